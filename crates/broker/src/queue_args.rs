//! Queue arguments (`x-*`) as RabbitMQ validates them at queue.declare.

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

#[derive(Debug, Clone, Default)]
pub struct QueueArgs {
    pub message_ttl_ms: Option<u64>,
    pub expires_ms: Option<u64>,
    pub max_length: Option<u64>,
    pub max_length_bytes: Option<u64>,
    pub overflow: Overflow,
    pub dead_letter_exchange: Option<String>,
    pub dead_letter_routing_key: Option<String>,
    /// `x-retention-seconds`: keep consumed messages on disk this long after they were enqueued, so the
    /// queue can later be rewound to a point in time (Warren's own argument; 0 or absent: no retention).
    pub retention_ms: u64,
}

impl QueueArgs {
    pub fn parse(queue: &str, vhost: &str, args: &FieldTable) -> Result<QueueArgs> {
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
            message_ttl_ms: non_negative("x-message-ttl")?,
            expires_ms: non_negative("x-expires")?,
            max_length: non_negative("x-max-length")?,
            max_length_bytes: non_negative("x-max-length-bytes")?,
            overflow: Overflow::DropHead,
            dead_letter_exchange: string("x-dead-letter-exchange")?,
            dead_letter_routing_key: string("x-dead-letter-routing-key")?,
            retention_ms: non_negative("x-retention-seconds")?.unwrap_or(0).saturating_mul(1000),
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
        if parsed.dead_letter_routing_key.is_some() && parsed.dead_letter_exchange.is_none() {
            return Err(invalid(
                "x-dead-letter-routing-key",
                "x-dead-letter-routing-key set without x-dead-letter-exchange",
            ));
        }
        if let Some(t) = string("x-queue-type")? {
            match t.as_str() {
                "classic" => {}
                "quorum" | "stream" => {
                    return Err(BrokerError::precondition_failed(format!(
                        "queue type '{t}' is not supported by this version of Warren yet; declare queue '{queue}' with x-queue-type 'classic' (or omit the argument)"
                    )))
                }
                other => {
                    return Err(invalid("x-queue-type", &format!("unknown queue type '{other}' (use 'classic')")))
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
    "x-expires",
    "x-max-length",
    "x-max-length-bytes",
    "x-message-ttl",
    "x-overflow",
    "x-queue-type",
    "x-max-priority",
    "x-retention-seconds",
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
