//! Queue arguments (`x-*`) as RabbitMQ validates them at queue.declare.
//!
//! Every `x-` argument is either supported (listed in [`SUPPORTED`]) or refused with 406
//! PRECONDITION_FAILED naming it: a client that asks for a behaviour Warren does not have must not
//! be left believing it got it. Arguments without the `x-` prefix are the application's own and are
//! kept as given, as RabbitMQ does.

use crate::error::{BrokerError, Result};
use warren_protocol::field::{FieldTable, FieldValue};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overflow {
    #[default]
    DropHead,
    RejectPublish,
    /// Reject the publish and dead-letter the rejected message.
    RejectPublishDlx,
}

/// `x-dead-letter-strategy` (quorum queues).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeadLetterStrategy {
    /// A dead letter leaves the queue when it is dead-lettered; its re-publish is not confirmed.
    #[default]
    AtMostOnce,
    /// A dead letter stays in the queue until its target holds it (with `x-overflow:
    /// reject-publish`; otherwise at-most-once, as RabbitMQ).
    AtLeastOnce,
}

/// `x-queue-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    /// One node's queue (the default).
    #[default]
    Classic,
    /// Replicated by its own Raft group (`crate::queue::quorum`).
    Quorum,
}

/// `x-queue-leader-locator` (or the older `x-queue-master-locator`): which node first leads a quorum
/// queue's group in a cluster, as RabbitMQ's `queue_leader_locator`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LeaderLocator {
    /// The node the declaring client is connected to (RabbitMQ's default).
    #[default]
    ClientLocal,
    /// Spread over the members by the queue's id (RabbitMQ's `balanced`; its older `random`,
    /// `least-leaders` and `min-masters` mean the same here).
    Balanced,
}

#[derive(Debug, Clone, Default)]
pub struct QueueArgs {
    /// `x-queue-type`.
    pub queue_type: QueueType,
    /// `x-delivery-limit` (quorum queues): a message returned more than this many times is
    /// dead-lettered or dropped. None: the default (20, as RabbitMQ 4); Some(None): unlimited (-1).
    pub delivery_limit: Option<Option<u32>>,
    /// `x-quorum-initial-group-size` (quorum queues): how many nodes replicate it (default 3, at most
    /// the cluster's size).
    pub quorum_initial_group_size: Option<u32>,
    pub message_ttl_ms: Option<u64>,
    pub expires_ms: Option<u64>,
    pub max_length: Option<u64>,
    pub max_length_bytes: Option<u64>,
    pub overflow: Overflow,
    pub dead_letter_exchange: Option<String>,
    pub dead_letter_routing_key: Option<String>,
    /// `x-dead-letter-strategy`.
    pub dead_letter_strategy: DeadLetterStrategy,
    /// `x-retention-seconds`: keep consumed messages on disk this long after they were enqueued, so the
    /// queue can later be rewound to a point in time (Warren's own argument; 0 or absent: no retention).
    pub retention_ms: u64,
    /// `x-single-active-consumer`: one consumer receives at a time (see `consumers`).
    pub single_active_consumer: bool,
    /// `x-consumer-timeout`: this queue's delivery acknowledgement timeout in ms, instead of the node's
    /// `consumer-timeout` (see `Channel::ack_timed_out`).
    pub consumer_timeout_ms: Option<u64>,
    /// `x-max-priority`: 1..255 makes a priority queue (see `lane`); 0 (or absent) a classic one.
    pub max_priority: u8,
    /// `x-queue-leader-locator`, else `x-queue-master-locator`; None: neither given.
    pub leader_locator: Option<LeaderLocator>,
}

/// The `x-` queue arguments Warren accepts. `x-queue-mode` changes nothing and is accepted so that
/// clients written for RabbitMQ work unchanged (every Warren queue already keeps only a bounded window
/// in memory and pages the rest to disk, which is what `lazy` asks for); the leader/master locators
/// place a quorum queue's first leader in a cluster (a classic queue lives on its declaring node).
pub const SUPPORTED: &[&str] = &[
    "x-message-ttl",
    "x-expires",
    "x-max-length",
    "x-max-length-bytes",
    "x-overflow",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-dead-letter-strategy",
    "x-queue-type",
    "x-retention-seconds",
    "x-single-active-consumer",
    "x-consumer-timeout",
    "x-max-priority",
    "x-queue-mode",
    "x-queue-master-locator",
    "x-queue-leader-locator",
    "x-delivery-limit",
    "x-quorum-initial-group-size",
];

/// Arguments RabbitMQ knows but Warren does not implement, with what to do instead.
fn unsupported_hint(arg: &str) -> &'static str {
    match arg {
        "x-max-in-memory-length" | "x-max-in-memory-bytes" => {
            "Warren's quorum queues do not implement it (they keep no bodies in their Raft state anyway)"
        }
        "x-max-age" | "x-stream-max-segment-size-bytes" | "x-initial-cluster-size" => {
            "it applies to streams, which Warren does not have"
        }
        _ => "Warren does not implement it",
    }
}

impl QueueArgs {
    /// Parses and validates the arguments of a queue.declare; an `x-` argument Warren does not support
    /// is refused.
    pub fn parse(queue: &str, vhost: &str, args: &FieldTable) -> Result<QueueArgs> {
        if let Some((arg, _)) = args.iter().find(|(k, _)| k.starts_with("x-") && !SUPPORTED.contains(&k.as_str())) {
            return Err(BrokerError::precondition_failed(format!(
                "queue argument '{arg}' is not supported for queue '{queue}' in vhost '{vhost}': {}; declare the queue without it",
                unsupported_hint(arg)
            )));
        }
        let parsed = Self::parse_known(queue, vhost, args)?;
        if let Some(key) = parsed.dead_letter_routing_key.as_deref().filter(|k| k.len() > 255) {
            // Dead letters are published with it as their routing key, an AMQP short string. (Checked at
            // declare only: a queue restored from older metadata keeps its key; the store takes any length.)
            return Err(BrokerError::precondition_failed(format!(
                "invalid arg 'x-dead-letter-routing-key' for queue '{queue}' in vhost '{vhost}': {} bytes, but a routing key is a short string of at most 255 bytes",
                key.len()
            )));
        }
        Ok(parsed)
    }

    /// Parses the arguments of a queue restored from the metadata log: one declared by an older
    /// version with an argument now refused keeps its other arguments (and its messages); the unknown
    /// one is named in the log.
    pub fn parse_stored(queue: &str, vhost: &str, args: &FieldTable) -> QueueArgs {
        for (arg, _) in args.iter().filter(|(k, _)| k.starts_with("x-") && !SUPPORTED.contains(&k.as_str())) {
            tracing::warn!(queue, vhost, arg = %arg, "stored queue has an argument this version does not support; ignoring it");
        }
        Self::parse_known(queue, vhost, args).unwrap_or_else(|e| {
            tracing::warn!(queue, vhost, error = %e, "stored queue has invalid arguments; restoring it without them");
            QueueArgs::default()
        })
    }

    fn parse_known(queue: &str, vhost: &str, args: &FieldTable) -> Result<QueueArgs> {
        let invalid = |arg: &str, why: &str| {
            BrokerError::precondition_failed(format!(
                "invalid arg '{arg}' for queue '{queue}' in vhost '{vhost}': {why}"
            ))
        };
        let non_negative = |arg: &str| -> Result<Option<u64>> {
            match args.get(arg) {
                None => Ok(None),
                Some(v) => match v.as_i64() {
                    Some(n) if n >= 0 => Ok(Some(n as u64)),
                    Some(n) => Err(invalid(arg, &format!("{{value_negative,{n}}}"))),
                    None => Err(invalid(arg, "{unacceptable_type,expected an integer}")),
                },
            }
        };
        let string = |arg: &str| -> Result<Option<String>> {
            match args.get(arg) {
                None => Ok(None),
                Some(v) => match v.as_str() {
                    Some(s) => Ok(Some(s.to_string())),
                    None => Err(invalid(arg, "{unacceptable_type,expected a string}")),
                },
            }
        };
        let mut parsed = QueueArgs {
            queue_type: QueueType::Classic,
            delivery_limit: match args.get("x-delivery-limit") {
                None => None,
                Some(v) => match v.as_i64() {
                    Some(n) if n < 0 => Some(None),
                    Some(n) => Some(Some(u32::try_from(n).unwrap_or(u32::MAX))),
                    None => return Err(invalid("x-delivery-limit", "{unacceptable_type,expected an integer}")),
                },
            },
            quorum_initial_group_size: match non_negative("x-quorum-initial-group-size")? {
                None => None,
                Some(0) => return Err(invalid("x-quorum-initial-group-size", "{value_zero,0}")),
                Some(n) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
            },
            message_ttl_ms: non_negative("x-message-ttl")?,
            expires_ms: non_negative("x-expires")?,
            max_length: non_negative("x-max-length")?,
            max_length_bytes: non_negative("x-max-length-bytes")?,
            overflow: Overflow::DropHead,
            dead_letter_exchange: string("x-dead-letter-exchange")?,
            dead_letter_routing_key: string("x-dead-letter-routing-key")?,
            dead_letter_strategy: DeadLetterStrategy::AtMostOnce,
            retention_ms: non_negative("x-retention-seconds")?.unwrap_or(0).saturating_mul(1000),
            single_active_consumer: match args.get("x-single-active-consumer") {
                None => false,
                Some(v) => v.as_bool().ok_or_else(|| invalid("x-single-active-consumer", "{unacceptable_type,expected a boolean}"))?,
            },
            consumer_timeout_ms: non_negative("x-consumer-timeout")?,
            max_priority: match non_negative("x-max-priority")? {
                None => 0,
                Some(n) => u8::try_from(n).map_err(|_| invalid("x-max-priority", &format!("{{max_value_exceeded,{n}}} (at most 255)")))?,
            },
            leader_locator: None,
        };
        if parsed.expires_ms == Some(0) {
            return Err(invalid("x-expires", "{value_zero,0}"));
        }
        if let Some(o) = string("x-overflow")? {
            parsed.overflow = match o.as_str() {
                "drop-head" => Overflow::DropHead,
                "reject-publish" => Overflow::RejectPublish,
                "reject-publish-dlx" => Overflow::RejectPublishDlx,
                other => {
                    return Err(invalid(
                        "x-overflow",
                        &format!("{{unknown_overflow_value,<<\"{other}\">>}} (use drop-head, reject-publish or reject-publish-dlx)"),
                    ))
                }
            };
        }
        if let Some(strategy) = string("x-dead-letter-strategy")? {
            parsed.dead_letter_strategy = match strategy.as_str() {
                "at-most-once" => DeadLetterStrategy::AtMostOnce,
                "at-least-once" => DeadLetterStrategy::AtLeastOnce,
                other => {
                    return Err(invalid(
                        "x-dead-letter-strategy",
                        &format!("unknown dead-letter strategy '{other}' (use at-most-once or at-least-once)"),
                    ))
                }
            };
        }
        if let Some(mode) = string("x-queue-mode")? {
            if mode != "default" && mode != "lazy" {
                return Err(invalid("x-queue-mode", &format!("unknown queue mode '{mode}' (use 'default' or 'lazy')")));
            }
        }
        for arg in ["x-queue-leader-locator", "x-queue-master-locator"] {
            let Some(locator) = string(arg)? else { continue };
            let parsed_locator = match locator.as_str() {
                "client-local" => LeaderLocator::ClientLocal,
                "balanced" | "random" | "least-leaders" | "min-masters" => LeaderLocator::Balanced,
                other => return Err(invalid(arg, &format!("unknown leader locator '{other}' (use 'client-local' or 'balanced')"))),
            };
            parsed.leader_locator.get_or_insert(parsed_locator);
        }
        if parsed.dead_letter_routing_key.is_some() && parsed.dead_letter_exchange.is_none() {
            return Err(invalid(
                "x-dead-letter-routing-key",
                "x-dead-letter-routing-key set without x-dead-letter-exchange",
            ));
        }
        if let Some(t) = string("x-queue-type")? {
            parsed.queue_type = match t.as_str() {
                "classic" => QueueType::Classic,
                "quorum" => QueueType::Quorum,
                "stream" => {
                    return Err(BrokerError::precondition_failed(format!(
                        "queue type 'stream' is not supported by Warren; declare queue '{queue}' with x-queue-type 'classic' or 'quorum'"
                    )))
                }
                other => {
                    return Err(invalid("x-queue-type", &format!("unknown queue type '{other}' (use 'classic' or 'quorum')")))
                }
            };
        }
        match parsed.queue_type {
            QueueType::Classic => {
                if parsed.dead_letter_strategy == DeadLetterStrategy::AtLeastOnce {
                    return Err(invalid(
                        "x-dead-letter-strategy",
                        "at-least-once dead-lettering is for quorum queues (declare the queue with x-queue-type 'quorum' and x-overflow 'reject-publish')",
                    ));
                }
                for arg in ["x-delivery-limit", "x-quorum-initial-group-size"] {
                    if args.get(arg).is_some() {
                        return Err(invalid(arg, "it is not supported by classic queues (it applies to quorum queues: declare the queue with x-queue-type 'quorum', or without it)"));
                    }
                }
            }
            QueueType::Quorum => {
                // What a quorum queue does not do (RabbitMQ refuses the same for its quorum queues,
                // except priorities, which RabbitMQ 4 has in two levels).
                for arg in ["x-max-priority", "x-queue-mode"] {
                    if args.get(arg).is_some() {
                        return Err(invalid(arg, "it is not supported by quorum queues; declare the queue without it"));
                    }
                }
                if parsed.overflow == Overflow::RejectPublishDlx {
                    return Err(invalid("x-overflow", "reject-publish-dlx is not supported by quorum queues (use drop-head or reject-publish)"));
                }
            }
        }
        Ok(parsed)
    }
}

/// RabbitMQ compares declared arguments for equivalence on redeclare; only the arguments that
/// change behaviour take part (as RabbitMQ's `rabbit_misc:assert_args_equivalence`).
pub const EQUIVALENCE_KEYS: &[&str] = &[
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-dead-letter-strategy",
    "x-expires",
    "x-max-length",
    "x-max-length-bytes",
    "x-message-ttl",
    "x-overflow",
    "x-queue-type",
    "x-max-priority",
    "x-retention-seconds",
    "x-queue-mode",
    "x-single-active-consumer",
    "x-consumer-timeout",
    "x-delivery-limit",
    "x-quorum-initial-group-size",
];

/// Finds the first behaviour-changing argument that differs between two declarations.
pub fn first_difference<'a>(a: &FieldTable, b: &FieldTable, keys: &[&'a str]) -> Option<&'a str> {
    keys.iter().copied().find(|k| !same_value(a.get(k), b.get(k)))
}

fn same_value(a: Option<&FieldValue>, b: Option<&FieldValue>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(x), Some(y)) => match (x.as_i64(), y.as_i64()) {
            (Some(i), Some(j)) => i == j,
            _ => x == y,
        },
        // `x-queue-type: classic` is the default, so it is equivalent to not giving it.
        (Some(x), None) | (None, Some(x)) => x.as_str() == Some("classic"),
    }
}
