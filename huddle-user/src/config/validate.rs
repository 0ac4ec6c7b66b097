//! From the file (and the flags merged into it) to the validated config:
//! every error names its field (and `locate` its line in the file).

use super::{
    checks::millis,
    file::*,
    model::*,
    settings::{renamed, validate_huddle},
    url,
    values::*,
};
use anyhow::{bail, Context, Result};
use huddle_common::{MAX_BACKENDS, MAX_SERVICES, RING_CAPACITY};
use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
};

impl ConfigFile {
    /// Checks everything and builds the runtime configuration. Every
    /// error names its field and, when the file set it, the file's line.
    pub fn validate(mut self) -> Result<Config> {
        let origin = self.origin.take();
        match self.checked() {
            Ok(cfg) => Ok(Config { origin, ..cfg }),
            Err(e) => match origin.and_then(|o| o.line(&e)) {
                Some(line) => Err(e.context(format!("line {line}"))),
                None => Err(e),
            },
        }
    }

    /// `validate`, with errors naming the field alone.
    fn checked(mut self) -> Result<Config> {
        let renamed = renamed(&mut self.huddle)?;
        let interface = self
            .interface
            .clone()
            .context("interface: missing (set `interface` or pass --iface)")?;
        if interface.is_empty() || interface.len() > 15 || interface.contains('/') {
            bail!("interface: {interface:?} is not a valid interface name");
        }
        let (flow_table_size, half_open_table_size, maglev_table_size) = table_sizes(&self)?;
        let nat_ports = self.nat_ports.unwrap_or(DEFAULT_NAT_PORTS);
        if nat_ports.max - nat_ports.min < 255 {
            bail!("nat_ports: {nat_ports} leaves fewer than 256 ports per backend");
        }
        let snat_ips = snat_v4(&self)?;
        let huddle = validate_huddle(&self.huddle)?;
        let default_capacity = self.huddle.capacity.unwrap_or(DEFAULT_CAPACITY);
        if default_capacity == 0 {
            bail!("huddle.capacity: must be at least 1");
        }
        let services = services(
            std::mem::take(&mut self.services),
            &snat_ips,
            self.encap_prefix,
            default_capacity,
            &huddle.probe,
        )?;
        let limits = limits(&self, &services)?;
        let mut huddle = huddle;
        if self.huddle.metrics_per_backend.is_none() {
            huddle.metrics_per_backend = BackendMetrics::for_backends(counts(&services).1);
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
            encap_prefix(p, &services)?;
        }
        let snat_ips6 = snat_v6(self.snat_ips6.as_deref(), snat_ips.len())?;
        Ok(Config {
            renamed,
            origin: None,
            bgp: bgp(self.bgp.as_ref(), &interface)?,
            cluster: cluster(self.cluster.as_ref(), huddle.listen)?,
            interface,
            snat_ips,
            snat_ips6,
            encap_prefix: self.encap_prefix,
            xdp_mode: self.xdp_mode.unwrap_or_default(),
            nat_ports,
            flow_table_size,
            half_open_table_size,
            maglev_table_size,
            limits,
            maglev_key: self
                .maglev_key_file
                .as_deref()
                .map(|p| super::key::ClusterKey::load(p, "maglev_key_file"))
                .transpose()?,
            pin_dir: self.pin_dir,
            state_file,
            detach_on_exit: self.detach_on_exit.unwrap_or(false),
            control_socket,
            services,
            huddle,
        })
    }
}

/// The flow, half-open (rounded up to a power of two: slots are found by
/// masking a hash) and Maglev table sizes.
fn table_sizes(f: &ConfigFile) -> Result<(u32, u32, u32)> {
    let flow_table_size = f
        .flow_table_size
        .unwrap_or(huddle_common::DEFAULT_FLOW_TABLE_SIZE);
    if !(MIN_FLOW_TABLE..=MAX_FLOW_TABLE).contains(&flow_table_size) {
        bail!("flow_table_size: {flow_table_size} is outside {MIN_FLOW_TABLE}..={MAX_FLOW_TABLE}");
    }
    let half_open_table_size = f
        .half_open_table_size
        .unwrap_or(huddle_common::DEFAULT_HALF_OPEN_SIZE);
    if !(MIN_FLOW_TABLE..=MAX_FLOW_TABLE).contains(&half_open_table_size) {
        bail!(
            "half_open_table_size: {half_open_table_size} is outside {MIN_FLOW_TABLE}..={MAX_FLOW_TABLE}"
        );
    }
    // Slots are found by masking a hash: a power of two.
    let half_open_table_size = half_open_table_size.next_power_of_two();
    let maglev_table_size = f
        .maglev_table_size
        .unwrap_or(huddle_common::DEFAULT_MAGLEV_SIZE);
    if !(MIN_MAGLEV..=MAX_MAGLEV).contains(&maglev_table_size)
        || !huddle_common::is_prime(maglev_table_size)
    {
        bail!(
            "maglev_table_size: {maglev_table_size} must be a prime in {MIN_MAGLEV}..={MAX_MAGLEV} (e.g. 65537), and at least 100 times a service's backends for an even spread"
        );
    }
    Ok((flow_table_size, half_open_table_size, maglev_table_size))
}

/// `max_services`, `max_backends` and `max_maglev_services`: within the
/// kernel's bounds and holding what `services` configure.
fn limits(f: &ConfigFile, services: &[Service]) -> Result<Limits> {
    let check = |name: &str, v: Option<u32>, max: u32, have: usize| -> Result<Option<u32>> {
        match v {
            Some(n) if n == 0 || n > max => bail!("{name}: {n} is outside 1..={max}"),
            Some(n) if (n as usize) < have => {
                bail!("{name}: {n} is fewer than the {have} configured")
            }
            v => Ok(v),
        }
    };
    let (n, backends, maglev) = counts(services);
    let services_max = check("max_services", f.max_services, MAX_SERVICES, n)?;
    Ok(Limits {
        services: services_max,
        backends: check("max_backends", f.max_backends, MAX_BACKENDS, backends)?,
        maglev_services: check(
            "max_maglev_services",
            f.max_maglev_services,
            services_max.unwrap_or(MAX_SERVICES),
            maglev,
        )?,
    })
}

/// The IPv4 SNAT addresses (`snat_ip` or `snat_ips`; empty: the
/// interface's).
fn snat_v4(f: &ConfigFile) -> Result<Vec<Ipv4Addr>> {
    let snat_ips: Vec<Ipv4Addr> = match (f.snat_ip, &f.snat_ips) {
        (Some(_), Some(_)) => bail!("snat_ip and snat_ips: give one of them"),
        (Some(ip), None) => vec![ip],
        (None, Some(list)) if list.is_empty() => {
            bail!("snat_ips: empty (leave it out to use the interface's address)")
        }
        (None, Some(list)) => list.clone(),
        (None, None) => Vec::new(),
    };
    let field = if f.snat_ips.is_some() {
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
    Ok(snat_ips)
}

/// The IPv6 SNAT addresses, `v4` IPv4 ones beside them.
fn snat_v6(list: Option<&[Ipv6Addr]>, v4: usize) -> Result<Vec<Ipv6Addr>> {
    let snat_ips6 = list.map(<[Ipv6Addr]>::to_vec).unwrap_or_default();
    if list.is_some_and(<[Ipv6Addr]>::is_empty) {
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
    if v4 + snat_ips6.len() > huddle_common::MAX_SNAT {
        bail!(
            "snat_ips and snat_ips6: {} addresses, at most {} in all",
            v4 + snat_ips6.len(),
            huddle_common::MAX_SNAT
        );
    }
    Ok(snat_ips6)
}

/// Every `[[service]]`, checked alone and against the others and the
/// limits.
fn services(
    list: Vec<ServiceFile>,
    snat_ips: &[Ipv4Addr],
    encap: Option<Prefix>,
    default_capacity: u64,
    probe: &Probe,
) -> Result<Vec<Service>> {
    if list.is_empty() {
        bail!("service: no service configured (add a [[service]] or pass --vip and --backend)");
    }
    if list.len() > MAX_SERVICES as usize {
        bail!(
            "service: {} services, at most {MAX_SERVICES} are supported",
            list.len()
        );
    }
    let mut services: Vec<Service> = Vec::new();
    let mut seen = HashSet::new();
    let mut probes: Vec<std::sync::Arc<Probe>> = Vec::new();
    for (i, s) in list.into_iter().enumerate() {
        let mut svc = service(i, s, snat_ips, encap, default_capacity, probe)?;
        // One probe shared by the services that send the same (a few
        // kinds among thousands of services).
        match probes.iter().find(|p| **p == svc.probe) {
            Some(same) => svc.probe = same.clone(),
            None => probes.push(svc.probe.clone()),
        }
        if !seen.insert((svc.vip, svc.proto)) {
            bail!(
                "service[{i}].vip: {}/{} is configured twice",
                svc.vip,
                svc.proto
            );
        }
        services.push(svc);
    }
    let total_backends = counts(&services).1;
    if total_backends > MAX_BACKENDS as usize {
        bail!("service: {total_backends} backends in all, at most {MAX_BACKENDS} are supported");
    }
    Ok(services)
}

/// `[[service]]` number `i`.
fn service(
    i: usize,
    s: ServiceFile,
    snat_ips: &[Ipv4Addr],
    encap: Option<Prefix>,
    default_capacity: u64,
    global: &Probe,
) -> Result<Service> {
    let field = format!("service[{i}]");
    let (vip, suffix) = parse_vip(&s.vip).with_context(|| format!("{field}.vip"))?;
    let proto = s.proto.or(suffix).unwrap_or(Proto::Tcp);
    let mode = s.mode.unwrap_or_default();
    if s.backends.is_empty() {
        bail!("{field}.backends: VIP {vip}/{proto} has no backend");
    }
    if s.backends.len() > RING_CAPACITY {
        bail!(
            "{field}.backends: {} backends, at most {RING_CAPACITY} per service",
            s.backends.len()
        );
    }
    let (backends, options) = backends(&field, &s.backends, vip, mode, snat_ips, default_capacity)?;
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
    if let (Some(p), true) = (encap, mode.is_dsr()) {
        if let IpAddr::V4(v4) = vip.ip() {
            if p.contains(v4) {
                bail!("encap_prefix: {p} holds the VIP {vip} of {field}; outer source addresses must not be service addresses");
            }
        }
    }
    Ok(Service {
        vip,
        proto,
        backends,
        options,
        udp_idle,
        mode,
        selection: s.selection.unwrap_or_default(),
        latency: s.latency.unwrap_or_default(),
        probe: std::sync::Arc::new(super::probe::service(i, s.probe.as_ref(), proto, global)?),
    })
}

impl Service {
    /// A service built in code (a benchmark's, a test's) whose backends
    /// all have default options.
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
            latency: LatencyMode::Auto,
            probe: std::sync::Arc::new(super::probe::default_for(proto)),
        }
    }
}

/// A service's backends, each with its options.
fn backends(
    field: &str,
    list: &[BackendEntry],
    vip: SocketAddr,
    mode: Mode,
    snat_ips: &[Ipv4Addr],
    default_capacity: u64,
) -> Result<(Vec<SocketAddr>, Vec<BackendOptions>)> {
    let mut backends = Vec::new();
    let mut options = Vec::new();
    for (j, b) in list.iter().enumerate() {
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
    Ok((backends, options))
}

/// An `encap_prefix` is for `dsr-ipip` services and holds no VIP.
fn encap_prefix(p: Prefix, services: &[Service]) -> Result<()> {
    if !services.iter().any(|s| s.mode == Mode::DsrIpip) {
        bail!("encap_prefix: {p} is set but no service has mode = \"dsr-ipip\"");
    }
    for s in services {
        if let IpAddr::V4(v4) = s.vip.ip() {
            if p.contains(v4) {
                bail!("encap_prefix: {p} holds the VIP {}; outer source addresses must not be service addresses", s.vip);
            }
        }
    }
    Ok(())
}

/// `[bgp]`.
fn bgp(b: Option<&BgpFile>, interface: &str) -> Result<Option<Bgp>> {
    Ok(match b {
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
                routes_file: b
                    .routes_file
                    .clone()
                    .unwrap_or_else(|| PathBuf::from(format!("/run/huddle/{interface}.bird.conf"))),
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
    })
}

/// `[cluster]`: this balancer, by its `huddle.listen`, among the members.
fn cluster(c: Option<&ClusterFile>, listen: Option<SocketAddr>) -> Result<Option<Cluster>> {
    Ok(match c {
        None => None,
        Some(c) => {
            let me = listen
                .and_then(|m| c.members.iter().position(|a| *a == m))
                .with_context(|| {
                    format!(
                        "cluster.members: this balancer's huddle.listen ({}) must be one of them, as the others reach it",
                        listen.map_or("off".to_string(), |m| m.to_string())
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
            let key_file = c.key_file.as_ref().context(
                "cluster.key_file: required: the members sign what they ask and answer with it (make one with `huddle keygen /etc/huddle/cluster.key` and copy it to every member)",
            )?;
            Some(Cluster {
                members: c.members.clone(),
                me,
                key: super::key::ClusterKey::load(key_file, "cluster.key_file")?,
            })
        }
    })
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
