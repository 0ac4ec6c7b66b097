//! A backend's TIME_WAIT and the NAT tuples handed to new connections.
//!
//! When the backend closes first it keeps the connection's tuple in
//! TIME_WAIT for 60 s. A new SYN on that tuple is accepted only if its
//! timestamp is newer than the last one the old connection sent (RFC 6191;
//! Linux `tcp_timewait_state_process`); otherwise the backend answers
//! with an ACK of the old connection, the client resets it and resends
//! its SYN a timer tick later (8 ms at HZ=250). Behind a source NAT the
//! new SYN's timestamp comes from another client connection with its own
//! random offset, so that is a coin toss whenever the port space must be
//! reused within 60 s. The balancer sees both timestamps: it keeps the
//! old connection's last one in its flow entry and in `TW_REUSED` (the
//! flow entry is the next connection's once the client reuses its tuple)
//! and, for a new SYN, passes over tuples whose TIME_WAIT would refuse it.
use huddle_common::{SynCopy, SYN_OPTS, TIME_WAIT_NS};

/// TCP option kinds and the timestamp option's length.
const END: u8 = 0;
const NOP: u8 = 1;
const TIMESTAMP: u8 = 8;
const TIMESTAMP_LEN: usize = 10;
/// Options looked at before giving up (40 bytes hold no more useful ones).
const MAX_OPTIONS: usize = 16;

/// The TSval of the timestamp option among `syn`'s options, 0 if none.
#[inline(always)]
pub fn tsval(syn: &SynCopy) -> u32 {
    let len = usize::from(syn.opt_len).min(SYN_OPTS);
    let o = &syn.opts;
    let mut i = 0;
    for _ in 0..MAX_OPTIONS {
        if i + TIMESTAMP_LEN > len {
            return 0;
        }
        let (Some(&kind), Some(&olen)) = (o.get(i), o.get(i + 1)) else {
            return 0;
        };
        match kind {
            END => return 0,
            NOP => i += 1,
            TIMESTAMP if usize::from(olen) == TIMESTAMP_LEN => {
                let Some(v) = o.get(i + 2..i + 6) else {
                    return 0;
                };
                return u32::from_be_bytes([v[0], v[1], v[2], v[3]]);
            }
            _ if olen < 2 => return 0,
            _ => i += usize::from(olen),
        }
    }
    0
}

/// Whether a backend's TIME_WAIT whose last timestamp from the client was
/// `last` accepts a SYN with timestamp `syn` (either 0: unknown, taken as
/// yes).
#[inline(always)]
pub fn accepts(syn: u32, last: u32) -> bool {
    syn == 0 || last == 0 || (syn.wrapping_sub(last) as i32) > 0
}

/// Whether a TIME_WAIT the backend entered at `closed_ns`, holding the
/// client's last timestamp `last`, still stands at `now` and refuses a SYN
/// with timestamp `syn`: the one question a flow entry, `TW_HINTS` and
/// `TW_REUSED` each answer.
#[inline(always)]
pub fn refuses(closed_ns: u64, last: u32, syn: u32, now: u64) -> bool {
    now.wrapping_sub(closed_ns) < TIME_WAIT_NS && !accepts(syn, last)
}
