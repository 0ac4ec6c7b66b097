//! Balancer configuration: the TOML file form, the command-line form, and
//! the validation both go through. Every error names the field (and, for a
//! file, the line) so a bad config never gets as far as the kernel.

pub mod tuning;
pub mod url;

use anyhow::{bail, Context, Result};
use huddle_common::{MAX_BACKENDS, MAX_SERVICES, RING_CAPACITY};
use serde::Deserialize;
use std::{
    collections::HashSet,
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};
use tuning::{RotationParams, ThermalParams};

/// Transport protocol of a service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    #[must_use]
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => huddle_common::PROTO_TCP,
            Proto::Udp => huddle_common::PROTO_UDP,
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        })
    }
}

impl FromStr for Proto {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(Proto::Tcp),
            "udp" => Ok(Proto::Udp),
            _ => bail!("unknown protocol {s:?} (expected tcp or udp)"),
        }
    }
}

/// How a service's packets reach its backends.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Source NAT: backends see the balancer's address; replies come back
    /// through it (and it times them).
    #[default]
    Snat,
    /// Direct server return on this L2 segment: only the destination MAC
    /// changes. Backends have the VIP on a local interface and answer
    /// clients themselves.
    DsrL2,
    /// Direct server return by IP-in-IP to the backend, which unwraps it
    /// (`huddle agent --decap`) and answers clients itself.
    DsrIpip,
}

impl Mode {
    /// `huddle_common::service_mode` value.
    #[must_use]
    pub fn number(self) -> u32 {
        match self {
            Mode::Snat => huddle_common::service_mode::SNAT,
            Mode::DsrL2 => huddle_common::service_mode::DSR_L2,
            Mode::DsrIpip => huddle_common::service_mode::DSR_IPIP,
        }
    }

    #[must_use]
    pub fn is_dsr(self) -> bool {
        self != Mode::Snat
    }
}

/// How a service picks the backend of a new flow.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    /// The inner ring in turn, passing over a backend that owes an answer
    /// too long, and of two entries the one owing for less time: the best
    /// spread one balancer can make alone.
    #[default]
    #[value(name = "round_robin")]
    RoundRobin,
    /// Maglev consistent hashing over the inner ring: every balancer
    /// sends the same new flow to the same backend, and a flow a router
    /// moves to another balancer keeps its backend.
    Maglev,
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Selection::RoundRobin => "round_robin",
            Selection::Maglev => "maglev",
        })
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Snat => "snat",
            Mode::DsrL2 => "dsr-l2",
            Mode::DsrIpip => "dsr-ipip",
        })
    }
}

/// An IPv4 prefix, `"10.0.0.0/24"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefix {
    pub addr: Ipv4Addr,
    pub len: u8,
}

impl Prefix {
    /// The prefix's mask, host order.
    #[must_use]
    pub fn mask(&self) -> u32 {
        if self.len == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(self.len))
        }
    }

    #[must_use]
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.addr) & self.mask()
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl FromStr for Prefix {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let (a, l) = s.split_once('/').unwrap_or((s, "32"));
        let addr: Ipv4Addr = a
            .trim()
            .parse()
            .with_context(|| format!("{s:?} is not an IPv4 prefix (ADDR/LEN)"))?;
        let len: u8 = l
            .trim()
            .parse()
            .ok()
            .filter(|l| *l <= 32)
            .with_context(|| format!("{s:?}: prefix length must be 0..=32"))?;
        let p = Prefix { addr, len };
        if u32::from(addr) & !p.mask() != 0 {
            bail!(
                "{s:?}: host bits set (did you mean {}/{len}?)",
                Ipv4Addr::from(u32::from(addr) & p.mask())
            );
        }
        Ok(p)
    }
}

impl<'de> Deserialize<'de> for Prefix {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse()
            .map_err(|e: anyhow::Error| serde::de::Error::custom(format!("{e:#}")))
    }
}

/// How the program is attached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    /// Native (driver) mode, falling back to generic mode with a warning;
    /// generic on a veth whose peer runs no XDP program (native XDP_TX
    /// frames are lost there).
    #[default]
    Auto,
    /// Native (driver) mode only.
    Native,
    /// Generic (skb) mode: works on any interface, slower.
    Generic,
}

/// An inclusive range of ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    pub min: u16,
    pub max: u16,
}

impl PortRange {
    #[must_use]
    pub fn overlaps(&self, other: &PortRange) -> bool {
        self.min <= other.max && other.min <= self.max
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.min, self.max)
    }
}

impl FromStr for PortRange {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let (a, b) = s
            .split_once('-')
            .with_context(|| format!("{s:?} is not a port range like 20000-32767"))?;
        let min: u16 = a
            .trim()
            .parse()
            .with_context(|| format!("bad port {a:?}"))?;
        let max: u16 = b
            .trim()
            .parse()
            .with_context(|| format!("bad port {b:?}"))?;
        if min == 0 || min > max {
            bail!("port range {s:?} must be low-high with 0 < low <= high");
        }
        Ok(PortRange { min, max })
    }
}

impl<'de> Deserialize<'de> for PortRange {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse()
            .map_err(|e: anyhow::Error| serde::de::Error::custom(format!("{e:#}")))
    }
}

/// Default NAT source ports: below Linux's default ephemeral range
/// (32768-60999), so translated flows never collide with the balancer
/// host's own connections.
pub const DEFAULT_NAT_PORTS: PortRange = PortRange {
    min: 20000,
    max: 32767,
};

/// A backend as written in the file: `"10.0.0.11:8080"` or a table.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum BackendEntry {
    Addr(String),
    Table(BackendTable),
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendTable {
    /// `IP:PORT` of the backend.
    pub addr: String,
    /// Scales the heat threshold: 2.0 is twice as hard to evict.
    pub weight: Option<f64>,
    /// Prometheus text endpoint of the backend's host (node_exporter or
    /// `huddle agent`), e.g. `http://10.0.0.11:9100/metrics`.
    pub metrics: Option<String>,
    /// Active flows at which its connection load counts as full.
    pub capacity: Option<u64>,
}

/// How resting and unhealthy backends are probed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    /// TCP connect.
    Tcp,
    /// HTTP GET of `path`; a 2xx or 3xx status passes.
    #[default]
    Http,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeFile {
    pub kind: Option<ProbeKind>,
    pub path: Option<String>,
    pub interval_ms: Option<u64>,
    pub timeout_ms: Option<u64>,
    /// Failed probes in a row that make a backend unhealthy.
    pub fall: Option<u32>,
    /// Passed probes in a row that make it healthy again.
    pub rise: Option<u32>,
}

/// The `[huddle]` table: temperatures and rotation. Every field optional.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HuddleFile {
    /// Turn rotation off: plain round robin over every backend.
    pub rotation: Option<bool>,
    pub tick_ms: Option<u64>,
    pub alpha: Option<f64>,
    pub heat: Option<f64>,
    pub cool: Option<f64>,
    pub min_inner: Option<usize>,
    pub cooldown_ms: Option<u64>,
    pub min_rest_ms: Option<u64>,
    pub max_rest_ms: Option<u64>,
    pub warmup_ms: Option<u64>,
    pub full_anomaly_ratio: Option<f64>,
    pub latency_ceiling_ms: Option<f64>,
    /// The inner ring's median latency counts as at least this (ms).
    pub latency_floor_ms: Option<f64>,
    pub weights: Option<tuning::Weights>,
    /// A backend owing answers this long (two or more requests, or one
    /// for three times as long) is hung: the most it waits, when the ring's
    /// own answer times do not call for less.
    pub hung_after_ms: Option<u64>,
    /// The least `hung_after` ever drops to, however fast the ring answers.
    pub hung_after_min_ms: Option<u64>,
    /// `hung_after` as a multiple of the ring's median p99 time to first
    /// byte (between the two bounds above).
    pub hung_after_p99: Option<f64>,
    /// New flows pass over a backend that owes an answer for longer than
    /// twice the ring's p99 (in the kernel, before it is judged hung).
    pub pass_over_owing: Option<bool>,
    /// SYNs unanswered this long make a backend unreachable.
    pub syn_timeout_ms: Option<u64>,
    /// Failed share of a tick's attempts that makes a backend unhealthy.
    pub error_threshold: Option<f64>,
    /// Request samples wanted before a tick's latency is trusted alone.
    pub min_samples: Option<u64>,
    /// Default backend capacity (active flows).
    pub capacity: Option<u64>,
    /// Also move existing flows off a backend found dead.
    pub move_flows_off_dead: Option<bool>,
    /// Address of the Prometheus endpoint, or "off".
    pub metrics_listen: Option<String>,
    pub metrics_interval_ms: Option<u64>,
    pub metrics_timeout_ms: Option<u64>,
    pub probe: Option<ProbeFile>,
}

/// One `[[service]]` table.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceFile {
    /// `IP:PORT`, optionally with `/tcp` or `/udp`.
    pub vip: String,
    /// Overrides a protocol suffix on `vip`; tcp when neither says.
    pub proto: Option<Proto>,
    pub backends: Vec<BackendEntry>,
    /// UDP only: an established flow with no datagram either way for this
    /// long is removed, and its NAT tuple freed (default 30,000).
    pub udp_idle_ms: Option<u64>,
    /// `"snat"` (default), `"dsr-l2"` or `"dsr-ipip"`.
    pub mode: Option<Mode>,
    /// `"round_robin"` (default) or `"maglev"`.
    pub selection: Option<Selection>,
}

/// The whole file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Interface to attach to.
    pub interface: Option<String>,
    /// Source address toward backends; default: the interface's address.
    pub snat_ip: Option<Ipv4Addr>,
    /// Several source addresses toward backends (instead of `snat_ip`):
    /// each multiplies the NAT tuples a backend can be given without
    /// reusing one still in TIME_WAIT. Each must be an address of this host.
    pub snat_ips: Option<Vec<Ipv4Addr>>,
    /// IPv6 source addresses toward IPv6 backends (source NAT); default:
    /// the interface's global IPv6 address. Each must be this host's.
    pub snat_ips6: Option<Vec<Ipv6Addr>>,
    /// Outer source addresses of `dsr-ipip` packets: each flow takes one
    /// from this prefix (default: the interface's address alone).
    pub encap_prefix: Option<Prefix>,
    pub xdp_mode: Option<XdpMode>,
    /// NAT source port range, `"low-high"`.
    pub nat_ports: Option<PortRange>,
    /// Entries in the flow table (and in the NAT table).
    pub flow_table_size: Option<u32>,
    /// Entries of each Maglev table (a prime; default 65,537).
    pub maglev_table_size: Option<u32>,
    /// Slots in the half-open table (TCP flows before the client's ACK),
    /// rounded up to a power of two.
    pub half_open_table_size: Option<u32>,
    /// Path of the control socket `huddle status` talks to.
    pub control_socket: Option<PathBuf>,
    /// bpffs folder where the maps and the XDP link are pinned, so the
    /// data plane outlives the daemon (default /sys/fs/bpf/huddle/IFACE).
    pub pin_dir: Option<PathBuf>,
    /// Where temperatures are kept across restarts (default: the control
    /// socket's path with extension `.state`).
    pub state_file: Option<PathBuf>,
    /// Remove the data plane when the daemon exits (default: keep it).
    pub detach_on_exit: Option<bool>,
    #[serde(default, rename = "service")]
    pub services: Vec<ServiceFile>,
    #[serde(default)]
    pub huddle: HuddleFile,
    /// Announcing the VIPs by BGP (none without this table).
    pub bgp: Option<BgpFile>,
    /// Balancers sharing the VIPs, which must agree on the rings.
    pub cluster: Option<ClusterFile>,
}

/// `[cluster]`: the balancers that share the VIPs.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    /// Every balancer's `huddle.metrics_listen` (this one's included), in
    /// the same order on each: the first that answers decides the rings
    /// and the others take them.
    pub members: Vec<SocketAddr>,
}

/// Validated `[cluster]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    pub members: Vec<SocketAddr>,
    /// This balancer's place in `members`.
    pub me: usize,
}

/// `[bgp]`: announcing the VIPs through the BGP daemon on this host.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BgpFile {
    /// `"bird"` (bird2), the one driven so far (the default).
    pub daemon: Option<String>,
    /// bird's control socket (default /run/bird/bird.ctl).
    pub control_socket: Option<PathBuf>,
    /// The file of VIP routes huddle writes and bird.conf includes
    /// (default /run/huddle/IFACE.bird.conf).
    pub routes_file: Option<PathBuf>,
}

/// Validated `[bgp]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Bgp {
    pub control_socket: PathBuf,
    pub routes_file: PathBuf,
}

/// An established UDP flow silent for this long is removed (as Linux
/// conntrack's `nf_conntrack_udp_timeout`).
pub const DEFAULT_UDP_IDLE: Duration = Duration::from_secs(30);

/// A validated service.
#[derive(Clone, Debug, PartialEq)]
pub struct Service {
    pub vip: SocketAddr,
    pub proto: Proto,
    pub backends: Vec<SocketAddr>,
    /// Per backend, parallel to `backends`.
    pub options: Vec<BackendOptions>,
    /// UDP: how long an established flow may stay silent before it is
    /// removed (see `ServiceFile::udp_idle_ms`).
    pub udp_idle: Duration,
    pub mode: Mode,
    pub selection: Selection,
}

/// What the huddle knows about a backend beyond its address.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendOptions {
    pub weight: f64,
    pub metrics: Option<String>,
    pub capacity: u64,
}

/// Validated probe settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Probe {
    pub kind: ProbeKind,
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    pub fall: u32,
    pub rise: u32,
}

/// Validated huddle settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Huddle {
    pub rotation: bool,
    pub tick: Duration,
    pub thermal: ThermalParams,
    pub rotation_params: RotationParams,
    /// The most `hung_after` is (see `ServiceHuddle::hung_after`).
    pub hung_after: Duration,
    pub hung_after_min: Duration,
    pub hung_after_p99: f64,
    pub pass_over_owing: bool,
    pub syn_timeout: Duration,
    pub error_threshold: f64,
    pub min_samples: u64,
    pub move_flows_off_dead: bool,
    pub metrics_listen: Option<SocketAddr>,
    pub metrics_interval: Duration,
    pub metrics_timeout: Duration,
    pub probe: Probe,
}

/// Default capacity of a backend, in active flows.
pub const DEFAULT_CAPACITY: u64 = 10_000;
/// Default address of the Prometheus endpoint.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9477";

impl Default for Huddle {
    fn default() -> Self {
        validate_huddle(&HuddleFile::default()).expect("the default huddle settings are valid")
    }
}

impl Service {
    /// A service whose backends all have default options.
    #[must_use]
    pub fn plain(vip: SocketAddr, proto: Proto, backends: Vec<SocketAddr>) -> Service {
        let options = backends
            .iter()
            .map(|_| BackendOptions {
                weight: 1.0,
                metrics: None,
                capacity: DEFAULT_CAPACITY,
            })
            .collect();
        Service {
            vip,
            proto,
            backends,
            options,
            udp_idle: DEFAULT_UDP_IDLE,
            mode: Mode::Snat,
            selection: Selection::RoundRobin,
        }
    }

    /// `10.0.0.1:80/tcp`.
    #[must_use]
    pub fn name(&self) -> String {
        format!("{}/{}", self.vip, self.proto)
    }
}

/// A validated configuration, ready for the data plane.
#[derive(Clone, Debug)]
pub struct Config {
    pub interface: String,
    /// SNAT addresses; empty: the interface's IPv4 address.
    pub snat_ips: Vec<Ipv4Addr>,
    /// IPv6 SNAT addresses; empty: the interface's global IPv6 address.
    pub snat_ips6: Vec<Ipv6Addr>,
    /// `None`: the interface's address alone.
    pub encap_prefix: Option<Prefix>,
    pub xdp_mode: XdpMode,
    pub nat_ports: PortRange,
    pub flow_table_size: u32,
    pub half_open_table_size: u32,
    pub maglev_table_size: u32,
    pub control_socket: PathBuf,
    /// `None`: the default for the interface (see `host::default_pin_dir`).
    pub pin_dir: Option<PathBuf>,
    pub state_file: PathBuf,
    pub detach_on_exit: bool,
    pub services: Vec<Service>,
    pub huddle: Huddle,
    pub bgp: Option<Bgp>,
    pub cluster: Option<Cluster>,
}

pub const MIN_FLOW_TABLE: u32 = 1024;
/// Bounds of `maglev_table_size`: every service has two tables of it
/// (the MAGLEV map holds 128 x this many ids, 64 MiB at the top).
pub const MIN_MAGLEV: u32 = 251;
pub const MAX_MAGLEV: u32 = 131_071;
pub const MAX_FLOW_TABLE: u32 = 1 << 24;

/// Default control socket for an interface.
#[must_use]
pub fn default_control_socket(interface: &str) -> PathBuf {
    PathBuf::from(format!("/run/huddle/{interface}.sock"))
}

/// Parses `IP:PORT[/tcp|/udp]`.
pub fn parse_vip(s: &str) -> Result<(SocketAddr, Option<Proto>)> {
    let (addr, proto) = match s.rsplit_once('/') {
        Some((a, p)) => (a, Some(p.parse::<Proto>()?)),
        None => (s, None),
    };
    Ok((parse_endpoint(addr)?, proto))
}

/// Parses `IP:PORT` (IPv6 as `[ADDR]:PORT`) of an endpoint with a
/// non-zero port.
pub fn parse_endpoint(s: &str) -> Result<SocketAddr> {
    let addr: SocketAddr = s
        .trim()
        .parse()
        .with_context(|| format!("{s:?} is not an IP:PORT address (IPv6: [ADDR]:PORT)"))?;
    if addr.port() == 0 {
        bail!("{s:?}: port 0 is not a service port");
    }
    let ip = addr.ip();
    if ip.is_unspecified() || ip.is_multicast() || ip == IpAddr::V4(Ipv4Addr::BROADCAST) {
        bail!("{s:?}: not a unicast address");
    }
    if let IpAddr::V6(v6) = ip {
        if v6.to_ipv4_mapped().is_some() || v6.is_loopback() {
            bail!("{s:?}: not a routable unicast IPv6 address");
        }
    }
    Ok(addr)
}

impl ConfigFile {
    /// Reads and parses a TOML file; errors name the file, line and field.
    pub fn load(path: &Path) -> Result<ConfigFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        Self::parse(&text).map_err(|e| anyhow::anyhow!("config {}: {e}", path.display()))
    }

    /// Parses TOML text; the error says where.
    pub fn parse(text: &str) -> Result<ConfigFile, String> {
        toml::from_str(text).map_err(|e| {
            let msg = e.message().replace('\n', " ");
            match e.span() {
                Some(span) => {
                    let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                    format!("line {line}: {msg}")
                }
                None => msg,
            }
        })
    }

    /// Checks everything and builds the runtime configuration. `file` is
    /// used to point errors at the right place.
    pub fn validate(self) -> Result<Config> {
        let interface = self
            .interface
            .context("interface: missing (set `interface` or pass --iface)")?;
        if interface.is_empty() || interface.len() > 15 || interface.contains('/') {
            bail!("interface: {interface:?} is not a valid interface name");
        }
        let flow_table_size = self
            .flow_table_size
            .unwrap_or(huddle_common::DEFAULT_FLOW_TABLE_SIZE);
        if !(MIN_FLOW_TABLE..=MAX_FLOW_TABLE).contains(&flow_table_size) {
            bail!(
                "flow_table_size: {flow_table_size} is outside {MIN_FLOW_TABLE}..={MAX_FLOW_TABLE}"
            );
        }
        let half_open_table_size = self
            .half_open_table_size
            .unwrap_or(huddle_common::DEFAULT_HALF_OPEN_SIZE);
        if !(MIN_FLOW_TABLE..=MAX_FLOW_TABLE).contains(&half_open_table_size) {
            bail!(
                "half_open_table_size: {half_open_table_size} is outside {MIN_FLOW_TABLE}..={MAX_FLOW_TABLE}"
            );
        }
        // Slots are found by masking a hash: a power of two.
        let half_open_table_size = half_open_table_size.next_power_of_two();
        let maglev_table_size = self
            .maglev_table_size
            .unwrap_or(huddle_common::DEFAULT_MAGLEV_SIZE);
        if !(MIN_MAGLEV..=MAX_MAGLEV).contains(&maglev_table_size)
            || !huddle_common::is_prime(maglev_table_size)
        {
            bail!(
                "maglev_table_size: {maglev_table_size} must be a prime in {MIN_MAGLEV}..={MAX_MAGLEV} (e.g. 65537), and at least 100 times a service's backends for an even spread"
            );
        }
        let nat_ports = self.nat_ports.unwrap_or(DEFAULT_NAT_PORTS);
        if nat_ports.max - nat_ports.min < 255 {
            bail!("nat_ports: {nat_ports} leaves fewer than 256 ports per backend");
        }
        let snat_ips: Vec<Ipv4Addr> = match (self.snat_ip, &self.snat_ips) {
            (Some(_), Some(_)) => bail!("snat_ip and snat_ips: give one of them"),
            (Some(ip), None) => vec![ip],
            (None, Some(list)) if list.is_empty() => {
                bail!("snat_ips: empty (leave it out to use the interface's address)")
            }
            (None, Some(list)) => list.clone(),
            (None, None) => Vec::new(),
        };
        let field = if self.snat_ips.is_some() {
            "snat_ips"
        } else {
            "snat_ip"
        };
        if snat_ips.len() > huddle_common::MAX_SNAT {
            bail!(
                "snat_ips: {} addresses, at most {} are supported",
                snat_ips.len(),
                huddle_common::MAX_SNAT
            );
        }
        for (i, ip) in snat_ips.iter().enumerate() {
            if ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() {
                bail!("{field}: {ip} is not a unicast address");
            }
            if snat_ips[..i].contains(ip) {
                bail!("{field}: {ip} is listed twice");
            }
        }
        if self.services.is_empty() {
            bail!("service: no service configured (add a [[service]] or pass --vip and --backend)");
        }
        if self.services.len() > MAX_SERVICES as usize {
            bail!(
                "service: {} services, at most {MAX_SERVICES} are supported",
                self.services.len()
            );
        }
        let huddle = validate_huddle(&self.huddle)?;
        let default_capacity = self.huddle.capacity.unwrap_or(DEFAULT_CAPACITY);
        if default_capacity == 0 {
            bail!("huddle.capacity: must be at least 1");
        }
        let mut services = Vec::new();
        let mut seen = HashSet::new();
        let mut total_backends = 0usize;
        for (i, s) in self.services.into_iter().enumerate() {
            let field = format!("service[{i}]");
            let (vip, suffix) = parse_vip(&s.vip).with_context(|| format!("{field}.vip"))?;
            let proto = s.proto.or(suffix).unwrap_or(Proto::Tcp);
            let mode = s.mode.unwrap_or_default();
            if !seen.insert((vip, proto)) {
                bail!("{field}.vip: {vip}/{proto} is configured twice");
            }
            if s.backends.is_empty() {
                bail!("{field}.backends: VIP {vip}/{proto} has no backend");
            }
            if s.backends.len() > RING_CAPACITY {
                bail!(
                    "{field}.backends: {} backends, at most {RING_CAPACITY} per service",
                    s.backends.len()
                );
            }
            let mut backends = Vec::new();
            let mut options = Vec::new();
            for (j, b) in s.backends.iter().enumerate() {
                let bfield = format!("{field}.backends[{j}]");
                let (raw, opts) = match b {
                    BackendEntry::Addr(a) => (
                        a,
                        backend_options(None, None, None, default_capacity, &bfield)?,
                    ),
                    BackendEntry::Table(t) => (
                        &t.addr,
                        backend_options(
                            t.weight,
                            t.metrics.clone(),
                            t.capacity,
                            default_capacity,
                            &bfield,
                        )?,
                    ),
                };
                options.push(opts);
                let addr = parse_endpoint(raw).with_context(|| bfield.clone())?;
                if backends.contains(&addr) {
                    bail!("{field}.backends[{j}]: backend {addr} is listed twice");
                }
                if addr.ip() == vip.ip() {
                    bail!("{field}.backends[{j}]: backend {addr} has the VIP's address");
                }
                if snat_ips.iter().any(|s| IpAddr::V4(*s) == addr.ip()) {
                    bail!("{field}.backends[{j}]: backend {addr} has a SNAT address");
                }
                // One family per service: the packet keeps its family
                // in every mode built so far.
                if addr.is_ipv4() != vip.is_ipv4() {
                    bail!(
                        "{field}.backends[{j}]: backend {addr} is {} but the VIP {vip} is {}; a service's backends have its VIP's family (give each family a service of its own)",
                        if addr.is_ipv4() { "IPv4" } else { "IPv6" },
                        if vip.is_ipv4() { "IPv4" } else { "IPv6" }
                    );
                }
                // The packet arrives as the client sent it: nothing can
                // change its port on the way.
                if mode.is_dsr() && addr.port() != vip.port() {
                    bail!(
                        "{field}.backends[{j}]: backend {addr} listens on another port than the VIP {vip}; {mode} delivers the client's packet unchanged, so the backend must listen on port {}",
                        vip.port()
                    );
                }
                backends.push(addr);
            }
            total_backends += backends.len();
            let udp_idle = match (s.udp_idle_ms, proto) {
                (None, _) => DEFAULT_UDP_IDLE,
                (Some(_), Proto::Tcp) => {
                    bail!("{field}.udp_idle_ms: only UDP services have an idle timeout")
                }
                (Some(ms), Proto::Udp) => millis(
                    Some(ms),
                    0,
                    &format!("{field}.udp_idle_ms"),
                    1000,
                    86_400_000,
                )?,
            };
            if let (Some(p), true) = (self.encap_prefix, mode.is_dsr()) {
                if let IpAddr::V4(v4) = vip.ip() {
                    if p.contains(v4) {
                        bail!("encap_prefix: {p} holds the VIP {vip} of {field}; outer source addresses must not be service addresses");
                    }
                }
            }
            services.push(Service {
                vip,
                proto,
                backends,
                options,
                udp_idle,
                mode,
                selection: s.selection.unwrap_or_default(),
            });
        }
        if total_backends > MAX_BACKENDS as usize {
            bail!(
                "service: {total_backends} backends in all, at most {MAX_BACKENDS} are supported"
            );
        }
        let control_socket = self
            .control_socket
            .unwrap_or_else(|| default_control_socket(&interface));
        let state_file = self
            .state_file
            .unwrap_or_else(|| control_socket.with_extension("state"));
        if let Some(p) = &self.pin_dir {
            if !p.is_absolute() {
                bail!(
                    "pin_dir: {} must be an absolute path on a bpffs",
                    p.display()
                );
            }
        }
        if let Some(p) = self.encap_prefix {
            if !services.iter().any(|s| s.mode == Mode::DsrIpip) {
                bail!("encap_prefix: {p} is set but no service has mode = \"dsr-ipip\"");
            }
            for s in &services {
                if let IpAddr::V4(v4) = s.vip.ip() {
                    if p.contains(v4) {
                        bail!("encap_prefix: {p} holds the VIP {}; outer source addresses must not be service addresses", s.vip);
                    }
                }
            }
        }
        let snat_ips6 = self.snat_ips6.clone().unwrap_or_default();
        if self.snat_ips6.as_ref().is_some_and(Vec::is_empty) {
            bail!("snat_ips6: empty (leave it out to use the interface's address)");
        }
        for (i, ip) in snat_ips6.iter().enumerate() {
            if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() {
                bail!("snat_ips6: {ip} is not a unicast address");
            }
            if snat_ips6[..i].contains(ip) {
                bail!("snat_ips6: {ip} is listed twice");
            }
        }
        if snat_ips.len() + snat_ips6.len() > huddle_common::MAX_SNAT {
            bail!(
                "snat_ips and snat_ips6: {} addresses, at most {} in all",
                snat_ips.len() + snat_ips6.len(),
                huddle_common::MAX_SNAT
            );
        }
        let bgp = match &self.bgp {
            None => None,
            Some(b) => {
                match b.daemon.as_deref() {
                    None | Some("bird") => {}
                    Some(other) => {
                        bail!("bgp.daemon: {other:?} is not driven (yet); \"bird\" (bird2) is")
                    }
                }
                let bgp = Bgp {
                    control_socket: b
                        .control_socket
                        .clone()
                        .unwrap_or_else(|| PathBuf::from("/run/bird/bird.ctl")),
                    routes_file: b.routes_file.clone().unwrap_or_else(|| {
                        PathBuf::from(format!("/run/huddle/{interface}.bird.conf"))
                    }),
                };
                for (field, p) in [
                    ("bgp.routes_file", &bgp.routes_file),
                    ("bgp.control_socket", &bgp.control_socket),
                ] {
                    if !p.is_absolute() {
                        bail!("{field}: {} must be an absolute path", p.display());
                    }
                }
                Some(bgp)
            }
        };
        let cluster = match &self.cluster {
            None => None,
            Some(c) => {
                let me = huddle
                    .metrics_listen
                    .and_then(|m| c.members.iter().position(|a| *a == m))
                    .with_context(|| {
                        format!(
                            "cluster.members: this balancer's huddle.metrics_listen ({}) must be one of them, as the others reach it",
                            huddle
                                .metrics_listen
                                .map_or("off".to_string(), |m| m.to_string())
                        )
                    })?;
                if c.members.len() < 2 {
                    bail!("cluster.members: a cluster of one balancer; leave [cluster] out");
                }
                for (i, m) in c.members.iter().enumerate() {
                    if c.members[..i].contains(m) {
                        bail!("cluster.members: {m} is listed twice");
                    }
                }
                Some(Cluster {
                    members: c.members.clone(),
                    me,
                })
            }
        };
        Ok(Config {
            bgp,
            cluster,
            interface,
            snat_ips,
            snat_ips6,
            encap_prefix: self.encap_prefix,
            xdp_mode: self.xdp_mode.unwrap_or_default(),
            nat_ports,
            flow_table_size,
            half_open_table_size,
            maglev_table_size,
            pin_dir: self.pin_dir,
            state_file,
            detach_on_exit: self.detach_on_exit.unwrap_or(false),
            control_socket,
            services,
            huddle,
        })
    }
}

fn backend_options(
    weight: Option<f64>,
    metrics: Option<String>,
    capacity: Option<u64>,
    default_capacity: u64,
    field: &str,
) -> Result<BackendOptions> {
    let weight = weight.unwrap_or(1.0);
    if !weight.is_finite() || weight <= 0.0 || weight > 100.0 {
        bail!("{field}.weight: {weight} must be a number in (0, 100]");
    }
    if let Some(url) = &metrics {
        url::Url::parse(url).with_context(|| format!("{field}.metrics"))?;
    }
    let capacity = capacity.unwrap_or(default_capacity);
    if capacity == 0 {
        bail!("{field}.capacity: must be at least 1");
    }
    Ok(BackendOptions {
        weight,
        metrics,
        capacity,
    })
}

fn millis(v: Option<u64>, default: u64, field: &str, min: u64, max: u64) -> Result<Duration> {
    let v = v.unwrap_or(default);
    if !(min..=max).contains(&v) {
        bail!("{field}: {v} is outside {min}..={max}");
    }
    Ok(Duration::from_millis(v))
}

fn fraction(v: Option<f64>, default: f64, field: &str, lo_open: bool) -> Result<f64> {
    let v = v.unwrap_or(default);
    let ok = v.is_finite() && v <= 1.0 && if lo_open { v > 0.0 } else { v >= 0.0 };
    if !ok {
        let lo = if lo_open { "(0" } else { "[0" };
        bail!("{field}: {v} must be in {lo}, 1]");
    }
    Ok(v)
}

fn validate_huddle(h: &HuddleFile) -> Result<Huddle> {
    let rd = RotationParams::default();
    let td = ThermalParams::default();
    let tick = millis(h.tick_ms, 100, "huddle.tick_ms", 10, 60_000)?;
    let hung_after = millis(h.hung_after_ms, 200, "huddle.hung_after_ms", 10, 600_000)?;
    let hung_after_min = millis(
        h.hung_after_min_ms,
        50.min(hung_after.as_millis() as u64),
        "huddle.hung_after_min_ms",
        10,
        600_000,
    )?;
    if hung_after_min > hung_after {
        bail!(
            "huddle.hung_after_min_ms: {} is above huddle.hung_after_ms ({})",
            hung_after_min.as_millis(),
            hung_after.as_millis()
        );
    }
    let heat = fraction(h.heat, rd.heat, "huddle.heat", true)?;
    let cool = fraction(h.cool, rd.cool, "huddle.cool", false)?;
    if cool >= heat {
        bail!("huddle.cool: {cool} must be below huddle.heat ({heat}), or backends would flap");
    }
    let min_inner = h.min_inner.unwrap_or(rd.min_inner);
    if min_inner == 0 {
        bail!("huddle.min_inner: must be at least 1 (the inner ring is never empty)");
    }
    let min_rest = millis(h.min_rest_ms, 10_000, "huddle.min_rest_ms", 0, 86_400_000)?;
    let max_rest = millis(h.max_rest_ms, 160_000, "huddle.max_rest_ms", 0, 86_400_000)?;
    if max_rest < min_rest {
        bail!("huddle.max_rest_ms: below huddle.min_rest_ms");
    }
    let weights = h.weights.unwrap_or_default();
    for (name, w) in [
        ("latency", weights.latency),
        ("cpu", weights.cpu),
        ("memory", weights.memory),
        ("load", weights.load),
    ] {
        if !w.is_finite() || !(0.0..=10.0).contains(&w) {
            bail!("huddle.weights.{name}: {w} must be in [0, 10]");
        }
    }
    let ratio = h.full_anomaly_ratio.unwrap_or(td.full_anomaly_ratio);
    if !ratio.is_finite() || ratio <= 1.0 || ratio > 1000.0 {
        bail!("huddle.full_anomaly_ratio: {ratio} must be above 1");
    }
    if let Some(c) = h.latency_ceiling_ms {
        if !c.is_finite() || c <= 0.0 {
            bail!("huddle.latency_ceiling_ms: {c} must be a positive number");
        }
    }
    let metrics_listen =
        match h
            .metrics_listen
            .as_deref()
            .unwrap_or(DEFAULT_METRICS_LISTEN)
        {
            "off" | "" => None,
            a => Some(a.parse::<SocketAddr>().with_context(|| {
                format!("huddle.metrics_listen: {a:?} is not IP:PORT or \"off\"")
            })?),
        };
    let floor_ms = h.latency_floor_ms.unwrap_or(td.floor_ms);
    if !floor_ms.is_finite() || floor_ms < 0.0 {
        bail!("huddle.latency_floor_ms: {floor_ms} must be a number >= 0");
    }
    let pf = h.probe.clone().unwrap_or_default();
    let path = pf.path.unwrap_or_else(|| "/".into());
    if !path.starts_with('/') || path.contains(char::is_whitespace) {
        bail!("huddle.probe.path: {path:?} must start with / and hold no spaces");
    }
    let probe = Probe {
        kind: pf.kind.unwrap_or_default(),
        path,
        interval: millis(pf.interval_ms, 250, "huddle.probe.interval_ms", 10, 600_000)?,
        timeout: millis(pf.timeout_ms, 1000, "huddle.probe.timeout_ms", 10, 60_000)?,
        fall: pf.fall.unwrap_or(2).max(1),
        rise: pf.rise.unwrap_or(2).max(1),
    };
    Ok(Huddle {
        rotation: h.rotation.unwrap_or(true),
        tick,
        thermal: ThermalParams {
            weights,
            alpha: fraction(h.alpha, td.alpha, "huddle.alpha", true)?,
            full_anomaly_ratio: ratio,
            ceiling_ms: h.latency_ceiling_ms,
            floor_ms,
        },
        rotation_params: RotationParams {
            heat,
            cool,
            min_inner,
            cooldown: millis(h.cooldown_ms, 5000, "huddle.cooldown_ms", 0, 86_400_000)?,
            min_rest,
            max_rest,
            warmup: millis(h.warmup_ms, 0, "huddle.warmup_ms", 0, 86_400_000)?,
        },
        hung_after,
        hung_after_min,
        hung_after_p99: match h.hung_after_p99 {
            None => 5.0,
            Some(k) if k.is_finite() && (1.0..=1000.0).contains(&k) => k,
            Some(k) => bail!("huddle.hung_after_p99: {k} is outside 1..=1000"),
        },
        pass_over_owing: h.pass_over_owing.unwrap_or(true),
        syn_timeout: millis(h.syn_timeout_ms, 300, "huddle.syn_timeout_ms", 10, 600_000)?,
        error_threshold: fraction(h.error_threshold, 0.5, "huddle.error_threshold", true)?,
        min_samples: h.min_samples.unwrap_or(3).max(1),
        move_flows_off_dead: h.move_flows_off_dead.unwrap_or(false),
        metrics_listen,
        metrics_interval: millis(
            h.metrics_interval_ms,
            1000,
            "huddle.metrics_interval_ms",
            50,
            600_000,
        )?,
        metrics_timeout: millis(
            h.metrics_timeout_ms,
            500,
            "huddle.metrics_timeout_ms",
            10,
            60_000,
        )?,
        probe,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> Result<Config> {
        ConfigFile::parse(text)
            .map_err(anyhow::Error::msg)?
            .validate()
    }

    const GOOD: &str = r#"
interface = "eth0"
nat_ports = "20000-30000"

[[service]]
vip = "10.213.100.1:80/tcp"
backends = ["10.213.0.11:8080", { addr = "10.213.0.12:8080" }]

[[service]]
vip = "10.213.100.1:53"
proto = "udp"
backends = ["10.213.0.11:5353"]
"#;

    #[test]
    fn good_file_validates() {
        let c = file(GOOD).unwrap();
        assert_eq!(c.services.len(), 2);
        assert_eq!(c.services[0].backends.len(), 2);
        assert_eq!(c.services[1].proto, Proto::Udp);
        assert_eq!(
            c.nat_ports,
            PortRange {
                min: 20000,
                max: 30000
            }
        );
        assert_eq!(c.control_socket, PathBuf::from("/run/huddle/eth0.sock"));
    }

    #[test]
    fn syntax_error_names_the_line() {
        let err =
            ConfigFile::parse("interface = \"eth0\"\n\n[[service]]\nvip = 10.0.0.1\n").unwrap_err();
        assert!(err.starts_with("line 4:"), "{err}");
    }

    #[test]
    fn unknown_field_is_refused_with_its_line() {
        let err = ConfigFile::parse("interface = \"eth0\"\nflowtable = 3\n").unwrap_err();
        assert!(
            err.starts_with("line 2:") && err.contains("flowtable"),
            "{err}"
        );
    }

    fn err_of(text: &str) -> String {
        format!("{:#}", file(text).unwrap_err())
    }

    #[test]
    fn bad_configs_name_the_field() {
        let base = "interface = \"eth0\"\n";
        let cases = [
            ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = []\n", "service[0].backends: VIP 10.0.0.1:80/tcp has no backend"),
            ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\", \"10.0.0.2:80\"]\n", "listed twice"),
            ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2\"]\n", "service[0].backends[0]"),
            ("[[service]]\nvip = \"10.0.0.1:0\"\nbackends = [\"10.0.0.2:80\"]\n", "service[0].vip"),
            ("[[service]]\nvip = \"10.0.0.1:80/sctp\"\nbackends = [\"10.0.0.2:80\"]\n", "unknown protocol"),
            ("[[service]]\nvip = \"[fd00::1]:80\"\nbackends = [\"10.0.0.2:80\"]\n", "is IPv4 but the VIP"),
            ("[[service]]\nvip = \"[::1]:80\"\nbackends = [\"[fd00::2]:80\"]\n", "routable"),
            ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n[[service]]\nvip = \"10.0.0.1:80/tcp\"\nbackends = [\"10.0.0.3:80\"]\n", "service[1].vip: 10.0.0.1:80/tcp is configured twice"),
            ("flow_table_size = 10\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "flow_table_size"),
            ("maglev_table_size = 65536\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "maglev_table_size: 65536 must be a prime"),
            ("[[service]]\nvip = \"10.0.0.1:80\"\nselection = \"hash\"\nbackends = [\"10.0.0.2:80\"]\n", "unknown variant `hash`"),
            ("[cluster]\nmembers = [\"10.0.0.5:9477\", \"10.0.0.6:9477\"]\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "cluster.members: this balancer's huddle.metrics_listen (127.0.0.1:9477) must be one of them"),
            ("[bgp]\ndaemon = \"gobgp\"\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "bgp.daemon: \"gobgp\" is not driven"),
            ("", "no service configured"),
            ("[huddle]\ncool = 0.6\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "huddle.cool: 0.6 must be below huddle.heat"),
            ("[huddle]\ntick_ms = 0\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "huddle.tick_ms"),
            ("[huddle]\nmin_inner = 0\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "huddle.min_inner"),
            ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [{ addr = \"10.0.0.2:80\", weight = -1.0 }]\n", "service[0].backends[0].weight"),
            ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [{ addr = \"10.0.0.2:80\", metrics = \"ftp://x\" }]\n", "service[0].backends[0].metrics"),
        ];
        for (body, want) in cases {
            let got = err_of(&format!("{base}{body}"));
            assert!(
                got.contains(want),
                "for {body:?}: got {got:?}, want {want:?}"
            );
        }
        assert!(
            err_of("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n")
                .contains("interface: missing")
        );
    }

    #[test]
    fn nat_port_range_parses_and_refuses_nonsense() {
        assert_eq!(
            "1024-2047".parse::<PortRange>().unwrap(),
            PortRange {
                min: 1024,
                max: 2047
            }
        );
        assert!("2047-1024".parse::<PortRange>().is_err());
        assert!("0-10".parse::<PortRange>().is_err());
        assert!("x".parse::<PortRange>().is_err());
        let err = ConfigFile::parse("nat_ports = \"9-1\"\n").unwrap_err();
        assert!(err.starts_with("line 1:"), "{err}");
    }
}
