//! What a channel hands to the connection that owns it: deliveries to write to the socket
//! ([`Delivery`], with the store ack a no-ack delivery carries until written, [`AckWhenWritten`]), and
//! the connection's side of that exchange ([`ClientSink`]).

use crate::message::MessageRef;
use std::sync::{Arc, Weak};
use warren_store::Batch;

/// What a channel hands to its connection to be written to the socket.
#[derive(Debug)]
pub enum Delivery {
    Deliver {
        channel: u16,
        consumer_tag: Arc<str>,
        delivery_tag: u64,
        redelivered: bool,
        /// Times the queue got it back unacknowledged (`Entry::returned`; 0 when not known).
        returned: u32,
        message: MessageRef,
        ack_when_written: Option<AckWhenWritten>,
    },
    GetOk {
        channel: u16,
        delivery_tag: u64,
        redelivered: bool,
        returned: u32,
        message_count: u32,
        message: MessageRef,
        ack_when_written: Option<AckWhenWritten>,
    },
    /// A server-sent basic.cancel (the queue was deleted under the consumer).
    Cancel { channel: u16, consumer_tag: Arc<str> },
}

/// The store ack of a no-ack delivery of a message the store holds. Such a delivery is consumed once
/// the connection has written it to the consumer's socket (RabbitMQ's "consumed"), not when it is
/// queued for writing: a crash in between must leave the message in the store, since its publisher
/// may have been confirmed. The connection appends this ack after the write (or when it gives up on
/// writing: the connection is gone, and a no-ack consumer's messages go with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckWhenWritten {
    pub queue: u64,
    pub seq: u64,
    pub stored_bytes: u64,
}

impl AckWhenWritten {
    pub fn add_to(&self, acks: &mut Batch) {
        acks.ack(self.queue, self.seq, self.stored_bytes);
    }
}

/// A channel whose consumers found no room, dispatched again once there is (`Channel` implements it;
/// the sink names no channel).
pub trait Kick: Send + Sync {
    fn kick_consumers(&self);
}

/// Implemented by the connection that owns a channel: queues push deliveries through it.
/// Must not block: it only appends to the connection's outgoing buffer.
pub trait ClientSink: Send + Sync {
    /// Queues a delivery for the socket. A delivery's `ack_when_written` (see [`AckWhenWritten`])
    /// becomes the sink's to append to the store once the delivery is written or dropped.
    fn send(&self, delivery: Delivery);

    /// Whether the connection can take more deliveries now. A connection whose socket is slower than
    /// its queues (a no-ack consumer has no prefetch to stop it) says no once enough is waiting to be
    /// written; queues then keep the messages (paging them to the store if need be) instead of the
    /// connection buffering them without bound.
    fn has_room(&self) -> bool {
        true
    }

    /// Asks to have `channel`'s consumers dispatched again once `has_room` turns true.
    fn wake_when_room(&self, _channel: Weak<dyn Kick>) {}

    /// Whether so much already waits for the client's socket that what cannot wait (a direct reply,
    /// pushed by another connection) must be dropped instead of buffered.
    fn overloaded(&self) -> bool {
        false
    }

    /// The connection's channels took (`hold`) or settled (`release`) unacknowledged messages of this
    /// many bytes (`Message::memory_bytes`). When a release brings the total below
    /// [`UNACKED_BYTES_LIMIT`], the channels that asked with `wake_when_room` are dispatched again.
    fn hold_unacked(&self, _bytes: usize) {}
    fn release_unacked(&self, _bytes: usize) {}

    /// Whether the connection holds [`UNACKED_BYTES_LIMIT`] or more of unacknowledged messages.
    fn unacked_full(&self) -> bool {
        false
    }

    /// A quorum queue resolved operations of the connection's publisher session
    /// (`crate::publisher`): confirms waiting for them may go out now.
    fn confirms_changed(&self) {}
}

impl Delivery {
    /// About how many bytes this delivery takes on the wire.
    pub fn approx_bytes(&self) -> usize {
        match self {
            Delivery::Deliver { message, .. } | Delivery::GetOk { message, .. } => message.memory_bytes(),
            Delivery::Cancel { .. } => 64,
        }
    }

    /// The store ack the sink appends once this delivery is written (see [`AckWhenWritten`]).
    pub fn ack_when_written(&self) -> Option<AckWhenWritten> {
        match self {
            Delivery::Deliver { ack_when_written, .. } | Delivery::GetOk { ack_when_written, .. } => *ack_when_written,
            Delivery::Cancel { .. } => None,
        }
    }
}
