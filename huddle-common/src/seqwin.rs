//! Sequence windows for closing segments, as conntrack keeps them. A RST
//! or FIN ends a source-NAT flow only when its sequence number lies near
//! where its sender is in the sequence space; a spoofer who guessed the
//! tuple (the NAT ports are a known range) must also guess that, one
//! chance in about 860 per segment instead of one in one. A close outside
//! the window still goes on to the endpoint, whose TCP judges it (RFC
//! 5961); the balancer only keeps the flow open.
//!
//! Each direction keeps one record of its sender's sequence number, moved
//! only when the sender is `STEP` past it, so a flow's entry is written
//! once per 256 KiB sent, not per segment.

/// The record moves up to a segment's sequence number once it is this far
/// past it.
pub const STEP: u32 = 256 << 10;
/// A close is taken up to this far past the record (the record trails by
/// up to `STEP`, and the sender may have sent more that was lost before
/// reaching the balancer).
pub const AHEAD: u32 = 4 << 20;
/// ... and this far before it (a peer that lost the connection answers
/// with what the other side last acknowledged).
pub const BEHIND: u32 = 1 << 20;

/// Whether a closing segment with sequence number `seq` lies in the window
/// of `rec` (0: no record, any is taken, as before records were kept).
#[inline(always)]
#[must_use]
pub const fn within(rec: u32, seq: u32) -> bool {
    rec == 0 || seq.wrapping_sub(rec).wrapping_add(BEHIND) < AHEAD + BEHIND
}

/// The new record after a segment with sequence number `seq`, if it must
/// move: none kept yet, or the sender `STEP` or more past it but still in
/// the window (a segment far off is a guess, and must not carry the
/// record to where the next guess lands). Never moves back (a
/// retransmission).
#[inline(always)]
#[must_use]
pub const fn advanced(rec: u32, seq: u32) -> Option<u32> {
    let d = seq.wrapping_sub(rec);
    if rec == 0 || (d >= STEP && d < AHEAD) {
        Some(seq)
    } else {
        None
    }
}

/// A record in 16 bits, for a DSR flow (which has no NAT port, so its
/// port's word holds the client's record): the sequence number's top 16
/// bits, never 0 (0 is "no record"). 64 KiB coarse, well inside the
/// window's `BEHIND`.
#[inline(always)]
#[must_use]
pub const fn coarse(seq: u32) -> u16 {
    let c = (seq >> 16) as u16;
    if c == 0 {
        1
    } else {
        c
    }
}

/// The record `coarse` kept, as a sequence number at or before the one it
/// was made from (0 stays 0: no record).
#[inline(always)]
#[must_use]
pub const fn widen(c: u16) -> u32 {
    (c as u32) << 16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_close_near_the_sender_is_taken_and_a_guess_far_off_is_not() {
        let rec = 4_000_000_000;
        assert!(within(rec, rec));
        assert!(within(rec, rec.wrapping_add(AHEAD - 1)));
        assert!(within(rec, rec.wrapping_sub(BEHIND)));
        assert!(!within(rec, rec.wrapping_add(AHEAD)));
        assert!(!within(rec, rec.wrapping_sub(BEHIND + 1)));
        assert!(!within(rec, rec.wrapping_add(1 << 31)));
        assert!(within(0, 12345), "no record: as before");
    }

    #[test]
    fn the_record_moves_forward_in_steps_and_never_back() {
        let rec = u32::MAX - 10;
        assert_eq!(advanced(rec, rec.wrapping_add(STEP - 1)), None);
        assert_eq!(
            advanced(rec, rec.wrapping_add(STEP)),
            Some(rec.wrapping_add(STEP))
        );
        assert_eq!(advanced(rec, rec.wrapping_sub(5)), None);
        assert_eq!(advanced(rec, rec.wrapping_add(AHEAD)), None, "a guess");
        assert_eq!(advanced(rec, rec.wrapping_add(1 << 31)), None);
        assert_eq!(advanced(0, 77), Some(77));
        // The coarse record (DSR) keeps a sender within its window too,
        // and never reads as "none".
        for seq in [0u32, 1, 0xffff, 0x1_0000, 0x1234_5678, u32::MAX] {
            let rec = widen(coarse(seq));
            assert_ne!(rec, 0);
            assert!(within(rec, seq) && within(rec, seq.wrapping_add(AHEAD - STEP)));
            assert!(!within(rec, seq.wrapping_add(1 << 31)));
        }
        // A sender that kept to the record stays within its window.
        let mut r = 1;
        let mut seq = 1u32;
        for _ in 0..10_000 {
            seq = seq.wrapping_add(1448);
            if let Some(n) = advanced(r, seq) {
                r = n;
            }
            assert!(within(r, seq));
        }
    }
}
