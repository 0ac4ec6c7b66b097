//! The flow and NAT tables chosen by mode and protocol, with one helper
//! call site per map.
//!
//! Why not a reference to the chosen map: LLVM then merges the branches
//! into one `bpf_map_lookup_elem` call on a map picked at run time, and a
//! helper call the verifier sees with two maps can neither be inlined nor
//! call the map's own function: it goes through the generic helper's
//! indirect call (a retpoline on this kind of machine). That was the
//! source-NAT path's flow lookup and the reply path's NAT lookup. The UDP
//! tables' operations are BPF functions of their own, so the TCP (and DSR)
//! ones keep a call site to themselves and are inlined by the verifier.

use crate::lb::maps::{DSR_FLOWS, FLOWS, NAT, UDP_FLOWS, UDP_NAT};
use huddle_common::{FlowKey, FlowValue, NatKey, NatValue, PROTO_UDP};

/// A flow table: `DSR_FLOWS` for direct server return, `UDP_FLOWS` for
/// source-NAT UDP, else `FLOWS`.
#[derive(Clone, Copy)]
pub enum Flows {
    Tcp,
    Udp,
    Dsr,
}

/// The flow table of a mode and protocol. `dsr` is a constant where the
/// paths are built; `proto` is the packet's.
#[inline(always)]
pub fn flows(dsr: bool, proto: u8) -> Flows {
    if dsr {
        Flows::Dsr
    } else if proto == PROTO_UDP {
        Flows::Udp
    } else {
        Flows::Tcp
    }
}

/// A NAT table: `UDP_NAT` or `NAT`.
#[derive(Clone, Copy)]
pub enum Nat {
    Tcp,
    Udp,
}

/// The NAT table of protocol `proto`.
#[inline(always)]
pub fn nat_table(proto: u8) -> Nat {
    if proto == PROTO_UDP {
        Nat::Udp
    } else {
        Nat::Tcp
    }
}

/// A helper's result as the maps' `insert` and `remove` give it.
#[inline(always)]
fn result(rc: i32) -> Result<(), i32> {
    if rc == 0 {
        Ok(())
    } else {
        Err(rc)
    }
}

/// `result` undone, to return from a BPF function (a `Result` does not
/// fit a register).
#[inline(always)]
fn code(r: Result<(), i32>) -> i32 {
    r.err().unwrap_or(0)
}

/// A pointer a lookup returned, `None` for null.
#[inline(always)]
fn found<T>(p: *mut T) -> Option<*mut T> {
    (!p.is_null()).then_some(p)
}

impl Flows {
    #[inline(always)]
    pub fn get_ptr_mut(self, key: &FlowKey) -> Option<*mut FlowValue> {
        match self {
            Flows::Tcp => FLOWS.get_ptr_mut(key),
            Flows::Dsr => DSR_FLOWS.get_ptr_mut(key),
            Flows::Udp => found(udp_flow_get(key)),
        }
    }

    #[inline(always)]
    pub fn insert(self, key: &FlowKey, value: &FlowValue, flags: u64) -> Result<(), i32> {
        match self {
            Flows::Tcp => FLOWS.insert(key, value, flags),
            Flows::Dsr => DSR_FLOWS.insert(key, value, flags),
            Flows::Udp => result(udp_flow_insert(key, value, flags)),
        }
    }

    #[inline(always)]
    pub fn remove(self, key: &FlowKey) -> Result<(), i32> {
        match self {
            Flows::Tcp => FLOWS.remove(key),
            Flows::Dsr => DSR_FLOWS.remove(key),
            Flows::Udp => result(udp_flow_remove(key)),
        }
    }

    /// # Safety
    /// As `HashMap::get`: the entry may change or go under the reference.
    #[inline(always)]
    pub unsafe fn get(self, key: &FlowKey) -> Option<&'static FlowValue> {
        // SAFETY: a map value pointer, valid for this run.
        self.get_ptr_mut(key).map(|p| unsafe { &*p })
    }
}

impl Nat {
    #[inline(always)]
    pub fn get_ptr_mut(self, key: &NatKey) -> Option<*mut NatValue> {
        match self {
            Nat::Tcp => NAT.get_ptr_mut(key),
            Nat::Udp => found(udp_nat_get(key)),
        }
    }

    #[inline(always)]
    pub fn get_ptr(self, key: &NatKey) -> Option<*const NatValue> {
        self.get_ptr_mut(key).map(|p| p.cast_const())
    }

    /// # Safety
    /// As `HashMap::get`: the entry may change or go under the reference.
    #[inline(always)]
    pub unsafe fn get(self, key: &NatKey) -> Option<&'static NatValue> {
        // SAFETY: a map value pointer, valid for this run.
        self.get_ptr_mut(key).map(|p| unsafe { &*p })
    }

    #[inline(always)]
    pub fn insert(self, key: &NatKey, value: &NatValue, flags: u64) -> Result<(), i32> {
        match self {
            Nat::Tcp => NAT.insert(key, value, flags),
            Nat::Udp => result(udp_nat_insert(key, value, flags)),
        }
    }

    #[inline(always)]
    pub fn remove(self, key: &NatKey) -> Result<(), i32> {
        match self {
            Nat::Tcp => NAT.remove(key),
            Nat::Udp => result(udp_nat_remove(key)),
        }
    }
}

#[inline(never)]
fn udp_flow_get(key: &FlowKey) -> *mut FlowValue {
    UDP_FLOWS.get_ptr_mut(key).unwrap_or(core::ptr::null_mut())
}

#[inline(never)]
fn udp_flow_insert(key: &FlowKey, value: &FlowValue, flags: u64) -> i32 {
    code(UDP_FLOWS.insert(key, value, flags))
}

#[inline(never)]
fn udp_flow_remove(key: &FlowKey) -> i32 {
    code(UDP_FLOWS.remove(key))
}

#[inline(never)]
fn udp_nat_get(key: &NatKey) -> *mut NatValue {
    UDP_NAT.get_ptr_mut(key).unwrap_or(core::ptr::null_mut())
}

#[inline(never)]
fn udp_nat_insert(key: &NatKey, value: &NatValue, flags: u64) -> i32 {
    code(UDP_NAT.insert(key, value, flags))
}

#[inline(never)]
fn udp_nat_remove(key: &NatKey) -> i32 {
    code(UDP_NAT.remove(key))
}
