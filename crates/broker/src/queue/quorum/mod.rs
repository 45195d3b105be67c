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
//!
//! The parts: this file (the traits, the replica's state, its constants), `apply` (committed
//! entries and their effects), `bodies` (holding and reading back bodies), `proposals` (entries
//! proposed, and again when their outcome is unknown), `consumers` (what the queue's callers ask of
//! a replica), `snapshot` (snapshots, restarts, and bodies fetched from a peer).

mod apply;
mod bodies;
mod consumers;
mod proposals;
mod snapshot;

// The helpers each part defines, for the others (`use super::*` there).
use bodies::*;
use consumers::*;
use proposals::*;

use super::body_memory::{BodyMemory, NodeBodies};
use super::{GetWait, Got, Queue};
use crate::queue::{consumers::Consumer, DeliverySink, Settle};
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
    channel: Weak<dyn DeliverySink>,
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
}

