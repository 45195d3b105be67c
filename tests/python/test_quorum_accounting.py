"""Every message accounted for, not only the confirmed ones: quorum queues under several
connections at once, on a healthy standalone node and through a follower of a three-node cluster;
a transaction whose publishes a queue refused; basic.gets on followers, one of them answered
empty by a follower that applies it late. Each test here failed before the fix it covers (issue 32).

A message is lost when it is published on a healthy broker (no alarm, no limit, no fault) and never
reaches a consumer, whether or not its publisher asked for a confirm. About 60 s."""
import threading
import time

import pika
import pytest

from conftest import eventually, three_node_cluster
from test_quorum_cluster import declare_on_one

pytestmark = [pytest.mark.warren_only]

SECRET = "accounting-test-secret"
QUORUM = {"x-queue-type": "quorum"}
PUBLISHERS_WITHOUT_CONFIRMS = 8
PUBLISHERS_WITH_CONFIRMS = 8
# Enough that connections interleave on the node's own publisher session many times over.
MESSAGES_WITHOUT_CONFIRMS = 4000
MESSAGES_WITH_CONFIRMS = 400


class Publisher(threading.Thread):
    """One connection publishing persistent messages `prefix-0`.. to a queue, with confirms (one
    at a time, as pika's blocking channel does) or without; keeps what it sent."""

    def __init__(self, node, queue, prefix, count, confirms):
        super().__init__(daemon=True)
        self.node, self.queue, self.prefix, self.count, self.confirms = node, queue, prefix, count, confirms
        self.sent, self.error = [], None

    def run(self):
        try:
            c = self.node.connection()
            ch = c.channel()
            if self.confirms:
                ch.confirm_delivery()
            props = pika.BasicProperties(delivery_mode=2)
            for i in range(self.count):
                body = f"{self.prefix}-{i}".encode()
                ch.basic_publish("", self.queue, body, props)  # raises on a nack
                self.sent.append(body)
            c.close()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e


def publish_from_many(node, queue):
    """8 connections without confirms and 8 with, at once; returns every body they sent."""
    publishers = [Publisher(node, queue, f"plain{i}", MESSAGES_WITHOUT_CONFIRMS, False) for i in range(PUBLISHERS_WITHOUT_CONFIRMS)]
    publishers += [Publisher(node, queue, f"confirmed{i}", MESSAGES_WITH_CONFIRMS, True) for i in range(PUBLISHERS_WITH_CONFIRMS)]
    for p in publishers:
        p.start()
    for p in publishers:
        p.join(120)
        assert not p.is_alive(), "a publisher did not finish in 120 s"
        assert p.error is None, f"{p.prefix}: {p.error!r} (a healthy node refused a publish)"
    sent = [b for p in publishers for b in p.sent]
    assert len(sent) == PUBLISHERS_WITHOUT_CONFIRMS * MESSAGES_WITHOUT_CONFIRMS + PUBLISHERS_WITH_CONFIRMS * MESSAGES_WITH_CONFIRMS
    return sent


def message_count(node, queue):
    c = node.connection()
    try:
        return c.channel().queue_declare(queue, passive=True).method.message_count
    finally:
        c.close()


def drain(node, queue, expected, timeout=60):
    """Consumes (manual acks, multiple) until `expected` messages came or nothing came for 3 s."""
    c = node.connection()
    ch = c.channel()
    ch.basic_qos(prefetch_count=2000)
    got = []

    def on_message(chan, method, props, body):
        got.append(body)
        if len(got) % 500 == 0 or len(got) >= expected:
            chan.basic_ack(method.delivery_tag, multiple=True)
    ch.basic_consume(queue, on_message)
    deadline = time.time() + timeout
    last_progress, last_len = time.time(), 0
    while len(got) < expected and time.time() < deadline and time.time() - last_progress < 3:
        c.process_data_events(time_limit=0.2)
        if len(got) != last_len:
            last_progress, last_len = time.time(), len(got)
    ch.basic_cancel(ch.consumer_tags[0])
    c.close()
    return got


def assert_every_message_once(sent, got):
    missing = set(sent) - set(got)
    extra = len(got) - len(set(got))
    assert not missing, f"{len(missing)} of {len(sent)} messages lost, e.g. {sorted(missing)[:5]}"
    assert extra == 0, f"{extra} messages delivered twice"
    assert set(got) == set(sent)


def every_message_arrives(publish_node, consume_node, queue):
    sent = publish_from_many(publish_node, queue)
    try:
        eventually(lambda: message_count(consume_node, queue) >= len(sent), timeout=30)
    except AssertionError:
        pass  # reported below, with which messages are missing
    got = drain(consume_node, queue, len(sent))
    assert_every_message_once(sent, got)
    assert message_count(consume_node, queue) == 0


def test_sixteen_connections_with_and_without_confirms_lose_nothing_in_a_quorum_queue(broker, name):
    """Before the fix, publishes without confirms from several connections took their numbers in
    the node's own publisher session before the lock that orders them into entries, and the group
    dropped the lower ones as duplicates: 198,813 of 200,000 were left with `warren bench`."""
    c = broker.connection()
    c.channel().queue_declare(name, durable=True, arguments=QUORUM)
    c.close()
    every_message_arrives(broker, broker, name)


@pytest.fixture
def cluster(tmp_path):
    yield from three_node_cluster(tmp_path, SECRET)


def test_sixteen_connections_through_a_follower_lose_nothing(cluster):
    """The same through node 2, a follower (the queue's group is led by node 1, where it was
    declared): every publish is forwarded to the leader; consumed on node 3."""
    name = "qq-accounting"
    declare_on_one(cluster, name)
    every_message_arrives(cluster[2], cluster[3], name)


def test_a_tx_commit_with_a_publish_the_queue_refused_fails(broker, name):
    """A quorum queue full with x-overflow reject-publish refuses two of a transaction's three
    publishes: the commit fails (406, as RabbitMQ's "partial tx completion"), never commit-ok.
    Before the fix the writer answered commit-ok once the publishes were resolved, refused or not."""
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(name, durable=True, arguments={**QUORUM, "x-max-length": 1, "x-overflow": "reject-publish"})
    ch.tx_select()
    for i in range(3):
        ch.basic_publish("", name, f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.tx_commit()
    assert e.value.reply_code == 406
    assert "partial tx completion" in e.value.reply_text
    # The connection and a transaction the queue takes whole are fine.
    ch = c.channel()
    ch.queue_purge(name)
    ch.tx_select()
    ch.basic_publish("", name, b"alone", pika.BasicProperties(delivery_mode=2))
    ch.tx_commit()
    assert ch.basic_get(name, auto_ack=True)[2] == b"alone"
    c.close()


def test_a_tx_commit_of_an_unrefused_transaction_on_a_quorum_queue_is_ok(broker, name):
    """The check above must not fail good commits: 50 commits of 20 publishes and acks each."""
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(name, durable=True, arguments=QUORUM)
    ch.tx_select()
    for round_ in range(50):
        for i in range(20):
            ch.basic_publish("", name, f"r{round_}-{i}".encode(), pika.BasicProperties(delivery_mode=2))
        ch.tx_commit()
    assert message_count(broker, name) == 1000
    for _ in range(10):
        method, _, _ = ch.basic_get(name)
        ch.basic_ack(method.delivery_tag)
    ch.tx_commit()
    assert message_count(broker, name) == 990
    c.close()


def test_a_no_ack_get_a_slow_follower_answers_empty_takes_no_message(cluster, monkeypatch):
    """Node 2 applies its own basic.gets 7 s late (test hook, hooks build): the leader (node 1)
    takes a message for a no-ack get on node 2 and answers, node 2 gives up waiting for its own
    apply after 5 s and answers get-empty. Before the fix its Dequeue, applied 2 s later, consumed
    the message on every replica though nobody received it. Now it goes back to the queue."""
    name = "qq-slow-get"
    monkeypatch.setenv("WARREN_TEST_GET_APPLY_DELAY_MS", "7000")
    cluster[2].kill9()
    cluster[2].start()
    monkeypatch.delenv("WARREN_TEST_GET_APPLY_DELAY_MS")
    declare_on_one(cluster, name)
    c = cluster[1].connection()
    ch = c.channel()
    ch.confirm_delivery()
    ch.basic_publish("", name, b"the-one", pika.BasicProperties(delivery_mode=2))
    c.close()
    eventually(lambda: message_count(cluster[2], name) == 1, timeout=30)

    c = cluster[2].connection()
    method, _, _ = c.channel().basic_get(name, auto_ack=True)
    c.close()
    assert method is None, "node 2 answered from its own apply, which the hook delays 7 s: no case made"

    def back():
        c = cluster[1].connection()
        try:
            m, _, b = c.channel().basic_get(name, auto_ack=True)
            return b if m is not None else None
        finally:
            c.close()
    assert eventually(back, timeout=30) == b"the-one", "a get answered empty consumed the message"


def test_an_acked_get_on_a_follower_still_works(cluster):
    """basic.get with and without no-ack on followers: each message once, the acked one settled."""
    name = "qq-gets"
    declare_on_one(cluster, name)
    c = cluster[1].connection()
    ch = c.channel()
    ch.confirm_delivery()
    for i in range(20):
        ch.basic_publish("", name, f"g{i}".encode(), pika.BasicProperties(delivery_mode=2))
    c.close()
    got = []
    for node in (2, 3) * 10:
        c = cluster[node].connection()
        ch = c.channel()
        method, _, body = ch.basic_get(name, auto_ack=(node == 2))
        assert method is not None
        if node == 3:
            ch.basic_ack(method.delivery_tag)
        got.append(body)
        c.close()
    assert sorted(got) == sorted(f"g{i}".encode() for i in range(20))
    eventually(lambda: message_count(cluster[1], name) == 0, timeout=10)
