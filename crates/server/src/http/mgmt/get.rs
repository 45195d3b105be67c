//! POST `/api/queues/{vhost}/{name}/get`: takes up to `count` messages off a queue, as
//! `rabbitmqadmin get` and the UI do, through a channel of the API's own (basic.get with acks), then
//! acks or requeues them as `ackmode` says: `ack_requeue_true` (look, and leave them there,
//! redelivered), `ack_requeue_false` (take them), `reject_requeue_true`, `reject_requeue_false`
//! (dead-lettered where the queue says so). It stops early once the bodies taken reach 16 MiB.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::Json;
use base64::Engine;
use parking_lot::Mutex;
use serde_json::{json, Value};
use warren_broker::channel::Delivery;
use warren_broker::{Channel, ClientSink, MessageRef, Settle};
use warren_protocol::properties::BasicProperties;

use super::queues::API_CONNECTION;
use super::body_object;
use super::scope::{Resource, Scope};
use warren_broker::auth::Perm;
use crate::http::error::{ApiError, ApiResult};
use crate::http::fields;
use crate::http::{durable_within, get_ready, HttpContext};

/// The most messages one request takes (each is held in memory until answered).
const MAX_COUNT: u64 = 1000;
/// Once the bodies taken reach this, no more are taken (the answer holds them all, base64 perhaps).
const MAX_BYTES: usize = 16 << 20;
/// How long the settlement may take to be durable before the answer goes anyway.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// The API's channel's client side: it keeps what basic.get hands it, and their bodies' bytes.
#[derive(Default)]
struct Collected(Mutex<(Vec<(bool, u32, MessageRef)>, usize)>);

impl ClientSink for Collected {
    fn send(&self, delivery: Delivery) {
        if let Delivery::GetOk { redelivered, message_count, message, .. } = delivery {
            let mut taken = self.0.lock();
            taken.1 += message.body.len();
            taken.0.push((redelivered, message_count, message));
        }
    }
}

pub async fn get(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>, body: Bytes) -> ApiResult<Json<Value>> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    // basic.get, as the user: read on the queue.
    scope.check_amqp(&v.name, Perm::Read, Resource::Queue, &name).map_err(|r| r.not_authorised())?;
    let queue = v.queue_any(&name).filter(|q| !q.is_deleted()).ok_or_else(|| ApiError::not_found(format!("no queue '{name}' in vhost '{vhost_name}'")))?;
    if queue.exclusive_owner.is_some() {
        return Err(ApiError::bad_request(format!("queue '{name}' is exclusive to the connection that declared it")));
    }
    let body = body_object(&body)?;
    let count = match body.get("count") {
        None => 1,
        Some(Value::Number(n)) => n.as_u64().unwrap_or(0),
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(_) => 0,
    };
    if !(1..=MAX_COUNT).contains(&count) {
        return Err(ApiError::bad_request(format!("count must be a number from 1 to {MAX_COUNT}")));
    }
    let how = match body.get("ackmode").and_then(Value::as_str).unwrap_or("ack_requeue_true") {
        "ack_requeue_true" | "reject_requeue_true" => Settle::Reject { requeue: true },
        "ack_requeue_false" => Settle::Ack,
        "reject_requeue_false" => Settle::Reject { requeue: false },
        other => {
            return Err(ApiError::bad_request(format!(
                "ackmode must be ack_requeue_true, ack_requeue_false, reject_requeue_true or reject_requeue_false, not \"{other}\""
            )))
        }
    };
    let encoding = match body.get("encoding").and_then(Value::as_str).unwrap_or("auto") {
        e @ ("auto" | "base64") => e,
        other => return Err(ApiError::bad_request(format!("encoding must be auto or base64, not \"{other}\""))),
    };
    let truncate = body.get("truncate").and_then(|t| t.as_u64().or_else(|| t.as_str().and_then(|s| s.parse().ok()))).map(|t| t as usize);

    let sink = Arc::new(Collected::default());
    let channel = Channel::new(1, API_CONNECTION, sink.clone());
    let failure = get_ready(&queue, &channel, || {
        let (taken, bytes) = &*sink.0.lock();
        (taken.len() as u64) < count && *bytes < MAX_BYTES
    })
    .await
    .err()
    .map(ApiError::unavailable);
    // Settles everything the channel took (tag 0, multiple: all of them), then closes it.
    let settled = if sink.0.lock().0.is_empty() { Ok(None) } else { channel.settle(0, true, how) };
    channel.close();
    if let Some(ticket) = settled.map_err(ApiError::from)? {
        durable_within(ctx.broker.store(), ticket, SETTLE_TIMEOUT).await;
    }
    if let Some(e) = failure {
        if sink.0.lock().0.is_empty() {
            return Err(e);
        }
    }
    let taken = std::mem::take(&mut sink.0.lock().0);
    Ok(Json(Value::Array(taken.into_iter().map(|(redelivered, message_count, m)| message_json(&m, redelivered, message_count, encoding, truncate)).collect())))
}

fn message_json(m: &MessageRef, redelivered: bool, message_count: u32, encoding: &str, truncate: Option<usize>) -> Value {
    let body = match truncate {
        Some(n) if n < m.body.len() => &m.body[..n],
        _ => &m.body[..],
    };
    let (payload, payload_encoding) = match (encoding, std::str::from_utf8(body)) {
        ("auto", Ok(text)) => (text.to_owned(), "string"),
        _ => (base64::engine::general_purpose::STANDARD.encode(body), "base64"),
    };
    json!({
        "payload_bytes": m.body.len(),
        "redelivered": redelivered,
        "exchange": m.exchange,
        "routing_key": m.routing_key,
        "message_count": message_count,
        "properties": properties_json(&m.properties),
        "payload": payload,
        "payload_encoding": payload_encoding,
    })
}

/// Properties as RabbitMQ shows them: only those set.
pub fn properties_json(raw: &[u8]) -> Value {
    let Ok(p) = BasicProperties::decode(raw) else { return json!({}) };
    let mut out = serde_json::Map::new();
    let mut put = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            out.insert(k.to_owned(), v);
        }
    };
    put("content_type", p.content_type.map(Value::from));
    put("content_encoding", p.content_encoding.map(Value::from));
    put("headers", p.headers.as_ref().map(fields::table_to_json));
    put("delivery_mode", p.delivery_mode.map(Value::from));
    put("priority", p.priority.map(Value::from));
    put("correlation_id", p.correlation_id.map(Value::from));
    put("reply_to", p.reply_to.map(Value::from));
    put("expiration", p.expiration.map(Value::from));
    put("message_id", p.message_id.map(Value::from));
    put("timestamp", p.timestamp.map(Value::from));
    put("type", p.kind.map(Value::from));
    put("user_id", p.user_id.map(Value::from));
    put("app_id", p.app_id.map(Value::from));
    put("cluster_id", p.cluster_id.map(Value::from));
    Value::Object(out)
}
