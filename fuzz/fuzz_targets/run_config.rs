//! libFuzzer target `run_config`: the body is `hearth_fuzz_entry::run_config`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| hearth_fuzz_entry::run_config(data));
