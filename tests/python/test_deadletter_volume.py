"""Dead letters are never dropped for lack of room (issue 33, item 1): 100,000 messages rejected by
one basic.nack(multiple, requeue=false), or expiring at once, all reach the dead-letter target, from
a classic and from a quorum queue. (Before: the vhost's list of dead letters waiting to be
re-published dropped everything past 65,536.) Takes about a minute.
"""

import time

import pika
import pytest

from conftest import eventually

COUNT = 100_000
KINDS = {"classic": {}, "quorum": {"x-queue-type": "quorum"}}


def declare_with_target(ch, name, kind, **args):
    """Queue `name` (of `kind`) dead-lettering through fanout name-dlx into classic queue name-dead."""
    ch.exchange_declare(name + "-dlx", "fanout", durable=True)
    ch.queue_declare(name + "-dead", durable=True)
    ch.queue_bind(name + "-dead", name + "-dlx")
    ch.queue_declare(name, durable=True, arguments={"x-dead-letter-exchange": name + "-dlx", **KINDS[kind], **args})


def publish(conn, name, count):
    """`count` small messages, without confirms, then waits until the queue holds them all."""
    ch = conn.channel()
    for i in range(count):
        ch.basic_publish("", name, b"%d" % i)
    ch.close()


def ready(conn, queue):
    ch = conn.channel()
    try:
        return ch.queue_declare(queue, passive=True).method.message_count
    finally:
        ch.close()


def wait_for_count(conn, queue, want, timeout):
    """Waits until `queue` reports `want` ready (at most `timeout` s, while the count still moves)."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        n = ready(conn, queue)
        if n == want:
            return n
        if n != last:
            last, deadline = n, max(deadline, time.time() + 15)
        time.sleep(0.2)
    return ready(conn, queue)


@pytest.mark.parametrize("kind", KINDS)
def test_one_nack_of_a_hundred_thousand_unacked_dead_letters_every_one(broker, name, kind):
    conn = broker.connection()
    setup = conn.channel()
    declare_with_target(setup, name, kind)
    publish(conn, name, COUNT)
    assert wait_for_count(conn, name, COUNT, 60) == COUNT
    ch = conn.channel()
    ch.basic_qos(prefetch_count=0)
    last = []
    ch.basic_consume(name, lambda c, m, p, b: last.append(m.delivery_tag))
    deadline = time.time() + 120
    while len(last) < COUNT and time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    assert len(last) == COUNT
    ch.basic_nack(last[-1], multiple=True, requeue=False)
    assert wait_for_count(conn, name + "-dead", COUNT, 60) == COUNT
    assert ready(conn, name) == 0
    conn.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_hundred_thousand_expiring_at_once_all_dead_letter(broker, name, kind):
    conn = broker.connection()
    setup = conn.channel()
    declare_with_target(setup, name, kind)
    # Each message's TTL ends at the same moment, after they are all published (a queue's TTL
    # would spread their expiry over the time publishing takes).
    ch = conn.channel()
    at = time.time() + 12
    for i in range(COUNT):
        ttl = max(0, int((at - time.time()) * 1000))
        ch.basic_publish("", name, b"%d" % i, pika.BasicProperties(expiration=str(ttl)))
    published_late = time.time() > at
    assert wait_for_count(conn, name + "-dead", COUNT, 60) == COUNT, f"published after the expiry: {published_late}"
    eventually(lambda: ready(conn, name) == 0, timeout=30)
    conn.close()
