"""Warren nodes, each a real `warren server` process inside its own network namespace.

`Node` starts one (`ip netns exec`), with its own data directory and log, listening on its
namespace's stable address; it can be killed with SIGKILL, stopped with SIGTERM, frozen with SIGSTOP
and thawed with SIGCONT, have its power cut (with `WARREN_TEST_SIMULATED_DISK` in `extra_env`: the
node drops what it had not fsynced, then dies as by SIGKILL), and restarted on the same data directory. `Cluster` is three of them on a
`netns.Topology`. Every namespace has its own ports, so all nodes use the same AMQP and cluster ports.

When the binary's `server --help` lists `--peers` (the cluster flags of issue 10), nodes are started
as one cluster: `--node-id N --cluster-addr ADDR:PORT --peers 1=ADDR:PORT,2=...,3=...`; otherwise
each node is a standalone broker (`Cluster.clustered` says which).
"""
import functools
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import netns
from netns import Topology

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("WARREN_BIN", str(ROOT / "target" / "release" / "warren"))


@functools.lru_cache(maxsize=None)
def _python_conftest():
    import importlib.util
    spec = importlib.util.spec_from_file_location("warren_python_conftest_bin", ROOT / "tests" / "python" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _python_conftest_binary_for(env):
    """tests/python/conftest.py's `binary_for` (the hooks build when a WARREN_TEST_* switch is set);
    WARREN_BIN, when set, for any other start."""
    chosen = _python_conftest().binary_for(env)
    return BIN if chosen == _python_conftest().BIN else chosen
AMQP_PORT = 5672
CLUSTER_PORT = 25672
READY_LINE = b"accepting AMQP 0-9-1 connections on"
CLUSTER_SECRET = "warren-fault-tests"


@functools.lru_cache(maxsize=None)
def server_help():
    return subprocess.run([BIN, "server", "--help"], capture_output=True, text=True).stdout


def cluster_flags_supported():
    """True once `warren server` takes `--node-id`, `--cluster-addr` and `--peers`."""
    h = server_help()
    return all(flag in h for flag in ("--node-id", "--cluster-addr", "--peers"))


_unavailable = []


def skip_unless_namespaces():
    """pytest.skip (saying why) unless namespaces can be made here and the binary is built."""
    import pytest
    if not _unavailable:
        _unavailable.append(netns.unavailable_reason())
    if _unavailable[0]:
        pytest.skip(_unavailable[0])
    if not Path(BIN).exists():
        pytest.skip(f"{BIN} is not built")


class Node:
    def __init__(self, n, topology, base_dir, peers=None, extra_args=(), extra_env=None):
        self.id = n
        self.topology = topology
        self.dir = Path(base_dir) / f"n{n}"
        self.data_dir = self.dir / "data"
        self.log_path = self.dir / "warren.log"
        self.port = AMQP_PORT
        self.cluster_port = CLUSTER_PORT
        self.peers = peers  # {node id: "addr:port"} when clustered, else None
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})  # added to the environment of the node's next starts (test-only hooks)
        self.proc = None
        self.paused = False
        self.dir.mkdir(parents=True, exist_ok=True)

    def __repr__(self):
        return f"n{self.id}"

    @property
    def ns(self):
        return self.topology.ns(self.id)

    @property
    def host(self):
        """The node's stable address, reached from every peer and from the root namespace."""
        return self.topology.addr(self.id)

    @property
    def target(self):
        """(label, host, port) for the workload's clients."""
        return (repr(self), self.host, self.port)

    def command(self):
        cmd = [_python_conftest_binary_for({**os.environ, **self.extra_env}), "server", "--bind", self.host, "--amqp-port", str(self.port),
               "--http-port", str(15672), "--data-dir", str(self.data_dir)]
        if self.peers:
            cmd += ["--node-id", str(self.id), "--cluster-addr", f"{self.host}:{self.cluster_port}",
                    "--peers", ",".join(f"{i}={a}" for i, a in sorted(self.peers.items()))]
        return cmd + self.extra_args

    def env(self):
        # Clients reach a node over its links, not loopback: let `guest` log in from anywhere.
        env = {**os.environ, "WARREN_LOOPBACK_USERS": "", **self.extra_env}
        if "--cluster-secret" in server_help():
            env["WARREN_CLUSTER_SECRET"] = CLUSTER_SECRET  # for the nodes and `warren ctl`
        return env

    def start(self, wait=True, timeout=20):
        assert not self.alive(), f"{self} is already running"
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            log.write(f"---- harness: starting {self} at {time.strftime('%H:%M:%S')} ----\n".encode())
            log.flush()
            self.proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *self.command()], env=self.env(),
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.paused = False
        if wait:
            self.wait_ready(offset, timeout)
        return self

    def wait_ready(self, offset=0, timeout=20):
        """Waits for this start's "accepting AMQP ..." log line (the listener is bound)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self} exited with {self.proc.returncode}:\n{self.log_tail()}")
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                if READY_LINE in f.read():
                    return
            time.sleep(0.02)
        raise TimeoutError(f"{self} not ready within {timeout}s:\n{self.log_tail()}")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill9(self):
        """SIGKILL (also of a frozen node) and reap."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.paused = False

    def terminate(self, timeout=20):
        """SIGTERM (a frozen node is thawed first); returns the exit code."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        if self.paused:
            self.resume()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def power_cut(self, timeout=20):
        """SIGUSR2 to a node started with WARREN_TEST_SIMULATED_DISK: its data directory is rewritten
        to what a machine crash would leave (unsynced writes dropped), then it kills itself (SIGKILL).
        Returns the server's "power cut" log line (what was dropped)."""
        return self.wait_power_cut(self.cut_power(), timeout)

    def cut_power(self):
        """Sends the power cut (see `power_cut`) without waiting; returns what `wait_power_cut` needs."""
        assert self.extra_env.get("WARREN_TEST_SIMULATED_DISK") not in (None, "", "0"), \
            f"{self} does not run on the power-loss simulator"
        offset = self.log_path.stat().st_size
        if self.paused:
            self.resume()
        self.proc.send_signal(signal.SIGUSR2)
        return offset

    def wait_power_cut(self, offset, timeout=20):
        """Waits for the node to die of the power cut sent by `cut_power`; returns its log line."""
        code = self.proc.wait(timeout)
        if code != -signal.SIGKILL:
            raise AssertionError(f"{self} exited with {code} on SIGUSR2, not by its power cut:\n{self.log_tail()}")
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            text = re.sub(r"\x1b\[[0-9;]*m", "", f.read().decode(errors="replace"))  # no colours
        lines = [ln for ln in text.splitlines() if "power cut" in ln]
        assert lines, f"{self} died without logging its power cut:\n{self.log_tail()}"
        return lines[-1]

    def pause(self):
        """SIGSTOP: the process keeps its sockets open but does nothing, like a long GC or VM stall."""
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def restart(self, wait=True):
        """Kill -9 if running, then start on the same data directory."""
        self.kill9()
        return self.start(wait=wait)

    def mark(self, text):
        """Appends a harness line with the wall-clock time to this node's log."""
        stamp = time.strftime("%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}"
        with open(self.log_path, "ab") as log:
            log.write(f"---- harness: {stamp} UTC {text} ----\n".encode())

    def log_text(self):
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars=4000):
        return self.log_text()[-chars:]

    def ctl(self, *args, timeout=10):
        """Runs `warren ctl ARGS` inside this node's namespace; returns the completed process."""
        return subprocess.run(["ip", "netns", "exec", self.ns, BIN, "ctl", *args], env=self.env(),
                              capture_output=True, text=True, timeout=timeout)


class Cluster:
    """Three nodes on their own topology. `clustered` is True when they were started as one cluster
    (the binary has the cluster flags, or `clustered=True` was asked), else each is standalone."""

    def __init__(self, base_dir, clustered=None, extra_args=(), nodes=(1, 2, 3), extra_env=None):
        self.base_dir = Path(base_dir)
        self.clustered = cluster_flags_supported() if clustered is None else clustered
        self.topology = Topology(nodes)
        self.extra_args = extra_args
        self.extra_env = extra_env
        self.nodes = {}

    def create(self):
        self.topology.create()
        peers = None
        if self.clustered:
            peers = {n: f"{self.topology.addr(n)}:{CLUSTER_PORT}" for n in self.topology.nodes}
        self.nodes = {n: Node(n, self.topology, self.base_dir, peers, self.extra_args, self.extra_env)
                      for n in self.topology.nodes}
        return self

    def start(self, timeout=30):
        """Starts every node at once (a cluster forms only with a majority up), then waits for each."""
        offsets = {}
        for node in self.nodes.values():
            offsets[node.id] = node.log_path.stat().st_size if node.log_path.exists() else 0
            node.start(wait=False)
        for node in self.nodes.values():
            node.wait_ready(offsets[node.id], timeout)
        return self

    def node(self, n):
        return self.nodes[n]

    def __iter__(self):
        return iter(self.nodes.values())

    def targets(self):
        return [node.target for node in self]

    def statuses(self):
        """`warren ctl --json cluster-status` of each live node that answers: yields (node, status
        dict) or (node, error string)."""
        for node in self:
            if not node.alive() or node.paused:
                continue
            status = node.ctl("--node", f"{node.host}:{node.cluster_port}", "--json", "--timeout", "3", "cluster-status")
            if status.returncode != 0:
                yield node, status.stderr.strip()[:200]
                continue
            try:
                yield node, json.loads(status.stdout)
            except ValueError:
                yield node, status.stdout[:200]

    def wait_caught_up(self, n, timeout=60):
        """Waits until node n (just restarted) holds, in every group it is a voter of, at least
        what the group's leader had when n was first seen back: each leader lists n as a follower
        whose matched index reached the leader's last log index of then (or n leads the group).
        Returns the seconds it took."""
        started = time.monotonic()
        deadline = started + timeout
        targets = {}  # group -> the leader's last log index when n was first seen back
        last = ""
        while time.monotonic() < deadline:
            for node, status in self.statuses():
                if not isinstance(status, dict):
                    last = f"{node}: {status}"
                    continue
                leads = [g for g in status.get("groups", []) if g.get("state") == "leader"]
                mine = [g for g in status.get("groups", []) if n in (g.get("voters") or [])]
                if not mine or any(g.get("leader") is None for g in mine):
                    last = f"{node}: groups without a leader: {mine}"
                    continue
                behind = []
                for g in leads:
                    if n not in (g.get("voters") or []):
                        continue
                    gid = g["group"]
                    if g.get("leader") == n:
                        targets.setdefault(gid, 0)
                        continue
                    targets.setdefault(gid, g.get("last_log_index") or 0)
                    f = [f for f in g.get("followers", []) if f.get("id") == n]
                    matched = f[0].get("matched") if f else None
                    if matched is None or matched < targets[gid]:
                        behind.append((gid, matched, targets[gid]))
                known = {g["group"] for g in leads}
                missing = [g["group"] for g in mine if g["group"] not in known]
                if not behind and not missing:
                    return time.monotonic() - started
                last = f"{node}: n{n} behind in {behind}, leaders' views missing for groups {missing}"
                break  # one answering node's view is the whole cluster's (it asks its peers)
            time.sleep(0.2)
        raise AssertionError(f"n{n} not caught up within {timeout} s ({last})")

    def leader(self, queue=None, timeout=20, group=None):
        """The node leading `queue`'s group (None: the metadata group), from `warren ctl
        cluster-status --json` asked of every live node; waits until a leader is known. With
        several quorum queues, `group` names the queue's group (its queue id: the n-th quorum
        queue declared in a fresh cluster has id n).

        Every node is asked and the claim of the highest term wins: a leader cut off a moment ago
        still names itself (its links may not be back yet), while the others follow a newer one.
        The status names groups by id (a quorum queue's group id is its queue id), not by queue
        name: a test's cluster holds one quorum queue, so its group is the one group besides 0."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            claims = []  # (term, leader)
            for node, status in self.statuses():
                if not isinstance(status, dict):
                    last = status
                    continue
                groups = status.get("groups", [])
                if queue is None:
                    wanted = [g for g in groups if g.get("group") == 0]
                elif group is not None:
                    wanted = [g for g in groups if g.get("group") == group]
                else:
                    wanted = [g for g in groups if g.get("group") != 0]
                    if len({g.get("group") for g in wanted}) > 1:
                        raise AssertionError(f"several quorum queue groups, cannot tell {queue!r}'s: {groups}")
                claims += [(g.get("term") or 0, g.get("leader")) for g in wanted if g.get("leader")]
                if not claims:
                    last = f"no leader yet: {wanted}"
            if claims:
                return max(claims)[1]
            time.sleep(0.2)
        raise AssertionError(f"no leader of {queue or 'the metadata group'} within {timeout} s ({last})")

    def mark(self, text):
        """Writes a harness line into every node's log (to line faults up with what the nodes did)."""
        for node in self:
            node.mark(text)

    def destroy(self):
        """Kills every node and removes the topology. Returns the nodes' log tails for a failed test."""
        for node in self.nodes.values():
            if node.alive():
                if node.paused:
                    node.resume()
                node.kill9()
        self.topology.destroy()
