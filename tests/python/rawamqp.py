"""A minimal AMQP 0-9-1 speaker over a raw socket, for tests no client library can write:
malformed frames, exact bytes of every field type, heartbeats, a peer that goes silent.

Only what the tests need: it builds frames by hand and reads frames back. It is not a client.
"""
import socket
import struct
import time

FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT = 1, 2, 3, 8
FRAME_END = b"\xce"
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"


def shortstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">B", len(b)) + b


def longstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">I", len(b)) + b


def table(raw_entries=b""):
    """A field table from already-encoded entries (name + type letter + value)."""
    return struct.pack(">I", len(raw_entries)) + raw_entries


def frame(kind, channel, payload):
    return struct.pack(">BHI", kind, channel, len(payload)) + payload + FRAME_END


def method_frame(channel, class_id, method_id, args=b""):
    return frame(FRAME_METHOD, channel, struct.pack(">HH", class_id, method_id) + args)


# Announces authentication_failure_close, so a refused login gets connection.close 403, not a bare close.
CLIENT_PROPERTIES = table(shortstr("capabilities") + b"F" + table(shortstr("authentication_failure_close") + b"t\x01"))


class Frame:
    def __init__(self, kind, channel, payload):
        self.kind, self.channel, self.payload = kind, channel, payload

    @property
    def method(self):
        """(class_id, method_id) of a method frame."""
        return struct.unpack(">HH", self.payload[:4])

    def close_reply(self):
        """(reply_code, reply_text) of a connection.close or channel.close frame."""
        code, n = struct.unpack(">HB", self.payload[4:7])
        return code, self.payload[7:7 + n].decode()

    def __repr__(self):
        extra = f" method={self.method}" if self.kind == FRAME_METHOD else ""
        return f"Frame(kind={self.kind}, channel={self.channel}{extra}, {len(self.payload)} bytes)"


class RawConnection:
    def __init__(self, host, port, timeout=5.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buf = b""

    def send(self, data):
        self.sock.sendall(data)

    def recv_exact(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"socket closed by peer ({len(self.buf)} of {n} bytes buffered)")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_frame(self):
        kind, channel, size = struct.unpack(">BHI", self.recv_exact(7))
        payload = self.recv_exact(size)
        end = self.recv_exact(1)
        assert end == FRAME_END, f"bad frame end {end!r}"
        return Frame(kind, channel, payload)

    def read_method(self, skip_heartbeats=True):
        while True:
            f = self.read_frame()
            if f.kind == FRAME_HEARTBEAT and skip_heartbeats:
                continue
            return f

    def expect(self, class_id, method_id):
        f = self.read_method()
        assert f.kind == FRAME_METHOD and f.method == (class_id, method_id), f"expected {class_id}.{method_id}, got {f}"
        return f

    def closed_by_peer(self, timeout=5.0):
        """True once the server has closed the socket (reads return EOF or reset)."""
        self.sock.settimeout(timeout)
        deadline = time.time() + timeout
        try:
            while time.time() < deadline:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
        return False

    def handshake(self, user="guest", password="guest", vhost="/", heartbeat=0, frame_max=131072,
                  mechanism="PLAIN", response=None):
        """Protocol header, start-ok, tune-ok, open; returns the server's (channel_max, frame_max, heartbeat)."""
        self.send(PROTOCOL_HEADER)
        self.expect(10, 10)
        if response is None:
            response = b"\x00" + user.encode() + b"\x00" + password.encode()
        self.send(method_frame(0, 10, 11, CLIENT_PROPERTIES + shortstr(mechanism) + longstr(response) + shortstr("en_US")))
        tune = self.expect(10, 30)
        channel_max, server_frame_max, server_heartbeat = struct.unpack(">HIH", tune.payload[4:12])
        self.send(method_frame(0, 10, 31, struct.pack(">HIH", channel_max, frame_max, heartbeat)))
        self.send(method_frame(0, 10, 40, shortstr(vhost) + shortstr("") + b"\x00"))
        self.expect(10, 41)
        return channel_max, server_frame_max, server_heartbeat

    def open_channel(self, channel=1):
        self.send(method_frame(channel, 20, 10, shortstr("")))
        self.expect(20, 11)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def publish_frames(channel, routing_key, body, exchange="", persistent=True, mandatory=False, frame_max=131072):
    """basic.publish + content header (delivery_mode 2 if persistent) + body frames cut at frame_max."""
    flags, props = (0x1000, b"\x02") if persistent else (0, b"")
    out = method_frame(channel, 60, 40, struct.pack(">H", 0) + shortstr(exchange) + shortstr(routing_key)
                       + (b"\x01" if mandatory else b"\x00"))
    out += frame(FRAME_HEADER, channel, struct.pack(">HHQH", 60, 0, len(body), flags) + props)
    step = frame_max - 8
    for i in range(0, len(body), step):
        out += frame(FRAME_BODY, channel, body[i:i + step])
    return out


def queue_declare_frame(channel, name, durable=True, exclusive=False, auto_delete=False):
    bits = (2 if durable else 0) | (4 if exclusive else 0) | (8 if auto_delete else 0)
    return method_frame(channel, 50, 10, struct.pack(">H", 0) + shortstr(name) + bytes([bits]) + table())


def ack_fields(f):
    """(delivery_tag, multiple) of a basic.ack frame."""
    tag, flags = struct.unpack(">QB", f.payload[4:13])
    return tag, bool(flags & 1)
