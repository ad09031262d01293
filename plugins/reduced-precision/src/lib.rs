//! The `reduced-precision` checkpoint hook: the float32 model tensors whose
//! names match the `tensors` patterns are saved in `dtype` (half the bytes)
//! in `reduced_precision.safetensors` (`reduced_precision_<i>.safetensors`
//! for model i > 0) and claimed, so the model files leave them out; a load
//! widens them back to float32. Rounding is to nearest, ties to even, as
//! PyTorch's `tensor.to(torch.bfloat16)`.
//!
//! Options: `{"dtype": "bf16" | "f16", "tensors": ["*.weight", "lm_head.*"]}`
//! (defaults: `bf16`, every float32 tensor). Patterns are globs (`*`, `?`,
//! `[ab]`) over the tensor's name.
//!
//! Limits: a load reads a model's reduced file whole into the sandbox
//! (memory cap 1 GiB), so at most about 900 MB of reduced tensors per model.

use half::{bf16, f16};
use hearth_guest::checkpoint::{
    read_chunks, CheckpointHook, CheckpointInfo, TensorInfo, TensorKey, TensorReader, TensorWriter,
    CHECKPOINT_DIR,
};
use hearth_guest::export_checkpoint_hook;
use safetensors::{Dtype, SafeTensors, View};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Elements converted per write on load.
const CHUNK: usize = 4 << 20;

/// The reduced dtype.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Reduced {
    Bf16,
    F16,
}

impl Reduced {
    fn dtype(self) -> Dtype {
        match self {
            Self::Bf16 => Dtype::BF16,
            Self::F16 => Dtype::F16,
        }
    }

    /// Little-endian float32 bytes → little-endian reduced bytes.
    fn narrow(self, f32_bytes: &[u8], out: &mut Vec<u8>) {
        for b in f32_bytes.chunks_exact(4) {
            let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let bits = match self {
                Self::Bf16 => bf16::from_f32(v).to_bits(),
                Self::F16 => f16::from_f32(v).to_bits(),
            };
            out.extend_from_slice(&bits.to_le_bytes());
        }
    }

    /// Little-endian reduced bytes → little-endian float32 bytes.
    fn widen(self, bytes: &[u8], out: &mut Vec<u8>) {
        for b in bytes.chunks_exact(2) {
            let bits = u16::from_le_bytes([b[0], b[1]]);
            let v = match self {
                Self::Bf16 => bf16::from_bits(bits).to_f32(),
                Self::F16 => f16::from_bits(bits).to_f32(),
            };
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// The user's options.
struct Options {
    dtype: Reduced,
    patterns: Vec<glob::Pattern>,
}

impl Options {
    fn parse(json: &str) -> Result<Self, String> {
        let map: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(json).map_err(|e| format!("options: {e}"))?;
        let mut options = Options {
            dtype: Reduced::Bf16,
            patterns: vec![glob::Pattern::new("*").expect("valid")],
        };
        for (key, value) in map {
            match key.as_str() {
                "dtype" => {
                    options.dtype = match value.as_str() {
                        Some("bf16" | "bfloat16") => Reduced::Bf16,
                        Some("f16" | "float16" | "fp16") => Reduced::F16,
                        _ => {
                            return Err(format!(
                                "option `dtype` must be \"bf16\" or \"f16\", not {value}"
                            ))
                        }
                    }
                }
                "tensors" => {
                    let list = value.as_array().ok_or_else(|| {
                        format!("option `tensors` must be a list of name patterns, not {value}")
                    })?;
                    options.patterns = list
                        .iter()
                        .map(|p| {
                            let text = p
                                .as_str()
                                .ok_or_else(|| format!("option `tensors`: {p} is not a string"))?;
                            glob::Pattern::new(text)
                                .map_err(|e| format!("option `tensors`: pattern {text:?}: {e}"))
                        })
                        .collect::<Result<_, _>>()?;
                }
                other => {
                    return Err(format!(
                        "unknown option `{other}` (options: dtype, tensors)"
                    ))
                }
            }
        }
        Ok(options)
    }

    fn matches(&self, info: &TensorInfo) -> bool {
        info.dtype == "F32" && self.patterns.iter().any(|p| p.matches(&info.key.name))
    }
}

fn file_name(model: u32) -> String {
    if model == 0 {
        "reduced_precision.safetensors".into()
    } else {
        format!("reduced_precision_{model}.safetensors")
    }
}

/// One tensor converted while it is written (one tensor in memory at a time).
struct Narrowed<'a> {
    info: &'a TensorInfo,
    reader: &'a TensorReader,
    dtype: Reduced,
    shape: Vec<usize>,
    error: &'a RefCell<Option<String>>,
}

impl View for &Narrowed<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype.dtype()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let mut out = Vec::with_capacity(self.data_len());
        let read = read_chunks(self.reader, self.info, |chunk| {
            self.dtype.narrow(chunk, &mut out);
            Ok(())
        });
        if let Err(e) = read {
            self.error.borrow_mut().get_or_insert(e);
            out.resize(self.data_len(), 0);
        }
        Cow::Owned(out)
    }
    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * 2
    }
}

#[derive(Default)]
struct ReducedPrecision;

impl CheckpointHook for ReducedPrecision {
    fn save(
        &mut self,
        checkpoint: &CheckpointInfo,
        tensors: &[TensorInfo],
        reader: &TensorReader,
    ) -> Result<Vec<TensorKey>, String> {
        let options = Options::parse(&checkpoint.options_json)?;
        let mut by_model: BTreeMap<u32, Vec<&TensorInfo>> = BTreeMap::new();
        for info in tensors.iter().filter(|i| options.matches(i)) {
            by_model.entry(info.key.model).or_default().push(info);
        }
        let mut claimed = Vec::new();
        for (model, infos) in by_model {
            let error = RefCell::new(None);
            let views: Vec<(String, Narrowed)> = infos
                .iter()
                .map(|info| {
                    let view = Narrowed {
                        info,
                        reader,
                        dtype: options.dtype,
                        shape: info.shape.iter().map(|&d| d as usize).collect(),
                        error: &error,
                    };
                    (info.key.name.clone(), view)
                })
                .collect();
            let name = file_name(model);
            let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
            let path = format!("{CHECKPOINT_DIR}/{name}");
            safetensors::serialize_to_file(
                views.iter().map(|(n, v)| (n.as_str(), v)),
                Some(metadata),
                Path::new(&path),
            )
            .map_err(|e| format!("{name}: {e}"))?;
            if let Some(e) = error.into_inner() {
                return Err(format!("{name}: {e}"));
            }
            claimed.extend(infos.iter().map(|i| i.key.clone()));
        }
        hearth_guest::log::debug(&format!(
            "{}: {} tensors saved in {:?}",
            checkpoint.name,
            claimed.len(),
            options.dtype
        ));
        Ok(claimed)
    }

    fn load(
        &mut self,
        checkpoint: &CheckpointInfo,
        tensors: &[TensorInfo],
        claimed: &[TensorKey],
        writer: &TensorWriter,
    ) -> Result<(), String> {
        let infos: HashMap<(u32, &str), &TensorInfo> = tensors
            .iter()
            .map(|i| ((i.key.model, i.key.name.as_str()), i))
            .collect();
        let mut files: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
        for key in claimed {
            let name = file_name(key.model);
            let bytes = match files.entry(key.model) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => e.insert(
                    std::fs::read(format!("{CHECKPOINT_DIR}/{name}"))
                        .map_err(|e| format!("{name}: {e}"))?,
                ),
            };
            let st = SafeTensors::deserialize(bytes).map_err(|e| format!("{name}: {e}"))?;
            let view = st
                .tensor(&key.name)
                .map_err(|_| format!("{name} has no tensor `{}`", key.name))?;
            let info = infos
                .get(&(key.model, key.name.as_str()))
                .ok_or_else(|| format!("the model has no tensor `{}`", key.name))?;
            let shape: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
            if shape != info.shape {
                return Err(format!(
                    "tensor `{}`: shape {shape:?} in {name}, {:?} in the model",
                    key.name, info.shape
                ));
            }
            if info.dtype != "F32" {
                return Err(format!(
                    "tensor `{}` is {} in the model; this hook restores F32 only",
                    key.name, info.dtype
                ));
            }
            let reduced = match view.dtype() {
                Dtype::BF16 => Reduced::Bf16,
                Dtype::F16 => Reduced::F16,
                other => {
                    return Err(format!(
                        "tensor `{}` is {other:?} in {name}; expected BF16 or F16",
                        key.name
                    ))
                }
            };
            let mut offset = 0u64;
            let mut wide = Vec::with_capacity(CHUNK * 4);
            for chunk in view.data().chunks(CHUNK * 2) {
                wide.clear();
                reduced.widen(chunk, &mut wide);
                writer.write(key, offset, &wide)?;
                offset += wide.len() as u64;
            }
        }
        hearth_guest::log::debug(&format!(
            "{}: {} tensors restored",
            checkpoint.name,
            claimed.len()
        ));
        Ok(())
    }
}

export_checkpoint_hook!(ReducedPrecision);

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn bf16_rounds_to_nearest_even_and_widens_exactly() {
        // bf16 steps by 2^-7 near 1. 1 + 2^-8 is halfway between 1 and
        // 1 + 2^-7: the tie goes to the even mantissa (1.0). 1 + 3·2^-8 is
        // halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up to 1.015625.
        let values = [1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.5, 0.0];
        let mut narrow = Vec::new();
        Reduced::Bf16.narrow(&f32_bytes(&values), &mut narrow);
        let mut wide = Vec::new();
        Reduced::Bf16.widen(&narrow, &mut wide);
        assert_eq!(wide, f32_bytes(&[1.0, 1.015625, -2.5, 0.0]));
    }

    #[test]
    fn f16_round_trip_of_representable_values_is_exact() {
        let values = [0.5, -1024.0, 65504.0, 2.0f32.powi(-14)];
        let mut narrow = Vec::new();
        Reduced::F16.narrow(&f32_bytes(&values), &mut narrow);
        assert_eq!(narrow.len(), 8);
        let mut wide = Vec::new();
        Reduced::F16.widen(&narrow, &mut wide);
        assert_eq!(wide, f32_bytes(&values));
    }

    #[test]
    fn options_name_what_is_wrong() {
        assert!(Options::parse("{}").is_ok());
        let err = |json: &str| Options::parse(json).err().unwrap();
        assert!(err(r#"{"dtype": "f8"}"#).contains("dtype"));
        assert!(err(r#"{"tensors": "*.weight"}"#).contains("list"));
        assert!(err(r#"{"tensors": ["[a"]}"#).contains("[a"));
        assert!(err(r#"{"precision": 1}"#).contains("precision"));
        let o = Options::parse(r#"{"dtype": "f16", "tensors": ["*.weight"]}"#).unwrap();
        assert_eq!(o.dtype, Reduced::F16);
    }
}
