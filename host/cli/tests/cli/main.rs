//! Tests of the `hearth` binary as a user runs it: `hearth launch` with
//! every launcher, `hearth env`, the launch config, and `hearth run` under
//! mpirun.

mod env;
mod launch;
mod launch_config;
mod run_mpirun;

use std::process::{Command, Output};

/// The `hearth` binary this test crate was built with.
const HEARTH: &str = env!("CARGO_BIN_EXE_hearth");

/// `hearth <args>` as a user starts it: no launcher's variables, no launch
/// config of the user's, mpirun allowed as root.
fn hearth(args: &[&str]) -> Command {
    let mut cmd = Command::new(HEARTH);
    hearth_testkit::open_mpi_as_root(cmd.args(args))
        // No default launch config of the user's (hearth config --launch).
        .env("HEARTH_CONFIG_DIR", "/nonexistent/hearth-tests");
    for var in ["OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", "RANK", "SLURM_NTASKS"] {
        cmd.env_remove(var);
    }
    cmd
}

/// A finished command's stdout, then its stderr.
fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The tiny job as the two-rank tests here run it, `steps` steps sorting 6
/// digits at lr 3e-3, named `name`.
fn six_digit_job(name: &str, steps: i64) -> hearth_testkit::TinyJob {
    hearth_testkit::TinyJob::new()
        .set("run", "name", name)
        .set("run", "steps", steps)
        .set("data", "digits", 6)
        .set("optimizer", "lr", 3e-3)
}
