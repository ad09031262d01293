//! The tracker adapter: loads a `tracker-plugin` component and calls it so
//! that nothing it does can take training down (fail open).
//!
//! A trap, a missed deadline or a memory-cap hit drops the poisoned store;
//! the next call instantiates a fresh one and replays `start`. An `Err` the
//! tracker returns keeps its store. Each fault is logged with the plugin's
//! name and cause; after [`MAX_FAULTS`] the tracker is disabled.

use super::bindings::tracker::TrackerPlugin as Bindings;
use super::engine::EPOCH_TICK;
use super::inspect::{check_is_component, check_world, report};
use super::sandbox::PluginState;
use super::{Entries, Manifest, PluginEngine, PluginError, PluginKind, RunInfo};
use std::path::{Path, PathBuf};
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Store, Trap};

/// Faults after which a tracker is disabled for the rest of the run.
pub const MAX_FAULTS: u32 = 3;

struct Live {
    store: Store<PluginState>,
    bindings: Bindings,
}

/// A loaded tracker plugin.
pub struct TrackerPlugin {
    manifest: Manifest,
    component: Component,
    linker: Linker<PluginState>,
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
    let name = manifest.name.as_str();
    let path = manifest.component_path();
    if manifest.kind != PluginKind::Tracker {
        return Err(PluginError::Refused {
            name: name.into(),
            path,
            reason: format!("it is a {} plugin, not a tracker", manifest.kind),
        });
    }
    let bytes = std::fs::read(&path).map_err(|source| PluginError::Io {
        path: path.clone(),
        source,
    })?;
    check_is_component(name, &path, &bytes)?;
    let engine = PluginEngine::global();
    let component = engine.compile(name, &path, &bytes)?;
    check_world(
        name,
        &path,
        PluginKind::Tracker,
        &report(engine.engine(), &component),
    )?;

    let mut linker = Linker::new(engine.engine());
    let runtime = |e: wasmtime::Error| PluginError::Runtime {
        name: name.into(),
        message: format!("{e:#}"),
    };
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(runtime)?;
    Bindings::add_to_linker::<PluginState, HasSelf<PluginState>>(&mut linker, |s| s)
        .map_err(runtime)?;
    if manifest.permissions.logging_dir {
        std::fs::create_dir_all(logs).map_err(|source| PluginError::Io {
            path: logs.into(),
            source,
        })?;
    }
    let mut plugin = TrackerPlugin {
        manifest: manifest.clone(),
        component,
        linker,
        logs: logs.into(),
        live: None,
        started: None,
        faults: 0,
        disabled: false,
    };
    // Instantiate now so that a component needing what hearth does not grant
    // is refused at load, not at its first call.
    plugin.live = Some(plugin.instantiate().map_err(|e| PluginError::Refused {
        name: name.into(),
        path: manifest.component_path(),
        reason: format!("{e:#}"),
    })?);
    Ok(plugin)
}

impl TrackerPlugin {
    /// The plugin's name.
    pub fn name(&self) -> &str {
        &self.manifest.name
    }

    /// The folder it writes to.
    pub fn logging_dir(&self) -> &Path {
        &self.logs
    }

    /// Whether repeated faults disabled it.
    pub fn is_disabled(&self) -> bool {
        self.disabled
    }

    /// Faults so far.
    pub fn faults(&self) -> u32 {
        self.faults
    }

    fn instantiate(&self) -> wasmtime::Result<Live> {
        let logs = self
            .manifest
            .permissions
            .logging_dir
            .then_some(self.logs.as_path());
        let state = PluginState::new(self.name(), &self.manifest.limits, logs)?;
        let mut store = Store::new(PluginEngine::global().engine(), state);
        store.limiter(|s| &mut s.limits);
        store.set_epoch_deadline(self.deadline_ticks());
        store.epoch_deadline_trap();
        let bindings = Bindings::instantiate(&mut store, &self.component, &self.linker)?;
        Ok(Live { store, bindings })
    }

    /// Epoch ticks in one call deadline (+1: the current tick may be nearly over).
    fn deadline_ticks(&self) -> u64 {
        let ticks = self
            .manifest
            .limits
            .call_timeout()
            .as_millis()
            .div_ceil(EPOCH_TICK.as_millis());
        ticks as u64 + 1
    }

    /// Begins the run (Accelerate's `store_init_configuration`).
    pub fn start(&mut self, run: RunInfo, config: Entries) {
        self.started = Some((run.clone(), config.clone()));
        self.call("start", |b, s| {
            b.hearth_plugin_tracker().call_start(s, &run, &config)
        });
    }

    /// Logs `values` at `step`.
    pub fn log(&mut self, step: u64, values: &Entries) {
        self.call("log", |b, s| {
            b.hearth_plugin_tracker().call_log(s, step, values)
        });
    }

    /// Ends the run.
    pub fn finish(&mut self) {
        self.call("finish", |b, s| b.hearth_plugin_tracker().call_finish(s));
    }

    fn call(
        &mut self,
        what: &str,
        f: impl FnOnce(&Bindings, &mut Store<PluginState>) -> wasmtime::Result<Result<(), String>>,
    ) {
        if self.disabled {
            return;
        }
        if self.live.is_none() {
            match self.instantiate() {
                Ok(live) => self.live = Some(live),
                Err(e) => return self.fault(what, format!("could not be re-instantiated: {e:#}")),
            }
            // A fresh instance has lost its state: begin the run again.
            if let (Some((run, config)), false) = (self.started.clone(), what == "start") {
                self.invoke("start (replayed after a fault)", |b, s| {
                    b.hearth_plugin_tracker().call_start(s, &run, &config)
                });
                if self.live.is_none() {
                    return;
                }
            }
        }
        self.invoke(what, f);
    }

    /// Calls into the live instance under the deadline; a trap drops it.
    fn invoke(
        &mut self,
        what: &str,
        f: impl FnOnce(&Bindings, &mut Store<PluginState>) -> wasmtime::Result<Result<(), String>>,
    ) {
        let ticks = self.deadline_ticks();
        let Some(live) = self.live.as_mut() else {
            return;
        };
        live.store.set_epoch_deadline(ticks);
        match f(&live.bindings, &mut live.store) {
            Ok(Ok(())) => {}
            Ok(Err(message)) => self.fault(what, format!("returned an error: {message}")),
            Err(trap) => {
                self.live = None;
                let cause = self.describe(&trap);
                self.fault(what, cause);
            }
        }
    }

    fn describe(&self, error: &wasmtime::Error) -> String {
        let limits = &self.manifest.limits;
        let trap = error.downcast_ref::<Trap>();
        if let Some(Trap::Interrupt) = trap {
            return format!(
                "exceeded its call deadline of {} ms",
                limits.call_timeout_ms
            );
        }
        let text = format!("{error:#}");
        if text.contains("growing memory") || text.contains("memory minimum size") {
            return format!("hit its memory cap of {} MiB", limits.memory_mb);
        }
        // The trap code says what happened ("wasm `unreachable` instruction
        // executed" for a Rust panic); the rest of the chain is a backtrace.
        let cause = match trap {
            Some(trap) => trap.to_string(),
            None => error.root_cause().to_string(),
        };
        format!("trapped: {}", super::stdio::clip(&cause, 400))
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
