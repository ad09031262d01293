//! `hearth plugins check`: everything load does, without a run.

use super::bindings::scheduler::SchedulerPlugin as SchedulerBindings;
use super::bindings::wrap_policy::WrapPolicyPlugin as WrapPolicyBindings;
use super::runtime::Prepared;
use super::sandbox::PluginState;
use super::{
    load_checkpoint_hook, load_tracker, ComponentReport, Manifest, PluginError, PluginKind,
};
use wasmtime::component::HasSelf;

/// Compiles the plugin, checks its world and version and instantiates it
/// in its sandbox (a tracker with a throwaway logging folder). Returns what the component exports and imports.
pub fn check_plugin(manifest: &Manifest) -> Result<ComponentReport, PluginError> {
    let report = match manifest.kind {
        PluginKind::Tracker => {
            // A fresh private folder of our own, under a random name (so
            // nobody can have planted a link there), removed when dropped.
            let scratch = tempfile::Builder::new()
                .prefix(&format!("hearth-check-{}-", manifest.name))
                .tempdir()
                .map_err(|source| PluginError::Io {
                    path: std::env::temp_dir(),
                    source,
                })?;
            load_tracker(manifest, scratch.path()).map(|t| t.report().clone())?
        }
        PluginKind::Scheduler => {
            let plugin = Prepared::new(manifest, PluginKind::Scheduler, None, |linker| {
                SchedulerBindings::add_to_linker::<PluginState, HasSelf<PluginState>>(linker, |s| s)
            })?;
            plugin
                .instantiate(async |s, c, l| SchedulerBindings::instantiate_async(s, c, l).await)
                .map_err(|e| plugin.refused(e))?;
            plugin.report
        }
        // Instantiated with no folder (each checkpoint gets a fresh instance).
        PluginKind::CheckpointHook => load_checkpoint_hook(manifest, "{}")?.report().clone(),
        // Instantiated as for a run (each question gets a fresh instance).
        PluginKind::WrapPolicy => {
            let plugin = Prepared::new(manifest, PluginKind::WrapPolicy, None, |linker| {
                WrapPolicyBindings::add_to_linker::<PluginState, HasSelf<PluginState>>(
                    linker,
                    |s| s,
                )
            })?;
            plugin
                .instantiate(async |s, c, l| WrapPolicyBindings::instantiate_async(s, c, l).await)
                .map_err(|e| plugin.refused(e))?;
            plugin.report
        }
    };
    Ok(report)
}
