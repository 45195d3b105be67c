//! What a queue hands its callers, whatever its kind.

use super::*;

/// A message in a queue (ready or delivered and not yet settled).
#[derive(Debug)]
pub struct Entry {
    pub message: MessageRef,
    /// Position in this queue (and its seq in the store): requeued messages go back to where they were.
    pub seq: u64,
    /// Payload bytes the store holds for it; 0 if it is not in the store.
    pub stored_bytes: u64,
    pub expires_at_ms: Option<u64>,
    pub redelivered: bool,
    /// How many times it came back to this queue unacknowledged (rejected or nacked with requeue, its
    /// channel closed, a CMQ lease ended) since this node took it: CMQ's `dequeueCount` is one more.
    /// Not stored: after a restart a message counts from its redelivered flag again.
    pub returned: u32,
}

impl Entry {
    /// Records in `acks` that this message is gone from queue `queue`, if the store has it.
    pub(in crate::queue) fn settle_in_store(&self, queue: u64, acks: &mut Batch) {
        if self.stored_bytes > 0 {
            acks.ack(queue, self.seq, self.stored_bytes);
        }
    }
}

/// The result of offering a message to a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// Taken; durable once the store reaches the ticket (if any). `slow_publishers`: the queue asks
    /// its publishers to pause (see `QueueState::publishers_must_wait`). `store_behind`: it was written
    /// to the store, which has more waiting to be written than it wants (`Store::is_behind`): the
    /// publisher should wait for `Store::caught_up` before sending more.
    Accepted { ticket: Option<SyncTicket>, slow_publishers: bool, store_behind: bool },
    /// Refused by `x-overflow: reject-publish(-dlx)`: the publisher gets a basic.nack.
    Rejected,
}

/// What basic.get found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Got {
    /// basic.get-ok went to the channel.
    Message,
    /// Nothing ready: the caller answers basic.get-empty.
    Empty,
    /// The head needs something first; await [`Queue::wait_for`] and call `get` again.
    Later(GetWait),
    /// The queue could not be asked (a classic queue's home node did not answer): the channel
    /// closes with 404 and this text, rather than say get-empty of a queue that may hold messages.
    Failed(String),
}

/// What a basic.get waits for (asynchronously, off the queue lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetWait {
    /// The store's durable watermark reaching this ticket (the head's delivered mark).
    Durable(SyncTicket),
    /// A read of the queue's backlog from the store (every window is empty meanwhile): one more read
    /// finished than this count of them.
    Refill(u64),
    /// The store's readable watermark reaching this ticket: the head is in the store, appended a
    /// moment ago, and not yet visible to `Store::read` (the writer applies appends after their fsync).
    Readable(SyncTicket),
    /// A quorum queue's Dequeue (this basic.get's id) being committed and applied (`replica`).
    Replicated(u64),
    /// A classic queue's home node answering this basic.get (`remote::get`).
    Remote(u64),
}

/// The connection that owns an exclusive queue: a connection of one run of one node (in a cluster,
/// the queue is known on every node, and only its owner may use it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    /// The owner's node's run (`crate::run_id`).
    pub run: u64,
    pub connection: u64,
}

impl Owner {
    /// Connection `connection` of this node's current run.
    pub fn here(connection: u64) -> Owner {
        Owner { run: crate::run_id(), connection }
    }
}

/// A rewind's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RewindOutcome {
    /// Consumed messages made ready again.
    pub rewound: u64,
    /// When the first message at or after the time asked for was published (unix ms): the queue was
    /// rewound to it. Later than asked when the retention no longer holds what was published then
    /// (`clamped`). None if the queue keeps no message from then on.
    pub from_ms: Option<u64>,
    /// The time asked for is before the oldest message the retention keeps.
    pub clamped: bool,
}

/// What a queue asks of the vhost it is in (`VHost` implements it): the queue module knows no
/// vhost, so the two do not import each other.
pub trait QueueHost: Send + Sync {
    /// The vhost's name.
    fn host_name(&self) -> &str;
    /// Re-publishes dead letters to their dead-letter exchanges.
    fn dead_letter(&self, letters: Vec<DeadLetter>);
    /// Whether few enough dead letters wait for a source that makes many at once to make more.
    fn dead_letter_room(&self) -> bool;
    /// Calls `f` once there is room for dead letters again (now, if there is).
    fn when_dead_letter_room(&self, f: crate::deadletter::WhenRoom);
    /// Deletes queue `name` without the client-facing checks (auto-delete, x-expires); retried at
    /// the vhost's tick if that cannot be made durable now.
    fn delete_queue_unchecked(&self, name: &str);
    /// Deletes `queue` at the vhost's next tick, retried until it is gone.
    fn doom(&self, queue: &Arc<Queue>);
}

/// Which settlement a client asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    Ack,
    /// Reject or nack: back to the queue (redelivered) or, without requeue, dead-lettered/dropped.
    Reject { requeue: bool },
}

/// What a queue delivers through: the channel of a consumer or of a basic.get (`Channel`
/// implements it), so that the queue module names no channel.
pub trait DeliverySink: Send + Sync {
    /// The connection the channel is on, and its number there.
    fn connection_id(&self) -> u64;
    fn number(&self) -> u16;
    /// This channel, for what must not keep it alive (a basic.get waiting for its answer).
    fn weak_sink(&self) -> std::sync::Weak<dyn DeliverySink>;
    /// Whether the channel is closed (or closing: its consumers are being removed).
    fn is_closed(&self) -> bool;
    /// Whether the connection holds as many unacknowledged bytes as it may.
    fn unacked_full(&self) -> bool;
    /// Whether the connection can take more deliveries now (its outgoing buffer is not full).
    fn has_room(&self) -> bool;
    /// Hands a message to `consumer`, under the queue's lock. Gives the entry back if the channel
    /// cannot take it (closed, flow off, no credit). `Ok(Some)`: delivered to a no-ack consumer, so
    /// settled (the connection acks it in the store once written).
    fn try_deliver(&self, consumer: &Arc<Consumer>, entry: Entry) -> std::result::Result<Option<Entry>, Entry>;
    /// basic.get-ok of `entry` from `queue`. Returns the entry when no_ack (settled).
    fn deliver_get(&self, queue: &Arc<Queue>, entry: Entry, no_ack: bool, message_count: u32) -> Option<Entry>;
    /// The queue was deleted under consumer `tag`: forget it and tell the client.
    fn consumer_cancelled_by_server(&self, tag: &Arc<str>);
}
