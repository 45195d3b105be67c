//! Exchanges and their bindings.

use crate::error::{BrokerError, Result};
use crate::queue::Queue;
use crate::routing::{headers_match, topic_matches};
use parking_lot::RwLock;
use std::sync::Arc;
use warren_protocol::field::FieldTable;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeKind {
    Direct,
    Fanout,
    Topic,
    Headers,
}

impl ExchangeKind {
    pub fn parse(kind: &str) -> Result<ExchangeKind> {
        match kind {
            "direct" => Ok(ExchangeKind::Direct),
            "fanout" => Ok(ExchangeKind::Fanout),
            "topic" => Ok(ExchangeKind::Topic),
            "headers" => Ok(ExchangeKind::Headers),
            other => Err(BrokerError::command_invalid(format!(
                "unknown exchange type '{other}' (Warren supports direct, fanout, topic and headers)"
            ))),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Headers => "headers",
        }
    }
}

#[derive(Clone)]
pub enum Destination {
    Queue(Arc<Queue>),
    Exchange(Arc<Exchange>),
}

impl Destination {
    pub fn name(&self) -> &str {
        match self {
            Destination::Queue(q) => &q.name,
            Destination::Exchange(e) => &e.name,
        }
    }
    pub fn is_queue(&self) -> bool {
        matches!(self, Destination::Queue(_))
    }
    pub fn same(&self, other: &Destination) -> bool {
        match (self, other) {
            (Destination::Queue(a), Destination::Queue(b)) => Arc::ptr_eq(a, b),
            (Destination::Exchange(a), Destination::Exchange(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
    pub fn durable(&self) -> bool {
        match self {
            Destination::Queue(q) => q.durable,
            Destination::Exchange(e) => e.durable,
        }
    }
}

#[derive(Clone)]
pub struct Binding {
    pub destination: Destination,
    pub routing_key: String,
    pub arguments: FieldTable,
}

pub struct Exchange {
    pub name: String,
    pub kind: ExchangeKind,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
    /// The `alternate-exchange` argument: where messages this exchange cannot route go.
    pub alternate: Option<String>,
    bindings: RwLock<Vec<Binding>>,
}

impl Exchange {
    pub fn new(
        name: String,
        kind: ExchangeKind,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: FieldTable,
    ) -> Arc<Exchange> {
        let alternate = arguments
            .get("alternate-exchange")
            .and_then(|v| v.as_str())
            .map(str::to_string);
        Arc::new(Exchange { name, kind, durable, auto_delete, internal, arguments, alternate, bindings: RwLock::new(Vec::new()) })
    }

    /// Adds a binding; returns false if an identical one exists (binding is idempotent).
    pub fn bind(&self, binding: Binding) -> bool {
        let mut bindings = self.bindings.write();
        if bindings.iter().any(|b| same_binding(b, &binding)) {
            return false;
        }
        bindings.push(binding);
        true
    }

    /// Removes a binding; returns false if it did not exist.
    pub fn unbind(&self, binding: &Binding) -> bool {
        let mut bindings = self.bindings.write();
        let before = bindings.len();
        bindings.retain(|b| !same_binding(b, binding));
        bindings.len() != before
    }

    /// Removes every binding to a destination (it is being deleted).
    pub fn unbind_destination(&self, destination: &Destination) -> bool {
        let mut bindings = self.bindings.write();
        let before = bindings.len();
        bindings.retain(|b| !b.destination.same(destination));
        bindings.len() != before
    }

    pub fn has_bindings(&self) -> bool {
        !self.bindings.read().is_empty()
    }

    /// Whether a chain of exchange-to-exchange bindings starts here (it may reach a headers
    /// exchange, so routing decodes headers up front).
    pub fn has_exchange_bindings(&self) -> bool {
        self.bindings.read().iter().any(|b| !b.destination.is_queue())
    }

    pub fn bindings(&self) -> Vec<Binding> {
        self.bindings.read().clone()
    }

    /// Adds the destinations a message with this routing key (and headers, for a headers
    /// exchange) is bound to.
    pub fn route(&self, routing_key: &str, headers: Option<&FieldTable>, out: &mut Vec<Destination>) {
        let bindings = self.bindings.read();
        for b in bindings.iter() {
            let hit = match self.kind {
                ExchangeKind::Direct => b.routing_key == routing_key,
                ExchangeKind::Fanout => true,
                ExchangeKind::Topic => topic_matches(&b.routing_key, routing_key),
                ExchangeKind::Headers => headers_match(&b.arguments, headers),
            };
            if hit && !out.iter().any(|d| d.same(&b.destination)) {
                out.push(b.destination.clone());
            }
        }
    }
}

fn same_binding(a: &Binding, b: &Binding) -> bool {
    a.destination.same(&b.destination) && a.routing_key == b.routing_key && a.arguments == b.arguments
}
