//! What a migration carried over and left behind, by kind, for its log.

use std::collections::BTreeMap;

/// Entries carried over and left behind, by kind.
#[derive(Default)]
pub struct Tally {
    pub carried: BTreeMap<&'static str, u64>,
    pub dropped: BTreeMap<&'static str, u64>,
}

impl Tally {
    pub(super) fn carry(&mut self, kind: &'static str, n: u64) {
        *self.carried.entry(kind).or_default() += n;
    }

    pub(super) fn drop(&mut self, kind: &'static str, n: u64) {
        *self.dropped.entry(kind).or_default() += n;
    }
}

pub(super) fn line(m: &BTreeMap<&'static str, u64>) -> String {
    let parts: Vec<String> = m.iter().map(|(k, n)| format!("{k} {n}")).collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}
