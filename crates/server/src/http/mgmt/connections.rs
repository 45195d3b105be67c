//! `/api/connections` and `/api/channels`: this node's AMQP connections (from the registry,
//! `crate::connection::registry`) and their channels; closing a connection.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde_json::{json, Value};

use crate::http::list;
use super::{vhost, Params};
use crate::connection::registry::ConnectionInfo;
use crate::http::error::{ApiError, ApiResult};
use crate::http::fields;
use crate::http::HttpContext;

fn connection_json(ctx: &HttpContext, c: &ConnectionInfo) -> Value {
    json!({
        "name": c.name,
        "node": ctx.node_name,
        "vhost": c.opened.vhost,
        "user": c.opened.user,
        "user_who_performed_action": c.opened.user,
        "type": "network",
        "protocol": "AMQP 0-9-1",
        "state": "running",
        "auth_mechanism": "PLAIN",
        "ssl": false,
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

fn connections_of(ctx: &HttpContext, vhost: Option<&str>) -> Vec<Value> {
    ctx.connections.list().iter().filter(|c| vhost.is_none_or(|v| c.opened.vhost == v)).map(|c| connection_json(ctx, c)).collect()
}

pub async fn connections(State(ctx): State<Arc<HttpContext>>, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(connections_of(&ctx, None), &query)
}

pub async fn vhost_connections(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    vhost(&ctx, &name)?;
    list::answer(connections_of(&ctx, Some(&name)), &query)
}

fn find(ctx: &HttpContext, name: &str) -> ApiResult<Arc<ConnectionInfo>> {
    ctx.connections.find(name).ok_or_else(|| ApiError::not_found(format!("no connection '{name}' on this node")))
}

pub async fn connection(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>) -> ApiResult<Json<Value>> {
    Ok(Json(connection_json(&ctx, &*find(&ctx, &name)?)))
}

/// DELETE: closes the connection with connection.close 320 (CONNECTION_FORCED); the reason is the
/// `X-Reason` header if given, as RabbitMQ's.
pub async fn close_connection(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>, headers: HeaderMap) -> ApiResult<StatusCode> {
    let c = find(&ctx, &name)?;
    let reason = headers
        .get("x-reason")
        .and_then(|v| v.to_str().ok())
        .map(|r| r.chars().filter(|ch| !ch.is_control()).take(200).collect::<String>())
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "Closed via management plugin".to_owned());
    tracing::info!(connection = c.opened.id, name = %c.name, %reason, "connection closed through the management API");
    c.close(&reason);
    Ok(StatusCode::NO_CONTENT)
}

fn channels_of(ctx: &HttpContext, filter: impl Fn(&ConnectionInfo) -> bool) -> Vec<Value> {
    let mut out = Vec::new();
    for c in ctx.connections.list().iter().filter(|c| filter(c)) {
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

pub async fn channels(State(ctx): State<Arc<HttpContext>>, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(channels_of(&ctx, |_| true), &query)
}

pub async fn vhost_channels(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    vhost(&ctx, &name)?;
    list::answer(channels_of(&ctx, |c| c.opened.vhost == name), &query)
}

pub async fn connection_channels(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    find(&ctx, &name)?;
    list::answer(channels_of(&ctx, |c| c.name == name), &query)
}
