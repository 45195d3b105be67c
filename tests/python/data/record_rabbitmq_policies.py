#!/usr/bin/env python3
"""Records how RabbitMQ 3.10 answers and behaves for policies and operator policies.

Run it against a real RabbitMQ 3.10 node with the management plugin on this host (AMQP
127.0.0.1:5672, HTTP 127.0.0.1:15672, user guest/guest), e.g.

    PLUGINS=rabbitmq_management /work/shared/anchors/start_cluster.sh 1
    python3 tests/python/data/record_rabbitmq_policies.py /tmp/policies.raw.md /tmp/policies.raw.json
    /work/shared/anchors/stop_cluster.sh

It writes a Markdown record (the exact requests and answers, and the observed behaviour) and a JSON
dump of the same, which tests/python/data/rabbitmq-3.10-policies.md was made from (that file adds
the hand-written summary). It only talks to 127.0.0.1; it creates vhosts `pt-match` and `pt-other`
and queues, exchanges and policies named `pt-*` in `/`, and removes them at the end.

Sections: 1 validation of PUT /api/policies and /api/operator-policies; 2 GET shapes; 3 matching
(priority, ties, apply-to, unanchored patterns); 4 effective values when a queue argument, a policy
and an operator policy set the same key (observed by publishing); 5 a policy set on / removed from
queues that already hold messages; 6 definitions export.
"""
import json
import sys
import time
import urllib.parse

import pika
import requests

HOST = "127.0.0.1"
HTTP = f"http://{HOST}:15672"
S = requests.Session()
S.auth = ("guest", "guest")
RECORD = {}
MD = []


def qv(s):
    return urllib.parse.quote(s, safe="")


def md(*lines):
    MD.extend(lines)


def http(method, path, body=None, raw=None):
    kw = {}
    if raw is not None:
        kw["data"] = raw
        kw["headers"] = {"content-type": "application/json"}
    elif body is not None:
        kw["json"] = body
    for attempt in range(3):
        try:
            r = S.request(method, HTTP + "/api" + path, timeout=60, **kw)
            break
        except requests.exceptions.ConnectionError:
            # the server may close a kept-alive connection after an error answer: retry on a new one
            if attempt == 2:
                raise
            time.sleep(0.2)
    try:
        j = r.json() if r.content else None
    except ValueError:
        j = None
    return r.status_code, j, r.text


def cell(s):
    return str(s).replace("|", "\\|").replace("\n", " ")


def jd(x):
    return json.dumps(x, ensure_ascii=False)


def code_block(text, lang="json"):
    return ["```" + lang, text, "```"]


def req_md(method, path, body, status, text, note=None):
    out = [f"`{method} /api{path}`" + (f" — {note}" if note else "")]
    if body is not None:
        out.append("")
        out.append("body: `" + (body if isinstance(body, str) else jd(body)) + "`")
    out.append("")
    out.append(f"→ **{status}**" + (f" `{text}`" if text else " (empty body)"))
    out.append("")
    return out


def call_md(method, path, body=None, raw=None, note=None, pretty=False):
    status, j, text = http(method, path, body=body, raw=raw)
    if pretty and j is not None:
        md(f"`{method} /api{path}`" + (f" — {note}" if note else ""), "", f"→ **{status}**", "")
        md(*code_block(json.dumps(j, indent=2, ensure_ascii=False)))
        md("")
    else:
        md(*req_md(method, path, raw if raw is not None else body, status, text, note))
    return status, j, text


# ---------------------------------------------------------------- AMQP helpers
class Amqp:
    def __init__(self, vhost="/"):
        self.params = pika.ConnectionParameters(
            HOST, 5672, vhost, pika.PlainCredentials("guest", "guest"), heartbeat=0,
            blocked_connection_timeout=60)
        self.conn = pika.BlockingConnection(self.params)
        self._ch = None
        self._cch = None

    def ch(self):
        if self._ch is None or self._ch.is_closed:
            self._ch = self.conn.channel()
        return self._ch

    def cch(self):
        if self._cch is None or self._cch.is_closed:
            self._cch = self.conn.channel()
            self._cch.confirm_delivery()
        return self._cch

    def declare(self, name, qtype="classic", args=None):
        a = dict(args or {})
        if qtype == "quorum":
            a["x-queue-type"] = "quorum"
        self.ch().queue_declare(name, durable=True, arguments=a)

    def count(self, name):
        try:
            return self.ch().queue_declare(name, passive=True).method.message_count
        except pika.exceptions.ChannelClosedByBroker:
            self._ch = None
            return None

    def publish(self, queue, n, size=None, prefix="m", exchange=""):
        nacks = 0
        ch = self.cch()
        for i in range(n):
            body = f"{prefix}{i:03d}"
            if size:
                body = body.ljust(size, "x")
            try:
                ch.basic_publish(exchange, queue, body.encode())
            except pika.exceptions.NackError:
                nacks += 1
        return nacks

    def get(self, name, ack=True):
        m, props, body = self.ch().basic_get(name, auto_ack=False)
        if m is None:
            return None
        if ack:
            self.ch().basic_ack(m.delivery_tag)
        return m, props, body

    def purge(self, name):
        self.ch().queue_purge(name)

    def close(self):
        try:
            self.conn.close()
        except Exception:
            pass


def put_pol(kind, name, pattern, definition, apply_to="queues", priority=0, vhost="/"):
    body = {"pattern": pattern, "definition": definition, "apply-to": apply_to, "priority": priority}
    st, _, text = http("PUT", f"/{kind}/{qv(vhost)}/{qv(name)}", body)
    return st, text


def del_pol(kind, name, vhost="/"):
    return http("DELETE", f"/{kind}/{qv(vhost)}/{qv(name)}")[0]


def qinfo(name, vhost="/"):
    st, j, _ = http("GET", f"/queues/{qv(vhost)}/{qv(name)}")
    return j if st == 200 else None


def wait_stats(name, vhost="/", timeout=10):
    """The queue's JSON once it has the `policy` key (the management plugin adds the policy fields with
    the queue's first stats emission, up to collect_statistics_interval = 5 s after the declare)."""
    t0 = time.time()
    j = None
    while time.time() - t0 < timeout:
        j = qinfo(name, vhost)
        if j is not None and "policy" in j:
            return j
        time.sleep(0.1)
    return j or {}


def wait_qpol(name, pol, op, vhost="/", timeout=10):
    """Polls the queue's JSON until its policy / operator_policy are the expected ones."""
    t0 = time.time()
    j = None
    while time.time() - t0 < timeout:
        j = qinfo(name, vhost)
        if j is None:
            return None, None
        if "policy" in j and (j.get("policy") or None) == pol and (j.get("operator_policy") or None) == op:
            return j, round(time.time() - t0, 2)
        time.sleep(0.1)
    return j, None


def cleanup():
    for v in ("pt-match", "pt-other"):
        http("DELETE", f"/vhosts/{qv(v)}")
    for kind in ("policies", "operator-policies"):
        st, j, _ = http("GET", f"/{kind}/%2F")
        for p in (j or []):
            if p["name"].startswith("pt-"):
                del_pol(kind, p["name"])
    for what in ("queues", "exchanges"):
        st, j, _ = http("GET", f"/{what}/%2F")
        for x in (j or []):
            if x["name"].startswith("pt-"):
                http("DELETE", f"/{what}/%2F/{qv(x['name'])}")


# ---------------------------------------------------------------- 1 validation
BASE = {"pattern": "^pt-nomatch$", "definition": {"max-length": 1}, "apply-to": "queues", "priority": 0}


def without(k):
    b = dict(BASE)
    del b[k]
    return b


def with_(**kw):
    b = dict(BASE)
    for k, v in kw.items():
        b[k.replace("_", "-")] = v
    return b


def defn(d):
    b = dict(BASE)
    b["definition"] = d
    return b


GENERAL_CASES = [
    ("valid body", BASE),
    ("missing pattern", without("pattern")),
    ("pattern 5 (not a string)", with_(pattern=5)),
    ("pattern \"(\" (invalid regex)", with_(pattern="(")),
    ("pattern \"\" (empty)", with_(pattern="")),
    ("missing definition", without("definition")),
    ("definition {}", defn({})),
    ("definition \"x\"", defn("x")),
    ("definition []", defn([])),
    ("definition null", defn(None)),
    ("definition 5", defn(5)),
    ("missing apply-to", without("apply-to")),
    ("apply-to \"queues\"", with_(apply_to="queues")),
    ("apply-to \"exchanges\"", with_(apply_to="exchanges")),
    ("apply-to \"all\"", with_(apply_to="all")),
    ("apply-to \"classic_queues\"", with_(apply_to="classic_queues")),
    ("apply-to \"quorum_queues\"", with_(apply_to="quorum_queues")),
    ("apply-to \"streams\"", with_(apply_to="streams")),
    ("apply-to \"nonsense\"", with_(apply_to="nonsense")),
    ("apply-to 5", with_(apply_to=5)),
    ("missing priority", without("priority")),
    ("priority \"1\" (string)", with_(priority="1")),
    ("priority \"x\"", with_(priority="x")),
    ("priority -1", with_(priority=-1)),
    ("priority 1.5", with_(priority=1.5)),
    ("priority 1000000", with_(priority=1000000)),
    ("priority null", with_(priority=None)),
    ("extra field \"vhost\":\"other\"", with_(vhost="other")),
    ("extra field \"name\":\"other\"", with_(name="other")),
    ("extra unknown top-level field \"foo\":1", with_(foo=1)),
]

KEY_CASES = [
    {"message-ttl": 1000}, {"message-ttl": 0}, {"message-ttl": "x"}, {"message-ttl": -1},
    {"message-ttl": 1.5}, {"message-ttl": "1000"}, {"message-ttl": True},
    {"expires": 1000}, {"expires": 1}, {"expires": 0}, {"expires": -1}, {"expires": "x"},
    {"max-length": 10}, {"max-length": 0}, {"max-length": -1}, {"max-length": "x"},
    {"max-length-bytes": 1000}, {"max-length-bytes": 0}, {"max-length-bytes": -1}, {"max-length-bytes": "x"},
    {"overflow": "drop-head"}, {"overflow": "reject-publish"}, {"overflow": "reject-publish-dlx"},
    {"overflow": "bogus"}, {"overflow": 5},
    {"dead-letter-exchange": "dlx"}, {"dead-letter-exchange": ""}, {"dead-letter-exchange": 5},
    {"dead-letter-routing-key": "rk"}, {"dead-letter-routing-key": 5},
    {"dead-letter-exchange": "dlx", "dead-letter-routing-key": "rk"},
    {"dead-letter-strategy": "at-least-once"}, {"dead-letter-strategy": "at-most-once"},
    {"dead-letter-strategy": "bogus"},
    {"delivery-limit": 3}, {"delivery-limit": 0}, {"delivery-limit": -1}, {"delivery-limit": "x"},
    {"queue-leader-locator": "client-local"}, {"queue-leader-locator": "balanced"},
    {"queue-leader-locator": "bogus"}, {"queue-master-locator": "min-masters"},
    {"ha-mode": "all"}, {"ha-mode": "exactly"}, {"ha-mode": "exactly", "ha-params": 2},
    {"ha-mode": "bogus"}, {"ha-mode": "all", "ha-sync-mode": "automatic"},
    {"queue-mode": "lazy"}, {"queue-mode": "default"}, {"queue-mode": "bogus"},
    {"queue-version": 2}, {"queue-version": 3},
    {"alternate-exchange": "ae"}, {"alternate-exchange": 5},
    {"max-in-memory-length": 10}, {"max-in-memory-bytes": 1000},
    {"max-age": "1D"}, {"stream-max-segment-size-bytes": 1000000}, {"initial-cluster-size": 3},
    {"bogus-key": 1},
    {"max-length": 10, "bogus-key": 1},
    {"message-ttl": "x", "max-length": -1},
]


def section1():
    md("## 1. Validation of PUT /api/policies/{vhost}/{name} and /api/operator-policies/{vhost}/{name}", "")
    md("Every case is a PUT of a new name (`pt-v<kind><n>`) in vhost `/`; a policy that was created is "
       "read back (`GET`, column *stored as*) and deleted before the next case.", "")
    md(f"Base body (cases change one thing): `{jd(BASE)}`", "")
    rec = RECORD.setdefault("1", {})
    cases = [(lbl, b) for lbl, b in GENERAL_CASES] + [("definition " + jd(d), defn(d)) for d in KEY_CASES]
    for kind in ("policies", "operator-policies"):
        md(f"### 1.{'a' if kind == 'policies' else 'b'} `/api/{kind}`", "")
        md("| # | case | request body | status | response body | stored as (GET) |", "|---|---|---|---|---|---|")
        rows = []
        for i, (lbl, body) in enumerate(cases):
            name = f"pt-v{'p' if kind == 'policies' else 'o'}{i}"
            path = f"/{kind}/%2F/{name}"
            st, j, text = http("PUT", path, body)
            stored = ""
            if st in (201, 204):
                _, gj, gtext = http("GET", path)
                stored = gtext
                del_pol(kind, name)
            rows.append({"case": lbl, "body": body, "status": st, "response": text, "stored": stored})
            md(f"| {i} | {cell(lbl)} | `{cell(jd(body))}` | {st} | {('`' + cell(text) + '`') if text else '(empty)'} | "
               f"{('`' + cell(stored) + '`') if stored else ''} |")
        rec[kind] = rows
        md("")
        # lifecycle: create, update, get, delete, missing things
        md(f"#### Life cycle and error paths (`/api/{kind}`)", "")
        nm = f"pt-life-{'p' if kind == 'policies' else 'o'}"
        life = []
        for method, path, body, raw in [
            ("PUT", f"/{kind}/%2F/{nm}", BASE, None),
            ("PUT", f"/{kind}/%2F/{nm}", with_(priority=5), None),
            ("GET", f"/{kind}/%2F/{nm}", None, None),
            ("DELETE", f"/{kind}/%2F/{nm}", None, None),
            ("DELETE", f"/{kind}/%2F/{nm}", None, None),
            ("GET", f"/{kind}/%2F/{nm}", None, None),
            ("GET", f"/{kind}/no-such-vhost", None, None),
            ("GET", f"/{kind}/no-such-vhost/x", None, None),
            ("PUT", f"/{kind}/no-such-vhost/{nm}", BASE, None),
            ("PUT", f"/{kind}/%2F/{nm}", None, "not json"),
            ("PUT", f"/{kind}/%2F/{nm}", None, ""),
            ("PUT", f"/{kind}/%2F/{nm}", None, "[]"),
        ]:
            st, j, text = call_md(method, path, body=body, raw=raw)
            life.append({"method": method, "path": path, "body": body if raw is None else raw,
                         "status": st, "response": text})
        del_pol(kind, nm)
        rec[kind + "-life"] = life


# ---------------------------------------------------------------- 2 GET shapes
def section2(amqp):
    md("## 2. GET shapes", "")
    http("PUT", "/vhosts/pt-other", {})
    http("PUT", "/permissions/pt-other/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    setup = [
        ("policies", "/", "pt-shape-pol", {"pattern": "^pt-shape-(both|pol)-", "apply-to": "queues", "priority": 3,
                                           "definition": {"max-length": 100, "message-ttl": 60000}}),
        ("policies", "/", "pt-shape-ex", {"pattern": "^pt-shape-ex", "apply-to": "exchanges", "priority": 0,
                                          "definition": {"alternate-exchange": "pt-ae"}}),
        ("operator-policies", "/", "pt-shape-op", {"pattern": "^pt-shape-(both|op)-", "apply-to": "queues",
                                                   "priority": 2, "definition": {"max-length": 50, "expires": 3600000}}),
        ("policies", "pt-other", "pt-other-pol", {"pattern": ".*", "apply-to": "all", "priority": 0,
                                                  "definition": {"max-length-bytes": 1000000}}),
        ("operator-policies", "pt-other", "pt-other-op", {"pattern": ".*", "apply-to": "queues", "priority": 0,
                                                          "definition": {"message-ttl": 1000000}}),
    ]
    md("Set up:", "")
    for kind, v, name, body in setup:
        call_md("PUT", f"/{kind}/{qv(v)}/{name}", body)
    queues = [("pt-shape-both-classic", "classic"), ("pt-shape-both-quorum", "quorum"),
              ("pt-shape-pol-classic", "classic"), ("pt-shape-pol-quorum", "quorum"),
              ("pt-shape-op-classic", "classic"), ("pt-shape-op-quorum", "quorum"),
              ("pt-shape-none-classic", "classic")]
    for q, t in queues:
        amqp.declare(q, t)
    amqp.ch().exchange_declare("pt-shape-ex1", "direct", durable=True)
    amqp.ch().exchange_declare("pt-shapeless", "direct", durable=True)
    md("Queues declared over AMQP (durable): " + ", ".join(f"`{q}` ({t})" for q, t in queues) +
       "; exchanges `pt-shape-ex1` (matched by `pt-shape-ex`) and `pt-shapeless` (not matched).", "")
    time.sleep(7)  # let the management stats arrive (5 s interval)
    rec = RECORD.setdefault("2", {})
    for path in ["/policies", "/policies/%2F", "/policies/%2F/pt-shape-pol", "/policies/pt-other",
                 "/operator-policies", "/operator-policies/%2F", "/operator-policies/%2F/pt-shape-op",
                 "/operator-policies/pt-other"]:
        st, j, text = call_md("GET", path, pretty=True)
        rec[path] = {"status": st, "body": j}
    md("### Queue JSON", "")
    md("Full JSON of `/api/queues/%2F/pt-shape-both-classic` and `.../pt-shape-both-quorum` "
       "(matched by `pt-shape-pol` and by `pt-shape-op`):", "")
    for q in ("pt-shape-both-classic", "pt-shape-both-quorum"):
        st, j, text = call_md("GET", f"/queues/%2F/{q}", pretty=True)
        rec[q] = j
    md("The policy fields of every queue (from `GET /api/queues/%2F/{name}`; *absent* = no such key):", "")
    md("| queue | type | `policy` | `operator_policy` | `effective_policy_definition` |", "|---|---|---|---|---|")
    rows = {}
    for q, t in queues:
        j = qinfo(q) or {}
        f = {k: (jd(j[k]) if k in j else "absent") for k in ("policy", "operator_policy", "effective_policy_definition")}
        rows[q] = f
        md(f"| {q} | {t} | `{cell(f['policy'])}` | `{cell(f['operator_policy'])}` | `{cell(f['effective_policy_definition'])}` |")
    md("")
    rec["queue-fields"] = rows
    st, lst, _ = http("GET", "/queues/%2F")
    ent = next((x for x in lst if x["name"] == "pt-shape-both-classic"), {})
    md("In the list `GET /api/queues/%2F` the same queue's entry has: " +
       ", ".join(f"`{k}`: `{cell(jd(ent.get(k, 'absent')))}`" for k in ("policy", "operator_policy",
                                                                       "effective_policy_definition")), "")
    rec["queue-list-entry"] = {k: ent.get(k, "absent") for k in ("policy", "operator_policy", "effective_policy_definition")}
    md("### Exchange JSON", "")
    for x in ("pt-shape-ex1", "pt-shapeless"):
        st, j, text = call_md("GET", f"/exchanges/%2F/{x}", pretty=True)
        rec[x] = j
    http("DELETE", "/vhosts/pt-other")
    for kind, v, name, body in setup:
        if v == "/":
            del_pol(kind, name)
    for q, t in queues:
        http("DELETE", f"/queues/%2F/{q}")
    for x in ("pt-shape-ex1", "pt-shapeless"):
        http("DELETE", f"/exchanges/%2F/{x}")


# ---------------------------------------------------------------- 3 matching
def section3():
    md("## 3. Matching", "")
    md("All in a fresh vhost `pt-match` (so that pattern `q` matches nothing else).", "")
    V = "pt-match"
    http("PUT", f"/vhosts/{V}", {})
    http("PUT", f"/permissions/{V}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    a = Amqp(V)
    rec = RECORD.setdefault("3", {})

    def pol(name, pattern, definition, apply_to="queues", priority=0, kind="policies"):
        st, text = put_pol(kind, name, pattern, definition, apply_to, priority, V)
        md(f"- `PUT /api/{kind}/{V}/{name}` `{cell(jd({'pattern': pattern, 'definition': definition, 'apply-to': apply_to, 'priority': priority}))}` → {st}")
        return st

    def limit(q):
        """The max-length in force right now, seen over AMQP: purge, publish 20, count."""
        a.purge(q)
        a.publish(q, 20)
        n = a.count(q)
        return n if n < 20 else None

    def show_q(q, stale=False):
        """Reads the queue's policy fields; for a queue that existed before the policy change, waits
        for the next stats emission (stale=True)."""
        n = limit(q)
        if stale:
            time.sleep(5.5)
        j = wait_stats(q, V)
        r = {k: j.get(k, "absent") for k in ("policy", "operator_policy", "effective_policy_definition")}
        r["max-length in force (AMQP)"] = n
        md(f"- queue `{q}`: " + ", ".join(f"`{k}`=`{cell(jd(v))}`" for k, v in r.items()))
        return r

    md("### 3.1 Priorities 1 and 2 on the same queue", "")
    md("`pt-lo` sets max-length 7, `pt-hi` max-length 8; *max-length in force* = ready count after "
       "purging and publishing 20 messages.", "")
    pol("pt-lo", "^prio", {"max-length": 7}, priority=1)
    pol("pt-hi", "^prio", {"max-length": 8}, priority=2)
    a.declare("prio-1")
    rec["prio, lo first"] = show_q("prio-1")
    http("DELETE", f"/policies/{V}/pt-lo")
    http("DELETE", f"/policies/{V}/pt-hi")
    md("- both deleted, then created again in the other order:")
    pol("pt-hi", "^prio", {"max-length": 8}, priority=2)
    pol("pt-lo", "^prio", {"max-length": 7}, priority=1)
    a.declare("prio-2")
    rec["prio, hi first"] = show_q("prio-2")
    rec["prio-1 after recreation"] = show_q("prio-1", stale=True)
    md("- `pt-hi` changed to priority 0 (PUT again):")
    pol("pt-hi", "^prio", {"max-length": 8}, priority=0)
    rec["prio-1 after hi lowered"] = show_q("prio-1", stale=True)
    http("DELETE", f"/policies/{V}/pt-lo")
    http("DELETE", f"/policies/{V}/pt-hi")
    md("")

    md("### 3.2 Equal priorities, names `a` and `b`", "")
    md("Each trial: delete both, create them in the given order (both pattern `^eq`, priority 0, "
       "`a` = max-length 1, `b` = max-length 2), declare a new queue `eq-<n>`; then the max-length in "
       "force (AMQP) on that queue and on the queues of the earlier trials (1 ⇒ `a`, 2 ⇒ `b`), and the new "
       "queue's `policy` field.", "")
    trials = []
    existing = []
    for t, order in enumerate(["ab", "ba", "ab", "ba", "ab", "ba"]):
        http("DELETE", f"/policies/{V}/a")
        http("DELETE", f"/policies/{V}/b")
        for n in order:
            put_pol("policies", n, "^eq", {"max-length": 1 if n == "a" else 2}, "queues", 0, V)
        qn = f"eq-{t}"
        a.declare(qn)
        existing.append(qn)
        got = {q: {1: "a", 2: "b"}.get(limit(q), "?") for q in existing}
        field = wait_stats(qn, V).get("policy", "absent")
        trials.append({"order": order, "new": got[qn], "field": field, "all": got})
        md(f"- trial {t}: created `{order[0]}` then `{order[1]}` → `{qn}` in force `{got[qn]}`, `policy` field "
           f"`{field}`; all queues in force: `{jd(got)}`")
    rec["equal"] = trials
    http("DELETE", f"/policies/{V}/a")
    http("DELETE", f"/policies/{V}/b")
    md("", "Other name pairs (pattern `^eqx`, priority 0; the first name = max-length 3, the second 4):", "")
    extra = []
    for t, (n1, n2) in enumerate([("y", "z"), ("z", "y"), ("b", "a"), ("a", "b"), ("pt-b", "pt-a"), ("pt-a", "pt-b")]):
        put_pol("policies", n1, "^eqx", {"max-length": 3}, "queues", 0, V)
        put_pol("policies", n2, "^eqx", {"max-length": 4}, "queues", 0, V)
        qn = f"eqx-{t}"
        a.declare(qn)
        n = limit(qn)
        p = {3: n1, 4: n2}.get(n, "?")
        field = wait_stats(qn, V).get("policy", "absent")
        extra.append({"order": n1 + "," + n2, "in force": p, "field": field})
        md(f"- created `{n1}` then `{n2}` → `{qn}` in force `{p}`, `policy` field `{field}`")
        for x in (n1, n2):
            http("DELETE", f"/policies/{V}/{x}")
    rec["equal-extra"] = extra
    md("")

    md("### 3.3 apply-to", "")
    pol("pt-ex", "^apx", {"alternate-exchange": "ae"}, apply_to="exchanges")
    a.declare("apx-q")
    a.ch().exchange_declare("apx-x", "direct")
    rec["exchanges policy on queue"] = show_q("apx-q")
    time.sleep(0.3)
    xj = http("GET", f"/exchanges/{V}/apx-x")[1]
    md(f"- exchange `apx-x`: `policy`=`{jd(xj.get('policy', 'absent'))}`")
    rec["exchanges policy on exchange"] = xj.get("policy", "absent")
    http("DELETE", f"/policies/{V}/pt-ex")
    md("", "A higher-priority `exchanges` policy does not hide a lower-priority `queues` policy:", "")
    pol("pt-shadow-ex", "^shadow", {"alternate-exchange": "ae"}, apply_to="exchanges", priority=10)
    pol("pt-shadow-q", "^shadow", {"max-length": 4}, apply_to="queues", priority=0)
    a.declare("shadow-q")
    a.ch().exchange_declare("shadow-x", "direct")
    rec["shadow queue"] = show_q("shadow-q")
    xj = http("GET", f"/exchanges/{V}/shadow-x")[1]
    md(f"- exchange `shadow-x`: `policy`=`{jd(xj.get('policy', 'absent'))}`")
    rec["shadow exchange"] = xj.get("policy", "absent")
    md("", "A queues policy with priority 10 and an `all` policy with priority 0 on a queue and an exchange:", "")
    pol("pt-all", "^both", {"max-length": 5}, apply_to="all", priority=0)
    pol("pt-q10", "^both", {"max-length": 6}, apply_to="queues", priority=10)
    a.declare("both-q")
    a.ch().exchange_declare("both-x", "direct")
    rec["all queue"] = show_q("both-q")
    xj = http("GET", f"/exchanges/{V}/both-x")[1]
    md(f"- exchange `both-x`: `policy`=`{jd(xj.get('policy', 'absent'))}`")
    rec["all exchange"] = xj.get("policy", "absent")
    for n in ("pt-shadow-ex", "pt-shadow-q", "pt-all", "pt-q10"):
        http("DELETE", f"/policies/{V}/{n}")
    md("", "The same with the priorities swapped (`all` priority 10, `queues` priority 0):", "")
    pol("pt-all10", "^swap", {"max-length": 5}, apply_to="all", priority=10)
    pol("pt-q0", "^swap", {"max-length": 6}, apply_to="queues", priority=0)
    a.declare("swap-q")
    rec["all10 queue"] = show_q("swap-q")
    for n in ("pt-all10", "pt-q0"):
        http("DELETE", f"/policies/{V}/{n}")
    md("")
    md("Operator policy with apply-to `exchanges` / `all` (if accepted), on a queue and an exchange:", "")
    st1 = pol("pt-op-ex", "^opx", {"max-length": 5}, apply_to="exchanges", kind="operator-policies")
    a.declare("opx-q")
    a.ch().exchange_declare("opx-x", "direct")
    rec["op exchanges on queue"] = show_q("opx-q")
    xj = http("GET", f"/exchanges/{V}/opx-x")[1]
    md(f"- exchange `opx-x`: `policy`=`{jd(xj.get('policy', 'absent'))}`, `operator_policy`=`{jd(xj.get('operator_policy', 'absent'))}`")
    http("DELETE", f"/operator-policies/{V}/pt-op-ex")
    st2 = pol("pt-op-all", "^opall", {"max-length": 5}, apply_to="all", kind="operator-policies")
    a.declare("opall-q")
    rec["op all on queue"] = show_q("opall-q")
    http("DELETE", f"/operator-policies/{V}/pt-op-all")
    md("")

    md("### 3.4 The pattern is a regex search, unanchored", "")
    pol("pt-unanch", "q", {"max-length": 9})
    res = {}
    for qn in ("aqb", "q", "AQB", "xyz"):
        a.declare(qn)
        res[qn] = show_q(qn)
    rec["unanchored"] = res
    http("DELETE", f"/policies/{V}/pt-unanch")
    pol("pt-case", "(?i)^aq", {"max-length": 9})
    res = show_q("AQB", stale=True)
    rec["(?i)"] = res
    http("DELETE", f"/policies/{V}/pt-case")
    md("")
    md("### 3.5 A policy with a key the queue type does not support does not match that queue", "")
    md("Two policies on the same pattern: the higher-priority one (priority 1) has max-length 5 plus the key "
       "under test, the other (priority 0) max-length 7 only. Declared afterwards: a classic and a quorum queue. "
       "*in force* = ready count after publishing 20.", "")
    unsup = []
    for i, (extra, kind) in enumerate([
            ({"delivery-limit": 2}, "policies"), ({"queue-leader-locator": "client-local"}, "policies"),
            ({"dead-letter-strategy": "at-least-once"}, "policies"), ({"queue-mode": "lazy"}, "policies"),
            ({"ha-mode": "all"}, "policies"), ({"queue-master-locator": "min-masters"}, "policies"),
            ({"queue-version": 2}, "policies"), ({"message-ttl": 60000}, "policies"),
            ({"max-in-memory-length": 100}, "policies"), ({"delivery-limit": 2}, "operator-policies")]):
        d = {"max-length": 5, **extra}
        st = pol(f"pt-u{i}-hi", f"^u{i}-", d, priority=1, kind=kind)
        pol(f"pt-u{i}-lo", f"^u{i}-", {"max-length": 7}, priority=0, kind=kind)
        row = {"extra": extra, "kind": kind, "put": st}
        for t in ("classic", "quorum"):
            qn = f"u{i}-{t}"
            a.declare(qn, t)
            r = show_q(qn)
            row[t] = {"in force": r["max-length in force (AMQP)"],
                      "field": r["operator_policy" if kind == "operator-policies" else "policy"]}
        unsup.append(row)
        http("DELETE", f"/{kind}/{V}/pt-u{i}-hi")
        http("DELETE", f"/{kind}/{V}/pt-u{i}-lo")
    rec["unsupported"] = unsup
    md("", "| kind | extra key in the priority-1 policy | classic: applied (max-length in force) | quorum: applied (max-length in force) |",
       "|---|---|---|---|")
    for row in unsup:
        md(f"| {row['kind']} | `{cell(jd(row['extra']))}` | `{row['classic']['field']}` ({row['classic']['in force']}) | "
           f"`{row['quorum']['field']}` ({row['quorum']['in force']}) |")
    md("")
    a.close()
    http("DELETE", f"/vhosts/{V}")


# ---------------------------------------------------------------- 4 effective values
NUMERIC = {
    # key: (small, mid, large)
    "max-length": (5, 10, 20),
    "max-length-bytes": (500, 1000, 2000),
    "message-ttl": (1000, 3000, 6000),
    "expires": (2000, 5000, 9000),
    "delivery-limit": (1, 2, 4),
}
NUM_COMBOS = [  # (arg, policy, operator policy) as indexes into (small, mid, large); None = not set
    (None, 1, None), (None, None, 1), (1, None, None),
    (1, 0, None), (1, 2, None),
    (1, None, 0), (1, None, 2),
    (None, 1, 0), (None, 1, 2),
    (0, 1, 2), (2, 0, 1), (1, 2, 0),
]


class Case:
    def __init__(self, key, qtype, arg, pol, op, idx, extra_args=None):
        self.key, self.qtype, self.arg, self.pol, self.op = key, qtype, arg, pol, op
        self.q = f"pt-eff-{key}-{qtype[0]}-{idx}"
        self.extra_args = extra_args or {}
        self.notes = []
        self.ok = True
        self.obs = None
        self.eff_def = None

    def setup(self, amqp, pol_def=None):
        pat = "^" + self.q + "$"
        if self.pol is not None:
            st, text = put_pol("policies", "pt-p-" + self.q, pat, pol_def or {self.key: self.pol})
            if st not in (201, 204):
                self.ok = False
                self.notes.append(f"policy PUT {st} {text}")
        if self.op is not None:
            st, text = put_pol("operator-policies", "pt-o-" + self.q, pat, {self.key: self.op})
            if st not in (201, 204):
                self.ok = False
                self.notes.append(f"operator policy PUT {st} {text}")
        if not self.ok:
            return False
        args = dict(self.extra_args)
        if self.arg is not None:
            args["x-" + self.key] = self.arg
        self.t_declared = time.time()
        try:
            amqp.declare(self.q, self.qtype, args)
        except pika.exceptions.AMQPError as e:
            self.ok = False
            self.notes.append(f"queue.declare failed: {e!r}")
            return False
        time.sleep(0.1)
        return True

    def fetch_def(self, timeout=10):
        """Reads the queue's policy fields from the management API (they lag by up to 5 s)."""
        if not self.ok or self.eff_def is not None:
            return
        j, took = wait_qpol(self.q, ("pt-p-" + self.q) if self.pol is not None else None,
                            ("pt-o-" + self.q) if self.op is not None else None, timeout=timeout)
        if j is None:
            return
        if took is None:
            self.notes.append("policy fields not as expected: " + jd({k: j.get(k, "absent") for k in ("policy", "operator_policy")}))
        else:
            self.eff_def = j.get("effective_policy_definition")

    def teardown(self):
        http("DELETE", f"/queues/%2F/{qv(self.q)}")
        del_pol("policies", "pt-p-" + self.q)
        del_pol("operator-policies", "pt-o-" + self.q)


def winner(cands, eff):
    srcs = [s for s, v in cands.items() if v == eff]
    return "+".join(srcs) if srcs else f"none ({eff})"


# quorum queues check expiry on the Ra tick (quorum_tick_interval, 5 s): candidates further apart
QUORUM_EXPIRES = (2000, 12000, 25000)


def candidates(key, qtype):
    return QUORUM_EXPIRES if (key, qtype) == ("expires", "quorum") else NUMERIC[key]


def numeric_cases(key, qtype):
    sml = candidates(key, qtype)
    out = []
    for i, (a, p, o) in enumerate(NUM_COMBOS):
        c = Case(key, qtype, None if a is None else sml[a], None if p is None else sml[p],
                 None if o is None else sml[o], i)
        out.append(c)
    return out


def run_count_cases(amqp, key, qtype):
    cases = numeric_cases(key, qtype)
    for c in cases:
        if not c.setup(amqp):
            continue
        if key == "max-length":
            nacks = amqp.publish(c.q, 30)
            time.sleep(0.5)
            n = amqp.count(c.q)
            c.obs = f"published 30, {n} ready"
            c.eff = n
        else:
            nacks = amqp.publish(c.q, 30, size=100)
            time.sleep(0.5)
            n = amqp.count(c.q)
            c.obs = f"published 30 x 100 B, {n} ready"
            c.eff = n * 100
        if nacks:
            c.obs += f" ({nacks} nacked)"
    for c in cases:
        c.fetch_def()
    for c in cases:
        c.teardown()
    return cases


def run_ttl_cases(amqp, qtype):
    cases = numeric_cases("message-ttl", qtype)
    t0 = {}
    for c in cases:
        if c.setup(amqp):
            amqp.publish(c.q, 5)
            t0[c.q] = time.time()
    gone = {}
    end = time.time() + 12
    while time.time() < end and len(gone) < len(t0):
        for c in cases:
            if c.q in t0 and c.q not in gone:
                n = amqp.count(c.q)
                if n == 0:
                    gone[c.q] = time.time() - t0[c.q]
        time.sleep(0.2)
    for c in cases:
        if c.q not in t0:
            continue
        if c.q in gone:
            el = gone[c.q]
            c.obs = f"5 messages, all gone after {el:.1f} s"
            cands = [v for v in NUMERIC["message-ttl"]]
            # the effective TTL: the largest candidate not above the time they went
            below = [v for v in cands if v / 1000 <= el + 0.05]
            c.eff = max(below) if below else None
        else:
            c.obs = f"5 messages, {amqp.count(c.q)} still ready after 12 s"
            c.eff = None
    for c in cases:
        c.fetch_def()
    for c in cases:
        c.teardown()
    return cases


def run_expires_cases(amqp, qtype):
    cases = numeric_cases("expires", qtype)
    t0 = {}
    for c in cases:
        if c.setup(amqp):
            t0[c.q] = c.t_declared  # the policies were set before the declare
    gone = {}
    end = time.time() + (35 if qtype == "quorum" else 15)
    while time.time() < end and len(gone) < len(t0):
        for c in cases:
            if c.q in t0 and c.q not in gone:
                st, j, _ = http("GET", f"/queues/%2F/{qv(c.q)}")
                if st == 404:
                    gone[c.q] = time.time() - t0[c.q]
                elif "policy" in j and c.eff_def is None:
                    c.eff_def = j.get("effective_policy_definition")
        time.sleep(0.2)
    for c in cases:
        if c.q not in t0:
            continue
        if c.eff_def is None:
            c.notes.append("gone before the management API showed its policy fields")
        if c.q in gone:
            el = gone[c.q]
            c.obs = f"queue gone {el:.1f} s after its declare"
            below = [v for v in candidates("expires", qtype) if v / 1000 <= el + 0.3]
            c.eff = max(below) if below else None
        else:
            c.obs = "queue still there at the end of the wait"
            c.eff = None
    for c in cases:
        c.fetch_def()
    for c in cases:
        c.teardown()
    return cases


def run_delivery_limit_cases(amqp, qtype):
    cases = numeric_cases("delivery-limit", qtype)
    for c in cases:
        if not c.setup(amqp):
            continue
        amqp.publish(c.q, 1)
        time.sleep(0.2)
        deliveries = 0
        last_count = None
        for _ in range(10):
            m, props, body = amqp.ch().basic_get(c.q, auto_ack=False)
            if m is None:
                time.sleep(0.3)
                m, props, body = amqp.ch().basic_get(c.q, auto_ack=False)
                if m is None:
                    break
            deliveries += 1
            last_count = (props.headers or {}).get("x-delivery-count")
            amqp.ch().basic_nack(m.delivery_tag, requeue=True)
            time.sleep(0.1)
        left = amqp.count(c.q)
        c.obs = f"1 message: delivered {deliveries} times (last x-delivery-count {last_count}), then {left} ready"
        c.eff = deliveries - 1 if left == 0 else None
    for c in cases:
        c.fetch_def()
    for c in cases:
        c.teardown()
    return cases


def case_rows(cases, unit=""):
    rows = []
    for c in cases:
        cands = {k: v for k, v in (("argument", c.arg), ("policy", c.pol), ("operator policy", c.op)) if v is not None}
        eff = getattr(c, "eff", None)
        w = winner(cands, eff) if c.ok and eff is not None else ("—" if not c.ok else "none (limit not applied)")
        rows.append({"queue": c.q, "type": c.qtype, "arg": c.arg, "policy": c.pol, "op": c.op,
                     "observed": c.obs, "effective": eff, "winner": w, "min": min(cands.values()) if cands else None,
                     "effective_policy_definition": c.eff_def, "notes": c.notes})
    return rows


def rows_md(rows):
    md("| type | `x-` argument | policy | operator policy | observed | effective | from | `effective_policy_definition` | notes |",
       "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        md(f"| {r['type']} | {'' if r['arg'] is None else r['arg']} | {'' if r['policy'] is None else r['policy']} | "
           f"{'' if r['op'] is None else r['op']} | {cell(r['observed'] or '')} | "
           f"{'' if r['effective'] is None else r['effective']} | {r['winner']} | `{cell(jd(r['effective_policy_definition']))}` | "
           f"{cell('; '.join(r['notes']))} |")
    md("")


def rule_of(rows):
    rs = [r for r in rows if r["winner"] != "—"]
    if not rs:
        return "not accepted"
    if all(r["effective"] is None for r in rs):
        return "not applied at all"
    if all(r["effective"] == r["min"] for r in rs):
        return "smallest wins"

    def pol_first(r):
        ps = [v for v in (r["policy"], r["op"]) if v is not None]
        return min(ps) if ps else r["arg"]
    if all(r["effective"] == pol_first(r) for r in rs):
        return "policy wins over the argument (policy vs operator policy: smallest)"
    return "see rows"


def section4(amqp):
    md("## 4. Effective values: queue argument vs policy vs operator policy", "")
    md("Each row is its own queue `pt-eff-<key>-<c|q>-<n>` (durable; classic or quorum) with its own policy "
       "`pt-p-<queue>` and/or operator policy `pt-o-<queue>` (pattern `^<queue>$`, priority 0, apply-to queues), "
       "both set *before* the queue is declared with the `x-` argument. *from* names the source(s) whose value "
       "equals the observed effective value.", "")
    rec = RECORD.setdefault("4", {})
    summary = {}
    for key in ("max-length", "max-length-bytes", "message-ttl", "expires", "delivery-limit"):
        md(f"### {key}", "")
        if key == "max-length":
            md("Publish 30 messages (publisher confirms), wait 0.5 s, count the ready messages (queue.declare passive).", "")
        elif key == "max-length-bytes":
            md("Publish 30 messages of 100 bytes (confirms), wait 0.5 s, count ready; effective = count × 100.", "")
        elif key == "message-ttl":
            md("All queues set up at once; publish 5 messages into each, then poll the ready count every 0.2 s "
               "until 0 (max 12 s). Candidate TTLs 1000 / 3000 / 6000 ms; effective = the largest candidate not "
               "above the time the messages went.", "")
        elif key == "expires":
            md("All queues set up at once, nothing consumes; poll `GET /api/queues/%2F/<q>` every 0.2 s until 404 "
               "(max 15 s classic, 35 s quorum). Candidates 2000 / 5000 / 9000 ms for classic queues; for quorum "
               "queues 2000 / 12000 / 25000 ms, because a quorum queue checks its expiry on the Ra tick "
               "(every 5 s), so it goes up to ~5 s late. Effective = the largest candidate not above the time "
               "the queue went.", "")
        else:
            md("Publish 1 message; loop basic.get + basic.nack(requeue) until the queue is empty (max 10); "
               "effective limit = deliveries − 1.", "")
        for qtype in ("classic", "quorum"):
            if key in ("max-length", "max-length-bytes"):
                cases = run_count_cases(amqp, key, qtype)
            elif key == "message-ttl":
                cases = run_ttl_cases(amqp, qtype)
            elif key == "expires":
                cases = run_expires_cases(amqp, qtype)
            else:
                cases = run_delivery_limit_cases(amqp, qtype)
            rows = case_rows(cases)
            rec[f"{key}/{qtype}"] = rows
            summary[(key, qtype)] = rule_of(rows)
            rows_md(rows)
    # ---- non-numeric keys
    for key in ("overflow", "dead-letter-exchange", "dead-letter-routing-key"):
        md(f"### {key}", "")
        for qtype in ("classic", "quorum"):
            rows = run_symbolic(amqp, key, qtype)
            rec[f"{key}/{qtype}"] = rows
            summary[(key, qtype)] = symbolic_rule(rows)
    md("### Summary (automatic)", "")
    md("| key | classic | quorum |", "|---|---|---|")
    for key in ("max-length", "max-length-bytes", "message-ttl", "expires", "delivery-limit",
                "overflow", "dead-letter-exchange", "dead-letter-routing-key"):
        md(f"| {key} | {summary[(key, 'classic')]} | {summary[(key, 'quorum')]} |")
    md("")
    RECORD["4-summary"] = {f"{k}/{t}": v for (k, t), v in summary.items()}


def symbolic_rule(rows):
    both = [r for r in rows if r["arg"] is not None and r["policy"] is not None and r["ok"]]
    if not both:
        return "n/a"
    ws = {r["winner"] for r in both}
    return "; ".join(sorted(ws)) + " wins" if len(ws) == 1 else "mixed: " + ", ".join(sorted(ws))


def run_symbolic(amqp, key, qtype):
    ch = amqp.ch()
    rows = []
    if key == "overflow":
        md(f"{qtype}: every queue has `x-max-length` 3; publish 6 messages `m000`..`m005` with confirms; "
           "count nacks and ready messages, and basic.get the head. drop-head ⇒ 0 nacks, head `m003`; "
           "reject-publish ⇒ nacks, head `m000`.", "")
        combos = [("reject-publish", "drop-head", None), ("drop-head", "reject-publish", None),
                  (None, "reject-publish", None), ("reject-publish", None, None), (None, None, "reject-publish")]
        if qtype == "classic":
            combos += [("reject-publish-dlx", "drop-head", None), ("drop-head", "reject-publish-dlx", None)]
        for i, (a, p, o) in enumerate(combos):
            c = Case(key, qtype, a, p, o, i, extra_args={"x-max-length": 3})
            r = {"type": qtype, "arg": a, "policy": p, "op": o, "ok": True}
            if not c.setup(amqp):
                r.update(ok=False, observed="; ".join(c.notes), winner="—")
                rows.append(r)
                c.teardown()
                continue
            nacks = amqp.publish(c.q, 6)
            time.sleep(0.3)
            n = amqp.count(c.q)
            g = amqp.get(c.q)
            head = g[2].decode() if g else None
            behaviour = "drop-head" if nacks == 0 and head == "m003" else (
                "reject" if nacks and head == "m000" else "?")
            w = []
            for s, v in (("argument", a), ("policy", p), ("operator policy", o)):
                if v is not None and (v == behaviour or (behaviour == "reject" and v.startswith("reject"))):
                    w.append(s)
            c.fetch_def()
            r.update(observed=f"{nacks} nacked, {n} ready, head {head}", behaviour=behaviour,
                     winner="+".join(w) or "?", effective_policy_definition=c.eff_def)
            rows.append(r)
            c.teardown()
    else:
        # dead-lettering by basic.get + basic.reject(requeue=false)
        for x in ("pt-dlx-arg", "pt-dlx-pol", "pt-dlx-op"):
            ch.exchange_declare(x, "fanout", durable=True)
            ch.queue_declare(x + "-q", durable=True)
            ch.queue_bind(x + "-q", x)
        ch.exchange_declare("pt-dlx-direct", "direct", durable=True)
        for rk in ("rk-arg", "rk-pol", "rk-op", "orig"):
            ch.queue_declare("pt-rk-" + rk, durable=True)
        for rk in ("rk-arg", "rk-pol", "rk-op"):
            ch.queue_bind("pt-rk-" + rk, "pt-dlx-direct", rk)
        if key == "dead-letter-exchange":
            md(f"{qtype}: fanout exchanges `pt-dlx-arg`, `pt-dlx-pol`, `pt-dlx-op`, each bound to queue `<exchange>-q`; "
               "publish 1 message, basic.get, basic.reject(requeue=false), wait 0.5 s, count the three queues.", "")
            combos = [("pt-dlx-arg", "pt-dlx-pol", None), (None, "pt-dlx-pol", None), ("pt-dlx-arg", None, None),
                      (None, None, "pt-dlx-op"), ("pt-dlx-arg", None, "pt-dlx-op")]
            targets = {"pt-dlx-arg-q": "argument", "pt-dlx-pol-q": "policy", "pt-dlx-op-q": "operator policy"}
        else:
            md(f"{qtype}: every queue has `x-dead-letter-exchange` `pt-dlx-direct` (direct), bound to queues "
               "`pt-rk-rk-arg`/`pt-rk-rk-pol`/`pt-rk-rk-op` with keys `rk-arg`/`rk-pol`/`rk-op` (no binding for the "
               "original key); publish 1, basic.get, reject(requeue=false), count.", "")
            combos = [("rk-arg", "rk-pol", None), (None, "rk-pol", None), ("rk-arg", None, None),
                      (None, None, "rk-op")]
            targets = {"pt-rk-rk-arg": "argument", "pt-rk-rk-pol": "policy", "pt-rk-rk-op": "operator policy"}
        for i, (a, p, o) in enumerate(combos):
            extra = {"x-dead-letter-exchange": "pt-dlx-direct"} if key == "dead-letter-routing-key" else {}
            c = Case(key, qtype, a, p, o, i, extra_args=extra)
            r = {"type": qtype, "arg": a, "policy": p, "op": o, "ok": True}
            if not c.setup(amqp):
                r.update(ok=False, observed="; ".join(c.notes), winner="—")
                rows.append(r)
                c.teardown()
                continue
            for t in targets:
                amqp.purge(t)
            amqp.publish(c.q, 1)
            time.sleep(0.2)
            g = amqp.ch().basic_get(c.q, auto_ack=False)
            if g[0] is not None:
                amqp.ch().basic_reject(g[0].delivery_tag, requeue=False)
            time.sleep(0.5)
            counts = {t: amqp.count(t) for t in targets}
            w = [targets[t] for t, n in counts.items() if n]
            c.fetch_def()
            r.update(observed="dead-lettered into " + (", ".join(t for t, n in counts.items() if n) or "nothing"),
                     winner="+".join(w) or "none", effective_policy_definition=c.eff_def)
            rows.append(r)
            c.teardown()
        # also: dlx and routing key both from a policy, no arguments
        if key == "dead-letter-routing-key":
            c = Case(key, qtype, None, "rk-pol", None, 9)
            c.setup(amqp, pol_def={"dead-letter-exchange": "pt-dlx-direct", "dead-letter-routing-key": "rk-pol"})
            for t in targets:
                amqp.purge(t)
            amqp.publish(c.q, 1)
            time.sleep(0.2)
            g = amqp.ch().basic_get(c.q, auto_ack=False)
            amqp.ch().basic_reject(g[0].delivery_tag, requeue=False)
            time.sleep(0.5)
            counts = {t: amqp.count(t) for t in targets}
            c.fetch_def()
            rows.append({"type": qtype, "arg": None, "policy": "dlx pt-dlx-direct + rk-pol", "op": None, "ok": True,
                         "observed": "dead-lettered into " + (", ".join(t for t, n in counts.items() if n) or "nothing"),
                         "winner": "+".join(targets[t] for t, n in counts.items() if n) or "none",
                         "effective_policy_definition": c.eff_def})
            c.teardown()
    md("| type | `x-` argument | policy | operator policy | observed | from | `effective_policy_definition` |",
       "|---|---|---|---|---|---|---|")
    for r in rows:
        md(f"| {r['type']} | {r['arg'] or ''} | {r['policy'] or ''} | {r['op'] or ''} | {cell(r['observed'])} | "
           f"{r['winner']} | `{cell(jd(r.get('effective_policy_definition')))}` |")
    md("")
    return rows


# ---------------------------------------------------------------- 5 applied at once
def section5(amqp):
    md("## 5. A policy set on queues that already hold messages", "")
    rec = RECORD.setdefault("5", {})
    for kind, pname in (("policies", "pt-apply-ml"), ("operator-policies", "pt-apply-ml-op")):
        md(f"### 5.{'1' if kind == 'policies' else '2'} max-length 10 by {'a policy' if kind == 'policies' else 'an operator policy'}", "")
        qs = [(f"pt-apply-{kind[0]}-classic", "classic"), (f"pt-apply-{kind[0]}-quorum", "quorum")]
        for q, t in qs:
            amqp.declare(q, t)
            amqp.publish(q, 100)
        time.sleep(0.5)
        before = {q: amqp.count(q) for q, _ in qs}
        body = {"pattern": f"^pt-apply-{kind[0]}-", "definition": {"max-length": 10}, "apply-to": "queues", "priority": 0}
        md(f"Queues {', '.join(f'`{q}` ({t})' for q, t in qs)} declared without arguments, 100 messages each "
           f"(ready: `{jd(before)}`). Then:", "")
        t0 = time.time()
        st, _, text = call_md("PUT", f"/{kind}/%2F/{pname}", body)
        series = []
        for at in (0.05, 0.2, 0.5, 1, 2, 5):
            while time.time() - t0 < at:
                time.sleep(0.01)
            series.append({"t": at, **{q: amqp.count(q) for q, _ in qs}})
        md("Ready counts after the PUT returned (seconds):", "")
        md("| t (s) | " + " | ".join(q for q, _ in qs) + " |", "|---|" + "---|" * len(qs))
        for s in series:
            md(f"| {s['t']} | " + " | ".join(str(s[q]) for q, _ in qs) + " |")
        md("")
        head = {}
        for q, _ in qs:
            g = amqp.get(q, ack=False)
            head[q] = g[2].decode() if g else None
            if g:
                amqp.ch().basic_nack(g[0].delivery_tag, requeue=True)
        md(f"Head message of each queue now (which ones were kept): `{jd(head)}`", "")
        call_md("DELETE", f"/{kind}/%2F/{pname}")
        time.sleep(1)
        for q, _ in qs:
            amqp.publish(q, 20, prefix="n")
        time.sleep(0.5)
        after = {q: amqp.count(q) for q, _ in qs}
        md(f"After the DELETE, 20 more published into each: ready `{jd(after)}`", "")
        rec[kind + "/max-length"] = {"before": before, "put": [st, text], "series": series, "head": head,
                                     "after-delete+20": after}
        for q, _ in qs:
            http("DELETE", f"/queues/%2F/{q}")

    md("### 5.3 message-ttl 1000 by a policy on queues with messages", "")
    qs = [("pt-ttl-classic", "classic"), ("pt-ttl-quorum", "quorum")]
    for q, t in qs:
        amqp.declare(q, t)
        amqp.publish(q, 10)
    time.sleep(0.5)
    before = {q: amqp.count(q) for q, _ in qs}
    md(f"Queues {', '.join(f'`{q}` ({t})' for q, t in qs)}, 10 messages each (ready `{jd(before)}`), then:", "")
    body = {"pattern": "^pt-ttl-", "definition": {"message-ttl": 1000}, "apply-to": "queues", "priority": 0}
    t0 = time.time()
    call_md("PUT", "/policies/%2F/pt-apply-ttl", body)
    series = []
    for at in (0.5, 1.5, 3, 6):
        while time.time() - t0 < at:
            time.sleep(0.01)
        series.append({"t": at, **{q: amqp.count(q) for q, _ in qs}})
    md("| t (s) after PUT | " + " | ".join(q for q, _ in qs) + " |", "|---|" + "---|" * len(qs))
    for s in series:
        md(f"| {s['t']} | " + " | ".join(str(s[q]) for q, _ in qs) + " |")
    md("")
    got = {}
    for q, _ in qs:
        g = amqp.get(q, ack=False)
        got[q] = g[2].decode() if g else None
        if g:
            amqp.ch().basic_nack(g[0].delivery_tag, requeue=True)
    md(f"basic.get on each at 6 s (then nack requeue): `{jd(got)}`", "")
    for q, _ in qs:
        amqp.purge(q)
        amqp.publish(q, 5, prefix="n")
    t1 = time.time()
    series2 = []
    for at in (0.3, 2.5):
        while time.time() - t1 < at:
            time.sleep(0.01)
        series2.append({"t": at, **{q: amqp.count(q) for q, _ in qs}})
    md(f"Purged, then 5 new messages published with the policy in force: ready `{jd(series2)}`", "")
    call_md("DELETE", "/policies/%2F/pt-apply-ttl")
    time.sleep(1)
    for q, _ in qs:
        amqp.publish(q, 5, prefix="k")
    time.sleep(2.5)
    after = {q: amqp.count(q) for q, _ in qs}
    md(f"After the DELETE, 5 more published, 2.5 s later ready: `{jd(after)}`", "")
    for q, _ in qs:
        amqp.purge(q)
    http("PUT", "/policies/%2F/pt-apply-ttl", {**body, "definition": {"message-ttl": 3000}})
    time.sleep(0.3)
    for q, _ in qs:
        amqp.publish(q, 5, prefix="t")
    time.sleep(0.3)
    http("DELETE", "/policies/%2F/pt-apply-ttl")
    time.sleep(4)
    kept = {q: amqp.count(q) for q, _ in qs}
    md("Purged; policy message-ttl 3000 set again, 5 messages published, policy deleted 0.3 s later; "
       f"4 s later ready: `{jd(kept)}` (0 = the messages kept the TTL they were published with)", "")
    rec["ttl-published-under-policy-then-deleted"] = kept
    rec["ttl"] = {"before": before, "series": series, "get-at-6s": got, "new-with-policy": series2,
                  "after-delete+5": after}
    for q, _ in qs:
        http("DELETE", f"/queues/%2F/{q}")


# ---------------------------------------------------------------- 6 definitions
def section6(amqp):
    md("## 6. Definitions export", "")
    put_pol("policies", "pt-def-pol", "^pt-def-", {"max-length": 10, "message-ttl": 5000}, "queues", 1)
    put_pol("operator-policies", "pt-def-op", "^pt-def-", {"max-length": 5}, "queues", 2)
    put_pol("policies", "pt-def-ex", "^pt-def-x", {"alternate-exchange": "ae"}, "exchanges", 0)
    md("With policies `pt-def-pol` (queues, priority 1, max-length 10 + message-ttl 5000), `pt-def-ex` (exchanges, "
       "alternate-exchange) and operator policy `pt-def-op` (queues, priority 2, max-length 5) in `/`:", "")
    rec = RECORD.setdefault("6", {})
    for path in ("/definitions", "/definitions/%2F"):
        st, j, text = http("GET", path)
        keys = list(j.keys())
        pols = [p for p in j.get("policies", []) if p.get("name", "").startswith("pt-")]
        md(f"`GET /api{path}` → **{st}**; top-level keys in order: `{jd(keys)}`; "
           f"`operator_policies` present: **{'operator_policies' in j}**", "")
        md("Its `policies` entries (ours):", "")
        md(*code_block(json.dumps(pols, indent=2, ensure_ascii=False)))
        i = text.find('"pt-def-')
        s = text.rfind("{", 0, i)
        md("", "Raw bytes around the first of them in the response: `" + cell(text[s:s + 260]) + "…`", "")
        params = [p for p in j.get("parameters", []) if p.get("name", "").startswith("pt-")]
        md("", "Its `parameters` entries (ours; the operator policy is here, component `operator_policy`):", "")
        md(*code_block(json.dumps(params, indent=2, ensure_ascii=False)))
        i = text.find('"component":"operator_policy","name":"pt-def-op"')
        s0 = text.rfind('{"value":', 0, i)
        md("", "Raw bytes of that entry: `" + cell(text[s0:text.find("}", i) + 1]) + "`", "")
        rec[path] = {"status": st, "keys": keys, "policies": pols, "parameters": params,
                     "operator_policies": j.get("operator_policies", "absent")}
        if "operator_policies" in j:
            md("`operator_policies`:", "")
            md(*code_block(json.dumps(j["operator_policies"], indent=2, ensure_ascii=False)))
    # import: are operator_policies read from a file?
    md("### Import", "")
    del_pol("policies", "pt-def-pol")
    del_pol("operator-policies", "pt-def-op")
    del_pol("policies", "pt-def-ex")
    imp = {"policies": [{"vhost": "/", "name": "pt-imp-pol", "pattern": "^pt-imp", "apply-to": "queues",
                         "definition": {"max-length": 3}, "priority": 0}],
           "operator_policies": [{"vhost": "/", "name": "pt-imp-op", "pattern": "^pt-imp", "apply-to": "queues",
                                  "definition": {"max-length": 2}, "priority": 0}]}
    call_md("POST", "/definitions", imp)
    st, j, text = call_md("GET", "/policies/%2F/pt-imp-pol")
    st2, j2, text2 = call_md("GET", "/operator-policies/%2F/pt-imp-op")
    rec["import"] = {"policy": [st, text], "operator_policy": [st2, text2]}
    md("An operator policy as a `parameters` entry (the export's form):", "")
    imp2 = {"parameters": [{"value": {"pattern": "^pt-imp", "definition": {"max-length": 2}, "priority": 0,
                                      "apply-to": "queues"},
                            "vhost": "/", "component": "operator_policy", "name": "pt-imp-op2"}]}
    call_md("POST", "/definitions", imp2)
    st4, j4, text4 = call_md("GET", "/operator-policies/%2F/pt-imp-op2")
    rec["import-as-parameter"] = [st4, text4]
    imp3 = {"parameters": [{"value": {"pattern": "^pt-imp", "definition": {"max-length": 4}, "priority": 0,
                                      "apply-to": "queues"},
                            "vhost": "/", "component": "policy", "name": "pt-imp-pol3"}]}
    call_md("POST", "/definitions", imp3, note="a policy as a `parameters` entry, component `policy`")
    st5, j5, text5 = call_md("GET", "/policies/%2F/pt-imp-pol3")
    rec["import-policy-as-parameter"] = [st5, text5]
    del_pol("operator-policies", "pt-imp-op2")
    del_pol("policies", "pt-imp-pol3")
    bad = {"policies": [{"vhost": "/", "name": "pt-imp-bad", "pattern": "^pt-imp", "apply-to": "queues",
                         "definition": {"max-length": "x"}, "priority": 0}]}
    st3, _, text3 = call_md("POST", "/definitions", bad, note="a bad policy in an import")
    rec["import-bad"] = [st3, text3]
    del_pol("policies", "pt-imp-pol")
    del_pol("operator-policies", "pt-imp-op")
    del_pol("policies", "pt-imp-bad")


def main():
    out_md = sys.argv[1] if len(sys.argv) > 1 else "/tmp/rabbitmq-3.10-policies.raw.md"
    out_json = sys.argv[2] if len(sys.argv) > 2 else "/tmp/rabbitmq-3.10-policies.raw.json"
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else ["1", "2", "3", "4", "5", "6"]
    st, ov, _ = http("GET", "/overview")
    md(f"RabbitMQ {ov['rabbitmq_version']}, Erlang {ov['erlang_version']}, management {ov.get('management_version')}; "
       f"recorded {time.strftime('%Y-%m-%d %H:%M:%S')} by tests/python/data/record_rabbitmq_policies.py.", "")
    RECORD["versions"] = {k: ov.get(k) for k in ("rabbitmq_version", "erlang_version", "management_version")}
    cleanup()
    amqp = Amqp()
    try:
        if "1" in only:
            section1()
        if "2" in only:
            section2(amqp)
        if "3" in only:
            section3()
        if "4" in only:
            section4(amqp)
        if "5" in only:
            section5(amqp)
        if "6" in only:
            section6(amqp)
    finally:
        with open(out_md, "w") as f:
            f.write("\n".join(MD) + "\n")
        with open(out_json, "w") as f:
            json.dump(RECORD, f, indent=1, default=str, ensure_ascii=False)
        amqp.close()
        cleanup()
    print("wrote", out_md, out_json)


if __name__ == "__main__":
    main()
