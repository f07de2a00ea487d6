//! Reactors: one thread per core, each owning a shard of the stripes.
//!
//! A reactor is a thread pinned to one core (core_affinity) running one loop that turns
//! every source into work, in order:
//!
//! 1. its **inbound rings**, one from each other reactor (bounded wait-free single-producer
//!    single-consumer rings, `rtrb`: a message costs the sender one store of its tail and
//!    the receiver one of its head, no read-modify-write, and each side re-reads the other's
//!    index only when its cached copy says full or empty): pieces of requests for stripes it
//!    owns, sent by other reactors, and completions of pieces it sent away;
//! 2. its **array shard** ([`Array`]): member completions from its own channels (one queue
//!    pair per member, never shared), stripe state machines, new member I/O;
//! 3. its **front-end** ([`Frontend`]): whatever submits array requests here — an NBD
//!    connection, a load generator.
//!
//! A request submitted on a reactor is split at stripe boundaries ([`crate::shard::split`]);
//! pieces owned here go straight into the local shard, the others travel over the owner's
//! ring (buffers lent by pointer, never copied) and their completions come back over this
//! reactor's ring. The request completes when every piece has.
//!
//! Modes: **polled** spins (the production default: lowest latency, a whole core), while
//! **adaptive** parks the thread (a futex wait in the kernel) after [`ADAPTIVE_SPINS`] idle
//! turns, for growing naps of up to [`ADAPTIVE_MAX_SLEEP`] (tests, the demo, shared
//! machines). A reactor that sends work to a parked one unparks it at once, so requests
//! crossing reactors never wait out a nap; device completions and front-end sockets are
//! noticed at the end of the nap (at most [`ADAPTIVE_MAX_SLEEP`] late).
//!
//! Every turn also gives the shard the time ([`Array::set_now`], ns since the reactors
//! started) that its command timeouts are measured on.

use std::any::Any;
use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use crossbeam_utils::CachePadded;
use thiserror::Error;

use crate::array::{
    device_fits, new_latency_histogram, Array, ArrayBuildError, ArrayCompletion, ArrayConfig,
    ArrayError, ArrayRequest, ArrayStats, MemberCounters, MemberState, ReplaceInfo, ReplaceState,
    RequestClass, TURN_BOUND_HOLD_NS,
};
use crate::bitmap::WriteIntent;
use crate::device::{BlockDevice, Channel, DeviceError, IoError};
use crate::geometry::ArrayGeometry;
use crate::parity::Parity;
use crate::process::{
    ProcessError, ProcessKind, ProcessRequest, ProcessSnapshot, ProcessState, RateWindow,
    ShardProgress,
};
use crate::qos::QosState;
use crate::qos::{Pacer, Unpaced};
use crate::shard::{merge_state, owner, split, StripeGate};
use crate::zero_map::ZeroMap;

/// Idle loop turns before an adaptive reactor starts sleeping.
pub const ADAPTIVE_SPINS: u32 = 1000;
/// Longest sleep of an idle adaptive reactor: bounds the latency added to the first request
/// after an idle period.
pub const ADAPTIVE_MAX_SLEEP: Duration = Duration::from_micros(200);
/// Capacity of the ring from one reactor to another, in messages (n × (n − 1) rings for n
/// reactors; a full ring keeps the sender's further messages in its outbox).
pub const RING_CAPACITY: usize = 1024;
/// Slots of the stripe gate shared by the reactors of an array (4 bytes each, 16 in a
/// 128-byte block: 128 KiB): far
/// more than the stripe operations in flight, so two of them rarely share a slot (a
/// false conflict costs a hop or a short wait, never correctness).
pub const GATE_SLOTS: usize = 16384;
/// Capacity of each reactor's control ring (management commands), in messages.
pub const CONTROL_CAPACITY: usize = 256;
/// How often a reactor publishes its statistics for [`ReactorHandle::snapshot`] (and at
/// once after a member failure).
pub const PUBLISH_INTERVAL: Duration = Duration::from_millis(100);

/// Window over which [`ReactorHandle::process_snapshot`] measures a process's rate.
pub const RATE_WINDOW: Duration = Duration::from_secs(10);

/// A management command for the reactors.
enum Control {
    /// Fail this member; `None` = the operator asked, `Some(e)` = another reactor saw `e`.
    FailMember(u16, Option<crate::device::IoError>),
    /// Start a background process on the shard.
    StartProcess(ProcessRequest),
    /// Stop the shard's process.
    StopProcess,
    /// Put a new device (an `Arc<D>` of the reactors' device type) into a failed member's
    /// slot; the reactor opens its own channel to it and starts a rebuild. `true`: it is
    /// the member's own device returning (a re-add: only the bitmap's dirty regions).
    ReplaceMember(u16, Arc<dyn Any + Send + Sync>, bool),
    /// Every shard has rebuilt this member: it is online.
    MemberRebuilt(u16),
    /// Give member `slot` a replacement device (an `Arc<D>`) and start the replace from
    /// `resume` (stripes).
    StartReplace {
        slot: u16,
        dev: Arc<dyn Any + Send + Sync>,
        serial: u64,
        resume: u64,
    },
    /// Replacement `serial` failed (on another reactor, or by the operator).
    FailReplacement { serial: u64, err: IoError },
    /// Every reactor has finished replacement `serial`: swap it in.
    ReplaceDone { serial: u64 },
}

/// One member as the array sees it: merged over every reactor's shard.
#[derive(Clone, Debug)]
pub struct MemberSnapshot {
    /// Failed if any reactor failed it (the first failure seen).
    pub state: MemberState,
    /// Requests sent to the member by every reactor.
    pub counters: MemberCounters,
    /// Completion latency of those requests, ns.
    pub latency: hdrhistogram::Histogram<u64>,
    /// Depth control of the member, merged over the reactors ([`QosState::merge`]).
    pub qos: QosState,
}

impl MemberSnapshot {
    /// An online member with nothing counted yet.
    fn online() -> Self {
        MemberSnapshot {
            state: MemberState::Online,
            counters: MemberCounters::default(),
            latency: new_latency_histogram(),
            qos: QosState::default(),
        }
    }
}

/// A reactor's turn clock: nanoseconds since the reactor started, read once at the start of
/// each turn ([`Reactor::turn`]) and given to the array as its clock (command timeouts,
/// latency windows, pacing) and to the front end ([`Io::now_ns`]).
///
/// Reads the CPU's time-stamp counter through `quanta` (`rdtsc` and a multiply-shift,
/// calibrated once per process against `CLOCK_MONOTONIC`) where the CPU has an invariant
/// TSC and `rdtscp`, else `CLOCK_MONOTONIC` itself. A read costs ~10 ns against ~26 ns
/// for `Instant::elapsed` (vDSO `clock_gettime`) on the Zen 4 VM of docs/BENCHMARKS.md, and
/// a full-stripe write takes a turn of its own. Never goes backwards: a reading below the
/// last one (a thread moved to a core whose counter lags) repeats the last one.
struct TurnClock {
    clock: quanta::Clock,
    /// Raw counter value at the reactor's start.
    start: u64,
    /// Last value returned, ns.
    last_ns: u64,
    /// Raw counter value of the last reading ([`TurnHold`] keeps these: every reactor's
    /// clock counts the same raw units).
    last_raw: u64,
}

impl TurnClock {
    fn new() -> Self {
        let clock = quanta::Clock::new();
        let start = clock.raw();
        Self {
            clock,
            start,
            last_ns: 0,
            last_raw: start,
        }
    }

    /// Nanoseconds since [`Self::new`], monotonic.
    fn now_ns(&mut self) -> u64 {
        let raw = self.clock.raw();
        self.last_raw = self.last_raw.max(raw);
        let ns = self.clock.delta_as_nanos(self.start, raw);
        self.last_ns = self.last_ns.max(ns);
        self.last_ns
    }

    /// Nanoseconds from raw reading `then` to the last reading (0 if `then` is later).
    fn since_ns(&self, then: u64) -> u64 {
        self.clock.delta_as_nanos(then, self.last_raw)
    }
}

/// When one reactor thread last saw a request that is not a bulk-sized write
/// ([`Io::note_arrival`]: any read, any write under [`crate::array::BULK_MIN_BYTES`]; not
/// a flush), as the raw counter of that turn's clock ([`TurnClock`]; 0: never). One per
/// thread, shared by every shard it hosts: such a request waits for the thread's whole
/// loop pass, the bulk work of every array hosted there, so every hosted shard keeps its
/// per-turn bulk bound for [`TURN_BOUND_HOLD_NS`] after it
/// ([`Array::set_turn_bound_held`]). Front ends note commands when they parse them
/// ([`Io::note_arrival`]), before they wait for a buffer or a request slot;
/// [`Io::submit`] notes every request again by its own length (a bulk write a front end
/// cut into pieces may so note its short last piece: the safe direction); pieces from
/// other reactors are noted as they arrive, by their origin's verdict on the whole
/// request ([`UNBULK_PIECE`]). Writes under [`crate::array::BULK_MIN_BYTES`] count
/// whether or not they continue a stream (the shard's own rule, [`RequestClass`], exempts
/// stream writes; the thread has no stream table).
#[derive(Default)]
struct TurnHold(Cell<u64>);

impl TurnHold {
    /// Notes a request that is not a bulk write, submitted in the turn whose clock read
    /// `raw`.
    #[inline]
    fn note(&self, raw: u64) {
        self.0.set(raw.max(1));
    }

    /// Whether the bound holds at `clock`'s last reading.
    fn held(&self, clock: &TurnClock) -> bool {
        let t = self.0.get();
        t != 0 && clock.since_ns(t) < TURN_BOUND_HOLD_NS
    }
}

/// The next item of `q`, looked for with `is_empty` first (two loads). `ArrayQueue::pop` on
/// an empty queue issues a full fence, which waits for every store the caller made (a
/// stripe's parity among them) to drain: a consumer that looks every loop turn (a
/// reactor's management and adoption queues, a front end's new connections) pays that on
/// every turn that finds nothing. An item pushed while we look is taken at the next look,
/// as after an empty `pop`.
#[inline]
pub fn pop_if_any<T>(q: &ArrayQueue<T>) -> Option<T> {
    if q.is_empty() {
        None
    } else {
        q.pop()
    }
}

/// One reactor's loop, counted by the reactor itself and published with its statistics
/// ([`ReactorHandle::reactor_loads`]). Times are wall-clock **nanoseconds** since the
/// reactor started; every interval between two turn starts counts once, as busy or idle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReactorLoad {
    /// Loop turns.
    pub turns: u64,
    /// Time in turns that moved something (a request, a completion, a message between
    /// reactors, a management command), ns.
    pub busy_ns: u64,
    /// Time in turns that found nothing to do, spinning or parked, ns.
    pub idle_ns: u64,
    /// Array request pieces this reactor sent to the reactor owning their stripe (issued
    /// by its front end for another reactor's stripe, or a foreign read handed back).
    pub pieces_sent: u64,
    /// Pieces other reactors sent to this one.
    pub pieces_received: u64,
    /// Turns whose per-turn bulk bound held by the reactor thread's own record: a request
    /// that is not a bulk-sized write seen by the thread within
    /// [`crate::array::TURN_BOUND_HOLD_NS`] (noted by a front end, or a piece so marked
    /// by its origin), whatever the shard accepted itself (`Array::set_turn_bound_held`).
    pub bound_held_turns: u64,
}

impl ReactorLoad {
    /// Busy share of the measured time, 0.0..=1.0 (0 before the first interval).
    pub fn busy_fraction(&self) -> f64 {
        let total = self.busy_ns + self.idle_ns;
        if total == 0 {
            0.0
        } else {
            self.busy_ns as f64 / total as f64
        }
    }
}

/// The array's statistics over every reactor, as last published (at most
/// [`PUBLISH_INTERVAL`] old).
#[derive(Clone, Debug)]
pub struct ArraySnapshot {
    /// Path counters, summed over the shards.
    pub stats: ArrayStats,
    /// Members in member order.
    pub members: Vec<MemberSnapshot>,
    /// Array requests accepted and not yet completed, all reactors.
    pub requests_in_flight: usize,
    /// Of those, write pieces finished and held until a member or replacement failure is
    /// recorded ([`Extras::confirm_failures`]), as last published.
    pub writes_held: usize,
    /// Reactors running.
    pub reactors: usize,
    /// The last management command a reactor refused after the handle accepted it (a
    /// process start a shard found busy, a replacement device it could not open), if any.
    pub control_error: Option<ControlError>,
    /// The last replacement ([`ReactorHandle::start_replace`]), merged over the reactors:
    /// failed if any reactor failed it, done once every reactor swapped it in, copied
    /// once every reactor copied it and it waits for [`ReactorHandle::complete_replace`]
    /// ([`Extras::confirm_replace`]), else copying; with what the reactors sent to the replacement device while it was live.
    pub replacement: Option<ReplacementSnapshot>,
    /// How long requests waited inside the array before their first member request, ns,
    /// per [`RequestClass`] (indexed by [`RequestClass::index`]), merged over the shards.
    pub queue_wait: [hdrhistogram::Histogram<u64>; 3],
    /// Stripes the array knows to read as zeroes now (reported as holes by block status,
    /// [`ZeroMap`]), of [`ArrayGeometry::stripes`].
    pub zero_stripes: u64,
}

/// A member's replacement as the array sees it ([`ArraySnapshot::replacement`]).
#[derive(Clone, Debug)]
pub struct ReplacementSnapshot {
    /// The member being (or that was) replaced, its serial and state.
    pub info: ReplaceInfo,
    /// Requests sent to the replacement device while it was live, every reactor.
    pub counters: MemberCounters,
    /// Their completion latency, ns.
    pub latency: hdrhistogram::Histogram<u64>,
}

/// Why a management command was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ControlError {
    /// No such member.
    #[error("member {member} does not exist: the array has {members} members")]
    NoSuchMember {
        /// The index asked for.
        member: u16,
        /// Members of the array.
        members: u16,
    },
    /// A background process or member replacement was refused.
    #[error("{0}")]
    Process(#[from] ProcessError),
    /// A replacement device of another type than the reactors' members.
    #[error("the new device for member {member} is not of the members' device type")]
    DeviceType {
        /// The slot.
        member: u16,
    },
    /// A reactor could not open a channel to a replacement device.
    #[error("reactor {reactor} could not open the new device for member {member}: {why}")]
    Open {
        /// The reactor.
        reactor: usize,
        /// The slot.
        member: u16,
        /// The device error.
        why: String,
    },
    /// [`ReactorHandle::complete_replace`] for a replacement that every reactor has not
    /// copied (still copying, failed while copying, or not the current one).
    #[error("replacement {serial} has not been copied by every reactor")]
    NotCopied {
        /// The serial asked for.
        serial: u64,
    },
}

/// What one reactor last published.
struct Published {
    stats: ArrayStats,
    members: Vec<MemberSnapshot>,
    /// The shard's progress in its last process.
    process: Option<ShardProgress>,
    /// The last command the reactor refused.
    control_error: Option<ControlError>,
    /// The shard's last replacement, and what it sent to the replacement device.
    replace: Option<ReplaceInfo>,
    replace_counters: MemberCounters,
    replace_latency: hdrhistogram::Histogram<u64>,
    /// [`Array::queue_wait`] per [`RequestClass`].
    queue_wait: [hdrhistogram::Histogram<u64>; 3],
    /// The reactor's own loop counters.
    load: ReactorLoad,
    /// Failures the shard has seen that the caller records ([`Array::failures_to_record`]).
    failures: u64,
    /// Write completions the shard holds for them ([`Array::held_writes`]).
    writes_held: usize,
}

/// A cloneable handle for management while the reactors run: fail members, read
/// statistics. Never blocks a reactor: commands travel over lock-free rings, and reactors
/// publish statistics with a `try_lock` that skips a turn rather than wait.
#[derive(Clone)]
pub struct ReactorHandle {
    shared: Arc<Shared>,
}

impl ReactorHandle {
    /// Marks `member` faulty on every reactor (an operator's `fail`): no request is sent to
    /// it afterwards; reads and writes go on from redundancy. Takes effect within a loop
    /// turn of each reactor.
    ///
    /// # Errors
    /// [`ControlError::NoSuchMember`] for an index beyond the array.
    pub fn fail_member(&self, member: u16) -> Result<(), ControlError> {
        if member >= self.shared.members {
            return Err(ControlError::NoSuchMember {
                member,
                members: self.shared.members,
            });
        }
        for to in 0..self.shared.control.len() {
            self.shared
                .send_control(to, Control::FailMember(member, None));
        }
        Ok(())
    }

    /// Starts a background process on every reactor (each walks its own stripes). Checked
    /// here against the last published state; a reactor that still refuses (its shard
    /// still draining a stopped process) reports it in [`ArraySnapshot::control_error`].
    ///
    /// # Errors
    /// [`ControlError::Process`]: the request is malformed, the array has failed, a
    /// process runs, or the members do not allow it (see [`Array::start_process`]).
    pub fn start_process(&self, req: ProcessRequest) -> Result<(), ControlError> {
        req.validate(&self.shared.geo)?;
        let snap = self.snapshot();
        let g = self.shared.geo.geometry();
        let lost = snap
            .members
            .iter()
            .filter(|m| m.state != MemberState::Online)
            .count();
        if lost > usize::from(g.parity_chunks()) {
            return Err(ProcessError::ArrayFailed.into());
        }
        if let Some(p) = self.process_snapshot() {
            if p.state == ProcessState::Running {
                return Err(ProcessError::Busy { running: p.kind }.into());
            }
        }
        let rebuilding = snap
            .members
            .iter()
            .any(|m| m.state == MemberState::Rebuilding);
        match req.kind {
            ProcessKind::Rebuild if !rebuilding => {
                return Err(ProcessError::NothingToRebuild.into())
            }
            ProcessKind::Rebuild => {}
            kind => {
                if let Some(m) = snap
                    .members
                    .iter()
                    .position(|m| m.state != MemberState::Online)
                {
                    return Err(ProcessError::Degraded {
                        kind,
                        member: m as u16,
                    }
                    .into());
                }
            }
        }
        self.shared
            .rate
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reset();
        for to in 0..self.shared.control.len() {
            self.shared
                .send_control(to, Control::StartProcess(req.clone()));
        }
        Ok(())
    }

    /// Stops the running process on every reactor: operations in flight finish, and the
    /// published position is then the checkpoint to resume from.
    pub fn stop_process(&self) {
        for to in 0..self.shared.control.len() {
            self.shared.send_control(to, Control::StopProcess);
        }
    }

    /// The last process merged over every reactor (as last published, at most
    /// [`PUBLISH_INTERVAL`] old), with its rate (per-member bytes per second over
    /// [`RATE_WINDOW`]) and time to finish; `None` before any process was started on every
    /// reactor. What the CLI checkpoints: `position_sectors` is md's `resync_offset`
    /// (resync) or `recovery_offset` (rebuild); `state` tells whether it finished, was
    /// stopped or failed, and `targets` which members a rebuild brought (or brings) in.
    pub fn process_snapshot(&self) -> Option<ProcessSnapshot> {
        let mut shards = Vec::with_capacity(self.shared.published.len());
        for p in &self.shared.published {
            let p = p.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            shards.push(p.process.clone()?);
        }
        let mut snap = ProcessSnapshot::merge(&shards, &self.shared.geo)?;
        let now = u64::try_from(self.shared.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let (rate, eta) = self
            .shared
            .rate
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .observe(now, snap.done_member_bytes, snap.total_member_bytes);
        snap.rate_bytes_per_s = rate;
        snap.eta_s = if snap.state == ProcessState::Running {
            eta
        } else {
            None
        };
        Some(snap)
    }

    /// Puts `device` into failed member `slot`'s place on every reactor (each opens its own
    /// channel to it) and starts a rebuild onto it (md's `member_add` of a spare to a
    /// degraded array); a rebuild already running finishes first, then this member's
    /// starts. Progress in [`Self::process_snapshot`]; the member turns
    /// [`MemberState::Online`] in [`Self::snapshot`] once every reactor has rebuilt it.
    ///
    /// # Errors
    /// [`ControlError::NoSuchMember`]; [`ControlError::Process`] with
    /// [`ProcessError::ArrayFailed`] (a failed array stays failed),
    /// [`ProcessError::NotFailed`] or [`ProcessError::Unfit`];
    /// [`ControlError::DeviceType`] for a device of another type than the members.
    pub fn replace_member<D: BlockDevice + Send + Sync + 'static>(
        &self,
        slot: u16,
        device: Arc<D>,
    ) -> Result<(), ControlError> {
        self.put_member(slot, device, false)
    }

    /// [`Self::replace_member`] for the device that left member `slot` coming back (md's
    /// re-add, [`Array::readd_member`]): its rebuild covers only the write-intent bitmap's
    /// dirty regions. The caller has checked that the device may return by bitmap (its
    /// `events` is not below [`WriteIntent::events_cleared`]).
    ///
    /// # Errors
    /// As [`Self::replace_member`].
    pub fn readd_member<D: BlockDevice + Send + Sync + 'static>(
        &self,
        slot: u16,
        device: Arc<D>,
    ) -> Result<(), ControlError> {
        self.put_member(slot, device, true)
    }

    fn put_member<D: BlockDevice + Send + Sync + 'static>(
        &self,
        slot: u16,
        device: Arc<D>,
        readd: bool,
    ) -> Result<(), ControlError> {
        let members = self.shared.members;
        if slot >= members {
            return Err(ControlError::NoSuchMember {
                member: slot,
                members,
            });
        }
        if self.shared.device_type != std::any::TypeId::of::<D>() {
            return Err(ControlError::DeviceType { member: slot });
        }
        let snap = self.snapshot();
        let lost = snap
            .members
            .iter()
            .filter(|m| m.state != MemberState::Online)
            .count();
        if lost > usize::from(self.shared.geo.geometry().parity_chunks()) {
            return Err(ProcessError::ArrayFailed.into());
        }
        if !snap.members[usize::from(slot)].state.is_failed() {
            return Err(ProcessError::NotFailed { member: slot }.into());
        }
        if snap
            .replacement
            .as_ref()
            .is_some_and(|r| r.info.member == slot && r.info.state.is_live())
        {
            return Err(ProcessError::ReplaceBusy { member: slot }.into());
        }
        device_fits(
            &self.shared.geo,
            self.shared.data_offset,
            slot,
            device.info(),
        )?;
        // A fresh count of the reactors that have rebuilt this slot.
        self.shared.rebuilt[usize::from(slot)].store(0, Ordering::Release);
        let device: Arc<dyn Any + Send + Sync> = device;
        for to in 0..self.shared.control.len() {
            self.shared
                .send_control(to, Control::ReplaceMember(slot, Arc::clone(&device), readd));
        }
        Ok(())
    }

    /// Gives member `slot` the replacement `device` on every reactor (each opens its own
    /// channel) and starts the replace from `resume_stripe` (md's `mdadm --replace`,
    /// [`Array::start_replace`]): writes to the member go to the replacement too, the
    /// replace process copies the member onto it (rebuilding what the member cannot
    /// read), and once every reactor has finished the replacement takes the slot
    /// ([`ArraySnapshot::replacement`] turns [`ReplaceState::Done`]). Returns the
    /// replacement's serial.
    ///
    /// # Errors
    /// [`ControlError::NoSuchMember`]; [`ControlError::DeviceType`];
    /// [`ControlError::Process`] with [`ProcessError::ArrayFailed`],
    /// [`ProcessError::Degraded`] (a member is failed or being rebuilt: md would use a new
    /// device for it first), [`ProcessError::ReplaceBusy`], [`ProcessError::Busy`] (a
    /// process runs) or [`ProcessError::Unfit`]. A reactor that refuses later reports it
    /// in [`ArraySnapshot::control_error`].
    pub fn start_replace<D: BlockDevice + Send + Sync + 'static>(
        &self,
        slot: u16,
        device: Arc<D>,
        resume_stripe: u64,
    ) -> Result<u64, ControlError> {
        if self.shared.device_type != std::any::TypeId::of::<D>() {
            return Err(ControlError::DeviceType { member: slot });
        }
        self.check_start_replace(slot, device.info(), resume_stripe)?;
        let serial = self.shared.replace_serial.fetch_add(1, Ordering::AcqRel) + 1;
        self.shared.replaced.store(0, Ordering::Release);
        self.shared
            .rate
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reset();
        let device: Arc<dyn Any + Send + Sync> = device;
        for to in 0..self.shared.control.len() {
            self.shared.send_control(
                to,
                Control::StartReplace {
                    slot,
                    dev: Arc::clone(&device),
                    serial,
                    resume: resume_stripe,
                },
            );
        }
        Ok(serial)
    }

    /// Swaps replacement `serial` into its slot on every reactor ([`Array::complete_replace`]
    /// on each shard) once every reactor has copied it ([`ReplaceState::Copied`]; only
    /// with [`Extras::confirm_replace`], else the reactors swap by themselves). The
    /// caller records the swap durably first. [`ArraySnapshot::replacement`] turns
    /// [`ReplaceState::Done`] when every reactor has swapped; a replacement that failed
    /// after its copy is not swapped and turns [`ReplaceState::Failed`]. Asking again
    /// (before or after the swap) is harmless.
    ///
    /// # Errors
    /// [`ControlError::NotCopied`] when `serial` is not the current replacement or not
    /// every reactor has copied it.
    pub fn complete_replace(&self, serial: u64) -> Result<(), ControlError> {
        if serial == 0 || self.shared.replace_copied.load(Ordering::Acquire) != serial {
            return Err(ControlError::NotCopied { serial });
        }
        for to in 0..self.shared.control.len() {
            self.shared
                .send_control(to, Control::ReplaceDone { serial });
        }
        Ok(())
    }

    /// Each reactor's count of failures to record as last published (members its shard
    /// had in service, and live replacements, that failed: [`Array::failures_to_record`]),
    /// to hand back to [`Self::failures_recorded`] once they are recorded. Taken before the
    /// [`Self::snapshot`] whose failures the caller records: every failure counted here is
    /// failed in that snapshot (a reactor publishes its member and replacement states with
    /// its count, and counts only grow).
    pub fn failure_marks(&self) -> FailureMarks {
        FailureMarks(self.each_published(|p| p.failures))
    }

    /// Says the failures counted in `marks` ([`Self::failure_marks`]) are recorded
    /// durably: each reactor releases the write completions it held for them
    /// ([`Extras::confirm_failures`]) within a loop turn. Marks never go back (an older
    /// `marks` changes nothing).
    pub fn failures_recorded(&self, marks: &FailureMarks) {
        for (to, (r, &m)) in self
            .shared
            .failures_recorded
            .iter()
            .zip(&marks.0)
            .enumerate()
        {
            if r.fetch_max(m, Ordering::AcqRel) < m {
                self.shared.wake(to);
            }
        }
    }

    /// Registers `notify`, called on a reactor's thread right after the reactor has
    /// published a new failure to record (a member or replacement of its shard failed,
    /// [`Array::failures_to_record`]) or has started holding write completions for one
    /// ([`Extras::confirm_failures`]). The caller can then take its
    /// [`Self::failure_marks`] and snapshot at once instead of at its next periodic look,
    /// and held writes wait that much less. `notify` runs on the data path: it must be quick
    /// and never block (unparking a thread, or a send on an unbounded channel). Calls may
    /// repeat for one failure and come from several reactors at once.
    ///
    /// One watcher per array's reactors (each array started on a [`ReactorSet`] has its
    /// own): `false`, with `notify` dropped, when one is registered already.
    pub fn watch_failures(&self, notify: impl Fn() + Send + Sync + 'static) -> bool {
        self.shared.failure_watcher.set(Box::new(notify)).is_ok()
    }

    /// Whether [`Self::start_replace`] would accept a device described by `info` for
    /// member `slot` now (against the last published state).
    ///
    /// # Errors
    /// As [`Self::start_replace`].
    pub fn check_start_replace(
        &self,
        slot: u16,
        info: &crate::device::DeviceInfo,
        resume_stripe: u64,
    ) -> Result<(), ControlError> {
        let members = self.shared.members;
        if slot >= members {
            return Err(ControlError::NoSuchMember {
                member: slot,
                members,
            });
        }
        let req = ProcessRequest {
            kind: ProcessKind::Replace,
            ranges: None,
            resume_stripe,
        };
        req.validate(&self.shared.geo)?;
        let snap = self.snapshot();
        let lost = snap
            .members
            .iter()
            .filter(|m| m.state != MemberState::Online)
            .count();
        if lost > usize::from(self.shared.geo.geometry().parity_chunks()) {
            return Err(ProcessError::ArrayFailed.into());
        }
        if let Some(r) = snap.replacement.as_ref().filter(|r| r.info.state.is_live()) {
            return Err(ProcessError::ReplaceBusy {
                member: r.info.member,
            }
            .into());
        }
        if snap.members[usize::from(slot)].state != MemberState::Online {
            return Err(ProcessError::NotInService { member: slot }.into());
        }
        if let Some(m) = snap
            .members
            .iter()
            .position(|m| m.state != MemberState::Online)
        {
            return Err(ProcessError::Degraded {
                kind: ProcessKind::Replace,
                member: m as u16,
            }
            .into());
        }
        if let Some(p) = self.process_snapshot() {
            if p.state == ProcessState::Running {
                return Err(ProcessError::Busy { running: p.kind }.into());
            }
        }
        device_fits(&self.shared.geo, self.shared.data_offset, slot, info)?;
        Ok(())
    }

    /// Fails replacement `serial` on every reactor (the operator's `fail` of the
    /// replacement device): the replace stops, the member keeps its slot.
    pub fn fail_replacement(&self, serial: u64) {
        for to in 0..self.shared.control.len() {
            self.shared.send_control(
                to,
                Control::FailReplacement {
                    serial,
                    err: IoError::Gone,
                },
            );
        }
    }

    /// The array's statistics over every reactor, as last published.
    pub fn snapshot(&self) -> ArraySnapshot {
        let mut out = ArraySnapshot {
            stats: ArrayStats::default(),
            members: (0..self.shared.members)
                .map(|_| MemberSnapshot::online())
                .collect(),
            requests_in_flight: self.shared.requests_in_flight(),
            writes_held: 0,
            reactors: self.shared.control.len(),
            control_error: None,
            replacement: None,
            queue_wait: std::array::from_fn(|_| new_latency_histogram()),
            zero_stripes: self.shared.zero_map.zero_stripes(),
        };
        let mut all_have_replace = true;
        for p in &self.shared.published {
            let p = p.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match (p.replace, &mut out.replacement) {
                (None, _) => all_have_replace = false,
                (Some(info), None) => {
                    let mut latency = new_latency_histogram();
                    // Same bounds on both sides: cannot fail.
                    let _ = latency.add(&p.replace_latency);
                    out.replacement = Some(ReplacementSnapshot {
                        info,
                        counters: p.replace_counters,
                        latency,
                    });
                }
                (Some(info), Some(r)) => {
                    if info.serial > r.info.serial {
                        // A reactor already on a newer replacement: that one is current.
                        r.info = info;
                    } else if info.serial == r.info.serial {
                        r.info.state = merge_replace(r.info.state, info.state);
                    }
                    r.counters.add(&p.replace_counters);
                    let _ = r.latency.add(&p.replace_latency);
                }
            }
            out.stats.add(&p.stats);
            out.writes_held += p.writes_held;
            for (o, h) in out.queue_wait.iter_mut().zip(&p.queue_wait) {
                // Same bounds on both sides: cannot fail.
                let _ = o.add(h);
            }
            if out.control_error.is_none() {
                out.control_error.clone_from(&p.control_error);
            }
            for (o, m) in out.members.iter_mut().zip(&p.members) {
                o.state = merge_state(o.state, m.state);
                o.counters.add(&m.counters);
                o.qos.merge(&m.qos);
                // Same bounds on both sides: cannot fail.
                let _ = o.latency.add(&m.latency);
            }
        }
        if !all_have_replace {
            // Not every reactor has taken the command yet: still starting.
            if let Some(r) = &mut out.replacement {
                if r.info.state == ReplaceState::Done {
                    r.info.state = ReplaceState::Copying;
                }
            }
        }
        if let Some(r) = &mut out.replacement {
            if r.info.state == ReplaceState::Copying
                && self.shared.replace_copied.load(Ordering::Acquire) == r.info.serial
            {
                r.info.state = ReplaceState::Copied;
            }
        }
        out
    }

    /// Each reactor's loop counters, in reactor order, as last published (at most
    /// [`PUBLISH_INTERVAL`] old).
    pub fn reactor_loads(&self) -> Vec<ReactorLoad> {
        self.each_published(|p| p.load)
    }

    /// `f` of what each reactor last published, in reactor order.
    fn each_published<T>(&self, f: impl Fn(&Published) -> T) -> Vec<T> {
        self.shared
            .published
            .iter()
            .map(|p| f(&p.lock().unwrap_or_else(std::sync::PoisonError::into_inner)))
            .collect()
    }
}

/// Merges one replacement's state over reactors: failed wins, done only when both are.
fn merge_replace(a: ReplaceState, b: ReplaceState) -> ReplaceState {
    match (a, b) {
        (ReplaceState::Failed(e), _) | (_, ReplaceState::Failed(e)) => ReplaceState::Failed(e),
        (ReplaceState::Done, ReplaceState::Done) => ReplaceState::Done,
        // A shard never reports `Copied` (the snapshot does); `Done` alone is not all.
        _ => ReplaceState::Copying,
    }
}

/// How a reactor waits when idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Busy-poll: never sleeps.
    Polled,
    /// Spin briefly, then sleep with growing naps up to [`ADAPTIVE_MAX_SLEEP`].
    Adaptive,
}

/// Reactor layout.
#[derive(Clone, Debug)]
pub struct ReactorConfig {
    /// CPU core of each reactor (one reactor per entry); `None` entries are not pinned.
    pub cores: Vec<Option<usize>>,
    /// Idle behaviour.
    pub mode: Mode,
    /// Array requests in flight per reactor (its parent table).
    pub requests: usize,
    /// With several reactors: a reactor serves reads of stripes another reactor owns
    /// itself (foreign reads, [`crate::shard::StripeGate`]) instead of sending them to the
    /// owner; the owner still orders them against its writes. `false` sends every piece
    /// to its owner (for comparison).
    pub foreign_reads: bool,
}

/// The zero map of an array over `devices` (member order) at start: from each member's
/// allocation over its data area ([`BlockDevice::allocated`]); every stripe "data" unless
/// all members can tell. Blocking (a few `lseek(2)` per member extent); runs once, before
/// the reactors start.
fn zero_map_of<D: BlockDevice>(
    devices: &[D],
    geo: &ArrayGeometry,
    data_offset: u64,
) -> Arc<ZeroMap> {
    let area = data_offset..data_offset.saturating_add(geo.member_data_bytes());
    let allocated: Vec<_> = devices.iter().map(|d| d.allocated(area.clone())).collect();
    let map = ZeroMap::from_allocation(geo, data_offset, &allocated);
    tracing::debug!(
        stripes = map.stripes(),
        zero = map.zero_stripes(),
        "zero map from the members' allocation"
    );
    Arc::new(map)
}

/// Something that submits array requests on a reactor (NBD connection, load generator).
pub trait Frontend: Send + 'static {
    /// Called every loop turn: submit requests through `io`. Returns whether it did anything.
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool;
    /// A request this front-end submitted has finished (`tag` is the front-end's).
    fn complete(&mut self, c: ArrayCompletion);
    /// Whether the front-end has nothing more to do and never will (once true it must stay
    /// true): the reactors stop once asked to, every front-end is finished and no request is
    /// in flight anywhere.
    fn finished(&self) -> bool;
}

/// Why reactors could not start.
#[derive(Debug, Error)]
pub enum ReactorError {
    /// A member channel could not be opened on a reactor.
    #[error("reactor {reactor}: {source}")]
    Device {
        /// The reactor.
        reactor: usize,
        /// The device error.
        source: DeviceError,
    },
    /// The array shard could not be built.
    #[error("reactor {reactor}: {source}")]
    Array {
        /// The reactor.
        reactor: usize,
        /// Why.
        source: ArrayBuildError,
    },
    /// The configuration names no reactor, or front-ends do not match the reactors.
    #[error("{0}")]
    Config(String),
    /// A reactor thread could not be spawned.
    #[error("spawning reactor thread: {0}")]
    Spawn(std::io::Error),
}

/// One reactor's ends of the rings between reactors: `out[to]` sends to reactor `to`,
/// `inbox[from]` receives from reactor `from` (`None` at its own index).
struct Links {
    out: Vec<Option<rtrb::Producer<Msg>>>,
    inbox: Vec<Option<rtrb::Consumer<Msg>>>,
    /// Receivers this turn sent to (to wake, in adaptive mode).
    sent: Vec<bool>,
}

/// Messages a reactor's turn produced, per receiving reactor, in the order produced; sent
/// at the end of the turn, each receiver's batch with one ring commit ([`Outbox::flush`]).
struct Outbox {
    to: Vec<VecDeque<Msg>>,
    /// [`Msg::Piece`]s pushed since start ([`ReactorLoad::pieces_sent`]).
    pieces: u64,
}

impl Outbox {
    /// Empty queues for `reactors` receivers other than reactor `me`, room for `capacity`
    /// messages in all before they grow (none for `me`: a reactor never messages itself).
    fn new(me: usize, reactors: usize, capacity: usize) -> Self {
        // Split between the receivers, as one queue of `capacity` was; a skewed turn grows
        // a queue once, and it keeps that capacity.
        let each = (capacity / reactors.saturating_sub(1).max(1)).max(64);
        Self {
            to: (0..reactors)
                .map(|to| VecDeque::with_capacity(if to == me { 0 } else { each }))
                .collect(),
            pieces: 0,
        }
    }

    fn push(&mut self, to: usize, msg: Msg) {
        if matches!(msg, Msg::Piece(_)) {
            self.pieces += 1;
        }
        self.to[to].push_back(msg);
    }

    fn is_empty(&self) -> bool {
        self.to.iter().all(VecDeque::is_empty)
    }

    /// Moves as many queued messages as fit into each receiver's ring, oldest first, and
    /// marks the receivers sent to. One chunk per receiver: the ring's write position (a
    /// cache line the receiver reads) is published once per batch, not once per message,
    /// and consecutive messages share cache lines on their way to the other core. What
    /// does not fit stays queued, in order, for the next turn. Returns whether anything
    /// was sent.
    fn flush(&mut self, links: &mut Links) -> bool {
        let mut any = false;
        for (to, q) in self.to.iter_mut().enumerate() {
            if q.is_empty() {
                continue;
            }
            let ring = links.out[to].as_mut().expect("no ring to oneself");
            let n = ring.slots().min(q.len());
            if n == 0 {
                continue;
            }
            let chunk = ring
                .write_chunk_uninit(n)
                .expect("`slots()` free slots are writable");
            // Only what the ring took leaves the queue (all `n`: the chunk has room).
            let moved = chunk.fill_from_iter(q.iter().copied());
            q.drain(..moved);
            links.sent[to] = true;
            any = true;
        }
        any
    }
}

impl Links {
    /// The rings of `n` reactors, every ordered pair its own: entry `i` is reactor `i`'s.
    fn mesh(n: usize) -> Vec<Links> {
        let mut links: Vec<Links> = (0..n)
            .map(|_| Links {
                out: (0..n).map(|_| None).collect(),
                inbox: (0..n).map(|_| None).collect(),
                sent: vec![false; n],
            })
            .collect();
        for from in 0..n {
            for to in (0..n).filter(|&to| to != from) {
                let (p, c) = rtrb::RingBuffer::new(RING_CAPACITY);
                links[from].out[to] = Some(p);
                links[to].inbox[from] = Some(c);
            }
        }
        links
    }
}

#[derive(Clone, Copy)]
enum Msg {
    /// A piece of a request owned by the receiving reactor; `tag` = (origin, parent), or
    /// a whole request ([`WHOLE_PIECE`]).
    Piece(ArrayRequest),
    /// A piece sent away has finished; `tag` = parent slot on the receiver, or a whole
    /// request's caller tag with [`WHOLE_PIECE`] ([`back_to_origin`]).
    Done(ArrayCompletion),
}

/// Callers' tags below this (2^46) can ride in a piece's tag: [`Io::submit`] sends a
/// request inside one stripe with such a tag as its own one piece, with no parent entry.
/// The front ends keep their tags below it (NBD's context indexes, iSCSI's and NVMe/TCP's
/// marker bits 45 and 44).
pub const WHOLE_TAG_LIMIT: u64 = 1 << 46;

/// Bit 46 of a piece's tag: the piece is its whole request, and the bits below it are the
/// caller's tag (below [`WHOLE_TAG_LIMIT`]), not a parent slot: its completion goes to
/// the front end as it is, with no parent entry to fill, count down and free. Outside the
/// fields [`split_tag`] reads for a parent slot, and below the origin's.
const WHOLE_PIECE: u64 = WHOLE_TAG_LIMIT;

/// Bit 47 of a piece's tag: its request is not a bulk-sized write ([`waits_on_turns`]),
/// so the reactor that receives it notes its thread's [`TurnHold`]. Outside the fields
/// [`split_tag`] reads.
const UNBULK_PIECE: u64 = 1 << 47;

/// Tag of a piece executing on some reactor: origin reactor in the high 16 bits, the
/// origin's parent slot in the low 32, and [`UNBULK_PIECE`] when `unbulk`.
fn piece_tag(origin: usize, parent: u32, unbulk: bool) -> u64 {
    ((origin as u64) << 48) | u64::from(parent) | if unbulk { UNBULK_PIECE } else { 0 }
}

/// Whether a request (not a flush) that changes the array when `writes`, of `len_bytes`,
/// keeps the per-turn bulk bound of the shards it waits for: all but a bulk-sized write
/// ([`crate::array::RequestClass::bulk_sized_write`]; [`Io::note_arrival`]).
#[inline]
fn waits_on_turns(writes: bool, len_bytes: u64) -> bool {
    !crate::array::RequestClass::bulk_sized_write(writes, len_bytes)
}

fn split_tag(tag: u64) -> (usize, u32) {
    ((tag >> 48) as usize, (tag & 0xffff_ffff) as u32)
}

/// What finished piece `c` tells its origin ([`Msg::Done`], or [`account`] there): the
/// parent slot, or the caller's tag with [`WHOLE_PIECE`].
#[inline]
fn back_to_origin(c: ArrayCompletion) -> ArrayCompletion {
    ArrayCompletion {
        tag: c.tag & (WHOLE_PIECE | (WHOLE_TAG_LIMIT - 1)),
        status: c.status,
    }
}

struct Parent {
    tag: u64,
    remaining: u32,
    error: Option<ArrayError>,
}

/// The request side of a reactor, handed to its front-end each turn.
pub struct Io<'a, C: Channel> {
    me: usize,
    geo: &'a ArrayGeometry,
    array: &'a mut Array<C>,
    local: &'a mut VecDeque<ArrayRequest>,
    outbox: &'a mut Outbox,
    parents: &'a mut Vec<Option<Parent>>,
    free: &'a mut Vec<u32>,
    reactors: usize,
    /// Reads of other reactors' stripes are served here ([`ReactorConfig::foreign_reads`]).
    foreign_reads: bool,
    done: &'a mut VecDeque<ArrayCompletion>,
    /// This reactor's count of requests in flight ([`Shared::in_flight`]).
    in_flight: &'a AtomicUsize,
    /// The thread's record of requests that are not bulk writes, and this turn's raw
    /// clock reading to note in it.
    hold: &'a TurnHold,
    turn_raw: u64,
}

impl<C: Channel> Io<'_, C> {
    /// This reactor's clock at the start of the current turn: nanoseconds since the
    /// reactor started (the array's clock, [`Array::now_ns`]). A front end that needs the
    /// time once per poll reads it here instead of reading a clock of its own.
    pub fn now_ns(&self) -> u64 {
        self.array.now_ns()
    }

    /// Block status of array bytes `[offset_bytes, offset_bytes + len_bytes)` (clipped to
    /// the array), from the array's [`ZeroMap`]: `extent(len_bytes, zero)` for each run in
    /// order (`zero`: reads as zeroes; else data), adjacent runs merged, until the range
    /// ends or `extent` returns `false`. Answered at once from shared state, on any
    /// reactor, with no array request and no allocation; a write that has completed is
    /// never reported as zero, one in flight may be either.
    pub fn block_status(
        &self,
        offset_bytes: u64,
        len_bytes: u64,
        extent: impl FnMut(u64, bool) -> bool,
    ) {
        match self.array.zero_map() {
            Some(z) => z.extents(offset_bytes, len_bytes, extent),
            None => {
                let cap = self.geo.capacity_bytes();
                let end = offset_bytes.saturating_add(len_bytes).min(cap);
                if offset_bytes < end {
                    let mut extent = extent;
                    extent(end - offset_bytes, false);
                }
            }
        }
    }

    /// Notes a request the front end has received and will submit, now or once it has
    /// room (a buffer, a request slot): `writes`, it changes the array (a write,
    /// write-zeroes, discard, compare-and-write); `len_bytes`, its length (0 where not
    /// known). Every request but a bulk-sized write (`writes` and at least
    /// [`crate::array::BULK_MIN_BYTES`]) keeps the per-turn bulk bound of every shard
    /// this thread runs for [`TURN_BOUND_HOLD_NS`] ([`Array::set_turn_bound_held`]): it
    /// waits for their turns. Front ends call it when they parse a command, before it
    /// waits for a buffer or a request slot: every command that reaches the array but a
    /// flush (iSCSI: every SCSI command but SYNCHRONIZE CACHE, as those served without
    /// the array wait for the turn too); [`Self::submit`] notes its request again. A
    /// store to a cell of this thread's own: no lock, no shared line.
    #[inline]
    pub fn note_arrival(&self, writes: bool, len_bytes: u64) {
        if waits_on_turns(writes, len_bytes) {
            self.hold.note(self.turn_raw);
        }
    }

    /// Submits an array request; its completion reaches the front-end's `complete`. With
    /// more than one reactor, a request (not a flush) inside one stripe whose tag is below
    /// [`WHOLE_TAG_LIMIT`] goes out as its own one piece ([`WHOLE_PIECE`]); any other
    /// takes a parent entry that collects its pieces' outcomes.
    ///
    /// # Errors
    /// [`ArrayError::QueueFull`] when this reactor has as many requests in flight as its
    /// parent table has entries (wait for completions); malformed requests complete with
    /// [`ArrayError::Invalid`].
    pub fn submit(&mut self, r: ArrayRequest) -> Result<(), ArrayError> {
        let unbulk = !r.op.is_flush() && waits_on_turns(r.op.is_write(), u64::from(r.len_bytes));
        if unbulk {
            self.hold.note(self.turn_raw);
        }
        if self.reactors == 1 {
            return self.submit_whole(r);
        }
        // Requests in flight are bounded by the parent table's size, whether or not they
        // take an entry: entries in use never exceed the count (an entry is freed before
        // its request's completion is delivered), so one is free below.
        if self.in_flight.load(Ordering::Relaxed) >= self.parents.len() {
            return Err(ArrayError::QueueFull);
        }
        // Counted until the completion reaches the front-end (see the stop rule).
        count_in_flight(self.in_flight, 1);
        // Validated once, here: the shards take the pieces unchecked
        // (`Array::submit_piece`).
        let invalid = self.array.validate(&r).err();
        if let Some(e) = invalid {
            // Refused: done now, no piece sent, no parent entry.
            self.done.push_back(ArrayCompletion {
                tag: r.tag,
                status: Err(e),
            });
            return Ok(());
        }
        // Inside one stripe (most small requests): the request is its own one piece, as
        // `one_piece` would cut it.
        let single = if r.op.is_flush() {
            None
        } else {
            self.geo.single_stripe(r.offset_bytes, r.len_bytes)
        };
        if let Some(stripe) = single.filter(|_| r.tag < WHOLE_TAG_LIMIT) {
            // Under its caller's tag: no parent entry.
            let whole = ArrayRequest {
                tag: piece_tag(self.me, 0, unbulk) | WHOLE_PIECE | r.tag,
                ..r
            };
            self.route_in(stripe, whole);
            return Ok(());
        }
        let p = self
            .free
            .pop()
            .expect("a parent entry is free while fewer requests than entries are in flight");
        let tagged = ArrayRequest {
            tag: piece_tag(self.me, p, unbulk),
            ..r
        };
        let mut remaining = 0;
        if r.op.is_flush() {
            for owner in 0..self.reactors {
                self.route(owner, tagged);
                remaining += 1;
            }
        } else if let Some(stripe) = single {
            // Inside one stripe, but a caller's tag at or above the limit: under a parent
            // entry.
            self.route_in(stripe, tagged);
            remaining = 1;
        } else {
            for piece in split(tagged, self.geo, self.reactors) {
                self.route(piece.owner, piece.request);
                remaining += 1;
            }
        }
        // Stored with a constant `error: None` (a valid request has no error yet), not
        // copied from a `Parent` assembled on the stack: that copy read a narrow store
        // back with a wide load and stalled on store-to-load forwarding, every request.
        // No piece can be accounted before this: `account` runs only in the reactor's
        // `receive` and `drive_array`, never while the front-end holds this `Io`.
        debug_assert!(remaining > 0, "a valid request has at least one piece");
        self.parents[p as usize] = Some(Parent {
            tag: r.tag,
            remaining,
            error: None,
        });
        Ok(())
    }

    /// [`Self::submit`] with one reactor: its shard owns every stripe, so the request is
    /// its own one piece and goes to the shard under the caller's tag — no parent entry to
    /// fill and account on completion ([`Reactor::drive_array`] hands the shard's
    /// completions straight to the front-end). The parent table's size still bounds the
    /// requests in flight.
    fn submit_whole(&mut self, r: ArrayRequest) -> Result<(), ArrayError> {
        debug_assert_eq!(self.reactors, 1);
        // Only this reactor writes its count (`count_in_flight`).
        if self.in_flight.load(Ordering::Relaxed) >= self.parents.len() {
            return Err(ArrayError::QueueFull);
        }
        count_in_flight(self.in_flight, 1);
        // Validated once, here: the shard takes it unchecked (`Array::submit_piece`).
        match self.array.validate(&r) {
            Ok(()) => self.submit_local(r),
            Err(e) => self.done.push_back(ArrayCompletion {
                tag: r.tag,
                status: Err(e),
            }),
        }
        Ok(())
    }

    /// Hands a validated piece to this reactor's shard: at once when nothing submitted
    /// earlier still waits in `local` for room there (`submit_piece` only accepts it; the
    /// shard runs it in this turn's `process`, as it would from `local`), else behind
    /// those in `local`, which [`Reactor::drive_array`] takes in order.
    fn submit_local(&mut self, r: ArrayRequest) {
        if !(self.local.is_empty() && self.array.submit_piece(r).is_ok()) {
            self.local.push_back(r);
        }
    }

    /// [`Self::route`] for a piece of `stripe`, working out the owner only when the piece
    /// is not a read served here whoever owns the stripe (foreign reads).
    fn route_in(&mut self, stripe: u64, r: ArrayRequest) {
        if self.foreign_reads && r.op.is_read() {
            self.submit_local(r);
        } else {
            self.route(owner(stripe, self.reactors), r);
        }
    }

    /// Sends a piece to the shard that serves it: this reactor's for its own stripes and,
    /// with foreign reads on, for reads of any stripe; the owner's otherwise.
    fn route(&mut self, owner: usize, r: ArrayRequest) {
        if owner == self.me || (self.foreign_reads && r.op.is_read()) {
            self.submit_local(r);
        } else {
            self.outbox.push(owner, Msg::Piece(r));
        }
    }
}

/// State every reactor shares for an orderly stop: a reactor may only leave once no other
/// reactor can send it work, i.e. once every front-end is finished and no request is in
/// flight anywhere.
struct Shared {
    stop: AtomicBool,
    /// Front-ends that reported `finished` (each counted once; finished is final).
    finished: AtomicUsize,
    /// Per reactor: array requests its front-end submitted and that have not yet completed
    /// (written by that reactor alone, each on its own cache line: no line bounces between
    /// cores on every request).
    in_flight: Box<[CachePadded<AtomicUsize>]>,
    /// The reactor threads hosting this array's shards (shared with every other array
    /// on the same [`ReactorSet`]): for unparking.
    host: Arc<HostShared>,
    /// Each reactor's control ring.
    control: Vec<ArrayQueue<Control>>,
    /// What each reactor last published.
    published: Vec<Mutex<Published>>,
    /// Members of the array.
    members: u16,
    geo: ArrayGeometry,
    /// Data offset on every member, bytes.
    data_offset: u64,
    /// The member device type (for replacement devices).
    device_type: std::any::TypeId,
    /// Per member slot: reactors whose shard has rebuilt it on all its stripes.
    rebuilt: Vec<AtomicUsize>,
    /// Serial of the last replacement started ([`ReactorHandle::start_replace`]).
    replace_serial: AtomicU64,
    /// Reactors whose shard has finished the current replacement.
    replaced: AtomicUsize,
    /// The replacement takes its slot only on [`ReactorHandle::complete_replace`]
    /// ([`Extras::confirm_replace`]), not as soon as every reactor has copied it.
    confirm_replace: bool,
    /// Serial of the replacement every reactor has copied and that waits for
    /// [`ReactorHandle::complete_replace`] (0: none).
    replace_copied: AtomicU64,
    /// Per reactor: the failures of its shard the caller has recorded durably
    /// ([`ReactorHandle::failures_recorded`]); each shard holds its write completions
    /// while its own count of failures is ahead ([`Extras::confirm_failures`]).
    failures_recorded: Vec<Arc<AtomicU64>>,
    /// Called after a reactor has published a failure to record, or writes it holds for
    /// one ([`ReactorHandle::watch_failures`]).
    failure_watcher: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// When the reactors started (the handle's clock for rates).
    epoch: Instant,
    /// Stripes known to read as zeroes (block status), shared with every shard.
    zero_map: Arc<ZeroMap>,
    /// Rate of the current process (handle side only; never locked by a reactor).
    rate: Mutex<RateWindow>,
}

/// Adds `delta` to a reactor's own in-flight count: only that reactor writes it, so a load
/// and a store do (no locked read-modify-write); readers on other threads load it.
fn count_in_flight(c: &AtomicUsize, delta: isize) {
    let v = c.load(Ordering::Relaxed);
    let next = v
        .checked_add_signed(delta)
        .expect("in-flight count stays in range");
    c.store(next, Ordering::Release);
}

impl Shared {
    /// Requests in flight over every reactor. Once every front-end is finished no count can
    /// grow again, so a sum of zero read one counter at a time is final (the stop rule).
    fn requests_in_flight(&self) -> usize {
        self.in_flight
            .iter()
            .map(|c| c.load(Ordering::Acquire))
            .sum()
    }

    /// Queues a control message for reactor `to` (waiting out a full ring: commands are
    /// rare and reactors drain their ring every turn) and wakes it.
    fn send_control(&self, to: usize, mut c: Control) {
        while let Err(back) = self.control[to].push(c) {
            c = back;
            self.wake(to);
            std::thread::yield_now();
        }
        self.wake(to);
    }

    /// Wakes reactor `to` if it is parked (adaptive mode), after work was queued for it.
    fn wake(&self, to: usize) {
        self.host.wake(to);
    }
}

impl Shared {
    /// The state of `n` reactors serving an array of geometry `geo` whose data starts at
    /// `data_offset` bytes on members of type `device_type`; `resumed`: a replace is
    /// resumed at start ([`RESUMED_REPLACE_SERIAL`]). `confirm_replace` starts false. Each reactor's published member
    /// states start as `initial` ([`ArrayConfig::initial_member_states`]), so a snapshot
    /// taken before a reactor's first publication does not report a member being rebuilt
    /// (or failed) as online — the management layer would record it in sync.
    fn new(
        host: Arc<HostShared>,
        geo: ArrayGeometry,
        data_offset: u64,
        device_type: std::any::TypeId,
        resumed: bool,
        zero_map: Arc<ZeroMap>,
        initial: &[MemberState],
    ) -> Self {
        debug_assert_eq!(initial.len(), usize::from(geo.geometry().members()));
        let n = host.reactors();
        Shared {
            zero_map,
            stop: AtomicBool::new(false),
            finished: AtomicUsize::new(0),
            in_flight: (0..n)
                .map(|_| CachePadded::new(AtomicUsize::new(0)))
                .collect(),
            host,
            control: (0..n).map(|_| ArrayQueue::new(CONTROL_CAPACITY)).collect(),
            published: (0..n)
                .map(|_| {
                    Mutex::new(Published {
                        stats: ArrayStats::default(),
                        members: initial
                            .iter()
                            .map(|&state| MemberSnapshot {
                                state,
                                ..MemberSnapshot::online()
                            })
                            .collect(),
                        process: None,
                        control_error: None,
                        replace: None,
                        replace_counters: MemberCounters::default(),
                        replace_latency: new_latency_histogram(),
                        queue_wait: std::array::from_fn(|_| new_latency_histogram()),
                        load: ReactorLoad::default(),
                        failures: 0,
                        writes_held: 0,
                    })
                })
                .collect(),
            members: geo.geometry().members(),
            geo,
            data_offset,
            device_type,
            rebuilt: (0..geo.geometry().members())
                .map(|_| AtomicUsize::new(0))
                .collect(),
            replace_serial: AtomicU64::new(if resumed { RESUMED_REPLACE_SERIAL } else { 0 }),
            replaced: AtomicUsize::new(0),
            confirm_replace: false,
            replace_copied: AtomicU64::new(0),
            failures_recorded: (0..n).map(|_| Arc::new(AtomicU64::new(0))).collect(),
            failure_watcher: OnceLock::new(),
            epoch: Instant::now(),
            rate: Mutex::new(RateWindow::new(RATE_WINDOW.as_nanos() as u64)),
        }
    }
}

/// What [`Reactors::start_with`] adds to a plain start.
pub struct Extras<P> {
    /// Makes each reactor's pacer (`pacer(reactor index)`, on the reactor's thread).
    pub pacer: P,
    /// The array's write-intent bitmap, if it has one (reactor 0 owns it).
    pub bitmap: Option<Arc<WriteIntent>>,
    /// The array's Partial Parity Log, if it has one (RAID5; attached to every shard,
    /// [`Array::attach_ppl`]; recovered and re-initialised before the reactors start).
    pub ppl: Option<Arc<crate::ppl::PplShared>>,
    /// A replace to resume ([`Array::start_replace`] on every shard before its first
    /// request, serial [`RESUMED_REPLACE_SERIAL`]): from the very first write, every write
    /// to the member reaches the replacement, which holds the member's data below
    /// `resume_stripe` and must not miss one.
    pub replace: Option<ResumeReplace>,
    /// A replacement copied on every reactor waits ([`ReplaceState::Copied`], writes
    /// still reaching both devices) until [`ReactorHandle::complete_replace`] swaps it
    /// in, instead of swapping at once. A caller that records the swap durably (the
    /// target's superblocks) sets it and records first: otherwise a crash between the
    /// swap and the record restarts on the old device, which missed the writes made
    /// after the swap, and the resumed replace copies its stale data over the new ones.
    pub confirm_replace: bool,
    /// Each shard holds the completions of writes finished while a member or replacement
    /// failure it saw is not yet recorded ([`Array::hold_writes_until_recorded`]), until
    /// the caller records it and says so with [`ReactorHandle::failures_recorded`]. A
    /// caller that records failures durably (the target's superblocks) sets it: otherwise
    /// a crash before the record reassembles with the failed member as current, and its
    /// stale chunks stand for writes acknowledged without it (md's `MD_SB_CHANGE_PENDING`).
    pub confirm_failures: bool,
}

/// Each reactor's count of failures to record, as published
/// ([`ReactorHandle::failure_marks`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FailureMarks(Vec<u64>);

impl FailureMarks {
    /// Failures counted over every reactor (one member failed on `n` shards counts `n`).
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

/// A replace found in progress at assembly ([`Extras::replace`]).
pub struct ResumeReplace {
    /// The member being replaced.
    pub member: u16,
    /// The replacement device: an `Arc<D>` of the reactors' device type.
    pub device: Arc<dyn Any + Send + Sync>,
    /// Stripes already copied (its `recovery_offset`).
    pub resume_stripe: u64,
}

/// The serial of a replace resumed at start ([`Extras::replace`]); later ones count up.
pub const RESUMED_REPLACE_SERIAL: u64 = 1;

/// Running reactors of one array; [`Reactors::stop`] stops its shards and returns their
/// front-ends. The shards run on the threads of a [`ReactorSet`]: one of its own
/// ([`Reactors::start`]) or one shared with other arrays ([`Reactors::start_on`]).
pub struct Reactors<F: Frontend> {
    shared: Arc<Shared>,
    /// Each shard's front-end (or setup error) when it stops, tagged with its reactor.
    results: Mutex<std::sync::mpsc::Receiver<(usize, Result<F, ReactorError>)>>,
    /// The set these reactors started for themselves ([`Reactors::start`]): shut down with
    /// them. `None` on a shared set.
    own: Option<ReactorSet>,
}

impl<F: Frontend> Reactors<F> {
    /// Starts one reactor per entry of `cfg.cores`, each with its own channel to every device
    /// in `devices` (member order) and one front-end from `frontends`.
    ///
    /// # Errors
    /// [`ReactorError`] if the configuration is inconsistent or a thread cannot start.
    /// Channel or shard construction errors surface from [`Reactors::stop`].
    pub fn start<D>(
        devices: Arc<Vec<D>>,
        geo: ArrayGeometry,
        parity: Parity,
        array_cfg: ArrayConfig,
        cfg: ReactorConfig,
        frontends: Vec<F>,
    ) -> Result<Self, ReactorError>
    where
        D: BlockDevice + Send + Sync + 'static,
    {
        Self::start_with_pacers(devices, geo, parity, array_cfg, cfg, frontends, |_| {
            Box::new(Unpaced)
        })
    }

    /// As [`Self::start`], with each reactor's shard admitting background work through
    /// the pacer `pacer(reactor index)` makes for it (called on the reactor's own thread,
    /// once, before its loop starts).
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_with_pacers<D, P>(
        devices: Arc<Vec<D>>,
        geo: ArrayGeometry,
        parity: Parity,
        array_cfg: ArrayConfig,
        cfg: ReactorConfig,
        frontends: Vec<F>,
        pacer: P,
    ) -> Result<Self, ReactorError>
    where
        D: BlockDevice + Send + Sync + 'static,
        P: Fn(usize) -> Box<dyn Pacer> + Send + Sync + 'static,
    {
        Self::start_with(
            devices,
            geo,
            parity,
            array_cfg,
            cfg,
            frontends,
            Extras {
                pacer,
                bitmap: None,
                ppl: None,
                replace: None,
                confirm_replace: false,
                confirm_failures: false,
            },
        )
    }

    /// [`Reactors::start`] for an array with a write-intent bitmap: every shard gets
    /// `bitmap` attached ([`Array::attach_bitmap`]), reactor 0 as its owner (it writes the
    /// bitmap sectors and runs the clearing daemon, and wakes the others when bits become
    /// durable). The reactors stop only once the owner's last bitmap write completed.
    ///
    /// # Errors
    /// As [`Reactors::start`].
    pub fn start_with_bitmap<D>(
        devices: Arc<Vec<D>>,
        geo: ArrayGeometry,
        parity: Parity,
        array_cfg: ArrayConfig,
        cfg: ReactorConfig,
        frontends: Vec<F>,
        bitmap: Option<Arc<WriteIntent>>,
    ) -> Result<Self, ReactorError>
    where
        D: BlockDevice + Send + Sync + 'static,
    {
        Self::start_with(
            devices,
            geo,
            parity,
            array_cfg,
            cfg,
            frontends,
            Extras {
                pacer: |_| Box::new(Unpaced) as Box<dyn Pacer>,
                bitmap,
                ppl: None,
                replace: None,
                confirm_replace: false,
                confirm_failures: false,
            },
        )
    }

    /// [`Reactors::start`] with every option: a pacer per reactor and a write-intent
    /// bitmap ([`Extras`]). The reactors are a [`ReactorSet`] of their own on
    /// `cfg.cores` in `cfg.mode`, shut down by [`Reactors::stop`].
    ///
    /// # Errors
    /// As [`Reactors::start`].
    pub fn start_with<D, P>(
        devices: Arc<Vec<D>>,
        geo: ArrayGeometry,
        parity: Parity,
        array_cfg: ArrayConfig,
        cfg: ReactorConfig,
        frontends: Vec<F>,
        extras: Extras<P>,
    ) -> Result<Self, ReactorError>
    where
        D: BlockDevice + Send + Sync + 'static,
        P: Fn(usize) -> Box<dyn Pacer> + Send + Sync + 'static,
    {
        let n = cfg.cores.len();
        if n == 0 || frontends.len() != n || n > usize::from(u16::MAX) {
            return Err(ReactorError::Config(format!(
                "{} reactors with {} front-ends: need one front-end per reactor, at least one reactor",
                n,
                frontends.len()
            )));
        }
        let set = ReactorSet::start(&cfg.cores, cfg.mode)?;
        let mut r = Self::start_on(
            &set, devices, geo, parity, array_cfg, &cfg, frontends, extras,
        )?;
        r.own = Some(set);
        Ok(r)
    }

    /// Starts the array's shards on the reactors of `set`, which may already serve other
    /// arrays: one shard per reactor of the set, each with its own channel to every device
    /// in `devices` (member order), front-end `frontends[reactor]`, and what `extras`
    /// adds. The other arrays' I/O goes on meanwhile (each reactor builds the shard —
    /// opens its channels, allocates its buffers — between two turns of its loop).
    /// `cfg.cores` and `cfg.mode` are not used (the set's are); `cfg.requests` and
    /// `cfg.foreign_reads` are this array's.
    ///
    /// Two arrays on one set must not share a member device: the pacer and the depth
    /// controller are per shard and member, so two arrays on one device would each
    /// believe they have it alone (the caller refuses that: member devices are locked
    /// per array).
    ///
    /// # Errors
    /// [`ReactorError::Config`] when `frontends` does not give one front-end per reactor
    /// of the set, or the set is shutting down. Channel or shard construction errors
    /// surface from [`Reactors::stop`].
    #[allow(clippy::too_many_arguments)]
    pub fn start_on<D, P>(
        set: &ReactorSet,
        devices: Arc<Vec<D>>,
        geo: ArrayGeometry,
        parity: Parity,
        array_cfg: ArrayConfig,
        cfg: &ReactorConfig,
        frontends: Vec<F>,
        extras: Extras<P>,
    ) -> Result<Self, ReactorError>
    where
        D: BlockDevice + Send + Sync + 'static,
        P: Fn(usize) -> Box<dyn Pacer> + Send + Sync + 'static,
    {
        let Extras {
            pacer,
            bitmap,
            ppl,
            replace,
            confirm_replace,
            confirm_failures,
        } = extras;
        let replace = replace.map(Arc::new);
        let pacer = Arc::new(pacer);
        let n = set.reactors();
        if frontends.len() != n {
            return Err(ReactorError::Config(format!(
                "{} front-ends for a set of {n} reactors: need one front-end per reactor",
                frontends.len()
            )));
        }
        if cfg.requests == 0 || cfg.requests > u32::MAX as usize {
            return Err(ReactorError::Config(format!(
                "{} requests in flight: need 1..=2^32-1",
                cfg.requests
            )));
        }
        if set.host.stop.load(Ordering::Acquire) {
            return Err(ReactorError::Config(
                "the reactor set is shutting down".into(),
            ));
        }
        let mut links = Links::mesh(n).into_iter();
        let mut shared = Shared::new(
            Arc::clone(&set.host),
            geo,
            array_cfg.data_offset_bytes,
            std::any::TypeId::of::<D>(),
            replace.is_some(),
            zero_map_of(&devices, &geo, array_cfg.data_offset_bytes),
            &array_cfg.initial_member_states(geo.geometry().members()),
        );
        shared.confirm_replace = confirm_replace;
        let shared = Arc::new(shared);
        // Foreign reads need more than one reactor; every slot counts at most the stripe
        // operations of all reactors and as many fast-path reads (`Array::submit`).
        let gate = (n > 1 && cfg.foreign_reads).then(|| {
            StripeGate::new(
                GATE_SLOTS,
                2 * n * (array_cfg.stripe_ops + array_cfg.background_ops),
                geo.geometry().members(),
            )
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let requests = cfg.requests;
        let foreign_reads = gate.is_some();
        for (me, fe) in frontends.into_iter().enumerate() {
            let devices = Arc::clone(&devices);
            let pacer = Arc::clone(&pacer);
            let my_links = links.next().expect("one link set per reactor");
            let shared = Arc::clone(&shared);
            let bitmap = bitmap.clone();
            let ppl = ppl.clone();
            let gate = gate.clone();
            let replace = replace.clone();
            let tx = tx.clone();
            let build: Adopt = Box::new(move || {
                // Channels are opened here, on the reactor's own thread: no queue pair is
                // ever touched by another thread.
                let built = (|| {
                    let mut chans = Vec::with_capacity(devices.len());
                    for d in devices.iter() {
                        chans.push(d.open_channel().map_err(|source| ReactorError::Device {
                            reactor: me,
                            source,
                        })?);
                    }
                    let mut array =
                        Array::new(geo, chans, parity, array_cfg).map_err(|source| {
                            ReactorError::Array {
                                reactor: me,
                                source,
                            }
                        })?;
                    array.set_pacer(pacer(me));
                    array.set_zero_map(Arc::clone(&shared.zero_map));
                    if let Some(b) = bitmap {
                        array.attach_bitmap(b, me == 0);
                    }
                    if let Some(p) = ppl {
                        array.attach_ppl(p);
                    }
                    if let Some(g) = &gate {
                        array.set_gate(Some(Arc::clone(g)));
                    }
                    if confirm_failures {
                        array.hold_writes_until_recorded(Arc::clone(&shared.failures_recorded[me]));
                    }
                    Ok(array)
                })();
                match built {
                    Ok(array) => Some(HostedShard::<F, D>::boxed(
                        me,
                        n,
                        geo,
                        array,
                        my_links,
                        shared,
                        requests,
                        foreign_reads,
                        fe,
                        replace.as_deref(),
                        tx,
                    )),
                    Err(e) => {
                        // The shard never runs: count its front-end finished (it never
                        // submits) so the other shards can stop, and report why.
                        shared.finished.fetch_add(1, Ordering::AcqRel);
                        let _ = tx.send((me, Err(e)));
                        None
                    }
                }
            });
            set.host.adopt(me, build);
        }
        Ok(Self {
            shared,
            results: Mutex::new(rx),
            own: None,
        })
    }

    /// A handle for management while the reactors run.
    pub fn handle(&self) -> ReactorHandle {
        ReactorHandle {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Asks every shard to stop once its front-end is finished and nothing is in flight,
    /// waits for each, and returns the front-ends in reactor order. Other arrays on the
    /// same set go on; a set of the array's own is shut down.
    ///
    /// # Errors
    /// The first reactor's setup error, if any.
    ///
    /// # Panics
    /// If a reactor thread panicked (a bug; the panic is propagated when the set is the
    /// array's own, otherwise reported as a panic here).
    pub fn stop(self) -> Result<Vec<F>, ReactorError> {
        self.shared.stop.store(true, Ordering::Release);
        let n = self.shared.in_flight.len();
        for to in 0..n {
            self.shared.wake(to);
        }
        let mut out: Vec<Option<Result<F, ReactorError>>> = (0..n).map(|_| None).collect();
        {
            let rx = self
                .results
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for _ in 0..n {
                match rx.recv() {
                    Ok((me, r)) => out[me] = Some(r),
                    Err(_) => break,
                }
            }
        }
        if let Some(set) = self.own {
            // Joins the threads: a panicked reactor's panic is resumed here.
            set.shutdown();
        }
        let mut fronts = Vec::with_capacity(n);
        let mut first_err = None;
        for (me, r) in out.into_iter().enumerate() {
            match r {
                Some(Ok(f)) => fronts.push(f),
                Some(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                None => panic!("reactor {me} ended without stopping its shard (it panicked)"),
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(fronts),
        }
    }
}

/// What a reactor thread is asked to host: run on the thread, it builds the shard (or
/// reports why it could not and returns `None`).
type Adopt = Box<dyn FnOnce() -> Option<Box<dyn Hosted>> + Send>;

/// Capacity of each reactor's queue of shards to adopt (arrays starting at once).
const ADOPT_CAPACITY: usize = 64;

/// A set of reactor threads, one per core, that any number of arrays run their shards on
/// ([`Reactors::start_on`]): an appliance pins its reactors once and starts and stops
/// arrays on them while the others serve. Each thread's loop turns every shard it hosts,
/// one turn each in order, and rests only when none made progress.
pub struct ReactorSet {
    host: Arc<HostShared>,
    threads: Vec<JoinHandle<()>>,
    cores: Vec<Option<usize>>,
}

impl ReactorSet {
    /// Starts one reactor thread per entry of `cores` (`None`: not pinned), idling as
    /// `mode` says. The threads host nothing until an array starts on them.
    ///
    /// # Errors
    /// [`ReactorError::Config`] for no core or more than 65535;
    /// [`ReactorError::Spawn`] when a thread cannot start (the ones started are stopped).
    pub fn start(cores: &[Option<usize>], mode: Mode) -> Result<Self, ReactorError> {
        let n = cores.len();
        if n == 0 || n > usize::from(u16::MAX) {
            return Err(ReactorError::Config(format!(
                "{n} reactors: need 1..=65535"
            )));
        }
        let host = Arc::new(HostShared::new(n, mode));
        let mut set = ReactorSet {
            host,
            threads: Vec::with_capacity(n),
            cores: cores.to_vec(),
        };
        for (me, &core) in cores.iter().enumerate() {
            let host = Arc::clone(&set.host);
            let t = std::thread::Builder::new()
                .name(format!("reactor-{me}"))
                .spawn(move || {
                    let _ = host.threads[me].set(std::thread::current());
                    if let Some(c) = core {
                        core_affinity::set_for_current(core_affinity::CoreId { id: c });
                    }
                    host_loop(me, &host);
                })
                .map_err(ReactorError::Spawn)?;
            set.threads.push(t);
        }
        Ok(set)
    }

    /// Reactors (threads) in the set.
    pub fn reactors(&self) -> usize {
        self.host.reactors()
    }

    /// Each reactor's core, in reactor order (`None`: not pinned).
    pub fn cores(&self) -> &[Option<usize>] {
        &self.cores
    }

    /// Array shards each reactor hosts now, in reactor order.
    pub fn hosted(&self) -> Vec<usize> {
        self.host
            .hosted
            .iter()
            .map(|h| h.load(Ordering::Acquire))
            .collect()
    }

    /// Stops the threads once every array on them has stopped ([`Reactors::stop`]; this
    /// waits for that) and joins them.
    ///
    /// # Panics
    /// If a reactor thread panicked (a bug; the panic is propagated).
    pub fn shutdown(mut self) {
        if let Some(p) = self.stop_threads() {
            std::panic::resume_unwind(p);
        }
    }

    fn stop_threads(&mut self) -> Option<Box<dyn Any + Send>> {
        self.host.stop.store(true, Ordering::Release);
        for to in 0..self.host.reactors() {
            self.host.unpark(to);
        }
        let mut panic = None;
        for t in self.threads.drain(..) {
            if let Err(p) = t.join() {
                panic.get_or_insert(p);
            }
        }
        panic
    }
}

impl Drop for ReactorSet {
    fn drop(&mut self) {
        if self.threads.is_empty() {
            return;
        }
        if self.hosted().iter().any(|&n| n > 0) {
            // Arrays still run on the threads (their owner was dropped without stopping
            // them: an unwinding test, a failed start): joining would wait for stops
            // that never come. The threads end with the process.
            self.host.stop.store(true, Ordering::Release);
            tracing::warn!("reactor set dropped while arrays still run on it: not joined");
            return;
        }
        // A thread's panic is reported by `shutdown`; a plain drop only stops them.
        let _ = self.stop_threads();
    }
}

/// The state a set's reactor threads share with the arrays on them.
struct HostShared {
    /// Each reactor's thread, for unparking (set when the thread starts).
    threads: Vec<OnceLock<Thread>>,
    /// Whether each reactor is (about to be) parked.
    parked: Vec<AtomicBool>,
    /// Shards waiting to be adopted, per reactor.
    adopting: Vec<ArrayQueue<Adopt>>,
    /// Shards each reactor hosts (written by that reactor).
    hosted: Vec<AtomicUsize>,
    /// The set is shutting down: a reactor with no shard left ends.
    stop: AtomicBool,
    mode: Mode,
}

impl HostShared {
    fn new(n: usize, mode: Mode) -> Self {
        HostShared {
            threads: (0..n).map(|_| OnceLock::new()).collect(),
            parked: (0..n).map(|_| AtomicBool::new(false)).collect(),
            adopting: (0..n).map(|_| ArrayQueue::new(ADOPT_CAPACITY)).collect(),
            hosted: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            stop: AtomicBool::new(false),
            mode,
        }
    }

    fn reactors(&self) -> usize {
        self.threads.len()
    }

    /// Wakes reactor `to` if it is parked (adaptive mode), after work was queued for it.
    fn wake(&self, to: usize) {
        // Dekker with the parking side (it stores its flag, then looks at its rings): our
        // queueing store must be visible before we read the flag. A ring push is a plain
        // release store, which a later load may pass; the fence forbids that.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.parked[to].load(Ordering::SeqCst) {
            self.unpark(to);
        }
    }

    fn unpark(&self, to: usize) {
        if let Some(t) = self.threads[to].get() {
            t.unpark();
        }
    }

    /// Queues a shard for reactor `to` to build and host (waiting out a full queue: array
    /// starts are rare and reactors empty it every turn), and wakes it.
    fn adopt(&self, to: usize, mut a: Adopt) {
        while let Err(back) = self.adopting[to].push(a) {
            a = back;
            self.unpark(to);
            std::thread::yield_now();
        }
        self.unpark(to);
    }
}

/// One shard a reactor thread hosts, type-erased over its front-end and device types.
trait Hosted {
    /// One turn of the shard's loop ([`Reactor::turn`]); `hold`: the thread's. Whether it
    /// made progress.
    fn turn(&mut self, hold: &TurnHold) -> bool;
    /// Whether the shard has stopped for good ([`Reactor::stopping`]).
    fn stopping(&mut self) -> bool;
    /// Whether nothing waits in the shard's inbound rings or its management queue (the last
    /// look before a park).
    fn inbox_empty(&self) -> bool;
    /// Hands the stopped shard's front-end to [`Reactors::stop`].
    fn finish(self: Box<Self>);
}

/// A shard hosted by a reactor thread: its loop state, and the array state it borrows.
struct HostedShard<F: Frontend, D: BlockDevice + Send + Sync + 'static> {
    /// Declared before `shared`, so dropped before it: the borrow never outlives the
    /// allocation it points into.
    r: Reactor<'static, F, D>,
    /// Keeps the array's state (which `r` borrows) alive and at one address.
    shared: Arc<Shared>,
    tx: std::sync::mpsc::Sender<(usize, Result<F, ReactorError>)>,
}

impl<F: Frontend, D: BlockDevice + Send + Sync + 'static> HostedShard<F, D> {
    #[allow(clippy::too_many_arguments)]
    fn boxed(
        me: usize,
        reactors: usize,
        geo: ArrayGeometry,
        array: Array<D::Channel>,
        links: Links,
        shared: Arc<Shared>,
        requests: usize,
        foreign_reads: bool,
        fe: F,
        replace: Option<&ResumeReplace>,
        tx: std::sync::mpsc::Sender<(usize, Result<F, ReactorError>)>,
    ) -> Box<dyn Hosted> {
        // SAFETY: `Arc::as_ptr` points at the `Shared` inside the Arc's heap allocation,
        // which does not move and lives as long as any clone of the Arc. The struct built
        // below keeps a clone in `shared` for as long as `r` (the only holder of this
        // reference) exists: `r` is declared first, so it is dropped first, and `finish`
        // drops `r`'s remains before the Arc. The reference is never handed out.
        let sref: &'static Shared = unsafe { &*Arc::as_ptr(&shared) };
        let r = Reactor::<F, D>::new(
            me,
            reactors,
            geo,
            array,
            links,
            sref,
            requests,
            foreign_reads,
            fe,
            replace,
        );
        Box::new(HostedShard { r, shared, tx })
    }
}

impl<F: Frontend, D: BlockDevice + Send + Sync + 'static> Hosted for HostedShard<F, D> {
    fn turn(&mut self, hold: &TurnHold) -> bool {
        self.r.turn(hold)
    }

    fn stopping(&mut self) -> bool {
        self.r.stopping()
    }

    fn inbox_empty(&self) -> bool {
        // The management queue too: a command pushed after this turn's look at it, whose
        // sender read the park flag before we set it, would otherwise wait out the nap.
        self.r.shared.control[self.r.me].is_empty()
            && self
                .r
                .links
                .inbox
                .iter()
                .flatten()
                .all(rtrb::Consumer::is_empty)
    }

    fn finish(self: Box<Self>) {
        let HostedShard { r, shared, tx } = *self;
        let me = r.me;
        // Everything of the shard but its front-end — the array, its channels (queue
        // pairs, a vfio device's files) — is dropped inside `into_frontend`, before the
        // stop is reported: whoever waits in `Reactors::stop` may reopen the devices at
        // once (a flush, a vfio group that admits one opener).
        let fe = r.into_frontend();
        // The borrow of `shared` went with the shard; the Arc may go now.
        drop(shared);
        let _ = tx.send((me, Ok(fe)));
    }
}

/// A reactor thread's loop: adopts new shards, turns every hosted shard, hands stopped
/// ones back, rests when nothing moved, and ends when the set shuts down with no shard
/// left.
fn host_loop(me: usize, host: &HostShared) {
    let mut shards: Vec<Box<dyn Hosted>> = Vec::new();
    let hold = TurnHold::default();
    let mut idle: u32 = 0;
    let mut nap = Duration::from_micros(1);
    loop {
        let mut progress = false;
        while let Some(build) = pop_if_any(&host.adopting[me]) {
            progress = true;
            if let Some(s) = build() {
                shards.push(s);
                host.hosted[me].store(shards.len(), Ordering::Release);
            }
        }
        let mut i = 0;
        while i < shards.len() {
            progress |= shards[i].turn(&hold);
            if shards[i].stopping() {
                shards.swap_remove(i).finish();
                host.hosted[me].store(shards.len(), Ordering::Release);
                progress = true;
            } else {
                i += 1;
            }
        }
        if shards.is_empty() {
            if host.stop.load(Ordering::Acquire) && host.adopting[me].is_empty() {
                return;
            }
            // Nothing to turn until a shard arrives (its sender unparks us) or the set
            // stops: sleep whatever the mode.
            host.parked[me].store(true, Ordering::SeqCst);
            if host.adopting[me].is_empty() && !host.stop.load(Ordering::Acquire) {
                std::thread::park_timeout(Duration::from_millis(100));
            }
            host.parked[me].store(false, Ordering::SeqCst);
            continue;
        }
        // The end of a turn: spins, or parks when idle long enough (adaptive mode).
        if progress {
            idle = 0;
            nap = Duration::from_micros(1);
        } else {
            idle = idle.saturating_add(1);
            match host.mode {
                Mode::Polled => std::hint::spin_loop(),
                Mode::Adaptive if idle < ADAPTIVE_SPINS => std::hint::spin_loop(),
                Mode::Adaptive => {
                    // Announce the park before the last look at the rings: a sender that
                    // pushes after that look sees the flag and unparks us (an unpark
                    // before the park makes it return at once).
                    host.parked[me].store(true, Ordering::SeqCst);
                    if host.adopting[me].is_empty() && shards.iter().all(|s| s.inbox_empty()) {
                        std::thread::park_timeout(nap);
                    }
                    host.parked[me].store(false, Ordering::SeqCst);
                    nap = (nap * 2).min(ADAPTIVE_MAX_SLEEP);
                }
            }
        }
    }
}

/// One reactor driven by the caller's thread, a turn at a time ([`run_local`]): no thread,
/// no rings, no rest between turns, so a front-end runs deterministically against an
/// array (for fuzzing and tests that must not depend on thread timing). A turn is exactly
/// a turn of a running reactor's loop ([`Reactors::start`]) with one reactor.
pub struct LocalReactor<'s, F: Frontend, D: BlockDevice + Send + Sync + 'static> {
    r: Reactor<'s, F, D>,
    hold: TurnHold,
}

impl<F: Frontend, D: BlockDevice + Send + Sync + 'static> LocalReactor<'_, F, D> {
    /// Runs one loop turn (the front-end's `poll`, the shard, completions delivered to the
    /// front-end). Whether anything made progress.
    pub fn turn(&mut self) -> bool {
        self.r.turn(&self.hold)
    }

    /// The front-end.
    pub fn frontend(&self) -> &F {
        &self.r.fe
    }

    /// The front-end, mutably (to hand it work between turns).
    pub fn frontend_mut(&mut self) -> &mut F {
        &mut self.r.fe
    }

    /// Array requests the front-end submitted whose completion it has not yet received.
    pub fn in_flight(&self) -> usize {
        self.r.shared.requests_in_flight()
    }
}

/// Builds one reactor over `devices` (channels opened on the calling thread) with the
/// front-end `fe`, calls `body` with it (`body` drives it with [`LocalReactor::turn`]),
/// and returns what `body` returned and the front-end. `requests`: array requests in
/// flight at once ([`ReactorConfig::requests`]). Background work is unpaced; the shard's
/// clock is the wall clock, as on a running reactor (give `array_cfg` no command timeout
/// and no write hold for runs that must not depend on time).
///
/// # Errors
/// [`ReactorError::Device`] or [`ReactorError::Array`] when a channel or the shard cannot
/// be built; [`ReactorError::Config`] for `requests` = 0.
pub fn run_local<F, D, R>(
    devices: &[D],
    geo: ArrayGeometry,
    parity: Parity,
    array_cfg: ArrayConfig,
    requests: usize,
    fe: F,
    body: impl FnOnce(&mut LocalReactor<'_, F, D>) -> R,
) -> Result<(R, F), ReactorError>
where
    F: Frontend,
    D: BlockDevice + Send + Sync + 'static,
{
    if requests == 0 || requests > u32::MAX as usize {
        return Err(ReactorError::Config(format!(
            "{requests} requests in flight: need 1..=2^32-1"
        )));
    }
    let shared = Shared::new(
        Arc::new(HostShared::new(1, Mode::Polled)),
        geo,
        array_cfg.data_offset_bytes,
        std::any::TypeId::of::<D>(),
        false,
        zero_map_of(devices, &geo, array_cfg.data_offset_bytes),
        &array_cfg.initial_member_states(geo.geometry().members()),
    );
    let mut chans = Vec::with_capacity(devices.len());
    for d in devices {
        chans.push(
            d.open_channel()
                .map_err(|source| ReactorError::Device { reactor: 0, source })?,
        );
    }
    let mut array = Array::new(geo, chans, parity, array_cfg)
        .map_err(|source| ReactorError::Array { reactor: 0, source })?;
    array.set_pacer(Box::new(Unpaced));
    array.set_zero_map(Arc::clone(&shared.zero_map));
    let links = Links::mesh(1)
        .into_iter()
        .next()
        .expect("one reactor's links");
    let mut local = LocalReactor {
        r: Reactor::<F, D>::new(0, 1, geo, array, links, &shared, requests, false, fe, None),
        hold: TurnHold::default(),
    };
    let out = body(&mut local);
    Ok((out, local.r.fe))
}

/// One reactor thread's state between turns of its loop ([`run`]).
struct Reactor<'a, F, D: BlockDevice> {
    me: usize,
    reactors: usize,
    geo: ArrayGeometry,
    array: Array<D::Channel>,
    links: Links,
    shared: &'a Shared,
    foreign_reads: bool,
    fe: F,
    parents: Vec<Option<Parent>>,
    free: Vec<u32>,
    local: VecDeque<ArrayRequest>,
    outbox: Outbox,
    done: VecDeque<ArrayCompletion>,
    comps: Vec<ArrayCompletion>,
    counted_finished: bool,
    clock: TurnClock,
    // Members whose failure this reactor has told the others about.
    announced: Vec<bool>,
    failures_seen: u64,
    /// Whether the shard held write completions at its last look (published at once
    /// when that changes, so status does not show writes waiting that are gone).
    holding_seen: bool,
    /// The failures to record ([`Array::failures_to_record`]) at the last look; a change,
    /// or writes starting to wait, is told to the failure watcher once published.
    to_record_seen: u64,
    tell_watcher: bool,
    next_publish: u64,
    // A replacement the shard could not take yet (requests to the old device outstanding);
    // `true`: a re-add.
    pending_replace: Vec<(u16, D::Channel, bool)>,
    // A replace the shard could not start yet (a device leaving, a process draining):
    // (slot, channel, serial, resume).
    pending_start: Option<(u16, D::Channel, u64, u64)>,
    // The replacement whose finish this reactor has counted.
    reported_replace: u64,
    repl_failures_seen: u64,
    // A member was replaced, or a rebuild finished with one still waiting: start one.
    // Members assembled as being rebuilt resume at once.
    rebuild_pending: bool,
    // Members this reactor has reported rebuilt on its stripes.
    reported_rebuilt: Vec<bool>,
    control_error: Option<ControlError>,
    // The owner wakes the other reactors when bits they may wait for become durable.
    owner_of_bitmap: bool,
    bitmap_gen: u64,
    // The loop's own counters ([`ReactorLoad`]); `pieces_sent` is the outbox's.
    load: ReactorLoad,
    // When the current turn started (array clock, ns) and whether the previous one moved
    // anything: the interval between two turn starts is busy or idle by the earlier turn.
    turn_started_ns: u64,
    last_progress: bool,
}

impl<'a, F: Frontend, D: BlockDevice + Send + Sync + 'static> Reactor<'a, F, D> {
    /// The reactor's state before its first turn; a replace in progress is resumed.
    #[allow(clippy::too_many_arguments)]
    fn new(
        me: usize,
        reactors: usize,
        geo: ArrayGeometry,
        mut array: Array<D::Channel>,
        links: Links,
        shared: &'a Shared,
        requests: usize,
        foreign_reads: bool,
        fe: F,
        replace: Option<&ResumeReplace>,
    ) -> Self {
        let parents: Vec<Option<Parent>> = (0..requests).map(|_| None).collect();
        let free: Vec<u32> = (0..requests as u32).rev().collect();
        let local: VecDeque<ArrayRequest> = VecDeque::with_capacity(requests);
        let outbox = Outbox::new(me, reactors, requests);
        let done: VecDeque<ArrayCompletion> = VecDeque::with_capacity(requests);
        let comps = vec![
            ArrayCompletion {
                tag: 0,
                status: Ok(())
            };
            64
        ];
        let clock = TurnClock::new();
        let members = geo.geometry().members();
        array.set_shard(me, reactors);
        let rebuild_pending = array.pending_rebuild().is_some();
        let mut control_error: Option<ControlError> = None;
        // A replace in progress resumes before the first request (see `Extras::replace`).
        if let Some(r) = replace {
            let started = match Arc::clone(&r.device).downcast::<D>() {
                Err(_) => Err(ControlError::DeviceType { member: r.member }),
                Ok(d) => d
                    .open_channel()
                    .map_err(|e| ControlError::Open {
                        reactor: me,
                        member: r.member,
                        why: e.to_string(),
                    })
                    .and_then(|ch| {
                        array
                            .start_replace(r.member, ch, RESUMED_REPLACE_SERIAL, r.resume_stripe)
                            .map_err(ControlError::from)
                    }),
            };
            control_error = started.err();
        }
        let owner_of_bitmap = me == 0 && reactors > 1;
        let bitmap_gen = array.bitmap().map_or(0, |b| b.generation());
        Self {
            me,
            reactors,
            geo,
            array,
            links,
            shared,
            foreign_reads,
            fe,
            parents,
            free,
            local,
            outbox,
            done,
            comps,
            counted_finished: false,
            clock,
            announced: vec![false; usize::from(members)],
            failures_seen: 0,
            holding_seen: false,
            to_record_seen: 0,
            tell_watcher: false,
            next_publish: 0,
            pending_replace: Vec::new(),
            pending_start: None,
            reported_replace: 0,
            repl_failures_seen: 0,
            rebuild_pending,
            reported_rebuilt: vec![false; usize::from(members)],
            control_error,
            owner_of_bitmap,
            bitmap_gen,
            load: ReactorLoad::default(),
            turn_started_ns: 0,
            last_progress: true,
        }
    }

    /// The front-end; the rest of the shard (array, channels, rings) is dropped before
    /// this returns.
    fn into_frontend(self) -> F {
        let Reactor { fe, .. } = self;
        fe
    }

    /// One turn of the loop, without the rest at its end: the clock, management commands,
    /// the rings, the front-end, the shard, the reports, the messages out and the
    /// completions in. Whether anything made progress.
    fn turn(&mut self, hold: &TurnHold) -> bool {
        let now = self.clock.now_ns();
        self.array.set_now(now);
        self.count_turn(now);
        let mut progress = self.control();
        progress |= self.start_waiting();
        progress |= self.receive(hold);
        progress |= self.front_end(hold);
        let held = hold.held(&self.clock);
        self.load.bound_held_turns += u64::from(held);
        self.array.set_turn_bound_held(held);
        progress |= self.drive_array();
        self.report(now);
        progress |= self.send();
        progress |= self.deliver();
        self.last_progress = progress;
        progress
    }

    /// Counts the turn starting at `now` (array clock, ns) and gives the time since the
    /// previous turn started to busy or idle by whether that turn made progress.
    fn count_turn(&mut self, now: u64) {
        let dt = now.saturating_sub(self.turn_started_ns);
        self.turn_started_ns = now;
        self.load.turns += 1;
        if self.last_progress {
            self.load.busy_ns += dt;
        } else {
            self.load.idle_ns += dt;
        }
    }

    /// Step 0: runs the management commands sent to this reactor. Whether there were any.
    fn control(&mut self) -> bool {
        let mut progress = false;
        let me = self.me;
        // 0. Management commands.
        while let Some(c) = pop_if_any(&self.shared.control[me]) {
            progress = true;
            match c {
                Control::FailMember(m, err) => {
                    // Every reactor gets the command (or already knows): no need to pass
                    // it on.
                    self.announced[usize::from(m)] = true;
                    match err {
                        None => self.array.fail_member_by_operator(m),
                        Some(e) => self.array.fail_member(m, e),
                    }
                }
                Control::StartProcess(req) => {
                    if let Err(e) = self.array.start_process(&req) {
                        self.control_error = Some(e.into());
                    }
                    self.next_publish = 0;
                }
                Control::StopProcess => {
                    self.array.stop_process();
                    self.rebuild_pending = false;
                    self.next_publish = 0;
                }
                Control::ReplaceMember(m, dev, readd) => match dev.downcast::<D>() {
                    Ok(d) => match d.open_channel() {
                        Ok(ch) => self.pending_replace.push((m, ch, readd)),
                        Err(e) => {
                            self.control_error = Some(ControlError::Open {
                                reactor: me,
                                member: m,
                                why: e.to_string(),
                            })
                        }
                    },
                    Err(_) => self.control_error = Some(ControlError::DeviceType { member: m }),
                },
                Control::MemberRebuilt(m) => {
                    self.array.set_member_online(m);
                    self.reported_rebuilt[usize::from(m)] = false;
                    if self
                        .array
                        .member_states()
                        .any(|s| s == MemberState::Rebuilding)
                    {
                        self.rebuild_pending = true;
                    }
                    self.next_publish = 0;
                }
                Control::StartReplace {
                    slot,
                    dev,
                    serial,
                    resume,
                } => match dev.downcast::<D>() {
                    Ok(d) => match d.open_channel() {
                        Ok(ch) => self.pending_start = Some((slot, ch, serial, resume)),
                        Err(e) => {
                            self.control_error = Some(ControlError::Open {
                                reactor: me,
                                member: slot,
                                why: e.to_string(),
                            })
                        }
                    },
                    Err(_) => self.control_error = Some(ControlError::DeviceType { member: slot }),
                },
                Control::FailReplacement { serial, err } => {
                    if self.pending_start.as_ref().is_some_and(|p| p.2 == serial) {
                        self.pending_start = None;
                    }
                    self.array.fail_replacement(serial, err);
                    // Already known everywhere: not announced again.
                    self.repl_failures_seen = self.array.replacement_failures();
                    self.next_publish = 0;
                }
                Control::ReplaceDone { serial } => {
                    self.array.complete_replace(serial);
                    if self
                        .array
                        .member_states()
                        .any(|s| s == MemberState::Rebuilding)
                    {
                        self.rebuild_pending = true;
                    }
                    self.next_publish = 0;
                }
            }
        }
        progress
    }

    /// Starts what the management commands left waiting for the shard: a replace, member
    /// replacements, a rebuild. Whether one started.
    fn start_waiting(&mut self) -> bool {
        let mut progress = false;
        // A replace waiting for the shard: started once nothing is in its way.
        if let Some((slot, ch, serial, resume)) = self.pending_start.take() {
            match self.array.check_start_replace(slot, ch.info()) {
                Err(ProcessError::MemberBusy { .. } | ProcessError::Busy { .. }) => {
                    self.pending_start = Some((slot, ch, serial, resume));
                }
                Err(e) => self.control_error = Some(e.into()),
                Ok(()) => {
                    if let Err(e) = self.array.start_replace(slot, ch, serial, resume) {
                        self.control_error = Some(e.into());
                    }
                    self.next_publish = 0;
                    progress = true;
                }
            }
        }
        // Replacements: swapped in once the old device has nothing outstanding here.
        let mut i = 0;
        while i < self.pending_replace.len() {
            let m = self.pending_replace[i].0;
            match self
                .array
                .check_replace(m, self.pending_replace[i].1.info())
            {
                Err(ProcessError::MemberBusy { .. }) => i += 1,
                Err(e) => {
                    self.control_error = Some(e.into());
                    self.pending_replace.swap_remove(i);
                }
                Ok(()) => {
                    let (m, ch, readd) = self.pending_replace.swap_remove(i);
                    let put = if readd {
                        self.array.readd_member(m, ch)
                    } else {
                        self.array.replace_member(m, ch)
                    };
                    // Checked just above.
                    if put.is_ok() {
                        self.announced[usize::from(m)] = false;
                        self.reported_rebuilt[usize::from(m)] = false;
                        self.rebuild_pending = true;
                        self.next_publish = 0;
                        progress = true;
                    }
                }
            }
        }
        if self.rebuild_pending && self.pending_replace.is_empty() {
            match self.array.pending_rebuild() {
                Some(req) if self.array.check_process(&req).is_ok() => {
                    self.rebuild_pending = false;
                    // Checked just above.
                    let _ = self.array.start_process(&req);
                    progress = true;
                }
                // Busy: retried once the running process ends.
                Some(_) => {}
                None => self.rebuild_pending = false,
            }
        }
        progress
    }

    /// Step 1: takes in what the other reactors sent. Whether there was anything.
    fn receive(&mut self, hold: &TurnHold) -> bool {
        let mut progress = false;
        // 1. Inbound rings.
        // Everything a sender has published, as one chunk (one read of its write position,
        // one release of the slots).
        for ring in self.links.inbox.iter_mut().flatten() {
            let n = ring.slots();
            if n == 0 {
                continue;
            }
            progress = true;
            let chunk = ring.read_chunk(n).expect("`slots()` slots are readable");
            let (a, b) = chunk.as_slices();
            for &msg in a.iter().chain(b) {
                match msg {
                    Msg::Piece(r) => {
                        self.load.pieces_received += 1;
                        // A piece of a request that is not a bulk-sized write (marked by
                        // its origin, which saw the whole request) waits for this thread's
                        // turns: every shard it runs keeps its bound (`TurnHold`).
                        if r.tag & UNBULK_PIECE != 0 {
                            hold.note(self.clock.last_raw);
                        }
                        self.local.push_back(r);
                    }
                    Msg::Done(c) => account(&mut self.parents, &mut self.free, &mut self.done, c),
                }
            }
            chunk.commit_all();
        }
        progress
    }

    /// Step 2: admits new work from the front-end. Whether it made progress.
    fn front_end(&mut self, hold: &TurnHold) -> bool {
        // 2. Front-end.
        let mut io = Io {
            me: self.me,
            geo: &self.geo,
            array: &mut self.array,
            local: &mut self.local,
            outbox: &mut self.outbox,
            parents: &mut self.parents,
            free: &mut self.free,
            reactors: self.reactors,
            foreign_reads: self.foreign_reads,
            done: &mut self.done,
            in_flight: &self.shared.in_flight[self.me],
            hold,
            turn_raw: self.clock.last_raw,
        };
        self.fe.poll(&mut io)
    }

    /// Step 3: drives the shard: local pieces in, foreign reads it could not serve out,
    /// completions routed to their origin. Whether it made progress.
    fn drive_array(&mut self) -> bool {
        let mut progress = false;
        let (me, reactors) = (self.me, self.reactors);
        // 3. Local pieces into the shard, in order.
        while let Some(r) = self.local.front().copied() {
            // Every piece here is a sub-range of a request some reactor's `Io::submit`
            // validated (pieces from other reactors, and foreign reads handed back).
            if self.array.submit_piece(r).is_err() {
                break;
            }
            self.local.pop_front();
            progress = true;
        }
        progress |= self.array.process();
        // Foreign reads this shard could not serve go to their owners.
        while let Some(r) = self.array.take_moved() {
            let (stripe, _) = self.geo.stripe_of(r.offset_bytes);
            self.outbox.push(owner(stripe, reactors), Msg::Piece(r));
            progress = true;
        }
        if self.owner_of_bitmap {
            if let Some(b) = self.array.bitmap() {
                let g = b.generation();
                if g != self.bitmap_gen {
                    self.bitmap_gen = g;
                    for to in 1..reactors {
                        self.shared.wake(to);
                    }
                }
            }
        }
        loop {
            let k = self.array.poll(&mut self.comps);
            if reactors == 1 {
                // Whole requests under their callers' tags (`Io::submit_whole`).
                self.done.extend(&self.comps[..k]);
            } else {
                for &c in &self.comps[..k] {
                    let (origin, _) = split_tag(c.tag);
                    let back = back_to_origin(c);
                    if origin == me {
                        account(&mut self.parents, &mut self.free, &mut self.done, back);
                    } else {
                        self.outbox.push(origin, Msg::Done(back));
                    }
                }
            }
            progress |= k > 0;
            if k < self.comps.len() {
                break;
            }
        }
        progress
    }

    /// Tells the other reactors what this shard learnt (members failed or rebuilt, a
    /// replacement finished or failed), restarts a waiting rebuild, and publishes the
    /// shard's figures when due.
    fn report(&mut self, now: u64) {
        let (me, reactors, shared) = (self.me, self.reactors, self.shared);
        // A member this shard failed is failed on every shard: a device that erred is not
        // trusted by any reactor (each learns it at once instead of by its own error).
        // Members this shard has rebuilt everywhere it owns: once every reactor has, they
        // go online on all.
        for m in self.array.rebuilt_members() {
            if !self.reported_rebuilt[usize::from(m)] {
                self.reported_rebuilt[usize::from(m)] = true;
                self.next_publish = 0;
                let count = shared.rebuilt[usize::from(m)].fetch_add(1, Ordering::AcqRel) + 1;
                if count == reactors {
                    shared.rebuilt[usize::from(m)].store(0, Ordering::Release);
                    for to in 0..reactors {
                        shared.send_control(to, Control::MemberRebuilt(m));
                    }
                }
            }
        }
        // Replacements: this shard's part finished (counted once; the last reactor to
        // finish swaps it in everywhere), or its device failed here (told to all).
        if let Some(r) = self.array.replacement() {
            if r.serial != self.reported_replace && self.array.replace_finished(r.serial) {
                self.reported_replace = r.serial;
                self.next_publish = 0;
                let count = shared.replaced.fetch_add(1, Ordering::AcqRel) + 1;
                if count == reactors {
                    shared.replaced.store(0, Ordering::Release);
                    if shared.confirm_replace {
                        // The caller records the swap, then asks for it.
                        shared.replace_copied.store(r.serial, Ordering::Release);
                    } else {
                        for to in 0..reactors {
                            shared.send_control(to, Control::ReplaceDone { serial: r.serial });
                        }
                    }
                }
            }
            let f = self.array.replacement_failures();
            if f != self.repl_failures_seen {
                self.repl_failures_seen = f;
                self.next_publish = 0;
                if let ReplaceState::Failed(err) = r.state {
                    for to in (0..reactors).filter(|&to| to != me) {
                        shared.send_control(
                            to,
                            Control::FailReplacement {
                                serial: r.serial,
                                err,
                            },
                        );
                    }
                }
            }
        }
        // A rebuild that finished while another replaced member waits: start that one.
        if !self.rebuild_pending
            && self.array.process_progress().is_some_and(|p| {
                p.kind == ProcessKind::Rebuild && p.state == ProcessState::Finished
            })
            && self
                .array
                .member_states()
                .enumerate()
                .any(|(m, s)| s == MemberState::Rebuilding && !self.reported_rebuilt[m])
        {
            self.rebuild_pending = true;
        }
        let failures = self.array.member_failures();
        if failures != self.failures_seen {
            self.failures_seen = failures;
            self.next_publish = 0;
            for (m, state) in self.array.member_states().enumerate() {
                if state.is_failed() && !self.announced[m] {
                    self.announced[m] = true;
                    let err = match state {
                        MemberState::Failed(e) => Some(e),
                        _ => None,
                    };
                    for to in (0..reactors).filter(|&to| to != me) {
                        shared.send_control(to, Control::FailMember(m as u16, err));
                    }
                }
            }
        }
        let holding = self.array.held_writes() > 0;
        if holding != self.holding_seen {
            self.holding_seen = holding;
            self.tell_watcher |= holding;
            self.next_publish = 0;
        }
        let to_record = self.array.failures_to_record();
        if to_record != self.to_record_seen {
            self.to_record_seen = to_record;
            self.tell_watcher = true;
            self.next_publish = 0;
        }
        if now >= self.next_publish {
            if let Ok(mut p) = shared.published[me].try_lock() {
                publish(&self.array, &mut p);
                p.load = ReactorLoad {
                    pieces_sent: self.outbox.pieces,
                    ..self.load
                };
                if self.control_error.is_some() {
                    p.control_error = self.control_error.take();
                }
                self.next_publish = now + PUBLISH_INTERVAL.as_nanos() as u64;
                drop(p);
                // After the publish: the watcher's marks and snapshot see what it is told.
                if std::mem::take(&mut self.tell_watcher) {
                    if let Some(notify) = shared.failure_watcher.get() {
                        notify();
                    }
                }
            }
        }
    }

    /// Step 4: sends the messages for other reactors. Whether any went.
    fn send(&mut self) -> bool {
        // 4. Messages to other reactors; a full ring keeps the rest for the next turn.
        let progress = self.outbox.flush(&mut self.links);
        // Only a parked reactor needs waking (adaptive mode): one look per receiver.
        for (to, sent) in self.links.sent.iter_mut().enumerate() {
            if std::mem::take(sent) && self.shared.host.mode == Mode::Adaptive {
                self.shared.wake(to);
            }
        }
        progress
    }

    /// Step 5: delivers completions to the front-end. Whether there were any.
    fn deliver(&mut self) -> bool {
        // 5. Completions to the front-end. The count drops once for the batch: a count
        // above the truth only delays the stop rule, never satisfies it early.
        let mut n = 0isize;
        while let Some(c) = self.done.pop_front() {
            self.fe.complete(c);
            n += 1;
        }
        if n > 0 {
            count_in_flight(&self.shared.in_flight[self.me], -n);
        }
        n > 0
    }

    /// Whether the reactor stops now (its final figures published).
    fn stopping(&mut self) -> bool {
        let (shared, me) = (self.shared, self.me);
        // Stop only when no reactor can send this one work any more: every front-end is
        // finished and no request is in flight anywhere.
        if !self.counted_finished && self.fe.finished() {
            self.counted_finished = true;
            shared.finished.fetch_add(1, Ordering::AcqRel);
        }
        if shared.stop.load(Ordering::Acquire)
            && shared.finished.load(Ordering::Acquire) == self.reactors
            && shared.requests_in_flight() == 0
            && !self.array.background_busy()
            // The bitmap owner's last batch (its buffer is the shard's) must complete.
            && !self.array.busy()
        {
            debug_assert!(self.local.is_empty() && self.outbox.is_empty() && !self.array.busy());
            // Final figures for anyone holding a handle (blocking is fine on the way out).
            let mut p = shared.published[me]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            publish(&self.array, &mut p);
            p.load = ReactorLoad {
                pieces_sent: self.outbox.pieces,
                ..self.load
            };
            return true;
        }
        false
    }
}

/// Copies the shard's statistics into its published slot (no allocation: histograms of
/// equal bounds are reset and re-added in place; the process's progress is a few words
/// and one small vector of targets).
fn publish<C: Channel>(array: &Array<C>, p: &mut Published) {
    p.stats = array.stats();
    for c in RequestClass::ALL {
        array.queue_wait_into(c, &mut p.queue_wait[c.index()]);
    }
    p.process = array.process_progress();
    p.failures = array.failures_to_record();
    p.writes_held = array.held_writes();
    p.replace = array.replacement();
    if let Some((c, h)) = array.replacement_io() {
        p.replace_counters = c;
        h.fill(&mut p.replace_latency);
    }
    for (i, (m, state)) in p.members.iter_mut().zip(array.member_states()).enumerate() {
        m.state = state;
        m.counters = array.member_counters(i as u16);
        m.qos = array.member_qos(i as u16);
        array.member_latency(i as u16).fill(&mut m.latency);
    }
}

/// Takes finished piece `c` ([`back_to_origin`]'s form) on its origin reactor: a whole
/// request ([`WHOLE_PIECE`]) is done under its caller's tag; a piece counts down its parent
/// entry, which is done (its first error, else success) when the last piece is in.
/// Inline: on every completion of a multi-reactor array (a call cost more than the whole
/// request's branch).
#[inline(always)]
fn account(
    parents: &mut [Option<Parent>],
    free: &mut Vec<u32>,
    done: &mut VecDeque<ArrayCompletion>,
    c: ArrayCompletion,
) {
    if c.tag & WHOLE_PIECE != 0 {
        // A whole request: done, under its caller's tag.
        done.push_back(ArrayCompletion {
            tag: c.tag & (WHOLE_TAG_LIMIT - 1),
            status: c.status,
        });
        return;
    }
    let p = c.tag as u32;
    let parent = parents[p as usize]
        .as_mut()
        .expect("completion for a live parent");
    if let Err(e) = c.status {
        parent.error.get_or_insert(e);
    }
    parent.remaining -= 1;
    if parent.remaining == 0 {
        // Field by field, not `take()` of the whole entry and `map_or` on its error: those
        // built the status on the stack with a narrow store read back by a wide load, a
        // store-forwarding stall on every request of a multi-reactor array.
        let tag = parent.tag;
        let status = match parent.error {
            None => Ok(()),
            Some(e) => Err(e),
        };
        parents[p as usize] = None;
        free.push(p);
        done.push_back(ArrayCompletion { tag, status });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::array::ArrayOp;
    use crate::device::{Completion, DeviceError, DeviceInfo, IoBuf, Request, SubmitError};

    /// A device that stores nothing (`drivers::null`'s, which this crate cannot use):
    /// every request completes at the channel's next `poll`, its buffer untouched.
    struct Nothing(DeviceInfo);

    struct NothingChannel(DeviceInfo, Vec<u64>);

    impl BlockDevice for Nothing {
        type Channel = NothingChannel;

        fn info(&self) -> &DeviceInfo {
            &self.0
        }

        fn open_channel(&self) -> Result<NothingChannel, DeviceError> {
            Ok(NothingChannel(self.0.clone(), Vec::new()))
        }
    }

    impl Channel for NothingChannel {
        fn info(&self) -> &DeviceInfo {
            &self.0
        }

        fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
            crate::device::validate(&self.0, &req)?;
            if self.1.len() >= self.0.queue_depth as usize {
                return Err(SubmitError::QueueFull);
            }
            self.1.push(req.tag);
            Ok(())
        }

        fn kick(&mut self) {}

        fn poll(&mut self, out: &mut [Completion]) -> usize {
            let n = out.len().min(self.1.len());
            for (o, tag) in out.iter_mut().zip(self.1.drain(..n)) {
                *o = Completion {
                    tag,
                    status: Ok(()),
                };
            }
            n
        }

        fn in_flight(&self) -> usize {
            self.1.len()
        }
    }

    fn done(tag: u64) -> Msg {
        Msg::Done(ArrayCompletion {
            tag,
            status: Ok(()),
        })
    }

    /// Pops every message reactor `at` has from reactor `from`, as tags.
    fn drain(links: &mut [Links], at: usize, from: usize) -> Vec<u64> {
        let ring = links[at].inbox[from].as_mut().unwrap();
        let mut out = Vec::new();
        while let Ok(m) = ring.pop() {
            match m {
                Msg::Done(c) => out.push(c.tag),
                Msg::Piece(r) => out.push(r.tag),
            }
        }
        out
    }

    /// Before any reactor has published, a snapshot reports the members as the array
    /// configuration starts them: one assembled as being rebuilt is not online (the
    /// management layer, whose first look may come before that publication, recorded such
    /// a member in sync, and a restart then served its unrebuilt half as data).
    #[test]
    fn a_snapshot_before_the_first_publication_reports_the_configured_member_states() {
        use crate::geometry::{Geometry, Layout, Level};
        let geo = ArrayGeometry::new(
            Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, 65536, 512).unwrap(),
            16,
        )
        .unwrap();
        let cfg = ArrayConfig {
            rebuilding: [Some((1, 7)), None],
            failed_members: [Some(4), None],
            ..ArrayConfig::default()
        };
        let initial = cfg.initial_member_states(6);
        let shared = Shared::new(
            Arc::new(HostShared::new(2, Mode::Polled)),
            geo,
            0,
            std::any::TypeId::of::<()>(),
            false,
            Arc::new(ZeroMap::new(&geo)),
            &initial,
        );
        let handle = ReactorHandle {
            shared: Arc::new(shared),
        };
        let states: Vec<MemberState> = handle.snapshot().members.iter().map(|m| m.state).collect();
        assert_eq!(
            states,
            [
                MemberState::Online,
                MemberState::Rebuilding,
                MemberState::Online,
                MemberState::Online,
                MemberState::Failed(IoError::Gone),
                MemberState::Online,
            ]
        );
    }

    /// A request of [`Submits`]: op, array offset, bytes.
    type Req = (ArrayOp, u64, u32);

    /// Submits its requests at its first poll, each into a buffer of its own.
    struct Submits {
        reqs: Vec<Req>,
        bufs: Vec<crate::buf::AlignedBuf>,
        sent: bool,
        done: usize,
    }

    impl Frontend for Submits {
        fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
            if std::mem::replace(&mut self.sent, true) {
                return false;
            }
            for (i, &(op, offset_bytes, len_bytes)) in self.reqs.iter().enumerate() {
                // SAFETY: the buffers' heap memory lives as long as `self`: `run_local`
                // moves the front end out before it drops the reactor, so no request can
                // outlive them (and `Nothing` never touches a buffer).
                let buf = unsafe { IoBuf::from_slice(&mut self.bufs[i][..]) };
                let r = ArrayRequest {
                    tag: i as u64,
                    op,
                    offset_bytes,
                    len_bytes,
                    buf,
                };
                io.submit(r).expect("room for every request");
            }
            true
        }

        fn complete(&mut self, c: ArrayCompletion) {
            assert_eq!(c.status, Ok(()), "request {}", c.tag);
            self.done += 1;
        }

        fn finished(&self) -> bool {
            self.sent && self.done == self.reqs.len()
        }
    }

    /// The reactor notes every request that is not a bulk-sized write its front end
    /// submits in the thread's `TurnHold` (small reads, small writes; not a write of 256
    /// KiB, not a flush) and gives the shard the hold's verdict in that turn (read after
    /// it); the hold lapses `TURN_BOUND_HOLD_NS` after the last note.
    #[test]
    fn the_thread_hold_notes_requests_that_are_not_bulk_writes() {
        use crate::geometry::{Geometry, Layout, Level};
        let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 5, 64 << 10, 4096).unwrap();
        let geo = ArrayGeometry::new(g, 16).unwrap();
        let cases: [(&[Req], bool); 4] = [
            (&[(ArrayOp::Read, 4096, 4096)], true),
            (&[(ArrayOp::Write { fua: false }, 8192, 4096)], true),
            (&[(ArrayOp::Write { fua: false }, 0, 256 << 10)], false),
            (&[(ArrayOp::Flush, 0, 0)], false),
        ];
        for (reqs, held) in cases {
            let devs: Vec<Nothing> = (0..5)
                .map(|i| {
                    Nothing(DeviceInfo {
                        name: format!("n{i}"),
                        block_bytes: 4096,
                        capacity_bytes: 16 * (64 << 10),
                        queue_depth: 64,
                        max_transfer_bytes: 1 << 20,
                        volatile_cache: false,
                        write_zeroes: false,
                        discard: false,
                        rotational: false,
                    })
                })
                .collect();
            let fe = Submits {
                reqs: reqs.to_vec(),
                bufs: reqs
                    .iter()
                    .map(|&(_, _, len)| crate::buf::AlignedBuf::zeroed(len.max(1) as usize))
                    .collect(),
                sent: false,
                done: 0,
            };
            let (seen, fe) = run_local(
                &devs,
                geo,
                Parity::new(),
                ArrayConfig::default(),
                8,
                fe,
                |r| {
                    r.turn();
                    let seen = r.r.array.turn_bound_held();
                    for _ in 0..10_000 {
                        if r.frontend().finished() {
                            break;
                        }
                        r.turn();
                    }
                    seen
                },
            )
            .unwrap();
            assert!(fe.finished(), "{reqs:?}: requests did not finish");
            assert_eq!(seen, held, "{reqs:?}");
        }

        // The hold lapses a hold's length after its last note.
        let (mock_clock, mock) = quanta::Clock::mock();
        // A counter past 0 (0 is "never"; a real counter is never there).
        mock.increment(1_000u64);
        let mut clock = TurnClock {
            start: mock_clock.raw(),
            clock: mock_clock,
            last_ns: 0,
            last_raw: 0,
        };
        clock.last_raw = clock.start;
        clock.now_ns();
        let hold = TurnHold::default();
        assert!(!hold.held(&clock), "nothing noted");
        hold.note(clock.last_raw);
        mock.increment(TURN_BOUND_HOLD_NS - 1);
        clock.now_ns();
        assert!(hold.held(&clock));
        mock.increment(1u64);
        clock.now_ns();
        assert!(!hold.held(&clock), "lapsed");
    }

    /// A piece's tag carries its origin's verdict on the whole request (`UNBULK_PIECE`)
    /// without disturbing the origin and parent slot that completions are routed by.
    #[test]
    fn a_piece_tag_carries_the_unbulk_mark_beside_origin_and_parent() {
        for (origin, parent) in [(0usize, 0u32), (1, 7), (15, u32::MAX), (0xffff, 1 << 20)] {
            for unbulk in [false, true] {
                let t = piece_tag(origin, parent, unbulk);
                assert_eq!(split_tag(t), (origin, parent));
                assert_eq!(t & UNBULK_PIECE != 0, unbulk);
            }
        }
        // A whole request's piece: the caller's tag, up to the limit, comes back whole to
        // the origin, past the unbulk mark, and leaves the parent table alone.
        for caller in [
            0u64,
            7,
            1 << 45,
            (1 << 44) | 0xFFFF_FFFF,
            WHOLE_TAG_LIMIT - 1,
        ] {
            for (origin, unbulk) in [(0usize, false), (3, true), (0xffff, true)] {
                let t = piece_tag(origin, 0, unbulk) | WHOLE_PIECE | caller;
                assert_eq!(split_tag(t).0, origin);
                assert_eq!(t & UNBULK_PIECE != 0, unbulk);
                let back = back_to_origin(ArrayCompletion {
                    tag: t,
                    status: Err(ArrayError::Failed),
                });
                let (mut parents, mut free, mut done) = (vec![None], vec![0], VecDeque::new());
                account(&mut parents, &mut free, &mut done, back);
                assert_eq!(
                    done.pop_front().map(|c| (c.tag, c.status)),
                    Some((caller, Err(ArrayError::Failed)))
                );
                assert!(parents[0].is_none() && free == [0]);
            }
        }
        assert!(waits_on_turns(false, 1 << 30), "a read of any length");
        assert!(waits_on_turns(true, crate::array::BULK_MIN_BYTES - 4096));
        assert!(!waits_on_turns(true, crate::array::BULK_MIN_BYTES));
    }

    #[test]
    fn outbox_sends_each_receiver_its_messages_in_order_and_keeps_what_does_not_fit() {
        let mut links = Links::mesh(3);
        let mut ob = Outbox::new(0, 3, 4);
        assert!(ob.is_empty());
        // More than one ring holds for reactor 1, a few for reactor 2, interleaved.
        let n1 = RING_CAPACITY as u64 + 10;
        for t in 0..n1 {
            ob.push(1, done(t));
            if t < 5 {
                ob.push(2, done(1000 + t));
            }
        }
        assert!(ob.flush(&mut links[0]));
        assert_eq!((links[0].sent[1], links[0].sent[2]), (true, true));
        assert!(!ob.is_empty(), "ten messages did not fit");
        assert_eq!(
            drain(&mut links, 1, 0),
            (0..RING_CAPACITY as u64).collect::<Vec<_>>()
        );
        assert_eq!(drain(&mut links, 2, 0), (1000..1005).collect::<Vec<_>>());
        links[0].sent.iter_mut().for_each(|s| *s = false);
        // The rest follows, still in order; nothing is sent twice.
        assert!(ob.flush(&mut links[0]));
        assert_eq!(
            (links[0].sent[1], links[0].sent[2]),
            (true, false),
            "only reactor 1 had messages left"
        );
        assert!(ob.is_empty());
        assert_eq!(
            drain(&mut links, 1, 0),
            (RING_CAPACITY as u64..n1).collect::<Vec<_>>()
        );
        assert!(!ob.flush(&mut links[0]), "nothing left to send");
    }
}
