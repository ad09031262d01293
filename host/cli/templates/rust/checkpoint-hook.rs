//! {{name}}: a hearth checkpoint hook. At save it writes `{{name}}.json`
//! into the checkpoint (its step and the number of model tensors); at load
//! it refuses a checkpoint whose note is missing, unless `allow-missing`.
//!
//! Build and install it with `hearth plugins build` and `hearth plugins
//! install .`; test it on this machine with `cargo test`.
use hearth_guest::checkpoint::{CheckpointHook, CheckpointInfo, TensorInfo, TensorKey, TensorReader, TensorWriter};
use hearth_guest::export_checkpoint_hook;

const NOTE: &str = "/checkpoint/{{name}}.json";

#[derive(Default)]
struct Plugin;

impl CheckpointHook for Plugin {
    fn save(&mut self, checkpoint: &CheckpointInfo, tensors: &[TensorInfo], _reader: &TensorReader) -> Result<Vec<TensorKey>, String> {
        std::fs::write(NOTE, note(checkpoint.step, tensors.len())).map_err(|e| format!("{NOTE}: {e}"))?;
        Ok(Vec::new()) // no tensor claimed: hearth saves them all
    }

    fn load(&mut self, checkpoint: &CheckpointInfo, _tensors: &[TensorInfo], _claimed: &[TensorKey], _writer: &TensorWriter) -> Result<(), String> {
        let options: serde_json::Value = serde_json::from_str(&checkpoint.options_json).map_err(|e| e.to_string())?;
        match std::fs::read_to_string(NOTE) {
            Ok(_) => Ok(()),
            Err(_) if options["allow-missing"].as_bool() == Some(true) => Ok(()),
            Err(e) => Err(format!("{} has no {NOTE} ({e}): it was not saved with this hook", checkpoint.name)),
        }
    }
}

/// The note of a checkpoint: its step and how many model tensors it holds.
fn note(step: u64, tensors: usize) -> String {
    format!("{{\"step\":{step},\"tensors\":{tensors}}}")
}

export_checkpoint_hook!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_note_holds_the_step_and_the_tensor_count() {
        assert_eq!(note(12, 5), r#"{"step":12,"tensors":5}"#);
    }
}
