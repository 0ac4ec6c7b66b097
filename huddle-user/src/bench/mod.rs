//! `huddle bench`: ns per packet of the balancer under BPF_PROG_TEST_RUN,
//! side by side with two baselines in the same run: an XDP_PASS program
//! (the timer floor) and a minimal parse + MAC swap + XDP_TX forwarder.
//!
//! The balancer rewrites packets, so it cannot be timed with one big
//! `repeat` (the kernel would feed it its own output from the second
//! repeat on). Every figure here is the mean of many single runs, each on a
//! fresh copy of the frame; all cases run interleaved in each round and the
//! median round is reported.

mod bounce;
mod flows;
mod pps;
mod setup;

use crate::{
    config::{Config, PortRange},
    kernel::object,
    kernel::prog_run::ProgRun,
    sys::steal::CpuTimes,
};
use anyhow::{bail, Context, Result};
use aya::{programs::Xdp, Ebpf};
use flows::Flows;
use setup::*;
use std::{cell::Cell, net::Ipv4Addr, time::Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Program runs per case and round.
    #[arg(long, default_value_t = 100_000)]
    pub calls: u32,
    /// Rounds; the median round is reported.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
    /// CPU to pin the measuring thread to.
    #[arg(long, default_value_t = 0)]
    pub cpu: usize,
    /// Frames per program in the packets-per-second measurement on a
    /// veth pair (0 skips it).
    #[arg(long, default_value_t = 5_000_000)]
    pub pps_frames: u32,
    /// Rounds of the packets-per-second programs in turn; the median
    /// round is reported (more on a noisy host).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=99))]
    pub pps_rounds: u32,
    /// Only the packets-per-second part (no per-packet cases): its
    /// balancer is the only one loaded.
    #[arg(long, conflicts_with = "cases")]
    pub pps_only: bool,
    /// Only the cases whose name contains this (any case; repeat for
    /// more), with the floor and the minimal forwarder: for timing or
    /// profiling one path without the other cases' runs in between.
    #[arg(long = "case", value_name = "TEXT")]
    pub cases: Vec<String>,
    /// Services configured in all (at least the bench's own 7; at most
    /// 4,096): the others, one backend each, take no traffic, so the
    /// figures show what the service count costs a packet.
    #[arg(long, default_value_t = 7)]
    pub services: usize,
}

pub fn run(args: &BenchArgs) -> Result<()> {
    crate::sys::host::check_privileges()?;
    if args.calls == 0 || args.rounds == 0 {
        bail!("--calls and --rounds must be at least 1");
    }
    if !(7..=huddle_common::MAX_SERVICES as usize).contains(&args.services) {
        bail!(
            "--services: {} is outside 7..={}",
            args.services,
            huddle_common::MAX_SERVICES
        );
    }
    let args = args.clone();
    std::thread::spawn(move || measure(&args))
        .join()
        .map_err(|_| anyhow::anyhow!("benchmark thread panicked"))?
}

/// The run, phase by phase: the balancers, the flows each case
/// needs, the cases, the interleaved rounds, the table, then packets per
/// second.
fn measure(args: &BenchArgs) -> Result<()> {
    // Stopped mid-run, it removes its namespaces (its data planes are not
    // pinned: they go with the process).
    crate::sys::netns::remove_on_signal(|| {});
    let stale = crate::sys::netns::remove_orphans(&["huddle-bench-", "huddle-pps-"]);
    if stale > 0 {
        eprintln!("removed {stale} network namespaces an interrupted benchmark left");
    }
    pin(args.cpu)?;
    let mut base = Ebpf::load(object::BASELINE).context("loading the baseline programs")?;
    for name in ["pass", "swap_tx"] {
        xdp_of(&mut base, name)?.load()?;
    }
    if args.pps_only {
        if args.pps_frames == 0 {
            bail!("--pps-only with --pps-frames 0 measures nothing");
        }
        let cfg = bench_config(HALF_OPEN_SLOTS, args.services);
        let frames = (args.pps_frames, args.pps_rounds);
        return pps::pps(args.cpu, frames, &cfg, &neighbours(), CLIENT, &mut base);
    }
    let mut beds = Beds::new(args.services, args.rounds)?;
    // The IPv6-in-IPv6 outer source (the daemon takes the interface's).
    beds.env.dp.set_encap6(SNAT6)?;
    let new_calls = args.calls.min(HALF_OPEN_SLOTS / 4);
    let cases = Cases::new(&beds, &base, args, new_calls)?;
    let chosen = cases.chosen(&args.cases)?;
    if chosen[REUSE_CASE] {
        // Their quiet time passes while the other cases' flows are opened
        // and the cases before them run.
        for round in 0..args.rounds.min(REUSE_BEDS as u32) {
            beds.prepare_reuse(round)?;
        }
    }
    let flows = Flows::open(&beds.env, CLIENT)?;
    beds.fill_full()?;
    eprintln!(
        "timing {} runs per case ({new_calls} for new flows), {} rounds, pinned to CPU {} ...",
        args.calls, args.rounds, args.cpu
    );
    let stolen = CpuTimes::now(&[args.cpu]);
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); cases.list.len()];
    for round in 0..args.rounds {
        for (i, case) in cases.list.iter().enumerate() {
            if chosen[i] {
                let frames = |n| flows.frame(i, round, n, new_calls);
                results[i].push(beds.time(i, round, case, frames)?);
            }
        }
    }
    beds.check_nothing_refused()?;
    report(args, new_calls, &cases, &chosen, results);
    if let Some(s) = stolen {
        println!("{}.", s.report("the cases ran"));
    }
    if let [Some(v4), Some(v6)] = beds.env.dp.verified_instructions() {
        println!("\nVerified instructions: {v4} (huddle), {v6} (huddle6), of the verifier's 1,000,000 a program.");
    }
    drop(cases);
    let Beds {
        env,
        full,
        reuse,
        cfg,
        neighbours,
        ..
    } = beds;
    drop((full, reuse, env));
    if args.pps_frames > 0 {
        pps::pps(
            args.cpu,
            (args.pps_frames, args.pps_rounds),
            &cfg,
            &neighbours,
            CLIENT,
            &mut base,
        )?;
    }
    Ok(())
}

/// The backends' and the client's addresses, which every bed's FIB knows.
fn neighbours() -> Vec<Ipv4Addr> {
    let mut all: Vec<Ipv4Addr> = (0..BACKENDS)
        .map(|i| Ipv4Addr::new(10, 213, 0, 10 + i))
        .collect();
    all.push(CLIENT);
    all
}

/// The client of every established flow.
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 2);

/// The reuse case's bed for round `round`.
fn reuse_bed(round: u32) -> usize {
    round as usize % REUSE_BEDS
}

/// The reuse case's balancers, taken in turn: a round's connections are
/// finished `REUSE_BEDS` rounds ahead. A round of all the cases took
/// 1.5-2.3 s here (finishing a round's connections 0.19-0.27 s of it);
/// with two, 250-370 ms of the quiet time were still left to wait in some
/// rounds (a test build printed them, 6 December).
const REUSE_BEDS: usize = 3;

/// The balancers the cases run on.
struct Beds {
    /// Free tables: most cases.
    env: ProgRun,
    /// Its half-open tables full: its SYNs take slots other SYNs hold.
    full: ProgRun,
    /// Their NAT walks give this CPU `reuse_tuples` tuples in all: their
    /// SYNs take tuples of finished connections, as every SYN does once a
    /// walk has gone round (the steady state). `REUSE_BEDS` of them in
    /// turn (`reuse_bed`), so that a round's connections are finished
    /// rounds ahead and their quiet time has passed when it comes.
    reuse: [ProgRun; REUSE_BEDS],
    reuse_tuples: u32,
    /// Rounds in all (none is prepared past the last).
    rounds: u32,
    /// When each reuse bed's connections were finished. A round's are
    /// finished right after the round `REUSE_BEDS` before it is timed on
    /// the same bed, so their quiet time passes while the other cases (and
    /// the other beds) run. With one bed, finished one round ahead, 1.3-1.4
    /// s were left to wait in every round (a test build printed them, 6
    /// December): a round of all the cases is shorter than the quiet time.
    /// Measured: a 3.3 s sleep just before timing put a SYN with free
    /// slots at 337-349 ns net against 232-294 without, alternating runs:
    /// the reuse case was timing the sleep.
    reuse_ready: [Cell<Option<Instant>>; REUSE_BEDS],
    cfg: Config,
    neighbours: Vec<Ipv4Addr>,
}

impl Beds {
    fn new(services: usize, rounds: u32) -> Result<Self> {
        let bench_config = |half_open| bench_config(half_open, services);
        let cfg = bench_config(HALF_OPEN_SLOTS);
        let neighbours = neighbours();
        let name = |what: &str| format!("huddle-bench-{what}{}", std::process::id());
        let env = ProgRun::new(&name(""), &cfg, &neighbours)?;
        let full = ProgRun::new(&name("full-"), &bench_config(HALF_OPEN_SLOTS), &neighbours)?;
        let mut reuse_cfg = bench_config(HALF_OPEN_SLOTS);
        // One slice of the port range (1024-65535) per possible CPU.
        let slices = u32::try_from(crate::sys::host::possible_cpus()?)?.max(1);
        let per_backend = (REUSE_TUPLES / u32::from(BACKENDS)).min(64_512 / slices);
        reuse_cfg.nat_ports = PortRange {
            min: 1024,
            max: u16::try_from(1023 + per_backend * slices)?,
        };
        let reuse = [
            ProgRun::new(&name("reuse-"), &reuse_cfg, &neighbours)?,
            ProgRun::new(&name("reuse2-"), &reuse_cfg, &neighbours)?,
            ProgRun::new(&name("reuse3-"), &reuse_cfg, &neighbours)?,
        ];
        // The runs happen in the namespace entered last (the last reuse
        // bed's): the FIB answers from its neighbours, so all get the IPv6
        // ones.
        for n in (0..u16::from(BACKENDS)).map(backend6).chain([CLIENT6]) {
            for bed in [&env, &full].into_iter().chain(&reuse) {
                bed.neighbour6(n)?;
            }
        }
        // The other cases run in that namespace, on its interface of the
        // same index.
        if reuse.iter().any(|r| r.ifindex != env.ifindex) {
            bail!("the benchmark's namespaces gave their interfaces different indexes");
        }
        Ok(Self {
            env,
            full,
            reuse,
            reuse_tuples: per_backend * u32::from(BACKENDS),
            rounds,
            reuse_ready: Default::default(),
            cfg,
            neighbours,
        })
    }

    /// Fills the full balancer's half-open tables.
    fn fill_full(&self) -> Result<()> {
        for n in 0..HALF_OPEN_SLOTS * 2 {
            let (verdict, _) = self.full.run(&flows::syn(FULL_BASE + n, 80))?;
            if verdict != XDP_TX {
                bail!("filling the small half-open table: verdict {verdict}");
            }
        }
        Ok(())
    }

    /// One round of case `i`: its tables made ready, then timed.
    fn time(
        &self,
        i: usize,
        round: u32,
        case: &Case,
        mut frames: impl FnMut(u32) -> Vec<u8>,
    ) -> Result<f64> {
        if NEW_CASES.contains(&i) {
            self.env.dp.clear_half_open()?;
        }
        let mut program = case.program;
        if i == REUSE_CASE {
            // Finished before the first rounds (`measure`), then
            // `REUSE_BEDS` rounds ahead.
            let bed = reuse_bed(round);
            let ready = self.reuse_ready[bed]
                .take()
                .context("the reuse case's connections were not finished")?;
            std::thread::sleep(REUSE_QUIET.saturating_sub(ready.elapsed()));
            program = self.reuse[bed].dp.program()?;
        }
        let ns = time_case(
            program,
            self.env.ifindex,
            &mut frames,
            case.calls,
            case.want,
        )
        .with_context(|| {
            format!(
                "{}: service counters {:?}, global counters {:?}",
                case.name,
                self.env.dp.service_stats(0),
                self.env.dp.global_stats()
            )
        })?;
        let ahead = round + REUSE_BEDS as u32;
        if i == REUSE_CASE && ahead < self.rounds {
            self.prepare_reuse(ahead)?;
        }
        Ok(ns)
    }

    /// Finishes round `round`'s connections of the reuse case on its bed,
    /// and notes when: the start of their quiet time.
    fn prepare_reuse(&self, round: u32) -> Result<()> {
        let bed = reuse_bed(round);
        finish_connections(&self.reuse[bed], round, self.reuse_tuples)?;
        self.reuse_ready[bed].set(Some(Instant::now()));
        Ok(())
    }

    /// Every new flow of every case found room.
    fn check_nothing_refused(&self) -> Result<()> {
        for id in 0..7 {
            let st = self.env.dp.service_stats(id)?;
            if st.drop_flow_table + st.drop_nat_ports != 0 {
                bail!("the tables refused new flows: {st:?}");
            }
        }
        Ok(())
    }
}

/// One timed case: what runs, how often, and the verdict it must give.
struct Case<'a> {
    name: &'static str,
    program: &'a Xdp,
    calls: u32,
    want: u32,
}

/// The cases of new flows: the half-open tables are emptied before each,
/// which then fills at most a quarter of their slots (the full ones time
/// another case). As many runs as that allows: the first runs of a case
/// find cold caches and a cold branch predictor, and a case of few runs
/// times them. Measured: 819 runs put a SYN at 764-898 ns, 1,638 at 590
/// (when every case shared one filling of the tables); Katran's ~450 ns
/// was timed over 100,000.
const NEW_CASES: [usize; 7] = [2, 7, 9, 11, 13, 15, 16];
/// The case on finished connections' NAT tuples.
const REUSE_CASE: usize = 4;
/// The two baselines, always timed.
const FORWARDER: usize = 17;
const FLOOR: usize = 18;

/// Every case, in the order of `Flows::frame`'s numbers.
struct Cases<'a> {
    list: Vec<Case<'a>>,
}

impl<'a> Cases<'a> {
    fn new(beds: &'a Beds, base: &'a Ebpf, args: &BenchArgs, new_calls: u32) -> Result<Self> {
        let prog = beds.env.dp.program()?;
        let full = beds.full.dp.program()?;
        // The first round's bed (`Beds::time` takes each round's own).
        let reuse = beds.reuse[0].dp.program()?;
        let pass: &Xdp = base.program("pass").context("pass")?.try_into()?;
        let swap: &Xdp = base.program("swap_tx").context("swap_tx")?.try_into()?;
        let all = args.calls;
        let list: [(&'static str, &Xdp, u32, u32); 19] = [
            ("established flow", prog, all, XDP_TX),
            ("established flow, backend's reply", prog, all, XDP_TX),
            (
                "new flow (SYN), half-open slots free",
                prog,
                new_calls,
                XDP_TX,
            ),
            (
                "new flow (SYN), half-open slots all taken",
                full,
                new_calls,
                XDP_TX,
            ),
            (
                "new flow (SYN) on a finished connection's NAT tuple",
                reuse,
                new_calls.min(beds.reuse_tuples),
                XDP_TX,
            ),
            ("non-VIP (pass)", prog, all, XDP_PASS),
            ("dsr-l2 established flow", prog, all, XDP_TX),
            ("dsr-l2 new flow (SYN)", prog, new_calls, XDP_TX),
            ("dsr-ipip established flow", prog, all, XDP_TX),
            ("dsr-ipip new flow (SYN)", prog, new_calls, XDP_TX),
            ("IPv6 established flow", prog, all, XDP_TX),
            ("IPv6 new flow (SYN)", prog, new_calls, XDP_TX),
            ("IPv6 dsr-l2 established flow", prog, all, XDP_TX),
            ("IPv6 dsr-l2 new flow (SYN)", prog, new_calls, XDP_TX),
            ("IPv6 dsr-ipip established flow", prog, all, XDP_TX),
            ("IPv6 dsr-ipip new flow (SYN)", prog, new_calls, XDP_TX),
            ("dsr-l2 Maglev new flow (SYN)", prog, new_calls, XDP_TX),
            ("minimal forwarder (swap+TX)", swap, all, XDP_TX),
            ("XDP_PASS floor", pass, all, XDP_PASS),
        ];
        let list = list
            .into_iter()
            .map(|(name, program, calls, want)| Case {
                name,
                program,
                calls,
                want,
            })
            .collect();
        Ok(Self { list })
    }

    /// Which cases `--case` picks (the baselines always).
    fn chosen(&self, wanted: &[String]) -> Result<Vec<bool>> {
        let picks = |name: &str| {
            wanted.is_empty()
                || wanted
                    .iter()
                    .any(|c| name.to_lowercase().contains(&c.to_lowercase()))
        };
        let chosen: Vec<bool> = self
            .list
            .iter()
            .enumerate()
            .map(|(i, c)| i == FORWARDER || i == FLOOR || picks(c.name))
            .collect();
        if chosen.iter().filter(|c| **c).count() == 2 {
            let names: Vec<&str> = self.list.iter().map(|c| c.name).collect();
            bail!(
                "no case's name contains any of {wanted:?}; the cases: {}",
                names.join("; ")
            );
        }
        Ok(chosen)
    }
}

/// The table: each chosen case's median round, net of the floor and
/// against the minimal forwarder.
fn report(
    args: &BenchArgs,
    new_calls: u32,
    cases: &Cases,
    chosen: &[bool],
    results: Vec<Vec<f64>>,
) {
    let med: Vec<f64> = results.into_iter().map(median).collect();
    let floor = med[FLOOR];
    let fwd_net = (med[FORWARDER] - floor).max(0.1);
    println!(
        "\nBPF_PROG_TEST_RUN, repeat=1 x {} runs ({new_calls} for new flows), median of {} rounds, CPU {}",
        args.calls, args.rounds, args.cpu
    );
    println!("| case | ns/packet | net of XDP_PASS floor | vs minimal forwarder (ns/packet) |");
    println!("|---|---:|---:|---:|");
    for (i, case) in cases.list.iter().enumerate().filter(|(i, _)| chosen[*i]) {
        let net = med[i] - floor;
        println!(
            "| {} | {:.1} | {:.1} | {:.2}x |",
            case.name,
            med[i],
            net,
            med[i] / med[FORWARDER]
        );
    }
    println!(
        "\nThe minimal forwarder costs {fwd_net:.1} ns net: below what this timer resolves, so ratios are of the whole figures.\n\
         For scale (Katran at 19f08fec, timed the same way beside this program on this kind of machine on 5 December 2026, net of the floor; \
         docs/benchmarks-datapath.md): established flow 108.9 ns, new flow 419.8 (Maglev pick and flow-table insert), non-VIP 40.9. \
         Figures move with the machine's state: compare within one run."
    );
}
