#!/usr/bin/env bash
# Checks the broker crate's layering (docs/internals/time-plan.md, section 1): a module names no
# module above it. Today: the queue kinds know no vhost, exchange or routing; the definitions are
# plain data; the delay store knows no vhost by path. The channel side (channel, consumers, sink,
# publisher, direct_reply) still imports the queue and back: listed in the plan as the next cut.
# Code under `#[cfg(test)]` is not checked. Run by `make test`.
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
            # Outside tests and comments.
            if sed '/#\[cfg(test)\]/,$d' "$f" | grep -v '^\s*//' | grep -q "crate::$m\b"; then
                echo "check-layers: $f names crate::$m, a module above it" >&2
                fail=1
            fi
        done
    done
}
check $(find queue -name '*.rs') -- vhost exchange routing definitions::restore broker metadata delay
check definitions.rs -- vhost queue exchange channel
check $(find delay -name '*.rs') -- vhost broker
check names.rs deadletter.rs message.rs queue_args.rs error.rs routing.rs stats.rs -- vhost queue exchange channel consumers publisher
exit $fail
