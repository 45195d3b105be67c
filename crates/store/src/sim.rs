//! [`SimDisk`]: a power-loss simulator for the store's tests.
//!
//! A store opened on `Disk::simulated(sim)` does its I/O on real files under the simulator's root, and
//! every change it makes (create, write, truncate, punch, rename, delete, make a directory) and every
//! sync (`fdatasync`/`fsync` of a file, fsync of a directory, `syncfs`) is also recorded in a model of
//! what the disk would keep if the power went off now:
//!
//! - a file's data is durable up to its last `fsync`/`fdatasync` (or any `syncfs`); later writes,
//!   truncations and punched holes are pending;
//! - a directory entry (a create, a rename, a delete) is durable only once its directory was fsynced
//!   (or any `syncfs`): an `fdatasync` of a new file does not make its name survive;
//! - a rename within one directory is atomic; across directories each side becomes durable with the
//!   fsync of its own directory;
//! - a failed fsync (injected) drops the file's pending changes from the durable path for good, while
//!   the running system still reads them: the Linux behaviour behind the PostgreSQL "fsync-gate".
//!
//! Every such call counts as one operation ([`SimDisk::ops`] lists them with their kind and file). A
//! test can make operation `k` cut the power ([`Fault::PowerCut`]: it and everything after fail with
//! `EIO` and change nothing) or fail once with an errno ([`Fault::Error`]: `EIO`, `ENOSPC`), or make
//! the disk full. [`SimDisk::power_loss`] then rewrites the files under the root to what the model
//! says survived: only durable state ([`Loss::Unsynced`]), or durable state plus a random prefix of
//! each file's pending writes, the last one torn at a random byte, and a random prefix of each
//! directory's pending entry changes ([`Loss::Torn`]). The store is then opened again on the same disk.
//!
//! [`Loss::Reordered`] keeps any subset of the pending writes' blocks instead of a prefix: a disk
//! that persists the blocks of one write out of order. Not modelled: metadata other than names and
//! sizes. Reads are not routed through the model: they see the real files. The real
//! `fsync`/`syncfs` calls are not made at all: the model decides what is durable, and a crash-point
//! suite that reruns a workload hundreds of times stays fast.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

/// The kinds of operations the simulator counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// A file created, or truncated to nothing on open.
    Create,
    Write,
    /// `set_len` (truncate or extend).
    SetLen,
    /// `fallocate(PUNCH_HOLE)`.
    PunchHole,
    /// `fsync` / `fdatasync` of a file.
    FileSync,
    /// fsync of a directory.
    DirSync,
    SyncFs,
    Rename,
    /// A file or a directory tree removed.
    Remove,
    MakeDir,
}

/// One counted operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    pub kind: OpKind,
    pub path: PathBuf,
}

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The power goes off: this operation and every later one fail with `EIO` and change nothing,
    /// until [`SimDisk::power_loss`].
    PowerCut,
    /// This one operation fails with the errno (e.g. `libc::EIO`, `libc::ENOSPC`) and changes nothing;
    /// a failed file sync also loses the file's pending changes for good (see the module docs).
    Error(i32),
}

/// What a [`SimDisk::power_cut_now`] found not yet durable (and so dropped, under [`Loss::Unsynced`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pending {
    /// Files with changes written since their last sync.
    pub files: usize,
    /// Bytes of those writes.
    pub bytes: u64,
    /// Directory entry changes (creates, renames, deletes) not yet covered by a directory fsync.
    pub entries: usize,
}

/// What survives a simulated power loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// Exactly what the syncs covered.
    Unsynced,
    /// That, plus per file a random prefix of its pending writes (the last one cut at a random byte)
    /// and per directory a random prefix of its pending entry changes. Same seed, same result.
    Torn { seed: u64 },
    /// That, plus per file any subset of the [`BLOCK`]-sized blocks of its pending writes: a disk
    /// that persists the blocks of a multi-block write out of order, so a block written later may
    /// survive one written before it (a hole followed by valid data). Size changes and punched holes
    /// apply in order; directories keep a random prefix of their pending entry changes, as `Torn`.
    /// Same seed, same result.
    Reordered { seed: u64 },
}

/// The unit a disk persists atomically, for [`Loss::Reordered`].
pub const BLOCK: u64 = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    Dir,
    File(u64),
}

#[derive(Debug, Clone)]
enum DataOp {
    Write { off: u64, data: Vec<u8> },
    SetLen(u64),
    Punch { off: u64, len: u64 },
}

#[derive(Debug, Default)]
struct Inode {
    durable: Vec<u8>,
    pending: Vec<DataOp>,
}

/// A change of directory entries that becomes durable as a whole with the fsync of `dir`.
#[derive(Debug, Clone)]
struct EntryOp {
    dir: PathBuf,
    sets: Vec<(PathBuf, Option<Node>)>,
}

struct Trigger {
    kind: Option<OpKind>,
    skip: u64,
    fault: Fault,
}

#[derive(Default)]
struct State {
    next_ino: u64,
    inodes: HashMap<u64, Inode>,
    /// The namespace as the running system sees it.
    current: BTreeMap<PathBuf, Node>,
    /// The namespace a power loss would leave (before pending entry changes).
    durable: BTreeMap<PathBuf, Node>,
    pending_entries: Vec<EntryOp>,
    ops: Vec<Op>,
    triggers: Vec<Trigger>,
    powered_off: bool,
    full: bool,
}

/// The power-loss simulator (see the module docs). Share it with `Arc`; open stores on it with
/// `Store::open_on(dir, opts, Disk::simulated(sim.clone()))`.
pub struct SimDisk {
    root: PathBuf,
    state: Mutex<State>,
}

/// A file opened through a simulated disk: which inode of the model it is.
pub(crate) struct SimFile {
    disk: Arc<SimDisk>,
    ino: u64,
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

impl SimDisk {
    /// A simulator for everything under `root` (an absolute path; created if missing). What is there
    /// already counts as durable.
    pub fn new(root: &Path) -> io::Result<Arc<SimDisk>> {
        std::fs::create_dir_all(root)?;
        let mut st = State::default();
        fn scan(st: &mut State, dir: &Path) -> io::Result<()> {
            for entry in std::fs::read_dir(dir)? {
                let path = entry?.path();
                if path.is_dir() {
                    st.current.insert(path.clone(), Node::Dir);
                    scan(st, &path)?;
                } else {
                    let ino = st.next_ino;
                    st.next_ino += 1;
                    st.inodes.insert(ino, Inode { durable: std::fs::read(&path)?, pending: Vec::new() });
                    st.current.insert(path, Node::File(ino));
                }
            }
            Ok(())
        }
        scan(&mut st, root)?;
        st.durable = st.current.clone();
        Ok(Arc::new(SimDisk { root: root.to_path_buf(), state: Mutex::new(st) }))
    }

    /// The root directory this simulator models.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Every operation counted so far, in order; a fault index refers to this list.
    pub fn ops(&self) -> Vec<Op> {
        self.state.lock().ops.clone()
    }

    /// How many operations were counted so far.
    pub fn op_count(&self) -> u64 {
        self.state.lock().ops.len() as u64
    }

    /// Operation number `index` (counting from the first one this simulator saw) gets `fault`.
    pub fn fault_at(&self, index: u64, fault: Fault) {
        let mut st = self.state.lock();
        let skip = index.saturating_sub(st.ops.len() as u64);
        st.triggers.push(Trigger { kind: None, skip, fault });
    }

    /// The `nth` (0: the next) operation of kind `kind` from now on gets `fault`.
    pub fn fault_on(&self, kind: OpKind, nth: u64, fault: Fault) {
        self.state.lock().triggers.push(Trigger { kind: Some(kind), skip: nth, fault });
    }

    /// While full, every create, write, extension and new directory fails with `ENOSPC`.
    pub fn set_full(&self, full: bool) {
        self.state.lock().full = full;
    }

    /// Whether a [`Fault::PowerCut`] has fired (and no `power_loss` followed yet).
    pub fn is_powered_off(&self) -> bool {
        self.state.lock().powered_off
    }

    /// The power goes off now, if it has not already (same as a `PowerCut` on the next operation).
    pub fn cut_power(&self) {
        self.state.lock().powered_off = true;
    }

    /// Damages a file as the disk holds it (the media, not a write of the store): writes `bytes` at
    /// `offset` of `path`, in the real file and in its durable state. Not counted as an operation.
    pub fn damage(&self, path: &Path, offset: u64, bytes: &[u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut st = self.state.lock();
        let Some(Node::File(ino)) = st.current.get(path).copied() else {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("{} is not a file the simulated disk knows", path.display())));
        };
        std::fs::OpenOptions::new().write(true).open(path)?.write_all_at(bytes, offset)?;
        let op = DataOp::Write { off: offset, data: bytes.to_vec() };
        if let Some(inode) = st.inodes.get_mut(&ino) {
            apply_data(&mut inode.durable, &op);
        }
        Ok(())
    }

    /// Rewrites the files under the root to what survives a power loss (see [`Loss`]) and turns the
    /// power back on, with nothing pending. Call it only once no store is open on this disk.
    pub fn power_loss(&self, loss: Loss) -> io::Result<()> {
        let mut st = self.state.lock();
        self.lose(&mut st, loss)
    }

    /// The power goes off now, in a running process: every later operation fails with `EIO` and
    /// changes nothing, and the files under the root are rewritten at once to what survives (see
    /// [`Loss`]). Unlike [`SimDisk::power_loss`] the power stays off, so the stores still open on this
    /// disk cannot touch the rewritten files; the process is expected to die right after, as a
    /// machine would (the server's `WARREN_TEST_SIMULATED_DISK` hook). Returns what was pending.
    pub fn power_cut_now(&self, loss: Loss) -> io::Result<Pending> {
        let mut st = self.state.lock();
        st.powered_off = true;
        let pending = Pending {
            files: st.inodes.values().filter(|i| !i.pending.is_empty()).count(),
            bytes: st
                .inodes
                .values()
                .flat_map(|i| &i.pending)
                .map(|op| match op {
                    DataOp::Write { data, .. } => data.len() as u64,
                    _ => 0,
                })
                .sum(),
            entries: st.pending_entries.len(),
        };
        self.lose(&mut st, loss)?;
        st.powered_off = true;
        Ok(pending)
    }

    fn lose(&self, st: &mut State, loss: Loss) -> io::Result<()> {
        let mut rng = Rng(match loss {
            Loss::Unsynced => 0,
            Loss::Torn { seed } => seed ^ 0x9e37_79b9_7f4a_7c15,
            Loss::Reordered { seed } => seed ^ 0x5851_f42d_4c95_7f2d,
        });
        let reordered = matches!(loss, Loss::Reordered { .. });
        let torn = matches!(loss, Loss::Torn { .. }) || reordered;
        // The namespace: durable entries, plus (torn) a prefix of each directory's pending changes.
        let mut names = st.durable.clone();
        if torn {
            let mut by_dir: BTreeMap<PathBuf, Vec<EntryOp>> = BTreeMap::new();
            for op in &st.pending_entries {
                by_dir.entry(op.dir.clone()).or_default().push(op.clone());
            }
            for ops in by_dir.into_values() {
                let keep = rng.below(ops.len() as u64 + 1) as usize;
                for op in &ops[..keep] {
                    apply_entry(&mut names, op);
                }
            }
        }
        // A name whose directory did not survive is gone too.
        let all = names.clone();
        names.retain(|path, _| {
            path.ancestors()
                .skip(1)
                .take_while(|a| a.starts_with(&self.root) && *a != self.root)
                .all(|a| all.get(a) == Some(&Node::Dir))
        });
        // The contents: durable bytes, plus (torn) a prefix of the pending changes, the last write cut.
        let mut contents: HashMap<u64, Vec<u8>> = HashMap::new();
        for node in names.values() {
            let Node::File(ino) = *node else { continue };
            if contents.contains_key(&ino) {
                continue;
            }
            let inode = st.inodes.get(&ino).ok_or_else(eio)?;
            let mut data = inode.durable.clone();
            if reordered {
                for op in &inode.pending {
                    match op {
                        DataOp::Write { off, data: bytes } => {
                            // Each block of the write (by file offset) survives or not, on its own.
                            let end = off + bytes.len() as u64;
                            let mut at = *off;
                            while at < end {
                                let block_end = ((at / BLOCK + 1) * BLOCK).min(end);
                                if rng.below(2) == 1 {
                                    let piece = bytes[(at - off) as usize..(block_end - off) as usize].to_vec();
                                    apply_data(&mut data, &DataOp::Write { off: at, data: piece });
                                }
                                at = block_end;
                            }
                        }
                        op => apply_data(&mut data, op),
                    }
                }
            } else if torn && !inode.pending.is_empty() {
                let keep = rng.below(inode.pending.len() as u64 + 1) as usize;
                for (i, op) in inode.pending[..keep].iter().enumerate() {
                    match op {
                        DataOp::Write { off, data: bytes } if i + 1 == keep => {
                            let n = rng.below(bytes.len() as u64 + 1) as usize;
                            apply_data(&mut data, &DataOp::Write { off: *off, data: bytes[..n].to_vec() });
                        }
                        op => apply_data(&mut data, op),
                    }
                }
            }
            contents.insert(ino, data);
        }
        // Rewrite the real files.
        for entry in std::fs::read_dir(&self.root)? {
            let path = entry?.path();
            if path.is_dir() {
                std::fs::remove_dir_all(&path)?;
            } else {
                std::fs::remove_file(&path)?;
            }
        }
        let mut fresh = State { next_ino: 0, ..State::default() };
        fresh.ops = std::mem::take(&mut st.ops);
        for (path, node) in &names {
            match node {
                Node::Dir => {
                    std::fs::create_dir(path)?;
                    fresh.current.insert(path.clone(), Node::Dir);
                }
                Node::File(ino) => {
                    let data = contents.get(ino).cloned().unwrap_or_default();
                    std::fs::write(path, &data)?;
                    let new = fresh.next_ino;
                    fresh.next_ino += 1;
                    fresh.inodes.insert(new, Inode { durable: data, pending: Vec::new() });
                    fresh.current.insert(path.clone(), Node::File(new));
                }
            }
        }
        fresh.durable = fresh.current.clone();
        *st = fresh;
        Ok(())
    }

    fn models(&self, path: &Path) -> bool {
        path.starts_with(&self.root) && path != self.root
    }

    /// Counts an operation; fails it if the power is off or a fault is due.
    fn begin(&self, st: &mut State, kind: OpKind, path: &Path) -> io::Result<()> {
        st.ops.push(Op { kind, path: path.to_path_buf() });
        if st.powered_off {
            return Err(eio());
        }
        let mut fired = None;
        for t in st.triggers.iter_mut() {
            if t.kind.is_none_or(|k| k == kind) {
                if t.skip == 0 {
                    fired = Some(t.fault);
                    t.skip = u64::MAX;
                } else {
                    t.skip -= 1;
                }
            }
        }
        st.triggers.retain(|t| t.skip != u64::MAX);
        match fired {
            Some(Fault::PowerCut) => {
                st.powered_off = true;
                Err(eio())
            }
            Some(Fault::Error(errno)) => Err(io::Error::from_raw_os_error(errno)),
            None if st.full && matches!(kind, OpKind::Create | OpKind::Write | OpKind::MakeDir) => {
                Err(io::Error::from_raw_os_error(libc::ENOSPC))
            }
            None => Ok(()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    pub(crate) fn open(
        self: &Arc<Self>,
        path: &Path,
        create: bool,
        real: impl FnOnce() -> io::Result<File>,
    ) -> io::Result<(File, Option<SimFile>)> {
        if !self.models(path) {
            return Ok((real()?, None));
        }
        let mut st = self.lock();
        if !create {
            let Some(Node::File(ino)) = st.current.get(path).copied() else {
                return Err(io::Error::new(io::ErrorKind::NotFound, format!("{} is not a file the simulated disk knows", path.display())));
            };
            let file = real()?;
            return Ok((file, Some(SimFile { disk: self.clone(), ino })));
        }
        self.begin(&mut st, OpKind::Create, path)?;
        let file = real()?;
        let ino = match st.current.get(path).copied() {
            Some(Node::File(ino)) => {
                st.inodes.entry(ino).or_default().pending.push(DataOp::SetLen(0));
                ino
            }
            _ => {
                let ino = st.next_ino;
                st.next_ino += 1;
                st.inodes.insert(ino, Inode::default());
                st.current.insert(path.to_path_buf(), Node::File(ino));
                let dir = parent(path);
                st.pending_entries.push(EntryOp { dir, sets: vec![(path.to_path_buf(), Some(Node::File(ino)))] });
                ino
            }
        };
        Ok((file, Some(SimFile { disk: self.clone(), ino })))
    }

    pub(crate) fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        if !self.models(path) {
            return std::fs::create_dir_all(path);
        }
        let mut st = self.lock();
        let missing: Vec<PathBuf> = path
            .ancestors()
            .take_while(|a| self.models(a) && !st.current.contains_key(*a))
            .map(Path::to_path_buf)
            .collect();
        for dir in missing.into_iter().rev() {
            self.begin(&mut st, OpKind::MakeDir, &dir)?;
            match std::fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
            st.current.insert(dir.clone(), Node::Dir);
            st.pending_entries.push(EntryOp { dir: parent(&dir), sets: vec![(dir, Some(Node::Dir))] });
        }
        Ok(())
    }

    pub(crate) fn remove(&self, path: &Path, tree: bool) -> io::Result<()> {
        if !self.models(path) {
            return if tree { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) };
        }
        let mut st = self.lock();
        self.begin(&mut st, OpKind::Remove, path)?;
        if tree { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) }?;
        let gone: Vec<PathBuf> = st.current.keys().filter(|p| p.starts_with(path)).cloned().collect();
        // Deepest first, each in its own directory.
        for p in gone.into_iter().rev() {
            st.current.remove(&p);
            st.pending_entries.push(EntryOp { dir: parent(&p), sets: vec![(p, None)] });
        }
        Ok(())
    }

    pub(crate) fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        if !self.models(from) || !self.models(to) {
            return std::fs::rename(from, to);
        }
        let mut st = self.lock();
        self.begin(&mut st, OpKind::Rename, to)?;
        std::fs::rename(from, to)?;
        let node = st.current.remove(from).ok_or_else(eio)?;
        st.current.insert(to.to_path_buf(), node);
        let (a, b) = (parent(from), parent(to));
        if a == b {
            st.pending_entries.push(EntryOp { dir: a, sets: vec![(to.to_path_buf(), Some(node)), (from.to_path_buf(), None)] });
        } else {
            st.pending_entries.push(EntryOp { dir: b, sets: vec![(to.to_path_buf(), Some(node))] });
            st.pending_entries.push(EntryOp { dir: a, sets: vec![(from.to_path_buf(), None)] });
        }
        Ok(())
    }

    /// The real fsync is not made: the model decides what is durable (see the module docs).
    pub(crate) fn sync_dir(&self, path: &Path, real: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        if !self.models(path) && path != self.root {
            return real();
        }
        let mut st = self.lock();
        self.begin(&mut st, OpKind::DirSync, path)?;
        let (now, later): (Vec<EntryOp>, Vec<EntryOp>) = std::mem::take(&mut st.pending_entries).into_iter().partition(|op| op.dir == path);
        st.pending_entries = later;
        for op in &now {
            apply_entry(&mut st.durable, op);
        }
        Ok(())
    }

    /// The real `syncfs` is not made: the model decides what is durable.
    pub(crate) fn syncfs(&self) -> io::Result<()> {
        let mut st = self.lock();
        let root = self.root.clone();
        self.begin(&mut st, OpKind::SyncFs, &root)?;
        for op in std::mem::take(&mut st.pending_entries) {
            apply_entry(&mut st.durable, &op);
        }
        for inode in st.inodes.values_mut() {
            inode.settle();
        }
        Ok(())
    }
}

impl Inode {
    /// The pending changes reach the disk.
    fn settle(&mut self) {
        for op in std::mem::take(&mut self.pending) {
            apply_data(&mut self.durable, &op);
        }
    }
}

impl SimFile {
    fn data_op(&self, kind: OpKind, op: DataOp, real: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        let disk = &self.disk;
        let mut st = disk.lock();
        let path = path_of(&st, self.ino);
        disk.begin(&mut st, kind, &path)?;
        real()?;
        st.inodes.entry(self.ino).or_default().pending.push(op);
        Ok(())
    }

    pub fn write_at(&self, buf: &[u8], off: u64, real: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        self.data_op(OpKind::Write, DataOp::Write { off, data: buf.to_vec() }, real)
    }

    pub fn set_len(&self, len: u64, real: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        self.data_op(OpKind::SetLen, DataOp::SetLen(len), real)
    }

    pub fn punch_hole(&self, off: u64, len: u64, real: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        self.data_op(OpKind::PunchHole, DataOp::Punch { off, len }, real)
    }

    /// The real fsync is not made: the model decides what is durable.
    pub fn sync(&self) -> io::Result<()> {
        let disk = &self.disk;
        let mut st = disk.lock();
        let path = path_of(&st, self.ino);
        match disk.begin(&mut st, OpKind::FileSync, &path) {
            Ok(()) => {}
            Err(e) => {
                if !st.powered_off {
                    // An fsync that failed: the kernel may have dropped the dirty pages and cleared the
                    // error; what was pending never reaches the disk, though reads still return it.
                    if let Some(inode) = st.inodes.get_mut(&self.ino) {
                        inode.pending.clear();
                    }
                }
                return Err(e);
            }
        }
        if let Some(inode) = st.inodes.get_mut(&self.ino) {
            inode.settle();
        }
        Ok(())
    }
}

/// The current path of inode `ino` (for the operation log; empty if it has none any more).
fn path_of(st: &State, ino: u64) -> PathBuf {
    st.current.iter().find(|(_, n)| **n == Node::File(ino)).map(|(p, _)| p.clone()).unwrap_or_default()
}

fn parent(path: &Path) -> PathBuf {
    path.parent().map(Path::to_path_buf).unwrap_or_default()
}

fn apply_entry(names: &mut BTreeMap<PathBuf, Node>, op: &EntryOp) {
    for (path, node) in &op.sets {
        match node {
            Some(n) => {
                names.insert(path.clone(), *n);
            }
            None => {
                names.remove(path);
            }
        }
    }
}

fn apply_data(data: &mut Vec<u8>, op: &DataOp) {
    match op {
        DataOp::Write { off, data: bytes } => {
            let (off, end) = (*off as usize, *off as usize + bytes.len());
            if data.len() < end {
                data.resize(end, 0);
            }
            data[off..end].copy_from_slice(bytes);
        }
        DataOp::SetLen(len) => data.resize(*len as usize, 0),
        DataOp::Punch { off, len } => {
            let end = ((off + len) as usize).min(data.len());
            let off = (*off as usize).min(end);
            data[off..end].fill(0);
        }
    }
}

/// splitmix64: enough randomness for tearing, without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 if n is 0).
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

#[cfg(test)]
mod reorder_tests {
    use super::*;

    /// Out-of-order persistence: some seed keeps a later block of an unsynced write without an
    /// earlier one (what a prefix model never does), and every seed keeps only whole blocks of it.
    #[test]
    fn a_reordered_power_loss_can_keep_a_later_block_without_an_earlier_one() {
        let root = tempfile::tempdir().unwrap();
        let sim = SimDisk::new(root.path()).unwrap();
        let disk = crate::io::Disk::simulated(sim.clone());
        let path = root.path().join("f");
        let data: Vec<u8> = (0..4 * BLOCK).map(|i| (i / BLOCK + 1) as u8).collect();
        let mut saw_hole_before_data = false;
        for seed in 0..64 {
            {
                let f = disk.open_file(&path, true).unwrap();
                f.sync_all().unwrap();
                disk.fsync_dir(root.path()).unwrap();
                f.write_all_at(&data, 0).unwrap();
            }
            sim.power_loss(Loss::Reordered { seed }).unwrap();
            let got = std::fs::read(&path).unwrap();
            let blocks: Vec<bool> = (0..4).map(|b| {
                let range = (b * BLOCK) as usize..((b + 1) * BLOCK) as usize;
                let kept = got.get(range.clone()).is_some_and(|c| c == &data[range.clone()]);
                let absent = got.get(range).is_none_or(|c| c.iter().all(|&x| x == 0));
                assert!(kept || absent, "seed {seed}: block {b} is neither whole nor absent");
                kept
            }).collect();
            saw_hole_before_data |= blocks.windows(2).any(|w| !w[0] && w[1]);
            std::fs::remove_file(&path).unwrap();
            sim.power_loss(Loss::Unsynced).unwrap();
        }
        assert!(saw_hole_before_data, "no seed kept a block after a lost one");
    }
}
