//! A test backend: an HTTP/1.1 server (keep-alive aware) whose body names
//! the backend, and a UDP echo that prefixes the backend's name.
//!
//! `hc-backend --id NAME [--http PORT] [--udp PORT] [--delay-ms N]`
//!
//! Its behaviour changes while it runs, through its own HTTP port:
//! - `GET /admin?delay_ms=N` sets the service time of every other request;
//! - `GET /admin?slow_for=ADDR:PORT:MS` adds MS to requests reaching the
//!   local IPv4 address and port only (one process serving many backends:
//!   `--more-ports FIRST-LAST`);
//! - `GET /admin?status=N` sets the status it answers with (500: failing);
//! - `GET /admin?cpu=F` sets the CPU utilisation (0..1) its `/metrics`
//!   reports, under node_exporter's names, next to its real memory;
//! - `GET /admin?metrics=M` makes `/metrics` misbehave: 1 hangs, 2 answers
//!   garbage, 3 NaN, 4 negative values, 5 absurdly huge values, 6 a 10 MB
//!   body; 0 is normal again.
//!
//! Killing it (connections refused) and SIGSTOP (the kernel still completes
//! handshakes, nothing answers) are done from outside.
//!
//! Kinds of traffic real services carry, by path (a request body is read
//! as its `Content-Length` says, so uploads work):
//! - `/poll?ms=N`: a long poll, answered N ms after the request;
//! - `/slow?ms=N`: an endpoint that takes N ms (instead of the delay);
//! - `/stream?every_ms=N&for_ms=M`: server push, a line every N ms for M
//!   ms, then the connection closes;
//! - `/bytes?n=N`: a download, N bytes in one write after a line naming
//!   the backend (what a hung process's kernel goes on sending);
//! - `/sink`: one-way, everything the client sends is read, nothing is
//!   ever answered.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream, UdpSocket},
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex,
    },
    thread,
    time::{Duration, Instant},
};

static DELAY_US: AtomicU64 = AtomicU64::new(0);
/// Extra service time for requests to one local IPv4 address and port
/// only (`slow_for`), as address << 32 | port << 16 | ms; 0: none. One
/// process serves many backends in the scale bench.
static SLOW_FOR: AtomicU64 = AtomicU64::new(0);
static STATUS: AtomicU64 = AtomicU64::new(200);
/// How `/metrics` behaves (see the module doc).
static METRICS_MODE: AtomicU64 = AtomicU64::new(0);
/// CPU utilisation in parts per million.
static CPU_PPM: AtomicU64 = AtomicU64::new(100_000);

/// Synthetic CPU seconds: (busy, idle, last update).
static CPU: Mutex<Option<(f64, f64, Instant)>> = Mutex::new(None);

/// A test backend: HTTP (keep-alive aware) naming the backend, and a UDP
/// echo; its behaviour changes through `GET /admin?...`.
#[derive(clap::Parser)]
#[command(name = "hc-backend")]
struct Cli {
    /// The name its answers carry.
    #[arg(long, default_value = "backend")]
    id: String,
    /// HTTP port.
    #[arg(long, default_value_t = 8080)]
    http: u16,
    /// UDP echo port.
    #[arg(long, default_value_t = 5353)]
    udp: u16,
    /// Service time of every request, in ms.
    #[arg(long, default_value_t = 0.0)]
    delay_ms: f64,
    /// Also serve HTTP on these ports (`FIRST-LAST`): many backends on
    /// few addresses (the scale bench).
    #[arg(long)]
    more_ports: Option<String>,
}

fn main() {
    // A churn test holds thousands of connections.
    testbed::raise_nofile();
    let Cli {
        id,
        http,
        udp,
        delay_ms,
        more_ports,
    } = <Cli as clap::Parser>::parse();
    DELAY_US.store((delay_ms * 1000.0) as u64, Ordering::Relaxed);

    let uid = id.clone();
    // Both families (an IPv6 socket takes IPv4 too, as mapped addresses).
    let sock = UdpSocket::bind(("::", udp)).expect("bind UDP");
    thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((n, peer)) = sock.recv_from(&mut buf) {
            let mut reply = format!("{uid}:").into_bytes();
            reply.extend_from_slice(&buf[..n]);
            let _ = sock.send_to(&reply, peer);
        }
    });

    if let Some((a, b)) = more_ports.as_deref().and_then(|r| r.split_once('-')) {
        let (a, b): (u16, u16) = (a.parse().expect("port"), b.parse().expect("port"));
        for port in a..=b {
            let id = id.clone();
            let l = TcpListener::bind(("::", port)).expect("bind HTTP");
            thread::spawn(move || {
                for stream in l.incoming().flatten() {
                    let id = id.clone();
                    thread::spawn(move || serve(stream, &id));
                }
            });
        }
    }
    let listener = TcpListener::bind(("::", http)).expect("bind HTTP");
    for stream in listener.incoming().flatten() {
        let id = id.clone();
        thread::spawn(move || serve(stream, &id));
    }
}

/// Applies `key=value` settings of an admin query.
fn admin(query: &str) -> String {
    for kv in query.split('&') {
        let Some((k, v)) = kv.split_once('=') else {
            continue;
        };
        if k == "slow_for" {
            // ADDR:PORT:MS, e.g. slow_for=10.213.128.5:8080:50
            let f: Vec<&str> = v.split(':').collect();
            if let [a, port, ms] = f[..] {
                if let (Ok(a), Ok(port), Ok(ms)) = (
                    a.parse::<std::net::Ipv4Addr>(),
                    port.parse::<u16>(),
                    ms.parse::<u16>(),
                ) {
                    SLOW_FOR.store(
                        (u64::from(u32::from(a)) << 32) | (u64::from(port) << 16) | u64::from(ms),
                        Ordering::Relaxed,
                    );
                }
            }
            continue;
        }
        let Ok(x) = v.parse::<f64>() else {
            continue;
        };
        match k {
            "delay_ms" => DELAY_US.store((x * 1000.0) as u64, Ordering::Relaxed),
            "status" => STATUS.store(x as u64, Ordering::Relaxed),
            "metrics" => METRICS_MODE.store(x as u64, Ordering::Relaxed),
            "cpu" => {
                advance_cpu();
                CPU_PPM.store((x.clamp(0.0, 1.0) * 1e6) as u64, Ordering::Relaxed);
            }
            _ => {}
        }
    }
    format!(
        "delay_ms={} status={} cpu={}\n",
        DELAY_US.load(Ordering::Relaxed) as f64 / 1000.0,
        STATUS.load(Ordering::Relaxed),
        CPU_PPM.load(Ordering::Relaxed) as f64 / 1e6
    )
}

/// Brings the synthetic CPU counters up to now at the current utilisation.
fn advance_cpu() -> (f64, f64) {
    let mut g = CPU
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let now = Instant::now();
    let (busy, idle, last) = g.unwrap_or((1000.0, 1000.0, now));
    let dt = now.duration_since(last).as_secs_f64();
    let u = CPU_PPM.load(Ordering::Relaxed) as f64 / 1e6;
    let next = (busy + dt * u, idle + dt * (1.0 - u), now);
    *g = Some(next);
    (next.0, next.1)
}

fn metrics() -> String {
    match METRICS_MODE.load(Ordering::Relaxed) {
        1 => loop {
            thread::sleep(Duration::from_secs(3600));
        },
        2 => return "}}}{{{ not prometheus \u{0}\u{1}\nnode_cpu_seconds_total{mode=\"idle\" 12\n".into(),
        3 => {
            return "node_cpu_seconds_total{cpu=\"0\",mode=\"idle\"} NaN\nnode_memory_MemAvailable_bytes NaN\nnode_memory_MemTotal_bytes NaN\n".into()
        }
        4 => {
            return "node_cpu_seconds_total{cpu=\"0\",mode=\"idle\"} -5\nnode_memory_MemAvailable_bytes -1\nnode_memory_MemTotal_bytes -10\n".into()
        }
        5 => {
            return "node_cpu_seconds_total{cpu=\"0\",mode=\"idle\"} 1e308\nnode_cpu_seconds_total{cpu=\"0\",mode=\"user\"} 1e308\nnode_memory_MemAvailable_bytes 1e300\nnode_memory_MemTotal_bytes +Inf\n".into()
        }
        6 => return format!("#{}\n", " ".repeat(10 << 20)),
        _ => {}
    }
    let (busy, idle) = advance_cpu();
    let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kb = |key: &str| {
        mem.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    format!(
        "# TYPE node_cpu_seconds_total counter\n\
         node_cpu_seconds_total{{cpu=\"0\",mode=\"idle\"}} {idle:.3}\n\
         node_cpu_seconds_total{{cpu=\"0\",mode=\"user\"}} {busy:.3}\n\
         # TYPE node_memory_MemTotal_bytes gauge\n\
         node_memory_MemTotal_bytes {}\n\
         # TYPE node_memory_MemAvailable_bytes gauge\n\
         node_memory_MemAvailable_bytes {}\n",
        kb("MemTotal:"),
        kb("MemAvailable:")
    )
}

fn serve(stream: TcpStream, id: &str) {
    let local = stream
        .local_addr()
        .ok()
        .and_then(|a| match a.ip().to_canonical() {
            std::net::IpAddr::V4(v4) => {
                Some((u64::from(u32::from(v4)) << 32) | (u64::from(a.port()) << 16))
            }
            std::net::IpAddr::V6(_) => None,
        });
    // An IPv4 peer as IPv4, not as a mapped IPv6 address.
    let peer = stream.peer_addr().map_or_else(
        |_| "?".to_string(),
        |a| std::net::SocketAddr::new(a.ip().to_canonical(), a.port()).to_string(),
    );
    let _ = stream.set_read_timeout(Some(Duration::from_secs(120)));
    let _ = stream.set_nodelay(true);
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    loop {
        let mut keep_alive = false;
        let mut body_len = 0usize;
        let mut line = String::new();
        if matches!(reader.read_line(&mut line), Ok(0) | Err(_)) {
            return;
        }
        let mut http11 = line.contains("HTTP/1.1");
        let target = line.split_whitespace().nth(1).unwrap_or("/").to_string();
        loop {
            let mut h = String::new();
            match reader.read_line(&mut h) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let lower = h.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                body_len = v.trim().parse().unwrap_or(0).min(64 << 20);
            }
            if lower.starts_with("connection:") {
                keep_alive = lower.contains("keep-alive");
                if lower.contains("close") {
                    http11 = false;
                }
            }
            if h == "\r\n" || h == "\n" {
                break;
            }
        }
        let keep = keep_alive || http11;
        if std::io::copy(
            &mut (&mut reader).take(body_len as u64),
            &mut std::io::sink(),
        )
        .ok()
            != Some(body_len as u64)
        {
            return;
        }
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let ms = |key: &str| {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        match path {
            "/sink" => {
                let _ = std::io::copy(&mut reader, &mut std::io::sink());
                return;
            }
            "/stream" => {
                let (every, until) = (ms("every_ms").max(1), ms("for_ms"));
                let start = Instant::now();
                let _ = out.write_all(b"HTTP/1.1 200 X\r\nConnection: close\r\n\r\n");
                while start.elapsed() < Duration::from_millis(until) {
                    if out.write_all(format!("{id} tick\n").as_bytes()).is_err() {
                        return;
                    }
                    thread::sleep(Duration::from_millis(every));
                }
                return;
            }
            "/bytes" => {
                let n = ms("n") as usize;
                let head = format!(
                    "HTTP/1.1 200 X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{id}\n",
                    n + id.len() + 1
                );
                let _ = out.write_all(head.as_bytes());
                let _ = out.write_all(&vec![b'.'; n]);
                return;
            }
            "/poll" | "/slow" => thread::sleep(Duration::from_millis(ms("ms"))),
            _ => {}
        }
        let (status, body) = match path {
            "/admin" => (200, admin(query)),
            "/metrics" => (200, metrics()),
            // Who connected, as this host's stack saw it (DSR keeps the
            // client's address; SNAT shows the balancer's).
            "/whoami" => {
                println!("whoami: {peer}");
                (200, format!("{id} {peer}\n"))
            }
            "/poll" | "/slow" => (STATUS.load(Ordering::Relaxed), format!("{id}\n")),
            _ => {
                let mut d = DELAY_US.load(Ordering::Relaxed);
                let slow = SLOW_FOR.load(Ordering::Relaxed);
                if slow != 0 && local == Some(slow & !0xffff) {
                    d += (slow & 0xffff) * 1000;
                }
                if d > 0 {
                    thread::sleep(Duration::from_micros(d));
                }
                (STATUS.load(Ordering::Relaxed), format!("{id}\n"))
            }
        };
        let resp = format!(
            "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: {}\r\n\r\n{body}",
            body.len(),
            if keep { "keep-alive" } else { "close" }
        );
        if out.write_all(resp.as_bytes()).is_err() || !keep {
            return;
        }
    }
}
