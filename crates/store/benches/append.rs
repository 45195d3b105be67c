//! Store micro-benchmark: appends of 1 KB records with group commit, next to what this machine's disk
//! does on its own in the same run (sequential 1 MiB writes with one fdatasync per 8 MiB, through the
//! page cache and with O_DIRECT, and the fsync rate).
//!
//! `cargo bench -p warren-store --bench append`. Throughput is in bytes of records per second.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use warren_store::{Batch, Store, StoreOptions};

const RECORD: usize = 1024;
/// Bytes written per iteration of each benchmark.
const PER_ITER: usize = 64 << 20;

/// Writes `PER_ITER` bytes to a new file at `path` in `chunk`s, one fdatasync per 8 chunks, and returns
/// the time it took; `direct` opens it with O_DIRECT (then `chunk` must be block-aligned).
fn timed_sequential_writes(path: &std::path::Path, chunk: &[u8], direct: bool) -> Duration {
    use std::os::unix::fs::OpenOptionsExt;
    let mut opts = std::fs::OpenOptions::new();
    opts.create(true).truncate(true).write(true);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let mut f = opts.open(path).unwrap();
    let t = Instant::now();
    for n in 0..PER_ITER / chunk.len() {
        f.write_all(chunk).unwrap();
        if n % 8 == 7 {
            f.sync_data().unwrap();
        }
    }
    f.sync_data().unwrap();
    let took = t.elapsed();
    drop(f);
    std::fs::remove_file(path).unwrap();
    took
}

/// The disk on its own: 1 MiB writes, one fdatasync per 8 MiB (about what one group commit holds),
/// through the page cache and with O_DIRECT (as the store writes: on this machine the faster of the
/// two, so the stricter yardstick).
fn raw_sequential(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut g = c.benchmark_group("disk");
    g.throughput(Throughput::Bytes(PER_ITER as u64)).sample_size(10);
    let mem = vec![7u8; (1 << 20) + 4096];
    let start = mem.as_ptr().align_offset(4096);
    let chunk = &mem[start..start + (1 << 20)];
    for (name, direct) in [("sequential_write_fdatasync_8MiB", false), ("sequential_write_direct_fdatasync_8MiB", true)] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| (0..iters).map(|i| timed_sequential_writes(&dir.path().join(format!("raw-{i}")), chunk, direct)).sum())
        });
    }
    g.throughput(Throughput::Elements(1));
    g.bench_function("fdatasync_4KiB", |b| {
        let mut f = std::fs::File::create(dir.path().join("fsync")).unwrap();
        let block = [1u8; 4096];
        b.iter(|| {
            f.write_all(&block).unwrap();
            f.sync_data().unwrap();
        })
    });
    g.finish();
}

/// The store: `threads` appenders, each appending batches of `per_batch` 1 KB records to its own queue,
/// group commit, waiting for durability at the end of each iteration.
fn store_appends(c: &mut Criterion) {
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Bytes(PER_ITER as u64)).sample_size(10);
    for (threads, per_batch) in [(1usize, 64usize), (4, 16), (4, 1)] {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = Store::open(dir.path(), StoreOptions::default()).unwrap();
        let store = Arc::new(store);
        let seqs: Arc<Vec<std::sync::atomic::AtomicU64>> = Arc::new((0..threads).map(|_| Default::default()).collect());
        g.bench_function(format!("append_1KiB_{threads}_threads_batches_of_{per_batch}"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let handles: Vec<_> = (0..threads)
                        .map(|th| {
                            let (store, seqs) = (store.clone(), seqs.clone());
                            std::thread::spawn(move || {
                                let body = [b'x'; RECORD];
                                let mut batch = Batch::new();
                                let mut last = 0;
                                let records = PER_ITER / RECORD / threads;
                                for _ in 0..records / per_batch {
                                    batch.clear();
                                    for _ in 0..per_batch {
                                        let seq = seqs[th].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                        batch.enqueue(th as u64, seq, 0, &[&body]);
                                    }
                                    last = store.append(&mut batch).unwrap();
                                }
                                store.wait_durable(last).unwrap();
                            })
                        })
                        .collect();
                    for h in handles {
                        h.join().unwrap();
                    }
                    total += t.elapsed();
                }
                total
            })
        });
        let s = store.stats();
        eprintln!(
            "  store stats: {} batches, {} fsyncs ({:.0} records per fsync), {} checkpoints",
            s.batches,
            s.fsyncs,
            s.records as f64 / s.fsyncs.max(1) as f64,
            s.checkpoints
        );
        store.close().unwrap();
    }
    g.finish();
}

/// The broker's own path: one `append_enqueue` per message (header and CRC computed outside the lock,
/// the body copied once into the group buffer), one queue, one thread.
fn store_single_enqueues(c: &mut Criterion) {
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Bytes(PER_ITER as u64)).sample_size(10);
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path(), StoreOptions::default()).unwrap();
    let mut seq = 0u64;
    let body = [b'x'; RECORD];
    g.bench_function("append_enqueue_1KiB_1_thread", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                let mut last = 0;
                for _ in 0..PER_ITER / RECORD {
                    last = store.append_enqueue(0, seq, 0, &[&body]).unwrap();
                    seq += 1;
                }
                store.wait_durable(last).unwrap();
                total += t.elapsed();
            }
            total
        })
    });
    g.finish();
    store.close().unwrap();
}

criterion_group!(benches, raw_sequential, store_appends, store_single_enqueues);
criterion_main!(benches);
