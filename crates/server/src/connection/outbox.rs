//! Everything a connection sends goes through its outbox: method replies from the reader,
//! deliveries from queues, confirms. One writer task drains it, so frames for a channel leave
//! in the order they were pushed, and each batch goes to the socket in one write.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Weak;

use parking_lot::Mutex;
use tokio::sync::Notify;
use warren_broker::{Channel, ClientSink, Delivery, MessageRef};
use warren_protocol::method::Method;
use warren_store::SyncTicket;

#[derive(Debug)]
pub enum Outgoing {
    Method { channel: u16, method: Method },
    Delivery(Delivery),
    Return { channel: u16, reply_code: u16, reply_text: &'static str, message: MessageRef },
    /// Sent once the store has made `ticket` durable, in the order pushed per channel:
    /// publisher confirms, and tx.commit-ok.
    WhenDurable { channel: u16, ticket: Option<SyncTicket>, action: DurableAction },
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
    Method(Method),
}

/// Deliveries a connection buffers for its socket before its queues hold back: about a thousand 1 KB
/// messages, enough to fill each write; a slow no-ack consumer costs no more than this.
const DELIVERY_BYTES_LIMIT: usize = 1 << 20;

#[derive(Default)]
pub struct Outbox {
    items: Mutex<Vec<Outgoing>>,
    notify: Notify,
    /// Bytes of deliveries pushed and not yet taken by the writer.
    delivery_bytes: AtomicUsize,
    /// Channels that found the outbox full; their consumers are dispatched again when the writer takes.
    waiting: Mutex<Vec<Weak<Channel>>>,
}

impl Outbox {
    pub fn push(&self, item: Outgoing) {
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
        let waiting = std::mem::take(&mut *self.waiting.lock());
        for channel in waiting.iter().filter_map(Weak::upgrade) {
            channel.kick_consumers();
        }
    }

    pub async fn wait(&self) {
        self.notify.notified().await;
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

    fn wake_when_room(&self, channel: Weak<Channel>) {
        let mut waiting = self.waiting.lock();
        if !waiting.iter().any(|w| w.ptr_eq(&channel)) {
            waiting.push(channel);
        }
    }
}
