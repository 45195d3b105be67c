"""Quorum queues (`x-queue-type: quorum`) on one node, through the real binary: declare rules, publish
with confirms (sent once the Raft entry is committed and applied), consume and settle through the
queue's group, delivery limit, basic.get, purge, delete, and what comes back after kill -9 or when a
consumer's connection dies. A standalone node's quorum queue is a single-voter Raft group whose log is in
the node's WAL (docs/internals/cluster.md, "Quorum queues on the AMQP path"). Takes about 15 s.
"""

import os
import re
import time

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, NackError, UnroutableError

from conftest import eventually

pytestmark = pytest.mark.warren_only

QUORUM = {"x-queue-type": "quorum"}
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def declare(ch, name, **args):
    return ch.queue_declare(name, durable=True, arguments={**QUORUM, **args})


def publish_confirmed(ch, queue, bodies, exchange=""):
    ch.confirm_delivery()
    for body in bodies:
        ch.basic_publish(exchange, queue, body, PERSISTENT)


def get_all(ch, queue, ack=True):
    got = []
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=False)
        if method is None:
            return got
        got.append((body, method.redelivered))
        if ack:
            ch.basic_ack(method.delivery_tag)


def ready(ch, queue):
    return ch.queue_declare(queue, passive=True).method.message_count


SMALL_BODY_BUDGET = 32 << 20


@pytest.fixture
def small_body_budget(broker, monkeypatch):
    """The broker restarted with a node budget for quorum bodies of 32 MiB (test-only
    `WARREN_TEST_BODY_BUDGET_BYTES`; a quarter of the memory limit otherwise, gigabytes here), so
    that backlogs of tens of MB are read back from the store."""
    monkeypatch.setenv("WARREN_TEST_BODY_BUDGET_BYTES", str(SMALL_BODY_BUDGET))
    broker.restart()
    return broker


def consume_acking(conn, queue, count, prefetch, timeout):
    """Consumes `count` bodies (or what came within `timeout` s) on a channel of its own, acking each."""
    cons = conn.channel()
    cons.basic_qos(prefetch_count=prefetch)
    got = []

    def on_message(c, method, props, body):
        got.append(body)
        c.basic_ack(method.delivery_tag)

    cons.basic_consume(queue, on_message)
    deadline = time.time() + timeout
    while len(got) < count and time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    cons.close()
    return got


def io_bytes(pid):
    """The process's bytes read from and written to storage (`/proc/PID/io`)."""
    fields = dict(line.split(": ") for line in open(f"/proc/{pid}/io").read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


@pytest.mark.parametrize("flags,prop", [
    ({"durable": False}, "non-durable"),
    ({"durable": True, "exclusive": True}, "exclusive-owner"),
    ({"durable": True, "auto_delete": True}, "auto-delete"),
])
def test_a_quorum_queue_must_be_durable_and_neither_exclusive_nor_auto_delete(ch, name, flags, prop):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, arguments=QUORUM, **flags)
    assert e.value.reply_code == 406
    assert prop in e.value.reply_text and "quorum" in e.value.reply_text


def test_quorum_only_arguments_are_refused_on_classic_queues_and_the_reverse(ch, conn, name):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, durable=True, arguments={"x-delivery-limit": 3})
    assert e.value.reply_code == 406 and "x-delivery-limit" in e.value.reply_text
    ch = conn.channel()
    with pytest.raises(ChannelClosedByBroker) as e:
        declare(ch, name, **{"x-max-priority": 5})
    assert e.value.reply_code == 406 and "x-max-priority" in e.value.reply_text


def test_publish_confirm_consume_ack(conn, ch, name):
    declare(ch, name)
    bodies = [f"m{i}".encode() for i in range(500)]
    publish_confirmed(ch, name, bodies)
    assert ready(ch, name) == 500
    cons = conn.channel()
    cons.basic_qos(prefetch_count=50)
    got = []

    def on_message(c, method, props, body):
        got.append(body)
        c.basic_ack(method.delivery_tag)

    cons.basic_consume(name, on_message)
    deadline = time.time() + 20
    while len(got) < 500 and time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    assert got == bodies, "every message once, in order"
    eventually(lambda: ready(ch, name) == 0)


def test_a_large_prefetch_is_enforced_though_the_machine_assigns_ahead(conn, ch, name):
    """From prefetch 100 on, the queue's machine assigns a consumer three times its prefetch so that acks
    make room at once (not one commit later); the client still never holds more than its prefetch,
    and what was assigned ahead comes back to the queue with the consumer's channel."""
    declare(ch, name)
    publish_confirmed(ch, name, [str(i).encode() for i in range(500)])
    cons = conn.channel()
    cons.basic_qos(prefetch_count=100)
    held = []
    cons.basic_consume(name, lambda c, m, p, b: held.append((m.delivery_tag, b)))

    def settle_for(seconds):
        deadline = time.time() + seconds
        while time.time() < deadline:
            conn.process_data_events(time_limit=0.1)

    def pump_until(n):
        # Wait for the deliveries (the Attach and the ack are commits), then a while more: a
        # surplus past the prefetch would show then.
        eventually(lambda: conn.process_data_events(time_limit=0.1) or len(held) >= n, timeout=15)
        settle_for(0.5)

    pump_until(100)
    assert len(held) == 100, f"{len(held)} unacked deliveries with prefetch 100"
    cons.basic_ack(held[-1][0], multiple=True)
    pump_until(200)
    assert len(held) == 200, f"{len(held)} deliveries after acking the first 100"
    assert [b for _, b in held] == [str(i).encode() for i in range(200)], "in order, each once"
    cons.close()
    eventually(lambda: ready(ch, name) == 400)
    got = get_all(ch, name)
    assert sorted(int(b) for b, _ in got) == list(range(100, 500))


def test_no_ack_consumer_gets_everything_once(conn, ch, name):
    declare(ch, name)
    publish_confirmed(ch, name, [str(i).encode() for i in range(3000)])
    got = []
    cons = conn.channel()
    cons.basic_consume(name, lambda c, m, p, b: got.append(b), auto_ack=True)
    deadline = time.time() + 20
    while len(got) < 3000 and time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    assert got == [str(i).encode() for i in range(3000)]
    eventually(lambda: ready(ch, name) == 0)


def test_basic_get_and_nack_requeue_redelivers(ch, name):
    declare(ch, name)
    assert ch.basic_get(name)[0] is None, "get-empty on an empty queue"
    publish_confirmed(ch, name, [b"a", b"b"])
    method, _, body = ch.basic_get(name)
    assert (body, method.redelivered, method.message_count) == (b"a", False, 1)
    ch.basic_nack(method.delivery_tag, requeue=True)
    method, props, body = ch.basic_get(name)
    assert (body, method.redelivered) == (b"a", True), "a requeued message comes back first, flagged"
    assert props.headers["x-delivery-count"] == 1, "failed deliveries so far, as RabbitMQ 4"
    ch.basic_ack(method.delivery_tag)
    assert get_all(ch, name) == [(b"b", False)]


def test_delivery_limit_dead_letters_a_poison_message(ch, name):
    dlq = name + "-dlq"
    ch.queue_declare(dlq, durable=True)
    declare(ch, name, **{"x-delivery-limit": 2, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    publish_confirmed(ch, name, [b"poison"])
    for attempt in range(3):
        method, _, body = ch.basic_get(name)
        assert body == b"poison", f"attempt {attempt}"
        ch.basic_nack(method.delivery_tag, requeue=True)
    # Returned a third time: past the limit of 2, dead-lettered.
    eventually(lambda: ready(ch, dlq) == 1)
    method, props, body = ch.basic_get(dlq, auto_ack=True)
    assert body == b"poison"
    assert props.headers["x-death"][0]["reason"] == "delivery_limit"
    assert ch.basic_get(name)[0] is None


def test_message_ttl_expires_to_the_dead_letter_exchange(ch, name):
    dlq = name + "-dlq"
    ch.queue_declare(dlq, durable=True)
    declare(ch, name, **{"x-message-ttl": 100, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    publish_confirmed(ch, name, [b"old"])
    # The leader's next Tick (at most a second apart) expires it.
    eventually(lambda: ready(ch, dlq) == 1, timeout=5)
    method, props, body = ch.basic_get(dlq, auto_ack=True)
    assert body == b"old" and props.headers["x-death"][0]["reason"] == "expired"
    assert ready(ch, name) == 0


def test_reject_publish_overflow_nacks_the_publisher(ch, name):
    declare(ch, name, **{"x-max-length": 2, "x-overflow": "reject-publish"})
    publish_confirmed(ch, name, [b"1", b"2"])
    with pytest.raises(NackError):
        ch.basic_publish("", name, b"3", PERSISTENT)
    assert [b for b, _ in get_all(ch, name)] == [b"1", b"2"]


def test_a_message_to_a_classic_and_a_quorum_queue_is_confirmed_once_both_hold_it(ch, name):
    ch.exchange_declare(name, "fanout", durable=True)
    ch.queue_declare(name + "-c", durable=True)
    declare(ch, name + "-q")
    ch.queue_bind(name + "-c", name)
    ch.queue_bind(name + "-q", name)
    publish_confirmed(ch, "", [b"both"], exchange=name)
    assert ready(ch, name + "-c") == 1 and ready(ch, name + "-q") == 1


def test_purge_and_delete(conn, ch, name):
    declare(ch, name)
    publish_confirmed(ch, name, [b"x"] * 10)
    assert ch.queue_purge(name).method.message_count == 10
    assert ready(ch, name) == 0
    publish_confirmed(ch, name, [b"y"] * 3)
    cancelled = []
    cons = conn.channel()
    cons.add_on_cancel_callback(lambda frame: cancelled.append(frame))
    cons.basic_qos(prefetch_count=1)
    delivered = []
    cons.basic_consume(name, lambda *a: delivered.append(a))
    # consume-ok comes before the Attach is committed: wait for the delivery, not for a time.
    eventually(lambda: conn.process_data_events(time_limit=0.05) or delivered)
    assert ch.queue_delete(name).method.message_count == 2, "the one delivered is not ready"
    eventually(lambda: conn.process_data_events(time_limit=0.05) or cancelled)
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, passive=True)
    assert e.value.reply_code == 404


def test_a_dead_consumer_connection_gives_its_unacked_back_redelivered(broker, ch, name):
    declare(ch, name)
    publish_confirmed(ch, name, [str(i).encode() for i in range(20)])
    doomed = broker.connection()
    dch = doomed.channel()
    dch.basic_qos(prefetch_count=5)
    held = []
    dch.basic_consume(name, lambda c, m, p, b: held.append(b))
    deadline = time.time() + 10
    while len(held) < 5 and time.time() < deadline:
        doomed.process_data_events(time_limit=0.1)
    assert held == [str(i).encode() for i in range(5)]
    doomed._impl._transport._sock.close()  # the connection dies without closing
    eventually(lambda: ready(ch, name) == 20)
    got = get_all(ch, name)
    assert sorted(int(b) for b, _ in got) == list(range(20))
    assert {b for b, redelivered in got if redelivered} == set(held)


def test_kill9_keeps_every_confirmed_unacked_message_and_no_acked_one(broker, name):
    conn = broker.connection()
    ch = conn.channel()
    declare(ch, name)
    publish_confirmed(ch, name, [str(i).encode() for i in range(300)])
    acked = []
    for _ in range(100):
        method, _, body = ch.basic_get(name)
        ch.basic_ack(method.delivery_tag)
        acked.append(body)
    held = []
    for _ in range(20):
        method, _, body = ch.basic_get(name)
        held.append(body)  # delivered, never acked
    # A round trip through the group after the acks: they are committed (fsynced) once it answers.
    assert ch.basic_get(name)[0] is not None
    broker.kill9()
    broker.start()
    conn = broker.connection()
    ch = conn.channel()
    # Once the group has replayed its log and returned what this node's consumers held.
    eventually(lambda: ready(ch, name) == 200)
    got = get_all(ch, name)
    assert sorted(int(b) for b, _ in got) == list(range(100, 300))
    redelivered = {b for b, r in got if r}
    assert set(held) <= redelivered, "the ones delivered before the crash come back flagged"
    # Still a working queue after the restart.
    publish_confirmed(ch, name, [b"after"])
    assert get_all(ch, name) == [(b"after", False)]


def test_tx_commit_ok_covers_a_transactions_acks_on_a_quorum_queue(broker, name):
    conn = broker.connection()
    ch = conn.channel()
    declare(ch, name)
    publish_confirmed(ch, name, [str(i).encode() for i in range(50)])
    tx = conn.channel()
    tx.tx_select()
    for _ in range(20):
        method, _, _ = tx.basic_get(name)
        tx.basic_ack(method.delivery_tag)
    tx.tx_commit()  # commit-ok: the group applied the acks (fsynced)
    broker.kill9()
    broker.start()
    ch = broker.connection().channel()
    eventually(lambda: ready(ch, name) == 30)
    assert sorted(int(b) for b, _ in get_all(ch, name)) == list(range(20, 50))


def test_after_a_snapshot_purged_the_log_kill9_brings_back_the_bodies_from_the_store(broker, name):
    """One entry per publish and per ack: past 5,000 entries the group snapshots (without bodies)
    and purges its log, but keeps the entries of what is still queued (pinned by the replica): the
    bodies come back from them."""
    conn = broker.connection()
    ch = conn.channel()
    declare(ch, name)
    publish_confirmed(ch, name, [str(i).encode() for i in range(3500)])  # each confirm awaited: an entry each
    for _ in range(2000):
        method, _, _ = ch.basic_get(name)
        ch.basic_ack(method.delivery_tag)
    assert ch.basic_get(name)[0] is not None  # the acks before it are applied
    broker.kill9()
    broker.start()
    ch = broker.connection().channel()
    eventually(lambda: ready(ch, name) == 1500)
    assert sorted(int(b) for b, _ in get_all(ch, name)) == list(range(2000, 3500))


def disk_bytes(path):
    """Bytes allocated on disk under `path` (what a du would say)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)


def test_a_settled_log_gives_its_disk_back_though_one_old_message_stays_unacked(broker, name):
    """A quorum queue's Raft log is purged after snapshots taken by bytes (64 MiB since the last)
    and once the queue is quiet, not only after openraft's 5,000 entries: 100 MB published and
    settled leave the disk, though the first message is still unacked, and that message's body
    (in its entry, which the purge keeps, alone) survives a kill -9."""
    conn = broker.connection()
    ch = conn.channel()
    declare(ch, name)
    publish_confirmed(ch, name, [b"old"])
    holder = conn.channel()
    method, _, body = holder.basic_get(name)
    assert body == b"old"
    pad = b"y" * 65536
    publish_confirmed(ch, name, [b"%d:" % i + pad for i in range(1600)])  # ~100 MB, an entry each
    assert disk_bytes(broker.data_dir) > 100e6
    for i in range(1600):
        m, _, body = ch.basic_get(name)
        assert body == b"%d:" % i + pad
        ch.basic_ack(m.delivery_tag)
    # What stays: the WAL being written, the queue segment the unacked message is in (16 MiB), state.
    eventually(lambda: disk_bytes(broker.data_dir) < 60e6, timeout=30)
    # Acks have no confirm: a confirmed publish after them is committed after their settles, so
    # the kill -9 below cannot bring the last ones back.
    publish_confirmed(ch, name, [b"marker"])
    broker.kill9()
    broker.start()
    ch = broker.connection().channel()
    eventually(lambda: ready(ch, name) == 2)
    got = get_all(ch, name)
    assert [body for body, _ in got] == [b"old", b"marker"] and got[0][1], got


def group_of(broker, name):
    """The group id (= queue id) of quorum queue `name`, as the broker's debug log of `quorum` says."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", broker.log_text())
    found = re.findall(rf"group leads on this node queue={re.escape(name)} group=(\d+)", text)
    assert found, f"no group of {name} in the log"
    return int(found[-1])


def store_files(broker, only=None):
    """Bytes in the store's queue files by kind: ("log", Raft log records), ("records", queues' own
    records); `only`: of that queue id (its group's log and its records) alone."""
    root = os.path.join(broker.data_dir, "store", "queues")
    out = {"log": 0, "records": 0}
    for d in os.listdir(root) if os.path.isdir(root) else []:
        if only is not None and int(d) & ((1 << 61) - 1) != only:
            continue
        size = sum(os.path.getsize(os.path.join(root, d, f)) for f in os.listdir(os.path.join(root, d)))
        if (1 << 62) <= int(d) < (1 << 63):
            out["log"] += size
        elif int(d) < (1 << 61):
            out["records"] += size
    return out


def test_a_body_is_written_once_in_its_entry_which_outlives_the_snapshot(broker, name, monkeypatch):
    """A quorum message's bytes are in the node's store once, in its Raft entry: the queue's own
    records are never written for it. 300 KB published: the next checkpoint keeps the log's records
    in the WAL (a Raft log's run of any length is an extent) and writes no queue record nor log
    copy. A kill -9 brings the bodies back from the replayed log; after the group's quiet snapshot
    (5 s after the last entry) and the purge of its log, the entries with live bodies are kept
    (pinned by the replica), and a kill -9 brings the bodies back from them."""
    monkeypatch.setenv("WARREN_LOG", "info,warren_server::quorum=debug")
    broker.restart()
    conn = broker.connection()
    ch = conn.channel()
    declare(ch, name)
    bodies = [b"%d:" % i + b"z" * 1000 for i in range(300)]
    checkpoint = os.path.join(broker.data_dir, "store", "checkpoint")
    mtime = lambda: os.stat(checkpoint).st_mtime_ns if os.path.exists(checkpoint) else 0  # noqa: E731
    publish_confirmed(ch, name, bodies)
    confirmed_at = mtime()
    eventually(lambda: mtime() > confirmed_at, timeout=4)  # a checkpoint after the last publish
    assert store_files(broker) == {"log": 0, "records": 0}, "the log holds the bodies, in the WAL only"
    broker.kill9()
    broker.start()
    ch = broker.connection().channel()
    eventually(lambda: ready(ch, name) == 300)
    for i in range(100):
        m, _, body = ch.basic_get(name)
        assert body == bodies[i], "bodies come back from the replayed log"
        ch.basic_ack(m.delivery_tag)
    purges = lambda: broker.log_text().count("asking for the group's log to be purged")  # noqa: E731
    before = purges()
    eventually(lambda: purges() > before, timeout=30)  # the quiet snapshot, then the purge
    time.sleep(1)
    # A checkpoint (a classic queue's message is a change) shows what was written meanwhile: what a
    # snapshot's write-back of the 200 live bodies would have written, as the quorum queue's records.
    purged_at = mtime()
    ch.queue_declare(f"{name}-nudge", durable=True)
    ch.basic_publish("", f"{name}-nudge", b"x", PERSISTENT)
    eventually(lambda: mtime() > purged_at, timeout=10)
    assert store_files(broker, only=group_of(broker, name))["records"] == 0, "no body was written a second time"
    broker.kill9()
    broker.start()
    ch = broker.connection().channel()
    eventually(lambda: ready(ch, name) == 200)
    assert [b for b, _ in get_all(ch, name)] == bodies[100:], "bodies come back from the retained entries"


def test_busy_queues_give_their_logs_back_once_together_past_the_nodes_budget(broker, name, monkeypatch):
    """Each queue's log stays under its own threshold (64 MiB) and none is quiet for 5 s, but
    together they pass the node's budget (4 MiB here, `WARREN_TEST_NODE_LOG_BYTES`; 512 MiB by
    default): the largest snapshot and purge theirs while still busy. Nothing is lost: after a
    kill -9 every message comes back, in order, with its body."""
    monkeypatch.setenv("WARREN_TEST_NODE_LOG_BYTES", str(4 << 20))
    broker.restart()
    ch = broker.connection().channel()
    names = [f"{name}-{i}" for i in range(8)]
    for n in names:
        declare(ch, n)
    ch.confirm_delivery()
    pad = b"b" * 16000
    sent = 0
    over_at = None
    deadline = time.time() + 30
    # Until the budget is passed, then 3 s more (a snapshot, then a purge, a second apart).
    while over_at is None or time.time() < over_at + 3:
        for n in names:
            ch.basic_publish("", n, b"%d:" % sent + pad, PERSISTENT)
        sent += 1
        if over_at is None and "over their budget" in broker.log_text():
            over_at = time.time()
        assert time.time() < deadline, "8 busy queues of 16 KB messages never passed a 4 MiB budget"
    broker.kill9()
    broker.start()
    ch = broker.connection().channel()
    for n in names:
        eventually(lambda: ready(ch, n) == sent)
        assert [b for b, _ in get_all(ch, n)] == [b"%d:" % i + pad for i in range(sent)]


def test_a_consumer_drains_a_backlog_past_the_memory_budget_in_order_with_requeues(broker, small_body_budget, name):
    """Past the node's budget (32 MiB here) a consumer's bodies are read ahead from the store off the apply path:
    every message arrives once with its own body, in order, and one sent back (basic.nack
    requeue) comes again with its body, while the read-ahead runs past it."""
    conn = broker.connection()
    ch = conn.channel()
    declare(ch, name)
    pad = b"y" * 8000
    bodies = [str(i).encode() + b":" + pad for i in range(6000)]  # ~48 MB
    publish_confirmed(ch, name, bodies)
    cons = conn.channel()
    cons.basic_qos(prefetch_count=1000)
    got, requeued = [], set()

    def on_message(c, method, props, body):
        n = int(body.split(b":", 1)[0])
        if n % 97 == 0 and n not in requeued:
            requeued.add(n)
            c.basic_nack(method.delivery_tag, requeue=True)
            return
        got.append(body)
        c.basic_ack(method.delivery_tag)

    cons.basic_consume(name, on_message)
    deadline = time.time() + 60
    while len(got) < len(bodies) and time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    assert len(got) == len(bodies), f"{len(got)} of {len(bodies)} delivered"
    assert sorted(got, key=lambda b: int(b.split(b":", 1)[0])) == bodies, "every message once, bodies intact"
    in_order = [b for b in got if int(b.split(b":", 1)[0]) not in requeued]
    assert in_order == [b for i, b in enumerate(bodies) if i not in requeued], "the others in publish order"
    assert ready(ch, name) == 0


def test_a_consumer_with_credit_past_the_read_ahead_gets_every_body_once_in_order(broker, small_body_budget, name):
    """Prefetch 3,000 (the machine assigns 9,000 ahead) over 8 KB bodies: a delivery wants bodies
    past what the read-ahead (8,192 bodies) has read, some of them in reads under way, which it
    takes from those reads rather than reading them again. Every message arrives once, in order,
    with its own body."""
    conn = broker.connection()
    ch = conn.channel()
    declare(ch, name)
    pad = b"z" * 8000
    bodies = [str(i).encode() + b":" + pad for i in range(12000)]  # ~96 MB: three times the budget
    publish_confirmed(ch, name, bodies)
    cons = conn.channel()
    cons.basic_qos(prefetch_count=3000)
    got = []

    def on_message(c, method, props, body):
        got.append(body)
        if len(got) % 100 == 0:
            c.basic_ack(method.delivery_tag, multiple=True)

    cons.basic_consume(name, on_message)
    deadline = time.time() + 90
    while len(got) < len(bodies) and time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    assert len(got) == len(bodies), f"{len(got)} of {len(bodies)} delivered"
    assert got == bodies, "every message once, in order, bodies intact"
    eventually(lambda: ready(ch, name) == 0)


def test_a_backlog_larger_than_the_memory_budget_is_read_back_from_the_store(broker, small_body_budget, name):
    """A node's replicas hold bodies within its budget (32 MiB here); the rest stays in the store and is read back, in
    order, as it is delivered (also after a restart)."""
    conn = broker.connection()
    ch = conn.channel()
    declare(ch, name)
    pad = b"x" * 16000
    bodies = [str(i).encode() + b":" + pad for i in range(3000)]  # ~48 MB
    publish_confirmed(ch, name, bodies)
    first = [ch.basic_get(name, auto_ack=True)[2] for _ in range(1000)]
    assert first == bodies[:1000]
    # A no-ack get is settled once its get-ok is sent, so a crash right after one may bring its
    # message back (redelivered). A confirmed publish after the gets is committed after their
    # settles: with it, the kill -9 below finds them all committed.
    publish_confirmed(ch, name, [b"marker"])
    broker.kill9()
    broker.start()
    conn = broker.connection()
    ch = conn.channel()
    eventually(lambda: ready(ch, name) == 2001)
    got = consume_acking(conn, name, 2001, prefetch=200, timeout=30)
    assert got == bodies[1000:] + [b"marker"], "every message once, in order, bodies intact"


def test_queues_share_the_nodes_budget_for_bodies(broker, small_body_budget, name):
    """The budget is the node's, not each queue's: four queues of 12 MB each (each well under the
    32 MiB budget) fill it together, and the node says so; what did not fit (~14 MB) is read back
    from the disk as it is delivered. Every body comes back, in order, whether it was held or read
    back from the store."""
    conn = broker.connection()
    ch = conn.channel()
    names = [f"{name}-{i}" for i in range(4)]
    pad = b"q" * 12000
    bodies = [str(i).encode() + b":" + pad for i in range(1000)]  # 12 MB a queue
    for n in names:
        declare(ch, n)
        publish_confirmed(ch, n, bodies)
    assert "fill this node's budget" in broker.log_text()
    read_before, _ = io_bytes(broker.proc.pid)
    for n in names:
        got = consume_acking(conn, n, len(bodies), prefetch=300, timeout=30)
        assert got == bodies, f"{n}: every message once, in order, bodies intact"
    read, _ = io_bytes(broker.proc.pid)
    assert read - read_before > 4 << 20, f"the drains read {(read - read_before) >> 20} MiB from the disk"


def test_a_backlog_within_the_nodes_budget_is_delivered_from_memory(broker, name):
    """A 64 MB backlog is past what one queue could hold before (32 MiB), but within the node's
    budget (a quarter of the memory limit): it is delivered from memory, so the drain reads next
    to nothing from the disk (the bodies read back bypass the page cache, so a read-back would
    show in `/proc/PID/io`), and the node never says the budget is full."""
    conn = broker.connection()
    ch = conn.channel()
    declare(ch, name)
    pad = b"m" * 16000
    bodies = [str(i).encode() + b":" + pad for i in range(4000)]  # ~64 MB
    publish_confirmed(ch, name, bodies)
    read_before, _ = io_bytes(broker.proc.pid)
    got = consume_acking(conn, name, len(bodies), prefetch=500, timeout=60)
    read, _ = io_bytes(broker.proc.pid)
    assert got == bodies, "every message once, in order, bodies intact"
    assert read - read_before < 4 << 20, f"the drain read {(read - read_before) >> 20} MiB from the disk"
    assert "fill this node's budget" not in broker.log_text()


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_held_messages_keep_their_own_bytes_on_disk_not_the_segments_they_were_written_in(broker, name, queue_type):
    """Twelve messages each taken and held unacked while the 40 MB published after it are consumed:
    the disk keeps about their bytes, not the 32 MiB WAL segment (quorum: Raft log extent; classic:
    backlog extent) each one was written in (issue 32, item 10: eight held messages kept 126 MB). At
    checkpoints a sparse segment's live records are copied out and the segment goes. What stays
    besides: the WAL being written, each queue's newest segment, the broker's state. A kill -9
    after brings back the twelve, and only them."""
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(name, durable=True, arguments={"x-queue-type": queue_type})
    holder = conn.channel()
    pad = b"z" * 65536
    held = []
    for round in range(12):
        body = b"held-%d" % round
        publish_confirmed(ch, name, [body])
        method, _, got = holder.basic_get(name)
        assert got == body
        held.append(body)
        publish_confirmed(ch, name, [b"%d:%d:" % (round, i) + pad for i in range(640)])  # ~40 MB
        for i in range(640):
            m, _, got = ch.basic_get(name)
            assert got == b"%d:%d:" % (round, i) + pad
            ch.basic_ack(m.delivery_tag)
    # 32 MiB of WAL being written, 32 MiB for the newest segment of the queue (an extent of the WAL
    # segment before), 16 MiB of queue segment, 8 MB of state and snapshots.
    bound = 88e6
    eventually(lambda: disk_bytes(broker.data_dir) < bound, timeout=60)
    # Acks have no confirm: a confirmed publish after them is written (committed) after them, so
    # with it the kill -9 below finds every ack durable.
    publish_confirmed(ch, name, [b"marker"])
    broker.kill9()
    broker.start()
    ch = broker.connection().channel()
    eventually(lambda: ready(ch, name) == len(held) + 1)
    got = get_all(ch, name)
    # (The marker's redelivered flag is a hint either way: never delivered, it may still say so.)
    assert [body for body, _ in got] == held + [b"marker"]
    assert all(redelivered for _, redelivered in got[: len(held)])


def test_a_redeclare_renews_x_expires(ch, name):
    """Issue 33, item 7: a quorum queue's x-expires countdown restarts when it is redeclared (a
    Touch through its group), as RabbitMQ's; once no longer redeclared, it expires. (Before, the
    redeclare did not reach the group: the queue was deleted after 3 s, the marker with it, and the
    next redeclare made a new, empty one.)"""
    declare(ch, name, **{"x-expires": 3000})
    ch.confirm_delivery()
    ch.basic_publish("", name, b"marker", PERSISTENT)
    end = time.time() + 8
    while time.time() < end:
        declare(ch, name, **{"x-expires": 3000})
        time.sleep(0.25)
    assert ready(ch, name) == 1, "the queue expired although redeclared"

    # Watched with mandatory publishes: a declare, even passive, is a use (as RabbitMQ's).
    def gone():
        try:
            ch.basic_publish("", name, b"probe", PERSISTENT, mandatory=True)
            return False
        except UnroutableError:
            return True

    eventually(gone, timeout=30, interval=0.5)


def test_consume_and_cancel_cycles_count_no_failed_delivery_for_messages_never_received(conn, ch, name):
    """Issue 33, item 5: the group assigns a consumer up to three times its prefetch ahead; what its
    client never received goes back on basic.cancel as never assigned: not a failed delivery (no
    x-delivery-limit death), not redelivered. (Before, 20 consume/cancel cycles with a delivery
    limit of 1 dead-lettered messages no client had seen.)"""
    ch.exchange_declare(name + "-dlx", "fanout", durable=True)
    ch.queue_declare(name + "-dead", durable=True)
    ch.queue_bind(name + "-dead", name + "-dlx")
    declare(ch, name, **{"x-delivery-limit": 1, "x-dead-letter-exchange": name + "-dlx"})
    total = 4000
    publish_confirmed(ch, name, [b"%d" % i for i in range(total)])
    got, redelivered = [], 0
    for _ in range(20):
        c = conn.channel()
        c.basic_qos(prefetch_count=100)
        mine = []
        tag = c.basic_consume(name, lambda ch_, m, p, b: mine.append((m, b)))
        deadline = time.time() + 10
        while len(mine) < 100 and time.time() < deadline:
            conn.process_data_events(time_limit=0.05)
        # Cancelled while the client holds its prefetch (no more can come), then acked.
        c.basic_cancel(tag)
        for m, b in mine:
            c.basic_ack(m.delivery_tag)
            redelivered += m.redelivered
            got.append(b)
        c.close()
    assert len(got) == 2000 and len(set(got)) == 2000
    assert redelivered == 0, f"{redelivered} deliveries flagged redelivered; none was delivered before"
    assert ready(ch, name + "-dead") == 0, "messages no client saw were dead-lettered for their delivery limit"
    eventually(lambda: ready(ch, name) == total - 2000, timeout=10)


def test_a_channel_wide_prefetch_limits_quorum_consumers_too(conn, ch, name):
    """Issue 33, item 5: basic.qos(global=true) is honoured on a quorum queue, not ignored: two
    consumers on a channel with a channel-wide prefetch of 5 hold 5 unacked between them."""
    declare(ch, name)
    publish_confirmed(ch, name, [b"%d" % i for i in range(50)])
    c = conn.channel()
    c.basic_qos(prefetch_count=5, global_qos=True)
    got = []
    for _ in range(2):
        c.basic_consume(name, lambda ch_, m, p, b: got.append(m))
    deadline = time.time() + 3
    while time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    assert len(got) == 5
    c.basic_ack(got[-1].delivery_tag, multiple=True)
    deadline = time.time() + 10
    while len(got) < 10 and time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    conn.process_data_events(time_limit=0.5)
    assert len(got) == 10


def test_high_priority_messages_go_first_two_for_each_normal_one(ch, name):
    """Issue 33, item 9: priorities on quorum queues as RabbitMQ 4 has them, without
    x-max-priority: a message of priority 5 or more is high, the rest (no priority included)
    normal; while both wait, two high ones are delivered for each normal one, so normal messages
    are delayed, never starved. A requeued message goes back to the head of its lane. Before,
    quorum queues ignored priority: FIFO."""
    declare(ch, name)
    ch.confirm_delivery()
    for i in range(6):
        ch.basic_publish("", name, b"normal %d" % i, pika.BasicProperties(delivery_mode=2, priority=i % 5))
    for i in range(6):
        ch.basic_publish("", name, b"high %d" % i, pika.BasicProperties(delivery_mode=2, priority=5 + i))
    ch.basic_publish("", name, b"normal 6", PERSISTENT)
    first = ch.basic_get(name, auto_ack=False)
    assert first[2] == b"high 0"
    ch.basic_nack(first[0].delivery_tag, requeue=True)
    # The first get counted as a high one: one more, then a normal one.
    got = [body for body, _ in get_all(ch, name)]
    assert got == [b"high 0", b"normal 0", b"high 1", b"high 2", b"normal 1", b"high 3", b"high 4", b"normal 2",
                   b"high 5", b"normal 3", b"normal 4", b"normal 5", b"normal 6"], got
