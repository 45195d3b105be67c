#!/usr/bin/env python3
"""Many idle connections (issue 9): starts `warren`, opens N AMQP connections that complete the
handshake and then stay idle, and reports the broker's resident memory (VmRSS) before and after.

Usage: bench/many-connections.py [--connections 10000] [--max-rss-mb M]
  --max-rss-mb: exit 1 if the broker's RSS with all connections open is above M (for CI).
Raises its own and the broker's open-file limit (ulimit -n) to the hard limit; each connection needs
one file descriptor on each side.
"""
import argparse
import asyncio
import os
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"


def method_frame(channel, class_id, method_id, args=b""):
    payload = struct.pack(">HH", class_id, method_id) + args
    return struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce"


def shortstr(s):
    return bytes([len(s)]) + s.encode()


START_OK = method_frame(0, 10, 11, struct.pack(">I", 0) + shortstr("PLAIN") + struct.pack(">I", 12)
                        + b"\x00guest\x00guest" + shortstr("en_US"))
TUNE_OK = method_frame(0, 10, 31, struct.pack(">HIH", 2047, 131072, 0))  # no heartbeats: truly idle
OPEN = method_frame(0, 10, 40, shortstr("/") + shortstr("") + b"\x00")


async def read_method(reader):
    kind, _, size = struct.unpack(">BHI", await reader.readexactly(7))
    payload = await reader.readexactly(size + 1)
    return struct.unpack(">HH", payload[:4]) if kind == 1 else None


async def open_connection(port):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(PROTOCOL_HEADER)
    assert await read_method(reader) == (10, 10), "expected connection.start"
    writer.write(START_OK)
    assert await read_method(reader) == (10, 30), "expected connection.tune"
    writer.write(TUNE_OK + OPEN)
    assert await read_method(reader) == (10, 41), "expected connection.open-ok"
    return reader, writer


async def open_many(port, n, parallel=200):
    conns = []
    sem = asyncio.Semaphore(parallel)

    async def one():
        async with sem:
            for attempt in range(5):
                try:
                    conns.append(await open_connection(port))
                    return
                except (ConnectionError, OSError, asyncio.IncompleteReadError):
                    await asyncio.sleep(0.1 * (attempt + 1))
            raise RuntimeError("could not open a connection")

    await asyncio.gather(*(one() for _ in range(n)))
    return conns


def vm_rss_mb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def still_serves(port):
    """A new connection still completes its handshake and gets channel.open-ok."""
    reader, writer = await open_connection(port)
    writer.write(method_frame(1, 20, 10, shortstr("")))
    ok = await read_method(reader) == (20, 11)
    writer.close()
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--max-rss-mb", type=float, default=None)
    ap.add_argument("--bin", default=os.environ.get("WARREN_BIN", str(ROOT / "target/release/warren")))
    args = ap.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.connections + 200
    if hard != resource.RLIM_INFINITY and hard < need:
        sys.exit(f"the open-file hard limit is {hard}; {need} are needed (raise it, e.g. ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))  # inherited by the broker

    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        log = open(Path(data) / "warren.log", "wb")
        broker = subprocess.Popen(
            [args.bin, "server", "--amqp-port", str(port), "--http-port", str(free_port()), "--prometheus-port", "0",
             "--data-dir", str(Path(data) / "d")],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "WARREN_LOG": "warn"})
        try:
            deadline = time.time() + 15
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.time() > deadline or broker.poll() is not None:
                        sys.exit("warren did not start")
                    time.sleep(0.05)
            time.sleep(1.5)
            base = vm_rss_mb(broker.pid)
            started = time.time()
            conns = asyncio.run(run(port, args.connections, broker.pid))
            rss, serves, opened_in = conns
            per_conn_kib = (rss - base) * 1024 / args.connections
            print(f"{args.connections} idle connections: broker RSS {rss:.0f} MB "
                  f"(idle broker {base:.0f} MB, {per_conn_kib:.1f} KiB per connection); "
                  f"opened in {opened_in:.1f} s; a new connection still works: {serves}")
        finally:
            broker.kill()
            broker.wait()
    if not serves:
        sys.exit(1)
    if args.max_rss_mb is not None and rss > args.max_rss_mb:
        print(f"FAIL: RSS {rss:.0f} MB is above {args.max_rss_mb:.0f} MB")
        sys.exit(1)


async def run(port, n, pid):
    started = time.time()
    conns = await open_many(port, n)
    opened_in = time.time() - started
    # Idle connections give back their buffers after a second without traffic.
    await asyncio.sleep(3)
    rss = vm_rss_mb(pid)
    serves = await still_serves(port)
    for _, writer in conns:
        writer.close()
    return rss, serves, opened_in


if __name__ == "__main__":
    main()
