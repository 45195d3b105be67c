//! Direct reply-to, as RabbitMQ's `amq.rabbitmq.reply-to`: an RPC client consumes (no-ack) from the
//! pseudo-queue `amq.rabbitmq.reply-to` and publishes requests with `reply_to` set to that name; the
//! broker rewrites it to `amq.rabbitmq.reply-to.<token>`, and a reply published to the default exchange
//! with that routing key goes straight to the client's channel: no queue, nothing stored, nothing to
//! ack. A reply to a consumer that is gone is dropped (a mandatory one is returned), and so is one to
//! a consumer whose connection has 16 MiB waiting for its socket (`ClientSink::overloaded`): the
//! requester stopped reading, and the broker must not buffer for it without bound.
//!
//! The token is random (22 URL-safe base64 characters) and names one consumer of one channel; the
//! registry is per virtual host. In a cluster the token starts with `n<node id>.`, the node the
//! consumer is on: a reply published on another node goes there (`VHost::publish_by`, the classic
//! queue service's `Reply` request), as RabbitMQ routes replies from any node of a cluster.

use crate::error::{BrokerError, Result};
use crate::message::MessageRef;
use crate::queue::quorum::QuorumRuntime;
use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// The pseudo-queue a client consumes replies from.
pub const PSEUDO_QUEUE: &str = "amq.rabbitmq.reply-to";
/// What a publisher's `reply_to` is rewritten to, followed by the token.
pub const PREFIX: &str = "amq.rabbitmq.reply-to.";

/// Where a reply goes: the channel of a reply consumer (`Channel` implements it; this module names
/// no channel).
pub trait ReplyTarget: Send + Sync {
    /// Delivers a reply to the channel's reply consumer; false if it has none now.
    fn deliver_reply(&self, message: MessageRef) -> bool;
}

/// The reply consumers of a virtual host, by token.
pub struct ReplyConsumers {
    by_token: RwLock<HashMap<String, Weak<dyn ReplyTarget>>>,
    /// This node's id in its cluster (0: standalone), for the tokens.
    runtime: Arc<QuorumRuntime>,
}

impl ReplyConsumers {
    pub fn new(runtime: Arc<QuorumRuntime>) -> ReplyConsumers {
        ReplyConsumers { by_token: RwLock::new(HashMap::new()), runtime }
    }

    /// Registers `channel`'s reply consumer; returns its token.
    pub fn register(&self, channel: Weak<dyn ReplyTarget>) -> String {
        let token = match self.runtime.node() {
            0 => crate::names::generated_name(""),
            node => crate::names::generated_name(&format!("n{node}.")),
        };
        self.by_token.write().insert(token.clone(), channel);
        token
    }

    pub fn unregister(&self, token: &str) {
        self.by_token.write().remove(token);
    }

    /// Delivers a reply published to the default exchange with a routing key that starts with
    /// [`PREFIX`]; false if no such consumer exists any more.
    pub fn deliver(&self, message: MessageRef) -> bool {
        let Some(token) = message.routing_key.strip_prefix(PREFIX) else { return false };
        let channel = self.by_token.read().get(token).and_then(Weak::upgrade);
        channel.is_some_and(|c| c.deliver_reply(message))
    }

    /// queue.declare of the pseudo-queue (always there) or of a reply address (there while its
    /// consumer is): RabbitMQ lets an RPC server check this way that its client is still waiting.
    /// An address of another node's consumer is taken to be there (not asked).
    pub fn declare(&self, name: &str, vhost: &str) -> Result<(String, u32, u32)> {
        let exists = name == PSEUDO_QUEUE
            || name.strip_prefix(PREFIX).is_some_and(|token| self.elsewhere(token).is_some() || self.by_token.read().contains_key(token));
        if exists {
            Ok((name.to_string(), 0, 0))
        } else {
            Err(BrokerError::not_found(format!("no queue '{name}' in vhost '{vhost}'")))
        }
    }
}

impl ReplyConsumers {
    /// The other node of the cluster a reply with routing key `routing_key` goes to (None: this
    /// node's, or not a reply address of a cluster node).
    pub fn elsewhere(&self, routing_key: &str) -> Option<u64> {
        let token = routing_key.strip_prefix(PREFIX).unwrap_or(routing_key);
        let node: u64 = token.strip_prefix('n')?.split_once('.')?.0.parse().ok()?;
        let me = self.runtime.node();
        (me != 0 && node != me).then_some(node)
    }
}

/// Whether a queue name belongs to direct reply-to.
pub fn is_reply_name(name: &str) -> bool {
    name == PSEUDO_QUEUE || name.starts_with(PREFIX)
}
