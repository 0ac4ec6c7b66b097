//! Request latency as the XDP program measures it: a per-backend, per-CPU
//! histogram of time-to-first-byte, and a shared "owes an answer since"
//! record that lets the control plane see a hung backend before any reply.
//!
//! Buckets are log-linear: four per power of two from 1 µs, so a bucket is
//! at most 25% wide and percentiles read from it are within that.

/// Histogram buckets. Bucket 0 is below 1 µs; the last one is open-ended
/// (from about 36 minutes).
pub const LATENCY_BUCKETS: usize = 128;

/// log2 of the smallest bucketed latency (1024 ns).
const MIN_SHIFT: u32 = 10;

/// Per backend, per CPU: counts of time-to-first-byte samples by bucket.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Latency {
    pub buckets: [u64; LATENCY_BUCKETS],
}
shared!(Latency, 8 * LATENCY_BUCKETS);

impl Default for Latency {
    fn default() -> Self {
        Latency {
            buckets: [0; LATENCY_BUCKETS],
        }
    }
}

impl Latency {
    /// Adds `o`'s counts bucket by bucket (CPUs, balancers, backends:
    /// cumulative counters, so wrapping as the kernel's do).
    pub fn add(&mut self, o: &Latency) {
        for (a, b) in self.buckets.iter_mut().zip(o.buckets.iter()) {
            *a = a.wrapping_add(*b);
        }
    }
}

/// Per backend, per CPU: the source (a client's /24, or /64) that gives
/// most of the backend's request samples, as a two-counter Misra-Gries
/// summary: a source in a slot raises its count, any other source takes
/// a slot at 0 or else lowers both. A source with more than a third of
/// the samples holds a slot, and two heavy sources (a client aiming
/// turns at the backend beside a big honest one) keep theirs rather than
/// knocking each other out. The samples of the slot counted more (of two
/// alike, the lower prefix: the same source on every CPU, whichever
/// reached it first) go to `LATENCY_HEAVY`, all others to `LATENCY`, so
/// no one source can make a backend look slow by itself (the control
/// plane takes the lower of the two medians).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeavySource {
    /// `source_prefix` of the sources holding the slots, and their counts.
    pub prefix: [u64; 2],
    pub count: [u64; 2],
}
shared!(HeavySource, 32);

impl HeavySource {
    /// Counts a sample from source `key` (`source_prefix`); whether it is
    /// the heavy source's.
    #[inline(always)]
    pub fn count_sample(&mut self, key: u64) -> bool {
        for i in 0..2 {
            if self.prefix[i] == key && self.count[i] > 0 {
                if self.count[i] < HEAVY_HOLD {
                    self.count[i] += 1;
                }
                return self.leads(i == 0);
            }
        }
        for i in 0..2 {
            if self.count[i] == 0 {
                self.prefix[i] = key;
                self.count[i] = 1;
                return self.leads(i == 0);
            }
        }
        self.count[0] -= 1;
        self.count[1] -= 1;
        false
    }

    /// Whether slot 0 (`first`) or slot 1 is the heavy one: counted
    /// more, or as much with the lower prefix.
    #[inline(always)]
    fn leads(&self, first: bool) -> bool {
        let (a, b) = (self.count[0], self.count[1]);
        let zero_leads = a > b || (a == b && self.prefix[0] <= self.prefix[1]);
        zero_leads == first
    }
}

/// The most `HeavySource::count` grows: a heavy source that stops is
/// displaced after this many samples from others.
pub const HEAVY_HOLD: u64 = 32;

/// A client address's source for `HeavySource`: its /24 (IPv4, tagged so
/// it is no IPv6 prefix) or its /64.
#[inline(always)]
#[must_use]
pub fn source_prefix(a: &crate::Addr, family: u8) -> u64 {
    if family == crate::FAMILY_V4 {
        (1 << 63) | u64::from(a[0]) << 16 | u64::from(a[1]) << 8 | u64::from(a[2])
    } else {
        u64::from_be_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]])
    }
}

/// Per backend, shared by all CPUs: `bpf_ktime_get_ns()` since when the
/// backend owes an answer, 0 when it owes none. Plain stores: a lost race
/// only delays detection until the next request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pulse {
    /// First request turn not followed by any answer data from the backend.
    pub turn_wait_ns: u64,
    /// First SYN not followed by any SYN-ACK or RST from the backend.
    pub syn_wait_ns: u64,
    /// Request turns started at the backend since `turn_wait_ns`, on any
    /// flow (counted up to `HUNG_EVIDENCE`), and when the last of those
    /// started: the evidence. One owed turn is no fault (a long poll);
    /// further requests unanswered as well are. Until it has had that
    /// many, a backend owing past the pass-over limit still gets new
    /// flows.
    pub evidence: u64,
    pub evidence_ns: u64,
}
shared!(Pulse, 32);

/// Request turns a backend owing an answer must be sent, on any flow, each
/// unanswered, with nothing else answered, before it is suspected hung
/// (and new flows pass it over). Until issue 51 the kernel's evidence was
/// the verdict, and it took 4 (2 called a healthy backend hung in 2 of 11
/// all-kinds runs); now a probe sent at once decides (the daemon's
/// `readings::suspicion`), so one is enough: a SIGSTOPped backend cost
/// 3.3 +- 1.2 failed requests at 200 connections/s (hc-compare, 3 trials,
/// 7 December 2026), against 5.0 +- 0.0 with 4; the kinds tests moved
/// nothing.
pub const HUNG_EVIDENCE: u64 = 1;

/// Index of the most significant set bit (0 for 0), without a loop or a
/// count-leading-zeros instruction (BPF has none).
#[inline(always)]
#[must_use]
pub const fn msb(mut v: u64) -> u32 {
    let mut r = 0;
    if v >> 32 != 0 {
        v >>= 32;
        r += 32;
    }
    if v >> 16 != 0 {
        v >>= 16;
        r += 16;
    }
    if v >> 8 != 0 {
        v >>= 8;
        r += 8;
    }
    if v >> 4 != 0 {
        v >>= 4;
        r += 4;
    }
    if v >> 2 != 0 {
        v >>= 2;
        r += 2;
    }
    if v >> 1 != 0 {
        r += 1;
    }
    r
}

/// The bucket of a latency in nanoseconds.
#[inline(always)]
#[must_use]
pub const fn latency_bucket(ns: u64) -> usize {
    if ns < (1 << MIN_SHIFT) {
        return 0;
    }
    let m = msb(ns);
    let sub = (ns >> (m - 2)) & 3;
    let b = ((m - MIN_SHIFT) * 4) as usize + sub as usize + 1;
    if b < LATENCY_BUCKETS {
        b
    } else {
        LATENCY_BUCKETS - 1
    }
}

/// The latencies bucket `b` holds, in nanoseconds: `[low, high)`.
#[must_use]
pub const fn bucket_bounds(b: usize) -> (u64, u64) {
    if b == 0 {
        return (0, 1 << MIN_SHIFT);
    }
    let m = (b as u32 - 1) / 4 + MIN_SHIFT;
    let sub = (b as u64 - 1) % 4;
    ((4 + sub) << (m - 2), (5 + sub) << (m - 2))
}

#[cfg(test)]
mod tests {

    /// Two CPUs see the same two sources arrive in opposite orders: each
    /// calls the same one heavy (with the slot taken first as the heavy
    /// one, CPU 0 said A and CPU 1 said B, and each part held both).
    #[test]
    fn every_cpu_calls_the_same_source_heavy_whichever_came_first() {
        let (a, b) = (
            source_prefix(
                &[10, 213, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                crate::FAMILY_V4,
            ),
            source_prefix(
                &[10, 213, 7, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                crate::FAMILY_V4,
            ),
        );
        let (mut cpu0, mut cpu1) = (HeavySource::default(), HeavySource::default());
        // The heavy source each CPU names over the last 40 samples.
        let (mut heavy0, mut heavy1) = ([0u64; 40], [0u64; 40]);
        for k in 0..200 {
            // 55% A, 45% B, in opposite orders on the two CPUs.
            let (x, y) = if k % 20 < 11 { (a, b) } else { (b, a) };
            let (h0, h1) = (cpu0.count_sample(x), cpu1.count_sample(y));
            if k >= 160 {
                heavy0[k - 160] = if h0 {
                    x
                } else if x == a {
                    b
                } else {
                    a
                };
                heavy1[k - 160] = if h1 {
                    y
                } else if y == a {
                    b
                } else {
                    a
                };
            }
        }
        assert!(
            heavy0.iter().all(|p| *p == heavy0[0]),
            "CPU 0 flips: {heavy0:?}"
        );
        assert_eq!(heavy0[0], heavy1[0], "the CPUs disagree");
        assert!(
            heavy1.iter().all(|p| *p == heavy0[0]),
            "CPU 1 flips: {heavy1:?}"
        );
    }

    use super::*;

    #[test]
    fn msb_matches_leading_zeros() {
        for v in [1u64, 2, 3, 1023, 1024, 1 << 40, u64::MAX, 12345678] {
            assert_eq!(msb(v), 63 - v.leading_zeros(), "{v}");
        }
        assert_eq!(msb(0), 0);
    }

    #[test]
    fn every_latency_falls_inside_its_bucket() {
        let mut v = 1u64;
        while v < 1 << 41 {
            for x in [v, v + v / 3, v * 2 - 1] {
                let b = latency_bucket(x);
                let (lo, hi) = bucket_bounds(b);
                assert!(lo <= x && x < hi, "{x} in bucket {b} [{lo}, {hi})");
                if b > 0 {
                    assert!(hi - lo <= lo / 4, "bucket {b} too wide");
                }
            }
            v *= 2;
        }
        assert_eq!(latency_bucket(u64::MAX), LATENCY_BUCKETS - 1);
    }
}
