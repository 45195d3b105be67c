//! A virtual host: its exchanges, queues and bindings, declaration rules, and routing of
//! published messages to queues.
//!
//! The parts: this file (the vhost's state, lookups, what queues ask of it, durable changes),
//! `declare` (exchanges, queues, bindings, deletion, the tick), `publish` (routing, delayed
//! messages, dead letters), `restore` (the topology from the metadata log).

mod declare;
mod publish;
mod restore;

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
                // The vhost was deleted while the change was on its way.
                Err(GroupCommitError::Refused(r)) => Err(BrokerError::not_found(r.text)),
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
