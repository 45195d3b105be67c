//! TCP between the nodes of a cluster (`--cluster-addr`).
//!
//! Each pair of nodes keeps two connections, both dialed by the node with the lower id: a
//! **control** link (votes, heartbeats, the failure detector's pings) and a **bulk** link (log
//! replication, snapshots, forwarded client commands), so heartbeats never queue behind data. Each
//! connection is symmetric: both sides send requests on it and answer the other's, multiplexed by
//! request id; every Raft group of the node shares them (a request names its group).
//!
//! Every connection starts with [`handshake`] (ids checked, the cluster secret proven both ways),
//! which also gives it its keys: every later frame is sealed ([`seal`]: encrypted and
//! authenticated, in order), so a relay of the handshake cannot inject, alter or replay a frame.
//! A frame that fails its tag, a frame over [`frame::MAX_FRAME`], a malformed frame, a peer silent for [`IDLE_TIMEOUT`]
//! (links send a keepalive every second) or one that stalls mid-frame or stops reading closes that
//! connection only; the dialer reconnects with backoff (100 ms doubling to 2 s). `warren ctl`
//! connects the same way with link kind `Ctl`.

pub mod frame;
pub mod handshake;
pub mod raft;
pub mod seal;
pub mod wire;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use parking_lot::{Mutex, RwLock};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};

pub use frame::Rpc;
use frame::{Frame, FrameError, RequestFrame, MAX_FRAME};
pub use handshake::LinkKind;

use crate::handshake_slots::{HandshakeSlots, NoSlot};
use crate::types::{GroupId, NodeId};

/// A connection with nothing received for this long is dead.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest a frame may take to arrive once started, or a write to make progress.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(10);
/// A link with nothing to send sends a keepalive this often.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(1);
/// Requests from one connection being handled at once; past it the connection is not read.
pub const MAX_INFLIGHT_PER_CONNECTION: usize = 1024;
/// Frames queued for one connection's writer; senders wait past it.
pub const WRITE_QUEUE: usize = 4096;
/// A connection's read buffer.
const READ_BUFFER: usize = 64 << 10;
/// A connection's write buffer (frames are sealed into it), kept between writes up to 4 times this.
const OUT_BUFFER: usize = 64 << 10;
/// Connections still in their handshake; more are closed at once (`handshake_slots`).
pub const MAX_HANDSHAKES: usize = 64;
/// Of those, from one address: a peer dials two links, a node on the same host as others (tests,
/// one machine) a few more, `warren ctl` one a call. Past it a connection waits for its
/// address's next slot, up to the handshake timeout.
pub const HANDSHAKES_PER_SOURCE: usize = 16;
/// Refused handshakes are logged at most this often (with how many there were).
const REFUSED_LOG_EVERY: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// What a node does with the requests it receives (Ping is answered by the transport).
pub trait Handler: Send + Sync + 'static {
    /// `from` is the calling node, 0 for `warren ctl`.
    fn handle(&self, from: NodeId, rpc: Rpc, group: GroupId, payload: Bytes) -> BoxFuture<Result<Bytes, String>>;
}

/// Why a request got no answer.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum RpcError {
    /// No connection to the peer: the request was not sent.
    #[error("node {0} is not connected")]
    NotConnected(NodeId),
    /// The connection closed after the request was sent: it may or may not have been handled.
    #[error("connection to node {0} lost")]
    Lost(NodeId),
    #[error("no answer from node {0} within {1:?}")]
    Timeout(NodeId, Duration),
    /// The peer handled the request and returned an error.
    #[error("node {0}: {1}")]
    Remote(NodeId, String),
    #[error("request of {0} bytes is over the frame limit")]
    TooLarge(usize),
}

/// Settings of a node's transport.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    pub node_id: NodeId,
    /// Where to listen (`--cluster-addr`).
    pub listen: SocketAddr,
    /// The other nodes: id → cluster address (HOST:PORT). This node's own entry is ignored.
    pub peers: Vec<(NodeId, String)>,
    pub secret: Vec<u8>,
    /// This node's AMQP address, told to peers for `cluster-status`.
    pub amqp_addr: String,
}

/// One live connection.
struct Conn {
    tx: mpsc::Sender<Bytes>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Result<Bytes, String>>>>,
    next_id: AtomicU64,
    close: watch::Sender<bool>,
}

impl Conn {
    fn close(&self) {
        let _ = self.close.send(true);
    }
}

struct Peer {
    id: NodeId,
    addr: Mutex<String>,
    amqp_addr: Mutex<String>,
    control: Mutex<Option<Arc<Conn>>>,
    bulk: Mutex<Option<Arc<Conn>>>,
    /// Woken when a control connection to the peer ends (a killed process's socket closes at
    /// once): the failure detector pings it then instead of at its next tick.
    control_closed: tokio::sync::Notify,
}

impl Peer {
    fn slot(&self, kind: LinkKind) -> &Mutex<Option<Arc<Conn>>> {
        match kind {
            LinkKind::Control => &self.control,
            _ => &self.bulk,
        }
    }
}

struct Inner {
    me: NodeId,
    secret: Vec<u8>,
    amqp_addr: String,
    local_addr: SocketAddr,
    peers: RwLock<HashMap<NodeId, Arc<Peer>>>,
    handler: RwLock<Option<Arc<dyn Handler>>>,
    shutdown: watch::Sender<bool>,
}

/// The node's end of the cluster network. Cheap to clone.
#[derive(Clone)]
pub struct Transport {
    inner: Arc<Inner>,
}

impl Transport {
    /// Binds the cluster port and starts dialing the peers with higher ids. Requests that arrive
    /// before [`Transport::set_handler`] are answered with an error.
    pub async fn start(config: TransportConfig) -> std::io::Result<Transport> {
        let listener = TcpListener::bind(config.listen).await?;
        let local_addr = listener.local_addr()?;
        let (shutdown, _) = watch::channel(false);
        let inner = Arc::new(Inner {
            me: config.node_id,
            secret: config.secret,
            amqp_addr: config.amqp_addr,
            local_addr,
            peers: RwLock::new(HashMap::new()),
            handler: RwLock::new(None),
            shutdown,
        });
        let transport = Transport { inner };
        for (id, addr) in config.peers {
            transport.add_peer(id, &addr);
        }
        tokio::spawn(accept_loop(transport.inner.clone(), listener));
        Ok(transport)
    }

    pub fn set_handler(&self, handler: Arc<dyn Handler>) {
        *self.inner.handler.write() = Some(handler);
    }

    pub fn node_id(&self) -> NodeId {
        self.inner.me
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// Adds (or re-addresses) a peer; dials it if its id is higher than this node's.
    pub fn add_peer(&self, id: NodeId, addr: &str) {
        if id == self.inner.me {
            return;
        }
        let mut peers = self.inner.peers.write();
        if let Some(p) = peers.get(&id) {
            *p.addr.lock() = addr.to_owned();
            return;
        }
        let peer = Arc::new(Peer {
            id,
            addr: Mutex::new(addr.to_owned()),
            amqp_addr: Mutex::new(String::new()),
            control: Mutex::new(None),
            bulk: Mutex::new(None),
            control_closed: tokio::sync::Notify::new(),
        });
        peers.insert(id, peer.clone());
        if id > self.inner.me {
            for kind in [LinkKind::Control, LinkKind::Bulk] {
                tokio::spawn(dial_loop(self.inner.clone(), peer.clone(), kind));
            }
        }
    }

    /// The peers' ids.
    pub fn peers(&self) -> Vec<NodeId> {
        let mut ids: Vec<NodeId> = self.inner.peers.read().keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// A peer's cluster address and the AMQP address it announced.
    pub fn peer_addrs(&self, id: NodeId) -> Option<(String, String)> {
        let peers = self.inner.peers.read();
        let p = peers.get(&id)?;
        let addrs = (p.addr.lock().clone(), p.amqp_addr.lock().clone());
        Some(addrs)
    }

    /// Whether a link to the peer is up now.
    /// Returns when a control connection to `peer` ends (at once if one ended since the last call).
    pub async fn control_link_closed(&self, peer: NodeId) {
        let p = self.inner.peers.read().get(&peer).cloned();
        match p {
            Some(p) => p.control_closed.notified().await,
            None => std::future::pending().await,
        }
    }

    pub fn connected(&self, peer: NodeId, kind: LinkKind) -> bool {
        let p = self.inner.peers.read().get(&peer).cloned();
        p.is_some_and(|p| p.slot(kind).lock().is_some())
    }

    /// Sends a request to a peer and waits for its answer.
    pub async fn request(
        &self,
        peer: NodeId,
        kind: LinkKind,
        rpc: Rpc,
        group: GroupId,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Bytes, RpcError> {
        let mut frame = RequestFrame::new(rpc, group, payload.len());
        frame.payload().extend_from_slice(payload);
        self.request_frame(peer, kind, frame, timeout).await
    }

    /// Sends a request whose payload the caller encoded into `frame`, and waits for its answer.
    pub async fn request_frame(&self, peer: NodeId, kind: LinkKind, frame: RequestFrame, timeout: Duration) -> Result<Bytes, RpcError> {
        let conn = {
            let p = self.inner.peers.read().get(&peer).cloned();
            p.and_then(|p| p.slot(kind).lock().clone()).ok_or(RpcError::NotConnected(peer))?
        };
        call(&conn, peer, frame, timeout).await
    }

    /// Closes the listener, every connection, and stops dialing.
    pub fn shutdown(&self) {
        let _ = self.inner.shutdown.send(true);
        for p in self.inner.peers.read().values() {
            for kind in [LinkKind::Control, LinkKind::Bulk] {
                if let Some(c) = p.slot(kind).lock().take() {
                    c.close();
                }
            }
        }
    }
}

async fn call(conn: &Conn, peer: NodeId, frame: RequestFrame, timeout: Duration) -> Result<Bytes, RpcError> {
    if frame.payload_len() + 18 > MAX_FRAME {
        return Err(RpcError::TooLarge(frame.payload_len()));
    }
    let id = conn.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = oneshot::channel();
    conn.pending.lock().insert(id, tx);
    let frame = frame.seal(id);
    let outcome = tokio::time::timeout(timeout, async {
        if conn.tx.send(frame).await.is_err() {
            return Err(RpcError::NotConnected(peer));
        }
        match rx.await {
            Ok(Ok(b)) => Ok(b),
            Ok(Err(e)) => Err(RpcError::Remote(peer, e)),
            Err(_) => Err(RpcError::Lost(peer)),
        }
    })
    .await;
    match outcome {
        Ok(r) => r,
        Err(_) => {
            conn.pending.lock().remove(&id);
            Err(RpcError::Timeout(peer, timeout))
        }
    }
}

/// Connects `warren ctl` to a node, sends one request and returns the answer.
pub async fn ctl_request(addr: &str, secret: &[u8], rpc: Rpc, group: GroupId, payload: &[u8], timeout: Duration) -> Result<Bytes, String> {
    let fut = async {
        let mut stream = TcpStream::connect(addr).await.map_err(|e| format!("cannot connect to {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (_, keys) = handshake::dial(&mut stream, secret, LinkKind::Ctl, 0, 0, "").await.map_err(|e| format!("{addr}: {e}"))?;
        let (mut sealer, mut opener) = (keys.sealer, keys.opener);
        let (mut rd, mut wr) = stream.into_split();
        let mut out = BytesMut::new();
        sealer.seal(&frame::request(1, rpc, group, payload), &mut out).map_err(|e| e.to_string())?;
        wr.write_all(&out).await.map_err(|e| e.to_string())?;
        // Keepalives while the answer takes its time (adding a node waits for it to catch up): the
        // node closes a link silent for `IDLE_TIMEOUT`.
        let keepalives = async move {
            loop {
                tokio::time::sleep(KEEPALIVE_EVERY).await;
                let mut out = BytesMut::new();
                if let Err(e) = sealer.seal(&frame::keepalive(), &mut out) {
                    return e.to_string();
                }
                if let Err(e) = wr.write_all(&out).await {
                    return e.to_string();
                }
            }
        };
        tokio::pin!(keepalives);
        loop {
            let body = tokio::select! {
                body = frame::read_body_mut(&mut rd, MAX_FRAME + seal::TAG_LEN, timeout, STALL_TIMEOUT) => body.map_err(|e| e.to_string())?,
                e = &mut keepalives => return Err(format!("{addr}: {e}")),
            };
            let body = opener.open(body).map_err(|e| format!("{addr}: {e}"))?.freeze();
            match frame::parse(body).map_err(|e| e.to_string())? {
                Frame::Response { id: 1, result } => return result,
                _ => continue,
            }
        }
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| format!("no answer from {addr} within {timeout:?}"))?
}

async fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    let slots = Arc::new(HandshakeSlots::new(MAX_HANDSHAKES, HANDSHAKES_PER_SOURCE));
    let (mut refused, mut refused_logged) = (0u64, None::<tokio::time::Instant>);
    let mut shutdown = inner.shutdown.subscribe();
    loop {
        let (stream, from) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "cluster accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stopped(&mut shutdown) => return,
        };
        // A slot now, or a place among those waiting for one of this address's slots.
        let deadline = tokio::time::Instant::now() + handshake::HANDSHAKE_TIMEOUT;
        let slot = match slots.take(from.ip()) {
            Ok(slot) => Ok(slot),
            Err(NoSlot::Source(_)) => match slots.wait_place() {
                Ok(place) => Err(place),
                Err(why) => {
                    note_refused(&mut refused, &mut refused_logged, from, why);
                    continue;
                }
            },
            Err(why) => {
                note_refused(&mut refused, &mut refused_logged, from, why);
                continue;
            }
        };
        let (inner, slots) = (inner.clone(), slots.clone());
        tokio::spawn(async move {
            let permit = match slot {
                Ok(slot) => slot,
                Err(place) => match slots.wait_for(from.ip(), deadline, place).await {
                    Some(slot) => slot,
                    None => {
                        tracing::warn!(%from, "cluster connection closed: {HANDSHAKES_PER_SOURCE} connections from its address stayed in their handshake");
                        return;
                    }
                },
            };
            let mut stream = stream;
            let _ = stream.set_nodelay(true);
            let me = inner.me;
            let known = |id: NodeId| inner.peers.read().contains_key(&id);
            let result = handshake::accept(&mut stream, &inner.secret, me, &inner.amqp_addr, |kind, node| match kind {
                LinkKind::Ctl if node == 0 => Ok(()),
                LinkKind::Ctl => Err("a ctl connection has no node id".into()),
                _ if node == me || node == 0 => Err(format!("node id {node} is not a peer's")),
                _ if node > me => Err(format!("node {node} has the higher id: node {me} dials it, not the reverse")),
                _ => Ok(()),
            })
            .await;
            drop(permit);
            let (dialer, keys) = match result {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(%from, error = %e, "cluster connection refused");
                    return;
                }
            };
            if dialer.kind == LinkKind::Ctl {
                run_conn(inner, stream, keys, None, LinkKind::Ctl).await;
                return;
            }
            if !known(dialer.node) {
                // A node added to the cluster after this one started: it dials us, so no address is needed.
                Transport { inner: inner.clone() }.add_peer(dialer.node, "");
            }
            let Some(peer) = inner.peers.read().get(&dialer.node).cloned() else { return };
            *peer.amqp_addr.lock() = dialer.amqp_addr;
            tracing::debug!(peer = peer.id, kind = ?dialer.kind, %from, "cluster link accepted");
            run_conn(inner, stream, keys, Some(peer), dialer.kind).await;
        });
    }
}

/// Logs a connection closed for want of a handshake slot, at most every [`REFUSED_LOG_EVERY`].
fn note_refused(refused: &mut u64, logged: &mut Option<tokio::time::Instant>, from: SocketAddr, why: NoSlot) {
    *refused += 1;
    if logged.is_some_and(|t| t.elapsed() < REFUSED_LOG_EVERY) {
        return;
    }
    let why = match why {
        NoSlot::All(n) => format!("{n} cluster connections are in their handshake"),
        NoSlot::Source(n) | NoSlot::Waiting(n) => format!("{n} cluster connections wait for a handshake slot of their address"),
    };
    tracing::warn!(%from, refused = *refused, "cluster connection closed at once: {why}");
    *logged = Some(tokio::time::Instant::now());
    *refused = 0;
}

async fn dial_loop(inner: Arc<Inner>, peer: Arc<Peer>, kind: LinkKind) {
    let mut shutdown = inner.shutdown.subscribe();
    let mut backoff = BACKOFF_MIN;
    let mut logged_down = false;
    loop {
        if *shutdown.borrow() {
            return;
        }
        let addr = peer.addr.lock().clone();
        let attempt = async {
            let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&addr))
                .await
                .map_err(|_| "connect timed out".to_owned())?
                .map_err(|e| e.to_string())?;
            let _ = stream.set_nodelay(true);
            let (amqp, keys) = handshake::dial(&mut stream, &inner.secret, kind, inner.me, peer.id, &inner.amqp_addr)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((stream, amqp, keys))
        };
        let result = tokio::select! {
            r = attempt => r,
            _ = stopped(&mut shutdown) => return,
        };
        match result {
            Ok((stream, amqp, keys)) => {
                *peer.amqp_addr.lock() = amqp;
                if logged_down || kind == LinkKind::Control {
                    tracing::info!(peer = peer.id, %addr, ?kind, "cluster link up");
                }
                logged_down = false;
                backoff = BACKOFF_MIN;
                run_conn(inner.clone(), stream, keys, Some(peer.clone()), kind).await;
                if kind == LinkKind::Control {
                    tracing::info!(peer = peer.id, "cluster link down");
                }
            }
            Err(e) => {
                if !logged_down {
                    tracing::warn!(peer = peer.id, %addr, ?kind, error = %e, "cannot reach cluster peer; retrying with backoff");
                    logged_down = true;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stopped(&mut shutdown) => return,
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Serves one authenticated connection until it closes. A peer connection replaces any older one
/// of the same kind (the peer restarted or redialed).
async fn run_conn(inner: Arc<Inner>, stream: TcpStream, keys: seal::Keys, peer: Option<Arc<Peer>>, kind: LinkKind) {
    let seal::Keys { sealer, mut opener } = keys;
    let (rd, wr) = stream.into_split();
    // Buffered: a frame's length and a small frame come in one system call, not two.
    let mut rd = tokio::io::BufReader::with_capacity(READ_BUFFER, rd);
    let (tx, rx) = mpsc::channel(WRITE_QUEUE);
    let (close, closed) = watch::channel(false);
    let conn = Arc::new(Conn { tx, pending: Mutex::new(HashMap::new()), next_id: AtomicU64::new(1), close });
    if let Some(p) = &peer {
        if let Some(old) = p.slot(kind).lock().replace(conn.clone()) {
            old.close();
        }
    }
    let mut writer = tokio::spawn(write_loop(wr, sealer, rx, closed.clone()));
    let from = peer.as_ref().map_or(0, |p| p.id);
    let inflight = Arc::new(Semaphore::new(MAX_INFLIGHT_PER_CONNECTION));
    let mut closed_rx = closed;
    let mut shutdown = inner.shutdown.subscribe();
    let reason: FrameError = loop {
        let body = tokio::select! {
            b = frame::read_body_mut(&mut rd, MAX_FRAME + seal::TAG_LEN, IDLE_TIMEOUT, STALL_TIMEOUT) => b,
            _ = stopped(&mut closed_rx) => break FrameError::Closed,
            _ = stopped(&mut shutdown) => break FrameError::Closed,
            _ = &mut writer => break FrameError::WriteFailed,
        };
        let frame = match body.and_then(|b| opener.open(b)).and_then(|b| frame::parse(b.freeze())) {
            Ok(f) => f,
            Err(e) => break e,
        };
        match frame {
            Frame::KeepAlive => {}
            Frame::Response { id, result } => {
                if let Some(waiter) = conn.pending.lock().remove(&id) {
                    let _ = waiter.send(result);
                }
            }
            Frame::Request { id, rpc: Rpc::Ping, .. } => {
                let _ = conn.tx.try_send(frame::response(id, &Ok(Bytes::new())));
            }
            Frame::Request { id, rpc, group, payload } => {
                let permit = tokio::select! {
                    p = inflight.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break FrameError::Closed },
                    _ = stopped(&mut closed_rx) => break FrameError::Closed,
                };
                let handler = inner.handler.read().clone();
                let reply_to = conn.tx.clone();
                tokio::spawn(async move {
                    let result = match handler {
                        Some(h) => h.handle(from, rpc, group, payload).await,
                        None => Err("the node is starting".to_owned()),
                    };
                    let result = match result {
                        Ok(b) if b.len() + 10 > MAX_FRAME => Err(format!("answer of {} bytes is over the frame limit", b.len())),
                        r => r,
                    };
                    let _ = reply_to.send(frame::response(id, &result)).await;
                    drop(permit);
                });
            }
        }
    };
    match &reason {
        FrameError::Closed => tracing::debug!(peer = from, ?kind, "cluster connection closed"),
        e => tracing::warn!(peer = from, ?kind, error = %e, "cluster connection dropped"),
    }
    conn.close();
    writer.abort();
    if let Some(p) = &peer {
        let was_current = {
            let mut slot = p.slot(kind).lock();
            let current = slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn));
            if current {
                *slot = None;
            }
            current
        };
        if was_current && kind == LinkKind::Control {
            p.control_closed.notify_one();
        }
    }
    // Waiters see their sender dropped: `RpcError::Lost`.
    conn.pending.lock().clear();
}

/// Seals queued frames and writes them, many per system call, and a keepalive when idle. A write
/// that makes no progress for [`STALL_TIMEOUT`] (the peer stopped reading) closes the connection.
/// Frames are sealed here, in the order they are written: the nonce is the frame's place in it.
async fn write_loop(mut wr: tokio::net::tcp::OwnedWriteHalf, mut sealer: seal::Sealer, mut rx: mpsc::Receiver<Bytes>, mut closed: watch::Receiver<bool>) {
    let mut out = BytesMut::with_capacity(OUT_BUFFER);
    loop {
        let first = tokio::select! {
            f = tokio::time::timeout(KEEPALIVE_EVERY, rx.recv()) => match f {
                Ok(Some(f)) => f,
                Ok(None) => return,
                Err(_) => frame::keepalive(),
            },
            _ = stopped(&mut closed) => return,
        };
        let mut next = Some(first);
        while let Some(f) = next {
            if let Err(e) = sealer.seal(&f, &mut out) {
                tracing::error!(error = %e, "cannot seal a cluster frame; closing the connection");
                return;
            }
            next = if out.len() < (256 << 10) { rx.try_recv().ok() } else { None };
        }
        match tokio::time::timeout(STALL_TIMEOUT, wr.write_all(&out)).await {
            Ok(Ok(())) => {}
            _ => return,
        }
        out.clear();
        // A snapshot chunk grew it: give the memory back rather than keep it per connection.
        if out.capacity() > 4 * OUT_BUFFER {
            out = BytesMut::with_capacity(OUT_BUFFER);
        }
    }
}

/// Completes once the flag is set (or its sender is gone).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}
