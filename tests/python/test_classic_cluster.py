"""A durable classic queue in a three-node cluster lives on one node, its home (the node whose
client declared it): publishes through the other nodes are forwarded there and confirmed only once
the home has them durable; consumers, basic.get and queue.purge elsewhere are refused with a reply
naming the home; with the home down, publishes through the others are nacked, never confirmed, and
what was confirmed is there when the home is back. Before, every node kept its own copy and a
message stayed in the copy of the node it was published on (consumers elsewhere never saw it).
About 15 s."""
import time

import pika
import pytest

from conftest import eventually, three_node_cluster

pytestmark = [pytest.mark.warren_only]

SECRET = "classic-cluster-secret"


@pytest.fixture
def cluster(tmp_path):
    yield from three_node_cluster(tmp_path, SECRET)


def declare_on(nodes, name, home):
    c = nodes[home].connection()
    c.channel().queue_declare(name, durable=True)
    c.close()

    def everywhere():
        for b in nodes.values():
            c = b.connection()
            try:
                c.channel().queue_declare(name, passive=True)
            finally:
                if c.is_open:
                    c.close()
        return True

    eventually(everywhere, timeout=10)


def publish_confirmed(node, name, bodies):
    """Publishes with confirms; returns (confirmed, nacked) bodies."""
    c = node.connection()
    ch = c.channel()
    ch.confirm_delivery()
    confirmed, nacked = [], []
    for body in bodies:
        try:
            ch.basic_publish("", name, body, pika.BasicProperties(delivery_mode=2), mandatory=True)
            confirmed.append(body)
        except pika.exceptions.NackError:
            nacked.append(body)
    c.close()
    return confirmed, nacked


def drain_by_get(node, name):
    c = node.connection()
    ch = c.channel()
    got = []
    while True:
        method, _, body = ch.basic_get(name, auto_ack=True)
        if method is None:
            break
        got.append(body)
    c.close()
    return got


def refused(node, name, action):
    c = node.connection()
    ch = c.channel()
    try:
        action(ch)
    except pika.exceptions.ChannelClosedByBroker as e:
        return e.reply_code, e.reply_text
    finally:
        if c.is_open:
            c.close()
    return None


def test_a_classic_queue_lives_on_its_declaring_node_and_takes_publishes_from_every_node(cluster):
    name = "classic-home-2"
    declare_on(cluster, name, home=2)
    sent = []
    for i, node in cluster.items():
        bodies = [f"n{i}-{k}".encode() for k in range(150)]
        confirmed, nacked = publish_confirmed(node, name, bodies)
        assert confirmed == bodies and not nacked, f"every publish through node {i} is confirmed"
        sent += bodies
    # Order is kept per publishing node.
    got = drain_by_get(cluster[2], name)
    assert sorted(got) == sorted(sent), f"the home has every message exactly once ({len(got)} of {len(sent)})"
    for i in (1, 3):
        per_node = [b for b in got if b.startswith(f"n{i}-".encode())]
        assert per_node == [f"n{i}-{k}".encode() for k in range(150)], f"node {i}'s messages arrive in order"

    for other in (1, 3):
        for what, action in [
            ("consume", lambda ch: ch.basic_consume(name, lambda *a: None)),
            ("get", lambda ch: ch.basic_get(name)),
            ("purge", lambda ch: ch.queue_purge(name)),
            ("delete if-empty", lambda ch: ch.queue_delete(name, if_empty=True)),
        ]:
            answer = refused(cluster[other], name, action)
            assert answer is not None, f"{what} on node {other} (not the home) is refused"
            code, text = answer
            assert code == 406 and "lives on node 2" in text, (what, other, code, text)

    # A consumer on the home gets what other nodes publish.
    c = cluster[2].connection()
    ch = c.channel()
    got = []
    ch.basic_consume(name, lambda chan, m, p, body: (got.append(body), chan.basic_ack(m.delivery_tag)))
    confirmed, _ = publish_confirmed(cluster[3], name, [b"live-1", b"live-2"])
    deadline = time.time() + 10
    while len(got) < 2 and time.time() < deadline:
        c.process_data_events(time_limit=0.1)
    c.close()
    assert got == [b"live-1", b"live-2"]


def test_with_the_home_down_publishes_elsewhere_are_nacked_and_what_was_confirmed_survives(cluster):
    name = "classic-home-1"
    declare_on(cluster, name, home=1)
    before, _ = publish_confirmed(cluster[3], name, [f"before-{k}".encode() for k in range(50)])
    assert len(before) == 50
    cluster[1].kill9()
    started = time.monotonic()
    confirmed, nacked = publish_confirmed(cluster[3], name, [f"down-{k}".encode() for k in range(5)])
    assert not confirmed, "nothing is confirmed for a classic queue whose home is down"
    assert len(nacked) == 5
    assert time.monotonic() - started < 20, "the nacks come within the forward timeout"
    cluster[1].start()

    def after_restart():
        confirmed, _ = publish_confirmed(cluster[2], name, [b"after"])
        return confirmed == [b"after"]

    eventually(after_restart, timeout=20)
    got = drain_by_get(cluster[1], name)
    assert [b for b in got if b.startswith(b"before-")] == before, "every message confirmed before the kill -9 is there, in order"
    assert b"after" in got
