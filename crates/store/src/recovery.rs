//! Recovery: restores the queue logs from the checkpoint, replays the WAL after it into them, repairs a
//! torn WAL tail, isolates corruption, writes a fresh checkpoint, and reports each queue's live range.
//! Work is proportional to the WAL after the last checkpoint (at most `checkpoint_bytes` plus one group),
//! not to the backlog: a queue's messages stay in its files until it reads them.
//!
//! It never refuses to start because of damaged data (see `format` for what is trusted); only I/O errors,
//! a locked directory, a file from a newer format version or a damaged checkpoint stop it.

use std::collections::VecDeque;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::checkpoint;
use crate::direct::Appender;
use crate::error::StoreError;
use crate::format::{self, Damage, Record, HEADER_SIZE, VERSION, WAL_MAGIC};
use crate::io::{Disk, Open};
use crate::qlog::{QueueLog, QueueLogs};
use crate::segment;
use crate::writer::Start;

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
    /// Older WAL segments with a bad record: the records from `offset` on were skipped (logged with
    /// `tracing::error!`). What they held is lost; everything else was recovered.
    pub corrupted: Vec<CorruptSegment>,
    /// WAL bytes replayed after the checkpoint.
    pub replayed_bytes: u64,
}

/// The damaged end of the newest WAL segment, dropped by recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    pub segment: PathBuf,
    /// File offset of the first bad byte: the file now ends here (0: the whole file was removed).
    pub offset: u64,
    pub dropped_bytes: u64,
    pub reason: Damage,
}

/// A bad record found in a WAL segment that is not the newest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptSegment {
    pub segment: PathBuf,
    pub offset: u64,
    pub skipped_bytes: u64,
    pub reason: Damage,
}

/// Restores the store in `dir`; returns where the WAL writer starts, the queue logs, and the report.
pub(crate) fn recover(disk: &Disk, dir: &Path, queue_segment_size: u64) -> Result<(Start, QueueLogs, Recovery), StoreError> {
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
    let known: std::collections::HashSet<u64> = cp.queues.iter().map(|q| q.id).collect();
    for state in cp.queues {
        let id = state.id;
        let log = QueueLog::restore(disk, dir, state).map_err(StoreError::io("restoring", crate::qlog::queue_dir(dir, id)))?;
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
    let bases = segment::list(&wal)?;
    let mut wal_bases: VecDeque<u64> = VecDeque::new();
    let mut end_pos = cp.wal_pos;
    let mut active: Option<(u64, usize)> = None;
    let now = crate::now_ms();
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
        let disk_len = data.len() as u64;
        end_pos = end_pos.max(base);
        match format::decode_header(&data, WAL_MAGIC) {
            Ok(_) => {}
            Err(Damage::UnsupportedVersion { version }) => {
                return Err(StoreError::UnsupportedVersion { path, version, supported: VERSION });
            }
            Err(reason) if newest => {
                // Created by a roll just before the crash: nothing in it was ever confirmed.
                tracing::warn!(file = %path.display(), offset = 0, dropped_bytes = disk_len, %reason,
                    "newest WAL segment has a torn header; removing it");
                disk.remove_file(&path).map_err(StoreError::io("removing", &path))?;
                segment::sync_dir(disk, &wal)?;
                out.truncated = Some(TornTail { segment: path, offset: 0, dropped_bytes: disk_len, reason });
                continue;
            }
            Err(reason) => {
                tracing::error!(file = %path.display(), offset = 0, skipped_bytes = disk_len, %reason,
                    "corrupt WAL segment header; skipping the whole segment");
                out.corrupted.push(CorruptSegment { segment: path, offset: 0, skipped_bytes: disk_len, reason });
                wal_bases.push_back(base);
                end_pos = end_pos.max(base + disk_len);
                continue;
            }
        }
        wal_bases.push_back(base);
        let (valid_len, damage) = replay(&data, base, cp.wal_pos, dir, &logs, queue_segment_size, now, &mut out)?;
        let mut kept_len = disk_len;
        if let Some(reason) = damage {
            let dropped = disk_len - valid_len as u64;
            if newest {
                tracing::warn!(file = %path.display(), offset = valid_len, dropped_bytes = dropped, %reason,
                    "torn tail in the newest WAL segment; truncating to the last valid record");
                truncate(disk, &path, valid_len as u64)?;
                kept_len = valid_len as u64;
                out.truncated = Some(TornTail { segment: path, offset: valid_len as u64, dropped_bytes: dropped, reason });
            } else {
                tracing::error!(file = %path.display(), offset = valid_len, skipped_bytes = dropped, %reason,
                    "corrupt record in an older WAL segment; keeping the records before it, skipping the rest");
                out.corrupted.push(CorruptSegment { segment: path, offset: valid_len as u64, skipped_bytes: dropped, reason });
            }
        }
        end_pos = end_pos.max(base + kept_len);
        // Appending after a cut below the checkpoint would put new records where extents expect old ones.
        if newest && base + valid_len as u64 >= cp.wal_pos {
            active = Some((base, valid_len));
        }
    }
    for log in logs.all() {
        let mut log = log.lock();
        log.flush().map_err(StoreError::io("writing", crate::qlog::queue_dir(dir, log.id)))?;
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
        let log = log.lock();
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
    let live: u64 = out.queues.iter().map(|q| q.live_count).sum();
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
    Ok((Start { file, base, pos, wal_bases, checkpoint_pos: cp.wal_pos }, logs, out))
}

/// Applies the records of one WAL segment at or after `from_pos` to the queue logs. Returns the end of
/// the valid prefix and, if the scan stopped early, why.
#[allow(clippy::too_many_arguments)]
fn replay(
    data: &[u8],
    base: u64,
    from_pos: u64,
    dir: &Path,
    logs: &QueueLogs,
    queue_segment_size: u64,
    now_ms: u64,
    out: &mut Recovery,
) -> Result<(usize, Option<Damage>), StoreError> {
    let mut off = HEADER_SIZE;
    while let Some(rest) = data.get(off..).filter(|r| !r.is_empty()) {
        let (record, n) = match format::decode_record(rest) {
            Ok(r) => r,
            Err(_) if crate::direct::is_padding(rest) => return Ok((off, None)),
            Err(damage) => return Ok((off, Some(damage))),
        };
        if base + off as u64 >= from_pos {
            out.replayed_bytes += n as u64;
            match record {
                Record::Enqueue { queue, seq, timestamp_ms, payload } => {
                    let log = logs.get_or_create(dir, queue);
                    let mut log = log.lock();
                    log.append(&rest[..n], seq, timestamp_ms, payload.len(), queue_segment_size)
                        .map_err(StoreError::io("writing", crate::qlog::queue_dir(dir, queue)))?;
                }
                record @ (Record::Acks { .. } | Record::Drop { .. } | Record::Delivered { .. }) => {
                    logs.apply_gone(record, now_ms, true, 0).map_err(StoreError::io("writing", dir.join("queues")))?;
                }
            }
        }
        off += n;
    }
    Ok((off, None))
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
        return Err(StoreError::UnsupportedVersion { path: segment::path(dir, base), version: 1, supported: VERSION });
    }
    Ok(())
}
