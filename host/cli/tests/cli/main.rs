//! Tests of the `hearth` binary as a user runs it: `hearth launch` with
//! every launcher, and `hearth run` under mpirun.

mod launch;
mod run_mpirun;
