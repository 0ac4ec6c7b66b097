//! Several balancers behind one router: who decides the rings (`peers`),
//! readings summed across members (`pooled`), flows handed over on a
//! takeover (`handoff`), the rings held still while members come and go
//! (`membership`), and the VIPs announced through bird (`bgp`).

pub mod auth;
pub mod bgp;
pub mod handoff;
pub mod membership;
pub mod peers;
pub mod pooled;
