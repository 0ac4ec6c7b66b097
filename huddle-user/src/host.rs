//! What the balancer needs from its host: privileges, the interface, a few
//! per-interface sysctls (restored on exit), and resolved neighbours.

use crate::config::PortRange;
use anyhow::{bail, Context, Result};
use std::{
    ffi::{CStr, CString},
    fs,
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    path::PathBuf,
};
use tracing::{debug, warn};

const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_BPF: u32 = 39;

/// Fails with one clear line unless this process may load and attach XDP.
pub fn check_privileges() -> Result<()> {
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let caps = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let has = |cap: u32| caps & (1u64 << cap) != 0;
    if !has(CAP_NET_ADMIN) || !(has(CAP_BPF) || has(CAP_SYS_ADMIN)) {
        bail!(
            "huddle run needs root (or CAP_BPF and CAP_NET_ADMIN) to load and attach XDP programs"
        );
    }
    Ok(())
}

/// Index of interface `name`, or a clear error if it does not exist.
pub fn ifindex(name: &str) -> Result<u32> {
    let c = CString::new(name).context("interface name contains NUL")?;
    // SAFETY: `c` is a valid NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        bail!("interface {name:?} does not exist in this network namespace");
    }
    Ok(idx)
}

/// First IPv4 address of interface `name`.
pub fn interface_ipv4(name: &str) -> Result<Option<Ipv4Addr>> {
    let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `addrs` with a list we free below.
    if unsafe { libc::getifaddrs(&mut addrs) } != 0 {
        return Err(std::io::Error::last_os_error()).context("getifaddrs");
    }
    let mut found = None;
    let mut cur = addrs;
    while !cur.is_null() {
        // SAFETY: `cur` walks the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: non-null, NUL-terminated name from the kernel.
        let ifname = unsafe { CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: non-null sockaddr; family read before the cast.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        if ifname.to_bytes() == name.as_bytes() && family == libc::AF_INET {
            // SAFETY: AF_INET addresses are sockaddr_in.
            let sin = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
            found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            break;
        }
    }
    // SAFETY: frees the list from getifaddrs exactly once.
    unsafe { libc::freeifaddrs(addrs) };
    Ok(found)
}

/// The kernel's ephemeral port range for outgoing connections.
pub fn ephemeral_ports() -> Result<PortRange> {
    let text = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .context("reading net.ipv4.ip_local_port_range")?;
    let mut it = text.split_whitespace().map(str::parse::<u16>);
    match (it.next(), it.next()) {
        (Some(Ok(min)), Some(Ok(max))) => Ok(PortRange { min, max }),
        _ => bail!("cannot parse net.ipv4.ip_local_port_range {text:?}"),
    }
}

/// Sysctls changed for the balancer, restored when dropped.
pub struct Sysctls {
    saved: Vec<(PathBuf, String)>,
}

impl Sysctls {
    /// On `iface`: forwarding on, so a rewritten packet whose next hop is
    /// not resolved yet is forwarded by the kernel; `accept_local`, because
    /// such a packet carries our own SNAT address as source; no ICMP
    /// redirects, since one-arm forwarding goes out where it came in.
    pub fn apply(iface: &str) -> Result<Sysctls> {
        let mut s = Sysctls { saved: Vec::new() };
        for (key, value) in [
            ("forwarding", "1"),
            ("accept_local", "1"),
            ("send_redirects", "0"),
        ] {
            let path = PathBuf::from(format!("/proc/sys/net/ipv4/conf/{iface}/{key}"));
            let old = fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?
                .trim()
                .to_string();
            if old != value {
                fs::write(&path, value).with_context(|| format!("writing {}", path.display()))?;
                s.saved.push((path, old));
            }
        }
        Ok(s)
    }
}

impl Drop for Sysctls {
    fn drop(&mut self) {
        for (path, old) in self.saved.drain(..).rev() {
            if let Err(e) = fs::write(&path, &old) {
                warn!("could not restore {}: {e}", path.display());
            }
        }
    }
}

/// Makes the kernel resolve each backend's link-layer address ahead of
/// traffic, so the XDP program finds it in the FIB. An empty datagram to the
/// discard port is enough to start resolution; nothing needs to answer.
pub fn warm_neighbours(backends: &[SocketAddr]) {
    let sock = match UdpSocket::bind("0.0.0.0:0") {
        Ok(s) => s,
        Err(e) => {
            warn!("neighbour warm-up: cannot open a UDP socket: {e}");
            return;
        }
    };
    let _ = sock.set_nonblocking(true);
    for b in backends {
        if let Err(e) = sock.send_to(&[], SocketAddr::new(b.ip(), 9)) {
            debug!("neighbour warm-up toward {}: {e}", b.ip());
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of `bpf_ktime_get_ns`.
#[must_use]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64
}
