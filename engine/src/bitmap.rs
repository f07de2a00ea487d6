//! The runtime write-intent bitmap: md's rules, shared lock-free by every shard.
//!
//! The on-disk format is [`crate::metadata::bitmap`] (md's internal bitmap). At run time
//! one [`WriteIntent`] is shared (`Arc`) by all shards of an array; exactly one shard — the
//! **owner** (shard 0) — holds a [`BitmapOwner`] and is the only writer of bitmap sectors,
//! so two snapshots of one sector never race on disk. Other shards only set atomics and
//! wait.
//!
//! # md's rules (`drivers/md/md-bitmap.c`)
//! 1. **Before a write to a region is issued, its bit is durable on disk on every online
//!    member** (`md_bitmap_startwrite` + the unplug that writes dirty bitmap pages before
//!    the data goes out). A region ("bitmap chunk") is `chunksize` bytes of every member's
//!    data area; a stripe maps to the regions its member sectors overlap.
//! 2. **Bits are cleared lazily** (the bitmap daemon, `md_bitmap_daemon_work`, every
//!    `daemon_sleep`): md's region counter is left at 2 by the last write and each pass
//!    takes one; at 0 the bit is cleared — so a region is cleared at the second pass after
//!    its last write completed, after one to two `daemon_sleep` periods of quiet (never a
//!    region with a write in flight). The cleared bits are then written — only after
//!    every online member with a volatile write cache was flushed (md writes bitmap pages
//!    with `REQ_PREFLUSH`, `md_super_write`): the region's writes completed before the
//!    pass, so the flush makes them durable, and a bit never reaches the disk clear while
//!    a crash could still take its region's writes out of a cache
//!    ([`BitmapOwner::batch_clears`]).
//! 3. **Never while degraded**: a write that could not reach every member leaves its bit
//!    set (md's `NEEDED`), since the missing member will need the region recovered; the
//!    daemon clears nothing while a member is failed or being recovered (md clears bits
//!    only while `mddev->degraded` is 0, `md_bitmap_endwrite`). Each shard says whether it
//!    sees a member missing ([`WriteIntent::shard_degraded`]); the daemon clears nothing
//!    while any shard does, so a failure one shard has seen and another not yet still
//!    stops every clear. Once the array is whole again (a rebuild or re-add finished on
//!    every shard), clearing resumes, as md's does.
//! 4. Regions found dirty after an unclean shutdown, or marked for a re-added member,
//!    are **needed**: pinned set until the resync/recovery that covers them calls
//!    [`WriteIntent::sync_done`] (md's `md_bitmap_end_sync`).
//! 5. **`events_cleared`** becomes the array's `events` whenever bits are cleared
//!    (`md_bitmap_endwrite`: `events_cleared = mddev->events`), and the bitmap superblock
//!    carries the array's `events` from each superblock update on
//!    ([`WriteIntent::set_events`]; md writes the bitmap superblock before the md
//!    superblocks, `md_update_sb` → `md_bitmap_update_sb`). A member that left the array
//!    at `events` E can be re-added by bitmap only while `events_cleared <= E`
//!    ([`WriteIntent::events_cleared`]; md's `super_1_validate`): no bit was cleared since
//!    it left, so the bits set on disk cover every write it missed
//!    ([`WriteIntent::on_disk_regions`]).
//! 6. **A device joining the array** (a rebuild target, a re-added member, a replacement)
//!    gets the whole bitmap area written, not only the units that change afterwards
//!    ([`WriteIntent::write_all`]; md's `md_bitmap_write_all` when spares are added in
//!    `md_check_recovery`), so it holds the array's bitmap once it is a member.
//!
//! # The writer / clearer race, and why it cannot lose a bit
//! Per region there is an in-flight counter (`counters[r]`, writers) and a `durable` bit
//! (set only by the owner, after the sector holding the bit was written on every online
//! member, and only while it stays set in the owner's image). All accesses below are
//! `SeqCst`, so they fall in one total order S.
//!
//! - **Writer** (any shard): `W1: counters[r] += 1`, then `W2: load durable[r]`. If set,
//!   it issues its member writes; else it sets `requested[r]` and waits until `durable[r]`
//!   is set (it re-checks whenever `generation` changes). `W3: counters[r] -= 1` once its
//!   member writes have completed.
//! - **Clearer** (owner, daemon pass): `C1: durable[r] = 0`, then `C2: load counters[r]`.
//!   Only if it reads 0 does it clear the bit in its image and write that sector; else it
//!   sets `durable[r]` again (the bit was never cleared on disk) and bumps `generation`.
//!
//! Take a writer that saw `durable[r]` set at W2. Then W2 precedes C1 in S (C1 is the only
//! thing that clears it, and a later re-set comes only after a completed write that set the
//! bit again). W1 precedes W2 (program order), so W1 precedes C2 in S and C2 reads a
//! counter ≥ 1 — unless W3 already ran, i.e. the writer's member writes had completed. So
//! the clearer never clears a bit while a write that relied on it is in flight. A writer
//! whose W2 follows C1 reads 0 and waits for the owner to write the bit again. The
//! interleavings are exercised step by step in this module's tests.
//!
//! A write that starts and finishes between two daemon passes also sets a `touched` bit,
//! which restarts the region's count: no region is cleared sooner than one full
//! `daemon_sleep` after its last write completed (md's counter reset to 2 in
//! `md_bitmap_endwrite`).
//!
//! # Limits
//! Memory is fixed at construction: 4 bytes of counter and 6 bits of flags per region, one
//! byte of idle count per region for the owner, and two copies of the bitmap area (at most
//! a few hundred KiB for md-sized bitmaps). Nothing allocates afterwards.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::SeqCst};

use thiserror::Error;

use crate::buf::AlignedBuf;
use crate::geometry::ArrayGeometry;
use crate::metadata::bitmap::{bit_location, Bitmap, BitmapSuper, BITMAP_SUPER_BYTES};

/// Why a [`WriteIntent`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum IntentError {
    /// The bitmap covers fewer member sectors than the array uses.
    #[error(
        "bitmap covers {bitmap_sectors} sectors of each member, the array uses {array_sectors}"
    )]
    TooSmall {
        /// Sectors the bitmap covers (`sync_size`).
        bitmap_sectors: u64,
        /// Sectors of each member the array uses.
        array_sectors: u64,
    },
    /// The bitmap start is not aligned to the unit it is written in.
    #[error("bitmap start at byte {start_bytes} is not a multiple of {unit_bytes} bytes")]
    Misaligned {
        /// Absolute member byte offset of the bitmap.
        start_bytes: u64,
        /// Write unit, bytes.
        unit_bytes: u32,
    },
    /// `daemon_sleep` of 0.
    #[error("bitmap daemon sleep of 0 s")]
    DaemonSleep,
}

/// Which regions start out needed (pinned dirty until a resync or recovery covers them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NeedsSync {
    /// None: the array was shut down clean and no member returns.
    None,
    /// Exactly the bits set on disk (unclean shutdown, or a member re-added by bitmap).
    OnDisk,
    /// Every region (a stale bitmap after an unclean shutdown).
    All,
}

/// What the intent bitmap did, for status and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IntentStats {
    /// Bitmap write batches completed (each one write per dirty unit per member).
    pub flushes: u64,
    /// Bits set on disk.
    pub bits_set: u64,
    /// Bits cleared on disk.
    pub bits_cleared: u64,
    /// Writes that had to wait for their bit.
    pub waits: u64,
}

fn word_bit(r: u64) -> (usize, u64) {
    ((r / 64) as usize, 1u64 << (r % 64))
}

fn words(n: u64) -> Box<[AtomicU64]> {
    (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect()
}

/// The state every shard shares; see the module docs.
pub struct WriteIntent {
    chunk_sectors: u64,
    raid_chunk_sectors: u64,
    stripes: u64,
    regions: u64,
    start_bytes: u64,
    unit_bytes: u32,
    daemon_sleep_ns: u64,
    counters: Box<[AtomicU32]>,
    durable: Box<[AtomicU64]>,
    requested: Box<[AtomicU64]>,
    touched: Box<[AtomicU64]>,
    ondisk: Box<[AtomicU64]>,
    needed: Box<[AtomicU64]>,
    generation: AtomicU64,
    /// Some `requested` bit may be set: the owner scans the words only then (set after
    /// the bit, cleared by the owner before its scan, so no request is missed).
    request_pending: AtomicBool,
    degraded: AtomicBool,
    /// Shards that see a member failed or being recovered ([`WriteIntent::shard_degraded`]).
    degraded_shards: AtomicU64,
    /// The owner is asked to write the whole bitmap area ([`WriteIntent::write_all`]).
    rewrite_all: AtomicBool,
    /// `write_all` requests made, and those whose whole-area write completed on every
    /// online member.
    all_requested: AtomicU64,
    all_written: AtomicU64,
    /// The owner's `events_cleared` (as last changed by a daemon pass).
    events_cleared: AtomicU64,
    events: AtomicU64,
    super_written: AtomicU64,
    owner_taken: AtomicBool,
    /// The bitmap as read at start (the owner's initial image).
    initial: Bitmap,
    /// Every region starts needed and set ([`NeedsSync::All`]): the owner writes them all.
    all: bool,
    flushes: AtomicU64,
    bits_set: AtomicU64,
    bits_cleared: AtomicU64,
    waits: AtomicU64,
}

impl std::fmt::Debug for WriteIntent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteIntent")
            .field("regions", &self.regions)
            .field("chunk_sectors", &self.chunk_sectors)
            .field("start_bytes", &self.start_bytes)
            .finish_non_exhaustive()
    }
}

impl WriteIntent {
    /// The shared state for an array `geo` whose bitmap, as read from disk, is `bitmap`,
    /// starting at absolute member byte `start_bytes` (`(super_offset + bitmap_offset) ×
    /// 512`). Bits set on disk start durable. `needs_sync` says which regions are pinned
    /// until [`WriteIntent::sync_done`]. Bitmap sectors are written in units of 4 KiB when
    /// `start_bytes` is 4 KiB-aligned (mdadm's placement), else 512 bytes.
    ///
    /// # Errors
    /// [`IntentError::TooSmall`] when the bitmap covers less than the array;
    /// [`IntentError::DaemonSleep`].
    pub fn new(
        bitmap: &Bitmap,
        start_bytes: u64,
        geo: &ArrayGeometry,
        needs_sync: NeedsSync,
    ) -> Result<Self, IntentError> {
        let s = &bitmap.super_;
        let raid_chunk_sectors = u64::from(geo.geometry().chunk_sectors());
        let array_sectors = geo.stripes() * raid_chunk_sectors;
        if s.sync_size < array_sectors {
            return Err(IntentError::TooSmall {
                bitmap_sectors: s.sync_size,
                array_sectors,
            });
        }
        if s.daemon_sleep == 0 {
            return Err(IntentError::DaemonSleep);
        }
        let unit_bytes = if start_bytes.is_multiple_of(4096) {
            4096
        } else {
            512
        };
        if !start_bytes.is_multiple_of(512) {
            return Err(IntentError::Misaligned {
                start_bytes,
                unit_bytes: 512,
            });
        }
        let regions = s.bits();
        let me = WriteIntent {
            chunk_sectors: s.chunk_sectors().max(1),
            raid_chunk_sectors,
            stripes: geo.stripes(),
            regions,
            start_bytes,
            unit_bytes,
            daemon_sleep_ns: u64::from(s.daemon_sleep).saturating_mul(1_000_000_000),
            counters: (0..regions).map(|_| AtomicU32::new(0)).collect(),
            durable: words(regions),
            requested: words(regions),
            touched: words(regions),
            ondisk: words(regions),
            needed: words(regions),
            generation: AtomicU64::new(0),
            request_pending: AtomicBool::new(false),
            degraded: AtomicBool::new(false),
            degraded_shards: AtomicU64::new(0),
            rewrite_all: AtomicBool::new(false),
            all_requested: AtomicU64::new(0),
            all_written: AtomicU64::new(0),
            events_cleared: AtomicU64::new(s.events_cleared),
            events: AtomicU64::new(s.events),
            super_written: AtomicU64::new(s.events),
            owner_taken: AtomicBool::new(false),
            initial: bitmap.clone(),
            all: needs_sync == NeedsSync::All,
            flushes: AtomicU64::new(0),
            bits_set: AtomicU64::new(0),
            bits_cleared: AtomicU64::new(0),
            waits: AtomicU64::new(0),
        };
        for r in 0..regions {
            if bitmap.is_set(r) {
                let (w, b) = word_bit(r);
                me.durable[w].fetch_or(b, SeqCst);
                me.ondisk[w].fetch_or(b, SeqCst);
                if needs_sync == NeedsSync::OnDisk {
                    me.needed[w].fetch_or(b, SeqCst);
                }
            }
            if needs_sync == NeedsSync::All {
                let (w, b) = word_bit(r);
                me.needed[w].fetch_or(b, SeqCst);
            }
        }
        Ok(me)
    }

    /// Number of regions (bits).
    pub fn regions(&self) -> u64 {
        self.regions
    }

    /// Bytes of each member one region covers (the bitmap chunk).
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_sectors * 512
    }

    /// The bitmap chunk in whole stripes (member sectors per region / RAID chunk sectors),
    /// or `None` when a region is smaller than a stripe's chunk (then a stripe spans
    /// several regions).
    pub fn chunk_stripes(&self) -> Option<u64> {
        (self.chunk_sectors >= self.raid_chunk_sectors)
            .then_some(self.chunk_sectors / self.raid_chunk_sectors)
    }

    /// Absolute member byte offset of the bitmap area.
    pub fn start_bytes(&self) -> u64 {
        self.start_bytes
    }

    /// The regions stripe `stripe` writes to (member sectors
    /// `[stripe × chunk, (stripe+1) × chunk)` of every member's data area).
    pub fn stripe_regions(&self, stripe: u64) -> Range<u64> {
        let first = stripe * self.raid_chunk_sectors;
        let last = first + self.raid_chunk_sectors - 1;
        first / self.chunk_sectors..(last / self.chunk_sectors + 1).min(self.regions)
    }

    /// The stripes that overlap region `region`.
    pub fn region_stripes(&self, region: u64) -> Range<u64> {
        let first = region * self.chunk_sectors;
        let end = first + self.chunk_sectors;
        (first / self.raid_chunk_sectors).min(self.stripes)
            ..end.div_ceil(self.raid_chunk_sectors).min(self.stripes)
    }

    fn test(words: &[AtomicU64], r: u64) -> bool {
        let (w, b) = word_bit(r);
        words[w].load(SeqCst) & b != 0
    }

    /// Whether region `r` is set on disk (as of the last completed bitmap write).
    pub fn on_disk(&self, r: u64) -> bool {
        Self::test(&self.ondisk, r)
    }

    /// Whether region `r`'s bit is durable on every online member (writes may be issued).
    pub fn is_durable(&self, r: u64) -> bool {
        Self::test(&self.durable, r)
    }

    /// Whether region `r` is needed (pinned for resync/recovery).
    pub fn is_needed(&self, r: u64) -> bool {
        Self::test(&self.needed, r)
    }

    /// Writes in flight to region `r`.
    pub fn in_flight(&self, r: u64) -> u32 {
        self.counters[r as usize].load(SeqCst)
    }

    /// Stripe ranges of the **needed** regions, ascending and merged: what a resync after
    /// an unclean shutdown (or a bitmap-based recovery) must cover. Allocates (a control
    /// path, not the data path).
    pub fn dirty_regions(&self) -> Vec<Range<u64>> {
        self.stripe_ranges(|r| self.is_needed(r))
    }

    /// Number of bits set on disk.
    pub fn dirty_on_disk(&self) -> u64 {
        self.ondisk
            .iter()
            .map(|w| u64::from(w.load(SeqCst).count_ones()))
            .sum()
    }

    /// A resync or recovery made `stripes` consistent: the regions wholly inside are no
    /// longer needed and the daemon may clear them (when idle and not degraded).
    pub fn sync_done(&self, stripes: Range<u64>) {
        for r in 0..self.regions {
            let s = self.region_stripes(r);
            if s.start >= stripes.start && s.end <= stripes.end && !s.is_empty() {
                let (w, b) = word_bit(r);
                self.needed[w].fetch_and(!b, SeqCst);
            }
        }
    }

    /// Marks the bitmap degraded for good (until restart): the daemon clears no bit any
    /// more. The arrays use [`WriteIntent::shard_degraded`], which lifts once the array is
    /// whole again; this is for callers without shards.
    pub fn set_degraded(&self) {
        self.degraded.store(true, SeqCst);
    }

    /// One shard now sees (`true`) or no longer sees (`false`) a member failed or being
    /// recovered; `was` is what it reported before (a transition is counted once). The
    /// daemon clears nothing while any shard is degraded (rule 3). A shard reports a
    /// failure before it issues any write that skips the member, so no write that missed
    /// a member can find the daemon clearing.
    pub fn shard_degraded(&self, now: bool, was: bool) {
        match (was, now) {
            (false, true) => {
                self.degraded_shards.fetch_add(1, SeqCst);
            }
            (true, false) => {
                let prev = self.degraded_shards.fetch_sub(1, SeqCst);
                debug_assert!(prev > 0, "a shard left a degraded state it never entered");
            }
            _ => {}
        }
    }

    /// Whether the daemon must keep every bit: some shard sees a member missing, or
    /// [`WriteIntent::set_degraded`] was called.
    pub fn degraded(&self) -> bool {
        self.degraded.load(SeqCst) || self.degraded_shards.load(SeqCst) > 0
    }

    /// Asks the owner to write the whole bitmap area (superblock and every bit) to every
    /// online member in its next batch: a device joined the array (rule 6). Returns a
    /// ticket: [`WriteIntent::all_written`] reaches it once such a batch completed.
    pub fn write_all(&self) -> u64 {
        let t = self.all_requested.fetch_add(1, SeqCst) + 1;
        self.rewrite_all.store(true, SeqCst);
        t
    }

    /// The highest [`WriteIntent::write_all`] ticket whose whole-area write has completed
    /// on every member online at the time.
    pub fn all_written(&self) -> u64 {
        self.all_written.load(SeqCst)
    }

    /// The bitmap's `events_cleared`: the array's `events` when bits were last cleared
    /// (rule 5). A device whose own `events` is below it may have missed writes whose bits
    /// are gone: it needs a full rebuild.
    pub fn events_cleared(&self) -> u64 {
        self.events_cleared.load(SeqCst)
    }

    /// Whether every region was forced dirty at start (a stale bitmap after an unclean
    /// shutdown): the bits then say nothing about what a returning member missed.
    pub fn forced_all(&self) -> bool {
        self.all
    }

    /// Stripe ranges of the regions **set on disk**, ascending and merged: what a member
    /// returning by bitmap (re-add) must be recovered over — every write it missed had its
    /// bit made durable first, and none has been cleared while it was away (rules 1, 3).
    /// Allocates (a control path).
    pub fn on_disk_regions(&self) -> Vec<Range<u64>> {
        self.stripe_ranges(|r| self.on_disk(r))
    }

    /// Stripe ranges of the regions `pick` selects, ascending and merged.
    fn stripe_ranges(&self, pick: impl Fn(u64) -> bool) -> Vec<Range<u64>> {
        let mut out: Vec<Range<u64>> = Vec::new();
        for r in (0..self.regions).filter(|&r| pick(r)) {
            let s = self.region_stripes(r);
            if s.is_empty() {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.end >= s.start => last.end = last.end.max(s.end),
                _ => out.push(s),
            }
        }
        out
    }

    /// The array's superblocks are about to move to `events`: the owner writes the bitmap
    /// superblock with it; wait for [`WriteIntent::super_written_events`] to reach it
    /// before writing the md superblocks (md's order).
    pub fn set_events(&self, events: u64) {
        self.events.fetch_max(events, SeqCst);
    }

    /// The `events` of the last bitmap superblock written on every online member.
    pub fn super_written_events(&self) -> u64 {
        self.super_written.load(SeqCst)
    }

    /// Bumped whenever bits become durable: waiting writers re-check.
    pub fn generation(&self) -> u64 {
        self.generation.load(SeqCst)
    }

    /// What was done so far.
    pub fn stats(&self) -> IntentStats {
        IntentStats {
            flushes: self.flushes.load(SeqCst),
            bits_set: self.bits_set.load(SeqCst),
            bits_cleared: self.bits_cleared.load(SeqCst),
            waits: self.waits.load(SeqCst),
        }
    }

    // ---- the four steps of the race (module docs), each one SeqCst access ---------------

    /// W1: count a write in flight to region `r` (and mark it touched).
    fn w1_count(&self, r: u64) {
        let c = self.counters[r as usize].fetch_add(1, SeqCst);
        debug_assert!(c < u32::MAX, "region write counter overflow");
        let (w, b) = word_bit(r);
        if self.touched[w].load(SeqCst) & b == 0 {
            self.touched[w].fetch_or(b, SeqCst);
        }
    }

    /// W2: is region `r`'s bit durable?
    fn w2_durable(&self, r: u64) -> bool {
        Self::test(&self.durable, r)
    }

    /// C1: take the durable bit of region `r` away; returns whether it was set.
    fn c1_take_durable(&self, r: u64) -> bool {
        let (w, b) = word_bit(r);
        self.durable[w].fetch_and(!b, SeqCst) & b != 0
    }

    /// C2: is a write in flight to region `r`?
    fn c2_in_flight(&self, r: u64) -> bool {
        self.counters[r as usize].load(SeqCst) > 0
    }

    /// The clearer backs off: the bit was never cleared on disk, make it durable again.
    fn c_restore(&self, r: u64) {
        let (w, b) = word_bit(r);
        self.durable[w].fetch_or(b, SeqCst);
    }

    // ---- writer side -----------------------------------------------------------------

    /// A write to `regions` begins (W1, W2 of the module docs): counts it in flight and
    /// returns whether every bit is durable. If not, the bits are requested from the owner
    /// and the caller must wait until [`WriteIntent::all_durable`] holds (re-check when
    /// [`WriteIntent::generation`] changes) before issuing member writes. Pair with
    /// [`WriteIntent::end_write`].
    pub fn begin_write(&self, regions: Range<u64>) -> bool {
        debug_assert!(regions.end <= self.regions);
        for r in regions.clone() {
            self.w1_count(r);
        }
        let mut ready = true;
        for r in regions {
            if !self.w2_durable(r) {
                let (w, b) = word_bit(r);
                self.requested[w].fetch_or(b, SeqCst);
                ready = false;
            }
        }
        if !ready {
            self.request_pending.store(true, SeqCst);
            self.waits.fetch_add(1, SeqCst);
        }
        ready
    }

    /// Whether every bit of `regions` is durable (a waiting writer's re-check). Re-requests
    /// the ones that are not (a request the owner consumed while a clear was restoring the
    /// bit is thereby never lost).
    pub fn all_durable(&self, regions: Range<u64>) -> bool {
        let mut ready = true;
        for r in regions {
            if !Self::test(&self.durable, r) {
                let (w, b) = word_bit(r);
                if self.requested[w].load(SeqCst) & b == 0 {
                    self.requested[w].fetch_or(b, SeqCst);
                    self.request_pending.store(true, SeqCst);
                }
                ready = false;
            }
        }
        ready
    }

    /// The write to `regions` finished (all its member writes completed or failed), W3.
    pub fn end_write(&self, regions: Range<u64>) {
        for r in regions {
            let (w, b) = word_bit(r);
            if self.touched[w].load(SeqCst) & b == 0 {
                self.touched[w].fetch_or(b, SeqCst);
            }
            let c = self.counters[r as usize].fetch_sub(1, SeqCst);
            assert!(c > 0, "end_write without begin_write on region {r}");
        }
    }

    /// Claims the owner role: the one [`BitmapOwner`] of this bitmap.
    ///
    /// # Panics
    /// If an owner was already created (a programmer error: two writers of one sector).
    pub fn owner(&self) -> BitmapOwner {
        assert!(
            !self.owner_taken.swap(true, SeqCst),
            "a write-intent bitmap has exactly one owner"
        );
        BitmapOwner::new(self)
    }
}

/// One bitmap write batch: write `len` bytes from `ptr` at absolute member byte `offset`,
/// on every online member, FUA; then [`BitmapOwner::batch_done`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BitmapWrite {
    /// Absolute member byte offset.
    pub offset_bytes: u64,
    /// Bytes (a multiple of the write unit).
    pub len_bytes: u32,
    /// Start of the bytes within the owner's batch buffer.
    pub buf_offset: usize,
}

/// The owner shard's part: the image of the bitmap area, the write batch in flight, and
/// the daemon's idle counts. Not shared; see the module docs.
pub struct BitmapOwner {
    super_: BitmapSuper,
    /// What the bitmap area should hold (superblock + bits), area-sized.
    image: Vec<u8>,
    /// Units of `image` changed since they were last written.
    dirty_units: Vec<bool>,
    /// The batch in flight: a snapshot of the units being written.
    snapshot: AlignedBuf,
    /// Units in the batch in flight (ascending), and how many were.
    batch: Vec<u32>,
    in_flight: bool,
    /// `events` of the superblock in the batch in flight (0 = superblock not in it).
    batch_events: u64,
    /// Consecutive daemon passes each region was seen idle.
    idle: Vec<u8>,
    /// Bits set in the image.
    image_set: u64,
    next_pass_ns: Option<u64>,
    unit_bytes: u32,
    /// The bitmap was stale and every bit is being written ([`NeedsSync::All`]): once the
    /// first batch is on disk, clear the stale flag (then the bits say it all).
    clear_stale: bool,
    /// [`WriteIntent::write_all`] tickets covered by the batch in flight (0: none) and by
    /// the units marked dirty since (0: none).
    batch_all: u64,
    pending_all: u64,
    /// Bits were cleared in the image since the last batch started, and the batch in
    /// flight clears bits (rule 2: it goes out after a flush).
    clears_pending: bool,
    batch_clears: bool,
}

impl BitmapOwner {
    fn new(i: &WriteIntent) -> Self {
        let area = i.initial.to_area(false);
        let units = area.len() / i.unit_bytes as usize;
        let mut o = BitmapOwner {
            super_: i.initial.super_.clone(),
            snapshot: AlignedBuf::zeroed(area.len()),
            image: area,
            dirty_units: vec![false; units],
            batch: Vec::with_capacity(units),
            in_flight: false,
            batch_events: 0,
            idle: vec![0; i.regions as usize],
            image_set: i.initial.dirty_count(),
            next_pass_ns: None,
            unit_bytes: i.unit_bytes,
            clear_stale: i.all && i.initial.super_.is_stale(),
            batch_all: 0,
            pending_all: 0,
            clears_pending: false,
            batch_clears: false,
        };
        if i.all {
            for r in 0..i.regions {
                if !o.image_bit(r) {
                    o.set_image_bit(r, true);
                }
            }
        }
        o
    }

    fn unit_of_bit(&self, r: u64) -> usize {
        (bit_location(r).0 / u64::from(self.unit_bytes)) as usize
    }

    fn image_bit(&self, r: u64) -> bool {
        let (byte, mask) = bit_location(r);
        self.image[byte as usize] & mask != 0
    }

    fn set_image_bit(&mut self, r: u64, v: bool) {
        let (byte, mask) = bit_location(r);
        let b = &mut self.image[byte as usize];
        if v && *b & mask == 0 {
            *b |= mask;
            self.image_set += 1;
        } else if !v && *b & mask != 0 {
            *b &= !mask;
            self.image_set -= 1;
        }
        let u = self.unit_of_bit(r);
        self.dirty_units[u] = true;
    }

    /// Whether a batch is in flight.
    pub fn busy(&self) -> bool {
        self.in_flight
    }

    /// Whether the batch in flight clears bits: then the caller flushes every online
    /// member with a volatile write cache, and issues the batch's writes only once those
    /// flushes completed (rule 2 in the module docs; md's `REQ_PREFLUSH`).
    pub fn batch_clears(&self) -> bool {
        self.in_flight && self.batch_clears
    }

    /// The next daemon pass, on the array clock (ns), when one is due (bits are set on
    /// disk or in the image); a virtual-time executor advances no further than this.
    pub fn next_deadline_ns(&self) -> Option<u64> {
        // A pass waits for the batch in flight (whose completion comes from the members).
        if self.image_set == 0 || self.in_flight {
            return None;
        }
        self.next_pass_ns
    }

    /// The owner's turn, at array time `now_ns`: takes the bit requests, runs a daemon pass
    /// when due, and — when nothing is in flight and units changed — starts a batch,
    /// returning its writes in `out` (cleared first; capacity fixed at construction). The
    /// caller issues each on every online member and calls
    /// [`BitmapOwner::batch_done`] when all completed.
    pub fn poll(&mut self, i: &WriteIntent, now_ns: u64, out: &mut Vec<BitmapWrite>) {
        out.clear();
        // Requests: bits writers wait for (the words are scanned only when some are set).
        let mut immediate = false;
        let words = if i.request_pending.swap(false, SeqCst) {
            i.requested.len()
        } else {
            0
        };
        for w in 0..words {
            let req = i.requested[w].swap(0, SeqCst);
            let mut bits = req;
            while bits != 0 {
                let r = w as u64 * 64 + u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                if r >= i.regions {
                    continue;
                }
                if self.image_bit(r) {
                    // Set in the image: durable already, or on its way (in a batch or a
                    // dirty unit; completion makes it durable). Set on disk and not about
                    // to be cleared: durable now.
                    let u = self.unit_of_bit(r);
                    let pending =
                        self.dirty_units[u] || (self.in_flight && self.batch.contains(&(u as u32)));
                    if i.on_disk(r) && !pending && !i.is_durable(r) {
                        let (wd, b) = word_bit(r);
                        i.durable[wd].fetch_or(b, SeqCst);
                        immediate = true;
                    }
                } else {
                    self.set_image_bit(r, true);
                }
            }
        }
        if immediate {
            i.generation.fetch_add(1, SeqCst);
        }
        // A device joined: every unit goes out again (rule 6).
        if i.rewrite_all.swap(false, SeqCst) {
            self.pending_all = i.all_requested.load(SeqCst);
            self.dirty_units.iter_mut().for_each(|d| *d = true);
        }
        // The superblock's events.
        let ev = i.events.load(SeqCst);
        if ev > self.super_.events {
            self.super_.events = ev;
            self.encode_super();
        }
        // The daemon.
        if self.next_pass_ns.is_none() {
            self.next_pass_ns = Some(now_ns.saturating_add(i.daemon_sleep_ns));
        }
        if !self.in_flight && self.next_pass_ns.is_some_and(|t| now_ns >= t) {
            self.next_pass_ns = Some(now_ns.saturating_add(i.daemon_sleep_ns));
            self.daemon_pass(i);
        }
        if self.in_flight || !self.dirty_units.iter().any(|&d| d) {
            return;
        }
        // Start a batch: snapshot the dirty units, merged into runs.
        self.batch.clear();
        let ub = self.unit_bytes as usize;
        let mut run: Option<(usize, usize)> = None;
        for u in 0..self.dirty_units.len() {
            if self.dirty_units[u] {
                self.dirty_units[u] = false;
                self.batch.push(u as u32);
                self.snapshot[u * ub..(u + 1) * ub]
                    .copy_from_slice(&self.image[u * ub..(u + 1) * ub]);
                run = match run {
                    Some((s, e)) if e == u => Some((s, u + 1)),
                    Some((s, e)) => {
                        out.push(self.write_of(i, s, e));
                        Some((u, u + 1))
                    }
                    None => Some((u, u + 1)),
                };
            }
        }
        if let Some((s, e)) = run {
            out.push(self.write_of(i, s, e));
        }
        self.batch_events = if self.batch.first() == Some(&0) {
            self.super_.events
        } else {
            0
        };
        self.batch_all = std::mem::take(&mut self.pending_all);
        self.batch_clears = std::mem::take(&mut self.clears_pending);
        self.in_flight = true;
    }

    fn write_of(&self, i: &WriteIntent, s: usize, e: usize) -> BitmapWrite {
        let ub = self.unit_bytes as usize;
        BitmapWrite {
            offset_bytes: i.start_bytes + (s * ub) as u64,
            len_bytes: ((e - s) * ub) as u32,
            buf_offset: s * ub,
        }
    }

    /// The batch buffer the [`BitmapWrite`]s point into (stable while a batch is in
    /// flight).
    pub fn buffer(&mut self) -> &mut AlignedBuf {
        &mut self.snapshot
    }

    fn encode_super(&mut self) {
        self.image[..BITMAP_SUPER_BYTES].copy_from_slice(&self.super_.encode());
        self.dirty_units[0] = true;
    }

    /// One daemon pass (rule 2): idle regions are cleared at their second idle pass,
    /// unless needed or the array is degraded.
    fn daemon_pass(&mut self, i: &WriteIntent) {
        if i.degraded() {
            return;
        }
        let mut cleared = false;
        let mut restored = false;
        for r in 0..i.regions {
            if !self.image_bit(r) {
                continue;
            }
            let (w, b) = word_bit(r);
            let touched = i.touched[w].load(SeqCst) & b != 0;
            if touched {
                i.touched[w].fetch_and(!b, SeqCst);
            }
            let idx = r as usize;
            if i.in_flight(r) > 0 || i.is_needed(r) {
                self.idle[idx] = 0;
                continue;
            }
            // md's counter: a finished write leaves it at 2, each pass takes one, the bit
            // goes at 0 — so the first pass after a write counts once, the next clears.
            if touched {
                self.idle[idx] = 1;
                continue;
            }
            self.idle[idx] = self.idle[idx].saturating_add(1);
            if self.idle[idx] < 2 {
                continue;
            }
            // C1, C2 (module docs). A member failure seen since the pass began stops it:
            // a write that skipped the member may have completed in between (rule 3).
            let was = i.c1_take_durable(r);
            if i.c2_in_flight(r) || i.degraded() {
                if was {
                    i.c_restore(r);
                    restored = true;
                }
                self.idle[idx] = 0;
                continue;
            }
            self.idle[idx] = 0;
            self.set_image_bit(r, false);
            cleared = true;
        }
        if restored {
            i.generation.fetch_add(1, SeqCst);
        }
        if cleared {
            self.clears_pending = true;
            // md_bitmap_endwrite: events_cleared = the array's events when bits are cleared.
            self.super_.events_cleared = i.events.load(SeqCst).max(self.super_.events);
            i.events_cleared
                .fetch_max(self.super_.events_cleared, SeqCst);
            self.encode_super();
        }
    }

    /// The batch finished on every online member (`ok`: at least one member took it; a
    /// member that failed it has been failed by the caller). Bits it set become durable;
    /// bits it cleared are cleared on disk; the superblock's `events` is recorded as
    /// written.
    pub fn batch_done(&mut self, i: &WriteIntent, ok: bool) {
        assert!(self.in_flight, "batch_done without a batch");
        self.in_flight = false;
        i.flushes.fetch_add(1, SeqCst);
        if !ok {
            // Nothing reached any member: write the same units again.
            for &u in &self.batch {
                self.dirty_units[u as usize] = true;
            }
            self.pending_all = self.pending_all.max(self.batch_all);
            self.clears_pending |= self.batch_clears;
            return;
        }
        if self.batch_all != 0 {
            i.all_written.fetch_max(self.batch_all, SeqCst);
        }
        let ub = u64::from(self.unit_bytes);
        let mut any = false;
        for k in 0..self.batch.len() {
            let u = u64::from(self.batch[k]);
            let lo = (u * ub).max(BITMAP_SUPER_BYTES as u64);
            let hi = (u + 1) * ub;
            let first = (lo - BITMAP_SUPER_BYTES as u64) * 8;
            let end = ((hi - BITMAP_SUPER_BYTES as u64) * 8).min(i.regions);
            for r in first..end {
                let (byte, mask) = bit_location(r);
                let written = self.snapshot[byte as usize] & mask != 0;
                let (w, b) = word_bit(r);
                let was = i.ondisk[w].load(SeqCst) & b != 0;
                if written && !was {
                    i.ondisk[w].fetch_or(b, SeqCst);
                    i.bits_set.fetch_add(1, SeqCst);
                } else if !written && was {
                    i.ondisk[w].fetch_and(!b, SeqCst);
                    i.bits_cleared.fetch_add(1, SeqCst);
                }
                // Durable only while the image still holds it (never for a bit a later
                // clear took out of the image).
                if written && self.image_bit(r) && i.durable[w].load(SeqCst) & b == 0 {
                    i.durable[w].fetch_or(b, SeqCst);
                    any = true;
                }
            }
        }
        if self.batch_events != 0 {
            i.super_written.fetch_max(self.batch_events, SeqCst);
        }
        if self.clear_stale && !self.dirty_units.iter().any(|&d| d) {
            // Every bit is on disk now: the stale flag can go (in a later write, after).
            self.clear_stale = false;
            self.super_.state &= !crate::metadata::bitmap::BITMAP_STATE_STALE;
            self.encode_super();
        }
        if any {
            i.generation.fetch_add(1, SeqCst);
        }
    }

    /// The bitmap superblock as the owner currently has it.
    pub fn super_block(&self) -> &BitmapSuper {
        &self.super_
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Geometry, Layout, Level};
    use crate::metadata::Uuid;

    /// A RAID5 of 3 members, 64 stripes of 4 KiB chunks, 8 KiB bitmap chunks (32 regions),
    /// daemon every 1 s; `set` regions set on disk.
    fn intent(set: &[u64]) -> WriteIntent {
        let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 4096, 512).unwrap();
        let geo = ArrayGeometry::new(g, 64).unwrap();
        let mut b = Bitmap::new(BitmapSuper::new(Uuid([1; 16]), 64 * 8, 8192, 1), false);
        for &r in set {
            b.set(r, true);
        }
        WriteIntent::new(&b, 8192, &geo, NeedsSync::None).unwrap()
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Step {
        W1,
        W2,
        W3,
        C1,
        C2,
    }

    /// Every interleaving of the writer's W1 → W2 (→ W3 once its write is done, if it
    /// proceeded) with the clearer's C1 → C2, run on the real step functions: the clearer
    /// never decides to clear while a writer that saw the bit durable is still writing,
    /// and a writer that did not see it waits.
    #[test]
    fn writer_and_clearer_interleavings_never_lose_a_bit() {
        use Step::*;
        let orders: Vec<Vec<Step>> = vec![
            vec![W1, W2, W3, C1, C2],
            vec![W1, W2, C1, W3, C2],
            vec![W1, W2, C1, C2, W3],
            vec![W1, C1, W2, C2],
            vec![W1, C1, C2, W2],
            vec![C1, W1, W2, C2],
            vec![C1, W1, C2, W2],
            vec![C1, C2, W1, W2],
        ];
        for order in orders {
            let i = intent(&[5]);
            let mut proceeded = None;
            let mut writing = false;
            let mut cleared = None;
            let mut took = false;
            for step in &order {
                match step {
                    W1 => i.w1_count(5),
                    W2 => {
                        let ok = i.w2_durable(5);
                        proceeded = Some(ok);
                        writing = ok;
                    }
                    W3 => {
                        i.end_write(5..6);
                        writing = false;
                    }
                    C1 => took = i.c1_take_durable(5),
                    C2 => {
                        let busy = i.c2_in_flight(5);
                        if busy && took {
                            i.c_restore(5);
                        }
                        cleared = Some(!busy);
                        assert!(
                            !writing || busy,
                            "{order:?}: cleared while a write relying on the bit is in flight"
                        );
                    }
                }
            }
            let (p, c) = (proceeded.unwrap(), cleared.unwrap());
            // Outcomes by order: the writer proceeds when W2 precedes C1, or when the
            // clearer saw it counted (W1 before C2) and restored the bit before W2.
            let at = |x: Step| order.iter().position(|&s| s == x).unwrap();
            let expect = at(W2) < at(C1) || (at(W1) < at(C2) && at(C2) < at(W2));
            assert_eq!(p, expect, "{order:?}");
            if !p {
                assert!(!i.w2_durable(5) || !c, "{order:?}: durable after a clear");
            }
            if p && !c {
                assert!(
                    i.w2_durable(5),
                    "{order:?}: a backed-off clear must restore the bit"
                );
            }
        }
    }

    /// The owner's whole cycle with the real functions and no I/O: set, durable, busy
    /// region survives the daemon, idle region cleared, then requested again.
    #[test]
    fn owner_cycle_sets_clears_and_sets_again() {
        let i = intent(&[]);
        let mut o = i.owner();
        let mut out = Vec::with_capacity(8);
        // A writer wants region 3: not durable, requested.
        assert!(!i.begin_write(3..4));
        o.poll(&i, 0, &mut out);
        assert_eq!(
            out,
            vec![BitmapWrite {
                offset_bytes: 8192,
                len_bytes: 4096,
                buf_offset: 0
            }]
        );
        assert!(o.busy());
        assert!(!i.all_durable(3..4));
        let g = i.generation();
        o.batch_done(&i, true);
        assert!(i.all_durable(3..4) && i.on_disk(3));
        assert!(i.generation() > g);
        // Daemon passes while the write is in flight: never cleared.
        for t in 1..5 {
            o.poll(&i, t * 1_000_000_000, &mut out);
            assert!(out.is_empty());
            assert!(i.is_durable(3));
        }
        i.end_write(3..4);
        // First pass after the write: counted once; the next one clears.
        o.poll(&i, 5_000_000_000, &mut out);
        assert!(out.is_empty() && i.is_durable(3));
        i.set_events(9);
        o.poll(&i, 6_000_000_000, &mut out);
        assert_eq!(
            out.len(),
            1,
            "the cleared bit and the superblock are written"
        );
        assert!(!i.is_durable(3));
        assert!(
            i.on_disk(3),
            "cleared on disk only when the write completes"
        );
        // A writer arriving meanwhile waits; its request is taken once the batch is done.
        assert!(!i.begin_write(3..4));
        o.batch_done(&i, true);
        assert!(!i.on_disk(3));
        assert_eq!(o.super_block().events_cleared, 9);
        assert_eq!(i.super_written_events(), 9);
        o.poll(&i, 7_000_000_001, &mut out);
        assert_eq!(out.len(), 1);
        o.batch_done(&i, true);
        assert!(i.all_durable(3..4));
        i.end_write(3..4);
        let s = i.stats();
        assert_eq!((s.bits_set, s.bits_cleared, s.waits), (2, 1, 2));
    }

    #[test]
    fn failed_batch_is_written_again_and_degraded_clears_nothing() {
        let i = intent(&[]);
        let mut o = i.owner();
        let mut out = Vec::with_capacity(8);
        assert!(!i.begin_write(0..1));
        o.poll(&i, 0, &mut out);
        o.batch_done(&i, false);
        assert!(!i.all_durable(0..1));
        o.poll(&i, 1, &mut out);
        assert_eq!(out.len(), 1);
        o.batch_done(&i, true);
        assert!(i.all_durable(0..1));
        i.end_write(0..1);
        i.set_degraded();
        for t in 1..10 {
            o.poll(&i, t * 1_000_000_000, &mut out);
        }
        assert!(i.on_disk(0) && i.is_durable(0));
    }

    #[test]
    #[should_panic(expected = "exactly one owner")]
    fn one_owner_only() {
        let i = intent(&[]);
        let _a = i.owner();
        let _b = i.owner();
    }

    #[test]
    fn stripe_and_region_maps() {
        let i = intent(&[]);
        assert_eq!(i.regions(), 32);
        assert_eq!(i.stripe_regions(0), 0..1);
        assert_eq!(i.stripe_regions(63), 31..32);
        assert_eq!(i.region_stripes(31), 62..64);
        assert_eq!(i.chunk_stripes(), Some(2));
    }
}
