#!/usr/bin/env python3
"""The management API and the Prometheus scrape with many queues, Warren next to RabbitMQ on this
machine: `GET /api/queues` and a scrape of `/metrics` and `/metrics/per-object` with N queues
(10,000 by default), each holding one message. Prints a table of medians and ratios.

    python3 bench/http-api.py                       # RabbitMQ from ../shared/anchors, Warren from target/release
    python3 bench/http-api.py --queues 1000 --reps 3
    WARREN_BIN=/path/to/warren python3 bench/http-api.py --brokers warren
    python3 bench/http-api.py --brokers warren --under-load 20   # + the scrape's cost under load

RabbitMQ runs with the management and prometheus plugins (`PLUGINS=... start_cluster.sh 1`: AMQP
5672, HTTP 15672, metrics 15692); Warren on AMQP 5682, HTTP 15682, metrics 15683."""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pika
import requests

ROOT = Path(__file__).resolve().parent.parent
ANCHORS = ROOT.parent / "shared" / "anchors"
BIN = os.environ.get("WARREN_BIN", str(ROOT / "target" / "release" / "warren"))
AUTH = ("guest", "guest")


def declare_queues(amqp_port, n, prefix):
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", amqp_port, credentials=pika.PlainCredentials(*AUTH)))
    ch = conn.channel()
    for i in range(n):
        ch.queue_declare(f"{prefix}{i}", durable=True)
        ch.basic_publish("", f"{prefix}{i}", b"x" * 100, pika.BasicProperties(delivery_mode=2))
    conn.close()


def timed(url, reps, auth=None):
    times, size = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        r = requests.get(url, auth=auth, timeout=600)
        times.append(time.perf_counter() - t0)
        r.raise_for_status()
        size = len(r.content)
    return statistics.median(times), size


def run(name, amqp, http, prom, args):
    declare_queues(amqp, args.queues, "bench-http-")
    # The queue list must be complete before timing (RabbitMQ's stats are emitted every 5 s).
    deadline = time.time() + 120
    while time.time() < deadline:
        n = len(requests.get(f"http://127.0.0.1:{http}/api/queues?columns=name", auth=AUTH, timeout=600).json())
        if n >= args.queues:
            break
        time.sleep(2)
    time.sleep(6)
    return {
        "GET /api/queues": timed(f"http://127.0.0.1:{http}/api/queues", args.reps, AUTH),
        "GET /metrics": timed(f"http://127.0.0.1:{prom}/metrics", args.reps),
        "GET /metrics/per-object": timed(f"http://127.0.0.1:{prom}/metrics/per-object", args.reps),
    }


def cpu_seconds(pid):
    """User + system CPU of a process so far, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_rate(amqp, seconds):
    """`warren bench` workload A (1 producer with confirms, 1 consumer) on a queue of its own: msg/s."""
    import json
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([BIN, "bench", "--uri", f"amqp://guest:guest@127.0.0.1:{amqp}/%2F", "--producers", "1", "--consumers", "1",
                        "--confirm", "1000", "--multi-ack-every", "100", "--time", str(seconds), "--queue", "bench-load",
                        "--progress-every", "0", "--json", f.name], capture_output=True, check=True)
        summary = json.loads(Path(f.name).read_text())
    return summary["consume_rate"]


def under_load(pid, amqp, prom, seconds):
    """What a per-object scrape costs the broker: its CPU per scrape when idle (the same work under
    load), and under workload A the scrape's latency and the workload's rate with and without a
    scrape every second (15 times Prometheus's usual interval)."""
    url = f"http://127.0.0.1:{prom}/metrics/per-object"
    before = cpu_seconds(pid)
    for _ in range(20):
        requests.get(url, timeout=60).raise_for_status()
    per_scrape = (cpu_seconds(pid) - before) / 20
    quiet = bench_rate(amqp, seconds)
    import threading
    stop, latencies = threading.Event(), []

    def scrape():
        while not stop.wait(1.0):
            t0 = time.perf_counter()
            requests.get(url, timeout=60).raise_for_status()
            latencies.append(time.perf_counter() - t0)

    t = threading.Thread(target=scrape)
    t.start()
    scraped = bench_rate(amqp, seconds)
    stop.set()
    t.join()
    print(f"per-object scrape: broker CPU {per_scrape * 1000:.1f} ms each when idle = {per_scrape / 15 * 100:.2f}% of a core at a 15 s interval; "
          f"under workload A: scrape median {statistics.median(latencies):.3f} s, max {max(latencies):.3f} s ({len(latencies)} scrapes); "
          f"workload A {quiet:,.0f} msg/s without scrapes, {scraped:,.0f} msg/s with one every second", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--queues", type=int, default=10000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--brokers", default="warren,rabbitmq")
    p.add_argument("--under-load", type=float, default=0, metavar="SECONDS",
                   help="Warren only: also measure the scrape's CPU and its effect on a workload of SECONDS")
    args = p.parse_args()
    print(f"started {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}", flush=True)
    results = {}
    brokers = args.brokers.split(",")
    if "warren" in brokers:
        data = tempfile.mkdtemp(prefix="warren-http-bench-")
        proc = subprocess.Popen([BIN, "server", "--amqp-port", "5682", "--http-port", "15682", "--prometheus-port", "15683",
                                 "--data-dir", data], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                try:
                    requests.get("http://127.0.0.1:15682/api/overview", auth=AUTH, timeout=1)
                    break
                except requests.ConnectionError:
                    time.sleep(0.1)
            results["warren"] = run("warren", 5682, 15682, 15683, args)
            if args.under_load:
                under_load(proc.pid, 5682, 15683, args.under_load)
        finally:
            proc.terminate()
            proc.wait(30)
            shutil.rmtree(data, ignore_errors=True)
    if "rabbitmq" in brokers:
        # A fresh node: state left by an earlier cluster run would have it wait for its old peers.
        base = tempfile.mkdtemp(prefix="warren-http-bench-rabbitmq-")
        env = dict(os.environ, PLUGINS="rabbitmq_management,rabbitmq_prometheus", BASE=base)
        subprocess.run(["bash", str(ANCHORS / "start_cluster.sh"), "1"], env=env, check=True)
        try:
            results["rabbitmq"] = run("rabbitmq", 5672, 15672, 15692, args)
        finally:
            subprocess.run(["bash", str(ANCHORS / "stop_cluster.sh")], env=env, check=False)
            shutil.rmtree(base, ignore_errors=True)
    print(f"\n{args.queues} queues, median of {args.reps}")
    print("| request | " + " | ".join(f"{b} (s, bytes)" for b in results) + (" | RabbitMQ / Warren |" if len(results) == 2 else " |"))
    print("|---|" + "---|" * (len(results) + (1 if len(results) == 2 else 0)))
    for req in next(iter(results.values())):
        cells = [f"{results[b][req][0]:.3f}, {results[b][req][1]:,}" for b in results]
        ratio = f" | {results['rabbitmq'][req][0] / results['warren'][req][0]:.1f}x" if len(results) == 2 else ""
        print(f"| {req} | " + " | ".join(cells) + ratio + " |")


if __name__ == "__main__":
    sys.exit(main())
