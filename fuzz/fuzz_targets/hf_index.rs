//! libFuzzer target `hf_index`: the body is `hearth_fuzz_entry::hf_index`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| hearth_fuzz_entry::hf_index(data));
