//! Talking to backends over the network: HTTP (client and server), probes
//! and metrics scrapes.

pub mod admission;
pub mod http;
pub mod probe;
pub mod scrape;
