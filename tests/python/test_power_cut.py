"""Power loss of a standalone node, end to end: `warren server` with WARREN_TEST_SIMULATED_DISK=1
does every durable write of its data directory on the store's power-loss simulator, and SIGUSR2
rewrites the files to what a machine crash would leave (what no fsync covered is dropped) and kills
the process. A kill -9 cannot show a missing fsync (the page cache keeps the writes); this can.

Publishers with confirms run at full speed; at a random moment the power is cut; after the restart
every confirmed message must come back (duplicates of unconfirmed ones allowed), in publish order
per publisher, none corrupt, and nothing acked before may return. A classic queue and a quorum queue
(its Raft log and hard state in the same WAL); a few seconds each.
"""
import random
import re
import signal
import struct
import threading
import time

import pika
import pytest

from conftest import Broker, eventually
from rawamqp import FRAME_BODY, FRAME_HEADER, RawConnection, frame, method_frame, shortstr
from test_crash import body_for, parse_body

pytestmark = pytest.mark.needs_process

KINDS = {"classic": {}, "quorum": {"x-queue-type": "quorum"}}
ROUNDS = 5


class Publisher(threading.Thread):
    """Publishes persistent messages to `queue` as fast as confirms allow (`window` in flight) on a
    raw socket, recording the confirmed seqs, until the broker dies."""

    def __init__(self, broker, queue, publisher, round_, window=300, size=200):
        super().__init__(daemon=True)
        self.broker, self.queue, self.publisher, self.round = broker, queue, publisher, round_
        self.window, self.size = window, size
        self.confirmed = []
        self.sent = 0

    def run(self):
        try:
            r = RawConnection(self.broker.host, self.broker.port, timeout=30)
            r.handshake()
            r.open_channel(1)
            r.send(method_frame(1, 85, 10, b"\x00"))  # confirm.select
            r.expect(85, 11)
            publish = method_frame(1, 60, 40, struct.pack(">H", 0) + shortstr("") + shortstr(self.queue) + b"\x00")
            header = frame(FRAME_HEADER, 1, struct.pack(">HHQH", 60, 0, self.size, 0x1000) + b"\x02")
            tag_to_seq, acked_up_to = {}, 0
            while True:
                burst = []
                while self.sent - acked_up_to < self.window and len(burst) < 50:
                    seq = self.sent
                    self.sent += 1
                    tag_to_seq[self.sent] = seq
                    burst.append(publish + header + frame(FRAME_BODY, 1, body_for(self.publisher, self.round, seq, self.size)))
                if burst:
                    r.send(b"".join(burst))
                f = r.read_method()
                assert f.method == (60, 80), f"expected basic.ack, got {f}"
                tag, flags = struct.unpack(">QB", f.payload[4:13])
                first = acked_up_to + 1 if flags & 1 else tag
                for t in range(first, tag + 1):
                    self.confirmed.append(tag_to_seq.pop(t))
                acked_up_to = max(acked_up_to, tag)
        except (ConnectionError, OSError, struct.error):
            pass  # the power went off


def drain(broker, queue, arguments, idle=2.0):
    """Consumes and acks everything in `queue` until nothing came for `idle` seconds; returns the
    bodies in delivery order. (A restarted quorum queue's declare-ok count is not waited for: its
    group may still be replaying its log when the declare is answered.)"""
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(queue, durable=True, arguments=arguments)
    ch.basic_qos(prefetch_count=1000)
    out, last, acked = [], [0], [0]

    def on_message(channel, method, props, body):
        out.append(body)
        last[0] = method.delivery_tag
        if len(out) % 200 == 0:
            channel.basic_ack(method.delivery_tag, multiple=True)
            acked[0] = method.delivery_tag

    tag = ch.basic_consume(queue, on_message)
    deadline = time.time() + 120
    while True:
        # Until `idle` s pass without a delivery and the queue then reports none ready (on a loaded
        # machine a delivery can come later than `idle`).
        quiet_since, seen = time.time(), len(out)
        while time.time() < deadline and time.time() - quiet_since < idle:
            c.process_data_events(time_limit=0.1)
            if len(out) != seen:
                quiet_since, seen = time.time(), len(out)
        if last[0] > acked[0]:
            ch.basic_ack(last[0], multiple=True)
            acked[0] = last[0]
        left = ch.queue_declare(queue, durable=True, passive=True).method.message_count
        if left == 0 or time.time() >= deadline:
            break
    ch.basic_cancel(tag)
    c.close()
    assert left == 0, f"{left} messages left in {queue} after the drain ({len(out)} delivered)"
    return out


def power_cut(broker):
    """SIGUSR2: the node drops what it had not fsynced and kills itself. Returns its log line."""
    before = len(broker.log_text())
    broker.proc.send_signal(signal.SIGUSR2)
    code = broker.proc.wait(20)
    assert code == -signal.SIGKILL, f"exited with {code}, not by its power cut:\n{broker.log_text()[before:]}"
    lines = [ln for ln in broker.log_text()[before:].splitlines() if "power cut" in ln]
    assert lines, "the node logs its power cut"
    return lines[-1]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_power_cut_keeps_every_confirmed_message(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("WARREN_TEST_SIMULATED_DISK", "1")
    # The simulator's fsync is instant: without a delay a cut almost never finds a write waiting
    # for its fsync (the moment a missing or early confirm would lose).
    monkeypatch.setenv("WARREN_TEST_FSYNC_DELAY_MS", "3")
    broker = Broker(tmp_path / "data", tmp_path / "warren.log")
    queue, arguments = f"power-{kind}", KINDS[kind]
    rng = random.Random(20261123)
    broker.start()
    try:
        assert "WARREN_TEST_SIMULATED_DISK is set" in broker.log_text()
        c = broker.connection()
        c.channel().queue_declare(queue, durable=True, arguments=arguments)
        c.close()
        confirmed_total, duplicates, consumed_before, cuts_dropping = 0, 0, set(), 0
        for round_ in range(ROUNDS):
            publishers = [Publisher(broker, queue, p, round_) for p in range(2)]
            for p in publishers:
                p.start()
            eventually(lambda: all(len(p.confirmed) > 0 for p in publishers), timeout=20)
            time.sleep(rng.uniform(0.05, 0.6))
            cut = re.sub(r"\x1b\[[0-9;]*m", "", power_cut(broker))
            print(f"round {round_}: {cut[cut.find('files='):]}")
            cuts_dropping += "bytes=0 " not in cut
            for p in publishers:
                p.join(10)
            broker.start()
            seen, order = {}, {}
            for b in drain(broker, queue, arguments):
                key = parse_body(b)
                assert key not in consumed_before, f"round {round_}: {key} was acked before the cut but came back"
                seen[key] = seen.get(key, 0) + 1
                pub, rnd, seq = key
                if seen[key] == 1:
                    assert seq > order.get((pub, rnd), -1), f"round {round_}: publisher {pub}'s {seq} out of order"
                    order[(pub, rnd)] = seq
            for p in publishers:
                confirmed_total += len(p.confirmed)
                lost = [s for s in p.confirmed if (p.publisher, round_, s) not in seen]
                assert not lost, f"round {round_}: {len(lost)} confirmed messages of publisher {p.publisher} lost: {lost[:20]}"
            duplicates += sum(n - 1 for n in seen.values())
            consumed_before.update(seen)
        print(f"{kind}: {ROUNDS} power cuts ({cuts_dropping} dropped unsynced writes), {confirmed_total} confirmed "
              f"messages all back, {duplicates} duplicates")
        assert confirmed_total > ROUNDS * 100
    finally:
        if broker.alive():
            broker.proc.kill()
            broker.proc.wait(10)


def test_without_the_variable_sigusr2_is_not_a_power_cut(tmp_path, monkeypatch):
    """Off by default: no simulator, and SIGUSR2 does not rewrite anything (its default action)."""
    monkeypatch.delenv("WARREN_TEST_SIMULATED_DISK", raising=False)
    broker = Broker(tmp_path / "data", tmp_path / "warren.log")
    broker.start()
    try:
        assert "WARREN_TEST_SIMULATED_DISK" not in broker.log_text()
        broker.proc.send_signal(signal.SIGUSR2)
        assert broker.proc.wait(10) == -signal.SIGUSR2
        assert "power cut" not in broker.log_text()
    finally:
        if broker.alive():
            broker.proc.kill()
            broker.proc.wait(10)


def test_power_cut_after_a_purge_keeps_the_bodies_only_in_retained_entries(tmp_path, monkeypatch):
    """A quorum queue's backlog whose log was purged after the group's quiet snapshot is only in its
    entries, which the purge kept (retained, pinned by the replica): a power cut while the backlog
    is consumed (its entries let go one by one, each with a layout) and new messages are published
    loses none of it, nor a confirmed new one."""
    monkeypatch.setenv("WARREN_TEST_SIMULATED_DISK", "1")
    monkeypatch.setenv("WARREN_TEST_FSYNC_DELAY_MS", "3")
    monkeypatch.setenv("WARREN_LOG", "info,warren_server::quorum=debug")
    broker = Broker(tmp_path / "data", tmp_path / "warren.log")
    queue, arguments = "power-retained", KINDS["quorum"]
    rng = random.Random(20261127)
    broker.start()
    try:
        c = broker.connection()
        ch = c.channel()
        ch.queue_declare(queue, durable=True, arguments=arguments)
        ch.confirm_delivery()
        backlog = 1500
        for seq in range(backlog):  # each confirm awaited: an entry each (or close)
            ch.basic_publish("", queue, body_for(9, 0, seq, 300), pika.BasicProperties(delivery_mode=2))
        purges = lambda: broker.log_text().count("asking for the group's log to be purged")  # noqa: E731
        eventually(lambda: purges() > 0, timeout=30)  # the quiet snapshot, then the purge
        time.sleep(1)
        publishers = [Publisher(broker, queue, p, 1) for p in range(2)]
        for p in publishers:
            p.start()
        acked = set()
        for _ in range(rng.randrange(100, 600)):
            method, _, body = ch.basic_get(queue)
            ch.basic_ack(method.delivery_tag)
            acked.add(parse_body(body))
        time.sleep(rng.uniform(0.05, 0.3))
        power_cut(broker)
        for p in publishers:
            p.join(10)
        broker.start()
        seen = {parse_body(b) for b in drain(broker, queue, arguments)}
        lost = [seq for seq in range(backlog) if (9, 0, seq) not in seen and (9, 0, seq) not in acked]
        assert not lost, f"{len(lost)} of the backlog's unacked messages lost: {lost[:20]}"
        for p in publishers:
            missing = [s for s in p.confirmed if (p.publisher, 1, s) not in seen]
            assert not missing, f"{len(missing)} confirmed messages of publisher {p.publisher} lost: {missing[:20]}"
    finally:
        if broker.alive():
            broker.proc.kill()
            broker.proc.wait(10)
