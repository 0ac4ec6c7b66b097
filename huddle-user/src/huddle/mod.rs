//! The huddle: per-tick readings of each backend (kernel counters, probes,
//! host metrics), temperatures, the rotation engine, which backends to
//! probe, and the state that carries them across restarts.

pub mod probing;
pub mod readings;
pub mod rotation;
pub mod state;
pub mod thermal;
