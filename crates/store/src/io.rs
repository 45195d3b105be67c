//! The store's file operations, in one place: every write, truncation, hole punch, fsync, `syncfs`,
//! create, rename and delete the store does goes through a [`Disk`] and the [`IoFile`]s it opens.
//!
//! The default disk is the real file system: each call is the plain system call behind one `Option`
//! check, so production pays nothing measurable (these calls are per group or per file, never per
//! message). Tests can open a store on a [`SimDisk`](crate::sim::SimDisk) instead: the same real files,
//! plus a model of what the last fsync covered, so a test can cut the power at any of these calls, or
//! make one fail with `EIO`/`ENOSPC`, and see what a machine crash would have left on disk.
//!
//! Reads are not routed: they see the real files, which is what the running system sees either way.
//!
//! Writes, file creations, new directories and renames that fail for lack of space (`ENOSPC`,
//! `EDQUOT`) wait for space and are tried again here (`space`); fsyncs never are.
//!
//! ### To ensure correctness
//! - Open every file the store writes with [`Disk::open`] and change the namespace only with the
//!   methods here: a write that bypasses the layer is invisible to the power-loss model, which then
//!   treats it as lost at a crash (or, worse, the model and the files disagree).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::space::retry_while_full;

use crate::sim::{SimDisk, SimFile};

/// Where the store's files live: the real file system ([`Disk::real`], the default) or a simulated
/// power-loss disk for tests ([`Disk::simulated`]).
#[derive(Clone, Default)]
pub struct Disk {
    sim: Option<Arc<SimDisk>>,
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.sim.is_some() { "Disk::simulated" } else { "Disk::real" })
    }
}

/// How [`Disk::open`] opens a file for writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Open {
    /// Create it, or truncate it to nothing if it exists.
    CreateTruncate,
    /// It must exist; its contents stay.
    Existing,
}

impl Disk {
    /// The real file system.
    pub fn real() -> Disk {
        Disk { sim: None }
    }

    /// The simulated power-loss disk `sim` (tests): real files plus a model of what is durable.
    pub fn simulated(sim: Arc<SimDisk>) -> Disk {
        Disk { sim: Some(sim) }
    }

    /// Whether this is a simulated disk: I/O failures then stop the store's writer thread (which a test
    /// can observe) instead of aborting the process.
    pub(crate) fn is_simulated(&self) -> bool {
        self.sim.is_some()
    }

    /// Opens `path` for writing (and reading), with `O_DIRECT` if `direct`.
    pub(crate) fn open(&self, path: &Path, how: Open, direct: bool) -> io::Result<IoFile> {
        let mut opts = OpenOptions::new();
        opts.read(true).write(true);
        if how == Open::CreateTruncate {
            opts.create(true).truncate(true);
        }
        // A simulated disk writes the same blocks through the page cache: the store still writes
        // block-aligned as for O_DIRECT, and a suite that reruns a workload hundreds of times stays fast.
        if direct && self.sim.is_none() {
            opts.custom_flags(libc::O_DIRECT);
        }
        let open = || match &self.sim {
            None => Ok(IoFile { disk: DiskFile { file: opts.open(path)?, sim: None }, path: path.to_path_buf() }),
            Some(sim) => {
                let (file, sim) = sim.open(path, how == Open::CreateTruncate, || opts.open(path))?;
                Ok(IoFile { disk: DiskFile { file, sim }, path: path.to_path_buf() })
            }
        };
        match how {
            // Creating (or truncating) again after a failure is harmless.
            Open::CreateTruncate => retry_while_full("creating", path, open),
            Open::Existing => open(),
        }
    }

    pub(crate) fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        retry_while_full("creating", path, || match &self.sim {
            None => std::fs::create_dir_all(path),
            Some(sim) => sim.create_dir_all(path),
        })
    }

    pub(crate) fn remove_file(&self, path: &Path) -> io::Result<()> {
        match &self.sim {
            None => std::fs::remove_file(path),
            Some(sim) => sim.remove(path, false),
        }
    }

    pub(crate) fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        match &self.sim {
            None => std::fs::remove_dir_all(path),
            Some(sim) => sim.remove(path, true),
        }
    }

    /// Renames `from` to `to` (replacing `to`). Durable once both directories are fsynced.
    pub(crate) fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        retry_while_full("renaming", from, || match &self.sim {
            None => std::fs::rename(from, to),
            Some(sim) => sim.rename(from, to),
        })
    }

    /// Fsyncs the directory `path` itself: creations, renames and deletions in it become durable.
    pub(crate) fn sync_dir(&self, path: &Path) -> io::Result<()> {
        match &self.sim {
            None => File::open(path)?.sync_all(),
            Some(sim) => sim.sync_dir(path, || File::open(path)?.sync_all()),
        }
    }

    /// One `syncfs` on the file system holding `path`: every file's data and every directory entry
    /// becomes durable.
    pub(crate) fn syncfs(&self, path: &Path) -> io::Result<()> {
        let real = || {
            use std::os::fd::AsRawFd;
            let d = File::open(path)?;
            // SAFETY: syncfs on a descriptor we own and keep open for the call; no memory is passed.
            if unsafe { libc::syncfs(d.as_raw_fd()) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        };
        match &self.sim {
            None => real(),
            Some(sim) => sim.syncfs(),
        }
    }
}

/// Files written through a [`Disk`] by code outside the store (the broker's metadata log), so that a
/// simulated disk models them too. On the real disk each call is the plain system call: unlike the
/// store's own writes, nothing here waits for space.
impl Disk {
    /// Opens `path` for writing: created (or truncated to nothing) if `create`, else it must exist.
    pub fn open_file(&self, path: &Path, create: bool) -> io::Result<DiskFile> {
        let mut opts = OpenOptions::new();
        opts.write(true);
        if create {
            opts.create(true).truncate(true);
        }
        match &self.sim {
            None => Ok(DiskFile { file: opts.open(path)?, sim: None }),
            Some(sim) => {
                let (file, sim) = sim.open(path, create, || opts.open(path))?;
                Ok(DiskFile { file, sim })
            }
        }
    }

    /// Renames `from` to `to` (replacing it); durable once the directories are fsynced.
    pub fn rename_file(&self, from: &Path, to: &Path) -> io::Result<()> {
        match &self.sim {
            None => std::fs::rename(from, to),
            Some(sim) => sim.rename(from, to),
        }
    }

    /// Removes the file `path`; durable once its directory is fsynced.
    pub fn delete_file(&self, path: &Path) -> io::Result<()> {
        self.remove_file(path)
    }

    /// Creates directory `path` and its missing parents (not durably: fsync their parents).
    pub fn make_dirs(&self, path: &Path) -> io::Result<()> {
        match &self.sim {
            None => std::fs::create_dir_all(path),
            Some(sim) => sim.create_dir_all(path),
        }
    }

    /// Fsyncs the directory `dir`: creations, renames and deletions in it become durable.
    pub fn fsync_dir(&self, dir: &Path) -> io::Result<()> {
        self.sync_dir(dir)
    }
}

/// A file opened with [`Disk::open_file`].
pub struct DiskFile {
    file: File,
    sim: Option<SimFile>,
}

impl DiskFile {
    pub fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        match &self.sim {
            None => self.file.write_all_at(buf, offset),
            Some(s) => s.write_at(buf, offset, || self.file.write_all_at(buf, offset)),
        }
    }

    pub fn set_len(&self, len: u64) -> io::Result<()> {
        match &self.sim {
            None => self.file.set_len(len),
            Some(s) => s.set_len(len, || self.file.set_len(len)),
        }
    }

    /// `fdatasync`.
    pub fn sync_data(&self) -> io::Result<()> {
        match &self.sim {
            None => self.file.sync_data(),
            Some(s) => s.sync(),
        }
    }

    /// `fsync`.
    pub fn sync_all(&self) -> io::Result<()> {
        match &self.sim {
            None => self.file.sync_all(),
            Some(s) => s.sync(),
        }
    }

    /// The file's length.
    pub fn size(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
}

/// A file opened for writing through a [`Disk`]: a [`DiskFile`] whose writes wait for space on a
/// full disk.
pub(crate) struct IoFile {
    disk: DiskFile,
    /// For the log when a write waits for space.
    path: PathBuf,
}

impl IoFile {
    /// Writes all of `buf` at `offset`; on a full disk, waits for space and writes it again.
    pub fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        retry_while_full("writing", &self.path, || self.disk.write_all_at(buf, offset))
    }

    pub fn set_len(&self, len: u64) -> io::Result<()> {
        self.disk.set_len(len)
    }

    /// `fdatasync`: the file's data (and its size) become durable; not its directory entry.
    pub fn sync_data(&self) -> io::Result<()> {
        self.disk.sync_data()
    }

    /// `fsync`: as `sync_data` (the model does not distinguish other metadata).
    pub fn sync_all(&self) -> io::Result<()> {
        self.disk.sync_all()
    }

    /// Frees the disk blocks of `[offset, offset + len)` (block-aligned) without changing the file's
    /// length: reads there return zeros.
    pub fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let real = || {
            use std::os::fd::AsRawFd;
            // SAFETY: fallocate on a descriptor we own, for the duration of the call; no memory is passed.
            let rc = unsafe {
                libc::fallocate(
                    self.disk.file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as libc::off_t,
                    len as libc::off_t,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        };
        match &self.disk.sim {
            None => real(),
            Some(s) => s.punch_hole(offset, len, real),
        }
    }

    /// Reads are not modelled: they see what the running system sees.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.disk.file.read_exact_at(buf, offset)
    }

    pub fn len(&self) -> io::Result<u64> {
        self.disk.size()
    }
}
