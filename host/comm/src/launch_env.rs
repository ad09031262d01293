//! Where this process stands in a job, from the variables its launcher set:
//! `mpirun` (`OMPI_COMM_WORLD_*`), torchrun or `hearth launch`'s GPU mode
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`), or SLURM's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`,
//! `SLURM_LOCALID`). Read without joining any process group.

use serde::Serialize;

/// Who started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Launcher {
    /// Open MPI's `mpirun` (also what `hearth launch` uses for CPU jobs).
    Mpirun,
    /// torchrun, or anything setting its variables (`hearth launch` for GPUs).
    Torchrun,
    /// SLURM's `srun`.
    Slurm,
    /// Nothing: a world of one.
    None,
}

/// This process's place in its job, as its launcher described it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LaunchEnv {
    /// Who set the variables.
    pub launcher: Launcher,
    /// Index of this process in the job.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Index of this process on its machine.
    pub local_rank: usize,
    /// Number of processes on its machine.
    pub local_world_size: usize,
    /// The rendezvous address (`MASTER_ADDR:MASTER_PORT`), when set.
    pub master: Option<String>,
}

/// A launcher variable that is missing or not a number.
#[derive(Debug, thiserror::Error)]
#[error("environment variable {name}{}: {why}", value.as_ref().map(|v| format!("={v:?}")).unwrap_or_default())]
pub struct LaunchEnvError {
    /// The variable.
    pub name: &'static str,
    /// Its value, when set.
    pub value: Option<String>,
    /// What is wrong, and what to do.
    pub why: String,
}

impl LaunchEnv {
    /// Reads the process's environment.
    pub fn from_env() -> Result<Self, LaunchEnvError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the variables `get` returns (the environment, or a test's map).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, LaunchEnvError> {
        let number = |name: &'static str| -> Result<Option<usize>, LaunchEnvError> {
            match get(name) {
                None => Ok(None),
                Some(v) => v.trim().parse().map(Some).map_err(|_| LaunchEnvError {
                    name,
                    value: Some(v),
                    why: "expected a whole number".into(),
                }),
            }
        };
        // A rank may be left out only in a world of one.
        let rank = |name: &'static str, launcher: &str, world: usize| match number(name)? {
            Some(rank) => Ok(rank),
            None if world == 1 => Ok(0),
            None => Err(LaunchEnvError {
                name,
                value: None,
                why: format!(
                    "{launcher} sets it beside the world size ({world}); set it or unset them all"
                ),
            }),
        };
        let master = get("MASTER_ADDR").map(|addr| match get("MASTER_PORT") {
            Some(port) => format!("{addr}:{port}"),
            None => addr,
        });
        let env = if let Some(world_size) = number("OMPI_COMM_WORLD_SIZE")? {
            Self {
                launcher: Launcher::Mpirun,
                rank: rank("OMPI_COMM_WORLD_RANK", "mpirun", world_size)?,
                world_size,
                local_rank: number("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0),
                local_world_size: number("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(world_size),
                master,
            }
        } else if let Some(world_size) = number("WORLD_SIZE")? {
            let rank = rank("RANK", "torchrun", world_size)?;
            Self {
                launcher: Launcher::Torchrun,
                rank,
                world_size,
                local_rank: number("LOCAL_RANK")?.unwrap_or(rank),
                local_world_size: number("LOCAL_WORLD_SIZE")?.unwrap_or(world_size),
                master,
            }
        } else if let Some(world_size) = number("SLURM_NTASKS")? {
            let rank = rank("SLURM_PROCID", "srun", world_size)?;
            Self {
                launcher: Launcher::Slurm,
                rank,
                world_size,
                local_rank: number("SLURM_LOCALID")?.unwrap_or(0),
                local_world_size: number("SLURM_NTASKS_PER_NODE")?.unwrap_or(world_size),
                master,
            }
        } else {
            Self {
                launcher: Launcher::None,
                rank: 0,
                world_size: 1,
                local_rank: 0,
                local_world_size: 1,
                master,
            }
        };
        if env.world_size == 0 || env.rank >= env.world_size {
            return Err(LaunchEnvError {
                name: match env.launcher {
                    Launcher::Mpirun => "OMPI_COMM_WORLD_RANK",
                    Launcher::Slurm => "SLURM_PROCID",
                    _ => "RANK",
                },
                value: Some(env.rank.to_string()),
                why: format!("not a rank of a world of {}", env.world_size),
            });
        }
        Ok(env)
    }
}

/// The variable that tells a restarted process how many times the job was
/// restarted (torchrun's `TORCHELASTIC_RESTART_COUNT` is set too).
pub const RESTART_COUNT_VAR: &str = "HEARTH_RESTART_COUNT";

/// The variable that names one `hearth launch` (the same across its
/// restarts, different for every launch).
pub const LAUNCH_ID_VAR: &str = "HEARTH_LAUNCH_ID";

/// The id of the `hearth launch` that started this process, if one did.
pub fn launch_id() -> Option<String> {
    std::env::var(LAUNCH_ID_VAR).ok().filter(|v| !v.is_empty())
}

/// How many times `hearth launch --max-restarts` has restarted this
/// process's job (0: the first start, or not started so).
pub fn restart_count() -> u32 {
    std::env::var(RESTART_COUNT_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<LaunchEnv, LaunchEnvError> {
        LaunchEnv::from_vars(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn each_launcher_names_the_same_place() {
        let mpirun = env(&[
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap();
        let torchrun = env(&[
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        let slurm = env(&[
            ("SLURM_NTASKS", "4"),
            ("SLURM_PROCID", "3"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2"),
        ])
        .unwrap();
        for e in [&mpirun, &torchrun, &slurm] {
            assert_eq!(
                (e.rank, e.world_size, e.local_rank, e.local_world_size),
                (3, 4, 1, 2)
            );
        }
        assert_eq!(torchrun.master.as_deref(), Some("10.0.0.1:29500"));
        assert_eq!(
            (mpirun.launcher, torchrun.launcher, slurm.launcher),
            (Launcher::Mpirun, Launcher::Torchrun, Launcher::Slurm)
        );
        assert_eq!(env(&[]).unwrap().world_size, 1);
    }

    #[test]
    fn bad_variables_are_named() {
        let e = env(&[("WORLD_SIZE", "two"), ("RANK", "0")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "environment variable WORLD_SIZE=\"two\": expected a whole number"
        );
        let e = env(&[("WORLD_SIZE", "2")]).unwrap_err().to_string();
        assert!(
            e.starts_with("environment variable RANK: torchrun sets it"),
            "{e}"
        );
        let e = env(&[("WORLD_SIZE", "2"), ("RANK", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a rank of a world of 2"), "{e}");
    }
}
