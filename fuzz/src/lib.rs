//! Shared code of Warren's fuzz targets (`fuzz_targets/`): the checks each target runs on its input
//! ([`protocol`], [`store`], [`metadata`], [`quorum`], [`classic`], [`http`]) and the seed corpus ([`seeds`], written by `examples/seed_corpus.rs`).
//! How to run them: `scripts/fuzz.sh` and tests/README.md.

pub mod classic;
pub mod http;
pub mod metadata;
pub mod protocol;
pub mod quorum;
pub mod seeds;
pub mod store;
