//! The `manifest-sha256` checkpoint hook. When a checkpoint is sealed (every
//! file written, before the commit) it writes `sha256_manifest.json`: the
//! checkpoint's name, iteration and step, the run's configuration, and the
//! sha256 of every file. Before a load it hashes every file again and
//! refuses the checkpoint if a file changed, disappeared or appeared.
//!
//! List it after the other hooks: files a later hook writes in its own
//! `seal` are not in the manifest, so every load would refuse them.
//!
//! Options: `{"allow-missing": true}` accepts checkpoints saved without this
//! hook (no manifest); by default they are refused.

use hearth_guest::checkpoint::{
    CheckpointHook, CheckpointInfo, TensorInfo, TensorKey, TensorWriter, CHECKPOINT_DIR,
};
use hearth_guest::{export_checkpoint_hook, Value};
use serde_json::{json, Map};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;

/// What this hook writes.
const MANIFEST: &str = "sha256_manifest.json";
/// The host's completion marker, written after `seal` (so not hashed).
const HOST_MANIFEST: &str = "hearth_checkpoint.json";

/// The sha256 of a reader's bytes, as lowercase hex.
fn sha256_hex(mut input: impl Read) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = input.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Every file under `root` but the two manifests, by path relative to it
/// (`/`-separated), sorted.
fn files(root: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut pending = vec![String::new()];
    while let Some(prefix) = pending.pop() {
        let dir = format!("{root}/{prefix}");
        for entry in std::fs::read_dir(&dir).map_err(|e| format!("{dir}: {e}"))? {
            let entry = entry.map_err(|e| format!("{dir}: {e}"))?;
            let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
            let kind = entry.file_type().map_err(|e| format!("{name}: {e}"))?;
            if kind.is_dir() {
                pending.push(format!("{name}/"));
            } else if name != MANIFEST && name != HOST_MANIFEST {
                out.push(name);
            }
        }
    }
    out.sort();
    Ok(out)
}

fn hashes(root: &str) -> Result<BTreeMap<String, String>, String> {
    files(root)?
        .into_iter()
        .map(|name| {
            let path = format!("{root}/{name}");
            let file = std::fs::File::open(&path).map_err(|e| format!("{name}: {e}"))?;
            let hash =
                sha256_hex(std::io::BufReader::new(file)).map_err(|e| format!("{name}: {e}"))?;
            Ok((name, hash))
        })
        .collect()
}

/// Differences between what the manifest recorded and what is there now,
/// one line each (empty when they agree).
fn compare(recorded: &BTreeMap<String, String>, found: &BTreeMap<String, String>) -> Vec<String> {
    let mut problems = Vec::new();
    for (name, want) in recorded {
        match found.get(name) {
            None => problems.push(format!("{name} is missing")),
            Some(got) if got != want => problems.push(format!(
                "{name} has sha256 {got}, the manifest says {want} (it changed after the save)"
            )),
            Some(_) => {}
        }
    }
    for name in found.keys().filter(|n| !recorded.contains_key(*n)) {
        problems.push(format!(
            "{name} is not in the manifest (it was added after the save)"
        ));
    }
    problems
}

fn to_json(value: &Value) -> serde_json::Value {
    match value {
        Value::Float(v) => json!(v),
        Value::Int(v) => json!(v),
        Value::Boolean(v) => json!(v),
        Value::Text(v) => json!(v),
    }
}

fn allow_missing(options_json: &str) -> Result<bool, String> {
    let options: Map<String, serde_json::Value> =
        serde_json::from_str(options_json).map_err(|e| format!("options: {e}"))?;
    for key in options.keys() {
        if key != "allow-missing" {
            return Err(format!(
                "unknown option `{key}` (the only option is `allow-missing`)"
            ));
        }
    }
    match options.get("allow-missing") {
        None => Ok(false),
        Some(serde_json::Value::Bool(b)) => Ok(*b),
        Some(other) => Err(format!(
            "option `allow-missing` must be true or false, not {other}"
        )),
    }
}

#[derive(Default)]
struct ManifestSha256;

impl CheckpointHook for ManifestSha256 {
    fn seal(&mut self, checkpoint: &CheckpointInfo) -> Result<(), String> {
        allow_missing(&checkpoint.options_json)?;
        let config: Map<String, serde_json::Value> = checkpoint
            .config
            .iter()
            .map(|(k, v)| (k.clone(), to_json(v)))
            .collect();
        let doc = json!({
            "checkpoint": checkpoint.name,
            "iteration": checkpoint.iteration,
            "step": checkpoint.step,
            "config": config,
            "sha256": hashes(CHECKPOINT_DIR)?,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(format!("{CHECKPOINT_DIR}/{MANIFEST}"), text)
            .map_err(|e| format!("{MANIFEST}: {e}"))
    }

    fn load(
        &mut self,
        checkpoint: &CheckpointInfo,
        _tensors: &[TensorInfo],
        _claimed: &[TensorKey],
        _writer: &TensorWriter,
    ) -> Result<(), String> {
        let allow_missing = allow_missing(&checkpoint.options_json)?;
        let text = match std::fs::read(format!("{CHECKPOINT_DIR}/{MANIFEST}")) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && allow_missing => {
                hearth_guest::log::warn(&format!("{} has no {MANIFEST}; not verified", checkpoint.name));
                return Ok(());
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(format!(
                    "{} has no {MANIFEST} (saved without this hook?); set option allow-missing = true to load it unverified",
                    checkpoint.name
                ))
            }
            Err(e) => return Err(format!("{MANIFEST}: {e}")),
        };
        let doc: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| format!("{MANIFEST} is unreadable: {e}"))?;
        let recorded: BTreeMap<String, String> = serde_json::from_value(doc["sha256"].clone())
            .map_err(|e| format!("{MANIFEST} has no valid `sha256` table: {e}"))?;
        let problems = compare(&recorded, &hashes(CHECKPOINT_DIR)?);
        if !problems.is_empty() {
            return Err(format!(
                "{} failed verification: {}",
                checkpoint.name,
                problems.join("; ")
            ));
        }
        hearth_guest::log::debug(&format!(
            "{}: {} files verified",
            checkpoint.name,
            recorded.len()
        ));
        Ok(())
    }
}

export_checkpoint_hook!(ManifestSha256);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_known_inputs() {
        // FIPS 180-2 test vectors.
        assert_eq!(
            sha256_hex(&b""[..]).unwrap(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            sha256_hex(&b"abc"[..]).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn changed_missing_and_added_files_are_each_named() {
        let recorded: BTreeMap<String, String> = [("a", "1"), ("b", "2")]
            .map(|(k, v)| (k.into(), v.into()))
            .into();
        let found: BTreeMap<String, String> = [("a", "9"), ("c", "3")]
            .map(|(k, v)| (k.into(), v.into()))
            .into();
        let problems = compare(&recorded, &found);
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].starts_with("a has sha256 9"));
        assert!(problems[1].starts_with("b is missing"));
        assert!(problems[2].starts_with("c is not in the manifest"));
        assert!(compare(&recorded, &recorded).is_empty());
    }

    #[test]
    fn options_are_checked() {
        assert!(!allow_missing("{}").unwrap());
        assert!(allow_missing(r#"{"allow-missing": true}"#).unwrap());
        assert!(allow_missing(r#"{"allow-missing": 1}"#)
            .unwrap_err()
            .contains("true or false"));
        assert!(allow_missing(r#"{"colour": 1}"#)
            .unwrap_err()
            .contains("colour"));
    }
}
