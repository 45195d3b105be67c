"""Rewind of classic and quorum queues with retention (`x-retention-seconds`), through the HTTP API and
`warren ctl`, with pika consumers counting every message: consumed messages published since the
point in time come back in publish order, redelivered; ready and unacked ones are not duplicated;
the rewind survives kill -9; a rewind racing publishers and consumers loses and reorders nothing."""

import subprocess
import threading
import time

import pika
import pytest
import requests

from conftest import binary_for, eventually

pytestmark = pytest.mark.warren_only

RETAINED = {"x-retention-seconds": 3600}
# A quorum queue's rewind is exact to its retention's sample step (retention / 65,536, at least
# 1 ms): 60 s makes it 1 ms, as these tests' timing needs. Its rewind is a replicated command.
KINDS = {"classic": RETAINED, "quorum": {"x-queue-type": "quorum", "x-retention-seconds": 60}}


def now_ms():
    return int(time.time() * 1000)


def rewind(broker, queue, to, status=200):
    r = requests.post(f"http://127.0.0.1:{broker.http_port}/api/queues/%2F/{queue}/rewind", json={"to": to}, auth=("guest", "guest"), timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def api_queue(broker, queue):
    return requests.get(f"http://127.0.0.1:{broker.http_port}/api/queues/%2F/{queue}", auth=("guest", "guest"), timeout=10).json()


def publish(ch, queue, ids):
    for i in ids:
        ch.basic_publish("", queue, b"m-%d" % i, pika.BasicProperties(delivery_mode=2))


def get_all(ch, queue, ack=True):
    """basic.get until empty: [(id, redelivered)]."""
    out = []
    while True:
        method, _, body = ch.basic_get(queue)
        if method is None:
            return out
        out.append((int(body.split(b"-")[1]), method.redelivered))
        if ack:
            ch.basic_ack(method.delivery_tag)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_consumed_messages_since_a_time_come_back_in_order_and_ready_or_unacked_ones_are_not_duplicated(broker, name, kind):
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(name, durable=True, arguments=KINDS[kind])
    ch.confirm_delivery()
    publish(ch, name, range(40))
    time.sleep(0.01)
    t40 = now_ms()
    time.sleep(0.01)
    publish(ch, name, range(40, 100))

    # 0..89 consumed; 90..94 unacked on another channel; 95..99 ready.
    got = []
    for _ in range(90):
        method, _, body = ch.basic_get(name)
        got.append(int(body.split(b"-")[1]))
        ch.basic_ack(method.delivery_tag)
    assert got == list(range(90))
    holder = broker.connection()
    hch = holder.channel()
    held = [hch.basic_get(name) for _ in range(5)]
    assert [int(b.split(b"-")[1]) for _, _, b in held] == list(range(90, 95))
    # The acks are counted once the store has applied them (after their fsync): not at once.
    eventually(lambda: api_queue(broker, name)["messages_retained"] == 90)

    answer = rewind(broker, name, t40)
    assert answer["rewound"] == 50, answer
    assert answer["to"] == t40 and not answer["clamped"]
    assert t40 <= answer["from"] <= now_ms()
    eventually(lambda: api_queue(broker, name)["messages_ready"] == 55)

    again = get_all(ch, name)
    assert [i for i, _ in again] == list(range(40, 90)) + list(range(95, 100)), "publish order, the unacked left out"
    assert all(r for i, r in again if i < 90), "rewound ones are redelivered"
    assert not any(r for i, r in again if i >= 95)
    # The unacked ones stayed with their consumer; released, they come back once.
    holder.close()
    assert get_all(ch, name) == [(i, True) for i in range(90, 95)]
    assert get_all(ch, name) == []
    # A second rewind to the same time: everything from 40 on again, nothing twice.
    assert rewind(broker, name, t40)["rewound"] == 60
    assert [i for i, _ in get_all(ch, name)] == list(range(40, 100))
    conn.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_rewind_survives_kill9_and_one_before_the_retention_is_clamped_to_the_oldest_kept(broker, name, kind):
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(name, durable=True, arguments=KINDS[kind])
    ch.confirm_delivery()
    before = now_ms()
    publish(ch, name, range(30))
    assert [i for i, _ in get_all(ch, name)] == list(range(30))
    answer = rewind(broker, name, 0)
    assert answer["rewound"] == 30 and answer["from"] >= before
    assert answer["clamped"], "1970 is before what the retention keeps"
    conn.close()
    broker.kill9()
    broker.start()
    conn = broker.connection()
    ch = conn.channel()
    assert ch.queue_declare(name, passive=True).method.message_count == 30, "the answered rewind survived kill -9"
    assert [i for i, _ in get_all(ch, name)] == list(range(30))
    assert get_all(ch, name) == []
    conn.close()


def test_refusals_say_why_and_change_nothing(broker, name):
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(name, durable=True)
    ch.queue_declare(f"{name}-q", durable=True, arguments={"x-queue-type": "quorum"})
    ch.queue_declare(f"{name}-r", durable=True, arguments=RETAINED)
    assert "x-retention-seconds" in rewind(broker, name, 0, status=400)["reason"]
    assert "x-retention-seconds" in rewind(broker, f"{name}-q", 0, status=400)["reason"]
    assert "point in time" in rewind(broker, f"{name}-r", "yesterday", status=400)["reason"]
    assert "unix milliseconds" in rewind(broker, f"{name}-r", -5, status=400)["reason"]
    r = requests.post(f"http://127.0.0.1:{broker.http_port}/api/queues/%2F/{name}-r/rewind", data="{}", auth=("guest", "guest"), timeout=10)
    assert r.status_code == 400 and '"to"' in r.json()["reason"]
    assert rewind(broker, "no-such-queue", 0, status=404)
    r = requests.post(f"http://127.0.0.1:{broker.http_port}/api/queues/%2F/{name}-r/rewind", json={"to": 0}, auth=("guest", "wrong"), timeout=10)
    assert r.status_code == 401
    # A string time works too; nothing was consumed, nothing comes back.
    assert rewind(broker, f"{name}-r", "-90m")["rewound"] == 0
    conn.close()


def test_warren_ctl_rewind_takes_the_three_forms_of_time(broker, name):
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(name, durable=True, arguments=RETAINED)
    ch.confirm_delivery()
    publish(ch, name, range(5))
    get_all(ch, name)

    def ctl(*args):
        return subprocess.run([binary_for({}), "ctl", "--url", f"http://127.0.0.1:{broker.http_port}", *args], capture_output=True, text=True, timeout=60)

    out = ctl("rewind", name, "--to", "-10m")
    assert out.returncode == 0, out.stderr
    assert f"queue rewound: {name}, 5 messages ready again from 20" in out.stdout, out.stdout
    assert len(get_all(ch, name)) == 5
    out = ctl("rewind", name, "--to", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 600)))
    assert out.returncode == 0 and ", 5 messages" in out.stdout, out.stdout + out.stderr
    assert len(get_all(ch, name)) == 5
    out = ctl("rewind", name, "--to", str(now_ms() + 60_000))
    assert out.returncode == 0 and "nothing kept from" in out.stdout, out.stdout + out.stderr
    out = ctl("rewind", name, "--to", "last tuesday")
    assert out.returncode != 0 and "not a point in time" in out.stderr
    conn.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_rewind_racing_publishers_and_consumers_brings_back_what_it_should_in_order(broker, name, kind):
    """A publisher with confirms and a consumer acking everything run while the queue is rewound to
    a point in their past: every message is delivered; those published after the point and acked
    before the rewind come again after it, in publish order; none published before it does."""
    setup = broker.connection()
    setup.channel().queue_declare(name, durable=True, arguments=KINDS[kind])
    setup.close()
    stop = threading.Event()
    published = {}  # id -> (start ms, confirmed ms)
    deliveries = []  # (id, redelivered, ms)
    errors = []

    def publisher():
        try:
            c = broker.connection()
            ch = c.channel()
            ch.confirm_delivery()
            i = 0
            while not stop.is_set():
                start = now_ms()
                ch.basic_publish("", name, b"m-%d" % i, pika.BasicProperties(delivery_mode=2))
                published[i] = (start, now_ms())
                i += 1
                time.sleep(0.002)
            c.close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def consumer():
        try:
            c = broker.connection()
            ch = c.channel()
            ch.basic_qos(prefetch_count=50)

            def on(ch, method, _props, body):
                deliveries.append((int(body.split(b"-")[1]), method.redelivered, now_ms()))
                ch.basic_ack(method.delivery_tag)

            ch.basic_consume(name, on)
            while not stop.is_set() or c.is_open and time.time() < drain_until[0]:
                c.process_data_events(time_limit=0.1)
            c.close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    drain_until = [float("inf")]
    threads = [threading.Thread(target=publisher), threading.Thread(target=consumer)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    point = now_ms()
    time.sleep(1.0)
    rewind_start = now_ms()
    answer = rewind(broker, name, point)
    rewind_end = now_ms()
    time.sleep(1.0)
    stop.set()
    drain_until[0] = time.time() + 3
    threads[0].join(30)
    eventually(lambda: len({i for i, _, _ in deliveries}) >= len(published), timeout=20)
    time.sleep(0.5)
    drain_until[0] = 0
    threads[1].join(30)
    assert not errors, errors

    seen = {}
    for i, _, at in deliveries:
        seen.setdefault(i, []).append(at)
    assert set(seen) == set(published), "every confirmed message delivered"
    before_point = [i for i, (_, confirmed) in published.items() if confirmed < point - 5]
    assert before_point and all(len(seen[i]) == 1 for i in before_point), "nothing published before the point comes again"
    # (Acked well before the rewind: an ack still on its way when the rewind is applied leaves the
    # message unacked then, so not rewound.)
    due = [i for i, (start, _) in published.items() if start >= point and seen[i][0] < rewind_start - 500]
    assert len(due) > 50, len(due)
    missing = [i for i in due if not any(at >= rewind_start for at in seen[i][1:])]
    assert not missing, f"consumed after the point and before the rewind, not delivered again: {missing[:20]}"
    assert answer["rewound"] >= len(due), (answer, len(due))
    again = [i for i, redelivered, at in deliveries if redelivered and at >= rewind_start]
    assert again == sorted(again), "rewound messages in publish order"
    late = [i for i, (start, _) in published.items() if start > rewind_end and len(seen[i]) > 1]
    assert not late, f"published after the rewind, delivered twice: {late[:20]}"


def test_a_rewound_message_past_its_ttl_is_neither_delivered_nor_dead_lettered_again(broker, name):
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(f"{name}-dlq", durable=True)
    ch.queue_declare(name, durable=True, arguments={**RETAINED, "x-message-ttl": 5000, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{name}-dlq"})
    ch.confirm_delivery()
    publish(ch, name, range(3))
    assert [i for i, _ in get_all(ch, name)] == [0, 1, 2]  # consumed in time
    publish(ch, name, [3])  # expires in the queue: dead-lettered once
    eventually(lambda: ch.queue_declare(f"{name}-dlq", passive=True).method.message_count == 1, timeout=20, interval=0.2)
    fresh_from = now_ms()
    time.sleep(0.01)
    publish(ch, name, range(4, 6))
    time.sleep(0.01)
    answer = rewind(broker, name, 0)
    assert answer["rewound"] == 4, answer  # 0..3 consumed or expired; 4, 5 still ready
    assert [i for i, _ in get_all(ch, name)] == [4, 5], "the expired ones are not delivered again"
    # Within their TTL (5 s) they do come back.
    assert rewind(broker, name, fresh_from)["rewound"] == 2
    assert [i for i, _ in get_all(ch, name)] == [4, 5]
    assert ch.queue_declare(f"{name}-dlq", passive=True).method.message_count == 1, "nor dead-lettered again"
    conn.close()


def test_a_priority_queue_rewinds_every_level_and_delivers_by_priority_then_order(broker, name):
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(name, durable=True, arguments={**RETAINED, "x-max-priority": 5})
    ch.confirm_delivery()
    for i in range(12):
        ch.basic_publish("", name, b"m-%d" % i, pika.BasicProperties(delivery_mode=2, priority=[0, 3, 5][i % 3]))
    first = [i for i, _ in get_all(ch, name)]
    assert first == [2, 5, 8, 11, 1, 4, 7, 10, 0, 3, 6, 9]
    answer = rewind(broker, name, 0)
    assert answer["rewound"] == 12, answer
    again = get_all(ch, name)
    assert [i for i, _ in again] == first, "each level in publish order, the highest first"
    assert all(r for _, r in again)
    conn.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_rewound_messages_purged_stay_purged_after_kill9_and_concurrent_rewinds_duplicate_nothing(broker, name, kind):
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(name, durable=True, arguments=KINDS[kind])
    ch.confirm_delivery()
    publish(ch, name, range(40))
    assert len(get_all(ch, name)) == 40
    # Four rewinds at once: one at a time on the broker, the later ones find nothing consumed.
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(rewind(broker, name, 0))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(a["rewound"] for a in answers) == [0, 0, 0, 40], answers
    assert ch.queue_declare(name, passive=True).method.message_count == 40
    # Purged before any was read back: gone for good, also after kill -9.
    assert ch.queue_purge(name).method.message_count == 40
    conn.close()
    broker.kill9()
    broker.start()
    conn = broker.connection()
    ch = conn.channel()
    assert ch.queue_declare(name, passive=True).method.message_count == 0
    assert get_all(ch, name) == []
    # Still retained: a rewind brings them back once more.
    assert rewind(broker, name, 0)["rewound"] == 40
    assert [i for i, _ in get_all(ch, name)] == list(range(40))
    conn.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_rewind_past_x_max_length_drops_the_oldest_the_rewound_ones(broker, name, kind):
    """Drop-head over x-max-length drops from the head, which after a rewind is the rewound
    messages (older than the ready ones), dead-lettered with reason maxlen; the ready ones stay."""
    conn = broker.connection()
    ch = conn.channel()
    ch.queue_declare(f"{name}-dlq", durable=True)
    ch.queue_declare(name, durable=True, arguments={**KINDS[kind], "x-max-length": 10, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{name}-dlq"})
    ch.confirm_delivery()
    publish(ch, name, range(10))
    assert len(get_all(ch, name)) == 10
    publish(ch, name, range(10, 20))
    assert rewind(broker, name, 0)["rewound"] == 10
    eventually(lambda: ch.queue_declare(f"{name}-dlq", passive=True).method.message_count == 10, timeout=10)
    assert ch.queue_declare(name, passive=True).method.message_count == 10
    assert [i for i, _ in get_all(ch, name)] == list(range(10, 20)), "the ready ones stayed"
    assert [i for i, _ in get_all(ch, f"{name}-dlq")] == list(range(10)), "the rewound ones, oldest, were dropped"
    conn.close()
