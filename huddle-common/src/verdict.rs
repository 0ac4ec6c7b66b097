//! Every special value the XDP program's steps return in band, defined
//! once (as Cilium's `drop_reasons.h` does). A step returns either an XDP
//! action (the kernel's `xdp_action`, 0 to `LAST_XDP_ACTION`) or one of
//! these, and a few return a backend id or one of these, so no two may be
//! equal, none may be an action and none a backend id: the unit test
//! `verdicts_never_collide` holds them to it.

/// The largest XDP action (`XDP_REDIRECT`).
pub const LAST_XDP_ACTION: u32 = 4;

/// The XDP actions user space reads back from a run (BPF_PROG_TEST_RUN),
/// as the kernel's `xdp_action` numbers them (the program checks them
/// against its bindings).
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = LAST_XDP_ACTION;

/// `reply`'s answer for a refused SYN that may be retried: the packet is
/// untouched and the scratch map holds its keys.
pub const RETRY: u32 = u32::MAX;
/// `request`'s answer for a packet to translate and send toward its
/// backend: untouched, its flow in the scratch map.
pub const FORWARD: u32 = u32::MAX - 1;
/// `FORWARD` for a new flow whose half-open slots are still to write
/// (`halfopen::commit`, after the packet).
pub const FORWARD_NEW: u32 = u32::MAX - 2;
/// The IP-in-IP encapsulation's answer for a packet too big once wrapped:
/// the scratch map holds what the ICMP answer needs.
pub const TOO_BIG: u32 = u32::MAX - 3;
/// `route`'s error for a destination the FIB reaches only through a
/// gateway, when it had to be on the balancer's own segment (its other
/// errors are the FIB's own `BPF_FIB_LKUP_RET_*`, all small).
pub const ROUTED: u32 = u32::MAX - 4;
/// No backend: none to avoid, or none chosen.
pub const NO_BACKEND: u32 = u32::MAX - 5;

/// The established path's answer for a packet it does not take: the full
/// request path does (`lb::established` in the XDP program).
pub const FULL_PATH: u32 = u32::MAX - 6;

/// A frame ready to be sent whose TCP or UDP checksum was left to
/// offload: the scratch map holds where it lies and the verdict, and the
/// checksum program (`TAIL_CSUM`) finishes it and sends the frame.
pub const FINISH_CSUM: u32 = u32::MAX - 7;

/// Every value above, for the test.
pub const ALL: [u32; 8] = [
    FINISH_CSUM,
    RETRY,
    FORWARD,
    FORWARD_NEW,
    TOO_BIG,
    ROUTED,
    NO_BACKEND,
    FULL_PATH,
];

/// The path MTU `route` gives when none is known: no packet is too big
/// for it.
pub const MTU_ANY: u16 = u16::MAX;
