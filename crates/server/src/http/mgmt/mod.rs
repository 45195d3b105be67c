//! RabbitMQ's management HTTP API (the paths `rabbitmqadmin`, rabbit-hole and scripts use), with
//! its JSON shapes, field names and status codes. Reference: RabbitMQ's "HTTP API reference";
//! `docs/http.md` lists what Warren serves and where it differs.

mod access;
mod connections;
mod definitions;
mod exchanges;
mod get;
mod node;
pub mod peers;
pub mod queues;
pub mod scope;

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::Query;
use axum::routing::{get, post};
use axum::{middleware, Router};
use serde_json::Value;
use warren_broker::VHost;

use super::error::{ApiError, ApiResult};
use super::HttpContext;

/// The version the API says it is: what RabbitMQ clients check features against (rabbitmqadmin
/// and rabbit-hole behave as with RabbitMQ 3.10).
pub const RABBITMQ_VERSION: &str = "3.10.8";

pub type Params = Query<HashMap<String, String>>;

/// The API's routes, each group behind the tag it needs (`scope`); within a group, each handler
/// shows and does what the user's permissions allow (`scope::Scope`).
pub fn router(ctx: Arc<HttpContext>) -> Router {
    // Any management user (any of the four tags).
    let management = Router::new()
        .route("/overview", get(node::overview))
        .route("/cluster-name", get(node::cluster_name))
        .route("/whoami", get(node::whoami))
        .route("/extensions", get(node::extensions))
        .route("/vhosts", get(node::vhosts))
        .route("/vhosts/{vhost}/connections", get(connections::vhost_connections))
        .route("/vhosts/{vhost}/channels", get(connections::vhost_channels))
        .route("/policies", get(node::policies))
        .route("/policies/{vhost}", get(node::policies))
        .route("/vhost-limits", get(access::vhost_limits))
        .route("/vhost-limits/{vhost}", get(access::vhost_limits))
        .route("/healthchecks/node", get(node::healthcheck))
        .route("/health/checks/alarms", get(node::alarms_check))
        .route("/health/checks/local-alarms", get(node::alarms_check))
        .route("/health/checks/virtual-hosts", get(node::healthcheck))
        .route("/health/checks/node-is-quorum-critical", get(node::healthcheck))
        .route("/health/checks/node-is-mirror-sync-critical", get(node::healthcheck))
        .route("/health/checks/port-listener/{port}", get(node::port_listener_check))
        .route("/health/checks/protocol-listener/{protocol}", get(node::protocol_listener_check))
        .route("/aliveness-test/{vhost}", get(node::aliveness))
        .route("/connections", get(connections::connections))
        .route("/connections/{name}", get(connections::connection).delete(connections::close_connection))
        .route("/connections/{name}/channels", get(connections::connection_channels))
        .route("/channels", get(connections::channels))
        .route("/consumers", get(connections::consumers))
        .route("/consumers/{vhost}", get(connections::consumers))
        .route("/queues", get(queues::list_all))
        .route("/queues/{vhost}", get(queues::list_vhost))
        .route("/queues/{vhost}/{name}", get(queues::show).put(queues::declare).delete(queues::delete))
        .route("/queues/{vhost}/{name}/contents", axum::routing::delete(queues::purge))
        .route("/queues/{vhost}/{name}/rewind", post(queues::rewind))
        .route("/queues/{vhost}/{name}/bindings", get(queues::bindings))
        .route("/queues/{vhost}/{name}/get", post(get::get))
        .route("/exchanges", get(exchanges::list_all))
        .route("/exchanges/{vhost}", get(exchanges::list_vhost))
        .route("/exchanges/{vhost}/{name}", get(exchanges::show).put(exchanges::declare).delete(exchanges::delete))
        .route("/exchanges/{vhost}/{name}/publish", post(exchanges::publish))
        .route("/exchanges/{vhost}/{name}/bindings/source", get(exchanges::bindings_from))
        .route("/exchanges/{vhost}/{name}/bindings/destination", get(exchanges::bindings_to))
        .route("/bindings", get(exchanges::bindings_all))
        .route("/bindings/{vhost}", get(exchanges::bindings_vhost))
        .route("/bindings/{vhost}/e/{source}/{kind}/{destination}", get(exchanges::bindings_between).post(exchanges::bind))
        .route("/bindings/{vhost}/e/{source}/{kind}/{destination}/{props}", get(exchanges::binding).delete(exchanges::unbind));
    let monitors = Router::new()
        .route("/nodes", get(node::nodes))
        .route("/nodes/{name}", get(node::node))
        .route("/limits", get(node::limits))
        .route_layer(middleware::from_fn(scope::monitors));
    let policymakers = Router::new().route("/parameters", get(node::empty_list)).route_layer(middleware::from_fn(scope::policymakers));
    let administrators = Router::new()
        .route("/vhosts/{vhost}", get(node::vhost).put(access::put_vhost).delete(access::delete_vhost))
        .route("/vhosts/{vhost}/permissions", get(access::vhost_permissions))
        .route("/vhosts/{vhost}/topic-permissions", get(access::vhost_topic_permissions))
        .route("/users", get(access::users))
        .route("/users/bulk-delete", post(access::bulk_delete_users))
        .route("/users/{user}", get(access::user).put(access::put_user).delete(access::delete_user))
        .route("/users/{user}/permissions", get(access::user_permissions))
        .route("/users/{user}/topic-permissions", get(access::user_topic_permissions))
        .route("/users/{user}/signing-keys/{secret_id}", axum::routing::put(access::put_signing_key))
        .route("/permissions", get(access::permissions))
        .route("/permissions/{vhost}/{user}", get(access::permission).put(access::put_permission).delete(access::delete_permission))
        .route("/topic-permissions", get(access::topic_permissions))
        .route(
            "/topic-permissions/{vhost}/{user}",
            get(access::topic_permission).put(access::put_topic_permission).delete(access::delete_topic_permission),
        )
        .route("/vhost-limits/{vhost}/{name}", axum::routing::put(access::put_vhost_limit).delete(access::delete_vhost_limit))
        .route("/operator-policies", get(node::empty_list))
        .route("/global-parameters", get(node::empty_list))
        .route("/feature-flags", get(node::empty_list))
        .route("/definitions", get(definitions::export_all).post(definitions::import_all))
        .route("/definitions/{vhost}", get(definitions::export_vhost).post(definitions::import_vhost))
        .route_layer(middleware::from_fn(scope::administrators));
    management
        .merge(monitors)
        .merge(policymakers)
        .merge(administrators)
        .layer(middleware::from_fn_with_state(ctx.clone(), super::auth::require_user))
        .with_state(ctx)
}

/// The vhost named in a path, or 404 as RabbitMQ answers for an unknown one.
pub fn vhost(ctx: &HttpContext, name: &str) -> ApiResult<Arc<VHost>> {
    ctx.broker.vhost(name).ok_or_else(|| ApiError::not_found(format!("no vhost '{name}'")))
}

/// The vhosts a list covers: one named, or all of them (sorted by name, for stable answers).
pub fn vhosts(ctx: &HttpContext, name: Option<&str>) -> ApiResult<Vec<Arc<VHost>>> {
    match name {
        Some(name) => Ok(vec![vhost(ctx, name)?]),
        None => {
            let mut all = ctx.broker.vhosts();
            all.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(all)
        }
    }
}

/// A JSON body's boolean field, which RabbitMQ also takes as the strings "true"/"false"
/// (rabbitmqadmin sends strings).
pub fn flag(body: &Value, key: &str, default: bool) -> ApiResult<bool> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s == "true" => Ok(true),
        Some(Value::String(s)) if s == "false" => Ok(false),
        Some(other) => Err(ApiError::bad_request(format!("{key} must be true or false, not {other}"))),
    }
}

/// A JSON request body: an object, or an empty body (an empty object).
pub fn body_object(bytes: &[u8]) -> ApiResult<Value> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Object(Default::default()));
    }
    match serde_json::from_slice::<Value>(bytes) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(other) => Err(ApiError::bad_request(format!("the body must be a JSON object, not {}", kind_of(&other)))),
        Err(e) => Err(ApiError::bad_request(format!("the body is not valid JSON: {e}"))),
    }
}

/// A JSON value's type, for errors that must not repeat the value (it may be a password or a hash).
pub(super) fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A `{"rate": 0.0}` detail object as RabbitMQ attaches to counts and counters.
pub fn rate(r: f64) -> Value {
    serde_json::json!({ "rate": r })
}
