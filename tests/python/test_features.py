"""RabbitMQ features the handshake advertises or the arguments ask for: unsupported arguments refused,
single active consumer, consumer priorities, the delivery acknowledgement timeout, direct reply-to and
priority queues, each as RabbitMQ behaves."""
import time

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker

from conftest import eventually


def pump(conn, seconds=0.3):
    """Lets in-flight deliveries arrive."""
    conn.process_data_events(time_limit=seconds)


def wait_for(conn, pred, timeout=10):
    deadline = time.time() + timeout
    while not pred() and time.time() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert pred(), "condition not met in time"


def consumer(ch, queue, got, label, auto_ack=True, arguments=None):
    """Registers a consumer that records (label, body)."""
    return ch.basic_consume(queue, lambda c, m, p, b: got.append((label, b)), auto_ack=auto_ack, arguments=arguments)


def publish_n(ch, queue, n, **props):
    for i in range(n):
        ch.basic_publish("", queue, str(i).encode(), pika.BasicProperties(**props) if props else None)


# ---- arguments Warren does not support are refused, never ignored ----------------------------------


@pytest.mark.warren_only  # RabbitMQ ignores arguments it does not know
@pytest.mark.parametrize("arg", ["x-made-up", "x-delivery-limit", "x-max-age", "x-max-in-memory-length"])
def test_unsupported_queue_argument_is_406_naming_it(ch, name, arg):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, arguments={arg: 1})
    assert e.value.reply_code == 406
    assert arg in e.value.reply_text and "not supported" in e.value.reply_text


@pytest.mark.warren_only
def test_unsupported_consume_argument_is_406_naming_it(ch, name):
    ch.queue_declare(name, auto_delete=True)
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_consume(name, lambda *a: None, arguments={"x-stream-offset": "first"})
    assert e.value.reply_code == 406
    assert "x-stream-offset" in e.value.reply_text


def test_supported_and_application_arguments_are_accepted(ch, name):
    ch.queue_declare(name, auto_delete=True, arguments={
        "x-queue-mode": "lazy", "x-single-active-consumer": False, "x-message-ttl": 60000,
        "my-own-metadata": "kept"})
    ch.basic_consume(name, lambda *a: None, arguments={"x-priority": 3})


def test_invalid_single_active_consumer_value_is_406(ch, name):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, arguments={"x-single-active-consumer": "yes"})
    assert e.value.reply_code == 406


# ---- single active consumer ------------------------------------------------------------------------


def test_single_active_consumer_gets_everything_then_the_next_takes_over(broker, conn, name):
    ch = conn.channel()
    ch.queue_declare(name, auto_delete=True, arguments={"x-single-active-consumer": True})
    got = []
    chans = [conn.channel() for _ in range(3)]
    tags = [consumer(c, name, got, i) for i, c in enumerate(chans)]
    publish_n(ch, name, 10)
    wait_for(conn, lambda: len(got) == 10)
    pump(conn)
    assert {label for label, _ in got} == {0}
    assert [b for _, b in got] == [str(i).encode() for i in range(10)]
    # The active one goes: the next registered one takes over, with what is waiting.
    chans[0].basic_cancel(tags[0])
    got.clear()
    publish_n(ch, name, 5)
    wait_for(conn, lambda: len(got) == 5)
    pump(conn)
    assert {label for label, _ in got} == {1}
    # Its channel closes: the third one.
    chans[1].close()
    got.clear()
    publish_n(ch, name, 5)
    wait_for(conn, lambda: len(got) == 5)
    assert {label for label, _ in got} == {2}


def test_single_active_consumer_waits_for_a_busy_active_consumer(conn, name):
    ch = conn.channel()
    ch.queue_declare(name, auto_delete=True, arguments={"x-single-active-consumer": True})
    busy = conn.channel()
    busy.basic_qos(prefetch_count=1)
    got = []
    consumer(busy, name, got, "busy", auto_ack=False)
    consumer(conn.channel(), name, got, "idle")
    publish_n(ch, name, 5)
    wait_for(conn, lambda: len(got) == 1)
    pump(conn, 0.5)
    assert got == [("busy", b"0")]
    assert ch.queue_declare(name, passive=True).method.message_count == 4


def test_single_active_consumer_successor_is_the_highest_priority(conn, name):
    ch = conn.channel()
    ch.queue_declare(name, auto_delete=True, arguments={"x-single-active-consumer": True})
    got = []
    first = conn.channel()
    tag = consumer(first, name, got, "first", arguments={"x-priority": 0})
    consumer(conn.channel(), name, got, "low", arguments={"x-priority": 1})
    consumer(conn.channel(), name, got, "high", arguments={"x-priority": 10})
    publish_n(ch, name, 3)
    wait_for(conn, lambda: len(got) == 3)
    # A later consumer never takes over from the active one, whatever its priority.
    assert {label for label, _ in got} == {"first"}
    first.basic_cancel(tag)
    got.clear()
    publish_n(ch, name, 3)
    wait_for(conn, lambda: len(got) == 3)
    assert {label for label, _ in got} == {"high"}


def test_exclusive_consume_on_single_active_consumer_queue_is_403(ch, name):
    ch.queue_declare(name, auto_delete=True, arguments={"x-single-active-consumer": True})
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_consume(name, lambda *a: None, exclusive=True)
    assert e.value.reply_code == 403


# ---- consumer priorities ---------------------------------------------------------------------------


def test_highest_priority_consumer_gets_everything_while_it_has_credit(conn, name):
    ch = conn.channel()
    ch.queue_declare(name, auto_delete=True)
    got = []
    consumer(conn.channel(), name, got, "low", arguments={"x-priority": 1})
    consumer(conn.channel(), name, got, "default")
    consumer(conn.channel(), name, got, "high", arguments={"x-priority": 10})
    publish_n(ch, name, 20)
    wait_for(conn, lambda: len(got) == 20)
    assert {label for label, _ in got} == {"high"}


def test_lower_priority_consumers_get_messages_when_higher_ones_are_blocked(conn, name):
    ch = conn.channel()
    ch.queue_declare(name, auto_delete=True)
    got = []
    high = conn.channel()
    high.basic_qos(prefetch_count=2)
    consumer(high, name, got, "high", auto_ack=False, arguments={"x-priority": 5})
    consumer(conn.channel(), name, got, "low", arguments={"x-priority": -5})
    publish_n(ch, name, 10)
    wait_for(conn, lambda: len(got) == 10)
    assert sum(1 for label, _ in got if label == "high") == 2
    assert sum(1 for label, _ in got if label == "low") == 8


def test_equal_priorities_share_round_robin(conn, name):
    ch = conn.channel()
    ch.queue_declare(name, auto_delete=True)
    got = []
    consumer(conn.channel(), name, got, "a", arguments={"x-priority": 7})
    consumer(conn.channel(), name, got, "b", arguments={"x-priority": 7})
    consumer(conn.channel(), name, got, "low")
    publish_n(ch, name, 10)
    wait_for(conn, lambda: len(got) == 10)
    assert sorted(label for label, _ in got) == ["a"] * 5 + ["b"] * 5


def test_consumer_priority_must_be_an_integer(ch, name):
    ch.queue_declare(name, auto_delete=True)
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_consume(name, lambda *a: None, arguments={"x-priority": "high"})
    assert e.value.reply_code == 406


# ---- delivery acknowledgement timeout ---------------------------------------------------------------


@pytest.fixture
def short_timeout_broker(tmp_path):
    from conftest import Broker
    cfg = tmp_path / "warren.toml"
    cfg.write_text("consumer-timeout = 600\n")
    b = Broker(tmp_path / "data", tmp_path / "warren.log")
    b.extra_args = ["--config", str(cfg)]
    b.start()
    yield b
    b.proc.kill()
    b.proc.wait(10)


def closed_by_broker(ch):
    """Records why the broker closes `ch` (pika's BlockingChannel keeps it to itself)."""
    reasons = []
    ch._impl.add_on_close_callback(lambda _c, reason: reasons.append(reason))
    return reasons


def wait_closed(conn, reasons, timeout=10):
    """Waits until the broker closed the channel `reasons` watches; returns the ChannelClosedByBroker."""
    deadline = time.time() + timeout
    while not reasons and time.time() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert reasons, "channel still open"
    assert isinstance(reasons[0], ChannelClosedByBroker), reasons[0]
    return reasons[0]


@pytest.mark.warren_only  # the node's timeout is set in Warren's config file (RabbitMQ: consumer_timeout)
def test_delivery_unacked_past_consumer_timeout_closes_channel_and_requeues(short_timeout_broker, name):
    conn = short_timeout_broker.connection()
    ch = conn.channel()
    reasons = closed_by_broker(ch)
    ch.queue_declare(name)
    publish_n(ch, name, 3)
    got = []
    started = time.time()  # before the deliveries: the client may see them late under load
    consumer(ch, name, got, "slow", auto_ack=False)
    wait_for(conn, lambda: len(got) == 3)
    closed = wait_closed(conn, reasons)
    assert time.time() - started >= 0.55  # the timeout is 600 ms
    assert closed.reply_code == 406
    assert "delivery acknowledgement on channel 1 timed out" in closed.reply_text
    assert "600 ms" in closed.reply_text
    # Its messages went back to the queue, flagged redelivered; the connection is still usable.
    other = conn.channel()
    m, _, body = other.basic_get(name, auto_ack=True)
    assert body == b"0" and m.redelivered
    assert other.queue_declare(name, passive=True).method.message_count == 2


@pytest.mark.warren_only
def test_acked_deliveries_and_basic_get_within_timeout_are_fine(short_timeout_broker, name):
    conn = short_timeout_broker.connection()
    ch = conn.channel()
    reasons = closed_by_broker(ch)
    ch.queue_declare(name)
    publish_n(ch, name, 20)
    for _ in range(20):
        m, _, _ = ch.basic_get(name)
        pump(conn, 0.1)
        ch.basic_ack(m.delivery_tag)
    pump(conn, 1.0)
    assert ch.is_open and not reasons
    # A basic.get delivery left unacked times out too.
    publish_n(ch, name, 1)
    m, _, _ = ch.basic_get(name)
    assert wait_closed(conn, reasons).reply_code == 406


@pytest.mark.warren_only
def test_queue_consumer_timeout_argument_overrides_the_node_default(short_timeout_broker, name):
    conn = short_timeout_broker.connection()
    patient = conn.channel()
    patient_reasons = closed_by_broker(patient)
    patient.queue_declare(name + "-long", arguments={"x-consumer-timeout": 60000})
    publish_n(patient, name + "-long", 1)
    patient.basic_get(name + "-long")
    ch = conn.channel()
    reasons = closed_by_broker(ch)
    ch.queue_declare(name, arguments={"x-consumer-timeout": 300})
    publish_n(ch, name, 1)
    ch.basic_get(name)
    closed = wait_closed(conn, reasons)
    assert closed.reply_code == 406 and "300 ms" in closed.reply_text
    pump(conn, 1.5)
    assert not patient_reasons and patient.is_open


# ---- direct reply-to ---------------------------------------------------------------------------------

REPLY_TO = "amq.rabbitmq.reply-to"


def test_direct_reply_to_round_trip(broker, conn, name):
    server_conn = broker.connection()
    server = server_conn.channel()
    server.queue_declare(name, auto_delete=True)
    requests = []
    server.basic_consume(name, lambda c, m, p, b: requests.append((p, b)), auto_ack=True)

    client = conn.channel()
    assert client.queue_declare(REPLY_TO, passive=True).method.queue == REPLY_TO
    replies = []
    client.basic_consume(REPLY_TO, lambda c, m, p, b: replies.append((m, p, b)), auto_ack=True)
    client.basic_publish("", name, b"ping", pika.BasicProperties(reply_to=REPLY_TO, correlation_id="c-1"))
    wait_for(server_conn, lambda: requests)
    props, body = requests[0]
    assert body == b"ping"
    address = props.reply_to
    assert address.startswith(REPLY_TO + ".") and len(address) > len(REPLY_TO) + 1
    assert props.correlation_id == "c-1"
    # The RPC server can check its client still waits: the address declares while the consumer exists.
    assert server.queue_declare(address, passive=True).method.queue == address
    for i in range(3):
        server.basic_publish("", address, b"pong%d" % i, pika.BasicProperties(correlation_id="c-1"))
    wait_for(conn, lambda: len(replies) == 3)
    m, p, b = replies[0]
    assert [r[2] for r in replies] == [b"pong0", b"pong1", b"pong2"]
    assert m.routing_key == address and m.exchange == "" and p.correlation_id == "c-1"
    # No queue was made for it.
    with pytest.raises(ChannelClosedByBroker) as e:
        server_conn.channel().queue_declare(address.replace(REPLY_TO + ".", "amq.gen-"), passive=True)
    assert e.value.reply_code == 404
    # Once the client's channel is gone, its address is too, and replies to it are dropped.
    client.close()
    pump(conn)
    server.basic_publish("", address, b"late")
    with pytest.raises(ChannelClosedByBroker) as e:
        server.queue_declare(address, passive=True)
    assert e.value.reply_code == 404
    server_conn.close()


def test_direct_reply_to_consumer_must_be_no_ack(ch):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_consume(REPLY_TO, lambda *a: None, auto_ack=False)
    assert e.value.reply_code == 406
    assert "reply consumer cannot acknowledge" in e.value.reply_text


def test_direct_reply_to_publish_without_reply_consumer_is_406(ch, name):
    ch.queue_declare(name, auto_delete=True)
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_publish("", name, b"x", pika.BasicProperties(reply_to=REPLY_TO))
        ch.queue_declare(name, passive=True)  # a round trip, to see the channel's fate
    assert e.value.reply_code == 406
    assert "fast reply consumer does not exist" in e.value.reply_text


def test_direct_reply_to_one_reply_consumer_per_channel(ch):
    ch.basic_consume(REPLY_TO, lambda *a: None, auto_ack=True)
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.basic_consume(REPLY_TO, lambda *a: None, auto_ack=True)
    assert e.value.reply_code == 406


def test_direct_reply_to_cancel_then_consume_again(conn, ch, name):
    tag = ch.basic_consume(REPLY_TO, lambda *a: None, auto_ack=True)
    ch.basic_cancel(tag)
    replies = []
    ch.basic_consume(REPLY_TO, lambda c, m, p, b: replies.append(b), auto_ack=True)
    ch.queue_declare(name, auto_delete=True)
    ch.basic_publish("", name, b"req", pika.BasicProperties(reply_to=REPLY_TO))
    _, props, _ = ch.basic_get(name, auto_ack=True) if eventually(
        lambda: ch.queue_declare(name, passive=True).method.message_count == 1) else (None, None, None)
    ch.basic_publish("", props.reply_to, b"answer")
    wait_for(conn, lambda: replies)
    assert replies == [b"answer"]


# ---- priority queues ---------------------------------------------------------------------------------


def publish_prioritised(ch, queue, pairs, persistent=False, body_pad=b""):
    """Publishes (priority, label) pairs; priority None sends no priority property."""
    for priority, label in pairs:
        props = pika.BasicProperties(priority=priority, delivery_mode=2 if persistent else None)
        ch.basic_publish("", queue, label.encode() + body_pad, props)


def drain_get(ch, queue, n):
    bodies = []
    for _ in range(n):
        m, _, body = ch.basic_get(queue, auto_ack=True)
        assert m is not None, f"only {len(bodies)} of {n} messages"
        bodies.append(body)
    return bodies


def test_priority_queue_delivers_highest_first_fifo_within_a_priority(ch, name):
    ch.queue_declare(name, auto_delete=True, arguments={"x-max-priority": 10})
    pairs = [(1, "a1"), (5, "a5"), (None, "n0"), (5, "b5"), (10, "a10"), (0, "a0"), (200, "over"), (1, "b1")]
    publish_prioritised(ch, name, pairs)
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == len(pairs))
    # Above x-max-priority counts as the maximum; no priority as 0.
    assert drain_get(ch, name, len(pairs)) == [b"a10", b"over", b"a5", b"b5", b"a1", b"b1", b"n0", b"a0"]


def test_priority_queue_consumer_gets_the_highest_waiting(conn, ch, name):
    ch.queue_declare(name, auto_delete=True, arguments={"x-max-priority": 3})
    publish_prioritised(ch, name, [(0, "low"), (2, "mid"), (3, "high"), (2, "mid2")])
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 4)
    ch.basic_qos(prefetch_count=1)
    got = []
    ch.basic_consume(name, lambda c, m, p, b: (got.append(b), c.basic_ack(m.delivery_tag)))
    wait_for(conn, lambda: len(got) == 4)
    assert got == [b"high", b"mid", b"mid2", b"low"]


def test_priority_queue_requeued_message_goes_back_to_its_priority(ch, name):
    ch.queue_declare(name, auto_delete=True, arguments={"x-max-priority": 5})
    publish_prioritised(ch, name, [(1, "low"), (4, "high"), (4, "high2")])
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 3)
    m, _, body = ch.basic_get(name)
    assert body == b"high"
    ch.basic_nack(m.delivery_tag, requeue=True)
    m, _, body = ch.basic_get(name, auto_ack=True)
    assert body == b"high" and m.redelivered
    assert drain_get(ch, name, 2) == [b"high2", b"low"]


def test_priority_queue_backlog_beyond_the_window_stays_in_order(ch, name):
    ch.queue_declare(name, auto_delete=True, arguments={"x-max-priority": 3})
    ch.confirm_delivery()
    n = 4000  # 1,000 per level: more than a lane's window, so every level pages to disk
    pad = b"x" * 1000
    publish_prioritised(ch, name, [(i % 4, "%d-%05d" % (i % 4, i)) for i in range(n)], body_pad=pad)
    assert ch.queue_declare(name, passive=True).method.message_count == n
    bodies = [b[:7] for b in drain_get(ch, name, n)]
    expected = sorted(("%d-%05d" % (i % 4, i)).encode() for i in range(n))
    expected = sorted(expected, key=lambda b: -int(b[:1]))  # stable: FIFO within a priority
    assert bodies == expected


def test_invalid_max_priority_is_406(ch, name):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, arguments={"x-max-priority": 256})
    assert e.value.reply_code == 406
    ch = ch.connection.channel()
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.queue_declare(name, arguments={"x-max-priority": "high"})
    assert e.value.reply_code == 406


@pytest.mark.needs_process
def test_priority_queue_keeps_priorities_across_a_restart(broker, name):
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(name, durable=True, arguments={"x-max-priority": 9})
    ch.confirm_delivery()
    pairs = [((i * 7) % 10, "%d-%04d" % ((i * 7) % 10, i)) for i in range(3000)]
    publish_prioritised(ch, name, pairs, persistent=True, body_pad=b"y" * 500)
    # Take a few (and ack them) so some levels are partly consumed before the restart.
    for _ in range(5):
        m, _, _ = ch.basic_get(name)
        ch.basic_ack(m.delivery_tag)
    conn.close()
    broker.restart()
    conn = broker.connection()
    ch = conn.channel()
    assert ch.queue_declare(name, durable=True, arguments={"x-max-priority": 9}).method.message_count == 2995
    bodies = [b[:6] for b in drain_get(ch, name, 2995)]
    expected = sorted((label.encode() for _, label in pairs), key=lambda b: -int(b[:1]))[5:]
    assert bodies == expected
    conn.close()


@pytest.mark.needs_process
def test_priority_queue_consumed_messages_stay_consumed_after_a_restart(broker, name):
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(name, durable=True, arguments={"x-max-priority": 4})
    ch.confirm_delivery()
    publish_prioritised(ch, name, [(i % 5, "m%d" % i) for i in range(300)], persistent=True)
    got = []
    ch.basic_consume(name, lambda c, m, p, b: got.append(b), auto_ack=True)  # settled by no-ack
    wait_for(conn, lambda: len(got) == 300)
    pump(conn, 0.5)
    conn.close()
    broker.restart()
    ch = broker.connection().channel()
    assert ch.queue_declare(name, passive=True).method.message_count == 0
