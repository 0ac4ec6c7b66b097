//! The Maglev tables the kernel reads: their size, seed and empty entry.

/// Seed of the permutations a Maglev table is built from: fixed, so every
/// balancer builds the same table from the same ring. Public, and no help
/// to an attacker: which entry a flow takes depends on the secret
/// `KernelConfig::maglev_seed`.
pub const MAGLEV_TABLE_SEED: u64 = 0x6d61_676c_6576_0001;

/// The MAGLEV map's flags: BPF_F_MMAPABLE, so the control plane writes a
/// table of 65,537 entries as memory, not one syscall each.
pub const MAGLEV_MAP_FLAGS: u32 = 1 << 10;

/// A Maglev entry no backend holds.
pub const MAGLEV_EMPTY: u32 = u32::MAX;

/// Whether `n` is prime (trial division; table sizes are small): a Maglev
/// table's size must be.
#[must_use]
pub const fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2u32;
    while d.saturating_mul(d) <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}

/// Elements of the MAGLEV map for `services` Maglev services' tables of
/// `size` entries: two per service (the double buffer), two 32-bit ids to
/// an element (an array's elements take 8 bytes whatever their value's
/// size). Only services with `selection = "maglev"` take a place
/// (`Tuning::maglev_base`).
#[must_use]
pub const fn maglev_elements(size: u32, services: u32) -> u32 {
    size * services
}
