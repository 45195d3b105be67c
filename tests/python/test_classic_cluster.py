"""A durable classic queue in a three-node cluster lives on one node, its home (the node whose
client declared it): publishes through the other nodes are forwarded there and confirmed only once
the home has them durable; consumers on every node are served (deliveries relayed from the home,
acks and requeues relayed back); basic.get, queue.purge and declare-ok's counts through any node
are the home's (a message got elsewhere is held on the home until settled, and comes back if the
getting channel closes or its node dies); queue.delete if-empty elsewhere is refused with a reply
naming the home; with the home down, publishes through the others are nacked, never confirmed,
consumers elsewhere are cancelled, and what was confirmed is there when the home is back; a
consumer's node killed: what it held is delivered to the others. Before, every node kept its own
copy and a message stayed in the copy of the node it was published on (consumers elsewhere never
saw it). About 40 s."""
import time

import pika
import pytest
import requests

from conftest import eventually, three_node_cluster

pytestmark = [pytest.mark.warren_only]

SECRET = "classic-cluster-secret"


@pytest.fixture
def cluster(tmp_path):
    yield from three_node_cluster(tmp_path, SECRET)


def declare_on(nodes, name, home):
    c = nodes[home].connection()
    c.channel().queue_declare(name, durable=True)
    c.close()

    def everywhere():
        for b in nodes.values():
            c = b.connection()
            try:
                c.channel().queue_declare(name, passive=True)
            finally:
                if c.is_open:
                    c.close()
        return True

    eventually(everywhere, timeout=10)


def publish_confirmed(node, name, bodies):
    """Publishes with confirms; returns (confirmed, nacked) bodies."""
    c = node.connection()
    ch = c.channel()
    ch.confirm_delivery()
    confirmed, nacked = [], []
    for body in bodies:
        try:
            ch.basic_publish("", name, body, pika.BasicProperties(delivery_mode=2), mandatory=True)
            confirmed.append(body)
        except pika.exceptions.NackError:
            nacked.append(body)
    c.close()
    return confirmed, nacked


def drain_by_get(node, name):
    c = node.connection()
    ch = c.channel()
    got = []
    while True:
        method, _, body = ch.basic_get(name, auto_ack=True)
        if method is None:
            break
        got.append(body)
    c.close()
    return got


def refused(node, name, action):
    c = node.connection()
    ch = c.channel()
    try:
        action(ch)
    except pika.exceptions.ChannelClosedByBroker as e:
        return e.reply_code, e.reply_text
    finally:
        if c.is_open:
            c.close()
    return None


def test_a_classic_queue_lives_on_its_declaring_node_and_takes_publishes_from_every_node(cluster):
    name = "classic-home-2"
    declare_on(cluster, name, home=2)
    sent = []
    for i, node in cluster.items():
        bodies = [f"n{i}-{k}".encode() for k in range(150)]
        confirmed, nacked = publish_confirmed(node, name, bodies)
        assert confirmed == bodies and not nacked, f"every publish through node {i} is confirmed"
        sent += bodies
    # Order is kept per publishing node.
    got = drain_by_get(cluster[2], name)
    assert sorted(got) == sorted(sent), f"the home has every message exactly once ({len(got)} of {len(sent)})"
    for i in (1, 3):
        per_node = [b for b in got if b.startswith(f"n{i}-".encode())]
        assert per_node == [f"n{i}-{k}".encode() for k in range(150)], f"node {i}'s messages arrive in order"

    for other in (1, 3):
        for what, action in [
            ("delete if-empty", lambda ch: ch.queue_delete(name, if_empty=True)),
        ]:
            answer = refused(cluster[other], name, action)
            assert answer is not None, f"{what} on node {other} (not the home) is refused"
            code, text = answer
            assert code == 406 and "lives on node 2" in text, (what, other, code, text)

    # A consumer on the home gets what other nodes publish.
    c = cluster[2].connection()
    ch = c.channel()
    got = []
    ch.basic_consume(name, lambda chan, m, p, body: (got.append(body), chan.basic_ack(m.delivery_tag)))
    confirmed, _ = publish_confirmed(cluster[3], name, [b"live-1", b"live-2"])
    deadline = time.time() + 10
    while len(got) < 2 and time.time() < deadline:
        c.process_data_events(time_limit=0.1)
    c.close()
    assert got == [b"live-1", b"live-2"]


def counts_on(node, name):
    c = node.connection()
    try:
        ok = c.channel().queue_declare(name, passive=True)
        return ok.method.message_count, ok.method.consumer_count
    finally:
        c.close()


def test_basic_get_purge_and_counts_through_any_node_are_the_homes(cluster):
    name = "classic-get"
    declare_on(cluster, name, home=2)
    sent = [f"m-{k}".encode() for k in range(30)]
    confirmed, _ = publish_confirmed(cluster[1], name, sent)
    assert confirmed == sent
    assert counts_on(cluster[3], name) == (30, 0), "a passive declare on another node counts the home's messages"

    # basic.get with acks on node 1: acked ones are gone, a nacked one and those its closed
    # channel held come back, redelivered.
    c = cluster[1].connection()
    ch = c.channel()
    got = []
    for k in range(5):
        method, _, body = ch.basic_get(name, auto_ack=False)
        assert method is not None, f"get {k} through node 1 finds a message"
        assert method.message_count == 29 - k, "get-ok counts what stays on the home"
        got.append((method.delivery_tag, body))
    assert [b for _, b in got] == sent[:5], "in the queue's order"
    ch.basic_ack(got[0][0])
    ch.basic_ack(got[1][0])
    ch.basic_nack(got[2][0], requeue=True)
    # Acks and the requeue reached the home (2 unacked held).
    eventually(lambda: counts_on(cluster[3], name) == (26, 0), timeout=10)
    c.close()
    eventually(lambda: counts_on(cluster[2], name) == (28, 0), timeout=10)

    # basic.get without acks on node 3: the rest, each once.
    rest = []
    c = cluster[3].connection()
    ch = c.channel()
    while True:
        method, _, body = ch.basic_get(name, auto_ack=True)
        if method is None:
            break
        rest.append((body, method.redelivered))
    c.close()
    assert sorted(b for b, _ in rest) == sorted(sent[2:]), "what was not acked, once"
    assert {b for b, r in rest if r} == set(sent[2:5]), "the nacked and the held ones come back redelivered"
    assert counts_on(cluster[1], name) == (0, 0)

    # queue.purge through node 1.
    publish_confirmed(cluster[3], name, [b"p"] * 10)
    c = cluster[1].connection()
    purged = c.channel().queue_purge(name)
    c.close()
    assert purged.method.message_count == 10, "purge-ok counts what the home removed"
    assert counts_on(cluster[2], name) == (0, 0)

    # A getting node killed while holding messages: they go back to the queue on the home.
    publish_confirmed(cluster[1], name, [b"h-1", b"h-2"])
    c = cluster[3].connection()
    ch = c.channel()
    assert ch.basic_get(name, auto_ack=False)[2] == b"h-1"
    assert ch.basic_get(name, auto_ack=False)[2] == b"h-2"
    cluster[3].kill9()
    eventually(lambda: counts_on(cluster[1], name) == (2, 0), timeout=20)
    again = drain_by_get(cluster[1], name)
    assert again == [b"h-1", b"h-2"], f"what the killed node's gets held comes back, in order: {again}"


def test_with_the_home_down_publishes_and_gets_elsewhere_fail_and_what_was_confirmed_survives(cluster):
    name = "classic-home-1"
    declare_on(cluster, name, home=1)
    before, _ = publish_confirmed(cluster[3], name, [f"before-{k}".encode() for k in range(50)])
    assert len(before) == 50
    cluster[1].kill9()
    started = time.monotonic()
    confirmed, nacked = publish_confirmed(cluster[3], name, [f"down-{k}".encode() for k in range(5)])
    assert not confirmed, "nothing is confirmed for a classic queue whose home is down"
    assert len(nacked) == 5
    assert time.monotonic() - started < 20, "the nacks come within the forward timeout"
    # basic.get elsewhere is not get-empty (the queue may hold messages): 404 naming the home.
    ch = cluster[3].connection().channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
        ch.basic_get(name)
    assert closed.value.reply_code == 404 and "home node 1" in closed.value.reply_text, closed.value
    cluster[1].start()

    def after_restart():
        confirmed, _ = publish_confirmed(cluster[2], name, [b"after"])
        return confirmed == [b"after"]

    eventually(after_restart, timeout=20)
    got = drain_by_get(cluster[1], name)
    assert [b for b in got if b.startswith(b"before-")] == before, "every message confirmed before the kill -9 is there, in order"
    assert b"after" in got


class Consumer:
    """A pika consumer with manual acks on one node; `ack=False` holds what it gets."""

    def __init__(self, node, name, prefetch=20, ack=True):
        self.conn = node.connection()
        self.ch = self.conn.channel()
        self.ch.basic_qos(prefetch_count=prefetch)
        self.got, self.held, self.cancelled = [], [], False
        self.ack = ack
        self.ch.add_on_cancel_callback(lambda frame: setattr(self, "cancelled", True))
        self.ch.basic_consume(name, self.on_message)

    def on_message(self, ch, method, props, body):
        self.got.append(body)
        if self.ack:
            ch.basic_ack(method.delivery_tag)
        else:
            self.held.append(method.delivery_tag)

    def pump(self, seconds):
        deadline = time.time() + seconds
        while time.time() < deadline:
            self.conn.process_data_events(time_limit=0.05)


def pump_all(consumers, until, timeout=15):
    deadline = time.time() + timeout
    while not until() and time.time() < deadline:
        for c in consumers:
            c.pump(0.05)
    return until()


def test_consumers_on_every_node_share_a_classic_queue_and_a_dead_consumer_node_gives_back_what_it_held(cluster):
    name = "classic-relay"
    declare_on(cluster, name, home=2)
    c1, c3 = Consumer(cluster[1], name), Consumer(cluster[3], name)
    sent = []
    for i, node in cluster.items():
        bodies = [f"n{i}-{k}".encode() for k in range(200)]
        confirmed, _ = publish_confirmed(node, name, bodies)
        assert confirmed == bodies
        sent += bodies
    assert pump_all([c1, c3], lambda: len(c1.got) + len(c3.got) >= len(sent)), (len(c1.got), len(c3.got))
    assert sorted(c1.got + c3.got) == sorted(sent), "every message once, to consumers on nodes without the queue"
    assert c1.got and c3.got, "both consumers get a share"

    # A nack with requeue on node 3 comes back (to one of the consumers), redelivered.
    c3.ack = False
    c1.ch.basic_cancel(c1.ch.consumer_tags[0])
    c1.pump(0.5)
    confirmed, _ = publish_confirmed(cluster[1], name, [b"requeue-me"])
    assert pump_all([c3], lambda: c3.held)
    c3.ch.basic_nack(c3.held.pop(), requeue=True)
    c3.ack = True
    assert pump_all([c3], lambda: c3.got.count(b"requeue-me") == 2), "a requeued message is delivered again"

    # A consumer's node killed with unacked messages: the home gives them to the other consumer.
    holder = Consumer(cluster[3], name, prefetch=10, ack=False)
    c3.ch.basic_cancel(c3.ch.consumer_tags[0])
    c3.pump(0.5)
    held = [f"held-{k}".encode() for k in range(10)]
    publish_confirmed(cluster[1], name, held)
    assert pump_all([holder], lambda: len(holder.got) == 10), holder.got
    cluster[3].kill9()
    other = Consumer(cluster[1], name)
    assert pump_all([other], lambda: sorted(other.got) == sorted(held), timeout=20), \
        f"what the killed node's consumer held comes back: {other.got}"


def test_with_the_home_down_consumers_on_other_nodes_are_cancelled(cluster):
    name = "classic-relay-home-down"
    declare_on(cluster, name, home=1)
    c2 = Consumer(cluster[2], name)
    publish_confirmed(cluster[3], name, [b"one"])
    assert pump_all([c2], lambda: c2.got == [b"one"])
    cluster[1].kill9()
    assert pump_all([c2], lambda: c2.cancelled, timeout=20), "the client is told its consumer is gone (basic.cancel)"


def test_a_redeclare_on_another_node_renews_x_expires(cluster):
    """Issue 33, item 7: a queue.declare (passive too) on any node restarts the countdown of
    x-expires of a classic queue homed elsewhere, as a declare on its home does (RabbitMQ: any
    declare renews it). Before, only its home's declares counted: it expired under its users."""
    args = {"x-expires": 3000}
    c = cluster[1].connection()
    c.channel().queue_declare("renewed", durable=True, arguments=args)
    c.close()
    other = cluster[2].connection()
    ch = other.channel()
    for i in range(8):
        time.sleep(1)
        if i % 2:
            ch.queue_declare("renewed", passive=True)
        else:
            ch.queue_declare("renewed", durable=True, arguments=args)
    other.close()

    def gone_from_home():
        c = cluster[1].connection()
        try:
            c.channel().queue_declare("renewed", passive=True)
            return False
        except pika.exceptions.ChannelClosedByBroker as e:
            return e.reply_code == 404
        finally:
            if c.is_open:
                c.close()

    assert not gone_from_home(), "expired while redeclared on another node every second"
    # Unused from then on, it goes (a look renews it: look once, after the countdown).
    time.sleep(5)
    assert gone_from_home()


def test_a_classic_queue_is_rewound_through_any_node_and_the_rewind_survives_a_kill9_of_its_home(cluster):
    """`POST .../rewind` on a node that is not the queue's home is done by the home (wire op
    REWIND): what was consumed comes back in order; a refusal says why; the answered rewind holds
    after the home is killed with SIGKILL."""
    name = "classic-rewound"
    declare_on(cluster, f"{name}-plain", 1)
    c = cluster[1].connection()
    c.channel().queue_declare(name, durable=True, arguments={"x-retention-seconds": 3600})
    c.close()
    eventually(lambda: all(counts_on(b, name) == (0, 0) for b in cluster.values()), timeout=10)
    bodies = [b"r-%d" % i for i in range(50)]
    assert publish_confirmed(cluster[2], name, bodies) == (bodies, [])
    assert drain_by_get(cluster[1], name) == bodies

    def rewind(node, queue):
        return requests.post(f"http://127.0.0.1:{node.http_port}/api/queues/%2F/{queue}/rewind", json={"to": 0}, auth=("guest", "guest"), timeout=90)

    r = rewind(cluster[3], f"{name}-plain")
    assert r.status_code == 400 and "x-retention-seconds" in r.json()["reason"], r.text
    r = rewind(cluster[3], name)
    assert r.status_code == 200, r.text
    assert (r.json()["rewound"], r.json()["clamped"]) == (50, True)
    assert counts_on(cluster[2], name)[0] == 50
    cluster[1].kill9()
    cluster[1].start()
    eventually(lambda: drain_by_get(cluster[1], name) == bodies, timeout=30, interval=0.5)


def test_the_management_api_on_every_node_shows_the_homes_counts_and_down_when_the_home_is(cluster):
    """`GET /api/queues` and `/api/queues/%2F/NAME` on a node that is not a classic queue's home
    show the home's ready, unacked and consumer counts (wire op STATS, one request per home);
    with the home killed they show state `down` and no counts, as RabbitMQ shows a classic queue
    whose node is down. Before, the other nodes showed their own empty view (0 unacked, and the
    list 0 messages)."""
    name = "classic-counted"
    declare_on(cluster, name, home=2)
    confirmed, _ = publish_confirmed(cluster[1], name, [f"c-{k}".encode() for k in range(20)])
    assert len(confirmed) == 20
    holder = Consumer(cluster[2], name, prefetch=5, ack=False)
    assert pump_all([holder], lambda: len(holder.got) == 5), holder.got

    def api(node, path):
        r = requests.get(f"http://127.0.0.1:{node.http_port}/api/{path}", auth=("guest", "guest"), timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def counts(q):
        return {k: q.get(k) for k in ("messages", "messages_ready", "messages_unacknowledged", "consumers", "state")}

    want = {"messages": 20, "messages_ready": 15, "messages_unacknowledged": 5, "consumers": 1, "state": "running"}
    for i in (1, 2, 3):
        listed = [q for q in api(cluster[i], "queues") if q["name"] == name]
        assert len(listed) == 1 and counts(listed[0]) == want, (i, listed)
        assert counts(api(cluster[i], f"queues/%2F/{name}")) == want, i

    holder.conn.close()
    cluster[2].kill9()
    down = {"messages": None, "messages_ready": None, "messages_unacknowledged": None, "consumers": None, "state": "down"}
    for i in (1, 3):
        started = time.monotonic()
        listed = [q for q in api(cluster[i], "queues") if q["name"] == name]
        assert len(listed) == 1 and counts(listed[0]) == down, (i, listed)
        assert time.monotonic() - started < 5, "a down home costs the list at most its wait"
        assert counts(api(cluster[i], f"queues/%2F/{name}")) == down, i


def test_connections_channels_consumers_and_nodes_are_cluster_wide_from_any_node(cluster):
    """Issue 35: "cluster-wide answers from any node". `/api/connections`, `/api/channels`,
    `/api/consumers`, `/api/nodes` and the overview's totals on any node list every node's (each
    node answers for its own, wire op MANAGEMENT); a consumer relayed to a classic queue's home is
    listed once, on its client's node (not as the home's relay too); a connection on another node
    is shown and closed (DELETE) through any node. Before, each node answered for itself only."""
    name = "classic-listed"
    declare_on(cluster, name, home=2)
    # Messages in a classic queue homed on node 2: every node's overview counts them (its own copy
    # holds nothing; the home's counts are asked for).
    declare_on(cluster, "classic-counted", home=2)
    publish_confirmed(cluster[3], "classic-counted", [b"a", b"b", b"c"])

    def open_on(i, label):
        c = cluster[i].connection(client_properties={"connection_name": label})
        return c

    conns = {label: open_on(i, label) for i, label in ((1, "on-1"), (2, "on-2"), (3, "on-3"))}
    ch1 = conns["on-1"].channel()
    ch1.basic_consume(name, lambda *a: None, consumer_tag="tag-on-1")
    ch3a, ch3b = conns["on-3"].channel(), conns["on-3"].channel()
    ch3b.basic_consume(name, lambda *a: None, consumer_tag="tag-on-3")
    conns["on-2"].channel()
    for c in conns.values():
        c.process_data_events(time_limit=0.2)

    def api(i, path, method="GET", **kw):
        return requests.request(method, f"http://127.0.0.1:{cluster[i].http_port}/api/{path}", auth=("guest", "guest"), timeout=10, **kw)

    node_names = {i: api(i, "overview").json()["node"] for i in cluster}
    by_label = {}
    for i in cluster:
        listed = api(i, "connections").json()
        labels = {c["client_properties"].get("connection_name"): c for c in listed}
        assert set(labels) == {"on-1", "on-2", "on-3"}, (i, list(labels))
        assert {lbl: c["node"] for lbl, c in labels.items()} == {"on-1": node_names[1], "on-2": node_names[2], "on-3": node_names[3]}
        by_label = {lbl: c["name"] for lbl, c in labels.items()}
        channels = api(i, "channels").json()
        per_connection = sorted((c["connection_details"]["name"], c["number"]) for c in channels)
        assert per_connection == sorted([(by_label["on-1"], 1), (by_label["on-2"], 1), (by_label["on-3"], 1), (by_label["on-3"], 2)]), (i, per_connection)
        consumers = api(i, "consumers").json()
        assert sorted((c["consumer_tag"], c["channel_details"]["node"], c["channel_details"]["connection_name"]) for c in consumers) == [
            ("tag-on-1", node_names[1], by_label["on-1"]),
            ("tag-on-3", node_names[3], by_label["on-3"]),
        ], (i, consumers)
        overview = api(i, "overview").json()
        totals = overview["object_totals"]
        assert (totals["connections"], totals["channels"], totals["consumers"]) == (3, 4, 2), (i, totals)
        assert (overview["queue_totals"]["messages_ready"], overview["queue_totals"]["messages"]) == (3, 3), (i, overview["queue_totals"])
        amqp_listeners = sorted((lst["node"], lst["protocol"]) for lst in overview["listeners"] if lst["protocol"] == "amqp")
        assert amqp_listeners == sorted((n, "amqp") for n in node_names.values()), (i, overview["listeners"])
        nodes = api(i, "nodes").json()
        assert sorted(n["name"] for n in nodes) == sorted(node_names.values())
        assert all(n["running"] and n.get("mem_used", 0) > 0 and n.get("os_pid") for n in nodes), (i, nodes)
        assert len(api(i, f"connections/{requests.utils.quote(by_label['on-1'], safe='')}/channels").json()) == 1

    # Shown and closed through a node that is not the connection's.
    quoted = requests.utils.quote(by_label["on-1"], safe="")
    shown = api(3, f"connections/{quoted}")
    assert shown.status_code == 200 and shown.json()["node"] == node_names[1], shown.text
    closed = api(3, f"connections/{quoted}", method="DELETE", headers={"X-Reason": "closed from node 3"})
    assert closed.status_code == 204, closed.text
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e:
        for _ in range(50):
            conns["on-1"].process_data_events(time_limit=0.1)
    assert e.value.reply_code == 320 and "closed from node 3" in e.value.reply_text, e.value
    assert api(2, f"connections/{quoted}", method="DELETE").status_code == 404
    eventually(lambda: {c["client_properties"].get("connection_name") for c in api(2, "connections").json()} == {"on-2", "on-3"}, timeout=5)

    # A node down: the others answer without it, within their wait.
    cluster[3].kill9()
    started = time.monotonic()
    eventually(lambda: {c["client_properties"].get("connection_name") for c in api(1, "connections").json()} == {"on-2"}, timeout=10)
    assert time.monotonic() - started < 8
    assert [c["consumer_tag"] for c in api(2, "consumers").json()] == []
