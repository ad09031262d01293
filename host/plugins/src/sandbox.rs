//! The state of one plugin instance and the capabilities it is granted.
//!
//! Deny by default: no environment, no arguments, no stdin, no network
//! (TCP, UDP and name lookup refused; `wasi:http` only for a plugin that
//! asks for hosts, and then only to the hosts its user granted, through
//! [`HttpGate`]), environment variables only those granted by name,
//! stdout/stderr into the host log, and
//! a filesystem only where the kind needs one — a tracker's own logging
//! folder, preopened read-write at `/logs`; a checkpoint hook the checkpoint
//! folder being written (read-write) or loaded (read-only) at `/checkpoint`.
//! Linear memory is capped by `StoreLimits`; growth past the cap traps. A
//! writable folder has a quota ([`Quota`]), and stdout/stderr a budget
//! ([`OutputBudget`]).

use super::network::HttpGate;
use super::quota::{Quota, QuotaFs};
use super::stdio::{LogStream, OutputBudget};
use super::{Limits, PluginError};
use std::path::Path;
use std::sync::Arc;
use wasmtime::component::ResourceTable;
use wasmtime::{StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::filesystem::WasiFilesystemCtxView;
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpCtxView, WasiHttpView};

/// Linear memories per instance; each is capped at the manifest's `memory-mb`.
const MAX_MEMORIES: usize = 8;
/// Tables per instance.
const MAX_TABLES: usize = 64;
/// Elements of one table.
const MAX_TABLE_ELEMENTS: usize = 1 << 20;
/// Core instances in one component instance.
const MAX_INSTANCES: usize = 256;
/// Live WASI resources (open files, streams, pollables) per instance.
const MAX_RESOURCES: usize = 256;

/// Where a tracker's logging folder appears inside the sandbox.
pub const LOGS_GUEST_PATH: &str = "/logs";
/// Where a checkpoint hook's checkpoint folder appears inside the sandbox.
pub const CHECKPOINT_GUEST_PATH: &str = "/checkpoint";

/// The one host folder a plugin instance may reach, and how.
#[derive(Debug, Clone, Copy)]
pub struct Preopen<'a> {
    /// The folder on the host.
    pub host: &'a Path,
    /// Its path inside the sandbox.
    pub guest: &'static str,
    /// Whether the plugin may create, change and remove files there.
    pub writable: bool,
}

impl<'a> Preopen<'a> {
    /// A tracker's logging folder, read-write at `/logs`.
    pub fn logs(host: &'a Path) -> Self {
        Self {
            host,
            guest: LOGS_GUEST_PATH,
            writable: true,
        }
    }

    /// A checkpoint folder at `/checkpoint`.
    pub fn checkpoint(host: &'a Path, writable: bool) -> Self {
        Self {
            host,
            guest: CHECKPOINT_GUEST_PATH,
            writable,
        }
    }
}

/// What a user granted a plugin beyond its folder: hosts (through its
/// gate) and environment variables (by name).
pub struct Grants<'a> {
    /// Its `wasi:http` gate (refusing everything where nothing is granted).
    pub gate: HttpGate,
    /// The environment variables it gets, read from the host's now.
    pub env: &'a [String],
}

/// What one plugin store holds.
pub struct PluginState {
    name: Arc<str>,
    wasi: WasiCtx,
    table: ResourceTable,
    http: WasiHttpCtx,
    gate: HttpGate,
    pub(crate) limits: StoreLimits,
    quota: Option<Arc<Quota>>,
    file_io_on_thread: bool,
    /// A tracker's last delivery report (`hearth:plugin/delivery`), not yet taken.
    pub(crate) delivery: Option<DeliveryCounts>,
}

impl PluginState {
    /// A sandbox for plugin `name` that reaches `files` (if any, under
    /// `quota` when writable) and nothing else; its output is counted
    /// against `budget`. With `file_io_on_thread`, its file reads and
    /// writes run on the calling thread instead of being handed to a
    /// blocking pool and back (tens of µs a call): only for a plugin called
    /// from a thread of its own, since a host timer cannot abandon a call
    /// blocked in such a write.
    pub fn new(
        name: &str,
        limits: &Limits,
        files: Option<Preopen<'_>>,
        quota: Option<Arc<Quota>>,
        budget: Arc<OutputBudget>,
        file_io_on_thread: bool,
        grants: Grants<'_>,
    ) -> Result<Self, PluginError> {
        let name: Arc<str> = name.into();
        let mut wasi = WasiCtxBuilder::new();
        for key in grants.env {
            if let Ok(value) = std::env::var(key) {
                wasi.env(key, value);
            }
        }
        wasi.stdout(LogStream::budgeted(name.clone(), "stdout", budget.clone()))
            .stderr(LogStream::budgeted(name.clone(), "stderr", budget))
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .allow_blocking_current_thread(file_io_on_thread);
        if let Some(files) = files {
            let perms = if files.writable {
                FsPerms::ReadWrite
            } else {
                FsPerms::ReadOnly
            };
            wasi.preopened_dir(files.host, files.guest, perms)
                .map_err(|e| PluginError::Runtime {
                    name: name.to_string(),
                    message: format!("cannot open its folder {}: {e}", files.host.display()),
                })?;
        }
        // The memory cap is per linear memory, so the number of memories,
        // tables, table elements and instances is capped too (generously
        // for a componentize-py runtime, far below what hurts the host).
        let limits = StoreLimitsBuilder::new()
            .memory_size(limits.memory_bytes())
            .memories(MAX_MEMORIES)
            .tables(MAX_TABLES)
            .table_elements(MAX_TABLE_ELEMENTS)
            .instances(MAX_INSTANCES)
            .trap_on_grow_failure(true)
            .build();
        // Each open file is a host file descriptor for as long as the store lives.
        let mut table = ResourceTable::new();
        table.set_max_capacity(MAX_RESOURCES);
        Ok(Self {
            name,
            wasi: wasi.build(),
            table,
            http: WasiHttpCtx::new(),
            gate: grants.gate,
            limits,
            quota,
            file_io_on_thread,
            delivery: None,
        })
    }

    /// The filesystem as the plugin sees it: wasmtime-wasi's, under the
    /// folder's quota.
    pub(crate) fn quota_fs(&mut self) -> QuotaFs<'_> {
        QuotaFs {
            fs: WasiFilesystemCtxView {
                ctx: self.wasi.filesystem(),
                table: &mut self.table,
            },
            quota: self.quota.clone(),
            on_thread: self.file_io_on_thread,
        }
    }

    /// The plugin's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The host resources handed to this instance.
    pub(crate) fn table(&mut self) -> &mut ResourceTable {
        &mut self.table
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

impl WasiHttpView for PluginState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView {
            hooks: &mut self.gate,
            table: &mut self.table,
            ctx: &mut self.http,
        }
    }
}

/// A tracker's own account of the logged values it delivers to a service
/// (`hearth:plugin/delivery`): totals over the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeliveryCounts {
    /// Values the service took.
    pub sent: u64,
    /// Values whose first attempt failed and that were tried again.
    pub retried: u64,
    /// Values that waited in the tracker's on-disk spool.
    pub spooled: u64,
    /// Values given up (refused, pushed out of a full spool, unsent at the end).
    pub dropped: u64,
}
