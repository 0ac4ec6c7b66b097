//! Request latency from the packets the balancer forwards: request turns
//! answered through it (source NAT), or the client's ACKs (DSR).

pub mod ackclock;
pub mod sources;
pub mod timing;
