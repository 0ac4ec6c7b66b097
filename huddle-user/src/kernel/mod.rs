//! The kernel side: loading the XDP object, its maps and link, what kind
//! of interface it attaches to, its log records, and running it on crafted
//! packets (fixtures and the per-packet benchmark).

pub mod bench;
pub mod dataplane;
pub mod decap;
pub mod link;
pub mod logs;
pub mod mmap;
pub mod object;
pub mod packet;
pub mod prog_run;
pub mod service_index;
