"""Three real `warren server` processes on loopback ports forming a cluster (--node-id, --peers,
--cluster-secret): `warren ctl cluster-status` shows the members and the metadata group's leader;
after kill -9 of the leader's process the other two elect a new leader, and the killed node
restarted on its data rejoins. About 10 s."""
import json
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, eventually, three_node_cluster

pytestmark = [pytest.mark.needs_process, pytest.mark.warren_only]

SECRET = "cluster-test-secret"


def ctl(cluster_port, *args, secret=SECRET, check=True):
    out = subprocess.run(
        [BIN, "ctl", "--node", f"127.0.0.1:{cluster_port}", "--cluster-secret", secret, "--timeout", "5", *args],
        capture_output=True, text=True, timeout=30,
    )
    if check and out.returncode != 0:
        raise AssertionError(f"warren ctl {' '.join(args)} failed: {out.stderr}")
    return out


def status(cluster_port):
    return json.loads(ctl(cluster_port, "cluster-status", "--json").stdout)


@pytest.fixture
def cluster(tmp_path):
    yield from three_node_cluster(tmp_path, SECRET)


def group0(st):
    return next(g for g in st["groups"] if g["group"] == 0)


def test_three_processes_form_a_cluster_and_elect_again_after_kill9(cluster):
    st = eventually(lambda: (s := status(cluster[1].cluster_port)) and group0(s)["leader"] and s, timeout=20)
    assert [m["id"] for m in st["members"]] == [1, 2, 3]
    eventually(lambda: all(m["reachable"] for m in status(cluster[1].cluster_port)["members"]), timeout=10)
    # Any node answers with the group as its leader sees it.
    g = eventually(lambda: (g := group0(status(cluster[2].cluster_port)))["state"] == "leader" and g, timeout=10)
    leader = g["leader"]
    assert g["seen_by"] == leader, g
    assert sorted(f["id"] for f in g["followers"]) == sorted({1, 2, 3} - {leader}), g
    text = ctl(cluster[1].cluster_port, "cluster-status").stdout
    assert "Members" in text and "Groups (1)" in text, text

    # The wrong secret is refused.
    bad = ctl(cluster[1].cluster_port, "cluster-status", secret="not-the-secret", check=False)
    assert bad.returncode != 0 and "secret" in bad.stderr, bad.stderr

    cluster[leader].kill9()
    killed = time.monotonic()
    survivor = next(i for i in cluster if i != leader)

    def new_leader():
        g = group0(status(cluster[survivor].cluster_port))
        return g["leader"] not in (None, leader) and g["leader"]

    elected = eventually(new_leader, timeout=15, interval=0.05)
    elapsed = time.monotonic() - killed
    print(f"new leader {elected} {elapsed:.2f}s after kill -9 of node {leader}")
    st = status(cluster[survivor].cluster_port)
    assert {m["id"]: m["reachable"] for m in st["members"]}[leader] is False, st

    # The killed node restarts on its data and rejoins.
    cluster[leader].start()
    eventually(lambda: all(m["reachable"] for m in status(cluster[survivor].cluster_port)["members"]), timeout=15)
    eventually(lambda: (g := group0(status(cluster[leader].cluster_port)))["leader"] == elected
               and g["state"] in ("follower", "leader"), timeout=15)
