# `make test` installs what the tests need and runs every test: Rust unit tests, then the
# end-to-end suites against the real binary (pika, amqp091-go, PerfTest; tests/cluster: nodes in network
# namespaces, skipped without root), then a short run of every
# fuzz target (scripts/fuzz.sh: 25 s each with a fixed seed, so CI is reproducible; cargo-fuzz on nightly).
.PHONY: test build hooks deps fuzz
build:
	cargo build --release

# The broker with the WARREN_TEST_* switches (a slow fsync, the power-loss simulator, small budgets)
# as `target/release/warren-hooks`, for the tests that use them; `target/release/warren`, the release
# binary, reads none (built again last: both builds write that path).
hooks:
	cargo build --release -p warren-server --features test-hooks
	cp target/release/warren target/release/warren-hooks
	cargo build --release

deps:
	bash scripts/install-test-deps.sh

# Each step is timed and pytest names its slowest tests, so a CI log shows where the time goes
# (CI must stay under 45 minutes on a 2-core machine). tests/python runs on three workers (its tests
# mostly wait on brokers: 15.5 minutes serial, 5.6 on three); tests/cluster stays serial (its network
# namespaces and fault timings are machine-wide).
test: SHELL := /bin/bash
test: deps build hooks
	python3 scripts/check-layers.py
	time cargo test --workspace --release --features warren-store/test-hooks,warren-cluster/test-hooks
	cargo build --release
	time python3 -m pytest -q --timeout=120 --durations=25 -n 3 tests/python
	time python3 -m pytest -q --timeout=300 --durations=10 tests/cluster
	time (cd tests/go && go test ./... -count=1)
	time FUZZ_SEED=20261123 bash scripts/fuzz.sh 25

# Longer fuzzing: `make fuzz FUZZ_SECONDS=600`.
FUZZ_SECONDS ?= 300
fuzz:
	bash scripts/fuzz.sh $(FUZZ_SECONDS)
