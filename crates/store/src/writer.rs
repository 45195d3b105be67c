//! The pending write buffer and the writer thread: group commit, then the queue logs, then checkpoints.
//!
//! `append` copies a batch's encoded records into `State::pending` under a short lock and wakes the writer.
//! The writer swaps `pending` with its own empty buffer (double buffering: appenders keep filling one while
//! the other is written), writes it to the WAL with one `write_all` per segment touched, `fdatasync`s once,
//! and publishes the end position as the durable watermark. Everything appended while that fsync runs
//! forms the next group, so N concurrent appenders cost about one fsync per fsync-latency, not one per
//! batch, whatever the number of queues. Then it copies the group's enqueues into the queue logs (page
//! cache only), applies acks and drops, deletes consumed queue segments, and every `checkpoint_bytes` of
//! WAL (or after a quiet second) writes a checkpoint and deletes the WAL before it.
//!
//! ### To ensure correctness
//! - The watermark is published only after the fsync that covers it returned; a ticket is never reported
//!   durable otherwise.
//! - A failed `fsync` aborts the process: the kernel may have dropped the dirty pages and cleared the
//!   error, so a retry can "succeed" without the data ever reaching disk (the PostgreSQL fsync-gate).
//!   Recovery from the files is the only safe continuation. So does a failed `write`, except for lack of
//!   space: that write did not happen, and it waits for space and is tried again (`space`), with
//!   nothing confirmed meanwhile.
//! - `append` never waits: a runtime thread must not block on the disk. When more than
//!   `MAX_PENDING_BYTES` wait to be written the store is "behind" ([`Shared::is_behind`]); the server
//!   then stops reading from publishers' sockets until the writer has taken the buffer, so memory stays
//!   bounded by TCP back-pressure instead of by blocking threads.
//! - A WAL segment is fsynced before the next one is created, so only the newest can have a torn tail.
//! - A checkpoint is written only after `syncfs` made the queue files it describes durable, and the WAL
//!   before it is deleted only after the checkpoint is durable.
//!
//! Lock order: `State` then `Durable`; a queue log's lock is never held while taking either.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::{Condvar, Mutex};
use tokio::sync::watch;

use crate::batch::Batch;
use crate::checkpoint::{self, Checkpoint, QueueState};
use crate::direct::{Appender, BLOCK};
use crate::error::StoreError;
use crate::format::{self, Record, HEADER_SIZE};
use crate::io::Disk;
use crate::qlog::WalPlace;
use crate::qlog::QueueLogs;
use crate::reclaim::{Job, Reclaimer};
use crate::segment;
use crate::store::SyncPolicy;
use crate::SyncTicket;

/// Above this many pending bytes the store is behind (the disk cannot keep up): publishers are asked to
/// wait (see `Shared::is_behind`), so memory stays bounded instead of growing with the backlog. A soft
/// cap: `append` itself never waits, so what publishers had already read still goes in.
pub(crate) const MAX_PENDING_BYTES: usize = 16 << 20;
/// Test-only fault hook: every fsync of the writer (WAL `fdatasync`, checkpoint `syncfs`) first sleeps
/// this many milliseconds, to show that a slow disk stalls only what waits for it. Never set it in
/// production.
const FSYNC_DELAY_ENV: &str = "WARREN_TEST_FSYNC_DELAY_MS";
/// Capacity of a new group buffer: a full pending buffer, a large batch on top and the seed.
const GROUP_BUFFER_CAPACITY: usize = MAX_PENDING_BYTES + (4 << 20);
/// Group buffers kept for reuse after a checkpoint (a busy store cycles through about
/// `checkpoint_bytes / group size` of them): fresh ones cost a page fault per 4 KiB as they fill, which
/// was a fifth of an appending thread's time. Given back when the store goes quiet.
const SPARE_BUFFERS: usize = 8;
/// The writer gives back buffer capacity above this after a burst. Large enough that a busy store does
/// not reallocate (and page-fault in) its two group buffers over and over.
const MAX_RETAINED_BUFFER: usize = 32 << 20;

/// Per this many queues with records since the last checkpoint, the checkpoint waits for
/// `checkpoint_bytes` more WAL (see `checkpoint_due_at`).
const SPREAD_QUEUES: usize = 64;
/// ... up to this many times `checkpoint_bytes` (the tail records until then are slices of group
/// buffers held in memory: 512 MiB at the default 32 MiB).
const SPREAD_FACTOR: u64 = 16;

/// The WAL bytes after which a checkpoint is due, with `queues` queues holding records since the last
/// one. A checkpoint writes each of those queues' live records into its own files: a small direct
/// write per queue when they are many. At 1,000 quorum queues on three nodes (bench/cluster.py Q4:
/// their Raft logs interleave in the WAL and stay live until a snapshot) those writes took a sixth
/// of a node's time at a checkpoint per 32 MiB; one per 128 MiB ran Q4 at 63.9k/61.5k msg/s against
/// 56.7k/56.7k, one per 480 MiB (15 x 32 MiB) at 71.2k/74.3k against 64.5k/67.1k: the longer the
/// WAL waits, the more of those entries a snapshot has let go by the checkpoint, and the fewer
/// are copied. Few queues keep the checkpoint at `checkpoint_bytes`: its copy (one queue's backlog,
/// in a few large writes) holds up group commits while it runs, and at 128 MiB for everyone Q1's
/// confirm p99 went from 62 ms to 104 ms.
fn checkpoint_due_at(checkpoint_bytes: u64, queues: usize) -> u64 {
    checkpoint_bytes * (queues / SPREAD_QUEUES).clamp(1, SPREAD_FACTOR as usize) as u64
}

/// State shared by appenders and the writer, under one mutex.
pub(crate) struct State {
    /// Encoded bytes not yet taken by the writer, after `lead` bytes that are not records. Logical
    /// positions `pos - (pending.len() - lead) .. pos`.
    pending: Vec<u8>,
    /// Bytes at the start of `pending` put there by the writer so that the buffer can be written to the
    /// WAL as it is (see `Writer::seed`): alignment padding, then the WAL file's last partial block.
    lead: usize,
    /// WAL segment rolls inside `pending`: at byte offset `at` a new segment `base` starts (with its header).
    rolls: Vec<Roll>,
    /// Logical position of the end of everything appended.
    pos: u64,
    /// Base of the WAL segment appends currently go to.
    seg_base: u64,
    closing: bool,
}

#[derive(Debug, Clone, Copy)]
struct Roll {
    /// The previous segment's records end here; zero filler follows up to `at`, so that the new
    /// segment's bytes start at a block-aligned address and can be written in place too.
    end: usize,
    /// The new segment's header starts here.
    at: usize,
    base: u64,
}

/// A group written to the WAL, waiting for its fsync to be applied to the queue logs.
struct Group {
    buf: Vec<u8>,
    /// Records start at this offset of `buf`.
    lead: usize,
    rolls: Vec<Roll>,
    /// Where the group's first byte is in the WAL.
    place: WalPlace,
}

/// The durable watermark for blocking waiters (the watch channel serves async ones).
struct Durable {
    pos: u64,
    writer_stopped: bool,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub batches: AtomicU64,
    pub records: AtomicU64,
    pub groups: AtomicU64,
    pub bytes_written: AtomicU64,
    pub fsyncs: AtomicU64,
    pub checkpoints: AtomicU64,
    pub wal_segments: AtomicU64,
    pub wal_bytes: AtomicU64,
    pub queue_bytes: AtomicU64,
    pub segments_deleted: AtomicU64,
    pub seq_regressions: AtomicU64,
    pub lost_messages: AtomicU64,
    pub bytes_read: AtomicU64,
}

impl Counters {
    fn note_freed(&self, bytes: u64, files: u64) {
        let _ = self.queue_bytes.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| Some(b.saturating_sub(bytes)));
        self.segments_deleted.fetch_add(files, Ordering::Relaxed);
    }
}

pub(crate) struct Shared {
    /// Every file operation goes through it (the real file system, or a simulated disk in tests).
    pub disk: Disk,
    pub dir: PathBuf,
    pub wal: PathBuf,
    segment_size: u64,
    pub queue_segment_size: u64,
    checkpoint_bytes: u64,
    checkpoint_idle: Duration,
    pub active_segment_idle_ms: u64,
    sync: SyncPolicy,
    state: Mutex<State>,
    /// Wakes the writer (work arrived, or closing).
    work: Condvar,
    /// `pending` is over `MAX_PENDING_BYTES` (set by appenders, cleared by the writer when it takes it).
    behind: AtomicBool,
    /// Times the writer took the pending buffer while `behind` was set; wakes async waiters.
    catch_ups: AtomicU64,
    caught_up: tokio::sync::Notify,
    /// Whether a write waits for disk space (see `space`).
    pub space: Arc<crate::space::SpaceWatch>,
    durable: Mutex<Durable>,
    durable_cv: Condvar,
    durable_tx: watch::Sender<u64>,
    /// Position up to which records were applied to the queue logs: what [`crate::Store::read`] sees.
    /// Trails `durable_tx` by the time the writer takes to apply a group after its fsync.
    applied_tx: watch::Sender<u64>,
    /// With `applied_cv`: threads blocked in [`Shared::wait_applied`] (woken at each apply).
    applied_wait: Mutex<()>,
    applied_cv: Condvar,
    pub logs: QueueLogs,
    pub counters: Counters,
}

/// Where recovery left the WAL: the writer's starting point.
pub(crate) struct Start {
    pub file: Appender,
    pub base: u64,
    pub pos: u64,
    pub wal_bases: VecDeque<u64>,
    /// WAL position of the checkpoint recovery started from.
    pub checkpoint_pos: u64,
}

pub(crate) struct Sizes {
    pub segment_size: u64,
    pub queue_segment_size: u64,
    pub checkpoint_bytes: u64,
    /// A quiet store still checkpoints this often when something changed, so that consumed queue files
    /// and the WAL are reclaimed soon after a backlog drains.
    pub checkpoint_idle: Duration,
    pub active_segment_idle_ms: u64,
}

impl Shared {
    pub fn new(disk: Disk, dir: PathBuf, sizes: Sizes, sync: SyncPolicy, start: &Start, logs: QueueLogs) -> Shared {
        Shared {
            disk,
            wal: segment::wal_dir(&dir),
            dir,
            segment_size: sizes.segment_size,
            queue_segment_size: sizes.queue_segment_size,
            checkpoint_bytes: sizes.checkpoint_bytes,
            checkpoint_idle: sizes.checkpoint_idle,
            active_segment_idle_ms: sizes.active_segment_idle_ms,
            sync,
            state: Mutex::new(State {
                pending: Vec::new(),
                lead: 0,
                rolls: Vec::new(),
                pos: start.pos,
                seg_base: start.base,
                closing: false,
            }),
            work: Condvar::new(),
            behind: AtomicBool::new(false),
            catch_ups: AtomicU64::new(0),
            caught_up: tokio::sync::Notify::new(),
            space: Arc::default(),
            durable: Mutex::new(Durable { pos: start.pos, writer_stopped: false }),
            durable_cv: Condvar::new(),
            durable_tx: watch::Sender::new(start.pos),
            applied_tx: watch::Sender::new(start.pos),
            applied_wait: Mutex::new(()),
            applied_cv: Condvar::new(),
            logs,
            counters: Counters::default(),
        }
    }

    /// Copies `batch` into the pending buffer; returns the position its durability waits for.
    pub fn append(&self, batch: &mut Batch) -> Result<SyncTicket, StoreError> {
        if batch.largest_payload > Batch::max_payload() {
            return Err(StoreError::RecordTooLarge { len: batch.largest_payload, max: Batch::max_payload() });
        }
        batch.seal();
        if batch.is_empty() {
            let guard = self.state.lock();
            return if guard.closing { Err(StoreError::Closed) } else { Ok(guard.pos) };
        }
        let ticket = self.write_pending(&batch.records, &[&batch.tail])?;
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.records.fetch_add(batch.record_count(), Ordering::Relaxed);
        Ok(ticket)
    }

    /// Appends one enqueue record: its payload parts are copied once, straight into the pending buffer.
    pub fn append_enqueue(&self, queue: u64, seq: u64, timestamp_ms: u64, parts: &[&[u8]]) -> Result<SyncTicket, StoreError> {
        let payload_len: usize = parts.iter().map(|p| p.len()).sum();
        if payload_len > Batch::max_payload() {
            return Err(StoreError::RecordTooLarge { len: payload_len, max: Batch::max_payload() });
        }
        let head = format::encode_enqueue_head(queue, seq, timestamp_ms, payload_len, parts);
        let ticket = self.write_pending(&head, parts)?;
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.records.fetch_add(1, Ordering::Relaxed);
        Ok(ticket)
    }

    /// Copies encoded records (`first`, then `rest`) into the pending buffer under the lock, rolling to a
    /// new WAL segment first if the current one is full; wakes the writer. Returns the ticket. Never
    /// waits for the writer, however full the buffer (see `is_behind`).
    fn write_pending(&self, first: &[u8], rest: &[&[u8]]) -> Result<SyncTicket, StoreError> {
        let mut guard = self.state.lock();
        if guard.closing {
            return Err(StoreError::Closed);
        }
        let st = &mut *guard;
        if st.pos - st.seg_base >= self.segment_size {
            let base = st.pos;
            let end = st.pending.len();
            let filler = (BLOCK - (st.pending.as_ptr() as usize + end) % BLOCK) % BLOCK;
            st.pending.resize(end + filler, 0);
            st.rolls.push(Roll { end, at: st.pending.len(), base });
            st.pending.extend_from_slice(&format::encode_wal_header());
            st.pos += HEADER_SIZE as u64;
            st.seg_base = base;
        }
        for piece in std::iter::once(first).chain(rest.iter().copied()) {
            st.pending.extend_from_slice(piece);
            st.pos += piece.len() as u64;
        }
        let ticket = st.pos;
        if st.pending.len() > MAX_PENDING_BYTES && !self.behind.load(Ordering::Relaxed) {
            self.behind.store(true, Ordering::Relaxed);
        }
        drop(guard);
        self.work.notify_one();
        Ok(ticket)
    }

    /// Whether more than `MAX_PENDING_BYTES` wait to be written: the disk is slower than the appenders
    /// (or full). Cheap: one load of a flag that changes only when the state does.
    pub fn is_behind(&self) -> bool {
        self.behind.load(Ordering::Relaxed)
    }

    /// Returns once the writer has taken the pending buffer (at once if the store is not behind now).
    /// Not "once it is no longer behind": busy publishers fill it again at once, and a waiter must not
    /// starve; each waiter gets one turn per buffer the writer takes.
    pub async fn caught_up(&self) {
        let seen = self.catch_ups.load(Ordering::Acquire);
        loop {
            let notified = self.caught_up.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.is_behind() || self.catch_ups.load(Ordering::Acquire) != seen {
                return;
            }
            notified.await;
        }
    }

    /// Clears `behind` once the writer took the pending buffer: waiting publishers go on.
    fn took_pending(&self) {
        if self.behind.swap(false, Ordering::Relaxed) {
            self.catch_ups.fetch_add(1, Ordering::Release);
            self.caught_up.notify_waiters();
        }
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.durable_tx.subscribe()
    }

    pub fn wait_durable(&self, ticket: SyncTicket) -> Result<(), StoreError> {
        let mut d = self.durable.lock();
        while d.pos < ticket {
            if d.writer_stopped {
                return Err(StoreError::Closed);
            }
            self.durable_cv.wait(&mut d);
        }
        Ok(())
    }

    /// Asks the writer to flush everything and stop; new appends fail from now on.
    pub fn request_close(&self) {
        self.state.lock().closing = true;
        self.space.closing.store(true, Ordering::Relaxed);
        self.work.notify_one();
        // Appends fail from now on: nobody needs to wait for the buffer to drain.
        self.behind.store(false, Ordering::Relaxed);
        self.caught_up.notify_waiters();
    }

    pub fn subscribe_applied(&self) -> watch::Receiver<u64> {
        self.applied_tx.subscribe()
    }

    pub fn applied_pos(&self) -> u64 {
        *self.applied_tx.borrow()
    }

    /// Blocks the calling (non-async) thread until `pos` is applied (readable), at most `timeout`;
    /// whether it is. A writer that stopped makes everything "applied" (readers read what is there).
    pub fn wait_applied(&self, pos: u64, timeout: std::time::Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut guard = self.applied_wait.lock();
        while self.applied_pos() < pos {
            if self.applied_cv.wait_until(&mut guard, deadline).timed_out() {
                return self.applied_pos() >= pos;
            }
        }
        true
    }

    /// `applied_tx` moved: wakes the threads in `wait_applied` (under its lock: none misses it).
    fn applied(&self, pos: u64) {
        self.applied_tx.send_replace(pos);
        let _guard = self.applied_wait.lock();
        self.applied_cv.notify_all();
    }

    pub fn durable_pos(&self) -> u64 {
        self.durable.lock().pos
    }

    fn publish(&self, pos: u64) {
        self.durable.lock().pos = pos;
        self.durable_cv.notify_all();
        self.durable_tx.send_replace(pos);
    }
}

/// The test-only fsync delay from the environment (`FSYNC_DELAY_ENV`), announced loudly when set:
/// `<ms>`, or `file:<path>`: the milliseconds written in that file at each fsync (none while it
/// does not exist), so a test can slow a node's disk down once the node is where it wants it.
fn fsync_delay_for_tests() -> Option<FsyncDelay> {
    let value = crate::test_hooks::var(FSYNC_DELAY_ENV)?;
    let delay = match value.trim().strip_prefix("file:") {
        Some(path) => FsyncDelay::FromFile(path.into()),
        None => FsyncDelay::Fixed(Duration::from_millis(value.trim().parse().ok().filter(|ms| *ms > 0)?)),
    };
    tracing::warn!(?delay, "{FSYNC_DELAY_ENV} is set: every fsync of the message store is delayed (a test-only fault hook)");
    Some(delay)
}

/// See `fsync_delay_for_tests`.
#[derive(Debug)]
enum FsyncDelay {
    Fixed(Duration),
    FromFile(std::path::PathBuf),
}

impl Writer {
    fn delay_fsync(&self) {
        let d = match &self.fsync_delay {
            None => return,
            Some(FsyncDelay::Fixed(d)) => *d,
            Some(FsyncDelay::FromFile(path)) => match std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()) {
                Some(ms) => Duration::from_millis(ms),
                None => return,
            },
        };
        std::thread::sleep(d);
    }
}

thread_local! {
    /// Set on a writer thread whose store runs on a simulated disk (tests): a failed write or fsync
    /// then stops that thread (the store reports `Closed`) instead of aborting the test process.
    static STOP_INSTEAD_OF_ABORT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Logs and aborts: see the module docs for why I/O failures of the writer are never retried. On a
/// simulated disk it unwinds the writer thread instead; either way nothing after the failure is ever
/// reported durable.
pub(crate) fn fatal(what: &str, path: &std::path::Path, e: &dyn std::fmt::Display) -> ! {
    if STOP_INSTEAD_OF_ABORT.with(|c| c.get()) {
        tracing::warn!(error = %e, file = %path.display(), "{what} failed on the simulated disk; the writer stops");
        std::panic::resume_unwind(Box::new(WriterStopped));
    }
    tracing::error!(error = %e, file = %path.display(), "{what} failed in the message store; aborting so \
        that nothing is confirmed on top of data that may not be on disk");
    // Also straight to stderr: with no log subscriber (a test binary) or output capture, an abort
    // would otherwise leave no word of its cause.
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "warren-store: {what} failed ({}): {e}; aborting", path.display());
    std::process::abort();
}

/// The unwinding payload of a writer thread stopped by `fatal` on a simulated disk.
pub(crate) struct WriterStopped;

/// However the writer thread ends (its loop returns, or it unwinds), appenders and waiters learn that
/// nothing more becomes durable.
struct StopGuard<'a>(&'a Shared);

impl Drop for StopGuard<'_> {
    fn drop(&mut self) {
        self.0.state.lock().closing = true;
        // Appends fail from now on: publishers waiting for the buffer to drain go on (and fail).
        self.0.behind.store(false, Ordering::Relaxed);
        self.0.caught_up.notify_waiters();
        self.0.durable.lock().writer_stopped = true;
        self.0.durable_cv.notify_all();
        // Nothing more becomes readable either: readers waiting for a ticket go on (and read what is there).
        self.0.applied(u64::MAX);
    }
}

/// The writer thread's own state.
pub(crate) struct Writer {
    shared: Arc<Shared>,
    file: Appender,
    base: u64,
    buf: Vec<u8>,
    /// Bytes before the records in `buf` (see `State::lead`).
    lead: usize,
    rolls: Vec<Roll>,
    wal_bases: VecDeque<u64>,
    /// Position up to which records were applied to the queue logs.
    applied: u64,
    /// Group buffers the queue logs' tails point into, until the next checkpoint; and their size.
    retained: Vec<Bytes>,
    tail_bytes: u64,
    /// Queues that had an enqueue applied since the last checkpoint.
    tail_queues: HashSet<u64>,
    /// Group buffers to reuse (at most `SPARE_BUFFERS`), so a busy store does not page-fault in fresh ones.
    spare: Vec<Vec<u8>>,
    last_group_len: usize,
    /// Per kept WAL segment, the extent ranges its holes were last punched around.
    punched: HashMap<u64, Vec<(u64, u64)>>,
    /// Deletes checkpointed WAL segments and punches holes, off this thread.
    reclaimer: Reclaimer,
    /// (queue, WAL segment) of the last enqueue applied: whether the next one follows its own queue's
    /// (or one its run may go over, `crate::runs_over`).
    prev_enqueue: Option<(u64, u64)>,
    last_checkpoint_pos: u64,
    last_checkpoint: Instant,
    /// When a consumed segment kept only for its queue's retention may go (see
    /// `QueueLog::retention_ends_at`): a quiet store checkpoints then, so its disk space comes back.
    retention_ends: Option<Instant>,
    /// The WAL is durable up to here (the last fsync's end): what the next group's synced mark says.
    synced: u64,
    /// The test-only fsync delay (`FSYNC_DELAY_ENV`).
    fsync_delay: Option<FsyncDelay>,
}

impl Writer {
    pub fn new(shared: Arc<Shared>, start: Start) -> Writer {
        Writer {
            file: start.file,
            base: start.base,
            buf: Vec::new(),
            lead: 0,
            rolls: Vec::new(),
            wal_bases: start.wal_bases,
            applied: start.pos,
            retained: Vec::new(),
            tail_bytes: 0,
            tail_queues: HashSet::new(),
            spare: Vec::new(),
            last_group_len: 0,
            prev_enqueue: None,
            punched: HashMap::new(),
            reclaimer: Reclaimer::new(shared.clone()),
            last_checkpoint_pos: start.checkpoint_pos,
            // Recovery made everything it found durable before the writer starts.
            synced: start.pos,
            last_checkpoint: Instant::now(),
            // Recovery applied no retention: the first checkpoint looks.
            retention_ends: Some(Instant::now()),
            fsync_delay: fsync_delay_for_tests(),
            shared,
        }
    }

    /// The writer thread's loop: take a group, write it, fsync (per policy), publish, apply, checkpoint.
    pub fn run(mut self) {
        let shared = self.shared.clone();
        let _stopped = StopGuard(&shared);
        STOP_INSTEAD_OF_ABORT.with(|c| c.set(shared.disk.is_simulated()));
        crate::space::report_on_this_thread(self.shared.space.clone());
        let interval = match self.shared.sync {
            SyncPolicy::EveryBatch => None,
            SyncPolicy::IntervalMs(ms) => Some(Duration::from_millis(ms)),
        };
        let mut last_sync = Instant::now();
        // Written but not yet fsynced: (end position, the bytes and rolls to apply after the fsync).
        let mut unsynced: Option<u64> = None;
        let mut to_apply: Vec<Group> = Vec::new();
        loop {
            let (end, closing) = {
                let mut st = self.shared.state.lock();
                loop {
                    if st.pending.len() > st.lead || st.closing {
                        break;
                    }
                    let checkpoint_due = self.applied > self.last_checkpoint_pos
                        || self.shared.logs.any_dirty_hint();
                    let deadline = match (unsynced, interval) {
                        (Some(_), Some(iv)) => Some(last_sync + iv),
                        _ if checkpoint_due => Some(self.last_checkpoint + self.shared.checkpoint_idle),
                        _ => self.retention_checkpoint_at(),
                    };
                    match deadline {
                        Some(d) if Instant::now() >= d => break,
                        Some(d) => {
                            self.shared.work.wait_until(&mut st, d);
                        }
                        None => self.shared.work.wait(&mut st),
                    }
                }
                if self.buf.capacity() == 0 {
                    // Room for twice the last group, so appenders rarely regrow it (that copies it and
                    // loses the alignment the in-place write needs). Not more: a thousand small groups
                    // waiting for a checkpoint in huge buffers made the heap grow to 800 MB resident.
                    let capacity = (2 * self.last_group_len + 4 * BLOCK).min(GROUP_BUFFER_CAPACITY);
                    self.buf = self.spare.pop().unwrap_or_else(|| Vec::with_capacity(capacity));
                }
                if st.pending.len() > st.lead {
                    // The group ends with its synced mark (see `format`): recovery's evidence of what
                    // was durable before this group, whatever of the group itself survives a power cut.
                    let at = st.pos;
                    format::encode_synced(&mut st.pending, self.synced, at);
                    st.pos += format::SYNCED_RECORD_LEN as u64;
                }
                std::mem::swap(&mut st.pending, &mut self.buf);
                std::mem::swap(&mut st.rolls, &mut self.rolls);
                self.lead = st.lead;
                st.lead = self.seed(&mut st.pending);
                (st.pos, st.closing)
            };
            self.shared.took_pending();
            if self.buf.len() > self.lead {
                self.last_group_len = self.buf.len();
                // Bytes of the log in the buffer: without the seed and the filler before rolls.
                let filler: usize = self.rolls.iter().map(|r| r.at - r.end).sum();
                let records = (self.buf.len() - self.lead - filler) as u64;
                let place = WalPlace { base: self.base, offset: end - records - self.base };
                self.write_group();
                let buf = std::mem::take(&mut self.buf);
                to_apply.push(Group { buf, lead: self.lead, rolls: std::mem::take(&mut self.rolls), place });
                unsynced = Some(end);
            } else {
                self.buf.clear();
            }
            let sync_now = closing || interval.is_none_or(|iv| last_sync.elapsed() >= iv);
            if sync_now {
                if let Some(pos) = unsynced.take() {
                    self.sync_data();
                    last_sync = Instant::now();
                    self.shared.publish(pos);
                    self.synced = pos;
                    for group in std::mem::take(&mut to_apply) {
                        self.apply(group);
                    }
                    self.applied = pos;
                    self.shared.applied(pos);
                }
            }
            let quiet_due = (self.last_checkpoint.elapsed() >= self.shared.checkpoint_idle
                && (self.applied > self.last_checkpoint_pos || self.shared.logs.any_dirty_hint()))
                || self.retention_checkpoint_at().is_some_and(|at| Instant::now() >= at);
            let due_at = checkpoint_due_at(self.shared.checkpoint_bytes, self.tail_queues.len());
            if unsynced.is_none()
                && (closing || self.applied - self.last_checkpoint_pos >= due_at || self.tail_bytes >= due_at || quiet_due)
            {
                self.checkpoint(quiet_due && !closing);
            }
            if closing {
                break;
            }
        }
    }

    /// When a quiet store checkpoints to free segments whose retention ended: not before it ends,
    /// nor sooner than ten idle periods after the last checkpoint (queues whose retention ends one
    /// after another do not keep the store checkpointing).
    fn retention_checkpoint_at(&self) -> Option<Instant> {
        self.retention_ends.map(|at| at.max(self.last_checkpoint + 10 * self.shared.checkpoint_idle))
    }

    /// Prepares an empty buffer for appenders so that, once taken, it can be written to the WAL as it is
    /// (`O_DIRECT` wants block-aligned memory, offsets and lengths): padding up to an aligned address,
    /// then the partial block the WAL file will end with once the group just taken (`self.buf`) is
    /// written, which the next write must repeat. Returns the bytes put in (the next group's `lead`).
    fn seed(&self, fresh: &mut Vec<u8>) -> usize {
        if !self.file.is_direct() || !fresh.is_empty() {
            return 0;
        }
        let records = &self.buf[self.lead.min(self.buf.len())..];
        // The bytes from the start of the file's last block to its end, once `records` is written.
        let (before, after): (&[u8], &[u8]) = match self.rolls.last() {
            Some(roll) => (&[], &self.buf[roll.at..]),
            None => (self.file.partial_block(), records),
        };
        let carry = (before.len() + after.len()) % BLOCK;
        fresh.reserve(2 * BLOCK);
        let pad = fresh.as_ptr().align_offset(BLOCK);
        fresh.resize(pad, 0);
        if after.len() >= carry {
            fresh.extend_from_slice(&after[after.len() - carry..]);
        } else {
            fresh.extend_from_slice(&before[before.len() - (carry - after.len())..]);
            fresh.extend_from_slice(after);
        }
        pad + carry
    }

    /// Writes the taken buffer to the WAL, rolling to new segments where `append` placed rolls. Each
    /// part goes in place when it can (see `write_part`).
    fn write_group(&mut self) {
        let mut from = self.lead;
        let rolls = std::mem::take(&mut self.rolls);
        for roll in &rolls {
            self.write_part(from, roll.end, roll.at);
            // The old segment must be complete on disk before a newer one exists: recovery treats only the
            // newest segment's tail as torn.
            self.sync_data();
            let mut file = match segment::create_empty(&self.shared.disk, &self.shared.wal, roll.base) {
                Ok(f) => f,
                Err(e) => fatal("creating a WAL segment", &segment::path(&self.shared.wal, roll.base), &e),
            };
            file.reuse_memory_of(&mut self.file);
            self.shared.counters.wal_segments.fetch_add(1, Ordering::Relaxed);
            self.wal_bases.push_back(roll.base);
            self.file = file;
            self.base = roll.base;
            from = roll.at;
        }
        let len = self.buf.len();
        self.write_part(from, len, len);
        self.rolls = rolls;
        self.shared.counters.groups.fetch_add(1, Ordering::Relaxed);
    }

    /// Appends `buf[from..to]` to the current WAL file. In place (one `pwrite` from the buffer, no
    /// copy) when the buffer was prepared for it: the file's partial block sits right before `from`
    /// (`seed`), at a block-aligned address, and zeros may follow `to` up to the next block boundary
    /// (filler before `zeros_until`, or room to add them). Otherwise through the appender's own
    /// aligned buffer (a copy).
    fn write_part(&mut self, from: usize, to: usize, zeros_until: usize) {
        let carry = self.file.partial_block().len();
        let len = self.buf.len();
        let start = from.saturating_sub(carry);
        let padded_end = start + (to - start).div_ceil(BLOCK) * BLOCK;
        let in_place = self.file.is_direct()
            && from >= carry
            && (self.buf.as_ptr() as usize + start) % BLOCK == 0
            && self.buf[start..from] == *self.file.partial_block()
            // Zeros must follow `to` up to the block boundary: filler, or room to add them at the end
            // of the buffer without moving it.
            && (padded_end <= zeros_until || (to == len && padded_end <= self.buf.capacity()));
        let buf = std::mem::take(&mut self.buf);
        self.buf = if in_place {
            let mut buf = buf;
            buf.resize(padded_end.max(len), 0);
            if let Err(e) = self.file.write_blocks(&buf[start..padded_end], to - start) {
                fatal("writing", &segment::path(&self.shared.wal, self.base), &e);
            }
            buf.truncate(len);
            let n = (to - from) as u64;
            self.shared.counters.bytes_written.fetch_add(n, Ordering::Relaxed);
            self.shared.counters.wal_bytes.fetch_add(n, Ordering::Relaxed);
            buf
        } else {
            self.write(&buf[from..to]);
            buf
        };
    }

    fn write(&mut self, bytes: &[u8]) {
        if let Err(e) = self.file.append(bytes) {
            fatal("writing", &segment::path(&self.shared.wal, self.base), &e);
        }
        let n = bytes.len() as u64;
        self.shared.counters.bytes_written.fetch_add(n, Ordering::Relaxed);
        self.shared.counters.wal_bytes.fetch_add(n, Ordering::Relaxed);
    }

    fn sync_data(&mut self) {
        self.delay_fsync();
        if let Err(e) = self.file.sync_data() {
            fatal("fdatasync", &segment::path(&self.shared.wal, self.base), &e);
        }
        self.shared.counters.fsyncs.fetch_add(1, Ordering::Relaxed);
    }

    /// Applies the group to the queue logs, in log order: enqueues join their queue's in-memory tail
    /// (they are durable in the WAL; the checkpoint writes the still-live ones to the queue's files), acks
    /// and drops are applied.
    fn apply(&mut self, Group { buf, lead, rolls, place }: Group) {
        let now = crate::now_ms();
        let shared = self.shared.clone();
        let group = Bytes::from(buf);
        let mut last: Option<(u64, Arc<Mutex<crate::qlog::QueueLog>>)> = None;
        let mut prev_enqueue = self.prev_enqueue;
        // Where in the WAL a record at a given offset of the group buffer is.
        let wal_place = |at: usize| match rolls.iter().rev().find(|r| r.at <= at) {
            Some(roll) => WalPlace { base: roll.base, offset: (at - roll.at) as u64 },
            None => WalPlace { base: place.base, offset: place.offset + (at - lead) as u64 },
        };
        for_each_record(&group, lead, &rolls, |start, end, record| match record {
            Record::Enqueue { queue, seq, timestamp_ms, payload } => {
                let log = match &last {
                    Some((q, log)) if *q == queue => log.clone(),
                    _ => {
                        let log = shared.logs.get_or_create(&shared.dir, queue);
                        last = Some((queue, log.clone()));
                        self.tail_queues.insert(queue);
                        log
                    }
                };
                let place = wal_place(start);
                let follows_own = prev_enqueue.is_some_and(|(prev, base)| base == place.base && crate::runs_over(queue, prev));
                prev_enqueue = Some((queue, place.base));
                let pushed = log.lock().push_tail(group.slice(start..end), place, follows_own, seq, timestamp_ms, payload.len(), now);
                if let Err(regression) = pushed {
                    shared.counters.seq_regressions.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(queue, seq, next_seq = regression.next_seq, "{regression}");
                    debug_assert!(false, "{regression}");
                }
            }
            Record::Acks { .. } | Record::Drop { .. } | Record::Delivered { .. } | Record::Rewind { .. } => {
                last = None;
                apply_other(&shared, record, now);
            }
            Record::Synced { .. } => {}
        });
        self.prev_enqueue = prev_enqueue;
        self.tail_bytes += group.len() as u64;
        self.retained.push(group);
    }

    /// Makes the queue files durable (one `syncfs`), writes the checkpoint, deletes the WAL before it.
    fn checkpoint(&mut self, quiet: bool) {
        let shared = self.shared.clone();
        let now = crate::now_ms();
        let mut queues = Vec::new();
        let mut spilled = 0;
        let mut extents: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
        let mut compact_budget = crate::qlog::COMPACT_READ_BUDGET;
        let mut obsolete = Vec::new();
        let mut retention_ends: Option<u64> = None;
        for log in shared.logs.all() {
            let mut log = log.lock();
            match log.spill(now, shared.queue_segment_size) {
                Ok(n) => spilled += n,
                Err(e) => fatal("writing a queue segment", &crate::qlog::queue_dir(&shared.dir, log.id), &e),
            }
            match log.compact(now, shared.queue_segment_size, &mut compact_budget) {
                Ok(c) => {
                    spilled += c.bytes_written;
                    obsolete.extend(c.obsolete);
                }
                Err(e) => fatal("rewriting a sparse queue segment", &crate::qlog::queue_dir(&shared.dir, log.id), &e),
            }
            let (freed, files) = log.collect_garbage(now, true, shared.active_segment_idle_ms);
            shared.counters.note_freed(freed, files);
            if let Some(at) = log.retention_ends_at(now, shared.active_segment_idle_ms) {
                retention_ends = Some(retention_ends.map_or(at, |r| r.min(at)));
            }
            log.dirty = false;
            for (base, start, end) in log.extents() {
                extents.entry(base).or_default().push((start, end));
            }
            queues.push(QueueState::of(&log));
        }
        shared.counters.bytes_written.fetch_add(spilled, Ordering::Relaxed);
        shared.counters.queue_bytes.fetch_add(spilled, Ordering::Relaxed);
        shared.logs.clear_dirty_hint();
        // The group buffers the tails pointed into are free again: keep one for reuse.
        self.tail_bytes = 0;
        self.tail_queues.clear();
        for group in self.retained.drain(..) {
            if let Ok(mut b) = group.try_into_mut() {
                if self.spare.len() < SPARE_BUFFERS && b.capacity() <= MAX_RETAINED_BUFFER {
                    b.clear();
                    self.spare.push(Vec::from(b));
                }
            }
        }
        if quiet {
            self.spare.clear();
        }
        self.delay_fsync();
        if let Err(e) = shared.disk.syncfs(&shared.dir) {
            fatal("syncfs", &shared.dir, &e);
        }
        // By id, so the same store state always writes the same bytes (reproducible fuzzing inputs).
        queues.sort_unstable_by_key(|q| q.id);
        let cp = Checkpoint { wal_pos: self.applied, queues };
        if let Err(e) = checkpoint::write(&shared.disk, &shared.dir, &cp) {
            fatal("writing the checkpoint", &shared.dir.join(checkpoint::FILE), &e);
        }
        shared.counters.checkpoints.fetch_add(1, Ordering::Relaxed);
        // Rewritten segments' files: the checkpoint just written no longer names them (one left by a
        // failed deletion or a crash here is deleted at the next start, as a file no checkpoint names).
        for path in obsolete {
            let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            match shared.disk.remove_file(&path) {
                Ok(()) => shared.counters.note_freed(len, 1),
                Err(e) => tracing::warn!(error = %e, file = %path.display(), "could not delete a rewritten queue segment; it goes at the next start"),
            }
        }
        self.last_checkpoint_pos = self.applied;
        self.last_checkpoint = Instant::now();
        self.retention_ends = retention_ends.map(|at| self.last_checkpoint + Duration::from_millis(at.saturating_sub(now)));
        // WAL segments that end at or before the checkpoint are no longer needed, unless a queue's extent
        // is in them: deleted by the reclaimer (see `crate::reclaim`).
        let mut delete = Vec::new();
        let mut kept = VecDeque::with_capacity(self.wal_bases.len());
        while let Some(base) = self.wal_bases.pop_front() {
            let needed = self.wal_bases.front().is_none_or(|&next| next > self.applied) || extents.contains_key(&base);
            if needed {
                kept.push_back(base);
                continue;
            }
            delete.push(segment::path(&shared.wal, base));
        }
        self.wal_bases = kept;
        if !delete.is_empty() {
            self.reclaimer.submit(Job::Delete(delete));
        }
        self.punch_holes(extents);
    }
}

impl Writer {
    /// Has the disk blocks of kept WAL segments (wholly before the checkpoint) that no extent covers
    /// freed: other queues' records, consumed or copied elsewhere, must not stay on disk because a slow
    /// queue's extent keeps the file. Only where the covered ranges changed since the last time. (A
    /// segment's covered ranges only shrink once it is wholly before a checkpoint, so punching them
    /// later, in order, never frees what a newer checkpoint keeps.)
    fn punch_holes(&mut self, mut extents: HashMap<u64, Vec<(u64, u64)>>) {
        let applied = self.applied;
        let bases: Vec<u64> = self.wal_bases.iter().copied().collect();
        self.punched.retain(|base, _| bases.contains(base));
        for (i, &base) in bases.iter().enumerate() {
            if bases.get(i + 1).is_none_or(|&next| next > applied) {
                break; // the checkpoint is in this one: replay may still read it whole
            }
            let Some(mut ranges) = extents.remove(&base) else { continue };
            ranges.sort_unstable();
            let mut covered: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
            for (s, e) in ranges {
                match covered.last_mut() {
                    Some(last) if s <= last.1 => last.1 = last.1.max(e),
                    _ => covered.push((s, e)),
                }
            }
            let before = self.punched.insert(base, covered.clone());
            if before.as_ref() == Some(&covered) {
                continue;
            }
            self.reclaimer.submit(Job::Punch { path: segment::path(&self.shared.wal, base), covered, before });
        }
    }
}

/// Applies an acks or drop record to the queue logs and counts what it freed.
fn apply_other(shared: &Shared, record: Record<'_>, now_ms: u64) {
    match shared.logs.apply_gone(record, Some(now_ms), false, shared.active_segment_idle_ms) {
        Ok((freed, files)) => shared.counters.note_freed(freed, files),
        Err(e) => fatal("writing a queue segment", &shared.dir.join("queues"), &e),
    }
}

/// Calls `f(start, end, record)` for each record of a group buffer, skipping the WAL headers at rolls.
fn for_each_record(buf: &[u8], lead: usize, rolls: &[Roll], mut f: impl FnMut(usize, usize, Record<'_>)) {
    let mut pos = lead;
    let mut next_roll = rolls.iter().peekable();
    while pos < buf.len() {
        if let Some(roll) = next_roll.peek().filter(|r| r.end == pos) {
            pos = roll.at + HEADER_SIZE; // past the filler and the new segment's header
            next_roll.next();
            continue;
        }
        let end_of_run = next_roll.peek().map_or(buf.len(), |r| r.end);
        match format::decode_own_record(&buf[pos..end_of_run]) {
            Ok((record, n)) => {
                f(pos, pos + n, record);
                pos += n;
            }
            Err(e) => {
                // We encoded these bytes ourselves a moment ago: this is a bug, not disk damage.
                tracing::error!(error = %e, offset = pos, "undecodable record in the write buffer");
                return;
            }
        }
    }
}
