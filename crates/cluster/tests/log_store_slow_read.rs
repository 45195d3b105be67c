//! A read of a group's log from the store does not hold the group's lock (issue 32, item 7): while
//! a read waits on the store, the group appends, pins and reads its tail from memory. In a file of
//! its own: the test holds every store read of its process (a test-hooks switch).

mod log_store_common;

use std::time::Duration;

use log_store_common::*;
use openraft::storage::RaftLogStorage;
use openraft::RaftLogReader;
use warren_store::test_hooks;

/// Waits (at most 10 s) until a store read waits in `hold_reads`.
fn wait_for_a_held_read() {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while test_hooks::reads_waiting() == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_does_not_wait_for_a_read_of_the_same_log_from_the_store() {
    if !test_hooks::enabled() {
        eprintln!("skipped: needs a test-hooks build (cargo test --features warren-store/test-hooks)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, logs) = open(dir.path());
        let mut ls = logs.log_store(8).unwrap();
        append_flushed(&mut ls, (0..50).map(|i| normal(8, 1, i)).collect()).await;
        ls.save_vote(&warren_cluster::types::Vote::new(1, 1)).await.unwrap();
        store.close().unwrap();
    }
    // Opened again: nothing is in memory, a read asks the store.
    let (store, logs) = open(dir.path());
    let mut ls = logs.log_store(8).unwrap();
    let mut reader = ls.get_log_reader().await;

    test_hooks::hold_reads(true);
    let read = tokio::spawn(async move { reader.try_get_log_entries(0..50).await });
    wait_for_a_held_read();
    assert_eq!(test_hooks::reads_waiting(), 1, "the read is waiting on the store");
    // The group's lock is free: an append (and a pin) goes through while the read waits.
    // (On a task of its own: one blocked on the lock must not block this test's timeout.)
    let append = tokio::spawn(async move {
        append_unflushed(&mut ls, vec![normal(8, 1, 50)]).await;
        ls
    });
    let appended = tokio::time::timeout(Duration::from_secs(5), append).await;
    test_hooks::hold_reads(false);
    assert!(appended.is_ok(), "an append waited for a read of the same log from the store");
    logs.pin_entry(8, 50).unwrap();
    let mut ls = appended.unwrap().unwrap();
    let read = tokio::time::timeout(Duration::from_secs(10), read).await.expect("the read ends").unwrap().expect("the read succeeds");
    assert_eq!(read, (0..50).map(|i| normal(8, 1, i)).collect::<Vec<_>>());

    // A truncation while a read waits on the store: the read gives the log as it is after it
    // (read again), never the entries the truncation removed.
    let mut reader = ls.get_log_reader().await;
    test_hooks::hold_reads(true);
    let read = tokio::spawn(async move { reader.try_get_log_entries(0..60).await });
    wait_for_a_held_read();
    ls.truncate_after(Some(log_id(1, 1, 20))).await.unwrap();
    append_unflushed(&mut ls, (21..30).map(|i| normal(8, 2, i)).collect()).await;
    test_hooks::hold_reads(false);
    let read = tokio::time::timeout(Duration::from_secs(10), read).await.expect("the read ends").unwrap().expect("the read succeeds");
    let want: Vec<_> = (0..21).map(|i| normal(8, 1, i)).chain((21..30).map(|i| normal(8, 2, i))).collect();
    assert_eq!(read, want);
    store.close().unwrap();
}
