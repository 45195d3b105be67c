//! [`Store`]: the handle the broker holds: open (recover), append, wait for durability, close, stats.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::batch::Batch;
use crate::error::StoreError;
use crate::io::Disk;
use crate::qlog::ReadBatch;
use crate::recovery::{self, Recovery, RecoveryMode};
use crate::writer::{Shared, Sizes, Writer};
use crate::SyncTicket;

/// When the writer thread fsyncs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncPolicy {
    /// `fdatasync` after every group of batches (group commit); a batch is durable as soon as possible.
    #[default]
    EveryBatch,
    /// Records are still written as soon as they arrive, but `fdatasync` runs at most every `n` ms. The
    /// durable watermark only advances after such an fsync, so confirms wait up to `n` ms longer; nothing is
    /// ever reported durable before it is. What this trades: fewer fsyncs, higher confirm latency. A crash
    /// of the process alone loses nothing written; a crash of the machine loses at most the last interval,
    /// none of it confirmed.
    IntervalMs(u64),
}

/// How to open the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// A WAL segment is closed and a new one started once it has reached this many bytes (the batch that
    /// crosses it is not split, so a segment can end up somewhat larger).
    pub segment_size: u64,
    /// The same for each queue's segment files.
    pub queue_segment_size: u64,
    /// A checkpoint is taken after this many WAL bytes (and after a quiet second): it bounds both the WAL
    /// on disk and the work of recovery. Up to four times later when the records since the last one
    /// are spread over many queues (see `writer::checkpoint_due_at`).
    pub checkpoint_bytes: u64,
    /// ... and this long after the last one when anything changed, so disk is reclaimed when quiet.
    pub checkpoint_idle_ms: u64,
    /// A queue's consumed newest segment (under 1 MiB) is kept until the queue has had no enqueue for
    /// this long: deleting and recreating it at every checkpoint of a busy queue costs file-system work.
    pub active_segment_idle_ms: u64,
    pub sync: SyncPolicy,
    /// What recovery does with damaged data (see [`RecoveryMode`]).
    pub recovery_mode: RecoveryMode,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            segment_size: 32 << 20,
            queue_segment_size: 16 << 20,
            checkpoint_bytes: 32 << 20,
            checkpoint_idle_ms: 1000,
            active_segment_idle_ms: 10_000,
            sync: SyncPolicy::EveryBatch,
            recovery_mode: RecoveryMode::default(),
        }
    }
}

/// Counters since open (plus the current disk footprint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// WAL segment files on disk.
    pub wal_segments: u64,
    /// Bytes of WAL and of queue segment files on disk (written ones; pending bytes are not counted yet).
    pub wal_bytes: u64,
    pub queue_bytes: u64,
    /// Successful `append` calls with at least one record.
    pub batches: u64,
    /// Records appended.
    pub records: u64,
    /// Groups written by the writer thread (one WAL `write` per segment touched).
    pub groups: u64,
    /// Bytes written to the WAL and to queue segments.
    pub bytes_written: u64,
    /// `fdatasync` calls on WAL segments: one per group (EveryBatch) plus one per segment roll.
    pub fsyncs: u64,
    /// Checkpoints written (each one `syncfs`).
    pub checkpoints: u64,
    /// WAL and queue segment files deleted.
    pub segments_deleted: u64,
    /// Enqueues refused because their seq was below their queue's next one: always a bug in the caller,
    /// logged as an error (see `Store::append`).
    pub seq_regressions: u64,
    /// Messages lost with the bytes that held them since the store was opened: those recovery
    /// found missing (`Recovery::lost`) and those reads found damaged (`ReadBatch::lost`).
    pub lost_messages: u64,
    /// Bytes reads took from queue files and WAL extents (page cache or disk) since the store was
    /// opened.
    pub bytes_read: u64,
    /// The current durable watermark.
    pub durable: SyncTicket,
}

/// Handle to the message log. Cheap to clone; the writer thread stops on [`Store::close`] or when the last
/// handle is dropped.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// Holds the `flock` on the directory's LOCK file until the store is closed.
    lock: Mutex<Option<DirLock>>,
}

impl Store {
    /// Opens (creating) the store in `dir`: restores the queue logs from the last checkpoint, replays the WAL
    /// after it, truncates a torn tail of the newest WAL segment (logging what was dropped), and reports
    /// each queue's live range. Messages stay on disk; queues read them with [`Store::read`].
    pub fn open(dir: &Path, opts: StoreOptions) -> Result<(Store, Recovery), StoreError> {
        Store::open_on(dir, opts, Disk::real())
    }

    /// [`Store::open`] on a given [`Disk`]: tests pass a simulated one (see [`crate::sim`]).
    pub fn open_on(dir: &Path, opts: StoreOptions, disk: Disk) -> Result<(Store, Recovery), StoreError> {
        // The new directories' own entries must survive a crash too, or the whole store could vanish.
        crate::segment::create_dirs_durably(&disk, dir).map_err(StoreError::io("creating", dir))?;
        let lock = lock_dir(dir)?;
        let queue_segment_size = opts.queue_segment_size.max(4096);
        let (start, logs, recovery) = recovery::recover(&disk, dir, queue_segment_size, opts.recovery_mode)?;
        let sizes = Sizes {
            segment_size: opts.segment_size.max(4096),
            queue_segment_size,
            checkpoint_bytes: opts.checkpoint_bytes.max(4096),
            checkpoint_idle: std::time::Duration::from_millis(opts.checkpoint_idle_ms),
            active_segment_idle_ms: opts.active_segment_idle_ms,
        };
        let shared = Arc::new(Shared::new(disk, dir.to_path_buf(), sizes, opts.sync, &start, logs));
        let (wal_bytes, queue_bytes) = disk_usage(&shared);
        shared.counters.wal_bytes.store(wal_bytes, Ordering::Relaxed);
        shared.counters.queue_bytes.store(queue_bytes, Ordering::Relaxed);
        shared.counters.wal_segments.store(start.wal_bases.len() as u64, Ordering::Relaxed);
        let lost: u64 = recovery.lost.iter().fold(0, |sum, l| sum.saturating_add(l.messages));
        shared.counters.lost_messages.store(lost, Ordering::Relaxed);
        let writer = Writer::new(shared.clone(), start);
        let handle = std::thread::Builder::new()
            .name("warren-store-writer".into())
            .spawn(move || writer.run())
            .map_err(StoreError::io("starting the writer thread for", dir))?;
        if let SyncPolicy::IntervalMs(ms) = opts.sync {
            tracing::warn!(interval_ms = ms, "message store fsyncs on an interval: confirms wait for it");
        }
        let inner = Inner { shared, writer: Mutex::new(Some(handle)), lock: Mutex::new(Some(lock)) };
        Ok((Store { inner: Arc::new(inner) }, recovery))
    }

    /// Appends a batch. Enqueues get ids assigned in order. Returns the batch's `SyncTicket`: the batch is
    /// durable once `durable()` has reached it. Cheap: copies the records into the pending write buffer
    /// under a short lock and wakes the writer thread; never waits for I/O, so it may be called on an
    /// async runtime thread. Flow control is the caller's: see [`Store::is_behind`].
    ///
    /// ### To ensure correctness
    /// - Confirm a publish (or treat an ack as settled on disk) only once `durable()` is `>= ticket`; the
    ///   return value of `append` itself promises nothing about the disk.
    /// - Ids in `batch.ids()` are final as soon as `append` returns, durable or not; a crash before the
    ///   ticket is durable may lose the batch, and after such a crash ids above the last durable one can be
    ///   handed out again (no durable record ever referred to them).
    /// - Ack only ids this store returned; unknown or repeated acks are ignored, never an error.
    /// - Append each queue's enqueues in increasing seq order (gaps are fine: skipped seqs count as gone).
    ///   The store keeps a queue's messages in seq order; an enqueue below one already appended cannot be
    ///   kept: it is counted in `StoreStats::seq_regressions` and logged as an error, since it is a bug.
    pub fn append(&self, batch: &mut Batch) -> Result<SyncTicket, StoreError> {
        self.inner.shared.append(batch)
    }

    /// Appends one enqueue (the common case for a broker: one message at a time) without a [`Batch`]:
    /// the payload parts are copied once, straight into the write buffer, instead of being encoded into
    /// a batch and copied again. Same contract as [`Store::append`].
    pub fn append_enqueue(&self, queue: u64, seq: u64, timestamp_ms: u64, payload_parts: &[&[u8]]) -> Result<SyncTicket, StoreError> {
        self.inner.shared.append_enqueue(queue, seq, timestamp_ms, payload_parts)
    }

    /// Whether more than 16 MiB wait to be written (the disk is slower than the appenders, or full).
    /// Appends still succeed; callers that produce data (publishers) should wait for
    /// [`Store::caught_up`] before taking more, so that memory stays bounded. One atomic load.
    pub fn is_behind(&self) -> bool {
        self.inner.shared.is_behind()
    }

    /// Returns once the writer has taken the pending buffer and the store is no longer behind (at once
    /// if it is not behind now). For async callers; it never blocks a thread.
    pub async fn caught_up(&self) {
        self.inner.shared.caught_up().await
    }

    /// Whether a write of the store is waiting for disk space (it failed with `ENOSPC` or `EDQUOT` and
    /// is retried after a pause; nothing becomes durable meanwhile). The server raises its disk alarm.
    /// [`Store::close`] waits up to 5 s more for space, then the writer stops the process (what it
    /// could not write was never confirmed).
    pub fn waiting_for_space(&self) -> bool {
        self.inner.shared.space.waiting.load(Ordering::Relaxed)
    }

    /// The durable watermark: a `tokio::sync::watch::Receiver<u64>` whose value is the highest SyncTicket
    /// that is on disk (fsynced). Waiters compare their ticket to it.
    pub fn durable(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.shared.subscribe()
    }

    /// Whether `ticket` is durable now.
    pub fn is_durable(&self, ticket: SyncTicket) -> bool {
        self.inner.shared.durable_pos() >= ticket
    }

    /// The readable watermark: the highest SyncTicket whose enqueues [`Store::read`] sees. It trails
    /// `durable()` a little (the writer copies a group into the queue logs after its fsync), so a reader
    /// that found nothing where the caller knows it appended something waits for its ticket here.
    pub fn readable(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.shared.subscribe_applied()
    }

    /// Whether what the batch of `ticket` enqueued is visible to [`Store::read`] now.
    pub fn is_readable(&self, ticket: SyncTicket) -> bool {
        self.inner.shared.applied_pos() >= ticket
    }

    /// Blocks the calling (non-async) thread until what the batch of `ticket` enqueued is readable,
    /// at most `timeout`; whether it is. (Run it off the async runtime's workers.)
    pub fn wait_readable(&self, ticket: SyncTicket, timeout: std::time::Duration) -> bool {
        self.inner.shared.wait_applied(ticket, timeout)
    }

    /// Blocks the calling (non-async) thread until `ticket` is durable. For tests and shutdown.
    /// Fails with `Closed` if the writer stopped before the ticket became durable.
    pub fn wait_durable(&self, ticket: SyncTicket) -> Result<(), StoreError> {
        self.inner.shared.wait_durable(ticket)
    }

    /// Flushes and fsyncs everything pending, stops the writer thread. Called on graceful shutdown.
    /// Later appends fail with `Closed`; calling it again is harmless. Releases the directory lock.
    pub fn close(&self) -> Result<(), StoreError> {
        self.inner.close();
        Ok(())
    }

    pub fn stats(&self) -> StoreStats {
        let s = &self.inner.shared;
        let c = &s.counters;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        StoreStats {
            wal_segments: get(&c.wal_segments),
            wal_bytes: get(&c.wal_bytes),
            queue_bytes: get(&c.queue_bytes),
            batches: get(&c.batches),
            records: get(&c.records),
            groups: get(&c.groups),
            bytes_written: get(&c.bytes_written),
            fsyncs: get(&c.fsyncs),
            checkpoints: get(&c.checkpoints),
            segments_deleted: get(&c.segments_deleted),
            seq_regressions: get(&c.seq_regressions),
            lost_messages: get(&c.lost_messages),
            bytes_read: get(&c.bytes_read),
            durable: s.durable_pos(),
        }
    }

    /// Reads queue `queue`'s live messages from `from_seq` on, in order: at most `max_count` and about
    /// `max_bytes` of payload (at least one message if there is one). Only what the writer has already
    /// copied into the queue's files is visible: a message appended a moment ago may show up only on a
    /// later read, once [`Store::readable`] has reached its ticket. Gone seqs are skipped; `next_seq` says where to continue.
    pub fn read(&self, queue: u64, from_seq: u64, max_count: usize, max_bytes: usize) -> Result<ReadBatch, StoreError> {
        self.read_from(queue, from_seq..u64::MAX, max_count, max_bytes, false)
    }

    /// [`Store::read`] of the seqs below `end_seq` only, past the page cache (`O_DIRECT`, where the
    /// file system has it): for reads made ahead of delivery, off its path, several at once over
    /// consecutive ranges. Each read waits for the disk, but costs less CPU than filling the page
    /// cache with what is read once (queue files are written with `O_DIRECT` too). A read that
    /// reached `end_seq` returns `next_seq` at or past it.
    pub fn read_direct(&self, queue: u64, from_seq: u64, end_seq: u64, max_count: usize, max_bytes: usize) -> Result<ReadBatch, StoreError> {
        self.read_from(queue, from_seq..end_seq, max_count, max_bytes, true)
    }

    fn read_from(&self, queue: u64, seqs: std::ops::Range<u64>, max_count: usize, max_bytes: usize, direct: bool) -> Result<ReadBatch, StoreError> {
        crate::test_hooks::wait_while_reads_held();
        let Some(log) = self.inner.shared.logs.get(queue) else {
            return Ok(ReadBatch { next_seq: seqs.start, ..Default::default() });
        };
        let mut log = log.lock();
        let batch = log
            .read(seqs, max_count.max(1), max_bytes.max(1), direct)
            .map_err(StoreError::io("reading", crate::qlog::queue_dir(&self.inner.shared.dir, queue)))?;
        if batch.lost > 0 {
            self.inner.shared.counters.lost_messages.fetch_add(batch.lost, Ordering::Relaxed);
        }
        self.inner.shared.counters.bytes_read.fetch_add(batch.bytes_read, Ordering::Relaxed);
        Ok(batch)
    }

    /// The delivered mark of `queue` that is durable (see `Batch::delivered`): a mark appended is
    /// reported here only once the writer has applied it, after its fsync.
    pub fn delivered_until(&self, queue: u64) -> u64 {
        self.inner.shared.logs.get(queue).map_or(0, |log| log.lock().delivered_until)
    }

    /// The first seq of `queue` enqueued at or after `timestamp_ms` that is still on disk (consumed
    /// messages stay while the queue's retention keeps them), or the queue's next seq if there is none.
    pub fn seek_time(&self, queue: u64, timestamp_ms: u64) -> Result<Option<u64>, StoreError> {
        let Some(log) = self.inner.shared.logs.get(queue) else { return Ok(None) };
        let mut log = log.lock();
        log.seek_time(timestamp_ms)
            .map(Some)
            .map_err(StoreError::io("reading", crate::qlog::queue_dir(&self.inner.shared.dir, queue)))
    }

    /// Live messages of `queue` in `seqs`, in order (as [`Store::read`]): a rewound range
    /// ([`Store::take_rewound`]) is read this way.
    pub fn read_range(&self, queue: u64, seqs: std::ops::Range<u64>, max_count: usize, max_bytes: usize) -> Result<ReadBatch, StoreError> {
        self.read_from(queue, seqs, max_count, max_bytes, false)
    }

    /// The seq ranges of `queue` that rewinds ([`Batch::rewind`]) made live again since the last call,
    /// once they are readable: the queue delivers them again. Empty after a restart (what a rewind made
    /// live is simply live then).
    pub fn take_rewound(&self, queue: u64) -> Vec<(u64, u64)> {
        self.inner.shared.logs.get(queue).map(|log| log.lock().take_rewound()).unwrap_or_default()
    }

    /// The first message of `queue` still on disk (consumed or not) that was enqueued at or after
    /// `timestamp_ms`: (seq, enqueue time); None if there is none. Reads segments whole under the
    /// queue log's lock (a sparse time index is future work): for rewinds, not the message path.
    pub fn first_at_or_after(&self, queue: u64, timestamp_ms: u64) -> Result<Option<(u64, u64)>, StoreError> {
        let Some(log) = self.inner.shared.logs.get(queue) else { return Ok(None) };
        let mut log = log.lock();
        log.first_at_or_after(timestamp_ms).map_err(StoreError::io("reading", crate::qlog::queue_dir(&self.inner.shared.dir, queue)))
    }

    /// The consumed messages `queue` keeps for its retention (see [`Store::set_retention`]).
    pub fn retention_stats(&self, queue: u64) -> crate::RetentionStats {
        self.inner.shared.logs.get(queue).map(|log| log.lock().retention_stats()).unwrap_or_default()
    }

    /// Keeps `queue`'s consumed messages on disk for `retention_ms` after they were enqueued (0: delete
    /// them as soon as they are consumed). Takes effect for the queue's segments at the next checkpoint.
    pub fn set_retention(&self, queue: u64, retention_ms: u64) {
        let shared = &self.inner.shared;
        let log = shared.logs.get_or_create(&shared.dir, queue);
        let mut log = log.lock();
        if log.retention_ms != retention_ms {
            log.retention_ms = retention_ms;
            log.dirty = true;
            shared.logs.set_dirty_hint();
        }
    }

    /// The log directory.
    pub fn dir(&self) -> &Path {
        &self.inner.shared.dir
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.inner.shared.dir)
            .finish_non_exhaustive()
    }
}

impl Inner {
    fn close(&self) {
        let handle = self.writer.lock().take();
        if let Some(handle) = handle {
            self.shared.request_close();
            // The writer aborts the process on I/O errors, so a join error means it panicked: a bug (or,
            // on a simulated disk, it stopped after a failed write or fsync).
            match handle.join() {
                Ok(()) => {}
                Err(p) if p.is::<crate::writer::WriterStopped>() => {}
                Err(_) => tracing::error!("the message store writer thread panicked"),
            }
        }
        // Nothing is written after the writer stopped: another store may open the directory now.
        self.lock.lock().take();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.close();
    }
}

/// Bytes of WAL and of queue segment files on disk.
fn disk_usage(shared: &Shared) -> (u64, u64) {
    fn dir_bytes(p: &Path) -> u64 {
        let Ok(entries) = std::fs::read_dir(p) else { return 0 };
        entries
            .flatten()
            .map(|e| match e.metadata() {
                Ok(m) if m.is_dir() => dir_bytes(&e.path()),
                Ok(m) => m.len(),
                Err(_) => 0,
            })
            .sum()
    }
    (dir_bytes(&shared.wal), dir_bytes(&shared.dir.join("queues")))
}

/// Takes an exclusive `flock` on `dir/LOCK`: two stores appending to one log would interleave records.
fn lock_dir(dir: &Path) -> Result<DirLock, StoreError> {
    let path: PathBuf = dir.join("LOCK");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(StoreError::io("opening", &path))?;
    // SAFETY: flock on a file descriptor we own and keep open; no memory is involved.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(StoreError::Locked {
                path: dir.to_path_buf(),
            });
        }
        return Err(StoreError::Io {
            op: "locking",
            path,
            source: err,
        });
    }
    Ok(DirLock(file))
}

/// The store directory's `flock`, released explicitly when dropped. Closing the descriptor is not
/// enough: a process another thread is spawning holds a copy of it between its fork and its exec
/// (close-on-exec acts only at the exec), and the lock would stay until then, so a store reopened
/// right after `close` could be refused as `Locked`.
struct DirLock(File);

impl Drop for DirLock {
    fn drop(&mut self) {
        // SAFETY: flock on the descriptor this value owns; it is closed right after.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}
