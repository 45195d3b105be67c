#!/usr/bin/env bash
# Many pending delayed messages (issue 36, BENCHMARKS.md "Delayed delivery"): N messages of 1 KB
# with x-delay 3 h through an x-delayed-message exchange (2 producers, confirms), then the broker's
# RSS, kill -9 and the time until it listens again, and 2,000 messages due 8 s after their publish
# (published just before the kill) consumed meanwhile: their lateness while the recovered slots are
# being counted.
#
#   bench/delay-pending.sh [N] [BIN]     (default 10,000,000: 11 GB on disk)
#
# One broker on a fresh data directory (ports 5795, 15798, 15799).
set -u
cd "$(dirname "$0")/.."
N=${1:-10000000}
BIN=${2:-target/release/warren}
CLIENT=target/release/warren
DATA=$(mktemp -d /tmp/warren-delay-pending.XXXX)
start() { "$BIN" server --data-dir "$DATA" --amqp-port 5795 --http-port 15798 --prometheus-port 15799 >> "$DATA.log" 2>&1 & echo $!; }
B=$(start)
trap 'kill $B 2>/dev/null; rm -rf "$DATA" "$DATA.log"' EXIT
for _ in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:15798/ && break; sleep 0.1; done
bench() { "$CLIENT" bench --uri amqp://guest:guest@127.0.0.1:5795/%2F --size 1000 --persistent --exchange delayed --exchange-type x-delayed-message "$@"; }
delayed() { curl -s -u guest:guest "http://127.0.0.1:15798/api/queues/%2F/$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["messages_delayed"])'; }
bench --progress-every 10 --confirm 1000 --delay-ms 10800000 --queue target --producers 2 --consumers 0 --pmessages $((N / 2)) 2>&1 | grep -E " sent| confirmed"
echo "RSS with $N pending: $(awk '/VmRSS/ {print $2, $3}' /proc/$B/status); messages_delayed $(delayed target); on disk $(du -sh "$DATA" | cut -f1)"
bench --progress-every 0 --confirm 100 --delay-ms 8000 --queue soon --producers 1 --consumers 0 --pmessages 2000 2>&1 | grep -E " sent"
kill -9 "$B"; while kill -0 "$B" 2>/dev/null; do sleep 0.01; done
T0=$(date +%s.%N); B=$(start)
until (echo > /dev/tcp/127.0.0.1/5795) 2>/dev/null; do sleep 0.01; done
echo "kill -9 -> listening: $(echo "$(date +%s.%N) - $T0" | bc) s"
bench --progress-every 0 --prefetch 1000 --delay-ms 8000 --queue soon --predeclared --producers 0 --consumers 1 --cmessages 2000 --time 30 2>&1 | grep -E "consumed|end-to-end|early"
for _ in $(seq 300); do grep -q "delayed messages recovered" "$DATA.log" && break; sleep 1; done
grep "delayed messages recovered" "$DATA.log" | tail -1
echo "RSS after the recount: $(awk '/VmRSS/ {print $2, $3}' /proc/$B/status) (peak $(awk '/VmHWM/ {print $2, $3}' /proc/$B/status)); messages_delayed $(delayed target)"
