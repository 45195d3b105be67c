"""Fixtures for the fault tests: three Warren nodes as separate hosts (a network namespace each).

Needs root and `ip netns` (iproute2); without them every test here skips, saying why. Modules:
`netns` (topology and link faults), `nodes` (the node processes), `workload` (publishers and
consumers that reconnect, drain), `nemesis` (faults in a history), `checker` (the verdict).
"""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checker import History  # noqa: E402
from nodes import Cluster, cluster_flags_supported, skip_unless_namespaces  # noqa: E402


def _python_conftest():
    """tests/python/conftest.py under another name (both files are called conftest)."""
    spec = importlib.util.spec_from_file_location("warren_python_conftest", HERE.parent / "python" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_configure(config):
    if "WARREN_BIN" not in os.environ:
        reason = _python_conftest().stale_binary_reason()
        if reason:
            raise pytest.UsageError(reason)
    config.addinivalue_line("markers", "cluster_fault: a fault test against a three-node cluster (issue 10)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def _cluster(tmp_path, request, clustered, extra_env=None, nodes=(1, 2, 3)):
    skip_unless_namespaces()
    c = Cluster(tmp_path, clustered=clustered, extra_env=extra_env, nodes=nodes).create()
    try:
        c.start()
        yield c
    finally:
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            for node in c:
                print(f"---- {node} log ({node.log_path}) ----\n{node.log_tail(6000)}")
        c.destroy()


@pytest.fixture
def standalone(tmp_path, request):
    """Three standalone Warren brokers (no cluster flags), each in its own namespace."""
    yield from _cluster(tmp_path, request, clustered=False)


@pytest.fixture
def cluster(tmp_path, request):
    """Three Warren nodes started as one cluster (`--node-id/--cluster-addr/--peers`)."""
    if not cluster_flags_supported():
        pytest.skip("needs --peers: `warren server` has no cluster flags yet")
    yield from _cluster(tmp_path, request, clustered=True)


@pytest.fixture
def four_nodes(tmp_path, request):
    """Four Warren nodes started as one cluster (for membership changes)."""
    if not cluster_flags_supported():
        pytest.skip("needs --peers: `warren server` has no cluster flags yet")
    yield from _cluster(tmp_path, request, clustered=True, nodes=(1, 2, 3, 4))


@pytest.fixture
def powerloss_cluster(tmp_path, request):
    """`cluster`, each node on the store's power-loss simulator (`WARREN_TEST_SIMULATED_DISK=1`,
    fsyncs delayed 2 ms; `WARREN_CLUSTER_POWER_LOSS=torn` also keeps a torn prefix of the unsynced writes):
    `Node.power_cut()` drops what the node had not fsynced, then kills it."""
    if not cluster_flags_supported():
        pytest.skip("needs --peers: `warren server` has no cluster flags yet")
    # The simulator's fsync is instant: the delay keeps writes waiting for their fsync, as on a
    # disk, so that a cut finds some to drop.
    env = {"WARREN_TEST_SIMULATED_DISK": os.environ.get("WARREN_CLUSTER_POWER_LOSS", "1"), "WARREN_TEST_FSYNC_DELAY_MS": "2"}
    yield from _cluster(tmp_path, request, clustered=True, extra_env=env)


@pytest.fixture
def reordering_powerloss_cluster(tmp_path, request):
    """`powerloss_cluster` whose cuts also keep any subset of the blocks of each unsynced write
    (`WARREN_TEST_SIMULATED_DISK=reordered`): a disk that persists a write's blocks out of order,
    leaving holes followed by valid data."""
    if not cluster_flags_supported():
        pytest.skip("needs --peers: `warren server` has no cluster flags yet")
    env = {"WARREN_TEST_SIMULATED_DISK": "reordered", "WARREN_TEST_FSYNC_DELAY_MS": "2"}
    yield from _cluster(tmp_path, request, clustered=True, extra_env=env)


_reports = []  # (test id, report) of every checked history, printed at the end of the run


@pytest.fixture
def history(request, tmp_path):
    h = History()
    yield h
    if h.report is not None:
        _reports.append((request.node.nodeid, h.report))
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        dump = tmp_path / "history.json"
        h.dump(dump)
        print(f"---- the whole history: {dump} ----")
        print("---- client events (last 60) ----")
        for t, who, what in h.events[-60:]:
            print(f"{t - h.started:8.2f}s {who}: {what}")


def pytest_terminal_summary(terminalreporter):
    """The checker's report of every test (duplicates, pauses per fault), also when all passed."""
    if _reports:
        terminalreporter.section("checker reports")
        for nodeid, report in _reports:
            terminalreporter.write_line(f"{nodeid}\n  {str(report)}")
