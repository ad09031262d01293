//! libFuzzer target `sharded_index`: the body is `hearth_fuzz_entry::sharded_index`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| hearth_fuzz_entry::sharded_index(data));
