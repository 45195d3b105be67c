//! Tencent CMQ's HTTP API (version 2.0) on the management port: `GET` or `POST` (form) to
//! `/v2/index.php` with `Action=...`, signed as [`sign`] says, answered with JSON
//! `{"code": 0, "message": "", "requestId": ...}` plus the action's fields (HTTP 200 even for an
//! error: CMQ's clients read `code`). Tencent's own SDK (`qcloud-cmq-sdk-py3`) works unchanged.
//!
//! CMQ's queues are Warren's queues (vhost `/` unless a `vhost` parameter names another): a message
//! sent here is consumed over AMQP and back. Topics are exchanges, subscriptions bindings
//! (`topics`). A receive is a delivery with a deadline (`receive`). `SendMessage` answers once
//! the message is durable, as a publisher confirm (`send`). See docs/http.md.

mod json;
mod messages;
mod params;
mod queues;
mod receive;
mod replay;
mod send;
pub mod sign;
mod topics;

use crate::connection::access::{Perm, Resource};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde_json::{Map, Value};
use warren_broker::error::BrokerError;
use warren_broker::{User, VHost};

pub use params::Params;

use super::{HttpContext, Peer};

/// The one path CMQ's API is served on.
pub const PATH: &str = "/v2/index.php";
/// How far a request's `Timestamp` may be from this node's clock (a captured request replayed
/// later is refused).
const MAX_CLOCK_SKEW_SECS: i64 = 300;

/// CMQ's error codes (the SDK's `CMQServerException` lists them).
pub mod code {
    pub const INVALID_PARAMETER: i64 = 4000;
    pub const AUTH_FAILED: i64 = 4100;
    pub const MESSAGE_TOO_LARGE: i64 = 4400;
    pub const QUEUE_FULL: i64 = 4410;
    pub const INVALID_RECEIPT_HANDLE: i64 = 4430;
    pub const NOT_FOUND: i64 = 4440;
    pub const ALREADY_EXISTS: i64 = 4460;
    pub const INTERNAL: i64 = 6000;
    pub const BATCH_DELETE_FAILED: i64 = 6010;
    pub const NO_MESSAGE: i64 = 7000;
}

/// A refused request: CMQ's code and a text a person can act on.
#[derive(Debug)]
pub struct CmqError {
    pub code: i64,
    pub message: String,
    /// Fields the answer carries besides (BatchDeleteMessage's `errorList`).
    pub extra: Answer,
}

impl CmqError {
    pub fn new(code: i64, message: impl Into<String>) -> CmqError {
        CmqError { code, message: message.into(), extra: Answer::new() }
    }

    pub fn invalid(message: impl Into<String>) -> CmqError {
        CmqError::new(code::INVALID_PARAMETER, message)
    }
}

impl From<BrokerError> for CmqError {
    fn from(e: BrokerError) -> CmqError {
        use warren_protocol::constants as c;
        let code = match e.code {
            c::NOT_FOUND => code::NOT_FOUND,
            c::PRECONDITION_FAILED | c::COMMAND_INVALID | c::NOT_ALLOWED | c::SYNTAX_ERROR | c::NOT_IMPLEMENTED | c::RESOURCE_LOCKED | c::ACCESS_REFUSED => {
                code::INVALID_PARAMETER
            }
            _ => code::INTERNAL,
        };
        CmqError::new(code, e.text)
    }
}

/// An action's answer: its fields besides `code`, `message` and `requestId`.
pub type Answer = Map<String, Value>;
pub type CmqResult = Result<Answer, CmqError>;

/// State the CMQ API keeps on a node: leases of received messages, the publisher session its
/// sends are confirmed through, request and message ids.
pub struct Cmq {
    pub leases: receive::Leases,
    pub confirms: send::Confirms,
    /// Requests taken lately, so a copy is refused (`replay`).
    seen: replay::SeenRequests,
    next_request: AtomicU64,
    /// Message ids are this (random per start, so ids do not repeat across restarts) plus a count.
    id_prefix: u64,
    next_message: AtomicU64,
}

impl Default for Cmq {
    fn default() -> Cmq {
        Cmq {
            leases: receive::Leases::default(),
            confirms: send::Confirms::default(),
            seen: replay::SeenRequests::default(),
            next_request: AtomicU64::new(1),
            id_prefix: rand::random::<u32>() as u64,
            next_message: AtomicU64::new(1),
        }
    }
}

impl Cmq {
    /// A new message id (decimal, as CMQ's are).
    pub fn message_id(&self) -> String {
        let n = self.next_message.fetch_add(1, Ordering::Relaxed);
        ((self.id_prefix << 32) | (n & 0xffff_ffff)).to_string()
    }
}

/// A signed, authenticated request.
pub struct Request {
    pub ctx: Arc<HttpContext>,
    pub params: Params,
    pub user: Arc<User>,
    pub vhost: Arc<VHost>,
}

/// `/v2/index.php`: checks the signature, runs the action, answers JSON.
pub async fn handle(State(ctx): State<Arc<HttpContext>>, peer: Option<Extension<Peer>>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let request_id = ctx.cmq.next_request.fetch_add(1, Ordering::Relaxed);
    let outcome = match authenticate(&ctx, peer.map(|p| p.0), &method, &uri, &headers, &body).await {
        Ok(request) => run(request).await,
        Err(e) => Err(e),
    };
    let (code, message, fields) = match outcome {
        Ok(fields) => (0, String::new(), fields),
        Err(e) => (e.code, e.message, e.extra),
    };
    ([(header::CONTENT_TYPE, "application/json")], json::answer(code, &message, request_id, &fields)).into_response()
}

async fn authenticate(ctx: &Arc<HttpContext>, peer: Option<Peer>, method: &Method, uri: &Uri, headers: &HeaderMap, body: &[u8]) -> Result<Request, CmqError> {
    // The SDK posts the form without a Content-Type: a POST's body is the form whatever it says.
    let raw = if *method == Method::GET { uri.query().unwrap_or("").as_bytes() } else { body };
    let params = Params::parse(raw)?;
    let secret_id = params.required("SecretId")?;
    let timestamp: i64 = params.required("Timestamp")?.parse().map_err(|_| CmqError::invalid("Timestamp must be a number of seconds since 1970"))?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    let skew = now.saturating_sub(timestamp);
    if skew.saturating_abs() > MAX_CLOCK_SKEW_SECS {
        return Err(CmqError::new(
            code::AUTH_FAILED,
            format!("Timestamp {timestamp} is {skew} s from this server's clock (at most {MAX_CLOCK_SKEW_SECS} s): check the client's clock"),
        ));
    }
    let signature = params.required("Signature")?;
    let signature_method = sign::Method::parse(params.get("SignatureMethod")).map_err(CmqError::invalid)?;
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("");
    let refused = || CmqError::new(code::AUTH_FAILED, "authentication failed: unknown SecretId or wrong signature (the SecretKey is the user's password)");
    // A source that failed too often for this SecretId waits its turn (`login_guard`).
    let source = peer.map(|p| p.0.ip());
    if let Some(source) = source {
        ctx.logins.wait_turn(source, secret_id).await;
    }
    let failed = || {
        if let Some(source) = source {
            ctx.logins.failed(source, secret_id);
        }
        refused()
    };
    let Some((user, secret)) = ctx.broker.signing_secret(secret_id) else {
        tracing::warn!(user = %secret_id, peer = ?peer.map(|p| p.0), "CMQ request refused: unknown SecretId");
        return Err(failed());
    };
    if !sign::verify(signature_method, &secret, method.as_str(), host, PATH, &params, signature) {
        tracing::warn!(user = %secret_id, peer = ?peer.map(|p| p.0), "CMQ request refused: wrong signature");
        return Err(failed());
    }
    if let Some(source) = source {
        ctx.logins.succeeded(source, secret_id);
    }
    if user.loopback_only && !peer.is_some_and(|p| p.0.ip().is_loopback()) {
        return Err(CmqError::new(code::AUTH_FAILED, format!("user '{}' can only connect via localhost", user.name)));
    }
    // Last: only a request that would run is remembered.
    match ctx.cmq.seen.admit(timestamp, signature, now.saturating_sub(MAX_CLOCK_SKEW_SECS)) {
        Ok(()) => {}
        Err(replay::Refused::Seen) => {
            tracing::warn!(user = %secret_id, peer = ?peer.map(|p| p.0), "CMQ request refused: a copy of one taken before");
            return Err(CmqError::new(code::AUTH_FAILED, "this request (same parameters, Nonce and Timestamp) was taken before: send each request with a new Nonce"));
        }
        Err(replay::Refused::TooOld { floor }) => {
            return Err(CmqError::new(
                code::AUTH_FAILED,
                format!("Timestamp {timestamp} is too old for this server under its current load (at most second {floor} is refused): sign requests just before sending them and check the client's clock"),
            ));
        }
    }
    let vhost_name = params.get("vhost").unwrap_or("/");
    let vhost = ctx.broker.vhost(vhost_name).filter(|_| ctx.broker.can_access(&user, vhost_name)).ok_or_else(|| CmqError::new(code::NOT_FOUND, format!("no vhost '{vhost_name}'")))?;
    Ok(Request { ctx: ctx.clone(), params, user, vhost })
}

impl Request {
    /// Whether the user may `perm` the queue or exchange `name`, as an AMQP client would be
    /// checked (`connection::access`); refused with 4100 naming what was refused.
    pub fn check(&self, perm: Perm, kind: Resource, name: &str) -> Result<(), CmqError> {
        let resource = if kind == Resource::Exchange { warren_broker::auth::exchange_resource(name) } else { name };
        let allowed = self.ctx.broker.users().permission(&self.user.name, &self.vhost.name).is_some_and(|p| p.allows(perm, resource));
        if allowed {
            return Ok(());
        }
        Err(CmqError::new(
            code::AUTH_FAILED,
            format!("access to {} '{resource}' in vhost '{}' refused for user '{}' (it needs {} permission)", kind.as_str(), self.vhost.name, self.user.name, perm.as_str()),
        ))
    }
}

/// The permission checks of an action, before it runs (as the AMQP operations it is made of). A
/// missing name is left to the action, which refuses it as such.
fn check_action(request: &Request, action: &str) -> Result<(), CmqError> {
    let check = |perm, kind, param: &str| match request.params.get(param) {
        Some(name) => request.check(perm, kind, name),
        None => Ok(()),
    };
    match action {
        "CreateQueue" | "SetQueueAttributes" | "DeleteQueue" => check(Perm::Configure, Resource::Queue, "queueName"),
        // A send is a publish through the default exchange.
        "SendMessage" | "BatchSendMessage" => request.check(Perm::Write, Resource::Exchange, ""),
        "ReceiveMessage" | "BatchReceiveMessage" | "DeleteMessage" | "BatchDeleteMessage" | "RewindQueue" => check(Perm::Read, Resource::Queue, "queueName"),
        "CreateTopic" | "SetTopicAttributes" | "DeleteTopic" => check(Perm::Configure, Resource::Exchange, "topicName"),
        "PublishMessage" | "BatchPublishMessage" => check(Perm::Write, Resource::Exchange, "topicName"),
        // A subscription is a binding: write on the queue, read on the topic's exchange.
        "Subscribe" | "CreateSubscription" => {
            check(Perm::Write, Resource::Queue, "endpoint")?;
            check(Perm::Read, Resource::Exchange, "topicName")
        }
        // The queue's write permission is checked by `topics::unsubscribe`, which knows the queue.
        "Unsubscribe" | "DeleteSubscription" => check(Perm::Read, Resource::Exchange, "topicName"),
        // Lists and attributes: access to the vhost is enough.
        _ => Ok(()),
    }
}

async fn run(request: Request) -> CmqResult {
    let action = request.params.required("Action")?.to_owned();
    check_action(&request, &action)?;
    match action.as_str() {
        "CreateQueue" => queues::create(&request),
        "ListQueue" => queues::list(&request),
        "GetQueueAttributes" => queues::attributes(&request),
        "SetQueueAttributes" => queues::set_attributes(&request),
        "DeleteQueue" => queues::delete(&request),
        "RewindQueue" => queues::rewind(&request).await,
        "SendMessage" => messages::send(&request, false).await,
        "BatchSendMessage" => messages::send(&request, true).await,
        "ReceiveMessage" => messages::receive(&request, false).await,
        "BatchReceiveMessage" => messages::receive(&request, true).await,
        "DeleteMessage" => messages::delete(&request, false).await,
        "BatchDeleteMessage" => messages::delete(&request, true).await,
        "CreateTopic" => topics::create(&request),
        "ListTopic" => topics::list(&request),
        "GetTopicAttributes" => topics::attributes(&request),
        "SetTopicAttributes" => topics::set_attributes(&request),
        "DeleteTopic" => topics::delete(&request),
        "PublishMessage" => topics::publish(&request, false).await,
        "BatchPublishMessage" => topics::publish(&request, true).await,
        // The SDK says Subscribe and Unsubscribe; the API reference CreateSubscription and DeleteSubscription.
        "Subscribe" | "CreateSubscription" => topics::subscribe(&request),
        "Unsubscribe" | "DeleteSubscription" => topics::unsubscribe(&request),
        "ListSubscriptionByTopic" => topics::subscriptions(&request),
        "GetSubscriptionAttributes" => topics::subscription_attributes(&request),
        other => Err(CmqError::invalid(format!("unknown Action '{other}'"))),
    }
}

/// The answer's fields from `(name, value)` pairs.
pub fn answer<const N: usize>(fields: [(&str, Value); N]) -> Answer {
    fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

/// Seconds since 1970.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
