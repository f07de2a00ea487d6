//! Per-member dispatch: one queue per [`IoClass`] in front of a member's channel, drained
//! in priority order within the depth controller's limits.
//!
//! A [`MemberQueue`] sits between the stripe engine and one member channel of one shard.
//! Every member request enters the queue of its class ([`MemberQueue::enqueue`]);
//! [`MemberQueue::pump`] hands requests to the channel, highest class first
//! ([`IoClass::ALL`]), while the channel has room and the class is within its
//! [`DepthController`] limit. So a foreground read waits inside ferroraid only for a
//! full channel, never behind queued writes or background I/O; write-class requests wait
//! in their queue when the controller holds their depth down, and their place in the
//! device goes to reads.
//!
//! No starvation: a class passed over [`STARVATION_LIMIT`] times while it had a request
//! allowed by its limit gets the next channel slot, and the controller never limits a
//! class to zero, so every class progresses as long as the device completes requests.
//!
//! Latency: each request's time in the device (hand-over to the channel → reaped) is fed
//! to the controller, per class. Requests are matched to completions by their tag's slot
//! (`tag >> slot_shift`): a slot (a stripe operation) has requests of one class at a time
//! on a member (one phase at a time), so one record per slot suffices.
//!
//! Capacity is fixed at construction: the per-class queues hold every request the engine
//! can have outstanding; nothing allocates per I/O.

use std::collections::VecDeque;

use super::depth::{DepthConfig, DepthController, QosState};
use super::IoClass;
use crate::device::{Channel, Request, SubmitError};

/// Dispatches of higher classes a waiting, admissible request tolerates before it gets the
/// next channel slot: bounds the wait of writes and background behind a read storm on a
/// full channel.
pub const STARVATION_LIMIT: u32 = 16;

#[derive(Clone, Copy, Debug, Default)]
struct Sent {
    class: Option<IoClass>,
    /// When the slot's first request still in the device was handed over, ns.
    at_ns: u64,
    /// Requests of the slot in the device.
    count: u32,
    /// A read that found no write-class request in the device or waiting.
    quiet: bool,
}

/// What [`MemberQueue::pump`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pumped {
    /// Requests handed to the channel.
    pub submitted: u32,
}

/// The class queues, in-device accounting and depth controller of one member on one shard;
/// see the module docs.
pub struct MemberQueue {
    queues: [VecDeque<Request>; 4],
    /// Requests in `queues`, all classes (the data path's common check, "does anything
    /// wait?", is one compare instead of a look at every class queue).
    waiting: usize,
    in_device: [u32; 4],
    passed: [u32; 4],
    sent: Vec<Sent>,
    slot_shift: u32,
    ctl: DepthController,
}

impl MemberQueue {
    /// A queue for a member whose channel holds `queue_depth` requests, with room for
    /// `capacity` queued requests per class and `slots` tag slots (`tag >> slot_shift` <
    /// `slots`).
    pub fn new(
        cfg: DepthConfig,
        queue_depth: u32,
        capacity: usize,
        slots: usize,
        slot_shift: u32,
    ) -> Self {
        Self {
            queues: std::array::from_fn(|_| VecDeque::with_capacity(capacity)),
            waiting: 0,
            in_device: [0; 4],
            passed: [0; 4],
            sent: vec![Sent::default(); slots],
            slot_shift,
            ctl: DepthController::new(cfg, queue_depth),
        }
    }

    /// Queues `req` behind earlier requests of its class.
    pub fn enqueue(&mut self, class: IoClass, req: Request) {
        self.queues[class.index()].push_back(req);
        self.waiting += 1;
    }

    /// Queues `req` in its class and dispatches what `ch` and the limits admit, like
    /// [`MemberQueue::enqueue`] then [`MemberQueue::pump`] — but a request that finds every
    /// queue empty and its class within its limit goes to the channel at once, without
    /// passing through its queue (the common case on the data path: nothing waits, so
    /// class order is not at stake). Returns what was dispatched; refusals as for `pump`.
    // Always inline, a submit error out of line (`send_refused`): the data path's common
    // case is a few compares, the channel's submit and `dispatched`.
    #[inline(always)]
    pub fn send<C: Channel>(
        &mut self,
        class: IoClass,
        req: Request,
        ch: &mut C,
        now_ns: u64,
        refused: impl FnMut(Request, SubmitError),
    ) -> Pumped {
        let i = class.index();
        let idle = self.waiting == 0;
        let within = self.in_device[i] < self.ctl.limit(class)
            && (!class.is_write_class() || self.write_class_in_device() < self.ctl.depth_limit());
        if !(idle && within) {
            self.enqueue(class, req);
            return self.pump(ch, now_ns, refused);
        }
        match ch.submit(req) {
            Ok(()) => {
                self.dispatched(class, &req, now_ns);
                Pumped { submitted: 1 }
            }
            Err(e) => self.send_refused(class, req, e, ch, refused),
        }
    }

    /// [`Self::send`] when the channel's submit failed with `e`: a full channel with
    /// requests of ours in it keeps `req` queued (back-pressure, routine under a queue
    /// deeper than the device's: not cold); a full channel with none of ours in it will
    /// never take it ([`SubmitError::Gone`], as in [`Self::pump`]); any other error goes
    /// to `refused`.
    #[inline(never)]
    fn send_refused<C: Channel>(
        &mut self,
        class: IoClass,
        req: Request,
        e: SubmitError,
        ch: &mut C,
        mut refused: impl FnMut(Request, SubmitError),
    ) -> Pumped {
        match e {
            SubmitError::QueueFull if ch.in_flight() > 0 => self.enqueue(class, req),
            SubmitError::QueueFull => refused(req, SubmitError::Gone),
            e => refused(req, e),
        }
        Pumped::default()
    }

    /// Requests waiting in the queues (all classes).
    pub fn queued(&self) -> usize {
        debug_assert_eq!(
            self.waiting,
            self.queues.iter().map(VecDeque::len).sum::<usize>()
        );
        self.waiting
    }

    /// Requests of `class` in the device.
    pub fn in_device(&self, class: IoClass) -> u32 {
        self.in_device[class.index()]
    }

    /// The depth controller.
    pub fn controller(&self) -> &DepthController {
        &self.ctl
    }

    /// The controller's state.
    pub fn state(&self) -> QosState {
        self.ctl.state()
    }

    fn write_class_in_device(&self) -> u32 {
        self.in_device[IoClass::ForegroundWrite.index()]
            + self.in_device[IoClass::Background.index()]
    }

    fn admissible(&self, class: IoClass) -> bool {
        let i = class.index();
        if self.queues[i].is_empty() || self.in_device[i] >= self.ctl.limit(class) {
            return false;
        }
        !class.is_write_class() || self.write_class_in_device() < self.ctl.depth_limit()
    }

    /// The next class to dispatch: a starved one first, else the highest admissible.
    fn pick(&self) -> Option<IoClass> {
        IoClass::ALL
            .into_iter()
            .find(|&c| self.passed[c.index()] >= STARVATION_LIMIT && self.admissible(c))
            .or_else(|| IoClass::ALL.into_iter().find(|&c| self.admissible(c)))
    }

    /// Hands queued requests to `ch` in class order within the limits, at `now_ns`.
    /// Requests the channel refuses for good (not `QueueFull`) go to `refused` with the
    /// error (the caller completes them as failed); a `QueueFull` with nothing of ours
    /// in the device is such a refusal ([`SubmitError::Gone`]): the channel will never
    /// take anything.
    pub fn pump<C: Channel>(
        &mut self,
        ch: &mut C,
        now_ns: u64,
        mut refused: impl FnMut(Request, SubmitError),
    ) -> Pumped {
        let mut out = Pumped::default();
        // The common case on every executor turn: nothing waits (one look at the count, no
        // class walk).
        if self.waiting == 0 {
            return out;
        }
        while let Some(class) = self.pick() {
            let i = class.index();
            let req = self.queues[i]
                .pop_front()
                .expect("admissible class has a request");
            self.waiting -= 1;
            match ch.submit(req) {
                Ok(()) => {
                    out.submitted += 1;
                    self.dispatched(class, &req, now_ns);
                }
                Err(SubmitError::QueueFull) if ch.in_flight() > 0 => {
                    self.queues[i].push_front(req);
                    self.waiting += 1;
                    break;
                }
                Err(SubmitError::QueueFull) => refused(req, SubmitError::Gone),
                Err(e) => refused(req, e),
            }
        }
        out
    }

    // Always: `send`'s common case is this and the channel's submit, and a call here
    // saved and restored as many registers as the function body runs instructions.
    #[inline(always)]
    fn dispatched(&mut self, class: IoClass, req: &Request, now_ns: u64) {
        let i = class.index();
        self.passed[i] = 0;
        let quiet = if self.waiting == 0 {
            // Nothing waits (the common case): no class was passed over.
            class == IoClass::ForegroundRead && self.write_class_in_device() == 0
        } else {
            for c in IoClass::ALL.into_iter().skip(i + 1) {
                if !self.queues[c.index()].is_empty() {
                    self.passed[c.index()] += 1;
                }
            }
            class == IoClass::ForegroundRead
                && self.write_class_in_device() == 0
                && self.queues[IoClass::ForegroundWrite.index()].is_empty()
                && self.queues[IoClass::Background.index()].is_empty()
        };
        self.in_device[i] += 1;
        let slot = (req.tag >> self.slot_shift) as usize;
        if let Some(s) = self.sent.get_mut(slot) {
            debug_assert!(
                s.count == 0 || s.class == Some(class),
                "one class per slot and member at a time"
            );
            if s.count == 0 {
                *s = Sent {
                    class: Some(class),
                    at_ns: now_ns,
                    count: 0,
                    quiet,
                };
            }
            s.count += 1;
        }
        self.ctl.on_dispatch(now_ns, class);
    }

    /// A request with `tag` came back from the device at `now_ns` (any status): updates
    /// the in-device counts and feeds its latency to the controller. Unknown tags (a
    /// back-end bug the engine counts separately) are ignored.
    #[inline(always)]
    pub fn completed(&mut self, tag: u64, now_ns: u64) -> Option<u64> {
        let slot = (tag >> self.slot_shift) as usize;
        let s = self.sent.get_mut(slot)?;
        let (Some(class), true) = (s.class, s.count > 0) else {
            return None;
        };
        s.count -= 1;
        let (at, quiet) = (s.at_ns, s.quiet);
        if s.count == 0 {
            s.class = None;
        }
        let i = class.index();
        debug_assert!(self.in_device[i] > 0);
        self.in_device[i] = self.in_device[i].saturating_sub(1);
        let latency = now_ns.saturating_sub(at);
        self.ctl.on_complete(now_ns, class, latency, quiet);
        Some(latency)
    }

    /// Removes every queued (not yet dispatched) request with `tag`; returns how many.
    pub fn remove_tag(&mut self, tag: u64) -> usize {
        let mut n = 0;
        for q in &mut self.queues {
            let before = q.len();
            q.retain(|r| r.tag != tag);
            n += before - q.len();
        }
        self.waiting -= n;
        n
    }

    /// Advances the controller's windows to `now_ns`.
    pub fn tick(&mut self, now_ns: u64) {
        let busy = self.write_class_in_device() > 0
            || !self.queues[IoClass::ForegroundWrite.index()].is_empty()
            || !self.queues[IoClass::Background.index()].is_empty();
        self.ctl.tick(now_ns, busy);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Completion, DeviceInfo, IoBuf, Op};
    use crate::qos::DepthPolicy;

    /// A channel of fixed capacity that records submission order.
    struct Rec {
        info: DeviceInfo,
        cap: usize,
        inside: Vec<u64>,
        order: Vec<u64>,
        /// Refuses every request with this, when set.
        refuse: Option<SubmitError>,
    }

    impl Channel for Rec {
        fn info(&self) -> &DeviceInfo {
            &self.info
        }
        fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
            if let Some(e) = self.refuse {
                return Err(e);
            }
            if self.inside.len() >= self.cap {
                return Err(SubmitError::QueueFull);
            }
            self.inside.push(req.tag);
            self.order.push(req.tag);
            Ok(())
        }
        fn kick(&mut self) {}
        fn poll(&mut self, _out: &mut [Completion]) -> usize {
            0
        }
        fn in_flight(&self) -> usize {
            self.inside.len()
        }
        fn abort(&mut self, _tag: u64) {}
    }

    fn rec(cap: usize) -> Rec {
        Rec {
            info: DeviceInfo {
                name: "rec".into(),
                block_bytes: 512,
                capacity_bytes: 1 << 20,
                queue_depth: cap as u32,
                max_transfer_bytes: 1 << 20,
                volatile_cache: false,
                write_zeroes: false,
                discard: false,
                rotational: false,
            },
            cap,
            inside: Vec::new(),
            order: Vec::new(),
            refuse: None,
        }
    }

    fn req(tag: u64, op: Op) -> Request {
        Request {
            tag,
            op,
            offset_bytes: 0,
            len_bytes: 0,
            buf: IoBuf::NONE,
        }
    }

    #[test]
    fn reads_overtake_queued_writes_and_writes_are_not_starved() {
        let mut ch = rec(1);
        let mut q = MemberQueue::new(DepthConfig::default(), 1, 64, 64, 0);
        let mut refused = 0;
        for t in 0..20 {
            q.enqueue(IoClass::ForegroundWrite, req(t, Op::Write { fua: false }));
        }
        q.pump(&mut ch, 0, |_, _| refused += 1);
        assert_eq!(ch.order, [0]);
        for t in 20..60 {
            q.enqueue(IoClass::ForegroundRead, req(t, Op::Read));
        }
        // Complete one request at a time: reads go first, but a write gets a turn after
        // STARVATION_LIMIT reads.
        for i in 1..40u64 {
            let done = ch.inside.pop().unwrap();
            q.completed(done, i * 100);
            q.pump(&mut ch, i * 100, |_, _| refused += 1);
        }
        assert_eq!(refused, 0);
        assert_eq!(ch.order[1], 20, "a read overtakes 19 queued writes");
        let first_write = ch.order[1..].iter().position(|&t| t < 20).unwrap();
        assert_eq!(
            first_write as u32, STARVATION_LIMIT,
            "then a write gets its turn"
        );
    }

    #[test]
    fn write_class_depth_is_enforced_and_reads_are_not() {
        let mut ch = rec(64);
        let cfg = DepthConfig {
            policy: DepthPolicy::Ferroraid,
            target_latency_ns: Some(1_000),
            rotational: false,
        };
        let mut q = MemberQueue::new(cfg, 64, 64, 64, 0);
        // Drive the controller down: slow reads with writes present.
        let mut now = 0;
        for w in 0..6u64 {
            q.enqueue(IoClass::ForegroundRead, req(1, Op::Read));
            q.enqueue(IoClass::ForegroundWrite, req(2, Op::Write { fua: false }));
            q.pump(&mut ch, now, |_, _| panic!("refused"));
            now += 100_000_000 * (w + 1);
            ch.inside.clear();
            q.completed(1, now);
            q.completed(2, now);
            q.tick(now);
        }
        let limit = q.state().depth_limit;
        assert!(limit < 64, "scaled down: {limit}");
        for t in 0..40 {
            q.enqueue(
                IoClass::ForegroundWrite,
                req(100 + t, Op::Write { fua: false }),
            );
            q.enqueue(IoClass::ForegroundRead, req(200 + t, Op::Read));
        }
        q.pump(&mut ch, now, |_, _| panic!("refused"));
        assert_eq!(q.in_device(IoClass::ForegroundWrite), limit);
        assert_eq!(q.in_device(IoClass::ForegroundRead), 40);
    }

    #[test]
    fn send_goes_straight_through_only_when_nothing_waits() {
        let mut ch = rec(2);
        let mut q = MemberQueue::new(DepthConfig::default(), 2, 8, 8, 0);
        let never = |_: Request, _: SubmitError| panic!("refused");
        // Nothing queued: straight to the channel, accounted as dispatched.
        let p = q.send(
            IoClass::ForegroundWrite,
            req(1, Op::Write { fua: false }),
            &mut ch,
            0,
            never,
        );
        assert_eq!(p.submitted, 1);
        assert_eq!(q.in_device(IoClass::ForegroundWrite), 1);
        q.send(
            IoClass::ForegroundWrite,
            req(2, Op::Write { fua: false }),
            &mut ch,
            0,
            never,
        );
        // The channel is full: the next ones wait in their queues...
        let p = q.send(
            IoClass::ForegroundWrite,
            req(3, Op::Write { fua: false }),
            &mut ch,
            0,
            never,
        );
        assert_eq!((p.submitted, q.queued()), (0, 1));
        // ... and a later read does not pass them by the direct path, but by class order
        // once the channel has room.
        q.send(IoClass::ForegroundRead, req(4, Op::Read), &mut ch, 0, never);
        assert_eq!(q.queued(), 2);
        ch.inside.clear();
        q.completed(1, 10);
        q.completed(2, 10);
        q.pump(&mut ch, 10, never);
        assert_eq!(ch.order, [1, 2, 4, 3]);
        assert_eq!(q.queued(), 0);
    }

    /// `send`'s refusals: a full channel with requests of ours in it keeps the request
    /// queued; a full one with none of ours will never take it (`Gone`).
    #[test]
    fn send_queues_on_a_full_channel_and_refuses_on_a_dead_one() {
        let mut ch = rec(1);
        let mut q = MemberQueue::new(DepthConfig::default(), 4, 8, 8, 0);
        let mut got = Vec::new();
        q.send(
            IoClass::ForegroundRead,
            req(1, Op::Read),
            &mut ch,
            0,
            |r, e| got.push((r.tag, e)),
        );
        q.send(
            IoClass::ForegroundRead,
            req(2, Op::Read),
            &mut ch,
            0,
            |r, e| got.push((r.tag, e)),
        );
        assert_eq!((ch.order.as_slice(), q.queued()), (&[1][..], 1));
        ch.inside.clear();
        q.completed(1, 10);
        q.pump(&mut ch, 10, |r, e| got.push((r.tag, e)));
        assert_eq!((ch.order.as_slice(), q.queued()), (&[1, 2][..], 0));
        let mut dead = rec(0);
        q.send(
            IoClass::ForegroundWrite,
            req(3, Op::Write { fua: false }),
            &mut dead,
            20,
            |r, e| got.push((r.tag, e)),
        );
        assert_eq!(got, [(3, SubmitError::Gone)]);
        assert_eq!(q.queued(), 0);
        // Any other refusal reaches the caller as it is, nothing queued or counted.
        let mut bad = rec(4);
        bad.refuse = Some(SubmitError::Invalid("test"));
        let p = q.send(
            IoClass::ForegroundRead,
            req(5, Op::Read),
            &mut bad,
            30,
            |r, e| got.push((r.tag, e)),
        );
        assert_eq!(p, Pumped::default());
        assert_eq!(got[1..], [(5, SubmitError::Invalid("test"))]);
        assert_eq!(q.queued(), 0);
        assert_eq!(q.in_device(IoClass::ForegroundRead), 1, "only request 2");
    }

    #[test]
    fn a_channel_that_never_takes_anything_refuses() {
        let mut ch = rec(0);
        let mut q = MemberQueue::new(DepthConfig::default(), 4, 8, 8, 0);
        q.enqueue(IoClass::Flush, req(3, Op::Flush));
        let mut got = Vec::new();
        q.pump(&mut ch, 0, |r, e| got.push((r.tag, e)));
        assert_eq!(got, [(3, SubmitError::Gone)]);
        assert_eq!(q.queued(), 0);
    }
}
