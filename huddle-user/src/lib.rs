//! HuddleCluster's control plane. Dependencies point one way, from the
//! entry points down (a unit test, `layers`, holds every file to it):
//!
//! - entry points: `daemon` (`huddle run`), `cli` (every other command);
//! - reports: `status` (status, `/metrics`, the control socket);
//! - services: `huddle` (readings, temperatures, rotation), `cluster`
//!   (several balancers), `agent` (the backend agent), `bench`;
//! - the kernel and the network: `kernel` (the XDP object, the data plane),
//!   `net` (HTTP, probes, scrapes);
//! - foundations: `sys` (host facts and changes), `config`.

pub mod agent;
pub mod bench;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod daemon;
pub mod huddle;
pub mod kernel;
#[cfg(test)]
mod layers;
pub mod net;
pub mod status;
pub mod sys;
#[cfg(test)]
mod test_rng;
