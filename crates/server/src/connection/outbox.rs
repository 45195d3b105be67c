//! Everything a connection sends goes through its outbox: method replies from the reader,
//! deliveries from queues, confirms. One writer task drains it, so frames for a channel leave
//! in the order they were pushed, and each batch goes to the socket in one write.
//!
//! The outbox is bounded in bytes, in two ways:
//! - deliveries: queues push them only while less than `DELIVERY_BYTES_LIMIT` waits to be taken
//!   (`ClientSink::has_room`); otherwise they keep the messages and are woken when the writer takes;
//! - everything else the reader causes (replies, basic.return, confirms): every item is counted in
//!   `outgoing_bytes` from its push until the writer has written it to the socket (or dropped it),
//!   and while that is at `OUTGOING_BYTES_LIMIT` or more the reader stops reading the socket
//!   ([`Outbox::until_uncongested`]): TCP back-pressure then stops the client, as in RabbitMQ. A
//!   client that publishes mandatory unroutable messages and never reads costs at most this much.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Weak;

use parking_lot::Mutex;
use tokio::sync::Notify;
use warren_broker::channel::UNACKED_BYTES_LIMIT;
use warren_broker::channel::Kick;
use warren_broker::{ClientSink, Delivery, MessageRef};
use warren_protocol::method::Method;
use warren_store::{Batch, Store, SyncTicket};

#[derive(Debug)]
pub enum Outgoing {
    Method { channel: u16, method: Method },
    Delivery(Delivery),
    Return { channel: u16, reply_code: u16, reply_text: &'static str, message: MessageRef },
    /// Sent once the store has made `ticket` durable and the connection's publisher session has
    /// every operation up to `seq` resolved by the quorum queues it went to (0: none), in the order
    /// pushed per channel: publisher confirms, and tx.commit-ok. An ack whose `seq` a quorum queue
    /// refused becomes a basic.nack.
    WhenDurable { channel: u16, ticket: Option<SyncTicket>, seq: u64, action: DurableAction },
    /// The channel's last frame (the channel.close-ok we answer with, or the channel.close we send):
    /// confirms of the channel that are durable by then go out before it, the rest are dropped, and
    /// nothing queued before it for the channel can follow it. A channel opened again on the same
    /// number starts with nothing pending.
    ChannelEnd { channel: u16, method: Method },
    /// Flush what is queued, then close the socket.
    Close,
}

#[derive(Debug)]
pub enum DurableAction {
    Ack { delivery_tag: u64 },
    Nack { delivery_tag: u64 },
    /// tx.commit-ok, unless an operation of the transaction (session seqs `first_seq..=seq`) was
    /// refused by a queue, or `refused_now` publishes were refused as they were routed: then the
    /// reader fails the commit (`Outbox::fail_commit`).
    TxCommit { first_seq: u64, refused_now: usize },
}

/// What a method frame is counted as (most are far smaller; names are at most 255 bytes).
const METHOD_COST: usize = 512;
/// What a pending confirm is counted as until it is written or dropped.
pub const CONFIRM_COST: usize = 32;

impl Outgoing {
    /// About how many bytes the item takes until it is written: what `outgoing_bytes` counts.
    pub fn cost(&self) -> usize {
        match self {
            Outgoing::Method { .. } | Outgoing::ChannelEnd { .. } => METHOD_COST,
            Outgoing::Delivery(d) => d.approx_bytes(),
            Outgoing::Return { message, .. } => message.memory_bytes(),
            Outgoing::WhenDurable { .. } => CONFIRM_COST,
            Outgoing::Close => 0,
        }
    }
}

/// Deliveries a connection buffers for its socket before its queues hold back: about a thousand 1 KB
/// messages, enough to fill each write; a slow no-ack consumer costs no more than this.
const DELIVERY_BYTES_LIMIT: usize = 1 << 20;

/// Bytes waiting for the socket (or for the disk, for confirms) above which the reader stops reading.
pub const OUTGOING_BYTES_LIMIT: usize = 4 << 20;

/// Bytes waiting for the socket above which direct replies to this connection (pushed by other
/// connections, so not held back by this one's reader) are dropped, as replies to a client that is gone.
const REPLY_DROP_BYTES: usize = 4 * OUTGOING_BYTES_LIMIT;

pub struct Outbox {
    items: Mutex<Vec<Outgoing>>,
    notify: Notify,
    /// Bytes of deliveries pushed and not yet taken by the writer.
    delivery_bytes: AtomicUsize,
    /// Bytes of everything pushed and not yet written to the socket or dropped (see the module docs).
    outgoing_bytes: AtomicUsize,
    /// Channels that found the outbox full; their consumers are dispatched again when the writer takes.
    waiting: Mutex<Vec<Weak<dyn Kick>>>,
    /// Memory of the messages the connection's channels hold delivered and unacknowledged.
    unacked_bytes: AtomicUsize,
    /// Wakes the reader: outgoing bytes fell below the limit, or the writer stopped.
    reader_wake: Notify,
    /// The writer task ended (socket error, write timeout, close): nothing more can be sent.
    writer_stopped: AtomicBool,
    /// Where the store acks of written no-ack deliveries go (`Delivery::ack_when_written`).
    store: Store,
    /// Channels whose tx.commit the writer found failed, with why: the reader closes them.
    failed_commits: Mutex<Vec<(u16, String)>>,
    /// Wakes the reader: a commit failed.
    commit_failed: Notify,
}

impl Outbox {
    pub fn new(store: Store) -> Outbox {
        Outbox {
            items: Mutex::new(Vec::new()),
            notify: Notify::new(),
            delivery_bytes: AtomicUsize::new(0),
            outgoing_bytes: AtomicUsize::new(0),
            unacked_bytes: AtomicUsize::new(0),
            waiting: Mutex::new(Vec::new()),
            reader_wake: Notify::new(),
            writer_stopped: AtomicBool::new(false),
            store,
            failed_commits: Mutex::new(Vec::new()),
            commit_failed: Notify::new(),
        }
    }

    /// The writer found that `channel`'s tx.commit cannot be answered commit-ok (`text` says why):
    /// the reader, which owns the channel's state, closes it with a channel error.
    pub fn fail_commit(&self, channel: u16, text: String) {
        self.failed_commits.lock().push((channel, text));
        self.commit_failed.notify_one();
    }

    /// Returns once a commit failed (see `fail_commit`).
    pub async fn until_commit_failed(&self) {
        self.commit_failed.notified().await;
    }

    /// The failed commits not handled yet.
    pub fn take_failed_commits(&self) -> Vec<(u16, String)> {
        std::mem::take(&mut *self.failed_commits.lock())
    }

    /// Appends the store acks of no-ack deliveries that were written to the socket (or that never will
    /// be: the connection is gone), and clears `acks`.
    pub fn ack_written(&self, acks: &mut Batch) {
        if acks.is_empty() {
            return;
        }
        match self.store.append(acks) {
            // Shutting down: those messages come back after the restart, as after a crash.
            Ok(_) | Err(warren_store::StoreError::Closed) => {}
            Err(e) => tracing::warn!(error = %e, "could not record consumed no-ack deliveries in the store"),
        }
        acks.clear();
    }
    pub fn push(&self, item: Outgoing) {
        self.outgoing_bytes.fetch_add(item.cost(), Ordering::Relaxed);
        self.items.lock().push(item);
        self.notify.notify_one();
    }

    pub fn method(&self, channel: u16, method: Method) {
        self.push(Outgoing::Method { channel, method });
    }

    /// Takes everything queued (swapping in `spare`, to reuse its allocation), then lets the channels
    /// that were held back deliver again.
    pub fn take(&self, spare: &mut Vec<Outgoing>) {
        std::mem::swap(&mut *self.items.lock(), spare);
        self.delivery_bytes.store(0, Ordering::SeqCst);
        self.kick_waiting();
    }

    /// Dispatches again the channels that found no room (outbox or unacknowledged bytes).
    fn kick_waiting(&self) {
        let waiting = std::mem::take(&mut *self.waiting.lock());
        for channel in waiting.iter().filter_map(Weak::upgrade) {
            channel.kick_consumers();
        }
    }

    pub async fn wait(&self) {
        self.notify.notified().await;
    }

    /// Frees the queue's allocation if it is empty (an idle connection).
    pub fn release_memory(&self) {
        let mut items = self.items.lock();
        if items.is_empty() {
            *items = Vec::new();
        }
    }

    /// The writer wrote (or dropped) items that were counted as `bytes`.
    pub fn written(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let before = self.outgoing_bytes.fetch_sub(bytes, Ordering::AcqRel);
        if before >= OUTGOING_BYTES_LIMIT && before - bytes < OUTGOING_BYTES_LIMIT {
            self.reader_wake.notify_one();
        }
    }

    /// Whether so much waits for the socket that the reader must stop reading.
    pub fn congested(&self) -> bool {
        self.outgoing_bytes.load(Ordering::Acquire) >= OUTGOING_BYTES_LIMIT
    }

    /// Returns once the outbox is no longer congested, or the writer stopped.
    pub async fn until_uncongested(&self) {
        while self.congested() && !self.writer_stopped() {
            self.reader_wake.notified().await;
        }
    }

    /// Called by the writer task as it ends.
    pub fn writer_ended(&self) {
        self.writer_stopped.store(true, Ordering::Release);
        self.reader_wake.notify_one();
    }

    pub fn writer_stopped(&self) -> bool {
        self.writer_stopped.load(Ordering::Acquire)
    }

    /// Returns once the writer task has ended.
    pub async fn until_writer_stopped(&self) {
        while !self.writer_stopped() {
            self.reader_wake.notified().await;
        }
    }
}

impl ClientSink for Outbox {
    fn send(&self, delivery: Delivery) {
        self.delivery_bytes.fetch_add(delivery.approx_bytes(), Ordering::SeqCst);
        self.push(Outgoing::Delivery(delivery));
    }

    fn has_room(&self) -> bool {
        self.delivery_bytes.load(Ordering::SeqCst) < DELIVERY_BYTES_LIMIT
    }

    fn overloaded(&self) -> bool {
        self.outgoing_bytes.load(Ordering::Acquire) >= REPLY_DROP_BYTES
    }

    fn hold_unacked(&self, bytes: usize) {
        self.unacked_bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    fn release_unacked(&self, bytes: usize) {
        let before = self.unacked_bytes.fetch_sub(bytes, Ordering::AcqRel);
        if before >= UNACKED_BYTES_LIMIT && before - bytes < UNACKED_BYTES_LIMIT {
            self.kick_waiting();
        }
    }

    fn unacked_full(&self) -> bool {
        self.unacked_bytes.load(Ordering::Acquire) >= UNACKED_BYTES_LIMIT
    }

    fn confirms_changed(&self) {
        self.notify.notify_one();
    }

    fn wake_when_room(&self, channel: Weak<dyn Kick>) {
        let mut waiting = self.waiting.lock();
        if !waiting.iter().any(|w| w.ptr_eq(&channel)) {
            waiting.push(channel);
        }
    }
}

impl Drop for Outbox {
    /// No-ack deliveries never written (the connection went first) are consumed all the same: their store
    /// acks are appended here, so their messages do not linger in the store.
    fn drop(&mut self) {
        let mut acks = Batch::new();
        for item in self.items.get_mut().iter() {
            if let Outgoing::Delivery(d) = item {
                if let Some(ack) = d.ack_when_written() {
                    ack.add_to(&mut acks);
                }
            }
        }
        self.ack_written(&mut acks);
    }
}
