//! Source NAT: tuple allocation and reclaim, the backends' TIME_WAIT, a
//! refused SYN rebuilt toward another backend, and the rewrite itself.

pub mod closing;
pub mod nat;
pub mod retry;
pub mod rewrite;
pub mod timewait;
