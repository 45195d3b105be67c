"""The members of quorum queues' groups change at runtime, on real `warren server` processes:
`warren ctl remove-node N` gives each queue with a member on N a member on another node in its
place (the new one catches up from the others before it votes), and `warren ctl grow N` adds a
member on N to every queue without one. Each test then kills nodes so that only the new
membership keeps a majority: every confirmed message must still be delivered. About 60 s."""
import time

import pika

from conftest import Broker, eventually, free_port, three_node_cluster
from test_quorum_cluster import QUORUM, SECRET, consume, ctl, groups, known_everywhere, publish

import pytest

pytestmark = [pytest.mark.warren_only]


@pytest.fixture
def cluster(tmp_path):
    yield from three_node_cluster(tmp_path, SECRET)


def queue_groups(node):
    """The quorum queues' groups (every group but the metadata group's), as `node` sees them."""
    return {g: s for g, s in groups(node).items() if g != 0}


def voters_are(node, wanted, count):
    """`count` quorum-queue groups, every one with voters `wanted` and no learner."""
    gs = queue_groups(node)
    return len(gs) == count and all(set(s["voters"]) == wanted and not s["learners"] for s in gs.values())


def start_fourth_node(cluster, tmp_path):
    port4 = free_port()
    peers = ",".join(f"{i}=127.0.0.1:{b.cluster_port}" for i, b in cluster.items()) + f",4=127.0.0.1:{port4}"
    node4 = Broker(tmp_path / "node4", tmp_path / "node4.log")
    node4.extra_args = ["--node-id", "4", "--peers", peers, "--cluster-secret", SECRET]
    node4.cluster_port = port4
    node4.start()
    out = ctl(cluster[1], "add-node", "4", f"127.0.0.1:{port4}", timeout=15)
    assert out.returncode == 0, out.stderr
    return node4


def test_remove_node_moves_its_members_to_another_node_and_loses_nothing(cluster, tmp_path):
    """Two queues with members on 1, 2, 3, led by 3, and 300 confirmed messages each; node 4 joins the cluster;
    `remove-node 3`: the queues' voters become 1, 2, 4. Then nodes 3 and 1 are killed: with the old
    members that is two of three gone (no majority), with the new ones 2 and 4 still are one. Every
    message is consumed through node 4, and a publish through node 2 is confirmed."""
    names = ["qq-move-a", "qq-move-b"]
    # Declared through node 3: it leads them (client-local) and is their preferred leader, so its
    # removal must hand the leadership over first (a leader does not remove itself).
    c = cluster[3].connection()
    for name in names:
        c.channel().queue_declare(name, durable=True, arguments=QUORUM)
    c.close()
    known_everywhere(cluster.values(), names, timeout=10)
    bodies = {name: [f"{name}-{i}".encode() for i in range(300)] for name in names}
    for name in names:
        publish(cluster[2], name, bodies[name])
    eventually(lambda: voters_are(cluster[1], {1, 2, 3}, 2), timeout=10)

    # A consumer on node 3 holds 50 messages unacked when node 3 leaves the groups.
    held = cluster[3].connection()
    ch = held.channel()
    ch.basic_qos(prefetch_count=50)
    delivered, cancelled = [], []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame))
    ch.basic_consume(names[0], lambda _c, _m, _p, body: delivered.append(body))
    eventually(lambda: held.process_data_events(time_limit=0.1) or len(delivered) == 50, timeout=10)

    node4 = start_fourth_node(cluster, tmp_path)
    try:
        known_everywhere([node4], names, timeout=20)
        out = ctl(cluster[1], "remove-node", "3", timeout=30)
        assert out.returncode == 0, out.stderr
        assert "2 quorum queues move their member on node 3" in out.stdout, out.stdout
        eventually(lambda: voters_are(cluster[1], {1, 2, 4}, 2), timeout=60, interval=0.5)
        # Node 3 leaves once it sees itself out: its consumer is cancelled (basic.cancel), and what
        # it held goes back to the queue; then the node stops. When the cancel and the shutdown's
        # connection.close come in one read, pika's BlockingConnection raises on the close without
        # running the cancel callback (seen in CI): the node having left both groups first (its
        # log, below) is what counts, and every held message is consumed through node 4 after.
        def cancelled_or_stopped():
            try:
                held.process_data_events(time_limit=0.1)
            except Exception:  # noqa: BLE001 - the close of the node's shutdown
                if held.is_closed:
                    return "closed"
                raise
            return cancelled
        eventually(cancelled_or_stopped, timeout=30)
        assert len(delivered) == 50, "nothing more was delivered on node 3"
        eventually(lambda: cluster[3].log_text().count("no longer a member of the quorum queue's group: leaving it") == 2, timeout=30)
        if held.is_open:
            held.close()

        cluster[3].kill9()
        cluster[1].kill9()
        for name in names:
            got = consume(node4, name, len(bodies[name]), timeout=60)
            assert sorted(got) == sorted(bodies[name]), f"{name}: {len(got)} of {len(bodies[name])} through node 4"
        publish(cluster[2], names[0], [b"after"])
        assert consume(node4, names[0], 1, timeout=30) == [b"after"]
    finally:
        if node4.alive():
            node4.kill9()


@pytest.mark.parametrize("down", [False, True], ids=["up", "down-then-started"])
def test_grow_adds_a_member_that_catches_up_and_keeps_the_queue_up(cluster, down):
    """A queue with two members (x-quorum-initial-group-size 2) and 4,000 confirmed messages;
    `grow` on the third node gives it three voters, the new one caught up. Then one of the first two
    is killed: the two left are a majority of three (of the old two, one was not), and every message
    is delivered through the new member. `down`: the third node is down when `grow` runs, and
    starts after it (with no state of the group: it must join it, not start one of its own)."""
    name = "qq-grow"
    c = cluster[1].connection()
    c.channel().queue_declare(name, durable=True, arguments={**QUORUM, "x-quorum-initial-group-size": 2})
    c.close()
    known_everywhere(cluster.values(), [name], timeout=10)
    # 4 MB: more than the leader keeps in its log (1 MiB after a snapshot), so the new member
    # catches up from a snapshot and fetches the bodies of its live messages.
    bodies = [f"g{i}-".encode().ljust(1000, b"x") for i in range(4000)]
    publish(cluster[1], name, bodies)
    # The log is snapshotted and purged once the group has been quiet for 5 s (`compaction`).
    time.sleep(7)

    def two_voters():
        gs = queue_groups(cluster[1])
        return len(gs) == 1 and len(next(iter(gs.values()))["voters"]) == 2 and gs

    first = set(next(iter(eventually(two_voters, timeout=10).values()))["voters"])
    outside = ({1, 2, 3} - first).pop()
    if down:
        cluster[outside].kill9()
    out = ctl(cluster[1], "grow", str(outside), timeout=30)
    assert out.returncode == 0, out.stderr
    assert "1 quorum queues get a member" in out.stdout, out.stdout
    if down:
        cluster[outside].start()
    eventually(lambda: voters_are(cluster[1], {1, 2, 3}, 1), timeout=60, interval=0.5)
    # A second grow finds nothing to do.
    again = ctl(cluster[1], "grow", str(outside), timeout=30)
    assert again.returncode == 0 and "0 quorum queues" in again.stdout, (again.stdout, again.stderr)

    victim = min(first - {1}) if first - {1} else min(first)
    cluster[victim].kill9()
    got = consume(cluster[outside], name, len(bodies), timeout=60)
    assert sorted(got) == sorted(bodies), f"{len(got)} of {len(bodies)} through the new member, node {victim} down"


def test_grow_refuses_a_node_outside_the_cluster(cluster):
    out = ctl(cluster[1], "grow", "9", timeout=15)
    assert out.returncode != 0 and "not a member of the cluster" in out.stderr, (out.stdout, out.stderr)


def test_remove_node_refuses_to_strand_the_classic_queues_homed_there(cluster):
    """A durable classic queue declared through node 3 lives there only (its home). `remove-node 3`
    would strand its messages, every other node still routing to it: it is refused, naming the
    queue, and nothing changes. Once the queue is deleted, the same command is no longer refused
    for it. Before, remove-node went ahead and said nothing of them."""
    c = cluster[3].connection()
    ch = c.channel()
    ch.queue_declare("cq-on-3", durable=True)
    ch.confirm_delivery()
    ch.basic_publish("", "cq-on-3", b"only-on-3", pika.BasicProperties(delivery_mode=2))
    c.close()
    known_everywhere(cluster.values(), ["cq-on-3"], timeout=10)
    out = ctl(cluster[1], "remove-node", "3", timeout=30)
    assert out.returncode != 0, out.stdout
    assert "cq-on-3" in out.stderr and "classic queue" in out.stderr, out.stderr
    c = cluster[1].connection()
    assert c.channel().queue_declare("cq-on-3", passive=True).method.message_count == 1
    c.channel().queue_delete("cq-on-3")
    c.close()
    out = ctl(cluster[1], "remove-node", "3", timeout=30)
    assert "classic queue" not in out.stderr and out.returncode == 0, (out.stdout, out.stderr)


def test_acks_on_a_node_that_joined_after_relaying_a_consumer_stick(cluster):
    """A node outside a two-member group relays its consumers through a member; after `grow` it
    holds a replica, and its new consumers take deliveries from it. Their acks must reach the
    replica: before, every settlement on that node went to the relay (it existed) and the replica's
    acks were dropped. Here the 50 acked messages stayed checked out to the closed consumer and came
    back once the node died; in the fault suite, one message was delivered 19 times to consumers
    that acked it each time."""
    name = "qq-relay-then-member"
    c = cluster[1].connection()
    c.channel().queue_declare(name, durable=True, arguments={**QUORUM, "x-quorum-initial-group-size": 2})
    c.close()
    known_everywhere(cluster.values(), [name], timeout=10)
    voters = eventually(lambda: next(iter(queue_groups(cluster[1]).values()), {}).get("voters"), timeout=10)
    outside = ({1, 2, 3} - set(voters)).pop()
    publish(cluster[1], name, [b"relayed"])
    # A consumer on the outside node: relayed through a member. It takes the one message and acks it.
    assert consume(cluster[outside], name, 1) == [b"relayed"]

    out = ctl(cluster[1], "grow", str(outside), timeout=30)
    assert out.returncode == 0, out.stderr
    eventually(lambda: voters_are(cluster[1], {1, 2, 3}, 1), timeout=60, interval=0.5)
    bodies = [f"m{i}".encode() for i in range(50)]
    publish(cluster[1], name, bodies)
    # Consumed and acked on the node that joined, from its own replica, and the connection closed
    # without a basic.cancel (what a consumer holds at its close goes back): nothing is left.
    got = consume(cluster[outside], name, len(bodies), cancel=False)
    assert sorted(got) == sorted(bodies)
    # Acks have no confirm: kill the node before the group committed them and they are lost with
    # it, which is no bug (the test failed so once on a loaded machine). A basic.get through the
    # same node is proposed after them, in order: its answer means the group applied them.
    c = cluster[outside].connection()
    assert c.channel().basic_get(name, auto_ack=False)[0] is None, "a message was left ready"
    c.close()
    # With the acks dropped, the messages stayed checked out to the closed consumer (neither ready
    # nor gone). Node 3 killed, the leader returns what its consumers held after 5 s: nothing.
    cluster[outside].kill9()
    leftover = consume(cluster[1], name, 1, timeout=10)
    assert leftover == [], f"acked on node {outside}, yet {len(leftover)}+ messages came back after it died"


def test_a_node_removed_while_down_stops_when_it_comes_back_and_loses_nothing(cluster, tmp_path):
    """Node 3 is killed, then removed (`remove-node 3`: the queue's members become 1, 2, 4), and
    started again with its old data, which still has it as a member of everything. No member
    replicates to it any more, so its topology is stale: it must find out that it was removed and
    stop (with a message saying how to bring it back), without taking leadership from the members,
    and whatever it confirmed meanwhile must be kept (it forwards to the members)."""
    name = "qq-removed-while-down"
    c = cluster[1].connection()
    c.channel().queue_declare(name, durable=True, arguments=QUORUM)
    c.close()
    known_everywhere(cluster.values(), [name], timeout=10)
    before = [f"before-{i}".encode() for i in range(100)]
    publish(cluster[1], name, before)
    node4 = start_fourth_node(cluster, tmp_path)
    try:
        known_everywhere([node4], [name], timeout=20)
        cluster[3].kill9()
        out = ctl(cluster[1], "remove-node", "3", timeout=30)
        assert out.returncode == 0, out.stderr
        eventually(lambda: voters_are(cluster[1], {1, 2, 4}, 1), timeout=60, interval=0.5)
        leader = {g["leader"] for g in queue_groups(cluster[1]).values()}

        started = time.time()
        cluster[3].start()
        # Publishes through node 3 until it stops: whatever it confirmed must be kept.
        confirmed_on_3 = []
        while cluster[3].alive() and time.time() < started + 30:
            body = f"on-3-{len(confirmed_on_3)}".encode()
            try:
                c3 = cluster[3].connection()
                ch = c3.channel()
                ch.confirm_delivery()
                ch.basic_publish("", name, body, pika.BasicProperties(delivery_mode=2))
                confirmed_on_3.append(body)
                c3.close()
            except (pika.exceptions.AMQPError, OSError, ValueError):
                # ValueError: pika's, for a socket the stopping node closed as it connected.
                time.sleep(0.2)
        assert not cluster[3].alive(), "node 3 still runs 30 s after it was started, although it was removed"
        assert cluster[3].proc.returncode not in (0, None), f"node 3 exited with {cluster[3].proc.returncode}"
        log = cluster[3].log_text()
        assert "was removed from the cluster" in log and "warren ctl add-node 3" in log, log[-2000:]
        assert {g["leader"] for g in queue_groups(cluster[1]).values()} == leader, "node 3 disrupted the queue's leadership"
        assert voters_are(cluster[1], {1, 2, 4}, 1)

        after = [f"after-{i}".encode() for i in range(100)]
        publish(cluster[1], name, after)
        wanted = before + confirmed_on_3 + after
        got = consume(node4, name, len(wanted), timeout=60)
        missing = set(wanted) - set(got)
        assert not missing, f"{len(missing)} confirmed messages lost, e.g. {sorted(missing)[:5]} ({len(confirmed_on_3)} confirmed by node 3)"
    finally:
        if node4.alive():
            node4.kill9()
