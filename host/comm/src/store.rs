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
//! for `SET` `value_len: u32, value`; the reply to `SET` is one byte (0:
//! stored, 1: refused, the store is full), the reply to `GET`
//! `value_len: u32, value` once the key exists, the reply to `CHECK` one
//! byte at once (0: the key exists, 1: not yet).
//!
//! A job token (`HEARTH_JOB_TOKEN`, a random one `hearth launch` gives
//! every rank of a job) keeps other clients out: a store served with one
//! answers nothing until a client's first request, `AUTH` with the token
//! as its key, matches it (reply 0; else 1 and the connection closes).
//! PyTorch's TCPStore has no such check. Lengths are capped on both sides
//! ([`MAX_KEY`], [`MAX_VALUE`], and [`MAX_STORED`] bytes in all), so that a
//! peer cannot make the other allocate what it announces.

use super::DistError;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SET: u8 = 0;
const GET: u8 = 1;
const AUTH: u8 = 2;
const CHECK: u8 = 3;
/// The longest key (or token) a store takes, in bytes.
pub const MAX_KEY: u32 = 4 << 10;
/// The largest value a store takes or a client accepts, in bytes (an NCCL
/// id is 128).
pub const MAX_VALUE: u32 = 1 << 20;
/// What a store holds in all, keys and values, in bytes; a set past it is
/// refused.
pub const MAX_STORED: usize = 64 << 20;
/// Connections a store serves at once; more are closed at once (a job
/// needs one per rank).
pub const MAX_CONNECTIONS: usize = 1024;
/// How long a new connection may take to send its first request (its
/// token, when the store has one) before it is closed.
const FIRST_REQUEST_WITHIN: Duration = Duration::from_secs(if cfg!(test) { 1 } else { 10 });

/// The environment variable that carries a job's token to its ranks.
pub const JOB_TOKEN_VAR: &str = "HEARTH_JOB_TOKEN";

/// A fresh random job token (128 bits, hex), for a launcher to give
/// every rank of a job in [`JOB_TOKEN_VAR`].
pub fn new_job_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

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
    /// The job token this client presented, if any.
    token: Option<String>,
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
    /// in any order; `get` waits at most `timeout` too. With a job `token`,
    /// a served store answers only clients that present it, and this
    /// client presents it.
    pub fn connect(
        host: &str,
        port: u16,
        serve: bool,
        timeout: Duration,
        token: Option<&str>,
    ) -> Result<Self, DistError> {
        let address = format!("{host}:{port}");
        let server = if serve {
            Some(serve_on(port, token.map(str::to_owned)).map_err(|e| {
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
        let store = Self {
            client: Mutex::new(client),
            address,
            timeout,
            token: token.map(str::to_owned),
            _server: server,
        };
        if let Some(token) = token {
            store.authenticate(token)?;
        }
        Ok(store)
    }

    /// Another client of the same store (same token), whose connecting and
    /// every answer wait at most `timeout`: a roll call's, which must not
    /// wait for the whole collective timeout. It connects to the address
    /// this client already reached (no name lookup).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn client_within(&self, timeout: Duration) -> Result<Self, DistError> {
        let unreachable = |e: std::io::Error| {
            failed(
                &self.address,
                format!("the store did not answer within {timeout:?} ({e})"),
            )
        };
        let peer = self
            .client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .peer_addr()
            .map_err(unreachable)?;
        let client = TcpStream::connect_timeout(&peer, timeout).map_err(unreachable)?;
        client.set_nodelay(true).ok();
        client.set_write_timeout(Some(timeout)).ok();
        let store = Self {
            client: Mutex::new(client),
            address: self.address.clone(),
            timeout,
            token: self.token.clone(),
            _server: None,
        };
        if let Some(token) = &self.token {
            store.authenticate(token)?;
        }
        Ok(store)
    }

    /// Whether `key` is set now (never waits for it).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn check(&self, key: &str) -> Result<bool, DistError> {
        self.check_key(key)?;
        let answer = self.exchange(key, &request(CHECK, key), |stream| {
            let mut answer = [0u8; 1];
            stream.read_exact(&mut answer)?;
            Ok(answer.to_vec())
        })?;
        Ok(answer == [0])
    }

    /// Presents the job's `token` to the store.
    fn authenticate(&self, token: &str) -> Result<(), DistError> {
        let accepted = self.exchange("(job token)", &request(AUTH, token), |stream| {
            let mut answer = [0u8; 1];
            stream.read_exact(&mut answer)?;
            Ok(answer.to_vec())
        })?;
        match accepted.as_slice() {
            [0] => Ok(()),
            _ => Err(failed(
                &self.address,
                format!(
                    "the store refused this process's job token: every rank of a job must have the same \
                     {JOB_TOKEN_VAR} (hearth launch gives its ranks one; on several machines, set the same \
                     value on each)"
                ),
            )),
        }
    }

    /// Sets `key` to `value` (a later set replaces it).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), DistError> {
        self.check_key(key)?;
        if value.len() > MAX_VALUE as usize {
            return Err(failed(
                &self.address,
                format!(
                    "key `{key}`: a value of {} bytes is more than the store takes ({MAX_VALUE})",
                    value.len()
                ),
            ));
        }
        let mut frame = request(SET, key);
        frame.extend_from_slice(&(value.len() as u32).to_le_bytes());
        frame.extend_from_slice(value);
        let answer = self.exchange(key, &frame, |stream| {
            let mut answer = [0u8; 1];
            stream.read_exact(&mut answer)?;
            Ok(answer.to_vec())
        })?;
        match answer.as_slice() {
            [0] => Ok(()),
            _ => Err(failed(
                &self.address,
                format!("key `{key}`: the store is full ({MAX_STORED} bytes) and refused it"),
            )),
        }
    }

    fn check_key(&self, key: &str) -> Result<(), DistError> {
        match key.len() > MAX_KEY as usize {
            true => Err(failed(
                &self.address,
                format!(
                    "a key of {} bytes is longer than the store takes ({MAX_KEY})",
                    key.len()
                ),
            )),
            false => Ok(()),
        }
    }

    /// The value of `key`, waiting until some process sets it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, DistError> {
        self.check_key(key)?;
        self.exchange(key, &request(GET, key), |stream| {
            let mut len = [0u8; 4];
            stream.read_exact(&mut len)?;
            let len = u32::from_le_bytes(len);
            if len > MAX_VALUE {
                return Err(std::io::Error::other(format!(
                    "the store announced a value of {len} bytes, more than a store holds ({MAX_VALUE}): \
                     is something other than rank 0's store listening there?"
                )));
            }
            let mut value = vec![0u8; len as usize];
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
                        "key `{key}`: {e} (rank 0, which serves the store, may have stopped, or \
                         refused this process: the ranks of a job need the same {JOB_TOKEN_VAR})"
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
    values: Mutex<Values>,
    changed: tokio::sync::Notify,
    /// The job token clients must present first, if any.
    token: Option<String>,
}

/// The keys and values, and their bytes in all.
#[derive(Default)]
struct Values {
    map: HashMap<String, Vec<u8>>,
    bytes: usize,
}

impl Values {
    /// Stores `value` under `key` unless that takes the store past
    /// [`MAX_STORED`].
    fn insert(&mut self, key: String, value: Vec<u8>) -> bool {
        let old = self.map.get(&key).map_or(0, |v| key.len() + v.len());
        let bytes = self.bytes - old + key.len() + value.len();
        if bytes > MAX_STORED {
            return false;
        }
        self.bytes = bytes;
        self.map.insert(key, value);
        true
    }
}

/// `a == b` in a time that does not depend on where they differ.
fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Listens on every interface at `port` and serves clients (those that
/// present `token`, when given) on a thread of its own until the returned
/// server is dropped.
fn serve_on(port: u16, token: Option<String>) -> std::io::Result<Server> {
    let listener = std::net::TcpListener::bind(("0.0.0.0", port))?;
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("hearth-store".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)
                    .expect("a non-blocking listener registers with tokio");
                let shared = Arc::new(Shared {
                    token,
                    ..Shared::default()
                });
                let live = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let accept = async {
                    loop {
                        let socket = match listener.accept().await {
                            Ok((socket, _)) => socket,
                            // Out of descriptors, a connection reset before
                            // it was taken: keep serving.
                            Err(_) => {
                                tokio::time::sleep(Duration::from_millis(50)).await;
                                continue;
                            }
                        };
                        use std::sync::atomic::Ordering::SeqCst;
                        if live.fetch_add(1, SeqCst) >= MAX_CONNECTIONS {
                            live.fetch_sub(1, SeqCst);
                            continue; // dropped: closed
                        }
                        socket.set_nodelay(true).ok();
                        let (shared, live) = (shared.clone(), live.clone());
                        tokio::spawn(async move {
                            serve_client(socket, shared).await;
                            live.fetch_sub(1, SeqCst);
                        });
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

/// Answers one client's requests until it disconnects, sends garbage or
/// (when the store has a token) fails to present the token first.
async fn serve_client(mut socket: tokio::net::TcpStream, shared: Arc<Shared>) {
    /// A length-prefixed frame of at most `max` bytes (a longer one is
    /// refused before anything is allocated).
    async fn read_frame(socket: &mut tokio::net::TcpStream, max: u32) -> std::io::Result<Vec<u8>> {
        let len = socket.read_u32_le().await?;
        if len > max {
            return Err(std::io::Error::other("frame too large"));
        }
        let mut bytes = vec![0u8; len as usize];
        socket.read_exact(&mut bytes).await?;
        Ok(bytes)
    }
    async fn read_request(socket: &mut tokio::net::TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
        let op = socket.read_u8().await?;
        Ok((op, read_frame(socket, MAX_KEY).await?))
    }
    let mut admitted = shared.token.is_none();
    loop {
        // A client that has not presented the token has a while to do so.
        let request = match admitted {
            true => read_request(&mut socket).await,
            false => tokio::time::timeout(FIRST_REQUEST_WITHIN, read_request(&mut socket))
                .await
                .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())),
        };
        let Ok((op, key)) = request else {
            return;
        };
        if op == AUTH {
            let matches = shared
                .token
                .as_ref()
                .is_none_or(|t| same_token(t.as_bytes(), &key));
            admitted |= matches;
            if socket.write_u8(u8::from(!matches)).await.is_err() || !matches {
                return;
            }
            continue;
        }
        if !admitted {
            return;
        }
        let key = String::from_utf8_lossy(&key).into_owned();
        let answered = match op {
            SET => {
                let Ok(value) = read_frame(&mut socket, MAX_VALUE).await else {
                    return;
                };
                let stored = shared.values.lock().unwrap().insert(key, value);
                shared.changed.notify_waiters();
                socket.write_u8(u8::from(!stored)).await
            }
            GET => {
                let value = loop {
                    // Registered before looking, so a set in between wakes it.
                    let changed = shared.changed.notified();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    if let Some(v) = shared.values.lock().unwrap().map.get(&key) {
                        break v.clone();
                    }
                    // A client gone while it waits frees its connection.
                    let mut probe = [0u8; 1];
                    let peeked = tokio::select! {
                        _ = changed.as_mut() => None,
                        peeked = socket.peek(&mut probe) => Some(peeked),
                    };
                    match peeked {
                        Some(Ok(0) | Err(_)) => return,
                        // Bytes sent while waiting: wait for the value only.
                        Some(Ok(_)) => changed.as_mut().await,
                        None => {}
                    }
                };
                let mut reply = (value.len() as u32).to_le_bytes().to_vec();
                reply.extend_from_slice(&value);
                socket.write_all(&reply).await
            }
            CHECK => {
                let set = shared.values.lock().unwrap().map.contains_key(&key);
                socket.write_u8(u8::from(!set)).await
            }
            _ => return,
        };
        if answered.is_err() {
            return;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A port nothing listens on now.
    pub(crate) fn free_port() -> u16 {
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
            let store = TcpStore::connect("127.0.0.1", port, false, timeout, None).unwrap();
            let id = store.get("nccl/id").unwrap();
            store.barrier("ready", 2, 3).unwrap();
            id
        });
        std::thread::sleep(Duration::from_millis(200));
        let master = TcpStore::connect("127.0.0.1", port, true, timeout, None).unwrap();
        let late = std::thread::spawn(move || {
            let store = TcpStore::connect("127.0.0.1", port, false, timeout, None).unwrap();
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
        let store =
            TcpStore::connect("127.0.0.1", port, true, Duration::from_millis(300), None).unwrap();
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
        let e = TcpStore::connect("127.0.0.1", port, false, Duration::from_millis(300), None)
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
        let e = TcpStore::connect("127.0.0.1", port, true, Duration::from_millis(300), None)
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

    #[test]
    fn only_clients_with_the_jobs_token_are_answered() {
        let port = free_port();
        let timeout = Duration::from_secs(5);
        let master = TcpStore::connect("127.0.0.1", port, true, timeout, Some("s3cret")).unwrap();
        master.set("nccl/id", b"id").unwrap();
        let wrong = TcpStore::connect("127.0.0.1", port, false, timeout, Some("guess"))
            .err()
            .unwrap()
            .to_string();
        assert!(
            wrong.contains("refused this process's job token") && wrong.contains(JOB_TOKEN_VAR),
            "{wrong}"
        );
        let none = TcpStore::connect("127.0.0.1", port, false, timeout, None).unwrap();
        let e = none.get("nccl/id").unwrap_err().to_string();
        assert!(e.contains("`nccl/id`") && e.contains(JOB_TOKEN_VAR), "{e}");
        assert!(none.set("nccl/id", b"evil").is_err());
        let rank = TcpStore::connect("127.0.0.1", port, false, timeout, Some("s3cret")).unwrap();
        assert_eq!(
            rank.get("nccl/id").unwrap(),
            b"id",
            "the others changed nothing"
        );
    }

    /// Sends raw bytes to the store at `port`; true when it closed the
    /// connection without answering.
    fn closes_on(port: u16, bytes: &[u8]) -> bool {
        let mut raw = TcpStream::connect(("127.0.0.1", port)).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = raw.write_all(bytes);
        let mut answer = [0u8; 1];
        matches!(raw.read(&mut answer), Ok(0) | Err(_))
    }

    #[test]
    fn lengths_past_the_caps_are_refused_on_both_sides() {
        let port = free_port();
        let timeout = Duration::from_secs(5);
        let master = TcpStore::connect("127.0.0.1", port, true, timeout, None).unwrap();
        // The server: a key or a value longer than it takes closes the
        // connection before anything that long is allocated.
        let mut huge_key = vec![SET];
        huge_key.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(closes_on(port, &huge_key));
        let mut huge_value = request(SET, "k");
        huge_value.extend_from_slice(&(MAX_VALUE + 1).to_le_bytes());
        assert!(closes_on(port, &huge_value));
        // The client refuses to send one.
        let e = master
            .set("k", &vec![0; MAX_VALUE as usize + 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than the store takes"), "{e}");
        let e = master
            .get(&"k".repeat(MAX_KEY as usize + 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("longer than the store takes"), "{e}");
        // The store still serves.
        master.set("k", b"v").unwrap();
        assert_eq!(master.get("k").unwrap(), b"v");
        // And holds at most MAX_STORED bytes in all.
        let mb = vec![7u8; MAX_VALUE as usize];
        let refused = (0..80)
            .position(|i| master.set(&format!("big/{i}"), &mb).is_err())
            .expect("the store fills up");
        assert_eq!(refused, MAX_STORED / MAX_VALUE as usize - 1);
        let e = master.set("big/x", &mb).unwrap_err().to_string();
        assert!(e.contains("the store is full"), "{e}");
        master.set("small", b"fits").unwrap();
    }

    #[test]
    fn a_client_refuses_a_value_longer_than_a_store_holds() {
        // Something that is not a store answers with a huge length.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let fake = std::thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            let mut request = [0u8; 9]; // GET, length 4, "nccl"
            socket.read_exact(&mut request).unwrap();
            socket.write_all(&u32::MAX.to_le_bytes()).unwrap();
        });
        let client =
            TcpStore::connect("127.0.0.1", port, false, Duration::from_secs(5), None).unwrap();
        let e = client.get("nccl").unwrap_err().to_string();
        assert!(e.contains("announced a value of 4294967295 bytes"), "{e}");
        fake.join().unwrap();
    }

    #[test]
    fn a_client_that_never_presents_the_token_is_closed_and_others_are_served() {
        let port = free_port();
        let timeout = Duration::from_secs(5);
        let master = TcpStore::connect("127.0.0.1", port, true, timeout, Some("t0ken")).unwrap();
        // Idle, and half a request: both closed after FIRST_REQUEST_WITHIN.
        let idle = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let mut slow = TcpStream::connect(("127.0.0.1", port)).unwrap();
        slow.write_all(&[AUTH, 200, 0]).unwrap();
        let started = Instant::now();
        for mut socket in [idle, slow] {
            socket
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut byte = [0u8; 1];
            assert!(
                matches!(socket.read(&mut byte), Ok(0)),
                "closed without an answer"
            );
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        master.set("k", b"v").unwrap();
        let rank = TcpStore::connect("127.0.0.1", port, false, timeout, Some("t0ken")).unwrap();
        assert_eq!(rank.get("k").unwrap(), b"v");
    }

    #[test]
    fn a_client_gone_while_waiting_frees_its_connection() {
        let port = free_port();
        let timeout = Duration::from_secs(5);
        let master = TcpStore::connect("127.0.0.1", port, true, timeout, None).unwrap();
        // More waiting clients than the store serves at once, each gone.
        for _ in 0..MAX_CONNECTIONS + 8 {
            let mut raw = TcpStream::connect(("127.0.0.1", port)).unwrap();
            raw.write_all(&request(GET, "never/set")).unwrap();
        }
        std::thread::sleep(Duration::from_millis(500));
        let rank = TcpStore::connect("127.0.0.1", port, false, timeout, None).unwrap();
        master.set("k", b"v").unwrap();
        assert_eq!(rank.get("k").unwrap(), b"v", "the store still answers");
    }
}
