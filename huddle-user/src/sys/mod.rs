//! The host: privileges, interfaces and addresses, sysctls, bpffs pins,
//! network namespaces, systemd, and what kind of link the program attaches
//! to.

pub mod files;
pub mod host;
pub mod link;
pub mod netns;
