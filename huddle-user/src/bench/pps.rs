//! Packets per second on a veth pair: our generator's established-flow
//! frames through the balancer and the baselines, in interleaved rounds.

use super::bounce::{self, Method};
use super::setup::*;
use crate::{
    config::{Config, XdpMode},
    kernel::object,
    kernel::packet::{checksums_valid, endpoints, ipip, Frame},
    kernel::prog_run::{mac_of, test_run, ProgRun, BALANCER_IP, BALANCER_MAC},
    sys::steal::CpuTimes,
};
use anyhow::{bail, Context, Result};
use aya::{
    maps::{Array, PerCpuArray},
    programs::xdp::XdpMode as Mode,
    programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp},
    Ebpf,
};
use huddle_common::{addr_v4, FlowKey, FlowValue, GenConfig, GenNat, FAMILY_V4, GEN_FRAME};
use std::{net::Ipv4Addr, time::Duration};

/// The one's-complement change of a checksum over `was` when those bytes
/// become `now`, summed as the program reads them (native-order words).
fn csum_diff(was: &[u8], now: &[u8]) -> u32 {
    let words = |b: &[u8]| -> Vec<u32> {
        b.chunks(2)
            .map(|w| u32::from(u16::from_ne_bytes([w[0], w[1]])))
            .collect()
    };
    words(was)
        .into_iter()
        .zip(words(now))
        .map(|(o, n)| (!o & 0xffff) + n)
        .sum()
}

/// Client ports the packets-per-second run spreads its frames over.
const PPS_FLOWS: u16 = 256;

const PPS_BASE_PORT: u16 = 30000;

/// The backend the bare forwarders send every flow to, its port, and
/// the first of the source ports they give the flows.
const BARE_BACKEND: Ipv4Addr = Ipv4Addr::new(10, 213, 1, 1);
const BARE_BACKEND_PORT: u16 = 8080;
const BARE_NAT_PORT: u16 = 20_000;

/// Packets per second forwarded on a veth pair, one core: a generator
/// (BPF_PROG_TEST_RUN live frames, or where the kernel refuses them,
/// frames circulating through a reflector: see `bounce`) sends
/// established-flow frames into the balancer's interface, the program
/// under test sends them back out, the peer counts them. Then the same
/// with the baselines in its place.
pub(super) fn pps(
    cpu: usize,
    (frames, pps_rounds): (u32, u32),
    cfg: &Config,
    neighbours: &[Ipv4Addr],
    client: Ipv4Addr,
    base: &mut Ebpf,
) -> Result<()> {
    // Two queues a veth end: the two-core run's streams each keep to one.
    let mut env = ProgRun::with_queues(
        &format!("huddle-pps-{}", std::process::id()),
        cfg,
        neighbours,
        2,
    )?;
    let peer = crate::sys::addresses::ifindex("hb1")?;
    // Establish the flows the frames belong to.
    for k in 0..PPS_FLOWS {
        handshake(&env, (client, PPS_BASE_PORT + k))?;
    }
    if env.dp.service_stats(0)?.promoted != u64::from(PPS_FLOWS) {
        bail!("could not establish the {PPS_FLOWS} flows of the packets-per-second run");
    }
    // The same clients' flows to the IP-in-IP DSR service: Katran's path.
    for k in 0..PPS_FLOWS {
        dsr_open(&env, (client, PPS_BASE_PORT + k), IPIP_PORT)?;
    }
    let mut gen = Generator::load(peer, env.ifindex, client, frames)?;
    gen.fill_lookup_table(client)?;
    gen.fill_nat_table(client)?;
    gen.check_bare(env.ifindex)?;
    let peer_program = gen.method.peer_program();
    let sink_link = xdp_of(&mut gen.obj, peer_program)?
        .attach_to_if_index(peer, Mode::Driver)
        .with_context(|| format!("attaching {peer_program} to the peer"))?;
    let stolen = CpuTimes::now(&[cpu]);
    let one = rounds(&mut env, &mut gen, base, &[cpu], pps_rounds)?;
    let stolen_one = stolen.map(|s| s.report("one core's rounds ran"));
    // The second core: the other of the first two.
    let two = [cpu, if cpu == 0 { 1 } else { 0 }];
    // Online CPUs, not this thread's affinity (pinned to one by now).
    let both = if crate::sys::host::online_cpus() >= 2 {
        let stolen = CpuTimes::now(&two);
        let both = rounds(&mut env, &mut gen, base, &two, pps_rounds)?;
        Some((both, stolen.map(|s| s.report("two cores' rounds ran"))))
    } else {
        None
    };
    xdp_of(&mut gen.obj, peer_program)?.detach(sink_link)?;
    report(cpu, (frames, pps_rounds), gen.method, &one);
    if let Some(s) = stolen_one {
        println!("{s}.");
    }
    if let Some((both, stolen)) = both {
        report_cores(
            two,
            (frames, pps_rounds),
            gen.method,
            medians(&one),
            medians(&both),
        );
        if let Some(s) = stolen {
            println!("{s}.");
        }
    }
    Ok(())
}

/// The live-frames generator and its sink, with the two extra baselines
/// (`lookup_tx`, `nat_tx`) in the same object.
struct Generator {
    obj: Ebpf,
    /// The frame sent: one of `templates`.
    template: [u8; GEN_FRAME],
    /// To the source-NAT service, to the IP-in-IP DSR one.
    templates: [[u8; GEN_FRAME]; 2],
    /// struct xdp_md for the runs.
    ctx: [u8; 24],
    frames: u32,
    /// Where the frames are sent from (the interface under test's peer),
    /// and how.
    peer: u32,
    method: Method,
}

impl Generator {
    /// Loads the generator to send `frames` copies of `client`'s
    /// established-flow frame from `peer` into `ifindex`.
    fn load(peer: u32, ifindex: u32, client: Ipv4Addr, frames: u32) -> Result<Self> {
        let frame = |port: u16| {
            let mut tpl = Frame::tcp((client, PPS_BASE_PORT), (VIP, port))
                .seq_ack(1001, 5001)
                .payload(&[0x61; GEN_FRAME - 54])
                .macs(mac_of(client), BALANCER_MAC)
                .build();
            tpl.resize(GEN_FRAME, 0);
            let mut template = [0u8; GEN_FRAME];
            template.copy_from_slice(&tpl);
            template
        };
        let templates = [frame(80), frame(IPIP_PORT)];
        let obj = Ebpf::load(object::TRAFFICGEN).context("loading the packet generator")?;
        let mut gen = Self {
            obj,
            template: templates[0],
            templates,
            ctx: [0; 24],
            frames,
            peer,
            method: Method::Live,
        };
        gen.send(0)?;
        let obj = &mut gen.obj;
        Array::<_, GenConfig>::try_from(obj.map_mut("GEN_CONFIG").context("GEN_CONFIG")?)?.set(
            0,
            GenConfig {
                ifindex: peer,
                flows: u32::from(PPS_FLOWS),
                base_port: PPS_BASE_PORT,
                ..GenConfig::default()
            },
            0,
        )?;
        for name in ["gen", "sink", "bounce", "lookup_tx", "nat_tx", "ipip_tx"] {
            xdp_of(obj, name)?.load()?;
        }
        // struct xdp_md: data_end must be the frame's length, as in
        // `test_run`.
        gen.ctx[4..8].copy_from_slice(&(GEN_FRAME as u32).to_ne_bytes());
        gen.ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
        let prog: &Xdp = gen.obj.program("gen").context("gen")?.try_into()?;
        gen.method = Method::probe(prog, &gen.template, &gen.ctx)?;
        Ok(gen)
    }

    /// Sends `templates[which]` from now on.
    fn send(&mut self, which: usize) -> Result<()> {
        self.template = self.templates[which];
        Array::<_, [u8; GEN_FRAME]>::try_from(
            self.obj.map_mut("GEN_TEMPLATE").context("GEN_TEMPLATE")?,
        )?
        .set(0, self.template, 0)?;
        Ok(())
    }

    /// Frames the sink counted so far.
    fn counted(&mut self) -> Result<u64> {
        let m =
            PerCpuArray::<_, u64>::try_from(self.obj.map_mut("GEN_COUNT").context("GEN_COUNT")?)?;
        Ok(m.get(&1, 0)?.iter().sum())
    }

    /// One run: frames the sink counted per second, with `frames` sent
    /// from each CPU of `cpus` at once (a thread pinned to each).
    fn rate(&mut self, cpus: &[usize]) -> Result<f64> {
        if self.method == Method::Bounce {
            return bounce::rate(&mut self.obj, self.peer, &self.template, cpus, self.frames);
        }
        let before = self.counted()?;
        let gen: &Xdp = self.obj.program("gen").context("gen")?.try_into()?;
        let (template, ctx, frames) = (&self.template, &self.ctx, self.frames);
        let send = |cpu: usize| -> Result<()> {
            pin(cpu)?;
            let mut opts = TestRunOptions::new();
            opts.data_in = Some(template);
            opts.ctx_in = Some(ctx);
            opts.repeat = frames;
            opts.attrs = TestRunAttrs::new().xdp_live_frames(64);
            gen.test_run(opts)
                .context("BPF_PROG_TEST_RUN (live frames)")?;
            Ok(())
        };
        let t = std::time::Instant::now();
        std::thread::scope(|s| -> Result<()> {
            let runs: Vec<_> = cpus.iter().map(|&c| s.spawn(move || send(c))).collect();
            for r in runs {
                r.join()
                    .map_err(|_| anyhow::anyhow!("a generator thread panicked"))??;
            }
            Ok(())
        })?;
        std::thread::sleep(Duration::from_millis(20));
        let took = t.elapsed().saturating_sub(Duration::from_millis(20));
        let after = self.counted()?;
        Ok((after - before) as f64 / took.as_secs_f64())
    }

    /// The forwarder plus one lookup in a table of the balancer's flow
    /// table's type, key and size holding these flows: what that lookup
    /// alone costs in the cycle.
    fn fill_lookup_table(&mut self, client: Ipv4Addr) -> Result<()> {
        let mut flows = aya::maps::HashMap::<_, FlowKey, FlowValue>::try_from(
            self.obj.map_mut("GEN_FLOWS").context("GEN_FLOWS")?,
        )?;
        for k in 0..PPS_FLOWS {
            let key = FlowKey::new(
                &addr_v4(client.octets()),
                &addr_v4(VIP.octets()),
                (PPS_BASE_PORT + k).to_be(),
                80u16.to_be(),
                6,
                FAMILY_V4,
            );
            flows.insert(key, FlowValue::default(), 0)?;
        }
        Ok(())
    }

    /// The bare forwarders' frames for the first flow, checked against
    /// what the balancer sends: a baseline that did less would flatter
    /// the comparison.
    fn check_bare(&self, ifindex: u32) -> Result<()> {
        let frame = &self.templates[0];
        let run = |name: &str| -> Result<(u32, Vec<u8>)> {
            let prog: &Xdp = self
                .obj
                .program(name)
                .context("bare forwarder")?
                .try_into()?;
            let (verdict, out, _) = test_run(prog, frame, ifindex)?;
            Ok((verdict, out))
        };
        let (verdict, out) = run("nat_tx")?;
        let want = (
            (BALANCER_IP, BARE_NAT_PORT),
            (BARE_BACKEND, BARE_BACKEND_PORT),
        );
        if verdict != XDP_TX || !checksums_valid(&out) || endpoints(&out) != want {
            bail!("the bare NAT forwarder sent {out:02x?} (verdict {verdict}), not a valid frame to {want:?}");
        }
        let (verdict, out) = run("ipip_tx")?;
        let macs = (BALANCER_MAC, mac_of(BARE_BACKEND));
        if verdict != XDP_TX || out != ipip(frame, BALANCER_IP, BARE_BACKEND, macs) {
            bail!("the bare IP-in-IP forwarder sent {out:02x?} (verdict {verdict}), not the balancer's encapsulation");
        }
        Ok(())
    }

    /// The bare NAT forwarder's flows: each rewritten toward a backend, as
    /// the balancer does (see `nat_tx`).
    fn fill_nat_table(&mut self, client: Ipv4Addr) -> Result<()> {
        let mut nat = aya::maps::HashMap::<_, [u64; 2], GenNat>::try_from(
            self.obj.map_mut("GEN_NAT").context("GEN_NAT")?,
        )?;
        let backend = BARE_BACKEND;
        let was = [client.octets(), VIP.octets()].concat();
        let now = [BALANCER_IP.octets(), backend.octets()].concat();
        let ip_diff = csum_diff(&was, &now);
        let mut macs = [0; 12];
        macs[..6].copy_from_slice(&mac_of(backend));
        macs[6..].copy_from_slice(&BALANCER_MAC);
        let addrs_key = u64::from_le_bytes(was[..].try_into()?);
        for k in 0..PPS_FLOWS {
            let was_ports = [(PPS_BASE_PORT + k).to_be_bytes(), 80u16.to_be_bytes()].concat();
            let now_ports = [
                (BARE_NAT_PORT + k).to_be_bytes(),
                BARE_BACKEND_PORT.to_be_bytes(),
            ]
            .concat();
            let key = [
                addrs_key,
                u64::from(u32::from_le_bytes(was_ports[..].try_into()?)),
            ];
            let entry = GenNat {
                addrs: now[..].try_into()?,
                ports: now_ports[..].try_into()?,
                ip_diff,
                l4_diff: ip_diff + csum_diff(&was_ports, &now_ports),
                macs,
            };
            nat.insert(key, entry, 0)?;
        }
        Ok(())
    }
}

/// The programs timed, by their index in a round's rates: the balancer,
/// the baselines, the balancer's IP-in-IP DSR path, the bare IP-in-IP
/// forwarder.
const PROGRAMS: usize = 6;
const HUDDLE: usize = 0;
const MINIMAL: usize = 1;
const LOOKUP: usize = 2;
const BARE_NAT: usize = 3;
const HUDDLE_IPIP: usize = 4;
const BARE_IPIP: usize = 5;

/// The order of the programs in a round: each path right before its bare
/// forwarder, so that the ratio of the two in one round sees one spell of
/// the host (and the bare IP-in-IP forwarder right before the minimal one).
const ORDER: [usize; PROGRAMS] = [HUDDLE, BARE_NAT, HUDDLE_IPIP, BARE_IPIP, MINIMAL, LOOKUP];

/// Rounds of the six programs in turn, so that a slower spell of the host
/// (this is a virtual machine) falls on all of them; each round's rates:
/// huddle, minimal forwarder, forwarder + lookup, bare NAT forwarder,
/// huddle on IP-in-IP DSR flows, bare IP-in-IP forwarder.
fn rounds(
    env: &mut ProgRun,
    gen: &mut Generator,
    base: &mut Ebpf,
    cpus: &[usize],
    n: u32,
) -> Result<Vec<[f64; PROGRAMS]>> {
    let mut all = Vec::new();
    for _ in 0..n {
        let mut round = [0.0; PROGRAMS];
        for which in ORDER {
            // The DSR frames for the DSR path, the source-NAT ones for the rest.
            gen.send(usize::from(which == HUDDLE_IPIP))?;
            let r = if which == HUDDLE || which == HUDDLE_IPIP {
                env.dp.attach(env.ifindex, XdpMode::Native)?;
                let r = gen.rate(cpus);
                env.dp.detach()?;
                r
            } else {
                // The forwarder is in the baseline object, the others in
                // the generator's.
                let name = match which {
                    MINIMAL => "swap_tx",
                    LOOKUP => "lookup_tx",
                    BARE_NAT => "nat_tx",
                    _ => "ipip_tx",
                };
                let in_base = which == MINIMAL;
                let obj = if in_base { &mut *base } else { &mut gen.obj };
                let link = xdp_of(obj, name)?.attach_to_if_index(env.ifindex, Mode::Driver)?;
                let r = gen.rate(cpus);
                let obj = if in_base { &mut *base } else { &mut gen.obj };
                xdp_of(obj, name)?.detach(link)?;
                r
            };
            round[which] = r?;
        }
        all.push(round);
    }
    Ok(all)
}

/// Each program's median rate over the rounds.
fn medians(rounds: &[[f64; PROGRAMS]]) -> [f64; PROGRAMS] {
    std::array::from_fn(|i| median(rounds.iter().map(|r| r[i]).collect()))
}

/// Program `a`'s rate over program `b`'s, round by round: the median, the
/// lowest and the highest. Less moved by the host's spells than the ratio
/// of the two medians, whose rounds may have fallen in different ones.
fn paired(rounds: &[[f64; PROGRAMS]], a: usize, b: usize) -> (f64, f64, f64) {
    let r: Vec<f64> = rounds.iter().map(|x| x[a] / x[b]).collect();
    let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = r.iter().copied().fold(0.0, f64::max);
    (median(r), lo, hi)
}

/// The table, and the whole cycle per packet.
fn report(cpu: usize, (frames, n): (u32, u32), method: Method, rounds: &[[f64; PROGRAMS]]) {
    let [ours, theirs, lookup, bare, ipip, bare_ipip] = medians(rounds);
    println!(
        "\nPackets per second forwarded on a veth pair, one core (CPU {}), {} frames of {GEN_FRAME} bytes each, \
         spread over {PPS_FLOWS} established flows, from {}. Median of {n} rounds of the six in turn.",
        cpu,
        frames,
        method.describe()
    );
    println!("| program on the receiving veth | Mpps forwarded | vs minimal forwarder |");
    println!("|---|---:|---:|");
    for (name, rate) in [
        (
            "huddle (established flows: lookup, NAT rewrite, FIB, XDP_TX)",
            ours,
        ),
        (
            "huddle dsr-ipip (established flows: lookup, IP-in-IP encapsulation, FIB, XDP_TX)",
            ipip,
        ),
        (
            "bare NAT forwarder (one 16-byte-key lookup, rewrite and MACs from the entry, XDP_TX)",
            bare,
        ),
        (
            "bare IP-in-IP forwarder (the same lookup, outer header and MACs from the entry, XDP_TX)",
            bare_ipip,
        ),
        (
            "forwarder + one lookup in a table like our flow table (40-byte key)",
            lookup,
        ),
        ("minimal forwarder (parse, MAC swap, XDP_TX)", theirs),
    ] {
        println!(
            "| {name} | {:.2} | {:.0}% |",
            rate / 1e6,
            rate / theirs * 100.0
        );
    }
    // The whole cycle per packet (generator, veth, program, XDP_TX, sink;
    // or reflector, veth, program, XDP_TX, veth)
    // sets the ceiling: a share of the forwarder's rate leaves the
    // balancer only so many ns of its own.
    let [ours_ns, bare_ns, lookup_ns, theirs_ns] = [ours, bare, lookup, theirs].map(|r| 1e9 / r);
    println!(
        "\nWhole cycle per packet: {ours_ns:.0} ns with huddle, {bare_ns:.0} with the bare NAT forwarder, \
         {lookup_ns:.0} with the forwarder and one lookup, {theirs_ns:.0} with the forwarder; huddle adds {:.0} ns, \
         the bare NAT forwarder {:.0}, the lookup alone {:.0}. 85% of the forwarder's rate would leave a balancer {:.0} ns.",
        ours_ns - theirs_ns,
        bare_ns - theirs_ns,
        lookup_ns - theirs_ns,
        theirs_ns / 0.85 - theirs_ns
    );
    let share = |(m, lo, hi): (f64, f64, f64)| {
        format!(
            "{:.0}% (rounds {:.0}-{:.0}%)",
            m * 100.0,
            lo * 100.0,
            hi * 100.0
        )
    };
    println!(
        "Each path against its bare forwarder, round by round (each path timed right before it; median and range): \
         source NAT {} of the bare NAT forwarder's rate, dsr-ipip {} of the bare IP-in-IP forwarder's; \
         the bare IP-in-IP forwarder {} of the minimal forwarder's.",
        share(paired(rounds, HUDDLE, BARE_NAT)),
        share(paired(rounds, HUDDLE_IPIP, BARE_IPIP)),
        share(paired(rounds, BARE_IPIP, MINIMAL)),
    );
}

/// Two cores against one, each program's rate and its ratio; the
/// balancer scales as well as the forwarder when the ratios match (a
/// harness that cannot scale shows in the forwarder's).
fn report_cores(
    cpus: [usize; 2],
    (frames, n): (u32, u32),
    method: Method,
    one: [f64; PROGRAMS],
    two: [f64; PROGRAMS],
) {
    let source = match method {
        Method::Live => "a generator thread pinned to each",
        Method::Bounce => "a loop of frames started from each",
    };
    println!(
        "\nTwo cores (CPUs {} and {}, {source}, {frames} frames each; two queues a veth end) \
         against one, in the same run. Median of {n} rounds.",
        cpus[0], cpus[1]
    );
    println!("| program | Mpps, one core | Mpps, two cores | two / one | share of the forwarder's two / one |");
    println!("|---|---:|---:|---:|---:|");
    let forwarder = two[MINIMAL] / one[MINIMAL];
    for (i, name) in [
        (HUDDLE, "huddle (established flows)"),
        (HUDDLE_IPIP, "huddle dsr-ipip (established flows)"),
        (BARE_NAT, "bare NAT forwarder"),
        (BARE_IPIP, "bare IP-in-IP forwarder"),
        (LOOKUP, "forwarder + one lookup"),
        (MINIMAL, "minimal forwarder"),
    ] {
        let ratio = two[i] / one[i];
        println!(
            "| {name} | {:.2} | {:.2} | {ratio:.2} | {:.0}% |",
            one[i] / 1e6,
            two[i] / 1e6,
            ratio / forwarder * 100.0
        );
    }
}
