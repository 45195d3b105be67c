//! SendMessage, BatchSendMessage, ReceiveMessage, BatchReceiveMessage, DeleteMessage,
//! BatchDeleteMessage.
//!
//! A message sent here is an AMQP message to the queue (default exchange, routing key the queue's
//! name), persistent, with `message_id` its CMQ `msgId` and `timestamp` its `enqueueTime`; one
//! published over AMQP is received here with those properties if it has them.

use std::time::Duration;

use serde_json::{json, Map, Value};
use warren_broker::Message;
use warren_protocol::field::FieldValue;
use warren_protocol::properties::BasicProperties;

use super::queues::{self, current, find};
use super::receive::{Leases, Received};
use super::{answer, code, now_secs, Answer, CmqError, CmqResult, Request};

/// Messages in one batch, at most (CMQ's limit).
pub const MAX_BATCH: usize = 16;

/// The message bodies of a (batch) send or publish: `msgBody`, or `msgBody.1` ... `msgBody.16`.
pub fn bodies(request: &Request, batch: bool, max_bytes: usize) -> Result<Vec<&str>, CmqError> {
    let bodies = if batch { request.params.numbered("msgBody", MAX_BATCH)? } else { vec![request.params.required("msgBody")?] };
    if bodies.is_empty() {
        return Err(CmqError::invalid("msgBody.1 is required (a batch of 1 to 16 messages)"));
    }
    if let Some(big) = bodies.iter().find(|b| b.len() > max_bytes) {
        return Err(CmqError::new(code::MESSAGE_TOO_LARGE, format!("a message of {} bytes is larger than the {max_bytes} bytes allowed (maxMsgSize); nothing was sent", big.len())));
    }
    Ok(bodies)
}

/// A send's `delaySeconds` (0 to 45 days, CMQ's bounds) in milliseconds: the messages wait in the
/// node's delay store (`warren_broker::delay`) and reach their queues once due.
pub fn delay_ms(request: &Request) -> Result<u64, CmqError> {
    Ok(request.params.int("delaySeconds", 0, 0..=3_888_000)? as u64 * 1000)
}

/// Refuses a send while a resource alarm blocks publishers (as AMQP publishers are blocked).
pub fn check_alarms(request: &Request) -> Result<(), CmqError> {
    let alarms = *request.ctx.alarms.borrow();
    if alarms.blocks_publishers() {
        return Err(CmqError::new(code::INTERNAL, format!("sending is blocked by a resource alarm ({}); nothing was sent, try again later", alarms.reason())));
    }
    Ok(())
}

/// An AMQP message of a CMQ body: persistent, with its msgId and enqueue time.
pub fn message(exchange: &str, routing_key: &str, body: &str, msg_id: &str, headers: Option<warren_protocol::field::FieldTable>) -> Message {
    let properties = BasicProperties { delivery_mode: Some(2), message_id: Some(msg_id.to_owned()), timestamp: Some(now_secs()), headers, ..Default::default() };
    let mut raw = bytes::BytesMut::new();
    properties.encode(&mut raw);
    Message {
        exchange: exchange.to_owned(),
        routing_key: routing_key.to_owned(),
        persistent: true,
        expiration_ms: None,
        properties: raw.freeze(),
        body: bytes::Bytes::copy_from_slice(body.as_bytes()),
    }
}

pub async fn send(request: &Request, batch: bool) -> CmqResult {
    let name = request.params.required("queueName")?;
    let q = find(request, name)?;
    let max = current(&q, queues::MAX_MSG_SIZE).min(request.ctx.config.max_message_size as i64) as usize;
    let bodies = bodies(request, batch, max)?;
    let delay = delay_ms(request)?;
    check_alarms(request)?;
    let cmq = &request.ctx.cmq;
    let ids: Vec<String> = bodies.iter().map(|_| cmq.message_id()).collect();
    let messages = bodies.iter().zip(&ids).map(|(body, id)| message("", name, body, id, None)).collect();
    let sent = cmq.confirms.publish(&request.vhost, "", messages, delay)?;
    if sent.routed.iter().any(|r| !r) {
        return Err(CmqError::new(code::NOT_FOUND, format!("queue '{name}' was deleted while the message was sent")));
    }
    cmq.confirms.durable(request.ctx.broker.store(), &sent).await?;
    Ok(sent_answer(ids, batch))
}

/// A (batch) send's or publish's answer: the messages' ids.
pub fn sent_answer(ids: Vec<String>, batch: bool) -> Answer {
    if batch {
        answer([("msgList", ids.into_iter().map(|id| json!({"msgId": id})).collect::<Vec<_>>().into())])
    } else {
        answer([("msgId", ids.into_iter().next().unwrap_or_default().into())])
    }
}

pub async fn receive(request: &Request, batch: bool) -> CmqResult {
    let name = request.params.required("queueName")?;
    let q = find(request, name)?;
    let n = if batch { request.params.int("numOfMsg", 0, 1..=MAX_BATCH as i64)? as usize } else { 1 };
    let default_wait = current(&q, queues::POLLING_WAIT_SECONDS).clamp(0, queues::MAX_POLLING_WAIT_SECONDS);
    let wait = request.params.int("pollingWaitSeconds", default_wait, 0..=queues::MAX_POLLING_WAIT_SECONDS)?;
    let visibility = current(&q, queues::VISIBILITY_TIMEOUT).clamp(1, queues::MAX_VISIBILITY_TIMEOUT);
    let received = Leases::receive(&request.ctx, &request.vhost.name, &q, n, Duration::from_secs(wait as u64), Duration::from_secs(visibility as u64)).await?;
    if received.is_empty() {
        return Err(CmqError::new(code::NO_MESSAGE, "no message"));
    }
    let next_visible = now_secs() + visibility as u64;
    let mut infos = received.iter().map(|r| message_info(r, next_visible));
    if batch {
        Ok(answer([("msgInfoList", infos.map(Value::Object).collect::<Vec<_>>().into())]))
    } else {
        Ok(infos.next().unwrap_or_default())
    }
}

/// A body as text: CMQ's bodies are strings (one published over AMQP that is not UTF-8 shows its
/// invalid bytes as U+FFFD).
fn text(body: &[u8]) -> String {
    match std::str::from_utf8(body) {
        Ok(s) => s.to_owned(),
        Err(_) => String::from_utf8_lossy(body).into_owned(),
    }
}

/// A received message as CMQ shows it.
fn message_info(r: &Received, next_visible: u64) -> Map<String, Value> {
    let p = BasicProperties::decode(&r.message.properties).unwrap_or_default();
    // A quorum queue counts returned deliveries (x-delivery-count); a classic queue counts them in
    // memory (`Entry::returned`), and after a restart knows only whether it was delivered before.
    let returned = p.headers.as_ref().and_then(|h| h.get("x-delivery-count")).and_then(FieldValue::as_i64);
    let dequeue_count = returned.map_or_else(|| i64::from(r.returned).max(i64::from(r.redelivered)) + 1, |n| n.max(0) + 1);
    let now = now_secs();
    answer([
        ("msgBody", text(&r.message.body).into()),
        ("msgId", p.message_id.unwrap_or_default().into()),
        ("receiptHandle", r.handle.clone().into()),
        ("enqueueTime", p.timestamp.unwrap_or(now).into()),
        ("firstDequeueTime", now.into()),
        ("nextVisibleTime", next_visible.into()),
        ("dequeueCount", dequeue_count.into()),
    ])
}

pub async fn delete(request: &Request, batch: bool) -> CmqResult {
    let name = request.params.required("queueName")?;
    find(request, name)?;
    let handles = if batch { request.params.numbered("receiptHandle", MAX_BATCH)? } else { vec![request.params.required("receiptHandle")?] };
    if handles.is_empty() {
        return Err(CmqError::invalid("receiptHandle.1 is required (1 to 16 receipt handles)"));
    }
    let leases = &request.ctx.cmq.leases;
    let mut ticket = None;
    let mut failed = Vec::new();
    for handle in &handles {
        match leases.delete(&request.vhost.name, name, handle) {
            Ok(t) => ticket = ticket.max(t),
            Err(e) => failed.push(json!({"code": e.code, "message": e.message, "receiptHandle": handle})),
        }
    }
    if let Some(ticket) = ticket {
        crate::http::durable_within(request.ctx.broker.store(), ticket, Duration::from_secs(10)).await;
    }
    match (batch, failed.len()) {
        (_, 0) => Ok(answer([])),
        (false, _) => {
            let e = failed.remove(0);
            Err(CmqError::new(e["code"].as_i64().unwrap_or(code::INVALID_RECEIPT_HANDLE), e["message"].as_str().unwrap_or_default()))
        }
        (true, n) => {
            // CMQ answers code 6010 with the handles that failed in `errorList`; its SDK raises with
            // the answer in `data`.
            let mut e = CmqError::new(code::BATCH_DELETE_FAILED, format!("{n} of {} receipt handles failed (see errorList); the others were deleted", handles.len()));
            e.extra.insert("errorList".into(), Value::Array(failed));
            Err(e)
        }
    }
}
