//! Load and clients: the open-loop generator, held and keep-alive
//! connections, one-shot HTTP and UDP requests, and tallies.

use anyhow::{bail, Context, Result};
use huddle_user::sys::netns::Netns;
use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream, UdpSocket},
    sync::atomic::Ordering,
    thread,
    time::{Duration, Instant},
};

/// One request of an open-loop run.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// When it was sent, since the run started.
    pub at: Duration,
    pub latency: Duration,
    /// The backend that answered, or the error.
    pub result: Result<String, String>,
    /// Sent again on a new connection, as HTTP clients do, after a reused
    /// keep-alive connection failed before any byte of the answer.
    pub retried: bool,
}

/// An open-loop load: a new connection and request at a fixed rate,
/// whatever the answers do, so a slow backend cannot hide by slowing the
/// client down.
pub struct OpenLoop {
    pub start: Instant,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: thread::JoinHandle<Vec<Outcome>>,
}

impl OpenLoop {
    /// Starts `rate` requests per second from namespace `ns` to `addr`,
    /// each on a new connection.
    #[must_use]
    pub fn start(ns: &Netns, addr: SocketAddr, rate: f64, timeout: Duration) -> OpenLoop {
        OpenLoop::sessions(ns, addr, rate, timeout, 1)
    }

    /// Starts `rate` requests per second from namespace `ns` to `addr` in
    /// sessions of `per_conn` requests, one after the other on one
    /// keep-alive connection (1: a new connection per request). Sessions
    /// start at `rate / per_conn` a second, whatever the answers do.
    #[must_use]
    pub fn sessions(
        ns: &Netns,
        addr: SocketAddr,
        rate: f64,
        timeout: Duration,
        per_conn: usize,
    ) -> OpenLoop {
        let per_conn = per_conn.max(1);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let name = ns.name.clone();
        let start = Instant::now();
        let handle = thread::spawn(move || {
            huddle_user::sys::netns::enter(&name).expect("enter client namespace");
            let (tx, rx) = std::sync::mpsc::channel();
            let gap = Duration::from_secs_f64(per_conn as f64 / rate);
            let mut n = 0u32;
            // Bounded: stops on the flag, or after an hour's worth at most.
            while !flag.load(Ordering::Relaxed) && f64::from(n) < rate * 3600.0 {
                let due = start + gap * n;
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    thread::sleep(wait);
                }
                let tx = tx.clone();
                // Threads inherit the namespace of the thread creating them.
                thread::spawn(move || {
                    let record = |sent: Instant, r: Result<String, String>, retried: bool| {
                        let _ = tx.send(Outcome {
                            at: sent - start,
                            latency: sent.elapsed(),
                            result: r,
                            retried,
                        });
                    };
                    if per_conn == 1 {
                        let sent = Instant::now();
                        let r = http_get(addr, timeout).map_err(|e| format!("{e:#}"));
                        record(sent, r, false);
                        return;
                    }
                    let sent = Instant::now();
                    let mut conn = match KeepAlive::connect(addr, timeout) {
                        Ok(c) => c,
                        Err(e) => {
                            let e = format!("connect: {e:#}");
                            for _ in 0..per_conn {
                                record(sent, Err(e.clone()), false);
                            }
                            return;
                        }
                    };
                    for k in 0..per_conn {
                        let sent = if k == 0 { sent } else { Instant::now() };
                        let mut r = conn.get();
                        let mut retried = false;
                        // As HTTP clients do (RFC 9112 9.3.1; curl, Go,
                        // browsers): a GET on a reused connection that the
                        // server closed or reset before any byte of its
                        // answer is sent once more on a new connection.
                        // Never after a timeout, never the first request
                        // of a connection.
                        if r.is_err() && k > 0 && conn.got_nothing {
                            retried = true;
                            r = KeepAlive::connect(addr, timeout).and_then(|c| {
                                conn = c;
                                conn.get()
                            });
                        }
                        match r {
                            Ok(b) => record(sent, Ok(b), retried),
                            Err(e) => {
                                // The session is over: its remaining
                                // requests fail with it.
                                let e = format!("{e:#}");
                                for _ in k..per_conn {
                                    record(sent, Err(e.clone()), retried);
                                }
                                return;
                            }
                        }
                    }
                });
                n += 1;
            }
            drop(tx);
            let mut v: Vec<Outcome> = rx.iter().collect();
            v.sort_by_key(|o| o.at);
            v
        });
        OpenLoop {
            start,
            stop,
            handle,
        }
    }

    /// Stops sending, waits for the answers still due, returns them all.
    pub fn stop(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().expect("load thread")
    }
}

/// Long-lived keep-alive connections kept busy: `threads` threads with
/// `per_thread` connections each; every connection asks once a round, a
/// round every `every`. A failed request is an error and retires its
/// connection.
pub struct HeldConnections {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handles: Vec<thread::JoinHandle<Vec<String>>>,
    /// Connections opened (or refused) so far.
    pub opened: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Requests answered or failed so far.
    pub asked: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// The slowest request so far, in microseconds.
    pub slowest_us: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl HeldConnections {
    #[must_use]
    pub fn start(
        ns: &Netns,
        addr: SocketAddr,
        threads: usize,
        per_thread: usize,
        every: Duration,
    ) -> HeldConnections {
        use std::sync::{atomic::AtomicU64, Arc};
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (opened, asked, slowest_us) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let handles = (0..threads)
            .map(|_| {
                let (stop, opened, asked, slowest, ns) = (
                    stop.clone(),
                    opened.clone(),
                    asked.clone(),
                    slowest_us.clone(),
                    ns.name.clone(),
                );
                thread::spawn(move || {
                    huddle_user::sys::netns::enter(&ns).expect("enter client namespace");
                    let mut errors = Vec::new();
                    let mut conns = Vec::new();
                    for _ in 0..per_thread {
                        match KeepAlive::connect(addr, Duration::from_secs(5)) {
                            Ok(c) => conns.push(c),
                            Err(e) => errors.push(format!("connect: {e:#}")),
                        }
                        opened.fetch_add(1, Ordering::Relaxed);
                    }
                    // Bounded even if never stopped.
                    let deadline = Instant::now() + Duration::from_secs(120);
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        let round = Instant::now();
                        conns.retain_mut(|c| {
                            let t0 = Instant::now();
                            let r = c.get();
                            slowest.fetch_max(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                            asked.fetch_add(1, Ordering::Relaxed);
                            match r {
                                Ok(_) => true,
                                Err(e) => {
                                    errors.push(format!("keep-alive request: {e:#}"));
                                    false
                                }
                            }
                        });
                        if let Some(rest) = every.checked_sub(round.elapsed()) {
                            thread::sleep(rest);
                        }
                    }
                    errors
                })
            })
            .collect();
        HeldConnections {
            stop,
            handles,
            opened,
            asked,
            slowest_us,
        }
    }

    /// Waits until every connection was tried.
    pub fn wait_opened(&self, n: u64, limit: Duration) -> Result<()> {
        wait_until(limit, || self.opened.load(Ordering::Relaxed) >= n)
    }

    /// Stops asking; returns every error seen.
    pub fn stop(self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        self.handles
            .into_iter()
            .flat_map(|h| h.join().expect("keep-alive thread"))
            .collect()
    }
}

pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(50));
    }
    bail!("condition not met within {timeout:?}")
}

/// One HTTP/1.0 request for `/` on a new connection; returns the body.
pub fn http_get(addr: SocketAddr, timeout: Duration) -> Result<String> {
    http_get_path(addr, "/", timeout)
}

/// One HTTP/1.0 request for `path` on a new connection; returns the body of
/// a 200 answer.
pub fn http_get_path(addr: SocketAddr, path: &str, timeout: Duration) -> Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(
        format!("GET {path} HTTP/1.0\r\nHost: vip\r\nConnection: close\r\n\r\n").as_bytes(),
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp.split_once("\r\n\r\n").context("no HTTP header end")?;
    // An HTTP/1.0 request may get an HTTP/1.0 answer (hyper's servers do).
    if !(head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200")) {
        bail!("unexpected response {head:?}");
    }
    Ok(body.trim().to_string())
}

/// Answers per backend, and the failures, among `outcomes` sent in
/// [from, to).
#[must_use]
pub fn tally(
    outcomes: &[Outcome],
    from: Duration,
    to: Duration,
) -> (std::collections::BTreeMap<String, u32>, Vec<String>) {
    let mut by = std::collections::BTreeMap::new();
    let mut failed = Vec::new();
    for o in outcomes.iter().filter(|o| o.at >= from && o.at < to) {
        match &o.result {
            Ok(b) => *by.entry(b.clone()).or_default() += 1,
            Err(e) => failed.push(format!("at {:?}: {e}", o.at)),
        }
    }
    (by, failed)
}

/// A keep-alive HTTP/1.1 connection.
pub struct KeepAlive {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    /// The last `get` failed because the server closed or reset the
    /// connection before a single byte of its answer came.
    pub got_nothing: bool,
}

impl KeepAlive {
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<KeepAlive> {
        let s = TcpStream::connect_timeout(&addr, timeout)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_nodelay(true)?;
        Ok(KeepAlive {
            writer: s.try_clone()?,
            reader: BufReader::new(s),
            got_nothing: false,
        })
    }

    /// One request on the connection; returns the body.
    pub fn get(&mut self) -> Result<String> {
        use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
        // Closed or reset by the server before a byte of the answer (not
        // a timeout: the request may still be in the works).
        let closed = |e: &std::io::Error| {
            matches!(e.kind(), ConnectionReset | ConnectionAborted | BrokenPipe)
        };
        self.got_nothing = false;
        if let Err(e) = self
            .writer
            .write_all(b"GET / HTTP/1.1\r\nHost: vip\r\n\r\n")
        {
            self.got_nothing = closed(&e);
            return Err(e.into());
        }
        match self.reader.fill_buf() {
            Ok([]) => {
                self.got_nothing = true;
                bail!("connection closed");
            }
            Ok(_) => {}
            Err(e) => {
                self.got_nothing = closed(&e);
                return Err(e.into());
            }
        }
        let mut len = None;
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line)? == 0 {
                bail!("connection closed");
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = Some(v.trim().parse::<usize>()?);
            }
            if line == "\r\n" {
                break;
            }
        }
        let mut body = vec![0u8; len.context("no content-length")?];
        self.reader.read_exact(&mut body)?;
        Ok(String::from_utf8_lossy(&body).trim().to_string())
    }
}

/// One UDP request from a fresh socket (so a new flow); returns the reply.
pub fn udp_request(addr: SocketAddr, payload: &[u8], timeout: Duration) -> Result<String> {
    let s = UdpSocket::bind("0.0.0.0:0")?;
    s.set_read_timeout(Some(timeout))?;
    s.send_to(payload, addr)?;
    let mut buf = [0u8; 2048];
    let (n, from) = s.recv_from(&mut buf)?;
    if from != addr {
        bail!("reply came from {from}, not {addr}");
    }
    Ok(String::from_utf8_lossy(&buf[..n]).to_string())
}
