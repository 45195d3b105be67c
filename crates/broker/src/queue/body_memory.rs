//! The memory quorum replicas hold message bodies in: one budget for the whole node.
//!
//! A replica keeps a live message's body in memory to deliver it, while the node has room; past
//! that the body is only in the store and is read back before it is delivered (see `replica`).
//! The budget is the node's, shared by all its replicas (the server derives it from the memory
//! limit: `--memory-high-watermark`), not a fixed amount per replica. A fixed 32 MiB per replica
//! allowed 1,000 queues 32 GiB between them, and sent a single large backlog to the store when
//! the node had gigabytes to spare: draining 500,000 messages of 1 KB (`bench/cluster.py` Q2)
//! read 546 MB back from the store on a disk that then bounded the drain.
//!
//! Reads back of bodies about to be delivered may always use a small allowance per replica
//! (`READ_BACK_ALLOWANCE`), so that a queue being drained does not read one body at a time while
//! another queue's backlog fills the node's budget. It is bounded by what consumers are being
//! handed: the read-ahead window of each replica.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// What a node's replicas may hold when no limit was set (the broker without the server: tests).
pub const DEFAULT_NODE_BODY_BYTES: u64 = 256 << 20;
/// What a replica may hold for bodies read back to deliver, whatever the node holds: its reads
/// ahead (two of 2 MiB under way) and the one on the spot (4 MiB).
const READ_BACK_ALLOWANCE: u64 = 8 << 20;
/// The log says the budget is full at most this often.
const SAY_FULL_EVERY: Duration = Duration::from_secs(60);

/// The node's budget for bodies and what all its replicas hold.
#[derive(Debug)]
pub struct NodeBodies {
    held: AtomicU64,
    limit: AtomicU64,
    /// When the log last said the budget was full.
    said_full: Mutex<Option<Instant>>,
}

impl Default for NodeBodies {
    fn default() -> NodeBodies {
        NodeBodies { held: AtomicU64::new(0), limit: AtomicU64::new(DEFAULT_NODE_BODY_BYTES), said_full: Mutex::new(None) }
    }
}

impl NodeBodies {
    /// Sets the budget (at a start and when the configuration is reloaded). Bodies held past a
    /// lower one stay until they leave; new ones go to the store meanwhile.
    pub fn set_limit(&self, bytes: u64) {
        self.limit.store(bytes, Ordering::Relaxed);
    }

    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// What all replicas of the node hold.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    fn has_room(&self, bytes: u64) -> bool {
        self.held().saturating_add(bytes) <= self.limit()
    }

    /// A new body found no room: says so in the log, at most once a minute.
    fn full(&self) {
        let mut said = self.said_full.lock();
        if said.is_some_and(|at| at.elapsed() < SAY_FULL_EVERY) {
            return;
        }
        *said = Some(Instant::now());
        tracing::info!(
            held_bytes = self.held(),
            limit_bytes = self.limit(),
            "quorum queues' bodies fill this node's budget for them: new ones stay only in the store (in their Raft entries) and are read back to be delivered"
        );
    }
}

/// What one replica holds, counted in its node's total too; given back when dropped.
#[derive(Debug)]
pub struct BodyMemory {
    mine: u64,
    node: Arc<NodeBodies>,
}

impl BodyMemory {
    pub fn new(node: Arc<NodeBodies>) -> BodyMemory {
        BodyMemory { mine: 0, node }
    }

    /// Whether a new body of `bytes` may be held: the node has room for it (if not, the log says
    /// the budget is full, at most once a minute).
    pub fn fits(&self, bytes: u64) -> bool {
        let fits = self.node.has_room(bytes);
        if !fits {
            self.node.full();
        }
        fits
    }

    /// Whether `bytes` read back to deliver may be held: the node has room, or this replica is
    /// within its allowance for reads back.
    pub fn fits_read_back(&self, bytes: u64) -> bool {
        self.node.has_room(bytes) || self.mine.saturating_add(bytes) <= READ_BACK_ALLOWANCE
    }

    pub fn add(&mut self, bytes: u64) {
        self.mine += bytes;
        self.node.held.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn sub(&mut self, bytes: u64) {
        let bytes = bytes.min(self.mine);
        self.mine -= bytes;
        self.node.held.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Every body was let go.
    pub fn clear(&mut self) {
        self.sub(self.mine);
    }
}

impl Drop for BodyMemory {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_share_the_nodes_budget_and_give_back_what_they_held() {
        let node = Arc::new(NodeBodies::default());
        node.set_limit(100 << 20);
        let mut a = BodyMemory::new(node.clone());
        let mut b = BodyMemory::new(node.clone());
        a.add(60 << 20);
        assert!(b.fits(40 << 20));
        assert!(!b.fits((40 << 20) + 1));
        b.add(40 << 20);
        assert_eq!(node.held(), 100 << 20);
        // Full: no new body, but a replica may still read back within its allowance.
        assert!(!b.fits(1));
        let c = BodyMemory::new(node.clone());
        assert!(c.fits_read_back(READ_BACK_ALLOWANCE));
        assert!(!c.fits_read_back(READ_BACK_ALLOWANCE + 1));
        assert!(!b.fits_read_back(1));
        a.sub(10 << 20);
        assert!(b.fits(10 << 20));
        drop(a);
        assert_eq!(node.held(), 40 << 20);
        b.clear();
        b.sub(1); // never below zero
        assert_eq!(node.held(), 0);
    }
}
