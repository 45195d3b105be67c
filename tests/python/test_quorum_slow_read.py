"""A slow disk read of a quorum queue's bodies holds up only the deliveries waiting for it: the
replica's lock is let go while the bodies are read, so publishers, other queues and management keep
working (issue 32, item 7). Uses the hooks build: `WARREN_TEST_HOLD_BODY_READS_FILE` holds the reads
of bodies to deliver while a file exists, and `WARREN_TEST_BODY_BUDGET_BYTES=1` keeps no body in
memory, so the first delivery reads from disk. Takes about 5 s.
"""

import os
import threading
import time

import pika
import pytest

from conftest import eventually

pytestmark = pytest.mark.warren_only

QUORUM = {"x-queue-type": "quorum"}
PERSISTENT = pika.BasicProperties(delivery_mode=2)
BACKLOG = 2000


def body(i):
    return b"%06d" % i + b"." * 4090


@pytest.fixture
def held_reads(broker, tmp_path, monkeypatch):
    """The broker restarted so that body reads wait while `hold` exists; yields (broker, hold path)."""
    hold = tmp_path / "hold-body-reads"
    monkeypatch.setenv("WARREN_TEST_HOLD_BODY_READS_FILE", str(hold))
    monkeypatch.setenv("WARREN_TEST_BODY_BUDGET_BYTES", "1")
    broker.restart()
    yield broker, hold
    hold.unlink(missing_ok=True)


def in_thread_within(seconds, work):
    """Runs `work` in a thread; its result, or AssertionError if it did not finish in `seconds`."""
    out = {}

    def run():
        try:
            out["result"] = work()
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise AssertionError(f"did not finish within {seconds}s while a body read was held")
    if "error" in out:
        raise out["error"]
    return out["result"]


def test_a_held_body_read_stalls_neither_publishers_nor_management_nor_other_queues(held_reads, name):
    broker, hold = held_reads
    setup = broker.connection()
    ch = setup.channel()
    ch.confirm_delivery()
    other = name + "-other"
    for q in (name, other):
        ch.queue_declare(q, durable=True, arguments=QUORUM)
    for i in range(BACKLOG):
        ch.basic_publish("", name, body(i), PERSISTENT)

    # The consumer's first delivery reads its bodies from disk: held there.
    hold.touch()
    consumer = broker.connection()
    cch = consumer.channel()
    cch.basic_qos(prefetch_count=100)
    got = []

    def on_message(c, method, props, b):
        got.append(b)
        c.basic_ack(method.delivery_tag)

    cch.basic_consume(name, on_message)
    waiting = hold.with_name(hold.name + ".waiting")
    eventually(lambda: waiting.exists() or consumer.process_data_events(time_limit=0.1), timeout=20)
    assert waiting.exists(), "the delivery never read its bodies"
    assert got == [], "delivered before its read was released"

    # Meanwhile, on another connection: publishes to the same queue, its message count, and a
    # confirmed publish to another quorum queue all go through.
    def others_work():
        conn = broker.connection()
        try:
            c = conn.channel()
            for i in range(BACKLOG, BACKLOG + 10):
                c.basic_publish("", name, body(i), PERSISTENT)
            count = c.queue_declare(name, passive=True).method.message_count
            c.confirm_delivery()
            c.basic_publish("", other, b"elsewhere", PERSISTENT)
            return count
        finally:
            conn.close()

    try:
        count = in_thread_within(15, others_work)
    finally:
        hold.unlink(missing_ok=True)
    # Less what the machine assigned to the consumer ahead of its prefetch: not ready.
    assert BACKLOG // 2 < count <= BACKLOG + 10, count

    # Released: every message, in order, exactly once.
    deadline = time.time() + 60
    while len(got) < BACKLOG + 10 and time.time() < deadline:
        consumer.process_data_events(time_limit=0.1)
    assert [b[:6] for b in got] == [b"%06d" % i for i in range(BACKLOG + 10)]
    consumer.close()
    method, _, b = ch.basic_get(other, auto_ack=True)
    assert b == b"elsewhere"
    setup.close()
