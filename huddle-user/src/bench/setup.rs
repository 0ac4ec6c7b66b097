//! What every part of the benchmark shares: the testbed's addresses, the
//! balancer's config, handshakes through the program, and timing one case.

use crate::{
    config::{Config, Mode, PortRange, Proto, Service},
    kernel::packet::{endpoints, Frame, ACK, FIN, SYN},
    kernel::prog_run::{test_run, ProgRun, BALANCER_IP},
};
use anyhow::{bail, Context, Result};
use aya::{programs::Xdp, Ebpf};
use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::Duration,
};

pub(super) const VIP: Ipv4Addr = Ipv4Addr::new(10, 213, 100, 1);

pub(super) use huddle_common::verdict::{XDP_PASS, XDP_TX};

pub(super) const BACKENDS: u8 = 16;

/// Half-open table slots of both new-flow runs: the default size. One
/// balancer starts with every slot free, the other with every slot taken
/// (filled twice over first), so its SYNs evict.
pub(super) const HALF_OPEN_SLOTS: u32 = huddle_common::DEFAULT_HALF_OPEN_SIZE;

/// NAT tuples the reuse case's balancer has on the bench's CPU, over all
/// backends: as many as a case of new flows runs (fewer on a machine of
/// more than 63 possible CPUs, whose slices of the port range are
/// smaller).
pub(super) const REUSE_TUPLES: u32 = HALF_OPEN_SLOTS / 4;

/// VIP ports of the DSR services (their backends listen on the same).
pub(super) const L2_PORT: u16 = 8080;

pub(super) const IPIP_PORT: u16 = 9090;

/// An L2 DSR service whose new flows take its Maglev table.
pub(super) const MAGLEV_PORT: u16 = 7070;

/// The bench's seven services, and idle ones up to `services` in all.
pub(super) fn bench_config(half_open: u32, services: usize) -> Config {
    let service = |vip_port: u16, port: u16, mode: Mode| {
        let mut s = Service::plain(
            (VIP, vip_port).into(),
            Proto::Tcp,
            (0..BACKENDS)
                .map(|i| (Ipv4Addr::new(10, 213, 0, 10 + i), port).into())
                .collect(),
        );
        s.mode = mode;
        s
    };
    let service6 = |vip_port: u16, port: u16, mode: Mode| {
        let mut s = Service::plain(
            (VIP6, vip_port).into(),
            Proto::Tcp,
            (0..u16::from(BACKENDS))
                .map(|i| (backend6(i), port).into())
                .collect(),
        );
        s.mode = mode;
        s
    };
    let mut cfg = crate::kernel::prog_run::config(
        vec![
            service(80, 8080, Mode::Snat),
            service(L2_PORT, L2_PORT, Mode::DsrL2),
            service(IPIP_PORT, IPIP_PORT, Mode::DsrIpip),
            {
                let mut s = service(MAGLEV_PORT, MAGLEV_PORT, Mode::DsrL2);
                s.selection = crate::config::Selection::Maglev;
                s
            },
            service6(80, 8080, Mode::Snat),
            service6(L2_PORT, L2_PORT, Mode::DsrL2),
            service6(IPIP_PORT, IPIP_PORT, Mode::DsrIpip),
        ],
        PortRange {
            min: 1024,
            max: 65535,
        },
        1 << 18,
        half_open,
    );
    cfg.snat_ips6 = vec![SNAT6];
    // Idle services on VIPs of their own, a backend each (never sent to).
    for k in 0..services.saturating_sub(cfg.services.len()) {
        let vip = Ipv4Addr::new(10, 213, 101 + (k / 250) as u8, 1 + (k % 250) as u8);
        let backend = Ipv4Addr::new(10, 214, (k / 250) as u8, 1 + (k % 250) as u8);
        cfg.services.push(Service::plain(
            (vip, 80).into(),
            Proto::Tcp,
            vec![(backend, 8080).into()],
        ));
    }
    cfg
}

pub(super) const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0x100, 0, 0, 0, 0, 1);

pub(super) const SNAT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 1);

pub(super) const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 2);

pub(super) fn backend6(i: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 0x10 + i)
}

pub(super) fn pin(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET and sched_setaffinity
    // get valid pointers for the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("pinning to CPU {cpu}"));
        }
    }
    Ok(())
}

/// One timed case: mean kernel-measured ns per run over `frames`.
/// Client `n`'s address and port: a fresh one for every new flow over all
/// rounds and cases.
pub(super) fn client_for(n: u32) -> (Ipv4Addr, u16) {
    let host = n / 50_000;
    let addr = Ipv4Addr::new(
        10,
        213,
        1 + (host % 250) as u8,
        1 + (host / 250 % 250) as u8,
    );
    (addr, 1024 + (n % 50_000) as u16)
}

/// A full handshake of `client` with the source-NAT service on port 80:
/// its SYN, the backend's SYN-ACK, its ACK (which promotes the flow).
/// Returns the three verdicts, the backend and the NAT port.
pub(super) fn handshake(
    env: &ProgRun,
    client: (Ipv4Addr, u16),
) -> Result<([u32; 3], (Ipv4Addr, u16), u16)> {
    let (v, out) = env.run(&Frame::tcp(client, (VIP, 80)).syn().build())?;
    let ((_, nat_port), backend) = endpoints(&out);
    let (v2, _) = env.run(
        &Frame::tcp(backend, (BALANCER_IP, nat_port))
            .flags(SYN | ACK)
            .seq_ack(5000, 1001)
            .build(),
    )?;
    let (v3, _) = env.run(&Frame::tcp(client, (VIP, 80)).seq_ack(1001, 5001).build())?;
    Ok(([v, v2, v3], backend, nat_port))
}

/// Opens an established DSR flow of `client` on the service at `port`:
/// the SYN, then the client's ACK promotes it (the backend answers the
/// client directly, so nothing comes back through the balancer).
pub(super) fn dsr_open(env: &ProgRun, client: (Ipv4Addr, u16), port: u16) -> Result<()> {
    let (v, _) = env.run(&Frame::tcp(client, (VIP, port)).syn().build())?;
    let ack = Frame::tcp(client, (VIP, port)).seq_ack(1001, 5001);
    let (v2, _) = env.run(&ack.build())?;
    if (v, v2) != (3, 3) {
        bail!("opening a DSR flow on port {port}: verdicts {v}, {v2}, expected XDP_TX (3)");
    }
    Ok(())
}

/// The first flow number of the full balancer's SYNs.
pub(super) const FULL_BASE: u32 = 10_000_000;

/// First client number of the reuse case: round `r` finishes
/// `REUSE_TUPLES` connections from `REUSE_BASE + 2r * REUSE_TUPLES`, then
/// times SYNs from the next `REUSE_TUPLES`.
pub(super) const REUSE_BASE: u32 = 20_000_000;

/// How long after `finish_connections` its tuples are surely quiet
/// (`nat_used::QUIET_NS`), as they are when a busy balancer's walk comes
/// round to them.
pub(super) const REUSE_QUIET: Duration =
    Duration::from_nanos(huddle_common::nat_used::QUIET_NS + 100_000_000);

/// Opens and finishes one connection on each of `env`'s `tuples` NAT
/// tuples of this CPU (the client's FIN, the backend's, the client's last
/// ACK: the close of a keep-alive connection the client ends), so its
/// walk starts over on finished connections' tuples once `REUSE_QUIET`
/// has passed.
pub(super) fn finish_connections(env: &ProgRun, round: u32, tuples: u32) -> Result<()> {
    env.dp.clear_half_open()?;
    let before = env.dp.service_stats(0)?.promoted;
    for n in 0..tuples {
        let client = client_for(REUSE_BASE + 2 * round * REUSE_TUPLES + n);
        let ([v, ..], backend, nat_port) = handshake(env, client)?;
        if v != XDP_TX {
            bail!("finishing connections for the reuse case: SYN verdict {v}");
        }
        let to_backend =
            |flags, seq, ack| Frame::tcp(client, (VIP, 80)).flags(flags).seq_ack(seq, ack);
        let closes = [
            to_backend(FIN | ACK, 1001, 5001),
            Frame::tcp(backend, (BALANCER_IP, nat_port))
                .flags(FIN | ACK)
                .seq_ack(5001, 1002),
            to_backend(ACK, 1002, 5002),
        ];
        // The backend's FIN goes to a client this namespace has no
        // neighbour for (passed, once the flow has been marked).
        for (i, f) in closes.into_iter().enumerate() {
            let (v, _) = env.run(&f.build())?;
            if v != XDP_TX && !(i == 1 && v == XDP_PASS) {
                bail!("finishing connections for the reuse case: close segment {i}: verdict {v}");
            }
        }
    }
    let promoted = env.dp.service_stats(0)?.promoted - before;
    if promoted != u64::from(tuples) {
        bail!("finishing connections for the reuse case: {promoted} of {tuples} established");
    }
    Ok(())
}

pub(super) fn time_case(
    prog: &Xdp,
    ifindex: u32,
    frames: &mut dyn FnMut(u32) -> Vec<u8>,
    calls: u32,
    want: u32,
) -> Result<f64> {
    let mut total = Duration::ZERO;
    for i in 0..calls {
        let frame = frames(i);
        let (verdict, _, d) = test_run(prog, &frame, ifindex)?;
        if verdict != want {
            bail!("run {i} returned verdict {verdict}, expected {want}: the case is not timing the path it names");
        }
        total += d;
    }
    Ok(total.as_nanos() as f64 / f64::from(calls))
}

/// The median of `v`; NaN for none (a case not run).
pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The XDP program `name` of `obj`.
pub(super) fn xdp_of<'a>(obj: &'a mut Ebpf, name: &str) -> Result<&'a mut Xdp> {
    Ok(obj
        .program_mut(name)
        .with_context(|| format!("program {name} missing"))?
        .try_into()?)
}
