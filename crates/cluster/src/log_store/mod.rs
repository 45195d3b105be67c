//! The Raft log of every group on a node, kept in the node's write-ahead log (`warren_store::Store`),
//! so one write and one fsync per batch covers every group and every classic queue.
//!
//! Layout (the contract in docs/internals/cluster.md, "The Raft log in the WAL"):
//! - group `g`'s entries are the records of store queue [`RAFT_LOG`]` | g`, one entry per record in
//!   [`codec`](crate::codec)'s encoding, in append order. The store seq is a counter of the group's
//!   appends, not the Raft index: a truncation acks the removed entries' records and the indexes are
//!   appended again under new seqs. A purge acks the records up to the purged index, except those
//!   of entries the state machine pinned ([`Group::pin`]: they hold the bodies of live messages,
//!   which are written nowhere else): those are *retained*, readable by index
//!   ([`Group::read_entry`]) until unpinned. Openraft sees them purged.
//! - group `g`'s hard state (vote, committed and purged log ids), its latest snapshot and its
//!   layout (where the entries are: runs of consecutive indexes and seqs) are records of store
//!   queue [`RAFT_STATE`]` | g`: each record acks the record of its kind before it, in the same
//!   batch. A layout goes with every `layout_every`th appended entry (after them) and with every
//!   truncation and purge (before their acks). The retained entries are named by records of the
//!   same queue, one per change (a purge's kept runs, an unpin's index) until the changes outweigh
//!   the whole set, which is then written as one reset record: an unpin costs the same bytes however
//!   many entries are retained.
//!
//! In memory, per group: for each unpurged entry its store seq and log id (the index is its place),
//! the entries appended but not yet readable from the store (see [`Store::readable`]) or not yet
//! applied by this node (within a budget, see [`cache`]), the hard state and the stored snapshot's
//! metadata. Other entries are read back from the store.
//!
//! Recovery ([`RaftLogs::open`]) reads each group's state records (the latest of each kind wins;
//! retained changes apply from the latest reset on), takes the entries the layout and the retained
//! set name without reading them, and reads the entry records appended
//! after it: a record whose index is at or below one before it replaces it and
//! everything after it (a truncation whose acks a crash lost). Records at or below the purged
//! index are retained (the layout names those a purge kept; others are ones whose ack a crash
//! lost) until the state machine, restored, has pinned what it reads: [`Group::release_unpinned`]
//! acks the rest. Stale and superseded records are acked again.
//!
//! ### To ensure correctness
//! - A group's records are appended under its lock, so its seqs rise in append order; the WAL is one
//!   ordered stream, so a record's durability implies every earlier record's, of every group. That is
//!   why a durable vote covers the appends before it (openraft#2118: `become_leader` marks the tail
//!   flushed without I/O) and why a truncation's acks are durable before anything appended after it.
//! - `IOFlushed` fires only once the durable watermark has passed the append's ticket;
//!   `save_vote` and snapshots return only once their record is durable.

mod cache;
mod compaction;
mod flush;
mod storage;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::io;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use warren_store::{Batch, RecoveredQueue, Store, StoreError, SyncTicket};

use crate::codec::{self, DecodeError, HardState, Layout, LeaderId, RetainedChange, Run, SnapshotMeta, StateRecord};
use crate::types::{Entry, GroupId, LogId, Vote};
use cache::{CacheBudget, EntryCache};
use compaction::CompactionState;
use flush::Flusher;

pub use compaction::Compaction;
pub use storage::LogStore;
pub use warren_store::{RAFT_LOG_QUEUES as RAFT_LOG, RAFT_STATE_QUEUES as RAFT_STATE};

/// Group ids are below this (they are classic-queue-like ids; the bits above are the kinds).
pub const GROUP_ID_LIMIT: GroupId = RAFT_STATE;

/// Reads of entries from the store ask for at most this many payload bytes at once.
const READ_CHUNK_BYTES: usize = 4 << 20;
/// What a log record holds besides its payload (the store's record header and enqueue fields), so
/// that a read of one record asks for all of it.
const RECORD_OVERHEAD: usize = warren_store::format::RECORD_HEADER_SIZE + warren_store::format::ENQUEUE_FIXED_LEN;

/// How long a read of a retained entry waits for the store to make its record readable.
const READABLE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// What opening the logs can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LogStoreError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("group {group}: record {seq} of store queue {queue:#x} does not decode: {error}")]
    Corrupt { group: GroupId, queue: u64, seq: u64, error: DecodeError },
    #[error("group id {0} is not below {GROUP_ID_LIMIT}")]
    GroupId(GroupId),
}

/// The Raft logs of every group on the node, over the node's store. Cheap to share (`Arc`).
pub struct RaftLogs {
    shared: Arc<Shared>,
    groups: Mutex<HashMap<GroupId, Arc<Group>>>,
    recovered: RecoveryStats,
}

/// Settings of the node's Raft logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogsOptions {
    /// A group writes a layout record (where its entries are) after this many appended entries, and
    /// at every truncation and purge: a start reads at most about this many entry records per group.
    pub layout_every: u64,
}

impl Default for LogsOptions {
    fn default() -> Self {
        LogsOptions { layout_every: 256 }
    }
}

/// What [`RaftLogs::open`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecoveryStats {
    pub groups: u64,
    /// Unpurged entries, in all groups.
    pub entries: u64,
    /// Purged entries whose records were kept (see [`GroupInner::purge`]), in all groups.
    pub retained: u64,
    /// Entry records read (the others are known from the groups' layout records).
    pub records_read: u64,
}

/// What every group's handles share: the store and the durability waiters.
pub(crate) struct Shared {
    pub store: Store,
    pub flusher: Arc<Flusher>,
    pub options: LogsOptions,
    /// The bytes of entries every group of the node keeps in memory.
    cache_budget: Arc<CacheBudget>,
}

impl Shared {
    /// Waits until `ticket` is durable.
    pub async fn durable(&self, ticket: SyncTicket) -> io::Result<()> {
        if self.flusher.durable_now() >= ticket {
            return Ok(());
        }
        let mut rx = self.store.durable();
        rx.wait_for(|d| *d >= ticket).await.map(|_| ()).map_err(|_| io::Error::other("the message store is closed"))
    }

    /// Waits until what `ticket` appended is visible to `Store::read`.
    pub async fn readable(&self, ticket: SyncTicket) -> io::Result<()> {
        if self.store.is_readable(ticket) {
            return Ok(());
        }
        let mut rx = self.store.readable();
        rx.wait_for(|d| *d >= ticket).await.map(|_| ()).map_err(|_| io::Error::other("the message store is closed"))
    }
}

impl RaftLogs {
    /// Rebuilds every group's log from what the store recovered (`Recovery::queues`; queues that are
    /// not Raft logs are skipped). Reads each group's live records once: bounded by the snapshot
    /// policy, since a snapshot lets the log before it be purged.
    pub fn open(store: Store, recovered: &[RecoveredQueue]) -> Result<Arc<RaftLogs>, LogStoreError> {
        RaftLogs::open_with(store, recovered, LogsOptions::default())
    }

    /// [`RaftLogs::open`], except for the groups with records among `lost_queues` (store queues
    /// whose files recovery found missing or cut short: `warren_store::Recovery::lost`). A log with
    /// a hole cannot answer for what this node acknowledged: each such group's log and state are
    /// deleted from the store, unread, so that it starts empty, as a new member, to be rebuilt from
    /// the other members (`ClusterNode::rebuild_group`). Returns the logs and those groups, once
    /// the deletions are applied.
    pub fn open_discarding_damaged(store: Store, recovered: &[RecoveredQueue], lost_queues: &[u64]) -> Result<(Arc<RaftLogs>, Vec<GroupId>), LogStoreError> {
        let group_of = |q: u64| q & !(RAFT_LOG | RAFT_STATE);
        let mut damaged: Vec<GroupId> =
            lost_queues.iter().copied().filter(|q| warren_store::is_raft_queue(*q)).map(group_of).filter(|g| *g < GROUP_ID_LIMIT).collect();
        damaged.sort_unstable();
        damaged.dedup();
        let intact: Vec<RecoveredQueue> = recovered
            .iter()
            .filter(|r| !warren_store::is_raft_queue(r.queue) || damaged.binary_search(&group_of(r.queue)).is_err())
            .cloned()
            .collect();
        let logs = RaftLogs::open(store, &intact)?;
        for &group in &damaged {
            let ticket = logs.remove_group(group)?;
            // The fresh log reads its own records back by seq: the old ones must be gone first.
            logs.shared.store.wait_durable(ticket)?;
            if !logs.shared.store.wait_readable(ticket, std::time::Duration::from_secs(30)) {
                return Err(LogStoreError::Store(StoreError::Closed));
            }
            tracing::error!(group, "this node lost part of the group's stored log: it starts the group empty and rebuilds it from the other members");
        }
        Ok((logs, damaged))
    }

    /// [`RaftLogs::open`] with settings.
    pub fn open_with(store: Store, recovered: &[RecoveredQueue], options: LogsOptions) -> Result<Arc<RaftLogs>, LogStoreError> {
        let shared = Arc::new(Shared { flusher: Flusher::new(store.durable()), store, options, cache_budget: Arc::default() });
        let mut stats = RecoveryStats::default();
        let mut groups: HashMap<GroupId, (Option<&RecoveredQueue>, Option<&RecoveredQueue>)> = HashMap::new();
        for rec in recovered.iter().filter(|r| warren_store::is_raft_queue(r.queue)) {
            if rec.queue & RAFT_LOG != 0 {
                groups.entry(rec.queue & !RAFT_LOG).or_default().0 = Some(rec);
            } else {
                groups.entry(rec.queue & !RAFT_STATE).or_default().1 = Some(rec);
            }
        }
        let mut map = HashMap::new();
        let mut cleanup = Batch::new();
        for (id, (log, state)) in groups {
            if id >= GROUP_ID_LIMIT {
                // Both bits set: not a queue this module writes. Leave it alone.
                tracing::error!(queue = id, "a store queue with both Raft bits set; ignored");
                continue;
            }
            let group = Group::recover(&shared.store, shared.cache_budget.clone(), id, log, state, &mut cleanup, &mut stats)?;
            map.insert(id, Arc::new(group));
        }
        if !cleanup.is_empty() {
            // Not waited for: redoing it after another crash is harmless.
            shared.store.append(&mut cleanup)?;
        }
        Ok(Arc::new(RaftLogs { shared, groups: Mutex::new(map), recovered: stats }))
    }

    /// What the last open found and read.
    pub fn recovery_stats(&self) -> RecoveryStats {
        self.recovered
    }

    /// The groups that have anything stored on this node, in id order.
    pub fn group_ids(&self) -> Vec<GroupId> {
        let mut ids: Vec<GroupId> = self.groups.lock().keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// The log of group `group` (created empty if it has none yet): openraft's `RaftLogStorage` for
    /// that group. Give each group's `Raft` one `LogStore`; clones share it.
    pub fn log_store(&self, group: GroupId) -> Result<LogStore, LogStoreError> {
        Ok(LogStore::new(self.group(group)?, self.shared.clone()))
    }

    /// Deletes group `group`'s log and state from the store (its `Raft` must be shut down first).
    /// Returns the ticket of the drop; handles still held on the group fail from now on.
    pub fn remove_group(&self, group: GroupId) -> Result<SyncTicket, LogStoreError> {
        if let Some(g) = self.groups.lock().remove(&group) {
            let mut g = g.inner.lock();
            g.removed = true;
            g.cached.clear();
        }
        let mut batch = Batch::new();
        batch.drop_queue(RAFT_LOG | group);
        batch.drop_queue(RAFT_STATE | group);
        Ok(self.shared.store.append(&mut batch)?)
    }

    /// Group `group`'s state machine reads entry `index` after it is purged (see [`Group::pin`]).
    pub fn pin_entry(&self, group: GroupId, index: u64) -> io::Result<()> {
        self.existing(group)?.pin(index);
        Ok(())
    }

    /// See [`Group::unpin`].
    pub fn unpin_entry(&self, group: GroupId, index: u64) -> io::Result<()> {
        self.existing(group)?.unpin(&self.shared.store, index)
    }

    /// See [`Group::release_unpinned`].
    pub fn release_unpinned(&self, group: GroupId) -> io::Result<u64> {
        self.existing(group)?.release_unpinned(&self.shared.store)
    }

    /// See [`Group::read_entry`].
    pub fn read_entry(&self, group: GroupId, index: u64) -> io::Result<Option<Entry>> {
        self.existing(group)?.read_entry(&self.shared.store, index)
    }

    /// The command of entry `index` of group `group` (None: no such entry, or not a command:
    /// a blank or membership entry).
    pub fn read_command(&self, group: GroupId, index: u64) -> io::Result<Option<bytes::Bytes>> {
        Ok(self.read_entry(group, index)?.and_then(|entry| match entry.payload {
            openraft::EntryPayload::Normal(crate::types::Command(bytes)) => Some(bytes),
            _ => None,
        }))
    }

    /// Group `group`, if the node has its log (a removed group's handles fail).
    fn existing(&self, group: GroupId) -> io::Result<Arc<Group>> {
        self.groups.lock().get(&group).cloned().ok_or_else(gone)
    }

    /// What group `group`'s Raft should be asked now to keep its log small (by bytes and when
    /// quiet, see [`compaction`]); nothing for a group this node has no log of. Asked
    /// periodically by whoever runs the group; `pressed`: the group is one of
    /// [`RaftLogs::over_node_budget`]'s.
    pub fn compaction(&self, group: GroupId, pressed: bool) -> Compaction {
        let Some(g) = self.groups.lock().get(&group).cloned() else { return Compaction::default() };
        let mut g = g.inner.lock();
        if g.removed {
            return Compaction::default();
        }
        g.compaction(std::time::Instant::now(), pressed)
    }

    /// The groups among the node's logs that [`RaftLogs::compaction`] would ask something of now
    /// (this remembers nothing): the periodic caller asks only those, not every group every time.
    pub fn wanting_compaction(&self, pressed: &[GroupId]) -> Vec<GroupId> {
        let now = std::time::Instant::now();
        self.each_group(|id, inner| inner.wants_compaction(now, pressed.contains(&id)).then_some(id))
    }

    /// What `f` makes of each group on the node that is not removed (None: nothing), each looked
    /// at under its own lock, not under the map's.
    fn each_group<T>(&self, mut f: impl FnMut(GroupId, &GroupInner) -> Option<T>) -> Vec<T> {
        let groups: Vec<Arc<Group>> = self.groups.lock().values().cloned().collect();
        groups
            .iter()
            .filter_map(|g| {
                let inner = g.inner.lock();
                if inner.removed {
                    return None;
                }
                f(g.id, &inner)
            })
            .collect()
    }

    /// The groups that must give their log back because the node's logs together keep more than
    /// [`compaction::NODE_LOG_BYTES`] of unpurged entries (test-only: `WARREN_TEST_NODE_LOG_BYTES`):
    /// the largest, until the others keep under three quarters of it. Empty while under.
    pub fn over_node_budget(&self) -> Vec<GroupId> {
        static BUDGET: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let budget = *BUDGET.get_or_init(|| {
            warren_store::test_hooks::var("WARREN_TEST_NODE_LOG_BYTES").and_then(|v| v.parse().ok()).unwrap_or(compaction::NODE_LOG_BYTES)
        });
        self.over_budget(budget)
    }

    /// Bytes of unpurged entries of every group on the node.
    pub fn log_bytes(&self) -> u64 {
        self.log_sizes().iter().map(|(bytes, _)| bytes).sum()
    }

    /// (bytes of unpurged entries, group) of every group on the node.
    fn log_sizes(&self) -> Vec<(u64, GroupId)> {
        self.each_group(|id, inner| Some((inner.compaction.log_bytes, id)))
    }

    fn over_budget(&self, budget: u64) -> Vec<GroupId> {
        let mut sizes = self.log_sizes();
        let mut total: u64 = sizes.iter().map(|(b, _)| b).sum();
        if total <= budget {
            return Vec::new();
        }
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        let mut out = Vec::new();
        for (bytes, id) in sizes {
            if total <= budget / 4 * 3 {
                break;
            }
            total -= bytes;
            out.push(id);
        }
        out
    }

    pub fn store(&self) -> &Store {
        &self.shared.store
    }

    pub(crate) fn group(&self, group: GroupId) -> Result<Arc<Group>, LogStoreError> {
        if group >= GROUP_ID_LIMIT {
            return Err(LogStoreError::GroupId(group));
        }
        Ok(self.groups.lock().entry(group).or_insert_with(|| Arc::new(Group::new(group, self.shared.cache_budget.clone()))).clone())
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

/// One group's log and state: the store queues it writes and what is kept in memory.
pub(crate) struct Group {
    pub id: GroupId,
    pub inner: Mutex<GroupInner>,
}

/// An unpurged entry: where it is in the store, and the entry itself until the store can read it.
struct Slot {
    seq: u64,
    leader: LeaderId,
    /// Payload bytes of its record (acks report them to the store).
    len: u64,
    ticket: SyncTicket,
}

/// The stored snapshot: its record and metadata (the data is read back from the store).
#[derive(Clone)]
pub(crate) struct StoredSnapshot {
    pub seq: u64,
    pub len: u64,
    pub ticket: SyncTicket,
    pub meta: SnapshotMeta,
}

pub(crate) struct GroupInner {
    /// The Raft index of `slots[0]`.
    first_index: u64,
    slots: VecDeque<Slot>,
    /// Entries the group's state machine still reads after they are purged (the bodies of live
    /// messages only in them), by index: a purge keeps their records as `retained`.
    pinned: BTreeSet<u64>,
    /// Purged entries whose records are kept, by index: pinned when purged, or found below the
    /// purged index at recovery (kept until the state machine has said which it reads, see
    /// [`Group::release_unpinned`]).
    retained: BTreeMap<u64, Slot>,
    /// Entries of the slots from index `cached_from` on, in order: appended, and not yet readable
    /// from the store or not yet applied here (see [`cache`]). (Appends are in ticket order, so the
    /// readable ones are a prefix.)
    cached: EntryCache,
    /// This node's state machine has applied every entry below this index.
    applied_below: u64,
    /// Where the replication streams last started a read (see [`cache::ReadMark`]).
    readers: cache::ReadMarks,
    next_log_seq: u64,
    next_state_seq: u64,
    hard: HardState,
    /// The live hard-state record: (seq, payload bytes).
    hard_record: Option<(u64, u64)>,
    /// The live layout record, and the entries appended since it was written.
    layout_record: Option<(u64, u64)>,
    appends_since_layout: u64,
    /// The live records of changes to `retained` (seq, payload bytes), oldest first: the last
    /// reset and the changes after it. Their bytes, to know when a reset costs less than they do.
    retained_records: Vec<(u64, u64)>,
    retained_records_bytes: u64,
    pub snapshot: Option<StoredSnapshot>,
    /// Bumped by every truncation and purge: a read planned under the lock and done after it is
    /// still what the log holds if this has not changed meanwhile.
    generation: u64,
    /// Reused for every append of the group (keeps its allocations).
    batch: Batch,
    head: Vec<u8>,
    removed: bool,
    compaction: CompactionState,
}

impl Group {
    fn new(id: GroupId, budget: Arc<CacheBudget>) -> Group {
        Group {
            id,
            inner: Mutex::new(GroupInner {
                first_index: 0,
                slots: VecDeque::new(),
                pinned: BTreeSet::new(),
                retained: BTreeMap::new(),
                cached: EntryCache::new(budget),
                applied_below: 0,
                readers: cache::ReadMarks::default(),
                next_log_seq: 0,
                next_state_seq: 0,
                hard: HardState::default(),
                hard_record: None,
                layout_record: None,
                appends_since_layout: 0,
                retained_records: Vec::new(),
                retained_records_bytes: 0,
                snapshot: None,
                generation: 0,
                batch: Batch::new(),
                head: Vec::new(),
                removed: false,
                compaction: CompactionState::new(),
            }),
        }
    }

    pub fn log_queue(&self) -> u64 {
        RAFT_LOG | self.id
    }

    pub fn state_queue(&self) -> u64 {
        RAFT_STATE | self.id
    }

    /// Rebuilds a group from its live records; what recovery finds stale goes into `cleanup` (acks).
    fn recover(
        store: &Store,
        budget: Arc<CacheBudget>,
        id: GroupId,
        log: Option<&RecoveredQueue>,
        state: Option<&RecoveredQueue>,
        cleanup: &mut Batch,
        stats: &mut RecoveryStats,
    ) -> Result<Group, LogStoreError> {
        let group = Group::new(id, budget);
        {
            let mut g = group.inner.lock();
            let state_queue = RAFT_STATE | id;
            let log_queue = RAFT_LOG | id;
            let mut layout: Option<Layout> = None;
            // The retained entries the state records name (a reset and the changes after it).
            let mut named_retained: BTreeMap<u64, Slot> = BTreeMap::new();
            // Retained records in an older form, or not named by any: rewrite the set once open.
            let mut rewrite_retained = false;
            if let Some(rec) = state {
                g.next_state_seq = rec.next_seq;
                let mut hard: Option<(u64, u64, HardState)> = None;
                let mut snap: Option<StoredSnapshot> = None;
                let mut lay: Option<(u64, u64, Layout)> = None;
                let mut retained_records: Vec<(u64, u64)> = Vec::new();
                for_each_record(store, state_queue, rec.first_seq, |seq, payload| {
                    let len = payload.len() as u64;
                    // Of each kind the latest record wins (changes to the retained set count from
                    // the latest reset on); one superseded by a record whose ack a crash lost is
                    // acked again.
                    let old = match codec::decode_state(&payload) {
                        Ok(StateRecord::Hard(h)) => hard.replace((seq, len, h)).map(|(s, l, _)| (s, l)),
                        Ok(StateRecord::Snapshot { meta, .. }) => snap.replace(StoredSnapshot { seq, len, ticket: 0, meta }).map(|o| (o.seq, o.len)),
                        Ok(StateRecord::Layout(mut l)) => {
                            if let Some(runs) = l.retained.take() {
                                for (seq, len) in retained_records.drain(..) {
                                    cleanup.ack(state_queue, seq, len);
                                }
                                named_retained.clear();
                                add_runs(&mut named_retained, &runs);
                                rewrite_retained = true;
                            }
                            lay.replace((seq, len, l)).map(|(s, l, _)| (s, l))
                        }
                        Ok(StateRecord::Retained(change)) => {
                            if change.reset {
                                for (seq, len) in retained_records.drain(..) {
                                    cleanup.ack(state_queue, seq, len);
                                }
                                named_retained.clear();
                            }
                            add_runs(&mut named_retained, &change.added);
                            for index in &change.released {
                                named_retained.remove(index);
                            }
                            retained_records.push((seq, len));
                            None
                        }
                        Err(error) => return Err(LogStoreError::Corrupt { group: id, queue: state_queue, seq, error }),
                    };
                    if let Some((seq, len)) = old {
                        cleanup.ack(state_queue, seq, len);
                    }
                    Ok(())
                })?;
                if let Some((seq, len, h)) = hard {
                    g.hard = h;
                    g.hard_record = Some((seq, len));
                }
                g.snapshot = snap;
                if let Some((seq, len, l)) = lay {
                    g.layout_record = Some((seq, len));
                    layout = Some(l);
                }
                g.retained_records_bytes = retained_records.iter().map(|r| r.1).sum();
                g.retained_records = retained_records;
            }
            if let Some(rec) = log {
                g.next_log_seq = rec.next_seq;
                let purged_next = g.hard.purged.map(|p| p.index + 1);
                let mut stale: Vec<(u64, u64)> = Vec::new();
                let mut from_seq = rec.first_seq;
                // The layout and the retained set name the entries appended before the layout:
                // only those after it are read.
                let named = layout.as_ref().and_then(|l| named_records(id, l, &named_retained, purged_next, rec).map(|spans| (l, spans)));
                if let Some((layout, spans)) = named {
                    for (index, slot) in std::mem::take(&mut named_retained) {
                        g.admit(id, index, slot.seq, slot.leader, slot.len, purged_next, &mut stale);
                    }
                    for run in &layout.runs {
                        let share = run.bytes / run.count.max(1);
                        for k in 0..run.count {
                            g.admit(id, run.first_index + k, run.first_seq + k, run.leader, share, purged_next, &mut stale);
                        }
                    }
                    // Records in between that neither names were acked before a crash lost the ack.
                    let mut covered = rec.first_seq;
                    for (first_seq, count) in spans {
                        if first_seq > covered {
                            cleanup.ack_range(log_queue, covered, first_seq, 0);
                        }
                        covered = first_seq + count;
                    }
                    if layout.next_log_seq > covered {
                        cleanup.ack_range(log_queue, covered, layout.next_log_seq, 0);
                    }
                    from_seq = layout.next_log_seq;
                } else if !named_retained.is_empty() || !g.retained_records.is_empty() {
                    // Every record is read: the retained set is rebuilt from them.
                    rewrite_retained = true;
                }
                let mut read = 0u64;
                let retained_before = g.retained.len();
                for_each_record(store, log_queue, from_seq, |seq, payload| {
                    // A record below the purged index here was retained by a purge whose layout a
                    // crash lost, or one whose ack it lost: kept as retained until the machine
                    // says whether it reads it.
                    let log_id = codec::decode_entry_log_id(&payload).map_err(|error| LogStoreError::Corrupt { group: id, queue: log_queue, seq, error })?;
                    g.admit(id, log_id.index, seq, log_id.leader_id, payload.len() as u64, purged_next, &mut stale);
                    read += 1;
                    Ok(())
                })?;
                if g.retained.len() != retained_before {
                    rewrite_retained = true;
                }
                // A layout soon, so that the next start reads little.
                g.appends_since_layout = read;
                stats.records_read += read;
                for (seq, len) in stale {
                    cleanup.ack(log_queue, seq, len);
                }
            }
            if rewrite_retained {
                // The whole set, then a layout after it: the next start finds every retained entry
                // named, in the current form.
                g.put_retained(cleanup, state_queue, Vec::new(), Vec::new(), true);
                g.put_layout(cleanup, state_queue, &[]);
            }
            g.reset_first_index();
            g.count_since_snapshot();
            g.count_log_bytes();
            stats.groups += 1;
            stats.entries += g.slots.len() as u64;
            stats.retained += g.retained.len() as u64;
        }
        Ok(group)
    }
}

/// The records a layout and the retained set name, as (first seq, count) in seq order, if they can
/// be trusted to describe the log queue `rec` (they always can unless damage was skipped or a
/// record was forged): runs in index and seq order, retained entries purged and below the log's,
/// every named record inside the queue's seqs and named once, no more of them than it holds.
fn named_records(group: GroupId, layout: &Layout, retained: &BTreeMap<u64, Slot>, purged_next: Option<u64>, rec: &RecoveredQueue) -> Option<Vec<(u64, u64)>> {
    let mut next: Option<(u64, u64)> = None;
    let mut spans: Vec<(u64, u64)> = Vec::with_capacity(layout.runs.len() + retained.len());
    for r in &layout.runs {
        let ordered = next.is_none_or(|(index, seq)| r.first_index == index && r.first_seq >= seq);
        let end_seq = r.first_seq.checked_add(r.count);
        let inside = r.first_seq >= rec.first_seq && end_seq.is_some_and(|e| e <= layout.next_log_seq);
        if !ordered || !inside || r.first_index.checked_add(r.count).is_none() {
            tracing::error!(group, "a Raft log layout record does not fit the log; reading every record instead");
            return None;
        }
        spans.push((r.first_seq, r.count));
        next = Some((r.first_index + r.count, r.first_seq + r.count));
    }
    let log_from = layout.runs.first().map(|r| r.first_index);
    for (index, slot) in retained {
        let purged = purged_next.is_some_and(|n| *index < n) && log_from.is_none_or(|f| *index < f);
        if !purged || slot.seq < rec.first_seq || slot.seq >= layout.next_log_seq {
            tracing::error!(group, index, "a Raft log's retained entry does not fit the log; reading every record instead");
            return None;
        }
        spans.push((slot.seq, 1));
    }
    spans.sort_unstable();
    // Consecutive seqs as one span; an overlap means a record named twice.
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(spans.len());
    let mut entries = 0u64;
    for (seq, count) in spans {
        entries += count;
        match merged.last_mut() {
            Some((first, n)) if *first + *n > seq => {
                tracing::error!(group, seq, "a Raft log record is named twice; reading every record instead");
                return None;
            }
            Some((first, n)) if *first + *n == seq => *n += count,
            _ => merged.push((seq, count)),
        }
    }
    if entries > rec.live_count || layout.next_log_seq > rec.next_seq {
        tracing::error!(group, entries, live = rec.live_count, "a Raft log layout record names more entries than the log holds; reading every record instead");
        return None;
    }
    Some(merged)
}

/// Adds the entries of `runs` to a retained set.
fn add_runs(set: &mut BTreeMap<u64, Slot>, runs: &[Run]) {
    for run in runs {
        let share = run.bytes / run.count.max(1);
        for k in 0..run.count {
            set.insert(run.first_index.saturating_add(k), Slot { seq: run.first_seq.saturating_add(k), leader: run.leader, len: share, ticket: 0 });
        }
    }
}

/// Calls `f(seq, payload)` for every live record of `queue` from `from_seq` on, in seq order.
fn for_each_record(store: &Store, queue: u64, from_seq: u64, mut f: impl FnMut(u64, Bytes) -> Result<(), LogStoreError>) -> Result<(), LogStoreError> {
    let mut seq = from_seq;
    loop {
        let batch = store.read(queue, seq, 4096, READ_CHUNK_BYTES)?;
        if batch.lost > 0 {
            tracing::error!(queue, lost = batch.lost, "records of a Raft log were lost to damage");
        }
        if batch.messages.is_empty() {
            return Ok(());
        }
        for m in batch.messages {
            f(m.seq, m.payload)?;
        }
        seq = batch.next_seq;
    }
}

/// Adds `record` to `batch` as the state queue's next record, superseding `live` (the live record
/// of its kind, (seq, payload bytes): acked, and now the new one).
fn put_state_record(batch: &mut Batch, state_queue: u64, next_state_seq: &mut u64, live: &mut Option<(u64, u64)>, record: &[u8]) {
    let seq = *next_state_seq;
    *next_state_seq += 1;
    batch.enqueue(state_queue, seq, 0, &[record]);
    if let Some((old, len)) = live.replace((seq, record.len() as u64)) {
        batch.ack(state_queue, old, len);
    }
}

/// Entries as runs: consecutive indexes and seqs, one leader.
fn runs_of<'a>(slots: impl Iterator<Item = (u64, &'a Slot)>) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for (index, slot) in slots {
        match runs.last_mut() {
            Some(r) if r.first_index + r.count == index && r.first_seq + r.count == slot.seq && r.leader == slot.leader => {
                r.count += 1;
                r.bytes += slot.len;
            }
            _ => runs.push(Run { first_index: index, first_seq: slot.seq, count: 1, leader: slot.leader, bytes: slot.len }),
        }
    }
    runs
}

/// Runs in index order, merged where one continues the one before it.
fn merge_runs(runs: Vec<Run>) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::with_capacity(runs.len());
    for run in runs {
        match out.last_mut() {
            Some(r) if r.first_index + r.count == run.first_index && r.first_seq + r.count == run.first_seq && r.leader == run.leader => {
                r.count += run.count;
                r.bytes += run.bytes;
            }
            _ => out.push(run),
        }
    }
    out
}

/// Acks `slots` (in seq order), consecutive seqs as one range.
fn ack_slots<'a>(batch: &mut Batch, log_queue: u64, slots: impl Iterator<Item = &'a Slot>) {
    for s in slots {
        batch.ack_range(log_queue, s.seq, s.seq + 1, s.len);
    }
}

fn gone() -> io::Error {
    io::Error::other("the group was removed")
}

impl GroupInner {
    /// Recovery: takes entry `index` at `seq` into the log, or into `stale`. A record whose index is
    /// at or below one before it replaces that one and everything after it (a truncation whose acks
    /// a crash lost); records at or below the purged index are retained (a later one of the same
    /// index replaces an earlier one) until the state machine says which it reads.
    #[allow(clippy::too_many_arguments)]
    fn admit(&mut self, group: GroupId, index: u64, seq: u64, leader: LeaderId, len: u64, purged_next: Option<u64>, stale: &mut Vec<(u64, u64)>) {
        if purged_next.is_some_and(|next| index < next) {
            if let Some(old) = self.retained.insert(index, Slot { seq, leader, len, ticket: 0 }) {
                if old.seq != seq {
                    stale.push((old.seq, old.len));
                }
            }
            return;
        }
        if !self.slots.is_empty() && index < self.next_index() {
            let keep = index.saturating_sub(self.first_index) as usize;
            stale.extend(self.slots.drain(keep..).map(|s| (s.seq, s.len)));
        }
        let expected = if self.slots.is_empty() { purged_next.unwrap_or(index) } else { self.next_index() };
        if index != expected {
            // Only damage skipped under `tolerate-any-corruption` leaves a hole: keep the log
            // before it (a log must not have holes).
            tracing::error!(group, index, expected, seq, "a hole in a Raft log: the entries after it are dropped");
            stale.push((seq, len));
            return;
        }
        if self.slots.is_empty() {
            self.first_index = index;
        }
        self.slots.push_back(Slot { seq, leader, len, ticket: 0 });
    }

    /// The log as runs (consecutive indexes and seqs, one leader), `extra` slots appended after it.
    /// (The retained entries are named by their own records: see [`GroupInner::put_retained`].)
    fn layout(&self, extra: &[Slot]) -> Layout {
        let log = self.slots.iter().chain(extra).enumerate().map(|(i, slot)| (self.first_index + i as u64, slot));
        Layout { next_log_seq: self.next_log_seq + extra.len() as u64, runs: runs_of(log), retained: None }
    }

    /// Adds a record of a change to the retained set (already made to `retained`) to `batch`: the
    /// change alone, or the whole set (`reset`, and always once the changes since the last whole set
    /// outweigh it: a change costs its own size, amortized, whatever the set's), superseding the
    /// records before it. An empty set needs no record. Put it before a layout that follows the
    /// change and before the acks of released records: if they are durable, so is it.
    fn put_retained(&mut self, batch: &mut Batch, state_queue: u64, added: Vec<Run>, released: Vec<u64>, mut reset: bool) {
        const CHANGE_HEAD: u64 = 2 + 1 + 4 + 4;
        let change = CHANGE_HEAD + added.len() as u64 * 48 + released.len() as u64 * 8;
        // At most one run per entry: a bound on the whole set's size without building it.
        let whole = CHANGE_HEAD + self.retained.len() as u64 * 48;
        // Whole sets once the records reach twice the set's size: a reset is paid for by at least
        // as many bytes of changes before it.
        reset |= self.retained_records_bytes + change > 2 * whole.max(2048);
        if !reset {
            let record = codec::encode_retained(&RetainedChange { reset, added, released });
            let seq = self.next_state_seq;
            self.next_state_seq += 1;
            batch.enqueue(state_queue, seq, 0, &[&record]);
            self.retained_records.push((seq, record.len() as u64));
            self.retained_records_bytes += record.len() as u64;
            return;
        }
        for (seq, len) in self.retained_records.drain(..) {
            batch.ack(state_queue, seq, len);
        }
        self.retained_records_bytes = 0;
        if self.retained.is_empty() {
            return;
        }
        let whole = runs_of(self.retained.iter().map(|(index, slot)| (*index, slot)));
        let record = codec::encode_retained(&RetainedChange { reset: true, added: whole, released: Vec::new() });
        let seq = self.next_state_seq;
        self.next_state_seq += 1;
        batch.enqueue(state_queue, seq, 0, &[&record]);
        self.retained_records.push((seq, record.len() as u64));
        self.retained_records_bytes = record.len() as u64;
    }

    /// Adds a layout record of the log (with `extra` slots about to be appended), superseding the
    /// live one, to `batch`.
    fn put_layout(&mut self, batch: &mut Batch, state_queue: u64, extra: &[Slot]) {
        let record = codec::encode_layout(&self.layout(extra));
        put_state_record(batch, state_queue, &mut self.next_state_seq, &mut self.layout_record, &record);
        self.appends_since_layout = 0;
    }

    /// The index the next append must have.
    fn next_index(&self) -> u64 {
        self.first_index + self.slots.len() as u64
    }

    fn cached_from(&self) -> u64 {
        self.next_index() - self.cached.len() as u64
    }

    /// With no entries, the next one follows the purged one.
    fn reset_first_index(&mut self) {
        if self.slots.is_empty() {
            self.cached.clear();
            self.first_index = self.hard.purged.map_or(0, |p| p.index + 1);
        }
    }

    fn log_id_at(&self, index: u64) -> Option<LogId> {
        let slot = self.slots.get(index.checked_sub(self.first_index)? as usize)?;
        Some(LogId::new(slot.leader, index))
    }

    pub fn vote(&self) -> Option<Vote> {
        self.hard.vote
    }

    pub fn committed(&self) -> Option<LogId> {
        self.hard.committed
    }

    pub fn last_purged(&self) -> Option<LogId> {
        self.hard.purged
    }

    pub fn last_log_id(&self) -> Option<LogId> {
        match self.slots.len() {
            0 => self.hard.purged,
            n => self.log_id_at(self.first_index + n as u64 - 1),
        }
    }

    /// Drops cached entries the store can read now, this node has applied and every replication
    /// stream has read (or all readable ones, oldest first, while the group or the node holds more
    /// than its budget).
    fn evict_readable(&mut self, store: &Store) {
        let read_below = self.readers.lowest();
        while !self.cached.is_empty() {
            let index = self.cached_from();
            let at = (index - self.first_index) as usize;
            if !self.slots.get(at).is_some_and(|s| store.is_readable(s.ticket)) {
                break;
            }
            if (index >= self.applied_below || index >= read_below) && !self.cached.over() {
                break;
            }
            self.cached.pop_front();
        }
    }

    /// Appends entries (their indexes must follow the log's last one, or the purged one when the log
    /// is empty; the first entry of a log that never had one may have any index).
    pub fn append(&mut self, store: &Store, log_queue: u64, state_queue: u64, layout_every: u64, entries: Vec<Entry>) -> io::Result<SyncTicket> {
        if self.removed {
            return Err(gone());
        }
        let Some(first) = entries.first() else { return Ok(0) };
        let never_written = self.slots.is_empty() && self.hard.purged.is_none();
        let start = if never_written { first.log_id.index } else { self.next_index() };
        for (i, e) in entries.iter().enumerate() {
            if e.log_id.index != start + i as u64 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("append of index {} where {} is next: a log must not have holes", e.log_id.index, start + i as u64),
                ));
            }
        }
        self.evict_readable(store);
        if never_written {
            self.first_index = start;
        }
        let mut batch = std::mem::take(&mut self.batch);
        let mut head = std::mem::take(&mut self.head);
        batch.clear();
        let mut new_slots = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            head.clear();
            codec::encode_entry_head(e, &mut head);
            let body = codec::entry_body(e);
            let seq = self.next_log_seq + i as u64;
            batch.enqueue(log_queue, seq, 0, &[&head, body]);
            new_slots.push(Slot { seq, leader: e.log_id.leader_id, len: (head.len() + body.len()) as u64, ticket: 0 });
        }
        // After the entries, in the same batch: a layout that survives only with them.
        let since = self.appends_since_layout + new_slots.len() as u64;
        if since >= layout_every {
            self.put_layout(&mut batch, state_queue, &new_slots);
        } else {
            self.appends_since_layout = since;
        }
        let appended = store.append(&mut batch);
        self.batch = batch;
        self.head = head;
        let ticket = appended.map_err(io::Error::other)?;
        self.next_log_seq += new_slots.len() as u64;
        let appended_bytes = new_slots.iter().map(|s| s.len).sum::<u64>();
        self.compaction.since_snapshot += appended_bytes;
        self.compaction.log_bytes += appended_bytes;
        self.compaction.last_append = std::time::Instant::now();
        for (e, s) in entries.into_iter().zip(&new_slots) {
            self.cached.push_back(e, s.len);
        }
        self.slots.extend(new_slots.into_iter().map(|s| Slot { ticket, ..s }));
        Ok(ticket)
    }

    /// Removes the entries after `last` (all of them for `None`): acks their records.
    pub fn truncate_after(&mut self, store: &Store, log_queue: u64, state_queue: u64, last: Option<LogId>) -> io::Result<()> {
        if self.removed {
            return Err(gone());
        }
        let keep_below = last.map_or(0, |l| l.index + 1).max(self.first_index);
        let keep = (keep_below - self.first_index) as usize;
        if keep >= self.slots.len() {
            return Ok(());
        }
        self.generation += 1;
        let drop_cached = (self.next_index() - keep_below).min(self.cached.len() as u64) as usize;
        self.cached.truncate(self.cached.len() - drop_cached);
        let removed: Vec<Slot> = self.slots.drain(keep..).collect();
        let bytes = removed.iter().map(|s| s.len).sum();
        self.compaction.since_snapshot = self.compaction.since_snapshot.saturating_sub(bytes);
        self.compaction.log_bytes = self.compaction.log_bytes.saturating_sub(bytes);
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        // The layout without the removed entries first: if the acks are durable, so is it.
        self.put_layout(&mut batch, state_queue, &[]);
        // Everything from the first removed record on: seqs in between are already gone.
        batch.ack_range(log_queue, removed[0].seq, self.next_log_seq, bytes);
        let appended = store.append(&mut batch);
        self.batch = batch;
        self.reset_first_index();
        appended.map(|_| ()).map_err(io::Error::other)
    }

    /// Records `purged` as the last purged log id and acks the records up to it, in one batch (the
    /// hard state first: if the acks are durable, so is the purged id that explains them). The
    /// records of pinned entries are kept (retained, named by the layout written with it).
    pub fn purge(&mut self, store: &Store, log_queue: u64, state_queue: u64, purged: LogId) -> io::Result<()> {
        if self.removed {
            return Err(gone());
        }
        if self.hard.purged.is_some_and(|p| p >= purged) {
            return Ok(());
        }
        self.hard.purged = Some(purged);
        self.generation += 1;
        let remove = (purged.index + 1).saturating_sub(self.first_index).min(self.slots.len() as u64) as usize;
        let mut removed: Vec<Slot> = Vec::with_capacity(remove);
        let mut kept: Vec<Run> = Vec::new();
        for (i, slot) in self.slots.drain(..remove).enumerate() {
            self.compaction.log_bytes = self.compaction.log_bytes.saturating_sub(slot.len);
            let index = self.first_index + i as u64;
            if self.pinned.contains(&index) {
                kept.extend(runs_of(std::iter::once((index, &slot))));
                self.retained.insert(index, slot);
            } else {
                removed.push(slot);
            }
        }
        let kept = merge_runs(kept);
        self.first_index += remove as u64;
        let cached_keep = (self.next_index() - self.cached_from().max(self.first_index)) as usize;
        while self.cached.len() > cached_keep {
            self.cached.pop_front();
        }
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        self.put_hard(&mut batch, state_queue);
        if !kept.is_empty() {
            self.put_retained(&mut batch, state_queue, kept, Vec::new(), false);
        }
        self.put_layout(&mut batch, state_queue, &[]);
        ack_slots(&mut batch, log_queue, removed.iter());
        let appended = store.append(&mut batch);
        self.batch = batch;
        self.reset_first_index();
        appended.map(|_| ()).map_err(io::Error::other)
    }

    /// Acks the records of the retained entries `go`, after a record of their release (so that a
    /// start does not take them for retained entries whose records are gone).
    fn release_retained(&mut self, store: &Store, log_queue: u64, state_queue: u64, go: &[u64]) -> io::Result<u64> {
        if self.removed {
            return Err(gone());
        }
        let mut released = Vec::with_capacity(go.len());
        let mut slots = Vec::with_capacity(go.len());
        for index in go {
            if let Some(slot) = self.retained.remove(index) {
                released.push(*index);
                slots.push(slot);
            }
        }
        if slots.is_empty() {
            return Ok(0);
        }
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        self.put_retained(&mut batch, state_queue, Vec::new(), released, false);
        ack_slots(&mut batch, log_queue, slots.iter());
        let appended = store.append(&mut batch);
        self.batch = batch;
        appended.map(|_| slots.len() as u64).map_err(io::Error::other)
    }

    /// Saves the hard state with `change` applied; returns the record's ticket.
    pub fn save_hard(&mut self, store: &Store, state_queue: u64, change: impl FnOnce(&mut HardState)) -> io::Result<SyncTicket> {
        if self.removed {
            return Err(gone());
        }
        change(&mut self.hard);
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        self.put_hard(&mut batch, state_queue);
        let appended = store.append(&mut batch);
        self.batch = batch;
        appended.map_err(io::Error::other)
    }

    /// Adds the hard-state record (superseding the live one) to `batch`.
    fn put_hard(&mut self, batch: &mut Batch, state_queue: u64) {
        let record = codec::encode_hard_state(&self.hard);
        put_state_record(batch, state_queue, &mut self.next_state_seq, &mut self.hard_record, &record);
    }

    /// Stores a snapshot (superseding the stored one), unless the stored one is as new or newer.
    /// Returns the ticket to wait for.
    pub fn save_snapshot(&mut self, store: &Store, state_queue: u64, meta: &SnapshotMeta, data: &[u8]) -> io::Result<SyncTicket> {
        if self.removed {
            return Err(gone());
        }
        if let Some(s) = &self.snapshot {
            if s.meta.last_log_id >= meta.last_log_id {
                return Ok(s.ticket);
            }
        }
        let head = codec::encode_snapshot_head(meta);
        let seq = self.next_state_seq;
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        batch.enqueue(state_queue, seq, 0, &[&head, data]);
        if let Some(old) = &self.snapshot {
            batch.ack(state_queue, old.seq, old.len);
        }
        let appended = store.append(&mut batch);
        self.batch = batch;
        let ticket = appended.map_err(io::Error::other)?;
        self.next_state_seq += 1;
        self.snapshot = Some(StoredSnapshot { seq, len: (head.len() + data.len()) as u64, ticket, meta: meta.clone() });
        self.count_since_snapshot();
        Ok(ticket)
    }

    /// What a read of `[start, end)` needs: the entries held in memory, and the (seq, log id) of
    /// those before them that the store must be asked for. Clamped to the entries there are.
    fn plan_read(&mut self, store: &Store, start: u64, end: u64) -> ReadPlan {
        self.evict_readable(store);
        let start = start.max(self.first_index);
        let end = end.min(self.next_index());
        let mut plan = ReadPlan { from_store: Vec::new(), cached: Vec::new() };
        if start >= end {
            return plan;
        }
        let cached_from = self.cached_from();
        for index in start..end.min(cached_from) {
            let slot = &self.slots[(index - self.first_index) as usize];
            plan.from_store.push((slot.seq, LogId::new(slot.leader, index)));
        }
        for index in start.max(cached_from)..end {
            plan.cached.extend(self.cached.get((index - cached_from) as usize).cloned());
        }
        plan
    }
}

struct ReadPlan {
    /// (seq, log id) to read from the store, in order.
    from_store: Vec<(u64, LogId)>,
    /// The entries after them, from memory.
    cached: Vec<Entry>,
}

impl Group {
    /// A mark for a new log reader (see [`cache::ReadMark`]).
    pub(crate) fn add_reader(&self) -> Arc<cache::ReadMark> {
        self.inner.lock().readers.add()
    }

    /// This node's state machine applied the entries up to `index`: cached ones the store can read
    /// are not needed in memory any more.
    pub fn applied(&self, store: &Store, index: u64) {
        let mut g = self.inner.lock();
        g.applied_below = g.applied_below.max(index + 1);
        g.evict_readable(store);
    }

    /// The state machine reads entry `index` after it is purged (it holds the bodies of live
    /// messages): a purge keeps its record until [`Group::unpin`]. Pin an entry when applying it,
    /// before any snapshot that covers it.
    pub fn pin(&self, index: u64) {
        self.inner.lock().pinned.insert(index);
    }

    /// The state machine no longer reads entry `index`: its record goes if it was purged (retained).
    pub fn unpin(&self, store: &Store, index: u64) -> io::Result<()> {
        let mut g = self.inner.lock();
        g.pinned.remove(&index);
        if g.retained.contains_key(&index) {
            g.release_retained(store, self.log_queue(), self.state_queue(), &[index])?;
        }
        Ok(())
    }

    /// The state machine has pinned every entry it reads (after its restore at a start): the
    /// records of retained entries it did not pin go. Returns how many.
    pub fn release_unpinned(&self, store: &Store) -> io::Result<u64> {
        let mut g = self.inner.lock();
        let go: Vec<u64> = g.retained.keys().copied().filter(|i| !g.pinned.contains(i)).collect();
        g.release_retained(store, self.log_queue(), self.state_queue(), &go)
    }

    /// Entry `index`, purged and retained or in the log; None if the log has neither.
    pub fn read_entry(&self, store: &Store, index: u64) -> io::Result<Option<Entry>> {
        let retained = {
            let g = self.inner.lock();
            if g.removed {
                return Err(gone());
            }
            g.retained.get(&index).map(|s| (s.seq, s.len, s.ticket, LogId::new(s.leader, index)))
        };
        let Some((seq, len, ticket, log_id)) = retained else {
            return Ok(self.read(store, index, index + 1, usize::MAX)?.pop());
        };
        // Purged right after its append, the record may not be readable yet (its cached copy went).
        if !store.wait_readable(ticket, READABLE_WAIT) {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("group {}: log record {seq} is not readable yet", self.id)));
        }
        // A retained record is never acked while pinned; read outside the lock (it may be large).
        // One record, in one read of about its size (with `READ_CHUNK_BYTES` each entry read 4 MiB;
        // with less, the store reads the record again whole). Through the page cache: a direct read
        // waits for the disk each time, and drained a rewound quorum queue at 185k msg/s, not 310k.
        let got = store.read(self.log_queue(), seq, 1, (len as usize).saturating_add(RECORD_OVERHEAD)).map_err(io::Error::other)?;
        let Some(m) = got.messages.into_iter().next().filter(|m| m.seq == seq) else { return Err(missing(self.id, seq)) };
        decode_record(self.id, seq, log_id, &m.payload).map(Some)
    }

    /// Whether a read of `[start, end)` now would ask the store (rather than only memory).
    pub fn reads_store(&self, store: &Store, start: u64, end: u64) -> bool {
        let mut g = self.inner.lock();
        g.evict_readable(store);
        start.max(g.first_index) < end.min(g.cached_from())
    }

    /// The entries in `[start, end)` that the log has, in order: a purged beginning and a missing
    /// end are left out, nothing in between is. At most about `max_bytes` are read from the store
    /// (at least one entry), unless `max_bytes` is `usize::MAX`.
    pub fn read(&self, store: &Store, start: u64, end: u64, max_bytes: usize) -> io::Result<Vec<Entry>> {
        // Planned under the group's lock, read from the store after it (a read may be slow: with
        // the lock held, appends, the state machine's pins and other readers of the group would
        // wait for it), then checked: no truncation or purge came in between (openraft's contract:
        // a read is atomic with respect to them), else planned and read again. After a few
        // retries (purges keep coming) the read is done under the lock.
        for _ in 0..3 {
            let (plan, generation) = {
                let mut g = self.inner.lock();
                if g.removed {
                    return Err(gone());
                }
                (g.plan_read(store, start, end), g.generation)
            };
            let read = self.read_planned(store, plan, max_bytes);
            let g = self.inner.lock();
            if g.removed {
                return Err(gone());
            }
            if g.generation == generation {
                return read;
            }
        }
        let mut g = self.inner.lock();
        if g.removed {
            return Err(gone());
        }
        let plan = g.plan_read(store, start, end);
        self.read_planned(store, plan, max_bytes)
    }

    /// Reads what `plan` names from the store, then its entries from memory.
    fn read_planned(&self, store: &Store, plan: ReadPlan, max_bytes: usize) -> io::Result<Vec<Entry>> {
        let mut out = Vec::with_capacity(plan.from_store.len() + plan.cached.len());
        let mut bytes = 0usize;
        let mut want = plan.from_store.iter().peekable();
        let queue = self.log_queue();
        'outer: while let Some(&&(seq, _)) = want.peek() {
            let remaining = want.len();
            let got = store.read(queue, seq, remaining, READ_CHUNK_BYTES.min(max_bytes)).map_err(io::Error::other)?;
            if got.messages.is_empty() {
                return Err(missing(self.id, seq));
            }
            for m in got.messages {
                let Some(&&(seq, log_id)) = want.peek() else { break 'outer };
                if m.seq < seq {
                    continue; // a truncated record whose ack the writer has not applied yet
                }
                if m.seq > seq {
                    return Err(missing(self.id, seq));
                }
                let entry = decode_record(self.id, seq, log_id, &m.payload)?;
                bytes += m.payload.len();
                out.push(entry);
                want.next();
                if bytes >= max_bytes {
                    return Ok(out);
                }
            }
        }
        out.extend(plan.cached);
        Ok(out)
    }
}

/// The entry in record `seq` of group `group`'s log, which must be the one `log_id` names.
fn decode_record(group: GroupId, seq: u64, log_id: LogId, payload: &Bytes) -> io::Result<Entry> {
    let entry = codec::decode_entry(payload).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("group {group} entry seq {seq}: {e}")))?;
    if entry.log_id != log_id {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("group {group}: record {seq} holds {} where {log_id} was written", entry.log_id)));
    }
    Ok(entry)
}

fn missing(group: GroupId, seq: u64) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("group {group}: log record {seq} is missing from the store"))
}

#[cfg(test)]
mod tests {
    use openraft::vote::RaftLeaderId;
    use openraft::EntryPayload;
    use warren_store::StoreOptions;

    use super::*;
    use crate::types::Command;

    fn entries(from: u64, count: u64, size: usize) -> Vec<Entry> {
        (from..from + count)
            .map(|i| Entry { log_id: LogId::new(LeaderId::new(1, 1), i), payload: EntryPayload::Normal(Command(Bytes::from(vec![i as u8; size]))) })
            .collect()
    }

    async fn wait_readable(logs: &RaftLogs, ticket: SyncTicket) {
        logs.shared.readable(ticket).await.unwrap();
    }

    /// A store in a fresh directory and the Raft logs over it.
    fn open_logs() -> (tempfile::TempDir, Store, Arc<RaftLogs>) {
        let dir = tempfile::tempdir().unwrap();
        let (store, recovery) = Store::open(dir.path(), StoreOptions::default()).unwrap();
        let logs = RaftLogs::open(store.clone(), &recovery.queues).unwrap();
        (dir, store, logs)
    }

    /// Entries stay in memory until applied here, even once the store can read them (a read back
    /// is a pread of the shared WAL); then they go, and the node's budget counts them out.
    #[tokio::test]
    async fn entries_stay_cached_until_applied_then_go() {
        let (_dir, store, logs) = open_logs();
        let g = logs.group(5).unwrap();
        let ticket = g.inner.lock().append(&store, g.log_queue(), g.state_queue(), 256, entries(0, 10, 100)).unwrap();
        wait_readable(&logs, ticket).await;
        assert!(!g.reads_store(&store, 0, 10), "readable but not applied: still in memory");
        assert!(logs.shared.cache_budget.bytes() > 1000);
        g.applied(&store, 4);
        assert!(g.reads_store(&store, 0, 5) && !g.reads_store(&store, 5, 10), "the applied ones go, the rest stay");
        g.applied(&store, 9);
        assert!(g.reads_store(&store, 9, 10));
        assert_eq!(logs.shared.cache_budget.bytes(), 0);
        // What they read back is what was appended.
        assert_eq!(g.read(&store, 0, 10, usize::MAX).unwrap(), entries(0, 10, 100));
    }

    /// On a leader, applied entries stay in memory until every replication stream has started a
    /// read past them (the slower follower's stream reads them after the faster one's ack
    /// committed them); a stream that ended, or never read, holds nothing back.
    #[tokio::test]
    async fn applied_entries_stay_cached_until_every_replication_stream_read_past_them() {
        let (_dir, store, logs) = open_logs();
        let g = logs.group(7).unwrap();
        let (fast, slow, _never_read) = (g.add_reader(), g.add_reader(), g.add_reader());
        let ticket = g.inner.lock().append(&store, g.log_queue(), g.state_queue(), 256, entries(0, 10, 100)).unwrap();
        wait_readable(&logs, ticket).await;
        fast.set(10);
        slow.set(3);
        g.applied(&store, 9);
        assert!(g.reads_store(&store, 0, 3), "read by both streams and applied: gone");
        assert!(!g.reads_store(&store, 3, 10), "the slow stream reads on from 3: kept");
        slow.set(6);
        g.applied(&store, 9);
        assert!(g.reads_store(&store, 5, 6) && !g.reads_store(&store, 6, 10));
        drop(slow);
        g.applied(&store, 9);
        assert!(g.reads_store(&store, 9, 10), "the slow stream ended: nothing held");
        assert_eq!(logs.shared.cache_budget.bytes(), 0);
        assert_eq!(g.read(&store, 0, 10, usize::MAX).unwrap(), entries(0, 10, 100));
    }

    /// A data directory written before retained records existed names its retained entries in
    /// its layout: a start takes them from there, and rewrites them in the current form.
    #[tokio::test]
    async fn retained_entries_named_by_an_older_layout_survive_two_starts() {
        let dir = tempfile::tempdir().unwrap();
        let open = || {
            let (store, recovery) = Store::open(dir.path(), StoreOptions::default()).unwrap();
            let logs = RaftLogs::open(store.clone(), &recovery.queues).unwrap();
            (store, logs)
        };
        {
            let (store, logs) = open();
            let g = logs.group(9).unwrap();
            let done = {
                let mut inner = g.inner.lock();
                let ticket = inner.append(&store, g.log_queue(), g.state_queue(), 256, entries(0, 10, 50)).unwrap();
                inner.pinned.extend([2, 5]);
                inner.purge(&store, g.log_queue(), g.state_queue(), LogId::new(LeaderId::new(1, 1), 7)).unwrap();
                // The older form: the layout names the retained entries, no retained record does.
                let mut batch = Batch::new();
                let mut layout = inner.layout(&[]);
                layout.retained = Some(runs_of(inner.retained.iter().map(|(i, s)| (*i, s))));
                let record = codec::encode_layout(&layout);
                let mut live = inner.layout_record;
                put_state_record(&mut batch, g.state_queue(), &mut inner.next_state_seq, &mut live, &record);
                for (seq, len) in inner.retained_records.drain(..) {
                    batch.ack(g.state_queue(), seq, len);
                }
                ticket.max(store.append(&mut batch).unwrap())
            };
            logs.shared.durable(done).await.unwrap();
            store.close().unwrap();
        }
        for start in 0..2 {
            let (store, logs) = open();
            assert_eq!(logs.recovery_stats().retained, 2, "start {start}");
            for i in [2, 5] {
                assert_eq!(logs.read_entry(9, i).unwrap(), Some(entries(i, 1, 50).remove(0)), "start {start}: entry {i}");
            }
            let g = logs.group(9).unwrap();
            {
                let inner = g.inner.lock();
                assert_eq!(inner.retained_records.len(), 1, "start {start}: one record names the set");
                assert_eq!(inner.slots.len(), 2, "start {start}: entries 8 and 9 are the log");
            }
            let ticket = g.inner.lock().save_hard(&store, g.state_queue(), |_| {}).unwrap();
            logs.shared.durable(ticket).await.unwrap();
            store.close().unwrap();
        }
    }

    /// A group that never applies (a follower that never learns the commit) keeps at most its
    /// budget of readable entries; a removed group gives its bytes back.
    #[tokio::test]
    async fn readable_entries_past_the_group_budget_go_unapplied() {
        let (_dir, store, logs) = open_logs();
        let g = logs.group(6).unwrap();
        let entry = 256 << 10;
        let count = 2 * cache::GROUP_CACHE_BYTES / entry as u64;
        let mut ticket = 0;
        for i in 0..count {
            ticket = g.inner.lock().append(&store, g.log_queue(), g.state_queue(), 256, entries(i, 1, entry)).unwrap();
        }
        wait_readable(&logs, ticket).await;
        assert!(g.reads_store(&store, 0, 1));
        let cached = logs.shared.cache_budget.bytes();
        assert!(cached <= cache::GROUP_CACHE_BYTES, "{cached} bytes cached");
        assert!(cached > cache::GROUP_CACHE_BYTES - entry as u64, "the budget's worth stays: {cached} bytes cached");
        logs.remove_group(6).unwrap();
        assert_eq!(logs.shared.cache_budget.bytes(), 0);
    }
}
