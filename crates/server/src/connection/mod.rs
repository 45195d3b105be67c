//! One AMQP connection: protocol header, handshake, then the read loop that turns frames into
//! channel operations. Writes go through the [`outbox::Outbox`] to the writer task.
//!
//! Errors follow the spec: a channel exception closes that channel (channel.close), a
//! connection exception closes the connection (connection.close) after which only
//! connection.close-ok is read. Nothing a peer sends can panic the server.

pub mod access;
mod channel;
mod error;
mod frames;
mod handshake;
mod io;
pub mod outbox;
pub mod registry;
mod stream;
mod writer;

use crate::config::Config;
use bytes::{Buf, BytesMut};
use channel::ChannelHandler;
use error::ConnError;
use io::FrameReader;
use outbox::{Outbox, Outgoing};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use warren_broker::{Broker, User, VHost};
use warren_protocol::constants as c;
use warren_protocol::frame::{self, Frame};
use warren_protocol::method::*;

const CLOSE_OK_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a connection's reader or writer must have been idle before it frees its buffers: ten
/// thousand idle connections must not keep 64 KiB each.
const RELEASE_BUFFERS_AFTER: Duration = Duration::from_secs(1);

static NEXT_CONNECTION_ID: AtomicU64 = AtomicU64::new(1);

/// What every connection shares: the broker, the configuration, the alarms, the registry (which
/// also carries the shutdown to each connection).
pub struct ServerContext {
    pub broker: Arc<Broker>,
    pub config: Config,
    /// Resource alarms: while one is raised, connections that publish are not read.
    pub alarms: watch::Receiver<crate::alarms::AlarmState>,
    /// Open connections, against `max-connections`.
    pub slots: ConnectionSlots,
    /// Open connections, as the management API lists and closes them.
    pub registry: Arc<registry::ConnectionRegistry>,
    /// Connections in their handshake, against `max-handshakes` (taken at accept).
    pub handshakes: crate::login_guard::HandshakeSlots,
    /// Failed logins, shared with the HTTP APIs.
    pub logins: Arc<crate::login_guard::LoginGuard>,
    /// The AMQPS listener's TLS configuration (none without `tls-cert` and `tls-key`).
    pub tls: Option<Arc<crate::tls::Tls>>,
    /// A cluster member's node: a vhost's `max-connections` counts every node's connections.
    pub cluster: Option<warren_cluster::ClusterNode>,
}

/// Counts open connections (those past connection.open) against `max-connections` (0: no limit).
pub struct ConnectionSlots {
    open: Arc<AtomicU64>,
    max: u64,
}

/// One open connection's place; given back when dropped.
pub struct Slot(Arc<AtomicU64>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ConnectionSlots {
    pub fn new(max: u32) -> Self {
        ConnectionSlots { open: Arc::new(AtomicU64::new(0)), max: max as u64 }
    }

    /// A place for one more connection, or the limit when all are taken.
    pub fn take(&self) -> Result<Slot, u64> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (self.max == 0 || n < self.max).then_some(n + 1))
            .map(|_| Slot(self.open.clone()))
            .map_err(|_| self.max)
    }
}

/// What a channel handler needs from its connection.
/// The longest a publisher pauses at once for a queue that asks it to (see `ConnectionShared::slowed_by`).
const FLOW_WAIT: Duration = Duration::from_millis(50);

pub struct ConnectionShared {
    pub id: u64,
    /// Users and permissions (`access`).
    pub broker: Arc<Broker>,
    pub vhost: Arc<VHost>,
    pub user: Arc<User>,
    pub outbox: Arc<Outbox>,
    pub max_message_size: u64,
    /// The node's delivery acknowledgement timeout in ms (0: off); see `Channel::ack_timed_out`.
    pub consumer_timeout_ms: u64,
    /// A queue this connection published to asks publishers to pause (a slow no-ack consumer): the
    /// reader waits for it before reading more.
    pub slowed_by: parking_lot::Mutex<Option<Arc<warren_broker::Queue>>>,
    /// A basic.get waits for its queue (see `ChannelHandler::get`): nothing more is read or handled
    /// until it is answered, so replies keep their order.
    pub waiting_get: parking_lot::Mutex<Option<channel::WaitingGet>>,
    /// A publish of this connection went to the store while it was behind (a slow or full disk): the
    /// reader waits for `Store::caught_up` before handling or reading more.
    pub store_behind: std::sync::atomic::AtomicBool,
    /// Bytes of message bodies received and not yet complete, on all channels (see `channel::Unfinished`).
    pub unfinished_content: Arc<AtomicU64>,
    /// What the connection's confirmed and transactional operations wait for in quorum queues.
    pub session: Arc<warren_broker::PublisherSession>,
}

/// How an accepted socket is spoken to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Plain,
    /// TLS first (the AMQPS port), with the context's `tls`.
    Tls,
}

/// Serves one accepted connection until it closes; `handshake` is its place among those in their
/// handshake, given back once it is open (or refused).
pub async fn serve(stream: TcpStream, transport: Transport, peer: SocketAddr, ctx: Arc<ServerContext>, handshake: crate::login_guard::HandshakeSlot) {
    let _ = stream.set_nodelay(true);
    let stream_local = stream.local_addr().unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
    // One deadline for the whole handshake, from the TLS handshake to connection.open: a client that
    // trickles its bytes (slowloris) cannot hold a connection longer than this.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(ctx.config.handshake_timeout as u64);
    let (mut read, mut write, session) = match (transport, &ctx.tls) {
        (Transport::Plain, _) => {
            let (read, write) = stream::split_plain(stream);
            (read, write, None)
        }
        (Transport::Tls, None) => return,
        (Transport::Tls, Some(tls)) => match tokio::time::timeout_at(deadline, tls.amqp_acceptor().accept(stream)).await {
            Ok(Ok(stream)) => {
                let session = tls.session(stream.get_ref().1);
                let (read, write) = stream::split_tls(stream);
                (read, write, Some(session))
            }
            Ok(Err(e)) => {
                tracing::info!(%peer, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::info!(%peer, timeout_s = ctx.config.handshake_timeout, "closing connection: TLS handshake not completed in handshake-timeout");
                return;
            }
        },
    };
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let header_ok = tokio::time::timeout_at(deadline, async {
        while buf.len() < 8 {
            match read.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(_) => {}
            }
        }
        true
    })
    .await
    .unwrap_or(false);
    if !header_ok {
        return;
    }
    if buf.get(..8) != Some(&c::PROTOCOL_HEADER[..]) {
        // The spec: answer with the protocol header we speak, then close.
        tracing::debug!(%peer, "refused connection with a bad protocol header");
        let _ = tokio::time::timeout(CLOSE_OK_TIMEOUT, async {
            write.write_all(&c::PROTOCOL_HEADER).await?;
            write.shutdown().await
        })
        .await;
        return;
    }
    buf.advance(8);
    let mut reader = FrameReader::new(read, buf);

    let negotiated = match tokio::time::timeout_at(
        deadline,
        handshake::negotiate(&mut reader, &mut write, &ctx, peer, session.as_ref().and_then(|s| s.peer.as_ref())),
    )
    .await
    {
        Ok(Ok(n)) => n,
        Ok(Err(ConnError::Close { code, text, class_id, method_id })) => {
            let mut out = BytesMut::new();
            frame::write_method(
                &mut out,
                0,
                &Method::ConnectionClose(ConnectionClose { reply_code: code, reply_text: text, class_id, method_id }),
            );
            let _ = tokio::time::timeout(CLOSE_OK_TIMEOUT, async {
                write.write_all(&out).await?;
                write.flush().await
            })
            .await;
            let _ = tokio::time::timeout(CLOSE_OK_TIMEOUT, reader.next(c::FRAME_MIN_SIZE)).await;
            let _ = tokio::time::timeout(CLOSE_OK_TIMEOUT, write.shutdown()).await;
            return;
        }
        Ok(Err(ConnError::Gone)) => return,
        Err(_) => {
            tracing::info!(%peer, timeout_s = ctx.config.handshake_timeout, "closing connection: handshake not completed in handshake-timeout");
            return;
        }
    };

    drop(handshake);
    let _slot = negotiated.slot; // given back when this function returns
    let id = NEXT_CONNECTION_ID.fetch_add(1, Ordering::Relaxed);
    tracing::info!(%peer, connection = id, user = %negotiated.user.name, vhost = %negotiated.vhost.name,
        client = %negotiated.client_name, "connection opened");
    let registered = ctx.registry.register(registry::Opened {
        id,
        peer,
        local: stream_local,
        user: negotiated.user.name.clone(),
        vhost: negotiated.vhost.name.clone(),
        client_properties: negotiated.client_properties,
        frame_max: negotiated.frame_max,
        channel_max: negotiated.channel_max,
        heartbeat: negotiated.heartbeat,
        auth_mechanism: negotiated.auth_mechanism.clone(),
        tls: session,
    });
    // Its user, permission or vhost removed between the handshake's check and the registration
    // (whose closing found no registered connection): closed as if registered first.
    if !ctx.broker.can_access(&negotiated.user, &negotiated.vhost.name) {
        registered.info.close(&format!("user '{}' may no longer use vhost '{}'", negotiated.user.name, negotiated.vhost.name));
    }
    let outbox = Arc::new(Outbox::new(ctx.broker.store().clone()));
    let writer_config = Arc::new(parking_lot::Mutex::new(writer::WriterConfig {
        frame_max: negotiated.frame_max,
        heartbeat_every: (negotiated.heartbeat > 0).then(|| Duration::from_millis(negotiated.heartbeat as u64 * 500)),
        consumer_cancel_notify: negotiated.consumer_cancel_notify,
        write_timeout: Duration::from_secs(ctx.config.write_timeout as u64),
        connection: id,
    }));
    let sink: std::sync::Weak<dyn warren_broker::ClientSink> = Arc::downgrade(&outbox) as _;
    let session = Arc::new(warren_broker::PublisherSession::new(sink));
    let writer = tokio::spawn(writer::run(write, outbox.clone(), ctx.broker.store().durable(), session.clone(), writer_config));

    let mut conn = Connection {
        shared: ConnectionShared {
            id,
            broker: ctx.broker.clone(),
            vhost: negotiated.vhost.clone(),
            user: negotiated.user.clone(),
            outbox: outbox.clone(),
            max_message_size: ctx.config.max_message_size as u64,
            consumer_timeout_ms: ctx.config.consumer_timeout,
            slowed_by: parking_lot::Mutex::new(None),
            waiting_get: parking_lot::Mutex::new(None),
            store_behind: std::sync::atomic::AtomicBool::new(false),
            unfinished_content: Arc::new(AtomicU64::new(0)),
            session,
        },
        channels: HashMap::new(),
        frame_max: negotiated.frame_max,
        channel_max: negotiated.channel_max,
        heartbeat: negotiated.heartbeat,
        connection_blocked: negotiated.connection_blocked,
        publisher: false,
        alarms: ctx.alarms.clone(),
        store: ctx.broker.store().clone(),
        info: registered.info.clone(),
    };
    // Becomes true at the server's shutdown or when an operator closes this connection.
    let mut shutdown = registered.close.clone();
    let mut ended = conn.run(&mut reader, &mut shutdown).await;
    if let (Ended::Error(ConnError::Close { code: c::CONNECTION_FORCED, text, .. }), Some(reason)) =
        (&mut ended, registered.info.closed_by_operator.lock().clone())
    {
        *text = format!("CONNECTION_FORCED - {reason}");
    }
    match ended {
        Ended::ClientClosed => {
            conn.cleanup();
            outbox.method(0, Method::ConnectionCloseOk(ConnectionCloseOk {}));
            outbox.push(Outgoing::Close);
        }
        Ended::Error(ConnError::Close { code, text, class_id, method_id }) => {
            if code != c::CONNECTION_FORCED {
                tracing::warn!(connection = id, %peer, code, %text, "closing connection");
            }
            conn.cleanup();
            outbox.method(0, Method::ConnectionClose(ConnectionClose { reply_code: code, reply_text: text, class_id, method_id }));
            // After connection.close only close-ok (or a crossing close) matters.
            let _ = tokio::time::timeout(CLOSE_OK_TIMEOUT, async {
                loop {
                    match reader.next(conn.frame_max).await {
                        Ok(Frame::Method { method: Method::ConnectionCloseOk(_), .. }) | Err(_) => break,
                        Ok(Frame::Method { method: Method::ConnectionClose(_), .. }) => {
                            outbox.method(0, Method::ConnectionCloseOk(ConnectionCloseOk {}));
                            break;
                        }
                        Ok(_) => continue,
                    }
                }
            })
            .await;
            outbox.push(Outgoing::Close);
        }
        Ended::Error(ConnError::Gone) => {
            conn.cleanup();
            outbox.push(Outgoing::Close);
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), writer).await;
    tracing::info!(connection = id, %peer, "connection closed");
}

enum Ended {
    ClientClosed,
    Error(ConnError),
}

struct Connection {
    shared: ConnectionShared,
    channels: HashMap<u16, ChannelHandler>,
    frame_max: u32,
    channel_max: u16,
    heartbeat: u16,
    /// The client announced the `connection.blocked` capability.
    connection_blocked: bool,
    /// This connection has published: alarms block it.
    publisher: bool,
    alarms: watch::Receiver<crate::alarms::AlarmState>,
    /// The message store: while it is behind (the disk is slower than the publishers), publishers that
    /// write to it are not read.
    store: warren_store::Store,
    /// This connection in the registry (its open channels are listed there).
    info: Arc<registry::ConnectionInfo>,
}

impl Connection {
    /// While a resource alarm is raised, a connection that publishes is not read (TCP back-pressure
    /// then stops the client), as RabbitMQ does; it is told with connection.blocked/unblocked.
    /// Returns whether it waited.
    async fn wait_while_blocked(&mut self, shutdown: &mut watch::Receiver<bool>) -> Result<bool, ConnError> {
        let state = *self.alarms.borrow();
        if !self.publisher || !state.blocks_publishers() {
            return Ok(false);
        }
        let reason = state.reason();
        tracing::info!(connection = self.shared.id, reason, "connection blocked by a resource alarm");
        if self.connection_blocked {
            self.shared.outbox.method(0, Method::ConnectionBlocked(ConnectionBlocked { reason: reason.to_string() }));
        }
        loop {
            if !self.alarms.borrow_and_update().blocks_publishers() {
                break;
            }
            tokio::select! {
                changed = self.alarms.changed() => if changed.is_err() { break },
                _ = shutdown.changed() => return Err(forced()),
            }
        }
        tracing::info!(connection = self.shared.id, "connection unblocked");
        if self.connection_blocked {
            self.shared.outbox.method(0, Method::ConnectionUnblocked(ConnectionUnblocked {}));
        }
        Ok(true)
    }

    /// Answers a basic.get that had to wait (for the disk), waiting as long as its queue asks.
    /// Ok(true) if it waited.
    async fn finish_waiting_get(&mut self, shutdown: &mut watch::Receiver<bool>) -> Result<bool, ConnError> {
        let mut waited = false;
        loop {
            let Some(waiting) = self.shared.waiting_get.lock().take() else { return Ok(waited) };
            waited = true;
            tokio::select! {
                _ = waiting.queue.wait_for(waiting.wait) => {}
                _ = shutdown.changed() => return Err(forced()),
            }
            if let Some(ch) = self.channels.get_mut(&waiting.channel) {
                ch.get(waiting.queue, waiting.no_ack, &self.shared);
            }
        }
    }

    async fn run(&mut self, reader: &mut FrameReader, shutdown: &mut watch::Receiver<bool>) -> Ended {
        // RabbitMQ drops a peer after two missed heartbeats.
        let read_timeout = (self.heartbeat > 0).then(|| Duration::from_secs(self.heartbeat as u64 * 2));
        // Reset whenever the socket gives data; other wake-ups (the ack-timeout check) must not reset it.
        let fresh_deadline = || read_timeout.map(|t| tokio::time::Instant::now() + t);
        let mut read_deadline = fresh_deadline();
        let mut ack_check = ack_timeout_checks(self.shared.consumer_timeout_ms);
        loop {
            // Frames are left in the buffer while something is awaited below; handled before reading more.
            let mut paused = false;
            loop {
                match reader.try_next(self.frame_max) {
                    Ok(Some(frame)) => {
                        let get = matches!(&frame, Frame::Method { method: Method::BasicGet(_), .. });
                        match self.handle_frame(frame) {
                            Ok(true) => {}
                            Ok(false) => return Ended::ClientClosed,
                            Err(e) => return Ended::Error(e),
                        }
                        if (get && self.shared.waiting_get.lock().is_some()) || self.shared.store_behind.load(Ordering::Relaxed) {
                            paused = true;
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => return Ended::Error(e),
                }
            }
            if *shutdown.borrow() {
                return Ended::Error(forced());
            }
            // Not reading while we wait for the disk is our doing, not a missed heartbeat.
            match self.finish_waiting_get(shutdown).await {
                Err(e) => return Ended::Error(e),
                Ok(true) => read_deadline = fresh_deadline(),
                Ok(false) => {}
            }
            // The store is behind (a slow or full disk): publishers to it wait until its writer took the
            // pending buffer, so memory stays bounded by TCP back-pressure; no thread blocks.
            if self.shared.store_behind.swap(false, Ordering::Relaxed) {
                tokio::select! {
                    _ = self.store.caught_up() => {}
                    _ = shutdown.changed() => return Ended::Error(forced()),
                }
                read_deadline = fresh_deadline();
            }
            if paused {
                continue;
            }
            match self.wait_while_blocked(shutdown).await {
                Err(e) => return Ended::Error(e),
                // Not reading was our doing, not a missed heartbeat.
                Ok(true) => read_deadline = fresh_deadline(),
                Ok(false) => {}
            }
            // TCP back-pressure: while too much waits for the socket (a client that does not read what
            // its publishes cause, such as basic.return), read nothing more from it.
            let outbox = self.shared.outbox.clone();
            if outbox.congested() {
                tokio::select! {
                    _ = outbox.until_uncongested() => {}
                    _ = shutdown.changed() => return Ended::Error(forced()),
                }
            }
            if outbox.writer_stopped() {
                return Ended::Error(ConnError::Gone);
            }
            // Credit flow: a queue whose consumers cannot keep up with their sockets slows its publishers
            // (a bounded wait, again while it lasts) instead of buffering without bound.
            let slow = self.shared.slowed_by.lock().take();
            if let Some(queue) = slow {
                tokio::select! {
                    _ = queue.wait_until_drained(FLOW_WAIT) => {}
                    _ = shutdown.changed() => return Ended::Error(forced()),
                }
                read_deadline = fresh_deadline();
            }
            // A publisher waiting for input is also woken by an alarm, to be blocked at once.
            let mut alarms = self.alarms.clone();
            let publisher = self.publisher;
            let fill = async {
                match read_deadline {
                    Some(deadline) => match tokio::time::timeout_at(deadline, reader.fill()).await {
                        Ok(r) => r,
                        Err(_) => {
                            tracing::warn!(connection = self.shared.id, "missed heartbeats from client, timeout: {}s", self.heartbeat);
                            Err(ConnError::Gone)
                        }
                    },
                    None => reader.fill().await,
                }
            };
            tokio::select! {
                r = fill => match r {
                    Err(e) => return Ended::Error(e),
                    Ok(_) => read_deadline = fresh_deadline(),
                },
                _ = shutdown.changed() => return Ended::Error(forced()),
                _ = alarms.changed(), if publisher => {}
                _ = ack_check.tick() => self.check_ack_timeouts(),
                _ = outbox.until_commit_failed() => self.fail_commits(),
                _ = outbox.until_writer_stopped() => return Ended::Error(ConnError::Gone),
            }
        }
    }

    /// Closes the channels whose tx.commit the writer found failed (`Outbox::fail_commit`).
    fn fail_commits(&mut self) {
        for (number, text) in self.shared.outbox.take_failed_commits() {
            if let Some(ch) = self.channels.get_mut(&number) {
                ch.commit_failed(text, &self.shared);
            }
        }
    }

    /// Closes the channels holding a delivery unacknowledged for longer than the timeout.
    fn check_ack_timeouts(&mut self) {
        let now = warren_broker::now_ms();
        for ch in self.channels.values_mut() {
            ch.check_ack_timeout(now, &self.shared);
        }
    }

    /// Handles one frame. Ok(false) when the client closed the connection.
    fn handle_frame(&mut self, frame: Frame) -> Result<bool, ConnError> {
        match frame {
            Frame::Heartbeat { channel: 0 } => Ok(true),
            Frame::Heartbeat { channel } => Err(ConnError::new(
                c::FRAME_ERROR,
                format!("FRAME_ERROR - heartbeat frame on channel {channel} (heartbeats belong on channel 0)"),
                0,
                0,
            )),
            Frame::Method { channel: 0, method } => self.handle_connection_method(method),
            Frame::Method { channel, method } => {
                if matches!(method, Method::BasicPublish(_)) {
                    self.publisher = true;
                }
                self.handle_channel_method(channel, method)?;
                Ok(true)
            }
            Frame::Header { channel: 0, .. } | Frame::Body { channel: 0, .. } => Err(ConnError::new(
                c::UNEXPECTED_FRAME,
                "UNEXPECTED_FRAME - content frame on channel 0 (content belongs to a basic.publish on a channel)",
                0,
                0,
            )),
            Frame::Header { channel, header } => {
                let ch = open_channel(&mut self.channels, channel, "content header")?;
                ch.handle_header(header, &self.shared)?;
                Ok(true)
            }
            Frame::Body { channel, payload } => {
                let ch = open_channel(&mut self.channels, channel, "content body")?;
                ch.handle_body(payload, &self.shared)?;
                Ok(true)
            }
        }
    }

    fn handle_connection_method(&mut self, method: Method) -> Result<bool, ConnError> {
        match method {
            Method::ConnectionClose(_) => Ok(false),
            Method::ConnectionCloseOk(_) => Ok(true),
            Method::ConnectionBlocked(_) | Method::ConnectionUnblocked(_) => Ok(true),
            Method::ConnectionUpdateSecret(_) => {
                self.shared.outbox.method(0, Method::ConnectionUpdateSecretOk(ConnectionUpdateSecretOk {}));
                Ok(true)
            }
            other => Err(ConnError::new(
                c::COMMAND_INVALID,
                format!("COMMAND_INVALID - {} is not allowed on channel 0", other.name()),
                other.class_id(),
                other.method_id(),
            )),
        }
    }

    fn handle_channel_method(&mut self, channel: u16, method: Method) -> Result<(), ConnError> {
        if method.class_id() == c::CLASS_CONNECTION {
            return Err(ConnError::new(
                c::COMMAND_INVALID,
                format!("COMMAND_INVALID - {} must be sent on channel 0, not channel {channel}", method.name()),
                method.class_id(),
                method.method_id(),
            ));
        }
        if let Method::ChannelOpen(_) = method {
            if channel > self.channel_max {
                return Err(ConnError::new(
                    c::NOT_ALLOWED,
                    format!("NOT_ALLOWED - channel id {channel} exceeds the negotiated channel_max {}", self.channel_max),
                    c::CLASS_CHANNEL,
                    10,
                ));
            }
            if self.channels.contains_key(&channel) {
                return Err(ConnError::new(
                    c::CHANNEL_ERROR,
                    format!("CHANNEL_ERROR - second 'channel.open' seen on channel {channel}"),
                    c::CLASS_CHANNEL,
                    10,
                ));
            }
            self.channels.insert(channel, ChannelHandler::new(channel, &self.shared));
            self.info.channels.lock().insert(channel);
            self.shared.outbox.method(channel, Method::ChannelOpenOk(ChannelOpenOk { reserved_1: Default::default() }));
            return Ok(());
        }
        let ch = match self.channels.get_mut(&channel) {
            Some(ch) => ch,
            None => {
                return Err(ConnError::new(
                    c::CHANNEL_ERROR,
                    format!("CHANNEL_ERROR - expected 'channel.open' on channel {channel}, got {}", method.name()),
                    method.class_id(),
                    method.method_id(),
                ))
            }
        };
        if ch.handle_method(method, &self.shared)? {
            // The channel finished closing.
            self.channels.remove(&channel);
            self.info.channels.lock().remove(&channel);
        }
        Ok(())
    }

    fn cleanup(&mut self) {
        for (_, ch) in self.channels.drain() {
            ch.release();
        }
        self.shared.vhost.connection_closed(self.shared.id);
    }
}

fn open_channel<'a>(
    channels: &'a mut HashMap<u16, ChannelHandler>,
    channel: u16,
    what: &str,
) -> Result<&'a mut ChannelHandler, ConnError> {
    channels.get_mut(&channel).ok_or_else(|| {
        ConnError::new(
            c::CHANNEL_ERROR,
            format!("CHANNEL_ERROR - {what} on channel {channel}, which is not open (expected 'channel.open')"),
            0,
            0,
        )
    })
}

/// How often a connection checks its channels for deliveries unacknowledged past the timeout: a tenth of
/// the timeout, between 100 ms and 10 s (10 s when the node's timeout is off: queues may set their own).
fn ack_timeout_checks(timeout_ms: u64) -> tokio::time::Interval {
    let period = Duration::from_millis(if timeout_ms == 0 { 10_000 } else { (timeout_ms / 10).clamp(100, 10_000) });
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval
}

fn forced() -> ConnError {
    ConnError::new(c::CONNECTION_FORCED, "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'", 0, 0)
}
