//! The durable topology replicated by the cluster's metadata group (Raft group 0).
//!
//! The broker knows no Raft library: the server implements [`MetadataGroup`] over its cluster
//! node and hands every committed entry of group 0 to `Broker::apply_metadata_entry`, on every
//! node, in log order. A node then makes a durable change like this:
//!
//! 1. the vhost checks the request and builds the [`Op`]s (a new queue's id left 0: it is
//!    assigned when the entry is applied, from the replicated counter, so it is the same on
//!    every node);
//! 2. [`propose`] sends them as one entry and waits until *this* node has applied it (the
//!    leader's reply names the entry's index; the local applied index must reach it);
//! 3. applying (the one path every node takes, the proposer included) writes the resolved ops
//!    to the local `metadata.log` with the entry's index, then changes the in-memory topology.
//!
//! 4. before the client gets its -ok, the proposer waits (at most [`SPREAD_TIMEOUT`]) until every
//!    other member it reaches has applied the entry too (`MetadataGroup::wait_applied_elsewhere`),
//!    as RabbitMQ's Mnesia transactions commit on every node: after bind-ok on one node, a
//!    publish on another routes with the binding (read-your-writes across nodes).
//!
//! Reads stay local. Before answering "does not exist" (404, unroutable) a node waits for a
//! barrier ([`catch_up`]): the leader's read index (a quorum heartbeat round, no log entry:
//! `MetadataGroup::read_barrier`), so everything committed before the miss (by a node that
//! could not reach this one in time) is applied here first.
//! Concurrent misses share one barrier (`Metadata::catch_up`).
//!
//! Entry and snapshot bytes: a version byte ([`ENTRY_VERSION`]), then JSON (the ops as in
//! `metadata.log`; a snapshot is `{"applied": index, "ops": [...]}`, the shortest op list).

use super::{Op, Refusal};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

pub const ENTRY_VERSION: u8 = 1;
/// How long a change waits for the group (commit, then this node's apply) before 541.
pub const COMMIT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a change waits for the other reachable members to have applied it too.
pub const SPREAD_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a lookup miss waits for the barrier before answering from what this node knows.
pub const BARRIER_TIMEOUT: Duration = Duration::from_secs(3);
/// After a failed barrier, misses answer at once for this long (no quorum: do not stall every
/// unroutable publish).
pub const BARRIER_BACKOFF: Duration = Duration::from_secs(1);

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Why a proposal has no index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProposeFailed {
    /// Not committed (no leader or quorum within the timeout, refused): nothing changed anywhere.
    NotCommitted(String),
    /// Sent to a leader that did not answer: the entry may be committed (and then is applied).
    Unknown(String),
}

/// A committed entry, as the leader's apply answered (`encode_reply`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    /// Its log index.
    pub index: u64,
    /// A declaration in it was dropped: the queue or exchange exists (declared first, on another
    /// node) with other properties (`AppliedEntry::conflict`).
    pub conflict: bool,
    /// Applied as nothing: it names a user or vhost that does not exist (`AppliedEntry::refused`).
    pub refused: Option<Refusal>,
}

/// The cluster's metadata group, as the broker sees it (implemented by the server).
pub trait MetadataGroup: Send + Sync {
    /// Proposes `entry` to group 0; resolves once committed, with the leader's reply.
    fn propose(&self, entry: Bytes, timeout: Duration) -> BoxFuture<Result<Committed, ProposeFailed>>;
    /// Waits (at most `timeout`) until every other member this node reaches has applied entry
    /// `index`; resolves to those that did not say so in time.
    /// A read barrier without a log entry, if the group offers one: resolves once this node has
    /// applied everything committed before the call (the leader's read index). None: the caller
    /// commits an empty entry instead.
    fn read_barrier(&self, timeout: Duration) -> Option<BoxFuture<Result<(), String>>> {
        let _ = timeout;
        None
    }
    fn wait_applied_elsewhere(&self, index: u64, timeout: Duration) -> BoxFuture<Vec<u64>> {
        let _ = (index, timeout);
        Box::pin(async { Vec::new() })
    }
}

pub fn encode_entry(ops: &[Op]) -> Bytes {
    let mut out = vec![ENTRY_VERSION];
    // Serialising these types cannot fail (string keys, no maps with other keys).
    out.extend(serde_json::to_vec(ops).unwrap_or_else(|_| b"[]".to_vec()));
    Bytes::from(out)
}

pub fn decode_entry(entry: &[u8]) -> Result<Vec<Op>, String> {
    match entry.split_first() {
        Some((&ENTRY_VERSION, json)) => serde_json::from_slice(json).map_err(|e| format!("undecodable metadata entry: {e}")),
        Some((v, _)) => Err(format!("metadata entry format version {v} is not one this Warren reads ({ENTRY_VERSION})")),
        None => Err("empty metadata entry".to_string()),
    }
}

#[derive(Serialize, Deserialize)]
struct SnapshotBody {
    applied: u64,
    ops: Vec<Op>,
}

pub fn encode_snapshot(applied: u64, ops: Vec<Op>) -> Bytes {
    let mut out = vec![ENTRY_VERSION];
    out.extend(serde_json::to_vec(&SnapshotBody { applied, ops }).unwrap_or_default());
    Bytes::from(out)
}

pub fn decode_snapshot(bytes: &[u8]) -> Result<(u64, Vec<Op>), String> {
    match bytes.split_first() {
        Some((&ENTRY_VERSION, json)) => serde_json::from_slice::<SnapshotBody>(json)
            .map(|s| (s.applied, s.ops))
            .map_err(|e| format!("undecodable metadata snapshot: {e}")),
        Some((v, _)) => Err(format!("metadata snapshot format version {v} is not one this Warren reads ({ENTRY_VERSION})")),
        None => Err("empty metadata snapshot".to_string()),
    }
}

/// The reply `apply` gives the proposer: the entry as committed, or why it was refused (every
/// node answers the same entry the same way). A tag byte: 0 applied, 2 applied with a conflict
/// (then the index, u64 little-endian), 1 undecodable (then the reason), 3 committed but
/// refused by the state (then the index, the reply code as u16 little-endian, the reason).
pub fn encode_reply(reply: Result<Committed, &str>) -> Bytes {
    let mut out = Vec::with_capacity(9);
    match reply {
        Ok(Committed { index, refused: Some(refusal), .. }) => {
            out.push(3);
            out.extend_from_slice(&index.to_le_bytes());
            out.extend_from_slice(&refusal.code.to_le_bytes());
            out.extend_from_slice(refusal.text.as_bytes());
        }
        Ok(Committed { index, conflict, refused: None }) => {
            out.push(if conflict { 2 } else { 0 });
            out.extend_from_slice(&index.to_le_bytes());
        }
        Err(why) => {
            out.push(1);
            out.extend_from_slice(why.as_bytes());
        }
    }
    Bytes::from(out)
}

/// The committed entry in an `apply` reply, or the refusal.
pub fn decode_reply(reply: &[u8]) -> Result<Committed, String> {
    match reply.split_first() {
        Some((tag @ (0 | 2), rest)) if rest.len() == 8 => {
            Ok(Committed { index: u64::from_le_bytes(rest.try_into().unwrap_or([0; 8])), conflict: *tag == 2, refused: None })
        }
        Some((3, rest)) if rest.len() >= 10 => {
            let (index, rest) = rest.split_at(8);
            let (code, text) = rest.split_at(2);
            Ok(Committed {
                index: u64::from_le_bytes(index.try_into().unwrap_or([0; 8])),
                conflict: false,
                refused: Some(Refusal { code: u16::from_le_bytes([code[0], code[1]]), text: String::from_utf8_lossy(text).into_owned() }),
            })
        }
        Some((1, why)) => Err(String::from_utf8_lossy(why).into_owned()),
        _ => Err(format!("a metadata reply of {} bytes that is not one", reply.len())),
    }
}

/// Runs a future to completion from synchronous broker code (a vhost change holding its topology
/// lock): on a multi-threaded runtime under `block_in_place`, so the worker's other tasks move on.
pub fn block_on<T>(fut: BoxFuture<T>) -> Result<T, String> {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => Ok(tokio::task::block_in_place(|| h.block_on(fut))),
        Ok(_) => Err("the replicated metadata needs the multi-threaded runtime".to_string()),
        // A plain thread (tests): a small runtime of its own drives the future.
        Err(_) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map(|rt| rt.block_on(fut))
            .map_err(|e| e.to_string()),
    }
}

/// Remaining time to `deadline`.
pub fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_round_trip() {
        let refused = Committed { index: 9, conflict: false, refused: Some(Refusal { code: 404, text: "no user 'ü'".into() }) };
        for committed in [Committed { index: 7, conflict: false, refused: None }, Committed { index: u64::MAX, conflict: true, refused: None }, refused] {
            assert_eq!(decode_reply(&encode_reply(Ok(committed.clone()))), Ok(committed));
        }
        assert_eq!(decode_reply(&encode_reply(Err("bad entry"))), Err("bad entry".to_string()));
        assert!(decode_reply(&[2, 1, 2]).is_err() && decode_reply(&[]).is_err() && decode_reply(&[3; 9]).is_err());
    }
}
