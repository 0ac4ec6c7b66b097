//! The config's value types (protocol, mode, selection, prefix, port range,
//! XDP mode) and the parses of addresses, each done once for the file and
//! the command line.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
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

/// Which latency a service's backends are judged on: where no rule can
/// tell a slow backend from a protocol that is slow by design, the
/// operator says.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum LatencyMode {
    /// The default: time to first byte, judged by its median, with the
    /// rules for long and unanswered turns (`docs/design/huddle.md`).
    #[default]
    Auto,
    /// Time to first byte (today the same as `auto`, and pinned so).
    Ttfb,
    /// Connect time (SYN to SYN-ACK) alone, for opaque streaming
    /// protocols whose turns say nothing: unanswered requests never make
    /// a backend hung or passed over (SYNs still do).
    Connect,
    /// No latency at all: CPU, memory, errors and load only; no request
    /// or answer is ever owed.
    Off,
}

impl LatencyMode {
    /// Whether request turns are timed and owed (hung, pass-over).
    #[must_use]
    pub fn turns(self) -> bool {
        matches!(self, LatencyMode::Auto | LatencyMode::Ttfb)
    }
}

impl fmt::Display for LatencyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LatencyMode::Auto => "auto",
            LatencyMode::Ttfb => "ttfb",
            LatencyMode::Connect => "connect",
            LatencyMode::Off => "off",
        })
    }
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

/// An IPv4 or IPv6 prefix, `"10.0.0.0/24"`, `"fd00::/64"`; a bare address
/// is the host alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpPrefix {
    pub addr: std::net::IpAddr,
    pub len: u8,
}

impl fmt::Display for IpPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl FromStr for IpPrefix {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let (a, l) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let addr: std::net::IpAddr = a
            .trim()
            .parse()
            .with_context(|| format!("{s:?} is not an IP prefix (ADDR/LEN)"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match l {
            None => max,
            Some(l) => l
                .trim()
                .parse()
                .ok()
                .filter(|l| *l <= max)
                .with_context(|| format!("{s:?}: prefix length must be 0..={max}"))?,
        };
        Ok(IpPrefix { addr, len })
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

    /// NAT tuples toward one backend with `snat_addrs` source addresses.
    #[must_use]
    pub fn tuples(&self, snat_addrs: usize) -> u64 {
        u64::from(self.max - self.min + 1) * snat_addrs.max(1) as u64
    }

    /// New connections a second toward one backend that these tuples
    /// carry before one is handed out again within a TIME_WAIT (60 s on
    /// Linux), which the backend may then still hold.
    #[must_use]
    pub fn sustainable_rate(&self, snat_addrs: usize) -> u64 {
        self.tuples(snat_addrs) / (huddle_common::TIME_WAIT_NS / 1_000_000_000)
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
