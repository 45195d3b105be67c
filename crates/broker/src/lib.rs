//! Warren's broker model: virtual hosts, exchanges, queues, bindings, routing, consumers,
//! prefetch, acknowledgements, TTL and dead-lettering. It knows nothing of sockets: the server
//! crate turns AMQP frames into calls here, and receives deliveries through [`ClientSink`].
//!
//! A message's way through: [`VHost::publish`] routes it ([`Exchange::route`]) to queues,
//! [`Queue::publish`] appends it to the store (durable queue, persistent message) and hands it
//! to a consumer with credit ([`Channel::try_deliver`]); the client's ack comes back through
//! [`Channel::settle`] to [`Queue::settle`], which records the ack in the store.

pub mod auth;
mod blocking;
pub mod broker;
pub mod channel;
pub mod deadletter;
pub mod deadletter_confirms;
pub mod delay;
pub mod direct_reply;
pub mod definitions;
pub mod error;
pub mod exchange;
pub mod message;
pub mod metadata;
pub mod names;
pub mod queue;
pub use queue::consumers;
pub mod publisher;
pub mod queue_args;
pub mod quorum;
pub mod routing;
pub mod sink;
pub mod stats;
pub mod vhost;

pub use broker::{AuthChange, AuthChangeError, Broker, BrokerOptions, User};
pub use queue::body_memory::DEFAULT_NODE_BODY_BYTES;
pub use channel::{AckWhenWritten, Channel, ClientSink, Consumer, Delivery, Settle};
pub use consumers::ConsumerArgs;
pub use error::{BrokerError, Scope};
pub use exchange::Exchange;
pub use message::{Message, MessageRef};
pub use publisher::{Publisher, PublisherSession};
pub use queue::{GetWait, Got, Queue};
pub use vhost::{PublishOutcome, VHost};

/// This process's run: random, never 0, different at every start. What a cluster records about a
/// node's transient queues and exclusive owners carries it, so that a node tells its own from those
/// of an earlier run (which ended with it).
pub fn run_id() -> u64 {
    static RUN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *RUN.get_or_init(|| rand::random::<u64>() | 1)
}

/// Wall-clock milliseconds since the Unix epoch: TTLs survive restarts, so they are absolute.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
