//! A scale-out testbed: clients behind a router, which spreads the VIP's
//! traffic by ECMP over several balancers that announce it by BGP (a bird2
//! in every namespace, BFD on), backends on the balancers' segment that
//! answer clients directly (L2 DSR, Maglev), the balancers in one
//! `[cluster]` (the first that answers decides the rings), all in
//! namespaces this process creates and removes.
//!
//! Addresses: the segment 10.214.0.0/24 (router .1, balancers .11 and up,
//! backends .21 and up), the clients' side 10.214.1.0/24 (router .1,
//! client .2), the VIP 10.214.100.1 on the backends' HTTP port.

use crate::{plug, segment, spawn_in, start_bird, wait_until, Proc, HTTP_PORT, UDP_PORT};
use anyhow::{Context, Result};
use huddle_user::{
    cluster::bgp,
    status::control::{self, Request},
    status::Status,
    sys::netns::Netns,
};
use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

pub const ROUTER_IP: Ipv4Addr = Ipv4Addr::new(10, 214, 0, 1);
pub const SCALE_CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 214, 1, 2);
pub const SCALE_VIP: Ipv4Addr = Ipv4Addr::new(10, 214, 100, 1);
const ROUTER_AS: u32 = 65000;

#[must_use]
pub fn balancer_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 214, 0, 11 + i as u8)
}

#[must_use]
pub fn scale_backend_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 214, 0, 21 + i as u8)
}

/// The VIP and port clients connect to.
#[must_use]
pub fn scale_vip() -> SocketAddr {
    (SCALE_VIP, HTTP_PORT).into()
}

pub struct ScaleOut {
    pub client: Netns,
    pub router: Netns,
    pub balancers: Vec<Netns>,
    pub backends: Vec<Netns>,
    /// The router's bird.
    router_bird: Option<Proc>,
    /// Per balancer: its bird and its daemon.
    lb_birds: Vec<Option<Proc>>,
    huddles: Vec<Option<Proc>>,
    /// Backend servers.
    procs: Vec<Proc>,
    pub dir: PathBuf,
    prefix: String,
    rotation: bool,
    // Dropped last: the bridge the others hang off.
    switch: Netns,
}

impl ScaleOut {
    /// Builds the namespaces and links; starts nothing.
    pub fn build(tag: &str, balancers: usize, backends: usize) -> Result<ScaleOut> {
        let (prefix, switch, dir) = segment(tag)?;
        let mut s = ScaleOut {
            client: Netns::create(&format!("{prefix}-c"))?,
            router: Netns::create(&format!("{prefix}-r"))?,
            balancers: Vec::new(),
            backends: Vec::new(),
            router_bird: None,
            lb_birds: Vec::new(),
            huddles: Vec::new(),
            procs: Vec::new(),
            dir,
            prefix: prefix.clone(),
            rotation: true,
            switch,
        };
        plug(&s.switch, "pr", &s.router, ROUTER_IP)?;
        // The clients' side: a veth straight from the router.
        s.router.ip(&[
            "link",
            "add",
            "eth1",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &s.client.name,
        ])?;
        s.router
            .ip(&["addr", "add", "10.214.1.1/24", "dev", "eth1"])?;
        s.router.ip(&["link", "set", "eth1", "up"])?;
        s.client.ip(&[
            "addr",
            "add",
            &format!("{SCALE_CLIENT_IP}/24"),
            "dev",
            "eth0",
        ])?;
        s.client.ip(&["link", "set", "eth0", "up"])?;
        s.client
            .ip(&["route", "add", "default", "via", "10.214.1.1"])?;
        s.router.sysctl("net.ipv4.conf.all.forwarding", "1")?;
        // Without it every connection of one client takes one balancer.
        s.router.sysctl("net.ipv4.fib_multipath_hash_policy", "1")?;
        for i in 0..balancers {
            let ns = Netns::create(&format!("{prefix}-lb{i}"))?;
            plug(&s.switch, &format!("pl{i}"), &ns, balancer_ip(i))?;
            s.balancers.push(ns);
            s.lb_birds.push(None);
            s.huddles.push(None);
        }
        for i in 0..backends {
            let ns = Netns::create(&format!("{prefix}-b{i}"))?;
            plug(&s.switch, &format!("pb{i}"), &ns, scale_backend_ip(i))?;
            // DSR: the VIP is the backend's own, never answered for by ARP
            // on the segment (the balancers take its packets by MAC).
            ns.ip(&["addr", "add", &format!("{SCALE_VIP}/32"), "dev", "lo"])?;
            for (k, v) in [("arp_ignore", "1"), ("arp_announce", "2")] {
                ns.sysctl(&format!("net.ipv4.conf.all.{k}"), v)?;
                ns.sysctl(&format!("net.ipv4.conf.eth0.{k}"), v)?;
            }
            ns.ip(&["route", "add", "default", "via", &ROUTER_IP.to_string()])?;
            s.backends.push(ns);
        }
        Ok(s)
    }

    /// Starts the backends, the birds and a balancer daemon per balancer
    /// (DSR, Maglev; `rotation`: the huddle rotates, else each ring stays
    /// whole), and waits until the router spreads the VIP over every
    /// balancer.
    pub fn start(&mut self, huddle: &Path, backend: &Path, rotation: bool) -> Result<()> {
        self.start_with(huddle, backend, rotation, &[])
    }

    /// As `start`, with `extra` arguments for every backend server.
    pub fn start_with(
        &mut self,
        huddle: &Path,
        backend: &Path,
        rotation: bool,
        extra: &[&str],
    ) -> Result<()> {
        self.rotation = rotation;
        for (i, ns) in self.backends.iter().enumerate() {
            let id = format!("b{i}");
            let log = self.dir.join(format!("{id}.log"));
            let (http, udp) = (HTTP_PORT.to_string(), UDP_PORT.to_string());
            let mut args = vec!["--id", &id, "--http", &http, "--udp", &udp];
            args.extend_from_slice(extra);
            self.procs.push(spawn_in(ns, backend, &args, Some(&log))?);
        }
        self.router_bird = Some(self.bird(&self.router, "router", &self.router_conf())?);
        for i in 0..self.balancers.len() {
            self.start_balancer(i, huddle)?;
        }
        wait_until(Duration::from_secs(30), || {
            self.next_hops().len() == self.balancers.len()
        })
        .with_context(|| {
            format!(
                "the router never spread the VIP over all balancers: next hops {:?}",
                self.next_hops()
            )
        })
    }

    fn router_conf(&self) -> String {
        let mut c = format!(
            "router id {ROUTER_IP};\nprotocol device {{ scan time 1; }}\n\
             protocol kernel {{ ipv4 {{ export all; }}; merge paths on; }}\n\
             protocol bfd {{ interface \"*\" {{ interval 100 ms; multiplier 3; }}; }}\n"
        );
        for i in 0..self.balancers.len() {
            c.push_str(&format!(
                "protocol bgp lb{i} {{ local {ROUTER_IP} as {ROUTER_AS}; neighbor {} as {}; \
                 hold time 3; connect retry time 1; error wait time 1, 5; bfd on; ipv4 {{ import all; export none; }}; }}\n",
                balancer_ip(i),
                65001 + i
            ));
        }
        c
    }

    fn routes_file(&self, i: usize) -> PathBuf {
        self.dir.join(format!("lb{i}-vips.conf"))
    }

    /// Starts balancer `i`: its bird, then its daemon.
    pub fn start_balancer(&mut self, i: usize, huddle: &Path) -> Result<()> {
        let routes = self.routes_file(i);
        if !routes.exists() {
            std::fs::write(&routes, bgp::routes_text(&BTreeSet::new()))?;
        }
        let conf = format!(
            "router id {};\nprotocol device {{ scan time 1; }}\ninclude \"{}\";\n\
             protocol bfd {{ interface \"*\" {{ interval 100 ms; multiplier 3; }}; }}\n\
             protocol bgp uplink {{ local {} as {}; neighbor {ROUTER_IP} as {ROUTER_AS}; \
             hold time 3; connect retry time 1; error wait time 1, 5; bfd on; \
             ipv4 {{ import none; export where proto = \"huddle_v4\"; next hop self; }}; }}\n",
            balancer_ip(i),
            routes.display(),
            balancer_ip(i),
            65001 + i
        );
        self.lb_birds[i] = Some(self.bird(&self.balancers[i], &format!("lb{i}-bird"), &conf)?);
        let backends: Vec<String> = (0..self.backends.len())
            .map(|b| format!("\"{}:{HTTP_PORT}\"", scale_backend_ip(b)))
            .collect();
        let config = self.dir.join(format!("lb{i}.toml"));
        // One key for the cluster, made the way the README says.
        let key = self.dir.join("cluster.key");
        if !key.exists() {
            huddle_user::config::key::generate(&key)?;
        }
        std::fs::write(
            &config,
            format!(
                "interface = \"eth0\"\ncontrol_socket = \"{}\"\npin_dir = \"{}\"\ndetach_on_exit = true\n\n\
                 [huddle]\nrotation = {}\nlisten = \"{}:9477\"\n\n[cluster]\nmembers = [{}]\nkey_file = \"{}\"\n\n\
                 [bgp]\ncontrol_socket = \"{}\"\nroutes_file = \"{}\"\n\n\
                 [[service]]\nvip = \"{}\"\nmode = \"dsr-l2\"\nselection = \"maglev\"\nbackends = [{}]\n",
                self.socket(i).display(),
                self.pins(i).display(),
                self.rotation,
                balancer_ip(i),
                (0..self.balancers.len())
                    .map(|m| format!("\"{}:9477\"", balancer_ip(m)))
                    .collect::<Vec<_>>()
                    .join(", "),
                key.display(),
                self.dir.join(format!("lb{i}-bird.ctl")).display(),
                routes.display(),
                scale_vip(),
                backends.join(", ")
            ),
        )?;
        let log = self.dir.join(format!("lb{i}.log"));
        self.huddles[i] = Some(spawn_in(
            &self.balancers[i],
            huddle,
            &["run", "--config", &config.display().to_string()],
            Some(&log),
        )?);
        wait_until(Duration::from_secs(20), || self.status(i).is_ok())
            .with_context(|| format!("balancer {i} never answered:\n{}", self.log(i)))
    }

    fn bird(&self, ns: &Netns, name: &str, conf: &str) -> Result<Proc> {
        Ok(start_bird(ns, &self.dir, name, conf)?.0)
    }

    /// Where balancer `i` pins its data plane.
    #[must_use]
    pub fn pins(&self, i: usize) -> PathBuf {
        crate::pin_dir(&format!("{}-lb{i}", self.prefix))
    }

    #[must_use]
    pub fn socket(&self, i: usize) -> PathBuf {
        self.dir.join(format!("lb{i}.sock"))
    }

    pub fn status(&self, i: usize) -> Result<Status> {
        let r = control::call(&self.socket(i), &Request::Status)?;
        r.status.context("no status in the reply")
    }

    #[must_use]
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("lb{i}.log"))).unwrap_or_default()
    }

    /// The balancers the router's FIB sends the VIP to now.
    #[must_use]
    pub fn next_hops(&self) -> Vec<Ipv4Addr> {
        let out = self
            .router
            .output("ip", &["route", "show", &format!("{SCALE_VIP}/32")])
            .unwrap_or_default();
        out.split_whitespace()
            .collect::<Vec<_>>()
            .windows(2)
            .filter(|w| w[0] == "via")
            .filter_map(|w| w[1].parse().ok())
            .collect()
    }

    /// The balancer the router's FIB picks for a TCP connection from the
    /// client's `ports` to the VIP, port by port (`None`: no route);
    /// one `ip -batch` of `route get`.
    pub fn balancer_of(&self, ports: std::ops::Range<u16>) -> Result<Vec<Option<Ipv4Addr>>> {
        let batch = self.dir.join("route-get.batch");
        let lines: String = ports
            .clone()
            .map(|p| {
                format!(
                    "route get {SCALE_VIP} from {SCALE_CLIENT_IP} iif eth1 ipproto tcp sport {p} dport {HTTP_PORT}\n"
                )
            })
            .collect();
        std::fs::write(&batch, lines)?;
        let out = self
            .router
            .output("ip", &["-batch", &batch.display().to_string()])?;
        let hops: Vec<Option<Ipv4Addr>> = out
            .lines()
            .filter(|l| l.starts_with(&SCALE_VIP.to_string()))
            .map(|l| {
                l.split_whitespace()
                    .collect::<Vec<_>>()
                    .windows(2)
                    .find(|w| w[0] == "via")
                    .and_then(|w| w[1].parse().ok())
            })
            .collect();
        if hops.len() != ports.len() {
            anyhow::bail!(
                "{} answers to {} route lookups:\n{out}",
                hops.len(),
                ports.len()
            );
        }
        Ok(hops)
    }

    /// Sends backend `i`'s server an admin query (`delay_ms=50`...).
    pub fn backend_admin(&self, i: usize, query: &str) -> Result<String> {
        crate::backend_admin(&self.backends[i], scale_backend_ip(i), query)
    }

    /// Cuts balancer `i`'s link to the segment (a host gone silent).
    pub fn cut_link(&self, i: usize) -> Result<()> {
        self.balancers[i].ip(&["link", "set", "eth0", "down"])
    }

    pub fn restore_link(&self, i: usize) -> Result<()> {
        self.balancers[i].ip(&["link", "set", "eth0", "up"])
    }
}

impl Drop for ScaleOut {
    fn drop(&mut self) {
        for mut h in self.huddles.iter_mut().filter_map(Option::take) {
            let _ = h.terminate(Duration::from_secs(5));
        }
        for i in 0..self.balancers.len() {
            crate::drop_pins(&self.pins(i));
        }
        self.lb_birds.clear();
        self.router_bird = None;
        self.procs.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
