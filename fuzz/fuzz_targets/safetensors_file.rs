//! libFuzzer target `safetensors_file`: the body is `hearth_fuzz_entry::safetensors_file`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| hearth_fuzz_entry::safetensors_file(data));
