//! Joining the process group this process was started in: which backend
//! (Accelerate's `InitProcessGroupKwargs.backend`) and how its members find
//! each other.
//!
//! | started by | trains on | backend | rendezvous |
//! |---|---|---|---|
//! | nothing (or a world of one) | any | single | — |
//! | torchrun's variables, a world of one, NCCL asked for by name | GPU | NCCL | the TCP store (as `init_process_group("nccl")` makes a communicator of one) |
//! | `mpirun`, `srun --mpi=pmix` | CPU | MPI | MPI |
//! | `mpirun`, `srun --mpi=pmix` | GPU | NCCL | the unique id broadcast over MPI |
//! | torchrun's variables (`hearth launch` on GPUs) | GPU | NCCL | the TCP store at `MASTER_ADDR:MASTER_PORT` |
//! | torchrun's variables | CPU | refused: CPU collectives are MPI's, start with `mpirun` | |
//!
//! A backend asked for by name wins over the device's default where the
//! launcher allows it (MPI on a GPU run moves tensors through the CPU).

use super::{DistError, LaunchEnv, Launcher, MpiGroup, ProcessGroup, SingleProcess};
use std::time::Duration;

/// True when this build has the NCCL backend (the `cuda` feature).
pub const NCCL_BUILT: bool = cfg!(feature = "cuda");

/// A collectives library.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Open MPI: CPU tensors (GPU tensors are refused).
    Mpi,
    /// NCCL: CUDA tensors, one GPU per process (the `cuda` feature).
    Nccl,
}

hearth_ops::spelled_enum! {
    Backend: "backend" {
        Mpi = "mpi",
        Nccl = "nccl",
    }
    refused |s| {
        "gloo" | "ucc" | "xccl" => format!(
            "hearth has no {s} backend (PyTorch's); use mpi for CPU processes or nccl for GPUs"
        ),
    }
}

/// What kind of world a run is (Accelerate's `DistributedType`, with its
/// spellings: `"NO"`, `"MULTI_CPU"`, `"MULTI_GPU"`, `"FSDP"`). Accelerate's
/// other values name devices and engines hearth does not drive (NPU, MLU,
/// SDAA, MUSA, XPU, HPU, XLA, DeepSpeed, Megatron-LM): parsing one says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", try_from = "String")]
pub enum DistributedType {
    /// One process.
    No,
    /// Several processes on CPUs (MPI).
    MultiCpu,
    /// Several processes, one GPU each.
    MultiGpu,
    /// Several processes with a GPU each, the model sharded (FSDP), as
    /// Accelerate names a multi-GPU world with an FSDP plugin.
    Fsdp,
}

hearth_ops::spelled_enum! {
    DistributedType: "distributed type" {
        No = "NO",
        MultiCpu = "MULTI_CPU",
        MultiGpu = "MULTI_GPU",
        Fsdp = "FSDP",
    }
    // Accelerate's values for devices and engines hearth does not drive.
    refused |s| {
        "MULTI_NPU" | "MULTI_MLU" | "MULTI_SDAA" | "MULTI_MUSA" | "MULTI_XPU" | "DEEPSPEED" | "XLA"
            | "MEGATRON_LM" | "MULTI_HPU" | "MULTI_NEURON" => format!(
            "distributed type {s:?} is Accelerate's for a device or engine hearth does not drive; hearth runs NO, MULTI_CPU, MULTI_GPU or FSDP"
        ),
    }
}

/// How this process joins its world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Join {
    /// Alone: a world of one.
    Single,
    /// MPI's world.
    Mpi,
    /// NCCL on `device`, its unique id broadcast over MPI.
    NcclOverMpi {
        /// This process's CUDA device.
        device: usize,
    },
    /// NCCL on `device`, its unique id exchanged through the store at
    /// `host:port`, served by rank 0.
    NcclOverStore {
        /// This process's CUDA device.
        device: usize,
        /// The store's host (`MASTER_ADDR`).
        host: String,
        /// The store's port.
        port: u16,
    },
}

/// Decides how to join from the launcher's description, the backend asked
/// for (if any), this process's CUDA device (`None` on the CPU) and
/// whether torchrun's agent holds `MASTER_PORT`. Pure: the table in the
/// module's documentation.
pub fn choose_backend(
    env: &LaunchEnv,
    requested: Option<Backend>,
    cuda_device: Option<usize>,
    agent_store: bool,
) -> Result<Join, String> {
    // mpirun always means MPI's world (even -n 1); srun only when it
    // started several tasks.
    let mpi_world =
        env.launcher == Launcher::Mpirun || (env.launcher == Launcher::Slurm && env.world_size > 1);
    // A world of one needs no collectives, unless a launcher started it and
    // NCCL was asked for by name (a one-GPU check of the NCCL path).
    let nccl_by_name = requested == Some(Backend::Nccl) && env.launcher == Launcher::Torchrun;
    if !mpi_world && env.world_size == 1 && !nccl_by_name {
        return Ok(Join::Single);
    }
    let backend = requested.unwrap_or(if cuda_device.is_some() {
        Backend::Nccl
    } else {
        Backend::Mpi
    });
    match (backend, cuda_device) {
        (Backend::Mpi, _) if mpi_world => Ok(Join::Mpi),
        (Backend::Mpi, _) => Err(format!(
            "WORLD_SIZE={n} is set but this process was not started by mpirun; hearth's CPU collectives are MPI's: start the job with `hearth launch --cpu -n {n}` or `mpirun -n {n}` (torchrun-started processes need GPUs and the NCCL backend)",
            n = env.world_size
        )),
        (Backend::Nccl, None) => Err(
            "the NCCL backend needs a GPU, but this process trains on the CPU; ask for the MPI backend or leave the backend to hearth (`[distributed] backend` in a `hearth run` config, `AcceleratorBuilder::backend` in code)".into(),
        ),
        (Backend::Nccl, Some(device)) if mpi_world => Ok(Join::NcclOverMpi { device }),
        (Backend::Nccl, Some(device)) => {
            let master = env.master.as_deref().unwrap_or_default();
            let (host, port) = master.rsplit_once(':').ok_or_else(|| {
                format!("the NCCL backend finds the other processes through MASTER_ADDR and MASTER_PORT, which are not both set (MASTER_ADDR:MASTER_PORT = {master:?}); torchrun and `hearth launch` set them")
            })?;
            let port: u16 = port
                .parse()
                .map_err(|_| format!("MASTER_PORT={port:?} is not a port number"))?;
            Ok(Join::NcclOverStore {
                device,
                host: host.to_string(),
                port: super::store_port(port, agent_store),
            })
        }
    }
}

/// The process group this process was started in (see [`choose_backend`]
/// and [`LaunchEnv`]), its collectives giving up after `timeout` (by
/// default [`super::DEFAULT_TIMEOUT`], [`super::DEFAULT_NCCL_TIMEOUT`] for NCCL).
/// `cuda_device` is the GPU this process trains on, `None` on the CPU.
pub fn from_environment(
    timeout: Option<Duration>,
    requested: Option<Backend>,
    cuda_device: Option<usize>,
    init_method: &super::InitMethod,
) -> Result<Box<dyn ProcessGroup>, DistError> {
    let refused = |message: String| DistError::Unsupported {
        op: "init",
        backend: "launch",
        message,
    };
    let env = init_method.apply(LaunchEnv::from_env().map_err(|e| refused(e.to_string()))?);
    // torchrun's agent serves its own store on MASTER_PORT: hearth's moves
    // to the next port when it would take the same one.
    let master_port = std::env::var("MASTER_PORT")
        .ok()
        .and_then(|p| p.parse::<u16>().ok());
    let agent_store = std::env::var("TORCHELASTIC_USE_AGENT_STORE").is_ok_and(|v| v == "True")
        && match init_method {
            super::InitMethod::Env => true,
            super::InitMethod::Tcp { port, .. } => Some(*port) == master_port,
        };
    let join = choose_backend(&env, requested, cuda_device, agent_store).map_err(refused)?;
    if matches!(join, Join::NcclOverMpi { .. } | Join::NcclOverStore { .. }) && !NCCL_BUILT {
        return Err(refused(
            "this process trains on a GPU in a world of several processes, which needs the NCCL backend, and this hearth was built without it: rebuild without `--no-default-features`, or train on the CPU (`--cpu`) under mpirun".into(),
        ));
    }
    let gpus = hearth_ops::cuda::device_count();
    if matches!(join, Join::NcclOverMpi { .. } | Join::NcclOverStore { .. })
        && env.local_world_size > gpus
    {
        return Err(refused(format!(
            "{} processes run on this machine but it has {gpus} GPU(s), and NCCL needs a GPU of its own for each: start at most {gpus} per machine (`hearth launch -n {gpus}`), or train on the CPU (`--cpu`) under mpirun",
            env.local_world_size
        )));
    }
    let timeout = timeout.unwrap_or(match join {
        Join::NcclOverMpi { .. } | Join::NcclOverStore { .. } => super::DEFAULT_NCCL_TIMEOUT,
        _ => super::DEFAULT_TIMEOUT,
    });
    match join {
        Join::Single => Ok(Box::new(SingleProcess)),
        Join::Mpi => Ok(Box::new(joined_mpi(&env, timeout)?)),
        #[cfg(feature = "cuda")]
        Join::NcclOverMpi { device } => {
            let mpi = joined_mpi(&env, timeout)?;
            let place = super::NcclPlace {
                rank: mpi.process_index(),
                world_size: mpi.num_processes(),
                local_rank: mpi.local_process_index(),
                local_world_size: mpi.num_local_processes(),
                device,
            };
            let share = |id: Option<Vec<u8>>| mpi.broadcast_bytes(id.unwrap_or_default(), 0);
            let group = super::NcclGroup::init(place, timeout, share)?;
            Ok(Box::new(group.keeping(mpi)))
        }
        #[cfg(feature = "cuda")]
        Join::NcclOverStore { device, host, port } => {
            let token = std::env::var(super::store::JOB_TOKEN_VAR).ok();
            let store =
                super::TcpStore::connect(&host, port, env.rank == 0, timeout, token.as_deref())?;
            let place = super::NcclPlace {
                rank: env.rank,
                world_size: env.world_size,
                local_rank: env.local_rank,
                local_world_size: env.local_world_size,
                device,
            };
            let share = |id: Option<Vec<u8>>| match id {
                Some(id) => store.set("hearth/nccl-id", &id).map(|()| id),
                None => store.get("hearth/nccl-id"),
            };
            let group = super::NcclGroup::init(place, timeout, share)?;
            // Every rank has read the id before rank 0's store may stop.
            store.barrier("hearth/joined", env.rank, env.world_size)?;
            let roll_call = super::roll_call::StoreRollCall {
                store,
                rank: env.rank,
            };
            Ok(Box::new(group.keeping(roll_call)))
        }
        #[cfg(not(feature = "cuda"))]
        Join::NcclOverMpi { .. } | Join::NcclOverStore { .. } => unreachable!("refused above"),
    }
}

/// MPI's world, checked against what the launcher said.
fn joined_mpi(env: &LaunchEnv, timeout: Duration) -> Result<MpiGroup, DistError> {
    let group = MpiGroup::init(timeout)?;
    if (group.process_index(), group.num_processes()) != (env.rank, env.world_size) {
        return Err(DistError::Unsupported {
            op: "init",
            backend: "mpi",
            message: format!(
                "{:?} started this process as rank {} of {}, but MPI sees rank {} of {}; under SLURM start the job with `srun --mpi=pmix` (Open MPI built with PMIx) or with mpirun",
                env.launcher, env.rank, env.world_size, group.process_index(), group.num_processes()
            ),
        });
    }
    Ok(group)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(launcher: Launcher, rank: usize, world: usize, master: Option<&str>) -> LaunchEnv {
        LaunchEnv {
            launcher,
            rank,
            world_size: world,
            local_rank: rank,
            local_world_size: world,
            master: master.map(str::to_string),
        }
    }

    #[test]
    fn each_launcher_and_device_gets_the_backend_of_the_table() {
        let torchrun = env(Launcher::Torchrun, 1, 2, Some("10.0.0.1:29500"));
        let mpirun = env(Launcher::Mpirun, 1, 2, None);
        let alone = env(Launcher::None, 0, 1, None);
        assert_eq!(
            choose_backend(&alone, None, Some(0), false),
            Ok(Join::Single)
        );
        assert_eq!(
            choose_backend(&env(Launcher::Mpirun, 0, 1, None), None, None, false),
            Ok(Join::Mpi),
            "mpirun -n 1 is still MPI's world"
        );
        assert_eq!(choose_backend(&mpirun, None, None, false), Ok(Join::Mpi));
        assert_eq!(
            choose_backend(&mpirun, None, Some(1), false),
            Ok(Join::NcclOverMpi { device: 1 })
        );
        assert_eq!(
            choose_backend(&mpirun, Some(Backend::Mpi), Some(1), false),
            Ok(Join::Mpi),
            "asked for by name"
        );
        let store = |port| Join::NcclOverStore {
            device: 0,
            host: "10.0.0.1".into(),
            port,
        };
        assert_eq!(
            choose_backend(&torchrun, None, Some(0), false),
            Ok(store(29500))
        );
        assert_eq!(
            choose_backend(&torchrun, None, Some(0), true),
            Ok(store(29501)),
            "torchrun's agent holds MASTER_PORT"
        );
        let one = env(Launcher::Torchrun, 0, 1, Some("10.0.0.1:29500"));
        assert_eq!(choose_backend(&one, None, Some(0), false), Ok(Join::Single));
        assert_eq!(
            choose_backend(&one, Some(Backend::Nccl), Some(0), false),
            Ok(store(29500)),
            "NCCL asked for by name in a world of one"
        );
        assert_eq!(
            choose_backend(&alone, Some(Backend::Nccl), Some(0), false),
            Ok(Join::Single),
            "no launcher, no rendezvous"
        );
        let slurm = env(Launcher::Slurm, 0, 4, None);
        assert_eq!(choose_backend(&slurm, None, None, false), Ok(Join::Mpi));
    }

    #[test]
    fn impossible_combinations_say_what_to_do() {
        let torchrun = env(Launcher::Torchrun, 0, 2, Some("localhost:29500"));
        let e = choose_backend(&torchrun, None, None, false).unwrap_err();
        assert!(e.contains("hearth launch --cpu -n 2"), "{e}");
        let e = choose_backend(&torchrun, Some(Backend::Nccl), None, false).unwrap_err();
        assert!(e.contains("needs a GPU"), "{e}");
        let no_master = env(Launcher::Torchrun, 0, 2, Some("localhost"));
        let e = choose_backend(&no_master, None, Some(0), false).unwrap_err();
        assert!(e.contains("MASTER_ADDR and MASTER_PORT"), "{e}");
        let bad_port = env(Launcher::Torchrun, 0, 2, Some("localhost:http"));
        let e = choose_backend(&bad_port, None, Some(0), false).unwrap_err();
        assert!(e.contains("MASTER_PORT=\"http\""), "{e}");
        assert!("gloo"
            .parse::<Backend>()
            .unwrap_err()
            .contains("use mpi for CPU processes or nccl for GPUs"));
        assert!("tcp"
            .parse::<Backend>()
            .unwrap_err()
            .contains("use mpi or nccl"));
        assert_eq!("NCCL".parse::<Backend>(), Ok(Backend::Nccl));
    }
}
