//! The host: privileges, interfaces and addresses, sysctls, bpffs pins,
//! network namespaces, systemd, and what kind of link the program attaches
//! to.

pub mod addresses;
pub mod files;
pub mod host;
pub mod link;
pub mod namespace;
pub mod netns;
pub mod pins;
pub mod sysctls;
pub mod systemd;
