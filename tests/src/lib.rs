//! Testbeds of network namespaces for HuddleCluster's tests and demo.
//!
//! Addresses all come from 10.213.0.0/16 and exist only inside namespaces
//! a testbed creates: hosts on one bridged segment 10.213.0.0/24 (balancer
//! .1, client .2, backends .11 and up), VIPs in 10.213.100.0/24, routed by
//! the client via the balancer. Names carry a prefix with the process id
//! and a counter; everything is removed on drop, also when a test fails.

pub mod scaleout;

use anyhow::{bail, Context, Result};
use huddle_user::{
    status::control::{self, Reply, Request},
    status::Status,
    sys::netns::Netns,
};
use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

pub const LB_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
/// The same hosts on IPv6: fd00:213::/64 (balancer ::1, client ::2,
/// backends ::11 and up), VIPs in fd00:213:100::/64.
pub const LB_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 1);
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 2);
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0x100, 0, 0, 0, 0, 1);
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 2);
pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 213, 100, 1);
pub const HTTP_PORT: u16 = 8080;
pub const UDP_PORT: u16 = 5353;
const NAME_PREFIX: &str = "hct";
/// Testbeds pin their balancers' data planes under here.
const PIN_ROOT: &str = "/sys/fs/bpf/huddle-tests";

/// Where the balancer named `name` (unique to its testbed) pins.
#[must_use]
pub fn pin_dir(name: &str) -> PathBuf {
    PathBuf::from(PIN_ROOT).join(name)
}

/// Removes the pins in `dir` (after its balancer stopped), and the root
/// folder once no testbed uses it.
pub fn drop_pins(dir: &Path) {
    let _ = huddle_user::kernel::dataplane::unpin(dir);
    let _ = std::fs::remove_dir(PIN_ROOT);
}

/// Address of backend `i` (0-based).
#[must_use]
pub fn backend_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 213, 0, 11 + i as u8)
}

/// IPv6 address of backend `i`.
#[must_use]
pub fn backend_ip6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 0x11 + i as u16)
}

/// A name unique to this process and call.
#[must_use]
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{NAME_PREFIX}{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Lifts this process's open-file limit to its hard maximum.
pub fn raise_nofile() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit with a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Fails with a clear message unless running as root.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        panic!("this test needs root (network namespaces, XDP); run it as root, as CI does");
    }
}

/// For the tools (`hc-demo`, `hc-compare`): on SIGINT or SIGTERM, remove
/// this process's namespaces, the processes in them and its pins, then
/// exit.
pub fn remove_on_signal() {
    huddle_user::sys::netns::remove_on_signal(drop_own_pins);
}

/// Removes the pins of this process's balancers.
fn drop_own_pins() {
    let own = format!("{NAME_PREFIX}{}-", std::process::id());
    for d in std::fs::read_dir(PIN_ROOT).into_iter().flatten().flatten() {
        if d.file_name().to_string_lossy().starts_with(&own) {
            drop_pins(&d.path());
        }
    }
}

/// Deletes namespaces left by earlier runs of this harness whose process
/// is gone.
pub fn sweep_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(NAME_PREFIX) else {
            continue;
        };
        let pid: u32 = rest
            .split('-')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if pid != 0 && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
    }
    let Ok(dirs) = std::fs::read_dir(PIN_ROOT) else {
        return;
    };
    for d in dirs.flatten() {
        let name = d.file_name().to_string_lossy().to_string();
        let pid: u32 = name
            .strip_prefix(NAME_PREFIX)
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if pid != 0 && !Path::new(&format!("/proc/{pid}")).exists() {
            drop_pins(&d.path());
        }
    }
}

/// Runs `f` on a thread inside namespace `ns` and returns its result.
pub fn in_ns<T: Send + 'static>(ns: &Netns, f: impl FnOnce() -> T + Send + 'static) -> T {
    let name = ns.name.clone();
    thread::spawn(move || {
        huddle_user::sys::netns::enter(&name).expect("enter namespace");
        f()
    })
    .join()
    .expect("thread in namespace panicked")
}

/// A child process, killed (by pid) and reaped on drop.
pub struct Proc {
    pub child: Child,
    pub what: String,
}

impl Proc {
    /// Sends SIGTERM and waits up to `timeout`; returns whether it exited
    /// successfully.
    pub fn terminate(&mut self, timeout: Duration) -> Result<bool> {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status.success());
            }
            if start.elapsed() > timeout {
                bail!("{} did not exit within {timeout:?} of SIGTERM", self.what);
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Starts `prog args` inside namespace `ns`.
pub fn spawn_in(ns: &Netns, prog: &Path, args: &[&str], log: Option<&Path>) -> Result<Proc> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name])
        .arg(prog)
        .args(args)
        .stdin(Stdio::null());
    match log {
        Some(path) => {
            let f = std::fs::File::create(path)?;
            cmd.stdout(f.try_clone()?).stderr(f);
        }
        None => {
            cmd.stdout(Stdio::null()).stderr(Stdio::null());
        }
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {}", prog.display()))?;
    Ok(Proc {
        child,
        what: prog.display().to_string(),
    })
}

/// A fresh name prefix for `tag`, a namespace holding the bridge `br0`
/// that hosts hang off, and a folder for sockets and logs (stale test
/// namespaces of dead runs swept first).
pub fn segment(tag: &str) -> Result<(String, Netns, PathBuf)> {
    sweep_stale();
    let prefix = unique(tag);
    let switch = Netns::create(&format!("{prefix}-sw"))?;
    switch.ip(&["link", "add", "br0", "type", "bridge"])?;
    switch.ip(&["link", "set", "br0", "up"])?;
    let dir = std::env::temp_dir().join(&prefix);
    std::fs::create_dir_all(&dir)?;
    Ok((prefix, switch, dir))
}

/// Connects `ns` to the bridge of `switch` by a veth pair (`port` on the
/// bridge, `eth0` in `ns`, up) and gives it `ip`/24.
pub fn plug(switch: &Netns, port: &str, ns: &Netns, ip: Ipv4Addr) -> Result<()> {
    switch.ip(&[
        "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", &ns.name,
    ])?;
    switch.ip(&["link", "set", port, "master", "br0", "up"])?;
    ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
    ns.ip(&["link", "set", "eth0", "up"])
}

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
            backend_bin: PathBuf::new(),
            backend_extra: Vec::new(),
            dir,
            ip_netns_exec: false,
            default_socket: false,
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
        args.push("--pin-dir".into());
        args.push(self.pins.display().to_string());
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
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        let mut p = Proc {
            child: cmd.spawn().context("starting huddle")?,
            what: "huddle".into(),
        };
        let ready = wait_until(Duration::from_secs(20), || {
            control::call(&sock, &Request::Status).is_ok_and(|r| r.ok)
        });
        if ready.is_err() {
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

    pub fn control(&self, req: Request) -> Result<Reply> {
        control::call(&self.socket(), &req)
    }

    /// The balancer's log so far.
    #[must_use]
    pub fn huddle_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("huddle.log")).unwrap_or_default()
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
        while let Some(mut p) = self.agents.pop() {
            let _ = p.terminate(Duration::from_secs(5));
        }
        while let Some(mut p) = self.procs.pop() {
            let _ = p.terminate(Duration::from_secs(5));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

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

/// The binary `name` next to the running one.
pub fn sibling(name: &str) -> Result<PathBuf> {
    Ok(std::env::current_exe()?
        .parent()
        .context("binary folder")?
        .join(name))
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

/// Whether any XDP program is attached in namespace `ns`.
pub fn xdp_attached(ns: &Netns) -> bool {
    let out = Command::new("ip")
        .args(["-n", &ns.name, "-o", "link", "show"])
        .output();
    out.is_ok_and(|o| {
        let text = String::from_utf8_lossy(&o.stdout);
        text.contains(" xdp") || text.contains("prog/xdp")
    })
}

/// Runs a command and returns (success, stdout, stderr).
pub fn output(prog: &Path, args: &[&str]) -> Result<(bool, String, String)> {
    let o = Command::new(prog).args(args).output()?;
    Ok((
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    ))
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
