//! The quorum queue's state machine: the state every replica holds, and [`QuorumMachine::apply`],
//! which turns one Raft entry into the same state change and the same [`Effect`]s on every replica.
//!
//! Deterministic by construction: no clock (time is the `now_ms` carried by `Tick` and `Touch`,
//! the machine's clock being the largest seen; an `Enqueue`'s `now_ms` only dates its messages),
//! no randomness, no I/O, ordered maps only.
//! Messages are assigned to consumers here (Ra's model): after every command, ready messages go
//! head first to the consumers that can take one (credit or room under their prefetch), highest
//! priority first, round-robin within a priority, only to the active one with single active
//! consumer. Each replica's wrapper acts on the effects for its own node's consumers and sessions.
//!
//! The parts: this file (the state, `apply`, enqueue, limits, dead letters), `consumers` (attach,
//! detach, settle, basic.get, assignment), `time` (delayed messages, TTL, x-expires, rewind).

mod consumers;
mod time;

use super::codec::DecodeError;
use super::command::{msg_id, Attach, Command, ConsumerId, Dequeued, EnqueueMsg, MsgId, Refusal, Reply, SessionId};
use super::ready::{push_id, MsgState, Ready, NEVER};
use super::retained::Retained;
use std::collections::BTreeMap;
use std::ops::Range;

/// What happens when a publish would take the ready messages past `x-max-length(-bytes)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overflow {
    /// The oldest ready messages are dropped (dead-lettered `maxlen`).
    #[default]
    DropHead,
    /// The publish is refused (the publisher is nacked).
    RejectPublish,
}

/// The queue's settings, from its arguments at declaration; fixed for its life (kept in snapshots).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueConfig {
    /// `x-max-length`: ready messages.
    pub max_length: Option<u64>,
    /// `x-max-length-bytes`: bytes of ready messages (each message's `size`).
    pub max_length_bytes: Option<u64>,
    pub overflow: Overflow,
    /// `x-delivery-limit` (default 20; `None` = unlimited): a message returned more than this many
    /// times is dead-lettered `delivery_limit` (or dropped).
    pub delivery_limit: Option<u32>,
    /// `x-message-ttl`.
    pub message_ttl_ms: Option<u64>,
    /// Whether the queue has a dead-letter exchange: removed messages are then [`Effect::DeadLetter`]
    /// (the wrapper re-publishes them), else [`Effect::Dropped`].
    pub dead_letter: bool,
    /// `x-dead-letter-strategy: at-least-once` (with `x-overflow: reject-publish`, as RabbitMQ
    /// requires): a dead-lettered message stays in the queue ([`QuorumMachine::dlx`]) until a
    /// `DeadLettered` says its target holds it ([`Effect::DeadLetterHeld`]).
    pub at_least_once: bool,
    /// `x-single-active-consumer` (with RabbitMQ 4's switch to a higher-priority consumer).
    pub single_active_consumer: bool,
    /// `x-expires`: the queue reports [`Effect::QueueExpired`] once unused this long.
    pub expires_ms: Option<u64>,
    /// `x-retention-seconds` (in ms): consumed messages are kept this long after their enqueue,
    /// for a `Rewind` (see `retained`).
    pub retention_ms: Option<u64>,
}

/// Entries at this index or above enqueue nothing (their messages are rejected): see `enqueue`.
pub const MAX_INDEX: u64 = 1 << 48;

/// RabbitMQ 4's default `x-delivery-limit`.
pub const DEFAULT_DELIVERY_LIMIT: u32 = 20;

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            max_length: None,
            max_length_bytes: None,
            overflow: Overflow::DropHead,
            delivery_limit: Some(DEFAULT_DELIVERY_LIMIT),
            message_ttl_ms: None,
            dead_letter: false,
            at_least_once: false,
            single_active_consumer: false,
            expires_ms: None,
            retention_ms: None,
        }
    }
}

impl QueueConfig {
    /// The settings of a quorum queue declared with `args` (`x-delivery-limit` is passed apart:
    /// `Some(n)`, or `None` for unlimited, as RabbitMQ's -1). Arguments a quorum queue does not
    /// have are refused with the reason.
    pub fn from_queue_args(args: &crate::queue_args::QueueArgs, delivery_limit: Option<u32>) -> Result<QueueConfig, String> {
        use crate::queue_args::Overflow as ArgOverflow;
        let overflow = match args.overflow {
            ArgOverflow::DropHead => Overflow::DropHead,
            ArgOverflow::RejectPublish => Overflow::RejectPublish,
            ArgOverflow::RejectPublishDlx => return Err("x-overflow 'reject-publish-dlx' is not supported by quorum queues".into()),
        };
        if args.max_priority > 0 {
            return Err("x-max-priority is not supported by quorum queues".into());
        }
        // A rewound message's size is not kept: the byte limit could not count it.
        if args.retention_ms > 0 && args.max_length_bytes.is_some() {
            return Err("x-retention-seconds with x-max-length-bytes is not supported by quorum queues (x-max-length is)".into());
        }
        Ok(QueueConfig {
            max_length: args.max_length,
            max_length_bytes: args.max_length_bytes,
            overflow,
            delivery_limit,
            message_ttl_ms: args.message_ttl_ms,
            dead_letter: args.dead_letter_exchange.is_some(),
            // As RabbitMQ: without reject-publish the strategy falls back to at-most-once (messages
            // kept for their dead-letter target must not be pushed out by drop-head).
            at_least_once: args.dead_letter_exchange.is_some()
                && args.dead_letter_strategy == crate::queue_args::DeadLetterStrategy::AtLeastOnce
                && args.overflow == ArgOverflow::RejectPublish,
            single_active_consumer: args.single_active_consumer,
            expires_ms: args.expires_ms,
            retention_ms: (args.retention_ms > 0).then_some(args.retention_ms),
        })
    }
}

/// Why a message left the queue other than by an ack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// Nack/reject without requeue (dead-letter reason `rejected`).
    Rejected,
    /// TTL (`expired`).
    Expired,
    /// Dropped from the head by `x-max-length(-bytes)` (`maxlen`).
    MaxLen,
    /// Returned more than `x-delivery-limit` times (`delivery_limit`).
    DeliveryLimit,
    /// Purged (never dead-lettered).
    Purged,
}

impl Reason {
    /// The `x-death` reason RabbitMQ writes.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Rejected => "rejected",
            Reason::Expired => "expired",
            Reason::MaxLen => "maxlen",
            Reason::DeliveryLimit => "delivery_limit",
            Reason::Purged => "purged",
        }
    }
}

/// One message handed to a consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    pub msg_id: MsgId,
    /// The message was delivered before (the AMQP `redelivered` flag).
    pub redelivered: bool,
    /// Failed deliveries so far (the `x-delivery-count` header; absent when 0).
    pub delivery_count: u32,
}

/// Message ids as runs `(first, count)` of consecutive ids.
pub type IdRuns = Vec<(MsgId, u32)>;

/// Iterates the ids of runs.
pub fn run_ids(runs: &[(MsgId, u32)]) -> impl Iterator<Item = MsgId> + '_ {
    runs.iter().flat_map(|&(first, n)| (0..n as u64).map(move |k| first + k))
}

/// What the replica's wrapper must do after an apply, in order. A message's body is needed from
/// its `Store` until it leaves by one of: `Release`, `DeadLetter` (after re-publishing it),
/// `Dropped`, or a `Deliver` with `settled` (after sending it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// A message was accepted: keep its payload (bytes `payload` of the entry) under `msg_id`.
    Store { msg_id: MsgId, payload: Range<usize> },
    /// Send these messages to `consumer` (only the consumer's node acts). `settled`: the consumer
    /// is auto-ack (or it was a no-ack get), the messages are no longer in the queue.
    Deliver { consumer: ConsumerId, settled: bool, msgs: Vec<Delivery> },
    /// Acked: forget these messages.
    Release { msgs: IdRuns },
    /// Re-publish these messages to the queue's dead-letter exchange with `reason`, then forget them.
    DeadLetter { reason: Reason, msgs: IdRuns },
    /// At-least-once: these messages left the queue for its dead-letter exchange with `reason`, but
    /// stay (bodies kept) until a `DeadLettered` names them. The leader re-publishes them, and every
    /// later leader re-publishes those not settled yet ([`QuorumMachine::dead_letters_waiting`]).
    DeadLetterHeld { reason: Reason, msgs: IdRuns },
    /// Removed without dead-lettering (no dead-letter exchange, or purged): forget them.
    Dropped { reason: Reason, msgs: IdRuns },
    /// To the session's node: every pub seq up to `applied_up_to` is applied; `rejected` (of this
    /// command) were refused by reject-publish overflow (nack them), the rest are enqueued (ack).
    Published { session: SessionId, applied_up_to: u64, rejected: Vec<u64> },
    /// `x-expires` elapsed with the queue unused: delete it (reported once).
    QueueExpired,
    /// A rewind made these consumed messages ready again (their bodies are in their entries,
    /// which the replicas kept for the retention).
    Rewound { runs: Vec<super::ready::Run> },
}

/// Running totals (in snapshots, so they are replica-consistent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub enqueued: u64,
    pub duplicates: u64,
    pub rejected: u64,
    pub delivered: u64,
    pub acked: u64,
    pub returned: u64,
    pub dead_lettered: u64,
    pub dropped: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Receives messages.
    Active,
    /// Cancelled (basic.cancel) with unacked messages: removed once they are settled.
    Cancelled,
    /// Created by a `Dequeue` (basic.get with ack): removed once its messages are settled.
    Getter,
}

/// A publisher session's dedup state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Session {
    /// The last pub seq applied.
    pub seq: u64,
    /// When it last enqueued (its `Enqueue`'s clock, not before the machine's).
    pub last_ms: u64,
}

/// A session that published nothing for this long is forgotten (see `forget_idle_sessions`).
pub const SESSION_IDLE_MS: u64 = 3_600_000;
const SESSION_SWEEP_EVERY_MS: u64 = 60_000;

/// Credit of an auto-ack consumer that was given no limit.
const UNLIMITED: u32 = u32::MAX;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Consumer {
    pub priority: i32,
    /// Acking consumer: unacked messages allowed (0 = unlimited).
    pub prefetch: u32,
    pub auto_ack: bool,
    /// Auto-ack consumer: messages it may still receive ([`UNLIMITED`]: no limit).
    pub credit: u32,
    pub status: Status,
    pub checked_out: BTreeMap<MsgId, MsgState>,
}

impl Consumer {
    fn can_take(&self) -> bool {
        self.status == Status::Active
            && if self.auto_ack { self.credit > 0 } else { self.prefetch == 0 || self.checked_out.len() < self.prefetch as usize }
    }
}

/// Active consumers of one priority, in registration order, with the round-robin cursor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Group {
    pub priority: i32,
    pub members: Vec<ConsumerId>,
    pub next: usize,
}

/// The effects of one apply, with the deliveries to each consumer gathered in one `Deliver` until
/// another effect, or a command that can return messages, closes the gathering.
#[derive(Default)]
struct Out {
    effects: Vec<Effect>,
    pending: Vec<Effect>,
    pending_at: BTreeMap<ConsumerId, usize>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Gone {
    Release,
    DeadLetter(Reason),
    DeadLetterHeld(Reason),
    Dropped(Reason),
}

impl Out {
    fn flush(&mut self) {
        self.effects.append(&mut self.pending);
        self.pending_at.clear();
    }

    fn push(&mut self, effect: Effect) {
        self.flush();
        self.effects.push(effect);
    }

    fn deliver(&mut self, consumer: ConsumerId, settled: bool, d: Delivery) {
        if let Some(&at) = self.pending_at.get(&consumer) {
            if let Some(Effect::Deliver { settled: s, msgs, .. }) = self.pending.get_mut(at) {
                if *s == settled {
                    msgs.push(d);
                    return;
                }
            }
        }
        self.pending_at.insert(consumer, self.pending.len());
        self.pending.push(Effect::Deliver { consumer, settled, msgs: vec![d] });
    }

    fn gone(&mut self, how: Gone, id: MsgId) {
        self.flush();
        let extended = match (self.effects.last_mut(), how) {
            (Some(Effect::Release { msgs }), Gone::Release) => Some(msgs),
            (Some(Effect::DeadLetter { reason, msgs }), Gone::DeadLetter(r)) if *reason == r => Some(msgs),
            (Some(Effect::DeadLetterHeld { reason, msgs }), Gone::DeadLetterHeld(r)) if *reason == r => Some(msgs),
            (Some(Effect::Dropped { reason, msgs }), Gone::Dropped(r)) if *reason == r => Some(msgs),
            _ => None,
        };
        match extended {
            Some(msgs) => push_id(msgs, id),
            None => self.effects.push(match how {
                Gone::Release => Effect::Release { msgs: vec![(id, 1)] },
                Gone::DeadLetter(reason) => Effect::DeadLetter { reason, msgs: vec![(id, 1)] },
                Gone::DeadLetterHeld(reason) => Effect::DeadLetterHeld { reason, msgs: vec![(id, 1)] },
                Gone::Dropped(reason) => Effect::Dropped { reason, msgs: vec![(id, 1)] },
            }),
        }
    }
}

/// A quorum queue's replicated state. See the module doc and docs/internals/cluster.md.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuorumMachine {
    pub(crate) config: QueueConfig,
    pub(crate) last_index: Option<u64>,
    pub(crate) now_ms: u64,
    /// When the queue was last used (for `x-expires`); set by the first time seen.
    pub(crate) last_used_ms: Option<u64>,
    pub(crate) expired_reported: bool,
    pub(crate) ready: Ready,
    pub(crate) consumers: BTreeMap<ConsumerId, Consumer>,
    /// Active consumers by priority, highest first.
    pub(crate) groups: Vec<Group>,
    pub(crate) sac_active: Option<ConsumerId>,
    pub(crate) exclusive: Option<ConsumerId>,
    /// Each publisher session's last applied pub seq, and when it last published.
    pub(crate) sessions: BTreeMap<SessionId, Session>,
    /// When `Tick` next forgets idle sessions.
    pub(crate) next_session_sweep_ms: u64,
    pub(crate) checked_out: u64,
    pub(crate) counters: Counters,
    /// At-least-once dead-lettering: messages dead-lettered and not yet held by their target, with
    /// why and their state (size counted against the length limits, as RabbitMQ counts them).
    pub(crate) dlx: BTreeMap<MsgId, (Reason, MsgState)>,
    pub(crate) dlx_bytes: u64,
    /// Delayed messages not due yet, by id; `timer` orders them by due time (same due: by id,
    /// publish order). A `Tick` whose clock reached a due time makes the message ready
    /// (`fire_due`). Not ready: not counted against the length limits, not purged.
    pub(crate) delayed: BTreeMap<MsgId, Held>,
    pub(crate) timer: std::collections::BTreeSet<(u64, MsgId)>,
    /// With `retention_ms`: the consumed messages kept for a rewind, and the clock's samples.
    pub(crate) retained: Retained,
}

/// A delayed message waiting in the group until `due_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub due_ms: u64,
    pub size: u32,
    /// Its TTL, which starts when it comes due.
    pub ttl_ms: Option<u64>,
    pub high: bool,
}

impl QuorumMachine {
    pub fn new(config: QueueConfig) -> QuorumMachine {
        QuorumMachine {
            ready: Ready::new(config.max_length_bytes.is_some()),
            config,
            last_index: None,
            now_ms: 0,
            last_used_ms: None,
            expired_reported: false,
            consumers: BTreeMap::new(),
            groups: Vec::new(),
            sac_active: None,
            exclusive: None,
            sessions: BTreeMap::new(),
            next_session_sweep_ms: 0,
            checked_out: 0,
            counters: Counters::default(),
            dlx: BTreeMap::new(),
            dlx_bytes: 0,
            delayed: BTreeMap::new(),
            timer: std::collections::BTreeSet::new(),
            retained: Retained::default(),
        }
    }

    /// Whether `id` is a consumed message kept for a rewind.
    pub fn is_kept(&self, id: MsgId) -> bool {
        self.retained.kept.contains(id)
    }

    /// The ids of the consumed messages kept for a rewind, from `from` on, rising.
    pub fn kept_from(&self, from: MsgId) -> impl Iterator<Item = MsgId> + '_ {
        self.retained.kept.ids_from(from)
    }

    /// Consumed messages kept for a rewind.
    pub fn retained_count(&self) -> u64 {
        self.retained.kept.len()
    }

    /// Messages below this id are past the retention: a replica keeps no entry below its entry
    /// for a rewind.
    pub fn retention_floor(&self) -> MsgId {
        self.retained.floor
    }

    /// The entry indexes that hold consumed messages kept for a rewind, rising (repeats possible).
    pub fn retained_entries(&self) -> impl Iterator<Item = u64> + '_ {
        // A run of either step covers the entries from its first id's to its last id's.
        self.retained.kept.runs().flat_map(|r| (r.first >> 16)..=(r.last() >> 16))
    }

    /// When the oldest message the queue holds or keeps for a rewind was enqueued, to the
    /// retention's sample step (None without retention or without samples).
    pub fn oldest_kept_ms(&self) -> Option<u64> {
        self.retained.samples.front().map(|s| s.1)
    }

    /// Delayed messages not due yet.
    pub fn delayed_count(&self) -> u64 {
        self.delayed.len() as u64
    }

    /// When the next delayed message comes due (by the machine's clock: a `Tick` with at least
    /// this `now_ms` makes it ready).
    pub fn next_due(&self) -> Option<u64> {
        self.timer.first().map(|(due, _)| *due)
    }

    /// At-least-once: dead letters not yet held by their target, oldest first.
    pub fn dead_letters_waiting(&self) -> impl Iterator<Item = (MsgId, Reason)> + '_ {
        self.dlx.iter().map(|(id, (reason, _))| (*id, *reason))
    }

    /// At-least-once: how many dead letters wait for their target.
    pub fn dead_letter_count(&self) -> u64 {
        self.dlx.len() as u64
    }

    /// Whether `id` is a dead letter waiting for its target.
    pub fn is_dead_letter_waiting(&self, id: MsgId) -> bool {
        self.dlx.contains_key(&id)
    }

    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// The last index applied.
    pub fn last_index(&self) -> Option<u64> {
        self.last_index
    }

    /// The machine's clock: the largest `now_ms` of the `Tick`s and `Touch`es applied.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Ready messages (basic.get / queue.declare-ok message count).
    pub fn ready_count(&self) -> u64 {
        self.ready.len()
    }

    /// Bytes of ready messages (counted only with `x-max-length-bytes`).
    pub fn ready_bytes(&self) -> u64 {
        self.ready.bytes()
    }

    /// Messages delivered and not yet settled.
    pub fn checked_out_count(&self) -> u64 {
        self.checked_out
    }

    /// Consumers that receive (not cancelled ones waiting for acks, nor basic.get holders).
    pub fn consumer_count(&self) -> usize {
        self.consumers.values().filter(|c| c.status == Status::Active).count()
    }

    /// With single active consumer: the one receiving.
    pub fn active_consumer(&self) -> Option<ConsumerId> {
        self.sac_active
    }

    /// The messages checked out to a consumer, in id order.
    pub fn checked_out_by(&self, consumer: ConsumerId) -> Vec<MsgId> {
        self.consumers.get(&consumer).map(|c| c.checked_out.keys().copied().collect()).unwrap_or_default()
    }

    /// Every live message (ready or checked out), in id order.
    pub fn live_ids(&self) -> Vec<MsgId> {
        let mut ids: Vec<MsgId> = self.ready.ids().collect();
        ids.extend(self.consumers.values().flat_map(|c| c.checked_out.keys().copied()));
        ids.extend(self.dlx.keys().copied());
        ids.extend(self.delayed.keys().copied());
        ids.sort_unstable();
        ids
    }

    /// Whether `id` is a live message: ready, checked out to a consumer, a dead letter waiting
    /// for its target, or delayed.
    pub fn is_live(&self, id: MsgId) -> bool {
        self.ready.contains(id) || self.dlx.contains_key(&id) || self.delayed.contains_key(&id) || self.consumers.values().any(|c| c.checked_out.contains_key(&id))
    }

    /// The last pub seq applied for a session.
    pub fn session_seq(&self, session: SessionId) -> Option<u64> {
        self.sessions.get(&session).map(|s| s.seq)
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Memory entries held: (returned messages, fresh runs, fresh sizes, checked-out messages,
    /// sessions). See the cost per message in the module doc.
    pub fn memory_entries(&self) -> (usize, usize, usize, u64, usize) {
        let (returned, runs, sizes) = self.ready.entries();
        (returned, runs, sizes, self.checked_out, self.sessions.len())
    }

    /// Applies the entry at Raft `index`: decodes it and applies its command(s). An undecodable
    /// entry or a stale index changes nothing and is refused (identically on every replica).
    pub fn apply(&mut self, index: u64, entry: &[u8]) -> (Vec<Effect>, Reply) {
        match Command::decode(entry) {
            Ok(cmd) => self.apply_decoded(index, cmd),
            Err(_) => {
                if self.last_index.is_some_and(|l| index <= l) {
                    return (Vec::new(), Reply::Refused(Refusal::StaleIndex));
                }
                self.last_index = Some(index);
                (Vec::new(), Reply::Refused(Refusal::BadCommand))
            }
        }
    }

    /// Applies an already decoded entry (from [`Command::decode`]).
    pub fn apply_decoded(&mut self, index: u64, cmd: Command) -> (Vec<Effect>, Reply) {
        if self.last_index.is_some_and(|l| index <= l) {
            return (Vec::new(), Reply::Refused(Refusal::StaleIndex));
        }
        self.last_index = Some(index);
        let mut out = Out::default();
        let mut next_i: u32 = 0;
        let reply = match cmd {
            Command::Batch(cmds) => {
                let mut replies = Vec::with_capacity(cmds.len());
                for c in cmds {
                    replies.push(self.apply_one(index, c, &mut next_i, &mut out));
                }
                Reply::Batch(replies)
            }
            c => self.apply_one(index, c, &mut next_i, &mut out),
        };
        out.flush();
        (out.effects, reply)
    }

    fn apply_one(&mut self, index: u64, cmd: Command, next_i: &mut u32, out: &mut Out) -> Reply {
        if matches!(cmd, Command::Detach { .. } | Command::Return { .. } | Command::Unassign { .. } | Command::ConsumerDown { .. }) {
            // Messages may come back and go to another consumer: the deliveries so far must be
            // effects before the ones that follow (gathering them would reorder a message's two
            // deliveries).
            out.flush();
        }
        let reply = match cmd {
            Command::Enqueue { session, now_ms, msgs } => self.enqueue(index, session, now_ms, msgs, next_i, out),
            Command::Attach(a) => self.attach(a),
            Command::Detach { consumer, return_unacked } => {
                self.detach(consumer, return_unacked);
                Reply::Ok
            }
            Command::Settle { consumer, msg_ids } => self.settle(consumer, &msg_ids, Settlement::Ack, out),
            Command::Return { consumer, msg_ids } => self.settle(consumer, &msg_ids, Settlement::Requeue, out),
            Command::Unassign { consumer, msg_ids } => self.settle(consumer, &msg_ids, Settlement::Unassign, out),
            Command::Discard { consumer, msg_ids } => self.settle(consumer, &msg_ids, Settlement::Reject, out),
            Command::Credit { consumer, credit } => {
                if let Some(c) = self.consumers.get_mut(&consumer) {
                    if c.auto_ack {
                        c.credit = credit;
                    } else {
                        c.prefetch = credit;
                    }
                }
                Reply::Ok
            }
            Command::Dequeue { consumer, auto_ack } => self.dequeue(consumer, auto_ack, out),
            Command::ConsumerDown { node } => {
                let gone: Vec<ConsumerId> = self.consumers.keys().filter(|c| c.node == node).copied().collect();
                for c in gone {
                    self.remove_consumer(c);
                }
                Reply::Ok
            }
            Command::SessionEnd { session } => {
                self.sessions.remove(&session);
                Reply::Ok
            }
            Command::Tick { now_ms, max_expired } => {
                self.advance(now_ms);
                if let Some(retention) = self.config.retention_ms {
                    self.retained.expire(retention, self.now_ms, msg_id(index, (*next_i).min(u16::MAX as u32) as u16));
                }
                let dead_lettered = self.fire_due(index, *next_i, max_expired, out);
                self.expire_head(out, max_expired.saturating_sub(dead_lettered));
                self.check_queue_expiry(out);
                self.forget_idle_sessions();
                Reply::Ok
            }
            Command::Touch { now_ms } => {
                self.advance(now_ms);
                self.last_used_ms = Some(self.now_ms);
                self.expired_reported = false;
                Reply::Ok
            }
            Command::DeadLettered { msg_ids } => {
                self.dead_lettered(&msg_ids, out);
                Reply::Ok
            }
            Command::Purge => {
                let count = self.ready.len();
                let runs = self.ready.clear();
                self.counters.dropped += count;
                for id in run_ids(&runs) {
                    self.consumed(id);
                }
                if !runs.is_empty() {
                    out.push(Effect::Dropped { reason: Reason::Purged, msgs: runs });
                }
                Reply::Purged { count }
            }
            Command::Rewind { to_ms } => self.rewind(to_ms, out),
            // The decoder refuses nested batches; treat one as refused if built by hand.
            Command::Batch(_) => Reply::Refused(Refusal::BadCommand),
        };
        self.assign(out);
        reply
    }

    fn advance(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        if self.last_used_ms.is_none() {
            self.last_used_ms = Some(self.now_ms);
        }
    }

    fn used(&mut self) {
        self.last_used_ms = Some(self.now_ms);
        self.expired_reported = false;
    }

    fn over_limit(&self, extra_count: u64, extra_bytes: u64) -> bool {
        // Dead letters waiting for their target count (at-least-once): a target that cannot take
        // them makes the source refuse publishes (reject-publish), as in RabbitMQ.
        let waiting = self.dlx.len() as u64;
        self.config.max_length.is_some_and(|m| self.ready.len() + waiting + extra_count > m)
            || self.config.max_length_bytes.is_some_and(|m| self.ready.bytes().saturating_add(self.dlx_bytes).saturating_add(extra_bytes) > m)
    }

    fn enqueue(&mut self, index: u64, session: SessionId, now_ms: u64, msgs: Vec<EnqueueMsg>, next_i: &mut u32, out: &mut Out) -> Reply {
        // The publishing node's clock dates its messages (never before the machine's clock) but
        // does not move the machine's clock: only Ticks (the leader's) and Touches do, so one node
        // whose clock runs ahead cannot expire every other node's messages early.
        let enqueued_at = now_ms.max(self.now_ms);
        let mut last = self.sessions.get(&session).map(|s| s.seq);
        let mut rejected = Vec::new();
        let limited = self.config.max_length.is_some() || self.config.max_length_bytes.is_some();
        // Ids are `index << 16 | i`: past 2^48 they would no longer rise, so such entries enqueue
        // nothing (at 100,000 entries a second that is 89 years of one queue's log).
        let ids_exhausted = index >= MAX_INDEX;
        for m in msgs {
            // The decoder caps an entry at MAX_MESSAGES_PER_ENTRY (65,535), so `i` fits 16 bits.
            let id = msg_id(index, (*next_i).min(u16::MAX as u32) as u16);
            *next_i += 1;
            if last.is_some_and(|l| m.pub_seq <= l) {
                self.counters.duplicates += 1;
                continue;
            }
            last = Some(m.pub_seq);
            if ids_exhausted {
                self.counters.rejected += 1;
                rejected.push(m.pub_seq);
                continue;
            }
            // A delayed message meets the length limits when it comes due (`fire_due`).
            if limited && self.config.overflow == Overflow::RejectPublish && m.delay_ms == 0 {
                if self.over_limit(1, m.size as u64) {
                    // Consumers with credit may make room first.
                    self.assign(out);
                }
                if self.over_limit(1, m.size as u64) {
                    self.counters.rejected += 1;
                    rejected.push(m.pub_seq);
                    continue;
                }
            }
            let ttl = match (m.ttl_ms, self.config.message_ttl_ms) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if m.delay_ms > 0 {
                // Held until due: its TTL and the length limits apply then (`fire_due`); not
                // ready, so the drop-head check below finds nothing new over the limit.
                let due_ms = enqueued_at.saturating_add(m.delay_ms).min(NEVER - 1);
                self.delayed.insert(id, Held { due_ms, size: m.size, ttl_ms: ttl, high: m.high });
                self.timer.insert((due_ms, id));
            } else {
                let expires_at = ttl.map_or(NEVER, |t| enqueued_at.saturating_add(t).min(NEVER - 1));
                self.ready.push_fresh(id, m.size, expires_at, m.high);
            }
            self.counters.enqueued += 1;
            if let Some(retention) = self.config.retention_ms {
                // Dated by the publishing node's clock (never before the machine's): one running
                // ahead stretches the retention and coarsens rewinds by as much (NTP assumed, as for
                // TTL). Not held to the machine's clock: that clock stands still while the group is
                // down or idle, and dating by it would end retentions early after an outage.
                self.retained.enqueued(retention, id, enqueued_at);
            }
            out.push(Effect::Store { msg_id: id, payload: m.payload });
            if limited {
                self.drop_head_over_limit(out);
            }
        }
        let applied_up_to = last.unwrap_or(0);
        if let Some(l) = last {
            self.sessions.insert(session, Session { seq: l, last_ms: enqueued_at });
        }
        out.push(Effect::Published { session, applied_up_to, rejected: rejected.clone() });
        Reply::Enqueued { applied_up_to, rejected }
    }

    /// A message leaves the queue for `reason`: dead-lettered if the queue has a dead-letter
    /// exchange (purges never are), else dropped.
    fn remove(&mut self, out: &mut Out, id: MsgId, st: MsgState, reason: Reason) {
        if self.config.dead_letter && reason != Reason::Purged && self.config.at_least_once {
            // Counted dead-lettered once its target holds it (`dead_lettered`).
            self.dlx_bytes = self.dlx_bytes.saturating_add(st.size as u64);
            self.dlx.insert(id, (reason, st));
            out.gone(Gone::DeadLetterHeld(reason), id);
        } else if self.config.dead_letter && reason != Reason::Purged {
            self.counters.dead_lettered += 1;
            self.consumed(id);
            out.gone(Gone::DeadLetter(reason), id);
        } else {
            self.counters.dropped += 1;
            self.consumed(id);
            out.gone(Gone::Dropped(reason), id);
        }
    }

    /// With drop-head, while the ready messages are past `x-max-length(-bytes)` (consumers with
    /// credit taking some first), the oldest go, dead-lettered `maxlen`: the oldest normal message
    /// first, a high-priority one only when no normal one is left.
    fn drop_head_over_limit(&mut self, out: &mut Out) {
        if self.config.overflow != Overflow::DropHead || !self.over_limit(0, 0) {
            return;
        }
        self.assign(out);
        while self.over_limit(0, 0) {
            let Some((dropped, st)) = self.ready.pop_lowest() else { break };
            self.remove(out, dropped, st, Reason::MaxLen);
        }
    }

    /// Message `id` left the queue: kept for a rewind if the queue has retention.
    fn consumed(&mut self, id: MsgId) {
        if self.config.retention_ms.is_some() {
            self.retained.consumed(id);
        }
    }

    /// At-least-once: these dead letters are held by their targets (or were dropped for good on
    /// the way, a dead-letter cycle): they leave the queue. Ids not waiting (settled already, by
    /// an earlier leader's re-publish) are ignored.
    fn dead_lettered(&mut self, ids: &[MsgId], out: &mut Out) {
        for id in ids {
            if let Some((_, st)) = self.dlx.remove(id) {
                self.dlx_bytes = self.dlx_bytes.saturating_sub(st.size as u64);
                self.counters.dead_lettered += 1;
                self.consumed(*id);
                out.gone(Gone::Release, *id);
            }
        }
    }

    /// Replaces this machine's state with a snapshot's.
    pub fn restore(&mut self, snapshot: &[u8]) -> Result<(), DecodeError> {
        *self = super::snapshot::decode(snapshot)?;
        Ok(())
    }

    /// The state without message bodies (see `snapshot`).
    pub fn snapshot(&self) -> bytes::Bytes {
        super::snapshot::encode(self)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Settlement {
    Ack,
    Requeue,
    Reject,
    Unassign,
}
