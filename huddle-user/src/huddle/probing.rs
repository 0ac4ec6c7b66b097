//! Which backends to probe this round. A probe tells most about a backend
//! the kernel's counters say little of, in this order (`Need`): one
//! resting, unhealthy or suspect (owing an answer, failing attempts); one
//! carrying too little traffic to be judged on it; one idle. One whose
//! own turns fill its window is measured passively, so it is probed only
//! every `active_interval`, for the health its traffic does not show (an
//! HTTP 500 is invisible to the kernel). An address in several services is
//! probed once for those that probe it alike (`Key`). Idle ones share at most `idle_per_second`, the longest
//! unprobed first. A round never holds more than the budget (`max_per_second`
//! x `interval`): those that tell most first, then the longest unprobed.
//!
//! Idle backends came after the busy ones when, at 4,096 services x 16
//! backends, the 2,000 probes a second went round all 65,536 alike: a 5x
//! slow backend of a service taking 6 connections a second each (too few
//! for its window, so judged on probes) was probed every 30 s or so and
//! left its ring 6 s after it slowed (hc-scale; 600 ms at 16 x 16).
//!
//! Before this every backend was probed every 250 ms, all at once: 4,096
//! probes a second at the 1,024-backend limit.

use std::{collections::HashMap, net::SocketAddr, time::Duration};

/// What one probe is: an address, and which of the configuration's
/// probes it gets (services probing alike share one: `Arc::as_ptr`). A
/// TCP and a UDP service on one address are probed apart.
pub type Key = (SocketAddr, usize);

/// How often, and how many.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Budget {
    /// A round's period: how often a backend that needs it is probed.
    pub interval: Duration,
    /// How often a healthy backend carrying traffic is probed.
    pub active_interval: Duration,
    /// The most probes a second, over all backends.
    pub max_per_second: u32,
    /// The most of them for idle backends (`Need::Idle`).
    pub idle_per_second: u32,
}

impl Budget {
    /// The most probes one round sends (at least one).
    #[must_use]
    pub fn per_round(&self) -> usize {
        Self::of_round(self.max_per_second, self.interval)
    }

    /// The most probes of idle backends one round sends (at least one).
    #[must_use]
    pub fn idle_per_round(&self) -> usize {
        Self::of_round(self.idle_per_second, self.interval)
    }

    fn of_round(per_second: u32, interval: Duration) -> usize {
        let n = f64::from(per_second) * interval.as_secs_f64();
        (n.floor() as usize).max(1)
    }
}

/// How much a probe of a backend would tell, most first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Need {
    /// Resting, unhealthy or suspect: every round.
    Now,
    /// Carrying traffic too thin to judge it on: every round.
    Thin,
    /// Idle: every round, after the others.
    Idle,
    /// Measured by its own traffic: every `active_interval`.
    Measured,
}

/// When each address was last probed, by slot: the wants of a round
/// are the same list as the last round's unless the configuration
/// changed, so an address's slot is found by its place in the list, not
/// by a hash (65,536 SipHash lookups four times a second, and the round's
/// vectors allocated afresh, were a quarter of an idle daemon at that size
/// with nothing to probe).
#[derive(Default)]
pub struct Planner {
    /// The addresses of the wants the slots were built for, in order.
    addrs: Vec<Key>,
    /// Each want's slot (an address in two services has one).
    slot_of: Vec<u32>,
    /// When each slot was last probed.
    last: Vec<Option<Duration>>,
    /// Each slot's wants (indices), for handing a result to all of them.
    wants_of: Vec<Vec<u32>>,
    /// Where the next round's idle ones are looked for from.
    idle_cursor: usize,
    /// This round's candidates, kept for their allocation.
    due: Vec<(Need, Option<Duration>, u32)>,
}

impl Planner {
    /// Slots for `wants`' addresses, each keeping when it was last probed.
    fn rebuild(&mut self, wants: &[(Key, Need)]) {
        let before: HashMap<Key, Option<Duration>> = self
            .addrs
            .iter()
            .zip(&self.slot_of)
            .map(|(a, &s)| (*a, self.last[s as usize]))
            .collect();
        let mut slots: HashMap<Key, u32> = HashMap::with_capacity(wants.len());
        self.addrs = wants.iter().map(|w| w.0).collect();
        self.last.clear();
        self.slot_of = wants
            .iter()
            .map(|(a, _)| {
                *slots.entry(*a).or_insert_with(|| {
                    self.last.push(before.get(a).copied().flatten());
                    (self.last.len() - 1) as u32
                })
            })
            .collect();
        self.wants_of = vec![Vec::new(); self.last.len()];
        for (i, &s) in self.slot_of.iter().enumerate() {
            self.wants_of[s as usize].push(i as u32);
        }
    }

    /// The wants (indices into the last `plan_indices`' list) with the
    /// same address as want `i`, `i` among them.
    #[must_use]
    pub fn sharing(&self, i: usize) -> &[u32] {
        self.slot_of
            .get(i)
            .and_then(|&s| self.wants_of.get(s as usize))
            .map_or(&[], Vec::as_slice)
    }

    /// The wants to probe at `now` (indices, one an address), from
    /// `wants`: each target's address and how much a probe tells (`Need`);
    /// an address listed twice counts as the more needed.
    pub fn plan_indices(&mut self, wants: &[(Key, Need)], now: Duration, b: &Budget) -> Vec<usize> {
        if wants.len() != self.addrs.len() || wants.iter().zip(&self.addrs).any(|(w, a)| w.0 != *a)
        {
            self.rebuild(wants);
        }
        // A little early counts as due: rounds drift by a few ms.
        let slack = b.interval / 4;
        // (need, when last probed: never sorts first, want index)
        let mut due = std::mem::take(&mut self.due);
        due.clear();
        let is_due = |last: Option<Duration>, every: Duration| {
            last.is_none_or(|t| now.saturating_sub(t) + slack >= every)
        };
        for (i, &(_, n)) in wants.iter().enumerate() {
            // Idle ones are taken below, in turn.
            if n == Need::Idle {
                continue;
            }
            let every = if n == Need::Measured {
                b.active_interval
            } else {
                b.interval
            };
            let last = self.last[self.slot_of[i] as usize];
            if is_due(last, every) {
                due.push((n, last, i as u32));
            }
        }
        // Idle ones up to their share, in turn through the list from
        // where the last round stopped: the longest unprobed first without
        // ordering 65,536 of them a round.
        // Only as many as the round has room for after the more needed,
        // so the turn passes no idle one it did not take.
        let ahead = due.iter().filter(|d| d.0 < Need::Idle).count();
        let q = b.idle_per_round().min(b.per_round().saturating_sub(ahead));
        let mut k = 0;
        let mut taken = 0;
        while taken < q && k < wants.len() {
            let i = (self.idle_cursor + k) % wants.len();
            k += 1;
            let last = self.last[self.slot_of[i] as usize];
            if wants[i].1 == Need::Idle && is_due(last, b.interval) {
                due.push((Need::Idle, last, i as u32));
                taken += 1;
            }
        }
        self.idle_cursor = (self.idle_cursor + k) % wants.len().max(1);
        // Most needed first, then the longest unprobed, then by address:
        // only the round's share is sorted (at 65,536 backends sorting all
        // of them every round was a sixth of an idle daemon's time).
        type Due = (Need, Option<Duration>, u32);
        let order = |x: &Due, y: &Due| {
            x.0.cmp(&y.0)
                .then(x.1.cmp(&y.1))
                .then(wants[x.2 as usize].0.cmp(&wants[y.2 as usize].0))
        };
        let k = b.per_round();
        if due.len() > k {
            due.select_nth_unstable_by(k - 1, order);
            due.truncate(k);
        }
        due.sort_by(order);
        // An address in two services is probed once, as the more urgent
        // (sorted first): its slot is marked probed `now` when taken.
        let mut chosen = Vec::with_capacity(due.len());
        for &(_, _, i) in &due {
            let slot = self.slot_of[i as usize] as usize;
            if self.last[slot] != Some(now) {
                self.last[slot] = Some(now);
                chosen.push(i as usize);
            }
        }
        self.due = due;
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(n: u16) -> Key {
        (SocketAddr::from(([10, 0, 0, 1], n)), 0)
    }

    const MS: Duration = Duration::from_millis(1);

    /// `plan_indices`, as addresses.
    fn plan(p: &mut Planner, w: &[(Key, Need)], now: Duration, b: &Budget) -> Vec<Key> {
        let chosen = p.plan_indices(w, now, b);
        chosen.into_iter().map(|i| w[i].0).collect()
    }

    fn budget(max_per_second: u32) -> Budget {
        Budget {
            interval: 250 * MS,
            active_interval: 2000 * MS,
            max_per_second,
            idle_per_second: max_per_second,
        }
    }

    #[test]
    fn active_backends_are_probed_every_active_interval_the_others_every_round() {
        let mut p = Planner::default();
        let b = budget(10_000);
        let wants = [
            (a(1), Need::Now),
            (a(2), Need::Measured),
            (a(3), Need::Measured),
        ];
        assert_eq!(
            plan(&mut p, &wants, Duration::ZERO, &b).len(),
            3,
            "all at first"
        );
        for k in 1..8u32 {
            assert_eq!(
                plan(&mut p, &wants, 250 * k * MS, &b),
                vec![a(1)],
                "round {k}"
            );
        }
        let mut r = plan(&mut p, &wants, 2000 * MS, &b);
        r.sort();
        assert_eq!(r, vec![a(1), a(2), a(3)]);
    }

    #[test]
    fn an_address_in_two_services_is_probed_once_and_urgent_if_either_says() {
        let mut p = Planner::default();
        let b = budget(10_000);
        let wants = [(a(1), Need::Measured), (a(1), Need::Now)];
        assert_eq!(plan(&mut p, &wants, Duration::ZERO, &b), vec![a(1)]);
        assert_eq!(
            p.plan_indices(&wants, 250 * MS, &b),
            vec![1],
            "as the urgent one"
        );
        assert_eq!(p.sharing(1), &[0, 1], "its result goes to both");
    }

    #[test]
    fn the_budget_takes_urgent_first_then_the_longest_unprobed() {
        let mut p = Planner::default();
        // 8 a second: 2 a round.
        let b = budget(8);
        let wants: Vec<_> = (1..=6)
            .map(|n| (a(n), if n == 5 { Need::Now } else { Need::Idle }))
            .collect();
        let r1 = plan(&mut p, &wants, Duration::ZERO, &b);
        assert_eq!(r1, vec![a(5), a(1)]);
        let r2 = plan(&mut p, &wants, 250 * MS, &b);
        assert_eq!(r2, vec![a(5), a(2)], "then the never probed, in order");
        let r3 = plan(&mut p, &wants, 500 * MS, &b);
        assert_eq!(r3, vec![a(5), a(3)]);
        // Every address gets its turn within the budget's reach.
        let mut seen = std::collections::HashSet::new();
        for k in 3..12u32 {
            seen.extend(plan(&mut p, &wants, 250 * k * MS, &b));
        }
        assert_eq!(seen.len(), 6);
    }

    #[test]
    fn idle_backends_share_their_own_part_of_the_budget_in_turn() {
        let mut p = Planner::default();
        // 40 a second, 10 a round; idle ones 8 a second, 2 a round.
        let b = Budget {
            idle_per_second: 8,
            ..budget(40)
        };
        let mut wants: Vec<_> = (1..=6).map(|n| (a(n), Need::Idle)).collect();
        wants.push((a(100), Need::Now));
        wants.push((a(101), Need::Measured));
        let r = plan(&mut p, &wants, Duration::ZERO, &b);
        assert_eq!(
            r,
            vec![a(100), a(1), a(2), a(101)],
            "the rest of the round is not given to the idle"
        );
        assert_eq!(plan(&mut p, &wants, 250 * MS, &b), vec![a(100), a(3), a(4)]);
        assert_eq!(plan(&mut p, &wants, 500 * MS, &b), vec![a(100), a(5), a(6)]);
        assert_eq!(
            plan(&mut p, &wants, 750 * MS, &b),
            vec![a(100), a(1), a(2)],
            "in turn"
        );
    }

    #[test]
    fn a_changed_list_keeps_when_each_address_was_probed() {
        let mut p = Planner::default();
        let b = budget(10_000);
        let wants = [(a(1), Need::Idle), (a(2), Need::Idle)];
        assert_eq!(plan(&mut p, &wants, Duration::ZERO, &b).len(), 2);
        // A reload adds a(3) in front and reorders: only a(3) is due.
        let wants = [(a(3), Need::Idle), (a(2), Need::Idle), (a(1), Need::Idle)];
        assert_eq!(plan(&mut p, &wants, 100 * MS, &b), vec![a(3)]);
        assert_eq!(plan(&mut p, &wants, 250 * MS, &b), vec![a(1), a(2)]);
    }

    #[test]
    fn thin_traffic_is_probed_every_round_before_the_idle() {
        let mut p = Planner::default();
        // 8 a second: 2 a round, among 1 suspect, 1 thin and 100 idle.
        let b = budget(8);
        let mut wants: Vec<_> = (1..=100).map(|n| (a(n), Need::Idle)).collect();
        wants.push((a(200), Need::Thin));
        wants.push((a(201), Need::Now));
        for k in 0..20u32 {
            let r = plan(&mut p, &wants, 250 * k * MS, &b);
            assert_eq!(r, vec![a(201), a(200)], "round {k}");
        }
        // With room, the idle get the rest of each round.
        let mut p = Planner::default();
        let r = plan(&mut p, &wants, Duration::ZERO, &budget(1_000));
        assert_eq!(r.len(), 102);
    }
}
