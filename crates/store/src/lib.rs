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
mod recovery;
mod segment;
pub mod sim;
mod space;
mod store;
mod writer;

pub use batch::Batch;
pub use error::StoreError;
pub use format::Damage;
pub use io::{Disk, DiskFile};
pub use qlog::{ReadBatch, StoredMessage};
pub use damaged::damaged_dir;
pub use recovery::{CorruptSegment, RecoveredQueue, Recovery, RecoveryMode, TornTail};
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

/// A position in the logical WAL. A batch is durable once the durable watermark is at or past its ticket.
pub type SyncTicket = u64;

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
