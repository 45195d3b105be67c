//! Exchanges and their bindings.

use crate::definitions::{table_to_json, BindingDef, ExchangeDef};
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
    /// The type a client declares: one of the four, or `x-delayed-message` (a delayed exchange, as
    /// the rabbitmq-delayed-message-exchange plugin) whose `x-delayed-type` argument names how it
    /// routes. Returns the routing kind and whether the exchange delays (`crate::delay`).
    pub fn parse_declared(kind: &str, arguments: &FieldTable) -> Result<(ExchangeKind, bool)> {
        if kind != DELAYED_TYPE {
            return Ok((ExchangeKind::parse(kind)?, false));
        }
        let routes_as = arguments.get("x-delayed-type").and_then(|v| v.as_str());
        match routes_as.map(ExchangeKind::parse) {
            Some(Ok(kind)) => Ok((kind, true)),
            _ => Err(BrokerError::precondition_failed(format!(
                "invalid argument 'x-delayed-type' for an exchange of type '{DELAYED_TYPE}': {}; it must name how the exchange routes \
                 (direct, fanout, topic or headers)",
                match routes_as {
                    Some(t) => format!("'{t}' is not one of them"),
                    None => "it is missing or not a string".to_string(),
                }
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

/// The exchange type of delayed exchanges (`ExchangeKind::parse_declared`).
pub const DELAYED_TYPE: &str = "x-delayed-message";

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

    /// Whether the destination is in the metadata log: durable, or a transient queue of a cluster
    /// (`Queue::recorded`). A binding from a durable exchange to it is recorded there too.
    pub fn recorded(&self) -> bool {
        match self {
            Destination::Queue(q) => q.recorded(),
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
    /// How it routes (for a delayed exchange, its `x-delayed-type`).
    pub kind: ExchangeKind,
    /// An `x-delayed-message` exchange: a message with a positive `x-delay` header waits that long
    /// in the node's delay store before its queues get it (`crate::delay`).
    pub delayed: bool,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
    /// The `alternate-exchange` argument: where messages this exchange cannot route go.
    pub alternate: Option<String>,
    bindings: RwLock<Bindings>,
}

/// An exchange's bindings, and for direct exchanges an index by routing key (a thousand queues bound
/// to one direct exchange must not cost a thousand string compares per message).
#[derive(Default)]
struct Bindings {
    all: Vec<Binding>,
    by_key: std::collections::HashMap<String, Vec<usize>>,
    /// Bindings to other exchanges.
    to_exchanges: usize,
}

impl Bindings {
    fn reindex(&mut self) {
        self.to_exchanges = self.all.iter().filter(|b| !b.destination.is_queue()).count();
        self.by_key.clear();
        for (i, b) in self.all.iter().enumerate() {
            self.by_key.entry(b.routing_key.clone()).or_default().push(i);
        }
    }
}

impl Exchange {
    pub fn new(
        name: String,
        kind: ExchangeKind,
        delayed: bool,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: FieldTable,
    ) -> Arc<Exchange> {
        let alternate = arguments
            .get("alternate-exchange")
            .and_then(|v| v.as_str())
            .map(str::to_string);
        Arc::new(Exchange { name, kind, delayed, durable, auto_delete, internal, arguments, alternate, bindings: RwLock::new(Bindings::default()) })
    }

    /// The type as declared and shown: the routing kind's name, or `x-delayed-message`.
    pub fn type_name(&self) -> &'static str {
        if self.delayed {
            DELAYED_TYPE
        } else {
            self.kind.as_str()
        }
    }

    /// Adds a binding; returns false if an identical one exists (binding is idempotent).
    pub fn bind(&self, binding: Binding) -> bool {
        let mut bindings = self.bindings.write();
        if bindings.all.iter().any(|b| same_binding(b, &binding)) {
            return false;
        }
        bindings.all.push(binding);
        bindings.reindex();
        true
    }

    /// Removes a binding; returns false if it did not exist.
    pub fn unbind(&self, binding: &Binding) -> bool {
        let mut bindings = self.bindings.write();
        let before = bindings.all.len();
        bindings.all.retain(|b| !same_binding(b, binding));
        bindings.reindex();
        bindings.all.len() != before
    }

    /// Removes every binding to a destination (it is being deleted).
    pub fn unbind_destination(&self, destination: &Destination) -> bool {
        let mut bindings = self.bindings.write();
        let before = bindings.all.len();
        bindings.all.retain(|b| !b.destination.same(destination));
        bindings.reindex();
        bindings.all.len() != before
    }

    /// Whether an identical binding exists.
    pub fn has_binding(&self, binding: &Binding) -> bool {
        self.bindings.read().all.iter().any(|b| same_binding(b, binding))
    }

    pub fn binding_count(&self) -> usize {
        self.bindings.read().all.len()
    }

    /// Whether the exchange has bindings and all of them lead to `destination`.
    pub fn only_bound_to(&self, destination: &Destination) -> bool {
        let bindings = self.bindings.read();
        !bindings.all.is_empty() && bindings.all.iter().all(|b| b.destination.same(destination))
    }

    pub fn has_bindings(&self) -> bool {
        !self.bindings.read().all.is_empty()
    }

    /// Whether a chain of exchange-to-exchange bindings starts here (it may reach a headers
    /// exchange, so routing decodes headers up front).
    pub fn has_exchange_bindings(&self) -> bool {
        self.bindings.read().to_exchanges > 0
    }

    pub fn bindings(&self) -> Vec<Binding> {
        self.bindings.read().all.clone()
    }

    /// Adds the destinations a message with this routing key (and headers, for a headers
    /// exchange) is bound to.
    pub fn route(&self, routing_key: &str, headers: Option<&FieldTable>, out: &mut Vec<Destination>) {
        let bindings = self.bindings.read();
        if self.kind == ExchangeKind::Direct {
            for &i in bindings.by_key.get(routing_key).into_iter().flatten() {
                if let Some(b) = bindings.all.get(i) {
                    if !out.iter().any(|d| d.same(&b.destination)) {
                        out.push(b.destination.clone());
                    }
                }
            }
            return;
        }
        for b in bindings.all.iter() {
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

impl Exchange {
    /// How the metadata log records this exchange.
    pub fn def(&self) -> ExchangeDef {
        ExchangeDef {
            name: self.name.clone(),
            kind: self.type_name().to_string(),
            auto_delete: self.auto_delete,
            internal: self.internal,
            arguments: table_to_json(&self.arguments),
        }
    }
}

impl Binding {
    /// How the metadata log records this binding of exchange `source`.
    pub fn def(&self, source: &str) -> BindingDef {
        BindingDef {
            source: source.to_string(),
            destination: self.destination.name().to_string(),
            destination_type: if self.destination.is_queue() { "queue" } else { "exchange" }.to_string(),
            routing_key: self.routing_key.clone(),
            arguments: table_to_json(&self.arguments),
        }
    }
}
