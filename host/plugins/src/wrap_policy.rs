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
use super::stdio::clip;
use super::{Manifest, PluginError, PluginKind};
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

/// One module of the model a wrap policy is asked about, as the WIT's
/// `module` record describes it (the host builds these from its module
/// tree; this crate knows no model type).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyModule {
    /// Dotted path from the root (`""` for the root).
    pub path: String,
    /// The module's class, named as PyTorch would (`"Linear"`).
    pub kind: String,
    /// Scalar parameters in this module and all below it.
    pub params: u64,
    /// Scalar parameters held by this module itself.
    pub own_params: u64,
    /// Bytes of parameters in this module and all below it.
    pub param_bytes: u64,
    /// Bytes of buffers in this module and all below it.
    pub buffer_bytes: u64,
    /// The index of the parent module in the same list; `None` for the root.
    pub parent: Option<usize>,
}

/// The modules as the WIT hands them over.
fn wit_modules(modules: &[PolicyModule]) -> Vec<Module> {
    modules
        .iter()
        .map(|m| Module {
            path: m.path.clone(),
            kind: m.kind.clone(),
            params: m.params,
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

    /// The module paths the policy wraps among `modules`, from
    /// `options_json` (a JSON object; the manifest's `[presets]` are
    /// added), in a fresh instance. Every path is checked to be one of
    /// `modules`.
    pub fn units(
        &self,
        options_json: &str,
        modules: &[PolicyModule],
    ) -> Result<Vec<String>, PluginError> {
        let fault = |cause: String| PluginError::Runtime {
            name: self.name().into(),
            message: format!("wrap policy failed: {cause}"),
        };
        let options = self.manifest.options_json(options_json)?;
        let plugin = &self.plugin;
        let (mut store, bindings) = plugin
            .instantiate(async |s, c, l| Bindings::instantiate_async(s, c, l).await)
            .map_err(|e| plugin.refused(e))?;
        plugin.arm(&mut store);
        let guest = bindings.hearth_plugin_wrap_policy();
        let wit = wit_modules(modules);
        let answer = plugin.run(guest.call_units(&mut store, &options, &wit));
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
        if let Some(bad) = paths
            .iter()
            .find(|p| !modules.iter().any(|m| &&m.path == p))
        {
            return Err(fault(format!(
                "it named `{}`, which is not a module of the model (`hearth model plan` lists them)",
                clip(bad, 200)
            )));
        }
        Ok(paths)
    }
}
