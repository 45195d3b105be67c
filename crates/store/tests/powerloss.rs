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

/// A failed write is the same: nothing written after it is confirmed.
#[test]
fn a_failed_write_never_confirms() {
    let root = tempfile::tempdir().unwrap();
    let sim = SimDisk::new(root.path()).unwrap();
    let dir = root.path().join("store");
    let (store, _) = open_on(&sim, &dir, opts()).unwrap();
    sim.fault_on(OpKind::Write, 0, Fault::Error(libc::ENOSPC));
    let mut b = Batch::new();
    b.enqueue(1, 0, 0, &[&payload(1, 0, 100)]);
    let t = store.append(&mut b).unwrap();
    assert!(matches!(store.wait_durable(t), Err(StoreError::Closed)));
    assert!(store.stats().durable < t);
}
