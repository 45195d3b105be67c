"""Memory that clients cannot grow without bound (issue 9, defect 7): a client that never reads what its
publishes cause, a socket that stops reading, a content header that declares a huge body, an endless
transaction, a consumer with no prefetch limit. The broker's memory is read from /proc/PID/status."""
import select
import socket
import struct
import threading
import time

import pytest

from conftest import Broker, eventually
from rawamqp import (FRAME_BODY, FRAME_HEADER, RawConnection, frame, method_frame, publish_frames,
                     queue_declare_frame, shortstr, table)

pytestmark = pytest.mark.needs_process

MB = 1 << 20
CLOSED_FOR_NOT_READING = "the client read nothing for write-timeout"


def proc_status_mb(pid, field):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def rss_mb(broker):
    return proc_status_mb(broker.proc.pid, "VmRSS")


@pytest.fixture
def limited_broker(tmp_path, monkeypatch):
    """A broker with a short write-timeout (3 s), so that tests of it do not take 30 s."""
    monkeypatch.setenv("WARREN_WRITE_TIMEOUT", "3")
    b = Broker(tmp_path / "data", tmp_path / "warren.log")
    b.start()
    yield b
    if b.alive():
        b.proc.kill()
        b.proc.wait(10)


def check_healthy(broker, name):
    """Another client can still declare, publish and get."""
    with broker.connection() as c:
        ch = c.channel()
        ch.queue_declare(name + "-ok", auto_delete=False)
        ch.basic_publish("", name + "-ok", b"still here")
        method, _, body = eventually(lambda: (lambda r: r if r[0] else None)(ch.basic_get(name + "-ok", auto_ack=True)))
        assert body == b"still here"
        ch.queue_delete(name + "-ok")


class Flooder(threading.Thread):
    """Sends `chunk` over and over on a raw socket and never reads, until stopped or the broker closes the
    socket. Partial sends are resumed, so the stream stays well-formed."""

    def __init__(self, raw, chunk):
        super().__init__(daemon=True)
        self.raw, self.chunk = raw, memoryview(chunk)
        self.sent = 0
        self.stop = False
        self.closed = False

    def run(self):
        self.raw.sock.settimeout(0.2)
        try:
            while not self.stop:
                view = self.chunk
                while view and not self.stop:
                    try:
                        n = self.raw.sock.send(view)
                    except socket.timeout:
                        continue
                    view = view[n:]
                    self.sent += n
        except OSError:
            self.closed = True


def wait_until_stalled(broker, flooder, limit_mb, timeout=60):
    """Waits until the flooder can send no more (the broker stopped reading); fails as soon as the
    broker's memory passes `limit_mb`. Returns the highest RSS seen."""
    peak, last_sent, still_since = 0, -1, time.time()
    deadline = time.time() + timeout
    while time.time() < deadline:
        rss = rss_mb(broker)
        peak = max(peak, rss)
        if rss > limit_mb:
            flooder.stop = True
            raise AssertionError(f"broker RSS {rss:.0f} MB after the client sent {flooder.sent / MB:.0f} MB")
        if flooder.sent != last_sent:
            last_sent, still_since = flooder.sent, time.time()
        elif time.time() - still_since > 2:
            return peak
        time.sleep(0.1)
    flooder.stop = True
    raise AssertionError(f"the client could still send after {timeout}s ({flooder.sent / MB:.0f} MB): nothing pushed back")


def test_client_that_never_reads_its_returns_is_pushed_back_then_dropped(limited_broker, name):
    """Mandatory unroutable publishes cause a basic.return each, with the whole body. A client that never
    reads them once drove the broker past 6 GB; now the broker stops reading it (TCP back-pressure) once
    a few MB wait for its socket, other clients are unaffected, and after write-timeout it is closed."""
    broker = limited_broker
    base = rss_mb(broker)
    r = RawConnection(broker.host, broker.port)
    r.handshake()
    r.open_channel(1)
    flooder = Flooder(r, publish_frames(1, "no-such-queue-" + name, b"r" * MB, persistent=False, mandatory=True) * 8)
    flooder.start()
    peak = wait_until_stalled(broker, flooder, limit_mb=base + 300)
    print(f"client stalled after sending {flooder.sent / MB:.0f} MB; broker RSS {base:.0f} MB idle, {peak:.0f} MB peak")
    check_healthy(broker, name)
    assert peak < base + 300, f"RSS grew from {base:.0f} to {peak:.0f} MB"
    # The client reads nothing: after write-timeout (3 s) the broker closes the connection.
    flooder.stop = True
    eventually(lambda: CLOSED_FOR_NOT_READING in broker.log_text(), timeout=20)
    assert r.closed_by_peer(timeout=20)
    check_healthy(broker, name)


def test_consumer_that_stops_reading_is_dropped_after_write_timeout(limited_broker, name):
    broker = limited_broker
    with broker.connection() as c:
        ch = c.channel()
        ch.queue_declare(name)
        for _ in range(40):
            ch.basic_publish("", name, b"d" * MB)
    r = RawConnection(broker.host, broker.port)
    r.handshake()
    r.open_channel(1)
    r.send(method_frame(1, 60, 20, struct.pack(">H", 0) + shortstr(name) + shortstr("") + b"\x02" + table()))
    # Never read: the deliveries fill the socket buffers, then the broker's writes make no progress.
    started = time.time()
    eventually(lambda: CLOSED_FOR_NOT_READING in broker.log_text(), timeout=30)
    assert time.time() - started >= 2, "closed before write-timeout (3 s)"
    assert r.closed_by_peer(timeout=20)
    check_healthy(broker, name)


def test_content_header_does_not_reserve_its_declared_size(broker, name):
    """A header declaring 100 MB, followed by one small body frame, on 40 channels: memory follows what
    arrived, not what was declared (before: 100 MB reserved per channel, 4 GB of address space)."""
    r = RawConnection(broker.host, broker.port)
    r.handshake()
    channels = 40
    for ch in range(1, channels + 1):
        r.open_channel(ch)
    pid = broker.proc.pid
    base_rss, base_vm = proc_status_mb(pid, "VmRSS"), proc_status_mb(pid, "VmSize")
    declared = 100 * MB
    for ch in range(1, channels + 1):
        r.send(method_frame(ch, 60, 40, struct.pack(">H", 0) + shortstr("") + shortstr(name) + b"\x00")
               + frame(FRAME_HEADER, ch, struct.pack(">HHQH", 60, 0, declared, 0))
               + frame(FRAME_BODY, ch, b"b" * 100_000))
    # A round trip on another channel: everything before it was processed.
    r.open_channel(channels + 1)
    rss, vm = proc_status_mb(pid, "VmRSS"), proc_status_mb(pid, "VmSize")
    assert vm - base_vm < 1024, f"address space grew by {vm - base_vm:.0f} MB for {channels} partial messages"
    assert rss - base_rss < 200, f"RSS grew by {rss - base_rss:.0f} MB"
    r.close()
    check_healthy(broker, name)


def test_transactions_are_bounded(broker, name):
    """A transaction holds at most 100,000 operations and 128 MiB of messages (max-message-size if larger)
    until tx.commit: past that the channel is closed with 406."""
    r = RawConnection(broker.host, broker.port, timeout=30)
    r.handshake()
    r.open_channel(1)
    r.send(method_frame(1, 90, 10))  # tx.select
    r.expect(90, 11)
    # 100,001 empty publishes exceed the operation limit (an ack of an unknown tag would fail the
    # transaction at once: acks are checked when made).
    r.send(publish_frames(1, name, b"", persistent=False) * 100_001)
    f = r.expect(20, 40)
    code, text = f.close_reply()
    assert code == 406 and "transaction too large" in text, (code, text)
    r.send(method_frame(1, 20, 41))
    r.open_channel(2)
    r.send(queue_declare_frame(2, name, durable=False))
    r.expect(50, 11)
    r.send(method_frame(2, 90, 10))
    r.expect(90, 11)
    r.send(publish_frames(2, name, b"t" * (48 * MB), persistent=False) * 3)
    f = r.expect(20, 40)
    code, text = f.close_reply()
    assert code == 406 and "transaction too large" in text, (code, text)
    r.close()
    check_healthy(broker, name)


def read_delivery(r):
    """A basic.deliver with its content: (channel, delivery_tag, body size); skips basic.consume-ok."""
    f = r.read_method()
    while f.method == (60, 21):
        f = r.read_method()
    assert f.method == (60, 60), f"expected basic.deliver, got {f}"
    n = f.payload[4]
    tag = struct.unpack(">Q", f.payload[5 + n:13 + n])[0]
    header = r.read_frame()
    assert header.kind == FRAME_HEADER
    size = struct.unpack(">Q", header.payload[4:12])[0]
    got = 0
    while got < size:
        got += len(r.read_frame().payload)
    return f.channel, tag, size


def more_to_read(r, wait):
    """Whether bytes of a delivery are buffered or arrive within `wait` seconds (none are consumed).
    Only decides when to stop reading: what must have arrived is read with the socket's long timeout."""
    return bool(r.buf) or bool(select.select([r.sock], [], [], wait)[0])


def test_unacked_bytes_per_connection_are_bounded_without_prefetch(broker, name):
    """Consumers with no prefetch limit that do not ack get deliveries up to 128 MiB of unacked
    messages per connection (its three channels together), then no more until some are acked; acks let
    them go on, and everything arrives in the end."""
    n = 160
    with broker.connection() as c:
        ch = c.channel()
        ch.queue_declare(name)
        r = RawConnection(broker.host, broker.port, timeout=60)  # a stall under load is no failure
        r.handshake()
        channels = (1, 2, 3)
        for channel in channels:
            r.open_channel(channel)
        # All three consumers are registered before there is anything to deliver: the queue then
        # gives each its turn, and none takes the whole backlog before the others are there.
        for channel in channels:
            r.send(method_frame(channel, 60, 20, struct.pack(">H", 0) + shortstr(name) + shortstr("") + b"\x00" + table()))
            r.expect(60, 21)
        for _ in range(n):
            ch.basic_publish("", name, b"u" * MB)
        got = []

        def read_one():
            channel, tag, _ = read_delivery(r)
            got.append((channel, tag))

        while len(got) < 124 or more_to_read(r, 1.0):
            read_one()
        # The broker's own count of what it handed out (a round trip after every publish): whatever
        # it handed out must arrive, however slowly; past the limit nothing more was handed out.
        handed_out = n - ch.queue_declare(name, passive=True).method.message_count
        while len(got) < handed_out:
            read_one()
        assert 124 <= len(got) <= 132, f"{len(got)} MB delivered and unacked (limit 128 MiB per connection)"
        assert {c for c, _ in got} == set(channels)
        first_round = len(got)
        acked_up_to = {c: 0 for c in channels}

        def ack_all():
            for channel, tag in got:
                if tag > acked_up_to[channel]:
                    acked_up_to[channel] = tag
                    r.send(method_frame(channel, 60, 80, struct.pack(">QB", tag, 1)))

        while len(got) < n:
            ack_all()
            read_one()  # the acks made room: another delivery comes
        ack_all()
        r.send(method_frame(1, 60, 10, struct.pack(">IHB", 0, 0, 0)))  # basic.qos: a round trip, acks processed
        r.expect(60, 11)
        r.close()
        assert first_round < n
        assert eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 0)


def test_direct_replies_to_a_client_that_never_reads_are_bounded(broker, name):
    """Direct reply-to replies are pushed by the replier's connection into the requester's outbox: a
    requester that stops reading must not make the broker buffer them without bound. Replies it cannot
    take are dropped, as replies to a requester that is gone."""
    import pika
    base = rss_mb(broker)
    requester = broker.connection()
    rch = requester.channel()
    rch.queue_declare(name)
    rch.basic_consume("amq.rabbitmq.reply-to", lambda *a: None, auto_ack=True)
    rch.basic_publish("", name, b"request", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
    # From here on the requester reads nothing.
    with broker.connection() as server:
        sch = server.channel()
        method, props, _ = eventually(lambda: (lambda r: r if r[0] else None)(sch.basic_get(name, auto_ack=True)))
        peak = 0
        for i in range(400):
            sch.basic_publish("", props.reply_to, b"p" * MB)
            if i % 20 == 0:
                sch.queue_declare(name, passive=True)  # a round trip: the replies were routed
                peak = max(peak, rss_mb(broker))
                assert peak < base + 300, f"RSS {peak:.0f} MB after {i} MB of replies to a client that does not read"
        sch.queue_declare(name, passive=True)
        peak = max(peak, rss_mb(broker))
    assert peak < base + 300, f"RSS grew from {base:.0f} to {peak:.0f} MB"
    check_healthy(broker, name)


def test_unfinished_messages_are_bounded_per_connection(tmp_path, monkeypatch, name):
    """Each channel may hold a message half received (up to max-message-size), but all of a connection's
    channels together at most twice max-message-size: 2,047 channels x 128 MiB would be 256 GiB. Here
    max-message-size is 4 MB: three channels with 3.5 MB each received, the third is closed with 406."""
    monkeypatch.setenv("WARREN_MAX_MESSAGE_SIZE", str(4_000_000))
    broker = Broker(tmp_path / "data", tmp_path / "warren.log")
    broker.start()
    try:
        r = RawConnection(broker.host, broker.port, timeout=10)
        r.handshake()
        for ch in (1, 2, 3):
            r.open_channel(ch)
        r.send(queue_declare_frame(1, name, durable=False))
        r.expect(50, 11)
        part = b"p" * 100_000
        for ch in (1, 2, 3):
            r.send(method_frame(ch, 60, 40, struct.pack(">H", 0) + shortstr("") + shortstr(name) + b"\x00")
                   + frame(FRAME_HEADER, ch, struct.pack(">HHQH", 60, 0, 4_000_000, 0)))
        for _ in range(35):  # 3.5 MB on each channel, interleaved
            r.send(b"".join(frame(FRAME_BODY, ch, part) for ch in (1, 2, 3)))
        f = r.expect(20, 40)
        code, text = f.close_reply()
        assert f.channel == 3 and code == 406 and "unfinished messages" in text, (f.channel, code, text)
        # The others go on: channel 1 finishes its message.
        r.send(frame(FRAME_BODY, 1, part) * 5)
        r.send(method_frame(1, 50, 10, struct.pack(">H", 0) + shortstr(name) + b"\x01" + table()))  # passive
        f = r.read_method()
        while f.method == (20, 41) or f.channel != 1:
            f = r.read_method()
        assert f.method == (50, 11), f
        n = f.payload[4]
        assert struct.unpack(">I", f.payload[5 + n:9 + n])[0] == 1, "channel 1's message was routed"
        r.close()
    finally:
        broker.proc.kill()
        broker.proc.wait(10)
