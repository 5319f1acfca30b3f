//! Which expert the VRAM tier gives up when a miss needs room: the one used least
//! recently (`--cache-policy lru`), or the one used least often, least recently among
//! equals (`lfu`). Kept apart from the device so that it is tested without one.
//!
//! LFU counts every use of an expert, held or not, so that a popular expert evicted
//! once wins its place back; the counts are halved every [`AGING_USES`] uses (at
//! least) so that the tier follows routing that drifts (a server's next client).
//!
//! The held experts are kept in eviction order, so that a miss finds its victim in
//! logarithmic time: a scan of the 1900 experts a 5 GiB tier holds (a hash lookup
//! each under LFU) cost the host tens of microseconds an eviction, some seventy
//! evictions a token, while the GPU waited for the layer's copies.

use std::collections::{BTreeSet, HashMap};

use sluice_experts::Policy;

/// An expert of a layer of an expert store: (store id, layer, expert).
pub(crate) type TierKey = (u64, usize, usize);

/// Uses between two halvings of LFU's counts: at least this many, and at least
/// eight per expert counted, so that one token's choices never age the counts.
const AGING_USES: u64 = 4096;

/// Where a held expert stands in the eviction order, the least first: its uses
/// (LFU; 0 under LRU), then the tick of its last use.
type Rank = (u32, u64);

/// The VRAM tier's eviction order.
#[derive(Debug)]
pub(crate) struct TierPolicy {
    policy: Policy,
    /// LFU: uses of each expert seen (held or not), halved as they age.
    uses: HashMap<TierKey, u32>,
    /// Uses since the counts were last halved.
    since_aging: u64,
    /// The held experts' ranks, and the same in eviction order.
    rank: HashMap<TierKey, Rank>,
    order: BTreeSet<(Rank, TierKey)>,
}

impl Default for TierPolicy {
    fn default() -> Self {
        TierPolicy::new(Policy::Lru)
    }
}

impl TierPolicy {
    pub(crate) fn new(policy: Policy) -> Self {
        TierPolicy { policy, uses: HashMap::new(), since_aging: 0, rank: HashMap::new(), order: BTreeSet::new() }
    }

    pub(crate) fn policy(&self) -> Policy {
        self.policy
    }

    /// Moves held expert `key` to `rank` in the eviction order.
    fn rerank(&mut self, key: TierKey, rank: Rank) {
        if let Some(old) = self.rank.insert(key, rank) {
            self.order.remove(&(old, key));
        }
        self.order.insert((rank, key));
    }

    /// One use of `key` (a hit or a miss).
    pub(crate) fn used(&mut self, key: TierKey) {
        if self.policy != Policy::Lfu {
            return;
        }
        let n = self.uses.entry(key).or_default();
        *n += 1;
        let n = *n;
        if let Some(&(_, tick)) = self.rank.get(&key) {
            self.rerank(key, (n, tick));
        }
        self.since_aging += 1;
        if self.since_aging >= AGING_USES.max(8 * self.uses.len() as u64) {
            self.since_aging = 0;
            self.uses.retain(|_, n| {
                *n /= 2;
                *n > 0
            });
            let held: Vec<(TierKey, u64)> = self.rank.iter().map(|(k, &(_, tick))| (*k, tick)).collect();
            for (k, tick) in held {
                self.rerank(k, (self.uses.get(&k).copied().unwrap_or(0), tick));
            }
        }
    }

    /// Expert `key` is held, last used at `tick` (taken in, or a hit).
    pub(crate) fn held(&mut self, key: TierKey, tick: u64) {
        let uses = if self.policy == Policy::Lfu { self.uses.get(&key).copied().unwrap_or(0) } else { 0 };
        self.rerank(key, (uses, tick));
    }

    /// Expert `key` is no longer held.
    pub(crate) fn dropped(&mut self, key: TierKey) {
        if let Some(r) = self.rank.remove(&key) {
            self.order.remove(&(r, key));
        }
    }

    /// The held expert to give up, passing over those `spare` names: the least
    /// recently used, or under LFU the least used (least recently among equals).
    /// `None` if nothing else is held.
    pub(crate) fn victim(&self, spare: impl Fn(&TierKey) -> bool) -> Option<TierKey> {
        self.order.iter().map(|(_, k)| *k).find(|k| !spare(k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tier of `cap` experts under `policy` fed `stream`: its hits.
    fn hits(policy: Policy, cap: usize, stream: &[usize]) -> usize {
        let mut p = TierPolicy::new(policy);
        let mut held = std::collections::HashSet::new();
        let mut hits = 0;
        for (tick, &e) in stream.iter().enumerate() {
            let key = (0, 0, e);
            p.used(key);
            if held.contains(&key) {
                p.held(key, tick as u64);
                hits += 1;
                continue;
            }
            if held.len() == cap {
                let gone = p.victim(|_| false).unwrap();
                p.dropped(gone);
                held.remove(&gone);
            }
            p.held(key, tick as u64);
            held.insert(key);
        }
        hits
    }

    #[test]
    fn lru_gives_up_the_least_recent_and_lfu_the_least_used() {
        let mut lru = TierPolicy::new(Policy::Lru);
        let mut lfu = TierPolicy::new(Policy::Lfu);
        for p in [&mut lru, &mut lfu] {
            assert_eq!(p.victim(|_| false), None);
            // Expert 1 used three times, last at tick 2; 2 and 3 once, at ticks 3 and 4.
            for (tick, e) in [1, 1, 1, 2, 3].into_iter().enumerate() {
                p.used((0, 0, e));
                p.held((0, 0, e), tick as u64);
            }
        }
        assert_eq!(lru.victim(|_| false), Some((0, 0, 1)));
        assert_eq!(lfu.victim(|_| false), Some((0, 0, 2)), "equal counts: the least recent goes");
        // Those spared are passed over; one dropped is no longer a candidate.
        assert_eq!(lru.victim(|k| *k == (0, 0, 1)), Some((0, 0, 2)));
        lfu.dropped((0, 0, 2));
        assert_eq!(lfu.victim(|_| false), Some((0, 0, 3)));
        assert_eq!(lfu.victim(|_| true), None);
        // LRU keeps no counts; a hit moves an expert to the back.
        assert!(lru.uses.is_empty());
        lru.held((0, 0, 1), 5);
        assert_eq!(lru.victim(|_| false), Some((0, 0, 2)));
    }

    #[test]
    fn lfu_counts_age() {
        let mut p = TierPolicy::new(Policy::Lfu);
        for _ in 0..10 {
            p.used((0, 0, 7));
        }
        for i in 0..AGING_USES {
            p.used((0, 1, (i % 4) as usize));
        }
        // The halving came after AGING_USES uses in all: expert 7's ten became five.
        assert_eq!(p.uses.get(&(0, 0, 7)), Some(&5));
        assert!(p.since_aging < AGING_USES);
        // A held expert's place in the order follows its halved count: 7 (five uses)
        // outranks one used four times, whose count went to two, then three.
        let mut q = TierPolicy::new(Policy::Lfu);
        for _ in 0..4 {
            q.used((0, 0, 1));
        }
        for _ in 0..10 {
            q.used((0, 0, 7));
        }
        q.held((0, 0, 1), 0);
        q.held((0, 0, 7), 1);
        for i in 0..AGING_USES {
            q.used((0, 1, (i % 4) as usize));
        }
        assert_eq!(q.rank.get(&(0, 0, 7)), Some(&(5, 1)));
        assert_eq!(q.rank.get(&(0, 0, 1)), Some(&(2, 0)));
        assert_eq!(q.victim(|_| false), Some((0, 0, 1)));
        q.used((0, 0, 1));
        assert_eq!(q.rank.get(&(0, 0, 1)), Some(&(3, 0)));
    }

    /// Routing skewed as `sluice synth --skew` makes it (a popularity falling as a power
    /// of an expert's rank, eight distinct experts a token): LFU keeps the popular
    /// experts that LRU lets a run of rare ones push out.
    #[test]
    fn lfu_holds_skewed_routing_better_than_lru() {
        let (n, k, cap) = (128usize, 8usize, 32usize);
        let weight: Vec<f64> = (0..n).map(|r| ((r + 1) as f64).powf(-0.9)).collect();
        let total: f64 = weight.iter().sum();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut stream = Vec::new();
        for _ in 0..3000 {
            let mut chosen = Vec::with_capacity(k);
            while chosen.len() < k {
                let mut u = uniform() * total;
                let e = weight.iter().position(|w| {
                    u -= w;
                    u <= 0.0
                });
                let e = e.unwrap_or(n - 1);
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            stream.extend(chosen);
        }
        let (lru, lfu) = (hits(Policy::Lru, cap, &stream), hits(Policy::Lfu, cap, &stream));
        let rate = |h: usize| h as f64 / stream.len() as f64;
        eprintln!("hit rate, {cap} of {n} experts held: LRU {:.3}, LFU {:.3}", rate(lru), rate(lfu));
        assert!(rate(lfu) > rate(lru) + 0.05, "LFU {} against LRU {}", rate(lfu), rate(lru));
    }
}
