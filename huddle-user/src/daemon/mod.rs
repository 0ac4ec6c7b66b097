//! `huddle run` and `huddle stop`: the daemon, by part. `run` is the
//! short list of phases (preflight, start, tasks, signals, shutdown); the
//! balancer's state and its reloads are `balancer`, one tick of the huddle
//! `tick`, the cluster's side `cluster`, what it reports `report`, the
//! control socket `control`, the HTTP listener's pages `pages`, the state
//! it saves `saved`, the snapshot `/metrics` and `huddle status` read
//! `snapshot`, its periodic tasks `tasks`.

pub mod balancer;
mod cluster;
mod control;
mod pages;
mod preflight;
mod report;
pub mod run;
mod saved;
mod settle;
mod snapshot;
mod start;
pub mod stop;
mod suspects;
mod tasks;
mod tick;
