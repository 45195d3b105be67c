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

pub mod auth;
pub mod group;
pub mod log;

use crate::auth::defs::{PermissionDef, SigningKeyDef, TopicPermissionDef, UserDef, VHostDef, VHostLimits};
use crate::definitions::{self, BindingDef, ExchangeDef, QueueDef, VHostDefs};
pub use auth::{AuthDefs, Refusal};
use group::{MetadataGroup, ProposeFailed};
use log::{LogError, OnCorruption, RecordLog};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

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
    /// A quorum queue's group has other members from now on (`warren ctl remove-node`, `grow`):
    /// the group's leader moves its voters to them (`QuorumHost::members_changed`).
    QueueMembers { vhost: String, name: String, id: u64, members: Vec<u64> },
    Bound { vhost: String, binding: BindingDef },
    Unbound { vhost: String, binding: BindingDef },
    /// Queue ids below this have been used (written by compaction).
    NextQueueId { value: u64 },
    /// Cluster only: the state includes every entry of the metadata group up to `index`
    /// (written with each applied entry and by compaction; see [`group`]).
    GroupApplied { index: u64 },
    // ---- vhosts, users, permissions (`auth`) ----
    /// Creates the vhost, or sets its description and tags.
    VhostDeclared { vhost: VHostDef },
    /// Deletes the vhost with everything in it: its queues (what the store holds for them may
    /// go), exchanges, bindings, limits, and every permission on it.
    VhostDeleted { name: String },
    VhostLimitsSet { vhost: String, limits: VHostLimits },
    /// Creates or replaces a user.
    UserPut { user: UserDef },
    /// Also removes the user's permissions, topic permissions and signing keys.
    UserDeleted { name: String },
    PermissionSet { permission: PermissionDef },
    PermissionCleared { user: String, vhost: String },
    TopicPermissionSet { permission: TopicPermissionDef },
    TopicPermissionCleared { user: String, vhost: String, exchange: String },
    SigningKeySet { key: SigningKeyDef },
    /// The first start's bootstrap (default user, vhost, permission) is recorded: from now on only
    /// recorded users log in, and the configured default user is not applied again. An entry
    /// holding it is dropped whole once the state has it (two nodes bootstrapping together).
    AuthInitialized,
}

impl Op {
    /// The vhost the change is in (none for the bookkeeping ops).
    pub fn vhost(&self) -> Option<&str> {
        match self {
            Op::ExchangeDeclared { vhost, .. }
            | Op::ExchangeDeleted { vhost, .. }
            | Op::QueueDeclared { vhost, .. }
            | Op::QueueDeleted { vhost, .. }
            | Op::QueueMembers { vhost, .. }
            | Op::Bound { vhost, .. }
            | Op::Unbound { vhost, .. } => Some(vhost),
            // Bookkeeping, and the broker's own (`is_auth`): vhosts themselves, users, permissions.
            _ => None,
        }
    }

    /// Whether it changes vhosts, users or permissions (`Broker::apply_committed` rebuilds its
    /// view of them after such an op).
    pub fn is_auth(&self) -> bool {
        matches!(
            self,
            Op::VhostDeclared { .. }
                | Op::VhostDeleted { .. }
                | Op::VhostLimitsSet { .. }
                | Op::UserPut { .. }
                | Op::UserDeleted { .. }
                | Op::PermissionSet { .. }
                | Op::PermissionCleared { .. }
                | Op::TopicPermissionSet { .. }
                | Op::TopicPermissionCleared { .. }
                | Op::SigningKeySet { .. }
                | Op::AuthInitialized
        )
    }

    /// A declaration in a vhost (refused once the vhost is deleted).
    fn declares_in(&self) -> Option<&str> {
        match self {
            Op::ExchangeDeclared { vhost, .. } | Op::QueueDeclared { vhost, .. } | Op::Bound { vhost, .. } => Some(vhost),
            _ => None,
        }
    }
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
    /// Cluster only: the last metadata-group entry applied.
    group_applied: Option<u64>,
    /// Users, permissions, signing keys.
    pub auth: AuthDefs,
}

#[derive(Debug, Default, Clone, PartialEq)]
struct VHostState {
    /// Created explicitly (by the bootstrap, the management API, an import). A vhost recorded
    /// before vhosts were (only through what is in it) has none until the bootstrap declares it.
    declared: Option<VHostDef>,
    limits: VHostLimits,
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
                let def = def.unwrap_or(QueueDef { name, id, auto_delete: false, arguments: serde_json::Value::Array(vec![]), home: None, members: None, leader: None, members_changed: false, transient: None });
                self.deleted.insert(id, (vhost, def));
            }
            Op::QueueMembers { vhost, name, id, members } => {
                if let Some(q) = self.vhosts.get_mut(&vhost).and_then(|v| v.queues.get_mut(&name)).filter(|q| q.id == id) {
                    q.members = Some(members);
                    q.members_changed = true;
                }
            }
            Op::Bound { vhost, binding } => {
                self.vhosts.entry(vhost).or_default().bindings.insert(binding_key(&binding), binding);
            }
            Op::Unbound { vhost, binding } => {
                self.vhosts.entry(vhost).or_default().bindings.remove(&binding_key(&binding));
            }
            Op::NextQueueId { value } => self.next_queue_id = self.next_queue_id.max(value),
            Op::GroupApplied { index } => self.group_applied = Some(self.group_applied.unwrap_or(0).max(index)),
            Op::VhostDeclared { vhost } => {
                let name = vhost.name.clone();
                self.vhosts.entry(name).or_default().declared = Some(vhost);
            }
            Op::VhostDeleted { ref name } => {
                if let Some(v) = self.vhosts.remove(name) {
                    for (_, q) in v.queues {
                        self.next_queue_id = self.next_queue_id.max(q.last_store_id().saturating_add(1));
                        self.deleted.insert(q.id, (name.clone(), q));
                    }
                }
                self.auth.apply(&op);
            }
            Op::VhostLimitsSet { vhost, limits } => {
                if let Some(v) = self.vhosts.get_mut(&vhost) {
                    v.limits = limits;
                }
            }
            auth => self.auth.apply(&auth),
        }
    }

    /// Admits a metadata-group entry's ops: drops the declaration of a queue or exchange that
    /// exists already (nodes declaring the same name concurrently each propose one: the first in
    /// log order wins, as it does in every node's in-memory topology, `VHost::apply_committed`),
    /// and gives each new queue (id 0) its id: the next unused one, as every node applying the
    /// same entries to the same state finds it. Without the drop, a later duplicate replaced the
    /// first's id in this state only: after a restart the queue came back under that other id
    /// (another Raft group, another store queue), and its messages were kept aside: lost.
    /// A dropped declaration with other properties than the existing one is a conflict: its
    /// proposer answers 406 (inequivalent arg), as RabbitMQ answers the second of two such.
    fn admit(&self, ops: Vec<Op>) -> AppliedEntry {
        // Declared (Some) or deleted (None) by the ops before, in this entry.
        let mut queues: HashMap<(String, String), Option<QueueDef>> = HashMap::new();
        let mut exchanges: HashMap<(String, String), Option<ExchangeDef>> = HashMap::new();
        let mut next = self.next_queue_id.max(1);
        let mut admitted = AppliedEntry { ops: Vec::with_capacity(ops.len()), conflict: false, refused: None };
        if self.auth.initialized && ops.iter().any(|op| matches!(op, Op::AuthInitialized)) {
            // A second bootstrap (another node's, proposed before it saw the first): nothing to do.
            return admitted;
        }
        let mut pending = auth::Pending::default();
        for mut op in ops {
            let refusal = match op.declares_in() {
                // Declarations need their vhost once vhosts are recorded (one deleted a moment ago).
                Some(vhost) if self.auth.initialized && !pending.vhost_exists(self, vhost) => Some(Refusal::not_found(format!("no vhost '{vhost}'"))),
                Some(_) => None,
                None => pending.check(self, &op),
            };
            if let Some(refusal) = refusal {
                return AppliedEntry { ops: Vec::new(), conflict: false, refused: Some(refusal) };
            }
            match &mut op {
                Op::QueueDeclared { vhost, queue } => {
                    let key = (vhost.clone(), queue.name.clone());
                    let existing = match queues.get(&key) {
                        Some(declared) => declared.clone(),
                        None => self.queue(vhost, &queue.name).cloned(),
                    };
                    if let Some(existing) = existing {
                        // The id is the existing one's, or 0 (assigned here).
                        // A transient queue is another node's, or another connection's if exclusive.
                        admitted.conflict |= existing.auto_delete != queue.auto_delete
                            || existing.arguments != queue.arguments
                            || existing.transient != queue.transient;
                        continue;
                    }
                    if queue.id == 0 {
                        queue.id = next;
                    }
                    next = next.max(queue.last_store_id().saturating_add(1));
                    queues.insert(key, Some(queue.clone()));
                }
                Op::QueueDeleted { vhost, name, id } => {
                    next = next.max(id.saturating_add(1));
                    let key = (vhost.clone(), name.clone());
                    // `apply` removes the queue only if the id is its current one.
                    let current = match queues.get(&key) {
                        Some(declared) => declared.as_ref().map(|q| q.id),
                        None => self.queue(vhost, name).map(|q| q.id),
                    };
                    if current == Some(*id) {
                        queues.insert(key, None);
                    }
                }
                Op::ExchangeDeclared { vhost, exchange } => {
                    let key = (vhost.clone(), exchange.name.clone());
                    let existing = match exchanges.get(&key) {
                        Some(declared) => declared.clone(),
                        None => self.exchange(vhost, &exchange.name).cloned(),
                    };
                    if let Some(existing) = existing {
                        admitted.conflict |= existing != *exchange;
                        continue;
                    }
                    exchanges.insert(key, Some(exchange.clone()));
                }
                Op::ExchangeDeleted { vhost, name } => {
                    exchanges.insert((vhost.clone(), name.clone()), None);
                }
                Op::NextQueueId { value } => next = next.max(*value),
                _ => {}
            }
            admitted.ops.push(op);
        }
        admitted
    }

    /// The last metadata-group entry this state includes (cluster only).
    pub fn group_applied(&self) -> Option<u64> {
        self.group_applied
    }

    /// Whether `name` was created as a vhost (and not deleted since).
    pub fn vhost_declared(&self, name: &str) -> bool {
        self.vhosts.get(name).is_some_and(|v| v.declared.is_some())
    }

    /// The declared vhosts, sorted by name, with their limits.
    pub fn declared_vhosts(&self) -> Vec<(VHostDef, VHostLimits)> {
        self.vhosts.values().filter_map(|v| v.declared.clone().map(|d| (d, v.limits.clone()))).collect()
    }

    /// The queue named `name` in `vhost`, if durable.
    pub fn queue(&self, vhost: &str, name: &str) -> Option<&QueueDef> {
        self.vhosts.get(vhost)?.queues.get(name)
    }

    /// The exchange named `name` in `vhost`, if durable.
    pub fn exchange(&self, vhost: &str, name: &str) -> Option<&ExchangeDef> {
        self.vhosts.get(vhost)?.exchanges.get(name)
    }

    /// The shortest list of changes that builds this state from nothing.
    pub fn snapshot_ops(&self) -> Vec<Op> {
        let mut ops = vec![Op::NextQueueId { value: self.next_queue_id }];
        if let Some(index) = self.group_applied {
            ops.push(Op::GroupApplied { index });
        }
        // Vhosts and users before what refers to them.
        for v in self.vhosts.values() {
            if let Some(def) = &v.declared {
                ops.push(Op::VhostDeclared { vhost: def.clone() });
                if v.limits != VHostLimits::default() {
                    ops.push(Op::VhostLimitsSet { vhost: def.name.clone(), limits: v.limits.clone() });
                }
            }
        }
        self.auth.snapshot_ops(&mut ops);
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
        self.vhosts.iter().filter(|(_, v)| v.declared.is_some() || !v.is_empty()).map(|(n, _)| n.clone()).collect()
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
    /// Set when the node is part of a cluster: durable changes go through the metadata group.
    group: RwLock<Option<Arc<dyn MetadataGroup>>>,
    /// The last metadata-group entry applied here (0: none), for proposers waiting for their own.
    applied: tokio::sync::watch::Sender<u64>,
    /// When a barrier last failed (no quorum): lookups do not wait again for `BARRIER_BACKOFF`.
    barrier_failed: Mutex<Option<Instant>>,
    /// The barriers callers share (`catch_up`).
    barriers: Mutex<Barriers>,
    barrier_done: parking_lot::Condvar,
}

/// Which barriers started and finished (`Metadata::catch_up`).
#[derive(Default)]
struct Barriers {
    running: bool,
    /// Barriers started, and finished, so far.
    started: u64,
    finished: u64,
    /// Whether the last finished one was applied here.
    last_ok: bool,
}

/// Why a replicated change failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupCommitError {
    /// Nothing changed, on any node.
    NotCommitted(String),
    /// It may have been (or will be) applied: the outcome is unknown to this node.
    Unknown(String),
    /// Applied, but a declaration in it was dropped: another node had declared the name first
    /// (earlier in the group's log), with other properties. It exists here now.
    Conflict,
    /// Nothing changed: the change names a user or vhost that does not exist (as the state was
    /// when it came, in log order).
    Refused(Refusal),
}

/// A metadata-group entry as applied to the durable state (see `State::admit`).
#[derive(Debug, Clone, PartialEq)]
pub struct AppliedEntry {
    /// The ops as applied: re-declarations dropped, new queues' ids assigned.
    pub ops: Vec<Op>,
    /// A declaration was dropped as it names an existing queue or exchange with other properties.
    pub conflict: bool,
    /// The entry was refused whole (`ops` is empty): it names a user or vhost that does not exist.
    pub refused: Option<Refusal>,
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
        Metadata::open_on(dir, on_corruption, &warren_store::Disk::real())
    }

    /// [`Metadata::open`] with the log's writes going through `disk` (a simulated one in tests).
    pub fn open_on(dir: &Path, on_corruption: OnCorruption, disk: &warren_store::Disk) -> Result<(Metadata, OpenReport), MetadataError> {
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
            RecordLog::create(disk, &path, &state.snapshot_records().map_err(io_err)?).map_err(io_err)?;
            let done = dir.join(format!("{}.migrated", definitions::FILE_NAME));
            disk.rename_file(&legacy, &done).and_then(|()| log::sync_dir(disk, &done)).map_err(io_err)?;
            tracing::info!(from = %legacy.display(), to = %path.display(), "imported the durable topology; the old file is kept as {}", done.display());
            report.migrated_from = Some(legacy.display().to_string());
        } else if legacy.exists() {
            tracing::warn!(file = %legacy.display(), "ignoring {}: {} holds the durable topology", definitions::FILE_NAME, FILE_NAME);
        }
        let (mut log, replayed) = RecordLog::open(disk, &path, on_corruption)?;
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
        let applied = tokio::sync::watch::Sender::new(state.group_applied.unwrap_or(0));
        let metadata = Metadata {
            inner: Mutex::new(Inner { log, state, rewritten_len }),
            group: RwLock::new(None),
            applied,
            barrier_failed: Mutex::new(None),
            barriers: Mutex::new(Barriers::default()),
            barrier_done: parking_lot::Condvar::new(),
        };
        Ok((metadata, report))
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
            let state = &inner.state;
            if let Some(vhost) = ops.iter().filter_map(Op::declares_in).find(|v| state.auth.initialized && !state.vhost_declared(v)) {
                // Deleted while the declaration was on its way (its connection is being closed).
                return Err(io::Error::other(format!("vhost '{vhost}' was deleted")));
            }
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

    /// Standalone: checks `ops` against the state as a metadata-group entry is (`State::admit`:
    /// a permission for a missing user is refused, a second bootstrap dropped), then makes what is
    /// admitted durable and applies it. Returns what was applied, for the in-memory changes.
    pub fn commit_admitted(&self, ops: Vec<Op>) -> io::Result<AppliedEntry> {
        crate::blocking::run(|| {
            let mut inner = self.inner.lock();
            let admitted = inner.state.admit(ops);
            if admitted.ops.is_empty() {
                return Ok(admitted);
            }
            let payload = serde_json::to_vec(&admitted.ops).map_err(io::Error::other)?;
            inner.repair_if_broken()?;
            inner.log.append(&payload)?;
            for op in admitted.ops.iter().cloned() {
                inner.state.apply(op);
            }
            inner.compact_if_due();
            Ok(admitted)
        })
    }

    /// The limits of vhost `name` (none if it has none, or does not exist).
    pub fn vhost_limits(&self, name: &str) -> VHostLimits {
        self.inner.lock().state.vhosts.get(name).map(|v| v.limits.clone()).unwrap_or_default()
    }

    /// Whether vhost `name` was deleted (vhosts are recorded and it is not declared).
    pub fn vhost_deleted(&self, name: &str) -> bool {
        let inner = self.inner.lock();
        inner.state.auth.initialized && !inner.state.vhost_declared(name)
    }

    /// The declared vhosts, sorted by name, with their limits.
    pub fn declared_vhosts(&self) -> Vec<(VHostDef, VHostLimits)> {
        self.inner.lock().state.declared_vhosts()
    }

    /// The recorded users, permissions and signing keys, and the declared vhosts.
    pub fn auth(&self) -> (AuthDefs, Vec<(VHostDef, VHostLimits)>) {
        let inner = self.inner.lock();
        (inner.state.auth.clone(), inner.state.declared_vhosts())
    }

    // ---- the cluster's metadata group (see `group`) --------------------------------------

    /// From now on durable changes go through `group` (set by the server before it serves).
    pub fn set_group(&self, group: Arc<dyn MetadataGroup>) {
        *self.group.write() = Some(group);
    }

    pub fn is_replicated(&self) -> bool {
        self.group.read().is_some()
    }

    /// The last metadata-group entry applied on this node.
    pub fn group_applied(&self) -> u64 {
        *self.applied.borrow()
    }

    /// Proposes `ops` to the metadata group and returns once this node has applied them (by
    /// [`Metadata::apply_group_entry`], called by the group's state machine). Blocks the caller.
    pub fn commit_replicated(&self, ops: &[Op]) -> Result<(), GroupCommitError> {
        let Some(group) = self.group.read().clone() else {
            return Err(GroupCommitError::NotCommitted("this node is not in a cluster".to_string()));
        };
        let deadline = Instant::now() + group::COMMIT_TIMEOUT;
        let proposed = group.propose(group::encode_entry(ops), group::COMMIT_TIMEOUT);
        let committed = match group::block_on(proposed).map_err(GroupCommitError::NotCommitted)? {
            Ok(committed) => committed,
            Err(ProposeFailed::NotCommitted(e)) => return Err(GroupCommitError::NotCommitted(e)),
            Err(ProposeFailed::Unknown(e)) => return Err(GroupCommitError::Unknown(e)),
        };
        let index = committed.index;
        self.wait_applied(index, deadline).map_err(|e| GroupCommitError::Unknown(format!("committed as entry {index}, but {e}")))?;
        match group::block_on(group.wait_applied_elsewhere(index, group::SPREAD_TIMEOUT)) {
            Ok(lagging) if lagging.is_empty() => {}
            Ok(lagging) => tracing::warn!(index, nodes = ?lagging, "reachable nodes had not applied a metadata change within {:?}; \
                answering the client anyway (they will, and a miss on them waits for a barrier)", group::SPREAD_TIMEOUT),
            Err(e) => tracing::warn!(index, error = %e, "could not wait for the other nodes to apply a metadata change"),
        }
        if let Some(refusal) = committed.refused {
            return Err(GroupCommitError::Refused(refusal));
        }
        if committed.conflict {
            return Err(GroupCommitError::Conflict);
        }
        Ok(())
    }

    /// Whether this node has applied entry `index`, waiting for it at most `timeout` (another
    /// node's declaration waits for it: `Request::Applied`).
    pub async fn applied_at_least(&self, index: u64, timeout: std::time::Duration) -> bool {
        let mut rx = self.applied.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|a| *a >= index)).await.is_ok_and(|r| r.is_ok())
    }

    /// Waits until this node has applied entry `index`.
    fn wait_applied(&self, index: u64, deadline: Instant) -> Result<(), String> {
        if self.group_applied() >= index {
            return Ok(());
        }
        let mut rx = self.applied.subscribe();
        let wait = Box::pin(async move { tokio::time::timeout(group::left(deadline), rx.wait_for(|a| *a >= index)).await.map(|_| ()) });
        match group::block_on(wait)? {
            Ok(()) => Ok(()),
            Err(_) => Err(format!("this node had not applied it within {:?} (it has applied up to {})", group::COMMIT_TIMEOUT, self.group_applied())),
        }
    }

    /// Before answering that something does not exist: waits until this node has applied
    /// everything the metadata group had committed (an empty entry's round trip). True if it
    /// waited (the caller looks again); false if not in a cluster or the group did not answer
    /// in time (the caller answers from what it knows).
    ///
    /// Concurrent callers share barriers: one runs at a time, and a caller takes the result of
    /// the first that *starts* after it came (one that started before may have missed what the
    /// caller must see), so a burst of misses costs two read barriers, not one each. A read
    /// barrier writes nothing to the group's log (`MetadataGroup::read_barrier`).
    pub fn catch_up(&self) -> bool {
        let Some(group) = self.group.read().clone() else { return false };
        if self.barrier_failed.lock().is_some_and(|t| t.elapsed() < group::BARRIER_BACKOFF) {
            return false;
        }
        crate::blocking::run(|| {
            let mut b = self.barriers.lock();
            let needed = b.started + 1;
            loop {
                if b.finished >= needed {
                    return b.last_ok;
                }
                if !b.running {
                    b.running = true;
                    b.started += 1;
                    let this = b.started;
                    drop(b);
                    let ok = self.run_barrier(&group);
                    b = self.barriers.lock();
                    b.running = false;
                    b.finished = this;
                    b.last_ok = ok;
                    self.barrier_done.notify_all();
                    continue;
                }
                // A waiter whose barrier's runner is stuck gives up with the group's timeout.
                if self.barrier_done.wait_for(&mut b, group::BARRIER_TIMEOUT + group::BARRIER_TIMEOUT).timed_out() {
                    return false;
                }
            }
        })
    }

    /// One barrier: the leader's read index applied here (or, where the group has none, an empty
    /// entry committed and applied here).
    fn run_barrier(&self, group: &Arc<dyn MetadataGroup>) -> bool {
        let deadline = Instant::now() + group::BARRIER_TIMEOUT;
        let result = match group.read_barrier(group::BARRIER_TIMEOUT) {
            Some(read) => group::block_on(read).and_then(|r| r),
            None => match group::block_on(group.propose(group::encode_entry(&[]), group::BARRIER_TIMEOUT)) {
                Ok(Ok(committed)) => self.wait_applied(committed.index, deadline),
                Ok(Err(ProposeFailed::NotCommitted(e) | ProposeFailed::Unknown(e))) | Err(e) => Err(e),
            },
        };
        match result {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "the metadata group did not answer a read barrier; answering from this node's topology");
                *self.barrier_failed.lock() = Some(Instant::now());
                false
            }
        }
    }

    /// Applies metadata-group entry `index` to the durable state: drops re-declarations, assigns new queues their ids,
    /// writes the ops (with the index) to the log, and returns them for the in-memory topology.
    /// None: this node had already applied it (a replay after a restart). Retries a failing disk
    /// (the group cannot skip an entry): the node's metadata waits until the write succeeds.
    pub fn apply_group_entry(&self, index: u64, ops: Vec<Op>) -> Option<AppliedEntry> {
        let mut inner = self.inner.lock();
        if inner.state.group_applied.is_some_and(|a| a >= index) {
            return None;
        }
        let applied = inner.state.admit(ops);
        let ops = &applied.ops;
        if !ops.is_empty() {
            let mut record = ops.clone();
            record.push(Op::GroupApplied { index });
            let payload = serde_json::to_vec(&record).unwrap_or_default();
            // Off the runtime's workers: the fsync, and the waits between retries.
            crate::blocking::run(|| {
                let mut delay = std::time::Duration::from_millis(10);
                while let Err(e) = inner.repair_if_broken().and_then(|()| inner.log.append(&payload)) {
                    tracing::error!(error = %e, index, "could not write a metadata-group entry to the metadata log; retrying");
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(std::time::Duration::from_secs(1));
                }
            });
            for op in ops.iter().cloned() {
                inner.state.apply(op);
            }
        }
        inner.state.apply(Op::GroupApplied { index });
        if !ops.is_empty() {
            inner.compact_if_due();
        }
        Some(applied)
    }

    /// Marks entry `index` applied here (after its in-memory changes are made): proposers
    /// waiting for it go on.
    pub fn group_entry_done(&self, index: u64) {
        self.applied.send_if_modified(|a| {
            let newer = index > *a;
            if newer {
                *a = index;
            }
            newer
        });
    }

    /// The state as a metadata-group snapshot (see `group::encode_snapshot`).
    pub fn group_snapshot(&self) -> bytes::Bytes {
        let inner = self.inner.lock();
        group::encode_snapshot(inner.state.group_applied.unwrap_or(0), inner.state.snapshot_ops())
    }

    /// Replaces the state by a metadata-group snapshot taken at entry `index`, and rewrites the
    /// log. None: this node's state already includes that entry (its log is newer), nothing done.
    pub fn restore_group_snapshot(&self, index: u64, ops: Vec<Op>) -> io::Result<Option<State>> {
        let mut inner = self.inner.lock();
        if inner.state.group_applied.is_some_and(|a| a >= index) {
            return Ok(None);
        }
        let mut state = State::default();
        for op in ops {
            state.apply(op);
        }
        state.apply(Op::GroupApplied { index });
        // Ids of queues deleted here before the snapshot stay known, so their data may still go.
        let deleted = std::mem::take(&mut inner.state.deleted);
        let old = std::mem::replace(&mut inner.state, state);
        for (id, entry) in deleted {
            inner.state.deleted.entry(id).or_insert(entry);
        }
        if let Err(e) = crate::blocking::run(|| inner.rewrite()) {
            inner.state = old;
            return Err(e);
        }
        Ok(Some(inner.state.clone()))
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
