//! The old build's per-CPU counters carried by name into this build's:
//! once at the copy, then what they grew by until the swap (the old
//! program counts on between the two, and a connection it opened there
//! and the new one closes would otherwise count as closed, never opened).

use super::tally::Tally;
use crate::kernel::rawmap::{pod_bytes as bytes, read_pod as from_bytes, RawMap, ANY};
use anyhow::Result;
use huddle_common::Counters;
use std::collections::HashMap;

/// Each counter map's old values (key -> every CPU's record) as the copy
/// read them.
#[derive(Default)]
pub(super) struct Counted {
    /// Set once the copy is made: `carry` adds growth, not values.
    after: bool,
    read: HashMap<&'static str, HashMap<Vec<u8>, Vec<u8>>>,
}

impl Counted {
    /// From now on `carry` adds what grew since the copy.
    pub(super) fn swapped(&mut self) {
        self.after = true;
    }

    /// `src` (old, counters `names` in its layout order) into `dst`
    /// (`T`'s): copied, or (after the swap) grown by what `src` counted
    /// since the copy. A record the new program writes between this read
    /// and write loses those counts: one map update, microseconds.
    pub(super) fn carry<T: Counters + aya::Pod>(
        &mut self,
        name: &'static str,
        (src, dst): (&RawMap, &RawMap),
        names: &[&str],
        tally: &mut Tally,
    ) -> Result<()> {
        let mut order = Vec::new();
        T::default().for_each(|n, _| order.push(n));
        let at: Vec<Option<usize>> = names
            .iter()
            .map(|n| order.iter().position(|o| o == n))
            .collect();
        let each = src.value_size.next_multiple_of(8);
        let cpus = |v: &[u8]| -> Option<Vec<T>> {
            v.chunks(each)
                .map(|cpu| {
                    let mut vals = vec![0u64; order.len()];
                    for (i, slot) in at.iter().enumerate() {
                        if let (Some(j), Some(b)) = (slot, cpu.get(i * 8..i * 8 + 8)) {
                            vals[*j] = u64::from_ne_bytes(b.try_into().ok()?);
                        }
                    }
                    T::from_values(&vals)
                })
                .collect()
        };
        let entries = src.entries()?;
        let then = self.read.entry(name).or_default();
        for (key, v) in entries.iter() {
            if src.array && u32::from_ne_bytes(key[..4].try_into()?) >= dst.max_entries {
                tally.drop("counters", 1);
                continue;
            }
            if !self.after {
                then.insert(key.to_vec(), v.to_vec());
                if src.array && v.iter().all(|b| *b == 0) {
                    continue;
                }
            }
            let Some(now) = cpus(v) else {
                tally.drop("counters", 1);
                continue;
            };
            let out: Vec<T> = if self.after {
                let before = match then.get(key) {
                    Some(b) => cpus(b).unwrap_or_default(),
                    None => Vec::new(),
                };
                let grew: Vec<T> = now
                    .iter()
                    .enumerate()
                    .map(|(i, n)| n.checked_sub(before.get(i).unwrap_or(&T::default())))
                    .collect::<Option<_>>()
                    .unwrap_or_default();
                if grew.iter().all(|g| bytes(g).iter().all(|b| *b == 0)) {
                    continue;
                }
                let Some(cur) = dst.get(key)? else { continue };
                cur.chunks(size_of::<T>().next_multiple_of(8))
                    .zip(&grew)
                    .map(|(c, g)| {
                        let mut t: T = from_bytes(&c[..size_of::<T>()]);
                        t.accumulate(g);
                        t
                    })
                    .collect()
            } else {
                now
            };
            let mut value = Vec::with_capacity(dst.value_len);
            for t in &out {
                value.extend_from_slice(&bytes(t));
            }
            if value.len() != dst.value_len {
                tally.drop("counters", 1);
                continue;
            }
            match dst.put(key, &value, ANY) {
                Ok(true) => tally.carry(
                    if self.after {
                        "counts since the copy"
                    } else {
                        "counters"
                    },
                    1,
                ),
                Ok(false) => {}
                Err(_) => tally.drop("counters", 1),
            }
        }
        Ok(())
    }
}
