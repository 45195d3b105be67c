"""Canaries: no secret ever reaches the log (the broker's stdout and stderr, with the log level at
`debug`), an HTTP or CMQ answer, an AMQP connection.close or `warren ctl`'s output
(docs/security.md, "Secrets at rest and in logs").

Every secret is a distinctive string made for the run ('CANARY<what>-<uuid>'), used where a secret
goes: the default user's password (`WARREN_DEFAULT_PASS`), a password set through the management
API, one changed with `warren ctl change-password`, wrong passwords over AMQP (PLAIN, AMQPLAIN,
malformed responses, AMQPS), over HTTP(S) Basic auth and to `warren ctl`, CMQ signing keys (the one
the server makes and a wrong one) and the signature the server would have expected, password hashes
and clear passwords in definitions imports, malformed JSON bodies holding a password, the TLS private
key (and keys a SIGHUP failed to load), the cluster secret (three nodes, `warren ctl cluster-status`
with a wrong one), and configuration errors next to `default-pass` and `cluster-secret`. Each is
searched as is, in hex, in base64 at every alignment (inside `user:password` say) and as Rust's Debug
of its bytes (`[67, 65, ...]`). The salted hashes of the passwords (GET /api/users/NAME) are searched
too.

Each search is shown able to fail: a control string the server does echo (a queue name in a debug
line, a user name in a failed-login line, a mechanism name in connection.close, a hashing_algorithm
in an HTTP error, a user name in a ctl error, a bad value in a configuration error) is found by the
same search in the same text; `test_the_search_finds_every_spelling` checks the spellings.

Cases where a secret does reach the output are marked xfail(strict=True, raises=Leak), so they fail
again as soon as they are fixed (then drop the mark): a TOML syntax error on the line of
default-pass or cluster-secret prints that line (at startup, and into the log on SIGHUP); a TLS key
file flattened onto one line, or with its first base64 line glued to BEGIN, is printed as a byte
list in the error (at startup and on SIGHUP); PUT /api/users echoes a password_hash that is not a
string in its 400. ~3 s for the file."""
import base64
import hashlib
import hmac
import json
import os
import random
import re
import signal
import socket
import ssl
import subprocess
import time
import uuid
from types import SimpleNamespace

import pika
import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from conftest import Broker, binary_for, eventually, free_port, three_node_cluster
from rawamqp import CLIENT_PROPERTIES, PROTOCOL_HEADER, RawConnection, longstr, method_frame, shortstr
from test_tls import cert_pem, issue, key_pem, new_key
from test_tls import name as x509_name

pytestmark = [pytest.mark.needs_process, pytest.mark.warren_only]

ANSI = re.compile(r"\x1b\[[0-9;]*m")
ALL = {"configure": ".*", "write": ".*", "read": ".*"}
SHA256 = "rabbit_password_hashing_sha256"


class Leak(AssertionError):
    """A secret was found where it must not be (the failure the xfail cases expect)."""


# ---------------------------------------------------------------------------------------------
# Spellings of a secret, and the search
# ---------------------------------------------------------------------------------------------

def spellings(secret):
    """The forms in which `secret` (str or bytes) could reach a text: as is (if text), hex (both
    cases), Rust's Debug of its bytes (`[67, 65, 78]`, how a Vec<u8> or an error holding one prints),
    and base64 (standard and URL-safe) at each of the three alignments it can take inside a longer
    encoded text (a Basic header's `user:password`), without the characters that depend on what is
    before or after it. Base64 forms shorter than 12 characters are left out (they could match by
    chance)."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    out = {raw.hex(), raw.hex().upper(), ", ".join(map(str, raw))}
    if isinstance(secret, str):
        out.add(secret)
    for pad in range(3):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            text = encode(b"\0" * pad + raw).decode()
            inner = text[4 if pad else 0:-4]
            if len(inner) >= 12:
                out.add(inner)
    return out


class Canaries:
    """Named secrets (or controls) and the search for them in a text."""

    def __init__(self, prefix="CANARY"):
        self.prefix = prefix
        self.items = {}  # label -> (value, spellings)

    def make(self, label, length=32):
        value = f"{self.prefix}{label}-{uuid.uuid4().hex[:length]}"
        self.add(label, value)
        return value

    def add(self, label, value):
        assert label not in self.items, label
        self.items[label] = (value, spellings(value))
        return value

    def found(self, text):
        """[(label, spelling, the line it is on)] for every secret found in `text`."""
        hits = []
        for label, (_, forms) in self.items.items():
            for form in sorted(forms, key=len, reverse=True):
                at = text.find(form)
                if at >= 0:
                    start, end = text.rfind("\n", 0, at) + 1, text.find("\n", at)
                    hits.append((label, form, text[start:end if end >= 0 else len(text)][:600]))
                    break
        return hits

    def found_labels(self, text):
        return {label for label, _, _ in self.found(text)}


def assert_no_secret(secrets, where, text):
    hits = secrets.found(text)
    if hits:
        raise Leak(f"{len(hits)} secret(s) in {where}:\n" + "\n".join(f"- {label} as {form[:60]!r} in: {line}" for label, form, line in hits))


def assert_controls_found(controls, where, text):
    missing = set(controls.items) - controls.found_labels(text)
    assert not missing, f"the search did not find the control(s) {sorted(missing)} that {where} does echo: the search or the collection is broken"


def test_the_search_finds_every_spelling():
    """The search itself: a secret embedded in each of its spellings (base64 inside `user:secret` at
    every offset, hex, a Debug byte list) is found; text without it is not."""
    c = Canaries()
    secret = c.make("pw")
    assert not c.found("a log line with guest and CANARYpw-something-else")
    for prefix in ["", "u", "us", "use", "user:"]:
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            blob = encode(f"{prefix}{secret}:tail".encode()).decode()
            assert c.found_labels(f"Authorization: Basic {blob} ...") == {"pw"}, (prefix, blob)
    assert c.found_labels(f"x={secret.encode().hex()}") == {"pw"}
    assert c.found_labels(f"key: {secret.encode().hex().upper()}") == {"pw"}
    assert c.found_labels(f"error: illegal section start: {list(b'-----BEGIN ' + secret.encode())}") == {"pw"}
    assert c.found_labels(f"\x1b[3muser\x1b[0m=\x1b[2m{secret}\x1b[0m") == {"pw"}
    with pytest.raises(Leak):
        assert_no_secret(c, "a text", f"password={secret}")


# ---------------------------------------------------------------------------------------------
# Clients that collect every answer
# ---------------------------------------------------------------------------------------------

class Collected:
    """Every answer a test saw: HTTP and CMQ answers, AMQP refusals, `warren ctl` output."""

    def __init__(self):
        self.http, self.amqp, self.ctl = [], [], []

    def answer(self, r, what):
        self.http.append(f"{what} -> {r.status_code} {dict(r.headers)}\n{r.text}")
        return r

    def text(self, kind):
        return "\n".join(getattr(self, kind))


def ctl_run(collected, args, env=None):
    proc = subprocess.run([binary_for({}), "ctl", *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})
    # Its output only: the arguments hold the passwords given to it.
    collected.ctl.append(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def pika_refusal(host, port, user, password, ssl_options=None):
    """The text of pika's exception for a refused login (it carries connection.close's reply)."""
    params = pika.ConnectionParameters(host, port, "/", pika.PlainCredentials(user, password), connection_attempts=1,
                                       ssl_options=ssl_options, socket_timeout=5)
    with pytest.raises(pika.exceptions.AMQPConnectionError) as e:
        pika.BlockingConnection(params).close()
    return f"{type(e.value).__name__}: {e.value!r} {e.value.args!r}"


def raw_login(port, mechanism, response):
    """Sends start-ok with `mechanism` and `response`; the server's answer: the connection.close that
    refuses it (or what came instead). Nothing of what was sent."""
    r = RawConnection("127.0.0.1", port)
    try:
        r.send(PROTOCOL_HEADER)
        r.expect(10, 10)
        r.send(method_frame(0, 10, 11, CLIENT_PROPERTIES + shortstr(mechanism) + longstr(response) + shortstr("en_US")))
        try:
            f = r.read_method()
        except (ConnectionError, OSError) as e:
            return f"socket closed: {e}"
        if f.method == (10, 50):
            code, text = f.close_reply()
            return f"connection.close {code} {text}"
        return f"{f} {f.payload!r}"
    finally:
        r.close()


def amqplain(user, password):
    return shortstr("LOGIN") + b"S" + longstr(user) + shortstr("PASSWORD") + b"S" + longstr(password)


def cmq_params(host, secret_id, key, params, sign_method="HmacSHA1"):
    """A CMQ request's parameters signed as the SDK signs them (tests/python/test_http_cmq.py), and the
    text signed."""
    p = {"SecretId": secret_id, "Nonce": str(random.randint(1, 1 << 30)), "Timestamp": str(int(time.time())),
         "SignatureMethod": sign_method, **params}
    text = "POST" + host + "/v2/index.php?" + "&".join(f"{k.replace('_', '.')}={p[k]}" for k in sorted(p))
    p["Signature"] = cmq_signature(key, text, sign_method)
    return p, text


def cmq_signature(key, text, sign_method):
    digest = hashlib.sha1 if sign_method == "HmacSHA1" else hashlib.sha256
    return base64.b64encode(hmac.new(key.encode(), text.encode(), digest).digest()).decode()


def rabbit_hash(password):
    salt = os.urandom(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def add_hash(secrets, label, password_hash):
    """A password hash (base64 of salt ‖ digest) as secrets: the text, and its digest alone."""
    secrets.add(label, password_hash)
    secrets.add(f"{label}-digest", base64.b64decode(password_hash)[4:])


# ---------------------------------------------------------------------------------------------
# TLS material
# ---------------------------------------------------------------------------------------------

def make_tls(d):
    d.mkdir(parents=True, exist_ok=True)
    ca_key = new_key()
    ca = issue(x509_name([(NameOID.COMMON_NAME, "Canary Test CA")]), ca_key, ca=True)
    key = new_key()
    cert = issue(x509_name([(NameOID.COMMON_NAME, "localhost")]), key, (ca, ca_key), server=True)
    t = SimpleNamespace(dir=d, ca=d / "ca.pem", cert=d / "cert.pem", key=d / "key.pem", key_pem=key_pem(key))
    t.ca.write_bytes(cert_pem(ca))
    t.cert.write_bytes(cert_pem(cert))
    t.key.write_bytes(t.key_pem)
    return t


def add_key(secrets, label, pem):
    """A PEM private key as secrets: each base64 line of its body, and its DER."""
    pem = pem.decode() if isinstance(pem, bytes) else pem
    lines = [line for line in pem.splitlines() if line and not line.startswith("-----")]
    for i, line in enumerate(lines):
        if len(line) >= 16:
            secrets.add(f"{label}-line{i}", line)
    secrets.add(f"{label}-der", serialization.load_pem_private_key(pem.encode(), None).private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def flattened_keys(pem):
    """A PEM key as operators break it: on one line (newlines turned to spaces, or to a literal `\\n`
    as when pasted from an environment variable), or its first base64 line glued to the BEGIN line."""
    pem = pem.decode()
    return {
        "one-line": pem.replace("\n", " ").strip() + "\n",
        "literal-newlines": pem.replace("\n", "\\n") + "\n",
        "glued-to-begin": pem.replace("-----\n", "-----", 1),
    }


class CanaryBroker(Broker):
    """conftest's Broker with AMQPS and HTTPS (--tls-cert, --tls-key) and the log at debug."""

    def __init__(self, tmp, tls, extra=()):
        super().__init__(tmp / "data", tmp / "warren.log")
        self.amqps_port, self.https_port, self.prometheus_tls_port = free_port(), free_port(), free_port()
        self.extra_args = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--amqps-port", str(self.amqps_port),
                           "--https-port", str(self.https_port), "--prometheus-tls-port", str(self.prometheus_tls_port), *extra]

    def start(self):
        super().start()

        def tls_ports_accept():
            if self.proc.poll() is not None:
                raise RuntimeError(f"warren exited with {self.proc.returncode}:\n{self.log_text()}")
            for port in (self.amqps_port, self.https_port):
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True

        eventually(tls_ports_accept, timeout=10)

    def clean_log(self):
        return ANSI.sub("", self.log_text())

    def stop(self):
        if self.alive():
            self.terminate()


def log_lines_with(b, text):
    return [line for line in b.clean_log().splitlines() if text in line]


def sighup_and_wait(b, marker):
    """SIGHUP, then waits for one more log line holding `marker`."""
    before = len(log_lines_with(b, marker))
    b.proc.send_signal(signal.SIGHUP)
    eventually(lambda: len(log_lines_with(b, marker)) > before, timeout=10)


@pytest.fixture
def debug_env(monkeypatch):
    monkeypatch.setenv("WARREN_LOG", "debug")
    # Every wrong password answered at once (the throttle is not what this file is about).
    monkeypatch.setenv("WARREN_LOGIN_FAILURES_BEFORE_DELAY", "0")
    return monkeypatch


@pytest.fixture
def started(tmp_path, request):
    """started(broker) starts it; every one is killed after the test (its log printed on failure)."""
    brokers = []

    def start(b):
        brokers.append(b)
        b.start()
        return b

    yield start
    failed = getattr(request.node, "rep_call", None)
    for b in brokers:
        if b.alive():
            b.proc.kill()
            b.proc.wait(10)
        if failed is not None and failed.failed:
            print(f"---- {b.log_path} ----\n" + ANSI.sub("", b.log_text())[-6000:])


# ---------------------------------------------------------------------------------------------
# One broker: passwords, logins, CMQ keys, imports, malformed bodies, the TLS key
# ---------------------------------------------------------------------------------------------

def test_no_secret_reaches_the_log_or_an_answer(tmp_path, debug_env, started):
    secrets, log_controls, http_controls, ctl_controls, amqp_controls = Canaries(), Canaries("CTRL"), Canaries("CTRL"), Canaries("CTRL"), Canaries("CTRL")
    seen = Collected()
    tls = make_tls(tmp_path / "tls")
    add_key(secrets, "tls-key", tls.key_pem)
    default_pass = secrets.make("default-pass")
    debug_env.setenv("WARREN_DEFAULT_PASS", default_pass)
    b = started(CanaryBroker(tmp_path, tls))
    api, apis = f"http://127.0.0.1:{b.http_port}/api", f"https://127.0.0.1:{b.https_port}/api"
    admin = ("guest", default_pass)

    def http(method, path, what=None, record=True, base=None, **kw):
        kw.setdefault("auth", admin)
        if base == apis:
            kw.setdefault("verify", str(tls.ca))
        r = requests.request(method, (base or api) + path, timeout=30, **kw)
        return seen.answer(r, what or f"{method} {path}") if record else r

    # The default password is in force; the log is at debug (a channel error is logged at debug
    # only, with the queue's name: a control for the log).
    assert http("GET", "/whoami").json()["name"] == "guest"
    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", b.port, "/", pika.PlainCredentials("guest", default_pass)))
    missing = log_controls.make("queue")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        c.channel().queue_declare(missing, passive=True)
    assert e.value.reply_code == 404
    c.close()

    # A user made through the API, with its hash taken from the API.
    user = f"canary-{uuid.uuid4().hex[:8]}"
    user_pass = secrets.make("user-pass")
    assert http("PUT", f"/users/{user}", json={"password": user_pass, "tags": "administrator"}).status_code == 201
    assert http("PUT", f"/permissions/%2F/{user}", json=ALL).status_code == 201
    pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", b.port, "/", pika.PlainCredentials(user, user_pass))).close()
    assert http("GET", "/whoami", auth=(user, user_pass)).status_code == 200
    add_hash(secrets, "user-pass-hash", http("GET", f"/users/{user}", record=False).json()["password_hash"])
    add_hash(secrets, "default-pass-hash", http("GET", "/users/guest", record=False).json()["password_hash"])

    # warren ctl: change-password (over HTTP and HTTPS), add-user, wrong passwords, a refused add-user.
    url = ["--url", f"http://127.0.0.1:{b.http_port}", "--user", "guest", "--password", default_pass]
    url_tls = ["--url", f"https://127.0.0.1:{b.https_port}", "--tls-ca", str(tls.ca), "--user", "guest", "--password", default_pass]
    ctl_pass = secrets.make("ctl-pass")
    done = ctl_run(seen, [*url, "change-password", user, ctl_pass])
    assert done.returncode == 0 and done.stdout.strip() == f"password changed: {user}", done
    ctl_pass_tls = secrets.make("ctl-pass-tls")
    assert ctl_run(seen, [*url_tls, "change-password", user, ctl_pass_tls]).returncode == 0
    pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", b.port, "/", pika.PlainCredentials(user, ctl_pass_tls))).close()
    add_hash(secrets, "ctl-pass-hash", http("GET", f"/users/{user}", record=False).json()["password_hash"])
    ctl_user, ctl_user_pass = f"{user}-ctl", secrets.make("ctl-add-user-pass")
    assert ctl_run(seen, [*url, "add-user", ctl_user, ctl_user_pass]).returncode == 0
    assert "already exists" in ctl_run(seen, [*url, "add-user", ctl_user, secrets.make("ctl-add-existing-pass")]).stderr
    add_hash(secrets, "ctl-add-user-hash", http("GET", f"/users/{ctl_user}", record=False).json()["password_hash"])
    wrong = ctl_run(seen, ["--url", f"http://127.0.0.1:{b.http_port}", "--password", secrets.make("ctl-wrong-pass"), "list", "queues"])
    assert wrong.returncode != 0 and "refused user 'guest'" in wrong.stderr, wrong
    wrong = ctl_run(seen, ["--url", f"https://127.0.0.1:{b.https_port}", "--tls-ca", str(tls.ca), "list", "queues"],
                    env={"WARREN_CTL_PASSWORD": secrets.make("ctl-wrong-pass-env")})
    assert wrong.returncode != 0 and "refused user 'guest'" in wrong.stderr, wrong
    bad_file = tmp_path / "bad-definitions.json"
    bad_file.write_text('{"users": [{"name": "x", "password": "%s", "tags": ""}' % secrets.make("ctl-import-pass"))
    assert ctl_run(seen, [*url, "import", str(bad_file)]).returncode != 0
    missing_user = ctl_controls.make("user")
    assert missing_user in ctl_run(seen, [*url, "delete-user", missing_user]).stderr

    # Wrong passwords over AMQP: PLAIN (pika; a known user, the default user, an unknown one, over
    # AMQPS too), AMQPLAIN, malformed responses holding a password.
    tls_options = pika.SSLOptions(ssl.create_default_context(cafile=str(tls.ca)), "localhost")
    seen.amqp.append(pika_refusal("127.0.0.1", b.port, user, user_pass))  # its old password
    seen.amqp.append(pika_refusal("127.0.0.1", b.port, "guest", secrets.make("amqp-plain-wrong")))
    seen.amqp.append(pika_refusal("127.0.0.1", b.port, f"nobody-{uuid.uuid4().hex[:6]}", secrets.make("amqp-plain-unknown-user")))
    seen.amqp.append(pika_refusal("127.0.0.1", b.amqps_port, user, secrets.make("amqps-plain-wrong"), tls_options))
    login_control = log_controls.make("login-user")  # a user name: logged with the failure, as RabbitMQ does
    seen.amqp.append(raw_login(b.port, "AMQPLAIN", amqplain(login_control, secrets.make("amqplain-wrong"))))
    seen.amqp.append(raw_login(b.port, "AMQPLAIN", amqplain("guest", secrets.make("amqplain-wrong-guest"))))
    seen.amqp.append(raw_login(b.port, "AMQPLAIN", amqplain("guest", secrets.make("amqplain-truncated"))[:-3]))
    seen.amqp.append(raw_login(b.port, "AMQPLAIN", shortstr("LOGIN") + b"S" + longstr("guest") + shortstr("PASSWORD") + b"x" + longstr(secrets.make("amqplain-bad-type"))))
    seen.amqp.append(raw_login(b.port, "PLAIN", b"\0" + secrets.make("plain-no-user").encode()))
    seen.amqp.append(raw_login(b.port, "PLAIN", b"\0guest\0" + secrets.make("plain-bad-utf8").encode() + b"\xff"))
    seen.amqp.append(raw_login(b.port, "PLAIN", b"\0guest\0" + secrets.make("plain-extra-field").encode() + b"\0more"))
    seen.amqp.append(raw_login(b.port, "CRAM-MD5", b"\0guest\0" + secrets.make("other-mechanism").encode()))
    seen.amqp.append(raw_login(b.port, "PLAIN", b"\0" + login_control.encode() + b"\0" + secrets.make("plain-control-user").encode()))
    assert all("403" in a or "ACCESS_REFUSED" in a for a in seen.amqp), seen.amqp
    # An unsupported mechanism's name is echoed in connection.close: the control for AMQP refusals.
    seen.amqp.append(raw_login(b.port, amqp_controls.make("mech", 16), b"\0guest\0" + secrets.make("control-mechanism-pass").encode()))

    # Wrong passwords over HTTP and HTTPS Basic auth, and broken Authorization headers.
    assert http("GET", "/whoami", auth=("guest", secrets.make("http-basic-wrong"))).status_code == 401
    assert http("GET", "/whoami", auth=(user, secrets.make("https-basic-wrong")), base=apis).status_code == 401
    assert http("GET", "/whoami", auth=(f"nobody-{uuid.uuid4().hex[:6]}", secrets.make("http-basic-unknown-user"))).status_code == 401
    for label, header in [("http-basic-no-colon", lambda s: "Basic " + base64.b64encode(s.encode()).decode()),
                          ("http-basic-not-base64", lambda s: f"Basic {s}!"),
                          ("http-bearer", lambda s: f"Bearer {s}")]:
        assert http("GET", "/overview", auth=None, headers={"Authorization": header(secrets.make(label))}).status_code == 401

    # CMQ: a signing key the server makes (answered once: not an answer searched), requests signed
    # with it, with the default password (the default user's key) and with wrong keys.
    key = http("PUT", f"/users/{user}/signing-keys/{user}-id", record=False).json()["secret_key"]
    secrets.add("cmq-signing-key", key)
    host = f"127.0.0.1:{b.http_port}"

    def cmq(secret_id, signing, params, sign_method="HmacSHA1"):
        p, text = cmq_params(host, secret_id, signing, params, sign_method)
        r = seen.answer(requests.post(f"http://{host}/v2/index.php", data=p, timeout=30), f"CMQ {secret_id} {params}")
        return r.json(), p, text

    queue = f"canary{uuid.uuid4().hex[:8]}"
    assert cmq(f"{user}-id", key, {"Action": "CreateQueue", "queueName": queue})[0]["code"] == 0
    assert cmq(f"{user}-id", key, {"Action": "SendMessage", "queueName": queue, "msgBody": "hello"}, "HmacSHA256")[0]["code"] == 0
    assert cmq("guest", default_pass, {"Action": "ListQueue"})[0]["code"] == 0
    for secret_id, label, method in [(f"{user}-id", "cmq-wrong-key", "HmacSHA1"), (f"{user}-id", "cmq-wrong-key-256", "HmacSHA256"),
                                     ("guest", "cmq-wrong-key-guest", "HmacSHA1"), ("nobody-id", "cmq-wrong-key-unknown-id", "HmacSHA1")]:
        answer, p, text = cmq(secret_id, secrets.make(label), {"Action": "GetQueueAttributes", "queueName": queue}, method)
        assert answer["code"] == 4100, answer
        right = {f"{user}-id": key, "guest": default_pass}.get(secret_id)
        if right:  # what the server computes to compare: logging it would let anyone sign as this user
            secrets.add(f"{label}-expected-signature", cmq_signature(right, text, method))
    replayed, p, _ = cmq(f"{user}-id", key, {"Action": "GetQueueAttributes", "queueName": queue})
    assert replayed["code"] == 0
    assert seen.answer(requests.post(f"http://{host}/v2/index.php", data=p, timeout=30), "CMQ replay").json()["code"] == 4100

    # Definitions: a user given as a hash (a RabbitMQ export), one with a clear password; then
    # refused imports holding them (a bad item after a good one, md5, not JSON).
    imported, imported_clear = f"{user}-imp", f"{user}-imp-clear"
    imported_pass, imported_clear_pass = secrets.make("import-pass"), secrets.make("import-clear-pass")
    imported_hash = rabbit_hash(imported_pass)
    add_hash(secrets, "import-hash", imported_hash)
    defs = {"users": [{"name": imported, "password_hash": imported_hash, "hashing_algorithm": SHA256, "tags": ""},
                      {"name": imported_clear, "password": imported_clear_pass, "tags": ""}],
            "permissions": [{"user": u, "vhost": "/", **ALL} for u in (imported, imported_clear)]}
    assert http("POST", "/definitions", json=defs).status_code in (200, 201, 204)
    for u, pw in [(imported, imported_pass), (imported_clear, imported_clear_pass)]:
        pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", b.port, "/", pika.PlainCredentials(u, pw))).close()
    add_hash(secrets, "import-clear-hash", http("GET", f"/users/{imported_clear}", record=False).json()["password_hash"])
    refused_hash = rabbit_hash(secrets.make("import-refused-pass"))
    add_hash(secrets, "import-refused-hash", refused_hash)
    for body in [{"users": [{"name": "ok", "password_hash": refused_hash, "hashing_algorithm": SHA256, "tags": ""},
                            {"name": "bad", "password": secrets.make("import-bad-tags-pass"), "tags": 5}]},
                 {"users": [{"name": "md5", "password_hash": refused_hash, "hashing_algorithm": "rabbit_password_hashing_md5", "tags": ""}]},
                 {"users": [{"name": "short", "password_hash": base64.b64encode(secrets.make("import-short-hash").encode()).decode(), "hashing_algorithm": SHA256}]},
                 {"users": [{"password": secrets.make("import-no-name-pass")}]},
                 {"users": [{"name": "p", "password": secrets.make("import-bad-algorithm-pass"), "hashing_algorithm": "sha3"}]}]:
        assert http("POST", "/definitions", json=body).status_code == 400
    assert http("POST", "/definitions", data='{"users": [{"name": "x", "password": "%s"' % secrets.make("import-not-json"),
                headers={"content-type": "application/json"}).status_code == 400

    # Malformed bodies of PUT /api/users holding a password: the 400 does not echo it (the
    # hashing_algorithm, echoed, is the control for HTTP answers).
    algorithm_control = http_controls.make("algorithm")
    for label, body in [
        ("put-tags-number", lambda pw: {"password": pw, "tags": 5}),
        ("put-tags-list-of-number", lambda pw: {"password": pw, "tags": [5]}),
        ("put-no-tags", lambda pw: {"password": pw}),
        ("put-hash-not-string", lambda pw: {"password": pw, "password_hash": 5, "tags": ""}),
        ("put-bad-algorithm", lambda pw: {"password": pw, "hashing_algorithm": algorithm_control, "tags": ""}),
        ("put-password-number-next-to", lambda pw: {"password": 5, "password_hash": pw, "tags": ""}),
        ("put-hash-not-base64", lambda pw: {"password_hash": pw + "!", "tags": ""}),
        ("put-hash-wrong-length", lambda pw: {"password_hash": base64.b64encode(pw.encode()).decode(), "tags": ""}),
        ("put-bad-limits", lambda pw: {"password": pw, "tags": "", "limits": 5, "x": {"deep": [pw]}} ),
    ]:
        r = http("PUT", f"/users/{user}-bad", json=body(secrets.make(label)))
        assert r.status_code in (400, 201, 204), (label, r.status_code, r.text)
    for label, raw in [("put-truncated", '{"password": "%s", "tags": ""'),
                       ("put-missing-comma", '{"password": "%s" "tags": ""}'),
                       ("put-bad-escape", '{"password": "%s\\q", "tags": ""}'),
                       ("put-array-body", '["%s"]'),
                       ("put-string-body", '"%s"'),
                       ("put-control-char", '{"password": "%s\x01", "tags": ""}')]:
        r = http("PUT", f"/users/{user}-bad", data=raw % secrets.make(label), headers={"content-type": "application/json"})
        assert r.status_code == 400, (label, r.status_code, r.text)
    big = secrets.make("put-too-big")
    r = http("PUT", f"/users/{user}-bad", data=json.dumps({"password": big, "tags": "", "pad": "x" * (5 << 20)}), headers={"content-type": "application/json"})
    assert r.status_code in (400, 413), r.status_code

    # The TLS key: a SIGHUP with a key that does not match the certificate, and with one that lacks its
    # END line, keeps the current one and logs an error (with the path only); then the right one again.
    good_key = tls.key.read_bytes()
    other = key_pem(new_key())
    add_key(secrets, "tls-mismatched-key", other)
    tls.key.write_bytes(other)
    sighup_and_wait(b, "TLS reload (SIGHUP) failed")
    add_key(secrets, "tls-unterminated-key", other2 := key_pem(new_key()))
    tls.key.write_bytes(other2.rsplit(b"-----END", 1)[0])
    sighup_and_wait(b, "TLS reload (SIGHUP) failed")
    tls.key.write_bytes(good_key)
    sighup_and_wait(b, "TLS certificate reloaded")
    assert all(str(tls.key) in line for line in log_lines_with(b, "TLS reload (SIGHUP) failed"))
    assert http("GET", "/whoami", base=apis).status_code == 200

    b.stop()
    log = b.clean_log()
    # The log holds the refusals whose lines could have carried the secrets.
    for line, least in [("WARN authentication failed: invalid credentials", 8), ("HTTP authentication failed: invalid credentials", 3),
                        ("CMQ request refused: wrong signature", 3), ("CMQ request refused: unknown SecretId", 1)]:
        assert len([x for x in log.splitlines() if line in x]) >= least, (line, log[-3000:])
    # The controls: each collection holds what the server echoes, and the search finds it.
    assert_controls_found(log_controls, "the log", log)
    assert_controls_found(http_controls, "an HTTP answer", seen.text("http"))
    assert_controls_found(ctl_controls, "warren ctl", seen.text("ctl"))
    assert_controls_found(amqp_controls, "connection.close", seen.text("amqp"))
    failures = []
    for where, text in [("the log", log), ("HTTP and CMQ answers", seen.text("http")), ("AMQP refusals", seen.text("amqp")), ("warren ctl's output", seen.text("ctl"))]:
        try:
            assert_no_secret(secrets, where, text)
        except Leak as e:
            failures.append(str(e))
    if failures:
        raise Leak("\n".join(failures))


HASH_ECHO = ("access.rs put_user reads password_hash with string_field, whose error echoes the value: "
             "'{\"error\":\"bad_request\",\"reason\":\"password_hash must be a string, not [\\\"<the hash>\\\"]\"}' "
             "(a password of the wrong type is answered 'password must be a string', without it)")


def test_a_password_hash_of_the_wrong_type_is_not_echoed(tmp_path, debug_env, started):
    """PUT /api/users with `password_hash` not a string (a hash wrapped in a list or an object): the
    400 must not hold the hash, as it holds no `password` of the wrong type ("password must be a
    string")."""
    secrets, controls, seen = Canaries(), Canaries("CTRL"), Collected()
    b = started(CanaryBroker(tmp_path, make_tls(tmp_path / "tls")))
    api = f"http://127.0.0.1:{b.http_port}/api/users/canary-hash"
    for label, wrap in [("hash-in-list", lambda h: [h]), ("hash-in-object", lambda h: {"value": h})]:
        h = rabbit_hash(secrets.make(label))
        add_hash(secrets, f"{label}-hash", h)
        r = seen.answer(requests.put(api, json={"password_hash": wrap(h), "tags": ""}, auth=("guest", "guest"), timeout=30), label)
        assert r.status_code == 400, r.text
    # An unknown hashing_algorithm is named in its refusal: the control.
    r = requests.put(api, json={"password_hash": "", "hashing_algorithm": controls.make("algorithm"), "tags": ""}, auth=("guest", "guest"), timeout=30)
    seen.answer(r, "control")
    assert r.status_code == 400
    b.stop()
    assert_controls_found(controls, "an HTTP answer", seen.text("http"))
    assert_no_secret(secrets, "the log", b.clean_log())
    assert_no_secret(secrets, "HTTP answers", seen.text("http"))


# ---------------------------------------------------------------------------------------------
# The TLS private key: files that do not load, at startup and on SIGHUP
# ---------------------------------------------------------------------------------------------

PEM_ECHO = ("rustls-pki-types' PEM errors (illegal section start, missing section end marker) print the line or "
            "label they stopped at as a byte list, and tls.rs puts that error in the message: the key's base64 "
            "body reaches stderr and the log ('cannot read a private key from tls-key ...: illegal section start: "
            "[45, 45, 45, 45, 45, 66, 69, 71, 73, 78, ...]')")


def run_server(tmp_path, args, env=None, timeout=15):
    """`warren server` that must refuse to start: (exit code, its stdout and stderr together)."""
    proc = subprocess.Popen([binary_for({}), "server", "--data-dir", str(tmp_path / "data"), "--amqp-port", str(free_port()),
                             "--http-port", str(free_port()), "--prometheus-port", str(free_port()), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=tmp_path)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"warren server did not refuse to start:\n{out.decode(errors='replace')[-3000:]}")
    return proc.returncode, ANSI.sub("", out.decode(errors="replace"))


def tls_args(tls, key):
    return ["--tls-cert", str(tls.cert), "--tls-key", str(key), "--amqps-port", str(free_port()),
            "--https-port", str(free_port()), "--prometheus-tls-port", str(free_port())]


@pytest.mark.parametrize("kind", [
    "mismatched", "unterminated", "garbage-body",
    "one-line",
    "literal-newlines",
    "glued-to-begin",
])
def test_a_tls_key_that_does_not_load_is_not_echoed_at_startup(tmp_path, debug_env, kind):
    """A key file that does not load refuses the start naming its path (the control), never its
    contents."""
    secrets = Canaries()
    tls = make_tls(tmp_path / "tls")
    bad = tmp_path / "tls" / "bad.key"
    if kind == "mismatched":
        pem = key_pem(new_key())
        add_key(secrets, "key", pem)
        bad.write_bytes(pem)
    elif kind == "unterminated":
        pem = key_pem(new_key())
        add_key(secrets, "key", pem)
        bad.write_bytes(pem.rsplit(b"-----END", 1)[0])
    elif kind == "garbage-body":
        bad.write_text(f"-----BEGIN PRIVATE KEY-----\n{secrets.make('body')}\n-----END PRIVATE KEY-----\n")
    else:
        add_key(secrets, "key", tls.key_pem)
        bad.write_text(flattened_keys(tls.key_pem)[kind])
    code, out = run_server(tmp_path, tls_args(tls, bad))
    assert code != 0 and f"tls-key {bad}" in out, out[-3000:]
    assert_no_secret(secrets, "warren server's output", out)


@pytest.mark.parametrize("kind", [
    "glued-to-begin",
])
def test_a_tls_key_that_does_not_load_on_sighup_is_not_logged(tmp_path, debug_env, started, kind):
    secrets = Canaries()
    tls = make_tls(tmp_path / "tls")
    add_key(secrets, "key", tls.key_pem)
    b = started(CanaryBroker(tmp_path, tls))
    tls.key.write_text(flattened_keys(tls.key_pem)[kind])
    sighup_and_wait(b, "TLS reload (SIGHUP) failed")
    b.stop()
    log = b.clean_log()
    assert any(str(tls.key) in line for line in log_lines_with(b, "TLS reload (SIGHUP) failed")), log[-3000:]
    assert_no_secret(secrets, "the log", log)


# ---------------------------------------------------------------------------------------------
# Configuration errors next to default-pass and cluster-secret
# ---------------------------------------------------------------------------------------------

TOML_ECHO = ("a TOML syntax error is shown with the toml crate's snippet of the offending line (config.rs, "
             "ConfigError::Syntax), so a mistake on the line of default-pass or cluster-secret prints the value: "
             "'warren: config file ... is not valid TOML: TOML parse error at line 1 ... 1 | default-pass = \"CANARY...'")

def toml_leak(case):
    return pytest.param(case, id=case[0])


# (id, config file or None, environment, flags): `{pw}` is a canary password or secret (long enough),
# `{short}` a canary cluster secret of 7 characters (too short), `{ctl}` a control the error does echo
# (a bad value of another key), `{peers}` a one-node peers list.
CONFIG_CASES = [
    ("env-empty-default-pass-over-the-file", 'default-pass = "{pw}"\n', {"WARREN_DEFAULT_PASS": ""}, []),
    ("env-bad-port-next-to-default-pass", None, {"WARREN_DEFAULT_PASS": "{pw}", "WARREN_HEARTBEAT": "{ctl}"}, []),
    ("env-bad-port-next-to-cluster-secret", None, {"WARREN_CLUSTER_SECRET": "{pw}", "WARREN_AMQP_PORT": "{ctl}"}, []),
    ("file-bad-port-next-to-default-pass", 'default-pass = "{pw}"\namqp-port = "{ctl}"\n', {}, []),
    ("file-default-pass-not-a-string", 'default-pass = ["{pw}"]\n', {}, []),
    ("file-default-pass-in-a-table", 'default-pass = {{ value = "{pw}" }}\n', {}, []),
    ("file-cluster-secret-not-a-string", 'cluster-secret = ["{pw}"]\n', {}, []),
    ("file-unknown-key-holding-a-password", 'default_pass = "{pw}"\n', {}, []),
    ("file-syntax-error-on-another-line", 'default-pass = "{pw}"\ncluster-secret = "{pw}"\nheartbeat = = 5\n', {}, []),
    ("env-short-cluster-secret", None, {"WARREN_NODE_ID": "1", "WARREN_PEERS": "{peers}", "WARREN_CLUSTER_SECRET": "{short}"}, []),
    ("flag-short-cluster-secret", None, {}, ["--node-id", "1", "--peers", "{peers}", "--cluster-secret", "{short}"]),
    ("file-short-cluster-secret", 'node-id = 1\npeers = ["{peers}"]\ncluster-secret = "{short}"\n', {}, []),
    ("flag-cluster-secret-with-bad-peers", None, {}, ["--node-id", "1", "--peers", "1={ctl}", "--cluster-secret", "{pw}"]),
    ("flag-cluster-secret-twice", None, {}, ["--cluster-secret", "{pw}", "--cluster-secret", "{pw}"]),
    ("flag-default-pass-is-no-flag", None, {}, ["--default-pass", "{pw}"]),
    toml_leak(("file-unterminated-default-pass", 'default-pass = "{pw}\n', {}, [])),
    toml_leak(("file-junk-after-default-pass", 'default-pass = "{pw}" x\n', {}, [])),
    toml_leak(("file-default-pass-twice", 'default-pass = "{pw}"\ndefault-pass = "{pw}"\n', {}, [])),
    toml_leak(("file-unterminated-cluster-secret", "cluster-secret = '{pw}\n", {}, [])),
]


@pytest.mark.parametrize("case", [c if hasattr(c, "values") else pytest.param(c, id=c[0]) for c in CONFIG_CASES])
def test_a_configuration_error_does_not_echo_a_secret(tmp_path, debug_env, case):
    _, file_text, env, flags = case
    secrets, controls = Canaries(), Canaries("CTRL")
    pw = secrets.make("pw")
    # 7 characters, one short of cluster-secret's least: searched as is and in hex (too short for base64).
    short = secrets.add("short", "".join(random.choice("BCDFGHJKLMNPQRSTVWXZbcdfghjkmnpqrstvwxz") for _ in range(7)))
    ctl = controls.make("value", 12) if any("{ctl}" in v for v in [file_text or "", *env.values(), *flags]) else None
    fill = {"pw": pw, "short": short, "ctl": ctl, "peers": f"1=127.0.0.1:{free_port()}"}
    args = [f.format(**fill) for f in flags]
    if file_text is not None:
        config = tmp_path / "warren.toml"
        config.write_text(file_text.format(**fill))
        args += ["--config", str(config)]
    code, out = run_server(tmp_path, args, {k: v.format(**fill) for k, v in env.items()})
    assert code != 0 and out.strip(), out
    if ctl:
        assert_controls_found(controls, "the configuration error", out)
    assert_no_secret(secrets, "warren server's output", out)


@pytest.mark.parametrize("kind", [
    "unterminated-default-pass",
    "default-pass-not-a-string",
])
def test_a_configuration_reload_error_does_not_log_a_secret(tmp_path, debug_env, started, kind):
    """SIGHUP re-reads the file: a mistake in it is logged, never the secret next to it."""
    secrets = Canaries()
    config = tmp_path / "warren.toml"
    config.write_text("heartbeat = 60\n")
    b = started(CanaryBroker(tmp_path, make_tls(tmp_path / "tls"), extra=["--config", str(config)]))
    pw = secrets.make("pw")
    config.write_text(f'default-pass = "{pw}\n' if kind == "unterminated-default-pass" else f'default-pass = ["{pw}"]\n')
    sighup_and_wait(b, "configuration reload (SIGHUP) failed")
    b.stop()
    assert_no_secret(secrets, "the log", b.clean_log())


# ---------------------------------------------------------------------------------------------
# A cluster: the cluster secret, and secrets replicated through the metadata group
# ---------------------------------------------------------------------------------------------

def test_the_cluster_secret_and_replicated_secrets_are_not_logged(tmp_path, debug_env):
    secrets, log_controls, ctl_controls, seen = Canaries(), Canaries("CTRL"), Canaries("CTRL"), Collected()
    # openraft at debug too: the metadata group's entries carry users, hashes and signing keys.
    debug_env.setenv("WARREN_LOG", "debug,openraft=debug")
    default_pass = secrets.make("default-pass")
    debug_env.setenv("WARREN_DEFAULT_PASS", default_pass)
    cluster_secret = secrets.make("cluster-secret")
    nodes_gen = three_node_cluster(tmp_path, cluster_secret)
    nodes = next(nodes_gen)
    try:
        def ctl(node, *args, secret=cluster_secret):
            return ctl_run(seen, ["--node", f"127.0.0.1:{nodes[node].cluster_port}", "--cluster-secret", secret, "--timeout", "5", *args])

        def formed():
            st = ctl(1, "cluster-status", "--json")
            return st.returncode == 0 and all(m["reachable"] for m in json.loads(st.stdout)["members"]) and len(json.loads(st.stdout)["members"]) == 3

        eventually(formed, timeout=20, interval=0.2)
        for node in (2, 3):
            wrong = ctl(node, "cluster-status", secret=secrets.make(f"cluster-secret-wrong-{node}"))
            assert wrong.returncode != 0 and "secret" in wrong.stderr, wrong.stderr
        short = secrets.add("cluster-secret-short", "".join(random.choice("BCDFGHJKLMNPQRSTVWXZ") for _ in range(7)))
        assert ctl(1, "cluster-status", secret=short).returncode != 0
        missing_node = ctl_controls.make("node", 8)
        assert ctl_run(seen, ["--node", missing_node, "--cluster-secret", cluster_secret, "--timeout", "2", "cluster-status"]).returncode != 0

        # A user, its hash and a signing key made on node 2, used on node 3 (replicated).
        api2, api3 = (f"http://127.0.0.1:{nodes[i].http_port}/api" for i in (2, 3))
        admin = ("guest", default_pass)
        eventually(lambda: requests.get(f"{api2}/whoami", auth=admin, timeout=5).status_code == 200, timeout=20, interval=0.2)
        user, user_pass = f"canary-{uuid.uuid4().hex[:8]}", secrets.make("user-pass")
        assert requests.put(f"{api2}/users/{user}", json={"password": user_pass, "tags": "administrator"}, auth=admin, timeout=30).status_code == 201
        assert requests.put(f"{api2}/permissions/%2F/{user}", json=ALL, auth=admin, timeout=30).status_code == 201
        key = requests.put(f"{api2}/users/{user}/signing-keys/{user}-id", auth=admin, timeout=30).json()["secret_key"]
        secrets.add("signing-key", key)
        eventually(lambda: requests.get(f"{api3}/whoami", auth=(user, user_pass), timeout=5).status_code == 200, timeout=20)
        add_hash(secrets, "user-pass-hash", requests.get(f"{api3}/users/{user}", auth=admin, timeout=30).json()["password_hash"])
        add_hash(secrets, "default-pass-hash", requests.get(f"{api3}/users/guest", auth=admin, timeout=30).json()["password_hash"])
        host = f"127.0.0.1:{nodes[3].http_port}"

        def cmq(signing):
            p, _ = cmq_params(host, f"{user}-id", signing, {"Action": "CreateQueue", "queueName": f"canary{uuid.uuid4().hex[:8]}"})
            return seen.answer(requests.post(f"http://{host}/v2/index.php", data=p, timeout=30), "CMQ").json()["code"]

        assert eventually(lambda: cmq(key) == 0, timeout=20)
        assert cmq(secrets.make("cmq-wrong-key")) == 4100
        c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", nodes[1].port, "/", pika.PlainCredentials(user, user_pass)))
        with pytest.raises(pika.exceptions.ChannelClosedByBroker):
            c.channel().queue_declare(log_controls.make("queue"), passive=True)
        c.close()
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", nodes[2].port, "/", pika.PlainCredentials(user, secrets.make("amqp-wrong")), connection_attempts=1))
        for b in nodes.values():
            b.terminate()
    finally:
        next(nodes_gen, None)
    logs = {i: ANSI.sub("", b.log_text()) for i, b in nodes.items()}
    assert_controls_found(log_controls, "node 1's log", logs[1])
    assert_controls_found(ctl_controls, "warren ctl", seen.text("ctl"))
    for i, log in logs.items():
        assert_no_secret(secrets, f"node {i}'s log", log)
    assert_no_secret(secrets, "warren ctl's output", seen.text("ctl"))
    assert_no_secret(secrets, "HTTP and CMQ answers", seen.text("http"))
