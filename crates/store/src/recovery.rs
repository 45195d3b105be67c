//! Recovery: restores the queue logs from the checkpoint, replays the WAL after it into them, repairs a
//! torn WAL tail, refuses or isolates corruption (per [`RecoveryMode`]), and reports each queue's live
//! range. Work is proportional to the WAL after the last checkpoint (at most `checkpoint_bytes` plus one
//! group), not to the backlog: a queue's messages stay in its files until it reads them.
//!
//! A torn tail and corruption in the middle are told apart (see `format` for what is trusted):
//! - a **torn tail** is damage in the newest WAL segment, after the checkpoint, that no synced mark
//!   proves durable (each group ends with one: `format`): only bytes written after the last fsync can
//!   be there, none of them confirmed. A disk that persists a write's blocks out of order can leave
//!   valid records after the damage; they were not confirmed either. It is cut there, with
//!   everything after it (the cut bytes kept in `damaged/`), unless the mode is `AbsoluteConsistency`.
//!   In a segment of the older format without marks, damage is a torn tail only if no valid record
//!   follows it.
//! - **corruption in the middle** is any other damage: a later group's mark says it was durable, or
//!   it is in an older segment (each is fsynced before the next one is created), or before the
//!   checkpoint (which was written after everything before it was durable). Recovery refuses to start with an error naming
//!   the file and offset, unless the mode is `TolerateAnyCorruption`: then the damaged bytes are skipped,
//!   the valid records after them replayed, a checkpoint is written, and the damaged file is moved into
//!   `damaged/` (never deleted).
//!
//! ### To ensure correctness
//! - Decide before changing the WAL: every segment is scanned and judged before records are applied or
//!   files cut, so a refusal leaves the damaged files as they were (queue files are only cut back to
//!   the lengths the checkpoint recorded, which the replay rewrites anyway).

use std::collections::{HashSet, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::checkpoint;
use crate::damaged::{aside_name, copy_aside, damaged_dir, move_aside};
use crate::direct::Appender;
use crate::error::StoreError;
use crate::format::{self, Damage, Record, HEADER_SIZE, WAL_MAGIC, WAL_VERSION};
use crate::io::{Disk, Open};
use crate::qlog::{QueueLog, QueueLogs};
use crate::segment;
use crate::writer::Start;

/// What recovery does with damaged data, in the spirit of raft-engine's recovery modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecoveryMode {
    /// A torn tail of the newest WAL segment (what a crash leaves) is cut; corruption in the middle
    /// refuses to start. The default.
    #[default]
    TolerateTailCorruption,
    /// Any damage refuses to start, a torn tail included (as raft-engine's `AbsoluteConsistency`): after
    /// a power loss an operator has to look every time.
    AbsoluteConsistency,
    /// Damaged bytes are skipped and the valid records around them recovered; the damaged files are kept
    /// in `damaged/`. What the damaged bytes held is lost (an ack lost this way brings a message back).
    TolerateAnyCorruption,
}

impl RecoveryMode {
    /// The name used in configuration: `tolerate-tail-corruption`, `absolute-consistency`,
    /// `tolerate-any-corruption`.
    pub fn name(self) -> &'static str {
        match self {
            RecoveryMode::TolerateTailCorruption => "tolerate-tail-corruption",
            RecoveryMode::AbsoluteConsistency => "absolute-consistency",
            RecoveryMode::TolerateAnyCorruption => "tolerate-any-corruption",
        }
    }
}

impl std::fmt::Display for RecoveryMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for RecoveryMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [RecoveryMode::TolerateTailCorruption, RecoveryMode::AbsoluteConsistency, RecoveryMode::TolerateAnyCorruption]
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                format!("unknown recovery mode {s:?} (tolerate-tail-corruption, absolute-consistency or tolerate-any-corruption)")
            })
    }
}

/// A queue with messages in the store when it was last running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredQueue {
    pub queue: u64,
    /// Live messages are in `[first_seq, next_seq)` (some seqs in between may be gone).
    pub first_seq: u64,
    pub next_seq: u64,
    pub live_count: u64,
    pub live_bytes: u64,
    /// Seqs below this may have been delivered before the restart (see `Batch::delivered`): they come
    /// back redelivered; live ones at or above it were never delivered.
    pub delivered_until: u64,
}

/// What recovery found and did.
#[derive(Debug, Default)]
pub struct Recovery {
    /// Every queue the store knows, by id order.
    pub queues: Vec<RecoveredQueue>,
    /// The torn tail cut off the newest WAL segment, if there was one (also logged with `tracing::warn!`).
    pub truncated: Option<TornTail>,
    /// Damage skipped under `RecoveryMode::TolerateAnyCorruption` (logged with `tracing::error!`): what
    /// those bytes held is lost; everything around them was recovered.
    pub corrupted: Vec<CorruptSegment>,
    /// WAL bytes replayed after the checkpoint.
    pub replayed_bytes: u64,
    /// Messages the checkpoint listed that the files no longer hold (also logged with
    /// `tracing::error!`): counted, no longer live; the rest of each queue was recovered.
    pub lost: Vec<LostMessages>,
}

/// Messages of a queue lost with the bytes that held them: a queue segment file the checkpoint
/// lists is missing or shorter than recorded, or a WAL segment holding a queue's extent is missing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostMessages {
    pub queue: u64,
    pub file: PathBuf,
    /// Where the missing bytes start in `file` (0: the whole file).
    pub offset: u64,
    /// Live messages lost (exact: the checkpoint knows which seqs were gone already).
    pub messages: u64,
    pub what: String,
}

/// The damaged end of the newest WAL segment, cut by recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    pub segment: PathBuf,
    /// File offset of the first bad byte: the file now ends here (0: the whole file was moved aside).
    pub offset: u64,
    pub dropped_bytes: u64,
    pub reason: Damage,
    /// Where the cut bytes were kept (`damaged/<segment name>.<offset>`); `None` if the disk had no
    /// room for them (they were never confirmed, so the cut goes ahead).
    pub kept: Option<PathBuf>,
}

/// Damaged bytes skipped under `RecoveryMode::TolerateAnyCorruption`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptSegment {
    pub segment: PathBuf,
    pub offset: u64,
    pub skipped_bytes: u64,
    pub reason: String,
    /// Where the damaged file (or its damaged bytes) now is, in `damaged/`.
    pub kept: PathBuf,
}

/// One WAL segment, scanned: where its valid records are, where it is damaged, and what its synced
/// marks prove durable.
struct Scan {
    /// `[start, end)` of each valid record, in order.
    records: Vec<(usize, usize)>,
    /// Damaged ranges: start, the next valid record after it (`None`: nothing valid follows), why.
    damage: Vec<(usize, Option<usize>, Damage)>,
    /// End of the last valid record (or of the header).
    valid_end: usize,
    /// The segment's groups end with synced marks (format version 3, or a header too damaged to
    /// tell: it can only be a segment this version created, torn before its first fsync).
    marked: bool,
    /// The highest `synced_to` of a valid synced mark found where it says it is: the WAL was durable
    /// up to here (0: no mark proves anything).
    synced_to: u64,
}

fn scan(data: &[u8], base: u64) -> Scan {
    let mut out = Scan { records: Vec::new(), damage: Vec::new(), valid_end: HEADER_SIZE.min(data.len()), marked: true, synced_to: 0 };
    let mut off = HEADER_SIZE;
    match format::decode_header(data, WAL_MAGIC) {
        Ok((version, _)) => out.marked = version >= WAL_VERSION,
        Err(reason) => {
            let next = format::find_record(data, HEADER_SIZE);
            out.damage.push((0, next, reason));
            out.valid_end = 0;
            match next {
                Some(n) => off = n,
                None => return out,
            }
        }
    }
    while let Some(rest) = data.get(off..).filter(|r| !r.is_empty()) {
        match format::decode_record(rest) {
            Ok((record, n)) => {
                if let Record::Synced { synced_to, at } = record {
                    if at == base + off as u64 && synced_to <= at {
                        out.synced_to = out.synced_to.max(synced_to);
                    }
                }
                out.records.push((off, off + n));
                off += n;
                out.valid_end = off;
            }
            Err(_) if crate::direct::is_padding(rest) => break,
            Err(reason) => {
                let next = format::find_record(data, off + 1);
                out.damage.push((off, next, reason));
                match next {
                    Some(n) => off = n,
                    None => break,
                }
            }
        }
    }
    out
}

/// Restores the store in `dir`; returns where the WAL writer starts, the queue logs, and the report.
pub(crate) fn recover(disk: &Disk, dir: &Path, queue_segment_size: u64, mode: RecoveryMode) -> Result<(Start, QueueLogs, Recovery), StoreError> {
    let started = Instant::now();
    let wal = segment::wal_dir(dir);
    refuse_old_layout(dir)?;
    make_dirs(disk, dir, &[&wal, &dir.join("queues")])?;

    let cp = match checkpoint::read(dir)? {
        None => checkpoint::Checkpoint::default(),
        Some(Ok(cp)) => cp,
        Some(Err(bad)) => {
            return Err(StoreError::Io {
                op: "reading",
                path: dir.join(checkpoint::FILE),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("the checkpoint is damaged ({}); restore it from a backup or move the data directory aside", bad.0),
                ),
            })
        }
    };
    let logs = QueueLogs::new(disk);
    let known: HashSet<u64> = cp.queues.iter().map(|q| q.id).collect();
    // Queue data the checkpoint promised but the files no longer hold.
    let mut lost: Vec<LostMessages> = Vec::new();
    for state in cp.queues {
        let id = state.id;
        let log = QueueLog::restore(disk, dir, state, &mut lost).map_err(StoreError::io("restoring", crate::qlog::queue_dir(dir, id)))?;
        logs.insert(log);
    }
    // Queue directories the checkpoint does not know were created after it: the replay recreates them.
    let queues_dir = dir.join("queues");
    for entry in fs::read_dir(&queues_dir).map_err(StoreError::io("listing", &queues_dir))? {
        let entry = entry.map_err(StoreError::io("listing", &queues_dir))?;
        let Some(id) = entry.file_name().to_str().and_then(|n| n.parse::<u64>().ok()) else { continue };
        if !known.contains(&id) {
            disk.remove_dir_all(&entry.path()).map_err(StoreError::io("removing", entry.path()))?;
        }
    }

    let mut out = Recovery::default();
    // Lost messages are counted and the queues go on (what the files still hold is recovered),
    // except where the operator asked to look at every damage (absolute-consistency).
    if let Some(l) = lost.first().filter(|_| mode == RecoveryMode::AbsoluteConsistency) {
        return Err(StoreError::Corrupt { path: l.file.clone(), offset: l.offset, reason: l.what.clone(), advice: refusal_advice(dir, mode) });
    }
    for l in &lost {
        tracing::error!(file = %l.file.display(), offset = l.offset, queue = l.queue, lost = l.messages,
            "{}: {} messages lost; the rest of the queue is recovered", l.what, l.messages);
    }
    out.lost = lost;
    let extent_bases: HashSet<u64> = logs.all().iter().flat_map(|l| l.lock().extents().map(|(b, _, _)| b).collect::<Vec<_>>()).collect();
    let bases = segment::list(&wal)?;

    // First judge every segment to replay, before anything is changed.
    struct Judged {
        base: u64,
        path: PathBuf,
        data: Vec<u8>,
        scan: Scan,
        /// Damage skipped (tolerate-any-corruption): the file goes aside once a checkpoint covers it.
        skipped: bool,
        /// The torn tail to cut: the offset it starts at.
        cut: Option<(usize, Damage)>,
    }
    let mut judged = Vec::new();
    let mut wal_bases: VecDeque<u64> = VecDeque::new();
    let mut end_pos = cp.wal_pos;
    for (i, &base) in bases.iter().enumerate() {
        let newest = i + 1 == bases.len();
        let path = segment::path(&wal, base);
        if bases.get(i + 1).is_some_and(|&next| next <= cp.wal_pos) {
            // Wholly before the checkpoint: nothing to replay. It is still here because a queue's extent
            // is in it (or a crash came between the checkpoint and its deletion); reads check its records.
            let len = fs::metadata(&path).map_err(StoreError::io("reading", &path))?.len();
            wal_bases.push_back(base);
            end_pos = end_pos.max(base + len);
            continue;
        }
        let data = fs::read(&path).map_err(StoreError::io("reading", &path))?;
        if let Err(Damage::UnsupportedVersion { version }) = format::decode_header(&data, WAL_MAGIC) {
            return Err(StoreError::UnsupportedVersion { path, version, supported: WAL_VERSION });
        }
        let scan = scan(&data, base);
        let mut skipped = false;
        let mut cut = None;
        for (offset, next, reason) in &scan.damage {
            // Only bytes written after the last fsync can be torn: the newest segment's, after the
            // checkpoint, and no synced mark says they were durable (in a segment without marks:
            // nothing valid follows them).
            let at = base + *offset as u64;
            let unsynced = if scan.marked { scan.synced_to <= at } else { next.is_none() };
            let torn = newest && unsynced && at >= cp.wal_pos;
            let refuse = match mode {
                RecoveryMode::AbsoluteConsistency => true,
                RecoveryMode::TolerateTailCorruption => !torn,
                RecoveryMode::TolerateAnyCorruption => false,
            };
            if refuse {
                let what = if torn {
                    format!("{reason}: a torn tail (written after the last fsync; recovery mode {mode} refuses even this)")
                } else if !newest {
                    format!("{reason}, in a WAL segment that is not the newest (it was fsynced whole): this is not a torn write")
                } else if at < cp.wal_pos {
                    format!("{reason}, before the last checkpoint (it was fsynced): this is not a torn write")
                } else if scan.marked {
                    format!("{reason}, and a later group's synced mark says the WAL was durable up to position {} (this is {at}): this is not a torn write", scan.synced_to)
                } else {
                    format!("{reason}, and valid records follow at offset {}: this is not a torn write", next.unwrap_or(0))
                };
                return Err(StoreError::Corrupt { path, offset: *offset as u64, reason: what, advice: refusal_advice(dir, mode) });
            }
            if torn {
                // Everything after it goes too: valid records there are of writes no fsync covered.
                cut = Some((*offset, reason.clone()));
                break;
            }
            skipped = true;
        }
        judged.push(Judged { base, path, data, scan, skipped, cut });
    }

    // Then replay.
    let damaged = damaged_dir(dir);
    let mut active: Option<(u64, usize)> = None;
    let mut set_aside: Vec<(PathBuf, u64, u64)> = Vec::new();
    let newest_base = bases.last().copied();
    for j in &judged {
        end_pos = end_pos.max(j.base);
        let cut_at = j.cut.as_ref().map_or(usize::MAX, |(offset, _)| *offset);
        for &(start, end) in j.scan.records.iter().take_while(|&&(start, _)| start < cut_at) {
            if j.base + start as u64 >= cp.wal_pos {
                replay(&j.data[start..end], dir, &logs, queue_segment_size, &mut out)?;
            }
        }
        let disk_len = j.data.len() as u64;
        if j.skipped {
            for (offset, next, reason) in &j.scan.damage {
                let skipped_bytes = next.unwrap_or(j.data.len()) as u64 - *offset as u64;
                tracing::error!(file = %j.path.display(), offset, skipped_bytes, %reason,
                    "damaged bytes in a WAL segment skipped (recovery mode tolerate-any-corruption)");
                let kept = damaged.join(aside_name(&j.path, j.scan.damage[0].0 as u64));
                out.corrupted.push(CorruptSegment { segment: j.path.clone(), offset: *offset as u64, skipped_bytes, reason: reason.to_string(), kept });
            }
            // Past its whole length: a new segment starts after it, and the checkpoint covers it.
            end_pos = end_pos.max(j.base + disk_len);
            set_aside.push((j.path.clone(), j.base, j.scan.damage[0].0 as u64));
            wal_bases.push_back(j.base);
            continue;
        }
        let mut kept_len = disk_len;
        if let Some((offset, reason)) = &j.cut {
            let dropped = disk_len - *offset as u64;
            let kept = if *offset == 0 {
                // Nothing valid in it at all (a roll just before the crash): the whole file goes aside.
                Some(move_aside(disk, dir, &j.path, &aside_name(&j.path, 0))?)
            } else {
                let kept = copy_aside(disk, dir, &aside_name(&j.path, *offset as u64), &j.data[*offset..])?;
                truncate(disk, &j.path, *offset as u64)?;
                kept
            };
            tracing::warn!(file = %j.path.display(), offset, dropped_bytes = dropped, %reason, kept = ?kept,
                "torn tail in the newest WAL segment (unconfirmed bytes written before a crash); cut, and kept aside");
            out.truncated = Some(TornTail { segment: j.path.clone(), offset: *offset as u64, dropped_bytes: dropped, reason: reason.clone(), kept });
            if *offset == 0 {
                continue;
            }
            kept_len = *offset as u64;
        }
        wal_bases.push_back(j.base);
        let valid_len = j.scan.valid_end.min(kept_len as usize);
        end_pos = end_pos.max(j.base + kept_len);
        // Appending after a cut below the checkpoint would put new records where extents expect old ones;
        // a segment without synced marks is not continued (the next start would judge it by the rule
        // for unmarked segments).
        if Some(j.base) == newest_base && j.base + valid_len as u64 >= cp.wal_pos && j.scan.marked {
            active = Some((j.base, valid_len));
        }
    }
    for log in logs.all() {
        let mut log = log.lock();
        log.flush().map_err(StoreError::io("writing", crate::qlog::queue_dir(dir, log.id)))?;
    }
    let mut checkpoint_pos = cp.wal_pos;
    if !set_aside.is_empty() {
        // The records around the damage are in the queue files now: make them and a checkpoint covering
        // the damaged segments durable, then those segments are no longer needed where they are.
        disk.syncfs(dir).map_err(StoreError::io("syncfs", dir))?;
        let queues = logs.all().iter().map(|l| checkpoint::QueueState::of(&l.lock())).collect();
        checkpoint::write(disk, dir, &checkpoint::Checkpoint { wal_pos: end_pos, queues })
            .map_err(StoreError::io("writing", dir.join(checkpoint::FILE)))?;
        checkpoint_pos = end_pos;
        for (path, base, offset) in set_aside {
            if Some(base) == newest_base {
                active = None; // never append after damage: the next start would judge it in the middle
            }
            if extent_bases.contains(&base) {
                // Queues' messages are in it: it stays; its damaged bytes are kept aside too.
                let data = fs::read(&path).map_err(StoreError::io("reading", &path))?;
                copy_aside(disk, dir, &aside_name(&path, offset), data.get(offset as usize..).unwrap_or_default())?;
            } else {
                move_aside(disk, dir, &path, &aside_name(&path, offset))?;
                wal_bases.retain(|&b| b != base);
            }
        }
    }

    // Appends continue in the newest segment if it survived intact up to its valid end; otherwise in a
    // fresh one, never after the garbage of an older segment.
    let (file, base, pos) = match active {
        Some((base, valid_len)) => {
            let path = segment::path(&wal, base);
            let file = Appender::open_at(disk, &path, valid_len as u64).map_err(StoreError::io("opening", &path))?;
            (file, base, base + valid_len as u64)
        }
        None => {
            let file = segment::create(disk, &wal, end_pos)?;
            wal_bases.push_back(end_pos);
            (file, end_pos, end_pos + HEADER_SIZE as u64)
        }
    };
    // What was replayed may only have been in the page cache (a killed process): make the WAL and the queue
    // files durable before anything is appended and confirmed on top of them.
    file.sync_data().map_err(StoreError::io("fsyncing", segment::path(&wal, base)))?;

    for log in logs.all() {
        let mut log = log.lock();
        // What replayed rewinds made live is simply live now: no queue is waiting to take it.
        log.take_rewound();
        let floor = log.gone.floor();
        out.queues.push(RecoveredQueue {
            queue: log.id,
            first_seq: floor,
            next_seq: log.next_seq,
            live_count: log.live_count(),
            live_bytes: log.live_bytes,
            delivered_until: log.delivered_until,
        });
    }
    out.queues.sort_by_key(|q| q.queue);
    // Saturating: a damaged checkpoint can claim counts near u64::MAX (the fuzzer's input).
    let live: u64 = out.queues.iter().fold(0, |sum, q| sum.saturating_add(q.live_count));
    tracing::info!(
        dir = %dir.display(),
        queues = out.queues.len(),
        live_messages = live,
        replayed_bytes = out.replayed_bytes,
        torn_tail = out.truncated.is_some(),
        corrupt_segments = out.corrupted.len(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "message store recovered"
    );
    Ok((Start { file, base, pos, wal_bases, checkpoint_pos }, logs, out))
}

/// Applies one valid WAL record to the queue logs.
fn replay(record: &[u8], dir: &Path, logs: &QueueLogs, queue_segment_size: u64, out: &mut Recovery) -> Result<(), StoreError> {
    let Ok((decoded, _)) = format::decode_record(record) else { return Ok(()) };
    out.replayed_bytes += record.len() as u64;
    match decoded {
        Record::Enqueue { queue, seq, timestamp_ms, payload } => {
            let log = logs.get_or_create(dir, queue);
            let mut log = log.lock();
            log.append(record, seq, timestamp_ms, payload.len(), queue_segment_size)
                .map_err(StoreError::io("writing", crate::qlog::queue_dir(dir, queue)))
        }
        Record::Synced { .. } => Ok(()),
        other @ (Record::Acks { .. } | Record::Drop { .. } | Record::Delivered { .. } | Record::Rewind { .. }) => {
            // Replay lets nothing go (see `apply_gone`).
            logs.apply_gone(other, None, true, 0).map_err(StoreError::io("writing", dir.join("queues")))?;
            Ok(())
        }
    }
}

/// What a refusal tells the operator to do.
fn refusal_advice(dir: &Path, mode: RecoveryMode) -> String {
    format!(
        "recovery mode {mode} refuses to start on it; to skip the damaged bytes (what they held is lost) and keep them in {}, \
         start once with --recovery-mode tolerate-any-corruption",
        damaged_dir(dir).display()
    )
}

/// Creates the store's subdirectories that are missing and makes their names durable: a WAL segment
/// fsynced inside a `wal` directory whose own entry was never fsynced can vanish with it.
fn make_dirs(disk: &Disk, dir: &Path, subdirs: &[&Path]) -> Result<(), StoreError> {
    let mut created = false;
    for sub in subdirs {
        if !sub.is_dir() {
            disk.create_dir_all(sub).map_err(StoreError::io("creating", *sub))?;
            created = true;
        }
    }
    if created {
        segment::sync_dir(disk, dir)?;
    }
    Ok(())
}

fn truncate(disk: &Disk, path: &Path, len: u64) -> Result<(), StoreError> {
    let f = disk.open(path, Open::Existing, false).map_err(StoreError::io("opening", path))?;
    f.set_len(len).map_err(StoreError::io("truncating", path))?;
    f.sync_all().map_err(StoreError::io("fsyncing", path))
}

/// Warren 0.1 kept a single log in the data directory itself; this version cannot read it.
fn refuse_old_layout(dir: &Path) -> Result<(), StoreError> {
    let old = segment::list(dir)?;
    if let Some(&base) = old.first() {
        return Err(StoreError::UnsupportedVersion { path: segment::path(dir, base), version: 1, supported: WAL_VERSION });
    }
    Ok(())
}
