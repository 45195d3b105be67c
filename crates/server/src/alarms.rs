//! Resource alarms, as RabbitMQ has them: a memory high watermark and a disk free limit.
//!
//! A monitor task samples the process's resident memory and the data directory's free space every
//! `CHECK_INTERVAL`. Past either limit it raises that alarm; connections that publish are then blocked
//! (`connection.blocked`, and their socket is not read) until every alarm has cleared. Each alarm clears
//! only with some margin below (memory) or above (disk) its limit, so it does not flap. No alarm ever
//! deletes a message.
//!
//! The disk alarm is also raised while the message store waits for space (a write failed with
//! `ENOSPC`: the file system filled up between two samples, or faster than the limit allows for), and
//! stays raised until that write went through and free space is back above the limit.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;

const CHECK_INTERVAL: Duration = Duration::from_millis(250);
/// The memory alarm clears below this fraction of the limit.
const MEMORY_CLEAR_RATIO: f64 = 0.95;
/// The store may need this much for writes it has already accepted (its write buffer and a WAL
/// segment): the effective disk limit is never lower.
const DISK_LIMIT_FLOOR: u64 = 128 << 20;
/// The disk alarm clears this far above the limit (5%, at least 16 MiB).
fn disk_clear_margin(limit: u64) -> u64 {
    (limit / 20).max(16 << 20)
}

/// Which alarms are raised.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AlarmState {
    pub memory: bool,
    pub disk: bool,
}

impl AlarmState {
    pub fn blocks_publishers(&self) -> bool {
        self.memory || self.disk
    }

    /// The reason text of connection.blocked, as RabbitMQ words it.
    pub fn reason(&self) -> &'static str {
        match (self.memory, self.disk) {
            (true, true) => "low on memory & disk",
            (true, false) => "low on memory",
            (false, true) => "low on disk",
            (false, false) => "",
        }
    }
}

/// The two thresholds in bytes; replaced when the configuration is reloaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    pub disk_free_bytes: u64,
}

impl Limits {
    pub fn from_config(config: &crate::config::Config) -> Limits {
        Limits {
            memory_bytes: config.memory_limit_bytes(total_memory()),
            disk_free_bytes: config.disk_free_limit_bytes().max(DISK_LIMIT_FLOOR),
        }
    }
}

/// Samples memory and disk until `shutdown`, publishing the alarm state on `tx`.
pub async fn monitor(
    data_dir: PathBuf,
    store: warren_store::Store,
    limits: Arc<Mutex<Limits>>,
    tx: watch::Sender<AlarmState>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(CHECK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let limits = *limits.lock();
        let mut state = *tx.borrow();
        if let Some(rss) = resident_memory() {
            if !state.memory && rss > limits.memory_bytes {
                state.memory = true;
                tracing::warn!(in_use = rss, limit = limits.memory_bytes,
                    "memory resource limit alarm set: publishers are blocked until memory use falls");
            } else if state.memory && (rss as f64) < limits.memory_bytes as f64 * MEMORY_CLEAR_RATIO {
                state.memory = false;
                tracing::warn!(in_use = rss, limit = limits.memory_bytes, "memory resource limit alarm cleared");
            }
        }
        let store_full = store.waiting_for_space();
        if store_full && !state.disk {
            state.disk = true;
            tracing::warn!(dir = %data_dir.display(),
                "disk resource limit alarm set: the message store has no space to write; publishers are blocked \
                 until free space is back");
        }
        match free_disk(&data_dir) {
            Ok(_) if store_full => {}
            Ok(free) => {
                if !state.disk && free < limits.disk_free_bytes {
                    state.disk = true;
                    tracing::warn!(free, limit = limits.disk_free_bytes, dir = %data_dir.display(),
                        "disk resource limit alarm set: publishers are blocked until free space is back");
                } else if state.disk && free > limits.disk_free_bytes + disk_clear_margin(limits.disk_free_bytes) {
                    state.disk = false;
                    tracing::warn!(free, limit = limits.disk_free_bytes, "disk resource limit alarm cleared");
                }
            }
            Err(e) => tracing::debug!(error = %e, "cannot read free disk space"),
        }
        tx.send_if_modified(|s| {
            let changed = *s != state;
            *s = state;
            changed
        });
    }
}

/// Resident set size of this process, from /proc/self/statm.
pub fn resident_memory() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok().filter(|p| *p > 0).unwrap_or(4096))
}

/// RAM of the machine, or the cgroup's memory limit if it is lower.
pub fn total_memory() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let ram = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(8 << 30);
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok().and_then(|s| s.trim().parse::<u64>().ok());
    cgroup.map_or(ram, |c| c.min(ram))
}

/// Bytes available to this process on the file system holding `dir`.
pub fn free_disk(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid NUL-terminated string and `st` a properly sized out-parameter.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}
