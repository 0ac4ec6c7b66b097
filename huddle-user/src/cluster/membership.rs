//! Which members of the cluster answer. When one is lost or comes back,
//! the router moves connections between balancers, and the one taking a
//! connection over finds its backend in its own Maglev table unless the
//! flow was shared (`handoff` shares only the flows the rings of the
//! last exchange no longer explain). A ring change while those
//! connections move would send the unshared ones elsewhere: measured in
//! CI, a backend returning to the ring 1 s after a balancer's link was
//! cut broke 28 of 342 moved connections. So the rings hold still for
//! `HOLD` after a change of members (see `rotation`: the sick still
//! leave).

use std::{collections::BTreeSet, net::SocketAddr, time::Duration};

/// How long the rings hold after a member is lost or back: long enough
/// for connections that send every few seconds to be taken over (each
/// is, at its next packet, and then has its own flow entry).
pub const HOLD: Duration = Duration::from_secs(5);

/// A hold starts at most once in this long, so a member that flaps
/// never keeps the huddle from resting a hot backend for good.
pub const HOLD_EVERY: Duration = Duration::from_secs(10);

/// The members that answered the last poll, and when the rings last
/// started holding.
#[derive(Default)]
pub struct Membership {
    answering: Option<BTreeSet<SocketAddr>>,
    held_at: Option<Duration>,
}

impl Membership {
    /// Takes the members that answered a poll at `now` (any monotonic
    /// clock). Returns until when the rings hold, and why, when members
    /// were lost or came back and no hold started within `HOLD_EVERY`.
    /// The first poll only says who is there.
    pub fn take(
        &mut self,
        answering: BTreeSet<SocketAddr>,
        now: Duration,
    ) -> Option<(Duration, String)> {
        let before = self.answering.replace(answering.clone())?;
        if before == answering {
            return None;
        }
        if self
            .held_at
            .is_some_and(|t| now.saturating_sub(t) < HOLD_EVERY)
        {
            return None;
        }
        self.held_at = Some(now);
        let list = |s: Vec<&SocketAddr>| {
            s.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let lost: Vec<_> = before.difference(&answering).collect();
        let back: Vec<_> = answering.difference(&before).collect();
        let why = match (lost.is_empty(), back.is_empty()) {
            (false, true) => format!("{} stopped answering", list(lost)),
            (true, false) => format!("{} answers again", list(back)),
            _ => format!(
                "{} stopped answering, {} answers again",
                list(lost),
                list(back)
            ),
        };
        Some((now + HOLD, why))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ports: &[u16]) -> BTreeSet<SocketAddr> {
        ports
            .iter()
            .map(|p| SocketAddr::from(([10, 0, 0, 1], *p)))
            .collect()
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_member_lost_or_back_holds_the_rings_at_most_once_in_hold_every() {
        let mut m = Membership::default();
        assert!(m.take(set(&[1, 2]), S).is_none(), "the first poll");
        assert!(m.take(set(&[1, 2]), 2 * S).is_none(), "no change");
        let (until, why) = m.take(set(&[1]), 3 * S).expect("lost");
        assert_eq!(until, 3 * S + HOLD);
        assert!(why.contains(":2 stopped answering"), "{why}");
        // Back within HOLD_EVERY of the last hold: no new one.
        assert!(m.take(set(&[1, 2]), 4 * S).is_none());
        assert!(m.take(set(&[1]), 5 * S).is_none());
        let (until, why) = m.take(set(&[1, 2]), 3 * S + HOLD_EVERY).expect("back");
        assert_eq!(until, 3 * S + HOLD_EVERY + HOLD);
        assert!(why.contains(":2 answers again"), "{why}");
    }
}
