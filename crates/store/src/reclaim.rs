//! Giving disk space back after a checkpoint, off the writer thread: deleting the WAL segments wholly
//! before it and punching holes in kept ones between their queues' extents. The writer decides what
//! goes (its `wal_bases` no longer name a segment it hands over); the file system's part is slow:
//! after three nodes drained a 500 MB backlog, one checkpoint deleted 25 segments of 32 MiB in
//! 211 ms, and while the writer did that no group commit was written, on each node at once (a
//! ~220 ms pause of the whole cluster, `bench/cluster.py` Q2). A crash before a deletion leaves a
//! segment that recovery keeps as one wholly before the checkpoint and a later checkpoint deletes,
//! as a crash between a checkpoint and its deletions always could.
//!
//! On a simulated disk (the crash-point and power-loss tests) the jobs run inline, on the writer
//! thread, so the order of file operations a test enumerates stays the same from run to run.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use crate::io::Open;
use crate::writer::{fatal, Shared};
use crate::direct::BLOCK;
use crate::segment;

/// Test-only: the reclaim thread waits this long before each checkpoint's deletions (announced loudly
/// when set), so a test can show that the writer goes on meanwhile.
const REMOVE_DELAY_ENV: &str = "WARREN_TEST_REMOVE_DELAY_MS";

pub(crate) enum Job {
    /// Delete these WAL segments, then fsync the WAL directory.
    Delete(Vec<PathBuf>),
    /// Free the whole blocks of this kept WAL segment outside `covered` (sorted, not overlapping),
    /// where they were not already freed around `before` (the ranges of the segment's last job).
    Punch { path: PathBuf, covered: Vec<(u64, u64)>, before: Option<Vec<(u64, u64)>> },
}

/// The thread that runs the jobs, in the order they were submitted.
pub(crate) struct Reclaimer {
    shared: Arc<Shared>,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Reclaimer {
    pub fn new(shared: Arc<Shared>) -> Reclaimer {
        if shared.disk.is_simulated() {
            return Reclaimer { shared, jobs: None, thread: None };
        }
        let (tx, rx) = mpsc::channel::<Job>();
        let on_thread = shared.clone();
        let delay = remove_delay_for_tests();
        match std::thread::Builder::new().name("warren-store-reclaim".into()).spawn(move || {
            for job in rx {
                if let (Some(d), Job::Delete(_)) = (delay, &job) {
                    std::thread::sleep(d);
                }
                run(&on_thread, job);
            }
        }) {
            Ok(thread) => Reclaimer { shared, jobs: Some(tx), thread: Some(thread) },
            Err(e) => {
                tracing::warn!(error = %e, "could not start the store's reclaim thread; the writer deletes WAL segments itself");
                Reclaimer { shared, jobs: None, thread: None }
            }
        }
    }

    pub fn submit(&self, job: Job) {
        match &self.jobs {
            Some(tx) => {
                if let Err(mpsc::SendError(job)) = tx.send(job) {
                    run(&self.shared, job);
                }
            }
            None => run(&self.shared, job),
        }
    }
}

impl Drop for Reclaimer {
    /// Waits for the jobs submitted: the writer ends before `Store::close` returns, and what the
    /// store's last checkpoint let go is then gone from the directory.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("the message store's reclaim thread panicked");
            }
        }
    }
}

fn remove_delay_for_tests() -> Option<std::time::Duration> {
    crate::test_hooks::millis(REMOVE_DELAY_ENV, "the store's WAL segment deletions are delayed")
}

fn run(shared: &Shared, job: Job) {
    match job {
        Job::Delete(segments) => {
            let mut deleted = false;
            for path in segments {
                let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                if let Err(e) = shared.disk.remove_file(&path) {
                    // Recovery keeps it (wholly before the checkpoint) and a later checkpoint deletes it.
                    tracing::warn!(error = %e, file = %path.display(), "could not delete a checkpointed WAL segment; it goes after the next start");
                    continue;
                }
                let c = &shared.counters;
                c.wal_bytes.fetch_sub(len.min(c.wal_bytes.load(Ordering::Relaxed)), Ordering::Relaxed);
                c.wal_segments.fetch_sub(1, Ordering::Relaxed);
                c.segments_deleted.fetch_add(1, Ordering::Relaxed);
                deleted = true;
            }
            if deleted {
                if let Err(e) = segment::sync_dir(&shared.disk, &shared.wal) {
                    fatal("fsyncing the WAL directory", &shared.wal, &e);
                }
            }
        }
        Job::Punch { path, covered, before } => {
            if let Err(e) = punch(shared, &path, &covered, before.as_deref()) {
                // Not supported here, or failed: the space comes back when the segment is deleted.
                tracing::debug!(error = %e, file = %path.display(), "could not punch holes in a WAL segment");
            }
        }
    }
}

/// Holes smaller than this are not punched. Between the extents of Raft groups' logs (runs of a record
/// or a few, interleaved with a thousand other groups') a hole frees a block or two for a system call,
/// and every checkpoint punched them all again: ~1,500 `fallocate` calls a second, ~7% of a core, in
/// `bench/cluster.py` Q4. What a small gap holds comes back when its segment is deleted.
const MIN_HOLE: u64 = 256 << 10;

fn punch(shared: &Shared, path: &std::path::Path, covered: &[(u64, u64)], before: Option<&[(u64, u64)]>) -> std::io::Result<()> {
    let file = shared.disk.open(path, Open::Existing, false)?;
    let len = file.len()?;
    let punched = before.map(|b| holes(b, len)).unwrap_or_default();
    for (a, b) in holes(covered, len) {
        if !punched.iter().any(|&(pa, pb)| pa <= a && b <= pb) {
            file.punch_hole(a, b - a)?;
        }
    }
    Ok(())
}

/// The runs of whole blocks, at least [`MIN_HOLE`] long, of a file of `len` bytes strictly between
/// the `covered` ranges (sorted, not overlapping).
fn holes(covered: &[(u64, u64)], len: u64) -> Vec<(u64, u64)> {
    let block = BLOCK as u64;
    let mut holes = Vec::new();
    let mut from = 0u64;
    for &(s, e) in covered.iter().chain(std::iter::once(&(len, len))) {
        // Within the file: a damaged checkpoint can claim an extent ending anywhere, and rounding
        // that up overflowed (in release, to a hole over the whole segment).
        let (s, e) = (s.min(len), e.min(len));
        let (a, b) = (from.div_ceil(block) * block, s / block * block);
        if b >= a + MIN_HOLE {
            holes.push((a, b));
        }
        from = e;
    }
    holes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holes_are_whole_blocks_between_extents_and_small_gaps_stay() {
        let (block, len) = (BLOCK as u64, 4u64 << 20);
        let large_gap_end = (400 << 10) + MIN_HOLE + block + 7;
        // The 64 KiB gap (Raft entries of other groups, say) stays; the large one is rounded in to
        // whole blocks; the end of the file past the last extent goes.
        let covered = [(100, 200), (200 + (64 << 10), 400 << 10), (large_gap_end, 3 << 20)];
        assert_eq!(holes(&covered, len), vec![(400 << 10, large_gap_end / block * block), (3 << 20, len)]);
        // Nothing covered: the whole file; an extent claimed past the end: no hole past it.
        assert_eq!(holes(&[], len), vec![(0, len)]);
        assert_eq!(holes(&[(block, len + 1_000_000)], len), vec![]);
    }
}
