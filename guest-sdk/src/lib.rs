//! Write hearth plugins in Rust.
//!
//! A tracker implements [`Tracker`] and exports itself with
//! [`export_tracker!`]; a learning-rate schedule implements [`Scheduler`]
//! and [`export_scheduler!`]; a checkpoint hook implements
//! [`CheckpointHook`] and [`export_checkpoint_hook!`]; a sharding wrap
//! policy implements [`WrapPolicy`] and [`export_wrap_policy!`]. Build it with
//! `cargo build --target wasm32-wasip2` (crate type `cdylib`) and put the
//! `.wasm` beside a `plugin.toml`. The tracker's logging folder is `/logs`,
//! a checkpoint hook's the checkpoint folder at `/checkpoint`; nothing else
//! is reachable.
//!
//! A complete tracker that appends every logged value to `/logs/values.txt`
//! (appending, so that a fresh instance after a fault goes on where the
//! failed one stopped; a new run starts with `/logs` empty):
//!
//! ```no_run
//! use hearth_guest::{export_tracker, Entries, Start, Tracker, Value};
//! use std::io::Write;
//!
//! #[derive(Default)]
//! struct Lines(Option<std::fs::File>);
//!
//! impl Tracker for Lines {
//!     fn start(&mut self, start: Start) -> Result<(), String> {
//!         hearth_guest::log::info(&format!("tracking {}", start.run.run));
//!         let file = std::fs::OpenOptions::new()
//!             .create(true)
//!             .append(true)
//!             .open("/logs/values.txt");
//!         self.0 = Some(file.map_err(|e| e.to_string())?);
//!         Ok(())
//!     }
//!     fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
//!         let file = self.0.as_mut().ok_or("log before start")?;
//!         for (name, value) in values {
//!             if let Value::Float(v) = value {
//!                 writeln!(file, "{step} {name} {v}").map_err(|e| e.to_string())?;
//!             }
//!         }
//!         Ok(())
//!     }
//! }
//!
//! export_tracker!(Lines);
//! ```
//!
//! The fault contract (what happens after a panic, a missed deadline or a
//! memory-cap hit) is [`Tracker`]'s. A tracker that sends its values to a
//! service (the `http` feature's client) delivers them through an
//! [`outbox::Outbox`]: retries with back-off, a bounded spool in `/logs`,
//! a bounded flush at `finish`, and counts in the run's `summary.json`.

#![warn(missing_docs)]

/// Bindings generated from the WIT package in `wit/`, one module per world.
pub mod bindings {
    /// The `tracker-plugin` world.
    #[allow(missing_docs)]
    pub mod tracker {
        wit_bindgen::generate!({
            path: "wit",
            world: "hearth:plugin/tracker-plugin",
            pub_export_macro: true,
            export_macro_name: "__export_tracker_world",
            default_bindings_module: "hearth_guest::bindings::tracker",
        });
    }

    /// The `scheduler-plugin` world (its `log` import is the tracker's).
    #[allow(missing_docs)]
    pub mod scheduler {
        wit_bindgen::generate!({
            path: "wit",
            world: "hearth:plugin/scheduler-plugin",
            pub_export_macro: true,
            export_macro_name: "__export_scheduler_world",
            default_bindings_module: "hearth_guest::bindings::scheduler",
            with: { "hearth:plugin/log@0.3.0": crate::bindings::tracker::hearth::plugin::log },
        });
    }

    /// The `checkpoint-plugin` world (its `log` and `types` are the tracker's).
    #[allow(missing_docs)]
    pub mod checkpoint {
        wit_bindgen::generate!({
            path: "wit",
            world: "hearth:plugin/checkpoint-plugin",
            pub_export_macro: true,
            export_macro_name: "__export_checkpoint_world",
            default_bindings_module: "hearth_guest::bindings::checkpoint",
            with: {
                "hearth:plugin/log@0.3.0": crate::bindings::tracker::hearth::plugin::log,
                "hearth:plugin/types@0.3.0": crate::bindings::tracker::hearth::plugin::types,
            },
        });
    }

    /// The `wrap-policy-plugin` world (its `log` import is the tracker's).
    #[allow(missing_docs)]
    pub mod wrap_policy {
        wit_bindgen::generate!({
            path: "wit",
            world: "hearth:plugin/wrap-policy-plugin",
            pub_export_macro: true,
            export_macro_name: "__export_wrap_policy_world",
            default_bindings_module: "hearth_guest::bindings::wrap_policy",
            with: { "hearth:plugin/log@0.3.0": crate::bindings::tracker::hearth::plugin::log },
        });
    }
}

pub mod checkpoint;
pub mod files;
#[cfg(feature = "http")]
pub mod http;
pub mod outbox;

pub use bindings::tracker::exports::hearth::plugin::tracker::Restart;
pub use bindings::tracker::hearth::plugin::types::{RunInfo, Value};
/// One module of the model tree a wrap policy is given.
pub use bindings::wrap_policy::exports::hearth::plugin::wrap_policy::Module;

/// Named values, in the order the host sent them.
pub type Entries = Vec<(String, Value)>;

/// The version of the WIT package this SDK speaks (`wit/plugin.wit`'s
/// `package` line, read at build time).
pub const WIT_VERSION: &str = env!("HEARTH_WIT_VERSION");

/// What a tracker's `start` is given.
#[derive(Debug, Clone)]
pub struct Start {
    /// The run, and this process's place in it.
    pub run: RunInfo,
    /// The run's hyper-parameters (Accelerate's `store_init_configuration`).
    pub config: Entries,
    /// The tracker's options from its `[[trackers]]` table, checked against
    /// the `[options]` its `plugin.toml` declares, defaults filled in.
    pub options: Entries,
    /// Set when this is a fresh instance after a fault: which call faulted
    /// (it comes again right after this `start`) and what was lost.
    pub restart: Option<Restart>,
}

impl Start {
    /// The option called `key`, if given or defaulted.
    pub fn option(&self, key: &str) -> Option<&Value> {
        self.options.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

/// An experiment tracker (Accelerate's `GeneralTracker`). One value of the
/// type lives for the whole plugin instance, created with `Default`.
///
/// The host's contract:
/// - An instance gets `start` first, then `log` for each logged step in
///   step order, then `finish` once.
/// - A new run begins with `/logs` empty; a resumed run finds it as the
///   last run left it.
/// - A panic, a missed deadline or a memory-cap hit drops the instance. A
///   fresh one gets `start` with [`Start::restart`] set, then the call that
///   faulted once more. `/logs` is as the failed instance left it: keep
///   there what must survive, and read it back on a restart (the failed
///   instance may have done part of `restart.step`).
/// - If that call faults again its values are lost (`restart.values_lost`
///   and the run's `summary.json` count them).
/// - An `Err` is a fault that keeps the instance; the call is not sent again.
/// - After 3 faults the tracker gets no further call, not even `finish`.
pub trait Tracker: Default + 'static {
    /// A run begins, or goes on in a fresh instance after a fault.
    fn start(&mut self, _start: Start) -> Result<(), String> {
        Ok(())
    }
    /// `values` were logged at global step `step`.
    fn log(&mut self, step: u64, values: Entries) -> Result<(), String>;
    /// The run ends: flush and close.
    fn finish(&mut self) -> Result<(), String> {
        Ok(())
    }
}

/// A learning-rate schedule (PyTorch's `LRScheduler`, transformers'
/// `get_*_schedule`). The host creates one per optimizer and asks for the
/// rates of every parameter group at each optimizer step (0-based).
pub trait Scheduler: Sized + 'static {
    /// A schedule from the user's options (the `[scheduler]` table as JSON,
    /// without `name`), the optimizer's base rates, and the total number of
    /// optimizer steps when known. An `Err` names the option that is wrong.
    fn create(
        options_json: &str,
        base_lrs: Vec<f64>,
        total_steps: Option<u64>,
    ) -> Result<Self, String>;
    /// The rate of each parameter group at optimizer step `step`.
    fn lrs(&self, step: u64) -> Vec<f64>;
    /// A metric to react to (reduce-on-plateau); ignored by default.
    fn observe(&mut self, _metric: f64) {}
    /// The schedule's state, for a checkpoint (empty for stateless schedules).
    fn save(&self) -> Vec<u8> {
        Vec::new()
    }
    /// Restores a state written by `save`.
    fn load(&mut self, _state: &[u8]) -> Result<(), String> {
        Ok(())
    }
}

/// A sharding wrap policy (FSDP's `auto_wrap_policy`): picks the modules
/// that become units from the model's module tree. The root is always a
/// unit; every path returned must name a module in `modules`, or the host
/// stops the run naming the plugin.
///
/// A policy that makes every `Block` a unit, and every module holding at
/// least 1000 parameters of its own:
///
/// ```no_run
/// use hearth_guest::{export_wrap_policy, Module, WrapPolicy};
///
/// struct BlocksAndBigLeaves;
///
/// impl WrapPolicy for BlocksAndBigLeaves {
///     fn units(_options_json: &str, modules: &[Module]) -> Result<Vec<String>, String> {
///         Ok(modules
///             .iter()
///             .filter(|m| m.kind == "Block" || m.own_params >= 1000)
///             .map(|m| m.path.clone())
///             .collect())
///     }
/// }
///
/// export_wrap_policy!(BlocksAndBigLeaves);
/// ```
pub trait WrapPolicy: 'static {
    /// The paths of the modules to wrap, from the policy's options (the
    /// `[fsdp]` table's policy options as a JSON object, plus the
    /// manifest's `[presets]`) and the module tree (parents
    /// before children; `parent` indexes the same list). An `Err` says
    /// what is wrong; the host stops the run with it.
    fn units(options_json: &str, modules: &[Module]) -> Result<Vec<String>, String>;
}

/// Lines into the host's log, prefixed with the plugin's name.
pub mod log {
    use crate::bindings::tracker::hearth::plugin::log::{log, Level};

    /// Logs at debug level.
    pub fn debug(message: &str) {
        log(Level::Debug, message)
    }
    /// Logs at info level.
    pub fn info(message: &str) {
        log(Level::Info, message)
    }
    /// Logs a warning.
    pub fn warn(message: &str) {
        log(Level::Warn, message)
    }
    /// Logs an error.
    pub fn error(message: &str) {
        log(Level::Error, message)
    }
}

/// Exports a [`Tracker`] type as this component's `tracker` interface.
#[macro_export]
macro_rules! export_tracker {
    ($ty:ty) => {
        const _: () = {
            static STATE: ::std::sync::Mutex<::core::option::Option<$ty>> = ::std::sync::Mutex::new(None);

            fn with<R>(f: impl FnOnce(&mut $ty) -> R) -> R {
                let mut guard = STATE.lock().unwrap_or_else(|e| e.into_inner());
                f(guard.get_or_insert_with(<$ty as ::core::default::Default>::default))
            }

            struct HearthTrackerExport;

            impl $crate::bindings::tracker::exports::hearth::plugin::tracker::Guest for HearthTrackerExport {
                fn start(
                    run: $crate::RunInfo,
                    config: $crate::Entries,
                    options: $crate::Entries,
                    restart: ::core::option::Option<$crate::Restart>,
                ) -> Result<(), String> {
                    let start = $crate::Start { run, config, options, restart };
                    with(|t| $crate::Tracker::start(t, start))
                }
                fn log(step: u64, values: $crate::Entries) -> Result<(), String> {
                    with(|t| $crate::Tracker::log(t, step, values))
                }
                fn finish() -> Result<(), String> {
                    with(|t| $crate::Tracker::finish(t))
                }
            }

            $crate::bindings::tracker::__export_tracker_world!(HearthTrackerExport with_types_in $crate::bindings::tracker);
        };
    };
}

/// Exports a [`Scheduler`] type as this component's `scheduler` interface.
#[macro_export]
macro_rules! export_scheduler {
    ($ty:ty) => {
        const _: () = {
            use $crate::bindings::scheduler::exports::hearth::plugin::scheduler as wit;

            struct HearthSchedule(::core::cell::RefCell<$ty>);

            impl wit::GuestSchedule for HearthSchedule {
                fn create(
                    options_json: String,
                    base_lrs: Vec<f64>,
                    total_steps: Option<u64>,
                ) -> Result<wit::Schedule, String> {
                    let inner =
                        <$ty as $crate::Scheduler>::create(&options_json, base_lrs, total_steps)?;
                    Ok(wit::Schedule::new(HearthSchedule(
                        ::core::cell::RefCell::new(inner),
                    )))
                }
                fn lrs(&self, step: u64) -> Vec<f64> {
                    $crate::Scheduler::lrs(&*self.0.borrow(), step)
                }
                fn observe(&self, metric: f64) {
                    $crate::Scheduler::observe(&mut *self.0.borrow_mut(), metric)
                }
                fn save(&self) -> Vec<u8> {
                    $crate::Scheduler::save(&*self.0.borrow())
                }
                fn load(&self, state: Vec<u8>) -> Result<(), String> {
                    $crate::Scheduler::load(&mut *self.0.borrow_mut(), &state)
                }
            }

            struct HearthSchedulerExport;

            impl wit::Guest for HearthSchedulerExport {
                type Schedule = HearthSchedule;
            }

            $crate::bindings::scheduler::__export_scheduler_world!(
                HearthSchedulerExport with_types_in $crate::bindings::scheduler
            );
        };
    };
}

/// Exports a [`WrapPolicy`] type as this component's `wrap-policy` interface.
#[macro_export]
macro_rules! export_wrap_policy {
    ($ty:ty) => {
        const _: () = {
            struct HearthWrapPolicyExport;

            impl $crate::bindings::wrap_policy::exports::hearth::plugin::wrap_policy::Guest
                for HearthWrapPolicyExport
            {
                fn units(
                    options_json: String,
                    modules: Vec<$crate::Module>,
                ) -> Result<Vec<String>, String> {
                    <$ty as $crate::WrapPolicy>::units(&options_json, &modules)
                }
            }

            $crate::bindings::wrap_policy::__export_wrap_policy_world!(
                HearthWrapPolicyExport with_types_in $crate::bindings::wrap_policy
            );
        };
    };
}
