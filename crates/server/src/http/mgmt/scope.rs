//! What a user of the management API may see and do, by its tags and permissions, in RabbitMQ
//! 3.10's rules and words (its `rabbit_mgmt_util:is_authorized_*` checks;
//! tests/python/test_management_tags.py holds the table recorded from RabbitMQ 3.10.8):
//!
//! - A route needs a tag (`mgmt::router` groups them): `management` (any of the four tags: the
//!   overview, lists, objects in a vhost), `monitoring` (or `administrator`: the nodes; 401 "Not
//!   monitor user"), `policymaker` (or `administrator`: parameters) or `administrator` (users,
//!   permissions, vhosts' own pages and changes, definitions; 401 "Not administrator user").
//! - Objects in a vhost (queues, exchanges, bindings, policies, a vhost's connections): an
//!   administrator sees every vhost's; anyone else those of the vhosts it has a permission in
//!   (monitoring too), and a path naming another vhost is 401 "User not authorised to access
//!   virtual host". The vhost list and vhost limits: every vhost for monitoring too.
//! - Connections, channels and consumers: administrator and monitoring see everyone's, the others
//!   their own only ("User not authorised to access object" for another's); only an
//!   administrator closes another's connection.
//! - Operations on a vhost's objects (declare, delete, purge, bind, get, publish, the aliveness
//!   test, rewind) need the user's own permission there, whatever its tags: an administrator
//!   without one is refused too ("Access refused.").
//!
//! Each handler that shows or changes something in a vhost takes a [`Scope`] and asks it.

use std::sync::Arc;

use axum::extract::{FromRequestParts, Request};
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use warren_broker::auth::{Perm, Permission, User, Users};
use warren_broker::exchange::ExchangeKind;
use warren_broker::VHost;

pub use crate::connection::access::Resource;
use crate::connection::access::{refused_text, resource_name, topic_refused_text};
use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, ApiResult};
use crate::http::HttpContext;

const MONITORING: &str = "monitoring";
const POLICYMAKER: &str = "policymaker";

/// The user of a request and the broker's view of users and permissions it is checked against
/// (one view for the whole request).
pub struct Scope {
    pub user: Arc<User>,
    users: Arc<Users>,
}

impl FromRequestParts<Arc<HttpContext>> for Scope {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, ctx: &Arc<HttpContext>) -> Result<Scope, ApiError> {
        // `auth::require_user` runs before every management route and puts the user there.
        let AuthUser(user) = parts.extensions.get::<AuthUser>().cloned().ok_or_else(|| ApiError::unauthorized("Login failed"))?;
        Ok(Scope { user, users: ctx.broker.users() })
    }
}

/// What is in a vhost but is not the user's to operate on: how the API says so.
pub enum Refused {
    /// No permission in the vhost at all (RabbitMQ: the connection the API opens as the user is
    /// refused): 401 "Access refused.".
    Vhost,
    /// A permission that does not cover the resource: the AMQP channel's 403 text, as RabbitMQ
    /// passes it on from the operation it runs as the user.
    Amqp(String),
}

impl Refused {
    /// As `/get` and the aliveness test answer it: 401 with the AMQP text.
    pub fn not_authorised(self) -> ApiError {
        match self {
            Refused::Vhost => access_refused(),
            Refused::Amqp(text) => ApiError::not_authorised(format!("ACCESS_REFUSED - {text}")),
        }
    }

    /// As a publish answers it: 400 with the AMQP code and text.
    pub fn bad_request(self) -> ApiError {
        match self {
            Refused::Vhost => access_refused(),
            Refused::Amqp(text) => ApiError::bad_request(format!("403 ACCESS_REFUSED - {text}")),
        }
    }
}

fn access_refused() -> ApiError {
    ApiError::not_authorised("Access refused.")
}

impl Scope {
    pub fn is_administrator(&self) -> bool {
        self.user.is_administrator()
    }

    /// Administrator or monitoring: sees every connection, channel, consumer, node and vhost name.
    pub fn is_monitor(&self) -> bool {
        self.is_administrator() || self.user.has_tag(MONITORING)
    }

    fn permission(&self, vhost: &str) -> Option<Arc<Permission>> {
        self.users.permission(&self.user.name, vhost)
    }

    /// Whether the user has a permission in `vhost` (may open an AMQP connection to it).
    pub fn permitted_in(&self, vhost: &str) -> bool {
        self.permission(vhost).is_some()
    }

    /// Whether the objects of `vhost` are shown to the user (in lists and by path).
    pub fn sees_objects_in(&self, vhost: &str) -> bool {
        self.is_administrator() || self.permitted_in(vhost)
    }

    /// Whether `vhost` itself is listed for the user (`/api/vhosts`, `/api/vhost-limits`).
    pub fn sees_vhost(&self, vhost: &str) -> bool {
        self.is_monitor() || self.permitted_in(vhost)
    }

    /// The vhost a path names: 404 if there is none (as for an administrator), 401 if its
    /// objects are not the user's to see.
    pub fn vhost(&self, ctx: &HttpContext, name: &str) -> ApiResult<Arc<VHost>> {
        let v = super::vhost(ctx, name)?;
        if !self.sees_objects_in(name) {
            return Err(ApiError::not_authorised("User not authorised to access virtual host"));
        }
        Ok(v)
    }

    /// The vhosts a list covers: the one a path names ([`Scope::vhost`]), or every vhost whose
    /// objects the user sees, sorted by name.
    pub fn vhosts(&self, ctx: &HttpContext, name: Option<&str>) -> ApiResult<Vec<Arc<VHost>>> {
        match name {
            Some(name) => Ok(vec![self.vhost(ctx, name)?]),
            None => Ok(super::vhosts(ctx, None)?.into_iter().filter(|v| self.sees_objects_in(&v.name)).collect()),
        }
    }

    /// Whether a connection, channel or consumer of user `owner` is shown.
    pub fn sees_owner(&self, owner: &str) -> bool {
        self.is_monitor() || owner == self.user.name
    }

    /// A connection of `owner` asked for by name: 401 if it is not the user's to see.
    pub fn may_see(&self, owner: &str) -> ApiResult<()> {
        if self.sees_owner(owner) {
            Ok(())
        } else {
            Err(ApiError::not_authorised("User not authorised to access object"))
        }
    }

    /// Closing a connection of `owner`: an administrator's, or the owner's.
    pub fn may_close(&self, owner: &str) -> ApiResult<()> {
        if self.is_administrator() || owner == self.user.name {
            Ok(())
        } else {
            Err(ApiError::not_authorised("User not authorised to access object"))
        }
    }

    /// The API's own check of an operation on a queue or exchange (the default exchange is
    /// `amq.default`): 401 "Access refused." unless the user's permission in the vhost allows
    /// `perm` on it.
    pub fn check(&self, vhost: &str, perm: Perm, what: Resource, name: &str) -> ApiResult<()> {
        self.check_amqp(vhost, perm, what, name).map_err(|_| access_refused())
    }

    /// The check of an operation the API runs as the user over AMQP (basic.get, basic.publish,
    /// the aliveness test), with the channel's words for a refusal.
    pub fn check_amqp(&self, vhost: &str, perm: Perm, what: Resource, name: &str) -> Result<(), Refused> {
        let permission = self.permission(vhost).ok_or(Refused::Vhost)?;
        let resource = resource_name(what, name);
        if permission.allows(perm, resource) {
            return Ok(());
        }
        Err(Refused::Amqp(refused_text(what, resource, vhost, &self.user.name)))
    }

    /// A publish's topic permission (write) on routing key `key` of a topic exchange, as AMQP
    /// checks it: no topic permission for the exchange allows every key.
    pub fn check_topic_write(&self, vhost: &str, exchange: &str, kind: ExchangeKind, key: &str) -> Result<(), Refused> {
        if kind != ExchangeKind::Topic {
            return Ok(());
        }
        let found = self.users.topic_permissions().iter().find(|p| p.user == self.user.name && p.vhost == vhost && p.exchange == exchange);
        let Some(p) = found else { return Ok(()) };
        let allowed = warren_broker::auth::defs::topic_pattern(&p.write, &self.user.name, vhost).is_some_and(|re| re.is_match(key));
        if allowed {
            return Ok(());
        }
        Err(Refused::Amqp(topic_refused_text(key, exchange, vhost, &self.user.name)))
    }
}

fn user_of(request: &Request) -> Option<&User> {
    request.extensions().get::<AuthUser>().map(|AuthUser(u)| &**u)
}

/// Route layer: administrators only.
pub async fn administrators(request: Request, next: Next) -> Response {
    match user_of(&request) {
        Some(u) if u.is_administrator() => next.run(request).await,
        _ => ApiError::not_authorised("Not administrator user").into_response(),
    }
}

/// Route layer: administrators and monitoring users.
pub async fn monitors(request: Request, next: Next) -> Response {
    match user_of(&request) {
        Some(u) if u.is_administrator() || u.has_tag(MONITORING) => next.run(request).await,
        _ => ApiError::not_authorised("Not monitor user").into_response(),
    }
}

/// Route layer: administrators and policymakers (RabbitMQ's words for the others).
pub async fn policymakers(request: Request, next: Next) -> Response {
    match user_of(&request) {
        Some(u) if u.is_administrator() || u.has_tag(POLICYMAKER) => next.run(request).await,
        _ => ApiError::not_authorised("User not authorised to access object").into_response(),
    }
}
