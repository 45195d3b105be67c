//! `/api/definitions`: export users (with their password hashes), vhosts, permissions, topic
//! permissions and the topology (exchanges, queues, bindings) in RabbitMQ's format, and import
//! such a file, a RabbitMQ 3.x export included: its users log in with their RabbitMQ passwords.
//!
//! An import is checked whole before anything changes (hashes decode, algorithms are known,
//! patterns compile, every entry names a vhost the node or the file has). Then, in RabbitMQ's
//! order: users, vhosts, permissions, topic permissions and vhost limits, recorded in entries of
//! at most [`AUTH_OPS_PER_ENTRY`] ops (not atomic across entries: a failure says so), then
//! exchanges, queues and bindings; declaring what exists with the same properties changes
//! nothing, so importing the same file twice is harmless. A per-vhost import takes no users.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use warren_broker::auth::defs::{self, PermissionDef, TopicPermissionDef, UserDef, VHostDef, VHostLimits};
use warren_broker::auth::{Algorithm, PasswordHash};
use warren_broker::metadata::Op;
use warren_broker::vhost::{ExchangeDeclare, QueueDeclare};

use super::queues::{check_name, API_CONNECTION};
use super::{flag, vhost, RABBITMQ_VERSION};
use crate::http::auth::AuthUser;
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
            queues.push(json!({"name": q.name, "vhost": v.name, "durable": true, "auto_delete": q.auto_delete,
                "type": if q.is_quorum() { "quorum" } else { "classic" }, "arguments": fields::table_to_json(&q.arguments)}));
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
    // As RabbitMQ exports them: runtime parameters of component `vhost-limits`.
    let limit_parameters: Vec<Value> = vhost_defs
        .iter()
        .filter(|(_, l)| *l != VHostLimits::default())
        .map(|(d, l)| json!({"vhost": d.name, "component": "vhost-limits", "name": "limits", "value": l}))
        .collect();
    Ok(json!({
        "rabbit_version": RABBITMQ_VERSION, "rabbitmq_version": RABBITMQ_VERSION, "product_name": "Warren",
        "product_version": env!("CARGO_PKG_VERSION"),
        "users": users,
        "vhosts": vhosts.iter().map(|v| {
            let def = vhost_defs.iter().find(|(d, _)| d.name == v.name);
            let (description, tags) = def.map(|(d, _)| (d.description.clone(), d.tags.clone())).unwrap_or_default();
            let limits: Vec<Value> = def
                .map(|(_, l)| [("max-connections", l.max_connections), ("max-queues", l.max_queues)].into_iter().filter_map(|(k, n)| n.map(|n| json!([k, n]))).collect())
                .unwrap_or_default();
            json!({"name": v.name, "limits": limits, "metadata": {"description": description, "tags": tags}})
        }).collect::<Vec<_>>(),
        "permissions": permissions,
        "topic_permissions": topic_permissions, "parameters": limit_parameters, "global_parameters": [], "policies": [],
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

/// Auth changes recorded per metadata entry: bounded, however large the file.
const AUTH_OPS_PER_ENTRY: usize = 256;

fn list<'a>(defs: &'a Value, key: &str) -> ApiResult<&'a [Value]> {
    match defs.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(ApiError::bad_request(format!("{key} must be a list"))),
    }
}

fn text<'a>(item: &'a Value, key: &str, what: &str) -> ApiResult<&'a str> {
    item.get(key).and_then(Value::as_str).ok_or_else(|| ApiError::bad_request(format!("{what} has no {key}")))
}

/// An optional string field: absent or null is None; any other type is refused, without repeating
/// the value (it may be a password or a hash: a user given a number for a hash must not become a
/// user without a password).
fn optional_text<'a>(item: &'a Value, key: &str, what: &str) -> ApiResult<Option<&'a str>> {
    match item.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(ApiError::bad_request(format!("{what}: {key} must be a string, not {}", super::kind_of(other)))),
    }
}

/// The users, vhosts, permissions, topic permissions and vhost limits of a definitions file, as
/// metadata ops in RabbitMQ's import order, every one checked.
fn auth_ops(ctx: &HttpContext, defs: &Value, importer: &str) -> ApiResult<Vec<Op>> {
    let mut ops = Vec::new();
    for (i, u) in list(defs, "users")?.iter().enumerate() {
        let what = format!("users[{i}]");
        let name = text(u, "name", &what)?.to_string();
        let what = format!("{what} ({name})");
        let algorithm = optional_text(u, "hashing_algorithm", &what)?.unwrap_or(Algorithm::Sha256.rabbitmq_name()).to_string();
        let password_hash = match (optional_text(u, "password_hash", &what)?, optional_text(u, "password", &what)?) {
            (Some(hash), _) => hash.to_string(),
            (None, Some(password)) => PasswordHash::new(Algorithm::from_rabbitmq_name(&algorithm)?, password).to_rabbitmq().0,
            (None, None) => String::new(),
        };
        let tags = defs::parse_tags(u.get("tags").unwrap_or(&Value::Null)).map_err(|e| format!("{what}: {e}"))?;
        let limits = u.get("limits").cloned().filter(|l| l.as_object().is_some_and(|o| !o.is_empty())).unwrap_or(Value::Null);
        let user = UserDef { name: name.clone(), password_hash, hashing_algorithm: algorithm, tags, limits };
        user.check().map_err(|e| format!("{what}: {e}"))?;
        ops.push(Op::UserPut { user });
    }
    for (i, v) in list(defs, "vhosts")?.iter().enumerate() {
        let what = format!("vhosts[{i}]");
        let name = text(v, "name", &what)?;
        defs::check_name("vhost", name)?;
        let metadata = v.get("metadata").unwrap_or(&Value::Null);
        let description = v.get("description").or_else(|| metadata.get("description")).and_then(Value::as_str).unwrap_or_default();
        let tags = defs::parse_tags(v.get("tags").or_else(|| metadata.get("tags")).unwrap_or(&Value::Null)).map_err(|e| format!("{what}: {e}"))?;
        let default_queue_type = v.get("default_queue_type").or_else(|| metadata.get("default_queue_type")).and_then(Value::as_str).map(str::to_string);
        ops.push(Op::VhostDeclared { vhost: VHostDef { name: name.to_string(), description: description.to_string(), tags, default_queue_type } });
        // A vhost the import creates is its importer's too, as RabbitMQ's import (the file's
        // permissions, set after, may say otherwise).
        if ctx.broker.vhost(name).is_none() {
            ops.push(Op::PermissionSet { permission: PermissionDef::all(importer, name) });
        }
        // RabbitMQ 3.10 also writes a vhost's limits as pairs here: [["max-connections", 10], ...].
        if let Some(pairs) = v.get("limits").and_then(Value::as_array).filter(|p| !p.is_empty()) {
            let limit = |key: &str| pairs.iter().find(|p| p.get(0).and_then(Value::as_str) == Some(key)).and_then(|p| p.get(1)).and_then(Value::as_i64).filter(|n| *n >= 0);
            let limits = VHostLimits { max_connections: limit("max-connections"), max_queues: limit("max-queues") };
            ops.push(Op::VhostLimitsSet { vhost: name.to_string(), limits });
        }
    }
    for (i, p) in list(defs, "permissions")?.iter().enumerate() {
        let what = format!("permissions[{i}]");
        let permission = PermissionDef {
            user: text(p, "user", &what)?.into(),
            vhost: text(p, "vhost", &what)?.into(),
            configure: text(p, "configure", &what)?.into(),
            write: text(p, "write", &what)?.into(),
            read: text(p, "read", &what)?.into(),
        };
        permission.check().map_err(|e| format!("{what}: {e}"))?;
        ops.push(Op::PermissionSet { permission });
    }
    for (i, p) in list(defs, "topic_permissions")?.iter().enumerate() {
        let what = format!("topic_permissions[{i}]");
        let permission = TopicPermissionDef {
            user: text(p, "user", &what)?.into(),
            vhost: text(p, "vhost", &what)?.into(),
            exchange: text(p, "exchange", &what)?.into(),
            write: text(p, "write", &what)?.into(),
            read: text(p, "read", &what)?.into(),
        };
        permission.check().map_err(|e| format!("{what}: {e}"))?;
        ops.push(Op::TopicPermissionSet { permission });
    }
    // RabbitMQ keeps vhost limits as runtime parameters of component `vhost-limits`; other
    // parameters (federation, shovel) are not kept yet.
    for (i, p) in list(defs, "parameters")?.iter().enumerate().filter(|(_, p)| p.get("component").and_then(Value::as_str) == Some("vhost-limits")) {
        let what = format!("parameters[{i}]");
        let value = p.get("value").unwrap_or(&Value::Null);
        let limit = |key: &str| value.get(key).and_then(Value::as_i64).filter(|n| *n >= 0);
        let limits = VHostLimits { max_connections: limit("max-connections"), max_queues: limit("max-queues") };
        ops.push(Op::VhostLimitsSet { vhost: text(p, "vhost", &what)?.into(), limits });
    }
    Ok(ops)
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
        let in_file = || list(defs, "vhosts").is_ok_and(|vs| vs.iter().any(|v| v.get("name").and_then(Value::as_str) == Some(vhost_name.as_str())));
        if ctx.broker.vhost(&vhost_name).is_none() && (into.is_some() || !in_file()) {
            return Err(ApiError::bad_request(format!("{key}[{i}] is in vhost '{vhost_name}', which neither this node nor the file has; nothing was imported")));
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

fn import(ctx: &HttpContext, body: &[u8], into: Option<&str>, importer: &str) -> ApiResult<StatusCode> {
    let defs: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("the definitions are not valid JSON: {e}")))?;
    if !defs.is_object() {
        return Err(ApiError::bad_request("the definitions must be a JSON object"));
    }
    let auth = if into.is_none() { auth_ops(ctx, &defs, importer)? } else { Vec::new() };
    let exchanges = entries(ctx, &defs, "exchanges", into)?;
    let queues = entries(ctx, &defs, "queues", into)?;
    let bindings = entries(ctx, &defs, "bindings", into)?;
    for (n, chunk) in auth.chunks(AUTH_OPS_PER_ENTRY).enumerate() {
        ctx.broker.change_auth(chunk.to_vec()).map_err(|e| {
            let done = n * AUTH_OPS_PER_ENTRY;
            let reason = format!("importing users, vhosts and permissions stopped after {done} of {} changes: {e}", auth.len());
            match e {
                warren_broker::AuthChangeError::Refused(_) => ApiError::bad_request(reason),
                warren_broker::AuthChangeError::Failed { .. } => ApiError::unavailable(reason),
            }
        })?;
    }
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
        let mut args = fields::table_from_json(item.get("arguments").unwrap_or(&Value::Null), "arguments")?;
        // 3.10 exports also say `type`; a quorum queue without the argument is still one.
        if let Some(kind @ "quorum") = item.get("type").and_then(Value::as_str) {
            if args.get("x-queue-type").is_none() {
                args.insert("x-queue-type".into(), warren_protocol::field::FieldValue::LongString(kind.as_bytes().to_vec().into()));
            }
        }
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
    tracing::info!(auth_changes = auth.len(), exchanges = exchanges.len(), queues = queues.len(), bindings = bindings.len(), "definitions imported through the management API");
    let left = not_imported(&defs);
    if !left.is_empty() {
        tracing::warn!(not_imported = %left.join(", "), "definitions: what Warren does not keep yet was left out (policies: security-plan.md step 8); \
            the queues they would apply to behave by their own arguments");
    }
    Ok(StatusCode::NO_CONTENT)
}

/// What of a definitions file the import leaves out, named for the log (names only: a
/// parameter's value may hold a federation upstream's password): policies, operator policies,
/// runtime parameters other than vhost limits, global parameters.
fn not_imported(defs: &Value) -> Vec<String> {
    let named = |item: &Value, keys: &[&str]| keys.iter().map(|k| item.get(*k).and_then(Value::as_str).unwrap_or("?")).collect::<Vec<_>>().join("/");
    let mut left = Vec::new();
    for (key, keys) in [("policies", &["vhost", "name"][..]), ("operator_policies", &["vhost", "name"][..]), ("global_parameters", &["name"][..])] {
        for item in list(defs, key).unwrap_or_default() {
            left.push(format!("{key} {}", named(item, keys)));
        }
    }
    for item in list(defs, "parameters").unwrap_or_default().iter().filter(|p| p.get("component").and_then(Value::as_str) != Some("vhost-limits")) {
        left.push(format!("parameter {}", named(item, &["vhost", "component", "name"])));
    }
    // A long list is cut: the log line stays readable.
    if left.len() > 20 {
        let more = left.len() - 20;
        left.truncate(20);
        left.push(format!("and {more} more"));
    }
    left
}

pub async fn import_all(State(ctx): State<Arc<HttpContext>>, Extension(AuthUser(user)): Extension<AuthUser>, body: Bytes) -> ApiResult<StatusCode> {
    import(&ctx, &body, None, &user.name)
}

pub async fn import_vhost(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>, body: Bytes) -> ApiResult<StatusCode> {
    vhost(&ctx, &name)?;
    import(&ctx, &body, Some(&name), "")
}
