//! The store's error type. Corruption found during recovery is not an error (it is repaired or isolated and
//! reported in [`Recovery`](crate::Recovery)); these are the failures the caller has to handle.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum StoreError {
    /// An I/O operation on the log directory failed while opening or recovering.
    /// (I/O failures of the writer thread are fatal and abort the process instead.)
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// Another process (or another `Store` in this one) has the log directory open.
    #[error("the log directory {path} is in use by another store")]
    Locked { path: PathBuf },
    /// A segment was written by a newer format version than this build reads.
    #[error("segment {path} has format version {version}, this build reads version {supported}")]
    UnsupportedVersion {
        path: PathBuf,
        version: u16,
        supported: u16,
    },
    /// A message payload is larger than one record may be.
    #[error("message of {len} bytes is larger than the {max} byte record limit")]
    RecordTooLarge { len: usize, max: usize },
    /// The store was closed; nothing more can be appended, and what was not durable will not become so.
    #[error("the message store is closed")]
    Closed,
}

impl StoreError {
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(io::Error) -> StoreError {
        let path = path.into();
        move |source| StoreError::Io { op, path, source }
    }
}
