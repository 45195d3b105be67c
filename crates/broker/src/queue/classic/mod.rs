//! A classic queue: ready messages in order, its consumers, and the rules applied on the way in
//! (max-length, overflow) and on the way out (TTL, dead-lettering, round-robin delivery).
//!
//! Each queue has its own lock; nothing on the publish path takes a global lock. Work that
//! reaches other queues (dead-lettering, auto-delete) is collected under the lock and carried
//! out after it is released, so queues never lock each other.
//!
//! Memory is bounded whatever the backlog: a queue keeps at most a window of ready messages in
//! memory (`WINDOW_MESSAGES`, and a share of `WINDOW_BUDGET_BYTES` that shrinks as queues are added,
//! see [`window_bytes`]). Once the window is full, newer messages go only to
//! the store (the "span": seqs `[span_from, next_seq)`), and the queue reads them back in order
//! as the window drains. Ready messages = window, then span; every window seq is below `span_from`.
//!
//! The parts: `ops` (publish, consumers, dispatch, basic.get, settle, purge, delete, tick),
//! `window` (refill from the store, expiry, drop-head, dead letters), `durable` (late writes,
//! delivered marks, restore), `rewind`.

mod durable;
mod lane;
mod ops;
mod rewind;
mod window;

use super::*;
use lane::{Lane, Levels};
use remote::RemoteHome;

/// Publishers held back by a slow no-ack consumer pause at this many waiting messages and go on at
/// `FLOW_RESUME_AT` (see `QueueState::publishers_must_wait`).
const FLOW_PAUSE_AT: usize = WINDOW_MESSAGES / 2;
const FLOW_RESUME_AT: usize = WINDOW_MESSAGES / 4;

/// How far ahead of the deliveries the delivered mark is kept (see `Queue::delivery_marked`): a mark
/// record per 1,024 deliveries, and after a restart at most this many never-delivered messages flagged
/// redelivered.
const MARK_STEP: u64 = 2048;

/// What `Queue::select_head` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Head {
    /// The current lane's window holds the message to deliver next.
    Ready,
    /// No ready message.
    Empty,
    /// The next messages (of the highest level holding any) are being read from the store
    /// (`refill_locked`); the read's merge delivers them.
    Refilling,
    /// The next message (of the highest level holding any) is in the store but not readable yet; it
    /// is once the store's readable watermark reaches this ticket.
    Unreadable(SyncTicket),
}

/// A classic queue's state (`Kind::Classic`).
pub(in crate::queue) struct Classic {
    pub(in crate::queue) state: Mutex<QueueState>,
    /// Wakes publishers slowed by `held_back` once the window has drained.
    drained: tokio::sync::Notify,
    /// Wakes basic.gets waiting for a read of a span (`GetWait::Refill`).
    refilled: tokio::sync::Notify,
    /// One rewind at a time (`rewind`).
    rewinding: tokio::sync::Mutex<()>,
    /// In a cluster: its home node (`remote`), set at declaration.
    pub(in crate::queue) home: Option<RemoteHome>,
}

impl Classic {
    pub(in crate::queue) fn new(id: u64, args: &QueueArgs, now_ms: u64, home: Option<RemoteHome>) -> Classic {
        Classic {
            state: Mutex::new(QueueState::new(id, args, now_ms)),
            drained: tokio::sync::Notify::new(),
            refilled: tokio::sync::Notify::new(),
            rewinding: tokio::sync::Mutex::new(()),
            home,
        }
    }

    /// Its home, when that is another node: this node forwards to it.
    pub(in crate::queue) fn elsewhere(&self) -> Option<&RemoteHome> {
        self.home.as_ref().filter(|h| h.is_elsewhere())
    }

    /// Returns once a read of a span has been merged since `done` reads were (`GetWait::Refill`), or
    /// the queue is deleted.
    pub(in crate::queue) async fn refilled_since(&self, done: u64) {
        loop {
            let notified = self.refilled.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let finished = {
                let st = self.state.lock();
                st.refills_done != done || st.deleted
            };
            if finished {
                return;
            }
            notified.await;
        }
    }
}

pub(in crate::queue) struct QueueState {
    /// The current lane (a classic queue's only one); `QueueState` reads as it (`Deref`).
    lane: Lane,
    /// A priority queue's other lanes (see `lane`).
    levels: Levels,
    /// A task waits for the mark's fsync to resume dispatching.
    mark_waiter: bool,
    /// A task waits for the store to make the head readable to resume dispatching.
    readable_waiter: bool,
    /// Reads of a span merged so far (see `refilled_from_store`): what a waiting basic.get watches.
    pub(in crate::queue) refills_done: u64,
    /// Consumers with credit could not take more because their connections' outgoing buffers are
    /// full (a consumer reading slower than publishers write): publishers are slowed (see
    /// `QueueState::publishers_must_wait`).
    held_back: bool,
    /// A publisher waits on `drained`.
    publisher_waiting: bool,
    /// A publisher waited the longest pause and the consumers made no progress: they are stalled, not
    /// slow, and publishers go on (the queue keeps the messages) until a delivery succeeds again.
    consumers_stalled: bool,
    /// Who gets the next message: priorities, round-robin, single active consumer (`consumers`).
    pub(in crate::queue) consumers: Consumers,
    pub(in crate::queue) unacked: u64,
    had_consumers: bool,
    /// For `x-expires`: the last time the queue was used (consume, get, declare).
    pub(in crate::queue) last_used_ms: u64,
    pub(in crate::queue) deleted: bool,
}

impl std::ops::Deref for QueueState {
    type Target = Lane;
    fn deref(&self) -> &Lane {
        &self.lane
    }
}

impl std::ops::DerefMut for QueueState {
    fn deref_mut(&mut self) -> &mut Lane {
        &mut self.lane
    }
}

impl QueueState {
    /// The state of a new queue `id` (used as of `now_ms`, for `x-expires`).
    pub(in crate::queue) fn new(id: u64, args: &QueueArgs, now_ms: u64) -> QueueState {
        let (lane, levels) = Levels::new(id, args.max_priority);
        QueueState {
            lane,
            levels,
            mark_waiter: false,
            readable_waiter: false,
            refills_done: 0,
            held_back: false,
            publisher_waiting: false,
            consumers_stalled: false,
            consumers: Consumers::new(args.single_active_consumer),
            unacked: 0,
            had_consumers: false,
            last_used_ms: now_ms,
            deleted: false,
        }
    }

    /// Makes `level` the current lane (a priority queue; nothing for a classic one).
    fn select(&mut self, level: usize) {
        self.levels.select(&mut self.lane, level);
    }

    /// Makes the highest lane holding ready messages current.
    fn select_highest(&mut self) {
        let highest = self.levels.non_empty_desc(&self.lane).next();
        if let Some(level) = highest {
            self.select(level);
        }
    }

    /// Whether publishers to this queue should pause: its consumers could take more but their
    /// connections cannot (a no-ack consumer whose socket is slower than the publishers), they are not
    /// stalled, and a good part of the window is waiting. RabbitMQ's credit flow has the same effect:
    /// the queue stops taking messages from publishers while it is blocked delivering. Queues without
    /// consumers, or whose consumers are at their prefetch limit, never slow publishers: their backlog
    /// goes to disk.
    fn publishers_must_wait(&self) -> bool {
        self.held_back && !self.consumers_stalled && self.ready.len() >= FLOW_PAUSE_AT
    }
}

/// A read of a lane's span, and the store's durable watermark just before it: messages become readable
/// only after their fsync, so a read that found nothing is worth repeating only once the watermark has
/// moved past this.
struct SpanRead {
    watermark: SyncTicket,
    read: std::result::Result<ReadBatch, StoreError>,
}

/// Work found under the queue lock, done after it is released.
#[derive(Default)]
struct AfterUnlock {
    dead: Vec<DeadLetter>,
    acks: Batch,
    cancelled: Vec<Arc<Consumer>>,
    auto_delete: bool,
    /// Dispatch again (a consumer took over).
    dispatch: bool,
}

/// Ready messages: the window and the span, of every lane.
pub(in crate::queue) fn ready_count(st: &QueueState) -> u64 {
    let others = if st.levels.is_priority() { st.levels.count_and_bytes().0 } else { 0 };
    st.lane.count() + others
}

/// Body bytes of the ready messages of every lane.
fn ready_bytes(st: &QueueState) -> u64 {
    let others = if st.levels.is_priority() { st.levels.count_and_bytes().1 } else { 0 };
    st.lane.bytes() + others
}

/// Empties every lane, collecting store acks; returns how many messages they held.
fn drain_ready(st: &mut QueueState, acks: &mut Batch) -> u32 {
    let n = ready_count(st).min(u32::MAX as u64) as u32;
    drain_lane(&mut st.lane, acks);
    for lane in st.levels.others_mut() {
        drain_lane(lane, acks);
    }
    n
}

/// Empties a lane's window and span, collecting store acks.
fn drain_lane(lane: &mut Lane, acks: &mut Batch) {
    lane.span_epoch += 1; // a read of the span under way is stale now
    for entry in lane.ready.drain(..) {
        entry.settle_in_store(lane.store_id, acks);
    }
    lane.ready_bytes = 0;
    lane.ready_mem = 0;
    if lane.span_count > 0 {
        acks.ack_range(lane.store_id, lane.span_from, lane.next_seq, lane.span_store_bytes);
    }
    lane.span_count = 0;
    lane.span_bytes = 0;
    lane.span_store_bytes = 0;
    for (start, end) in lane.rewound.take_all() {
        // (Their bytes are not known here: the store's count of live bytes keeps an estimate.)
        acks.ack_range(lane.store_id, start, end, 0);
    }
}

fn pop_ready(st: &mut QueueState) -> Option<Entry> {
    let entry = st.ready.pop_front()?;
    st.ready_bytes = st.ready_bytes.saturating_sub(entry.message.body_len() as u64);
    st.ready_mem = st.ready_mem.saturating_sub(entry.message.memory_bytes() as u64);
    Some(entry)
}

fn push_ready_front(st: &mut QueueState, entry: Entry) {
    st.ready_bytes += entry.message.body_len() as u64;
    st.ready_mem += entry.message.memory_bytes() as u64;
    st.ready.push_front(entry);
}

/// Requeued messages go back to their original position (RabbitMQ's behaviour for classic queues).
fn push_ready_sorted(st: &mut QueueState, entry: Entry) {
    st.ready_bytes += entry.message.body_len() as u64;
    st.ready_mem += entry.message.memory_bytes() as u64;
    let pos = st.ready.partition_point(|e| e.seq < entry.seq);
    st.ready.insert(pos, entry);
}

#[cfg(test)]
mod refill_tests {
    use super::*;
    use crate::channel::{ClientSink, Delivery};
    use std::time::{Duration, Instant};
    use warren_store::sim::SimDisk;
    use warren_store::{Disk, StoreOptions};

    /// A queue outside any vhost (nothing here dead-letters or deletes it).
    struct NoHost;

    impl QueueHost for NoHost {
        fn host_name(&self) -> &str {
            ""
        }
        fn dead_letter(&self, _: Vec<DeadLetter>) {}
        fn dead_letter_room(&self) -> bool {
            true
        }
        fn when_dead_letter_room(&self, f: crate::deadletter::WhenRoom) {
            f()
        }
        fn delete_queue_unchecked(&self, _: &str) {}
        fn doom(&self, _: &Arc<Queue>) {}
    }

    /// Keeps the seqs of what basic.get handed out (the body holds the seq).
    #[derive(Default)]
    struct Gets(parking_lot::Mutex<Vec<u64>>);

    impl ClientSink for Gets {
        fn send(&self, delivery: Delivery) {
            if let Delivery::GetOk { message, .. } = delivery {
                self.0.lock().push(std::str::from_utf8(&message.body).unwrap().parse().unwrap());
            }
        }
    }

    /// The store's writer holds a queue log's lock while a checkpoint copies records into the queue's
    /// files; on a full disk that lasts until space comes back. A refill used to read the store under
    /// the queue's lock on the calling (runtime) thread, so basic.get, publishes and dispatch of that
    /// queue, and the runtime threads they ran on, waited for the disk. Now the read runs on a
    /// blocking thread: gets from the window go on, and the backlog arrives once the disk has room.
    #[test]
    fn a_refill_waiting_for_the_disk_holds_neither_the_queue_nor_the_caller() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _in_runtime = rt.enter();
        let root = tempfile::tempdir().unwrap();
        let sim = SimDisk::new(root.path()).unwrap();
        let opts = StoreOptions { checkpoint_idle_ms: 50, ..StoreOptions::default() };
        let (store, _) = Store::open_on(&root.path().join("store"), opts, Disk::simulated(sim.clone())).unwrap();
        // Not durable: its gets need no delivered mark (which could not become durable on a full disk);
        // what does not fit in its window is still paged to the store.
        let queue = Queue::new("q".into(), 1, false, None, false, FieldTable::default(), QueueArgs::default(), Weak::<NoHost>::new(), store.clone(), 0, None);
        let total = WINDOW_MESSAGES as u64 + 300;
        for seq in 0..total {
            let message = Arc::new(crate::Message {
                exchange: String::new(),
                routing_key: "q".into(),
                properties: bytes::Bytes::from_static(&[0x10, 0x00, 0x02]),
                body: bytes::Bytes::from(seq.to_string()),
                persistent: true,
                expiration_ms: None,
            });
            let mut header = bytes::BytesMut::new();
            crate::message::encode_header(&message, None, &mut header);
            assert!(matches!(queue.publish(&message, &header, 0, false, None).unwrap(), Enqueued::Accepted { .. }));
        }
        let mut sync = Batch::new();
        sync.delivered(7, 1); // any record: once it is durable, the paged messages before it are too
        store.wait_durable(store.append(&mut sync).unwrap()).unwrap();
        assert_eq!(queue.classic().unwrap().state.lock().span_count, 300, "the last 300 wait in the store");

        // The next quiet checkpoint copies the 300 (a short run) into the queue's own file: it cannot.
        sim.set_full(true);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !store.waiting_for_space() {
            assert!(Instant::now() < deadline, "the checkpoint's write waits for space");
            std::thread::sleep(Duration::from_millis(5));
        }
        let sink = Arc::new(Gets::default());
        let channel = crate::channel::Channel::new(1, 1, sink.clone());
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let (q, ch, handle) = (queue.clone(), channel.clone(), rt.handle().clone());
        let getter = std::thread::spawn(move || {
            let _in_runtime = handle.enter();
            for _ in 0..1100 {
                assert_eq!(q.get(&*ch, true), Got::Message);
            }
            done_tx.send(()).unwrap();
        });
        let _ = getter;
        let prompt = done_rx.recv_timeout(Duration::from_secs(5)).is_ok();
        sim.set_full(false);
        assert!(prompt, "basic.get waited for a refill that waits for the disk");

        loop {
            match queue.get(&*channel, true) {
                Got::Message => {}
                Got::Empty => break,
                Got::Later(wait) => rt.block_on(queue.wait_for(wait)),
                Got::Failed(e) => panic!("a local queue's get failed: {e}"),
            }
        }
        let seqs = sink.0.lock().clone();
        assert_eq!(seqs, (0..total).collect::<Vec<_>>(), "every message once, in order");
    }
}
