//! The backend agent's decap program (`huddle agent --decap`): loaded from
//! the embedded object, told this host's addresses, attached to the
//! backend's interface for as long as the agent runs.

use crate::{config::XdpMode, object};
use anyhow::{Context, Result};
use aya::{
    maps::{HashMap, MapData, PerCpuArray},
    programs::{xdp::XdpLinkId, Xdp},
    Ebpf,
};
use huddle_common::{addr_v4, decap, Addr, Counters, DecapStats};
use std::{collections::HashSet, net::Ipv4Addr};
use tracing::warn;

pub struct Decap {
    ebpf: Ebpf,
    local: HashMap<MapData, Addr, u32>,
    stats: PerCpuArray<MapData, DecapStats>,
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
        let local = HashMap::try_from(ebpf.take_map(decap::LOCAL).context("DECAP_LOCAL")?)?;
        let stats = PerCpuArray::try_from(ebpf.take_map(decap::STATS).context("DECAP_STATS")?)?;
        Ok(Decap {
            ebpf,
            local,
            stats,
            link: None,
            mode: "",
        })
    }

    /// Makes the program unwrap exactly the packets to `addrs`.
    pub fn set_local(&mut self, addrs: &[Ipv4Addr]) -> Result<()> {
        let want: HashSet<Addr> = addrs.iter().map(|a| addr_v4(a.octets())).collect();
        let have: Vec<Addr> = self.local.keys().filter_map(Result::ok).collect();
        for k in have.iter().filter(|k| !want.contains(*k)) {
            self.local.remove(k).context("updating DECAP_LOCAL")?;
        }
        for k in want.iter().filter(|k| !have.contains(k)) {
            self.local.insert(k, 1, 0).context("updating DECAP_LOCAL")?;
        }
        Ok(())
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
