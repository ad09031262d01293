//! The tracker adapter: calls a `tracker-plugin` component so that nothing
//! it does can take training down (fail open).
//!
//! The fault contract is the WIT's (`interface tracker`): a trap, a missed
//! deadline or a memory-cap hit drops the poisoned store; a fresh instance
//! is made at once, gets `start` with `restart` set, and the call that
//! faulted is delivered to it once more. An `Err` the tracker returns keeps
//! its store and is not delivered again. Each fault is logged with the
//! plugin's name and cause and kept in [`TrackerHealth`]; after
//! [`MAX_FAULTS`] the tracker is disabled and what is logged later is
//! counted as dropped.

use super::bindings::tracker::exports::hearth::plugin::tracker::Restart;
use super::bindings::tracker::TrackerPlugin as Bindings;
use super::runtime::{FaultKind, Prepared};
use super::sandbox::PluginState;
use super::stdio::clip;
use super::{Entries, Manifest, PluginError, PluginKind, RunInfo};
use crate::sandbox::DeliveryCounts;
use std::path::{Path, PathBuf};
use wasmtime::component::HasSelf;
use wasmtime::Store;

/// Faults after which a tracker is disabled for the rest of the run.
pub const MAX_FAULTS: u32 = 3;

/// Longest error message from a tracker that reaches the log.
const MAX_MESSAGE: usize = 1000;

struct Live {
    store: Store<PluginState>,
    bindings: Bindings,
}

/// A loaded tracker plugin.
pub struct TrackerPlugin {
    plugin: Prepared,
    logs: PathBuf,
    live: Option<Live>,
    /// What `start` was given (run, config), for the restarts.
    started: Option<(RunInfo, Entries)>,
    /// Its options, from the run config, checked against its manifest.
    options: Entries,
    /// The step of the last `log` call.
    last_step: Option<u64>,
    /// `log` calls so far.
    log_calls: u64,
    /// The index among the `log` calls of the last one that faulted.
    fault_index: Option<u64>,
    health: TrackerHealth,
}

/// What went wrong with one tracker over a run (in `summary.json`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TrackerHealth {
    /// The tracker's name.
    pub name: String,
    /// Each fault, in order.
    pub faults: Vec<TrackerFault>,
    /// Fresh instances started after a fault.
    pub restarts: u32,
    /// Logged values (name and value pairs) it never received: those of a
    /// call that faulted twice, and all logged after it was disabled.
    pub values_dropped: u64,
    /// The step of the call after which it was disabled, if it was.
    pub disabled_at_step: Option<u64>,
    /// For a tracker that asks for hosts: the requests its gate let
    /// through, refused and cut.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::network::NetworkCounts>,
    /// What the tracker last reported of its deliveries (a tracker that
    /// sends to a service through the guest SDK's outbox), if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delivery: Option<DeliveryCounts>,
}

/// One fault of a tracker.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TrackerFault {
    /// The call: `start`, `log` or `finish`.
    pub call: &'static str,
    /// Its step, for `log`.
    pub step: Option<u64>,
    /// What happened.
    pub kind: FaultKind,
    /// The host's description of it.
    pub message: String,
}

/// Loads the tracker `manifest` describes, with `logs` (created if needed)
/// as its logging folder and its declared options' defaults. Refuses core
/// modules, components of another world or WIT version, and components
/// that need capabilities hearth does not grant.
pub fn load_tracker(manifest: &Manifest, logs: &Path) -> Result<TrackerPlugin, PluginError> {
    load_tracker_with(manifest, logs, &toml::Table::new())
}

/// [`load_tracker`] with `options` (a `[[trackers]]` table less `name`),
/// checked against the options its manifest declares: an unknown key or a
/// wrong type is refused, naming the plugin and the key.
pub fn load_tracker_with(
    manifest: &Manifest,
    logs: &Path,
    options: &toml::Table,
) -> Result<TrackerPlugin, PluginError> {
    let options = super::options::entries(&manifest.checked_options(options)?)
        .map_err(|(key, message)| manifest.option_error(&key, message))?;
    let plugin = Prepared::new(manifest, PluginKind::Tracker, Some(logs), |linker| {
        Bindings::add_to_linker::<PluginState, HasSelf<PluginState>>(linker, |s| s)
    })?;
    // Instantiate now so that a component needing what hearth does not grant
    // is refused at load, not at its first call.
    let live = instantiate(&plugin).map_err(|e| plugin.refused(e))?;
    Ok(TrackerPlugin {
        plugin,
        logs: logs.into(),
        live: Some(live),
        started: None,
        options,
        last_step: None,
        log_calls: 0,
        fault_index: None,
        health: TrackerHealth {
            name: manifest.name.clone(),
            ..TrackerHealth::default()
        },
    })
}

fn instantiate(plugin: &Prepared) -> wasmtime::Result<Live> {
    let (store, bindings) =
        plugin.instantiate(async |s, c, l| Bindings::instantiate_async(s, c, l).await)?;
    Ok(Live { store, bindings })
}

/// Removes every symbolic link under `dir`, noting each with its target.
fn remove_links(dir: &Path, removed: &mut Vec<(PathBuf, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let target = std::fs::read_link(&path).unwrap_or_default();
                if std::fs::remove_file(&path).is_ok() {
                    removed.push((path, target));
                }
            }
            Ok(meta) if meta.is_dir() => remove_links(&path, removed),
            _ => {}
        }
    }
}

/// One call into the tracker interface.
#[derive(Clone, Copy)]
enum Call<'a> {
    Start(&'a RunInfo, &'a Entries),
    Log(u64, &'a Entries),
    Finish,
}

impl Call<'_> {
    fn name(self) -> &'static str {
        match self {
            Call::Start(..) => "start",
            Call::Log(..) => "log",
            Call::Finish => "finish",
        }
    }

    fn step(self) -> Option<u64> {
        match self {
            Call::Log(step, _) => Some(step),
            _ => None,
        }
    }

    /// The logged values it carries.
    fn values(self) -> u64 {
        match self {
            Call::Log(_, values) => values.len() as u64,
            _ => 0,
        }
    }
}

/// How one invocation ended.
enum Outcome {
    /// `ok`, or an `err` (a fault that keeps the instance).
    Kept,
    /// A trap, deadline or memory hit: the instance is gone.
    Dropped,
}

impl TrackerPlugin {
    /// The plugin's name.
    pub fn name(&self) -> &str {
        self.plugin.name()
    }

    /// The folder it writes to.
    pub fn logging_dir(&self) -> &Path {
        &self.logs
    }

    /// What its component exports and imports.
    pub(crate) fn report(&self) -> &super::ComponentReport {
        &self.plugin.report
    }

    /// Whether repeated faults disabled it.
    pub fn is_disabled(&self) -> bool {
        self.health.disabled_at_step.is_some()
    }

    /// Faults so far.
    pub fn faults(&self) -> u32 {
        self.health.faults.len() as u32
    }

    /// Its faults, restarts and lost values so far, and its requests if it
    /// asks for hosts.
    pub fn health(&self) -> TrackerHealth {
        let mut health = self.health.clone();
        if !self.plugin.manifest.permissions.network.is_empty() {
            health.network = Some(self.plugin.gate.counts());
        }
        health
    }

    /// The limit on one call, from its manifest.
    pub fn call_timeout(&self) -> std::time::Duration {
        self.plugin.manifest.limits.call_timeout()
    }

    /// Begins the run (Accelerate's `store_init_configuration`).
    pub fn start(&mut self, run: RunInfo, config: Entries) {
        self.started = Some((run.clone(), config.clone()));
        self.call(Call::Start(&run, &config));
    }

    /// Logs `values` at `step`.
    pub fn log(&mut self, step: u64, values: &Entries) {
        self.last_step = Some(step);
        self.log_calls += 1;
        self.call(Call::Log(step, values));
    }

    /// Ends the run, then removes any symbolic link it left in its folder:
    /// the sandbox never follows one out, but host tools (tar -h, uploaders)
    /// would, so a tracker's folder holds files and folders only.
    pub fn finish(&mut self) {
        self.call(Call::Finish);
        let mut removed = Vec::new();
        remove_links(&self.logs, &mut removed);
        if let Some((link, target)) = removed.first() {
            tracing::warn!(
                "tracker plugin `{}` left {} symbolic link(s) in {} (e.g. {} -> {}); removed them",
                self.name(),
                removed.len(),
                self.logs.display(),
                link.display(),
                target.display()
            );
        }
    }

    /// Delivers `call` under the contract: on a dropped instance, a fresh
    /// one is started and gets the call once more; if that fails too, its
    /// values are lost and one more instance is started to go on with.
    fn call(&mut self, call: Call<'_>) {
        if self.is_disabled() {
            self.health.values_dropped += call.values();
            return;
        }
        // A restart that could not be made after the last fault: make it now.
        if self.live.is_none() && !self.restart(false) {
            self.health.values_dropped += call.values();
            return;
        }
        if let Outcome::Kept = self.invoke(call, None) {
            return;
        }
        if self.is_disabled() || !self.restart(true) {
            self.health.values_dropped += call.values();
            return;
        }
        if let Call::Start(..) = call {
            return; // the restart's `start` was its second delivery
        }
        if let Outcome::Dropped = self.invoke(call, None) {
            self.health.values_dropped += call.values();
            if !self.is_disabled() {
                self.restart(false);
            }
        }
    }

    /// A fresh instance, begun with `start` and `restart` set, after the
    /// last fault dropped the previous one; `again` tells the tracker the
    /// call that faulted comes next. False if it could not be made or begun.
    fn restart(&mut self, again: bool) -> bool {
        match instantiate(&self.plugin) {
            Ok(live) => self.live = Some(live),
            Err(e) => {
                let cause = format!("could not be re-instantiated: {}", self.plugin.describe(&e));
                let (call, step) = self.last_fault();
                self.fault(call, step, FaultKind::Instantiate, cause);
                return false;
            }
        }
        let Some((run, config)) = self.started.clone() else {
            return true; // the run has not begun: `start` comes next
        };
        self.health.restarts += 1;
        let (call, step) = self.last_fault();
        let restart = Restart {
            count: self.health.restarts,
            call: call.into(),
            step,
            log_index: step.and(self.fault_index),
            again,
            values_lost: self.health.values_dropped,
        };
        let begun = self.invoke(Call::Start(&run, &config), Some(restart));
        matches!(begun, Outcome::Kept) && self.live.is_some()
    }

    /// The call and step of the last fault.
    fn last_fault(&self) -> (&'static str, Option<u64>) {
        self.health
            .faults
            .last()
            .map(|f| (f.call, f.step))
            .unwrap_or(("start", None))
    }

    /// Calls into the live instance under the deadline; a trap or timeout drops it.
    fn invoke(&mut self, call: Call<'_>, restart: Option<Restart>) -> Outcome {
        let Some(live) = self.live.as_mut() else {
            return Outcome::Dropped;
        };
        let (plugin, store, options) = (&self.plugin, &mut live.store, &self.options);
        let tracker = live.bindings.hearth_plugin_tracker();
        plugin.arm(store);
        let result = plugin.run(async {
            match call {
                Call::Start(run, config) => {
                    tracker
                        .call_start(store, run, config, options, restart.as_ref())
                        .await
                }
                Call::Log(step, values) => tracker.call_log(store, step, values).await,
                Call::Finish => tracker.call_finish(store).await,
            }
        });
        // Reported during the call, also by one that then faulted.
        if let Some(counts) = live.store.data_mut().delivery.take() {
            self.health.delivery = Some(counts);
        }
        match result {
            Ok(Ok(())) => Outcome::Kept,
            Ok(Err(message)) => {
                let cause = format!("returned an error: {}", clip(&message, MAX_MESSAGE));
                self.fault(call.name(), call.step(), FaultKind::Error, cause);
                Outcome::Kept
            }
            Err(trap) => {
                self.live = None;
                let (kind, cause) = (self.plugin.fault_kind(&trap), self.plugin.describe(&trap));
                self.fault(call.name(), call.step(), kind, cause);
                Outcome::Dropped
            }
        }
    }

    fn fault(&mut self, call: &'static str, step: Option<u64>, kind: FaultKind, cause: String) {
        if call == "log" {
            self.fault_index = Some(self.log_calls - 1);
        }
        let at = step.map(|s| format!(" at step {s}")).unwrap_or_default();
        tracing::warn!(
            "tracker plugin `{}` failed in {call}{at}: {cause}; training goes on",
            self.name(),
        );
        self.health.faults.push(TrackerFault {
            call,
            step,
            kind,
            message: cause,
        });
        if self.health.faults.len() as u32 >= MAX_FAULTS {
            self.live = None;
            self.health.disabled_at_step = Some(step.or(self.last_step).unwrap_or(0));
            tracing::warn!(
                "tracker plugin `{}` disabled after {} faults; it gets no further call, \
                 and summary.json counts the values it misses",
                self.name(),
                MAX_FAULTS
            );
        }
    }
}
