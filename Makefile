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

test: deps build hooks
	cargo test --workspace --release --features warren-store/test-hooks,warren-cluster/test-hooks
	cargo build --release
	python3 -m pytest -q --timeout=120 tests/python
	python3 -m pytest -q --timeout=300 tests/cluster
	cd tests/go && go test ./... -count=1
	FUZZ_SEED=20261123 bash scripts/fuzz.sh 25

# Longer fuzzing: `make fuzz FUZZ_SECONDS=600`.
FUZZ_SECONDS ?= 300
fuzz:
	bash scripts/fuzz.sh $(FUZZ_SECONDS)
