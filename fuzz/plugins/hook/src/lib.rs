//! A checkpoint hook whose every move comes from the fuzzer's scripts (hex
//! strings in the run's config: `fuzz.save` for save and seal,
//! `fuzz.load` for load): files written into the checkpoint, reads,
//! claimed tensors (real or not), restored bytes of any length and
//! offset, errors, traps, output.
use hearth_guest::checkpoint::{
    byte_len, CheckpointHook, CheckpointInfo, TensorInfo, TensorKey, TensorReader, TensorWriter,
};
use hearth_guest::export_checkpoint_hook;
use hearth_guest::Value;

#[path = "../../script.rs"]
mod script;
use script::Script;

/// The script in config entry `key`.
fn script(checkpoint: &CheckpointInfo, key: &str) -> Script {
    let hex = checkpoint
        .config
        .iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| match v {
            Value::Text(t) => Some(t.clone()),
            _ => None,
        })
        .unwrap_or_default();
    Script::from_hex_in(&format!("\"s\":\"{hex}\""), "s")
}

/// Output, an error or a trap, as the script says.
fn act(s: &mut Script, what: &str) -> Result<u8, String> {
    let op = s.u8();
    if op & 1 != 0 {
        s.chatter();
    }
    if op & 0x0c == 0x0c {
        panic!("fuzz hook traps in {what} on purpose");
    }
    if op & 2 != 0 {
        return Err(s.text());
    }
    Ok(op)
}

/// A tensor's key: one the host named, or made up.
fn key(s: &mut Script, tensors: &[TensorInfo], claimed: &[TensorKey]) -> TensorKey {
    let pick = s.u8();
    if pick < 100 && !claimed.is_empty() {
        claimed[pick as usize % claimed.len()].clone()
    } else if pick < 200 && !tensors.is_empty() {
        tensors[pick as usize % tensors.len()].key.clone()
    } else {
        TensorKey {
            model: if pick & 1 == 0 { 0 } else { s.u32() },
            name: s.text(),
        }
    }
}

/// Writes (or makes folders of) names the script gives into the checkpoint.
fn write_files(s: &mut Script) {
    for _ in 0..s.u8() % 4 {
        let kind = s.u8();
        let name = s.text();
        let path = format!("/checkpoint/{name}");
        if kind & 1 == 0 {
            if let Some((dir, _)) = path.rsplit_once('/') {
                let _ = std::fs::create_dir_all(dir);
            }
            let _ = std::fs::write(&path, s.bytes());
        } else {
            let _ = std::fs::create_dir_all(&path);
        }
    }
}

#[derive(Default)]
struct Fuzz;

impl CheckpointHook for Fuzz {
    fn save(
        &mut self,
        checkpoint: &CheckpointInfo,
        tensors: &[TensorInfo],
        reader: &TensorReader,
    ) -> Result<Vec<TensorKey>, String> {
        let mut s = script(checkpoint, "fuzz.save");
        let op = act(&mut s, "save")?;
        if op & 0x10 != 0 {
            write_files(&mut s);
        }
        if op & 0x20 != 0 {
            for _ in 0..s.u8() % 4 {
                let k = key(&mut s, tensors, &[]);
                let (offset, length) = (s.u64() % 64, s.u64() % 64);
                let _ = reader.read(&k, offset, length);
            }
        }
        let mut claimed = Vec::new();
        for _ in 0..s.u8() % 5 {
            claimed.push(key(&mut s, tensors, &[]));
        }
        Ok(claimed)
    }

    fn seal(&mut self, checkpoint: &CheckpointInfo) -> Result<(), String> {
        let mut s = script(checkpoint, "fuzz.seal");
        let op = act(&mut s, "seal")?;
        if op & 0x10 != 0 {
            write_files(&mut s);
        }
        Ok(())
    }

    fn load(
        &mut self,
        checkpoint: &CheckpointInfo,
        tensors: &[TensorInfo],
        claimed: &[TensorKey],
        writer: &TensorWriter,
    ) -> Result<(), String> {
        let mut s = script(checkpoint, "fuzz.load");
        let op = act(&mut s, "load")?;
        if op & 0x10 == 0 {
            // Restores every claimed tensor whole (a well-behaved hook), as
            // the bytes the script gives, padded or cut to length.
            for k in claimed {
                let Some(info) = tensors
                    .iter()
                    .find(|t| t.key.model == k.model && t.key.name == k.name)
                else {
                    continue;
                };
                let len = byte_len(info).unwrap_or(0) as usize;
                let mut data = s.bytes();
                data.resize(len, 0);
                writer.write(k, 0, &data)?;
            }
        }
        for _ in 0..s.u8() % 6 {
            let k = key(&mut s, tensors, claimed);
            let offset = match s.u8() % 3 {
                0 => 0,
                1 => s.u8() as u64,
                _ => s.u64(),
            };
            let data = s.bytes();
            let _ = writer.write(&k, offset, &data);
        }
        Ok(())
    }
}

export_checkpoint_hook!(Fuzz);
