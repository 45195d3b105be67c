"""A consumer on a node cut off from the other two for longer than the consumer-down delay.

The queue's leader, on the majority side, detaches the consumers of a node it has not reached for
5 s and hands their unacked messages to others (`server::quorum::watch_nodes`). The client of such
a consumer is still connected to its node (only the links between nodes were cut) and waits: after
the heal its consumer must receive messages again. Before, it was never attached again and
silently received nothing, forever. Also checked on the way: a publisher on the cut-off node gets
no confirm while its node is on the minority side, and what it published then is confirmed after
the heal and delivered. About 30 s.
"""
import time

import pytest

from workload import Client

pytestmark = [pytest.mark.cluster_fault]

QUEUE = "partition-consumers-q"
QUORUM = {"x-queue-type": "quorum"}
CUT_FOR = 9.0  # past the 5 s after which the leader detaches the node's consumers (+ detector, sweep)


def pump(client, seconds, events):
    """Reads (and heartbeats) for `seconds`, appending what arrives to `events`."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        events.extend(client.events(min(left, 0.5)))


def publish(client, ids):
    for i in ids:
        client.send(client.publish_frames(QUEUE, i.encode()))


def delivered(events):
    return [e[3].decode() for e in events if e[0] == "deliver"]


def confirmed_tags(events, kind="ack"):
    """Publisher tags acked (or nacked, `kind="nack"`) so far, multiple ones expanded: a multiple
    ack covers every earlier tag not already answered, which is all this test needs."""
    done, top = set(), 0
    for e in events:
        if e[0] == kind:
            if e[2]:
                top = max(top, e[1])
            else:
                done.add(e[1])
    return done | set(range(1, top + 1))


def test_a_consumer_on_a_node_cut_off_a_while_is_served_again_after_the_heal(cluster):
    nodes = {n.id: n for n in cluster}
    first = nodes[1]
    admin = Client(first.host, first.port)
    admin.declare(QUEUE, QUORUM)
    admin.close()
    leader = cluster.leader(QUEUE)
    cut = next(n for n in nodes if n != leader)  # a follower: the leader stays on the majority side
    other = next(n for n in nodes if n not in (leader, cut))

    consumer = Client(nodes[cut].host, nodes[cut].port)
    consumer.qos(50)
    consumer.consume(QUEUE)
    got = []
    publisher = Client(nodes[other].host, nodes[other].port)
    publisher.confirm_select()
    confirms = []
    publish(publisher, [f"before/{i}" for i in range(20)])
    # Commits through a follower and the consumer's Attach: waited for, not timed.
    end = time.monotonic() + 15
    while len(confirmed_tags(confirms)) < 20 and time.monotonic() < end:
        pump(publisher, 0.2, confirms)
    while len(delivered(got)) < 20 and time.monotonic() < end:
        pump(consumer, 0.2, got)
    assert len(confirmed_tags(confirms)) == 20
    assert sorted(delivered(got)) == sorted(f"before/{i}" for i in range(20)), "the consumer works before the cut"
    for e in got:
        consumer.ack(e[1], multiple=False)

    minority = Client(nodes[cut].host, nodes[cut].port)
    minority.confirm_select()
    minority_events = []
    cluster.mark(f"isolating n{cut} from the other nodes (its clients stay connected)")
    cluster.topology.isolate(cut)
    try:
        publish(minority, [f"minority/{i}" for i in range(10)])
        # Keep every connection heartbeating while the leader gives up on the cut-off node.
        deadline = time.monotonic() + CUT_FOR
        while time.monotonic() < deadline:
            pump(consumer, 0.3, got)
            pump(minority, 0.3, minority_events)
            pump(publisher, 0.3, confirms)
        assert not confirmed_tags(minority_events), "nothing is confirmed on the minority side"
    finally:
        cluster.topology.heal_all()
        cluster.mark("healed")

    # After the heal: the cut-off node learns that its consumer was detached and attaches it again;
    # its minority-side publishes commit. Every message published now reaches the one consumer.
    # A publish whose entry was on its way to the leader as the link went down has an unknown
    # outcome: it is nacked (the client publishes it again) and need not arrive.
    publish(publisher, [f"after/{i}" for i in range(50)])
    want = {f"after/{i}" for i in range(50)}
    all_minority = set(range(1, 11))
    deadline = time.monotonic() + 30
    seen = set()
    while time.monotonic() < deadline:
        fresh = []
        pump(consumer, 0.5, fresh)
        for e in fresh:
            if e[0] == "deliver":
                seen.add(e[3].decode())
                consumer.ack(e[1], multiple=False)
        pump(minority, 0.1, minority_events)
        pump(publisher, 0.1, confirms)
        nacked = confirmed_tags(minority_events, "nack")
        acked = confirmed_tags(minority_events) - nacked
        want |= {f"minority/{tag - 1}" for tag in acked}
        if want <= seen and acked | nacked >= all_minority:
            break
    assert want <= seen, (f"the consumer on n{cut} got {len(seen & want)} of {len(want)} messages after the heal; "
                          f"missing e.g. {sorted(want - seen)[:5]}; during the cut it got {delivered(got)[20:]}")
    assert acked | nacked >= all_minority, "every publish on the minority side is answered after the heal"
    assert len(acked) >= 5, f"most of the minority side's publishes (queued while cut off) are confirmed after the heal: {sorted(acked)}"
    for c in (consumer, publisher, minority):
        c.close()
