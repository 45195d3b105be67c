"""A classic queue across the nodes of a cluster: three Warren nodes on loopback, a durable classic
queue declared on node 2 (its home); `warren bench` with 1 KB persistent messages, confirms 1000 in
flight, prefetch 1000, ack every 100, first with the publisher and the consumer on node 2, then
with the publisher on node 1 and the consumer on node 3 (publishes forwarded to node 2, deliveries
relayed from it). A look at the cost of crossing nodes, not a comparison with RabbitMQ.

Usage: python3 bench/classic_across_nodes.py [SECONDS]   (needs target/release/warren)"""
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "python"))
from conftest import BIN, three_node_cluster  # noqa: E402

seconds = sys.argv[1] if len(sys.argv) > 1 else "10"
cluster = three_node_cluster(pathlib.Path(tempfile.mkdtemp()), "classic-across-nodes")
nodes = next(cluster)
c = nodes[2].connection()
c.channel().queue_declare("across", durable=True)
c.close()
time.sleep(1)


def uri(n):
    return f"amqp://guest:guest@127.0.0.1:{nodes[n].port}/%2F"


common = ["--size", "1000", "--persistent", "--predeclared", "--queue", "across", "--time", seconds]
consumer = ["--producers", "0", "--consumers", "1", "--prefetch", "1000", "--multi-ack-every", "100"]
producer = ["--producers", "1", "--consumers", "0", "--confirm", "1000"]
for label, runs in {
    "publisher and consumer on the home (node 2)": [(2, consumer), (2, producer)],
    "publisher on node 1, consumer on node 3, home node 2": [(3, consumer), (1, producer)],
}.items():
    procs = [subprocess.Popen([BIN, "bench", "--uri", uri(n)] + common + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n, args in runs]
    print(f"== {label}")
    for p in procs:
        out = p.communicate()[0]
        print("\n".join(line for line in out.splitlines() if line.startswith("  ")))
try:
    next(cluster)
except StopIteration:
    pass
