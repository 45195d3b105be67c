//! Classic queues across the nodes of a cluster, the server's side (`warren_broker::queue::remote`
//! is the broker's): answers other nodes' requests (`Rpc::Classic`) about the classic queues living
//! on this node — batches of publishes (answered once durable here), consumers relayed from other
//! nodes (relay channels), basic.gets of other nodes (a relay channel each, holding the message
//! until it is settled), purges and counts — and takes the deliveries a home pushes to consumers on
//! this node.
//! Nodes outside a quorum queue's group relay their consumers and basic.gets of it to a member the
//! same way (`warren_broker::queue::remote`); publishes, purges and counts are not asked of it.
//! Whatever a peer sends is checked: a malformed request, an unknown vhost or queue, a queue whose
//! home is not this node (or a quorum queue without a replica here) is an error answer.

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use warren_broker::channel::{AckWhenWritten, Channel, ClientSink, Consumer, Delivery, UNACKED_BYTES_LIMIT};
use warren_broker::consumers::ConsumerArgs;
use warren_broker::message::{decode_stored, encode_header, encode_stored};
use warren_broker::queue::remote::relay::incarnation_of;
use warren_broker::queue::remote::wire::{encode_flags, encode_got, encode_ids, GotMessage, QueueRef, Relayed, Request};
use warren_broker::queue::remote::{HomeStats, RequestDone, REQUEST_TIMEOUT};
use warren_broker::queue::{Enqueued, Got};
use warren_broker::{Broker, Queue};
use warren_cluster::node::ClassicService;
use warren_cluster::{ClusterNode, NodeId};

/// Relay consumers of a node unreachable this long are closed (what they hold goes back), as
/// quorum queues detach a down node's consumers.
const RELAYS_DOWN_AFTER: Duration = Duration::from_secs(5);
/// A relay's deliveries on their way to its node, at most (no-ack consumers have no prefetch).
const PUSH_BYTES: usize = 4 << 20;
/// How long a node waits to have applied a metadata entry another node's declaration waits for.
const APPLIED_WAIT: Duration = Duration::from_secs(2);
/// Relay channels are not a client's: no connection id a client can have.
pub const RELAY_CONNECTION: u64 = u64::MAX;

/// This node's classic-queue service: what `Rpc::Classic` reaches.
pub struct ClassicHome {
    broker: Weak<Broker>,
    node: ClusterNode,
    runtime: tokio::runtime::Handle,
    relays: Mutex<HashMap<u64, HomeRelay>>,
    /// What answers other nodes' management API (`Request::Management`), once it serves.
    management: std::sync::OnceLock<ManagementService>,
}

/// Answers another node's management query (`http::mgmt::peers`).
pub type ManagementService = Arc<dyn Fn(Bytes) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Bytes, String>> + Send>> + Send + Sync>;

/// A consumer of another node on a queue living here, or a basic.get of another node holding its
/// message (no consumer).
struct HomeRelay {
    from: NodeId,
    channel: Arc<Channel>,
    consumer: Option<Arc<Consumer>>,
}

impl ClassicHome {
    /// Starts the service on `node` (and its watch of the relays of unreachable nodes).
    pub fn start(broker: Weak<Broker>, node: ClusterNode) -> Arc<ClassicHome> {
        let home = Arc::new(ClassicHome { broker, node: node.clone(), runtime: tokio::runtime::Handle::current(), relays: Mutex::new(HashMap::new()), management: Default::default() });
        let weak = Arc::downgrade(&home);
        let service: ClassicService = Arc::new(move |from, request| {
            let home = weak.clone();
            Box::pin(async move {
                let home = home.upgrade().ok_or_else(|| "the node is stopping".to_string())?;
                home.serve(from, request).await
            })
        });
        node.set_classic_service(service);
        home.runtime.spawn(watch_nodes(Arc::downgrade(&home)));
        home
    }

    /// Installs what answers other nodes' management queries.
    pub fn set_management(&self, service: ManagementService) {
        let _ = self.management.set(service);
    }

    /// Sends a request to another node (the broker's `QuorumHost::classic_request`).
    pub fn request(&self, peer: NodeId, request: Bytes, done: RequestDone) {
        let node = self.node.clone();
        self.runtime.spawn(async move {
            done(node.classic_request(peer, &request, REQUEST_TIMEOUT).await.map_err(|e| e.to_string()));
        });
    }

    async fn serve(self: &Arc<Self>, from: NodeId, request: Bytes) -> Result<Bytes, String> {
        let broker = self.broker.upgrade().ok_or_else(|| "the node is stopping".to_string())?;
        let request = Request::decode(&request).map_err(|e| format!("bad classic queue request: {e}"))?;
        match request {
            Request::Publish { queue, messages } => take(&broker, self.home_queue(&broker, &queue)?, messages).await,
            Request::Open { queue, relay, tag, prefetch, no_ack, exclusive, priority } => {
                let q = self.consumable_queue(&broker, &queue)?;
                self.open(from, q, relay, tag, prefetch, no_ack, exclusive, priority).map(|()| Bytes::new())
            }
            Request::Settle { relay, how, tags } => {
                let channel = self.relays.lock().get(&relay).filter(|r| r.from == from).map(|r| r.channel.clone());
                let channel = channel.ok_or_else(|| format!("no consumer relay {relay} here"))?;
                // A tag the channel does not hold (settled twice by a confused peer) is skipped.
                channel.settle_tags(&tags, how);
                Ok(Bytes::new())
            }
            Request::Cancel { relay } => {
                let relay = self.relays.lock().get(&relay).filter(|r| r.from == from).and_then(|r| Some((r.channel.clone(), r.consumer.as_ref()?.tag.clone())));
                if let Some((channel, tag)) = relay {
                    channel.cancel(&tag);
                }
                Ok(Bytes::new())
            }
            Request::Close { relay } => {
                let gone = {
                    let mut relays = self.relays.lock();
                    match relays.get(&relay) {
                        Some(r) if r.from == from => relays.remove(&relay),
                        _ => None,
                    }
                };
                if let Some(r) = gone {
                    r.channel.close();
                }
                Ok(Bytes::new())
            }
            Request::Check { relays } => {
                let known = self.relays.lock();
                let unknown: Vec<u64> = relays.into_iter().filter(|id| known.get(id).is_none_or(|r| r.from != from)).collect();
                Ok(encode_ids(&unknown))
            }
            Request::Deliver { queue, relay, deliveries } => {
                let q = deliver_here(&broker, from, &queue, relay, deliveries)?;
                // The home pushes again once this is answered: a client slower than the pushes
                // (a no-ack consumer has no prefetch) holds the answer back.
                let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT - Duration::from_secs(2);
                while q.relay_side().is_some_and(|r| r.relay_backlog_full(relay)) && tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Ok(Bytes::new())
            }
            Request::Get { queue, relay, no_ack } => {
                let q = self.consumable_queue(&broker, &queue)?;
                self.get(from, q, relay, no_ack).await
            }
            Request::Purge { queue } => {
                let q = self.home_queue(&broker, &queue)?;
                // Answers once the purge is durable (a blocking wait for one group commit).
                let n = q.purge().map_err(|e| e.to_string())?;
                Ok(encode_ids(&[n as u64]))
            }
            Request::Rewind { queue, to_ms } => {
                let q = self.home_queue(&broker, &queue)?;
                let outcome = q.rewind(to_ms).await.map_err(|e| e.to_string())?;
                Ok(encode_ids(&[outcome.rewound, outcome.from_ms.map_or(0, |ms| ms.saturating_add(1)), u64::from(outcome.clamped)]))
            }
            Request::Stat { queue } => {
                let q = self.home_queue(&broker, &queue)?;
                // Asked by a queue.declare on another node: as a declare here, it renews x-expires.
                q.touch(warren_broker::now_ms());
                Ok(encode_ids(&[q.message_count() as u64, q.consumer_count() as u64]))
            }
            Request::Stats { queues } => {
                let stats: Vec<Option<HomeStats>> = queues
                    .iter()
                    .map(|queue| {
                        let q = self.home_queue(&broker, queue).ok()?;
                        let retained = if q.args.retention_ms > 0 { q.retention_stats().consumed } else { 0 };
                        Some(HomeStats { ready: q.message_count() as u64, unacked: q.unacked_count(), consumers: q.consumer_count() as u64, retained })
                    })
                    .collect();
                Ok(HomeStats::answer(&stats))
            }
            Request::Management { query } => match self.management.get() {
                Some(service) => service(query).await,
                None => Err(format!("node {} does not serve its management API yet", self.me())),
            },
            Request::Applied { index } => {
                if broker.metadata_applied_at_least(index, APPLIED_WAIT).await {
                    Ok(Bytes::new())
                } else {
                    Err(format!("node {} had not applied metadata entry {index} within {APPLIED_WAIT:?}", self.me()))
                }
            }
            Request::Reply { vhost, message } => {
                let message = decode_stored(&message).ok_or_else(|| "a direct reply that does not decode".to_string())?.message;
                let vhost = broker.vhost(&vhost).ok_or_else(|| format!("no vhost '{vhost}' here"))?;
                // A reply to a consumer gone meanwhile is dropped, as on the node it was published on.
                vhost.replies.deliver(Arc::new(message));
                Ok(Bytes::new())
            }
        }
    }

    fn me(&self) -> NodeId {
        self.node.node_id()
    }

    fn home_queue(&self, broker: &Broker, queue: &QueueRef) -> Result<Arc<Queue>, String> {
        let q = find_queue(broker, queue)?;
        if q.home_node() != Some(self.me()) {
            return Err(format!("classic queue '{}' does not live on node {} (its home is {:?})", queue.name, self.me(), q.home_node()));
        }
        Ok(q)
    }

    /// A queue another node's consumers and basic.gets may be relayed to here: a classic queue living
    /// here, or a quorum queue whose group has this node as a member (for nodes outside the group).
    fn consumable_queue(&self, broker: &Broker, queue: &QueueRef) -> Result<Arc<Queue>, String> {
        let q = find_queue(broker, queue)?;
        if q.exclusive_owner.is_some() {
            // Only its owner, a connection of its home, may consume from it.
            return Err(format!("queue '{}' is exclusive to a connection of node {}", queue.name, self.me()));
        }
        if q.is_quorum() {
            if q.has_replica_here() {
                return Ok(q);
            }
            return Err(format!("quorum queue '{}' has no replica on node {}", queue.name, self.me()));
        }
        self.home_queue(broker, queue)
    }

    /// A consumer of node `from` on a queue living here: a relay channel of its own, its deliveries
    /// pushed to `from`.
    #[allow(clippy::too_many_arguments)]
    fn open(self: &Arc<Self>, from: NodeId, queue: Arc<Queue>, relay: u64, tag: String, prefetch: u32, no_ack: bool, exclusive: bool, priority: i32) -> Result<(), String> {
        if self.relays.lock().contains_key(&relay) {
            return Ok(()); // asked again
        }
        self.close_stale(from, relay);
        let sink = Arc::new_cyclic(|me| RelaySink {
            me: me.clone(),
            home: Arc::downgrade(self),
            to: from,
            relay,
            queue: warren_broker::queue::remote::queue_ref(&queue),
            store_queue: Arc::downgrade(&queue),
            state: Mutex::new(SinkState::default()),
        });
        let channel = Channel::new(1, RELAY_CONNECTION, sink.clone());
        sink.state.lock().channel = Arc::downgrade(&channel);
        channel.qos(prefetch.min(u16::MAX as u32) as u16, false);
        let consumer = channel.new_consumer(Arc::from(tag.as_str()), queue.clone(), no_ack, exclusive, ConsumerArgs { priority });
        self.relays.lock().insert(relay, HomeRelay { from, channel: channel.clone(), consumer: Some(consumer.clone()) });
        let registered = queue.add_consumer(consumer.clone(), || channel.add_consumer(consumer.clone()));
        if let Err(e) = registered {
            self.relays.lock().remove(&relay);
            channel.close();
            return Err(e.to_string());
        }
        Ok(())
    }

    /// A relay of an earlier run of `from` than `relay`'s is stale: that run's consumers and gets
    /// are gone, and what they held goes back to the queues.
    fn close_stale(&self, from: NodeId, relay: u64) {
        let stale: Vec<HomeRelay> = {
            let mut relays = self.relays.lock();
            let ids: Vec<u64> = relays.iter().filter(|(id, r)| r.from == from && incarnation_of(**id) != incarnation_of(relay)).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| relays.remove(&id)).collect()
        };
        for r in stale {
            r.channel.close();
        }
    }

    /// basic.get of node `from`: the message, if any, taken for a relay channel of its own, which
    /// holds it until `from` settles it (`SETTLE`, `CLOSE`) unless `no_ack`.
    async fn get(self: &Arc<Self>, from: NodeId, queue: Arc<Queue>, relay: u64, no_ack: bool) -> Result<Bytes, String> {
        if self.relays.lock().contains_key(&relay) {
            return Err(format!("get relay {relay} is already in use"));
        }
        self.close_stale(from, relay);
        let sink = Arc::new(GetSink::default());
        let channel = Channel::new(1, RELAY_CONNECTION, sink.clone());
        if !no_ack {
            // Registered first: if `from` goes down meanwhile, the message goes back.
            self.relays.lock().insert(relay, HomeRelay { from, channel: channel.clone(), consumer: None });
        }
        let give_up = |home: &Self| {
            home.relays.lock().remove(&relay);
            channel.close();
        };
        let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT - Duration::from_secs(2);
        loop {
            match queue.get(&*channel, no_ack) {
                Got::Message => break,
                Got::Empty => {
                    give_up(self);
                    return Ok(encode_got(None));
                }
                Got::Failed(e) => {
                    give_up(self);
                    return Err(e);
                }
                Got::Later(wait) => {
                    if tokio::time::timeout_at(deadline, queue.wait_for(wait)).await.is_err() {
                        give_up(self);
                        return Err("the queue's head was not readable in time".to_string());
                    }
                }
            }
        }
        let Some(Delivery::GetOk { delivery_tag, redelivered, message_count, message, ack_when_written, .. }) = sink.taken.lock().take() else {
            give_up(self);
            return Err("basic.get found a message but delivered none".to_string());
        };
        let encoded = encode_stored(&message, None);
        if no_ack {
            // Consumed once answered, as once written to a socket (at most once, as RabbitMQ's).
            if let Some(ack) = ack_when_written {
                let mut batch = warren_store::Batch::new();
                ack.add_to(&mut batch);
                queue.append_acks(&mut batch);
            }
            channel.close();
        }
        let got = GotMessage { delivery: Relayed { tag: delivery_tag, redelivered, message: encoded }, remaining: message_count };
        Ok(encode_got(Some(&got)))
    }

    /// `node` is unreachable: its relays close, and what they held goes back to the queues.
    fn node_down(&self, node: NodeId) {
        let gone: Vec<HomeRelay> = {
            let mut relays = self.relays.lock();
            let ids: Vec<u64> = relays.iter().filter(|(_, r)| r.from == node).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| relays.remove(&id)).collect()
        };
        if !gone.is_empty() {
            tracing::info!(node, consumers = gone.len(), "a node of the cluster is down: closing its consumers of classic queues here");
        }
        for r in gone {
            r.channel.close();
        }
    }

    /// A push to a relay's node failed or was refused: the relay closes.
    fn relay_failed(&self, relay: u64, error: &str) {
        let gone = self.relays.lock().remove(&relay);
        if let Some(r) = gone {
            let queue = r.consumer.as_ref().map(|c| c.queue.name.clone()).unwrap_or_default();
            tracing::warn!(node = r.from, queue = %queue, error, "could not deliver to a consumer on another node; its messages go back to the queue");
            r.channel.close();
        }
    }
}

fn find_queue(broker: &Broker, queue: &QueueRef) -> Result<Arc<Queue>, String> {
    let vhost = broker.vhost(&queue.vhost).ok_or_else(|| format!("no vhost '{}'", queue.vhost))?;
    // Whoever owns it: publishes to another connection's exclusive queue are allowed.
    vhost
        .queue_any(&queue.name)
        .filter(|q| q.id == queue.id)
        .ok_or_else(|| format!("no queue '{}' (id {}) in vhost '{}'", queue.name, queue.id, queue.vhost))
}

/// Takes a batch of publishes for a queue living here; answers once they are durable.
async fn take(broker: &Broker, q: Arc<Queue>, messages: Vec<Bytes>) -> Result<Bytes, String> {
    let mut refused = Vec::with_capacity(messages.len());
    let mut ticket = None;
    let now = warren_broker::now_ms();
    let mut header = BytesMut::new();
    for payload in &messages {
        let Some(stored) = decode_stored(payload) else {
            refused.push(true);
            continue;
        };
        let message = Arc::new(stored.message);
        header.clear();
        encode_header(&message, Some(now), &mut header);
        match q.publish(&message, &header, now, false, None) {
            Ok(Enqueued::Accepted { ticket: t, .. }) => {
                ticket = ticket.max(t);
                refused.push(false);
            }
            Ok(Enqueued::Rejected) => refused.push(true),
            Err(e) => {
                tracing::warn!(queue = %q.name, error = %e, "a message forwarded by another node was refused");
                refused.push(true);
            }
        }
    }
    if let Some(ticket) = ticket {
        // Answered once durable: the sender confirms on this answer.
        let mut durable = broker.store().durable();
        let waited = tokio::time::timeout(REQUEST_TIMEOUT - Duration::from_secs(1), async { durable.wait_for(|d| *d >= ticket).await.map(|_| ()) }).await;
        match waited {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err("the store stopped before the messages were durable".to_string()),
            Err(_) => return Err("the messages were not durable in time".to_string()),
        }
    }
    Ok(encode_flags(&refused))
}

/// Deliveries a home pushed to a consumer on this node.
fn deliver_here(broker: &Broker, from: NodeId, queue: &QueueRef, relay: u64, deliveries: Vec<Relayed>) -> Result<Arc<Queue>, String> {
    let q = find_queue(broker, queue)?;
    let remote = q.relay_side().filter(|r| r.home() == from).ok_or_else(|| format!("queue '{}' is not relayed here from node {from}", queue.name))?;
    let mut messages = Vec::with_capacity(deliveries.len());
    for d in deliveries {
        let stored = decode_stored(&d.message).ok_or_else(|| "a relayed message does not decode".to_string())?;
        messages.push((d.tag, d.redelivered, Arc::new(stored.message)));
    }
    remote.relay_delivered(&q, relay, messages)?;
    Ok(q)
}

/// Closes the relays of nodes unreachable for `RELAYS_DOWN_AFTER`.
async fn watch_nodes(home: Weak<ClassicHome>) {
    let mut down_since: HashMap<NodeId, Option<tokio::time::Instant>> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let Some(home) = home.upgrade() else { return };
        let nodes: Vec<NodeId> = {
            let mut n: Vec<NodeId> = home.relays.lock().values().map(|r| r.from).collect();
            n.sort_unstable();
            n.dedup();
            n
        };
        down_since.retain(|n, _| nodes.contains(n));
        for node in nodes {
            if home.node.is_reachable(node) {
                down_since.remove(&node);
                continue;
            }
            let since = down_since.entry(node).or_insert_with(|| Some(tokio::time::Instant::now()));
            if since.is_some_and(|t| t.elapsed() >= RELAYS_DOWN_AFTER) {
                *since = None;
                home.node_down(node);
            }
        }
    }
}

/// A get relay channel's "connection": keeps the get-ok for the answer.
#[derive(Default)]
struct GetSink {
    taken: Mutex<Option<Delivery>>,
}

impl ClientSink for GetSink {
    fn send(&self, delivery: Delivery) {
        if matches!(delivery, Delivery::GetOk { .. }) {
            *self.taken.lock() = Some(delivery);
        }
    }
}

/// The relay channel's "connection": deliveries go to the consumer's node in pushes, one at a time.
struct RelaySink {
    me: Weak<RelaySink>,
    home: Weak<ClassicHome>,
    to: NodeId,
    relay: u64,
    queue: QueueRef,
    /// For the store acks of no-ack deliveries.
    store_queue: Weak<Queue>,
    state: Mutex<SinkState>,
}

#[derive(Default)]
struct SinkState {
    channel: Weak<Channel>,
    waiting: Vec<(u64, bool, warren_broker::MessageRef, Option<AckWhenWritten>)>,
    waiting_bytes: usize,
    pushing: bool,
    unacked_bytes: usize,
    /// The channel asked to be dispatched again once there is room.
    wake: bool,
}

impl RelaySink {
    fn push_next(self: &Arc<Self>) {
        let (request, acks) = {
            let mut st = self.state.lock();
            if st.pushing || st.waiting.is_empty() {
                return;
            }
            st.pushing = true;
            st.waiting_bytes = 0;
            let taken = std::mem::take(&mut st.waiting);
            let mut acks = Vec::new();
            let mut deliveries = Vec::with_capacity(taken.len());
            for (tag, redelivered, message, ack) in taken {
                deliveries.push(Relayed { tag, redelivered, message: encode_stored(&message, None) });
                acks.extend(ack);
            }
            (Request::Deliver { queue: self.queue.clone(), relay: self.relay, deliveries }, acks)
        };
        let Some(home) = self.home.upgrade() else { return };
        let me = self.clone();
        let bytes = request.encode();
        home.request(
            self.to,
            bytes,
            Box::new(move |answer| {
                // No-ack deliveries are consumed once pushed (or given up on), as once written to a socket.
                if let Some(queue) = me.store_queue.upgrade().filter(|_| !acks.is_empty()) {
                    let mut batch = warren_store::Batch::new();
                    for a in &acks {
                        a.add_to(&mut batch);
                    }
                    queue.append_acks(&mut batch);
                }
                let wake = {
                    let mut st = me.state.lock();
                    st.pushing = false;
                    std::mem::take(&mut st.wake)
                };
                if let Err(e) = answer {
                    if let Some(home) = me.home.upgrade() {
                        home.relay_failed(me.relay, &e);
                    }
                    return;
                }
                me.push_next();
                if wake {
                    if let Some(channel) = me.state.lock().channel.upgrade() {
                        channel.kick_consumers();
                    }
                }
            }),
        );
    }
}

impl ClientSink for RelaySink {
    fn send(&self, delivery: Delivery) {
        let Delivery::Deliver { delivery_tag, redelivered, message, ack_when_written, .. } = delivery else {
            // A cancel (the queue was deleted here): the consumer's node deletes its copy too and
            // cancels the consumer itself.
            return;
        };
        let start = {
            let mut st = self.state.lock();
            st.waiting_bytes += message.memory_bytes();
            st.waiting.push((delivery_tag, redelivered, message, ack_when_written));
            !st.pushing
        };
        if start {
            // `send` must not block (it runs under the queue's lock): the push starts from a task.
            if let Some(home) = self.home.upgrade() {
                let me = self.me.clone();
                home.runtime.spawn(async move {
                    if let Some(sink) = me.upgrade() {
                        sink.push_next();
                    }
                });
            }
        }
    }

    fn has_room(&self) -> bool {
        self.state.lock().waiting_bytes < PUSH_BYTES
    }

    fn wake_when_room(&self, _channel: Weak<dyn warren_broker::channel::Kick>) {
        self.state.lock().wake = true;
    }

    fn hold_unacked(&self, bytes: usize) {
        self.state.lock().unacked_bytes += bytes;
    }

    fn release_unacked(&self, bytes: usize) {
        // The channel dispatches its queues itself after a settlement.
        let mut st = self.state.lock();
        st.unacked_bytes = st.unacked_bytes.saturating_sub(bytes);
    }

    fn unacked_full(&self) -> bool {
        self.state.lock().unacked_bytes >= UNACKED_BYTES_LIMIT
    }
}

