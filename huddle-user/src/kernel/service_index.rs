//! `SERVICE_INDEX`: the IPv4 service table (`SERVICES`) laid out as
//! direct-mapped buckets of four entries, one cache line each. The program
//! then finds a packet's service with an array lookup and at most four
//! compares instead of a hash lookup, and traffic that is not ours misses
//! as cheaply, however many services there are. The bucket is a
//! multiply-shift hash of the key; the multiplier is searched for until no
//! bucket holds more than four keys.
//!
//! Measured (`huddle bench --services 4096`, net of the floor): with one
//! entry a slot in 2,048 slots no layout held 4,112 keys, and the hash
//! table's lookup made non-VIP packets 14.0 -> 29.7 ns and established
//! flows 72.8 -> 81.5 ns.

use huddle_common::{
    service_slot, ServiceBucket, ServiceEntry, ServiceKey, ServiceValue, SERVICE_INDEX_SLOTS,
};

/// Multipliers tried before giving up. With the most keys a balancer can
/// have (4,096 services and 16 SNAT addresses) a quarter of a key a
/// bucket on average: a bucket of five or more, on a random multiplier, is
/// one in 150,000, so most multipliers place them all.
const TRIES: usize = 256;

/// One half of the index, ready to write.
pub struct Placed {
    /// The multiplier that places every key in a bucket with room.
    pub mul: u64,
    /// `SERVICE_INDEX_SLOTS` buckets; empty entries all zero.
    pub slots: Vec<ServiceBucket>,
}

/// Places `entries` at most four to a bucket, or `None` if no multiplier
/// tried does (the program then keeps asking `SERVICES`).
#[must_use]
pub fn place(entries: &[(ServiceKey, ServiceValue)]) -> Option<Placed> {
    // The same key twice would be found first only: refused.
    let mut words: Vec<u64> = entries.iter().map(|(k, _)| k.word()).collect();
    words.sort_unstable();
    if words.windows(2).any(|w| w[0] == w[1]) {
        return None;
    }
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    (0..TRIES).find_map(|_| {
        let mul = splitmix(&mut state) | 1;
        let mut slots = vec![ServiceBucket::default(); SERVICE_INDEX_SLOTS as usize];
        for (key, value) in entries {
            let bucket = &mut slots[service_slot(key.word(), mul) as usize];
            let free = bucket.entries.iter_mut().find(|e| e.key.word() == 0)?;
            *free = ServiceEntry {
                key: *key,
                value: *value,
            };
        }
        Some(Placed { mul, slots })
    })
}

/// The next value of a SplitMix64 sequence: well-spread multipliers from
/// a fixed start, so a set of services always gets the same layout.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use huddle_common::{MAX_SERVICES, MAX_SNAT, SERVICE_KIND_SNAT, SERVICE_KIND_VIP};

    /// The most keys a balancer holds: `MAX_SERVICES` VIPs on neighbouring
    /// ports of one address (the keys most alike) and `MAX_SNAT` SNAT
    /// addresses in a row.
    fn full_table() -> Vec<(ServiceKey, ServiceValue)> {
        let vips = (0..MAX_SERVICES).map(|i| {
            let key = ServiceKey {
                addr: [10, 0, 0, 1],
                port_be: (8000 + i as u16).to_be(),
                proto: 6,
                kind: SERVICE_KIND_VIP,
            };
            (key, ServiceValue { id: i, mode: 0 })
        });
        let snat = (0..MAX_SNAT as u8).map(|i| {
            let key = ServiceKey {
                addr: [10, 0, 1, i],
                port_be: 0,
                proto: 0,
                kind: SERVICE_KIND_SNAT,
            };
            (
                key,
                ServiceValue {
                    id: u32::from(i),
                    mode: 0,
                },
            )
        });
        vips.chain(snat).collect()
    }

    #[test]
    fn every_key_of_a_full_table_is_found_in_its_own_slot() {
        let entries = full_table();
        let placed = place(&entries).expect("a full table places");
        for (key, value) in &entries {
            let bucket = placed.slots[service_slot(key.word(), placed.mul) as usize];
            let e = bucket
                .entries
                .iter()
                .find(|e| e.key == *key)
                .expect("in its bucket");
            assert_eq!(e.value, *value);
        }
        let used = placed
            .slots
            .iter()
            .flat_map(|b| b.entries.iter())
            .filter(|s| s.key.word() != 0)
            .count();
        assert_eq!(used, entries.len());
    }

    #[test]
    fn a_key_not_placed_meets_an_empty_slot_or_another_key() {
        let entries = full_table();
        let placed = place(&entries).expect("a full table places");
        let stranger = ServiceKey {
            addr: [10, 0, 0, 1],
            port_be: 60_000u16.to_be(),
            proto: 6,
            kind: SERVICE_KIND_VIP,
        };
        let bucket = placed.slots[service_slot(stranger.word(), placed.mul) as usize];
        assert!(bucket.entries.iter().all(|e| e.key != stranger));
    }

    #[test]
    fn the_same_services_get_the_same_layout_and_none_gives_an_empty_half() {
        let entries = full_table();
        assert_eq!(place(&entries).unwrap().mul, place(&entries).unwrap().mul);
        let empty = place(&[]).unwrap();
        assert!(empty
            .slots
            .iter()
            .flat_map(|b| b.entries.iter())
            .all(|s| s.key.word() == 0));
    }

    #[test]
    fn keys_that_cannot_be_separated_are_refused() {
        // The same key twice: the second would never be found.
        let (k, v) = full_table()[0];
        assert!(place(&[(k, v), (k, v)]).is_none());
    }
}
