//! See `warren_fuzz::protocol::check_properties` for the input layout and what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| warren_fuzz::protocol::check_properties(data));
