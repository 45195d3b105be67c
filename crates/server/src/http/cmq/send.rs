//! A CMQ send is a confirmed publish: it answers once the message is durable in every queue it
//! reached, as a publisher confirm would go out (fsynced in a classic queue's store, committed by a
//! majority and applied in a quorum queue's group). The API has one publisher session
//! (`warren_broker::publisher`) for its sends: quorum queues tell it what they applied or refused.

use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use warren_broker::channel::Delivery;
use warren_broker::error::BrokerError;
use warren_broker::{ClientSink, Message, Publisher, PublisherSession, VHost};
use warren_store::{Store, SyncTicket};

use super::{code, CmqError};

/// How long a send waits for its messages to be durable before it answers an error.
const DURABLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Wakes the sends waiting for quorum queues (the session's "sink").
#[derive(Default)]
struct Wake(Notify);

impl ClientSink for Wake {
    fn send(&self, _: Delivery) {}

    fn confirms_changed(&self) {
        self.0.notify_waiters();
    }
}

pub struct Confirms {
    session: Arc<PublisherSession>,
    wake: Arc<Wake>,
    /// A session's operations must reach each queue in pub-seq order (`PublisherSession::sent`):
    /// taking a seq and publishing with it happen under this.
    order: Mutex<()>,
}

impl Default for Confirms {
    fn default() -> Confirms {
        let wake = Arc::new(Wake::default());
        let sink: Weak<dyn ClientSink> = Arc::downgrade(&(wake.clone() as Arc<dyn ClientSink>));
        Confirms { session: Arc::new(PublisherSession::new(sink)), wake, order: Mutex::new(()) }
    }
}

/// What a publish of some messages awaits before it is confirmed.
pub struct Sent {
    /// Per message: whether some queue took it.
    pub routed: Vec<bool>,
    /// Some queue refused one (x-overflow reject-publish: CMQ's full queue).
    pub rejected: bool,
    seqs: Option<(u64, u64)>,
    ticket: Option<SyncTicket>,
}

impl Confirms {
    /// Publishes `messages` through `exchange`, confirmed; with `delay_ms` > 0 they are held that
    /// long before their queues get them.
    pub fn publish(&self, vhost: &VHost, exchange: &str, messages: Vec<Message>, delay_ms: u64) -> Result<Sent, BrokerError> {
        let mut sent = Sent { routed: Vec::with_capacity(messages.len()), rejected: false, seqs: None, ticket: None };
        let _order = self.order.lock();
        for message in messages {
            let seq = self.session.next_seq();
            sent.seqs = Some((sent.seqs.map_or(seq, |(first, _)| first), seq));
            let publisher = Some(Publisher { session: &self.session, seq });
            let outcome = if delay_ms > 0 {
                vhost.publish_delayed(exchange, message, delay_ms, publisher)?
            } else {
                vhost.publish_by(exchange, message, true, publisher)?
            };
            sent.routed.push(outcome.routed);
            sent.rejected |= outcome.rejected;
            if let Some(t) = outcome.ticket {
                sent.ticket = Some(sent.ticket.map_or(t, |o: SyncTicket| o.max(t)));
            }
        }
        Ok(sent)
    }

    /// Returns once what `sent` published is durable everywhere it went; an error if a queue refused
    /// it or it did not become durable in time.
    pub async fn durable(&self, store: &Store, sent: &Sent) -> Result<(), CmqError> {
        let deadline = tokio::time::Instant::now() + DURABLE_TIMEOUT;
        let late = || CmqError::new(code::INTERNAL, format!("the message is not durable after {} s (the store or the queue's group is behind); it may still be delivered", DURABLE_TIMEOUT.as_secs()));
        if let Some(ticket) = sent.ticket {
            if !crate::http::durable_within(store, ticket, DURABLE_TIMEOUT).await {
                return Err(late());
            }
        }
        if let Some((first, last)) = sent.seqs {
            loop {
                let changed = self.wake.0.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if self.session.is_resolved(last) {
                    break;
                }
                if tokio::time::timeout_at(deadline, changed).await.is_err() {
                    return Err(late());
                }
            }
            if self.session.take_refused_in(first, last) > 0 {
                return Err(full());
            }
        }
        if sent.rejected {
            return Err(full());
        }
        Ok(())
    }
}

fn full() -> CmqError {
    CmqError::new(code::QUEUE_FULL, "the queue is full (maxMsgHeapNum, x-max-length with reject-publish): the message was refused")
}
