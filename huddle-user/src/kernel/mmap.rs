//! A BPF array mapped into this process (created with `BPF_F_MMAPABLE`)
//! and seen as 16-bit entries, four to each 8-byte element (the MAGLEV
//! map's layout): a Maglev table of 65,537 entries is written as memory
//! in microseconds, where one update syscall per element takes tens of
//! milliseconds.

use anyhow::{bail, Result};
use aya::maps::MapData;
use std::os::fd::{AsFd, AsRawFd};

pub struct MappedArray {
    /// Kept open: the mapping holds the map, the descriptor names it.
    _map: MapData,
    ptr: *mut u32,
    len: usize,
    bytes: usize,
}

// SAFETY: the mapping is owned by this value alone and only touched
// through `&mut self` (writes) or `&self` (reads); the kernel's readers
// are the programs, which the double buffer keeps off the part written.
unsafe impl Send for MappedArray {}
unsafe impl Sync for MappedArray {}

impl MappedArray {
    /// Maps `map`, an array created mmapable with 8-byte values, as
    /// `len` 32-bit entries.
    pub fn new(map: MapData, len: usize) -> Result<MappedArray> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let bytes = (len * 4).div_ceil(page) * page;
        let fd = map.fd().as_fd().as_raw_fd();
        // SAFETY: a fresh shared mapping of the map's memory, checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            bail!(
                "mapping the MAGLEV map ({len} entries) into memory: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(MappedArray {
            _map: map,
            ptr: ptr.cast(),
            len,
            bytes,
        })
    }

    /// Writes `values` from entry `at` on.
    pub fn write(&mut self, at: usize, values: &[u32]) -> Result<()> {
        if at
            .checked_add(values.len())
            .is_none_or(|end| end > self.len)
        {
            bail!(
                "{} entries at {at} do not fit the map's {}",
                values.len(),
                self.len
            );
        }
        // SAFETY: in bounds (checked), and `values` is not in the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(values.as_ptr(), self.ptr.add(at), values.len());
        }
        Ok(())
    }

    /// `n` entries from entry `at` on.
    pub fn read(&self, at: usize, n: usize) -> Result<Vec<u32>> {
        if at.checked_add(n).is_none_or(|end| end > self.len) {
            bail!("{n} entries at {at} are past the map's {}", self.len);
        }
        // SAFETY: in bounds (checked); u32 has no invalid bit patterns.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.add(at), n) }.to_vec())
    }
}

impl Drop for MappedArray {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
    }
}
