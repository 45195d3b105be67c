//! A queue: ready messages in order, its consumers, and the rules applied on the way in
//! (max-length, overflow) and on the way out (TTL, dead-lettering, round-robin delivery).
//!
//! Each queue has its own lock; nothing on the publish path takes a global lock. Work that
//! reaches other queues (dead-lettering, auto-delete) is collected under the lock and carried
//! out after it is released, so queues never lock each other.
//!
//! Memory is bounded whatever the backlog: a queue keeps at most a window of ready messages in
//! memory (`WINDOW_MESSAGES`, and a share of `WINDOW_BUDGET_BYTES` that shrinks as queues are added,
//! see [`window_bytes`]). Once the window is full, newer messages go only to
//! the store (the "span": seqs `[span_from, next_seq)`), and the queue reads them back in order
//! as the window drains. Ready messages = window, then span; every window seq is below `span_from`.

pub mod body_memory;
pub mod remote;
pub mod quorum;
mod rewind;

pub use rewind::RewindOutcome;

use crate::channel::{Channel, Consumer, Settle};
use crate::consumers::Consumers;
use crate::lane::{Lane, Levels};
use crate::message::Message;
use warren_protocol::properties::PropertiesView;
use crate::deadletter::{DeadLetter, DeathReason};
use crate::error::{BrokerError, Result};
use crate::message::{decode_stored, MessageRef};
use crate::publisher::Publisher;
use crate::queue_args::{Overflow, QueueArgs};
use crate::vhost::VHost;
use parking_lot::Mutex;
use std::sync::{Arc, Weak};
use warren_protocol::field::FieldTable;
use warren_store::{Batch, ReadBatch, RecoveredQueue, Store, StoreError, SyncTicket};

/// Most ready messages a queue holds in memory; the rest waits in the store.
pub const WINDOW_MESSAGES: usize = 2048;

/// Publishers held back by a slow no-ack consumer pause at this many waiting messages and go on at
/// `FLOW_RESUME_AT` (see `QueueState::publishers_must_wait`).
const FLOW_PAUSE_AT: usize = WINDOW_MESSAGES / 2;
const FLOW_RESUME_AT: usize = WINDOW_MESSAGES / 4;

/// How far ahead of the deliveries the delivered mark is kept (see `Queue::delivery_marked`): a mark
/// record per 1,024 deliveries, and after a restart at most this many never-delivered messages flagged
/// redelivered.
const MARK_STEP: u64 = 2048;
/// Body bytes of ready messages all queues together may hold in memory...
pub const WINDOW_BUDGET_BYTES: u64 = 128 << 20;
/// ... and at most this much per queue, at least `WINDOW_MIN_BYTES`.
pub const WINDOW_MAX_BYTES: u64 = 8 << 20;
pub const WINDOW_MIN_BYTES: u64 = 64 << 10;

/// Queues that exist now, to share the window budget.
static QUEUES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A queue's window in bytes: its share of the budget (one queue: 8 MiB; a thousand: 128 KiB each).
pub fn window_bytes() -> u64 {
    let n = QUEUES.load(std::sync::atomic::Ordering::Relaxed).max(1);
    (WINDOW_BUDGET_BYTES / n).clamp(WINDOW_MIN_BYTES, WINDOW_MAX_BYTES)
}

/// A message in a queue (ready or delivered and not yet settled).
#[derive(Debug)]
pub struct Entry {
    pub message: MessageRef,
    /// Position in this queue (and its seq in the store): requeued messages go back to where they were.
    pub seq: u64,
    /// Payload bytes the store holds for it; 0 if it is not in the store.
    pub stored_bytes: u64,
    pub expires_at_ms: Option<u64>,
    pub redelivered: bool,
    /// How many times it came back to this queue unacknowledged (rejected or nacked with requeue, its
    /// channel closed, a CMQ lease ended) since this node took it: CMQ's `dequeueCount` is one more.
    /// Not stored: after a restart a message counts from its redelivered flag again.
    pub returned: u32,
}

impl Entry {
    /// Records in `acks` that this message is gone from queue `queue`, if the store has it.
    fn settle_in_store(&self, queue: u64, acks: &mut Batch) {
        if self.stored_bytes > 0 {
            acks.ack(queue, self.seq, self.stored_bytes);
        }
    }
}

/// The result of offering a message to a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// Taken; durable once the store reaches the ticket (if any). `slow_publishers`: the queue asks
    /// its publishers to pause (see `QueueState::publishers_must_wait`). `store_behind`: it was written
    /// to the store, which has more waiting to be written than it wants (`Store::is_behind`): the
    /// publisher should wait for `Store::caught_up` before sending more.
    Accepted { ticket: Option<SyncTicket>, slow_publishers: bool, store_behind: bool },
    /// Refused by `x-overflow: reject-publish(-dlx)`: the publisher gets a basic.nack.
    Rejected,
}

/// What basic.get found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Got {
    /// basic.get-ok went to the channel.
    Message,
    /// Nothing ready: the caller answers basic.get-empty.
    Empty,
    /// The head needs something first; await [`Queue::wait_for`] and call `get` again.
    Later(GetWait),
    /// The queue could not be asked (a classic queue's home node did not answer): the channel
    /// closes with 404 and this text, rather than say get-empty of a queue that may hold messages.
    Failed(String),
}

/// What a basic.get waits for (asynchronously, off the queue lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetWait {
    /// The store's durable watermark reaching this ticket (the head's delivered mark).
    Durable(SyncTicket),
    /// A read of the queue's backlog from the store (every window is empty meanwhile): one more read
    /// finished than this count of them.
    Refill(u64),
    /// The store's readable watermark reaching this ticket: the head is in the store, appended a
    /// moment ago, and not yet visible to `Store::read` (the writer applies appends after their fsync).
    Readable(SyncTicket),
    /// A quorum queue's Dequeue (this basic.get's id) being committed and applied (`replica`).
    Replicated(u64),
    /// A classic queue's home node answering this basic.get (`remote::get`).
    Remote(u64),
}

/// What `Queue::select_head` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Head {
    /// The current lane's window holds the message to deliver next.
    Ready,
    /// No ready message.
    Empty,
    /// The next messages (of the highest level holding any) are being read from the store
    /// (`refill_locked`); the read's merge delivers them.
    Refilling,
    /// The next message (of the highest level holding any) is in the store but not readable yet; it
    /// is once the store's readable watermark reaches this ticket.
    Unreadable(SyncTicket),
}

struct QueueState {
    /// The current lane (a classic queue's only one); `QueueState` reads as it (`Deref`).
    lane: Lane,
    /// A priority queue's other lanes (see `lane`).
    levels: Levels,
    /// A task waits for the mark's fsync to resume dispatching.
    mark_waiter: bool,
    /// A task waits for the store to make the head readable to resume dispatching.
    readable_waiter: bool,
    /// Reads of a span merged so far (see `refilled_from_store`): what a waiting basic.get watches.
    refills_done: u64,
    /// Consumers with credit could not take more because their connections' outgoing buffers are
    /// full (a consumer reading slower than publishers write): publishers are slowed (see
    /// `QueueState::publishers_must_wait`).
    held_back: bool,
    /// A publisher waits on `drained`.
    publisher_waiting: bool,
    /// A publisher waited the longest pause and the consumers made no progress: they are stalled, not
    /// slow, and publishers go on (the queue keeps the messages) until a delivery succeeds again.
    consumers_stalled: bool,
    /// Who gets the next message: priorities, round-robin, single active consumer (`consumers`).
    consumers: Consumers,
    unacked: u64,
    had_consumers: bool,
    /// For `x-expires`: the last time the queue was used (consume, get, declare).
    last_used_ms: u64,
    deleted: bool,
}

impl std::ops::Deref for QueueState {
    type Target = Lane;
    fn deref(&self) -> &Lane {
        &self.lane
    }
}

impl std::ops::DerefMut for QueueState {
    fn deref_mut(&mut self) -> &mut Lane {
        &mut self.lane
    }
}

impl QueueState {
    /// Makes `level` the current lane (a priority queue; nothing for a classic one).
    fn select(&mut self, level: usize) {
        self.levels.select(&mut self.lane, level);
    }

    /// Makes the highest lane holding ready messages current.
    fn select_highest(&mut self) {
        let highest = self.levels.non_empty_desc(&self.lane).next();
        if let Some(level) = highest {
            self.select(level);
        }
    }

    /// Whether publishers to this queue should pause: its consumers could take more but their
    /// connections cannot (a no-ack consumer whose socket is slower than the publishers), they are not
    /// stalled, and a good part of the window is waiting. RabbitMQ's credit flow has the same effect:
    /// the queue stops taking messages from publishers while it is blocked delivering. Queues without
    /// consumers, or whose consumers are at their prefetch limit, never slow publishers: their backlog
    /// goes to disk.
    fn publishers_must_wait(&self) -> bool {
        self.held_back && !self.consumers_stalled && self.ready.len() >= FLOW_PAUSE_AT
    }
}

/// The connection that owns an exclusive queue: a connection of one run of one node (in a cluster,
/// the queue is known on every node, and only its owner may use it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    /// The owner's node's run (`crate::run_id`).
    pub run: u64,
    pub connection: u64,
}

impl Owner {
    /// Connection `connection` of this node's current run.
    pub fn here(connection: u64) -> Owner {
        Owner { run: crate::run_id(), connection }
    }
}

pub struct Queue {
    pub name: String,
    /// Stable id: the store tags this queue's messages with it.
    pub id: u64,
    pub durable: bool,
    /// The owner of an exclusive queue.
    pub exclusive_owner: Option<Owner>,
    pub auto_delete: bool,
    /// Arguments as declared (for redeclare equivalence and listing).
    pub arguments: FieldTable,
    pub args: QueueArgs,
    vhost: Weak<VHost>,
    /// The node's shared message log; only durable queues write messages to it.
    store: Store,
    state: Mutex<QueueState>,
    /// Wakes publishers slowed by `held_back` once the window has drained.
    drained: tokio::sync::Notify,
    /// Wakes basic.gets waiting for a read of a span (`GetWait::Refill`).
    refilled: tokio::sync::Notify,
    /// This queue, for the blocking task that reads its spans (`refill_locked`).
    me: Weak<Queue>,
    /// A quorum queue: its replica does the queue's work (`replica`), and the classic state above
    /// stays empty. None: a classic queue.
    replica: Option<quorum::QuorumReplica>,
    /// A classic queue in a cluster: its home node (`remote`). Set once, at declaration.
    home: std::sync::OnceLock<remote::RemoteHome>,
    /// A transient queue of a cluster, recorded in the metadata group (`QueueDef::transient`).
    transient: std::sync::OnceLock<crate::definitions::TransientDef>,
    /// A quorum queue on a node outside its group: the member its consumers and basic.gets go
    /// through (`remote::relay`), set at the first of them.
    member_relay: std::sync::OnceLock<remote::RemoteHome>,
    /// Messages published to, delivered from and acknowledged on this queue (the management
    /// API's rates).
    pub stats: crate::stats::QueueStats,
    /// One rewind at a time (`rewind`).
    rewinding: tokio::sync::Mutex<()>,
}

/// A read of a lane's span, and the store's durable watermark just before it: messages become readable
/// only after their fsync, so a read that found nothing is worth repeating only once the watermark has
/// moved past this.
struct SpanRead {
    watermark: SyncTicket,
    read: std::result::Result<ReadBatch, StoreError>,
}

/// Work found under the queue lock, done after it is released.
#[derive(Default)]
struct AfterUnlock {
    dead: Vec<DeadLetter>,
    acks: Batch,
    cancelled: Vec<Arc<Consumer>>,
    auto_delete: bool,
    /// Dispatch again (a consumer took over).
    dispatch: bool,
}

impl Queue {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: String,
        id: u64,
        durable: bool,
        exclusive_owner: Option<Owner>,
        auto_delete: bool,
        arguments: FieldTable,
        args: QueueArgs,
        vhost: Weak<VHost>,
        store: Store,
        now_ms: u64,
    ) -> Arc<Queue> {
        Self::build(name, id, durable, exclusive_owner, auto_delete, arguments, args, vhost, store, now_ms, None)
    }

    /// A quorum queue (`x-queue-type: quorum`; durable, neither exclusive nor auto-delete): its Raft
    /// group is started by the node's quorum host.
    #[allow(clippy::too_many_arguments)]
    pub fn new_quorum(
        name: String,
        id: u64,
        arguments: FieldTable,
        args: QueueArgs,
        vhost: Weak<VHost>,
        store: Store,
        runtime: Arc<quorum::QuorumRuntime>,
        recorded: quorum::Recorded,
    ) -> Arc<Queue> {
        let replica = quorum::QuorumReplica::new(&name, id, store.clone(), &args, runtime, recorded);
        Self::build(name, id, true, None, false, arguments, args, vhost, store, crate::now_ms(), Some(replica))
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        name: String,
        id: u64,
        durable: bool,
        exclusive_owner: Option<Owner>,
        auto_delete: bool,
        arguments: FieldTable,
        args: QueueArgs,
        vhost: Weak<VHost>,
        store: Store,
        now_ms: u64,
        replica: Option<quorum::QuorumReplica>,
    ) -> Arc<Queue> {
        QUEUES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let consumers = Consumers::new(args.single_active_consumer);
        let (lane, levels) = Levels::new(id, args.max_priority);
        Arc::new_cyclic(|me| Queue {
            me: me.clone(),
            refilled: tokio::sync::Notify::new(),
            name,
            id,
            durable,
            exclusive_owner,
            auto_delete,
            arguments,
            args,
            vhost,
            store,
            state: Mutex::new(QueueState {
                lane,
                levels,
                mark_waiter: false,
                readable_waiter: false,
                refills_done: 0,
                held_back: false,
                publisher_waiting: false,
                consumers_stalled: false,
                consumers,
                unacked: 0,
                had_consumers: false,
                last_used_ms: now_ms,
                deleted: false,
            }),
            drained: tokio::sync::Notify::new(),
            replica,
            home: std::sync::OnceLock::new(),
            transient: std::sync::OnceLock::new(),
            member_relay: std::sync::OnceLock::new(),
            stats: Default::default(),
            rewinding: tokio::sync::Mutex::new(()),
        })
    }

    /// A classic queue in a cluster lives on node `home` (`remote`): on other nodes its messages are
    /// forwarded there, and consumers are refused.
    pub fn set_home(&self, home: u64, runtime: Arc<quorum::QuorumRuntime>) {
        if self.replica.is_none() {
            let _ = self.home.set(remote::RemoteHome::new(home, runtime));
        }
    }

    /// A transient queue of a cluster: recorded in the metadata group, so every node knows it (set
    /// once, at declaration).
    pub fn set_transient(&self, def: crate::definitions::TransientDef) {
        let _ = self.transient.set(def);
    }

    pub fn transient_def(&self) -> Option<crate::definitions::TransientDef> {
        self.transient.get().copied()
    }

    /// Whether the queue is in the metadata log (and, in a cluster, the metadata group): durable, or
    /// transient in a cluster. Its deletion and its bindings from durable exchanges go there too.
    pub fn recorded(&self) -> bool {
        self.durable || self.transient.get().is_some()
    }

    /// The home node of a classic queue in a cluster (None: standalone, or a quorum queue).
    pub fn home_node(&self) -> Option<u64> {
        self.home.get().map(|h| h.home())
    }

    /// The forwarding side, when this classic queue's home is another node.
    pub fn remote_home(&self) -> Option<&remote::RemoteHome> {
        self.home.get().filter(|h| h.is_elsewhere())
    }

    /// Where this node's consumers of the queue are relayed from: a classic queue's home on another
    /// node, or the member a quorum queue outside whose group this node is relays them through.
    pub fn relay_side(&self) -> Option<&remote::RemoteHome> {
        self.remote_home().or_else(|| self.member_relay.get())
    }

    /// A quorum queue on a node outside its group: the member relay, set up at the first consumer
    /// or basic.get (None on a member, or with no member to relay through).
    fn member_relay(&self) -> Option<&remote::RemoteHome> {
        let r = self.replica.as_ref().filter(|r| r.is_outside_group())?;
        if let Some(relay) = self.member_relay.get() {
            return Some(relay);
        }
        let member = r.relay_member(None)?;
        Some(self.member_relay.get_or_init(|| remote::RemoteHome::through_member(member, r.runtime())))
    }

    /// The members of a quorum queue's group recorded at its declaration (`QueueDef::members`).
    pub fn recorded_members(&self) -> Option<Vec<u64>> {
        self.replica.as_ref().and_then(|r| r.recorded_members())
    }

    /// A quorum queue's group has other members from now on (`metadata::Op::QueueMembers`): the
    /// node's quorum host moves the group to them.
    pub fn set_recorded_members(&self, members: Vec<u64>) {
        let Some(r) = &self.replica else { return };
        r.set_recorded_members(members);
        if let Some(host) = r.runtime().host() {
            host.members_changed(self.id);
        }
    }

    /// Whether a quorum queue's members were changed since its declaration (`QueueDef::members_changed`).
    pub fn members_changed(&self) -> bool {
        self.replica.as_ref().is_some_and(|r| r.members_changed())
    }

    /// This node left the quorum queue's group (see `QuorumReplica::leave_group`).
    pub fn leave_group(self: &Arc<Self>) {
        if let Some(r) = &self.replica {
            r.leave_group(self);
        }
    }

    /// The member recorded at the declaration to lead a quorum queue's group first (`QueueDef::leader`).
    pub fn recorded_leader(&self) -> Option<u64> {
        self.replica.as_ref().and_then(|r| r.recorded_leader())
    }

    /// A quorum queue with a replica on this node (a member of its group, or not known otherwise yet).
    pub fn has_replica_here(&self) -> bool {
        self.replica.as_ref().is_some_and(|r| !r.is_outside_group())
    }

    /// Another member of the group to relay through than `avoid` (the one lost), if the group has one.
    pub(crate) fn relay_member_instead_of(&self, avoid: u64) -> Option<u64> {
        self.replica.as_ref().and_then(|r| r.relay_member(Some(avoid)))
    }

    /// Whether this is a quorum queue.
    pub fn is_quorum(&self) -> bool {
        self.replica.is_some()
    }

    pub fn message_count(&self) -> u32 {
        if let Some(r) = &self.replica {
            return r.message_count();
        }
        let st = self.state.lock();
        ready_count(&st).min(u32::MAX as u64) as u32
    }

    /// The consumed messages a queue with `x-retention-seconds` keeps on disk (a rewind could
    /// deliver them again), over its lanes, and when its oldest message on disk was enqueued (a
    /// quorum queue: its oldest retention sample). Zero for other queues, and for a classic queue
    /// homed on another node (its home knows).
    pub fn retention_stats(&self) -> warren_store::RetentionStats {
        if self.args.retention_ms == 0 || self.remote_home().is_some() {
            return warren_store::RetentionStats::default();
        }
        if let Some(r) = &self.replica {
            return r.retention_stats();
        }
        self.store_ids().map(|id| self.store.retention_stats(id)).fold(warren_store::RetentionStats::default(), |a, b| {
            warren_store::RetentionStats { consumed: a.consumed + b.consumed, oldest_ms: a.oldest_ms.into_iter().chain(b.oldest_ms).min() }
        })
    }

    /// A classic queue living on another node: its home's counts for queue.declare-ok (this node's
    /// copy holds nothing). None for a queue whose counts are this node's.
    pub fn home_counts(&self) -> Option<(u32, u32)> {
        self.remote_home().map(|remote| remote.counts(self))
    }

    pub fn consumer_count(&self) -> u32 {
        if let Some(r) = &self.replica {
            return r.consumer_count();
        }
        self.state.lock().consumers.len() as u32
    }

    /// This node's consumers of the queue (the management API lists them).
    pub fn local_consumers(&self) -> Vec<Arc<Consumer>> {
        if let Some(r) = &self.replica {
            return r.local_consumers();
        }
        self.state.lock().consumers.iter().cloned().collect()
    }

    pub fn unacked_count(&self) -> u64 {
        if let Some(r) = &self.replica {
            return r.unacked_count();
        }
        self.state.lock().unacked
    }

    pub fn is_deleted(&self) -> bool {
        if let Some(r) = &self.replica {
            return r.is_deleted();
        }
        self.state.lock().deleted
    }

    // ---- a quorum queue's group (see `replica`) ------------------------------------------

    /// A quorum queue's group runs on this node: proposals go through `replicator` from now on.
    pub fn attach_replicator(self: &Arc<Self>, replicator: Arc<dyn quorum::Replicator>) {
        if let Some(r) = &self.replica {
            r.attach(self, replicator);
        }
    }

    /// Whether `entry` holds a basic.get (`Dequeue`) of one of this node's getters (for a test hook
    /// that delays its apply here, see the server's `QueueMachine::apply`).
    pub fn has_own_dequeue(&self, entry: &[u8]) -> bool {
        self.replica.as_ref().is_some_and(|r| r.has_own_dequeue(entry))
    }

    /// Applies a committed entry of a quorum queue's group; returns the reply for its proposer.
    pub fn apply_replicated(self: &Arc<Self>, index: u64, entry: &bytes::Bytes) -> bytes::Bytes {
        match &self.replica {
            Some(r) => r.apply(self, index, entry),
            None => bytes::Bytes::new(),
        }
    }

    /// A quorum queue's state for a snapshot of its group (without message bodies: the entries
    /// with those of its live messages are pinned in the log, which keeps them).
    pub fn snapshot_replicated(&self) -> bytes::Bytes {
        match &self.replica {
            Some(r) => r.snapshot(),
            None => bytes::Bytes::new(),
        }
    }

    /// Replaces a quorum queue's state by a snapshot's.
    pub fn restore_replicated(&self, snapshot: &[u8]) -> std::result::Result<(), String> {
        match &self.replica {
            Some(r) => r.restore_snapshot(snapshot),
            None => Err(format!("queue '{}' is not a quorum queue", self.name)),
        }
    }

    /// At a start, a quorum queue's state was restored from this node's own snapshot
    /// (`restore_replicated`): the bodies of its live messages that are in the log are found there.
    pub fn restored_at_start(&self) {
        if let Some(r) = &self.replica {
            r.restored_at_start(self);
        }
    }

    /// A snapshot from a peer replaced a quorum queue's state (`restore_replicated`): returns the
    /// first request for the bodies of its live messages this node lacks (None: nothing to fetch).
    /// The caller sends it to a peer (the cluster's body-fetch RPC, answered by
    /// [`Queue::serve_bodies`]) and hands the answers to [`Queue::bodies_fetched`] until it returns
    /// None, before any later entry of the group applies.
    pub fn snapshot_installed(self: &Arc<Self>) -> std::result::Result<Option<bytes::Bytes>, String> {
        match &self.replica {
            Some(r) => r.snapshot_installed(self),
            None => Ok(None),
        }
    }

    /// A peer's answer to a body request: writes the bodies to this node's store; returns the next
    /// request, or None once every live message of the snapshot has its body here. Err: a bad
    /// answer (ask another peer).
    pub fn bodies_fetched(self: &Arc<Self>, request: &[u8], answer: bytes::Bytes) -> std::result::Result<Option<bytes::Bytes>, String> {
        match &self.replica {
            Some(r) => r.bodies_fetched(self, request, answer),
            None => Ok(None),
        }
    }

    /// Answers a peer's body request from this node's store. Blocking: call it off the runtime.
    pub fn serve_bodies(&self, request: &[u8]) -> std::result::Result<bytes::Bytes, String> {
        match &self.replica {
            Some(r) => r.serve_bodies(self, request),
            None => Err(format!("queue '{}' is not a quorum queue", self.name)),
        }
    }

    /// Whether this node can deliver this queue's messages (basic.get, basic.consume): from its
    /// replica of a quorum queue, or through a member of the group when it has none.
    pub fn check_consumable(&self) -> Result<()> {
        match &self.replica {
            Some(r) if r.is_outside_group() => match self.member_relay() {
                Some(_) => Ok(()),
                None => Err(BrokerError::precondition_failed(format!(
                    "quorum queue '{}' has no replica on this node and no member of its group to relay consumers through; \
                     try again once its members are up",
                    self.name
                ))),
            },
            Some(r) => r.check_member(self),
            // A classic queue: on its home, or through it (`remote`).
            None => Ok(()),
        }
    }

    /// Refuses what only the home node of a classic queue can do elsewhere (delete it if empty or unused).
    pub(crate) fn check_home(&self, what: &str) -> Result<()> {
        match self.home.get() {
            Some(h) => remote::not_here(h, &self.name, what),
            None => Ok(()),
        }
    }

    /// A node of the cluster is down: the queue's group returns what its consumers held (proposed
    /// by the group's leader).
    pub fn consumers_down(self: &Arc<Self>, node: u64) {
        if let Some(r) = &self.replica {
            r.consumers_down(self, node);
        }
    }

    fn replica_proposed(self: &Arc<Self>, result: std::result::Result<bytes::Bytes, String>, entry: &[u8], waiters: Vec<quorum::Waiter>) {
        if let Some(r) = &self.replica {
            r.proposed(self, result, entry, waiters);
        }
    }

    /// The queue was used (redeclared): restarts its `x-expires` countdown. A quorum queue's
    /// countdown is its machine's: a `Touch` is proposed (only if it has `x-expires`).
    pub fn touch(self: &Arc<Self>, now_ms: u64) {
        if let Some(r) = &self.replica {
            if self.args.expires_ms.is_some() {
                r.touch(self, now_ms);
            }
            return;
        }
        self.state.lock().last_used_ms = now_ms;
    }

    /// When a message enqueued at `enqueued_at_ms` expires: the smaller of the queue's
    /// `x-message-ttl` and the message's own `expiration`.
    pub fn expiry_for(&self, message: &MessageRef, enqueued_at_ms: u64) -> Option<u64> {
        let ttl = match (self.args.message_ttl_ms, message.expiration_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        ttl.map(|t| enqueued_at_ms.saturating_add(t))
    }

    /// A message routed to this queue to be ready in `delay_ms`, if this queue holds delayed
    /// messages itself: a quorum queue's group does, replicated and confirmed on a majority (see
    /// `QuorumMachine::fire_due`). None for a classic queue: the node's delay store holds the
    /// message for it (`crate::delay`).
    pub fn publish_delayed(self: &Arc<Self>, message: &MessageRef, stored_header: &[u8], now_ms: u64, delay_ms: u64, publisher: Option<Publisher>) -> Option<Result<Enqueued>> {
        let r = self.replica.as_ref()?;
        Some(r.publish(self, message, stored_header, now_ms, delay_ms, publisher))
    }

    /// Delayed messages this queue holds itself (a quorum queue's group: `publish_delayed`).
    pub fn delayed_in_group(&self) -> u64 {
        self.replica.as_ref().map_or(0, |r| r.delayed_count())
    }

    /// Offers a routed message. `stored_header` is the message's store encoding minus the body
    /// (built once per publish and shared by every queue it goes to).
    ///
    /// `lazy_ok`: the publisher did not ask for a confirm (nor a transaction), so nothing waits for the
    /// message to be durable. Then, while every consumer of the queue is no-ack, a persistent message is
    /// not written at once: it is delivered (settled) in a moment, usually before a write would even have
    /// reached the disk, and written by the next `tick` (100 ms) if it is still waiting, or on close.
    /// RabbitMQ's message store also skips writes of messages consumed before they are flushed.
    pub fn publish(
        self: &Arc<Self>,
        message: &MessageRef,
        stored_header: &[u8],
        now_ms: u64,
        lazy_ok: bool,
        publisher: Option<Publisher>,
    ) -> Result<Enqueued> {
        if let Some(r) = &self.replica {
            return r.publish(self, message, stored_header, now_ms, 0, publisher);
        }
        if let Some(remote) = self.remote_home() {
            return Ok(remote.publish(self, message, now_ms, publisher));
        }
        // A classic queue's confirm needs only the store ticket; `publisher` is for quorum queues.
        let mut after = AfterUnlock::default();
        let outcome = {
            let mut st = self.state.lock();
            if st.deleted {
                return Ok(Enqueued::Accepted { ticket: None, slow_publishers: false, store_behind: false });
            }
            let level = self.level_of(message);
            st.select(level);
            if self.args.overflow != Overflow::DropHead && self.is_full(&st, message.body_len() as u64) {
                if self.args.overflow == Overflow::RejectPublishDlx {
                    let entry = Entry { message: message.clone(), seq: 0, stored_bytes: 0, expires_at_ms: None, redelivered: false, returned: 0 };
                    self.dead_letter_into(&mut after, entry, DeathReason::MaxLen);
                }
                drop(st);
                self.finish(after);
                return Ok(Enqueued::Rejected);
            }
            let seq = st.next_seq;
            st.next_seq += 1;
            let must_be_durable = self.durable && message.persistent;
            let (window_messages, window_bytes) = self.window();
            let paged = st.span_count > 0 || st.ready.len() >= window_messages || st.ready_mem >= window_bytes;
            // Without a confirm (`lazy_ok`), a message for no-ack consumers is written only if it is still
            // waiting at the next tick (see above). A confirmed one is always written before it is
            // confirmed: a delivery is only queued for the consumer's socket here, and a crash before it is
            // written would lose a message the publisher was told is safe.
            let all_no_ack = !st.consumers.is_empty() && st.consumers.receivers().all(|c| c.no_ack);
            let skip_store = must_be_durable && !paged && self.args.retention_ms == 0 && lazy_ok && all_no_ack;
            let ticket;
            let stored_bytes = if (must_be_durable && !skip_store) || paged || self.args.retention_ms > 0 {
                // The store takes a queue's seqs in increasing order: deferred ones go first.
                if st.has_deferred {
                    self.store_deferred_locked(&mut st, now_ms);
                }
                let store_id = st.store_id;
                let t = self.store_message(store_id, &mut st.stored_until, seq, now_ms, stored_header, message)?;
                if paged {
                    st.span_ticket = t;
                }
                ticket = must_be_durable.then_some(t);
                (stored_header.len() + message.body.len()) as u64
            } else {
                ticket = None;
                0
            };
            if paged {
                if st.span_count == 0 {
                    st.span_from = seq;
                }
                st.span_count += 1;
                st.span_bytes += message.body_len() as u64;
                st.span_store_bytes += stored_bytes;
            } else {
                let expires_at_ms = self.expiry_for(message, now_ms);
                st.ready_bytes += message.body_len() as u64;
                st.ready_mem += message.memory_bytes() as u64;
                st.ready.push_back(Entry { message: message.clone(), seq, stored_bytes, expires_at_ms, redelivered: false, returned: 0 });
            }
            self.drop_head_over_limit(&mut st, &mut after);
            self.dispatch_locked(&mut st, now_ms, &mut after);
            st.select(level);
            if skip_store && st.ready.back().is_some_and(|e| e.seq == seq && e.stored_bytes == 0) {
                st.has_deferred = true;
            }
            // TTL 0 (or an already past expiry): what no consumer took right now expires now.
            self.expire_locked(&mut st, now_ms, true, &mut after);
            let store_behind = (stored_bytes > 0 || ticket.is_some()) && self.store.is_behind();
            Enqueued::Accepted { ticket, slow_publishers: st.publishers_must_wait(), store_behind }
        };
        self.finish(after);
        Ok(outcome)
    }

    /// Appends message `seq` to the store. Seqs must reach the store in increasing order (`stored_until`
    /// is the seq after the last one appended): a lower one would be refused by the store and lost on
    /// restart, so it is refused here, loudly, as the bug it is (a deferred message not written before a
    /// later one; see `store_deferred_locked`).
    #[allow(clippy::too_many_arguments)]
    fn store_message(&self, store_id: u64, stored_until: &mut u64, seq: u64, now_ms: u64, stored_header: &[u8], message: &MessageRef) -> Result<SyncTicket> {
        if seq < *stored_until {
            tracing::error!(queue = %self.name, seq, stored_until = *stored_until, "message not stored: its seq is below one already stored (a bug)");
            debug_assert!(false, "queue {}: seq {seq} stored after seq {}", self.name, *stored_until - 1);
            return Err(BrokerError::internal(format!(
                "queue '{}' could not store a message out of order (seq {seq} after {}); this is a bug in Warren",
                self.name,
                *stored_until - 1
            )));
        }
        let ticket = self.store.append_enqueue(store_id, seq, now_ms, &[stored_header, &message.body]).map_err(store_error)?;
        *stored_until = seq + 1;
        Ok(ticket)
    }

    /// Whether the head of the window is a persistent message of this durable queue that is not in the
    /// store yet (see `store_deferred_locked`).
    fn head_is_deferred(&self, st: &QueueState) -> bool {
        self.durable && st.ready.front().is_some_and(|e| e.stored_bytes == 0 && e.message.persistent)
    }

    /// Takes over what the store held for this queue at startup: every live message is in the span,
    /// read back as the window needs it; those that may have been delivered before come back marked
    /// redelivered.
    pub fn restore(&self, recovered: &RecoveredQueue) {
        if let Some(r) = &self.replica {
            return r.restore_bodies(self, recovered);
        }
        let mut st = self.state.lock();
        // A priority queue's levels are store queues `id`, `id` + 1, ... (see `lane`).
        st.select(recovered.queue.saturating_sub(self.id) as usize);
        st.next_seq = recovered.next_seq;
        st.stored_until = recovered.next_seq;
        st.recovered_until = recovered.next_seq;
        st.redelivered_below = recovered.delivered_until;
        st.mark_durable = recovered.delivered_until;
        st.span_from = recovered.first_seq;
        st.span_count = recovered.live_count;
        st.span_store_bytes = recovered.live_bytes;
        // Body bytes are not recorded separately; the stored bytes are a close upper bound.
        st.span_bytes = recovered.live_bytes;
    }

    /// Tops up the current lane's window from its span when it runs low. The read (up to 4 MiB, and a
    /// wait for the queue log's lock, which the store's writer holds while a checkpoint copies records
    /// into the queue's files: on a full disk, until space is back) must hold neither this queue's lock
    /// nor a runtime thread: on a runtime it runs on a blocking thread and `refilled_from_store` merges
    /// it under the lock. Without a runtime (startup, tests) it reads here.
    fn refill_locked(&self, st: &mut QueueState, after: &mut AfterUnlock) {
        let (window_messages, window) = self.window();
        // Rewound messages below the window's head first (`rewind`).
        while st.rewound_due() && !st.refill_in_flight {
            if !self.refill_rewound_locked(st, after) {
                return;
            }
        }
        while st.span_count > 0 && st.ready.len() < window_messages / 2 && st.ready_mem < window / 2 && !st.refill_in_flight {
            if let Some(watermark) = st.refill_found_nothing {
                if !self.store.is_readable(watermark + 1) {
                    return; // nothing new can be readable yet
                }
                st.refill_found_nothing = None;
            }
            let want = window_messages - st.ready.len();
            let budget = (window - st.ready_mem) as usize;
            let (store_id, from, epoch) = (st.store_id, st.span_from, st.span_epoch);
            if let (Ok(rt), Some(me)) = (tokio::runtime::Handle::try_current(), self.me.upgrade()) {
                st.refill_in_flight = true;
                rt.spawn_blocking(move || {
                    let read = me.read_span(store_id, from, want, budget);
                    me.refilled_from_store(store_id, from, epoch, read);
                });
                return;
            }
            let read = self.read_span(store_id, from, want, budget);
            if !self.take_read(st, after, read) {
                return;
            }
        }
    }

    /// Reads a lane's span from `from`, with the readable watermark from before the read (`SpanRead`):
    /// the read saw everything appended up to it, so reading again finds more only once it moved.
    fn read_span(&self, store_id: u64, from: u64, want: usize, budget: usize) -> SpanRead {
        let watermark = *self.store.readable().borrow();
        SpanRead { watermark, read: self.store.read(store_id, from, want, budget) }
    }

    /// Merges a read of a lane's span made off the lock (see `refill_locked`), unless the span changed
    /// meanwhile (purged, deleted: the read is dropped), then delivers.
    fn refilled_from_store(self: &Arc<Self>, store_id: u64, from: u64, epoch: u64, read: SpanRead) {
        self.merge_read(store_id, |me, st, after| {
            if st.span_epoch == epoch && st.span_from == from && me.take_read(st, after, read) {
                me.drop_head_over_limit(st, after);
            }
        });
    }

    /// Merges a read made off the lock into the lane of `store_id` (`take`, which drops a stale
    /// one), then delivers and wakes basic.gets waiting for it.
    fn merge_read(self: &Arc<Self>, store_id: u64, take: impl FnOnce(&Self, &mut QueueState, &mut AfterUnlock)) {
        let mut after = AfterUnlock::default();
        {
            let mut st = self.state.lock();
            st.refills_done += 1;
            if !st.deleted {
                st.select(store_id.saturating_sub(self.id) as usize);
                st.refill_in_flight = false;
                take(self, &mut st, &mut after);
                self.dispatch_locked(&mut st, crate::now_ms(), &mut after);
            }
        }
        self.refilled.notify_waiters();
        self.finish(after);
    }

    /// Puts what a read of the current lane's span returned into its window. False if it found nothing
    /// (an error, or the store's writer has not applied those messages yet: a later read gets them).
    fn take_read(&self, st: &mut QueueState, after: &mut AfterUnlock, read: SpanRead) -> bool {
        let batch = match read.read {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(queue = %self.name, error = %e, "could not read messages back from the store");
                st.refill_found_nothing = Some(read.watermark);
                return false;
            }
        };
        if batch.messages.is_empty() && batch.lost == 0 {
            st.refill_found_nothing = Some(read.watermark);
            return false;
        }
        st.span_from = batch.next_seq;
        // (Holes: seqs a rewind made live without a record, e.g. before a restart; not there.)
        st.span_count = st.span_count.saturating_sub(batch.messages.len() as u64 + batch.lost + batch.holes);
        for m in batch.messages {
            st.span_store_bytes = st.span_store_bytes.saturating_sub(m.payload.len() as u64);
            let stored_bytes = m.payload.len() as u64;
            let Some((message, expires_at_ms)) = self.decode_read(st.store_id, &m, after) else { continue };
            st.span_bytes = st.span_bytes.saturating_sub(message.body_len() as u64);
            if self.lost_to_restart(st, m.seq, &message) {
                after.acks.ack(st.store_id, m.seq, stored_bytes);
                continue;
            }
            st.ready_bytes += message.body_len() as u64;
            st.ready_mem += message.memory_bytes() as u64;
            let redelivered = m.seq < st.redelivered_below;
            st.ready.push_back(Entry { message, seq: m.seq, stored_bytes, expires_at_ms, redelivered, returned: 0 });
        }
        if st.span_count == 0 {
            st.span_bytes = 0;
            st.span_store_bytes = 0;
        }
        true
    }

    /// A message read back from a lane's store queue, with its expiry; an unreadable one is dropped
    /// (acked in the store, logged).
    fn decode_read(&self, store_id: u64, m: &warren_store::StoredMessage, after: &mut AfterUnlock) -> Option<(Arc<Message>, Option<u64>)> {
        let Some(stored) = decode_stored(&m.payload) else {
            tracing::error!(queue = %self.name, seq = m.seq, "unreadable message in the store; dropping it");
            after.acks.ack(store_id, m.seq, m.payload.len() as u64);
            return None;
        };
        let message = Arc::new(stored.message);
        let expires_at_ms = self.expiry_for(&message, stored.expires_at_ms.unwrap_or(m.timestamp_ms));
        Some((message, expires_at_ms))
    }

    /// A transient message the store held from before a restart: it does not survive one.
    fn lost_to_restart(&self, st: &QueueState, seq: u64, message: &Message) -> bool {
        seq < st.recovered_until && !(self.durable && message.persistent)
    }

    /// The store queue ids this queue's messages are written under: one per lane (see `lane`).
    pub fn store_ids(&self) -> std::ops::RangeInclusive<u64> {
        self.id..=self.id + self.args.max_priority as u64
    }

    /// The level (lane) of a message: its priority property, capped at `x-max-priority`; 0 in a classic
    /// queue. Messages without a priority have priority 0, as in RabbitMQ.
    fn level_of(&self, message: &Message) -> usize {
        if self.args.max_priority == 0 {
            return 0;
        }
        let priority = PropertiesView::new(&message.properties).ok().and_then(|v| v.priority()).unwrap_or(0);
        priority.min(self.args.max_priority) as usize
    }

    /// The store queue id an entry of this queue is written under.
    pub(crate) fn store_id_of(&self, entry: &Entry) -> u64 {
        self.id + self.level_of(&entry.message) as u64
    }

    /// A lane's window (messages, bytes): a priority queue's lanes share the budget of one classic
    /// queue (each at least 16 messages and 16 KiB), so memory stays bounded whatever the levels.
    fn window(&self) -> (usize, u64) {
        let bytes = window_bytes();
        if self.args.max_priority == 0 {
            return (WINDOW_MESSAGES, bytes);
        }
        let lanes = self.args.max_priority as u64 + 1;
        ((WINDOW_MESSAGES / lanes as usize).max(16), (bytes / lanes).max(16 << 10))
    }

    /// Makes the lane to deliver from current (the highest priority holding ready messages), with its
    /// window refilled and expired messages dropped (`inclusive`: see `expire_locked`). A lane whose
    /// next messages are being read, or not readable yet (the store writer is a moment behind:
    /// `Store::readable`), is waited for, never passed over: a get-empty or a lower priority first
    /// would be a lie.
    fn select_head(&self, st: &mut QueueState, now_ms: u64, inclusive: bool, after: &mut AfterUnlock) -> Head {
        if !st.levels.is_priority() {
            return self.lane_head(st, now_ms, inclusive, after).unwrap_or(Head::Empty);
        }
        // Highest first, without collecting the levels: this runs once per message dispatched.
        let mut below = st.levels.lane_count();
        loop {
            let next = st.levels.non_empty_desc(&st.lane).find(|&level| level < below);
            let Some(level) = next else { break };
            below = level;
            st.select(level);
            if let Some(head) = self.lane_head(st, now_ms, inclusive, after) {
                return head;
            }
        }
        Head::Empty
    }

    /// The current lane's head, refilled and expired; None if the lane has nothing to deliver.
    fn lane_head(&self, st: &mut QueueState, now_ms: u64, inclusive: bool, after: &mut AfterUnlock) -> Option<Head> {
        self.refill_locked(st, after);
        self.expire_locked(st, now_ms, inclusive, after);
        if st.rewound_due() {
            // (What expired may have uncovered a rewound message below the new head.)
            self.refill_locked(st, after);
            if st.refill_in_flight {
                return Some(Head::Refilling);
            }
        }
        if !st.ready.is_empty() {
            return Some(Head::Ready);
        }
        if st.span_count == 0 {
            return None;
        }
        if st.refill_in_flight {
            return Some(Head::Refilling);
        }
        // A span the store had made readable and a read still did not give back is not there (lost):
        // passed over rather than waited for forever.
        (!self.store.is_readable(st.span_ticket)).then_some(Head::Unreadable(st.span_ticket))
    }

    fn is_full(&self, st: &QueueState, incoming_bytes: u64) -> bool {
        self.args.max_length.is_some_and(|max| ready_count(st) >= max)
            || self.args.max_length_bytes.is_some_and(|max| ready_bytes(st) + incoming_bytes > max)
    }

    fn drop_head_over_limit(&self, st: &mut QueueState, after: &mut AfterUnlock) {
        if self.args.overflow != Overflow::DropHead {
            return;
        }
        loop {
            let over = self.args.max_length.is_some_and(|max| ready_count(st) > max)
                || self.args.max_length_bytes.is_some_and(|max| ready_bytes(st) > max);
            if !over {
                break;
            }
            // The head: of the highest priority, in a priority queue (as RabbitMQ drops).
            st.select_highest();
            self.refill_locked(st, after);
            if st.rewound_due() {
                // The oldest are rewound messages still being read: the read's merge drops them.
                break;
            }
            let Some(entry) = pop_ready(st) else { break };
            self.dead_letter_into(after, entry, DeathReason::MaxLen);
        }
    }

    /// Drops expired messages from the head. `inclusive` also drops those expiring exactly now
    /// (after a delivery attempt, so that TTL 0 means "deliver now or never").
    fn expire_locked(&self, st: &mut QueueState, now_ms: u64, inclusive: bool, after: &mut AfterUnlock) {
        while let Some(head) = st.ready.front() {
            let expired = match head.expires_at_ms {
                Some(at) => at < now_ms || (inclusive && at == now_ms),
                None => false,
            };
            if !expired {
                break;
            }
            if let Some(entry) = pop_ready(st) {
                self.dead_letter_into(after, entry, DeathReason::Expired);
            }
        }
    }

    /// Either dead-letters an entry (if the queue has a DLX) or just drops it; both settle it in the store.
    fn dead_letter_into(&self, after: &mut AfterUnlock, entry: Entry, reason: DeathReason) {
        entry.settle_in_store(self.store_id_of(&entry), &mut after.acks);
        if let Some(exchange) = &self.args.dead_letter_exchange {
            after.dead.push(DeadLetter {
                message: entry.message,
                reason,
                queue: self.name.clone(),
                exchange: exchange.clone(),
                routing_key: self.args.dead_letter_routing_key.clone(),
                settle: None,
            });
        }
    }

    /// Delivers ready messages to consumers with credit, in the order `Consumers::candidates` gives
    /// (priority, then round-robin).
    fn dispatch_locked(self: &Arc<Self>, st: &mut QueueState, now_ms: u64, after: &mut AfterUnlock) {
        loop {
            if st.consumers.is_empty() {
                return;
            }
            match self.select_head(st, now_ms, false, after) {
                Head::Ready => {}
                // The read's merge (`refilled_from_store`) dispatches.
                Head::Empty | Head::Refilling => return,
                Head::Unreadable(ticket) => {
                    self.resume_when_readable(st, ticket);
                    return;
                }
            }
            let mut delivered = false;
            let mut candidates = st.consumers.candidates();
            while let Some((slot, consumer)) = candidates.next(&st.consumers) {
                if !consumer.has_credit() {
                    continue;
                }
                if !consumer.no_ack && self.head_is_deferred(st) {
                    // Deferred entries never become unacked unstored (see `store_deferred_locked`).
                    self.store_deferred_locked(st, now_ms);
                }
                if !self.delivery_marked(st) {
                    self.resume_when_marked(st);
                    return;
                }
                let Some(entry) = pop_ready(st) else { return };
                match consumer.channel.try_deliver(&consumer, entry) {
                    // A no-ack delivery: its connection acks it in the store once written (`AckWhenWritten`).
                    Ok(Some(_consumed)) => {}
                    Ok(None) => st.unacked += 1,
                    Err(entry) => {
                        push_ready_front(st, entry);
                        continue;
                    }
                }
                st.consumers.delivered(slot);
                delivered = true;
                break;
            }
            if !delivered {
                st.held_back = st.consumers.receivers().any(|c| c.has_credit() && !c.channel.has_room());
                return;
            }
            st.consumers_stalled = false;
            if st.publisher_waiting && (!st.held_back || st.ready.len() <= FLOW_RESUME_AT) {
                st.held_back = false;
                st.publisher_waiting = false;
                self.drained.notify_waiters();
            }
        }
    }

    /// Waits until publishers may go on (see `QueueState::publishers_must_wait`), at most `max` at a time.
    pub async fn wait_until_drained(&self, max: std::time::Duration) {
        if let Some(r) = &self.replica {
            return r.wait_until_drained(max).await;
        }
        if let Some(remote) = self.remote_home() {
            return remote.wait_until_drained(max).await;
        }
        let notified = self.drained.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        {
            let mut st = self.state.lock();
            if !st.publishers_must_wait() || st.consumers.is_empty() {
                return;
            }
            st.publisher_waiting = true;
        }
        if tokio::time::timeout(max, notified).await.is_err() {
            self.state.lock().consumers_stalled = true;
        }
    }

    /// Whether the head of the window may be delivered as far as the delivered mark goes: a stored
    /// persistent message may leave only once the store durably says it may have been delivered (else a
    /// crash would bring it back as never delivered). Marks are requested `MARK_STEP` seqs ahead, half a
    /// step early, so a consumer normally never waits for one; after a restart at most that many
    /// never-delivered messages come back flagged redelivered.
    fn delivery_marked(&self, st: &mut QueueState) -> bool {
        let Some(head) = st.ready.front() else { return true };
        if head.stored_bytes == 0 || !(self.durable && head.message.persistent) {
            return true;
        }
        let seq = head.seq;
        if let Some((up_to, ticket)) = st.mark_pending {
            if self.store.is_durable(ticket) {
                st.mark_durable = st.mark_durable.max(up_to);
                st.mark_pending = None;
            }
        }
        if st.mark_pending.is_none() && seq + MARK_STEP / 2 >= st.mark_durable {
            let mut batch = Batch::new();
            batch.delivered(st.store_id, seq + MARK_STEP);
            match self.store.append(&mut batch) {
                Ok(ticket) => st.mark_pending = Some((seq + MARK_STEP, ticket)),
                Err(e) => tracing::error!(queue = %self.name, error = %e, "could not record deliveries in the store"),
            }
        }
        seq < st.mark_durable
    }

    /// Dispatches again once the pending delivered mark is durable.
    fn resume_when_marked(self: &Arc<Self>, st: &mut QueueState) {
        let Some((_, ticket)) = st.mark_pending else { return };
        self.resume_when(st, ticket, Store::durable, |st| &mut st.mark_waiter);
    }

    /// Dispatches again once the store can read the head back (see `Head::Unreadable`).
    fn resume_when_readable(self: &Arc<Self>, st: &mut QueueState, ticket: SyncTicket) {
        self.resume_when(st, ticket, Store::readable, |st| &mut st.readable_waiter);
    }

    /// Dispatches again once the store's `watermark` (durable or readable) reaches `ticket`, from a
    /// task; `waiting` is the state's flag that keeps it to one such task per watermark.
    fn resume_when(
        self: &Arc<Self>,
        st: &mut QueueState,
        ticket: SyncTicket,
        watermark: fn(&Store) -> tokio::sync::watch::Receiver<u64>,
        waiting: fn(&mut QueueState) -> &mut bool,
    ) {
        if *waiting(st) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        *waiting(st) = true;
        let queue = self.clone();
        let mut watermark = watermark(&self.store);
        rt.spawn(async move {
            let _ = watermark.wait_for(|&w| w >= ticket).await;
            *waiting(&mut queue.state.lock()) = false;
            queue.dispatch();
        });
    }

    /// Delivers what can be delivered now (credit came back, a consumer arrived, flow resumed).
    pub fn dispatch(self: &Arc<Self>) {
        if let Some(relay) = self.member_relay.get() {
            relay.dispatch();
        }
        if let Some(r) = &self.replica {
            return r.dispatch(self);
        }
        if let Some(remote) = self.remote_home() {
            return remote.dispatch();
        }
        let mut after = AfterUnlock::default();
        {
            let mut st = self.state.lock();
            if st.deleted {
                return;
            }
            self.dispatch_locked(&mut st, crate::now_ms(), &mut after);
        }
        self.finish(after);
    }

    /// Periodic housekeeping: expire messages whose TTL passed, and report whether the queue
    /// has been unused for longer than `x-expires` (the caller then deletes it).
    pub fn tick(self: &Arc<Self>, now_ms: u64) -> bool {
        if let Some(relay) = self.member_relay.get() {
            relay.tick(self, now_ms);
        }
        if let Some(r) = &self.replica {
            // x-expires of a quorum queue comes from its machine (`Effect::QueueExpired`).
            r.tick(self, now_ms);
            return false;
        }
        if let Some(remote) = self.remote_home() {
            // Its home decides x-expires (nothing is used here), and the copy here holds nothing.
            remote.tick(self, now_ms);
            return false;
        }
        let mut after = AfterUnlock::default();
        let expired_unused = {
            let mut st = self.state.lock();
            if st.deleted {
                return false;
            }
            let lanes = st.levels.lane_count();
            for level in 0..lanes {
                st.select(level);
                // A read that found nothing is tried again at least once per tick.
                st.refill_found_nothing = None;
                self.refill_locked(&mut st, &mut after);
                self.expire_locked(&mut st, now_ms, true, &mut after);
            }
            self.dispatch_locked(&mut st, now_ms, &mut after);
            for level in 0..lanes {
                st.select(level);
                if st.has_deferred {
                    self.store_deferred_locked(&mut st, now_ms);
                }
            }
            self.args.expires_ms.is_some_and(|ttl| {
                st.consumers.is_empty() && now_ms.saturating_sub(st.last_used_ms) >= ttl
            })
        };
        self.finish(after);
        expired_unused
    }

    /// Writes the persistent messages of a durable queue that wait in the window without being in the
    /// store (`publish` with `lazy_ok`, while every consumer is no-ack), in seq
    /// order. Invariant: such messages are only ever in the window, never unacked (`dispatch_locked` and
    /// `get` write them before an ack-mode consumer or basic.get takes one: a requeued one would come
    /// back below seqs stored meanwhile), and they are written before any later seq is, since the store
    /// takes a queue's seqs in increasing order (`store_message`). Returns the ticket of the last write.
    fn store_deferred_locked(&self, st: &mut QueueState, now_ms: u64) -> Option<SyncTicket> {
        st.has_deferred = false;
        if !self.durable {
            return None;
        }
        let mut header = bytes::BytesMut::new();
        let mut ticket = None;
        let Lane { ready, stored_until, store_id, .. } = &mut st.lane;
        for entry in ready.iter_mut().filter(|e| e.stored_bytes == 0 && e.message.persistent) {
            header.clear();
            crate::message::encode_header(&entry.message, Some(now_ms), &mut header);
            match self.store_message(*store_id, stored_until, entry.seq, now_ms, &header, &entry.message) {
                Ok(t) => {
                    entry.stored_bytes = (header.len() + entry.message.body.len()) as u64;
                    ticket = Some(t);
                }
                Err(e) => {
                    tracing::error!(queue = %self.name, error = %e, "could not write a message to the store");
                    break;
                }
            }
        }
        ticket
    }

    /// Writes what `publish` left unstored (see `lazy_ok`): on shutdown, before the store closes.
    pub fn store_lazy(&self) {
        if self.replica.is_some() {
            return; // a quorum queue writes every message as its entry is applied
        }
        let mut st = self.state.lock();
        if !st.deleted {
            for level in 0..st.levels.lane_count() {
                st.select(level);
                self.store_deferred_locked(&mut st, crate::now_ms());
            }
        }
    }

    /// basic.consume: registers a consumer, enforcing exclusivity, then delivers.
    /// `on_registered` runs under the queue lock once the consumer is accepted and before anything
    /// is delivered to it (the server sends basic.consume-ok from there).
    pub fn add_consumer(self: &Arc<Self>, consumer: Arc<Consumer>, on_registered: impl FnOnce()) -> Result<()> {
        if let Some(relay) = self.member_relay() {
            return relay.add_consumer(self, consumer, on_registered);
        }
        if let Some(r) = &self.replica {
            return r.add_consumer(self, consumer, on_registered);
        }
        if let Some(remote) = self.remote_home() {
            return remote.add_consumer(self, consumer, on_registered);
        }
        {
            let mut st = self.state.lock();
            if st.deleted {
                return Err(BrokerError::not_found(format!("no queue '{}'", self.name)));
            }
            // An exclusive consumer excludes every other, and single active consumer excludes exclusive
            // ones (RabbitMQ answers both with 403).
            if st.consumers.iter().any(|c| c.exclusive)
                || (consumer.exclusive && (!st.consumers.is_empty() || self.args.single_active_consumer))
            {
                return Err(BrokerError::access_refused(format!(
                    "queue '{}' in vhost '{}' in exclusive use",
                    self.name,
                    self.vhost_name()
                )));
            }
            st.consumers.add(consumer);
            on_registered();
            st.had_consumers = true;
            st.last_used_ms = crate::now_ms();
        }
        self.dispatch();
        Ok(())
    }

    /// The consumer is gone (cancel, channel closed). An auto-delete queue goes with its last consumer.
    pub fn remove_consumer(self: &Arc<Self>, consumer: &Arc<Consumer>) {
        if let Some(relay) = self.member_relay.get() {
            relay.remove_consumer(self, consumer);
        }
        if let Some(r) = &self.replica {
            return r.remove_consumer(self, consumer);
        }
        if let Some(remote) = self.remote_home() {
            return remote.remove_consumer(self, consumer);
        }
        let mut after = AfterUnlock::default();
        {
            let mut st = self.state.lock();
            if st.consumers.remove(consumer) {
                // With single active consumer another may have taken over: it gets what is waiting.
                after.dispatch = self.args.single_active_consumer;
            }
            st.last_used_ms = crate::now_ms();
            if self.auto_delete && st.had_consumers && st.consumers.is_empty() && !st.deleted {
                after.auto_delete = true;
            }
        }
        self.finish(after);
    }

    /// basic.get: takes the head (if any) for `channel`. Nothing when the channel already holds as many
    /// unacknowledged bytes as it may (`UNACKED_BYTES_LIMIT`) and this one would be acknowledged. Never
    /// waits: when the head may leave only once something is on disk, it returns [`Got::Later`]; the
    /// caller awaits [`Queue::wait_for`] and asks again (holding back what the client sent after the
    /// basic.get, so replies stay in order).
    pub fn get(self: &Arc<Self>, channel: &Channel, no_ack: bool) -> Got {
        if !no_ack && channel.unacked_full() {
            return Got::Empty;
        }
        if let Some(relay) = self.member_relay() {
            return relay.get(self, channel, no_ack);
        }
        if let Some(r) = &self.replica {
            return r.get(self, channel, no_ack);
        }
        if let Some(remote) = self.remote_home() {
            return remote.get(self, channel, no_ack);
        }
        let mut after = AfterUnlock::default();
        let got = {
            let mut st = self.state.lock();
            let now = crate::now_ms();
            st.last_used_ms = now;
            let wait = match self.select_head(&mut st, now, true, &mut after) {
                Head::Ready | Head::Empty => None,
                // The next messages are being read from the store (`refill_locked`).
                Head::Refilling => Some(GetWait::Refill(st.refills_done)),
                Head::Unreadable(ticket) => Some(GetWait::Readable(ticket)),
            };
            if let Some(wait) = wait {
                drop(st);
                self.finish(after);
                return Got::Later(wait);
            }
            if !no_ack && self.head_is_deferred(&st) {
                // It becomes unacked: it must be in the store before anything could requeue it (see
                // `store_deferred_locked`), and then it needs its delivered mark too.
                self.store_deferred_locked(&mut st, now);
            }
            // The head's delivered mark must be durable first (see `delivery_marked`): once per 1,024
            // gets, the caller waits for that one fsync.
            if !self.delivery_marked(&mut st) {
                if let Some((_, ticket)) = st.mark_pending {
                    drop(st);
                    self.finish(after);
                    return Got::Later(GetWait::Durable(ticket));
                }
            }
            match pop_ready(&mut st) {
                None => Got::Empty,
                Some(entry) => {
                    let remaining = ready_count(&st).min(u32::MAX as u64) as u32;
                    match channel.deliver_get(self, entry, no_ack, remaining) {
                        // no-ack: the connection acks it in the store once written (`AckWhenWritten`).
                        Some(_consumed) => {}
                        None => st.unacked += 1,
                    }
                    Got::Message
                }
            }
        };
        self.finish(after);
        got
    }

    /// Returns once what a [`Got::Later`] asked for is there (or can no longer come: the store closed).
    pub async fn wait_for(&self, wait: GetWait) {
        match wait {
            GetWait::Durable(ticket) => {
                let mut durable = self.store.durable();
                let _ = durable.wait_for(|&d| d >= ticket).await;
            }
            GetWait::Refill(done) => loop {
                let notified = self.refilled.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let finished = {
                    let st = self.state.lock();
                    st.refills_done != done || st.deleted
                };
                if finished {
                    return;
                }
                notified.await;
            },
            GetWait::Readable(ticket) => {
                let mut readable = self.store.readable();
                let _ = readable.wait_for(|&r| r >= ticket).await;
            }
            GetWait::Replicated(get) => {
                if let Some(r) = &self.replica {
                    r.wait_get(get).await;
                }
            }
            GetWait::Remote(get) => {
                if let Some(remote) = self.relay_side() {
                    remote.wait_get(get).await;
                }
            }
        }
    }

    /// Settles delivered entries (ack, or reject with/without requeue). Store acks go into `acks`
    /// for the caller to append once for all queues it settled. Returns the ticket of acks this call
    /// appended itself (those of messages rejected without requeue), which a transaction waits for.
    /// A quorum queue proposes the settlement instead and, for a transaction (`publisher`), tells
    /// its session once applied.
    pub fn settle(self: &Arc<Self>, entries: Vec<Entry>, how: Settle, acks: &mut Batch, publisher: Option<Publisher>) -> Option<SyncTicket> {
        if let Some(relay) = self.member_relay.get() {
            // What came through a member goes back to it; the rest is this node's replica's (it
            // joined the group since: `warren ctl grow`, `remove-node`).
            let (relayed, own): (Vec<Entry>, Vec<Entry>) = entries.into_iter().partition(|e| e.seq & remote::relay::RELAY_SEQ != 0);
            if !relayed.is_empty() {
                relay.settle(self, relayed, how);
            }
            if let Some(r) = self.replica.as_ref().filter(|_| !own.is_empty()) {
                r.settle(self, own, how, publisher);
            }
            return None;
        }
        if let Some(r) = &self.replica {
            r.settle(self, entries, how, publisher);
            return None;
        }
        if let Some(remote) = self.remote_home() {
            remote.settle(self, entries, how);
            return None;
        }
        let mut after = AfterUnlock::default();
        {
            let mut st = self.state.lock();
            st.unacked = st.unacked.saturating_sub(entries.len() as u64);
            for entry in entries {
                match how {
                    _ if st.deleted => {} // the queue's files went with it
                    Settle::Ack => entry.settle_in_store(self.store_id_of(&entry), acks),
                    Settle::Reject { requeue: true } => {
                        let mut entry = entry;
                        entry.redelivered = true;
                        entry.returned = entry.returned.saturating_add(1);
                        st.select(self.level_of(&entry.message));
                        push_ready_sorted(&mut st, entry);
                    }
                    Settle::Reject { requeue: false } => self.dead_letter_into(&mut after, entry, DeathReason::Rejected),
                }
            }
            if matches!(how, Settle::Reject { requeue: true }) && !st.deleted {
                self.drop_head_over_limit(&mut st, &mut after);
            }
        }
        self.finish(after)
    }

    /// queue.purge: drops every ready message; returns how many.
    pub fn purge(self: &Arc<Self>) -> Result<u32> {
        if let Some(r) = &self.replica {
            return r.purge(self);
        }
        if let Some(remote) = self.remote_home() {
            return remote.purge(self);
        }
        let mut after = AfterUnlock::default();
        let n = {
            let mut st = self.state.lock();
            drain_ready(&mut st, &mut after.acks)
        };
        self.append_acks(&mut after.acks);
        Ok(n)
    }

    /// Marks the queue deleted, settles its ready messages in the store and cancels its consumers
    /// (the clients get basic.cancel). Returns the number of ready messages it held.
    pub fn mark_deleted(self: &Arc<Self>) -> u32 {
        if let Some(relay) = self.member_relay.get() {
            relay.deleted(self);
        }
        if let Some(r) = &self.replica {
            return r.delete(self);
        }
        if let Some(remote) = self.remote_home() {
            remote.deleted(self);
        }
        let (n, consumers, mut acks) = {
            let mut st = self.state.lock();
            st.deleted = true;
            let mut acks = Batch::new();
            let n = drain_ready(&mut st, &mut acks);
            // Everything the store holds for this queue goes at once, acked or not.
            acks.clear();
            for store_id in self.store_ids() {
                acks.drop_queue(store_id);
            }
            (n, st.consumers.take_all(), acks)
        };
        self.append_acks(&mut acks);
        for c in consumers {
            c.channel.consumer_cancelled_by_server(&c.tag);
        }
        n
    }

    /// Appends collected store acks (for any queue: the store is shared) and clears the batch. Returns
    /// the ticket they are durable at (None when there was nothing to append).
    pub fn append_acks(&self, acks: &mut Batch) -> Option<SyncTicket> {
        if acks.is_empty() {
            return None;
        }
        let ticket = match self.store.append(acks) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::error!(queue = %self.name, error = %e, "could not record acks in the store");
                None
            }
        };
        acks.clear();
        ticket
    }

    /// Does the work collected under the lock; returns the ticket of the store acks it appended.
    fn finish(self: &Arc<Self>, mut after: AfterUnlock) -> Option<SyncTicket> {
        let ticket = self.append_acks(&mut after.acks);
        let Some(vhost) = self.vhost.upgrade() else { return ticket };
        for c in after.cancelled {
            c.channel.consumer_cancelled_by_server(&c.tag);
        }
        if !after.dead.is_empty() {
            vhost.dead_letter(after.dead);
        }
        if after.auto_delete {
            vhost.delete_queue_unchecked(&self.name);
        } else if after.dispatch {
            self.dispatch();
        }
        ticket
    }

    fn vhost_name(&self) -> String {
        self.vhost.upgrade().map(|v| v.name.clone()).unwrap_or_default()
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        QUEUES.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

fn store_error(e: warren_store::StoreError) -> BrokerError {
    BrokerError::internal(format!("the message store refused the write: {e}"))
}

/// Ready messages: the window and the span, of every lane.
fn ready_count(st: &QueueState) -> u64 {
    let others = if st.levels.is_priority() { st.levels.count_and_bytes().0 } else { 0 };
    st.lane.count() + others
}

/// Body bytes of the ready messages of every lane.
fn ready_bytes(st: &QueueState) -> u64 {
    let others = if st.levels.is_priority() { st.levels.count_and_bytes().1 } else { 0 };
    st.lane.bytes() + others
}

/// Empties every lane, collecting store acks; returns how many messages they held.
fn drain_ready(st: &mut QueueState, acks: &mut Batch) -> u32 {
    let n = ready_count(st).min(u32::MAX as u64) as u32;
    drain_lane(&mut st.lane, acks);
    for lane in st.levels.others_mut() {
        drain_lane(lane, acks);
    }
    n
}

/// Empties a lane's window and span, collecting store acks.
fn drain_lane(lane: &mut Lane, acks: &mut Batch) {
    lane.span_epoch += 1; // a read of the span under way is stale now
    for entry in lane.ready.drain(..) {
        entry.settle_in_store(lane.store_id, acks);
    }
    lane.ready_bytes = 0;
    lane.ready_mem = 0;
    if lane.span_count > 0 {
        acks.ack_range(lane.store_id, lane.span_from, lane.next_seq, lane.span_store_bytes);
    }
    lane.span_count = 0;
    lane.span_bytes = 0;
    lane.span_store_bytes = 0;
    for (start, end) in lane.rewound.take_all() {
        // (Their bytes are not known here: the store's count of live bytes keeps an estimate.)
        acks.ack_range(lane.store_id, start, end, 0);
    }
}

fn pop_ready(st: &mut QueueState) -> Option<Entry> {
    let entry = st.ready.pop_front()?;
    st.ready_bytes = st.ready_bytes.saturating_sub(entry.message.body_len() as u64);
    st.ready_mem = st.ready_mem.saturating_sub(entry.message.memory_bytes() as u64);
    Some(entry)
}

fn push_ready_front(st: &mut QueueState, entry: Entry) {
    st.ready_bytes += entry.message.body_len() as u64;
    st.ready_mem += entry.message.memory_bytes() as u64;
    st.ready.push_front(entry);
}

/// Requeued messages go back to their original position (RabbitMQ's behaviour for classic queues).
fn push_ready_sorted(st: &mut QueueState, entry: Entry) {
    st.ready_bytes += entry.message.body_len() as u64;
    st.ready_mem += entry.message.memory_bytes() as u64;
    let pos = st.ready.partition_point(|e| e.seq < entry.seq);
    st.ready.insert(pos, entry);
}

#[cfg(test)]
mod refill_tests {
    use super::*;
    use crate::channel::{ClientSink, Delivery};
    use std::time::{Duration, Instant};
    use warren_store::sim::SimDisk;
    use warren_store::{Disk, StoreOptions};

    /// Keeps the seqs of what basic.get handed out (the body holds the seq).
    #[derive(Default)]
    struct Gets(parking_lot::Mutex<Vec<u64>>);

    impl ClientSink for Gets {
        fn send(&self, delivery: Delivery) {
            if let Delivery::GetOk { message, .. } = delivery {
                self.0.lock().push(std::str::from_utf8(&message.body).unwrap().parse().unwrap());
            }
        }
    }

    /// The store's writer holds a queue log's lock while a checkpoint copies records into the queue's
    /// files; on a full disk that lasts until space comes back. A refill used to read the store under
    /// the queue's lock on the calling (runtime) thread, so basic.get, publishes and dispatch of that
    /// queue, and the runtime threads they ran on, waited for the disk. Now the read runs on a
    /// blocking thread: gets from the window go on, and the backlog arrives once the disk has room.
    #[test]
    fn a_refill_waiting_for_the_disk_holds_neither_the_queue_nor_the_caller() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _in_runtime = rt.enter();
        let root = tempfile::tempdir().unwrap();
        let sim = SimDisk::new(root.path()).unwrap();
        let opts = StoreOptions { checkpoint_idle_ms: 50, ..StoreOptions::default() };
        let (store, _) = Store::open_on(&root.path().join("store"), opts, Disk::simulated(sim.clone())).unwrap();
        // Not durable: its gets need no delivered mark (which could not become durable on a full disk);
        // what does not fit in its window is still paged to the store.
        let queue = Queue::new("q".into(), 1, false, None, false, FieldTable::default(), QueueArgs::default(), Weak::new(), store.clone(), 0);
        let total = WINDOW_MESSAGES as u64 + 300;
        for seq in 0..total {
            let message = Arc::new(crate::Message {
                exchange: String::new(),
                routing_key: "q".into(),
                properties: bytes::Bytes::from_static(&[0x10, 0x00, 0x02]),
                body: bytes::Bytes::from(seq.to_string()),
                persistent: true,
                expiration_ms: None,
            });
            let mut header = bytes::BytesMut::new();
            crate::message::encode_header(&message, None, &mut header);
            assert!(matches!(queue.publish(&message, &header, 0, false, None).unwrap(), Enqueued::Accepted { .. }));
        }
        let mut sync = Batch::new();
        sync.delivered(7, 1); // any record: once it is durable, the paged messages before it are too
        store.wait_durable(store.append(&mut sync).unwrap()).unwrap();
        assert_eq!(queue.state.lock().span_count, 300, "the last 300 wait in the store");

        // The next quiet checkpoint copies the 300 (a short run) into the queue's own file: it cannot.
        sim.set_full(true);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !store.waiting_for_space() {
            assert!(Instant::now() < deadline, "the checkpoint's write waits for space");
            std::thread::sleep(Duration::from_millis(5));
        }
        let sink = Arc::new(Gets::default());
        let channel = Channel::new(1, 1, sink.clone());
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let (q, ch, handle) = (queue.clone(), channel.clone(), rt.handle().clone());
        let getter = std::thread::spawn(move || {
            let _in_runtime = handle.enter();
            for _ in 0..1100 {
                assert_eq!(q.get(&ch, true), Got::Message);
            }
            done_tx.send(()).unwrap();
        });
        let _ = getter;
        let prompt = done_rx.recv_timeout(Duration::from_secs(5)).is_ok();
        sim.set_full(false);
        assert!(prompt, "basic.get waited for a refill that waits for the disk");

        loop {
            match queue.get(&channel, true) {
                Got::Message => {}
                Got::Empty => break,
                Got::Later(wait) => rt.block_on(queue.wait_for(wait)),
                Got::Failed(e) => panic!("a local queue's get failed: {e}"),
            }
        }
        let seqs = sink.0.lock().clone();
        assert_eq!(seqs, (0..total).collect::<Vec<_>>(), "every message once, in order");
    }
}
