//! The state of one plugin instance and the capabilities it is granted.
//!
//! Deny by default: no environment, no arguments, no stdin, no network
//! (TCP, UDP and name lookup refused), stdout/stderr into the host log, and
//! a filesystem only where the kind needs one — a tracker's own logging
//! folder, preopened read-write at `/logs`. Linear memory is capped by
//! `StoreLimits`; growth past the cap traps.

use super::stdio::LogStream;
use super::{Limits, PluginError};
use std::path::Path;
use std::sync::Arc;
use wasmtime::component::ResourceTable;
use wasmtime::{StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

/// Where a tracker's logging folder appears inside the sandbox.
pub const LOGS_GUEST_PATH: &str = "/logs";

/// What one plugin store holds.
pub struct PluginState {
    name: Arc<str>,
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) limits: StoreLimits,
}

impl PluginState {
    /// A sandbox for plugin `name`, with `logs` (if any) read-write at `/logs`.
    pub fn new(name: &str, limits: &Limits, logs: Option<&Path>) -> Result<Self, PluginError> {
        let name: Arc<str> = name.into();
        let mut wasi = WasiCtxBuilder::new();
        wasi.stdout(LogStream::new(name.clone(), "stdout"))
            .stderr(LogStream::new(name.clone(), "stderr"))
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
        if let Some(dir) = logs {
            wasi.preopened_dir(dir, LOGS_GUEST_PATH, FsPerms::ReadWrite)
                .map_err(|e| PluginError::Runtime {
                    name: name.to_string(),
                    message: format!("cannot open its logging folder {}: {e}", dir.display()),
                })?;
        }
        let limits = StoreLimitsBuilder::new()
            .memory_size(limits.memory_bytes())
            .trap_on_grow_failure(true)
            .build();
        Ok(Self {
            name,
            wasi: wasi.build(),
            table: ResourceTable::new(),
            limits,
        })
    }

    /// The plugin's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}
