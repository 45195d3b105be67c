"""The fault-test harness itself, on three standalone Warren brokers (one per namespace, each its own
broker with a classic durable queue): link faults cut exactly what they say and heal, kill -9 and
restart of a node under confirmed publishing loses nothing the checker can see, SIGSTOP shows as a
pause in confirms. About 20 s in all.
"""
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import netns
from checker import check
from nemesis import Nemesis
from nodes import skip_unless_namespaces
from workload import Client, Workload, drain

QUEUE = "harness-q"


def reachability(cluster):
    """{(from, to): reachable} on the AMQP port, from the root namespace (None) and every peer."""
    topo = cluster.topology
    pairs = [(frm, to) for frm in (None, 1, 2, 3) for to in (1, 2, 3) if frm != to]
    with ThreadPoolExecutor(len(pairs)) as pool:
        ok = pool.map(lambda p: topo.reachable(5672, p[1], p[0], timeout=0.5), pairs)
        return dict(zip(pairs, ok))


def unreachable(cluster):
    return sorted((k for k, ok in reachability(cluster).items() if not ok), key=str)


def wait_until(fn, what, timeout=10):
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.05)


def amqp_works(node):
    c = Client(node.host, node.port, timeout=2)
    try:
        c.declare(QUEUE)
    finally:
        c.close()
    return True


def test_link_faults_cut_exactly_their_links_and_heal(standalone):
    topo = standalone.topology
    assert unreachable(standalone) == []

    topo.isolate(3, clients=True)
    assert unreachable(standalone) == [(1, 3), (2, 3), (3, 1), (3, 2), (None, 3)]
    assert amqp_works(standalone.node(1)) and amqp_works(standalone.node(2))
    topo.heal_all()
    assert unreachable(standalone) == []
    assert amqp_works(standalone.node(3)), "a healed node serves clients again"

    topo.cut(1, 2)  # the bridge case: 1 and 2 both still reach 3, clients reach all
    assert unreachable(standalone) == [(1, 2), (2, 1)]
    topo.heal(1, 2)

    topo.isolate(2)  # peers only: clients still reach it
    assert unreachable(standalone) == [(1, 2), (2, 1), (2, 3), (3, 2)]
    topo.heal_all()

    topo.cut_client(1)  # clients only: peers still reach it
    assert unreachable(standalone) == [(None, 1)]
    topo.heal_client(1)

    # One way: only what 1 sends to 2 is dropped (a TCP connect needs both ways, so it fails both ways).
    topo.one_way(1, 2)
    assert unreachable(standalone) == [(1, 2), (2, 1)]
    assert topo.faults() == [(topo.ns(1), "p2")]
    topo.heal_all()
    assert unreachable(standalone) == [] and topo.faults() == []


def test_a_one_way_drop_passes_the_other_direction(standalone):
    """On a connection made before the fault, 2's bytes still reach 1 while 1's are dropped until
    the heal (TCP then retransmits them)."""
    topo = standalone.topology

    def listen():
        s = socket.socket()
        s.bind((topo.addr(1), 7001))
        s.listen(1)
        return s

    listener = netns.in_netns(topo.ns(1), listen)
    at_2 = netns.in_netns(topo.ns(2), lambda: socket.create_connection((topo.addr(1), 7001), timeout=2))
    at_1, _ = listener.accept()
    at_1.settimeout(1.0)
    at_2.settimeout(1.0)
    try:
        topo.one_way(1, 2)
        at_2.sendall(b"from 2")
        assert at_1.recv(100) == b"from 2"
        at_1.sendall(b"from 1")
        with pytest.raises(socket.timeout):
            at_2.recv(100)
        topo.heal(1, 2)
        at_2.settimeout(5.0)  # the retransmission timer has backed off by now
        assert at_2.recv(100) == b"from 1"
    finally:
        for s in (at_1, at_2, listener):
            s.close()


def test_kill9_and_restart_under_confirmed_publishing_loses_no_confirmed_message(standalone, history):
    rng = random.Random(20261123)
    n1, n2, n3 = (standalone.node(n).target for n in (1, 2, 3))
    # Publishers start on different nodes and move on when theirs dies; one consumer per broker
    # (standalone brokers share nothing), reconnecting to its own.
    work = Workload(QUEUE, history, publishers=[[n1, n2, n3], [n2, n3, n1], [n3, n1, n2]],
                    consumers=[[n1], [n2], [n3]], publisher_opts=dict(window=100, rate=5000)).start()
    nemesis = Nemesis(standalone, history)
    try:
        work.wait_for_confirms(300)
        for victim in (1, 2, 3, rng.choice((1, 2, 3))):
            time.sleep(rng.uniform(0.05, 0.5))
            consumer = work.consumers[victim - 1]
            connects = consumer.connects
            nemesis.kill9_restart(victim, seconds=0.3)
            work.wait_for_confirms(300)
            wait_until(lambda: consumer.connects > connects, f"{consumer.name} reconnected to n{victim}")
    finally:
        work.stop()
    drain(standalone.targets(), QUEUE, history)
    report = check(history)
    print(report)
    report.assert_valid()
    assert report.confirmed >= 1500
    assert all(p.failures >= 1 for p in work.publishers), "each publisher lost its node and moved on"
    assert all(p.resumed_after_heal is not None for p in report.pauses)


def test_the_checker_sees_confirmed_messages_lost_with_a_transient_queue(standalone, history):
    """The negative control: a transient queue is gone after kill -9, so its confirmed messages are
    lost, and the checker must say so (a harness that cannot fail shows nothing)."""
    n1 = standalone.node(1)
    work = Workload("transient-q", history, publishers=[[n1.target]], consumers=[], durable=False).start()
    try:
        work.wait_for_confirms(200)
    finally:
        work.stop()
    Nemesis(standalone, history).kill9_restart(1)
    drain([n1.target], "transient-q", history, durable=False)
    report = check(history)
    print(report)
    assert not report.valid and len(report.lost) == report.confirmed >= 200


def test_sigstop_pauses_confirms_and_sigcont_resumes(standalone, history):
    n1 = standalone.node(1)
    # One publisher bound to node 1 that waits out the pause instead of moving on.
    work = Workload(QUEUE, history, publishers=[[n1.target]], consumers=[[n1.target]],
                    publisher_opts=dict(window=20, rate=500, stall_timeout=30, heartbeat=0),
                    consumer_opts=dict(heartbeat=0)).start()
    try:
        work.wait_for_confirms(100)
        Nemesis(standalone, history).pause_resume(1, seconds=2.0)
        work.wait_for_confirms(100)
    finally:
        work.stop()
    drain([n1.target], QUEUE, history)
    report = check(history)
    print(report)
    report.assert_valid()
    (pause,) = report.pauses
    # No confirm can come from a stopped node (only ones already in our socket buffer: some slack).
    assert pause.longest >= 1.5, "the 2 s stop shows as a pause in confirms"
    assert pause.resumed_after_heal is not None
    assert work.publishers[0].failures == 0, "the connection survived the pause"
    assert time.monotonic() - history.started < 60


def test_namespaces_of_a_killed_run_are_removed_by_the_next_run(tmp_path):
    """A run killed with -9 leaves its namespaces and nodes behind; the next topology removes them
    (and never touches those of a run still alive: its slot lock is held)."""
    skip_unless_namespaces()
    script = ("import subprocess, sys, time; sys.path.insert(0, sys.argv[1]); import netns; "
              "t = netns.Topology().create(); "
              "p = subprocess.Popen(['ip', 'netns', 'exec', t.ns(1), 'sleep', '600']); "
              "print(t.slot, p.pid, flush=True); time.sleep(600)")
    crashed = subprocess.Popen([sys.executable, "-c", script, str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True)
    slot, orphan = map(int, crashed.stdout.readline().split())
    with netns.Topology() as alive:  # made while the other run lives: its namespaces stay
        assert f"wn{slot}-n1" in netns._namespaces() and alive.slot != slot
    crashed.kill()
    crashed.wait()
    assert f"wn{slot}-n1" in netns._namespaces(), "left behind"
    with netns.Topology() as after:
        # It may take the freed slot itself (probing from its pid's slot): then namespaces of that
        # slot are its own, made anew, and the orphan's end (below) shows the leftovers went.
        left = [n for n in netns._namespaces() if n.startswith(f"wn{slot}-") and after.slot != slot]
        assert not left, f"the killed run's namespaces are still there: {left}"
    for _ in range(100):
        if not Path(f"/proc/{orphan}").exists():
            break
        time.sleep(0.02)
    assert not Path(f"/proc/{orphan}").exists(), "the orphan inside the namespace was killed"
