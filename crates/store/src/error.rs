//! The store's error type: the failures the caller has to handle. Damage found during recovery is an
//! error ([`StoreError::Corrupt`]) only where the recovery mode refuses it; otherwise it is repaired or
//! isolated and reported in [`Recovery`](crate::Recovery).

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
    /// Recovery found damage its recovery mode does not accept: the store refuses to open and changes
    /// nothing (see `RecoveryMode`).
    #[error("{path} is damaged at offset {offset}: {reason}; {advice}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
        advice: String,
    },
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
