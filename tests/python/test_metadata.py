"""The durable topology (metadata log): a declare that cannot be made durable fails and nothing
claims otherwise; messages are never deleted because their queue's metadata is missing; a durable
declare writes the same few bytes with 5,000 queues as with none."""
import shutil
import struct
import subprocess
import time

import pika
import pytest

from conftest import BIN
from rawamqp import RawConnection, method_frame, shortstr, table

pytestmark = [pytest.mark.needs_process, pytest.mark.warren_only]

# The metadata log, and the file earlier versions kept the topology in (so the tests also run
# against an old binary, to show they fail there).
METADATA_FILES = ("metadata.log", "definitions.json")


def metadata_files(broker):
    return [broker.data_dir / f for f in METADATA_FILES if (broker.data_dir / f).exists()]


def chattr(flag, path):
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


def raw_queue_declare(name, durable=True):
    bits = 0x02 if durable else 0
    return method_frame(1, 50, 10, struct.pack(">H", 0) + shortstr(name) + struct.pack(">B", bits) + table())


def test_a_declare_that_cannot_be_made_durable_fails_with_541_and_no_declare_ok(broker, name):
    conn = broker.connection()
    conn.channel().queue_declare(name + "-first", durable=True)
    conn.close()
    files = metadata_files(broker)
    assert files, "the broker keeps durable metadata in its data dir"
    # As root, chmod does not stop writes; an immutable file does (EPERM on write, and no rename over it).
    if not all(chattr("+i", f) for f in files):
        pytest.skip("chattr +i is not supported on this filesystem")
    try:
        r = RawConnection(broker.host, broker.port)
        r.handshake()
        r.open_channel()
        r.send(raw_queue_declare(name))
        reply = r.read_method()
        # The first thing back must be connection.close 541, never queue.declare-ok.
        assert reply.method == (10, 50), f"expected connection.close, got {reply} (declare-ok claims durability)"
        code, text = reply.close_reply()
        assert code == 541, text
        assert "metadata log" in text and name in text and "nothing was changed" in text, text
        r.close()
        assert "could not make the declaration of queue" in broker.log_text()
    finally:
        for f in files:
            chattr("-i", f)
    # The failed declare changed nothing: the queue does not exist.
    ch = broker.connection().channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.queue_declare(name, passive=True)
    assert e.value.reply_code == 404
    # Once the disk takes writes again, durable declares work and survive a restart.
    ch = broker.connection().channel()
    ch.queue_declare(name, durable=True)
    broker.restart()
    broker.connection().channel().queue_declare(name, passive=True)


def test_a_bind_or_delete_that_cannot_be_made_durable_changes_nothing(broker, name):
    ch = broker.connection().channel()
    ch.confirm_delivery()
    ch.exchange_declare(name + "-ex", "direct", durable=True)
    ch.queue_declare(name, durable=True)
    for i in range(5):
        ch.basic_publish("", name, f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
    files = metadata_files(broker)
    if not all(chattr("+i", f) for f in files):
        pytest.skip("chattr +i is not supported on this filesystem")
    try:
        for attempt in ("bind", "delete"):
            ch = broker.connection().channel()
            with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e:
                if attempt == "bind":
                    ch.queue_bind(name, name + "-ex", "k")
                else:
                    ch.queue_delete(name)
            assert e.value.reply_code == 541, e.value.reply_text
            assert "metadata log" in e.value.reply_text and "nothing was changed" in e.value.reply_text
    finally:
        for f in files:
            chattr("-i", f)
    # The queue is still there with its messages, and no binding was made.
    ch = broker.connection().channel()
    assert ch.queue_declare(name, passive=True).method.message_count == 5
    ch.basic_publish(name + "-ex", "k", b"unroutable")
    assert ch.queue_declare(name, passive=True).method.message_count == 5
    broker.restart()
    ch = broker.connection().channel()
    assert ch.queue_declare(name, passive=True).method.message_count == 5


def test_messages_of_a_queue_missing_from_the_metadata_are_kept_aside_not_deleted(broker, name, tmp_path):
    conn = broker.connection()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(name, durable=True)
    for i in range(50):
        ch.basic_publish("", name, f"kept-{i}".encode(), pika.BasicProperties(delivery_mode=2))
    conn.close()
    assert broker.terminate() == 0
    backup = tmp_path / "metadata-backup"
    backup.mkdir()
    for f in metadata_files(broker):
        shutil.move(str(f), backup / f.name)

    # The metadata is gone: the queue is unknown, but its messages stay on disk, and the log says so.
    broker.start()
    log = broker.log_text()
    assert "kept aside" in log and "50 messages" in log, log[-3000:]
    # A queue declared meanwhile must not adopt the kept data.
    ch = broker.connection().channel()
    ch.queue_declare(name + "-new", durable=True)
    assert ch.queue_declare(name + "-new", passive=True).method.message_count == 0
    assert broker.terminate() == 0

    # With the metadata back, every message is there, in order.
    for f in METADATA_FILES:
        (broker.data_dir / f).unlink(missing_ok=True)
    for f in backup.iterdir():
        shutil.move(str(f), broker.data_dir / f.name)
    broker.start()
    ch = broker.connection().channel()
    assert ch.queue_declare(name, passive=True).method.message_count == 50
    bodies = []
    for _ in range(50):
        _, _, body = ch.basic_get(name, auto_ack=True)
        bodies.append(body.decode())
    assert bodies == [f"kept-{i}" for i in range(50)]


def frame_offsets(path):
    """Byte offsets of the frames of a metadata.log (16-byte header, then len u32 | crc u32 | payload)."""
    data = path.read_bytes()
    offsets, pos = [], 16
    while pos + 8 <= len(data):
        offsets.append(pos)
        (length,) = struct.unpack("<I", data[pos:pos + 4])
        pos += 8 + length
    return offsets


def test_a_corrupt_metadata_log_refuses_to_start_unless_the_recovery_mode_skips_it(broker, name):
    ch = broker.connection().channel()
    for q in ("a", "b", "c"):
        ch.queue_declare(f"{name}-{q}", durable=True)
    assert broker.terminate() == 0
    log = broker.data_dir / "metadata.log"
    offsets = frame_offsets(log)
    data = bytearray(log.read_bytes())
    bad = offsets[-2]  # b's declaration, with c's after it: corruption in the middle, not a torn tail
    data[bad + 20] ^= 0xFF
    log.write_bytes(bytes(data))

    refused = subprocess.run(
        [BIN, "server", "--amqp-port", str(broker.port), "--http-port", str(broker.http_port),
         "--prometheus-port", str(broker.prometheus_port), "--data-dir", str(broker.data_dir)], capture_output=True, timeout=60)
    output = (refused.stdout + refused.stderr).decode(errors="replace")
    assert refused.returncode != 0, output
    assert f"metadata.log: corrupt record at byte offset {bad}" in output, output
    assert "--recovery-mode tolerate-any-corruption" in output
    assert log.read_bytes() == bytes(data), "a refused start changes nothing"

    broker.extra_args = ["--recovery-mode", "tolerate-any-corruption"]
    broker.start()
    ch = broker.connection().channel()
    ch.queue_declare(f"{name}-a", passive=True)
    ch.queue_declare(f"{name}-c", passive=True)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        ch.queue_declare(f"{name}-b", passive=True)
    kept = broker.data_dir / "damaged" / f"metadata.log.{bad}"
    assert kept.read_bytes() == bytes(data[bad:offsets[-1]])

    # The log was rewritten clean: a normal start works again.
    broker.extra_args = []
    broker.restart()
    broker.connection().channel().queue_declare(f"{name}-c", passive=True)


def bytes_written(pid):
    """What the process has written so far (write syscalls, page cache included)."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise AssertionError("no wchar in /proc/PID/io")


@pytest.mark.timeout(600)
def test_5000_durable_declares_write_bytes_linear_in_the_number_of_queues(broker, name):
    """Each durable declare appends one small record. (definitions.json was rewritten whole on
    every declare: 5,000 declares wrote 1.6 GB.) Prints the time per declare for each 1,000
    queues; only the bytes written are asserted, never a time."""
    ch = broker.connection().channel()
    written_before = bytes_written(broker.proc.pid)
    per_thousand = []
    for k in range(5):
        start = time.perf_counter()
        for i in range(1000):
            ch.queue_declare(f"{name}-{k * 1000 + i}", durable=True)
        per_thousand.append(time.perf_counter() - start)
    written = bytes_written(broker.proc.pid) - written_before
    print("\n5,000 durable queue.declare: ms per declare for each 1,000: "
          + ", ".join(f"{t:.2f}" for t in per_thousand)
          + f" (total {sum(per_thousand):.1f} s); the broker wrote {written / 1e6:.1f} MB")
    assert ch.queue_declare(f"{name}-4999", passive=True)
    # About 150 bytes a queue, plus at most a compaction or two: far below quadratic.
    assert written < 20_000_000, f"{written} bytes written for 5,000 declares"
