//! What kind of link the program attaches to, asked of the kernel over
//! rtnetlink (not /sys, which under a network-namespace switch without
//! `ip netns exec` still shows the host's interfaces).
//!
//! Only one question matters today: is it a veth, and does its peer run an
//! XDP program? Native XDP_TX on a veth reaches the peer only when the peer
//! runs XDP (otherwise the frame is counted and dropped), so `auto` mode
//! picks generic mode there.

use anyhow::{bail, Context, Result};
use std::{io, mem::size_of, os::fd::AsRawFd, os::fd::FromRawFd, os::fd::OwnedFd};

const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const IFLA_LINK: u16 = 5;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_LINK_NETNSID: u16 = 37;
const IFLA_XDP: u16 = 43;
const IFLA_XDP_ATTACHED: u16 = 2;
const IFLA_XDP_PROG_ID: u16 = 4;
/// `IFLA_XDP_ATTACHED`'s value for a program attached in generic mode.
const XDP_ATTACHED_SKB: u8 = 2;
const IFLA_TARGET_NETNSID: u16 = 46;
/// Attribute type bits that are flags (nested, byte order), not the type.
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLMSG_HDR: usize = 16;
const IFINFOMSG: usize = 16;

/// The few facts about a link that attaching needs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    /// `IFLA_INFO_KIND`, e.g. "veth", "bridge"; empty for plain NICs.
    pub kind: String,
    /// An XDP program is attached (any mode).
    pub xdp: bool,
    /// It is attached in generic (skb) mode only (`XDP_ATTACHED_SKB`).
    pub xdp_generic: bool,
    /// Id of the attached XDP program, when there is one.
    pub xdp_prog: Option<u32>,
    /// The peer's (or lower device's) ifindex, in `link_netnsid`'s namespace.
    pub link: Option<u32>,
    /// Namespace id of the peer, when it lives in another namespace.
    pub link_netnsid: Option<i32>,
}

impl LinkInfo {
    #[must_use]
    pub fn is_veth(&self) -> bool {
        self.kind == "veth"
    }
}

/// The link `ifindex` of this namespace (`netnsid: None`) or of the
/// namespace with that id as seen from this one.
pub fn query(ifindex: u32, netnsid: Option<i32>) -> Result<LinkInfo> {
    // SAFETY: plain socket call; the fd is owned at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error()).context("opening an rtnetlink socket");
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = Vec::with_capacity(40);
    let len = NLMSG_HDR + IFINFOMSG + if netnsid.is_some() { 8 } else { 0 };
    req.extend_from_slice(&(len as u32).to_ne_bytes());
    req.extend_from_slice(&RTM_GETLINK.to_ne_bytes());
    req.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    req.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    req.extend_from_slice(&[0u8; 4]); // family, pad, type
    req.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    req.extend_from_slice(&[0u8; 8]); // flags, change
    if let Some(id) = netnsid {
        req.extend_from_slice(&8u16.to_ne_bytes());
        req.extend_from_slice(&IFLA_TARGET_NETNSID.to_ne_bytes());
        req.extend_from_slice(&id.to_ne_bytes());
    }
    // SAFETY: sending our own buffer on our own socket (to the kernel: a
    // zeroed sockaddr_nl is pid 0).
    let sent = unsafe {
        let mut to: libc::sockaddr_nl = std::mem::zeroed();
        to.nl_family = libc::AF_NETLINK as u16;
        libc::sendto(
            sock.as_raw_fd(),
            req.as_ptr().cast(),
            req.len(),
            0,
            std::ptr::addr_of!(to).cast(),
            size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error()).context("asking rtnetlink for a link");
    }
    let mut buf = vec![0u8; 32 * 1024];
    // SAFETY: receiving into our own buffer.
    let got = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if got < 0 {
        return Err(io::Error::last_os_error()).context("reading rtnetlink's answer");
    }
    parse_reply(&buf[..got as usize])
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Walks the attributes in `b`, calling `f(type, payload)`.
fn attrs(mut b: &[u8], mut f: impl FnMut(u16, &[u8])) {
    while b.len() >= 4 {
        let len = usize::from(u16_at(b, 0).unwrap_or(0));
        let kind = u16_at(b, 2).unwrap_or(0) & NLA_TYPE_MASK;
        if len < 4 || len > b.len() {
            return;
        }
        f(kind, &b[4..len]);
        b = &b[((len + 3) & !3).min(b.len())..];
    }
}

fn parse_reply(msg: &[u8]) -> Result<LinkInfo> {
    let len = u32_at(msg, 0).context("short rtnetlink answer")? as usize;
    let kind = u16_at(msg, 4).context("short rtnetlink answer")?;
    if kind == NLMSG_ERROR {
        let errno = u32_at(msg, NLMSG_HDR).unwrap_or(0) as i32;
        bail!(
            "rtnetlink: {}",
            io::Error::from_raw_os_error(errno.checked_neg().unwrap_or(0))
        );
    }
    if kind != RTM_NEWLINK || len > msg.len() || len < NLMSG_HDR + IFINFOMSG {
        bail!("unexpected rtnetlink answer (type {kind}, {len} bytes)");
    }
    let mut info = LinkInfo::default();
    attrs(&msg[NLMSG_HDR + IFINFOMSG..len], |t, v| match t {
        IFLA_LINK => info.link = u32_at(v, 0),
        IFLA_LINK_NETNSID => info.link_netnsid = u32_at(v, 0).map(|x| x as i32),
        IFLA_LINKINFO => attrs(v, |t, v| {
            if t == IFLA_INFO_KIND {
                info.kind = String::from_utf8_lossy(v)
                    .trim_end_matches('\0')
                    .to_string();
            }
        }),
        IFLA_XDP => attrs(v, |t, v| {
            if t == IFLA_XDP_ATTACHED {
                info.xdp = v.first().is_some_and(|a| *a != 0);
                info.xdp_generic = v.first() == Some(&XDP_ATTACHED_SKB);
            } else if t == IFLA_XDP_PROG_ID {
                info.xdp_prog = u32_at(v, 0);
            }
        }),
        _ => {}
    });
    Ok(info)
}

/// What attaching natively to a link needs to know about its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// Not a veth: no peer to worry about.
    NotVeth,
    /// A veth whose peer runs an XDP program.
    VethXdp,
    /// A veth whose peer runs none.
    VethNoXdp,
    /// A veth whose peer cannot be asked about.
    VethUnknown,
}

/// For a veth: whether its peer runs an XDP program.
pub fn veth_peer(ifindex: u32) -> Result<Peer> {
    let me = query(ifindex, None)?;
    if !me.is_veth() {
        return Ok(Peer::NotVeth);
    }
    let Some(peer) = me.link.filter(|p| *p != 0) else {
        return Ok(Peer::VethUnknown);
    };
    Ok(match query(peer, me.link_netnsid) {
        Ok(p) if p.xdp => Peer::VethXdp,
        Ok(_) => Peer::VethNoXdp,
        Err(_) => Peer::VethUnknown,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_not_a_veth() {
        // Index 1 is loopback in every namespace.
        let lo = query(1, None).expect("rtnetlink answers about loopback");
        assert!(!lo.is_veth());
        assert_eq!(veth_peer(1).unwrap(), Peer::NotVeth);
    }

    #[test]
    fn a_missing_link_is_an_error() {
        assert!(query(u32::MAX >> 1, None).is_err());
    }

    #[test]
    fn truncated_answers_are_refused() {
        assert!(parse_reply(&[]).is_err());
        assert!(parse_reply(&[40, 0, 0, 0, 16, 0]).is_err());
    }
}
