//! Errors as the management API answers them: RabbitMQ's shape, `{"error": ..., "reason": ...}`,
//! with its status codes (rabbitmqadmin prints `reason` of a 400; clients switch on the code).

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use warren_broker::error::BrokerError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub error: &'static str,
    pub reason: String,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn bad_request(reason: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::BAD_REQUEST, error: "bad_request", reason: reason.into() }
    }

    pub fn not_found(reason: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::NOT_FOUND, error: "Object Not Found", reason: reason.into() }
    }

    pub fn unauthorized(reason: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::UNAUTHORIZED, error: "not_authorized", reason: reason.into() }
    }

    /// Logged in, but not allowed (RabbitMQ's spelling and code for a user lacking a tag).
    pub fn not_authorised(reason: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::UNAUTHORIZED, error: "not_authorised", reason: reason.into() }
    }

    pub fn unavailable(reason: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::SERVICE_UNAVAILABLE, error: "unavailable", reason: reason.into() }
    }
}

/// A malformed request: the text says what is wrong.
impl From<String> for ApiError {
    fn from(reason: String) -> ApiError {
        ApiError::bad_request(reason)
    }
}

/// A broker refusal: a precondition or a wrong argument is the client's (400), a missing object
/// 404, a locked one 405 (RabbitMQ answers these), anything else the server's (500).
impl From<BrokerError> for ApiError {
    fn from(e: BrokerError) -> ApiError {
        use warren_protocol::constants as c;
        let status = match e.code {
            c::NOT_FOUND => StatusCode::NOT_FOUND,
            c::RESOURCE_LOCKED => StatusCode::METHOD_NOT_ALLOWED,
            c::ACCESS_REFUSED => StatusCode::FORBIDDEN,
            c::PRECONDITION_FAILED | c::COMMAND_INVALID | c::NOT_ALLOWED | c::SYNTAX_ERROR | c::NOT_IMPLEMENTED => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let error = match status {
            StatusCode::NOT_FOUND => "Object Not Found",
            StatusCode::BAD_REQUEST => "bad_request",
            _ => "internal_server_error",
        };
        ApiError { status, error, reason: e.text }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": self.error, "reason": self.reason}).to_string();
        let mut response = (self.status, [(header::CONTENT_TYPE, "application/json")], body).into_response();
        if self.status == StatusCode::UNAUTHORIZED && self.error != "not_authorised" {
            // rabbitmqadmin and browsers look for it; the realm is RabbitMQ's.
            response.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Basic realm=\"RabbitMQ Management\""));
        }
        response
    }
}

/// Any path no route serves.
pub async fn not_found() -> ApiError {
    ApiError::not_found("Not Found")
}
