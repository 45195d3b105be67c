//! The connection handshake: protocol header, start/start-ok (PLAIN, AMQPLAIN), secure,
//! tune/tune-ok, open/open-ok.

use super::error::ConnError;
use super::io::FrameReader;
use bytes::{Bytes, BytesMut};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use super::stream::WriteHalf;
use warren_broker::{User, VHost};
use warren_protocol::constants as c;
use warren_protocol::field::{FieldTable, FieldValue};
use warren_protocol::frame::{self, Frame};
use warren_protocol::method::*;

pub struct Negotiated {
    /// This connection's place under `max-connections`, held while it is open.
    pub slot: super::Slot,
    pub user: std::sync::Arc<User>,
    pub vhost: Arc<VHost>,
    pub frame_max: u32,
    pub channel_max: u16,
    pub heartbeat: u16,
    pub consumer_cancel_notify: bool,
    /// The client understands connection.blocked (used by resource alarms).
    #[allow(dead_code)]
    pub connection_blocked: bool,
    pub client_name: String,
    /// What the client said of itself (product, version, platform, capabilities), for the management API.
    pub client_properties: warren_protocol::field::FieldTable,
    /// The SASL mechanism it logged in with.
    pub auth_mechanism: String,
}

fn long_str(s: &str) -> FieldValue {
    FieldValue::LongString(Bytes::copy_from_slice(s.as_bytes()))
}

pub fn server_properties() -> FieldTable {
    let mut caps = FieldTable::new();
    for cap in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "consumer_priorities",
        "authentication_failure_close",
        "per_consumer_qos",
        "direct_reply_to",
    ] {
        caps.insert(cap.to_string(), FieldValue::Bool(true));
    }
    let mut props = FieldTable::new();
    props.insert("capabilities".to_string(), FieldValue::Table(caps));
    props.insert("cluster_name".to_string(), long_str("warren"));
    props.insert("copyright".to_string(), long_str("Copyright (c) the Warren authors"));
    props.insert("information".to_string(), long_str("Licensed under the Apache License 2.0"));
    props.insert("platform".to_string(), long_str("Rust"));
    props.insert("product".to_string(), long_str("Warren"));
    props.insert("version".to_string(), long_str(env!("CARGO_PKG_VERSION")));
    props
}

async fn send(socket: &mut WriteHalf, channel: u16, method: Method) -> Result<(), ConnError> {
    let mut buf = BytesMut::new();
    frame::write_method(&mut buf, channel, &method);
    socket.write_all(&buf).await.map_err(|_| ConnError::Gone)?;
    socket.flush().await.map_err(|_| ConnError::Gone)
}

/// PLAIN or AMQPLAIN: a user name and password, checked against the user's hash (failures per
/// source and user are throttled, `login_guard`).
async fn password_login(
    start_ok: &ConnectionStartOk,
    ctx: &super::ServerContext,
    peer: SocketAddr,
    refused: &impl Fn() -> ConnError,
) -> Result<Arc<User>, ConnError> {
    let (username, password) = match start_ok.mechanism.as_str() {
        "PLAIN" => parse_plain(&start_ok.response),
        "AMQPLAIN" => parse_amqplain(&start_ok.response),
        other => {
            return Err(ConnError::new(
                c::ACCESS_REFUSED,
                format!("ACCESS_REFUSED - unsupported authentication mechanism '{other}' (use PLAIN or AMQPLAIN, or EXTERNAL with a client certificate over TLS)"),
                c::CLASS_CONNECTION,
                11,
            ))
        }
    }
    .ok_or_else(|| {
        ConnError::new(
            c::ACCESS_REFUSED,
            format!("ACCESS_REFUSED - malformed {} response", start_ok.mechanism),
            c::CLASS_CONNECTION,
            11,
        )
    })?;
    // A source that failed too often for this user waits its turn (inside the handshake deadline).
    ctx.logins.wait_turn(peer.ip(), &username).await;
    let user = ctx.broker.authenticate(&username, &password).ok_or_else(|| {
        tracing::warn!(%peer, user = %username, "authentication failed: invalid credentials");
        ctx.logins.failed(peer.ip(), &username);
        refused()
    })?;
    ctx.logins.succeeded(peer.ip(), &username);
    Ok(user)
}

/// Reads the next method frame on channel 0, refusing anything else.
async fn expect_method(reader: &mut FrameReader, frame_max: u32) -> Result<Method, ConnError> {
    loop {
        match reader.next(frame_max).await? {
            Frame::Heartbeat { .. } => continue,
            Frame::Method { channel: 0, method } => return Ok(method),
            _ => {
                return Err(ConnError::new(c::UNEXPECTED_FRAME, "expected a connection method on channel 0 during the handshake", 0, 0))
            }
        }
    }
}

/// Runs the handshake after the protocol header was accepted.
pub async fn negotiate(
    reader: &mut FrameReader,
    socket: &mut WriteHalf,
    ctx: &super::ServerContext,
    peer: SocketAddr,
    identity: Option<&crate::tls::PeerIdentity>,
) -> Result<Negotiated, ConnError> {
    let (broker, config, slots) = (&*ctx.broker, &ctx.config, &ctx.slots);
    // EXTERNAL (rabbitmq_auth_mechanism_ssl) only where a verified client certificate names a user.
    let certificate_user = identity.and_then(|i| i.user.clone());
    send(
        socket,
        0,
        Method::ConnectionStart(ConnectionStart {
            version_major: 0,
            version_minor: 9,
            server_properties: server_properties(),
            mechanisms: match certificate_user {
                Some(_) => Bytes::from_static(b"PLAIN AMQPLAIN EXTERNAL"),
                None => Bytes::from_static(b"PLAIN AMQPLAIN"),
            },
            locales: Bytes::from_static(b"en_US"),
        }),
    )
    .await?;
    let pre_tune_max = config.frame_max;
    let start_ok = match expect_method(reader, pre_tune_max).await? {
        Method::ConnectionStartOk(m) => m,
        other => return Err(unexpected(&other, "connection.start-ok")),
    };
    let refused = || {
        ConnError::new(
            c::ACCESS_REFUSED,
            format!(
                "ACCESS_REFUSED - Login was refused using authentication mechanism {}. For details see the broker logfile.",
                start_ok.mechanism
            ),
            c::CLASS_CONNECTION,
            11,
        )
    };
    let user = match (start_ok.mechanism.as_str(), &certificate_user) {
        ("EXTERNAL", Some(name)) => broker.users().user(name).ok_or_else(|| {
            tracing::warn!(%peer, user = %name, "authentication failed: no user named as the client certificate's subject");
            refused()
        })?,
        _ => password_login(&start_ok, ctx, peer, &refused).await?,
    };
    let username = user.name.clone();
    if user.loopback_only && !peer.ip().is_loopback() {
        tracing::warn!(%peer, user = %username, "user can only connect via localhost");
        return Err(ConnError::new(
            c::ACCESS_REFUSED,
            format!("ACCESS_REFUSED - user '{username}' can only connect via localhost"),
            c::CLASS_CONNECTION,
            11,
        ));
    }
    let capabilities = start_ok.client_properties.get("capabilities").and_then(|v| v.as_table());
    let has_cap = |name: &str| capabilities.and_then(|t| t.get(name)).and_then(|v| v.as_bool()).unwrap_or(false);
    let consumer_cancel_notify = has_cap("consumer_cancel_notify");
    let connection_blocked = has_cap("connection.blocked");
    let client_name = start_ok
        .client_properties
        .get("connection_name")
        .or_else(|| start_ok.client_properties.get("product"))
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();

    send(
        socket,
        0,
        Method::ConnectionTune(ConnectionTune {
            channel_max: config.channel_max,
            frame_max: config.frame_max,
            heartbeat: config.heartbeat,
        }),
    )
    .await?;
    let tune_ok = match expect_method(reader, pre_tune_max).await? {
        Method::ConnectionTuneOk(m) => m,
        other => return Err(unexpected(&other, "connection.tune-ok")),
    };
    let frame_max = match tune_ok.frame_max {
        0 => config.frame_max,
        n if n < c::FRAME_MIN_SIZE => {
            return Err(ConnError::new(
                c::NOT_ALLOWED,
                format!("NOT_ALLOWED - frame_max={n} < {} min size", c::FRAME_MIN_SIZE),
                c::CLASS_CONNECTION,
                31,
            ))
        }
        n if n > config.frame_max => {
            return Err(ConnError::new(
                c::NOT_ALLOWED,
                format!("NOT_ALLOWED - frame_max={n} > {} max size", config.frame_max),
                c::CLASS_CONNECTION,
                31,
            ))
        }
        n => n,
    };
    let channel_max = match tune_ok.channel_max {
        0 => config.channel_max,
        n if n > config.channel_max => {
            return Err(ConnError::new(
                c::NOT_ALLOWED,
                format!("NOT_ALLOWED - channel_max={n} > {} max channels", config.channel_max),
                c::CLASS_CONNECTION,
                31,
            ))
        }
        n => n,
    };
    let heartbeat = tune_ok.heartbeat;

    let open = match expect_method(reader, frame_max).await? {
        Method::ConnectionOpen(m) => m,
        other => return Err(unexpected(&other, "connection.open")),
    };
    let vhost = broker.vhost(&open.virtual_host).ok_or_else(|| {
        ConnError::new(c::NOT_ALLOWED, format!("NOT_ALLOWED - vhost {} not found", open.virtual_host), c::CLASS_CONNECTION, 40)
    })?;
    if !broker.can_access(&user, &open.virtual_host) {
        tracing::warn!(%peer, user = %user.name, vhost = %open.virtual_host, "connection refused: the user has no permission on the vhost");
        return Err(ConnError::new(
            c::NOT_ALLOWED,
            format!("NOT_ALLOWED - access to vhost '{}' refused for user '{}'", open.virtual_host, user.name),
            c::CLASS_CONNECTION,
            40,
        ));
    }
    // The vhost's `max-connections`, counting every node's connections as RabbitMQ does (those of
    // the nodes that answer within VHOST_COUNT_WAIT; an unreachable node's are not counted).
    if let Some(max) = broker.vhost_limits(&open.virtual_host).max_connections {
        let mut open_now = ctx.registry.count_in(&open.virtual_host) as u64;
        if let Some(cluster) = ctx.cluster.as_ref().filter(|_| (open_now as i64) < max) {
            open_now += crate::http::mgmt::peers::vhost_connections_elsewhere(cluster, &open.virtual_host, VHOST_COUNT_WAIT).await;
        }
        if open_now as i64 >= max {
            tracing::warn!(%peer, vhost = %open.virtual_host, max, "connection refused: the vhost's connection limit is reached");
            return Err(ConnError::new(
                c::NOT_ALLOWED,
                format!("NOT_ALLOWED - access to vhost '{}' refused for user '{}': connection limit ({max}) is reached", open.virtual_host, user.name),
                c::CLASS_CONNECTION,
                40,
            ));
        }
    }
    let slot = slots.take().map_err(|max| {
        tracing::warn!(%peer, max_connections = max, "connection refused: max-connections reached");
        ConnError::new(
            c::NOT_ALLOWED,
            format!("NOT_ALLOWED - connection refused: node connection limit ({max}) is reached"),
            c::CLASS_CONNECTION,
            40,
        )
    })?;
    send(socket, 0, Method::ConnectionOpenOk(ConnectionOpenOk { reserved_1: String::new() })).await?;
    Ok(Negotiated { slot, user, vhost, frame_max, channel_max, heartbeat, consumer_cancel_notify, connection_blocked, client_name, client_properties: start_ok.client_properties, auth_mechanism: start_ok.mechanism })
}

/// How long a connection to a vhost with `max-connections` waits for the other nodes' counts.
const VHOST_COUNT_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

fn unexpected(got: &Method, wanted: &str) -> ConnError {
    ConnError::new(
        c::COMMAND_INVALID,
        format!("COMMAND_INVALID - expected {wanted}, got {}", got.name()),
        got.class_id(),
        got.method_id(),
    )
}

/// PLAIN: `authzid \0 authcid \0 password`.
fn parse_plain(response: &[u8]) -> Option<(String, String)> {
    let mut parts = response.split(|b| *b == 0);
    let _authzid = parts.next()?;
    let user = std::str::from_utf8(parts.next()?).ok()?.to_string();
    let pass = std::str::from_utf8(parts.next()?).ok()?.to_string();
    Some((user, pass))
}

/// AMQPLAIN: a field table without its length prefix, holding LOGIN and PASSWORD.
fn parse_amqplain(response: &[u8]) -> Option<(String, String)> {
    let mut framed = BytesMut::with_capacity(response.len() + 4);
    framed.extend_from_slice(&(response.len() as u32).to_be_bytes());
    framed.extend_from_slice(response);
    let table = FieldTable::decode(&framed).ok()?;
    let get = |k: &str| table.get(k).and_then(|v| v.as_str()).map(str::to_string);
    Some((get("LOGIN")?, get("PASSWORD")?))
}

