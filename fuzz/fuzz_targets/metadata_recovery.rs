//! See `warren_fuzz::metadata` for the input layout and what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| warren_fuzz::metadata::check_metadata(data));
