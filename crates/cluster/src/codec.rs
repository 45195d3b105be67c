//! Warren's encodings of what a Raft group stores: log entries, the hard state (vote, committed and
//! purged log ids) and snapshots. These bytes are the payloads of store records (the store frames
//! them and checks their CRC), so they carry no length prefix or checksum of their own; they are
//! versioned so that a later layout can still read this one, and they name no openraft type on
//! disk, so the library can be swapped without a data migration (docs/internals/cluster.md).
//!
//! Layouts (integers little-endian; `opt<X>` is a byte 0/1 and then `X` when 1):
//!
//! ```text
//! entry     = version:u8 kind:u8 term:u64 leader:u64 index:u64 body
//!             kind 0 blank:      body = nothing
//!             kind 1 normal:     body = the command's bytes, to the end of the record
//!             kind 2 membership: body = membership
//! state     = version:u8 kind:u8 ...
//!             kind 1 hard state: vote:opt<vote> committed:opt<log_id> purged:opt<log_id>
//!             kind 2 snapshot:   last:opt<log_id> membership_at:opt<log_id> membership data (to the end)
//!             kind 3 layout:     next_log_seq:u64 runs:u32 { run } [retained:u32 { run }]
//!                                (written before retained records existed: its retained runs, none
//!                                when absent, are the whole retained set as of this record)
//!             kind 4 log layout: next_log_seq:u64 runs:u32 { run }
//!             kind 5 retained:   reset:u8 added:u32 { run } released:u32 { index:u64 }
//!                                (a change to the retained set; reset: the set is `added` alone)
//! run       = first_index:u64 first_seq:u64 count:u64 term:u64 leader:u64 bytes:u64
//! log_id    = term:u64 leader:u64 index:u64
//! vote      = term:u64 node:u64 committed:u8
//! membership= configs:u32 { voters:u32 { node:u64 } } nodes:u32 { node:u64 cluster_addr:str amqp_addr:str }
//! str       = len:u32 utf-8 bytes
//! ```
//!
//! ### To ensure correctness
//! - Decoding never panics and never allocates more than the input could hold: every length and
//!   count is checked against the bytes that remain. Bad bytes are a [`DecodeError`].

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use openraft::entry::RaftEntry;
use openraft::vote::RaftLeaderId;
use openraft::EntryPayload;

use crate::types::{Command, Entry, LogId, Membership, NodeAddr, NodeId, Vote};

/// The layout version written; decoders accept it and refuse others.
pub const VERSION: u8 = 1;

/// Bytes before an entry's body: version, kind, term, leader, index.
pub const ENTRY_HEAD_LEN: usize = 2 + 8 + 8 + 8;

const ENTRY_BLANK: u8 = 0;
const ENTRY_NORMAL: u8 = 1;
const ENTRY_MEMBERSHIP: u8 = 2;

const STATE_HARD: u8 = 1;
const STATE_SNAPSHOT: u8 = 2;
const STATE_LAYOUT_WITH_RETAINED: u8 = 3;
const STATE_LOG_LAYOUT: u8 = 4;
const STATE_RETAINED: u8 = 5;

/// The committed leader id of a log id: (term, node).
pub type LeaderId = crate::types::CommittedLeaderId;
pub type StoredMembership = openraft::StoredMembership<LeaderId, NodeId, NodeAddr>;
pub type SnapshotMeta = openraft::SnapshotMeta<LeaderId, NodeId, NodeAddr>;

/// What is wrong with bytes that do not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("truncated: {what} needs {need} bytes at offset {at}, {have} remain")]
    Truncated { what: &'static str, at: usize, need: usize, have: usize },
    #[error("unknown layout version {0} (this build reads {VERSION})")]
    Version(u8),
    #[error("unknown {what} kind {kind}")]
    Kind { what: &'static str, kind: u8 },
    #[error("invalid {0}")]
    Invalid(&'static str),
}

/// The durable part of a group's Raft state besides its log: one record, rewritten whole when any
/// field changes (it is a few dozen bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HardState {
    pub vote: Option<Vote>,
    pub committed: Option<LogId>,
    pub purged: Option<LogId>,
}

/// A record of a group's `RAFT_STATE` queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateRecord {
    Hard(HardState),
    /// A snapshot: its metadata and the state machine's bytes (`GroupMachine::snapshot`).
    Snapshot { meta: SnapshotMeta, data: Bytes },
    /// Where the log's entries are: recovery reads only the records appended after it.
    Layout(Layout),
    /// A change to the set of retained entries (purged entries whose records are kept).
    Retained(RetainedChange),
}

/// The group's log as runs of entries with consecutive indexes and store seqs and one leader, as
/// of the moment the group's log queue had appended up to `next_log_seq`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Layout {
    pub next_log_seq: u64,
    pub runs: Vec<Run>,
    /// Only in layouts written before [`RetainedChange`] records existed (and by tests of reading
    /// them): every purged entry whose record is kept, as runs (their indexes are below the log's:
    /// runs need not follow each other). Such a record also resets the retained set.
    pub retained: Option<Vec<Run>>,
}

/// A change to a group's retained entries (purged entries whose records are kept because the state
/// machine still reads them). Written as the set changes, so a change costs its own size whatever
/// the set's: the log store writes the whole set (`reset`) once the changes since the last one
/// outweigh it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetainedChange {
    /// The set is `added` alone (the changes before this record no longer count).
    pub reset: bool,
    pub added: Vec<Run>,
    /// Indexes that left the set.
    pub released: Vec<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub first_index: u64,
    pub first_seq: u64,
    pub count: u64,
    pub leader: LeaderId,
    /// Payload bytes of the run's records (what acks report to the store).
    pub bytes: u64,
}

/// The head of an entry record (everything before a normal entry's command bytes, and a membership
/// entry's whole encoding). Append it and the command as two parts of one store record: the command
/// is copied once, into the write buffer.
pub fn encode_entry_head(entry: &Entry, out: &mut Vec<u8>) {
    let kind = match &entry.payload {
        EntryPayload::Blank => ENTRY_BLANK,
        EntryPayload::Normal(_) => ENTRY_NORMAL,
        EntryPayload::Membership(_) => ENTRY_MEMBERSHIP,
    };
    out.push(VERSION);
    out.push(kind);
    put_log_id(out, &entry.log_id);
    if let EntryPayload::Membership(m) = &entry.payload {
        put_membership(out, m);
    }
}

/// The bytes after the head: a normal entry's command, empty otherwise.
pub fn entry_body(entry: &Entry) -> &[u8] {
    match &entry.payload {
        EntryPayload::Normal(c) => &c.0,
        _ => &[],
    }
}

/// The whole encoding of an entry (head and body in one buffer).
pub fn encode_entry(entry: &Entry) -> Vec<u8> {
    let mut out = Vec::with_capacity(ENTRY_HEAD_LEN + entry_body(entry).len());
    encode_entry_head(entry, &mut out);
    out.extend_from_slice(entry_body(entry));
    out
}

/// Decodes an entry record. A normal entry's command is a slice of `record` (no copy).
pub fn decode_entry(record: &Bytes) -> Result<Entry, DecodeError> {
    let mut r = Reader::new(record);
    let kind = r.head("entry")?;
    let log_id = r.log_id()?;
    let payload = match kind {
        ENTRY_BLANK => EntryPayload::Blank,
        ENTRY_NORMAL => EntryPayload::Normal(Command(record.slice(r.at..))),
        ENTRY_MEMBERSHIP => EntryPayload::Membership(r.membership()?),
        kind => return Err(DecodeError::Kind { what: "entry", kind }),
    };
    if kind != ENTRY_NORMAL {
        r.end()?;
    }
    Ok(Entry::new(log_id, payload))
}

/// Only the log id of an entry record (recovery builds its index from these without decoding
/// bodies). Checks the version and kind too.
pub fn decode_entry_log_id(record: &[u8]) -> Result<LogId, DecodeError> {
    let mut r = Reader::new(record);
    match r.head("entry")? {
        ENTRY_BLANK | ENTRY_NORMAL | ENTRY_MEMBERSHIP => r.log_id(),
        kind => Err(DecodeError::Kind { what: "entry", kind }),
    }
}

pub fn encode_hard_state(hard: &HardState) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + 18 + 2 * 25);
    out.push(VERSION);
    out.push(STATE_HARD);
    match &hard.vote {
        None => out.push(0),
        Some(v) => {
            out.push(1);
            put_u64(&mut out, v.leader_id.term);
            put_u64(&mut out, v.leader_id.node_id);
            out.push(u8::from(v.committed));
        }
    }
    put_opt_log_id(&mut out, hard.committed.as_ref());
    put_opt_log_id(&mut out, hard.purged.as_ref());
    out
}

/// The head of a snapshot record (its metadata); the snapshot's data follows it in the record.
pub fn encode_snapshot_head(meta: &SnapshotMeta) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.push(VERSION);
    out.push(STATE_SNAPSHOT);
    put_opt_log_id(&mut out, meta.last_log_id.as_ref());
    put_opt_log_id(&mut out, meta.last_membership.log_id().as_ref());
    put_membership(&mut out, meta.last_membership.membership());
    out
}

pub fn encode_layout(layout: &Layout) -> Vec<u8> {
    let retained = layout.retained.as_ref().map_or(0, Vec::len);
    let mut out = Vec::with_capacity(2 + 8 + 8 + (layout.runs.len() + retained) * 48);
    out.push(VERSION);
    out.push(if layout.retained.is_some() { STATE_LAYOUT_WITH_RETAINED } else { STATE_LOG_LAYOUT });
    put_u64(&mut out, layout.next_log_seq);
    put_runs(&mut out, &layout.runs);
    if let Some(retained) = layout.retained.as_ref().filter(|r| !r.is_empty()) {
        put_runs(&mut out, retained);
    }
    out
}

pub fn encode_retained(change: &RetainedChange) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + 1 + 4 + change.added.len() * 48 + 4 + change.released.len() * 8);
    out.push(VERSION);
    out.push(STATE_RETAINED);
    out.push(change.reset as u8);
    put_runs(&mut out, &change.added);
    put_u32(&mut out, change.released.len());
    for index in &change.released {
        put_u64(&mut out, *index);
    }
    out
}

fn put_runs(out: &mut Vec<u8>, runs: &[Run]) {
    put_u32(out, runs.len());
    for r in runs {
        put_u64(out, r.first_index);
        put_u64(out, r.first_seq);
        put_u64(out, r.count);
        put_u64(out, r.leader.term);
        put_u64(out, r.leader.node_id);
        put_u64(out, r.bytes);
    }
}

/// Decodes a `RAFT_STATE` record. A snapshot's data is a slice of `record` (no copy).
pub fn decode_state(record: &Bytes) -> Result<StateRecord, DecodeError> {
    let mut r = Reader::new(record);
    match r.head("state record")? {
        STATE_HARD => {
            let vote = match r.flag("vote")? {
                false => None,
                true => {
                    let term = r.u64("vote term")?;
                    let node = r.u64("vote node")?;
                    let committed = r.flag("vote committed")?;
                    Some(if committed { Vote::new_committed(term, node) } else { Vote::new(term, node) })
                }
            };
            let committed = r.opt_log_id()?;
            let purged = r.opt_log_id()?;
            r.end()?;
            Ok(StateRecord::Hard(HardState { vote, committed, purged }))
        }
        STATE_SNAPSHOT => {
            let last_log_id = r.opt_log_id()?;
            let membership_at = r.opt_log_id()?;
            let membership = r.membership()?;
            let data = record.slice(r.at..);
            let meta = SnapshotMeta { last_log_id, last_membership: StoredMembership::new(membership_at, membership) };
            Ok(StateRecord::Snapshot { meta, data })
        }
        STATE_LAYOUT_WITH_RETAINED => {
            let next_log_seq = r.u64("layout next seq")?;
            let runs = r.runs("layout runs")?;
            let retained = if r.at < r.buf.len() { r.runs("layout retained runs")? } else { Vec::new() };
            r.end()?;
            Ok(StateRecord::Layout(Layout { next_log_seq, runs, retained: Some(retained) }))
        }
        STATE_LOG_LAYOUT => {
            let next_log_seq = r.u64("layout next seq")?;
            let runs = r.runs("layout runs")?;
            r.end()?;
            Ok(StateRecord::Layout(Layout { next_log_seq, runs, retained: None }))
        }
        STATE_RETAINED => {
            let reset = r.flag("retained reset")?;
            let added = r.runs("retained runs")?;
            let n = r.count("released indexes", 8)?;
            let mut released = Vec::with_capacity(n);
            for _ in 0..n {
                released.push(r.u64("released index")?);
            }
            r.end()?;
            Ok(StateRecord::Retained(RetainedChange { reset, added, released }))
        }
        kind => Err(DecodeError::Kind { what: "state record", kind }),
    }
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u32(out: &mut Vec<u8>, v: usize) {
    // Counts and lengths of what Warren encodes are far below 4 Gi; saturate rather than wrap.
    out.extend_from_slice(&u32::try_from(v).unwrap_or(u32::MAX).to_le_bytes());
}

fn put_log_id(out: &mut Vec<u8>, id: &LogId) {
    put_u64(out, id.leader_id.term);
    put_u64(out, id.leader_id.node_id);
    put_u64(out, id.index);
}

fn put_opt_log_id(out: &mut Vec<u8>, id: Option<&LogId>) {
    match id {
        None => out.push(0),
        Some(id) => {
            out.push(1);
            put_log_id(out, id);
        }
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u32(out, s.len());
    out.extend_from_slice(s.as_bytes());
}

fn put_membership(out: &mut Vec<u8>, m: &Membership) {
    let configs = m.get_joint_config();
    put_u32(out, configs.len());
    for config in configs {
        put_u32(out, config.len());
        for id in config {
            put_u64(out, *id);
        }
    }
    let nodes: Vec<(&NodeId, &NodeAddr)> = m.nodes().collect();
    put_u32(out, nodes.len());
    for (id, addr) in nodes {
        put_u64(out, *id);
        put_str(out, &addr.cluster_addr);
        put_str(out, &addr.amqp_addr);
    }
}

/// A cursor over bytes being decoded; every read checks what remains.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf, at: 0 }
    }

    fn take(&mut self, what: &'static str, n: usize) -> Result<&'a [u8], DecodeError> {
        let have = self.buf.len() - self.at;
        if n > have {
            return Err(DecodeError::Truncated { what, at: self.at, need: n, have });
        }
        let s = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(what, 1)?[0])
    }

    fn u32(&mut self, what: &'static str) -> Result<usize, DecodeError> {
        let b = self.take(what, 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let b = self.take(what, 8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn runs(&mut self, what: &'static str) -> Result<Vec<Run>, DecodeError> {
        let n = self.count(what, 48)?;
        let mut runs = Vec::with_capacity(n);
        for _ in 0..n {
            let first_index = self.u64("run index")?;
            let first_seq = self.u64("run seq")?;
            let count = self.u64("run count")?;
            let term = self.u64("run term")?;
            let node = self.u64("run leader")?;
            let bytes = self.u64("run bytes")?;
            runs.push(Run { first_index, first_seq, count, leader: LeaderId::new(term, node), bytes });
        }
        Ok(runs)
    }

    fn flag(&mut self, what: &'static str) -> Result<bool, DecodeError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(DecodeError::Invalid(what)),
        }
    }

    /// Version and kind.
    fn head(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        let version = self.u8(what)?;
        if version != VERSION {
            return Err(DecodeError::Version(version));
        }
        self.u8(what)
    }

    fn log_id(&mut self) -> Result<LogId, DecodeError> {
        let term = self.u64("log id term")?;
        let node = self.u64("log id leader")?;
        let index = self.u64("log id index")?;
        Ok(LogId::new(LeaderId::new(term, node), index))
    }

    fn opt_log_id(&mut self) -> Result<Option<LogId>, DecodeError> {
        Ok(match self.flag("log id flag")? {
            false => None,
            true => Some(self.log_id()?),
        })
    }

    /// A count of items of at least `min_size` bytes each, checked against what remains.
    fn count(&mut self, what: &'static str, min_size: usize) -> Result<usize, DecodeError> {
        let n = self.u32(what)?;
        let have = self.buf.len() - self.at;
        if n.saturating_mul(min_size) > have {
            return Err(DecodeError::Truncated { what, at: self.at, need: n.saturating_mul(min_size), have });
        }
        Ok(n)
    }

    fn string(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let n = self.u32(what)?;
        let b = self.take(what, n)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::Invalid(what))
    }

    fn membership(&mut self) -> Result<Membership, DecodeError> {
        let n_configs = self.count("membership configs", 4)?;
        let mut configs = Vec::with_capacity(n_configs);
        for _ in 0..n_configs {
            let n = self.count("membership voters", 8)?;
            let mut config = BTreeSet::new();
            for _ in 0..n {
                config.insert(self.u64("voter id")?);
            }
            configs.push(config);
        }
        let n_nodes = self.count("membership nodes", 16)?;
        let mut nodes = BTreeMap::new();
        for _ in 0..n_nodes {
            let id = self.u64("node id")?;
            let cluster_addr = self.string("cluster address")?;
            let amqp_addr = self.string("amqp address")?;
            nodes.insert(id, NodeAddr { cluster_addr, amqp_addr });
        }
        // Checks that every voter has an address; an empty joint config is the "none yet" value.
        Membership::new(configs, nodes).map_err(|_| DecodeError::Invalid("membership (a voter without a node)"))
    }

    fn end(&self) -> Result<(), DecodeError> {
        if self.at != self.buf.len() {
            return Err(DecodeError::Invalid("trailing bytes"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(n: u64) -> NodeAddr {
        NodeAddr { cluster_addr: format!("10.0.0.{n}:4000"), amqp_addr: format!("10.0.0.{n}:5672") }
    }

    fn log_id(term: u64, node: u64, index: u64) -> LogId {
        LogId::new(LeaderId::new(term, node), index)
    }

    fn membership() -> Membership {
        let configs = vec![BTreeSet::from([1, 2]), BTreeSet::from([1, 2, 3])];
        let nodes = BTreeMap::from([(1, addr(1)), (2, addr(2)), (3, addr(3)), (4, addr(4))]);
        Membership::new(configs, nodes).unwrap()
    }

    #[test]
    fn entries_round_trip() {
        let entries = [
            Entry::new(log_id(1, 2, 3), EntryPayload::Blank),
            Entry::new(log_id(u64::MAX, 7, 9), EntryPayload::Normal(Command(Bytes::from_static(b"publish")))),
            Entry::new(log_id(4, 1, 10), EntryPayload::Normal(Command(Bytes::new()))),
            Entry::new(log_id(5, 3, 11), EntryPayload::Membership(membership())),
            Entry::new(log_id(0, 0, 0), EntryPayload::Membership(Membership::default())),
        ];
        for e in entries {
            let bytes = Bytes::from(encode_entry(&e));
            assert_eq!(decode_entry(&bytes).unwrap(), e);
            assert_eq!(decode_entry_log_id(&bytes).unwrap(), e.log_id);
        }
    }

    #[test]
    fn state_records_round_trip() {
        let hards = [
            HardState::default(),
            HardState { vote: Some(Vote::new(3, 1)), committed: Some(log_id(2, 1, 40)), purged: None },
            HardState { vote: Some(Vote::new_committed(9, 2)), committed: None, purged: Some(log_id(1, 1, 5)) },
        ];
        for h in hards {
            let bytes = Bytes::from(encode_hard_state(&h));
            assert_eq!(decode_state(&bytes).unwrap(), StateRecord::Hard(h));
        }
        let meta = SnapshotMeta {
            last_log_id: Some(log_id(3, 2, 100)),
            last_membership: StoredMembership::new(Some(log_id(2, 1, 7)), membership()),
        };
        let mut bytes = encode_snapshot_head(&meta);
        bytes.extend_from_slice(b"machine state");
        let got = decode_state(&Bytes::from(bytes)).unwrap();
        assert_eq!(got, StateRecord::Snapshot { meta, data: Bytes::from_static(b"machine state") });
        for layout in [
            Layout::default(),
            Layout {
                next_log_seq: 99,
                runs: vec![
                    Run { first_index: 5, first_seq: 10, count: 3, leader: LeaderId::new(1, 2), bytes: 300 },
                    Run { first_index: 8, first_seq: 20, count: 70, leader: LeaderId::new(2, 1), bytes: 7000 },
                ],
                retained: None,
            },
            Layout { next_log_seq: 7, runs: Vec::new(), retained: Some(Vec::new()) },
            Layout {
                next_log_seq: 120,
                runs: vec![Run { first_index: 50, first_seq: 100, count: 20, leader: LeaderId::new(2, 1), bytes: 2000 }],
                retained: Some(vec![
                    Run { first_index: 3, first_seq: 8, count: 1, leader: LeaderId::new(1, 2), bytes: 100 },
                    Run { first_index: 30, first_seq: 70, count: 2, leader: LeaderId::new(2, 1), bytes: 200 },
                ]),
            },
        ] {
            let bytes = Bytes::from(encode_layout(&layout));
            assert_eq!(decode_state(&bytes).unwrap(), StateRecord::Layout(layout));
        }
        for change in [
            RetainedChange::default(),
            RetainedChange { reset: true, added: vec![Run { first_index: 3, first_seq: 8, count: 4, leader: LeaderId::new(1, 2), bytes: 400 }], released: Vec::new() },
            RetainedChange { reset: false, added: Vec::new(), released: vec![3, 9, 1 << 40] },
        ] {
            let bytes = Bytes::from(encode_retained(&change));
            assert_eq!(decode_state(&bytes).unwrap(), StateRecord::Retained(change));
        }
    }

    /// Every truncation and every single-byte change of valid records decodes to a value or an
    /// error, never a panic (or a huge allocation).
    #[test]
    fn bad_bytes_are_errors_not_panics() {
        let mut samples = vec![
            encode_entry(&Entry::new(log_id(5, 3, 11), EntryPayload::Membership(membership()))),
            encode_entry(&Entry::new(log_id(1, 1, 1), EntryPayload::Blank)),
            encode_hard_state(&HardState { vote: Some(Vote::new(3, 1)), committed: Some(log_id(2, 1, 4)), purged: Some(log_id(1, 1, 2)) }),
        ];
        let meta = SnapshotMeta { last_log_id: None, last_membership: StoredMembership::new(Some(log_id(2, 1, 7)), membership()) };
        samples.push(encode_snapshot_head(&meta));
        let run = Run { first_index: 1, first_seq: 2, count: 3, leader: LeaderId::new(4, 5), bytes: 6 };
        samples.push(encode_layout(&Layout { next_log_seq: 9, runs: vec![run], retained: Some(vec![run]) }));
        samples.push(encode_layout(&Layout { next_log_seq: 9, runs: vec![run], retained: None }));
        samples.push(encode_retained(&RetainedChange { reset: true, added: vec![run], released: vec![7, 8] }));
        for sample in samples {
            for len in 0..sample.len() {
                let b = Bytes::copy_from_slice(&sample[..len]);
                let _ = decode_entry(&b);
                let _ = decode_entry_log_id(&b);
                let _ = decode_state(&b);
            }
            for i in 0..sample.len() {
                for v in [0u8, 1, 2, 0x7f, 0xff] {
                    let mut s = sample.clone();
                    s[i] = v;
                    let b = Bytes::from(s);
                    let _ = decode_entry(&b);
                    let _ = decode_state(&b);
                }
            }
        }
        assert!(matches!(decode_entry(&Bytes::from_static(&[2, 0])), Err(DecodeError::Version(2))));
        assert!(decode_entry(&Bytes::new()).is_err());
        // A count claiming more items than bytes remain is refused before anything is allocated.
        let mut huge = vec![VERSION, ENTRY_MEMBERSHIP];
        huge.extend_from_slice(&[0; 24]);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode_entry(&Bytes::from(huge)), Err(DecodeError::Truncated { .. })));
    }
}
