"""Durability: topology and persistent messages survive restarts and kill -9."""
import hashlib
import time
import threading

import pika
import pytest

from conftest import eventually

pytestmark = pytest.mark.needs_process


def body(i):
    payload = b"%08d" % i
    return payload + hashlib.sha256(payload).hexdigest().encode()


def test_durable_topology_and_persistent_messages_survive_restart(broker, name):
    c = broker.connection()
    ch = c.channel()
    ch.confirm_delivery()
    ch.exchange_declare(name + "x", "direct", durable=True)
    ch.queue_declare(name, durable=True)
    ch.queue_bind(name, name + "x", "k")
    ch.basic_publish(name + "x", "k", b"persistent", pika.BasicProperties(delivery_mode=2))
    ch.basic_publish(name + "x", "k", b"transient", pika.BasicProperties(delivery_mode=1))
    c.close()
    assert broker.terminate() == 0
    broker.start()
    c = broker.connection()
    ch = c.channel()
    ch.exchange_declare(name + "x", passive=True)
    assert ch.queue_declare(name, passive=True).method.message_count == 1
    m, _, b = ch.basic_get(name, auto_ack=True)
    assert b == b"persistent"
    ch.basic_publish(name + "x", "k", b"binding survived")
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 1)
    c.close()


def test_sigterm_closes_clients_with_320(broker):
    c = broker.connection()
    closed = {}

    def stop():
        closed["code"] = broker.terminate()

    t = threading.Thread(target=stop)
    t.start()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e:
        c.process_data_events(time_limit=15)
        c.sleep(15)
    t.join()
    assert e.value.reply_code == 320
    assert closed["code"] == 0


def test_kill9_keeps_every_confirmed_message_in_order(broker, name):
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(name, durable=True)
    ch.confirm_delivery()
    confirmed = []
    # pika's BlockingChannel with confirms returns only after the broker confirmed each publish.
    for i in range(3000):
        ch.basic_publish("", name, body(i), pika.BasicProperties(delivery_mode=2))
        confirmed.append(i)
        if i == 2000:
            # Take some, leave them unacked: they must come back redelivered.
            for _ in range(10):
                ch.basic_get(name, auto_ack=False)
    broker.kill9()
    broker.start()
    c = broker.connection()
    ch = c.channel()
    got = []
    redelivered = 0
    while True:
        m, _, b = ch.basic_get(name, auto_ack=True)
        if m is None:
            break
        assert b == body(int(b[:8])), "corrupt message"
        got.append(int(b[:8]))
        redelivered += m.redelivered
    assert got == confirmed, "confirmed messages missing, duplicated or out of order"
    assert redelivered >= 10
    c.close()


def test_after_a_crash_delivered_ones_come_back_redelivered_and_never_delivered_ones_not(broker, name):
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(name, durable=True)
    ch.confirm_delivery()
    for i in range(6000):
        ch.basic_publish("", name, body(i), pika.BasicProperties(delivery_mode=2))
    # A consumer takes 100 and never acks them.
    ch.basic_qos(prefetch_count=100)
    taken = []
    ch.basic_consume(name, lambda ch_, m, p, b: taken.append(int(b[:8])), auto_ack=False)
    deadline = time.time() + 10
    while len(taken) < 100 and time.time() < deadline:
        c.process_data_events(time_limit=0.1)
    assert taken == list(range(100))
    broker.kill9()
    broker.start()
    c = broker.connection()
    ch = c.channel()
    flags = {}
    while True:
        m, _, b = ch.basic_get(name, auto_ack=True)
        if m is None:
            break
        flags[int(b[:8])] = m.redelivered
    assert sorted(flags) == list(range(6000))
    assert all(flags[i] for i in range(100)), "delivered before the crash: redelivered"
    # The store records deliveries a bounded step ahead (2,048 seqs): beyond that, first deliveries.
    never = [i for i in range(100 + 2048, 6000) if flags[i]]
    assert not never, f"{len(never)} never-delivered messages flagged redelivered, e.g. {never[:5]}"
    c.close()


@pytest.mark.parametrize("stop", ["kill9", "terminate"])
def test_unconfirmed_messages_held_for_a_stalled_no_ack_consumer_are_written_soon(broker, name, stop):
    """Persistent messages published without confirms while every consumer is no-ack are written lazily
    (most are delivered first); those a stalled consumer leaves waiting must reach the store within a
    housekeeping tick, or on shutdown, and survive a restart."""
    import struct
    from rawamqp import RawConnection, method_frame, shortstr, table
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(name, durable=True)
    # A no-ack consumer that never reads its socket: deliveries back up, the queue holds the rest.
    stalled = RawConnection(broker.host, broker.port)
    stalled.handshake()
    stalled.open_channel(1)
    stalled.send(method_frame(1, 60, 20, struct.pack(">H", 0) + shortstr(name) + shortstr("") + b"\x02" + table()))
    stalled.expect(60, 21)
    for i in range(30000):
        ch.basic_publish("", name, body(i) + b"x" * 2000, pika.BasicProperties(delivery_mode=2))
    stalled.sock.close()  # the consumer goes; what it did not get stays in the queue
    time.sleep(1.0)  # several housekeeping ticks
    waiting = ch.queue_declare(name, durable=True, passive=True).method.message_count
    assert waiting > 1000, f"the stalled consumer should have left most messages waiting ({waiting})"
    c.close()
    if stop == "kill9":
        broker.kill9()
    else:
        assert broker.terminate() == 0
    broker.start()
    c = broker.connection()
    ch = c.channel()
    assert ch.queue_declare(name, durable=True, passive=True).method.message_count == waiting
    c.close()


@pytest.mark.parametrize("stop", ["terminate", "kill9"])
def test_a_deferred_message_taken_by_get_and_requeued_survives_a_restart(broker, name, stop):
    """A persistent message published without confirms while the queue's only consumer is no-ack is
    not written at once (deferred). Taken by basic.get and requeued after a later message was written,
    it used to be written after that higher seq, and the store dropped it: lost even on a clean stop."""
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(name, durable=True)
    # The no-ack consumer's channel has flow off: it takes nothing, so the publish below stays deferred.
    consumer = broker.connection()
    cch = consumer.channel()
    cch.flow(False)
    cch.basic_consume(name, lambda *a: None, auto_ack=True)
    ch.basic_publish("", name, b"first", pika.BasicProperties(delivery_mode=2))
    m, _, b = ch.basic_get(name, auto_ack=False)
    assert b == b"first"
    confirmed = c.channel()
    confirmed.confirm_delivery()
    confirmed.basic_publish("", name, b"second", pika.BasicProperties(delivery_mode=2))
    ch.basic_reject(m.delivery_tag, requeue=True)
    assert ch.queue_declare(name, durable=True, passive=True).method.message_count == 2
    if stop == "kill9":
        time.sleep(0.5)  # several housekeeping ticks: waiting deferred messages are written
        broker.kill9()
    else:
        assert broker.terminate() == 0
    broker.start()
    c = broker.connection()
    ch = c.channel()
    got = []
    while True:
        m, _, b = ch.basic_get(name, auto_ack=True)
        if m is None:
            break
        got.append(b)
    assert got == [b"first", b"second"]
    assert "out of seq order" not in broker.log_text() and "below one already stored" not in broker.log_text()
    c.close()


def test_confirmed_messages_for_a_no_ack_consumer_are_stored_or_written_to_its_socket(broker, name):
    """A confirm promises the message is on disk or consumed, and a no-ack delivery is consumed once it
    is written to the consumer's socket (RabbitMQ's "consumed from all queues"). Confirmed persistent
    messages used to skip the store when a no-ack consumer could take them, and were confirmed while
    still in the consumer connection's outbox: kill -9 lost them."""
    import struct
    from rawamqp import FRAME_BODY, RawConnection, method_frame, shortstr, table
    c = broker.connection()
    ch = c.channel()
    ch.queue_declare(name, durable=True)
    # A no-ack consumer that never reads its socket: deliveries back up in its outbox.
    stalled = RawConnection(broker.host, broker.port)
    stalled.handshake()
    stalled.open_channel(1)
    stalled.send(method_frame(1, 60, 20, struct.pack(">H", 0) + shortstr(name) + shortstr("") + b"\x02" + table()))
    stalled.expect(60, 21)
    ch.confirm_delivery()
    confirmed = []
    for i in range(4000):
        ch.basic_publish("", name, body(i) + b"x" * 2000, pika.BasicProperties(delivery_mode=2))
        confirmed.append(i)
    broker.kill9()
    # What the broker wrote to the consumer's socket before it died was consumed: read it all back.
    delivered = set()
    stalled.sock.settimeout(5)
    try:
        while True:
            f = stalled.read_frame()
            if f.kind == FRAME_BODY:
                delivered.add(int(f.payload[:8]))
    except (ConnectionError, OSError):
        pass
    broker.start()
    c = broker.connection()
    ch = c.channel()
    stored = set()
    while True:
        m, _, b = ch.basic_get(name, auto_ack=True)
        if m is None:
            break
        stored.add(int(b[:8]))
    lost = sorted(set(confirmed) - delivered - stored)
    assert not lost, f"{len(lost)} confirmed messages neither stored nor delivered, e.g. {lost[:5]} " \
                     f"({len(delivered)} delivered, {len(stored)} stored)"
    c.close()
