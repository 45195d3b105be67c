//! The store recovery fuzz target: a small valid store, built with the store's own API, has its files
//! overwritten, cut, extended, replaced or removed as the fuzzer's input says; then the store is
//! opened on them. Opening may refuse with an error (a damaged checkpoint, a newer format), but must
//! never panic; if it opens, every queue it reports must read back to its end without a panic, and a
//! store that opened and closed must open again (recovery leaves a store it can recover).
//!
//! Input: `flags | edit*`, each edit `op u8 | at u32 LE | len u16 LE | data[len]` (cut short at the
//! end of the input).
//! - `flags` bit 0 picks the base store ([`BASES`]); bit 1 reseals record checksums after the edits,
//!   bit 2 segment-header checksums, bit 3 the checkpoint's checksum, so edits reach past the CRC
//!   checks into what recovery does with well-formed but wrong records.
//! - `op % 5` is the edit (overwrite at, insert at, truncate to, remove, replace the whole file with
//!   `data`), `op / 5` the file: an index into [`file_names`] (the base's files and [`EXTRA_FILES`],
//!   names a store could hold that the base may not, sorted by path), modulo their number. `at` is
//!   taken modulo the file's length plus one.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use warren_store::format::{HEADER_SIZE, RECORD_HEADER_SIZE};
use warren_store::{Batch, Store, StoreOptions, SyncPolicy};

/// A store's files: path relative to its directory, and contents.
pub type Files = Vec<(PathBuf, Vec<u8>)>;

/// The base stores an input can start from.
pub const BASES: [&str; 2] = ["copies", "extents"];

/// Files a store may hold that the bases do not: another WAL segment, a queue the checkpoint does not
/// know, a second segment of a known queue, a checkpoint left half-written, a stray directory entry.
pub const EXTRA_FILES: [&str; 6] = [
    "wal/00000000000001000000.wlog",
    "wal/00000000000000000000.wlog",
    "queues/7/00000000000000000000.qseg",
    "queues/1/00000000000000000020.qseg",
    "checkpoint.tmp",
    "queues/x/junk",
];

const OPS: usize = 5;

/// The options every store here is built and opened with: small segments, so a small store has
/// several of each; checkpoints only at open and close, so the files do not depend on timing.
#[allow(clippy::needless_update)] // the default fills options added later (recovery modes, ...)
pub fn options(base: usize) -> StoreOptions {
    let small = base == 0;
    StoreOptions {
        segment_size: if small { 4096 } else { 2 << 20 },
        queue_segment_size: if small { 4096 } else { 1 << 20 },
        checkpoint_bytes: 1 << 40,
        checkpoint_idle_ms: 3_600_000,
        active_segment_idle_ms: 0,
        sync: SyncPolicy::EveryBatch,
        ..StoreOptions::default()
    }
}

/// A fresh, empty directory for one use: under /dev/shm when there is one (fsync is free there).
pub fn scratch_dir(what: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let root = Path::new("/dev/shm");
    let root = if root.is_dir() { root.to_path_buf() } else { std::env::temp_dir() };
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = root.join(format!("warren-fuzz-{}-{what}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn payload(queue: u64, seq: u64, len: usize) -> Vec<u8> {
    let mut p = format!("q{queue}-m{seq:06}-").into_bytes();
    p.resize(len.max(p.len()), b'.');
    p
}

fn enqueue(store: &Store, queue: u64, seqs: std::ops::Range<u64>, len: usize) {
    for seq in seqs {
        let t = store.append_enqueue(queue, seq, 1_000 + seq, &[&payload(queue, seq, len)]).expect("append");
        store.wait_durable(t).expect("durable");
    }
}

fn append(store: &Store, fill: impl FnOnce(&mut Batch)) {
    let mut b = Batch::new();
    fill(&mut b);
    let t = store.append(&mut b).expect("append");
    store.wait_durable(t).expect("durable");
}

/// Every file under `dir` but the LOCK, sorted by path.
pub fn read_files(dir: &Path) -> Files {
    fn walk(root: &Path, dir: &Path, out: &mut Files) {
        for e in std::fs::read_dir(dir).expect("list").flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(root, &p, out);
            } else if e.file_name() != "LOCK" {
                out.push((p.strip_prefix(root).expect("inside").to_path_buf(), std::fs::read(&p).expect("read")));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// Builds base store `base` and returns its files as a crash would leave them: a checkpoint with queue
/// segments (or WAL extents) behind it, then more WAL after it, snapshotted while the store is open.
/// Every append waits for its fsync, so the files are the same on every run.
pub fn build_base(base: usize) -> Files {
    let dir = scratch_dir("base");
    let opts = options(base);
    let (store, _) = Store::open(&dir, opts.clone()).expect("open a new store");
    if base == 0 {
        // Several queues interleaved: their live messages are copied into queue segments at close.
        for seq in 0..30 {
            enqueue(&store, 1, seq..seq + 1, 150);
            if seq % 3 == 0 {
                enqueue(&store, 2, seq / 3..seq / 3 + 1, 90);
            }
        }
        append(&store, |b| {
            b.ack_range(1, 0, 6, 6 * 150);
            b.ack(1, 10, 150);
            b.delivered(1, 12);
        });
        store.set_retention(2, 3_600_000);
        enqueue(&store, 3, 0..3, 40);
        append(&store, |b| b.drop_queue(3));
    } else {
        // One queue's backlog dense enough in the WAL to stay there as an extent at close.
        enqueue(&store, 1, 0..70, 8 << 10);
        append(&store, |b| {
            b.ack_range(1, 20, 25, 5 * (8 << 10));
            b.delivered(1, 30);
        });
    }
    store.close().expect("close");
    drop(store);

    // After the checkpoint: more messages, acks and marks only in the WAL.
    let (more, acked, acked_bytes) = if base == 0 { (30..40, 6..9, 3 * 150) } else { (70..74, 0..3, 3 * (8 << 10)) };
    let (store, _) = Store::open(&dir, opts).expect("reopen");
    enqueue(&store, 1, more, 150);
    enqueue(&store, 4, 0..5, 60);
    append(&store, |b| {
        b.ack(4, 1, 60);
        b.ack_range(1, acked.start, acked.end, acked_bytes);
        b.delivered(4, 3);
    });
    let files = read_files(&dir);
    store.close().expect("close");
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    files
}

/// The base stores, built once per process.
pub fn bases() -> &'static [Files; 2] {
    static BASES_BUILT: OnceLock<[Files; 2]> = OnceLock::new();
    BASES_BUILT.get_or_init(|| [build_base(0), build_base(1)])
}

/// One edit of the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edit {
    pub op: u8,
    pub at: u32,
    pub data: Vec<u8>,
}

impl Edit {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.op);
        out.extend_from_slice(&self.at.to_le_bytes());
        out.extend_from_slice(&(self.data.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.data);
    }
}

/// Splits an input into its flags and edits.
pub fn parse_input(input: &[u8]) -> (u8, Vec<Edit>) {
    let Some((&flags, mut rest)) = input.split_first() else { return (0, Vec::new()) };
    let mut edits = Vec::new();
    while rest.len() >= 7 {
        let op = rest[0];
        let at = u32::from_le_bytes([rest[1], rest[2], rest[3], rest[4]]);
        let len = usize::from(u16::from_le_bytes([rest[5], rest[6]])).min(rest.len() - 7);
        edits.push(Edit { op, at, data: rest[7..7 + len].to_vec() });
        rest = &rest[7 + len..];
    }
    (flags, edits)
}

/// Applies `edits` to `files` (in memory; `None` = removed).
fn apply(files: &mut [(PathBuf, Option<Vec<u8>>)], edits: &[Edit]) {
    for e in edits {
        let idx = usize::from(e.op) / OPS % files.len();
        let file = &mut files[idx].1;
        let len = file.as_ref().map_or(0, Vec::len);
        let at = e.at as usize % (len + 1);
        match usize::from(e.op) % OPS {
            0 => {
                let f = file.get_or_insert_with(Vec::new);
                let end = at + e.data.len();
                if f.len() < end {
                    f.resize(end, 0);
                }
                f[at..end].copy_from_slice(&e.data);
            }
            1 => {
                file.get_or_insert_with(Vec::new).splice(at..at, e.data.iter().copied());
            }
            2 => {
                if let Some(f) = file {
                    f.truncate(at);
                }
            }
            3 => *file = None,
            _ => *file = Some(e.data.clone()),
        }
    }
}

/// Rewrites the checksums of what an edit damaged, as far as the structure can be followed.
fn reseal(path: &Path, data: &mut [u8], flags: u8) {
    let segment = path.extension().is_some_and(|x| x == "wlog" || x == "qseg");
    if segment && data.len() >= HEADER_SIZE {
        if flags & 4 != 0 {
            let crc = crc32c::crc32c(&data[..HEADER_SIZE - 4]);
            data[HEADER_SIZE - 4..HEADER_SIZE].copy_from_slice(&crc.to_le_bytes());
        }
        if flags & 2 != 0 {
            let mut at = HEADER_SIZE;
            while at + RECORD_HEADER_SIZE <= data.len() {
                let len = u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]) as usize;
                let Some(end) = (at + RECORD_HEADER_SIZE).checked_add(len).filter(|&e| e <= data.len()) else { break };
                let crc = crc32c::crc32c(&data[at + RECORD_HEADER_SIZE..end]);
                data[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
                at = end;
            }
        }
    }
    if flags & 8 != 0 && path.file_name().is_some_and(|n| n == "checkpoint") && data.len() >= 4 {
        let body = data.len() - 4;
        let crc = crc32c::crc32c(&data[..body]);
        data[body..].copy_from_slice(&crc.to_le_bytes());
    }
}

/// The files an edit can name in base `base`: its own and [`EXTRA_FILES`], sorted by path.
pub fn file_names(base: usize) -> Vec<PathBuf> {
    let mut names: Vec<PathBuf> = bases()[base].iter().map(|(p, _)| p.clone()).collect();
    names.extend(EXTRA_FILES.iter().map(PathBuf::from));
    names.sort();
    names.dedup();
    names
}

/// Writes base `base` with `edits` applied (and resealed per `flags`) into the empty directory `dir`.
pub fn materialize(dir: &Path, flags: u8, edits: &[Edit]) {
    let base = usize::from(flags & 1);
    let contents = &bases()[base];
    let mut files: Vec<(PathBuf, Option<Vec<u8>>)> = file_names(base)
        .into_iter()
        .map(|p| {
            let data = contents.iter().find(|(q, _)| *q == p).map(|(_, d)| d.clone());
            (p, data)
        })
        .collect();
    apply(&mut files, edits);
    std::fs::create_dir_all(dir.join("wal")).expect("mkdir");
    std::fs::create_dir_all(dir.join("queues")).expect("mkdir");
    for (path, data) in &mut files {
        let Some(data) = data else { continue };
        reseal(path, data, flags);
        let full = dir.join(&*path);
        std::fs::create_dir_all(full.parent().expect("in a directory")).expect("mkdir");
        std::fs::write(&full, data).expect("write");
    }
}

/// Reads every live message of every queue `store` recovered; returns how many were read and lost.
fn read_everything(store: &Store, rec: &warren_store::Recovery) -> (u64, u64) {
    let (mut read, mut lost) = (0, 0);
    for q in &rec.queues {
        let mut seq = 0;
        // Bounded: forged seqs can put billions of gone ones between live ones.
        for _ in 0..10_000 {
            let Ok(batch) = store.read(q.queue, seq, 64, 64 << 10) else { break };
            assert!(batch.next_seq >= seq, "queue {}: a read from {seq} continues at {}", q.queue, batch.next_seq);
            let mut prev = None;
            for m in &batch.messages {
                assert!(m.seq >= seq && m.seq < batch.next_seq, "queue {}: seq {} read from {seq}, next {}", q.queue, m.seq, batch.next_seq);
                assert!(prev.is_none_or(|p| p < m.seq), "queue {}: seqs out of order", q.queue);
                prev = Some(m.seq);
            }
            read += batch.messages.len() as u64;
            lost += batch.lost;
            if batch.messages.is_empty() && (batch.next_seq == seq || batch.next_seq >= q.next_seq) {
                break;
            }
            seq = batch.next_seq;
        }
    }
    (read, lost)
}

/// The whole check for one input.
pub fn check_recovery(input: &[u8]) {
    let (flags, edits) = parse_input(input);
    let dir = scratch_dir("run");
    materialize(&dir, flags, &edits);
    let opts = options(usize::from(flags & 1));
    if let Ok((store, rec)) = Store::open(&dir, opts.clone()) {
        read_everything(&store, &rec);
        store.close().expect("close");
        drop(store);
        // Recovery repaired what it could and wrote a fresh checkpoint: the store opens again.
        let (store, _) = Store::open(&dir, opts).unwrap_or_else(|e| panic!("a store that opened once is refused the second time: {e}"));
        store.close().expect("close");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
