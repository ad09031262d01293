//! The rendezvous store: a small key-value store over TCP that processes
//! started without MPI (torchrun's variables, `hearth launch` on GPUs) use
//! to agree on what they need before their communicator exists — the NCCL
//! unique id. Rank 0 serves it at `MASTER_ADDR:MASTER_PORT`; every rank,
//! rank 0 included, is a client. `get` waits until the key is set, under
//! the store's timeout (PyTorch's `TCPStore`, in spirit; not its protocol).
//!
//! Under torchrun the agent's own store already listens on `MASTER_PORT`
//! (`TORCHELASTIC_USE_AGENT_STORE=True`); hearth's then listens on the
//! next port (see [`store_port`]).
//!
//! Frames, little-endian: a request is `op: u8, key_len: u32, key`, then
//! for `SET` `value_len: u32, value`; the reply to `SET` is one byte 0, the
//! reply to `GET` `value_len: u32, value` once the key exists.

use super::DistError;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SET: u8 = 0;
const GET: u8 = 1;
/// Larger keys or values are refused (an id or a small object fits easily).
const MAX_FRAME: u32 = 64 << 20;

/// The port hearth's store listens on for a job whose `MASTER_PORT` is
/// `master_port`: the next one when torchrun's agent holds that one.
pub fn store_port(master_port: u16, agent_store: bool) -> u16 {
    if agent_store {
        master_port.wrapping_add(1)
    } else {
        master_port
    }
}

/// A client of the job's store; on rank 0 also its server.
pub struct TcpStore {
    client: Mutex<TcpStream>,
    address: String,
    timeout: Duration,
    /// The server's runtime (rank 0): dropping it stops serving.
    _server: Option<Server>,
}

struct Server {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn failed(address: &str, message: String) -> DistError {
    DistError::Rendezvous {
        address: address.to_string(),
        message,
    }
}

impl TcpStore {
    /// Connects to the store at `host:port`, serving it first when `serve`
    /// (rank 0). Connecting retries until `timeout`, so the ranks may start
    /// in any order; `get` waits at most `timeout` too.
    pub fn connect(
        host: &str,
        port: u16,
        serve: bool,
        timeout: Duration,
    ) -> Result<Self, DistError> {
        let address = format!("{host}:{port}");
        let server = if serve {
            Some(serve_on(port).map_err(|e| {
                failed(
                    &address,
                    format!("rank 0 cannot listen on port {port}: {e}; choose another MASTER_PORT"),
                )
            })?)
        } else {
            None
        };
        let deadline = Instant::now() + timeout;
        let client = loop {
            match TcpStream::connect(&address) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() >= deadline => {
                    return Err(failed(
                        &address,
                        format!("no store answered within {timeout:?} ({e}); is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every process?"),
                    ))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        client.set_nodelay(true).ok();
        Ok(Self {
            client: Mutex::new(client),
            address,
            timeout,
            _server: server,
        })
    }

    /// Sets `key` to `value` (a later set replaces it).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), DistError> {
        let mut frame = request(SET, key);
        frame.extend_from_slice(&(value.len() as u32).to_le_bytes());
        frame.extend_from_slice(value);
        self.exchange(key, &frame, |stream| {
            let mut ok = [0u8; 1];
            stream.read_exact(&mut ok)?;
            Ok(Vec::new())
        })
        .map(drop)
    }

    /// The value of `key`, waiting until some process sets it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, DistError> {
        self.exchange(key, &request(GET, key), |stream| {
            let mut len = [0u8; 4];
            stream.read_exact(&mut len)?;
            let mut value = vec![0u8; u32::from_le_bytes(len) as usize];
            stream.read_exact(&mut value)?;
            Ok(value)
        })
    }

    /// Returns once every one of `world` processes has reached the
    /// barrier named `name` (each calls it with its `rank`).
    pub fn barrier(&self, name: &str, rank: usize, world: usize) -> Result<(), DistError> {
        self.set(&format!("{name}/{rank}"), &[])?;
        (0..world).try_for_each(|r| self.get(&format!("{name}/{r}")).map(drop))
    }

    fn exchange(
        &self,
        key: &str,
        frame: &[u8],
        reply: impl FnOnce(&mut TcpStream) -> std::io::Result<Vec<u8>>,
    ) -> Result<Vec<u8>, DistError> {
        let mut stream = self.client.lock().unwrap_or_else(|p| p.into_inner());
        stream.set_read_timeout(Some(self.timeout)).ok();
        stream
            .write_all(frame)
            .and_then(|()| reply(&mut stream))
            .map_err(|e| {
                let why = match e.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                        "key `{key}` was not set within {:?}: another process stopped or hangs",
                        self.timeout
                    ),
                    _ => format!(
                        "key `{key}`: {e} (rank 0, which serves the store, may have stopped)"
                    ),
                };
                failed(&self.address, why)
            })
    }
}

fn request(op: u8, key: &str) -> Vec<u8> {
    let mut frame = vec![op];
    frame.extend_from_slice(&(key.len() as u32).to_le_bytes());
    frame.extend_from_slice(key.as_bytes());
    frame
}

/// The store's contents and a signal for waiting readers.
#[derive(Default)]
struct Shared {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: tokio::sync::Notify,
}

/// Listens on every interface at `port` and serves clients on a thread of
/// its own until the returned server is dropped.
fn serve_on(port: u16) -> std::io::Result<Server> {
    let listener = std::net::TcpListener::bind(("0.0.0.0", port))?;
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("hearth-store".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)
                    .expect("a non-blocking listener registers with tokio");
                let shared = Arc::new(Shared::default());
                let accept = async {
                    while let Ok((socket, _)) = listener.accept().await {
                        socket.set_nodelay(true).ok();
                        tokio::spawn(serve_client(socket, shared.clone()));
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = stopped => {}
                }
            })
        })?;
    Ok(Server {
        stop: Some(stop),
        thread: Some(thread),
    })
}

/// Answers one client's requests until it disconnects or sends garbage.
async fn serve_client(mut socket: tokio::net::TcpStream, shared: Arc<Shared>) {
    async fn read_frame(socket: &mut tokio::net::TcpStream) -> std::io::Result<Vec<u8>> {
        let len = socket.read_u32_le().await?;
        if len > MAX_FRAME {
            return Err(std::io::Error::other("frame too large"));
        }
        let mut bytes = vec![0u8; len as usize];
        socket.read_exact(&mut bytes).await?;
        Ok(bytes)
    }
    loop {
        let Ok(op) = socket.read_u8().await else {
            return;
        };
        let Ok(key) = read_frame(&mut socket).await else {
            return;
        };
        let key = String::from_utf8_lossy(&key).into_owned();
        let answered = match op {
            SET => {
                let Ok(value) = read_frame(&mut socket).await else {
                    return;
                };
                shared.values.lock().unwrap().insert(key, value);
                shared.changed.notify_waiters();
                socket.write_u8(0).await
            }
            GET => {
                let value = loop {
                    // Registered before looking, so a set in between wakes it.
                    let changed = shared.changed.notified();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    if let Some(v) = shared.values.lock().unwrap().get(&key) {
                        break v.clone();
                    }
                    changed.await;
                };
                let mut reply = (value.len() as u32).to_le_bytes().to_vec();
                reply.extend_from_slice(&value);
                socket.write_all(&reply).await
            }
            _ => return,
        };
        if answered.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn ranks_exchange_values_and_meet_at_a_barrier_in_any_start_order() {
        let port = free_port();
        let timeout = Duration::from_secs(10);
        // Rank 2 starts before rank 0 serves: it retries until the store is up.
        let early = std::thread::spawn(move || {
            let store = TcpStore::connect("127.0.0.1", port, false, timeout).unwrap();
            let id = store.get("nccl/id").unwrap();
            store.barrier("ready", 2, 3).unwrap();
            id
        });
        std::thread::sleep(Duration::from_millis(200));
        let master = TcpStore::connect("127.0.0.1", port, true, timeout).unwrap();
        let late = std::thread::spawn(move || {
            let store = TcpStore::connect("127.0.0.1", port, false, timeout).unwrap();
            let id = store.get("nccl/id").unwrap();
            store.barrier("ready", 1, 3).unwrap();
            id
        });
        std::thread::sleep(Duration::from_millis(100));
        let id: Vec<u8> = (0..128).collect();
        master.set("nccl/id", &id).unwrap();
        master.barrier("ready", 0, 3).unwrap();
        assert_eq!(early.join().unwrap(), id);
        assert_eq!(late.join().unwrap(), id);
        assert_eq!(master.get("nccl/id").unwrap(), id);
    }

    #[test]
    fn a_key_nobody_sets_fails_after_the_timeout_naming_it() {
        let port = free_port();
        let store = TcpStore::connect("127.0.0.1", port, true, Duration::from_millis(300)).unwrap();
        let started = Instant::now();
        let e = store.get("nccl/id").unwrap_err().to_string();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(
            e.contains(&format!("127.0.0.1:{port}"))
                && e.contains("`nccl/id` was not set within 300ms"),
            "{e}"
        );
    }

    #[test]
    fn no_store_at_the_address_fails_saying_what_to_check() {
        let port = free_port();
        let e = TcpStore::connect("127.0.0.1", port, false, Duration::from_millis(300))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("is rank 0 running") && e.contains("MASTER_PORT"),
            "{e}"
        );
    }

    #[test]
    fn a_port_in_use_is_refused_on_rank_0() {
        let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let e = TcpStore::connect("127.0.0.1", port, true, Duration::from_millis(300))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(&format!("cannot listen on port {port}")), "{e}");
    }

    #[test]
    fn torchruns_agent_store_moves_hearths_to_the_next_port() {
        assert_eq!(store_port(29500, false), 29500);
        assert_eq!(store_port(29500, true), 29501);
    }
}
