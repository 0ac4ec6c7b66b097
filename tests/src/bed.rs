//! The single-balancer testbed: a client, a balancer and backends on one
//! segment, the daemon started and asked over its control socket.

use crate::*;
use anyhow::{bail, Context, Result};
use huddle_user::{
    status::control::{self, Reply, Request},
    status::Status,
    sys::netns::Netns,
};
use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

/// Starts bird in `ns` with `conf`, its files in `dir` named after `name`
/// (`name.conf`, `name.log`, `name.pid`); returns it and its control
/// socket, once that exists.
pub fn start_bird(ns: &Netns, dir: &Path, name: &str, conf: &str) -> Result<(Proc, PathBuf)> {
    let path = dir.join(format!("{name}.conf"));
    std::fs::write(&path, conf)?;
    let sock = dir.join(format!("{name}.ctl"));
    let _ = std::fs::remove_file(&sock);
    let p = spawn_in(
        ns,
        Path::new("/usr/sbin/bird"),
        &[
            "-f",
            "-c",
            &path.display().to_string(),
            "-s",
            &sock.display().to_string(),
            "-P",
            &dir.join(format!("{name}.pid")).display().to_string(),
        ],
        Some(&dir.join(format!("{name}.log"))),
    )?;
    wait_until(Duration::from_secs(5), || sock.exists())
        .with_context(|| format!("{name}'s bird did not start"))?;
    Ok((p, sock))
}

/// Sends the `hc-backend` at `ip` (in `ns`) an admin query
/// (`delay_ms=50`...) and returns its answer.
pub fn backend_admin(ns: &Netns, ip: Ipv4Addr, query: &str) -> Result<String> {
    let addr = SocketAddr::from((ip, HTTP_PORT));
    let path = format!("/admin?{query}");
    in_ns(ns, move || {
        http_get_path(addr, &path, Duration::from_secs(2))
    })
}

/// Client, balancer and backends on one bridged segment.
pub struct Testbed {
    pub client: Netns,
    pub lb: Netns,
    pub backends: Vec<Netns>,
    /// Backend servers (index = backend) and other helpers.
    pub procs: Vec<Proc>,
    /// The balancer daemon, once started.
    pub huddle: Option<Proc>,
    /// `huddle agent` of each backend, when DSR set them up.
    pub agents: Vec<Proc>,
    /// Where the balancer pins its data plane (bpffs is shared by all
    /// namespaces, so each testbed has its own folder).
    pub pins: PathBuf,
    /// Arguments of the last `start_huddle`, for restarts.
    huddle_args: Vec<String>,
    huddle_bin: PathBuf,
    /// Environment the next `huddle` starts with, besides the test's.
    pub huddle_env: Vec<(String, String)>,
    backend_bin: PathBuf,
    backend_extra: Vec<String>,
    /// Folder for sockets and logs of this testbed.
    pub dir: PathBuf,
    /// Start the balancer with `ip netns exec` (a fresh /sys without the
    /// host's bpffs, as a user would) instead of a namespace switch only.
    pub ip_netns_exec: bool,
    /// Let the balancer use its default control socket (one test at a
    /// time: the folder is the host's).
    pub default_socket: bool,
    /// Let the balancer pick its pin folder (one per namespace, under the
    /// host's /sys/fs/bpf/huddle) instead of this testbed's own.
    pub default_pins: bool,
    // Dropped last: the bridge the others hang off.
    pub switch: Netns,
}

impl Testbed {
    /// Builds the namespaces and links; starts nothing. The balancer's
    /// peer runs an XDP program and hosts compute their own checksums, so
    /// native XDP works on its veth.
    pub fn new(tag: &str, n_backends: usize) -> Result<Testbed> {
        Testbed::build(tag, n_backends, true)
    }

    /// As `new`, but as anyone's first testbed: plain veth pairs with
    /// default offloads and nothing attached to the balancer's peer.
    pub fn plain(tag: &str, n_backends: usize) -> Result<Testbed> {
        Testbed::build(tag, n_backends, false)
    }

    /// Native XDP with every host's default offloads (checksums left to them).
    pub fn native(tag: &str, n_backends: usize) -> Result<Testbed> {
        let bed = Testbed::build(tag, n_backends, false)?;
        bed.peer_xdp()?;
        Ok(bed)
    }

    fn build(tag: &str, n_backends: usize, tuned: bool) -> Result<Testbed> {
        let (prefix, switch, dir) = segment(tag)?;
        let mut bed = Testbed {
            client: Netns::create(&format!("{prefix}-client"))?,
            lb: Netns::create(&format!("{prefix}-lb"))?,
            backends: Vec::new(),
            procs: Vec::new(),
            huddle: None,
            agents: Vec::new(),
            pins: pin_dir(&prefix),
            huddle_args: Vec::new(),
            huddle_bin: PathBuf::new(),
            huddle_env: Vec::new(),
            backend_bin: PathBuf::new(),
            backend_extra: Vec::new(),
            dir,
            ip_netns_exec: false,
            default_socket: false,
            default_pins: false,
            switch,
        };
        bed.attach("pl", &bed.lb, (LB_IP, LB_IP6), tuned)?;
        if tuned {
            bed.peer_xdp()?;
        }
        bed.attach("pc", &bed.client, (CLIENT_IP, CLIENT_IP6), tuned)?;
        bed.client
            .ip(&["route", "add", "10.213.100.0/24", "via", &LB_IP.to_string()])?;
        bed.client.ip(&[
            "-6",
            "route",
            "add",
            "fd00:213:100::/64",
            "via",
            &LB_IP6.to_string(),
        ])?;
        for i in 0..n_backends {
            let ns = Netns::create(&format!("{prefix}-b{i}"))?;
            bed.attach(
                &format!("pb{i}"),
                &ns,
                (backend_ip(i), backend_ip6(i)),
                tuned,
            )?;
            bed.backends.push(ns);
        }
        Ok(bed)
    }

    /// Deletes the balancer's namespace and makes another of the same name,
    /// plugged in as before (plain veth): what a user does who tears a
    /// namespace down and builds it again. The kernel may give the new one
    /// the old one's inode number; never its cookie.
    pub fn renew_lb(&mut self) -> Result<()> {
        let name = self.lb.name.clone();
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        // The kernel tears a deleted namespace down in the background: the
        // old pair's end on the bridge goes with it. Made after that, the
        // new namespace is likely to get the old one's inode number.
        wait_until(Duration::from_secs(10), || {
            self.switch.ip(&["link", "show", "pl"]).is_err()
        })
        .context("the old namespace's veth outlived it")?;
        std::thread::sleep(Duration::from_millis(200));
        let fresh = Netns::create(&name)?;
        // The old guard would delete the new namespace of the same name:
        // its own is already gone.
        std::mem::forget(std::mem::replace(&mut self.lb, fresh));
        self.attach("pl", &self.lb, (LB_IP, LB_IP6), false)
    }

    fn peer_xdp(&self) -> Result<()> {
        // A frame sent with XDP_TX from a veth is only taken by a peer that
        // runs XDP itself (with only GRO on the peer, this kernel accepted
        // the frames and then lost them): give the peer an XDP_PASS program.
        let obj = self.dir.join("baseline.o");
        std::fs::write(&obj, huddle_user::kernel::object::BASELINE)?;
        self.switch.ip(&[
            "link",
            "set",
            "dev",
            "pl",
            "xdpdrv",
            "obj",
            &obj.display().to_string(),
            "sec",
            "xdp",
        ])
    }

    fn attach(&self, port: &str, ns: &Netns, ip: (Ipv4Addr, Ipv6Addr), tuned: bool) -> Result<()> {
        let (ip, ip6) = ip;
        plug(&self.switch, port, ns, ip)?;
        // No duplicate address detection: usable at once.
        ns.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{ip6}/64"),
            "dev",
            "eth0",
            "nodad",
        ])?;
        // A veth sends TCP/UDP with the checksum left to offload (only the
        // pseudo-header sum filled in). An XDP-rewritten frame loses that
        // state on the way to its peer and arrives with a bad checksum, so
        // hosts whose traffic crosses the balancer compute checksums in
        // software, as a NIC on a wire would have.
        if tuned {
            ns.exec("ethtool", &["-K", "eth0", "tx", "off"])?;
        }
        Ok(())
    }

    /// Starts `hc-backend` in every backend namespace and waits until each
    /// answers.
    pub fn start_backends(&mut self, bin: &Path) -> Result<()> {
        self.start_backends_with(bin, &[])
    }

    /// As `start_backends`, with `extra` arguments for every backend.
    pub fn start_backends_with(&mut self, bin: &Path, extra: &[&str]) -> Result<()> {
        self.backend_bin = bin.to_path_buf();
        self.backend_extra = extra.iter().map(ToString::to_string).collect();
        for i in 0..self.backends.len() {
            let p = self.spawn_backend(i)?;
            self.procs.push(p);
        }
        for i in 0..self.backends.len() {
            self.wait_backend(i)
                .with_context(|| format!("backend b{i} did not start"))?;
        }
        Ok(())
    }

    /// Waits up to 10 s until backend `i` answers HTTP.
    fn wait_backend(&self, i: usize) -> Result<()> {
        let addr = SocketAddr::from((backend_ip(i), HTTP_PORT));
        wait_until(Duration::from_secs(10), || {
            in_ns(&self.backends[i], move || {
                http_get(addr, Duration::from_millis(500)).is_ok()
            })
        })
    }

    fn spawn_backend(&self, i: usize) -> Result<Proc> {
        let id = format!("b{i}");
        let log = self.dir.join(format!("{id}.log"));
        let (http, udp) = (HTTP_PORT.to_string(), UDP_PORT.to_string());
        let mut args = vec!["--id", &id, "--http", &http, "--udp", &udp];
        args.extend(self.backend_extra.iter().map(String::as_str));
        spawn_in(&self.backends[i], &self.backend_bin, &args, Some(&log))
    }

    /// Brings backend `i` back to its starting state: a fresh process if it
    /// was killed or stopped, default behaviour otherwise.
    pub fn reset_backend(&mut self, i: usize) -> Result<()> {
        let alive = matches!(self.procs[i].child.try_wait(), Ok(None));
        if alive {
            self.signal_backend(i, libc::SIGCONT);
        }
        if !alive
            || self
                .backend_admin(i, "status=200&metrics=0&cpu=0.1")
                .is_err()
        {
            let _ = self.procs[i].child.kill();
            let _ = self.procs[i].child.wait();
            self.procs[i] = self.spawn_backend(i)?;
        }
        self.wait_backend(i)
            .with_context(|| format!("backend b{i} did not come back"))
    }

    /// Sets every backend up for direct server return of `VIP`: the VIP on
    /// its loopback and, with `decap`, `huddle agent --decap eth0 --vip
    /// VIP` (binary `huddle`, metrics on port 9100) to unwrap dsr-ipip
    /// packets and time each request to its first answer byte. Returns
    /// when each agent is up.
    pub fn dsr_backends(&mut self, huddle: &Path, decap: bool) -> Result<()> {
        let vip = VIP.to_string();
        for (i, ns) in self.backends.iter().enumerate() {
            ns.ip(&["addr", "add", &format!("{vip}/32"), "dev", "lo"])?;
            if decap {
                let log = self.dir.join(format!("agent{i}.log"));
                let args = [
                    "agent",
                    "--decap",
                    "eth0",
                    "--listen",
                    "0.0.0.0:9100",
                    "--vip",
                    &vip,
                ];
                self.agents.push(spawn_in(ns, huddle, &args, Some(&log))?);
            }
        }
        for (i, ns) in self.backends.iter().enumerate().filter(|_| decap) {
            let up = wait_until(Duration::from_secs(10), || {
                in_ns(ns, || {
                    http_get_path(
                        (Ipv4Addr::LOCALHOST, 9100).into(),
                        "/metrics",
                        Duration::from_millis(500),
                    )
                    .is_ok()
                })
            });
            if up.is_err() {
                let log = std::fs::read_to_string(self.dir.join(format!("agent{i}.log")));
                bail!("the agent of b{i} did not come up: {log:?}");
            }
        }
        Ok(())
    }

    /// The metrics text of backend `i`'s agent.
    pub fn agent_metrics(&self, i: usize) -> Result<String> {
        in_ns(&self.backends[i], || {
            http_get_path(
                (Ipv4Addr::LOCALHOST, 9100).into(),
                "/metrics",
                Duration::from_secs(2),
            )
        })
    }

    /// Makes the VIP an address of the balancer host (for proxies, which
    /// accept connections to it) or not (for the XDP balancer).
    pub fn vip_local(&self, on: bool) -> Result<()> {
        let vip = format!("{VIP}/32");
        if on {
            self.lb.ip(&["addr", "replace", &vip, "dev", "lo"])
        } else {
            let _ = self.lb.ip(&["addr", "del", &vip, "dev", "lo"]);
            Ok(())
        }
    }

    /// Changes backend `i`'s behaviour (`hc-backend`'s `/admin` query,
    /// e.g. `delay_ms=50`).
    pub fn backend_admin(&self, i: usize, query: &str) -> Result<String> {
        backend_admin(&self.backends[i], backend_ip(i), query)
    }

    /// Polls the balancer every 5 ms until backend `addr` is in `place`
    /// ("inner", "outer"); returns how long after `since` that was seen.
    pub fn wait_place(
        &self,
        addr: &str,
        place: &str,
        since: Instant,
        limit: Duration,
    ) -> Result<Duration> {
        loop {
            let st = self.status()?;
            let b = st.services[0]
                .backends
                .iter()
                .find(|b| b.addr == addr)
                .with_context(|| format!("{addr} is not in the status"))?;
            if b.place == place {
                return Ok(since.elapsed());
            }
            if since.elapsed() > limit {
                bail!(
                    "{addr} not {place} within {limit:?}:\n{}\n{}",
                    st.render(),
                    self.huddle_log()
                );
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sends `sig` to backend `i`'s server process (started first, so its
    /// index in `procs`; `ip netns exec` execs in place, same pid).
    pub fn signal_backend(&self, i: usize, sig: i32) {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.procs[i].child.id() as i32, sig) };
    }

    /// Control socket path for a balancer of this testbed.
    #[must_use]
    pub fn socket(&self) -> PathBuf {
        if self.default_socket {
            huddle_user::config::default_control_socket("eth0")
        } else {
            self.dir.join("huddle.sock")
        }
    }

    /// Starts the balancer in the lb namespace with `extra` arguments after
    /// `run --iface eth0 --control-socket ...`, and waits for its socket.
    pub fn start_huddle(&mut self, bin: &Path, extra: &[&str]) -> Result<()> {
        let sock = self.socket();
        let mut args: Vec<String> = ["run", "--iface", "eth0"]
            .iter()
            .map(ToString::to_string)
            .collect();
        if !self.default_socket {
            args.push("--control-socket".into());
            args.push(sock.display().to_string());
        }
        if !self.default_pins {
            args.push("--pin-dir".into());
            args.push(self.pins.display().to_string());
        }
        args.extend(extra.iter().map(ToString::to_string));
        self.huddle_args = args;
        self.huddle_bin = bin.to_path_buf();
        self.launch_huddle()
    }

    /// Starts the balancer with the service `VIP:80` over the HTTP port of
    /// every backend of the testbed, then `extra` arguments.
    pub fn start_huddle_service(&mut self, bin: &Path, extra: &[&str]) -> Result<()> {
        let vip = format!("{VIP}:80");
        let backends: Vec<String> = (0..self.backends.len())
            .map(|i| format!("{}:{HTTP_PORT}", backend_ip(i)))
            .collect();
        let mut args = vec!["--vip", vip.as_str()];
        for b in &backends {
            args.extend(["--backend", b.as_str()]);
        }
        args.extend_from_slice(extra);
        self.start_huddle(bin, &args)
    }

    /// Starts the balancer again with the arguments of `start_huddle`
    /// (after a kill: it takes over the pinned data plane).
    pub fn restart_huddle(&mut self) -> Result<()> {
        self.launch_huddle()
    }

    /// Stops the balancer daemon and removes its data plane and state, so
    /// the next start is a fresh one.
    pub fn stop_huddle(&mut self) {
        if let Some(mut p) = self.huddle.take() {
            let _ = p.terminate(Duration::from_secs(5));
        }
        let _ = huddle_user::kernel::dataplane::unpin(&self.pins);
        let _ = std::fs::remove_file(self.socket().with_extension("state"));
    }

    /// Kills the balancer daemon with `sig` and reaps it.
    pub fn kill_huddle(&mut self, sig: i32) {
        if let Some(mut p) = self.huddle.take() {
            // SAFETY: signalling our own child by pid.
            unsafe { libc::kill(p.child.id() as i32, sig) };
            let _ = p.child.wait();
        }
    }

    fn launch_huddle(&mut self) -> Result<()> {
        let sock = self.socket();
        if self.default_pins {
            // Where this namespace's balancer pins, for the clean-up.
            self.pins = in_ns(&self.lb, || huddle_user::sys::pins::default_pin_dir("eth0"));
        }
        let args: Vec<&str> = self.huddle_args.iter().map(String::as_str).collect();
        let log = self.dir.join("huddle.log");
        // Append, so a restart keeps the earlier runs' log.
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let mut cmd = if self.ip_netns_exec {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &self.lb.name])
                .arg(&self.huddle_bin);
            c
        } else {
            huddle_user::sys::netns::command_in(&self.lb.name, &self.huddle_bin)?
        };
        cmd.args(&args)
            .envs(self.huddle_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        let mut p = Proc {
            child: cmd.spawn().context("starting huddle")?,
            what: "huddle".into(),
        };
        // Up, or gone (a refused start need not be waited out).
        let mut up = false;
        let _ = wait_until(Duration::from_secs(20), || {
            up = control::call(&sock, &Request::Status).is_ok_and(|r| r.ok);
            up || p.child.try_wait().is_ok_and(|s| s.is_some())
        });
        if !up {
            let exited = p.child.try_wait()?;
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            bail!("huddle did not come up (exit: {exited:?}); its log:\n{text}");
        }
        self.huddle = Some(p);
        Ok(())
    }

    pub fn status(&self) -> Result<Status> {
        let r: Reply = control::call(&self.socket(), &Request::Status)?;
        r.status.context("no status in reply")
    }

    /// The status of the services whose names contain one of `only`.
    pub fn status_of(&self, only: &[String]) -> Result<Status> {
        huddle_user::status::control::status_of(&self.socket(), only)
    }

    pub fn control(&self, req: Request) -> Result<Reply> {
        control::call(&self.socket(), &req)
    }

    /// The balancer's log so far.
    #[must_use]
    pub fn huddle_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("huddle.log")).unwrap_or_default()
    }

    /// The balancer's Prometheus page (its default listener), fetched
    /// inside its namespace.
    pub fn metrics_page(&self) -> Result<String> {
        crate::in_ns(&self.lb, || {
            crate::http_get_path(
                "127.0.0.1:9477".parse()?,
                "/metrics",
                Duration::from_secs(2),
            )
        })
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        // Balancer first, then its pinned data plane, then backends, then
        // namespaces.
        if let Some(mut p) = self.huddle.take() {
            let _ = p.terminate(Duration::from_secs(5));
        }
        drop_pins(&self.pins);
        if self.default_pins {
            // The default root, once no balancer pins under it.
            if let Some(root) = self.pins.parent() {
                let _ = std::fs::remove_dir(root);
            }
        }
        while let Some(mut p) = self.agents.pop() {
            let _ = p.terminate(Duration::from_secs(5));
        }
        while let Some(mut p) = self.procs.pop() {
            let _ = p.terminate(Duration::from_secs(5));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `f` every 50 ms until it holds or `timeout` passes.
/// Backend counter `k` summed over the first service's backends.
#[must_use]
pub fn backends_total(st: &Status, k: &str) -> u64 {
    st.services[0]
        .backends
        .iter()
        .map(|b| b.counters.get(k).copied().unwrap_or(0))
        .sum()
}

/// What `whoami` saw: answers per backend name, the distinct peers the
/// backends reported, failures (it stops after 5).
pub type Whoami = (
    std::collections::BTreeMap<String, u32>,
    Vec<String>,
    Vec<String>,
);

/// `n` requests for `/whoami` (`hc-backend`: its name and the peer its
/// stack saw) to `vip` from namespace `ns`.
pub fn whoami(ns: &Netns, vip: SocketAddr, n: usize) -> Whoami {
    in_ns(ns, move || {
        let mut counts = std::collections::BTreeMap::<String, u32>::new();
        let mut peers = Vec::new();
        let mut failures = Vec::new();
        for i in 0..n {
            match http_get_path(vip, "/whoami", Duration::from_secs(3)) {
                Ok(body) => {
                    let mut w = body.split_whitespace();
                    *counts.entry(w.next().unwrap_or("").into()).or_default() += 1;
                    let p = w.next().unwrap_or("").to_string();
                    if !peers.contains(&p) && peers.len() < 1000 {
                        peers.push(p);
                    }
                }
                Err(e) => failures.push(format!("request {i}: {e:#}")),
            }
            if failures.len() >= 5 {
                break;
            }
        }
        (counts, peers, failures)
    })
}
