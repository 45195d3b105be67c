"""The cluster's metadata group (issue 10): three `warren server` processes on loopback ports with
--peers share one durable topology. A client may declare on any node and use the declaration on
another right after declare-ok; a deletion on one node is seen on the others; a node that was
down gets what it missed; without a quorum a durable declare fails with 541 and changes nothing.

About 40 s (elections, one 10 s commit timeout)."""
import time

import pika
import pytest

from conftest import Broker, eventually, free_port

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
    # Transient things never need the group.
    channel(n1).queue_declare("transient-here", durable=False)
    # Once a quorum is back, the nodes agree on whether the declare took effect (a leader that had
    # appended it may still commit it: the 541 said it might).
    n2.start()
    eventually(lambda: exists(n1, "no-quorum") == exists(n2, "no-quorum"), timeout=15)
    assert not exists(n2, "transient-here")
