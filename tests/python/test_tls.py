"""TLS (issue 37, step 7 of docs/internals/security-plan.md): AMQPS, HTTPS (management API) and
/metrics over TLS, with certificates this file makes with `cryptography`: a CA, server certificates
(ECDSA P-256 and RSA 2048, one behind an intermediate), a client certificate, an expired one and one
from another CA. Real clients (pika, requests, `openssl s_client`, `warren ctl`, `warren bench`, the
RabbitMQ Java client) against the real binary; every message counted."""
import base64
import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import time
import urllib.parse
import uuid
from pathlib import Path
from types import SimpleNamespace

import pika
import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from conftest import ROOT, Broker, binary_for, eventually, free_port
from rawamqp import (FRAME_METHOD, PROTOCOL_HEADER, RawConnection, ack_fields, method_frame, publish_frames,
                     queue_declare_frame, shortstr)

pytestmark = [pytest.mark.needs_process, pytest.mark.warren_only]

# The client certificate's subject, in issuing order (C first, CN last).
CLIENT_SUBJECT = [(NameOID.COUNTRY_NAME, "GB"), (NameOID.ORGANIZATION_NAME, "Warren Tests"),
                  (NameOID.ORGANIZATIONAL_UNIT_NAME, "QA"), (NameOID.COMMON_NAME, "tls-client")]
# The user name rabbitmq_auth_mechanism_ssl derives from CLIENT_SUBJECT with the default
# ssl_cert_login_from = distinguished_name: checked against RabbitMQ 3.10.8 (Erlang 25) here, a node
# with listeners.ssl, verify_peer and the plugin, logging in with EXTERNAL and this certificate.
CLIENT_DN_USER = "CN=tls-client,OU=QA,O=Warren Tests,C=GB"
CLIENT_CN_USER = "tls-client"

NOW = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
DAY = datetime.timedelta(days=1)


# ---------------------------------------------------------------------------------------------
# Certificates
# ---------------------------------------------------------------------------------------------

def new_key(kind="ec"):
    if kind == "ec":
        return ec.generate_private_key(ec.SECP256R1())
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def name(pairs):
    return x509.Name([x509.NameAttribute(oid, value) for oid, value in pairs])


def issue(subject, key, issuer=None, *, ca=False, server=False, client=False, not_before=None,
          not_after=None, serial=None):
    """A certificate for `key` with `subject` (an x509.Name), signed by `issuer` (a (cert, key) pair;
    None: self-signed)."""
    issuer_cert, issuer_key = issuer if issuer else (None, key)
    b = (x509.CertificateBuilder()
         .subject_name(subject)
         .issuer_name(issuer_cert.subject if issuer_cert else subject)
         .public_key(key.public_key())
         .serial_number(serial or x509.random_serial_number())
         .not_valid_before(not_before or NOW - DAY)
         .not_valid_after(not_after or NOW + 365 * DAY)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    if issuer_cert is not None:
        b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    if ca:
        b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        b = b.add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                          crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
    else:
        b = b.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if server:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def cert_pem(*certs):
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def key_pem(key, fmt="pkcs8"):
    """`fmt`: pkcs8 (BEGIN PRIVATE KEY), or traditional: PKCS#1 for RSA (BEGIN RSA PRIVATE KEY), SEC1
    for EC (BEGIN EC PRIVATE KEY)."""
    f = serialization.PrivateFormat.PKCS8 if fmt == "pkcs8" else serialization.PrivateFormat.TraditionalOpenSSL
    return key.private_bytes(serialization.Encoding.PEM, f, serialization.NoEncryption())


def server_identity(ca, kind="ec", org="Warren Server", serial=None, not_after=None):
    key = new_key(kind)
    cert = issue(name([(NameOID.ORGANIZATION_NAME, org), (NameOID.COMMON_NAME, "localhost")]), key, ca,
                 server=True, serial=serial, not_after=not_after)
    return cert, key


def make_certs(d):
    """Every certificate and key the tests use, as files under `d`, in a namespace."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    c = SimpleNamespace(dir=d)

    def write(fname, data):
        p = d / fname
        p.write_bytes(data)
        return p

    ca_key = new_key()
    ca_cert = issue(name([(NameOID.ORGANIZATION_NAME, "Warren Tests"), (NameOID.COMMON_NAME, "Warren Test CA")]),
                    ca_key, ca=True, not_after=NOW + 3650 * DAY)
    c.ca_cert, c.ca_key = ca_cert, ca_key
    c.ca = write("ca.pem", cert_pem(ca_cert))

    other_key = new_key()
    other_cert = issue(name([(NameOID.ORGANIZATION_NAME, "Someone Else"), (NameOID.COMMON_NAME, "Other CA")]),
                       other_key, ca=True, not_after=NOW + 3650 * DAY)
    c.other_ca = write("other-ca.pem", cert_pem(other_cert))
    c.other_ca_cert, c.other_ca_key = other_cert, other_key

    # Server: ECDSA P-256 (PKCS#8 key), the default.
    c.server_cert, c.server_key = server_identity((ca_cert, ca_key), "ec")
    c.server = write("server.pem", cert_pem(c.server_cert))
    c.server_keyfile = write("server.key", key_pem(c.server_key, "pkcs8"))
    # RSA 2048 with its key in PKCS#1, EC with its key in SEC1.
    c.rsa_cert, c.rsa_key = server_identity((ca_cert, ca_key), "rsa", org="Warren RSA")
    c.rsa = write("server-rsa.pem", cert_pem(c.rsa_cert))
    c.rsa_keyfile = write("server-rsa.key", key_pem(c.rsa_key, "traditional"))
    c.rsa8_keyfile = write("server-rsa8.key", key_pem(c.rsa_key, "pkcs8"))
    c.sec1_keyfile = write("server-sec1.key", key_pem(c.server_key, "traditional"))
    # A server certificate issued by an intermediate CA; the file holds the chain (leaf, intermediate).
    inter_key = new_key()
    inter_cert = issue(name([(NameOID.ORGANIZATION_NAME, "Warren Tests"), (NameOID.COMMON_NAME, "Warren Intermediate")]),
                       inter_key, (ca_cert, ca_key), ca=True, not_after=NOW + 365 * DAY)
    c.chain_cert, c.chain_key = server_identity((inter_cert, inter_key), "ec", org="Warren Chained")
    c.chain = write("server-chain.pem", cert_pem(c.chain_cert, inter_cert))
    c.chain_keyfile = write("server-chain.key", key_pem(c.chain_key))
    # The same server key, self-signed: a server no client trusting the CA should accept.
    c.selfsigned = write("selfsigned.pem", cert_pem(issue(name([(NameOID.COMMON_NAME, "localhost")]), c.server_key, server=True)))

    def client(stem, subject, issuer, **kw):
        key = new_key()
        cert = issue(name(subject), key, issuer, client=True, **kw)
        return SimpleNamespace(cert=cert, key=key, certfile=write(f"{stem}.pem", cert_pem(cert)),
                               keyfile=write(f"{stem}.key", key_pem(key)))

    c.client = client("client", CLIENT_SUBJECT, (ca_cert, ca_key))
    c.expired = client("client-expired", CLIENT_SUBJECT, (ca_cert, ca_key),
                       not_before=NOW - 10 * DAY, not_after=NOW - DAY)
    c.foreign = client("client-foreign", CLIENT_SUBJECT, (other_cert, other_key))
    return c


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


# ---------------------------------------------------------------------------------------------
# Brokers and clients
# ---------------------------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class TlsBroker(Broker):
    """conftest's Broker with TLS: its own copies of the certificate, key and CA files (a test may
    overwrite them and send SIGHUP), free ports for AMQPS, HTTPS and metrics over TLS."""

    def __init__(self, tmp, certs, cert, key, ca, flags):
        super().__init__(tmp / "data", tmp / "warren.log")
        self.amqps_port, self.https_port, self.prometheus_tls_port = free_port(), free_port(), free_port()
        tls = tmp / "tls"
        tls.mkdir()
        self.certfile, self.keyfile, self.cafile = tls / "cert.pem", tls / "key.pem", tls / "ca.pem"
        shutil.copyfile(cert or certs.server, self.certfile)
        shutil.copyfile(key or certs.server_keyfile, self.keyfile)
        self.extra_args = ["--tls-cert", str(self.certfile), "--tls-key", str(self.keyfile),
                           "--amqps-port", str(self.amqps_port), "--https-port", str(self.https_port),
                           "--prometheus-tls-port", str(self.prometheus_tls_port)]
        if ca:
            shutil.copyfile(certs.ca if ca is True else ca, self.cafile)
            self.extra_args += ["--tls-ca", str(self.cafile)]
        self.extra_args += list(flags)

    def start(self):
        super().start()

        def tls_ports_accept():
            if self.proc.poll() is not None:
                raise RuntimeError(f"warren exited with {self.proc.returncode}:\n{self.log_text()}")
            for port in (self.amqps_port, self.https_port, self.prometheus_tls_port):
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True

        try:
            eventually(tls_ports_accept, timeout=10)
        except AssertionError as e:
            raise AssertionError(f"the TLS ports never accepted: {e}\n---- log ----\n{self.clean_log()[-3000:]}") from None

    def clean_log(self):
        return ANSI.sub("", self.log_text())


@pytest.fixture
def start_tls(tmp_path, certs, request):
    """start_tls(*flags, cert=, key=, ca=True|path|None) starts a TLS broker (ca=None: no --tls-ca)."""
    started = []

    def start(*flags, cert=None, key=None, ca=True):
        d = tmp_path / f"b{len(started)}"
        d.mkdir()
        b = TlsBroker(d, certs, cert, key, ca, flags)
        started.append(b)
        b.start()
        return b

    yield start
    failed = getattr(request.node, "rep_call", None)
    for b in started:
        if b.alive():
            b.proc.kill()
            b.proc.wait(10)
        if failed is not None and failed.failed:
            print(f"---- warren log ({b.log_path}) ----\n" + b.clean_log()[-8000:])


@pytest.fixture
def tb(start_tls):
    """A TLS broker with the default (ECDSA) certificate and --tls-ca: client certificates verified, not required."""
    return start_tls()


def client_ctx(certs, client=None, ca=None, max_version=None, min_version=None):
    ctx = ssl.create_default_context(cafile=str(ca or certs.ca))
    if client is not None:
        ctx.load_cert_chain(str(client.certfile), str(client.keyfile))
    if max_version:
        ctx.maximum_version = max_version
    if min_version:
        ctx.minimum_version = min_version
    return ctx


def any_cert_ctx(client=None):
    """Trusts any server certificate: to read whichever one the server sends."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if client is not None:
        ctx.load_cert_chain(str(client.certfile), str(client.keyfile))
    return ctx


def tls_socket(port, ctx, server_hostname="localhost", timeout=5):
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        return ctx.wrap_socket(raw, server_hostname=server_hostname)
    except BaseException:
        raw.close()
        raise


def served_cert(port, client=None):
    """The DER of the certificate the server presents on `port`."""
    with tls_socket(port, any_cert_ctx(client)) as s:
        return s.getpeercert(binary_form=True)


def der(cert):
    return cert.public_bytes(serialization.Encoding.DER)


def read_connection_start(sock):
    """Sends the protocol header on `sock` and returns connection.start's mechanisms, split."""
    sock.sendall(PROTOCOL_HEADER)
    buf = b""
    while len(buf) < 7:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed by the server after {len(buf)} bytes")
        buf += chunk
    kind, channel, size = struct.unpack(">BHI", buf[:7])
    assert (kind, channel) == (FRAME_METHOD, 0), f"not connection.start: {buf[:16]!r}"
    while len(buf) < 8 + size:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed by the server inside connection.start")
        buf += chunk
    p = buf[7:7 + size]
    assert struct.unpack(">HH", p[:4]) == (10, 10), f"not connection.start: {p[:8]!r}"
    off = 6 + 4 + struct.unpack(">I", p[6:10])[0]  # class, method, version major and minor, server-properties
    n = struct.unpack(">I", p[off:off + 4])[0]
    return p[off + 4:off + 4 + n].decode().split()


def mechanisms(port, ctx):
    with tls_socket(port, ctx) as s:
        return read_connection_start(s)


def refused_in_handshake(port, ctx):
    """The error with which the server refuses a TLS client (for a client certificate in TLS 1.3 the
    client's handshake ends before the server has checked it: its refusal then comes with the first
    read). Fails if an AMQP byte ever arrives."""
    try:
        s = tls_socket(port, ctx)
    except socket.timeout:
        raise AssertionError("the TLS handshake hung instead of failing") from None
    except (ssl.SSLError, OSError) as e:
        return f"handshake: {e}"
    try:
        s.sendall(PROTOCOL_HEADER)
        data = s.recv(7)
    except socket.timeout:
        raise AssertionError("the server neither refused the client certificate nor answered") from None
    except (ssl.SSLError, OSError) as e:
        return f"first read: {e}"
    finally:
        s.close()
    assert data == b"", f"the server spoke AMQP to a client it should have refused: {data!r}"
    return "closed without an alert"


def amqps_params(b, certs, client=None, credentials=None, server_hostname="localhost", ca=None, version=None, **kw):
    ctx = client_ctx(certs, client, ca=ca, max_version=version, min_version=version)
    return pika.ConnectionParameters(
        "127.0.0.1", b.amqps_port, ssl_options=pika.SSLOptions(ctx, server_hostname),
        credentials=credentials or pika.PlainCredentials("guest", "guest"), connection_attempts=1,
        socket_timeout=10, **kw)


def amqps(b, certs, **kw):
    return pika.BlockingConnection(amqps_params(b, certs, **kw))


# What pika raises when it cannot connect: its own errors, or (a TLS failure during its handshake,
# with connection_attempts=1) the ssl module's.
CONNECT_ERRORS = (pika.exceptions.AMQPConnectionError, ssl.SSLError, ConnectionError)


def body_of(i, prefix="m"):
    """Bodies of many sizes: every tenth past a TLS record (16 KiB) and a frame (128 KiB)."""
    head = f"{prefix}-{i:06d}".encode()
    size = 200_000 if i % 10 == 3 else (20_000 if i % 10 == 7 else 0)
    return head + hashlib.sha256(head).digest() * (size // 32)


def publish_confirmed(ch, queue, indices, prefix="m"):
    """Publishes with confirms on (basic_publish raises on a nack or a return); counts each confirm."""
    confirmed = 0
    for i in indices:
        ch.basic_publish("", queue, body_of(i, prefix), pika.BasicProperties(delivery_mode=2), mandatory=True)
        confirmed += 1
    return confirmed


def consume_exactly(ch, queue, expected, timeout=20):
    """Consumes (acking each) until every body of `expected` arrived; fails on a missing, duplicate or
    unexpected one, and on any delivery after the last."""
    want = set(expected)
    got = []
    deadline = time.time() + timeout
    for method, _props, body in ch.consume(queue, inactivity_timeout=1):
        if method is None:
            assert time.time() < deadline, f"got {len(got)} of {len(want)} in {timeout}s"
            continue
        got.append(body)
        ch.basic_ack(method.delivery_tag)
        if len(got) == len(want):
            break
    extra = []
    for method, _props, body in ch.consume(queue, inactivity_timeout=0.3):
        if method is None:
            break
        extra.append(body[:20])
    ch.cancel()
    assert not extra, f"deliveries past the last: {extra[:5]}"
    assert len(set(got)) == len(got), "a message was delivered twice"
    assert set(got) == want
    return len(got)


def api(b, method, path, port=None, scheme="http", verify=None, **kw):
    url = f"{scheme}://127.0.0.1:{port or b.http_port}{path}"
    return requests.request(method, url, auth=("guest", "guest"), timeout=10, verify=verify, **kw)


def add_user(b, user, configure=".*", write=".*", read=".*"):
    q = urllib.parse.quote(user, safe="")
    r = api(b, "PUT", f"/api/users/{q}", json={"password": "x", "tags": ""})
    assert r.status_code in (201, 204), f"PUT /api/users/{q}: {r.status_code} {r.text}"
    if configure is not None:
        r = api(b, "PUT", f"/api/permissions/%2F/{q}", json={"configure": configure, "write": write, "read": read})
        assert r.status_code in (201, 204), f"PUT /api/permissions: {r.status_code} {r.text}"


def connection_users(b):
    r = api(b, "GET", "/api/connections")
    assert r.status_code == 200, r.text
    return [c.get("user") for c in r.json()]


def metric_samples(text, metric):
    """{labels: value} of every sample of `metric` in a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{metric}(\{{[^}}]*\}})?\s+(\S+)", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def error_lines(b, word="TLS"):
    return [line for line in b.clean_log().splitlines() if "ERROR" in line and word in line]


_HELP = {}


def server_help():
    if "server" not in _HELP:
        _HELP["server"] = subprocess.run([binary_for({}), "server", "--help"], capture_output=True, text=True, timeout=20).stdout
    return _HELP["server"]


# ---------------------------------------------------------------------------------------------
# AMQPS
# ---------------------------------------------------------------------------------------------

def consume_n(ch, queue, n, timeout=20):
    """The bodies of the first `n` deliveries (each acked)."""
    got = []
    deadline = time.time() + timeout
    for method, _props, body in ch.consume(queue, inactivity_timeout=1):
        if method is None:
            assert time.time() < deadline, f"got {len(got)} of {n} in {timeout}s"
            continue
        got.append(body)
        ch.basic_ack(method.delivery_tag)
        if len(got) == n:
            break
    return got


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls1.2", "tls1.3"])
def test_publish_and_consume_1000_with_confirms_over_amqps_beside_the_plain_port(tb, certs, name, version):
    """1000 messages (every tenth past a TLS record, some past a frame) published with confirms and
    consumed over AMQPS by a client without a certificate (verified if given, not required); half are
    consumed through the plain port, which keeps working beside the TLS one."""
    with amqps(tb, certs, version=version) as conn:
        ch = conn.channel()
        ch.queue_declare(name, durable=True)
        ch.confirm_delivery()
        assert publish_confirmed(ch, name, range(1000)) == 1000
        assert ch.queue_declare(name, passive=True).method.message_count == 1000
        with tb.connection() as plain:  # closing it requeues what its prefetch held past the 500
            pch = plain.channel()
            pch.basic_qos(prefetch_count=50)
            first = consume_n(pch, name, 500)
        assert len(set(first)) == 500
        rest = {body_of(i) for i in range(1000)} - set(first)
        assert len(rest) == 500, "the plain consumer got bodies that were never published"
        ch.basic_qos(prefetch_count=100)
        assert consume_exactly(ch, name, rest) == 500
    with tb.connection() as plain:
        assert eventually(lambda: plain.channel().queue_declare(name, passive=True).method.message_count == 0)


def raw_tls(port, ctx):
    """A rawamqp.RawConnection over TLS."""
    r = RawConnection.__new__(RawConnection)
    r.sock, r.buf = tls_socket(port, ctx), b""
    return r


def test_frames_written_at_once_are_all_answered_without_more_bytes(tb, certs, name):
    """confirm.select, 50 publishes and a passive queue.declare in one write: one TLS record, decrypted
    together. Every one must be answered while the client sends nothing more (a reader that waits for
    the socket to turn readable while the TLS layer holds decrypted frames stalls here)."""
    r = raw_tls(tb.amqps_port, client_ctx(certs))
    try:
        r.handshake()
        r.open_channel(1)
        r.send(queue_declare_frame(1, name))
        r.expect(50, 11)
        batch = method_frame(1, 85, 10, b"\x00")  # confirm.select, nowait = false
        batch += b"".join(publish_frames(1, name, b"pipelined %d" % i) for i in range(50))
        batch += method_frame(1, 50, 10, struct.pack(">H", 0) + shortstr(name) + b"\x01" + struct.pack(">I", 0))  # passive
        assert len(batch) < 16384, "meant to fit one TLS record"
        r.send(batch)
        r.expect(85, 11)
        acked, declare_ok = 0, None
        while acked < 50 or declare_ok is None:
            f = r.read_method()  # the socket's timeout (5 s) fails a stall
            if f.method == (60, 80):
                acked, _multiple = ack_fields(f)
            elif f.method == (50, 11):
                declare_ok = f
            else:
                raise AssertionError(f"unexpected {f}")
        assert acked == 50
    finally:
        r.close()
    with amqps(tb, certs) as c:
        ch = c.channel()
        assert consume_exactly(ch, name, {b"pipelined %d" % i for i in range(50)}) == 50


@pytest.mark.parametrize("kind", ["ec-pkcs8", "ec-sec1", "rsa2048-pkcs1", "rsa2048-pkcs8", "chain"])
def test_certificate_and_key_formats_are_served(start_tls, certs, kind, name):
    """ECDSA P-256 and RSA 2048 keys in PKCS#8, SEC1 and PKCS#1 PEM; a chain file (leaf, intermediate)
    whose intermediate the client, trusting only the root, must get from the server. Served on AMQPS
    (by name and by IP: SAN DNS:localhost and IP:127.0.0.1) and HTTPS."""
    cert, key, leaf = {
        "ec-pkcs8": (certs.server, certs.server_keyfile, certs.server_cert),
        "ec-sec1": (certs.server, certs.sec1_keyfile, certs.server_cert),
        "rsa2048-pkcs1": (certs.rsa, certs.rsa_keyfile, certs.rsa_cert),
        "rsa2048-pkcs8": (certs.rsa, certs.rsa8_keyfile, certs.rsa_cert),
        "chain": (certs.chain, certs.chain_keyfile, certs.chain_cert),
    }[kind]
    b = start_tls(cert=cert, key=key)
    for hostname in ("localhost", "127.0.0.1"):
        with tls_socket(b.amqps_port, client_ctx(certs), server_hostname=hostname) as s:
            assert s.getpeercert(binary_form=True) == der(leaf)
            assert "PLAIN" in read_connection_start(s)
    with amqps(b, certs) as c:
        ch = c.channel()
        ch.queue_declare(name)
        ch.confirm_delivery()
        assert publish_confirmed(ch, name, range(20)) == 20
        assert consume_exactly(ch, name, {body_of(i) for i in range(20)}) == 20
    r = api(b, "GET", "/api/overview", port=b.https_port, scheme="https", verify=str(certs.ca))
    assert r.status_code == 200


def test_the_client_refuses_a_wrong_name_or_an_untrusted_server(start_tls, certs):
    """The client's half (what a client checks, given what the server sends): another host name, and a
    self-signed certificate, both refused by a client trusting the CA."""
    b = start_tls()
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch|doesn't match|not valid for"):
        tls_socket(b.amqps_port, client_ctx(certs), server_hostname="warren.example")
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_socket(b.amqps_port, client_ctx(certs, ca=certs.other_ca))
    selfsigned = start_tls(cert=certs.selfsigned, key=certs.server_keyfile)
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_socket(selfsigned.amqps_port, client_ctx(certs))
    with pytest.raises(CONNECT_ERRORS):
        amqps(selfsigned, certs)
    assert served_cert(selfsigned.amqps_port) == ssl.PEM_cert_to_DER_cert(certs.selfsigned.read_text())


# ---------------------------------------------------------------------------------------------
# Protocol versions
# ---------------------------------------------------------------------------------------------

def s_client(port, ca, *args):
    return subprocess.run(["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-servername", "localhost",
                           "-CAfile", str(ca), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20)


# OpenSSL 3 refuses TLS 1.0/1.1 itself at its default security level ("legacy sigalg disallowed"), so
# a bare `-tls1_1` fails even against a server that speaks it (RabbitMQ 3.10.8 here does): level 0
# lets the client offer it, and the control below shows the same command succeeds against a server
# that accepts TLS 1.1.
LEGACY = ["-cipher", "DEFAULT@SECLEVEL=0"]


def negotiated(out):
    """The protocol an `openssl s_client` run agreed on, from its session block ("Protocol  : ...";
    TLS 1.3 prints none before the first ticket: "New, TLSv1.3, Cipher is ..."), or None."""
    if "Cipher is (NONE)" in out:  # no session (the block below still names the version asked for)
        return None
    m = re.search(r"^\s*Protocol\s*:\s*(\S+)", out, re.M) or re.search(r"^New, (TLSv1\.3), Cipher is", out, re.M)
    return m.group(1) if m else None


@pytest.fixture(scope="session")
def openssl_legacy_control(certs):
    """The TLS 1.1 client command succeeds against `openssl s_server -tls1_1` (else the refusal below
    would prove nothing)."""
    if not shutil.which("openssl"):
        pytest.skip("openssl not installed")
    port = free_port()
    server = subprocess.Popen(["openssl", "s_server", "-accept", str(port), "-cert", str(certs.server),
                               "-key", str(certs.server_keyfile), "-tls1_1", *LEGACY, "-quiet"],
                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def tried():
            out = s_client(port, certs.ca, "-tls1_1", *LEGACY)
            return out if out.returncode == 0 else None
        out = eventually(tried, timeout=10, interval=0.1)
        assert negotiated(out.stdout) == "TLSv1.1", out.stdout
    finally:
        server.kill()
        server.wait(10)
    return True


@pytest.mark.parametrize("listener", ["amqps_port", "https_port", "prometheus_tls_port"])
def test_tls_1_2_and_1_3_accepted_1_1_and_1_0_refused(tb, certs, listener, openssl_legacy_control):
    port = getattr(tb, listener)
    for flag, version in (("-tls1_2", "TLSv1.2"), ("-tls1_3", "TLSv1.3")):
        out = s_client(port, certs.ca, flag)
        assert out.returncode == 0, out.stdout + out.stderr
        assert negotiated(out.stdout) == version, out.stdout
        assert "Verify return code: 0 (ok)" in out.stdout, out.stdout
    for flag in ("-tls1_1", "-tls1"):
        out = s_client(port, certs.ca, flag, *LEGACY)
        assert out.returncode != 0, f"{flag} accepted:\n{out.stdout}"
        assert negotiated(out.stdout) is None and "no peer certificate available" in out.stdout, out.stdout
    # Python's own client, pinned to each version, speaks AMQP on the TLS port too.
    if listener == "amqps_port":
        for v in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
            with tls_socket(port, client_ctx(certs, max_version=v, min_version=v)) as s:
                assert s.version() == {ssl.TLSVersion.TLSv1_2: "TLSv1.2", ssl.TLSVersion.TLSv1_3: "TLSv1.3"}[v]
                assert "PLAIN" in read_connection_start(s)


# ---------------------------------------------------------------------------------------------
# HTTPS and metrics
# ---------------------------------------------------------------------------------------------

def cmq_signed(host, params, secret="guest"):
    """A CMQ request's parameters, signed as Tencent's SDK signs them (POST, HmacSHA1)."""
    p = {"SecretId": "guest", "Nonce": str(uuid.uuid4().int % (1 << 30)), "Timestamp": str(int(time.time())),
         "SignatureMethod": "HmacSHA1", **params}
    text = "POST" + host + "/v2/index.php?" + "&".join(f"{k.replace('_', '.')}={p[k]}" for k in sorted(p))
    p["Signature"] = base64.b64encode(hmac.new(secret.encode(), text.encode(), hashlib.sha1).digest()).decode()
    return p


def test_https_serves_the_management_and_cmq_apis(tb, certs, name):
    ca = str(certs.ca)
    https = lambda method, path, **kw: api(tb, method, path, port=tb.https_port, scheme="https", verify=ca, **kw)  # noqa: E731
    r = https("GET", "/api/overview")
    assert r.status_code == 200, r.text
    plain = api(tb, "GET", "/api/overview").json()
    assert set(r.json()) == set(plain), "the HTTPS port answers with the same routes as the HTTP one"
    assert r.json()["node"] == plain["node"]
    # By name too (SAN DNS:localhost).
    r = requests.get(f"https://localhost:{tb.https_port}/api/whoami", auth=("guest", "guest"), verify=ca, timeout=10)
    assert r.status_code == 200 and r.json()["name"] == "guest"
    # Credentials still wanted.
    r = requests.get(f"https://127.0.0.1:{tb.https_port}/api/overview", verify=ca, timeout=10)
    assert r.status_code == 401
    # A declare and a publish through HTTPS, checked over AMQPS.
    assert https("PUT", f"/api/queues/%2F/{name}", json={"durable": True}).status_code in (201, 204)
    r = https("POST", "/api/exchanges/%2F/amq.default/publish",
              json={"properties": {}, "routing_key": name, "payload": "via https", "payload_encoding": "string"})
    assert r.status_code == 200 and r.json() == {"routed": True}, r.text
    # CMQ's API on the same port: a signed SendMessage to the same queue.
    host = f"127.0.0.1:{tb.https_port}"
    r = requests.post(f"https://{host}/v2/index.php", data=cmq_signed(host, {"Action": "SendMessage", "queueName": name, "msgBody": "via cmq"}),
                      verify=ca, timeout=10)
    assert r.status_code == 200 and r.json()["code"] == 0, r.text
    with amqps(tb, certs) as c:
        ch = c.channel()
        assert consume_exactly(ch, name, {b"via https", b"via cmq"}) == 2
    # The TLS port speaks no plain HTTP; a client trusting another CA refuses it.
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://127.0.0.1:{tb.https_port}/api/overview", auth=("guest", "guest"), timeout=5)
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(f"https://127.0.0.1:{tb.https_port}/api/overview", verify=str(certs.other_ca), timeout=5)


def test_the_management_api_shows_tls_as_rabbitmq_does(tb, certs):
    """Beyond the flags: what RabbitMQ 3.10.8's management API shows for TLS (checked here with the
    same certificates): a connection's auth_mechanism, ssl, ssl_protocol and peer_cert_* fields,
    the TLS listeners in /api/overview (amqp/ssl, https, https/prometheus) and the port-listener
    health check of the AMQPS port."""
    add_user(tb, CLIENT_DN_USER)
    with amqps(tb, certs, client=certs.client, credentials=pika.credentials.ExternalCredentials()) as ext, \
            amqps(tb, certs) as tls_plain, tb.connection() as plain:
        def listed():
            conns = api(tb, "GET", "/api/connections").json()
            return conns if len(conns) == 3 else None
        by_port = {}
        for c in eventually(listed):
            by_port.setdefault((c["user"], c["port"]), []).append(c)
        ext_c = by_port[(CLIENT_DN_USER, tb.amqps_port)][0]
        assert (ext_c["auth_mechanism"], ext_c["ssl"]) == ("EXTERNAL", True), ext_c
        assert ext_c.get("ssl_protocol") in ("tlsv1.2", "tlsv1.3"), ext_c
        assert ext_c.get("peer_cert_subject") == CLIENT_DN_USER, ext_c
        assert ext_c.get("peer_cert_issuer") == "CN=Warren Test CA,O=Warren Tests", ext_c
        tls_c = by_port[("guest", tb.amqps_port)][0]
        assert (tls_c["auth_mechanism"], tls_c["ssl"]) == ("PLAIN", True), tls_c
        plain_c = by_port[("guest", tb.port)][0]
        assert plain_c["ssl"] is False, plain_c
        assert ext.is_open and tls_plain.is_open and plain.is_open
    listeners = {(x["protocol"], x["port"]) for x in api(tb, "GET", "/api/overview").json()["listeners"]}
    assert {("amqp/ssl", tb.amqps_port), ("https", tb.https_port), ("https/prometheus", tb.prometheus_tls_port)} <= listeners, listeners
    r = api(tb, "GET", f"/api/health/checks/port-listener/{tb.amqps_port}")
    assert r.status_code == 200 and r.json() == {"status": "ok", "port": tb.amqps_port}, r.text


EXPIRY = "warren_tls_certificate_expiry_timestamp_seconds"


def test_metrics_over_tls_with_the_certificates_expiry(tb, certs):
    r = requests.get(f"https://127.0.0.1:{tb.prometheus_tls_port}/metrics", verify=str(certs.ca), timeout=10)
    assert r.status_code == 200
    assert f"# TYPE {EXPIRY} gauge" in r.text
    samples = metric_samples(r.text, EXPIRY)
    not_after = certs.server_cert.not_valid_after_utc.timestamp()
    assert samples and set(samples.values()) == {not_after}, (samples, not_after)
    plain = requests.get(f"http://127.0.0.1:{tb.prometheus_port}/metrics", timeout=10).text
    assert metric_samples(plain, EXPIRY) == samples
    names = lambda text: {m.group(1) for m in re.finditer(r"^# TYPE (\S+)", text, re.M)}  # noqa: E731
    assert names(r.text) == names(plain)
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://127.0.0.1:{tb.prometheus_tls_port}/metrics", timeout=5)


def test_no_expiry_gauge_without_tls(broker):
    text = requests.get(f"http://127.0.0.1:{broker.prometheus_port}/metrics", timeout=10).text
    assert "warren_" in text
    assert EXPIRY not in text


def test_tls_listeners_open_only_with_both_certificate_and_key(tmp_path, certs):
    """A certificate without its key (or a key alone) opens no TLS port: the broker either refuses to
    start, saying why, or runs with its plain ports only."""
    for i, flags in enumerate((["--tls-cert", str(certs.server)], ["--tls-key", str(certs.server_keyfile)])):
        amqp_port, amqps_port, https_port = free_port(), free_port(), free_port()
        log_path = tmp_path / f"warren{i}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([binary_for({}), "server", "--amqp-port", str(amqp_port), "--http-port", str(free_port()),
                                     "--prometheus-port", str(free_port()), "--data-dir", str(tmp_path / f"data{i}"), *flags,
                                     "--amqps-port", str(amqps_port), "--https-port", str(https_port),
                                     "--prometheus-tls-port", str(free_port())], stdout=log, stderr=subprocess.STDOUT)
        try:
            eventually(lambda: proc.poll() is not None or "serving Prometheus metrics" in log_path.read_text())
            if proc.poll() is not None:
                assert proc.returncode != 0
                assert "tls" in log_path.read_text().lower(), log_path.read_text()
                continue
            for port in (amqps_port, https_port):
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection(("127.0.0.1", port), timeout=2).close()
            socket.create_connection(("127.0.0.1", amqp_port), timeout=2).close()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------------------------------------
# Client certificates and EXTERNAL
# ---------------------------------------------------------------------------------------------

VERSIONS = pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls1.2", "tls1.3"])


@VERSIONS
def test_expired_and_foreign_client_certificates_fail_the_handshake(tb, certs, version):
    pinned = dict(max_version=version, min_version=version)
    # The control: the CA's valid client certificate passes (and is offered EXTERNAL).
    assert "EXTERNAL" in mechanisms(tb.amqps_port, client_ctx(certs, certs.client, **pinned))
    for bad in (certs.expired, certs.foreign):
        refused_in_handshake(tb.amqps_port, client_ctx(certs, bad, **pinned))
        with pytest.raises(CONNECT_ERRORS):
            amqps(tb, certs, client=bad, version=version)
    # Refusing them cost the broker nothing: a client without a certificate logs in.
    with amqps(tb, certs, version=version) as c:
        assert c.channel().is_open


@VERSIONS
def test_fail_if_no_peer_cert_refuses_a_client_without_one(start_tls, certs, name, version):
    b = start_tls("--tls-fail-if-no-peer-cert")
    pinned = dict(max_version=version, min_version=version)
    refused_in_handshake(b.amqps_port, client_ctx(certs, **pinned))
    refused_in_handshake(b.amqps_port, client_ctx(certs, certs.expired, **pinned))
    with pytest.raises(CONNECT_ERRORS):
        amqps(b, certs, version=version)
    # With a certificate: PLAIN as guest works (the certificate does not force EXTERNAL).
    assert "EXTERNAL" in mechanisms(b.amqps_port, client_ctx(certs, certs.client, **pinned))
    with amqps(b, certs, client=certs.client, version=version) as c:
        ch = c.channel()
        ch.queue_declare(name)
        ch.confirm_delivery()
        assert publish_confirmed(ch, name, range(30)) == 30
        assert consume_exactly(ch, name, {body_of(i) for i in range(30)}) == 30
    with b.connection() as c:  # the plain port wants no certificate
        assert c.is_open


def test_external_logs_in_as_the_certificates_distinguished_name(tb, certs, name):
    """The user is the subject in RabbitMQ's formatting (CLIENT_DN_USER); then permissions apply as for
    any user: this one may configure only ext-* queues."""
    add_user(tb, CLIENT_DN_USER, configure="^ext-")
    with amqps(tb, certs, client=certs.client, credentials=pika.credentials.ExternalCredentials()) as c:
        assert eventually(lambda: CLIENT_DN_USER in connection_users(tb))
        ch = c.channel()
        q = "ext-" + name
        ch.queue_declare(q, durable=True)
        ch.confirm_delivery()
        assert publish_confirmed(ch, q, range(100)) == 100
        assert consume_exactly(ch, q, {body_of(i) for i in range(100)}) == 100
        ch2 = c.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch2.queue_declare("other-" + name)
        assert e.value.reply_code == 403


def test_external_is_refused_when_no_user_has_the_subjects_name(tb, certs):
    # The CN alone is a user: with the default (distinguished_name) it must not be the one logged in.
    add_user(tb, CLIENT_CN_USER)
    with pytest.raises(pika.exceptions.AMQPConnectionError) as e:
        amqps(tb, certs, client=certs.client, credentials=pika.credentials.ExternalCredentials())
    assert isinstance(e.value, pika.exceptions.ProbableAuthenticationError), repr(e.value)
    assert "403" in str(e.value) and "ACCESS_REFUSED" in str(e.value), str(e.value)
    # The user exists but has no permission on the vhost: connection.open refused.
    add_user(tb, CLIENT_DN_USER, configure=None)
    with pytest.raises(pika.exceptions.AMQPConnectionError) as e:
        amqps(tb, certs, client=certs.client, credentials=pika.credentials.ExternalCredentials())
    assert "530" in str(e.value), repr(e.value)
    with amqps(tb, certs, client=certs.client) as c:  # PLAIN as guest, same certificate
        assert c.is_open


def test_external_is_offered_only_with_a_verified_client_certificate(start_tls, certs):
    """(RabbitMQ 3.10.8 offers EXTERNAL on every TLS connection and refuses it with 403 when no
    certificate came; Warren's rule is stricter: offered only when there is a user name to take.)"""
    b = start_tls()
    assert "EXTERNAL" in mechanisms(b.amqps_port, client_ctx(certs, certs.client))
    without = mechanisms(b.amqps_port, client_ctx(certs))
    assert "PLAIN" in without and "EXTERNAL" not in without
    with socket.create_connection(("127.0.0.1", b.port), timeout=5) as s:
        plain = read_connection_start(s)
    assert "PLAIN" in plain and "EXTERNAL" not in plain
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        amqps(b, certs, credentials=pika.credentials.ExternalCredentials())
    # Without --tls-ca no certificate is asked for, so none is verified: no EXTERNAL either.
    unverified = start_tls(ca=None)
    assert "EXTERNAL" not in mechanisms(unverified.amqps_port, client_ctx(certs, certs.client))
    add_user(unverified, CLIENT_DN_USER)
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        amqps(unverified, certs, client=certs.client, credentials=pika.credentials.ExternalCredentials())


def test_external_with_common_name_logs_in_as_the_cn(start_tls, certs, name):
    b = start_tls("--tls-cert-login-from", "common_name")
    add_user(b, CLIENT_CN_USER)  # and no user named after the whole subject
    with amqps(b, certs, client=certs.client, credentials=pika.credentials.ExternalCredentials()) as c:
        assert eventually(lambda: CLIENT_CN_USER in connection_users(b))
        ch = c.channel()
        ch.queue_declare(name)
        ch.confirm_delivery()
        assert publish_confirmed(ch, name, range(10)) == 10
        assert consume_exactly(ch, name, {body_of(i) for i in range(10)}) == 10


# Subjects (RDNs in issuing order, each a list of attributes) and the user names
# rabbitmq_auth_mechanism_ssl makes of them with ssl_cert_login_from = distinguished_name and
# common_name: each read from RabbitMQ 3.10.8 (Erlang 25) here, the name in its "EXTERNAL login
# refused: user '...'" log line, then a user created with exactly that name logged in with the
# certificate. The RDNs last first, joined by "," (no space); a multi-valued RDN's attributes in
# certificate (DER) order joined by "+"; values escaped as RFC 4514 says (, + " \ < > ; and a
# leading space or #, a trailing space; "=" is not), control characters and every byte past ASCII
# as \XX (upper-case hex of the UTF-8 bytes); RabbitMQ's upper-case attribute names (SN, GIVENNAME,
# SERIALNUMBER, EMAILADDRESS, ...) and the dotted OID for attributes it has no name for (street,
# postalCode included). common_name: the CN's value as it is (UTF-8, nothing escaped).
N = NameOID
DN_CASES = {
    "escapes": ([[(N.COUNTRY_NAME, "GB")], [(N.ORGANIZATION_NAME, "Warren, Tests+Co")], [(N.ORGANIZATIONAL_UNIT_NAME, "Q=A;B")],
                 [(N.COMMON_NAME, 'tls "client" <x> \\y')]],
                r'CN=tls \"client\" \<x\> \\y,OU=Q=A\;B,O=Warren\, Tests\+Co,C=GB', 'tls "client" <x> \\y'),
    "spaces-hash": ([[(N.ORGANIZATION_NAME, " lead")], [(N.ORGANIZATIONAL_UNIT_NAME, "#hash")], [(N.COMMON_NAME, "trail ")]],
                    r"CN=trail\ ,OU=\#hash,O=\ lead", "trail "),
    "control-character": ([[(N.ORGANIZATION_NAME, "tab\there")], [(N.COMMON_NAME, "nul=")]], r"CN=nul=,O=tab\09here", "nul="),
    "utf8": ([[(N.COUNTRY_NAME, "DE")], [(N.ORGANIZATION_NAME, "Wärren Tësts")], [(N.COMMON_NAME, "tls-ümlaut")]],
             r"CN=tls-\C3\BCmlaut,O=W\C3\A4rren T\C3\ABsts,C=DE", "tls-ümlaut"),
    "utf8-cjk": ([[(N.ORGANIZATION_NAME, "日本")], [(N.COMMON_NAME, "é")]], r"CN=\C3\A9,O=\E6\97\A5\E6\9C\AC", "é"),
    "attribute-names": ([[(N.DOMAIN_COMPONENT, "org")], [(N.DOMAIN_COMPONENT, "warren")], [(N.STATE_OR_PROVINCE_NAME, "Kent")],
                         [(N.LOCALITY_NAME, "Canterbury")], [(N.EMAIL_ADDRESS, "qa@warren.test")], [(N.USER_ID, "u42")],
                         [(N.SERIAL_NUMBER, "1234")], [(N.TITLE, "Tester")], [(N.GIVEN_NAME, "Ann")], [(N.SURNAME, "Lee")],
                         [(N.COMMON_NAME, "tls-attrs")]],
                        "CN=tls-attrs,SN=Lee,GIVENNAME=Ann,TITLE=Tester,SERIALNUMBER=1234,UID=u42,"
                        "EMAILADDRESS=qa@warren.test,L=Canterbury,ST=Kent,DC=warren,DC=org", "tls-attrs"),
    "attribute-oids": ([[(N.POSTAL_CODE, "CT1")], [(N.STREET_ADDRESS, "1 High St")], [(N.PSEUDONYM, "ps")], [(N.INITIALS, "AL")],
                        [(N.GENERATION_QUALIFIER, "III")], [(N.DN_QUALIFIER, "dnq")], [(N.BUSINESS_CATEGORY, "Testing")],
                        [(N.JURISDICTION_COUNTRY_NAME, "GB")], [(N.ORGANIZATION_IDENTIFIER, "VATGB-1")],
                        [(x509.ObjectIdentifier("1.3.6.1.4.1.99999.1"), "custom")], [(N.COMMON_NAME, "tls-more")]],
                       "CN=tls-more,1.3.6.1.4.1.99999.1=custom,2.5.4.97=VATGB-1,1.3.6.1.4.1.311.60.2.1.3=GB,2.5.4.15=Testing,"
                       "2.5.4.46=dnq,GENERATIONQUALIFIER=III,INITIALS=AL,PSEUDONYM=ps,2.5.4.9=1 High St,2.5.4.17=CT1", "tls-more"),
    # cryptography writes a multi-valued RDN's attributes sorted by their DER (as DER wants): OU before L,
    # UID before CN.
    "multi-valued": ([[(N.COUNTRY_NAME, "GB")], [(N.ORGANIZATIONAL_UNIT_NAME, "QA"), (N.LOCALITY_NAME, "Kent")],
                      [(N.COMMON_NAME, "tls-multi2")]], "CN=tls-multi2,OU=QA+L=Kent,C=GB", "tls-multi2"),
    "multi-valued-uid": ([[(N.COUNTRY_NAME, "GB")], [(N.COMMON_NAME, "tls-multi3"), (N.USER_ID, "u8")]],
                         "UID=u8+CN=tls-multi3,C=GB", "tls-multi3"),
}


def dn_case_subject(case):
    return x509.Name([x509.RelativeDistinguishedName([x509.NameAttribute(oid, value) for oid, value in rdn])
                      for rdn in DN_CASES[case][0]])


@pytest.mark.parametrize("login_from", ["distinguished_name", "common_name"])
@pytest.mark.parametrize("case", list(DN_CASES))
def test_external_user_names_as_rabbitmq_formats_them(start_tls, certs, tmp_path, case, login_from):
    key = new_key()
    cert = issue(dn_case_subject(case), key, (certs.ca_cert, certs.ca_key), client=True)
    client = SimpleNamespace(certfile=tmp_path / "c.pem", keyfile=tmp_path / "c.key")
    client.certfile.write_bytes(cert_pem(cert))
    client.keyfile.write_bytes(key_pem(key))
    b = start_tls("--tls-cert-login-from", login_from)
    user = DN_CASES[case][1] if login_from == "distinguished_name" else DN_CASES[case][2]
    add_user(b, user)
    try:
        c = amqps(b, certs, client=client, credentials=pika.credentials.ExternalCredentials())
    except pika.exceptions.AMQPConnectionError as e:
        refused = [line for line in b.clean_log().splitlines() if "authentication" in line or "EXTERNAL" in line]
        raise AssertionError(f"EXTERNAL refused for {user!r}: {e!r}; log: {refused[-3:]}") from None
    with c:
        assert eventually(lambda: user in connection_users(b))


def test_tls_settings_from_the_config_file(tmp_path, certs, name):
    """The flags' config-file keys: tls-cert, tls-key, tls-ca, tls-fail-if-no-peer-cert,
    tls-cert-login-from and the three ports."""
    b = Broker(tmp_path / "data", tmp_path / "warren.log")
    b.amqps_port, b.https_port, b.prometheus_tls_port = free_port(), free_port(), free_port()
    config = tmp_path / "warren.toml"
    config.write_text(f"""tls-cert = "{certs.server}"
tls-key = "{certs.sec1_keyfile}"
tls-ca = "{certs.ca}"
tls-fail-if-no-peer-cert = true
tls-cert-login-from = "common_name"
amqps-port = {b.amqps_port}
https-port = {b.https_port}
prometheus-tls-port = {b.prometheus_tls_port}
""")
    b.extra_args = ["--config", str(config)]
    b.start()
    try:
        eventually(lambda: served_cert(b.amqps_port, certs.client) == der(certs.server_cert))
        refused_in_handshake(b.amqps_port, client_ctx(certs))  # no certificate: refused
        add_user(b, CLIENT_CN_USER)
        with amqps(b, certs, client=certs.client, credentials=pika.credentials.ExternalCredentials()) as c:
            assert eventually(lambda: CLIENT_CN_USER in connection_users(b))
            ch = c.channel()
            ch.queue_declare(name)
            ch.confirm_delivery()
            assert publish_confirmed(ch, name, range(10)) == 10
            assert consume_exactly(ch, name, {body_of(i) for i in range(10)}) == 10
        for port in (b.https_port, b.prometheus_tls_port):
            assert served_cert(port, certs.client) == der(certs.server_cert)
    finally:
        if b.alive():
            b.proc.kill()
            b.proc.wait(10)


# ---------------------------------------------------------------------------------------------
# SIGHUP
# ---------------------------------------------------------------------------------------------

def expiry_gauge(b, certs):
    r = requests.get(f"https://127.0.0.1:{b.prometheus_tls_port}/metrics", verify=str(certs.ca), timeout=10)
    return set(metric_samples(r.text, EXPIRY).values())


def test_sighup_serves_the_new_certificate_and_open_connections_keep_working(start_tls, certs, name):
    b = start_tls()
    assert served_cert(b.amqps_port) == der(certs.server_cert)
    before = amqps(b, certs)
    ch = before.channel()
    ch.queue_declare(name, durable=True)
    ch.confirm_delivery()
    assert publish_confirmed(ch, name, range(100)) == 100

    new_cert, new_key = server_identity((certs.ca_cert, certs.ca_key), "rsa", org="Warren Reloaded",
                                        serial=424242, not_after=NOW + 60 * DAY)
    assert new_cert.serial_number != certs.server_cert.serial_number
    b.keyfile.write_bytes(key_pem(new_key, "traditional"))
    b.certfile.write_bytes(cert_pem(new_cert))
    b.proc.send_signal(signal.SIGHUP)
    for port in (b.amqps_port, b.https_port, b.prometheus_tls_port):
        eventually(lambda: served_cert(port) == der(new_cert))
    assert eventually(lambda: expiry_gauge(b, certs) == {new_cert.not_valid_after_utc.timestamp()})

    # The connection opened before goes on publishing and consuming; a new one verifies the new
    # certificate against the CA and publishes too.
    assert publish_confirmed(ch, name, range(100, 200)) == 100
    with amqps(b, certs) as after:
        ach = after.channel()
        ach.confirm_delivery()
        assert publish_confirmed(ach, name, range(200, 300)) == 100
    assert consume_exactly(ch, name, {body_of(i) for i in range(300)}) == 300
    before.close()
    assert not error_lines(b), error_lines(b)
    assert b.alive()


def test_sighup_rereads_the_ca(start_tls, certs):
    b = start_tls()
    assert "EXTERNAL" in mechanisms(b.amqps_port, client_ctx(certs, certs.client))
    refused_in_handshake(b.amqps_port, client_ctx(certs, certs.foreign))
    b.cafile.write_bytes(certs.other_ca.read_bytes())
    b.proc.send_signal(signal.SIGHUP)
    assert eventually(lambda: "EXTERNAL" in mechanisms(b.amqps_port, client_ctx(certs, certs.foreign)))
    refused_in_handshake(b.amqps_port, client_ctx(certs, certs.client))


GARBAGE = b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\ngarbage\n"


@pytest.mark.parametrize("bad", ["garbage-cert", "empty-cert", "garbage-key", "key-of-another-cert", "garbage-ca"])
def test_a_reload_that_fails_keeps_the_old_certificate_and_logs_an_error(start_tls, certs, name, bad):
    b = start_tls()
    old = der(certs.server_cert)
    errors = len(error_lines(b))
    other_cert, _other_key = server_identity((certs.ca_cert, certs.ca_key), "ec", org="Warren Unmatched")
    if bad == "garbage-cert":
        b.certfile.write_bytes(GARBAGE)
    elif bad == "empty-cert":
        b.certfile.write_bytes(b"")
    elif bad == "garbage-key":
        b.keyfile.write_bytes(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    elif bad == "key-of-another-cert":
        b.certfile.write_bytes(cert_pem(other_cert))  # the key file stays the old certificate's
    else:
        b.cafile.write_bytes(GARBAGE)
    b.proc.send_signal(signal.SIGHUP)
    assert eventually(lambda: len(error_lines(b)) > errors), b.clean_log()[-2000:]
    assert b.alive()
    for port in (b.amqps_port, b.https_port, b.prometheus_tls_port):
        assert served_cert(port) == old
    # Still serving with everything it had: the CA too (the client certificate still accepted).
    assert "EXTERNAL" in mechanisms(b.amqps_port, client_ctx(certs, certs.client))
    with amqps(b, certs) as c:
        ch = c.channel()
        ch.queue_declare(name)
        ch.confirm_delivery()
        assert publish_confirmed(ch, name, range(20)) == 20
        assert consume_exactly(ch, name, {body_of(i) for i in range(20)}) == 20
    assert expiry_gauge(b, certs) == {certs.server_cert.not_valid_after_utc.timestamp()}
    # Good files and another SIGHUP: the new certificate is served.
    new_cert, new_key = server_identity((certs.ca_cert, certs.ca_key), "ec", org="Warren Fixed")
    b.keyfile.write_bytes(key_pem(new_key))
    b.certfile.write_bytes(cert_pem(new_cert))
    b.cafile.write_bytes(certs.ca.read_bytes())
    b.proc.send_signal(signal.SIGHUP)
    eventually(lambda: served_cert(b.amqps_port) == der(new_cert))
    assert "EXTERNAL" in mechanisms(b.amqps_port, client_ctx(certs, certs.client))


# ---------------------------------------------------------------------------------------------
# Clients that never finish the handshake
# ---------------------------------------------------------------------------------------------

def handshake_timeout(monkeypatch, seconds):
    """Flags (or the environment) for a handshake timeout of `seconds`."""
    if "--handshake-timeout" in server_help():
        return ["--handshake-timeout", str(seconds)]
    monkeypatch.setenv("WARREN_HANDSHAKE_TIMEOUT", str(seconds))
    return []


def client_hello(certs):
    """The first flight of a TLS client (its ClientHello), as bytes."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_ctx(certs).wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def closed_within(sock, seconds):
    """What the peer sent before closing, if it closed within `seconds`; None if still open."""
    sock.settimeout(0.2)
    got = b""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return got
        if not chunk:
            return got
        got += chunk
    return None


def test_silent_and_plaintext_clients_on_the_amqps_port_are_dropped(start_tls, certs, monkeypatch, name):
    b = start_tls(*handshake_timeout(monkeypatch, 2))
    started = time.time()
    silent = socket.create_connection(("127.0.0.1", b.amqps_port), timeout=5)
    half_hello = socket.create_connection(("127.0.0.1", b.amqps_port), timeout=5)
    hello = client_hello(certs)
    half_hello.sendall(hello[:len(hello) // 2])
    plaintext = socket.create_connection(("127.0.0.1", b.amqps_port), timeout=5)
    plaintext.sendall(PROTOCOL_HEADER)
    tls_then_nothing = tls_socket(b.amqps_port, client_ctx(certs))
    # A plaintext AMQP header is not TLS: dropped at once, with at most a TLS alert, never AMQP.
    got = closed_within(plaintext, 3)
    assert got is not None, "a plaintext client stayed connected"
    assert got == b"" or got[:1] == b"\x15", f"answered plaintext with {got[:16]!r}"
    # Meanwhile the broker serves a real client promptly.
    t = time.time()
    with amqps(b, certs) as c:
        ch = c.channel()
        ch.queue_declare(name)
        ch.confirm_delivery()
        assert publish_confirmed(ch, name, range(10)) == 10
        assert consume_exactly(ch, name, {body_of(i) for i in range(10)}) == 10
    assert time.time() - t < 1.5
    for what, s in (("silent", silent), ("half a ClientHello", half_hello)):
        got = closed_within(s, max(0.1, started + 5 - time.time()))
        assert got is not None, f"{what}: still open {time.time() - started:.1f}s after connecting (handshake timeout 2s)"
        assert got == b"" or got[:1] == b"\x15", f"{what}: {got[:16]!r}"
    # TLS done, no AMQP header: the handshake timeout covers the AMQP handshake after TLS.
    tls_then_nothing.settimeout(max(0.1, started + 5 - time.time()))
    try:
        assert tls_then_nothing.recv(7) == b""
    except socket.timeout:
        raise AssertionError(f"a TLS client that sent no AMQP header still open after {time.time() - started:.1f}s") from None
    except (ssl.SSLError, ConnectionResetError):
        pass
    for s in (silent, half_hello, plaintext, tls_then_nothing):
        s.close()
    assert b.alive()
    with amqps(b, certs) as c:
        assert c.channel().is_open


def test_stalled_handshakes_hold_up_no_other_client(start_tls, certs, name):
    """25 connections on each TLS port sit in their handshakes (silent, or half a ClientHello) under the
    default 10 s timeout; meanwhile new clients on every port are served at once (a TLS accept done
    in the accept loop would queue them behind the stalled ones)."""
    b = start_tls()
    hello = client_hello(certs)
    stalled = []
    for port in (b.amqps_port, b.https_port, b.prometheus_tls_port):
        for i in range(25):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:
                s.sendall(hello[:len(hello) // 2])
            stalled.append(s)
    try:
        t = time.time()
        with amqps(b, certs) as c:
            ch = c.channel()
            ch.queue_declare(name)
            ch.confirm_delivery()
            assert publish_confirmed(ch, name, range(10)) == 10
            assert consume_exactly(ch, name, {body_of(i) for i in range(10)}) == 10
        r = api(b, "GET", "/api/overview", port=b.https_port, scheme="https", verify=str(certs.ca))
        assert r.status_code == 200
        r = requests.get(f"https://127.0.0.1:{b.prometheus_tls_port}/metrics", verify=str(certs.ca), timeout=5)
        assert r.status_code == 200
        assert time.time() - t < 3, f"served in {time.time() - t:.1f}s beside 75 stalled handshakes"
    finally:
        for s in stalled:
            s.close()


# ---------------------------------------------------------------------------------------------
# Warren's own clients, Go's and Java's
# ---------------------------------------------------------------------------------------------

def ctl(b, *args, ca=None):
    tls = ["--tls-ca", str(ca)] if ca else []
    return subprocess.run([binary_for({}), "ctl", "--url", f"https://127.0.0.1:{b.https_port}", *tls, *args],
                          capture_output=True, text=True, timeout=30)


def test_ctl_over_https(tb, certs, name):
    with amqps(tb, certs) as c:
        ch = c.channel()
        ch.queue_declare(name, durable=True)
        ch.confirm_delivery()
        assert publish_confirmed(ch, name, range(3)) == 3
    p = ctl(tb, "list", "queues", "--json", ca=certs.ca)
    assert p.returncode == 0, p.stderr
    mine = [q for q in json.loads(p.stdout) if q["name"] == name]
    assert len(mine) == 1 and mine[0]["messages"] == 3, p.stdout
    p = ctl(tb, "list", "queues", ca=certs.ca)
    assert p.returncode == 0 and name in p.stdout, p.stderr
    p = ctl(tb, "declare", "queue", name + "-ctl", ca=certs.ca)
    assert p.returncode == 0, p.stderr
    with tb.connection() as c:
        c.channel().queue_declare(name + "-ctl", passive=True)
    # The CA decides: another CA's bundle, or none (the test CA is no system root), is refused.
    for ca in (certs.other_ca, None):
        p = ctl(tb, "list", "queues", ca=ca)
        assert p.returncode != 0 and name not in p.stdout, f"--tls-ca {ca}: rc {p.returncode}\n{p.stdout}"
        assert "certificate" in (p.stderr + p.stdout).lower() or "tls" in (p.stderr + p.stdout).lower(), p.stderr


def bench(b, tmp_path, queue, n, *tls):
    out = tmp_path / f"{queue}.json"
    p = subprocess.run([binary_for({}), "bench", "--uri", f"amqps://guest:guest@127.0.0.1:{b.amqps_port}/%2F", *tls,
                        "--pmessages", str(n), "--confirm", "100", "--prefetch", "200", "--persistent", "--queue", queue,
                        "--progress-every", "0", "--time", "30", "--json", str(out)],
                       capture_output=True, text=True, timeout=60)
    return p, (json.loads(out.read_text()) if p.returncode == 0 and out.exists() else None)


def test_bench_over_amqps(tb, certs, tmp_path, name):
    p, s = bench(tb, tmp_path, name, 5000, "--tls-ca", str(certs.ca))
    assert p.returncode == 0, p.stdout + p.stderr
    assert s["sent"] == s["confirmed"] == s["consumed"] == 5000 and s["nacked"] == 0, s
    # Without --tls-ca it trusts any certificate (as PerfTest does).
    p, s = bench(tb, tmp_path, name + "-any", 500)
    assert p.returncode == 0, p.stdout + p.stderr
    assert s["sent"] == s["confirmed"] == s["consumed"] == 500, s
    # With another CA's bundle the server's certificate is refused.
    p, s = bench(tb, tmp_path, name + "-other", 100, "--tls-ca", str(certs.other_ca))
    assert p.returncode != 0, p.stdout + p.stderr


def perftest_lib():
    cache = os.environ.get("WARREN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "warren")
    return Path(cache) / "perftest" / "lib"


def test_java_client_over_amqps(tb, certs):
    lib = perftest_lib()
    if not shutil.which("java"):
        pytest.skip("java is not installed")
    if not list(lib.glob("amqp-client-*.jar")):
        pytest.skip(f"no RabbitMQ Java client in {lib} (scripts/install-perftest.sh)")
    p = subprocess.run(["java", "-cp", f"{lib}/*", str(ROOT / "tests" / "java" / "TlsCheck.java"),
                        "127.0.0.1", str(tb.amqps_port), str(certs.ca), "2000"],
                       capture_output=True, text=True, timeout=120)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert re.match(r"confirmed 2000 \(\d+ basic\.ack\), consumed 2000 of 2000 over TLSv1\.[23]$", last), last
    # Trusting another CA it must fail.
    p = subprocess.run(["java", "-cp", f"{lib}/*", str(ROOT / "tests" / "java" / "TlsCheck.java"),
                        "127.0.0.1", str(tb.amqps_port), str(certs.other_ca), "10"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "PKIX path building failed" in p.stdout + p.stderr


# ---------------------------------------------------------------------------------------------
# rabbitmqadmin and a real Prometheus over TLS
# ---------------------------------------------------------------------------------------------

def rabbitmqadmin_tls(b, *args, ca=None):
    """Debian's rabbitmqadmin against the HTTPS port, by the name the server certificate carries
    (SAN DNS:localhost), verifying it against `ca` (None: only the system's roots)."""
    if not shutil.which("rabbitmqadmin"):
        pytest.skip("rabbitmqadmin is not installed (Debian's rabbitmq-server package ships it)")
    tls = [f"--ssl-ca-cert-file={ca}"] if ca else []
    return subprocess.run(["rabbitmqadmin", "--host", "localhost", "--port", str(b.https_port), "--ssl", *tls,
                           "-u", "guest", "-p", "guest", *args], capture_output=True, text=True, timeout=30)


def test_rabbitmqadmin_over_https(tb, certs, name):
    """declare, publish, list and get with rabbitmqadmin over HTTPS, every body counted; without the
    CA (or with another CA's) it fails on the certificate and changes nothing."""
    def admin(*args):
        p = rabbitmqadmin_tls(tb, *args, ca=certs.ca)
        assert p.returncode == 0, f"rabbitmqadmin {' '.join(args)}: rc {p.returncode}\n{p.stdout}{p.stderr}"
        return p.stdout

    def listed():
        rows = [line.split("\t") for line in admin("-f", "tsv", "list", "queues", "name", "messages").splitlines()]
        assert rows and rows[0] == ["name", "messages"], rows
        return {r[0]: int(r[1]) for r in rows[1:]}

    def plain_messages(queue):
        r = api(tb, "GET", f"/api/queues/%2F/{queue}")
        assert r.status_code == 200, r.text
        return r.json()["messages"]

    bodies = [f"{name}-body-{i}" for i in range(5)]
    admin("declare", "queue", f"name={name}", "durable=true")
    for body in bodies:
        admin("publish", "exchange=amq.default", f"routing_key={name}", f"payload={body}")
    assert listed()[name] == 5
    assert plain_messages(name) == 5

    # Untrusted: no CA (the test CA is no system root) or another CA. Each fails in the handshake,
    # before any request: no queue declared, no message published.
    for ca in (None, certs.other_ca):
        for args in (("declare", "queue", f"name={name}-untrusted"),
                     ("publish", "exchange=amq.default", f"routing_key={name}", "payload=untrusted")):
            p = rabbitmqadmin_tls(tb, *args, ca=ca)
            out = p.stdout + p.stderr
            assert p.returncode != 0, f"--ssl-ca-cert-file={ca}: {args} succeeded\n{out}"
            assert "CERTIFICATE_VERIFY_FAILED" in out, out
    assert api(tb, "GET", f"/api/queues/%2F/{name}-untrusted").status_code == 404
    assert name + "-untrusted" not in listed()
    assert plain_messages(name) == 5

    got = json.loads(admin("-f", "raw_json", "get", f"queue={name}", "count=5", "ackmode=ack_requeue_false"))
    assert [m["payload"] for m in got] == bodies, got
    assert {(m["routing_key"], m["exchange"], m["payload_encoding"]) for m in got} == {(name, "", "string")}, got
    assert [m["redelivered"] for m in got] == [False] * 5, got
    assert [m["message_count"] for m in got] == [4, 3, 2, 1, 0], got
    assert listed()[name] == 0
    assert plain_messages(name) == 0
    assert json.loads(admin("-f", "raw_json", "get", f"queue={name}", "count=5", "ackmode=ack_requeue_false")) == []
    with tb.connection() as c:
        assert c.channel().queue_declare(name, passive=True).method.message_count == 0


def test_a_real_prometheus_scrapes_metrics_over_tls(tb, certs, tmp_path):
    """Prometheus scrapes the TLS metrics port with `scheme: https`, trusting the CA; the same target
    with another CA, or with a name the certificate does not carry, is down with the certificate
    error."""
    if not shutil.which("prometheus"):
        pytest.skip("Debian's prometheus is not installed (scripts/install-test-deps.sh installs it)")
    target = f"127.0.0.1:{tb.prometheus_tls_port}"
    jobs = {"warren-tls": (certs.ca, "localhost"), "wrong-ca": (certs.other_ca, "localhost"),
            "wrong-name": (certs.ca, "warren.example")}
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s, scrape_timeout: 1s}\nscrape_configs:\n" + "".join(
        f"  - job_name: {job}\n    scheme: https\n    tls_config: {{ca_file: '{ca}', server_name: {server_name}}}\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n" for job, (ca, server_name) in jobs.items()))
    port = free_port()
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "ab") as log:
        prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/api/v1"

    def query(q):
        r = requests.get(f"{base}/query", params={"query": q}, timeout=5)
        assert r.status_code == 200 and r.json()["status"] == "success", r.text
        return r.json()["data"]["result"]

    try:
        def scraped():
            assert prom.poll() is None, f"prometheus exited with {prom.returncode}:\n{log_path.read_text()[-3000:]}"
            active = requests.get(f"{base}/targets", timeout=5).json()["data"]["activeTargets"]
            by_job = {t["labels"]["job"]: t for t in active}
            # Until the good job is up (a scrape that failed under load is retried each second) and
            # the others have been tried.
            if (set(by_job) == set(jobs) and by_job["warren-tls"]["health"] == "up"
                    and all(t["health"] != "unknown" for t in by_job.values())):
                return by_job
            return None
        try:
            targets = eventually(scraped, timeout=60, interval=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n---- prometheus log ----\n{log_path.read_text()[-3000:]}") from None
        up = targets["warren-tls"]
        assert up["health"] == "up" and up["lastError"] == "", up
        assert up["scrapeUrl"] == f"https://{target}/metrics", up
        assert "x509: certificate signed by unknown authority" in targets["wrong-ca"]["lastError"], targets["wrong-ca"]
        assert "x509: certificate is valid for localhost, not warren.example" in targets["wrong-name"]["lastError"], targets["wrong-name"]
        for job in ("wrong-ca", "wrong-name"):
            assert targets[job]["health"] == "down", targets[job]

        # A target's health is reported as its scrape ends, its samples committed just after: poll for them.
        build = eventually(lambda: query('rabbitmq_build_info{job="warren-tls"}'), timeout=30, interval=0.5)
        assert len(build) == 1 and build[0]["value"][1] == "1", build
        assert build[0]["metric"]["instance"] == target and build[0]["metric"]["rabbitmq_version"], build
        expiry = eventually(lambda: query(f'{EXPIRY}{{job="warren-tls"}}'), timeout=30, interval=0.5)
        assert {float(s["value"][1]) for s in expiry} == {certs.server_cert.not_valid_after_utc.timestamp()}, expiry
        want_up = {"warren-tls": "1", "wrong-ca": "0", "wrong-name": "0"}
        ups = lambda: {s["metric"]["job"]: s["value"][1] for s in query("up")}  # noqa: E731
        try:
            eventually(lambda: ups() == want_up, timeout=30, interval=0.5)
        except AssertionError:
            raise AssertionError(f"up: {ups()}, wanted {want_up}") from None
        assert query('rabbitmq_build_info{job!="warren-tls"}') == []
    finally:
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(10)
