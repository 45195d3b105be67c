"""Harness: starts the real `warren` binary on free ports with a temporary data dir.

Set WARREN_BIN to test another build. Set WARREN_TEST_EXTERNAL_URL to run the suite against
an already running broker (e.g. RabbitMQ, to check the tests encode RabbitMQ's behaviour);
tests marked `needs_process` or `warren_only` are then skipped. WARREN_TEST_EXTERNAL_HTTP (e.g.
http://guest:guest@127.0.0.1:15672) gives that broker's management API (`http_host`, `http_port`).
"""
import os
import signal
import socket
import subprocess
import time
import urllib.parse
import uuid
from pathlib import Path

import pika
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("WARREN_BIN", str(ROOT / "target" / "release" / "warren"))
# The same broker built with the `test-hooks` feature (`make test` builds it): the only build that
# reads the WARREN_TEST_* switches (a slow fsync, the power-loss simulator, small budgets).
HOOKS_BIN = os.environ.get("WARREN_HOOKS_BIN", str(ROOT / "target" / "release" / "warren-hooks"))


def binary_for(env):
    """The binary to start with environment `env`: the hooks build if a test switch is set."""
    if any(k.startswith("WARREN_TEST_") and k not in ("WARREN_TEST_EXTERNAL_URL", "WARREN_TEST_EXTERNAL_HTTP") and v for k, v in env.items()):
        if not Path(HOOKS_BIN).exists():
            pytest.skip(f"{HOOKS_BIN} is not built (`make test` builds it: cargo build --release -p warren-server --features test-hooks)")
        return HOOKS_BIN
    return BIN
EXTERNAL = os.environ.get("WARREN_TEST_EXTERNAL_URL")
EXTERNAL_HTTP = os.environ.get("WARREN_TEST_EXTERNAL_HTTP")


def stale_binary_reason():
    """Why the default binary is older than the sources it is built from, or None. A helper worktree
    starts with a copy of another checkout's `target/`: its `warren` can predate features the tests
    check (every single-active-consumer test then fails as if the broker ignored the argument)."""
    binary = Path(BIN)
    dep_info = binary.with_suffix(".d")
    if not binary.exists() or not dep_info.exists():
        return None
    built = binary.stat().st_mtime
    # Cargo's dep-info lists every source file the binary was built from, with the absolute paths of
    # the checkout that built it: look at the same files in this one.
    for path in dep_info.read_text().split(":", 1)[-1].split():
        if "/crates/" not in path:
            continue
        source = ROOT / "crates" / path.split("/crates/", 1)[1]
        if source.exists() and source.stat().st_mtime > built:
            return f"{binary} is older than {source.relative_to(ROOT)}: run `cargo build --release` first (or set WARREN_BIN)"
    return None


def pytest_configure(config):
    if not EXTERNAL and "WARREN_BIN" not in os.environ:
        reason = stale_binary_reason()
        if reason:
            raise pytest.UsageError(reason)
    config.addinivalue_line("markers", "needs_process: kills or restarts the broker process")
    config.addinivalue_line("markers", "warren_only: Warren-specific behaviour")


def pytest_collection_modifyitems(config, items):
    if not EXTERNAL:
        return
    skip = pytest.mark.skip(reason="running against an external broker")
    for item in items:
        if "needs_process" in item.keywords or "warren_only" in item.keywords:
            item.add_marker(skip)


_GIVEN_PORTS = set()


def _port_slice():
    """This process's ports to hand out: below the kernel's ephemeral range, where every outgoing
    connection (a cluster node's to its peers, a client's) takes its source port, so a port handed
    out from there could be in use before the broker binds it (a node failed to start with "Address
    already in use" on -n 3); and one slice per pytest-xdist worker, so that two workers never hand
    out the same port. None: the range is not the usual one (then the kernel picks)."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    start, size = 10000 + (index % 8) * 2500, 2500
    return range(start, start + size) if start + size <= low else None


_PORTS = _port_slice()
_NEXT_PORT = [0]


def free_port():
    """A port free now and not handed out before in this run: the kernel may give the same free
    port twice in a row, and a broker whose AMQP and HTTP ports came out equal refused to start."""
    while True:
        if _PORTS is not None:
            if len(_GIVEN_PORTS) >= len(_PORTS):
                raise RuntimeError(f"every port of {_PORTS} was handed out in this run")
            port = _PORTS[_NEXT_PORT[0] % len(_PORTS)]
            _NEXT_PORT[0] += 1
            if port in _GIVEN_PORTS:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue  # something else listens there
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


def eventually(fn, timeout=10.0, interval=0.05):
    """Polls fn until it returns a truthy value (returned) or raises after `timeout`."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - polling
            last = e
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last error: {last!r})")


class Broker:
    def __init__(self, data_dir, log_path):
        self.host = self.http_host = "127.0.0.1"
        self.port = free_port()
        self.http_port = free_port()
        self.prometheus_port = free_port()
        self.data_dir = data_dir
        self.log_path = log_path
        self.proc = None
        self.extra_args = []
        self.bin = None  # None: `binary_for` the environment

    @property
    def url(self):
        return f"amqp://guest:guest@{self.host}:{self.port}/%2F"

    def start(self):
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.bin or binary_for(os.environ), "server", "--amqp-port", str(self.port), "--http-port", str(self.http_port),
             "--prometheus-port", str(self.prometheus_port), "--data-dir", str(self.data_dir), *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT,
        )

        def accepting():
            if self.proc.poll() is not None:
                raise RuntimeError(f"warren exited with {self.proc.returncode}:\n{self.log_text()}")
            with socket.create_connection((self.host, self.port), timeout=0.5):
                return True

        eventually(accepting, timeout=15)

    def log_text(self):
        try:
            return Path(self.log_path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout=20):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def restart(self):
        if self.alive():
            self.terminate()
        self.start()

    def connection(self, **kw):
        params = pika.URLParameters(self.url)
        for k, v in kw.items():
            setattr(params, k, v)
        return pika.BlockingConnection(params)


class ExternalBroker(Broker):
    def __init__(self, url):
        parsed = urllib.parse.urlparse(url)
        self.host = parsed.hostname
        self.port = parsed.port or 5672
        self._url = url
        self.proc = None
        if EXTERNAL_HTTP:
            http = urllib.parse.urlparse(EXTERNAL_HTTP)
            self.http_host = http.hostname
            self.http_port = http.port or 15672

    @property
    def url(self):
        return self._url

    def alive(self):
        return True


@pytest.fixture
def broker(tmp_path, request):
    if EXTERNAL:
        yield ExternalBroker(EXTERNAL)
        return
    b = Broker(tmp_path / "data", tmp_path / "warren.log")
    b.start()
    yield b
    failed = getattr(request.node, "rep_call", None)
    if b.alive():
        b.proc.kill()
        b.proc.wait(10)
    if failed is not None and failed.failed:
        print("---- warren log ----\n" + b.log_text()[-20000:])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def conn(broker):
    c = broker.connection()
    yield c
    if c.is_open:
        try:
            c.close()
        except Exception:  # noqa: BLE001
            pass


@pytest.fixture
def ch(conn):
    return conn.channel()


@pytest.fixture
def name():
    """A unique name, so tests never collide on a shared broker."""
    return "t-" + uuid.uuid4().hex[:12]


def three_node_cluster(tmp_path, secret):
    """Three `warren server` nodes clustered on loopback (free AMQP and cluster ports), started in
    reverse order (the order must not matter); yields {id: Broker} with `cluster_port` set on
    each, and kill -9s the live ones after (printing the log tail of one that panicked). For
    fixtures: `yield from three_node_cluster(...)`."""
    ids = [1, 2, 3]
    cports = {i: free_port() for i in ids}
    peers = ",".join(f"{i}=127.0.0.1:{cports[i]}" for i in ids)
    nodes = {}
    for i in ids:
        b = Broker(tmp_path / f"node{i}", tmp_path / f"node{i}.log")
        b.extra_args = ["--node-id", str(i), "--peers", peers, "--cluster-secret", secret]
        b.cluster_port = cports[i]
        nodes[i] = b
    for i in reversed(ids):
        nodes[i].start()
    yield nodes
    for i, b in nodes.items():
        if b.alive():
            b.kill9()
        text = b.log_text()
        if "panicked" in text:
            print(f"---- node {i} log ----\n" + text[-5000:])
