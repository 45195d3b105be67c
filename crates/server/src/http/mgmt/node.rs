//! The node and the cluster: overview, nodes, who am I, vhosts, users, permissions, health checks.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{Extension, Json};
use serde_json::{json, Value};

use crate::http::list;
use warren_broker::auth::defs::{VHostDef, VHostLimits};
use super::scope::{Resource, Scope};
use super::{rate, Params, RABBITMQ_VERSION};
use warren_broker::auth::Perm;

/// The queue RabbitMQ's aliveness test declares.
const ALIVENESS_QUEUE: &str = "aliveness-test";
use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, ApiResult};
use crate::http::rates::Window;
use crate::http::HttpContext;

/// The overview. For administrator and monitoring, everything's totals and the node's details;
/// for the others, as RabbitMQ: the queues and exchanges of the vhosts they may see, their own
/// connections and channels, no consumer count, no node, listeners or contexts.
pub async fn overview(State(ctx): State<Arc<HttpContext>>, scope: Scope, Query(query): Params) -> ApiResult<Json<Value>> {
    let (mut ready, mut unacked, mut queues, mut exchanges, mut consumers) = (0u64, 0u64, 0usize, 0usize, 0u64);
    let counted = if scope.is_monitor() { super::vhosts(&ctx, None)? } else { scope.vhosts(&ctx, None)? };
    // Classic queues living on other nodes are counted as their homes count them (this node's
    // copy holds nothing); one request per home, as `/api/queues` asks.
    let mut elsewhere = Vec::new();
    for v in counted {
        for q in v.queues().into_iter().filter(|q| !q.is_deleted()) {
            queues += 1;
            if q.remote_home().is_some() {
                elsewhere.push(q);
                continue;
            }
            ready += q.message_count() as u64;
            unacked += q.unacked_count();
            consumers += q.consumer_count() as u64;
        }
        exchanges += v.exchanges().len();
    }
    for stats in super::queues::home_stats(&elsewhere).await.into_values().flatten() {
        ready += stats.ready;
        unacked += stats.unacked;
        consumers += stats.consumers as u64;
    }
    let (connections, channels) = if scope.is_monitor() {
        super::peers::totals(&ctx).await
    } else {
        let (c, ch) = super::connections::own_totals(&ctx, &scope).await;
        (c as u64, ch as u64)
    };
    // Every node's, as RabbitMQ lists them (those that answer).
    let listeners: Vec<Value> = if scope.is_monitor() { super::peers::everywhere(&ctx, super::peers::Query::Listeners).await } else { Vec::new() };
    let [messages_details, ready_details, unacked_details] = ctx.rates.length_details(Window::from_query(&query, "lengths"));
    let exchange_types: Vec<Value> =
        ["direct", "fanout", "headers", "topic"].iter().map(|t| json!({"name": t, "description": format!("AMQP {t} exchange"), "enabled": true})).collect();
    let mut answer = json!({
        "management_version": RABBITMQ_VERSION,
        "rates_mode": "basic",
        "sample_retention_policies": {"global": [600, 3600, 28800, 86400], "basic": [600, 3600], "detailed": [600]},
        "exchange_types": exchange_types,
        "product_version": env!("CARGO_PKG_VERSION"),
        "product_name": "Warren",
        "rabbitmq_version": RABBITMQ_VERSION,
        "cluster_name": cluster_name_of(&ctx),
        "erlang_version": "none (Warren is written in Rust)",
        "erlang_full_version": "none (Warren is written in Rust)",
        "disable_stats": false,
        "enable_queue_totals": true,
        "message_stats": ctx.rates.message_stats(Window::from_query(&query, "msg_rates")),
        "churn_rates": {},
        "queue_totals": {
            "messages": ready + unacked, "messages_details": messages_details,
            "messages_ready": ready, "messages_ready_details": ready_details,
            "messages_unacknowledged": unacked, "messages_unacknowledged_details": unacked_details,
        },
        "object_totals": {
            "channels": channels, "connections": connections, "consumers": consumers,
            "exchanges": exchanges, "queues": queues,
        },
        "statistics_db_event_queue": 0,
        "node": ctx.node_name,
        "listeners": listeners,
        "warren_limits": limits_json(&ctx),
        "contexts": [{"node": ctx.node_name, "description": "RabbitMQ Management", "path": "/", "port": ctx.config.http_port.to_string()}],
    });
    if !scope.is_monitor() {
        if let Some(o) = answer.as_object_mut() {
            for key in ["node", "listeners", "contexts", "warren_limits", "statistics_db_event_queue"] {
                o.remove(key);
            }
        }
        if let Some(totals) = answer["object_totals"].as_object_mut() {
            totals.remove("consumers");
        }
    }
    Ok(Json(answer))
}

/// This node's listeners, as `/api/overview` shows them.
pub(super) fn listeners(ctx: &HttpContext) -> Vec<Value> {
    let ip = ctx.config.bind.to_string();
    let mut out = vec![
        json!({"node": ctx.node_name, "protocol": "amqp", "ip_address": ip, "port": ctx.config.amqp_port, "socket_opts": {}}),
        json!({"node": ctx.node_name, "protocol": "http", "ip_address": ip, "port": ctx.config.http_port, "socket_opts": {}}),
        json!({"node": ctx.node_name, "protocol": "http/prometheus", "ip_address": ip, "port": ctx.config.prometheus_port, "socket_opts": {}}),
    ];
    if ctx.tls.is_some() {
        // RabbitMQ's names for its TLS listeners.
        out.push(json!({"node": ctx.node_name, "protocol": "amqp/ssl", "ip_address": ip, "port": ctx.config.amqps_port, "socket_opts": {}}));
        out.push(json!({"node": ctx.node_name, "protocol": "https", "ip_address": ip, "port": ctx.config.https_port, "socket_opts": {}}));
        out.push(json!({"node": ctx.node_name, "protocol": "https/prometheus", "ip_address": ip, "port": ctx.config.prometheus_tls_port, "socket_opts": {}}));
    }
    if let Some(settings) = ctx.config.cluster() {
        out.push(json!({"node": ctx.node_name, "protocol": "clustering", "ip_address": settings.listen.ip().to_string(), "port": settings.listen.port(), "socket_opts": {}}));
    }
    out
}

fn cluster_name_of(ctx: &HttpContext) -> String {
    ctx.node_name.clone()
}

pub async fn cluster_name(State(ctx): State<Arc<HttpContext>>) -> Json<Value> {
    Json(json!({"name": cluster_name_of(&ctx)}))
}

pub async fn whoami(Extension(AuthUser(user)): Extension<AuthUser>) -> Json<Value> {
    Json(json!({"name": user.name, "tags": user.tags}))
}

/// Warren's own: every bound a hostile or careless client meets, as this node applies it
/// (docs/security.md, "What bounds each stage"). Also under `warren_limits` in the overview.
pub async fn limits(State(ctx): State<Arc<HttpContext>>) -> Json<Value> {
    Json(limits_json(&ctx))
}

pub(super) fn limits_json(ctx: &HttpContext) -> Value {
    use warren_cluster::transport as cluster;
    let c = &ctx.config;
    json!({
        "amqp": {
            "max_handshakes": c.max_handshakes,
            "max_handshakes_per_source": c.max_handshakes_per_source,
            "handshake_timeout_s": c.handshake_timeout,
            "login_failures_before_delay": c.login_failures_before_delay,
            "login_delay_max_ms": c.login_delay_max_ms,
            "max_connections": c.max_connections,
            "channel_max": c.channel_max,
            "frame_max": c.frame_max,
            "max_message_size": c.max_message_size,
            "write_timeout_s": c.write_timeout,
            "heartbeat_s": c.heartbeat,
            "consumer_timeout_ms": c.consumer_timeout,
        },
        "http": {
            "max_connections_per_port": crate::http::MAX_HTTP_CONNECTIONS,
            "header_read_timeout_s": crate::http::HEADER_READ_TIMEOUT.as_secs(),
            "max_body_bytes": crate::http::MAX_BODY_BYTES,
            "write_timeout_s": c.write_timeout,
        },
        "cluster": {
            "max_handshakes": cluster::MAX_HANDSHAKES,
            "max_handshakes_per_source": cluster::HANDSHAKES_PER_SOURCE,
            "handshake_timeout_s": cluster::handshake::HANDSHAKE_TIMEOUT.as_secs(),
            "max_requests_in_flight_per_connection": cluster::MAX_INFLIGHT_PER_CONNECTION,
            "max_queued_frames_per_connection": cluster::WRITE_QUEUE,
        },
        "tls": {
            "enabled": ctx.tls.is_some(),
            "versions": if ctx.tls.is_some() { json!(["tlsv1.2", "tlsv1.3"]) } else { json!([]) },
            "client_certificates": if c.tls_ca.is_empty() { "not asked for" } else if c.tls_fail_if_no_peer_cert { "required" } else { "verified when given" },
            "certificate_not_after": ctx.tls.as_ref().map(|t| t.not_after()),
        },
    })
}

pub async fn extensions() -> Json<Value> {
    Json(json!([]))
}

pub async fn empty_list() -> Json<Value> {
    Json(json!([]))
}

/// `/api/policies[/{vhost}]`: none yet (security-plan.md, step 8), but a vhost the user may not
/// see is refused as for its other objects.
pub async fn policies(State(ctx): State<Arc<HttpContext>>, scope: Scope, vhost: Option<Path<String>>) -> ApiResult<Json<Value>> {
    if let Some(Path(name)) = vhost {
        scope.vhost(&ctx, &name)?;
    }
    Ok(Json(json!([])))
}

/// This node as `/api/nodes` shows it, with its resources.
pub(super) fn this_node(ctx: &HttpContext) -> Value {
    let limits = *ctx.limits.lock();
    let alarms = *ctx.alarms.borrow();
    let mem_used = crate::alarms::resident_memory().unwrap_or(0);
    let disk_free = crate::alarms::free_disk(&ctx.config.data_dir).unwrap_or(0);
    let processors = std::thread::available_parallelism().map_or(1, |n| n.get());
    json!({
        "name": ctx.node_name,
        "type": "disc",
        "running": true,
        "being_drained": false,
        "os_pid": std::process::id().to_string(),
        "uptime": ctx.started.elapsed().as_millis() as u64,
        "processors": processors,
        "run_queue": 0,
        "mem_used": mem_used, "mem_used_details": rate(0.0),
        "mem_limit": limits.memory_bytes,
        "mem_alarm": alarms.memory,
        "disk_free": disk_free, "disk_free_details": rate(0.0),
        "disk_free_limit": limits.disk_free_bytes,
        "disk_free_alarm": alarms.disk,
        "fd_used": ctx.open_files(), "fd_total": max_open_files(),
        "sockets_used": ctx.connections.count(), "sockets_total": ctx.config.max_connections,
        "proc_used": 0, "proc_total": 0,
        "partitions": [],
        "applications": [],
        "exchange_types": [],
        "auth_mechanisms": [
            {"name": "PLAIN", "enabled": true},
            {"name": "AMQPLAIN", "enabled": true},
            {"name": "EXTERNAL", "enabled": ctx.tls.is_some() && !ctx.config.tls_ca.is_empty()},
        ],
        "enabled_plugins": ["rabbitmq_management", "rabbitmq_prometheus"],
        "rates_mode": "basic",
        "config_files": [],
        "log_files": [],
        "net_ticktime": 60,
    })
}

fn max_open_files() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass and reads nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        0
    }
}

/// Every node of the cluster with its resources as it reports them (`peers`); one that does not
/// answer, as reachable or not.
async fn all_nodes(ctx: &HttpContext) -> Vec<Value> {
    let mut nodes = vec![this_node(ctx)];
    if let Some(cluster) = &ctx.cluster {
        let mut reported: std::collections::HashMap<u64, Value> = super::peers::other_nodes(ctx).await.into_iter().collect();
        let status = cluster.local_status();
        for m in status.members.iter().filter(|m| m.id != status.node_id) {
            if let Some(mut theirs) = reported.remove(&m.id) {
                theirs["cluster_addr"] = m.cluster_addr.clone().into();
                theirs["amqp_addr"] = m.amqp_addr.clone().into();
                nodes.push(theirs);
                continue;
            }
            nodes.push(json!({
                "name": ctx.node_name_of(m.id),
                "type": "disc",
                "running": m.reachable,
                "cluster_addr": m.cluster_addr,
                "amqp_addr": m.amqp_addr,
                "partitions": [],
            }));
        }
    }
    nodes
}

pub async fn nodes(State(ctx): State<Arc<HttpContext>>, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(all_nodes(&ctx).await, &query)
}

pub async fn node(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>) -> ApiResult<Json<Value>> {
    all_nodes(&ctx)
        .await
        .into_iter()
        .find(|n| n["name"] == name.as_str())
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("no node '{name}'")))
}

fn vhost_json(ctx: &HttpContext, v: &warren_broker::VHost, defs: &[(VHostDef, VHostLimits)]) -> Value {
    let def = defs.iter().find(|(d, _)| d.name == v.name).map(|(d, _)| d.clone()).unwrap_or_else(|| VHostDef::named(&v.name));
    let (mut ready, mut unacked) = (0u64, 0u64);
    for q in v.queues() {
        ready += q.message_count() as u64;
        unacked += q.unacked_count();
    }
    json!({
        "name": v.name,
        "description": def.description,
        "tags": def.tags,
        "default_queue_type": def.default_queue_type.as_deref().unwrap_or("classic"),
        "metadata": {"description": def.description, "tags": def.tags},
        "tracing": false,
        "cluster_state": { ctx.node_name.clone(): "running" },
        "messages": ready + unacked, "messages_details": rate(0.0),
        "messages_ready": ready, "messages_ready_details": rate(0.0),
        "messages_unacknowledged": unacked, "messages_unacknowledged_details": rate(0.0),
    })
}

/// Every vhost for administrator and monitoring; for the others, those they have a permission in.
pub async fn vhosts(State(ctx): State<Arc<HttpContext>>, scope: Scope, Query(query): Params) -> ApiResult<Json<Value>> {
    let defs = ctx.broker.vhost_defs();
    let items = super::vhosts(&ctx, None)?.iter().filter(|v| scope.sees_vhost(&v.name)).map(|v| vhost_json(&ctx, v, &defs)).collect();
    list::answer(items, &query)
}

pub async fn vhost(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>) -> ApiResult<Json<Value>> {
    Ok(Json(vhost_json(&ctx, &*super::vhost(&ctx, &name)?, &ctx.broker.vhost_defs())))
}

/// `{"status": "ok"}`, or 503 with `{"status": "failed", "reason": ...}`, as RabbitMQ's checks.
fn check(failure: Option<String>) -> axum::response::Response {
    match failure {
        None => Json(json!({"status": "ok"})).into_response(),
        Some(reason) => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "failed", "reason": reason}))).into_response(),
    }
}

pub async fn healthcheck() -> axum::response::Response {
    check(None)
}

pub async fn alarms_check(State(ctx): State<Arc<HttpContext>>) -> axum::response::Response {
    let alarms = *ctx.alarms.borrow();
    check(alarms.blocks_publishers().then(|| format!("resource alarm in effect: {}", alarms.reason())))
}

pub async fn port_listener_check(State(ctx): State<Arc<HttpContext>>, Path(port): Path<String>) -> axum::response::Response {
    let mut ports = vec![ctx.config.amqp_port, ctx.config.http_port, ctx.config.prometheus_port];
    if ctx.tls.is_some() {
        ports.extend([ctx.config.amqps_port, ctx.config.https_port, ctx.config.prometheus_tls_port]);
    }
    match port.parse::<u16>() {
        // RabbitMQ's answers: the port checked, or the one missing and those there are.
        Ok(p) if ports.contains(&p) => Json(json!({"status": "ok", "port": p})).into_response(),
        Ok(p) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "failed", "reason": format!("no listener on port {p}; this node listens on {ports:?}"), "missing": p, "ports": ports})),
        )
            .into_response(),
        Err(_) => ApiError::bad_request(format!("'{port}' is not a port number")).into_response(),
    }
}

pub async fn protocol_listener_check(Path(protocol): Path<String>) -> axum::response::Response {
    match protocol.as_str() {
        "amqp" | "amqp091" | "amqp0-9-1" | "http" | "prometheus" => check(None),
        other => check(Some(format!("no listener for protocol '{other}'; this node serves amqp, http and prometheus"))),
    }
}

/// RabbitMQ's aliveness test: declares `aliveness-test` in the vhost, publishes to it and reads
/// the message back, as the user. Warren checks the user's permissions for those three (as
/// RabbitMQ's refusals say), that the vhost is served and that its store takes writes.
pub async fn aliveness(State(ctx): State<Arc<HttpContext>>, scope: Scope, Path(name): Path<String>) -> ApiResult<axum::response::Response> {
    let v = scope.vhost(&ctx, &name)?;
    for (perm, what, resource) in [(Perm::Configure, Resource::Queue, ALIVENESS_QUEUE), (Perm::Write, Resource::Exchange, ""), (Perm::Read, Resource::Queue, ALIVENESS_QUEUE)] {
        scope.check_amqp(&v.name, perm, what, resource).map_err(|r| r.not_authorised())?;
    }
    let alarms = *ctx.alarms.borrow();
    Ok(check(alarms.disk.then(|| "the disk alarm is raised: the store takes no more messages".to_owned())))
}
