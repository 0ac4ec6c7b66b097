//! Taking over a data plane an older build pinned, whose maps are laid out
//! otherwise: flows carry on across an upgrade that changes a layout.
//!
//! Each build writes its layout number (`LAYOUT_VERSION`) into `CONFIG`.
//! A start over a pinned data plane reads it: the same layout is adopted
//! as it is; an older one this build knows (`v1`: the previous release,
//! which recorded none) is migrated; any other is refused with what to do
//! and left running untouched.
//!
//! A migration moves the old pins into a folder of their own (`ASIDE`;
//! the old program runs on, holding its maps), lets the load make every
//! map afresh, copies what it can translate into them (services, backends,
//! rings, flows, NAT entries, half-open slots, counters, cursors, hints),
//! puts the new program into the pinned link in one step, copies the
//! flows the old program made meanwhile, and only then unpins the old
//! maps. Entries it cannot translate are counted and logged by kind.

mod counts;
mod tally;
mod v1;

use crate::kernel::rawmap::{RawMap, NOEXIST};
use anyhow::{anyhow, Context, Result};
use huddle_common::{maps, KernelConfig, LAYOUT_VERSION};
use std::path::{Path, PathBuf};
use tally::{line, Tally};
use tracing::info;

/// Where a migration keeps the old build's pins until the new program
/// runs (inside the pin folder; a crash leaves it for the next start).
pub const ASIDE: &str = "migrating";

/// What the start finds pinned.
pub(super) enum Found {
    /// Nothing, this build's layout, or a build that recorded none (one
    /// made between the previous release and this one): taken over as
    /// before, each map's layout checked.
    AsBefore,
    /// The previous release's layout (`v1`): migrated.
    Older,
    /// A migration whose copy was done, interrupted before it ended: the
    /// new maps are adopted and the migration finished.
    Finishing,
}

/// The layout of the data plane pinned in `dir`; an unknown one refused.
pub(super) fn inspect(dir: &Path) -> Result<Found> {
    let aside = dir.join(ASIDE);
    if aside.exists() {
        if recorded(dir)? == Some(LAYOUT_VERSION) {
            return Ok(Found::Finishing);
        }
        // Copied in part when it stopped: the new maps go, the copy is
        // made again from the old ones.
        for name in maps::ALL {
            let p = dir.join(name);
            if p.exists() {
                std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
            }
        }
        return Ok(Found::Older);
    }
    if !dir.join(maps::FLOWS).exists() {
        return Ok(Found::AsBefore);
    }
    match recorded(dir)? {
        Some(0 | LAYOUT_VERSION) => return Ok(Found::AsBefore),
        Some(n) => return Err(refuse(dir, &format!("layout {n}"))),
        None => {}
    }
    if v1::matches(dir)? {
        return Ok(Found::Older);
    }
    if !dir.join(maps::CONFIG).exists() {
        return Ok(Found::AsBefore);
    }
    Err(refuse(dir, "a layout it does not know"))
}

/// The one-line refusal of a data plane this build cannot take over.
fn refuse(dir: &Path, what: &str) -> anyhow::Error {
    anyhow!(
        "the data plane pinned under {} has {what}, which this build (layout {LAYOUT_VERSION}, migrating from layout {}) cannot take over; it was left running: start the build that pinned it again, or `huddle stop` (every flow drops) and start this one",
        dir.display(),
        v1::LAYOUT
    )
}

/// The layout number `CONFIG` in `dir` records: `None` if it is missing
/// or not this build's `KernelConfig` (an older build's).
fn recorded(dir: &Path) -> Result<Option<u32>> {
    let pin = dir.join(maps::CONFIG);
    if !pin.exists() {
        return Ok(None);
    }
    let config = RawMap::open(&pin)?;
    if config.value_size != size_of::<KernelConfig>() || config.key_size != 4 {
        return Ok(None);
    }
    let Some(v) = config.get(&0u32.to_ne_bytes())? else {
        return Ok(None);
    };
    let at = std::mem::offset_of!(KernelConfig, layout);
    Ok(Some(u32::from_ne_bytes(v[at..at + 4].try_into()?)))
}

/// Whether a migration carries the flow and NAT tables (see
/// `Migration::flows`).
fn carries_flows() -> bool {
    std::env::var("HUDDLE_MIGRATE_FLOWS").as_deref() != Ok("0")
}

/// Unpins what `ASIDE` in `dir` holds, and the folder: the end of a
/// migration, or of a data plane `huddle stop` removes mid-migration.
pub fn remove_aside(dir: &Path) -> Result<()> {
    let aside = dir.join(ASIDE);
    if !aside.exists() {
        return Ok(());
    }
    for name in maps::ALL {
        let p = aside.join(name);
        if p.exists() {
            std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
        }
    }
    std::fs::remove_dir(&aside).with_context(|| format!("removing {}", aside.display()))
}

/// A migration under way: the old pins set aside, the new maps made.
pub struct Migration {
    dir: PathBuf,
    /// Whether the copy is still to be made (not when finishing one).
    copy: bool,
    /// Whether the flow and NAT tables are carried: always, but for the
    /// upgrade test's control (`HUDDLE_MIGRATE_FLOWS=0`).
    flows: bool,
    /// The old `CONFIG` as this build's (seeds and generation carried).
    pub(super) old_config: Option<KernelConfig>,
    /// What the copy wrote: the pass after the swap writes only the rest.
    copied: v1::Copied,
    /// The old counters as the copy read them.
    counted: counts::Counted,
}

impl Migration {
    /// Sets the old build's pins in `dir` aside (see `ASIDE`).
    pub(super) fn begin(dir: &Path) -> Result<Migration> {
        let aside = dir.join(ASIDE);
        if !aside.exists() {
            std::fs::create_dir(&aside).with_context(|| format!("creating {}", aside.display()))?;
            for name in v1::MAPS {
                let p = dir.join(name);
                if p.exists() {
                    std::fs::rename(&p, aside.join(name))
                        .with_context(|| format!("setting {} aside", p.display()))?;
                }
            }
        }
        let old_config = v1::config(&aside)?;
        info!(
            "the data plane pinned under {} has layout {}: migrating it to layout {LAYOUT_VERSION}",
            dir.display(),
            v1::LAYOUT
        );
        Ok(Migration {
            dir: dir.to_path_buf(),
            copy: true,
            flows: carries_flows(),
            old_config,
            copied: v1::Copied::default(),
            counted: counts::Counted::default(),
        })
    }

    /// The end of a migration whose copy was made (see `Found::Finishing`).
    pub(super) fn finishing(dir: &Path) -> Migration {
        Migration {
            dir: dir.to_path_buf(),
            copy: false,
            flows: carries_flows(),
            old_config: None,
            copied: v1::Copied::default(),
            counted: counts::Counted::default(),
        }
    }

    /// Copies what the old maps hold into the new ones (pinned in the
    /// folder by the load, before its `CONFIG` records this layout).
    pub(super) fn copy(&mut self) -> Result<()> {
        if !self.copy {
            return Ok(());
        }
        let began = std::time::Instant::now();
        let mut tally = Tally::default();
        let flows = self.flows.then_some(&mut self.copied);
        let aside = self.dir.join(ASIDE);
        v1::copy(&aside, &self.dir, flows, &mut self.counted, &mut tally)?;
        info!(
            "migrated layout {} to {LAYOUT_VERSION} in {} ms: carried {}; not carried {}",
            v1::LAYOUT,
            began.elapsed().as_millis(),
            line(&tally.carried),
            line(&tally.dropped)
        );
        Ok(())
    }

    /// Once the new program runs: the flows and NAT entries the old one
    /// made since the copy and what its counters grew by, then the old
    /// pins unpinned (the old maps are
    /// freed with the old program).
    pub(super) fn finish(mut self) -> Result<()> {
        let aside = self.dir.join(ASIDE);
        let began = std::time::Instant::now();
        let mut tally = Tally::default();
        if self.flows {
            v1::copy_flows(&aside, &self.dir, NOEXIST, &mut tally, &mut self.copied)?;
        }
        if self.copy {
            self.counted.swapped();
            v1::counts(&aside, &self.dir, &mut self.counted, &mut tally)?;
        }
        if !tally.carried.is_empty() || !tally.dropped.is_empty() {
            info!(
                "after the swap, in {} ms: carried {}; not carried {}",
                began.elapsed().as_millis(),
                line(&tally.carried),
                line(&tally.dropped)
            );
        }
        remove_aside(&self.dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key and value sizes of every map of layout 2, as the embedded
    /// object declares them. A change here is a new layout: raise
    /// `LAYOUT_VERSION`, teach this module the step, then update this.
    const LAYOUT_2: &str = "\
SERVICES 8 8
SERVICES6 24 8
SERVICE_INDEX 4 64
TAILS 4 4
BACKENDS 4 24
RINGS 4 1032
RING_GEN 4 8
RR_CURSOR 4 4
FLOWS 40 32
NAT 40 48
CONFIG 4 368
BACKEND_STATS 4 208
SERVICE_STATS 4 88
GLOBAL_STATS 4 200
LATENCY 4 1024
LATENCY_HEAVY 4 1024
HEAVY 4 32
PULSE 4 32
HALF_OPEN 4 128
HALF_OPEN_NAT 4 96
HALF_OPEN_TAGS 4 64
HALF_OPEN_NAT_TAGS 4 64
NEXT_HOP 4 32
NAT_CURSOR 4 24
CONNECT 4 1024
TUNING 4 32
SWEPT 4 8
MAGLEV 4 8
TW_HINTS 40 16
TW_HINTS_UNTIL 4 8
GUARDED 16 1
GUARD_FILTER 4 131072
DSR_FLOWS 40 32
UDP_FLOWS 40 32
UDP_NAT 40 48
";

    #[test]
    fn the_maps_are_laid_out_as_layout_version_says() {
        let obj = aya_obj::Object::parse(crate::kernel::object::HUDDLE).unwrap();
        let mut have = String::new();
        for name in maps::ALL {
            if let Some(m) = obj.maps.get(name) {
                have += &format!("{name} {} {}\n", m.key_size(), m.value_size());
            }
        }
        assert_eq!(LAYOUT_VERSION, 2);
        assert_eq!(have, LAYOUT_2, "a map's layout changed:\n{have}");
    }

    #[test]
    fn layout_1_is_told_by_its_config_ring_and_pulse() {
        assert_eq!(v1::MAPS.len(), 28);
        assert!(v1::MAPS.iter().all(|m| maps::ALL.contains(m)));
        assert_eq!(
            std::mem::offset_of!(KernelConfig, maglev_seed),
            16 * 16 + 104
        );
    }
}
