//! HuddleCluster's control plane, by concern: `kernel` (loading the XDP
//! program, its maps, running it on crafted packets), `huddle` (readings,
//! temperatures, rotation, saved state), `net` (probes, scrapes, agent,
//! metrics, HTTP, control socket) and `ops` (CLI, config, daemon, host,
//! status, the live view). Each module is also reachable at the top, as
//! `huddle_user::dataplane`, `huddle_user::config` and so on.

pub mod huddle;
pub mod kernel;
pub mod net;
pub mod ops;

pub use huddle::{maglev, rotation, state, thermal};
pub use kernel::{
    bench, dataplane, decap, link, logs, mmap, object, packet, prog_run, service_index,
};
pub use net::{agent, bgp, control, handoff, http, metrics, peers, pooled, probe, scrape};
pub use ops::{cli, config, daemon, host, netns, status, top};
