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
