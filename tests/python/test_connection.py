"""Connection-level behaviour: handshake, authentication, tuning, heartbeats, and what happens to
peers that send malformed, oversized or unexpected frames (only that peer is closed, with the
right reply code, and everyone else keeps working)."""
import socket
import struct
import time

import pika
import pytest
from pika.exceptions import AMQPConnectionError, ProbableAccessDeniedError

from rawamqp import (CLIENT_PROPERTIES, FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD, PROTOCOL_HEADER, RawConnection,
                     frame, longstr, method_frame, shortstr, table)


def raw(broker, **kw):
    return RawConnection(broker.host, broker.port, **kw)


def assert_broker_healthy(broker, name):
    """Another connection can still declare, publish and get: one bad peer harmed nobody else."""
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(name, auto_delete=True)
    ch.confirm_delivery()
    ch.basic_publish("", name, b"still-alive")
    m, _, body = ch.basic_get(name, auto_ack=True)
    assert body == b"still-alive"
    ch.queue_delete(name)
    c.close()


def test_wrong_protocol_header_gets_ours_back_and_close(broker):
    r = raw(broker)
    r.send(b"AMQP\x00\x00\x08\x00")
    assert r.recv_exact(8) == PROTOCOL_HEADER
    assert r.closed_by_peer()


def test_http_request_on_amqp_port_is_refused(broker, name):
    r = raw(broker)
    r.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert r.recv_exact(8) == PROTOCOL_HEADER
    assert r.closed_by_peer()
    assert_broker_healthy(broker, name)


def test_server_properties_announce_rabbitmq_capabilities(conn):
    props = conn._impl.server_properties
    caps = props["capabilities"]
    for cap in ["publisher_confirms", "exchange_exchange_bindings", "basic.nack", "consumer_cancel_notify",
                "connection.blocked", "authentication_failure_close", "per_consumer_qos"]:
        assert caps.get(cap) is True, cap
    assert "product" in props and "version" in props


def test_wrong_password_is_403_access_refused(broker):
    r = raw(broker)
    r.send(PROTOCOL_HEADER)
    r.expect(10, 10)
    r.send(method_frame(0, 10, 11, CLIENT_PROPERTIES + shortstr("PLAIN") + longstr(b"\x00guest\x00wrong")
                        + shortstr("en_US")))
    close = r.expect(10, 50)
    code, text = close.close_reply()
    assert code == 403 and "ACCESS_REFUSED" in text
    assert r.closed_by_peer()


def test_pika_sees_authentication_failure(broker):
    params = pika.URLParameters(broker.url.replace("guest:guest", "guest:nope"))
    with pytest.raises((ProbableAccessDeniedError, AMQPConnectionError)):
        pika.BlockingConnection(params)


def test_amqplain_login(broker):
    entries = shortstr("LOGIN") + b"S" + longstr("guest") + shortstr("PASSWORD") + b"S" + longstr("guest")
    r = raw(broker)
    r.handshake(mechanism="AMQPLAIN", response=entries)
    r.open_channel(1)
    bad = raw(broker)
    wrong = shortstr("LOGIN") + b"S" + longstr("guest") + shortstr("PASSWORD") + b"S" + longstr("nope")
    with pytest.raises(AssertionError, match="got Frame.*10, 50"):
        bad.handshake(mechanism="AMQPLAIN", response=wrong)


def test_unknown_vhost_is_530(broker):
    params = pika.URLParameters(broker.url.rsplit("/", 1)[0] + "/no-such-vhost")
    with pytest.raises(AMQPConnectionError) as e:
        pika.BlockingConnection(params)
    assert "530" in repr(e.value) or "NOT_ALLOWED" in repr(e.value)


@pytest.mark.warren_only
def test_tune_announces_limits_and_channel_max_is_enforced(broker):
    # RabbitMQ 3.10 does not refuse channel_max + 1; the spec says it is the highest usable channel.
    r = raw(broker)
    channel_max, frame_max, heartbeat = r.handshake()
    assert channel_max > 0 and frame_max >= 4096
    # A channel id above what was negotiated closes the connection.
    r.send(method_frame(channel_max + 1, 20, 10, shortstr("")))
    code, text = r.expect(10, 50).close_reply()
    assert code in (503, 530), text
    assert str(channel_max) in text


def test_second_channel_open_is_504(broker):
    r = raw(broker)
    r.handshake()
    r.open_channel(1)
    r.send(method_frame(1, 20, 10, shortstr("")))
    code, text = r.expect(10, 50).close_reply()
    assert code == 504 and "CHANNEL_ERROR" in text


def test_method_on_unopened_channel_is_504(broker):
    r = raw(broker)
    r.handshake()
    r.send(method_frame(7, 50, 10, struct.pack(">H", 0) + shortstr("q") + b"\x00" + table()))
    code, _ = r.expect(10, 50).close_reply()
    assert code == 504


def test_client_close_gets_close_ok(broker):
    r = raw(broker)
    r.handshake()
    r.send(method_frame(0, 10, 50, struct.pack(">H", 200) + shortstr("bye") + struct.pack(">HH", 0, 0)))
    r.expect(10, 51)


def test_server_sends_heartbeats(broker):
    r = raw(broker)
    r.handshake(heartbeat=1)
    start = time.time()
    seen = 0
    while time.time() - start < 3.5 and seen < 2:
        r.send(frame(FRAME_HEARTBEAT, 0, b""))
        f = r.read_frame()
        if f.kind == FRAME_HEARTBEAT:
            seen += 1
    assert seen >= 2


def test_silent_peer_is_dropped_after_two_missed_heartbeats(broker, name):
    r = raw(broker, timeout=10)
    r.handshake(heartbeat=1)
    start = time.time()
    # Read (the server's heartbeats) but never write: the server must give up on us.
    assert r.closed_by_peer(timeout=8)
    assert 1.5 <= time.time() - start <= 6
    assert_broker_healthy(broker, name)


def test_heartbeats_keep_an_idle_connection_alive(broker):
    c = broker.connection(heartbeat=1)
    c.sleep(3.5)  # pika answers heartbeats while sleeping
    assert c.is_open
    c.channel().queue_declare("", exclusive=True)
    c.close()


@pytest.mark.parametrize("bad", ["frame_end", "frame_type", "oversized", "garbage_args",
                                 pytest.param("unknown_method", marks=pytest.mark.warren_only),  # RabbitMQ 3.10 crashes
                                 "header_without_publish", "body_on_channel_0",
                                 pytest.param("bad_headers_table", marks=pytest.mark.warren_only)])
def test_bad_frames_close_only_the_offender(broker, name, bad):
    other = broker.connection()
    other_ch = other.channel()
    r = raw(broker)
    _, frame_max, _ = r.handshake()
    r.open_channel(1)
    expected = {
        # Undecodable arguments: the spec says 502 SYNTAX_ERROR, RabbitMQ says 501 "cannot decode".
        "frame_end": {501}, "frame_type": {501}, "oversized": {501}, "garbage_args": {501, 502},
        "unknown_method": {540}, "header_without_publish": {505}, "body_on_channel_0": {505},
        "bad_headers_table": {502},
    }[bad]
    if bad == "frame_end":
        r.send(method_frame(1, 85, 10, b"\x00")[:-1] + b"\x00")
    elif bad == "frame_type":
        r.send(frame(42, 1, b"hello"))
    elif bad == "oversized":
        # Only the header: the server must refuse on the declared size, not wait for the bytes.
        r.send(struct.pack(">BHI", FRAME_METHOD, 1, frame_max * 4))
    elif bad == "garbage_args":
        # queue.declare whose queue-name length runs past the end of the frame.
        r.send(method_frame(1, 50, 10, struct.pack(">H", 0) + b"\xff" + b"abc"))
    elif bad == "unknown_method":
        r.send(method_frame(1, 60, 99, b""))
    elif bad == "header_without_publish":
        r.send(frame(FRAME_HEADER, 1, struct.pack(">HHQH", 60, 0, 5, 0)))
    elif bad == "bad_headers_table":
        # A headers table whose array claims more bytes than the table holds.
        entries = shortstr("a") + b"A" + struct.pack(">I", 50) + b"V"
        r.send(method_frame(1, 60, 40, struct.pack(">H", 0) + shortstr("") + shortstr(name) + b"\x00")
               + frame(FRAME_HEADER, 1, struct.pack(">HHQH", 60, 0, 1, 0x2000) + table(entries)))
    elif bad == "body_on_channel_0":
        r.send(frame(FRAME_BODY, 0, b"hello"))
    close = r.expect(10, 50)
    code, text = close.close_reply()
    assert code in expected, text
    assert len(text) > 10  # a reason a person can act on
    r.send(method_frame(0, 10, 51))
    assert r.closed_by_peer()
    # The other connection and new ones are untouched.
    other_ch.queue_declare(name, auto_delete=True)
    assert other.is_open
    other.close()
    assert_broker_healthy(broker, name + "-x")


def test_random_garbage_never_kills_the_broker(broker, name):
    import random
    rng = random.Random(7)
    for i in range(30):
        r = raw(broker, timeout=2)
        try:
            if i % 2:
                r.handshake()
                r.open_channel(1)
            else:
                r.send(PROTOCOL_HEADER)
            r.send(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000))))
            r.closed_by_peer(timeout=0.5)
        except (ConnectionError, OSError, AssertionError):
            pass
        finally:
            r.close()
    assert broker.alive()
    assert_broker_healthy(broker, name)


def test_many_connections_and_channels(broker, name):
    conns = [broker.connection() for _ in range(20)]
    chans = [c.channel() for c in conns for _ in range(5)]
    chans[0].queue_declare(name, auto_delete=False)
    for i, ch in enumerate(chans):
        ch.basic_publish("", name, str(i).encode())
    got = set()
    for _ in range(len(chans)):
        m, _, body = chans[-1].basic_get(name, auto_ack=True)
        if m is None:
            time.sleep(0.05)
            continue
        got.add(int(body))
    while len(got) < len(chans):
        m, _, body = chans[-1].basic_get(name, auto_ack=True)
        assert m is not None, f"only {len(got)} of {len(chans)} messages arrived"
        got.add(int(body))
    chans[0].queue_delete(name)
    for c in conns:
        c.close()
