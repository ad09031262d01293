//! libFuzzer target `plugin_values`: the body is `hearth_fuzz_entry::plugin_values`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| hearth_fuzz_entry::plugin_values(data));
