//! A pinned map as bytes: its elements read and written whatever the
//! types of the build that made it. Migration (`dataplane::migrate`) reads
//! an older build's maps, whose Rust types this build no longer has.

use anyhow::{bail, Context, Result};
use aya::maps::{MapData, MapInfo};
use std::{
    os::fd::{AsFd, AsRawFd},
    path::Path,
};

/// `enum bpf_cmd`'s element commands.
const LOOKUP: libc::c_long = 1;
const UPDATE: libc::c_long = 2;
const NEXT_KEY: libc::c_long = 4;
/// `BPF_MAP_LOOKUP_BATCH`.
pub(crate) const LOOKUP_BATCH: libc::c_long = 24;

/// `BPF_NOEXIST`: an update that leaves an existing element alone.
pub const NOEXIST: u64 = 1;
/// `BPF_ANY`.
pub const ANY: u64 = 0;

/// `union bpf_attr`'s part for the element commands.
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// `union bpf_attr`'s part for the batch commands.
#[repr(C)]
#[derive(Default)]
pub(crate) struct BatchAttr {
    pub in_batch: u64,
    pub out_batch: u64,
    pub keys: u64,
    pub values: u64,
    pub count: u32,
    pub map_fd: u32,
    pub elem_flags: u64,
    pub flags: u64,
}

/// Elements asked for in one batch: a hash map answers whole buckets, so
/// this must exceed the longest (doubled on `ENOSPC`).
const BATCH: usize = 4096;

/// Elements read at once: keys and values each in one buffer.
pub struct Entries {
    keys: Vec<u8>,
    values: Vec<u8>,
    key_size: usize,
    value_len: usize,
}

impl Entries {
    /// How many.
    #[must_use]
    pub fn len(&self) -> usize {
        self.keys.len() / self.key_size.max(1)
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each (key, value).
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.keys
            .chunks_exact(self.key_size.max(1))
            .zip(self.values.chunks_exact(self.value_len.max(1)))
    }
}

/// A map opened by its pin, with the sizes the kernel gives.
pub struct RawMap {
    data: MapData,
    pub name: String,
    pub key_size: usize,
    /// Bytes of one element as the kernel copies it: a per-CPU map's
    /// value rounded up to 8 bytes, once per possible CPU.
    pub value_len: usize,
    /// One value's size (one CPU's, for a per-CPU map).
    pub value_size: usize,
    pub max_entries: u32,
    pub per_cpu: bool,
    pub array: bool,
}

impl RawMap {
    /// The map pinned at `pin`.
    pub fn open(pin: &Path) -> Result<RawMap> {
        let data = MapData::from_pin(pin).with_context(|| format!("opening {}", pin.display()))?;
        let info = MapInfo::from_pin(pin)?;
        let kind = info.map_type()?;
        use aya::maps::MapType as T;
        let per_cpu = matches!(kind, T::PerCpuArray | T::PerCpuHash | T::LruPerCpuHash);
        let array = matches!(kind, T::Array | T::PerCpuArray);
        let value_size = info.value_size() as usize;
        let value_len = if per_cpu {
            value_size.next_multiple_of(8) * crate::sys::host::possible_cpus()?
        } else {
            value_size
        };
        Ok(RawMap {
            data,
            name: pin
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            key_size: info.key_size() as usize,
            value_len,
            value_size,
            max_entries: info.max_entries(),
            per_cpu,
            array,
        })
    }

    fn call(
        &self,
        cmd: libc::c_long,
        key: *const u8,
        value: *mut u8,
        flags: u64,
    ) -> std::io::Result<()> {
        let mut attr = ElemAttr {
            map_fd: self.data.fd().as_fd().as_raw_fd() as u32,
            _pad: 0,
            key: key as u64,
            value: value as u64,
            flags,
        };
        // SAFETY: the buffers the attribute points at (key_size and
        // value_len bytes, checked by the callers) live across the call.
        unsafe { bpf(cmd, &mut attr) }.map(drop)
    }

    /// The element at `key`, if any.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.check_key(key)?;
        let mut v = vec![0u8; self.value_len];
        match self.call(LOOKUP, key.as_ptr(), v.as_mut_ptr(), 0) {
            Ok(()) => Ok(Some(v)),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading an element of {}", self.name)),
        }
    }

    /// Writes `value` at `key` (`flags`: `ANY` or `NOEXIST`); false if
    /// `NOEXIST` found one there.
    pub fn put(&self, key: &[u8], value: &[u8], flags: u64) -> Result<bool> {
        self.check_key(key)?;
        if value.len() != self.value_len {
            bail!(
                "{}: a value of {} bytes, the map's are {}",
                self.name,
                value.len(),
                self.value_len
            );
        }
        match self.call(UPDATE, key.as_ptr(), value.as_ptr().cast_mut(), flags) {
            Ok(()) => Ok(true),
            Err(e) if flags == NOEXIST && e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
            Err(e) => Err(e).with_context(|| format!("writing an element of {}", self.name)),
        }
    }

    /// Every key, at most `max_entries` of them plus as many again (a hash
    /// map walked while a program changes it may give a key twice; the
    /// bound keeps the walk finite).
    pub fn keys(&self) -> Result<Vec<Vec<u8>>> {
        if self.array {
            return Ok((0..self.max_entries)
                .map(|i| i.to_ne_bytes()[..self.key_size.min(4)].to_vec())
                .collect());
        }
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut prev: Option<Vec<u8>> = None;
        let bound = 2 * self.max_entries as usize + 1;
        for _ in 0..bound {
            let mut next = vec![0u8; self.key_size];
            let key = prev.as_ref().map_or(std::ptr::null(), |k| k.as_ptr());
            match self.call(NEXT_KEY, key, next.as_mut_ptr(), 0) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
                Err(e) => {
                    return Err(e).with_context(|| format!("walking the keys of {}", self.name))
                }
            }
            if seen.insert(next.clone()) {
                out.push(next.clone());
            }
            prev = Some(next);
        }
        Ok(out)
    }

    /// Every element, read a few thousand at a time
    /// (`BPF_MAP_LOOKUP_BATCH`: a migration's pass over a full flow table
    /// was seconds of one lookup each, during which the flows the old
    /// program opened were missing from the new one). At most
    /// `max_entries` plus as many again, as `keys`; an array's in order.
    pub fn entries(&self) -> Result<Entries> {
        let mut out = Entries {
            keys: Vec::new(),
            values: Vec::new(),
            key_size: self.key_size,
            value_len: self.value_len,
        };
        // The kernel's cursor: a bucket (hash maps) or a key (arrays).
        let token_len = self.key_size.max(8);
        let (mut token_in, mut token_out) = (vec![0u8; token_len], vec![0u8; token_len]);
        let mut first = true;
        let mut count = BATCH;
        let bound = 2 * self.max_entries as usize + 1;
        while out.len() < bound {
            let (k0, v0) = (out.keys.len(), out.values.len());
            out.keys.resize(k0 + count * self.key_size, 0);
            out.values.resize(v0 + count * self.value_len, 0);
            let mut attr = BatchAttr {
                in_batch: if first {
                    0
                } else {
                    token_in.as_mut_ptr() as u64
                },
                out_batch: token_out.as_mut_ptr() as u64,
                keys: out.keys[k0..].as_mut_ptr() as u64,
                values: out.values[v0..].as_mut_ptr() as u64,
                count: count as u32,
                map_fd: self.data.fd().as_fd().as_raw_fd() as u32,
                ..Default::default()
            };
            // SAFETY: the buffers hold `count` more keys and values and a
            // token of at least the key's size; they outlive the call.
            let r = unsafe { bpf(LOOKUP_BATCH, &mut attr) };
            let got = (attr.count as usize).min(count);
            out.keys.truncate(k0 + got * self.key_size);
            out.values.truncate(v0 + got * self.value_len);
            match r {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && count < 1 << 20 => {
                    count *= 2;
                    continue;
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("reading {} in batches", self.name))
                }
            }
            std::mem::swap(&mut token_in, &mut token_out);
            first = false;
        }
        Ok(out)
    }

    fn check_key(&self, key: &[u8]) -> Result<()> {
        if key.len() != self.key_size {
            bail!(
                "{}: a key of {} bytes, the map's are {}",
                self.name,
                key.len(),
                self.key_size
            );
        }
        Ok(())
    }
}

/// The bpf(2) system call `cmd` on `attr`, the part of `union bpf_attr`
/// that command reads (and the kernel may write back); its result.
///
/// # Safety
/// Every pointer in `attr` must point at memory of the size the command
/// expects, alive across the call.
pub unsafe fn bpf<A>(cmd: libc::c_long, attr: &mut A) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is ours and `size_of::<A>()` long; the pointers in it
    // are the caller's to vouch for.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            size_of::<A>() as u32,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}

/// `T` read from the front of `b` (which holds at least its size).
#[must_use]
pub fn read_pod<T: aya::Pod>(b: &[u8]) -> T {
    assert!(
        b.len() >= size_of::<T>(),
        "{} bytes for a {}-byte value",
        b.len(),
        size_of::<T>()
    );
    // SAFETY: `Pod`: every bit pattern is a valid `T`; the length is
    // checked above and the read is unaligned.
    unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) }
}

/// `T`'s bytes, as a map holds them.
#[must_use]
pub fn pod_bytes<T: aya::Pod>(t: &T) -> Vec<u8> {
    // SAFETY: `Pod`: plain bytes with explicit padding, `size_of` long.
    unsafe { std::slice::from_raw_parts(std::ptr::from_ref(t).cast::<u8>(), size_of::<T>()) }
        .to_vec()
}
