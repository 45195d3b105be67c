//! The pending write buffer and the writer thread: group commit.
//!
//! `append` copies a batch's encoded records into `State::pending` under a short lock (assigning ids and
//! sealing CRCs there, so log order is id order) and wakes the writer. The writer swaps `pending` with its
//! own empty buffer (double buffering: appenders keep filling one while the other is written), writes it
//! with one `write_all` per segment touched, `fdatasync`s once, and then publishes the end position as the
//! durable watermark. Everything appended while that fsync runs forms the next group, so N concurrent
//! appenders cost about one fsync per fsync-latency, not one per batch.
//!
//! ### To ensure correctness
//! - The watermark is published only after the fsync that covers it returned; a ticket is never reported
//!   durable otherwise.
//! - A failed `write` or `fsync` aborts the process: after a failed fsync the kernel may have dropped the
//!   dirty pages and cleared the error, so a retry can "succeed" without the data ever reaching disk (the
//!   PostgreSQL fsync-gate). Confirms must not go out on top of that; recovery from the files is the only
//!   safe continuation, and it starts on the next boot.
//! - A segment is fsynced before the next one is created, so only the newest segment can have a torn tail.
//!
//! Lock order: `State` then `Durable`; never the reverse. Neither is held across I/O.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tokio::sync::watch;

use crate::batch::Batch;
use crate::error::StoreError;
use crate::format::{self, HEADER_SIZE};
use crate::segment::{self, SegmentTable};
use crate::store::SyncPolicy;
use crate::{MsgId, SyncTicket};

/// Above this many pending bytes `append` waits for the writer (the disk cannot keep up): memory stays
/// bounded instead of growing with the backlog.
pub(crate) const MAX_PENDING_BYTES: usize = 64 << 20;
/// The writer gives back buffer capacity above this after a burst.
const MAX_RETAINED_BUFFER: usize = 8 << 20;

/// State shared by appenders and the writer, under one mutex.
pub(crate) struct State {
    /// Encoded bytes not yet taken by the writer. Logical positions `pos - pending.len() .. pos`.
    pending: Vec<u8>,
    /// Segment rolls inside `pending`: at byte offset `at` a new segment `base` starts (with its header).
    rolls: Vec<Roll>,
    /// `pending` holds acks (after writing it, the writer looks for segments to delete).
    pending_acks: bool,
    /// Logical position of the end of everything appended.
    pos: u64,
    /// Base of the segment appends currently go to.
    seg_base: u64,
    next_id: MsgId,
    segments: SegmentTable,
    closing: bool,
}

#[derive(Debug, Clone, Copy)]
struct Roll {
    at: usize,
    base: u64,
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
    pub dir_fsyncs: AtomicU64,
    pub segments: AtomicU64,
    pub segments_deleted: AtomicU64,
    pub bytes_on_disk: AtomicU64,
}

pub(crate) struct Shared {
    pub dir: PathBuf,
    segment_size: u64,
    sync: SyncPolicy,
    state: Mutex<State>,
    /// Wakes the writer (work arrived, or closing).
    work: Condvar,
    /// Wakes appenders waiting for `pending` to drain.
    space: Condvar,
    durable: Mutex<Durable>,
    durable_cv: Condvar,
    durable_tx: watch::Sender<u64>,
    pub counters: Counters,
}

/// Where recovery left the log: the writer's starting point.
pub(crate) struct Start {
    pub file: File,
    pub base: u64,
    pub pos: u64,
    pub next_id: MsgId,
    pub segments: SegmentTable,
    pub bytes_on_disk: u64,
}

impl Shared {
    pub fn new(dir: PathBuf, segment_size: u64, sync: SyncPolicy, start: &mut Start) -> Shared {
        let counters = Counters::default();
        counters
            .segments
            .store(start.segments.len() as u64, Ordering::Relaxed);
        counters
            .bytes_on_disk
            .store(start.bytes_on_disk, Ordering::Relaxed);
        Shared {
            dir,
            segment_size,
            sync,
            state: Mutex::new(State {
                pending: Vec::new(),
                rolls: Vec::new(),
                pending_acks: false,
                pos: start.pos,
                seg_base: start.base,
                next_id: start.next_id,
                segments: std::mem::take(&mut start.segments),
                closing: false,
            }),
            work: Condvar::new(),
            space: Condvar::new(),
            durable: Mutex::new(Durable {
                pos: start.pos,
                writer_stopped: false,
            }),
            durable_cv: Condvar::new(),
            durable_tx: watch::Sender::new(start.pos),
            counters,
        }
    }

    /// Copies `batch` into the pending buffer, assigning ids; returns the position its durability waits for.
    pub fn append(&self, batch: &mut Batch) -> Result<SyncTicket, StoreError> {
        if batch.largest_payload > Batch::max_payload() {
            return Err(StoreError::RecordTooLarge {
                len: batch.largest_payload,
                max: Batch::max_payload(),
            });
        }
        batch.ids.clear();
        batch.ack_records.clear();
        format::encode_acks(&mut batch.ack_records, &batch.acks);
        let mut guard = self.state.lock();
        while guard.pending.len() > MAX_PENDING_BYTES && !guard.closing {
            self.space.wait(&mut guard);
        }
        if guard.closing {
            return Err(StoreError::Closed);
        }
        if batch.is_empty() {
            return Ok(guard.pos);
        }
        let st = &mut *guard;
        if st.pos - st.seg_base >= self.segment_size {
            let base = st.pos;
            st.rolls.push(Roll {
                at: st.pending.len(),
                base,
            });
            st.pending
                .extend_from_slice(&format::encode_header(st.next_id));
            st.pos += HEADER_SIZE as u64;
            st.seg_base = base;
            st.segments.push(base, st.next_id);
        }
        let start = st.pending.len();
        st.pending.extend_from_slice(&batch.records);
        for e in &batch.enqueues {
            let id = st.next_id;
            st.next_id += 1;
            format::seal_enqueue(
                &mut st.pending[start + e.offset..],
                id,
                e.tail_crc,
                e.tail_len,
            );
            st.segments.enqueue(id);
            batch.ids.push(id);
        }
        if !batch.acks.is_empty() {
            st.pending.extend_from_slice(&batch.ack_records);
            for &id in &batch.acks {
                st.segments.ack(id);
            }
            st.pending_acks = true;
        }
        st.pos += batch.encoded_len() as u64;
        let ticket = st.pos;
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.records.fetch_add(
            batch.enqueues.len() as u64 + u64::from(!batch.acks.is_empty()),
            Ordering::Relaxed,
        );
        drop(guard);
        self.work.notify_one();
        Ok(ticket)
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
        self.work.notify_one();
        self.space.notify_all();
    }

    pub fn durable_pos(&self) -> u64 {
        self.durable.lock().pos
    }

    pub fn live_messages(&self) -> u64 {
        self.state.lock().segments.live_messages()
    }

    fn publish(&self, pos: u64) {
        self.durable.lock().pos = pos;
        self.durable_cv.notify_all();
        self.durable_tx.send_replace(pos);
    }
}

/// Logs and aborts: see the module docs for why I/O failures of the writer are never retried.
fn fatal(what: &str, path: &std::path::Path, e: &std::io::Error) -> ! {
    tracing::error!(error = %e, file = %path.display(), "{what} failed in the message store; aborting so \
        that nothing is confirmed on top of data that may not be on disk");
    std::process::abort();
}

/// The writer thread's own state.
pub(crate) struct Writer {
    shared: Arc<Shared>,
    file: File,
    base: u64,
    buf: Vec<u8>,
    rolls: Vec<Roll>,
}

impl Writer {
    pub fn new(shared: Arc<Shared>, file: File, base: u64) -> Writer {
        Writer {
            shared,
            file,
            base,
            buf: Vec::new(),
            rolls: Vec::new(),
        }
    }

    /// The writer thread's loop: take a group, write it, fsync (per policy), publish, delete dead segments.
    pub fn run(mut self) {
        let interval = match self.shared.sync {
            SyncPolicy::EveryBatch => None,
            SyncPolicy::IntervalMs(ms) => Some(Duration::from_millis(ms)),
        };
        let mut last_sync = Instant::now();
        // Written but not yet fsynced: the position to publish after the next fsync.
        let mut unsynced: Option<u64> = None;
        let mut gc_due = false;
        loop {
            let (end, closing) = {
                let mut st = self.shared.state.lock();
                loop {
                    if !st.pending.is_empty() || st.closing {
                        break;
                    }
                    match (unsynced, interval) {
                        (Some(_), Some(iv)) => {
                            let deadline = last_sync + iv;
                            if Instant::now() >= deadline {
                                break;
                            }
                            self.shared.work.wait_until(&mut st, deadline);
                        }
                        _ => self.shared.work.wait(&mut st),
                    }
                }
                std::mem::swap(&mut st.pending, &mut self.buf);
                std::mem::swap(&mut st.rolls, &mut self.rolls);
                gc_due |= std::mem::take(&mut st.pending_acks);
                (st.pos, st.closing)
            };
            self.shared.space.notify_all();
            if !self.buf.is_empty() {
                gc_due |= !self.rolls.is_empty();
                self.write_group();
                unsynced = Some(end);
            }
            let sync_now = closing || interval.is_none_or(|iv| last_sync.elapsed() >= iv);
            if sync_now {
                if let Some(pos) = unsynced.take() {
                    self.sync_data();
                    last_sync = Instant::now();
                    self.shared.publish(pos);
                    if std::mem::take(&mut gc_due) {
                        self.delete_dead_segments();
                    }
                }
            }
            if closing {
                break;
            }
        }
        self.shared.durable.lock().writer_stopped = true;
        self.shared.durable_cv.notify_all();
    }

    /// Writes the taken buffer, rolling to new segments where `append` placed rolls.
    fn write_group(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let rolls = std::mem::take(&mut self.rolls);
        let mut from = 0;
        for roll in &rolls {
            self.write(&buf[from..roll.at]);
            // The old segment must be complete on disk before a newer one exists: recovery treats only the
            // newest segment's tail as torn.
            self.sync_data();
            let file = match segment::create_empty(&self.shared.dir, roll.base) {
                Ok(f) => f,
                Err(StoreError::Io { op, path, source }) => fatal(op, &path, &source),
                Err(e) => fatal(
                    "creating a segment",
                    &segment::path(&self.shared.dir, roll.base),
                    &std::io::Error::other(e),
                ),
            };
            self.shared
                .counters
                .dir_fsyncs
                .fetch_add(1, Ordering::Relaxed);
            self.shared
                .counters
                .segments
                .fetch_add(1, Ordering::Relaxed);
            self.file = file;
            self.base = roll.base;
            from = roll.at;
        }
        self.write(&buf[from..]);
        self.shared.counters.groups.fetch_add(1, Ordering::Relaxed);
        self.buf = buf;
        self.buf.clear();
        if self.buf.capacity() > MAX_RETAINED_BUFFER {
            self.buf.shrink_to(MAX_RETAINED_BUFFER);
        }
        self.rolls = rolls;
        self.rolls.clear();
    }

    fn write(&mut self, bytes: &[u8]) {
        if let Err(e) = self.file.write_all(bytes) {
            fatal("writing", &segment::path(&self.shared.dir, self.base), &e);
        }
        let n = bytes.len() as u64;
        self.shared
            .counters
            .bytes_written
            .fetch_add(n, Ordering::Relaxed);
        self.shared
            .counters
            .bytes_on_disk
            .fetch_add(n, Ordering::Relaxed);
    }

    fn sync_data(&mut self) {
        if let Err(e) = self.file.sync_data() {
            fatal("fdatasync", &segment::path(&self.shared.dir, self.base), &e);
        }
        self.shared.counters.fsyncs.fetch_add(1, Ordering::Relaxed);
    }

    /// Deletes the oldest segments once they and all before them hold no live message.
    fn delete_dead_segments(&mut self) {
        let mut dead = self
            .shared
            .state
            .lock()
            .segments
            .take_dead_prefix(self.base);
        if dead.is_empty() {
            return;
        }
        let mut deleted = 0;
        for seg in &dead {
            let p = segment::path(&self.shared.dir, seg.base);
            let len = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
            if let Err(e) = std::fs::remove_file(&p) {
                // Not fatal, but nothing after it may be deleted either: if a later segment (holding the
                // acks of this one's messages) went while this one stayed, those messages would come back.
                tracing::warn!(error = %e, file = %p.display(), "could not delete a fully acked segment; will retry");
                break;
            }
            deleted += 1;
            let _ = self.shared.counters.bytes_on_disk.fetch_update(
                Ordering::Relaxed,
                Ordering::Relaxed,
                |b| Some(b.saturating_sub(len)),
            );
            self.shared
                .counters
                .segments
                .fetch_sub(1, Ordering::Relaxed);
            self.shared
                .counters
                .segments_deleted
                .fetch_add(1, Ordering::Relaxed);
            tracing::debug!(file = %p.display(), bytes = len, "deleted fully acked segment");
        }
        if deleted < dead.len() {
            self.shared
                .state
                .lock()
                .segments
                .restore_front(dead.split_off(deleted));
        }
        if deleted > 0 {
            // The deletions must be durable in order, for the same reason as above: fatal like any fsync.
            if let Err(StoreError::Io { op, path, source }) = segment::sync_dir(&self.shared.dir) {
                fatal(op, &path, &source);
            }
            self.shared
                .counters
                .dir_fsyncs
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}
