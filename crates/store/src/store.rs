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
use crate::recovery::{self, Recovery};
use crate::writer::{Shared, Writer};
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
    /// A segment is closed and a new one started once it has reached this many bytes (the batch that
    /// crosses it is not split, so a segment can end up somewhat larger).
    pub segment_size: u64,
    pub sync: SyncPolicy,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            segment_size: 64 << 20,
            sync: SyncPolicy::EveryBatch,
        }
    }
}

/// Counters since open (plus the current disk footprint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Segment files on disk.
    pub segments: u64,
    /// Bytes of segment files on disk (written ones; pending bytes are not counted yet).
    pub bytes_on_disk: u64,
    /// Enqueued, not yet acked messages.
    pub live_messages: u64,
    /// Successful `append` calls with at least one record.
    pub batches: u64,
    /// Records appended (each enqueue, and one acks record per batch with acks).
    pub records: u64,
    /// Groups written by the writer thread (one `write` per segment touched).
    pub groups: u64,
    pub bytes_written: u64,
    /// `fdatasync` calls on segment files: one per group (EveryBatch) plus one per segment roll.
    pub fsyncs: u64,
    /// `fsync` calls on the directory (segment creation and deletion).
    pub dir_fsyncs: u64,
    pub segments_deleted: u64,
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
    lock: Mutex<Option<File>>,
}

impl Store {
    /// Opens (creating) the log in `dir`, replays every segment, truncates a torn/garbled tail of the newest
    /// segment to the last valid record (logging what was dropped), and returns the live messages.
    pub fn open(dir: &Path, opts: StoreOptions) -> Result<(Store, Recovery), StoreError> {
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(StoreError::io("creating", dir))?;
            // The new directory's own entry must survive a crash too, or the whole log could vanish.
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                crate::segment::sync_dir(parent)?;
            }
        }
        let lock = lock_dir(dir)?;
        let (mut start, recovery) = recovery::recover(dir)?;
        let file = start
            .file
            .try_clone()
            .map_err(StoreError::io("opening", dir))?;
        let base = start.base;
        let shared = Arc::new(Shared::new(
            dir.to_path_buf(),
            opts.segment_size.max(1),
            opts.sync,
            &mut start,
        ));
        drop(start);
        let writer = Writer::new(shared.clone(), file, base);
        let handle = std::thread::Builder::new()
            .name("warren-store-writer".into())
            .spawn(move || writer.run())
            .map_err(StoreError::io("starting the writer thread for", dir))?;
        if let SyncPolicy::IntervalMs(ms) = opts.sync {
            tracing::warn!(
                interval_ms = ms,
                "message store fsyncs on an interval: confirms wait for it"
            );
        }
        let inner = Inner {
            shared,
            writer: Mutex::new(Some(handle)),
            lock: Mutex::new(Some(lock)),
        };
        Ok((
            Store {
                inner: Arc::new(inner),
            },
            recovery,
        ))
    }

    /// Appends a batch. Enqueues get ids assigned in order. Returns the batch's `SyncTicket`: the batch is
    /// durable once `durable()` has reached it. Cheap: copies the records into the pending write buffer
    /// under a short lock and wakes the writer thread; never waits for I/O, except as flow control when
    /// more than 64 MiB are already waiting to be written.
    ///
    /// ### To ensure correctness
    /// - Confirm a publish (or treat an ack as settled on disk) only once `durable()` is `>= ticket`; the
    ///   return value of `append` itself promises nothing about the disk.
    /// - Ids in `batch.ids()` are final as soon as `append` returns, durable or not; a crash before the
    ///   ticket is durable may lose the batch, and after such a crash ids above the last durable one can be
    ///   handed out again (no durable record ever referred to them).
    /// - Ack only ids this store returned; unknown or repeated acks are ignored, never an error.
    pub fn append(&self, batch: &mut Batch) -> Result<SyncTicket, StoreError> {
        self.inner.shared.append(batch)
    }

    /// The durable watermark: a `tokio::sync::watch::Receiver<u64>` whose value is the highest SyncTicket
    /// that is on disk (fsynced). Waiters compare their ticket to it.
    pub fn durable(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.shared.subscribe()
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
            segments: get(&c.segments),
            bytes_on_disk: get(&c.bytes_on_disk),
            live_messages: s.live_messages(),
            batches: get(&c.batches),
            records: get(&c.records),
            groups: get(&c.groups),
            bytes_written: get(&c.bytes_written),
            fsyncs: get(&c.fsyncs),
            dir_fsyncs: get(&c.dir_fsyncs),
            segments_deleted: get(&c.segments_deleted),
            durable: s.durable_pos(),
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
            // The writer aborts the process on I/O errors, so a join error means it panicked: a bug.
            if handle.join().is_err() {
                tracing::error!("the message store writer thread panicked");
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

/// Takes an exclusive `flock` on `dir/LOCK`: two stores appending to one log would interleave records.
fn lock_dir(dir: &Path) -> Result<File, StoreError> {
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
    Ok(file)
}
