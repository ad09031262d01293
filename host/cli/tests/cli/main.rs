//! Tests of the `hearth` binary as a user runs it: `hearth launch` with
//! every launcher, and `hearth run` under mpirun.

mod launch;
mod run_mpirun;

/// The tiny job as the two-rank tests here run it, `steps` steps sorting 6
/// digits at lr 3e-3, named `name`.
fn six_digit_job(name: &str, steps: i64) -> hearth_testkit::TinyJob {
    hearth_testkit::TinyJob::new()
        .set("run", "name", name)
        .set("run", "steps", steps)
        .set("data", "digits", 6)
        .set("optimizer", "lr", 3e-3)
}
