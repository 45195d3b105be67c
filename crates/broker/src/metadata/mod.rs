//! The durable topology (exchanges, queues, bindings of every vhost) in an append-only log,
//! `metadata.log` in the data directory (frame format and recovery in [`log`]).
//!
//! Each durable change is one frame holding a JSON array of [`Op`]s, applied whole or not at
//! all: a queue.delete that also auto-deletes an exchange is one frame. [`Metadata::commit`]
//! appends the frame and `fdatasync`s it before it returns; the vhost makes the change visible
//! (and the client gets its -ok) only after that, so a failed write changes nothing. The file is
//! compacted into the shortest log that builds the same state once the appends since the last
//! rewrite outgrow that state (and at least [`COMPACT_MIN_BYTES`]): each declare costs one
//! small append, and rewrites cost amortised O(1) per change.
//!
//! After a failed append the log is broken (what reached the disk is unknown); the next commit
//! first rewrites the whole file from the in-memory state, and fails if it cannot.
//!
//! A start with no `metadata.log` but a `definitions.json` (written by earlier versions) imports
//! it and renames it to `definitions.json.migrated`.

pub mod log;

use crate::definitions::{self, BindingDef, ExchangeDef, QueueDef, VHostDefs};
use log::{LogError, OnCorruption, RecordLog};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io;
use std::path::Path;

pub const FILE_NAME: &str = "metadata.log";
/// Appends since the last rewrite below this never trigger compaction.
pub const COMPACT_MIN_BYTES: u64 = 1 << 20;
const OPS_PER_SNAPSHOT_FRAME: usize = 512;

/// One change to the durable topology.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    ExchangeDeclared { vhost: String, exchange: ExchangeDef },
    /// Also removes the bindings from and to the exchange.
    ExchangeDeleted { vhost: String, name: String },
    QueueDeclared { vhost: String, queue: QueueDef },
    /// Also removes the bindings to the queue. What the store holds for `id` may then be dropped.
    QueueDeleted { vhost: String, name: String, id: u64 },
    Bound { vhost: String, binding: BindingDef },
    Unbound { vhost: String, binding: BindingDef },
    /// Queue ids below this have been used (written by compaction).
    NextQueueId { value: u64 },
}

#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("{path}: the record at byte offset {offset} has a valid checksum but cannot be read ({reason}); was it written by a newer Warren?")]
    Record { path: String, offset: u64, reason: String },
    #[error("cannot import {path}: {source}")]
    Legacy { path: String, source: io::Error },
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
}

/// The durable topology as the log describes it.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct State {
    vhosts: BTreeMap<String, VHostState>,
    /// Queues deleted since the last start (id -> vhost, declaration): the store's data for their
    /// ids (a priority queue has several, see `QueueDef::last_store_id`) may go.
    deleted: BTreeMap<u64, (String, QueueDef)>,
    next_queue_id: u64,
}

#[derive(Debug, Default, Clone, PartialEq)]
struct VHostState {
    exchanges: BTreeMap<String, ExchangeDef>,
    queues: BTreeMap<String, QueueDef>,
    bindings: BTreeMap<BindingKey, BindingDef>,
}

/// source, destination type, destination, routing key, arguments.
type BindingKey = (String, String, String, String, String);

fn binding_key(b: &BindingDef) -> BindingKey {
    (b.source.clone(), b.destination_type.clone(), b.destination.clone(), b.routing_key.clone(), b.arguments.to_string())
}

impl State {
    pub fn apply(&mut self, op: Op) {
        match op {
            Op::ExchangeDeclared { vhost, exchange } => {
                self.vhosts.entry(vhost).or_default().exchanges.insert(exchange.name.clone(), exchange);
            }
            Op::ExchangeDeleted { vhost, name } => {
                let v = self.vhosts.entry(vhost).or_default();
                v.exchanges.remove(&name);
                v.bindings.retain(|_, b| b.source != name && !(b.destination_type == "exchange" && b.destination == name));
            }
            Op::QueueDeclared { vhost, queue } => {
                // Saturating: a damaged record may hold any id, u64::MAX included. A priority queue uses
                // one store id per level after its own.
                self.next_queue_id = self.next_queue_id.max(queue.last_store_id().saturating_add(1));
                self.vhosts.entry(vhost).or_default().queues.insert(queue.name.clone(), queue);
            }
            Op::QueueDeleted { vhost, name, id } => {
                self.next_queue_id = self.next_queue_id.max(id.saturating_add(1));
                let v = self.vhosts.entry(vhost.clone()).or_default();
                let def = match v.queues.get(&name) {
                    Some(q) if q.id == id => {
                        v.bindings.retain(|_, b| !(b.destination_type == "queue" && b.destination == name));
                        v.queues.remove(&name)
                    }
                    _ => None,
                };
                let def = def.unwrap_or(QueueDef { name, id, auto_delete: false, arguments: serde_json::Value::Array(vec![]) });
                self.deleted.insert(id, (vhost, def));
            }
            Op::Bound { vhost, binding } => {
                self.vhosts.entry(vhost).or_default().bindings.insert(binding_key(&binding), binding);
            }
            Op::Unbound { vhost, binding } => {
                self.vhosts.entry(vhost).or_default().bindings.remove(&binding_key(&binding));
            }
            Op::NextQueueId { value } => self.next_queue_id = self.next_queue_id.max(value),
        }
    }

    /// The shortest list of changes that builds this state from nothing.
    pub fn snapshot_ops(&self) -> Vec<Op> {
        let mut ops = vec![Op::NextQueueId { value: self.next_queue_id }];
        // Declared then deleted, so that replaying keeps which store ids the deleted queue had.
        for (id, (vhost, def)) in &self.deleted {
            ops.push(Op::QueueDeclared { vhost: vhost.clone(), queue: def.clone() });
            ops.push(Op::QueueDeleted { vhost: vhost.clone(), name: def.name.clone(), id: *id });
        }
        for (vhost, v) in &self.vhosts {
            for e in v.exchanges.values() {
                ops.push(Op::ExchangeDeclared { vhost: vhost.clone(), exchange: e.clone() });
            }
            for q in v.queues.values() {
                ops.push(Op::QueueDeclared { vhost: vhost.clone(), queue: q.clone() });
            }
            for b in v.bindings.values() {
                ops.push(Op::Bound { vhost: vhost.clone(), binding: b.clone() });
            }
        }
        ops
    }

    fn snapshot_records(&self) -> io::Result<Vec<Vec<u8>>> {
        self.snapshot_ops().chunks(OPS_PER_SNAPSHOT_FRAME).map(|c| serde_json::to_vec(c).map_err(io::Error::other)).collect()
    }

    pub fn vhost_names(&self) -> Vec<String> {
        self.vhosts.iter().filter(|(_, v)| !v.is_empty()).map(|(n, _)| n.clone()).collect()
    }

    pub fn vhost(&self, name: &str) -> VHostDefs {
        let Some(v) = self.vhosts.get(name) else { return VHostDefs::default() };
        VHostDefs {
            exchanges: v.exchanges.values().cloned().collect(),
            queues: v.queues.values().cloned().collect(),
            bindings: v.bindings.values().cloned().collect(),
        }
    }
}

impl VHostState {
    fn is_empty(&self) -> bool {
        self.exchanges.is_empty() && self.queues.is_empty() && self.bindings.is_empty()
    }
}

struct Inner {
    log: RecordLog,
    state: State,
    /// The log's length right after its last rewrite (or at open).
    rewritten_len: u64,
}

pub struct Metadata {
    inner: Mutex<Inner>,
}

/// What opening found, for the startup log.
#[derive(Debug, Default)]
pub struct OpenReport {
    pub migrated_from: Option<String>,
    pub torn_tail_at: Option<u64>,
    pub skipped: Vec<(u64, u64)>,
}

impl Metadata {
    /// Opens `dir/metadata.log` (importing `dir/definitions.json` if there is no log yet).
    pub fn open(dir: &Path, on_corruption: OnCorruption) -> Result<(Metadata, OpenReport), MetadataError> {
        let path = dir.join(FILE_NAME);
        let legacy = dir.join(definitions::FILE_NAME);
        let mut report = OpenReport::default();
        let io_err = |source| MetadataError::Io { path: path.display().to_string(), source };
        if !path.exists() && legacy.exists() {
            // The whole import is written at once (new file, fsync, rename): a crash leaves no log
            // or a complete one, never a log missing what definitions.json held.
            let (next_queue_id, vhosts) =
                definitions::load_legacy(&legacy).map_err(|source| MetadataError::Legacy { path: legacy.display().to_string(), source })?;
            let mut state = State::default();
            state.apply(Op::NextQueueId { value: next_queue_id });
            for (vhost, defs) in vhosts {
                for op in ops_for_vhost(&vhost, defs) {
                    state.apply(op);
                }
            }
            RecordLog::create(&path, &state.snapshot_records().map_err(io_err)?).map_err(io_err)?;
            let done = dir.join(format!("{}.migrated", definitions::FILE_NAME));
            std::fs::rename(&legacy, &done).and_then(|()| log::sync_dir(&done)).map_err(io_err)?;
            tracing::info!(from = %legacy.display(), to = %path.display(), "imported the durable topology; the old file is kept as {}", done.display());
            report.migrated_from = Some(legacy.display().to_string());
        } else if legacy.exists() {
            tracing::warn!(file = %legacy.display(), "ignoring {}: {} holds the durable topology", definitions::FILE_NAME, FILE_NAME);
        }
        let (mut log, replayed) = RecordLog::open(&path, on_corruption)?;
        let mut state = State::default();
        for (offset, payload) in &replayed.records {
            let ops: Vec<Op> = serde_json::from_slice(payload).map_err(|e| MetadataError::Record {
                path: path.display().to_string(),
                offset: *offset,
                reason: e.to_string(),
            })?;
            for op in ops {
                state.apply(op);
            }
        }
        report.torn_tail_at = replayed.torn.as_ref().map(|(offset, _)| *offset);
        report.skipped = replayed.skipped.clone();
        // After skipping damage, or when churn made the log much larger than what it describes.
        let mut rewrite = !replayed.skipped.is_empty();
        if !rewrite && log.len() > COMPACT_MIN_BYTES {
            let records = state.snapshot_records().map_err(io_err)?;
            rewrite = log.len() > 2 * records.iter().map(|r| r.len() as u64 + 8).sum::<u64>();
        }
        if rewrite {
            log.rewrite(&state.snapshot_records().map_err(io_err)?).map_err(io_err)?;
        }
        let rewritten_len = log.len();
        Ok((Metadata { inner: Mutex::new(Inner { log, state, rewritten_len }) }, report))
    }

    /// Makes `ops` durable (one frame, appended and fsynced) and applies them. On error nothing
    /// is applied and the caller must not make the change.
    pub fn commit(&self, ops: Vec<Op>) -> io::Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let payload = serde_json::to_vec(&ops).map_err(io::Error::other)?;
        crate::blocking::run(|| {
            let mut inner = self.inner.lock();
            inner.repair_if_broken()?;
            inner.log.append(&payload)?;
            for op in ops {
                inner.state.apply(op);
            }
            inner.compact_if_due();
            Ok(())
        })
    }

    pub fn vhost_names(&self) -> Vec<String> {
        self.inner.lock().state.vhost_names()
    }

    pub fn vhost(&self, name: &str) -> VHostDefs {
        self.inner.lock().state.vhost(name)
    }

    /// Queue ids below this were used by durable queues.
    pub fn next_queue_id(&self) -> u64 {
        self.inner.lock().state.next_queue_id
    }

    /// Whether store queue `id` belonged to a deleted queue (so what the store holds for it may go).
    pub fn was_deleted(&self, id: u64) -> bool {
        let inner = self.inner.lock();
        // Deleted queues' id ranges do not overlap: the nearest start at or below `id` decides.
        inner.state.deleted.range(..=id).next_back().is_some_and(|(_, (_, def))| id <= def.last_store_id())
    }

    /// The store no longer holds anything for deleted queues: the next rewrite omits them.
    pub fn forget_deleted(&self) {
        self.inner.lock().state.deleted.clear();
    }

    /// Rewrites the log now (tests, and operators through a restart).
    pub fn compact(&self) -> io::Result<()> {
        crate::blocking::run(|| self.inner.lock().rewrite())
    }

    pub fn state(&self) -> State {
        self.inner.lock().state.clone()
    }

    pub fn log_len(&self) -> u64 {
        self.inner.lock().log.len()
    }
}

impl Inner {
    fn rewrite(&mut self) -> io::Result<()> {
        let records = self.state.snapshot_records()?;
        self.log.rewrite(&records)?;
        self.rewritten_len = self.log.len();
        Ok(())
    }

    fn repair_if_broken(&mut self) -> io::Result<()> {
        if !self.log.is_broken() {
            return Ok(());
        }
        self.rewrite().map_err(|e| io::Error::new(e.kind(), format!("rewriting the metadata log after an earlier failed write: {e}")))?;
        tracing::info!(file = %self.log.path().display(), "metadata log rewritten after an earlier failed write; durable changes work again");
        Ok(())
    }

    fn compact_if_due(&mut self) {
        let appended = self.log.len().saturating_sub(self.rewritten_len);
        if appended <= COMPACT_MIN_BYTES.max(self.rewritten_len) {
            return;
        }
        // A failed compaction leaves the current log in place and intact.
        if let Err(e) = self.rewrite() {
            tracing::warn!(file = %self.log.path().display(), error = %e, "metadata log compaction failed; will retry later");
            self.rewritten_len = self.log.len();
        }
    }
}

/// The changes that declare everything in `defs` (importing `definitions.json`).
fn ops_for_vhost(vhost: &str, defs: VHostDefs) -> Vec<Op> {
    let mut ops = Vec::new();
    for exchange in defs.exchanges {
        ops.push(Op::ExchangeDeclared { vhost: vhost.to_string(), exchange });
    }
    for queue in defs.queues {
        ops.push(Op::QueueDeclared { vhost: vhost.to_string(), queue });
    }
    for binding in defs.bindings {
        ops.push(Op::Bound { vhost: vhost.to_string(), binding });
    }
    ops
}

#[cfg(test)]
mod tests;
