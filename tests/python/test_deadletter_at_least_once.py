"""At-least-once dead-lettering for quorum queues (issue 33, item 2), as RabbitMQ 3.10+:
`x-dead-letter-strategy: at-least-once` with `x-overflow: reject-publish`. A dead-lettered message
stays in its source (bodies kept, counted against its length limit) until every queue its
dead-letter exchange routes it to holds it durably; the source's leader re-publishes it until then,
and a new leader re-publishes what the old one had not settled. Every message rejected ends up in
the target, duplicates allowed (counted), none lost: with no such exchange yet, with the target's
home node down, and with the source's leader killed meanwhile. Before, the argument was refused
(and the default, at-most-once, drops a dead letter it cannot route). About 40 s.
"""
import time

import pika
import pytest

from conftest import eventually, three_node_cluster

pytestmark = [pytest.mark.warren_only]

SECRET = "dlx-at-least-once-secret"


def source_args(exchange, routing_key=None, **extra):
    args = {"x-queue-type": "quorum", "x-dead-letter-exchange": exchange, "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish", **extra}
    if routing_key is not None:
        args["x-dead-letter-routing-key"] = routing_key
    return args


def publish_confirmed(ch, queue, bodies):
    ch.confirm_delivery()
    for body in bodies:
        ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))


def reject_all(conn, ch, queue, count, timeout=30):
    """Consumes `count` messages from `queue` and rejects each without requeue."""
    rejected = []

    def on_message(c, method, props, body):
        c.basic_reject(method.delivery_tag, requeue=False)
        rejected.append(body)

    ch.basic_qos(prefetch_count=200)
    tag = ch.basic_consume(queue, on_message)
    deadline = time.time() + timeout
    while len(rejected) < count and time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    ch.basic_cancel(tag)
    assert len(rejected) == count, f"rejected {len(rejected)} of {count}"


def drain(node, queue, timeout=30):
    """Every body in `queue` (acked), through `node`."""
    conn = node.connection()
    ch = conn.channel()
    got = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        method, _, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        got.append(body)
    conn.close()
    return got


def test_dead_letters_wait_in_their_source_for_an_exchange_declared_later(broker, conn, ch, name):
    target = name + "-target"
    ch.queue_declare(name, durable=True, arguments=source_args(name + "-dlx"))
    bodies = [b"m%d" % i for i in range(200)]
    publish_confirmed(ch, name, bodies)
    reject_all(conn, ch, name, len(bodies))
    # No such exchange: at-most-once would drop them; here they wait, counted against the source's
    # length (not ready: never delivered again).
    time.sleep(1)
    assert ch.queue_declare(name, passive=True).method.message_count == 0
    ch.exchange_declare(name + "-dlx", "fanout", durable=True)
    ch.queue_declare(target, durable=True)
    ch.queue_bind(target, name + "-dlx")

    def all_arrived():
        return ch.queue_declare(target, passive=True).method.message_count >= len(bodies)

    eventually(all_arrived, timeout=20)
    got = drain(broker, target)
    assert set(got) == set(bodies), f"missing: {sorted(set(bodies) - set(got))[:10]}"
    print(f"{len(got)} dead letters arrived for {len(bodies)} rejected ({len(got) - len(bodies)} duplicates)")


def test_at_least_once_needs_a_quorum_queue(ch, name):
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.queue_declare(name, durable=True, arguments={"x-dead-letter-exchange": "x", "x-dead-letter-strategy": "at-least-once"})
    assert e.value.reply_code == 406 and "quorum" in e.value.reply_text


@pytest.fixture
def cluster(tmp_path):
    yield from three_node_cluster(tmp_path, SECRET)


def test_none_lost_with_the_target_home_down_and_the_source_leader_killed(cluster):
    """The target is a classic queue living on node 3; the source a quorum queue on all three,
    led by node 1. Node 3 is killed: the dead letters cannot reach the target and wait in the
    source. Then node 1, the source's leader, is killed and node 3 comes back: the new leader
    re-publishes every one."""
    c3 = cluster[3].connection()
    c3.channel().queue_declare("dlx-target", durable=True)
    c3.close()
    conn = cluster[1].connection()
    ch = conn.channel()
    ch.queue_declare("dlx-source", durable=True, arguments=source_args("", "dlx-target"))
    bodies = [b"m%d" % i for i in range(500)]
    publish_confirmed(ch, "dlx-source", bodies)
    cluster[3].kill9()
    reject_all(conn, ch, "dlx-source", len(bodies))
    conn.close()
    time.sleep(2)
    cluster[1].kill9()
    cluster[3].start()

    def arrived():
        c = cluster[3].connection()
        try:
            return c.channel().queue_declare("dlx-target", passive=True).method.message_count >= len(bodies)
        finally:
            c.close()

    eventually(arrived, timeout=60)
    cluster[1].start()
    got = drain(cluster[3], "dlx-target")
    assert set(got) == set(bodies), f"missing: {sorted(set(bodies) - set(got))[:10]}"
    print(f"{len(got)} dead letters arrived for {len(bodies)} rejected ({len(got) - len(bodies)} duplicates)")

    def source_empty():
        c = cluster[2].connection()
        try:
            return c.channel().queue_declare("dlx-source", passive=True).method.message_count == 0
        finally:
            c.close()

    eventually(source_empty, timeout=20)
