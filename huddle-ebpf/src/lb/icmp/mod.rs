//! ICMP: "fragmentation needed" answers, and errors about a translated
//! flow translated back to its client, per family.

pub mod v4;
pub mod v6;
