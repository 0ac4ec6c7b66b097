//! The `huddle` command line.

mod flags;
pub mod top;

use crate::{
    config::{default_control_socket, ConfigFile, PortRange, XdpMode},
    status::control::{call, Request},
};
use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::ExitCode,
};
use tracing_subscriber::EnvFilter;

#[derive(Parser, Debug)]
#[command(
    name = "huddle",
    version,
    about = "HuddleCluster: an XDP load balancer that rests its hot backends"
)]
struct Cli {
    /// Log lines as text for people, or as one JSON object per line for
    /// log shippers; rotations, refusals and warnings carry the same
    /// fields in both.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Attach the balancer to an interface and run until SIGINT/SIGTERM.
    Run(RunArgs),
    /// Show services, rings and counters of a running balancer.
    Status {
        #[command(flatten)]
        target: Target,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Only the services whose name (VIP:PORT/PROTO) contains this;
        /// again for more.
        #[arg(long)]
        service: Vec<String>,
    },
    /// A live view of the huddle: rings, temperatures with the last
    /// minute, latency, rates, rotations; drain and undrain with a key.
    Top {
        #[command(flatten)]
        target: Target,
    },
    /// Take a backend out of its rings; its existing flows finish normally.
    Drain(DrainArgs),
    /// Detach the balancer from an interface and remove its pinned maps
    /// (through its daemon if one runs, else directly).
    Stop {
        #[command(flatten)]
        target: Target,
        /// Pin folder (default: the interface's).
        #[arg(long)]
        pin_dir: Option<PathBuf>,
        /// State file (default: next to the control socket).
        #[arg(long)]
        state_file: Option<PathBuf>,
    },
    /// Put a drained backend back into its rings.
    Undrain(DrainArgs),
    /// Withdraw this balancer's VIPs from BGP while it keeps forwarding,
    /// so the router sends new connections elsewhere and its flows finish
    /// (--undo: announce them again).
    DrainBalancer {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        undo: bool,
    },
    /// Re-read the running balancer's configuration and apply it; an
    /// invalid one changes nothing (SIGHUP does the same).
    Reload {
        #[command(flatten)]
        target: Target,
    },
    /// Check a configuration file and exit.
    Check {
        /// TOML configuration file.
        config: PathBuf,
    },
    /// Serve this host's CPU and memory as node_exporter-style Prometheus
    /// metrics, for backends without a node_exporter.
    Agent {
        /// Address to listen on.
        #[arg(long, default_value = "0.0.0.0:9100")]
        listen: std::net::SocketAddr,
        /// Unwrap the balancer's dsr-ipip packets arriving on this
        /// interface (an XDP program; no tunnel device needed).
        #[arg(long, value_name = "IFACE")]
        decap: Option<String>,
        /// Attach mode of the decap program.
        #[arg(long, value_enum, default_value_t = XdpMode::Auto)]
        xdp_mode: XdpMode,
        /// A VIP this backend serves by DSR: checked to be a local address
        /// (with ARP and rp_filter), and, with --decap, its requests timed
        /// (IPv4 or IPv6); repeat for each.
        #[arg(long = "vip")]
        vips: Vec<std::net::IpAddr>,
        /// With --decap: the outer sources (the balancers, or their
        /// `encap_prefix`) whose packets are unwrapped, as ADDR/LEN;
        /// repeat for each. Default: the subnets of the --decap
        /// interface. IP-in-IP from anywhere else is dropped.
        #[arg(long = "allow", value_name = "PREFIX")]
        allow: Vec<crate::config::IpPrefix>,
    },
    /// Write a new random cluster key to PATH (hex, mode 0600; an existing
    /// file is left alone), for `cluster.key_file`: copy the same file to
    /// every member.
    Keygen { path: PathBuf },
    /// List the data planes pinned in the host's bpffs under the default
    /// folder, each with the interface its XDP link is attached to.
    Pins {
        /// Remove those pinned for network namespaces that are gone (their
        /// link has lost its interface).
        #[arg(long)]
        prune: bool,
    },
    /// Time the XDP program per packet under BPF_PROG_TEST_RUN, next to
    /// baseline programs in the same run.
    Bench(crate::bench::BenchArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish,
    /// powershell).
    #[command(hide = true)]
    Completions { shell: clap_complete::Shell },
    /// Print the man page (roff).
    #[command(hide = true)]
    Man,
}

#[derive(Args, Debug)]
struct Target {
    /// Interface of the balancer (selects /run/huddle/IFACE.sock); default:
    /// the only balancer running on this host.
    #[arg(long, short)]
    iface: Option<String>,
    /// Control socket path (overrides --iface).
    #[arg(long)]
    control_socket: Option<PathBuf>,
}

impl Target {
    /// The control socket to talk to: the one named, or the only balancer
    /// running here.
    fn socket(&self) -> Result<PathBuf> {
        Ok(self.resolve(false)?.0)
    }

    /// The control socket and, when known, the interface. Without
    /// `--iface` or `--control-socket`: the only balancer whose socket in
    /// the default folder answers; for `stop` (`stopping`), failing that,
    /// the only one whose data plane is still pinned with no daemon. With
    /// several, they are listed and the caller must choose.
    fn resolve(&self, stopping: bool) -> Result<(PathBuf, Option<String>)> {
        match (&self.control_socket, &self.iface) {
            (Some(p), i) => Ok((p.clone(), i.clone())),
            (None, Some(i)) => Ok((default_control_socket(i), Some(i.clone()))),
            (None, None) => {
                let dir = default_control_socket("x")
                    .parent()
                    .map(Path::to_path_buf)
                    .unwrap_or_default();
                let found = running_balancers(&dir, stopping);
                match found.as_slice() {
                    [one] => Ok((one.1.clone(), Some(one.0.clone()))),
                    [] => bail!(
                        "no balancer runs on this host (no answering control socket in {}); say which: --iface IFACE or --control-socket PATH",
                        dir.display()
                    ),
                    many => bail!(
                        "{} balancers run on this host: {}; say which with --iface",
                        many.len(),
                        many.iter()
                            .map(|(i, _)| i.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                }
            }
        }
    }
}

/// (interface, control socket) of each balancer in `dir` whose socket
/// answers; with `stopping` and none answering, of each whose daemon is
/// gone but whose data plane is still pinned.
fn running_balancers(dir: &Path, stopping: bool) -> Vec<(String, PathBuf)> {
    let mut socks: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter_map(|p| {
            let iface = p.file_name()?.to_str()?.strip_suffix(".sock")?.to_string();
            Some((iface, p))
        })
        .collect();
    socks.sort();
    let live: Vec<_> = socks
        .iter()
        .filter(|(_, p)| std::os::unix::net::UnixStream::connect(p).is_ok())
        .cloned()
        .collect();
    if !live.is_empty() || !stopping {
        return live;
    }
    socks
        .into_iter()
        .filter(|(i, _)| {
            let pins = crate::sys::pins::default_pin_dir(i);
            let pins = crate::sys::pins::host_pin_dir(&pins).unwrap_or(pins);
            pins.join(huddle_common::maps::FLOWS).exists()
        })
        .collect()
}

#[derive(Args, Debug)]
struct DrainArgs {
    #[command(flatten)]
    target: Target,
    /// Backend IP:PORT.
    #[arg(long)]
    backend: String,
    /// Only in this service (IP:PORT[/tcp|/udp]); default: every service
    /// that has the backend.
    #[arg(long)]
    vip: Option<String>,
}

#[derive(Args, Debug, Clone)]
struct RunArgs {
    /// TOML configuration file; flags given too override its values.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Interface to attach to.
    #[arg(long, short)]
    iface: Option<String>,
    /// Service address, IP:PORT[/tcp|/udp] (tcp by default).
    #[arg(long)]
    vip: Option<String>,
    /// Backend IP:PORT of --vip; repeat for each backend.
    #[arg(long = "backend")]
    backends: Vec<String>,
    /// How --vip's packets reach its backends.
    #[arg(long, value_enum)]
    mode: Option<crate::config::Mode>,
    /// How --vip's new flows pick a backend.
    #[arg(long, value_enum)]
    selection: Option<crate::config::Selection>,
    /// Which latency judges the `--vip` service's backends (auto, ttfb,
    /// connect, off).
    #[arg(long, value_enum)]
    latency: Option<crate::config::LatencyMode>,
    /// Outer source addresses of dsr-ipip packets, ADDR/LEN (default: the
    /// interface's address).
    #[arg(long)]
    encap_prefix: Option<crate::config::Prefix>,
    /// Source address toward backends (default: the interface's IPv4);
    /// repeat for a pool (more NAT tuples per backend).
    #[arg(long = "snat-ip")]
    snat_ips: Vec<Ipv4Addr>,
    /// Attach mode.
    #[arg(long, value_enum)]
    xdp_mode: Option<XdpMode>,
    /// NAT source ports, LOW-HIGH, outside the kernel's ephemeral range.
    #[arg(long)]
    nat_ports: Option<PortRange>,
    /// Flow table entries.
    #[arg(long)]
    flow_table_size: Option<u32>,
    /// Control socket path (default /run/huddle/IFACE.sock).
    #[arg(long)]
    control_socket: Option<PathBuf>,
    /// Turn rotation off: plain round robin (temperatures still shown).
    #[arg(long)]
    no_rotation: bool,
    /// Huddle tick in milliseconds.
    #[arg(long)]
    tick_ms: Option<u64>,
    /// Where /metrics (and a cluster's pages) are served, or "off"
    /// (default 127.0.0.1:9477; `huddle.listen`).
    #[arg(long, alias = "metrics-listen")]
    listen: Option<String>,
    /// bpffs folder for the pinned maps and link
    /// (default /sys/fs/bpf/huddle/IFACE).
    #[arg(long)]
    pin_dir: Option<PathBuf>,
    /// Remove the data plane when the daemon exits (default: it keeps
    /// running and the next `huddle run` takes it over).
    #[arg(long)]
    detach_on_exit: bool,
}

fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_env("HUDDLE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
    let _ = match format {
        LogFormat::Text => fmt.try_init(),
        LogFormat::Json => fmt.json().flatten_event(true).try_init(),
    };
}

/// Entry point of the `huddle` binary.
#[must_use]
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    match dispatch(cli.cmd) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("huddle: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs one command: each is a line here or a function of its own below.
fn dispatch(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Run(args) => run(args),
        Cmd::Status {
            target,
            json,
            service,
        } => status(&target, json, &service),
        Cmd::Stop {
            target,
            pin_dir,
            state_file,
        } => stop(&target, pin_dir, state_file),
        Cmd::Reload { target } => control_message(&target, Request::Reload),
        Cmd::Top { target } => crate::cli::top::run(&target.socket()?),
        Cmd::Drain(a) => control_message(
            &a.target,
            Request::Drain {
                backend: a.backend,
                vip: a.vip,
            },
        ),
        Cmd::Undrain(a) => control_message(
            &a.target,
            Request::Undrain {
                backend: a.backend,
                vip: a.vip,
            },
        ),
        Cmd::DrainBalancer { target, undo } => {
            control_message(&target, Request::DrainBalancer { undo })
        }
        Cmd::Check { config } => check(&config),
        Cmd::Bench(args) => crate::bench::run(&args),
        Cmd::Pins { prune } => pins(prune),
        Cmd::Keygen { path } => {
            crate::config::key::generate(&path)?;
            println!(
                "wrote a cluster key to {} (mode 0600): set cluster.key_file to it on every member",
                path.display()
            );
            Ok(())
        }
        Cmd::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "huddle", &mut std::io::stdout());
            Ok(())
        }
        Cmd::Man => {
            let cmd = <Cli as clap::CommandFactory>::command();
            clap_mangen::Man::new(cmd)
                .render(&mut std::io::stdout())
                .context("writing the man page")
        }
        Cmd::Agent {
            listen,
            decap,
            xdp_mode,
            vips,
            allow,
        } => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(crate::agent::run(crate::agent::AgentArgs {
                listen,
                decap,
                xdp_mode,
                vips,
                allow,
            }))
        }
    }
}

/// `huddle run`: the daemon, re-reading the same flags and file on reload.
fn run(args: RunArgs) -> Result<()> {
    let cfg = args.config()?;
    let reloader: crate::daemon::balancer::Reloader = std::sync::Arc::new(move || args.config());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(crate::daemon::run::run(cfg, Some(reloader)))
}

/// `huddle status`, as text or JSON.
fn status(target: &Target, json: bool, only: &[String]) -> Result<()> {
    let status = crate::status::control::status_of(&target.socket()?, only)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", status.render());
    }
    Ok(())
}

/// `huddle stop`: the daemon told to remove everything (it knows its
/// pins), or the pins removed by hand when no daemon answers.
fn stop(target: &Target, pin_dir: Option<PathBuf>, state_file: Option<PathBuf>) -> Result<()> {
    use crate::daemon::stop::{by_daemon, by_hand};
    let resolved = target.resolve(true);
    if let Ok((socket, _)) = &resolved {
        if let Some(done) = by_daemon(socket)? {
            println!("{done}");
            return Ok(());
        }
    }
    let (socket, iface) = match (resolved, &pin_dir) {
        (Ok((s, i)), _) => (Some(s), i),
        // No socket to find, but the pins are named: enough.
        (Err(_), Some(_)) => (None, None),
        (Err(e), None) => return Err(e),
    };
    let pins = match (pin_dir, &iface) {
        (Some(p), _) => p,
        (None, Some(i)) => crate::sys::pins::default_pin_dir(i),
        (None, None) => bail!("say which pin folder: --iface IFACE or --pin-dir PATH"),
    };
    let state_file = state_file.or_else(|| socket.as_ref().map(|s| s.with_extension("state")));
    let asked = socket.map_or("any control socket".to_string(), |s| {
        s.display().to_string()
    });
    println!("{}", by_hand(&asked, &pins, state_file.as_deref())?);
    Ok(())
}

/// `huddle pins`: what is pinned under the default root, and (with
/// `prune`) the pins of namespaces that are gone removed.
fn pins(prune: bool) -> Result<()> {
    use crate::kernel::dataplane::stale;
    let root = PathBuf::from(crate::sys::pins::PIN_ROOT);
    let root = crate::sys::pins::host_pin_dir(&root).unwrap_or(root);
    // As the operator knows the folders, not through another mount space.
    let root_shown = PathBuf::from(crate::sys::pins::PIN_ROOT);
    let shown = |d: &Path| root_shown.join(d.file_name().unwrap_or_default());
    for (dir, link) in stale::list(&root) {
        let what = match link {
            Ok(l) if l.ifindex == 0 => "interface gone (stale)".to_string(),
            Ok(l) => format!("attached to ifindex {} (program {})", l.ifindex, l.prog_id),
            Err(e) => format!("no readable link: {e:#}"),
        };
        println!("{}  {what}", shown(&dir).display());
    }
    if prune {
        for d in stale::remove(&root) {
            println!("removed {}", shown(&d).display());
        }
    }
    Ok(())
}

/// `huddle check`: the config validated, renamed keys warned about.
fn check(config: &Path) -> Result<()> {
    let cfg = ConfigFile::load(config)?
        .validate()
        .with_context(|| format!("config {}", config.display()))?;
    for r in &cfg.renamed {
        println!("warning: {r}");
    }
    println!(
        "{}: OK, {} service(s) on {}",
        config.display(),
        cfg.services.len(),
        cfg.interface
    );
    // Without snat_ips, the interface's one address (known only at start).
    let snat = cfg.snat_ips.len().max(1);
    println!(
        "source NAT: ports {} x {snat} address(es) = {} tuples per backend: about {} new connections a second per backend before a tuple comes back within a TIME_WAIT (60 s)",
        cfg.nat_ports,
        cfg.nat_ports.tuples(snat),
        cfg.nat_ports.sustainable_rate(snat)
    );
    Ok(())
}

fn control_message(target: &Target, req: Request) -> Result<()> {
    let reply = call(&target.socket()?, &req)?;
    if !reply.ok {
        bail!("{}", reply.error.unwrap_or_default());
    }
    println!("{}", reply.message.unwrap_or_default());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn only_answering_sockets_count_as_running_balancers() {
        let dir = std::env::temp_dir().join(format!("huddle-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let _a = UnixListener::bind(dir.join("eth0.sock")).unwrap();
        let _b = UnixListener::bind(dir.join("eth1.sock")).unwrap();
        // A daemon killed without cleaning up leaves a socket nobody answers.
        drop(UnixListener::bind(dir.join("eth2.sock")).unwrap());
        std::fs::write(dir.join("eth0.state"), "not a socket").unwrap();
        let found: Vec<String> = running_balancers(&dir, false)
            .into_iter()
            .map(|(i, _)| i)
            .collect();
        assert_eq!(found, ["eth0", "eth1"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
