"""Resource alarms: past the memory or disk limit, publishing connections get connection.blocked and
are not read until the alarm clears; consumers keep consuming; nothing is lost."""
import os
import signal
import subprocess
import time

import pytest

from conftest import Broker, eventually

pytestmark = pytest.mark.needs_process


def set_config(path, **keys):
    path.write_text("".join(f'{k.replace("_", "-")} = "{v}"\n' for k, v in keys.items()))


def broker_with_config(tmp_path, data_dir, **keys):
    """A started broker reading `tmp_path/warren.toml` (written from `keys`); returns (broker, config path)."""
    config = tmp_path / "warren.toml"
    set_config(config, **keys)
    b = Broker(data_dir, tmp_path / "warren.log")
    b.extra_args = ["--config", str(config)]
    b.start()
    return b, config


def count(broker, queue):
    c = broker.connection()
    try:
        return c.channel().queue_declare(queue, durable=True, passive=True).method.message_count
    finally:
        c.close()


def blocked_publisher(broker):
    conn = broker.connection()
    events = []
    conn.add_on_connection_blocked_callback(lambda c, m: events.append(("blocked", m.method.reason)))
    conn.add_on_connection_unblocked_callback(lambda c, m: events.append(("unblocked", None)))
    return conn, conn.channel(), events


def pump(conn, events, kind, timeout=10):
    """Processes I/O on a pika connection until an event of `kind` arrived."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        conn.process_data_events(time_limit=0.05)
        if any(e[0] == kind for e in events):
            return [e for e in events if e[0] == kind][0]
    raise AssertionError(f"no connection.{kind} within {timeout}s (events: {events})")


def check_alarm_cycle(broker, raise_alarm, clear_alarm, reason, queue="alarm-q"):
    conn, ch, events = blocked_publisher(broker)
    ch.queue_declare(queue, durable=True)
    for i in range(100):
        ch.basic_publish("", queue, b"before-%d" % i)
    eventually(lambda: count(broker, queue) == 100)

    raise_alarm()
    ch.basic_publish("", queue, b"trigger")
    assert pump(conn, events, "blocked") == ("blocked", reason)
    for i in range(50):
        ch.basic_publish("", queue, b"during-%d" % i)  # buffered: the broker does not read them yet
    conn.process_data_events(time_limit=0.3)

    # A consumer (a connection that never published) keeps working during the alarm.
    consumer = broker.connection()
    cch = consumer.channel()
    got = []
    while True:
        m, _, body = cch.basic_get(queue, auto_ack=True)
        if m is None:
            break
        got.append(body)
    assert len(got) >= 100
    time.sleep(0.5)
    assert count(broker, queue) == 0, "nothing the blocked connection sent was read during the alarm"

    clear_alarm()
    assert pump(conn, events, "unblocked") == ("unblocked", None)
    conn.process_data_events(time_limit=0.2)

    def all_arrived():
        while True:
            m, _, body = cch.basic_get(queue, auto_ack=True)
            if m is None:
                break
            got.append(body)
        return len(got) == 151

    eventually(all_arrived)
    assert sorted(got) == sorted([b"before-%d" % i for i in range(100)] + [b"trigger"] + [b"during-%d" % i for i in range(50)])
    consumer.close()
    conn.close()


def test_memory_alarm_blocks_publishers_and_clears(tmp_path):
    b, config = broker_with_config(tmp_path, tmp_path / "data", memory_high_watermark="0.4")
    try:
        def raise_alarm():
            set_config(config, memory_high_watermark="1MiB")  # far below what the broker uses
            b.proc.send_signal(signal.SIGHUP)

        def clear_alarm():
            set_config(config, memory_high_watermark="0.4")
            b.proc.send_signal(signal.SIGHUP)

        check_alarm_cycle(b, raise_alarm, clear_alarm, "low on memory")
        assert "memory resource limit alarm set" in b.log_text()
        assert "memory resource limit alarm cleared" in b.log_text()
    finally:
        b.proc.kill()
        b.proc.wait(10)


def test_disk_alarm_on_a_really_full_file_system(tmp_path):
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m", "tmpfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    b = None
    try:
        b, _ = broker_with_config(tmp_path, mnt / "data", disk_free_limit="200MiB")
        filler = mnt / "filler"

        def raise_alarm():
            with open(filler, "wb") as f:  # leaves about 150 MiB free: below the limit
                chunk = b"\0" * (1 << 20)
                for _ in range(250):
                    f.write(chunk)

        def clear_alarm():
            filler.unlink()

        check_alarm_cycle(b, raise_alarm, clear_alarm, "low on disk")
        assert "disk resource limit alarm set" in b.log_text()
    finally:
        if b is not None and b.alive():
            b.proc.kill()
            b.proc.wait(10)
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_sighup_with_a_broken_config_keeps_running(tmp_path):
    b, config = broker_with_config(tmp_path, tmp_path / "data", memory_high_watermark="0.4")
    try:
        config.write_text('memory-high-watermark = "lots"\n')
        b.proc.send_signal(signal.SIGHUP)
        eventually(lambda: "reload (SIGHUP) failed" in b.log_text())
        assert b.alive()
        c = b.connection()
        c.channel().queue_declare("", exclusive=True)
        c.close()
    finally:
        b.proc.kill()
        b.proc.wait(10)
