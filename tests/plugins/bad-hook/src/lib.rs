//! A checkpoint hook that misbehaves as its option `do` says, to show the
//! host fails closed and keeps it in its folder:
//! `save-err`, `save-trap` (after writing a file), `seal-spin`, `save-hog`,
//! `save-squat` (takes the name `model.safetensors`), `seal-clobber`
//! (rewrites a file hearth wrote),
//! `claim-unknown`, `claim-first` (claims the first tensor, saves nothing,
//! restores it as zeros), `load-err`, `load-partial`, `load-unclaimed`,
//! `escape` (tries to leave its folder; records what happened in
//! `escape.txt`, and tries to write while loading).
use hearth_guest::checkpoint::{
    byte_len, CheckpointHook, CheckpointInfo, TensorInfo, TensorKey, TensorReader, TensorWriter,
};
use hearth_guest::export_checkpoint_hook;

fn action(options_json: &str) -> String {
    options_json
        .split("\"do\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or("")
        .to_string()
}

/// Whether each escape attempt was refused.
fn try_escape() -> String {
    let mut lines = Vec::new();
    let mut attempt = |what: &str, ok: bool| {
        lines.push(format!(
            "{what}: {}",
            if ok { "ALLOWED" } else { "refused" }
        ))
    };
    attempt("read /etc/passwd", std::fs::read("/etc/passwd").is_ok());
    attempt(
        "write /checkpoint/../outside.txt",
        std::fs::write("/checkpoint/../outside.txt", "x").is_ok(),
    );
    attempt(
        "write /tmp/outside.txt",
        std::fs::write("/tmp/outside.txt", "x").is_ok(),
    );
    attempt(
        "list /",
        std::fs::read_dir("/")
            .map(|d| d.count() > 1)
            .unwrap_or(false),
    );
    lines.join("\n")
}

#[derive(Default)]
struct BadHook;

impl CheckpointHook for BadHook {
    fn save(
        &mut self,
        checkpoint: &CheckpointInfo,
        tensors: &[TensorInfo],
        _reader: &TensorReader,
    ) -> Result<Vec<TensorKey>, String> {
        match action(&checkpoint.options_json).as_str() {
            "save-err" => Err("refusing this checkpoint on purpose".into()),
            "save-trap" => {
                std::fs::write("/checkpoint/half-done.bin", [1u8; 100]).unwrap();
                panic!("fixture trap in save")
            }
            "save-hog" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 8 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            "save-squat" => {
                std::fs::create_dir("/checkpoint/model.safetensors").map_err(|e| e.to_string())?;
                Ok(Vec::new())
            }
            "claim-unknown" => Ok(vec![TensorKey {
                model: 0,
                name: "no.such.tensor".into(),
            }]),
            "claim-first" | "load-partial" | "load-unclaimed" | "load-err" => {
                Ok(vec![tensors[0].key.clone()])
            }
            "escape" => {
                std::fs::write("/checkpoint/escape.txt", try_escape())
                    .map_err(|e| e.to_string())?;
                Ok(Vec::new())
            }
            _ => Ok(Vec::new()),
        }
    }

    fn seal(&mut self, checkpoint: &CheckpointInfo) -> Result<(), String> {
        if action(&checkpoint.options_json) == "seal-clobber" {
            std::fs::write("/checkpoint/trainer_state.json", "{}").map_err(|e| e.to_string())?;
        }
        if action(&checkpoint.options_json) == "seal-spin" {
            let mut n = 1u64;
            loop {
                n = std::hint::black_box(n.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
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
        let info = |key: &TensorKey| {
            tensors
                .iter()
                .find(|t| t.key.model == key.model && t.key.name == key.name)
                .unwrap()
        };
        match action(&checkpoint.options_json).as_str() {
            "load-err" => Err("refusing this load on purpose".into()),
            "load-partial" => {
                let len = byte_len(info(&claimed[0]))?;
                writer.write(&claimed[0], 0, &vec![0u8; (len / 2) as usize])
            }
            "load-unclaimed" => writer.write(&tensors[tensors.len() - 1].key, 0, &[0u8; 4]),
            "claim-first" => {
                // Restores the claimed tensor as all zeros.
                let len = byte_len(info(&claimed[0]))?;
                writer.write(&claimed[0], 0, &vec![0u8; len as usize])
            }
            "escape" => match std::fs::write("/checkpoint/written-on-load.txt", "x") {
                Ok(()) => Err("could write into a checkpoint being loaded".into()),
                Err(_) => Ok(()),
            },
            _ => Ok(()),
        }
    }
}

export_checkpoint_hook!(BadHook);
