//! A durable classic queue in a cluster lives on one node, its home (the node whose client declared
//! it, as RabbitMQ's `client-local` placement). Every node has the queue (the metadata group
//! declares it everywhere, so every node routes to it), but only the home's copy holds messages.
//! This module is the other nodes' side (the home's is the server's `classic_home`):
//!
//! - **Publishes** routed to the queue are forwarded to the home in batches over the cluster
//!   transport, and confirmed once the home answers that they are durable there (or nacked: the
//!   home refused, is down, or did not answer in time). A node has at most one batch per queue on
//!   its way, so one node's publishes reach the queue in the order they were made. Publishers
//!   pause (`Queue::wait_until_drained`) while `PAUSE_BYTES` wait and are refused past
//!   `REFUSE_BYTES`.
//! - **Consumers** (`relay`): a consumer here has a relay consumer on the home, on a channel of its
//!   own with the consumer's prefetch; the home pushes its deliveries here, and acks, nacks and
//!   rejects go back.
//! - **basic.get, queue.purge, declare-ok's counts** (`get`): asked of the home each time.
//!
//! A quorum queue on a node outside its group (`x-quorum-initial-group-size` below the cluster's
//! size) relays its consumers and basic.gets the same way, through a member of the group
//! ([`RemoteHome::through_member`]); its publishes are proposed to the group as any node's. When
//! that member is lost, the consumers move to another member instead of being cancelled.
//!
//! Requests and answers: `wire`.

mod get;
pub use get::HomeStats;
pub mod relay;
pub mod wire;

use bytes::Bytes;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

use super::consumers::Consumer;
use super::quorum::QuorumRuntime;
use crate::error::BrokerError;
use crate::message::{encode_stored, MessageRef};
use crate::publisher::{Publisher, PublisherSession};
use wire::{QueueRef, Request};

/// A batch carries at most this much (messages beyond it wait for the next batch; a single larger
/// message goes alone).
const MAX_BATCH_BYTES: usize = 4 << 20;
/// Publishers pause while this much waits to be forwarded...
const PAUSE_BYTES: usize = 16 << 20;
/// ... and what comes while this much waits (the home stalls: a paused publisher still reads a
/// little every `FLOW_WAIT`) is refused (basic.nack), so memory stays bounded.
const REFUSE_BYTES: usize = 4 * PAUSE_BYTES;
/// How long the home may take to answer a request (a batch is nacked after it).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// What carries a request to another node (the server, over the cluster transport): `done` is
/// called exactly once, later, with the answer or why there is none.
pub type RequestDone = Box<dyn FnOnce(std::result::Result<Bytes, String>) + Send>;

/// The side of a classic queue on a node that is not its home.
pub struct RemoteHome {
    /// The home node's id (through a member: the member relayed through now).
    home: AtomicU64,
    /// A quorum queue's relay through a member of its group (consumers and basic.gets only).
    through_member: bool,
    runtime: Arc<QuorumRuntime>,
    pending: Mutex<Pending>,
    drained: Notify,
    relays: relay::Relays,
    gets: get::Gets,
}

#[derive(Default)]
struct Pending {
    /// Encoded messages waiting for the next batch, with their publishers (None: nothing waits).
    messages: Vec<(Bytes, Option<(Arc<PublisherSession>, u64)>)>,
    bytes: usize,
    in_flight: bool,
    /// The queue's id, which publishers wait on (set by the first publish).
    queue_id: u64,
}

impl Drop for Pending {
    /// The queue's handle is gone (deleted, or its home changed): what still waits to be forwarded
    /// never will be, so its publishers are nacked now rather than waiting for ever.
    fn drop(&mut self) {
        let waiters: Vec<_> = self.messages.drain(..).map(|(_, w)| w).collect();
        resolve(self.queue_id, waiters, None);
    }
}

impl RemoteHome {
    pub fn new(home: u64, runtime: Arc<QuorumRuntime>) -> RemoteHome {
        RemoteHome {
            home: AtomicU64::new(home),
            through_member: false,
            runtime,
            pending: Mutex::new(Pending::default()),
            drained: Notify::new(),
            relays: relay::Relays::default(),
            gets: get::Gets::default(),
        }
    }

    /// The consumers and basic.gets of a quorum queue on a node outside its group, relayed through
    /// `member` (and through another member once that one is lost).
    pub fn through_member(member: u64, runtime: Arc<QuorumRuntime>) -> RemoteHome {
        RemoteHome { through_member: true, ..RemoteHome::new(member, runtime) }
    }

    /// The home node (or the member relayed through).
    pub fn home(&self) -> u64 {
        self.home.load(Ordering::Acquire)
    }

    /// This node's consumers served through the home (or member).
    pub fn relayed_consumers(&self) -> Vec<Arc<Consumer>> {
        self.relays.consumers()
    }

    /// Through a member: relays from now on go through another member than `lost`, if the group
    /// has one. Whether they moved.
    pub(super) fn move_from(&self, queue: &super::Queue, lost: u64) -> bool {
        if !self.through_member {
            return false;
        }
        match queue.relay_member_instead_of(lost) {
            Some(member) if member != lost => {
                let moved = self.home.compare_exchange(lost, member, Ordering::AcqRel, Ordering::Acquire).is_ok();
                if moved {
                    tracing::info!(queue = %queue.name, from = lost, to = member, "consumers of a quorum queue outside its group move to another member");
                }
                moved || self.home() != lost
            }
            _ => false,
        }
    }

    /// Whether the home is another node (false on the home itself, and before the node knows its id).
    pub fn is_elsewhere(&self) -> bool {
        let me = self.runtime.node();
        me != 0 && me != self.home()
    }

    /// What the relayed side is called in logs and in what clients are told.
    fn what(&self) -> &'static str {
        if self.through_member {
            "the member of the quorum queue's group relayed through"
        } else {
            "the home node of the classic queue"
        }
    }

    pub(super) fn refusal(&self, queue: &str, what: &str) -> BrokerError {
        BrokerError::precondition_failed(format!(
            "classic queue '{queue}' lives on node {} of the cluster: {what} through a connection to that node \
             (or use a quorum queue, served by every node)",
            self.home()
        ))
    }

    /// Sends `request` to the home; `done` gets the answer.
    fn request(&self, request: &Request, done: RequestDone) {
        match self.runtime.host() {
            Some(host) => host.classic_request(self.home(), request.encode(), done),
            None => done(Err("this node runs no cluster".to_string())),
        }
    }

    /// Takes a message routed to the queue: it leaves in the next batch to the home.
    pub(super) fn publish(&self, queue: &Arc<super::Queue>, message: &MessageRef, now_ms: u64, publisher: Option<Publisher>) -> super::Enqueued {
        if self.pending.lock().bytes >= REFUSE_BYTES {
            return super::Enqueued::Rejected;
        }
        let encoded = encode_stored(message, Some(now_ms));
        let waiter = publisher.map(|p| {
            p.session.sent(queue.id, p.seq);
            (p.session.clone(), p.seq)
        });
        let slow_publishers = {
            let mut p = self.pending.lock();
            p.queue_id = queue.id;
            p.bytes += encoded.len();
            p.messages.push((encoded, waiter));
            p.bytes >= PAUSE_BYTES
        };
        self.send_next(queue);
        super::Enqueued::Accepted { ticket: None, slow_publishers, store_behind: false }
    }

    /// Sends the next batch if none is on its way.
    fn send_next(&self, queue: &Arc<super::Queue>) {
        let (request, waiters) = {
            let mut p = self.pending.lock();
            if p.in_flight || p.messages.is_empty() {
                return;
            }
            let mut size = 0;
            let mut n = 0;
            for (m, _) in &p.messages {
                if n > 0 && size + m.len() > MAX_BATCH_BYTES {
                    break;
                }
                size += m.len();
                n += 1;
            }
            let taken: Vec<_> = p.messages.drain(..n).collect();
            p.bytes -= size;
            p.in_flight = true;
            let (messages, waiters): (Vec<Bytes>, Vec<_>) = taken.into_iter().unzip();
            (Request::Publish { queue: queue_ref(queue), messages }, waiters)
        };
        self.drained.notify_waiters();
        let weak = Arc::downgrade(queue);
        let queue_id = queue.id;
        self.request(
            &request,
            Box::new(move |answer| match weak.upgrade() {
                Some(queue) => {
                    if let Some(remote) = queue.remote_home() {
                        remote.answered(&queue, waiters, answer);
                    }
                }
                // Publishers wait on the queue's id: resolved under it, or their confirms stall.
                None => resolve(queue_id, waiters, None),
            }),
        );
    }

    fn answered(&self, queue: &Arc<super::Queue>, waiters: Vec<Option<(Arc<PublisherSession>, u64)>>, answer: std::result::Result<Bytes, String>) {
        let outcomes = match answer.and_then(|a| wire::decode_flags(&a, waiters.len()).map_err(|e| e.to_string())) {
            Ok(o) => Some(o),
            Err(e) => {
                tracing::warn!(queue = %queue.name, home = self.home(), messages = waiters.len(), error = %e,
                    "messages for a classic queue on another node were not taken there; their publishers get basic.nack");
                None
            }
        };
        resolve(queue.id, waiters, outcomes);
        self.pending.lock().in_flight = false;
        self.send_next(queue);
    }

    /// Waits (at most `max`) until less waits to be forwarded than makes publishers pause.
    pub(super) async fn wait_until_drained(&self, max: Duration) {
        let notified = self.drained.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.pending.lock().bytes < PAUSE_BYTES {
            return;
        }
        let _ = tokio::time::timeout(max, notified).await;
    }
}

/// How nodes name `queue` to each other.
pub fn queue_ref(queue: &super::Queue) -> QueueRef {
    QueueRef { vhost: queue.vhost_name(), name: queue.name.clone(), id: queue.id }
}

/// Tells each publisher its outcome: taken (`outcomes[i]` false) or refused; all refused without outcomes.
fn resolve(queue: u64, waiters: Vec<Option<(Arc<PublisherSession>, u64)>>, outcomes: Option<Vec<bool>>) {
    for (i, w) in waiters.into_iter().enumerate() {
        if let Some((session, seq)) = w {
            let refused = outcomes.as_ref().is_none_or(|o| o.get(i).copied().unwrap_or(true));
            session.resolved(queue, [(seq, refused)]);
        }
    }
}

/// Refuses what only the home can do, on another node.
pub(super) fn not_here(remote: &RemoteHome, queue: &str, what: &str) -> crate::error::Result<()> {
    if remote.is_elsewhere() {
        return Err(remote.refusal(queue, what));
    }
    Ok(())
}
