//! [`GoneSet`]: which seqs of a queue are gone (acked, purged, expired, or never stored).
//!
//! Everything below `floor` is gone; above it, gone seqs are kept as merged `[start, end)` ranges. Acks
//! mostly arrive in order, so the ranges collapse into the floor and memory stays a few entries per queue,
//! however long the backlog. A consumer that keeps one old message unacked while acking millions after it
//! costs one range, not millions of entries.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GoneSet {
    floor: u64,
    /// start -> end (exclusive), non-overlapping, non-adjacent, all starting above `floor`.
    ranges: BTreeMap<u64, u64>,
}

impl GoneSet {
    pub fn new(floor: u64) -> Self {
        GoneSet { floor, ranges: BTreeMap::new() }
    }

    pub fn from_parts(floor: u64, ranges: impl IntoIterator<Item = (u64, u64)>) -> Self {
        let mut s = GoneSet::new(floor);
        for (a, b) in ranges {
            s.insert(a, b);
        }
        s
    }

    /// The first seq that is not gone.
    pub fn floor(&self) -> u64 {
        self.floor
    }

    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(a, b)| (*a, *b))
    }

    pub fn contains(&self, seq: u64) -> bool {
        seq < self.floor || self.ranges.range(..=seq).next_back().is_some_and(|(_, &end)| seq < end)
    }

    /// Marks `[start, end)` gone. Returns how many of those seqs were not gone before.
    pub fn insert(&mut self, start: u64, end: u64) -> u64 {
        let start = start.max(self.floor);
        if start >= end {
            return 0;
        }
        let mut new_start = start;
        let mut new_end = end;
        let mut already = 0;
        // Merge with a range that starts before `start` and reaches it.
        if let Some((&s, &e)) = self.ranges.range(..start).next_back() {
            if e >= start {
                already += e.min(end) - start;
                new_start = s;
                new_end = new_end.max(e);
                self.ranges.remove(&s);
            }
        }
        // Merge with ranges starting inside [start, end].
        let inside: Vec<(u64, u64)> = self.ranges.range(start..=end).map(|(a, b)| (*a, *b)).collect();
        for (s, e) in inside {
            already += e.min(end) - s;
            new_end = new_end.max(e);
            self.ranges.remove(&s);
        }
        if new_start <= self.floor {
            self.floor = new_end;
        } else {
            self.ranges.insert(new_start, new_end);
        }
        // The floor may now touch the next range.
        while let Some((&s, &e)) = self.ranges.iter().next() {
            if s > self.floor {
                break;
            }
            self.floor = self.floor.max(e);
            self.ranges.remove(&s);
        }
        (end - start) - already
    }

    /// Makes the gone seqs of `[start, end)` not gone (a rewind: `QueueLog::rewind`). Returns the
    /// ranges that were gone, in order.
    pub fn remove(&mut self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        if start >= end {
            return out;
        }
        // The floor's part: everything below `start` stays gone, `[end, floor)` becomes a range.
        if start < self.floor {
            let old_floor = self.floor;
            out.push((start, end.min(old_floor)));
            self.floor = start;
            if end < old_floor {
                self.ranges.insert(end, old_floor);
            }
        }
        // A range starting before `start` that reaches into it.
        if let Some((&s, &e)) = self.ranges.range(..start).next_back() {
            if e > start {
                self.ranges.insert(s, start);
                out.push((start, e.min(end)));
                if e > end {
                    self.ranges.insert(end, e);
                }
            }
        }
        let inside: Vec<(u64, u64)> = self.ranges.range(start..end).map(|(a, b)| (*a, *b)).collect();
        for (s, e) in inside {
            self.ranges.remove(&s);
            out.push((s, e.min(end)));
            if e > end {
                self.ranges.insert(end, e);
            }
        }
        out.sort_unstable();
        out
    }

    /// How many seqs in `[start, end)` are gone.
    pub fn count_in(&self, start: u64, end: u64) -> u64 {
        if start >= end {
            return 0;
        }
        let mut n = self.floor.clamp(start, end) - start;
        let from = start.max(self.floor);
        if from >= end {
            return n;
        }
        if let Some((_, &e)) = self.ranges.range(..from).next_back() {
            if e > from {
                n += e.min(end) - from;
            }
        }
        for (&s, &e) in self.ranges.range(from..end) {
            n += e.min(end) - s;
        }
        n
    }

    /// The first seq at or after `seq` that is not gone.
    pub fn next_live(&self, seq: u64) -> u64 {
        let seq = seq.max(self.floor);
        match self.ranges.range(..=seq).next_back() {
            Some((_, &e)) if seq < e => e,
            _ => seq,
        }
    }

    #[cfg(test)]
    pub fn range_count(&self) -> usize {
        self.ranges.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_acks_collapse_into_the_floor() {
        let mut g = GoneSet::new(0);
        for i in 0..1000 {
            assert_eq!(g.insert(i, i + 1), 1);
        }
        assert_eq!(g.floor(), 1000);
        assert_eq!(g.range_count(), 0);
    }

    #[test]
    fn out_of_order_acks_merge_and_count_once() {
        let mut g = GoneSet::new(0);
        assert_eq!(g.insert(5, 8), 3);
        assert_eq!(g.insert(10, 12), 2);
        assert_eq!(g.insert(6, 11), 2); // 8, 9 new
        assert_eq!(g.ranges().collect::<Vec<_>>(), vec![(5, 12)]);
        assert!(g.contains(5) && g.contains(11) && !g.contains(12) && !g.contains(4));
        assert_eq!(g.count_in(0, 20), 7);
        assert_eq!(g.count_in(6, 10), 4);
        assert_eq!(g.next_live(5), 12);
        assert_eq!(g.next_live(3), 3);
        assert_eq!(g.insert(0, 5), 5);
        assert_eq!(g.floor(), 12);
        assert_eq!(g.range_count(), 0);
        assert_eq!(g.insert(3, 9), 0);
    }

    #[test]
    fn remove_makes_gone_seqs_live_again_and_says_which() {
        let mut g = GoneSet::new(10);
        g.insert(15, 20);
        g.insert(25, 30);
        assert_eq!(g.remove(5, 17), vec![(5, 10), (15, 17)]);
        assert_eq!(g.floor(), 5);
        assert!(g.contains(4) && !g.contains(5) && !g.contains(12) && !g.contains(16) && g.contains(17));
        assert_eq!(g.remove(0, 100), vec![(0, 5), (17, 20), (25, 30)]);
        assert_eq!((g.floor(), g.range_count()), (0, 0));
        assert_eq!(g.remove(0, 100), vec![]);
        // Inside the floor: the part above the removed range stays gone.
        let mut g = GoneSet::new(100);
        assert_eq!(g.remove(40, 60), vec![(40, 60)]);
        assert_eq!((g.floor(), g.ranges().collect::<Vec<_>>()), (40, vec![(60, 100)]));
        assert_eq!(g.insert(40, 60), 20);
        assert_eq!((g.floor(), g.range_count()), (100, 0));
    }

    #[test]
    fn random_against_a_model() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut g = GoneSet::new(0);
        let mut model = vec![false; 300];
        for _ in 0..2000 {
            let a = rng.gen_range(0..300u64);
            let b = (a + rng.gen_range(1..20)).min(300);
            let fresh = (a..b).filter(|&i| !model[i as usize]).count() as u64;
            assert_eq!(g.insert(a, b), fresh);
            for i in a..b {
                model[i as usize] = true;
            }
            if rng.gen_range(0..4) == 0 {
                let a = rng.gen_range(0..300u64);
                let b = (a + rng.gen_range(1..30)).min(300);
                let removed: u64 = g.remove(a, b).iter().map(|(x, y)| y - x).sum();
                assert_eq!(removed, (a..b).filter(|&i| model[i as usize]).count() as u64);
                for i in a..b {
                    model[i as usize] = false;
                }
            }
            let s = rng.gen_range(0..300u64);
            let e = rng.gen_range(s..=300);
            assert_eq!(g.count_in(s, e), (s..e).filter(|&i| model[i as usize]).count() as u64);
            assert_eq!(g.next_live(s), (s..300).find(|&i| !model[i as usize]).unwrap_or(300).max(s));
            assert_eq!(g.contains(s), model[s as usize]);
        }
    }
}
