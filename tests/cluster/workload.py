"""The clients of a fault test: publishers with confirms and consumers with manual acks that move to
another node whenever theirs fails, and a drain that empties the queue after the faults are healed.

They speak AMQP 0-9-1 over a raw socket (frames from tests/python/rawamqp.py) rather than pika, so
that every wait is bounded: a connect, a handshake, a send into a cut link, a confirm that never
comes (`stall_timeout`) and a silent peer (heartbeats) all end in an error that makes the client
move on to its next target. Every id sent, confirmed, nacked and delivered goes into a
`checker.History`.

A target is `(label, host, port)` (`Node.target`). A client starts at its first target and, after
each failure, tries the next one in its list, round and round, until stopped. Clients run in the
root namespace unless given `netns=` (then their sockets live in that namespace).
"""
import base64
import json
import random
import socket
import struct
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from netns import in_netns  # noqa: E402
from rawamqp import (FRAME_BODY, FRAME_END, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD,  # noqa: E402
                     PROTOCOL_HEADER, CLIENT_PROPERTIES, frame, longstr, method_frame, shortstr)


class AmqpError(Exception):
    """The broker closed the channel or connection, or said something this client does not expect."""


class Stalled(Exception):
    """No progress (confirm) within the client's stall timeout."""


def encode_table(values):
    """A field table of str (S), bool (t) and int (l) values."""
    out = b""
    for k, v in (values or {}).items():
        if isinstance(v, bool):
            out += shortstr(k) + b"t" + (b"\x01" if v else b"\x00")
        elif isinstance(v, int):
            out += shortstr(k) + b"l" + struct.pack(">q", v)
        else:
            out += shortstr(k) + b"S" + longstr(str(v))
    return struct.pack(">I", len(out)) + out


def read_shortstr(data, off):
    n = data[off]
    return data[off + 1:off + 1 + n].decode(errors="replace"), off + 1 + n


class Client:
    """One AMQP connection with channel 1 open. Every read has a deadline; heartbeats both ways."""

    def __init__(self, host, port, *, heartbeat=2, timeout=3.0, netns=None):
        self.heartbeat = heartbeat
        self.timeout = timeout
        self.sock = in_netns(netns, lambda: socket.create_connection((host, port), timeout=timeout))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(timeout)  # bounds every send too: a cut link fills the buffer, then times out
        self.buf = bytearray()
        self.last_recv = self.last_send = time.monotonic()
        # content being assembled: [delivery tag, redelivered, expected size, body parts]
        self._content = None
        try:
            self._handshake()
        except BaseException:
            self.abort()
            raise

    # ---- framing ----
    def send(self, data):
        self.sock.sendall(data)
        self.last_send = time.monotonic()

    def _fill(self, deadline):
        """Reads once (until `deadline`); False on timeout. Raises when the peer is gone."""
        wait = deadline - time.monotonic()
        if wait <= 0:
            return False
        self.sock.settimeout(wait)
        try:
            chunk = self.sock.recv(65536)
        except socket.timeout:
            return False
        finally:
            self.sock.settimeout(self.timeout)
        if not chunk:
            raise ConnectionError("connection closed by the broker")
        self.buf += chunk
        self.last_recv = time.monotonic()
        return True

    def _take_frame(self):
        """The next whole frame in the buffer, or None."""
        if len(self.buf) < 7:
            return None
        kind, channel, size = struct.unpack_from(">BHI", self.buf)
        if len(self.buf) < 8 + size:
            return None
        if self.buf[7 + size] != FRAME_END[0]:
            raise AmqpError("bad frame end")
        payload = bytes(self.buf[7:7 + size])
        del self.buf[:8 + size]
        return kind, channel, payload

    def _next_frame(self, deadline):
        while True:
            f = self._take_frame()
            if f is not None:
                return f
            if not self._fill(deadline):
                return None

    def _tick(self):
        """Sends a heartbeat when due; raises when the broker has been silent for 3 intervals."""
        if not self.heartbeat:
            return
        now = time.monotonic()
        if now - self.last_recv > 3 * self.heartbeat:
            raise ConnectionError(f"no heartbeat from the broker for {now - self.last_recv:.1f}s")
        if now - self.last_send > self.heartbeat / 2:
            self.send(frame(FRAME_HEARTBEAT, 0, b""))

    @staticmethod
    def _closing(kind, payload):
        if kind == FRAME_METHOD and payload[:4] in (b"\x00\x0a\x00\x32", b"\x00\x14\x00\x28"):
            code, n = struct.unpack_from(">HB", payload, 4)
            what = "connection" if payload[1] == 10 else "channel"
            raise AmqpError(f"{what} closed by the broker: {code} {payload[7:7 + n].decode(errors='replace')}")

    def rpc(self, data, expect, timeout=None):
        """Sends `data` and returns the payload of the method `expect` = (class, method)."""
        self.send(data)
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            f = self._next_frame(deadline)
            if f is None:
                raise socket.timeout(f"no reply {expect} within {timeout or self.timeout}s")
            kind, _, payload = f
            if kind == FRAME_HEARTBEAT:
                continue
            self._closing(kind, payload)
            if kind == FRAME_METHOD and struct.unpack_from(">HH", payload) == expect:
                return payload
            raise AmqpError(f"expected {expect}, got frame kind {kind} {payload[:4].hex()}")

    def _handshake(self):
        self.send(PROTOCOL_HEADER)
        deadline = time.monotonic() + self.timeout
        f = self._next_frame(deadline)
        if f is None or f[0] != FRAME_METHOD or f[2][:4] != b"\x00\x0a\x00\x0a":
            raise AmqpError(f"no connection.start within {self.timeout}s")
        start_ok = CLIENT_PROPERTIES + shortstr("PLAIN") + longstr(b"\x00guest\x00guest") + shortstr("en_US")
        tune = self.rpc(method_frame(0, 10, 11, start_ok), (10, 30))
        channel_max, frame_max, _ = struct.unpack_from(">HIH", tune, 4)
        self.frame_max = min(frame_max or 131072, 131072)
        self.send(method_frame(0, 10, 31, struct.pack(">HIH", channel_max, self.frame_max, self.heartbeat)))
        self.rpc(method_frame(0, 10, 40, shortstr("/") + shortstr("") + b"\x00"), (10, 41))
        self.rpc(method_frame(1, 20, 10, shortstr("")), (20, 11))

    # ---- methods ----
    def declare(self, queue, arguments=None, passive=False, durable=True):
        """queue.declare; returns (message count, consumer count)."""
        bits = (2 if durable else 0) | (1 if passive else 0)
        ok = self.rpc(method_frame(1, 50, 10, struct.pack(">H", 0) + shortstr(queue) + bytes([bits])
                                   + encode_table(arguments)), (50, 11))
        _, off = read_shortstr(ok, 4)
        return struct.unpack_from(">II", ok, off)

    def confirm_select(self):
        self.rpc(method_frame(1, 85, 10, b"\x00"), (85, 11))

    def qos(self, prefetch):
        self.rpc(method_frame(1, 60, 10, struct.pack(">IHB", 0, prefetch, 0)), (60, 11))

    def consume(self, queue, tag="c"):
        self.rpc(method_frame(1, 60, 20, struct.pack(">H", 0) + shortstr(queue) + shortstr(tag) + b"\x00"
                              + encode_table(None)), (60, 21))

    def publish_frames(self, routing_key, body, exchange="", headers=None):
        """basic.publish of a persistent message (with `headers`, a table as `encode_table`'s)."""
        props = struct.pack(">H", 0x1000) + b"\x02" if headers is None else struct.pack(">H", 0x3000) + encode_table(headers) + b"\x02"
        return (method_frame(1, 60, 40, struct.pack(">H", 0) + shortstr(exchange) + shortstr(routing_key) + b"\x00")
                + frame(FRAME_HEADER, 1, struct.pack(">HHQ", 60, 0, len(body)) + props)
                + frame(FRAME_BODY, 1, body))

    def exchange_declare(self, name, kind, arguments=None):
        """exchange.declare of a durable exchange."""
        self.rpc(method_frame(1, 40, 10, struct.pack(">H", 0) + shortstr(name) + shortstr(kind) + b"\x02"
                              + encode_table(arguments)), (40, 11))

    def bind(self, queue, exchange, routing_key):
        self.rpc(method_frame(1, 50, 20, struct.pack(">H", 0) + shortstr(queue) + shortstr(exchange) + shortstr(routing_key)
                              + b"\x00" + encode_table(None)), (50, 21))

    def tx_select(self):
        self.rpc(method_frame(1, 90, 10, b""), (90, 11))

    def tx_commit(self, timeout=None):
        """tx.commit; returns once commit-ok came (raises AmqpError if the broker failed the commit)."""
        self.rpc(method_frame(1, 90, 20, b""), (90, 21), timeout=timeout)

    def get(self, queue, no_ack, timeout=None):
        """basic.get: (delivery tag, body), or None for get-empty."""
        self.send(method_frame(1, 60, 70, struct.pack(">H", 0) + shortstr(queue) + (b"\x01" if no_ack else b"\x00")))
        deadline = time.monotonic() + (timeout or self.timeout)
        tag, size, parts = None, None, []
        while True:
            f = self._next_frame(deadline)
            if f is None:
                raise socket.timeout(f"no answer to basic.get within {timeout or self.timeout}s")
            kind, _, payload = f
            if kind == FRAME_HEARTBEAT:
                continue
            self._closing(kind, payload)
            if kind == FRAME_METHOD:
                cm = struct.unpack_from(">HH", payload)
                if cm == (60, 72):
                    return None
                if cm != (60, 71):
                    raise AmqpError(f"unexpected method {cm} after basic.get")
                tag = struct.unpack_from(">Q", payload, 4)[0]
            elif kind == FRAME_HEADER and tag is not None:
                size = struct.unpack_from(">Q", payload, 4)[0]
                if size == 0:
                    return tag, b""
            elif kind == FRAME_BODY and tag is not None:
                parts.append(payload)
                if sum(map(len, parts)) >= size:
                    return tag, b"".join(parts)
            else:
                raise AmqpError(f"unexpected frame kind {kind} after basic.get")

    def cancel(self, tag):
        """basic.cancel with no-wait (deliveries may still arrive before anything else would)."""
        self.send(method_frame(1, 60, 30, shortstr(tag) + b"\x01"))

    def ack(self, tag, multiple=True):
        self.send(method_frame(1, 60, 80, struct.pack(">QB", tag, 1 if multiple else 0)))

    def reject(self, tag):
        """basic.reject without requeue: the message is dead-lettered (or dropped)."""
        self.send(method_frame(1, 60, 90, struct.pack(">QB", tag, 0)))

    def close(self, timeout=2.0):
        """connection.close and its -ok (so acks sent before it were processed), then the socket."""
        try:
            self.send(method_frame(0, 10, 50, struct.pack(">H", 200) + shortstr("bye") + struct.pack(">HH", 0, 0)))
            deadline = time.monotonic() + timeout
            while True:
                f = self._next_frame(deadline)
                if f is None or (f[0] == FRAME_METHOD and f[2][:4] == b"\x00\x0a\x00\x33"):
                    break
        except (OSError, AmqpError):
            pass
        self.abort()

    def abort(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def events(self, timeout):
        """What arrives within `timeout` (at least one read): a list of
        ("ack"|"nack", tag, multiple) and ("deliver", tag, redelivered, body)."""
        out = []
        deadline = time.monotonic() + timeout
        while True:
            self._tick()
            f = self._take_frame()
            if f is None:
                if out or not self._fill(deadline):
                    return out
                continue
            kind, _, payload = f
            if kind == FRAME_HEARTBEAT:
                continue
            if kind == FRAME_METHOD:
                self._closing(kind, payload)
                cm = struct.unpack_from(">HH", payload)
                if cm == (60, 80):
                    tag, bits = struct.unpack_from(">QB", payload, 4)
                    out.append(("ack", tag, bool(bits & 1)))
                elif cm == (60, 120):
                    tag, bits = struct.unpack_from(">QB", payload, 4)
                    out.append(("nack", tag, bool(bits & 1)))
                elif cm == (60, 60):
                    _, off = read_shortstr(payload, 4)
                    tag, redelivered = struct.unpack_from(">QB", payload, off)
                    self._content = [tag, bool(redelivered), None, []]
                elif cm == (60, 30):
                    raise AmqpError("consumer cancelled by the broker")
                else:
                    raise AmqpError(f"unexpected method {cm}")
            elif kind == FRAME_HEADER and self._content is not None:
                self._content[2] = struct.unpack_from(">Q", payload, 4)[0]
                if self._content[2] == 0:
                    out.append(("deliver", self._content[0], self._content[1], b""))
                    self._content = None
            elif kind == FRAME_BODY and self._content is not None:
                self._content[3].append(payload)
                if sum(map(len, self._content[3])) >= self._content[2]:
                    tag, redelivered, _, parts = self._content
                    out.append(("deliver", tag, redelivered, b"".join(parts)))
                    self._content = None
            else:
                raise AmqpError(f"unexpected frame kind {kind}")


CLIENT_ERRORS = (OSError, ConnectionError, AmqpError, Stalled, struct.error, IndexError)


def message_id(body):
    """The id a publisher put at the front of a body: "<publisher>/<seq>"."""
    return body.split(b" ", 1)[0].decode(errors="replace")


class _Worker(threading.Thread):
    def __init__(self, name, targets, queue, history, arguments, heartbeat, timeout, netns, durable=True):
        super().__init__(daemon=True, name=name)
        self.durable = durable
        assert targets, "a client needs at least one target"
        self.targets, self.queue, self.history = list(targets), queue, history
        self.arguments, self.heartbeat, self.timeout, self.netns = arguments, heartbeat, timeout, netns
        self._stop_flag = threading.Event()
        self.connects = 0
        self.failures = 0

    def stop(self, timeout=15):
        self._stop_flag.set()
        self.join(timeout)
        assert not self.is_alive(), f"{self.name} did not stop"

    @property
    def stopping(self):
        return self._stop_flag.is_set()

    def _connect(self, target):
        label, host, port = target
        c = Client(host, port, heartbeat=self.heartbeat, timeout=self.timeout, netns=self.netns)
        try:
            c.declare(self.queue, self.arguments, durable=self.durable)
        except BaseException:
            c.abort()
            raise
        self.connects += 1
        self.history.event(self.name, f"connected to {label}")
        return c

    def run(self):
        i = 0
        while not self.stopping:
            target = self.targets[i % len(self.targets)]
            c = None
            try:
                c = self._connect(target)
                self.session(c, target[0])
                c.close()
                c = None
            except CLIENT_ERRORS as e:
                self.failures += 1
                self.history.event(self.name, f"{target[0]}: {type(e).__name__}: {e}")
                i += 1
                time.sleep(0.1)
            finally:
                if c is not None:
                    c.abort()


class Publisher(_Worker):
    """Publishes persistent messages "<name>/<seq> ..." with up to `window` unconfirmed, recording
    each id before it is sent and each confirm. A connection with unconfirmed messages and no
    confirm for `stall_timeout` is dropped (those messages stay indeterminate) and the next target
    tried. `rate` caps messages per second (None: as fast as confirms come)."""

    def __init__(self, name, targets, queue, history, *, arguments=None, window=100, size=64,
                 stall_timeout=3.0, rate=None, heartbeat=2, timeout=3.0, netns=None, durable=True):
        super().__init__(name, targets, queue, history, arguments, heartbeat, timeout, netns, durable)
        self.window, self.size, self.stall_timeout, self.rate = window, size, stall_timeout, rate
        self.seq = 0
        self.confirmed = 0

    def _body(self, msg_id):
        head = msg_id.encode() + b" "
        return head + b"x" * max(0, self.size - len(head))

    def _frames(self, c, msg_id):
        return c.publish_frames(self.queue, self._body(msg_id))

    def session(self, c, label):
        c.confirm_select()
        unconfirmed = {}  # delivery tag -> id
        next_tag, acked_to = 1, 0
        last_progress = time.monotonic()
        started, sent = time.monotonic(), 0
        while True:
            if not self.stopping:
                room = self.window - len(unconfirmed)
                if self.rate:
                    room = min(room, int((time.monotonic() - started) * self.rate) - sent)
                if room > 0:
                    if not unconfirmed:
                        last_progress = time.monotonic()  # the stall clock starts with the first unconfirmed
                    ids = [f"{self.name}/{self.seq + k}" for k in range(room)]
                    self.seq += room
                    self.history.attempt(ids)
                    data = b"".join(self._frames(c, i) for i in ids)
                    for i in ids:
                        unconfirmed[next_tag] = i
                        next_tag += 1
                    sent += room
                    c.send(data)
            elif not unconfirmed:
                return
            for ev in c.events(0.05 if self.rate else 0.2):
                kind, tag, multiple = ev[:3]
                tags = range(acked_to + 1, tag + 1) if multiple else (tag,)
                ids = [unconfirmed.pop(t) for t in tags if t in unconfirmed]
                if multiple:
                    acked_to = max(acked_to, tag)
                if kind == "ack":
                    self.history.confirm(ids, label)
                    self.confirmed += len(ids)
                else:
                    self.history.nack(ids)
                last_progress = time.monotonic()
            if unconfirmed and time.monotonic() - last_progress > self.stall_timeout:
                raise Stalled(f"{len(unconfirmed)} unconfirmed, none confirmed for {self.stall_timeout}s")


DELAYED_EXCHANGE = "faults-delayed"


class DelayedPublisher(Publisher):
    """A `Publisher` through a delayed exchange (`x-delayed-message` routing as direct, the queue
    bound to it by its name), each message with an `x-delay` of 1 to `max_delay_ms`, recording the
    earliest time each may arrive (`History.delayed`: the send time plus the delay; the broker
    dates it at its receipt, later). The checker holds every delivery to it (`early`)."""

    def __init__(self, name, targets, queue, history, *, max_delay_ms=3000, **opts):
        super().__init__(name, targets, queue, history, **opts)
        self.max_delay_ms = max_delay_ms
        self.rng = random.Random(name)

    def _connect(self, target):
        c = super()._connect(target)
        try:
            c.exchange_declare(DELAYED_EXCHANGE, "x-delayed-message", {"x-delayed-type": "direct"})
            c.bind(self.queue, DELAYED_EXCHANGE, self.queue)
        except BaseException:
            c.abort()
            raise
        return c

    def _frames(self, c, msg_id):
        delay = self.rng.randint(1, self.max_delay_ms)
        self.history.delayed(msg_id, delay / 1000)
        return c.publish_frames(self.queue, self._body(msg_id), exchange=DELAYED_EXCHANGE, headers={"x-delay": delay})


class PlainPublisher(_Worker):
    """Publishes persistent messages "<name>/<seq> ..." without confirms at `rate` per second,
    recording each id with the time it was sent (`History.plain`). Nothing tells it whether a
    message was taken, so the checker holds it only to what was sent while the cluster was healthy
    (see `checker.check`): those must all arrive."""

    def __init__(self, name, targets, queue, history, *, arguments=None, size=64, rate=300, heartbeat=2,
                 timeout=3.0, netns=None, durable=True):
        super().__init__(name, targets, queue, history, arguments, heartbeat, timeout, netns, durable)
        self.size, self.rate = size, rate
        self.seq = 0

    def session(self, c, label):
        started, sent = time.monotonic(), 0
        while not self.stopping:
            room = int((time.monotonic() - started) * self.rate) - sent
            if room > 0:
                ids = [f"{self.name}/{self.seq + k}" for k in range(room)]
                self.seq += room
                data = b"".join(c.publish_frames(self.queue, (i + " ").encode().ljust(self.size, b"x")) for i in ids)
                c.send(data)
                self.history.plain(ids, label)
                sent += room
            for _ in c.events(0.02):
                pass  # nothing is expected; heartbeats and errors are handled by `events`


class TxPublisher(_Worker):
    """Publishes in transactions of `batch` persistent messages: every id of a transaction whose
    tx.commit-ok came is confirmed (a commit-ok is a promise, as a confirm is); a failed or
    unanswered commit leaves them indeterminate."""

    def __init__(self, name, targets, queue, history, *, arguments=None, batch=10, size=64, pause=0.02,
                 heartbeat=2, timeout=3.0, netns=None, durable=True):
        super().__init__(name, targets, queue, history, arguments, heartbeat, timeout, netns, durable)
        self.batch, self.size, self.pause = batch, size, pause
        self.seq = 0
        self.committed = 0

    def session(self, c, label):
        c.tx_select()
        while not self.stopping:
            ids = [f"{self.name}/{self.seq + k}" for k in range(self.batch)]
            self.seq += self.batch
            self.history.attempt(ids)
            c.send(b"".join(c.publish_frames(self.queue, (i + " ").encode().ljust(self.size, b"x")) for i in ids))
            c.tx_commit(timeout=40)  # past the broker's own proposal timeout (30 s)
            self.history.confirm(ids, label)
            self.committed += 1
            time.sleep(self.pause)


class Getter(_Worker):
    """basic.get in a loop, with manual acks (each message acked after it is recorded) or no-ack.
    A no-ack get answered while the connection fails may lose its message on the way (the protocol
    allows it: no-ack is at most once), so each failure with a no-ack get outstanding is counted
    (`History.tolerate_no_ack_get`), and the checker allows that many lost messages."""

    def __init__(self, name, targets, queue, history, *, arguments=None, no_ack=False, pause=0.05,
                 heartbeat=2, timeout=3.0, netns=None, durable=True):
        super().__init__(name, targets, queue, history, arguments, heartbeat, timeout, netns, durable)
        self.no_ack, self.pause = no_ack, pause
        self.got = 0
        self._outstanding = False

    def session(self, c, label):
        try:
            while not self.stopping:
                self._outstanding = self.no_ack
                got = c.get(self.queue, self.no_ack, timeout=10)
                self._outstanding = False
                if got is None:
                    time.sleep(self.pause)
                    continue
                tag, body = got
                self.history.receive(message_id(body), label)
                self.got += 1
                if not self.no_ack:
                    c.ack(tag, multiple=False)
        finally:
            if self._outstanding:
                self.history.tolerate_no_ack_get()
                self._outstanding = False


class Consumer(_Worker):
    """Consumes with manual acks (prefetch `prefetch`, one multiple-ack per batch), recording every
    delivery. The ack goes out after the delivery is recorded, so a lost ack means a redelivery
    (a duplicate), never a loss. With `session_seconds`, each connection ends after about that long
    (basic.cancel, then connection.close with what arrived meanwhile unacked) and the consumer
    connects again to the same node: the churn of short-lived consumers, whose cancels, closes and
    acks a fault may lose on the way to the leader."""

    def __init__(self, name, targets, queue, history, *, arguments=None, prefetch=200, heartbeat=2,
                 timeout=3.0, netns=None, durable=True, session_seconds=None):
        super().__init__(name, targets, queue, history, arguments, heartbeat, timeout, netns, durable)
        self.prefetch = prefetch
        self.session_seconds = session_seconds
        self.delivered = 0

    def session(self, c, label):
        c.qos(self.prefetch)
        c.consume(self.queue, tag=self.name)
        ends = time.monotonic() + self.session_seconds if self.session_seconds else None
        while not self.stopping and (ends is None or time.monotonic() < ends):
            last = None
            for ev in c.events(0.2):
                if ev[0] == "deliver":
                    self.history.receive(message_id(ev[3]), label)
                    self.delivered += 1
                    last = ev[1]
            if last is not None:
                c.ack(last, multiple=True)
        if ends is not None and not self.stopping:
            c.cancel(self.name)
            c.close()


class Rejecter(Consumer):
    """Consumes as `Consumer` does, but rejects without requeue every message whose publisher seq
    is a multiple of `every`, recording nothing for it: the queue dead-letters those, and the test
    finds them in the dead-letter target. The others are recorded and acked."""

    def __init__(self, name, targets, queue, history, *, every=3, **kw):
        super().__init__(name, targets, queue, history, **kw)
        self.every = every
        self.rejected = 0

    def session(self, c, label):
        c.qos(self.prefetch)
        c.consume(self.queue, tag=self.name)
        while not self.stopping:
            last = None
            for ev in c.events(0.2):
                if ev[0] != "deliver":
                    continue
                mid = message_id(ev[3])
                if int(mid.rsplit("/", 1)[-1]) % self.every == 0:
                    c.reject(ev[1])
                    self.rejected += 1
                else:
                    self.history.receive(mid, label)
                    self.delivered += 1
                    last = ev[1]
            if last is not None:
                c.ack(last, multiple=True)


class Rewinder(threading.Thread):
    """Now and then (every `every` seconds, jittered) rewinds the queue through a random node's HTTP
    API to 0.2 to `max_back` seconds ago: the messages consumed since come again (duplicates, which
    the checker allows; never a loss, never before a delayed message's due time). A rewind through
    a node that is down, cut off or without a majority fails or times out: recorded, not an error.
    Counts the rewinds answered and the messages they made ready again."""

    def __init__(self, name, targets, queue, history, *, every=2.0, max_back=3.0, http_port=15672):
        super().__init__(name=name, daemon=True)
        self.targets, self.queue, self.history = targets, queue, history
        self.every, self.max_back, self.http_port = every, max_back, http_port
        self.rng = random.Random(name)
        self.answered = self.failed = self.rewound = 0
        self._stop_event = threading.Event()

    def stop(self, timeout=15):
        self._stop_event.set()
        self.join(timeout)

    def run(self):
        while not self._stop_event.wait(self.every * self.rng.uniform(0.5, 1.5)):
            label, host, _ = self.rng.choice(self.targets)
            to = int(time.time() * 1000) - self.rng.randint(200, int(self.max_back * 1000))
            try:
                answer = rewind(host, self.queue, to, self.http_port)
                self.answered += 1
                self.rewound += answer.get("rewound", 0)
                self.history.event(self.name, f"rewound {answer.get('rewound')} via {label}")
            except (OSError, ValueError) as e:
                self.failed += 1
                self.history.event(self.name, f"rewind via {label} failed: {str(e)[:80]}")


def rewind(host, queue, to_ms, http_port=15672, timeout=10):
    """POSTs a rewind of `queue` to `to_ms` to the node's HTTP API: its answer (raises OSError or
    ValueError if it fails)."""
    req = urllib.request.Request(f"http://{host}:{http_port}/api/queues/%2F/{urllib.parse.quote(queue, safe='')}/rewind",
                                 data=json.dumps({"to": to_ms}).encode(), method="POST")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def rewind_through_any(targets, queue, to_ms, timeout=60):
    """A rewind through the first node that answers, trying them in turn until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        for _label, host, _port in targets:
            try:
                return rewind(host, queue, to_ms)
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.5)


def delayed_count(host, queue, http_port=15672):
    """The queue's `messages_delayed` from the node's management API (None if it does not answer)."""
    req = urllib.request.Request(f"http://{host}:{http_port}/api/queues/%2F/{urllib.parse.quote(queue, safe='')}")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r).get("messages_delayed")
    except (OSError, ValueError):
        return None


def drain(targets, queue, history, *, arguments=None, idle=1.0, timeout=60.0, heartbeat=2, netns=None,
          durable=True, delayed=False):
    """Consumes and acks everything left in `queue` on each target (call it once the faults are
    healed and the publishers and consumers stopped): for each, until a passive declare reports
    no ready messages after `idle` seconds without a delivery (with `delayed`, and the node's
    management API no delayed ones: those are not counted ready). Returns the number of deliveries."""
    total = 0
    deadline = time.monotonic() + timeout
    for label, host, port in targets:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"drain of {queue} on {label} did not finish within {timeout}s")
            try:
                c = Client(host, port, heartbeat=heartbeat, netns=netns)
                try:
                    c.declare(queue, arguments, durable=durable)
                    c.qos(1000)
                    c.consume(queue, tag="drain")
                    quiet_since = time.monotonic()
                    while time.monotonic() - quiet_since < idle:
                        last = None
                        for ev in c.events(0.1):
                            if ev[0] == "deliver":
                                history.receive(message_id(ev[3]), label)
                                total += 1
                                last = ev[1]
                        if last is not None:
                            c.ack(last, multiple=True)
                            quiet_since = time.monotonic()
                    c.close()  # close-ok: every ack before it was processed
                finally:
                    c.abort()
                check = Client(host, port, heartbeat=heartbeat, netns=netns)
                try:
                    ready, _ = check.declare(queue, arguments, passive=True, durable=durable)
                finally:
                    check.close()
                if ready == 0 and not (delayed and delayed_count(host, queue) != 0):
                    break
            except CLIENT_ERRORS as e:
                history.event("drain", f"{label}: {type(e).__name__}: {e}")
                time.sleep(0.2)
    return total


class Workload:
    """Publishers and consumers on one queue, started together and stopped together.

    `publishers`, `consumers` and `churning` (consumers that reconnect every second or so) are lists
    of target lists (one per client, in the order each client tries them)."""

    def __init__(self, queue, history, publishers, consumers, *, arguments=None, durable=True,
                 publisher_opts=None, consumer_opts=None, churning=None, plain=None, tx=None, getters=None,
                 no_ack_getters=None, delayed=None, delayed_opts=None, rewinders=None):
        self.queue, self.history = queue, history
        # Rewinds through random nodes (the queue must have x-retention-seconds).
        self.rewinders = [Rewinder(f"rewind{i}", t, queue, history) for i, t in enumerate(rewinders or [])]
        self.publishers = [Publisher(f"p{i}", t, queue, history, arguments=arguments, durable=durable,
                                     **(publisher_opts or {})) for i, t in enumerate(publishers)]
        self.consumers = [Consumer(f"c{i}", t, queue, history, arguments=arguments, durable=durable,
                                   **(consumer_opts or {})) for i, t in enumerate(consumers)]
        # One more on each node whose connections last about a second each (see `Consumer`).
        self.consumers += [Consumer(f"churn{i}", t, queue, history, arguments=arguments, durable=durable,
                                    session_seconds=0.7 + 0.2 * i, **(consumer_opts or {}))
                           for i, t in enumerate(churning or [])]
        # Publishers without confirms and transactional ones (stopped with the publishers), and
        # basic.get consumers with and without acks (stopped with the consumers).
        self.publishers += [PlainPublisher(f"plain{i}", t, queue, history, arguments=arguments, durable=durable)
                            for i, t in enumerate(plain or [])]
        self.publishers += [TxPublisher(f"tx{i}", t, queue, history, arguments=arguments, durable=durable)
                            for i, t in enumerate(tx or [])]
        # Publishers of delayed messages (confirmed; the checker also holds them to their due time).
        self.publishers += [DelayedPublisher(f"delayed{i}", t, queue, history, arguments=arguments, durable=durable,
                                             **(delayed_opts or {})) for i, t in enumerate(delayed or [])]
        self.consumers += [Getter(f"get{i}", t, queue, history, arguments=arguments, durable=durable)
                           for i, t in enumerate(getters or [])]
        self.consumers += [Getter(f"getnoack{i}", t, queue, history, arguments=arguments, durable=durable, no_ack=True)
                           for i, t in enumerate(no_ack_getters or [])]

    def start(self):
        for w in self.publishers + self.consumers + self.rewinders:
            w.start()
        return self

    def confirmed(self):
        return sum(p.confirmed for p in self.publishers if isinstance(p, Publisher))

    def wait_for_confirms(self, n, timeout=20):
        """Waits until at least `n` more messages are confirmed than when called."""
        target = self.confirmed() + n
        deadline = time.monotonic() + timeout
        while self.confirmed() < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.confirmed()} of {target} confirmed after {timeout}s; events: "
                                   f"{self.history.events[-10:]}")
            time.sleep(0.05)

    def stop(self):
        """Stops the publishers (each waits for its last confirms), then the consumers."""
        for r in self.rewinders:
            r.stop()
        for p in self.publishers:
            p.stop()
        self.history.end()
        for c in self.consumers:
            c.stop()
