//! What the balancer needs from its host: privileges, the interface, a few
//! per-interface sysctls (restored on exit), and resolved neighbours.

use crate::config::PortRange;
use anyhow::{bail, Context, Result};
use std::os::fd::AsRawFd;
use std::{
    ffi::{CStr, CString},
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    path::{Path, PathBuf},
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
    Ok(ipv4_addrs()?
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, a)| a))
}

/// Tells systemd about the daemon's state (`READY=1`, `RELOADING=1`,
/// `STOPPING=1`, `STATUS=...`) when it runs as a `Type=notify` service;
/// nothing otherwise. Errors are logged, never fatal.
pub fn sd_notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = notify_to(&path, state) {
        warn!("telling systemd {state:?}: {e}");
    }
}

/// Sends `state` to the notification socket `path` (`@name`: abstract).
fn notify_to(path: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixDatagram};
    let sock = UnixDatagram::unbound()?;
    let addr = match path.as_encoded_bytes().strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt as _;
            UnixAddr::from_abstract_name(name)?
        }
        None => UnixAddr::from_pathname(path)?,
    };
    sock.send_to_addr(state.as_bytes(), &addr)?;
    Ok(())
}

/// CPUs the kernel may ever run (per-CPU maps and NAT slices are sized by
/// this, not by the online count).
pub fn possible_cpus() -> Result<usize> {
    aya::util::nr_cpus()
        .map_err(|(_, e)| e)
        .context("counting the possible CPUs")
}

/// First global IPv6 address of interface `name` (not link-local).
pub fn interface_ipv6(name: &str) -> Result<Option<Ipv6Addr>> {
    Ok(ipv6_addrs()?
        .into_iter()
        .find(|(n, a)| n == name && !a.is_unicast_link_local() && !a.is_loopback())
        .map(|(_, a)| a))
}

/// Every IPv6 address of this namespace's interfaces, with the interface.
pub fn ipv6_addrs() -> Result<Vec<(String, Ipv6Addr)>> {
    Ok(ip_addrs()?
        .into_iter()
        .filter_map(|(n, a)| match a {
            IpAddr::V6(v6) => Some((n, v6)),
            IpAddr::V4(_) => None,
        })
        .collect())
}

/// Every IPv4 address of this namespace's interfaces, with the interface.
pub fn ipv4_addrs() -> Result<Vec<(String, Ipv4Addr)>> {
    Ok(ip_addrs()?
        .into_iter()
        .filter_map(|(n, a)| match a {
            IpAddr::V4(v4) => Some((n, v4)),
            IpAddr::V6(_) => None,
        })
        .collect())
}

/// Every address of this namespace's interfaces, with the interface.
/// Every address of this namespace's interfaces, both families, with the
/// interface.
pub fn ip_addrs() -> Result<Vec<(String, IpAddr)>> {
    let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `addrs` with a list we free below.
    if unsafe { libc::getifaddrs(&mut addrs) } != 0 {
        return Err(std::io::Error::last_os_error()).context("getifaddrs");
    }
    let mut found = Vec::new();
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
        if family == libc::AF_INET {
            // SAFETY: AF_INET addresses are sockaddr_in.
            let sin = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
            found.push((
                ifname.to_string_lossy().into_owned(),
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))),
            ));
        } else if family == libc::AF_INET6 {
            // SAFETY: AF_INET6 addresses are sockaddr_in6.
            let sin6 = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in6>() };
            found.push((
                ifname.to_string_lossy().into_owned(),
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
            ));
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

/// Sysctls changed for the balancer, restored when dropped unless kept
/// (the data plane goes on without the daemon and still needs them).
pub struct Sysctls {
    /// Each changed file and its value before the balancer's first start.
    pub saved: Vec<(PathBuf, String)>,
    restore: bool,
}

impl Sysctls {
    /// On `iface`: forwarding on, so a rewritten packet whose next hop is
    /// not resolved yet is forwarded by the kernel; `accept_local`, because
    /// such a packet carries our own SNAT address as source; no ICMP
    /// redirects, since one-arm forwarding goes out where it came in.
    /// `earlier`: the originals an earlier run saved (its changes are
    /// still in place), so a stop restores the values from before it.
    /// With `ipv6` (IPv6 services), IPv6 forwarding on it too: the FIB
    /// answers the XDP program only on an interface that forwards (the
    /// interface then ignores router advertisements, as any router does).
    pub fn apply(iface: &str, earlier: Vec<(PathBuf, String)>, ipv6: bool) -> Result<Sysctls> {
        let mut s = Sysctls {
            saved: earlier,
            restore: true,
        };
        let mut keys = vec![
            ("ipv4", "forwarding", "1"),
            ("ipv4", "accept_local", "1"),
            ("ipv4", "send_redirects", "0"),
        ];
        if ipv6 {
            keys.push(("ipv6", "forwarding", "1"));
        }
        for (family, key, value) in keys {
            let path = PathBuf::from(format!("/proc/sys/net/{family}/conf/{iface}/{key}"));
            let old = fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?
                .trim()
                .to_string();
            if old != value {
                fs::write(&path, value).with_context(|| format!("writing {}", path.display()))?;
                if !s.saved.iter().any(|(p, _)| *p == path) {
                    s.saved.push((path, old));
                }
            }
        }
        Ok(s)
    }

    /// Leaves the changes in place when dropped.
    pub fn keep(&mut self) {
        self.restore = false;
    }

    /// Restores saved values (for `huddle stop` without a daemon).
    pub fn restore_saved(saved: &[(PathBuf, String)]) {
        for (path, old) in saved.iter().rev() {
            if let Err(e) = fs::write(path, old) {
                warn!("could not restore {}: {e}", path.display());
            }
        }
    }
}

impl Drop for Sysctls {
    fn drop(&mut self) {
        if self.restore {
            Sysctls::restore_saved(&self.saved);
        }
    }
}

/// Where the data plane of `iface` is pinned unless configured: one folder
/// per interface, and per network namespace outside the host's own (bpffs
/// is shared by all namespaces, interface names are not).
#[must_use]
pub fn default_pin_dir(iface: &str) -> PathBuf {
    let ino = |p: &str| {
        fs::metadata(p)
            .ok()
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
    };
    let root = PathBuf::from("/sys/fs/bpf/huddle");
    let Some(me) = ino("/proc/self/ns/net") else {
        return root.join(iface);
    };
    // Where PID 1's namespace cannot be read (a sandbox), a namespace made
    // with `ip netns add` is still known by its file under /run/netns.
    let named = || {
        fs::read_dir("/run/netns").ok().is_some_and(|d| {
            d.filter_map(Result::ok)
                .any(|e| ino(&e.path().to_string_lossy()) == Some(me))
        })
    };
    match ino("/proc/1/ns/net") {
        Some(init) if init != me => root.join(format!("netns-{me}-{iface}")),
        None if named() => root.join(format!("netns-{me}-{iface}")),
        _ => root.join(iface),
    }
}

/// Makes the kernel resolve each backend's link-layer address ahead of
/// traffic, so the XDP program finds it in the FIB. An empty datagram to the
/// discard port is enough to start resolution; nothing needs to answer.
pub fn warm_neighbours(backends: &[SocketAddr]) {
    for b in backends {
        let r = udp_for(b.ip()).and_then(|sock| {
            sock.set_nonblocking(true)?;
            sock.send_to(&[], SocketAddr::new(b.ip(), 9))
        });
        if let Err(e) = r {
            debug!("neighbour warm-up toward {}: {e}", b.ip());
        }
    }
}

/// A UDP socket of `ip`'s family, on any address and port.
pub fn udp_for(ip: IpAddr) -> std::io::Result<UdpSocket> {
    if ip.is_ipv4() {
        UdpSocket::bind("0.0.0.0:0")
    } else {
        UdpSocket::bind("[::]:0")
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

/// `statfs` magic of bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Where the data plane is really pinned, and whether it outlives us.
#[derive(Clone, Debug)]
pub struct PinPlace {
    /// The path to pin at: the configured folder, or the same folder in
    /// the host's bpffs reached through another mount namespace.
    pub dir: PathBuf,
    /// False when the pins live in a bpffs only this process can see: they
    /// die with it, and so does the data plane.
    pub survives: bool,
    /// What the operator must be told about it, once.
    pub note: Option<String>,
}

fn fs_type(p: &Path) -> Option<i64> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs writes into the zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0).then_some(st.f_type as i64)
}

fn mount_ns(pid: &str) -> Option<u64> {
    fs::metadata(format!("/proc/{pid}/ns/mnt"))
        .ok()
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
}

fn parent_pid(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The root folder of a process outside our mount namespace whose
/// /sys/fs/bpf is a bpffs, held open so the path through it stays valid
/// after that process exits: `(path of our descriptor, pid)`.
fn host_root() -> Option<(PathBuf, u32)> {
    static ROOT: std::sync::OnceLock<Option<(PathBuf, u32)>> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        let me = mount_ns("self");
        // PID 1 first, then whoever started us (a shell that ran `ip netns
        // exec`, say), and its ancestors.
        let mut candidates = vec![1u32];
        let mut pid = std::process::id();
        for _ in 0..16 {
            match parent_pid(pid) {
                Some(p) if p > 1 => {
                    candidates.push(p);
                    pid = p;
                }
                _ => break,
            }
        }
        for pid in candidates {
            let ns = mount_ns(&pid.to_string());
            if ns.is_some() && ns == me {
                continue;
            }
            let Ok(dir) = fs::File::open(format!("/proc/{pid}/root")) else {
                continue;
            };
            let via = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
            if fs_type(&via.join("sys/fs/bpf")) == Some(BPF_FS_MAGIC) {
                // Kept open for the life of the process on purpose.
                std::mem::forget(dir);
                return Some((via, pid));
            }
        }
        None
    })
    .clone()
}

/// Whether this process has a mount namespace of its own, apart from its
/// parent's (`ip netns exec` makes one, with a fresh /sys).
fn private_mounts() -> bool {
    let parent = parent_pid(std::process::id()).unwrap_or(1);
    match (mount_ns("self"), mount_ns(&parent.to_string())) {
        (Some(a), Some(b)) => a != b,
        _ => false,
    }
}

/// `dir` as seen from the host's mounts, when this process has a /sys of
/// its own without a bpffs (under `ip netns exec`) and the host's bpffs can
/// be reached; `None` otherwise.
#[must_use]
pub fn host_pin_dir(dir: &Path) -> Option<PathBuf> {
    let root = Path::new("/sys/fs/bpf");
    if !dir.starts_with(root) || fs_type(root) == Some(BPF_FS_MAGIC) || !private_mounts() {
        return None;
    }
    let (via, _) = host_root()?;
    Some(via.join(dir.strip_prefix("/").unwrap_or(dir)))
}

/// Makes sure `dir` can hold pins that outlive the daemon. It must lie on
/// a bpffs. `ip netns exec` gives each run a fresh /sys without one: then
/// the same folder of the host's bpffs is used, reached through the mount
/// namespace of PID 1 or of the process that started us. If nothing is
/// mounted at /sys/fs/bpf and `dir` is under it, one is mounted there (as
/// systemd would); inside a private mount namespace that one dies with us,
/// and the place says so.
pub fn pin_place(dir: &Path) -> Result<PinPlace> {
    let existing = dir
        .ancestors()
        .find(|a| a.exists())
        .unwrap_or(Path::new("/"));
    if fs_type(existing) == Some(BPF_FS_MAGIC) {
        return Ok(PinPlace {
            dir: dir.to_path_buf(),
            survives: true,
            note: None,
        });
    }
    let root = Path::new("/sys/fs/bpf");
    if !dir.starts_with(root) || existing != root {
        bail!(
            "pin_dir {} is not on a bpffs (mount one, e.g. `mount -t bpf bpf /sys/fs/bpf`, or choose another pin_dir)",
            dir.display()
        );
    }
    let private = private_mounts();
    if private {
        if let Some((via, pid)) = host_root() {
            let rel = dir.strip_prefix("/").unwrap_or(dir);
            return Ok(PinPlace {
                dir: via.join(rel),
                survives: true,
                note: Some(format!(
                    "this process has a /sys of its own (as under `ip netns exec`), without the host's bpffs: pinning into the host's bpffs at {} (reached through the mounts of pid {pid}), so the data plane outlives the daemon",
                    dir.display()
                )),
            });
        }
    }
    let c = |s: &str| std::ffi::CString::new(s).expect("no NUL");
    let (src, target, kind) = (c("bpf"), c("/sys/fs/bpf"), c("bpf"));
    // SAFETY: mount with valid C strings and no data.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            kind.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("mounting bpffs at /sys/fs/bpf");
    }
    if private {
        let note = "pins live in a bpffs of this process's own mount namespace (as under `ip netns exec` when no host bpffs can be reached): they die with the daemon, so a restart drops every flow; mount bpffs on the host (`mount -t bpf bpf /sys/fs/bpf`) or pass --pin-dir on one".to_string();
        tracing::warn!("{note}");
        return Ok(PinPlace {
            dir: dir.to_path_buf(),
            survives: false,
            note: Some(note),
        });
    }
    tracing::info!("mounted bpffs at /sys/fs/bpf for the pinned data plane");
    Ok(PinPlace {
        dir: dir.to_path_buf(),
        survives: true,
        note: None,
    })
}

/// The route the main table gives `ip` (from /proc/net/route text): its
/// interface and gateway (`None`: on-link), longest prefix first, then
/// lowest metric.
#[must_use]
pub fn route_of(table: &str, ip: Ipv4Addr) -> Option<(String, Option<Ipv4Addr>)> {
    let ip = u32::from(ip);
    let hex = |s: &str| u32::from_str_radix(s, 16).ok().map(u32::from_be);
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
            let (dest, gw, flags, metric, mask) = (
                hex(f.get(1)?)?,
                hex(f.get(2)?)?,
                u32::from_str_radix(f.get(3)?, 16).ok()?,
                f.get(6)?.parse::<u32>().ok()?,
                hex(f.get(7)?)?,
            );
            // RTF_UP, and the destination matches.
            (flags & 1 == 1 && ip & mask == dest & mask)
                .then(|| (mask.count_ones(), metric, f[0].to_string(), gw))
        })
        .min_by_key(|(bits, metric, _, _)| (std::cmp::Reverse(*bits), *metric))
        .map(|(_, _, iface, gw)| (iface, (gw != 0).then(|| Ipv4Addr::from(gw))))
}

/// As `route_of`, for IPv6 (from /proc/net/ipv6_route text).
#[must_use]
pub fn route6_of(table: &str, ip: Ipv6Addr) -> Option<(String, Option<Ipv6Addr>)> {
    let want = u128::from(ip);
    let hex = |s: &str| u128::from_str_radix(s, 16).ok();
    table
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // dest plen src plen next_hop metric refcnt use flags iface
            let (dest, plen, gw, metric, flags) = (
                hex(f.first()?)?,
                u32::from_str_radix(f.get(1)?, 16).ok()?,
                hex(f.get(4)?)?,
                u32::from_str_radix(f.get(5)?, 16).ok()?,
                u32::from_str_radix(f.get(8)?, 16).ok()?,
            );
            let mask = if plen == 0 {
                0
            } else {
                u128::MAX << (128 - plen.min(128))
            };
            // RTF_UP, not a rejecting route, the destination matches.
            (flags & 1 == 1 && flags & 0x200 == 0 && want & mask == dest & mask)
                .then(|| (plen, metric, f.get(9).unwrap_or(&"").to_string(), gw))
        })
        .filter(|(_, _, iface, _)| iface != "lo")
        .min_by_key(|(plen, metric, _, _)| (std::cmp::Reverse(*plen), *metric))
        .map(|(_, _, iface, gw)| (iface, (gw != 0).then(|| Ipv6Addr::from(gw))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_matched_longest_prefix_first() {
        let t =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
eth0\t00000000\tFE00D50A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
eth0\t0000D50A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
eth1\t0063D50A\t0100D50A\t0003\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";
        let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        assert_eq!(route_of(t, ip("10.213.0.11")), Some(("eth0".into(), None)));
        assert_eq!(
            route_of(t, ip("10.213.99.5")),
            Some(("eth1".into(), Some(ip("10.213.0.1"))))
        );
        assert_eq!(
            route_of(t, ip("8.8.8.8")),
            Some(("eth0".into(), Some(ip("10.213.0.254"))))
        );
    }

    #[test]
    fn readiness_reaches_a_notification_socket_by_path_and_abstract_name() {
        use std::os::unix::net::UnixDatagram;
        let path = std::env::temp_dir().join(format!("huddle-notify-{}", std::process::id()));
        let _ = fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).unwrap();
        notify_to(path.as_os_str(), "READY=1\nSTATUS=attached").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=attached");
        fs::remove_file(&path).unwrap();

        use std::os::linux::net::SocketAddrExt as _;
        let name = format!("huddle-notify-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let rx = UnixDatagram::bind_addr(&addr).unwrap();
        notify_to(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }
}
