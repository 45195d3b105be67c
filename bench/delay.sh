#!/usr/bin/env bash
# Delayed delivery (issue 36, BENCHMARKS.md "Time in queues"), side by side in one sitting:
# Warren's x-delayed-message exchange vs RabbitMQ's usual substitute on this machine (Debian's
# RabbitMQ 3.10 has no delayed-message plugin): a queue `delay.MS` with x-message-ttl MS
# dead-lettering into `target`. 1 KB persistent messages with confirms (1000 in flight), one
# producer and one consumer (prefetch 1000, a multiple ack every 100), each for SECONDS, unlimited
# and then at RATE msg/s. Lateness = delivery time - (send time + MS), from `warren bench`'s
# end-to-end latency with --delay-ms; `early` counts deliveries before that.
#
#   bench/delay.sh [MS] [SECONDS] [RATE] [BIN]     (defaults 1000, 30, 10000)
#
# Needs RabbitMQ on 5672 (../shared/anchors/start_cluster.sh 1); Warren runs on a fresh data
# directory (ports 5794, 15796, 15797).
set -euo pipefail
cd "$(dirname "$0")/.."
MS=${1:-1000}
SECONDS_EACH=${2:-30}
RATE=${3:-10000}
BIN=${4:-target/release/warren}
CLIENT=target/release/warren
DATA=$(mktemp -d /tmp/warren-delay-bench.XXXX)
"$BIN" server --data-dir "$DATA" --amqp-port 5794 --http-port 15796 --prometheus-port 15797 > "$DATA.log" 2>&1 &
BROKER=$!
trap 'kill $BROKER 2>/dev/null; wait $BROKER 2>/dev/null; rm -rf "$DATA" "$DATA.log"' EXIT
for _ in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:15796/ && break; sleep 0.1; done
bench() {
  "$CLIENT" bench --progress-every 0 --size 1000 --persistent --confirm 1000 --prefetch 1000 --multi-ack-every 100 \
    --delay-ms "$MS" --time "$SECONDS_EACH" "$@"
}
summary() { grep -E ' (sent|consumed) |end-to-end|early'; }
# RabbitMQ's queues from an earlier run would hand their old messages to this one's consumer.
python3 -c '
import pika
ch = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2F")).channel()
for rate in ("0", "'"$RATE"'"):
    for q in ("target-" + rate, "delay.'"$MS"'-" + rate):
        ch.queue_delete(q)'

for rate in 0 "$RATE"; do
  echo "== rate ${rate} (0: unlimited), x-delay ${MS} ms, ${SECONDS_EACH} s =="
  echo "-- Warren: x-delayed-message exchange"
  bench --uri amqp://guest:guest@127.0.0.1:5794/%2F --exchange delayed --exchange-type x-delayed-message \
    --queue "target-$rate" --producers 1 --consumers 1 --rate "$rate" | summary
  echo "-- RabbitMQ: delay.${MS} (x-message-ttl, dead-lettered into target)"
  bench --uri amqp://guest:guest@127.0.0.1:5672/%2F --queue "target-$rate" --producers 0 --consumers 1 > /tmp/delay-rmq-consumer.txt &
  CONSUMER=$!
  sleep 1
  bench --uri amqp://guest:guest@127.0.0.1:5672/%2F --queue "delay.$MS-$rate" --producers 1 --consumers 0 --rate "$rate" \
    --queue-args "x-message-ttl=$MS,x-dead-letter-exchange=,x-dead-letter-routing-key=target-$rate" | summary
  wait $CONSUMER || true
  summary < /tmp/delay-rmq-consumer.txt
done
echo "Warren RSS: $(awk '/VmHWM/ {print $2, $3}' /proc/$BROKER/status) peak"
