//! Recovery modes: a torn tail is cut, corruption in the middle refuses to start (naming the file and
//! the offset) unless the operator asks to skip it, and whatever is cut or skipped is kept in
//! `damaged/`, never deleted.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use warren_store::sim::{Fault, Loss, SimDisk};
use warren_store::{Batch, Disk, RecoveryMode, Store, StoreError, StoreOptions};

const LEN: usize = 700;
/// Bytes of one enqueue record with a `LEN`-byte payload: record header, fixed fields, payload.
const RECORD: u64 = 8 + 25 + LEN as u64;
/// The WAL bytes of one message confirmed on its own: its record and its group's synced mark.
const STRIDE: u64 = RECORD + warren_store::format::SYNCED_RECORD_LEN as u64;
const HEADER: u64 = 32;

fn opts(mode: RecoveryMode) -> StoreOptions {
    StoreOptions {
        segment_size: 1 << 30,
        queue_segment_size: 16 << 10,
        checkpoint_bytes: 1 << 40,
        checkpoint_idle_ms: 3_600_000,
        active_segment_idle_ms: 0,
        recovery_mode: mode,
        ..StoreOptions::default()
    }
}

fn payload(queue: u64, seq: u64) -> Vec<u8> {
    let mut p = format!("q{queue}-m{seq:06}-").into_bytes();
    p.resize(LEN, b'x');
    p
}

/// A store directory as a power loss leaves it: `count` messages of queue 1 confirmed one by one, no
/// checkpoint since. Returns the simulator (root) and the store directory.
fn crashed_store(count: u64, o: StoreOptions) -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let sim: Arc<SimDisk> = SimDisk::new(root.path()).unwrap();
    let dir = root.path().join("store");
    let (store, _) = Store::open_on(&dir, o, Disk::simulated(sim.clone())).unwrap();
    for seq in 0..count {
        let mut b = Batch::new();
        b.enqueue(1, seq, seq, &[&payload(1, seq)]);
        let t = store.append(&mut b).unwrap();
        store.wait_durable(t).unwrap();
    }
    sim.cut_power();
    drop(store);
    sim.power_loss(Loss::Unsynced).unwrap();
    (root, dir)
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    out.sort();
    out
}

fn flip(path: &Path, at: u64) {
    let mut data = std::fs::read(path).unwrap();
    data[at as usize] ^= 0x40;
    std::fs::write(path, data).unwrap();
}

fn live(store: &Store, queue: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut seq = 0;
    loop {
        let b = store.read(queue, seq, 100, 1 << 20).unwrap();
        if b.messages.is_empty() {
            return out;
        }
        for m in &b.messages {
            assert_eq!(m.payload[..], payload(queue, m.seq)[..], "seq {}", m.seq);
        }
        out.extend(b.messages.iter().map(|m| m.seq));
        seq = b.next_seq;
    }
}

#[test]
fn corruption_in_the_middle_of_the_newest_segment_refuses_to_start_and_can_be_skipped_on_request() {
    let (_root, dir) = crashed_store(60, opts(RecoveryMode::default()));
    let wal = files(&dir.join("wal")).remove(0);
    let bad = HEADER + 10 * STRIDE;
    flip(&wal, bad + 40); // inside record 10's payload: records 11.. are still valid
    let before = std::fs::read(&wal).unwrap();
    for mode in [RecoveryMode::TolerateTailCorruption, RecoveryMode::AbsoluteConsistency] {
        match Store::open(&dir, opts(mode)) {
            Err(StoreError::Corrupt { path, offset, .. }) => {
                assert_eq!((path.as_path(), offset), (wal.as_path(), bad), "{mode}");
            }
            other => panic!("{mode}: expected a refusal, got {other:?}"),
        }
        assert_eq!(std::fs::read(&wal).unwrap(), before, "{mode}: a refusal changes nothing");
    }
    let err = Store::open(&dir, opts(RecoveryMode::default())).unwrap_err().to_string();
    assert!(err.contains(&wal.display().to_string()) && err.contains(&format!("offset {bad}")), "{err}");
    assert!(err.contains("tolerate-any-corruption"), "the error says what to do: {err}");

    let (store, rec) = Store::open(&dir, opts(RecoveryMode::TolerateAnyCorruption)).unwrap();
    let expect: Vec<u64> = (0..60).filter(|&s| s != 10).collect();
    assert_eq!(live(&store, 1), expect, "only the damaged record is lost");
    assert_eq!(rec.corrupted.len(), 1);
    assert_eq!((rec.corrupted[0].offset, rec.corrupted[0].skipped_bytes), (bad, RECORD));
    let kept = &rec.corrupted[0].kept;
    assert_eq!(std::fs::read(kept).unwrap(), before, "the damaged segment is kept whole in damaged/");
    assert!(!wal.exists(), "and no longer in the WAL");
    let mut b = Batch::new();
    b.enqueue(1, 60, 60, &[&payload(1, 60)]);
    store.wait_durable(store.append(&mut b).unwrap()).unwrap();
    drop(store);
    // The next start, in the default mode, finds nothing wrong.
    let (store, rec) = Store::open(&dir, opts(RecoveryMode::default())).unwrap();
    assert!(rec.corrupted.is_empty() && rec.truncated.is_none());
    assert_eq!(live(&store, 1), expect.iter().copied().chain([60]).collect::<Vec<_>>());
}

#[test]
fn damage_in_an_older_segment_refuses_to_start_and_can_be_skipped_on_request() {
    let o = |mode| StoreOptions { segment_size: 16 << 10, ..opts(mode) };
    let (_root, dir) = crashed_store(100, o(RecoveryMode::default()));
    let segments = files(&dir.join("wal"));
    assert!(segments.len() >= 3, "{segments:?}");
    let first = &segments[0];
    // The segment rolled after the record that took it past 16 KiB (zero padding follows).
    let records = (1..).find(|n| HEADER + n * STRIDE >= 16 << 10).unwrap();
    // Damage the segment's last record: nothing valid follows inside it, but it is not the newest.
    let bad = HEADER + (records - 1) * STRIDE;
    flip(first, bad + 8);
    match Store::open(&dir, o(RecoveryMode::TolerateTailCorruption)) {
        Err(StoreError::Corrupt { path, offset, reason, .. }) => {
            assert_eq!((path.as_path(), offset), (first.as_path(), bad));
            assert!(reason.contains("not the newest"), "{reason}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let (store, rec) = Store::open(&dir, o(RecoveryMode::TolerateAnyCorruption)).unwrap();
    let lost = records - 1;
    let expect: Vec<u64> = (0..100).filter(|&s| s != lost).collect();
    assert_eq!(live(&store, 1), expect);
    assert_eq!(rec.corrupted.len(), 1);
    assert!(rec.corrupted[0].kept.exists());
    drop(store);
    let (store, rec) = Store::open(&dir, o(RecoveryMode::default())).unwrap();
    assert!(rec.corrupted.is_empty());
    assert_eq!(live(&store, 1), expect);
}

#[test]
fn a_torn_tail_is_cut_and_kept_aside_but_absolute_consistency_refuses_it() {
    let (_root, dir) = crashed_store(20, opts(RecoveryMode::default()));
    let wal = files(&dir.join("wal")).remove(0);
    let cut = HEADER + 15 * STRIDE + 100;
    std::fs::OpenOptions::new().write(true).open(&wal).unwrap().set_len(cut).unwrap();
    match Store::open(&dir, opts(RecoveryMode::AbsoluteConsistency)) {
        Err(StoreError::Corrupt { path, offset, reason, .. }) => {
            assert_eq!((path.as_path(), offset), (wal.as_path(), HEADER + 15 * STRIDE));
            assert!(reason.contains("torn tail"), "{reason}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let tail = std::fs::read(&wal).unwrap()[(HEADER + 15 * STRIDE) as usize..].to_vec();
    let (store, rec) = Store::open(&dir, opts(RecoveryMode::TolerateTailCorruption)).unwrap();
    assert_eq!(live(&store, 1), (0..15).collect::<Vec<_>>());
    let torn = rec.truncated.expect("reported");
    assert_eq!(torn.offset, HEADER + 15 * STRIDE);
    assert_eq!(std::fs::read(torn.kept.expect("kept")).unwrap(), tail, "the cut bytes are kept in damaged/");
}

/// Issue 34: a disk that persists a write's blocks out of order leaves a hole in the last group
/// followed by valid records. No synced mark says the hole was durable, so it is a torn tail: cut
/// with the valid records after it (none was confirmed), and the node starts on its own. The same
/// bytes followed by a later group's mark saying the WAL was durable past the hole are corruption:
/// refused, as before.
#[test]
fn a_hole_in_the_last_group_followed_by_valid_records_is_a_torn_tail_unless_a_later_mark_says_it_was_durable() {
    use warren_store::format::{encode_enqueue, encode_synced};
    for later_mark in [false, true] {
        let (_root, dir) = crashed_store(20, opts(RecoveryMode::default()));
        let wal = files(&dir.join("wal")).remove(0);
        let end = HEADER + 20 * STRIDE;
        let mut bytes = std::fs::read(&wal).unwrap();
        assert!(bytes[end as usize..].iter().all(|&b| b == 0), "only block padding after the confirmed groups");
        bytes.truncate(end as usize);
        // The last group: seqs 20..30 in one write, of which a 4 KiB block in the middle never
        // reached the disk (zeros), and the blocks after it did.
        let mut group = Vec::new();
        for seq in 20..30 {
            encode_enqueue(&mut group, 1, seq, seq, &[&payload(1, seq)]);
        }
        let hole = 1000..5096;
        group[hole.clone()].fill(0);
        let hole_at = end + hole.start as u64;
        // The record the hole starts in: the cut goes at its start.
        let torn_record = end + (hole.start as u64 / RECORD) * RECORD;
        bytes.extend_from_slice(&group);
        if later_mark {
            // A later group (written only after an fsync covered this one) whose mark survived.
            let at = bytes.len() as u64;
            encode_synced(&mut bytes, at, at);
        }
        std::fs::write(&wal, &bytes).unwrap();
        let opened = Store::open(&dir, opts(RecoveryMode::default()));
        if later_mark {
            match opened {
                Err(StoreError::Corrupt { path, offset, reason, .. }) => {
                    assert_eq!((path.as_path(), offset), (wal.as_path(), torn_record));
                    assert!(reason.contains("synced mark"), "{reason}");
                }
                other => panic!("expected a refusal, got {:?}", other.map(|(_, r)| r)),
            }
            assert_eq!(std::fs::read(&wal).unwrap(), bytes, "a refusal changes nothing");
            continue;
        }
        let (store, rec) = opened.unwrap_or_else(|e| panic!("a torn tail with a hole refuses to start: {e}"));
        let torn = rec.truncated.expect("the torn tail is reported");
        assert_eq!(torn.offset, torn_record);
        assert!(torn_record <= hole_at);
        assert_eq!(std::fs::read(torn.kept.expect("kept")).unwrap(), bytes[torn_record as usize..], "kept in damaged/");
        // Seq 20 (before the hole) survived whole; nothing from the hole on comes back.
        assert_eq!(live(&store, 1), (0..21).collect::<Vec<_>>(), "the confirmed messages, and none after the hole");
        assert_eq!(rec.queues[0].live_count, 21);
        let mut b = Batch::new();
        b.enqueue(1, 21, 21, &[&payload(1, 21)]);
        store.wait_durable(store.append(&mut b).unwrap()).unwrap();
        drop(store);
        let (store, rec) = Store::open(&dir, opts(RecoveryMode::default())).unwrap();
        assert!(rec.truncated.is_none() && rec.corrupted.is_empty(), "the next start finds nothing wrong");
        assert_eq!(live(&store, 1), (0..22).collect::<Vec<_>>());
    }
}

/// A WAL segment written before synced marks (format version 2) is still read, judged by the older
/// rule (damage followed by valid records refuses), and never appended to: new groups go to a fresh
/// segment of the current version.
#[test]
fn a_segment_of_the_format_without_marks_is_read_and_not_continued() {
    let (_root, dir) = crashed_store(10, opts(RecoveryMode::default()));
    let wal = files(&dir.join("wal")).remove(0);
    let mut bytes = std::fs::read(&wal).unwrap();
    bytes[4..6].copy_from_slice(&warren_store::format::WAL_VERSION_UNMARKED.to_le_bytes());
    let crc = crc32c::crc32c(&bytes[..28]);
    bytes[28..32].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&wal, &bytes).unwrap();
    let (store, rec) = Store::open(&dir, opts(RecoveryMode::default())).unwrap();
    assert!(rec.truncated.is_none() && rec.corrupted.is_empty());
    assert_eq!(live(&store, 1), (0..10).collect::<Vec<_>>());
    let mut b = Batch::new();
    b.enqueue(1, 10, 10, &[&payload(1, 10)]);
    store.wait_durable(store.append(&mut b).unwrap()).unwrap();
    drop(store);
    let segments = files(&dir.join("wal"));
    let newest = segments.last().unwrap();
    assert_ne!(newest, &wal, "a fresh segment for new groups");
    assert_eq!(std::fs::read(newest).unwrap()[4..6], warren_store::format::WAL_VERSION.to_le_bytes());
    let (store, _) = Store::open(&dir, opts(RecoveryMode::default())).unwrap();
    assert_eq!(live(&store, 1), (0..11).collect::<Vec<_>>());
}

/// Two queues written in turn: their messages are copied into their own files at the checkpoint.
fn two_queues_in_their_own_files(dir: &Path) {
    let (store, _) = Store::open(dir, opts(RecoveryMode::default())).unwrap();
    for seq in 0..30 {
        let mut b = Batch::new();
        b.enqueue(1, seq, seq, &[&payload(1, seq)]);
        b.enqueue(2, seq, seq, &[&payload(2, seq)]);
        store.wait_durable(store.append(&mut b).unwrap()).unwrap();
    }
    store.close().unwrap();
}

/// Issue 34: a queue segment file shorter than the checkpoint recorded (a disk that lost its end)
/// loses exactly the messages past its last whole record: counted and reported, no longer live, and
/// the node starts on its own; the rest of that queue and every other queue are as they were. Only
/// absolute-consistency refuses (before, every mode but tolerate-any-corruption refused).
#[test]
fn a_queue_segment_shorter_than_the_checkpoint_says_loses_exactly_its_missing_messages() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    two_queues_in_their_own_files(&dir);
    let mut qsegs = files(&dir.join("queues").join("1"));
    qsegs.sort();
    let qseg = qsegs[0].clone();
    // The file after it starts at the seq after this one's last (names are first seqs).
    let in_file: u64 = qsegs.get(1).map_or(30, |p| p.file_stem().unwrap().to_str().unwrap().parse().unwrap());
    let len = std::fs::metadata(&qseg).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&qseg).unwrap().set_len(len / 2).unwrap();
    match Store::open(&dir, opts(RecoveryMode::AbsoluteConsistency)) {
        Err(StoreError::Corrupt { path, .. }) => assert_eq!(path, qseg.clone()),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let whole = (len / 2 - HEADER) / RECORD;
    let (store, rec) = Store::open(&dir, opts(RecoveryMode::default())).unwrap();
    assert_eq!(rec.lost.len(), 1, "{:?}", rec.lost);
    assert_eq!((rec.lost[0].queue, rec.lost[0].messages), (1, in_file - whole));
    let q1 = rec.queues.iter().find(|q| q.queue == 1).unwrap();
    let left: Vec<u64> = (0..whole).chain(in_file..30).collect();
    assert_eq!(q1.live_count, left.len() as u64, "nothing reported live that cannot be read");
    assert_eq!(live(&store, 1), left);
    assert_eq!(live(&store, 2).len(), 30, "the other queue is whole");
    // The queue keeps working.
    let mut b = Batch::new();
    b.enqueue(1, 30, 30, &[&payload(1, 30)]);
    let ticket = store.append(&mut b).unwrap();
    store.wait_durable(ticket).unwrap();
    // Durable first, then applied to the queue's log, which reads see.
    assert!(store.wait_readable(ticket, std::time::Duration::from_secs(10)));
    assert_eq!(live(&store, 1).len(), left.len() + 1);
    store.close().unwrap();
    let (_, rec) = Store::open(&dir, opts(RecoveryMode::default())).unwrap();
    assert!(rec.lost.is_empty(), "counted once: {:?}", rec.lost);
}

/// Issue 34: a queue segment file the checkpoint lists deleted: startup reports exactly its live
/// messages lost, and nothing else changes (before, they were reported live and reads found none).
#[test]
fn a_deleted_queue_segment_file_is_reported_with_the_exact_count_lost() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    two_queues_in_their_own_files(&dir);
    // Some of queue 1's messages were consumed before: they are not counted lost.
    {
        let (store, _) = Store::open(&dir, opts(RecoveryMode::default())).unwrap();
        let mut b = Batch::new();
        b.ack(1, 0, 0);
        b.ack(1, 1, 0);
        b.ack(1, 7, 0);
        store.wait_durable(store.append(&mut b).unwrap()).unwrap();
        store.close().unwrap();
    }
    let mut qsegs = files(&dir.join("queues").join("1"));
    qsegs.sort();
    let in_file: u64 = qsegs[1].file_stem().unwrap().to_str().unwrap().parse().unwrap();
    std::fs::remove_file(&qsegs[0]).unwrap();
    let (store, rec) = Store::open(&dir, opts(RecoveryMode::default())).unwrap();
    assert_eq!(rec.lost.iter().map(|l| (l.queue, l.messages)).collect::<Vec<_>>(), vec![(1, in_file - 3)]);
    assert_eq!(store.stats().lost_messages, in_file - 3, "the count a metric reports");
    assert_eq!(rec.queues.iter().find(|q| q.queue == 1).map_or(0, |q| q.live_count), 30 - in_file);
    assert_eq!(live(&store, 1), (in_file..30).collect::<Vec<_>>());
    assert_eq!(live(&store, 2).len(), 30, "the other queue is whole");
}

#[test]
fn a_damaged_queue_segment_found_while_reading_is_kept_aside_before_it_can_be_deleted() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    {
        let (store, _) = Store::open(&dir, opts(RecoveryMode::default())).unwrap();
        for seq in 0..10 {
            let mut b = Batch::new();
            b.enqueue(1, seq, seq, &[&payload(1, seq)]);
            b.enqueue(2, seq, seq, &[&payload(2, seq)]);
            store.wait_durable(store.append(&mut b).unwrap()).unwrap();
        }
        store.close().unwrap();
    }
    let qseg = files(&dir.join("queues").join("1")).remove(0);
    flip(&qseg, HEADER + 5 * RECORD + 50);
    let (store, _) = Store::open(&dir, opts(RecoveryMode::default())).unwrap();
    let b = store.read(1, 0, 100, 1 << 20).unwrap();
    assert_eq!(b.messages.len(), 5);
    assert_eq!(b.lost, 5);
    assert_eq!(store.stats().lost_messages, 5, "the count a metric reports");
    let kept = files(&warren_store::damaged_dir(&dir));
    assert_eq!(kept.len(), 1, "{kept:?}");
    let name = kept[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("queue-1-") && name.ends_with(&format!(".{}", HEADER + 5 * RECORD)), "{name}");
    assert_eq!(std::fs::read(&kept[0]).unwrap()[..], std::fs::read(&qseg).unwrap()[(HEADER + 5 * RECORD) as usize..]);
}

/// Recovery itself can be cut short by a power loss: while it keeps a torn tail aside and cuts it, or
/// (tolerate-any-corruption) while it replays around damage, writes its checkpoint and moves the
/// damaged segment aside. At every one of its file operations: cut the power, drop what was not
/// synced, recover again: it succeeds, and every message outside the damage is there.
#[test]
fn a_power_cut_at_any_point_of_a_repairing_recovery_is_recovered_from() {
    // (mode, damage: a torn tail at the end, or a flipped byte in the middle)
    for (mode, middle) in [(RecoveryMode::TolerateTailCorruption, false), (RecoveryMode::TolerateAnyCorruption, true)] {
        let count = 40u64;
        let setup = || {
            let root = tempfile::tempdir().unwrap();
            let sim: Arc<SimDisk> = SimDisk::new(root.path()).unwrap();
            let dir = root.path().join("store");
            let (store, _) = Store::open_on(&dir, opts(mode), Disk::simulated(sim.clone())).unwrap();
            for seq in 0..count {
                let mut b = Batch::new();
                b.enqueue(1, seq, seq, &[&payload(1, seq)]);
                store.wait_durable(store.append(&mut b).unwrap()).unwrap();
            }
            sim.cut_power();
            drop(store);
            sim.power_loss(Loss::Unsynced).unwrap();
            let wal = files(&dir.join("wal")).remove(0);
            if middle {
                sim.damage(&wal, HEADER + 10 * STRIDE + 40, b"\xff").unwrap();
            } else {
                // Half a record after the last one: what a write cut by the power leaves.
                sim.damage(&wal, HEADER + count * STRIDE, &payload(1, count)[..300]).unwrap();
            }
            (root, sim, dir)
        };
        let expect: Vec<u64> = (0..count).filter(|&s| !middle || s != 10).collect();
        // How many operations one repairing recovery (and close) does.
        let (_root, sim, dir) = setup();
        let before = sim.op_count();
        let (store, rec) = Store::open_on(&dir, opts(mode), Disk::simulated(sim.clone())).unwrap();
        assert!(rec.truncated.is_some() || !rec.corrupted.is_empty(), "{mode}: the damage is repaired");
        assert_eq!(live(&store, 1), expect);
        drop(store);
        let ops = sim.op_count() - before;
        for k in 0..ops {
            for loss in [Loss::Unsynced, Loss::Torn { seed: k }] {
                let (_root, sim, dir) = setup();
                sim.fault_at(sim.op_count() + k, Fault::PowerCut);
                if let Ok((store, _)) = Store::open_on(&dir, opts(mode), Disk::simulated(sim.clone())) {
                    drop(store);
                }
                sim.power_loss(loss).unwrap();
                let what = format!("{mode}: power cut at operation {k} of the recovery, {loss:?}");
                let (store, _) = Store::open_on(&dir, opts(mode), Disk::simulated(sim.clone()))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(live(&store, 1), expect, "{what}");
                drop(store);
            }
        }
    }
}
