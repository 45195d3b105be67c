//! Completions waiting for the store's durable watermark: one task per node watches
//! `Store::durable()` and fires every append's `IOFlushed` whose ticket it has passed, whatever the
//! number of groups (not a task per append).

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use openraft::storage::IOFlushed;
use parking_lot::Mutex;
use tokio::sync::watch;
use warren_store::SyncTicket;

use crate::types::TypeConfig;

/// Appends waiting to be durable, by ticket.
pub(crate) struct Flusher {
    waiting: Mutex<BinaryHeap<Waiting>>,
    /// Breaks ties between equal tickets (the heap needs a total order).
    counter: AtomicU64,
    started: AtomicBool,
    durable: watch::Receiver<u64>,
}

struct Waiting {
    ticket: SyncTicket,
    n: u64,
    done: IOFlushed<TypeConfig>,
}

impl PartialEq for Waiting {
    fn eq(&self, other: &Self) -> bool {
        (self.ticket, self.n) == (other.ticket, other.n)
    }
}
impl Eq for Waiting {}
impl PartialOrd for Waiting {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiting {
    /// Reversed: the heap's top is the lowest ticket.
    fn cmp(&self, other: &Self) -> CmpOrdering {
        (other.ticket, other.n).cmp(&(self.ticket, self.n))
    }
}

impl Flusher {
    pub fn new(durable: watch::Receiver<u64>) -> Arc<Flusher> {
        Arc::new(Flusher { waiting: Mutex::new(BinaryHeap::new()), counter: AtomicU64::new(0), started: AtomicBool::new(false), durable })
    }

    /// The durable watermark now.
    pub fn durable_now(&self) -> u64 {
        *self.durable.borrow()
    }

    /// Calls `done` once `ticket` is durable: now if it already is, else from the watching task.
    /// Must be called on a tokio runtime (the task is started on the first call that waits).
    pub fn when_durable(self: &Arc<Self>, ticket: SyncTicket, done: IOFlushed<TypeConfig>) {
        if self.durable_now() >= ticket {
            done.io_completed(Ok(()));
            return;
        }
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        self.waiting.lock().push(Waiting { ticket, n, done });
        self.start();
        // The task may have seen the watermark pass `ticket` just before the push: it would not look
        // again until the next change, which an idle node may never make.
        self.complete_up_to(self.durable_now());
    }

    fn start(self: &Arc<Self>) {
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = Arc::downgrade(self);
        let mut rx = self.durable.clone();
        // If the runtime the task runs on shuts down, the next wait starts it again (on its own).
        let restart = Restart(Arc::downgrade(self));
        tokio::spawn(async move {
            let _restart = restart;
            loop {
                let durable = *rx.borrow_and_update();
                match me.upgrade() {
                    Some(f) => f.complete_up_to(durable),
                    None => return,
                }
                // The store is gone (every handle dropped): nothing more becomes durable.
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
    }

    fn complete_up_to(&self, durable: u64) {
        let mut done = Vec::new();
        {
            let mut waiting = self.waiting.lock();
            while waiting.peek().is_some_and(|w| w.ticket <= durable) {
                if let Some(w) = waiting.pop() {
                    done.push(w.done);
                }
            }
        }
        for d in done {
            d.io_completed(Ok(()));
        }
    }
}

/// Lets the next wait start the watching task again once this one is gone.
struct Restart(std::sync::Weak<Flusher>);

impl Drop for Restart {
    fn drop(&mut self) {
        if let Some(f) = self.0.upgrade() {
            f.started.store(false, Ordering::Release);
            // A wait registered after the task's last look would otherwise sleep until the next
            // `when_durable`.
            f.complete_up_to(f.durable_now());
        }
    }
}
