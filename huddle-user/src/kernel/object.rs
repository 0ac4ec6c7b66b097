//! The XDP objects, built by `build.rs` with the nightly and embedded so the
//! daemon is a single binary.

/// The balancer program (`huddle`) and its maps.
pub static HUDDLE: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/huddle"));

/// Baselines for `huddle bench`: `pass` and `swap_tx`.
pub static BASELINE: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/baseline"));

/// The live-frames packet generator (`gen`) and counting sink (`sink`) of
/// `huddle bench`'s packets-per-second measurement.
pub static TRAFFICGEN: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/trafficgen"));

/// The backend agent's IP-in-IP decap (`decap`) and its maps.
pub static DECAP: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/decap"));
