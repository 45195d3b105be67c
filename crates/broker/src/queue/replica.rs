//! This node's replica of a quorum queue (`x-queue-type: quorum`) on the AMQP path.
//!
//! The queue's state is a [`QuorumMachine`] (`crate::quorum`), replicated by the queue's own Raft
//! group (group id = queue id = its store queue id). The broker knows no Raft library: the server
//! starts the group ([`QuorumHost::start`]) and attaches a [`Replicator`] to propose entries
//! through; the group's state machine hands every committed entry to [`Queue::apply_replicated`],
//! on every replica, in log order.
//!
//! - Publishing: a message (its store encoding: header + body) joins the next entry's Enqueue
//!   command of its publisher session. At most `MAX_IN_FLIGHT` entries are proposed at once; what
//!   arrives meanwhile waits for the next entry, so one entry carries a whole burst (group commit).
//!   The Enqueue's reply (after a majority has the entry and it is applied) resolves the pub seqs of
//!   the connection's [`PublisherSession`]: the confirm goes out, or a basic.nack for a reject-publish
//!   refusal or an entry not committed within the Replicator's timeout.
//! - Applying: every replica keeps the entry's message bodies in memory to deliver (within the
//!   node's budget), and frees them once the machine says the message left (ack, dead-letter,
//!   drop). A body is written once per node: as part of its Raft entry, which is in the node's
//!   store already. The replica pins the entry in the log (`Replicator::pin_entry`) while any of its
//!   bodies is live, so a snapshot's purge keeps the entry's record (retained) until the last one
//!   leaves; past the memory budget, and after a restart, bodies are read back from their entries.
//!   The queue's own store records (seq = msg id) hold only the bodies fetched from a peer with a
//!   snapshot (and those an earlier version wrote); replayed entries (a restart) find those
//!   (`stored_until`), loaded by [`Queue::restore`].
//! - Consumers: basic.consume proposes Attach; the machine assigns messages (deterministically, on
//!   every replica) and the replica of the consumer's node hands the `Deliver` effects to the channel,
//!   keeping what the channel cannot take yet (flow, room) in the consumer's backlog. Acks, nacks and
//!   rejects become Settle, Return and Discard commands, batched into the next entry. A no-ack
//!   consumer is an acking consumer to the machine (prefetch `NO_ACK_PREFETCH`) whose deliveries the
//!   replica settles once handed to the channel, so the machine never pushes a whole backlog at it.
//! - basic.get proposes Dequeue; the connection waits ([`GetWait::Replicated`]) until it is applied.
//! - A consumer's channel closing returns its unacked messages (Detach with return: redelivered, not
//!   counted as failed deliveries); after a restart the first entry this node proposes is
//!   `ConsumerDown(this node)`, which returns what its consumers held before.
//! - An entry whose outcome is unknown (its leader stopped or was replaced before answering): its
//!   acks, nacks, rejects and detaches are proposed again (`QuorumReplica::to_propose_again`);
//!   what the group delivers to a consumer this node no longer has goes back with a detach
//!   (`delivered_to_gone`), and such consumers are detached at a tick (`detach_gone_consumers`).
//! - Dead-lettering and TTL expiry ticks are the leader's (dead letters at most once).
//!
//! Memory is bounded whatever the backlog: the node's replicas together hold bodies within one budget
//! (`body_memory::NodeBodies`, from the memory limit); the others are only in the store (in their
//! entries, or as the queue's records) and are read back in batches as they are delivered.

use super::body_memory::{BodyMemory, NodeBodies};
use super::{GetWait, Got, Queue};
use crate::channel::{Channel, Consumer, Settle};
use crate::deadletter::{DeadLetter, DeathReason};
use crate::error::{BrokerError, Result};
use crate::message::{decode_stored, stored_has_expiration, MessageRef};
use crate::publisher::{Publisher, PublisherSession};
use crate::queue::Entry;
use crate::queue_args::QueueArgs;
use crate::quorum::bodies::{BodiesAnswer, BodiesRequest, BodyRecord, MAX_ANSWER_BYTES};
use crate::quorum::{
    run_ids, ready::Run, Attach, Command, ConsumerId, Delivery, Effect, Encoder, MsgId, QueueConfig, QuorumMachine, Reason, Refusal,
    Reply, SessionId, DEFAULT_DELIVERY_LIMIT, MAX_MESSAGES_PER_ENTRY,
};
use bytes::{Bytes, BytesMut};
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::Notify;
use warren_store::{Batch, RecoveredQueue, Store, SyncTicket};

/// What a proposal's `done` receives: the reply bytes of the entry's apply on this node, or why it
/// was not committed (no leader or majority within the replicator's timeout, the group stopped).
pub type ProposeDone = Box<dyn FnOnce(std::result::Result<Bytes, String>) + Send>;

/// A quorum queue's Raft group, as the broker sees it (implemented by the server over openraft).
pub trait Replicator: Send + Sync {
    /// Proposes an entry. `done` is called exactly once, later (never from inside `propose`).
    fn propose(&self, entry: Bytes, done: ProposeDone);
    /// Whether this node leads the group now.
    fn is_leader(&self) -> bool;
    /// Whether this node is a member of the group (applies its entries, holds the bodies). A
    /// node that is not forwards publishes, and relays its consumers through a member.
    fn is_member(&self) -> bool {
        true
    }
    /// On a node outside the group: a member its consumers and basic.gets can go through
    /// (`super::remote::relay`), a reachable one first, and another than `avoid` if there is one.
    fn relay_member(&self, avoid: Option<u64>) -> Option<u64> {
        let _ = avoid;
        None
    }
    /// The replica reads bodies from entry `index` of this node's log after the log is purged:
    /// the log keeps the entry's record until [`Replicator::unpin_entry`]. Called while applying
    /// the entry (or at a start, for the restored snapshot's messages), so before any snapshot
    /// that covers it.
    fn pin_entry(&self, index: u64) -> std::result::Result<(), String>;
    /// The replica no longer reads entry `index`: its record may go.
    fn unpin_entry(&self, index: u64) -> std::result::Result<(), String>;
    /// Entry `index` of this node's log (kept by a pin, or not purged yet): its command bytes.
    /// None: the log has no such entry. Blocking (a store read).
    fn read_entry(&self, index: u64) -> std::result::Result<Option<Bytes>, String>;
}

/// Starts and stops the Raft groups of quorum queues on this node (the server's cluster runtime).
pub trait QuorumHost: Send + Sync {
    /// This node's id (consumers and publisher sessions are named by it).
    fn node_id(&self) -> u64;
    /// Starts the group of `queue` (new, or restored at a start) and attaches its replicator
    /// ([`Queue::attach_replicator`]).
    fn start(&self, queue: Arc<Queue>);
    /// The queue was deleted: stops its group and removes its log.
    fn remove(&self, group: u64);
    /// In a cluster: the members of a new quorum queue's group (`size` of them, the default without)
    /// and the one to lead it first (None: picked by the group id), chosen by the declaring node
    /// with `locator` and recorded with the declaration. None standalone.
    fn placement(&self, group: u64, size: Option<u32>, locator: crate::queue_args::LeaderLocator) -> Option<(Vec<u64>, Option<u64>)> {
        let _ = (group, size, locator);
        None
    }
    /// In a cluster: the members recorded for the group changed (`Queue::set_recorded_members`).
    fn members_changed(&self, group: u64) {
        let _ = group;
    }
    /// Sends a request about a classic queue to another node (`super::remote`); `done` is called
    /// exactly once, later, with the answer.
    fn classic_request(&self, node: u64, request: Bytes, done: super::remote::RequestDone) {
        let _ = (node, request);
        done(Err("this node is not in a cluster".to_string()));
    }
}

/// The node's quorum-queue runtime, shared by its vhosts: set by the server before it serves.
#[derive(Default)]
pub struct QuorumRuntime {
    host: RwLock<Option<Arc<dyn QuorumHost>>>,
    node: AtomicU64,
    /// The memory all replicas of the node hold bodies in (see `body_memory`).
    bodies: Arc<NodeBodies>,
}

impl QuorumRuntime {
    pub fn set_host(&self, host: Arc<dyn QuorumHost>) {
        self.node.store(host.node_id(), Ordering::Release);
        *self.host.write() = Some(host);
    }

    pub fn host(&self) -> Option<Arc<dyn QuorumHost>> {
        self.host.read().clone()
    }

    /// This node's id (0 until the server sets the host).
    pub(crate) fn node(&self) -> u64 {
        self.node.load(Ordering::Acquire)
    }

    /// The node's budget for the bodies its replicas hold, and what they hold.
    pub fn bodies(&self) -> &Arc<NodeBodies> {
        &self.bodies
    }
}

/// Entries proposed and not yet answered, per queue. One: what comes meanwhile goes into the next
/// entry, so entries are as large as the commit round trip makes them, and per-entry costs (Raft,
/// transport, store records) are paid least often. Measured on three nodes (bench/cluster.py, two
/// rounds each): 1 against 2 in flight, Q1 116k/115k vs 105k/105k msg/s, Q3 130k/134k vs 129k/124k,
/// Q4 48k/51k vs 46k/47k (its p99 higher, 5-6 s vs 3-4 s); 4 in flight was worse than 2 in every row.
const MAX_IN_FLIGHT: usize = 1;
/// An entry is closed at this size (or at `MAX_MESSAGES_PER_ENTRY` messages) and the next one begun.
const MAX_ENTRY_BYTES: usize = 4 << 20;
/// Publishers pause (`Queue::wait_until_drained`) while this much waits to be proposed.
const PENDING_PAUSE_BYTES: usize = 16 << 20;
/// What a no-ack consumer may hold at once, as far as the machine is concerned.
const NO_ACK_PREFETCH: u32 = 1000;
/// From this prefetch on, the machine assigns an acking consumer `ASSIGN_AHEAD_FACTOR` times its
/// prefetch: the surplus waits in the consumer's backlog on this node and goes to the channel as
/// soon as the client's acks make room (the replica enforces the prefetch, `Consumer::has_credit`),
/// rather than one commit later, when the machine has applied the acks. Without it a consumer's
/// throughput was its prefetch per commit round trip (Q2: 1,000 per ~7 ms). Below it (work queues
/// with a small prefetch, often 1, for fair dispatch) a slow consumer must not hold messages an
/// idle one could take: the machine's prefetch is the consumer's.
const ASSIGN_AHEAD_FROM: u32 = 100;
/// Three times the prefetch: the surplus covers the acks' commit round trip on a follower (the ack
/// forwarded to the leader, committed, applied here) at ~550k msg/s. Q2 in `bench/cluster.py`
/// (500,000 messages past the memory budget): 2x ~395k msg/s, 3x ~545k; 4x assigned faster than
/// the read-ahead reads (deliveries then waited for reads on the apply path), ~400-520k.
const ASSIGN_AHEAD_FACTOR: u32 = 3;
/// The leader proposes a `Tick` (TTL, x-expires) at most this often. The vhost ticks quorum queues
/// once a second (`VHost::tick`), give or take its own 100 ms tick: under 1 s, so that a tick a
/// little early is not skipped, which would make it one every 2 s.
const TICK_EVERY_MS: u64 = 800;
/// Expired messages one Tick dead-letters at most (`QuorumMachine::expire_head`); the leader
/// proposes the next at once while the vhost has room for them (`QuorumReplica::expire_more`).
const EXPIRE_PER_TICK: u64 = 16_384;
/// What one read-back asks the store for.
const READ_BACK_MESSAGES: usize = 512;
const READ_BACK_BYTES: usize = 4 << 20;
/// What one read-ahead asks the store for (see `QuorumReplica::read_ahead`).
/// 2,048 or 2 MiB: Q2 in `bench/cluster.py` (500,000 messages, the chained read-ahead), five runs
/// each, median 513k msg/s against 414k with 1,024 or 1 MiB (4,096 or 4 MiB: 316-389k). The bodies
/// lie in the WAL in runs of ~1 MB between the Raft entries' (a pread each at least): a read of
/// 1 MiB took 3-4 preads of ~300 KB on average, and every read is a task and a wait for the lock.
const READ_AHEAD_MESSAGES: usize = 2048;
/// How many bodies after the last delivery are read ahead: more than a consumer with a large
/// prefetch is assigned at once (`ASSIGN_AHEAD_FACTOR`).
const READ_AHEAD_WINDOW: usize = 8192;
/// Reads ahead under way at once (see `QuorumReplica::read_ahead_task`). Q2 of `bench/cluster.py`
/// (500,000 messages), five drains each, alternating: two, 529-553k msg/s (median 540k); a chain
/// of one read at a time, each starting the next before it decoded, 381-531k (median 510k).
/// Three were no better (402-538k), nor reads of 4,096 (439-540k); reads of 1,024 were worse
/// (331-371k).
const READS_IN_FLIGHT: usize = 2;
/// After a look for a read ahead found none, deliveries look again after this many more bodies.
const LOOK_AGAIN_EVERY: usize = 256;
const READ_AHEAD_BYTES: usize = 2 << 20;
/// How long a delivery waits for a read ahead under way that holds its body (`BodySource::UnderWay`).
const READ_UNDER_WAY_WAIT: Duration = Duration::from_secs(2);
/// `take_bodies` of a read ahead: no body is wanted now.
const NOTHING_WANTED: std::ops::RangeInclusive<MsgId> = 1..=0;
/// What one answer to a peer's body request carries at most (besides its bytes, `MAX_ANSWER_BYTES`).
const SERVE_MAX_MESSAGES: usize = 16_384;
/// Test switch (test-hooks builds): while the file it names exists, reads of bodies to deliver or
/// dead-letter wait (`warren_store::test_hooks::wait_while_file_exists`).
const HOLD_BODY_READS_FILE: &str = "WARREN_TEST_HOLD_BODY_READS_FILE";
/// How long a read-back waits for a record the store has not made readable yet.
const READABLE_WAIT: Duration = Duration::from_secs(5);
/// How long a basic.get answered "taken" by the leader waits for this node to apply the entry that
/// took it before it answers get-empty (the message then goes back: the getter is gone).
const GET_APPLY_WAIT: Duration = Duration::from_secs(5);

/// At-least-once dead letters: re-published again if not settled within this (a lost confirm).
const DEAD_LETTER_SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
/// At-least-once dead letters: a re-publish that was refused (no route, a full target, no majority)
/// is tried again after this.
const DEAD_LETTER_RETRY_AFTER: Duration = Duration::from_secs(2);
/// At-least-once dead letters re-published per tick (once a second) by the leader.
const REDRIVE_PER_TICK: usize = 4096;
/// How long purge waits for its entry.
const PURGE_TIMEOUT: Duration = Duration::from_secs(30);
/// How many times an ack or detach whose entry's outcome was unknown is proposed again (each try
/// waits up to the replicator's timeout for a leader: 20 are ten minutes without a majority).
const PROPOSE_AGAIN_TIMES: u32 = 20;
/// Ticks between detaches proposed again for a consumer of this node the group still counts
/// (`QuorumReplica::detach_gone_consumers`).
const DETACH_GONE_AGAIN_TICKS: u32 = 30;

/// A live message on this replica: where its bytes are, and its body while it fits in memory.
struct Body {
    /// The message, decoded. None: either not held (the node's budget for bodies had no room), read
    /// back from its record or entry to deliver; or held as its entry's bytes (`Record::InEntry`),
    /// decoded only if it is delivered from this node. Every replica keeps every body, but a message
    /// is delivered by one: decoding each on all three cost two allocations, and cache misses when
    /// dropped, for nothing.
    message: Option<MessageRef>,
    /// What this body adds to `ReplicaState::body_mem` (0 when not held).
    mem: u64,
    stored_bytes: u64,
    record: Record,
}

impl Body {
    /// A body as decoded (or not held: `message` None), counted at its message's size.
    fn new(message: Option<MessageRef>, stored_bytes: u64, record: Record) -> Body {
        let mem = message.as_ref().map_or(0, |m| m.memory_bytes() as u64);
        Body { message, mem, stored_bytes, record }
    }

    /// In memory: decoded, or as its entry's bytes.
    fn held(&self) -> bool {
        self.message.is_some() || matches!(self.record, Record::InEntry { payload: Some(_) })
    }
}

/// Where a live message's bytes are on this node besides memory.
enum Record {
    /// The queue's own store record (a body fetched from a peer with a snapshot, or written by a
    /// version before bodies stayed in their entries); the append's ticket (readable once the
    /// store's readable watermark passes it).
    Stored(SyncTicket),
    /// In its Raft entry (index `msg_id >> 16`), in this node's store already: the replica pins the
    /// entry, so the log keeps its record after a snapshot lets the log go (retained), until the
    /// entry's last live body leaves (`ReplicaState::entry_holds`). The store encoding (a slice of
    /// the entry) while held in memory; None: read back from the entry to deliver.
    InEntry { payload: Option<Bytes> },
}

/// The bodies of a snapshot's live messages, being fetched from a peer (see [`crate::quorum::bodies`]).
struct BodyFetch {
    /// The snapshot's msg ids end here (entries after it have larger ids).
    until: MsgId,
    started: std::time::Instant,
    messages: u64,
    bytes: u64,
}

/// What one body-fetch request asks a peer for.
const FETCH_BYTES: u32 = 4 << 20;

/// A basic.consume on this node.
struct LocalConsumer {
    consumer: Arc<Consumer>,
    /// Delivered to it by the machine, not yet taken by its channel (flow, prefetch, room).
    backlog: VecDeque<Entry>,
    /// Assigned to it by the machine, but this node has no body for them (a store that failed to
    /// give one back): held, undelivered, until the consumer goes (then returned, as its backlog).
    bodiless: Vec<MsgId>,
    /// Its Attach is proposed and not answered yet (the machine may not know it yet).
    attaching: bool,
}

/// A basic.get under way on this node.
struct Getter {
    channel: Weak<Channel>,
    connection: u64,
    number: u16,
    /// basic.get with no-ack: the message is still taken as for an acking getter (held by the
    /// group until settled), then settled once get-ok is handed to the channel. A get answered
    /// empty (the Dequeue not applied here in time, or its outcome unknown) may still be applied
    /// later: its message then goes back (`delivered_to_gone`) instead of being consumed unsent.
    no_ack: bool,
    /// Some(true): get-ok sent; Some(false): get-empty to send.
    done: Option<bool>,
}

impl ReplicaState {
    fn new(config: QueueConfig, node_bodies: Arc<NodeBodies>) -> ReplicaState {
        ReplicaState {
            machine: QuorumMachine::new(config),
            sessions: HashMap::new(),
            sessions_pruned_at: 16,
            bodies: BTreeMap::new(),
            body_mem: BodyMemory::new(node_bodies),
            stored_until: 0,
            store_only: 0,
            entry_holds: BTreeMap::new(),
            retained_entries: BTreeSet::new(),
            applied_before_restore: None,
            not_applied_here: Vec::new(),
            kept_records: BTreeMap::new(),
            log: None,
            last_ticket: 0,
            fetch: None,
            consumers: HashMap::new(),
            getters: HashMap::new(),
            checked_out: BTreeMap::new(),
            last_tick_ms: 0,
            gone_at_last_tick: Vec::new(),
            deleted: false,
            read_ahead: ReadAhead::default(),
            generation: 0,
            extra_tick_at: 0,
            waiting_for_room: false,
            dlx_in_flight: HashMap::new(),
        }
    }
}

struct ReplicaState {
    machine: QuorumMachine,
    /// By msg id: ordered, since ids rise as messages come and mostly leave oldest first, which
    /// keeps a large backlog's inserts and removals on a few hot nodes (a hash table's were cache
    /// misses: 6% of a node's time publishing a backlog).
    bodies: BTreeMap<MsgId, Body>,
    /// Memory (`Message::memory_bytes`) of the bodies held in `bodies`, within the node's budget:
    /// past it, new bodies stay only in the store and are read back, in batches, as they are
    /// delivered (as a classic queue's span).
    body_mem: BodyMemory,
    /// The queue's store records are all below this msg id (replayed entries below it have theirs):
    /// the bodies from here on are `InEntry`.
    stored_until: u64,
    /// How many bodies are only in the store (not held): reads ahead look for them only while there
    /// are some. Walking the read-ahead window for none cost 9% of a node draining a backlog held
    /// in memory.
    store_only: usize,
    /// Holds per entry index: its live bodies that are `InEntry` (`insert_body`, `let_go`), plus
    /// one while the machine may keep its messages for a rewind (`retained_entries`). An entry is
    /// pinned in the log while it has some (`hold_entry`, `release_entry`).
    entry_holds: BTreeMap<u64, u32>,
    /// With retention (`x-retention-seconds`): the entries holding messages the machine may keep
    /// for a rewind once consumed, pinned in the log whether or not they still hold live bodies,
    /// until the machine's retention floor passes them (`unretain`). ~100 B per entry on each
    /// replica (this set, and the log's pin and retained record).
    retained_entries: BTreeSet<u64>,
    /// The last index this node had applied when a snapshot replaced its machine.
    applied_before_restore: Option<u64>,
    /// Entry indexes whose entries this node's log does not hold validly: those between what it
    /// had applied and a snapshot it installed from a peer (its log may have held entries there the
    /// group never committed). Nothing is read from, or pinned at, these.
    not_applied_here: Vec<std::ops::RangeInclusive<u64>>,
    /// With retention: consumed messages kept for a rewind whose bodies are records of the queue's
    /// own store (fetched from a peer with a snapshot, `Record::Stored` before they were consumed):
    /// their append ticket and bytes. Acked once the retention floor passes them (`unretain`).
    kept_records: BTreeMap<MsgId, (SyncTicket, u64)>,
    /// The group's replicator, once attached: the log the entries are pinned and read in.
    log: Option<Arc<dyn Replicator>>,
    /// The store append of the last record written (a peer's body fetch waits until it is readable).
    last_ticket: SyncTicket,
    /// A snapshot from a peer was installed and the bodies of its live messages are being fetched.
    fetch: Option<BodyFetch>,
    consumers: HashMap<u64, LocalConsumer>,
    getters: HashMap<u64, Getter>,
    /// Messages delivered on this node (or in a consumer's backlog) and not settled: their consumer.
    checked_out: BTreeMap<MsgId, ConsumerId>,
    /// This node's publisher sessions that published to the queue, by id: the machine's `Published`
    /// effects resolve their pub seqs.
    sessions: HashMap<u64, Weak<PublisherSession>>,
    /// `sessions` is pruned of ended sessions when it grows past this.
    sessions_pruned_at: usize,
    last_tick_ms: u64,
    /// Consumers of this node the group counted at the last tick although this node no longer has
    /// them, with how many ticks in a row it did (`QuorumReplica::detach_gone_consumers`).
    gone_at_last_tick: Vec<(ConsumerId, u32)>,
    deleted: bool,
    read_ahead: ReadAhead,
    /// The clock of the extra Tick last proposed because expired messages wait at the head
    /// (`QuorumReplica::expire_more`): another only once the machine's clock reached it.
    extra_tick_at: u64,
    /// This replica waits for room in the vhost's dead letters to propose that Tick.
    waiting_for_room: bool,
    /// At-least-once dead letters this node re-published as the leader, and when each may be
    /// re-published again if its settle has not come (`QuorumReplica::redrive_dead_letters`).
    dlx_in_flight: HashMap<MsgId, std::time::Instant>,
    /// Bumped when the state is replaced (`QuorumReplica::leave_group`): an apply that let the lock
    /// go to read bodies (`QuorumReplica::apply`) and finds it changed stops there.
    generation: u64,
}

/// Bodies only in the store, read on blocking threads before the machine delivers them, so that
/// draining a backlog past the memory budget does not stop the apply path for a read every few
/// hundred messages (`QuorumReplica::read_ahead`).
#[derive(Default)]
struct ReadAhead {
    /// Reads under way (`QuorumReplica::read_ahead_task`), at most `READS_IN_FLIGHT`.
    in_flight: usize,
    /// The msg ids of the reads under way.
    under_way: Vec<std::ops::Range<MsgId>>,
    /// The largest msg id delivered on this node.
    delivered: MsgId,
    /// Msg ids below this are held or being read: the next read starts at or after it.
    claimed_until: MsgId,
    /// Deliveries look for a read to start again only once `delivered` reaches this: after a look
    /// found none (the window full, everything held, or no room), looking at every delivery would
    /// walk thousands of bodies each time.
    look_again_at: MsgId,
    /// The read under way an apply waits for (off the lock) to take its bodies: its task leaves
    /// them in `reads_done` for that apply rather than taking them itself (see `BodyRead::UnderWay`).
    awaited: Option<std::ops::Range<MsgId>>,
}

/// A read of bodies an apply delivers or dead-letters and that are only on disk, made without
/// `state`'s lock (`QuorumReplica::apply`): `wanted` are held once read, whatever the budget.
struct BodyRead {
    wanted: std::ops::RangeInclusive<MsgId>,
    from: BodySource,
}

enum BodySource {
    /// A read ahead under way is reading the first: its bodies are taken rather than read twice.
    /// Why: a consumer whose credit runs past what the reads ahead have done wants bodies they are
    /// reading. Draining 1,000,000 messages with prefetch 3,000 (`bench/cluster.py` Q2's setup),
    /// 744 deliveries read their bodies again on the spot (512 each), waiting behind the read
    /// ahead for the store's lock: the disk read the same bytes twice.
    UnderWay(std::ops::Range<MsgId>),
    /// The queue's store records from the first, once readable. Past the memory budget, only up
    /// to `wanted`'s end.
    Store { ticket: SyncTicket, over_budget: bool },
    /// Their Raft entries in this node's log.
    Entries { log: Option<Arc<dyn Replicator>>, ids: Vec<MsgId> },
}

/// A read ahead that was done, for the replica to take its bodies: the msg ids it read and their
/// bodies (None: the read failed).
struct ReadDone {
    seqs: std::ops::Range<MsgId>,
    bodies: Option<Vec<(MsgId, MessageRef)>>,
}

/// One read ahead: the msg ids it reads and their payload bytes; from the entries (the ids of the
/// bodies to read), or from the queue's store records (None).
struct ReadRange {
    seqs: std::ops::Range<MsgId>,
    bytes: usize,
    from_entries: Option<Vec<MsgId>>,
}

/// What a reply is for, per command of an entry.
pub(super) enum Waiter {
    None,
    Enqueue { session: Option<Arc<PublisherSession>>, seqs: Vec<u64> },
    /// Settlements or a detach waited for: by the transaction `tx` (its tx.commit-ok), or, proposed
    /// again (`tries` times so far) after their entry's outcome was unknown, by nobody (see
    /// `QuorumReplica::to_propose_again`).
    Settled { tries: u32, tx: Option<(Arc<PublisherSession>, u64)> },
    Attach(u64),
    Get(u64),
    Purge(std::sync::mpsc::Sender<Option<u64>>),
    Rewind(tokio::sync::oneshot::Sender<Option<crate::queue::RewindOutcome>>),
}

struct Proposals {
    encoder: Encoder,
    waiters: Vec<Waiter>,
    /// The session (and priority lane, and whether of delayed messages) whose Enqueue is open at
    /// the end of `encoder`.
    open_session: Option<(SessionId, bool, bool)>,
    /// The clock the open Enqueue carries (its first message's `now_ms`).
    open_now_ms: u64,
    /// Closed entries waiting for a slot.
    sealed: VecDeque<(Bytes, Vec<Waiter>)>,
    in_flight: usize,
    /// Bytes in `encoder` and `sealed`.
    pending_bytes: usize,
    /// Scratch for a message's store encoding.
    scratch: BytesMut,
}

impl Proposals {
    fn new() -> Proposals {
        Proposals {
            encoder: Encoder::new(),
            waiters: Vec::new(),
            open_session: None,
            open_now_ms: 0,
            sealed: VecDeque::new(),
            in_flight: 0,
            pending_bytes: 0,
            scratch: BytesMut::new(),
        }
    }

    /// Closes the entry being built.
    fn seal(&mut self) {
        if self.encoder.is_empty() {
            return;
        }
        let entry = std::mem::take(&mut self.encoder).finish();
        let waiters = std::mem::take(&mut self.waiters);
        self.open_session = None;
        self.sealed.push_back((entry, waiters));
    }

    fn command(&mut self, waiter: Waiter) {
        self.open_session = None;
        self.waiters.push(waiter);
    }
}

/// Work found under the replica's lock, done after it is released.
#[derive(Default)]
struct After {
    acks: Batch,
    dead: Vec<DeadLetter>,
    /// Deliveries handed to no-ack consumers: settled in the next entry.
    settles: Vec<(ConsumerId, MsgId)>,
    /// Deliveries to consumers gone from this node (see `delivered_to_gone`).
    to_gone: Vec<ToGone>,
    discards: Vec<(ConsumerId, MsgId)>,
    /// basic.get consumers whose message goes back uncounted (no body here, or the channel closed).
    detaches: Vec<ConsumerId>,
    cancelled: Vec<Arc<Consumer>>,
    /// Local consumers to attach again (the machine lost them: see `QuorumReplica::lost_consumers`).
    reattach: Vec<u64>,
    gets_done: bool,
    /// basic.gets the leader took a message for, not applied here yet (`GET_APPLY_WAIT`).
    get_applies: Vec<u64>,
    expired: bool,
    /// Expired messages wait at the head of a queue that dead-letters (`expire_more`).
    expire_more: bool,
}

/// Messages the group delivered to a consumer of this node that is gone from it.
struct ToGone {
    consumer: ConsumerId,
    /// Whether its channel still holds messages it delivered (cancelled, not closed).
    client_holds: bool,
    msgs: Vec<MsgId>,
}

/// Where a quorum queue's group runs, as recorded with its declaration (`QueueDef`).
#[derive(Debug, Clone, Default)]
pub struct Recorded {
    pub members: Option<Vec<u64>>,
    pub leader: Option<u64>,
    pub members_changed: bool,
}

pub struct QuorumReplica {
    group: u64,
    store: Store,
    runtime: Arc<QuorumRuntime>,
    /// The group's members recorded at the declaration, or since by `warren ctl remove-node` or
    /// `grow` (None: before they were recorded); and whether they were changed since.
    members: RwLock<(Option<Vec<u64>>, bool)>,
    /// The member recorded to lead the group first (None: picked by the group id).
    leader: Option<u64>,
    /// The high 32 bits of this process's local consumer ids: a restart never reuses one.
    incarnation: u64,
    next_local: AtomicU64,
    /// Publishes without a publisher session (no confirm, dead letters) use this one.
    own_session: u64,
    own_seq: AtomicU64,
    state: Mutex<ReplicaState>,
    /// Reads ahead done, decoded, not yet taken into `state` (`QuorumReplica::from_reads_under_way`).
    reads_done: Mutex<Vec<ReadDone>>,
    read_done: Condvar,
    /// Some message had its own TTL: the leader ticks. Outside `state` so that the housekeeping
    /// tick (every 100 ms, every queue) of a queue that can expire nothing takes no lock.
    saw_expiration: AtomicBool,
    /// When the machine's next delayed message comes due (`u64::MAX`: none), as of the last apply;
    /// outside `state` for the same reason.
    next_due: AtomicU64,
    /// The due time a timer of this replica waits for (`u64::MAX`: none; see `arm_due_timer`).
    armed_due: AtomicU64,
    /// The due time this replica last proposed a `Tick` for: no timer for it again until that
    /// Tick applied (the next due time is then another), or the housekeeping tick finds it lost.
    tick_proposed_for: AtomicU64,
    proposals: Mutex<Proposals>,
    replicator: RwLock<Option<Arc<dyn Replicator>>>,
    gets_done: Notify,
    drained: Notify,
}

/// The machine's settings from the queue's arguments (validated at declare; a queue restored from
/// older metadata with arguments a quorum queue cannot have gets the defaults, logged).
pub fn queue_config(name: &str, args: &QueueArgs) -> QueueConfig {
    let delivery_limit = args.delivery_limit.unwrap_or(Some(DEFAULT_DELIVERY_LIMIT));
    QueueConfig::from_queue_args(args, delivery_limit).unwrap_or_else(|e| {
        tracing::error!(queue = name, error = %e, "quorum queue with arguments it cannot have; using the defaults");
        QueueConfig { delivery_limit, ..QueueConfig::default() }
    })
}

/// Dead letters by reason, in id order within each.
fn group_by_reason(letters: &[(MsgId, Reason)]) -> Vec<(Reason, Vec<MsgId>)> {
    let mut groups: Vec<(Reason, Vec<MsgId>)> = Vec::new();
    for (id, reason) in letters {
        match groups.iter_mut().find(|(r, _)| r == reason) {
            Some((_, ids)) => ids.push(*id),
            None => groups.push((*reason, vec![*id])),
        }
    }
    groups
}

fn death_reason(reason: Reason) -> Option<DeathReason> {
    match reason {
        Reason::Rejected => Some(DeathReason::Rejected),
        Reason::Expired => Some(DeathReason::Expired),
        Reason::MaxLen => Some(DeathReason::MaxLen),
        Reason::DeliveryLimit => Some(DeathReason::DeliveryLimit),
        Reason::Purged => None,
    }
}

impl QuorumReplica {
    pub fn new(name: &str, group: u64, store: Store, args: &QueueArgs, runtime: Arc<QuorumRuntime>, recorded: Recorded) -> QuorumReplica {
        let node_bodies = runtime.bodies.clone();
        QuorumReplica {
            group,
            store,
            runtime,
            members: RwLock::new((recorded.members, recorded.members_changed)),
            leader: recorded.leader,
            incarnation: (rand::random::<u32>() as u64 | 1) << 32,
            next_local: AtomicU64::new(1),
            own_session: rand::random::<u64>() | 1,
            own_seq: AtomicU64::new(1),
            state: Mutex::new(ReplicaState::new(queue_config(name, args), node_bodies)),
            saw_expiration: AtomicBool::new(false),
            next_due: AtomicU64::new(u64::MAX),
            armed_due: AtomicU64::new(u64::MAX),
            tick_proposed_for: AtomicU64::new(u64::MAX),
            proposals: Mutex::new(Proposals::new()),
            replicator: RwLock::new(None),
            gets_done: Notify::new(),
            drained: Notify::new(),
            reads_done: Mutex::new(Vec::new()),
            read_done: Condvar::new(),
        }
    }

    fn node(&self) -> u64 {
        self.runtime.node()
    }

    fn consumer_id(&self, local: u64) -> ConsumerId {
        ConsumerId { node: self.node(), local }
    }

    fn new_local_id(&self) -> u64 {
        self.incarnation | (self.next_local.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff)
    }

    pub fn is_leader(&self) -> bool {
        self.replicator.read().as_ref().is_some_and(|r| r.is_leader())
    }

    pub(super) fn recorded_members(&self) -> Option<Vec<u64>> {
        self.members.read().0.clone()
    }

    pub(super) fn members_changed(&self) -> bool {
        self.members.read().1
    }

    /// The group's members recorded from now on (`metadata::Op::QueueMembers`).
    pub(super) fn set_recorded_members(&self, members: Vec<u64>) {
        *self.members.write() = (Some(members), true);
    }

    pub(super) fn recorded_leader(&self) -> Option<u64> {
        self.leader
    }

    /// Whether this node is known to be outside the group (its consumers go through a member).
    pub(super) fn is_outside_group(&self) -> bool {
        self.replicator.read().as_ref().is_some_and(|r| !r.is_member())
    }

    /// See [`Replicator::relay_member`].
    pub(super) fn relay_member(&self, avoid: Option<u64>) -> Option<u64> {
        self.replicator.read().as_ref().and_then(|r| r.relay_member(avoid))
    }

    pub(super) fn runtime(&self) -> Arc<QuorumRuntime> {
        self.runtime.clone()
    }

    /// Consumers of this replica need this node to hold one (deliveries come from its own apply);
    /// a node outside the group relays them through a member instead (`Queue::member_relay`).
    pub(super) fn check_member(&self, queue: &Queue) -> Result<()> {
        if self.replicator.read().as_ref().is_none_or(|r| r.is_member()) {
            return Ok(());
        }
        Err(BrokerError::precondition_failed(format!(
            "quorum queue '{}' has no replica on this node (x-quorum-initial-group-size is below the cluster's size); \
             consume from a node that holds one",
            queue.name
        )))
    }

    pub fn message_count(&self) -> u32 {
        self.state.lock().machine.ready_count().min(u32::MAX as u64) as u32
    }

    pub fn consumer_count(&self) -> u32 {
        self.state.lock().machine.consumer_count() as u32
    }

    /// The consumers attached on this node.
    pub fn local_consumers(&self) -> Vec<Arc<Consumer>> {
        self.state.lock().consumers.values().map(|c| c.consumer.clone()).collect()
    }

    pub fn unacked_count(&self) -> u64 {
        self.state.lock().machine.checked_out_count()
    }

    pub fn is_deleted(&self) -> bool {
        self.state.lock().deleted
    }

    // ---- the group ------------------------------------------------------------------------

    /// The group runs: proposals go to `replicator` from now on (those made before go first).
    pub(super) fn attach(&self, queue: &Arc<Queue>, replicator: Arc<dyn Replicator>) {
        let mut p = self.proposals.lock();
        // What this node's consumers held before a restart comes back, before any new consumer of
        // this node attaches (nothing to do for a new queue, and harmless).
        let mut first = Encoder::new();
        first.consumer_down(self.node());
        p.sealed.push_front((first.finish(), vec![Waiter::None]));
        self.state.lock().log = Some(replicator.clone());
        *self.replicator.write() = Some(replicator);
        self.flush(queue, &mut p);
    }

    /// Applies a committed entry (every replica, log order) and does what its effects ask on this
    /// node. Returns the reply for the proposer.
    ///
    /// The bodies an effect delivers or dead-letters that are only on disk are read first, with
    /// `state`'s lock let go (`body_read_for`, `read_bodies`): publishers, acks, consumers and
    /// management take that lock on runtime threads, and a slow read (or a wait for the store to
    /// make a record readable) under it stalled them all, and with them the node's other groups.
    /// Effects stay in order: the next entry applies only once this one is done, and other tasks
    /// between two effects only propose (their commands apply after this entry) or see the
    /// machine's state a little ahead of the consumers' backlogs.
    pub(super) fn apply(&self, queue: &Arc<Queue>, index: u64, entry: &Bytes) -> Bytes {
        let mut after = After::default();
        let reply = {
            let mut st = self.state.lock();
            let generation = st.generation;
            let consumers_before = st.machine.consumers.len();
            let (effects, reply) = st.machine.apply(index, entry);
            let mut left = false;
            if !effects.is_empty() {
                let leader = self.is_leader();
                for effect in effects {
                    if !self.hold_bodies_for(queue, &mut st, &effect, leader, generation) {
                        // The replica left the group meanwhile: nothing of this entry is its any more.
                        left = true;
                        break;
                    }
                    self.perform(queue, &mut st, entry, effect, leader, &mut after);
                }
            }
            if !left && st.machine.consumers.len() < consumers_before && !st.consumers.is_empty() {
                self.lost_consumers(&mut st, &mut after);
            }
            if !left {
                unretain(&mut st, self.group, &mut after.acks);
            }
            after.expire_more = !left
                && queue.args.dead_letter_exchange.is_some()
                && (st.machine.head_expired() || st.machine.due_left())
                && st.machine.now_ms >= st.extra_tick_at;
            self.next_due.store(st.machine.next_due().unwrap_or(u64::MAX), Ordering::Relaxed);
            reply.encode()
        };
        self.finish(queue, after);
        self.arm_due_timer(queue);
        reply
    }

    /// The consumed messages the machine keeps for a rewind, and its oldest retention sample.
    pub(super) fn retention_stats(&self) -> warren_store::RetentionStats {
        let st = self.state.lock();
        warren_store::RetentionStats { consumed: st.machine.retained_count(), oldest_ms: st.machine.oldest_kept_ms() }
    }

    /// Delayed messages the group holds, not due yet.
    pub(super) fn delayed_count(&self) -> u64 {
        self.state.lock().machine.delayed_count()
    }

    /// On the leader, with delayed messages waiting: a timer task proposes a `Tick` when the next
    /// one comes due (the machine makes it ready then: `QuorumMachine::fire_due`), not at the
    /// housekeeping tick, so a due message is late by the timer and one commit. A new leader arms
    /// at its first housekeeping tick (`tick`, within a second). Cheap when armed already: two
    /// atomic loads.
    fn arm_due_timer(&self, queue: &Arc<Queue>) {
        let due = self.next_due.load(Ordering::Relaxed);
        if due == u64::MAX
            || self.armed_due.load(Ordering::Relaxed) <= due
            || self.tick_proposed_for.load(Ordering::Relaxed) == due
            || !self.is_leader()
        {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        // Armed for the earlier time; a timer armed for a later one still fires, and finds
        // nothing due or proposes one more Tick (harmless).
        self.armed_due.fetch_min(due, Ordering::Relaxed);
        let queue = Arc::downgrade(queue);
        rt.spawn(async move {
            // The wall clock, which dates messages and Ticks, may drift from tokio's.
            loop {
                let now = crate::now_ms();
                if now >= due {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(due - now)).await;
            }
            let Some(queue) = queue.upgrade() else { return };
            if let Some(r) = queue.replica.as_ref() {
                let _ = r.armed_due.compare_exchange(due, u64::MAX, Ordering::Relaxed, Ordering::Relaxed);
                r.due_tick(&queue);
            }
        });
    }

    /// A due timer fired: on the leader, a `Tick` if a delayed message is due by now, else the
    /// timer again for the next.
    fn due_tick(&self, queue: &Arc<Queue>) {
        if !self.is_leader() || self.state.lock().deleted {
            return;
        }
        let now_ms = crate::now_ms();
        let due = self.next_due.load(Ordering::Relaxed);
        if due <= now_ms {
            self.tick_proposed_for.store(due, Ordering::Relaxed);
            let room = queue.vhost.upgrade().is_none_or(|v| v.dead_letter_room());
            self.propose_tick(queue, now_ms, if room { EXPIRE_PER_TICK } else { 0 });
        } else {
            self.arm_due_timer(queue);
        }
    }

    /// Reads the bodies `effect` needs that are only on disk (`body_read_for`), with the lock let go
    /// for each read, and holds them. False if the replica left the group meanwhile (its state was
    /// replaced: `generation` moved on).
    fn hold_bodies_for(&self, queue: &Arc<Queue>, st: &mut parking_lot::MutexGuard<'_, ReplicaState>, effect: &Effect, leader: bool, generation: u64) -> bool {
        let mut tries = HashMap::new();
        while let Some(read) = self.body_read_for(queue, st, effect, leader, &mut tries) {
            let bodies = parking_lot::MutexGuard::unlocked(st, || crate::blocking::run(|| self.read_bodies(queue, &read)));
            if st.generation != generation {
                return false;
            }
            let bodies = match &read.from {
                BodySource::UnderWay(seqs) => self.took_read_under_way(st, seqs, bodies),
                _ => bodies,
            };
            if let Some(bodies) = bodies {
                take_bodies(st, bodies, &read.wanted);
            }
        }
        true
    }

    fn perform(&self, queue: &Arc<Queue>, st: &mut ReplicaState, entry: &Bytes, effect: Effect, leader: bool, after: &mut After) {
        match effect {
            Effect::Store { msg_id, payload } => {
                if payload.end > entry.len() || payload.start > payload.end {
                    tracing::error!(queue = %queue.name, msg_id, "an enqueue names bytes outside its entry; message not kept");
                    return;
                }
                self.keep_body(st, msg_id, entry.slice(payload));
                if st.machine.config().retention_ms.is_some() && msg_id >= st.stored_until {
                    // Pinned by `keep_body` already; stays pinned once consumed, for a rewind.
                    retain_entry(st, msg_id >> 16);
                }
            }
            // Consumed messages made ready again: their bodies are in their entries, read back
            // when delivered (as after a restart).
            Effect::Rewound { runs } => {
                // The reads ahead follow deliveries up the ids: start them again below the rewound
                // ones (all below what was delivered), or each would be read on the apply path.
                if let Some(first) = runs.first().map(|r| r.first) {
                    let ahead = &mut st.read_ahead;
                    if first <= ahead.delivered {
                        ahead.delivered = first.saturating_sub(1);
                        ahead.claimed_until = ahead.claimed_until.min(first);
                        ahead.look_again_at = ahead.look_again_at.min(first);
                    }
                }
                for id in runs.iter().flat_map(Run::ids) {
                    if st.bodies.contains_key(&id) {
                        continue;
                    }
                    if let Some((ticket, stored_bytes)) = st.kept_records.remove(&id) {
                        insert_body(st, id, Body { message: None, mem: 0, stored_bytes, record: Record::Stored(ticket) });
                    } else if applied_here(st, id >> 16) {
                        retain_entry(st, id >> 16);
                        insert_body(st, id, Body { message: None, mem: 0, stored_bytes: 0, record: Record::InEntry { payload: None } });
                    } else {
                        tracing::warn!(queue = %queue.name, msg_id = id, "a rewound message's body is on no record or entry of this node; its consumers here will hold it undelivered");
                    }
                }
            }
            Effect::Deliver { consumer, settled, msgs } => {
                if consumer.node == self.node() && !st.deleted {
                    self.deliver(queue, st, consumer, settled, msgs, after);
                } else if settled {
                    for d in msgs {
                        forget(st, self.group, d.msg_id, &mut after.acks);
                    }
                }
            }
            Effect::Release { msgs } | Effect::Dropped { msgs, .. } => {
                for id in run_ids(&msgs) {
                    forget(st, self.group, id, &mut after.acks);
                }
            }
            Effect::DeadLetter { reason, msgs } => {
                for id in run_ids(&msgs) {
                    let (Some(reason), Some(exchange), true) = (death_reason(reason), &queue.args.dead_letter_exchange, leader) else {
                        forget(st, self.group, id, &mut after.acks);
                        continue;
                    };
                    let message = self.message_of(queue, st, id);
                    forget(st, self.group, id, &mut after.acks);
                    let Some(message) = message else { continue };
                    after.dead.push(DeadLetter {
                        message,
                        reason,
                        queue: queue.name.clone(),
                        exchange: exchange.clone(),
                        routing_key: queue.args.dead_letter_routing_key.clone(),
                        settle: None,
                    });
                }
            }
            // At-least-once: every replica keeps the bodies until `DeadLettered`; the leader
            // re-publishes them now, confirmed (those whose body it has not: at the next tick).
            Effect::DeadLetterHeld { reason, msgs } => {
                if leader && !st.deleted {
                    for id in run_ids(&msgs) {
                        self.republish_held(queue, st, id, reason, after);
                    }
                }
            }
            // Confirms come from this node's replica applying the entry, in log order (a re-sent
            // batch's reply would not repeat the first application's rejections).
            Effect::Published { session, applied_up_to, rejected } => {
                if session.node == self.node() {
                    if let Some(s) = st.sessions.get(&session.channel).and_then(Weak::upgrade) {
                        s.applied_up_to(self.group, applied_up_to, &rejected);
                    }
                }
            }
            Effect::QueueExpired => after.expired |= leader,
        }
    }

    /// Keeps a message's body for delivery: in its entry, in this node's store already (pinned, so
    /// that the log keeps it), held in memory while the node's budget has room and read back from
    /// the entry past it. Nothing for a replayed entry's message whose record was written before a
    /// restart (loaded at the start, if still live).
    fn keep_body(&self, st: &mut ReplicaState, msg_id: MsgId, payload: Bytes) {
        if msg_id < st.stored_until {
            return;
        }
        if stored_has_expiration(&payload) {
            self.saw_expiration.store(true, Ordering::Relaxed);
        }
        let stored_bytes = payload.len() as u64;
        // About what the decoded message would count (`Message::memory_bytes`).
        let memory = stored_bytes + 128;
        let (payload, mem) = if st.body_mem.fits(memory) { (Some(payload), memory) } else { (None, 0) };
        insert_body(st, msg_id, Body { message: None, mem, stored_bytes, record: Record::InEntry { payload } });
    }

    /// A live message's body if this node holds it (in memory, or in its entry's bytes held). The
    /// bodies not held were read before the effect (`body_read_for`): None if the replica has no
    /// such message or its body could not be read.
    fn message_of(&self, queue: &Queue, st: &ReplicaState, msg_id: MsgId) -> Option<MessageRef> {
        match st.bodies.get(&msg_id)? {
            Body { message: Some(m), .. } => Some(m.clone()),
            Body { record: Record::InEntry { payload: Some(payload) }, .. } => {
                let decoded = decode_stored(payload).map(|stored| Arc::new(stored.message));
                if decoded.is_none() {
                    tracing::error!(queue = %queue.name, msg_id, "a quorum queue's message does not decode; not delivered");
                }
                decoded
            }
            _ => None,
        }
    }

    /// The next read `effect` needs before it is performed: of the first body it delivers (to a
    /// consumer or getter of this node) or dead-letters (as the leader) that is only on disk, and
    /// the bodies after it. Each body is read at most twice (`tries`; the first may wait for a
    /// read ahead under way), then left out: the effect finds it missing. Those up to the effect's
    /// last are held whatever the memory budget, as they are wanted now; the others while they fit.
    /// Past the budget the read stops at the effect's last.
    ///
    /// Why the bodies after it: a read kept only the body asked for once past the budget, so a
    /// consumer assigned 9,000 messages (prefetch 3,000) read 4 MiB for each of them, and each body
    /// kept, a slice of its read, held all 4 MiB: 12,000 bodies of 8 KB took the node past 10 GB.
    fn body_read_for(&self, queue: &Queue, st: &mut ReplicaState, effect: &Effect, leader: bool, tries: &mut HashMap<MsgId, u8>) -> Option<BodyRead> {
        if st.store_only == 0 {
            return None;
        }
        let not_held = |st: &ReplicaState, id: MsgId, tries: &HashMap<MsgId, u8>| {
            st.bodies.get(&id).is_some_and(|b| !b.held()) && tries.get(&id).is_none_or(|n| *n < 2)
        };
        let (first, through) = match effect {
            Effect::Deliver { consumer, msgs, .. }
                if consumer.node == self.node() && !st.deleted && (st.getters.contains_key(&consumer.local) || st.consumers.contains_key(&consumer.local)) =>
            {
                let through = msgs.iter().map(|d| d.msg_id).max()?;
                (msgs.iter().map(|d| d.msg_id).find(|id| not_held(st, *id, tries))?, through)
            }
            Effect::DeadLetter { reason, msgs } | Effect::DeadLetterHeld { reason, msgs }
                if leader && death_reason(*reason).is_some() && queue.args.dead_letter_exchange.is_some() =>
            {
                let through = msgs.iter().map(|&(first, n)| first + u64::from(n).saturating_sub(1)).max()?;
                (run_ids(msgs).find(|id| not_held(st, *id, tries))?, through)
            }
            _ => return None,
        };
        let attempt = tries.entry(first).or_insert(0);
        *attempt += 1;
        let wanted = first..=through.max(first);
        if *attempt == 1 {
            if let Some(seqs) = st.read_ahead.under_way.iter().find(|r| r.contains(&first)).cloned() {
                st.read_ahead.awaited = Some(seqs.clone());
                return Some(BodyRead { wanted, from: BodySource::UnderWay(seqs) });
            }
        }
        let over_budget = !st.body_mem.fits_read_back(1);
        let from = match st.bodies.get(&first)?.record {
            Record::Stored(ticket) => BodySource::Store { ticket, over_budget },
            Record::InEntry { .. } => {
                let upto = if over_budget { through } else { MsgId::MAX };
                BodySource::Entries { log: st.log.clone(), ids: not_held_in_entries(st, first..=upto, READ_BACK_MESSAGES) }
            }
        };
        Some(BodyRead { wanted, from })
    }

    /// Makes `read` (without `state`'s lock, on a blocking thread): the bodies decoded, None if there
    /// are none to take (a failed read, logged, or a read ahead that did not end in time).
    fn read_bodies(&self, queue: &Queue, read: &BodyRead) -> Option<Vec<(MsgId, MessageRef)>> {
        let first = *read.wanted.start();
        match &read.from {
            BodySource::UnderWay(seqs) => {
                let deadline = std::time::Instant::now() + READ_UNDER_WAY_WAIT;
                let mut reads = self.reads_done.lock();
                loop {
                    if let Some(done) = take_read_done(&mut reads, seqs) {
                        return done.bodies;
                    }
                    if self.read_done.wait_until(&mut reads, deadline).timed_out() {
                        tracing::warn!(queue = %queue.name, msg_id = first, "a read ahead of a quorum queue's messages took over {READ_UNDER_WAY_WAIT:?}; reading them again");
                        return None;
                    }
                }
            }
            BodySource::Store { ticket, over_budget } => {
                warren_store::test_hooks::wait_while_file_exists(HOLD_BODY_READS_FILE);
                self.store.wait_readable(*ticket, READABLE_WAIT);
                let batch = if *over_budget {
                    self.store.read_direct(self.group, first, *read.wanted.end() + 1, READ_BACK_MESSAGES, READ_BACK_BYTES)
                } else {
                    self.store.read(self.group, first, READ_BACK_MESSAGES, READ_BACK_BYTES)
                };
                match batch {
                    Ok(batch) => Some(decode_bodies(queue, batch.messages)),
                    Err(e) => {
                        tracing::error!(queue = %queue.name, error = %e, "could not read a quorum queue's messages back from the store");
                        None
                    }
                }
            }
            BodySource::Entries { log, ids } => {
                warren_store::test_hooks::wait_while_file_exists(HOLD_BODY_READS_FILE);
                Some(read_from_entries(queue, log.as_deref(), ids))
            }
        }
    }

    /// Back under the lock after waiting for read ahead `seqs`: it is no longer awaited, and if its
    /// task finished while this apply was giving up on it, the bodies it left are taken here.
    fn took_read_under_way(&self, st: &mut ReplicaState, seqs: &std::ops::Range<MsgId>, bodies: Option<Vec<(MsgId, MessageRef)>>) -> Option<Vec<(MsgId, MessageRef)>> {
        st.read_ahead.awaited = None;
        st.read_ahead.under_way.retain(|r| r != seqs);
        match take_read_done(&mut self.reads_done.lock(), seqs) {
            Some(done) => done.bodies,
            None => bodies,
        }
    }

    /// After a delivery of `delivered`: if bodies within `READ_AHEAD_WINDOW` after it are only in the
    /// store, reads them on blocking threads, `READS_IN_FLIGHT` reads of consecutive ranges at once,
    /// until the window is held or the memory budget is reached, so they are held when the machine
    /// delivers them. Measured on three nodes draining 1,000,000 messages (`warren bench`, prefetch
    /// 1000): reading 512 bodies on the apply path whenever a delivery found one not held, ~280k
    /// msg/s; with the read-ahead ~360k; with the whole backlog in memory ~530k.
    fn read_ahead(&self, queue: &Arc<Queue>, st: &mut ReplicaState, delivered: MsgId) {
        st.read_ahead.delivered = st.read_ahead.delivered.max(delivered);
        if st.read_ahead.in_flight < READS_IN_FLIGHT && st.read_ahead.delivered >= st.read_ahead.look_again_at {
            self.start_reads(queue, st);
        }
    }

    /// Starts reads ahead while fewer than `READS_IN_FLIGHT` are under way and there is one to make
    /// (`next_read`) among the bodies only in the store (`store_only`).
    fn start_reads(&self, queue: &Arc<Queue>, st: &mut ReplicaState) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        while st.store_only > 0 && st.read_ahead.in_flight < READS_IN_FLIGHT && !st.deleted {
            let Some(range) = self.next_read(st) else { return };
            st.read_ahead.in_flight += 1;
            st.read_ahead.claimed_until = range.seqs.end;
            st.read_ahead.under_way.push(range.seqs.clone());
            Self::read_ahead_task(&rt, queue.clone(), range);
        }
    }

    /// One read ahead, of the bodies in `range`, on a blocking thread. The store serializes a
    /// queue's reads, so with two under way one waits for the other's disk reads while that one
    /// decodes its bodies and waits for the replica's lock to hold them: the disk is kept busy.
    /// Draining 500,000 messages past the budget (`bench/cluster.py` Q2): one read after the
    /// other, 266-286k msg/s; two in flight, see `READS_IN_FLIGHT`. The task then starts the next
    /// reads, unless it found nothing (not readable yet, or a failed read): a later delivery looks
    /// again.
    fn read_ahead_task(rt: &tokio::runtime::Handle, queue: Arc<Queue>, range: ReadRange) {
        rt.spawn_blocking(move || {
            let Some(me) = &queue.replica else { return };
            let ReadRange { seqs: range, bytes, from_entries } = range;
            let (read, read_until) = match from_entries {
                Some(ids) => {
                    let log = me.replicator.read().clone();
                    (Ok(read_from_entries(&queue, log.as_deref(), &ids)), range.end)
                }
                None => {
                    // The bytes bound the size of the store's disk reads too: the range's own, not more.
                    let read = me.store.read_direct(me.group, range.start, range.end, 2 * READ_AHEAD_MESSAGES, bytes.max(1));
                    let read_until = read.as_ref().map_or(range.start, |b| b.next_seq);
                    // Decoded before the lock: the apply path and the consumers' dispatch wait for it.
                    (read.map(|b| decode_bodies(&queue, b.messages)), read_until)
                }
            };
            let found = match &read {
                Ok(bodies) => !bodies.is_empty(),
                Err(e) => {
                    tracing::error!(queue = %queue.name, error = %e, "could not read a quorum queue's messages ahead from the store");
                    false
                }
            };
            // Handed over first without `state`'s lock: a delivery waiting for this read holds it.
            me.reads_done.lock().push(ReadDone { seqs: range.clone(), bodies: read.ok() });
            me.read_done.notify_all();
            let mut st = me.state.lock();
            st.read_ahead.in_flight = st.read_ahead.in_flight.saturating_sub(1);
            st.read_ahead.under_way.retain(|r| *r != range);
            // An apply waiting for this read takes its bodies (`took_read_under_way`).
            let awaited = st.read_ahead.awaited.as_ref() == Some(&range);
            let mine = if awaited { None } else { take_read_done(&mut me.reads_done.lock(), &range) };
            // None: a delivery took the bodies already.
            if let Some(ReadDone { bodies: Some(bodies), .. }) = mine {
                take_bodies(&mut st, bodies, &NOTHING_WANTED);
            }
            if read_until < range.end {
                // The read stopped short (its byte or count cap, or records not readable yet): what
                // is left of the range may be read again.
                st.read_ahead.claimed_until = st.read_ahead.claimed_until.min(read_until);
            }
            if found {
                me.start_reads(&queue, &mut st);
            }
        });
    }

    /// The next read ahead: from the first body after the last delivery and the reads under way
    /// that is only in the store (and readable), over `READ_AHEAD_MESSAGES` bodies or about
    /// `READ_AHEAD_BYTES` of them, inside the window (`READ_AHEAD_WINDOW` bodies after the last
    /// delivery). None if there is none, or the memory budget has no room for it beside the reads
    /// under way; deliveries then look again only `LOOK_AGAIN_EVERY` bodies later.
    fn next_read(&self, st: &mut ReplicaState) -> Option<ReadRange> {
        let delivered = st.read_ahead.delivered;
        let reserved = (st.read_ahead.in_flight as u64 + 1) * READ_AHEAD_BYTES as u64;
        let window_end = st.bodies.range(delivered + 1..).nth(READ_AHEAD_WINDOW - 1).map_or(MsgId::MAX, |(id, _)| *id + 1);
        let from = (delivered + 1).max(st.read_ahead.claimed_until);
        let found = if !st.body_mem.fits_read_back(reserved) || from >= window_end {
            None
        } else {
            st.bodies.range(from..window_end).find(|(_, b)| !b.held())
        };
        let first = found.and_then(|(id, body)| match body.record {
            Record::Stored(ticket) if self.store.is_readable(ticket) => Some((*id, false)),
            Record::InEntry { payload: None } => Some((*id, true)),
            _ => None,
        });
        let Some((first, in_entries)) = first else {
            // With fewer bodies than that after the last delivery, the next delivery looks again.
            st.read_ahead.look_again_at = st.bodies.range(delivered + 1..).nth(LOOK_AGAIN_EVERY).map_or(delivered + 1, |(id, _)| *id);
            return None;
        };
        let mut end = window_end;
        let mut bytes = 0;
        let mut ids = Vec::new();
        // One kind of read: from the entries, or from the records.
        for (count, (id, body)) in st.bodies.range(first..window_end).enumerate() {
            let in_entry = matches!(body.record, Record::InEntry { .. });
            if count == READ_AHEAD_MESSAGES || bytes >= READ_AHEAD_BYTES as u64 || in_entry != in_entries {
                end = *id;
                break;
            }
            bytes += body.stored_bytes;
            if in_entries && !body.held() {
                ids.push(*id);
            }
        }
        Some(ReadRange { seqs: first..end, bytes: bytes as usize, from_entries: in_entries.then_some(ids) })
    }

    /// Hands the machine's deliveries to a consumer (or getter) of this node.
    fn deliver(&self, queue: &Arc<Queue>, st: &mut ReplicaState, consumer: ConsumerId, settled: bool, msgs: Vec<Delivery>, after: &mut After) {
        let known = st.getters.contains_key(&consumer.local) || st.consumers.contains_key(&consumer.local);
        // The bodies first (read back before, see `apply`); a settled delivery's message is gone.
        let mut entries: Vec<Option<Entry>> = Vec::with_capacity(msgs.len());
        for d in &msgs {
            let message = if known { self.message_of(queue, st, d.msg_id) } else { None };
            if settled {
                forget(st, self.group, d.msg_id, &mut after.acks);
            }
            let message = message.map(|m| if d.delivery_count > 0 { with_delivery_count(&m, d.delivery_count) } else { m });
            entries.push(message.map(|message| Entry { message, seq: d.msg_id, stored_bytes: 0, expires_at_ms: None, redelivered: d.redelivered, returned: 0 }));
        }
        if let Some(last) = msgs.iter().map(|d| d.msg_id).max().filter(|_| known) {
            self.read_ahead(queue, st, last);
        }
        let ReplicaState { machine, consumers, getters, checked_out, .. } = st;
        if let Some(getter) = getters.get_mut(&consumer.local) {
            let Some(d) = msgs.first() else { return };
            // A channel closed meanwhile takes nothing more (its get-ok would never be settled).
            let channel = getter.channel.upgrade().filter(|c| !c.is_closed());
            match (entries.swap_remove(0), channel) {
                (Some(entry), Some(channel)) => {
                    let remaining = machine.ready_count().min(u32::MAX as u64) as u32;
                    if channel.deliver_get(queue, entry, settled || getter.no_ack, remaining).is_none() {
                        checked_out.insert(d.msg_id, consumer);
                    } else if !settled {
                        after.settles.push((consumer, d.msg_id));
                    }
                    getter.done = Some(true);
                }
                (None, _) => {
                    // Never discarded (that would remove it for the whole cluster): the getter lets
                    // it go back, not counted as a failed delivery.
                    tracing::error!(queue = %queue.name, msg_id = d.msg_id, "no body on this node for a message taken by basic.get; returning it");
                    if !settled {
                        after.detaches.push(consumer);
                    }
                    getter.done = Some(false);
                }
                // The channel closed before get-ok: back, not a failed delivery (as a closed channel's unacked).
                (Some(_), None) if !settled => after.detaches.push(consumer),
                (Some(_), None) => {}
            }
            after.gets_done = true;
            return;
        }
        let Some(local) = consumers.get_mut(&consumer.local) else {
            // Gone from this node: see `delivered_to_gone`. (An earlier run's consumers are
            // ConsumerDown's: a restart replays deliveries to them.)
            if !settled && consumer.local & !0xffff_ffff == self.incarnation {
                let client_holds = holds_any(checked_out, consumer);
                after.to_gone.push(ToGone { consumer, client_holds, msgs: msgs.iter().map(|d| d.msg_id).collect() });
            }
            return;
        };
        for (d, entry) in msgs.iter().zip(entries) {
            let Some(entry) = entry else {
                // Never discarded (a discard removes it for the whole cluster): it stays checked out
                // to the consumer, undelivered, and goes back when the consumer goes.
                tracing::error!(queue = %queue.name, msg_id = d.msg_id, "no body on this node for a delivered message; it stays with the consumer undelivered");
                if !settled {
                    checked_out.insert(d.msg_id, consumer);
                    local.bodiless.push(d.msg_id);
                }
                continue;
            };
            if !settled {
                checked_out.insert(d.msg_id, consumer);
            }
            if local.backlog.is_empty() {
                if let Some(entry) = hand_to_channel(local, consumer, entry, after) {
                    local.backlog.push_back(entry);
                }
            } else {
                local.backlog.push_back(entry);
            }
        }
    }

    /// Local consumers the machine no longer has although this node never cancelled them: another
    /// node detached them (`consumers_down`: this node was unreachable for a while, and its
    /// consumers' messages went to others). The client still waits on them, so they are attached
    /// again (RabbitMQ's quorum queues do the same when a node comes back). What they held is the
    /// queue's again: their backlog here is dropped (it would be delivered twice), and acks of
    /// what their channel still holds are not proposed (the machine would ignore them).
    fn lost_consumers(&self, st: &mut ReplicaState, after: &mut After) {
        let node = self.node();
        let ReplicaState { machine, consumers, checked_out, .. } = st;
        for (local, c) in consumers.iter_mut() {
            let id = ConsumerId { node, local: *local };
            if c.attaching || machine.consumers.contains_key(&id) {
                continue;
            }
            c.backlog.clear();
            c.bodiless.clear();
            checked_out.retain(|_, holder| *holder != id);
            c.attaching = true;
            after.reattach.push(*local);
        }
    }

    /// Does what was found under the lock.
    fn finish(&self, queue: &Arc<Queue>, mut after: After) {
        if !after.acks.is_empty() {
            queue.append_acks(&mut after.acks);
        }
        if after.gets_done {
            self.gets_done.notify_waiters();
        }
        if !after.get_applies.is_empty() {
            let gets = std::mem::take(&mut after.get_applies);
            let weak = Arc::downgrade(queue);
            let give_up = move || {
                let Some(queue) = weak.upgrade() else { return };
                let Some(r) = &queue.replica else { return };
                {
                    let mut st = r.state.lock();
                    for local in &gets {
                        if let Some(g) = st.getters.get_mut(local) {
                            g.done.get_or_insert(false);
                        }
                    }
                }
                r.gets_done.notify_waiters();
            };
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(async move {
                        tokio::time::sleep(GET_APPLY_WAIT).await;
                        give_up();
                    });
                }
                Err(_) => give_up(),
            }
        }
        for c in after.cancelled.drain(..) {
            c.channel.consumer_cancelled_by_server(&c.tag);
        }
        let reattach: Vec<(u64, Attach)> = if after.reattach.is_empty() {
            Vec::new()
        } else {
            let st = self.state.lock();
            after.reattach.iter().filter_map(|l| st.consumers.get(l).map(|c| (*l, self.attach_of(*l, &c.consumer)))).collect()
        };
        for (local, _) in &reattach {
            tracing::info!(queue = %queue.name, consumer = local, "a consumer of this node was detached by another node (unreachable a while): attaching it again");
        }
        if !after.settles.is_empty() || !after.to_gone.is_empty() || !after.discards.is_empty() || !after.detaches.is_empty() || !reattach.is_empty() {
            let mut p = self.proposals.lock();
            for (local, attach) in &reattach {
                p.encoder.attach(attach);
                p.command(Waiter::Attach(*local));
            }
            detach_returning(&mut p, after.detaches.drain(..));
            delivered_to_gone(&mut p, std::mem::take(&mut after.to_gone));
            for (list, kind) in [(&after.settles, Settle::Ack), (&after.discards, Settle::Reject { requeue: false })] {
                push_settlements(&mut p, list.iter().copied(), kind);
            }
            self.flush(queue, &mut p);
        }
        let Some(vhost) = queue.vhost.upgrade() else { return };
        if !after.dead.is_empty() {
            vhost.dead_letter(after.dead);
        }
        if after.expire_more {
            self.expire_more(queue);
        }
        if after.expired {
            tracing::info!(queue = %queue.name, vhost = %vhost.name, "deleting quorum queue unused for longer than its x-expires");
            let name = queue.name.clone();
            // Not from inside the group's apply: deleting stops the group.
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn_blocking(move || vhost.delete_queue_unchecked(&name));
                }
                Err(_) => vhost.delete_queue_unchecked(&name),
            }
        }
    }

    /// The machine's state for a snapshot (no bodies). The log up to here may be purged once the
    /// snapshot is stored: the entries with the bodies of live messages are pinned (`keep_body`),
    /// so the log keeps them.
    pub(super) fn snapshot(&self) -> Bytes {
        self.state.lock().machine.snapshot()
    }

    /// Replaces the machine's state by a snapshot's.
    pub(super) fn restore_snapshot(&self, snapshot: &[u8]) -> std::result::Result<(), String> {
        let mut st = self.state.lock();
        let applied = st.machine.last_index();
        st.machine.restore(snapshot).map_err(|e| e.to_string())?;
        st.applied_before_restore = applied;
        self.next_due.store(st.machine.next_due().unwrap_or(u64::MAX), Ordering::Relaxed);
        Ok(())
    }

    /// At a start, the machine was restored from this node's own snapshot: the live messages it
    /// lists whose bodies were not loaded from the queue's records (`restore_bodies`) are in their
    /// entries, which this node applied before the snapshot (also below `stored_until`: bodies this
    /// node had in its entries when it installed a snapshot were not fetched as records). Those
    /// entries are pinned now (the log lets the retained ones nobody pins go after this) and the
    /// bodies read back when delivered.
    pub(super) fn restored_at_start(&self, queue: &Queue) {
        let mut st = self.state.lock();
        let missing: Vec<MsgId> = st.machine.live_ids().into_iter().filter(|id| !st.bodies.contains_key(id)).collect();
        if !missing.is_empty() {
            tracing::debug!(queue = %queue.name, messages = missing.len(), "a quorum queue's bodies are read from its log when delivered");
        }
        for id in missing {
            insert_body(&mut st, id, Body { message: None, mem: 0, stored_bytes: 0, record: Record::InEntry { payload: None } });
        }
        // Every id of its own snapshot is in an entry this node applied.
        let applied = st.machine.last_index();
        retain_entries_of_machine(&mut st, applied);
        // Records of consumed messages kept for a rewind were loaded as bodies (`restore_bodies`).
        if st.machine.config().retention_ms.is_some() {
            let kept: Vec<MsgId> = st.bodies.keys().copied().filter(|id| !st.machine.is_live(*id) && st.machine.is_kept(*id)).collect();
            for id in kept {
                if let Some(body) = st.bodies.remove(&id) {
                    if let Record::Stored(ticket) = body.record {
                        st.kept_records.insert(id, (ticket, body.stored_bytes));
                    }
                    let_go(&mut st, id, &body);
                }
            }
        }
    }

    /// A snapshot from a peer was installed (`restore_snapshot`): bodies of messages it no longer
    /// lists go, and the first request for the bodies of its live messages this node lacks is
    /// returned (None: nothing to fetch). Those bodies must be in the store before any later entry
    /// applies (records rise by msg id): the caller fetches them ([`QuorumReplica::bodies_fetched`])
    /// before returning to the group. The live bodies this node has in its own entries stay there
    /// (pinned: the log keeps them when it goes up to the snapshot).
    pub(super) fn snapshot_installed(&self, queue: &Arc<Queue>) -> std::result::Result<Option<Bytes>, String> {
        let mut after = After::default();
        let request = {
            let mut st = self.state.lock();
            // First: entries of messages the snapshot keeps for a rewind must not go with the bodies
            // that leave here. Only those this node applied: at a higher index its log may hold an
            // entry the group never committed (it led alone, cut off), not the message's.
            let applied = st.applied_before_restore;
            if let Some(installed) = st.machine.last_index() {
                let first = applied.map_or(0, |a| a + 1);
                if first <= installed {
                    st.not_applied_here.push(first..=installed);
                }
            }
            retain_entries_of_machine(&mut st, applied);
            let gone: Vec<MsgId> = st.bodies.keys().copied().filter(|id| !st.machine.is_live(*id)).collect();
            for id in gone {
                forget(&mut st, self.group, id, &mut after.acks);
            }
            let ReplicaState { machine, checked_out, .. } = &mut *st;
            checked_out.retain(|id, _| machine.is_live(*id));
            let until = st.machine.last_index().map_or(0, |i| (i + 1) << 16);
            let from = st.stored_until;
            if from < until {
                st.fetch = Some(BodyFetch { until, started: std::time::Instant::now(), messages: 0, bytes: 0 });
                Some(BodiesRequest { from, until, max_bytes: FETCH_BYTES }.encode())
            } else {
                None
            }
        };
        self.finish(queue, after);
        Ok(request)
    }

    /// A peer's answer to `request`: the live messages among its records are written to this node's
    /// store (as they would have been at apply) and held. Returns the next request, or None once the
    /// snapshot's bodies are all here. An answer that does not decode is an error (ask elsewhere).
    pub(super) fn bodies_fetched(&self, queue: &Arc<Queue>, request: &[u8], answer: Bytes) -> std::result::Result<Option<Bytes>, String> {
        let request = BodiesRequest::decode(request).map_err(|e| format!("bad body request: {e}"))?;
        let answer = BodiesAnswer::decode(&answer, &request).map_err(|e| format!("bad body answer: {e}"))?;
        let mut after = After::default();
        let next = {
            let mut st = self.state.lock();
            if st.deleted {
                st.fetch = None;
                return Ok(None);
            }
            let Some(until) = st.fetch.as_ref().map(|f| f.until) else { return Ok(None) };
            for r in answer.records {
                // Already stored here (an earlier answer), or neither live nor kept for a rewind.
                let kept = st.machine.is_kept(r.msg_id);
                if r.msg_id < st.stored_until || !(st.machine.is_live(r.msg_id) || kept) || st.bodies.contains_key(&r.msg_id) {
                    continue;
                }
                let Some(stored) = decode_stored(&r.payload) else {
                    return Err(format!("message {} from the peer does not decode", r.msg_id));
                };
                let ticket = self.store.append_enqueue(self.group, r.msg_id, r.timestamp_ms, &[&r.payload]).map_err(|e| e.to_string())?;
                st.stored_until = r.msg_id + 1;
                st.last_ticket = st.last_ticket.max(ticket);
                if kept {
                    // Consumed, kept for a rewind: the record waits (`Effect::Rewound`, `unretain`).
                    st.kept_records.insert(r.msg_id, (ticket, r.payload.len() as u64));
                    continue;
                }
                if stored.message.expiration_ms.is_some() {
                    self.saw_expiration.store(true, Ordering::Relaxed);
                }
                let stored_bytes = r.payload.len() as u64;
                let message = hold(&st, stored.message);
                insert_body(&mut st, r.msg_id, Body::new(message, stored_bytes, Record::Stored(ticket)));
                if let Some(f) = st.fetch.as_mut() {
                    f.messages += 1;
                    f.bytes += stored_bytes;
                }
            }
            if !answer.complete {
                Some(BodiesRequest { from: answer.next.max(st.stored_until), until, max_bytes: FETCH_BYTES }.encode())
            } else {
                st.stored_until = st.stored_until.max(until);
                if let Some(f) = st.fetch.take() {
                    let secs = f.started.elapsed().as_secs_f64().max(1e-6);
                    tracing::info!(
                        queue = %queue.name,
                        messages = f.messages,
                        bytes = f.bytes,
                        secs = format!("{secs:.2}"),
                        msgs_per_s = format!("{:.0}", f.messages as f64 / secs),
                        mb_per_s = format!("{:.1}", f.bytes as f64 / secs / 1e6),
                        "caught up from a snapshot: fetched the bodies of its live messages from a peer"
                    );
                }
                // Messages the snapshot has checked out to this node's consumers (assigned by entries
                // this node skipped) go to them now.
                let node = self.node();
                let locals: Vec<u64> = st.consumers.keys().copied().collect();
                for local in locals {
                    let id = ConsumerId { node, local };
                    let msgs: Vec<Delivery> = st
                        .machine
                        .checked_out_by(id)
                        .into_iter()
                        .filter(|m| !st.checked_out.contains_key(m))
                        .map(|msg_id| Delivery { msg_id, redelivered: true, delivery_count: 0 })
                        .collect();
                    if !msgs.is_empty() {
                        self.deliver(queue, &mut st, id, false, msgs, &mut after);
                    }
                }
                None
            }
        };
        self.finish(queue, after);
        Ok(next)
    }

    /// A peer asks for the bodies of this replica's live messages (it installed a snapshot): from
    /// memory, the queue's records and the entries they are in. Blocking (store reads, a short wait
    /// for the store's writer): called off the runtime.
    pub(super) fn serve_bodies(&self, queue: &Queue, request: &[u8]) -> std::result::Result<Bytes, String> {
        let request = BodiesRequest::decode(request).map_err(|e| format!("bad body request: {e}"))?;
        let max_bytes = (request.max_bytes as usize).clamp(1, MAX_ANSWER_BYTES);
        // Where each live body of the range is, about `max_bytes` of them: read after the lock.
        let (applied_until, ticket, now_ms, plan, mut next) = {
            let st = self.state.lock();
            if st.fetch.is_some() {
                return Err("this replica is itself fetching the bodies of a snapshot".to_string());
            }
            let mut plan: Vec<(MsgId, Option<Bytes>, bool)> = Vec::new();
            let mut bytes = 0u64;
            let mut next = request.until;
            // Live messages, and (with retention) consumed ones kept for a rewind, in id order.
            let mut live = st.bodies.range(request.from..request.until).peekable();
            let mut kept = st.machine.kept_from(request.from).take_while(|id| *id < request.until).peekable();
            loop {
                let (id, is_kept) = match (live.peek(), kept.peek()) {
                    (None, None) => break,
                    (Some((&l, _)), Some(&k)) if k < l => (k, true),
                    (Some((&l, _)), _) => (l, false),
                    (None, Some(&k)) => (k, true),
                };
                if bytes >= max_bytes as u64 || plan.len() >= SERVE_MAX_MESSAGES {
                    next = id;
                    break;
                }
                if is_kept {
                    kept.next();
                    plan.push(match st.kept_records.get(&id) {
                        Some(&(_, stored_bytes)) => {
                            bytes += stored_bytes;
                            (id, None, false)
                        }
                        None if !applied_here(&st, id >> 16) => continue,
                        None => (id, None, true),
                    });
                    continue;
                }
                let Some((_, body)) = live.next() else { break };
                bytes += body.stored_bytes;
                plan.push(match &body.record {
                    Record::InEntry { payload } => (id, payload.clone(), true),
                    Record::Stored(_) => (id, None, false),
                });
            }
            (st.machine.last_index().map_or(0, |i| (i + 1) << 16), st.last_ticket, st.machine.now_ms(), plan, next)
        };
        if applied_until < request.until {
            return Err(format!("this replica has applied less of the log ({applied_until:#x}) than asked ({:#x})", request.until));
        }
        if plan.iter().any(|(_, _, in_entry)| !in_entry) && !self.store.wait_readable(ticket, READABLE_WAIT) {
            return Err("the store has not made the records readable yet".to_string());
        }
        let from_log: Vec<MsgId> = plan.iter().filter(|(_, held, in_entry)| *in_entry && held.is_none()).map(|(id, ..)| *id).collect();
        let log = self.replicator.read().clone();
        let mut from_log = payloads_from_entries(queue, log.as_deref(), &from_log).into_iter().peekable();
        let mut from_store: VecDeque<warren_store::StoredMessage> = VecDeque::new();
        let mut records = Vec::with_capacity(plan.len());
        let mut bytes = 0;
        let unreadable = !plan.is_empty() && unreadable_once_for_tests();
        if unreadable {
            tracing::warn!(queue = %queue.name, "answered a body request as if no body were readable (WARREN_TEST_UNREADABLE_BODIES_ONCE)");
        }
        for (id, held, in_entry) in plan {
            // Bodies restored at a start are counted at 0 bytes in the plan: the cap is on what is read.
            if bytes >= max_bytes {
                next = id;
                break;
            }
            let payload = match (held, in_entry) {
                _ if unreadable => None,
                (Some(p), _) => Some(p),
                (None, true) => from_log.next_if(|(i, _)| *i == id).map(|(_, p)| p),
                (None, false) => {
                    while from_store.front().is_some_and(|m| m.seq < id) {
                        from_store.pop_front();
                    }
                    if from_store.is_empty() {
                        from_store.extend(self.store.read(self.group, id, READ_BACK_MESSAGES, READ_BACK_BYTES).map_err(|e| e.to_string())?.messages);
                    }
                    from_store.front().filter(|m| m.seq == id).map(|m| m.payload.clone())
                }
            };
            match payload {
                Some(payload) => {
                    bytes += payload.len();
                    records.push(BodyRecord { msg_id: id, timestamp_ms: now_ms, payload });
                }
                // The message left since it was planned (its record acked, its entry let go): the
                // asking node applies that later too. Still live, it is a body this replica cannot
                // read: an answer without it would leave the asking node without it for good, so
                // the request fails, and that node asks another member.
                None if self.state.lock().machine.is_live(id) => {
                    return Err(format!("this replica cannot read the body of live message {id:#x}"));
                }
                None => {}
            }
        }
        Ok(BodiesAnswer { records, next, complete: next >= request.until }.encode())
    }

    /// At a start: loads what the store holds for this queue (the bodies of its live messages).
    pub(super) fn restore_bodies(&self, queue: &Queue, recovered: &RecoveredQueue) {
        let mut st = self.state.lock();
        st.stored_until = st.stored_until.max(recovered.next_seq);
        let mut from = recovered.first_seq;
        while from < recovered.next_seq {
            let batch = match self.store.read(self.group, from, 4096, 16 << 20) {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(queue = %queue.name, error = %e, "could not read a quorum queue's messages back from the store");
                    return;
                }
            };
            if batch.messages.is_empty() && batch.next_seq <= from {
                break;
            }
            for m in batch.messages {
                let stored_bytes = m.payload.len() as u64;
                match decode_stored(&m.payload) {
                    Some(stored) => {
                        let message = hold(&st, stored.message);
                        insert_body(&mut st, m.seq, Body::new(message, stored_bytes, Record::Stored(0)));
                    }
                    None => tracing::error!(queue = %queue.name, seq = m.seq, "unreadable message in the store"),
                }
            }
            from = batch.next_seq;
        }
    }

    // ---- proposing ------------------------------------------------------------------------

    /// Proposes what waits, as far as the in-flight limit allows.
    fn flush(&self, queue: &Arc<Queue>, p: &mut Proposals) {
        let Some(replicator) = self.replicator.read().clone() else { return };
        while p.in_flight < MAX_IN_FLIGHT {
            if p.sealed.is_empty() {
                p.seal();
            }
            let Some((entry, waiters)) = p.sealed.pop_front() else { break };
            p.in_flight += 1;
            p.pending_bytes = p.pending_bytes.saturating_sub(entry.len());
            let q = queue.clone();
            let proposed = entry.clone();
            replicator.propose(entry, Box::new(move |result| q.replica_proposed(result, &proposed, waiters)));
        }
        if p.pending_bytes < PENDING_PAUSE_BYTES {
            self.drained.notify_waiters();
        }
    }

    /// An entry's proposal ended: resolves what waited for its reply, proposes more.
    pub(super) fn proposed(&self, queue: &Arc<Queue>, result: std::result::Result<Bytes, String>, entry: &[u8], waiters: Vec<Waiter>) {
        let mut again = if result.is_err() { self.to_propose_again(queue, entry, &waiters) } else { Vec::new() };
        let replies = match &result {
            Ok(bytes) => match Reply::decode(bytes) {
                Ok(Reply::Batch(replies)) => replies,
                Ok(one) => vec![one],
                Err(e) => {
                    tracing::error!(queue = %queue.name, error = %e, "a quorum queue's reply does not decode");
                    Vec::new()
                }
            },
            Err(e) => {
                tracing::warn!(queue = %queue.name, error = %e, "a quorum queue's entry was not committed; its publishes are nacked");
                Vec::new()
            }
        };
        let mut after = After::default();
        let mut replies = replies.into_iter();
        for (i, waiter) in waiters.into_iter().enumerate() {
            let reply = replies.next();
            if again.get(i).is_some_and(Option::is_some) {
                continue; // waits for its command proposed again
            }
            match waiter {
                Waiter::None | Waiter::Settled { tx: None, .. } => {}
                Waiter::Enqueue { session: Some(session), seqs } => {
                    let rejected: &[u64] = match &reply {
                        Some(Reply::Enqueued { rejected, .. }) => rejected,
                        _ => {
                            session.resolved(self.group, seqs.iter().map(|s| (*s, true)));
                            continue;
                        }
                    };
                    session.resolved(self.group, seqs.iter().map(|s| (*s, rejected.contains(s))));
                }
                Waiter::Enqueue { session: None, .. } => {}
                Waiter::Settled { tx: Some((session, seq)), .. } => {
                    // Not committed (and not proposed again, or given up on): the commit fails.
                    if reply.is_none() {
                        tracing::warn!(queue = %queue.name, "a transaction's settlements were not committed in time; its tx.commit fails");
                    }
                    session.resolved(self.group, [(seq, reply.is_none())]);
                }
                Waiter::Attach(local) => {
                    let mut st = self.state.lock();
                    if matches!(reply, Some(Reply::Refused(Refusal::ExclusiveConsumer))) {
                        if let Some(c) = st.consumers.remove(&local) {
                            after.cancelled.push(c.consumer);
                        }
                    } else if let Some(c) = st.consumers.get_mut(&local) {
                        // Not applied (no quorum within the timeout, or the leader changed and the
                        // outcome is unknown): proposed again, so that the consumer is not left
                        // registered here and unknown to the queue. Attaching twice is harmless.
                        let applied = reply.is_some();
                        c.attaching = !applied;
                        if !applied {
                            after.reattach.push(local);
                        }
                    }
                }
                Waiter::Get(local) => {
                    // A message taken for this getter is handed over when this node applies the
                    // entry (`deliver`), which on a follower comes after the leader's answer:
                    // answering get-empty on the answer lost the race on every follower.
                    let taken = matches!(reply, Some(Reply::Dequeued(Some(_))));
                    let mut st = self.state.lock();
                    if let Some(g) = st.getters.get_mut(&local) {
                        if taken && g.done.is_none() {
                            after.get_applies.push(local);
                        } else {
                            g.done.get_or_insert(false);
                        }
                    }
                    after.gets_done = true;
                }
                Waiter::Rewind(tx) => {
                    let outcome = match reply {
                        Some(Reply::Rewound { count, from_ms, clamped }) => Some(crate::queue::RewindOutcome { rewound: count, from_ms, clamped }),
                        _ => None,
                    };
                    if let (Err(_), Some(outcome)) = (tx.send(outcome), outcome) {
                        tracing::warn!(queue = %queue.name, rewound = outcome.rewound,
                            "a rewind of a quorum queue took effect after its client was told its outcome was unknown (it waited too long)");
                    }
                }
                Waiter::Purge(tx) => {
                    let count = match reply {
                        Some(Reply::Purged { count }) => Some(count),
                        _ => None,
                    };
                    if tx.send(count).is_err() {
                        if let Some(count) = count {
                            // Its client was told the outcome was unknown (`purge` timed out).
                            tracing::warn!(queue = %queue.name, removed = count,
                                "a purge of a quorum queue took effect after its client was told its outcome was unknown (it waited too long)");
                        }
                    }
                }
            }
        }
        {
            let mut p = self.proposals.lock();
            p.in_flight -= 1;
            for (command, waiter) in again.drain(..).flatten() {
                if p.encoder.push(&command, &[]).is_ok() {
                    p.command(waiter);
                }
            }
            self.flush(queue, &mut p);
        }
        self.finish(queue, after);
    }

    /// The commands of an entry whose outcome is unknown (not committed in time, or sent to a
    /// leader that went silent or was replaced: it may still be applied, or never) that must be
    /// proposed again, with how many times they will have been: acks, nacks, rejects and detaches.
    /// Lost, an ack left its message checked out to a consumer that goes on (a prefetch-1 consumer
    /// then got nothing more), and a detach left a consumer this node no longer has counted by the
    /// group, taking messages. They are safe twice: the group ignores a settlement of a message the
    /// consumer no longer holds and a detach of a consumer it does not know. (A requeue applied
    /// twice, the message delivered to the same consumer between, is a second redelivery.) Not
    /// again: publishes (nacked: the client decides), Attach and Dequeue (their waiters deal with
    /// it), ConsumerDown (this node's new consumers may be attached since), ticks and purges.
    ///
    /// Returns, by the entry's commands (their waiters), those to propose again with their new
    /// waiters (None: not again). A transaction's commit-ok waits for its settlements proposed again.
    fn to_propose_again(&self, queue: &Queue, entry: &[u8], waiters: &[Waiter]) -> Vec<Option<(Command, Waiter)>> {
        if self.state.lock().deleted {
            return Vec::new();
        }
        let commands = match Command::decode(entry) {
            Ok(Command::Batch(commands)) => commands,
            Ok(one) => vec![one],
            Err(_) => return Vec::new(),
        };
        let mut again = Vec::with_capacity(waiters.len());
        for (command, waiter) in commands.into_iter().zip(waiters) {
            let (attempt, tx) = match waiter {
                Waiter::Settled { tries, tx } => (tries + 1, tx.clone()),
                _ => (1, None),
            };
            let settles = matches!(command, Command::Settle { .. } | Command::Return { .. } | Command::Discard { .. } | Command::Detach { .. });
            if !settles {
                again.push(None);
                continue;
            }
            if attempt > PROPOSE_AGAIN_TIMES {
                tracing::error!(queue = %queue.name, "a quorum queue's ack or detach was not committed after {PROPOSE_AGAIN_TIMES} tries; given up (its consumer may hold messages until its channel closes)");
                again.push(None);
                continue;
            }
            again.push(Some((command, Waiter::Settled { tries: attempt, tx })));
        }
        again
    }

    // ---- the AMQP side --------------------------------------------------------------------

    /// A message routed to this queue: it joins the next entry.
    /// With `delay_ms` > 0 the group holds it that long first (`QuorumMachine::fire_due`).
    pub(super) fn publish(&self, queue: &Arc<Queue>, message: &MessageRef, stored_header: &[u8], now_ms: u64, delay_ms: u64, publisher: Option<Publisher>) -> Result<super::Enqueued> {
        let mut p = self.proposals.lock();
        // The machine drops a publish whose seq is at or below its session's last as a re-sent
        // duplicate, so a session's seqs must enter entries in rising order. A connection's session
        // numbers its publishes on its one reader task; the node's own session (publishes without
        // confirms, dead letters) is shared by every connection, so its seq is taken under the
        // proposals lock, where the message also joins the entry: taken before it, two connections
        // could add their numbers out of order and the lower one was dropped on every replica.
        let (session, seq, tracked) = match publisher {
            Some(p) => (SessionId { node: self.node(), channel: p.session.id }, p.seq, Some(p.session)),
            None => (SessionId { node: self.node(), channel: self.own_session }, self.own_seq.fetch_add(1, Ordering::Relaxed), None),
        };
        {
            let mut st = self.state.lock();
            if st.deleted {
                return Ok(super::Enqueued::Accepted { ticket: None, slow_publishers: false, store_behind: false });
            }
            if let Some(session) = tracked {
                if !st.sessions.contains_key(&session.id) {
                    st.sessions.insert(session.id, Arc::downgrade(session));
                    if st.sessions.len() > st.sessions_pruned_at {
                        // Ended sessions go, here and in the machine (their dedup state).
                        let node = self.node();
                        let mut ended = Vec::new();
                        st.sessions.retain(|id, s| {
                            let live = s.strong_count() > 0;
                            if !live {
                                ended.push(*id);
                            }
                            live
                        });
                        st.sessions_pruned_at = (2 * st.sessions.len()).max(16);
                        for id in ended {
                            p.encoder.session_end(SessionId { node, channel: id });
                            p.command(Waiter::None);
                        }
                    }
                }
            }
        }
        let size = stored_header.len() + message.body.len();
        if p.encoder.messages() >= MAX_MESSAGES_PER_ENTRY || p.encoder.encoded_len() + size > MAX_ENTRY_BYTES {
            p.seal();
        }
        // RabbitMQ 4's two priorities: above 4 is high (`quorum::ready`).
        let high = warren_protocol::properties::PropertiesView::new(&message.properties)
            .ok()
            .and_then(|v| v.priority())
            .is_some_and(|p| p > crate::quorum::ready::HIGH_PRIORITY_ABOVE);
        let delayed = delay_ms > 0;
        if p.open_session != Some((session, high, delayed)) {
            if delayed {
                p.encoder.begin_enqueue_delayed(session, now_ms, high);
            } else {
                p.encoder.begin_enqueue(session, now_ms, high);
            }
            p.command(Waiter::Enqueue { session: tracked.cloned(), seqs: Vec::new() });
            p.open_session = Some((session, high, delayed));
            p.open_now_ms = now_ms;
        }
        // The machine dates a delayed message by its Enqueue's clock, which is its first message's:
        // a later one's delay grows by the time between them, so it is due `delay_ms` after its own
        // publish; and by 1 ms, as clocks are whole ms (a publish at 1000.9 ms is dated 1000).
        let delay_ms = if delayed { delay_ms.saturating_add(now_ms.saturating_sub(p.open_now_ms)).saturating_add(1) } else { 0 };
        let mut scratch = std::mem::take(&mut p.scratch);
        scratch.clear();
        scratch.extend_from_slice(stored_header);
        scratch.extend_from_slice(&message.body);
        let body_len = u32::try_from(message.body.len()).unwrap_or(u32::MAX);
        let added = if delayed {
            p.encoder.message_delayed(seq, body_len, message.expiration_ms, delay_ms, &scratch)
        } else {
            p.encoder.message(seq, body_len, message.expiration_ms, &scratch)
        };
        p.scratch = scratch;
        if let Err(e) = added {
            return Err(BrokerError::internal(format!("could not add a message to quorum queue '{}': {e}", queue.name)));
        }
        p.pending_bytes += size;
        if let Some(session) = tracked {
            session.sent(self.group, seq);
            if let Some(Waiter::Enqueue { seqs, .. }) = p.waiters.last_mut() {
                seqs.push(seq);
            }
        }
        self.flush(queue, &mut p);
        let slow_publishers = p.pending_bytes >= PENDING_PAUSE_BYTES;
        Ok(super::Enqueued::Accepted { ticket: None, slow_publishers, store_behind: false })
    }

    /// Waits (at most `max`) until less waits to be proposed than makes publishers pause.
    pub(super) async fn wait_until_drained(&self, max: Duration) {
        let notified = self.drained.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.proposals.lock().pending_bytes < PENDING_PAUSE_BYTES {
            return;
        }
        let _ = tokio::time::timeout(max, notified).await;
    }

    /// basic.consume.
    pub(super) fn add_consumer(&self, queue: &Arc<Queue>, consumer: Arc<Consumer>, on_registered: impl FnOnce()) -> Result<()> {
        self.check_member(queue)?;
        let local = self.new_local_id();
        let attach = self.attach_of(local, &consumer);
        {
            let mut st = self.state.lock();
            if st.deleted {
                return Err(BrokerError::not_found(format!("no queue '{}'", queue.name)));
            }
            st.consumers.insert(local, LocalConsumer { consumer, backlog: VecDeque::new(), bodiless: Vec::new(), attaching: true });
            // consume-ok before any delivery: those come once the Attach is applied.
            on_registered();
        }
        let mut p = self.proposals.lock();
        p.encoder.attach(&attach);
        p.command(Waiter::Attach(local));
        self.flush(queue, &mut p);
        Ok(())
    }

    fn attach_of(&self, local: u64, consumer: &Consumer) -> Attach {
        Attach {
            consumer: self.consumer_id(local),
            prefetch: machine_prefetch(consumer),
            auto_ack: false,
            exclusive: consumer.exclusive,
            priority: consumer.priority,
        }
    }

    /// basic.cancel, or the consumer's channel closed.
    pub(super) fn remove_consumer(&self, queue: &Arc<Queue>, consumer: &Arc<Consumer>) {
        let closing = consumer.channel.is_closed();
        let (local, never_sent) = {
            let mut st = self.state.lock();
            let Some(local) = st.consumers.iter().find(|(_, c)| Arc::ptr_eq(&c.consumer, consumer)).map(|(id, _)| *id) else { return };
            let Some(removed) = st.consumers.remove(&local) else { return };
            let id = self.consumer_id(local);
            // What the machine assigned to it that its client never got (the backlog here, and the
            // bodiless): back as never assigned, not as failed deliveries (issue 33: a prefetch of
            // 1,000 assigns 3,000, and 20 consume/cancel cycles dead-lettered messages no client
            // had seen, with `redelivered` set on the others).
            let never_sent: Vec<MsgId> = removed.backlog.iter().map(|e| e.seq).chain(removed.bodiless.iter().copied()).collect();
            if closing {
                // Everything it holds goes back with the Detach; the channel's requeue of its unacked
                // finds nothing left to settle.
                st.checked_out.retain(|_, c| *c != id);
            } else {
                for m in &never_sent {
                    st.checked_out.remove(m);
                }
            }
            (local, never_sent)
        };
        let id = self.consumer_id(local);
        let mut p = self.proposals.lock();
        // Stopped first (it keeps what it holds), so that what is unassigned is not assigned back
        // to it; then, on a close, the rest goes back as acquired (redelivered, not failed).
        p.encoder.detach(id, false);
        p.command(Waiter::None);
        if !never_sent.is_empty() {
            p.encoder.unassign(id, &never_sent);
            p.command(Waiter::None);
        }
        if closing {
            p.encoder.detach(id, true);
            p.command(Waiter::None);
        }
        self.flush(queue, &mut p);
    }

    /// Credit or room came back: hands consumers' backlogs to their channels.
    pub(super) fn dispatch(&self, queue: &Arc<Queue>) {
        let mut after = After::default();
        {
            let mut st = self.state.lock();
            let node = self.node();
            for (local, c) in st.consumers.iter_mut() {
                let id = ConsumerId { node, local: *local };
                while let Some(entry) = c.backlog.pop_front() {
                    if let Some(entry) = hand_to_channel(c, id, entry, &mut after) {
                        c.backlog.push_front(entry);
                        break;
                    }
                }
            }
        }
        self.finish(queue, after);
    }

    /// basic.ack / nack / reject of deliveries from this queue: Settle, Return or Discard in the next
    /// entry.
    pub(super) fn settle(&self, queue: &Arc<Queue>, entries: Vec<Entry>, how: Settle, publisher: Option<Publisher>) {
        let settled: Vec<(ConsumerId, MsgId)> = {
            let mut st = self.state.lock();
            entries.iter().filter_map(|e| st.checked_out.remove(&e.seq).map(|c| (c, e.seq))).collect()
        };
        if settled.is_empty() {
            return;
        }
        let mut p = self.proposals.lock();
        push_settlements(&mut p, settled.into_iter(), how);
        if let Some(publisher) = publisher {
            // The entry's reply (any of its commands': an entry applies whole) resolves it.
            publisher.session.sent(self.group, publisher.seq);
            if let Some(last) = p.waiters.last_mut() {
                *last = Waiter::Settled { tries: 0, tx: Some((publisher.session.clone(), publisher.seq)) };
            }
        }
        self.flush(queue, &mut p);
    }

    /// Whether `entry` holds a Dequeue of one of this node's getters.
    pub(super) fn has_own_dequeue(&self, entry: &[u8]) -> bool {
        let node = self.node();
        let own = |c: &Command| matches!(c, Command::Dequeue { consumer, .. } if consumer.node == node);
        match Command::decode(entry) {
            Ok(Command::Batch(commands)) => commands.iter().any(own),
            Ok(one) => own(&one),
            Err(_) => false,
        }
    }

    /// basic.get: proposes a Dequeue and asks the connection to wait; called again once it is
    /// applied, it answers.
    pub(super) fn get(&self, queue: &Arc<Queue>, channel: &Channel, no_ack: bool) -> Got {
        let local = {
            let mut st = self.state.lock();
            let mine = st.getters.iter().find(|(_, g)| g.connection == channel.connection_id && g.number == channel.number).map(|(id, g)| (*id, g.done));
            match mine {
                Some((id, Some(delivered))) => {
                    st.getters.remove(&id);
                    return if delivered { Got::Message } else { Got::Empty };
                }
                Some((id, None)) => return Got::Later(GetWait::Replicated(id)),
                None => {}
            }
            if st.deleted {
                return Got::Empty;
            }
            let local = self.new_local_id();
            st.getters.insert(local, Getter { channel: channel.weak(), connection: channel.connection_id, number: channel.number, no_ack, done: None });
            local
        };
        let mut p = self.proposals.lock();
        // Never a settling Dequeue, even for no-ack: see `Getter::no_ack`.
        p.encoder.dequeue(self.consumer_id(local), false);
        p.command(Waiter::Get(local));
        self.flush(queue, &mut p);
        Got::Later(GetWait::Replicated(local))
    }

    /// Returns once basic.get `local` is answered (or gone).
    pub(super) async fn wait_get(&self, local: u64) {
        loop {
            let notified = self.gets_done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.state.lock().getters.get(&local).is_none_or(|g| g.done.is_some()) {
                return;
            }
            notified.await;
        }
    }

    /// queue.purge: waits for the Purge entry (as a blocking call: a purge is rare). Returns how
    /// many ready messages it removed.
    pub(super) fn purge(&self, queue: &Arc<Queue>) -> Result<u32> {
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let mut p = self.proposals.lock();
            p.encoder.purge();
            p.command(Waiter::Purge(tx));
            self.flush(queue, &mut p);
        }
        match crate::blocking::run(|| rx.recv_timeout(PURGE_TIMEOUT)) {
            Ok(Some(count)) => Ok(count.min(u32::MAX as u64) as u32),
            Ok(None) => Err(BrokerError::internal(format!("the purge of quorum queue '{}' was not applied; nothing was purged", queue.name))),
            Err(_) => Err(outcome_unknown("purge", &queue.name)),
        }
    }

    /// Rewind (the queue has retention): the consumed messages it keeps from `to_ms` on are ready
    /// again. Answers once the group applied it (committed on a majority: it holds if this node or
    /// the leader dies next); proposed from any replica (a follower forwards it).
    pub(super) async fn rewind(&self, queue: &Arc<Queue>, to_ms: u64) -> Result<crate::queue::RewindOutcome> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        {
            let mut p = self.proposals.lock();
            p.encoder.rewind(to_ms);
            p.command(Waiter::Rewind(tx));
            self.flush(queue, &mut p);
        }
        match tokio::time::timeout(PURGE_TIMEOUT, rx).await {
            Ok(Ok(Some(outcome))) => Ok(outcome),
            Ok(_) => Err(BrokerError::internal(format!("the rewind of quorum queue '{}' was not applied; nothing was rewound", queue.name))),
            Err(_) => Err(outcome_unknown("rewind", &queue.name)),
        }
    }

    /// Another node is gone: its consumers the machine knows now are detached, their messages come
    /// back redelivered. Named one by one rather than `ConsumerDown(node)`: if the node restarts
    /// before this applies, the consumers it attached since are not touched (it proposes
    /// `ConsumerDown` for itself first thing when it starts).
    pub(super) fn consumers_down(&self, queue: &Arc<Queue>, node: u64) {
        let gone: Vec<ConsumerId> = self.state.lock().machine.consumers.keys().filter(|c| c.node == node).copied().collect();
        if gone.is_empty() {
            return;
        }
        let mut p = self.proposals.lock();
        detach_returning(&mut p, gone);
        self.flush(queue, &mut p);
    }

    /// At-least-once: re-publishes dead letter `id` (its body held) to the queue's dead-letter
    /// exchange, confirmed; marks it in flight. False if its body is not held (read it first).
    fn republish_held(&self, queue: &Arc<Queue>, st: &mut ReplicaState, id: MsgId, reason: Reason, after: &mut After) -> bool {
        let (Some(reason), Some(exchange)) = (death_reason(reason), &queue.args.dead_letter_exchange) else { return true };
        let Some(message) = self.message_of(queue, st, id) else { return false };
        st.dlx_in_flight.insert(id, std::time::Instant::now() + DEAD_LETTER_SETTLE_TIMEOUT);
        let weak = Arc::downgrade(queue);
        after.dead.push(DeadLetter {
            message,
            reason,
            queue: queue.name.clone(),
            exchange: exchange.clone(),
            routing_key: queue.args.dead_letter_routing_key.clone(),
            settle: Some(Box::new(move |done| {
                if let Some(queue) = weak.upgrade() {
                    if let Some(r) = &queue.replica {
                        r.dead_letter_settled(&queue, id, done);
                    }
                }
            })),
        });
        true
    }

    /// At-least-once: the re-publish of dead letter `id` is confirmed (`done`: its targets hold it,
    /// it leaves the queue through a `DeadLettered`), or must be tried again a little later.
    fn dead_letter_settled(&self, queue: &Arc<Queue>, id: MsgId, done: bool) {
        if !done {
            let mut st = self.state.lock();
            if let Some(at) = st.dlx_in_flight.get_mut(&id) {
                *at = std::time::Instant::now() + DEAD_LETTER_RETRY_AFTER;
            }
            return;
        }
        let mut p = self.proposals.lock();
        p.encoder.dead_lettered(&[id]);
        p.command(Waiter::None);
        self.flush(queue, &mut p);
    }

    /// At-least-once, on the leader: re-publishes the dead letters the machine still holds that
    /// this node has not re-published (a new leader: all of them), or whose settle is overdue, at
    /// most `REDRIVE_PER_TICK` at a time; bodies only on disk are read first (off the lock).
    fn redrive_dead_letters(&self, queue: &Arc<Queue>) {
        if !self.is_leader() {
            return;
        }
        let mut after = After::default();
        {
            let mut st = self.state.lock();
            if st.deleted || st.machine.dead_letter_count() == 0 {
                st.dlx_in_flight.clear();
                return;
            }
            let now = std::time::Instant::now();
            let ReplicaState { machine, dlx_in_flight, .. } = &mut *st;
            dlx_in_flight.retain(|id, _| machine.is_dead_letter_waiting(*id));
            let due: Vec<(MsgId, Reason)> = machine
                .dead_letters_waiting()
                .filter(|(id, _)| dlx_in_flight.get(id).is_none_or(|at| *at <= now))
                .take(REDRIVE_PER_TICK)
                .collect();
            if due.is_empty() {
                return;
            }
            let generation = st.generation;
            for (reason, ids) in group_by_reason(&due) {
                let effect = Effect::DeadLetterHeld { reason, msgs: ids.iter().fold(Vec::new(), |mut runs, id| {
                    crate::quorum::ready::push_id(&mut runs, *id);
                    runs
                }) };
                if !self.hold_bodies_for(queue, &mut st, &effect, true, generation) {
                    return;
                }
                for id in ids {
                    if st.machine.is_dead_letter_waiting(id) && !self.republish_held(queue, &mut st, id, reason, &mut after) {
                        tracing::warn!(queue = %queue.name, msg_id = id, "the body of a dead letter waiting for its target could not be read; trying again later");
                    }
                }
            }
        }
        self.finish(queue, after);
    }

    /// Periodic: the leader proposes a Tick when messages or the queue can expire; every replica
    /// detaches the consumers of its node it no longer has.
    pub(super) fn tick(&self, queue: &Arc<Queue>, now_ms: u64) {
        self.detach_gone_consumers(queue);
        self.redrive_dead_letters(queue);
        // A Tick proposed for a due message that has not applied a second later was lost (a
        // leader change): again.
        if self.next_due.load(Ordering::Relaxed).saturating_add(1000) <= now_ms {
            self.due_tick(queue);
        }
        self.arm_due_timer(queue);
        // The leader that applied the expiry deletes the queue (`after.expired`); should it be lost
        // before its deletion was committed, whichever leads now does it.
        let expired = { let st = self.state.lock(); !st.deleted && st.machine.queue_expired() };
        if expired && self.is_leader() {
            if let Some(vhost) = queue.vhost.upgrade() {
                vhost.doom(queue);
            }
        }
        // Retention ends by Ticks too (the machine's clock moves its floor).
        let expiring = queue.args.message_ttl_ms.is_some()
            || queue.args.expires_ms.is_some()
            || queue.args.retention_ms > 0
            || self.saw_expiration.load(Ordering::Relaxed);
        if !expiring {
            return;
        }
        {
            let mut st = self.state.lock();
            if st.deleted || now_ms.saturating_sub(st.last_tick_ms) < TICK_EVERY_MS || !self.is_leader() {
                return;
            }
            st.last_tick_ms = now_ms;
        }
        let room = queue.vhost.upgrade().is_none_or(|v| v.dead_letter_room());
        self.propose_tick(queue, now_ms, if room { EXPIRE_PER_TICK } else { 0 });
    }

    /// The queue was redeclared: a `Touch` restarts its `x-expires` countdown on every replica.
    /// (Proposed by whichever node the client is on: the machine's clock is the largest `now_ms`
    /// of its Ticks and Touches, so the countdown does not depend on which node led when.)
    pub(super) fn touch(&self, queue: &Arc<Queue>, now_ms: u64) {
        if self.state.lock().deleted {
            return;
        }
        let mut p = self.proposals.lock();
        p.encoder.touch(now_ms);
        p.command(Waiter::None);
        self.flush(queue, &mut p);
    }

    fn propose_tick(&self, queue: &Arc<Queue>, now_ms: u64, max_expired: u64) {
        let mut p = self.proposals.lock();
        p.encoder.tick(now_ms, max_expired);
        p.command(Waiter::None);
        self.flush(queue, &mut p);
    }

    /// On the leader, expired messages wait at the head of a queue that dead-letters (a tick
    /// dead-letters at most `EXPIRE_PER_TICK`, and deliveries skip nothing): proposes the next
    /// Tick at once if the vhost has room for more dead letters, or once it has. So a backlog
    /// expiring at once is dead-lettered as fast as the vhost re-publishes it, a bounded number at
    /// a time, and none is dropped (issue 33: past 65,536 waiting they were). Likewise for due
    /// delayed messages a full queue dead-letters as they come due (`QuorumMachine::fire_due`).
    fn expire_more(&self, queue: &Arc<Queue>) {
        let Some(vhost) = queue.vhost.upgrade() else { return };
        let at = {
            let mut st = self.state.lock();
            if st.deleted || !(st.machine.head_expired() || st.machine.due_left()) || st.machine.now_ms < st.extra_tick_at || !self.is_leader() {
                return;
            }
            if !vhost.dead_letter_room() {
                if st.waiting_for_room {
                    return;
                }
                st.waiting_for_room = true;
                drop(st);
                let weak = Arc::downgrade(queue);
                vhost.when_dead_letter_room(Box::new(move || {
                    let Some(queue) = weak.upgrade() else { return };
                    let Some(r) = &queue.replica else { return };
                    r.state.lock().waiting_for_room = false;
                    r.expire_more(&queue);
                }));
                return;
            }
            // Past the machine's clock, so that its apply shows (`extra_tick_at`).
            st.extra_tick_at = crate::now_ms().max(st.machine.now_ms + 1);
            st.extra_tick_at
        };
        self.propose_tick(queue, at, EXPIRE_PER_TICK);
    }

    /// Consumers of this node the group still counts at two ticks in a row although this node no
    /// longer has them, and whose channel holds none of their messages, are detached (what they
    /// hold goes back, as acquired, not failed). Their detach was lost (sent to a leader that
    /// stopped, and not committed when proposed again), or they are an earlier run's and this run's
    /// ConsumerDown was lost. Without this, a lost consumer that is delivered nothing more keeps
    /// the messages it held (whose acks were lost with it) until this node restarts. (Two ticks:
    /// a detach proposed since the last one is not proposed twice. Twice is harmless, as is a
    /// detach that arrives after the consumer is gone.)
    fn detach_gone_consumers(&self, queue: &Arc<Queue>) {
        let gone: Vec<ConsumerId> = {
            let mut st = self.state.lock();
            let node = self.node();
            let st = &mut *st;
            let mut gone: Vec<ConsumerId> = st
                .machine
                .consumers
                .keys()
                .filter(|c| c.node == node && !st.consumers.contains_key(&c.local) && !st.getters.contains_key(&c.local))
                .copied()
                .collect();
            if !gone.is_empty() {
                gone.retain(|c| !holds_any(&st.checked_out, *c));
            }
            let seen_before = std::mem::take(&mut st.gone_at_last_tick);
            st.gone_at_last_tick = gone
                .into_iter()
                .map(|c| (c, seen_before.iter().find(|(g, _)| *g == c).map_or(1, |(_, ticks)| ticks + 1)))
                .collect();
            if st.deleted {
                return;
            }
            // Proposed at the second tick, then every `DETACH_GONE_AGAIN_TICKS` while it lasts (no
            // majority to commit it: one log line and one command a second per consumer is noise).
            st.gone_at_last_tick
                .iter()
                .filter(|(_, ticks)| *ticks == 2 || (*ticks > 2 && ticks % DETACH_GONE_AGAIN_TICKS == 0))
                .map(|(c, _)| *c)
                .collect()
        };
        if gone.is_empty() {
            return;
        }
        for c in &gone {
            tracing::info!(queue = %queue.name, consumer = c.local, "the group still counts a consumer this node no longer has: detaching it");
        }
        let mut p = self.proposals.lock();
        detach_returning(&mut p, gone);
        self.flush(queue, &mut p);
    }

    /// This node is no longer a member of the group (`warren ctl remove-node`, a shrink; the caller
    /// stops the group here and removes its log). Its consumers are cancelled, and what they held
    /// goes back to the group (`ConsumerDown` of this node, proposed through the members). The
    /// replica forgets the group's state and this node's copies of its bodies: it is now what a node
    /// outside the group always was, and its clients go through the members (`Queue::member_relay`).
    pub(super) fn leave_group(&self, queue: &Arc<Queue>) {
        let consumers: Vec<Arc<Consumer>> = {
            let mut st = self.state.lock();
            let mut old = std::mem::replace(&mut *st, ReplicaState::new(queue_config(&queue.name, &queue.args), self.runtime.bodies.clone()));
            // Reads ahead under way end by themselves; no more may start beside them.
            st.read_ahead.in_flight = old.read_ahead.in_flight;
            st.generation = old.generation + 1;
            st.log = old.log.take();
            // A basic.get waiting for its entry answers empty (the next one goes through a member).
            st.getters = std::mem::take(&mut old.getters);
            for g in st.getters.values_mut() {
                g.done.get_or_insert(false);
            }
            old.consumers.into_values().map(|c| c.consumer).collect()
        };
        self.gets_done.notify_waiters();
        {
            let mut p = self.proposals.lock();
            p.encoder.consumer_down(self.node());
            p.command(Waiter::None);
            self.flush(queue, &mut p);
        }
        let mut drop = Batch::new();
        drop.drop_queue(self.group);
        queue.append_acks(&mut drop);
        for c in consumers {
            c.channel.consumer_cancelled_by_server(&c.tag);
        }
    }

    /// The queue was deleted: its consumers are cancelled, its records dropped, its group removed.
    /// Returns how many ready messages it held.
    pub(super) fn delete(&self, queue: &Arc<Queue>) -> u32 {
        let (count, consumers) = {
            let mut st = self.state.lock();
            st.deleted = true;
            st.bodies.clear();
            st.store_only = 0;
            st.entry_holds.clear();
            st.retained_entries.clear();
            st.kept_records.clear();
            st.body_mem.clear();
            st.checked_out.clear();
            st.getters.clear();
            let consumers: Vec<Arc<Consumer>> = st.consumers.drain().map(|(_, c)| c.consumer).collect();
            (st.machine.ready_count().min(u32::MAX as u64) as u32, consumers)
        };
        self.gets_done.notify_waiters();
        // What waits to be proposed never will be: its publishers are nacked.
        let waiting: Vec<Waiter> = {
            let mut p = self.proposals.lock();
            p.seal();
            p.pending_bytes = 0;
            p.sealed.drain(..).flat_map(|(_, w)| w).collect()
        };
        for w in waiting {
            match w {
                Waiter::Enqueue { session: Some(session), seqs } => session.resolved(self.group, seqs.into_iter().map(|s| (s, true))),
                Waiter::Settled { tx: Some((session, seq)), .. } => session.resolved(self.group, [(seq, false)]),
                _ => {}
            }
        }
        let mut acks = Batch::new();
        acks.drop_queue(self.group);
        queue.append_acks(&mut acks);
        for c in consumers {
            c.channel.consumer_cancelled_by_server(&c.tag);
        }
        if let Some(host) = self.runtime.host() {
            host.remove(self.group);
        }
        count
    }
}

/// The prefetch the machine knows an AMQP consumer by (see `ASSIGN_AHEAD_FROM`).
fn machine_prefetch(consumer: &Consumer) -> u32 {
    match consumer.prefetch {
        _ if consumer.no_ack => NO_ACK_PREFETCH,
        p if p >= ASSIGN_AHEAD_FROM => p.saturating_mul(ASSIGN_AHEAD_FACTOR),
        p => p,
    }
}

/// Hands an entry to a consumer's channel; gives it back if the channel cannot take it now.
fn hand_to_channel(local: &mut LocalConsumer, id: ConsumerId, entry: Entry, after: &mut After) -> Option<Entry> {
    if !local.consumer.has_credit() {
        return Some(entry); // assigned ahead: waits for the client's acks (`ASSIGN_AHEAD_FROM`)
    }
    let seq = entry.seq;
    match local.consumer.channel.try_deliver(&local.consumer, entry) {
        // A no-ack consumer: settled once handed over (its messages are the machine's until then).
        Ok(Some(_)) => {
            after.settles.push((id, seq));
            None
        }
        Ok(None) => None,
        Err(entry) => Some(entry),
    }
}

/// Adds a live message's body: its memory to the budget, counted in `store_only` if not held, and
/// in its entry's count if in its entry, which is pinned in the log with the first (`let_go` takes
/// it out of all three).
fn insert_body(st: &mut ReplicaState, msg_id: MsgId, body: Body) {
    st.body_mem.add(body.mem);
    if !body.held() {
        st.store_only += 1;
    }
    if let Record::InEntry { .. } = body.record {
        hold_entry(st, msg_id >> 16);
    }
    if let Some(old) = st.bodies.insert(msg_id, body) {
        let_go(st, msg_id, &old);
    }
}

/// Takes the body of `msg_id` that left `bodies` out of the counts and the memory budget; the last
/// of its entry unpins the entry.
fn let_go(st: &mut ReplicaState, msg_id: MsgId, body: &Body) {
    if !body.held() {
        st.store_only = st.store_only.saturating_sub(1);
    }
    if let Record::InEntry { .. } = body.record {
        release_entry(st, msg_id >> 16);
    }
    st.body_mem.sub(body.mem);
}

/// One more hold on entry `index` (a live body in it, or its messages kept for a rewind): the
/// first pins it in the log.
fn hold_entry(st: &mut ReplicaState, index: u64) {
    let count = st.entry_holds.entry(index).or_insert(0);
    *count += 1;
    if *count == 1 {
        match &st.log {
            Some(log) => {
                if let Err(e) = log.pin_entry(index) {
                    tracing::error!(index, error = %e, "could not pin a quorum queue's entry in the log: its bodies may go with its next snapshot");
                }
            }
            None => tracing::error!(index, "a quorum queue keeps bodies in its log before its group is attached"),
        }
    }
}

/// One hold less on entry `index`: the last unpins it.
fn release_entry(st: &mut ReplicaState, index: u64) {
    if let Some(count) = st.entry_holds.get_mut(&index) {
        *count -= 1;
        if *count == 0 {
            st.entry_holds.remove(&index);
            if let Some(Err(e)) = st.log.as_ref().map(|log| log.unpin_entry(index)) {
                tracing::error!(index, error = %e, "could not let a quorum queue's entry go from the log");
            }
        }
    }
}

/// The machine keeps no message for a rewind below its retention floor: the entries below the
/// floor's entry go from the log once no live body holds them.
fn unretain(st: &mut ReplicaState, group: u64, acks: &mut Batch) {
    let floor_id = st.machine.retention_floor();
    while let Some((&id, &(_, bytes))) = st.kept_records.first_key_value() {
        if id >= floor_id {
            break;
        }
        st.kept_records.pop_first();
        acks.ack(group, id, bytes);
    }
    let floor = floor_id >> 16;
    while let Some(&index) = st.retained_entries.first() {
        if index >= floor {
            break;
        }
        st.retained_entries.pop_first();
        release_entry(st, index);
    }
}

/// A purge or rewind not applied within `PURGE_TIMEOUT`: what its client is told.
fn outcome_unknown(what: &str, queue: &str) -> BrokerError {
    BrokerError::internal(format!(
        "the {what} of quorum queue '{queue}' was not committed within {} s (no majority of its replicas reachable); \
         its outcome is unknown: it may still take effect (the node logs it if it does)",
        PURGE_TIMEOUT.as_secs()
    ))
}

/// With retention: the entry `index` stays pinned in the log, whether or not it holds live bodies,
/// until the machine's retention floor passes it (`unretain`).
fn retain_entry(st: &mut ReplicaState, index: u64) {
    if applied_here(st, index) && st.retained_entries.insert(index) {
        hold_entry(st, index);
    }
}

/// Whether this node's log holds the entry at `index` as the group committed it (see
/// `ReplicaState::not_applied_here`).
fn applied_here(st: &ReplicaState, index: u64) -> bool {
    !st.not_applied_here.iter().any(|r| r.contains(&index))
}

/// With retention, after the machine was restored (a start, a snapshot installed): the entries of
/// every message it keeps for a rewind, and of every live one (kept once consumed), stay pinned,
/// those up to `applied` (the last index this node applied itself; None: none).
fn retain_entries_of_machine(st: &mut ReplicaState, applied: Option<u64>) {
    let Some(applied) = applied else { return };
    if st.machine.config().retention_ms.is_none() {
        return;
    }
    let floor = st.machine.retention_floor() >> 16;
    let mut entries: Vec<u64> =
        st.machine.retained_entries().chain(st.machine.live_ids().into_iter().map(|id| id >> 16)).filter(|i| *i >= floor && *i <= applied).collect();
    entries.sort_unstable();
    entries.dedup();
    for index in entries {
        retain_entry(st, index);
    }
}

/// A message left the queue: its body and store record go.
fn forget(st: &mut ReplicaState, group: u64, msg_id: MsgId, acks: &mut Batch) {
    st.checked_out.remove(&msg_id);
    let Some(body) = st.bodies.remove(&msg_id) else { return };
    if let Record::Stored(ticket) = body.record {
        if st.machine.config().retention_ms.is_some() && st.machine.is_kept(msg_id) {
            st.kept_records.insert(msg_id, (ticket, body.stored_bytes));
        } else {
            acks.ack(group, msg_id, body.stored_bytes);
        }
    }
    let_go(st, msg_id, &body);
}

/// A message returned before, as delivered: with the `x-delivery-count` header (failed deliveries so
/// far), as RabbitMQ 4's quorum queues add it. A message whose properties do not decode goes as it is.
fn with_delivery_count(message: &MessageRef, count: u32) -> MessageRef {
    let Ok(mut props) = warren_protocol::properties::BasicProperties::decode(&message.properties) else {
        return message.clone();
    };
    let mut headers = props.headers.take().unwrap_or_default();
    headers.insert("x-delivery-count".to_string(), warren_protocol::field::FieldValue::I64(count as i64));
    props.headers = Some(headers);
    let mut raw = BytesMut::new();
    props.encode(&mut raw);
    Arc::new(crate::message::Message {
        exchange: message.exchange.clone(),
        routing_key: message.routing_key.clone(),
        properties: raw.freeze(),
        body: message.body.clone(),
        persistent: message.persistent,
        expiration_ms: message.expiration_ms,
    })
}

/// A new live message's body, to be held in memory (`insert_body` counts it) while the node's budget
/// has room for it.
fn hold(st: &ReplicaState, message: crate::message::Message) -> Option<MessageRef> {
    st.body_mem.fits(message.memory_bytes() as u64).then(|| Arc::new(message))
}

/// Decodes bodies read back from the store (unreadable ones are logged and left out).
fn decode_bodies(queue: &Queue, messages: Vec<warren_store::StoredMessage>) -> Vec<(MsgId, MessageRef)> {
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        match decode_stored(&m.payload) {
            Some(stored) => out.push((m.seq, Arc::new(stored.message))),
            None => tracing::error!(queue = %queue.name, seq = m.seq, "unreadable message in the store"),
        }
    }
    out
}

/// The ids of the bodies in `ids` that are only in their entries and not held, at most `max`.
fn not_held_in_entries(st: &ReplicaState, ids: std::ops::RangeInclusive<MsgId>, max: usize) -> Vec<MsgId> {
    st.bodies.range(ids).filter(|(_, b)| matches!(b.record, Record::InEntry { payload: None })).take(max).map(|(id, _)| *id).collect()
}

/// Reads the bodies of `ids` (in id order) from their entries in this node's log, decoded.
fn read_from_entries(queue: &Queue, log: Option<&dyn Replicator>, ids: &[MsgId]) -> Vec<(MsgId, MessageRef)> {
    let mut out = Vec::with_capacity(ids.len());
    for (id, payload) in payloads_from_entries(queue, log, ids) {
        match decode_stored(&payload) {
            Some(stored) => out.push((id, Arc::new(stored.message))),
            None => tracing::error!(queue = %queue.name, msg_id = id, "a quorum queue's message does not decode"),
        }
    }
    out
}

/// Reads the bodies of `ids` (in id order) from their entries in this node's log, an entry once
/// for all its ids: their store encodings (copied out of the entries). Bodies that cannot be read are
/// logged and left out (the log has no such entry any more when the message left meanwhile).
fn payloads_from_entries(queue: &Queue, log: Option<&dyn Replicator>, ids: &[MsgId]) -> Vec<(MsgId, Bytes)> {
    let mut out = Vec::with_capacity(ids.len());
    let Some(log) = log else {
        tracing::error!(queue = %queue.name, "a quorum queue's bodies are in its log, but its group is not attached; not read");
        return out;
    };
    let mut at = 0;
    while at < ids.len() {
        let index = ids[at] >> 16;
        let in_entry = ids[at..].iter().take_while(|id| *id >> 16 == index).count();
        let wanted = &ids[at..at + in_entry];
        at += in_entry;
        let entry = match log.read_entry(index) {
            Ok(Some(entry)) => entry,
            Ok(None) => {
                tracing::debug!(queue = %queue.name, index, "an entry with a quorum queue's bodies is not in the log (its messages left)");
                continue;
            }
            Err(e) => {
                tracing::error!(queue = %queue.name, index, error = %e, "could not read a quorum queue's bodies from its log");
                continue;
            }
        };
        let payloads = match Command::enqueued_payloads(&entry) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(queue = %queue.name, index, error = %e, "an entry with a quorum queue's bodies does not decode");
                continue;
            }
        };
        for &id in wanted {
            match payloads.get((id & 0xffff) as usize).filter(|r| r.end <= entry.len()) {
                // A copy: a slice would keep the whole entry (up to megabytes) in memory for as
                // long as the body is held, and the memory budget counts only the body.
                Some(r) => out.push((id, Bytes::copy_from_slice(&entry[r.clone()]))),
                None => tracing::error!(queue = %queue.name, msg_id = id, "a quorum queue's message is not in its entry"),
            }
        }
    }
    out
}

/// The read of `seqs` among the reads done, taken out of them.
fn take_read_done(reads: &mut Vec<ReadDone>, seqs: &std::ops::Range<MsgId>) -> Option<ReadDone> {
    reads.iter().position(|r| r.seqs == *seqs).map(|i| reads.swap_remove(i))
}

/// Holds bodies read back from the store, for messages still live and not held, while they fit in
/// the memory budget (`wanted`: held whatever the budget).
fn take_bodies(st: &mut ReplicaState, bodies: Vec<(MsgId, MessageRef)>, wanted: &std::ops::RangeInclusive<MsgId>) {
    for (seq, message) in bodies {
        let mem = message.memory_bytes() as u64;
        let wanted = wanted.contains(&seq) || st.body_mem.fits_read_back(mem);
        let ReplicaState { bodies, body_mem, store_only, .. } = st;
        match bodies.get_mut(&seq) {
            Some(b) if wanted && !b.held() => {
                b.mem = mem;
                body_mem.add(mem);
                *store_only = store_only.saturating_sub(1);
                b.message = Some(message);
            }
            _ => {}
        }
    }
}

/// Adds settlements to the entry being built: one command per consumer and kind.
/// Detaches `consumers`, returning what they hold (as acquired, not failed deliveries).
fn detach_returning(p: &mut Proposals, consumers: impl IntoIterator<Item = ConsumerId>) {
    for c in consumers {
        p.encoder.detach(c, true);
        p.command(Waiter::None);
    }
}

/// Whether a channel on this node holds a message delivered to `consumer` (`ReplicaState::checked_out`).
fn holds_any(checked_out: &BTreeMap<MsgId, ConsumerId>, consumer: ConsumerId) -> bool {
    checked_out.values().any(|holder| *holder == consumer)
}

/// Messages the group delivered to a consumer of this node that is gone from it: its cancel or
/// its channel's close was proposed, and not applied yet, or lost (sent to a leader that stopped),
/// or it is an earlier run's. They go back, and so does the consumer. Returned one by one
/// (Return: delivery count + 1), a consumer whose detach was lost got them again at once: after
/// `x-delivery-limit` rounds they were dropped. So: a consumer whose channel holds none of its
/// messages is detached with them (Detach with return: back as acquired, not failed); one
/// cancelled while its channel still holds some (which the client may still ack) is cancelled
/// again (it takes nothing more) before these are returned.
fn delivered_to_gone(p: &mut Proposals, to_gone: Vec<ToGone>) {
    let mut detached: Vec<ConsumerId> = Vec::new();
    for ToGone { consumer, client_holds, msgs } in to_gone {
        if !detached.contains(&consumer) {
            detached.push(consumer);
            p.encoder.detach(consumer, !client_holds);
            p.command(Waiter::None);
        }
        if client_holds {
            // Never sent to the client: not failed deliveries.
            p.encoder.unassign(consumer, &msgs);
            p.command(Waiter::None);
        }
    }
}

fn push_settlements(p: &mut Proposals, settled: impl Iterator<Item = (ConsumerId, MsgId)>, how: Settle) {
    let mut by_consumer: Vec<(ConsumerId, Vec<MsgId>)> = Vec::new();
    for (c, m) in settled {
        match by_consumer.iter_mut().find(|(id, _)| *id == c) {
            Some((_, ids)) => ids.push(m),
            None => by_consumer.push((c, vec![m])),
        }
    }
    for (c, ids) in by_consumer {
        match how {
            Settle::Ack => p.encoder.settle(c, &ids),
            Settle::Reject { requeue: true } => p.encoder.return_(c, &ids),
            Settle::Reject { requeue: false } => p.encoder.discard(c, &ids),
        }
        p.command(Waiter::None);
    }
}

/// Test-only (`WARREN_TEST_UNREADABLE_BODIES_ONCE=1`, test-hooks builds): true for the first body
/// request with bodies in it that this node serves: it finds none of them readable (as if a pinned
/// entry were lost), so a test shows that the asking node gets them from another member instead
/// of going on without them.
fn unreadable_once_for_tests() -> bool {
    static ARMED: std::sync::OnceLock<std::sync::atomic::AtomicBool> = std::sync::OnceLock::new();
    let armed = ARMED.get_or_init(|| {
        let on = warren_store::test_hooks::var("WARREN_TEST_UNREADABLE_BODIES_ONCE").is_some_and(|v| v == "1");
        if on {
            tracing::warn!("WARREN_TEST_UNREADABLE_BODIES_ONCE is set: the first body request served finds no body readable (a test-only hook)");
        }
        std::sync::atomic::AtomicBool::new(on)
    });
    armed.swap(false, Ordering::Relaxed)
}
