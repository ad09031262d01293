//! The wrap-policy adapter: one sandboxed instance of a
//! `wrap-policy-plugin` component, asked once which modules of a model
//! become sharding units.
//!
//! A wrap policy fails closed: a trap, a missed deadline, a memory-cap
//! hit, an `Err`, or an answer naming a path that is not a module of the
//! model is a [`PluginError::Runtime`] naming the plugin, and sharding
//! does not start (the run stops before its first step).

use super::bindings::wrap_policy::exports::hearth::plugin::wrap_policy::Module;
use super::bindings::wrap_policy::WrapPolicyPlugin as Bindings;
use super::runtime::Prepared;
use super::sandbox::PluginState;
use super::scheduler::with_presets;
use super::stdio::clip;
use super::{Manifest, PluginError, PluginKind};
use crate::models::ModuleTree;
use wasmtime::component::HasSelf;

/// Longest error message from a policy that is reported.
const MAX_MESSAGE: usize = 1000;

/// A loaded wrap policy.
pub struct WrapPolicyPlugin {
    plugin: Prepared,
    manifest: Manifest,
}

/// Loads the wrap policy `manifest` describes (compiled and checked; it is
/// instantiated by [`WrapPolicyPlugin::units`]).
pub fn load_wrap_policy(manifest: &Manifest) -> Result<WrapPolicyPlugin, PluginError> {
    let plugin = Prepared::new(manifest, PluginKind::WrapPolicy, None, |linker| {
        Bindings::add_to_linker::<PluginState, HasSelf<PluginState>>(linker, |s| s)
    })?;
    Ok(WrapPolicyPlugin {
        plugin,
        manifest: manifest.clone(),
    })
}

/// The module tree as the WIT hands it over.
fn modules(tree: &ModuleTree) -> Vec<Module> {
    tree.modules()
        .iter()
        .map(|m| Module {
            path: m.path.clone(),
            kind: m.kind.clone(),
            params: m.num_params,
            own_params: m.own_params,
            param_bytes: m.param_bytes,
            buffer_bytes: m.buffer_bytes,
            parent: m.parent.map(|p| p as u32),
        })
        .collect()
}

impl WrapPolicyPlugin {
    /// The plugin's name.
    pub fn name(&self) -> &str {
        self.plugin.name()
    }

    /// The module paths the policy wraps in `tree`, from `options_json` (a
    /// JSON object; the manifest's `[options]` presets are added), in a
    /// fresh instance. Every path is checked to be a module of `tree`.
    pub fn units(&self, options_json: &str, tree: &ModuleTree) -> Result<Vec<String>, PluginError> {
        let fault = |cause: String| PluginError::Runtime {
            name: self.name().into(),
            message: format!("wrap policy failed: {cause}"),
        };
        let options = with_presets(&self.manifest, options_json)?;
        let plugin = &self.plugin;
        let (mut store, bindings) = plugin
            .instantiate(async |s, c, l| Bindings::instantiate_async(s, c, l).await)
            .map_err(|e| plugin.refused(e))?;
        plugin.arm(&mut store);
        let guest = bindings.hearth_plugin_wrap_policy();
        let modules = modules(tree);
        let answer = plugin.run(guest.call_units(&mut store, &options, &modules));
        let paths = match answer {
            Ok(Ok(paths)) => paths,
            Ok(Err(message)) => {
                return Err(fault(format!(
                    "it returned an error: {}",
                    clip(&message, MAX_MESSAGE)
                )))
            }
            Err(trap) => return Err(fault(plugin.describe(&trap))),
        };
        if let Some(bad) = paths.iter().find(|p| tree.get(p).is_none()) {
            return Err(fault(format!(
                "it named `{}`, which is not a module of the model (`hearth model plan` lists them)",
                clip(bad, 200)
            )));
        }
        Ok(paths)
    }
}
