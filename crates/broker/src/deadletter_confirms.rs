//! Confirms for at-least-once dead letters (a quorum queue's `x-dead-letter-strategy:
//! at-least-once`): a vhost re-publishes them as a confirming publisher would, and tells each
//! letter's source ([`SettleDeadLetter`]) once every queue it reached holds it durably, so the
//! source keeps the message until then.
//!
//! One publisher session per vhost (`crate::publisher`): quorum queues and classic queues homed on
//! other nodes resolve its operations as they do a connection's; a local classic queue's store
//! ticket is waited for here. A background task settles the letters in publish order as their
//! operations resolve (woken by the session, and every few milliseconds for store tickets).

use crate::sink::{ClientSink, Delivery};
use crate::deadletter::SettleDeadLetter;
use crate::publisher::PublisherSession;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::Notify;
use warren_store::{Store, SyncTicket};

/// How often pending letters are looked at without a wake-up (store tickets becoming durable).
const POLL: Duration = Duration::from_millis(20);

pub struct DeadLetterConfirms {
    session: Arc<PublisherSession>,
    store: Store,
    pending: Mutex<VecDeque<Pending>>,
    wake: Notify,
    task_started: AtomicBool,
}

/// A re-published letter waiting for its confirm: the session's operation `seq`, the store ticket
/// of the local classic queues it reached.
struct Pending {
    seq: u64,
    ticket: Option<SyncTicket>,
    /// A queue refused it when it was published (it is tried again).
    refused: bool,
    settle: SettleDeadLetter,
}

impl ClientSink for DeadLetterConfirms {
    fn send(&self, _delivery: Delivery) {}

    fn confirms_changed(&self) {
        self.wake.notify_one();
    }
}

impl DeadLetterConfirms {
    pub fn new(store: Store) -> Arc<DeadLetterConfirms> {
        Arc::new_cyclic(|me: &Weak<DeadLetterConfirms>| {
            let sink: Weak<dyn ClientSink> = me.clone();
            DeadLetterConfirms {
                session: Arc::new(PublisherSession::new(sink)),
                store,
                pending: Mutex::new(VecDeque::new()),
                wake: Notify::new(),
                task_started: AtomicBool::new(false),
            }
        })
    }

    /// The publisher for the next letter's publish (a new operation of the session).
    pub fn publisher(&self) -> (Arc<PublisherSession>, u64) {
        (self.session.clone(), self.session.next_seq())
    }

    /// The letter published as operation `seq` (`ticket`: the store's, for local classic queues;
    /// `refused`: a queue refused it at once) is settled once both are done.
    pub fn track(self: &Arc<Self>, seq: u64, ticket: Option<SyncTicket>, refused: bool, settle: SettleDeadLetter) {
        self.pending.lock().push_back(Pending { seq, ticket, refused, settle });
        self.wake.notify_one();
        if !self.task_started.swap(true, Ordering::AcqRel) {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(run(Arc::downgrade(self)));
                }
                Err(_) => self.task_started.store(false, Ordering::Release),
            }
        }
    }

    /// Settles the letters at the front whose operation and store ticket are done. Returns how
    /// many are left.
    fn settle_ready(&self) -> usize {
        loop {
            let done = {
                let mut pending = self.pending.lock();
                match pending.front() {
                    Some(p) if self.session.is_resolved(p.seq) && p.ticket.is_none_or(|t| self.store.is_durable(t)) => pending.pop_front(),
                    _ => return pending.len(),
                }
            };
            if let Some(p) = done {
                // A queue that refused it (reject-publish, no majority in time, its home down): again later.
                let refused = self.session.take_refused(p.seq) | p.refused;
                (p.settle)(!refused);
            }
        }
    }
}

/// Settles letters as they are confirmed, while the vhost lives.
async fn run(confirms: Weak<DeadLetterConfirms>) {
    loop {
        let Some(c) = confirms.upgrade() else { return };
        let left = c.settle_ready();
        let wake = c.wake.notified();
        if left == 0 {
            // Nothing pending: sleep until a letter is tracked (or a while, to notice the vhost gone).
            let _ = tokio::time::timeout(Duration::from_secs(5), wake).await;
        } else {
            let _ = tokio::time::timeout(POLL, wake).await;
        }
    }
}
