"""CMQ's HTTP API (2.0) with Tencent's own SDK (`qcloud-cmq-sdk-py3`, module `cmq`), unchanged,
pointed at Warren's HTTP port. Every test counts what it sent and checks it arrived once: through
CMQ, and through AMQP (pika) on the same queues, both ways; on a three-node cluster with a quorum
queue too. Signatures, receipt handles and bad input are attacked directly with `requests`."""

import base64
import hashlib
import hmac
import random
import threading
import time

import pika
import pytest
import requests

from conftest import eventually, three_node_cluster

cmq_account = pytest.importorskip("cmq.account", reason="the CMQ SDK (pip install qcloud-cmq-sdk-py3)")
from cmq.cmq_exception import CMQServerException  # noqa: E402
from cmq.queue import Message, QueueMeta  # noqa: E402
from cmq.subscription import SubscriptionMeta  # noqa: E402
from cmq.topic import TopicMeta  # noqa: E402

pytestmark = pytest.mark.warren_only


def account(broker, secret_id="guest", secret_key="guest", method="POST", sign="sha1"):
    a = cmq_account.Account(f"http://127.0.0.1:{broker.http_port}", secret_id, secret_key)
    a.cmq_client.set_method(method)
    a.cmq_client.set_sign_method(sign)
    return a


def create_queue(acct, name, **attrs):
    meta = QueueMeta()
    for k, v in attrs.items():
        setattr(meta, k, v)
    q = acct.get_queue(name)
    q.create(meta)
    return q


def error_code(f):
    with pytest.raises(CMQServerException) as e:
        f()
    return e.value.code


def signed(host, params, secret="guest", method="POST", sign=True):
    """A CMQ request's parameters with the common ones, signed as the SDK signs them (or not)."""
    p = {"SecretId": "guest", "Nonce": str(random.randint(1, 1 << 30)), "Timestamp": str(int(time.time())), "SignatureMethod": "HmacSHA1", **params}
    if sign:
        text = method + host + "/v2/index.php?" + "&".join(f"{k.replace('_', '.')}={p[k]}" for k in sorted(p))
        p["Signature"] = base64.b64encode(hmac.new(secret.encode(), text.encode(), hashlib.sha1).digest()).decode()
    return p


def raw(broker, params, secret="guest", method="POST", host=None, sign=True):
    """A CMQ request signed as the SDK signs it (or not, `sign=False`), sent with `requests`."""
    host = host or f"127.0.0.1:{broker.http_port}"
    p = signed(host, params, secret, method, sign)
    url = f"http://{host}/v2/index.php"
    r = requests.post(url, data=p, timeout=40) if method == "POST" else requests.get(url, params=p, timeout=40)
    assert r.status_code == 200, r.text
    return r.json()


def take(q, wait):
    """One BatchReceiveMessage of up to 16, deleted at once; [] when the answer is 7000 (none)."""
    try:
        msgs = q.batch_receive_message(16, polling_wait_seconds=wait)
    except CMQServerException as e:
        assert e.code == 7000
        return []
    q.batch_delete_message([m.receiptHandle for m in msgs])
    return msgs


def amqp(broker):
    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
    return conn, conn.channel()


def test_queue_lifecycle_and_every_message_once_through_the_sdk(broker):
    acct = account(broker)
    q = create_queue(acct, "orders", visibilityTimeout=30, maxMsgSize=65536)
    assert error_code(lambda: create_queue(acct, "orders")) == 4460
    total, listed, _ = acct.list_queue(searchWord="ord")
    assert total == 1 and listed[0]["queueName"] == "orders"
    meta = q.get_attributes()
    assert (meta.visibilityTimeout, meta.maxMsgSize, meta.activeMsgNum) == (30, 65536, 0)

    sent = [f"single-{i}" for i in range(10)]
    for body in sent:
        assert q.send_message(Message(body)).msgId
    batches = [[f"batch-{b}-{i}" for i in range(16)] for b in range(5)]
    for batch in batches:
        ids = [m.msgId for m in q.batch_send_message([Message(x) for x in batch])]
        assert len(ids) == 16 and len(set(ids)) == 16
        sent += batch
    assert q.get_attributes().activeMsgNum == len(sent)

    got = []
    while msgs := take(q, 0):
        got += [m.msgBody for m in msgs]
        assert all(m.dequeueCount == 1 for m in msgs)
    assert sorted(got) == sorted(sent), "every message received exactly once"
    assert got[:10] == sent[:10], "in the order sent"
    meta = q.get_attributes()
    assert (meta.activeMsgNum, meta.inactiveMsgNum) == (0, 0)

    q.send_message(Message("last"))
    m = q.receive_message(polling_wait_seconds=0)
    assert m.msgBody == "last" and m.receiptHandle
    assert q.get_attributes().inactiveMsgNum == 1
    q.delete_message(m.receiptHandle)
    assert error_code(lambda: q.delete_message(m.receiptHandle)) == 4430, "a handle deletes once"
    q.delete()
    assert error_code(lambda: q.get_attributes()) == 4440
    assert acct.list_queue()[0] == 0


def test_messages_cross_between_cmq_and_amqp_both_ways(broker):
    acct = account(broker)
    q = create_queue(acct, "bridge")
    conn, ch = amqp(broker)
    try:
        for i in range(20):
            q.send_message(Message(f"to-amqp-{i}"))
        bodies = []
        for _ in range(20):
            method, props, body = ch.basic_get("bridge", auto_ack=True)
            assert method is not None
            assert props.delivery_mode == 2 and props.message_id, "persistent, with its CMQ msgId"
            bodies.append(body.decode())
        assert bodies == [f"to-amqp-{i}" for i in range(20)]
        assert ch.basic_get("bridge")[0] is None

        ch.confirm_delivery()
        for i in range(20):
            ch.basic_publish("", "bridge", f"to-cmq-{i}".encode(), pika.BasicProperties(message_id=f"amqp-{i}", delivery_mode=2))
        got = []
        while len(got) < 20:
            msgs = q.batch_receive_message(16, polling_wait_seconds=1)
            got += [(m.msgBody, m.msgId) for m in msgs]
            q.batch_delete_message([m.receiptHandle for m in msgs])
        assert got == [(f"to-cmq-{i}", f"amqp-{i}") for i in range(20)]
        assert error_code(lambda: q.receive_message(polling_wait_seconds=0)) == 7000
    finally:
        conn.close()


def test_an_undeleted_message_comes_back_after_its_visibility_timeout_and_stale_handles_fail(broker):
    acct = account(broker)
    # 3 s: long enough that the check right after the receive cannot race the deadline on a
    # loaded machine.
    q = create_queue(acct, "vis", visibilityTimeout=3)
    q.send_message(Message("m"))
    first = q.receive_message(polling_wait_seconds=0)
    assert first.dequeueCount == 1
    assert first.nextVisibleTime >= int(time.time())
    assert error_code(lambda: q.receive_message(polling_wait_seconds=0)) == 7000, "invisible while leased"
    again = q.receive_message(polling_wait_seconds=10)
    assert again.msgBody == "m" and again.msgId == first.msgId
    assert again.dequeueCount == 2
    assert again.receiptHandle != first.receiptHandle
    assert error_code(lambda: q.delete_message(first.receiptHandle)) == 4430, "the first lease's handle is stale"
    q.delete_message(again.receiptHandle)
    assert error_code(lambda: q.receive_message(polling_wait_seconds=1)) == 7000
    assert q.get_attributes().activeMsgNum == 0


def test_long_polling_answers_as_soon_as_a_message_arrives(broker):
    acct = account(broker)
    q = create_queue(acct, "poll")
    started = time.monotonic()
    assert error_code(lambda: q.receive_message(polling_wait_seconds=1)) == 7000
    assert time.monotonic() - started >= 0.9, "an empty receive waits out its pollingWaitSeconds"

    def publish_later():
        time.sleep(1.0)
        conn, ch = amqp(broker)
        ch.basic_publish("", "poll", b"late")
        conn.close()

    t = threading.Thread(target=publish_later)
    started = time.monotonic()
    t.start()
    m = q.receive_message(polling_wait_seconds=20)
    waited = time.monotonic() - started
    t.join()
    assert m.msgBody == "late"
    assert waited < 10, f"answered {waited:.1f} s after it was asked, not when the message arrived"
    q.delete_message(m.receiptHandle)
    assert q.get_attributes().inactiveMsgNum == 0 and q.get_attributes().activeMsgNum == 0


def test_concurrent_senders_and_receivers_see_every_message_once(broker):
    acct = account(broker)
    create_queue(acct, "busy")
    per_sender, senders, receivers = 200, 3, 3
    received, errors = [], []
    lock = threading.Lock()
    done_sending = threading.Event()

    def send(n):
        try:
            q = account(broker).get_queue("busy")
            for i in range(0, per_sender, 8):
                q.batch_send_message([Message(f"{n}-{j}") for j in range(i, i + 8)])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def receive():
        try:
            q = account(broker).get_queue("busy")
            while True:
                msgs = take(q, 1)
                if not msgs and done_sending.is_set():
                    return
                with lock:
                    received.extend(m.msgBody for m in msgs)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    rs = [threading.Thread(target=receive) for _ in range(receivers)]
    ss = [threading.Thread(target=send, args=(n,)) for n in range(senders)]
    for t in rs + ss:
        t.start()
    for t in ss:
        t.join()
    done_sending.set()
    for t in rs:
        t.join()
    assert not errors, errors
    expected = [f"{n}-{j}" for n in range(senders) for j in range(per_sender)]
    assert sorted(received) == sorted(expected), f"{len(received)} received of {len(expected)}, {len(received) - len(set(received))} twice"


def test_signatures_are_checked_and_a_refused_request_changes_nothing(broker):
    assert raw(broker, {"Action": "CreateQueue", "queueName": "signed"})["code"] == 0
    refused = [
        raw(broker, {"Action": "CreateQueue", "queueName": "forged"}, secret="wrong"),
        raw(broker, {"Action": "CreateQueue", "queueName": "forged", "SecretId": "nobody"}),
        raw(broker, {"Action": "CreateQueue", "queueName": "forged", "Timestamp": str(int(time.time()) - 3600)}),
        raw(broker, {"Action": "CreateQueue", "queueName": "forged"}, sign=False),
    ]
    for r in refused:
        assert r["code"] in (4100, 4000), r
    assert refused[0]["code"] == refused[1]["code"] == refused[2]["code"] == 4100
    assert "Timestamp" in refused[2]["message"]
    # A signature over other parameters does not carry to these.
    host = f"127.0.0.1:{broker.http_port}"
    good = signed(host, {"Action": "SendMessage", "queueName": "signed", "msgBody": "a"})
    tampered = dict(good, msgBody="b")
    r = requests.post(f"http://{host}/v2/index.php", data=tampered, timeout=10).json()
    assert r["code"] == 4100, r
    assert requests.post(f"http://{host}/v2/index.php", data=good, timeout=10).json()["code"] == 0
    # The same request again (a captured one, replayed within its Timestamp's 300 s): refused.
    replayed = requests.post(f"http://{host}/v2/index.php", data=good, timeout=10).json()
    assert replayed["code"] == 4100 and "new Nonce" in replayed["message"], replayed
    acct = account(broker)
    assert [q["queueName"] for q in acct.list_queue()[1]] == ["signed"], "the refused creates made nothing"
    assert acct.get_queue("signed").get_attributes().activeMsgNum == 1, "the tampered and the replayed sends sent nothing"
    # HmacSHA256 and GET, as the SDK offers them.
    for method, sign in [("GET", "sha1"), ("POST", "sha256"), ("GET", "sha256")]:
        a = account(broker, method=method, sign=sign)
        a.get_queue("signed").send_message(Message(f"{method}-{sign}"))
    assert acct.get_queue("signed").get_attributes().activeMsgNum == 4
    assert error_code(lambda: account(broker, secret_key="nope").list_queue()) == 4100


def test_forged_or_foreign_receipt_handles_delete_nothing(broker):
    acct = account(broker)
    a, b = create_queue(acct, "qa"), create_queue(acct, "qb")
    a.send_message(Message("x"))
    b.send_message(Message("y"))
    ma, mb = a.receive_message(polling_wait_seconds=0), b.receive_message(polling_wait_seconds=0)
    lease, tag, mac = ma.receiptHandle.split("-")
    forged = [f"{lease}-{int(tag) + 1}-{mac}", f"{lease}-{tag}-{'0' * len(mac)}", "garbage", "", "1-2", mb.receiptHandle]
    for h in forged:
        assert error_code(lambda: a.delete_message(h)) in (4430, 4000), h
    with pytest.raises(CMQServerException) as e:
        a.batch_delete_message(forged[:3] + [ma.receiptHandle])
    assert e.value.code == 6010 and len(e.value.data["errorList"]) == 3
    assert a.get_attributes().inactiveMsgNum == 0, "the one real handle in the batch deleted its message"
    assert b.get_attributes().inactiveMsgNum == 1, "b's message is still leased, not deleted through a"
    b.delete_message(mb.receiptHandle)


def test_bad_input_gets_cmq_codes_and_changes_nothing(broker):
    acct = account(broker)
    q = create_queue(acct, "strict", maxMsgSize=1024)
    assert raw(broker, {"Action": "NoSuchAction"})["code"] == 4000
    for stamp in ["-9223372036854775808", "9223372036854775807", "1e9", ""]:
        assert raw(broker, {"Action": "ListQueue", "Timestamp": stamp})["code"] in (4000, 4100), stamp
    assert raw(broker, {"Action": "SendMessage", "queueName": "strict", "msgBody": "x" * 2000})["code"] == 4400
    many = {f"msgBody.{i}": "m" for i in range(1, 18)}
    assert raw(broker, {"Action": "BatchSendMessage", "queueName": "strict", **many})["code"] == 4000
    assert raw(broker, {"Action": "BatchReceiveMessage", "queueName": "strict", "numOfMsg": "1000"})["code"] == 4000
    assert raw(broker, {"Action": "ReceiveMessage", "queueName": "strict", "pollingWaitSeconds": "99"})["code"] == 4000
    assert raw(broker, {"Action": "SendMessage", "queueName": "nope", "msgBody": "x"})["code"] == 4440
    assert raw(broker, {"Action": "CreateQueue", "queueName": "bad name!"})["code"] == 4000
    assert raw(broker, {"Action": "CreateQueue", "queueName": "x", "visibilityTimeout": "-1"})["code"] == 4000
    for delay in ["-1", "3888001", "soon"]:
        assert raw(broker, {"Action": "SendMessage", "queueName": "strict", "msgBody": "x", "delaySeconds": delay})["code"] == 4000
    r = requests.post(f"http://127.0.0.1:{broker.http_port}/v2/index.php", data=b"\xff\xfe%%%&&&=", timeout=10)
    assert r.status_code == 200 and r.json()["code"] in (4000, 4100)
    assert q.get_attributes().activeMsgNum == 0
    assert [x["queueName"] for x in acct.list_queue()[1]] == ["strict"]
    # Attributes are fixed once declared: the same ones are fine, others refused with the reason.
    meta = q.get_attributes()
    q.set_attributes(meta)
    meta.visibilityTimeout = 99
    assert error_code(lambda: q.set_attributes(meta)) == 4000


def test_delay_seconds_holds_messages_until_due_through_the_sdk_and_kill9(broker):
    acct = account(broker)
    q = create_queue(acct, "later", pollingWaitSeconds=0)
    sent_at = time.time()
    q.send_message(Message("single"), delayTime=3)
    q.batch_send_message([Message(f"batch-{i}") for i in range(16)], delayTime=2)
    q.send_message(Message("now"))
    meta = q.get_attributes()
    if time.time() < sent_at + 1.5:  # (a loaded machine may take that long to get here)
        assert (meta.activeMsgNum, meta.delayMsgNum) == (1, 17)
    first = [(m.msgBody, time.time()) for m in take(q, 0)]
    assert "now" in [b for b, _ in first]
    # (Any other was due already: a loaded machine took that long to get here.)
    got = [(b, at) for b, at in first if b != "now"]
    # Still held after kill -9, and counted again after the restart.
    broker.kill9()
    broker.start()
    eventually(lambda: q.get_attributes().delayMsgNum + q.get_attributes().activeMsgNum == 17 - len(got), timeout=10)
    deadline = time.time() + 15
    while len(got) < 17 and time.time() < deadline:
        for m in take(q, 1):
            got.append((m.msgBody, time.time()))
    assert sorted(b for b, _ in got) == sorted(["single"] + [f"batch-{i}" for i in range(16)])
    assert all(at >= sent_at + 2 for b, at in got if b.startswith("batch"))
    assert [at >= sent_at + 3 for b, at in got if b == "single"] == [True]
    assert q.get_attributes().delayMsgNum == 0


def test_a_full_queue_refuses_sends(broker):
    acct = account(broker)
    q = create_queue(acct, "small", maxMsgHeapNum=3)
    for i in range(3):
        q.send_message(Message(str(i)))
    assert error_code(lambda: q.send_message(Message("over"))) == 4410
    assert q.get_attributes().activeMsgNum == 3


def test_topics_route_by_tag_and_by_routing_key_and_amqp_can_subscribe(broker):
    acct = account(broker)
    for name in ["all", "red", "blue", "eu", "any"]:
        create_queue(acct, name)
    tags = acct.get_topic("colours")
    tm = TopicMeta()
    tm.filterType = 1
    tags.create(tm)

    def subscribe(topic, name, queue, tags=(), keys=()):
        sm = SubscriptionMeta()
        sm.Endpoint, sm.Protocal = queue, "queue"
        sm.FilterTag, sm.bindingKey = list(tags), list(keys)
        acct.get_subscription(topic, name).create(sm)

    subscribe("colours", "s-all", "all")
    subscribe("colours", "s-red", "red", tags=["red"])
    subscribe("colours", "s-blue", "blue", tags=["blue", "navy"])
    assert error_code(lambda: subscribe("colours", "s-red", "red", tags=["red"])) == 4460
    tags.publish_message(Message("r1", ["red"]))
    tags.publish_message(Message("b1", ["navy"]))
    tags.publish_message(Message("rb", ["red", "blue"]))
    tags.publish_message(Message("none"))
    tags.batch_publish_message([Message("r2"), Message("r3")], msgtag=["red"])

    keys = acct.get_topic("regions")
    tm = TopicMeta()
    tm.filterType = 2
    keys.create(tm)
    subscribe("regions", "s-eu", "eu", keys=["eu.*"])
    subscribe("regions", "s-any", "any")
    # An AMQP client binds its own queue to the topic too.
    conn, ch = amqp(broker)
    ch.queue_declare("amqp-side")
    ch.queue_bind("amqp-side", "regions", "*.paris")
    keys.publish_message(Message("p"), routingKey="eu.paris")
    keys.publish_message(Message("b"), routingKey="eu.berlin")
    keys.publish_message(Message("n"), routingKey="us.ny")

    def drain(name):
        q, out = acct.get_queue(name), []
        while msgs := take(q, 0):
            out += [m.msgBody for m in msgs]
        return sorted(out)

    assert drain("all") == sorted(["r1", "b1", "rb", "none", "r2", "r3"])
    assert drain("red") == sorted(["r1", "rb", "r2", "r3"])
    assert drain("blue") == sorted(["b1", "rb"])
    assert drain("eu") == sorted(["p", "b"])
    assert drain("any") == sorted(["p", "b", "n"])
    assert ch.basic_get("amqp-side", auto_ack=True)[2] == b"p" and ch.basic_get("amqp-side")[0] is None
    conn.close()

    total, subs, _ = acct.get_topic("colours").list_subscription()
    assert total == 3 and sorted(s["endpoint"] for s in subs) == ["all", "blue", "red"]
    attrs = acct.get_subscription("colours", "s-blue").get_attributes()
    assert sorted(attrs.FilterTag) == ["blue", "navy"]
    assert acct.get_subscription("regions", "s-eu").get_attributes().bindingKey == ["eu.*"]
    acct.get_subscription("colours", "s-red").delete()
    tags.publish_message(Message("r4", ["red"]))
    assert drain("red") == [] and drain("all") == ["r4"]
    assert acct.get_topic("colours").get_attributes().filterType == 1
    assert sorted(t["topicName"] for t in acct.list_topic()[1]) == ["colours", "regions"]
    acct.get_topic("colours").delete()
    assert error_code(lambda: acct.get_topic("colours").publish_message(Message("x"))) == 4440


@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_dequeue_count_counts_every_return_to_the_queue(broker, kind):
    """dequeueCount is one more than the times the message came back unacknowledged: leases that
    ended and AMQP nacks with requeue alike (a classic queue's stopped at 2)."""
    assert raw(broker, {"Action": "CreateQueue", "queueName": "retried", "queueType": kind, "visibilityTimeout": "1"})["code"] == 0
    q = account(broker).get_queue("retried")
    q.send_message(Message("poison"))
    counts = []
    for _ in range(3):
        m = q.receive_message(polling_wait_seconds=5)  # not deleted: back when its lease ends
        counts.append(m.dequeueCount)
    conn, ch = amqp(broker)
    for _ in range(2):
        method = None
        deadline = time.time() + 5
        while method is None and time.time() < deadline:
            method, _, body = ch.basic_get("retried")
        assert body == b"poison"
        ch.basic_nack(method.delivery_tag, requeue=True)
    conn.close()
    m = q.receive_message(polling_wait_seconds=5)
    counts.append(m.dequeueCount)
    q.delete_message(m.receiptHandle)
    assert counts == [1, 2, 3, 6]


@pytest.mark.needs_process
def test_received_messages_are_kept_for_rewind_seconds_across_checkpoints_and_kill9(broker):
    """rewindSeconds keeps what was received and deleted (rewindmsgNum, the management API's
    messages_retained, a Prometheus gauge), past the checkpoint after which the WAL that held them
    goes (before: kept only until then) and a kill -9; it lets them go once the time has passed,
    on a broker that meanwhile does nothing else. A queue without it keeps nothing."""
    acct = account(broker)
    kept = create_queue(acct, "kept", rewindSeconds=3600)
    brief = create_queue(acct, "brief", rewindSeconds=3)
    plain = create_queue(acct, "plain")
    for q in (kept, brief, plain):
        for b in range(4):
            q.batch_send_message([Message(f"m-{b}-{i}") for i in range(16)])
        got = []
        while msgs := take(q, 0):
            got += msgs
        assert len(got) == 64
    retained = lambda q: q.get_attributes().rewindmsgNum  # noqa: E731
    assert (retained(kept), retained(brief), retained(plain)) == (64, 64, 0)
    api = requests.get(f"http://127.0.0.1:{broker.http_port}/api/queues/%2F/kept", auth=("guest", "guest"), timeout=10).json()
    assert (api["messages_retained"], api["messages"]) == (64, 0)
    assert "messages_retained" not in requests.get(f"http://127.0.0.1:{broker.http_port}/api/queues/%2F/plain", auth=("guest", "guest"), timeout=10).json()
    metrics = requests.get(f"http://127.0.0.1:{broker.prometheus_port}/metrics/per-object", timeout=10).text
    assert 'warren_queue_messages_retained{vhost="/",queue="kept"} 64' in metrics, metrics

    time.sleep(2.5)  # a quiet second: the checkpoint writes the store's tail out, the WAL before it goes
    assert retained(kept) == 64
    broker.kill9()
    broker.start()
    acct = account(broker)  # the SDK's kept-alive connection died with the broker
    kept, brief = acct.get_queue("kept"), acct.get_queue("brief")
    assert retained(kept) == 64, "kept across kill -9"
    # Three seconds after they were sent, plus the quiet store's wait between checkpoints (10 s).
    eventually(lambda: retained(brief) == 0, timeout=30, interval=0.5)
    assert retained(kept) == 64


@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_rewind_queue_with_the_sdk_receives_deleted_messages_again(broker, kind):
    """RewindQueue (the SDK's rewindQueue, unix seconds): what was received and deleted since then
    is received again, in order; what was sent before is not; a queue without rewindSeconds says
    why. A quorum queue (Warren's own queueType) rewinds alike."""
    acct = account(broker)
    if kind == "classic":
        q = create_queue(acct, "rewound", rewindSeconds=3600)
    else:
        # queueType is Warren's own parameter: the SDK's QueueMeta cannot send it.
        assert raw(broker, {"Action": "CreateQueue", "queueName": "rewound", "queueType": "quorum", "rewindSeconds": "3600"})["code"] == 0
        q = acct.get_queue("rewound")
    q.batch_send_message([Message(f"old-{i}") for i in range(5)])
    time.sleep(1.1)
    since = int(time.time())
    time.sleep(0.01)
    for b in range(2):
        q.batch_send_message([Message(f"new-{b}-{i}") for i in range(16)])
    got = []
    while msgs := take(q, 0):
        got += [m.msgBody for m in msgs]
    assert len(got) == 37
    q.rewindQueue(since)
    answer = raw(broker, {"Action": "RewindQueue", "queueName": "rewound", "startConsumeTime": str(since)})
    assert (answer["code"], answer["rewoundMsgNum"]) == (0, 0), "the first rewind made them ready: nothing consumed since"
    assert q.get_attributes().activeMsgNum == 32
    again = []
    while msgs := take(q, 0):
        again += [m.msgBody for m in msgs]
    assert again == [f"new-{b}-{i}" for b in range(2) for i in range(16)]
    plain = create_queue(acct, "unkept")
    assert error_code(lambda: plain.rewindQueue(since)) == 4000


@pytest.fixture
def cluster(tmp_path):
    yield from three_node_cluster(tmp_path, "cmq-test-secret-0123456789")


def test_a_quorum_queue_through_any_node_of_a_cluster(cluster):
    """Sent through one node, received and deleted through the others; each message once, and a
    lease's timeout on a follower redelivers with dequeueCount 2."""
    accts = {i: account(b) for i, b in cluster.items()}

    # queueType is Warren's own parameter: the SDK's QueueMeta cannot send it.
    eventually(lambda: raw(cluster[1], {"Action": "CreateQueue", "queueName": "replicated", "queueType": "quorum", "visibilityTimeout": "2"})["code"] == 0, timeout=30)
    # (A declaration waits for every node it reaches; one a moment from joining learns it after.)
    eventually(lambda: raw(cluster[2], {"Action": "GetQueueAttributes", "queueName": "replicated"}).get("queueType") == "quorum", timeout=10)
    sent = []
    for i, acct in accts.items():
        q = acct.get_queue("replicated")
        for b in range(3):
            batch = [f"n{i}-{b}-{j}" for j in range(16)]
            q.batch_send_message([Message(x) for x in batch])
            sent += batch
    got = []
    for i in [3, 2, 1] * 20:
        if len(got) == len(sent):
            break
        got += [m.msgBody for m in take(accts[i].get_queue("replicated"), 1)]
    assert sorted(got) == sorted(sent)

    q2, q3 = accts[2].get_queue("replicated"), accts[3].get_queue("replicated")
    q2.send_message(Message("lease"))
    first = q3.receive_message(polling_wait_seconds=5)
    again = q2.receive_message(polling_wait_seconds=10)
    assert (again.msgBody, again.dequeueCount) == ("lease", 2)
    assert error_code(lambda: q3.delete_message(first.receiptHandle)) == 4430
    q2.delete_message(again.receiptHandle)
    assert error_code(lambda: q3.receive_message(polling_wait_seconds=1)) == 7000


@pytest.mark.needs_process
@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_a_power_cut_keeps_every_message_a_send_answered(tmp_path, monkeypatch, kind):
    """SendMessage answers once the message is durable: with the power-loss simulator (what no fsync
    covered is dropped at the cut), every batch answered with code 0 is there after the restart."""
    from conftest import Broker
    from test_power_cut import drain, power_cut

    monkeypatch.setenv("WARREN_TEST_SIMULATED_DISK", "1")
    monkeypatch.setenv("WARREN_TEST_FSYNC_DELAY_MS", "3")
    broker = Broker(tmp_path / "data", tmp_path / "warren.log")
    broker.start()
    # What CMQ's create made (the SDK always sends msgRetentionSeconds: x-message-ttl): AMQP's
    # declare must say the same.
    arguments = {"x-queue-type": kind, "x-message-ttl": 345600 * 1000}
    try:
        # queueType is Warren's own parameter: the SDK's QueueMeta cannot send it.
        assert raw(broker, {"Action": "CreateQueue", "queueName": "cut", "queueType": kind})["code"] == 0
        rng = random.Random(20261128)
        answered_total = 0
        for round_ in range(3):
            answered, stop = [], threading.Event()

            def send(sender):
                q = account(broker).get_queue("cut")
                n = 0
                while not stop.is_set():
                    batch = [f"{round_}-{sender}-{n + j}" for j in range(16)]
                    try:
                        q.batch_send_message([Message(b) for b in batch])
                    except Exception:  # noqa: BLE001  (the power went off mid-request)
                        return
                    answered.extend(batch)
                    n += 16

            senders = [threading.Thread(target=send, args=(s,), daemon=True) for s in range(3)]
            for t in senders:
                t.start()
            eventually(lambda: len(answered) >= 64, timeout=20)
            time.sleep(rng.uniform(0.05, 0.5))
            power_cut(broker)
            stop.set()
            for t in senders:
                t.join(10)
            broker.start()
            back = {b.decode() for b in drain(broker, "cut", arguments)}
            lost = [m for m in answered if m not in back]
            assert not lost, f"round {round_}: {len(lost)} of {len(answered)} answered messages lost: {lost[:10]}"
            answered_total += len(answered)
        print(f"{kind}: 3 power cuts, {answered_total} answered messages all back")
    finally:
        if broker.alive():
            broker.proc.kill()
            broker.proc.wait(10)


def test_a_client_gone_during_a_long_poll_leaves_no_consumer_behind(broker):
    """A receive whose client hangs up while it waits must not leave its consumer on the queue
    (which would take the next message into a lease nobody can see or delete)."""
    import socket
    import urllib.parse

    acct = account(broker)
    q = create_queue(acct, "hangup")
    host = f"127.0.0.1:{broker.http_port}"
    body = urllib.parse.urlencode(signed(host, {"Action": "ReceiveMessage", "queueName": "hangup", "pollingWaitSeconds": "20"})).encode()
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", broker.http_port))
        s.sendall(b"POST /v2/index.php HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)
        s.close()
    time.sleep(0.5)
    conn, ch = amqp(broker)
    for i in range(3):
        ch.basic_publish("", "hangup", f"after-{i}".encode())
    conn.close()
    got = []
    for _ in range(3):
        m = q.receive_message(polling_wait_seconds=5)
        got.append(m.msgBody)
        q.delete_message(m.receiptHandle)
    assert sorted(got) == ["after-0", "after-1", "after-2"]


def test_a_users_permissions_decide_its_cmq_actions(broker, name):
    """A signing key per user (Warren's PUT /api/users/{u}/signing-keys/{id}); each action is
    checked as the AMQP operations it is made of: sends write the default exchange, receives read
    the queue, creating a queue configures it."""
    admin = ("guest", "guest")
    api = f"http://127.0.0.1:{broker.http_port}/api"
    assert requests.put(f"{api}/users/{name}", json={"password": "pw", "tags": ""}, auth=admin).status_code == 201
    # May configure and read queues starting with its name, write nowhere.
    perm = {"configure": f"^{name}", "write": "^$", "read": f"^{name}"}
    assert requests.put(f"{api}/permissions/%2F/{name}", json=perm, auth=admin).status_code == 201
    key = requests.put(f"{api}/users/{name}/signing-keys/{name}-id", auth=admin).json()
    assert key["secret_id"] == f"{name}-id" and len(key["secret_key"]) == 32
    taken = requests.put(f"{api}/users/{name}/signing-keys/guest", auth=admin)
    assert taken.status_code == 400 and "signs for user 'guest'" in taken.json()["reason"]
    acct = account(broker, key["secret_id"], key["secret_key"])
    create_queue(acct, f"{name}-q")
    with pytest.raises(CMQServerException) as refused:
        create_queue(acct, "not-mine")
    assert refused.value.code == 4100 and "access to queue 'not-mine'" in refused.value.message
    q = acct.get_queue(f"{name}-q")
    with pytest.raises(CMQServerException) as refused:
        q.send_message(Message("hello"))
    assert refused.value.code == 4100 and "exchange 'amq.default'" in refused.value.message and "write" in refused.value.message
    # Sent by guest, received by the user (read on its queue).
    account(broker).get_queue(f"{name}-q").send_message(Message("from guest"))
    got = q.receive_message(1)
    assert got.msgBody == "from guest"
    q.delete_message(got.receiptHandle)
    # The wrong key is refused as any bad signature.
    assert error_code(lambda: account(broker, key["secret_id"], "wrong").get_queue(f"{name}-q").get_attributes()) == 4100
