"""A relay on the cluster link between two real nodes: it forwards the handshake (it does not know
the cluster secret, and needs not), then writes a well-formed frame of its own into the stream, as a
man in the middle would. The frame is not sealed with the connection's keys, so the node that reads
it drops the link ("authentication failed") and nothing it asked is answered; the nodes redial
(through the same relay, now forwarding only) and the cluster works on. With frames in the clear
(before handshake v2) the node answered the injected request, and an injected Propose to the
metadata group would have declared what the relay liked. About 2 s."""
import socket
import struct
import threading
import time

import pika
import pytest

from conftest import Broker, eventually, free_port

pytestmark = [pytest.mark.needs_process, pytest.mark.warren_only]

SECRET = "mitm-test-secret"
PING = 7  # frame::Rpc::Ping
INJECTED_ID = 0x7EDC_BA98_7654_3210


def read_frame(sock):
    """One frame (`u32` LE length, body) as bytes, or None at EOF."""
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack("<I", head)
    body = b""
    while len(body) < n:
        chunk = sock.recv(min(65536, n - len(body)))
        if not chunk:
            return None
        body += chunk
    return head + body


class Relay:
    """Forwards node 1's dials to node 2's cluster port frame by frame. On the first connection,
    once the handshake's four frames went through, it injects a cleartext Ping request toward
    node 2 and records what node 2 does with that connection."""

    def __init__(self, target_port):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.injected = threading.Event()
        self.closed_after_injection = threading.Event()
        self.answer_seen = threading.Event()
        self.connections = 0
        self.stop = False
        threading.Thread(target=self.accept_loop, daemon=True).start()

    def accept_loop(self):
        while not self.stop:
            try:
                dialer, _ = self.listener.accept()
            except OSError:
                return
            try:
                acceptor = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                dialer.close()  # node 2 not listening yet: node 1 redials
                continue
            self.connections += 1
            inject = self.connections == 1
            welcomed = threading.Event()
            threading.Thread(target=self.pump, args=(dialer, acceptor, inject, welcomed, True), daemon=True).start()
            threading.Thread(target=self.pump, args=(acceptor, dialer, inject, welcomed, False), daemon=True).start()

    def pump(self, src, dst, inject, welcomed, from_dialer):
        frames = 0
        try:
            while True:
                frame = read_frame(src)
                if frame is None:
                    if inject and not from_dialer and self.injected.is_set():
                        self.closed_after_injection.set()
                    break
                if inject and not from_dialer and self.injected.is_set() and INJECTED_ID.to_bytes(8, "little") in frame:
                    self.answer_seen.set()
                dst.sendall(frame)
                frames += 1
                if not from_dialer and frames == 2:
                    welcomed.set()  # Challenge, then Welcome: the handshake is done
                if inject and from_dialer and frames == 2 and not self.injected.is_set():
                    welcomed.wait(5)
                    body = bytes([1]) + INJECTED_ID.to_bytes(8, "little") + bytes([PING]) + (0).to_bytes(8, "little")
                    self.injected.set()  # before the send: node 2 may drop the link before it returns
                    dst.sendall(struct.pack("<I", len(body)) + body)
        except OSError:
            if inject and not from_dialer and self.injected.is_set():
                self.closed_after_injection.set()
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.stop = True
        self.listener.close()


@pytest.fixture
def two_nodes_through_a_relay(tmp_path):
    ports = {1: free_port(), 2: free_port()}
    relay = Relay(ports[2])
    nodes = {}
    for i in (1, 2):
        # Node 1 (the lower id dials) reaches node 2 through the relay; node 2 listens on its own port.
        to_2 = relay.port if i == 1 else ports[2]
        b = Broker(tmp_path / f"node{i}", tmp_path / f"node{i}.log")
        b.extra_args = ["--node-id", str(i), "--peers", f"1=127.0.0.1:{ports[1]},2=127.0.0.1:{to_2}", "--cluster-secret", SECRET]
        nodes[i] = b
    for i in (2, 1):
        nodes[i].start()
    yield nodes, relay
    relay.close()
    for b in nodes.values():
        if b.alive():
            b.kill9()


def test_a_frame_injected_after_the_handshake_drops_the_link_and_is_never_answered(two_nodes_through_a_relay):
    nodes, relay = two_nodes_through_a_relay
    assert relay.injected.wait(20), "node 1 dialed node 2 through the relay and the handshake went through"
    assert relay.closed_after_injection.wait(5), "node 2 dropped the connection the frame was injected into:\n" + nodes[2].log_text()[-4000:]
    assert not relay.answer_seen.is_set(), "node 2 answered the injected request"
    eventually(lambda: "authentication failed" in nodes[2].log_text(), timeout=5)

    # The nodes redial (through the relay, which now only forwards) and work on: a durable
    # declaration through node 1 (a metadata commit needs both nodes) is seen on node 2.
    def declares(node, **how):
        """Whether a queue.declare of the test's queue through `node` succeeds now."""
        try:
            conn = pika.BlockingConnection(pika.URLParameters(node.url))
        except pika.exceptions.AMQPError:
            return False
        try:
            conn.channel().queue_declare("after-the-relay", **how)
            return True
        except pika.exceptions.AMQPError:
            return False
        finally:
            if conn.is_open:
                conn.close()

    eventually(lambda: declares(nodes[1], durable=True), timeout=30, interval=0.5)
    eventually(lambda: declares(nodes[2], passive=True), timeout=10, interval=0.2)
    assert relay.connections >= 2, "the links came back through the relay"
