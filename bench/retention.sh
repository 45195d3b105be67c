#!/usr/bin/env bash
# Disk held by a queue with retention (issue 36, BENCHMARKS.md "Retention: disk held"): a publisher
# at RATE msg/s of 1 KB persistent messages and a consumer keeping up, on a queue with
# x-retention-seconds RET, for TIME seconds; every 10 s the data directory's size (du) beside what
# the queue retains (the API's messages_retained). Then nothing runs: the retained messages' disk
# must be given back within a minute of their retention's end.
#
#   bench/retention.sh [RATE] [RET] [TIME] [BIN]     defaults 50000 60 120
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-50000}
RET=${2:-60}
TIME=${3:-120}
BIN=${4:-target/release/warren}
DATA=$(mktemp -d /tmp/warren-retention-bench.XXXX)
"$BIN" server --data-dir "$DATA" --amqp-port 5792 --http-port 15794 --prometheus-port 15795 > "$DATA.log" 2>&1 &
BROKER=$!
trap 'kill $BROKER 2>/dev/null; wait $BROKER 2>/dev/null; rm -rf "$DATA" "$DATA.log"' EXIT
for _ in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:15794/ && break; sleep 0.1; done
retained() { curl -s -u guest:guest http://127.0.0.1:15794/api/queues/%2F/kept | python3 -c 'import json,sys; print(json.load(sys.stdin).get("messages_retained", 0))'; }
sample() {
  local du_bytes kept
  du_bytes=$(du -sb "$DATA" | cut -f1)
  kept=$(retained)
  echo "t=${1}s  disk $((du_bytes / 1048576)) MiB  retained $kept msgs ($((kept * 1000 / 1048576)) MiB of bodies)  disk per retained message: $(( kept > 0 ? du_bytes / kept : 0 )) B"
}
target/release/warren bench --uri amqp://guest:guest@127.0.0.1:5792/%2F --queue kept --queue-args "x-retention-seconds=$RET" \
  --producers 1 --consumers 1 --rate "$RATE" --time "$TIME" --size 1000 --persistent --confirm 1000 --prefetch 1000 \
  --multi-ack-every 100 --progress-every 0 > "$DATA.bench" 2>&1 &
BENCH=$!
for t in $(seq 10 10 "$TIME"); do sleep 10; sample "$t"; done
wait $BENCH || true
grep -E ' (sent|consumed) ' "$DATA.bench"; rm -f "$DATA.bench"
echo "publishing stopped; the last messages' retention ends in ${RET} s:"
for t in $(seq 10 10 $((RET + 70))); do sleep 10; sample "+$t"; done
