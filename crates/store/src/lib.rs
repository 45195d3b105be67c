//! Warren's message store: a shared write-ahead log (WAL) with group commit, and behind it one log per
//! queue.
//!
//! Records (`Enqueue { queue, seq, timestamp, payload }`, `Acks`, `Drop`) are appended in batches, written
//! sequentially into WAL segments by one writer thread, and made durable with one `fdatasync` per group of
//! batches, whatever the number of queues. A batch's [`SyncTicket`] is durable once the watermark from
//! [`Store::durable`] has reached it; only then may the broker confirm it. At checkpoints each queue's
//! still-live enqueues become part of its log: as extents of the WAL where they lie densely (a backlog
//! is written once), else copied into the queue's own segment files. The queue reads its backlog back
//! in order from there ([`Store::read`]): memory does not grow with the backlog, and a queue's consumed
//! segments are deleted without waiting for any other queue. Checkpoints make the queue files durable
//! with one `syncfs` and let the WAL before them go (but for segments extents are in); recovery replays
//! only the WAL after the last checkpoint.
//!
//! Module map: [`format`] (on-disk layouts and crash behaviour), `checkpoint`, `segment` (WAL files),
//! `qlog` (queue logs), `gone` (which seqs of a queue are gone), `writer` (pending buffer, writer thread),
//! `recovery`, `space` (a full disk), `store` (the handle), `batch`, `error`. The API contract is `docs/internals/store-api.md`.

mod batch;
mod checkpoint;
mod damaged;
mod direct;
mod error;
pub mod format;
mod gone;
pub mod io;
mod qlog;
mod reclaim;
mod recovery;
mod segment;
pub mod sim;
pub mod test_hooks;
mod space;
mod store;
mod writer;

pub use batch::Batch;
pub use error::StoreError;
pub use format::Damage;
pub use io::{Disk, DiskFile};
pub use qlog::{ReadBatch, RetentionStats, StoredMessage};
pub use damaged::damaged_dir;
pub use recovery::{CorruptSegment, LostMessages, RecoveredQueue, Recovery, RecoveryMode, TornTail};
pub use store::{Store, StoreOptions, StoreStats, SyncPolicy};

/// Creates directory `path` and any missing parents durably: the parent of each directory created is
/// fsynced, so that files fsynced inside it cannot vanish with its entry at a power loss. For the data
/// directory around the store.
pub fn create_dir_durably(path: &std::path::Path) -> std::io::Result<()> {
    segment::create_dirs_durably(&io::Disk::real(), path)
}

/// Store queue ids with this bit (and below `1 << 63`, where the broker's transient queues start) hold
/// the Raft log of a cluster group: queue `RAFT_LOG_QUEUES | g` is group `g`'s entries
/// (crates/cluster, `log_store`). Group ids, like classic queue ids, stay below [`RAFT_STATE_QUEUES`].
pub const RAFT_LOG_QUEUES: u64 = 1 << 62;

/// Store queue `RAFT_STATE_QUEUES | g` holds group `g`'s hard state (vote, committed, purged) and its
/// snapshot (crates/cluster, `log_store`).
pub const RAFT_STATE_QUEUES: u64 = 1 << 61;

/// Whether store queue `id` is a Raft group's log or state rather than a message queue: the broker
/// leaves those to the cluster when it matches recovered queues against its metadata.
pub fn is_raft_queue(id: u64) -> bool {
    (RAFT_STATE_QUEUES..1 << 63).contains(&id)
}

/// Whether a run of `queue`'s records in the WAL goes on over a record of `other` (see
/// `qlog::QueueLog::spill`: a run spanning 512 KiB becomes an extent instead of being copied at the
/// checkpoint). A queue's own records continue its run; a Raft group's log also runs over the
/// group's own queue's records and state: a quorum queue writes its entries and, past its memory
/// budget, its messages' records in turn, and then neither formed a run long enough, so both were
/// copied. Keeping the queue's records on disk as long as the group's log is keeping the same
/// queue's data (the log is purged after snapshots). Not the other way round: a queue's records
/// in an extent with the log's entries in between would be read at twice the bytes (measured: a
/// quorum queue's backlog drained at half the rate).
pub(crate) fn runs_over(queue: u64, other: u64) -> bool {
    let group = |id: u64| id & (RAFT_STATE_QUEUES - 1);
    let is_log = (RAFT_LOG_QUEUES..1 << 63).contains(&queue);
    let of_the_group = other == group(queue) || (is_raft_queue(other) && group(other) == group(queue));
    queue == other || (is_log && of_the_group)
}

/// A position in the logical WAL. A batch is durable once the durable watermark is at or past its ticket.
pub type SyncTicket = u64;

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
