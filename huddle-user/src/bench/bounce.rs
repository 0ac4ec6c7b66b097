//! Packets per second where the kernel refuses BPF_PROG_TEST_RUN's live
//! frames (EPERM on every program, as on this project's Firecracker
//! guests): user space sends a few hundred frames once, and they
//! circulate between the interface under test and the `bounce` program on
//! its peer, each pass one packet through the program under test, until
//! `bounce` is told to let them die.

use super::setup::pin;
use anyhow::{bail, Context, Result};
use aya::{
    maps::{Array, PerCpuArray},
    programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp},
    Ebpf,
};
use huddle_common::{GenConfig, GEN_FRAME};
use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::{Duration, Instant},
};

/// Frames sent into each CPU's loop: under a veth ring (256), above a
/// NAPI budget (64), so that neither end waits for the other.
const INJECT: usize = 128;

/// How long a round may take, and how long its count may stand still,
/// before the bench gives up on it.
const ROUND_LIMIT: Duration = Duration::from_secs(20);
const STALL: Duration = Duration::from_secs(1);

/// How frames reach the program under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Method {
    /// BPF_PROG_TEST_RUN live frames from `gen`, counted by `sink`.
    Live,
    /// Frames circulating through `bounce`.
    Bounce,
}

impl Method {
    /// The method this kernel allows: one live frame from `gen` is tried;
    /// EPERM means the kernel refuses live frames outright (any program,
    /// flags, size or namespace), any other failure is an error.
    pub(super) fn probe(gen: &Xdp, template: &[u8], ctx: &[u8]) -> Result<Method> {
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(template);
        opts.ctx_in = Some(ctx);
        opts.repeat = 1;
        opts.attrs = TestRunAttrs::new().xdp_live_frames(64);
        match gen.test_run(opts) {
            Ok(_) => Ok(Method::Live),
            Err(e) if is_eperm(&e) => Ok(Method::Bounce),
            Err(e) => Err(e).context("BPF_PROG_TEST_RUN (live frames)"),
        }
    }

    /// The generator's program on the peer: the counting sink, or the
    /// reflector that is generator and sink at once.
    pub(super) fn peer_program(self) -> &'static str {
        match self {
            Method::Live => "sink",
            Method::Bounce => "bounce",
        }
    }

    /// How the report names the source of the frames.
    pub(super) fn describe(self) -> &'static str {
        match self {
            Method::Live => "a BPF_PROG_TEST_RUN live-frames generator; counted by an XDP sink on the peer",
            Method::Bounce => {
                "frames circulating between the two ends (this kernel refuses BPF_PROG_TEST_RUN live frames: \
                 EPERM for any program), an XDP reflector on the peer counting each and writing the template \
                 back over it, so its cost is in every figure as the live generator's was"
            }
        }
    }
}

fn is_eperm(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.raw_os_error() == Some(libc::EPERM) {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

/// Frames `bounce` counted so far, on every CPU.
fn counted(obj: &mut Ebpf) -> Result<u64> {
    let m = PerCpuArray::<_, u64>::try_from(obj.map_mut("GEN_COUNT").context("GEN_COUNT")?)?;
    Ok(m.get(&1, 0)?.iter().sum())
}

/// Tells `bounce` to drop (or again to send back) what it receives.
fn set_stop(obj: &mut Ebpf, stop: bool) -> Result<()> {
    let mut m = Array::<_, GenConfig>::try_from(obj.map_mut("GEN_CONFIG").context("GEN_CONFIG")?)?;
    let mut cfg = m.get(&0, 0)?;
    cfg.stop = u32::from(stop);
    m.set(0, cfg, 0)?;
    Ok(())
}

/// Lets the circulating frames die: `bounce` drops from now on, until
/// its count stands still.
fn drain(obj: &mut Ebpf) -> Result<()> {
    set_stop(obj, true)?;
    let mut last = counted(obj)?;
    for _ in 0..250 {
        std::thread::sleep(Duration::from_millis(20));
        let now = counted(obj)?;
        if now == last {
            return set_stop(obj, false);
        }
        last = now;
    }
    bail!("frames still circulating 5 s after the reflector was told to drop them")
}

/// Sends `count` copies of `frame` out of `ifindex` (AF_PACKET).
fn send(ifindex: u32, frame: &[u8], count: usize) -> Result<()> {
    // SAFETY: plain socket call; the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("an AF_PACKET socket");
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // Past the qdisc, the transmit queue is the sending CPU's (the
    // default hashes the socket: two CPUs' loops could share a queue,
    // and so one NAPI and one CPU).
    let on: libc::c_int = 1;
    // SAFETY: a valid int option for a valid socket.
    if unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_QDISC_BYPASS,
            std::ptr::from_ref(&on).cast(),
            std::mem::size_of::<libc::c_int>() as u32,
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error()).context("PACKET_QDISC_BYPASS");
    }
    // SAFETY: an all-zero sockaddr_ll is valid; the fields are set below.
    let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    to.sll_family = libc::AF_PACKET as u16;
    to.sll_ifindex = i32::try_from(ifindex)?;
    to.sll_halen = 6;
    to.sll_addr[..6].copy_from_slice(&frame[..6]);
    for _ in 0..count {
        // SAFETY: the buffer and the address are valid for their lengths.
        let n = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                std::ptr::from_ref(&to).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error()).context("sending the first frames");
        }
    }
    Ok(())
}

/// One round: frames the program under test sent per second, with
/// `frames` passes per CPU of `cpus`. Each CPU's loop starts from
/// frames sent by a thread pinned to it: the veth end's transmit queue
/// follows the sending CPU, and each end's NAPI then runs where its peer
/// sent, so a loop stays on its CPU.
pub(super) fn rate(
    obj: &mut Ebpf,
    peer: u32,
    template: &[u8; GEN_FRAME],
    cpus: &[usize],
    frames: u32,
) -> Result<f64> {
    std::thread::scope(|s| -> Result<()> {
        let runs: Vec<_> = cpus
            .iter()
            .map(|&c| {
                s.spawn(move || -> Result<()> {
                    pin(c)?;
                    send(peer, template, INJECT)
                })
            })
            .collect();
        for r in runs {
            r.join()
                .map_err(|_| anyhow::anyhow!("a sending thread panicked"))??;
        }
        Ok(())
    })?;
    std::thread::sleep(Duration::from_millis(10));
    let want = u64::from(frames) * cpus.len() as u64;
    let (from, start) = (counted(obj)?, Instant::now());
    let (mut last, mut moved) = (0, start);
    let result = loop {
        std::thread::sleep(Duration::from_millis(5));
        let n = counted(obj)? - from;
        if n >= want {
            break Ok(n as f64 / start.elapsed().as_secs_f64());
        }
        if n != last {
            (last, moved) = (n, Instant::now());
        }
        if moved.elapsed() > STALL || start.elapsed() > ROUND_LIMIT {
            break Err(anyhow::anyhow!(
                "{n} of {want} frames came back, then none for {} ms: the program under test did not send \
                 them back out of the interface (XDP_TX)",
                moved.elapsed().as_millis()
            ));
        }
    };
    drain(obj)?;
    result
}
