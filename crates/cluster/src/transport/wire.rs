//! Warren's binary encoding of the Raft messages nodes exchange (not openraft's serde forms, so the
//! library can be swapped without changing what travels between nodes).
//!
//! Integers are little-endian and fixed-size; byte strings and lists carry a `u32` count. Decoding
//! never panics and never allocates more than the input could hold: every count is checked against
//! the bytes left before anything is reserved, and leftover bytes are an error.

use std::collections::{BTreeMap, BTreeSet};

use bytes::{BufMut, Bytes, BytesMut};
use openraft::entry::RaftEntry;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest, VoteRequest,
    VoteResponse,
};
use openraft::raft::TransferLeaderResponse;
use openraft::{EntryPayload, Membership, StoredMembership};

use crate::types::{Command, Entry, NodeAddr, NodeId, TypeConfig, Vote};

pub type CommittedLeaderId = openraft::impls::leader_id_adv::LeaderId<u64, NodeId>;
pub type LogId = openraft::LogId<CommittedLeaderId>;
pub type SnapshotMeta = openraft::storage::SnapshotMeta<CommittedLeaderId, NodeId, NodeAddr>;

/// Why bytes from a peer could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("message truncated: needed {needed} more bytes at offset {at}")]
    Truncated { at: usize, needed: usize },
    #[error("invalid {what} tag {tag}")]
    BadTag { what: &'static str, tag: u8 },
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
    #[error("a text field is not UTF-8")]
    NotUtf8,
    #[error("invalid membership: {0}")]
    Membership(String),
}

/// Appends encoded values to a buffer.
pub struct Enc<'a>(pub &'a mut BytesMut);

impl Enc<'_> {
    pub fn u8(&mut self, v: u8) {
        self.0.put_u8(v);
    }
    pub fn u64(&mut self, v: u64) {
        self.0.put_u64_le(v);
    }
    pub fn bool(&mut self, v: bool) {
        self.0.put_u8(v as u8);
    }
    pub fn bytes(&mut self, b: &[u8]) {
        self.0.put_u32_le(b.len() as u32);
        self.0.put_slice(b);
    }
    pub fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    pub fn vote(&mut self, v: &Vote) {
        self.u64(v.leader_id.term);
        self.u64(v.leader_id.node_id);
        self.bool(v.committed);
    }
    pub fn log_id(&mut self, id: &LogId) {
        self.u64(id.leader_id.term);
        self.u64(id.leader_id.node_id);
        self.u64(id.index);
    }
    pub fn opt_log_id(&mut self, id: &Option<LogId>) {
        match id {
            None => self.u8(0),
            Some(id) => {
                self.u8(1);
                self.log_id(id);
            }
        }
    }
    pub fn node_addr(&mut self, n: &NodeAddr) {
        self.str(&n.cluster_addr);
        self.str(&n.amqp_addr);
    }
    pub fn membership(&mut self, m: &Membership<NodeId, NodeAddr>) {
        let configs = m.get_joint_config();
        self.0.put_u32_le(configs.len() as u32);
        for c in configs {
            self.0.put_u32_le(c.len() as u32);
            for id in c {
                self.u64(*id);
            }
        }
        let nodes: Vec<(&NodeId, &NodeAddr)> = m.nodes().collect();
        self.0.put_u32_le(nodes.len() as u32);
        for (id, addr) in nodes {
            self.u64(*id);
            self.node_addr(addr);
        }
    }
    pub fn entry(&mut self, e: &Entry) {
        self.log_id(&e.log_id);
        match &e.payload {
            EntryPayload::Blank => self.u8(0),
            EntryPayload::Normal(cmd) => {
                self.u8(1);
                self.bytes(&cmd.0);
            }
            EntryPayload::Membership(m) => {
                self.u8(2);
                self.membership(m);
            }
        }
    }
    pub fn snapshot_meta(&mut self, m: &SnapshotMeta) {
        self.opt_log_id(&m.last_log_id);
        self.opt_log_id(m.last_membership.log_id());
        self.membership(m.last_membership.membership());
    }
}

/// Reads encoded values from a frame's payload; byte strings are zero-copy slices of it.
pub struct Dec {
    buf: Bytes,
    pos: usize,
}

impl Dec {
    pub fn new(buf: Bytes) -> Self {
        Dec { buf, pos: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&[u8], DecodeError> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(DecodeError::Truncated { at: self.pos, needed: n - left });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    /// Errors unless every byte was read.
    pub fn finish(self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(DecodeError::Trailing(n)),
        }
    }
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub fn bool(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            tag => Err(DecodeError::BadTag { what: "bool", tag }),
        }
    }
    /// A count of items of at least `min_item` bytes each, checked against what is left.
    fn count(&mut self, min_item: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        let need = n.saturating_mul(min_item);
        if need > self.remaining() {
            return Err(DecodeError::Truncated { at: self.pos, needed: need - self.remaining() });
        }
        Ok(n)
    }
    pub fn bytes(&mut self) -> Result<Bytes, DecodeError> {
        let n = self.count(1)?;
        let start = self.pos;
        self.pos += n;
        Ok(self.buf.slice(start..start + n))
    }
    pub fn string(&mut self) -> Result<String, DecodeError> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::NotUtf8)
    }
    pub fn vote(&mut self) -> Result<Vote, DecodeError> {
        let term = self.u64()?;
        let node_id = self.u64()?;
        let committed = self.bool()?;
        Ok(Vote { leader_id: CommittedLeaderId { term, node_id }, committed })
    }
    pub fn log_id(&mut self) -> Result<LogId, DecodeError> {
        let term = self.u64()?;
        let node_id = self.u64()?;
        let index = self.u64()?;
        Ok(LogId { leader_id: CommittedLeaderId { term, node_id }, index })
    }
    pub fn opt_log_id(&mut self) -> Result<Option<LogId>, DecodeError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.log_id()?)),
            tag => Err(DecodeError::BadTag { what: "option", tag }),
        }
    }
    pub fn node_addr(&mut self) -> Result<NodeAddr, DecodeError> {
        Ok(NodeAddr { cluster_addr: self.string()?, amqp_addr: self.string()? })
    }
    pub fn membership(&mut self) -> Result<Membership<NodeId, NodeAddr>, DecodeError> {
        let n_configs = self.count(4)?;
        let mut configs = Vec::with_capacity(n_configs);
        for _ in 0..n_configs {
            let n = self.count(8)?;
            let mut set = BTreeSet::new();
            for _ in 0..n {
                set.insert(self.u64()?);
            }
            configs.push(set);
        }
        let n_nodes = self.count(16)?;
        let mut nodes = BTreeMap::new();
        for _ in 0..n_nodes {
            let id = self.u64()?;
            nodes.insert(id, self.node_addr()?);
        }
        Membership::new(configs, nodes).map_err(|e| DecodeError::Membership(e.to_string()))
    }
    pub fn entry(&mut self) -> Result<Entry, DecodeError> {
        let log_id = self.log_id()?;
        let payload = match self.u8()? {
            0 => EntryPayload::Blank,
            1 => EntryPayload::Normal(Command(self.bytes()?)),
            2 => EntryPayload::Membership(self.membership()?),
            tag => return Err(DecodeError::BadTag { what: "entry payload", tag }),
        };
        Ok(Entry::new(log_id, payload))
    }
    pub fn snapshot_meta(&mut self) -> Result<SnapshotMeta, DecodeError> {
        let last_log_id = self.opt_log_id()?;
        let membership_log_id = self.opt_log_id()?;
        let membership = self.membership()?;
        Ok(SnapshotMeta { last_log_id, last_membership: StoredMembership::new(membership_log_id, membership) })
    }
}

/// A message that travels between nodes: how it is written and read back.
pub trait Wire: Sized {
    fn encode(&self, e: &mut Enc<'_>);
    /// About how many bytes `encode` writes (the buffer is allocated once at this size).
    fn size_hint(&self) -> usize {
        64
    }
    fn decode(d: &mut Dec) -> Result<Self, DecodeError>;
}

/// Encodes one message into a fresh buffer.
pub fn to_bytes<T: Wire>(msg: &T) -> Bytes {
    let mut buf = BytesMut::with_capacity(64);
    msg.encode(&mut Enc(&mut buf));
    buf.freeze()
}

/// Decodes one message that must fill `buf` exactly.
pub fn from_bytes<T: Wire>(buf: Bytes) -> Result<T, DecodeError> {
    let mut d = Dec::new(buf);
    let msg = T::decode(&mut d)?;
    d.finish()?;
    Ok(msg)
}

impl Wire for AppendEntriesRequest<TypeConfig> {
    fn size_hint(&self) -> usize {
        let payload = |e: &Entry| match &e.payload {
            EntryPayload::Normal(cmd) => cmd.0.len(),
            _ => 64,
        };
        128 + self.entries.iter().map(|e| 32 + payload(e)).sum::<usize>()
    }
    fn encode(&self, e: &mut Enc<'_>) {
        e.vote(&self.vote);
        e.opt_log_id(&self.prev_log_id);
        e.opt_log_id(&self.leader_commit);
        e.0.put_u32_le(self.entries.len() as u32);
        for entry in &self.entries {
            e.entry(entry);
        }
    }
    fn decode(d: &mut Dec) -> Result<Self, DecodeError> {
        let vote = d.vote()?;
        let prev_log_id = d.opt_log_id()?;
        let leader_commit = d.opt_log_id()?;
        let n = d.count(25)?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            entries.push(d.entry()?);
        }
        Ok(AppendEntriesRequest { vote, prev_log_id, entries, leader_commit })
    }
}

impl Wire for AppendEntriesResponse<TypeConfig> {
    fn encode(&self, e: &mut Enc<'_>) {
        match self {
            AppendEntriesResponse::Success => e.u8(0),
            AppendEntriesResponse::PartialSuccess(id) => {
                e.u8(1);
                e.opt_log_id(id);
            }
            AppendEntriesResponse::Conflict => e.u8(2),
            AppendEntriesResponse::HigherVote(v) => {
                e.u8(3);
                e.vote(v);
            }
        }
    }
    fn decode(d: &mut Dec) -> Result<Self, DecodeError> {
        Ok(match d.u8()? {
            0 => AppendEntriesResponse::Success,
            1 => AppendEntriesResponse::PartialSuccess(d.opt_log_id()?),
            2 => AppendEntriesResponse::Conflict,
            3 => AppendEntriesResponse::HigherVote(d.vote()?),
            tag => return Err(DecodeError::BadTag { what: "append-entries response", tag }),
        })
    }
}

impl Wire for VoteRequest<TypeConfig> {
    fn encode(&self, e: &mut Enc<'_>) {
        e.vote(&self.vote);
        e.opt_log_id(&self.last_log_id);
        e.bool(self.leadership_transfer);
    }
    fn decode(d: &mut Dec) -> Result<Self, DecodeError> {
        let vote = d.vote()?;
        let last_log_id = d.opt_log_id()?;
        let mut req = VoteRequest::new(vote, last_log_id);
        req.leadership_transfer = d.bool()?;
        Ok(req)
    }
}

impl Wire for VoteResponse<TypeConfig> {
    fn encode(&self, e: &mut Enc<'_>) {
        e.vote(&self.vote);
        e.bool(self.vote_granted);
        e.opt_log_id(&self.last_log_id);
    }
    fn decode(d: &mut Dec) -> Result<Self, DecodeError> {
        let vote = d.vote()?;
        let granted = d.bool()?;
        let last_log_id = d.opt_log_id()?;
        Ok(VoteResponse::new(vote, last_log_id, granted))
    }
}

impl Wire for SnapshotResponse<TypeConfig> {
    fn encode(&self, e: &mut Enc<'_>) {
        e.vote(&self.vote);
    }
    fn decode(d: &mut Dec) -> Result<Self, DecodeError> {
        Ok(SnapshotResponse::new(d.vote()?))
    }
}

impl Wire for TransferLeaderRequest<TypeConfig> {
    fn encode(&self, e: &mut Enc<'_>) {
        e.vote(self.from_leader());
        e.u64(*self.to_node_id());
        e.opt_log_id(&self.last_log_id().cloned());
    }
    fn decode(d: &mut Dec) -> Result<Self, DecodeError> {
        let from = d.vote()?;
        let to = d.u64()?;
        let last = d.opt_log_id()?;
        Ok(TransferLeaderRequest::new(from, to, last))
    }
}

impl Wire for TransferLeaderResponse<TypeConfig> {
    fn encode(&self, e: &mut Enc<'_>) {
        use openraft::raft::TransferLeaderError as E;
        match self {
            Ok(()) => e.u8(0),
            Err(E::VoteChanged { expected, actual }) => {
                e.u8(1);
                e.vote(expected);
                e.vote(actual);
            }
            Err(E::LogNotFlushed { expected, actual }) => {
                e.u8(2);
                e.opt_log_id(expected);
                e.opt_log_id(actual);
            }
        }
    }
    fn decode(d: &mut Dec) -> Result<Self, DecodeError> {
        use openraft::raft::TransferLeaderError as E;
        Ok(match d.u8()? {
            0 => Ok(()),
            1 => Err(E::VoteChanged { expected: d.vote()?, actual: d.vote()? }),
            2 => Err(E::LogNotFlushed { expected: d.opt_log_id()?, actual: d.opt_log_id()? }),
            tag => return Err(DecodeError::BadTag { what: "transfer-leader response", tag }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lid(term: u64, node: u64, index: u64) -> LogId {
        LogId { leader_id: CommittedLeaderId { term, node_id: node }, index }
    }

    fn membership() -> Membership<NodeId, NodeAddr> {
        let addr = |p: u16| NodeAddr { cluster_addr: format!("127.0.0.1:{p}"), amqp_addr: String::new() };
        Membership::new(
            vec![BTreeSet::from([1, 2, 3])],
            BTreeMap::from([(1, addr(1)), (2, addr(2)), (3, addr(3)), (4, addr(4))]),
        )
        .expect("valid membership")
    }

    fn append_request() -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote { leader_id: CommittedLeaderId { term: 7, node_id: 2 }, committed: true },
            prev_log_id: Some(lid(6, 1, 41)),
            leader_commit: Some(lid(6, 1, 40)),
            entries: vec![
                Entry::new(lid(7, 2, 42), EntryPayload::Blank),
                Entry::new(lid(7, 2, 43), EntryPayload::Normal(Command(Bytes::from_static(b"hello")))),
                Entry::new(lid(7, 2, 44), EntryPayload::Membership(membership())),
            ],
        }
    }

    #[test]
    fn messages_round_trip() {
        let req = append_request();
        let back: AppendEntriesRequest<TypeConfig> = from_bytes(to_bytes(&req)).expect("decodes");
        assert_eq!((back.vote, back.prev_log_id, back.leader_commit), (req.vote, req.prev_log_id, req.leader_commit));
        assert_eq!(back.entries, req.entries);
        for resp in [
            AppendEntriesResponse::Success,
            AppendEntriesResponse::PartialSuccess(Some(lid(1, 2, 3))),
            AppendEntriesResponse::PartialSuccess(None),
            AppendEntriesResponse::Conflict,
            AppendEntriesResponse::HigherVote(req.vote),
        ] {
            let back: AppendEntriesResponse<TypeConfig> = from_bytes(to_bytes(&resp)).expect("decodes");
            assert_eq!(back, resp);
        }
        let mut vote = VoteRequest::<TypeConfig>::new(req.vote, Some(lid(3, 3, 9)));
        vote.leadership_transfer = true;
        let back: VoteRequest<TypeConfig> = from_bytes(to_bytes(&vote)).expect("decodes");
        assert_eq!(back, vote);
        let resp = VoteResponse::<TypeConfig>::new(req.vote, None, true);
        let back: VoteResponse<TypeConfig> = from_bytes(to_bytes(&resp)).expect("decodes");
        assert_eq!(back, resp);
        let t = TransferLeaderRequest::<TypeConfig>::new(req.vote, 3, Some(lid(7, 2, 44)));
        let back: TransferLeaderRequest<TypeConfig> = from_bytes(to_bytes(&t)).expect("decodes");
        assert_eq!(back, t);
    }

    #[test]
    fn every_truncation_and_every_corrupted_byte_is_an_error_or_a_value_never_a_panic() {
        let full = to_bytes(&append_request());
        for cut in 0..full.len() {
            let r: Result<AppendEntriesRequest<TypeConfig>, _> = from_bytes(full.slice(..cut));
            assert!(r.is_err(), "a message cut at {cut} of {} must not decode", full.len());
        }
        let mut extra = full.to_vec();
        extra.push(0);
        assert_eq!(
            from_bytes::<AppendEntriesRequest<TypeConfig>>(Bytes::from(extra)).expect_err("trailing"),
            DecodeError::Trailing(1)
        );
        for i in 0..full.len() {
            for v in [0u8, 1, 2, 0x7f, 0xff] {
                let mut b = full.to_vec();
                b[i] = v;
                let _ = from_bytes::<AppendEntriesRequest<TypeConfig>>(Bytes::from(b));
            }
        }
    }

    #[test]
    fn a_huge_count_is_refused_before_allocating() {
        let mut buf = BytesMut::new();
        let mut e = Enc(&mut buf);
        e.vote(&Vote::new(1, 1));
        e.opt_log_id(&None);
        e.opt_log_id(&None);
        e.0.put_u32_le(u32::MAX);
        let r = from_bytes::<AppendEntriesRequest<TypeConfig>>(buf.freeze());
        assert!(matches!(r, Err(DecodeError::Truncated { .. })), "{r:?}");
    }
}
