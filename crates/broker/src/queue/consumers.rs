//! A queue's consumers and the order in which they are offered the next message, as RabbitMQ does:
//!
//! - Consumer priorities (`x-priority` consume argument, default 0): messages go to the consumers of
//!   the highest priority that can take one (credit, room in their connection); equal priorities
//!   share round-robin; lower priorities get messages only while every higher one is blocked.
//! - Single active consumer (`x-single-active-consumer` queue argument): only one consumer receives;
//!   the first registered one is active (a later one never takes over, whatever its priority); when
//!   it goes, the waiting consumer with the highest priority, earliest registered, takes over. The
//!   active one keeps its turn even when it has no credit: messages wait for it.
//!
//! With every consumer at one priority (the usual case) there is one group and the choice is a plain
//! round-robin cursor, as cheap as a single list.

use crate::error::{BrokerError, Result};
use crate::queue::{DeliverySink, Queue};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use warren_protocol::field::FieldTable;

/// A consumer registered on a queue by basic.consume.
pub struct Consumer {
    pub tag: Arc<str>,
    /// The channel it delivers through.
    pub channel: Arc<dyn DeliverySink>,
    pub queue: Arc<Queue>,
    pub no_ack: bool,
    pub exclusive: bool,
    /// Per-consumer prefetch (basic.qos global=false at the time of consume); 0 = unlimited.
    pub prefetch: u32,
    /// `x-priority` (see `consumers`).
    pub priority: i32,
    /// Unacknowledged deliveries of this consumer (kept by its channel).
    pub(crate) unacked: AtomicU32,
}

impl Consumer {
    pub fn has_credit(&self) -> bool {
        self.no_ack || self.prefetch == 0 || self.unacked.load(Ordering::Relaxed) < self.prefetch
    }
}

/// The consume arguments Warren accepts. `x-cancel-on-ha-failover` concerns mirrored queues failing
/// over to another node, which cannot happen on one node: accepted and has nothing to do.
pub const SUPPORTED_CONSUME_ARGS: &[&str] = &["x-priority", "x-cancel-on-ha-failover"];

/// basic.consume arguments.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerArgs {
    /// `x-priority`: larger first; negative allowed.
    pub priority: i32,
}

impl ConsumerArgs {
    /// Validates basic.consume arguments; an `x-` argument Warren does not support is refused with 406.
    pub fn parse(queue: &str, args: &FieldTable) -> Result<ConsumerArgs> {
        if let Some((arg, _)) = args.iter().find(|(k, _)| k.starts_with("x-") && !SUPPORTED_CONSUME_ARGS.contains(&k.as_str())) {
            let why = match arg.as_str() {
                "x-stream-offset" | "x-stream-filter" => "it applies to streams, which Warren does not have",
                _ => "Warren does not implement it",
            };
            return Err(BrokerError::precondition_failed(format!(
                "consume argument '{arg}' is not supported (queue '{queue}'): {why}; consume without it"
            )));
        }
        let priority = match args.get("x-priority") {
            None => 0,
            Some(v) => match v.as_i64() {
                Some(p) if i32::try_from(p).is_ok() => p as i32,
                _ => {
                    return Err(BrokerError::precondition_failed(format!(
                        "invalid consume argument 'x-priority' for queue '{queue}': expected an integer between {} and {}, got {v:?}",
                        i32::MIN,
                        i32::MAX
                    )))
                }
            },
        };
        if let Some(v) = args.get("x-cancel-on-ha-failover") {
            if v.as_bool().is_none() {
                return Err(BrokerError::precondition_failed(format!(
                    "invalid consume argument 'x-cancel-on-ha-failover' for queue '{queue}': expected a boolean, got {v:?}"
                )));
            }
        }
        Ok(ConsumerArgs { priority })
    }
}

/// Consumers of one priority, in registration order, with their round-robin cursor.
struct Group {
    priority: i32,
    members: Vec<Arc<Consumer>>,
    next: usize,
}

/// Where a candidate sits, to advance the round-robin once it took a message.
#[derive(Debug, Clone, Copy)]
pub struct Slot {
    group: usize,
    member: usize,
}

/// A queue's consumers.
pub struct Consumers {
    /// Highest priority first.
    groups: Vec<Group>,
    count: usize,
    single_active: bool,
    /// With single active consumer: the one that receives.
    active: Option<Arc<Consumer>>,
}

impl Consumers {
    pub fn new(single_active: bool) -> Consumers {
        Consumers { groups: Vec::new(), count: 0, single_active, active: None }
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn len(&self) -> usize {
        self.count
    }

    /// Every registered consumer.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Consumer>> {
        self.groups.iter().flat_map(|g| g.members.iter())
    }

    /// The consumers that may receive now: the active one with single active consumer, else all.
    pub fn receivers(&self) -> impl Iterator<Item = &Arc<Consumer>> {
        let (all, active) = if self.single_active { (None, self.active.as_ref()) } else { (Some(self.iter()), None) };
        active.into_iter().chain(all.into_iter().flatten())
    }

    pub fn add(&mut self, consumer: Arc<Consumer>) {
        if self.single_active && self.active.is_none() {
            self.active = Some(consumer.clone());
        }
        self.count += 1;
        let priority = consumer.priority;
        match self.groups.iter().position(|g| g.priority <= priority) {
            Some(i) if self.groups[i].priority == priority => self.groups[i].members.push(consumer),
            at => {
                let group = Group { priority, members: vec![consumer], next: 0 };
                self.groups.insert(at.unwrap_or(self.groups.len()), group);
            }
        }
    }

    /// Removes a consumer; with single active consumer, the next one takes over if it was active.
    /// Returns whether it was registered.
    pub fn remove(&mut self, consumer: &Arc<Consumer>) -> bool {
        let Some((gi, mi)) = self.position(consumer) else { return false };
        let group = &mut self.groups[gi];
        group.members.remove(mi);
        if mi < group.next {
            group.next -= 1;
        }
        if group.next >= group.members.len() {
            group.next = 0;
        }
        if group.members.is_empty() {
            self.groups.remove(gi);
        }
        self.count -= 1;
        if self.active.as_ref().is_some_and(|a| Arc::ptr_eq(a, consumer)) {
            // Highest priority first, earliest registered within it.
            self.active = self.groups.first().and_then(|g| g.members.first()).cloned();
        }
        true
    }

    /// Removes every consumer (the queue is deleted).
    pub fn take_all(&mut self) -> Vec<Arc<Consumer>> {
        self.active = None;
        self.count = 0;
        self.groups.drain(..).flat_map(|g| g.members).collect()
    }

    fn position(&self, consumer: &Arc<Consumer>) -> Option<(usize, usize)> {
        let gi = self.groups.iter().position(|g| g.priority == consumer.priority)?;
        let mi = self.groups[gi].members.iter().position(|c| Arc::ptr_eq(c, consumer))?;
        Some((gi, mi))
    }

    /// The consumers to offer the next message to, in order (see the module doc).
    pub fn candidates(&self) -> Candidates {
        Candidates { group: 0, tried: 0, done: false }
    }

    /// The consumer at `slot` took a message: the next one of its priority comes next.
    pub fn delivered(&mut self, slot: Slot) {
        if let Some(g) = self.groups.get_mut(slot.group) {
            g.next = (slot.member + 1) % g.members.len().max(1);
        }
    }
}

/// Walks the candidates for one delivery without borrowing the consumers between steps (the caller
/// holds the queue state mutably while it tries each one).
pub struct Candidates {
    group: usize,
    tried: usize,
    done: bool,
}

impl Candidates {
    pub fn next(&mut self, consumers: &Consumers) -> Option<(Slot, Arc<Consumer>)> {
        if self.done {
            return None;
        }
        if consumers.single_active {
            self.done = true;
            let active = consumers.active.clone()?;
            let (group, member) = consumers.position(&active)?;
            return Some((Slot { group, member }, active));
        }
        loop {
            let group = consumers.groups.get(self.group)?;
            let n = group.members.len();
            if self.tried < n {
                let member = (group.next + self.tried) % n;
                self.tried += 1;
                return Some((Slot { group: self.group, member }, group.members[member].clone()));
            }
            self.group += 1;
            self.tried = 0;
        }
    }
}
