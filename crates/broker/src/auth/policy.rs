//! Policies and operator policies (`rabbitmqctl set_policy`, `set_operator_policy`): what one is
//! ([`PolicyDef`], checked as RabbitMQ 3.10 checks it), which one applies to a queue or an exchange
//! ([`best`]), and the queue arguments that result ([`apply`]). The rules, and the texts of the
//! refusals, are RabbitMQ 3.10.8's as recorded in tests/python/data/rabbitmq-3.10-policies.md
//! (security-plan.md, step 8). Not wired yet: the metadata ops, the API and the queues' use of
//! them come next (the plan's order of work).
//!
//! Where RabbitMQ answers 500 with an empty body (a definition or an `apply-to` of the wrong JSON
//! type), Warren answers 400 with a text; RabbitMQ's `/api/policies` HTML-escapes its reasons
//! (`&lt;&lt;"x"&gt;&gt;`), Warren does not (its `/api/operator-policies` does not either).

use crate::queue_args::{LeaderLocator, Overflow, QueueArgs, QueueType};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Number, Value};
use warren_protocol::field::FieldTable;

/// What a policy applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ApplyTo {
    #[serde(rename = "queues")]
    Queues,
    #[serde(rename = "exchanges")]
    Exchanges,
    #[serde(rename = "all")]
    All,
}

impl ApplyTo {
    pub fn as_str(self) -> &'static str {
        match self {
            ApplyTo::Queues => "queues",
            ApplyTo::Exchanges => "exchanges",
            ApplyTo::All => "all",
        }
    }
}

/// A regular policy, or an operator policy (which takes only limits, and of those the smaller).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Regular,
    Operator,
}

/// A policy as recorded, in RabbitMQ's shape (its GET answer and its definitions export).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyDef {
    pub vhost: String,
    pub name: String,
    pub pattern: String,
    #[serde(rename = "apply-to")]
    pub apply_to: ApplyTo,
    /// The keys and values as given (checked by [`check_definition`]).
    pub definition: Map<String, Value>,
    /// Any JSON number, kept as given (RabbitMQ takes -1 and 1.5).
    pub priority: Number,
}

/// The keys an operator policy takes (each limit: the smaller of it and the policy's applies).
pub const OPERATOR_KEYS: &[&str] = &["delivery-limit", "expires", "max-in-memory-bytes", "max-in-memory-length", "max-length", "max-length-bytes", "message-ttl"];

/// The keys a policy takes: RabbitMQ's, and Warren's `retention` (`x-retention-seconds`). Those
/// Warren does not act on (mirroring, streams, queue versions, in-memory limits) are kept and
/// exported, as real 3.x exports carry `ha-mode` policies.
pub const REGULAR_KEYS: &[&str] = &[
    "alternate-exchange",
    "dead-letter-exchange",
    "dead-letter-routing-key",
    "dead-letter-strategy",
    "delivery-limit",
    "expires",
    "federation-upstream",
    "federation-upstream-set",
    "ha-mode",
    "ha-params",
    "ha-promote-on-failure",
    "ha-promote-on-shutdown",
    "ha-sync-batch-size",
    "ha-sync-mode",
    "initial-cluster-size",
    "max-age",
    "max-in-memory-bytes",
    "max-in-memory-length",
    "max-length",
    "max-length-bytes",
    "message-ttl",
    "overflow",
    "queue-leader-locator",
    "queue-master-locator",
    "queue-mode",
    "queue-version",
    "retention",
    "stream-max-segment-size-bytes",
];

/// Keys a classic queue lacks: a policy holding one does not match a classic queue (RabbitMQ
/// 3.10's `capabilities()`); the next policy by priority does.
const NOT_FOR_CLASSIC: &[&str] = &["dead-letter-strategy", "delivery-limit", "initial-cluster-size", "max-age", "queue-leader-locator", "stream-max-segment-size-bytes"];
/// Keys a quorum queue lacks, likewise.
const NOT_FOR_QUORUM: &[&str] = &[
    "ha-mode",
    "ha-params",
    "ha-promote-on-failure",
    "ha-promote-on-shutdown",
    "ha-sync-mode",
    "initial-cluster-size",
    "max-age",
    "max-priority",
    "queue-master-locator",
    "queue-mode",
    "single-active-consumer",
    "stream-max-segment-size-bytes",
];

/// A refusal of a policy: RabbitMQ's reason text (the API answers 400 with it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

fn validation_failed(message: impl std::fmt::Display) -> Invalid {
    Invalid(format!("Validation failed\n\n{message}\n"))
}

/// A JSON value as RabbitMQ prints the Erlang term it decoded it to (`<<"x">>` for a string).
fn term(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("<<\"{s}\">>"),
        Value::Array(items) => format!("[{}]", items.iter().map(term).collect::<Vec<_>>().join(",")),
        Value::Object(map) => format!("[{}]", map.iter().map(|(k, v)| format!("{{<<\"{k}\">>,{}}}", term(v))).collect::<Vec<_>>().join(",")),
    }
}

impl PolicyDef {
    /// A policy from the body of `PUT /api/policies/{vhost}/{name}` (or `operator-policies`): the
    /// path names it; `apply-to` defaults to `all`, `priority` to 0.
    pub fn from_body(vhost: &str, name: &str, body: &Value, kind: Kind) -> Result<PolicyDef, Invalid> {
        let missing: Vec<&str> = ["pattern", "definition"].into_iter().filter(|k| body.get(*k).is_none()).collect();
        if !missing.is_empty() {
            return Err(Invalid(format!("[{}]", missing.iter().map(|k| format!("{{key_missing,{k}}}")).collect::<Vec<_>>().join(","))));
        }
        let pattern = match &body["pattern"] {
            Value::String(s) => s.clone(),
            other => return Err(validation_failed(format_args!("pattern should be a binary but was {}", term(other)))),
        };
        if let Err(e) = super::defs::compile("policy", &pattern) {
            return Err(validation_failed(format_args!("pattern should be regular expression but is invalid: {e}")));
        }
        let apply_to = match body.get("apply-to") {
            None | Some(Value::Null) => ApplyTo::All,
            Some(Value::String(s)) => match s.as_str() {
                "queues" => ApplyTo::Queues,
                "exchanges" => ApplyTo::Exchanges,
                "all" => ApplyTo::All,
                other => return Err(validation_failed(format_args!("apply-to '{other}' unrecognised; should be 'queues', 'exchanges' or 'all'"))),
            },
            Some(other) => return Err(validation_failed(format_args!("apply-to should be 'queues', 'exchanges' or 'all', not {}", term(other)))),
        };
        let priority = match body.get("priority") {
            None => Number::from(0),
            Some(Value::Number(n)) => n.clone(),
            Some(other) => return Err(validation_failed(format_args!("priority should be a number, actually was {}", term(other)))),
        };
        let definition = match &body["definition"] {
            Value::Object(map) => map.clone(),
            other => return Err(validation_failed(format_args!("definition should be a JSON object of policy settings, not {}", term(other)))),
        };
        check_definition(&definition, kind)?;
        Ok(PolicyDef { vhost: vhost.to_owned(), name: name.to_owned(), pattern, apply_to, definition, priority })
    }

    /// Whether it may apply to `object` at all: its `apply-to`, and no key the object's kind lacks.
    pub fn fits(&self, object: Object) -> bool {
        let lacking: &[&str] = match object {
            Object::Exchange => return self.apply_to != ApplyTo::Queues,
            Object::Queue(QueueType::Classic) => NOT_FOR_CLASSIC,
            Object::Queue(QueueType::Quorum) => NOT_FOR_QUORUM,
        };
        self.apply_to != ApplyTo::Exchanges && !self.definition.keys().any(|k| lacking.contains(&k.as_str()))
    }
}

/// Checks a definition as RabbitMQ does: not empty; unknown keys first, all named; then the first
/// bad value, in key order.
pub fn check_definition(definition: &Map<String, Value>, kind: Kind) -> Result<(), Invalid> {
    if definition.is_empty() {
        return Err(validation_failed("no policy provided"));
    }
    let known = match kind {
        Kind::Regular => REGULAR_KEYS,
        Kind::Operator => OPERATOR_KEYS,
    };
    let unknown: Vec<String> = definition.iter().filter(|(k, _)| !known.contains(&k.as_str())).map(|(k, v)| format!("{{<<\"{k}\">>,{}}}", term(v))).collect();
    if !unknown.is_empty() {
        return Err(validation_failed(format_args!("[{}] are not recognised policy settings", unknown.join(","))));
    }
    let mut keys: Vec<&String> = definition.keys().collect();
    keys.sort();
    for key in keys {
        check_value(key, &definition[key.as_str()], definition)?;
    }
    Ok(())
}

fn whole(v: &Value, min: u64) -> bool {
    v.as_u64().is_some_and(|n| n >= min)
}

fn check_value(key: &str, v: &Value, definition: &Map<String, Value>) -> Result<(), Invalid> {
    let bad = |what: &str| Err(validation_failed(format_args!("{} is not a valid {what}", term(v))));
    let one_of = |allowed: &[&str]| v.as_str().is_some_and(|s| allowed.contains(&s));
    match key {
        "message-ttl" if !whole(v, 0) => bad("message TTL"),
        "expires" if !whole(v, 1) => bad("queue expiry"),
        "max-length" if !whole(v, 0) => bad("maximum length"),
        "max-length-bytes" if !whole(v, 0) => bad("maximum length in bytes"),
        "delivery-limit" if !whole(v, 0) => bad("delivery limit"),
        "retention" if !whole(v, 0) => bad("retention (seconds)"),
        "max-in-memory-length" if !whole(v, 0) => bad("maximum memory length"),
        "max-in-memory-bytes" if !whole(v, 0) => bad("maximum memory in bytes"),
        "overflow" if !one_of(&["drop-head", "reject-publish", "reject-publish-dlx"]) => bad("overflow value"),
        "dead-letter-exchange" if !v.is_string() => bad("dead letter exchange name"),
        "dead-letter-routing-key" if !v.is_string() => bad("dead letter routing key"),
        "dead-letter-strategy" if !one_of(&["at-most-once", "at-least-once"]) => bad("dead letter strategy"),
        "alternate-exchange" if !v.is_string() => bad("alternate exchange name"),
        "queue-leader-locator" if !one_of(&["client-local", "balanced", "random", "least-leaders"]) => bad("queue leader locator value"),
        "queue-mode" if !one_of(&["default", "lazy"]) => Err(validation_failed(format_args!("{} is not a valid queue-mode value", term(v)))),
        "queue-version" if !(v.as_u64() == Some(1) || v.as_u64() == Some(2)) => Err(validation_failed(format_args!("{} is not a valid queue-version value", term(v)))),
        "ha-mode" => match v.as_str() {
            Some("all") => Ok(()),
            Some(mode @ ("exactly" | "nodes")) if definition.get("ha-params").is_none() => {
                let takes = if mode == "exactly" { "an integer" } else { "a list" };
                Err(validation_failed(format_args!("ha-mode=\"{mode}\" takes {takes}, none given")))
            }
            Some("exactly" | "nodes") => Ok(()),
            _ => Err(validation_failed(format_args!("{} is not a valid ha-mode value", term(v)))),
        },
        _ => Ok(()),
    }
}

/// What a policy is matched against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Object {
    Queue(QueueType),
    Exchange,
}

/// A policy with its pattern compiled (once, when the broker's view is rebuilt).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub def: PolicyDef,
    pattern: regex::Regex,
}

impl Compiled {
    /// None if the pattern does not compile (a checked policy's always does).
    pub fn new(def: PolicyDef) -> Option<Compiled> {
        let pattern = super::defs::compile("policy", &def.pattern).ok()?;
        Some(Compiled { def, pattern })
    }

    /// Whether it applies to the object `name` of kind `object` (in its vhost: the caller's).
    pub fn matches(&self, name: &str, object: Object) -> bool {
        self.def.fits(object) && self.pattern.is_match(name)
    }
}

/// The policy that applies to `name` among `policies` (one vhost's, of one kind): the highest
/// priority of those that match. RabbitMQ breaks ties by its table's order (in effect a hash);
/// Warren takes the first name, so every node picks the same one.
pub fn best<'a>(policies: impl IntoIterator<Item = &'a Compiled>, name: &str, object: Object) -> Option<&'a Compiled> {
    let priority = |c: &Compiled| c.def.priority.as_f64().unwrap_or(0.0);
    policies.into_iter().filter(|c| c.matches(name, object)).fold(None, |chosen: Option<&Compiled>, c| match chosen {
        Some(b) if priority(b) > priority(c) || (priority(b) == priority(c) && b.def.name <= c.def.name) => Some(b),
        _ => Some(c),
    })
}

/// The definition a queue shows as `effective_policy_definition`: the policy's, with each key of
/// the operator policy merged in (the smaller value where both have it).
pub fn merged(policy: Option<&PolicyDef>, operator: Option<&PolicyDef>) -> Map<String, Value> {
    let mut out = policy.map(|p| p.definition.clone()).unwrap_or_default();
    for (k, v) in operator.map(|o| &o.definition).into_iter().flatten() {
        let smaller = match (out.get(k).and_then(Value::as_u64), v.as_u64()) {
            (Some(ours), Some(theirs)) if ours <= theirs => continue,
            _ => v.clone(),
        };
        out.insert(k.clone(), smaller);
    }
    out
}

/// `args` (parsed from the queue's declared `arguments`) with a merged definition applied, as
/// RabbitMQ 3.10 resolves each key against the queue's own argument: limits and TTLs the smaller;
/// a quorum queue's `expires` and `overflow` the policy's; a classic queue's `overflow`, and the
/// dead-letter exchange and routing key on both, the argument's if given; `retention` and the
/// leader locator the argument's if given.
pub fn apply(args: &QueueArgs, arguments: &FieldTable, definition: &Map<String, Value>) -> QueueArgs {
    let mut out = args.clone();
    let quorum = args.queue_type == QueueType::Quorum;
    let given = |arg: &str| arguments.get(arg).is_some();
    let number = |key: &str| definition.get(key).and_then(Value::as_u64);
    let text = |key: &str| definition.get(key).and_then(Value::as_str).map(str::to_owned);
    let smaller = |ours: Option<u64>, policy: Option<u64>| match (ours, policy) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    out.max_length = smaller(args.max_length, number("max-length"));
    out.max_length_bytes = smaller(args.max_length_bytes, number("max-length-bytes"));
    out.message_ttl_ms = smaller(args.message_ttl_ms, number("message-ttl"));
    out.expires_ms = if quorum { number("expires").or(args.expires_ms) } else { smaller(args.expires_ms, number("expires")) };
    if quorum {
        if let Some(limit) = number("delivery-limit") {
            let ours = args.delivery_limit.flatten().map(u64::from);
            out.delivery_limit = Some(Some(smaller(ours, Some(limit)).map_or(u32::MAX, |n| n.min(u32::MAX as u64) as u32)));
        }
    }
    let overflow = text("overflow").and_then(|o| match o.as_str() {
        "drop-head" => Some(Overflow::DropHead),
        "reject-publish" => Some(Overflow::RejectPublish),
        "reject-publish-dlx" => Some(Overflow::RejectPublishDlx),
        _ => None,
    });
    if let Some(o) = overflow.filter(|_| quorum || !given("x-overflow")) {
        out.overflow = o;
    }
    if !given("x-dead-letter-exchange") {
        if let Some(dlx) = text("dead-letter-exchange") {
            out.dead_letter_exchange = Some(dlx);
        }
    }
    if !given("x-dead-letter-routing-key") {
        if let Some(key) = text("dead-letter-routing-key") {
            out.dead_letter_routing_key = Some(key);
        }
    }
    if !given("x-retention-seconds") {
        if let Some(seconds) = number("retention") {
            out.retention_ms = seconds.saturating_mul(1000);
        }
    }
    if args.leader_locator.is_none() {
        out.leader_locator = text("queue-leader-locator").map(|l| if l == "client-local" { LeaderLocator::ClientLocal } else { LeaderLocator::Balanced });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use warren_protocol::field::FieldValue;

    fn body(definition: Value) -> Value {
        json!({"pattern": "^pt-nomatch$", "definition": definition, "apply-to": "queues", "priority": 0})
    }

    fn refusal(b: Value, kind: Kind) -> String {
        PolicyDef::from_body("/", "p", &b, kind).unwrap_err().0
    }

    #[test]
    fn refusals_are_rabbitmqs() {
        // The texts as RabbitMQ 3.10.8 answered them (tests/python/data/rabbitmq-3.10-policies.md, 1.a).
        assert_eq!(refusal(json!({"definition": {"max-length": 1}}), Kind::Regular), "[{key_missing,pattern}]");
        assert_eq!(refusal(json!({}), Kind::Regular), "[{key_missing,pattern},{key_missing,definition}]");
        assert_eq!(refusal(json!({"pattern": 5, "definition": {"max-length": 1}}), Kind::Regular), "Validation failed\n\npattern should be a binary but was 5\n");
        assert_eq!(refusal(body(json!({})), Kind::Regular), "Validation failed\n\nno policy provided\n");
        assert_eq!(
            refusal(json!({"pattern": "x", "definition": {"max-length": 1}, "apply-to": "classic_queues"}), Kind::Regular),
            "Validation failed\n\napply-to 'classic_queues' unrecognised; should be 'queues', 'exchanges' or 'all'\n"
        );
        assert_eq!(refusal(json!({"pattern": "x", "definition": {"max-length": 1}, "priority": "1"}), Kind::Regular), "Validation failed\n\npriority should be a number, actually was <<\"1\">>\n");
        assert_eq!(refusal(body(json!({"bogus-key": 1})), Kind::Regular), "Validation failed\n\n[{<<\"bogus-key\">>,1}] are not recognised policy settings\n");
        assert_eq!(refusal(body(json!({"message-ttl": "x", "max-length": -1})), Kind::Regular), "Validation failed\n\n-1 is not a valid maximum length\n");
        assert_eq!(refusal(body(json!({"expires": 0})), Kind::Regular), "Validation failed\n\n0 is not a valid queue expiry\n");
        assert_eq!(refusal(body(json!({"overflow": "bogus"})), Kind::Regular), "Validation failed\n\n<<\"bogus\">> is not a valid overflow value\n");
        assert_eq!(refusal(body(json!({"dead-letter-exchange": 5})), Kind::Regular), "Validation failed\n\n5 is not a valid dead letter exchange name\n");
        assert_eq!(refusal(body(json!({"ha-mode": "exactly"})), Kind::Regular), "Validation failed\n\nha-mode=\"exactly\" takes an integer, none given\n");
        assert_eq!(
            refusal(body(json!({"dead-letter-exchange": "dlx"})), Kind::Operator),
            "Validation failed\n\n[{<<\"dead-letter-exchange\">>,<<\"dlx\">>}] are not recognised policy settings\n"
        );
        // Where RabbitMQ answers 500 with nothing, a text a person can act on.
        assert!(refusal(json!({"pattern": "x", "definition": "x"}), Kind::Regular).contains("definition should be a JSON object"));
    }

    #[test]
    fn defaults_and_what_is_kept() {
        let p = PolicyDef::from_body("/", "p", &json!({"pattern": "", "definition": {"ha-mode": "all", "max-length": 3}, "priority": 1.5}), Kind::Regular).unwrap();
        assert_eq!((p.apply_to, p.priority.as_f64()), (ApplyTo::All, Some(1.5)));
        assert_eq!(serde_json::to_value(&p).unwrap()["apply-to"], "all");
        assert!(PolicyDef::from_body("/", "p", &body(json!({"max-length": 3, "expires": 1000, "delivery-limit": 2})), Kind::Operator).is_ok());
    }

    fn compiled(name: &str, pattern: &str, apply_to: &str, priority: i64, definition: Value) -> Compiled {
        let b = json!({"pattern": pattern, "definition": definition, "apply-to": apply_to, "priority": priority});
        Compiled::new(PolicyDef::from_body("/", name, &b, Kind::Regular).unwrap()).unwrap()
    }

    #[test]
    fn the_highest_priority_that_fits_applies() {
        let classic = Object::Queue(QueueType::Classic);
        let quorum = Object::Queue(QueueType::Quorum);
        let low = compiled("low", "q", "queues", 0, json!({"max-length": 1}));
        let high = compiled("high", "^aq", "all", 5, json!({"max-length": 2}));
        let exchanges = compiled("ex", ".*", "exchanges", 10, json!({"alternate-exchange": "ae"}));
        let limit = compiled("limit", ".*", "queues", 9, json!({"delivery-limit": 3}));
        let all = [low.clone(), high.clone(), exchanges.clone(), limit.clone()];
        // Unanchored; apply-to before priority; a key the type lacks skips the policy.
        assert_eq!(best(&all, "aqb", classic).map(|c| c.def.name.as_str()), Some("high"));
        assert_eq!(best(&all, "xqz", classic).map(|c| c.def.name.as_str()), Some("low"));
        assert_eq!(best(&all, "aqb", quorum).map(|c| c.def.name.as_str()), Some("limit"));
        assert_eq!(best(&all, "AQB", classic).map(|c| c.def.name.as_str()), None);
        assert_eq!(best(&all, "aqb", Object::Exchange).map(|c| c.def.name.as_str()), Some("ex"));
        // A tie: the first name, whatever the order given.
        let (a, b) = (compiled("a", ".*", "queues", 1, json!({"max-length": 1})), compiled("b", ".*", "queues", 1, json!({"max-length": 2})));
        assert_eq!(best([&b, &a], "q", classic).map(|c| c.def.name.as_str()), Some("a"));
        assert_eq!(best([&a, &b], "q", classic).map(|c| c.def.name.as_str()), Some("a"));
    }

    fn args_of(table: &[(&str, FieldValue)]) -> (QueueArgs, FieldTable) {
        let mut t = FieldTable::new();
        for (k, v) in table {
            t.insert((*k).into(), v.clone());
        }
        (QueueArgs::parse("q", "/", &t).unwrap(), t)
    }

    #[test]
    fn the_merge_is_rabbitmqs_per_key_and_queue_type() {
        let long = |n: i64| FieldValue::I64(n);
        let text = |s: &str| FieldValue::LongString(s.as_bytes().to_vec().into());
        let quorum_type = ("x-queue-type", text("quorum"));
        let definition = |v: Value| v.as_object().cloned().unwrap();
        // Limits and TTL: the smaller, both types.
        for quorum in [false, true] {
            let mut table = vec![("x-max-length", long(10)), ("x-message-ttl", long(5000))];
            if quorum {
                table.push(quorum_type.clone());
            }
            let (args, t) = args_of(&table);
            let out = apply(&args, &t, &definition(json!({"max-length": 5, "message-ttl": 9000, "max-length-bytes": 100})));
            assert_eq!((out.max_length, out.message_ttl_ms, out.max_length_bytes), (Some(5), Some(5000), Some(100)));
        }
        // expires: the smaller on classic, the policy's on quorum.
        let (args, t) = args_of(&[("x-expires", long(12000))]);
        assert_eq!(apply(&args, &t, &definition(json!({"expires": 25000}))).expires_ms, Some(12000));
        let (args, t) = args_of(&[("x-expires", long(12000)), quorum_type.clone()]);
        assert_eq!(apply(&args, &t, &definition(json!({"expires": 25000}))).expires_ms, Some(25000));
        // overflow: the argument's on classic, the policy's on quorum.
        let (args, t) = args_of(&[("x-overflow", text("reject-publish"))]);
        assert_eq!(apply(&args, &t, &definition(json!({"overflow": "drop-head"}))).overflow, Overflow::RejectPublish);
        let (args, t) = args_of(&[("x-overflow", text("reject-publish")), quorum_type.clone()]);
        assert_eq!(apply(&args, &t, &definition(json!({"overflow": "drop-head"}))).overflow, Overflow::DropHead);
        // The dead-letter exchange: the argument's on both; the policy's without one.
        let (args, t) = args_of(&[("x-dead-letter-exchange", text("mine")), quorum_type.clone()]);
        assert_eq!(apply(&args, &t, &definition(json!({"dead-letter-exchange": "theirs"}))).dead_letter_exchange.as_deref(), Some("mine"));
        let (args, t) = args_of(&[]);
        assert_eq!(apply(&args, &t, &definition(json!({"dead-letter-exchange": "theirs"}))).dead_letter_exchange.as_deref(), Some("theirs"));
        // delivery-limit: quorum only, the smaller.
        let (args, t) = args_of(&[("x-delivery-limit", long(10)), quorum_type]);
        assert_eq!(apply(&args, &t, &definition(json!({"delivery-limit": 3}))).delivery_limit, Some(Some(3)));
    }

    #[test]
    fn an_operator_policy_merges_in_the_smaller_limits() {
        let p = PolicyDef::from_body("/", "p", &body(json!({"max-length": 10, "dead-letter-exchange": "dlx"})), Kind::Regular).unwrap();
        let o = PolicyDef::from_body("/", "o", &body(json!({"max-length": 5, "message-ttl": 100})), Kind::Operator).unwrap();
        assert_eq!(Value::Object(merged(Some(&p), Some(&o))), json!({"max-length": 5, "dead-letter-exchange": "dlx", "message-ttl": 100}));
        let o = PolicyDef::from_body("/", "o", &body(json!({"max-length": 50})), Kind::Operator).unwrap();
        assert_eq!(merged(Some(&p), Some(&o))["max-length"], 10);
        assert_eq!(Value::Object(merged(None, None)), json!({}));
    }
}
