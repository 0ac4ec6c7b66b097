//! HuddleCluster's control plane: configuration, the data plane interface,
//! the daemon and its control socket, status and benchmarks.

pub mod agent;
pub mod bench;
pub mod cli;
pub mod config;
pub mod control;
pub mod daemon;
pub mod dataplane;
pub mod host;
pub mod http;
pub mod huddle;
pub mod link;
pub mod logs;
pub mod metrics;
pub mod netns;
pub mod object;
pub mod packet;
pub mod probe;
pub mod prog_run;
pub mod rotation;
pub mod scrape;
pub mod state;
pub mod status;
pub mod thermal;
pub mod top;
