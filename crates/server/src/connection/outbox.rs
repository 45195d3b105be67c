//! Everything a connection sends goes through its outbox: method replies from the reader,
//! deliveries from queues, confirms. One writer task drains it, so frames for a channel leave
//! in the order they were pushed, and each batch goes to the socket in one write.

use parking_lot::Mutex;
use tokio::sync::Notify;
use warren_broker::{ClientSink, Delivery, MessageRef};
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
    /// Flush what is queued, then close the socket.
    Close,
}

#[derive(Debug)]
pub enum DurableAction {
    Ack { delivery_tag: u64 },
    Nack { delivery_tag: u64 },
    Method(Method),
}

#[derive(Default)]
pub struct Outbox {
    items: Mutex<Vec<Outgoing>>,
    notify: Notify,
}

impl Outbox {
    pub fn push(&self, item: Outgoing) {
        self.items.lock().push(item);
        self.notify.notify_one();
    }

    pub fn method(&self, channel: u16, method: Method) {
        self.push(Outgoing::Method { channel, method });
    }

    /// Takes everything queued (swapping in `spare`, to reuse its allocation).
    pub fn take(&self, spare: &mut Vec<Outgoing>) {
        std::mem::swap(&mut *self.items.lock(), spare);
    }

    pub async fn wait(&self) {
        self.notify.notified().await;
    }
}

impl ClientSink for Outbox {
    fn send(&self, delivery: Delivery) {
        self.push(Outgoing::Delivery(delivery));
    }
}
