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
//!   those the least hot unhealthy ones (panic mode): never an empty ring;
//! - while held (`hold_until`, set when the cluster loses or regains a
//!   member) no member leaves hot or returns: a ring change then would
//!   break the moved connections no balancer has shared yet. The sick
//!   still leave, the floor still holds.

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
    /// Placed as the cluster's last ring had it (this balancer took over
    /// deciding from a leader it lost).
    Followed,
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
            Reason::Followed => f.write_str("as the lost leader's ring"),
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
    /// Until then no hot leave and no rested return (see the module).
    pub hold_until: Duration,
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
            hold_until: Duration::ZERO,
        };
        if warm {
            // Never start empty: the refill brings `min_inner` in now.
            e.tick(now);
        }
        e
    }

    /// Whether a tick at `now` with every temperature as it is would move
    /// nothing, now or later: every member inside, healthy, not drained,
    /// forgiven and below its heat, and no hold in force. (A resting one
    /// returns on a timer, so a ring with one is never at rest.)
    #[must_use]
    pub fn at_rest(&self, now: Duration) -> bool {
        !self.panic
            && now >= self.hold_until
            && self.members.iter().enumerate().all(|(i, m)| {
                m.place == Place::Inner
                    && !m.drained
                    && m.unhealthy.is_none()
                    && m.strikes == 0
                    && m.temperature < self.heat_of(i)
            })
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
        self.place(i, to, reason, now, moves);
    }

    /// Puts member `i` in `to` at `now` and records the move.
    fn place(&mut self, i: usize, to: Place, reason: Reason, now: Duration, moves: &mut Vec<Move>) {
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

    /// Places the members as `inner` says (the rest resting, for at least
    /// `min_rest`), as a new decider that carries on from the ring the
    /// cluster had rather than jump to its own. Members drained or
    /// unhealthy here stay out; nothing moves if that leaves none inside.
    pub fn follow(&mut self, inner: &[usize], now: Duration) -> Vec<Move> {
        let mut moves = Vec::new();
        let takes = |m: &Member| !m.drained && m.unhealthy.is_none();
        if !inner
            .iter()
            .any(|i| self.members.get(*i).is_some_and(takes))
        {
            return moves;
        }
        for i in 0..self.members.len() {
            let to = if inner.contains(&i) && takes(&self.members[i]) {
                Place::Inner
            } else {
                Place::Outer
            };
            if self.members[i].place == to {
                continue;
            }
            if to == Place::Outer {
                let m = &mut self.members[i];
                m.rest_until = m.rest_until.max(now + self.params.min_rest);
            }
            self.place(i, to, Reason::Followed, now, &mut moves);
        }
        moves
    }

    /// One rotation step at time `now`: forgive, then the sick leave, the
    /// hot leave, the rested return (these two not while held), and the
    /// ring is refilled to its floor.
    pub fn tick(&mut self, now: Duration) -> Vec<Move> {
        let mut moves = Vec::new();
        self.forgive(now);
        self.sick_leave(now, &mut moves);
        if now >= self.hold_until {
            self.hot_leave(now, &mut moves);
            self.rested_return(now, &mut moves);
        }
        let want = self.params.min_inner.max(1);
        self.refill(want, now, &mut moves);
        self.panic = self
            .inner()
            .iter()
            .any(|i| self.members[*i].unhealthy.is_some())
            || self.inner_len() < want;
        moves
    }

    /// Members that stayed inside long enough are forgiven their strikes.
    fn forgive(&mut self, now: Duration) {
        let max_rest = self.params.max_rest;
        for m in &mut self.members {
            if m.place == Place::Inner
                && m.strikes > 0
                && m.moved_at
                    .is_some_and(|t| now.saturating_sub(t) >= max_rest)
            {
                m.strikes = 0;
            }
        }
    }

    /// Inner members, hottest first.
    fn hottest_first(&self, mut members: Vec<usize>) -> Vec<usize> {
        members.sort_by(|a, b| {
            self.members[*b]
                .temperature
                .total_cmp(&self.members[*a].temperature)
        });
        members
    }

    /// Step 1: unhealthy members leave promptly, worst first, while the ring
    /// stays at its floor or a healthy resting member can stand in.
    fn sick_leave(&mut self, now: Duration, moves: &mut Vec<Move>) {
        let sick: Vec<usize> = self
            .inner()
            .into_iter()
            .filter(|i| self.members[*i].unhealthy.is_some())
            .collect();
        let sick = self.hottest_first(sick);
        // Healthy resting members that could stand in for a sick one.
        let mut spare = self
            .members
            .iter()
            .filter(|m| m.place == Place::Outer && m.unhealthy.is_none() && !m.drained)
            .count();
        for i in sick {
            let inner = self.inner_len();
            if inner > self.params.min_inner {
                // fine: the ring stays at or above its minimum
            } else if spare > 0 {
                spare -= 1; // the refill calls a healthy one back
            } else {
                continue;
            }
            let why = self.members[i].unhealthy.clone().unwrap_or_default();
            self.shift(i, Place::Outer, Reason::Unhealthy(why), now, moves);
        }
    }

    /// Step 2: hot members leave, hottest first, capped per tick.
    fn hot_leave(&mut self, now: Duration, moves: &mut Vec<Move>) {
        let cap = (self.inner_len() / 3).max(1);
        let cooldown = self.params.cooldown;
        let hot: Vec<usize> = self
            .inner()
            .into_iter()
            .filter(|i| {
                let m = &self.members[*i];
                m.temperature >= self.heat_of(*i)
                    && m.moved_at.is_none_or(|t| now.saturating_sub(t) >= cooldown)
            })
            .collect();
        for i in self.hottest_first(hot).into_iter().take(cap) {
            if self.inner_len() <= self.params.min_inner {
                break;
            }
            self.shift(i, Place::Outer, Reason::Hot, now, moves);
        }
    }

    /// Step 3: rested, cool, healthy members return, coolest first.
    fn rested_return(&mut self, now: Duration, moves: &mut Vec<Move>) {
        for i in self.outer() {
            let m = &self.members[i];
            if m.drained
                || m.unhealthy.is_some()
                || now < m.rest_until
                || m.temperature > self.params.cool
            {
                continue;
            }
            let reason = if m.moved_at.is_none() {
                Reason::WarmedUp
            } else {
                Reason::Cooled
            };
            self.shift(i, Place::Inner, reason, now, moves);
        }
    }

    /// Step 4: never below `want`, never empty: healthy members first, then the
    /// least hot unhealthy ones (panic).
    fn refill(&mut self, want: usize, now: Duration, moves: &mut Vec<Move>) {
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
                self.shift(i, Place::Inner, reason, now, moves);
            }
        }
    }
}

#[cfg(test)]
mod tests;
