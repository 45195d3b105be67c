//! WAL segment files: naming, listing, creating, directory fsync.

use std::fs;
use std::path::{Path, PathBuf};

use crate::direct::Appender;
use crate::io::Disk;
use crate::error::StoreError;
use crate::format::{self, WAL_EXT};

/// The WAL's directory inside the data directory.
pub(crate) fn wal_dir(dir: &Path) -> PathBuf {
    dir.join("wal")
}

/// Path of the WAL segment with base position `base`.
pub(crate) fn path(wal: &Path, base: u64) -> PathBuf {
    wal.join(format!("{base:020}.{WAL_EXT}"))
}

/// The base positions of the WAL segments in `wal`, oldest first. Other files are ignored.
pub(crate) fn list(wal: &Path) -> Result<Vec<u64>, StoreError> {
    let mut bases = Vec::new();
    for entry in fs::read_dir(wal).map_err(StoreError::io("listing", wal))? {
        let entry = entry.map_err(StoreError::io("listing", wal))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(stem) = name.strip_suffix(WAL_EXT).and_then(|s| s.strip_suffix('.')) else {
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

/// Creates WAL segment `base` with its header, fsyncs it and the directory (so the new name survives).
pub(crate) fn create(disk: &Disk, wal: &Path, base: u64) -> Result<Appender, StoreError> {
    let p = path(wal, base);
    let mut f = create_empty(disk, wal, base)?;
    f.append(&format::encode_wal_header()).map_err(StoreError::io("writing", &p))?;
    f.sync_data().map_err(StoreError::io("fsyncing", &p))?;
    Ok(f)
}

/// Creates an empty WAL segment file and fsyncs the directory entry.
pub(crate) fn create_empty(disk: &Disk, wal: &Path, base: u64) -> Result<Appender, StoreError> {
    let p = path(wal, base);
    if p.exists() {
        return Err(StoreError::Io {
            op: "creating",
            path: p,
            source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
        });
    }
    let f = Appender::create(disk, &p).map_err(StoreError::io("creating", &p))?;
    sync_dir(disk, wal)?;
    Ok(f)
}

/// Fsyncs the directory itself, making file creations and deletions durable.
pub(crate) fn sync_dir(disk: &Disk, dir: &Path) -> Result<(), StoreError> {
    disk.sync_dir(dir).map_err(StoreError::io("fsyncing directory", dir))
}

/// Creates `path` and any missing parents, and fsyncs the parent of each directory it created:
/// a file fsynced inside a directory whose own entry was never fsynced can vanish with it.
pub(crate) fn create_dirs_durably(disk: &Disk, path: &Path) -> std::io::Result<()> {
    let missing: Vec<&Path> = path.ancestors().take_while(|a| !a.as_os_str().is_empty() && !a.exists()).collect();
    if missing.is_empty() {
        return Ok(());
    }
    disk.create_dir_all(path)?;
    for dir in missing.iter().rev() {
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            disk.sync_dir(parent)?;
        }
    }
    Ok(())
}
