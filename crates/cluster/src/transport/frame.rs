//! Frames on a cluster connection: a `u32` little-endian length, then the body. Requests and
//! responses are multiplexed by request id; a request names its group and its RPC.
//!
//! ```text
//! request:   len | 1 | request id u64 | rpc u8 | group u64 | payload
//! response:  len | 2 | request id u64 | status u8 (0 ok, 1 error: payload is UTF-8 text) | payload
//! keepalive: len | 3
//! ```

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::types::GroupId;

/// The largest frame body accepted (and sent): a snapshot or a batch of entries must fit.
pub const MAX_FRAME: usize = 64 << 20;

/// The RPCs nodes (and `warren ctl`) send each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Rpc {
    AppendEntries = 1,
    Vote = 2,
    PreVote = 3,
    Snapshot = 4,
    TransferLeader = 5,
    /// A client command for a group's leader (forwarding).
    Propose = 6,
    /// The failure detector's probe.
    Ping = 7,
    /// `warren ctl cluster-status`.
    Status = 8,
    /// `warren ctl add-node`, `remove-node`, `transfer-leader`: node-wide membership operations.
    Admin = 9,
    /// A replica that installed a snapshot asks a peer for the stored bodies of its live messages
    /// (quorum queues: snapshots carry no bodies). Opaque bytes to the cluster; served by the
    /// node's body source (`ClusterNode::set_body_source`).
    Bodies = 10,
    /// Requests about classic queues (`warren_broker::queue::remote::wire`): opaque bytes to the
    /// cluster, served by the node's classic service (`ClusterNode::set_classic_service`).
    Classic = 11,
    /// One piece of a snapshot larger than [`SNAPSHOT_CHUNK`](super::raft::SNAPSHOT_CHUNK), in order;
    /// the last one installs it (see `transport::raft::SnapshotChunk`).
    SnapshotChunk = 12,
    /// A read barrier for a group's leader (forwarding): it confirms its leadership with a quorum
    /// and answers the index a linearizable read must wait to have applied (`ClusterNode::linearize`).
    ReadIndex = 13,
}

impl Rpc {
    pub fn from_u8(v: u8) -> Option<Rpc> {
        Some(match v {
            1 => Rpc::AppendEntries,
            2 => Rpc::Vote,
            3 => Rpc::PreVote,
            4 => Rpc::Snapshot,
            5 => Rpc::TransferLeader,
            6 => Rpc::Propose,
            7 => Rpc::Ping,
            8 => Rpc::Status,
            9 => Rpc::Admin,
            10 => Rpc::Bodies,
            11 => Rpc::Classic,
            13 => Rpc::ReadIndex,
            12 => Rpc::SnapshotChunk,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug)]
pub enum Frame {
    Request { id: u64, rpc: Rpc, group: GroupId, payload: Bytes },
    Response { id: u64, result: Result<Bytes, String> },
    KeepAlive,
}

const REQUEST: u8 = 1;
const RESPONSE: u8 = 2;
const KEEPALIVE: u8 = 3;

/// Why a connection is dropped.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection closed")]
    Closed,
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes is over the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    #[error("malformed frame: {0}")]
    Malformed(&'static str),
    #[error("peer silent for {0:?}")]
    Silent(Duration),
    #[error("a write failed or made no progress (the peer stopped reading)")]
    WriteFailed,
}

/// The bytes of a request frame before its payload: length, kind, id, rpc, group.
const REQUEST_HEADER: usize = 4 + 18;

/// A request frame whose payload is encoded straight after its header, with no copy of it
/// (a replicated batch of entries is encoded once, into the frame that carries it).
pub struct RequestFrame(BytesMut);

impl RequestFrame {
    /// Starts a frame; `payload_hint` is the payload's expected size (the buffer grows past it).
    pub fn new(rpc: Rpc, group: GroupId, payload_hint: usize) -> RequestFrame {
        let mut b = BytesMut::with_capacity(REQUEST_HEADER + payload_hint);
        b.put_u32_le(0); // the length, set by `seal`
        b.put_u8(REQUEST);
        b.put_u64_le(0); // the request id, set by `seal`
        b.put_u8(rpc as u8);
        b.put_u64_le(group);
        RequestFrame(b)
    }

    /// Where the payload is written.
    pub fn payload(&mut self) -> &mut BytesMut {
        &mut self.0
    }

    pub fn payload_len(&self) -> usize {
        self.0.len() - REQUEST_HEADER
    }

    /// The frame as it is sent, as request `id`.
    pub fn seal(mut self, id: u64) -> Bytes {
        let body_len = (self.0.len() - 4) as u32;
        self.0[0..4].copy_from_slice(&body_len.to_le_bytes());
        self.0[5..13].copy_from_slice(&id.to_le_bytes());
        self.0.freeze()
    }
}

pub fn request(id: u64, rpc: Rpc, group: GroupId, payload: &[u8]) -> Bytes {
    let mut f = RequestFrame::new(rpc, group, payload.len());
    f.payload().put_slice(payload);
    f.seal(id)
}

pub fn response(id: u64, result: &Result<Bytes, String>) -> Bytes {
    let (status, payload): (u8, &[u8]) = match result {
        Ok(b) => (0, b),
        Err(e) => (1, e.as_bytes()),
    };
    let mut b = BytesMut::with_capacity(4 + 10 + payload.len());
    b.put_u32_le((10 + payload.len()) as u32);
    b.put_u8(RESPONSE);
    b.put_u64_le(id);
    b.put_u8(status);
    b.put_slice(payload);
    b.freeze()
}

pub fn keepalive() -> Bytes {
    Bytes::from_static(&[1, 0, 0, 0, KEEPALIVE])
}

/// Reads one frame body of at most `limit` bytes. `idle` bounds the wait for its first byte (a
/// silent peer), `stall` the time the rest of it may take (a peer that stops mid-frame).
pub async fn read_body<R: AsyncRead + Unpin>(
    r: &mut R,
    limit: usize,
    idle: Duration,
    stall: Duration,
) -> Result<Bytes, FrameError> {
    read_body_mut(r, limit, idle, stall).await.map(BytesMut::freeze)
}

/// [`read_body`], the body still mutable (a sealed frame is opened in place).
pub async fn read_body_mut<R: AsyncRead + Unpin>(
    r: &mut R,
    limit: usize,
    idle: Duration,
    stall: Duration,
) -> Result<BytesMut, FrameError> {
    let mut len = [0u8; 4];
    let first = tokio::time::timeout(idle, r.read(&mut len)).await.map_err(|_| FrameError::Silent(idle))??;
    if first == 0 {
        return Err(FrameError::Closed);
    }
    let body = tokio::time::timeout(stall, async {
        if first < 4 {
            r.read_exact(&mut len[first..]).await?;
        }
        let n = u32::from_le_bytes(len) as usize;
        if n > limit {
            return Err(FrameError::TooLarge(n));
        }
        // Read into uninitialized capacity: zeroing the body first cost as much as a copy of it.
        let mut body = BytesMut::with_capacity(n);
        let mut rest = (&mut *r).take(n as u64);
        while body.len() < n {
            if rest.read_buf(&mut body).await? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
        }
        Ok(body)
    })
    .await
    .map_err(|_| FrameError::Silent(stall))??;
    Ok(body)
}

/// Parses a frame body.
pub fn parse(body: Bytes) -> Result<Frame, FrameError> {
    let Some(&kind) = body.first() else { return Err(FrameError::Malformed("empty frame")) };
    let u64_at = |at: usize| -> Result<u64, FrameError> {
        body.get(at..at + 8)
            .map(|s| u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]))
            .ok_or(FrameError::Malformed("short header"))
    };
    match kind {
        REQUEST => {
            let id = u64_at(1)?;
            let rpc = body.get(9).copied().ok_or(FrameError::Malformed("short header"))?;
            let rpc = Rpc::from_u8(rpc).ok_or(FrameError::Malformed("unknown rpc"))?;
            let group = u64_at(10)?;
            Ok(Frame::Request { id, rpc, group, payload: body.slice(18..) })
        }
        RESPONSE => {
            let id = u64_at(1)?;
            let status = body.get(9).copied().ok_or(FrameError::Malformed("short header"))?;
            let payload = body.slice(10..);
            let result = match status {
                0 => Ok(payload),
                1 => Err(String::from_utf8_lossy(&payload).into_owned()),
                _ => return Err(FrameError::Malformed("unknown response status")),
            };
            Ok(Frame::Response { id, result })
        }
        KEEPALIVE if body.len() == 1 => Ok(Frame::KeepAlive),
        _ => Err(FrameError::Malformed("unknown frame kind")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_parse_back() {
        let f = request(7, Rpc::Vote, 42, b"abc");
        match parse(f.slice(4..)).expect("parses") {
            Frame::Request { id, rpc, group, payload } => {
                assert_eq!((id, rpc, group, &payload[..]), (7, Rpc::Vote, 42, &b"abc"[..]));
            }
            other => panic!("{other:?}"),
        }
        let mut f = RequestFrame::new(Rpc::AppendEntries, 3, 0);
        f.payload().put_slice(b"grown past the hint");
        assert_eq!(f.payload_len(), 19);
        let sealed = f.seal(11);
        assert_eq!(sealed[..4], ((sealed.len() - 4) as u32).to_le_bytes());
        match parse(sealed.slice(4..)).expect("parses") {
            Frame::Request { id, rpc, group, payload } => {
                assert_eq!((id, rpc, group, &payload[..]), (11, Rpc::AppendEntries, 3, &b"grown past the hint"[..]));
            }
            other => panic!("{other:?}"),
        }
        let f = response(9, &Err("no".into()));
        assert!(matches!(parse(f.slice(4..)), Ok(Frame::Response { id: 9, result: Err(e) }) if e == "no"));
        assert!(matches!(parse(keepalive().slice(4..)), Ok(Frame::KeepAlive)));
        for bad in [&b""[..], &[1, 0, 0], &[1, 0, 0, 0, 0, 0, 0, 0, 0, 99, 0, 0, 0, 0, 0, 0, 0, 0], &[2; 5], &[9]] {
            assert!(parse(Bytes::copy_from_slice(bad)).is_err(), "{bad:?}");
        }
    }
}
