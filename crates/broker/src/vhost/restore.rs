//! The vhost's topology from the metadata log: at a start, and as the metadata group commits
//! changes.

use super::*;

impl VHost {
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
            // The broker's: vhosts themselves, users, permissions.
            _ => {}
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
