//! HTTP Basic authentication against the broker's users, as RabbitMQ's management plugin does it:
//! a missing or wrong `Authorization` gets 401 with `WWW-Authenticate`, and a loopback-only user
//! (`loopback-users`, `guest` by default) is refused from any other address, as on AMQP. A script's
//! request (`X-Requested-With: XMLHttpRequest`, as the web UI sends) gets its 401 without
//! `WWW-Authenticate`, so that the browser shows no password dialog of its own.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use warren_broker::User;

use super::error::ApiError;
use super::{HttpContext, Peer};

/// The authenticated user of a request (in its extensions, for the handlers).
#[derive(Clone, Debug)]
pub struct AuthUser(pub Arc<User>);

/// Middleware: lets the request through with its [`AuthUser`], or answers 401.
pub async fn require_user(State(ctx): State<Arc<HttpContext>>, mut request: Request, next: Next) -> Response {
    let peer = request.extensions().get::<Peer>().copied();
    match authenticate(&ctx, request.headers().get(header::AUTHORIZATION), peer).await {
        Ok(user) => {
            if let Err(refused) = may_use(&user) {
                return refused.into_response();
            }
            request.extensions_mut().insert(AuthUser(user));
            next.run(request).await
        }
        Err(e) => {
            let from_script = request.headers().get("x-requested-with").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"XMLHttpRequest"));
            let mut response = e.into_response();
            if from_script {
                // The web UI asks with its own login form: `WWW-Authenticate` would make the browser
                // open its password dialog over it (and hold the request until it is answered).
                response.headers_mut().remove(header::WWW_AUTHENTICATE);
            }
            response
        }
    }
}

/// The management API by tag, as RabbitMQ: a user with none of its tags is refused everything
/// (401 "Not management user", no `WWW-Authenticate`: its password was right). What each tag then
/// reaches is `mgmt::scope`'s.
fn may_use(user: &User) -> Result<(), ApiError> {
    if !user.may_use_management() {
        return Err(ApiError::not_authorised("Not management user"));
    }
    Ok(())
}

async fn authenticate(ctx: &HttpContext, authorization: Option<&header::HeaderValue>, peer: Option<Peer>) -> Result<Arc<User>, ApiError> {
    let value = authorization.ok_or_else(|| ApiError::unauthorized("Login failed"))?;
    let (name, password) = basic_credentials(value.as_bytes()).ok_or_else(|| ApiError::unauthorized("Login failed"))?;
    let source = peer.map(|p| p.0.ip());
    if let Some(source) = source {
        ctx.logins.wait_turn(source, &name).await;
    }
    let user = ctx.broker.authenticate(&name, &password).ok_or_else(|| {
        tracing::warn!(user = %name, peer = ?peer.map(|p| p.0), "HTTP authentication failed: invalid credentials");
        if let Some(source) = source {
            ctx.logins.failed(source, &name);
        }
        ApiError::unauthorized("Login failed")
    })?;
    if let Some(source) = source {
        ctx.logins.succeeded(source, &name);
    }
    if user.loopback_only && !peer.is_some_and(|p| p.0.ip().is_loopback()) {
        tracing::warn!(user = %name, peer = ?peer.map(|p| p.0), "HTTP user can only connect via localhost");
        return Err(ApiError::unauthorized(format!("User '{name}' can only log in via localhost")));
    }
    Ok(user)
}

/// The user name and password of `Basic BASE64(name:password)`; None if it is anything else.
pub fn basic_credentials(value: &[u8]) -> Option<(String, String)> {
    let value = std::str::from_utf8(value).ok()?.trim();
    let (scheme, encoded) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (name, password) = text.split_once(':')?;
    Some((name.to_owned(), password.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::basic_credentials;

    #[test]
    fn basic_credentials_are_decoded_and_anything_else_is_refused() {
        assert_eq!(basic_credentials(b"Basic Z3Vlc3Q6Z3Vlc3Q="), Some(("guest".into(), "guest".into())));
        assert_eq!(basic_credentials(b"basic Z3Vlc3Q6YTpi"), Some(("guest".into(), "a:b".into())));
        assert_eq!(basic_credentials(b"Bearer Z3Vlc3Q6Z3Vlc3Q="), None);
        assert_eq!(basic_credentials(b"Basic not-base64!"), None);
        assert_eq!(basic_credentials(b"Basic Z3Vlc3Q="), None); // no colon
        assert_eq!(basic_credentials(b"Basic"), None);
        assert_eq!(basic_credentials(&[0xff, 0xfe]), None);
    }
}
