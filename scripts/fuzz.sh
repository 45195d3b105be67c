#!/usr/bin/env bash
# Runs Warren's cargo-fuzz targets (fuzz/) one after another, SECONDS each (default 25), and prints
# each one's figures. Fails if a target finds a crash (the input is saved under
# fuzz/artifacts/<target>/) or if the tools are missing: cargo-fuzz needs the nightly toolchain, and a
# machine without it fails here loudly rather than skipping the fuzzing.
#
#   scripts/fuzz.sh                  # every target, 25 s each (what `make test` runs)
#   scripts/fuzz.sh 600 frames       # one target, 10 minutes
#
# The seeds in fuzz/corpus/<target>/ are read, never written: inputs a run finds are kept in
# fuzz/target/corpus/<target>/ (not in git) and reused by the next run on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-25}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(frames methods properties field_tables store_recovery metadata_recovery quorum_machine classic_wire http_api)
fi

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  echo "fuzz.sh: the Rust nightly toolchain is not installed; cargo-fuzz needs it." >&2
  echo "fuzz.sh: install it with 'rustup toolchain install nightly' (scripts/install-test-deps.sh does)." >&2
  exit 1
fi
if ! command -v cargo-fuzz >/dev/null; then
  echo "fuzz.sh: cargo-fuzz is not installed: run scripts/install-test-deps.sh" >&2
  exit 1
fi

# FUZZ_SEED fixes libFuzzer's random seed (what `make test` does), so a CI run explores the same
# inputs as a run of the same length here and is reproducible; unset, every run explores anew.
seed_arg=()
if [ -n "${FUZZ_SEED:-}" ]; then
  seed_arg=(-seed="$FUZZ_SEED")
fi

cargo +nightly fuzz build
for t in "${targets[@]}"; do
  corpus=fuzz/target/corpus/$t
  log=fuzz/target/fuzz-$t.log
  mkdir -p "$corpus"
  # -timeout: an input that takes 10 s is a hang (a loop that never ends), reported like a crash.
  if ! nice -n 10 cargo +nightly fuzz run "$t" "$corpus" "fuzz/corpus/$t" -- \
      -max_total_time="$seconds" -timeout=10 -print_final_stats=1 "${seed_arg[@]}" >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz.sh: $t FAILED (a crash or hang: the input is under fuzz/artifacts/$t/; or a build error): see $log" >&2
    exit 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  corp=$(grep -o 'corp: [0-9]*/[0-9]*[a-zA-Z]*' "$log" | tail -n 1 | cut -d' ' -f2)
  echo "fuzz: $t: ${runs} executions in ${seconds} s (${rate}/s), crashes: 0, corpus ${corp} (inputs/bytes)"
done
