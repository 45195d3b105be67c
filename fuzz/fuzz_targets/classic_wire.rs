//! See `warren_fuzz::classic` for the input layout and what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| warren_fuzz::classic::check_classic(data));
