//! See `warren_fuzz::quorum` for the input layout and what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| warren_fuzz::quorum::check_quorum(data));
