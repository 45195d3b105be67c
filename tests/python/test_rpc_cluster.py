"""RPC across a three-node cluster (issue 33, item 3): an RPC server consuming on node 2 answers
clients on nodes 1 and 3, 10,000 calls each, none lost, through direct reply-to
(`amq.rabbitmq.reply-to`: the reply goes to the node of the waiting consumer, whose node id its
reply address carries; before, the reply registry was per node) and through each client's
exclusive server-named reply queue (recorded cluster-wide in the metadata group, living on the
client's node; before, it was known to that node only and every reply was dropped).
Also what RabbitMQ's exclusive and transient queues promise cluster-wide: a second exclusive
declare on another node gets 405, a transient queue shadows no durable one, bindings to it route
from every node, and its node deletes it when it restarts. About 90 s.
"""
import json
import subprocess
import threading
import time

import pika
import pytest

from conftest import BIN, eventually, three_node_cluster
from test_classic_cluster import declare_on

pytestmark = [pytest.mark.warren_only]

SECRET = "rpc-cluster-secret"
CALLS = 10_000


@pytest.fixture
def cluster(tmp_path):
    yield from three_node_cluster(tmp_path, SECRET)


class RpcServer(threading.Thread):
    """Answers each request on `queue` (through `node`) with its body, to its reply_to."""

    def __init__(self, node, queue):
        super().__init__(daemon=True)
        self.node, self.queue = node, queue
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.answered = 0
        self.error = None

    def run(self):
        try:
            conn = self.node.connection()
            ch = conn.channel()
            ch.basic_qos(prefetch_count=500)

            def on_request(c, method, props, body):
                c.basic_publish("", props.reply_to, body, pika.BasicProperties(correlation_id=props.correlation_id))
                c.basic_ack(method.delivery_tag)
                self.answered += 1

            ch.basic_consume(self.queue, on_request)
            self.ready.set()
            while not self.stop.is_set():
                conn.process_data_events(time_limit=0.1)
            conn.close()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e
            self.ready.set()


def call(node, queue, calls, exclusive_reply_queue=False):
    """`calls` requests through `node`, the replies to direct reply-to or to an exclusive
    server-named queue; returns the set of replies received."""
    conn = node.connection()
    ch = conn.channel()
    got = set()
    reply_to = "amq.rabbitmq.reply-to"
    if exclusive_reply_queue:
        reply_to = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_consume(reply_to, lambda c, m, p, b: got.add(b), auto_ack=True)
    for i in range(calls):
        ch.basic_publish("", queue, b"%d" % i, pika.BasicProperties(reply_to=reply_to, correlation_id=str(i)))
        if i % 500 == 499:
            conn.process_data_events(time_limit=0)
    deadline = time.time() + 60
    while len(got) < calls and time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    conn.close()
    return got


@pytest.mark.parametrize("replies", ["direct reply-to", "exclusive reply queue"])
def test_replies_reach_clients_on_other_nodes(cluster, replies):
    declare_on(cluster, "rpc", home=2)
    server = RpcServer(cluster[2], "rpc")
    server.start()
    assert server.ready.wait(20) and server.error is None, server.error
    try:
        for node in (1, 3):
            got = call(cluster[node], "rpc", CALLS, exclusive_reply_queue=replies == "exclusive reply queue")
            assert len(got) == CALLS, f"node {node}: {len(got)} of {CALLS} replies (server answered {server.answered})"
            assert got == {b"%d" % i for i in range(CALLS)}
    finally:
        server.stop.set()
        server.join(10)
    assert server.error is None, server.error


def declare_error(node, name, **kw):
    """The reply code of a queue.declare through `node` that fails (None if it succeeds)."""
    c = node.connection()
    try:
        c.channel().queue_declare(name, **kw)
        return None
    except pika.exceptions.ChannelClosedByBroker as e:
        return e.reply_code
    finally:
        if c.is_open:
            c.close()


def test_an_exclusive_queue_is_locked_on_every_node(cluster):
    owner = cluster[1].connection()
    owner.channel().queue_declare("locked", exclusive=True)
    for node in (2, 3):
        assert declare_error(cluster[node], "locked", exclusive=True) == 405
        assert declare_error(cluster[node], "locked", passive=True) == 405
        c = cluster[node].connection()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            c.channel().basic_consume("locked", lambda *a: None)
        assert refused.value.reply_code == 405
        if c.is_open:
            c.close()
    # The owner's connection gone, its queue goes on every node: another node can declare it.
    owner.close()
    eventually(lambda: declare_error(cluster[2], "locked", exclusive=True) is None, timeout=10)


def test_a_transient_queue_shadows_no_durable_queue(cluster):
    c = cluster[1].connection()
    c.channel().queue_declare("shadow", durable=False)
    c.close()
    assert declare_error(cluster[2], "shadow", durable=True) == 406
    # And the other way round.
    declare_on(cluster, "durable-one", home=2)
    assert declare_error(cluster[1], "durable-one", durable=False) == 406


def test_bindings_to_an_exclusive_queue_route_from_every_node(cluster):
    conn = cluster[1].connection()
    ch = conn.channel()
    name = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(name, "amq.fanout")
    publisher = cluster[2].connection()
    pch = publisher.channel()
    pch.confirm_delivery()
    for i in range(1000):
        pch.basic_publish("amq.fanout", "", b"%d" % i, mandatory=True)
    publisher.close()
    got = set()
    ch.basic_consume(name, lambda c, m, p, b: got.add(b), auto_ack=True)
    deadline = time.time() + 30
    while len(got) < 1000 and time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    conn.close()
    assert got == {b"%d" % i for i in range(1000)}


def test_a_restarted_node_deletes_its_transient_queues(cluster):
    c = cluster[1].connection()
    c.channel().queue_declare("transient-on-1", durable=False)
    c.close()
    # Known on every node (it lives on node 1)...
    assert declare_error(cluster[2], "transient-on-1", passive=True) is None
    # ...until node 1 restarts: a transient queue ends with its node's run, as in RabbitMQ.
    cluster[1].kill9()
    cluster[1].start()
    eventually(lambda: declare_error(cluster[2], "transient-on-1", passive=True) == 404, timeout=30)
    assert declare_error(cluster[1], "transient-on-1", passive=True) == 404


def metadata_leader(node):
    """The metadata group's leader as `warren ctl cluster-status` on `node` shows it (None if unknown)."""
    out = subprocess.run([BIN, "ctl", "--node", f"127.0.0.1:{node.cluster_port}", "--cluster-secret", SECRET,
                          "--timeout", "5", "--json", "cluster-status"], capture_output=True, text=True, timeout=50)
    if out.returncode != 0:
        return None
    return next((g.get("leader") for g in json.loads(out.stdout).get("groups", []) if g["group"] == 0), None)


@pytest.mark.parametrize("how", ["auto-delete", "exclusive owner gone"])
def test_a_deletion_the_group_could_not_commit_is_retried(cluster, how):
    """Issue 33, item 7: the last consumer of an auto-delete queue cancels, or an exclusive queue's
    owner closes, while the metadata group has no quorum: the deletion cannot be committed then,
    and goes through once the group is back (before, it was dropped and the queue stayed)."""
    leader = eventually(lambda: metadata_leader(cluster[1]), timeout=20)
    # On a follower: with the others down, nothing it proposes reaches any log (a leader's own
    # proposal would be appended, and committed anyway once a quorum is back).
    me = next(n for n in (1, 2, 3) if n != leader)
    others = [n for n in (1, 2, 3) if n != me]
    conn = cluster[me].connection()
    ch = conn.channel()
    if how == "auto-delete":
        ch.queue_declare("going", durable=True, auto_delete=True)
        tag = ch.basic_consume("going", lambda *a: None)
    else:
        ch.queue_declare("going", exclusive=True)
    for n in others:
        cluster[n].terminate()
    if how == "auto-delete":
        ch.basic_cancel(tag)
    conn.close()
    time.sleep(2)
    for n in others:
        cluster[n].start()
    eventually(lambda: all(declare_error(cluster[n], "going", passive=True) == 404 for n in (1, 2, 3)), timeout=40)
