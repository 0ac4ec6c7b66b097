//! NGINX backends, their bodies and the clients' figures, for the
//! real-stack test and benchmark (`tests/netns/realstack.rs`,
//! `hc-realload`): Debian's nginx on every backend, HTTP/1.1 on `H1` and
//! h2c (prior knowledge) on `H2`, bodies of bytes that are not all alike.

use crate::{backend_ip, spawn_in, Testbed, VIP};
use anyhow::{Context, Result};
use huddle_user::sys::netns::Netns;
use std::path::{Path, PathBuf};

/// NGINX's HTTP/1.1 and h2c ports on every backend, and its TLS port
/// (`start_probed`).
pub const H1: u16 = 8080;
pub const H2: u16 = 8081;
pub const TLS: u16 = 8443;
/// The bodies every backend serves, by name and size.
pub const BODIES: [(&str, usize); 4] = [
    ("1k", 1024),
    ("5k", 5632),
    ("100k", 100 * 1024),
    ("1m", 1024 * 1024),
];

/// Bytes that are not all alike, so a wrong sum or a lost segment shows.
#[must_use]
pub fn body(n: usize) -> Vec<u8> {
    let mut x = 0x2545_f491u32;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// Backend `i`'s access log (one line per request), when kept.
#[must_use]
pub fn access_log(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("acc{i}.log"))
}

fn conf(dir: &Path, i: usize, log: bool) -> String {
    let (d, ip) = (dir.display(), backend_ip(i));
    let access = if log {
        format!(
            "access_log {} combined buffer=64k flush=1s;",
            access_log(dir, i).display()
        )
    } else {
        "access_log off;".to_string()
    };
    format!(
        "user root; worker_processes 1; daemon off; pid {d}/ngx{i}.pid; error_log {d}/ngx{i}.err;
events {{ worker_connections 4096; }}
http {{ {access} sendfile on; keepalive_requests 100000;
  server {{ listen {ip}:{H1} backlog=4096; listen {ip}:{H2} http2; root {d}/www; }} }}\n"
    )
}

/// Writes the bodies and starts NGINX on every backend of `bed` (an access
/// log each with `log`).
pub fn start(bed: &mut Testbed, log: bool) -> Result<()> {
    let www = bed.dir.join("www");
    std::fs::create_dir_all(&www)?;
    for (name, n) in BODIES {
        std::fs::write(www.join(name), body(n))?;
    }
    for i in 0..bed.backends.len() {
        let c = conf(&bed.dir, i, log);
        spawn(bed, i, &c)?;
    }
    Ok(())
}

/// Starts NGINX on backend `i` of `bed` with config text `conf`.
fn spawn(bed: &mut Testbed, i: usize, conf: &str) -> Result<()> {
    let c = bed.dir.join(format!("ngx{i}.conf"));
    std::fs::write(&c, conf)?;
    let out = bed.dir.join(format!("ngx{i}.log"));
    let p = spawn_in(
        &bed.backends[i],
        Path::new("/usr/sbin/nginx"),
        &["-c", &c.display().to_string()],
        Some(&out),
    )
    .context("nginx")?;
    bed.procs.push(p);
    Ok(())
}

/// Starts NGINX on every backend of `bed` for the probe test: HTTP/1.1,
/// h2c and TLS (a self-signed certificate made here with openssl), and
/// `/health` answering 200, but 503 on backend `sick`'s HTTP/1.1 port.
pub fn start_probed(bed: &mut Testbed, sick: usize) -> Result<()> {
    let (key, cert) = (bed.dir.join("key.pem"), bed.dir.join("cert.pem"));
    let made = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args([
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=backend.test",
            "-keyout",
        ])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .context("openssl")?;
    anyhow::ensure!(
        made.status.success(),
        "openssl: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    for i in 0..bed.backends.len() {
        let (d, ip) = (bed.dir.display(), backend_ip(i));
        let health = if i == sick {
            format!("if ($server_port = {H1}) {{ return 503; }} return 200 ok;")
        } else {
            "return 200 ok;".into()
        };
        let conf = format!(
            "user root; worker_processes 1; daemon off; pid {d}/ngx{i}.pid; error_log {d}/ngx{i}.err;
events {{ worker_connections 1024; }}
http {{ access_log off;
  server {{ listen {ip}:{H1}; listen {ip}:{H2} http2; listen {ip}:{TLS} ssl;
    ssl_certificate {}; ssl_certificate_key {};
    location = /health {{ {health} }}
    location / {{ return 200 page; }} }} }}\n",
            cert.display(),
            key.display()
        );
        spawn(bed, i, &conf)?;
    }
    Ok(())
}

/// The processes of backend `i`'s NGINX: its master (from the pid file)
/// and the master's children.
pub fn pids(dir: &Path, i: usize) -> Result<Vec<u32>> {
    let master: u32 = std::fs::read_to_string(dir.join(format!("ngx{i}.pid")))?
        .trim()
        .parse()?;
    let mut all = vec![master];
    for e in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        // pid (comm) state ppid ...: the comm may hold spaces, not ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(master) {
            all.push(pid);
        }
    }
    Ok(all)
}

/// A config for `huddle run --config`: `VIP:80` over every backend's `H1`
/// and `VIP:81` over its `H2`, TCP probes, no HTTP listener.
pub fn huddle_config(bed: &Testbed) -> Result<PathBuf> {
    let service = |port: u16, to: u16| {
        let b: Vec<String> = (0..bed.backends.len())
            .map(|i| format!("\"{}:{to}\"", backend_ip(i)))
            .collect();
        format!(
            "[[service]]\nvip = \"{VIP}:{port}/tcp\"\nbackends = [{}]\n",
            b.join(", ")
        )
    };
    let path = bed.dir.join("huddle.toml");
    std::fs::write(
        &path,
        format!(
            "interface = \"eth0\"\n[huddle]\nprobe = {{ kind = \"tcp\" }}\nlisten = \"off\"\n{}{}",
            service(80, H1),
            service(81, H2)
        ),
    )?;
    Ok(path)
}

/// Kernel DNAT in the balancer's namespace, as the comparison: nftables
/// `numgen inc` over the backends for `VIP:80` and `VIP:81`, masquerade,
/// forwarding on. The huddle must be detached.
pub fn dnat(bed: &Testbed) -> Result<()> {
    let map = |port: u16| {
        let v: Vec<String> = (0..bed.backends.len())
            .map(|i| format!("{i} : {} . {port}", backend_ip(i)))
            .collect();
        v.join(", ")
    };
    let n = bed.backends.len();
    let rules = format!(
        "table ip hcdnat {{
  chain pre {{ type nat hook prerouting priority -100;
    ip daddr {VIP} tcp dport 80 dnat ip to numgen inc mod {n} map {{ {} }}
    ip daddr {VIP} tcp dport 81 dnat ip to numgen inc mod {n} map {{ {} }}
  }}
  chain post {{ type nat hook postrouting priority 100;
    ip daddr 10.213.0.0/24 masquerade
  }}
}}\n",
        map(H1),
        map(H2)
    );
    let file = bed.dir.join("dnat.nft");
    std::fs::write(&file, rules)?;
    bed.lb.exec("nft", &["-f", &file.display().to_string()])?;
    bed.lb.exec("sysctl", &["-qw", "net.ipv4.ip_forward=1"])
}

/// Removes what `dnat` set up.
pub fn undo_dnat(bed: &Testbed) {
    let _ = bed.lb.exec("nft", &["delete", "table", "ip", "hcdnat"]);
    let _ = bed.lb.exec("sysctl", &["-qw", "net.ipv4.ip_forward=0"]);
}

/// TCP segments that host `ns` dropped for a bad checksum (`Tcp:
/// InCsumErrors` of its /proc/net/snmp): what a frame sent on with a sum
/// left to offload comes to.
pub fn csum_errors(ns: &Netns) -> Result<u64> {
    let snmp = ns.output("cat", &["/proc/net/snmp"])?;
    let tcp: Vec<&str> = snmp.lines().filter(|l| l.starts_with("Tcp:")).collect();
    let at = tcp
        .first()
        .and_then(|h| h.split_whitespace().position(|w| w == "InCsumErrors"));
    at.and_then(|i| tcp.get(1)?.split_whitespace().nth(i)?.parse().ok())
        .context("no InCsumErrors in /proc/net/snmp")
}

/// The line of `text` that starts with `key`, trimmed, if any.
#[must_use]
pub fn line<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().map(str::trim).find(|l| l.starts_with(key))
}

/// A download of `url` by curl in `ns` into `to`: the bytes and the
/// seconds it took, or `None` if it failed.
#[must_use]
pub fn fetch(ns: &Netns, url: &str, to: &Path) -> Option<(Vec<u8>, f64)> {
    let _ = std::fs::remove_file(to);
    let took = ns
        .output(
            "curl",
            &[
                "-s",
                "--max-time",
                "10",
                "-w",
                "%{time_total}",
                "-o",
                &to.display().to_string(),
                url,
            ],
        )
        .ok()?;
    Some((std::fs::read(to).ok()?, took.trim().parse().ok()?))
}
