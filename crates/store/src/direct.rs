//! [`Appender`]: appends to a file with `O_DIRECT`, bypassing the page cache.
//!
//! Why: on this kind of machine a buffered `write` spends most of its time copying into the page cache
//! (`copy_folio_from_iter_atomic` was 57% of the writer thread in a profile, and `dd` through the page
//! cache reached 414 MB/s against 1.7 GB/s with `O_DIRECT`). The store writes every byte once or twice and
//! reads little of it back soon, so the page cache buys nothing on the write path.
//!
//! `O_DIRECT` wants offsets, lengths and memory aligned to [`BLOCK`]. The appender keeps the last partial
//! block in its buffer and writes it again, completed, with the next append (or the caller does, with
//! [`Appender::write_blocks`], from memory it prepared: the WAL writer's in-place group writes); the file therefore ends in
//! zero padding up to the next block boundary, which readers treat as the end of the data (see
//! [`is_padding`]). Where `O_DIRECT` is not supported (tmpfs, some file systems), it falls back to
//! ordinary buffered appends, without padding.

use std::fs::File;
use std::path::Path;

use crate::io::{Disk, IoFile, Open};

pub(crate) const BLOCK: usize = 4096;

pub(crate) struct Appender {
    file: IoFile,
    direct: bool,
    /// Backing memory; the aligned working area starts at `start`.
    mem: Vec<u8>,
    start: usize,
    /// Bytes of the current partial block, at the start of the working area (direct mode).
    tail: usize,
    /// File offset of the current partial block (direct mode), or of the end (buffered mode).
    block_off: u64,
}

impl Appender {
    /// Creates (truncating) `path` for appending.
    pub fn create(disk: &Disk, path: &Path) -> std::io::Result<Appender> {
        let (file, direct) = open(disk, path, Open::CreateTruncate)?;
        Ok(Appender::new(file, direct, 0, &[]))
    }

    /// Opens `path` to append after its first `len` bytes (anything after them is cut off).
    pub fn open_at(disk: &Disk, path: &Path, len: u64) -> std::io::Result<Appender> {
        let plain = disk.open(path, Open::Existing, false)?;
        if plain.len()? != len {
            plain.set_len(len)?;
        }
        let block_off = len / BLOCK as u64 * BLOCK as u64;
        let mut partial = vec![0u8; (len - block_off) as usize];
        plain.read_exact_at(&mut partial, block_off)?;
        drop(plain);
        let (file, direct) = open(disk, path, Open::Existing)?;
        let mut a = Appender::new(file, direct, block_off, &partial);
        if !direct {
            a.block_off = len;
        }
        Ok(a)
    }

    fn new(file: IoFile, direct: bool, block_off: u64, partial: &[u8]) -> Appender {
        let mut a = Appender { file, direct, mem: Vec::new(), start: 0, tail: 0, block_off };
        if direct {
            a.reserve(BLOCK);
            a.area()[..partial.len()].copy_from_slice(partial);
            a.tail = partial.len();
        }
        a
    }

    /// Makes the aligned working area at least `n` bytes.
    fn reserve(&mut self, n: usize) {
        let have = self.mem.len().saturating_sub(self.start);
        if have >= n {
            return;
        }
        let keep = self.tail;
        let want = n.next_power_of_two().max(BLOCK);
        let mut mem = vec![0u8; want + BLOCK];
        let start = mem.as_ptr().align_offset(BLOCK);
        mem[start..start + keep].copy_from_slice(&self.mem[self.start..self.start + keep]);
        self.mem = mem;
        self.start = start;
    }

    /// Gives back buffer memory above `max` bytes (keeping the partial block).
    pub fn shrink_to(&mut self, max: usize) {
        if self.mem.len() <= max + BLOCK || !self.direct {
            return;
        }
        let keep = self.tail;
        let mut mem = vec![0u8; BLOCK * 2];
        let start = mem.as_ptr().align_offset(BLOCK);
        mem[start..start + keep].copy_from_slice(&self.mem[self.start..self.start + keep]);
        self.mem = mem;
        self.start = start;
    }

    fn area(&mut self) -> &mut [u8] {
        &mut self.mem[self.start..]
    }

    /// Appends `data` (written when this returns; durable after [`Appender::sync_data`]).
    pub fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        if !self.direct {
            self.file.write_all_at(data, self.block_off)?;
            self.block_off += data.len() as u64;
            return Ok(());
        }
        let total = self.tail + data.len();
        let padded = total.div_ceil(BLOCK) * BLOCK;
        self.reserve(padded);
        let tail = self.tail;
        let area = self.area();
        area[tail..total].copy_from_slice(data);
        area[total..padded].fill(0);
        let off = self.block_off;
        if let Err(e) = self.file.write_all_at(&self.mem[self.start..self.start + padded], off) {
            if e.raw_os_error() == Some(libc::EINVAL) {
                // The file system refused direct I/O after all: continue buffered from the logical end.
                return self.fall_back(total);
            }
            return Err(e);
        }
        let full = total / BLOCK * BLOCK;
        self.mem.copy_within(self.start + full..self.start + total, self.start);
        self.tail = total - full;
        self.block_off += full as u64;
        Ok(())
    }

    fn fall_back(&mut self, total: usize) -> std::io::Result<()> {
        tracing::warn!("O_DIRECT writes refused by the file system; using buffered writes");
        let bytes = self.mem[self.start..self.start + total].to_vec();
        self.direct = false;
        self.file.write_all_at(&bytes, self.block_off)?;
        self.block_off += total as u64;
        self.tail = 0;
        Ok(())
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The bytes of the file's last, partial block (direct mode; empty otherwise): the next write
    /// starts at that block and repeats them.
    pub fn partial_block(&self) -> &[u8] {
        if self.direct {
            &self.mem[self.start..self.start + self.tail]
        } else {
            &[]
        }
    }

    /// Writes `blocks` straight from the caller's memory (direct mode): block-aligned memory whose
    /// first bytes are [`Appender::partial_block`], then new data, `data_len` bytes in all, then zero
    /// padding to a whole number of blocks. Saves copying the data into this appender's own buffer.
    pub fn write_blocks(&mut self, blocks: &[u8], data_len: usize) -> std::io::Result<()> {
        debug_assert!(self.direct && blocks.len() % BLOCK == 0 && data_len <= blocks.len());
        debug_assert_eq!(blocks.as_ptr() as usize % BLOCK, 0);
        if let Err(e) = self.file.write_all_at(blocks, self.block_off) {
            if e.raw_os_error() == Some(libc::EINVAL) {
                tracing::warn!("O_DIRECT writes refused by the file system; using buffered writes");
                self.direct = false;
                self.file.write_all_at(&blocks[..data_len], self.block_off)?;
                self.block_off += data_len as u64;
                self.tail = 0;
                return Ok(());
            }
            return Err(e);
        }
        let full = data_len / BLOCK * BLOCK;
        let tail = data_len - full;
        self.reserve(BLOCK);
        let start = self.start;
        self.mem[start..start + tail].copy_from_slice(&blocks[full..data_len]);
        self.tail = tail;
        self.block_off += full as u64;
        Ok(())
    }

    /// Takes over the working memory of `old` (whose file is done) if this appender has written nothing
    /// yet: after a WAL roll the new segment does not allocate and page-fault in its own.
    pub fn reuse_memory_of(&mut self, old: &mut Appender) {
        if self.direct && self.tail == 0 && self.block_off == 0 && old.mem.len() > self.mem.len() {
            std::mem::swap(&mut self.mem, &mut old.mem);
            std::mem::swap(&mut self.start, &mut old.start);
        }
    }

    pub fn sync_data(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }
}

fn open(disk: &Disk, path: &Path, how: Open) -> std::io::Result<(IoFile, bool)> {
    match disk.open(path, how, true) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((disk.open(path, how, false)?, false)),
        Err(e) => Err(e),
    }
}

/// Opens `path` for reading, telling the kernel that reads will be sequential (larger readahead).
///
/// Reads are buffered on purpose: `O_DIRECT` reads measured slower here (178k against 359k msg/s
/// consuming a backlog) because each one waits for the disk, where buffered reads find the data already
/// read ahead.
pub(crate) fn open_reader(path: &Path) -> std::io::Result<File> {
    use std::os::fd::AsRawFd;
    let file = File::open(path)?;
    // SAFETY: an advisory call on a descriptor we own; failure only loses the hint.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };
    Ok(file)
}

/// A reader that bypasses the page cache (`O_DIRECT`), for reads made off the delivery path: a
/// buffered read of a file written with `O_DIRECT` fills the page cache first (allocation, copy),
/// which was a fifth of a node's time draining a quorum queue's backlog past its memory budget. Falls
/// back to a buffered reader where the file system refuses `O_DIRECT` (tmpfs): the bool says which.
pub(crate) fn open_direct_reader(path: &Path) -> std::io::Result<(File, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((open_reader(path)?, false)),
        Err(e) => Err(e),
    }
}

/// `read_range` for a reader opened with `O_DIRECT`: reads the whole blocks around the range into an
/// aligned part of a fresh buffer and returns the range as a slice of it (no copy).
pub(crate) fn read_range_direct(file: &File, offset: u64, len: usize) -> std::io::Result<bytes::Bytes> {
    use std::os::fd::AsRawFd;
    let start = offset - offset % BLOCK as u64;
    let skip = (offset - start) as usize;
    let total = (skip + len).div_ceil(BLOCK) * BLOCK;
    let mut buf: Vec<u8> = Vec::with_capacity(total + BLOCK);
    let pad = buf.as_ptr().align_offset(BLOCK);
    let mut done = 0usize;
    while done < total {
        // SAFETY: the destination `pad + done .. pad + total` is inside `buf`'s allocation (capacity
        // total + BLOCK, pad < BLOCK), block-aligned as O_DIRECT requires, and only written by the
        // kernel; `file` is an open descriptor for the duration of the call.
        let n = unsafe {
            libc::pread(file.as_raw_fd(), buf.as_mut_ptr().add(pad + done).cast(), total - done, (start + done as u64) as libc::off_t)
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
        // At the end of the file a direct read returns less than asked (not a whole block).
        if n == 0 || (n as usize) % BLOCK != 0 {
            break;
        }
    }
    // SAFETY: the kernel initialised `pad .. pad + done`; the bytes before `pad` are set here.
    unsafe {
        std::ptr::write_bytes(buf.as_mut_ptr(), 0, pad);
        buf.set_len(pad + done);
    }
    let from = (pad + skip).min(buf.len());
    let to = (pad + skip + len).min(buf.len());
    Ok(bytes::Bytes::from(buf).slice(from..to))
}

/// Reads up to `len` bytes at `offset` (fewer at the end of the file) into a fresh buffer that is not
/// zeroed first (zeroing it was 6% of the broker's CPU while it consumed a backlog).
pub(crate) fn read_range(file: &File, offset: u64, len: usize) -> std::io::Result<bytes::Bytes> {
    use std::os::fd::AsRawFd;
    let mut buf: Vec<u8> = Vec::with_capacity(len);
    let mut done = 0usize;
    while done < len {
        // SAFETY: the destination is inside `buf`'s allocation (done + (len - done) <= capacity) and is
        // only written by the kernel; `file` is an open descriptor for the duration of the call.
        let n = unsafe {
            libc::pread(file.as_raw_fd(), buf.as_mut_ptr().add(done).cast(), len - done, (offset + done as u64) as libc::off_t)
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        done += n as usize;
    }
    // SAFETY: the kernel initialised the first `done` bytes.
    unsafe { buf.set_len(done) };
    Ok(bytes::Bytes::from(buf))
}

/// Whether `rest` (what follows the last valid record) is only the zero padding direct writes leave.
pub(crate) fn is_padding(rest: &[u8]) -> bool {
    rest.len() < BLOCK && rest.iter().all(|b| *b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_of_any_size_read_back_and_reopen_continues() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let disk = Disk::real();
        let mut a = Appender::create(&disk, &path).unwrap();
        let mut expect = Vec::new();
        for i in 0..300usize {
            let chunk: Vec<u8> = (0..(i * 37 % 9000)).map(|j| (i + j) as u8).collect();
            a.append(&chunk).unwrap();
            expect.extend_from_slice(&chunk);
        }
        a.sync_data().unwrap();
        drop(a);
        let data = std::fs::read(&path).unwrap();
        assert_eq!(&data[..expect.len()], &expect[..]);
        assert!(is_padding(&data[expect.len()..]));
        let mut b = Appender::open_at(&disk, &path, expect.len() as u64).unwrap();
        b.append(b"more").unwrap();
        expect.extend_from_slice(b"more");
        let data = std::fs::read(&path).unwrap();
        assert_eq!(&data[..expect.len()], &expect[..]);
    }
}
