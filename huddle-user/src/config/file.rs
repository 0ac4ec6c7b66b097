//! The TOML file as written: every table and key, optional, unknown keys
//! refused with their line.

use super::{tuning::Weights, values::*};
use anyhow::{Context, Result};
use serde::Deserialize;
use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
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

/// What `/metrics` shows per backend (every page shows per service).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendMetrics {
    /// Gauges, kernel counters and both latency histograms (about 10 KB
    /// a backend). Unset: this up to 1,024 backends, `Gauges` up to 8,192,
    /// `None` past that (`for_backends`).
    #[default]
    All,
    /// The gauges of `huddle status` only (about 3 KB a backend).
    Gauges,
    /// Nothing per backend.
    None,
}

impl BackendMetrics {
    /// The default for `backends` configured: a page a Prometheus scrape
    /// takes (tens of MB at most). Measured: `All` was 491 MB, rendered
    /// in 10.5 s, at 65,536 backends.
    #[must_use]
    pub fn for_backends(backends: usize) -> BackendMetrics {
        match backends {
            0..=1024 => BackendMetrics::All,
            1025..=8192 => BackendMetrics::Gauges,
            _ => BackendMetrics::None,
        }
    }
}

/// How backends are probed: the `[huddle]` table's `probe` for every
/// TCP service, a service's own `probe` over it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    /// TCP connect.
    Tcp,
    /// HTTP GET of `path` (HTTP/1.1, or h2c with prior knowledge); a
    /// status in `status` (default 200-399) passes.
    #[default]
    Http,
    /// A TLS handshake, then that HTTP request over it.
    Tls,
    /// A datagram (`send`), passed by an answer holding `expect`.
    Udp,
    /// Not probed: the kernel's counters alone judge it.
    None,
}

/// The HTTP version a probe speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
pub enum HttpVersion {
    #[default]
    #[serde(rename = "1.1")]
    Http1,
    /// HTTP/2: h2c with prior knowledge, or over TLS by ALPN.
    #[serde(rename = "2")]
    Http2,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeFile {
    pub kind: Option<ProbeKind>,
    pub path: Option<String>,
    /// The Host header (and, for `tls`, the default SNI); default: the
    /// backend's address.
    pub host: Option<String>,
    /// Statuses that pass, each `"200"` or `"200-399"`.
    pub status: Option<Vec<String>>,
    /// `"1.1"` (default) or `"2"`.
    pub version: Option<HttpVersion>,
    /// `tls`: the server name sent; default `host`, if a DNS name.
    pub sni: Option<String>,
    /// `udp`: the datagram sent, and what the answer must hold.
    pub send: Option<String>,
    pub expect: Option<String>,
    pub interval_ms: Option<u64>,
    pub timeout_ms: Option<u64>,
    /// Failed probes in a row that make a backend unhealthy.
    pub fall: Option<u32>,
    /// Passed probes in a row that make it healthy again.
    pub rise: Option<u32>,
    /// How often a healthy backend carrying traffic is probed (its own
    /// traffic measures it); the others every `interval_ms`.
    pub active_interval_ms: Option<u64>,
    /// The most probes a second over all backends.
    pub max_per_second: Option<u32>,
    /// The most of them a second for idle backends (no traffic, nothing
    /// suspect), which a probe tells least about.
    pub idle_per_second: Option<u32>,
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
    pub weights: Option<Weights>,
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
    /// Of two ring entries, a new flow takes the one that has owed an
    /// answer for less time (off by default: on mixed traffic that is the
    /// traffic's doing, and it skews the shares).
    pub two_choices: Option<bool>,
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
    /// Where this balancer serves `/metrics` (and, in a cluster, its
    /// rings, readings and flows to the others), or "off".
    pub listen: Option<String>,
    /// How often, and within how long, each backend's `metrics` page is
    /// scraped.
    pub scrape_interval_ms: Option<u64>,
    pub scrape_timeout_ms: Option<u64>,
    /// The old names of `listen`, `scrape_interval_ms` and
    /// `scrape_timeout_ms`: still read, with a warning, until the next
    /// release.
    pub metrics_listen: Option<String>,
    pub metrics_interval_ms: Option<u64>,
    pub metrics_timeout_ms: Option<u64>,
    pub probe: Option<ProbeFile>,
    /// What `/metrics` shows per backend.
    pub metrics_per_backend: Option<BackendMetrics>,
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
    /// `"auto"` (default), `"ttfb"`, `"connect"` or `"off"`: which latency
    /// the backends are judged on.
    pub latency: Option<LatencyMode>,
    /// This service's probe, over `[huddle]`'s key by key (its timing
    /// and budget excepted: one round probes every service).
    pub probe: Option<ProbeFile>,
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
    /// A key (as `cluster.key_file`; `huddle keygen PATH`) that the secret
    /// seed of the Maglev flow hash is drawn from, for balancers behind one
    /// router that are not a `[cluster]` (whose key serves otherwise).
    pub maglev_key_file: Option<PathBuf>,
    /// Slots in the half-open table (TCP flows before the client's ACK),
    /// rounded up to a power of two.
    pub half_open_table_size: Option<u32>,
    /// Services the maps hold (default: 64, or twice those configured),
    /// at most 4,096: what a reload may grow to without a restart.
    pub max_services: Option<u32>,
    /// Backends over all services the maps hold (default: 1,024, or twice
    /// those configured), at most 65,536.
    pub max_backends: Option<u32>,
    /// Services with `selection = "maglev"` the Maglev tables hold
    /// (default: 2, or twice those configured).
    pub max_maglev_services: Option<u32>,
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
    /// The file's path and text, so an error can name its line; the
    /// command line notes there the fields its flags set.
    #[serde(skip)]
    pub origin: Option<super::locate::Origin>,
}

/// `[cluster]`: the balancers that share the VIPs.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    /// Every balancer's `huddle.listen` (this one's included), in
    /// the same order on each: the first that answers decides the rings
    /// and the others take them.
    pub members: Vec<SocketAddr>,
    /// The members' shared key (hex, 32 bytes or more, mode 0600; `huddle
    /// keygen PATH` makes one): every request and answer between them is
    /// signed with it.
    pub key_file: Option<PathBuf>,
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

impl ConfigFile {
    /// Reads and parses a TOML file; errors name the file, line and field.
    pub fn load(path: &Path) -> Result<ConfigFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        let mut file =
            Self::parse(&text).map_err(|e| anyhow::anyhow!("config {}: {e}", path.display()))?;
        file.origin = Some(super::locate::Origin {
            path: path.to_path_buf(),
            text: text.into(),
            from_flags: Vec::new(),
        });
        Ok(file)
    }

    /// Parses TOML text; the error says where.
    pub fn parse(text: &str) -> Result<ConfigFile, String> {
        toml::from_str(text).map_err(|e| {
            let msg = e.message().replace('\n', " ");
            match e.span() {
                Some(span) => format!("line {}: {msg}", super::locate::line_at(text, span.start)),
                None => msg,
            }
        })
    }
}
