//! The quorum queue's commands (what a Raft entry carries) and replies (what the proposer gets
//! back), in Warren's own compact binary encoding.
//!
//! An entry is `VERSION u8` then one command; [`Encoder`] always writes a `Batch` so one entry can
//! carry many commands (one event-loop turn of a node's channels). Integers are LEB128 varints
//! unless noted; ids are `(node, local)` pairs of varints. Per command (tag, then fields):
//!
//! | tag | command | fields |
//! | --- | --- | --- |
//! | 1 | `Enqueue` | session, now_ms, count u32 (fixed width), count × (pub_seq, size, ttl_ms opt, payload len, payload) |
//! | 2 | `Attach` | consumer, prefetch, flags u8 (1 auto-ack, 2 exclusive), priority (zigzag) |
//! | 3 | `Detach` | consumer, return_unacked u8 |
//! | 4/5/6 | `Settle`/`Return`/`Discard` | consumer, count, first id, then zigzag deltas |
//! | 7 | `Credit` | consumer, credit |
//! | 8 | `Dequeue` | consumer, auto_ack u8 |
//! | 9 | `ConsumerDown` | node |
//! | 10 | `SessionEnd` | session |
//! | 11 | `Tick` | now_ms |
//! | 12 | `Touch` | now_ms |
//! | 13 | `Purge` | |
//! | 14 | `Batch` | count u32 (fixed width), commands (not nested) |
//! | 15 | `Tick` | now_ms, max_expired (a tick before it, tag 11, expires without a bound) |
//! | 16 | `Unassign` | consumer, count, first id, then zigzag deltas |
//! | 17 | `Enqueue` of high-priority messages | as tag 1 |
//! | 18 | `DeadLettered` | count, first id, then zigzag deltas |
//! | 19/20 | `Enqueue` of delayed messages (20: high-priority) | as tag 1, with delay_ms after ttl_ms |
//! | 21 | `Rewind` | to_ms |
//!
//! "opt" is a varint with 0 = none and n + 1 = n. Message payloads are opaque here: decoding keeps
//! only their place in the entry ([`EnqueueMsg::payload`]), so applying an entry never copies a body.

use super::codec::{err, put_bool, put_opt, put_var, put_zigzag, DecodeError, Reader};
use bytes::{BufMut, Bytes, BytesMut};
use std::ops::Range;

/// The encoding version written at the head of every entry (and reply).
pub const COMMAND_VERSION: u8 = 1;

/// At most this many messages in one entry: a message's id is `index << 16 | i`.
pub const MAX_MESSAGES_PER_ENTRY: usize = 65_535;

/// A message's id in its queue: the Raft index of the entry that enqueued it, shifted, and its
/// place in the entry. Unique and rising; also the message's store seq.
pub type MsgId = u64;

pub fn msg_id(index: u64, i: u16) -> MsgId {
    (index << 16) | i as u64
}

/// A consumer: the node it is attached on and that node's id for it (unique on the node).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConsumerId {
    pub node: u64,
    pub local: u64,
}

/// A publisher session (one AMQP channel publishing to the queue): the node and that node's id
/// for the channel. Its publisher seqs rise; the queue remembers the last one applied (dedup).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionId {
    pub node: u64,
    pub channel: u64,
}

/// One message of an `Enqueue`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnqueueMsg {
    /// The session's sequence number of this publish (rising within the session).
    pub pub_seq: u64,
    /// Bytes counted against `x-max-length-bytes` (the body's length, as RabbitMQ counts).
    pub size: u32,
    /// The message's own TTL (`expiration` property), if any.
    pub ttl_ms: Option<u64>,
    /// Where the message's opaque bytes sit in the decoded entry.
    pub payload: Range<usize>,
    /// A high-priority message (priority above 4: `ready::HIGH_PRIORITY_ABOVE`). The messages of
    /// one encoded enqueue share it (tag 17 high, tag 1 normal).
    pub high: bool,
    /// A delayed message (`x-delay`, CMQ's `delaySeconds`): held by the group this long after its
    /// enqueue, then ready (0: ready at once). Tags 19/20.
    pub delay_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attach {
    pub consumer: ConsumerId,
    /// Unacknowledged deliveries allowed at once (0 = unlimited); for an auto-ack consumer, the
    /// initial credit (see `Command::Credit`).
    pub prefetch: u32,
    /// no-ack: a delivery settles the message.
    pub auto_ack: bool,
    /// AMQP exclusive consume: refused if the queue has other consumers, and others are refused.
    pub exclusive: bool,
    /// `x-priority`: larger first.
    pub priority: i32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Messages from one publisher session; their ids are `index << 16 | i` with `i` counting the
    /// entry's messages (across a batch's enqueues). `now_ms` (the publishing node's clock) is
    /// when their TTLs start (not before the machine's clock).
    Enqueue { session: SessionId, now_ms: u64, msgs: Vec<EnqueueMsg> },
    /// Registers a consumer (again: updates its prefetch and priority).
    Attach(Attach),
    /// basic.cancel (`return_unacked` false: its unacked messages stay checked out until settled)
    /// or channel close (true: they go back to the queue, as acquired but not failed).
    Detach { consumer: ConsumerId, return_unacked: bool },
    /// Acks.
    Settle { consumer: ConsumerId, msg_ids: Vec<MsgId> },
    /// Nack/reject with requeue: delivery count + 1, back to the queue (or dead-lettered past the
    /// delivery limit).
    Return { consumer: ConsumerId, msg_ids: Vec<MsgId> },
    /// Nack/reject without requeue: dead-lettered `rejected` (or dropped).
    Discard { consumer: ConsumerId, msg_ids: Vec<MsgId> },
    /// Assigned to the consumer but never sent to its client (the node's backlog for it when it was
    /// cancelled): back to the queue as if never assigned, not a failed delivery, not redelivered.
    Unassign { consumer: ConsumerId, msg_ids: Vec<MsgId> },
    /// At-least-once dead-lettering: these dead letters are held by their target now (or were
    /// dropped for good on the way): they leave the queue.
    DeadLettered { msg_ids: Vec<MsgId> },
    /// An auto-ack consumer's credit is set to `credit`; an acking consumer's prefetch is set to it.
    Credit { consumer: ConsumerId, credit: u32 },
    /// basic.get: takes the head message for `consumer` (created if absent, removed once settled).
    Dequeue { consumer: ConsumerId, auto_ack: bool },
    /// A node is gone: its consumers are removed and their checkouts returned.
    ConsumerDown { node: u64 },
    /// A publisher session ended (channel closed): its dedup state is forgotten.
    SessionEnd { session: SessionId },
    /// Time passes: TTL expiry (at most `max_expired` messages dead-lettered, as the leader chose:
    /// see `QuorumMachine`'s expiry), queue expiry.
    Tick { now_ms: u64, max_expired: u64 },
    /// The queue was used (redeclared): restarts its `x-expires` countdown.
    Touch { now_ms: u64 },
    /// Removes every ready message.
    Purge,
    /// Makes the consumed messages kept by the retention (`x-retention-seconds`), enqueued at or
    /// after `to_ms` (unix ms), ready again.
    Rewind { to_ms: u64 },
    /// Several commands in one entry, applied in order.
    Batch(Vec<Command>),
}

const TAG_ENQUEUE: u8 = 1;
const TAG_ATTACH: u8 = 2;
const TAG_DETACH: u8 = 3;
const TAG_SETTLE: u8 = 4;
const TAG_RETURN: u8 = 5;
const TAG_DISCARD: u8 = 6;
const TAG_CREDIT: u8 = 7;
const TAG_DEQUEUE: u8 = 8;
const TAG_CONSUMER_DOWN: u8 = 9;
const TAG_SESSION_END: u8 = 10;
const TAG_TICK: u8 = 11;
const TAG_TOUCH: u8 = 12;
const TAG_PURGE: u8 = 13;
const TAG_BATCH: u8 = 14;
const TAG_TICK_BOUNDED: u8 = 15;
const TAG_UNASSIGN: u8 = 16;
const TAG_ENQUEUE_HIGH: u8 = 17;
const TAG_DEAD_LETTERED: u8 = 18;
const TAG_ENQUEUE_DELAYED: u8 = 19;
const TAG_ENQUEUE_DELAYED_HIGH: u8 = 20;
const TAG_REWIND: u8 = 21;

const ATTACH_AUTO_ACK: u8 = 1;
const ATTACH_EXCLUSIVE: u8 = 2;

impl Command {
    /// Decodes an entry. Never panics; anything malformed (including more than
    /// [`MAX_MESSAGES_PER_ENTRY`] messages) is an error.
    pub fn decode(entry: &[u8]) -> Result<Command, DecodeError> {
        let mut r = Reader::new(entry);
        let version = r.u8()?;
        if version != COMMAND_VERSION {
            return err(format!("unknown command version {version}"));
        }
        let mut messages = 0usize;
        let cmd = decode_one(&mut r, true, &mut messages)?;
        r.end()?;
        Ok(cmd)
    }

    /// The messages an entry enqueues, in the order the machine numbers them (`msg_id(index, i)`
    /// is the i-th): where each one's payload (its store encoding) is in `entry`. Every message is
    /// numbered, whether the machine accepted it or not.
    pub fn enqueued_payloads(entry: &[u8]) -> Result<Vec<Range<usize>>, DecodeError> {
        let enqueues = match Command::decode(entry)? {
            Command::Batch(cmds) => cmds,
            cmd => vec![cmd],
        };
        Ok(enqueues
            .into_iter()
            .flat_map(|c| match c {
                Command::Enqueue { msgs, .. } => msgs.into_iter().map(|m| m.payload).collect(),
                _ => Vec::new(),
            })
            .collect())
    }

    /// Encodes this command alone as an entry (for enqueues, `src` holds the payload ranges).
    pub fn encode(&self, src: &[u8]) -> Result<Bytes, EncodeError> {
        let mut e = Encoder::new();
        e.push(self, src)?;
        Ok(e.finish())
    }
}

fn decode_consumer(r: &mut Reader) -> Result<ConsumerId, DecodeError> {
    Ok(ConsumerId { node: r.var()?, local: r.var()? })
}

fn decode_session(r: &mut Reader) -> Result<SessionId, DecodeError> {
    Ok(SessionId { node: r.var()?, channel: r.var()? })
}

fn decode_ids(r: &mut Reader) -> Result<Vec<MsgId>, DecodeError> {
    let n = r.count(1)?;
    let mut ids = Vec::with_capacity(n);
    if n > 0 {
        let mut id = r.var()?;
        ids.push(id);
        for _ in 1..n {
            id = id.wrapping_add(r.zigzag()? as u64);
            ids.push(id);
        }
    }
    Ok(ids)
}

fn decode_one(r: &mut Reader, top: bool, messages: &mut usize) -> Result<Command, DecodeError> {
    let tag = r.u8()?;
    Ok(match tag {
        TAG_ENQUEUE | TAG_ENQUEUE_HIGH | TAG_ENQUEUE_DELAYED | TAG_ENQUEUE_DELAYED_HIGH => {
            let high = tag == TAG_ENQUEUE_HIGH || tag == TAG_ENQUEUE_DELAYED_HIGH;
            let delayed = tag == TAG_ENQUEUE_DELAYED || tag == TAG_ENQUEUE_DELAYED_HIGH;
            let session = decode_session(r)?;
            let now_ms = r.var()?;
            let n = r.u32_fixed()? as u64;
            let n = r.check_count(n, 4)?;
            *messages += n;
            if *messages > MAX_MESSAGES_PER_ENTRY {
                return err(format!("more than {MAX_MESSAGES_PER_ENTRY} messages in one entry"));
            }
            let mut msgs = Vec::with_capacity(n);
            for _ in 0..n {
                let pub_seq = r.var()?;
                let size = r.var_u32()?;
                let ttl_ms = r.opt()?;
                let delay_ms = if delayed { r.var()? } else { 0 };
                let len = r.var()?;
                let len = usize::try_from(len).or_else(|_| err("payload length"))?;
                let start = r.pos();
                r.bytes(len)?;
                msgs.push(EnqueueMsg { pub_seq, size, ttl_ms, payload: start..start + len, high, delay_ms });
            }
            Command::Enqueue { session, now_ms, msgs }
        }
        TAG_ATTACH => {
            let consumer = decode_consumer(r)?;
            let prefetch = r.var_u32()?;
            let flags = r.u8()?;
            if flags & !(ATTACH_AUTO_ACK | ATTACH_EXCLUSIVE) != 0 {
                return err(format!("unknown attach flags {flags:#x}"));
            }
            let priority = r.zigzag()?;
            let priority = i32::try_from(priority).or_else(|_| err("consumer priority exceeds 32 bits"))?;
            Command::Attach(Attach {
                consumer,
                prefetch,
                auto_ack: flags & ATTACH_AUTO_ACK != 0,
                exclusive: flags & ATTACH_EXCLUSIVE != 0,
                priority,
            })
        }
        TAG_DETACH => Command::Detach { consumer: decode_consumer(r)?, return_unacked: r.bool()? },
        TAG_SETTLE => Command::Settle { consumer: decode_consumer(r)?, msg_ids: decode_ids(r)? },
        TAG_RETURN => Command::Return { consumer: decode_consumer(r)?, msg_ids: decode_ids(r)? },
        TAG_DISCARD => Command::Discard { consumer: decode_consumer(r)?, msg_ids: decode_ids(r)? },
        TAG_UNASSIGN => Command::Unassign { consumer: decode_consumer(r)?, msg_ids: decode_ids(r)? },
        TAG_DEAD_LETTERED => Command::DeadLettered { msg_ids: decode_ids(r)? },
        TAG_CREDIT => Command::Credit { consumer: decode_consumer(r)?, credit: r.var_u32()? },
        TAG_DEQUEUE => Command::Dequeue { consumer: decode_consumer(r)?, auto_ack: r.bool()? },
        TAG_CONSUMER_DOWN => Command::ConsumerDown { node: r.var()? },
        TAG_SESSION_END => Command::SessionEnd { session: decode_session(r)? },
        TAG_TICK => Command::Tick { now_ms: r.var()?, max_expired: u64::MAX },
        TAG_TICK_BOUNDED => Command::Tick { now_ms: r.var()?, max_expired: r.var()? },
        TAG_TOUCH => Command::Touch { now_ms: r.var()? },
        TAG_PURGE => Command::Purge,
        TAG_REWIND => Command::Rewind { to_ms: r.var()? },
        TAG_BATCH if top => {
            let n = r.u32_fixed()? as u64;
            let n = r.check_count(n, 1)?;
            let mut cmds = Vec::with_capacity(n);
            for _ in 0..n {
                cmds.push(decode_one(r, false, messages)?);
            }
            Command::Batch(cmds)
        }
        TAG_BATCH => return err("nested batch"),
        other => return err(format!("unknown command tag {other}")),
    })
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodeError {
    /// The entry already holds [`MAX_MESSAGES_PER_ENTRY`] messages: start another entry.
    EntryFull,
    /// A payload range outside the source given to [`Encoder::push`], or a nested batch.
    Invalid(&'static str),
}

impl std::fmt::Display for EncodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EncodeError::EntryFull => write!(f, "entry full ({MAX_MESSAGES_PER_ENTRY} messages)"),
            EncodeError::Invalid(why) => write!(f, "invalid command: {why}"),
        }
    }
}

impl std::error::Error for EncodeError {}

/// Builds one entry: a `Batch` of the commands pushed, in order. Enqueues are written message by
/// message ([`Encoder::begin_enqueue`], [`Encoder::message`]) so bodies are copied once, into the
/// entry.
pub struct Encoder {
    buf: BytesMut,
    commands: u32,
    messages: usize,
    /// Where the open enqueue's message count sits, and the count so far.
    open_enqueue: Option<(usize, u32)>,
    /// The open enqueue is of delayed messages (tags 19/20: each message has a delay).
    open_delayed: bool,
}

impl Default for Encoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Encoder {
    pub fn new() -> Encoder {
        let mut buf = BytesMut::with_capacity(256);
        buf.put_u8(COMMAND_VERSION);
        buf.put_u8(TAG_BATCH);
        buf.put_u32(0);
        Encoder { buf, commands: 0, messages: 0, open_enqueue: None, open_delayed: false }
    }

    /// Commands pushed so far.
    pub fn len(&self) -> usize {
        self.commands as usize
    }

    pub fn is_empty(&self) -> bool {
        self.commands == 0
    }

    /// Messages written so far (at most [`MAX_MESSAGES_PER_ENTRY`]).
    pub fn messages(&self) -> usize {
        self.messages
    }

    /// Bytes of the entry so far.
    pub fn encoded_len(&self) -> usize {
        self.buf.len()
    }

    fn begin(&mut self, tag: u8) {
        self.open_enqueue = None;
        self.commands += 1;
        self.buf.put_u8(tag);
    }

    /// Opens an enqueue; add its messages with [`Encoder::message`] (all of `high` priority or not).
    pub fn begin_enqueue(&mut self, session: SessionId, now_ms: u64, high: bool) {
        self.begin_enqueue_of(session, now_ms, high, false);
    }

    /// Opens an enqueue of delayed messages; add them with [`Encoder::message_delayed`].
    pub fn begin_enqueue_delayed(&mut self, session: SessionId, now_ms: u64, high: bool) {
        self.begin_enqueue_of(session, now_ms, high, true);
    }

    fn begin_enqueue_of(&mut self, session: SessionId, now_ms: u64, high: bool, delayed: bool) {
        self.begin(match (delayed, high) {
            (false, false) => TAG_ENQUEUE,
            (false, true) => TAG_ENQUEUE_HIGH,
            (true, false) => TAG_ENQUEUE_DELAYED,
            (true, true) => TAG_ENQUEUE_DELAYED_HIGH,
        });
        put_var(&mut self.buf, session.node);
        put_var(&mut self.buf, session.channel);
        put_var(&mut self.buf, now_ms);
        let at = self.buf.len();
        self.buf.put_u32(0);
        self.open_enqueue = Some((at, 0));
        self.open_delayed = delayed;
    }

    /// Adds a message to the open enqueue (not of delayed messages).
    pub fn message(&mut self, pub_seq: u64, size: u32, ttl_ms: Option<u64>, payload: &[u8]) -> Result<(), EncodeError> {
        if self.open_delayed {
            return Err(EncodeError::Invalid("a message without a delay in an enqueue of delayed messages"));
        }
        self.add_message(pub_seq, size, ttl_ms, None, payload)
    }

    /// Adds a message held `delay_ms` to the open enqueue of delayed messages.
    pub fn message_delayed(&mut self, pub_seq: u64, size: u32, ttl_ms: Option<u64>, delay_ms: u64, payload: &[u8]) -> Result<(), EncodeError> {
        if !self.open_delayed {
            return Err(EncodeError::Invalid("a delayed message in an enqueue without delays"));
        }
        self.add_message(pub_seq, size, ttl_ms, Some(delay_ms), payload)
    }

    fn add_message(&mut self, pub_seq: u64, size: u32, ttl_ms: Option<u64>, delay_ms: Option<u64>, payload: &[u8]) -> Result<(), EncodeError> {
        let Some((at, count)) = self.open_enqueue.as_mut() else {
            return Err(EncodeError::Invalid("message without begin_enqueue"));
        };
        if self.messages >= MAX_MESSAGES_PER_ENTRY {
            return Err(EncodeError::EntryFull);
        }
        self.messages += 1;
        *count += 1;
        let (at, count) = (*at, *count);
        self.buf[at..at + 4].copy_from_slice(&count.to_be_bytes());
        put_var(&mut self.buf, pub_seq);
        put_var(&mut self.buf, size as u64);
        put_opt(&mut self.buf, ttl_ms);
        if let Some(delay) = delay_ms {
            put_var(&mut self.buf, delay);
        }
        put_var(&mut self.buf, payload.len() as u64);
        self.buf.put_slice(payload);
        Ok(())
    }

    fn consumer(&mut self, tag: u8, c: ConsumerId) {
        self.begin(tag);
        put_var(&mut self.buf, c.node);
        put_var(&mut self.buf, c.local);
    }

    fn ids(&mut self, ids: &[MsgId]) {
        put_var(&mut self.buf, ids.len() as u64);
        let mut prev = None;
        for &id in ids {
            match prev {
                None => put_var(&mut self.buf, id),
                Some(p) => put_zigzag(&mut self.buf, id.wrapping_sub(p) as i64),
            }
            prev = Some(id);
        }
    }

    pub fn attach(&mut self, a: &Attach) {
        self.consumer(TAG_ATTACH, a.consumer);
        put_var(&mut self.buf, a.prefetch as u64);
        let flags = if a.auto_ack { ATTACH_AUTO_ACK } else { 0 } | if a.exclusive { ATTACH_EXCLUSIVE } else { 0 };
        self.buf.put_u8(flags);
        put_zigzag(&mut self.buf, a.priority as i64);
    }

    pub fn detach(&mut self, consumer: ConsumerId, return_unacked: bool) {
        self.consumer(TAG_DETACH, consumer);
        put_bool(&mut self.buf, return_unacked);
    }

    pub fn settle(&mut self, consumer: ConsumerId, ids: &[MsgId]) {
        self.consumer(TAG_SETTLE, consumer);
        self.ids(ids);
    }

    pub fn return_(&mut self, consumer: ConsumerId, ids: &[MsgId]) {
        self.consumer(TAG_RETURN, consumer);
        self.ids(ids);
    }

    pub fn discard(&mut self, consumer: ConsumerId, ids: &[MsgId]) {
        self.consumer(TAG_DISCARD, consumer);
        self.ids(ids);
    }

    pub fn unassign(&mut self, consumer: ConsumerId, ids: &[MsgId]) {
        self.consumer(TAG_UNASSIGN, consumer);
        self.ids(ids);
    }

    pub fn dead_lettered(&mut self, ids: &[MsgId]) {
        self.begin(TAG_DEAD_LETTERED);
        self.ids(ids);
    }

    pub fn credit(&mut self, consumer: ConsumerId, credit: u32) {
        self.consumer(TAG_CREDIT, consumer);
        put_var(&mut self.buf, credit as u64);
    }

    pub fn dequeue(&mut self, consumer: ConsumerId, auto_ack: bool) {
        self.consumer(TAG_DEQUEUE, consumer);
        put_bool(&mut self.buf, auto_ack);
    }

    pub fn consumer_down(&mut self, node: u64) {
        self.begin(TAG_CONSUMER_DOWN);
        put_var(&mut self.buf, node);
    }

    pub fn session_end(&mut self, session: SessionId) {
        self.begin(TAG_SESSION_END);
        put_var(&mut self.buf, session.node);
        put_var(&mut self.buf, session.channel);
    }

    /// A tick that dead-letters at most `max_expired` expired messages.
    pub fn tick(&mut self, now_ms: u64, max_expired: u64) {
        self.begin(TAG_TICK_BOUNDED);
        put_var(&mut self.buf, now_ms);
        put_var(&mut self.buf, max_expired);
    }

    pub fn touch(&mut self, now_ms: u64) {
        self.begin(TAG_TOUCH);
        put_var(&mut self.buf, now_ms);
    }

    pub fn purge(&mut self) {
        self.begin(TAG_PURGE);
    }

    pub fn rewind(&mut self, to_ms: u64) {
        self.begin(TAG_REWIND);
        put_var(&mut self.buf, to_ms);
    }

    /// Adds a decoded command (enqueue payloads are copied from `src`, the entry it was decoded
    /// from); a batch adds its commands.
    pub fn push(&mut self, cmd: &Command, src: &[u8]) -> Result<(), EncodeError> {
        match cmd {
            Command::Enqueue { session, now_ms, msgs } => {
                if self.messages + msgs.len() > MAX_MESSAGES_PER_ENTRY {
                    return Err(EncodeError::EntryFull);
                }
                if msgs.is_empty() {
                    self.begin_enqueue(*session, *now_ms, false);
                }
                let mut open = None;
                for m in msgs {
                    let delayed = m.delay_ms > 0;
                    if open != Some((m.high, delayed)) {
                        self.begin_enqueue_of(*session, *now_ms, m.high, delayed);
                        open = Some((m.high, delayed));
                    }
                    let payload = src.get(m.payload.clone()).ok_or(EncodeError::Invalid("payload range outside the source"))?;
                    self.add_message(m.pub_seq, m.size, m.ttl_ms, delayed.then_some(m.delay_ms), payload)?;
                }
                self.open_enqueue = None;
            }
            Command::Attach(a) => self.attach(a),
            Command::Detach { consumer, return_unacked } => self.detach(*consumer, *return_unacked),
            Command::Settle { consumer, msg_ids } => self.settle(*consumer, msg_ids),
            Command::Return { consumer, msg_ids } => self.return_(*consumer, msg_ids),
            Command::Discard { consumer, msg_ids } => self.discard(*consumer, msg_ids),
            Command::Unassign { consumer, msg_ids } => self.unassign(*consumer, msg_ids),
            Command::DeadLettered { msg_ids } => self.dead_lettered(msg_ids),
            Command::Credit { consumer, credit } => self.credit(*consumer, *credit),
            Command::Dequeue { consumer, auto_ack } => self.dequeue(*consumer, *auto_ack),
            Command::ConsumerDown { node } => self.consumer_down(*node),
            Command::SessionEnd { session } => self.session_end(*session),
            Command::Tick { now_ms, max_expired } => self.tick(*now_ms, *max_expired),
            Command::Touch { now_ms } => self.touch(*now_ms),
            Command::Purge => self.purge(),
            Command::Rewind { to_ms } => self.rewind(*to_ms),
            Command::Batch(cmds) => {
                for c in cmds {
                    if matches!(c, Command::Batch(_)) {
                        return Err(EncodeError::Invalid("nested batch"));
                    }
                    self.push(c, src)?;
                }
            }
        }
        Ok(())
    }

    /// The entry's bytes.
    pub fn finish(mut self) -> Bytes {
        let commands = self.commands.to_be_bytes();
        self.buf[2..6].copy_from_slice(&commands);
        self.buf.freeze()
    }
}

/// Why a command was refused (deterministically: every replica refuses it alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The entry could not be decoded.
    BadCommand,
    /// Applied at or below an index already applied (a replay bug in the caller).
    StaleIndex,
    /// An exclusive consumer holds the queue, or an exclusive attach found other consumers.
    ExclusiveConsumer,
}

/// A message taken by `Dequeue`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dequeued {
    pub msg_id: MsgId,
    pub redelivered: bool,
    pub delivery_count: u32,
    /// Ready messages left after it (basic.get-ok's message-count).
    pub ready_after: u64,
}

/// What applying a command returns to its proposer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Ok,
    /// Every pub seq of the session up to `applied_up_to` is applied; of those in this command,
    /// `rejected` were refused (reject-publish overflow: nack them), the others enqueued.
    Enqueued { applied_up_to: u64, rejected: Vec<u64> },
    Dequeued(Option<Dequeued>),
    Purged { count: u64 },
    /// A rewind made `count` messages ready again, from the sample taken at `from_ms` (None: the
    /// queue kept nothing to rewind); `clamped`: the time asked was before the oldest one kept.
    Rewound { count: u64, from_ms: Option<u64>, clamped: bool },
    Refused(Refusal),
    Batch(Vec<Reply>),
}

const REPLY_OK: u8 = 1;
const REPLY_ENQUEUED: u8 = 2;
const REPLY_DEQUEUED: u8 = 3;
const REPLY_PURGED: u8 = 4;
const REPLY_REFUSED: u8 = 5;
const REPLY_BATCH: u8 = 6;
const REPLY_REWOUND: u8 = 7;

impl Reply {
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(16);
        out.put_u8(COMMAND_VERSION);
        self.encode_into(&mut out);
        out.freeze()
    }

    fn encode_into(&self, out: &mut BytesMut) {
        match self {
            Reply::Ok => out.put_u8(REPLY_OK),
            Reply::Enqueued { applied_up_to, rejected } => {
                out.put_u8(REPLY_ENQUEUED);
                put_var(out, *applied_up_to);
                put_var(out, rejected.len() as u64);
                for s in rejected {
                    put_var(out, *s);
                }
            }
            Reply::Dequeued(None) => {
                out.put_u8(REPLY_DEQUEUED);
                out.put_u8(0);
            }
            Reply::Dequeued(Some(d)) => {
                out.put_u8(REPLY_DEQUEUED);
                out.put_u8(1);
                put_var(out, d.msg_id);
                put_bool(out, d.redelivered);
                put_var(out, d.delivery_count as u64);
                put_var(out, d.ready_after);
            }
            Reply::Purged { count } => {
                out.put_u8(REPLY_PURGED);
                put_var(out, *count);
            }
            Reply::Rewound { count, from_ms, clamped } => {
                out.put_u8(REPLY_REWOUND);
                put_var(out, *count);
                put_opt(out, *from_ms);
                put_bool(out, *clamped);
            }
            Reply::Refused(why) => {
                out.put_u8(REPLY_REFUSED);
                out.put_u8(match why {
                    Refusal::BadCommand => 1,
                    Refusal::StaleIndex => 2,
                    Refusal::ExclusiveConsumer => 3,
                });
            }
            Reply::Batch(replies) => {
                out.put_u8(REPLY_BATCH);
                put_var(out, replies.len() as u64);
                for r in replies {
                    r.encode_into(out);
                }
            }
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<Reply, DecodeError> {
        let mut r = Reader::new(bytes);
        let version = r.u8()?;
        if version != COMMAND_VERSION {
            return err(format!("unknown reply version {version}"));
        }
        let reply = Self::decode_one(&mut r, true)?;
        r.end()?;
        Ok(reply)
    }

    fn decode_one(r: &mut Reader, top: bool) -> Result<Reply, DecodeError> {
        Ok(match r.u8()? {
            REPLY_OK => Reply::Ok,
            REPLY_ENQUEUED => {
                let applied_up_to = r.var()?;
                let n = r.count(1)?;
                let mut rejected = Vec::with_capacity(n);
                for _ in 0..n {
                    rejected.push(r.var()?);
                }
                Reply::Enqueued { applied_up_to, rejected }
            }
            REPLY_DEQUEUED => match r.bool()? {
                false => Reply::Dequeued(None),
                true => Reply::Dequeued(Some(Dequeued {
                    msg_id: r.var()?,
                    redelivered: r.bool()?,
                    delivery_count: r.var_u32()?,
                    ready_after: r.var()?,
                })),
            },
            REPLY_PURGED => Reply::Purged { count: r.var()? },
            REPLY_REWOUND => Reply::Rewound { count: r.var()?, from_ms: r.opt()?, clamped: r.bool()? },
            REPLY_REFUSED => Reply::Refused(match r.u8()? {
                1 => Refusal::BadCommand,
                2 => Refusal::StaleIndex,
                3 => Refusal::ExclusiveConsumer,
                other => return err(format!("unknown refusal {other}")),
            }),
            REPLY_BATCH if top => {
                let n = r.count(1)?;
                let mut replies = Vec::with_capacity(n);
                for _ in 0..n {
                    replies.push(Self::decode_one(r, false)?);
                }
                Reply::Batch(replies)
            }
            REPLY_BATCH => return err("nested batch reply"),
            other => return err(format!("unknown reply tag {other}")),
        })
    }
}
