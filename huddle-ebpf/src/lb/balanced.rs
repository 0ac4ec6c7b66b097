//! What the balancer needs of an address family.

use crate::lb::{dsr::Encap, service::Lookup, snat::rewrite::Rewrite};

/// What the balancer needs of a family: its shape, the service lookup,
/// the rewrite and the encapsulation.
pub trait Balanced: Lookup + Rewrite + Encap {}
impl<F: Lookup + Rewrite + Encap> Balanced for F {}
