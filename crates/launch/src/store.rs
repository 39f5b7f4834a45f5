//! A small TCP key-value store on `MASTER_ADDR:MASTER_PORT` for the rendezvous of a job's
//! processes (the NCCL unique id, a check that every rank arrived): torch's `TCPStore` in
//! spirit. It carries bytes of set-up, never collective traffic, and it admits only its own
//! job: rank 0 serves it on `MASTER_ADDR`'s interface (not every interface), and every client
//! first presents the job's [`StoreToken`].
//!
//! Protocol (little-endian): a connection opens with a hello, `magic: [u8; 4]` (`KLNS`),
//! `version: u8`, `token_len: u32`, `token`, answered like a request; a wrong token (or a
//! client that does not speak the protocol) is answered with status 2 and the connection
//! closed, and the store records and logs the refused client. A request is `op: u8`,
//! `key_len: u32`, `key`, `value_len: u64`, `value`, `wait_ms: u64`; the answer is
//! `status: u8` (0 ok, 1 timed out, 2 refused) and `len: u64`, `bytes`. Operations: set, get
//! (waits for the key up to `wait_ms`), add (an i64 counter, returns the new value).

use super::env::LaunchEnv;
use crate::error::{LaunchError, Result};
use crate::token::StoreToken;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const MAX_KEY: usize = 4096;
const MAX_VALUE: u64 = 64 << 20;
const POLL: Duration = Duration::from_millis(20);
const MAGIC: &[u8; 4] = b"KLNS";
const VERSION: u8 = 1;
const MAX_TOKEN: usize = 4096;

/// A connection to the job's rendezvous store; rank 0's also serves it.
///
/// ```
/// use kiln_launch::{LaunchError, StoreToken, TcpStore};
/// use std::time::Duration;
/// let t = Duration::from_secs(10);
/// let token = StoreToken::new("job-41", "this example");
/// let host = TcpStore::host("127.0.0.1", 0, &token, t)?; // port 0: any free port
/// let client = TcpStore::connect("127.0.0.1", host.port(), &token, t)?;
/// client.set("nccl-id", b"\x01\x02")?;
/// assert_eq!(host.get("nccl-id")?, b"\x01\x02");
/// assert_eq!(host.add("arrived", 1)?, 1);
/// assert_eq!(client.add("arrived", 1)?, 2);
/// // another job's process is refused
/// let stranger = StoreToken::new("job-42", "another job");
/// let e = TcpStore::connect("127.0.0.1", host.port(), &stranger, t).unwrap_err();
/// assert!(matches!(e, LaunchError::Refused { .. }), "{e}");
/// assert_eq!(host.refused_clients().len(), 1);
/// # Ok::<(), kiln_launch::LaunchError>(())
/// ```
#[derive(Debug)]
pub struct TcpStore {
    addr: String,
    port: u16,
    timeout: Duration,
    conn: Mutex<TcpStream>,
    server: Option<Server>,
}

#[derive(Debug)]
struct Server {
    stop: Arc<AtomicBool>,
    refused: Arc<Mutex<Vec<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            // the accept loop polls `stop`; a panicking server has nothing more to report
            let _ = t.join();
        }
    }
}

#[derive(Default)]
struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

fn store_err(addr: &str, message: impl Into<String>) -> LaunchError {
    LaunchError::Store {
        addr: addr.to_string(),
        message: message.into(),
    }
}

impl TcpStore {
    /// Serves the store on `port` of the interface `bind` resolves to (the job's
    /// `MASTER_ADDR`; `0`: a free port, see [`TcpStore::port`]), admitting only clients that
    /// present `token`, and connects to it. `timeout` bounds every wait of this handle.
    pub fn host(bind: &str, port: u16, token: &StoreToken, timeout: Duration) -> Result<TcpStore> {
        let at = format!("{bind}:{port}");
        let listener = TcpListener::bind((bind, port))
            .map_err(|e| store_err(&at, format!("cannot listen: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| store_err(&at, e.to_string()))?;
        let port = local.port();
        listener
            .set_nonblocking(true)
            .map_err(|e| store_err(&at, e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(Mutex::new(Vec::new()));
        let shared = Arc::new(Shared {
            table: Table::default(),
            token: token.clone(),
            refused: refused.clone(),
            addr: local.to_string(),
        });
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kiln-store".into())
            .spawn(move || serve(&listener, &shared, &s))
            .map_err(|e| store_err(&at, e.to_string()))?;
        let server = Server {
            stop,
            refused,
            thread: Some(thread),
        };
        // a store bound to every interface is reached on the loopback one
        let ip = if local.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else {
            local.ip().to_string()
        };
        let mut store = TcpStore::connect(&ip, port, token, timeout)?;
        store.server = Some(server);
        Ok(store)
    }

    /// Connects to a store at `host:port` and presents `token`, retrying the connection until
    /// `timeout` (the host may start later). A store that refuses the token is
    /// [`LaunchError::Refused`] at once.
    pub fn connect(
        host: &str,
        port: u16,
        token: &StoreToken,
        timeout: Duration,
    ) -> Result<TcpStore> {
        let addr = format!("{host}:{port}");
        let start = Instant::now();
        let mut last = String::from("no address");
        loop {
            let addrs = (host, port)
                .to_socket_addrs()
                .map_err(|e| store_err(&addr, format!("cannot resolve the host: {e}")))?;
            for a in addrs {
                match TcpStream::connect_timeout(&a, Duration::from_secs(1)) {
                    Ok(s) => {
                        s.set_nodelay(true)
                            .map_err(|e| store_err(&addr, e.to_string()))?;
                        let store = TcpStore {
                            addr: addr.clone(),
                            port,
                            timeout,
                            conn: Mutex::new(s),
                            server: None,
                        };
                        store.hello(token)?;
                        return Ok(store);
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            if start.elapsed() >= timeout {
                return Err(store_err(
                    &addr,
                    format!("no store answered within {timeout:?} (last error: {last})"),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Presents the token; a refusal names this end of the connection.
    fn hello(&self, token: &StoreToken) -> Result<()> {
        let mut msg = Vec::with_capacity(9 + token.value().len());
        msg.extend_from_slice(MAGIC);
        msg.push(VERSION);
        msg.extend_from_slice(&(token.value().len() as u32).to_le_bytes());
        msg.extend_from_slice(token.value().as_bytes());
        match self.exchange(&msg, Duration::ZERO, "hello") {
            Ok(_) => Ok(()),
            Err(Answer::Refused(why)) => {
                let conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
                let me = conn
                    .local_addr()
                    .map_or_else(|_| "an unknown address".into(), |a| a.to_string());
                Err(LaunchError::Refused {
                    addr: self.addr.clone(),
                    client: format!("{me}, pid {}", std::process::id()),
                    reason: format!(
                        "{why}: its token (from {}) is not the one of the job the store serves",
                        token.source()
                    ),
                })
            }
            Err(Answer::Failed(e)) => Err(e),
        }
    }

    /// The clients the store refused (`host:port` and why), in order; empty on a handle that
    /// does not serve the store.
    pub fn refused_clients(&self) -> Vec<String> {
        self.server.as_ref().map_or_else(Vec::new, |s| {
            s.refused
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        })
    }

    /// Rank 0 of `env` hosts the store on `MASTER_ADDR:MASTER_PORT`; every rank connects to
    /// it; all of them with the job's token ([`LaunchEnv::store_token`]).
    pub fn for_rank(env: &LaunchEnv, timeout: Duration) -> Result<TcpStore> {
        let Some((host, port)) = env.master() else {
            return Err(LaunchError::Env {
                variable: "MASTER_ADDR, MASTER_PORT".into(),
                message: "the rendezvous store needs both".into(),
            });
        };
        if env.rank == 0 {
            TcpStore::host(host, port, &env.store_token, timeout)
        } else {
            TcpStore::connect(host, port, &env.store_token, timeout)
        }
    }

    /// The port of the store.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Sets `key` to `value`, waking every rank waiting for it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.request(OP_SET, key, value, Duration::ZERO).map(|_| ())
    }

    /// The value of `key`, waiting for it up to the timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.request(OP_GET, key, &[], self.timeout)
    }

    /// Adds `delta` to the counter `key` (0 when unset) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let v = self.request(OP_ADD, key, &delta.to_le_bytes(), Duration::ZERO)?;
        let bytes: [u8; 8] = v
            .as_slice()
            .try_into()
            .map_err(|_| store_err(&self.addr, format!("add {key}: a malformed answer")))?;
        Ok(i64::from_le_bytes(bytes))
    }

    /// Records that `rank` of `world` arrived (with this host and process id) and waits for
    /// every other rank; returns each rank's `host:pid`. Two processes claiming one rank is an
    /// error naming it.
    pub fn check_in(&self, rank: usize, world: usize) -> Result<Vec<String>> {
        let claims = self.add(&format!("kiln/claims/{rank}"), 1)?;
        if claims > 1 {
            return Err(store_err(
                &self.addr,
                format!("rank {rank} was claimed by {claims} processes (a RANK set twice?)"),
            ));
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "unknown-host".into());
        let me = format!("{host}:{}", std::process::id());
        self.set(&format!("kiln/rank/{rank}"), me.as_bytes())?;
        (0..world)
            .map(|r| {
                self.get(&format!("kiln/rank/{r}"))
                    .map(|v| String::from_utf8_lossy(&v).into_owned())
                    .map_err(|e| match e {
                        LaunchError::Store { addr, message } => LaunchError::Store {
                            addr,
                            message: format!("rank {r} of {world} never checked in: {message}"),
                        },
                        e => e,
                    })
            })
            .collect()
    }

    fn request(&self, op: u8, key: &str, value: &[u8], wait: Duration) -> Result<Vec<u8>> {
        if key.len() > MAX_KEY || value.len() as u64 > MAX_VALUE {
            return Err(store_err(
                &self.addr,
                format!("key {key:.40} or its value is too large"),
            ));
        }
        let mut msg = Vec::with_capacity(21 + key.len() + value.len());
        msg.push(op);
        msg.extend_from_slice(&(key.len() as u32).to_le_bytes());
        msg.extend_from_slice(key.as_bytes());
        msg.extend_from_slice(&(value.len() as u64).to_le_bytes());
        msg.extend_from_slice(value);
        msg.extend_from_slice(&(wait.as_millis() as u64).to_le_bytes());
        self.exchange(&msg, wait, key).map_err(|a| match a {
            Answer::Failed(e) => e,
            Answer::Refused(why) => store_err(&self.addr, format!("{key}: refused: {why}")),
        })
    }

    /// Sends `msg` and reads the answer, which the server gives within `wait`.
    fn exchange(&self, msg: &[u8], wait: Duration, what: &str) -> Result<Vec<u8>, Answer> {
        let io = |e: std::io::Error| Answer::Failed(store_err(&self.addr, format!("{what}: {e}")));
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        conn.write_all(msg).map_err(io)?;
        // allow the server a margin to reply
        conn.set_read_timeout(Some(wait + Duration::from_secs(30)))
            .map_err(io)?;
        let mut head = [0u8; 9];
        conn.read_exact(&mut head).map_err(io)?;
        let len = u64::from_le_bytes(head[1..9].try_into().unwrap_or_default());
        if len > MAX_VALUE {
            return Err(Answer::Failed(store_err(
                &self.addr,
                format!("{what}: a malformed answer"),
            )));
        }
        let mut body = vec![0u8; len as usize];
        conn.read_exact(&mut body).map_err(io)?;
        match head[0] {
            0 => Ok(body),
            1 => Err(Answer::Failed(store_err(
                &self.addr,
                format!("key {what} was not set within {wait:?}"),
            ))),
            _ => Err(Answer::Refused(String::from_utf8_lossy(&body).into_owned())),
        }
    }
}

/// A failed exchange: refused by the server (status 2, with its reason), or anything else.
enum Answer {
    Refused(String),
    Failed(LaunchError),
}

/// What the server's threads share.
struct Shared {
    table: Table,
    token: StoreToken,
    refused: Arc<Mutex<Vec<String>>>,
    /// The address it listens on, for its log lines.
    addr: String,
}

fn serve(listener: &TcpListener, shared: &Arc<Shared>, stop: &Arc<AtomicBool>) {
    let mut workers = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let (sh, s) = (shared.clone(), stop.clone());
                if let Ok(h) = std::thread::Builder::new()
                    .name("kiln-store-conn".into())
                    .spawn(move || serve_conn(stream, &peer.to_string(), &sh, &s))
                {
                    workers.push(h);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(_) => std::thread::sleep(POLL),
        }
    }
    shared.table.changed.notify_all();
    for w in workers {
        let _ = w.join();
    }
}

/// Reads a client's hello; `Err` with the reason to refuse it (`None`: the client left).
fn read_hello(s: &mut TcpStream, shared: &Shared, stop: &AtomicBool) -> Result<(), Option<String>> {
    let mut head = [0u8; 9];
    if !read_full(s, &mut head, stop) {
        return Err(None);
    }
    if &head[..4] != MAGIC {
        return Err(Some("not a kiln rendezvous client".into()));
    }
    if head[4] != VERSION {
        return Err(Some(format!(
            "protocol version {} (this store speaks {VERSION})",
            head[4]
        )));
    }
    let len = u32::from_le_bytes([head[5], head[6], head[7], head[8]]) as usize;
    if len > MAX_TOKEN {
        return Err(Some(format!("a token of {len} bytes")));
    }
    let mut token = vec![0u8; len];
    if !read_full(s, &mut token, stop) {
        return Err(None);
    }
    if shared.token.admits(&token) {
        Ok(())
    } else {
        Err(Some("wrong rendezvous token".into()))
    }
}

/// Reads exactly `buf.len()` bytes, giving up when the server stops; false at end of stream.
fn read_full(s: &mut TcpStream, buf: &mut [u8], stop: &AtomicBool) -> bool {
    let mut got = 0;
    while got < buf.len() {
        if stop.load(Ordering::SeqCst) {
            return false;
        }
        match s.read(&mut buf[got..]) {
            Ok(0) => return false,
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

fn serve_conn(mut s: TcpStream, peer: &str, shared: &Shared, stop: &AtomicBool) {
    if s.set_read_timeout(Some(POLL * 5)).is_err() || s.set_nodelay(true).is_err() {
        return;
    }
    match read_hello(&mut s, shared, stop) {
        Ok(()) => {
            if reply(&mut s, 0, &[]).is_err() {
                return;
            }
        }
        Err(None) => return,
        Err(Some(why)) => {
            // the job goes on: only this connection is closed
            eprintln!(
                "kiln rendezvous store on {}: refused the client {peer}: {why}",
                shared.addr
            );
            shared
                .refused
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(format!("{peer}: {why}"));
            let _ = reply(&mut s, 2, why.as_bytes());
            let _ = s.shutdown(Shutdown::Both);
            return;
        }
    }
    let table = &shared.table;
    loop {
        let mut head = [0u8; 5];
        if !read_full(&mut s, &mut head, stop) {
            break;
        }
        let klen = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if klen > MAX_KEY {
            let _ = reply(&mut s, 2, b"key too long");
            break;
        }
        let mut key = vec![0u8; klen];
        let mut vlen = [0u8; 8];
        if !read_full(&mut s, &mut key, stop) || !read_full(&mut s, &mut vlen, stop) {
            break;
        }
        let vlen = u64::from_le_bytes(vlen);
        if vlen > MAX_VALUE {
            let _ = reply(&mut s, 2, b"value too large");
            break;
        }
        let mut value = vec![0u8; vlen as usize];
        let mut wait = [0u8; 8];
        if !read_full(&mut s, &mut value, stop) || !read_full(&mut s, &mut wait, stop) {
            break;
        }
        let key = String::from_utf8_lossy(&key).into_owned();
        let wait = Duration::from_millis(u64::from_le_bytes(wait));
        let (status, body) = match head[0] {
            OP_SET => {
                table
                    .map
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(key, value);
                table.changed.notify_all();
                (0, Vec::new())
            }
            OP_GET => {
                let deadline = Instant::now() + wait;
                let mut map = table.map.lock().unwrap_or_else(PoisonError::into_inner);
                loop {
                    if let Some(v) = map.get(&key) {
                        break (0, v.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline || stop.load(Ordering::SeqCst) {
                        break (1, Vec::new());
                    }
                    map = table
                        .changed
                        .wait_timeout(map, (deadline - now).min(POLL * 5))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
            OP_ADD => {
                let delta = value
                    .as_slice()
                    .try_into()
                    .map(i64::from_le_bytes)
                    .unwrap_or(0);
                let mut map = table.map.lock().unwrap_or_else(PoisonError::into_inner);
                let old = map
                    .get(&key)
                    .and_then(|v| v.as_slice().try_into().ok())
                    .map(i64::from_le_bytes)
                    .unwrap_or(0);
                let new = old.wrapping_add(delta);
                map.insert(key, new.to_le_bytes().to_vec());
                drop(map);
                table.changed.notify_all();
                (0, new.to_le_bytes().to_vec())
            }
            _ => (2, b"unknown operation".to_vec()),
        };
        if reply(&mut s, status, &body).is_err() {
            break;
        }
    }
    let _ = s.shutdown(Shutdown::Both);
}

fn reply(s: &mut TcpStream, status: u8, body: &[u8]) -> std::io::Result<()> {
    let mut msg = Vec::with_capacity(9 + body.len());
    msg.push(status);
    msg.extend_from_slice(&(body.len() as u64).to_le_bytes());
    msg.extend_from_slice(body);
    s.write_all(&msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> StoreToken {
        StoreToken::new("the-job", "the test")
    }

    #[test]
    fn ranks_exchange_values_and_check_in() {
        let t = Duration::from_secs(20);
        let host = TcpStore::host("127.0.0.1", 0, &token(), t).unwrap();
        let port = host.port();
        let outs: Vec<Vec<String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (1..4)
                .map(|r| {
                    s.spawn(move || {
                        let c = TcpStore::connect("localhost", port, &token(), t).unwrap();
                        // a get before the set waits for it
                        assert_eq!(c.get("id").unwrap(), b"unique-id");
                        c.check_in(r, 4).unwrap()
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(100));
            host.set("id", b"unique-id").unwrap();
            let mine = host.check_in(0, 4).unwrap();
            let mut all = vec![mine];
            all.extend(hs.into_iter().map(|h| h.join().unwrap()));
            all
        });
        for o in &outs {
            assert_eq!(o, &outs[0]);
            assert_eq!(o.len(), 4);
        }
        assert_eq!(host.add("n", 5).unwrap(), 5);
        assert_eq!(host.add("n", -2).unwrap(), 3);
        assert!(host.refused_clients().is_empty());
    }

    #[test]
    fn a_wrong_token_is_refused_and_named_and_the_job_goes_on() {
        let t = Duration::from_secs(20);
        let host = TcpStore::host("127.0.0.1", 0, &token(), t).unwrap();
        let port = host.port();
        let right = TcpStore::connect("127.0.0.1", port, &token(), t).unwrap();
        right.set("before", b"1").unwrap();

        // another job's process: refused at once, with a typed error naming the store, this
        // process's end of the connection and where its token came from
        let stranger = StoreToken::new("another-job", "KILN_STORE_TOKEN");
        let started = Instant::now();
        let e = TcpStore::connect("127.0.0.1", port, &stranger, t).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5), "not retried");
        let LaunchError::Refused {
            addr,
            client,
            reason,
        } = &e
        else {
            panic!("expected Refused, got {e}");
        };
        assert_eq!(addr, &format!("127.0.0.1:{port}"));
        assert!(client.starts_with("127.0.0.1:"), "{client}");
        assert!(
            client.contains(&format!("pid {}", std::process::id())),
            "{client}"
        );
        assert!(reason.contains("wrong rendezvous token"), "{reason}");
        assert!(reason.contains("KILN_STORE_TOKEN"), "{reason}");
        // the store named the client it refused: the port of the refused connection
        let client_addr = client.split(',').next().unwrap();
        let refused = host.refused_clients();
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(
            refused[0].starts_with(client_addr),
            "{refused:?} vs {client}"
        );

        // a client that does not speak the protocol at all is refused too
        let mut raw = TcpStream::connect(("127.0.0.1", port)).unwrap();
        raw.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut answer = Vec::new();
        raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = raw.read_to_end(&mut answer);
        assert_eq!(answer.first(), Some(&2), "status 2: refused");
        assert!(String::from_utf8_lossy(&answer).contains("not a kiln rendezvous client"));
        assert_eq!(host.refused_clients().len(), 2);

        // the job is unharmed: the admitted client and a new one with the right token work
        assert_eq!(right.get("before").unwrap(), b"1");
        let late = TcpStore::connect("127.0.0.1", port, &token(), t).unwrap();
        assert_eq!(late.add("n", 2).unwrap(), 2);
        assert_eq!(right.add("n", 1).unwrap(), 3);
    }

    #[test]
    fn the_store_listens_on_the_given_interface_only() {
        let t = Duration::from_secs(5);
        let host = TcpStore::host("127.0.0.1", 0, &token(), t).unwrap();
        // 127.0.0.2 is loopback too, but not the address the store was bound to
        let other = TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 2], host.port())),
            Duration::from_secs(2),
        );
        assert!(
            other.is_err(),
            "the store must not listen on every interface"
        );
        let e = TcpStore::connect(
            "127.0.0.2",
            host.port(),
            &token(),
            Duration::from_millis(300),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("no store answered"), "{e}");
    }

    #[test]
    fn waits_and_connections_time_out_with_clear_errors() {
        let host = TcpStore::host("127.0.0.1", 0, &token(), Duration::from_millis(300)).unwrap();
        let t = Instant::now();
        let e = host.get("never").unwrap_err().to_string();
        assert!(e.contains("key never was not set within 300ms"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
        // a second claim of one rank is refused
        host.check_in(0, 1).unwrap();
        let e = host.check_in(0, 1).unwrap_err().to_string();
        assert!(e.contains("rank 0 was claimed by 2 processes"), "{e}");
        // nobody listens on the port a dropped store used
        let port = host.port();
        drop(host);
        let e = TcpStore::connect("127.0.0.1", port, &token(), Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
        assert!(e.contains("no store answered"), "{e}");
    }
}
