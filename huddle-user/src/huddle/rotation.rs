//! The huddle's rotation: which backends of one service are in the inner
//! ring (taking new connections) and which rest in the outer ring.
//!
//! Pure and deterministic: the caller sets each member's temperature and
//! health, then calls [`Engine::tick`] with the current time; the engine
//! returns the moves it made. Rules:
//!
//! - an unhealthy inner member leaves at once (never taking the inner ring
//!   below `min_inner` unless a healthy member can take its place);
//! - a hot inner member (temperature at or above `heat` x weight) leaves,
//!   hottest first, at most `max(1, inner / 3)` per tick, not within
//!   `cooldown` of its last move, never below `min_inner`;
//! - a resting member returns once it has rested (`min_rest`, doubled for
//!   each eviction in a row up to `max_rest`) and cooled to `cool` or
//!   below, coolest first; the gap between `cool` and `heat` is the
//!   hysteresis that stops flapping;
//! - if the inner ring would hold fewer than `min_inner` members, the
//!   coolest healthy resting ones are called back early, and failing
//!   those the least hot unhealthy ones (panic mode): never an empty ring.

use crate::config::tuning::RotationParams;
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Place {
    Inner,
    Outer,
}

impl Place {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Place::Inner => "inner",
            Place::Outer => "outer",
        }
    }
}

/// Why a member moved.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum Reason {
    /// Temperature at or above its heat threshold.
    Hot,
    /// Failing health signals (the text says which).
    Unhealthy(String),
    /// Rested and cooled down.
    Cooled,
    /// Warm-up over.
    WarmedUp,
    /// Called back early: the inner ring was below its minimum.
    Refill,
    /// Called back unhealthy: no healthy member was left to call.
    Panic,
    /// Taken out or put back by an operator.
    Drained,
    Undrained,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::Hot => f.write_str("hot"),
            Reason::Unhealthy(why) => write!(f, "unhealthy: {why}"),
            Reason::Cooled => f.write_str("cooled"),
            Reason::WarmedUp => f.write_str("warm-up over"),
            Reason::Refill => f.write_str("inner ring below minimum"),
            Reason::Panic => f.write_str("panic: no healthy backend left to call"),
            Reason::Drained => f.write_str("drained by operator"),
            Reason::Undrained => f.write_str("restored by operator"),
        }
    }
}

/// A move the engine made.
#[derive(Clone, Debug, PartialEq)]
pub struct Move {
    pub member: usize,
    pub to: Place,
    pub reason: Reason,
    pub temperature: f64,
}

#[derive(Clone, Debug)]
pub struct Member {
    pub place: Place,
    pub temperature: f64,
    /// Scales the heat threshold (2.0: twice as hard to evict).
    pub weight: f64,
    /// Why it is unhealthy, if it is.
    pub unhealthy: Option<String>,
    pub drained: bool,
    /// When it last changed place.
    pub moved_at: Option<Duration>,
    /// Earliest return to the inner ring.
    pub rest_until: Duration,
    /// Evictions in a row (reset after a long enough stay inside).
    pub strikes: u32,
    pub rotations: u64,
    pub last_reason: Option<Reason>,
}

pub struct Engine {
    pub params: RotationParams,
    pub members: Vec<Member>,
    /// True while the inner ring holds unhealthy members or is below its
    /// minimum for lack of healthy ones.
    pub panic: bool,
}

impl Engine {
    /// Members with these weights, all inner (or all resting for
    /// `warmup`), at time `now`.
    #[must_use]
    pub fn new(params: RotationParams, weights: &[f64], now: Duration) -> Engine {
        let warm = !params.warmup.is_zero();
        let members = weights
            .iter()
            .map(|w| Member {
                place: if warm { Place::Outer } else { Place::Inner },
                temperature: 0.0,
                weight: if w.is_finite() && *w > 0.0 { *w } else { 1.0 },
                unhealthy: None,
                drained: false,
                moved_at: None,
                rest_until: now + params.warmup,
                strikes: 0,
                rotations: 0,
                last_reason: None,
            })
            .collect();
        let mut e = Engine {
            params,
            members,
            panic: false,
        };
        if warm {
            // Never start empty: the refill brings `min_inner` in now.
            e.tick(now);
        }
        e
    }

    /// Inner members, in member order (the ring the kernel gets).
    #[must_use]
    pub fn inner(&self) -> Vec<usize> {
        self.placed(Place::Inner)
    }

    /// Resting members, coolest first.
    #[must_use]
    pub fn outer(&self) -> Vec<usize> {
        let mut v = self.placed(Place::Outer);
        v.sort_by(|a, b| {
            self.members[*a]
                .temperature
                .total_cmp(&self.members[*b].temperature)
                .then(a.cmp(b))
        });
        v
    }

    /// How many members are inner (without building the list).
    fn inner_len(&self) -> usize {
        self.members
            .iter()
            .filter(|m| m.place == Place::Inner)
            .count()
    }

    fn placed(&self, place: Place) -> Vec<usize> {
        (0..self.members.len())
            .filter(|i| self.members[*i].place == place)
            .collect()
    }

    fn heat_of(&self, i: usize) -> f64 {
        self.params.heat * self.members[i].weight
    }

    fn rest_for(&self, strikes: u32) -> Duration {
        let factor = 1u32 << strikes.min(16);
        self.params
            .min_rest
            .saturating_mul(factor)
            .min(self.params.max_rest.max(self.params.min_rest))
    }

    fn shift(&mut self, i: usize, to: Place, reason: Reason, now: Duration, moves: &mut Vec<Move>) {
        if to == Place::Outer {
            let strikes = self.members[i].strikes;
            let rest = if matches!(reason, Reason::Drained) {
                Duration::ZERO
            } else {
                self.rest_for(strikes)
            };
            let m = &mut self.members[i];
            m.strikes = strikes.saturating_add(1);
            m.rest_until = now + rest;
        }
        let m = &mut self.members[i];
        m.place = to;
        m.moved_at = Some(now);
        m.rotations += 1;
        m.last_reason = Some(reason.clone());
        moves.push(Move {
            member: i,
            to,
            reason,
            temperature: m.temperature,
        });
    }

    /// Takes a member out of (or puts it back into) rotation by hand.
    pub fn set_drained(&mut self, i: usize, drained: bool, now: Duration) -> Vec<Move> {
        let mut moves = Vec::new();
        self.members[i].drained = drained;
        if drained && self.members[i].place == Place::Inner {
            self.shift(i, Place::Outer, Reason::Drained, now, &mut moves);
        } else if !drained && self.members[i].place == Place::Outer {
            self.members[i].rest_until = now;
            self.shift(i, Place::Inner, Reason::Undrained, now, &mut moves);
        }
        moves
    }

    /// One rotation step at time `now`.
    pub fn tick(&mut self, now: Duration) -> Vec<Move> {
        let p = self.params;
        let mut moves = Vec::new();
        // Members that stayed inside long enough are forgiven.
        for m in &mut self.members {
            if m.place == Place::Inner
                && m.strikes > 0
                && m.moved_at
                    .is_some_and(|t| now.saturating_sub(t) >= p.max_rest)
            {
                m.strikes = 0;
            }
        }

        // 1. Unhealthy members leave promptly, worst first.
        let mut sick: Vec<usize> = self
            .inner()
            .into_iter()
            .filter(|i| self.members[*i].unhealthy.is_some())
            .collect();
        sick.sort_by(|a, b| {
            self.members[*b]
                .temperature
                .total_cmp(&self.members[*a].temperature)
        });
        // Healthy resting members that could stand in for a sick one.
        let mut spare = self
            .members
            .iter()
            .filter(|m| m.place == Place::Outer && m.unhealthy.is_none() && !m.drained)
            .count();
        for i in sick {
            let inner = self.inner_len();
            if inner > p.min_inner {
                // fine: the ring stays at or above its minimum
            } else if spare > 0 {
                spare -= 1; // the refill below calls a healthy one back
            } else {
                continue;
            }
            let why = self.members[i].unhealthy.clone().unwrap_or_default();
            self.shift(i, Place::Outer, Reason::Unhealthy(why), now, &mut moves);
        }

        // 2. Hot members leave, hottest first, capped per tick.
        let cap = (self.inner_len() / 3).max(1);
        let mut hot: Vec<usize> = self
            .inner()
            .into_iter()
            .filter(|i| {
                let m = &self.members[*i];
                m.temperature >= self.heat_of(*i)
                    && m.moved_at
                        .is_none_or(|t| now.saturating_sub(t) >= p.cooldown)
            })
            .collect();
        hot.sort_by(|a, b| {
            self.members[*b]
                .temperature
                .total_cmp(&self.members[*a].temperature)
        });
        for i in hot.into_iter().take(cap) {
            if self.inner_len() <= p.min_inner {
                break;
            }
            self.shift(i, Place::Outer, Reason::Hot, now, &mut moves);
        }

        // 3. Rested, cool, healthy members return, coolest first.
        for i in self.outer() {
            let m = &self.members[i];
            if m.drained || m.unhealthy.is_some() || now < m.rest_until || m.temperature > p.cool {
                continue;
            }
            let reason = if m.moved_at.is_none() {
                Reason::WarmedUp
            } else {
                Reason::Cooled
            };
            self.shift(i, Place::Inner, reason, now, &mut moves);
        }

        // 4. Never below the minimum, never empty.
        let want = p.min_inner.max(1);
        for pass_unhealthy in [false, true] {
            for i in self.outer() {
                if self.inner_len() >= want {
                    break;
                }
                let m = &self.members[i];
                if m.drained || m.unhealthy.is_some() != pass_unhealthy {
                    continue;
                }
                let reason = if pass_unhealthy {
                    Reason::Panic
                } else {
                    Reason::Refill
                };
                self.shift(i, Place::Inner, reason, now, &mut moves);
            }
        }
        self.panic = self
            .inner()
            .iter()
            .any(|i| self.members[*i].unhealthy.is_some())
            || self.inner_len() < want;
        moves
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn engine(n: usize) -> Engine {
        Engine::new(RotationParams::default(), &vec![1.0; n], Duration::ZERO)
    }

    fn temps(e: &mut Engine, t: &[f64]) {
        for (m, t) in e.members.iter_mut().zip(t) {
            m.temperature = *t;
        }
    }

    #[test]
    fn a_hot_member_rests_and_returns_only_when_cool_and_rested() {
        let mut e = engine(4);
        temps(&mut e, &[0.1, 0.1, 0.9, 0.1]);
        let m = e.tick(10 * S);
        assert_eq!(m.len(), 1);
        assert_eq!(
            (m[0].member, m[0].to, &m[0].reason),
            (2, Place::Outer, &Reason::Hot)
        );
        assert_eq!(e.inner(), vec![0, 1, 3]);
        // Cooled at once, but it must rest min_rest.
        temps(&mut e, &[0.1, 0.1, 0.0, 0.1]);
        assert!(e.tick(19 * S).is_empty());
        let m = e.tick(20 * S);
        assert_eq!((m[0].member, &m[0].reason), (2, &Reason::Cooled));
        assert_eq!(e.inner(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn hysteresis_holds_across_a_wobble_between_the_thresholds() {
        let mut e = engine(4);
        temps(&mut e, &[0.1, 0.1, 0.6, 0.1]);
        assert_eq!(e.tick(10 * S).len(), 1);
        // Wobbling between cool and heat: rested long enough, yet stays out.
        for k in 0..100u64 {
            let t = if k % 2 == 0 { 0.31 } else { 0.54 };
            temps(&mut e, &[0.1, 0.1, t, 0.1]);
            assert!(e.tick(30 * S + ms(100 * k)).is_empty(), "tick {k}");
        }
        // And an inner member wobbling below heat never leaves.
        let mut e = engine(4);
        for k in 0..100u64 {
            let t = if k % 2 == 0 { 0.31 } else { 0.54 };
            temps(&mut e, &[0.1, t, 0.1, 0.1]);
            assert!(e.tick(10 * S + ms(100 * k)).is_empty());
        }
    }

    #[test]
    fn evictions_are_capped_per_tick_and_stop_at_the_minimum() {
        let mut e = engine(9);
        temps(&mut e, &[0.9; 9]);
        assert_eq!(e.tick(10 * S).len(), 3, "max(1, 9/3)");
        assert_eq!(e.tick(10 * S + ms(100)).len(), 2, "max(1, 6/3)");
        assert_eq!(e.tick(10 * S + ms(200)).len(), 1);
        assert_eq!(e.tick(10 * S + ms(300)).len(), 1);
        assert_eq!(e.inner().len(), 2, "never below min_inner");
        assert!(e.tick(10 * S + ms(400)).is_empty());
    }

    #[test]
    fn weight_scales_the_heat_threshold() {
        let mut e = Engine::new(
            RotationParams::default(),
            &[1.0, 1.0, 1.5, 1.0],
            Duration::ZERO,
        );
        temps(&mut e, &[0.0, 0.0, 0.8, 0.0]);
        assert!(e.tick(10 * S).is_empty(), "0.8 < 0.55 x 1.5");
        temps(&mut e, &[0.0, 0.0, 0.83, 0.0]);
        assert_eq!(e.tick(10 * S).len(), 1);
    }

    #[test]
    fn an_unhealthy_member_leaves_at_once_but_never_empties_the_ring() {
        let mut e = engine(3);
        e.members[1].unhealthy = Some("hung".into());
        let m = e.tick(ms(100));
        assert_eq!(m[0].reason, Reason::Unhealthy("hung".into()));
        assert_eq!(e.inner(), vec![0, 2]);
        assert!(!e.panic);
        // A second one: min_inner 2 and nobody healthy to replace it.
        e.members[2].unhealthy = Some("refused".into());
        assert!(e.tick(ms(200)).is_empty());
        assert_eq!(e.inner(), vec![0, 2]);
        assert!(e.panic, "keeping an unhealthy member is panic mode");
        // All three sick: the ring still holds two, the least hot.
        e.members[0].unhealthy = Some("refused".into());
        e.members[1].temperature = 0.9;
        e.tick(ms(300));
        assert_eq!(e.inner().len(), 2);
        assert!(e.panic);
        // One recovers (still resting): it is called back early to replace
        // an unhealthy one.
        e.members[1].unhealthy = None;
        let m = e.tick(ms(400));
        assert!(
            m.iter()
                .any(|m| m.member == 1 && m.reason == Reason::Refill),
            "{m:?}"
        );
        assert!(e.inner().contains(&1));
    }

    #[test]
    fn repeated_evictions_back_off() {
        let mut e = engine(4);
        let mut t = 10 * S;
        let mut rests = Vec::new();
        for _ in 0..4 {
            temps(&mut e, &[0.0, 0.0, 0.9, 0.0]);
            assert_eq!(e.tick(t).len(), 1);
            temps(&mut e, &[0.0, 0.0, 0.0, 0.0]);
            let out = t;
            while e.tick(t).is_empty() {
                t += ms(100);
            }
            rests.push((t - out).as_secs());
            t += 6 * S; // past the cooldown, then hot again
        }
        assert_eq!(rests, vec![10, 20, 40, 80]);
    }

    #[test]
    fn the_outer_ring_is_ordered_by_current_temperature() {
        let mut e = Engine::new(
            RotationParams {
                min_inner: 1,
                ..RotationParams::default()
            },
            &[1.0; 6],
            Duration::ZERO,
        );
        temps(&mut e, &[0.9, 0.9, 0.9, 0.9, 0.9, 0.0]);
        for k in 0..5 {
            e.tick(10 * S + ms(100 * k));
        }
        assert_eq!(e.outer().len(), 5);
        temps(&mut e, &[0.5, 0.1, 0.4, 0.2, 0.3, 0.0]);
        assert_eq!(e.outer(), vec![1, 3, 4, 2, 0]);
        temps(&mut e, &[0.05, 0.6, 0.4, 0.2, 0.3, 0.0]);
        assert_eq!(e.outer(), vec![0, 3, 4, 2, 1]);
        // Coolest first: at a tick where all have rested, those at or
        // below cool return in that order.
        let m = e.tick(60 * S);
        let back: Vec<usize> = m.iter().map(|m| m.member).collect();
        assert_eq!(back, vec![0, 3, 4]);
    }

    #[test]
    fn warm_up_keeps_new_members_out_but_never_empties_the_ring() {
        let p = RotationParams {
            warmup: 3 * S,
            ..RotationParams::default()
        };
        let mut e = Engine::new(p, &[1.0; 4], Duration::ZERO);
        assert_eq!(e.inner(), vec![0, 1], "min_inner called in at once");
        assert!(e.tick(2 * S).is_empty());
        let m = e.tick(3 * S);
        assert_eq!(m.len(), 2);
        assert!(m.iter().all(|m| m.reason == Reason::WarmedUp));
    }

    use crate::test_rng::Rng;

    #[test]
    fn property_random_signals_never_break_the_rules() {
        for seed in 1..=300u64 {
            let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let n = 1 + r.below(10) as usize;
            let p = RotationParams {
                min_inner: 1 + r.below(4) as usize,
                warmup: if r.below(3) == 0 {
                    2 * S
                } else {
                    Duration::ZERO
                },
                ..RotationParams::default()
            };
            let mut e = Engine::new(p, &vec![1.0; n], Duration::ZERO);
            let mut last_hot: Vec<Option<Duration>> = vec![None; n];
            let mut now = Duration::ZERO;
            for step in 0..600 {
                now += ms(50 + r.below(200));
                for m in &mut e.members {
                    // Sticky signals with occasional jumps, NaN included.
                    if r.below(10) == 0 {
                        m.temperature = match r.below(20) {
                            0 => f64::NAN,
                            _ => r.unit(),
                        };
                        if !m.temperature.is_finite() {
                            m.temperature = 1.0; // the daemon sanitises
                        }
                    }
                    if r.below(30) == 0 {
                        m.unhealthy = if r.below(3) == 0 {
                            Some("x".into())
                        } else {
                            None
                        };
                    }
                }
                let inner_before = e.inner().len();
                let moves = e.tick(now);
                let ctx = format!("seed {seed} step {step} n {n} {p:?}");
                let inner = e.inner();
                assert!(!inner.is_empty(), "empty inner ring: {ctx}");
                assert!(inner.len() >= p.min_inner.min(n), "below minimum: {ctx}");
                let healthy = e.members.iter().filter(|m| m.unhealthy.is_none()).count();
                if healthy >= p.min_inner {
                    assert!(
                        inner.iter().all(|i| e.members[*i].unhealthy.is_none()),
                        "unhealthy member kept though healthy ones exist: {ctx}"
                    );
                }
                let hot = moves.iter().filter(|m| m.reason == Reason::Hot).count();
                assert!(hot <= (inner_before / 3).max(1), "eviction cap: {ctx}");
                for m in &moves {
                    match m.reason {
                        Reason::Hot => {
                            if let Some(t) = last_hot[m.member] {
                                assert!(now - t >= p.cooldown, "flapping: {ctx}");
                            }
                            last_hot[m.member] = Some(now);
                        }
                        Reason::Cooled => {
                            assert!(m.temperature <= p.cool, "returned warm: {ctx}");
                            let out = last_hot[m.member];
                            if let Some(t) = out {
                                assert!(now - t >= p.min_rest, "rest too short: {ctx}");
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}
