//! Power loss, simulated: the store runs on a `SimDisk` (real files plus a model of what the last
//! fsync covered), the power is cut at a chosen file operation, the files are rewritten to what a
//! machine crash would have left (unsynced data dropped, or torn at a random byte), and the store is
//! opened again. A `kill -9` cannot find a missing fsync; this can.

use std::path::Path;
use std::sync::Arc;

use warren_store::sim::{Fault, Loss, OpKind, SimDisk};
use warren_store::{Batch, Disk, Store, StoreError, StoreOptions, SyncPolicy};

fn opts() -> StoreOptions {
    StoreOptions {
        segment_size: 64 << 10,
        queue_segment_size: 16 << 10,
        checkpoint_bytes: 1 << 40,
        checkpoint_idle_ms: 3_600_000,
        active_segment_idle_ms: 0,
        sync: SyncPolicy::EveryBatch,
        ..StoreOptions::default()
    }
}

fn payload(queue: u64, seq: u64, len: usize) -> Vec<u8> {
    let mut p = format!("q{queue}-m{seq:06}-").into_bytes();
    p.resize(len.max(p.len()), b'x');
    p
}

fn open_on(sim: &Arc<SimDisk>, dir: &Path, o: StoreOptions) -> Result<(Store, warren_store::Recovery), StoreError> {
    Store::open_on(dir, o, Disk::simulated(sim.clone()))
}

/// Every live message of `queue` (seq, payload), read back until nothing more comes.
fn read_all(store: &Store, queue: u64) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut seq = 0;
    loop {
        let batch = store.read(queue, seq, 64, 1 << 20).unwrap();
        assert_eq!(batch.lost, 0, "queue {queue}: messages lost to damage");
        if batch.messages.is_empty() {
            return out;
        }
        out.extend(batch.messages.into_iter().map(|m| (m.seq, m.payload.to_vec())));
        seq = batch.next_seq;
    }
}

/// The bug this layer exists to find: a fresh store created `wal/` without fsyncing the store
/// directory, so a confirmed message's segment could vanish with the directory entry at a power loss.
#[test]
fn a_fresh_store_keeps_what_it_confirmed_through_a_power_loss() {
    let root = tempfile::tempdir().unwrap();
    let sim = SimDisk::new(root.path()).unwrap();
    let dir = root.path().join("store");
    {
        let (store, _) = open_on(&sim, &dir, opts()).unwrap();
        let mut b = Batch::new();
        b.enqueue(1, 0, 0, &[&payload(1, 0, 100)]);
        let t = store.append(&mut b).unwrap();
        store.wait_durable(t).unwrap();
        sim.cut_power();
        drop(store);
    }
    sim.power_loss(Loss::Unsynced).unwrap();
    let (store, rec) = open_on(&sim, &dir, opts()).unwrap();
    assert_eq!(rec.queues.len(), 1, "the confirmed message's queue is there: {rec:?}");
    assert_eq!(read_all(&store, 1), vec![(0, payload(1, 0, 100))]);
}

/// The same for directories created above the store: each new one's entry is fsynced in its parent.
#[test]
fn a_fresh_store_in_new_nested_directories_keeps_what_it_confirmed_through_a_power_loss() {
    let root = tempfile::tempdir().unwrap();
    let sim = SimDisk::new(root.path()).unwrap();
    let dir = root.path().join("a").join("b").join("store");
    {
        let (store, _) = open_on(&sim, &dir, opts()).unwrap();
        let mut b = Batch::new();
        b.enqueue(1, 0, 0, &[&payload(1, 0, 100)]);
        let t = store.append(&mut b).unwrap();
        store.wait_durable(t).unwrap();
        sim.cut_power();
        drop(store);
    }
    sim.power_loss(Loss::Unsynced).unwrap();
    let (store, _) = open_on(&sim, &dir, opts()).unwrap();
    assert_eq!(read_all(&store, 1), vec![(0, payload(1, 0, 100))]);
}

/// A failed fsync never advances the durable watermark: the writer stops (on the simulated disk; in
/// production it aborts the process) and every waiter gets `Closed`, never a confirm.
#[test]
fn a_failed_fsync_never_confirms_and_what_it_covered_may_be_gone_after_restart() {
    for errno in [libc::EIO, libc::ENOSPC] {
        let root = tempfile::tempdir().unwrap();
        let sim = SimDisk::new(root.path()).unwrap();
        let dir = root.path().join("store");
        let (store, _) = open_on(&sim, &dir, opts()).unwrap();
        let mut b = Batch::new();
        b.enqueue(1, 0, 0, &[&payload(1, 0, 100)]);
        let first = store.append(&mut b).unwrap();
        store.wait_durable(first).unwrap();
        sim.fault_on(OpKind::FileSync, 0, Fault::Error(errno));
        let mut b = Batch::new();
        b.enqueue(1, 1, 0, &[&payload(1, 1, 100)]);
        let second = store.append(&mut b).unwrap();
        assert!(matches!(store.wait_durable(second), Err(StoreError::Closed)), "errno {errno}");
        assert!(store.stats().durable < second, "the watermark did not pass the failed fsync");
        assert!(matches!(store.append(&mut Batch::new()), Err(StoreError::Closed)));
        drop(store);
        sim.power_loss(Loss::Unsynced).unwrap();
        let (store, _) = open_on(&sim, &dir, opts()).unwrap();
        assert_eq!(read_all(&store, 1), vec![(0, payload(1, 0, 100))], "errno {errno}");
    }
}

/// A failed write is the same: nothing written after it is confirmed. (A full disk is not a failure:
/// see `a_full_disk_waits_for_space_then_confirms`.)
#[test]
fn a_failed_write_never_confirms() {
    let root = tempfile::tempdir().unwrap();
    let sim = SimDisk::new(root.path()).unwrap();
    let dir = root.path().join("store");
    let (store, _) = open_on(&sim, &dir, opts()).unwrap();
    sim.fault_on(OpKind::Write, 0, Fault::Error(libc::EIO));
    let mut b = Batch::new();
    b.enqueue(1, 0, 0, &[&payload(1, 0, 100)]);
    let t = store.append(&mut b).unwrap();
    assert!(matches!(store.wait_durable(t), Err(StoreError::Closed)));
    assert!(store.stats().durable < t);
}

/// A write that fails with ENOSPC did not happen: the store waits for space and writes it again. Meanwhile
/// nothing is confirmed, appends still return at once (they never block a caller), the store says it is
/// behind and waiting for space; once space is back everything becomes durable, with nothing lost even
/// if the power goes right after.
#[test]
fn a_full_disk_waits_for_space_then_confirms() {
    let root = tempfile::tempdir().unwrap();
    let sim = SimDisk::new(root.path()).unwrap();
    let dir = root.path().join("store");
    let (store, _) = open_on(&sim, &dir, opts()).unwrap();
    let mut b = Batch::new();
    b.enqueue(1, 0, 0, &[&payload(1, 0, 100)]);
    let before = store.append(&mut b).unwrap();
    store.wait_durable(before).unwrap();

    sim.set_full(true);
    const N: u64 = 300; // 64 KiB each: more than the pending buffer's 16 MiB
    let append = |seq: u64| {
        let mut b = Batch::new();
        b.enqueue(1, seq, 0, &[&payload(1, seq, 64 << 10)]);
        store.append(&mut b).unwrap()
    };
    append(1);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !store.waiting_for_space() {
        assert!(std::time::Instant::now() < deadline, "the store reports that it waits for space");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let started = std::time::Instant::now();
    let last = (2..=N).map(append).last().unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "appends do not wait for the disk");
    assert!(store.is_behind(), "over 16 MiB wait to be written: publishers are asked to wait");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(!store.is_durable(last) && store.stats().durable < last, "nothing is confirmed while the disk is full");

    sim.set_full(false);
    store.wait_durable(last).unwrap();
    assert!(!store.waiting_for_space());
    sim.cut_power();
    drop(store);
    sim.power_loss(Loss::Unsynced).unwrap();
    let (store, _) = open_on(&sim, &dir, opts()).unwrap();
    let got = read_all(&store, 1);
    assert_eq!(got.len(), N as usize + 1);
    for (i, (seq, p)) in got.iter().enumerate() {
        assert_eq!(*seq, i as u64);
        assert_eq!(*p, payload(1, *seq, if *seq == 0 { 100 } else { 64 << 10 }));
    }
}
