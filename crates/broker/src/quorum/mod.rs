//! The quorum queue's deterministic state machine (issue 10), modelled on RabbitMQ 4's
//! `rabbit_fifo`: every replica applies the same Raft entries in log order and reaches the same
//! state and the same effects. No I/O, no clock, no randomness, no Raft library here: the cluster
//! crate's group runtime feeds entries to [`QuorumMachine::apply`] and performs the [`Effect`]s;
//! time enters as commands (`Tick`, and the `now_ms` of `Enqueue` and `Touch`).
//!
//! - [`command`]: the commands an entry carries and the replies, in Warren's versioned binary
//!   encoding ([`Encoder`] builds entries, [`Command::decode`] never panics).
//! - [`machine`]: the state, `apply`, consumers and assignment, TTL, limits, dead-lettering.
//! - [`ready`]: the ready messages, compact (runs of ids, per-message state only where it differs).
//! - [`snapshot`]: the state without bodies, and its restore.
//! - [`bodies`]: what a replica that installed a snapshot asks a peer for (the bodies of its live
//!   messages), and the answer.
//!
//! Cost per message in memory (x86-64): a fresh (never delivered) message costs its share of a
//! 24-byte run of ids with one expiry (an entry's messages: 0.24 B each in a 100-message batch; or
//! the single messages of consecutive entries; 24 B alone), plus 4 B with `x-max-length-bytes`. A message
//! that is checked out or was returned costs one B-tree entry of 32 B (id + state) plus the
//! tree's node overhead (≈ 45 B in all). A publisher session costs ≈ 40 B. Bodies are never held.
//!
//! Deviations from RabbitMQ 4 (see docs/internals/cluster.md): exact (not approximate)
//! reject-publish; no message priorities; no `reject-publish-dlx`; dead-lettering is at-most-once
//! (the wrapper re-publishes after the message has left the queue).

pub mod bodies;
pub mod codec;
pub mod command;
pub mod machine;
pub mod ready;
pub mod retained;
pub mod snapshot;

#[cfg(test)]
mod tests;

pub use codec::DecodeError;
pub use command::{
    msg_id, Attach, Command, ConsumerId, Dequeued, EncodeError, EnqueueMsg, Encoder, MsgId, Refusal, Reply, SessionId,
    MAX_MESSAGES_PER_ENTRY,
};
pub use machine::{
    run_ids, Counters, Delivery, Effect, IdRuns, Overflow, QueueConfig, QuorumMachine, Reason, DEFAULT_DELIVERY_LIMIT,
};
