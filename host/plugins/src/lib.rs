//! WebAssembly plugins: one wasmtime engine, manifests and discovery, the
//! sandbox, a compile cache, and one typed adapter per plugin kind.
//!
//! Only this crate knows WIT and wasmtime, and no type of either is in its
//! public API. A plugin is a folder holding a
//! `plugin.toml` ([`Manifest`]) and a component; [`Registry`] finds them,
//! [`load_tracker`] turns one into a [`TrackerPlugin`] whose calls never
//! crash or hang the host.

#![warn(missing_docs)]

mod bindings;
mod builtin;
mod cache;
mod check;
mod checkpoint_hook;
mod engine;
mod error;
mod inspect;
mod manifest;
pub mod network;
mod options;
mod pin;
mod quota;
mod registry;
mod runtime;
mod sandbox;
pub use sandbox::DeliveryCounts;
mod scheduler;
mod stdio;
mod tensors;
mod tracker;
mod usage;
mod wrap_policy;

pub use bindings::{RunInfo, Value};
pub use cache::ComponentCache;
pub use check::check_plugin;
pub use checkpoint_hook::{load_checkpoint_hook, CheckpointHookPlugin, HookCheckpoint, HookSave};
pub use engine::PluginEngine;
pub use error::PluginError;
pub use inspect::{ComponentReport, WIT_PACKAGE, WIT_VERSION};
pub use manifest::{Granted, LimitOverrides, Limits, Manifest, PermissionGrant, PluginKind};
pub use options::{toml_scalar, OptionSpec, OptionType};
pub use pin::{parse_pin, sha256_hex};
pub use registry::{Broken, Found, PluginSource, Registry, SearchPath};
pub use runtime::{linkers_built, FaultKind};
pub use scheduler::{load_scheduler, SchedulerPlugin};
pub use tracker::{load_tracker, load_tracker_with, TrackerFault, TrackerHealth, TrackerPlugin};
pub use usage::{plugin_usage, plugin_usage_since, PluginUsage};
pub use wrap_policy::{load_wrap_policy, PolicyModule, WrapPolicyPlugin};

/// Named values, as the WIT `entries` type.
pub type Entries = Vec<(String, Value)>;
