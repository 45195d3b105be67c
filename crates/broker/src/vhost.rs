//! A virtual host: its exchanges, queues and bindings, declaration rules, and routing of
//! published messages to queues.

use crate::deadletter::{dead_lettered_message, is_cycle, DeadLetter, DeadLetterWork};
use crate::definitions::{table_from_json, table_to_json, BindingDef, QueueDef, TransientDef, VHostDefs};
use crate::direct_reply::{self, ReplyConsumers};
use crate::error::{BrokerError, Result};
use crate::delay::Delays;
use crate::exchange::{Binding, Destination, Exchange, ExchangeKind};
use crate::message::{encode_header, Message, MessageRef};
use crate::metadata::{GroupCommitError, Metadata, Op};
use crate::publisher::Publisher;
pub use crate::names::generated_name;
use crate::queue::{Enqueued, Owner, Queue, QueueHost};
use crate::queue::quorum::QuorumRuntime;
use crate::queue_args::{first_difference, QueueArgs, QueueType, EQUIVALENCE_KEYS};
use bytes::BytesMut;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use warren_protocol::field::FieldTable;
use warren_protocol::properties::PropertiesView;
use warren_store::{Store, SyncTicket};

/// The queues the housekeeping tick walks ([`VHost::tick`]).
struct TickLists {
    /// Ticked every time (every 100 ms): classic queues expire messages and refill from the store.
    classic: Vec<Arc<Queue>>,
    /// Ticked once a second: what a quorum queue does on a tick is once a second at most anyway
    /// (its leader proposes a Tick every second, a relay checks every 2 s), and ticking 1,000 of
    /// them ten times a second, cold cache lines each, was a tenth of an idle node's CPU.
    quorum: Vec<Arc<Queue>>,
}

/// What happened to a published message.
#[derive(Clone, Default)]
pub struct PublishOutcome {
    /// Some queue took it (false: unroutable; a mandatory publish gets basic.return).
    pub routed: bool,
    /// A queue refused it (x-overflow reject-publish): the publisher gets basic.nack.
    pub rejected: bool,
    /// The message is durable once the store reaches this ticket.
    pub ticket: Option<SyncTicket>,
    /// A queue it went to asks publishers to pause (`Enqueued::Accepted::slow_publishers`).
    pub slow_queue: Option<Arc<Queue>>,
    /// It was written to a store that is behind (`Enqueued::Accepted::store_behind`): the publisher
    /// waits for `Store::caught_up` before sending more.
    pub store_behind: bool,
}

impl PublishOutcome {
    /// What queue `q` answered to the message, added in.
    fn took(&mut self, q: &Arc<Queue>, enqueued: Enqueued) {
        match enqueued {
            Enqueued::Accepted { ticket, slow_publishers, store_behind } => {
                q.stats.published();
                self.store_behind |= store_behind;
                if let Some(t) = ticket {
                    self.ticket = Some(self.ticket.map_or(t, |o| o.max(t)));
                }
                if slow_publishers && self.slow_queue.is_none() {
                    self.slow_queue = Some(q.clone());
                }
            }
            Enqueued::Rejected => self.rejected = true,
        }
    }
}

pub struct QueueDeclare<'a> {
    pub name: &'a str,
    pub passive: bool,
    pub durable: bool,
    pub exclusive: bool,
    pub auto_delete: bool,
    pub arguments: &'a FieldTable,
    pub connection_id: u64,
}

pub struct ExchangeDeclare<'a> {
    pub name: &'a str,
    pub kind: &'a str,
    pub passive: bool,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: &'a FieldTable,
}

pub struct VHost {
    pub name: String,
    exchanges: RwLock<HashMap<String, Arc<Exchange>>>,
    queues: RwLock<HashMap<String, Arc<Queue>>>,
    /// `queues` as the housekeeping tick walks them, rebuilt after the set changed (`queues_changed`):
    /// collecting 1,000 queues every 100 ms was ~10% of an idle node's CPU.
    ticked: Mutex<Option<Arc<TickLists>>>,
    /// `queues` by id, rebuilt at the first lookup after the set changed (`queues_changed`): the
    /// delay timer finds the queues a due message was routed to by id.
    by_id: Mutex<Option<Arc<HashMap<u64, Arc<Queue>>>>>,
    /// The second (of `now_ms`) in which quorum queues were last ticked.
    quorum_ticked_second: AtomicU64,
    /// Queues to delete whose deletion did not go through yet (the metadata group did not commit
    /// it, `make_durable`): an auto-delete or expired queue, an exclusive queue whose owner is gone,
    /// a transient queue of an earlier run of this node. The tick retries them once a second.
    doomed: Mutex<Vec<Arc<Queue>>>,
    /// The second (of `now_ms`) in which `doomed` was last tried.
    doomed_tried_second: AtomicU64,
    /// Serialises changes to the topology, including their durable write to the metadata log.
    topology: Mutex<()>,
    store: Store,
    metadata: Arc<Metadata>,
    /// The next durable queue's id (the metadata log records it; transient ids come from
    /// `NEXT_TRANSIENT_QUEUE_ID`).
    next_queue_id: Arc<AtomicU64>,
    /// Dead letters waiting to be re-published (see `dead_letter`).
    dead_letters: DeadLetterWork,
    /// Confirms of at-least-once dead letters' re-publishes (`crate::deadletter_confirms`).
    dead_letter_confirms: Arc<crate::deadletter_confirms::DeadLetterConfirms>,
    me: Weak<VHost>,
    /// Direct reply-to consumers (`amq.rabbitmq.reply-to`).
    pub replies: Arc<ReplyConsumers>,
    /// The node's quorum-queue runtime (`queue::quorum`).
    quorum: Arc<QuorumRuntime>,
    /// The node's delayed messages (`crate::delay`), for delayed exchanges.
    delays: Arc<Delays>,
}

/// Dead letters a caller re-publishes before handing the rest to a task (see `VHost::dead_letter`).
const DEAD_LETTERS_PER_TURN: usize = 1024;

pub use crate::queue::TRANSIENT_QUEUE_IDS;
static NEXT_TRANSIENT_QUEUE_ID: AtomicU64 = AtomicU64::new(TRANSIENT_QUEUE_IDS);

const DEFAULT_EXCHANGES: &[(&str, ExchangeKind)] = &[
    ("", ExchangeKind::Direct),
    ("amq.direct", ExchangeKind::Direct),
    ("amq.fanout", ExchangeKind::Fanout),
    ("amq.topic", ExchangeKind::Topic),
    ("amq.headers", ExchangeKind::Headers),
    ("amq.match", ExchangeKind::Headers),
];

impl VHost {
    pub fn new(name: String, store: Store, metadata: Arc<Metadata>, next_queue_id: Arc<AtomicU64>, quorum: Arc<QuorumRuntime>, delays: Arc<Delays>) -> Arc<VHost> {
        let confirms = crate::deadletter_confirms::DeadLetterConfirms::new(store.clone());
        let vhost = Arc::new_cyclic(|me| VHost {
            name,
            exchanges: RwLock::new(HashMap::new()),
            queues: RwLock::new(HashMap::new()),
            ticked: Mutex::new(None),
            by_id: Mutex::new(None),
            quorum_ticked_second: AtomicU64::new(0),
            doomed: Mutex::new(Vec::new()),
            doomed_tried_second: AtomicU64::new(0),
            topology: Mutex::new(()),
            store,
            metadata,
            next_queue_id,
            dead_letters: DeadLetterWork::default(),
            dead_letter_confirms: confirms,
            me: me.clone(),
            replies: Arc::new(ReplyConsumers::new(quorum.clone())),
            quorum,
            delays,
        });
        {
            let mut exchanges = vhost.exchanges.write();
            for (name, kind) in DEFAULT_EXCHANGES {
                exchanges.insert(
                    name.to_string(),
                    Exchange::new(name.to_string(), *kind, false, true, false, false, FieldTable::new()),
                );
            }
        }
        vhost
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    fn no_exchange(&self, name: &str) -> BrokerError {
        BrokerError::not_found(format!("no exchange '{name}' in vhost '{}'", self.name))
    }

    fn no_queue(&self, name: &str) -> BrokerError {
        BrokerError::not_found(format!("no queue '{name}' in vhost '{}'", self.name))
    }

    /// Looks an exchange up; in a cluster, a miss first waits until this node has applied what the
    /// metadata group committed (a declare another node just confirmed), then looks again.
    pub fn exchange(&self, name: &str) -> Result<Arc<Exchange>> {
        self.find_exchange_caught_up(name).ok_or_else(|| self.no_exchange(name))
    }

    /// The exchange a basic.publish to `name` goes through: 404 if there is none, 403 if internal.
    /// (Also checked when a transaction buffers the publish, so that a bad one fails the
    /// transaction when it is made, as in RabbitMQ, not after its earlier publishes went out.)
    pub fn publishable_exchange(&self, name: &str) -> Result<Arc<Exchange>> {
        let ex = self.exchange(name)?;
        if ex.internal {
            return Err(BrokerError::access_refused(format!("cannot publish to internal exchange '{name}' in vhost '{}'", self.name)));
        }
        Ok(ex)
    }

    /// The exchange as this node knows it now (no waiting).
    fn find_exchange(&self, name: &str) -> Option<Arc<Exchange>> {
        self.exchanges.read().get(name).cloned()
    }

    fn find_exchange_caught_up(&self, name: &str) -> Option<Arc<Exchange>> {
        self.find_exchange(name).or_else(|| if self.metadata.catch_up() { self.find_exchange(name) } else { None })
    }

    fn find_queue(&self, name: &str) -> Option<Arc<Queue>> {
        self.queues.read().get(name).cloned()
    }

    /// [`VHost::find_queue`]; in a cluster a miss waits for the metadata group first (see `exchange`).
    fn find_queue_caught_up(&self, name: &str) -> Option<Arc<Queue>> {
        self.find_queue(name).or_else(|| if self.metadata.catch_up() { self.find_queue(name) } else { None })
    }

    pub fn exchanges(&self) -> Vec<Arc<Exchange>> {
        self.exchanges.read().values().cloned().collect()
    }

    pub fn queues(&self) -> Vec<Arc<Queue>> {
        self.queues.read().values().cloned().collect()
    }

    /// Adds `queue` to the vhost's queues under `name` (replacing one of that name).
    fn insert_queue(&self, name: String, queue: Arc<Queue>) {
        self.queues.write().insert(name, queue);
        self.queues_changed();
    }

    /// A queue was added or removed: the tick's list is rebuilt at the next tick (a tick that
    /// took the list before still walks the old one: a new queue waits a tick, a removed one,
    /// marked deleted, does nothing when ticked).
    fn queues_changed(&self) {
        *self.ticked.lock() = None;
        *self.by_id.lock() = None;
    }

    /// The vhost's queue with store id `id` (its first lane's), if any.
    pub fn queue_by_id(&self, id: u64) -> Option<Arc<Queue>> {
        let map = self
            .by_id
            .lock()
            .get_or_insert_with(|| Arc::new(self.queues.read().values().map(|q| (q.id, q.clone())).collect()))
            .clone();
        map.get(&id).cloned()
    }

    /// Looks a queue up whoever owns it (restoring bindings, other nodes' requests): no 405.
    pub fn queue_any(&self, name: &str) -> Option<Arc<Queue>> {
        self.find_queue(name)
    }

    /// Looks a queue up for `connection_id`, refusing another connection's exclusive queue (405).
    pub fn queue(&self, name: &str, connection_id: u64) -> Result<Arc<Queue>> {
        let queue = self.find_queue_caught_up(name).ok_or_else(|| self.no_queue(name))?;
        self.check_exclusive(&queue, connection_id)?;
        Ok(queue)
    }

    fn check_exclusive(&self, queue: &Queue, connection_id: u64) -> Result<()> {
        match queue.exclusive_owner {
            Some(owner) if owner != Owner::here(connection_id) => Err(BrokerError::resource_locked(format!(
                "cannot obtain exclusive access to locked queue '{}' in vhost '{}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration.",
                queue.name, self.name
            ))),
            _ => Ok(()),
        }
    }

    // ---- exchanges ----------------------------------------------------------------------

    pub fn exchange_declare(&self, d: &ExchangeDeclare) -> Result<()> {
        let _topology = self.lock_topology();
        if let Some(existing) = self.find_exchange_caught_up(d.name) {
            if d.passive {
                return Ok(());
            }
            return self.check_exchange_equivalence(&existing, d);
        }
        if d.passive {
            return Err(self.no_exchange(d.name));
        }
        if d.name.starts_with("amq.") {
            return Err(BrokerError::access_refused(format!(
                "exchange name '{}' contains reserved prefix 'amq.*'",
                d.name
            )));
        }
        let (kind, delayed) = ExchangeKind::parse_declared(d.kind, d.arguments)?;
        let exchange = Exchange::new(d.name.to_string(), kind, delayed, d.durable, d.auto_delete, d.internal, d.arguments.clone());
        if d.durable {
            // Made in memory by `apply_committed`, as every node of a cluster makes it.
            let op = Op::ExchangeDeclared { vhost: self.name.clone(), exchange: exchange.def() };
            if self.make_durable(vec![op], || format!("the declaration of exchange '{}'", d.name))? == Durable::Conflict {
                // Another node's declaration of the name came first: answer as if it had existed.
                return match self.find_exchange(d.name) {
                    Some(existing) => self.check_exchange_equivalence(&existing, d),
                    None => Err(self.deleted_meanwhile("exchange", d.name)),
                };
            }
            return Ok(());
        }
        self.exchanges.write().insert(d.name.to_string(), exchange);
        Ok(())
    }

    /// A re-declaration must match the exchange (406 naming the first difference, as RabbitMQ).
    fn check_exchange_equivalence(&self, existing: &Exchange, d: &ExchangeDeclare) -> Result<()> {
        let (received, delayed) = ExchangeKind::parse_declared(d.kind, d.arguments)?;
        let inequivalent = |arg: &str, got: String, cur: String| {
            BrokerError::precondition_failed(format!(
                "inequivalent arg '{arg}' for exchange '{}' in vhost '{}': received '{got}' but current is '{cur}'",
                d.name, self.name
            ))
        };
        if received != existing.kind || delayed != existing.delayed {
            return Err(inequivalent("type", d.kind.to_string(), existing.type_name().to_string()));
        }
        if d.durable != existing.durable {
            return Err(inequivalent("durable", d.durable.to_string(), existing.durable.to_string()));
        }
        if d.auto_delete != existing.auto_delete {
            return Err(inequivalent("auto_delete", d.auto_delete.to_string(), existing.auto_delete.to_string()));
        }
        if d.internal != existing.internal {
            return Err(inequivalent("internal", d.internal.to_string(), existing.internal.to_string()));
        }
        if let Some(arg) = first_difference(d.arguments, &existing.arguments, &["alternate-exchange"]) {
            return Err(BrokerError::precondition_failed(format!(
                "inequivalent arg '{arg}' for exchange '{}' in vhost '{}'",
                d.name, self.name
            )));
        }
        Ok(())
    }

    /// A declaration that lost to another node's (`Durable::Conflict`) whose queue or exchange was
    /// deleted before this node looked at it.
    fn deleted_meanwhile(&self, kind: &str, name: &str) -> BrokerError {
        BrokerError::precondition_failed(format!(
            "{kind} '{name}' in vhost '{}' was declared at the same time on another node with other properties, then deleted",
            self.name
        ))
    }

    pub fn exchange_delete(&self, name: &str, if_unused: bool) -> Result<()> {
        let _topology = self.lock_topology();
        if name.is_empty() || name.starts_with("amq.") {
            return Err(BrokerError::access_refused(format!(
                "operation not permitted on the default exchange '{name}' in vhost '{}'",
                self.name
            )));
        }
        let exchange = self.exchange(name)?;
        if if_unused && exchange.has_bindings() {
            return Err(BrokerError::precondition_failed(format!(
                "exchange '{name}' in vhost '{}' in use",
                self.name
            )));
        }
        if exchange.durable {
            let op = Op::ExchangeDeleted { vhost: self.name.clone(), name: name.to_string() };
            self.make_durable(vec![op], || format!("the deletion of exchange '{name}'"))?;
            return Ok(());
        }
        self.remove_exchange_locked(&exchange);
        Ok(())
    }

    fn remove_exchange_locked(&self, exchange: &Arc<Exchange>) {
        {
            let mut exchanges = self.exchanges.write();
            if exchanges.get(&exchange.name).is_some_and(|e| Arc::ptr_eq(e, exchange)) {
                exchanges.remove(&exchange.name);
            }
        }
        let dest = Destination::Exchange(exchange.clone());
        for other in self.exchanges() {
            other.unbind_destination(&dest);
        }
    }

    pub fn exchange_bind(&self, destination: &str, source: &str, routing_key: &str, arguments: &FieldTable) -> Result<()> {
        let _topology = self.lock_topology();
        self.check_bindable_source(source)?;
        let src = self.exchange(source)?;
        let dst = self.exchange(destination)?;
        let binding = Binding { destination: Destination::Exchange(dst), routing_key: routing_key.to_string(), arguments: arguments.clone() };
        self.bind_locked(&src, binding)
    }

    pub fn exchange_unbind(&self, destination: &str, source: &str, routing_key: &str, arguments: &FieldTable) -> Result<()> {
        let _topology = self.lock_topology();
        self.check_bindable_source(source)?;
        let src = self.exchange(source)?;
        let dst = self.exchange(destination)?;
        let binding = Binding { destination: Destination::Exchange(dst), routing_key: routing_key.to_string(), arguments: arguments.clone() };
        self.unbind_locked(&src, &binding)
    }

    fn check_bindable_source(&self, source: &str) -> Result<()> {
        if source.is_empty() {
            return Err(BrokerError::access_refused(format!(
                "operation not permitted on the default exchange in vhost '{}'",
                self.name
            )));
        }
        Ok(())
    }

    /// Adds a binding, durably first if both ends are durable. Binding twice is a no-op.
    fn bind_locked(&self, src: &Arc<Exchange>, binding: Binding) -> Result<()> {
        if src.has_binding(&binding) {
            return Ok(());
        }
        if src.durable && binding.destination.recorded() {
            let op = Op::Bound { vhost: self.name.clone(), binding: binding.def(&src.name) };
            self.make_durable(vec![op], || format!("the binding of '{}' to exchange '{}'", binding.destination.name(), src.name))?;
            return Ok(());
        }
        src.bind(binding);
        Ok(())
    }

    /// Removes a binding; an auto-delete exchange goes with its last binding (in the same
    /// durable change).
    fn unbind_locked(&self, src: &Arc<Exchange>, binding: &Binding) -> Result<()> {
        if !src.has_binding(binding) {
            return Ok(());
        }
        let auto_delete = src.auto_delete && src.binding_count() == 1;
        let durable_binding = src.durable && binding.destination.recorded();
        let mut ops = Vec::new();
        if durable_binding {
            ops.push(Op::Unbound { vhost: self.name.clone(), binding: binding.def(&src.name) });
        }
        if auto_delete && src.durable {
            ops.push(Op::ExchangeDeleted { vhost: self.name.clone(), name: src.name.clone() });
        }
        // The durable part is made by `apply_committed`; the node-local rest here.
        self.make_durable(ops, || format!("the unbinding of '{}' from exchange '{}'", binding.destination.name(), src.name))?;
        if !durable_binding {
            src.unbind(binding);
        }
        if auto_delete && !src.durable {
            self.remove_exchange_locked(src);
        }
        Ok(())
    }

    // ---- queues -------------------------------------------------------------------------

    /// queue.declare: returns (name, message count, consumer count).
    pub fn queue_declare(&self, d: &QueueDeclare) -> Result<(String, u32, u32)> {
        let (name, messages, consumers) = self.declare_queue_locked(d)?;
        // A classic queue living on another node: its counts are the home's, asked once the
        // topology lock is released (the home may be slow to answer, or down).
        let (messages, consumers) = self.find_queue(&name).and_then(|q| q.home_counts()).unwrap_or((messages, consumers));
        Ok((name, messages, consumers))
    }

    fn declare_queue_locked(&self, d: &QueueDeclare) -> Result<(String, u32, u32)> {
        if direct_reply::is_reply_name(d.name) {
            return self.replies.declare(d.name, &self.name);
        }
        let _topology = self.lock_topology();
        if !d.name.is_empty() {
            if let Some(existing) = self.find_queue_caught_up(d.name) {
                // A transient queue of this node's earlier run not yet deleted (`doom`): deleted now,
                // and declared anew, as if it had gone with that run.
                if !self.ended_here(&existing) || self.remove_queue_locked(&existing).is_err() {
                    return self.declare_existing(&existing, d);
                }
            }
            if d.passive {
                return Err(self.no_queue(d.name));
            }
            if d.name.starts_with("amq.") {
                return Err(BrokerError::access_refused(format!(
                    "queue name '{}' contains reserved prefix 'amq.*'",
                    d.name
                )));
            }
        } else if d.passive {
            return Err(self.no_queue(d.name));
        }
        let name = if d.name.is_empty() { generated_name("amq.gen-") } else { d.name.to_string() };
        let args = QueueArgs::parse(&name, &self.name, d.arguments)?;
        if args.queue_type == QueueType::Quorum {
            return self.declare_quorum(name, d);
        }
        // Exclusive queues live and die with their connection, so they are never durable.
        let durable = d.durable && !d.exclusive;
        // A priority queue takes one store queue id per level (see `lane`).
        let ids = 1 + args.max_priority as u64;
        if !durable && self.metadata.is_replicated() {
            // In a cluster a transient queue is recorded too, living on this node: every node
            // routes to it, and refuses another connection's use of an exclusive one (405).
            let home = Some(self.quorum.node()).filter(|n| *n != 0);
            let transient = TransientDef { run: crate::run_id(), exclusive: d.exclusive.then_some(d.connection_id) };
            let queue = QueueDef { name: name.clone(), id: 0, auto_delete: d.auto_delete, arguments: table_to_json(d.arguments), home, members: None, leader: None, members_changed: false, transient: Some(transient) };
            let op = Op::QueueDeclared { vhost: self.name.clone(), queue };
            return self.declare_durable_queue(op, name, d);
        }
        if durable {
            // Made in memory by `apply_committed`, as every node of a cluster makes it.
            // In a cluster it lives on this node, whose client declared it (`queue::remote`).
            let home = self.metadata.is_replicated().then(|| self.quorum.node()).filter(|n| *n != 0);
            let queue = QueueDef { name: name.clone(), id: self.new_durable_queue_id(ids), auto_delete: d.auto_delete, arguments: table_to_json(d.arguments), home, members: None, leader: None, members_changed: false, transient: None };
            let op = Op::QueueDeclared { vhost: self.name.clone(), queue };
            return self.declare_durable_queue(op, name, d);
        }
        let id = NEXT_TRANSIENT_QUEUE_ID.fetch_add(ids, Ordering::Relaxed);
        let queue = Queue::new(
            name.clone(),
            id,
            durable,
            d.exclusive.then_some(Owner::here(d.connection_id)),
            d.auto_delete,
            d.arguments.clone(),
            args,
            self.me.clone(),
            self.store.clone(),
            crate::now_ms(),
            None,
        );
        if queue.args.retention_ms > 0 {
            for store_id in queue.store_ids() {
                self.store.set_retention(store_id, queue.args.retention_ms);
            }
        }
        // Every queue is bound to the default exchange by its name (routing does that directly).
        self.insert_queue(name.clone(), queue.clone());
        Ok((name, 0, 0))
    }

    /// Declares a quorum queue: durable, neither exclusive nor auto-delete (406 otherwise, as
    /// RabbitMQ); recorded in the metadata log, then its Raft group is started by the node's quorum
    /// host (declare-ok does not wait for the group: publishes wait for it in the replica).
    fn declare_quorum(&self, name: String, d: &QueueDeclare) -> Result<(String, u32, u32)> {
        let invalid = |property: &str, why: &str| {
            BrokerError::precondition_failed(format!(
                "invalid property '{property}' for queue '{name}' in vhost '{}': {why}",
                self.name
            ))
        };
        if !d.durable {
            return Err(invalid("non-durable", "a quorum queue is always durable; declare it with durable=true"));
        }
        if d.exclusive {
            return Err(invalid("exclusive-owner", "a quorum queue cannot be exclusive; declare it with exclusive=false"));
        }
        if d.auto_delete {
            return Err(invalid("auto-delete", "a quorum queue cannot be auto-delete; declare it with auto_delete=false"));
        }
        if self.quorum.host().is_none() {
            return Err(BrokerError::precondition_failed(format!(
                "queue '{name}' in vhost '{}' cannot be a quorum queue: this node runs no Raft groups",
                self.name
            )));
        }
        // Made in memory, and its group started, by `apply_committed` (`restore_queue`). In a
        // cluster its members are chosen here, once, and recorded with it.
        let id = self.new_durable_queue_id(1);
        let args = QueueArgs::parse(&name, &self.name, d.arguments)?;
        let placement = self.quorum.host().and_then(|h| h.placement(id, args.quorum_initial_group_size, args.leader_locator.unwrap_or_default()));
        let (members, leader) = placement.map_or((None, None), |(members, leader)| (Some(members), leader));
        let queue = QueueDef { name: name.clone(), id, auto_delete: false, arguments: table_to_json(d.arguments), home: None, members, leader, members_changed: false, transient: None };
        let op = Op::QueueDeclared { vhost: self.name.clone(), queue };
        self.declare_durable_queue(op, name, d)
    }

    /// Makes a queue's declaration durable. In a cluster, another node's declaration of the name
    /// may have come first in the metadata group (this one is then dropped): answered as if the
    /// queue had existed, so a declaration with other properties gets 406, as in RabbitMQ.
    fn declare_durable_queue(&self, op: Op, name: String, d: &QueueDeclare) -> Result<(String, u32, u32)> {
        if self.make_durable(vec![op], || format!("the declaration of queue '{name}'"))? == Durable::Conflict {
            return match self.find_queue(&name) {
                Some(existing) => self.declare_existing(&existing, d),
                None => Err(self.deleted_meanwhile("queue", &name)),
            };
        }
        Ok((name, 0, 0))
    }

    /// queue.declare of a queue that exists: its counts, if the declaration matches it.
    fn declare_existing(&self, existing: &Arc<Queue>, d: &QueueDeclare) -> Result<(String, u32, u32)> {
        self.check_exclusive(existing, d.connection_id)?;
        if !d.passive {
            self.check_queue_equivalence(existing, d)?;
        }
        existing.touch(crate::now_ms());
        Ok((existing.name.clone(), existing.message_count(), existing.consumer_count()))
    }

    fn check_queue_equivalence(&self, existing: &Queue, d: &QueueDeclare) -> Result<()> {
        let inequivalent = |arg: &str, got: bool, cur: bool| {
            BrokerError::precondition_failed(format!(
                "inequivalent arg '{arg}' for queue '{}' in vhost '{}': received '{got}' but current is '{cur}'",
                existing.name, self.name
            ))
        };
        let existing_durable = existing.durable || existing.exclusive_owner.is_some() && d.durable;
        if d.durable != existing_durable {
            return Err(inequivalent("durable", d.durable, existing.durable));
        }
        if d.exclusive != existing.exclusive_owner.is_some() {
            return Err(inequivalent("exclusive", d.exclusive, existing.exclusive_owner.is_some()));
        }
        if d.auto_delete != existing.auto_delete {
            return Err(inequivalent("auto_delete", d.auto_delete, existing.auto_delete));
        }
        if let Some(arg) = first_difference(d.arguments, &existing.arguments, EQUIVALENCE_KEYS) {
            return Err(BrokerError::precondition_failed(format!(
                "inequivalent arg '{arg}' for queue '{}' in vhost '{}': received {} but current is {}",
                existing.name,
                self.name,
                describe(d.arguments.get(arg)),
                describe(existing.arguments.get(arg)),
            )));
        }
        Ok(())
    }

    pub fn queue_bind(&self, queue: &str, exchange: &str, routing_key: &str, arguments: &FieldTable, connection_id: u64) -> Result<()> {
        let _topology = self.lock_topology();
        self.check_bindable_source(exchange)?;
        let q = self.queue(queue, connection_id)?;
        let src = self.exchange(exchange)?;
        let binding = Binding { destination: Destination::Queue(q), routing_key: routing_key.to_string(), arguments: arguments.clone() };
        self.bind_locked(&src, binding)
    }

    pub fn queue_unbind(&self, queue: &str, exchange: &str, routing_key: &str, arguments: &FieldTable, connection_id: u64) -> Result<()> {
        let _topology = self.lock_topology();
        self.check_bindable_source(exchange)?;
        let q = self.queue(queue, connection_id)?;
        let src = self.exchange(exchange)?;
        let binding = Binding { destination: Destination::Queue(q), routing_key: routing_key.to_string(), arguments: arguments.clone() };
        self.unbind_locked(&src, &binding)
    }

    pub fn queue_purge(&self, queue: &str, connection_id: u64) -> Result<u32> {
        self.queue(queue, connection_id)?.purge()
    }

    /// queue.delete: returns the number of messages deleted.
    pub fn queue_delete(&self, name: &str, if_unused: bool, if_empty: bool, connection_id: u64) -> Result<u32> {
        let _topology = self.lock_topology();
        let queue = match self.find_queue_caught_up(name) {
            Some(q) => q,
            // RabbitMQ answers delete-ok for a queue that does not exist.
            None => return Ok(0),
        };
        self.check_exclusive(&queue, connection_id)?;
        if if_unused || if_empty {
            // Only a classic queue's home knows whether it is in use or empty.
            queue.check_home("delete it with if-unused or if-empty")?;
        }
        if if_unused && queue.consumer_count() > 0 {
            return Err(BrokerError::precondition_failed(format!("queue '{name}' in vhost '{}' in use", self.name)));
        }
        if if_empty && queue.message_count() > 0 {
            return Err(BrokerError::precondition_failed(format!("queue '{name}' in vhost '{}' is not empty", self.name)));
        }
        self.remove_queue_locked(&queue)
    }

    /// Deletes a queue without the client-facing checks (auto-delete, x-expires, exclusive owner
    /// gone). If its deletion cannot be made durable now, the tick retries it (`doomed`).
    pub fn delete_queue_unchecked(&self, name: &str) {
        // Bind first: a read guard held by `if let` would deadlock with the write in remove_queue_locked.
        let queue = self.queues.read().get(name).cloned();
        if let Some(queue) = queue {
            if !self.delete_doomed(&queue) {
                self.doom(&queue);
            }
        }
    }

    /// Deletes `queue` (that one: not another of its name declared since). Whether it is gone.
    fn delete_doomed(&self, queue: &Arc<Queue>) -> bool {
        let _topology = self.lock_topology();
        if !self.find_queue(&queue.name).is_some_and(|q| Arc::ptr_eq(&q, queue)) {
            return true;
        }
        // A failure is logged by make_durable.
        self.remove_queue_locked(queue).is_ok()
    }

    /// Deletes `queue` at the next tick, and retries until it is gone (also: an expired quorum queue
    /// its leader finds not deleted).
    pub(crate) fn doom(&self, queue: &Arc<Queue>) {
        let mut doomed = self.doomed.lock();
        if !doomed.iter().any(|q| Arc::ptr_eq(q, queue)) {
            doomed.push(queue.clone());
        }
    }

    /// Tries the deletions that did not go through yet (`doomed`), once a second.
    fn retry_doomed(&self, now_ms: u64) {
        let second = now_ms / 1000;
        if self.doomed.lock().is_empty() || self.doomed_tried_second.swap(second, Ordering::Relaxed) == second {
            return;
        }
        let doomed = std::mem::take(&mut *self.doomed.lock());
        for queue in doomed {
            if self.delete_doomed(&queue) {
                tracing::info!(queue = %queue.name, vhost = %self.name, "deleted a queue whose deletion had not gone through");
            } else {
                self.doom(&queue);
            }
        }
    }

    /// Whether `queue` is a transient queue of an earlier run of this node (it ended with that run).
    fn ended_here(&self, queue: &Queue) -> bool {
        queue.transient_def().is_some_and(|t| t.run != crate::run_id()) && queue.home_node() == Some(self.quorum.node())
    }

    /// This node's transient queues of an earlier run (they ended with it) go, once the node's id is
    /// known (`Broker::set_quorum_host`): a transient queue lives as long as its node's run.
    pub fn doom_ended_transients(&self) {
        for queue in self.queues() {
            if self.ended_here(&queue) {
                self.doom(&queue);
            }
        }
    }

    /// Deletes a queue, its bindings, and the auto-delete exchanges that lose their last binding
    /// with it: one durable change first, then in memory, then its messages in the store.
    fn remove_queue_locked(&self, queue: &Arc<Queue>) -> Result<u32> {
        let dest = Destination::Queue(queue.clone());
        let exchanges = self.exchanges();
        let auto_deleted: Vec<Arc<Exchange>> =
            exchanges.iter().filter(|ex| ex.auto_delete && ex.only_bound_to(&dest)).cloned().collect();
        let mut ops = Vec::new();
        if queue.recorded() {
            ops.push(Op::QueueDeleted { vhost: self.name.clone(), name: queue.name.clone(), id: queue.id });
        }
        for ex in auto_deleted.iter().filter(|ex| ex.durable) {
            ops.push(Op::ExchangeDeleted { vhost: self.name.clone(), name: ex.name.clone() });
        }
        let count = queue.message_count();
        // The durable part is made by `apply_committed`; the node-local rest here.
        self.make_durable(ops, || format!("the deletion of queue '{}'", queue.name))?;
        let count = if queue.recorded() { count } else { self.drop_queue(queue) };
        for ex in auto_deleted.iter().filter(|ex| !ex.durable) {
            self.remove_exchange_locked(ex);
        }
        Ok(count)
    }

    /// Removes a queue from the vhost and its bindings, and deletes its messages.
    fn drop_queue(&self, queue: &Arc<Queue>) -> u32 {
        {
            let mut queues = self.queues.write();
            if queues.get(&queue.name).is_some_and(|q| Arc::ptr_eq(q, queue)) {
                queues.remove(&queue.name);
            }
        }
        self.queues_changed();
        let dest = Destination::Queue(queue.clone());
        for ex in self.exchanges() {
            ex.unbind_destination(&dest);
        }
        queue.mark_deleted()
    }

    /// A connection closed: its exclusive queues go with it.
    pub fn connection_closed(&self, connection_id: u64) {
        let owned: Vec<String> = self
            .queues
            .read()
            .values()
            .filter(|q| q.exclusive_owner == Some(Owner::here(connection_id)))
            .map(|q| q.name.clone())
            .collect();
        for name in owned {
            self.delete_queue_unchecked(&name);
        }
    }

    /// Writes what queues deferred (see `Queue::publish`); on shutdown.
    pub fn store_deferred(&self) {
        for q in self.queues() {
            q.store_lazy();
        }
    }

    /// Housekeeping (`Broker::tick`, every 100 ms): message TTL and queue expiry (`x-expires`),
    /// classic queues every time, quorum queues once a second ([`TickLists`]).
    pub fn tick(&self, now_ms: u64) {
        let lists = self
            .ticked
            .lock()
            .get_or_insert_with(|| {
                let (quorum, classic) = self.queues().into_iter().partition(|q| q.is_quorum());
                Arc::new(TickLists { classic, quorum })
            })
            .clone();
        let second = now_ms / 1000;
        let quorum_due = self.quorum_ticked_second.swap(second, Ordering::Relaxed) != second;
        let quorum: &[Arc<Queue>] = if quorum_due { &lists.quorum } else { &[] };
        for q in lists.classic.iter().chain(quorum) {
            if q.tick(now_ms) {
                tracing::info!(queue = %q.name, vhost = %self.name, "deleting queue unused for longer than its x-expires");
                self.delete_queue_unchecked(&q.name);
            }
        }
        self.retry_doomed(now_ms);
    }

    // ---- publishing ---------------------------------------------------------------------

    /// Routes a message and offers it to every queue it reaches.
    /// `confirmed`: the publisher waits for the message to be durable (publisher confirms or a
    /// transaction); if not, queues may defer writing it (see `Queue::publish`).
    pub fn publish(&self, exchange: &str, message: Message, confirmed: bool) -> Result<PublishOutcome> {
        self.publish_by(exchange, message, confirmed, None)
    }

    /// [`VHost::publish`] by a connection's publisher session (`crate::publisher`): quorum queues the
    /// message reaches tell the session once their group applied (or refused) it, and the confirm
    /// waits for that as well as for the store ticket of the classic queues it reached.
    pub fn publish_by(&self, exchange: &str, message: Message, confirmed: bool, publisher: Option<Publisher>) -> Result<PublishOutcome> {
        self.publish_routed(exchange, message, confirmed, publisher, None)
    }

    /// Routes a message through `exchange` now and holds it for `delay_ms` before its queues get it
    /// (whatever the exchange's type): CMQ's `delaySeconds`. Durable once the ticket is, and once
    /// `publisher`'s session has it resolved (quorum queues).
    pub fn publish_delayed(&self, exchange: &str, message: Message, delay_ms: u64, publisher: Option<Publisher>) -> Result<PublishOutcome> {
        self.publish_routed(exchange, message, true, publisher, Some(delay_ms))
    }

    fn publish_routed(&self, exchange: &str, message: Message, confirmed: bool, publisher: Option<Publisher>, delay_ms: Option<u64>) -> Result<PublishOutcome> {
        let ex = self.publishable_exchange(exchange)?;
        if ex.name.is_empty() && message.routing_key.starts_with(direct_reply::PREFIX) {
            // A direct reply: straight to the waiting channel, no queue; on its node, if that is
            // another (a reply to a consumer gone there is dropped there, and not returned here).
            if let (Some(node), Some(host)) = (self.replies.elsewhere(&message.routing_key), self.quorum.host()) {
                let request = crate::queue::remote::wire::Request::Reply { vhost: self.name.clone(), message: crate::message::encode_stored(&message, None) };
                host.classic_request(node, request.encode(), Box::new(move |answer| {
                    if let Err(e) = answer {
                        tracing::debug!(node, error = %e, "a direct reply to a consumer on another node was not delivered");
                    }
                }));
                return Ok(PublishOutcome { routed: true, ..Default::default() });
            }
            let routed = self.replies.deliver(Arc::new(message));
            return Ok(PublishOutcome { routed, ..Default::default() });
        }
        let mut queues = Vec::new();
        self.route(&ex, &message, &mut queues);
        // In a cluster, a binding or queue another node just confirmed may not be applied here yet.
        if queues.is_empty() && self.metadata.is_replicated() && self.metadata.catch_up() {
            self.route(&ex, &message, &mut queues);
        }
        use crate::stats::Counter;
        crate::stats::add(if queues.is_empty() { Counter::Unroutable } else { Counter::Routed }, 1);
        let delay_ms = delay_ms.or_else(|| ex.delayed.then(|| crate::delay::record::requested_delay(&message)).flatten().map(|d| d as u64));
        if let Some(delay_ms) = delay_ms.filter(|d| *d > 0) {
            return self.hold_delayed(message, &queues, delay_ms, publisher);
        }
        self.deliver_to_queues(Arc::new(message), &queues, !confirmed, publisher)
    }

    /// A message a delayed exchange routed, with a positive `x-delay`: held until due, durable
    /// (and confirmed) as any persistent message. Routed now: mandatory and returns work as usual.
    /// A quorum queue's group holds it (replicated: it survives the loss of any minority of the
    /// group's nodes, this one included); for classic queues the node's delay store does
    /// (`crate::delay`).
    fn hold_delayed(&self, message: Message, queues: &[Arc<Queue>], delay_ms: u64, publisher: Option<Publisher>) -> Result<PublishOutcome> {
        let mut outcome = PublishOutcome { routed: !queues.is_empty(), ..Default::default() };
        if queues.is_empty() {
            return Ok(outcome);
        }
        crate::delay::check_delay(delay_ms)?;
        let now = crate::now_ms();
        // Kept as consumers get it once due (the node's delay store would negate it then).
        let mut message = message;
        crate::delay::record::negate_delay(&mut message);
        let message = Arc::new(message);
        // The classic queues' hold first: if it fails, no queue has the message.
        let held_here: Vec<u64> = queues.iter().filter(|q| !q.is_quorum()).map(|q| q.id).collect();
        if !held_here.is_empty() {
            outcome.ticket = Some(self.delays.hold(&self.name, &held_here, &message, delay_ms)?);
            outcome.store_behind = self.store.is_behind();
        }
        let mut header = BytesMut::new();
        for q in queues.iter().filter(|q| q.is_quorum()) {
            if header.is_empty() {
                encode_header(&message, Some(now), &mut header);
            }
            if let Some(enqueued) = q.publish_delayed(&message, &header, now, delay_ms, publisher) {
                outcome.took(q, enqueued?);
            }
        }
        Ok(outcome)
    }

    /// A delayed message now due, to one of the queues it was routed to: published as
    /// at-least-once dead letters are (`crate::deadletter_confirms`); `settle` is told true once the
    /// queue holds it durably, false when it refused it (full with `reject-publish`, its home node
    /// down or backed up, no majority in time) and it must be tried again.
    pub fn publish_due(&self, message: MessageRef, queue: &Arc<Queue>, settle: crate::deadletter::SettleDeadLetter) {
        let (session, seq) = self.dead_letter_confirms.publisher();
        let publisher = Publisher { session: &session, seq };
        match self.deliver_to_queues(message, std::slice::from_ref(queue), false, Some(publisher)) {
            Ok(outcome) => self.dead_letter_confirms.track(seq, outcome.ticket, outcome.rejected, settle),
            Err(e) => {
                tracing::warn!(vhost = %self.name, error = %e, "could not publish a due delayed message; trying again");
                self.dead_letter_confirms.track(seq, None, true, settle);
            }
        }
    }

    /// Delayed messages held for `queue` (`crate::delay`).
    pub fn delayed_count(&self, queue: &Queue) -> u64 {
        self.delays.count(queue.id) + queue.delayed_in_group()
    }

    fn deliver_to_queues(&self, message: MessageRef, queues: &[Arc<Queue>], lazy_ok: bool, publisher: Option<Publisher>) -> Result<PublishOutcome> {
        let mut outcome = PublishOutcome { routed: !queues.is_empty(), ..Default::default() };
        if queues.is_empty() {
            return Ok(outcome);
        }
        let now = crate::now_ms();
        // The store encoding's header, for queues that write the message to the store (persistent in a
        // durable queue, or a queue whose window is full). Small next to the body, so always built.
        let mut header = BytesMut::new();
        encode_header(&message, Some(now), &mut header);
        for q in queues {
            outcome.took(q, q.publish(&message, &header, now, lazy_ok, publisher)?);
        }
        Ok(outcome)
    }

    /// Collects the queues a message reaches from `exchange`: bindings, exchange-to-exchange
    /// bindings (each exchange visited once), and the alternate exchange when nothing matched.
    fn route(&self, exchange: &Arc<Exchange>, message: &Message, out: &mut Vec<Arc<Queue>>) {
        if exchange.name.is_empty() {
            if let Some(q) = self.queues.read().get(&message.routing_key) {
                out.push(q.clone());
            }
            return;
        }
        let to_exchanges = exchange.has_exchange_bindings();
        let headers = if exchange.kind == ExchangeKind::Headers || to_exchanges {
            PropertiesView::new(&message.properties).ok().and_then(|v| v.headers()).and_then(|r| r.ok())
        } else {
            None
        };
        if !to_exchanges && exchange.alternate.is_none() {
            // The common case: bindings to queues only, no alternate exchange; no graph walk.
            let mut dests = Vec::new();
            exchange.route(&message.routing_key, headers.as_ref(), &mut dests);
            out.extend(dests.into_iter().filter_map(|d| match d {
                Destination::Queue(q) => Some(q),
                Destination::Exchange(_) => None,
            }));
            return;
        }
        let mut visited: Vec<Arc<Exchange>> = vec![exchange.clone()];
        let mut pending: Vec<Arc<Exchange>> = vec![exchange.clone()];
        while let Some(ex) = pending.pop() {
            let mut dests = Vec::new();
            ex.route(&message.routing_key, headers.as_ref(), &mut dests);
            let mut matched = false;
            for d in dests {
                match d {
                    Destination::Queue(q) => {
                        matched = true;
                        if !out.iter().any(|o| Arc::ptr_eq(o, &q)) {
                            out.push(q);
                        }
                    }
                    Destination::Exchange(e) => {
                        matched = true;
                        if !visited.iter().any(|v| Arc::ptr_eq(v, &e)) {
                            visited.push(e.clone());
                            pending.push(e);
                        }
                    }
                }
            }
            if !matched {
                if let Some(alt) = ex.alternate.as_ref().and_then(|n| self.exchanges.read().get(n).cloned()) {
                    if !visited.iter().any(|v| Arc::ptr_eq(v, &alt)) {
                        visited.push(alt.clone());
                        pending.push(alt);
                    }
                }
            }
        }
    }

    /// Re-publishes dead letters to their dead-letter exchanges.
    ///
    /// Iterative, never recursive: a dead letter's publish can make more (a queue with TTL 0 expires
    /// it at once, to a queue that may dead-letter it again). Those join the vhost's work list, which
    /// one caller at a time works off: at most `DEAD_LETTERS_PER_TURN` here, the rest on a task that
    /// yields between turns, so a dead-letter chain or fan-out never holds a runtime thread for long.
    pub fn dead_letter(&self, letters: Vec<DeadLetter>) {
        if !self.dead_letters.push(letters) || self.dead_letters_turn() {
            return;
        }
        match (tokio::runtime::Handle::try_current(), self.me.upgrade()) {
            (Ok(rt), Some(me)) => {
                rt.spawn(async move {
                    while !me.dead_letters_turn() {
                        tokio::task::yield_now().await;
                    }
                });
            }
            // No runtime (tests, shutdown): finish here.
            _ => while !self.dead_letters_turn() {},
        }
    }

    /// Whether fewer than `deadletter::BACKLOG_LIMIT` dead letters wait to be re-published: a
    /// source that can make many at once (a quorum queue's expiry) makes more only then.
    pub fn dead_letter_room(&self) -> bool {
        self.dead_letters.has_room()
    }

    /// Calls `f` once fewer than `deadletter::BACKLOG_LIMIT` dead letters wait (now, if so).
    pub fn when_dead_letter_room(&self, f: crate::deadletter::WhenRoom) {
        self.dead_letters.when_room(f);
    }

    /// Re-publishes up to `DEAD_LETTERS_PER_TURN` waiting dead letters; true once none is left (the
    /// caller is then no longer the one working the list off).
    fn dead_letters_turn(&self) -> bool {
        for _ in 0..DEAD_LETTERS_PER_TURN {
            match self.dead_letters.next() {
                Some(letter) => self.republish_dead_letter(letter),
                None => return true,
            }
        }
        false
    }

    fn republish_dead_letter(&self, mut letter: DeadLetter) {
        let settle = letter.settle.take();
        let now_secs = crate::now_ms() / 1000;
        let Some(message) = dead_lettered_message(&letter, now_secs) else {
            // Its properties do not decode: it can never be re-published (logged there).
            if let Some(settle) = settle {
                settle(true);
            }
            return;
        };
        let Some(ex) = self.find_exchange(&letter.exchange) else {
            tracing::debug!(exchange = %letter.exchange, "dead-letter exchange does not exist; message dropped");
            // At-least-once: kept in its source until the exchange exists (as RabbitMQ).
            if let Some(settle) = settle {
                settle(false);
            }
            return;
        };
        let mut queues = Vec::new();
        self.route(&ex, &message, &mut queues);
        let routed = !queues.is_empty();
        queues.retain(|q| {
            let cycle = is_cycle(&message, letter.reason, &q.name);
            if cycle {
                tracing::debug!(queue = %q.name, from = %letter.queue, "dead letter dropped: it would go round an automatic dead-letter cycle");
            }
            !cycle
        });
        let Some(settle) = settle else {
            if let Err(e) = self.deliver_to_queues(Arc::new(message), &queues, false, None) {
                tracing::warn!(error = %e, "could not dead-letter a message");
            }
            return;
        };
        if queues.is_empty() {
            // Dropped for good by the cycle rule; or routed nowhere: kept in its source, tried again.
            settle(routed);
            return;
        }
        let (session, seq) = self.dead_letter_confirms.publisher();
        let publisher = Publisher { session: &session, seq };
        // Settled once every queue it reached answered (a classic queue that refused it, with
        // reject-publish, answered at once: then it is tried again).
        match self.deliver_to_queues(Arc::new(message), &queues, false, Some(publisher)) {
            Ok(outcome) => self.dead_letter_confirms.track(seq, outcome.ticket, outcome.rejected, settle),
            Err(e) => {
                tracing::warn!(error = %e, "could not dead-letter a message; its source keeps it and tries again");
                self.dead_letter_confirms.track(seq, None, true, settle);
            }
        }
    }

    // ---- recovery and metadata ----------------------------------------------------------

    /// Rebuilds this vhost's durable topology from the metadata log. Returns the queues by store id.
    pub fn restore_definitions(&self, defs: &VHostDefs) -> Vec<Arc<Queue>> {
        for e in &defs.exchanges {
            let arguments = table_from_json(&e.arguments);
            let Ok((kind, delayed)) = ExchangeKind::parse_declared(&e.kind, &arguments) else {
                tracing::warn!(exchange = %e.name, kind = %e.kind, "skipping exchange of unknown type in definitions");
                continue;
            };
            self.restore_exchange(Exchange::new(e.name.clone(), kind, delayed, true, e.auto_delete, e.internal, arguments));
        }
        let mut queues = Vec::new();
        for q in &defs.queues {
            queues.push(self.restore_queue(q));
        }
        for b in &defs.bindings {
            let Ok(source) = self.exchange(&b.source) else { continue };
            let destination = if b.destination_type == "queue" {
                match self.queue_any(&b.destination) {
                    Some(q) => Destination::Queue(q),
                    None => continue,
                }
            } else {
                match self.exchange(&b.destination) {
                    Ok(e) => Destination::Exchange(e),
                    Err(_) => continue,
                }
            };
            source.bind(crate::exchange::Binding { destination, routing_key: b.routing_key.clone(), arguments: table_from_json(&b.arguments) });
        }
        queues
    }

    /// Recreates a durable exchange from the metadata log.
    pub fn restore_exchange(&self, exchange: Arc<Exchange>) {
        self.exchanges.write().insert(exchange.name.clone(), exchange);
    }

    /// Recreates a durable queue from the metadata log.
    pub fn restore_queue(&self, def: &QueueDef) -> Arc<Queue> {
        let (name, id, auto_delete, home) = (def.name.clone(), def.id, def.auto_delete, def.home);
        let arguments = table_from_json(&def.arguments);
        let args = QueueArgs::parse_stored(&name, &self.name, &arguments);
        if args.queue_type == QueueType::Quorum {
            let queue = Queue::new_quorum(name.clone(), id, arguments, args, self.me.clone(), self.store.clone(), self.quorum.clone(), crate::queue::quorum::Recorded { members: def.members.clone(), leader: def.leader, members_changed: def.members_changed });
            self.insert_queue(name, queue.clone());
            // Declared now (or applied from the metadata group): its group starts at once. At a
            // start, the server starts them all once it has set the quorum host (`Broker::set_quorum_host`).
            if let Some(host) = self.quorum.host() {
                host.start(queue.clone());
            }
            return queue;
        }
        let transient = def.transient;
        let owner = transient.and_then(|t| t.exclusive.map(|connection| Owner { run: t.run, connection }));
        // In a cluster a classic queue lives on node `home` (`queue::remote`): on other nodes its
        // messages are forwarded there.
        let home = home.map(|home| crate::queue::remote::RemoteHome::new(home, self.quorum.clone()));
        let queue = Queue::new(name.clone(), id, transient.is_none(), owner, auto_delete, arguments, args, self.me.clone(), self.store.clone(), crate::now_ms(), home);
        if let Some(t) = transient {
            queue.set_transient(t);
            if self.ended_here(&queue) {
                self.doom(&queue);
            }
        }
        self.insert_queue(name, queue.clone());
        queue
    }

    /// The topology lock. Waiting for it may mean waiting for another change's fsync, so a
    /// contended wait runs as blocking work (`crate::blocking`), off the runtime's workers.
    fn lock_topology(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.topology.try_lock().unwrap_or_else(|| crate::blocking::run(|| self.topology.lock()))
    }

    /// Makes a durable change: `ops` are written to the metadata log and fsynced (standalone,
    /// `Metadata::commit`) or committed by the cluster's metadata group and applied on this node
    /// (`Metadata::commit_replicated`); either way the change is made in memory by
    /// [`VHost::apply_committed`] only once it is durable. Call under the topology lock, having
    /// checked the request. A failure is a connection error, 541 INTERNAL_ERROR, as RabbitMQ
    /// answers when its metadata store cannot commit a change.
    fn make_durable(&self, ops: Vec<Op>, what: impl FnOnce() -> String) -> Result<Durable> {
        if ops.is_empty() {
            return Ok(Durable::Made);
        }
        if self.metadata.is_replicated() {
            return match self.metadata.commit_replicated(&ops) {
                Ok(()) => Ok(Durable::Made),
                Err(GroupCommitError::Conflict) => Ok(Durable::Conflict),
                Err(GroupCommitError::NotCommitted(e)) => Err(self.not_durable(what(), e, "nothing was changed")),
                Err(GroupCommitError::Unknown(e)) => Err(self.not_durable(what(), e, "it may still take effect")),
            };
        }
        self.metadata.commit(ops.clone()).map_err(|e| {
            let what = what();
            tracing::error!(vhost = %self.name, error = %e, "could not make {what} durable; nothing was changed");
            BrokerError::internal(format!(
                "could not make {what} in vhost '{}' durable: writing the metadata log failed ({e}); nothing was changed",
                self.name
            ))
        })?;
        for op in &ops {
            self.apply_committed(op);
        }
        Ok(Durable::Made)
    }

    /// The metadata group did not commit `what` (541).
    fn not_durable(&self, what: String, why: String, outcome: &str) -> BrokerError {
        tracing::error!(vhost = %self.name, error = %why, "could not make {what} durable through the metadata group; {outcome}");
        BrokerError::internal(format!(
            "could not make {what} in vhost '{}' durable: the cluster's metadata group did not commit it ({why}); {outcome}",
            self.name
        ))
    }

    /// The id of a new durable queue taking `ids` store ids: from the node's counter when
    /// standalone; 0 in a cluster, where applying the declaration assigns it from the replicated
    /// counter (the same id on every node).
    pub fn new_durable_queue_id(&self, ids: u64) -> u64 {
        if self.metadata.is_replicated() {
            0
        } else {
            self.next_queue_id.fetch_add(ids, Ordering::Relaxed)
        }
    }

    /// Makes a durable change in memory once it is committed: the one path for this node's own
    /// changes and, in a cluster, for every node's (in the metadata group's log order). Never
    /// waits for the metadata group, never takes the topology lock (a proposer holds it while it
    /// waits for this), and takes any op: what it names may be gone already, or exist (replays).
    pub fn apply_committed(&self, op: &Op) {
        match op {
            Op::ExchangeDeclared { exchange: def, .. } => {
                if self.find_exchange(&def.name).is_some() {
                    return;
                }
                let arguments = table_from_json(&def.arguments);
                let Ok((kind, delayed)) = ExchangeKind::parse_declared(&def.kind, &arguments) else {
                    tracing::warn!(exchange = %def.name, kind = %def.kind, "not declaring an exchange of unknown type");
                    return;
                };
                let exchange = Exchange::new(def.name.clone(), kind, delayed, true, def.auto_delete, def.internal, arguments);
                self.exchanges.write().entry(def.name.clone()).or_insert(exchange);
            }
            Op::ExchangeDeleted { name, .. } => {
                if name.is_empty() || name.starts_with("amq.") {
                    return;
                }
                if let Some(ex) = self.find_exchange(name) {
                    self.remove_exchange_locked(&ex);
                }
            }
            Op::QueueDeclared { queue: def, .. } => {
                if let Some(existing) = self.find_queue(&def.name) {
                    if existing.id != def.id {
                        tracing::warn!(queue = %def.name, vhost = %self.name, id = def.id, existing = existing.id,
                            "a durable queue was declared with the name of a queue this node has; keeping this node's");
                    }
                    return;
                }
                let queue = self.restore_queue(def);
                if queue.args.retention_ms > 0 {
                    for store_id in queue.store_ids() {
                        self.store.set_retention(store_id, queue.args.retention_ms);
                    }
                }
            }
            Op::QueueDeleted { name, id, .. } => {
                if let Some(queue) = self.find_queue(name).filter(|q| q.id == *id) {
                    self.drop_queue(&queue);
                }
            }
            Op::QueueMembers { name, id, members, .. } => {
                if let Some(queue) = self.find_queue(name).filter(|q| q.id == *id) {
                    queue.set_recorded_members(members.clone());
                }
            }
            Op::Bound { binding, .. } => {
                if let Some((src, binding)) = self.resolve_binding(binding) {
                    if !src.has_binding(&binding) {
                        src.bind(binding);
                    }
                }
            }
            Op::Unbound { binding, .. } => {
                if let Some((src, binding)) = self.resolve_binding(binding) {
                    src.unbind(&binding);
                }
            }
            Op::NextQueueId { .. } | Op::GroupApplied { .. } => {}
        }
    }

    fn resolve_binding(&self, def: &BindingDef) -> Option<(Arc<Exchange>, Binding)> {
        let source = self.find_exchange(&def.source)?;
        let destination = if def.destination_type == "queue" {
            Destination::Queue(self.find_queue(&def.destination)?)
        } else {
            Destination::Exchange(self.find_exchange(&def.destination)?)
        };
        Some((source, Binding { destination, routing_key: def.routing_key.clone(), arguments: table_from_json(&def.arguments) }))
    }

    /// Makes the durable topology in memory what `defs` says (a metadata-group snapshot installed
    /// on a node that was away): durable exchanges, queues and bindings it lacks are removed (a
    /// removed queue's messages are deleted), those it adds are created. Node-local (transient)
    /// things stay.
    pub fn replace_durable(&self, defs: &VHostDefs) {
        let keep_queues: HashMap<&str, u64> = defs.queues.iter().map(|q| (q.name.as_str(), q.id)).collect();
        for queue in self.queues().into_iter().filter(|q| q.recorded()) {
            if keep_queues.get(queue.name.as_str()) != Some(&queue.id) {
                tracing::info!(queue = %queue.name, vhost = %self.name, "deleting a queue the metadata group's snapshot no longer has");
                self.drop_queue(&queue);
            }
        }
        let keep_exchanges: std::collections::HashSet<&str> = defs.exchanges.iter().map(|e| e.name.as_str()).collect();
        for ex in self.exchanges().into_iter().filter(|e| e.durable && !e.name.is_empty() && !e.name.starts_with("amq.")) {
            if !keep_exchanges.contains(ex.name.as_str()) {
                self.remove_exchange_locked(&ex);
            }
        }
        let vhost = self.name.clone();
        for exchange in &defs.exchanges {
            self.apply_committed(&Op::ExchangeDeclared { vhost: vhost.clone(), exchange: exchange.clone() });
        }
        for queue in &defs.queues {
            self.apply_committed(&Op::QueueDeclared { vhost: vhost.clone(), queue: queue.clone() });
        }
        // Durable bindings (both ends durable) the snapshot lacks go; the others are added.
        let wanted: std::collections::HashSet<String> =
            defs.bindings.iter().map(|b| serde_json::to_string(b).unwrap_or_default()).collect();
        for src in self.exchanges().into_iter().filter(|e| e.durable) {
            for b in src.bindings().into_iter().filter(|b| b.destination.recorded()) {
                if !wanted.contains(&serde_json::to_string(&b.def(&src.name)).unwrap_or_default()) {
                    src.unbind(&b);
                }
            }
        }
        for binding in &defs.bindings {
            self.apply_committed(&Op::Bound { vhost: vhost.clone(), binding: binding.clone() });
        }
    }
}

/// What a durable change came to (`VHost::make_durable`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Durable {
    Made,
    /// In a cluster: a declaration dropped by the metadata group, because another node declared
    /// the name first (earlier in the group's log) with other properties (`State::admit`). That
    /// queue or exchange exists on this node now. Only declarations conflict.
    Conflict,
}

fn describe(v: Option<&warren_protocol::field::FieldValue>) -> String {
    match v {
        None => "none".to_string(),
        Some(v) => format!("'{v:?}'"),
    }
}


impl QueueHost for VHost {
    fn host_name(&self) -> &str {
        &self.name
    }

    fn dead_letter(&self, letters: Vec<DeadLetter>) {
        VHost::dead_letter(self, letters)
    }

    fn dead_letter_room(&self) -> bool {
        VHost::dead_letter_room(self)
    }

    fn when_dead_letter_room(&self, f: crate::deadletter::WhenRoom) {
        VHost::when_dead_letter_room(self, f)
    }

    fn delete_queue_unchecked(&self, name: &str) {
        VHost::delete_queue_unchecked(self, name)
    }

    fn doom(&self, queue: &Arc<Queue>) {
        VHost::doom(self, queue)
    }
}
