//! Behaviour of the store through its public API: durability, recovery, group commit, segment deletion.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use warren_store::format::{ENQUEUE_FIXED_LEN, HEADER_SIZE, RECORD_HEADER_SIZE};
use warren_store::{Batch, MsgId, Store, StoreError, StoreOptions, SyncPolicy};

fn opts(segment_size: u64) -> StoreOptions {
    StoreOptions {
        segment_size,
        sync: SyncPolicy::EveryBatch,
    }
}

fn open(dir: &Path, segment_size: u64) -> (Store, warren_store::Recovery) {
    Store::open(dir, opts(segment_size)).expect("open")
}

/// Appends one enqueue per payload (one batch each) and waits until durable. Returns the ids.
fn put(store: &Store, queue: u64, payloads: &[Vec<u8>]) -> Vec<MsgId> {
    let mut ids = Vec::new();
    let mut last = 0;
    for p in payloads {
        let mut b = Batch::new();
        b.enqueue(queue, &[p]);
        last = store.append(&mut b).unwrap();
        ids.extend_from_slice(b.ids());
    }
    store.wait_durable(last).unwrap();
    ids
}

fn ack(store: &Store, ids: &[MsgId]) {
    let mut b = Batch::new();
    for &id in ids {
        b.ack(id);
    }
    let t = store.append(&mut b).unwrap();
    store.wait_durable(t).unwrap();
}

fn payload(i: usize, len: usize) -> Vec<u8> {
    let mut p = format!("msg-{i:06}-").into_bytes();
    p.resize(len.max(p.len()), b'x');
    p
}

fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wlog"))
        .collect();
    v.sort();
    v
}

fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn given_appends_and_acks_when_reopened_should_keep_exactly_the_live_messages_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let payloads: Vec<_> = (0..200).map(|i| payload(i, 100)).collect();
    let ids = {
        let (store, rec) = open(dir.path(), 4096);
        assert!(rec.messages.is_empty());
        let ids = put(&store, 7, &payloads);
        let acked: Vec<_> = ids.iter().copied().filter(|id| id % 3 == 0).collect();
        ack(&store, &acked);
        ack(&store, &acked); // double acks are harmless
        ack(&store, &[999_999]); // unknown ids are ignored
        store.close().unwrap();
        ids
    };
    let (_store, rec) = open(dir.path(), 4096);
    let expected: Vec<_> = ids
        .iter()
        .zip(&payloads)
        .filter(|(id, _)| *id % 3 != 0)
        .collect();
    assert_eq!(rec.messages.len(), expected.len());
    for (m, (id, p)) in rec.messages.iter().zip(expected) {
        assert_eq!((m.id, m.queue, &m.payload[..]), (*id, 7, &p[..]));
    }
    assert!(rec.truncated.is_none());
    assert!(rec.corrupted.is_empty());
}

#[test]
fn given_payload_in_parts_and_mixed_batch_should_assign_increasing_ids() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1 << 20);
    let mut b = Batch::new();
    assert!(b.is_empty());
    assert_eq!(b.enqueue(1, &[b"head-", b"body"]), 0);
    assert_eq!(b.enqueue(2, &[]), 1);
    let t = store.append(&mut b).unwrap();
    let ids = b.ids().to_vec();
    assert_eq!(ids.len(), 2);
    assert!(ids[0] < ids[1]);
    b.clear();
    b.ack(ids[1]);
    b.enqueue(3, &[b"third"]);
    let t2 = store.append(&mut b).unwrap();
    assert!(t2 > t);
    assert!(b.ids()[0] > ids[1]);
    store.close().unwrap();
    let (_s, rec) = open(dir.path(), 1 << 20);
    let got: Vec<_> = rec
        .messages
        .iter()
        .map(|m| (m.queue, m.payload.to_vec()))
        .collect();
    assert_eq!(
        got,
        vec![(1, b"head-body".to_vec()), (3, b"third".to_vec())]
    );
}

#[test]
fn given_many_concurrent_appenders_should_group_batches_into_far_fewer_fsyncs() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 64 << 20);
    let threads = 8;
    let per_thread: u64 = 300;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in 0..per_thread {
                    let mut b = Batch::new();
                    b.enqueue(t, &[&payload(i as usize, 256)]);
                    let ticket = store.append(&mut b).unwrap();
                    store.wait_durable(ticket).unwrap(); // like a publisher waiting for its confirm
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let s = store.stats();
    let batches = threads * per_thread;
    assert_eq!(s.batches, batches);
    assert!(s.fsyncs >= 1);
    assert!(
        s.fsyncs * 2 < batches,
        "fsyncs {} should be far fewer than batches {}",
        s.fsyncs,
        batches
    );
    assert!(
        s.groups <= s.fsyncs,
        "EveryBatch: one fsync per group ({s:?})"
    );
    store.close().unwrap();
    let (_s, rec) = open(dir.path(), 64 << 20);
    assert_eq!(rec.messages.len() as u64, batches);
    assert!(rec.messages.windows(2).all(|w| w[0].id < w[1].id));
}

/// Writes `n` messages of varying size into a small-segment log and returns, for the newest segment,
/// its path and the file offsets at which each of its records ends (with the message index).
fn build_log(
    dir: &Path,
    n: usize,
    rng: &mut impl Rng,
) -> (Vec<Vec<u8>>, PathBuf, Vec<(u64, usize)>) {
    let payloads: Vec<_> = (0..n).map(|i| payload(i, rng.gen_range(10..300))).collect();
    let (store, _) = open(dir, 2048);
    put(&store, 1, &payloads);
    store.close().unwrap();
    let newest = segment_files(dir).pop().unwrap();
    let len = std::fs::metadata(&newest).unwrap().len();
    // Walk back from the end: the last messages are in the newest segment.
    let mut ends = Vec::new();
    let mut end = len;
    for i in (0..n).rev() {
        if end <= HEADER_SIZE as u64 {
            break;
        }
        ends.push((end, i));
        end -= (RECORD_HEADER_SIZE + ENQUEUE_FIXED_LEN + payloads[i].len()) as u64;
    }
    assert_eq!(end, HEADER_SIZE as u64, "record sizes add up");
    ends.reverse();
    (payloads, newest, ends)
}

fn copy_dir(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

#[test]
fn given_torn_or_garbled_tail_at_random_offsets_should_keep_every_earlier_record_and_report_the_drop(
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let golden = tempfile::tempdir().unwrap();
    let (payloads, newest, ends) = build_log(golden.path(), 60, &mut rng);
    let newest_name = newest.file_name().unwrap().to_owned();
    let file_len = std::fs::metadata(&newest).unwrap().len();
    let first_in_newest = ends[0].1;
    for round in 0..120 {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(golden.path(), dir.path());
        let target = dir.path().join(&newest_name);
        let offset = rng.gen_range(0..file_len);
        let garble = round % 2 == 1;
        let mut bytes = std::fs::read(&target).unwrap();
        if garble {
            bytes[offset as usize] ^= rng.gen_range(1..=255u8);
        } else {
            bytes.truncate(offset as usize);
        }
        std::fs::write(&target, &bytes).unwrap();

        // Records wholly before the damage survive; the damaged one and all after it go.
        let survivors = ends.iter().filter(|(end, _)| *end <= offset).count();
        let kept_end = ends
            .iter()
            .filter(|(end, _)| *end <= offset)
            .map(|(end, _)| *end)
            .max();
        let (store, rec) = open(dir.path(), 2048);
        let expect_count = first_in_newest + survivors;
        let what = format!("round {round} garble={garble} offset={offset}");
        assert_eq!(rec.messages.len(), expect_count, "{what}");
        for (m, p) in rec.messages.iter().zip(&payloads) {
            assert_eq!(&m.payload[..], &p[..], "{what}");
        }
        let header_hit = offset < HEADER_SIZE as u64;
        let valid_end = if header_hit {
            0
        } else {
            kept_end.unwrap_or(HEADER_SIZE as u64)
        };
        let damaged_len = if garble { file_len } else { offset };
        match &rec.truncated {
            None => assert!(!garble && valid_end == offset, "{what}: nothing reported"),
            Some(t) => {
                assert_eq!(t.offset, valid_end, "{what}: {t:?}");
                assert_eq!(t.dropped_bytes, damaged_len - valid_end, "{what}: {t:?}");
            }
        }
        assert!(rec.corrupted.is_empty(), "{what}");
        // The repaired log accepts appends and reopens cleanly with them.
        let new_ids = put(&store, 2, &[b"after".to_vec()]);
        assert!(
            rec.messages.last().is_none_or(|m| m.id < new_ids[0]),
            "{what}"
        );
        store.close().unwrap();
        drop(store);
        let (_s, again) = open(dir.path(), 2048);
        assert!(again.truncated.is_none(), "{what}");
        assert_eq!(again.messages.len(), expect_count + 1, "{what}");
    }
}

#[test]
fn given_bad_record_in_an_older_segment_should_start_keep_records_before_it_and_skip_the_rest() {
    let golden = tempfile::tempdir().unwrap();
    let payloads: Vec<_> = (0..40).map(|i| payload(i, 200)).collect();
    {
        let (store, _) = open(golden.path(), 1024);
        put(&store, 1, &payloads);
        store.close().unwrap();
    }
    let files = segment_files(golden.path());
    assert!(files.len() >= 3);
    let record = (RECORD_HEADER_SIZE + ENQUEUE_FIXED_LEN + payloads[0].len()) as u64;
    let per_segment: Vec<u64> = files
        .iter()
        .map(|f| (std::fs::metadata(f).unwrap().len() - HEADER_SIZE as u64) / record)
        .collect();
    // Garble the second record of the first segment.
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let at = HEADER_SIZE + record as usize + 30;
    bytes[at] ^= 0xff;
    std::fs::write(&files[0], &bytes).unwrap();

    let (_s, rec) = open(golden.path(), 1024);
    assert!(rec.truncated.is_none());
    assert_eq!(rec.corrupted.len(), 1);
    let c = &rec.corrupted[0];
    assert_eq!(c.offset, HEADER_SIZE as u64 + record);
    assert_eq!(c.skipped_bytes, (per_segment[0] - 1) * record);
    let expected = payloads.len() as u64 - (per_segment[0] - 1);
    assert_eq!(rec.messages.len() as u64, expected);
    assert_eq!(&rec.messages[0].payload[..], &payloads[0][..]);
    assert_eq!(
        &rec.messages[1].payload[..],
        &payloads[per_segment[0] as usize][..]
    );
}

#[test]
fn given_all_messages_acked_should_delete_segments_but_not_while_an_earlier_one_is_live() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1024);
    let ids = put(
        &store,
        1,
        &(0..50).map(|i| payload(i, 200)).collect::<Vec<_>>(),
    );
    let before = store.stats();
    assert!(before.segments >= 5, "{before:?}");
    let files_before = segment_files(dir.path()).len();

    // Everything but the very first message: the first segment pins every later one.
    ack(&store, &ids[1..]);
    std::thread::sleep(Duration::from_millis(50));
    let pinned = store.stats();
    assert_eq!(pinned.segments_deleted, 0, "{pinned:?}");
    assert!(segment_files(dir.path()).len() >= files_before);

    ack(&store, &ids[..1]);
    eventually("segments deleted", || {
        store.stats().segments_deleted as usize >= files_before - 1
    });
    let after = store.stats();
    assert!(
        after.bytes_on_disk < before.bytes_on_disk / 3,
        "{before:?} -> {after:?}"
    );
    assert_eq!(after.live_messages, 0);
    assert_eq!(segment_files(dir.path()).len() as u64, after.segments);
    store.close().unwrap();
    drop(store);

    let (store, rec) = open(dir.path(), 1024);
    assert!(rec.messages.is_empty());
    // Ids keep going up even though every segment that held them is gone.
    let next = put(&store, 1, &[b"later".to_vec()]);
    assert!(next[0] > *ids.last().unwrap());
}

#[test]
fn given_acks_written_but_segments_left_behind_recovery_should_delete_dead_segments() {
    let dir = tempfile::tempdir().unwrap();
    let keep;
    {
        let (store, _) = open(dir.path(), 1024);
        let ids = put(
            &store,
            1,
            &(0..30).map(|i| payload(i, 200)).collect::<Vec<_>>(),
        );
        // Ack the first 20 while the segments stay pinned by the 20th... then restore a copy of the files
        // as they were before deletion, which is what a crash before the directory fsync can leave.
        keep = ids[20..].to_vec();
        let snapshot = tempfile::tempdir().unwrap();
        copy_dir(dir.path(), snapshot.path());
        ack(&store, &ids[..20]);
        store.close().unwrap();
        drop(store);
        for f in segment_files(snapshot.path()) {
            let target = dir.path().join(f.file_name().unwrap());
            if !target.exists() {
                std::fs::copy(&f, &target).unwrap();
            }
        }
    }
    let (store, rec) = open(dir.path(), 1024);
    assert!(rec.segments_deleted > 0);
    assert_eq!(rec.messages.iter().map(|m| m.id).collect::<Vec<_>>(), keep);
    assert_eq!(
        segment_files(dir.path()).len() as u64,
        store.stats().segments
    );
}

#[test]
fn given_reopens_ids_should_stay_strictly_increasing() {
    let dir = tempfile::tempdir().unwrap();
    let mut last = 0;
    for round in 0..5 {
        let (store, _) = open(dir.path(), 512);
        let ids = put(
            &store,
            1,
            &(0..10).map(|i| payload(i, 50)).collect::<Vec<_>>(),
        );
        assert!(ids[0] > last, "round {round}");
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        last = *ids.last().unwrap();
        if round % 2 == 0 {
            ack(&store, &ids);
        }
    }
}

#[test]
fn given_interval_policy_should_write_at_once_but_only_report_durable_after_the_interval_fsync() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(
        dir.path(),
        StoreOptions {
            segment_size: 1 << 20,
            sync: SyncPolicy::IntervalMs(400),
        },
    )
    .unwrap();
    let started = Instant::now();
    let mut b = Batch::new();
    b.enqueue(1, &[b"first"]);
    let ticket = store.append(&mut b).unwrap();
    let rx = store.durable();
    // Written immediately (bytes reach the file) but not yet durable.
    eventually("bytes written", || store.stats().bytes_written > 0);
    if started.elapsed() < Duration::from_millis(300) {
        assert!(*rx.borrow() < ticket, "durable before the interval fsync");
        assert_eq!(store.stats().fsyncs, 0);
    }
    store.wait_durable(ticket).unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(350),
        "{:?}",
        started.elapsed()
    );
    assert!(*rx.borrow() >= ticket);

    // A steady stream for ~1 s costs a few fsyncs, not one per batch.
    let before = store.stats().fsyncs;
    let until = Instant::now() + Duration::from_millis(1000);
    let mut n = 0;
    while Instant::now() < until {
        let mut b = Batch::new();
        b.enqueue(1, &[b"more"]);
        store.append(&mut b).unwrap();
        n += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
    let fsyncs = store.stats().fsyncs - before;
    assert!(fsyncs <= 4, "{fsyncs} fsyncs for {n} batches");
    store.close().unwrap();
    assert_eq!(
        store.stats().durable,
        store.stats().bytes_written + HEADER_SIZE as u64
    );
}

#[test]
fn given_close_should_flush_pending_and_refuse_later_appends() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(
        dir.path(),
        StoreOptions {
            segment_size: 1 << 20,
            sync: SyncPolicy::IntervalMs(60_000),
        },
    )
    .unwrap();
    let mut last = 0;
    for i in 0..100 {
        let mut b = Batch::new();
        b.enqueue(1, &[&payload(i, 64)]);
        last = store.append(&mut b).unwrap();
    }
    store.close().unwrap();
    assert!(*store.durable().borrow() >= last);
    store.wait_durable(last).unwrap();
    let mut b = Batch::new();
    b.enqueue(1, &[b"late"]);
    assert!(matches!(store.append(&mut b), Err(StoreError::Closed)));
    store.close().unwrap();
    drop(store);
    let (_s, rec) = open(dir.path(), 1 << 20);
    assert_eq!(rec.messages.len(), 100);
}

#[test]
fn given_open_store_a_second_open_of_the_same_dir_should_fail() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1 << 20);
    assert!(matches!(
        Store::open(dir.path(), opts(1 << 20)),
        Err(StoreError::Locked { .. })
    ));
    drop(store);
    assert!(Store::open(dir.path(), opts(1 << 20)).is_ok());
}

#[test]
fn given_durable_watch_async_waiters_see_the_watermark_reach_their_ticket() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 1 << 20);
    let mut rx = store.durable();
    let mut b = Batch::new();
    b.enqueue(1, &[b"x"]);
    let ticket = store.append(&mut b).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        rx.wait_for(|d| *d >= ticket).await.unwrap();
    });
    // An empty batch is a barrier: its ticket is everything appended so far.
    let mut empty = Batch::new();
    assert_eq!(store.append(&mut empty).unwrap(), ticket);
}

const CHILD_DIR_ENV: &str = "WARREN_STORE_KILL9_CHILD_DIR";

/// Not a test on its own: the body of the child process killed by the kill -9 test below. It appends from
/// 3 threads, acks every fourth message, and prints each confirmed id once it is durable.
#[test]
fn kill9_child() {
    let Ok(dir) = std::env::var(CHILD_DIR_ENV) else {
        return;
    };
    let (store, _) = Store::open(Path::new(&dir), opts(8 << 10)).unwrap();
    let out = Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let handles: Vec<_> = (0..3)
        .map(|t| {
            let (store, out) = (store.clone(), out.clone());
            std::thread::spawn(move || loop {
                let mut b = Batch::new();
                b.enqueue(t, &[&payload(0, 300)]);
                let ticket = store.append(&mut b).unwrap();
                let id = b.ids()[0];
                store.wait_durable(ticket).unwrap();
                if id.is_multiple_of(4) {
                    let mut a = Batch::new();
                    a.ack(id);
                    let ticket = store.append(&mut a).unwrap();
                    store.wait_durable(ticket).unwrap();
                    writeln!(out.lock().unwrap(), "acked {id}").unwrap();
                } else {
                    writeln!(out.lock().unwrap(), "confirmed {id}").unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn given_kill_9_every_confirmed_message_should_survive_and_acked_ones_stay_gone() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    for round in 0..3 {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "kill9_child", "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR_ENV, dir.path())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut confirmed = Vec::new();
            let mut acked = Vec::new();
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let mut words = line.split_whitespace();
                match (
                    words.next(),
                    words.next().and_then(|w| w.parse::<MsgId>().ok()),
                ) {
                    (Some("confirmed"), Some(id)) => confirmed.push(id),
                    (Some("acked"), Some(id)) => acked.push(id),
                    _ => {}
                }
            }
            (confirmed, acked)
        });
        std::thread::sleep(Duration::from_millis(400 + 150 * round));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let (confirmed, acked) = reader.join().unwrap();
        assert!(
            !confirmed.is_empty(),
            "round {round}: child confirmed nothing"
        );
        let (_store, rec) = open(dir.path(), 8 << 10);
        let live: std::collections::HashSet<MsgId> = rec.messages.iter().map(|m| m.id).collect();
        for id in &confirmed {
            assert!(
                live.contains(id),
                "round {round}: confirmed message {id} lost"
            );
        }
        for id in &acked {
            assert!(
                !live.contains(id),
                "round {round}: acked message {id} came back"
            );
        }
    }
}

/// Throughput with group commit: 4 threads, 1 KiB messages, each waiting for its own confirm (the worst
/// case for fsync count) and then in batches of 32 without waiting. `cargo test -p warren-store --release
/// -- --ignored --nocapture throughput`.
#[test]
#[ignore]
fn throughput() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 64 << 20);
    let store = Arc::new(store);
    let scenarios = [
        ("confirm each", 1usize, true),
        ("1 per batch, no wait", 1, false),
        ("batches of 32", 32, false),
    ];
    for (label, per_batch, wait_each) in scenarios {
        let before = store.stats();
        let started = Instant::now();
        let total_per_thread = 20_000usize;
        let body = vec![b'x'; 1024];
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let store = store.clone();
                let body = body.clone();
                std::thread::spawn(move || {
                    let mut b = Batch::new();
                    let mut last = 0;
                    for _ in 0..total_per_thread / per_batch {
                        b.clear();
                        for _ in 0..per_batch {
                            b.enqueue(t, &[&body]);
                        }
                        last = store.append(&mut b).unwrap();
                        if wait_each {
                            store.wait_durable(last).unwrap();
                        }
                    }
                    store.wait_durable(last).unwrap();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let secs = started.elapsed().as_secs_f64();
        let after = store.stats();
        let msgs = (4 * total_per_thread) as f64;
        let fsyncs = (after.fsyncs - before.fsyncs) as f64;
        println!(
            "{label}: {:.0} msgs/s, {:.1} MB/s, {:.0} fsyncs/s, {:.1} msgs per fsync, {:.2}s",
            msgs / secs,
            msgs * 1024.0 / secs / 1e6,
            fsyncs / secs,
            msgs / fsyncs.max(1.0),
            secs
        );
    }
}
