"""The permission matrix: one AMQP method run by a user with given configure/write/read (and topic)
patterns, against resources an administrator made, and its outcome, in RabbitMQ 3.10's rules
(rabbit_channel.erl) and words. Each case gets its own vhost and user (made through the management
API, deleted after), so the module shares one broker.

The table is RabbitMQ's truth: it passes against RabbitMQ 3.10 with the management plugin:
    PLUGINS=rabbitmq_management ../shared/anchors/start_cluster.sh 1
    WARREN_TEST_EXTERNAL_URL=amqp://guest:guest@127.0.0.1:5672/%2F \\
    WARREN_TEST_EXTERNAL_HTTP=http://guest:guest@127.0.0.1:15672 \\
      python3 -m pytest -q tests/python/test_permissions.py

An outcome is "ok", or ("channel" | "connection", code, text) of the close the broker sent. `{v}`
and `{u}` in an expected text are the case's vhost and user; a server-named queue's name shows
as `amq.gen-*`."""
import re
from collections import namedtuple

import pytest
from pika.exceptions import ChannelClosedByBroker, ConnectionClosedByBroker

from conftest import EXTERNAL, Broker, ExternalBroker
from test_users_vhosts import connect, delete, put, q

NONE = ("", "", "")
ALL = (".*", ".*", ".*")


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """One broker for the module: every case has its own vhost and user."""
    if EXTERNAL:
        yield ExternalBroker(EXTERNAL)
        return
    d = tmp_path_factory.mktemp("permissions")
    b = Broker(d / "data", d / "warren.log")
    b.start()
    yield b
    if b.alive():
        b.proc.kill()
        b.proc.wait(10)
    if "panicked" in b.log_text():
        print("---- warren log ----\n" + b.log_text()[-20000:])


# ---- expected outcomes ----

def denied(kind, name):
    return ("channel", 403, f"ACCESS_REFUSED - access to {kind} '{name}' in vhost '{{v}}' refused for user '{{u}}'")


def topic_denied(key, exchange="amq.topic"):
    return ("channel", 403, f"ACCESS_REFUSED - access to topic '{key}' in exchange '{exchange}' in vhost '{{v}}' refused for user '{{u}}'")


def not_found(kind, name):
    return ("channel", 404, f"NOT_FOUND - no {kind} '{name}' in vhost '{{v}}'")


DEFAULT_EXCHANGE = ("channel", 403, "ACCESS_REFUSED - operation not permitted on the default exchange")


def system_exchange(name):
    return ("channel", 403, f"ACCESS_REFUSED - deletion of system exchange '{name}' in vhost '{{v}}' not allowed")


# ---- what the administrator makes first (as guest, over AMQP) ----

def queue(*names, **arguments):
    return lambda ch: [ch.queue_declare(n, arguments=arguments or None) for n in names]


def exchange(*names, type="direct", **arguments):
    return lambda ch: [ch.exchange_declare(n, type, arguments=arguments or None) for n in names]


def steps(*fns):
    return lambda ch: [f(ch) for f in fns]


def bound(queue_name, exchange_name, key=""):
    return lambda ch: ch.queue_bind(queue_name, exchange_name, key)


# ---- what the user does ----

def publish(exchange_name, key="k"):
    """A publish with confirms: a refusal closes the channel before the confirm."""
    def run(ch, user):
        ch.confirm_delivery()
        ch.basic_publish(exchange_name, key.format(username=user), b"m")
    return run


def consume(queue_name):
    return lambda ch, user: ch.basic_consume(queue_name, lambda *a: None, auto_ack=True)


Case = namedtuple("Case", "id perms action expected setup topic", defaults=(None, None))
# perms: (configure, write, read). topic: [{"exchange", "write", "read"}, ...].

CASES = [
    # exchange.declare: configure on the exchange; passive: no check.
    Case("exchange.declare allowed", ("^x$", "", ""), lambda ch, u: ch.exchange_declare("x", "direct"), "ok"),
    Case("exchange.declare denied", ("^y$", ".*", ".*"), lambda ch, u: ch.exchange_declare("x", "direct"), denied("exchange", "x")),
    Case("exchange.declare of an existing exchange denied", ("^y$", ".*", ".*"), lambda ch, u: ch.exchange_declare("x", "direct"),
         denied("exchange", "x"), exchange("x")),
    Case("exchange.declare amq.direct (existing) allowed", (".*", "", ""), lambda ch, u: ch.exchange_declare("amq.direct", "direct", durable=True), "ok"),
    Case("exchange.declare amq.direct denied", ("", ".*", ".*"), lambda ch, u: ch.exchange_declare("amq.direct", "direct", durable=True),
         denied("exchange", "amq.direct")),
    Case("exchange.declare passive needs nothing", NONE, lambda ch, u: ch.exchange_declare("x", "direct", passive=True), "ok", exchange("x")),
    Case("exchange.declare passive of a missing exchange is 404", NONE, lambda ch, u: ch.exchange_declare("x", "direct", passive=True),
         not_found("exchange", "x")),
    Case("exchange.declare of the default exchange", ALL, lambda ch, u: ch.exchange_declare("", "direct"), DEFAULT_EXCHANGE),
    # alternate-exchange on a new exchange: read on it, write on the AE.
    Case("exchange.declare with alternate-exchange allowed", ("^x$", "^ae$", "^x$"),
         lambda ch, u: ch.exchange_declare("x", "direct", arguments={"alternate-exchange": "ae"}), "ok"),
    Case("exchange.declare with alternate-exchange without read on it", ("^x$", "^ae$", ""),
         lambda ch, u: ch.exchange_declare("x", "direct", arguments={"alternate-exchange": "ae"}), denied("exchange", "x")),
    Case("exchange.declare with alternate-exchange without write on the AE", ("^x$", "^x$", "^x$"),
         lambda ch, u: ch.exchange_declare("x", "direct", arguments={"alternate-exchange": "ae"}), denied("exchange", "ae")),
    Case("exchange.declare of an existing exchange with alternate-exchange checks only configure", ("^x$", "", ""),
         lambda ch, u: ch.exchange_declare("x", "direct", arguments={"alternate-exchange": "ae"}), "ok",
         exchange("x", **{"alternate-exchange": "ae"})),

    # exchange.delete: configure; the default exchange and amq.* refused for what they are.
    Case("exchange.delete allowed", ("^x$", "", ""), lambda ch, u: ch.exchange_delete("x"), "ok", exchange("x")),
    Case("exchange.delete denied", ("^y$", ".*", ".*"), lambda ch, u: ch.exchange_delete("x"), denied("exchange", "x"), exchange("x")),
    Case("exchange.delete amq.direct with configure .*", ALL, lambda ch, u: ch.exchange_delete("amq.direct"), system_exchange("amq.direct")),
    Case("exchange.delete amq.direct with configure ^$", ("^$", "", ""), lambda ch, u: ch.exchange_delete("amq.direct"),
         system_exchange("amq.direct")),
    Case("exchange.delete of the default exchange", ALL, lambda ch, u: ch.exchange_delete(""), DEFAULT_EXCHANGE),

    # exchange.bind/unbind: write on the destination, read on the source.
    Case("exchange.bind allowed", ("", "^dst$", "^src$"), lambda ch, u: ch.exchange_bind("dst", "src", "k"), "ok", exchange("src", "dst")),
    Case("exchange.bind without write on the destination", ("", "^src$", "^src$"), lambda ch, u: ch.exchange_bind("dst", "src", "k"),
         denied("exchange", "dst"), exchange("src", "dst")),
    Case("exchange.bind without read on the source", ("", "^dst$", "^dst$"), lambda ch, u: ch.exchange_bind("dst", "src", "k"),
         denied("exchange", "src"), exchange("src", "dst")),
    Case("exchange.unbind allowed", ("", "^dst$", "^src$"), lambda ch, u: ch.exchange_unbind("dst", "src", "k"), "ok",
         steps(exchange("src", "dst"), lambda ch: ch.exchange_bind("dst", "src", "k"))),
    Case("exchange.unbind without write on the destination", ("", "", "^src$"), lambda ch, u: ch.exchange_unbind("dst", "src", "k"),
         denied("exchange", "dst"), steps(exchange("src", "dst"), lambda ch: ch.exchange_bind("dst", "src", "k"))),
    Case("exchange.unbind without read on the source", ("", "^dst$", ""), lambda ch, u: ch.exchange_unbind("dst", "src", "k"),
         denied("exchange", "src"), steps(exchange("src", "dst"), lambda ch: ch.exchange_bind("dst", "src", "k"))),

    # queue.declare: configure; passive: no check.
    Case("queue.declare allowed", ("^q$", "", ""), lambda ch, u: ch.queue_declare("q"), "ok"),
    Case("queue.declare denied", ("^other$", ".*", ".*"), lambda ch, u: ch.queue_declare("q"), denied("queue", "q")),
    Case("queue.declare of an existing queue denied", ("^other$", ".*", ".*"), lambda ch, u: ch.queue_declare("q"),
         denied("queue", "q"), queue("q")),
    Case("queue.declare passive needs nothing", NONE, lambda ch, u: ch.queue_declare("q", passive=True), "ok", queue("q")),
    Case("queue.declare passive of a missing queue is 404", NONE, lambda ch, u: ch.queue_declare("q", passive=True), not_found("queue", "q")),
    Case("queue.declare server-named allowed by ^amq\\.gen", ("^amq\\.gen", "", ""), lambda ch, u: ch.queue_declare(""), "ok"),
    Case("queue.declare server-named denied by ^only-this$", ("^only-this$", ".*", ".*"), lambda ch, u: ch.queue_declare(""),
         denied("queue", "amq.gen-*")),
    # x-dead-letter-exchange on a new queue: read on the queue, write on the DLX.
    Case("queue.declare with a DLX allowed", ("^q$", "^dlx$", "^q$"),
         lambda ch, u: ch.queue_declare("q", arguments={"x-dead-letter-exchange": "dlx"}), "ok"),
    Case("queue.declare with a DLX without read on the queue", ("^q$", "^dlx$", ""),
         lambda ch, u: ch.queue_declare("q", arguments={"x-dead-letter-exchange": "dlx"}), denied("queue", "q")),
    Case("queue.declare with a DLX without write on it", ("^q$", "^q$", "^q$"),
         lambda ch, u: ch.queue_declare("q", arguments={"x-dead-letter-exchange": "dlx"}), denied("exchange", "dlx")),
    Case("queue.declare of an existing queue with a DLX checks only configure", ("^q$", "", ""),
         lambda ch, u: ch.queue_declare("q", arguments={"x-dead-letter-exchange": "dlx"}), "ok",
         queue("q", **{"x-dead-letter-exchange": "dlx"})),

    # queue.delete: configure. queue.purge: read.
    Case("queue.delete allowed", ("^q$", "", ""), lambda ch, u: ch.queue_delete("q"), "ok", queue("q")),
    Case("queue.delete denied", ("^other$", ".*", ".*"), lambda ch, u: ch.queue_delete("q"), denied("queue", "q"), queue("q")),
    Case("queue.purge allowed", ("", "", "^q$"), lambda ch, u: ch.queue_purge("q"), "ok", queue("q")),
    Case("queue.purge denied", (".*", ".*", "^other$"), lambda ch, u: ch.queue_purge("q"), denied("queue", "q"), queue("q")),

    # queue.bind/unbind: write on the queue, read on the exchange.
    Case("queue.bind allowed", ("", "^q$", "^x$"), lambda ch, u: ch.queue_bind("q", "x", "k"), "ok", steps(queue("q"), exchange("x"))),
    Case("queue.bind without write on the queue", ("", "^x$", "^x$"), lambda ch, u: ch.queue_bind("q", "x", "k"),
         denied("queue", "q"), steps(queue("q"), exchange("x"))),
    Case("queue.bind without read on the exchange", ("", "^q$", "^q$"), lambda ch, u: ch.queue_bind("q", "x", "k"),
         denied("exchange", "x"), steps(queue("q"), exchange("x"))),
    Case("queue.bind to the default exchange", ALL, lambda ch, u: ch.queue_bind("q", "", "q"), DEFAULT_EXCHANGE, queue("q")),
    Case("queue.unbind allowed", ("", "^q$", "^x$"), lambda ch, u: ch.queue_unbind("q", "x", "k"), "ok",
         steps(queue("q"), exchange("x"), bound("q", "x", "k"))),
    Case("queue.unbind without write on the queue", ("", "", "^x$"), lambda ch, u: ch.queue_unbind("q", "x", "k"),
         denied("queue", "q"), steps(queue("q"), exchange("x"), bound("q", "x", "k"))),
    Case("queue.unbind without read on the exchange", ("", "^q$", ""), lambda ch, u: ch.queue_unbind("q", "x", "k"),
         denied("exchange", "x"), steps(queue("q"), exchange("x"), bound("q", "x", "k"))),

    # basic.consume and basic.get: read on the queue; the reply-to pseudo queue: no check.
    Case("basic.consume allowed", ("", "", "^q$"), consume("q"), "ok", queue("q")),
    Case("basic.consume denied", (".*", ".*", "^other$"), consume("q"), denied("queue", "q"), queue("q")),
    Case("basic.consume on amq.rabbitmq.reply-to needs nothing", NONE, consume("amq.rabbitmq.reply-to"), "ok"),
    Case("basic.get allowed", ("", "", "^q$"), lambda ch, u: ch.basic_get("q"), "ok", queue("q")),
    Case("basic.get denied", (".*", ".*", "^other$"), lambda ch, u: ch.basic_get("q"), denied("queue", "q"), queue("q")),

    # basic.publish: write on the exchange, the default one as amq.default; checked before the lookup.
    Case("basic.publish allowed", ("", "^x$", ""), publish("x"), "ok", exchange("x")),
    Case("basic.publish denied", (".*", "^other$", ".*"), publish("x"), denied("exchange", "x"), exchange("x")),
    Case("basic.publish to the default exchange allowed as amq.default", ("", "^amq\\.default$", ""), publish("", "q"), "ok", queue("q")),
    Case("basic.publish to the default exchange denied as amq.default", (".*", "^q$", ".*"), publish("", "q"),
         denied("exchange", "amq.default"), queue("q")),
    Case("basic.publish to a missing exchange denied is 403", (".*", "^other$", ".*"), publish("nope"), denied("exchange", "nope")),
    Case("basic.publish to a missing exchange allowed is 404", ("", ".*", ""), publish("nope"), not_found("exchange", "nope")),
    Case("basic.publish denied then a synchronous call sees the close", (".*", "^other$", ".*"),
         lambda ch, u: (ch.basic_publish("x", "k", b"m"), ch.queue_declare("x", passive=True)), denied("exchange", "x"), exchange("x")),

    # an empty pattern matches nothing (not even the default exchange).
    Case("empty configure pattern refuses queue.declare", NONE, lambda ch, u: ch.queue_declare("q"), denied("queue", "q")),
    Case("empty configure pattern refuses a server-named queue", NONE, lambda ch, u: ch.queue_declare(""), denied("queue", "amq.gen-*")),
    Case("empty write pattern refuses a publish to the default exchange", NONE, publish("", "q"), denied("exchange", "amq.default"),
         queue("q")),
    Case("empty read pattern refuses basic.get", NONE, lambda ch, u: ch.basic_get("q"), denied("queue", "q"), queue("q")),
]

TOPIC = [{"exchange": "amq.topic", "write": "^allowed\\.", "read": "^r\\."}]
TOPIC_CASES = [
    Case("topic: publish allowed.x", ALL, publish("amq.topic", "allowed.x"), "ok", topic=TOPIC),
    Case("topic: publish other.x", ALL, publish("amq.topic", "other.x"), topic_denied("other.x"), topic=TOPIC),
    Case("topic: queue.bind r.x", ALL, lambda ch, u: ch.queue_bind("q", "amq.topic", "r.x"), "ok", queue("q"), TOPIC),
    Case("topic: queue.bind x.y", ALL, lambda ch, u: ch.queue_bind("q", "amq.topic", "x.y"), topic_denied("x.y"), queue("q"), TOPIC),
    Case("topic: queue.unbind x.y", ALL, lambda ch, u: ch.queue_unbind("q", "amq.topic", "x.y"), topic_denied("x.y"),
         steps(queue("q"), bound("q", "amq.topic", "x.y")), TOPIC),
    Case("topic: exchange.bind from amq.topic x.y", ALL, lambda ch, u: ch.exchange_bind("dst", "amq.topic", "x.y"), topic_denied("x.y"),
         exchange("dst"), TOPIC),
    Case("topic: no topic permission for another topic exchange allows a publish", ALL, publish("t2", "other.x"), "ok",
         exchange("t2", type="topic"), TOPIC),
    Case("topic: no topic permission for another topic exchange allows a bind", ALL, lambda ch, u: ch.queue_bind("q", "t2", "x.y"), "ok",
         steps(queue("q"), exchange("t2", type="topic")), TOPIC),
    Case("topic: a topic permission on a direct exchange is not checked", ALL, publish("amq.direct", "other.x"), "ok",
         topic=[{"exchange": "amq.direct", "write": "^nothing$", "read": "^nothing$"}]),
    Case("topic: {username} expanded, allowed", ALL, publish("amq.topic", "{username}.x"), "ok",
         topic=[{"exchange": "amq.topic", "write": "^{username}\\.", "read": ".*"}]),
    Case("topic: {username} expanded, denied", ALL, publish("amq.topic", "someone-else.x"), topic_denied("someone-else.x"),
         topic=[{"exchange": "amq.topic", "write": "^{username}\\.", "read": ".*"}]),
    Case("topic: {username} in a read pattern", ALL, lambda ch, u: ch.queue_bind("q", "amq.topic", f"{u}.x"), "ok", queue("q"),
         [{"exchange": "amq.topic", "write": ".*", "read": "^{username}\\."}]),
]


def outcome(fn):
    try:
        fn()
        return "ok"
    except ChannelClosedByBroker as e:
        return ("channel", e.reply_code, re.sub(r"amq\.gen-[A-Za-z0-9_-]+", "amq.gen-*", e.reply_text))
    except ConnectionClosedByBroker as e:
        return ("connection", e.reply_code, e.reply_text)


@pytest.mark.parametrize("case", CASES + TOPIC_CASES, ids=lambda c: c.id)
def test_permission(broker, name, case):
    vhost, user = name + "-vh", name
    try:
        assert put(broker, f"/vhosts/{q(vhost)}").status_code == 201  # guest, its creator, gets ".*" on it
        assert put(broker, f"/users/{q(user)}", {"password": "pw", "tags": ""}).status_code == 201
        configure, write, read = case.perms
        assert put(broker, f"/permissions/{q(vhost)}/{q(user)}", {"configure": configure, "write": write, "read": read}).status_code == 201
        for t in case.topic or []:
            assert put(broker, f"/topic-permissions/{q(vhost)}/{q(user)}", t).status_code in (201, 204)
        if case.setup:
            admin = connect(broker, "guest", "guest", vhost)
            case.setup(admin.channel())
            admin.close()
        c = connect(broker, user, "pw", vhost)
        try:
            got = outcome(lambda: case.action(c.channel(), user))
        finally:
            if c.is_open:
                c.close()
        expected = case.expected
        if expected != "ok":
            expected = (expected[0], expected[1], expected[2].format(v=vhost, u=user))
        assert got == expected
    finally:
        delete(broker, f"/vhosts/{q(vhost)}")
        delete(broker, f"/users/{q(user)}")
