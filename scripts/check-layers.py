#!/usr/bin/env python3
"""Checks the broker crate's layering (docs/internals/time-plan.md, section 1): no module names a
module above it, so the crate's modules import each other in no circle. From the bottom:

    error, auth, message, stats, routing, names, queue_args, quorum (the machine), definitions,
    deadletter, sink -> publisher -> queue (classic, quorum, remote) -> direct_reply, delay
    -> channel, exchange -> deadletter_confirms -> metadata -> vhost -> broker

A module below reaches one above only through a trait the one above implements: the queue asks its
vhost through `QueueHost` and delivers through `DeliverySink` (queue/types.rs), the sink kicks a
channel through `Kick`, direct reply-to delivers through `ReplyTarget`, the delay timer asks the
broker through `DueHost`. Inside the crate, items are named by their module (`crate::queue::Queue`),
never by the crate root's re-exports (`crate::Queue`), which would hide the module.

Every path naming the crate is checked: `crate::m`, `use crate::{.., m::{..}, ..}` groups over any
number of lines, `super::` chains climbing out of a module. Comments and code from a module's first
`#[cfg(test)]` on are not checked (tests may use anything). Run by `make test`; exits 1 on a
violation, naming it.
"""
import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "crates" / "broker" / "src"

# Each layer, bottom first: a module may name modules of its own layer or below.
LAYERS = [
    ["error", "auth", "message", "stats", "routing", "names", "queue_args", "quorum", "definitions", "deadletter", "blocking", "sink"],
    ["publisher"],
    ["queue", "consumers"],  # `consumers` is the queue's, re-exported at the crate root
    ["direct_reply", "delay"],
    ["channel", "exchange"],
    ["deadletter_confirms"],
    ["metadata"],
    ["vhost"],
    ["broker"],
]
LEVEL = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def top_module(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".rs")


def code_of(path: Path) -> str:
    text = path.read_text()
    cut = text.find("#[cfg(test)]")
    if cut >= 0:
        text = text[:cut]
    text = re.sub(r"//[^\n]*", "", text)  # comments (doc comments too)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"\s+", "", text)  # one line, no spaces: `crate :: x` and groups over lines read as one


def named_modules(code: str):
    """The crate's top modules (and root re-exports, as `<root>`) a file's code names."""
    found = set()
    i = 0
    while True:
        i = code.find("crate::", i)
        if i < 0:
            return found
        j = i + len("crate::")
        if code.startswith("{", j):
            # A group: every first segment inside it at depth one.
            depth, k, start = 0, j, j + 1
            while k < len(code):
                if code[k] == "{":
                    depth += 1
                elif code[k] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                k += 1
            inner = code[start:k]
            depth, part, parts = 0, "", []
            for ch in inner:
                if ch == "," and depth == 0:
                    parts.append(part)
                    part = ""
                    continue
                depth += ch == "{"
                depth -= ch == "}"
                part += ch
            parts.append(part)
            for p in parts:
                m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", p)
                if m:
                    found.add(m.group(0) if m.group(0)[0].islower() else "<root>")
            i = k
        else:
            m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", code[j:])
            if m:
                found.add(m.group(0) if m.group(0)[0].islower() else "<root>")
            i = j


def main() -> int:
    failures = []
    for path in sorted(SRC.rglob("*.rs")):
        if path.name == "lib.rs" and path.parent == SRC:
            continue
        me = top_module(path)
        code = code_of(path)
        for m in named_modules(code):
            if m == "<root>":
                failures.append(f"{path.relative_to(SRC)} names a crate-root re-export (crate::X): name it by its module")
            elif m in LEVEL and me in LEVEL and LEVEL[m] > LEVEL[me]:
                failures.append(f"{path.relative_to(SRC)} ({me}) names crate::{m}, a module above it")
            elif m not in LEVEL and m not in ("now_ms", "run_id"):
                failures.append(f"{path.relative_to(SRC)} names crate::{m}, which is in no layer: add it to LAYERS")
        if me not in LEVEL:
            failures.append(f"{path.relative_to(SRC)}: module {me} is in no layer: add it to LAYERS")
        # `super::` chains climbing out of the top module reach the crate root.
        depth = len(path.relative_to(SRC).parts) - (1 if path.name == "mod.rs" else 0)
        for chain in re.findall(r"(?:super::)+", code):
            if chain.count("super::") >= depth:
                failures.append(f"{path.relative_to(SRC)} climbs to the crate root with {chain}")
    for f in failures:
        print(f"check-layers: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
