"""Issue 34: a quorum queue replica whose stored Raft log lost files rebuilds from its peers, and
does not help elect a leader that lacks what it had acknowledged.

n3 is frozen (SIGSTOP) while messages are published and confirmed, so each confirm counts n1 and
n2. n2 is stopped cleanly (its checkpoint names where each Raft log's records are: extents of WAL
segments, or queue files) and those files are deleted: a disk that lost them. n1 is killed, n2 restarted on what is left, n3 thawed.
n2 and n3 form a majority, but n3 lacks every confirmed message and n2 forgot them: a vote from n2
would elect n3 and lose them all. n2 must start on its own (reporting the loss), refuse its vote
while it rebuilds, and, once n1 is back, catch up; then every confirmed message is consumed, and n2
reports the group rebuilt. About 30 s.
"""
import time

import pytest

from workload import Client

pytestmark = [pytest.mark.cluster_fault]

QUEUE = "rebuild-q"
QUORUM = {"x-queue-type": "quorum"}
COUNT = 300
RAFT_QUEUES = 1 << 61  # store queue ids from here on hold Raft logs and state (warren_store::is_raft_queue)


def publish_confirmed(client, count):
    client.confirm_select()
    for i in range(count):
        client.send(client.publish_frames(QUEUE, f"m{i:05d}".encode().ljust(200, b".")))
    acked, deadline = set(), time.monotonic() + 30
    while len(acked) < count and time.monotonic() < deadline:
        for e in client.events(0.5):
            if e[0] == "ack":
                acked |= set(range(1, e[1] + 1)) if e[2] else {e[1]}
            assert e[0] != "nack", f"a publish was refused: {e}"
    assert len(acked) == count, f"{len(acked)} of {count} confirmed"


def raft_log_files(node):
    """The store files that hold the node's Raft log records after a clean stop: the WAL segments
    (the checkpoint names their records as extents of the Raft queues) and any queue files of Raft
    queues."""
    store = node.data_dir / "store"
    queues = [d for d in (store / "queues").iterdir() if d.name.isdigit() and int(d.name) >= RAFT_QUEUES]
    return list((store / "wal").glob("*.wlog")) + [f for d in queues for f in d.glob("*.qseg")]


def test_a_replica_that_lost_its_log_rebuilds_from_its_peers_and_never_elects_a_stale_leader(cluster):
    n1, n2, n3 = (cluster.node(n) for n in (1, 2, 3))
    admin = Client(n1.host, n1.port)
    admin.declare(QUEUE, QUORUM)
    admin.close()
    assert cluster.leader(QUEUE) in (1, 2, 3)
    n3.pause()
    try:
        publisher = Client(n1.host, n1.port)
        publish_confirmed(publisher, COUNT)
        publisher.close()
        assert n2.terminate() == 0, n2.log_tail()
        lost = raft_log_files(n2)
        assert lost, "n2's Raft log records are in store files after a clean stop"
        for f in lost:
            f.unlink()
        n1.kill9()
        n2.start()
    finally:
        n3.resume()
    log = n2.log_text()
    assert "messages were lost with store files that are missing" in log, n2.log_tail()
    assert "rebuilds it from the other members" in log, n2.log_tail()
    # n2 and n3 are a majority, but only a vote from n2 could elect n3, which lacks the messages.
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        elected = queue_leaders_besides(cluster, 1)
        assert not elected, f"elected while n2 rebuilds and n1 is down: {elected} (n3 lacks every confirmed message)"
        time.sleep(0.5)
    n1.start()
    # Both groups (the metadata group and the queue's) lost their log on n2 and are rebuilt.
    rebuilding = n2.log_text().count("rebuilds it from the other members")
    assert rebuilding == 2, n2.log_tail()
    deadline = time.monotonic() + 60
    while n2.log_text().count("group rebuilt from the other members") < rebuilding:
        assert time.monotonic() < deadline, f"n2 never finished rebuilding: {group_views(cluster)}\n{n2.log_tail()}"
        time.sleep(0.5)
    # Every confirmed message is there, served by whichever node leads now.
    got = set()
    consumer = Client(n2.host, n2.port)
    deadline = time.monotonic() + 30
    while len(got) < COUNT and time.monotonic() < deadline:
        r = consumer.get(QUEUE, no_ack=True, timeout=5)
        if r is None:
            time.sleep(0.2)
            continue
        got.add(r[1][:6].decode())
    consumer.close()
    assert got == {f"m{i:05d}" for i in range(COUNT)}, f"{COUNT - len(got)} confirmed messages missing"


def queue_leaders_besides(cluster, dead):
    """(node, term) of each live node that names a leader of the quorum queue's group other than
    `dead` (whose own leadership is stale: it was killed)."""
    out = []
    for node, status in cluster.statuses():
        if isinstance(status, dict):
            out += [(f"{node} names n{g['leader']}", g.get("term")) for g in status.get("groups", [])
                    if g.get("group") != 0 and g.get("leader") not in (None, dead)]
    return out


def group_views(cluster):
    """Each live node's view of the quorum queue's group (for failure messages)."""
    return [(str(node), [{k: g.get(k) for k in ("state", "term", "leader", "last_log_index", "committed", "applied")}
                         for g in status.get("groups", []) if g.get("group") != 0] if isinstance(status, dict) else status)
            for node, status in cluster.statuses()]
