//! The owner's stripe cache: recently written (or read-for-write) stripes' chunks, kept so
//! that a following write pass on the same stripe reads only what it does not hold.
//!
//! # What an entry holds
//! One chunk buffer per member, addressed by **absolute chunk offset** (byte `i` of member
//! `m`'s buffer is byte `i` of `m`'s chunk in the entry's stripe), and per member a
//! [`BlockSet`] of the array blocks that are **known to equal the member** (valid). Data
//! and P/Q alike. Everything else in the buffers is scratch.
//!
//! # Rules (write-through)
//! - A block becomes valid only after a member read of it completed without error, or a
//!   member write of it completed without error (the pass that wrote it knows its bytes).
//! - Blocks a pass is about to overwrite are invalid until its writes are durable; a pass
//!   that fails any member I/O, or that overlapped an [`StripeCache::invalidate_all`],
//!   drops its entry's validity whole.
//! - Every path that writes a member without going through the cache (degraded writes,
//!   native write-zeroes and discards, read repair, background processes) invalidates the
//!   stripe's entry first; a member failing, joining or being replaced invalidates every
//!   entry. No acknowledged data lives only here: the cache is never the only copy.
//! - Reads rely on these rules without holding the stripe ([`Self::lookup`],
//!   `read.rs`'s `cache_read`): they are served only while no write holds or awaits the
//!   stripe, and any holder that shares the stripe with them and writes a member (a
//!   background operation, a read's repair) has invalidated the entry before its first
//!   write. A new path that writes members must keep to it.
//!
//! # Limits
//! The entries, their buffers and the stripe → entry map are allocated at construction;
//! lookups, pins, evictions and validity changes allocate nothing. An entry in use by a
//! running pass is *pinned*: it is out of the recency list and never evicted. There are
//! always at least as many entries as foreground stripe operations, so a pass can always
//! pin one (at most one pass per stripe operation runs at a time).
//!
//! # Recency
//! Entries are evicted least recently used first, with one exception the pass decides
//! ([`StripeCache::demote`], `pass.rs`'s `recycle_first`): a pass of a sequential stream
//! of sub-stripe writes, once it reaches its stripe's last data block, makes its entry the
//! next one taken. Recycled at once, the entry's buffers are still in the CPU's caches
//! when the stream's next stripe is copied and its parity computed into them, instead of
//! the least recently used entry's cold ones. What the entry holds stays valid until it
//! is taken. The cache remembers the stripes it demoted last (as many as it has
//! entries, ARC's ghost list in spirit): a miss on one of them means a stream came back
//! to a stripe it was made to leave — a region rewritten in laps that the cache could
//! hold — and for the next twice-the-entries misses ([`StripeCache::cautious`]) only a
//! stream longer than the whole cache recycles, so the region stays cached lap after lap.
//!
//! # Admission
//! Sequential streams and stripes already cached go through the cache. A random
//! sub-stripe write to a stripe the cache does not hold goes around it (`pass.rs`'s
//! single-operation path: no copy), and the cache notes the stripe in a direct-mapped
//! filter ([`StripeCache::note_bypass`]); a write that comes back to a stripe still in
//! the filter runs as a pass, so from its stripe's second write on, its old data and P/Q
//! stay cached. A random writer over a region the cache can hold thus stops reading its
//! members (16 KiB random 70/30 over NBD on RAID6: docs/BENCHMARKS.md, "Random
//! rewrites through the stripe cache"), while one over a region far larger than the
//! cache is rarely admitted and keeps the cheaper path. The pass decides whether to ask
//! the filter at all: only on members whose writes take time (`pass.rs`,
//! `CACHE_ADMIT_WRITE_LATENCY_NS`), since on RAM-speed members the copy costs more than
//! the reads it saves.
//!
//! # Reads
//! On the same members, a read of a stripe the shard owns that no write holds or awaits,
//! whose blocks are all valid in the stripe's (unpinned) entry, is copied from the entry
//! and completed at once (`read.rs`, `Array::cache_read`): valid blocks equal the member,
//! and no pass is writing them.
//!
//! The size is md's `stripe_cache_size` idea (raid5.c `NR_STRIPES`, 256 rows of 4 KiB per
//! member by default, sysfs range 17..32768) at chunk granularity: an entry caches a whole
//! chunk per member, so `entries × members × chunk_bytes` bytes.

use std::collections::HashMap;

use rustc_hash::FxBuildHasher;

use crate::buf::AlignedBuf;

/// A set of blocks of one chunk: bit `b` is block `b` (bytes `b·unit .. (b+1)·unit` of the
/// chunk, `unit` = the array's block size). Fixed size, never allocates after
/// construction.
#[derive(Clone, Debug)]
pub(crate) struct BlockSet {
    words: Box<[u64]>,
    bits: u32,
}

impl BlockSet {
    /// An empty set of `bits` blocks.
    pub(crate) fn new(bits: u32) -> Self {
        Self {
            words: vec![0u64; bits.div_ceil(64) as usize].into_boxed_slice(),
            bits,
        }
    }

    /// Blocks the set can hold.
    pub(crate) fn capacity(&self) -> u32 {
        self.bits
    }

    /// Removes every block.
    pub(crate) fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Blocks in the set.
    pub(crate) fn count(&self) -> u32 {
        self.words.iter().map(|w| w.count_ones()).sum()
    }

    /// Whether block `b` is in the set.
    pub(crate) fn contains(&self, b: u32) -> bool {
        debug_assert!(b < self.bits);
        self.words[(b / 64) as usize] & (1 << (b % 64)) != 0
    }

    /// Adds blocks `a..b`.
    pub(crate) fn insert_range(&mut self, a: u32, b: u32) {
        self.apply_range(a, b, |w, m| *w |= m);
    }

    /// Removes blocks `a..b`.
    pub(crate) fn remove_range(&mut self, a: u32, b: u32) {
        self.apply_range(a, b, |w, m| *w &= !m);
    }

    fn apply_range(&mut self, a: u32, b: u32, f: impl Fn(&mut u64, u64)) {
        assert!(a <= b && b <= self.bits, "blocks {a}..{b} of {}", self.bits);
        let mut i = a;
        while i < b {
            let w = i / 64;
            let lo = i % 64;
            let hi = if b / 64 == w { b % 64 } else { 64 };
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            f(&mut self.words[w as usize], mask);
            i = (w + 1) * 64;
        }
    }

    /// `self |= other`.
    pub(crate) fn union_with(&mut self, other: &BlockSet) {
        debug_assert_eq!(self.bits, other.bits);
        for (w, o) in self.words.iter_mut().zip(other.words.iter()) {
            *w |= o;
        }
    }

    /// `self = a & !b` (blocks of `a` not in `b`).
    pub(crate) fn set_difference(&mut self, a: &BlockSet, b: &BlockSet) {
        debug_assert!(self.bits == a.bits && a.bits == b.bits);
        for ((w, x), y) in self
            .words
            .iter_mut()
            .zip(a.words.iter())
            .zip(b.words.iter())
        {
            *w = x & !y;
        }
    }

    /// `self = a & !b & !c`.
    pub(crate) fn set_difference2(&mut self, a: &BlockSet, b: &BlockSet, c: &BlockSet) {
        self.combine3(a, b, c, |w, x, y, z| *w = x & !y & !z);
    }

    /// `self |= a & !b & !c`.
    pub(crate) fn union_difference2(&mut self, a: &BlockSet, b: &BlockSet, c: &BlockSet) {
        self.combine3(a, b, c, |w, x, y, z| *w |= x & !y & !z);
    }

    /// Applies `f(word of self, word of a, of b, of c)` to every word.
    fn combine3(
        &mut self,
        a: &BlockSet,
        b: &BlockSet,
        c: &BlockSet,
        f: impl Fn(&mut u64, u64, u64, u64),
    ) {
        debug_assert!(self.bits == a.bits && a.bits == b.bits && b.bits == c.bits);
        for (((w, x), y), z) in self
            .words
            .iter_mut()
            .zip(a.words.iter())
            .zip(b.words.iter())
            .zip(c.words.iter())
        {
            f(w, *x, *y, *z);
        }
    }

    /// `self = !a & !b`: every block of the chunk in neither set.
    pub(crate) fn set_neither(&mut self, a: &BlockSet, b: &BlockSet) {
        debug_assert!(self.bits == a.bits && a.bits == b.bits);
        for (((i, w), x), y) in self
            .words
            .iter_mut()
            .enumerate()
            .zip(a.words.iter())
            .zip(b.words.iter())
        {
            // Bits past the last block stay clear.
            let top = (self.bits - 64 * i as u32).min(64);
            let mask = if top == 64 {
                u64::MAX
            } else {
                (1u64 << top) - 1
            };
            *w = !x & !y & mask;
        }
    }

    /// Blocks of the chunk in neither `a` nor `b`.
    pub(crate) fn count_neither(a: &BlockSet, b: &BlockSet) -> u32 {
        debug_assert_eq!(a.bits, b.bits);
        a.bits
            - a.words
                .iter()
                .zip(b.words.iter())
                .map(|(x, y)| (x | y).count_ones())
                .sum::<u32>()
    }

    /// Whether every block of `other` is in `self`.
    pub(crate) fn is_superset(&self, other: &BlockSet) -> bool {
        self.words
            .iter()
            .zip(other.words.iter())
            .all(|(a, b)| b & !a == 0)
    }

    /// The maximal runs of consecutive blocks in the set, in order, as `(first, end)`
    /// block ranges.
    pub(crate) fn runs(&self) -> Runs<'_> {
        Runs { set: self, at: 0 }
    }

    /// The first run of the set that starts at or after block `from`, as `(first, end)`.
    /// Lets a caller walk the runs while mutating what owns the set.
    pub(crate) fn run_from(&self, from: u32) -> Option<(u32, u32)> {
        let a = self.next(from, true);
        (a < self.bits).then(|| (a, self.next(a, false)))
    }

    /// Whether every block of `a..b` (non-empty) is in the set.
    pub(crate) fn contains_range(&self, a: u32, b: u32) -> bool {
        debug_assert!(a < b && b <= self.bits);
        self.run_from(a).is_some_and(|(x, y)| x == a && y >= b)
    }

    /// Whether any block of `a..b` is in the set.
    pub(crate) fn any_in(&self, a: u32, b: u32) -> bool {
        a < b && self.next(a, true) < b
    }

    /// The next block at or after `from` whose membership equals `member`, or the
    /// capacity.
    fn next(&self, from: u32, member: bool) -> u32 {
        let mut i = from;
        while i < self.bits {
            let w = self.words[(i / 64) as usize];
            let w = if member { w } else { !w };
            let w = w >> (i % 64);
            if w != 0 {
                return (i + w.trailing_zeros()).min(self.bits);
            }
            i = (i / 64 + 1) * 64;
        }
        self.bits
    }
}

/// Iterator over the runs of a [`BlockSet`].
pub(crate) struct Runs<'a> {
    set: &'a BlockSet,
    at: u32,
}

impl Iterator for Runs<'_> {
    type Item = (u32, u32);

    fn next(&mut self) -> Option<(u32, u32)> {
        let a = self.set.next(self.at, true);
        if a >= self.set.bits {
            self.at = self.set.bits;
            return None;
        }
        let b = self.set.next(a, false);
        self.at = b;
        Some((a, b))
    }
}

/// No entry / no link.
pub(crate) const NONE: u32 = u32::MAX;

/// One cached stripe (see the module docs).
pub(crate) struct CacheEntry {
    /// The stripe cached, or `u64::MAX` for an empty entry.
    pub(crate) stripe: u64,
    /// One chunk buffer per member (absolute chunk offsets).
    pub(crate) bufs: Vec<AlignedBuf>,
    /// Per member: blocks known to equal the member.
    pub(crate) valid: Vec<BlockSet>,
    /// In use by a running pass: out of the recency list, never evicted.
    pub(crate) pinned: bool,
    /// The cache's epoch when the pass pinned it ([`StripeCache::invalidate_all`]).
    pub(crate) epoch: u64,
    prev: u32,
    next: u32,
}

impl CacheEntry {
    /// Forgets every valid block.
    pub(crate) fn invalidate(&mut self) {
        for v in &mut self.valid {
            v.clear();
        }
    }
}

/// The per-shard stripe cache (see the module docs).
pub(crate) struct StripeCache {
    entries: Vec<CacheEntry>,
    map: HashMap<u64, u32, FxBuildHasher>,
    /// Least recently used unpinned entry (evicted first), and the most recent one.
    head: u32,
    tail: u32,
    /// Bumped by [`Self::invalidate_all`]: a pass that pinned its entry in an earlier
    /// epoch does not mark anything valid.
    epoch: u64,
    /// Whether validity survives a pass (`false`: entries are only working sets).
    keep: bool,
    /// [`Self::demoted`].
    demoted: u64,
    /// The stripes demoted last, a ring of as many as there are entries (`u64::MAX`:
    /// none): a miss on one of them means a stream came back to a stripe it was made to
    /// leave ([`Self::cautious`]).
    ghosts: Box<[u64]>,
    ghost_next: usize,
    /// How many times each stripe is in `ghosts`: a miss asks it instead of scanning the
    /// ring (which is as long as the cache, any size `--stripe-cache` gives). Sized at
    /// construction for twice the ring, so inserting never grows it.
    ghost_count: HashMap<u64, u32, FxBuildHasher>,
    /// Misses still to come before [`Self::cautious`] ends: set to twice the entries by a
    /// miss on a ghost, counted down by every other miss.
    cautious_misses: u32,
    /// The stripes that sub-stripe writes wrote around the cache lately
    /// ([`Self::note_bypass`]), direct-mapped by a hash of the stripe number (`u64::MAX`:
    /// none); twice as many slots as entries, rounded up to a power of two (fewer
    /// collisions among the stripes the cache can hold).
    bypassed: Box<[u64]>,
    /// `64 - log2(bypassed.len())`: the shift that maps a hash to a slot.
    bypass_shift: u32,
}

impl StripeCache {
    /// `entries` entries of `members` chunk buffers of `chunk` bytes, validity in blocks of
    /// `block` bytes; `keep`: whether anything stays cached between passes.
    pub(crate) fn new(entries: usize, members: usize, chunk: u32, block: u32, keep: bool) -> Self {
        assert!(entries > 0 && chunk.is_multiple_of(block));
        let bits = chunk / block;
        let mut c = Self {
            entries: (0..entries)
                .map(|_| CacheEntry {
                    stripe: u64::MAX,
                    bufs: (0..members)
                        .map(|_| AlignedBuf::zeroed(chunk as usize))
                        .collect(),
                    valid: (0..members).map(|_| BlockSet::new(bits)).collect(),
                    pinned: false,
                    epoch: 0,
                    prev: NONE,
                    next: NONE,
                })
                .collect(),
            map: HashMap::with_capacity_and_hasher(entries, FxBuildHasher),
            head: NONE,
            tail: NONE,
            epoch: 0,
            keep,
            demoted: 0,
            ghosts: vec![u64::MAX; entries].into_boxed_slice(),
            ghost_next: 0,
            ghost_count: HashMap::with_capacity_and_hasher(2 * entries, FxBuildHasher),
            cautious_misses: 0,
            bypassed: vec![u64::MAX; (2 * entries).next_power_of_two()].into_boxed_slice(),
            bypass_shift: 64 - (2 * entries).next_power_of_two().trailing_zeros(),
        };
        for e in 0..entries as u32 {
            c.push_tail(e);
        }
        c
    }

    /// Entry `e`.
    pub(crate) fn entry(&self, e: u32) -> &CacheEntry {
        &self.entries[e as usize]
    }

    /// Entry `e`, mutable.
    pub(crate) fn entry_mut(&mut self, e: u32) -> &mut CacheEntry {
        &mut self.entries[e as usize]
    }

    /// Pins the entry of `stripe` for a pass: its cached blocks if it has one, else the
    /// least recently used unpinned entry, emptied. Returns the entry and how many
    /// blocks of it are valid (0 on a miss).
    ///
    /// # Panics
    /// If `stripe` is already pinned or every entry is pinned (an engine bug: there are
    /// at least as many entries as stripe operations, one pass per stripe).
    pub(crate) fn pin(&mut self, stripe: u64) -> (u32, u32) {
        if let Some(&e) = self.map.get(&stripe) {
            assert!(
                !self.entries[e as usize].pinned,
                "stripe {stripe} pinned twice"
            );
            self.unlink(e);
            let ent = &mut self.entries[e as usize];
            ent.pinned = true;
            ent.epoch = self.epoch;
            let valid = ent.valid.iter().map(BlockSet::count).sum();
            return (e, valid);
        }
        let e = self.head;
        assert!(e != NONE, "every stripe cache entry is pinned");
        if self.ghost_count.contains_key(&stripe) {
            self.cautious_misses = 2 * self.entries.len() as u32;
        } else {
            self.cautious_misses = self.cautious_misses.saturating_sub(1);
        }
        self.unlink(e);
        let ent = &mut self.entries[e as usize];
        if ent.stripe != u64::MAX {
            self.map.remove(&ent.stripe);
        }
        ent.stripe = stripe;
        ent.invalidate();
        ent.pinned = true;
        ent.epoch = self.epoch;
        self.map.insert(stripe, e);
        (e, 0)
    }

    /// Ends a pass's use of entry `e`: it becomes the most recently used; `keep_valid`
    /// false (the pass failed, or the cache was invalidated meanwhile, or caching is off)
    /// drops its validity.
    pub(crate) fn unpin(&mut self, e: u32, keep_valid: bool) {
        let epoch = self.epoch;
        let keep = self.keep;
        let ent = &mut self.entries[e as usize];
        debug_assert!(ent.pinned);
        ent.pinned = false;
        if !keep_valid || !keep || ent.epoch != epoch {
            ent.invalidate();
        }
        self.push_tail(e);
    }

    /// Makes unpinned entry `e` the least recently used: the next miss takes it, with
    /// what it holds (a stripe a sequential stream has left, [`super::pass`]).
    pub(crate) fn demote(&mut self, e: u32) {
        assert!(!self.entries[e as usize].pinned, "entry {e} is pinned");
        self.unlink(e);
        self.push_head(e);
        self.demoted += 1;
        let stripe = self.entries[e as usize].stripe;
        let old = std::mem::replace(&mut self.ghosts[self.ghost_next], stripe);
        self.ghost_next = (self.ghost_next + 1) % self.ghosts.len();
        if old != u64::MAX {
            match self.ghost_count.get_mut(&old) {
                Some(n) if *n > 1 => *n -= 1,
                Some(_) => {
                    self.ghost_count.remove(&old);
                }
                None => unreachable!("stripe {old} in the ghost ring but not counted"),
            }
        }
        if stripe != u64::MAX {
            *self.ghost_count.entry(stripe).or_insert(0) += 1;
        }
        debug_assert!(self.ghost_count.len() <= self.ghosts.len());
    }

    /// Whether a stream came back lately to a stripe it had been made to leave (a miss
    /// on one of the last demoted stripes, within the last twice-the-entries misses):
    /// recycling then loses hits, and only streams longer than the whole cache recycle
    /// ([`super::pass`]'s `recycle_first`).
    pub(crate) fn cautious(&self) -> bool {
        self.cautious_misses > 0
    }

    /// Remembers that a sub-stripe write of `stripe` went around the cache (a random
    /// write: it neither continued a stream nor found the stripe cached, and wrote from
    /// its own buffers, `pass.rs`'s single-operation path). A write that comes back to
    /// the stripe while [`Self::bypassed_lately`] says so goes through the cache instead,
    /// and its stripe's blocks stay cached for the writes after it: random writes over a
    /// region the cache can hold find their old data and P/Q there (ARC's ghost idea:
    /// a stripe is admitted on its second write, so a random writer over a region much
    /// larger than the cache, which would only evict, keeps the cheaper path).
    pub(crate) fn note_bypass(&mut self, stripe: u64) {
        if self.keep {
            let slot = self.bypass_slot(stripe);
            self.bypassed[slot] = stripe;
        }
    }

    /// Whether a write of `stripe` went around the cache lately ([`Self::note_bypass`]):
    /// among roughly the last twice-the-entries such writes (a slot keeps the last
    /// stripe mapped to it, so collisions forget early). Always false without caching.
    pub(crate) fn bypassed_lately(&self, stripe: u64) -> bool {
        self.keep && self.bypassed[self.bypass_slot(stripe)] == stripe
    }

    /// The slot of `stripe` in `bypassed`: the top bits of MurmurHash3's 64-bit finalizer
    /// (`fmix64`) of the stripe number, so that a shard's stripe numbers, whatever their
    /// stride, spread over every slot (a plain multiplicative hash maps strides that are
    /// powers of two onto a fraction of the slots).
    pub(crate) fn bypass_slot(&self, stripe: u64) -> usize {
        let mut x = stripe;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^= x >> 33;
        // `checked_shr`: a one-slot table shifts by 64, which maps everything to slot 0.
        x.checked_shr(self.bypass_shift).unwrap_or(0) as usize
    }

    /// Entries [`Self::demote`] made the least recently used so far.
    #[cfg(test)]
    pub(crate) fn demoted(&self) -> u64 {
        self.demoted
    }

    /// Entries in the cache.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether a pass that pinned entry `e` may still mark blocks valid (no
    /// [`Self::invalidate_all`] since).
    pub(crate) fn current(&self, e: u32) -> bool {
        self.entries[e as usize].epoch == self.epoch
    }

    /// Whether `stripe` has an entry with any valid block.
    pub(crate) fn holds(&self, stripe: u64) -> bool {
        self.map
            .get(&stripe)
            .is_some_and(|&e| self.entries[e as usize].valid.iter().any(|v| v.count() > 0))
    }

    /// The unpinned entry of `stripe`, if the cache has one: its valid blocks equal the
    /// members' contents while no pass writes the stripe (see "Rules").
    pub(crate) fn lookup(&self, stripe: u64) -> Option<u32> {
        self.map
            .get(&stripe)
            .copied()
            .filter(|&e| !self.entries[e as usize].pinned)
    }

    /// Makes unpinned entry `e` the most recently used: a read was served from it
    /// (`read.rs`'s `cache_read`), so a stripe that is only read stays cached as one that
    /// is written does. A demoted entry read again is no longer taken first.
    pub(crate) fn touch(&mut self, e: u32) {
        assert!(
            !self.entries[e as usize].pinned,
            "touching pinned entry {e}"
        );
        if self.tail != e {
            self.unlink(e);
            self.push_tail(e);
        }
    }

    /// Forgets what is cached of `stripe` (a path about to write its members without the
    /// cache). A pinned entry is left alone: its pass owns the stripe.
    pub(crate) fn invalidate(&mut self, stripe: u64) {
        if let Some(&e) = self.map.get(&stripe) {
            let ent = &mut self.entries[e as usize];
            if !ent.pinned {
                ent.invalidate();
            }
        }
    }

    /// Forgets everything (a member failed, joined or was replaced); passes running now
    /// mark nothing valid when they end.
    pub(crate) fn invalidate_all(&mut self) {
        self.epoch += 1;
        for ent in &mut self.entries {
            ent.invalidate();
        }
    }

    fn unlink(&mut self, e: u32) {
        let (p, n) = {
            let ent = &self.entries[e as usize];
            (ent.prev, ent.next)
        };
        if p == NONE {
            self.head = n;
        } else {
            self.entries[p as usize].next = n;
        }
        if n == NONE {
            self.tail = p;
        } else {
            self.entries[n as usize].prev = p;
        }
        let ent = &mut self.entries[e as usize];
        ent.prev = NONE;
        ent.next = NONE;
    }

    fn push_head(&mut self, e: u32) {
        let h = self.head;
        {
            let ent = &mut self.entries[e as usize];
            ent.prev = NONE;
            ent.next = h;
        }
        if h == NONE {
            self.tail = e;
        } else {
            self.entries[h as usize].prev = e;
        }
        self.head = e;
    }

    fn push_tail(&mut self, e: u32) {
        let t = self.tail;
        {
            let ent = &mut self.entries[e as usize];
            ent.prev = t;
            ent.next = NONE;
        }
        if t == NONE {
            self.head = e;
        } else {
            self.entries[t as usize].next = e;
        }
        self.tail = e;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_set_ranges_and_runs() {
        let mut s = BlockSet::new(130);
        assert_eq!(s.count(), 0);
        s.insert_range(3, 70);
        s.insert_range(128, 130);
        assert_eq!(s.count(), 67 + 2);
        assert_eq!(s.runs().collect::<Vec<_>>(), vec![(3, 70), (128, 130)]);
        s.remove_range(10, 64);
        assert_eq!(
            s.runs().collect::<Vec<_>>(),
            vec![(3, 10), (64, 70), (128, 130)]
        );
        assert!(s.contains(64) && s.contains(69) && !s.contains(10));
        assert_eq!(s.run_from(4), Some((4, 10)));
        assert_eq!(s.run_from(10), Some((64, 70)));
        assert_eq!(s.run_from(130), None);
        assert!(s.any_in(9, 64) && !s.any_in(10, 64) && !s.any_in(5, 5));
        let mut all = BlockSet::new(130);
        all.insert_range(0, 130);
        let mut d = BlockSet::new(130);
        d.set_difference(&all, &s);
        assert_eq!(
            d.runs().collect::<Vec<_>>(),
            vec![(0, 3), (10, 64), (70, 128)]
        );
        assert!(all.is_superset(&s) && !s.is_superset(&all));
        d.union_with(&s);
        assert_eq!(d.runs().collect::<Vec<_>>(), vec![(0, 130)]);
        // Neither set: the gaps of both, never a block past the end.
        let mut other = BlockSet::new(130);
        other.insert_range(0, 2);
        let mut n = BlockSet::new(130);
        n.set_neither(&s, &other);
        assert_eq!(
            n.runs().collect::<Vec<_>>(),
            vec![(2, 3), (10, 64), (70, 128)]
        );
        assert_eq!(BlockSet::count_neither(&s, &other), n.count());
        let mut u = BlockSet::new(130);
        u.insert_range(0, 1);
        u.union_difference2(&all, &s, &other);
        assert_eq!(
            u.runs().collect::<Vec<_>>(),
            vec![(0, 1), (2, 3), (10, 64), (70, 128)]
        );
        n.set_neither(&BlockSet::new(130), &BlockSet::new(130));
        assert_eq!(n.runs().collect::<Vec<_>>(), vec![(0, 130)]);
        let mut full = BlockSet::new(64);
        full.insert_range(0, 64);
        assert_eq!(full.runs().collect::<Vec<_>>(), vec![(0, 64)]);
    }

    #[test]
    fn block_set_matches_a_plain_model() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |n: u32| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % u64::from(n)) as u32
        };
        for bits in [1u32, 63, 64, 65, 200] {
            let mut s = BlockSet::new(bits);
            let mut m = vec![false; bits as usize];
            for _ in 0..500 {
                let a = rnd(bits + 1);
                let b = a + rnd(bits + 1 - a);
                if rnd(2) == 0 {
                    s.insert_range(a, b);
                    m[a as usize..b as usize].fill(true);
                } else {
                    s.remove_range(a, b);
                    m[a as usize..b as usize].fill(false);
                }
                let mut runs = Vec::new();
                let mut i = 0;
                while i < bits as usize {
                    if m[i] {
                        let j = (i..bits as usize).find(|&j| !m[j]).unwrap_or(bits as usize);
                        runs.push((i as u32, j as u32));
                        i = j;
                    } else {
                        i += 1;
                    }
                }
                assert_eq!(s.runs().collect::<Vec<_>>(), runs, "bits {bits}");
                assert_eq!(s.count() as usize, m.iter().filter(|&&v| v).count());
            }
        }
    }

    #[test]
    fn a_demoted_entry_is_taken_next_and_keeps_its_blocks_until_then() {
        let mut c = StripeCache::new(3, 2, 4096, 512, true);
        let mut pinned = Vec::new();
        for stripe in [10, 11, 12] {
            let (e, _) = c.pin(stripe);
            c.entry_mut(e).valid[0].insert_range(0, 8);
            pinned.push(e);
        }
        for &e in &pinned {
            c.unpin(e, true);
        }
        // Recency now 10, 11, 12 (10 evicted first); 12 is made the next victim.
        c.demote(pinned[2]);
        assert_eq!(c.demoted(), 1);
        assert!(c.holds(12), "demoted, not dropped");
        let (e, hit) = c.pin(12);
        assert_eq!((e, hit), (pinned[2], 8), "still a hit until taken");
        c.unpin(e, true);
        c.demote(e);
        let (e, hit) = c.pin(13);
        assert_eq!(
            (e, hit),
            (pinned[2], 0),
            "the next miss takes the demoted entry"
        );
        assert!(!c.holds(12) && c.holds(10) && c.holds(11));
        c.unpin(e, true);
    }

    /// The ghost counts answer what a scan of the ring would, through random pins,
    /// unpins and demotions that put stripes in the ring more than once; a stripe stops
    /// being a ghost only when its last copy in the ring is overwritten.
    #[test]
    fn ghost_counts_answer_what_the_ring_holds() {
        let mut c = StripeCache::new(4, 1, 4096, 512, true);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (x >> 33) % n
        };
        for _ in 0..20_000 {
            let (e, _) = c.pin(next(12));
            c.unpin(e, true);
            if next(3) > 0 {
                c.demote(e);
            }
            for stripe in 0..12 {
                assert_eq!(
                    c.ghost_count.contains_key(&stripe),
                    c.ghosts.contains(&stripe),
                    "stripe {stripe}, ring {:?}",
                    c.ghosts
                );
            }
            assert_eq!(
                c.ghost_count.values().sum::<u32>() as usize,
                c.ghosts.iter().filter(|&&g| g != u64::MAX).count()
            );
        }
    }

    #[test]
    fn a_miss_on_a_stripe_demoted_lately_makes_the_cache_cautious_for_a_while() {
        let mut c = StripeCache::new(2, 1, 4096, 512, true);
        for stripe in [1, 2] {
            let (e, _) = c.pin(stripe);
            c.unpin(e, true);
            c.demote(e);
        }
        assert!(!c.cautious());
        // A stripe never demoted: no change.
        let (e, _) = c.pin(3);
        c.unpin(e, true);
        assert!(!c.cautious());
        // Stripe 1 was demoted (and since evicted): a stream came back to it.
        let (e, hit) = c.pin(1);
        assert_eq!(hit, 0);
        c.unpin(e, true);
        assert!(c.cautious());
        // Twice the entries of other misses end it.
        for stripe in [10, 11, 12] {
            let (e, _) = c.pin(stripe);
            c.unpin(e, true);
            assert!(c.cautious(), "after miss on {stripe}");
        }
        let (e, _) = c.pin(13);
        c.unpin(e, true);
        assert!(!c.cautious());
    }

    /// The bypass filter remembers the stripes written around the cache lately, spreads
    /// a shard's strided stripe numbers over its slots, works with one slot, and says
    /// nothing when caching is off.
    #[test]
    fn bypassed_stripes_are_remembered_until_their_slot_is_reused() {
        let mut c = StripeCache::new(32, 1, 4096, 512, true);
        assert!(!c.bypassed_lately(5));
        c.note_bypass(5);
        assert!(c.bypassed_lately(5) && !c.bypassed_lately(6));
        // Stripes strided by 16 (a shard of 16 reactors) land in most of the 64 slots
        // (64 keys hashed at random into 64 slots fill 40 on average).
        let slots: std::collections::HashSet<usize> =
            (0..64u64).map(|k| c.bypass_slot(k * 16)).collect();
        assert!(slots.len() >= 36, "{} slots", slots.len());
        // Within a slot the last stripe wins.
        let other = (6..)
            .find(|&x| c.bypass_slot(x) == c.bypass_slot(5))
            .unwrap();
        c.note_bypass(other);
        assert!(c.bypassed_lately(other) && !c.bypassed_lately(5));
        let mut one = StripeCache::new(1, 1, 4096, 512, true);
        let (a, b) = (0..)
            .map(|x| (x, x + 1))
            .find(|&(a, b)| one.bypass_slot(a) == one.bypass_slot(b))
            .unwrap();
        one.note_bypass(a);
        assert!(one.bypassed_lately(a));
        one.note_bypass(b);
        assert!(one.bypassed_lately(b) && !one.bypassed_lately(a));
        let mut off = StripeCache::new(4, 1, 4096, 512, false);
        off.note_bypass(3);
        assert!(!off.bypassed_lately(3));
    }

    #[test]
    fn cache_pins_evicts_by_recency_and_invalidates() {
        let mut c = StripeCache::new(2, 3, 4096, 512, true);
        let (a, hit) = c.pin(10);
        assert_eq!(hit, 0);
        c.entry_mut(a).valid[0].insert_range(0, 8);
        c.unpin(a, true);
        let (b, _) = c.pin(11);
        assert_ne!(a, b);
        c.unpin(b, true);
        // Stripe 10 is cached with 8 valid blocks.
        let (a2, hit) = c.pin(10);
        assert_eq!((a2, hit), (a, 8));
        c.unpin(a2, true);
        // 11 is now the least recently used: a new stripe evicts it.
        let (e, hit) = c.pin(12);
        assert_eq!((e, hit), (b, 0));
        c.unpin(e, true);
        assert_eq!(c.pin(10).1, 8);
        // A pass across an invalidate_all marks nothing valid.
        c.invalidate_all();
        assert!(!c.current(a));
        c.entry_mut(a).valid[1].insert_range(0, 8);
        c.unpin(a, true);
        assert_eq!(c.pin(10).1, 0);
        c.unpin(a, true);
        // invalidate(stripe) forgets an unpinned entry.
        let (e, _) = c.pin(10);
        c.entry_mut(e).valid[2].insert_range(0, 1);
        c.unpin(e, true);
        c.invalidate(10);
        assert_eq!(c.pin(10).1, 0);
    }

    #[test]
    fn a_read_entry_is_evicted_after_the_ones_not_used_since() {
        let mut c = StripeCache::new(3, 3, 4096, 512, true);
        let mut at = Vec::new();
        for s in [10, 11, 12] {
            let (e, _) = c.pin(s);
            c.entry_mut(e).valid[0].insert_range(0, 8);
            c.unpin(e, true);
            at.push(e);
        }
        // 10 is the least recently used; a read of it makes 11 the next one taken.
        c.touch(c.lookup(10).unwrap());
        let (e, hit) = c.pin(13);
        assert_eq!((e, hit), (at[1], 0));
        c.unpin(e, true);
        // Touching the most recent entry changes nothing; a demoted one read is kept.
        c.touch(c.lookup(13).unwrap());
        c.demote(c.lookup(12).unwrap());
        c.touch(c.lookup(12).unwrap());
        let (e, _) = c.pin(14);
        assert_eq!(e, at[0], "stripe 10 was the least recently used");
        c.unpin(e, true);
        assert_eq!(c.lookup(12), Some(at[2]));
        assert_eq!(c.lookup(13), Some(at[1]));
    }
}
