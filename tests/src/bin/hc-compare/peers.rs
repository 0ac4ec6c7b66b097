//! The balancers compared, each started in the testbed's balancer
//! namespace in front of the same four backends at the same VIP.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use testbed::{backend_ip, spawn_in, wait_until, Proc, Testbed, HTTP_PORT, VIP};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Balancer {
    /// HuddleCluster's XDP path with rotation on (defaults).
    Huddle,
    /// The same XDP path, rotation off: plain round robin.
    XdpRoundRobin,
    /// HuddleCluster in direct server return (`dsr-l2`): the balancer
    /// never sees a reply and times backends by the clients' ACKs.
    HuddleDsr,
    NginxRoundRobin,
    NginxLeastConn,
    HaproxyRoundRobin,
    HaproxyLeastConn,
}

pub const ALL: [Balancer; 7] = [
    Balancer::Huddle,
    Balancer::XdpRoundRobin,
    Balancer::HuddleDsr,
    Balancer::NginxRoundRobin,
    Balancer::NginxLeastConn,
    Balancer::HaproxyRoundRobin,
    Balancer::HaproxyLeastConn,
];

impl Balancer {
    pub fn name(self) -> &'static str {
        match self {
            Balancer::Huddle => "huddle (XDP, rotation on)",
            Balancer::XdpRoundRobin => "XDP round robin (rotation off)",
            Balancer::HuddleDsr => "huddle DSR (dsr-l2, ACK clock)",
            Balancer::NginxRoundRobin => "NGINX stream round robin",
            Balancer::NginxLeastConn => "NGINX stream least_conn",
            Balancer::HaproxyRoundRobin => "HAProxy roundrobin + checks",
            Balancer::HaproxyLeastConn => "HAProxy leastconn + checks",
        }
    }

    pub fn slug(self) -> &'static str {
        match self {
            Balancer::Huddle => "huddle",
            Balancer::XdpRoundRobin => "xdp-rr",
            Balancer::HuddleDsr => "huddle-dsr",
            Balancer::NginxRoundRobin => "nginx-rr",
            Balancer::NginxLeastConn => "nginx-lc",
            Balancer::HaproxyRoundRobin => "haproxy-rr",
            Balancer::HaproxyLeastConn => "haproxy-lc",
        }
    }

    pub fn is_xdp(self) -> bool {
        matches!(
            self,
            Balancer::Huddle | Balancer::XdpRoundRobin | Balancer::HuddleDsr
        )
    }

    /// Where clients connect: DSR cannot change the port, so its VIP is
    /// on the backends' port.
    pub fn vip(self) -> std::net::SocketAddr {
        let port = if self == Balancer::HuddleDsr {
            HTTP_PORT
        } else {
            80
        };
        (VIP, port).into()
    }
}

/// A started balancer; `stop` undoes everything.
pub enum Running {
    Xdp,
    Proxy(Proc),
}

fn backends(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("{}:{HTTP_PORT}", backend_ip(i)))
        .collect()
}

/// Debian's NGINX stream module (package libnginx-mod-stream).
pub const STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

/// NGINX as an L4 (stream) proxy with its defaults: passive failure
/// handling (max_fails=1, fail_timeout=10s, next upstream on connect
/// failure).
fn nginx_conf(dir: &Path, least_conn: bool, n: usize) -> String {
    let servers: String = backends(n)
        .iter()
        .map(|b| format!("        server {b};\n"))
        .collect();
    format!(
        "load_module {STREAM_MODULE};\nworker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/nginx.err warn;\n\
         events {{ worker_connections 8192; }}\n\
         stream {{\n    upstream backends {{\n{lc}{servers}    }}\n    \
         server {{\n        listen {VIP}:80 reuseport backlog=4096;\n        proxy_pass backends;\n    }}\n}}\n",
        d = dir.display(),
        lc = if least_conn { "        least_conn;\n" } else { "" },
    )
}

/// HAProxy in TCP mode with HTTP health checks at common settings (every
/// 2 s, down after 3 failures, up after 2 passes).
fn haproxy_conf(least_conn: bool, n: usize) -> String {
    let servers: String = backends(n)
        .iter()
        .enumerate()
        .map(|(i, b)| format!("    server b{i} {b} check inter 2s fall 3 rise 2\n"))
        .collect();
    format!(
        "global\n    maxconn 8000\n\ndefaults\n    mode tcp\n    timeout connect 5s\n    timeout client 30s\n    timeout server 30s\n\n\
         listen vip\n    bind {VIP}:80\n    balance {}\n    option httpchk GET /\n{servers}",
        if least_conn { "leastconn" } else { "roundrobin" }
    )
}

/// Starts `b` in front of the testbed's backends.
/// `huddle_extra`: more arguments for the XDP balancer (e.g. `--nat-ports`).
pub fn start(
    b: Balancer,
    bed: &mut Testbed,
    huddle: &Path,
    n: usize,
    huddle_extra: &[String],
) -> Result<Running> {
    let dir: PathBuf = bed.dir.clone();
    match b {
        Balancer::Huddle | Balancer::XdpRoundRobin | Balancer::HuddleDsr => {
            bed.vip_local(false)?;
            let mut args = vec!["--vip".to_string(), b.vip().to_string()];
            if b == Balancer::HuddleDsr {
                for ns in &bed.backends {
                    ns.ip(&["addr", "replace", &format!("{VIP}/32"), "dev", "lo"])?;
                }
                args.extend(["--mode".into(), "dsr-l2".into()]);
            }
            for a in backends(n) {
                args.push("--backend".into());
                args.push(a);
            }
            args.push("--metrics-listen".into());
            args.push("off".into());
            if b == Balancer::XdpRoundRobin {
                args.push("--no-rotation".into());
            }
            args.extend(huddle_extra.iter().cloned());
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            bed.start_huddle(huddle, &args)?;
            Ok(Running::Xdp)
        }
        Balancer::NginxRoundRobin | Balancer::NginxLeastConn => {
            bed.vip_local(true)?;
            let conf = dir.join("nginx.conf");
            std::fs::write(&conf, nginx_conf(&dir, b == Balancer::NginxLeastConn, n))?;
            let c = conf.display().to_string();
            let p = spawn_in(
                &bed.lb,
                Path::new("/usr/sbin/nginx"),
                &["-c", &c, "-e", &format!("{}/nginx.err", dir.display())],
                Some(&dir.join("nginx.log")),
            )?;
            ready(bed, p, "nginx")
        }
        Balancer::HaproxyRoundRobin | Balancer::HaproxyLeastConn => {
            bed.vip_local(true)?;
            let conf = dir.join("haproxy.cfg");
            std::fs::write(&conf, haproxy_conf(b == Balancer::HaproxyLeastConn, n))?;
            let c = conf.display().to_string();
            let p = spawn_in(
                &bed.lb,
                Path::new("/usr/sbin/haproxy"),
                &["-db", "-f", &c],
                Some(&dir.join("haproxy.log")),
            )?;
            ready(bed, p, "haproxy")
        }
    }
}

/// Waits until the proxy answers on the VIP.
fn ready(bed: &Testbed, mut p: Proc, what: &str) -> Result<Running> {
    let vip = Balancer::Huddle.vip();
    let up = wait_until(std::time::Duration::from_secs(10), || {
        testbed::in_ns(&bed.client, move || {
            testbed::http_get(vip, std::time::Duration::from_millis(500)).is_ok()
        })
    });
    if up.is_err() {
        let exited = p.child.try_wait()?;
        let log = std::fs::read_to_string(bed.dir.join(format!("{what}.log"))).unwrap_or_default();
        anyhow::bail!("{what} did not come up (exit {exited:?}):\n{log}");
    }
    Ok(Running::Proxy(p))
}

/// Stops a running balancer and cleans up after it.
pub fn stop(r: Running, bed: &mut Testbed) -> Result<()> {
    match r {
        Running::Xdp => {
            bed.stop_huddle();
            for ns in &bed.backends {
                let _ = ns.ip(&["addr", "del", &format!("{VIP}/32"), "dev", "lo"]);
            }
        }
        Running::Proxy(mut p) => {
            p.terminate(std::time::Duration::from_secs(5))
                .context("stopping the proxy")?;
        }
    }
    bed.vip_local(false)
}
