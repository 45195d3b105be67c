"""Hostile clients at the door (issue 37, "hostile clients"): one address holding silent AMQP
handshakes cannot lock the others out (`max-handshakes`, `max-handshakes-per-source`: past its
share a connection waits unread for one of its address's slots, past the bounds it is closed at
once), and failed logins from one address for one user take turns once past
`login-failures-before-delay` (AMQP, the management API's Basic authentication and CMQ
signatures alike; a right password waits its turn too, a success clears the count, other users
and addresses are not slowed). Before, nothing bounded connections in their handshake and a
password could be guessed as fast as connections could be opened. About 30 s."""
import select
import socket
import time
import uuid

import pika
import pytest
import requests

from conftest import Broker, eventually

pytestmark = [pytest.mark.needs_process, pytest.mark.warren_only]


@pytest.fixture
def start_broker(tmp_path, monkeypatch):
    started = []

    def start(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, str(v))
        b = Broker(tmp_path / f"data{len(started)}", tmp_path / f"warren{len(started)}.log")
        b.start()
        started.append(b)
        return b

    yield start
    for b in started:
        if b.alive():
            b.proc.kill()
            b.proc.wait(10)


def silent_from(source, port):
    """A TCP connection from `source` (another loopback address) that sends nothing."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def closed_by_server(sock, within):
    """Whether the server closes `sock` within `within` seconds without sending anything."""
    readable, _, _ = select.select([sock], [], [], within)
    if not readable:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_silent_handshakes_from_one_address_wait_or_are_closed_and_do_not_lock_out_others(start_broker):
    broker = start_broker(WARREN_MAX_HANDSHAKES=8, WARREN_MAX_HANDSHAKES_PER_SOURCE=4, WARREN_HANDSHAKE_TIMEOUT=30)
    held = [silent_from("127.0.0.2", broker.port) for _ in range(4)]
    waiting = [silent_from("127.0.0.2", broker.port) for _ in range(8)]
    # The waiting ones have sent their protocol header: nothing reads it until a slot frees.
    for s in waiting:
        s.sendall(b"AMQP\x00\x00\x09\x01")
    time.sleep(0.5)
    past_bounds = silent_from("127.0.0.2", broker.port)
    assert closed_by_server(past_bounds, 5), "a connection past its share, with max-handshakes waiting, is closed at once"
    eventually(lambda: "max-handshakes" in broker.log_text(), timeout=5)

    # Another address is not held up by them.
    started = time.monotonic()
    c = broker.connection()
    c.channel().queue_declare("still-served")
    c.close()
    assert time.monotonic() - started < 5

    readable, _, _ = select.select(waiting, [], [], 1.0)
    assert not readable, "connections past their address's share are not read (nor closed) while they wait"
    held.pop().close()
    readable, _, _ = select.select(waiting, [], [], 5.0)
    assert len(readable) >= 1, "a freed slot of the address goes to one of its waiting connections"
    answer = readable[0].recv(7)
    assert answer[:1] == b"\x01" and answer[1:3] == b"\x00\x00", f"connection.start on channel 0: {answer!r}"
    for s in held + waiting:
        s.close()


def amqp_login(broker, user, password):
    """Whether an AMQP login succeeds, and how long its answer took."""
    started = time.monotonic()
    params = pika.ConnectionParameters("127.0.0.1", broker.port, credentials=pika.PlainCredentials(user, password),
                                       connection_attempts=1, socket_timeout=20, blocked_connection_timeout=20)
    try:
        pika.BlockingConnection(params).close()
        ok = True
    except pika.exceptions.AMQPConnectionError:
        ok = False
    return ok, time.monotonic() - started


def test_failed_amqp_logins_from_one_address_take_turns_until_a_success(start_broker):
    broker = start_broker(WARREN_LOGIN_FAILURES_BEFORE_DELAY=3, WARREN_LOGIN_DELAY_MAX_MS=3000)
    for _ in range(3):
        assert amqp_login(broker, "guest", "canary-password-1") == (False, pytest.approx(0, abs=3))
    # Past the free failures, one attempt per turn: 0, 250 ms, 500 ms, 1 s, 2 s apart.
    started = time.monotonic()
    for _ in range(5):
        ok, _ = amqp_login(broker, "guest", "canary-password-2")
        assert not ok
    throttled = time.monotonic() - started
    assert throttled >= 3.4, f"five throttled attempts took {throttled:.2f} s (turns 0.25+0.5+1+2 s after the first)"
    # The next turn is 3 s off: a right password waits for it too (no timing tells it apart), then
    # logs in; another user from the same address is not slowed meanwhile.
    other_ok, other_took = amqp_login(broker, "nobody", "x")
    assert not other_ok and other_took < 2.0, f"another user's attempt took {other_took:.2f} s"
    ok, took = amqp_login(broker, "guest", "guest")
    assert ok and took >= 2.0, f"the right password logged in after {took:.2f} s"
    # The success cleared the count: failures answer at once again.
    ok, took = amqp_login(broker, "guest", "wrong")
    assert not ok and took < 2.0
    assert "authentication failed" in broker.log_text()
    assert "canary-password" not in broker.log_text(), "no password in the log"


def test_failed_http_and_cmq_logins_take_turns_too(start_broker):
    broker = start_broker(WARREN_LOGIN_FAILURES_BEFORE_DELAY=2, WARREN_LOGIN_DELAY_MAX_MS=3000)
    api = f"http://127.0.0.1:{broker.http_port}/api/overview"
    for _ in range(2):
        assert requests.get(api, auth=("guest", "wrong"), timeout=10).status_code == 401
    started = time.monotonic()
    for _ in range(4):
        assert requests.get(api, auth=("guest", "wrong"), timeout=10).status_code == 401
    assert time.monotonic() - started >= 1.6, "turns 0.25+0.5+1 s after the first"
    assert requests.get(api, auth=("monitor", "x"), timeout=10).status_code == 401
    r = requests.get(api, auth=("guest", "guest"), timeout=10)
    assert r.status_code == 200

    # CMQ: a wrong signature counts against its SecretId.
    def cmq_wrong():
        form = {"Action": "ListQueue", "SecretId": "guest", "Timestamp": str(int(time.time())), "Nonce": str(uuid.uuid4().int % 10**9),
                "SignatureMethod": "HmacSHA256", "Signature": "bm90IGEgc2lnbmF0dXJl"}
        started = time.monotonic()
        answer = requests.post(f"http://127.0.0.1:{broker.http_port}/v2/index.php", data=form, timeout=10).json()
        return answer["code"], time.monotonic() - started

    for _ in range(2):
        code, _ = cmq_wrong()
        assert code != 0
    started = time.monotonic()
    for _ in range(4):
        code, _ = cmq_wrong()
        assert code != 0
    assert time.monotonic() - started >= 1.6


def test_every_limit_is_reported_as_the_node_applies_it_to_administrators_only(start_broker):
    """`GET /api/limits` (Warren's own, also `warren_limits` in the overview) shows the bounds a
    client meets as configured, not as compiled in; a user without the administrator tag is refused."""
    b = start_broker(WARREN_MAX_HANDSHAKES=77, WARREN_MAX_HANDSHAKES_PER_SOURCE=7, WARREN_LOGIN_FAILURES_BEFORE_DELAY=3,
                     WARREN_HANDSHAKE_TIMEOUT=4, WARREN_MAX_MESSAGE_SIZE=123456)
    base = f"http://127.0.0.1:{b.http_port}/api"
    limits = requests.get(f"{base}/limits", auth=("guest", "guest"), timeout=5).json()
    amqp = limits["amqp"]
    assert (amqp["max_handshakes"], amqp["max_handshakes_per_source"], amqp["login_failures_before_delay"],
            amqp["handshake_timeout_s"], amqp["max_message_size"]) == (77, 7, 3, 4, 123456), limits
    assert limits["http"]["max_connections_per_port"] == 512 and limits["http"]["max_body_bytes"] == 4 << 20, limits
    assert limits["cluster"]["max_handshakes_per_source"] == 16, limits
    assert limits["tls"] == {"enabled": False, "versions": [], "client_certificates": "not asked for", "certificate_not_after": None}
    overview = requests.get(f"{base}/overview", auth=("guest", "guest"), timeout=5).json()
    assert overview["warren_limits"] == limits
    r = requests.put(f"{base}/users/watcher", json={"password": "w", "tags": "management"}, auth=("guest", "guest"), timeout=5)
    assert r.status_code in (201, 204), r.text
    r = requests.get(f"{base}/limits", auth=("watcher", "w"), timeout=5)
    # A node's bounds are for its operators, as /api/nodes: administrator or monitoring.
    assert (r.status_code, r.json()) == (401, {"error": "not_authorised", "reason": "Not monitor user"}), r.text
