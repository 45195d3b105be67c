//! The delivery side of an AMQP channel: consumers, delivery tags, unacknowledged messages,
//! prefetch (per consumer and per channel) and settlement (ack, nack, reject, recover).
//!
//! Lock order: a queue's lock may be held while a channel's lock is taken (delivery), never the
//! other way round. Settlement therefore takes what it needs out of the channel first, releases
//! the channel lock, and only then calls into the queues.

use crate::consumers::ConsumerArgs;
pub use crate::consumers::Consumer;
pub use crate::sink::{AckWhenWritten, ClientSink, Delivery, Kick};
use crate::direct_reply::{ReplyConsumers, ReplyTarget};
use crate::error::{BrokerError, Result};
use crate::message::MessageRef;
use crate::publisher::Publisher;
pub use crate::queue::Settle;
use crate::queue::{DeliverySink, Entry, Queue};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use warren_store::{Batch, SyncTicket};

struct Unacked {
    tag: u64,
    queue: Arc<Queue>,
    entry: Entry,
    consumer: Option<Arc<Consumer>>,
    /// When an acknowledgement-timeout check first saw it unacked (0: not yet); see `ack_timed_out`.
    seen_ms: u64,
}

/// Memory (`Message::memory_bytes`) of delivered, unacknowledged messages a connection (all its
/// channels) may hold before its ack-mode consumers get no more (and basic.get answers get-empty) until
/// some are settled. Without it a consumer with no prefetch limit makes the broker hold a whole
/// backlog in memory. One message always fits, however large. Counted by the connection's
/// [`ClientSink`].
pub const UNACKED_BYTES_LIMIT: usize = 128 << 20;

struct ChannelState {
    next_tag: u64,
    /// Ordered by delivery tag.
    unacked: VecDeque<Unacked>,
    consumers: HashMap<Arc<str>, Arc<Consumer>>,
    /// basic.qos global=true: limit for the whole channel; 0 = unlimited.
    global_prefetch: u32,
    /// basic.qos global=false: limit given to consumers created from now on.
    consumer_prefetch: u32,
    /// channel.flow: false stops deliveries.
    flow_active: bool,
    closed: bool,
    /// Some unacked message came from a queue with its own `x-consumer-timeout`.
    queue_timeouts: bool,
    /// The direct reply-to consumer of this channel, if any (see `direct_reply`).
    reply: Option<ReplyConsumer>,
}

/// A channel's consumer of `amq.rabbitmq.reply-to`.
struct ReplyConsumer {
    tag: Arc<str>,
    token: String,
    registry: Arc<ReplyConsumers>,
}

pub struct Channel {
    pub number: u16,
    /// Connection identity, for exclusive queues.
    pub connection_id: u64,
    sink: Arc<dyn ClientSink>,
    me: Weak<Channel>,
    state: Mutex<ChannelState>,
}

impl Channel {
    pub fn new(number: u16, connection_id: u64, sink: Arc<dyn ClientSink>) -> Arc<Channel> {
        Arc::new_cyclic(|me| Channel {
            number,
            connection_id,
            sink,
            me: me.clone(),
            state: Mutex::new(ChannelState {
                next_tag: 1,
                unacked: VecDeque::new(),
                consumers: HashMap::new(),
                global_prefetch: 0,
                consumer_prefetch: 0,
                flow_active: true,
                closed: false,
                queue_timeouts: false,
                reply: None,
            }),
        })
    }

    /// Whether the channel is closed (or closing: its consumers are being removed).
    pub fn is_closed(&self) -> bool {
        self.state.lock().closed
    }

    /// Whether a delivery could be made now, as far as the channel is concerned.
    pub fn has_credit(&self) -> bool {
        let st = self.state.lock();
        !st.closed
            && st.flow_active
            && (st.global_prefetch == 0 || (st.unacked.len() as u32) < st.global_prefetch)
            && !self.sink.unacked_full()
            && self.sink.has_room()
    }

    /// Whether the connection holds as many unacknowledged bytes as it may (see `UNACKED_BYTES_LIMIT`).
    pub fn unacked_full(&self) -> bool {
        self.sink.unacked_full()
    }

    /// Whether the connection may hold another unacknowledged message; if not, asks to be woken when
    /// it can (checking again after asking, so a release between the two cannot be missed).
    fn unacked_room_or_wake(&self) -> bool {
        if !self.sink.unacked_full() {
            return true;
        }
        self.sink.wake_when_room(self.me.clone());
        !self.sink.unacked_full()
    }

    /// Whether the connection can take more deliveries now (its outgoing buffer is not full).
    pub fn has_room(&self) -> bool {
        self.sink.has_room()
    }

    /// Whether the connection can take another delivery; if not, asks to be woken when it can (checking
    /// again after asking, so a wake-up between the two cannot be missed).
    fn room_or_wake(&self) -> bool {
        if self.sink.has_room() {
            return true;
        }
        self.sink.wake_when_room(self.me.clone());
        self.sink.has_room()
    }

    /// Called by a queue, under its lock, to hand a message to one of this channel's consumers.
    /// Gives the entry back if the channel cannot take it (closed, flow off, no credit). `Ok(Some)`:
    /// delivered to a no-ack consumer, so settled (the sink acks it in the store once written).
    pub fn try_deliver(&self, consumer: &Arc<Consumer>, entry: Entry) -> std::result::Result<Option<Entry>, Entry> {
        let mut st = self.state.lock();
        if st.closed || !st.flow_active {
            return Err(entry);
        }
        if !consumer.no_ack
            && ((st.global_prefetch != 0 && st.unacked.len() as u32 >= st.global_prefetch) || !self.unacked_room_or_wake())
        {
            return Err(entry);
        }
        if !self.room_or_wake() {
            return Err(entry);
        }
        let tag = st.next_tag;
        st.next_tag += 1;
        self.sink.send(Delivery::Deliver {
            channel: self.number,
            consumer_tag: consumer.tag.clone(),
            delivery_tag: tag,
            redelivered: entry.redelivered,
            returned: entry.returned,
            message: entry.message.clone(),
            ack_when_written: if consumer.no_ack { ack_when_written(&consumer.queue, &entry) } else { None },
        });
        use crate::stats::Counter;
        crate::stats::delivered(if consumer.no_ack { Counter::DeliveredConsumeAutoAck } else { Counter::DeliveredConsumeManualAck }, entry.redelivered);
        consumer.queue.stats.delivered(entry.redelivered);
        if consumer.no_ack {
            // Settled on delivery; the sink acks it in the store once written (`AckWhenWritten`).
            return Ok(Some(entry));
        }
        consumer.unacked.fetch_add(1, Ordering::Relaxed);
        st.queue_timeouts |= consumer.queue.args.consumer_timeout_ms.is_some();
        self.sink.hold_unacked(entry.message.memory_bytes());
        st.unacked.push_back(Unacked { tag, queue: consumer.queue.clone(), entry, consumer: Some(consumer.clone()), seen_ms: 0 });
        Ok(None)
    }

    /// basic.get-ok. Returns the entry when no_ack (settled; the sink acks it in the store once written).
    pub fn deliver_get(&self, queue: &Arc<Queue>, entry: Entry, no_ack: bool, message_count: u32) -> Option<Entry> {
        let mut st = self.state.lock();
        let tag = st.next_tag;
        st.next_tag += 1;
        self.sink.send(Delivery::GetOk {
            channel: self.number,
            delivery_tag: tag,
            redelivered: entry.redelivered,
            returned: entry.returned,
            message_count,
            message: entry.message.clone(),
            ack_when_written: if no_ack { ack_when_written(queue, &entry) } else { None },
        });
        use crate::stats::Counter;
        crate::stats::delivered(if no_ack { Counter::DeliveredGetAutoAck } else { Counter::DeliveredGetManualAck }, entry.redelivered);
        queue.stats.delivered(entry.redelivered);
        if no_ack {
            return Some(entry);
        }
        st.queue_timeouts |= queue.args.consumer_timeout_ms.is_some();
        self.sink.hold_unacked(entry.message.memory_bytes());
        st.unacked.push_back(Unacked { tag, queue: queue.clone(), entry, consumer: None, seen_ms: 0 });
        None
    }

    /// basic.qos.
    pub fn qos(&self, prefetch_count: u16, global: bool) {
        let mut st = self.state.lock();
        if global {
            st.global_prefetch = prefetch_count as u32;
        } else {
            st.consumer_prefetch = prefetch_count as u32;
        }
        drop(st);
        self.kick_consumers();
    }

    /// channel.flow from the client: pause or resume deliveries.
    pub fn flow(&self, active: bool) {
        self.state.lock().flow_active = active;
        if active {
            self.kick_consumers();
        }
    }

    pub fn consumer_prefetch(&self) -> u32 {
        self.state.lock().consumer_prefetch
    }

    pub fn has_consumer(&self, tag: &str) -> bool {
        let st = self.state.lock();
        st.consumers.contains_key(tag) || st.reply.as_ref().is_some_and(|r| &*r.tag == tag)
    }

    /// basic.consume from `amq.rabbitmq.reply-to`: registers this channel's reply consumer (one per
    /// channel, no-ack only, as RabbitMQ). The caller sends consume-ok.
    pub fn start_reply_consumer(self: &Arc<Self>, registry: &Arc<ReplyConsumers>, tag: Arc<str>, no_ack: bool) -> Result<()> {
        if !no_ack {
            return Err(BrokerError::precondition_failed("reply consumer cannot acknowledge"));
        }
        let mut st = self.state.lock();
        if st.reply.is_some() {
            return Err(BrokerError::precondition_failed("reply consumer already set"));
        }
        let token = registry.register(self.me.clone());
        st.reply = Some(ReplyConsumer { tag, token, registry: registry.clone() });
        Ok(())
    }

    /// What a `reply_to` of `amq.rabbitmq.reply-to` published on this channel becomes; None if the
    /// channel has no reply consumer.
    pub fn reply_address(&self) -> Option<String> {
        let st = self.state.lock();
        st.reply.as_ref().map(|r| format!("{}{}", crate::direct_reply::PREFIX, r.token))
    }

    /// Hands a direct reply to this channel's reply consumer (no ack: nothing is kept). False if there
    /// is none any more.
    pub fn deliver_reply(&self, message: MessageRef) -> bool {
        let mut st = self.state.lock();
        if st.closed || self.sink.overloaded() {
            return false;
        }
        let Some(consumer_tag) = st.reply.as_ref().map(|r| r.tag.clone()) else { return false };
        let delivery_tag = st.next_tag;
        st.next_tag += 1;
        self.sink.send(Delivery::Deliver { channel: self.number, consumer_tag, delivery_tag, redelivered: false, returned: 0, message, ack_when_written: None });
        true
    }

    fn stop_reply_consumer(st: &mut ChannelState) {
        if let Some(r) = st.reply.take() {
            r.registry.unregister(&r.token);
        }
    }

    /// Registers a consumer (already accepted by its queue).
    pub fn add_consumer(&self, consumer: Arc<Consumer>) {
        self.state.lock().consumers.insert(consumer.tag.clone(), consumer);
    }

    pub fn new_consumer(
        self: &Arc<Self>,
        tag: Arc<str>,
        queue: Arc<Queue>,
        no_ack: bool,
        exclusive: bool,
        args: ConsumerArgs,
    ) -> Arc<Consumer> {
        let prefetch = self.consumer_prefetch();
        Arc::new(Consumer {
            tag,
            channel: self.clone(),
            queue,
            no_ack,
            exclusive,
            prefetch,
            priority: args.priority,
            unacked: AtomicU32::new(0),
        })
    }

    /// basic.cancel from the client. Returns false when no such consumer exists.
    pub fn cancel(&self, tag: &str) -> bool {
        let consumer = {
            let mut st = self.state.lock();
            if st.reply.as_ref().is_some_and(|r| &*r.tag == tag) {
                Self::stop_reply_consumer(&mut st);
                return true;
            }
            st.consumers.remove(tag)
        };
        match consumer {
            Some(c) => {
                c.queue.remove_consumer(&c);
                true
            }
            None => false,
        }
    }

    /// The queue was deleted under this consumer: forget it and tell the client.
    pub fn consumer_cancelled_by_server(&self, tag: &Arc<str>) {
        // Under the channel lock, so that nothing is sent once `close` has run (the channel's close-ok
        // may already be on its way).
        let mut st = self.state.lock();
        if st.consumers.remove(tag).is_some() && !st.closed {
            self.sink.send(Delivery::Cancel { channel: self.number, consumer_tag: tag.clone() });
        }
    }

    /// basic.ack / basic.nack / basic.reject. `delivery_tag` 0 with `multiple` means everything.
    /// Returns the store ticket at which the settlement is durable (the ack records of acked and
    /// of dropped or dead-lettered messages), if anything was written: tx.commit-ok waits for it.
    pub fn settle(&self, delivery_tag: u64, multiple: bool, how: Settle) -> Result<Option<SyncTicket>> {
        self.settle_for(delivery_tag, multiple, how, None)
    }

    /// Whether `delivery_tag` is outstanding on this channel (unacked): a transaction checks its
    /// acks when they are made (`settle` at commit would fail them too late).
    pub fn is_unacked(&self, delivery_tag: u64) -> bool {
        self.state.lock().unacked.binary_search_by_key(&delivery_tag, |u| u.tag).is_ok()
    }

    /// [`Channel::settle`] for a transaction's commit: quorum queues tell `publisher`'s session once
    /// their group applied the settlement, which tx.commit-ok waits for (`crate::publisher`).
    pub fn settle_for(&self, delivery_tag: u64, multiple: bool, how: Settle, publisher: Option<Publisher>) -> Result<Option<SyncTicket>> {
        let taken = {
            let mut st = self.state.lock();
            take_unacked(&mut st.unacked, delivery_tag, multiple)?
        };
        Ok(self.finish_settle(taken, how, publisher))
    }

    /// Settles each of `tags` (those the channel holds; others are skipped) in one go: a consumer of
    /// another node acking through its relay channel (`queue::remote`).
    pub fn settle_tags(&self, tags: &[u64], how: Settle) -> Option<SyncTicket> {
        let taken: Vec<Unacked> = {
            let mut st = self.state.lock();
            tags.iter().filter_map(|t| take_unacked(&mut st.unacked, *t, false).ok()).flatten().collect()
        };
        self.finish_settle(taken, how, None)
    }

    /// basic.recover: every unacknowledged message goes back to its queue, redelivered.
    pub fn recover(&self) {
        let taken: Vec<Unacked> = self.state.lock().unacked.drain(..).collect();
        self.finish_settle(taken, Settle::Reject { requeue: true }, None);
    }

    /// Channel or connection closed: cancel consumers, requeue everything unacknowledged.
    pub fn close(&self) {
        let (taken, consumers) = {
            let mut st = self.state.lock();
            st.closed = true;
            Self::stop_reply_consumer(&mut st);
            let consumers: Vec<_> = st.consumers.drain().map(|(_, c)| c).collect();
            (st.unacked.drain(..).collect::<Vec<_>>(), consumers)
        };
        for c in &consumers {
            c.queue.remove_consumer(c);
        }
        self.finish_settle(taken, Settle::Reject { requeue: true }, None);
    }

    /// The delivery acknowledgement timeout (RabbitMQ's `consumer_timeout`): returns the timeout (ms)
    /// that a delivery of this channel has now stayed unacknowledged longer than, if any. The caller
    /// closes the channel (406), which requeues its unacked messages.
    ///
    /// Called periodically. Deliveries carry no timestamp (no clock read per message): a check stamps
    /// the ones it has not seen yet, so a delivery times out between `timeout` and `timeout` plus one
    /// check period after it was sent. `default_ms` is the node's `consumer-timeout`; a queue's
    /// `x-consumer-timeout` overrides it for its messages; 0 disables.
    pub fn ack_timed_out(&self, now_ms: u64, default_ms: u64) -> Option<u64> {
        let mut st = self.state.lock();
        for u in st.unacked.iter_mut().rev() {
            if u.seen_ms != 0 {
                break;
            }
            u.seen_ms = now_ms;
        }
        let timeout_of = |u: &Unacked| u.queue.args.consumer_timeout_ms.unwrap_or(default_ms);
        let expired = |u: &Unacked| {
            let t = timeout_of(u);
            t > 0 && u.seen_ms < now_ms && now_ms - u.seen_ms >= t
        };
        if st.queue_timeouts {
            st.unacked.iter().find(|u| expired(u)).map(timeout_of)
        } else {
            st.unacked.front().filter(|u| expired(u)).map(timeout_of)
        }
    }

    pub fn unacked_count(&self) -> usize {
        self.state.lock().unacked.len()
    }

    fn finish_settle(&self, taken: Vec<Unacked>, how: Settle, publisher: Option<Publisher>) -> Option<SyncTicket> {
        if taken.is_empty() {
            return None;
        }
        if matches!(how, Settle::Ack) {
            crate::stats::add(crate::stats::Counter::Acknowledged, taken.len() as u64);
        }
        let mut released = 0;
        for u in &taken {
            if matches!(how, Settle::Ack) {
                u.queue.stats.acked();
            }
            if let Some(c) = &u.consumer {
                c.unacked.fetch_sub(1, Ordering::Relaxed);
            }
            released += u.entry.message.memory_bytes();
        }
        // No lock is held here: the release may dispatch the connection's other channels.
        self.sink.release_unacked(released);
        // Group by queue, keeping tag order, so each queue is locked once.
        let mut by_queue: Vec<(Arc<Queue>, Vec<Entry>)> = Vec::new();
        for u in taken {
            match by_queue.iter_mut().find(|(q, _)| Arc::ptr_eq(q, &u.queue)) {
                Some((_, entries)) => entries.push(u.entry),
                None => by_queue.push((u.queue, vec![u.entry])),
            }
        }
        let mut batch = Batch::new();
        let mut ticket = None;
        for (queue, entries) in &mut by_queue {
            ticket = ticket.max(queue.settle(std::mem::take(entries), how, &mut batch, publisher));
        }
        if let Some((queue, _)) = by_queue.first() {
            ticket = ticket.max(queue.append_acks(&mut batch));
        }
        // Credit came back: let every queue this channel consumes from deliver again.
        self.kick_consumers();
        for (queue, _) in &by_queue {
            queue.dispatch();
        }
        ticket
    }

    /// Ask every queue this channel consumes from to deliver (credit or flow changed).
    /// Dispatches the queues this channel's consumers are on (credit or room came back).
    pub fn kick_consumers(&self) {
        let queues: Vec<Arc<Queue>> = {
            let st = self.state.lock();
            let mut qs: Vec<Arc<Queue>> = Vec::new();
            for c in st.consumers.values() {
                if !qs.iter().any(|q| Arc::ptr_eq(q, &c.queue)) {
                    qs.push(c.queue.clone());
                }
            }
            qs
        };
        for q in queues {
            q.dispatch();
        }
    }
}

/// Removes the entries a settlement names from the ordered unacked list.
fn take_unacked(unacked: &mut VecDeque<Unacked>, tag: u64, multiple: bool) -> Result<Vec<Unacked>> {
    if multiple {
        if tag == 0 {
            return Ok(unacked.drain(..).collect());
        }
        // As RabbitMQ: the named tag itself must be outstanding, even with `multiple`.
        return match unacked.binary_search_by_key(&tag, |u| u.tag) {
            Ok(i) => Ok(unacked.drain(..=i).collect()),
            Err(_) => Err(unknown_tag(tag)),
        };
    }
    match unacked.binary_search_by_key(&tag, |u| u.tag) {
        Ok(i) => Ok(unacked.remove(i).into_iter().collect()),
        Err(_) => Err(unknown_tag(tag)),
    }
}

fn unknown_tag(tag: u64) -> BrokerError {
    BrokerError::precondition_failed(format!("unknown delivery tag {tag}"))
}

/// What a no-ack delivery of `entry` from `queue` leaves the connection to ack in the store once
/// written (None: not stored).
fn ack_when_written(queue: &Queue, entry: &Entry) -> Option<AckWhenWritten> {
    (entry.stored_bytes > 0).then(|| AckWhenWritten { queue: queue.store_id_of(entry), seq: entry.seq, stored_bytes: entry.stored_bytes })
}

impl DeliverySink for Channel {
    fn connection_id(&self) -> u64 {
        self.connection_id
    }

    fn number(&self) -> u16 {
        self.number
    }

    fn weak_sink(&self) -> Weak<dyn DeliverySink> {
        self.me.clone()
    }

    fn is_closed(&self) -> bool {
        Channel::is_closed(self)
    }

    fn unacked_full(&self) -> bool {
        Channel::unacked_full(self)
    }

    fn has_room(&self) -> bool {
        Channel::has_room(self)
    }

    fn try_deliver(&self, consumer: &Arc<Consumer>, entry: Entry) -> std::result::Result<Option<Entry>, Entry> {
        Channel::try_deliver(self, consumer, entry)
    }

    fn deliver_get(&self, queue: &Arc<Queue>, entry: Entry, no_ack: bool, message_count: u32) -> Option<Entry> {
        Channel::deliver_get(self, queue, entry, no_ack, message_count)
    }

    fn consumer_cancelled_by_server(&self, tag: &Arc<str>) {
        Channel::consumer_cancelled_by_server(self, tag)
    }
}

impl Kick for Channel {
    fn kick_consumers(&self) {
        Channel::kick_consumers(self)
    }
}

impl ReplyTarget for Channel {
    fn deliver_reply(&self, message: MessageRef) -> bool {
        Channel::deliver_reply(self, message)
    }
}
