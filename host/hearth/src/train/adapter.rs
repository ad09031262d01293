//! `[model] adapter-from` (a PEFT LoRA adapter read into the traced
//! model's LoRA parameters) and the run folder's `adapter/`, which
//! `PeftModel.from_pretrained(base, "RUN/adapter")` loads.

use super::config::TrainConfig;
use super::error::TrainError;
use crate::accelerator::Accelerator;
use crate::checkpoint::adapter::{self, Adapter, LoraNames};
use crate::models::Model;
use std::collections::BTreeMap;
use std::path::Path;
use tch::Tensor;

/// The run folder's adapter.
pub(super) const ADAPTER_DIR: &str = "adapter";

/// The adapter a run writes at its end: the configuration it was read
/// with, and each LoRA tensor's model name with its PEFT name.
pub(super) struct RunAdapter {
    config: serde_json::Value,
    names: Vec<(String, String)>,
}

/// The LoRA tensors of `tensors`, named as PEFT's file names them
/// (`init-key-prefix` stripped).
pub(super) fn lora_names(config: &TrainConfig, tensors: &[(String, Tensor)]) -> LoraNames {
    LoraNames::of(tensors, prefix(config))
}

fn prefix(config: &TrainConfig) -> &str {
    config.model.init_key_prefix.as_deref().unwrap_or_default()
}

fn adapter_err(config: &TrainConfig) -> impl Fn(adapter::AdapterError) -> TrainError + '_ {
    |source| TrainError::Adapter {
        config: config.source.clone(),
        source,
    }
}

/// Reads `[model] adapter-from` into `model`'s LoRA parameters, checked
/// against them first (every process checks, so all refuse together).
/// `None` when the config names no adapter.
pub(super) fn load(
    config: &TrainConfig,
    model: &dyn Model,
    acc: &Accelerator,
) -> Result<Option<RunAdapter>, TrainError> {
    let tensors = model.named_parameters();
    let lora = lora_names(config, &tensors);
    let Some(from) = &config.model.adapter_from else {
        if !lora.is_empty() {
            acc.print(format!(
                "the model has {} LoRA tensors and no model.adapter-from: no adapter/ is written (name the folder PeftModel.save_pretrained wrote at export to get one)",
                lora.tensors.len()
            ));
        }
        return Ok(None);
    };
    let dir = config.resolve(from);
    let err = adapter_err(config);
    let mine = read(&dir, model, &tensors, &lora, prefix(config));
    // Every process learns whether each read worked: one that could not
    // (a folder missing on one machine) stops them all, named.
    if let Some((rank, message)) = super::error::failed_rank(acc, &mine)? {
        mine.map_err(&err)?;
        return Err(err(adapter::AdapterError::Unsupported {
            path: dir,
            message: format!("rank {rank} could not read it: {message}"),
        }));
    }
    let (found, loaded) = mine.map_err(&err)?;
    let others = loaded.len() - lora.tensors.len();
    acc.print(format!(
        "loaded {} LoRA tensors{} from {}",
        lora.tensors.len(),
        match others {
            0 => String::new(),
            n => format!(" and {n} of the model's own"),
        },
        dir.display()
    ));
    Ok(Some(RunAdapter {
        config: found.config,
        names: loaded
            .into_iter()
            .map(|(i, peft)| (tensors[i].0.clone(), peft))
            .collect(),
    }))
}

/// Opens the adapter at `dir`, checks it against `model`'s LoRA tensors
/// (`lora` of `tensors`) and reads it into them; returns it and what it
/// loaded.
fn read(
    dir: &Path,
    model: &dyn Model,
    tensors: &[(String, Tensor)],
    lora: &LoraNames,
    prefix: &str,
) -> Result<(Adapter, Vec<(usize, String)>), adapter::AdapterError> {
    let found = Adapter::open(dir)?;
    let loaded = found.check(tensors, lora, prefix)?;
    // A model read lazily reads these now, so that the adapter's values
    // are not overwritten by the file's (or init-from's) later.
    let names: Vec<String> = loaded.iter().map(|(i, _)| tensors[*i].0.clone()).collect();
    model
        .materialize(Some(&names))
        .map_err(|message| adapter::AdapterError::Unsupported {
            path: dir.into(),
            message,
        })?;
    found.load(tensors, &loaded)?;
    Ok((found, loaded))
}

/// Writes `run_dir/adapter/` from the model just saved in `run_dir`
/// (whose tensor names `saved_name` gives): the main process only.
pub(super) fn write(
    acc: &Accelerator,
    run_dir: &Path,
    run_adapter: &RunAdapter,
    saved_name: impl Fn(&str) -> String,
) -> Result<(), TrainError> {
    if !acc.is_main_process() {
        return Ok(());
    }
    let names: BTreeMap<String, String> = run_adapter
        .names
        .iter()
        .map(|(model_name, peft)| (saved_name(model_name), peft.clone()))
        .collect();
    let tensors = adapter::read_saved(run_dir, &names)?;
    let dir = run_dir.join(ADAPTER_DIR);
    adapter::write(&dir, &run_adapter.config, &tensors)?;
    acc.print(format!("adapter written to {}", dir.display()));
    Ok(())
}
