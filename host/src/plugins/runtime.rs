//! The kind-independent half of every adapter: read and check the component,
//! compile it (through the cache), link WASI and the world's imports, make
//! sandboxed stores, call under the deadline, and say why a call failed.

use super::engine::EPOCH_TICK;
use super::inspect::{check_is_component, check_world, report};
use super::sandbox::PluginState;
use super::{Manifest, PluginEngine, PluginError, PluginKind};
use std::path::{Path, PathBuf};
use wasmtime::component::{Component, Linker};
use wasmtime::{Store, Trap};

/// A plugin compiled and linked, ready to instantiate any number of times.
pub(crate) struct Prepared {
    pub(crate) manifest: Manifest,
    pub(crate) component: Component,
    pub(crate) linker: Linker<PluginState>,
    /// The folder preopened for it (a tracker's logging folder), if any.
    files: Option<PathBuf>,
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
        let bytes = std::fs::read(&path).map_err(|source| PluginError::Io {
            path: path.clone(),
            source,
        })?;
        check_is_component(name, &path, &bytes)?;
        let engine = PluginEngine::global();
        let component = engine.compile(name, &path, &bytes)?;
        check_world(name, &path, kind, &report(engine.engine(), &component))?;

        let mut linker = Linker::new(engine.engine());
        let runtime = |e: wasmtime::Error| PluginError::Runtime {
            name: name.into(),
            message: format!("{e:#}"),
        };
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(runtime)?;
        add_world(&mut linker).map_err(runtime)?;
        let files = files
            .filter(|_| manifest.permissions.logging_dir)
            .map(Path::to_path_buf);
        if let Some(dir) = &files {
            std::fs::create_dir_all(dir).map_err(|source| PluginError::Io {
                path: dir.clone(),
                source,
            })?;
        }
        Ok(Self {
            manifest: manifest.clone(),
            component,
            linker,
            files,
        })
    }

    /// The plugin's name.
    pub(crate) fn name(&self) -> &str {
        &self.manifest.name
    }

    /// A fresh sandboxed store: memory cap, no network, its folder only.
    pub(crate) fn store(&self) -> wasmtime::Result<Store<PluginState>> {
        let state = PluginState::new(self.name(), &self.manifest.limits, self.files.as_deref())?;
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

    /// Runs `f` on `store` with a fresh call deadline.
    pub(crate) fn call<T>(
        &self,
        store: &mut Store<PluginState>,
        f: impl FnOnce(&mut Store<PluginState>) -> wasmtime::Result<T>,
    ) -> wasmtime::Result<T> {
        store.set_epoch_deadline(self.deadline_ticks());
        f(store)
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
