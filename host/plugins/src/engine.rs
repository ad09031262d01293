//! The process-wide wasmtime engine: component model, epoch interruption
//! driven by a ticker thread, and the on-disk compile cache.
//!
//! The ticker advances the epoch only while a plugin call is in flight and
//! sleeps otherwise: waking 100 times a second on a machine whose cores the
//! training threads keep busy would preempt them for nothing.

use super::{ComponentCache, PluginError};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;
use wasmtime::component::Component;
use wasmtime::{Config, Engine};

/// How often the epoch advances; deadlines are whole ticks.
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Plugin calls (and instantiations) in flight, on any thread.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// One wasmtime engine per process, shared by every plugin.
pub struct PluginEngine {
    engine: Engine,
    cache: Option<ComponentCache>,
    ticker: std::thread::Thread,
}

/// A call in flight: the epoch advances while one lives.
pub(crate) struct Ticking(());

impl Drop for Ticking {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

impl PluginEngine {
    /// The engine, created (with its ticker thread) on first use.
    pub fn global() -> &'static PluginEngine {
        static ENGINE: OnceLock<PluginEngine> = OnceLock::new();
        ENGINE.get_or_init(|| {
            let mut config = Config::new();
            config.wasm_component_model(true).epoch_interruption(true);
            let engine =
                Engine::new(&config).expect("the plugin engine's static configuration is valid");
            let weak = engine.weak();
            let ticker = std::thread::Builder::new()
                .name("hearth-plugin-epoch".into())
                .spawn(move || {
                    while let Some(engine) = weak.upgrade() {
                        if IN_FLIGHT.load(Ordering::SeqCst) == 0 {
                            drop(engine);
                            // `ticking` unparks it (an unpark before this
                            // park makes it return at once).
                            std::thread::park();
                            continue;
                        }
                        engine.increment_epoch();
                        drop(engine);
                        std::thread::sleep(EPOCH_TICK);
                    }
                })
                .expect("spawn the epoch ticker")
                .thread()
                .clone();
            let cache =
                ComponentCache::default_location().map(|dir| ComponentCache::new(dir, &engine));
            PluginEngine {
                engine,
                cache,
                ticker,
            }
        })
    }

    /// The wasmtime engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Keeps the epoch advancing while the returned guard lives (a call
    /// deadline counts epoch ticks); hold it around every call into a plugin.
    pub(crate) fn ticking(&self) -> Ticking {
        if IN_FLIGHT.fetch_add(1, Ordering::SeqCst) == 0 {
            self.ticker.unpark();
        }
        Ticking(())
    }

    /// Compiles the component in `bytes` (read from `path`), through the
    /// cache when there is one.
    pub fn compile(&self, name: &str, path: &Path, bytes: &[u8]) -> Result<Component, PluginError> {
        let compile = || {
            Component::new(&self.engine, bytes).map_err(|e| PluginError::Refused {
                name: name.into(),
                path: path.into(),
                reason: format!("not a valid component: {e:#}"),
            })
        };
        match &self.cache {
            Some(cache) => cache.get_or_compile(&self.engine, bytes, compile),
            None => compile(),
        }
    }
}
