//! Several balancers behind one router: who decides the rings (`peers`),
//! readings summed across members (`pooled`), flows handed over on a
//! takeover (`handoff`), and the VIPs announced through bird (`bgp`).

pub mod auth;
pub mod bgp;
pub mod handoff;
pub mod peers;
pub mod pooled;
