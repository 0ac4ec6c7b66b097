//! HuddleCluster's control plane: configuration, the data plane interface,
//! the daemon and its control socket, status and benchmarks.

pub mod bench;
pub mod cli;
pub mod config;
pub mod control;
pub mod daemon;
pub mod dataplane;
pub mod host;
pub mod logs;
pub mod netns;
pub mod object;
pub mod packet;
pub mod prog_run;
pub mod rotation;
pub mod status;
pub mod thermal;
