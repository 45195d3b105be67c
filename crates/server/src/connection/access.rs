//! Permission checks on AMQP operations, as RabbitMQ's `rabbit_channel` makes them: a user's
//! configure, write and read patterns in the connection's vhost (`auth::Permission`) against the
//! name of the queue or exchange an operation touches (the default exchange is `amq.default`),
//! and topic permissions against routing keys on topic exchanges. A refusal is a channel error,
//! 403 ACCESS_REFUSED, in RabbitMQ 3.10's words.
//!
//! Each channel keeps the permission it last looked up, with the generation of the broker's view
//! it came from (`Broker::auth_generation`): a changed permission takes effect at the next check
//! (RabbitMQ keeps a channel's cached answers; Warren is stricter). A publish to the exchange the
//! last allowed one went to costs an atomic load and a string compare.

use std::sync::Arc;

use warren_broker::auth::defs::TopicPermissionDef;
pub use warren_broker::auth::Perm;
use warren_broker::auth::Permission;
use warren_broker::exchange::ExchangeKind;
use warren_broker::BrokerError;

use super::ConnectionShared;

/// What a resource is, in refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    Queue,
    Exchange,
}

impl Resource {
    pub fn as_str(self) -> &'static str {
        match self {
            Resource::Queue => "queue",
            Resource::Exchange => "exchange",
        }
    }
}

/// A channel's permission checks (see the module doc).
pub struct Access {
    /// The broker view's generation `permission` and `topics` come from (u64::MAX: none yet).
    generation: u64,
    permission: Option<Arc<Permission>>,
    /// This user's topic permissions in this vhost, `{username}` and `{vhost}` expanded and
    /// compiled once (they are the connection's own).
    topics: Vec<TopicPatterns>,
    /// The exchange the last allowed publish went to (write checked).
    last_write: Option<String>,
}

/// A topic permission as checked: (exchange, write, read); a pattern the expansion made invalid
/// grants nothing (None).
struct TopicPatterns {
    exchange: String,
    write: Option<regex::Regex>,
    read: Option<regex::Regex>,
}

impl TopicPatterns {
    fn compile(p: &TopicPermissionDef, conn: &ConnectionShared) -> TopicPatterns {
        let expand = |pattern: &str| warren_broker::auth::defs::topic_pattern(pattern, &conn.user.name, &conn.vhost.name);
        TopicPatterns { exchange: p.exchange.clone(), write: expand(&p.write), read: expand(&p.read) }
    }
}

impl Default for Access {
    fn default() -> Self {
        Access { generation: u64::MAX, permission: None, topics: Vec::new(), last_write: None }
    }
}

/// The name permissions are matched against: the default exchange is `amq.default`.
pub fn resource_name(kind: Resource, name: &str) -> &str {
    match kind {
        Resource::Exchange => warren_broker::auth::exchange_resource(name),
        Resource::Queue => name,
    }
}

/// RabbitMQ's text for a refused operation on `resource` (as `resource_name` gives it), after
/// "ACCESS_REFUSED - " (the management API passes it on too).
pub fn refused_text(kind: Resource, resource: &str, vhost: &str, user: &str) -> String {
    format!("access to {} '{resource}' in vhost '{vhost}' refused for user '{user}'", kind.as_str())
}

/// RabbitMQ's text for a routing key a topic permission refuses.
pub fn topic_refused_text(key: &str, exchange: &str, vhost: &str, user: &str) -> String {
    format!("access to topic '{key}' in exchange '{exchange}' in vhost '{vhost}' refused for user '{user}'")
}

impl Access {
    fn refresh(&mut self, conn: &ConnectionShared) {
        let generation = conn.broker.auth_generation();
        if generation == self.generation {
            return;
        }
        let users = conn.broker.users();
        self.permission = users.permission(&conn.user.name, &conn.vhost.name);
        self.topics = users
            .topic_permissions()
            .iter()
            .filter(|p| p.user == conn.user.name && p.vhost == conn.vhost.name)
            .map(|p| TopicPatterns::compile(p, conn))
            .collect();
        self.last_write = None;
        self.generation = generation;
    }

    /// Whether the user may `perm` the queue or exchange `name` in the connection's vhost.
    pub fn check(&mut self, conn: &ConnectionShared, perm: Perm, kind: Resource, name: &str) -> Result<(), BrokerError> {
        self.refresh(conn);
        let name = resource_name(kind, name);
        let allowed = self.permission.as_ref().is_some_and(|p| p.allows(perm, name));
        if allowed {
            return Ok(());
        }
        Err(BrokerError::access_refused(refused_text(kind, name, &conn.vhost.name, &conn.user.name)))
    }

    /// basic.publish's checks, in RabbitMQ's order: write on the exchange; with topic permissions,
    /// the exchange must exist and not be internal, then the routing key is checked on it. A
    /// publish to the exchange the last allowed one went to, by a user without topic permissions,
    /// costs an atomic load and a string compare.
    pub fn check_publish(&mut self, conn: &ConnectionShared, exchange: &str, routing_key: &str) -> Result<(), BrokerError> {
        if self.generation == conn.broker.auth_generation() && self.last_write.as_deref() == Some(exchange) {
            return Ok(());
        }
        self.check(conn, Perm::Write, Resource::Exchange, exchange)?;
        if self.topics.is_empty() {
            self.last_write = Some(exchange.to_string());
            return Ok(());
        }
        // Each routing key is checked: nothing cached.
        let exchange = conn.vhost.publishable_exchange(exchange)?;
        self.check_topic(conn, Perm::Write, &exchange.name, exchange.kind, routing_key)
    }

    /// Whether this user has topic permissions in this vhost at all (most have none: no lookup).
    pub fn has_topic_permissions(&mut self, conn: &ConnectionShared) -> bool {
        self.refresh(conn);
        !self.topics.is_empty()
    }

    /// A topic permission on a topic exchange: `perm` (write for a publish, read for a binding) of
    /// routing key `key`. No topic permission for the exchange allows everything, as RabbitMQ;
    /// patterns may name `{username}` and `{vhost}`.
    pub fn check_topic(&mut self, conn: &ConnectionShared, perm: Perm, exchange: &str, kind: ExchangeKind, key: &str) -> Result<(), BrokerError> {
        if kind != ExchangeKind::Topic || !self.has_topic_permissions(conn) {
            return Ok(());
        }
        let Some(p) = self.topics.iter().find(|p| p.exchange == exchange) else { return Ok(()) };
        let pattern = match perm {
            Perm::Write => &p.write,
            _ => &p.read,
        };
        let allowed = pattern.as_ref().is_some_and(|re| re.is_match(key));
        if allowed {
            return Ok(());
        }
        Err(BrokerError::access_refused(topic_refused_text(key, exchange, &conn.vhost.name, &conn.user.name)))
    }
}
