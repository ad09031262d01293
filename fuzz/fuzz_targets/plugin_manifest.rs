//! libFuzzer target `plugin_manifest`: the body is `hearth_fuzz_entry::plugin_manifest`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| hearth_fuzz_entry::plugin_manifest(data));
