//! `/api/exchanges` and `/api/bindings`: list, show, declare, delete exchanges; publish through one;
//! list, add and remove bindings.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use serde_json::{json, Value};
use warren_broker::exchange::{Destination, Exchange};
use warren_broker::vhost::ExchangeDeclare;
use warren_broker::{Message, VHost};
use warren_protocol::field::FieldTable;
use warren_protocol::properties::BasicProperties;

use super::queues::{check_name, API_CONNECTION, MAX_NAME_BYTES};
use crate::http::list;
use super::scope::{Resource, Scope};
use super::{body_object, flag, Params};
use warren_broker::auth::Perm;
use crate::http::error::{ApiError, ApiResult};
use crate::http::fields;
use crate::http::HttpContext;

/// How long a publish through the API waits for its message to be durable.
const PUBLISH_DURABLE_TIMEOUT: Duration = Duration::from_secs(30);

/// The default exchange's name in paths (its real name is empty).
const DEFAULT_EXCHANGE: &str = "amq.default";

fn real_name(name: &str) -> &str {
    if name == DEFAULT_EXCHANGE {
        ""
    } else {
        name
    }
}

fn exchange_json(v: &VHost, e: &Exchange) -> Value {
    json!({
        "name": e.name,
        "vhost": v.name,
        "type": e.type_name(),
        "durable": e.durable,
        "auto_delete": e.auto_delete,
        "internal": e.internal,
        "arguments": fields::table_to_json(&e.arguments),
        "policy": Value::Null,
        "user_who_performed_action": "",
        "message_stats": {},
    })
}

fn list_of(ctx: &HttpContext, scope: &Scope, vhost_name: Option<&str>) -> ApiResult<Vec<Value>> {
    let mut items = Vec::new();
    for v in scope.vhosts(ctx, vhost_name)? {
        let mut exchanges = v.exchanges();
        exchanges.sort_by(|a, b| a.name.cmp(&b.name));
        items.extend(exchanges.iter().map(|e| exchange_json(&v, e)));
    }
    Ok(items)
}

pub async fn list_all(State(ctx): State<Arc<HttpContext>>, scope: Scope, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(list_of(&ctx, &scope, None)?, &query)
}

pub async fn list_vhost(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path(vhost): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(list_of(&ctx, &scope, Some(&vhost))?, &query)
}

fn find(v: &VHost, name: &str) -> ApiResult<Arc<Exchange>> {
    v.exchange(real_name(name)).map_err(|_| ApiError::not_found(format!("no exchange '{name}' in vhost '{}'", v.name)))
}

pub async fn show(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>) -> ApiResult<Json<Value>> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    Ok(Json(exchange_json(&v, &*find(&v, &name)?)))
}

pub async fn declare(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>, body: Bytes) -> ApiResult<StatusCode> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    check_name("exchange", &name)?;
    scope.check(&v.name, Perm::Configure, Resource::Exchange, &name)?;
    let body = body_object(&body)?;
    let kind = body.get("type").and_then(Value::as_str).ok_or_else(|| ApiError::bad_request("type is required: direct, fanout, topic or headers"))?;
    let arguments = fields::table_from_json(body.get("arguments").unwrap_or(&Value::Null), "arguments")?;
    let existed = v.exchange(&name).is_ok();
    v.exchange_declare(&ExchangeDeclare {
        name: &name,
        kind,
        passive: false,
        durable: flag(&body, "durable", true)?,
        auto_delete: flag(&body, "auto_delete", false)?,
        internal: flag(&body, "internal", false)?,
        arguments: &arguments,
    })?;
    Ok(if existed { StatusCode::NO_CONTENT } else { StatusCode::CREATED })
}

pub async fn delete(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>, Query(query): Params) -> ApiResult<StatusCode> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    scope.check(&v.name, Perm::Configure, Resource::Exchange, real_name(&name))?;
    find(&v, &name)?;
    v.exchange_delete(real_name(&name), query.get("if-unused").is_some_and(|s| s == "true"))?;
    Ok(StatusCode::NO_CONTENT)
}

/// POST .../publish: `{"routing_key", "payload", "payload_encoding": "string"|"base64", "properties"}`
/// answers `{"routed": bool}` once the message is durable in the classic queues it reached (a
/// quorum queue takes it as from a publisher without confirms: use AMQP or CMQ's SendMessage to
/// know it is committed).
pub async fn publish(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>, body: Bytes) -> ApiResult<Json<Value>> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    // As basic.publish, as the user: write on the exchange (the topic permission on the routing
    // key is checked below, once the key is read).
    scope.check_amqp(&v.name, Perm::Write, Resource::Exchange, real_name(&name)).map_err(|r| r.bad_request())?;
    // As AMQP publishers are blocked while a resource alarm is raised, so is this.
    let alarms = *ctx.alarms.borrow();
    if alarms.blocks_publishers() {
        return Err(ApiError::unavailable(format!("publishing is blocked by a resource alarm ({}); nothing was published", alarms.reason())));
    }
    let body = body_object(&body)?;
    let routing_key = body.get("routing_key").and_then(Value::as_str).ok_or_else(|| ApiError::bad_request("routing_key is required (a string)"))?;
    check_name("routing key", routing_key)?;
    if let Ok(exchange) = v.exchange(real_name(&name)) {
        scope.check_topic_write(&v.name, &exchange.name, exchange.kind, routing_key).map_err(|r| r.bad_request())?;
    }
    let payload = body.get("payload").and_then(Value::as_str).ok_or_else(|| ApiError::bad_request("payload is required (a string)"))?;
    let payload: Vec<u8> = match body.get("payload_encoding").and_then(Value::as_str).unwrap_or("string") {
        "string" => payload.as_bytes().to_vec(),
        "base64" => base64::engine::general_purpose::STANDARD.decode(payload).map_err(|e| ApiError::bad_request(format!("payload is not valid base64: {e}")))?,
        other => return Err(ApiError::bad_request(format!("payload_encoding must be \"string\" or \"base64\", not \"{other}\""))),
    };
    if payload.len() as u64 > ctx.config.max_message_size as u64 {
        return Err(ApiError::bad_request(format!("payload is {} bytes; max-message-size is {}", payload.len(), ctx.config.max_message_size)));
    }
    let properties = properties_from_json(body.get("properties").unwrap_or(&Value::Null))?;
    let expiration_ms = match &properties.expiration {
        None => None,
        Some(s) => Some(warren_broker::message::parse_expiration(s).ok_or_else(|| ApiError::bad_request(format!("expiration '{s}' is not a number of milliseconds")))?),
    };
    let mut raw = bytes::BytesMut::new();
    properties.encode(&mut raw);
    let message = Message {
        exchange: real_name(&name).to_owned(),
        routing_key: routing_key.to_owned(),
        persistent: properties.delivery_mode == Some(2),
        expiration_ms,
        properties: raw.freeze(),
        body: payload.into(),
    };
    let outcome = v.publish(real_name(&name), message, true)?;
    if outcome.rejected {
        return Err(ApiError::bad_request("a queue refused the message (x-overflow reject-publish)"));
    }
    if let Some(ticket) = outcome.ticket {
        if !crate::http::durable_within(ctx.broker.store(), ticket, PUBLISH_DURABLE_TIMEOUT).await {
            return Err(ApiError::unavailable("the message was routed but is not durable yet (the store is behind or stopping)"));
        }
    }
    Ok(Json(json!({"routed": outcome.routed})))
}

/// RabbitMQ's `properties` object as AMQP basic properties.
fn properties_from_json(v: &Value) -> ApiResult<BasicProperties> {
    let mut p = BasicProperties::default();
    let Some(map) = v.as_object() else {
        return if v.is_null() { Ok(p) } else { Err(ApiError::bad_request("properties must be a JSON object")) };
    };
    let short = |key: &str| -> ApiResult<Option<String>> {
        match map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.len() <= MAX_NAME_BYTES => Ok(Some(s.clone())),
            Some(Value::String(_)) => Err(ApiError::bad_request(format!("properties.{key} is longer than {MAX_NAME_BYTES} bytes"))),
            Some(other) => Err(ApiError::bad_request(format!("properties.{key} must be a string, not {other}"))),
        }
    };
    let number = |key: &str, max: u64| -> ApiResult<Option<u64>> {
        match map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(n) => n.as_u64().filter(|n| *n <= max).map(Some).ok_or_else(|| ApiError::bad_request(format!("properties.{key} must be a number from 0 to {max}"))),
        }
    };
    p.content_type = short("content_type")?;
    p.content_encoding = short("content_encoding")?;
    p.correlation_id = short("correlation_id")?;
    p.reply_to = short("reply_to")?;
    p.expiration = short("expiration")?;
    p.message_id = short("message_id")?;
    p.kind = short("type")?;
    p.user_id = short("user_id")?;
    p.app_id = short("app_id")?;
    p.cluster_id = short("cluster_id")?;
    p.delivery_mode = number("delivery_mode", 2)?.map(|n| n as u8);
    p.priority = number("priority", 255)?.map(|n| n as u8);
    p.timestamp = number("timestamp", u64::MAX)?;
    if let Some(h) = map.get("headers") {
        p.headers = Some(fields::table_from_json(h, "properties.headers")?);
    }
    Ok(p)
}

// ---- bindings -----------------------------------------------------------------------------

/// RabbitMQ's `properties_key` of a binding: what names it in a path among the bindings between
/// the same two objects. "~" for no routing key and no arguments.
fn properties_key(routing_key: &str, arguments: &FieldTable) -> String {
    if arguments.is_empty() {
        if routing_key.is_empty() {
            "~".to_owned()
        } else {
            routing_key.to_owned()
        }
    } else {
        let text = fields::table_to_json(arguments).to_string();
        // FNV-1a: stable across runs and nodes, unlike the std hasher.
        let hash = text.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
        format!("{routing_key}~{hash:016x}")
    }
}

fn binding_json(vhost: &str, source: &str, destination: &str, destination_type: &str, routing_key: &str, arguments: &FieldTable) -> Value {
    json!({
        "source": source,
        "vhost": vhost,
        "destination": destination,
        "destination_type": destination_type,
        "routing_key": routing_key,
        "arguments": fields::table_to_json(arguments),
        "properties_key": properties_key(routing_key, arguments),
    })
}

/// Every binding of a vhost, the default exchange's implicit ones first (one per queue, as RabbitMQ lists them).
pub fn bindings_of(v: &VHost) -> Vec<Value> {
    let empty = FieldTable::new();
    let mut queues = v.queues();
    queues.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out: Vec<Value> = queues.iter().filter(|q| !q.is_deleted()).map(|q| binding_json(&v.name, "", &q.name, "queue", &q.name, &empty)).collect();
    let mut exchanges = v.exchanges();
    exchanges.sort_by(|a, b| a.name.cmp(&b.name));
    for e in exchanges.iter().filter(|e| !e.name.is_empty()) {
        for b in e.bindings() {
            let kind = if b.destination.is_queue() { "queue" } else { "exchange" };
            out.push(binding_json(&v.name, &e.name, b.destination.name(), kind, &b.routing_key, &b.arguments));
        }
    }
    out
}

fn bindings_in(ctx: &HttpContext, scope: &Scope, vhost_name: Option<&str>) -> ApiResult<Vec<Value>> {
    Ok(scope.vhosts(ctx, vhost_name)?.iter().flat_map(|v| bindings_of(v)).collect())
}

pub async fn bindings_all(State(ctx): State<Arc<HttpContext>>, scope: Scope, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(bindings_in(&ctx, &scope, None)?, &query)
}

pub async fn bindings_vhost(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path(vhost): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(bindings_in(&ctx, &scope, Some(&vhost))?, &query)
}

pub async fn bindings_from(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>, Query(query): Params) -> ApiResult<Json<Value>> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    find(&v, &name)?;
    let source = real_name(&name);
    list::answer(bindings_of(&v).into_iter().filter(|b| b["source"] == source).collect(), &query)
}

pub async fn bindings_to(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>, Query(query): Params) -> ApiResult<Json<Value>> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    find(&v, &name)?;
    list::answer(bindings_of(&v).into_iter().filter(|b| b["destination"] == name.as_str() && b["destination_type"] == "exchange").collect(), &query)
}

/// `q` or `e` in a binding's path.
fn destination_type(kind: &str) -> ApiResult<&'static str> {
    match kind {
        "q" => Ok("queue"),
        "e" => Ok("exchange"),
        other => Err(ApiError::not_found(format!("'{other}' is neither q (a queue) nor e (an exchange)"))),
    }
}

fn between(v: &VHost, source: &str, kind: &str, destination: &str) -> ApiResult<Vec<Value>> {
    let dtype = destination_type(kind)?;
    find(v, source)?;
    match dtype {
        "queue" => v.queue_any(destination).filter(|q| !q.is_deleted()).map(|_| ()).ok_or_else(|| ApiError::not_found(format!("no queue '{destination}'")))?,
        _ => find(v, destination).map(|_| ())?,
    }
    let source = real_name(source);
    Ok(bindings_of(v).into_iter().filter(|b| b["source"] == source && b["destination"] == destination && b["destination_type"] == dtype).collect())
}

pub async fn bindings_between(
    State(ctx): State<Arc<HttpContext>>,
    scope: Scope,
    Path((vhost_name, source, kind, destination)): Path<(String, String, String, String)>,
    Query(query): Params,
) -> ApiResult<Json<Value>> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    list::answer(between(&v, &source, &kind, &destination)?, &query)
}

/// queue.bind's and exchange.bind's permissions (and their unbinds'): write on the destination,
/// read on the source.
fn check_bind(scope: &Scope, v: &VHost, source: &str, dtype: &str, destination: &str) -> ApiResult<()> {
    let kind = if dtype == "queue" { Resource::Queue } else { Resource::Exchange };
    scope.check(&v.name, Perm::Write, kind, destination)?;
    scope.check(&v.name, Perm::Read, Resource::Exchange, real_name(source))
}

/// POST: adds a binding (`{"routing_key", "arguments"}`), 201 with its path in `Location`.
pub async fn bind(
    State(ctx): State<Arc<HttpContext>>,
    scope: Scope,
    Path((vhost_name, source, kind, destination)): Path<(String, String, String, String)>,
    body: Bytes,
) -> ApiResult<Response> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    let dtype = destination_type(&kind)?;
    if real_name(&source).is_empty() {
        return Err(ApiError::bad_request("the default exchange's bindings are implicit: it routes to the queue its routing key names"));
    }
    let body = body_object(&body)?;
    let routing_key = match body.get("routing_key") {
        None | Some(Value::Null) => "",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(ApiError::bad_request(format!("routing_key must be a string, not {other}"))),
    };
    check_name("routing key", routing_key)?;
    check_bind(&scope, &v, &source, dtype, &destination)?;
    let arguments = fields::table_from_json(body.get("arguments").unwrap_or(&Value::Null), "arguments")?;
    match dtype {
        "queue" => v.queue_bind(&destination, &source, routing_key, &arguments, API_CONNECTION)?,
        _ => v.exchange_bind(&destination, &source, routing_key, &arguments)?,
    }
    // Relative, as RabbitMQ's: the new binding's properties key, percent-encoded.
    let location: String = properties_key(routing_key, &arguments)
        .bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect();
    Ok((StatusCode::CREATED, [(header::LOCATION, location)]).into_response())
}

pub async fn binding(
    State(ctx): State<Arc<HttpContext>>,
    scope: Scope,
    Path((vhost_name, source, kind, destination, props)): Path<(String, String, String, String, String)>,
) -> ApiResult<Json<Value>> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    between(&v, &source, &kind, &destination)?
        .into_iter()
        .find(|b| b["properties_key"] == props.as_str())
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("no binding '{props}' from '{source}' to '{destination}'")))
}

pub async fn unbind(
    State(ctx): State<Arc<HttpContext>>,
    scope: Scope,
    Path((vhost_name, source, kind, destination, props)): Path<(String, String, String, String, String)>,
) -> ApiResult<StatusCode> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    let exchange = find(&v, &source)?;
    let dtype = destination_type(&kind)?;
    let found = exchange.bindings().into_iter().find(|b| {
        b.destination.is_queue() == (dtype == "queue") && b.destination.name() == destination && properties_key(&b.routing_key, &b.arguments) == props
    });
    let Some(b) = found else { return Err(ApiError::not_found(format!("no binding '{props}' from '{source}' to '{destination}'"))) };
    check_bind(&scope, &v, &source, dtype, &destination)?;
    match &b.destination {
        Destination::Queue(_) => v.queue_unbind(&destination, &exchange.name, &b.routing_key, &b.arguments, API_CONNECTION)?,
        Destination::Exchange(_) => v.exchange_unbind(&destination, &exchange.name, &b.routing_key, &b.arguments)?,
    }
    Ok(StatusCode::NO_CONTENT)
}
