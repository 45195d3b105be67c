//! An append-only file of checksummed records, rewritten whole by compaction.
//!
//! ```text
//! header: magic "WRNMETA\n" | version u32 | crc32c(magic, version) u32          (16 bytes, little-endian)
//! frame:  len u32 | crc32c(len bytes, payload) u32 | payload (len bytes, 1..=MAX_RECORD)
//! ```
//!
//! A frame is one atomic change: it is applied whole or not at all. `append` writes one frame at
//! the end and `fdatasync`s before it returns. `rewrite` (compaction) writes a new file beside the
//! log (`<log>.compacting`), fsyncs it, renames it over the log and fsyncs the directory, so a
//! crash leaves the old file or the new one, never neither; a leftover `.compacting` file is
//! an unfinished rewrite and is removed when the log is opened.
//!
//! Opening tells a torn tail from corruption. A bad frame (short, zero length, wrong checksum)
//! followed by no valid frame is a torn tail (an append the crash interrupted, never
//! acknowledged): the file is cut there. A bad frame followed by a valid one is corruption in the
//! middle: opening fails naming the file and offset, unless the caller tolerates it
//! ([`OnCorruption::Skip`]), in which case the bad bytes are skipped and the frames found are
//! returned (the caller then rewrites the log). Nothing is deleted: bytes cut or skipped are kept
//! in `damaged/<log file name>.<offset>` beside the log, as the store keeps its own.
//!
//! Every write, fsync, rename and delete goes through a `warren_store::Disk` (plain system calls on
//! the real disk), so the store's power-loss simulator covers this file too.

use std::fs;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use warren_store::{Disk, DiskFile};

pub const MAGIC: &[u8; 8] = b"WRNMETA\n";
pub const VERSION: u32 = 1;
pub const HEADER_SIZE: u64 = 16;
const FRAME_HEADER: usize = 8;
/// No single change comes near this; a larger length field is damage.
pub const MAX_RECORD: usize = 64 << 20;

/// What opening does about damage (the store's `RecoveryMode`, for this log).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnCorruption {
    /// A torn tail is cut; corruption in the middle refuses to open, naming the file and offset
    /// (`tolerate-tail-corruption`, the default).
    #[default]
    Refuse,
    /// Damaged bytes are skipped, the valid frames around them read (`tolerate-any-corruption`).
    Skip,
    /// Any damage refuses to open, a torn tail too (`absolute-consistency`).
    RefuseAll,
}

impl From<warren_store::RecoveryMode> for OnCorruption {
    fn from(mode: warren_store::RecoveryMode) -> Self {
        match mode {
            warren_store::RecoveryMode::TolerateTailCorruption => OnCorruption::Refuse,
            warren_store::RecoveryMode::TolerateAnyCorruption => OnCorruption::Skip,
            warren_store::RecoveryMode::AbsoluteConsistency => OnCorruption::RefuseAll,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("{path}: not a Warren metadata log (bad header)")]
    BadHeader { path: String },
    #[error("{path}: format version {version} is newer than this Warren reads ({VERSION})")]
    Version { path: String, version: u32 },
    #[error(
        "{path}: corrupt record at byte offset {offset}, and valid records follow it (not a torn tail); \
         refusing to start. Restore the file from a backup, or start once with --recovery-mode \
         tolerate-any-corruption to skip the damaged bytes (kept in damaged/ beside it; what they held is lost)"
    )]
    Corrupt { path: String, offset: u64 },
    #[error(
        "{path}: torn tail at byte offset {offset} (an interrupted, unacknowledged append); refusing to start \
         under --recovery-mode absolute-consistency. Start with tolerate-tail-corruption to cut it (the bytes \
         are kept in damaged/ beside the log)"
    )]
    TornTail { path: String, offset: u64 },
}

/// What opening the log found.
#[derive(Debug, Default)]
pub struct Replayed {
    /// Every frame's offset and payload, in order.
    pub records: Vec<(u64, Vec<u8>)>,
    /// A torn tail was cut at this offset; its bytes were kept in this file.
    pub torn: Option<(u64, PathBuf)>,
    /// Damaged byte ranges (offset, length) skipped (only with [`OnCorruption::Skip`]), each kept
    /// in `damaged/`.
    pub skipped: Vec<(u64, u64)>,
}

pub struct RecordLog {
    disk: Disk,
    path: PathBuf,
    file: DiskFile,
    /// Bytes of valid frames (and header) in the file; the next frame goes here.
    len: u64,
    /// An append failed: what is on disk after `len` is unknown, and the page cache may not be
    /// trusted. Only a `rewrite` (which replaces the file) makes the log usable again.
    broken: bool,
}

impl RecordLog {
    /// Opens (or creates, empty) the log at `path` and returns every record in it.
    pub fn open(disk: &Disk, path: &Path, on_corruption: OnCorruption) -> Result<(RecordLog, Replayed), LogError> {
        let io_err = |source| LogError::Io { path: path.display().to_string(), source };
        let leftover = compacting_path(path);
        if leftover.exists() {
            tracing::warn!(file = %leftover.display(), "removing an unfinished metadata compaction (the log it would have replaced is intact)");
            disk.delete_file(&leftover).map_err(io_err)?;
        }
        if !path.exists() {
            let log = RecordLog::create(disk, path, &[]).map_err(io_err)?;
            return Ok((log, Replayed::default()));
        }
        // Written by a version before it held password hashes and signing keys: readable by others.
        owner_only(path).map_err(io_err)?;
        let bytes = fs::read(path).map_err(io_err)?;
        check_header(path, &bytes)?;
        let mut out = Replayed::default();
        let mut pos = HEADER_SIZE as usize;
        while pos < bytes.len() {
            if let Some(end) = frame_at(&bytes, pos) {
                out.records.push((pos as u64, bytes[pos + FRAME_HEADER..end].to_vec()));
                pos = end;
                continue;
            }
            match next_valid_frame(&bytes, pos + 1) {
                Some(next) => {
                    if on_corruption != OnCorruption::Skip {
                        return Err(LogError::Corrupt { path: path.display().to_string(), offset: pos as u64 });
                    }
                    let aside = keep_damaged(disk, path, pos, &bytes[pos..next]).map_err(io_err)?;
                    tracing::error!(file = %path.display(), offset = pos, bytes = next - pos, kept = %aside.display(),
                        "skipping a corrupt metadata record (recovery mode tolerate-any-corruption); what it held is lost");
                    out.skipped.push((pos as u64, (next - pos) as u64));
                    pos = next;
                }
                None => {
                    if on_corruption == OnCorruption::RefuseAll {
                        return Err(LogError::TornTail { path: path.display().to_string(), offset: pos as u64 });
                    }
                    let aside = keep_damaged(disk, path, pos, &bytes[pos..]).map_err(io_err)?;
                    tracing::warn!(file = %path.display(), offset = pos, bytes = bytes.len() - pos, kept = %aside.display(),
                        "cut a torn tail off the metadata log (an append a crash interrupted; it was never acknowledged)");
                    out.torn = Some((pos as u64, aside));
                    break;
                }
            }
        }
        let file = disk.open_file(path, false).map_err(io_err)?;
        if out.torn.is_some() {
            file.set_len(pos as u64).map_err(io_err)?;
            file.sync_all().map_err(io_err)?;
        }
        Ok((RecordLog { disk: disk.clone(), path: path.to_path_buf(), file, len: pos as u64, broken: false }, out))
    }

    /// Creates the log at `path` holding `records`, atomically (it replaces any file there).
    pub fn create(disk: &Disk, path: &Path, records: &[Vec<u8>]) -> io::Result<RecordLog> {
        let tmp = compacting_path(path);
        let file = write_snapshot(disk, &tmp, records).and_then(|f| {
            disk.rename_file(&tmp, path)?;
            sync_dir(disk, path)?;
            Ok(f)
        });
        match file {
            Ok(file) => Ok(RecordLog { disk: disk.clone(), path: path.to_path_buf(), len: file.size()?, file, broken: false }),
            Err(e) => {
                let _ = disk.delete_file(&tmp);
                Err(e)
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes in the log, header included.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Appends one frame and makes it durable. After an error the log is broken until `rewrite`.
    pub fn append(&mut self, payload: &[u8]) -> io::Result<()> {
        if self.broken {
            return Err(io::Error::other("an earlier write to the metadata log failed and it could not be rewritten since"));
        }
        let frame = encode_frame(payload)?;
        let written = self.file.write_all_at(&frame, self.len).and_then(|()| self.file.sync_data());
        match written {
            Ok(()) => {
                self.len += frame.len() as u64;
                Ok(())
            }
            Err(e) => {
                self.broken = true;
                Err(e)
            }
        }
    }

    /// Replaces the log with one holding exactly `records` (compaction, or repair after a failed
    /// append). On error the old log stays in place, unchanged.
    pub fn rewrite(&mut self, records: &[Vec<u8>]) -> io::Result<()> {
        *self = RecordLog::create(&self.disk.clone(), &self.path, records)?;
        Ok(())
    }
}

/// `<log>.compacting`: where a rewrite is prepared.
pub fn compacting_path(path: &Path) -> PathBuf {
    suffixed(path, "compacting")
}

fn suffixed(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".");
    s.push(suffix);
    PathBuf::from(s)
}

pub fn encode_header() -> [u8; HEADER_SIZE as usize] {
    let mut h = [0u8; HEADER_SIZE as usize];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&h[..12]);
    h[12..16].copy_from_slice(&crc.to_le_bytes());
    h
}

fn check_header(path: &Path, bytes: &[u8]) -> Result<(), LogError> {
    let bad = || LogError::BadHeader { path: path.display().to_string() };
    let h = bytes.get(..HEADER_SIZE as usize).ok_or_else(bad)?;
    let crc = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
    if &h[..8] != MAGIC || crc != crc32c::crc32c(&h[..12]) {
        return Err(bad());
    }
    let version = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if version > VERSION {
        return Err(LogError::Version { path: path.display().to_string(), version });
    }
    Ok(())
}

pub fn encode_frame(payload: &[u8]) -> io::Result<Vec<u8>> {
    if payload.is_empty() || payload.len() > MAX_RECORD {
        return Err(io::Error::other(format!("a metadata record of {} bytes (must be 1..={MAX_RECORD})", payload.len())));
    }
    let len = (payload.len() as u32).to_le_bytes();
    let crc = crc32c::crc32c_append(crc32c::crc32c(&len), payload);
    let mut frame = Vec::with_capacity(FRAME_HEADER + payload.len());
    frame.extend_from_slice(&len);
    frame.extend_from_slice(&crc.to_le_bytes());
    frame.extend_from_slice(payload);
    Ok(frame)
}

/// The end of the valid frame starting at `pos`, if there is one.
fn frame_at(bytes: &[u8], pos: usize) -> Option<usize> {
    let head = bytes.get(pos..pos + FRAME_HEADER)?;
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    if len == 0 || len > MAX_RECORD {
        return None;
    }
    let end = pos + FRAME_HEADER + len;
    let payload = bytes.get(pos + FRAME_HEADER..end)?;
    (crc32c::crc32c_append(crc32c::crc32c(&head[..4]), payload) == crc).then_some(end)
}

/// The first offset at or after `from` where a valid frame starts. The checksum covers the
/// length, so random or zeroed bytes pass by chance with probability about 2^-32 per offset.
fn next_valid_frame(bytes: &[u8], from: usize) -> Option<usize> {
    (from..bytes.len().saturating_sub(FRAME_HEADER)).find(|&p| frame_at(bytes, p).is_some())
}

/// Sequential writes to a [`DiskFile`] (for a `BufWriter`).
struct Appending<'a> {
    file: &'a DiskFile,
    at: u64,
}

impl Write for Appending<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write_all_at(buf, self.at)?;
        self.at += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes a complete log (header and `records`) at `path` and fsyncs it; returns it open for writing.
fn write_snapshot(disk: &Disk, path: &Path, records: &[Vec<u8>]) -> io::Result<DiskFile> {
    let file = disk.open_file(path, true)?;
    owner_only(path)?;
    let mut w = BufWriter::with_capacity(256 * 1024, Appending { file: &file, at: 0 });
    w.write_all(&encode_header())?;
    for r in records {
        w.write_all(&encode_frame(r)?)?;
    }
    w.flush()?;
    drop(w);
    file.sync_all()?;
    sync_dir(disk, path)?;
    Ok(file)
}

/// Readable and writable by the broker's user only (mode 0600): the log holds password hashes and
/// CMQ signing keys.
fn owner_only(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
}

/// Keeps bytes cut or skipped at `offset` of the log in `damaged/<log file name>.<offset>`.
fn keep_damaged(disk: &Disk, log: &Path, offset: usize, bytes: &[u8]) -> io::Result<PathBuf> {
    let dir = log.parent().unwrap_or(Path::new(".")).join("damaged");
    disk.make_dirs(&dir)?;
    let name = log.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let path = dir.join(format!("{name}.{offset}"));
    let f = disk.open_file(&path, true)?;
    f.write_all_at(bytes, 0)?;
    f.sync_all()?;
    sync_dir(disk, &path)?;
    sync_dir(disk, &dir)?;
    Ok(path)
}

/// Fsyncs the directory holding `path` (its entry becomes durable).
pub fn sync_dir(disk: &Disk, path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => disk.fsync_dir(dir),
        _ => disk.fsync_dir(Path::new(".")),
    }
}
