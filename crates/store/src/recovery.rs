//! Recovery: replays the segments at open, repairs a torn tail, isolates corruption, and returns the live
//! messages. It never refuses to start because of damaged data (see `format` for what is trusted); only
//! I/O errors, a locked directory or a segment from a newer format version stop it.
//!
//! Two passes keep memory bounded by the live messages rather than the log: the first checks every record
//! and builds the live-message bitmaps (acks can be in later segments than their enqueues), the second
//! re-reads only the segments that still hold live messages and copies those payloads out.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::Instant;

use bytes::Bytes;

use crate::error::StoreError;
use crate::format::{self, Damage, Record, HEADER_SIZE, VERSION};
use crate::segment::{self, SegmentTable};
use crate::writer::Start;
use crate::MsgId;

/// A message that was enqueued and not acked when the store was last running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredMessage {
    pub id: MsgId,
    pub queue: u64,
    pub payload: Bytes,
}

/// What recovery found and did.
#[derive(Debug, Default)]
pub struct Recovery {
    /// The live messages, in id order.
    pub messages: Vec<RecoveredMessage>,
    /// The torn tail cut off the newest segment, if there was one (also logged with `tracing::warn!`).
    pub truncated: Option<TornTail>,
    /// Older segments with a bad record: the records from `offset` on were skipped (logged with
    /// `tracing::error!`). Messages in the skipped part are lost; everything else was recovered.
    pub corrupted: Vec<CorruptSegment>,
    /// Segments deleted during recovery because every message in them was acked.
    pub segments_deleted: usize,
}

/// The damaged end of the newest segment, dropped by recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    pub segment: PathBuf,
    /// File offset of the first bad byte: the file now ends here (0: the whole file was removed).
    pub offset: u64,
    pub dropped_bytes: u64,
    pub reason: Damage,
}

/// A bad record found in a segment that is not the newest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptSegment {
    pub segment: PathBuf,
    pub offset: u64,
    pub skipped_bytes: u64,
    pub reason: Damage,
}

/// Per segment: bytes on disk and bytes of valid records (the end of the good prefix).
#[derive(Debug, Clone, Copy)]
struct Extent {
    disk_len: u64,
    valid_len: usize,
}

/// Replays the log in `dir` and returns where the writer starts, plus what was recovered.
pub(crate) fn recover(dir: &Path) -> Result<(Start, Recovery), StoreError> {
    let started = Instant::now();
    let bases = segment::list(dir)?;
    let mut out = Recovery::default();
    let mut table = SegmentTable::default();
    let mut extents = BTreeMap::new();
    let mut next_id: MsgId = 1;
    // Where a new segment may start: after every byte that exists or existed.
    let mut end_pos = 0u64;
    let mut active: Option<(u64, usize)> = None;

    for (i, &base) in bases.iter().enumerate() {
        let newest = i + 1 == bases.len();
        let path = segment::path(dir, base);
        let data = fs::read(&path).map_err(StoreError::io("reading", &path))?;
        let disk_len = data.len() as u64;
        end_pos = end_pos.max(base);
        let header = match format::decode_header(&data) {
            Ok(h) => h,
            Err(Damage::UnsupportedVersion { version }) => {
                return Err(StoreError::UnsupportedVersion {
                    path,
                    version,
                    supported: VERSION,
                });
            }
            Err(reason) if newest => {
                // Created by a roll just before the crash: nothing in it was ever confirmed.
                tracing::warn!(file = %path.display(), offset = 0, dropped_bytes = disk_len, %reason,
                    "newest segment has a torn header; removing it");
                fs::remove_file(&path).map_err(StoreError::io("removing", &path))?;
                segment::sync_dir(dir)?;
                out.truncated = Some(TornTail {
                    segment: path,
                    offset: 0,
                    dropped_bytes: disk_len,
                    reason,
                });
                continue;
            }
            Err(reason) => {
                tracing::error!(file = %path.display(), offset = 0, skipped_bytes = disk_len, %reason,
                    "corrupt segment header; skipping the whole segment");
                out.corrupted.push(CorruptSegment {
                    segment: path,
                    offset: 0,
                    skipped_bytes: disk_len,
                    reason,
                });
                table.push(base, next_id);
                extents.insert(
                    base,
                    Extent {
                        disk_len,
                        valid_len: 0,
                    },
                );
                end_pos = end_pos.max(base + disk_len);
                continue;
            }
        };
        next_id = next_id.max(header.first_id);
        table.push(base, next_id);
        let (valid_len, damage) = scan(&data, &mut table, &mut next_id);
        let mut kept_len = disk_len;
        if let Some(reason) = damage {
            let dropped = disk_len - valid_len as u64;
            if newest {
                tracing::warn!(file = %path.display(), offset = valid_len, dropped_bytes = dropped, %reason,
                    "torn tail in the newest segment; truncating to the last valid record");
                truncate(&path, valid_len as u64)?;
                kept_len = valid_len as u64;
                out.truncated = Some(TornTail {
                    segment: path,
                    offset: valid_len as u64,
                    dropped_bytes: dropped,
                    reason,
                });
            } else {
                tracing::error!(file = %path.display(), offset = valid_len, skipped_bytes = dropped, %reason,
                    "corrupt record in an older segment; keeping the records before it, skipping the rest");
                out.corrupted.push(CorruptSegment {
                    segment: path,
                    offset: valid_len as u64,
                    skipped_bytes: dropped,
                    reason,
                });
            }
        }
        extents.insert(
            base,
            Extent {
                disk_len: kept_len,
                valid_len,
            },
        );
        end_pos = end_pos.max(base + kept_len);
        if newest {
            active = Some((base, valid_len));
        }
    }

    // Appends continue in the newest segment if it survived intact up to its valid end; otherwise (no
    // segments, or its header was torn) in a fresh one, never after the garbage of an older segment.
    let (file, base, pos) = match active {
        Some((base, valid_len)) => {
            let path = segment::path(dir, base);
            let file = OpenOptions::new()
                .append(true)
                .open(&path)
                .map_err(StoreError::io("opening", &path))?;
            (file, base, base + valid_len as u64)
        }
        None => {
            let file = segment::create(dir, end_pos, next_id)?;
            table.push(end_pos, next_id);
            extents.insert(
                end_pos,
                Extent {
                    disk_len: HEADER_SIZE as u64,
                    valid_len: HEADER_SIZE,
                },
            );
            (file, end_pos, end_pos + HEADER_SIZE as u64)
        }
    };
    // What was read back may only have been in the page cache (a killed process with IntervalMs): make it
    // durable before anything is appended and confirmed on top of it. Older segments were fsynced at roll.
    file.sync_data()
        .map_err(StoreError::io("fsyncing", segment::path(dir, base)))?;

    out.segments_deleted = delete_dead(dir, &mut table, &mut extents, base)?;
    collect_live(dir, &table, &extents, &mut out.messages)?;

    let bytes_on_disk = extents.values().map(|e| e.disk_len).sum();
    tracing::info!(
        dir = %dir.display(),
        segments = table.len(),
        live_messages = out.messages.len(),
        next_id,
        deleted_segments = out.segments_deleted,
        torn_tail = out.truncated.is_some(),
        corrupt_segments = out.corrupted.len(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "message store recovered"
    );
    Ok((
        Start {
            file,
            base,
            pos,
            next_id,
            segments: table,
            bytes_on_disk,
        },
        out,
    ))
}

/// Applies the records of one segment to `table`. Returns the end of the valid prefix and, if the scan
/// stopped early, why.
fn scan(data: &[u8], table: &mut SegmentTable, next_id: &mut MsgId) -> (usize, Option<Damage>) {
    let mut off = HEADER_SIZE;
    while let Some(rest) = data.get(off..).filter(|r| !r.is_empty()) {
        match format::decode_record(rest) {
            Ok((Record::Enqueue { id, .. }, n)) => {
                if id < *next_id {
                    return (
                        off,
                        Some(Damage::IdOutOfOrder {
                            id,
                            previous: next_id.saturating_sub(1),
                        }),
                    );
                }
                table.enqueue(id);
                *next_id = id.saturating_add(1);
                off += n;
            }
            Ok((Record::Acks { ids }, n)) => {
                // Unknown ids (from deleted or skipped segments) are ignored by the table.
                for id in ids.iter() {
                    table.ack(id);
                }
                off += n;
            }
            Err(damage) => return (off, Some(damage)),
        }
    }
    (off, None)
}

fn truncate(path: &Path, len: u64) -> Result<(), StoreError> {
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(StoreError::io("opening", path))?;
    f.set_len(len).map_err(StoreError::io("truncating", path))?;
    f.sync_all().map_err(StoreError::io("fsyncing", path))
}

/// Deletes the oldest segments that hold no live message (never the active one). Returns how many.
fn delete_dead(
    dir: &Path,
    table: &mut SegmentTable,
    extents: &mut BTreeMap<u64, Extent>,
    active_base: u64,
) -> Result<usize, StoreError> {
    let mut dead = table.take_dead_prefix(active_base);
    let mut deleted = 0;
    for seg in &dead {
        let path = segment::path(dir, seg.base);
        if let Err(e) = fs::remove_file(&path) {
            tracing::warn!(error = %e, file = %path.display(), "could not delete a fully acked segment");
            break;
        }
        extents.remove(&seg.base);
        deleted += 1;
    }
    if deleted < dead.len() {
        table.restore_front(dead.split_off(deleted));
    }
    if deleted > 0 {
        segment::sync_dir(dir)?;
    }
    Ok(deleted)
}

/// Second pass: copies out the payloads of live messages, in id order.
fn collect_live(
    dir: &Path,
    table: &SegmentTable,
    extents: &BTreeMap<u64, Extent>,
    messages: &mut Vec<RecoveredMessage>,
) -> Result<(), StoreError> {
    for seg in table.iter().filter(|s| s.live > 0) {
        let Some(extent) = extents.get(&seg.base) else {
            continue;
        };
        let path = segment::path(dir, seg.base);
        let data = read_prefix(&path, extent.valid_len)?;
        let mut off = HEADER_SIZE;
        while let Some(rest) = data.get(off..).filter(|r| !r.is_empty()) {
            // The first pass validated this prefix; a failure now means the file changed under us.
            let Ok((record, n)) = format::decode_record(rest) else {
                break;
            };
            if let Record::Enqueue { id, queue, payload } = record {
                if seg.is_live(id) {
                    messages.push(RecoveredMessage {
                        id,
                        queue,
                        payload: Bytes::copy_from_slice(payload),
                    });
                }
            }
            off += n;
        }
    }
    Ok(())
}

fn read_prefix(path: &Path, len: usize) -> Result<Vec<u8>, StoreError> {
    use std::io::Read;
    let mut data = Vec::with_capacity(len);
    File::open(path)
        .and_then(|f| f.take(len as u64).read_to_end(&mut data))
        .map_err(StoreError::io("reading", path))?;
    Ok(data)
}
