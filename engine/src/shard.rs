//! Stripe ownership across reactors, and a single-threaded composition of shards.
//!
//! Every stripe is owned by exactly one reactor: [`owner`] maps stripe `s` to reactor
//! `s mod reactors`, so consecutive stripes (sequential I/O) spread over all reactors and
//! each reactor's [`Array`] sees only its own stripes — stripe state needs no locks.
//! [`split`] cuts an array request at stripe boundaries into pieces for their owners; a
//! piece lends a sub-range of the caller's buffer (moved by reference, never copied).
//!
//! [`ShardedArray`] runs several shards in one thread: what the virtual-time executor uses
//! to run 1, 2 or 4 "reactors" deterministically over simulated members. The threaded
//! reactor runtime routes with the same [`split`].

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use crate::array::{
    Array, ArrayCompletion, ArrayError, ArrayOp, ArrayRequest, MemberState, ReplaceInfo,
    ReplaceState,
};
use crate::device::{Channel, IoBuf, IoError};
use crate::geometry::ArrayGeometry;
use crate::process::{
    ProcessError, ProcessKind, ProcessRequest, ProcessSnapshot, ProcessState, ShardProgress,
};

/// The reactor owning `stripe` among `reactors`.
///
/// # Panics
/// If `reactors` is 0.
pub fn owner(stripe: u64, reactors: usize) -> usize {
    assert!(reactors > 0, "at least one reactor");
    // Power-of-two counts (1, 2, 4, …) take a mask, not a division: this runs for every
    // request.
    if reactors.is_power_of_two() {
        (stripe & (reactors as u64 - 1)) as usize
    } else {
        (stripe % reactors as u64) as usize
    }
}

/// One piece of a split request: the reactor that owns it and the request it gets.
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    /// Owning reactor.
    pub owner: usize,
    /// The piece (same tag and op as the parent; a sub-range of its buffer).
    pub request: ArrayRequest,
}

/// Splits `r` (a read, write, write-zeroes or discard, already validated against `geo`) into pieces at stripe
/// boundaries; consecutive stripes with the same owner stay in one piece (with one reactor
/// the request stays whole). Allocation-free iterator.
pub fn split(r: ArrayRequest, geo: &ArrayGeometry, reactors: usize) -> impl Iterator<Item = Piece> {
    let geo = *geo;
    let stripe_bytes = geo.geometry().stripe_data_bytes();
    let end = r.offset_bytes + u64::from(r.len_bytes);
    let mut pos = r.offset_bytes;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let (first, within) = geo.stripe_of(pos);
        let who = owner(first, reactors);
        let mut stop = (pos - within + stripe_bytes).min(end);
        let mut next = first + 1;
        while stop < end && owner(next, reactors) == who {
            stop = (stop + stripe_bytes).min(end);
            next += 1;
        }
        let piece = piece_of(&r, who, pos, stop);
        pos = stop;
        Some(piece)
    })
}

/// What [`split`] yields for `r` when it lies inside one stripe (most small requests): its
/// one piece, computed without the iterator; `None` when `r` spans stripes (then use
/// [`split`]). `r` must be validated against `geo` (non-empty, inside the array), as for
/// [`split`].
#[inline]
pub fn one_piece(r: ArrayRequest, geo: &ArrayGeometry, reactors: usize) -> Option<Piece> {
    geo.single_stripe(r.offset_bytes, r.len_bytes)
        .map(|stripe| {
            piece_of(
                &r,
                owner(stripe, reactors),
                r.offset_bytes,
                r.offset_bytes + u64::from(r.len_bytes),
            )
        })
}

/// The piece of `r` over array bytes `pos..stop` (inside `r`'s range), for `who`.
#[inline]
fn piece_of(r: &ArrayRequest, who: usize, pos: u64, stop: u64) -> Piece {
    debug_assert!(r.offset_bytes <= pos && pos < stop);
    debug_assert!(stop <= r.offset_bytes + u64::from(r.len_bytes));
    let at = (pos - r.offset_bytes) as usize;
    let len = (stop - pos) as u32;
    let buf = if matches!(r.op, ArrayOp::CompareAndWrite { .. }) {
        // Lies inside one stripe (validated), so this is the only piece: it carries
        // the whole buffer, verify data and write data.
        r.buf
    } else if r.op.has_buffer() {
        // SAFETY: the piece is a sub-range (at..at+len) of the parent's lent buffer; the
        // pieces of one request are disjoint, and the parent completes only after every
        // piece has, so the caller's promise (valid and untouched until completion)
        // covers each.
        unsafe {
            IoBuf::from_raw(
                NonNull::new(r.buf.as_ptr().wrapping_add(at)).expect("non-null"),
                len,
                r.buf.region(),
            )
        }
    } else {
        // Write-zeroes and discard carry no buffer; the range is the request's.
        IoBuf::NONE
    };
    Piece {
        owner: who,
        request: ArrayRequest {
            tag: r.tag,
            op: r.op,
            offset_bytes: pos,
            len_bytes: len,
            buf,
        },
    }
}

/// Lets a reactor serve a read of a stripe another reactor owns by itself (a *foreign
/// read*), without a hop to the owner — DESIGN.md "The data path": non-degraded reads with
/// no write in flight on their stripe need no hop — while the owner's writes stay ordered
/// against it.
///
/// A fixed table of slots, one 32-bit word each, stripes hashed onto slots: the low 16
/// bits count foreign reads in flight, the high 16 bits the owners' writes that hold the
/// stripe. Both sides announce themselves with one read-modify-write on the same word, so
/// the two are totally ordered (the atomic's modification order; no fences needed): a
/// foreign read that finds a writer backs off at once and goes to the owner instead
/// ([`StripeGate::try_read`]); a write that finds readers issues no member write until
/// they have finished ([`StripeGate::begin_write`], [`StripeGate::readers_clear`]), and
/// new readers meanwhile go to the owner, where they queue behind the write (per-stripe
/// FIFO), so a stream of reads cannot starve it. A foreign read never waits for anything
/// but its own device I/O, so there is no cycle of waits between reactors. Two stripes on
/// one slot only cost a false conflict (a read that hops, a write that waits for an
/// unrelated read); consecutive stripes land on different cache lines.
///
/// Member failures: reactors learn of a failure another reactor saw by message, so a
/// reader's view of the members may lag the owner's, and after a failure the owner's
/// degraded writes leave the failed member's chunks stale. Every shard therefore also
/// records the members it failed here ([`StripeGate::note_failed`]) before it issues any
/// write without them; a foreign read that finds a member failed here that it still
/// thinks online goes to the owner ([`StripeGate::lagging`]). The owner's flag store
/// happens before its next `begin_write`, and a reader that passes `try_read` after that
/// write's `end_write` sees the flag (release/acquire through the slot word).
///
/// Cost on the hot path: one uncontended atomic add at the start and one at the end of a
/// foreign read plus one load per 64 members (the failure bits); one add of each per owner
/// write (only with more than one reactor). The slots sit in groups of
/// [`SLOTS_PER_LINE`], each group alone in a 128-byte block ([`GateLine`]: the pair of
/// lines an x86 spatial prefetcher fetches together), and a group holds stripes of one
/// owner alone (see `slot`): stripes of different owners never share a block, so on two
/// reactors one reactor's foreign reads never touch a line the other's do. (Readers of one
/// owner's stripes on more reactors, and the owner's own writes, do share its blocks.)
/// Unaligned (a plain `Box<[AtomicU32]>`, 16-byte aligned by the allocator), each group
/// straddled two lines shared with its neighbours, another owner's.
pub struct StripeGate {
    /// `lines` groups of [`SLOTS_PER_LINE`] slots.
    slots: Box<[GateLine]>,
    /// Groups in `slots` (a power of two).
    lines: u64,
    /// Bit `m % 64` of word `m / 64`: some shard failed member `m` (cleared when the slot
    /// gets a new device). One word covers arrays of up to 64 members, so a foreign read's
    /// check ([`StripeGate::lagging`]) is one load while no member is failed.
    /// (Padded: read on every foreign read, so never beside data written often.)
    failed: Box<[CachePadded<AtomicU64>]>,
    /// Members of the array (bits past it are never set).
    members: u16,
}

/// One group of a [`StripeGate`]'s slots, alone in a 128-byte block on every target (not
/// `CachePadded`, whose alignment varies by architecture).
#[repr(align(128))]
struct GateLine([AtomicU32; SLOTS_PER_LINE as usize]);

/// One writer in a slot word.
const GATE_WRITER: u32 = 1 << 16;
/// Readers (or writers) one slot can count: 16 bits each.
const GATE_MAX: u32 = (1 << 16) - 1;
/// 32-bit slots in one group, a 64-byte cache line's worth.
const SLOTS_PER_LINE: u64 = 16;

impl StripeGate {
    /// A gate for reactors that have at most `ops_in_flight` stripe operations and
    /// fast-path reads in flight in all (the bound on any slot's count; a shard holds the
    /// gate for at most as many fast-path reads as it has stripe operations), with `slots` slots (rounded up to a power
    /// of two, at least 1024: a few KiB, so false conflicts stay rare).
    ///
    /// # Panics
    /// If `ops_in_flight` does not fit a slot's 16-bit count (a configuration far beyond
    /// any pool size the target uses: 65 535 operations).
    pub fn new(slots: usize, ops_in_flight: usize, members: u16) -> Arc<Self> {
        assert!(
            ops_in_flight <= GATE_MAX as usize,
            "{ops_in_flight} stripe operations exceed the gate's 16-bit counts"
        );
        let n = slots.max(1024).next_power_of_two();
        let lines = n as u64 / SLOTS_PER_LINE;
        assert!(lines.is_power_of_two());
        Arc::new(Self {
            slots: (0..lines)
                .map(|_| GateLine(std::array::from_fn(|_| AtomicU32::new(0))))
                .collect(),
            lines,
            failed: (0..usize::from(members).div_ceil(64))
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
            members,
        })
    }

    /// A shard failed `member` (before it writes any stripe without it).
    pub fn note_failed(&self, member: u16) {
        if member < self.members {
            self.failed[usize::from(member) / 64].fetch_or(1 << (member % 64), Ordering::Release);
        }
    }

    /// `member`'s slot has a new device (being rebuilt: foreign reads go to the owner
    /// until it is online everywhere).
    pub fn note_replaced(&self, member: u16) {
        if member < self.members {
            self.failed[usize::from(member) / 64]
                .fetch_and(!(1 << (member % 64)), Ordering::Release);
        }
    }

    /// Whether some shard failed a member that `failed_here(member)` says this shard has
    /// not: its view lags, and a foreign read must go to the owner. Call after a
    /// successful [`StripeGate::try_read`].
    pub fn lagging(&self, mut failed_here: impl FnMut(u16) -> bool) -> bool {
        for (i, w) in self.failed.iter().enumerate() {
            let mut bits = w.load(Ordering::Acquire);
            while bits != 0 {
                let m = (i * 64) as u16 + bits.trailing_zeros() as u16;
                if !failed_here(m) {
                    return true;
                }
                bits &= bits - 1;
            }
        }
        false
    }

    /// The slot of `stripe`: group `stripe mod lines`, so consecutive stripes (which
    /// alternate owners) are in different groups, and with a power-of-two count of
    /// reactors up to `lines` every stripe of one group has one owner ([`owner`]: `stripe
    /// mod reactors`, which divides `lines`): stripes of different owners never share a
    /// block.
    fn slot(&self, stripe: u64) -> &AtomicU32 {
        // `lines` is a power of two (asserted at construction): masks and shifts.
        let line = stripe & (self.lines - 1);
        let within = (stripe >> self.lines.trailing_zeros()) % SLOTS_PER_LINE;
        &self.slots[line as usize].0[within as usize]
    }

    /// A foreign read of `stripe` starts: `true` when no write holds it (the read is then
    /// counted until [`StripeGate::end_read`]); `false` when one does (nothing counted:
    /// send the read to the owner).
    pub fn try_read(&self, stripe: u64) -> bool {
        let slot = self.slot(stripe);
        let prev = slot.fetch_add(1, Ordering::AcqRel);
        debug_assert!(prev & GATE_MAX < GATE_MAX, "gate reader count overflow");
        if prev >= GATE_WRITER {
            slot.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// A foreign read counted by [`StripeGate::try_read`] has finished with the members.
    pub fn end_read(&self, stripe: u64) {
        let prev = self.slot(stripe).fetch_sub(1, Ordering::Release);
        debug_assert!(prev & GATE_MAX > 0, "gate reader count underflow");
    }

    /// The owner's write takes `stripe` (counted until [`StripeGate::end_write`]); returns
    /// whether no foreign read is in flight on it (else wait for
    /// [`StripeGate::readers_clear`] before writing any member).
    pub fn begin_write(&self, stripe: u64) -> bool {
        let prev = self.slot(stripe).fetch_add(GATE_WRITER, Ordering::AcqRel);
        debug_assert!(prev >> 16 < GATE_MAX, "gate writer count overflow");
        prev & GATE_MAX == 0
    }

    /// Whether the foreign reads in flight on `stripe` (when its write began) have all
    /// finished (no new ones start while the write holds the stripe).
    pub fn readers_clear(&self, stripe: u64) -> bool {
        self.slot(stripe).load(Ordering::Acquire) & GATE_MAX == 0
    }

    /// The owner's write counted by [`StripeGate::begin_write`] has finished.
    pub fn end_write(&self, stripe: u64) {
        let prev = self.slot(stripe).fetch_sub(GATE_WRITER, Ordering::Release);
        debug_assert!(prev >= GATE_WRITER, "gate writer count underflow");
    }
}

struct Parent {
    tag: u64,
    remaining: u32,
    error: Option<ArrayError>,
}

/// Several shards ([`Array`]s, one per "reactor", each over its own channels to the same
/// members) driven from one thread. Same request interface as [`Array`].
///
/// As on the threaded reactors, a read piece is served by the shard that "received" the
/// request — here the shard `parent slot mod shards`, so reads spread over every shard
/// whatever their stripe — through the shards' shared [`StripeGate`] (foreign reads), and
/// goes to its owner when the gate says so; writes always go to the owner.
pub struct ShardedArray<C: Channel> {
    shards: Vec<Array<C>>,
    parents: Vec<Option<Parent>>,
    free: Vec<u32>,
    /// Pieces a shard refused with QueueFull, resubmitted in order (per shard).
    overflow: Vec<VecDeque<ArrayRequest>>,
    done: VecDeque<ArrayCompletion>,
    scratch: Vec<ArrayCompletion>,
    /// Member failures each shard has reported so far (to spread a failure to all).
    failures_seen: Vec<u64>,
    /// A member was replaced: start a rebuild at the next turn (so members replaced
    /// together are rebuilt together).
    rebuild_pending: bool,
    /// Reads are served by the receiving shard (foreign reads); with more than one shard.
    foreign_reads: bool,
    /// Replacement failures each shard has reported so far (to spread one to all).
    repl_failures_seen: Vec<u64>,
    /// Serial of the last replacement started.
    repl_serial: u64,
}

impl<C: Channel> ShardedArray<C> {
    /// Composes `shards` (stripe `s` goes to shard `s mod shards.len()`), accepting up to
    /// `requests` requests in flight.
    ///
    /// # Panics
    /// If `shards` is empty or the shards' geometries differ (programmer errors).
    pub fn new(mut shards: Vec<Array<C>>, requests: usize) -> Self {
        assert!(!shards.is_empty(), "at least one shard");
        assert!(
            shards.iter().all(|s| s.geometry() == shards[0].geometry()),
            "shards must share one geometry"
        );
        let n = shards.len();
        let gate = (n > 1).then(|| {
            // Each shard counts at most its stripe operations and as many fast-path reads.
            let ops: usize = shards.iter().map(Array::stripe_op_capacity).sum();
            StripeGate::new(4096, 2 * ops, shards[0].geometry().geometry().members())
        });
        for (i, s) in shards.iter_mut().enumerate() {
            s.set_shard(i, n);
            s.set_gate(gate.clone());
        }
        // Members assembled as being rebuilt resume at once.
        let rebuild_pending = shards[0].pending_rebuild().is_some();
        Self {
            failures_seen: shards.iter().map(|s| s.stats().member_failures).collect(),
            repl_failures_seen: vec![0; n],
            repl_serial: 0,
            rebuild_pending,
            foreign_reads: n > 1,
            shards,
            parents: (0..requests).map(|_| None).collect(),
            free: (0..requests as u32).rev().collect(),
            overflow: (0..n).map(|_| VecDeque::with_capacity(requests)).collect(),
            done: VecDeque::with_capacity(requests),
            scratch: vec![
                ArrayCompletion {
                    tag: 0,
                    status: Ok(())
                };
                64
            ],
        }
    }

    /// The shards.
    pub fn shards(&self) -> &[Array<C>] {
        &self.shards
    }

    /// Turns foreign reads off (every piece goes to its stripe's owner) or back on (with
    /// more than one shard).
    pub fn set_foreign_reads(&mut self, on: bool) {
        self.foreign_reads = on && self.shards.len() > 1;
    }

    /// The shards, mutably (to set pacers).
    pub fn shards_mut(&mut self) -> &mut [Array<C>] {
        &mut self.shards
    }

    /// Member states merged over the shards: failed if any shard failed it, else being
    /// rebuilt if any shard still rebuilds it, else online.
    pub fn member_states(&self) -> Vec<MemberState> {
        let mut out: Vec<MemberState> = self.shards[0].member_states().collect();
        for sh in &self.shards[1..] {
            for (o, st) in out.iter_mut().zip(sh.member_states()) {
                *o = merge_state(*o, st);
            }
        }
        out
    }

    /// Fails `member` on every shard (as if it returned `err`).
    ///
    /// # Panics
    /// If `member` is not a member index.
    pub fn fail_member(&mut self, member: u16, err: IoError) {
        for s in &mut self.shards {
            s.fail_member(member, err);
        }
    }

    /// Starts a process on every shard ([`Array::start_process`]); nothing starts unless
    /// every shard accepts.
    ///
    /// # Errors
    /// The first shard's refusal.
    pub fn start_process(&mut self, req: &ProcessRequest) -> Result<(), ProcessError> {
        for s in &self.shards {
            s.check_process(req)?;
        }
        for s in &mut self.shards {
            // Checked above on every shard, with nothing in between.
            s.start_process(req)?;
        }
        Ok(())
    }

    /// Stops the running process on every shard ([`Array::stop_process`]); returns whether
    /// one was running.
    pub fn stop_process(&mut self) -> bool {
        let mut any = false;
        for s in &mut self.shards {
            any |= s.stop_process();
        }
        any
    }

    /// The last process's progress merged over the shards, if one was started.
    pub fn process_snapshot(&self) -> Option<ProcessSnapshot> {
        let shards: Vec<ShardProgress> = self
            .shards
            .iter()
            .filter_map(Array::process_progress)
            .collect();
        if shards.len() != self.shards.len() {
            return None;
        }
        ProcessSnapshot::merge(&shards, self.geometry())
    }

    /// Whether a process runs or background operations are in flight on any shard (or a
    /// finished replace waits for its completion on every shard).
    pub fn process_active(&self) -> bool {
        self.rebuild_pending
            || self.shards.iter().any(|s| {
                s.background_busy()
                    || s.process_progress()
                        .is_some_and(|p| p.state == ProcessState::Running)
                    || s.replace_finished(self.repl_serial)
            })
    }

    /// Gives member `slot` a replacement device on every shard (`channels`: one per shard,
    /// in shard order) and starts the replace ([`Array::start_replace`]) from
    /// `resume_stripe`. It completes by itself once every shard has finished (the
    /// replacement takes the slot); a replacement failure on one shard is spread to all.
    ///
    /// # Errors
    /// See [`Array::start_replace`]; [`ProcessError::Unfit`] for a channel count that
    /// differs from the shard count. Nothing changes unless every shard accepts.
    pub fn start_replace(
        &mut self,
        slot: u16,
        channels: Vec<C>,
        resume_stripe: u64,
    ) -> Result<(), ProcessError> {
        if channels.len() != self.shards.len() {
            return Err(ProcessError::Unfit {
                member: slot,
                why: "one channel per shard is needed",
            });
        }
        for (sh, ch) in self.shards.iter().zip(&channels) {
            sh.check_start_replace(slot, ch.info())?;
        }
        self.repl_serial += 1;
        for (sh, ch) in self.shards.iter_mut().zip(channels) {
            // Checked above on every shard, with nothing in between.
            sh.start_replace(slot, ch, self.repl_serial, resume_stripe)?;
        }
        Ok(())
    }

    /// Fails the live replacement on every shard (as if it returned `err`): the replace
    /// stops, the member keeps its slot. Returns whether one was live.
    pub fn fail_replacement(&mut self, err: IoError) -> bool {
        let mut any = false;
        for s in &mut self.shards {
            any |= s.fail_replacement(self.repl_serial, err);
        }
        any
    }

    /// The last replacement merged over the shards: failed if any shard failed it, done
    /// when every shard completed it, else copying.
    pub fn replacement(&self) -> Option<ReplaceInfo> {
        let mut out = self.shards[0].replacement()?;
        for s in &self.shards[1..] {
            let r = s.replacement()?;
            out.state = match (out.state, r.state) {
                (ReplaceState::Failed(e), _) | (_, ReplaceState::Failed(e)) => {
                    ReplaceState::Failed(e)
                }
                (ReplaceState::Done, ReplaceState::Done) => ReplaceState::Done,
                _ => ReplaceState::Copying,
            };
        }
        Some(out)
    }

    /// Puts the device that left member `slot` back into it on every shard (md's re-add,
    /// [`Array::readd_member`]): only the bitmap's dirty regions are rebuilt. Scheduled
    /// like [`Self::replace_member`].
    ///
    /// # Errors
    /// As [`Self::replace_member`].
    pub fn readd_member(&mut self, slot: u16, channels: Vec<C>) -> Result<(), ProcessError> {
        self.fill_slot(slot, channels, |sh, ch| sh.readd_member(slot, ch).map(drop))
    }

    /// Puts a new device into failed member `slot`'s place on every shard (`channels`: one
    /// channel to the new device per shard, in shard order) and schedules a rebuild: it
    /// starts at the next [`Self::process`] if no process runs (members replaced before
    /// then are rebuilt together), else when the running rebuild has finished on every
    /// shard (md's rule: a spare added during a recovery waits for it).
    ///
    /// # Errors
    /// See [`Array::replace_member`]; also [`ProcessError::Unfit`] for a channel count that
    /// differs from the shard count. Nothing changes unless every shard accepts.
    pub fn replace_member(&mut self, slot: u16, channels: Vec<C>) -> Result<(), ProcessError> {
        self.fill_slot(slot, channels, |sh, ch| {
            sh.replace_member(slot, ch).map(drop)
        })
    }

    /// Puts a device into failed member `slot` on every shard with `put` (one channel per
    /// shard, in shard order) once every shard accepts it ([`Array::check_replace`]), and
    /// schedules the rebuild. Nothing changes unless every shard accepts.
    fn fill_slot(
        &mut self,
        slot: u16,
        channels: Vec<C>,
        put: impl Fn(&mut Array<C>, C) -> Result<(), ProcessError>,
    ) -> Result<(), ProcessError> {
        if channels.len() != self.shards.len() {
            return Err(ProcessError::Unfit {
                member: slot,
                why: "one channel per shard is needed",
            });
        }
        for (sh, ch) in self.shards.iter().zip(&channels) {
            sh.check_replace(slot, ch.info())?;
        }
        for (sh, ch) in self.shards.iter_mut().zip(channels) {
            // Checked above on every shard, with nothing in between.
            put(sh, ch)?;
        }
        self.rebuild_pending = true;
        Ok(())
    }

    /// Runs the cross-shard upkeep: spreads member failures to every shard, completes a
    /// rebuild finished on every shard, starts pending rebuilds.
    fn coordinate(&mut self) -> bool {
        let mut any = false;
        // A member one shard failed is failed on all (as the reactors announce it).
        for i in 0..self.shards.len() {
            let f = self.shards[i].stats().member_failures;
            if f != self.failures_seen[i] {
                self.failures_seen[i] = f;
                let states: Vec<MemberState> = self.shards[i].member_states().collect();
                for (m, st) in states.into_iter().enumerate() {
                    if let MemberState::Failed(e) = st {
                        for s in &mut self.shards {
                            s.fail_member(m as u16, e);
                        }
                    } else if st == MemberState::FailedByOperator {
                        for s in &mut self.shards {
                            s.fail_member_by_operator(m as u16);
                        }
                    }
                }
                any = true;
            }
        }
        // A replacement one shard saw fail is failed on all.
        for i in 0..self.shards.len() {
            let f = self.shards[i].replacement_failures();
            if f != self.repl_failures_seen[i] {
                self.repl_failures_seen[i] = f;
                if let Some(ReplaceInfo {
                    state: ReplaceState::Failed(e),
                    serial,
                    ..
                }) = self.shards[i].replacement()
                {
                    for s in &mut self.shards {
                        s.fail_replacement(serial, e);
                    }
                }
                any = true;
            }
        }
        // A replace finished on every shard: the replacement takes the slot on all.
        let serial = self.repl_serial;
        if serial > 0 && self.shards.iter().all(|s| s.replace_finished(serial)) {
            for s in &mut self.shards {
                s.complete_replace(serial);
            }
            any = true;
            // A member replaced (rebuilt) meanwhile is rebuilt next (allocation-free).
            self.rebuild_pending |= self
                .shards
                .iter()
                .any(|s| s.member_states().any(|m| m == MemberState::Rebuilding));
        }
        // Members every shard has rebuilt go online on all, as the reactors do (a RAID6
        // rebuild's targets, before its verification walk ends). Allocation-free but when
        // a member goes online (`member_states` then).
        if let Some(first) = self.shards.first() {
            for m in first.rebuilt_members() {
                if self.shards.iter().all(|s| s.rebuilt_members().contains(&m)) {
                    for s in &mut self.shards {
                        s.set_member_online(m);
                    }
                    any = true;
                    // Members replaced during that rebuild are rebuilt next.
                    self.rebuild_pending |= self.member_states().contains(&MemberState::Rebuilding);
                }
            }
        }
        // Allocation-free: this runs every turn.
        let rebuild_done = self.shards.iter().all(|s| {
            s.process_progress().is_some_and(|p| {
                p.kind == ProcessKind::Rebuild
                    && p.state == ProcessState::Finished
                    && p.targets.iter().any(|&t| {
                        s.member_states().nth(usize::from(t)) == Some(MemberState::Rebuilding)
                    })
            })
        });
        if rebuild_done {
            for s in &mut self.shards {
                s.complete_rebuild();
            }
            any = true;
            // Members replaced during that rebuild are rebuilt next.
            self.rebuild_pending |= self.member_states().contains(&MemberState::Rebuilding);
        }
        if self.rebuild_pending && !self.process_running() {
            self.rebuild_pending = false;
            // Every shard resumes from the lowest recovery position of any, over the same
            // ranges (a re-add's: the shared bitmap's dirty regions).
            let pending: Vec<ProcessRequest> = self
                .shards
                .iter()
                .filter_map(|s| s.pending_rebuild())
                .collect();
            if let Some(first) = pending.first() {
                let req = ProcessRequest {
                    kind: ProcessKind::Rebuild,
                    ranges: if pending.iter().all(|r| r.ranges.is_some()) {
                        first.ranges.clone()
                    } else {
                        None
                    },
                    resume_stripe: pending.iter().map(|r| r.resume_stripe).min().unwrap_or(0),
                };
                // Refused on a failed array (then nothing can be rebuilt), or while a
                // replace runs: retried when it is over.
                if let Err(ProcessError::Busy { .. }) = self.start_process(&req) {
                    self.rebuild_pending = true;
                }
            }
            any = true;
        }
        any
    }

    fn process_running(&self) -> bool {
        self.shards.iter().any(|s| {
            s.background_busy()
                || s.process_progress()
                    .is_some_and(|p| p.state == ProcessState::Running)
        })
    }

    /// The array geometry.
    pub fn geometry(&self) -> &ArrayGeometry {
        self.shards[0].geometry()
    }

    /// Accepts a request; see [`Array::submit`].
    ///
    /// # Errors
    /// [`ArrayError::QueueFull`] when `requests` are already in flight.
    pub fn submit(&mut self, r: ArrayRequest) -> Result<(), ArrayError> {
        let Some(p) = self.free.pop() else {
            return Err(ArrayError::QueueFull);
        };
        let n = self.shards.len();
        let mut parent = Parent {
            tag: r.tag,
            remaining: 0,
            error: None,
        };
        let tagged = ArrayRequest {
            tag: u64::from(p),
            ..r
        };
        match r.op {
            ArrayOp::Flush => {
                // Every shard flushes its channels: a flush covers every completed write,
                // whichever shard carried it.
                for s in 0..n {
                    self.push(s, tagged);
                    parent.remaining += 1;
                }
            }
            _ => match self.shards[0].validate(&r) {
                Err(e) => parent.error = Some(e),
                Ok(()) => {
                    let here = self.foreign_reads && r.op.is_read();
                    let to = |piece: &Piece| {
                        if here {
                            p as usize % n
                        } else {
                            piece.owner
                        }
                    };
                    if let Some(piece) = one_piece(tagged, self.shards[0].geometry(), n) {
                        self.push(to(&piece), piece.request);
                        parent.remaining = 1;
                    } else {
                        for piece in split(tagged, self.shards[0].geometry(), n) {
                            self.push(to(&piece), piece.request);
                            parent.remaining += 1;
                        }
                    }
                }
            },
        }
        let done = parent.remaining == 0;
        self.parents[p as usize] = Some(parent);
        if done {
            self.finish(p);
        }
        Ok(())
    }

    fn push(&mut self, shard: usize, r: ArrayRequest) {
        if self.overflow[shard].is_empty() && self.shards[shard].submit(r).is_ok() {
            return;
        }
        self.overflow[shard].push_back(r);
    }

    fn finish(&mut self, p: u32) {
        let parent = self.parents[p as usize].take().expect("live parent");
        self.done.push_back(ArrayCompletion {
            tag: parent.tag,
            status: parent.error.map_or(Ok(()), Err),
        });
        self.free.push(p);
    }

    /// Sets every shard's clock, ns (see [`Array::set_now`]).
    pub fn set_now(&mut self, now_ns: u64) {
        for s in &mut self.shards {
            s.set_now(now_ns);
        }
    }

    /// The earliest command-timeout deadline of any shard (see [`Array::next_deadline_ns`]).
    pub fn next_deadline_ns(&self) -> Option<u64> {
        self.shards.iter().filter_map(Array::next_deadline_ns).min()
    }

    /// Runs every shard once, then the cross-shard upkeep (member failures spread to every
    /// shard, rebuild completion and start); returns whether anything happened.
    pub fn process(&mut self) -> bool {
        let mut any = self.coordinate();
        let n = self.shards.len();
        for s in 0..n {
            while let Some(r) = self.overflow[s].pop_front() {
                if self.shards[s].submit(r).is_err() {
                    self.overflow[s].push_front(r);
                    break;
                }
                any = true;
            }
            any |= self.shards[s].process();
            while let Some(r) = self.shards[s].take_moved() {
                let (stripe, _) = self.shards[s].geometry().stripe_of(r.offset_bytes);
                self.push(owner(stripe, n), r);
                any = true;
            }
            loop {
                let k = self.shards[s].poll(&mut self.scratch);
                for i in 0..k {
                    let c = self.scratch[i];
                    let parent = self.parents[c.tag as usize].as_mut().expect("live parent");
                    if let Err(e) = c.status {
                        parent.error.get_or_insert(e);
                    }
                    parent.remaining -= 1;
                    if parent.remaining == 0 {
                        self.finish(c.tag as u32);
                    }
                }
                any |= k > 0;
                if k < self.scratch.len() {
                    break;
                }
            }
        }
        any |= self.coordinate();
        any
    }

    /// Moves finished requests into `out`; returns how many.
    pub fn poll(&mut self, out: &mut [ArrayCompletion]) -> usize {
        let n = self.done.len().min(out.len());
        for (o, c) in out.iter_mut().zip(self.done.drain(..n)) {
            *o = c;
        }
        n
    }
}

/// Merges one member's state over shards: failed wins, then being rebuilt, then online.
pub fn merge_state(a: MemberState, b: MemberState) -> MemberState {
    let rank = |s: MemberState| match s {
        MemberState::Online => 0,
        MemberState::Rebuilding => 1,
        MemberState::Failed(_) | MemberState::FailedByOperator => 2,
    };
    if rank(b) > rank(a) {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Geometry, Layout, Level};

    #[test]
    fn the_gate_orders_foreign_reads_and_owner_writes() {
        let g = StripeGate::new(0, 64, 5);
        // Readers first: the write is told to wait until they are gone.
        assert!(g.try_read(7) && g.try_read(7));
        assert!(!g.begin_write(7));
        // While the write holds the stripe, new readers go to the owner.
        assert!(!g.try_read(7));
        assert!(!g.readers_clear(7));
        g.end_read(7);
        assert!(!g.readers_clear(7));
        g.end_read(7);
        assert!(g.readers_clear(7));
        // Other stripes are unaffected, including the neighbours on other cache lines.
        assert!(g.try_read(8) && g.try_read(6));
        g.end_read(8);
        g.end_read(6);
        // Two writes hold the stripe until both end.
        assert!(g.begin_write(7));
        g.end_write(7);
        assert!(!g.try_read(7));
        g.end_write(7);
        assert!(g.try_read(7));
        g.end_read(7);
        // Every slot is used.
        let slots: std::collections::HashSet<usize> = (0..1024u64)
            .map(|s| g.slot(s) as *const AtomicU32 as usize)
            .collect();
        assert_eq!(slots.len(), 1024);
    }

    /// Two reactors' foreign reads (each of the stripes the other owns) never touch one
    /// cache line, nor the pair of lines an x86 spatial prefetcher fetches together: the
    /// slots of stripes with different owners lie in different 128-byte blocks, at 2, 4
    /// and 8 reactors, whatever the table's size.
    #[test]
    fn stripes_of_different_owners_never_share_a_cache_line() {
        for slots in [0, 4096] {
            let g = StripeGate::new(slots, 64, 5);
            for reactors in [2usize, 4, 8] {
                let mut owner_of_block = std::collections::HashMap::new();
                for s in 0..4 * g.lines * SLOTS_PER_LINE {
                    let block = g.slot(s) as *const AtomicU32 as usize / 128;
                    let o = *owner_of_block.entry(block).or_insert(owner(s, reactors));
                    assert_eq!(o, owner(s, reactors), "stripe {s}, {reactors} reactors");
                }
            }
        }
    }

    #[test]
    fn a_reader_that_missed_a_failure_is_lagging() {
        let g = StripeGate::new(0, 64, 5);
        assert!(!g.lagging(|_| false));
        g.note_failed(3);
        assert!(g.lagging(|_| false));
        assert!(!g.lagging(|m| m == 3));
        g.note_replaced(3);
        assert!(!g.lagging(|_| false));
    }

    #[test]
    fn lagging_covers_members_past_the_first_word() {
        // RAID6 over 257 members (255 data chunks): five words of failure bits.
        let g = StripeGate::new(0, 64, 257);
        g.note_failed(256);
        g.note_failed(64);
        assert!(g.lagging(|m| m == 64), "member 256 missed");
        assert!(g.lagging(|m| m == 256), "member 64 missed");
        assert!(!g.lagging(|m| m == 64 || m == 256));
        g.note_replaced(64);
        assert!(!g.lagging(|m| m == 256));
        // Out of range: ignored, as before.
        g.note_failed(300);
        assert!(!g.lagging(|m| m == 256));
    }

    /// RAID5 over four members, 4 KiB chunks, ten stripes; and its stripe's data bytes.
    fn ten_stripes() -> (ArrayGeometry, u64) {
        let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, 4096, 512).unwrap();
        (ArrayGeometry::new(g, 10).unwrap(), g.stripe_data_bytes())
    }

    #[test]
    fn one_piece_is_what_split_yields_for_a_request_inside_one_stripe() {
        let (geo, stripe) = ten_stripes();
        let mut buf = vec![0u8; 2 * stripe as usize];
        for (op, len) in [
            (ArrayOp::Read, 4096),
            (ArrayOp::Write { fua: false }, 8192),
            (ArrayOp::WriteZeroes { fua: true }, 512),
            (ArrayOp::Discard, stripe as u32),
        ] {
            for offset in [0, stripe - u64::from(len), 3 * stripe + 512, 9 * stripe] {
                // SAFETY: never submitted; only split.
                let io = unsafe { IoBuf::from_slice(&mut buf[..len as usize]) };
                let r = ArrayRequest {
                    tag: 7,
                    op,
                    offset_bytes: offset,
                    len_bytes: len,
                    buf: if op.has_buffer() { io } else { IoBuf::NONE },
                };
                for reactors in [1, 2, 3] {
                    let all: Vec<Piece> = split(r, &geo, reactors).collect();
                    let one = one_piece(r, &geo, reactors);
                    let fits = offset % stripe + u64::from(len) <= stripe;
                    assert_eq!(one.is_some(), fits, "{op:?} at {offset}");
                    if let Some(p) = one {
                        assert_eq!(all.len(), 1);
                        assert_eq!(p.owner, all[0].owner);
                        let (a, b) = (p.request, all[0].request);
                        assert_eq!(
                            (
                                a.tag,
                                a.offset_bytes,
                                a.len_bytes,
                                a.buf.as_ptr(),
                                a.buf.len()
                            ),
                            (
                                b.tag,
                                b.offset_bytes,
                                b.len_bytes,
                                b.buf.as_ptr(),
                                b.buf.len()
                            )
                        );
                    }
                }
            }
        }
        // Across a stripe boundary: no one piece.
        let r = ArrayRequest {
            tag: 7,
            op: ArrayOp::Read,
            offset_bytes: stripe - 512,
            len_bytes: 1024,
            // SAFETY: never submitted; only split.
            buf: unsafe { IoBuf::from_slice(&mut buf[..1024]) },
        };
        assert!(one_piece(r, &geo, 2).is_none());
        assert_eq!(split(r, &geo, 2).count(), 2);
    }

    #[test]
    fn pieces_follow_stripe_owners() {
        let (geo, stripe) = ten_stripes();
        let mut buf = vec![0u8; 3 * stripe as usize];
        // SAFETY: never submitted; only split.
        let io = unsafe { IoBuf::from_slice(&mut buf) };
        let r = ArrayRequest {
            tag: 5,
            op: ArrayOp::Read,
            offset_bytes: stripe / 2,
            len_bytes: io.len(),
            buf: io,
        };
        let two: Vec<Piece> = split(r, &geo, 2).collect();
        assert_eq!(
            two.iter().map(|p| p.owner).collect::<Vec<_>>(),
            [0, 1, 0, 1]
        );
        assert_eq!(
            two.iter()
                .map(|p| u64::from(p.request.len_bytes))
                .sum::<u64>(),
            3 * stripe
        );
        assert_eq!(
            two[1].request.buf.as_ptr() as usize - buf.as_ptr() as usize,
            (stripe / 2) as usize
        );
        let one: Vec<Piece> = split(r, &geo, 1).collect();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].request.len_bytes, r.len_bytes);
    }
}
