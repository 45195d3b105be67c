//! Broker errors, each carrying the AMQP reply code a client receives.
//!
//! One table: `BrokerError::reply_code` and `BrokerError::scope` decide whether the
//! failure closes the channel (403, 404, 405, 406) or the whole connection
//! (501-505, 530, 540, 541), as the AMQP 0-9-1 spec and RabbitMQ do.

use warren_protocol::constants as c;

/// Whether an error closes only the channel or the whole connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Channel,
    Connection,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text}")]
pub struct BrokerError {
    pub code: u16,
    pub text: String,
}

impl BrokerError {
    pub fn new(code: u16, text: impl Into<String>) -> Self {
        BrokerError { code, text: text.into() }
    }
    pub fn access_refused(text: impl Into<String>) -> Self {
        Self::new(c::ACCESS_REFUSED, text)
    }
    pub fn not_found(text: impl Into<String>) -> Self {
        Self::new(c::NOT_FOUND, text)
    }
    pub fn resource_locked(text: impl Into<String>) -> Self {
        Self::new(c::RESOURCE_LOCKED, text)
    }
    pub fn precondition_failed(text: impl Into<String>) -> Self {
        Self::new(c::PRECONDITION_FAILED, text)
    }
    pub fn not_allowed(text: impl Into<String>) -> Self {
        Self::new(c::NOT_ALLOWED, text)
    }
    pub fn not_implemented(text: impl Into<String>) -> Self {
        Self::new(c::NOT_IMPLEMENTED, text)
    }
    pub fn command_invalid(text: impl Into<String>) -> Self {
        Self::new(c::COMMAND_INVALID, text)
    }
    pub fn internal(text: impl Into<String>) -> Self {
        Self::new(c::INTERNAL_ERROR, text)
    }

    /// Channel exceptions are the 3xx/4xx codes; everything in 5xx closes the connection.
    pub fn scope(&self) -> Scope {
        if self.code >= 500 {
            Scope::Connection
        } else {
            Scope::Channel
        }
    }

    /// The reply text as RabbitMQ formats it: `NOT_FOUND - no queue 'q' in vhost '/'`.
    pub fn reply_text(&self) -> String {
        format!("{} - {}", reply_name(self.code), self.text)
    }
}

/// The symbolic name RabbitMQ puts in front of a reply text.
pub fn reply_name(code: u16) -> &'static str {
    match code {
        c::REPLY_SUCCESS => "OK",
        c::CONTENT_TOO_LARGE => "CONTENT_TOO_LARGE",
        c::NO_ROUTE => "NO_ROUTE",
        c::NO_CONSUMERS => "NO_CONSUMERS",
        c::CONNECTION_FORCED => "CONNECTION_FORCED",
        c::INVALID_PATH => "INVALID_PATH",
        c::ACCESS_REFUSED => "ACCESS_REFUSED",
        c::NOT_FOUND => "NOT_FOUND",
        c::RESOURCE_LOCKED => "RESOURCE_LOCKED",
        c::PRECONDITION_FAILED => "PRECONDITION_FAILED",
        c::FRAME_ERROR => "FRAME_ERROR",
        c::SYNTAX_ERROR => "SYNTAX_ERROR",
        c::COMMAND_INVALID => "COMMAND_INVALID",
        c::CHANNEL_ERROR => "CHANNEL_ERROR",
        c::UNEXPECTED_FRAME => "UNEXPECTED_FRAME",
        c::RESOURCE_ERROR => "RESOURCE_ERROR",
        c::NOT_ALLOWED => "NOT_ALLOWED",
        c::NOT_IMPLEMENTED => "NOT_IMPLEMENTED",
        c::INTERNAL_ERROR => "INTERNAL_ERROR",
        _ => "ERROR",
    }
}

pub type Result<T> = std::result::Result<T, BrokerError>;
