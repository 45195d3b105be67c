#!/usr/bin/env python3
"""Warren against RabbitMQ, side by side on this machine: runs the workloads of issue 4 against each
broker in turn (same client, same settings: durable queue, persistent 1 KB messages unless stated),
samples each broker's CPU time, and rewrites BENCHMARKS.md with tables, ratios and PNG charts.

    bench/run.sh            # installs what it needs, then runs this
    bench/run.py --quick    # shorter runs, for trying the script itself

Brokers: RabbitMQ from Debian's `rabbitmq-server` (started with ../shared/anchors/start_cluster.sh,
or $ANCHORS), Warren from target/release/warren. Clients: `warren bench` for every workload, RabbitMQ's
PerfTest for A, B and C as well.
"""
import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "target" / "release" / "warren"
OUT = ROOT / "target" / "bench"
ANCHORS = Path(os.environ.get("ANCHORS", ROOT.parent / "shared" / "anchors"))
ANCHOR_BASE = Path(os.environ.get("BASE", "/tmp/warren-anchors"))
PERFTEST_LIB = Path(os.environ.get("PERFTEST_LIB", Path.home() / ".cache/warren/perftest/lib"))
RABBIT_PORT = 5672
WARREN_PORT = 5682


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cpu_ticks(pids):
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def wait_port(port, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


class Warren:
    name = "Warren"

    def __init__(self):
        self.port = WARREN_PORT
        self.data = OUT / "warren-data"
        self.proc = None

    def start(self):
        shutil.rmtree(self.data, ignore_errors=True)
        self.proc = subprocess.Popen([str(BIN), "server", "--amqp-port", str(self.port), "--http-port", str(self.port + 1), "--prometheus-port", str(self.port + 2),
                                      "--data-dir", str(self.data)], stdout=open(OUT / "warren.log", "ab"), stderr=subprocess.STDOUT)
        wait_port(self.port)

    def pids(self):
        return [self.proc.pid]

    def rss_mb(self):
        return sum(rss_kb(p) for p in self.pids()) / 1024

    def stop(self):
        if self.proc:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)

    def version(self):
        return subprocess.run([str(BIN), "--version"], capture_output=True, text=True).stdout.strip()

    def delete_queues(self, prefix):
        delete_queues(self.port, prefix)


class RabbitMQ:
    name = "RabbitMQ"

    def __init__(self):
        self.port = RABBIT_PORT

    def start(self):
        subprocess.run(["bash", str(ANCHORS / "stop_cluster.sh")], capture_output=True)
        shutil.rmtree(ANCHOR_BASE / "nodes", ignore_errors=True)
        subprocess.run(["bash", str(ANCHORS / "start_cluster.sh"), "1"], check=True, capture_output=True)
        wait_port(self.port)

    def pids(self):
        out = subprocess.run(["pgrep", "-x", "beam.smp"], capture_output=True, text=True).stdout.split()
        return [int(p) for p in out]

    def rss_mb(self):
        return sum(rss_kb(p) for p in self.pids()) / 1024

    def stop(self):
        subprocess.run(["bash", str(ANCHORS / "stop_cluster.sh")], capture_output=True)

    def version(self):
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "rabbitmq-server"], capture_output=True, text=True).stdout
        return f"RabbitMQ {out.strip()}"

    def delete_queues(self, prefix):
        delete_queues(self.port, prefix)


def rss_kb(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def delete_queues(port, names):
    import pika
    c = pika.BlockingConnection(pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{port}/%2F"))
    for n in names:
        ch = c.channel()
        try:
            ch.queue_delete(n)
        except Exception:  # noqa: BLE001 - a missing queue is fine
            pass
    c.close()


def run_bench(broker, label, args, queues, timeout=900):
    """One `warren bench` run; returns its JSON summary plus broker CPU and memory."""
    out = OUT / f"{broker.name}-{label}.json"
    uri = f"amqp://guest:guest@127.0.0.1:{broker.port}/%2F"
    cmd = [str(BIN), "bench", "--uri", uri, "--progress-every", "0", "--json", str(out), *args]
    pids = broker.pids()
    cpu0, t0 = cpu_ticks(pids), time.time()
    peak = [broker.rss_mb()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while proc.poll() is None:
        time.sleep(0.5)
        peak.append(broker.rss_mb())
        if time.time() - t0 > timeout:
            proc.kill()
    text = proc.stdout.read()
    wall = time.time() - t0
    cpu = cpu_ticks(pids) - cpu0
    (OUT / f"{broker.name}-{label}.txt").write_text(" ".join(cmd) + "\n" + text)
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update(broker_cpu_s=cpu, wall_s=wall, broker_cores=cpu / max(wall, 1e-9), broker_rss_mb=max(peak),
                  exit=proc.returncode, command="warren bench " + " ".join(args))
    msgs = max(result.get("sent", 0), result.get("consumed", 0))
    result["broker_cpu_us_per_msg"] = cpu * 1e6 / msgs if msgs else None
    log(f"  {broker.name:8} {label:14} sent {result.get('send_rate', 0):>9.0f}/s  consumed {result.get('consume_rate', 0):>9.0f}/s  "
        f"confirm p50 {result.get('confirm_p50_us', 0)}µs  e2e p99 {result.get('e2e_p99_us', 0)}µs  broker {result['broker_cores']:.2f} cores")
    if queues:
        broker.delete_queues(queues)
    return result


def run_perftest(broker, label, args, queues, timeout=900):
    uri = f"amqp://guest:guest@127.0.0.1:{broker.port}/%2F"
    cmd = ["java", "-Xmx2g", "-cp", f"{PERFTEST_LIB}/*", "com.rabbitmq.perf.PerfTest", "-h", uri, *args]
    pids = broker.pids()
    cpu0, t0 = cpu_ticks(pids), time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    cpu = cpu_ticks(pids) - cpu0
    text = proc.stdout + proc.stderr
    (OUT / f"{broker.name}-perftest-{label}.txt").write_text(" ".join(cmd) + "\n" + text)
    grab = lambda pat: float(m.group(1)) if (m := re.search(pat, text)) else 0.0  # noqa: E731
    r = {"send_rate": grab(r"sending rate avg: (\d+)"), "consume_rate": grab(r"receiving rate avg: (\d+)"),
         "broker_cpu_s": cpu, "wall_s": wall, "broker_cores": cpu / max(wall, 1e-9), "exit": proc.returncode,
         "command": "PerfTest " + " ".join(args)}
    log(f"  {broker.name:8} perftest-{label:5} sent {r['send_rate']:>9.0f}/s  consumed {r['consume_rate']:>9.0f}/s  broker {r['broker_cores']:.2f} cores")
    if queues:
        broker.delete_queues(queues)
    return r


def workloads(quick):
    t = "8" if quick else "20"
    sweep_t = "5" if quick else "10"
    backlog = "200000" if quick else "2000000"
    small_backlog = "100000" if quick else "500000"
    a = ["--persistent", "--confirm", "1000", "--prefetch", "1000", "--multi-ack-every", "100"]
    w = []  # (label, description, args, queues)
    w.append(("A", "1P/1C, confirms 1000 in flight, prefetch 1000, ack every 100", a + ["--time", t, "--queue", "wl-a"], ["wl-a"]))
    w.append(("B", f"publish only, confirms 1000, {int(backlog):,} messages", ["--consumers", "0", "--persistent", "--confirm", "1000", "--pmessages", backlog, "--queue", "wl-b"], []))
    w.append(("C", "consume only: B's backlog, prefetch 1000, ack every 100", ["--producers", "0", "--prefetch", "1000", "--multi-ack-every", "100", "--cmessages", backlog, "--queue", "wl-b", "--predeclared"], ["wl-b"]))
    for n in ["1", "5", "20", "200", "1000", "10000"]:
        w.append((f"D-inflight-{n}", f"in-flight {n}, prefetch 1000, ack each", ["--persistent", "--confirm", n, "--prefetch", "1000", "--time", sweep_t, "--queue", "wl-d"], ["wl-d"]))
    for n in ["1", "10", "100", "1000", "10000"]:
        w.append((f"E-prefetch-{n}", f"prefetch {n}, in-flight 1000, ack each", ["--persistent", "--confirm", "1000", "--prefetch", n, "--time", sweep_t, "--queue", "wl-e"], ["wl-e"]))
    for n in ["1", "10", "50", "100", "500"]:
        w.append((f"F-ack-{n}", f"ack every {n}, in-flight 1000, prefetch 1000", ["--persistent", "--confirm", "1000", "--prefetch", "1000", "--multi-ack-every", n, "--time", sweep_t, "--queue", "wl-f"], ["wl-f"]))
    w.append(("G", "no confirms, auto-ack", ["--persistent", "--auto-ack", "--time", t, "--queue", "wl-g"], ["wl-g"]))
    for size, name in [("100", "100B"), ("5000", "5KB")]:
        w.append((f"H-A-{name}", f"A with {name} messages", a + ["--size", size, "--time", t, "--queue", "wl-h"], ["wl-h"]))
        w.append((f"H-B-{name}", f"B with {name} messages", ["--consumers", "0", "--persistent", "--confirm", "1000", "--size", size, "--pmessages", small_backlog, "--queue", "wl-hb"], []))
        w.append((f"H-C-{name}", f"C with {name} messages", ["--producers", "0", "--prefetch", "1000", "--multi-ack-every", "100", "--cmessages", small_backlog, "--queue", "wl-hb", "--predeclared"], ["wl-hb"]))
    w.append(("I", "A's settings at a fixed 5,000 msg/s", a + ["--rate", "5000", "--time", t, "--queue", "wl-i"], ["wl-i"]))
    for size, name in [("100", "100B"), ("5000", "5KB")]:
        w.append((f"J-{name}", f"one message at a time (confirm 1), {name}", ["--consumers", "0", "--persistent", "--confirm", "1", "--size", size, "--time", sweep_t, "--queue", "wl-j"], ["wl-j"]))
    w.append(("K", "5 producers, 5 queues, 5 consumers, 10,000 msg/s each", a + ["--producers", "5", "--consumers", "5", "--queues", "5", "--rate", "10000", "--time", t, "--queue", "wl-k"], [f"wl-k-{i}" for i in range(5)]))
    w.append(("L", "1,000 queues, 100 producers, 100 consumers, A's settings", a + ["--producers", "100", "--consumers", "100", "--queues", "1000", "--time", t, "--queue", "wl-l"], [f"wl-l-{i}" for i in range(1000)]))
    w.append(("M", "fanout exchange to 10 queues, a consumer each", a + ["--consumers", "10", "--queues", "10", "--exchange", "wl-fanout", "--exchange-type", "fanout", "--time", t, "--queue", "wl-m"], [f"wl-m-{i}" for i in range(10)]))
    return w


def perftest_workloads(quick):
    t = "8" if quick else "20"
    n = "200000" if quick else "1000000"
    base = ["-s", "1000", "-f", "persistent", "-ad", "false"]
    return [
        ("A", base + ["-x", "1", "-y", "1", "-c", "1000", "-q", "1000", "--multi-ack-every", "100", "-u", "pt-a", "-z", t], ["pt-a"]),
        ("B", base + ["-x", "1", "-y", "0", "-c", "1000", "-u", "pt-b", "-C", n], []),
        ("C", ["-x", "0", "-y", "1", "-q", "1000", "--multi-ack-every", "100", "-u", "pt-b", "-p", "-D", n], ["pt-b"]),
    ]


def machine_facts():
    facts = {"cores": os.cpu_count(), "kernel": platform.release()}
    try:
        facts["cpu"] = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name"))
    except StopIteration:
        facts["cpu"] = "?"
    facts["ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    d = OUT / "disktest"
    d.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["dd", "if=/dev/zero", f"of={d}/dd.bin", "bs=1M", "count=1000", "oflag=direct"], capture_output=True, text=True).stderr
    facts["disk_direct"] = out.strip().splitlines()[-1].split(",")[-1].strip() if out else "?"
    out = subprocess.run(["dd", "if=/dev/zero", f"of={d}/dd.bin", "bs=1M", "count=1000", "conv=fdatasync"], capture_output=True, text=True).stderr
    facts["disk_fdatasync"] = out.strip().splitlines()[-1].split(",")[-1].strip() if out else "?"
    fd = os.open(d / "fsync.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    lat = []
    for _ in range(500):
        t0 = time.perf_counter()
        os.write(fd, b"x" * 4096)
        os.fdatasync(fd)
        lat.append(time.perf_counter() - t0)
    os.close(fd)
    lat.sort()
    facts["fsync_median_us"] = round(lat[len(lat) // 2] * 1e6)
    facts["fsyncs_per_s"] = round(1 / (sum(lat) / len(lat)))
    shutil.rmtree(d, ignore_errors=True)
    return facts


def ratio(w, r, key):
    a, b = w.get(key) or 0, r.get(key) or 0
    return f"{a / b:.1f}×" if b else "—"


def fmt_rate(v):
    return f"{v / 1000:.1f}k" if v else "—"


def fmt_us(v):
    if not v:
        return "—"
    return f"{v / 1000:.1f} ms" if v >= 1000 else f"{v} µs"


def charts(results, w_desc):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no charts")
        return []
    made = []
    main = [k for k in ["A", "B", "C", "G", "H-A-100B", "H-A-5KB", "K", "L", "M"] if k in results["Warren"]]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = range(len(main))
    rate = lambda b, k: flow_rate(results[b][k]) / 1000  # noqa: E731
    ax.bar([x - 0.2 for x in xs], [rate("Warren", k) for k in main], 0.4, label="Warren")
    ax.bar([x + 0.2 for x in xs], [rate("RabbitMQ", k) for k in main], 0.4, label="RabbitMQ")
    ax.set_xticks(list(xs), main)
    ax.set_ylabel("thousand messages / s")
    ax.set_title("Throughput, same machine, same client (warren bench)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "bench" / "throughput.png", dpi=110)
    made.append("bench/throughput.png")
    plt.close(fig)
    for prefix, title, fname in [("D-inflight-", "In-flight sweep (publish rate)", "sweep-inflight.png"),
                                 ("E-prefetch-", "Prefetch sweep (consume rate)", "sweep-prefetch.png"),
                                 ("F-ack-", "Ack-interval sweep (consume rate)", "sweep-ack.png")]:
        keys = [k for k in results["Warren"] if k.startswith(prefix)]
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for b in ["Warren", "RabbitMQ"]:
            ax.plot([int(k[len(prefix):]) for k in keys], [rate(b, k) for k in keys], marker="o", label=b)
        ax.set_xscale("log")
        ax.set_xlabel(prefix.strip("-").split("-")[-1])
        ax.set_ylabel("thousand messages / s")
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(ROOT / "bench" / fname, dpi=110)
        made.append(f"bench/{fname}")
        plt.close(fig)
    if "I" in results["Warren"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        ps = ["p50", "p95", "p99", "p999"]
        for i, b in enumerate(["Warren", "RabbitMQ"]):
            vals = [results[b]["I"].get(f"e2e_{p}_us", 0) / 1000 for p in ps]
            ax.bar([x + (i - 0.5) * 0.4 for x in range(len(ps))], vals, 0.4, label=b)
        ax.set_xticks(range(len(ps)), ["p50", "p95", "p99", "p99.9"])
        ax.set_yscale("log")
        ax.set_ylabel("end-to-end latency, ms (log)")
        ax.set_title("Latency at 5,000 msg/s (workload I)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(ROOT / "bench" / "latency.png", dpi=110)
        made.append("bench/latency.png")
        plt.close(fig)
    return made


def flow_rate(r):
    """Messages through the broker per second: consumed if anything consumed, else published. With
    consumers that fall behind (auto-ack runs without flow control) this is the lower, honest figure."""
    return r.get("consume_rate") or r.get("send_rate") or 0


def targets(W, R, perftest, facts):
    """Each target of issue 4, met or missed, from this run's figures."""
    out = []

    def rate(r, k):
        return flow_rate(r.get(k, {}))

    def check(ok, text):
        out.append(f"- {'met' if ok else '**missed**'}: {text}")

    for k in ["A", "B", "C", "G"]:
        if k in W and k in R and rate(R, k):
            x = rate(W, k) / rate(R, k)
            check(x >= 5, f"{k}: Warren {fmt_rate(rate(W, k))} msg/s vs RabbitMQ {fmt_rate(rate(R, k))} = {x:.1f}× (target ≥ 5×)")
    if "A" in W:
        check(rate(W, "A") >= 100_000, f"A at {fmt_rate(rate(W, 'A'))} msg/s (target ≥ 100k)")
    for k in ["A", "B", "C"]:
        wc, rc = (W.get(k) or {}).get("broker_cpu_us_per_msg"), (R.get(k) or {}).get("broker_cpu_us_per_msg")
        if wc and rc:
            check(wc <= rc / 5, f"{k}: broker CPU {wc:.1f} µs/msg vs {rc:.1f} µs/msg = {rc / wc:.1f}× less (target ≥ 5× less)")
    pw, pr = perftest.get("Warren") or {}, perftest.get("RabbitMQ") or {}
    for k in ["A", "B", "C"]:
        key = "consume_rate" if k == "C" else "send_rate"
        if pw.get(k, {}).get(key) and pr.get(k, {}).get(key):
            x = pw[k][key] / pr[k][key]
            check(x >= 3, f"PerfTest {k}: {fmt_rate(pw[k][key])} vs {fmt_rate(pr[k][key])} msg/s = {x:.1f}× (target ≥ 3×)")
    if "I" in W and "I" in R and R["I"].get("e2e_p99_us"):
        a, b = W["I"]["e2e_p99_us"], R["I"]["e2e_p99_us"]
        check(a * 4 <= b, f"I: p99 end-to-end at 5,000 msg/s {fmt_us(a)} vs {fmt_us(b)} = {b / max(a, 1):.1f}× lower (target ≥ 4×)")
    for k in ["J-100B", "J-5KB"]:
        if k in W:
            m = W[k].get("confirm_p50_us", 0)
            check(m <= 2 * facts["fsync_median_us"], f"{k}: median confirm {fmt_us(m)} vs one fsync {facts['fsync_median_us']} µs (target ≤ 2×)")
    cpus = {k: W[k].get("client_cpu_us_per_msg") for k in ["A", "B", "C", "G", "M"] if W.get(k, {}).get("client_cpu_us_per_msg")}
    if cpus:
        out.append("- client cost: `warren bench` used " + ", ".join(f"{k} {v:.2f}" for k, v in cpus.items())
                   + " µs of CPU per message sent or consumed against Warren (from its getrusage), so at Warren's rates the "
                   "client takes about a quarter to half of one core; the broker's own CPU per message is in the table below.")
    return out


def write_report(results, perftest, facts, versions, w_desc, chart_files, started, quick):
    W, R = results["Warren"], results["RabbitMQ"]
    lines = [
        "# Benchmarks",
        "",
        f"Written by `bench/run.sh`{' --quick' if quick else ''} on {started:%Y-%m-%d %H:%M} UTC; every figure below comes from that one run.",
        "",
        f"Machine: {facts['cores']} cores ({facts['cpu']}), {facts['ram_gib']} GiB RAM, Linux {facts['kernel']}; "
        f"disk {facts['disk_direct']} sequential (O_DIRECT, dd), {facts['disk_fdatasync']} through the page cache with one "
        f"fdatasync; one 4 KiB write+fdatasync takes {facts['fsync_median_us']} µs (median), ~{facts['fsyncs_per_s']} fsyncs/s.",
        f"Brokers: {versions['Warren']}, {versions['RabbitMQ']} (Debian package, default settings, one node), run one "
        "after the other on the same machine. Queues durable, messages persistent, 1 KB unless stated.",
        "",
        "Client: `warren bench` (same binary for both brokers); broker CPU is the broker process's user+system "
        "time over the run (RabbitMQ: `beam.smp`).",
        "",
        "## Targets (issue 4)",
        "",
        *targets(W, R, perftest, facts),
        "",
        "## Throughput and CPU",
        "",
        "Rates are messages consumed per second (published, for publish-only runs).",
        "",
        "| workload | Warren msg/s | RabbitMQ msg/s | ratio | Warren CPU µs/msg | RabbitMQ CPU µs/msg | CPU ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in ["A", "B", "C", "G", "H-A-100B", "H-B-100B", "H-C-100B", "H-A-5KB", "H-B-5KB", "H-C-5KB", "K", "L", "M"]:
        if k not in W:
            continue
        wr, rr = flow_rate(W[k]), flow_rate(R[k])
        wc, rc = W[k].get("broker_cpu_us_per_msg"), R[k].get("broker_cpu_us_per_msg")
        lines.append(f"| {k}: {w_desc[k]} | {fmt_rate(wr)} | {fmt_rate(rr)} | {wr / rr:.1f}× | "
                     f"{wc:.1f} | {rc:.1f} | {rc / wc:.1f}× less |" if rr and wc and rc else
                     f"| {k}: {w_desc[k]} | {fmt_rate(wr)} | {fmt_rate(rr)} | — | — | — | — |")
    lines += ["", "Charts: " + ", ".join(f"[{Path(c).name}]({c})" for c in chart_files), ""]
    for c in chart_files:
        lines.append(f"![{Path(c).stem}]({c})")
    lines += ["", "## Latency", "", "| workload | broker | confirm p50 | p95 | p99 | p99.9 | end-to-end p50 | p95 | p99 | p99.9 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for k in ["A", "I", "J-100B", "J-5KB", "K"]:
        for b, r in [("Warren", W), ("RabbitMQ", R)]:
            if k in r:
                x = r[k]
                lines.append(f"| {k} | {b} | " + " | ".join(fmt_us(x.get(f"confirm_{p}_us")) for p in ["p50", "p95", "p99", "p999"]) + " | "
                             + " | ".join(fmt_us(x.get(f"e2e_{p}_us")) for p in ["p50", "p95", "p99", "p999"]) + " |")
    lines += ["", "## Sweeps (warren bench)", "", "| workload | Warren msg/s | RabbitMQ msg/s | ratio |", "|---|---|---|---|"]
    for k in W:
        if k[0] in "DEF":
            a, b = flow_rate(W[k]), flow_rate(R[k])
            lines.append(f"| {k}: {w_desc[k]} | {fmt_rate(a)} | {fmt_rate(b)} | {a / max(b, 1):.1f}× |")
    if perftest.get("Warren"):
        lines += ["", "## With PerfTest as the client", "", "PerfTest 2.22.1 (Java) itself takes much of the two cores; its CPU is "
                  "not counted as the broker's.", "", "| workload | Warren msg/s | RabbitMQ msg/s | ratio | Warren broker cores | RabbitMQ broker cores |", "|---|---|---|---|---|---|"]
        for k in ["A", "B", "C"]:
            w, r = perftest["Warren"].get(k, {}), perftest["RabbitMQ"].get(k, {})
            rate = lambda x: x.get("consume_rate") if k == "C" else x.get("send_rate")  # noqa: E731
            if rate(w) and rate(r):
                lines.append(f"| {k} | {fmt_rate(rate(w))} | {fmt_rate(rate(r))} | {rate(w) / rate(r):.1f}× | {w['broker_cores']:.2f} | {r['broker_cores']:.2f} |")
    store = ROOT / "bench" / "store-results.md"
    if store.exists():
        lines += ["", store.read_text().strip()]
    cluster = ROOT / "bench" / "cluster-results.md"  # the three-node run's section, written by bench/cluster.py
    if cluster.exists():
        lines += ["", cluster.read_text().strip()]
    lines += ["", "## Commands", "", "Each row above is one of these, with `--uri` pointing at the broker under test:", "", "```"]
    seen = set()
    for k, r in W.items():
        c = r.get("command", "")
        if c and c not in seen:
            seen.add(c)
            lines.append(f"{k}: {c}")
    for k, r in (perftest.get("Warren") or {}).items():
        lines.append(f"PerfTest {k}: {r.get('command', '')}")
    lines += ["```", "", "Raw outputs: `target/bench/` (per broker and workload).", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs")
    ap.add_argument("--only", default="", help="comma-separated workload labels (default: all)")
    ap.add_argument("--no-perftest", action="store_true")
    ap.add_argument("--report-only", action="store_true", help="rewrite BENCHMARKS.md from the last run's results")
    opts = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if opts.report_only:
        saved = json.loads((OUT / "results.json").read_text())
        w_desc = {label: desc for label, desc, _, _ in workloads(saved.get("quick", False))}
        chart_files = charts(saved["results"], w_desc)
        started = datetime.datetime.fromisoformat(saved["started"])
        report = write_report(saved["results"], saved["perftest"], saved["facts"], saved["versions"], w_desc, chart_files, started, saved.get("quick", False))
        (ROOT / "BENCHMARKS.md").write_text(report)
        log("rewrote BENCHMARKS.md")
        return
    started = datetime.datetime.now(datetime.timezone.utc)
    log("machine facts")
    facts = machine_facts()
    log(json.dumps(facts))
    ws = workloads(opts.quick)
    if opts.only:
        keep = set(opts.only.split(","))
        ws = [w for w in ws if w[0] in keep or w[0].split("-")[0] in keep]
    w_desc = {label: desc for label, desc, _, _ in ws}
    results, perftest, versions = {}, {}, {}
    for broker in [Warren(), RabbitMQ()]:
        log(f"starting {broker.name}")
        broker.start()
        versions[broker.name] = broker.version()
        results[broker.name] = {}
        try:
            for label, _desc, args, queues in ws:
                results[broker.name][label] = run_bench(broker, label, args, queues)
            if not opts.no_perftest and PERFTEST_LIB.exists():
                perftest[broker.name] = {}
                for label, args, queues in perftest_workloads(opts.quick):
                    perftest[broker.name][label] = run_perftest(broker, label, args, queues)
        finally:
            broker.stop()
    (OUT / "results.json").write_text(json.dumps({"results": results, "perftest": perftest, "facts": facts, "versions": versions,
                                                  "started": started.isoformat(), "quick": opts.quick}, indent=1))
    chart_files = charts(results, w_desc)
    report = write_report(results, perftest, facts, versions, w_desc, chart_files, started, opts.quick)
    (ROOT / "BENCHMARKS.md").write_text(report)
    log("wrote BENCHMARKS.md")


if __name__ == "__main__":
    sys.exit(main())
