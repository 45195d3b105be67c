//! Test-only: a node whose disk can lose its power (`WARREN_TEST_SIMULATED_DISK`).
//!
//! A `kill -9` cannot show a missing fsync: the page cache keeps every write of a killed process.
//! With `WARREN_TEST_SIMULATED_DISK=1` (or `torn`) the server does every durable write of its data
//! directory (the store: WAL, queue files, checkpoints, the Raft logs and hard state of its groups;
//! the metadata log) through the store's power-loss simulator (`warren_store::sim::SimDisk`), which
//! knows what the last `fdatasync`/`fsync`/`syncfs` of each file and directory covered. On SIGUSR2 the
//! power goes off: the files are rewritten at once to what a machine crash would leave (`1`: unsynced
//! data and directory entries dropped; `torn`: also a random prefix of each file's unsynced writes,
//! the last one cut at a random byte; `reordered`: any subset of the blocks of each file's unsynced
//! writes, as a disk that persists them out of order) and the process kills itself with SIGKILL: no flush, no
//! graceful shutdown. The fault tests (`tests/cluster`, `tests/python/test_power_cut.py`) then
//! restart it on what is left.
//!
//! Never for production: the simulator keeps a copy of every file in memory and makes no real fsync
//! at all (the model decides what is durable). Unset, none of this runs: the store and the metadata
//! log are opened on the real disk, as before.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use warren_store::sim::{Loss, SimDisk};
use warren_store::Disk;

pub const ENV: &str = "WARREN_TEST_SIMULATED_DISK";

/// The disk the data directory is opened on: the simulator when `WARREN_TEST_SIMULATED_DISK` asks for
/// it (then SIGUSR2 cuts the power, see the module docs), else the real one. Returns the data
/// directory to use (made absolute: the simulator models the paths under it).
pub fn disk(data_dir: &Path) -> Result<(Disk, PathBuf), String> {
    let loss = match warren_store::test_hooks::var(ENV).as_deref() {
        None | Some("") | Some("0") => return Ok((Disk::real(), data_dir.to_path_buf())),
        Some("1") | Some("unsynced") => Loss::Unsynced,
        Some("torn") => Loss::Torn { seed: rand::random() },
        Some("reordered") => Loss::Reordered { seed: rand::random() },
        Some(other) => return Err(format!("{ENV}={other}: expected 1 (or unsynced), torn, reordered or 0")),
    };
    let root = std::path::absolute(data_dir).map_err(|e| format!("{ENV}: {}: {e}", data_dir.display()))?;
    warren_store::create_dir_durably(&root).map_err(|e| format!("cannot create data directory {}: {e}", root.display()))?;
    let sim = SimDisk::new(&root).map_err(|e| format!("{ENV}: cannot read {} into the simulator: {e}", root.display()))?;
    tracing::warn!(
        data_dir = %root.display(),
        ?loss,
        "{ENV} is set (TESTS ONLY): the data directory is on the power-loss simulator (no real fsync; every file also held in memory); SIGUSR2 cuts the power"
    );
    cut_on_sigusr2(sim.clone(), loss).map_err(|e| format!("{ENV}: cannot handle SIGUSR2: {e}"))?;
    Ok((Disk::simulated(sim), root))
}

fn cut_on_sigusr2(sim: Arc<SimDisk>, loss: Loss) -> std::io::Result<()> {
    let mut usr2 = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined2())?;
    tokio::spawn(async move {
        if usr2.recv().await.is_none() {
            return;
        }
        match sim.power_cut_now(loss) {
            Ok(dropped) => tracing::error!(
                files = dropped.files,
                bytes = dropped.bytes,
                dir_entries = dropped.entries,
                ?loss,
                "power cut ({ENV}, SIGUSR2): unsynced writes dropped from the data directory; killing this process"
            ),
            Err(e) => tracing::error!("power cut ({ENV}, SIGUSR2): rewriting the data directory failed: {e}; killing this process"),
        }
        // Like the machine dying: nothing after this point runs, nothing is flushed.
        // SAFETY: kill(2) on our own pid; no memory is passed.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    });
    Ok(())
}
