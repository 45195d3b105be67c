#!/usr/bin/env bash
# CMQ's HTTP API under load, with the broker's CPU per message (BENCHMARKS.md, "CMQ's HTTP API").
#
#   bench/cmq.sh send    [BIN]   16 clients BatchSendMessage 16 x 1 KB for 10 s
#   bench/cmq.sh receive [BIN]   a 10 s fill as above, then 16 clients BatchReceive + BatchDelete for 8 s
#
# BIN is the broker to measure (default target/release/warren); the client is always this tree's
# `warren bench --cmq`, so an A/B of two brokers runs the same client. Each run starts the broker on
# a fresh data directory (ports 5790, 15790, 15791) and stops it after. Broker CPU is user + system
# from /proc/PID/stat over the measured part; divide by the messages sent or received.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-send}
BIN=${2:-target/release/warren}
CLIENT=target/release/warren
DATA=$(mktemp -d /tmp/warren-cmq-bench.XXXX)
"$BIN" server --data-dir "$DATA" --amqp-port 5790 --http-port 15790 --prometheus-port 15791 > "$DATA.log" 2>&1 &
BROKER=$!
trap 'kill $BROKER 2>/dev/null; wait $BROKER 2>/dev/null; rm -rf "$DATA" "$DATA.log"' EXIT
for _ in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:15790/ && break; sleep 0.1; done
ticks() { awk '{print $14 + $15}' "/proc/$BROKER/stat"; }
bench() { "$CLIENT" bench --cmq http://127.0.0.1:15790 --progress-every 0 --size 1000 "$@"; }
case "$MODE" in
  send)
    before=$(ticks)
    bench --producers 16 --consumers 0 --time 10 | grep -E '"sent"|p99'
    ;;
  receive)
    bench --producers 16 --consumers 0 --time 10 | grep -E '"sent"'
    before=$(ticks)
    bench --producers 0 --consumers 16 --time 8 | grep -E '"received"|p99'
    ;;
  *) echo "usage: $0 send|receive [BIN]" >&2; exit 2 ;;
esac
hz=$(getconf CLK_TCK)
echo "broker CPU: $(( ($(ticks) - before) * 1000 / hz )) ms"
