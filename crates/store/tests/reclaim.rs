//! A checkpoint's WAL deletions do not hold up group commits (`reclaim.rs`): its own process, since
//! the deletion delay hook is read from the environment.

use std::path::Path;
use std::time::{Duration, Instant};

use warren_store::{Batch, Store, StoreOptions, SyncPolicy};

fn put(store: &Store, queue: u64, seqs: std::ops::Range<u64>) {
    let mut last = 0;
    for seq in seqs {
        let mut b = Batch::new();
        b.enqueue(queue, seq, 1_000 + seq, &[&[b'x'; 1000]]);
        last = store.append(&mut b).unwrap();
    }
    store.wait_durable(last).unwrap();
}

fn wal_files(dir: &Path) -> usize {
    std::fs::read_dir(dir.join("wal")).unwrap().filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "wlog")).count()
}

#[test]
fn appends_become_durable_while_a_checkpoints_wal_segments_are_still_being_deleted() {
    // The reclaim thread waits 1 s before a checkpoint's deletions. (Before it, the writer deleted
    // them itself, before it wrote the next group: an append made then found them all deleted.)
    std::env::set_var("WARREN_TEST_REMOVE_DELAY_MS", "1000");
    let dir = tempfile::tempdir().unwrap();
    let opts = StoreOptions {
        segment_size: 64 << 10,
        queue_segment_size: 16 << 10,
        checkpoint_bytes: 512 << 10,
        checkpoint_idle_ms: 3_600_000,
        active_segment_idle_ms: 0,
        sync: SyncPolicy::EveryBatch,
        ..StoreOptions::default()
    };
    let (store, _) = Store::open(dir.path(), opts).unwrap();
    // ~300 KB of queue 1, consumed: its WAL segments are no longer needed after the next checkpoint.
    put(&store, 1, 0..300);
    let mut acks = Batch::new();
    for seq in 0..300 {
        acks.ack(1, seq, 1000);
    }
    let t = store.append(&mut acks).unwrap();
    store.wait_durable(t).unwrap();
    assert_eq!(store.stats().checkpoints, 0, "no checkpoint yet (512 KiB of WAL)");
    // Queue 2 takes the WAL past 512 KiB: a checkpoint, which lets queue 1's segments go.
    let mut seq = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while store.stats().checkpoints == 0 {
        assert!(Instant::now() < deadline, "no checkpoint after {seq} more messages");
        put(&store, 2, seq..seq + 10);
        seq += 10;
    }
    let segments_before = wal_files(dir.path());
    // An append made now is durable long before the deletions are through.
    put(&store, 3, 0..1);
    let deleted_meanwhile = store.stats().segments_deleted;
    store.close().unwrap();
    let deleted = store.stats().segments_deleted;
    assert!(deleted >= 4, "the checkpoint let go of queue 1's segments ({deleted} deleted, {segments_before} were there)");
    assert_eq!(deleted_meanwhile, 0, "an append made during the checkpoint's deletions waited for them ({deleted} deleted in all)");
    assert!(wal_files(dir.path()) <= segments_before - deleted as usize, "close waits for the deletions");
}
