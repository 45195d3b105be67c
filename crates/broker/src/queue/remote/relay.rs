//! Consumers of a classic queue on a node that is not its home. Each has a relay consumer on the
//! home (opened with `OPEN`, on a channel of its own there, with this consumer's prefetch, no-ack
//! and priority), which delivers as any consumer does; the home pushes the deliveries here
//! (`DELIVER`) and this node hands them to the client's channel under tags of its own. The client's
//! acks, nacks and rejects go back by the home's tags (`SETTLE`). basic.cancel stops the relay's
//! deliveries (`CANCEL`) and closes it (`CLOSE`: what it still holds goes back to the queue) once
//! the client settled what it holds; a closed channel closes it at once.
//!
//! Failures: a relay the home does not know (it restarted, or gave up on this node) or a home that
//! does not answer is found by `CHECK`, every `CHECK_EVERY`: the client's consumer is cancelled
//! (basic.cancel, as RabbitMQ does when a classic queue's node goes down) and what it held is
//! already back in the queue on the home. The home closes the relays of a node it has not reached
//! for a while, and of an earlier run of a node (relay ids carry the run's `incarnation`).
//!
//! Through a member of a quorum queue's group, a lost member (or one that refused or could not take
//! a consumer) is not the end: the consumers are opened again on another member, without telling
//! the client. What they held comes back redelivered (the lost member's consumers are detached by
//! the group, as any down node's); the client's acks of it are dropped here.

use parking_lot::Mutex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::wire::{self, Request};
use super::RemoteHome;
use crate::queue::{consumers::Consumer, Settle};
use crate::error::Result;
use crate::message::MessageRef;
use crate::queue::{Entry, Queue};

/// How often a node asks the home whether its relays are still there.
const CHECK_EVERY_MS: u64 = 2_000;
/// A relay's pushed-but-not-taken bytes above which the home's next push waits.
const BACKLOG_BYTES: usize = 4 << 20;
/// Most delivery tags one merged `SETTLE` carries.
const MAX_TAGS_PER_SETTLE: usize = 4096;
/// Through a member: how many members in a row may refuse or fail a consumer's `OPEN` before it is
/// cancelled.
const OPEN_TRIES: u32 = 3;

/// The high 32 bits of this process's relay ids: random per run, so a home tells an earlier run's
/// relays from this one's.
pub fn incarnation() -> u64 {
    static RUN: OnceLock<u64> = OnceLock::new();
    *RUN.get_or_init(|| (rand::random::<u32>() | 1) as u64)
}

/// The run a relay id belongs to.
pub fn incarnation_of(relay: u64) -> u64 {
    relay >> 32
}

pub(super) fn new_relay_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    incarnation() << 32 | (NEXT.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff)
}

#[derive(Default)]
pub struct Relays {
    st: Mutex<State>,
}

#[derive(Default)]
struct State {
    by_id: HashMap<u64, Relay>,
    /// Deliveries in the hands of this node's consumers, by the seq they carry here: (relay, tag on
    /// the home).
    held: HashMap<u64, (u64, u64)>,
    /// Relays of basic.gets (`get`) holding a message: closed once it is settled.
    gets: HashSet<u64>,
    next_seq: u64,
    next_check_ms: u64,
    checking: bool,
    /// Requests about relays (`OPEN`, `SETTLE`, `CANCEL`, `CLOSE`) waiting to go to the home, one at a
    /// time in the order they were made: the home serves requests concurrently, and a `CLOSE` that
    /// overtook the `SETTLE` before it would requeue what the client acked (or one that overtook its
    /// `OPEN` would leave the relay open for good).
    outbox: VecDeque<(Request, Option<super::RequestDone>)>,
    sending: bool,
}

struct Relay {
    consumer: Arc<Consumer>,
    /// Pushed by the home but not taken by the client's channel yet (flow off, or the connection's
    /// buffers full).
    backlog: VecDeque<Entry>,
    /// Bytes of `backlog` (`Message::memory_bytes`).
    backlog_bytes: usize,
    /// Delivered to the client and not settled.
    outstanding: usize,
    /// The home answered its `OPEN` (only then does a `CHECK` ask about it).
    opened: bool,
    cancelled: bool,
}

/// Set in every seq a relayed delivery carries here, so that a settlement tells by itself which
/// way the entry came (`Queue::settle`): a quorum queue's node that joined its group after relaying
/// consumers through a member has both relayed deliveries and its own replica's (msg ids, which
/// stay far below this bit). Before, every settlement went to the relay then, and acks of the
/// replica's deliveries were dropped: the messages stayed checked out, or came back again and
/// again.
pub const RELAY_SEQ: u64 = 1 << 63;

impl Relays {
    /// The consumers of this node's clients that these relays serve (not cancelled).
    pub(super) fn consumers(&self) -> Vec<Arc<Consumer>> {
        self.st.lock().by_id.values().filter(|r| !r.cancelled).map(|r| r.consumer.clone()).collect()
    }

    /// A message basic.get took for get relay `relay` (tag `tag` on the home): the seq it carries
    /// in the client's channel here.
    pub(super) fn hold_got(&self, relay: u64, tag: u64) -> u64 {
        let mut st = self.st.lock();
        st.next_seq += 1;
        let seq = RELAY_SEQ | st.next_seq;
        st.held.insert(seq, (relay, tag));
        st.gets.insert(relay);
        seq
    }
}

impl RemoteHome {
    /// basic.consume on this node: consume-ok at once, the relay opened on the home meanwhile (a
    /// refusal there, such as another exclusive consumer, cancels the consumer).
    pub(in crate::queue) fn add_consumer(&self, queue: &Arc<Queue>, consumer: Arc<Consumer>, on_registered: impl FnOnce()) -> Result<()> {
        self.open(queue, consumer, on_registered, 1);
        Ok(())
    }

    /// Opens a relay for `consumer` on the home (`tries`: the how-manieth home in a row asked).
    fn open(&self, queue: &Arc<Queue>, consumer: Arc<Consumer>, on_registered: impl FnOnce(), tries: u32) {
        let relay = new_relay_id();
        let open = Request::Open {
            queue: super::queue_ref(queue),
            relay,
            tag: consumer.tag.to_string(),
            prefetch: consumer.prefetch,
            no_ack: consumer.no_ack,
            exclusive: consumer.exclusive,
            priority: consumer.priority,
        };
        self.relays.st.lock().by_id.insert(relay, Relay { consumer, backlog: VecDeque::new(), backlog_bytes: 0, outstanding: 0, opened: false, cancelled: false });
        on_registered();
        let weak = Arc::downgrade(queue);
        let home = self.home();
        self.send_in_order(
            queue,
            open,
            Box::new(move |answer| {
                let Some(queue) = weak.upgrade() else { return };
                let Some(remote) = queue.relay_side() else { return };
                let Err(e) = answer else {
                    if let Some(r) = remote.relays.st.lock().by_id.get_mut(&relay) {
                        r.opened = true;
                    }
                    return;
                };
                if tries < OPEN_TRIES && remote.move_from(&queue, home) {
                    tracing::info!(queue = %queue.name, member = home, error = %e, "a member of the quorum queue's group could not take a consumer; trying another");
                    remote.reopen(&queue, &[relay], tries + 1);
                    return;
                }
                tracing::warn!(queue = %queue.name, home, error = %e, "a consumer could not be registered on {}; cancelling it", remote.what());
                remote.drop_relays(&queue, &[relay]);
            }),
        );
    }

    /// Opens the consumers of relays `ids` again on the (new) home: through a member, once the one
    /// they were on is lost. What they held is forgotten here (the group gives it back).
    fn reopen(&self, queue: &Arc<Queue>, ids: &[u64], tries: u32) {
        let moved: Vec<Arc<Consumer>> = {
            let mut st = self.relays.st.lock();
            let moved = ids.iter().filter_map(|id| st.by_id.remove(id)).filter(|r| !r.cancelled).map(|r| r.consumer).collect();
            st.held.retain(|_, (r, _)| !ids.contains(r));
            moved
        };
        for consumer in moved {
            if !consumer.channel.is_closed() {
                self.open(queue, consumer, || {}, tries);
            }
        }
    }

    /// basic.cancel, or the consumer's channel closed.
    pub(in crate::queue) fn remove_consumer(&self, queue: &Arc<Queue>, consumer: &Arc<Consumer>) {
        let mut requests = Vec::new();
        {
            let mut st = self.relays.st.lock();
            let State { by_id, held, .. } = &mut *st;
            let Some((&id, relay)) = by_id.iter_mut().find(|(_, r)| Arc::ptr_eq(&r.consumer, consumer)) else { return };
            // What the client never got goes back now.
            let unsent: Vec<u64> = relay.backlog.drain(..).filter_map(|e| held.remove(&e.seq).map(|(_, tag)| tag)).collect();
            relay.backlog_bytes = 0;
            if !unsent.is_empty() {
                requests.push(Request::Settle { relay: id, how: Settle::Reject { requeue: true }, tags: unsent });
            }
            if relay.outstanding == 0 || consumer.channel.is_closed() {
                by_id.remove(&id);
                held.retain(|_, (r, _)| *r != id);
                requests.push(Request::Close { relay: id });
            } else {
                relay.cancelled = true;
                requests.push(Request::Cancel { relay: id });
            }
        }
        self.send_all(queue, requests);
    }

    /// Bytes pushed for `relay` that the client's channel has not taken yet: the home's next push
    /// waits while they are many (`BACKLOG_BYTES`; a no-ack consumer has no prefetch to stop it).
    pub fn relay_backlog_full(&self, relay: u64) -> bool {
        self.relays.st.lock().by_id.get(&relay).is_some_and(|r| r.backlog_bytes >= BACKLOG_BYTES)
    }

    /// Deliveries the home pushed for `relay`. An error: this node has no such relay (the home then
    /// closes it, which returns the messages).
    pub fn relay_delivered(&self, queue: &Arc<Queue>, relay: u64, deliveries: Vec<(u64, bool, MessageRef)>) -> std::result::Result<(), String> {
        let mut requests = Vec::new();
        {
            let mut st = self.relays.st.lock();
            let State { by_id, held, next_seq, .. } = &mut *st;
            let Some(r) = by_id.get_mut(&relay) else {
                return Err(format!("node has no consumer relay {relay} of queue '{}'", queue.name));
            };
            if r.cancelled {
                // Pushed before the home saw the cancel: back to the queue.
                let tags = deliveries.iter().map(|(tag, _, _)| *tag).collect();
                requests.push(Request::Settle { relay, how: Settle::Reject { requeue: true }, tags });
            } else {
                for (tag, redelivered, message) in deliveries {
                    *next_seq += 1;
                    let seq = RELAY_SEQ | *next_seq;
                    held.insert(seq, (relay, tag));
                    r.backlog_bytes += message.memory_bytes();
                    r.backlog.push_back(Entry { message, seq, stored_bytes: 0, expires_at_ms: None, redelivered, returned: 0 });
                }
                hand_over(r, held);
            }
        }
        self.send_all(queue, requests);
        Ok(())
    }

    /// The client's channel may take deliveries again (credit or room came back).
    pub(in crate::queue) fn dispatch(&self) {
        let mut st = self.relays.st.lock();
        let State { by_id, held, .. } = &mut *st;
        for r in by_id.values_mut() {
            if !r.backlog.is_empty() {
                hand_over(r, held);
            }
        }
    }

    /// The client settled deliveries of this queue: back to the home by its tags.
    pub(in crate::queue) fn settle(&self, queue: &Arc<Queue>, entries: Vec<Entry>, how: Settle) {
        let mut requests = Vec::new();
        {
            let mut st = self.relays.st.lock();
            let State { by_id, held, gets, .. } = &mut *st;
            let mut by_relay: Vec<(u64, Vec<u64>)> = Vec::new();
            for e in entries {
                let Some((relay, tag)) = held.remove(&e.seq) else { continue };
                match by_relay.iter_mut().find(|(r, _)| *r == relay) {
                    Some((_, tags)) => tags.push(tag),
                    None => by_relay.push((relay, vec![tag])),
                }
            }
            for (relay, tags) in by_relay {
                if let Some(r) = by_id.get_mut(&relay) {
                    r.outstanding = r.outstanding.saturating_sub(tags.len());
                }
                requests.push(Request::Settle { relay, how, tags });
                if gets.remove(&relay) {
                    requests.push(Request::Close { relay });
                } else if by_id.get(&relay).is_some_and(|r| r.cancelled && r.outstanding == 0) {
                    by_id.remove(&relay);
                    requests.push(Request::Close { relay });
                }
            }
        }
        self.send_all(queue, requests);
    }

    /// Asks the home, now and then, whether it still has this node's relays.
    pub(in crate::queue) fn tick(&self, queue: &Arc<Queue>, now_ms: u64) {
        let ids: Vec<u64> = {
            let mut st = self.relays.st.lock();
            if st.by_id.is_empty() || st.checking || now_ms < st.next_check_ms {
                return;
            }
            st.next_check_ms = now_ms + CHECK_EVERY_MS;
            let ids: Vec<u64> = st.by_id.iter().filter(|(_, r)| r.opened).map(|(id, _)| *id).collect();
            if ids.is_empty() {
                return;
            }
            st.checking = true;
            ids
        };
        let weak = Arc::downgrade(queue);
        let asked = ids.clone();
        let home = self.home();
        self.request(
            &Request::Check { relays: ids },
            Box::new(move |answer| {
                let Some(queue) = weak.upgrade() else { return };
                let Some(remote) = queue.relay_side() else { return };
                remote.relays.st.lock().checking = false;
                let gone: Vec<u64> = match answer.and_then(|a| wire::decode_ids(&a).map_err(|e| e.to_string())) {
                    Ok(unknown) => unknown.into_iter().filter(|id| asked.contains(id)).collect(),
                    Err(e) => {
                        tracing::warn!(queue = %queue.name, home, error = %e, "{} does not answer; its consumers on this node are cancelled or move", remote.what());
                        asked
                    }
                };
                if gone.is_empty() {
                    return;
                }
                if remote.move_from(&queue, home) {
                    remote.reopen(&queue, &gone, 1);
                } else {
                    remote.drop_relays(&queue, &gone);
                }
            }),
        );
    }

    /// The queue was deleted: its consumers here are cancelled.
    pub(in crate::queue) fn deleted(&self, queue: &Arc<Queue>) {
        let ids: Vec<u64> = self.relays.st.lock().by_id.keys().copied().collect();
        self.drop_relays(queue, &ids);
    }

    /// Forgets relays the home lost (or refused): their consumers are cancelled (basic.cancel), and
    /// what they held is the queue's again on the home (acks of it are not sent).
    fn drop_relays(&self, queue: &Arc<Queue>, ids: &[u64]) {
        let dropped: Vec<Relay> = {
            let mut st = self.relays.st.lock();
            let dropped = ids.iter().filter_map(|id| st.by_id.remove(id)).collect();
            st.held.retain(|_, (r, _)| !ids.contains(r));
            dropped
        };
        for r in dropped {
            tracing::info!(queue = %queue.name, consumer = %r.consumer.tag, "consumer relayed from another node cancelled");
            r.consumer.channel.consumer_cancelled_by_server(&r.consumer.tag);
        }
    }

    /// Sends `requests` after every relay request made before them (see `State::outbox`).
    pub(super) fn send_all(&self, queue: &Arc<Queue>, requests: Vec<Request>) {
        {
            let mut st = self.relays.st.lock();
            st.outbox.extend(requests.into_iter().map(|r| (r, None)));
        }
        self.send_next_relay_request(queue);
    }

    /// Sends `request` after every relay request made before it; `done` gets its answer.
    fn send_in_order(&self, queue: &Arc<Queue>, request: Request, done: super::RequestDone) {
        self.relays.st.lock().outbox.push_back((request, Some(done)));
        self.send_next_relay_request(queue);
    }

    /// Sends the next relay request unless one is on its way.
    fn send_next_relay_request(&self, queue: &Arc<Queue>) {
        let (request, done) = {
            let mut st = self.relays.st.lock();
            if st.sending {
                return;
            }
            let Some(mut next) = st.outbox.pop_front() else { return };
            // Settlements of one relay queued one after the other go as one request: one at a
            // time must not mean one round trip per basic.ack of a client that acks each message.
            if let (Request::Settle { relay, how, tags }, None) = &mut next {
                while let Some((Request::Settle { relay: r, how: h, tags: more }, None)) = st.outbox.front_mut() {
                    if *r != *relay || *h != *how || tags.len() + more.len() > MAX_TAGS_PER_SETTLE {
                        break;
                    }
                    tags.append(more);
                    st.outbox.pop_front();
                }
            }
            st.sending = true;
            next
        };
        let weak = Arc::downgrade(queue);
        self.request(
            &request,
            Box::new(move |answer| {
                let Some(queue) = weak.upgrade() else { return };
                match done {
                    Some(done) => done(answer),
                    // The relay is gone on the home, or the home is: its CHECK sorts it out.
                    None => {
                        if let Err(e) = answer {
                            tracing::debug!(queue = %queue.name, error = %e, "a relay request to another node failed");
                        }
                    }
                }
                if let Some(remote) = queue.relay_side() {
                    remote.relays.st.lock().sending = false;
                    remote.send_next_relay_request(&queue);
                }
            }),
        );
    }
}

/// Hands a relay's backlog to the client's channel, in order, as far as it takes it.
fn hand_over(r: &mut Relay, held: &mut HashMap<u64, (u64, u64)>) {
    while let Some(entry) = r.backlog.pop_front() {
        let seq = entry.seq;
        let bytes = entry.message.memory_bytes();
        match r.consumer.channel.try_deliver(&r.consumer, entry) {
            Ok(None) => {
                r.outstanding += 1;
                r.backlog_bytes = r.backlog_bytes.saturating_sub(bytes);
            }
            // No-ack: the home settled it when it pushed it.
            Ok(Some(_)) => {
                held.remove(&seq);
                r.backlog_bytes = r.backlog_bytes.saturating_sub(bytes);
            }
            Err(entry) => {
                r.backlog.push_front(entry);
                return;
            }
        }
    }
}
