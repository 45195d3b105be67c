//! `/api/queues`: list, show, declare, delete, purge, bindings of queues (classic and quorum).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use warren_broker::vhost::QueueDeclare;
use warren_broker::queue::remote::HomeStats;
use warren_broker::{Queue, VHost};

use crate::http::list;
use super::scope::{Resource, Scope};
use super::{body_object, flag, rate, Params};
use warren_broker::auth::Perm;
use crate::http::error::{ApiError, ApiResult};
use crate::http::fields;
use crate::http::HttpContext;

/// The management API's own "connection" for the broker's calls: it owns no exclusive queue, and
/// AMQP connections are numbered from 1.
pub const API_CONNECTION: u64 = 0;

/// AMQP's longest name (a short string).
pub const MAX_NAME_BYTES: usize = 255;

pub fn check_name(what: &str, name: &str) -> ApiResult<()> {
    if name.len() > MAX_NAME_BYTES {
        return Err(ApiError::bad_request(format!("{what} name is {} bytes long; at most {MAX_NAME_BYTES} are allowed", name.len())));
    }
    Ok(())
}

/// A queue as RabbitMQ's API shows it.
pub fn queue_json(ctx: &HttpContext, vhost: &VHost, q: &Queue) -> Value {
    let ready = q.message_count() as u64;
    let unacked = q.unacked_count();
    let consumers = q.consumer_count();
    let mut v = json!({
        "name": q.name,
        "vhost": vhost.name,
        "durable": q.durable,
        "auto_delete": q.auto_delete,
        "exclusive": q.exclusive_owner.is_some(),
        "arguments": fields::table_to_json(&q.arguments),
        "type": if q.is_quorum() { "quorum" } else { "classic" },
        "state": "running",
        "node": ctx.node_name_of(q.home_node().unwrap_or_else(|| this_node_id(ctx))),
        "consumers": consumers,
        "consumer_capacity": if consumers > 0 { 1.0 } else { 0.0 },
        "consumer_utilisation": Value::Null,
        "exclusive_consumer_tag": Value::Null,
        "policy": Value::Null,
        "operator_policy": Value::Null,
        "effective_policy_definition": {},
        "messages": ready + unacked, "messages_details": rate(0.0),
        "messages_ready": ready, "messages_ready_details": rate(0.0),
        "messages_unacknowledged": unacked, "messages_unacknowledged_details": rate(0.0),
        // Warren's own: held by a delayed exchange until due (not in `messages`, as RabbitMQ's
        // plugin holds them outside the queue).
        "messages_delayed": vhost.delayed_count(q),
        "message_stats": crate::http::rates::queue_message_stats(&q.stats),
    });
    if q.args.retention_ms > 0 {
        // Warren's own: consumed messages kept for x-retention-seconds.
        v["messages_retained"] = q.retention_stats().consumed.into();
    }
    if q.is_quorum() {
        let members: Vec<u64> = q.recorded_members().unwrap_or_else(|| vec![this_node_id(ctx)]);
        let leader = match &ctx.cluster {
            Some(node) => node.leader(q.id).or_else(|| q.recorded_leader()),
            None => Some(this_node_id(ctx)),
        };
        let online: Vec<String> = members
            .iter()
            .filter(|m| ctx.cluster.as_ref().is_none_or(|node| **m == node.node_id() || node.is_reachable(**m)))
            .map(|m| ctx.node_name_of(*m))
            .collect();
        v["leader"] = leader.map_or(Value::Null, |l| Value::String(ctx.node_name_of(l)));
        v["members"] = members.iter().map(|m| ctx.node_name_of(*m)).collect();
        v["online"] = online.into();
        if let Some(l) = leader {
            v["node"] = ctx.node_name_of(l).into();
        }
    }
    v
}

fn this_node_id(ctx: &HttpContext) -> u64 {
    ctx.cluster.as_ref().map_or(0, |n| n.node_id())
}

/// How long a list or show waits for the home nodes of classic queues living elsewhere.
const HOME_STATS_WAIT: Duration = Duration::from_secs(2);

/// The counts of the classic queues among `queues` that live on other nodes, as their homes have
/// them: one request per home, all at once. A queue whose home did not answer in time maps to
/// None (its node is down or cut off).
pub(super) async fn home_stats(queues: &[Arc<Queue>]) -> HashMap<u64, Option<HomeStats>> {
    let mut by_home: BTreeMap<u64, Vec<Arc<Queue>>> = BTreeMap::new();
    for q in queues.iter().filter(|q| q.remote_home().is_some()) {
        by_home.entry(q.home_node().unwrap_or(0)).or_default().push(q.clone());
    }
    let asked: Vec<_> = by_home
        .into_values()
        .filter_map(|group| {
            let ask = group.first()?.remote_home()?.ask_stats(&group);
            Some((group, tokio::spawn(tokio::time::timeout(HOME_STATS_WAIT, ask))))
        })
        .collect();
    let mut out = HashMap::new();
    for (group, answer) in asked {
        let stats = match answer.await {
            Ok(Ok(Ok(stats))) => stats,
            Ok(Ok(Err(e))) => {
                tracing::debug!(home = group[0].home_node(), error = %e, "no counts from the home of classic queues");
                vec![None; group.len()]
            }
            _ => vec![None; group.len()],
        };
        out.extend(group.iter().map(|q| q.id).zip(stats));
    }
    out
}

/// `queue_json` of a classic queue living on another node, with its home's counts: or, with no
/// answer from the home, none and state `down` (as RabbitMQ shows a classic queue whose node is down).
fn with_home_stats(mut v: Value, stats: Option<HomeStats>) -> Value {
    match stats {
        Some(s) => {
            v["messages_ready"] = s.ready.into();
            v["messages_unacknowledged"] = s.unacked.into();
            v["messages"] = (s.ready + s.unacked).into();
            v["consumers"] = s.consumers.into();
            v["consumer_capacity"] = if s.consumers > 0 { 1.0 } else { 0.0 }.into();
            if v.get("messages_retained").is_some() {
                v["messages_retained"] = s.retained.into();
            }
        }
        None => {
            if let Some(o) = v.as_object_mut() {
                for key in ["messages", "messages_ready", "messages_unacknowledged", "consumers", "messages_retained"] {
                    o.remove(key);
                }
            }
            v["state"] = "down".into();
        }
    }
    v
}

async fn list_of(ctx: &HttpContext, scope: &Scope, vhost_name: Option<&str>) -> ApiResult<Vec<Value>> {
    let mut items = Vec::new();
    for v in scope.vhosts(ctx, vhost_name)? {
        let mut queues: Vec<Arc<Queue>> = v.queues().into_iter().filter(|q| !q.is_deleted()).collect();
        queues.sort_by(|a, b| a.name.cmp(&b.name));
        let mut homes = home_stats(&queues).await;
        items.extend(queues.iter().map(|q| match homes.remove(&q.id) {
            Some(stats) => with_home_stats(queue_json(ctx, &v, q), stats),
            None => queue_json(ctx, &v, q),
        }));
    }
    Ok(items)
}

pub async fn list_all(State(ctx): State<Arc<HttpContext>>, scope: Scope, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(list_of(&ctx, &scope, None).await?, &query)
}

pub async fn list_vhost(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path(vhost): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(list_of(&ctx, &scope, Some(&vhost)).await?, &query)
}

fn find(v: &VHost, name: &str) -> ApiResult<Arc<Queue>> {
    v.queue_any(name).filter(|q| !q.is_deleted()).ok_or_else(|| ApiError::not_found(format!("no queue '{name}' in vhost '{}'", v.name)))
}

pub async fn show(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>) -> ApiResult<Json<Value>> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    let q = find(&v, &name)?;
    let mut answer = queue_json(&ctx, &v, &q);
    // A classic queue living on another node: its counts are its home's.
    if let Some(stats) = home_stats(std::slice::from_ref(&q)).await.remove(&q.id) {
        answer = with_home_stats(answer, stats);
    }
    Ok(Json(answer))
}

/// PUT: declares the queue (201 when new, 204 when it existed with the same properties, 400 when
/// it exists with others, as queue.declare would refuse).
pub async fn declare(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>, body: Bytes) -> ApiResult<StatusCode> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    check_name("queue", &name)?;
    scope.check(&v.name, Perm::Configure, Resource::Queue, &name)?;
    let body = body_object(&body)?;
    let durable = flag(&body, "durable", true)?;
    let auto_delete = flag(&body, "auto_delete", false)?;
    if flag(&body, "exclusive", false)? {
        return Err(ApiError::bad_request("an exclusive queue belongs to a connection; the HTTP API cannot declare one"));
    }
    let mut arguments = fields::table_from_json(body.get("arguments").unwrap_or(&Value::Null), "arguments")?;
    if let Some(kind) = body.get("queue_type").and_then(Value::as_str) {
        arguments.insert("x-queue-type".into(), warren_protocol::field::FieldValue::LongString(kind.as_bytes().to_vec().into()));
    }
    let existed = v.queue_any(&name).is_some_and(|q| !q.is_deleted());
    v.queue_declare(&QueueDeclare { name: &name, passive: false, durable, exclusive: false, auto_delete, arguments: &arguments, connection_id: API_CONNECTION })?;
    Ok(if existed { StatusCode::NO_CONTENT } else { StatusCode::CREATED })
}

pub async fn delete(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>, Query(query): Params) -> ApiResult<StatusCode> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    scope.check(&v.name, Perm::Configure, Resource::Queue, &name)?;
    find(&v, &name)?;
    let if_unused = query.get("if-unused").is_some_and(|s| s == "true");
    let if_empty = query.get("if-empty").is_some_and(|s| s == "true");
    v.queue_delete(&name, if_unused, if_empty, API_CONNECTION)?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn purge(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>) -> ApiResult<StatusCode> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    scope.check(&v.name, Perm::Read, Resource::Queue, &name)?;
    find(&v, &name)?;
    v.queue_purge(&name, API_CONNECTION)?;
    Ok(StatusCode::NO_CONTENT)
}

/// POST `{"to": <unix ms, or an RFC 3339 time or a time ago like "-90m">}`: makes the consumed
/// messages published since then that the queue still keeps (`x-retention-seconds`) ready again
/// (`Queue::rewind`). 200 `{"rewound": N, "from": <publish time of the first kept message at or
/// after "to", or null>, "to": <asked, unix ms>, "clamped": <"to" is before the oldest one kept>}`.
pub async fn rewind(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>, body: Bytes) -> ApiResult<Json<Value>> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    // As a purge: read permission on the queue; an exclusive queue belongs to its connection.
    scope.check(&v.name, Perm::Read, Resource::Queue, &name)?;
    find(&v, &name)?;
    let q = v.queue(&name, API_CONNECTION)?;
    let body = body_object(&body)?;
    let to = match body.get("to") {
        Some(Value::Number(n)) => n.as_u64().ok_or_else(|| ApiError::bad_request(format!("\"to\" must be unix milliseconds (a whole number from 0), not {n}")))?,
        Some(Value::String(text)) => crate::time_point::parse(text, warren_broker::now_ms()).map_err(ApiError::bad_request)?,
        _ => return Err(ApiError::bad_request("give the point in time to rewind to as \"to\": unix milliseconds, an RFC 3339 time or a time ago like \"-90m\"")),
    };
    let outcome = q.rewind(to).await?;
    Ok(Json(json!({"rewound": outcome.rewound, "from": outcome.from_ms, "to": to, "clamped": outcome.clamped})))
}

pub async fn bindings(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path((vhost_name, name)): Path<(String, String)>, Query(query): Params) -> ApiResult<Json<Value>> {
    let v = scope.vhost(&ctx, &vhost_name)?;
    find(&v, &name)?;
    let items = super::exchanges::bindings_of(&v).into_iter().filter(|b| b["destination"] == name.as_str() && b["destination_type"] == "queue").collect();
    list::answer(items, &query)
}
