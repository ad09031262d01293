//! The kind-independent half of every adapter: read and check the component,
//! compile it (through the cache), link WASI and the world's imports, make
//! sandboxed stores, call under the deadline, and say why a call failed.
//!
//! Every call (and instantiation) has two clocks: the epoch deadline traps
//! a guest running wasm, and a host timer abandons a guest blocked inside a
//! host call (a WASI clock poll) — calls are async, so dropping the call
//! cancels the wait. Either way the store is poisoned and must be dropped.

use super::engine::EPOCH_TICK;
use super::inspect::{check_is_component, check_world, report};
use super::network::HttpGate;
use super::quota::{HasQuotaFs, Quota};
use super::sandbox::{Grants, PluginState, Preopen};
use super::stdio::OutputBudget;
use super::usage::Phase;
use super::{ComponentReport, Manifest, PluginEngine, PluginError, PluginKind};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use wasmtime::component::{Component, Linker};
use wasmtime::{Store, Trap};

/// How long a thread of a plugin's blocking pool (WASI's file calls) stays
/// once idle: tokio's default of 10 s kept every thread a burst ever needed
/// alive through a run whose plugins are called every few seconds.
const IDLE_THREAD_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(2);

/// A call abandoned by the host timer (the guest was blocked in a host call).
#[derive(Debug, thiserror::Error)]
#[error("the call did not return within its deadline")]
pub(crate) struct CallTimedOut;

/// How a call into a plugin failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// It trapped (a Rust panic, an `unreachable`, an out-of-bounds access).
    Trap,
    /// It missed its call deadline.
    Timeout,
    /// It hit its memory cap.
    Memory,
    /// It returned an `err`.
    Error,
    /// A fresh instance could not be made.
    Instantiate,
}

/// A plugin compiled and linked, ready to instantiate any number of times.
pub(crate) struct Prepared {
    pub(crate) manifest: Manifest,
    pub(crate) component: Component,
    pub(crate) linker: Linker<PluginState>,
    /// What the component exports and imports.
    pub(crate) report: ComponentReport,
    /// The folder preopened for it (a tracker's logging folder), if any.
    files: Option<PathBuf>,
    /// Drives its async calls on the calling thread.
    runtime: tokio::runtime::Runtime,
    /// The quota of its logging folder.
    logs_quota: Option<Arc<Quota>>,
    /// Its stdout and stderr budget, over every store.
    budget: Arc<OutputBudget>,
    /// Its `wasi:http` gate, over every store.
    pub(crate) gate: HttpGate,
}

impl Prepared {
    /// Checks that `manifest` describes a component of `kind` this host can
    /// run, compiles it and links WASI plus the world's imports
    /// (`add_world`). `files` is preopened for it if its manifest allows.
    pub(crate) fn new(
        manifest: &Manifest,
        kind: PluginKind,
        files: Option<&Path>,
        add_world: impl FnOnce(&mut Linker<PluginState>) -> wasmtime::Result<()>,
    ) -> Result<Self, PluginError> {
        let name = manifest.name.as_str();
        let path = manifest.component_path();
        if manifest.kind != kind {
            return Err(PluginError::Refused {
                name: name.into(),
                path,
                reason: format!("it is a {} plugin, not a {kind}", manifest.kind),
            });
        }
        let bytes = manifest.component_bytes()?;
        if let Some(pin) = &manifest.pin {
            super::pin::check_pin(name, &path, pin, &bytes)?;
        }
        check_is_component(name, &path, &bytes)?;
        let engine = PluginEngine::global();
        let component = engine.compile(name, &path, &bytes)?;
        let report = report(engine.engine(), &component);
        let asks_network = !manifest.permissions.network.is_empty();
        check_world(
            name,
            &path,
            kind,
            manifest.world_version(),
            &report,
            asks_network,
        )?;

        let runtime = |e: wasmtime::Error| PluginError::Runtime {
            name: name.into(),
            message: format!("{e:#}"),
        };
        let linker = linker_for(kind, asks_network, add_world).map_err(runtime)?;
        // WASI's file calls run on the executor's blocking pool. tokio keeps
        // an idle pool thread for 10 s, so calls every few seconds (a
        // checkpoint hook, a tracker) keep every thread a burst ever needed
        // alive for the whole run (the hour-long soak saw 0 grow to 5).
        // Idle threads now go after 2 s ([`IDLE_THREAD_KEEP_ALIVE`]), and a
        // plugin's pool is capped. They are named after the plugin
        // (`plugin-<name>`, the first 15 bytes in `ps` and /proc), so that
        // a thread list shows whose they are.
        let executor = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .enable_io()
            .thread_name(format!("plugin-{name}"))
            .thread_keep_alive(IDLE_THREAD_KEEP_ALIVE)
            .max_blocking_threads(8)
            .build()
            .map_err(|e| PluginError::Runtime {
                name: name.into(),
                message: format!("cannot start its executor: {e}"),
            })?;
        let files = files
            .filter(|_| manifest.permissions.logging_dir)
            .map(Path::to_path_buf);
        if let Some(dir) = &files {
            std::fs::create_dir_all(dir).map_err(|source| PluginError::Io {
                path: dir.clone(),
                source,
            })?;
        }
        let limits = &manifest.limits;
        let logs_quota = files.as_deref().map(|dir| {
            Quota::new(
                dir,
                limits.disk_mb.saturating_mul(1 << 20),
                limits.files,
                false,
            )
        });
        let gate = HttpGate::new(
            name.into(),
            manifest.granted.network.clone(),
            manifest.granted.private_addresses,
            limits,
        );
        Ok(Self {
            gate,
            budget: OutputBudget::new(name.into(), limits),
            logs_quota,
            manifest: manifest.clone(),
            component,
            linker,
            report,
            files,
            runtime: executor,
        })
    }

    /// The plugin's name.
    pub(crate) fn name(&self) -> &str {
        &self.manifest.name
    }

    /// A fresh sandboxed store: memory cap, the hosts and environment
    /// variables granted, its folder only
    /// (`files`, else the logging folder it was prepared with).
    pub(crate) fn store(&self, files: Option<Preopen<'_>>) -> wasmtime::Result<Store<PluginState>> {
        let limits = &self.manifest.limits;
        // A folder given for this store (a checkpoint being written): what
        // the plugin adds to it is capped, not what the host writes.
        let quota = match files {
            Some(f) if f.writable => Some(Quota::new(
                f.host,
                limits.disk_mb.saturating_mul(1 << 20),
                limits.files,
                true,
            )),
            Some(_) => None,
            None => self.logs_quota.clone(),
        };
        let files = files.or(self.files.as_deref().map(Preopen::logs));
        // A tracker is called from the tracker thread, whose hang the hub
        // already bounds (it drops values while full and gives up at finish):
        // its file I/O may block that thread.
        let on_thread = self.manifest.kind == PluginKind::Tracker;
        let state = PluginState::new(
            self.name(),
            limits,
            files,
            quota,
            self.budget.clone(),
            on_thread,
            Grants {
                gate: self.gate.clone(),
                env: &self.manifest.granted.env,
            },
        )?;
        let mut store = Store::new(PluginEngine::global().engine(), state);
        store.limiter(|s| &mut s.limits);
        store.set_epoch_deadline(self.deadline_ticks());
        store.epoch_deadline_trap();
        Ok(store)
    }

    /// A refusal at load, for an instantiation that failed (an import the
    /// host does not grant, a start function that trapped).
    pub(crate) fn refused(&self, error: wasmtime::Error) -> PluginError {
        PluginError::Refused {
            name: self.name().into(),
            path: self.manifest.component_path(),
            reason: format!("{error:#}"),
        }
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

    /// Arms `store`'s epoch deadline (and the output budget) for one call.
    pub(crate) fn arm(&self, store: &mut Store<PluginState>) {
        self.budget.start_call();
        store.set_epoch_deadline(self.deadline_ticks());
    }

    /// Runs one call (or instantiation) of an armed store to completion, or
    /// abandons it when the host timer runs out (two ticks after the epoch
    /// deadline, which catches a guest running wasm first).
    pub(crate) fn run<T>(
        &self,
        call: impl Future<Output = wasmtime::Result<T>>,
    ) -> wasmtime::Result<T> {
        self.run_timed(Phase::Call, call)
    }

    /// [`run`](Self::run), counted in the plugin's usage as `phase`.
    fn run_timed<T>(
        &self,
        phase: Phase,
        call: impl Future<Output = wasmtime::Result<T>>,
    ) -> wasmtime::Result<T> {
        let limit = self.manifest.limits.call_timeout() + 2 * EPOCH_TICK;
        let _span = hearth_ops::profiler::span_named(|| format!("plugin::{}", self.name()));
        let _ticking = PluginEngine::global().ticking();
        let started = super::usage::start();
        let clock = std::time::Instant::now();
        let result = self.runtime.block_on(async {
            match tokio::time::timeout(limit, call).await {
                Ok(result) => result,
                Err(_) => Err(CallTimedOut.into()),
            }
        });
        super::usage::record(self.manifest.kind.as_str(), self.name(), phase, started);
        tracing::debug!(
            "{} plugin `{}`: {} {} in {:.3} ms",
            self.manifest.kind,
            self.name(),
            match phase {
                Phase::Instantiate => "instantiated",
                Phase::Call => "called",
            },
            if result.is_ok() { "ok" } else { "with a fault" },
            clock.elapsed().as_secs_f64() * 1e3
        );
        result
    }

    /// Instantiates `bindings` in a fresh store under the call deadline.
    pub(crate) fn instantiate<B>(
        &self,
        instantiate: impl AsyncFnOnce(
            &mut Store<PluginState>,
            &Component,
            &Linker<PluginState>,
        ) -> wasmtime::Result<B>,
    ) -> wasmtime::Result<(Store<PluginState>, B)> {
        self.instantiate_in(None, instantiate)
    }

    /// [`instantiate`](Self::instantiate) with `files` as its one folder.
    pub(crate) fn instantiate_in<B>(
        &self,
        files: Option<Preopen<'_>>,
        instantiate: impl AsyncFnOnce(
            &mut Store<PluginState>,
            &Component,
            &Linker<PluginState>,
        ) -> wasmtime::Result<B>,
    ) -> wasmtime::Result<(Store<PluginState>, B)> {
        let mut store = self.store(files)?;
        self.arm(&mut store);
        let bindings = self.run_timed(
            Phase::Instantiate,
            instantiate(&mut store, &self.component, &self.linker),
        )?;
        Ok((store, bindings))
    }

    /// What kind of fault `error` (from a call or an instantiation) was.
    pub(crate) fn fault_kind(&self, error: &wasmtime::Error) -> FaultKind {
        if matches!(error.downcast_ref::<Trap>(), Some(Trap::Interrupt))
            || error.downcast_ref::<CallTimedOut>().is_some()
        {
            return FaultKind::Timeout;
        }
        let text = format!("{error:#}");
        if text.contains("growing memory") || text.contains("memory minimum size") {
            return FaultKind::Memory;
        }
        FaultKind::Trap
    }

    /// Why a call failed, in the user's terms: the deadline, the memory cap,
    /// or the trap.
    pub(crate) fn describe(&self, error: &wasmtime::Error) -> String {
        let limits = &self.manifest.limits;
        let trap = error.downcast_ref::<Trap>();
        if let Some(Trap::Interrupt) = trap {
            return format!(
                "exceeded its call deadline of {} ms",
                limits.call_timeout_ms
            );
        }
        if error.downcast_ref::<CallTimedOut>().is_some() {
            return format!(
                "exceeded its call deadline of {} ms (blocked in a host call)",
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
}

/// The linkers built so far, one per world (and per whether it links
/// `wasi:http`): every plugin of a kind shares its world's, cloned (a
/// clone shares the definitions).
static LINKERS: std::sync::Mutex<Vec<(World, Linker<PluginState>)>> =
    std::sync::Mutex::new(Vec::new());

/// A world as a linker sees it: the kind's, with `wasi:http` or without.
type World = (PluginKind, bool);

/// The linker of `kind`'s world: WASI, the quota-checked filesystem,
/// `wasi:http` when `network`, and the world's own imports (`add_world`);
/// built the first time a plugin of the kind loads, then reused.
fn linker_for(
    kind: PluginKind,
    network: bool,
    add_world: impl FnOnce(&mut Linker<PluginState>) -> wasmtime::Result<()>,
) -> wasmtime::Result<Linker<PluginState>> {
    let mut built = LINKERS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, linker)) = built.iter().find(|(k, _)| *k == (kind, network)) {
        return Ok(linker.clone());
    }
    let mut linker = Linker::new(PluginEngine::global().engine());
    wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
    // The filesystem again, over wasmtime-wasi's: the same calls, under
    // the folder's quota.
    linker.allow_shadowing(true);
    wasmtime_wasi::p2::bindings::filesystem::types::add_to_linker::<PluginState, HasQuotaFs>(
        &mut linker,
        PluginState::quota_fs,
    )?;
    linker.allow_shadowing(false);
    if network {
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker)?;
    }
    add_world(&mut linker)?;
    built.push(((kind, network), linker.clone()));
    Ok(linker)
}

/// How many linkers were built for `kind`'s world (with `wasi:http` or
/// without): at most one each, however many plugins load.
#[doc(hidden)]
pub fn linkers_built(kind: PluginKind, network: bool) -> usize {
    let built = LINKERS.lock().unwrap_or_else(|p| p.into_inner());
    built.iter().filter(|(k, _)| *k == (kind, network)).count()
}
