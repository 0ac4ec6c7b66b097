//! The per-interface sysctls the balancer sets, restored on exit, and
//! the host's ephemeral port range.

use crate::config::PortRange;
use anyhow::{bail, Context, Result};
use std::{fs, path::PathBuf};
use tracing::warn;

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
            saved: earlier.into_iter().filter(|(p, v)| ours(p, v)).collect(),
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

    /// Restores saved values (for `huddle stop` without a daemon). Only
    /// the sysctls `apply` changes, with the values they can hold: the list
    /// comes from the state file, which must not make root write anything
    /// else anywhere.
    pub fn restore_saved(saved: &[(PathBuf, String)]) {
        for (path, old) in saved.iter().rev() {
            if !ours(path, old) {
                warn!(
                    "not restoring {} = {old:?}: not a sysctl huddle run changes",
                    path.display()
                );
                continue;
            }
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

/// Whether `path` = `value` is one of the sysctls `Sysctls::apply` sets,
/// on an interface name the kernel could have (no `/`, not `.` or `..`,
/// at most 15 bytes), holding a 0 or 1 as those do.
fn ours(path: &std::path::Path, value: &str) -> bool {
    let Some(rest) = path.to_str().and_then(|p| p.strip_prefix("/proc/sys/net/")) else {
        return false;
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let [family, "conf", iface, key] = parts[..] else {
        return false;
    };
    let known = matches!(
        (family, key),
        ("ipv4", "forwarding" | "accept_local" | "send_redirects") | ("ipv6", "forwarding")
    );
    known
        && !iface.is_empty()
        && iface.len() <= 15
        && iface != "."
        && iface != ".."
        && matches!(value.trim(), "0" | "1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn only_the_sysctls_run_sets_are_restored() {
        let ok = |p: &str, v: &str| ours(Path::new(p), v);
        assert!(ok("/proc/sys/net/ipv4/conf/eth0/forwarding", "0"));
        assert!(ok("/proc/sys/net/ipv4/conf/eth0/send_redirects", "1"));
        assert!(ok("/proc/sys/net/ipv6/conf/veth-a.12/forwarding", "0"));
        assert!(!ok("/proc/sys/net/ipv6/conf/eth0/accept_local", "0"));
        assert!(!ok(
            "/proc/sys/net/ipv4/conf/../../../kernel/core_pattern/x",
            "0"
        ));
        assert!(!ok("/proc/sys/net/ipv4/conf/../forwarding", "0"));
        assert!(!ok("/proc/sys/kernel/core_pattern", "|/tmp/x"));
        assert!(!ok("/etc/passwd", "0"));
        assert!(!ok("/proc/sys/net/ipv4/conf/eth0/forwarding", "|/tmp/x"));
        // And a state file naming anything else writes nothing there.
        let victim = std::env::temp_dir().join(format!("huddle-sysctl-{}", std::process::id()));
        std::fs::write(&victim, "precious").unwrap();
        Sysctls::restore_saved(&[(victim.clone(), "0".into())]);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        std::fs::remove_file(&victim).unwrap();
    }
}
