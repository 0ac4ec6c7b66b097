//! The backend agent's programs (`huddle agent --decap`): loaded from the
//! embedded object, told this host's addresses and its DSR VIPs, attached
//! to the backend's interface (XDP on ingress: decap and request arrival;
//! TC on egress: first answer byte) for as long as the agent runs.

use crate::kernel::dataplane::keys::ip_bytes;
use crate::{
    config::{IpPrefix, XdpMode},
    kernel::object,
};
use anyhow::{Context, Result};
use aya::{
    maps::{
        lpm_trie::{Key, LpmTrie},
        HashMap, MapData, PerCpuArray,
    },
    programs::{tc, xdp::XdpLinkId, SchedClassifier, TcAttachType, Xdp},
    Ebpf,
};
use huddle_common::{decap, Addr, AgentTtfb, Counters, DecapStats};
use std::{collections::HashSet, net::IpAddr};
use tracing::warn;

/// Makes the address set `map` hold exactly `addrs`.
fn sync(map: &mut HashMap<MapData, Addr, u32>, addrs: &[IpAddr]) -> Result<()> {
    let want: HashSet<Addr> = addrs.iter().map(|a| ip_bytes(*a)).collect();
    let have: Vec<Addr> = map.keys().filter_map(Result::ok).collect();
    for k in have.iter().filter(|k| !want.contains(*k)) {
        map.remove(k)?;
    }
    for k in want.iter().filter(|k| !have.contains(k)) {
        map.insert(k, 1, 0)?;
    }
    Ok(())
}

pub struct Decap {
    ebpf: Ebpf,
    local: HashMap<MapData, Addr, u32>,
    allow4: LpmTrie<MapData, [u8; 4], u32>,
    allow6: LpmTrie<MapData, [u8; 16], u32>,
    inner: HashMap<MapData, Addr, u32>,
    stats: PerCpuArray<MapData, DecapStats>,
    vips_map: HashMap<MapData, Addr, u32>,
    ttfb: PerCpuArray<MapData, AgentTtfb>,
    /// The VIPs timed, in `AGENT_TTFB` index order.
    pub vips: Vec<IpAddr>,
    /// Inner destinations are only the VIPs set with `set_inner`, not
    /// this host's addresses as they come and go.
    pub vips_only: bool,
    link: Option<XdpLinkId>,
    /// The mode it was attached in: "native" or "generic".
    pub mode: &'static str,
}

impl Decap {
    /// Loads the program (not attached yet).
    pub fn load() -> Result<Decap> {
        let mut ebpf = Ebpf::load(object::DECAP).context("loading the decap object")?;
        let prog: &mut Xdp = ebpf
            .program_mut(decap::PROGRAM)
            .context("decap program missing from its object")?
            .try_into()?;
        prog.load()
            .context("the kernel verifier refused the decap program")?;
        let tc: &mut SchedClassifier = ebpf
            .program_mut(decap::TTFB_PROGRAM)
            .context("ttfb program missing from the decap object")?
            .try_into()?;
        tc.load()
            .context("the kernel verifier refused the ttfb program")?;
        let local = HashMap::try_from(ebpf.take_map(decap::LOCAL).context("DECAP_LOCAL")?)?;
        let allow4 = LpmTrie::try_from(ebpf.take_map(decap::ALLOW4).context("DECAP_ALLOW4")?)?;
        let allow6 = LpmTrie::try_from(ebpf.take_map(decap::ALLOW6).context("DECAP_ALLOW6")?)?;
        let inner = HashMap::try_from(ebpf.take_map(decap::INNER).context("DECAP_INNER")?)?;
        let stats = PerCpuArray::try_from(ebpf.take_map(decap::STATS).context("DECAP_STATS")?)?;
        let vips_map = HashMap::try_from(ebpf.take_map(decap::VIPS).context("AGENT_VIPS")?)?;
        let ttfb = PerCpuArray::try_from(ebpf.take_map(decap::TTFB).context("AGENT_TTFB")?)?;
        Ok(Decap {
            ebpf,
            local,
            allow4,
            allow6,
            inner,
            stats,
            vips_map,
            ttfb,
            vips: Vec::new(),
            vips_only: false,
            link: None,
            mode: "",
        })
    }

    /// Makes the program unwrap exactly the packets to `addrs`.
    pub fn set_local(&mut self, addrs: &[IpAddr]) -> Result<()> {
        sync(&mut self.local, addrs).context("updating DECAP_LOCAL")
    }

    /// This host's addresses, as they are now: the outer destinations to
    /// unwrap, and (unless `vips_only`) the inner ones allowed.
    pub fn set_addresses(&mut self, addrs: &[IpAddr]) -> Result<()> {
        self.set_local(addrs)?;
        if !self.vips_only {
            self.set_inner(addrs)?;
        }
        Ok(())
    }

    /// Unwraps only packets whose outer source lies in one of `prefixes`
    /// (the balancers'); IP-in-IP to this host from anywhere else is
    /// dropped. Set once, before attaching.
    pub fn set_allow(&mut self, prefixes: &[IpPrefix]) -> Result<()> {
        if prefixes.len() > decap::MAX_ALLOW as usize {
            anyhow::bail!("--allow: at most {} prefixes", decap::MAX_ALLOW);
        }
        for p in prefixes {
            let len = u32::from(p.len);
            match p.addr {
                IpAddr::V4(a) => self.allow4.insert(&Key::new(len, a.octets()), 1, 0),
                IpAddr::V6(a) => self.allow6.insert(&Key::new(len, a.octets()), 1, 0),
            }
            .with_context(|| format!("writing {p} to the decap allow list"))?;
        }
        Ok(())
    }

    /// Lets through only wrapped packets whose inner destination is one of
    /// `addrs` (the VIPs served here, or this host's addresses).
    pub fn set_inner(&mut self, addrs: &[IpAddr]) -> Result<()> {
        sync(&mut self.inner, addrs).context("updating DECAP_INNER")
    }

    /// Attaches to `ifindex`. Auto: native, else generic. The program only
    /// ever passes packets up, so native mode works on a veth too.
    pub fn attach(&mut self, ifindex: u32, mode: XdpMode) -> Result<&'static str> {
        use aya::programs::xdp::XdpMode as M;
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(decap::PROGRAM)
            .context("decap program missing")?
            .try_into()?;
        let (link, name) = match mode {
            XdpMode::Generic => (
                prog.attach_to_if_index(ifindex, M::Skb)
                    .context("attaching decap in generic mode")?,
                "generic",
            ),
            XdpMode::Native => (
                prog.attach_to_if_index(ifindex, M::Driver)
                    .context("attaching decap in native mode (try --xdp-mode generic)")?,
                "native",
            ),
            XdpMode::Auto => match prog.attach_to_if_index(ifindex, M::Driver) {
                Ok(l) => (l, "native"),
                Err(e) => {
                    warn!("native XDP refused for decap ({e}); generic mode");
                    (
                        prog.attach_to_if_index(ifindex, M::Skb)
                            .context("attaching decap in generic mode")?,
                        "generic",
                    )
                }
            },
        };
        self.link = Some(link);
        self.mode = name;
        Ok(name)
    }

    /// Times requests to `vips` (at most `MAX_VIPS`) from their arrival to
    /// their first answer byte leaving `iface`: the egress program goes on
    /// it (a clsact qdisc is added if there is none).
    pub fn time_vips(&mut self, iface: &str, vips: &[IpAddr]) -> Result<()> {
        if vips.len() > decap::MAX_VIPS as usize {
            anyhow::bail!("--vip: at most {} VIPs", decap::MAX_VIPS);
        }
        for (i, v) in vips.iter().enumerate() {
            self.vips_map
                .insert(ip_bytes(*v), i as u32, 0)
                .context("writing AGENT_VIPS")?;
        }
        self.vips = vips.to_vec();
        // Already there (another program's, or an earlier agent's): fine.
        let _ = tc::qdisc_add_clsact(iface);
        let prog: &mut SchedClassifier = self
            .ebpf
            .program_mut(decap::TTFB_PROGRAM)
            .context("ttfb program missing")?
            .try_into()?;
        prog.attach(iface, TcAttachType::Egress)
            .with_context(|| format!("attaching the ttfb program to {iface} egress"))?;
        Ok(())
    }

    /// Time-to-first-byte samples of VIP index `i`, summed over CPUs.
    pub fn ttfb(&self, i: u32) -> Result<AgentTtfb> {
        let mut total = AgentTtfb::default();
        for v in self.ttfb.get(&i, 0)?.iter() {
            total.sum_ns = total.sum_ns.wrapping_add(v.sum_ns);
            total.count = total.count.wrapping_add(v.count);
            for (t, x) in total.hist.buckets.iter_mut().zip(v.hist.buckets.iter()) {
                *t = t.wrapping_add(*x);
            }
        }
        Ok(total)
    }

    /// Counters summed over CPUs.
    pub fn stats(&self) -> Result<DecapStats> {
        let mut total = DecapStats::default();
        for v in self.stats.get(&0, 0)?.iter() {
            total.accumulate(v);
        }
        Ok(total)
    }

    /// The loaded program (for BPF_PROG_TEST_RUN).
    pub fn program(&self) -> Result<&Xdp> {
        Ok(self
            .ebpf
            .program(decap::PROGRAM)
            .context("decap program missing")?
            .try_into()?)
    }
}
