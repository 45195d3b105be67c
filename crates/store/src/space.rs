//! A full disk: file writes that fail with `ENOSPC` (or `EDQUOT`) wait for space and try again.
//!
//! Such a write did not happen (or only partly, at offsets the retry writes again with the same
//! bytes), so nothing was lost and trying again later is safe: every store write goes to an explicit
//! offset (`pwrite`) or recreates its file from scratch. The retries sit in the I/O layer (`io`), so
//! every writer of the store (WAL groups, segment creation, checkpoints copying records into queue
//! files, the checkpoint file) waits instead of failing half-way. While a write waits, the writer thread takes
//! no new group, publishes no durable watermark (so nothing is confirmed meanwhile), and the store
//! reports [`Store::waiting_for_space`](crate::Store::waiting_for_space): the server raises its disk
//! alarm, and publishers wait because the pending buffer is over its cap.
//!
//! This is for writes only. A failed `fsync` is never retried, whatever its error: the kernel may have
//! dropped the dirty pages and cleared the error, so a retry can "succeed" with the data lost (the
//! writer aborts instead, see `writer.rs`).

use std::cell::RefCell;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// First pause before a retry; doubled up to `MAX_PAUSE`.
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const MAX_PAUSE: Duration = Duration::from_secs(1);
/// How often a write still waiting says so in the log.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Once the store is closing, a write still waits this long for space, then fails (the writer then
/// stops the process: nothing it could not write was confirmed).
const GRACE_WHEN_CLOSING: Duration = Duration::from_secs(5);

/// What a store and its writer thread share about space.
#[derive(Default)]
pub(crate) struct SpaceWatch {
    /// A write waits for space now.
    pub waiting: AtomicBool,
    /// The store is closing: stop waiting after `GRACE_WHEN_CLOSING`.
    pub closing: AtomicBool,
}

thread_local! {
    /// The watch of the store whose writer runs on this thread (see [`report_on_this_thread`]).
    static WATCH: RefCell<Option<Arc<SpaceWatch>>> = const { RefCell::new(None) };
}

/// Makes retries on this thread report to `watch`: called once by a store's writer thread.
pub(crate) fn report_on_this_thread(watch: Arc<SpaceWatch>) {
    WATCH.with(|w| *w.borrow_mut() = Some(watch));
}

fn with_watch<T>(f: impl FnOnce(&SpaceWatch) -> T) -> Option<T> {
    WATCH.with(|w| w.borrow().as_deref().map(f))
}

/// Whether `e` means the file system (or the user's quota) has no room for the write.
pub(crate) fn is_out_of_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// Runs `op` (a write, or a file or directory creation) until it does not fail for lack of space,
/// pausing in between. Other errors are returned as they are. `op` must be safe to repeat after a
/// failure: writes at fixed offsets, or creating a file with truncation.
pub(crate) fn retry_while_full<T>(what: &str, path: &Path, mut op: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let mut pause = FIRST_PAUSE;
    let mut waiting_since: Option<Instant> = None;
    let mut last_log = Instant::now();
    let mut closing_since: Option<Instant> = None;
    loop {
        match op() {
            Err(e) if is_out_of_space(&e) => {
                if with_watch(|w| w.closing.load(Ordering::Relaxed)) == Some(true)
                    && closing_since.get_or_insert_with(Instant::now).elapsed() >= GRACE_WHEN_CLOSING
                {
                    with_watch(|w| w.waiting.store(false, Ordering::Relaxed));
                    return Err(e);
                }
                let since = *waiting_since.get_or_insert_with(|| {
                    tracing::error!(error = %e, file = %path.display(),
                        "{what} failed: no space left; the message store waits for space and tries again \
                         (nothing is confirmed meanwhile, publishers are blocked)");
                    with_watch(|w| w.waiting.store(true, Ordering::Relaxed));
                    Instant::now()
                });
                if last_log.elapsed() >= LOG_EVERY {
                    tracing::warn!(waited_s = since.elapsed().as_secs(), file = %path.display(),
                        "the message store is still waiting for disk space");
                    last_log = Instant::now();
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(MAX_PAUSE);
            }
            result => {
                if let Some(since) = waiting_since {
                    with_watch(|w| w.waiting.store(false, Ordering::Relaxed));
                    if result.is_ok() {
                        tracing::warn!(waited_ms = since.elapsed().as_millis() as u64, file = %path.display(),
                            "disk space is back: the message store goes on writing");
                    }
                }
                return result;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_only_while_out_of_space_and_reports_it() {
        let watch = Arc::new(SpaceWatch::default());
        report_on_this_thread(watch.clone());
        let mut calls = 0;
        let seen = watch.clone();
        let r = retry_while_full("writing", Path::new("x"), || {
            calls += 1;
            if calls < 3 {
                Err(io::Error::from_raw_os_error(libc::ENOSPC))
            } else {
                assert!(seen.waiting.load(Ordering::Relaxed), "the flag is up while the write waits");
                Ok(7)
            }
        });
        assert_eq!(r.unwrap(), 7);
        assert_eq!(calls, 3);
        assert!(!watch.waiting.load(Ordering::Relaxed));
        let mut calls = 0;
        let r: io::Result<()> = retry_while_full("writing", Path::new("x"), || {
            calls += 1;
            Err(io::Error::from_raw_os_error(libc::EIO))
        });
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EIO));
        assert_eq!(calls, 1, "other errors are not retried");
    }
}
