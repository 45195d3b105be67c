#!/usr/bin/env bash
# Rewind (issue 36, BENCHMARKS.md "Time in queues"): how long a rewind of N consumed messages takes
# to answer, and how fast the rewound messages are consumed next to the same number left as a
# backlog (row C's consume-only run).
#
#   bench/rewind.sh [N] [BIN] [TYPE]    N messages of 1 KB (default 1,000,000); TYPE classic
#                                        (default) or quorum (a group of one on this broker)
#
# One broker on a fresh data directory (ports 5791, 15792, 15793). Queue `rewound`
# (x-retention-seconds 3600) gets N persistent messages published with confirms and consumed as
# they come, then is rewound to 0 (clamped to the oldest kept) through the HTTP API; queue
# `backlog` gets N published with no consumer. Each is then drained by one consumer (prefetch
# 1000, a multiple ack every 100), timed by `warren bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000000}
BIN=${2:-target/release/warren}
TYPE=${3:-classic}
CLIENT=target/release/warren
DATA=$(mktemp -d /tmp/warren-rewind-bench.XXXX)
"$BIN" server --data-dir "$DATA" --amqp-port 5791 --http-port 15792 --prometheus-port 15793 > "$DATA.log" 2>&1 &
BROKER=$!
trap 'kill $BROKER 2>/dev/null; wait $BROKER 2>/dev/null; rm -rf "$DATA" "$DATA.log"' EXIT
for _ in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:15792/ && break; sleep 0.1; done
bench() {
  "$CLIENT" bench --uri amqp://guest:guest@127.0.0.1:5791/%2F --progress-every 0 --size 1000 --persistent \
    --prefetch 1000 --multi-ack-every 100 "$@"
}
echo "publish + consume $N on 'rewound' (retention 1 h):"
bench --queue rewound --queue-type "$TYPE" --queue-args x-retention-seconds=3600 --producers 1 --consumers 1 --confirm 1000 --pmessages "$N" | grep -E ' (sent|consumed) '
echo "rewind to 0:"
curl -s -u guest:guest -o /dev/stderr -w 'answered in %{time_total} s\n' -H 'content-type: application/json' \
  -d '{"to": 0}' http://127.0.0.1:15792/api/queues/%2F/rewound/rewind
echo
echo "consume the $N rewound:"
bench --queue rewound --predeclared --producers 0 --consumers 1 --cmessages "$N" | grep -E ' consumed '
echo "publish $N to 'backlog' (no consumer), then consume them:"
bench --queue backlog --queue-type "$TYPE" --producers 1 --consumers 0 --confirm 1000 --pmessages "$N" | grep -E ' sent '
bench --queue backlog --predeclared --producers 0 --consumers 1 --cmessages "$N" | grep -E ' consumed '
echo "broker RSS: $(awk '/VmHWM/ {print $2, $3}' /proc/$BROKER/status) peak"
