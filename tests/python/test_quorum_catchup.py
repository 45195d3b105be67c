"""A quorum-queue replica that was down while the others snapshotted and purged their Raft log past
it comes back through an InstallSnapshot, which carries the queue's state but no message bodies: it
must fetch the bodies of the live messages from a peer before it applies anything after the snapshot,
and deliver every confirmed message to its own consumers (never discard one for want of its body: a
discard removes the message for the whole cluster).

Three real `warren server` processes on loopback. `WARREN_TEST_SNAPSHOT_EVERY` (test-only) makes the
groups snapshot every 40 entries (keeping 8), so a few hundred confirmed publishes put the returning
node past the leader's log. About 15 s. The large-backlog variant (memory stays bounded while the
returning node fetches hundreds of MB) is opt-in: WARREN_CATCHUP_BIG=1 (about 15 s; the backlog is
WARREN_CATCHUP_MESSAGES messages of WARREN_CATCHUP_SIZE bytes, default 4000 of 64 KiB).
"""
import json
import os
import re
import subprocess
import threading
import time

import pika
import pytest

from conftest import BIN, eventually, three_node_cluster

pytestmark = [pytest.mark.warren_only]

SECRET = "catchup-test-secret"
QUORUM = {"x-queue-type": "quorum"}


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("WARREN_TEST_SNAPSHOT_EVERY", "40")
    yield from three_node_cluster(tmp_path, SECRET)


def declare_everywhere(nodes, name):
    c = nodes[1].connection()
    c.channel().queue_declare(name, durable=True, arguments=QUORUM)
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
    """One publish at a time, each confirmed before the next: one Raft entry each (or close)."""
    c = node.connection()
    ch = c.channel()
    ch.confirm_delivery()
    for body in bodies:
        ch.basic_publish("", name, body, pika.BasicProperties(delivery_mode=2))
    c.close()


def publish_in_parallel(node, name, bodies, connections=4):
    parts = [bodies[i::connections] for i in range(connections)]
    errors = []

    def run(part):
        try:
            publish_confirmed(node, name, part)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def consume_all(node, name, count, timeout=60, prefetch=50):
    """Manual acks, through `node` only. Returns the bodies delivered (duplicates kept)."""
    c = node.connection()
    ch = c.channel()
    ch.basic_qos(prefetch_count=prefetch)
    got = []

    def on_message(chan, method, props, body):
        got.append(body)
        chan.basic_ack(method.delivery_tag)

    ch.basic_consume(name, on_message)
    deadline = time.time() + timeout
    while len(set(got)) < count and time.time() < deadline:
        c.process_data_events(time_limit=0.2)
    ch.basic_cancel(ch.consumer_tags[0])
    c.process_data_events(time_limit=0.2)
    c.close()
    return got


def ready_count(node, name):
    c = node.connection()
    try:
        return c.channel().queue_declare(name, passive=True).method.message_count
    finally:
        if c.is_open:
            c.close()


def publish_past_node_3(cluster, name, pad, kinds, step):
    """Kills node 3, then publishes (confirmed, through node 1) hundreds of entries: the leader
    snapshots and purges its log past node 3. Returns the bodies: (during, late)."""
    cluster[3].kill9()
    during = [f"during-{i}-".encode() + pad * (i % kinds * step) for i in range(400)]
    publish_in_parallel(cluster[1], name, during)
    # The leader builds its snapshots and purges its log in the background: a pause, more entries
    # (another snapshot past node 3) and another pause, so that node 3 cannot come back through the
    # log alone.
    time.sleep(1)
    late = [f"late-{i}".encode() for i in range(100)]
    publish_in_parallel(cluster[1], name, late)
    time.sleep(1)
    return during, late


def test_a_node_back_through_a_snapshot_delivers_every_confirmed_message(cluster):
    name = "qq-catchup"
    declare_everywhere(cluster, name)
    # Live before the outage: the returning node has these bodies in its own store.
    before = [f"before-{i}".encode() for i in range(30)]
    publish_confirmed(cluster[1], name, before)
    during, late = publish_past_node_3(cluster, name, b"x", 7, 300)
    cluster[3].start()
    eventually(lambda: "caught up" in cluster[3].log_text() or "fetched the bodies" in cluster[3].log_text(), timeout=60)
    # Restarted after the install: the fetched bodies come back from the queue's records, the ones
    # node 3 had before (not fetched) from its own entries, which the install's purge kept.
    cluster[3].kill9()
    cluster[3].start()
    confirmed = before + during + late
    got = consume_all(cluster[3], name, len(confirmed))
    log3 = cluster[3].log_text()
    missing = set(confirmed) - set(got)
    assert not missing, f"{len(missing)} confirmed messages never delivered through the returning node, e.g. {[m[:12] for m in sorted(missing)[:5]]}"
    assert "discarding it" not in log3, "a replica discarded a message it had no body for"
    assert "caught up" in log3 or "fetched the bodies" in log3, "node 3 did not come back through a snapshot"
    # Every message was acked once: the queue is empty everywhere.
    eventually(lambda: all(ready_count(b, name) == 0 for b in cluster.values()), timeout=20)


@pytest.fixture
def cluster_unreadable_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WARREN_TEST_SNAPSHOT_EVERY", "40")
    monkeypatch.setenv("WARREN_TEST_UNREADABLE_BODIES_ONCE", "1")
    yield from three_node_cluster(tmp_path, SECRET)


def test_a_peer_that_cannot_read_a_live_body_fails_the_fetch_and_another_serves_it(cluster_unreadable_once):
    """Issue 32, item 4: every node answers its first body request as if it could not read any of
    its bodies (a test hook: as if a pinned entry were lost). The returning node must not take that
    answer as complete (it would never deliver those messages): the request fails, it asks the
    other member, then the first again, until every body is here."""
    cluster = cluster_unreadable_once
    name = "qq-unreadable"
    declare_everywhere(cluster, name)
    during, late = publish_past_node_3(cluster, name, b"u", 5, 200)
    cluster[3].start()
    eventually(lambda: "fetched the bodies" in cluster[3].log_text(), timeout=60)
    served = [i for i in (1, 2) if "answered a body request as if no body were readable" in cluster[i].log_text()]
    assert served, "no peer answered the way the hook makes it: the test did not test anything"
    confirmed = during + late
    got = consume_all(cluster[3], name, len(confirmed))
    missing = set(confirmed) - set(got)
    assert not missing, f"{len(missing)} confirmed messages never delivered through the returning node, e.g. {[m[:12] for m in sorted(missing)[:5]]}"
    assert "discarding it" not in cluster[3].log_text()
    assert "trying another" in cluster[3].log_text()
    eventually(lambda: all(ready_count(b, name) == 0 for b in cluster.values()), timeout=20)


def rss_kb(proc):
    with open(f"/proc/{proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(os.environ.get("WARREN_CATCHUP_BIG") != "1", reason="opt-in: WARREN_CATCHUP_BIG=1 (about a minute)")
def test_a_node_back_after_a_long_outage_fetches_a_large_backlog_with_bounded_memory(cluster):
    name = "qq-catchup-big"
    declare_everywhere(cluster, name)
    cluster[3].kill9()
    size = int(os.environ.get("WARREN_CATCHUP_SIZE", str(64 << 10)))
    count = int(os.environ.get("WARREN_CATCHUP_MESSAGES", "4000"))  # 4000 x 64 KiB = 250 MiB
    bodies = [f"big-{i:06}-".encode().ljust(size, b"y") for i in range(count)]
    publish_in_parallel(cluster[1], name, bodies, connections=8)
    start = time.time()
    cluster[3].start()
    peak = 0
    # Node 3 catches up (its log says so), its memory sampled meanwhile.
    while time.time() - start < 300:
        peak = max(peak, rss_kb(cluster[3].proc))
        if "fetched the bodies" in cluster[3].log_text():
            break
        time.sleep(0.05)
    log3 = cluster[3].log_text()
    m = re.search(r"fetched the bodies.*", log3)
    assert m, "node 3 did not fetch the bodies of a snapshot"
    print("catch-up:", m.group(0))
    print(f"node 3 peak RSS while catching up: {peak // 1024} MiB for a {count * size >> 20} MiB backlog")
    assert peak < 400 << 10, f"node 3 used {peak // 1024} MiB while catching up a {count * size >> 20} MiB backlog"
    got = consume_all(cluster[3], name, count, timeout=240, prefetch=200)
    missing = set(bodies) - set(got)
    assert not missing, f"{len(missing)} confirmed messages never delivered through the returning node"
    assert "discarding it" not in cluster[3].log_text()


@pytest.fixture
def plain_cluster(tmp_path):
    """Three nodes with the production snapshot policy (no test switch: the release binary)."""
    yield from three_node_cluster(tmp_path, SECRET)


def bench(node, tmp_path, tag, *args):
    """`warren bench` against `node`; returns its JSON summary."""
    out = tmp_path / f"{tag}.json"
    subprocess.run(
        [BIN, "bench", "--uri", node.url, "--queue", "qq-ten-million", "--predeclared", "--progress-every", "30",
         "--json", str(out), *args],
        check=True, timeout=1800,
    )
    return json.loads(out.read_text())


@pytest.mark.skipif(os.environ.get("WARREN_CATCHUP_TEN_MILLION") != "1", reason="opt-in: WARREN_CATCHUP_TEN_MILLION=1 (several minutes)")
def test_a_node_back_after_ten_million_messages_catches_up_and_delivers_them_all(plain_cluster, tmp_path):
    """Issue 32, item 9: a follower down while 10,000,000 persistent messages (WARREN_CATCHUP_MESSAGES)
    were confirmed comes back through a snapshot larger than one frame chunk and the fetch of every
    body, then delivers every one of them through itself."""
    cluster = plain_cluster
    count = int(os.environ.get("WARREN_CATCHUP_MESSAGES", "10000000"))
    producers = 4
    declare_everywhere(cluster, "qq-ten-million")
    cluster[3].kill9()
    start = time.time()
    sent = bench(cluster[1], tmp_path, "publish", "--producers", str(producers), "--consumers", "0",
                 "--pmessages", str(count // producers), "--size", "16", "--persistent", "--confirm", "2000")
    assert sent["confirmed"] == count, sent
    print(f"published {count} in {time.time() - start:.0f} s")
    start = time.time()
    cluster[3].start()
    eventually(lambda: "fetched the bodies" in cluster[3].log_text(), timeout=1800, interval=1)
    m = re.search(r"fetched the bodies.*", re.sub(r"\x1b\[[0-9;]*m", "", cluster[3].log_text()))
    print(f"node 3 caught up in {time.time() - start:.0f} s: {m.group(0) if m else ''}")
    start = time.time()
    got = bench(cluster[3], tmp_path, "consume", "--producers", "0", "--consumers", "2", "--cmessages", str(count // 2),
                "--prefetch", "2000", "--multi-ack-every", "200")
    print(f"consumed {got['consumed']} through node 3 in {time.time() - start:.0f} s")
    assert got["consumed"] == count, got
    eventually(lambda: all(ready_count(b, "qq-ten-million") == 0 for b in cluster.values()), timeout=120)
