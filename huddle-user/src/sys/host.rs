//! Host facts: privileges, possible CPUs, the kernel's clock.

use anyhow::{bail, Context, Result};
use std::fs;

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

/// CPUs the kernel may ever run (per-CPU maps and NAT slices are sized by
/// this, not by the online count).
pub fn possible_cpus() -> Result<usize> {
    aya::util::nr_cpus()
        .map_err(|(_, e)| e)
        .context("counting the possible CPUs")
}

/// CPUs online now (a thread can be pinned to), whatever this thread's
/// own affinity.
#[must_use]
pub fn online_cpus() -> usize {
    // SAFETY: sysconf reads a system constant.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).unwrap_or(1).max(1)
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

/// Fills `buf` from the kernel's random source: secrets (hash seeds, the
/// cluster key) and nonces.
pub fn random_bytes(buf: &mut [u8]) -> Result<()> {
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, buf))
        .context("reading /dev/urandom")
}

/// The kernel memory of the BPF maps this process holds open: the sum of
/// each distinct map's `memlock` (from /proc/self/fdinfo), and how many
/// maps. A map opened twice counts once.
pub fn bpf_map_memory() -> Result<(u64, usize)> {
    let mut seen = std::collections::HashMap::new();
    for e in fs::read_dir("/proc/self/fdinfo").context("reading /proc/self/fdinfo")? {
        let Ok(text) = fs::read_to_string(e?.path()) else {
            continue;
        };
        if let Some((id, bytes)) = map_fdinfo(&text) {
            seen.insert(id, bytes);
        }
    }
    Ok((seen.values().sum(), seen.len()))
}

/// (map id, memlock bytes) from an fdinfo text, if the fd is a BPF map.
fn map_fdinfo(text: &str) -> Option<(u32, u64)> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<u64>().ok())
    };
    let id = u32::try_from(field("map_id:")?).ok()?;
    Some((id, field("memlock:")?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_maps_fdinfo_gives_its_id_and_memory_and_others_nothing() {
        let map = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t2080\nmap_type:\t6\nkey_size:\t4\nvalue_size:\t1024\nmax_entries:\t1024\nmap_flags:\t0x0\nmap_extra:\t0x0\nmemlock:\t2105344\nmap_id:\t4242\nfrozen:\t0\n";
        assert_eq!(super::map_fdinfo(map), Some((4242, 2_105_344)));
        assert_eq!(
            super::map_fdinfo("pos:\t0\nflags:\t02\nmnt_id:\t15\n"),
            None
        );
    }
}
