//! The balancer: its maps and scratch space, the service lookup, the
//! request and reply paths, half-open flows, next hops, backend selection,
//! source NAT, direct server return, ICMP, latency, and the guard on what
//! is not balanced.

pub mod balance;
pub mod balanced;
pub mod dsr;
pub mod established;
pub mod finish;
pub mod forward;
pub mod guard;
pub mod halfopen;
pub mod icmp;
pub mod latency;
pub mod loglimit;
pub mod maps;
pub mod new_flow;
pub mod reply;
pub mod scratch;
pub mod select;
pub mod service;
pub mod snat;
pub mod tables;
pub mod window;
