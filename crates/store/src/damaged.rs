//! `damaged/`: where the store keeps what it cut or skipped instead of deleting it. Recovery moves a
//! damaged WAL segment here (or copies the bytes it cuts off one), and a queue that finds a damaged
//! record while reading copies the rest of that segment here before the segment can be deleted. Files
//! are named `<original name>.<offset of the damage>`; nothing in the directory is read back.

use std::path::{Path, PathBuf};

use crate::error::StoreError;
use crate::io::{Disk, Open};
use crate::segment;

/// The directory damaged files and cut bytes go to, inside the store's directory.
pub fn damaged_dir(dir: &Path) -> PathBuf {
    dir.join("damaged")
}

/// `<file name>.<offset>`: what a file (or its bytes from `offset` on) is called in `damaged/`.
pub(crate) fn aside_name(path: &Path, offset: u64) -> String {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{name}.{offset}")
}

/// Makes sure `damaged/` exists, durably.
fn ready(disk: &Disk, dir: &Path) -> Result<PathBuf, StoreError> {
    let damaged = damaged_dir(dir);
    if !damaged.is_dir() {
        disk.create_dir_all(&damaged).map_err(StoreError::io("creating", &damaged))?;
        segment::sync_dir(disk, dir)?;
    }
    Ok(damaged)
}

/// Room the file system must keep after a copy aside.
const COPY_MARGIN: u64 = 64 << 20;

/// Whether the file system holding `dir` has room for `bytes` more and a margin. A copy aside is a
/// courtesy (the bytes it keeps were never confirmed, or stay where they are too): it must not wait
/// for space the way the store's own writes do (`space`), on a full disk it is skipped.
fn has_room(dir: &Path, bytes: usize) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return false };
    // SAFETY: statvfs writes into the zeroed struct we pass, for a NUL-terminated path we own.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return false;
    }
    (st.f_bavail as u64).saturating_mul(st.f_frsize as u64) >= bytes as u64 + COPY_MARGIN
}

/// Keeps `bytes` in `damaged/<name>`, durably (before the original is cut or deleted). `None` if the
/// file system is too full for it (see `has_room`; logged).
pub(crate) fn copy_aside(disk: &Disk, dir: &Path, name: &str, bytes: &[u8]) -> Result<Option<PathBuf>, StoreError> {
    if !has_room(dir, bytes.len()) {
        tracing::warn!(dir = %dir.display(), name, bytes = bytes.len(), "no room to keep damaged bytes aside; not kept");
        return Ok(None);
    }
    let to = ready(disk, dir)?.join(name);
    let f = disk.open(&to, Open::CreateTruncate, false).map_err(StoreError::io("creating", &to))?;
    f.write_all_at(bytes, 0).map_err(StoreError::io("writing", &to))?;
    f.sync_data().map_err(StoreError::io("fsyncing", &to))?;
    segment::sync_dir(disk, &damaged_dir(dir))?;
    Ok(Some(to))
}

/// Moves `path` to `damaged/<name>`, durably: the new name first, then the old one's removal.
pub(crate) fn move_aside(disk: &Disk, dir: &Path, path: &Path, name: &str) -> Result<PathBuf, StoreError> {
    let to = ready(disk, dir)?.join(name);
    disk.rename(path, &to).map_err(StoreError::io("moving aside", path))?;
    segment::sync_dir(disk, &damaged_dir(dir))?;
    if let Some(from) = path.parent() {
        segment::sync_dir(disk, from)?;
    }
    Ok(to)
}
