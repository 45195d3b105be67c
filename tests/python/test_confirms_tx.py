"""Publisher confirms and transactions."""
import struct
import time

import pytest
from pika.exceptions import ChannelClosedByBroker, NackError

from conftest import eventually
from rawamqp import (FRAME_BODY, FRAME_HEADER, RawConnection, ack_fields, frame, method_frame, publish_frames,
                     queue_declare_frame, shortstr, table)


def test_confirm_select_then_publishes_are_acked(ch, name):
    ch.queue_declare(name, durable=True)
    ch.confirm_delivery()
    for i in range(20):
        ch.basic_publish("", name, str(i).encode(), properties=None, mandatory=False)
    assert ch.queue_declare(name, passive=True).method.message_count == 20
    ch.queue_delete(name)


def test_confirms_cover_every_tag_and_use_multiple(broker, name):
    """Many publishes in flight: every sequence number is acked exactly once, acks in order,
    and the broker coalesces them with `multiple` instead of one ack per message."""
    r = RawConnection(broker.host, broker.port)
    r.handshake()
    r.open_channel(1)
    r.send(method_frame(1, 50, 10, struct.pack(">H", 0) + shortstr(name) + b"\x02" + table()))  # durable
    r.expect(50, 11)
    r.send(method_frame(1, 85, 10, b"\x00"))
    r.expect(85, 11)
    n = 2000
    body = b"x" * 100
    header = frame(FRAME_HEADER, 1, struct.pack(">HHQH", 60, 0, len(body), 0x1000) + b"\x02")  # persistent
    publish = method_frame(1, 60, 40, struct.pack(">H", 0) + shortstr("") + shortstr(name) + b"\x00")
    r.send((publish + header + frame(FRAME_BODY, 1, body)) * n)
    confirmed, acks, multiples = 0, 0, 0
    while confirmed < n:
        f = r.read_method()
        assert f.method == (60, 80), f"expected basic.ack, got {f}"
        tag, flags = struct.unpack(">QB", f.payload[4:13])
        multiple = bool(flags & 1)
        if multiple:
            multiples += 1
            assert tag > confirmed
            confirmed = tag
        else:
            assert tag == confirmed + 1, f"single ack {tag} after {confirmed}"
            confirmed = tag
        acks += 1
    assert confirmed == n
    assert multiples > 0 and acks < n / 2, f"{acks} acks for {n} messages"
    r.close()


def test_reject_publish_overflow_nacks(ch, name):
    ch.queue_declare(name, auto_delete=True, arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    ch.confirm_delivery()
    ch.basic_publish("", name, b"1")
    ch.basic_publish("", name, b"2")
    with pytest.raises(NackError):
        ch.basic_publish("", name, b"3")
    assert ch.queue_declare(name, passive=True).method.message_count == 2


def test_confirm_select_on_transactional_channel_is_406(ch):
    ch.tx_select()
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.confirm_delivery()
    assert e.value.reply_code == 406


def test_tx_commit_publishes_rollback_discards(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    ch.tx_select()
    ch.basic_publish("", name, b"committed")
    ch.basic_publish("", name, b"rolled-back-1")
    observer = conn.channel()
    assert observer.queue_declare(name, passive=True).method.message_count == 0
    ch.tx_commit()
    assert observer.queue_declare(name, passive=True).method.message_count == 2
    m1, _, _ = observer.basic_get(name, auto_ack=True)
    observer.basic_get(name, auto_ack=True)
    ch.basic_publish("", name, b"discarded")
    ch.tx_rollback()
    ch.tx_commit()  # nothing left to commit
    assert observer.queue_declare(name, passive=True).method.message_count == 0


def test_tx_acks_take_effect_on_commit(conn, ch, name):
    ch.queue_declare(name, auto_delete=True)
    for b in (b"a", b"b"):
        ch.basic_publish("", name, b)
    ch.tx_select()
    m1, _, _ = eventually(lambda: ch.basic_get(name))
    m2, _, _ = ch.basic_get(name)
    ch.basic_ack(m1.delivery_tag)
    ch.tx_rollback()  # the ack of m1 is forgotten; m1 stays unacked
    ch.basic_ack(m2.delivery_tag)
    ch.tx_commit()
    ch.basic_recover(requeue=True)
    again, _, body = eventually(lambda: ch.basic_get(name, auto_ack=True))
    assert body == b"a" and again.redelivered
    assert ch.basic_get(name) == (None, None, None)


@pytest.mark.parametrize("bad", ["publish to a missing exchange", "ack of an unknown tag", "ack of a tag twice"])
def test_a_bad_operation_fails_the_transaction_before_any_of_it_is_done(conn, ch, name, bad):
    """Issue 33, item 6: a transaction is all or nothing. A publish to a missing exchange or an ack
    of a tag the channel does not hold is refused when it is made (a channel error, as RabbitMQ):
    the transaction's earlier publishes are never routed, its earlier acks never done. (Before, the
    earlier publishes were routed at commit, then the channel closed.)"""
    ch.queue_declare(name, auto_delete=False)
    ch.basic_publish("", name, b"held")
    held, _, _ = eventually(lambda: ch.basic_get(name))
    ch.tx_select()
    ch.basic_publish("", name, b"first")
    ch.basic_ack(held.delivery_tag)
    with pytest.raises(ChannelClosedByBroker) as e:
        if bad == "publish to a missing exchange":
            ch.basic_publish(name + "-no-such-exchange", "rk", b"lost")
        elif bad == "ack of an unknown tag":
            ch.basic_ack(held.delivery_tag + 100)
        else:
            ch.basic_ack(held.delivery_tag)
        ch.tx_commit()
    assert e.value.reply_code == (404 if bad.startswith("publish") else 406)
    observer = conn.channel()
    # Neither "first" nor the ack: the held message is back (its channel closed), alone.
    got = []
    while True:
        m, _, body = observer.basic_get(name, auto_ack=True)
        if m is None:
            break
        got.append(body)
    assert got == [b"held"]
    observer.queue_delete(name)


def test_tx_commit_without_select_is_406(ch):
    with pytest.raises(ChannelClosedByBroker) as e:
        ch.tx_commit()
    assert e.value.reply_code == 406


def test_confirms_do_not_leak_across_a_reopened_channel(broker, name):
    """Confirms belong to one channel incarnation (issue 9, defect 2): publishes still waiting for their
    fsync when the channel closes are never confirmed after its close-ok, and a channel opened again on
    the same number starts with nothing pending (its tag 1 is acked alone, not merged with old tags)."""
    r = RawConnection(broker.host, broker.port, timeout=60)
    r.handshake()
    r.open_channel(1)
    r.send(queue_declare_frame(1, name))
    r.expect(50, 11)
    r.send(method_frame(1, 85, 10, b"\x00"))
    r.expect(85, 11)
    # 64 MB of persistent messages, then channel.close at once: most confirms are still waiting for the
    # disk when the close is read.
    n, body = 256, b"x" * (256 * 1024)
    r.send(publish_frames(1, name, body) * n + method_frame(1, 20, 40, struct.pack(">H", 200) + shortstr("bye")
                                                             + struct.pack(">HH", 0, 0)))
    acked_before_close = 0
    while True:
        f = r.read_method()
        if f.method == (20, 41):
            break
        assert f.method == (60, 80), f"expected basic.ack or close-ok, got {f}"
        acked_before_close = ack_fields(f)[0]
    r.send(method_frame(1, 20, 10, shortstr("")))
    f = r.read_method()
    assert f.method == (20, 11), f"after close-ok only open-ok may come on channel 1, got {f} " \
                                 f"({acked_before_close} of {n} were confirmed before the close)"
    r.send(method_frame(1, 85, 10, b"\x00"))
    r.expect(85, 11)
    for tag in (1, 2):
        r.send(publish_frames(1, name, b"new"))
        f = r.read_method()
        assert f.method == (60, 80), f"expected basic.ack, got {f}"
        assert ack_fields(f) == (tag, False), f"the new channel's publish {tag} got {ack_fields(f)}"
    r.close()
    # Nothing was lost: the old channel's publishes are stored, only unconfirmed.
    with broker.connection() as c:
        ch = c.channel()
        eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == n + 2)
        ch.queue_delete(name)


@pytest.mark.needs_process
def test_confirms_pending_at_close_are_never_sent_with_a_slow_disk(tmp_path, monkeypatch, name):
    """The same as above, made deterministic with the test-only fault hook WARREN_TEST_FSYNC_DELAY_MS:
    every fsync takes 500 ms, so every confirm is still pending when channel.close is read. None may
    follow close-ok, and the reopened channel's confirms start at tag 1, alone."""
    from conftest import Broker
    monkeypatch.setenv("WARREN_TEST_FSYNC_DELAY_MS", "500")
    broker = Broker(tmp_path / "data", tmp_path / "warren.log")
    broker.start()
    try:
        r = RawConnection(broker.host, broker.port, timeout=30)
        r.handshake()
        r.open_channel(1)
        r.send(queue_declare_frame(1, name))
        r.expect(50, 11)
        r.send(method_frame(1, 85, 10, b"\x00"))
        r.expect(85, 11)
        r.send(publish_frames(1, name, b"old") * 50
               + method_frame(1, 20, 40, struct.pack(">H", 200) + shortstr("bye") + struct.pack(">HH", 0, 0)))
        f = r.read_method()
        assert f.method == (20, 41), f"expected channel.close-ok first (every confirm waits for a slow fsync), got {f}"
        time.sleep(1.5)  # the old publishes become durable meanwhile: their confirms must stay unsent
        r.send(method_frame(1, 20, 10, shortstr("")))
        f = r.read_method()
        assert f.method == (20, 11), f"after close-ok only open-ok may come on channel 1, got {f}"
        r.send(method_frame(1, 85, 10, b"\x00"))
        r.expect(85, 11)
        for tag in (1, 2):
            r.send(publish_frames(1, name, b"new"))
            f = r.read_method()
            assert f.method == (60, 80), f"expected basic.ack, got {f}"
            assert ack_fields(f) == (tag, False), f"the new channel's publish {tag} got {ack_fields(f)}"
        r.close()
    finally:
        broker.proc.kill()
        broker.proc.wait(10)
