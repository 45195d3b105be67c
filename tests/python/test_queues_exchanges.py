"""Exchanges, queues, bindings and routing, as RabbitMQ behaves."""
import pika
import pytest
from pika.exceptions import ChannelClosedByBroker

from conftest import eventually


def drain(ch, queue):
    bodies = []
    while True:
        m, _, body = ch.basic_get(queue, auto_ack=True)
        if m is None:
            return bodies
        bodies.append(body)


def test_server_named_queue(ch):
    q = ch.queue_declare("", exclusive=True).method.queue
    assert q.startswith("amq.gen-") and len(q) == len("amq.gen-") + 22


def test_passive_declare_of_missing_queue_is_404(ch, name):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, passive=True)
    assert e.value.reply_code == 404
    assert name in e.value.reply_text


def test_declare_ok_counts(conn, ch, name):
    ch.queue_declare(name, auto_delete=False)
    for i in range(3):
        ch.basic_publish("", name, b"x")
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 3)
    other = conn.channel()
    other.basic_consume(name, lambda *a: None)
    ok = ch.queue_declare(name, passive=True).method
    assert ok.consumer_count == 1
    ch.queue_delete(name)


def test_redeclare_with_different_arguments_is_406(ch, name):
    ch.queue_declare(name, arguments={"x-message-ttl": 1000})
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, arguments={"x-message-ttl": 2000})
    assert e.value.reply_code == 406


def test_redeclare_with_different_durability_is_406(conn, name):
    ch = conn.channel()
    ch.queue_declare(name, durable=False)
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, durable=True)
    assert e.value.reply_code == 406
    conn.channel().queue_delete(name)


def test_exclusive_queue_is_locked_to_its_connection(broker, ch, name):
    ch.queue_declare(name, exclusive=True)
    other = broker.connection()
    try:
        with pytest.raises(ChannelClosedByBroker) as e:
            other.channel().queue_declare(name, passive=True)
        assert e.value.reply_code == 405
    finally:
        other.close()


def test_exclusive_queue_goes_with_its_connection(broker, name):
    c1 = broker.connection()
    c1.channel().queue_declare(name, exclusive=True)
    c1.close()
    c2 = broker.connection()
    try:
        def gone():
            with pytest.raises(ChannelClosedByBroker) as e:
                c2.channel().queue_declare(name, passive=True)
            return e.value.reply_code == 404
        eventually(gone)
    finally:
        c2.close()


def test_auto_delete_queue_goes_with_last_consumer(conn, name):
    ch = conn.channel()
    ch.queue_declare(name, auto_delete=True)
    tag = ch.basic_consume(name, lambda *a: None)
    ch.basic_cancel(tag)
    check = conn.channel()
    with pytest.raises(ChannelClosedByBroker) as e:
        check.queue_declare(name, passive=True)
    assert e.value.reply_code == 404


def test_purge_and_delete_if_empty(ch, name):
    ch.queue_declare(name)
    for _ in range(5):
        ch.basic_publish("", name, b"x")
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 5)
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_delete(name, if_empty=True)
    assert e.value.reply_code == 406


def test_purge_returns_count(ch, name):
    ch.queue_declare(name)
    for _ in range(4):
        ch.basic_publish("", name, b"x")
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 4)
    assert ch.queue_purge(name).method.message_count == 4
    assert ch.queue_delete(name).method.message_count == 0


def test_delete_if_unused(conn, name):
    ch = conn.channel()
    ch.queue_declare(name)
    ch.basic_consume(name, lambda *a: None)
    other = conn.channel()
    with pytest.raises(ChannelClosedByBroker) as e:
        other.queue_delete(name, if_unused=True)
    assert e.value.reply_code == 406


def test_builtin_exchanges_exist(ch):
    for ex in ["amq.direct", "amq.fanout", "amq.topic", "amq.headers", "amq.match"]:
        ch.exchange_declare(ex, passive=True)


def test_reserved_exchange_prefix_is_403(ch):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.exchange_declare("amq.warren-test", "direct")
    assert e.value.reply_code == 403


def test_exchange_redeclare_with_other_type_is_406(ch, name):
    ch.exchange_declare(name, "direct")
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.exchange_declare(name, "fanout")
    assert e.value.reply_code == 406


def test_passive_missing_exchange_is_404(ch, name):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.exchange_declare(name, passive=True)
    assert e.value.reply_code == 404


def test_exchange_delete_if_unused(conn, name):
    ch = conn.channel()
    ch.exchange_declare(name, "fanout")
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, name)
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.exchange_delete(name, if_unused=True)
    assert e.value.reply_code == 406
    conn.channel().exchange_delete(name)


def test_internal_exchange_refuses_publish(conn, name):
    ch = conn.channel()
    ch.exchange_declare(name, "fanout", internal=True)
    ch.basic_publish(name, "", b"x")
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare("", exclusive=True)  # forces a round trip that sees the close
    assert e.value.reply_code == 403


def bound_queue(ch, exchange, key="", arguments=None):
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, exchange, routing_key=key, arguments=arguments)
    return q


def test_direct_fanout_routing(ch, name):
    ch.exchange_declare(name + "d", "direct", auto_delete=True)
    ch.exchange_declare(name + "f", "fanout", auto_delete=True)
    a = bound_queue(ch, name + "d", "a")
    b = bound_queue(ch, name + "d", "b")
    f1 = bound_queue(ch, name + "f")
    f2 = bound_queue(ch, name + "f")
    ch.basic_publish(name + "d", "a", b"to-a")
    ch.basic_publish(name + "f", "whatever", b"to-all")
    eventually(lambda: ch.queue_declare(f2, passive=True).method.message_count == 1)
    assert drain(ch, a) == [b"to-a"]
    assert drain(ch, b) == []
    assert drain(ch, f1) == [b"to-all"]
    assert drain(ch, f2) == [b"to-all"]


@pytest.mark.parametrize("pattern,key,hit", [
    ("a.*.c", "a.b.c", True), ("a.*.c", "a.c", False), ("a.#", "a", True), ("a.#", "a.b.c", True),
    ("#", "", True), ("#", "x.y", True), ("*", "", False), ("a.#.b", "a.b", True), ("a.#.b", "a.x.y.b", True),
    ("a.#.b", "a.x.c", False), ("*.b.#", "x.b", True), ("a..b", "a..b", True),
])
def test_topic_routing(ch, name, pattern, key, hit):
    ch.exchange_declare(name, "topic", auto_delete=True)
    q = bound_queue(ch, name, pattern)
    ch.basic_publish(name, key, b"m", mandatory=False)
    ch.basic_publish("", q, b"marker")
    eventually(lambda: ch.queue_declare(q, passive=True).method.message_count >= 1)
    assert drain(ch, q) == ([b"m", b"marker"] if hit else [b"marker"])


def test_headers_routing_all_and_any(ch, name):
    ch.exchange_declare(name, "headers", auto_delete=True)
    q_all = bound_queue(ch, name, arguments={"x-match": "all", "a": "1", "b": 2})
    q_any = bound_queue(ch, name, arguments={"x-match": "any", "a": "1", "b": 2})
    ch.basic_publish(name, "", b"both", pika.BasicProperties(headers={"a": "1", "b": 2}))
    ch.basic_publish(name, "", b"one", pika.BasicProperties(headers={"a": "1"}))
    ch.basic_publish(name, "", b"none", pika.BasicProperties(headers={"c": "z"}))
    ch.basic_publish("", q_any, b"end")
    eventually(lambda: ch.queue_declare(q_any, passive=True).method.message_count == 3)
    assert drain(ch, q_all) == [b"both"]
    assert drain(ch, q_any) == [b"both", b"one", b"end"]


def test_exchange_to_exchange_binding(ch, name):
    ch.exchange_declare(name + "src", "direct")
    ch.exchange_declare(name + "dst", "fanout", auto_delete=True)
    ch.exchange_bind(name + "dst", name + "src", routing_key="k")
    q = bound_queue(ch, name + "dst")
    ch.basic_publish(name + "src", "k", b"via-e2e")
    ch.basic_publish(name + "src", "other", b"not-routed")
    ch.basic_publish("", q, b"end")
    eventually(lambda: ch.queue_declare(q, passive=True).method.message_count == 2)
    assert drain(ch, q) == [b"via-e2e", b"end"]
    ch.exchange_unbind(name + "dst", name + "src", routing_key="k")
    ch.basic_publish(name + "src", "k", b"after-unbind")
    ch.basic_publish("", q, b"end2")
    eventually(lambda: ch.queue_declare(q, passive=True).method.message_count == 1)
    assert drain(ch, q) == [b"end2"]


def test_alternate_exchange(ch, name):
    ch.exchange_declare(name + "alt", "fanout", auto_delete=True)
    ch.exchange_declare(name, "direct", arguments={"alternate-exchange": name + "alt"})
    q = bound_queue(ch, name + "alt")
    ch.basic_publish(name, "unbound-key", b"lost?")
    eventually(lambda: ch.queue_declare(q, passive=True).method.message_count == 1)
    assert drain(ch, q) == [b"lost?"]
    ch.exchange_delete(name)


def test_unbind_stops_routing(ch, name):
    ch.exchange_declare(name, "direct", auto_delete=False)
    q = bound_queue(ch, name, "k")
    ch.queue_unbind(q, name, "k")
    ch.basic_publish(name, "k", b"x")
    ch.basic_publish("", q, b"end")
    eventually(lambda: ch.queue_declare(q, passive=True).method.message_count == 1)
    assert drain(ch, q) == [b"end"]
    ch.exchange_delete(name)


@pytest.mark.warren_only
def test_unsupported_queue_type_is_406(ch, name):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "stream"})
    assert e.value.reply_code == 406
    assert "stream" in e.value.reply_text


def test_classic_queue_type_accepted(ch, name):
    ch.queue_declare(name, arguments={"x-queue-type": "classic"})
    ch.queue_delete(name)
