"""A slow disk stalls only what waits for it: with every fsync of the store taking seconds (the test-only
fault hook WARREN_TEST_FSYNC_DELAY_MS), publishers flooding a durable queue and basic.gets that wait for
a delivered mark must not take the runtime's threads with them: an idle connection keeps getting its
heartbeats, and another connection opens a channel, declares a transient queue and gets from it at once.
"""
import struct
import threading
import time

import pytest

from conftest import Broker
from rawamqp import FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, RawConnection, frame, method_frame, shortstr

pytestmark = pytest.mark.needs_process

FSYNC_DELAY_MS = 4000
BODY = 256 * 1024
FRAME_MAX = 131072


def publish_frames(queue, body, persistent=True):
    out = [method_frame(1, 60, 40, struct.pack(">H", 0) + shortstr("") + shortstr(queue) + b"\x00")]
    flags, props = (0x1000, b"\x02") if persistent else (0, b"")
    out.append(frame(FRAME_HEADER, 1, struct.pack(">HHQH", 60, 0, len(body), flags) + props))
    step = FRAME_MAX - 8
    for i in range(0, len(body), step):
        out.append(frame(FRAME_BODY, 1, body[i:i + step]))
    return b"".join(out)


def declare(r, queue, durable):
    # queue.declare: reserved, name, flags (passive, durable, exclusive, auto-delete, nowait), arguments
    r.send(method_frame(1, 50, 10, struct.pack(">H", 0) + shortstr(queue) + bytes([2 if durable else 0]) + struct.pack(">I", 0)))
    r.expect(50, 11)


def basic_get(r, queue):
    """basic.get with no-ack; returns the body, or None on get-empty."""
    r.send(method_frame(1, 60, 70, struct.pack(">H", 0) + shortstr(queue) + b"\x01"))
    f = r.read_method()
    if f.method == (60, 72):
        return None
    assert f.method == (60, 71), f"expected basic.get-ok, got {f}"
    header = r.read_method()
    size = struct.unpack(">Q", header.payload[4:12])[0]
    body = b""
    while len(body) < size:
        body += r.read_method().payload
    return body


class Flood(threading.Thread):
    """Publishes persistent messages to a durable queue without confirms until the broker goes away."""

    def __init__(self, broker, queue):
        super().__init__(daemon=True)
        self.broker, self.queue, self.sent = broker, queue, 0

    def run(self):
        try:
            r = RawConnection(self.broker.host, self.broker.port, timeout=60)
            r.handshake()
            r.open_channel(1)
            batch = publish_frames(self.queue, b"x" * BODY) * 8
            while True:
                r.send(batch)
                self.sent += 8
        except (ConnectionError, OSError, AssertionError, struct.error):
            pass


class HeartbeatWatcher(threading.Thread):
    """An idle connection with heartbeat=1: records when the server's heartbeats arrive, answers them."""

    def __init__(self, broker):
        super().__init__(daemon=True)
        self.r = RawConnection(broker.host, broker.port, timeout=30)
        self.r.handshake(heartbeat=1)
        self.beats = [time.monotonic()]
        self.error = None
        self.stop = False

    def run(self):
        try:
            while not self.stop:
                f = self.r.read_frame()
                if f.kind == FRAME_HEARTBEAT:
                    self.beats.append(time.monotonic())
                    self.r.send(frame(FRAME_HEARTBEAT, 0, b""))
        except (ConnectionError, OSError, AssertionError, struct.error) as e:
            self.error = e

    def longest_gap(self):
        beats = self.beats + [time.monotonic()]
        return max(b - a for a, b in zip(beats, beats[1:]))


def test_a_slow_fsync_does_not_stall_other_connections(tmp_path, monkeypatch):
    monkeypatch.setenv("WARREN_TEST_FSYNC_DELAY_MS", str(FSYNC_DELAY_MS))
    b = Broker(tmp_path / "data", tmp_path / "warren.log")
    b.start()
    try:
        setup = RawConnection(b.host, b.port, timeout=30)
        setup.handshake()
        setup.open_channel(1)
        declare(setup, "flood", durable=True)
        declare(setup, "marked", durable=True)
        setup.send(publish_frames("marked", b"m" * 100) * 2)
        time.sleep(0.2)

        watcher = HeartbeatWatcher(b)
        watcher.start()
        floods = [Flood(b, "flood") for _ in range(2)]
        for f in floods:
            f.start()
        # basic.get on a durable queue's persistent message waits for its delivered mark's fsync: that
        # wait must not hold a runtime thread either.
        got_marked = []
        getters = []
        for _ in range(2):
            def get_marked():
                r = RawConnection(b.host, b.port, timeout=60)
                r.handshake()
                r.open_channel(1)
                got_marked.append(basic_get(r, "marked"))
            t = threading.Thread(target=get_marked, daemon=True)
            t.start()
            getters.append(t)

        slowest = 0.0
        deadline = time.monotonic() + 3 * FSYNC_DELAY_MS / 1000
        round_ = 0
        while time.monotonic() < deadline:
            started = time.monotonic()
            r = RawConnection(b.host, b.port, timeout=30)
            r.handshake()
            r.open_channel(1)
            q = f"transient-{round_}"
            declare(r, q, durable=False)
            r.send(publish_frames(q, b"hello", persistent=False))
            assert basic_get(r, q) == b"hello"
            r.close()
            slowest = max(slowest, time.monotonic() - started)
            round_ += 1
            time.sleep(0.2)

        assert watcher.error is None, f"the idle connection was dropped: {watcher.error!r}"
        gap = watcher.longest_gap()
        assert gap < FSYNC_DELAY_MS / 2000, f"heartbeats stalled for {gap:.1f} s while fsyncs took {FSYNC_DELAY_MS} ms"
        assert slowest < FSYNC_DELAY_MS / 2000, \
            f"opening a channel, declaring and getting from a transient queue took {slowest:.1f} s"
        assert sum(f.sent for f in floods) > 0
        for t in getters:
            t.join(4 * FSYNC_DELAY_MS / 1000)
        assert sorted(got_marked) == [b"m" * 100] * 2, "both basic.gets on the durable queue were answered"
        watcher.stop = True
    finally:
        b.proc.kill()
        b.proc.wait(10)


def test_a_publisher_waiting_for_confirms_on_a_slow_disk_still_gets_heartbeats(tmp_path, monkeypatch):
    """Issue 33, item 8: with heartbeat=1 and every fsync taking 4 s, a publisher with confirms hears
    from the server at least every ~1 s (heartbeats between the confirms). Before, each publish woke
    the connection's writer with nothing to write yet and restarted its heartbeat timer: nothing
    came for 4 s at a time, and a client takes a server that silent for dead."""
    monkeypatch.setenv("WARREN_TEST_FSYNC_DELAY_MS", str(FSYNC_DELAY_MS))
    b = Broker(tmp_path / "data", tmp_path / "warren.log")
    b.start()
    try:
        r = RawConnection(b.host, b.port, timeout=30)
        r.handshake(heartbeat=1)
        r.open_channel(1)
        declare(r, "confirmed", durable=True)
        r.send(method_frame(1, 85, 10, b"\x00"))  # confirm.select
        r.expect(85, 11)
        heard = [time.monotonic()]
        errors = []

        def read():
            # Never sends: the publishes below are the client's side of the heartbeat.
            try:
                while True:
                    r.read_frame()
                    heard.append(time.monotonic())
            except (ConnectionError, OSError, AssertionError, struct.error) as e:
                errors.append(e)

        threading.Thread(target=read, daemon=True).start()
        end = time.monotonic() + 2.5 * FSYNC_DELAY_MS / 1000
        while time.monotonic() < end:
            r.send(publish_frames("confirmed", b"c" * 100))
            time.sleep(0.05)
        marks = heard + [time.monotonic()]
        longest = max(b - a for a, b in zip(marks, marks[1:]))
        assert not errors, errors
        assert longest < 2.5, f"the server was silent for {longest:.1f} s (heartbeat=1)"
    finally:
        b.proc.kill()
        b.proc.wait(10)
