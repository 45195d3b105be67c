#!/usr/bin/env python3
"""Three nodes (issue 10): a three-node Warren cluster against a three-node RabbitMQ cluster on this
machine, side by side, one run per broker, and the section "Three nodes (issue 10)" of BENCHMARKS.md.

    bench/run.sh --cluster              # installs what it needs, builds, then runs this
    bench/cluster.py --quick            # a few seconds per row: for trying the script itself
    bench/cluster.py --report-only      # rewrite the section from target/bench/cluster/results.json

Rows (quorum queue, 1 KB persistent messages, confirms 1000 in flight, prefetch 1000, ack every 100):
Q1 publish only (1 producer), Q2 consume only from Q1's backlog (1 consumer), Q3 both at once, Q4 1,000
quorum queues with 100 producers and 100 consumers, spread over the three nodes. Q1-Q3 with
`warren bench` and with PerfTest as the client, Q4 with `warren bench`. Broker CPU is the sum over the
three nodes' processes. Then, measured separately: failover (the queue's leader killed with kill -9 ->
first confirm, to a publisher on another node, of a message published after the kill), catch-up of a
returning node (a follower stopped, a backlog published, the follower started: how fast its log
reaches the leader's), and the start time of a node holding Q4's quorum queues.

RabbitMQ: ../shared/anchors/start_cluster.sh 3 (nodes rmq1..3, AMQP 5672-5674, data under $BASE).
Warren: target/release/warren, node N with AMQP port 5690+N, cluster port 25690+N, HTTP 26690+N and metrics 25680+N on 127.0.0.1
(`--node-id N --cluster-addr 127.0.0.1:2569N --peers 1=...,2=...,3=... --cluster-secret ...`), data
under target/bench/cluster/warren/. A measurement Warren cannot make yet (no quorum queues, no
`warren ctl cluster-status` to find a queue's leader) is recorded as "not yet measurable: <reason>".
"""
import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as single  # noqa: E402  (helpers of the single-node harness: CPU, machine facts, formatting)

sys.path.insert(0, str(single.ROOT / "tests" / "cluster"))
from workload import AmqpError, Client  # noqa: E402  (raw AMQP client whose every wait is bounded)

ROOT = single.ROOT
BIN = Path(os.environ.get("WARREN_BIN", single.BIN))  # another build of warren, e.g. to try a branch
OUT = single.OUT / "cluster"
NODES = (1, 2, 3)
SECRET = "warren-bench-cluster"
SECTION = "## Three nodes (issue 10)"
RESULTS_MD = ROOT / "bench" / "cluster-results.md"
RBIN = Path("/usr/lib/rabbitmq/bin")
log = single.log


class NotMeasurable(Exception):
    """What a measurement needs that the broker does not have (yet)."""


def amqp_ready(port, timeout=120.0):
    """Waits until a full AMQP handshake (connection and channel open) succeeds on `port`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            Client("127.0.0.1", port, heartbeat=0, timeout=2.0).close()
            return
        except (OSError, AmqpError) as e:
            last = e
            time.sleep(0.05)
    raise RuntimeError(f"no AMQP handshake on port {port} within {timeout:.0f}s ({last})")


def declare(port, queue, arguments):
    c = Client("127.0.0.1", port, heartbeat=0, timeout=30.0)
    try:
        c.declare(queue, arguments)
    finally:
        c.close()


def first_line(text, pattern=r"error|refused|not supported|NOT_"):
    """Why a client or tool failed, short: the AMQP reply code and text if it names one (warren bench's
    "406 PRECONDITION_FAILED - ...", Java's "reply-code=406, reply-text=..."), else the first line that
    looks like an error, else the last line."""
    m = re.search(r"reply-code=(\d+), reply-text=([^,;\n]+)", text) or re.search(r"\b(\d{3}) ([A-Z_]{6,} - [^;(\n]+)", text)
    if m:
        return f"{m.group(1)} {m.group(2)}".strip()[:200]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hit = next((ln for ln in lines if re.search(pattern, ln, re.I)), lines[-1] if lines else "no output")
    return hit[:200]


# ---------------------------------------------------------------- the two clusters

class WarrenCluster:
    name = "Warren"

    def __init__(self, queue_type):
        self.queue_type = queue_type
        self.procs = {}
        self.dir = OUT / "warren"

    def port(self, n):
        return 5690 + n

    def cluster_addr(self, n):
        return f"127.0.0.1:{25690 + n}"

    def uri(self, n):
        return f"amqp://guest:guest@127.0.0.1:{self.port(n)}/%2F"

    def queue_arguments(self):
        return {"x-queue-type": self.queue_type}

    def command(self, n):
        peers = ",".join(f"{i}={self.cluster_addr(i)}" for i in NODES)
        return [str(BIN), "server", "--amqp-port", str(self.port(n)), "--http-port", str(26690 + n), "--prometheus-port", str(25680 + n),
                "--data-dir", str(self.dir / f"n{n}"), "--node-id", str(n), "--cluster-addr", self.cluster_addr(n),
                "--peers", peers, "--cluster-secret", SECRET]

    def launch(self, n):
        self.procs[n] = subprocess.Popen(self.command(n), stdout=open(self.dir / f"n{n}.log", "ab"), stderr=subprocess.STDOUT)

    def start(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        for n in NODES:  # all at once: a cluster forms from nodes started in any order
            self.launch(n)
        for n in NODES:
            amqp_ready(self.port(n))
        self.settle()

    def settle(self, timeout=60):
        """Waits until every member is reachable and the metadata group (0) has a leader, as far as
        `warren ctl cluster-status` tells (without it, there is nothing to wait for)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                s = self.status()
            except NotMeasurable:
                return
            members = s.get("members", [])
            meta = next((g for g in s.get("groups", []) if g.get("group") == 0), {})
            if len(members) == len(NODES) and all(m.get("reachable") for m in members) and meta.get("leader"):
                return
            time.sleep(0.2)

    def start_node(self, n):
        """Starts node n on its data; seconds until it completes an AMQP handshake."""
        t0 = time.monotonic()
        self.launch(n)
        amqp_ready(self.port(n), timeout=600)
        return time.monotonic() - t0

    def stop_node(self, n):
        p = self.procs.get(n)
        if p and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill9(self, n):
        p = self.procs[n]
        p.kill()
        p.wait()

    def signal(self, n, sig):
        """SIGSTOP / SIGCONT node n's process (a node that stops answering, its sockets open)."""
        os.kill(self.procs[n].pid, sig)

    def stop(self):
        for n in NODES:
            self.stop_node(n)

    def pids(self):
        return [p.pid for p in self.procs.values() if p.poll() is None]

    def alive(self, n):
        return n in self.procs and self.procs[n].poll() is None

    def version(self):
        return subprocess.run([str(BIN), "--version"], capture_output=True, text=True).stdout.strip()

    def delete_queues(self, names, node=1):
        single.delete_queues(self.port(node), names)

    # --- cluster state, from `warren ctl cluster-status --json`
    def status(self, node=None):
        """The cluster status as JSON, asked of `node` (None: the first live one)."""
        live = [n for n in NODES if self.procs.get(n) and self.procs[n].poll() is None]
        ask = node or (live[0] if live else 1)
        try:
            p = subprocess.run([str(BIN), "ctl", "--node", self.cluster_addr(ask), "--json", "--timeout", "5", "cluster-status"],
                               capture_output=True, text=True, timeout=30, env=dict(os.environ, WARREN_CLUSTER_SECRET=SECRET))
        except subprocess.TimeoutExpired:
            raise NotMeasurable("`warren ctl cluster-status` did not answer within 30 s") from None
        if p.returncode != 0:
            raise NotMeasurable(f"`warren ctl cluster-status` failed: {first_line(p.stderr + p.stdout)}")
        try:
            return json.loads(p.stdout)
        except ValueError:
            raise NotMeasurable(f"`warren ctl cluster-status --json` printed no JSON: {p.stdout[:200]!r}") from None

    def describe(self):
        """One line on what the three processes are: a cluster, or three standalone nodes."""
        try:
            s = self.status()
        except NotMeasurable as e:
            return f"started with --peers; cluster state unknown ({e})"
        up = [m["id"] for m in s.get("members", []) if m.get("reachable")]
        return f"cluster of {len(s.get('members', []))} members, {len(up)} reachable from node {s.get('node_id')}"

    def clustered(self):
        """(True, "") when `warren ctl cluster-status` shows the three nodes as one cluster, else
        (False, why): then quorum queues are single-voter groups on the node that declared them."""
        try:
            s = self.status()
        except NotMeasurable as e:
            return False, str(e)
        members = s.get("members", [])
        if len(members) != len(NODES) or not all(m.get("reachable") for m in members):
            return False, f"`warren ctl cluster-status` shows {len(members)} members, not {len(NODES)} reachable ones"
        if self.queue_type != "quorum":
            return True, ""
        try:  # a probe queue: is a quorum queue a Raft group of the three nodes?
            group = self.declare_located("cq-probe")
            voters = self.groups().get(group, {}).get("voters", [])
        except NotMeasurable as e:
            return False, f"a quorum queue is not a group of the cluster: {e}"
        finally:
            self.delete_queues(["cq-probe"])
        if len(voters) != len(NODES):
            return False, f"a quorum queue's group has voters {voters}, not the three nodes"
        return True, ""

    def groups(self):
        return {g["group"]: g for g in self.status().get("groups", [])}

    def declare_located(self, queue, node=1):
        """Declares `queue` on `node`; returns its Raft group id (the group that appeared with it, or the
        one the status names after it)."""
        before = set(self.groups())
        try:
            declare(self.port(node), queue, self.queue_arguments())
        except AmqpError as e:
            raise NotMeasurable(f"declaring {self.queue_type} queue {queue}: {e}") from None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            gs = self.groups()
            named = [g for g, v in gs.items() if queue in (v.get("queue"), v.get("name"))]
            new = named or [g for g in gs if g not in before and g != 0]
            if len(new) == 1:
                return new[0]
            if len(new) > 1:
                raise NotMeasurable(f"cannot tell queue {queue}'s group among {sorted(new)}")
            time.sleep(0.2)
        raise NotMeasurable(f"no Raft group appeared in `warren ctl cluster-status` for quorum queue {queue}")

    def leader(self, group):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            g = self.groups().get(group)
            if g and g.get("leader"):
                return int(g["leader"])
            time.sleep(0.2)
        raise NotMeasurable(f"group {group} has no leader in `warren ctl cluster-status`")

    def log_position(self, group, node):
        """(the leader's last log index, `node`'s matched index as the leader sees it)."""
        g = self.groups().get(group) or {}
        matched = next((f.get("matched") for f in g.get("followers", []) if f.get("id") == node), None)
        return g.get("last_log_index"), matched

    def timed_rejoin(self, group, node, before, target, timeout):
        """Starts `node` and watches the leader's view of it until its matched index reaches `target`.
        Returns seconds from launch: ready (AMQP), first progress past `before`, caught up."""
        t0 = time.monotonic()
        ready = {}
        starter = threading.Thread(target=lambda: ready.update(s=self.start_node(node)), daemon=True)
        starter.start()
        first = None
        while time.monotonic() - t0 < timeout:
            try:
                _, matched = self.log_position(group, node)
            except NotMeasurable:
                matched = None
            now = time.monotonic() - t0
            if matched is not None and matched > before and first is None:
                first = (now, matched)
            if matched is not None and matched >= target:
                starter.join(600)
                first = first or (now, matched)
                return {"ready_s": ready.get("s"), "first_s": first[0], "first_index": first[1], "done_s": now}
            time.sleep(0.1)
        raise NotMeasurable(f"node {node} did not catch up within {timeout} s")


class RabbitCluster:
    name = "RabbitMQ"

    def __init__(self):
        self.procs = {}
        self.base = single.ANCHOR_BASE

    def port(self, n):
        return 5671 + n

    def uri(self, n):
        return f"amqp://guest:guest@127.0.0.1:{self.port(n)}/%2F"

    def queue_arguments(self):
        return {"x-queue-type": "quorum"}

    @property
    def queue_type(self):
        return "quorum"

    def node_dir(self, n):
        return self.base / "nodes" / f"rmq{n}"

    def env(self, n):
        """Node n's environment, exactly as start_cluster.sh's node_env sets it."""
        d = self.node_dir(n)
        return dict(os.environ, HOME=str(self.base / "home"), RABBITMQ_NODENAME=f"rmq{n}@localhost",
                    RABBITMQ_NODE_PORT=str(self.port(n)), RABBITMQ_DIST_PORT=str(25671 + n),
                    RABBITMQ_MNESIA_BASE=f"{d}/mnesia", RABBITMQ_LOG_BASE=f"{d}/log", RABBITMQ_PID_FILE=f"{d}/pid",
                    RABBITMQ_ENABLED_PLUGINS_FILE=f"{d}/enabled_plugins", RABBITMQ_CONFIG_FILE=f"{d}/rabbitmq.conf",
                    RABBITMQ_ADVANCED_CONFIG_FILE=f"{d}/advanced.config", RABBITMQ_CONF_ENV_FILE=f"{d}/rabbitmq-env.conf")

    def ctl(self, *args, node=1, timeout=120):
        p = subprocess.run([str(RBIN / "rabbitmqctl"), "-n", f"rmq{node}@localhost", *args], capture_output=True,
                           text=True, env=dict(os.environ, HOME=str(self.base / "home")), timeout=timeout)
        return p

    def start(self):
        subprocess.run(["bash", str(single.ANCHORS / "stop_cluster.sh")], capture_output=True)
        shutil.rmtree(self.base / "nodes", ignore_errors=True)
        p = subprocess.run(["bash", str(single.ANCHORS / "start_cluster.sh"), "3"], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"start_cluster.sh 3 failed: {p.stdout[-500:]}{p.stderr[-500:]}")
        for n in NODES:
            amqp_ready(self.port(n))

    def beam_pid(self, n):
        try:
            pid = int((self.node_dir(n) / "pid").read_text().strip())
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError):
            return None

    def start_node(self, n):
        t0 = time.monotonic()
        d = self.node_dir(n)
        (d / "pid").unlink(missing_ok=True)
        self.procs[n] = subprocess.Popen([str(RBIN / "rabbitmq-server")], env=self.env(n),
                                         stdout=open(d / "log" / "stdout.log", "ab"), stderr=subprocess.STDOUT)
        amqp_ready(self.port(n), timeout=600)
        return time.monotonic() - t0

    def stop_node(self, n):
        self.ctl("stop", str(self.node_dir(n) / "pid"), node=n, timeout=300)

    def kill9(self, n):
        pid = self.beam_pid(n)
        if pid:
            os.kill(pid, signal.SIGKILL)
            while self.beam_pid(n):
                time.sleep(0.01)

    def signal(self, n, sig):
        """SIGSTOP / SIGCONT node n's Erlang VM."""
        pid = self.beam_pid(n)
        if pid:
            os.kill(pid, sig)

    def stop(self):
        subprocess.run(["bash", str(single.ANCHORS / "stop_cluster.sh")], capture_output=True)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    def pids(self):
        return [p for p in (self.beam_pid(n) for n in NODES) if p]

    def alive(self, n):
        return self.beam_pid(n) is not None

    def version(self):
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "rabbitmq-server"], capture_output=True, text=True).stdout
        return f"RabbitMQ {out.strip()}"

    def delete_queues(self, names, node=1):
        single.delete_queues(self.port(node), names)

    def clustered(self):
        return True, ""

    def describe(self):
        p = self.ctl("-q", "cluster_status", "--formatter", "json")
        try:
            s = json.loads(p.stdout)
            return f"cluster of {len(s.get('disk_nodes', []))} disc nodes, {len(s.get('running_nodes', []))} running"
        except ValueError:
            return f"cluster status unknown: {first_line(p.stdout + p.stderr)}"

    # --- a quorum queue's Raft state, from rabbitmqctl (the leader node runs the loops, in Erlang)
    def declare_located(self, queue, node=1):
        declare(self.port(node), queue, self.queue_arguments())
        return queue

    def leader(self, queue):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            live = [n for n in NODES if self.beam_pid(n)]
            p = self.ctl("-q", "list_queues", "name", "leader", "--formatter", "json", node=live[0])
            try:
                row = next((r for r in json.loads(p.stdout) if r.get("name") == queue), None)
            except ValueError:
                row = None
            m = re.match(r"rmq(\d)@", str((row or {}).get("leader", "")))
            if m and self.beam_pid(int(m.group(1))):
                return int(m.group(1))
            time.sleep(0.5)
        raise NotMeasurable(f"rabbitmqctl names no live leader for {queue}")

    def _status_expr(self, queue, node):
        return (f'case catch rabbit_quorum_queue:status(<<"/">>, <<"{queue}">>) of L when is_list(L) -> '
                f'case [proplists:get_value(<<"Log Index">>, M) || M <- L, proplists:get_value(<<"Node Name">>, M) '
                f"=:= 'rmq{node}@localhost'] of [I] when is_integer(I) -> I; _ -> none end; _ -> none end")

    def log_index(self, queue, node, ask):
        p = self.ctl("eval", self._status_expr(queue, node) + ".", node=ask)
        out = p.stdout.strip()
        return int(out) if out.isdigit() else None

    def timed_rejoin(self, queue, node, before, target, timeout, leader=1):
        """Starts `node` while an Erlang loop on the leader polls the queue's Raft status every 20 ms
        until `node`'s log index reaches `target`. Returns seconds from launch: ready, first progress,
        caught up."""
        marker = OUT / "rejoin.started"
        marker.unlink(missing_ok=True)
        idx = self._status_expr(queue, node)
        expr = (f'T0 = erlang:monotonic_time(millisecond), ok = file:write_file("{marker}", <<"started">>), '
                f"Idx = fun() -> {idx} end, "
                f"Loop = fun Loop(First) -> Now = erlang:monotonic_time(millisecond) - T0, I = Idx(), "
                f"F2 = case First of {{undefined, _}} when is_integer(I), I > {before} -> {{Now, I}}; _ -> First end, "
                f"if Now > {timeout * 1000} -> {{timeout, F2, Now}}; is_integer(I), I >= {target} -> {{done, F2, Now}}; "
                f"true -> timer:sleep(20), Loop(F2) end end, Loop({{undefined, undefined}}).")
        watcher = subprocess.Popen([str(RBIN / "rabbitmqctl"), "-n", f"rmq{leader}@localhost", "eval", expr],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=dict(os.environ, HOME=str(self.base / "home")))
        deadline = time.monotonic() + 60
        while not marker.exists():
            if watcher.poll() is not None or time.monotonic() > deadline:
                raise NotMeasurable(f"rabbitmqctl eval did not start its loop: {watcher.stdout.read()[:300]}")
            time.sleep(0.02)
        t_loop = time.monotonic()  # the loop's T0, within 20 ms
        shift = t_loop - time.monotonic()  # loop times are from T0; the results are from the launch, just after
        ready = self.start_node(node)
        out = watcher.communicate(timeout=timeout + 120)[0].strip()
        m = re.search(r"\{(\w+),\{(\w+),(\w+)\},(\d+)\}", out.replace(" ", "").replace("\n", ""))
        if not m or m.group(1) != "done":
            raise NotMeasurable(f"rmq{node} did not catch up: {out[:300]}")
        done = int(m.group(4)) / 1000
        first, first_index = (int(m.group(2)) / 1000, int(m.group(3))) if m.group(2).isdigit() else (done, target)
        return {"ready_s": ready, "first_s": first + shift, "first_index": first_index, "done_s": done + shift}


# ---------------------------------------------------------------- one measured client run

def written_bytes(pids):
    """Bytes the processes `pids` sent to storage so far (`write_bytes` of /proc/PID/io: counted when
    a page is dirtied or a direct write is issued, whether or not it has reached the disk yet)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("write_bytes:"):
                    total += int(line.split()[1])
        except (OSError, ValueError):
            pass
    return total


def measured(broker, cmd, label, timeout):
    """Runs `cmd` (a client), timing it and summing the CPU and the bytes written of every broker
    process over it."""
    pids = broker.pids()
    written0 = written_bytes(pids)
    cpu0, t0 = single.cpu_ticks(pids), time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        text, code = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout or "", e.stderr or ""))
        text, code = text + f"\ntimed out after {timeout} s", -9
    wall = time.time() - t0
    cpu = single.cpu_ticks(pids) - cpu0
    written = written_bytes(pids) - written0
    (OUT / f"{broker.name}-{label}.txt").write_text(" ".join(map(str, cmd)) + "\n" + text)
    return text, code, {"broker_cpu_s": cpu, "wall_s": wall, "broker_cores": cpu / max(wall, 1e-9), "exit": code,
                        "broker_written_bytes": written}


def bench_cmd(uri, args, out):
    return [str(BIN), "bench", "--uri", uri, "--progress-every", "0", "--json", str(out), *args]


def run_bench(broker, label, args, timeout, node=1):
    out = OUT / f"{broker.name}-{label}.json"
    out.unlink(missing_ok=True)
    text, code, r = measured(broker, bench_cmd(broker.uri(node), args, out), label, timeout)
    if out.exists():
        r.update(json.loads(out.read_text()))
    if code != 0:
        r["error"] = first_line(text)
    r["command"] = "warren bench " + " ".join(args)
    per_msg(r)
    report_line(broker, label, r)
    return r


def run_bench_spread(broker, label, parts, timeout):
    """Q4: one `warren bench` per node at once (its share of producers, consumers and queues); rates add
    up, latencies are the worst of the three."""
    pids = broker.pids()
    cpu0, t0 = single.cpu_ticks(pids), time.time()
    procs = []
    for n, args in parts:
        out = OUT / f"{broker.name}-{label}-n{n}.json"
        out.unlink(missing_ok=True)
        cmd = bench_cmd(broker.uri(n), args, out)
        procs.append((n, out, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    r = {"sent": 0, "consumed": 0, "send_rate": 0.0, "consume_rate": 0.0, "confirm_rate": 0.0, "parts": []}
    errors = []
    for n, out, cmd, p in procs:
        try:
            text = p.communicate(timeout=max(1, timeout - (time.time() - t0)))[0]
        except subprocess.TimeoutExpired:
            p.kill()
            text = p.communicate()[0] + f"\ntimed out after {timeout} s"
        (OUT / f"{broker.name}-{label}-n{n}.txt").write_text(" ".join(cmd) + "\n" + text)
        part = json.loads(out.read_text()) if out.exists() else {}
        r["parts"].append(part)
        for k in ("sent", "consumed", "send_rate", "consume_rate", "confirm_rate"):
            r[k] += part.get(k, 0) or 0
        for k in ("confirm_p50_us", "confirm_p99_us", "e2e_p50_us", "e2e_p99_us"):
            r[k] = max(r.get(k, 0), part.get(k, 0) or 0)
        if p.returncode != 0:
            errors.append(f"node {n}: {first_line(text)}")
    wall = time.time() - t0
    cpu = single.cpu_ticks(pids) - cpu0
    r.update(broker_cpu_s=cpu, wall_s=wall, broker_cores=cpu / max(wall, 1e-9), exit=0 if not errors else 1,
             command=" & ".join(f"warren bench --uri <node {n}> " + " ".join(a) for n, a in parts))
    if errors:
        r["error"] = "; ".join(errors)
    per_msg(r)
    report_line(broker, label, r)
    return r


def run_perftest(broker, label, args, timeout, messages=None):
    cmd = ["java", "-Xmx2g", "-cp", f"{single.PERFTEST_LIB}/*", "com.rabbitmq.perf.PerfTest", "-h", broker.uri(1), *args]
    text, code, r = measured(broker, cmd, f"perftest-{label}", timeout)
    grab = lambda pat: float(m.group(1)) if (m := re.search(pat, text)) else 0.0  # noqa: E731

    def lat(kind):
        m = re.search(kind + r" latency min/median/75th/95th/99th (\d+)/(\d+)/(\d+)/(\d+)/(\d+)", text)
        return (int(m.group(2)), int(m.group(5))) if m else (0, 0)
    r.update(send_rate=grab(r"sending rate avg: (\d+)"), consume_rate=grab(r"receiving rate avg: (\d+)"),
             command="PerfTest " + " ".join(args))
    r["confirm_p50_us"], r["confirm_p99_us"] = lat("confirm")
    r["e2e_p50_us"], r["e2e_p99_us"] = lat("consumer")
    # PerfTest prints rates, not counts: Q1/Q2 move `messages`; else rate x run time (which includes the JVM's start)
    r["sent"] = messages if messages and r["send_rate"] else r["send_rate"] * r["wall_s"]
    r["consumed"] = messages if messages and r["consume_rate"] else r["consume_rate"] * r["wall_s"]
    if code != 0 or not (r["send_rate"] or r["consume_rate"]):
        r["error"] = first_line(text, r"exception|error|refused|NOT_")
    per_msg(r)
    report_line(broker, f"perftest-{label}", r)
    return r


def per_msg(r):
    msgs = max(r.get("sent", 0) or 0, r.get("consumed", 0) or 0)
    r["broker_cpu_us_per_msg"] = r["broker_cpu_s"] * 1e6 / msgs if msgs else None


def report_line(broker, label, r):
    if r.get("error"):
        log(f"  {broker.name:8} {label:12} FAILED: {r['error']}")
        return
    log(f"  {broker.name:8} {label:12} sent {r.get('send_rate', 0):>9.0f}/s  consumed {r.get('consume_rate', 0):>9.0f}/s  "
        f"confirm p50/p99 {r.get('confirm_p50_us', 0)}/{r.get('confirm_p99_us', 0)} µs  "
        f"e2e p50/p99 {r.get('e2e_p50_us', 0)}/{r.get('e2e_p99_us', 0)} µs  broker {r['broker_cores']:.2f} cores")


# ---------------------------------------------------------------- the rows

def sizes(quick):
    return {
        "backlog": 20_000 if quick else 500_000,       # Q1 publishes it, Q2 drains it
        "time": 3 if quick else 20,                     # Q3, PerfTest Q3
        "q4_time": 3 if quick else 30,                  # Q4 starts with 100 x 1,000 messages in flight: a longer run
        "q4_queues": 99 if quick else 1000, "q4_clients": 9 if quick else 100,
        "catchup": 10_000 if quick else 200_000,
        "idle": 3 if quick else 30,                     # seconds of idle CPU with Q4's queues and no clients
        "idle_settle": 1 if quick else 15,              # seconds after Q4 before that: the load's aftermath
        "failover_rounds": 1 if quick else 5,
        "timeout": 180 if quick else 900,
    }


def bench_rows(broker, z):
    qt = ["--queue-type", broker.queue_type]
    flow = ["--persistent", "--confirm", "1000", "--prefetch", "1000", "--multi-ack-every", "100"]
    n, t = str(z["backlog"]), str(z["time"])
    return [
        ("Q1", "publish only, 1 producer", ["--consumers", "0", "--persistent", "--confirm", "1000", "--pmessages", n, "--queue", "cq-1", *qt]),
        ("Q2", "consume only, Q1's backlog, 1 consumer", ["--producers", "0", "--prefetch", "1000", "--multi-ack-every", "100", "--cmessages", n, "--queue", "cq-1", "--predeclared"]),
        ("Q3", "1 producer and 1 consumer at once", [*flow, "--time", t, "--queue", "cq-3", *qt]),
    ]


def perftest_rows(broker, z):
    qq = ["-qq"] if broker.queue_type == "quorum" else []
    base = ["-s", "1000", "-f", "persistent", "-ad", "false"]
    n, t = str(z["backlog"]), str(z["time"])
    return [
        ("Q1", [*base, *qq, "-x", "1", "-y", "0", "-c", "1000", "-C", n, "-u", "pt-1"]),
        ("Q2", ["-x", "0", "-y", "1", "-q", "1000", "--multi-ack-every", "100", "-u", "pt-1", "-p", "-D", n, "-z", str(z["timeout"] // 2)]),
        ("Q3", [*base, *qq, "-x", "1", "-y", "1", "-c", "1000", "-q", "1000", "--multi-ack-every", "100", "-u", "pt-3", "-z", t]),
    ]


def q4_parts(z):
    """Q4's queues and clients split over the nodes (1,000 -> 334/333/333; 100 -> 34/33/33)."""
    def split(total):
        return [total // 3 + (1 if i < total % 3 else 0) for i in range(3)]
    flow = ["--persistent", "--confirm", "1000", "--prefetch", "1000", "--multi-ack-every", "100"]
    parts = []
    for n, q, c in zip(NODES, split(z["q4_queues"]), split(z["q4_clients"])):
        parts.append((n, q, [*flow, "--producers", str(c), "--consumers", str(c), "--queues", str(q),
                             "--time", str(z["q4_time"]), "--queue", f"cq-4-n{n}", "--predeclared"]))
    return parts


def declare_many(broker, parts):
    """Declares Q4's queues, each part through its own node, one at a time; returns seconds."""
    t0 = time.monotonic()
    for n, q, _ in parts:
        c = Client("127.0.0.1", broker.port(n), heartbeat=0, timeout=120.0)
        try:
            for i in range(q):
                c.declare(f"cq-4-n{n}-{i}", broker.queue_arguments())
        finally:
            c.close()
    return time.monotonic() - t0


class ConfirmClock(threading.Thread):
    """A publisher with confirms (1 KB persistent, `window` in flight, `rate` per second) that keeps,
    for the failover measurement, the time of the first confirm of a message sent after `mark`."""

    def __init__(self, port, queue, arguments, window=100, rate=1000):
        super().__init__(daemon=True)
        self.port, self.queue, self.arguments, self.window, self.rate = port, queue, arguments, window, rate
        self.mark = None
        self.first_after_mark = None
        self.confirmed = 0
        self.nacked = 0
        self.error = None
        self.longest_gap = 0.0
        self.stop_flag = threading.Event()

    def run(self):
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - reported with the measurement
            self.error = f"{type(e).__name__}: {e}"

    def _run(self):
        c = Client("127.0.0.1", self.port, heartbeat=2, timeout=5.0)
        c.declare(self.queue, self.arguments)
        c.confirm_select()
        sent_at = {}
        tag, started, last_confirm = 0, time.monotonic(), None
        body = b"x" * 1000
        while not self.stop_flag.is_set():
            room = min(self.window - len(sent_at), int((time.monotonic() - started) * self.rate) - tag)
            if room > 0:
                now = time.monotonic()
                c.send(b"".join(c.publish_frames(self.queue, body) for _ in range(room)))
                for _ in range(room):
                    tag += 1
                    sent_at[tag] = now
            for ev in c.events(0.005):
                kind, t, multiple = ev[:3]
                now = time.monotonic()
                tags = [x for x in sent_at if x <= t] if multiple else [t]
                sent = [sent_at.pop(x) for x in tags if x in sent_at]
                if kind == "nack":
                    self.nacked += len(sent)
                    continue
                self.confirmed += len(sent)
                if last_confirm is not None and self.mark is not None:
                    self.longest_gap = max(self.longest_gap, now - last_confirm)
                last_confirm = now
                if self.mark is not None and self.first_after_mark is None and any(s > self.mark for s in sent):
                    self.first_after_mark = now
        c.close()


def failover(broker, z, how="kill9"):
    """Rounds of: a publisher on a node that does not lead the queue; kill -9 of the leader (`how`
    "kill9"; "sigstop": SIGSTOP, a leader silent with its sockets open, as behind a cut link); seconds
    to the first confirm of a message published after it; the killed node restarted (or continued)."""
    queue = "cq-failover" if how == "kill9" else "cq-failover-stop"
    group = broker.declare_located(queue)
    rounds = []
    for _ in range(z["failover_rounds"]):
        leader = broker.leader(group)
        via = next(n for n in NODES if n != leader)
        pub = ConfirmClock(broker.port(via), queue, broker.queue_arguments())
        pub.start()
        deadline = time.monotonic() + 60
        while pub.confirmed < 2000 and pub.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if pub.confirmed < 2000:
            pub.stop_flag.set()
            raise NotMeasurable(f"publisher through node {via} got {pub.confirmed} confirms before the kill ({pub.error})")
        t_kill = time.monotonic()
        if how == "kill9":
            broker.kill9(leader)  # returns once the process is gone
        else:
            broker.signal(leader, signal.SIGSTOP)
        pub.mark = time.monotonic()  # a message sent after this can only be confirmed by a new leader
        while pub.first_after_mark is None and pub.error is None and time.monotonic() - t_kill < 120:
            time.sleep(0.005)
        pub.stop_flag.set()
        pub.join(30)
        if how == "kill9":
            restart = broker.start_node(leader)
        else:
            t0 = time.monotonic()
            broker.signal(leader, signal.SIGCONT)
            restart = time.monotonic() - t0
        if isinstance(broker, WarrenCluster):
            broker.settle()
        if pub.first_after_mark is None:
            raise NotMeasurable(f"no confirm within 120 s of killing node {leader} ({pub.error or 'no error'})")
        r = {"killed": leader, "publisher_on": via, "failover_s": pub.first_after_mark - t_kill,
             "longest_gap_s": pub.longest_gap, "nacked": pub.nacked, "restart_s": restart}
        log(f"  {broker.name:8} failover: leader node {leader} {'killed' if how == 'kill9' else 'stopped'}, first confirm after {r['failover_s']:.2f} s "
            f"(publisher on node {via}; killed node back in {restart:.1f} s)")
        rounds.append(r)
        time.sleep(2)  # let the restarted node settle before the next round
    broker.delete_queues([queue])
    return {"rounds": rounds, "failover_s": sorted(r["failover_s"] for r in rounds)[len(rounds) // 2]}


def catchup(broker, z):
    """A follower stopped, `catchup` messages published, the follower started: how fast it catches up."""
    queue, n = "cq-catchup", z["catchup"]
    group = broker.declare_located(queue)
    leader = broker.leader(group)
    follower = max(x for x in NODES if x != leader)
    if isinstance(broker, RabbitCluster):
        before = broker.log_index(queue, follower, leader)
    else:
        before = broker.log_position(group, follower)[1]
    if before is None:
        raise NotMeasurable(f"no log index for node {follower} in the queue's Raft status")
    broker.stop_node(follower)
    try:
        return _catchup(broker, z, queue, n, group, leader, follower, before)
    finally:
        if not broker.alive(follower):  # a failed measurement leaves the cluster whole for the next rows
            broker.start_node(follower)


def _catchup(broker, z, queue, n, group, leader, follower, before):
    pub = run_bench(broker, "catchup-backlog", ["--consumers", "0", "--persistent", "--confirm", "1000", "--pmessages", str(n),
                                                "--queue", queue, "--predeclared"], z["timeout"], node=leader)
    if pub.get("error"):
        raise NotMeasurable(f"publishing the backlog failed: {pub['error']}")
    if isinstance(broker, RabbitCluster):
        target = broker.log_index(queue, leader, leader)
        r = broker.timed_rejoin(queue, follower, before, target, z["timeout"], leader=leader)
    else:
        target = broker.log_position(group, follower)[0]
        r = broker.timed_rejoin(group, follower, before, target, z["timeout"])
    # The rate is measured between the first and the last observation of the follower's log: entries
    # it took before the first one (while it was booting) are not counted, nor is the time they took.
    # A follower that gets a snapshot (or most of the log before it is first seen) leaves too little to
    # time that way: then the rate is over the time from its AMQP port opening to caught up.
    entries = target - before
    seen = target - r["first_index"]
    took = r["done_s"] - r["first_s"]
    basis = "log"
    if seen < entries / 10 or took <= 0:
        basis, seen, took = "ready", entries, r["done_s"] - (r["ready_s"] or 0)
        if took <= 0:
            raise NotMeasurable(f"node {follower} caught up {r['done_s']:.1f} s after launch, before its AMQP port opened "
                                f"({r['ready_s']:.1f} s): no rate; use a larger backlog")
    msgs = n * seen / entries
    r.update(node=follower, leader=leader, messages=n, entries=entries, seen_entries=seen, msgs_per_s=msgs / took,
             mb_per_s=msgs * 1000 / took / 1e6, launch_to_done_s=r["done_s"], basis=basis)
    log(f"  {broker.name:8} catch-up: node {follower} took {msgs:,.0f} of {n:,} messages ({seen:,} of {entries:,} entries) in "
        f"{took:.2f} s = {r['msgs_per_s']:.0f} msg/s, {r['mb_per_s']:.1f} MB/s; caught up {r['done_s']:.1f} s after launch")
    broker.delete_queues([queue], node=leader)
    return r


def run_broker(broker, z, only, perftest, results):
    """Every row for one broker, in this order: Q1-Q3, PerfTest Q1-Q3, failover, catch-up, Q4, start time."""
    want = lambda k: not only or k in only  # noqa: E731
    R = results.setdefault(broker.name, {})

    def guarded(key, fn):
        try:
            R[key] = fn()
        except NotMeasurable as e:
            log(f"  {broker.name:8} {key}: not yet measurable: {e}")
            R[key] = {"not_measurable": str(e)}
        except (OSError, RuntimeError, AmqpError, subprocess.SubprocessError) as e:
            log(f"  {broker.name:8} {key}: failed: {type(e).__name__}: {e}")
            R[key] = {"error": f"{type(e).__name__}: {e}"[:300]}

    log(f"starting {broker.name} (3 nodes)")
    broker.start()
    R["version"] = broker.version()
    R["cluster"] = broker.describe()
    R["queue_type"] = broker.queue_type
    R["clustered"], R["not_clustered_because"] = broker.clustered()
    log(f"  {broker.name}: {R['cluster']}")
    try:
        for label, _desc, args in bench_rows(broker, z):
            if label == "Q2" and R.get("Q1", {}).get("error"):
                R[label] = {"not_measurable": "no backlog (Q1 failed)"}
            elif want(label):
                R[label] = run_bench(broker, label, args, z["timeout"])
        broker.delete_queues(["cq-1", "cq-3"])
        if perftest and single.PERFTEST_LIB.exists():
            for label, args in perftest_rows(broker, z):
                if label == "Q2" and R.get("PT-Q1", {}).get("error"):
                    R["PT-Q2"] = {"not_measurable": "no backlog (PerfTest Q1 failed)"}
                elif want(label) or want("PT"):
                    R[f"PT-{label}"] = run_perftest(broker, label, args, z["timeout"], z["backlog"] if label != "Q3" else None)
            broker.delete_queues(["pt-1", "pt-3"])
        if want("failover"):
            guarded("failover", lambda: failover(broker, z))
            guarded("failover_stop", lambda: failover(broker, z, "sigstop"))
        if want("catchup"):
            guarded("catchup", lambda: catchup(broker, z))
        if want("Q4") or want("start") or want("idle"):
            parts = q4_parts(z)

            def q4():
                try:
                    declared = declare_many(broker, parts)
                except AmqpError as e:
                    if isinstance(broker, RabbitCluster):
                        raise
                    raise NotMeasurable(f"declaring {broker.queue_type} queues: {e}") from None
                log(f"  {broker.name:8} declared {z['q4_queues']} {broker.queue_type} queues in {declared:.1f} s")
                r = run_bench_spread(broker, "Q4", [(n, a) for n, _, a in parts], z["timeout"])
                r["declare_s"] = declared
                return r
            guarded("Q4", q4)
            q4_ok = "error" not in R["Q4"] and "not_measurable" not in R["Q4"]
            if want("idle") and q4_ok:
                def idle():
                    # Past the load's aftermath (the clients' last acks and closes; each queue's
                    # snapshot and log purge 5 s after its last entry, with what Q4 left queued
                    # written out): what is measured is the cost of idle queues, not of the load.
                    time.sleep(z["idle_settle"])
                    pids = broker.pids()
                    cpu0, t0 = single.cpu_ticks(pids), time.monotonic()
                    time.sleep(z["idle"])
                    cores = (single.cpu_ticks(pids) - cpu0) / (time.monotonic() - t0)
                    log(f"  {broker.name:8} idle with {z['q4_queues']} queues: {cores * 100:.1f}% of a core (3 nodes)")
                    return {"cores": cores, "seconds": z["idle"]}
                guarded("idle", idle)
            if want("start") and q4_ok:
                def start_time():
                    broker.stop_node(3)
                    s = broker.start_node(3)
                    log(f"  {broker.name:8} node 3 holding {z['q4_queues']} queues: started in {s:.2f} s")
                    return {"start_s": s, "queues": z["q4_queues"]}
                guarded("start", start_time)
    finally:
        log(f"stopping {broker.name}")
        broker.stop()


# ---------------------------------------------------------------- the report

def fmt_lat(r, kind):
    p50, p99 = r.get(f"{kind}_p50_us"), r.get(f"{kind}_p99_us")
    return f"{single.fmt_us(p50)} / {single.fmt_us(p99)}" if p50 or p99 else "—"


def flow(r):
    return single.flow_rate(r)


ROW_LATENCY = {"Q1": "confirm", "Q2": None, "Q3": "e2e", "Q4": "e2e"}


def table_rows(W, R, keys, client):
    lines = []
    for key, desc in keys:
        w, r = W.get(key), R.get(key)
        if w is None and r is None:
            continue
        w, r = w or {}, r or {}
        kind = ROW_LATENCY[key.replace("PT-", "")]
        cells = [f"{key}: {desc}", client]
        for x in (w, r):
            bad = x.get("error") or x.get("not_measurable")
            cells.append(f"not yet measurable: {bad}" if bad else single.fmt_rate(flow(x)))
        ok = not (w.get("error") or w.get("not_measurable") or r.get("error") or r.get("not_measurable"))
        cells.append(f"**{flow(w) / flow(r):.1f}×**" if ok and flow(r) else "—")
        cells += [fmt_lat(w, kind) if kind else "—", fmt_lat(r, kind) if kind else "—"]
        wp, rp = (w.get(f"{kind}_p99_us"), r.get(f"{kind}_p99_us")) if kind else (None, None)
        cells.append(("—" if not (ok and wp and rp) else f"{rp / wp:.1f}× lower" if wp <= rp else f"**{wp / rp:.1f}× higher**"))
        for x in (w, r):
            cells.append(f"{x['broker_cores']:.2f} / {x['broker_cpu_us_per_msg']:.1f}" if x.get("broker_cpu_us_per_msg") else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def measure_cell(x, fmt):
    if not x:
        return "not run"
    if x.get("not_measurable"):
        return f"not yet measurable: {x['not_measurable']}"
    if x.get("error"):
        return f"failed: {x['error']}"
    return fmt(x)


def write_section(saved):
    res, facts, started, quick = saved["results"], saved["facts"], saved["started"], saved.get("quick")
    W, R = res.get("Warren", {}), res.get("RabbitMQ", {})
    z = saved["sizes"]
    when = datetime.datetime.fromisoformat(started)
    lines = [
        SECTION,
        "",
        f"Written by `bench/cluster.py{' --quick' if quick else ''}` on {when:%Y-%m-%d %H:%M} UTC; every figure in this "
        "section comes from that one run (Warren's three nodes first, then RabbitMQ's).",
        "",
        f"Machine: {facts.get('cores')} cores ({facts.get('cpu')}), {facts.get('ram_gib')} GiB RAM, Linux {facts.get('kernel')}"
        + (f"; one 4 KiB write+fdatasync {facts['fsync_median_us']} µs (median)" if facts.get("fsync_median_us") else "")
        + ". All three nodes of each broker run on this one machine (one disk, loopback network), with the client.",
        f"Brokers: {W.get('version', '?')} ({W.get('cluster', '?')}; queues declared with x-queue-type "
        f"`{W.get('queue_type', '?')}`{'' if W.get('queue_type', 'quorum') == 'quorum' else ', **not quorum: this run only tries the script**'}"
        f"{'' if W.get('clustered', True) else ', **quorum queues not replicated: see Targets**'}), {R.get('version', '?')} ({R.get('cluster', '?')}; `start_cluster.sh 3`, default "
        "settings, quorum queues).",
        "",
        f"Rows: quorum queue, 1 KB persistent messages, confirms 1000 in flight, prefetch 1000, ack every 100. Q1 publishes "
        f"{z['backlog']:,} messages (1 producer), Q2 drains them (1 consumer), Q3 runs 1 producer and 1 consumer for "
        f"{z['time']} s; their client connects to node 1. Q4: {z['q4_queues']:,} quorum queues, {z['q4_clients']} producers "
        f"and {z['q4_clients']} consumers for {z['q4_time']} s, queues and clients split over the three nodes (one "
        "`warren bench` per node, each queue declared through its node: RabbitMQ places a queue's leader there); rates "
        "are the sums, latencies the worst of the three. Rates are messages consumed per second (published, for Q1). "
        "Latency p50 / p99: confirm latency for Q1, end-to-end (publish to delivery) for Q3 and Q4, none for Q2 (its "
        "messages waited in the backlog). CPU: user+system time of all three nodes' broker processes together "
        "(`warren`, `beam.smp`), as cores busy over the row / µs per message.",
        "",
        "| row | client | Warren msg/s | RabbitMQ msg/s | ratio | Warren p50 / p99 | RabbitMQ p50 / p99 | Warren's p99 | Warren CPU cores / µs per msg | RabbitMQ CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [("Q1", "publish only"), ("Q2", "consume only (Q1's backlog)"), ("Q3", "publish and consume"),
            ("Q4", f"{z['q4_queues']:,} queues, {z['q4_clients']}P/{z['q4_clients']}C")]
    lines += table_rows(W, R, rows, "warren bench")
    lines += table_rows(W, R, [(f"PT-{k}", d) for k, d in rows[:3]], "PerfTest 2.22.1")
    took = [f"{x['Q4']['declare_s']:.1f} s on {name}" for name, x in (("Warren", W), ("RabbitMQ", R)) if x.get("Q4", {}).get("declare_s")]
    if took:
        lines += ["", f"Declaring Q4's {z['q4_queues']:,} queues one after the other took " + " and ".join(took) + "."]
    wrote = [f"{name} {x['Q1']['broker_written_bytes'] / 1e6:,.0f} MB ({x['Q1']['broker_written_bytes'] / 3 / (z['backlog'] * 1000):.2f}× "
             "the messages' bytes per node)" for name, x in (("Warren", W), ("RabbitMQ", R)) if x.get("Q1", {}).get("broker_written_bytes")]
    if wrote:
        lines += ["", f"Written to storage by the three nodes during Q1 ({z['backlog']:,} messages of 1 KB, `write_bytes` of "
                  "/proc/PID/io while the row ran; what a snapshot or checkpoint writes later is not in it): " + ", ".join(wrote) + "."]
    lines += ["", "### Targets (issue 10)", ""]
    if W.get("queue_type", "quorum") != "quorum":
        lines.append(f"- not judged: Warren's rows ran on `{W['queue_type']}` queues (`--warren-queue-type`), not quorum queues.")
    elif not W.get("clustered", True):
        lines.append(f"- not judged: Warren's quorum queues were not replicated over the three nodes "
                     f"({W.get('not_clustered_because')}): its rows measure single-voter groups on the node that declared them.")
    else:
        lines += targets(W, R)
    lines += ["", "### Failover, catch-up, start", "",
              "| measurement | Warren | RabbitMQ |", "|---|---|---|"]

    def fo(x):
        rs = ", ".join(f"{r['failover_s']:.2f}" for r in x["rounds"])
        return f"{x['failover_s']:.2f} s (median of {len(x['rounds'])}: {rs} s; longest gap between confirms {max(r['longest_gap_s'] for r in x['rounds']):.2f} s)"

    def cu(x):
        over = (f"over {x['seen_entries']:,} of {x['entries']:,} entries" if x.get("basis", "log") == "log"
                else "from its AMQP port opening: the log moved in one step, e.g. a snapshot")
        return (f"{x['msgs_per_s'] / 1000:.1f}k msg/s = {x['mb_per_s']:.1f} MB/s ({over}; caught up {x['launch_to_done_s']:.1f} s after launch, AMQP ready after "
                f"{x['ready_s']:.1f} s)")

    def st(x):
        return f"{x['start_s']:.2f} s"

    def idle(x):
        return f"{x['cores'] * 100:.1f}% of one core"
    lines.append(f"| failover: leader killed (kill -9) → first confirm of a message published after the kill, publisher on another node "
                 f"| {measure_cell(W.get('failover'), fo)} | {measure_cell(R.get('failover'), fo)} |")
    lines.append(f"| failover: leader stopped (SIGSTOP: silent, its sockets open, as behind a cut link) → first confirm of a message "
                 f"published after it, publisher on another node | {measure_cell(W.get('failover_stop'), fo)} | {measure_cell(R.get('failover_stop'), fo)} |")
    lines.append(f"| catch-up: a follower stopped, {z['catchup']:,} messages published, the follower started: its log's growth "
                 f"rate from the first observation of it growing to the leader's last entry | {measure_cell(W.get('catchup'), cu)} | {measure_cell(R.get('catchup'), cu)} |")
    lines.append(f"| idle: {z['q4_queues']:,} quorum queues (Q4's), no clients, CPU of the three nodes together over "
                 f"{z['idle']} s from {z['idle_settle']} s after Q4 (issue 10: under 5%) | {measure_cell(W.get('idle'), idle)} | {measure_cell(R.get('idle'), idle)} |")
    lines.append(f"| start: node 3 holding {z['q4_queues']:,} quorum queues (Q4's), stopped cleanly, launch → AMQP handshake "
                 f"| {measure_cell(W.get('start'), st)} | {measure_cell(R.get('start'), st)} |")
    lines += ["", "How: the leader is read from `warren ctl cluster-status --json` (Warren) or `rabbitmqctl list_queues name "
              "leader` (RabbitMQ); the publisher (1 KB persistent, 1,000 msg/s, 100 in flight) is a raw-socket client on "
              "a node that does not lead the queue; the killed node is restarted after each round. Catch-up is watched "
              "from the leader every 0.1 s (Warren: the follower's matched index in `warren ctl cluster-status`) or every "
              "20 ms (RabbitMQ: an Erlang loop on the leader over `rabbit_quorum_queue:status/2`).",
              "", "Commands (`--uri` points at node 1, Q4 at each node; PerfTest `-h` at node 1):", "", "```"]
    cmds = bench_rows(WarrenCluster("quorum"), z)
    for label, _d, args in cmds:
        lines.append(f"{label}: warren bench " + " ".join(args))
    for n, _q, args in q4_parts(z):
        lines.append(f"Q4 (node {n}): warren bench " + " ".join(args))
    for label, args in perftest_rows(WarrenCluster("quorum"), z):
        lines.append(f"PerfTest {label}: " + " ".join(args))
    if W.get("queue_type", "quorum") != "quorum":
        lines.append(f"(Warren's rows: --queue-type {W['queue_type']}, PerfTest without -qq)")
    lines += ["```", "", f"Reproduce: `python3 bench/cluster.py{' --quick' if quick else ''}` (raw outputs in "
              "`target/bench/cluster/`).", ""]
    return "\n".join(lines)


def targets(W, R):
    out = []

    def ok(x):
        return x and not x.get("error") and not x.get("not_measurable") and flow(x)
    for key, goal, client in [("Q1", 5, "warren bench"), ("Q2", 5, "warren bench"), ("Q3", 5, "warren bench"), ("Q4", 5, "warren bench"),
                              ("PT-Q1", 3, "PerfTest"), ("PT-Q2", 3, "PerfTest"), ("PT-Q3", 3, "PerfTest")]:
        w, r = W.get(key), R.get(key)
        if not (ok(w) and ok(r)):
            why = (w or {}).get("not_measurable") or (w or {}).get("error") or "not run"
            out.append(f"- not yet measurable: {key} ({client}): Warren: {why}")
            continue
        x = flow(w) / flow(r)
        out.append(f"- {'met' if x >= goal else '**missed**'}: {key} ({client}): {single.fmt_rate(flow(w))} vs "
                   f"{single.fmt_rate(flow(r))} msg/s = {x:.1f}× (target ≥ {goal}×)")
        kind = ROW_LATENCY[key.replace("PT-", "")]
        if kind and w.get(f"{kind}_p99_us") and r.get(f"{kind}_p99_us"):
            a, b = w[f"{kind}_p99_us"], r[f"{kind}_p99_us"]
            out.append(f"- {'met' if a < b else '**missed**'}: {key} ({client}): p99 {single.fmt_us(a)} vs {single.fmt_us(b)} (target: lower)")
    fo = W.get("failover") or {}
    if fo.get("failover_s") is not None:
        out.append(f"- {'met' if fo['failover_s'] <= 0.4 else '**missed**'}: failover after kill -9 {fo['failover_s']:.2f} s (issue 32: ≤ 0.4 s)")
    fs = W.get("failover_stop") or {}
    if fs.get("failover_s") is not None:
        out.append(f"- {'met' if fs['failover_s'] <= 2 else '**missed**'}: failover after SIGSTOP {fs['failover_s']:.2f} s (issue 32: ≤ 2 s)")
    idle = W.get("idle") or {}
    if idle.get("cores") is not None:
        out.append(f"- {'met' if idle['cores'] < 0.05 else '**missed**'}: idle quorum queues cost {idle['cores'] * 100:.1f}% of a core "
                   "(target < 5% for 1,000 on three nodes)")
    return out


def splice(section):
    """Puts the section into BENCHMARKS.md: in place of an earlier one, else before "## Throughput and CPU"."""
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    if SECTION in lines:
        a = lines.index(SECTION)
        b = next((i for i in range(a + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[a:b] = section.rstrip("\n").splitlines() + [""]
    else:
        at = next((i for i, ln in enumerate(lines) if ln.startswith("## Throughput and CPU")), len(lines))
        lines[at:at] = section.rstrip("\n").splitlines() + [""]
    path.write_text("\n".join(lines) + "\n")


def light_facts():
    facts = {"cores": os.cpu_count(), "kernel": os.uname().release}
    try:
        facts["cpu"] = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name"))
    except StopIteration:
        facts["cpu"] = "?"
    facts["ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    return facts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few seconds per row (for trying the script); the section is "
                    "written to target/bench/cluster/section.md only, unless --write")
    ap.add_argument("--only", default="", help="comma-separated: Q1,Q2,Q3,Q4,PT,failover,catchup,idle,start (default: all)")
    ap.add_argument("--brokers", default="warren,rabbitmq", help="which clusters to run (default: both)")
    ap.add_argument("--no-perftest", action="store_true")
    ap.add_argument("--warren-queue-type", default="quorum", choices=["quorum", "classic"],
                    help="x-queue-type Warren's queues are declared with (classic only to try the script before "
                         "Warren has quorum queues; the report says so)")
    ap.add_argument("--q4-queues", type=int, help="Q4's number of queues (default 1,000; --quick: 99)")
    ap.add_argument("--q4-clients", type=int, help="Q4's producers, and as many consumers (default 100; --quick: 9)")
    ap.add_argument("--write", action="store_true", help="with --quick: write BENCHMARKS.md and bench/cluster-results.md anyway")
    ap.add_argument("--report-only", action="store_true", help="rewrite the section from the last run's results.json")
    opts = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if opts.report_only:
        saved = json.loads((OUT / "results.json").read_text())
        saved["sizes"] = {**sizes(saved.get("quick")), **saved.get("sizes", {})}
    else:
        if not BIN.exists():
            sys.exit(f"{BIN} is not built: cargo build --release -p warren-server")
        started = datetime.datetime.now(datetime.timezone.utc)
        z = sizes(opts.quick)
        z["q4_queues"] = opts.q4_queues or z["q4_queues"]
        z["q4_clients"] = opts.q4_clients or z["q4_clients"]
        facts = light_facts() if opts.quick else single.machine_facts()
        log(json.dumps(facts))
        only = {x.strip() for x in opts.only.split(",") if x.strip()}
        results = {}
        brokers = {"warren": lambda: WarrenCluster(opts.warren_queue_type), "rabbitmq": RabbitCluster}
        for b in opts.brokers.split(","):
            run_broker(brokers[b.strip()](), z, only, not opts.no_perftest, results)
        saved = {"results": results, "facts": facts, "started": started.isoformat(), "quick": opts.quick, "sizes": z}
        (OUT / "results.json").write_text(json.dumps(saved, indent=1))
    section = write_section(saved)
    (OUT / "section.md").write_text(section)
    if saved.get("quick") and not opts.write:
        log(f"quick run: section written to {OUT / 'section.md'} only")
        return
    RESULTS_MD.write_text(section)
    splice(section)
    log("wrote bench/cluster-results.md and its section of BENCHMARKS.md")


if __name__ == "__main__":
    sys.exit(main())
