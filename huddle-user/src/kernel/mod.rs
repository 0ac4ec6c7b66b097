//! The kernel side: loading the XDP object, its maps and link, its log
//! records, the agent's decap programs, and running the program on crafted
//! packets (fixtures and the per-packet benchmark).

pub mod batch;
pub mod dataplane;
pub mod decap;
pub mod logs;
pub mod maglev;
pub mod mmap;
pub mod object;
pub mod packet;
pub mod prog_run;
pub mod rawmap;
pub mod service_index;
