//! Attaching the program to the interface (or into the pinned link of a
//! running data plane, in one step), and detaching it.

use super::*;
use crate::config::XdpMode;
use anyhow::{bail, Context, Result};
use aya::programs::{
    links::{FdLink, PinnedLink},
    xdp::XdpLink,
    Xdp,
};
use huddle_common::{config_flags, PROGRAM_NAME};
use std::path::Path;
use tracing::{info, warn};

impl Dataplane {
    /// Attaches to `ifindex` in the requested mode. With pins, an adopted
    /// link gets the new program atomically (traffic never stops), and a
    /// new link is pinned so the program outlives the daemon.
    pub fn attach(&mut self, ifindex: u32, mode: XdpMode) -> Result<AttachedMode> {
        let attached = self.attach_program(ifindex, mode)?;
        // An adopted link kept its mode: the interface says which.
        let generic = match attached {
            AttachedMode::Generic => true,
            AttachedMode::Native => false,
            AttachedMode::Adopted => crate::sys::link::query(ifindex, None)
                .map(|l| l.xdp_generic)
                .unwrap_or(false),
        };
        self.set_flag(config_flags::SKB_MODE, generic)?;
        // The new program runs: a migration copies what the old one made
        // since, then unpins the old maps.
        if let Some(m) = self.attach.migration.take() {
            m.finish().context("ending the migration")?;
            self.set_migrating(false)?;
        }
        Ok(attached)
    }

    /// Sets or clears `config_flags::MIGRATING` (public for the frames
    /// tests, which have no older data plane to migrate).
    pub fn set_migrating(&mut self, on: bool) -> Result<()> {
        self.set_flag(config_flags::MIGRATING, on)
    }

    /// Sets or clears one of `config_flags` in the program's config.
    fn set_flag(&mut self, flag: u16, on: bool) -> Result<()> {
        if on {
            self.settings.kernel_config.flags |= flag;
        } else {
            self.settings.kernel_config.flags &= !flag;
        }
        self.write_config()
    }

    fn attach_program(&mut self, ifindex: u32, mode: XdpMode) -> Result<AttachedMode> {
        let link_pin = self.attach.pins.as_ref().map(|d| d.join(LINK_PIN));
        if let Some(pin) = link_pin.as_ref().filter(|p| p.exists()) {
            match self.adopt_link(pin) {
                Ok(()) => {
                    self.attach.mode = Some(AttachedMode::Adopted);
                    return Ok(AttachedMode::Adopted);
                }
                Err(e) => {
                    warn!(
                        "the pinned XDP link {} cannot be taken over ({e:#}); attaching afresh",
                        pin.display()
                    );
                    let _ = std::fs::remove_file(pin);
                }
            }
        }
        let auto_reason = (mode == XdpMode::Auto)
            .then(|| auto_generic_reason(ifindex))
            .flatten();
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(PROGRAM_NAME)
            .context("program missing")?
            .try_into()?;
        let (link, mode) = match mode {
            XdpMode::Generic => (
                prog.attach_to_if_index(ifindex, aya::programs::xdp::XdpMode::Skb)
                    .context("attaching in generic mode")?,
                AttachedMode::Generic,
            ),
            XdpMode::Native => (
                prog.attach_to_if_index(ifindex, aya::programs::xdp::XdpMode::Driver)
                    .context("attaching in native mode (try --xdp-mode generic)")?,
                AttachedMode::Native,
            ),
            XdpMode::Auto => match &auto_reason {
                Some(why) => {
                    info!("{why}");
                    (
                        prog.attach_to_if_index(ifindex, aya::programs::xdp::XdpMode::Skb)
                            .context("attaching in generic mode")?,
                        AttachedMode::Generic,
                    )
                }
                None => {
                    match prog.attach_to_if_index(ifindex, aya::programs::xdp::XdpMode::Driver) {
                        Ok(link) => (link, AttachedMode::Native),
                        Err(e) => {
                            warn!("native XDP refused ({e}); falling back to generic mode, which is slower");
                            (
                                prog.attach_to_if_index(ifindex, aya::programs::xdp::XdpMode::Skb)
                                    .context("attaching in generic mode")?,
                                AttachedMode::Generic,
                            )
                        }
                    }
                }
            },
        };
        if let Some(pin) = link_pin {
            let owned = prog.take_link(link).context("taking the XDP link")?;
            match FdLink::try_from(owned) {
                Ok(fd) => {
                    self.attach.pinned_link = Some(
                        fd.pin(&pin)
                            .with_context(|| format!("pinning the XDP link at {}", pin.display()))?,
                    );
                }
                Err(e) => bail!("the kernel gave a netlink XDP attachment, which cannot be pinned ({e}); run with pins off"),
            }
        } else {
            self.attach.link = Some(link);
        }
        self.attach.mode = Some(mode);
        self.attach.mode_note = auto_reason;
        Ok(mode)
    }

    /// Detaches an unpinned attachment (pinned ones go with `unpin`).
    pub fn detach(&mut self) -> Result<()> {
        if let Some(link) = self.attach.link.take() {
            let prog: &mut Xdp = self
                .ebpf
                .program_mut(PROGRAM_NAME)
                .context("program missing")?
                .try_into()?;
            prog.detach(link).context("detaching the XDP program")?;
        }
        self.attach.mode = None;
        Ok(())
    }

    /// Puts this program into the pinned link at `pin`, replacing the old
    /// program in one step.
    pub(super) fn adopt_link(&mut self, pin: &Path) -> Result<()> {
        let fd: FdLink = PinnedLink::from_pin(pin)?.into();
        let link = XdpLink::try_from(fd).context("the pinned link is not an XDP link")?;
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(PROGRAM_NAME)
            .context("program missing")?
            .try_into()?;
        self.attach.link = Some(
            prog.attach_to_link(link)
                .context("replacing the program in the pinned link")?,
        );
        Ok(())
    }
}

/// Why `auto` mode must not attach natively to `ifindex`, if it must not:
/// a veth whose peer runs no XDP program drops every frame sent back with
/// XDP_TX (the kernel counts it and moves on), so native mode forwards
/// nothing there. Generic mode works on any veth.
pub(super) fn auto_generic_reason(ifindex: u32) -> Option<String> {
    use crate::sys::link::Peer;
    let peer = match crate::sys::link::veth_peer(ifindex) {
        Ok(Peer::VethXdp) => {
            info!(
                "the interface is a veth whose peer runs an XDP program: native mode (checksums a sender left to offload are finished by the program: `csum_finished` in `huddle status`)"
            );
            return None;
        }
        Ok(Peer::NotVeth) => return None,
        Ok(Peer::VethNoXdp) => "runs no XDP program",
        Ok(Peer::VethUnknown) => "cannot be checked for an XDP program",
        Err(e) => {
            warn!("cannot tell what kind of link this is ({e:#}); trying native mode");
            return None;
        }
    };
    Some(format!(
        "xdp mode auto: generic, because the interface is a veth whose peer {peer}, and native XDP_TX on a veth is lost unless the peer runs one; for native mode attach an XDP program to the peer and pass --xdp-mode native"
    ))
}
