"""RPC across a three-node cluster (issue 33, item 3): an RPC server consuming on node 2 answers
clients on nodes 1 and 3 through direct reply-to (`amq.rabbitmq.reply-to`), 10,000 calls each,
none lost. The reply is published on node 2 and goes to the node of the waiting consumer, whose
node id its reply address carries. (Before, the reply registry was per node: none of the replies
arrived.) About 30 s.
"""
import threading
import time

import pika
import pytest

from conftest import three_node_cluster
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


def call(node, queue, calls):
    """`calls` requests through `node` with direct reply-to; returns the set of replies received."""
    conn = node.connection()
    ch = conn.channel()
    got = set()
    ch.basic_consume("amq.rabbitmq.reply-to", lambda c, m, p, b: got.add(b), auto_ack=True)
    for i in range(calls):
        ch.basic_publish("", queue, b"%d" % i, pika.BasicProperties(reply_to="amq.rabbitmq.reply-to", correlation_id=str(i)))
        if i % 500 == 499:
            conn.process_data_events(time_limit=0)
    deadline = time.time() + 60
    while len(got) < calls and time.time() < deadline:
        conn.process_data_events(time_limit=0.1)
    conn.close()
    return got


def test_direct_replies_reach_clients_on_other_nodes(cluster):
    declare_on(cluster, "rpc", home=2)
    server = RpcServer(cluster[2], "rpc")
    server.start()
    assert server.ready.wait(20) and server.error is None, server.error
    try:
        for node in (1, 3):
            got = call(cluster[node], "rpc", CALLS)
            assert len(got) == CALLS, f"node {node}: {len(got)} of {CALLS} replies (server answered {server.answered})"
            assert got == {b"%d" % i for i in range(CALLS)}
    finally:
        server.stop.set()
        server.join(10)
    assert server.error is None, server.error
