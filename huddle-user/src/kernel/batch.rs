//! Reading a run of array elements in one system call
//! (`BPF_MAP_LOOKUP_BATCH`, which aya does not offer): the tick reads
//! every backend's counters and owed answers, and one lookup each was three
//! system calls a backend a tick.

use anyhow::{bail, Result};
use aya::maps::{IterableMap, MapData};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use super::rawmap::{BatchAttr, LOOKUP_BATCH as BPF_MAP_LOOKUP_BATCH};

/// Elements `first..first + n` of the array map `fd`, as the kernel copies
/// them: each `value_size` bytes (a per-CPU map's: `cpus` values, each
/// rounded up to 8 bytes). Fewer if the map ends sooner.
pub fn lookup_array(
    fd: BorrowedFd<'_>,
    first: u32,
    n: u32,
    value_size: usize,
) -> Result<(u32, Vec<u8>)> {
    let mut keys = vec![0u32; n as usize];
    let mut values = vec![0u8; n as usize * value_size];
    // The batch starts after `in_batch` (a key); none: at element 0.
    let mut start = first.wrapping_sub(1);
    let mut next = 0u32;
    let mut attr = BatchAttr {
        in_batch: if first == 0 {
            0
        } else {
            std::ptr::addr_of_mut!(start) as u64
        },
        out_batch: std::ptr::addr_of_mut!(next) as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: n,
        map_fd: fd.as_raw_fd() as u32,
        ..Default::default()
    };
    // SAFETY: every buffer the attribute points at lives across the call,
    // sized for `n` elements.
    match unsafe { super::rawmap::bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) } {
        // ENOENT: the map ended; `count` says how many came.
        Err(e) if e.raw_os_error() != Some(libc::ENOENT) => {
            bail!("reading {n} map elements from {first} at once: {e}")
        }
        _ => {}
    }
    if attr.count > 0 && keys[0] != first {
        bail!("a batch read from {first} began at {}", keys[0]);
    }
    values.truncate(attr.count as usize * value_size);
    Ok((attr.count, values))
}

/// Bytes the kernel copies for one element of a per-CPU map of values of
/// `size` bytes on `cpus` CPUs.
#[must_use]
pub fn per_cpu_size(size: usize, cpus: usize) -> usize {
    size.next_multiple_of(8) * cpus
}

/// `ranges` of ids (inclusive) sorted and merged where at most `gap` ids
/// apart: one batch read rather than two for ids a few apart.
#[must_use]
pub fn merged(mut ranges: Vec<(u32, u32)>, gap: u32) -> Vec<(u32, u32)> {
    ranges.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(ranges.len());
    for (a, b) in ranges {
        match out.last_mut() {
            Some(last) if a <= last.1.saturating_add(gap) => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// The descriptor of `map` (an aya map), borrowed: no copy of it a read.
fn fd_of<K: aya::Pod, V>(map: &impl IterableMap<K, V>) -> BorrowedFd<'_> {
    let data: &MapData = map.map();
    data.fd().as_fd()
}

/// Elements `first..first + n` of the per-CPU array `map` of `T`: each
/// element's value on each of `cpus` CPUs.
pub fn per_cpu<T: aya::Pod, V>(
    map: &impl IterableMap<u32, V>,
    first: u32,
    n: u32,
    cpus: usize,
) -> Result<Vec<Vec<T>>> {
    let mut out: Vec<Vec<T>> = Vec::new();
    per_cpu_fold(map, first, n, cpus, |i, v: &T| {
        if out.len() == i {
            out.push(Vec::with_capacity(cpus));
        }
        out[i].push(*v);
    })?;
    Ok(out)
}

/// `f(i, value)` for each CPU's value of each element `first + i` of the
/// per-CPU array `map` of `T`, in order, with nothing allocated per
/// element; how many elements were read.
pub fn per_cpu_fold<T: aya::Pod, V>(
    map: &impl IterableMap<u32, V>,
    first: u32,
    n: u32,
    cpus: usize,
    mut f: impl FnMut(usize, &T),
) -> Result<usize> {
    let fd = fd_of(map);
    let one = per_cpu_size(size_of::<T>(), cpus);
    let stride = size_of::<T>().next_multiple_of(8);
    let (got, raw) = lookup_array(fd, first, n, one)?;
    for i in 0..got as usize {
        for cpu in 0..cpus {
            // SAFETY: in bounds (`got` elements of `one` bytes); a
            // plain-old-data value.
            let v: T =
                unsafe { std::ptr::read_unaligned(raw[i * one + cpu * stride..].as_ptr().cast()) };
            f(i, &v);
        }
    }
    Ok(got as usize)
}

/// Elements `first..first + n` of the array `map` of `T`.
pub fn plain<T: aya::Pod>(map: &impl IterableMap<u32, T>, first: u32, n: u32) -> Result<Vec<T>> {
    let (_, raw) = lookup_array(fd_of(map), first, n, size_of::<T>())?;
    Ok(raw
        .chunks_exact(size_of::<T>())
        // SAFETY: one plain-old-data value a chunk.
        .map(|c| unsafe { std::ptr::read_unaligned(c.as_ptr().cast()) })
        .collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn ranges_a_few_ids_apart_are_read_as_one() {
        let r = super::merged(vec![(70, 80), (1, 3), (5, 5), (200, 210), (75, 90)], 16);
        assert_eq!(r, vec![(1, 5), (70, 90), (200, 210)]);
    }
}
