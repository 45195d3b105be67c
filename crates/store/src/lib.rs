//! Warren's message store: one shared append-only log for all durable queues.
//!
//! Records (`Enqueue { queue, payload }` and `Acks`) are appended in batches, written sequentially into
//! segment files by one writer thread, and made durable with one `fdatasync` per group of batches (group
//! commit). A batch's [`SyncTicket`] is durable once the watermark from [`Store::durable`] has reached it;
//! only then may the broker confirm it. On open, [`Store::open`] replays the log, truncates a torn tail,
//! isolates corruption and returns the live messages. Segments are deleted from the head once every
//! message in them (and before them) is acked.
//!
//! Module map: [`format`] (on-disk layout and crash behaviour), `segment` (files and the live-message
//! table), `writer` (pending buffer and writer thread), `recovery`, `store` (the handle), `batch`, `error`.
//! The API contract is `docs/internals/store-api.md`.

mod batch;
mod error;
pub mod format;
mod recovery;
mod segment;
mod store;
mod writer;

pub use batch::Batch;
pub use error::StoreError;
pub use format::Damage;
pub use recovery::{CorruptSegment, RecoveredMessage, Recovery, TornTail};
pub use store::{Store, StoreOptions, StoreStats, SyncPolicy};

/// Store-assigned message id: strictly increasing, unique for the life of the log (also across restarts).
pub type MsgId = u64;

/// A position in the logical log. A batch is durable once the durable watermark is at or past its ticket.
pub type SyncTicket = u64;
