//! See `warren_fuzz::http` for the input layout and what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| warren_fuzz::http::check_http(data));
