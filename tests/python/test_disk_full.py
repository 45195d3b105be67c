"""A really full disk: the broker's data directory on a small tmpfs that a ballast file fills while a
publisher publishes persistent messages with confirms.

- Below the disk free limit, the disk alarm blocks the publisher (connection.blocked); nothing is lost.
- Filled to the last byte, the store's writes fail with ENOSPC: the store waits for space and tries
  again (it does not abort), raises the disk alarm, and confirms nothing it could not write.
- Either way, once the ballast is deleted the broker carries on without a restart: the publisher is
  unblocked, and every confirmed message is consumable, intact and exactly once. And a broker killed
  while the disk is full loses nothing it confirmed.
"""
import os
import struct
import subprocess
import threading
import time

import pytest

from conftest import Broker, eventually
from rawamqp import (FRAME_BODY, FRAME_HEADER, FRAME_METHOD, PROTOCOL_HEADER, RawConnection, frame, longstr,
                     method_frame, shortstr, table)

pytestmark = pytest.mark.needs_process

QUEUE = "disk-full-q"
SIZE = 4000
TMPFS_SIZE = "400m"
DISK_FREE_LIMIT = "200MiB"  # the broker never uses less than 128 MiB
CAPABILITIES = table(shortstr("capabilities") + b"F" + table(
    shortstr("connection.blocked") + b"t\x01" + shortstr("publisher_confirms") + b"t\x01"))


def body_for(seq):
    head = b"%08d|" % seq
    return head + bytes((seq + i) % 251 for i in range(SIZE - len(head)))


def handshake(r):
    r.send(PROTOCOL_HEADER)
    r.expect(10, 10)
    r.send(method_frame(0, 10, 11, CAPABILITIES + shortstr("PLAIN") + longstr(b"\0guest\0guest") + shortstr("en_US")))
    tune = r.expect(10, 30)
    channel_max, frame_max, _ = struct.unpack(">HIH", tune.payload[4:12])
    r.send(method_frame(0, 10, 31, struct.pack(">HIH", channel_max, frame_max, 0)))
    r.send(method_frame(0, 10, 40, shortstr("/") + shortstr("") + b"\x00"))
    r.expect(10, 41)


class ConfirmingPublisher:
    """Publishes persistent messages (seq in the body) with confirms, at most `window` unconfirmed, on a
    raw socket; a reader thread records confirms and connection.blocked/unblocked."""

    def __init__(self, broker, base=0, window=200, queue=QUEUE):
        self.base = base
        self.queue = queue
        self.r = RawConnection(broker.host, broker.port, timeout=120)
        handshake(self.r)
        self.r.open_channel(1)
        self.r.send(method_frame(1, 50, 10, struct.pack(">H", 0) + shortstr(queue) + b"\x02" + struct.pack(">I", 0)))
        self.r.expect(50, 11)
        self.r.send(method_frame(1, 85, 10, b"\x00"))
        self.r.expect(85, 11)
        self.window = window
        self.lock = threading.Condition()
        self.sent = 0
        self.acked_up_to = 0
        self.confirmed = set()
        self.nacked = set()
        self.events = []
        # How many messages were confirmed when each event arrived: the broker confirms only what it
        # read before it blocked the connection, so at most `window` more after "blocked".
        self.confirmed_at = {}
        self.stop = False
        self.error = None
        self.sender = threading.Thread(target=self._send, daemon=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.sender.start()
        self.reader.start()

    def _send(self):
        publish = method_frame(1, 60, 40, struct.pack(">H", 0) + shortstr("") + shortstr(self.queue) + b"\x00")
        header = frame(FRAME_HEADER, 1, struct.pack(">HHQH", 60, 0, SIZE, 0x1000) + b"\x02")
        try:
            while True:
                with self.lock:
                    while not self.stop and self.sent - self.acked_up_to >= self.window:
                        self.lock.wait(0.1)
                    if self.stop:
                        return
                    n = min(20, self.window - (self.sent - self.acked_up_to))
                    first = self.sent
                    self.sent += n
                self.r.send(b"".join(publish + header + frame(FRAME_BODY, 1, body_for(self.base + s)) for s in range(first, first + n)))
        except OSError as e:
            self.error = self.error or e

    def _read(self):
        try:
            while True:
                f = self.r.read_method()
                if f.kind != FRAME_METHOD:
                    continue
                if f.method in ((60, 80), (60, 120)):  # basic.ack / basic.nack
                    tag, flags = struct.unpack(">QB", f.payload[4:13])
                    with self.lock:
                        first = self.acked_up_to + 1 if flags & 1 else tag
                        target = self.confirmed if f.method == (60, 80) else self.nacked
                        target.update(self.base + t - 1 for t in range(first, tag + 1))  # delivery tag t: seq base+t-1
                        self.acked_up_to = max(self.acked_up_to, tag)
                        self.lock.notify_all()
                elif f.method in ((10, 60), (10, 61)):
                    kind = "blocked" if f.method == (10, 60) else "unblocked"
                    with self.lock:
                        self.confirmed_at.setdefault(kind, len(self.confirmed))
                    self.events.append(kind)
                else:
                    raise AssertionError(f"unexpected {f}")
        except (OSError, ConnectionError, struct.error) as e:
            self.error = self.error or e

    def confirmed_count(self):
        with self.lock:
            return len(self.confirmed)

    def settle(self, quiet=1.0, timeout=30):
        """Waits until no confirm arrived for `quiet` seconds: the broker confirmed what it had read
        (on a loaded machine that can take longer than `quiet`). Returns the confirmed set."""
        last = [self.snapshot(), time.monotonic()]

        def quiet_for_a_while():
            now = self.snapshot()
            if now != last[0]:
                last[:] = [now, time.monotonic()]
            return time.monotonic() - last[1] >= quiet

        eventually(quiet_for_a_while, timeout=timeout)
        return last[0]

    def snapshot(self):
        with self.lock:
            return set(self.confirmed)

    def close(self):
        with self.lock:
            self.stop = True
            self.lock.notify_all()
        self.sender.join(10)
        self.r.close()


@pytest.fixture
def print_log_on_failure(request):
    """Brokers registered here have their log printed if the test fails."""
    brokers = []
    yield brokers.append
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        for b in brokers:
            print(f"---- warren log {b.log_path} ----\n" + b.log_text()[-30000:])


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def start_broker(tmp_path, mnt):
    config = tmp_path / "warren.toml"
    config.write_text(f'disk-free-limit = "{DISK_FREE_LIMIT}"\n')
    b = Broker(mnt / "data", tmp_path / "warren.log")
    b.extra_args = ["--config", str(config)]
    b.start()
    return b


def fill(path, leave_free):
    """Writes a ballast file that leaves about `leave_free` bytes free (0: until the file system is full)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        # The broker writes meanwhile: allocate a little less than is free at once (more headroom if
        # it wrote faster than that), then write until the disk is full.
        for headroom in (8 << 20, 32 << 20, 96 << 20):
            st = os.statvfs(path.parent)
            want = st.f_bavail * st.f_frsize - max(leave_free, headroom)
            if want <= 0:
                break
            try:
                os.posix_fallocate(fd, 0, want)
                break
            except OSError:
                continue
        if leave_free == 0:
            os.lseek(fd, 0, os.SEEK_END)
            chunk = b"\0" * 4096
            try:
                while True:
                    os.write(fd, chunk)
            except OSError:
                pass
    finally:
        os.close(fd)


def consume_all(broker):
    c = broker.connection()
    ch = c.channel()
    got = []
    while True:
        m, _, body = ch.basic_get(QUEUE, auto_ack=True)
        if m is None:
            break
        got.append(body)
    c.close()
    return got


def check_consumable(broker, confirmed):
    got = consume_all(broker)
    seqs = [int(b[:8]) for b in got]
    dups = sorted({s for s in seqs if seqs.count(s) > 1}) if len(seqs) != len(set(seqs)) else []
    assert not dups, f"no message comes back twice: {len(dups)} did ({dups[0]}..{dups[-1]})"
    for b, s in zip(got, seqs):
        assert b == body_for(s), f"message {s} is intact"
    assert seqs == sorted(seqs), "in publish order"
    missing = confirmed - set(seqs)
    assert not missing, f"{len(missing)} confirmed messages are missing, e.g. {sorted(missing)[:5]}"
    return seqs


def wait_for_event(pub, kind, timeout=30):
    eventually(lambda: kind in pub.events, timeout=timeout)


def test_disk_alarm_below_the_limit_blocks_confirming_publishers(tmp_path, small_disk, print_log_on_failure):
    b = start_broker(tmp_path, small_disk)
    print_log_on_failure(b)
    try:
        pub = ConfirmingPublisher(b)
        eventually(lambda: pub.confirmed_count() >= 2000, timeout=30)
        ballast = small_disk / "ballast"
        fill(ballast, leave_free=150 << 20)
        wait_for_event(pub, "blocked")
        # What the broker read before it blocked the connection (at most a window) is still confirmed;
        # then nothing more is.
        during = len(pub.settle())
        assert during - pub.confirmed_at["blocked"] <= pub.window, "a blocked publisher's messages are not read"
        time.sleep(1.0)
        assert pub.confirmed_count() == during, "a blocked publisher's messages are not read, so not confirmed"
        ballast.unlink()
        wait_for_event(pub, "unblocked")
        eventually(lambda: pub.confirmed_count() >= during + 1000, timeout=30)
        pub.close()
        confirmed = pub.snapshot()
        check_consumable(b, confirmed)
        assert b.alive()
        assert "disk resource limit alarm set" in b.log_text()
    finally:
        b.proc.kill()
        b.proc.wait(10)


def test_writes_that_hit_enospc_wait_for_space_and_confirm_nothing_meanwhile(tmp_path, small_disk, print_log_on_failure):
    b = start_broker(tmp_path, small_disk)
    print_log_on_failure(b)
    try:
        pub = ConfirmingPublisher(b)
        eventually(lambda: pub.confirmed_count() >= 2000, timeout=30)
        ballast = small_disk / "ballast"
        fill(ballast, leave_free=0)
        wait_for_event(pub, "blocked")
        # A store write after the disk is full, whatever the alarm blocked first: a new connection's
        # first publish is read (it is blocked only once it has published).
        probe = ConfirmingPublisher(b, window=1, queue="disk-full-probe")
        wait_for_event(probe, "blocked")
        eventually(lambda: "no space left" in b.log_text().lower() or "waits for space" in b.log_text(), timeout=30)
        assert b.alive(), "the broker did not abort on ENOSPC"
        # Nothing more is confirmed while the store cannot write: the watermark does not move (confirms
        # the broker sent before its write failed may still be on their way: let them arrive).
        frozen = pub.settle()
        assert len(frozen) - pub.confirmed_at["blocked"] <= pub.window, "a blocked publisher's messages are not read"
        # The probe's message may have been written before a write failed (into space the broker
        # freed itself, e.g. a WAL segment a checkpoint deleted): then it is durable and confirmed.
        # From the failed write on, nothing is.
        probe_frozen = probe.settle()
        time.sleep(1.5)
        assert pub.snapshot() == frozen, "nothing is confirmed while the disk is full"
        assert probe.snapshot() == probe_frozen, "a message published while the disk is full is not confirmed"

        # Space comes back: the broker carries on without a restart.
        ballast.unlink()
        wait_for_event(pub, "unblocked", timeout=30)
        eventually(lambda: pub.confirmed_count() >= len(frozen) + 2000, timeout=60)
        eventually(lambda: probe.confirmed_count() >= len(probe_frozen) + 1, timeout=30)
        probe.close()
        assert "disk space is back" in b.log_text()
        pub.close()
        seqs = check_consumable(b, pub.snapshot())
        assert b.alive()

        # Once more, and this time the broker is killed while the disk is full: every confirmed message
        # is still there after a restart with space back.
        pub = ConfirmingPublisher(b, base=10_000_000)
        eventually(lambda: pub.confirmed_count() >= 1000, timeout=30)
        fill(ballast, leave_free=0)
        wait_for_event(pub, "blocked")
        time.sleep(1.0)
        confirmed = pub.snapshot()
        b.kill9()
        pub.close()
        confirmed |= pub.snapshot()
        ballast.unlink()
        b.start()
        after = check_consumable(b, confirmed)
        assert not set(after) & set(seqs), "what was consumed before does not come back"
    finally:
        if b.alive():
            b.proc.kill()
            b.proc.wait(10)
