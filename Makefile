# `make test` installs what the tests need and runs every test: Rust unit tests, then the
# end-to-end suites against the real binary (pika, amqp091-go, PerfTest).
.PHONY: test build deps
build:
	cargo build --release

deps:
	bash scripts/install-test-deps.sh

test: deps build
	cargo test --workspace --release
	python3 -m pytest -q --timeout=120 tests/python
	cd tests/go && go test ./... -count=1
