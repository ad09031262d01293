//! Accelerate's `load_state_dict`: one safetensors file's tensors, each on
//! the device its module is mapped to.

use super::device_map::{device_of, DeviceMap};
use super::handles::torch_err;
use super::{BigModelError, MapDevice, Notes};
use crate::checkpoint::{self, CheckpointError};
use safetensors::SafeTensors;
use std::path::Path;
use tch::{Device, Tensor};

/// Reads a safetensors file's `format` metadata as Accelerate does: none is
/// taken as `pt` (with a warning), `tf` and `flax` are refused.
pub(crate) fn check_format(
    path: &Path,
    st_bytes: &[u8],
    notes: &mut Notes,
) -> Result<(), BigModelError> {
    let bad = |message: String| {
        BigModelError::Checkpoint(CheckpointError::Format {
            path: path.into(),
            message,
        })
    };
    let (_, metadata) = SafeTensors::read_metadata(st_bytes).map_err(|e| bad(e.to_string()))?;
    let format = metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get("format").cloned());
    match format.as_deref() {
        None if metadata.metadata().is_none() => {
            notes.warn(format!(
                "The safetensors archive passed at {} does not contain metadata. Make sure to save your model with the \
                 `save_pretrained` method. Defaulting to 'pt' metadata.",
                path.display()
            ));
            Ok(())
        }
        Some("pt") => Ok(()),
        Some(f @ ("tf" | "flax")) => Err(bad(format!("it was saved with {f}; hearth reads the pt format"))),
        other => Err(bad(format!(
            "its metadata has format {other:?}, not \"pt\"; save the model with save_pretrained or save_model"
        ))),
    }
}

/// Accelerate's `load_state_dict(checkpoint_file, device_map)`: every
/// tensor of one safetensors file, each on the device its module is mapped
/// to (tensors mapped to the disk, or to nothing, on the CPU).
pub fn load_state_dict(
    path: &Path,
    device_map: Option<&DeviceMap>,
    notes: &mut Notes,
) -> Result<Vec<(String, Tensor)>, BigModelError> {
    if path.extension().is_none_or(|e| e != "safetensors") {
        return Err(BigModelError::Checkpoint(CheckpointError::Format {
            path: path.into(),
            message: "hearth reads safetensors files (*.safetensors), not pickled state dicts"
                .into(),
        }));
    }
    let map = checkpoint::open_mapped(path)?;
    check_format(path, map.bytes(), notes)?;
    let st = map.tensors(path)?;
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let view = st.tensor(&name).expect("listed by the file");
        let tensor = checkpoint::tensor_from_view(path, &name, &view)?;
        let device = device_map
            .and_then(|m| device_of(m, &name))
            .and_then(MapDevice::torch_device)
            .unwrap_or(Device::Cpu);
        let tensor = tensor.f_to_device(device).map_err(torch_err(format!(
            "{}: loading `{name}` on {}",
            path.display(),
            hearth_ops::spelling::device_name(device)
        )))?;
        out.push((name, tensor));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::{serialize_to_file, Dtype, TensorView};
    use std::collections::HashMap;

    fn write(path: &Path, metadata: Option<HashMap<String, String>>) {
        let data = [0u8; 8];
        let views = [
            ("a.w", TensorView::new(Dtype::F32, vec![2], &data).unwrap()),
            ("b.w", TensorView::new(Dtype::F32, vec![2], &data).unwrap()),
        ];
        serialize_to_file(views, metadata, path).unwrap();
    }

    #[test]
    fn load_state_dict_reads_the_pt_format_and_warns_without_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let map: DeviceMap = [
            ("a".to_string(), MapDevice::Cpu),
            ("b".to_string(), MapDevice::Disk),
        ]
        .into_iter()
        .collect();
        let pt = dir.path().join("pt.safetensors");
        write(&pt, Some(HashMap::from([("format".into(), "pt".into())])));
        let mut notes = Notes::default();
        let tensors = load_state_dict(&pt, Some(&map), &mut notes).unwrap();
        assert_eq!(
            tensors
                .iter()
                .map(|(n, t)| (n.as_str(), t.device()))
                .collect::<Vec<_>>(),
            [("a.w", Device::Cpu), ("b.w", Device::Cpu)],
            "the disk's tensors are read onto the CPU"
        );
        assert!(notes.warnings.is_empty());

        let bare = dir.path().join("bare.safetensors");
        write(&bare, None);
        load_state_dict(&bare, None, &mut notes).unwrap();
        assert!(
            notes.warnings[0].contains("does not contain metadata"),
            "{:?}",
            notes.warnings
        );

        let tf = dir.path().join("tf.safetensors");
        write(&tf, Some(HashMap::from([("format".into(), "tf".into())])));
        let err = load_state_dict(&tf, None, &mut notes)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tf.safetensors") && err.contains("saved with tf"),
            "{err}"
        );
        let err = load_state_dict(&dir.path().join("model.bin"), None, &mut notes)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model.bin") && err.contains("safetensors"),
            "{err}"
        );
    }
}
