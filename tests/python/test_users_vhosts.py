"""Users, vhosts, permissions and topic permissions through the management HTTP API, in RabbitMQ's
shapes, checked through AMQP logins: a user's tags and hash, passwords given as RabbitMQ hashes,
connection.open refused without a permission or for an unknown vhost, connections closed (320)
when their user or vhost is deleted, management routes by tag, everything surviving a restart and
reaching every node of a cluster.

Everything not `warren_only` also passes against RabbitMQ 3.10 with the management plugin:
    PLUGINS=rabbitmq_management ../shared/anchors/start_cluster.sh 1
    WARREN_TEST_EXTERNAL_URL=amqp://guest:guest@127.0.0.1:5672/%2F \\
    WARREN_TEST_EXTERNAL_HTTP=http://guest:guest@127.0.0.1:15672 \\
      python3 -m pytest -q tests/python/test_users_vhosts.py
(the broker is shared then: every test deletes the users and vhosts it made)."""
import ast
import base64
import hashlib
import os
import re
import time
import urllib.parse

import pika
import pytest
import requests
from pika.exceptions import ConnectionClosedByBroker, ProbableAccessDeniedError, ProbableAuthenticationError

from conftest import eventually, three_node_cluster

AUTH = ("guest", "guest")
ALL = {"configure": ".*", "write": ".*", "read": ".*"}


def api(broker, path):
    if not getattr(broker, "http_port", None):
        pytest.skip("no management API: set WARREN_TEST_EXTERNAL_HTTP with WARREN_TEST_EXTERNAL_URL")
    return f"http://{broker.http_host}:{broker.http_port}/api{path}"


def q(name):
    return urllib.parse.quote(name, safe="")


def put(broker, path, body=None, auth=AUTH):
    return requests.put(api(broker, path), json=body, auth=auth, timeout=30)


def get(broker, path, auth=AUTH):
    return requests.get(api(broker, path), auth=auth, timeout=30)


def delete(broker, path, auth=AUTH):
    return requests.delete(api(broker, path), auth=auth, timeout=30)


@pytest.fixture
def made(broker):
    """API paths (a user's, a vhost's) the test created: deleted after it, last first."""
    paths = []
    yield paths
    for path in reversed(paths):
        try:
            delete(broker, path)
        except Exception:  # noqa: BLE001 - best effort; a restarted-away broker is gone already
            pass


def make_user(broker, made, user, password="pw", tags="", vhost=None):
    """Creates `user` (and, given `vhost`, full permissions on it) through the API."""
    assert put(broker, f"/users/{q(user)}", {"password": password, "tags": tags}).status_code == 201
    made.append(f"/users/{q(user)}")
    if vhost is not None:
        assert put(broker, f"/permissions/{q(vhost)}/{q(user)}", ALL).status_code == 201


def make_vhost(broker, made, vhost, body=None):
    assert put(broker, f"/vhosts/{q(vhost)}", body).status_code == 201
    made.append(f"/vhosts/{q(vhost)}")


def connect(broker, user, password, vhost="/"):
    return pika.BlockingConnection(pika.ConnectionParameters(
        broker.host, broker.port, vhost, pika.PlainCredentials(user, password)))


def refused(broker, user, password, vhost, kind):
    """(code, text) of the connection.close that refused this login; pika raises `kind`. pika keeps
    the close it replaced by a Probable*Error only as its repr: 'ConnectionClosedByBroker: (530) "..."'."""
    with pytest.raises(kind) as e:
        connect(broker, user, password, vhost)
    m = re.fullmatch(r"ConnectionClosedByBroker: \((\d+)\) (.*)", e.value.args[0], re.S)
    assert m, e.value.args
    return int(m[1]), ast.literal_eval(m[2])


def forced_close(c, timeout=10):
    """(code, text) of the connection.close the broker sends this open connection within `timeout`."""
    deadline = time.time() + timeout
    with pytest.raises(ConnectionClosedByBroker) as e:
        while time.time() < deadline:
            c.process_data_events(time_limit=0.05)
    return e.value.reply_code, e.value.reply_text


def rabbit_hash(password, algorithm):
    """RabbitMQ's password_hash: base64(salt + H(salt + password)) with 4 random salt bytes."""
    salt = os.urandom(4)
    return base64.b64encode(salt + hashlib.new(algorithm, salt + password.encode()).digest()).decode()


# ---- users ----

def test_put_user_is_201_then_204_and_get_shows_tags_as_a_list_and_a_sha256_hash(broker, made, name):
    assert put(broker, f"/users/{name}", {"password": "pw", "tags": "administrator"}).status_code == 201
    made.append(f"/users/{name}")
    assert put(broker, f"/users/{name}", {"password": "pw", "tags": ["administrator", "monitoring"]}).status_code == 204
    user = get(broker, f"/users/{name}").json()
    # 3.10 shows tags as a list, however they were given.
    assert (user["name"], user["tags"], user["hashing_algorithm"]) == (name, ["administrator", "monitoring"], "rabbit_password_hashing_sha256")
    assert len(base64.b64decode(user["password_hash"])) == 4 + 32
    assert put(broker, f"/users/{name}", {"password": "pw", "tags": "monitoring, administrator"}).status_code == 204
    assert get(broker, f"/users/{name}").json()["tags"] == ["monitoring", "administrator"]


def test_put_user_without_tags_is_400_tags_not_present(broker, made, name):
    r = put(broker, f"/users/{name}", {"password": "pw"})
    assert (r.status_code, r.json()) == (400, {"error": "bad_request", "reason": "tags_not_present"})
    assert get(broker, f"/users/{name}").status_code == 404


def test_the_password_never_appears_in_a_get_answer(broker, made, name):
    password = "secret-" + name
    make_user(broker, made, name, password, "administrator")
    for path in [f"/users/{name}", "/users", "/whoami", "/definitions"]:
        r = get(broker, path, auth=(name, password))
        assert r.status_code == 200, path
        assert password not in r.text, path


def test_delete_user_is_204_then_get_and_delete_are_404(broker, made, name):
    make_user(broker, made, name)
    assert delete(broker, f"/users/{name}").status_code == 204
    r = get(broker, f"/users/{name}")
    assert (r.status_code, r.json()) == (404, {"error": "Object Not Found", "reason": "Not Found"})
    assert delete(broker, f"/users/{name}").status_code == 404


@pytest.mark.parametrize("algorithm", ["sha256", "sha512"])
def test_a_user_put_with_a_password_hash_logs_in_with_the_password(broker, made, name, algorithm):
    given = {"password_hash": rabbit_hash("hashed-pw", algorithm), "hashing_algorithm": f"rabbit_password_hashing_{algorithm}", "tags": ""}
    assert put(broker, f"/users/{name}", given).status_code == 201
    made.append(f"/users/{name}")
    user = get(broker, f"/users/{name}").json()
    assert (user["password_hash"], user["hashing_algorithm"], user["tags"]) == (given["password_hash"], given["hashing_algorithm"], [])
    assert put(broker, f"/permissions/%2F/{name}", ALL).status_code == 201
    connect(broker, name, "hashed-pw").close()
    assert refused(broker, name, "other", "/", ProbableAuthenticationError)[0] == 403


def test_a_wrong_password_or_unknown_user_is_refused_with_403_access_refused(broker, made, name):
    make_user(broker, made, name, "right", vhost="/")
    text = "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. For details see the broker logfile."
    assert refused(broker, name, "wrong", "/", ProbableAuthenticationError) == (403, text)
    assert refused(broker, name + "-nobody", "right", "/", ProbableAuthenticationError) == (403, text)


# ---- permissions ----

def test_a_user_without_a_permission_is_refused_the_vhost_with_530(broker, made, name):
    make_user(broker, made, name)
    assert refused(broker, name, "pw", "/", ProbableAccessDeniedError) == (530, f"NOT_ALLOWED - access to vhost '/' refused for user '{name}'")


def test_an_unknown_vhost_is_refused_with_530_not_found(broker, name):
    # 3.10 does not quote the vhost's name here (it does in "access to vhost '/' refused").
    assert refused(broker, "guest", "guest", name, ProbableAccessDeniedError) == (530, f"NOT_ALLOWED - vhost {name} not found")


def test_put_permission_is_201_then_204_lets_the_user_in_and_is_listed_three_ways(broker, made, name):
    make_user(broker, made, name)
    assert put(broker, f"/permissions/%2F/{name}", ALL).status_code == 201
    assert put(broker, f"/permissions/%2F/{name}", ALL).status_code == 204
    connect(broker, name, "pw").close()
    entry = {"user": name, "vhost": "/", **ALL}
    assert get(broker, f"/permissions/%2F/{name}").json() == entry
    assert get(broker, f"/users/{name}/permissions").json() == [entry]
    assert entry in get(broker, "/vhosts/%2F/permissions").json()


def test_delete_permission_is_204_and_new_connections_are_refused_again(broker, made, name):
    make_user(broker, made, name, vhost="/")
    connect(broker, name, "pw").close()
    assert delete(broker, f"/permissions/%2F/{name}").status_code == 204
    assert refused(broker, name, "pw", "/", ProbableAccessDeniedError)[0] == 530
    assert get(broker, f"/permissions/%2F/{name}").status_code == 404
    assert get(broker, f"/users/{name}/permissions").json() == []
    assert delete(broker, f"/permissions/%2F/{name}").status_code == 404


@pytest.mark.parametrize("kind", ["permissions", "topic-permissions"])
@pytest.mark.parametrize("missing", ["user", "vhost"])
def test_put_permission_for_a_missing_user_or_vhost_is_400(broker, made, name, kind, missing):
    # 3.10 answers 400 (not 404), with one reason for both.
    make_user(broker, made, name)
    vhost, user = ("%2F", name + "-nobody") if missing == "user" else (name + "-novhost", name)
    r = put(broker, f"/{kind}/{vhost}/{user}", {**ALL, "exchange": "amq.topic"} if kind == "topic-permissions" else ALL)
    assert (r.status_code, r.json()) == (400, {"error": "bad_request", "reason": "vhost_or_user_not_found"})


def test_topic_permission_put_is_201_then_204_listed_and_deleted_with_204(broker, made, name):
    make_user(broker, made, name)
    body = {"exchange": "amq.topic", "write": "^a", "read": ".*"}
    assert put(broker, f"/topic-permissions/%2F/{name}", body).status_code == 201
    assert put(broker, f"/topic-permissions/%2F/{name}", body).status_code == 204
    entry = {"user": name, "vhost": "/", **body}
    # A list even for one user on one vhost (one entry per exchange).
    assert get(broker, f"/topic-permissions/%2F/{name}").json() == [entry]
    assert get(broker, f"/users/{name}/topic-permissions").json() == [entry]
    assert entry in get(broker, "/vhosts/%2F/topic-permissions").json()
    assert delete(broker, f"/topic-permissions/%2F/{name}").status_code == 204
    assert get(broker, f"/topic-permissions/%2F/{name}").status_code == 404
    assert delete(broker, f"/topic-permissions/%2F/{name}").status_code == 404


# ---- vhosts ----

def test_put_vhost_is_201_then_204_and_lists_it_with_description_and_tags(broker, made, name):
    make_vhost(broker, made, name, {"description": "first", "tags": "a,b"})
    listed = [v for v in get(broker, "/vhosts").json() if v["name"] == name]
    assert [(v["description"], v["tags"]) for v in listed] == [("first", ["a", "b"])]
    assert put(broker, f"/vhosts/{name}", {"description": "second", "tags": ["x"]}).status_code == 204
    v = get(broker, f"/vhosts/{name}").json()
    assert (v["name"], v["description"], v["tags"]) == (name, "second", ["x"])


def test_put_vhost_grants_its_creator_full_permissions_and_nobody_else(broker, made, name):
    # 3.10 gives the user who PUT the vhost configure/write/read ".*" on it (guest gets none).
    make_user(broker, made, name, "pw", "administrator")
    vhost = name + "-vh"
    assert put(broker, f"/vhosts/{vhost}", auth=(name, "pw")).status_code == 201
    made.append(f"/vhosts/{vhost}")
    assert get(broker, f"/vhosts/{vhost}/permissions").json() == [{"vhost": vhost, "user": name, **ALL}]
    assert get(broker, f"/vhosts/{vhost}/topic-permissions").json() == []
    connect(broker, name, "pw", vhost).close()


def test_delete_vhost_closes_its_connections_with_320_and_drops_its_queues(broker, made, name):
    make_vhost(broker, made, name)  # guest, its creator, has full permissions on it
    c = connect(broker, "guest", "guest", name)
    ch = c.channel()
    ch.queue_declare("kept", durable=True)
    ch.confirm_delivery()
    ch.basic_publish("", "kept", b"m", pika.BasicProperties(delivery_mode=2))
    assert ch.queue_declare("kept", passive=True).method.message_count == 1
    assert [x["name"] for x in get(broker, f"/queues/{name}").json()] == ["kept"]
    assert delete(broker, f"/vhosts/{name}").status_code == 204
    # 3.10 closes from two racing events (vhost_deleted, vhost_down): "is deleted" about 85% of
    # the time, "is down" the rest (measured over 40 deletions).
    code, text = forced_close(c)
    assert (code, text.replace("' is down", "' is deleted")) == (320, f"CONNECTION_FORCED - vhost '{name}' is deleted")
    assert get(broker, f"/vhosts/{name}").status_code == 404
    assert get(broker, f"/queues/{name}").status_code == 404
    assert name not in [v["name"] for v in get(broker, "/vhosts").json()]
    assert put(broker, f"/vhosts/{name}").status_code == 201
    assert get(broker, f"/queues/{name}").json() == []
    c = connect(broker, "guest", "guest", name)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        c.channel().queue_declare("kept", passive=True)
    assert e.value.reply_code == 404
    c.close()


def test_delete_of_a_missing_vhost_is_404(broker, name):
    r = delete(broker, f"/vhosts/{name}")
    assert (r.status_code, r.json()) == (404, {"error": "Object Not Found", "reason": "Not Found"})


# ---- open connections ----

def test_delete_user_closes_its_connections_with_320(broker, made, name):
    make_user(broker, made, name, vhost="/")
    c = connect(broker, name, "pw")
    assert delete(broker, f"/users/{name}").status_code == 204
    assert forced_close(c) == (320, f"CONNECTION_FORCED - user '{name}' is deleted")
    assert get(broker, f"/permissions/%2F/{name}").status_code == 404


@pytest.mark.warren_only
def test_clearing_a_permission_closes_the_users_connections_on_that_vhost(broker, made, name):
    # RabbitMQ 3.10 leaves the connection open (a new channel opens; queue.declare then gets a
    # channel-level 403): Warren closes it, as for a deleted user.
    make_user(broker, made, name, vhost="/")
    c = connect(broker, name, "pw")
    assert delete(broker, f"/permissions/%2F/{name}").status_code == 204
    assert forced_close(c)[0] == 320


# ---- the management API by tag ----

@pytest.mark.warren_only
def test_a_blank_password_never_logs_in(broker, made, name):
    # RabbitMQ's internal backend refuses it too ("attempted to log in with a blank password,
    # which is prohibited"): a user made with "password": "" is no open door, over AMQP or HTTP.
    make_user(broker, made, name, "", "administrator", vhost="/")
    code, text = refused(broker, name, "", "/", ProbableAuthenticationError)
    assert code == 403 and "Login was refused" in text, (code, text)
    r = get(broker, "/whoami", auth=(name, ""))
    assert (r.status_code, r.json()["error"]) == (401, "not_authorized"), r.text
    # The same user with a password set logs in: the refusal was the blank password's.
    assert put(broker, f"/users/{q(name)}", {"password": "now set", "tags": "administrator"}).status_code == 204
    connect(broker, name, "now set").close()


def test_a_user_without_tags_gets_401_from_the_management_api(broker, made, name):
    make_user(broker, made, name, "pw", "", vhost="/")
    for path in ["/overview", "/whoami"]:
        r = get(broker, path, auth=(name, "pw"))
        # 3.10 spells it "not_authorised" here ("not_authorized" for a failed login) and sends no
        # WWW-Authenticate.
        assert (r.status_code, r.json()) == (401, {"error": "not_authorised", "reason": "Not management user"}), path
        assert "WWW-Authenticate" not in r.headers
    r = get(broker, "/overview", auth=(name, "wrong"))
    assert (r.status_code, r.json()) == (401, {"error": "not_authorized", "reason": "Login failed"})
    assert r.headers["WWW-Authenticate"] == 'Basic realm="RabbitMQ Management"'


def test_an_administrator_sees_itself_in_whoami_and_creates_a_user(broker, made, name):
    make_user(broker, made, name, "pw", "administrator")
    admin = (name, "pw")
    assert get(broker, "/whoami", auth=admin).json() == {"name": name, "tags": ["administrator"]}
    other = name + "-made"
    assert put(broker, f"/users/{other}", {"password": "pw2", "tags": ""}, auth=admin).status_code == 201
    made.append(f"/users/{other}")
    assert get(broker, f"/users/{other}", auth=admin).json()["tags"] == []


# ---- Warren: restart and cluster ----

@pytest.mark.warren_only
@pytest.mark.needs_process
def test_users_vhosts_and_permissions_survive_a_restart(broker, made, name):
    vhost = name + "-vh"
    make_vhost(broker, made, vhost, {"description": "kept", "tags": ["t"]})
    make_user(broker, made, name, "pw", "monitoring", vhost=vhost)
    assert put(broker, f"/topic-permissions/{vhost}/{name}", {"exchange": "amq.topic", "write": "^a", "read": ".*"}).status_code == 201
    broker.restart()
    connect(broker, name, "pw", vhost).close()
    assert get(broker, f"/users/{name}").json()["tags"] == ["monitoring"]
    v = get(broker, f"/vhosts/{vhost}").json()
    assert (v["description"], v["tags"]) == ("kept", ["t"])
    assert get(broker, f"/permissions/{vhost}/{name}").json() == {"user": name, "vhost": vhost, **ALL}
    assert get(broker, f"/topic-permissions/{vhost}/{name}").json() == [
        {"user": name, "vhost": vhost, "exchange": "amq.topic", "write": "^a", "read": ".*"}]


@pytest.mark.warren_only
@pytest.mark.needs_process
def test_guests_password_changed_through_the_api_is_not_reset_by_a_restart(broker):
    # RabbitMQ creates its default user only at the first start of a node.
    assert put(broker, "/users/guest", {"password": "changed", "tags": "administrator"}).status_code == 204
    broker.restart()
    assert refused(broker, "guest", "guest", "/", ProbableAuthenticationError)[0] == 403
    connect(broker, "guest", "changed").close()
    assert get(broker, "/whoami", auth=("guest", "changed")).json() == {"name": "guest", "tags": ["administrator"]}
    assert get(broker, "/whoami").status_code == 401


@pytest.fixture
def cluster(tmp_path):
    yield from three_node_cluster(tmp_path, "users-vhosts-cluster-secret")


@pytest.mark.warren_only
def test_a_user_made_on_node_1_logs_in_on_node_3_at_once_and_deleting_it_on_node_2_closes_that_connection(cluster, name):
    n1, n2, n3 = cluster[1], cluster[2], cluster[3]
    # The first change waits for the metadata group to elect a leader.
    eventually(lambda: put(n1, f"/users/{name}", {"password": "pw", "tags": ""}).status_code in (201, 204), timeout=30)
    assert put(n1, f"/permissions/%2F/{name}", ALL).status_code == 201
    c = connect(n3, name, "pw")
    assert delete(n2, f"/users/{name}").status_code == 204
    assert forced_close(c) == (320, f"CONNECTION_FORCED - user '{name}' is deleted")
    assert refused(n3, name, "pw", "/", ProbableAuthenticationError)[0] == 403


# ---- vhost limits ----

@pytest.mark.warren_only
def test_a_vhost_connection_limit_counts_every_nodes_connections(cluster, name):
    # As RabbitMQ counts its tracked connections on every node: a limit of 2 is 2 in the cluster,
    # not 2 per node.
    n1, n2, n3 = cluster[1], cluster[2], cluster[3]
    vhost = name + "-lim"
    eventually(lambda: put(n1, f"/vhosts/{q(vhost)}").status_code in (201, 204), timeout=30)
    assert put(n2, f"/vhost-limits/{q(vhost)}/max-connections", {"value": 2}).status_code == 204
    first, second = connect(n1, "guest", "guest", vhost), connect(n2, "guest", "guest", vhost)
    code, text = refused(n3, "guest", "guest", vhost, ProbableAccessDeniedError)
    assert (code, text) == (530, f"NOT_ALLOWED - access to vhost '{vhost}' refused for user 'guest': connection limit (2) is reached")
    # One closed on node 1: node 3 takes its place, and now node 1, which has none, is refused.
    first.close()

    def open_on_3():
        try:
            return connect(n3, "guest", "guest", vhost)
        except ProbableAccessDeniedError:  # node 1 has not yet let go of the closed one
            return None

    third = eventually(open_on_3, timeout=10)
    assert refused(n1, "guest", "guest", vhost, ProbableAccessDeniedError)[0] == 530
    second.close()
    third.close()
    for n in (n1, n2, n3):
        connect(n, "guest", "guest", vhost).close()


@pytest.mark.warren_only
def test_vhost_limits_refuse_the_queue_and_the_connection_past_them(broker, made, name):
    vhost = name + "-lim"
    make_vhost(broker, made, vhost)
    assert put(broker, f"/vhost-limits/{vhost}/max-queues", {"value": 2}).status_code == 204
    assert put(broker, f"/vhost-limits/{vhost}/max-connections", {"value": 1}).status_code == 204
    assert get(broker, f"/vhost-limits/{vhost}").json() == [{"vhost": vhost, "value": {"max-connections": 1, "max-queues": 2}}]
    c = connect(broker, "guest", "guest", vhost)
    ch = c.channel()
    ch.queue_declare("q1", durable=True)
    ch.queue_declare("", exclusive=True)  # transient ones count too
    ch.queue_declare("q1", durable=True)  # an existing one is no new queue
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.queue_declare("q3", durable=True)
    assert (e.value.reply_code, e.value.reply_text) == (406, f"PRECONDITION_FAILED - cannot declare queue 'q3': queue limit in vhost '{vhost}' (2) is reached")
    code, text = refused(broker, "guest", "guest", vhost, ProbableAccessDeniedError)
    assert (code, text) == (530, f"NOT_ALLOWED - access to vhost '{vhost}' refused for user 'guest': connection limit (1) is reached")
    # Lifted (a negative value, or DELETE): both work again.
    assert put(broker, f"/vhost-limits/{vhost}/max-queues", {"value": -1}).status_code == 204
    assert delete(broker, f"/vhost-limits/{vhost}/max-connections").status_code == 204
    c.channel().queue_declare("q3", durable=True)
    connect(broker, "guest", "guest", vhost).close()
    assert get(broker, f"/vhost-limits/{vhost}").json() == []
    c.close()
