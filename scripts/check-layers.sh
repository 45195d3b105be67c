#!/usr/bin/env bash
# Checks the broker crate's layering (docs/internals/time-plan.md, section 1): no module names a
# module above it, so the crate's modules import each other in no circle. From the bottom:
#
#   error, message, stats, routing, names, queue_args, quorum (the machine), definitions, deadletter,
#   sink -> publisher -> queue (its kinds: classic, quorum, remote) -> direct_reply, delay
#   -> channel, exchange -> deadletter_confirms, metadata -> vhost -> broker
#
# A module below reaches one above only through a trait the one above implements: the queue asks
# its vhost through `QueueHost` and delivers through `DeliverySink` (queue/types.rs), the sink kicks
# a channel through `Kick`, direct reply-to delivers through `ReplyTarget`. Code under
# `#[cfg(test)]` and comments are not checked. Run by `make test`.
set -euo pipefail
cd "$(dirname "$0")/../crates/broker/src"
fail=0
check() { # check FILE... -- FORBIDDEN-MODULE...
    local files=() forbidden=()
    while [ "$1" != "--" ]; do files+=("$1"); shift; done
    shift
    forbidden=("$@")
    for f in "${files[@]}"; do
        for m in "${forbidden[@]}"; do
            # `crate::m` and `crate::{.., m, ..}` (one line), outside comments and tests.
            if sed '/#\[cfg(test)\]/,$d' "$f" | grep -v '^\s*//' | grep -Eq "crate::$m\b|crate::\{[^}]*\b$m\b"; then
                echo "check-layers: $f names crate::$m, a module above it" >&2
                fail=1
            fi
        done
    done
}
top=(vhost broker metadata deadletter_confirms)
check error.rs message.rs stats.rs routing.rs names.rs queue_args.rs definitions.rs deadletter.rs $(find quorum -name '*.rs') \
    -- "${top[@]}" channel exchange delay direct_reply queue publisher sink
check sink.rs -- "${top[@]}" channel exchange delay direct_reply queue publisher
check publisher.rs -- "${top[@]}" channel exchange delay direct_reply queue
check $(find queue -name '*.rs') -- "${top[@]}" channel exchange delay direct_reply
check direct_reply.rs $(find delay -name '*.rs') -- "${top[@]}" channel exchange
check channel.rs exchange.rs -- "${top[@]}"
exit $fail
