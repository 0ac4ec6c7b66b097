//! Copies the BPF backend compiles to loads and stores.

/// Copies `src` into `dst`, which must not overlap it (a map value into
/// another map's value or into the packet). A plain assignment there makes
/// LLVM call `memmove` (a BPF function of its own, copying byte by byte,
/// whose frame counts against the call chain's 512 bytes of stack); a
/// non-overlapping copy it inlines as loads and stores.
#[inline(always)]
pub fn put<T: Copy>(dst: *mut T, src: &T) {
    // SAFETY: callers pass a valid, writable `dst` distinct from `src`.
    unsafe { core::ptr::copy_nonoverlapping(src, dst, 1) }
}
