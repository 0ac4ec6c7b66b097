//! Talking over the network and sockets: probes, metrics scrapes, the
//! agent, the Prometheus endpoint, HTTP, the control socket, and BGP.

pub mod agent;
pub mod bgp;
pub mod control;
pub mod handoff;
pub mod http;
pub mod metrics;
pub mod peers;
pub mod pooled;
pub mod probe;
pub mod scrape;
