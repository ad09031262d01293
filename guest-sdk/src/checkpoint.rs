//! Checkpoint hooks: implement [`CheckpointHook`], export it with
//! [`export_checkpoint_hook!`](crate::export_checkpoint_hook).
//!
//! Each save or load runs in a fresh instance (one value of the type,
//! created with `Default`, lives for `save` then `seal`, or for `load`).
//! The checkpoint folder is `/checkpoint`: writable during `save` and
//! `seal`, read-only during `load`. Returning `Err` (or panicking) abandons
//! that save — the previous checkpoint stays intact — or refuses that load.
//!
//! A hook that writes the step of every checkpoint into `step.txt`:
//!
//! ```no_run
//! use hearth_guest::checkpoint::{CheckpointHook, CheckpointInfo, TensorInfo, TensorKey, TensorReader};
//! use hearth_guest::export_checkpoint_hook;
//!
//! #[derive(Default)]
//! struct Step;
//!
//! impl CheckpointHook for Step {
//!     fn save(&mut self, checkpoint: &CheckpointInfo, _: &[TensorInfo], _: &TensorReader) -> Result<Vec<TensorKey>, String> {
//!         std::fs::write("/checkpoint/step.txt", checkpoint.step.to_string()).map_err(|e| e.to_string())?;
//!         Ok(Vec::new())
//!     }
//! }
//!
//! export_checkpoint_hook!(Step);
//! ```

pub use crate::bindings::checkpoint::exports::hearth::plugin::checkpoint_hook::CheckpointInfo;
pub use crate::bindings::checkpoint::hearth::plugin::tensors::{
    TensorInfo, TensorKey, TensorReader, TensorWriter,
};

/// Where the checkpoint folder appears.
pub const CHECKPOINT_DIR: &str = "/checkpoint";

/// The most bytes one [`TensorReader::read`] returns.
pub const MAX_READ: u64 = 64 << 20;

/// Hooks around `save_state` / `load_state`.
pub trait CheckpointHook: Default + 'static {
    /// Before the host writes its files: may write files into
    /// `/checkpoint` and returns the tensors it saved itself (the host then
    /// leaves them out and asks this hook for them at load).
    fn save(
        &mut self,
        _checkpoint: &CheckpointInfo,
        _tensors: &[TensorInfo],
        _reader: &TensorReader,
    ) -> Result<Vec<TensorKey>, String> {
        Ok(Vec::new())
    }
    /// After every file is written, before the commit.
    fn seal(&mut self, _checkpoint: &CheckpointInfo) -> Result<(), String> {
        Ok(())
    }
    /// Before anything is restored: may verify the folder, and must write
    /// every tensor in `claimed` through `writer`.
    fn load(
        &mut self,
        _checkpoint: &CheckpointInfo,
        _tensors: &[TensorInfo],
        _claimed: &[TensorKey],
        _writer: &TensorWriter,
    ) -> Result<(), String> {
        Ok(())
    }
}

/// Bytes per element of a safetensors dtype (`F32` → 4), if known.
pub fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
        _ => return None,
    })
}

/// The number of bytes of `info`'s data.
pub fn byte_len(info: &TensorInfo) -> Result<u64, String> {
    let size = dtype_size(&info.dtype).ok_or_else(|| {
        format!(
            "tensor `{}` has unknown dtype {}",
            info.key.name, info.dtype
        )
    })?;
    Ok(info.shape.iter().product::<u64>() * size)
}

/// Reads the bytes of `info`'s tensor in chunks of at most [`MAX_READ`],
/// handing each chunk to `each` in order.
pub fn read_chunks(
    reader: &TensorReader,
    info: &TensorInfo,
    mut each: impl FnMut(&[u8]) -> Result<(), String>,
) -> Result<(), String> {
    let total = byte_len(info)?;
    let mut offset = 0;
    while offset < total {
        let length = (total - offset).min(MAX_READ);
        let chunk = reader.read(&info.key, offset, length)?;
        each(&chunk)?;
        offset += length;
    }
    Ok(())
}

/// Exports a [`CheckpointHook`] type as this component's `checkpoint-hook`
/// interface.
#[macro_export]
macro_rules! export_checkpoint_hook {
    ($ty:ty) => {
        const _: () = {
            use $crate::bindings::checkpoint::exports::hearth::plugin::checkpoint_hook as wit;
            use $crate::checkpoint::{
                CheckpointInfo, TensorInfo, TensorKey, TensorReader, TensorWriter,
            };

            static STATE: ::std::sync::Mutex<::core::option::Option<$ty>> =
                ::std::sync::Mutex::new(None);

            fn with<R>(f: impl FnOnce(&mut $ty) -> R) -> R {
                let mut guard = STATE.lock().unwrap_or_else(|e| e.into_inner());
                f(guard.get_or_insert_with(<$ty as ::core::default::Default>::default))
            }

            struct HearthCheckpointExport;

            impl wit::Guest for HearthCheckpointExport {
                fn save(
                    checkpoint: CheckpointInfo,
                    tensors: Vec<TensorInfo>,
                    reader: &TensorReader,
                ) -> Result<Vec<TensorKey>, String> {
                    with(|h| {
                        $crate::checkpoint::CheckpointHook::save(h, &checkpoint, &tensors, reader)
                    })
                }
                fn seal(checkpoint: CheckpointInfo) -> Result<(), String> {
                    with(|h| $crate::checkpoint::CheckpointHook::seal(h, &checkpoint))
                }
                fn load(
                    checkpoint: CheckpointInfo,
                    tensors: Vec<TensorInfo>,
                    claimed: Vec<TensorKey>,
                    writer: &TensorWriter,
                ) -> Result<(), String> {
                    with(|h| {
                        $crate::checkpoint::CheckpointHook::load(
                            h,
                            &checkpoint,
                            &tensors,
                            &claimed,
                            writer,
                        )
                    })
                }
            }

            $crate::bindings::checkpoint::__export_checkpoint_world!(
                HearthCheckpointExport with_types_in $crate::bindings::checkpoint
            );
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::Dtype;

    #[test]
    fn element_sizes_are_the_safetensors_crates() {
        let dtypes = [
            Dtype::BOOL,
            Dtype::U8,
            Dtype::I8,
            Dtype::F8_E5M2,
            Dtype::F8_E4M3,
            Dtype::I16,
            Dtype::U16,
            Dtype::F16,
            Dtype::BF16,
            Dtype::I32,
            Dtype::U32,
            Dtype::F32,
            Dtype::F64,
            Dtype::I64,
            Dtype::U64,
        ];
        for dtype in dtypes {
            let name = format!("{dtype:?}");
            assert_eq!(
                dtype_size(&name),
                Some(dtype.bitsize() as u64 / 8),
                "{name}"
            );
        }
        assert_eq!(dtype_size("C64"), None);
    }

    #[test]
    fn a_tensors_byte_length_is_its_elements_times_their_size() {
        let info = |dtype: &str, shape: Vec<u64>| TensorInfo {
            key: TensorKey {
                model: 0,
                name: "w".into(),
            },
            dtype: dtype.into(),
            shape,
        };
        assert_eq!(byte_len(&info("BF16", vec![3, 5])), Ok(30));
        assert_eq!(
            byte_len(&info("F32", vec![])),
            Ok(4),
            "a scalar is one element"
        );
        assert_eq!(byte_len(&info("F64", vec![4, 0])), Ok(0));
        let e = byte_len(&info("Q4", vec![2])).unwrap_err();
        assert!(e.contains("`w`") && e.contains("Q4"), "{e}");
    }
}
