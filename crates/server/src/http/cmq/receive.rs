//! A CMQ receive is a delivery with a deadline. Each receive takes its messages on a channel of its
//! own (not a connection's: `API_CONNECTION`), as unacknowledged deliveries: a *lease*. Deleting a
//! message acks its delivery; when the lease's visibility timeout passes, its channel closes and
//! whatever was not deleted goes back to the queue, redelivered, for the next receive (CMQ's
//! `dequeueCount` + 1). Works on every kind of queue, on any node, as basic.get and basic.consume
//! do.
//!
//! A receive first takes what is ready (basic.get); finding nothing, it waits up to
//! `pollingWaitSeconds` as a consumer with a prefetch of what it still wants, so it answers as soon
//! as a message arrives, and cancels the consumer before it answers (what arrived by then is
//! answered too: the prefetch bounds it).
//!
//! Receipt handles are `LEASE-TAG-MAC`: the MAC (HMAC-SHA256 with a key random per start, over the
//! vhost, queue, lease and tag) makes them unforgeable, and the lease and tag name one delivery; a
//! handle whose lease ended (deleted, or timed out and redelivered) or from before a restart fails.

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;
use warren_broker::channel::Delivery;
use warren_broker::{Channel, ClientSink, ConsumerArgs, MessageRef, Queue, Settle};
use warren_store::SyncTicket;

use super::{code, CmqError};
use crate::http::mgmt::queues::API_CONNECTION;
use crate::http::{get_ready, HttpContext};

/// Received messages not yet deleted or timed out, on this node, at most: a client that receives
/// and never deletes cannot make the node hold every queue's messages twice.
const MAX_LEASED: usize = 100_000;
const CONSUMER_TAG: &str = "cmq-receive";

/// What a lease's channel was handed.
#[derive(Default)]
struct Taken {
    items: Mutex<Vec<Received>>,
    arrived: Notify,
}

impl ClientSink for Taken {
    fn send(&self, delivery: Delivery) {
        match delivery {
            Delivery::Deliver { delivery_tag, redelivered, returned, message, .. } | Delivery::GetOk { delivery_tag, redelivered, returned, message, .. } => {
                self.items.lock().push(Received { tag: delivery_tag, redelivered, returned, message, handle: String::new() });
                self.arrived.notify_one();
            }
            Delivery::Cancel { .. } => self.arrived.notify_one(),
        }
    }
}

/// A received message.
pub struct Received {
    tag: u64,
    pub redelivered: bool,
    /// Times its queue got it back unacknowledged (`Entry::returned`).
    pub returned: u32,
    pub message: MessageRef,
    pub handle: String,
}

/// Messages received together, invisible until `deadline` unless deleted first.
struct Lease {
    channel: Arc<Channel>,
    /// Woken when every message was deleted: the lease ends before its deadline.
    all_deleted: Notify,
    count: usize,
}

pub struct Leases {
    key: [u8; 32],
    next: AtomicU64,
    live: Mutex<HashMap<u64, Arc<Lease>>>,
    leased: AtomicUsize,
}

impl Default for Leases {
    fn default() -> Leases {
        Leases { key: rand::random(), next: AtomicU64::new(1), live: Mutex::new(HashMap::new()), leased: AtomicUsize::new(0) }
    }
}

impl Leases {
    fn mac(&self, vhost: &str, queue: &str, lease: u64, tag: u64) -> String {
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        for part in [vhost.as_bytes(), b"\0", queue.as_bytes(), b"\0", &lease.to_be_bytes(), &tag.to_be_bytes()] {
            mac.update(part);
        }
        let mut hex = String::with_capacity(20);
        for b in &mac.finalize().into_bytes()[..10] {
            let _ = write!(hex, "{b:02x}");
        }
        hex
    }

    /// Takes up to `n` messages off `queue`, waiting up to `wait` for the first; they stay
    /// invisible for `visibility`. An empty answer when nothing came.
    ///
    /// Runs on a task of its own, to the end, whatever its caller does: a request's future is
    /// dropped when its client hangs up, and dropped halfway this would leave its consumer on the
    /// queue or its messages unacknowledged on a channel nobody closes. A client gone while the
    /// receive waits stops the wait, and what arrived meanwhile goes back to the queue.
    pub async fn receive(ctx: &Arc<HttpContext>, vhost: &str, queue: &Arc<Queue>, n: usize, wait: Duration, visibility: Duration) -> Result<Vec<Received>, CmqError> {
        let (ctx, vhost, queue) = (ctx.clone(), vhost.to_owned(), queue.clone());
        // Dropped with this future (the client hung up): `gone` then resolves.
        let (_caller, gone) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move { ctx.cmq.leases.receive_here(&ctx, &vhost, &queue, n, wait, visibility, gone).await })
            .await
            .map_err(|e| CmqError::new(code::INTERNAL, format!("the receive failed: {e}")))?
    }

    #[allow(clippy::too_many_arguments)]
    async fn receive_here(
        &self,
        ctx: &Arc<HttpContext>,
        vhost: &str,
        queue: &Arc<Queue>,
        n: usize,
        wait: Duration,
        visibility: Duration,
        mut gone: tokio::sync::oneshot::Receiver<()>,
    ) -> Result<Vec<Received>, CmqError> {
        if self.leased.load(Ordering::Relaxed) >= MAX_LEASED {
            return Err(CmqError::new(
                code::INTERNAL,
                format!("{MAX_LEASED} received messages on this node are neither deleted nor timed out: delete what you received, or wait for visibility timeouts"),
            ));
        }
        let taken = Arc::new(Taken::default());
        let channel = Channel::new(1, API_CONNECTION, taken.clone());
        let poll_deadline = Instant::now() + wait;
        let outcome = self.take(queue, &channel, &taken, n, poll_deadline, &mut gone).await;
        let mut received = std::mem::take(&mut *taken.items.lock());
        if received.is_empty() || matches!(gone.try_recv(), Err(tokio::sync::oneshot::error::TryRecvError::Closed)) {
            // Nothing, or nobody to answer: what was taken goes back.
            channel.close();
            return outcome.map(|_| Vec::new());
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        for r in &mut received {
            r.handle = format!("{id}-{}-{}", r.tag, self.mac(vhost, &queue.name, id, r.tag));
        }
        let lease = Arc::new(Lease { channel, all_deleted: Notify::new(), count: received.len() });
        self.leased.fetch_add(lease.count, Ordering::Relaxed);
        self.live.lock().insert(id, lease.clone());
        let deadline = Instant::now() + visibility;
        let ctx = ctx.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {}
                _ = lease.all_deleted.notified() => {}
            }
            let leases = &ctx.cmq.leases;
            leases.live.lock().remove(&id);
            // What was not deleted goes back to its queue, redelivered.
            lease.channel.close();
            leases.leased.fetch_sub(lease.count, Ordering::Relaxed);
        });
        Ok(received)
    }

    async fn take(
        &self,
        queue: &Arc<Queue>,
        channel: &Arc<Channel>,
        taken: &Taken,
        n: usize,
        poll_deadline: Instant,
        gone: &mut tokio::sync::oneshot::Receiver<()>,
    ) -> Result<(), CmqError> {
        // What is ready now.
        get_ready(queue, channel, || taken.items.lock().len() < n).await.map_err(|text| CmqError::new(code::INTERNAL, text))?;
        if !taken.items.lock().is_empty() || Instant::now() >= poll_deadline {
            return Ok(());
        }
        // Long polling: a consumer that may hold what is still wanted, until something arrives.
        channel.qos(n.min(u16::MAX as usize) as u16, false);
        let consumer = channel.new_consumer(CONSUMER_TAG.into(), queue.clone(), false, false, ConsumerArgs::default());
        queue.add_consumer(consumer.clone(), || {})?;
        channel.add_consumer(consumer);
        loop {
            let arrived = taken.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if !taken.items.lock().is_empty() || !channel.has_consumer(CONSUMER_TAG) {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(poll_deadline) => break,
                _ = &mut *gone => break,
                _ = arrived => {}
            }
        }
        channel.cancel(CONSUMER_TAG);
        Ok(())
    }

    /// Deletes the message `handle` names (acks its delivery). Returns the store ticket of the ack,
    /// if any.
    pub fn delete(&self, vhost: &str, queue: &str, handle: &str) -> Result<Option<SyncTicket>, CmqError> {
        let invalid = || CmqError::new(code::INVALID_RECEIPT_HANDLE, format!("receipt handle '{handle}' is not one of queue '{queue}'"));
        let mut parts = handle.splitn(3, '-');
        let (Some(lease), Some(tag), Some(mac)) = (parts.next(), parts.next(), parts.next()) else { return Err(invalid()) };
        let (Ok(lease), Ok(tag)) = (lease.parse::<u64>(), tag.parse::<u64>()) else { return Err(invalid()) };
        if !super::sign::same(&self.mac(vhost, queue, lease, tag), mac) {
            return Err(invalid());
        }
        let expired = || {
            CmqError::new(
                code::INVALID_RECEIPT_HANDLE,
                format!("receipt handle '{handle}' has expired: the message was deleted already, or its visibility timeout passed and it is visible again (receive it again for a new handle)"),
            )
        };
        let Some(lease) = self.live.lock().get(&lease).cloned() else { return Err(expired()) };
        let ticket = lease.channel.settle(tag, false, Settle::Ack).map_err(|_| expired())?;
        if lease.channel.unacked_count() == 0 {
            lease.all_deleted.notify_one();
        }
        Ok(ticket)
    }
}
