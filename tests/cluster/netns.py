"""Three (or four) hosts on one machine: a network namespace per node, a full mesh of links, faults on links.

Layout for a topology in slot S (a number 0..63 owned by one test run, see `claim_slot`):

- namespace `wn{S}-n{N}` for node N (1..3, or 1..4 for a membership test), with `lo` up and the node's stable address
  `10.77.S.N/32` on `lo`: every peer and every client reaches node N at that one address;
- a veth pair per pair of nodes (a<b, pair index k: (1,2)=0, (1,3)=1, (2,3)=2, (1,4)=3, (2,4)=4,
  (3,4)=5), named `p{b}` in a's
  namespace and `p{a}` in b's, addressed `10.78.S.(4k+1)/30` (a) and `10.78.S.(4k+2)/30` (b); a
  host route sends `10.77.S.b` over it with source `10.77.S.a`, so a peer always sees the stable
  address. Cutting one pair therefore leaves both ends reaching the third node (the "bridge" case);
- a client link per node from the root namespace (where test clients run): `wn{S}c{N}` in the root,
  `c0` in the node's namespace, `10.79.S.(4(N-1)+1)/30` (root) and `+2` (node), with a root route
  to `10.77.S.N` over it. A client can be cut off from one node separately from the node's peers.

A fault is a `pfifo limit 0` root qdisc on a link end: every packet leaving that end is dropped
silently (no error to the sender, as when a switch or cable fails), routes and addresses stay, so
deleting the qdisc heals at once. The kernel has no `netem`. Dropping on one end only is a one-way
fault: `one_way(a, b)` drops what a sends to b while b's packets still reach a.

Slots make concurrent runs (several worktrees on one machine) independent: each run holds a lock
file for its slot while its namespaces live; a namespace whose slot lock nobody holds is a leftover
of a run that died and is removed (with the processes inside it) by the next run.
"""
import ctypes
import fcntl
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

NODES = (1, 2, 3)
# What the addressing covers: a fourth node for the membership tests (`remove-node`, `grow`).
MAX_NODES = (1, 2, 3, 4)
SLOTS = 64
LOCK_DIR = Path(os.environ.get("WARREN_NETNS_LOCK_DIR", "/tmp/warren-netns"))
NAME = re.compile(r"^wn(\d+)-n\d+$")
CLONE_NEWNET = 0x40000000


class Unavailable(Exception):
    """Network namespaces cannot be used here (not root, no `ip`, no permission): tests skip."""


def run(*args, check=True):
    """Runs a command; returns its stdout. Raises with the command's stderr on failure."""
    p = subprocess.run(args, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def unavailable_reason():
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"wn-probe-{os.getpid()}"
    try:
        run("ip", "netns", "add", probe)
        run("ip", "netns", "del", probe)
    except FileNotFoundError:
        return "`ip` (iproute2) is not installed"
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    try:
        run("tc", "-V")
    except (FileNotFoundError, RuntimeError):
        return "`tc` (iproute2) is not installed"
    return None


def _lock(slot):
    """The slot's lock file descriptor if this process could take it, else None."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK_DIR / f"slot-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _namespaces():
    out = run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _remove_namespace(name):
    """Kills what runs inside `name` (a leftover's orphaned nodes) and deletes it."""
    for pid in run("ip", "netns", "pids", name, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    for _ in range(200):  # the namespace goes once its last process has exited (slower on a busy machine)
        if not run("ip", "netns", "pids", name, check=False).split():
            break
        time.sleep(0.05)
    why = ""
    for _ in range(50):  # a deletion can fail while the kernel still tears down what ran inside
        p = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
        if name not in _namespaces():
            return
        why = f"exit {p.returncode}: {p.stderr.strip()}"
        time.sleep(0.1)
    pids = run("ip", "netns", "pids", name, check=False).split()
    raise RuntimeError(f"network namespace {name} could not be deleted in 5 s (ip netns del: {why}; pids inside: {pids})")


def remove_leftovers():
    """Deletes the namespaces of every slot no live run holds (a crashed or killed earlier run)."""
    by_slot = {}
    for name in _namespaces():
        m = NAME.match(name)
        if m:
            by_slot.setdefault(int(m.group(1)), []).append(name)
    for slot, names in by_slot.items():
        fd = _lock(slot)
        if fd is None:
            continue  # a live run owns it
        try:
            for name in names:
                _remove_namespace(name)
        finally:
            os.close(fd)


def claim_slot():
    """(slot, lock fd) of a free slot, starting from one derived from the pid."""
    start = os.getpid() % SLOTS
    for i in range(SLOTS):
        slot = (start + i) % SLOTS
        fd = _lock(slot)
        if fd is not None:
            return slot, fd
    raise RuntimeError(f"all {SLOTS} topology slots are held by live runs")


def pair_index(a, b):
    a, b = min(a, b), max(a, b)
    return {(1, 2): 0, (1, 3): 1, (2, 3): 2, (1, 4): 3, (2, 4): 4, (3, 4): 5}[(a, b)]


class Topology:
    """The namespaces and links of one test run. `create()` builds them, `destroy()` removes them.

    Faults: `cut(a, b)`, `one_way(a, b)`, `isolate(a)`, `cut_client(a)`, and their heals
    `heal(a, b)`, `heal_client(a)`, `heal_all()`. `faults()` lists the link ends now dropping."""

    def __init__(self, nodes=NODES):
        self.nodes = tuple(nodes)
        assert set(self.nodes) <= set(MAX_NODES), "the mesh addressing covers nodes 1..4"
        self.slot = None
        self._lock_fd = None
        self._dropping = set()  # (namespace or None for root, interface)

    # ---- names and addresses ----
    def ns(self, n):
        return f"wn{self.slot}-n{n}"

    def addr(self, n):
        """Node n's stable address: what peers and clients connect to."""
        return f"10.77.{self.slot}.{n}"

    def _pair_addr(self, a, b):
        """Address of a's end of the a-b link."""
        k = pair_index(a, b)
        return f"10.78.{self.slot}.{4 * k + (1 if a < b else 2)}"

    def _client_root_if(self, n):
        return f"wn{self.slot}c{n}"

    def _client_addrs(self, n):
        base = 4 * (n - 1)
        return f"10.79.{self.slot}.{base + 1}", f"10.79.{self.slot}.{base + 2}"  # root, node

    # ---- life ----
    def create(self):
        remove_leftovers()
        self.slot, self._lock_fd = claim_slot()
        for n in self.nodes:  # a leftover of our own slot from a run that died after taking it
            if self.ns(n) in _namespaces():
                _remove_namespace(self.ns(n))
        try:
            self._build()
        except Exception:
            self.destroy()
            raise
        return self

    def _build(self):
        for n in self.nodes:
            ns = self.ns(n)
            run("ip", "netns", "add", ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "-n", ns, "addr", "add", f"{self.addr(n)}/32", "dev", "lo")
        for a in self.nodes:
            for b in self.nodes:
                if a < b:
                    run("ip", "link", "add", f"p{b}", "netns", self.ns(a), "type", "veth",
                        "peer", "name", f"p{a}", "netns", self.ns(b))
                    for x, y in ((a, b), (b, a)):
                        run("ip", "-n", self.ns(x), "addr", "add", f"{self._pair_addr(x, y)}/30", "dev", f"p{y}")
                        run("ip", "-n", self.ns(x), "link", "set", f"p{y}", "up")
        for a in self.nodes:
            for b in self.nodes:
                if a != b:
                    run("ip", "-n", self.ns(a), "route", "add", f"{self.addr(b)}/32", "via", self._pair_addr(b, a),
                        "dev", f"p{b}", "src", self.addr(a))
        for n in self.nodes:
            root_if, (root_ip, node_ip) = self._client_root_if(n), self._client_addrs(n)
            run("ip", "link", "del", root_if, check=False)  # a leftover root end whose namespace is gone
            run("ip", "link", "add", root_if, "type", "veth", "peer", "name", "c0", "netns", self.ns(n))
            run("ip", "addr", "add", f"{root_ip}/30", "dev", root_if)
            run("ip", "link", "set", root_if, "up")
            run("ip", "-n", self.ns(n), "addr", "add", f"{node_ip}/30", "dev", "c0")
            run("ip", "-n", self.ns(n), "link", "set", "c0", "up")
            run("ip", "route", "add", f"{self.addr(n)}/32", "via", node_ip, "dev", root_if)

    def destroy(self):
        """Removes the namespaces (killing what still runs in them) and the root ends of the links."""
        if self.slot is None:
            return
        for n in self.nodes:
            _remove_namespace(self.ns(n))
            run("ip", "link", "del", self._client_root_if(n), check=False)
        self._dropping.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.destroy()

    # ---- faults ----
    def _drop(self, ns, dev):
        cmd = ["tc"] + (["-n", ns] if ns else []) + ["qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "0"]
        run(*cmd)
        self._dropping.add((ns, dev))

    def _pass(self, ns, dev):
        cmd = ["tc"] + (["-n", ns] if ns else []) + ["qdisc", "del", "dev", dev, "root"]
        run(*cmd, check=False)  # no qdisc: nothing to heal
        self._dropping.discard((ns, dev))

    def one_way(self, a, b):
        """Drops everything node a sends to node b; b's packets still reach a."""
        self._drop(self.ns(a), f"p{b}")

    def cut(self, a, b):
        """Cuts the link between nodes a and b both ways; both still reach the third node."""
        self._drop(self.ns(a), f"p{b}")
        self._drop(self.ns(b), f"p{a}")

    def heal(self, a, b):
        self._pass(self.ns(a), f"p{b}")
        self._pass(self.ns(b), f"p{a}")

    def isolate(self, a, clients=False):
        """Cuts node a from every peer (and, with `clients`, from the test clients too)."""
        for b in self.nodes:
            if b != a:
                self.cut(a, b)
        if clients:
            self.cut_client(a)

    def cut_client(self, n):
        """Cuts the root namespace's clients off node n (both ways); n still reaches its peers."""
        self._drop(None, self._client_root_if(n))
        self._drop(self.ns(n), "c0")

    def heal_client(self, n):
        self._pass(None, self._client_root_if(n))
        self._pass(self.ns(n), "c0")

    def heal_all(self):
        for ns, dev in list(self._dropping):
            self._pass(ns, dev)

    def faults(self):
        return sorted(self._dropping, key=str)

    # ---- reachability ----
    def reachable(self, port, to, frm=None, timeout=1.0):
        """True if a TCP connect from node `frm`'s namespace (None: the root, where clients run)
        to node `to`'s stable address and `port` completes within `timeout`."""
        def connect():
            with socket.create_connection((self.addr(to), port), timeout=timeout):
                return True
        try:
            return in_netns(self.ns(frm) if frm else None, connect)
        except OSError:
            return False


_libc = ctypes.CDLL(None, use_errno=True)


def in_netns(ns, fn):
    """Runs fn() on a fresh thread that has entered namespace `ns` (None: this one) and returns its
    result. A socket made inside stays in that namespace, so a client can live in a node's
    namespace while the test drives it from here."""
    if ns is None:
        return fn()
    out = {}

    def body():
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({ns}): {os.strerror(err)}")
            finally:
                os.close(fd)
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            out["error"] = e

    t = threading.Thread(target=body, name=f"in-{ns}")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
