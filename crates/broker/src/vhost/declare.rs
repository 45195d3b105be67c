//! Declaring, binding and deleting exchanges and queues (made durable in the metadata log first),
//! and the vhost's housekeeping tick.

use super::*;

impl VHost {
    pub fn exchange_declare(&self, d: &ExchangeDeclare) -> Result<()> {
        if d.name.is_empty() && !d.passive {
            return Err(BrokerError::access_refused("operation not permitted on the default exchange"));
        }
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
        // RabbitMQ 3.10's refusals, word for word.
        if name.is_empty() {
            return Err(BrokerError::access_refused("operation not permitted on the default exchange"));
        }
        if name.starts_with("amq.") {
            return Err(BrokerError::access_refused(format!("deletion of system exchange '{name}' in vhost '{}' not allowed", self.name)));
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

    pub(super) fn remove_exchange_locked(&self, exchange: &Arc<Exchange>) {
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
            return Err(BrokerError::access_refused("operation not permitted on the default exchange"));
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
        // The vhost's `max-queues` (rabbitmqctl set_vhost_limits), counting every queue this node
        // knows in it: exact standalone; in a cluster other nodes' transient queues are not counted.
        if let Some(max) = self.metadata.vhost_limits(&self.name).max_queues {
            if self.queues.read().len() as i64 >= max {
                return Err(BrokerError::precondition_failed(format!("cannot declare queue '{name}': queue limit in vhost '{}' ({max}) is reached", self.name)));
            }
        }
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
    pub(super) fn ended_here(&self, queue: &Queue) -> bool {
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
    pub(super) fn drop_queue(&self, queue: &Arc<Queue>) -> u32 {
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

    /// The vhost was deleted (`Op::VhostDeleted`, applied): every queue in it goes with its
    /// messages, durable or not, as do its exchanges and bindings. Its connections are closed by
    /// the server (`Broker::on_auth_change`).
    pub fn drop_everything(&self) {
        for queue in self.queues() {
            self.drop_queue(&queue);
        }
        for ex in self.exchanges().into_iter().filter(|e| !e.name.is_empty() && !e.name.starts_with("amq.")) {
            self.remove_exchange_locked(&ex);
        }
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
}
