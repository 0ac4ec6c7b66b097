//! Maglev consistent hashing (Eisenbud et al., NSDI 2016): a lookup table
//! of a prime number of entries, each a backend of the inner ring, that a
//! new flow indexes by a hash of its 5-tuple. Every balancer given the
//! same ring builds the same table, so a flow keeps its backend whichever
//! balancer the router sends it to, and one backend leaving or returning
//! moves about 1/N of the entries, not all of them.
//!
//! Each backend walks its own permutation of the table (an offset and a
//! skip from a hash of its address) and takes the next entry still free
//! there, in turns; a backend of weight w takes w / (largest weight) turns
//! a round, so shares follow the weights. Backends are taken in address
//! order, not config order, and their identity is their address, not the
//! id this balancer gave them: balancers that number backends differently
//! still agree.

use huddle_common::{hash_words, FlowKey, MAGLEV_TABLE_SEED};
use std::net::{IpAddr, SocketAddr};

/// A table entry no backend holds (an empty ring): the kernel finds no
/// backend there.
pub const EMPTY: u32 = huddle_common::MAGLEV_EMPTY;

/// One backend of the ring as the table sees it.
#[derive(Clone, Copy, Debug)]
pub struct Member {
    /// Backend id in this balancer's maps: what the entries hold.
    pub id: u32,
    /// Its identity, the same on every balancer.
    pub addr: SocketAddr,
    /// Relative share of the entries (0: none).
    pub weight: f64,
}

/// The 64-bit words a backend's identity hashes from.
fn words(addr: SocketAddr) -> [u64; 5] {
    let (bytes, family) = match addr.ip() {
        IpAddr::V4(v4) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&v4.octets());
            (b, 4)
        }
        IpAddr::V6(v6) => (v6.octets(), 6),
    };
    let half = |i: usize| u64::from_be_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    [half(0), half(8), u64::from(addr.port()), family, 0]
}

/// The table of `size` entries (a prime) for `members`.
#[must_use]
pub fn table(members: &[Member], size: u32) -> Vec<u32> {
    let m = size as usize;
    let mut table = vec![EMPTY; m];
    let mut ms: Vec<&Member> = members
        .iter()
        .filter(|b| b.weight > 0.0 && b.weight.is_finite())
        .collect();
    if ms.is_empty() || m == 0 {
        return table;
    }
    ms.sort_by_key(|b| b.addr);
    ms.dedup_by_key(|b| b.addr);
    let top = ms.iter().map(|b| b.weight).fold(0.0, f64::max);
    // Per backend: offset, skip, how far along its permutation it is, and
    // its turns not yet taken.
    let mut walk: Vec<(u64, u64, u64, f64)> = ms
        .iter()
        .map(|b| {
            let w = words(b.addr);
            let offset = hash_words(&w, MAGLEV_TABLE_SEED) % size as u64;
            let skip = hash_words(&w, MAGLEV_TABLE_SEED ^ 0x5a5a) % (size as u64 - 1) + 1;
            (offset, skip, 0, 0.0)
        })
        .collect();
    let mut filled = 0;
    while filled < m {
        for (i, b) in ms.iter().enumerate() {
            let w = &mut walk[i];
            w.3 += b.weight / top;
            while w.3 >= 1.0 - 1e-9 && filled < m {
                w.3 -= 1.0;
                loop {
                    let slot = ((w.0 + w.2 * w.1) % size as u64) as usize;
                    w.2 += 1;
                    if table[slot] == EMPTY {
                        table[slot] = b.id;
                        filled += 1;
                        break;
                    }
                }
            }
        }
    }
    table
}

/// The entry a flow takes in a table of `size` entries indexed with
/// `seed` (`KernelConfig::maglev_seed`): the kernel's index, computed the
/// same way.
#[must_use]
pub fn slot_of(flow: &FlowKey, size: u32, seed: u64) -> usize {
    (flow.hash(seed) % u64::from(size)) as usize
}

/// Entries that differ between two tables of the same size.
#[must_use]
pub fn changed(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;
    use std::collections::HashMap;

    const M: u32 = huddle_common::DEFAULT_MAGLEV_SIZE;

    fn members(n: u32, weight: impl Fn(u32) -> f64) -> Vec<Member> {
        (0..n)
            .map(|i| Member {
                id: i,
                addr: SocketAddr::from(([10, 1, (i / 250) as u8, (i % 250) as u8 + 1], 8080)),
                weight: weight(i),
            })
            .collect()
    }

    fn shares(t: &[u32]) -> HashMap<u32, usize> {
        let mut s = HashMap::new();
        for id in t {
            *s.entry(*id).or_default() += 1;
        }
        s
    }

    #[test]
    fn primes_are_told_apart() {
        assert!(
            huddle_common::is_prime(65_537)
                && huddle_common::is_prime(251)
                && huddle_common::is_prime(131_071)
                && huddle_common::is_prime(2)
        );
        assert!(
            !huddle_common::is_prime(65_536)
                && !huddle_common::is_prime(1)
                && !huddle_common::is_prime(0)
                && !huddle_common::is_prime(65_535)
        );
    }

    #[test]
    fn equal_weights_share_the_table_within_one_entry() {
        for n in [1, 2, 3, 7, 16, 100] {
            let t = table(&members(n, |_| 1.0), M);
            let s = shares(&t);
            assert_eq!(s.len(), n as usize);
            let (lo, hi) = (s.values().min().unwrap(), s.values().max().unwrap());
            assert!(hi - lo <= 1, "{n} backends: {lo}..{hi}");
        }
    }

    #[test]
    fn weights_set_the_shares_within_half_a_percent() {
        let t = table(&members(3, |i| f64::from(i + 1)), M);
        let s = shares(&t);
        for i in 0..3u32 {
            let want = f64::from(i + 1) / 6.0;
            let got = s[&i] as f64 / f64::from(M);
            assert!(
                (got - want).abs() < 0.005,
                "backend {i}: {got} of the table, want {want}"
            );
        }
        let zero = table(&members(3, |i| if i == 1 { 0.0 } else { 1.0 }), M);
        assert!(!zero.contains(&1), "a weight of 0 takes no entry");
        assert!(table(&[], M).iter().all(|e| *e == EMPTY));
    }

    /// At the default size, equal weights: one backend of N leaving moves
    /// its 1/N of the entries and, measured, at most 0.6% more.
    #[test]
    fn one_of_n_leaving_moves_about_one_nth_at_the_default_size() {
        for n in [2, 3, 4, 8, 16, 50] {
            let all = members(n, |_| 1.0);
            let before = table(&all, M);
            for gone in [0, n / 2, n - 1] {
                let rest: Vec<Member> = all.iter().filter(|m| m.id != gone).copied().collect();
                let moved = changed(&before, &table(&rest, M)) as f64 / f64::from(M);
                println!("{n} backends, backend {gone} leaves: {:.2}% of the entries move (1/N = {:.2}%)", moved * 100.0, 100.0 / f64::from(n));
                assert!(moved - 1.0 / f64::from(n) < 0.006, "{n} backends: {moved}");
            }
        }
    }

    #[test]
    fn the_table_depends_on_addresses_not_ids_or_order() {
        let a = members(5, |_| 1.0);
        let mut b = a.clone();
        b.reverse();
        assert_eq!(table(&a, M), table(&b, M));
        // Ids numbered otherwise: the same backend at every entry.
        let renumbered: Vec<Member> = a
            .iter()
            .map(|m| Member {
                id: m.id + 40,
                ..*m
            })
            .collect();
        let (ta, tr) = (table(&a, M), table(&renumbered, M));
        assert!(ta.iter().zip(&tr).all(|(x, y)| x + 40 == *y));
    }

    /// Property test: 200 seeded random rings of 2..=64 backends with
    /// weights 1..=4 in a table of 8,191; one backend leaves, then
    /// returns. Measured: the entries that change when one of N leaves are
    /// its own share plus at most 2.1% of the table (bound 2.5%); every
    /// backend's share is within 3% of the table of its weighted one.
    #[test]
    fn one_backend_leaving_or_returning_moves_little_more_than_its_share() {
        let mut rng = Rng(0x6d61_676c_6576);
        let mut worst_extra = 0.0f64;
        for case in 0..200 {
            let n = 2 + (rng.next() % 63) as u32;
            let weights: Vec<f64> = (0..n).map(|_| 1.0 + (rng.next() % 4) as f64).collect();
            let all = members(n, |i| weights[i as usize]);
            // A smaller prime keeps 200 cases fast; still 100x the backends.
            let size = 8191;
            let before = table(&all, size);
            let total: f64 = weights.iter().sum();
            let s = shares(&before);
            for (i, w) in weights.iter().enumerate() {
                let got = s[&(i as u32)] as f64 / f64::from(size);
                assert!(
                    (got - w / total).abs() < 0.03,
                    "case {case}: backend {i} has {got}, weight share {}",
                    w / total
                );
            }
            let gone = (rng.next() % u64::from(n)) as usize;
            let rest: Vec<Member> = all
                .iter()
                .filter(|m| m.id != gone as u32)
                .copied()
                .collect();
            let after = table(&rest, size);
            let moved = changed(&before, &after);
            let own = s[&(gone as u32)];
            let extra = (moved - own) as f64 / f64::from(size);
            worst_extra = worst_extra.max(extra);
            assert!(
                extra < 0.025,
                "case {case}: {n} backends, {moved} entries moved, {own} were the leaver's"
            );
            assert_eq!(table(&all, size), before, "returning restores the table");
        }
        println!(
            "worst extra disruption: {:.3}% of the table",
            worst_extra * 100.0
        );
    }
}
