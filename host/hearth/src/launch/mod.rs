//! `hearth launch`: starting the processes of a job (through `mpirun` on
//! the CPU, one spawned process per GPU otherwise) and supervising them.
//! A command, not a process group: the groups the processes then join are
//! in [`hearth_comm`].

mod config;
mod launcher;
mod mpirun;
mod process;
mod signals;
mod spec;

pub use config::{
    basic_config, default_launch_config_path, read_launch_config, write_basic_config, LaunchConfig,
    LaunchConfigError,
};
pub use launcher::launch;
pub use spec::{
    launch_id, restart_count, LaunchError, LaunchMode, LaunchSpec, LAUNCH_ID_VAR, RESTART_COUNT_VAR,
};
