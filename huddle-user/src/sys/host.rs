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
