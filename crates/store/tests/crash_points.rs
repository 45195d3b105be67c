//! The crash-point suite: a workload that makes the store do every kind of file operation it has
//! (WAL writes and fdatasyncs, segment rolls, queue files copied at checkpoints, extents and the holes
//! punched around them, checkpoint renames, deletions, `syncfs`, directory fsyncs, a clean restart
//! and its recovery) runs on a simulated disk, which cuts the power at operation `k`. The files are
//! then rewritten to what the disk would hold (everything unsynced dropped, or torn at a random byte),
//! the store is opened again, and:
//!
//! - recovery succeeds in the default mode (a power loss only ever leaves a torn tail);
//! - every enqueue whose ticket was durable (a confirm could have gone out) is there, exactly once,
//!   with its payload, unless an ack of it was durable too;
//! - nothing whose ack was durable came back; a durable drop stays dropped;
//! - a durable delivered mark did not go backwards;
//! - queue 6 keeps what was consumed (retention): a durable rewind brings it back, and it stays
//!   back (unless acked again) through every cut, the clean restart and the replay;
//! - the store takes and confirms new messages on top.
//!
//! Every kind of operation is crashed at (a deterministic sample of each kind: all of the rare ones,
//! evenly spaced ones of the frequent ones). `WARREN_CRASH_POINTS=all` crashes at every operation.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

use warren_store::sim::{Fault, Loss, OpKind, SimDisk};
use warren_store::{Batch, Disk, Store, StoreError, StoreOptions, SyncPolicy};

fn opts() -> StoreOptions {
    StoreOptions {
        // Extents need a run of at least 512 KiB in one WAL segment.
        segment_size: 1 << 20,
        queue_segment_size: 32 << 10,
        // Well above the backlog's 640 KiB (group buffers count with their alignment padding), so that
        // the clean restart's checkpoint finds it whole and makes it an extent.
        checkpoint_bytes: 1536 << 10,
        checkpoint_idle_ms: 3_600_000,
        active_segment_idle_ms: 0,
        ..StoreOptions::default()
    }
}

fn payload(queue: u64, seq: u64, len: usize) -> Vec<u8> {
    let mut p = format!("q{queue}-m{seq:06}-").into_bytes();
    p.resize(len.max(p.len()), b'a' + (seq % 26) as u8);
    p
}

/// What the workload learnt from the store before the power went: what became durable.
#[derive(Default)]
struct Durable {
    /// (queue, seq) -> payload length, for enqueues whose ticket was durable.
    enqueued: BTreeMap<(u64, u64), usize>,
    /// Every enqueue appended, durable or not (what may come back).
    appended: BTreeMap<(u64, u64), usize>,
    /// Acks (and drops) whose ticket was durable.
    acked: BTreeSet<(u64, u64)>,
    dropped: BTreeSet<u64>,
    /// Every ack and drop appended, durable or not: an ack that was not confirmed may still have
    /// reached the disk, so a message it covers may be gone.
    ack_appended: BTreeSet<(u64, u64)>,
    drop_appended: BTreeSet<u64>,
    /// The highest delivered mark per queue whose ticket was durable.
    delivered: HashMap<u64, u64>,
    /// Seqs of queue 6 a durable rewind made live again.
    rewound: BTreeSet<u64>,
    /// Seqs of queue 6 any rewind appended covers (durable or not: it may have reached the disk).
    rewind_appended: BTreeSet<u64>,
}

/// The queue with retention: its consumed messages stay on disk for rewinds.
const RETAINED: u64 = 6;

/// One batch of the workload, and what it will mean once durable.
#[derive(Default)]
struct Step {
    batch: Batch,
    enqueues: Vec<(u64, u64, usize)>,
    acks: Vec<(u64, u64)>,
    drop: Option<u64>,
    delivered: Option<(u64, u64)>,
    /// Seqs of queue 6 the rewind in `batch` covers (all consumed and acked durably before it).
    rewind: Vec<u64>,
}

impl Step {
    fn enqueue(&mut self, queue: u64, seq: u64, len: usize) -> &mut Self {
        self.batch.enqueue(queue, seq, seq, &[&payload(queue, seq, len)]);
        self.enqueues.push((queue, seq, len));
        self
    }
    fn ack(&mut self, queue: u64, seqs: std::ops::Range<u64>, len: usize) -> &mut Self {
        let bytes = seqs.clone().map(|s| payload(queue, s, len).len() as u64).sum();
        self.batch.ack_range(queue, seqs.start, seqs.end, bytes);
        self.acks.extend(seqs.map(|s| (queue, s)));
        self
    }
}

/// Appends steps one after the other without waiting (so that the writer may take several in one
/// group, a WAL roll in the middle of it), then waits for each; false once the store can no longer
/// make anything durable.
fn run_steps(store: &Store, steps: Vec<Step>, d: &mut Durable) -> bool {
    let mut waiting = Vec::new();
    for mut step in steps {
        for &(q, s, len) in &step.enqueues {
            d.appended.insert((q, s), len);
        }
        d.ack_appended.extend(step.acks.iter().copied());
        d.drop_appended.extend(step.drop);
        d.rewind_appended.extend(step.rewind.iter().copied());
        match store.append(&mut step.batch) {
            Ok(ticket) => waiting.push((ticket, step)),
            Err(_) => break,
        }
    }
    for (ticket, step) in waiting {
        match store.wait_durable(ticket) {
            Ok(()) => {
                for (q, s, len) in step.enqueues {
                    d.enqueued.insert((q, s), len);
                }
                d.acked.extend(step.acks);
                d.rewound.extend(step.rewind);
                if let Some(q) = step.drop {
                    d.dropped.insert(q);
                }
                if let Some((q, up_to)) = step.delivered {
                    let m = d.delivered.entry(q).or_default();
                    *m = (*m).max(up_to);
                }
            }
            Err(StoreError::Closed) => return false,
            Err(e) => panic!("unexpected error waiting for durability: {e}"),
        }
    }
    true
}

const SMALL: usize = 300;
const BIG: usize = 4 << 10;
const MID: usize = 12 << 10;

/// The workload. Queues 2 and 3 trickle in turn (copied into their own files at checkpoints) and are
/// consumed, 3 with delivered marks; queue 4 is created and dropped; queue 1 gets a dense 640 KiB
/// backlog (an extent of the WAL) that is consumed at the end, after several checkpoints, segment
/// rolls and a clean restart. Returns the durable facts and whether it ran to the end.
fn workload(sim: &Arc<SimDisk>, dir: &Path, o: &StoreOptions) -> (Durable, bool) {
    let mut d = Durable::default();
    let open = || {
        let store = Store::open_on(dir, o.clone(), Disk::simulated(sim.clone())).ok().map(|(s, _)| s)?;
        // (Enqueue times are the seqs: long past. A retention reaching back to 1970.)
        store.set_retention(RETAINED, u64::MAX / 4);
        Some(store)
    };
    let Some(mut store) = open() else { return (d, false) };
    let mut ok = true;
    // Each entry is one step, or several appended without waiting.
    let mut steps: Vec<Box<dyn Fn() -> Vec<Step>>> = Vec::new();
    for i in 0..30u64 {
        steps.push(Box::new(move || {
            let mut s = Step::default();
            s.enqueue(2, i, SMALL).enqueue(3, i, SMALL);
            if i < 20 {
                s.enqueue(RETAINED, i, SMALL);
            }
            if i % 5 == 4 {
                s.ack(2, i - 4..i - 1, SMALL); // seq i-1 stays unacked for a while: out of order
                s.batch.delivered(3, i + 1);
                s.delivered = Some((3, i + 1));
            }
            vec![s]
        }));
    }
    for i in 0..6u64 {
        steps.push(Box::new(move || {
            let mut s = Step::default();
            s.enqueue(4, i, SMALL);
            vec![s]
        }));
    }
    steps.push(Box::new(|| {
        let mut s = Step::default();
        s.batch.drop_queue(4);
        s.drop = Some(4);
        vec![s]
    }));
    for i in 0..40u64 {
        steps.push(Box::new(move || {
            let mut s = Step::default();
            for j in 0..4 {
                s.enqueue(1, 4 * i + j, BIG);
            }
            vec![s]
        }));
    }
    steps.push(Box::new(Vec::new)); // marker: a clean restart here
    for chunk in 0..20u64 {
        // Three steps at a time, appended without waiting: groups of several batches, and a WAL roll
        // inside one of them.
        steps.push(Box::new(move || {
            (0..3u64)
                .map(|k| {
                    let i = 3 * chunk + k;
                    let mut s = Step::default();
                    let seq = 30 + i;
                    s.enqueue(2, seq, MID).enqueue(3, seq, MID);
                    if i < 12 {
                        // Queue 5: runs of one record between the others', copied into its own files.
                        s.enqueue(5, i, MID);
                    }
                    if i % 6 == 5 {
                        s.ack(2, seq - 5..seq + 1, MID);
                        s.ack(3, seq - 5..seq - 2, MID);
                    }
                    if i == 10 {
                        // What the first phase left unacked of queue 2, and all of queue 3's first phase.
                        for g in (0..30).step_by(5) {
                            s.ack(2, g + 3..g + 5, SMALL);
                        }
                        s.ack(3, 0..30, SMALL);
                        s.ack(RETAINED, 0..20, SMALL); // consumed: kept for the retention
                    }
                    s
                })
                .collect()
        }));
    }
    steps.push(Box::new(|| {
        // Before the restart: the replay after a cut must make the same seqs live again.
        let mut s = Step::default();
        s.batch.rewind(RETAINED, 4, 12);
        s.rewind = (4..12).collect();
        vec![s]
    }));
    steps.push(Box::new(Vec::new)); // a clean restart: queue 5 is in its own files
    steps.push(Box::new(|| {
        // Seq 4 stays: its file, whose first record is gone, is rewritten at the final checkpoint
        // (and the old one deleted after it).
        let mut s = Step::default();
        s.ack(5, 0..4, MID).ack(5, 5..12, MID);
        vec![s]
    }));
    steps.push(Box::new(|| {
        let mut s = Step::default();
        s.ack(1, 40..120, BIG); // the middle of the backlog first
        s.ack(RETAINED, 4..6, SMALL); // two rewound ones consumed again
        vec![s]
    }));
    steps.push(Box::new(|| {
        let mut s = Step::default();
        s.batch.rewind(RETAINED, 0, 20);
        s.rewind = (0..20).collect();
        vec![s]
    }));
    steps.push(Box::new(|| {
        let mut s = Step::default();
        // Seq 39 stays: with the later enqueues in a newer segment, the backlog's extent is sparse,
        // and the final checkpoint rewrites it.
        s.ack(1, 0..39, BIG).ack(1, 120..150, BIG);
        vec![s]
    }));
    for i in 0..12u64 {
        steps.push(Box::new(move || {
            let mut s = Step::default();
            s.enqueue(2, 90 + i, MID);
            if i < 4 {
                s.enqueue(1, 160 + i, SMALL).enqueue(5, 12 + i, SMALL);
            }
            vec![s]
        }));
    }
    for make in &steps {
        let group = make();
        if group.is_empty() {
            // The clean restart: close (final checkpoint), recover.
            let _ = store.close();
            drop(store);
            match open() {
                Some(s) => store = s,
                None => return (d, false),
            }
            continue;
        }
        if !run_steps(&store, group, &mut d) {
            ok = false;
            break;
        }
    }
    let _ = store.close();
    ok = ok && !sim.is_powered_off();
    (d, ok)
}

fn read_all(store: &Store, queue: u64) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut seq = 0;
    loop {
        let b = store.read(queue, seq, 1000, 4 << 20).unwrap();
        assert_eq!(b.lost, 0, "queue {queue}: messages lost to damage");
        if b.messages.is_empty() {
            return out;
        }
        out.extend(b.messages.into_iter().map(|m| (m.seq, m.payload.to_vec())));
        seq = b.next_seq;
    }
}

/// Recovers after the power loss and checks the durable facts; `what` names the crash point.
fn check(sim: &Arc<SimDisk>, dir: &Path, d: &Durable, what: &str) {
    // Recovery in the default options: a store written with any sync policy opens with them.
    let (store, rec) = match Store::open_on(dir, opts(), Disk::simulated(sim.clone())) {
        Ok(r) => r,
        Err(e) => panic!("{what}: recovery failed after a power loss: {e}"),
    };
    assert!(rec.corrupted.is_empty(), "{what}: a power loss is never corruption in the middle: {:?}", rec.corrupted);
    for q in 1..=4u64 {
        let got = read_all(&store, q);
        let seqs: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{what}: queue {q} in order, each once: {seqs:?}");
        for (s, p) in &got {
            let len = d.appended.get(&(q, *s)).unwrap_or_else(|| panic!("{what}: queue {q} seq {s} was never appended"));
            assert_eq!(p[..], payload(q, *s, *len)[..], "{what}: queue {q} seq {s} payload");
            assert!(!d.acked.contains(&(q, *s)), "{what}: queue {q} seq {s} was acked durably and came back");
            assert!(!d.dropped.contains(&q), "{what}: queue {q} was dropped durably and seq {s} came back");
        }
        let live: BTreeSet<u64> = seqs.iter().copied().collect();
        for &(eq, s) in d.enqueued.keys().filter(|(eq, _)| *eq == q) {
            if !d.ack_appended.contains(&(eq, s)) && !d.drop_appended.contains(&q) {
                assert!(live.contains(&s), "{what}: confirmed message {q}/{s} lost");
            }
        }
        let reported = rec.queues.iter().find(|r| r.queue == q).map_or(0, |r| r.live_count);
        assert_eq!(reported, got.len() as u64, "{what}: queue {q}'s live count matches what reads back");
        if let Some(&mark) = d.delivered.get(&q) {
            assert!(store.delivered_until(q) >= mark, "{what}: queue {q}'s durable delivered mark {mark} went back");
        }
    }
    // Queue 6: live is what a rewind brought back and nothing consumed again; a durable rewind's
    // seqs are there unless an ack of them was appended after it (the acks of 4..6 follow the first).
    let got = read_all(&store, RETAINED);
    let seqs: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{what}: queue 6 in order, each once: {seqs:?}");
    for (s, p) in &got {
        assert_eq!(p[..], payload(RETAINED, *s, SMALL)[..], "{what}: queue 6 seq {s} payload");
        let acked = d.acked.contains(&(RETAINED, *s));
        assert!(!acked || d.rewind_appended.contains(s), "{what}: queue 6 seq {s} was consumed durably, never rewound, and came back");
    }
    let second_rewind_durable = d.rewound.contains(&0);
    for s in &d.rewound {
        let consumed_again = (4..6).contains(s) && d.ack_appended.contains(&(RETAINED, *s)) && !second_rewind_durable;
        if !consumed_again {
            assert!(seqs.contains(s), "{what}: queue 6 seq {s} was rewound durably and is not there: {seqs:?}");
        }
    }
    let reported = rec.queues.iter().find(|r| r.queue == RETAINED).map_or(0, |r| r.live_count);
    assert_eq!(reported, got.len() as u64, "{what}: queue 6's live count matches what reads back");
    // The store works on top of what it recovered.
    let mut b = Batch::new();
    b.enqueue(9, 0, 0, &[b"after"]);
    let t = store.append(&mut b).unwrap();
    store.wait_durable(t).unwrap_or_else(|e| panic!("{what}: the recovered store does not confirm: {e}"));
    store.close().unwrap();
}

/// Which operations to crash at, as (kind, n): the n-th operation of that kind (the workload appends
/// some steps without waiting, so the order of operations of different kinds can vary a little from
/// run to run; the n-th of a kind is stable). Every one of the rare kinds, and about `per_kind`
/// evenly spaced ones of each frequent kind.
fn sample(ops: &[warren_store::sim::Op], per_kind: usize) -> Vec<(OpKind, u64)> {
    let all = std::env::var("WARREN_CRASH_POINTS").is_ok_and(|v| v == "all");
    let mut count: BTreeMap<OpKind, u64> = BTreeMap::new();
    for op in ops {
        *count.entry(op.kind).or_default() += 1;
    }
    let mut out = Vec::new();
    for (&kind, &n) in &count {
        let stride = if all { 1 } else { (n as usize).div_ceil(per_kind).max(1) };
        let mut picked: BTreeSet<u64> = (0..n).step_by(stride).collect();
        picked.insert(n - 1);
        out.extend(picked.into_iter().map(|i| (kind, i)));
    }
    out
}

#[test]
fn every_kind_of_file_operation_survives_a_power_loss_at_it() {
    crash_at_every_kind(&opts(), 30);
}

/// With fsyncs on an interval several groups are written before one fsync covers them all: a torn
/// tail can be long, and a WAL roll syncs groups nobody waits for yet.
#[test]
fn every_kind_of_file_operation_survives_a_power_loss_with_interval_fsyncs() {
    crash_at_every_kind(&StoreOptions { sync: SyncPolicy::IntervalMs(2), ..opts() }, 3);
}

fn crash_at_every_kind(o: &StoreOptions, per_kind: usize) {
    let o = o.clone();
    // A clean run: the workload completes and its operations are listed.
    let root = tempfile::tempdir().unwrap();
    let sim = SimDisk::new(root.path()).unwrap();
    let dir = root.path().join("store");
    let (d, completed) = workload(&sim, &dir, &o);
    assert!(completed, "the workload runs to the end without faults");
    let ops = sim.ops();
    let kinds: BTreeSet<OpKind> = ops.iter().map(|o| o.kind).collect();
    for kind in [
        OpKind::Create, OpKind::Write, OpKind::FileSync, OpKind::DirSync, OpKind::SyncFs, OpKind::Rename,
        OpKind::Remove, OpKind::MakeDir, OpKind::PunchHole,
    ] {
        assert!(kinds.contains(&kind), "the workload never does {kind:?}: {kinds:?}");
    }
    sim.power_loss(Loss::Unsynced).unwrap();
    check(&sim, &dir, &d, "after a clean run");

    let points = sample(&ops, per_kind);
    let mut crashed_at: BTreeMap<OpKind, usize> = BTreeMap::new();
    let started = std::time::Instant::now();
    for (i, &(kind, nth)) in points.iter().enumerate() {
        for loss in [Loss::Unsynced, Loss::Torn { seed: i as u64 }, Loss::Reordered { seed: i as u64 }] {
            let root = tempfile::tempdir().unwrap();
            let sim = SimDisk::new(root.path()).unwrap();
            let dir = root.path().join("store");
            sim.fault_on(kind, nth, Fault::PowerCut);
            let (d, _) = workload(&sim, &dir, &o);
            let fired = sim.is_powered_off();
            let what = format!("power cut at {kind:?} number {nth}, {loss:?}");
            sim.power_loss(loss).unwrap();
            check(&sim, &dir, &d, &what);
            if fired {
                *crashed_at.entry(kind).or_default() += 1;
            }
        }
    }
    for kind in &kinds {
        assert!(crashed_at.contains_key(kind), "no crash at a {kind:?}: {crashed_at:?}");
    }
    eprintln!(
        "crash points: {} of {} operations, 3 losses each (unsynced dropped, torn, reordered), in {:.1} s; crashes by kind: {crashed_at:?}",
        points.len(),
        ops.len(),
        started.elapsed().as_secs_f64()
    );
}

/// Injected I/O errors: whatever write or fsync fails, nothing it covered is ever reported durable,
/// and what was confirmed before survives a power loss right after.
#[test]
fn a_failed_write_or_fsync_anywhere_never_confirms_what_it_covered() {
    let o = opts();
    let root = tempfile::tempdir().unwrap();
    let sim = SimDisk::new(root.path()).unwrap();
    let (_, completed) = workload(&sim, &root.path().join("store"), &o);
    assert!(completed);
    let ops = sim.ops();
    let failing: Vec<(OpKind, u64)> = sample(&ops, 6)
        .into_iter()
        .filter(|(kind, _)| matches!(kind, OpKind::Write | OpKind::FileSync | OpKind::SyncFs | OpKind::DirSync))
        .collect();
    for (kind, nth) in failing {
        let root = tempfile::tempdir().unwrap();
        let sim = SimDisk::new(root.path()).unwrap();
        let dir = root.path().join("store");
        sim.fault_on(kind, nth, Fault::Error(libc::EIO));
        let (d, _) = workload(&sim, &dir, &o);
        // The failed operation stopped the writer (or the workload's final close): the power goes off
        // now, before anything else could make up for it.
        sim.cut_power();
        sim.power_loss(Loss::Unsynced).unwrap();
        check(&sim, &dir, &d, &format!("EIO at {kind:?} number {nth}"));
    }
}
