//! How the processes of a job find each other's rendezvous store
//! (Accelerate's `InitProcessGroupKwargs.init_method`, in PyTorch's URL
//! forms).

use super::LaunchEnv;

/// Where the rendezvous store is (`env://` or `tcp://host:port`).
///
/// Only processes started without MPI (torchrun's variables, `hearth
/// launch` on GPUs) rendezvous: an MPI world is mpirun's, and ignores it.
/// PyTorch's `file://` (a shared file) is refused: hearth's store is served
/// over TCP by rank 0.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum InitMethod {
    /// `env://`: `MASTER_ADDR` and `MASTER_PORT`, as the launcher set them
    /// (the default).
    #[default]
    Env,
    /// `tcp://host:port`: rank 0 serves the store there, whatever
    /// `MASTER_ADDR` and `MASTER_PORT` say.
    Tcp {
        /// Rank 0's address, as the other processes reach it.
        host: String,
        /// The store's port.
        port: u16,
    },
}

impl std::str::FromStr for InitMethod {
    type Err = String;

    fn from_str(url: &str) -> Result<Self, String> {
        let url = url.trim();
        if url == "env://" {
            return Ok(Self::Env);
        }
        if let Some(address) = url.strip_prefix("tcp://") {
            let address = address.trim_end_matches('/');
            let (host, port) = address.rsplit_once(':').ok_or_else(|| {
                format!("{url:?} has no port: write tcp://HOST:PORT (e.g. tcp://10.1.1.20:23456)")
            })?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            if host.is_empty() {
                return Err(format!("{url:?} has no host: write tcp://HOST:PORT"));
            }
            let port =
                port.parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(|| {
                    format!("{url:?}: {port:?} is not a port number (1 to 65535)")
                })?;
            return Ok(Self::Tcp {
                host: host.to_string(),
                port,
            });
        }
        if url.starts_with("file://") {
            return Err(format!(
                "{url:?}: hearth's processes rendezvous through a TCP store served by rank 0, not a shared file; give tcp://HOST:PORT, or env:// with MASTER_ADDR and MASTER_PORT"
            ));
        }
        Err(format!(
            "{url:?} is not an init method: write env:// (MASTER_ADDR and MASTER_PORT) or tcp://HOST:PORT"
        ))
    }
}

impl std::fmt::Display for InitMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Env => write!(f, "env://"),
            Self::Tcp { host, port } if host.contains(':') => write!(f, "tcp://[{host}]:{port}"),
            Self::Tcp { host, port } => write!(f, "tcp://{host}:{port}"),
        }
    }
}

impl InitMethod {
    /// `env` with its rendezvous address replaced as this method says.
    pub fn apply(&self, mut env: LaunchEnv) -> LaunchEnv {
        if let Self::Tcp { host, port } = self {
            env.master = Some(format!("{host}:{port}"));
        }
        env
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{choose_backend, Join, Launcher};

    #[test]
    fn urls_parse_as_pytorch_writes_them_and_others_are_refused_saying_what_to_write() {
        assert_eq!("env://".parse(), Ok(InitMethod::Env));
        assert_eq!(
            "tcp://10.1.1.20:23456".parse(),
            Ok(InitMethod::Tcp {
                host: "10.1.1.20".into(),
                port: 23456
            })
        );
        let v6: InitMethod = "tcp://[::1]:29500".parse().unwrap();
        assert_eq!(v6.to_string(), "tcp://[::1]:29500");
        for (bad, says) in [
            ("file:///mnt/nfs/sharedfile", "not a shared file"),
            ("tcp://10.1.1.20", "has no port"),
            ("tcp://:29500", "has no host"),
            ("tcp://host:99999", "not a port number"),
            ("udp://host:1", "not an init method"),
        ] {
            let e = bad.parse::<InitMethod>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn tcp_replaces_the_launchers_address_for_the_nccl_store_and_env_keeps_it() {
        let env = LaunchEnv {
            launcher: Launcher::Torchrun,
            rank: 1,
            world_size: 2,
            local_rank: 1,
            local_world_size: 2,
            master: Some("127.0.0.1:29500".into()),
        };
        let store =
            |method: &InitMethod| choose_backend(&method.apply(env.clone()), None, Some(1), false);
        assert_eq!(
            store(&InitMethod::Env),
            Ok(Join::NcclOverStore {
                device: 1,
                host: "127.0.0.1".into(),
                port: 29500
            })
        );
        let tcp: InitMethod = "tcp://10.0.0.7:23456".parse().unwrap();
        assert_eq!(
            store(&tcp),
            Ok(Join::NcclOverStore {
                device: 1,
                host: "10.0.0.7".into(),
                port: 23456
            })
        );
        // Without MASTER_ADDR, a tcp:// method is enough.
        let bare = LaunchEnv {
            master: None,
            ..env.clone()
        };
        assert!(choose_backend(&bare, None, Some(1), false).is_err());
        assert!(choose_backend(&tcp.apply(bare), None, Some(1), false).is_ok());
    }
}
