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
