//! Testbeds of network namespaces for HuddleCluster's tests and demo.
//!
//! Addresses all come from 10.213.0.0/16 and exist only inside namespaces
//! a testbed creates: hosts on one bridged segment 10.213.0.0/24 (balancer
//! .1, client .2, backends .11 and up), VIPs in 10.213.100.0/24, routed by
//! the client via the balancer. Names carry a prefix with the process id
//! and a counter; everything is removed on drop, also when a test fails.

mod addrs;
pub mod adversary;
mod bed;
pub mod kinds;
mod names;
pub mod nginx;
mod proc;
pub mod scaleout;
pub mod slowloris;
mod traffic;
pub mod uplink;

// One flat namespace: tests name `testbed::X` whatever file holds it.
pub use addrs::*;
pub use bed::*;
pub use names::*;
pub use proc::*;
pub use traffic::*;
