#!/usr/bin/env bash
# Backlog benchmark (issue 3): publish N persistent 1 KB messages with no consumer, restart the broker
# with the backlog waiting, then consume them all. Reports publish and consume rates, peak RSS in each
# phase, disk use before and after the drain, and the restart time.
#
# Usage: bench/backlog.sh [N]          (default 10000000)
# Env:   CLIENT=perftest|warren        load generator (default: warren bench if built, else PerfTest)
#        OUT=dir                       where logs go (default target/bench-backlog)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-10000000}
OUT=${OUT:-target/bench-backlog}
PORT=${PORT:-5698}
BIN=target/release/warren
DATA=$OUT/data
mkdir -p "$OUT"; rm -rf "$DATA"
URI="amqp://guest:guest@127.0.0.1:$PORT/%2F"
CLIENT=${CLIENT:-$($BIN bench --help >/dev/null 2>&1 && echo warren || echo perftest)}
PERFTEST_LIB=${PERFTEST_LIB:-$HOME/.cache/warren/perftest/lib}

start_broker() {
  local t0; t0=$(date +%s.%N)
  $BIN server --amqp-port "$PORT" --http-port $((PORT + 1)) --prometheus-port $((PORT + 2)) --data-dir "$DATA" >>"$OUT/warren.log" 2>&1 &
  PID=$!
  until (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null; do sleep 0.02; done
  READY_S=$(echo "$(date +%s.%N) - $t0" | bc)
}

# Samples the broker's RSS every 200 ms into $1 until the file $1.stop exists.
sample_rss() {
  local f=$1; : > "$f"; rm -f "$f.stop"
  while [ ! -e "$f.stop" ] && kill -0 "$PID" 2>/dev/null; do
    awk '/VmRSS/{print $2}' /proc/$PID/status >> "$f" 2>/dev/null || true; sleep 0.2
  done
}
peak_mb() { sort -n "$1" | tail -1 | awk '{printf "%.0f", $1/1024}'; }
disk_mb() { du -sb "$DATA" | awk '{printf "%.0f", $1/1048576}'; }

publish() {
  if [ "$CLIENT" = warren ]; then
    $BIN bench --uri "$URI" --producers 1 --consumers 0 --confirm 1000 --persistent --size 1000 \
      --pmessages "$N" --queue backlog --json "$OUT/publish.json" > "$OUT/publish.txt" 2>/dev/null
    PUB_RATE=$(python3 -c "import json;print(round(json.load(open('$OUT/publish.json'))['confirm_rate']))")
  else
    java -Xmx2g -cp "$PERFTEST_LIB/*" com.rabbitmq.perf.PerfTest -h "$URI" -x 1 -y 0 -s 1000 -f persistent \
      -c 1000 -u backlog -ad false -C "$N" > "$OUT/publish.txt" 2>&1
    PUB_RATE=$(grep -oP 'sending rate avg: \K[0-9]+' "$OUT/publish.txt")
  fi
}

consume() {
  if [ "$CLIENT" = warren ]; then
    $BIN bench --uri "$URI" --producers 0 --consumers 1 --prefetch 1000 --multi-ack-every 100 \
      --cmessages "$N" --queue backlog --predeclared --json "$OUT/consume.json" > "$OUT/consume.txt" 2>/dev/null
    CON_RATE=$(python3 -c "import json;print(round(json.load(open('$OUT/consume.json'))['consume_rate']))")
  else
    java -Xmx2g -cp "$PERFTEST_LIB/*" com.rabbitmq.perf.PerfTest -h "$URI" -x 0 -y 1 -q 1000 \
      --multi-ack-every 100 -u backlog -p -D "$N" > "$OUT/consume.txt" 2>&1
    CON_RATE=$(grep -oP 'receiving rate avg: \K[0-9]+' "$OUT/consume.txt")
  fi
}

start_broker
sample_rss "$OUT/rss-publish" & S=$!
T0=$(date +%s.%N); publish; PUB_S=$(echo "$(date +%s.%N) - $T0" | bc)
touch "$OUT/rss-publish.stop"; wait $S
DISK_FULL=$(disk_mb)

kill -TERM "$PID"; wait "$PID" || true
start_broker; RESTART_CLEAN=$READY_S
kill -9 "$PID"; wait "$PID" 2>/dev/null || true
start_broker; RESTART_KILL9=$READY_S

sample_rss "$OUT/rss-consume" & S=$!
T0=$(date +%s.%N); consume; CON_S=$(echo "$(date +%s.%N) - $T0" | bc)
touch "$OUT/rss-consume.stop"; wait $S
sleep 3 # a quiet second lets a checkpoint reclaim the WAL and consumed queue files
DISK_DRAINED=$(disk_mb)
kill -TERM "$PID"; wait "$PID" || true

cat <<REPORT | tee "$OUT/report.md"
| backlog of $N × 1 KB persistent ($CLIENT client) | value |
|---|---|
| publish rate (confirmed) | $PUB_RATE msg/s (${PUB_S%.*} s) |
| peak RSS while publishing | $(peak_mb "$OUT/rss-publish") MB |
| disk use with the backlog | $DISK_FULL MB |
| restart with the backlog (SIGTERM, then start until accepting) | ${RESTART_CLEAN} s |
| restart with the backlog (kill -9, then start until accepting) | ${RESTART_KILL9} s |
| consume rate | $CON_RATE msg/s (${CON_S%.*} s) |
| peak RSS while consuming | $(peak_mb "$OUT/rss-consume") MB |
| disk use after the drain | $DISK_DRAINED MB |
REPORT
