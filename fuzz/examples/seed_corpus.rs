//! Writes the seed corpus to `fuzz/corpus/<target>/<name>` (replacing the seeds of the same names),
//! after checking that every seed passes its target's checks and that the base stores come out the
//! same on every build (so a crash input reproduces in another process).
//! `cargo run --manifest-path fuzz/Cargo.toml --example seed_corpus` (stable is enough).

use warren_fuzz::{classic, http, metadata, protocol, quorum, seeds, store};

fn main() {
    let again = [store::build_base(0), store::build_base(1)];
    for (a, b) in store::bases().iter().zip(&again) {
        for ((pa, da), (pb, db)) in a.iter().zip(b) {
            assert!(pa == pb && da == db, "the base stores differ between two builds: {} ({} bytes) vs {} ({} bytes), first difference at {:?}", pa.display(), da.len(), pb.display(), db.len(), da.iter().zip(db).position(|(x, y)| x != y));
        }
        assert_eq!(a.len(), b.len(), "the base stores differ between two builds: {:?} vs {:?}", a.iter().map(|f| &f.0).collect::<Vec<_>>(), b.iter().map(|f| &f.0).collect::<Vec<_>>());
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let mut count = 0;
    let meta = metadata::seeds().into_iter().map(|(name, bytes)| ("metadata_recovery", name, bytes));
    let quorum_seeds = quorum::seeds().into_iter().map(|(name, bytes)| ("quorum_machine", name, bytes));
    let classic_seeds = classic::seeds().into_iter().map(|(name, bytes)| ("classic_wire", name, bytes));
    let http_seeds = http::seeds().into_iter().map(|(name, bytes)| ("http_api", name, bytes));
    for (target, name, bytes) in seeds::protocol_seeds().into_iter().chain(seeds::store_seeds()).chain(meta).chain(quorum_seeds).chain(classic_seeds).chain(http_seeds) {
        match target {
            "frames" => protocol::check_frame_stream(&bytes),
            "methods" => protocol::check_method(&bytes),
            "properties" => protocol::check_properties(&bytes),
            "field_tables" => protocol::check_field_table(&bytes),
            "metadata_recovery" => metadata::check_metadata(&bytes),
            "quorum_machine" => quorum::check_quorum(&bytes),
            "classic_wire" => classic::check_classic(&bytes),
            "http_api" => http::check_http(&bytes),
            _ => store::check_recovery(&bytes),
        }
        let dir = root.join(target);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join(name), bytes).expect("write seed");
        count += 1;
    }
    println!("{count} seeds written to {}", root.display());
}
