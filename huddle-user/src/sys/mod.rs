//! The host: privileges, interfaces and addresses, sysctls, bpffs pins,
//! network namespaces, systemd, what kind of link the program attaches
//! to, and the time the hypervisor takes from our CPUs.

pub mod addresses;
pub mod files;
pub mod host;
pub mod link;
pub mod namespace;
pub mod netns;
pub mod pins;
pub mod steal;
pub mod sysctls;
pub mod systemd;
