"""`warren ctl` over the management HTTP API, the real binary against a real broker: every change it
makes is checked over AMQP (or the API), every refusal says why and changes nothing."""

import json
import subprocess

import pika
import pytest
import requests

from conftest import Broker, binary_for, eventually

pytestmark = pytest.mark.warren_only


def ctl(broker, *args, check=True, stdin=None):
    proc = subprocess.run(
        [binary_for({}), "ctl", "--url", f"http://127.0.0.1:{broker.http_port}", *args],
        capture_output=True, text=True, timeout=30, input=stdin,
    )
    if check:
        assert proc.returncode == 0, f"warren ctl {' '.join(args)}: {proc.stderr}"
    return proc


def test_declare_bind_publish_get_purge_delete_checked_over_amqp(broker, ch, name):
    ctl(broker, "declare", "queue", name, "--type", "quorum", "--arg", "x-max-length=100")
    ctl(broker, "declare", "exchange", f"{name}-x", "--type", "topic")
    ctl(broker, "declare", "binding", f"{name}-x", name, "--routing-key", "orders.*")
    ok = ch.queue_declare(name, passive=True)
    assert ok.method.message_count == 0
    ch.exchange_declare(f"{name}-x", "topic", passive=True)

    # Routed through the binding: two over AMQP, one from ctl.
    ch.confirm_delivery()
    for i in range(2):
        ch.basic_publish(f"{name}-x", "orders.new", b"amqp %d" % i, pika.BasicProperties(delivery_mode=2))
    assert "message published" == ctl(broker, "publish", "--exchange", f"{name}-x", "--routing-key", "orders.paid", "--payload", "from ctl").stdout.strip()
    assert "not routed" in ctl(broker, "publish", "--exchange", f"{name}-x", "--routing-key", "other", "--payload", "x").stdout
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 3)

    listed = json.loads(ctl(broker, "list", "queues", "--json").stdout)
    mine = [q for q in listed if q["name"] == name][0]
    assert mine["type"] == "quorum" and mine["arguments"]["x-max-length"] == 100 and mine["messages"] == 3
    table = ctl(broker, "list", "queues").stdout.splitlines()
    assert table[0].split() == ["vhost", "name", "type", "node", "messages_ready", "messages_unacknowledged", "consumers"]
    assert any(line.split()[1:3] == [name, "quorum"] and line.split()[4] == "3" for line in table[1:])
    bindings = json.loads(ctl(broker, "list", "bindings", "--json").stdout)
    assert any(b["source"] == f"{name}-x" and b["destination"] == name and b["routing_key"] == "orders.*" for b in bindings)

    # get looks (requeues) by default; ack_requeue_false takes.
    looked = json.loads(ctl(broker, "get", name, "--count", "3", "--json").stdout)
    assert [m["payload"] for m in looked] == ["amqp 0", "amqp 1", "from ctl"]
    taken = json.loads(ctl(broker, "get", name, "--ackmode", "ack_requeue_false", "--json").stdout)
    assert [m["payload"] for m in taken] == ["amqp 0"]
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 2)

    # Unbinding needs the binding's routing key; a wrong one is refused and removes nothing.
    wrong = ctl(broker, "delete", "binding", f"{name}-x", name, "--routing-key", "nope", check=False)
    assert wrong.returncode == 1 and "no binding from" in wrong.stderr
    ctl(broker, "delete", "binding", f"{name}-x", name, "--routing-key", "orders.*")
    ch.basic_publish(f"{name}-x", "orders.new", b"after unbind", pika.BasicProperties(delivery_mode=2))

    ctl(broker, "purge", name)
    assert ch.queue_declare(name, passive=True).method.message_count == 0
    ctl(broker, "delete", "queue", name)
    ctl(broker, "delete", "exchange", f"{name}-x")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as gone:
        ch.queue_declare(name, passive=True)
    assert gone.value.reply_code == 404


def test_close_connection_and_conditional_deletes(broker, conn, name):
    ch = conn.channel()
    ch.queue_declare(name)
    ch.basic_publish("", name, b"keep me")
    eventually(lambda: ch.queue_declare(name, passive=True).method.message_count == 1)
    refused = ctl(broker, "delete", "queue", name, "--if-empty", check=False)
    assert refused.returncode == 1 and "not empty" in refused.stderr.lower(), refused.stderr
    assert ch.queue_declare(name, passive=True).method.message_count == 1

    other = broker.connection(client_properties={"product": "ctl-victim"})
    connections = json.loads(ctl(broker, "list", "connections", "--json").stdout)
    victim = [c for c in connections if c["client_properties"].get("product") == "ctl-victim"][0]
    ctl(broker, "close-connection", victim["name"], "--reason", "maintenance by ctl")
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        for _ in range(100):
            other.process_data_events(time_limit=0.1)
    assert closed.value.reply_code == 320 and "maintenance by ctl" in closed.value.reply_text
    assert conn.is_open


def test_export_and_import_into_another_broker(broker, ch, name, tmp_path):
    ch.queue_declare(name, durable=True, arguments={"x-message-ttl": 60000})
    ch.exchange_declare(f"{name}-x", "fanout", durable=True)
    ch.queue_bind(name, f"{name}-x")
    exported = tmp_path / "definitions.json"
    ctl(broker, "export", str(exported))
    definitions = json.loads(exported.read_text())
    assert any(q["name"] == name for q in definitions["queues"])

    other = Broker(tmp_path / "other-data", tmp_path / "other.log")
    other.start()
    try:
        ctl(other, "import", str(exported))
        conn = other.connection()
        och = conn.channel()
        och.queue_declare(name, passive=True)
        och.basic_publish(f"{name}-x", "", b"through the imported binding")
        eventually(lambda: och.queue_declare(name, passive=True).method.message_count == 1)
        conn.close()
        # A file that is not definitions changes nothing.
        bad = tmp_path / "bad.json"
        bad.write_text('{"queues": [{"name": 5}]}')
        refused = ctl(other, "import", str(bad), check=False)
        assert refused.returncode == 1 and refused.stderr.startswith("warren ctl: ")
    finally:
        other.proc.kill()
        other.proc.wait(10)


def test_refusals_say_why(broker, name):
    wrong = ctl(broker, "--password", "wrong", "list", "queues", check=False)
    assert wrong.returncode == 1 and "refused user 'guest'" in wrong.stderr and "--password" in wrong.stderr
    missing = ctl(broker, "delete", "queue", name, check=False)
    assert missing.returncode == 1 and f"no queue '{name}'" in missing.stderr and "HTTP 404" in missing.stderr
    bad_arg = ctl(broker, "declare", "queue", name, "--arg", "x-max-length=-5", check=False)
    assert bad_arg.returncode == 1 and "x-max-length" in bad_arg.stderr
    assert requests.get(f"http://127.0.0.1:{broker.http_port}/api/queues/%2F/{name}", auth=("guest", "guest")).status_code == 404
    no_vhost = ctl(broker, "--vhost", "nowhere", "list", "queues", check=False)
    assert no_vhost.returncode == 1 and "no vhost 'nowhere'" in no_vhost.stderr
    down = subprocess.run([binary_for({}), "ctl", "--url", "http://127.0.0.1:1", "list", "queues"], capture_output=True, text=True, timeout=30)
    assert down.returncode == 1 and "cannot connect to http://127.0.0.1:1" in down.stderr
    # A queue name with a terminal escape sequence is printed escaped.
    requests.put(f"http://127.0.0.1:{broker.http_port}/api/queues/%2F/{name}%1B%5B2J", auth=("guest", "guest"), json={})
    listed = ctl(broker, "list", "queues").stdout
    assert "\x1b" not in listed and f"{name}\\u{{1b}}[2J" in listed


def amqp_login(broker, user, password, vhost="/"):
    params = pika.ConnectionParameters(broker.host, broker.port, vhost, pika.PlainCredentials(user, password), connection_attempts=1)
    return pika.BlockingConnection(params)


def test_users_vhosts_and_permissions_as_rabbitmqctl_names_them(broker, name):
    vhost = f"{name}-v"
    assert ctl(broker, "add-vhost", vhost, "--description", "made by ctl").stdout.strip() == f"vhost added: {vhost}"
    assert "already exists" in ctl(broker, "add-vhost", vhost, check=False).stderr
    ctl(broker, "add-user", name, "first pw", "--tags", "monitoring")
    assert "already exists" in ctl(broker, "add-user", name, "other", check=False).stderr
    ctl(broker, "--vhost", vhost, "set-permissions", name, "^a", ".*", ".*")
    amqp_login(broker, name, "first pw", vhost).close()
    listed = json.loads(ctl(broker, "--vhost", vhost, "list", "permissions", "--json").stdout)
    assert {(p["user"], p["configure"]) for p in listed} == {("guest", ".*"), (name, "^a")}, "the creator (guest) got every permission on it"
    users = {u["name"]: u for u in json.loads(ctl(broker, "list", "users", "--json").stdout)}
    assert users[name]["tags"] == ["monitoring"] and "first pw" not in json.dumps(users)

    # The password changes and the tags stay; the tags change and the password stays.
    ctl(broker, "change-password", name, "second pw")
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        amqp_login(broker, name, "first pw", vhost)
    ctl(broker, "set-user-tags", name, "administrator", "management")
    amqp_login(broker, name, "second pw", vhost).close()
    assert requests.get(f"http://127.0.0.1:{broker.http_port}/api/whoami", auth=(name, "second pw")).json()["tags"] == ["administrator", "management"]

    # Cleared permissions close the user's connections to that vhost; then the user and the vhost go.
    c = amqp_login(broker, name, "second pw", vhost)
    ctl(broker, "--vhost", vhost, "clear-permissions", name)
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        c.channel()
        c.process_data_events(time_limit=5)
        c.channel().queue_declare("", exclusive=True)
    assert closed.value.reply_code == 320
    ctl(broker, "delete-user", name)
    assert f"no user '{name}'" in ctl(broker, "delete-user", name, check=False).stderr
    ctl(broker, "delete-vhost", vhost)
    assert vhost not in [v["name"] for v in json.loads(ctl(broker, "list", "vhosts", "--json").stdout)]


def test_a_password_left_off_the_command_line_is_read_from_stdin(broker, name):
    # As rabbitmqctl: what is on a command line is visible to every user in `ps`.
    ctl(broker, "add-user", name, "--tags", "management", stdin="from stdin pw\n")
    try:
        assert requests.get(f"http://127.0.0.1:{broker.http_port}/api/whoami", auth=(name, "from stdin pw"), timeout=10).status_code == 200
        ctl(broker, "change-password", name, stdin="second\r\n")
        assert requests.get(f"http://127.0.0.1:{broker.http_port}/api/whoami", auth=(name, "second"), timeout=10).status_code == 200
        assert requests.get(f"http://127.0.0.1:{broker.http_port}/api/whoami", auth=(name, "from stdin pw"), timeout=10).status_code == 401
        # Nothing on stdin changes nothing and says why.
        refused = ctl(broker, "change-password", name, check=False, stdin="")
        assert refused.returncode != 0 and "standard input" in refused.stderr, refused.stderr
        assert requests.get(f"http://127.0.0.1:{broker.http_port}/api/whoami", auth=(name, "second"), timeout=10).status_code == 200
    finally:
        ctl(broker, "delete-user", name, check=False)
