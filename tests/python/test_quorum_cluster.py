"""A quorum queue replicated on three real `warren server` processes on loopback ports (--node-id,
--peers): published on one node, consumed on another (commands forwarded to the group's leader,
deliveries from each node's own replica), and still confirming and delivering every confirmed message
after kill -9 of any one node, which rejoins with its data. A queue is declared through one node; the
metadata group carries it to the others. About 15 s."""
import time

import pika
import pytest

from conftest import eventually, three_node_cluster

pytestmark = [pytest.mark.warren_only]

SECRET = "cluster-test-secret"
QUORUM = {"x-queue-type": "quorum"}


@pytest.fixture
def cluster(tmp_path):
    yield from three_node_cluster(tmp_path, SECRET)


def declare_on_one(nodes, name, node=1, **args):
    """Declared through one node: the metadata group carries it to the others, which start their
    replicas of its group."""
    c = nodes[node].connection()
    c.channel().queue_declare(name, durable=True, arguments={**QUORUM, **args})
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


def publish(node, name, bodies):
    c = node.connection()
    ch = c.channel()
    ch.confirm_delivery()
    for body in bodies:
        ch.basic_publish("", name, body, pika.BasicProperties(delivery_mode=2))
    c.close()


def consume(node, name, count, timeout=30):
    c = node.connection()
    ch = c.channel()
    ch.basic_qos(prefetch_count=100)
    got = []

    def on_message(chan, method, props, body):
        got.append(body)
        chan.basic_ack(method.delivery_tag)

    ch.basic_consume(name, on_message)
    deadline = time.time() + timeout
    while len(got) < count and time.time() < deadline:
        c.process_data_events(time_limit=0.1)
    # The acks go out with the next round trip.
    ch.basic_cancel(ch.consumer_tags[0]) if ch.consumer_tags else None
    c.close()
    return got


def test_a_quorum_queue_is_served_by_every_node_and_survives_kill9_of_any_one(cluster):
    name = "qq-cluster"
    declare_on_one(cluster, name)
    first = [f"a{i}".encode() for i in range(200)]
    publish(cluster[2], name, first)
    got = consume(cluster[3], name, len(first))
    assert got == first, "published on node 2, consumed on node 3, in order"

    for victim in (1, 2, 3):
        cluster[victim].kill9()
        others = [i for i in cluster if i != victim]
        bodies = [f"k{victim}-{i}".encode() for i in range(100)]
        publish(cluster[others[0]], name, bodies)
        got = consume(cluster[others[1]], name, len(bodies))
        if sorted(got) != sorted(bodies):
            import subprocess, json
            from conftest import BIN
            for o in others:
                out = subprocess.run([BIN, "ctl", "--node", f"127.0.0.1:{cluster[o].cluster_port}", "--cluster-secret", SECRET, "cluster-status", "--json"], capture_output=True, text=True)
                print("STATUS from", o, out.stdout[-3000:], out.stderr[-500:])
        assert sorted(got) == sorted(bodies), f"with node {victim} down"
        cluster[victim].start()
        # The restarted node catches up; then a publish through it is confirmed again.
        publish(cluster[victim], name, [f"back{victim}".encode()])
        assert consume(cluster[others[0]], name, 1) == [f"back{victim}".encode()]
        # Its own consumers' view too, before the next node goes down (two of three must be up).
        assert consume(cluster[victim], name, 0, timeout=0) == []
        time.sleep(3)


def test_a_one_replica_quorum_queue_takes_publishes_on_every_node_and_serves_consumers_on_its_member(cluster):
    name = "qq-one-replica"
    declare_on_one(cluster, name, node=2, **{"x-quorum-initial-group-size": 1})
    for i, b in cluster.items():
        publish(b, name, [f"from{i}".encode()])  # forwarded to the member unless it is this node
    serving, refused = [], []
    for i, b in cluster.items():
        c = b.connection()
        ch = c.channel()
        try:
            method, _, _ = ch.basic_get(name, auto_ack=False)
            serving.append(i)
            assert method is not None
            c.close()
        except pika.exceptions.ChannelClosedByBroker as e:
            assert e.reply_code == 406 and "no replica on this node" in e.reply_text
            refused.append(i)
    assert len(serving) == 1 and len(refused) == 2, (serving, refused)
    got = consume(cluster[serving[0]], name, 3)
    assert sorted(got) == [b"from1", b"from2", b"from3"]
