//! `/api/connections`, `/api/channels` and `/api/consumers`: the AMQP connections of every node
//! (each from its registry, `crate::connection::registry`; the others' through `peers`), their
//! channels and consumers; closing a connection.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde_json::{json, Value};

use crate::classic_home::RELAY_CONNECTION;
use crate::http::list;
use super::peers::{self, Query as PeerQuery};
use super::scope::Scope;
use super::Params;
use crate::connection::registry::ConnectionInfo;
use crate::http::error::{ApiError, ApiResult};
use crate::http::fields;
use crate::http::HttpContext;

fn connection_json(ctx: &HttpContext, c: &ConnectionInfo) -> Value {
    let tls = c.opened.tls.as_ref();
    let peer = tls.and_then(|t| t.peer.as_ref());
    json!({
        "name": c.name,
        "node": ctx.node_name,
        "vhost": c.opened.vhost,
        "user": c.opened.user,
        "user_who_performed_action": c.opened.user,
        "type": "network",
        "protocol": "AMQP 0-9-1",
        "state": "running",
        "auth_mechanism": c.opened.auth_mechanism,
        "ssl": tls.is_some(),
        "ssl_protocol": tls.map(|t| t.protocol),
        "ssl_cipher": tls.map(|t| t.cipher.as_str()),
        "peer_cert_subject": peer.map(|p| p.subject.as_str()),
        "peer_cert_issuer": peer.map(|p| p.issuer.as_str()),
        "peer_cert_validity": peer.map(|p| p.validity.as_str()),
        "host": c.opened.local.ip().to_string(),
        "port": c.opened.local.port(),
        "peer_host": c.opened.peer.ip().to_string(),
        "peer_port": c.opened.peer.port(),
        "connected_at": c.connected_at,
        "timeout": c.opened.heartbeat,
        "frame_max": c.opened.frame_max,
        "channel_max": c.opened.channel_max,
        "channels": c.channels.lock().len(),
        "client_properties": fields::table_to_json(&c.opened.client_properties),
    })
}

/// This node's connections.
pub(super) fn local_connections(ctx: &HttpContext) -> Vec<Value> {
    ctx.connections.list().iter().map(|c| connection_json(ctx, c)).collect()
}

/// The user a connection, channel or consumer (`channel_details`) of a list belongs to.
fn owner(item: &Value) -> &str {
    item.get("user").or_else(|| item["channel_details"].get("user")).and_then(Value::as_str).unwrap_or("")
}

/// Every node's connections (`peers`), those of `vhost` only if given.
async fn connections_of(ctx: &HttpContext, vhost: Option<&str>) -> Vec<Value> {
    let mut items = peers::everywhere(ctx, PeerQuery::Connections).await;
    items.retain(|c| vhost.is_none_or(|v| c["vhost"] == v));
    items
}

/// The user's own connections, channels or consumers among `items` (all of them for monitors).
fn visible(scope: &Scope, mut items: Vec<Value>) -> Vec<Value> {
    items.retain(|c| scope.sees_owner(owner(c)));
    items
}

pub async fn connections(State(ctx): State<Arc<HttpContext>>, scope: Scope, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(visible(&scope, connections_of(&ctx, None).await), &query)
}

pub async fn vhost_connections(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path(name): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    scope.vhost(&ctx, &name)?;
    list::answer(visible(&scope, connections_of(&ctx, Some(&name)).await), &query)
}

/// The user's own connections and channels (the overview's counts for a non-monitor).
pub(super) async fn own_totals(ctx: &HttpContext, scope: &Scope) -> (usize, usize) {
    let connections = visible(scope, connections_of(ctx, None).await).len();
    let channels = visible(scope, peers::everywhere(ctx, PeerQuery::Channels).await).len();
    (connections, channels)
}

/// Connection `name` on any node.
async fn find(ctx: &HttpContext, name: &str) -> ApiResult<Value> {
    if let Some(c) = ctx.connections.find(name) {
        return Ok(connection_json(ctx, &c));
    }
    connections_of(ctx, None)
        .await
        .into_iter()
        .find(|c| c["name"] == name)
        .ok_or_else(|| ApiError::not_found(format!("no connection '{name}' on any node that answered")))
}

pub async fn connection(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path(name): Path<String>) -> ApiResult<Json<Value>> {
    let c = find(&ctx, &name).await?;
    scope.may_see(owner(&c))?;
    Ok(Json(c))
}

/// Closes connection `name` if it is this node's; whether it was.
pub(super) fn close_local(ctx: &HttpContext, name: &str, reason: &str) -> bool {
    let Some(c) = ctx.connections.find(name) else { return false };
    tracing::info!(connection = c.opened.id, name = %c.name, %reason, "connection closed through the management API");
    c.close(reason);
    true
}

/// DELETE: closes the connection, on whichever node has it, with connection.close 320
/// (CONNECTION_FORCED); the reason is the `X-Reason` header if given, as RabbitMQ's.
pub async fn close_connection(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path(name): Path<String>, headers: HeaderMap) -> ApiResult<StatusCode> {
    let c = find(&ctx, &name).await?;
    scope.may_close(owner(&c))?;
    let reason = headers
        .get("x-reason")
        .and_then(|v| v.to_str().ok())
        .map(|r| r.chars().filter(|ch| !ch.is_control()).take(200).collect::<String>())
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "Closed via management plugin".to_owned());
    if close_local(&ctx, &name, &reason) || peers::close_elsewhere(&ctx, &name, &reason).await {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("no connection '{name}' on any node that answered")))
    }
}

/// This node's channels.
pub(super) fn local_channels(ctx: &HttpContext) -> Vec<Value> {
    let mut out = Vec::new();
    for c in ctx.connections.list().iter() {
        for number in c.channels.lock().iter() {
            out.push(json!({
                "name": format!("{} ({number})", c.name),
                "number": number,
                "node": ctx.node_name,
                "vhost": c.opened.vhost,
                "user": c.opened.user,
                "state": "running",
                "connection_details": {"name": c.name, "peer_host": c.opened.peer.ip().to_string(), "peer_port": c.opened.peer.port()},
            }));
        }
    }
    out
}

/// Every node's channels that `keep` keeps.
async fn channels_of(ctx: &HttpContext, keep: impl Fn(&Value) -> bool) -> Vec<Value> {
    let mut items = peers::everywhere(ctx, PeerQuery::Channels).await;
    items.retain(keep);
    items
}

pub async fn channels(State(ctx): State<Arc<HttpContext>>, scope: Scope, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(visible(&scope, channels_of(&ctx, |_| true).await), &query)
}

pub async fn vhost_channels(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path(name): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    scope.vhost(&ctx, &name)?;
    list::answer(visible(&scope, channels_of(&ctx, |c| c["vhost"] == name.as_str()).await), &query)
}

pub async fn connection_channels(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path(name): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    let c = find(&ctx, &name).await?;
    scope.may_see(owner(&c))?;
    list::answer(channels_of(&ctx, |c| c["connection_details"]["name"] == name.as_str()).await, &query)
}

/// This node's consumers: those of its clients' channels, on queues living here and relayed to
/// queues living elsewhere (the relay consumers other nodes keep here are theirs to list).
pub(super) fn local_consumers(ctx: &HttpContext) -> Vec<Value> {
    let connections = ctx.connections.list();
    let mut items = Vec::new();
    for v in ctx.broker.vhosts() {
        let mut queues = v.queues();
        queues.sort_by(|a, b| a.name.cmp(&b.name));
        for q in queues.iter().filter(|q| !q.is_deleted()) {
            for c in q.consumers_here().iter().filter(|c| c.channel.connection_id() != RELAY_CONNECTION) {
                let connection = connections.iter().find(|info| info.opened.id == c.channel.connection_id());
                let connection_name = connection.map_or_else(String::new, |info| info.name.clone());
                items.push(json!({
                    "consumer_tag": &*c.tag,
                    "queue": {"name": q.name, "vhost": v.name},
                    "channel_details": {
                        "name": format!("{connection_name} ({})", c.channel.number()),
                        "number": c.channel.number(),
                        "connection_name": connection_name,
                        "node": ctx.node_name,
                        "user": connection.map(|info| info.opened.user.clone()),
                        "peer_host": connection.map(|info| info.opened.peer.ip().to_string()),
                        "peer_port": connection.map(|info| info.opened.peer.port()),
                    },
                    "ack_required": !c.no_ack,
                    "exclusive": c.exclusive,
                    "prefetch_count": c.prefetch,
                    "active": true,
                    "activity_status": "up",
                    "arguments": if c.priority != 0 { json!({"x-priority": c.priority}) } else { json!({}) },
                }));
            }
        }
    }
    items
}

/// `/api/consumers[/{vhost}]`: every node's consumers, as RabbitMQ lists them.
/// Administrator and monitoring see everyone's, the others those of their own channels.
pub async fn consumers(State(ctx): State<Arc<HttpContext>>, scope: Scope, vhost_name: Option<Path<String>>, Query(query): Params) -> ApiResult<Json<Value>> {
    let only = vhost_name.map(|Path(v)| v);
    if let Some(name) = &only {
        scope.vhost(&ctx, name)?;
    }
    let mut items = peers::everywhere(&ctx, PeerQuery::Consumers).await;
    items.retain(|c| only.as_deref().is_none_or(|v| c["queue"]["vhost"] == v));
    list::answer(visible(&scope, items), &query)
}
