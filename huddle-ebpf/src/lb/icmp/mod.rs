//! ICMP: "fragmentation needed" answers, and errors about a translated
//! flow translated back to its client, per family.

pub mod gate;
pub mod v4;
pub mod v6;

use crate::lb::maps::FLOWS;
use huddle_common::{flow_flags, seqwin, FlowKey, PROTO_TCP};

/// Whether an ICMP error about `flow` can be real, as Linux judges one
/// before acting on it: for TCP, the quoted sequence number `seq` is where
/// the client is (`isn`: the SYN's own, for a half-open flow; else the
/// flow's `seqwin` record); for UDP, which quotes nothing to check, the
/// error comes from the backend itself (`from_backend`). A forger who
/// guessed a NAT tuple reaches no client.
#[inline(always)]
pub fn plausible(
    flow: &FlowKey,
    isn: Option<u32>,
    proto: u8,
    seq: u32,
    from_backend: bool,
) -> bool {
    if proto != PROTO_TCP {
        return from_backend;
    }
    if let Some(isn) = isn {
        return seq == isn;
    }
    // SAFETY: copied out at once.
    match unsafe { FLOWS.get(flow) } {
        Some(v) => v.flags & flow_flags::CLOSING != 0 || seqwin::within(v.synack_seq, seq),
        None => false,
    }
}
