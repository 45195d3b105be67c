#!/usr/bin/env bash
# Installs what the end-to-end tests need on a fresh Debian machine. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import pika, pytest, pytest_timeout" 2>/dev/null || python3 -m pip install -q pika pytest pytest-timeout
(cd tests/go && go mod download)
if command -v java >/dev/null && command -v mvn >/dev/null; then
  bash scripts/install-perftest.sh
fi
