//! The checkpoint-hook adapter: a `checkpoint-plugin` component called
//! around `save_state` / `load_state`, one fresh instance per checkpoint,
//! whose only filesystem is that checkpoint's folder.
//!
//! Hooks fail closed: a trap, a missed deadline, a memory-cap hit, an `Err`
//! or a reply that breaks the contract (claiming a tensor the checkpoint
//! does not have, restoring half a tensor) is a [`PluginError::Runtime`]
//! naming the hook, and the caller abandons that save or load.

use super::bindings::checkpoint::exports::hearth::plugin::checkpoint_hook::CheckpointInfo;
use super::bindings::checkpoint::hearth::plugin::tensors::{self as wit, TensorInfo};
use super::bindings::checkpoint::CheckpointPlugin as Bindings;
use super::runtime::Prepared;
use super::sandbox::{PluginState, Preopen};
use super::stdio::clip;
use super::tensors::{Expected, TensorReader, TensorWriter};
use super::{Entries, Manifest, PluginError, PluginKind};
use hearth_ops::tensor::{dtype_of, TensorKey};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use tch::{Device, Tensor};
use wasmtime::component::{HasSelf, Resource};
use wasmtime::Store;

/// Longest error message from a hook that is reported.
const MAX_MESSAGE: usize = 1000;

/// The checkpoint a hook is called for.
#[derive(Debug, Clone, Default)]
pub struct HookCheckpoint {
    /// The folder's name (`checkpoint_12`).
    pub name: String,
    /// Its iteration.
    pub iteration: u64,
    /// Micro-batches run when it was saved.
    pub step: u64,
    /// The run's configuration.
    pub config: Entries,
}

/// A loaded checkpoint hook with the user's options.
pub struct CheckpointHookPlugin {
    plugin: Prepared,
    options_json: String,
}

/// Loads the checkpoint hook `manifest` describes, with `options_json` (a
/// JSON object) as its options. Instantiates it once (with no folder) so
/// that a component needing what hearth does not grant is refused now.
pub fn load_checkpoint_hook(
    manifest: &Manifest,
    options_json: &str,
) -> Result<CheckpointHookPlugin, PluginError> {
    let plugin = Prepared::new(manifest, PluginKind::CheckpointHook, None, |linker| {
        Bindings::add_to_linker::<PluginState, HasSelf<PluginState>>(linker, |s| s)
    })?;
    // Checked against its declared options, plus its presets.
    let options_json = manifest.options_json(options_json)?;
    plugin
        .instantiate(async |s, c, l| Bindings::instantiate_async(s, c, l).await)
        .map_err(|e| plugin.refused(e))?;
    Ok(CheckpointHookPlugin {
        plugin,
        options_json,
    })
}

fn infos(tensors: &[(TensorKey, Tensor)]) -> Result<Vec<TensorInfo>, String> {
    tensors
        .iter()
        .map(|(key, t)| {
            let dtype = dtype_of(t.kind()).ok_or_else(|| {
                format!(
                    "tensor {key} has dtype {:?}, which safetensors cannot hold",
                    t.kind()
                )
            })?;
            Ok(TensorInfo {
                key: key.into(),
                dtype: format!("{dtype:?}"),
                shape: t.size().iter().map(|&d| d as u64).collect(),
            })
        })
        .collect()
}

impl CheckpointHookPlugin {
    /// The plugin's name.
    pub fn name(&self) -> &str {
        self.plugin.name()
    }

    /// What its component exports and imports.
    pub(crate) fn report(&self) -> &super::ComponentReport {
        &self.plugin.report
    }

    fn fault(&self, what: &str, cause: String) -> PluginError {
        PluginError::Runtime {
            name: self.name().into(),
            message: format!("{what} {cause}"),
        }
    }

    /// A call's result: its value, or a fault for the `err` it returned or
    /// the trap, deadline or memory cap that stopped it.
    fn outcome<T>(
        &self,
        what: &str,
        result: wasmtime::Result<Result<T, String>>,
    ) -> Result<T, PluginError> {
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(message)) => Err(self.fault(
                what,
                format!("returned an error: {}", clip(&message, MAX_MESSAGE)),
            )),
            Err(trap) => Err(self.fault(what, self.plugin.describe(&trap))),
        }
    }

    fn info(&self, checkpoint: &HookCheckpoint) -> CheckpointInfo {
        CheckpointInfo {
            name: checkpoint.name.clone(),
            iteration: checkpoint.iteration,
            step: checkpoint.step,
            options_json: self.options_json.clone(),
            config: checkpoint.config.clone(),
        }
    }

    /// A fresh instance whose one folder is `folder`.
    fn instance(
        &self,
        what: &str,
        folder: &Path,
        writable: bool,
    ) -> Result<(Store<PluginState>, Bindings), PluginError> {
        self.plugin
            .instantiate_in(
                Some(Preopen::checkpoint(folder, writable)),
                async |s, c, l| Bindings::instantiate_async(s, c, l).await,
            )
            .map_err(|e| self.fault(what, self.plugin.describe(&e)))
    }

    /// Calls `save` with the checkpoint being written in `folder` (the
    /// staged folder, read-write) and the models' `tensors` (CPU; the
    /// snapshot being saved). Returns the live call, to be sealed once the
    /// host has written its files, and the tensors the hook claimed.
    pub fn save(
        &self,
        folder: &Path,
        checkpoint: &HookCheckpoint,
        tensors: &[(TensorKey, Tensor)],
    ) -> Result<HookSave<'_>, PluginError> {
        let infos =
            infos(tensors).map_err(|m| self.fault("save", format!("cannot be called: {m}")))?;
        let (mut store, bindings) = self.instance("save", folder, true)?;
        let reader = TensorReader {
            tensors: tensors
                .iter()
                .map(|(k, t)| (k.clone(), t.to_device(Device::Cpu).contiguous()))
                .collect(),
        };
        let reader = store
            .data_mut()
            .table()
            .push(reader)
            .map_err(|e| self.fault("save", format!("failed: {e}")))?;
        let info = self.info(checkpoint);
        let hook = bindings.hearth_plugin_checkpoint_hook();
        let borrowed = Resource::<TensorReader>::new_borrow(reader.rep());
        self.plugin.arm(&mut store);
        let result = self
            .plugin
            .run(hook.call_save(&mut store, &info, &infos, borrowed));
        let claimed = self.outcome("save", result)?;
        // The snapshot is no longer needed by the hook.
        let _ = store.data_mut().table().delete(reader);
        let known: BTreeSet<&TensorKey> = tensors.iter().map(|(k, _)| k).collect();
        let mut unique = BTreeSet::new();
        for key in claimed.into_iter().map(TensorKey::from) {
            if !known.contains(&key) {
                return Err(self.fault(
                    "save",
                    format!("claimed tensor {key}, which the checkpoint does not have"),
                ));
            }
            unique.insert(key);
        }
        Ok(HookSave {
            hook: self,
            store,
            bindings,
            info,
            claimed: unique.into_iter().collect(),
        })
    }

    /// Calls `load` with the checkpoint in `folder` (read-only), the
    /// models' `tensors` (what they hold now: names, dtypes, shapes) and the
    /// tensors this hook `claimed` when the checkpoint was saved. Returns
    /// each claimed tensor, restored whole, in the model's dtype and shape.
    pub fn load(
        &self,
        folder: &Path,
        checkpoint: &HookCheckpoint,
        tensors: &[(TensorKey, Tensor)],
        claimed: &[TensorKey],
    ) -> Result<Vec<(TensorKey, Tensor)>, PluginError> {
        let infos =
            infos(tensors).map_err(|m| self.fault("load", format!("cannot be called: {m}")))?;
        let by_key: HashMap<&TensorKey, &Tensor> = tensors.iter().map(|(k, t)| (k, t)).collect();
        let mut expected = HashMap::new();
        for key in claimed {
            let tensor = by_key.get(key).ok_or_else(|| {
                self.fault(
                    "load",
                    format!("cannot restore tensor {key}: the checkpoint says this hook saved it, but the model has no such tensor"),
                )
            })?;
            expected.insert(
                key.clone(),
                Expected {
                    kind: tensor.kind(),
                    shape: tensor.size(),
                    bytes: tensor.numel() * tensor.kind().elt_size_in_bytes(),
                },
            );
        }
        let (mut store, bindings) = self.instance("load", folder, false)?;
        let writer = TensorWriter {
            expected,
            written: HashMap::new(),
        };
        let writer = store
            .data_mut()
            .table()
            .push(writer)
            .map_err(|e| self.fault("load", format!("failed: {e}")))?;
        let info = self.info(checkpoint);
        let wit_claimed: Vec<wit::TensorKey> = claimed.iter().map(Into::into).collect();
        let hook = bindings.hearth_plugin_checkpoint_hook();
        let borrowed = Resource::<TensorWriter>::new_borrow(writer.rep());
        self.plugin.arm(&mut store);
        let result =
            self.plugin
                .run(hook.call_load(&mut store, &info, &infos, &wit_claimed, borrowed));
        self.outcome("load", result)?;
        let writer = store
            .data_mut()
            .table()
            .delete(writer)
            .map_err(|e| self.fault("load", format!("failed: {e}")))?;
        writer.finish().map_err(|m| self.fault("load", m))
    }
}

/// A hook's instance between `save` and `seal`.
pub struct HookSave<'a> {
    hook: &'a CheckpointHookPlugin,
    store: Store<PluginState>,
    bindings: Bindings,
    info: CheckpointInfo,
    claimed: Vec<TensorKey>,
}

impl HookSave<'_> {
    /// The plugin's name.
    pub fn name(&self) -> &str {
        self.hook.name()
    }

    /// The tensors the hook saved itself, sorted.
    pub fn claimed(&self) -> &[TensorKey] {
        &self.claimed
    }

    /// Calls `seal`: every file of the checkpoint is written, the commit
    /// comes next.
    pub fn seal(mut self) -> Result<(), PluginError> {
        let plugin = &self.hook.plugin;
        let hook = self.bindings.hearth_plugin_checkpoint_hook();
        plugin.arm(&mut self.store);
        let result = plugin.run(hook.call_seal(&mut self.store, &self.info));
        self.hook.outcome("seal", result)
    }
}
