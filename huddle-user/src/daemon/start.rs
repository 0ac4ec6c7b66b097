//! Starting the balancer: where the pins go, the data plane loaded (or
//! taken over), programmed and attached, with nothing left behind if any
//! step fails; then the lines that say what started.

use super::{balancer::Balancer, balancer::Reloader, preflight::HostFacts};
use crate::{
    config::Config,
    huddle::state::{self, Saved},
    kernel::dataplane::{self, Dataplane},
    sys::{pins::PinPlace, sysctls::Sysctls},
};
use anyhow::{Context, Result};
use std::path::PathBuf;
use tracing::info;

/// Where the data plane is pinned and what starting it changed on the
/// host: what the shutdown needs.
pub(super) struct Pinned {
    pub sysctls: Sysctls,
    /// Where the pins really are, and whether they outlive this process.
    pub place: PinPlace,
    pub pins: PathBuf,
    /// The pin folder as configured, for messages.
    pub shown: PathBuf,
}

/// Loads or adopts the data plane, attaches it and says so.
pub(super) fn start(
    cfg: &Config,
    facts: &HostFacts,
    reloader: Option<Reloader>,
) -> Result<(Balancer, Pinned)> {
    let pins = cfg
        .pin_dir
        .clone()
        .unwrap_or_else(|| crate::sys::pins::default_pin_dir(&cfg.interface));
    let place = crate::sys::pins::pin_place(&pins)?;
    if let Some(n) = place.note.as_ref().filter(|_| place.survives) {
        info!("{n}");
    }
    if cfg.pin_dir.is_none() {
        tidy_default_pins(&place.dir, &cfg.interface);
    }
    let shown = pins.clone();
    let pins = place.dir.clone();
    let saved = state::load_ours(&cfg.state_file);
    // A start that fails must leave nothing behind: pins it created go.
    let existed = pins.join(huddle_common::maps::FLOWS).exists();
    let (balancer, sysctls, mode) = match attach(cfg, facts, &pins, saved.as_ref()) {
        Ok(s) => s,
        Err(e) => {
            if !existed {
                let _ = dataplane::unpin(&pins);
            }
            return Err(e);
        }
    };
    let adopted = balancer.dp.attach.adopted;
    if adopted {
        info!(
            "took over the running data plane on {} (pinned under {}): flows, NAT entries and counters carry on",
            cfg.interface,
            shown.display()
        );
    }
    info!(
        "attached to {} in {} mode; SNAT {}, NAT ports {} ({} new connections a second per backend before a tuple comes back within a TIME_WAIT: widen nat_ports or add snat_ips for more); control socket {}; pinned under {}",
        cfg.interface,
        mode.as_str(),
        facts
            .snat
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        cfg.nat_ports,
        cfg.nat_ports.sustainable_rate(facts.snat.len()),
        cfg.control_socket.display(),
        shown.display()
    );
    crate::sys::systemd::sd_notify(&format!(
        "READY=1\nSTATUS=attached to {} in {} mode",
        cfg.interface,
        mode.as_str()
    ));
    let mut balancer = balancer;
    if let Some(n) = place.note.clone().filter(|_| !place.survives) {
        balancer.seen.notes.push(n);
    }
    balancer.life.sysctl_originals = sysctls.saved.clone();
    balancer.life.reloader = reloader;
    balancer.save_state();
    log_settings(cfg);
    Ok((
        balancer,
        Pinned {
            sysctls,
            place,
            pins,
            shown,
        },
    ))
}

/// Under the default pin root: takes over this namespace's data plane if an
/// earlier build pinned it by inode number, and removes those of
/// namespaces that are gone, saying so.
fn tidy_default_pins(dir: &std::path::Path, iface: &str) {
    if dataplane::stale::claim_legacy(dir, iface) {
        info!(
            "moved this namespace's data plane to its cookie-named pin folder {}",
            dir.display()
        );
    }
    for gone in dir
        .parent()
        .map(dataplane::stale::remove)
        .unwrap_or_default()
    {
        info!(
            "removed {}/{}: pinned for a network namespace whose interface is gone",
            crate::sys::pins::PIN_ROOT,
            gone.file_name().unwrap_or_default().to_string_lossy()
        );
    }
}

/// The data plane loaded, programmed and attached, and the sysctls set.
fn attach(
    cfg: &Config,
    facts: &HostFacts,
    pins: &std::path::Path,
    saved: Option<&Saved>,
) -> Result<(Balancer, Sysctls, dataplane::AttachedMode)> {
    let resume = crate::kernel::dataplane::walk::load_nat_walk(
        &crate::kernel::dataplane::walk::nat_walk_file(&cfg.state_file),
    );
    let mut dp = Dataplane::load(cfg, &facts.snat, &facts.snat6, Some(pins), resume)?;
    let ipip6 = cfg
        .services
        .iter()
        .any(|s| s.mode == crate::config::Mode::DsrIpip && s.vip.is_ipv6());
    if ipip6 {
        let src = crate::sys::addresses::interface_ipv6(&cfg.interface)?.with_context(|| {
            format!(
                "interface {} has no global IPv6 address for the outer source of dsr-ipip IPv6 packets",
                cfg.interface
            )
        })?;
        dp.set_encap6(src)?;
    }
    let sysctls = crate::sys::sysctls::Sysctls::apply(
        &cfg.interface,
        saved
            .as_ref()
            .map(|s| s.sysctls.clone())
            .unwrap_or_default(),
        cfg.services.iter().any(|s| s.vip.is_ipv6()),
    )?;
    let mut balancer = Balancer::new(dp, cfg.clone(), saved);
    crate::sys::addresses::warm_neighbours(&balancer.backend_addrs());
    let mode = balancer.dp.attach(facts.ifindex, cfg.xdp_mode)?;
    Ok((balancer, sysctls, mode))
}

/// One line per service and one for the huddle's settings.
fn log_settings(cfg: &Config) {
    for r in &cfg.renamed {
        tracing::warn!(event = "config_renamed", "{r}");
    }
    for s in &cfg.services {
        let probe = if *s.probe == cfg.huddle.probe {
            String::new()
        } else {
            format!(", probed with {}", s.probe.describe())
        };
        info!(
            "service {} -> {} backends{probe}",
            s.name(),
            s.backends.len()
        );
    }
    let maglev = cfg
        .services
        .iter()
        .any(|s| s.selection == crate::config::Selection::Maglev);
    if maglev && cfg.maglev_key.is_none() && cfg.cluster.is_none() {
        info!("Maglev flows are hashed with this balancer's own secret seed: balancers behind one router must share a `maglev_key_file` (or a [cluster] key) to pick alike");
    }
    let h = &cfg.huddle;
    info!(
        "huddle: rotation {}, tick {:?}, heat {} cool {}, min inner {}, {} probes every {:?}",
        if h.rotation {
            "on"
        } else {
            "off (round robin)"
        },
        h.tick,
        h.rotation_params.heat,
        h.rotation_params.cool,
        h.rotation_params.min_inner,
        h.probe.describe(),
        h.probe.interval
    );
}
