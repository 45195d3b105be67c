"""Fault tests of issue 10 against a three-node Warren cluster and one quorum queue.

Each test runs publishers with confirms and consumers with manual acks on every node (each
reconnects to the next node when its own fails), and on every node a consumer that cancels and
closes its connection every second or so and connects again (a fault loses some of those cancels,
closes and acks on their way to the leader), a publisher without confirms, a transactional
publisher (10 messages a commit: a commit-ok confirms them), a publisher of delayed messages
(through an `x-delayed-message` exchange, `x-delay` 1-3,000 ms: the queue's group holds them until
due, across the faults), basic.get consumers with and without acks (each node's, so most of the
time on a follower). The queue keeps consumed messages 30 s (`x-retention-seconds`); with
`rewinds`, a rewinder also rewinds it every 2 s or so through a random node's HTTP API to up to
3 s ago (what was consumed since comes again: duplicates the checker allows), and once more after
the faults. It does its fault REPEATS times
(waiting after each heal until confirms flow again), drains the queue and asks the checker:
nothing confirmed or committed lost, nothing published without confirms lost while the cluster
was healthy, nothing unexpected, no delayed message delivered before its due time; duplicates and the longest pause in confirms per fault are
printed.

A test skipped (`not_yet`) until the cluster passes it: remove its marker once it passes 3 times
in a row (the `cluster` fixture also skips while `warren server` has no `--peers`); set
WARREN_CLUSTER_FAULTS=1 to run them anyway. All run now. Lengths (about 5 × (fault + recovery)):
kill -9 of the leader and of all three about 15-30 s each, isolating the leader ~35 s, cutting one
pair ~27 s, SIGSTOP ~33 s, the power cut of one node at a time ~15 s, the rolling restart ~40 s.
Each run leaves `timeline.txt` next to the node logs.
"""
import os
import time

import pytest

from checker import check, write_timeline
from nemesis import Nemesis
from workload import Client, Rejecter, Workload, drain, rewind_through_any

pytestmark = [pytest.mark.cluster_fault]
not_yet = pytest.mark.skipif(os.environ.get("WARREN_CLUSTER_FAULTS") != "1",
                             reason="the cluster does not pass this fault yet (WARREN_CLUSTER_FAULTS=1 runs it)")

QUEUE = "faults-q"
QUORUM = {"x-queue-type": "quorum"}
RETAINED = {**QUORUM, "x-retention-seconds": 30}  # the fault workload's queue, rewound now and then
REPEATS = 5
PAST_ELECTION = 5.0  # seconds a fault lasts: well past an election timeout


def run_faults(cluster, history, fault, repeats=REPEATS, rebalanced=False, message_size=64, rewinds=False):
    """Runs the workload, calls fault(round) `repeats` times, drains, checks; returns the report.

    With `rebalanced`, each round after the first starts once the queue's leadership is back on
    the node that led it before the first fault (nodes hand a group back to its preferred member
    once it returns and has caught up): the fault then hits a recovered cluster, not one still
    recovering from the last round, where clients that moved off the faulted node may all sit on
    the node that the test faults next. Waiting for it also checks that rebalancing happens."""
    targets = cluster.targets()
    rotations = [targets[i:] + targets[:i] for i in range(len(targets))]
    work = Workload(QUEUE, history, publishers=rotations, consumers=rotations, churning=rotations, arguments=RETAINED,
                    publisher_opts=dict(window=100, rate=2000, stall_timeout=5.0, size=message_size),
                    plain=rotations, tx=rotations, getters=rotations, no_ack_getters=rotations,
                    delayed=rotations, delayed_opts=dict(window=50, rate=200, stall_timeout=5.0, max_delay_ms=3000),
                    rewinders=[targets] if rewinds else []).start()
    try:
        work.wait_for_confirms(300, timeout=30)
        home = cluster.leader(QUEUE) if rebalanced else None
        for r in range(repeats):
            if home is not None and r > 0:
                wait_for_leader(cluster, home, timeout=20)
            fault(r)
            work.wait_for_confirms(300, timeout=30)  # service is back after the heal
            history.recovered()  # healthy again: what is published without confirms from now on must arrive
    finally:
        work.stop()
        write_timeline(history, cluster.base_dir / "timeline.txt")  # next to the node logs
    if rewinds:
        # One more rewind once healed (the workload's may all have met a fault), to the oldest
        # message retained: what was consumed since comes again, and the drain must take it too. It
        # may find nothing to rewind: when the consumers lag behind the redeliveries of earlier
        # rewinds, nothing published since was consumed yet (all of it is ready already). So the
        # rewinds together must have made messages ready again, not this one alone.
        last = rewind_through_any(targets, QUEUE, int(time.time() * 1000) - RETAINED["x-retention-seconds"] * 1000)
        assert last["rewound"] > 0 or any(r.rewound > 0 for r in work.rewinders), (last, "no rewind made a message ready again")
    # Delayed messages not due yet are not counted ready: the drain starts once all are due by the
    # clients' clock, and ends once the node shows none delayed (a new leader's timer may be late).
    last_due = history.last_due()
    if last_due is not None:
        time.sleep(max(0.0, last_due - time.monotonic()))
    drain(targets[:1], QUEUE, history, arguments=RETAINED, delayed=True)  # one queue, served by every node
    report = check(history)
    assert report.delayed > 0, "delayed messages were published"
    print(report)
    if rewinds:
        rewinders = work.rewinders
        print(f"rewinds: {sum(r.answered for r in rewinders)} answered ({sum(r.rewound for r in rewinders)} messages), "
              f"{sum(r.failed for r in rewinders)} failed or timed out")
    report.assert_valid()
    assert all(p.resumed_after_heal is not None for p in report.pauses), "confirms resumed after every fault"
    return report


def wait_for_leader(cluster, node, timeout):
    """Waits until `node` leads the test queue again (rebalanced after a heal)."""
    deadline = time.monotonic() + timeout
    while (leader := cluster.leader(QUEUE)) != node:
        assert time.monotonic() < deadline, f"the queue's leadership did not return to n{node} within {timeout}s (n{leader} leads)"
        time.sleep(0.2)


def test_kill9_of_the_leader_then_restart(cluster, history):
    nemesis = Nemesis(cluster, history)
    run_faults(cluster, history, lambda r: nemesis.kill9_restart(cluster.leader(QUEUE), seconds=1.0))


def test_rewinds_through_isolating_the_leader(cluster, history):
    """The isolation test with a rewinder (issue 36): the isolated leader catches up by installing
    a snapshot, so it must fetch the bodies of the consumed messages kept for a rewind with the live
    ones (before that fix its consumers held rewound messages undelivered, `no body on this node`,
    and the drain through it lost messages behind them), and must never read a body from the
    entries its log held past what it applied (the group never committed them)."""
    nemesis = Nemesis(cluster, history)
    run_faults(cluster, history, lambda r: nemesis.isolate_heal(cluster.leader(QUEUE), PAST_ELECTION), rebalanced=True, rewinds=True)


def test_rewinds_through_kill9_of_the_leader_then_restart(cluster, history):
    """Rewinds through random nodes while the queue's leader is killed -9 and restarted, five
    times: every confirmed message is delivered, none before due; what the rewinds bring back
    comes again (duplicates)."""
    nemesis = Nemesis(cluster, history)
    run_faults(cluster, history, lambda r: nemesis.kill9_restart(cluster.leader(QUEUE), seconds=1.0), rewinds=True)


def test_isolating_the_leader_then_healing(cluster, history):
    nemesis = Nemesis(cluster, history)
    run_faults(cluster, history, lambda r: nemesis.isolate_heal(cluster.leader(QUEUE), PAST_ELECTION), rebalanced=True)


def test_cutting_one_pair_while_both_reach_the_third(cluster, history):
    nemesis = Nemesis(cluster, history)

    def fault(r):
        leader = cluster.leader(QUEUE)
        follower = [n for n in (1, 2, 3) if n != leader][r % 2]
        nemesis.cut_heal(leader, follower, PAST_ELECTION)

    run_faults(cluster, history, fault, rebalanced=True)


def test_sigstop_of_the_leader_past_the_election_timeout(cluster, history):
    nemesis = Nemesis(cluster, history)
    run_faults(cluster, history, lambda r: nemesis.pause_resume(cluster.leader(QUEUE), PAST_ELECTION), rebalanced=True)


def test_kill9_of_all_three_then_restart(cluster, history):
    nemesis = Nemesis(cluster, history)
    run_faults(cluster, history, lambda r: nemesis.kill9_all_restart(seconds=1.0))


def test_power_cut_of_one_node_at_a_time(powerloss_cluster, history):
    """The power-loss layer on one node at a time: every node runs on the store's simulator, and
    each round cuts one node's power (what it had not fsynced is dropped, then it dies as by
    SIGKILL): the queue's leader, then a follower, alternating. The node is restarted on what is
    left and must catch up before the next cut. A confirm is a promise of a majority's fsync: a
    node that confirmed (or voted, or acknowledged an append) before its fsync shows up here."""
    cluster = powerloss_cluster
    nemesis = Nemesis(cluster, history)
    caught_up = []

    def fault(r):
        leader = cluster.leader(QUEUE)
        n = leader if r % 2 == 0 else [m for m in (1, 2, 3) if m != leader][(r // 2) % 2]
        nemesis.power_cut_restart(n, seconds=1.0)
        caught_up.append((f"n{n}{' (leader)' if n == leader else ''}", round(cluster.wait_caught_up(n), 2)))

    run_faults(cluster, history, fault)
    print("caught up after each cut (s):", caught_up)
    print("what each cut dropped:", [(who, what) for _, who, what in history.events if what.startswith("files=")])


def test_power_cut_of_all_three_at_once(reordering_powerloss_cluster, history):
    """Issue 34: a data-centre power loss. Each round cuts the three nodes' power at the same
    moment: each disk keeps what it had fsynced plus any subset of the blocks of its unsynced
    writes (persisted out of order: a WAL tail can hold a hole followed by valid records). All three
    restart with default options: each must start on its own (a torn tail cut, never a refusal
    that waits for an operator), the cluster elects, and every confirmed message is there."""
    cluster = reordering_powerloss_cluster
    nemesis = Nemesis(cluster, history)
    # Messages over a 4 KiB block: every unsynced write spans blocks that can persist out of order.
    run_faults(cluster, history, lambda r: nemesis.power_cut_all_restart(seconds=1.0), message_size=5000)
    torn = sum(cluster.node(n).log_text().count("torn tail in the newest WAL segment") for n in (1, 2, 3))
    print("what each cut dropped:", [(who, what) for _, who, what in history.events if what.startswith("files=")])
    print(f"torn WAL tails cut at the restarts: {torn}")


def test_rolling_restart_of_all_three(cluster, history):
    """The upgrade path: each node in turn is stopped cleanly (SIGTERM), left down 1 s, started
    again and waited for until it has caught up (`warren ctl cluster-status`), then 2 s more of
    load before the next; two rolls (n1, n2, n3, n1, n2, n3) under the standard workload. Nothing
    confirmed may be lost and confirms must resume after each restart; the longest pause in
    confirms per restart is reported (not asserted, see below)."""
    nemesis = Nemesis(cluster, history)
    caught_up = []

    def fault(r):
        n = r % 3 + 1
        nemesis.graceful_restart(n, seconds=1.0)
        caught_up.append((f"n{n}", round(cluster.wait_caught_up(n), 2)))
        time.sleep(2.0)

    report = run_faults(cluster, history, fault, repeats=6)
    print("caught up after each restart (s):", caught_up)
    print("longest pause in confirms per restart (s):", [round(p.longest, 2) for p in report.pauses])
    # Not asserted under 5 s: 7 of 8 runs stayed under 2.8 s, but one paused 6.2 s (after a stop
    # of the queue's leader, publishers on a follower got no confirm until their 5 s stall timeout
    # moved them to the third node).



def queue_voters(cluster, timeout=5):
    """The voters of the test queue's group, as its leader sees them (a cluster holds one queue)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _node, status in cluster.statuses():
            if not isinstance(status, dict):
                continue
            groups = [g for g in status.get("groups", []) if g.get("group") != 0 and g.get("state") == "leader"]
            if groups and not groups[0].get("learners"):
                return set(groups[0].get("voters") or [])
        time.sleep(0.2)
    return set()


def test_remove_node_under_load_then_losing_another_member(four_nodes, history):
    """Four nodes, the queue's group on three of them, publishers and consumers on every node.
    `warren ctl remove-node` of the queue's leader, under load: the group gets the fourth node in
    its place (a learner until caught up, then a voter), the leader hands its leadership over, and
    the removed node leaves. Then the removed node is killed for good and another of the first
    three is killed and restarted: with the old members two of three would be gone; with the new
    ones confirms go on. Nothing confirmed is lost."""
    cluster = four_nodes
    nemesis = Nemesis(cluster, history)
    targets = cluster.targets()
    rotations = [targets[i:] + targets[:i] for i in range(len(targets))]
    work = Workload(QUEUE, history, publishers=rotations, consumers=rotations, churning=rotations, arguments=QUORUM,
                    publisher_opts=dict(window=100, rate=2000, stall_timeout=5.0)).start()
    removed = None
    try:
        work.wait_for_confirms(300, timeout=30)
        members = queue_voters(cluster)
        assert len(members) == 3, members
        removed = cluster.leader(QUEUE)
        [newcomer] = {1, 2, 3, 4} - members
        asker = cluster.node(min(members - {removed}))
        with history.fault(f"remove-node n{removed}"):
            out = asker.ctl("--node", f"{asker.host}:{asker.cluster_port}", "--timeout", "30", "remove-node", str(removed), timeout=60)
            assert out.returncode == 0, out.stderr
            wanted = members - {removed} | {newcomer}
            deadline = time.monotonic() + 60
            while (voters := queue_voters(cluster)) != wanted:
                assert time.monotonic() < deadline, f"voters {voters}, not {wanted}, 60 s after remove-node"
                time.sleep(0.5)
        work.wait_for_confirms(300, timeout=30)
        with history.fault(f"kill -9 n{removed} (removed)"):
            cluster.node(removed).kill9()
        work.wait_for_confirms(300, timeout=30)
        second = min(members - {removed})
        with history.fault(f"kill -9 n{second} (two of the first three down)"):
            cluster.node(second).kill9()
            work.wait_for_confirms(300, timeout=30)  # the new members still have a majority
            cluster.node(second).start()
        work.wait_for_confirms(300, timeout=30)
    finally:
        work.stop()
        write_timeline(history, cluster.base_dir / "timeline.txt")
    drain([cluster.node(newcomer).target], QUEUE, history, arguments=QUORUM)
    report = check(history)
    print(report)
    report.assert_valid()


DLX_SOURCE = "faults-dlx-source"
DLX_TARGET = "faults-dlx-target"


def test_at_least_once_dead_letters_through_kill9_of_the_source_leader(cluster, history):
    """Issue 33: dead-lettering under faults. Publishers with confirms into a quorum queue with
    at-least-once dead-lettering (and a 3 s TTL) into a quorum target; consumers on every node
    reject a third of what they get and ack the rest; the source's leader is killed and restarted
    three times. Every confirmed message must end up consumed from the source (acked) or from the
    target (rejected or expired, then dead-lettered): none lost, duplicates counted. About 45 s."""
    targets = cluster.targets()
    rotations = [targets[i:] + targets[:i] for i in range(len(targets))]
    source = {**QUORUM, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": DLX_TARGET,
              "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish", "x-message-ttl": 3000}
    # The source first: its group is 1, the target's 2 (queue ids in a fresh cluster).
    _, host, port = targets[0]
    c = Client(host, port)
    try:
        c.declare(DLX_SOURCE, source)
        c.declare(DLX_TARGET, QUORUM)
    finally:
        c.close()
    work = Workload(DLX_SOURCE, history, publishers=rotations, consumers=[], arguments=source,
                    publisher_opts=dict(window=100, rate=1000, stall_timeout=5.0))
    work.consumers += [Rejecter(f"r{i}", t, DLX_SOURCE, history, arguments=source) for i, t in enumerate(rotations)]
    work.start()
    nemesis = Nemesis(cluster, history)
    try:
        work.wait_for_confirms(300, timeout=30)
        for _ in range(3):
            nemesis.kill9_restart(cluster.leader(DLX_SOURCE, group=1), seconds=1.0)
            work.wait_for_confirms(300, timeout=30)
            history.recovered()
    finally:
        work.stop()
        write_timeline(history, cluster.base_dir / "timeline.txt")
    rejected = sum(r.rejected for r in work.consumers)
    drain(targets[:1], DLX_SOURCE, history, arguments=source)
    # Dead letters still waiting in the source (a re-publish tried again every 2 s) arrive within
    # seconds: the target's drain waits for 5 s without one.
    dead = drain(targets[:1], DLX_TARGET, history, arguments=QUORUM, idle=5.0)
    report = check(history)
    print(report)
    print(f"{rejected} rejections, {dead} messages consumed from the dead-letter target")
    assert rejected > 0 and dead > 0
    report.assert_valid()
