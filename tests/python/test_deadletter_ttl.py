"""TTL, expiry, length limits and dead-lettering with x-death, as RabbitMQ writes it."""
import datetime
import time

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker

from conftest import eventually


def get(ch, queue, timeout=5):
    """Polls basic.get until a message arrives; returns (method, properties, body)."""
    return eventually(lambda: (lambda r: r if r[0] else None)(ch.basic_get(queue, auto_ack=True)), timeout=timeout)


def dlx_pair(ch, name, **args):
    """A queue `name` dead-lettering to exchange name-dlx, bound to queue name-dead."""
    ch.exchange_declare(name + "-dlx", "fanout", auto_delete=False)
    ch.queue_declare(name + "-dead")
    ch.queue_bind(name + "-dead", name + "-dlx")
    arguments = {"x-dead-letter-exchange": name + "-dlx"}
    arguments.update(args)
    ch.queue_declare(name, arguments=arguments)


def cleanup(ch, name):
    for q in (name, name + "-dead"):
        ch.queue_delete(q)
    ch.exchange_delete(name + "-dlx")


def test_rejected_message_is_dead_lettered_with_x_death(ch, name):
    dlx_pair(ch, name)
    ch.basic_publish("", name, b"bad", properties=pika.BasicProperties(headers={"app": "kept"}))
    m, _, _ = get_unacked(ch, name)
    ch.basic_reject(m.delivery_tag, requeue=False)
    _, props, body = get(ch, name + "-dead")
    assert body == b"bad"
    h = props.headers
    assert h["app"] == "kept"
    [death] = h["x-death"]
    assert death["count"] == 1 and death["reason"] == "rejected" and death["queue"] == name
    assert death["exchange"] == "" and death["routing-keys"] == [name]
    assert isinstance(death["time"], datetime.datetime)
    assert abs(death["time"].timestamp() - time.time()) < 60
    assert h["x-first-death-reason"] == "rejected"
    assert h["x-first-death-queue"] == name
    assert h["x-first-death-exchange"] == ""
    cleanup(ch, name)


def get_unacked(ch, queue):
    return eventually(lambda: (lambda r: r if r[0] else None)(ch.basic_get(queue)))


def test_queue_ttl_expires_and_dead_letters(ch, name):
    dlx_pair(ch, name, **{"x-message-ttl": 100})
    ch.basic_publish("", name, b"old")
    _, props, body = get(ch, name + "-dead")
    assert body == b"old"
    death = props.headers["x-death"][0]
    assert death["reason"] == "expired" and death["queue"] == name
    assert ch.queue_declare(name, passive=True).method.message_count == 0
    cleanup(ch, name)


def test_per_message_ttl_and_original_expiration(ch, name):
    dlx_pair(ch, name)
    ch.basic_publish("", name, b"short", properties=pika.BasicProperties(expiration="100"))
    ch.basic_publish("", name, b"long", properties=pika.BasicProperties(expiration="600000"))
    _, props, body = get(ch, name + "-dead")
    assert body == b"short"
    assert props.expiration is None
    assert props.headers["x-death"][0]["original-expiration"] == "100"
    assert props.headers["x-death"][0]["reason"] == "expired"
    m, _, body = get(ch, name)
    assert body == b"long"
    cleanup(ch, name)


def test_zero_ttl_message_is_dropped_unless_a_consumer_can_take_it(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    ch.basic_publish("", name, b"now-or-never", properties=pika.BasicProperties(expiration="0"))
    time.sleep(0.1)
    assert ch.basic_get(name) == (None, None, None)


def test_invalid_expiration_is_406(ch, name):
    ch.queue_declare(name, auto_delete=True)
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_publish("", name, b"x", properties=pika.BasicProperties(expiration="soon"))
        ch.queue_declare(name, passive=True)
    assert e.value.reply_code == 406


def test_max_length_drop_head_dead_letters_maxlen(ch, name):
    dlx_pair(ch, name, **{"x-max-length": 2})
    for b in (b"1", b"2", b"3", b"4"):
        ch.basic_publish("", name, b)
    eventually(lambda: ch.queue_declare(name + "-dead", passive=True).method.message_count == 2)
    assert ch.queue_declare(name, passive=True).method.message_count == 2
    _, props, body = get(ch, name + "-dead")
    assert body == b"1" and props.headers["x-death"][0]["reason"] == "maxlen"
    assert get(ch, name + "-dead")[2] == b"2"
    assert get(ch, name)[2] == b"3"
    cleanup(ch, name)


def test_max_length_bytes(ch, name):
    ch.queue_declare(name, auto_delete=True, arguments={"x-max-length-bytes": 10})
    for b in (b"aaaa", b"bbbb", b"cccc"):
        ch.basic_publish("", name, b)
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 2)
    assert get(ch, name)[2] == b"bbbb"


def test_dead_letter_routing_key_overrides(ch, name):
    ch.queue_declare(name + "-dead")
    ch.queue_declare(name, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": name + "-dead"})
    ch.basic_publish("", name, b"x")
    m, _, _ = get_unacked(ch, name)
    ch.basic_nack(m.delivery_tag, requeue=False)
    _, props, body = get(ch, name + "-dead")
    assert body == b"x" and props.headers["x-death"][0]["routing-keys"] == [name]
    ch.queue_delete(name)
    ch.queue_delete(name + "-dead")


def test_repeated_deaths_increment_count(ch, name):
    # name -> (reject) -> name-b -> (expire) -> name : a cycle broken only by a rejection each lap.
    ch.queue_declare(name, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": name + "-b"})
    ch.queue_declare(name + "-b", arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": name,
                                             "x-message-ttl": 50})
    ch.basic_publish("", name, b"x")
    for lap in (1, 2):
        m, props, _ = get_unacked(ch, name)
        ch.basic_reject(m.delivery_tag, requeue=False)
    _, props, _ = get(ch, name)
    deaths = {(d["queue"], d["reason"]): d["count"] for d in props.headers["x-death"]}
    assert deaths == {(name, "rejected"): 2, (name + "-b", "expired"): 2}
    # Most recent death first, as RabbitMQ orders them.
    assert props.headers["x-death"][0]["queue"] == name + "-b"
    ch.queue_delete(name)
    ch.queue_delete(name + "-b")


def test_expired_cycle_without_rejection_is_dropped(ch, name):
    # A queue that dead-letters expired messages to itself would loop forever; RabbitMQ drops them.
    ch.queue_declare(name, auto_delete=True, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": name,
                                                        "x-message-ttl": 50})
    ch.basic_publish("", name, b"x")
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 0, timeout=5)


def test_queue_expires_when_unused(broker, name):
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(name, arguments={"x-expires": 300})
    c.close()

    def gone():
        c2 = broker.connection()
        try:
            c2.channel().queue_declare(name, passive=True)
            return False
        except ChannelClosedByBroker as e:
            return e.reply_code == 404
        finally:
            if c2.is_open:
                c2.close()

    # Polled less often than the TTL: a declare, even a passive one, renews the lease.
    eventually(gone, timeout=5, interval=0.6)


def test_queue_with_consumer_does_not_expire(conn, ch, name):
    ch.queue_declare(name, arguments={"x-expires": 200})
    ch.basic_consume(name, lambda *a: None)
    conn.process_data_events(time_limit=0.6)
    assert ch.queue_declare(name, passive=True).method.consumer_count == 1
    ch.queue_delete(name)


@pytest.mark.parametrize("args", [
    {"x-message-ttl": -1}, {"x-expires": 0}, {"x-max-length": -5}, {"x-overflow": "reject-publish-sideways"},
    {"x-message-ttl": "ten"}, {"x-dead-letter-routing-key": "k"},
])
def test_invalid_queue_arguments_are_406(ch, name, args):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, arguments=args)
    assert e.value.reply_code == 406
    assert list(args)[0] in e.value.reply_text


def test_dead_letter_cycle_entered_by_a_rejection_is_dropped_and_the_broker_keeps_serving(broker, ch, name):
    # q3 rejects into a loop q1 <-> q2 where both expire at once (TTL 0). The rejection happened in q3, not
    # in the loop: as in RabbitMQ, the loop is "fully automatic" and the message is dropped when it comes
    # back to q1. (Warren used to recurse through the loop on one stack until the process aborted.)
    q1, q2, q3 = name + "-1", name + "-2", name + "-3"
    ch.queue_declare(q1, arguments={"x-message-ttl": 0, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": q2})
    ch.queue_declare(q2, arguments={"x-message-ttl": 0, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": q1})
    ch.queue_declare(q3, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q1})
    ch.basic_publish("", q3, b"loop")
    m, _, _ = get_unacked(ch, q3)
    ch.basic_reject(m.delivery_tag, requeue=False)
    time.sleep(0.3)
    assert broker.alive()
    for q in (q1, q2, q3):
        assert ch.queue_declare(q, passive=True).method.message_count == 0
    # Still serving: a plain publish and get on a new connection.
    c = broker.connection()
    ch2 = c.channel()
    ch2.queue_declare(name + "-ok", auto_delete=True)
    ch2.basic_publish("", name + "-ok", b"alive")
    assert get(ch2, name + "-ok")[2] == b"alive"
    c.close()
    for q in (q1, q2, q3):
        ch.queue_delete(q)


def test_rejection_inside_the_cycle_keeps_the_message_moving(ch, name):
    # q1 -(reject)-> q2 -(TTL 0)-> q1: the client's rejection is in the loop, so RabbitMQ delivers it
    # back to q1 every lap (each lap needs the client).
    q1, q2 = name + "-1", name + "-2"
    ch.queue_declare(q1, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q2})
    ch.queue_declare(q2, arguments={"x-message-ttl": 0, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": q1})
    ch.basic_publish("", q1, b"again")
    for _ in range(3):
        m, _, body = get_unacked(ch, q1)
        assert body == b"again"
        ch.basic_reject(m.delivery_tag, requeue=False)
    _, props, _ = get(ch, q1)
    deaths = {(d["queue"], d["reason"]): d["count"] for d in props.headers["x-death"]}
    assert deaths == {(q1, "rejected"): 3, (q2, "expired"): 3}
    ch.queue_delete(q1)
    ch.queue_delete(q2)


@pytest.mark.warren_only
def test_a_long_dead_letter_chain_is_followed_without_recursion(broker, ch, name):
    # 1,500 queues, each expiring at once (TTL 0) into the next: one publish walks the whole chain.
    n = 1500
    for i in range(n):
        args = {"x-message-ttl": 0, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{name}-{i + 1}"}
        ch.queue_declare(f"{name}-{i}", auto_delete=False, arguments=args)
    ch.queue_declare(f"{name}-{n}")
    ch.basic_publish("", f"{name}-0", b"far")
    eventually(lambda: ch.queue_declare(f"{name}-{n}", passive=True).method.message_count == 1)
    assert broker.alive()
    for i in range(n + 1):
        ch.queue_delete(f"{name}-{i}")


@pytest.mark.warren_only
def test_a_dead_letter_routing_key_longer_than_a_short_string_is_406(ch, name):
    # Dead letters are published with it as their routing key: an AMQP short string (<= 255 bytes).
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "é" * 128})
    assert e.value.reply_code == 406
    assert "x-dead-letter-routing-key" in e.value.reply_text and "255" in e.value.reply_text


@pytest.mark.needs_process
def test_dead_letters_with_a_255_byte_routing_key_page_to_disk_and_survive_a_restart(broker, name):
    key = "é" * 127 + "x"  # 255 bytes, 128 characters
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(key, durable=True)
    ch.queue_declare(name, durable=True,
                     arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": key, "x-message-ttl": 0})
    n = 3000  # more than a queue's in-memory window: the rest is read back from the store
    for i in range(n):
        ch.basic_publish("", name, b"%06d" % i, pika.BasicProperties(delivery_mode=2))
    eventually(lambda: ch.queue_declare(key, durable=True, passive=True).method.message_count == n)
    c.close()
    assert broker.terminate() == 0
    broker.start()
    c = broker.connection()
    ch = c.channel()
    got = []
    while True:
        m, props, body = ch.basic_get(key, auto_ack=True)
        if m is None:
            break
        assert m.routing_key == key and props.headers["x-death"][0]["queue"] == name
        got.append(int(body))
    assert got == list(range(n))
    c.close()
