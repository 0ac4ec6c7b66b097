//! Talking over the network and sockets: probes, metrics scrapes, the
//! agent, the Prometheus endpoint, HTTP, and the control socket.

pub mod agent;
pub mod control;
pub mod http;
pub mod metrics;
pub mod probe;
pub mod scrape;
