#!/usr/bin/env bash
# Warren against RabbitMQ on this machine: installs what is needed (RabbitMQ from Debian, PerfTest from
# Maven Central, pika and matplotlib from PyPI), builds Warren, runs every workload against both brokers
# and rewrites BENCHMARKS.md and the charts in bench/. Usage: bench/run.sh [--quick] [--only A,B,...]
# bench/run.sh --cluster [--quick] [...]: three nodes of each instead (bench/cluster.py, issue 10): rewrites
# the section "Three nodes (issue 10)" of BENCHMARKS.md and bench/cluster-results.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ANCHORS=${ANCHORS:-$(cd .. && pwd)/shared/anchors}
if ! command -v rabbitmq-server >/dev/null && [ ! -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
  apt-get update -q
  bash "$ANCHORS/install_rabbitmq.sh"
fi
bash scripts/install-perftest.sh
python3 -c "import pika, matplotlib" 2>/dev/null || python3 -m pip install -q pika matplotlib
cargo build --release
if [ "${1:-}" = "--cluster" ]; then
  shift
  ANCHORS=$ANCHORS exec python3 bench/cluster.py "$@"
fi
ANCHORS=$ANCHORS python3 bench/run.py "$@"
