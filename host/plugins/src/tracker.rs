//! The tracker adapter: calls a `tracker-plugin` component so that nothing
//! it does can take training down (fail open).
//!
//! A trap, a missed deadline or a memory-cap hit drops the poisoned store;
//! the next call instantiates a fresh one and replays `start`. An `Err` the
//! tracker returns keeps its store. Each fault is logged with the plugin's
//! name and cause; after [`MAX_FAULTS`] the tracker is disabled.

use super::bindings::tracker::TrackerPlugin as Bindings;
use super::runtime::Prepared;
use super::sandbox::PluginState;
use super::stdio::clip;
use super::{Entries, Manifest, PluginError, PluginKind, RunInfo};
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
    started: Option<(RunInfo, Entries)>,
    faults: u32,
    disabled: bool,
}

/// Loads the tracker `manifest` describes, with `logs` (created if needed)
/// as its logging folder. Refuses core modules, components of another world
/// or WIT version, and components that need capabilities hearth does not grant.
pub fn load_tracker(manifest: &Manifest, logs: &Path) -> Result<TrackerPlugin, PluginError> {
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
        faults: 0,
        disabled: false,
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
        self.disabled
    }

    /// Faults so far.
    pub fn faults(&self) -> u32 {
        self.faults
    }

    /// The limit on one call, from its manifest.
    pub fn call_timeout(&self) -> std::time::Duration {
        self.plugin.manifest.limits.call_timeout()
    }

    /// Begins the run (Accelerate's `store_init_configuration`).
    pub fn start(&mut self, run: RunInfo, config: Entries) {
        self.call("start", Call::Start(&run, &config));
        self.started = Some((run, config));
    }

    /// Logs `values` at `step`.
    pub fn log(&mut self, step: u64, values: &Entries) {
        self.call("log", Call::Log(step, values));
    }

    /// Ends the run, then removes any symbolic link it left in its folder:
    /// the sandbox never follows one out, but host tools (tar -h, uploaders)
    /// would, so a tracker's folder holds files and folders only.
    pub fn finish(&mut self) {
        self.call("finish", Call::Finish);
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

    fn call(&mut self, what: &str, call: Call<'_>) {
        if self.disabled {
            return;
        }
        if self.live.is_none() {
            match instantiate(&self.plugin) {
                Ok(live) => self.live = Some(live),
                Err(e) => {
                    let cause =
                        format!("could not be re-instantiated: {}", self.plugin.describe(&e));
                    return self.fault(what, cause);
                }
            }
            // A fresh instance has lost its state: begin the run again.
            if let (Some((run, config)), false) = (self.started.take(), what == "start") {
                self.invoke("start (replayed after a fault)", Call::Start(&run, &config));
                self.started = Some((run, config));
                if self.live.is_none() {
                    return;
                }
            }
        }
        self.invoke(what, call);
    }

    /// Calls into the live instance under the deadline; a trap or timeout drops it.
    fn invoke(&mut self, what: &str, call: Call<'_>) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        let (plugin, store) = (&self.plugin, &mut live.store);
        let tracker = live.bindings.hearth_plugin_tracker();
        plugin.arm(store);
        let result = plugin.run(async {
            match call {
                Call::Start(run, config) => tracker.call_start(store, run, config).await,
                Call::Log(step, values) => tracker.call_log(store, step, values).await,
                Call::Finish => tracker.call_finish(store).await,
            }
        });
        match result {
            Ok(Ok(())) => {}
            Ok(Err(message)) => self.fault(
                what,
                format!("returned an error: {}", clip(&message, MAX_MESSAGE)),
            ),
            Err(trap) => {
                self.live = None;
                let cause = self.plugin.describe(&trap);
                self.fault(what, cause);
            }
        }
    }

    fn fault(&mut self, what: &str, cause: String) {
        self.faults += 1;
        tracing::warn!(
            "tracker plugin `{}` failed in {what}: {cause}; training goes on",
            self.name()
        );
        if self.faults >= MAX_FAULTS {
            self.disabled = true;
            self.live = None;
            tracing::warn!(
                "tracker plugin `{}` disabled after {} faults",
                self.name(),
                self.faults
            );
        }
    }
}
