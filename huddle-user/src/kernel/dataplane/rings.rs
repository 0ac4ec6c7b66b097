//! Rings and Maglev tables swapped in whole, and the per-backend and
//! per-service settings the program reads with them.

use super::*;
use crate::{config::Selection, kernel::maglev};
use anyhow::{bail, Context, Result};
use huddle_common::{ring_slot, Pulse, Ring, Tuning, RING_CAPACITY};
use std::{net::SocketAddr, time::Instant};

impl Dataplane {
    /// Replaces service `index`'s live ring with `backends` (backend ids)
    /// atomically: the idle slot is written whole, then the generation
    /// flips. Packets see the old ring or the new one, never a mix.
    pub fn swap_ring(&mut self, index: usize, backends: &[u32]) -> Result<()> {
        if backends.len() > RING_CAPACITY {
            bail!(
                "ring of {} backends exceeds {RING_CAPACITY}",
                backends.len()
            );
        }
        let slot = &self.services[index];
        if let Some(last) = slot.last_swap {
            let since = last.elapsed();
            if since < SLOT_REUSE_GUARD {
                std::thread::sleep(SLOT_REUSE_GUARD - since);
            }
        }
        let mut ring = Ring::EMPTY;
        ring.len = backends.len() as u32;
        ring.backends[..backends.len()].copy_from_slice(backends);
        if let Some(id) = backends.iter().find(|id| **id >= self.maps.limits.backends) {
            bail!("backend id {id} out of range");
        }
        let next = slot.generation + 1;
        if slot.service.selection == Selection::Maglev {
            let size = self.maps.limits.maglev_size;
            // Empty entries are `MAGLEV_EMPTY` already (`maglev::EMPTY`).
            let table = maglev::table(&members(slot, backends), size);
            let at = maglev_at(slot.maglev_base, next, size);
            self.maps
                .maglev
                .write(at, &table)
                .context("writing the idle Maglev table")?;
        }
        self.maps
            .rings
            .set(ring_slot(slot.id, next), ring, 0)
            .context("writing the idle ring slot")?;
        self.maps
            .ring_gen
            .set(slot.id, next, 0)
            .context("publishing the ring generation")?;
        let slot = &mut self.services[index];
        slot.generation = next;
        slot.ring = backends.to_vec();
        slot.last_swap = Some(Instant::now());
        Ok(())
    }

    /// Service `index`'s live Maglev table (empty for round robin).
    pub fn maglev_table(&self, index: usize) -> Result<Vec<u32>> {
        let slot = &self.services[index];
        if slot.service.selection != Selection::Maglev {
            return Ok(Vec::new());
        }
        let size = self.maps.limits.maglev_size;
        let at = maglev_at(slot.maglev_base, slot.generation, size);
        self.maps.maglev.read(at, size as usize)
    }

    /// The live Maglev tables of the DSR services, for `cluster::handoff` (a
    /// takeover needs the client's own address at the backend).
    pub fn maglev_tables(&self) -> Vec<MaglevTable> {
        (0..self.services.len())
            .filter_map(|i| {
                let slot = &self.services[i];
                if slot.service.mode == crate::config::Mode::Snat {
                    return None;
                }
                let entries = self.maglev_table(i).ok().filter(|t| !t.is_empty())?;
                Some(MaglevTable {
                    service: slot.id,
                    vip: slot.service.vip,
                    proto: slot.service.proto.number(),
                    entries,
                    backends: slot
                        .backend_ids
                        .iter()
                        .copied()
                        .zip(slot.service.backends.iter().copied())
                        .collect(),
                    seed: self.settings.kernel_config.maglev_seed,
                })
            })
            .collect()
    }

    /// Forgets what backend `id` owed: a probe showed it answers again.
    pub fn clear_pulse(&mut self, id: u32) -> Result<()> {
        Ok(self.stats.pulse.set(id, Pulse::default(), 0)?)
    }

    /// Sets how long a backend of service `id` may owe an answer before
    /// new flows pass it over.
    /// Writes service `id`'s pass-over limits; its selection (Maglev or
    /// two choices of the ring) is the service's own.
    pub fn set_tuning(&mut self, id: u32, mut t: Tuning) -> Result<()> {
        match self
            .services
            .iter()
            .find(|s| s.id == id && s.service.selection == Selection::Maglev)
        {
            Some(s) => {
                t.maglev_size = self.maps.limits.maglev_size;
                t.maglev_base = s.maglev_base;
                t.two_choices = 0;
            }
            None => (t.maglev_size, t.maglev_base) = (0, 0),
        }
        Ok(self.maps.tuning.set(id, t, 0)?)
    }

    /// Sets `huddle_common::backend_flags` on backend `id`. The address and
    /// port are rewritten with them: one element, replaced whole.
    pub fn set_backend_flags(&mut self, id: u32, addr: SocketAddr, flags: u8) -> Result<()> {
        let mut b = backend_value(addr);
        b.flags = flags;
        self.maps
            .backends_map
            .set(id, b, 0)
            .with_context(|| format!("writing backend {addr}"))
    }
}

/// The table members of `slot`'s ring `ring` (backend ids): each with
/// its address and weight.
pub(super) fn members(slot: &ServiceSlot, ring: &[u32]) -> Vec<maglev::Member> {
    ring.iter()
        .filter_map(|id| {
            let j = slot.backend_ids.iter().position(|b| b == id)?;
            Some(maglev::Member {
                id: *id,
                addr: slot.service.backends[j],
                weight: slot.service.options[j].weight,
            })
        })
        .collect()
}

/// Entry of `MAGLEV` where the table of generation `generation` of the
/// service whose tables start at `base` begins.
fn maglev_at(base: u32, generation: u64, size: u32) -> usize {
    base as usize + (generation & 1) as usize * size as usize
}
