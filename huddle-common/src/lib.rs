//! Types shared by the XDP program and the control plane.
//!
//! Every map name, size and on-map layout lives here, once. All types are
//! `#[repr(C)]`, `Copy`, made of fixed-width integers with explicit padding
//! (no `bool`, enum or `Option`), so the kernel and user space agree byte for
//! byte. Sizes are asserted at compile time. Keys and values the packet path
//! builds on its stack are 8-byte aligned: the BPF backend then fills and
//! copies them with word stores instead of calls to byte-wise memset and
//! memmove.
//!
//! Addresses in flow and NAT keys are always 16 bytes with a family tag;
//! an IPv4 address sits in the first 4 bytes in network order and the
//! other 12 are zero.
#![no_std]

/// Beside every type the kernel and user space share: asserts its size
/// (the layout both sides compile must be the same) and, for user space,
/// marks it `aya::Pod`.
macro_rules! shared {
    ($t:ty, $n:expr) => {
        const _: () = assert!(core::mem::size_of::<$t>() == $n);
        shared!($t);
    };
    ($t:ty) => {
        // SAFETY: a repr(C) struct of integers and byte arrays with
        // explicit padding fields: every bit pattern is valid.
        #[cfg(feature = "user")]
        unsafe impl aya::Pod for $t {}
    };
}

mod addr;
mod backend;
mod config;
pub mod decap;
mod flow;
mod gen;
mod halfopen;
mod hash;
pub mod headers;
mod hop;
pub mod latency;
mod limits;
mod maglev;
pub mod maps;
mod nat;
pub mod seqwin;
mod service;
pub mod stats;
pub mod verdict;

// One flat namespace for the shared types, as both sides name them.
pub use addr::*;
pub use backend::*;
pub use config::*;
pub use decap::{AgentTtfb, TurnKey};
pub use flow::*;
pub use gen::*;
pub use halfopen::*;
pub use hash::*;
pub use hop::*;
pub use latency::{
    latency_bucket, source_prefix, HeavySource, Latency, Pulse, HEAVY_HOLD, HUNG_EVIDENCE,
    LATENCY_BUCKETS,
};
pub use limits::*;
pub use maglev::*;
pub use nat::*;
pub use service::*;
pub use stats::{BackendStats, Counters, DecapStats, GlobalStats, ServiceStats};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_never_collide() {
        let all = verdict::ALL;
        for (i, a) in all.iter().enumerate() {
            assert!(*a > verdict::LAST_XDP_ACTION, "{a:#x} is an XDP action");
            assert!(*a >= MAX_BACKENDS, "{a:#x} is a backend id");
            for b in &all[i + 1..] {
                assert_ne!(a, b, "two verdicts share {a:#x}");
            }
        }
        // The FIB's own answers, which `route` returns beside ROUTED.
        const { assert!(verdict::ROUTED > 8) };
    }

    #[test]
    fn consecutive_nat_ports_toward_a_backend_take_consecutive_half_open_slots() {
        let key = |backend: u8, port: u16| NatKey {
            backend: [backend; 16],
            local: [7; 16],
            backend_port_be: 8080u16.to_be(),
            nat_port_be: port.to_be(),
            proto: PROTO_TCP,
            family: FAMILY_V4,
            _pad: [0; 2],
        };
        let mask = 1023;
        let (first, tag) = key(1, 20000).half_open_slot(42, 20000, mask);
        for off in 1..300u16 {
            let (slot, t) = key(1, 20000 + off).half_open_slot(42, 20000, mask);
            assert_eq!(slot, first.wrapping_add(u32::from(off)));
            assert_eq!(t, tag);
        }
        let (other, other_tag) = key(2, 20000).half_open_slot(42, 20000, mask);
        assert_ne!(
            (other, other_tag),
            (first, tag),
            "another backend, another run"
        );
        assert_ne!(
            key(1, 20000).half_open_slot(43, 20000, mask).0,
            first,
            "seeded"
        );
        assert_eq!(tag & 1, 1, "a tag is never 0");
        // Laps later: the same slot, told apart by the tag, short tag too.
        for lap in 1..6u16 {
            let (slot, t) = key(1, 20000 + lap * 1024).half_open_slot(42, 20000, mask);
            assert_eq!(slot & mask, first & mask);
            assert_ne!(short_tag(t), short_tag(tag), "lap {lap}");
        }
    }

    #[test]
    fn the_nat_used_filter_is_sized_by_the_walk_and_off_past_its_cap() {
        // Default range 20000-32767 on 2 CPUs, one SNAT address.
        let per = nat_used_per_backend(6384, 2, 1);
        assert_eq!(per, 12_768);
        assert_eq!(
            u64::from(nat_used_lines(per)) * NAT_USED_LINE as u64,
            12_768 * u64::from(NAT_USED_BACKENDS)
        );
        // The whole 1024-65535 range with 2 addresses: 33 MB, on.
        assert_ne!(nat_used_per_backend(32_256, 2, 2), 0);
        // With 16 addresses it would take 264 MB: off, one line left.
        assert_eq!(nat_used_per_backend(32_256, 2, 16), 0);
        assert_eq!(nat_used_lines(0), 1);
    }

    #[test]
    fn ring_slots_alternate_per_generation() {
        assert_eq!(ring_slot(0, 0), 0);
        assert_eq!(ring_slot(0, 1), 1);
        assert_eq!(ring_slot(0, 2), 0);
        assert_eq!(ring_slot(5, 7), 11);
        assert!(ring_slot(MAX_SERVICES - 1, 1) < MAX_SERVICES * 2);
    }

    #[test]
    fn keys_built_from_words_equal_keys_built_from_fields() {
        let (a, b) = (
            core::array::from_fn(|i| i as u8 + 1),
            core::array::from_fn(|i| 0xf0 - i as u8),
        );
        let flow = FlowKey {
            client: a,
            vip: b,
            client_port_be: 0x1234,
            vip_port_be: 0xabcd,
            proto: PROTO_TCP,
            family: FAMILY_V6,
            _pad: [0; 2],
        };
        assert_eq!(
            FlowKey::new(&a, &b, 0x1234, 0xabcd, PROTO_TCP, FAMILY_V6),
            flow
        );
        let nat = NatKey {
            backend: b,
            local: a,
            backend_port_be: 0x8899,
            nat_port_be: 0x4455,
            proto: 17,
            family: FAMILY_V4,
            _pad: [0; 2],
        };
        assert_eq!(NatKey::new(a, b, 0x8899, 0x4455, 17, FAMILY_V4), nat);
        let service = ServiceKey {
            addr: [10, 0, 0, 1],
            port_be: 80u16.to_be(),
            proto: PROTO_TCP,
            kind: SERVICE_KIND_SNAT,
        };
        // SAFETY: 8 bytes of integers and byte arrays.
        let raw = unsafe { core::mem::transmute::<ServiceKey, u64>(service) };
        assert_eq!(service.word(), raw);
    }

    #[test]
    fn v4_address_sits_in_first_bytes() {
        let a = addr_v4([10, 1, 2, 3]);
        assert_eq!(&a[..4], &[10, 1, 2, 3]);
        assert!(a[4..].iter().all(|b| *b == 0));
    }

    #[test]
    fn nat_slices_cover_the_range_without_overlap() {
        assert_eq!(KernelConfig::slices_for(20000, 32767, 2), (6384, 2));
        assert_eq!(KernelConfig::slices_for(20000, 20999, 3), (333, 3));
        // Fewer ports than CPUs: one port each, as many slices as ports.
        assert_eq!(KernelConfig::slices_for(100, 101, 8), (1, 2));
        assert_eq!(KernelConfig::slices_for(1024, 65535, 0), (64512, 1));
        let (ports, n) = KernelConfig::slices_for(1024, 65535, 4096);
        assert!(u32::from(ports) * u32::from(n) <= 64512);
    }

    #[test]
    fn map_names_are_unique() {
        for (i, a) in maps::ALL.iter().enumerate() {
            for b in &maps::ALL[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
