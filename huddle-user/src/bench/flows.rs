//! The frames `huddle bench` times: established flows set up once on the
//! balancer (their handshakes run through it), and a fresh new flow per
//! run for the SYN cases.

use super::setup::{
    client_for, dsr_open, handshake, CLIENT6, FULL_BASE, HALF_OPEN_SLOTS, IPIP_PORT, L2_PORT,
    MAGLEV_PORT, REUSE_BASE, REUSE_TUPLES, SNAT6, VIP, VIP6, XDP_TX,
};
use crate::kernel::{
    packet::{tcp6, Frame, ACK, SYN},
    prog_run::{mac_of6, ProgRun, BALANCER_IP, BALANCER_MAC},
};
use anyhow::{bail, Result};
use std::net::{Ipv4Addr, Ipv6Addr};

/// The payload of every established flow's packet.
const PAYLOAD: [u8; 64] = [0x61; 64];

/// The established flows' packets, ready to be copied per run.
pub(super) struct Flows {
    established: Vec<u8>,
    /// The backend's answer on that flow: half the packets of a
    /// source-NATed connection go this way (NAT lookup, flow lookup for
    /// its timing, next hop toward the client).
    reply: Vec<u8>,
    /// dsr-l2, dsr-ipip.
    dsr: [Vec<u8>; 2],
    /// IPv6: source NAT, dsr-l2, dsr-ipip.
    v6: Vec<Vec<u8>>,
    /// Not for a VIP.
    other: Vec<u8>,
}

impl Flows {
    /// Opens every established flow on `env`, from `client`.
    pub(super) fn open(env: &ProgRun, client: Ipv4Addr) -> Result<Self> {
        let established = Frame::tcp((client, 40000), (VIP, 80))
            .flags(ACK)
            .payload(&PAYLOAD)
            .build();
        // A full handshake, so the flow is in the flow table, not half-open.
        let ([v, v2, v3], backend, nat_port) = handshake(env, (client, 40000))?;
        if (v, v2, v3) != (3, 3, 3) || env.dp.service_stats(0)?.promoted != 1 {
            bail!("setting up the established flow returned verdicts {v}, {v2}, {v3}, expected XDP_TX (3)");
        }
        let reply = Frame::tcp(backend, (BALANCER_IP, nat_port))
            .flags(ACK)
            .seq_ack(5001, 1001)
            .payload(&PAYLOAD)
            .build();
        let dsr = [
            dsr_flow(env, client, L2_PORT)?,
            dsr_flow(env, client, IPIP_PORT)?,
        ];
        let other = Frame::tcp((client, 40000), (Ipv4Addr::new(10, 213, 0, 99), 80))
            .payload(&PAYLOAD)
            .build();
        Ok(Self {
            established,
            reply,
            dsr,
            v6: v6_flows(env)?,
            other,
        })
    }

    /// Run `n` of round `round` of case `case` (numbered as in `Cases`).
    pub(super) fn frame(&self, case: usize, round: u32, n: u32, new_calls: u32) -> Vec<u8> {
        let fresh = round * new_calls + n;
        match case {
            1 => self.reply.clone(),
            2 => syn(fresh, 80),
            3 => syn(FULL_BASE + HALF_OPEN_SLOTS * 2 + fresh, 80),
            4 => syn(REUSE_BASE + (2 * round + 1) * REUSE_TUPLES + n, 80),
            5 => self.other.clone(),
            6 => self.dsr[0].clone(),
            7 => syn(fresh, L2_PORT),
            8 => self.dsr[1].clone(),
            9 => syn(fresh, IPIP_PORT),
            10 => self.v6[0].clone(),
            11 => syn6(fresh, 80),
            12 => self.v6[1].clone(),
            13 => syn6(fresh, L2_PORT),
            14 => self.v6[2].clone(),
            15 => syn6(fresh, IPIP_PORT),
            16 => syn(fresh, MAGLEV_PORT),
            _ => self.established.clone(),
        }
    }
}

/// New flow `n`'s SYN to the VIP's `port`.
pub(super) fn syn(n: u32, port: u16) -> Vec<u8> {
    Frame::tcp(client_for(n), (VIP, port)).syn().build()
}

/// New IPv6 flow `n`'s SYN to the VIP's `port`.
fn syn6(n: u32, port: u16) -> Vec<u8> {
    let mut c = CLIENT6.octets();
    c[12..16].copy_from_slice(&(n / 50_000 + 1).to_be_bytes());
    tcp6(
        (Ipv6Addr::from(c), 1024 + (n % 50_000) as u16),
        (VIP6, port),
        (SYN, 1000, 0),
        &[],
        (mac_of6(CLIENT6), BALANCER_MAC),
    )
}

/// An established DSR flow on `port`; returns its data packet.
fn dsr_flow(env: &ProgRun, client: Ipv4Addr, port: u16) -> Result<Vec<u8>> {
    dsr_open(env, (client, 40000), port)?;
    Ok(Frame::tcp((client, 40000), (VIP, port))
        .flags(ACK)
        .payload(&PAYLOAD)
        .build())
}

/// IPv6: an established source-NATed flow and two DSR ones; their data
/// packets.
fn v6_flows(env: &ProgRun) -> Result<Vec<Vec<u8>>> {
    let macs6 = (mac_of6(CLIENT6), BALANCER_MAC);
    let from_client = |port: u16, tcp: (u8, u32, u32), payload: &[u8]| {
        tcp6((CLIENT6, 40000), (VIP6, port), tcp, payload, macs6)
    };
    let (v, out) = env.run(&from_client(80, (SYN, 1000, 0), &[]))?;
    if v != XDP_TX || out.len() < 58 {
        bail!("setting up the IPv6 flow: verdict {v}");
    }
    let nat6 = u16::from_be_bytes([out[54], out[55]]);
    let b6 = Ipv6Addr::from(<[u8; 16]>::try_from(&out[38..54]).expect("16 bytes"));
    env.run(&tcp6(
        (b6, 8080),
        (SNAT6, nat6),
        (SYN | ACK, 5000, 1001),
        &[],
        (mac_of6(b6), BALANCER_MAC),
    ))?;
    let mut flows = Vec::new();
    for port in [80, L2_PORT, IPIP_PORT] {
        if port != 80 {
            env.run(&from_client(port, (SYN, 1000, 0), &[]))?;
        }
        let (v, _) = env.run(&from_client(port, (ACK, 1001, 5001), &[]))?;
        if v != XDP_TX {
            bail!("setting up the IPv6 flow on port {port}: verdict {v}");
        }
        flows.push(from_client(port, (ACK, 1001, 5001), &PAYLOAD));
    }
    Ok(flows)
}
