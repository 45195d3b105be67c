//! `/api/definitions`: export the topology (exchanges, queues, bindings; vhosts, users and
//! permissions as they are) in RabbitMQ's format, and import such a file.
//!
//! An import is checked whole before anything changes: a file naming a vhost or a user this node
//! does not have is refused (they come with issue 37), as is a malformed entry. Then exchanges,
//! queues and bindings are declared in that order, as RabbitMQ does; declaring what exists with
//! the same properties changes nothing, so importing the same file twice is harmless.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use warren_broker::vhost::{ExchangeDeclare, QueueDeclare};

use super::queues::{check_name, API_CONNECTION};
use super::{flag, vhost, RABBITMQ_VERSION};
use crate::http::error::{ApiError, ApiResult};
use crate::http::fields;
use crate::http::HttpContext;

fn export(ctx: &HttpContext, only: Option<&str>) -> ApiResult<Value> {
    let vhosts = super::vhosts(ctx, only)?;
    let (mut queues, mut exchanges, mut bindings) = (Vec::new(), Vec::new(), Vec::new());
    for v in &vhosts {
        let mut qs = v.queues();
        qs.sort_by(|a, b| a.name.cmp(&b.name));
        for q in qs.iter().filter(|q| q.durable && q.exclusive_owner.is_none() && !q.is_deleted()) {
            queues.push(json!({"name": q.name, "vhost": v.name, "durable": true, "auto_delete": q.auto_delete, "arguments": fields::table_to_json(&q.arguments)}));
        }
        let mut es = v.exchanges();
        es.sort_by(|a, b| a.name.cmp(&b.name));
        for e in es.iter().filter(|e| e.durable && !e.name.is_empty() && !e.name.starts_with("amq.")) {
            exchanges.push(json!({"name": e.name, "vhost": v.name, "type": e.type_name(), "durable": true,
                "auto_delete": e.auto_delete, "internal": e.internal, "arguments": fields::table_to_json(&e.arguments)}));
        }
        for e in es.iter().filter(|e| !e.name.is_empty()) {
            for b in e.bindings().iter().filter(|b| e.durable && b.destination.durable()) {
                bindings.push(json!({"source": e.name, "vhost": v.name, "destination": b.destination.name(),
                    "destination_type": if b.destination.is_queue() { "queue" } else { "exchange" },
                    "routing_key": b.routing_key, "arguments": fields::table_to_json(&b.arguments)}));
            }
        }
    }
    if only.is_some() {
        // A vhost's definitions carry no vhost names (RabbitMQ's shape: they import into any vhost).
        for item in queues.iter_mut().chain(exchanges.iter_mut()).chain(bindings.iter_mut()) {
            if let Some(m) = item.as_object_mut() {
                m.remove("vhost");
            }
        }
        return Ok(json!({"rabbit_version": RABBITMQ_VERSION, "rabbitmq_version": RABBITMQ_VERSION, "product_name": "Warren",
            "product_version": env!("CARGO_PKG_VERSION"), "parameters": [], "policies": [],
            "queues": queues, "exchanges": exchanges, "bindings": bindings}));
    }
    let users: Vec<Value> = ctx.broker.users().all().iter().map(|u| super::access::user_json(u)).collect();
    let permissions = super::access::all_permissions(ctx);
    let topic_permissions: Vec<Value> = ctx.broker.users().topic_permissions().iter()
        .map(|p| json!({"user": p.user, "vhost": p.vhost, "exchange": p.exchange, "write": p.write, "read": p.read})).collect();
    let vhost_defs = ctx.broker.vhost_defs();
    Ok(json!({
        "rabbit_version": RABBITMQ_VERSION, "rabbitmq_version": RABBITMQ_VERSION, "product_name": "Warren",
        "product_version": env!("CARGO_PKG_VERSION"),
        "users": users,
        "vhosts": vhosts.iter().map(|v| {
            let def = vhost_defs.iter().find(|(d, _)| d.name == v.name);
            let (description, tags) = def.map(|(d, _)| (d.description.clone(), d.tags.clone())).unwrap_or_default();
            json!({"name": v.name, "limits": [], "metadata": {"description": description, "tags": tags}})
        }).collect::<Vec<_>>(),
        "permissions": permissions,
        "topic_permissions": topic_permissions, "parameters": [], "global_parameters": [], "policies": [],
        "queues": queues, "exchanges": exchanges, "bindings": bindings,
    }))
}

pub async fn export_all(State(ctx): State<Arc<HttpContext>>) -> ApiResult<Json<Value>> {
    Ok(Json(export(&ctx, None)?))
}

pub async fn export_vhost(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>) -> ApiResult<Json<Value>> {
    Ok(Json(export(&ctx, Some(&name))?))
}

/// One entry of a definitions file, checked: its vhost and its name.
struct Entry<'a> {
    vhost: String,
    item: &'a Value,
}

fn entries<'a>(ctx: &HttpContext, defs: &'a Value, key: &str, into: Option<&str>) -> ApiResult<Vec<Entry<'a>>> {
    let items = match defs.get(key) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(ApiError::bad_request(format!("{key} must be a list"))),
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let vhost_name = match into {
            Some(v) => v.to_owned(),
            None => item.get("vhost").and_then(Value::as_str).ok_or_else(|| ApiError::bad_request(format!("{key}[{i}] has no vhost")))?.to_owned(),
        };
        if ctx.broker.vhost(&vhost_name).is_none() {
            return Err(ApiError::bad_request(format!("{key}[{i}] is in vhost '{vhost_name}', which this node does not have; nothing was imported")));
        }
        let name_key = if key == "bindings" { "source" } else { "name" };
        let name = item.get(name_key).and_then(Value::as_str).ok_or_else(|| ApiError::bad_request(format!("{key}[{i}] has no {name_key}")))?;
        check_name(key, name)?;
        if key == "bindings" {
            item.get("destination").and_then(Value::as_str).ok_or_else(|| ApiError::bad_request(format!("bindings[{i}] has no destination")))?;
        }
        fields::table_from_json(item.get("arguments").unwrap_or(&Value::Null), "arguments").map_err(|e| ApiError::bad_request(format!("{key}[{i}]: {e}")))?;
        out.push(Entry { vhost: vhost_name, item });
    }
    Ok(out)
}

fn import(ctx: &HttpContext, body: &[u8], into: Option<&str>) -> ApiResult<StatusCode> {
    let defs: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("the definitions are not valid JSON: {e}")))?;
    if !defs.is_object() {
        return Err(ApiError::bad_request("the definitions must be a JSON object"));
    }
    if into.is_none() {
        for v in defs.get("vhosts").and_then(Value::as_array).into_iter().flatten() {
            let name = v.get("name").and_then(Value::as_str).unwrap_or("");
            if ctx.broker.vhost(name).is_none() {
                return Err(ApiError::bad_request(format!("vhost '{name}' does not exist and this Warren version cannot create vhosts; nothing was imported")));
            }
        }
        let users = ctx.broker.users();
        for u in defs.get("users").and_then(Value::as_array).into_iter().flatten() {
            let name = u.get("name").and_then(Value::as_str).unwrap_or("");
            if users.user(name).is_none() {
                return Err(ApiError::bad_request(format!("user '{name}' does not exist and this Warren version cannot create users; nothing was imported")));
            }
        }
    }
    let exchanges = entries(ctx, &defs, "exchanges", into)?;
    let queues = entries(ctx, &defs, "queues", into)?;
    let bindings = entries(ctx, &defs, "bindings", into)?;
    for Entry { vhost: v, item } in &exchanges {
        let v = vhost(ctx, v)?;
        let args = fields::table_from_json(item.get("arguments").unwrap_or(&Value::Null), "arguments")?;
        v.exchange_declare(&ExchangeDeclare {
            name: item["name"].as_str().unwrap_or_default(),
            kind: item.get("type").and_then(Value::as_str).unwrap_or("direct"),
            passive: false,
            durable: flag(item, "durable", true)?,
            auto_delete: flag(item, "auto_delete", false)?,
            internal: flag(item, "internal", false)?,
            arguments: &args,
        })?;
    }
    for Entry { vhost: v, item } in &queues {
        let v = vhost(ctx, v)?;
        let args = fields::table_from_json(item.get("arguments").unwrap_or(&Value::Null), "arguments")?;
        v.queue_declare(&QueueDeclare {
            name: item["name"].as_str().unwrap_or_default(),
            passive: false,
            durable: flag(item, "durable", true)?,
            exclusive: false,
            auto_delete: flag(item, "auto_delete", false)?,
            arguments: &args,
            connection_id: API_CONNECTION,
        })?;
    }
    for Entry { vhost: v, item } in &bindings {
        let v = vhost(ctx, v)?;
        let args = fields::table_from_json(item.get("arguments").unwrap_or(&Value::Null), "arguments")?;
        let source = item["source"].as_str().unwrap_or_default();
        let destination = item["destination"].as_str().unwrap_or_default();
        let routing_key = item.get("routing_key").and_then(Value::as_str).unwrap_or("");
        match item.get("destination_type").and_then(Value::as_str).unwrap_or("queue") {
            "exchange" => v.exchange_bind(destination, source, routing_key, &args)?,
            _ => v.queue_bind(destination, source, routing_key, &args, API_CONNECTION)?,
        }
    }
    tracing::info!(exchanges = exchanges.len(), queues = queues.len(), bindings = bindings.len(), "definitions imported through the management API");
    Ok(StatusCode::NO_CONTENT)
}

pub async fn import_all(State(ctx): State<Arc<HttpContext>>, body: Bytes) -> ApiResult<StatusCode> {
    import(&ctx, &body, None)
}

pub async fn import_vhost(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>, body: Bytes) -> ApiResult<StatusCode> {
    vhost(&ctx, &name)?;
    import(&ctx, &body, Some(&name))
}
