//! The validated config the daemon runs on.

use super::{
    file::{HttpVersion, ProbeKind},
    tuning::{RotationParams, ThermalParams},
    values::*,
};
use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

/// Validated `[cluster]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    pub members: Vec<SocketAddr>,
    /// This balancer's place in `members`.
    pub me: usize,
    /// The key the members sign their requests and answers with.
    pub key: super::key::ClusterKey,
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
    pub latency: LatencyMode,
    /// How its backends are probed (`[huddle]`'s probe unless it set one).
    pub probe: Arc<Probe>,
}

/// What the huddle knows about a backend beyond its address.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendOptions {
    pub weight: f64,
    pub metrics: Option<String>,
    pub capacity: u64,
}

/// Validated probe settings: what is sent and what passes (a service may
/// set its own), and the round's timing and budget (`[huddle]`'s alone).
#[derive(Clone, Debug, PartialEq)]
pub struct Probe {
    pub kind: ProbeKind,
    pub path: String,
    /// The Host header (`None`: the backend's address).
    pub host: Option<String>,
    /// Statuses that pass, inclusive ranges.
    pub status: Vec<(u16, u16)>,
    pub version: HttpVersion,
    /// `tls`: the server name sent (`None`: none, as for an address).
    pub sni: Option<String>,
    /// `udp`: the datagram sent, and what the answer must hold.
    pub send: Vec<u8>,
    pub expect: Vec<u8>,
    pub interval: Duration,
    pub timeout: Duration,
    pub fall: u32,
    pub rise: u32,
    /// How often a healthy backend carrying traffic is probed.
    pub active_interval: Duration,
    /// The most probes a second over all backends.
    pub max_per_second: u32,
    /// The most a second for idle backends (within `max_per_second`).
    pub idle_per_second: u32,
}

impl Probe {
    /// Whether the application itself answers it (not the kernel's
    /// accept, as for a TCP connect): only such an answer can clear a
    /// suspicion that it hangs.
    #[must_use]
    pub fn asks_the_application(&self) -> bool {
        matches!(self.kind, ProbeKind::Http | ProbeKind::Tls | ProbeKind::Udp)
    }

    /// Whether HTTP status `s` passes.
    #[must_use]
    pub fn passes(&self, s: u16) -> bool {
        self.status.iter().any(|&(lo, hi)| (lo..=hi).contains(&s))
    }

    /// What it sends, for the log: `HTTP/2 GET /health (Host x)`.
    #[must_use]
    pub fn describe(&self) -> String {
        let http = |p: &Probe| {
            let v = match p.version {
                HttpVersion::Http1 => "HTTP/1.1",
                HttpVersion::Http2 => "HTTP/2",
            };
            let host = p
                .host
                .as_ref()
                .map(|h| format!(" (Host {h})"))
                .unwrap_or_default();
            format!("{v} GET {}{host}", p.path)
        };
        match self.kind {
            ProbeKind::Tcp => "TCP connect".into(),
            ProbeKind::Http => http(self),
            ProbeKind::Tls => format!(
                "TLS{} then {}",
                self.sni
                    .as_ref()
                    .map(|s| format!(" (SNI {s})"))
                    .unwrap_or_default(),
                http(self)
            ),
            ProbeKind::Udp => format!("UDP datagram of {} bytes", self.send.len()),
            ProbeKind::None => "none".into(),
        }
    }
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
    pub two_choices: bool,
    pub syn_timeout: Duration,
    pub error_threshold: f64,
    pub min_samples: u64,
    pub move_flows_off_dead: bool,
    /// Where this balancer serves its pages (`None`: off).
    pub listen: Option<SocketAddr>,
    /// Backends' metrics pages: how often, and within how long.
    pub scrape_interval: Duration,
    pub scrape_timeout: Duration,
    pub probe: Probe,
    /// What `/metrics` shows per backend.
    pub metrics_per_backend: super::file::BackendMetrics,
}

/// Default capacity of a backend, in active flows.
pub const DEFAULT_CAPACITY: u64 = 10_000;

/// Default address of the Prometheus endpoint.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9477";

impl Service {
    /// `10.0.0.1:80/tcp`.
    #[must_use]
    pub fn name(&self) -> String {
        format!("{}/{}", self.vip, self.proto)
    }
}

/// A validated configuration, ready for the data plane.
#[derive(Clone, Debug)]
pub struct Config {
    /// Keys the file set under an old name, said once at start.
    pub renamed: Vec<String>,
    /// The file it was read from, for the line in a later check's error.
    pub origin: Option<super::locate::Origin>,
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
    /// `max_services`, `max_backends`, `max_maglev_services` as set.
    pub limits: Limits,
    /// `maglev_key_file`'s key, if set.
    pub maglev_key: Option<super::key::ClusterKey>,
    pub control_socket: PathBuf,
    /// `None`: the default for the interface (see `crate::sys::pins::default_pin_dir`).
    pub pin_dir: Option<PathBuf>,
    pub state_file: PathBuf,
    pub detach_on_exit: bool,
    pub services: Vec<Service>,
    pub huddle: Huddle,
    pub bgp: Option<Bgp>,
    pub cluster: Option<Cluster>,
}

impl Config {
    /// `e`, a check's error about a field, with the file's path and line
    /// when the file set that field.
    #[must_use]
    pub fn placed(&self, e: anyhow::Error) -> anyhow::Error {
        match &self.origin {
            Some(o) => o.place(e),
            None => e,
        }
    }
}

/// The maps' sizes the file sets (`None`: sized at load from what is
/// configured, see `kernel::dataplane::limits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub services: Option<u32>,
    pub backends: Option<u32>,
    pub maglev_services: Option<u32>,
}

/// Services, backends over all of them, and services with
/// `selection = "maglev"` of `services`: what the maps must hold.
#[must_use]
pub fn counts(services: &[Service]) -> (usize, usize, usize) {
    let backends = services.iter().map(|s| s.backends.len()).sum();
    let maglev = services
        .iter()
        .filter(|s| s.selection == Selection::Maglev)
        .count();
    (services.len(), backends, maglev)
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
