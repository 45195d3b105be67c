//! Blocking work (an fsync, waiting for a lock held across one) called from async code.
//!
//! On the multi-threaded runtime the work runs under `tokio::task::block_in_place`: the worker
//! hands its other tasks to another thread first, so a slow disk stalls only the caller, never
//! the connections (and heartbeats) that share its worker. Elsewhere (startup, tests, plain
//! threads) the work just runs.

use tokio::runtime::{Handle, RuntimeFlavor};

pub fn run<R>(f: impl FnOnce() -> R) -> R {
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// With a single worker, a task blocked in `run` (standing in for a slow fsync) must not stop
    /// another task from running.
    #[test]
    fn blocking_work_does_not_stall_the_other_tasks_of_its_worker() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_time().build().unwrap();
        let ticks = Arc::new(AtomicU32::new(0));
        rt.block_on(async {
            let counter = ticks.clone();
            let ticker = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            });
            tokio::task::yield_now().await;
            let during = ticks.clone();
            let blocked = tokio::spawn(async move {
                let before = during.load(Ordering::Relaxed);
                super::run(|| std::thread::sleep(Duration::from_millis(400)));
                during.load(Ordering::Relaxed) - before
            });
            let ticks_while_blocked = blocked.await.unwrap();
            ticker.abort();
            assert!(ticks_while_blocked >= 5, "the other task ran {ticks_while_blocked} times in 400 ms");
        });
    }

    #[test]
    fn outside_a_multi_threaded_runtime_the_work_just_runs() {
        assert_eq!(super::run(|| 7), 7);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(rt.block_on(async { super::run(|| 8) }), 8);
    }
}
