//! The process-wide wasmtime engine: component model, epoch interruption
//! driven by a ticker thread, and the on-disk compile cache.

use super::{ComponentCache, PluginError};
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;
use wasmtime::component::Component;
use wasmtime::{Config, Engine};

/// How often the epoch advances; deadlines are whole ticks.
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(10);

/// One wasmtime engine per process, shared by every plugin.
pub struct PluginEngine {
    engine: Engine,
    cache: Option<ComponentCache>,
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
            let ticker = engine.weak();
            std::thread::Builder::new()
                .name("hearth-plugin-epoch".into())
                .spawn(move || {
                    while let Some(engine) = ticker.upgrade() {
                        engine.increment_epoch();
                        drop(engine);
                        std::thread::sleep(EPOCH_TICK);
                    }
                })
                .expect("spawn the epoch ticker");
            let cache =
                ComponentCache::default_location().map(|dir| ComponentCache::new(dir, &engine));
            PluginEngine { engine, cache }
        })
    }

    /// The wasmtime engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
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
