//! The scheduler adapter: one `schedule` resource inside one sandboxed
//! instance of a `scheduler-plugin` component.
//!
//! Unlike a tracker, a schedule cannot fail open (training needs its rates):
//! a trap, a missed deadline, a memory-cap hit or an `Err` is a
//! [`PluginError::Runtime`] naming the plugin, and the instance is not used
//! again.

use super::bindings::scheduler::exports::hearth::plugin::scheduler::GuestSchedule;
use super::bindings::scheduler::SchedulerPlugin as Bindings;
use super::runtime::Prepared;
use super::sandbox::PluginState;
use super::stdio::clip;
use super::{Manifest, PluginError, PluginKind};
use wasmtime::component::{HasSelf, ResourceAny};
use wasmtime::Store;

/// Longest error message from a scheduler that is reported.
const MAX_MESSAGE: usize = 1000;

/// A live schedule.
pub struct SchedulerPlugin {
    plugin: Prepared,
    store: Store<PluginState>,
    bindings: Bindings,
    schedule: ResourceAny,
    groups: usize,
    poisoned: bool,
}

/// Loads the scheduler `manifest` describes and creates its schedule from
/// `options_json` (a JSON object, plus the manifest's `[presets]`), the
/// optimizer's base rates per parameter group and the total number of
/// steps, when known.
pub fn load_scheduler(
    manifest: &Manifest,
    options_json: &str,
    base_lrs: &[f64],
    total_steps: Option<u64>,
) -> Result<SchedulerPlugin, PluginError> {
    let plugin = Prepared::new(manifest, PluginKind::Scheduler, None, |linker| {
        Bindings::add_to_linker::<PluginState, HasSelf<PluginState>>(linker, |s| s)
    })?;
    let options = manifest.options_json(options_json)?;
    let options_json = options.as_str();
    let (mut store, bindings) = plugin
        .instantiate(async |s, c, l| Bindings::instantiate_async(s, c, l).await)
        .map_err(|e| plugin.refused(e))?;
    plugin.arm(&mut store);
    let guest = bindings.hearth_plugin_scheduler().schedule();
    let created = plugin.run(guest.call_create(&mut store, options_json, base_lrs, total_steps));
    let schedule = match created {
        Ok(Ok(schedule)) => schedule,
        Ok(Err(message)) => {
            return Err(fault(
                &plugin,
                "create",
                format!("returned an error: {}", clip(&message, MAX_MESSAGE)),
            ))
        }
        Err(trap) => return Err(fault(&plugin, "create", plugin.describe(&trap))),
    };
    Ok(SchedulerPlugin {
        plugin,
        store,
        bindings,
        schedule,
        groups: base_lrs.len(),
        poisoned: false,
    })
}

fn fault(plugin: &Prepared, what: &str, cause: String) -> PluginError {
    PluginError::Runtime {
        name: plugin.name().into(),
        message: format!("scheduler failed in {what}: {cause}"),
    }
}

impl SchedulerPlugin {
    /// The plugin's name.
    pub fn name(&self) -> &str {
        self.plugin.name()
    }

    fn call<T>(
        &mut self,
        what: &str,
        f: impl AsyncFnOnce(
            GuestSchedule<'_>,
            ResourceAny,
            &mut Store<PluginState>,
        ) -> wasmtime::Result<T>,
    ) -> Result<T, PluginError> {
        if self.poisoned {
            return Err(fault(&self.plugin, what, "an earlier call trapped".into()));
        }
        let (plugin, store) = (&self.plugin, &mut self.store);
        plugin.arm(store);
        let guest = self.bindings.hearth_plugin_scheduler().schedule();
        plugin.run(f(guest, self.schedule, store)).map_err(|trap| {
            self.poisoned = true;
            fault(&self.plugin, what, self.plugin.describe(&trap))
        })
    }

    /// The learning rate of each parameter group at `step`: exactly one
    /// finite, non-negative rate per group, or an error naming the plugin.
    pub fn lrs(&mut self, step: u64) -> Result<Vec<f64>, PluginError> {
        let lrs = self.call("lrs", async |g, r, s| g.call_lrs(s, r, step).await)?;
        if lrs.len() != self.groups {
            let why = format!(
                "returned {} rates at step {step}, for {} parameter groups",
                lrs.len(),
                self.groups
            );
            return Err(fault(&self.plugin, "lrs", why));
        }
        if let Some(bad) = lrs.iter().find(|lr| !lr.is_finite() || **lr < 0.0) {
            let why =
                format!("returned the rate {bad} at step {step}; rates must be finite and ≥ 0");
            return Err(fault(&self.plugin, "lrs", why));
        }
        Ok(lrs)
    }

    /// Reports a metric (reduce-on-plateau reacts to it).
    pub fn observe(&mut self, metric: f64) -> Result<(), PluginError> {
        self.call("observe", async |g, r, s| {
            g.call_observe(s, r, metric).await
        })
    }

    /// The schedule's state, for a checkpoint.
    pub fn save(&mut self) -> Result<Vec<u8>, PluginError> {
        self.call("save", async |g, r, s| g.call_save(s, r).await)
    }

    /// Restores a state written by [`save`](Self::save).
    pub fn load(&mut self, state: &[u8]) -> Result<(), PluginError> {
        self.call("load", async |g, r, s| g.call_load(s, r, state).await)?
            .map_err(|message| {
                fault(
                    &self.plugin,
                    "load",
                    format!("returned an error: {}", clip(&message, MAX_MESSAGE)),
                )
            })
    }
}
