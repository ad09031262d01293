//! libFuzzer target `store_protocol`: the body is `hearth_fuzz_entry::store_protocol`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| hearth_fuzz_entry::store_protocol(data));
