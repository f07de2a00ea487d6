//! Real reactor threads (adaptive mode) over `mem` members: every reactor's front-end runs
//! random reads and writes on its own region of the array — regions share stripes, so
//! pieces cross between reactors — checking each read against its reference; afterwards the
//! member images go to the oracle.

use std::ptr::NonNull;
use std::sync::Arc;

use drivers::mem::MemDevice;
use engine::array::{ArrayCompletion, ArrayConfig, ArrayOp, ArrayRequest, MemberState};
use engine::buf::AlignedBuf;
use engine::device::{
    BlockDevice, Channel, Completion, DeviceError, DeviceInfo, IoBuf, IoError, Request, SubmitError,
};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::reactor::{Extras, Frontend, Io, Mode, ReactorConfig, ReactorSet, Reactors};
use ferroraid_tests::{Oracle, Rng};

const CHUNK: u64 = 4096;

/// Background admissions asked of the reactors' pacers (all tests of this binary).
static ADMITS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Admits everything, counting the questions: proves each reactor's shard consults the
/// pacer it was given.
struct CountingPacer;

impl engine::qos::Pacer for CountingPacer {
    fn foreground_submitted(&mut self, _now_ns: u64) {}
    fn foreground_done(&mut self, _now: u64, _lat: u64, _bytes: u64, _read: bool) {}
    fn background_done(&mut self, _now: u64, _lat: u64, _bytes: u64) {}
    fn admit(&mut self, _now: u64, _bytes: u64, _in_flight: u32) -> engine::qos::Admission {
        ADMITS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        engine::qos::Admission::Now
    }
}
const STRIPES: u64 = 48;

/// Random I/O, one request at a time, on `start..start+len` of the array.
struct Checker {
    start: u64,
    reference: Vec<u8>,
    buf: AlignedBuf,
    rng: Rng,
    ops_left: u32,
    /// Added to each request's tag (`tag_base + ops_left`): its width decides whether a
    /// request inside one stripe goes out without a parent entry (`Io::submit`).
    tag_base: u64,
    /// Write, offset, length and tag of the request in flight.
    inflight: Option<(bool, u64, u64, u64)>,
    errors: Vec<String>,
}

impl Frontend for Checker {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        if self.inflight.is_some() || self.ops_left == 0 {
            return false;
        }
        let region = self.reference.len() as u64;
        let len = 512 * (1 + self.rng.below((region / 512).min(64)));
        let off = 512 * self.rng.below((region - len) / 512 + 1);
        let write = self.rng.below(2) == 0;
        let b = &mut self.buf[..len as usize];
        if write {
            self.rng.fill(b);
            self.reference[off as usize..(off + len) as usize].copy_from_slice(b);
        }
        // SAFETY: the buffer belongs to this front-end and is untouched until `complete`.
        let io_buf =
            unsafe { IoBuf::from_raw(NonNull::new(b.as_mut_ptr()).unwrap(), len as u32, None) };
        let tag = self.tag_base.wrapping_add(u64::from(self.ops_left));
        let r = ArrayRequest {
            tag,
            op: if write {
                ArrayOp::Write { fua: false }
            } else {
                ArrayOp::Read
            },
            offset_bytes: self.start + off,
            len_bytes: len as u32,
            buf: io_buf,
        };
        if io.submit(r).is_ok() {
            self.inflight = Some((write, off, len, tag));
            self.ops_left -= 1;
            true
        } else {
            false
        }
    }

    fn complete(&mut self, c: ArrayCompletion) {
        let (write, off, len, tag) = self.inflight.take().expect("one request in flight");
        if c.tag != tag {
            self.errors
                .push(format!("request {tag:#x} completed as {:#x}", c.tag));
        } else if let Err(e) = c.status {
            self.errors.push(format!("request {} failed: {e}", c.tag));
        } else if !write
            && self.buf[..len as usize] != self.reference[off as usize..(off + len) as usize]
        {
            self.errors.push(format!(
                "read {}+{len} differs from the reference",
                self.start + off
            ));
        }
    }

    fn finished(&self) -> bool {
        self.ops_left == 0 && self.inflight.is_none()
    }
}

/// Starts `reactors` adaptive reactors over six fresh `mem` members of a RAID6, each with a
/// `Checker` running `ops` requests seeded from `seed` on its own region (regions not
/// stripe-aligned, so neighbouring front-ends share stripes).
fn start_checkers(
    reactors: usize,
    ops: u32,
    seed: u64,
) -> (Reactors<Checker>, Arc<Vec<MemDevice>>, ArrayGeometry) {
    start_checkers_on(None, reactors, ops, seed).unwrap()
}

/// A started array: its reactors, members and geometry.
type Started = (Reactors<Checker>, Arc<Vec<MemDevice>>, ArrayGeometry);

/// [`start_checkers`] on the reactors of `set` (`None`: reactors of the array's own).
fn start_checkers_on(
    set: Option<&ReactorSet>,
    reactors: usize,
    ops: u32,
    seed: u64,
) -> Result<Started, engine::reactor::ReactorError> {
    start_checkers_with(set, reactors, ops, seed, false)
}

/// [`start_checkers_on`] with [`Extras::confirm_replace`] set as given.
fn start_checkers_with(
    set: Option<&ReactorSet>,
    reactors: usize,
    ops: u32,
    seed: u64,
    confirm_replace: bool,
) -> Result<Started, engine::reactor::ReactorError> {
    let (devices, geo) = raid6_members();
    let frontends = checkers(geo, reactors, ops, seed);
    let running = start_frontends(set, &devices, geo, frontends, confirm_replace, false)?;
    Ok((running, devices, geo))
}

/// One [`Checker`] per reactor over `geo`'s capacity split evenly (512-byte multiples), each
/// `ops` requests, seeded `seed + i`.
fn checkers(geo: ArrayGeometry, reactors: usize, ops: u32, seed: u64) -> Vec<Checker> {
    let region = (geo.capacity_bytes() / reactors as u64) / 512 * 512;
    (0..reactors)
        .map(|i| Checker {
            start: i as u64 * region,
            reference: vec![0; region as usize],
            buf: AlignedBuf::zeroed(64 * 512),
            rng: Rng::new(seed + i as u64),
            ops_left: ops,
            tag_base: 0,
            inflight: None,
            errors: Vec::new(),
        })
        .collect()
}

/// Six fresh `mem` members of a RAID6 (left-symmetric, 4 KiB chunks, [`STRIPES`] stripes)
/// and its geometry.
fn raid6_members() -> (Arc<Vec<MemDevice>>, ArrayGeometry) {
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, CHUNK, 512).unwrap();
    let geo = ArrayGeometry::new(g, STRIPES).unwrap();
    let devices: Arc<Vec<MemDevice>> = Arc::new(
        (0..6)
            .map(|i| MemDevice::new(&format!("mem{i}"), STRIPES * CHUNK, 512, 64).unwrap())
            .collect(),
    );
    (devices, geo)
}

/// Starts one adaptive reactor per front-end over `devices` (on `set`, else on reactors of
/// the array's own), 16 requests each, foreign reads on, with
/// [`Extras::confirm_replace`] and [`Extras::confirm_failures`] as given.
fn start_frontends<F: Frontend + Send + 'static, D: BlockDevice + Send + Sync + 'static>(
    set: Option<&ReactorSet>,
    devices: &Arc<Vec<D>>,
    geo: ArrayGeometry,
    frontends: Vec<F>,
    confirm_replace: bool,
    confirm_failures: bool,
) -> Result<Reactors<F>, engine::reactor::ReactorError> {
    let cfg = ReactorConfig {
        cores: vec![None; frontends.len()],
        mode: Mode::Adaptive,
        requests: 16,
        foreign_reads: true,
    };
    let extras = Extras {
        pacer: |_| Box::new(CountingPacer) as Box<dyn engine::qos::Pacer>,
        bitmap: None,
        ppl: None,
        replace: None,
        confirm_replace,
        confirm_failures,
    };
    match set {
        Some(set) => Reactors::start_on(
            set,
            Arc::clone(devices),
            geo,
            Parity::new(),
            ArrayConfig::default(),
            &cfg,
            frontends,
            extras,
        ),
        None => Reactors::start_with(
            Arc::clone(devices),
            geo,
            Parity::new(),
            ArrayConfig::default(),
            cfg,
            frontends,
            extras,
        ),
    }
}

/// Checks a stopped array's front-ends saw no error and its members (via the oracle) hold
/// parity that verifies and the data the front-ends wrote.
fn check_stopped(what: &str, done: &[Checker], devices: &[MemDevice]) {
    check_images(
        what,
        done,
        devices.iter().map(MemDevice::contents).collect(),
    );
}

/// [`check_stopped`] on member images (member order).
fn check_images(what: &str, done: &[Checker], images: Vec<Vec<u8>>) {
    let members: Vec<Option<&[u8]>> = images.iter().map(|i| Some(&i[..])).collect();
    check_members(what, done, &members, true);
}

/// [`check_images`] with members given as missing (`None`: the oracle reconstructs their
/// chunks from the others; [`oracle_images_raid6_4k`]), parity verified when `verify`.
fn check_members(what: &str, done: &[Checker], images: &[Option<&[u8]>], verify: bool) {
    let mut logical = Vec::new();
    for f in done {
        assert!(
            f.errors.is_empty(),
            "{what}: {:?}",
            &f.errors[..f.errors.len().min(5)]
        );
        assert!(f.finished());
        logical.extend_from_slice(&f.reference);
    }
    if let Some(extracted) = oracle_images_raid6_4k(what, images, verify) {
        assert!(
            extracted[..logical.len()] == logical[..],
            "{what}: logical image differs"
        );
    }
}

/// Waits (up to 30 s) until `cond` holds.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Several arrays on one set of reactor threads (issue 21): each array has a shard on
/// every reactor; one array stops (its shards drain and leave) while another keeps
/// serving, a third starts on the same threads meanwhile, and every array's data and
/// parity are right.
#[test]
fn arrays_share_a_reactor_set_and_start_and_stop_independently() {
    let set = ReactorSet::start(&[None, None], Mode::Adaptive).unwrap();
    assert_eq!(set.reactors(), 2);
    // A runs long; B short.
    let (a, a_devs, _) = start_checkers_on(Some(&set), 2, 40_000, 901).unwrap();
    let (b, b_devs, _) = start_checkers_on(Some(&set), 2, 1_500, 902).unwrap();
    let (ha, hb) = (a.handle(), b.handle());
    wait_for("both arrays hosted on both reactors", || {
        set.hosted() == [2, 2]
    });
    let done_b = b.stop().unwrap();
    check_stopped("array B", &done_b, &b_devs);
    wait_for("B's shards gone", || set.hosted() == [1, 1]);
    // Member requests sent, every member of the array.
    let served = |h: &engine::reactor::ReactorHandle| -> u64 {
        h.snapshot()
            .members
            .iter()
            .map(|m| m.counters.reads + m.counters.writes)
            .sum()
    };
    assert!(served(&hb) > 0);
    // A goes on after B left: its member request counts keep moving.
    let before = served(&ha);
    wait_for("A still serving after B stopped", || served(&ha) > before);
    // C starts on the same threads while A runs.
    let (c, c_devs, _) = start_checkers_on(Some(&set), 2, 1_500, 903).unwrap();
    wait_for("C hosted beside A", || set.hosted() == [2, 2]);
    let done_c = c.stop().unwrap();
    check_stopped("array C", &done_c, &c_devs);
    let done_a = a.stop().unwrap();
    check_stopped("array A", &done_a, &a_devs);
    assert_eq!(set.hosted(), [0, 0]);
    set.shutdown();
}

/// A set refuses front-ends that do not match its reactors, and a configuration without
/// reactors.
#[test]
fn reactor_set_refuses_mismatched_front_ends() {
    assert!(ReactorSet::start(&[], Mode::Adaptive).is_err());
    let set = ReactorSet::start(&[None, None], Mode::Adaptive).unwrap();
    let err = start_checkers_on(Some(&set), 3, 10, 1)
        .err()
        .expect("three front-ends on two reactors were accepted");
    assert!(err.to_string().contains("3 front-ends"), "{err}");
    assert_eq!(set.hosted(), [0, 0]);
    set.shutdown();
}

/// The per-turn bulk bound's thread record (`engine::reactor`'s `TurnHold`) reaches a
/// reactor that only serves pieces: reactor 0's front end sends small writes (at most
/// 32 KiB) to reactor 1's stripes, and reactor 1's thread, whose own front end submits
/// nothing, counts turns whose bound held by that record (`bound_held_turns`), from the
/// pieces' marks. Data checked as the other runs are.
#[test]
fn small_pieces_hold_the_turn_bound_on_the_reactor_that_serves_them() {
    let (devices, geo) = raid6_members();
    let mut frontends = checkers(geo, 2, 300, 41);
    frontends[1].ops_left = 0;
    let running = start_frontends(None, &devices, geo, frontends, false, false).unwrap();
    let h = running.handle();
    let done = running.stop().unwrap();
    let loads = h.reactor_loads();
    assert!(loads[1].pieces_received > 0, "{loads:?}");
    assert!(loads[0].bound_held_turns > 0, "{loads:?}");
    assert!(
        loads[1].bound_held_turns > 0,
        "the pieces did not arm the serving thread: {loads:?}"
    );
    check_stopped(
        "small_pieces_hold_the_turn_bound_on_the_reactor_that_serves_them",
        &done,
        &devices,
    );
}

#[test]
fn reactors_route_pieces_and_keep_data_and_parity_right() {
    for reactors in [1usize, 2, 3] {
        let t0 = std::time::Instant::now();
        let (running, devices, _geo) = start_checkers(reactors, 1500, 77);
        let h = running.handle();
        let done = running.stop().unwrap();
        let wall_ns = t0.elapsed().as_nanos() as u64;
        let st = h.snapshot().stats;
        // Each reactor's loop counters: every piece sent to another reactor arrived there,
        // pieces cross only between reactors, and busy + idle time fits the run.
        let loads = h.reactor_loads();
        assert_eq!(loads.len(), reactors);
        let sent: u64 = loads.iter().map(|l| l.pieces_sent).sum();
        let received: u64 = loads.iter().map(|l| l.pieces_received).sum();
        assert_eq!(sent, received, "{reactors} reactors: {loads:?}");
        assert_eq!(sent > 0, reactors > 1, "{reactors} reactors: {loads:?}");
        for l in &loads {
            assert!(l.turns > 0 && l.busy_ns > 0, "{reactors} reactors: {l:?}");
            assert!(l.busy_ns + l.idle_ns <= wall_ns, "{l:?} in {wall_ns} ns");
            assert!((0.0..=1.0).contains(&l.busy_fraction()));
        }
        // Reads of another reactor's stripes are served where they arrive (foreign reads),
        // while that reactor writes its stripes: the data checks above and below cover them.
        if reactors > 1 {
            assert!(st.foreign_reads > 0, "{reactors} reactors: {st:?}");
        } else {
            assert_eq!(st.foreign_reads + st.moved_reads, 0);
        }
        eprintln!(
            "{reactors} reactors: {} direct reads, {} foreign, {} moved to the owner, {} writes waited for foreign reads",
            st.direct_reads, st.foreign_reads, st.moved_reads, st.gate_waits
        );
        check_stopped(
            &format!("reactors_route_pieces_and_keep_data_and_parity_right, {reactors} reactors"),
            &done,
            &devices,
        );
    }
}

/// A request comes back under the tag its front end gave it, whatever the tag's width: a
/// request inside one stripe whose tag is below `WHOLE_TAG_LIMIT` goes out without a parent
/// entry (its tag carried in the piece's), others through one, and both keep data and
/// parity right on two reactors (reads and writes inside one stripe and across stripes, on
/// either reactor's stripes). Bases: small tags; iSCSI's and NVMe/TCP's marker bits; tags
/// just under the limit; tags from the limit up (parent entries).
#[test]
fn requests_complete_under_their_callers_tags_whatever_the_tags_width() {
    let limit = engine::reactor::WHOLE_TAG_LIMIT;
    for tag_base in [
        0,
        1 << 45,
        (1 << 44) | (0xFFFF << 16),
        limit - 4000,
        limit,
        u64::MAX - 4000,
    ] {
        let (devices, geo) = raid6_members();
        let mut fes = checkers(geo, 2, 1500, 91);
        for f in &mut fes {
            f.tag_base = tag_base;
        }
        let running = start_frontends(None, &devices, geo, fes, false, false).unwrap();
        let done = running.stop().unwrap();
        check_stopped(
            &format!("tags from {tag_base:#x}, 2 reactors"),
            &done,
            &devices,
        );
    }
}

/// Submits single-stripe reads with small tags (no parent entry each) until the reactor
/// refuses one, and then nothing more.
struct Flood {
    buf: AlignedBuf,
    accepted: usize,
    done: usize,
    refused: bool,
}

impl Frontend for Flood {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        if self.refused {
            return false;
        }
        while self.accepted < 1000 {
            let i = self.accepted;
            let b = &mut self.buf[i * 512..(i + 1) * 512];
            // SAFETY: each request has its own 512 bytes of the front end's buffer,
            // untouched until the reactors stop (the buffer outlives them).
            let buf = unsafe { IoBuf::from_raw(NonNull::new(b.as_mut_ptr()).unwrap(), 512, None) };
            let r = ArrayRequest {
                tag: i as u64,
                op: ArrayOp::Read,
                offset_bytes: i as u64 * 512,
                len_bytes: 512,
                buf,
            };
            match io.submit(r) {
                Ok(()) => self.accepted += 1,
                Err(e) => {
                    assert_eq!(e, engine::array::ArrayError::QueueFull);
                    break;
                }
            }
        }
        self.refused = true;
        true
    }

    fn complete(&mut self, c: ArrayCompletion) {
        assert_eq!(c.status, Ok(()));
        self.done += 1;
    }

    fn finished(&self) -> bool {
        self.refused && self.done == self.accepted
    }
}

/// A reactor takes at most as many requests in flight as its parent table has entries
/// (`ReactorConfig::requests`), also when none of them takes an entry.
#[test]
fn requests_without_parent_entries_are_bounded_like_the_rest() {
    let (devices, geo) = raid6_members();
    let fes: Vec<Flood> = (0..2)
        .map(|_| Flood {
            buf: AlignedBuf::zeroed(1000 * 512),
            accepted: 0,
            done: 0,
            refused: false,
        })
        .collect();
    let running = start_frontends(None, &devices, geo, fes, false, false).unwrap();
    let done = running.stop().unwrap();
    for f in &done {
        assert_eq!(f.accepted, 16, "the configured requests per reactor");
        assert_eq!(f.done, 16);
    }
}

/// Management while the reactors run: an operator fails a member through the handle; every
/// reactor stops using it, clients see no error and read the right data; the snapshot shows
/// the member failed, per-member counters and latencies; a bad member index is refused.
#[test]
fn operator_fails_a_member_while_clients_run() {
    let reactors = 2usize;
    let (running, _devices, _geo) = start_checkers(reactors, 20_000, 500);
    let h = running.handle();
    assert!(h.fail_member(6).is_err());
    // Fail the member once every member has served requests (as published): on a loaded
    // machine the reactors may not have run at all after a fixed sleep.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !h
        .snapshot()
        .members
        .iter()
        .all(|m| m.counters.reads + m.counters.writes > 0)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no I/O published on every member"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    h.fail_member(2).unwrap();
    // The next publication (within PUBLISH_INTERVAL of each reactor) shows it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let snap = loop {
        let s = h.snapshot();
        if s.members[2].state != MemberState::Online {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "failure never published"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    assert_eq!(snap.members[2].state, MemberState::FailedByOperator);
    assert_eq!(snap.reactors, reactors);
    // Once every reactor has published again (each within PUBLISH_INTERVAL), the counters
    // of the failed member no longer move.
    std::thread::sleep(3 * engine::reactor::PUBLISH_INTERVAL);
    let before = h.snapshot().members[2].counters;
    let done = running.stop().unwrap();
    for f in &done {
        assert!(
            f.errors.is_empty(),
            "{:?}",
            &f.errors[..f.errors.len().min(5)]
        );
    }
    let after = h.snapshot();
    assert!(after
        .members
        .iter()
        .all(|m| m.counters.reads + m.counters.writes > 0));
    assert!(!after.members[0].latency.is_empty());
    assert_eq!(
        after.members[2].counters, before,
        "requests reached the failed member after every reactor knew"
    );
    assert!(after.stats.degraded_reads + after.stats.degraded_writes > 0);
}

/// A `mem` member that dies on command: from the moment `dying` is set, every request it
/// holds or is given completes with an I/O error (EIO) — those whose data already moved
/// too (a write inside `submit`, a read at the `poll` that reports it failed), as a
/// device that fails with writes in its queue reports them failed whether or not they
/// reached the media.
struct Dying {
    mem: MemDevice,
    dying: Arc<std::sync::atomic::AtomicBool>,
}

/// A channel of [`Dying`]: the `mem` channel, and the requests refused since the death
/// (completed by `poll` as failed).
struct DyingChannel {
    ch: <MemDevice as BlockDevice>::Channel,
    dying: Arc<std::sync::atomic::AtomicBool>,
    failed: std::collections::VecDeque<u64>,
}

impl BlockDevice for Dying {
    type Channel = DyingChannel;

    fn info(&self) -> &DeviceInfo {
        self.mem.info()
    }

    fn open_channel(&self) -> Result<DyingChannel, DeviceError> {
        Ok(DyingChannel {
            ch: self.mem.open_channel()?,
            dying: Arc::clone(&self.dying),
            failed: std::collections::VecDeque::new(),
        })
    }
}

impl DyingChannel {
    fn dead(&self) -> bool {
        self.dying.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// EIO, as a dying device reports it.
const EIO: IoError = IoError::Io { errno: 5 };

impl Channel for DyingChannel {
    fn info(&self) -> &DeviceInfo {
        self.ch.info()
    }

    fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        if !self.dead() {
            return self.ch.submit(req);
        }
        if self.in_flight() >= self.info().queue_depth as usize {
            return Err(SubmitError::QueueFull);
        }
        self.failed.push_back(req.tag);
        Ok(())
    }

    fn kick(&mut self) {
        self.ch.kick();
    }

    fn poll(&mut self, out: &mut [Completion]) -> usize {
        let dead = self.dead();
        let mut n = self.ch.poll(out);
        if dead {
            for c in &mut out[..n] {
                c.status = Err(EIO);
            }
        }
        while n < out.len() {
            let Some(tag) = self.failed.pop_front() else {
                break;
            };
            out[n] = Completion {
                tag,
                status: Err(EIO),
            };
            n += 1;
        }
        n
    }

    fn in_flight(&self) -> usize {
        self.ch.in_flight() + self.failed.len()
    }

    fn abort(&mut self, tag: u64) {
        self.ch.abort(tag);
    }

    fn gathers(&self) -> bool {
        self.ch.gathers()
    }
}

/// A member that dies under client reads and writes on two reactors (every request it had
/// taken and every one sent to it after comes back with EIO, whether a read or a write):
/// every reactor fails it — on an error of its own or by the other's message — and sends
/// it nothing more; no client request fails; every read returns what its client last
/// wrote; and the survivors (the oracle, the dead member missing) hold every client's
/// data. (Whether a write is among the requests in flight at the moment of death varies
/// from run to run; `engine::array::tests::full_stripe_writes_with_a_member_write_fault`
/// pins that case down in the simulator.)
#[test]
fn a_member_that_dies_under_writes_is_failed_everywhere_and_loses_nothing() {
    let reactors = 2usize;
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, CHUNK, 512).unwrap();
    let geo = ArrayGeometry::new(g, STRIPES).unwrap();
    let dying = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let devices: Arc<Vec<Dying>> = Arc::new(
        (0..6)
            .map(|i| Dying {
                mem: MemDevice::new(&format!("mem{i}"), STRIPES * CHUNK, 512, 64).unwrap(),
                dying: if i == 2 {
                    Arc::clone(&dying)
                } else {
                    Arc::new(std::sync::atomic::AtomicBool::new(false))
                },
            })
            .collect(),
    );
    let frontends = checkers(geo, reactors, 20_000, 900);
    let running = start_frontends(None, &devices, geo, frontends, false, false).unwrap();
    let h = running.handle();
    // The member dies once every member has served writes (as published): a fixed sleep
    // may find the reactors not yet started on a loaded machine.
    wait_for("writes published on every member", || {
        h.snapshot().members.iter().all(|m| m.counters.writes > 0)
    });
    dying.store(true, std::sync::atomic::Ordering::Release);
    wait_for("the failure published", || {
        h.snapshot().members[2].state.is_failed()
    });
    assert_eq!(h.snapshot().members[2].state, MemberState::Failed(EIO));
    // Once every reactor has published again (each within PUBLISH_INTERVAL) and had time
    // to hear of the failure, nothing more reaches the member.
    std::thread::sleep(3 * engine::reactor::PUBLISH_INTERVAL);
    let before = h.snapshot().members[2].counters;
    let done = running.stop().unwrap();
    let after = h.snapshot();
    assert!(
        after.members[2].counters.errors > 0,
        "the dead member's errors are counted"
    );
    assert_eq!(
        after.members[2].counters, before,
        "requests reached the dead member after every reactor knew"
    );
    assert!(after.stats.degraded_writes > 0, "writes went on degraded");
    // Every request succeeded and every read matched (the checkers read back as they go),
    // and the survivors hold every client's data (the oracle verifies no array with a
    // member missing: it reconstructs the dead member's chunks).
    let images: Vec<Vec<u8>> = devices.iter().map(|d| d.mem.contents()).collect();
    let members: Vec<Option<&[u8]>> = images
        .iter()
        .enumerate()
        .map(|(i, img)| (i != 2).then_some(&img[..]))
        .collect();
    check_members("a member that dies under writes", &done, &members, false);
}

/// Rebuild on real reactor threads: a member fails under client I/O, a blank `mem` device
/// replaces it through the handle, every reactor rebuilds its own stripes while the
/// clients keep reading and writing, the member comes back online everywhere, the
/// published progress shows a rate while it runs, clients see no error and the oracle
/// finds every stripe consistent with the new member's image.
#[test]
fn rebuild_onto_a_replacement_while_clients_run() {
    use engine::process::{ProcessKind, ProcessState};
    for reactors in [1usize, 2, 3] {
        let (running, devices, geo) = start_checkers(reactors, 6_000, 900 + reactors as u64);
        let h = running.handle();
        std::thread::sleep(std::time::Duration::from_millis(20));
        h.fail_member(3).unwrap();
        let wait = |what: &str, cond: &dyn Fn() -> bool| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            while !cond() {
                assert!(std::time::Instant::now() < deadline, "{what}: timed out");
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        };
        wait("failure published", &|| {
            h.snapshot().members[3].state.is_failed()
        });
        // A device too small is refused, and a member that is online cannot be replaced.
        let small = Arc::new(MemDevice::new("small", CHUNK, 512, 64).unwrap());
        assert!(h.replace_member(3, small).is_err());
        let spare = Arc::new(MemDevice::new("spare", STRIPES * CHUNK, 512, 64).unwrap());
        assert!(h.replace_member(1, Arc::clone(&spare)).is_err());
        h.replace_member(3, Arc::clone(&spare)).unwrap();
        wait("rebuild finished", &|| {
            // Feeds the handle's rate window too.
            let _ = h.process_snapshot();
            let s = h.snapshot();
            s.members.iter().all(|m| m.state == MemberState::Online)
        });
        let p = h.process_snapshot().expect("a process was published");
        assert_eq!(p.kind, ProcessKind::Rebuild);
        assert_eq!(p.state, ProcessState::Finished);
        assert_eq!(p.position_stripes, STRIPES);
        // Two samples at least (the wait and this one): a rate; no ETA once finished.
        assert!(p.rate_bytes_per_s.is_some());
        assert_eq!(p.eta_s, None);
        assert_eq!(p.done_member_bytes, geo.member_data_bytes());
        assert!(h.snapshot().control_error.is_none());
        assert!(ADMITS.load(std::sync::atomic::Ordering::Relaxed) >= STRIPES);
        let done = running.stop().unwrap();
        let mut logical = Vec::new();
        for f in &done {
            assert!(
                f.errors.is_empty(),
                "{reactors} reactors: {:?}",
                &f.errors[..f.errors.len().min(5)]
            );
            logical.extend_from_slice(&f.reference);
        }
        let images: Vec<Vec<u8>> = devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                if i == 3 {
                    spare.contents()
                } else {
                    d.contents()
                }
            })
            .collect();
        if let Some(extracted) =
            oracle_extract_raid6_4k("rebuild_onto_a_replacement_while_clients_run", &images)
        {
            assert!(
                extracted[..logical.len()] == logical[..],
                "{reactors} reactors: logical image differs after the rebuild"
            );
        }
    }
}

/// A replace with [`Extras::confirm_replace`] (the target's: it records the swap in the
/// superblocks first): once every reactor has copied the member, the replacement waits as
/// `Copied` and every write still reaches the old device too, so that the array as the
/// superblocks still describe it (the old device in the slot) holds every acknowledged
/// write, and the new device holds the same. With the swap made as soon as the copy ended
/// (as before), writes in that window reached only the new device: a crash there restarted
/// on the old one, which had missed them. Then `complete_replace` swaps it in (refused
/// before the copy and for another serial), and the array with the new device holds the
/// data too.
#[test]
fn a_copied_replacement_waits_for_its_swap_and_the_old_member_keeps_every_write() {
    use engine::array::ReplaceState;
    use engine::reactor::ControlError;
    for reactors in [1usize, 2] {
        let what = format!("{reactors} reactors");
        let seed = 1700 + reactors as u64;
        // The crash side: the swap is never confirmed.
        let (running, devices, _geo) = start_checkers_with(None, reactors, 8_000, seed, true)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let h = running.handle();
        let new = Arc::new(MemDevice::new("new", STRIPES * CHUNK, 512, 64).unwrap());
        // Not before the copy (the first replace's serial is 1).
        assert_eq!(
            h.complete_replace(1),
            Err(ControlError::NotCopied { serial: 1 }),
            "{what}"
        );
        let serial = h.start_replace(2, Arc::clone(&new), 0).unwrap();
        assert_eq!(serial, 1);
        wait_for("the copy", || {
            h.snapshot()
                .replacement
                .is_some_and(|r| r.info.serial == serial && r.info.state == ReplaceState::Copied)
        });
        assert_eq!(
            h.complete_replace(serial + 1),
            Err(ControlError::NotCopied { serial: serial + 1 })
        );
        let done = running.stop().unwrap();
        let r = h.snapshot().replacement.expect("a replacement");
        assert_eq!(
            r.info.state,
            ReplaceState::Copied,
            "{what}: swapped unasked"
        );
        check_stopped(&format!("{what}, old member"), &done, &devices);
        assert!(
            new.contents() == devices[2].contents(),
            "{what}: the replacement differs from the member it copied"
        );
        // The swap confirmed: the new device in the slot holds everything.
        let (running, devices, _geo) =
            start_checkers_with(None, reactors, 8_000, seed + 100, true).unwrap();
        let h = running.handle();
        let new = Arc::new(MemDevice::new("new", STRIPES * CHUNK, 512, 64).unwrap());
        let serial = h.start_replace(2, Arc::clone(&new), 0).unwrap();
        wait_for("the copy", || {
            h.snapshot()
                .replacement
                .is_some_and(|r| r.info.state == ReplaceState::Copied)
        });
        h.complete_replace(serial).unwrap();
        wait_for("the swap", || {
            h.snapshot()
                .replacement
                .is_some_and(|r| r.info.state == ReplaceState::Done)
        });
        // Asking again is harmless.
        h.complete_replace(serial).unwrap();
        let done = running.stop().unwrap();
        let images = (0..devices.len())
            .map(|i| {
                if i == 2 {
                    new.contents()
                } else {
                    devices[i].contents()
                }
            })
            .collect();
        check_images(&format!("{what}, after the swap"), &done, images);
    }
}

/// What a [`GatedWriter`] and its test share.
#[derive(Default)]
struct WriteGate {
    /// Blocks the writer may have written by now.
    limit: std::sync::atomic::AtomicU32,
    /// Blocks whose write was acknowledged.
    acked: std::sync::atomic::AtomicU32,
}

/// Writes 4 KiB blocks `first..first + count` of the array in order, one at a time and
/// each once, with the block's own pattern ([`block_pattern`]), while fewer than
/// `gate.limit` are written; counts the acknowledged ones in `gate.acked`.
struct GatedWriter {
    first: u32,
    count: u32,
    next: u32,
    in_flight: bool,
    gate: Arc<WriteGate>,
    buf: AlignedBuf,
    errors: Vec<String>,
}

/// The contents a [`GatedWriter`] gives block `block`: different in every block.
fn block_pattern(block: u32) -> Vec<u8> {
    (0..CHUNK as u32)
        .map(|i| ((block * 131 + i * 7 + 1) % 251) as u8)
        .collect()
}

impl Frontend for GatedWriter {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        use std::sync::atomic::Ordering;
        if self.in_flight
            || self.next == self.count
            || self.next >= self.gate.limit.load(Ordering::Acquire)
        {
            return false;
        }
        let block = self.first + self.next;
        self.buf[..CHUNK as usize].copy_from_slice(&block_pattern(block));
        // SAFETY: the buffer belongs to this front-end and is untouched until `complete`.
        let buf = unsafe {
            IoBuf::from_raw(
                NonNull::new(self.buf.as_mut_ptr()).unwrap(),
                CHUNK as u32,
                None,
            )
        };
        let r = ArrayRequest {
            tag: u64::from(block),
            op: ArrayOp::Write { fua: false },
            offset_bytes: u64::from(block) * CHUNK,
            len_bytes: CHUNK as u32,
            buf,
        };
        if io.submit(r).is_err() {
            return false;
        }
        self.in_flight = true;
        self.next += 1;
        true
    }

    fn complete(&mut self, c: ArrayCompletion) {
        self.in_flight = false;
        match c.status {
            Ok(()) => {
                self.gate
                    .acked
                    .fetch_add(1, std::sync::atomic::Ordering::Release);
            }
            Err(e) => self
                .errors
                .push(format!("write of block {} failed: {e}", c.tag)),
        }
    }

    fn finished(&self) -> bool {
        self.next == self.count && !self.in_flight
    }
}

/// With [`Extras::confirm_failures`] (the target's: it records failures in the
/// superblocks), a write finished after a member failed is acknowledged only once the
/// caller says the failure is recorded. Before that the member is still current as far
/// as a restart knows, and a crash would reassemble with its stale chunks: the member
/// images taken while the writes wait, the failed member among them, hold every
/// acknowledged write (without the hold, writes acknowledged after the failure read back
/// stale from it). Then `failures_recorded` lets them complete, and the survivors hold
/// every block.
#[test]
fn writes_after_a_member_failure_wait_until_it_is_recorded() {
    for reactors in [1usize, 2] {
        writes_wait_for_the_record(
            &format!("member failure, {reactors} reactors"),
            reactors,
            |h| h.fail_member(3).unwrap(),
            |images| images,
            Some(3),
        );
    }
}

/// The same for a replacement that fails after its copy (before the swap is recorded):
/// until the superblocks drop it, a restart resumes the replace onto it and takes what it
/// holds below the checkpoint as copied, so writes finished since wait for the record.
/// The images a restart would serve have the replacement in the member's slot.
#[test]
fn writes_after_a_replacement_failure_wait_until_it_is_recorded() {
    use engine::array::ReplaceState;
    for reactors in [1usize, 2] {
        let new = Arc::new(MemDevice::new("new", STRIPES * CHUNK, 512, 64).unwrap());
        let dev = Arc::clone(&new);
        writes_wait_for_the_record(
            &format!("replacement failure, {reactors} reactors"),
            reactors,
            move |h| {
                let serial = h.start_replace(2, Arc::clone(&dev), 0).unwrap();
                wait_for("the copy", || {
                    h.snapshot().replacement.is_some_and(|r| {
                        r.info.serial == serial && r.info.state == ReplaceState::Copied
                    })
                });
                h.fail_replacement(serial);
            },
            move |mut images| {
                images[2] = new.contents();
                images
            },
            None,
        );
    }
}

/// Gated writers on `reactors` reactors with [`Extras::confirm_failures`]: a third of
/// the blocks written, then `fail` (which the reactors count as a failure to record),
/// then more writes, which must wait; the member images a restart would assemble then
/// (`restart_images` of the devices' images) must hold every acknowledged block. After
/// `failures_recorded` every write completes and the devices hold every block (without
/// member `missing_at_end`, a failed one).
fn writes_wait_for_the_record(
    what: &str,
    reactors: usize,
    fail: impl FnOnce(&engine::reactor::ReactorHandle),
    restart_images: impl FnOnce(Vec<Vec<u8>>) -> Vec<Vec<u8>>,
    missing_at_end: Option<usize>,
) {
    use std::sync::atomic::Ordering;
    let (devices, geo) = raid6_members();
    let blocks = (geo.capacity_bytes() / CHUNK) as u32;
    let per = blocks / reactors as u32;
    let gates: Vec<Arc<WriteGate>> = (0..reactors)
        .map(|_| Arc::new(WriteGate::default()))
        .collect();
    let frontends: Vec<GatedWriter> = (0..reactors)
        .map(|i| GatedWriter {
            first: i as u32 * per,
            count: per,
            next: 0,
            in_flight: false,
            gate: Arc::clone(&gates[i]),
            buf: AlignedBuf::zeroed(CHUNK as usize),
            errors: Vec::new(),
        })
        .collect();
    let running = start_frontends(None, &devices, geo, frontends, true, true).unwrap();
    let h = running.handle();
    // The failure watcher: told by every reactor of the failure, and again by each shard
    // that starts holding writes (what wakes the target's monitor).
    let told = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&told);
    assert!(h.watch_failures(move || {
        count.fetch_add(1, Ordering::AcqRel);
    }));
    assert!(!h.watch_failures(|| {}), "{what}: a second watcher");
    let acked = || -> Vec<u32> {
        gates
            .iter()
            .map(|g| g.acked.load(Ordering::Acquire))
            .collect()
    };
    let check = |what: &str, images: Vec<Option<Vec<u8>>>, upto: &[u32]| {
        let view: Vec<Option<&[u8]>> = images.iter().map(Option::as_deref).collect();
        // (The oracle verifies no array with a member missing or stale: extract only.)
        if let Some(logical) = oracle_images_raid6_4k(what, &view, false) {
            for (i, &n) in upto.iter().enumerate() {
                for b in i as u32 * per..i as u32 * per + n {
                    let at = (u64::from(b) * CHUNK) as usize;
                    assert!(
                        logical[at..at + CHUNK as usize] == block_pattern(b)[..],
                        "{what}: acknowledged block {b} lost"
                    );
                }
            }
        }
    };
    let (before, during) = (per / 3, 2 * per / 3);
    for g in &gates {
        g.limit.store(before, Ordering::Release);
    }
    wait_for("the first writes", || acked().iter().all(|&a| a == before));
    let stale = h.failure_marks();
    assert_eq!(
        told.load(Ordering::Acquire),
        0,
        "{what}: told before a failure"
    );
    fail(&h);
    // Every reactor has counted it (published), and told the watcher.
    wait_for("the failure on every reactor", || {
        h.failure_marks().total() == reactors as u64
    });
    wait_for("the watcher told of the failure", || {
        told.load(Ordering::Acquire) >= reactors
    });
    let told_of_failure = told.load(Ordering::Acquire);
    for g in &gates {
        g.limit.store(during, Ordering::Release);
    }
    // Each writer's next write waits for the record (and the reactors say so).
    wait_for("a write held on every reactor", || {
        let s = h.snapshot();
        s.requests_in_flight == reactors && s.writes_held == reactors
    });
    // (By each shard holding some: the writes may all be pieces of one shard's stripes.)
    wait_for("the watcher told of the held writes", || {
        told.load(Ordering::Acquire) > told_of_failure
    });
    // Marks taken before the failure release nothing.
    h.failures_recorded(&stale);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(
        acked(),
        vec![before; reactors],
        "{what}: acknowledged before the record"
    );
    // A crash now: the images a restart would assemble.
    let images = restart_images(devices.iter().map(MemDevice::contents).collect());
    check(
        &format!("{what}, restarted before the record"),
        images.into_iter().map(Some).collect(),
        &acked(),
    );
    // Recorded: the held writes complete, and later ones are not held.
    h.failures_recorded(&h.failure_marks());
    wait_for("the held writes", || acked().iter().all(|&a| a == during));
    for g in &gates {
        g.limit.store(per, Ordering::Release);
    }
    wait_for("every write", || acked().iter().all(|&a| a == per));
    let done = running.stop().unwrap();
    for f in &done {
        assert!(f.errors.is_empty(), "{what}: {:?}", f.errors);
    }
    let images = devices
        .iter()
        .enumerate()
        .map(|(m, d)| (Some(m) != missing_at_end).then(|| d.contents()))
        .collect();
    check(&format!("{what}, after the record"), images, &acked());
}

/// Another member failing while a RAID6 rebuilds (one failed plus one being rebuilt is
/// still within its redundancy): the rebuild carries on and finishes, the rebuilt member
/// comes online, the newly failed one stays failed, and clients see no error.
#[test]
fn rebuild_survives_another_failure_on_raid6() {
    let (running, _devices, _geo) = start_checkers(2, 6_000, 1300);
    let h = running.handle();
    let wait = |what: &str, cond: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "{what}: timed out");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };
    h.fail_member(3).unwrap();
    wait("failure published", &|| {
        h.snapshot().members[3].state.is_failed()
    });
    let spare = Arc::new(MemDevice::new("spare", STRIPES * CHUNK, 512, 64).unwrap());
    // Both commands reach each reactor's control ring back to back: member 1 fails as
    // the rebuild of member 3 starts (it takes many loop turns, I/O being asynchronous).
    h.replace_member(3, spare).unwrap();
    h.fail_member(1).unwrap();
    wait("member 3 online", &|| {
        h.snapshot().members[3].state == MemberState::Online
    });
    let snap = h.snapshot();
    assert!(snap.members[1].state.is_failed());
    assert_eq!(
        snap.members
            .iter()
            .filter(|m| m.state == MemberState::Online)
            .count(),
        5
    );
    for f in &running.stop().unwrap() {
        assert!(
            f.errors.is_empty(),
            "{:?}",
            &f.errors[..f.errors.len().min(5)]
        );
    }
}

/// The oracle over member images of a left-symmetric RAID6 with 4 KiB chunks (data offset
/// 0): `verify` must find no mismatch; returns what `extract` reads from them, or `None`
/// without the oracle (after saying on stderr that `test` skips the check).
fn oracle_extract_raid6_4k(test: &str, images: &[Vec<u8>]) -> Option<Vec<u8>> {
    let images: Vec<Option<&[u8]>> = images.iter().map(|i| Some(&i[..])).collect();
    oracle_images_raid6_4k(test, &images, true)
}

/// [`oracle_extract_raid6_4k`] with members given as missing (`None`: the oracle
/// reconstructs their chunks from the others), and `verify` run only when asked (a
/// member left stale fails it; the oracle verifies no array with a member missing).
fn oracle_images_raid6_4k(test: &str, images: &[Option<&[u8]>], verify: bool) -> Option<Vec<u8>> {
    let oracle = Oracle::locate_or_skip(test)?;
    let dir = tempfile::tempdir().unwrap();
    let mut paths = Vec::new();
    for (i, img) in images.iter().enumerate() {
        match img {
            Some(img) => {
                let p = dir.path().join(format!("m{i}.img"));
                std::fs::write(&p, img).unwrap();
                paths.push(p.display().to_string());
            }
            None => paths.push("missing".into()),
        }
    }
    let common = [
        "--level",
        "6",
        "--layout",
        "left-symmetric",
        "--chunk",
        "4096",
    ];
    if verify {
        let mut args: Vec<String> = vec!["verify".into()];
        args.extend(paths.iter().cloned());
        args.extend(common.iter().map(|s| s.to_string()));
        let out = oracle.run_ok(&args).unwrap_or_else(|e| panic!("{e}"));
        assert!(out.contains("mismatches 0"), "{out}");
    }
    let img = dir.path().join("logical.img");
    let mut args: Vec<String> = vec!["extract".into()];
    args.extend(paths.iter().cloned());
    args.extend(common.iter().map(|s| s.to_string()));
    args.extend(["--out".to_string(), img.display().to_string()]);
    oracle.run_ok(&args).unwrap_or_else(|e| panic!("{e}"));
    Some(std::fs::read(&img).unwrap())
}

/// Front-end of [`foreign_reads_race_owner_writes_on_shared_stripes`]: reads and writes of
/// 4 KiB blocks `b` with `b % stride == lane`, several in flight (never two on one block).
struct Interleaved {
    lane: u64,
    stride: u64,
    blocks: u64,
    reference: Vec<u8>,
    bufs: Vec<AlignedBuf>,
    /// Per slot: (write, block) in flight.
    slots: Vec<Option<(bool, u64)>>,
    rng: Rng,
    ops_left: u32,
    errors: Vec<String>,
}

impl Frontend for Interleaved {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        let mut any = false;
        for slot in 0..self.slots.len() {
            if self.slots[slot].is_some() || self.ops_left == 0 {
                continue;
            }
            let mine = self.blocks / self.stride;
            let block = self.lane + self.stride * self.rng.below(mine);
            if self.slots.iter().flatten().any(|&(_, b)| b == block) {
                continue;
            }
            let write = self.rng.below(2) == 0;
            let b = &mut self.bufs[slot][..];
            let at = (block / self.stride * 4096) as usize;
            if write {
                self.rng.fill(b);
                self.reference[at..at + 4096].copy_from_slice(b);
            }
            // SAFETY: slot `slot`'s buffer is untouched until its completion.
            let buf = unsafe { IoBuf::from_raw(NonNull::new(b.as_mut_ptr()).unwrap(), 4096, None) };
            let r = ArrayRequest {
                tag: slot as u64,
                op: if write {
                    ArrayOp::Write { fua: false }
                } else {
                    ArrayOp::Read
                },
                offset_bytes: block * 4096,
                len_bytes: 4096,
                buf,
            };
            if io.submit(r).is_err() {
                break;
            }
            self.slots[slot] = Some((write, block));
            self.ops_left -= 1;
            any = true;
        }
        any
    }

    fn complete(&mut self, c: ArrayCompletion) {
        let slot = c.tag as usize;
        let (write, block) = self.slots[slot].take().expect("slot in flight");
        let at = (block / self.stride * 4096) as usize;
        if let Err(e) = c.status {
            self.errors.push(format!("block {block}: {e}"));
        } else if !write && self.bufs[slot][..] != self.reference[at..at + 4096] {
            self.errors.push(format!("read of block {block} differs"));
        }
    }

    fn finished(&self) -> bool {
        self.ops_left == 0 && self.slots.iter().all(Option::is_none)
    }
}

/// Three reactors hammer the same four stripes, each its own interleaved 4 KiB blocks, four
/// requests in flight each: most reads are of stripes another reactor owns and is writing
/// at that moment (foreign reads through the stripe gate). Halfway a member fails, so
/// foreign reads turn degraded (reading parity the owner's writes change) while writes
/// continue. Every read must return what its front-end last wrote.
#[test]
fn foreign_reads_race_owner_writes_on_shared_stripes() {
    const STRIPES_HERE: u64 = 4;
    const REACTORS: u64 = 3;
    let mut moved = 0;
    for seed in [1u64, 2, 3] {
        let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, CHUNK, 512).unwrap();
        let geo = ArrayGeometry::new(g, STRIPES_HERE).unwrap();
        let blocks = geo.capacity_bytes() / 4096;
        let devices: Arc<Vec<MemDevice>> = Arc::new(
            (0..6)
                .map(|i| MemDevice::new(&format!("mem{i}"), STRIPES_HERE * CHUNK, 512, 64).unwrap())
                .collect(),
        );
        let frontends: Vec<Interleaved> = (0..REACTORS)
            .map(|lane| Interleaved {
                lane,
                stride: REACTORS,
                blocks,
                reference: vec![0; (blocks / REACTORS * 4096) as usize],
                bufs: (0..4).map(|_| AlignedBuf::zeroed(4096)).collect(),
                slots: vec![None; 4],
                rng: Rng::new(seed * 10 + lane),
                ops_left: 60_000,
                errors: Vec::new(),
            })
            .collect();
        let cfg = ReactorConfig {
            cores: vec![None; REACTORS as usize],
            mode: Mode::Adaptive,
            requests: 16,
            foreign_reads: true,
        };
        let running = Reactors::start(
            Arc::clone(&devices),
            geo,
            Parity::new(),
            ArrayConfig::default(),
            cfg,
            frontends,
        )
        .unwrap();
        let h = running.handle();
        // Fail a member once reads have been published (every 100 ms; the run lasts
        // several publications), so healthy and degraded phases both happen.
        let t0 = std::time::Instant::now();
        while h.snapshot().stats.direct_reads == 0 && t0.elapsed().as_secs() < 60 {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        h.fail_member(2).unwrap();
        let done = running.stop().unwrap();
        let st = h.snapshot().stats;
        for f in &done {
            assert!(
                f.errors.is_empty(),
                "seed {seed}: {:?} ({st:?})",
                &f.errors[..f.errors.len().min(5)]
            );
        }
        eprintln!("seed {seed}: {st:?}");
        assert!(
            st.foreign_reads > 0 && st.degraded_reads > 0,
            "seed {seed}: {st:?}"
        );
        moved += st.moved_reads;
    }
    // Whether a foreign read meets a write holding its stripe is up to thread timing;
    // over the seeds some do.
    assert!(moved > 0, "no foreign read was handed to its owner");
}

/// Submits, on each poll, as many 512-byte reads as the reactor accepts (after one
/// malformed request on the first poll), recording what `Io::submit` answered.
struct Bounded {
    bufs: Vec<AlignedBuf>,
    next_tag: u64,
    to_send: u64,
    accepted: Vec<u64>,
    refused_at: Vec<u64>,
    completions: Vec<ArrayCompletion>,
    polls: u32,
}

impl Frontend for Bounded {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        self.polls += 1;
        let mut any = false;
        if self.polls == 1 {
            // Malformed (zero length): completes at once with `Invalid`, yet holds its
            // place in flight until delivered.
            let r = ArrayRequest {
                tag: 7,
                op: ArrayOp::Read,
                offset_bytes: 0,
                len_bytes: 0,
                buf: IoBuf::NONE,
            };
            assert_eq!(io.submit(r), Ok(()));
            self.accepted.push(7);
            any = true;
        }
        while self.next_tag < 100 + self.to_send {
            let tag = self.next_tag;
            let b = &mut self.bufs[(tag - 100) as usize];
            // SAFETY: buffer `tag - 100` belongs to this front-end and is used by this
            // request alone, untouched until the test ends.
            let buf = unsafe { IoBuf::from_raw(NonNull::new(b.as_mut_ptr()).unwrap(), 512, None) };
            let r = ArrayRequest {
                tag,
                op: ArrayOp::Read,
                offset_bytes: (tag - 100) * 4096,
                len_bytes: 512,
                buf,
            };
            match io.submit(r) {
                Ok(()) => {
                    self.accepted.push(tag);
                    self.next_tag += 1;
                    any = true;
                }
                Err(e) => {
                    assert_eq!(e, engine::array::ArrayError::QueueFull);
                    self.refused_at.push(tag);
                    break;
                }
            }
        }
        any
    }

    fn complete(&mut self, c: ArrayCompletion) {
        self.completions.push(c);
    }

    fn finished(&self) -> bool {
        self.completions.len() as u64 == self.to_send + 1
    }
}

/// With one reactor a request goes to the shard under its caller's tag, with no parent
/// entry (`Io::submit_whole`): the reactor's `requests` still bounds what is in flight
/// (a malformed request included, until its completion is delivered), `QueueFull` beyond
/// it, room again once completions are delivered, and every completion carries the tag
/// its caller gave.
#[test]
fn one_reactor_bounds_requests_in_flight_and_answers_under_the_callers_tags() {
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 5, CHUNK, 512).unwrap();
    let geo = ArrayGeometry::new(g, STRIPES).unwrap();
    let devices: Vec<MemDevice> = (0..5)
        .map(|i| MemDevice::new(&format!("mem{i}"), STRIPES * CHUNK, 512, 64).unwrap())
        .collect();
    let fe = Bounded {
        bufs: (0..10).map(|_| AlignedBuf::zeroed(512)).collect(),
        next_tag: 100,
        to_send: 10,
        accepted: Vec::new(),
        refused_at: Vec::new(),
        completions: Vec::new(),
        polls: 0,
    };
    let cfg = ArrayConfig {
        io_timeout_ns: 0,
        write_hold_ns: 0,
        ..ArrayConfig::default()
    };
    let ((), fe) = engine::reactor::run_local(&devices, geo, Parity::new(), cfg, 4, fe, |r| {
        for _ in 0..10_000 {
            r.turn();
            if r.frontend().finished() {
                break;
            }
        }
        assert_eq!(r.in_flight(), 0, "every completion delivered");
    })
    .unwrap();
    // First poll: the malformed request and three reads fill the four places; the fourth
    // read is refused.
    assert_eq!(
        fe.refused_at.first(),
        Some(&103),
        "refusals: {:?}",
        fe.refused_at
    );
    assert_eq!(fe.accepted.len(), 11, "accepted: {:?}", fe.accepted);
    let mut tags: Vec<u64> = fe.completions.iter().map(|c| c.tag).collect();
    tags.sort_unstable();
    let mut want: Vec<u64> = (100..110).collect();
    want.insert(0, 7);
    assert_eq!(tags, want, "completions under the callers' tags");
    for c in &fe.completions {
        if c.tag == 7 {
            assert!(matches!(
                c.status,
                Err(engine::array::ArrayError::Invalid(_))
            ));
        } else {
            assert_eq!(c.status, Ok(()), "read {}", c.tag);
        }
    }
}
