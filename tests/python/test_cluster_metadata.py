"""The cluster's metadata group (issue 10): three `warren server` processes on loopback ports with
--peers share one durable topology. A client may declare on any node and use the declaration on
another right after declare-ok; a deletion on one node is seen on the others; a node that was
down gets what it missed; without a quorum a durable declare fails with 541 and changes nothing;
of two inequivalent declarations of one name on two nodes, one gets 406 (also when sent at once).

About 45 s (elections, one 10 s commit timeout)."""
import json
import subprocess
import threading
import time

import pika
import pytest

from conftest import BIN, Broker, eventually, free_port

pytestmark = [pytest.mark.needs_process, pytest.mark.warren_only]

SECRET = "metadata-group-test-secret"


@pytest.fixture
def cluster(tmp_path, request):
    ports = {n: free_port() for n in (1, 2, 3)}
    peers = ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items())
    nodes = []
    for n in (1, 2, 3):
        b = Broker(tmp_path / f"n{n}", tmp_path / f"n{n}.log")
        b.extra_args = ["--node-id", str(n), "--cluster-addr", f"127.0.0.1:{ports[n]}", "--peers", peers,
                        "--cluster-secret", SECRET]
        b.cluster_port = ports[n]
        nodes.append(b)
    for b in nodes:
        b.start()
    if "go through the cluster's metadata group" not in nodes[0].log_text():
        for b in nodes:
            b.proc.kill()
        pytest.skip("this warren does not run its topology through the metadata group yet")
    yield nodes
    failed = getattr(request.node, "rep_call", None)
    for b in nodes:
        if b.alive():
            b.proc.kill()
            b.proc.wait(10)
    if failed is not None and failed.failed:
        for i, b in enumerate(nodes, 1):
            print(f"---- node {i} log ----\n" + b.log_text()[-8000:])


def channel(node):
    return node.connection().channel()


def declare_topology(ch, name):
    """A durable exchange, a durable queue and a binding; returns after bind-ok."""
    ch.exchange_declare(name + "-ex", "direct", durable=True)
    ch.queue_declare(name, durable=True)
    ch.queue_bind(name, name + "-ex", "k")


def wait_for_leader(node):
    """The first durable change waits for group 0 to elect a leader (a few seconds)."""
    ch = channel(node)
    ch.queue_declare("warm-up", durable=True)
    ch.connection.close()


def test_declare_on_one_node_then_publish_and_consume_on_others_right_after_declare_ok(cluster):
    n1, n2, n3 = cluster
    wait_for_leader(n1)
    c1, c2, c3 = channel(n1), channel(n2), channel(n3)
    c2.confirm_delivery()
    for i in range(20):
        name = f"q{i}"
        declare_topology(c1, name)
        # Right after bind-ok on node 1: node 2 routes (mandatory: an unroutable message would be
        # returned, which pika turns into UnroutableError) and confirms.
        c2.basic_publish(name + "-ex", "k", b"m", pika.BasicProperties(delivery_mode=2), mandatory=True)
        # Node 3 knows the queue (passive declare: a 404 would close the channel).
        c3.queue_declare(name, passive=True)
        # And the default exchange on node 3 routes to it by name.
        c3.basic_publish("", name, b"m", mandatory=True)
    # A consumer on node 3 may subscribe to a queue declared on node 1 just before.
    declare_topology(c1, "fresh")
    c3.basic_consume("fresh", lambda *a: None, auto_ack=True)


def test_a_deletion_on_one_node_is_seen_on_the_others(cluster):
    n1, n2, n3 = cluster
    wait_for_leader(n1)
    c1 = channel(n1)
    declare_topology(c1, "doomed")
    c3 = channel(n3)
    c3.queue_delete("doomed")
    c3.exchange_delete("doomed-ex")

    def gone_on(node):
        ch = channel(node)
        try:
            ch.queue_declare("doomed", passive=True)
            return False
        except pika.exceptions.ChannelClosedByBroker as e:
            return e.reply_code == 404

    eventually(lambda: gone_on(n1), timeout=5)
    eventually(lambda: gone_on(n2), timeout=5)
    ch = channel(n1)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.exchange_declare("doomed-ex", "direct", passive=True)
    assert e.value.reply_code == 404


def test_a_restarted_node_gets_the_topology_back_with_what_it_missed(cluster):
    n1, n2, n3 = cluster
    wait_for_leader(n1)
    c1 = channel(n1)
    declare_topology(c1, "before")
    declare_topology(c1, "deleted-while-away")
    n2.terminate()
    declare_topology(c1, "while-away")
    c1.queue_delete("deleted-while-away")
    n2.start()

    def caught_up():
        ch = channel(n2)
        try:
            ch.queue_declare("while-away", passive=True)
            return True
        finally:
            if ch.connection.is_open:
                ch.connection.close()
    # A lookup miss waits only a few seconds for the restarted node to catch up: wait for it here.
    eventually(caught_up, timeout=15)
    c2 = channel(n2)
    for name in ("before", "while-away"):
        c2.queue_declare(name, passive=True)
        c2.basic_publish(name + "-ex", "k", b"m", mandatory=True)

    def deleted_on_n2():
        ch = channel(n2)
        try:
            ch.queue_declare("deleted-while-away", passive=True)
            return False
        except pika.exceptions.ChannelClosedByBroker as e:
            return e.reply_code == 404

    eventually(deleted_on_n2, timeout=10)


def exists(node, queue):
    ch = channel(node)
    try:
        ch.queue_declare(queue, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker as e:
        assert e.reply_code == 404
        return False


def test_without_a_quorum_a_durable_declare_fails_with_541(cluster):
    n1, n2, n3 = cluster
    wait_for_leader(n1)
    conn = n1.connection()
    n2.terminate()
    n3.terminate()
    started = time.time()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e:
        conn.channel().queue_declare("no-quorum", durable=True)
    assert e.value.reply_code == 541, e.value
    assert "metadata group" in e.value.reply_text, e.value.reply_text
    assert time.time() - started < 30
    # A transient queue is recorded in the group too (every node routes to it), as RabbitMQ 4's
    # Khepri records every queue: it needs a quorum as well.
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e:
        n1.connection().channel().queue_declare("transient-here", durable=False)
    assert e.value.reply_code == 541, e.value
    # Once a quorum is back, the nodes agree on whether the declares took effect (a leader that had
    # appended them may still commit them: the 541 said they might).
    n2.start()
    for name in ("no-quorum", "transient-here"):
        eventually(lambda: exists(n1, name) == exists(n2, name), timeout=15)


def declare_outcome(declare):
    """'ok', or the reply text of the channel.close the declare got."""
    try:
        declare()
        return "ok"
    except pika.exceptions.ChannelClosedByBroker as e:
        assert e.reply_code == 406, e
        return e.reply_text


def test_a_declare_inequivalent_to_one_committed_on_another_node_gets_406(cluster):
    n1, n2, n3 = cluster
    wait_for_leader(n1)
    channel(n1).queue_declare("q-committed", durable=True)
    channel(n1).exchange_declare("ex-committed", "direct", durable=True)
    assert declare_outcome(lambda: channel(n2).queue_declare("q-committed", durable=False)) == (
        "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q-committed' in vhost '/': received 'false' but current is 'true'")
    assert declare_outcome(lambda: channel(n3).exchange_declare("ex-committed", "fanout", durable=True)) == (
        "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'ex-committed' in vhost '/': received 'fanout' but current is 'direct'")


def test_concurrent_inequivalent_declares_on_two_nodes_one_gets_406(cluster):
    """Two clients declare one name at the same moment on two nodes with other properties: both
    declarations reach the metadata group, the first in its log wins and the other's client gets
    406 (inequivalent arg), as in RabbitMQ; never declare-ok for a queue or exchange other than the
    one it asked for. Each round starts both declares together (a thread barrier) on fresh names.
    (Before the fix, round 0 already gave both clients declare-ok.)"""

    n1, n2, _ = cluster
    wait_for_leader(n1)
    conns = [n1.connection(), n2.connection()]
    rounds = 30
    start = threading.Barrier(2)
    outcomes = [[None] * rounds for _ in conns]

    def declare(node, kind, i):
        if kind == "queue-type":  # a quorum queue against a classic one
            args = {"x-queue-type": "quorum"} if node == 0 else {}
            return lambda ch: ch.queue_declare(f"race-qt-{i}", durable=True, arguments=args)
        if kind == "queue":
            return lambda ch: ch.queue_declare(f"race-q-{i}", durable=True, auto_delete=node == 1)
        return lambda ch: ch.exchange_declare(f"race-ex-{i}", "direct" if node == 0 else "fanout", durable=True)

    def kind_of(i):
        return "queue-type" if i < 3 else ("queue" if i % 2 else "exchange")

    def client(node):
        conn = conns[node]
        for i in range(rounds):
            ch = conn.channel()
            fn = declare(node, kind_of(i), i)
            start.wait(timeout=60)
            outcomes[node][i] = declare_outcome(lambda: fn(ch))
            if ch.is_open:
                ch.close()

    threads = [threading.Thread(target=client, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for c in conns:
        c.close()
    for i in range(rounds):
        pair = (outcomes[0][i], outcomes[1][i])
        assert sorted(o == "ok" for o in pair) == [False, True], (i, kind_of(i), pair)
        refused = next(o for o in pair if o != "ok")
        assert refused.startswith("PRECONDITION_FAILED - inequivalent arg '"), refused


def test_after_bind_ok_on_one_node_a_publish_on_another_routes_with_the_binding(cluster):
    """Issue 33, item 4: read-your-writes for declarations across nodes. Right after bind-ok on
    node 1, a publish on node 2 reaches the new queue: through a fanout exchange that routes to
    older queues too (so the miss barrier never ran), and through an alternate exchange. A
    declaration's -ok waits for every reachable node to apply it, as RabbitMQ's Mnesia commits
    on every node. Before, node 2 applied the binding a little later, and missed some."""
    n1, n2, n3 = cluster
    wait_for_leader(n1)
    ch1 = channel(n1)
    publisher = n2.connection()
    ch2 = publisher.channel()
    ch2.confirm_delivery()
    ch1.exchange_declare("fan", "fanout", durable=True)
    ch1.queue_declare("fan-0", durable=True)
    ch1.queue_bind("fan-0", "fan")
    ch1.exchange_declare("ae", "fanout", durable=True)
    ch1.exchange_declare("with-ae", "direct", durable=True, arguments={"alternate-exchange": "ae"})
    ch1.queue_declare("ae-0", durable=True)
    ch1.queue_bind("ae-0", "ae")
    rounds = 40
    for i in range(1, rounds + 1):
        ch1.queue_declare(f"fan-{i}", durable=True)
        ch1.queue_bind(f"fan-{i}", "fan")
        ch2.basic_publish("fan", "", b"fan %d" % i)
        ch1.queue_declare(f"ae-{i}", durable=True)
        ch1.queue_bind(f"ae-{i}", "ae")
        ch2.basic_publish("with-ae", "nowhere", b"ae %d" % i)
    publisher.close()
    counts = {}
    for prefix in ("fan", "ae"):
        for i in range(rounds + 1):
            counts[f"{prefix}-{i}"] = ch1.queue_declare(f"{prefix}-{i}", passive=True).method.message_count
    expected = {f"{prefix}-{i}": rounds - max(i, 1) + 1 for prefix in ("fan", "ae") for i in range(rounds + 1)}
    missed = {q: (counts[q], want) for q, want in expected.items() if counts[q] != want}
    assert not missed, f"queues with fewer messages than publishes after their bind-ok (got, want): {missed}"


def last_metadata_index(node):
    """The metadata group's last log index as `warren ctl cluster-status` on `node` shows it."""
    out = subprocess.run([BIN, "ctl", "--node", f"127.0.0.1:{node.cluster_port}", "--cluster-secret", SECRET,
                          "--timeout", "5", "--json", "cluster-status"], capture_output=True, text=True, timeout=50, check=True)
    return next(g["last_log_index"] for g in json.loads(out.stdout)["groups"] if g["group"] == 0)


def test_unroutable_publishes_add_nothing_to_the_metadata_log(cluster):
    """Issue 33, item 4: a publish that routes nowhere waits for a read barrier of the metadata
    group (something declared elsewhere may not be applied here yet): the leader's read index, a
    heartbeat round, not an entry; concurrent ones share it. 8 connections publishing 200
    unroutable messages each on node 2 add (almost) nothing to the group's log (before: one
    entry each, 1,600)."""
    n1, n2, n3 = cluster
    wait_for_leader(n1)

    errors = []

    def publish_nowhere():
        try:
            c = n2.connection()
            ch = c.channel()
            for i in range(200):
                ch.basic_publish("", "no-such-queue", b"x")
            c.channel().close()
            c.close()
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    before = last_metadata_index(n2)
    threads = [threading.Thread(target=publish_nowhere) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    used = last_metadata_index(n2) - before
    print(f"{used} metadata entries for 1,600 unroutable publishes on 8 connections")
    assert used < 20, f"{used} metadata entries for 1,600 unroutable publishes"
