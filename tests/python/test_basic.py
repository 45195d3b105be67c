"""basic.*: publish, consume, get, ack/nack/reject, qos, recover, cancel, properties, as RabbitMQ does."""
import datetime
import decimal
import struct
import time

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, UnroutableError

from conftest import eventually
from rawamqp import FRAME_BODY, FRAME_HEADER, RawConnection, frame, method_frame, shortstr, table


def consume_n(conn, ch, queue, n, auto_ack=False, timeout=10):
    """Starts a consumer and returns (tag, [(method, properties, body)]) once n deliveries arrived."""
    got = []
    tag = ch.basic_consume(queue, lambda c, m, p, b: got.append((m, p, b)), auto_ack=auto_ack)
    deadline = time.time() + timeout
    while len(got) < n and time.time() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(got) >= n, f"only {len(got)} of {n} deliveries"
    return tag, got


def settle(conn, seconds=0.3):
    """Lets in-flight deliveries arrive, to show that no more than expected do."""
    conn.process_data_events(time_limit=seconds)


def arrived(conn, done, timeout=10):
    """Processes events until `done()` holds (at most `timeout` s), then settles: what is expected
    has arrived however slow the machine, and a moment shows that no more than that does."""
    deadline = time.time() + timeout
    while not done() and time.time() < deadline:
        conn.process_data_events(time_limit=0.05)
    settle(conn)


def test_consume_gets_messages_in_order(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    for i in range(50):
        ch.basic_publish("", name, str(i).encode())
    tag, got = consume_n(conn, ch, name, 50)
    assert [int(b) for _, _, b in got] == list(range(50))
    assert [m.delivery_tag for m, _, _ in got] == list(range(1, 51))
    assert all(m.consumer_tag == tag and not m.redelivered and m.routing_key == name for m, _, _ in got)
    ch.basic_ack(got[-1][0].delivery_tag, multiple=True)
    assert ch.queue_declare(name, passive=True).method.message_count == 0
    ch.basic_cancel(tag)
    # auto-delete: gone with its last consumer
    with pytest.raises(ChannelClosedByBroker):
        ch.queue_declare(name, passive=True)


def test_get_ok_and_get_empty(ch, name):
    ch.queue_declare(name, auto_delete=True)
    assert ch.basic_get(name) == (None, None, None)
    for b in (b"a", b"b", b"c"):
        ch.basic_publish("", name, b)
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 3)
    m, _, body = ch.basic_get(name)
    assert body == b"a" and m.message_count == 2 and not m.redelivered and m.delivery_tag == 1


def test_no_ack_consumer_removes_messages(broker, name):
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(name)
    for i in range(5):
        ch.basic_publish("", name, b"x")
    consume_n(c, ch, name, 5, auto_ack=True)
    c.close()
    c2 = broker.connection()
    assert c2.channel().queue_declare(name, passive=True).method.message_count == 0
    c2.channel().queue_delete(name)
    c2.close()


def test_nack_requeue_sets_redelivered_and_keeps_position(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    for b in (b"1", b"2", b"3"):
        ch.basic_publish("", name, b)
    m1, _, _ = eventually(lambda: ch.basic_get(name))
    ch.basic_nack(m1.delivery_tag, requeue=True)
    again, _, body = ch.basic_get(name)
    assert body == b"1" and again.redelivered
    m2, _, body2 = ch.basic_get(name)
    assert body2 == b"2" and not m2.redelivered


def test_reject_without_requeue_drops(ch, name):
    ch.queue_declare(name, auto_delete=True)
    ch.basic_publish("", name, b"x")
    m, _, _ = eventually(lambda: ch.basic_get(name))
    ch.basic_reject(m.delivery_tag, requeue=False)
    assert ch.basic_get(name) == (None, None, None)


def test_nack_multiple(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    for i in range(5):
        ch.basic_publish("", name, str(i).encode())
    _, got = consume_n(conn, ch, name, 5)
    ch.basic_nack(got[2][0].delivery_tag, multiple=True, requeue=False)  # drops 0, 1, 2
    ch.basic_nack(got[4][0].delivery_tag, multiple=True, requeue=True)  # requeues 3, 4
    arrived(conn, lambda: len(got) >= 7)
    redelivered = got[5:]
    assert [int(b) for _, _, b in redelivered] == [3, 4]
    assert all(m.redelivered for m, _, _ in redelivered)


@pytest.mark.parametrize("how", ["unknown", "twice"])
def test_bad_delivery_tag_is_406(conn, ch, name, how):
    ch.queue_declare(name, auto_delete=True)
    ch.basic_publish("", name, b"x")
    m, _, _ = eventually(lambda: ch.basic_get(name))
    with pytest.raises(ChannelClosedByBroker) as e:
        if how == "unknown":
            ch.basic_ack(m.delivery_tag + 10)
        else:
            ch.basic_ack(m.delivery_tag)
            ch.basic_ack(m.delivery_tag)
        ch.queue_declare(name, passive=True)  # a round trip, to see the close
    assert e.value.reply_code == 406
    assert "unknown delivery tag" in e.value.reply_text


def test_per_consumer_prefetch(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    for i in range(10):
        ch.basic_publish("", name, str(i).encode())
    ch.basic_qos(prefetch_count=3)
    got = []
    ch.basic_consume(name, lambda c, m, p, b: got.append(m))
    other = []
    ch.basic_consume(name, lambda c, m, p, b: other.append(m))
    arrived(conn, lambda: len(got) + len(other) >= 6)
    assert len(got) == 3 and len(other) == 3  # each consumer has its own limit of 3
    ch.basic_ack(got[0].delivery_tag)
    arrived(conn, lambda: len(got) + len(other) >= 7)
    assert len(got) + len(other) == 7


def test_global_prefetch_is_shared_by_the_channel(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    for i in range(10):
        ch.basic_publish("", name, str(i).encode())
    ch.basic_qos(prefetch_count=4, global_qos=True)
    got = []
    ch.basic_consume(name, lambda c, m, p, b: got.append(m))
    ch.basic_consume(name, lambda c, m, p, b: got.append(m))
    arrived(conn, lambda: len(got) >= 4)
    assert len(got) == 4
    ch.basic_ack(got[-1].delivery_tag, multiple=True)
    arrived(conn, lambda: len(got) >= 8)
    assert len(got) == 8


def test_prefetch_change_applies_to_next_consumer_only(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    for i in range(10):
        ch.basic_publish("", name, b"x")
    ch.basic_qos(prefetch_count=1)
    first = []
    ch.basic_consume(name, lambda c, m, p, b: first.append(m))
    ch.basic_qos(prefetch_count=5)
    arrived(conn, lambda: len(first) >= 1)
    assert len(first) == 1


def test_recover_requeues_unacked_as_redelivered(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    for i in range(3):
        ch.basic_publish("", name, str(i).encode())
    _, got = consume_n(conn, ch, name, 3)
    ch.basic_recover(requeue=True)
    arrived(conn, lambda: len(got) >= 6)
    again = got[3:]
    assert sorted(int(b) for _, _, b in again) == [0, 1, 2]
    assert all(m.redelivered for m, _, _ in again)


@pytest.mark.parametrize("what", ["channel", "connection"])
def test_unacked_are_requeued_when_the_consumer_goes(broker, name, what):
    keeper = broker.connection()
    kch = keeper.channel()
    kch.queue_declare(name, auto_delete=False)
    for i in range(5):
        kch.basic_publish("", name, str(i).encode())
    c = broker.connection()
    ch = c.channel()
    _, got = consume_n(c, ch, name, 5)
    ch.basic_ack(got[1][0].delivery_tag)  # 1 is gone for good
    if what == "channel":
        ch.close()
    else:
        c.close()
    bodies = []
    while len(bodies) < 4:
        m, _, body = eventually(lambda: kch.basic_get(name, auto_ack=True))
        assert m.redelivered
        bodies.append(int(body))
    assert bodies == [0, 2, 3, 4]
    kch.queue_delete(name)
    keeper.close()
    if c.is_open:
        c.close()


def test_exclusive_consumer(broker, conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    ch.basic_consume(name, lambda *a: None, exclusive=True)
    other = conn.channel()
    with pytest.raises(ChannelClosedByBroker) as e:
        other.basic_consume(name, lambda *a: None)
    assert e.value.reply_code == 403 and name in e.value.reply_text


def test_exclusive_consume_when_queue_has_consumers_is_403(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    ch.basic_consume(name, lambda *a: None)
    other = conn.channel()
    with pytest.raises(ChannelClosedByBroker) as e:
        other.basic_consume(name, lambda *a: None, exclusive=True)
    assert e.value.reply_code == 403


def basic_consume_raw(r, queue, tag, exclusive=False):
    flags = 0x08 if exclusive else 0
    r.send(method_frame(1, 60, 20, struct.pack(">H", 0) + shortstr(queue) + shortstr(tag) + bytes([flags]) + table()))


def test_server_generates_consumer_tags_and_refuses_reuse(broker, ch, name):
    ch.queue_declare(name, auto_delete=True)
    r = RawConnection(broker.host, broker.port)
    r.handshake()
    r.open_channel(1)
    basic_consume_raw(r, name, "")
    ok = r.expect(60, 21)
    tag = ok.payload[5:5 + ok.payload[4]].decode()
    assert tag.startswith("amq.ctag-") and len(tag) > len("amq.ctag-") + 10
    basic_consume_raw(r, name, tag)
    code, text = r.expect(10, 50).close_reply()
    assert code == 530 and tag in text


def test_cancel_stops_deliveries(conn, ch, name):
    ch.queue_declare(name, auto_delete=False)
    got = []
    tag = ch.basic_consume(name, lambda c, m, p, b: got.append(b), auto_ack=True)
    ch.basic_publish("", name, b"1")
    eventually(lambda: (settle(conn, 0.05), got)[1])
    ch.basic_cancel(tag)
    ch.basic_publish("", name, b"2")
    settle(conn)
    assert got == [b"1"]
    assert ch.queue_declare(name, passive=True).method.message_count == 1
    ch.queue_delete(name)


def test_server_cancels_consumer_when_queue_is_deleted(broker, conn, ch, name):
    ch.queue_declare(name)
    cancelled = []
    ch.add_on_cancel_callback(lambda method: cancelled.append(method))
    tag = ch.basic_consume(name, lambda *a: None)
    other = broker.connection()
    other.channel().queue_delete(name)
    other.close()
    eventually(lambda: (settle(conn, 0.05), cancelled)[1])
    assert cancelled[0].method.consumer_tag == tag
    assert ch.is_open


def test_mandatory_unroutable_is_returned_312(conn, ch, name):
    returned = []
    ch.add_on_return_callback(lambda c, m, p, b: returned.append((m, b)))
    ch.basic_publish("amq.direct", name, b"lost", mandatory=True)
    ch.basic_publish("amq.direct", name, b"silently dropped")  # not mandatory: no return
    eventually(lambda: (settle(conn, 0.05), returned)[1])
    settle(conn)
    assert len(returned) == 1
    m, body = returned[0]
    assert (m.reply_code, m.reply_text, m.exchange, m.routing_key, body) == (312, "NO_ROUTE", "amq.direct", name, b"lost")


def test_mandatory_with_confirms_returns_then_acks(ch, name):
    ch.confirm_delivery()
    with pytest.raises(UnroutableError):
        ch.basic_publish("amq.direct", name, b"lost", mandatory=True)


ALL_HEADER_VALUES = {
    "str": "text é", "bytes": b"\x00\xffraw", "true": True, "false": False, "int": 2**31 - 1,
    "neg": -(2**31), "long": 2**62, "decimal": decimal.Decimal("3.14"),
    "time": datetime.datetime(2026, 11, 23, 8, 0, tzinfo=datetime.timezone.utc),
    "table": {"a": 1, "nested": {"deep": ["x", 2, {"k": None}]}}, "array": [1, "two", [3.0 and 3], {"four": 4}],
    "void": None,
}


def test_all_properties_and_header_types_round_trip(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    props = pika.BasicProperties(
        content_type="application/json", content_encoding="gzip", headers=ALL_HEADER_VALUES, delivery_mode=2,
        priority=7, correlation_id="corr-1", reply_to="replies", expiration="60000", message_id="msg-1",
        timestamp=1_700_000_000, type="order.created", user_id="guest", app_id="tests", cluster_id="c-1",
    )
    ch.basic_publish("", name, b"body", properties=props)
    _, got = consume_n(conn, ch, name, 1, auto_ack=True)
    _, p, body = got[0]
    assert body == b"body"
    for attr in ["content_type", "content_encoding", "delivery_mode", "priority", "correlation_id", "reply_to",
                 "expiration", "message_id", "timestamp", "type", "user_id", "app_id", "cluster_id"]:
        assert getattr(p, attr) == getattr(props, attr), attr
    assert p.headers == ALL_HEADER_VALUES


def test_no_properties_round_trip(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    ch.basic_publish("", name, b"")
    _, got = consume_n(conn, ch, name, 1, auto_ack=True)
    _, p, body = got[0]
    assert body == b""
    assert all(getattr(p, a) is None for a in ["content_type", "headers", "delivery_mode", "priority", "timestamp"])


def test_large_message_spans_frames(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    big = bytes(range(256)) * 4096 * 3  # 3 MiB, many body frames each way
    ch.basic_publish("", name, big)
    _, got = consume_n(conn, ch, name, 1, auto_ack=True)
    assert got[0][2] == big


def test_user_id_must_match_the_login(ch, name):
    ch.queue_declare(name, auto_delete=True)
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_publish("", name, b"x", properties=pika.BasicProperties(user_id="mallory"))
        ch.queue_declare(name, passive=True)
    assert e.value.reply_code == 406
    assert "mallory" in e.value.reply_text and "guest" in e.value.reply_text


def test_publish_to_missing_exchange_is_404(ch, name):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_publish(name, "k", b"x")
        ch.queue_declare("", exclusive=True)
    assert e.value.reply_code == 404 and name in e.value.reply_text


def test_consume_from_missing_queue_is_404(ch, name):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_consume(name, lambda *a: None)
    assert e.value.reply_code == 404


@pytest.mark.warren_only
def test_channel_flow_pauses_deliveries(conn, ch, name):
    # RabbitMQ refuses client-side flow(active=false) with 540; Warren implements the spec.
    ch.queue_declare(name, auto_delete=True)
    got = []
    ch.basic_consume(name, lambda c, m, p, b: got.append(b), auto_ack=True)
    assert ch.flow(False) is False
    ch.basic_publish("", name, b"held")
    settle(conn)
    assert got == []
    assert ch.flow(True) is True
    eventually(lambda: (settle(conn, 0.05), got)[1])
    assert got == [b"held"]


# Every field type RabbitMQ knows, written by hand, so types no client library sends (b B s u i f d)
# are covered too. The broker must hand back exactly these bytes.
EVERY_TYPE_ENTRIES = b"".join([
    shortstr("t") + b"t\x01",
    shortstr("b") + b"b\x80",
    shortstr("B") + b"B\xff",
    shortstr("s") + b"s" + struct.pack(">h", -2),
    shortstr("u") + b"u" + struct.pack(">H", 65535),
    shortstr("I") + b"I" + struct.pack(">i", -7),
    shortstr("i") + b"i" + struct.pack(">I", 4_000_000_000),
    shortstr("l") + b"l" + struct.pack(">q", -(2**62)),
    shortstr("f") + b"f" + struct.pack(">f", 1.5),
    shortstr("d") + b"d" + struct.pack(">d", -2.25),
    shortstr("D") + b"D\x02" + struct.pack(">i", 314),
    shortstr("S") + b"S" + struct.pack(">I", 3) + b"abc",
    shortstr("x") + b"x" + struct.pack(">I", 2) + b"\x00\x01",
    shortstr("T") + b"T" + struct.pack(">Q", 1_700_000_000),
    shortstr("V") + b"V",
    shortstr("A") + b"A" + struct.pack(">I", 8) + b"I" + struct.pack(">i", 1) + b"t\x00" + b"V",
    shortstr("F") + b"F" + table(shortstr("n") + b"F" + table(shortstr("z") + b"S" + struct.pack(">I", 0))),
])


def test_every_field_type_is_stored_and_delivered_byte_exact(broker, name):
    r = RawConnection(broker.host, broker.port)
    r.handshake()
    r.open_channel(1)
    r.send(method_frame(1, 50, 10, struct.pack(">H", 0) + shortstr(name) + b"\x08" + table()))  # auto-delete
    r.expect(50, 11)
    body = b"payload"
    # Property flags: headers (bit 13) and delivery-mode (bit 12) set.
    props = struct.pack(">H", 0x2000 | 0x1000) + table(EVERY_TYPE_ENTRIES) + b"\x02"
    header = struct.pack(">HHQ", 60, 0, len(body)) + props
    r.send(method_frame(1, 60, 40, struct.pack(">H", 0) + shortstr("") + shortstr(name) + b"\x00")
           + frame(FRAME_HEADER, 1, header) + frame(FRAME_BODY, 1, body))
    for _ in range(50):
        r.send(method_frame(1, 60, 70, struct.pack(">H", 0) + shortstr(name) + b"\x01"))  # basic.get no-ack
        f = r.read_method()
        if f.method == (60, 71):
            break
        assert f.method == (60, 72)  # get-empty: not routed yet
        time.sleep(0.02)
    got_header = r.read_frame()
    assert got_header.kind == FRAME_HEADER
    assert got_header.payload == header
    assert r.read_frame().payload == body
    r.close()
