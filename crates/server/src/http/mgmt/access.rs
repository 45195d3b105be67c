//! Users, vhosts, permissions and topic permissions in the management API, in RabbitMQ's shapes:
//! `/api/users`, `/api/vhosts/{v}` (PUT, DELETE), `/api/permissions`, `/api/topic-permissions`.
//! A change is recorded through the broker (`Broker::change_auth`: the metadata log, or the
//! cluster's metadata group, so it holds on every node at once); a password is hashed here and
//! only its hash goes further. Administrators only (`scope::administrators`), but for the vhost limits, which anyone sees of the vhosts it may see.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use warren_broker::auth::defs::{self, PermissionDef, TopicPermissionDef, UserDef, VHostDef, VHostLimits};
use warren_broker::auth::{Algorithm, PasswordHash};
use warren_broker::metadata::Op;
use warren_broker::AuthChangeError;

use super::scope::Scope;
use super::{body_object, Params};
use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, ApiResult};
use crate::http::{list, HttpContext};

/// A change refused or not recorded, as the API answers it.
fn change_error(e: AuthChangeError) -> ApiError {
    match e {
        AuthChangeError::Refused(r) if r.code == 404 => ApiError::not_found(r.text),
        AuthChangeError::Refused(r) => ApiError::bad_request(r.text),
        e @ AuthChangeError::Failed { .. } => ApiError::unavailable(e.to_string()),
    }
}

fn change(ctx: &HttpContext, ops: Vec<Op>) -> ApiResult<()> {
    ctx.broker.change_auth(ops).map_err(change_error)
}

fn created_or_updated(existed: bool) -> StatusCode {
    if existed {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::CREATED
    }
}

fn string_field<'a>(body: &'a Value, key: &str) -> ApiResult<Option<&'a str>> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        // The value is not repeated: it may be a password or its hash.
        Some(other) => Err(ApiError::bad_request(format!("{key} must be a string, not {}", super::kind_of(other)))),
    }
}

// ---- users -------------------------------------------------------------------------------

pub(super) fn user_json(user: &warren_broker::User) -> Value {
    let (hash, algorithm) = user.password_hash().to_rabbitmq();
    json!({"name": user.name, "password_hash": hash, "hashing_algorithm": algorithm, "tags": user.tags, "limits": {}})
}

pub async fn users(State(ctx): State<Arc<HttpContext>>, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(ctx.broker.users().all().iter().map(|u| user_json(u)).collect(), &query)
}

pub async fn user(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>) -> ApiResult<Json<Value>> {
    ctx.broker.users().user(&name).map(|u| Json(user_json(&u))).ok_or_else(|| ApiError::not_found("Not Found"))
}

/// PUT /api/users/{name}: `password` (hashed here with SHA-256), or `password_hash` and
/// `hashing_algorithm` as a RabbitMQ export has them, or neither (no password login: RabbitMQ 3.10
/// clears an existing user's password then too); `tags` (required, as RabbitMQ 3.10 does) a list
/// or a comma-separated string.
pub async fn put_user(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>, body: Bytes) -> ApiResult<StatusCode> {
    defs::check_name("user", &name)?;
    // Not through `mgmt::flag` or any helper that echoes a value: a password must not reach an answer.
    let body = body_object(&body)?;
    let existing = ctx.broker.users().user(&name);
    let algorithm = match string_field(&body, "hashing_algorithm")? {
        Some(a) => a.to_string(),
        None => Algorithm::Sha256.rabbitmq_name().to_string(),
    };
    let password_hash = match (body.get("password"), string_field(&body, "password_hash")?) {
        (Some(Value::String(password)), _) => {
            let algorithm = Algorithm::from_rabbitmq_name(&algorithm)?;
            PasswordHash::new(algorithm, password).to_rabbitmq().0
        }
        (Some(Value::Null) | None, Some(hash)) => hash.to_string(),
        (Some(Value::Null) | None, None) => String::new(),
        (Some(_), _) => return Err(ApiError::bad_request("password must be a string")),
    };
    let tags = defs::parse_tags(body.get("tags").ok_or_else(|| ApiError::bad_request("tags_not_present"))?)?;
    let user = UserDef { name: name.clone(), password_hash, hashing_algorithm: algorithm, tags, limits: body.get("limits").cloned().unwrap_or(Value::Null) };
    user.check()?;
    change(&ctx, vec![Op::UserPut { user }])?;
    Ok(created_or_updated(existing.is_some()))
}

pub async fn delete_user(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>) -> ApiResult<StatusCode> {
    change(&ctx, vec![Op::UserDeleted { name }])?;
    Ok(StatusCode::NO_CONTENT)
}

/// POST /api/users/bulk-delete `{"users": [...]}`: names that do not exist are skipped.
pub async fn bulk_delete_users(State(ctx): State<Arc<HttpContext>>, body: Bytes) -> ApiResult<StatusCode> {
    let body = body_object(&body)?;
    let names = body.get("users").and_then(Value::as_array).ok_or_else(|| ApiError::bad_request("the body must name the users: {\"users\": [...]}"))?;
    let users = ctx.broker.users();
    let ops = names.iter().filter_map(Value::as_str).filter(|n| users.user(n).is_some()).map(|n| Op::UserDeleted { name: n.to_string() }).collect();
    change(&ctx, ops)?;
    Ok(StatusCode::NO_CONTENT)
}

/// PUT /api/users/{user}/signing-keys/{secret_id} (Warren's own): a new random key that signs CMQ
/// requests as the user, answered once, `{"secret_id": ..., "secret_key": ...}`. A secret id
/// names one key: putting it again replaces the key.
pub async fn put_signing_key(State(ctx): State<Arc<HttpContext>>, Path((user, secret_id)): Path<(String, String)>) -> ApiResult<(StatusCode, Json<Value>)> {
    defs::check_name("secret id", &secret_id)?;
    if ctx.broker.users().user(&user).is_none() {
        return Err(ApiError::not_found("Not Found"));
    }
    if let Some((owner, _)) = ctx.broker.users().signing_key(&secret_id).filter(|(owner, _)| owner.name != user) {
        return Err(ApiError::bad_request(format!("secret id '{secret_id}' signs for user '{}'; choose another", owner.name)));
    }
    let key: String = {
        use rand::Rng;
        let mut rng = rand::thread_rng();
        (0..32).map(|_| char::from(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"[rng.gen_range(0..62)])).collect()
    };
    let signing = defs::SigningKeyDef { secret_id: secret_id.clone(), user, key: key.clone() };
    change(&ctx, vec![Op::SigningKeySet { key: signing }])?;
    Ok((StatusCode::CREATED, Json(json!({"secret_id": secret_id, "secret_key": key}))))
}

// ---- vhosts ------------------------------------------------------------------------------

/// PUT /api/vhosts/{name}: creates it (201), its creator getting every permission on it (as
/// RabbitMQ 3.10 does), or sets its description and tags (204; what the body omits is cleared, as
/// RabbitMQ does).
pub async fn put_vhost(
    State(ctx): State<Arc<HttpContext>>,
    Extension(AuthUser(creator)): Extension<AuthUser>,
    Path(name): Path<String>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    defs::check_name("vhost", &name)?;
    let body = body_object(&body)?;
    let existed = ctx.broker.vhost(&name).is_some();
    let mut def = VHostDef::named(&name);
    def.description = string_field(&body, "description")?.unwrap_or_default().to_string();
    def.tags = defs::parse_tags(body.get("tags").unwrap_or(&Value::Null))?;
    def.default_queue_type = string_field(&body, "default_queue_type")?.map(str::to_string);
    if let Some(kind) = def.default_queue_type.as_deref().filter(|k| !matches!(*k, "classic" | "quorum" | "stream")) {
        return Err(ApiError::bad_request(format!("default_queue_type '{kind}' is not one of classic, quorum")));
    }
    let mut ops = vec![Op::VhostDeclared { vhost: def }];
    if !existed {
        ops.push(Op::PermissionSet { permission: PermissionDef::all(&creator.name, &name) });
    }
    change(&ctx, ops)?;
    Ok(created_or_updated(existed))
}

/// DELETE /api/vhosts/{name}: everything in it goes (queues with their messages), and every
/// connection to it is closed (320), on every node.
pub async fn delete_vhost(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>) -> ApiResult<StatusCode> {
    if ctx.broker.vhost(&name).is_none() {
        return Err(ApiError::not_found("Not Found"));
    }
    change(&ctx, vec![Op::VhostDeleted { name }])?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- vhost limits ------------------------------------------------------------------------

fn limits_json(vhost: &str, limits: &VHostLimits) -> Value {
    json!({"vhost": vhost, "value": limits})
}

/// GET /api/vhost-limits[/{vhost}]: the vhosts that have limits, as RabbitMQ lists them.
/// Every vhost's for administrator and monitoring, the others' of the vhosts they have a
/// permission in (RabbitMQ's "vhost visible").
pub async fn vhost_limits(State(ctx): State<Arc<HttpContext>>, scope: Scope, vhost: Option<Path<String>>) -> ApiResult<Json<Value>> {
    if let Some(Path(v)) = &vhost {
        super::vhost(&ctx, v)?;
        if !scope.sees_vhost(v) {
            return Err(ApiError::not_authorised("User not authorised to access virtual host"));
        }
    }
    let items: Vec<Value> = ctx
        .broker
        .vhost_defs()
        .iter()
        .filter(|(d, l)| *l != VHostLimits::default() && vhost.as_ref().is_none_or(|Path(v)| *v == d.name) && scope.sees_vhost(&d.name))
        .map(|(d, l)| limits_json(&d.name, l))
        .collect();
    Ok(Json(Value::Array(items)))
}

/// PUT /api/vhost-limits/{vhost}/{name} `{"value": N}`: `max-connections` or `max-queues`; a
/// negative value lifts the limit, as RabbitMQ.
pub async fn put_vhost_limit(State(ctx): State<Arc<HttpContext>>, Path((vhost, name)): Path<(String, String)>, body: Bytes) -> ApiResult<StatusCode> {
    let body = body_object(&body)?;
    let value = body.get("value").and_then(Value::as_i64).ok_or_else(|| ApiError::bad_request("value must be a whole number (negative: no limit)"))?;
    set_limit(&ctx, vhost, &name, (value >= 0).then_some(value))
}

pub async fn delete_vhost_limit(State(ctx): State<Arc<HttpContext>>, Path((vhost, name)): Path<(String, String)>) -> ApiResult<StatusCode> {
    set_limit(&ctx, vhost, &name, None)
}

fn set_limit(ctx: &HttpContext, vhost: String, name: &str, value: Option<i64>) -> ApiResult<StatusCode> {
    super::vhost(ctx, &vhost)?;
    let mut limits = ctx.broker.vhost_limits(&vhost);
    match name {
        "max-connections" => limits.max_connections = value,
        "max-queues" => limits.max_queues = value,
        other => return Err(ApiError::bad_request(format!("unknown vhost limit '{other}': max-connections or max-queues"))),
    }
    change(ctx, vec![Op::VhostLimitsSet { vhost, limits }])?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- permissions -------------------------------------------------------------------------

fn permission_json(p: &PermissionDef) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write, "read": p.read})
}

pub(super) fn all_permissions(ctx: &HttpContext) -> Vec<Value> {
    ctx.broker.users().permissions().iter().map(permission_json).collect()
}

pub async fn permissions(State(ctx): State<Arc<HttpContext>>, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(all_permissions(&ctx), &query)
}

pub async fn vhost_permissions(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    super::vhost(&ctx, &name)?;
    list::answer(all_permissions(&ctx).into_iter().filter(|p| p["vhost"] == name.as_str()).collect(), &query)
}

pub async fn user_permissions(State(ctx): State<Arc<HttpContext>>, Path(name): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    if ctx.broker.users().user(&name).is_none() {
        return Err(ApiError::not_found("Not Found"));
    }
    list::answer(all_permissions(&ctx).into_iter().filter(|p| p["user"] == name.as_str()).collect(), &query)
}

fn recorded_permission(ctx: &HttpContext, vhost: &str, user: &str) -> Option<PermissionDef> {
    let users = ctx.broker.users();
    users.permissions().into_iter().find(|p| p.vhost == vhost && p.user == user).filter(|_| users.initialized)
}

pub async fn permission(State(ctx): State<Arc<HttpContext>>, Path((vhost, user)): Path<(String, String)>) -> ApiResult<Json<Value>> {
    recorded_permission(&ctx, &vhost, &user).map(|p| Json(permission_json(&p))).ok_or_else(|| ApiError::not_found("Not Found"))
}

/// The three patterns of a permission body; each must be there, as RabbitMQ requires.
fn pattern(body: &Value, key: &str) -> ApiResult<String> {
    match body.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        None => Err(ApiError::bad_request(format!("{key} is missing: a permission has configure, write and read patterns"))),
        // The value is not repeated: it may be a password or its hash.
        Some(other) => Err(ApiError::bad_request(format!("{key} must be a string, not {}", super::kind_of(other)))),
    }
}

/// An unknown user or vhost in a permission's path: 400, as RabbitMQ answers.
fn user_and_vhost_exist(ctx: &HttpContext, vhost: &str, user: &str) -> ApiResult<()> {
    if ctx.broker.vhost(vhost).is_none() || ctx.broker.users().user(user).is_none() {
        return Err(ApiError::bad_request("vhost_or_user_not_found"));
    }
    Ok(())
}

pub async fn put_permission(State(ctx): State<Arc<HttpContext>>, Path((vhost, user)): Path<(String, String)>, body: Bytes) -> ApiResult<StatusCode> {
    let body = body_object(&body)?;
    user_and_vhost_exist(&ctx, &vhost, &user)?;
    let existed = recorded_permission(&ctx, &vhost, &user).is_some();
    let permission = PermissionDef { configure: pattern(&body, "configure")?, write: pattern(&body, "write")?, read: pattern(&body, "read")?, user, vhost };
    permission.check()?;
    change(&ctx, vec![Op::PermissionSet { permission }]).map_err(refused_as_bad_request)?;
    Ok(created_or_updated(existed))
}

/// A user or vhost gone between the check and the commit: answered as the check would have.
fn refused_as_bad_request(e: ApiError) -> ApiError {
    if e.status == StatusCode::NOT_FOUND {
        ApiError::bad_request("vhost_or_user_not_found")
    } else {
        e
    }
}

pub async fn delete_permission(State(ctx): State<Arc<HttpContext>>, Path((vhost, user)): Path<(String, String)>) -> ApiResult<StatusCode> {
    if recorded_permission(&ctx, &vhost, &user).is_none() {
        return Err(ApiError::not_found("Not Found"));
    }
    change(&ctx, vec![Op::PermissionCleared { user, vhost }])?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- topic permissions -------------------------------------------------------------------

fn topic_permission_json(p: &TopicPermissionDef) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "exchange": p.exchange, "write": p.write, "read": p.read})
}

fn topic_permissions_where(ctx: &HttpContext, keep: impl Fn(&TopicPermissionDef) -> bool) -> Vec<Value> {
    ctx.broker.users().topic_permissions().iter().filter(|p| keep(p)).map(topic_permission_json).collect()
}

pub async fn topic_permissions(State(ctx): State<Arc<HttpContext>>, Query(query): Params) -> ApiResult<Json<Value>> {
    list::answer(topic_permissions_where(&ctx, |_| true), &query)
}

pub async fn vhost_topic_permissions(State(ctx): State<Arc<HttpContext>>, Path(vhost): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    super::vhost(&ctx, &vhost)?;
    list::answer(topic_permissions_where(&ctx, |p| p.vhost == vhost), &query)
}

pub async fn user_topic_permissions(State(ctx): State<Arc<HttpContext>>, Path(user): Path<String>, Query(query): Params) -> ApiResult<Json<Value>> {
    if ctx.broker.users().user(&user).is_none() {
        return Err(ApiError::not_found("Not Found"));
    }
    list::answer(topic_permissions_where(&ctx, |p| p.user == user), &query)
}

pub async fn topic_permission(State(ctx): State<Arc<HttpContext>>, Path((vhost, user)): Path<(String, String)>) -> ApiResult<Json<Value>> {
    let found = topic_permissions_where(&ctx, |p| p.vhost == vhost && p.user == user);
    if found.is_empty() {
        return Err(ApiError::not_found("Not Found"));
    }
    Ok(Json(Value::Array(found)))
}

pub async fn put_topic_permission(State(ctx): State<Arc<HttpContext>>, Path((vhost, user)): Path<(String, String)>, body: Bytes) -> ApiResult<StatusCode> {
    let body = body_object(&body)?;
    user_and_vhost_exist(&ctx, &vhost, &user)?;
    let exchange = string_field(&body, "exchange")?.ok_or_else(|| ApiError::bad_request("exchange is missing: a topic permission names its exchange"))?.to_string();
    let existed = !topic_permissions_where(&ctx, |p| p.vhost == vhost && p.user == user && p.exchange == exchange).is_empty();
    let permission = TopicPermissionDef { exchange, write: pattern(&body, "write")?, read: pattern(&body, "read")?, user, vhost };
    permission.check()?;
    change(&ctx, vec![Op::TopicPermissionSet { permission }]).map_err(refused_as_bad_request)?;
    Ok(created_or_updated(existed))
}

/// DELETE /api/topic-permissions/{vhost}/{user}: every exchange's (RabbitMQ's `?exchange=` one).
pub async fn delete_topic_permission(State(ctx): State<Arc<HttpContext>>, Path((vhost, user)): Path<(String, String)>, Query(query): Params) -> ApiResult<StatusCode> {
    let exchange = query.get("exchange");
    let ops: Vec<Op> = ctx
        .broker
        .users()
        .topic_permissions()
        .iter()
        .filter(|p| p.vhost == vhost && p.user == user && exchange.is_none_or(|e| *e == p.exchange))
        .map(|p| Op::TopicPermissionCleared { user: p.user.clone(), vhost: p.vhost.clone(), exchange: p.exchange.clone() })
        .collect();
    if ops.is_empty() {
        return Err(ApiError::not_found("Not Found"));
    }
    change(&ctx, ops)?;
    Ok(StatusCode::NO_CONTENT)
}

