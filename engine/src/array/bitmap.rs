//! The write-intent bitmap: attaching it, holding writes until their bits are durable, and
//! writing bitmap sectors.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::bitmap::WriteIntent;
use crate::device::{Channel, IoBuf, IoError, Op, Request};
use crate::qos::IoClass;

use super::{Array, ArrayError, IntentShard, MemberState, Phase};

impl<C: Channel> Array<C> {
    /// Attaches the array's write-intent bitmap (see the module docs): from now on every
    /// write operation waits until its regions' bits are durable. `owner`: this shard
    /// writes the bitmap sectors and runs the clearing daemon (exactly one shard per
    /// array: shard 0). Attach before submitting requests.
    ///
    /// # Panics
    /// If a bitmap is already attached, requests are in flight, or a second owner is
    /// claimed ([`WriteIntent::owner`]) — programmer errors.
    pub fn attach_bitmap(&mut self, intent: Arc<WriteIntent>, owner: bool) {
        assert!(self.intent.is_none(), "a bitmap is already attached");
        assert!(!self.busy(), "attach the bitmap before submitting requests");
        let owner = owner.then(|| intent.owner());
        let units = owner.as_ref().map_or(0, |_| {
            (intent.regions().div_ceil(8) as usize + 256).div_ceil(512) + 1
        });
        self.intent = Some(IntentShard {
            seen: intent.generation(),
            shared: intent,
            owner,
            waiting: VecDeque::with_capacity(self.sops.len()),
            writes: Vec::with_capacity(units),
            outstanding: 0,
            per_member: vec![0; self.slots() + 1],
            issued_ns: 0,
            degraded: false,
            preflush: false,
        });
        self.note_degraded();
        // Members joining (assembled partly rebuilt, or re-added) get the whole bitmap.
        if self.members[..self.slots()]
            .iter()
            .any(|m| m.state == MemberState::Rebuilding)
        {
            self.intent.as_ref().expect("attached").shared.write_all();
        }
    }

    /// The attached write-intent bitmap's shared state.
    pub fn bitmap(&self) -> Option<&Arc<WriteIntent>> {
        self.intent.as_ref().map(|i| &i.shared)
    }

    // ---- write-intent bitmap -------------------------------------------------------------

    /// Counts a write operation in its regions (W1/W2, `crate::bitmap`); returns `true`
    /// when it must wait for its bits (it is then in `BitmapWait`).
    pub(super) fn bitmap_gate(&mut self, s: u32) -> bool {
        let Some(i) = &mut self.intent else {
            return false;
        };
        let sop = &mut self.sops[s as usize];
        let writes = self.reqs.get(sop.req).expect("live request").op.is_write();
        if !writes {
            return false;
        }
        let regions = i.shared.stripe_regions(sop.stripe);
        debug_assert!(sop.regions.is_empty());
        sop.regions = regions.clone();
        if i.shared.begin_write(regions) {
            return false;
        }
        sop.phase = Phase::BitmapWait;
        i.waiting.push_back(s);
        true
    }

    /// The bitmap's turn in the loop: the owner's batch and daemon, then the waiting writes
    /// whose bits became durable.
    pub(super) fn bitmap_work(&mut self) -> bool {
        let mut any = self.bitmap_timeouts();
        let Some(i) = &mut self.intent else {
            return false;
        };
        if let Some(o) = &mut i.owner {
            if !o.busy() {
                o.poll(&i.shared, self.now, &mut i.writes);
                if o.busy() {
                    any = true;
                    if !(o.batch_clears() && self.issue_bitmap_flushes()) {
                        self.issue_bitmap_batch();
                    }
                }
            }
        }
        let Some(i) = &mut self.intent else {
            return any;
        };
        let gen = i.shared.generation();
        if gen == i.seen || i.waiting.is_empty() {
            return any;
        }
        i.seen = gen;
        let mut k = 0;
        loop {
            let i = self.intent.as_ref().expect("the bitmap stays attached");
            let Some(&s) = i.waiting.get(k) else {
                break;
            };
            if i.shared.all_durable(self.sops[s as usize].regions.clone()) {
                self.intent
                    .as_mut()
                    .expect("the bitmap stays attached")
                    .waiting
                    .remove(k);
                self.ready_after_bitmap(s);
                any = true;
            } else {
                k += 1;
            }
        }
        any
    }

    fn ready_after_bitmap(&mut self, s: u32) {
        debug_assert_eq!(self.sops[s as usize].phase, Phase::BitmapWait);
        if self.array_failed() {
            return self.finish_sop(s, Err(ArrayError::Failed));
        }
        self.dispatch_sop(s);
    }

    /// The "operation index" in the tags of the owner shard's bitmap writes: one past the
    /// stripe operations (foreground and background pools), so the member queues account
    /// for them in a slot of their own.
    pub(super) fn bitmap_sop(&self) -> u32 {
        self.sops.len() as u32
    }

    /// Before a batch that clears bits: flushes every online member with a volatile write
    /// cache, so the writes of the regions being cleared (completed before the daemon
    /// pass) are durable before a cleared bit can be (`crate::bitmap` rule 2). Returns
    /// whether any flush was sent (the batch then goes out when they are back).
    fn issue_bitmap_flushes(&mut self) -> bool {
        let mut sent = false;
        for member in 0..self.members.len() as u16 {
            if !self.needs_flush(member) {
                continue;
            }
            let m = &mut self.members[usize::from(member)];
            m.counters.flushes += 1;
            let id = usize::from(m.id);
            let i = self.intent.as_mut().expect("bitmap");
            if i.outstanding == 0 {
                i.issued_ns = self.now;
            }
            i.outstanding += 1;
            i.per_member[id] += 1;
            i.preflush = true;
            sent = true;
            let req = Request {
                tag: self.tag_of(self.bitmap_sop(), member),
                op: Op::Flush,
                offset_bytes: 0,
                len_bytes: 0,
                buf: IoBuf::NONE,
            };
            self.send(member, IoClass::Flush, req);
        }
        sent
    }

    /// Issues the owner's batch on every online member: FUA writes at absolute member
    /// offsets (the bitmap area lies between the superblock and the data).
    fn issue_bitmap_batch(&mut self) {
        let i = self.intent.as_mut().expect("owner has a bitmap");
        let o = i.owner.as_mut().expect("owner");
        let base = o.buffer().as_mut_ptr();
        let nwrites = i.writes.len();
        let mut sent = 0u32;
        for w in 0..nwrites {
            let bw = self.intent.as_ref().expect("bitmap").writes[w];
            for member in 0..self.members.len() as u16 {
                if self.is_failed(member) {
                    continue;
                }
                let max = self.members[usize::from(member)].max_transfer;
                let mut done = 0u32;
                while done < bw.len_bytes {
                    let piece = (bw.len_bytes - done).min(max);
                    // SAFETY: the batch buffer is the owner's snapshot, allocated at attach
                    // and not written again until `batch_done` — after every request of the
                    // batch has completed; `buf_offset + done + piece <= len` of the area
                    // (the owner built the writes inside it).
                    let buf = unsafe {
                        IoBuf::from_raw(
                            std::ptr::NonNull::new(
                                base.wrapping_add(bw.buf_offset + done as usize),
                            )
                            .expect("non-null buffer"),
                            piece,
                            None,
                        )
                    };
                    let req = Request {
                        tag: self.tag_of(self.bitmap_sop(), member),
                        op: Op::Write { fua: true },
                        offset_bytes: bw.offset_bytes + u64::from(done),
                        len_bytes: piece,
                        buf,
                    };
                    done += piece;
                    let m = &mut self.members[usize::from(member)];
                    let id = usize::from(m.id);
                    m.counters.writes += 1;
                    m.counters.write_bytes += u64::from(piece);
                    sent += 1;
                    let i = self.intent.as_mut().expect("bitmap");
                    if i.outstanding == 0 {
                        i.issued_ns = self.now;
                    }
                    i.outstanding += 1;
                    i.per_member[id] += 1;
                    self.send(member, IoClass::Flush, req);
                }
            }
        }
        if sent == 0 {
            // No member online: the array has failed; nothing can be made durable.
            self.finish_bitmap_batch(false);
        }
    }

    pub(super) fn bitmap_write_done(&mut self, member: u16, status: Result<(), IoError>) {
        let Some(i) = &mut self.intent else {
            self.stats.stray_completions += 1;
            return;
        };
        if i.outstanding == 0 || i.owner.is_none() {
            self.stats.stray_completions += 1;
            return;
        }
        i.outstanding -= 1;
        let pm = &mut i.per_member[usize::from(self.members[usize::from(member)].id)];
        debug_assert!(
            *pm > 0,
            "bitmap completion from a member with nothing outstanding"
        );
        *pm = pm.saturating_sub(1);
        let done = i.outstanding == 0;
        if let Err(e) = status {
            self.members[usize::from(member)].counters.errors += 1;
            // md fails a member whose bitmap write fails (md_super_write → md_error).
            self.fail_entry(member, e);
        }
        if done {
            let i = self.intent.as_mut().expect("bitmap");
            if std::mem::take(&mut i.preflush) && !self.array_failed() {
                // The flushes before a clearing batch are back: now its writes.
                self.issue_bitmap_batch();
                return;
            }
            let ok = !self.array_failed();
            self.finish_bitmap_batch(ok);
        }
    }

    /// The owner's bitmap writes are member commands too: one outstanding longer than the
    /// command timeout fails its member (as [`Array::check_timeouts`] does for stripe
    /// operations), is aborted, and the batch completes on the other members.
    fn bitmap_timeouts(&mut self) -> bool {
        let Some(i) = &mut self.intent else {
            return false;
        };
        if self.io_timeout_ns == 0
            || i.outstanding == 0
            || self.now.saturating_sub(i.issued_ns) < self.io_timeout_ns
        {
            return false;
        }
        // Abort again only after another full timeout.
        i.issued_ns = self.now;
        for member in 0..self.members.len() as u16 {
            let id = self.id_of(member);
            if self.intent.as_ref().expect("bitmap").per_member[id] == 0 {
                continue;
            }
            self.time_out(self.bitmap_sop(), member);
        }
        true
    }

    fn finish_bitmap_batch(&mut self, ok: bool) {
        let i = self.intent.as_mut().expect("bitmap");
        let o = i.owner.as_mut().expect("owner");
        o.batch_done(&i.shared, ok);
    }
}
