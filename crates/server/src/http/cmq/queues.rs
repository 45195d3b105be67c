//! CMQ's queue actions on Warren's queues. A queue's CMQ attributes are its arguments:
//! `maxMsgHeapNum` is `x-max-length` with `x-overflow: reject-publish` (a full queue refuses sends,
//! code 4410, as CMQ's does), `msgRetentionSeconds` is `x-message-ttl`, `rewindSeconds` is
//! `x-retention-seconds`, and what only CMQ reads is kept under `cmq-` names (no `x-`: AMQP's
//! declare ignores them): `cmq-visibility-timeout`, `cmq-polling-wait-seconds`, `cmq-max-msg-size`.
//! Beyond CMQ, `queueType=quorum` makes a replicated queue.

use serde_json::{json, Value};
use warren_broker::vhost::QueueDeclare;
use warren_broker::Queue;
use warren_protocol::field::{FieldTable, FieldValue};

use super::{answer, code, CmqError, CmqResult, Request};
use crate::http::mgmt::queues::API_CONNECTION;

pub const VISIBILITY_TIMEOUT: &str = "cmq-visibility-timeout";
pub const POLLING_WAIT_SECONDS: &str = "cmq-polling-wait-seconds";
pub const MAX_MSG_SIZE: &str = "cmq-max-msg-size";

/// CMQ's defaults (its SDK's `QueueMeta`).
pub const DEFAULT_VISIBILITY_TIMEOUT: i64 = 30;
const DEFAULT_MAX_MSG_SIZE: i64 = 65_536;
const DEFAULT_RETENTION_SECONDS: i64 = 345_600;
/// The longest a message may stay invisible after a receive (12 hours, as CMQ).
pub const MAX_VISIBILITY_TIMEOUT: i64 = 43_200;
/// The longest a receive may wait for a message.
pub const MAX_POLLING_WAIT_SECONDS: i64 = 30;
/// The largest message CMQ takes.
pub const MAX_MESSAGE_BYTES: i64 = 1 << 20;

/// A queue of the request's vhost, or CMQ's "no such queue".
pub fn find(request: &Request, name: &str) -> Result<std::sync::Arc<Queue>, CmqError> {
    let q = request
        .vhost
        .queue_any(name)
        .filter(|q| !q.is_deleted())
        .ok_or_else(|| CmqError::new(code::NOT_FOUND, format!("no queue '{name}' in vhost '{}'", request.vhost.name)))?;
    if q.exclusive_owner.is_some() {
        return Err(CmqError::invalid(format!("queue '{name}' is exclusive to the AMQP connection that declared it")));
    }
    Ok(q)
}

/// CMQ's queue and topic names: a letter, then letters, digits, `-` and `_`, at most 64.
pub fn check_cmq_name(what: &str, name: &str) -> Result<(), CmqError> {
    let ok = name.len() <= 64
        && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(CmqError::invalid(format!("{what} '{name}': a name is a letter, then letters, digits, '-' or '_', at most 64 in all")))
    }
}

/// An integer argument of a queue.
fn int_arg(q: &Queue, name: &str) -> Option<i64> {
    q.arguments.get(name).and_then(FieldValue::as_i64)
}

/// The value of the argument behind a CMQ attribute, or what it is without one (a queue declared
/// over AMQP has none of the `cmq-` ones).
pub fn current(q: &Queue, arg: &str) -> i64 {
    int_arg(q, arg).unwrap_or(match arg {
        VISIBILITY_TIMEOUT => DEFAULT_VISIBILITY_TIMEOUT,
        MAX_MSG_SIZE => MAX_MESSAGE_BYTES,
        "x-message-ttl" => DEFAULT_RETENTION_SECONDS * 1000,
        _ => 0,
    })
}

/// The queue arguments the request's CMQ attributes make.
fn arguments(request: &Request) -> Result<FieldTable, CmqError> {
    let p = &request.params;
    let mut args = FieldTable::new();
    args.insert(VISIBILITY_TIMEOUT.into(), FieldValue::I64(p.int("visibilityTimeout", DEFAULT_VISIBILITY_TIMEOUT, 1..=MAX_VISIBILITY_TIMEOUT)?));
    args.insert(POLLING_WAIT_SECONDS.into(), FieldValue::I64(p.int("pollingWaitSeconds", 0, 0..=MAX_POLLING_WAIT_SECONDS)?));
    args.insert(MAX_MSG_SIZE.into(), FieldValue::I64(p.int("maxMsgSize", DEFAULT_MAX_MSG_SIZE, 1024..=MAX_MESSAGE_BYTES)?));
    let retention = p.int("msgRetentionSeconds", DEFAULT_RETENTION_SECONDS, 60..=1_296_000)?;
    args.insert("x-message-ttl".into(), FieldValue::I64(retention * 1000));
    let rewind = p.int("rewindSeconds", 0, 0..=1_296_000)?;
    if rewind > retention {
        return Err(CmqError::invalid(format!("rewindSeconds ({rewind}) cannot be more than msgRetentionSeconds ({retention})")));
    }
    if rewind > 0 {
        args.insert("x-retention-seconds".into(), FieldValue::I64(rewind));
    }
    let heap = p.int("maxMsgHeapNum", 0, 0..=i64::from(u32::MAX))?;
    if heap > 0 {
        args.insert("x-max-length".into(), FieldValue::I64(heap));
        args.insert("x-overflow".into(), FieldValue::LongString(b"reject-publish".to_vec().into()));
    }
    match p.get("queueType").unwrap_or("classic") {
        kind @ ("classic" | "quorum") => {
            args.insert("x-queue-type".into(), FieldValue::LongString(kind.as_bytes().to_vec().into()));
        }
        other => return Err(CmqError::invalid(format!("queueType must be classic or quorum, not '{other}'"))),
    }
    Ok(args)
}

pub fn create(request: &Request) -> CmqResult {
    let name = request.params.required("queueName")?;
    check_cmq_name("queueName", name)?;
    if request.vhost.queue_any(name).is_some_and(|q| !q.is_deleted()) {
        return Err(CmqError::new(code::ALREADY_EXISTS, format!("queue '{name}' already exists in vhost '{}'", request.vhost.name)));
    }
    let arguments = arguments(request)?;
    request.vhost.queue_declare(&QueueDeclare {
        name,
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        arguments: &arguments,
        connection_id: API_CONNECTION,
    })?;
    Ok(answer([("queueId", queue_id(&request.vhost.name, name).into())]))
}

fn queue_id(vhost: &str, name: &str) -> String {
    if vhost == "/" {
        format!("queue-{name}")
    } else {
        format!("queue-{vhost}-{name}")
    }
}

pub fn list(request: &Request) -> CmqResult {
    let search = request.params.get("searchWord").unwrap_or("");
    let offset = request.params.int("offset", 0, 0..=i64::from(u32::MAX))? as usize;
    let limit = request.params.int("limit", 20, 1..=1000)? as usize;
    let mut names: Vec<String> = request
        .vhost
        .queues()
        .into_iter()
        .filter(|q| !q.is_deleted() && q.exclusive_owner.is_none() && q.name.contains(search))
        .map(|q| q.name.clone())
        .collect();
    names.sort_unstable();
    let total = names.len();
    let page: Vec<Value> = names.iter().skip(offset).take(limit).map(|n| json!({"queueId": queue_id(&request.vhost.name, n), "queueName": n})).collect();
    Ok(answer([("totalCount", total.into()), ("queueList", page.into())]))
}

pub fn attributes(request: &Request) -> CmqResult {
    let name = request.params.required("queueName")?;
    let q = find(request, name)?;
    Ok(answer([
        ("queueName", name.into()),
        ("maxMsgHeapNum", current(&q, "x-max-length").into()),
        ("pollingWaitSeconds", current(&q, POLLING_WAIT_SECONDS).into()),
        ("visibilityTimeout", current(&q, VISIBILITY_TIMEOUT).into()),
        ("maxMsgSize", current(&q, MAX_MSG_SIZE).into()),
        ("msgRetentionSeconds", (current(&q, "x-message-ttl") / 1000).into()),
        ("rewindSeconds", current(&q, "x-retention-seconds").into()),
        ("activeMsgNum", q.message_count().into()),
        ("inactiveMsgNum", q.unacked_count().into()),
        ("delayMsgNum", request.vhost.delayed_count(&q).into()),
        ("rewindmsgNum", q.retention_stats().consumed.into()),
        ("minMsgTime", 0.into()),
        // Warren's own: what AMQP sees of the queue.
        ("queueType", if q.is_quorum() { "quorum" } else { "classic" }.into()),
        ("vhost", request.vhost.name.clone().into()),
    ]))
}

/// A queue's arguments are fixed once declared (as in AMQP): a SetQueueAttributes that changes
/// nothing succeeds, one that would change something is refused and says so.
pub fn set_attributes(request: &Request) -> CmqResult {
    let name = request.params.required("queueName")?;
    let q = find(request, name)?;
    let wanted = arguments(request)?;
    let p = &request.params;
    let given = |cmq: &str| p.get(cmq).is_some_and(|v| !v.is_empty());
    let checks = [
        ("visibilityTimeout", VISIBILITY_TIMEOUT),
        ("pollingWaitSeconds", POLLING_WAIT_SECONDS),
        ("maxMsgSize", MAX_MSG_SIZE),
        ("msgRetentionSeconds", "x-message-ttl"),
        ("rewindSeconds", "x-retention-seconds"),
        ("maxMsgHeapNum", "x-max-length"),
    ];
    for (cmq, arg) in checks {
        if !given(cmq) {
            continue;
        }
        let want = wanted.get(arg).and_then(FieldValue::as_i64).unwrap_or(0);
        let have = current(&q, arg);
        if want != have {
            return Err(CmqError::invalid(format!(
                "Warren cannot change {cmq} of an existing queue (its arguments are fixed once declared, as in AMQP): queue '{name}' has {}; create a new queue with the attributes you want",
                if arg == "x-message-ttl" { have / 1000 } else { have }
            )));
        }
    }
    Ok(answer([]))
}

pub fn delete(request: &Request) -> CmqResult {
    let name = request.params.required("queueName")?;
    find(request, name)?;
    request.vhost.queue_delete(name, false, false, API_CONNECTION)?;
    Ok(answer([]))
}

/// RewindQueue: the consumed messages the queue keeps (`rewindSeconds`) published at or after
/// `startConsumeTime` (unix seconds) are received again (`Queue::rewind`). Beyond CMQ, the answer
/// says how many (`rewoundMsgNum`) and from when (`rewoundFromTime`, unix seconds; 0 if none).
pub async fn rewind(request: &Request) -> CmqResult {
    let name = request.params.required("queueName")?;
    let q = find(request, name)?;
    request.params.required("startConsumeTime")?;
    let start = request.params.int("startConsumeTime", 0, 0..=i64::MAX / 1000)?;
    if current(&q, "x-retention-seconds") == 0 {
        return Err(CmqError::invalid(format!("queue '{name}' keeps no consumed messages (rewindSeconds 0): nothing to rewind to")));
    }
    let outcome = q.rewind(start as u64 * 1000).await?;
    Ok(answer([("rewoundMsgNum", json!(outcome.rewound)), ("rewoundFromTime", json!(outcome.from_ms.map_or(0, |ms| ms / 1000)))]))
}
