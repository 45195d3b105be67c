//! Segment files (naming, creating, deleting, directory fsync) and the in-memory table of which segments
//! still hold live messages.
//!
//! The table is the store's only per-message memory: one bit per message id of each segment still on
//! disk (1 MiB of ids costs 128 KiB), so acks are idempotent and acks of unknown ids are ignored without a
//! map from id to anything. A segment's ids are a contiguous range `[first_id, end_id)`, so finding the
//! segment of an id is a binary search over the (few) segments.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::StoreError;
use crate::format::{self, SEGMENT_EXT};
use crate::MsgId;

/// Path of the segment with base position `base`.
pub(crate) fn path(dir: &Path, base: u64) -> PathBuf {
    dir.join(format!("{base:020}.{SEGMENT_EXT}"))
}

/// The base positions of the segment files in `dir`, oldest first. Other files are ignored.
pub(crate) fn list(dir: &Path) -> Result<Vec<u64>, StoreError> {
    let mut bases = Vec::new();
    for entry in fs::read_dir(dir).map_err(StoreError::io("listing", dir))? {
        let entry = entry.map_err(StoreError::io("listing", dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(stem) = name
            .strip_suffix(SEGMENT_EXT)
            .and_then(|s| s.strip_suffix('.'))
        else {
            continue;
        };
        if stem.len() == 20 && stem.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(base) = stem.parse() {
                bases.push(base);
            }
        }
    }
    bases.sort_unstable();
    Ok(bases)
}

/// Creates segment `base` with its header, fsyncs it and the directory (so the new name survives a crash).
/// Used at open; the writer thread creates rolled segments from header bytes already in its buffer.
pub(crate) fn create(dir: &Path, base: u64, first_id: MsgId) -> Result<File, StoreError> {
    let p = path(dir, base);
    let mut f = create_empty(dir, base)?;
    f.write_all(&format::encode_header(first_id))
        .map_err(StoreError::io("writing", &p))?;
    f.sync_data().map_err(StoreError::io("fsyncing", &p))?;
    Ok(f)
}

/// Creates an empty segment file and fsyncs the directory entry.
pub(crate) fn create_empty(dir: &Path, base: u64) -> Result<File, StoreError> {
    let p = path(dir, base);
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&p)
        .map_err(StoreError::io("creating", &p))?;
    sync_dir(dir)?;
    Ok(f)
}

/// Fsyncs the directory itself, making file creations and deletions durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(StoreError::io("fsyncing directory", dir))
}

/// What the store knows about one segment on disk.
#[derive(Debug)]
pub(crate) struct SegmentInfo {
    pub base: u64,
    /// Ids of this segment's enqueues are in `[first_id, end_id)`.
    pub first_id: MsgId,
    pub end_id: MsgId,
    /// Number of set bits in `live_bits`.
    pub live: u64,
    /// Bit `id - first_id` is set while message `id` is enqueued and not acked.
    live_bits: Vec<u64>,
}

impl SegmentInfo {
    fn bit(&self, id: MsgId) -> Option<(usize, u64)> {
        if id < self.first_id || id >= self.end_id {
            return None;
        }
        let i = usize::try_from(id - self.first_id).ok()?;
        Some((i / 64, 1u64 << (i % 64)))
    }

    pub fn is_live(&self, id: MsgId) -> bool {
        self.bit(id)
            .and_then(|(w, m)| self.live_bits.get(w).map(|word| word & m != 0))
            .unwrap_or(false)
    }
}

/// The segments on disk, oldest first, with their live messages.
#[derive(Debug, Default)]
pub(crate) struct SegmentTable {
    segments: VecDeque<SegmentInfo>,
}

impl SegmentTable {
    /// Adds a new newest segment whose enqueues get ids from `first_id` on.
    pub fn push(&mut self, base: u64, first_id: MsgId) {
        self.segments.push_back(SegmentInfo {
            base,
            first_id,
            end_id: first_id,
            live: 0,
            live_bits: Vec::new(),
        });
    }

    /// Records a live enqueue of `id` in the newest segment. Ids must be increasing (the caller checks).
    pub fn enqueue(&mut self, id: MsgId) {
        let Some(seg) = self.segments.back_mut() else {
            return;
        };
        let Ok(i) = usize::try_from(id.saturating_sub(seg.first_id)) else {
            return;
        };
        let words = i / 64 + 1;
        if seg.live_bits.len() < words {
            seg.live_bits.resize(words, 0);
        }
        seg.live_bits[i / 64] |= 1u64 << (i % 64);
        seg.live += 1;
        seg.end_id = seg.end_id.max(id + 1);
    }

    /// Marks `id` acked. Returns false (and changes nothing) for ids that are unknown or already acked.
    pub fn ack(&mut self, id: MsgId) -> bool {
        let idx = self.segments.partition_point(|s| s.first_id <= id);
        let Some(seg) = idx.checked_sub(1).and_then(|i| self.segments.get_mut(i)) else {
            return false;
        };
        let Some((w, m)) = seg.bit(id) else {
            return false;
        };
        match seg.live_bits.get_mut(w) {
            Some(word) if *word & m != 0 => {
                *word &= !m;
                seg.live -= 1;
                true
            }
            _ => false,
        }
    }

    /// Removes and returns the bases of the oldest segments that hold no live message, stopping at the
    /// first segment that does, and never touching segments at or after `before_base` (still being written).
    /// Deleting only such a prefix is what makes deletion safe: acks refer to the same or earlier segments,
    /// so no remaining segment holds an enqueue whose ack was in a deleted one.
    pub fn take_dead_prefix(&mut self, before_base: u64) -> Vec<SegmentInfo> {
        let mut dead = Vec::new();
        while self
            .segments
            .front()
            .is_some_and(|s| s.live == 0 && s.base < before_base)
        {
            dead.extend(self.segments.pop_front());
        }
        dead
    }

    /// Puts back segments taken by `take_dead_prefix` that could not be deleted (oldest first).
    pub fn restore_front(&mut self, segments: Vec<SegmentInfo>) {
        for s in segments.into_iter().rev() {
            self.segments.push_front(s);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &SegmentInfo> {
        self.segments.iter()
    }

    pub fn len(&self) -> usize {
        self.segments.len()
    }

    pub fn live_messages(&self) -> u64 {
        self.segments.iter().map(|s| s.live).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_are_idempotent_and_unknown_ids_ignored() {
        let mut t = SegmentTable::default();
        t.push(0, 1);
        t.enqueue(1);
        t.enqueue(2);
        t.push(100, 3);
        t.push(200, 3); // acks-only segment before: same first id
        t.enqueue(3);
        assert!(t.ack(2));
        assert!(!t.ack(2));
        assert!(!t.ack(0));
        assert!(!t.ack(99));
        assert!(t.ack(3));
        assert_eq!(t.live_messages(), 1);
        assert!(t.take_dead_prefix(u64::MAX).is_empty());
        assert!(t.ack(1));
        let dead = t.take_dead_prefix(200);
        assert_eq!(
            dead.iter().map(|s| s.base).collect::<Vec<_>>(),
            vec![0, 100]
        );
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn names_sort_by_base() {
        let dir = tempfile::tempdir().unwrap();
        for base in [5u64, 1_000, 20] {
            create(dir.path(), base, 1).unwrap();
        }
        fs::write(dir.path().join("LOCK"), b"").unwrap();
        assert_eq!(list(dir.path()).unwrap(), vec![5, 20, 1_000]);
    }
}
