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
