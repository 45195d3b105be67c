//! See `warren_fuzz::store` for the input layout and what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| warren_fuzz::store::check_recovery(data));
