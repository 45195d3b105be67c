#!/usr/bin/env bash
# Installs what the end-to-end tests need on a fresh Debian machine. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
# cryptography: tests/python/test_tls.py makes its certificates with it.
python3 -c "import pika, pytest, pytest_timeout, xdist, requests, cmq.account, selenium, cryptography" 2>/dev/null || python3 -m pip install -q pika pytest pytest-timeout pytest-xdist requests qcloud-cmq-sdk-py3 selenium cryptography
(cd tests/go && go mod download)
# Fault tests (tests/cluster): `ip` and `tc` (iproute2) make the network namespaces and cut links.
if { ! command -v ip >/dev/null || ! command -v tc >/dev/null; } && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get update -q && apt-get install -y -q iproute2; } || echo "install-test-deps: could not install iproute2 (tests/cluster will skip)" >&2
fi
# The HTTP tests (tests/python/test_http_management.py): Debian's rabbitmqadmin (in rabbitmq-server),
# promtool and prometheus (in prometheus). Installed without starting their services' defaults mattering:
# the tests run their own Prometheus on a free port.
if { ! command -v rabbitmqadmin >/dev/null || ! command -v prometheus >/dev/null; } && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q rabbitmq-server prometheus; } \
    || echo "install-test-deps: could not install rabbitmq-server/prometheus (HTTP tests that need them skip)" >&2
fi
# The web UI's test (tests/python/test_http_ui.py): Debian's chromium, headless, driven by its chromedriver.
if { ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; } && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } \
    || echo "install-test-deps: could not install chromium/chromium-driver (the UI test skips)" >&2
fi
if command -v java >/dev/null && command -v mvn >/dev/null; then
  bash scripts/install-perftest.sh
fi
# Fuzzing (scripts/fuzz.sh): cargo-fuzz and the nightly toolchain it builds with. If either cannot be
# installed here, scripts/fuzz.sh says which is missing and fails `make test`.
if command -v rustup >/dev/null && ! rustup toolchain list | grep -q '^nightly'; then
  rustup toolchain install nightly --profile minimal || echo "install-test-deps: could not install the nightly toolchain" >&2
fi
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked || echo "install-test-deps: could not install cargo-fuzz" >&2
