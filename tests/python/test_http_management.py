"""The management HTTP API (RabbitMQ's) and the Prometheus metrics, with real clients: `requests`,
Debian's `rabbitmqadmin`, pika for the AMQP side, `promtool` and a real Prometheus server.

Every test counts what it sent and checks it through the other protocol: a message published over
HTTP is consumed over AMQP, queue counts move with AMQP traffic, a connection closed over HTTP is
closed for its AMQP client."""

import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse

import pika
import pytest
import requests

from conftest import Broker, eventually, free_port, three_node_cluster

pytestmark = pytest.mark.warren_only

AUTH = ("guest", "guest")


def api(broker, path):
    return f"http://127.0.0.1:{broker.http_port}/api{path}"


def q(name):
    return urllib.parse.quote(name, safe="")


def drain(ch, queue):
    """Every body basic.get finds in the queue, in order (auto-ack)."""
    bodies = []
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return bodies
        bodies.append(body)


def admin(broker, *args, check=True):
    """Runs Debian's rabbitmqadmin against the broker; returns its stdout."""
    if not shutil.which("rabbitmqadmin"):
        pytest.skip("rabbitmqadmin is not installed (Debian's rabbitmq-server package ships it)")
    out = subprocess.run(["rabbitmqadmin", "-H", "127.0.0.1", "-P", str(broker.http_port), "-u", "guest", "-p", "guest", *args],
                         capture_output=True, text=True, timeout=30)
    if check:
        assert out.returncode == 0, out.stderr + out.stdout
    return out


def broker_with_config(tmp_path, text):
    """A broker started with a configuration file holding `text`; returns it and the file."""
    config = tmp_path / "warren.toml"
    config.write_text(text)
    b = Broker(tmp_path / "data", tmp_path / "warren.log")
    b.extra_args = ["--config", str(config)]
    b.start()
    return b, config


def test_every_api_path_wants_credentials_and_says_how(broker):
    for path in ["/overview", "/queues", "/nodes", "/definitions", "/connections"]:
        r = requests.get(api(broker, path))
        assert r.status_code == 401, path
        assert r.headers["WWW-Authenticate"].startswith("Basic"), path
        assert r.json()["error"] == "not_authorized"
    assert requests.get(api(broker, "/overview"), auth=("guest", "wrong")).status_code == 401
    assert requests.get(api(broker, "/overview"), auth=("nobody", "guest")).status_code == 401
    assert requests.get(api(broker, "/overview"), headers={"Authorization": "Basic !!!"}).status_code == 401
    assert requests.get(api(broker, "/overview"), auth=AUTH).status_code == 200


def test_guest_is_refused_from_a_non_loopback_address(tmp_path):
    """As on AMQP (`loopback-users`): guest/guest only from loopback."""
    addrs = [a for a in subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split() if ":" not in a]
    if not addrs:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    b = Broker(tmp_path / "data", tmp_path / "warren.log")
    b.extra_args = ["--bind", "0.0.0.0"]
    b.start()
    try:
        r = requests.get(f"http://{addrs[0]}:{b.http_port}/api/overview", auth=AUTH)
        assert r.status_code == 401 and "localhost" in r.json()["reason"], r.text
        assert requests.get(api(b, "/overview"), auth=AUTH).status_code == 200
    finally:
        b.terminate()


def test_overview_whoami_nodes_vhosts_have_rabbitmqs_fields(broker):
    o = requests.get(api(broker, "/overview"), auth=AUTH).json()
    for key in ["management_version", "rabbitmq_version", "cluster_name", "node", "queue_totals", "object_totals", "listeners",
                "exchange_types", "message_stats"]:
        assert key in o, key
    assert {l["protocol"] for l in o["listeners"]} >= {"amqp", "http"}
    assert requests.get(api(broker, "/whoami"), auth=AUTH).json()["name"] == "guest"
    nodes = requests.get(api(broker, "/nodes"), auth=AUTH).json()
    assert len(nodes) == 1 and nodes[0]["running"] is True and nodes[0]["mem_used"] > 0 and nodes[0]["disk_free"] > 0
    assert requests.get(api(broker, "/nodes/" + q(nodes[0]["name"])), auth=AUTH).json()["name"] == nodes[0]["name"]
    assert [v["name"] for v in requests.get(api(broker, "/vhosts"), auth=AUTH).json()] == ["/"]
    assert requests.get(api(broker, "/vhosts/%2F"), auth=AUTH).json()["name"] == "/"
    assert requests.get(api(broker, "/vhosts/nope"), auth=AUTH).status_code == 404
    assert requests.get(api(broker, "/healthchecks/node"), auth=AUTH).json() == {"status": "ok"}
    assert requests.get(api(broker, "/health/checks/alarms"), auth=AUTH).json() == {"status": "ok"}
    assert requests.get(api(broker, f"/health/checks/port-listener/{broker.port}"), auth=AUTH).status_code == 200
    assert requests.get(api(broker, "/health/checks/port-listener/1"), auth=AUTH).status_code == 503
    assert requests.get(api(broker, "/aliveness-test/%2F"), auth=AUTH).json() == {"status": "ok"}
    assert requests.get(api(broker, "/no/such/path"), auth=AUTH).status_code == 404


def test_rabbitmqadmin_declares_publishes_lists_and_deletes(broker, ch, name):
    """What an operator does with rabbitmqadmin, checked through AMQP."""
    admin(broker, "declare", "exchange", f"name={name}-x", "type=topic")
    admin(broker, "declare", "queue", f"name={name}", "durable=true", 'arguments={"x-max-length": 1000}')
    admin(broker, "declare", "queue", f"name={name}-qq", "queue_type=quorum")
    admin(broker, "declare", "binding", f"source={name}-x", f"destination={name}", "routing_key=a.*")
    for i in range(5):
        admin(broker, "publish", f"exchange={name}-x", "routing_key=a.b", f"payload=m{i}", 'properties={"delivery_mode": 2, "headers": {"n": %d}}' % i)
    admin(broker, "publish", "exchange=amq.default", f"routing_key={name}-qq", "payload=to-quorum")
    listed = json.loads(admin(broker, "-f", "raw_json", "list", "queues").stdout)
    by_name = {x["name"]: x for x in listed}
    assert by_name[name]["messages"] == 5 and by_name[name]["type"] == "classic"
    assert by_name[name]["arguments"] == {"x-max-length": 1000}
    assert eventually(lambda: requests.get(api(broker, f"/queues/%2F/{name}-qq"), auth=AUTH).json()["messages"] == 1, timeout=10)
    quorum = requests.get(api(broker, f"/queues/%2F/{name}-qq"), auth=AUTH).json()
    assert quorum["type"] == "quorum" and quorum["leader"] and quorum["members"]
    bindings = json.loads(admin(broker, "-f", "raw_json", "list", "bindings").stdout)
    assert {"source": f"{name}-x", "destination": name, "routing_key": "a.*"}.items() <= next(
        b for b in bindings if b["source"] == f"{name}-x").items()

    # Over AMQP: the five messages, in order, with their properties.
    got = []
    for _ in range(5):
        method, props, body = ch.basic_get(name, auto_ack=True)
        got.append((body, props.delivery_mode, props.headers))
    assert got == [(f"m{i}".encode(), 2, {"n": i}) for i in range(5)]
    method, props, body = ch.basic_get(f"{name}-qq", auto_ack=True)
    assert body == b"to-quorum"

    admin(broker, "publish", f"exchange={name}-x", "routing_key=a.c", "payload=again")
    assert requests.get(api(broker, f"/queues/%2F/{name}"), auth=AUTH).json()["messages"] == 1
    admin(broker, "purge", "queue", f"name={name}")
    assert requests.get(api(broker, f"/queues/%2F/{name}"), auth=AUTH).json()["messages"] == 0
    admin(broker, "delete", "binding", f"source={name}-x", "destination_type=queue", f"destination={name}", "properties_key=a.*")
    assert not [b for b in requests.get(api(broker, "/bindings/%2F"), auth=AUTH).json() if b["source"] == f"{name}-x"]
    admin(broker, "delete", "queue", f"name={name}")
    admin(broker, "delete", "exchange", f"name={name}-x")
    assert requests.get(api(broker, f"/queues/%2F/{name}"), auth=AUTH).status_code == 404
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        ch.queue_declare(name, passive=True)


def test_queue_counts_follow_amqp_traffic(broker, conn, name):
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(name, durable=True)
    for i in range(100):
        ch.basic_publish("", name, b"x" * 100, pika.BasicProperties(delivery_mode=2))
    assert requests.get(api(broker, f"/queues/%2F/{name}"), auth=AUTH).json()["messages_ready"] == 100
    consumer = conn.channel()
    consumer.basic_qos(prefetch_count=30)
    consumer.basic_consume(name, lambda *a: None)
    conn.process_data_events(time_limit=0.5)

    def counted():
        j = requests.get(api(broker, f"/queues/%2F/{name}"), auth=AUTH).json()
        return (j["messages_ready"], j["messages_unacknowledged"], j["messages"], j["consumers"]) == (70, 30, 100, 1)
    assert eventually(counted, timeout=10)
    o = requests.get(api(broker, "/overview"), auth=AUTH).json()
    assert o["object_totals"]["connections"] >= 1 and o["object_totals"]["channels"] >= 2
    consumers = requests.get(api(broker, "/consumers/%2F"), auth=AUTH).json()
    assert len(consumers) == 1, consumers
    c = consumers[0]
    assert c["queue"] == {"name": name, "vhost": "/"} and c["ack_required"] is True and c["prefetch_count"] == 30
    assert c["channel_details"]["connection_name"] == requests.get(api(broker, "/connections"), auth=AUTH).json()[0]["name"]
    assert o["queue_totals"]["messages_unacknowledged"] >= 30


@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_message_rates_count_what_moved(broker, conn, name, kind):
    """Each queue's message_stats count its publishes, deliveries and acks; the rates are the change
    between two samples (every 5 s), and the overview carries samples for the UI's charts."""
    ch = conn.channel()
    ch.confirm_delivery()
    window = "?msg_rates_age=60&msg_rates_incr=5&lengths_age=60&lengths_incr=5"

    def newest_sample_ms():
        stats = requests.get(api(broker, "/overview" + window), auth=AUTH).json()["message_stats"]
        return stats["publish_details"]["samples"][0]["timestamp"] if stats else 0

    def stats(queue):
        return requests.get(api(broker, f"/queues/%2F/{q(queue)}"), auth=AUTH).json()["message_stats"]

    # The traffic must fall between two samples to be one interval's rate: retried on a fresh
    # queue if a sample fell in the middle of it (a slow machine).
    for attempt in range(3):
        queue = f"{name}-{attempt}"
        ch.queue_declare(queue, durable=True, arguments={"x-queue-type": kind})
        before = newest_sample_ms()
        start = eventually(lambda: (t := newest_sample_ms()) > before and t, timeout=12, interval=0.1)
        for i in range(200):
            ch.basic_publish("", queue, b"r%d" % i, pika.BasicProperties(delivery_mode=2))
        for _ in range(50):
            method, _, _ = ch.basic_get(queue)
            ch.basic_ack(method.delivery_tag)
        method, _, _ = ch.basic_get(queue)
        ch.basic_nack(method.delivery_tag, requeue=True)
        ch.basic_get(queue, auto_ack=True)  # the redelivery
        ended = time.time() * 1000
        end = eventually(lambda: (t := newest_sample_ms()) > start and t, timeout=12, interval=0.1)
        counted = stats(queue)
        overview = requests.get(api(broker, "/overview" + window), auth=AUTH).json()
        # What was read is still that interval's (no later sample came while reading).
        if ended + 100 < end and overview["message_stats"]["publish_details"]["samples"][0]["timestamp"] == end:
            break
    else:
        pytest.fail("the traffic never fitted between two samples")
    assert (counted["publish"], counted["deliver_get"], counted["ack"], counted["redeliver"]) == (200, 52, 50, 1), counted
    seconds = (end - start) / 1000
    for key, n in (("publish", 200), ("deliver_get", 52), ("ack", 50), ("redeliver", 1)):
        assert abs(counted[key + "_details"]["rate"] * seconds - n) < 0.05 * n, (key, counted, seconds)
    publish = overview["message_stats"]["publish_details"]
    assert overview["message_stats"]["publish"] >= 200 and len(publish["samples"]) >= 2
    stamps = [s["timestamp"] for s in publish["samples"]]
    assert stamps == sorted(stamps, reverse=True), "samples come newest first"
    assert publish["samples"][0]["sample"] >= 200 and publish["rate"] > 0
    assert overview["queue_totals"]["messages_ready_details"]["samples"][0]["sample"] >= 149
    # Without the window parameters there are rates but no samples.
    plain = requests.get(api(broker, "/overview"), auth=AUTH).json()
    assert "rate" in plain["message_stats"]["publish_details"] and "samples" not in plain["message_stats"]["publish_details"]


def test_get_looks_requeues_takes_and_rejects(broker, ch, name):
    """rabbitmqadmin get, each ackmode, counted through AMQP."""
    ch.confirm_delivery()
    ch.queue_declare(name, durable=True)
    ch.queue_declare(name + "-dlq", durable=True)
    ch.queue_declare(name + "-dl", durable=True, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": name + "-dlq"})
    for i in range(10):
        ch.basic_publish("", name, f"m{i}".encode(), pika.BasicProperties(delivery_mode=2, message_id=f"id{i}", headers={"i": i}))
    looked = json.loads(admin(broker, "-f", "raw_json", "get", f"queue={name}", "count=3").stdout)
    assert [m["payload"] for m in looked] == ["m0", "m1", "m2"]
    assert looked[0]["properties"] == {"delivery_mode": 2, "message_id": "id0", "headers": {"i": 0}}
    assert looked[0]["redelivered"] is False and looked[0]["message_count"] == 9
    assert requests.get(api(broker, f"/queues/%2F/{name}"), auth=AUTH).json()["messages"] == 10
    again = requests.post(api(broker, f"/queues/%2F/{name}/get"), auth=AUTH, json={"count": 2, "ackmode": "ack_requeue_true", "encoding": "base64"}).json()
    assert again[0]["redelivered"] is True and base64.b64decode(again[0]["payload"]) == b"m0"
    taken = requests.post(api(broker, f"/queues/%2F/{name}/get"), auth=AUTH, json={"count": 4, "ackmode": "ack_requeue_false", "truncate": 1}).json()
    assert [m["payload"] for m in taken] == ["m"] * 4 and taken[0]["payload_bytes"] == 2
    assert requests.get(api(broker, f"/queues/%2F/{name}"), auth=AUTH).json()["messages"] == 6
    assert drain(ch, name) == [f"m{i}".encode() for i in range(4, 10)]
    assert requests.post(api(broker, f"/queues/%2F/{name}/get"), auth=AUTH, json={"count": 5}).json() == []
    # Rejected without requeue: dead-lettered.
    for i in range(3):
        ch.basic_publish("", name + "-dl", f"d{i}".encode(), pika.BasicProperties(delivery_mode=2))
    requests.post(api(broker, f"/queues/%2F/{name}-dl/get"), auth=AUTH, json={"count": 3, "ackmode": "reject_requeue_false"}).raise_for_status()
    assert eventually(lambda: requests.get(api(broker, f"/queues/%2F/{name}-dlq"), auth=AUTH).json()["messages"] == 3, timeout=5)
    assert requests.get(api(broker, f"/queues/%2F/{name}-dl"), auth=AUTH).json()["messages"] == 0
    for bad in [{"count": 0}, {"count": 100000}, {"ackmode": "keep"}, {"encoding": "hex"}]:
        assert requests.post(api(broker, f"/queues/%2F/{name}/get"), auth=AUTH, json=bad).status_code == 400


def test_connections_are_listed_and_closed_with_the_reason(broker, conn):
    names = [c["name"] for c in requests.get(api(broker, "/connections"), auth=AUTH).json()]
    assert len(names) == 1
    c = requests.get(api(broker, "/connections/" + q(names[0])), auth=AUTH).json()
    assert c["user"] == "guest" and c["vhost"] == "/" and c["protocol"] == "AMQP 0-9-1"
    assert c["client_properties"]["product"] == "Pika Python Client Library"
    conn.channel()
    conn.channel()
    assert eventually(lambda: len(requests.get(api(broker, "/channels"), auth=AUTH).json()) == 2, timeout=5)
    r = requests.delete(api(broker, "/connections/" + q(names[0])), auth=AUTH, headers={"X-Reason": "maintenance window"})
    assert r.status_code == 204
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        for _ in range(50):
            conn.process_data_events(time_limit=0.1)
    assert closed.value.reply_code == 320 and "maintenance window" in closed.value.reply_text
    assert eventually(lambda: requests.get(api(broker, "/connections"), auth=AUTH).json() == [], timeout=5)
    assert requests.delete(api(broker, "/connections/" + q(names[0])), auth=AUTH).status_code == 404


def test_a_message_published_over_http_is_durable_when_answered(broker, name):
    requests.put(api(broker, f"/queues/%2F/{name}"), auth=AUTH, json={"durable": True}).raise_for_status()
    for i in range(20):
        r = requests.post(api(broker, f"/exchanges/%2F/amq.default/publish"), auth=AUTH,
                          json={"routing_key": name, "payload": base64.b64encode(bytes([i]) * 10).decode(), "payload_encoding": "base64",
                                "properties": {"delivery_mode": 2}})
        assert r.json() == {"routed": True}
    broker.kill9()
    broker.start()
    c = broker.connection()
    ch = c.channel()
    assert drain(ch, name) == [bytes([i]) * 10 for i in range(20)]
    c.close()


def test_definitions_export_and_import_into_another_broker(broker, tmp_path, name):
    admin(broker, "declare", "exchange", f"name={name}-x", "type=headers")
    admin(broker, "declare", "queue", f"name={name}", 'arguments={"x-message-ttl": 60000}')
    admin(broker, "declare", "queue", f"name={name}-qq", "queue_type=quorum")
    requests.post(api(broker, f"/bindings/%2F/e/{name}-x/q/{name}"), auth=AUTH,
                  json={"routing_key": "", "arguments": {"x-match": "all", "k": "v"}}).raise_for_status()
    exported = tmp_path / "defs.json"
    admin(broker, "export", str(exported))
    defs = json.loads(exported.read_text())
    assert {x["name"] for x in defs["queues"]} >= {name, f"{name}-qq"}

    other = Broker(tmp_path / "other", tmp_path / "other.log")
    other.start()
    try:
        admin(other, "import", str(exported))
        admin(other, "import", str(exported))  # twice: nothing changes
        queues = {x["name"]: x for x in requests.get(api(other, "/queues"), auth=AUTH).json()}
        assert queues[name]["arguments"] == {"x-message-ttl": 60000}
        assert queues[f"{name}-qq"]["type"] == "quorum"
        b = [b for b in requests.get(api(other, "/bindings"), auth=AUTH).json() if b["source"] == f"{name}-x"]
        assert len(b) == 1 and b[0]["arguments"] == {"x-match": "all", "k": "v"}
        # The binding routes over AMQP.
        c = other.connection()
        ch = c.channel()
        ch.basic_publish(f"{name}-x", "", b"hdr", pika.BasicProperties(headers={"k": "v"}))
        assert eventually(lambda: ch.basic_get(name, auto_ack=True)[2] == b"hdr", timeout=5)
        c.close()
        # A file naming a vhost this node does not have changes nothing.
        bad = dict(defs, queues=defs["queues"] + [{"name": "elsewhere", "vhost": "other", "durable": True, "auto_delete": False, "arguments": {}}])
        r = requests.post(api(other, "/definitions"), auth=AUTH, json=bad)
        assert r.status_code == 400 and "vhost 'other'" in r.json()["reason"]
        assert "elsewhere" not in {x["name"] for x in requests.get(api(other, "/queues"), auth=AUTH).json()}
    finally:
        other.terminate()


def test_bad_input_gets_a_clear_error_and_changes_nothing(broker, name):
    before = requests.get(api(broker, "/queues"), auth=AUTH).json()
    cases = [
        ("put", f"/queues/%2F/{name}", b"{not json"),
        ("put", f"/queues/%2F/{name}", b"[1,2]"),
        ("put", f"/queues/%2F/{name}", json.dumps({"arguments": [1]}).encode()),
        ("put", f"/queues/%2F/{name}", json.dumps({"durable": "maybe"}).encode()),
        ("put", f"/queues/%2F/{name}", json.dumps({"arguments": {"x-max-length": "ten"}}).encode()),
        ("put", f"/queues/%2F/{name}", json.dumps({"exclusive": True}).encode()),
        ("put", f"/queues/%2F/{'n' * 300}", b"{}"),
        ("put", f"/queues/%2F/amq.{name}", b"{}"),
        ("put", f"/exchanges/%2F/{name}", json.dumps({"type": "nonsense"}).encode()),
        ("put", f"/exchanges/%2F/{name}", b"{}"),
        ("post", "/exchanges/%2F/amq.default/publish", json.dumps({"routing_key": name}).encode()),
        ("post", "/exchanges/%2F/amq.default/publish", json.dumps({"routing_key": name, "payload": "x", "payload_encoding": "base64"}).encode()),
        ("post", "/exchanges/%2F/amq.default/publish", json.dumps({"routing_key": name, "payload": "x", "properties": {"priority": 1000}}).encode()),
        ("post", "/exchanges/%2F/amq.default/publish", json.dumps({"routing_key": name, "payload": "x", "properties": {"message_id": "m" * 300}}).encode()),
        ("post", "/definitions", b"\"a string\""),
        ("post", "/definitions", json.dumps({"queues": "nope"}).encode()),
        ("get", "/queues?page=0", None),
        ("get", "/queues?page=1&page_size=100000", None),
    ]
    for method, path, body in cases:
        r = requests.request(method, api(broker, path), auth=AUTH, data=body, headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
        assert r.json()["reason"], (path, r.text)
    # Deeply nested JSON: refused by the parser's depth limit, not by a stack overflow.
    deep = b"{\"arguments\":" + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert requests.put(api(broker, f"/queues/%2F/{name}"), auth=AUTH, data=deep).status_code == 400
    # A body over the limit: 413, unread.
    assert requests.put(api(broker, f"/queues/%2F/{name}"), auth=AUTH, data=b"{" + b" " * (5 << 20) + b"}").status_code == 413
    assert requests.get(api(broker, "/queues"), auth=AUTH).json() == before
    assert broker.alive()


def test_a_resource_alarm_refuses_http_publishes_and_fails_the_alarm_check(tmp_path, name):
    """As AMQP publishers are blocked during an alarm, an HTTP publish is refused (503), and the
    alarms health check says why; both recover when it clears."""
    import signal
    b, config = broker_with_config(tmp_path, 'memory-high-watermark = "0.4"\n')
    try:
        requests.put(api(b, f"/queues/%2F/{name}"), auth=AUTH, json={}).raise_for_status()
        publish = lambda: requests.post(api(b, "/exchanges/%2F/amq.default/publish"), auth=AUTH,
                                        json={"routing_key": name, "payload": "x"})
        assert publish().json() == {"routed": True}
        config.write_text('memory-high-watermark = "1MiB"\n')  # far below what the broker uses
        b.proc.send_signal(signal.SIGHUP)
        assert eventually(lambda: requests.get(api(b, "/health/checks/alarms"), auth=AUTH).status_code == 503, timeout=15)
        r = publish()
        assert r.status_code == 503 and "resource alarm" in r.json()["reason"], r.text
        assert requests.get(api(b, f"/queues/%2F/{name}"), auth=AUTH).json()["messages"] == 1
        config.write_text('memory-high-watermark = "0.4"\n')
        b.proc.send_signal(signal.SIGHUP)
        assert eventually(lambda: requests.get(api(b, "/health/checks/alarms"), auth=AUTH).status_code == 200, timeout=15)
        assert publish().json() == {"routed": True}
        assert requests.get(api(b, f"/queues/%2F/{name}"), auth=AUTH).json()["messages"] == 2
    finally:
        b.kill9()


def test_get_stops_at_16_mib_of_bodies(broker, ch, name):
    ch.queue_declare(name)
    for _ in range(6):
        ch.basic_publish("", name, b"x" * (4 << 20))
    got = requests.post(api(broker, f"/queues/%2F/{name}/get"), auth=AUTH, json={"count": 6, "ackmode": "ack_requeue_false", "truncate": 10}).json()
    assert len(got) == 4 and all(m["payload_bytes"] == 4 << 20 for m in got)
    assert requests.get(api(broker, f"/queues/%2F/{name}"), auth=AUTH).json()["messages"] == 2


def test_a_client_that_never_reads_its_answer_is_dropped(tmp_path, name):
    """A 48 MB answer to a client that reads nothing: once the socket buffers are full, after
    write-timeout (here 2 s) the server drops the connection instead of holding it (and its slot)
    for ever. What the buffers held (a few MB) is all the client gets."""
    b, _ = broker_with_config(tmp_path, "write-timeout = 2\n")
    try:
        c = b.connection()
        c.channel().queue_declare(name)
        c.channel().basic_publish("", name, b"y" * (48 << 20))
        c.close()
        body = json.dumps({"count": 1, "ackmode": "ack_requeue_true"}).encode()
        s = socket.create_connection(("127.0.0.1", b.http_port))
        auth = base64.b64encode(b"guest:guest").decode()
        s.sendall(f"POST /api/queues/%2F/{name}/get HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {auth}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(6)
        received = 0
        s.settimeout(10)
        while True:
            try:
                chunk = s.recv(1 << 20)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            received += len(chunk)
        assert received < 48 << 20, f"the whole answer ({received} bytes) was still sent after the write timeout"
        assert requests.get(api(b, f"/queues/%2F/{name}"), auth=AUTH).json()["messages"] == 1
    finally:
        b.kill9()


def test_a_client_trickling_its_headers_is_dropped(broker):
    """A slowloris client holds a connection at most the header read timeout (10 s)."""
    s = socket.create_connection(("127.0.0.1", broker.http_port))
    s.sendall(b"GET /api/overview HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    s.settimeout(30)
    while True:
        try:
            s.sendall(b"X-Slow: 1\r\n")
        except OSError:
            break
        try:
            s.settimeout(1)
            if s.recv(4096) == b"":
                break
        except socket.timeout:
            pass
        except OSError:
            break
        assert time.monotonic() - started < 25, "the server kept a trickling client past its header timeout"
    assert requests.get(api(broker, "/overview"), auth=AUTH).status_code == 200


def metrics(broker, path="/metrics"):
    r = requests.get(f"http://127.0.0.1:{broker.prometheus_port}{path}")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    return r.text


def sample(text, name, labels=""):
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not in the metrics")


def test_prometheus_metrics_have_rabbitmq_names_and_move_with_traffic(broker, conn, name):
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(name, durable=True)
    before = metrics(broker)
    for _ in range(10):
        ch.basic_publish("", name, b"m", pika.BasicProperties(delivery_mode=2))
    for _ in range(4):
        assert ch.basic_get(name, auto_ack=True)[0] is not None
    after = metrics(broker)
    assert sample(after, "rabbitmq_global_messages_received_total") - sample(before, "rabbitmq_global_messages_received_total") == 10
    assert sample(after, "rabbitmq_global_messages_routed_total") - sample(before, "rabbitmq_global_messages_routed_total") == 10
    assert sample(after, "rabbitmq_global_messages_delivered_get_auto_ack_total") - sample(before, "rabbitmq_global_messages_delivered_get_auto_ack_total") == 4
    assert sample(after, "rabbitmq_queue_messages_ready") == 6
    assert sample(after, "rabbitmq_connections") == 1
    assert sample(after, "warren_store_fsyncs_total") > 0
    per_object = metrics(broker, "/metrics/per-object")
    assert sample(per_object, "rabbitmq_queue_messages_ready", f'{{vhost="/",queue="{name}"}}') == 6
    detailed = metrics(broker, "/metrics/detailed?family=queue_coarse_metrics&family=queue_consumer_count&vhost=%2F")
    assert sample(detailed, "rabbitmq_detailed_queue_messages", f'{{vhost="/",queue="{name}"}}') == 6
    assert sample(detailed, "rabbitmq_detailed_queue_consumers", f'{{vhost="/",queue="{name}"}}') == 0
    if shutil.which("promtool"):
        for text in (after, per_object, detailed):
            check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
            # promtool warns about rabbitmq_prometheus's own naming (counters' _total, units) as it does for RabbitMQ;
            # an error in the format is what fails.
            assert "error" not in (check.stdout + check.stderr).lower(), check.stdout + check.stderr


def test_a_real_prometheus_scrapes_the_node(broker, conn, tmp_path, name):
    if not shutil.which("prometheus"):
        pytest.skip("Debian's prometheus is not installed (scripts/install-test-deps.sh installs it)")
    ch = conn.channel()
    ch.queue_declare(name)
    for _ in range(7):
        ch.basic_publish("", name, b"m")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: warren\n    metrics_path: /metrics/per-object\n    static_configs: [{{targets: ['127.0.0.1:{broker.prometheus_port}']}}]\n")
    prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def scraped():
            r = requests.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": f'rabbitmq_queue_messages_ready{{queue="{name}"}}'}, timeout=2)
            result = r.json()["data"]["result"]
            return result and result[0]["value"][1] == "7"
        assert eventually(scraped, timeout=60)
        targets = requests.get(f"http://127.0.0.1:{port}/api/v1/targets").json()["data"]["activeTargets"]
        assert targets[0]["health"] == "up", targets
    finally:
        prom.terminate()
        prom.wait(10)


@pytest.fixture
def cluster(tmp_path):
    yield from three_node_cluster(tmp_path, "http-test-secret-0123456789")


def test_cluster_answers_from_any_node(cluster, name):
    n1, n2, n3 = cluster[1], cluster[2], cluster[3]
    r = requests.put(api(n1, f"/queues/%2F/{name}"), auth=AUTH, json={"durable": True, "arguments": {"x-queue-type": "quorum"}})
    assert r.status_code == 201, r.text
    c = n2.connection()
    ch = c.channel()
    ch.confirm_delivery()
    for _ in range(25):
        ch.basic_publish("", name, b"m", pika.BasicProperties(delivery_mode=2))
    c.close()
    for node in (n1, n2, n3):
        def seen():
            j = requests.get(api(node, f"/queues/%2F/{name}"), auth=AUTH).json()
            return j["type"] == "quorum" and j["messages"] == 25 and len(j["members"]) == 3 and j["leader"] in j["members"]
        assert eventually(seen, timeout=20), node

        def all_running():
            nodes = requests.get(api(node, "/nodes"), auth=AUTH).json()
            return len(nodes) == 3 and all(n["running"] for n in nodes)
        assert eventually(all_running, timeout=20), requests.get(api(node, "/nodes"), auth=AUTH).json()
    n3.kill9()

    def n3_down():
        nodes = {n["name"]: n["running"] for n in requests.get(api(n1, "/nodes"), auth=AUTH).json()}
        return sorted(nodes.values()) == [False, True, True]
    assert eventually(n3_down, timeout=30)
    per_object = metrics(n1, "/metrics/per-object")
    assert sample(per_object, "rabbitmq_raft_term_total", f'{{vhost="/",queue="{name}"}}') >= 1


def test_rabbitmqadmin_manages_users_vhosts_and_permissions(broker, name):
    """rabbitmqadmin unchanged: a user, a vhost and a permission it declares let that user in,
    and deleting them closes it out again."""
    admin(broker, "declare", "vhost", f"name={name}")
    admin(broker, "declare", "user", f"name={name}", "password=s3cret", "tags=management")
    admin(broker, "declare", "permission", f"vhost={name}", f"user={name}", "configure=^app-", "write=.*", "read=.*")
    listed = json.loads(admin(broker, "-f", "raw_json", "list", "permissions").stdout)
    assert {"user": name, "vhost": name, "configure": "^app-", "write": ".*", "read": ".*"} in listed
    users = {u["name"]: u for u in json.loads(admin(broker, "-f", "raw_json", "list", "users").stdout)}
    assert users[name]["tags"] == ["management"] and "s3cret" not in json.dumps(users)
    params = pika.ConnectionParameters("127.0.0.1", broker.port, name, pika.PlainCredentials(name, "s3cret"))
    c = pika.BlockingConnection(params)
    ch = c.channel()
    ch.queue_declare("app-q")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        ch.queue_declare("other-q")
    assert refused.value.reply_code == 403
    c.close()
    admin(broker, "delete", "user", f"name={name}")
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        pika.BlockingConnection(params)
    admin(broker, "delete", "vhost", f"name={name}")
    assert name not in [v["name"] for v in json.loads(admin(broker, "-f", "raw_json", "list", "vhosts").stdout)]
