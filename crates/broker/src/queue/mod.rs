//! A queue, whatever its kind: the one interface the broker (channels, routing, vhosts, the HTTP
//! APIs) uses. Each kind lives in its own module behind it:
//!
//! - `classic`: a classic queue on this node (its home): the ready window, the span in the store,
//!   consumers, TTL, max-length, dead-lettering, rewind.
//! - `quorum`: this node's replica of a quorum queue's Raft group.
//! - `remote`: a classic queue homed on another node of a cluster (forwarded to its home), and a
//!   quorum queue on a node outside its group (relayed through a member).
//!
//! `Queue` holds what every kind shares (name, id, flags, arguments, store, stats). Its public
//! methods dispatch in a fixed order: member relay, quorum replica, remote home, classic. A feature
//! such as rewind is one method here and one per kind (`classic_rewind`, `QuorumReplica::rewind`,
//! `RemoteHome::rewind`). A node that joined a quorum group (`warren ctl grow`) keeps its member
//! relay beside its new replica: `settle` splits what each delivered.

pub mod body_memory;
pub mod consumers;
pub mod remote;
pub mod quorum;
mod classic;
mod types;

pub use types::*;

use classic::{ready_count, Classic};

use consumers::Consumer;
use consumers::Consumers;

use crate::message::Message;
use warren_protocol::properties::PropertiesView;
use crate::deadletter::{DeadLetter, DeathReason};
use crate::error::{BrokerError, Result};
use crate::message::{decode_stored, MessageRef};
use crate::publisher::Publisher;
use crate::queue_args::{Overflow, QueueArgs};
use parking_lot::Mutex;
use std::sync::{Arc, Weak};
use warren_protocol::field::FieldTable;
use warren_store::{Batch, ReadBatch, RecoveredQueue, Store, StoreError, SyncTicket};

/// Transient queues' ids start here. They are never in the metadata log, so at a start what the
/// store still holds for one belongs to a queue that ended with the previous run and is dropped;
/// a lower id the metadata log does not know is kept aside instead (see `Broker::open`).
pub const TRANSIENT_QUEUE_IDS: u64 = 1 << 63;

/// Most ready messages a queue holds in memory; the rest waits in the store.
pub const WINDOW_MESSAGES: usize = 2048;

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
    vhost: Weak<dyn QueueHost>,
    /// The node's shared message log; only durable queues write messages to it.
    store: Store,
    /// This queue, for the tasks that read it back from the store (`classic::window`).
    me: Weak<Queue>,
    kind: Kind,
    /// A transient queue of a cluster, recorded in the metadata group (`QueueDef::transient`).
    transient: std::sync::OnceLock<crate::definitions::TransientDef>,
    /// Messages published to, delivered from and acknowledged on this queue (the management
    /// API's rates).
    pub stats: crate::stats::QueueStats,
}

/// What a queue is, with that kind's state.
enum Kind {
    /// A classic queue (`classic`). In a cluster it lives on its home node; the others forward to
    /// it (`remote`), and its state there stays empty.
    Classic(Classic),
    /// A quorum queue: this node's replica of its group (`quorum`), and on a node outside the group
    /// the member its consumers and basic.gets go through (`remote::relay`), set at the first of them.
    Quorum { replica: quorum::QuorumReplica, member_relay: std::sync::OnceLock<remote::RemoteHome> },
}

impl Queue {
    /// A classic queue. `home`: in a cluster, the node it lives on (this one, or another that this
    /// node forwards to).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: String,
        id: u64,
        durable: bool,
        exclusive_owner: Option<Owner>,
        auto_delete: bool,
        arguments: FieldTable,
        args: QueueArgs,
        vhost: Weak<dyn QueueHost>,
        store: Store,
        now_ms: u64,
        home: Option<remote::RemoteHome>,
    ) -> Arc<Queue> {
        let kind = Kind::Classic(Classic::new(id, &args, now_ms, home));
        Self::build(name, id, durable, exclusive_owner, auto_delete, arguments, args, vhost, store, kind)
    }

    /// A quorum queue (`x-queue-type: quorum`; durable, neither exclusive nor auto-delete): its Raft
    /// group is started by the node's quorum host.
    #[allow(clippy::too_many_arguments)]
    pub fn new_quorum(
        name: String,
        id: u64,
        arguments: FieldTable,
        args: QueueArgs,
        vhost: Weak<dyn QueueHost>,
        store: Store,
        runtime: Arc<quorum::QuorumRuntime>,
        recorded: quorum::Recorded,
    ) -> Arc<Queue> {
        let replica = quorum::QuorumReplica::new(&name, id, store.clone(), &args, runtime, recorded);
        let kind = Kind::Quorum { replica, member_relay: std::sync::OnceLock::new() };
        Self::build(name, id, true, None, false, arguments, args, vhost, store, kind)
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
        vhost: Weak<dyn QueueHost>,
        store: Store,
        kind: Kind,
    ) -> Arc<Queue> {
        QUEUES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Arc::new_cyclic(|me| Queue {
            me: me.clone(),
            name,
            id,
            durable,
            exclusive_owner,
            auto_delete,
            arguments,
            args,
            vhost,
            store,
            kind,
            transient: std::sync::OnceLock::new(),
            stats: Default::default(),
        })
    }

    /// This node's replica of a quorum queue's group (None: a classic queue).
    fn replica(&self) -> Option<&quorum::QuorumReplica> {
        match &self.kind {
            Kind::Quorum { replica, .. } => Some(replica),
            Kind::Classic(_) => None,
        }
    }

    /// A classic queue's state (None: a quorum queue).
    fn classic(&self) -> Option<&Classic> {
        match &self.kind {
            Kind::Classic(c) => Some(c),
            Kind::Quorum { .. } => None,
        }
    }

    /// A quorum queue's member relay, once set up (see `member_relay`).
    fn relay_started(&self) -> Option<&remote::RemoteHome> {
        match &self.kind {
            Kind::Quorum { member_relay, .. } => member_relay.get(),
            Kind::Classic(_) => None,
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
        self.classic()?.home.as_ref().map(|h| h.home())
    }

    /// The forwarding side, when this classic queue's home is another node.
    pub fn remote_home(&self) -> Option<&remote::RemoteHome> {
        self.classic()?.home.as_ref().filter(|h| h.is_elsewhere())
    }

    /// Where this node's consumers of the queue are relayed from: a classic queue's home on another
    /// node, or the member a quorum queue outside whose group this node is relays them through.
    pub fn relay_side(&self) -> Option<&remote::RemoteHome> {
        self.remote_home().or_else(|| self.relay_started())
    }

    /// A quorum queue on a node outside its group: the member relay, set up at the first consumer
    /// or basic.get (None on a member, or with no member to relay through).
    fn member_relay(&self) -> Option<&remote::RemoteHome> {
        let Kind::Quorum { replica: r, member_relay } = &self.kind else { return None };
        if !r.is_outside_group() {
            return None;
        }
        if let Some(relay) = member_relay.get() {
            return Some(relay);
        }
        let member = r.relay_member(None)?;
        Some(member_relay.get_or_init(|| remote::RemoteHome::through_member(member, r.runtime())))
    }

    /// The members of a quorum queue's group recorded at its declaration (`QueueDef::members`).
    pub fn recorded_members(&self) -> Option<Vec<u64>> {
        self.replica().and_then(|r| r.recorded_members())
    }

    /// A quorum queue's group has other members from now on (`metadata::Op::QueueMembers`): the
    /// node's quorum host moves the group to them.
    pub fn set_recorded_members(&self, members: Vec<u64>) {
        let Some(r) = self.replica() else { return };
        r.set_recorded_members(members);
        if let Some(host) = r.runtime().host() {
            host.members_changed(self.id);
        }
    }

    /// Whether a quorum queue's members were changed since its declaration (`QueueDef::members_changed`).
    pub fn members_changed(&self) -> bool {
        self.replica().is_some_and(|r| r.members_changed())
    }

    /// This node left the quorum queue's group (see `QuorumReplica::leave_group`).
    pub fn leave_group(self: &Arc<Self>) {
        if let Some(r) = self.replica() {
            r.leave_group(self);
        }
    }

    /// The member recorded at the declaration to lead a quorum queue's group first (`QueueDef::leader`).
    pub fn recorded_leader(&self) -> Option<u64> {
        self.replica().and_then(|r| r.recorded_leader())
    }

    /// A quorum queue with a replica on this node (a member of its group, or not known otherwise yet).
    pub fn has_replica_here(&self) -> bool {
        self.replica().is_some_and(|r| !r.is_outside_group())
    }

    /// Another member of the group to relay through than `avoid` (the one lost), if the group has one.
    pub(crate) fn relay_member_instead_of(&self, avoid: u64) -> Option<u64> {
        self.replica().and_then(|r| r.relay_member(Some(avoid)))
    }

    /// Whether this is a quorum queue.
    pub fn is_quorum(&self) -> bool {
        self.replica().is_some()
    }

    pub fn message_count(&self) -> u32 {
        match &self.kind {
            Kind::Quorum { replica, .. } => replica.message_count(),
            Kind::Classic(c) => ready_count(&c.state.lock()).min(u32::MAX as u64) as u32,
        }
    }

    /// The consumed messages a queue with `x-retention-seconds` keeps on disk (a rewind could
    /// deliver them again), over its lanes, and when its oldest message on disk was enqueued (a
    /// quorum queue: its oldest retention sample). Zero for other queues, and for a classic queue
    /// homed on another node (its home knows).
    pub fn retention_stats(&self) -> warren_store::RetentionStats {
        if self.args.retention_ms == 0 || self.remote_home().is_some() {
            return warren_store::RetentionStats::default();
        }
        if let Some(r) = self.replica() {
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
        match &self.kind {
            Kind::Quorum { replica, .. } => replica.consumer_count(),
            Kind::Classic(c) => c.state.lock().consumers.len() as u32,
        }
    }

    /// This node's consumers of the queue (the management API lists them).
    pub fn local_consumers(&self) -> Vec<Arc<Consumer>> {
        match &self.kind {
            Kind::Quorum { replica, .. } => replica.local_consumers(),
            Kind::Classic(c) => c.state.lock().consumers.iter().cloned().collect(),
        }
    }

    /// The consumers of this node's channels on the queue: on its home (or replica) and relayed
    /// to another node's, with the home's relay consumers among them (the caller tells those by
    /// their channel).
    pub fn consumers_here(&self) -> Vec<Arc<Consumer>> {
        let mut consumers = self.local_consumers();
        if let Some(remote) = self.relay_side() {
            consumers.extend(remote.relayed_consumers());
        }
        consumers
    }

    pub fn unacked_count(&self) -> u64 {
        match &self.kind {
            Kind::Quorum { replica, .. } => replica.unacked_count(),
            Kind::Classic(c) => c.state.lock().unacked,
        }
    }

    pub fn is_deleted(&self) -> bool {
        match &self.kind {
            Kind::Quorum { replica, .. } => replica.is_deleted(),
            Kind::Classic(c) => c.state.lock().deleted,
        }
    }

    // ---- a quorum queue's group (see `replica`) ------------------------------------------

    /// A quorum queue's group runs on this node: proposals go through `replicator` from now on.
    pub fn attach_replicator(self: &Arc<Self>, replicator: Arc<dyn quorum::Replicator>) {
        if let Some(r) = self.replica() {
            r.attach(self, replicator);
        }
    }

    /// Whether `entry` holds a basic.get (`Dequeue`) of one of this node's getters (for a test hook
    /// that delays its apply here, see the server's `QueueMachine::apply`).
    pub fn has_own_dequeue(&self, entry: &[u8]) -> bool {
        self.replica().is_some_and(|r| r.has_own_dequeue(entry))
    }

    /// Applies a committed entry of a quorum queue's group; returns the reply for its proposer.
    pub fn apply_replicated(self: &Arc<Self>, index: u64, entry: &bytes::Bytes) -> bytes::Bytes {
        match self.replica() {
            Some(r) => r.apply(self, index, entry),
            None => bytes::Bytes::new(),
        }
    }

    /// A quorum queue's state for a snapshot of its group (without message bodies: the entries
    /// with those of its live messages are pinned in the log, which keeps them).
    pub fn snapshot_replicated(&self) -> bytes::Bytes {
        match self.replica() {
            Some(r) => r.snapshot(),
            None => bytes::Bytes::new(),
        }
    }

    /// Replaces a quorum queue's state by a snapshot's.
    pub fn restore_replicated(&self, snapshot: &[u8]) -> std::result::Result<(), String> {
        match self.replica() {
            Some(r) => r.restore_snapshot(snapshot),
            None => Err(format!("queue '{}' is not a quorum queue", self.name)),
        }
    }

    /// At a start, a quorum queue's state was restored from this node's own snapshot
    /// (`restore_replicated`): the bodies of its live messages that are in the log are found there.
    pub fn restored_at_start(&self) {
        if let Some(r) = self.replica() {
            r.restored_at_start(self);
        }
    }

    /// A snapshot from a peer replaced a quorum queue's state (`restore_replicated`): returns the
    /// first request for the bodies of its live messages this node lacks (None: nothing to fetch).
    /// The caller sends it to a peer (the cluster's body-fetch RPC, answered by
    /// [`Queue::serve_bodies`]) and hands the answers to [`Queue::bodies_fetched`] until it returns
    /// None, before any later entry of the group applies.
    pub fn snapshot_installed(self: &Arc<Self>) -> std::result::Result<Option<bytes::Bytes>, String> {
        match self.replica() {
            Some(r) => r.snapshot_installed(self),
            None => Ok(None),
        }
    }

    /// A peer's answer to a body request: writes the bodies to this node's store; returns the next
    /// request, or None once every live message of the snapshot has its body here. Err: a bad
    /// answer (ask another peer).
    pub fn bodies_fetched(self: &Arc<Self>, request: &[u8], answer: bytes::Bytes) -> std::result::Result<Option<bytes::Bytes>, String> {
        match self.replica() {
            Some(r) => r.bodies_fetched(self, request, answer),
            None => Ok(None),
        }
    }

    /// Answers a peer's body request from this node's store. Blocking: call it off the runtime.
    pub fn serve_bodies(&self, request: &[u8]) -> std::result::Result<bytes::Bytes, String> {
        match self.replica() {
            Some(r) => r.serve_bodies(self, request),
            None => Err(format!("queue '{}' is not a quorum queue", self.name)),
        }
    }

    /// Whether this node can deliver this queue's messages (basic.get, basic.consume): from its
    /// replica of a quorum queue, or through a member of the group when it has none.
    pub fn check_consumable(&self) -> Result<()> {
        match self.replica() {
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
        match self.classic().and_then(|c| c.home.as_ref()) {
            Some(h) => remote::not_here(h, &self.name, what),
            None => Ok(()),
        }
    }

    /// A node of the cluster is down: the queue's group returns what its consumers held (proposed
    /// by the group's leader).
    pub fn consumers_down(self: &Arc<Self>, node: u64) {
        if let Some(r) = self.replica() {
            r.consumers_down(self, node);
        }
    }

    fn replica_proposed(self: &Arc<Self>, result: std::result::Result<bytes::Bytes, String>, entry: &[u8], waiters: Vec<quorum::Waiter>) {
        if let Some(r) = self.replica() {
            r.proposed(self, result, entry, waiters);
        }
    }

    /// The queue was used (redeclared): restarts its `x-expires` countdown. A quorum queue's
    /// countdown is its machine's: a `Touch` is proposed (only if it has `x-expires`).
    pub fn touch(self: &Arc<Self>, now_ms: u64) {
        match &self.kind {
            Kind::Quorum { replica, .. } => {
                if self.args.expires_ms.is_some() {
                    replica.touch(self, now_ms);
                }
            }
            Kind::Classic(c) => c.state.lock().last_used_ms = now_ms,
        }
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
        let r = self.replica()?;
        Some(r.publish(self, message, stored_header, now_ms, delay_ms, publisher))
    }

    /// Delayed messages this queue holds itself (a quorum queue's group: `publish_delayed`).
    pub fn delayed_in_group(&self) -> u64 {
        self.replica().map_or(0, |r| r.delayed_count())
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
        match &self.kind {
            Kind::Quorum { replica, .. } => replica.publish(self, message, stored_header, now_ms, 0, publisher),
            Kind::Classic(c) => match c.elsewhere() {
                Some(remote) => Ok(remote.publish(self, message, now_ms, publisher)),
                // A classic queue's confirm needs only the store ticket; `publisher` is for quorum queues.
                None => self.classic_publish(c, message, stored_header, now_ms, lazy_ok),
            },
        }
    }

    /// Takes over what the store held for this queue at startup: every live message is in the span,
    /// read back as the window needs it; those that may have been delivered before come back marked
    /// redelivered.
    pub fn restore(&self, recovered: &RecoveredQueue) {
        match &self.kind {
            Kind::Quorum { replica, .. } => replica.restore_bodies(self, recovered),
            Kind::Classic(c) => self.classic_restore(c, recovered),
        }
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

    /// Waits until publishers may go on (see `QueueState::publishers_must_wait`), at most `max` at a time.
    pub async fn wait_until_drained(&self, max: std::time::Duration) {
        match &self.kind {
            Kind::Quorum { replica, .. } => replica.wait_until_drained(max).await,
            Kind::Classic(c) => match c.elsewhere() {
                Some(remote) => remote.wait_until_drained(max).await,
                None => self.classic_wait_until_drained(c, max).await,
            },
        }
    }

    /// Delivers what can be delivered now (credit came back, a consumer arrived, flow resumed).
    pub fn dispatch(self: &Arc<Self>) {
        match &self.kind {
            Kind::Quorum { replica, member_relay } => {
                if let Some(relay) = member_relay.get() {
                    relay.dispatch();
                }
                replica.dispatch(self);
            }
            Kind::Classic(c) => match c.elsewhere() {
                Some(remote) => remote.dispatch(),
                None => self.classic_dispatch(c),
            },
        }
    }

    /// Periodic housekeeping: expire messages whose TTL passed, and report whether the queue
    /// has been unused for longer than `x-expires` (the caller then deletes it).
    pub fn tick(self: &Arc<Self>, now_ms: u64) -> bool {
        match &self.kind {
            Kind::Quorum { replica, member_relay } => {
                if let Some(relay) = member_relay.get() {
                    relay.tick(self, now_ms);
                }
                // x-expires of a quorum queue comes from its machine (`Effect::QueueExpired`).
                replica.tick(self, now_ms);
                false
            }
            Kind::Classic(c) => match c.elsewhere() {
                Some(remote) => {
                    // Its home decides x-expires (nothing is used here), and the copy here holds nothing.
                    remote.tick(self, now_ms);
                    false
                }
                None => self.classic_tick(c, now_ms),
            },
        }
    }

    /// Writes what `publish` left unstored (see `lazy_ok`): on shutdown, before the store closes.
    /// (A quorum queue writes every message as its entry is applied.)
    pub fn store_lazy(&self) {
        if let Kind::Classic(c) = &self.kind {
            self.classic_store_lazy(c);
        }
    }

    /// basic.consume: registers a consumer, enforcing exclusivity, then delivers.
    /// `on_registered` runs under the queue lock once the consumer is accepted and before anything
    /// is delivered to it (the server sends basic.consume-ok from there).
    pub fn add_consumer(self: &Arc<Self>, consumer: Arc<Consumer>, on_registered: impl FnOnce()) -> Result<()> {
        match &self.kind {
            Kind::Quorum { replica, .. } => match self.member_relay() {
                Some(relay) => relay.add_consumer(self, consumer, on_registered),
                None => replica.add_consumer(self, consumer, on_registered),
            },
            Kind::Classic(c) => match c.elsewhere() {
                Some(remote) => remote.add_consumer(self, consumer, on_registered),
                None => self.classic_add_consumer(c, consumer, on_registered),
            },
        }
    }

    /// The consumer is gone (cancel, channel closed). An auto-delete queue goes with its last consumer.
    pub fn remove_consumer(self: &Arc<Self>, consumer: &Arc<Consumer>) {
        match &self.kind {
            Kind::Quorum { replica, member_relay } => {
                if let Some(relay) = member_relay.get() {
                    relay.remove_consumer(self, consumer);
                }
                replica.remove_consumer(self, consumer);
            }
            Kind::Classic(c) => match c.elsewhere() {
                Some(remote) => remote.remove_consumer(self, consumer),
                None => self.classic_remove_consumer(c, consumer),
            },
        }
    }

    /// basic.get: takes the head (if any) for `channel`. Nothing when the channel already holds as many
    /// unacknowledged bytes as it may (`UNACKED_BYTES_LIMIT`) and this one would be acknowledged. Never
    /// waits: when the head may leave only once something is on disk, it returns [`Got::Later`]; the
    /// caller awaits [`Queue::wait_for`] and asks again (holding back what the client sent after the
    /// basic.get, so replies stay in order).
    pub fn get(self: &Arc<Self>, channel: &dyn DeliverySink, no_ack: bool) -> Got {
        if !no_ack && channel.unacked_full() {
            return Got::Empty;
        }
        match &self.kind {
            Kind::Quorum { replica, .. } => match self.member_relay() {
                Some(relay) => relay.get(self, channel, no_ack),
                None => replica.get(self, channel, no_ack),
            },
            Kind::Classic(c) => match c.elsewhere() {
                Some(remote) => remote.get(self, channel, no_ack),
                None => self.classic_get(c, channel, no_ack),
            },
        }
    }

    /// Returns once what a [`Got::Later`] asked for is there (or can no longer come: the store closed).
    pub async fn wait_for(&self, wait: GetWait) {
        match wait {
            GetWait::Durable(ticket) => {
                let mut durable = self.store.durable();
                let _ = durable.wait_for(|&d| d >= ticket).await;
            }
            GetWait::Refill(done) => {
                if let Some(c) = self.classic() {
                    c.refilled_since(done).await;
                }
            }
            GetWait::Readable(ticket) => {
                let mut readable = self.store.readable();
                let _ = readable.wait_for(|&r| r >= ticket).await;
            }
            GetWait::Replicated(get) => {
                if let Some(r) = self.replica() {
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
        match &self.kind {
            Kind::Quorum { replica, member_relay } => {
                match member_relay.get() {
                    Some(relay) => {
                        // What came through a member goes back to it; the rest is this node's
                        // replica's (it joined the group since: `warren ctl grow`, `remove-node`).
                        let (relayed, own): (Vec<Entry>, Vec<Entry>) = entries.into_iter().partition(|e| e.seq & remote::relay::RELAY_SEQ != 0);
                        if !relayed.is_empty() {
                            relay.settle(self, relayed, how);
                        }
                        if !own.is_empty() {
                            replica.settle(self, own, how, publisher);
                        }
                    }
                    None => replica.settle(self, entries, how, publisher),
                }
                None
            }
            Kind::Classic(c) => match c.elsewhere() {
                Some(remote) => {
                    remote.settle(self, entries, how);
                    None
                }
                None => self.classic_settle(c, entries, how, acks),
            },
        }
    }

    /// queue.purge: drops every ready message; returns how many.
    pub fn purge(self: &Arc<Self>) -> Result<u32> {
        match &self.kind {
            Kind::Quorum { replica, .. } => replica.purge(self),
            Kind::Classic(c) => match c.elsewhere() {
                Some(remote) => remote.purge(self),
                None => self.classic_purge(c),
            },
        }
    }

    /// Makes the consumed messages published at or after `to_ms` (unix ms) that the queue's retention
    /// still keeps ready again. Answers once the rewind is durable: it survives a crash.
    pub async fn rewind(self: &Arc<Self>, to_ms: u64) -> Result<RewindOutcome> {
        if let Some(remote) = self.remote_home() {
            return remote.rewind(self, to_ms).await;
        }
        if self.args.retention_ms == 0 {
            return Err(BrokerError::precondition_failed(format!(
                "queue '{}' keeps no consumed messages: declare it with x-retention-seconds (CMQ: rewindSeconds) to rewind it",
                self.name
            )));
        }
        match &self.kind {
            Kind::Quorum { replica, .. } => replica.rewind(self, to_ms).await,
            Kind::Classic(c) => self.classic_rewind(c, to_ms).await,
        }
    }

    /// Marks the queue deleted, settles its ready messages in the store and cancels its consumers
    /// (the clients get basic.cancel). Returns the number of ready messages it held.
    pub fn mark_deleted(self: &Arc<Self>) -> u32 {
        match &self.kind {
            Kind::Quorum { replica, member_relay } => {
                if let Some(relay) = member_relay.get() {
                    relay.deleted(self);
                }
                replica.delete(self)
            }
            Kind::Classic(c) => {
                if let Some(remote) = c.elsewhere() {
                    remote.deleted(self);
                }
                self.classic_mark_deleted(c)
            }
        }
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

    fn vhost_name(&self) -> String {
        self.vhost.upgrade().map(|v| v.host_name().to_string()).unwrap_or_default()
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
