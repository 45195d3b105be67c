#!/usr/bin/env bash
# Many-queues benchmark (issue 3): PerfTest publishing with confirms to 1,000 durable queues (1,000
# producers, 1,000 consumers: PerfTest gives each producer one queue), against one queue with one
# producer and one consumer; reports PerfTest's rates, the store's fsyncs per second (from the
# broker's "store activity" log line, every 10 s) and the broker's peak RSS.
#
# Usage: bench/many-queues.sh [seconds]      (default 30 per run)
set -euo pipefail
cd "$(dirname "$0")/.."
T=${1:-30}
OUT=${OUT:-target/bench-many-queues}
PORT=${PORT:-5696}
BIN=target/release/warren
PERFTEST_LIB=${PERFTEST_LIB:-$HOME/.cache/warren/perftest/lib}
URI="amqp://guest:guest@127.0.0.1:$PORT/%2F"
mkdir -p "$OUT"

run() { # label, PerfTest args...
  local label=$1; shift
  rm -rf "$OUT/data"
  $BIN server --amqp-port "$PORT" --http-port $((PORT + 1)) --prometheus-port $((PORT + 2)) --data-dir "$OUT/data" >"$OUT/$label.log" 2>&1 &
  local pid=$!
  until (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null; do sleep 0.05; done
  (while kill -0 "$pid" 2>/dev/null; do ps -o rss= -p "$pid"; sleep 0.5; done) >"$OUT/$label.rss" 2>/dev/null &
  java -Xmx2g -cp "$PERFTEST_LIB/*" com.rabbitmq.perf.PerfTest -h "$URI" -z "$T" -s 1000 -f persistent "$@" \
    >"$OUT/$label.perftest" 2>&1 || true
  kill "$pid"; wait "$pid" 2>/dev/null || true
  local sent received fsyncs
  sent=$(grep -o 'sending rate avg: [0-9]*' "$OUT/$label.perftest" | grep -o '[0-9]*$' || echo "?")
  received=$(grep -o 'receiving rate avg: [0-9]*' "$OUT/$label.perftest" | grep -o '[0-9]*$' || echo "?")
  fsyncs=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/$label.log" | grep -o 'fsyncs_per_s=[0-9.]*' | cut -d= -f2 | tr '\n' ' ')
  local rss_mb
  rss_mb=$(( $(sort -n "$OUT/$label.rss" | tail -1) / 1024 ))
  echo "| $label | $sent | $received | $fsyncs | $rss_mb |"
}

echo "| run | publish msg/s | consume msg/s | fsyncs/s (each 10 s) | peak RSS MB |"
echo "|---|---|---|---|---|"
run one-queue -x 1 -y 1 -c 1000 -q 1000 --multi-ack-every 100 -u mq-single
run 1000-queues --queue-pattern 'mq-%d' --queue-pattern-from 1 --queue-pattern-to 1000 -x 1000 -y 1000 \
  -c 100 -q 100 --multi-ack-every 10
