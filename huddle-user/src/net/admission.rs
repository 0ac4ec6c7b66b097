//! Places for a server's connections: at most so many at once in all and
//! per key (a source address, a process), each place given back when its
//! holder is dropped. A flood from one source then costs the others
//! nothing, and no flood holds the daemon's descriptors.

use std::{
    collections::HashMap,
    hash::Hash,
    sync::{Arc, Mutex, PoisonError},
};

/// Which limit a refused connection met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    Total,
    PerKey,
}

/// Places held, in all and per key.
struct Held<K> {
    total: usize,
    by_key: HashMap<K, usize>,
}

/// The places of one server.
pub struct Admissions<K> {
    held: Arc<Mutex<Held<K>>>,
    total: usize,
    per_key: usize,
}

/// One admitted connection's place, given back when dropped.
pub struct Admitted<K: Hash + Eq> {
    held: Arc<Mutex<Held<K>>>,
    key: K,
}

impl<K: Hash + Eq + Clone> Admissions<K> {
    /// At most `total` places at once, `per_key` for any one key.
    #[must_use]
    pub fn new(total: usize, per_key: usize) -> Self {
        Self {
            held: Arc::new(Mutex::new(Held {
                total: 0,
                by_key: HashMap::new(),
            })),
            total,
            per_key,
        }
    }

    /// A place for a connection of `key`, or the limit it met.
    pub fn admit(&self, key: K) -> Result<Admitted<K>, Full> {
        let mut h = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if h.total >= self.total {
            return Err(Full::Total);
        }
        let n = h.by_key.entry(key.clone()).or_default();
        if *n >= self.per_key {
            return Err(Full::PerKey);
        }
        *n += 1;
        h.total += 1;
        Ok(Admitted {
            held: self.held.clone(),
            key,
        })
    }
}

impl<K: Hash + Eq> Drop for Admitted<K> {
    fn drop(&mut self) {
        let mut h = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        h.total -= 1;
        if let Some(n) = h.by_key.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                h.by_key.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_capped_in_all_and_per_key_and_given_back() {
        let a = Admissions::new(3, 2);
        let x1 = a.admit('x').unwrap();
        let _x2 = a.admit('x').unwrap();
        assert_eq!(a.admit('x').err(), Some(Full::PerKey));
        let _y = a.admit('y').unwrap();
        assert_eq!(a.admit('z').err(), Some(Full::Total));
        drop(x1);
        assert!(a.admit('x').is_ok());
    }
}
