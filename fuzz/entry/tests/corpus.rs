//! The fuzz targets (`fuzz/`, `hearth_fuzz_entry`) on their checked-in
//! corpus and on every input that once crashed them: what CI runs of the
//! fuzzing, in seconds. A panic names the target and the file.
//!
//! `fuzz/corpus/<target>/` is the minimised corpus of the last long run
//! (`fuzz/run.sh`); `fuzz/regressions/<target>/` holds the crashes found,
//! each fixed since.

use std::panic::AssertUnwindSafe;
use std::path::Path;

/// Runs every file of the target's corpus and regressions through it.
fn replay(target: &str, run: fn(&[u8])) {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut ran = 0;
    for folder in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(fuzz.join(folder).join(target)) else {
            continue;
        };
        let mut files: Vec<_> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        for path in files {
            let data = std::fs::read(&path).unwrap();
            let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| run(&data)));
            assert!(
                outcome.is_ok(),
                "fuzz target `{target}` panicked on {}",
                path.display()
            );
            ran += 1;
        }
    }
    assert!(ran > 0, "fuzz/corpus/{target} holds no inputs");
}

#[test]
fn run_config() {
    replay("run_config", hearth_fuzz_entry::run_config);
}

#[test]
fn plugin_manifest() {
    replay("plugin_manifest", hearth_fuzz_entry::plugin_manifest);
}

#[test]
fn safetensors_file() {
    replay("safetensors_file", hearth_fuzz_entry::safetensors_file);
}

#[test]
fn hf_index() {
    replay("hf_index", hearth_fuzz_entry::hf_index);
}

#[test]
fn checkpoint_manifest() {
    replay(
        "checkpoint_manifest",
        hearth_fuzz_entry::checkpoint_manifest,
    );
}

#[test]
fn checkpoint_state() {
    replay("checkpoint_state", hearth_fuzz_entry::checkpoint_state);
}

#[test]
fn sharded_index() {
    replay("sharded_index", hearth_fuzz_entry::sharded_index);
}

#[test]
fn plugin_values() {
    replay("plugin_values", hearth_fuzz_entry::plugin_values);
}

#[test]
fn store_protocol() {
    replay("store_protocol", hearth_fuzz_entry::store_protocol);
}
