//! Test-only switches from the environment (`WARREN_TEST_*`: a slow fsync, a simulated disk, small
//! budgets). They are read only in a build with the `test-hooks` feature, which the test suites
//! build (`make test`: `target/release/warren-hooks`); the release binary has no such switch, so
//! no environment can turn its fsyncs off or change its limits.

/// The value of test switch `name`, if this build reads test switches and it is set.
pub fn var(name: &str) -> Option<String> {
    #[cfg(feature = "test-hooks")]
    {
        std::env::var(name).ok()
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        let _ = name;
        None
    }
}

/// Test switch `name` as a number of milliseconds (None: unset, not a number, or 0), announced
/// loudly (`what` it does) when set.
pub fn millis(name: &str, what: &str) -> Option<std::time::Duration> {
    let ms: u64 = var(name)?.trim().parse().ok().filter(|ms| *ms > 0)?;
    tracing::warn!(delay_ms = ms, "{name} is set: {what} (a test-only hook)");
    Some(std::time::Duration::from_millis(ms))
}

/// Whether this build reads test switches (tests that need one skip themselves otherwise).
pub fn enabled() -> bool {
    cfg!(feature = "test-hooks")
}

#[cfg(feature = "test-hooks")]
static READS_HELD: parking_lot::Mutex<(bool, usize)> = parking_lot::Mutex::new((false, 0));
#[cfg(feature = "test-hooks")]
static READS_RELEASED: parking_lot::Condvar = parking_lot::Condvar::new();

/// Test-only (test-hooks builds; elsewhere nothing): while held, every `Store::read` waits at its
/// start, so that a test can show what does not wait for a slow read.
pub fn hold_reads(held: bool) {
    #[cfg(feature = "test-hooks")]
    {
        READS_HELD.lock().0 = held;
        READS_RELEASED.notify_all();
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = held;
}

/// How many reads wait in [`hold_reads`] now.
pub fn reads_waiting() -> usize {
    #[cfg(feature = "test-hooks")]
    {
        READS_HELD.lock().1
    }
    #[cfg(not(feature = "test-hooks"))]
    0
}

pub(crate) fn wait_while_reads_held() {
    #[cfg(feature = "test-hooks")]
    {
        let mut held = READS_HELD.lock();
        if !held.0 {
            return;
        }
        held.1 += 1;
        while held.0 {
            READS_RELEASED.wait(&mut held);
        }
        held.1 -= 1;
    }
}

/// Test-only (test-hooks builds; elsewhere returns at once): while the file named by test switch
/// `name` exists, waits (polling every 10 ms), having created `<file>.waiting` first, so that a test
/// of the real binary can hold a slow disk read where it chooses, see that it is held, and release
/// it by removing the file.
pub fn wait_while_file_exists(name: &str) {
    #[cfg(feature = "test-hooks")]
    {
        let Some(path) = var(name) else { return };
        let path = std::path::PathBuf::from(path);
        if !path.exists() {
            return;
        }
        tracing::warn!(file = %path.display(), "{name} is set: a read waits while this file exists (a test-only hook)");
        let _ = std::fs::write(format!("{}.waiting", path.display()), b"");
        while path.exists() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = name;
}
