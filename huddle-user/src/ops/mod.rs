//! What operators run and read: the CLI, configuration, the daemon, host
//! set-up, status and the live view.

pub mod cli;
pub mod config;
pub mod daemon;
pub mod host;
pub mod netns;
pub mod status;
pub mod top;
