//! The health probe validated: `[huddle]`'s (what every TCP service
//! sends, and the round's timing and budget), and a service's own over it
//! key by key, in the service's protocol.

use super::{
    checks::millis,
    file::{HttpVersion, HuddleFile, ProbeFile, ProbeKind},
    model::Probe,
    values::Proto,
};
use anyhow::{bail, Result};

/// Probes a second unless configured: up to 500 backends that need it
/// probed every 250 ms, or 2,000 carrying traffic every second.
const DEFAULT_PROBES_PER_SECOND: u32 = 2_000;

/// Idle backends' probes a second unless configured: 62 idle backends
/// are probed every 250 ms as before; 1,024 every 4 s, 65,536 every 4.4
/// minutes. A probe costs this daemon about 90 us of CPU on a veth
/// testbed (hc-scale at 4,096 x 16: 14% of a core idle with no probes,
/// 25% at 500 a second, 58% at 4,000), and an idle backend that died is
/// found by its first connections (the kernel's owed answers) anyway.
const DEFAULT_IDLE_PROBES_PER_SECOND: u32 = 250;

/// Statuses that pass unless `status` says: any answer but an error.
const DEFAULT_STATUS: (u16, u16) = (200, 399);

/// The `[huddle]` table's probe.
pub(super) fn global(h: &HuddleFile) -> Result<Probe> {
    let pf = h.probe.clone().unwrap_or_default();
    let field = "huddle.probe";
    let interval = millis(
        pf.interval_ms,
        250,
        &format!("{field}.interval_ms"),
        10,
        600_000,
    )?;
    let active_interval = millis(
        pf.active_interval_ms,
        (4 * interval.as_millis() as u64).min(600_000),
        &format!("{field}.active_interval_ms"),
        10,
        600_000,
    )?;
    if active_interval < interval {
        bail!(
            "{field}.active_interval_ms: {} ms is shorter than {field}.interval_ms ({} ms)",
            active_interval.as_millis(),
            interval.as_millis()
        );
    }
    let max_per_second = pf.max_per_second.unwrap_or(DEFAULT_PROBES_PER_SECOND);
    if !(1..=1_000_000).contains(&max_per_second) {
        bail!("{field}.max_per_second: {max_per_second} is outside 1..=1000000");
    }
    let idle_per_second = pf
        .idle_per_second
        .unwrap_or(DEFAULT_IDLE_PROBES_PER_SECOND.min(max_per_second));
    if !(1..=max_per_second).contains(&idle_per_second) {
        bail!("{field}.idle_per_second: {idle_per_second} is outside 1..={max_per_second} (max_per_second)");
    }
    if pf.kind == Some(ProbeKind::Udp) {
        bail!(
            "{field}.kind: \"udp\" probes UDP services only; set it in those services' own `probe`"
        );
    }
    let base = Probe {
        kind: ProbeKind::Http,
        path: "/".into(),
        host: None,
        status: vec![DEFAULT_STATUS],
        version: HttpVersion::Http1,
        sni: None,
        send: Vec::new(),
        expect: Vec::new(),
        interval,
        timeout: std::time::Duration::from_millis(1000),
        fall: 2,
        rise: 2,
        active_interval,
        max_per_second,
        idle_per_second,
    };
    over(base, &pf, field)
}

/// The probe of `[[service]]` number `i` (protocol `proto`): its own
/// `probe` keys over `global`'s. A UDP service is not probed unless it
/// asks (`[huddle]`'s probe speaks TCP).
pub(super) fn service(
    i: usize,
    own: Option<&ProbeFile>,
    proto: Proto,
    global: &Probe,
) -> Result<Probe> {
    let field = format!("service[{i}].probe");
    let mut base = global.clone();
    if proto == Proto::Udp {
        base.kind = if own.is_some() {
            ProbeKind::Udp
        } else {
            ProbeKind::None
        };
    }
    let Some(pf) = own else { return Ok(base) };
    for (key, set) in [
        ("interval_ms", pf.interval_ms.is_some()),
        ("active_interval_ms", pf.active_interval_ms.is_some()),
        ("max_per_second", pf.max_per_second.is_some()),
        ("idle_per_second", pf.idle_per_second.is_some()),
    ] {
        if set {
            bail!("{field}.{key}: one round probes every service; set huddle.probe.{key} instead");
        }
    }
    let p = over(base, pf, &field)?;
    match (p.kind, proto) {
        (ProbeKind::Udp, Proto::Tcp) => {
            bail!("{field}.kind: \"udp\" probes a UDP service; this one is TCP")
        }
        (ProbeKind::Tcp | ProbeKind::Http | ProbeKind::Tls, Proto::Udp) => {
            bail!("{field}.kind: a UDP service is probed with \"udp\" or \"none\"")
        }
        _ => Ok(p),
    }
}

/// The probe a service built in code gets (`Service::plain`): the
/// defaults, as `[huddle]` with no `probe`.
#[must_use]
pub fn default_for(proto: Proto) -> Probe {
    let p = global(&HuddleFile::default()).expect("the default probe is valid");
    service(0, None, proto, &p).expect("the default probe is valid")
}

/// `base` with the keys `pf` sets (its timing and budget excepted),
/// checked together, errors naming `field`'s keys.
fn over(mut p: Probe, pf: &ProbeFile, field: &str) -> Result<Probe> {
    if let Some(k) = pf.kind {
        p.kind = k;
    }
    if let Some(path) = &pf.path {
        if !path.starts_with('/') || path.contains(|c: char| c.is_whitespace() || c.is_control()) {
            bail!("{field}.path: {path:?} must start with / and hold no spaces");
        }
        p.path.clone_from(path);
    }
    if let Some(h) = &pf.host {
        if h.is_empty() || h.contains(|c: char| c.is_whitespace() || c.is_control()) {
            bail!("{field}.host: {h:?} must be a host name, with no spaces");
        }
        p.host = Some(h.clone());
    }
    if let Some(list) = &pf.status {
        p.status = list
            .iter()
            .map(|s| status_range(s).ok_or_else(|| anyhow::anyhow!(
                "{field}.status: {s:?} is not a status or a range such as \"200-399\" (within 100-599)"
            )))
            .collect::<Result<_>>()?;
        if p.status.is_empty() {
            bail!("{field}.status: empty: no answer could pass");
        }
    }
    if let Some(v) = pf.version {
        p.version = v;
    }
    if let Some(s) = &pf.sni {
        if rustls::pki_types::ServerName::try_from(s.as_str()).is_err() {
            bail!("{field}.sni: {s:?} is not a DNS name");
        }
        p.sni = Some(s.clone());
    }
    if let Some(s) = &pf.send {
        p.send = s.as_bytes().to_vec();
    }
    if let Some(e) = &pf.expect {
        p.expect = e.as_bytes().to_vec();
    }
    if let Some(ms) = pf.timeout_ms {
        p.timeout = millis(Some(ms), 0, &format!("{field}.timeout_ms"), 10, 60_000)?;
    }
    if let Some(n) = pf.fall {
        p.fall = n.max(1);
    }
    if let Some(n) = pf.rise {
        p.rise = n.max(1);
    }
    // The server name sent by default: the Host header, if a DNS name.
    if p.kind == ProbeKind::Tls && p.sni.is_none() {
        p.sni = p
            .host
            .clone()
            .filter(|h| h.parse::<std::net::IpAddr>().is_err())
            .filter(|h| rustls::pki_types::ServerName::try_from(h.as_str()).is_ok());
    }
    let http = matches!(p.kind, ProbeKind::Http | ProbeKind::Tls);
    let only = |key: &str, set: bool, kinds: &str| -> Result<()> {
        if set {
            bail!(
                "{field}.{key}: only a {kinds} probe uses it (kind is {:?})",
                p.kind
            );
        }
        Ok(())
    };
    only("sni", pf.sni.is_some() && p.kind != ProbeKind::Tls, "tls")?;
    only("send", pf.send.is_some() && p.kind != ProbeKind::Udp, "udp")?;
    only(
        "expect",
        pf.expect.is_some() && p.kind != ProbeKind::Udp,
        "udp",
    )?;
    only("version", pf.version.is_some() && !http, "http or tls")?;
    only("status", pf.status.is_some() && !http, "http or tls")?;
    only("host", pf.host.is_some() && !http, "http or tls")?;
    if p.kind == ProbeKind::Udp && p.send.is_empty() {
        bail!("{field}.send: a udp probe needs a datagram to send (what the service answers)");
    }
    Ok(p)
}

/// `"200"` or `"200-399"` as an inclusive range within 100-599.
fn status_range(s: &str) -> Option<(u16, u16)> {
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let (a, b): (u16, u16) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    ((100..=599).contains(&a) && (100..=599).contains(&b) && a <= b).then_some((a, b))
}
