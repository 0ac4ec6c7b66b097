//! Balancer configuration: the TOML file form, the command-line form, and
//! the validation both go through. Every error names the field (and, for a
//! file, the line) so a bad config never gets as far as the kernel.

use anyhow::{bail, Context, Result};
use huddle_common::{MAX_BACKENDS, MAX_SERVICES, RING_CAPACITY};
use serde::Deserialize;
use std::{
    collections::HashSet,
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    str::FromStr,
};

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

/// How the program is attached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    /// Native (driver) mode, falling back to generic mode with a warning.
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
}

/// The whole file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Interface to attach to.
    pub interface: Option<String>,
    /// Source address toward backends; default: the interface's address.
    pub snat_ip: Option<Ipv4Addr>,
    pub xdp_mode: Option<XdpMode>,
    /// NAT source port range, `"low-high"`.
    pub nat_ports: Option<PortRange>,
    /// Entries in the flow table (and in the NAT table).
    pub flow_table_size: Option<u32>,
    /// Path of the control socket `huddle status` talks to.
    pub control_socket: Option<PathBuf>,
    #[serde(default, rename = "service")]
    pub services: Vec<ServiceFile>,
}

/// A validated service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    pub vip: SocketAddr,
    pub proto: Proto,
    pub backends: Vec<SocketAddr>,
}

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
    pub interface: String,
    pub snat_ip: Option<Ipv4Addr>,
    pub xdp_mode: XdpMode,
    pub nat_ports: PortRange,
    pub flow_table_size: u32,
    pub control_socket: PathBuf,
    pub services: Vec<Service>,
}

pub const MIN_FLOW_TABLE: u32 = 1024;
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

/// Parses `IP:PORT` of an IPv4 endpoint with a non-zero port.
pub fn parse_endpoint(s: &str) -> Result<SocketAddr> {
    let addr: SocketAddr = s
        .trim()
        .parse()
        .with_context(|| format!("{s:?} is not an IP:PORT address"))?;
    if !addr.is_ipv4() {
        bail!("{s:?}: IPv6 services are not supported yet");
    }
    if addr.port() == 0 {
        bail!("{s:?}: port 0 is not a service port");
    }
    let ip = addr.ip();
    if ip.is_unspecified() || ip.is_multicast() || ip == IpAddr::V4(Ipv4Addr::BROADCAST) {
        bail!("{s:?}: not a unicast address");
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
        let nat_ports = self.nat_ports.unwrap_or(DEFAULT_NAT_PORTS);
        if nat_ports.max - nat_ports.min < 255 {
            bail!("nat_ports: {nat_ports} leaves fewer than 256 ports per backend");
        }
        if let Some(ip) = self.snat_ip {
            if ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() {
                bail!("snat_ip: {ip} is not a unicast address");
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
        let mut services = Vec::new();
        let mut seen = HashSet::new();
        let mut total_backends = 0usize;
        for (i, s) in self.services.into_iter().enumerate() {
            let field = format!("service[{i}]");
            let (vip, suffix) = parse_vip(&s.vip).with_context(|| format!("{field}.vip"))?;
            let proto = s.proto.or(suffix).unwrap_or(Proto::Tcp);
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
            for (j, b) in s.backends.iter().enumerate() {
                let raw = match b {
                    BackendEntry::Addr(a) => a,
                    BackendEntry::Table(t) => &t.addr,
                };
                let addr = parse_endpoint(raw).with_context(|| format!("{field}.backends[{j}]"))?;
                if backends.contains(&addr) {
                    bail!("{field}.backends[{j}]: backend {addr} is listed twice");
                }
                if addr.ip() == vip.ip() {
                    bail!("{field}.backends[{j}]: backend {addr} has the VIP's address");
                }
                if Some(addr.ip()) == self.snat_ip.map(IpAddr::V4) {
                    bail!("{field}.backends[{j}]: backend {addr} has the SNAT address");
                }
                backends.push(addr);
            }
            total_backends += backends.len();
            services.push(Service {
                vip,
                proto,
                backends,
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
        Ok(Config {
            interface,
            snat_ip: self.snat_ip,
            xdp_mode: self.xdp_mode.unwrap_or_default(),
            nat_ports,
            flow_table_size,
            control_socket,
            services,
        })
    }
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
            ("[[service]]\nvip = \"[::1]:80\"\nbackends = [\"10.0.0.2:80\"]\n", "IPv6"),
            ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n[[service]]\nvip = \"10.0.0.1:80/tcp\"\nbackends = [\"10.0.0.3:80\"]\n", "service[1].vip: 10.0.0.1:80/tcp is configured twice"),
            ("flow_table_size = 10\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "flow_table_size"),
            ("", "no service configured"),
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
