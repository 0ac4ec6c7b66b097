//! Kinds of traffic real services carry beside short requests, each as a
//! few clients looping until stopped (`hc-backend` serves each kind): the
//! turns they take are long, late or never answered by design, so none of
//! them says anything about a backend's health.

use anyhow::{bail, Result};
use huddle_user::sys::netns::Netns;
use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

/// One kind of traffic, with the number of clients the testbed
/// gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// 8 clients POSTing 48 KiB in 1 KiB pieces over about 2 s.
    Upload,
    /// 4 clients sending the request line, the rest 1.5 s later.
    Dribble,
    /// 4 long polls the backend answers after 3 s.
    LongPoll,
    /// 2 server-push streams: one request, a line every 100 ms for 10 s.
    Push,
    /// 2 one-way streams: the client sends every 50 ms, never answered.
    OneWay,
    /// 100 keep-alive connections, one request each, then idle.
    Idle,
    /// 10 requests a second (5% of 200) to an endpoint taking 200 ms on
    /// every backend.
    SlowEndpoint,
    /// 2 clients asking for a stream they never read.
    StopReading,
}

impl Kind {
    pub const ALL: [Kind; 8] = [
        Kind::Upload,
        Kind::Dribble,
        Kind::LongPoll,
        Kind::Push,
        Kind::OneWay,
        Kind::Idle,
        Kind::SlowEndpoint,
        Kind::StopReading,
    ];

    fn clients(self) -> usize {
        match self {
            Kind::Upload => 8,
            Kind::Dribble | Kind::LongPoll => 4,
            Kind::Push | Kind::OneWay | Kind::StopReading => 2,
            Kind::Idle => 100,
            Kind::SlowEndpoint => 10,
        }
    }
}

/// Exchanges each kind completed and failed.
pub type KindTally = BTreeMap<Kind, (u64, u64)>;

/// The clients of some kinds, running until `stop`.
pub struct Kinds {
    stop: Arc<AtomicBool>,
    handles: Vec<(Kind, thread::JoinHandle<(u64, u64)>)>,
}

impl Kinds {
    /// Starts `kinds` from namespace `ns` toward `vip`.
    #[must_use]
    pub fn start(ns: &Netns, vip: SocketAddr, kinds: &[Kind]) -> Kinds {
        let stop = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        for &kind in kinds {
            for i in 0..kind.clients() {
                let (stop, name) = (stop.clone(), ns.name.clone());
                let h = thread::spawn(move || {
                    huddle_user::sys::netns::enter(&name).expect("enter client namespace");
                    // Spread the clients' starts over a second.
                    thread::sleep(Duration::from_millis((i as u64 * 97) % 1000));
                    client(kind, vip, &stop)
                });
                handles.push((kind, h));
            }
        }
        Kinds { stop, handles }
    }

    /// Stops every client (each within its current exchange's timeout)
    /// and tallies them.
    pub fn stop(self) -> KindTally {
        self.stop.store(true, Ordering::Relaxed);
        let mut t = KindTally::new();
        for (kind, h) in self.handles {
            let (ok, failed) = h.join().unwrap_or((0, 1));
            let e = t.entry(kind).or_default();
            e.0 += ok;
            e.1 += failed;
        }
        t
    }
}

/// One client of `kind`, looping until `stop` (or an hour at most).
fn client(kind: Kind, vip: SocketAddr, stop: &AtomicBool) -> (u64, u64) {
    let (mut ok, mut failed) = (0, 0);
    let until = Instant::now() + Duration::from_secs(3600);
    while !stop.load(Ordering::Relaxed) && Instant::now() < until {
        match exchange(kind, vip, stop) {
            Ok(()) => ok += 1,
            Err(_) => {
                failed += 1;
                thread::sleep(Duration::from_millis(100));
            }
        }
        if kind == Kind::SlowEndpoint {
            thread::sleep(Duration::from_millis(800));
        }
    }
    (ok, failed)
}

/// Sleeps `d` unless stopped first; whether it was stopped.
fn nap(d: Duration, stop: &AtomicBool) -> bool {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if stop.load(Ordering::Relaxed) {
            return true;
        }
        thread::sleep(Duration::from_millis(20).min(end - Instant::now()));
    }
    false
}

/// A connection to `vip` with the timeouts of every kind's client.
pub(crate) fn connect(vip: SocketAddr) -> Result<TcpStream> {
    let s = TcpStream::connect_timeout(&vip, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(15)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Reads one answer's head and its `Content-Length` body; the body,
/// trimmed.
pub(crate) fn answer(r: &mut BufReader<TcpStream>) -> Result<String> {
    let mut len = 0usize;
    let mut first = true;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            bail!("closed before the answer");
        }
        if first && !line.starts_with("HTTP/1.1 200") {
            bail!("answered {line:?}");
        }
        first = false;
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse()?;
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(String::from_utf8_lossy(&body).trim().to_string())
}

fn exchange(kind: Kind, vip: SocketAddr, stop: &AtomicBool) -> Result<()> {
    let mut s = connect(vip)?;
    let mut r = BufReader::new(s.try_clone()?);
    match kind {
        Kind::Upload => {
            s.write_all(b"POST /upload HTTP/1.1\r\nHost: vip\r\nContent-Length: 49152\r\n\r\n")?;
            for _ in 0..48 {
                s.write_all(&[b'u'; 1024])?;
                if nap(Duration::from_millis(42), stop) {
                    return Ok(());
                }
            }
            answer(&mut r).map(drop)
        }
        Kind::Dribble => {
            s.write_all(b"GET /dribbled HTTP/1.1\r\n")?;
            if nap(Duration::from_millis(1500), stop) {
                return Ok(());
            }
            s.write_all(b"Host: vip\r\n\r\n")?;
            answer(&mut r).map(drop)
        }
        Kind::LongPoll => {
            s.write_all(b"GET /poll?ms=3000 HTTP/1.1\r\nHost: vip\r\n\r\n")?;
            answer(&mut r).map(drop)
        }
        Kind::SlowEndpoint => {
            s.write_all(b"GET /slow?ms=200 HTTP/1.1\r\nHost: vip\r\n\r\n")?;
            answer(&mut r).map(drop)
        }
        Kind::Push | Kind::StopReading => {
            let every = if kind == Kind::Push { 100 } else { 1 };
            let req =
                format!("GET /stream?every_ms={every}&for_ms=10000 HTTP/1.1\r\nHost: vip\r\n\r\n");
            s.write_all(req.as_bytes())?;
            if kind == Kind::StopReading {
                // Never reads: the backend's writes stall on the window.
                nap(Duration::from_secs(10), stop);
                return Ok(());
            }
            let mut buf = [0u8; 4096];
            while r.read(&mut buf)? > 0 {
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
            }
            Ok(())
        }
        Kind::OneWay => {
            s.write_all(b"POST /sink HTTP/1.1\r\nHost: vip\r\n\r\n")?;
            for _ in 0..200 {
                s.write_all(b"metric.value 1\n")?;
                if nap(Duration::from_millis(50), stop) {
                    break;
                }
            }
            Ok(())
        }
        Kind::Idle => {
            s.write_all(b"GET / HTTP/1.1\r\nHost: vip\r\n\r\n")?;
            answer(&mut r)?;
            // Held open, idle, until the run ends.
            while !nap(Duration::from_secs(1), stop) {}
            Ok(())
        }
    }
}
