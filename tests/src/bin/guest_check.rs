//! `guest_check`: the checks `tests/guest/run.sh` runs inside its QEMU guest, against real
//! (emulated) NVMe controllers and an AHCI disk, through ferroraid's own back ends.
//!
//! ```text
//! guest_check facts MEMBER...
//!     open each member (drivers::any::open_member: /dev/ngXnY → NVMe passthrough,
//!     vfio:BDF → vfio NVMe driver, /dev/sdX → io_uring) and print its DeviceInfo
//! guest_check model [OPTIONS] MEMBER...
//!     the model-based random read/write test of one array (below)
//! guest_check timeout-drill vfio:BDF
//!     a vfio command that never reaches the controller times out, is aborted, the
//!     controller is reset, the command completes with a timeout, and the queue pair works
//!     again afterwards (data written before the reset reads back)
//! guest_check superblock MEMBER
//!     writes a superblock area through drivers::metadata_io and reads it back
//! ```
//!
//! # The model test
//!
//! Options: `--level 5|6 --layout NAME --chunk BYTES --stripes N --data-offset BYTES
//! --seed N --ops N --depth N --fail MEMBER --fail-how operator|controller-reset
//! [--spare MEMBER] --reference FILE`.
//!
//! 1. Healthy phase: `ops` random requests (reads, writes with and without FUA, write
//!    zeroes), from one block to two stripes long, up to `depth` in flight at once, never
//!    two overlapping ones in flight (so the flat reference image is the model). Every
//!    read is compared with the reference.
//! 2. Flush, then an in-guest parity check: every stripe's chunks read back through fresh
//!    channels of the members, P (and Q) recomputed with `engine::parity` and compared.
//! 3. Member failure: `operator` marks member `--fail` faulty before the degraded phase;
//!    `controller-reset` (vfio members only) disables that member's NVMe controller
//!    behind the driver's back while requests are in flight, a quarter into the degraded
//!    phase: the driver must notice, reset, fail its lost commands, and the array must
//!    fail the member and carry on from redundancy.
//! 4. Degraded phase: `ops` more random requests, verified the same way; the member must
//!    end failed and every array request must have succeeded.
//! 5. Rebuild (with `--spare`): the spare's data area is first filled with random bytes
//!    (so a stripe the rebuild skipped cannot pass for rebuilt: zeros or stale data could),
//!    then the spare takes the failed member's slot (`Array::replace_member`) and a
//!    rebuild (`engine::process`, `ProcessKind::Rebuild`) runs while the random verified
//!    requests go on: `ops` of them, and more until the rebuild has finished. Some client
//!    requests must have completed while the rebuild ran, the rebuild must finish (not
//!    fail), and the spare must come online (`Array::complete_rebuild`). Then a flush and
//!    the in-guest parity check of every stripe again, now over the spare.
//! 6. The whole array is read back and compared (after a rebuild: served by the spare, not
//!    reconstructed); the reference image is written to `--reference` so the host can
//!    hold it against raidref.py's extraction of the member images (without a rebuild,
//!    the failed member as `missing`; after one, the final members, spare included).
//!
//! Exit status 0 when everything held; 1 with a message naming the first difference.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use drivers::any::{open_member, AnyChannel, AnyDevice, MemberConfig};
use engine::array::{Array, ArrayCompletion, ArrayConfig, ArrayOp, ArrayRequest, MemberState};
use engine::buf::AlignedBuf;
use engine::device::{BlockDevice, Channel, Completion, IoBuf, IoError, Op, Request};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::process::{ProcessError, ProcessKind, ProcessRequest, ProcessState};
use ferroraid_tests::Rng;

type Res<T> = Result<T, String>;

/// How long the whole of one phase may take before the check gives up (TCG is slow, but a
/// hang must end in a clear failure, not a CI timeout).
const PHASE_DEADLINE: Duration = Duration::from_secs(300);

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .without_time()
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("facts") => facts(&args[1..]),
        Some("model") => model(&args[1..]),
        Some("timeout-drill") => timeout_drill(&args[1..]),
        Some("superblock") => superblock(&args[1..]),
        _ => Err(
            "usage: guest_check facts|model|timeout-drill|superblock ... (see the source)".into(),
        ),
    };
    if let Err(e) = r {
        eprintln!("guest_check: FAILED: {e}");
        std::process::exit(1);
    }
}

fn open(spec: &str, depth: u32) -> Res<AnyDevice> {
    open_member(Path::new(spec), &MemberConfig::with_queue_depth(depth))
        .map_err(|e| format!("opening {spec}: {e}"))
}

fn kind(d: &AnyDevice) -> &'static str {
    match d {
        AnyDevice::Uring(_) => "uring",
        AnyDevice::NvmePassthru(_) => "nvme-passthru",
        AnyDevice::VfioNvme(_) => "vfio-nvme",
        AnyDevice::Mem(_) => "mem",
        AnyDevice::Null(_) => "null",
        AnyDevice::Missing(_) => "missing",
    }
}

fn facts(members: &[String]) -> Res<()> {
    for m in members {
        let d = open(m, 128)?;
        let i = d.info();
        let extra = match &d {
            AnyDevice::Uring(u) => format!(" device_queue_depth={:?}", u.device_queue_depth()),
            AnyDevice::NvmePassthru(p) => format!(" nsid={} iopoll={}", p.nsid(), p.iopoll()),
            AnyDevice::VfioNvme(v) => format!(" nsid={} io_queues={}", v.nsid(), v.io_queues()),
            _ => String::new(),
        };
        println!(
            "facts: {m} backend={} block={} capacity={} queue_depth={} max_transfer={} \
             volatile_cache={} write_zeroes={} discard={}{extra}",
            kind(&d),
            i.block_bytes,
            i.capacity_bytes,
            i.queue_depth,
            i.max_transfer_bytes,
            i.volatile_cache,
            i.write_zeroes,
            i.discard
        );
    }
    Ok(())
}

struct ModelOpts {
    level: Level,
    layout: Layout,
    chunk: u64,
    stripes: u64,
    data_offset: u64,
    seed: u64,
    ops: usize,
    depth: usize,
    fail: u16,
    fail_by_reset: bool,
    spare: Option<String>,
    reference: Option<PathBuf>,
    members: Vec<String>,
}

fn parse_model(args: &[String]) -> Res<ModelOpts> {
    let mut o = ModelOpts {
        level: Level::Raid6,
        layout: Layout::LeftSymmetric,
        chunk: 64 << 10,
        stripes: 32,
        data_offset: 1 << 20,
        seed: 1,
        ops: 1000,
        depth: 8,
        fail: 0,
        fail_by_reset: false,
        spare: None,
        reference: None,
        members: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or(format!("{a} needs a value"));
        let num = |v: String| v.parse::<u64>().map_err(|e| format!("{a} {v}: {e}"));
        match a.as_str() {
            "--level" => o.level = val()?.parse().map_err(|e| format!("--level: {e}"))?,
            "--layout" => o.layout = val()?.parse().map_err(|e| format!("--layout: {e}"))?,
            "--chunk" => o.chunk = num(val()?)?,
            "--stripes" => o.stripes = num(val()?)?,
            "--data-offset" => o.data_offset = num(val()?)?,
            "--seed" => o.seed = num(val()?)?,
            "--ops" => o.ops = num(val()?)? as usize,
            "--depth" => o.depth = (num(val()?)? as usize).max(1),
            "--fail" => o.fail = num(val()?)? as u16,
            "--fail-how" => {
                o.fail_by_reset = match val()?.as_str() {
                    "operator" => false,
                    "controller-reset" => true,
                    other => {
                        return Err(format!("--fail-how {other}: operator or controller-reset"))
                    }
                }
            }
            "--spare" => o.spare = Some(val()?),
            "--reference" => o.reference = Some(PathBuf::from(val()?)),
            m if !m.starts_with("--") => o.members.push(m.to_string()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(o)
}

/// One request in flight: its range, op and buffer index.
#[derive(Clone, Copy)]
struct Flight {
    op: ArrayOp,
    off: u64,
    len: u64,
    buf: usize,
}

struct Model {
    arr: Array<AnyChannel>,
    reference: Vec<u8>,
    bufs: Vec<AlignedBuf>,
    free_bufs: Vec<usize>,
    flights: Vec<Option<Flight>>,
    rng: Rng,
    start: Instant,
    verified_reads: u64,
    requests: u64,
}

impl Model {
    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// Picks a random request not overlapping anything in flight (bounded tries).
    fn pick(&mut self) -> Option<(ArrayOp, u64, u64)> {
        let cap = self.arr.geometry().capacity_bytes();
        let stripe = self.arr.geometry().geometry().stripe_data_bytes();
        let block = 4096u64; // 4 KiB: fine for 512-byte and 4 KiB members alike
        for _ in 0..16 {
            let max_blocks = if self.rng.below(2) == 0 {
                16
            } else {
                2 * stripe / block
            };
            let len = block * (1 + self.rng.below(max_blocks));
            let off = block * self.rng.below((cap - len) / block + 1);
            let overlaps = self
                .flights
                .iter()
                .flatten()
                .any(|f| off < f.off + f.len && f.off < off + len);
            if overlaps {
                continue;
            }
            let k = self.rng.below(16);
            let op = if k == 0 {
                ArrayOp::WriteZeroes {
                    fua: self.rng.below(2) == 0,
                }
            } else if k < 8 {
                ArrayOp::Write {
                    fua: self.rng.below(8) == 0,
                }
            } else {
                ArrayOp::Read
            };
            return Some((op, off, len));
        }
        None
    }

    fn submit(&mut self, op: ArrayOp, off: u64, len: u64) -> Res<()> {
        let b = self.free_bufs.pop().expect("a buffer per request slot");
        let tag = self
            .flights
            .iter()
            .position(Option::is_none)
            .expect("a free request slot");
        let buf = &mut self.bufs[b][..len as usize];
        match op {
            ArrayOp::Write { .. } => {
                self.rng.fill(buf);
                self.reference[off as usize..(off + len) as usize].copy_from_slice(buf);
            }
            ArrayOp::WriteZeroes { .. } => {
                self.reference[off as usize..(off + len) as usize].fill(0);
            }
            _ => buf.fill(0xA5),
        }
        let io = if op.has_buffer() {
            // SAFETY: the buffer belongs to this request until its completion is polled
            // (it is off the free list), and the buffers outlive the array.
            unsafe { IoBuf::from_slice(buf) }
        } else {
            IoBuf::NONE
        };
        self.arr
            .submit(ArrayRequest {
                tag: tag as u64,
                op,
                offset_bytes: off,
                len_bytes: len as u32,
                buf: io,
            })
            .map_err(|e| format!("array submit: {e}"))?;
        self.flights[tag] = Some(Flight {
            op,
            off,
            len,
            buf: b,
        });
        self.requests += 1;
        Ok(())
    }

    /// Processes and reaps; checks every completion.
    fn turn(&mut self) -> Res<usize> {
        let now = self.now_ns();
        self.arr.set_now(now);
        self.arr.process();
        let mut out = [ArrayCompletion {
            tag: 0,
            status: Ok(()),
        }; 16];
        let n = self.arr.poll(&mut out);
        for c in &out[..n] {
            let f = self.flights[c.tag as usize]
                .take()
                .ok_or(format!("completion of unknown tag {}", c.tag))?;
            if let Err(e) = c.status {
                let members: Vec<String> = (0..self.arr.geometry().geometry().members())
                    .map(|i| {
                        format!(
                            "{i}: {:?}, {} errors",
                            self.arr.member_states().nth(usize::from(i)),
                            self.arr.member_counters(i).errors
                        )
                    })
                    .collect();
                return Err(format!(
                    "{:?} at {}+{} failed: {e} (members: {})",
                    f.op,
                    f.off,
                    f.len,
                    members.join("; ")
                ));
            }
            if f.op == ArrayOp::Read {
                let got = &self.bufs[f.buf][..f.len as usize];
                let want = &self.reference[f.off as usize..(f.off + f.len) as usize];
                if got != want {
                    return Err(format!(
                        "read {}+{} differs from the model: {}",
                        f.off,
                        f.len,
                        ferroraid_tests::first_difference(got, want).unwrap_or_default()
                    ));
                }
                self.verified_reads += 1;
            }
            self.free_bufs.push(f.buf);
        }
        Ok(n)
    }

    fn in_flight(&self) -> usize {
        self.flights.iter().flatten().count()
    }

    /// Runs `ops` random requests; `at_quarter` runs once a quarter of the way in (with
    /// requests in flight).
    fn phase(&mut self, name: &str, ops: usize, mut at_quarter: impl FnMut(&mut Self)) -> Res<()> {
        let deadline = Instant::now() + PHASE_DEADLINE;
        let mut issued = 0;
        let mut fired = false;
        let depth = self.flights.len();
        while issued < ops || self.in_flight() > 0 {
            while issued < ops && self.in_flight() < depth {
                let Some((op, off, len)) = self.pick() else {
                    break;
                };
                self.submit(op, off, len)?;
                issued += 1;
            }
            if !fired && issued >= ops / 4 && self.in_flight() > 0 {
                fired = true;
                at_quarter(self);
            }
            self.turn()?;
            if Instant::now() > deadline {
                return Err(format!(
                    "{name}: not finished after {PHASE_DEADLINE:?} ({issued} of {ops} issued, {} in flight)",
                    self.in_flight()
                ));
            }
        }
        Ok(())
    }

    /// One request alone, to completion.
    fn one(&mut self, op: ArrayOp, off: u64, len: u64) -> Res<()> {
        self.submit(op, off, len)?;
        let deadline = Instant::now() + PHASE_DEADLINE;
        while self.in_flight() > 0 {
            self.turn()?;
            if Instant::now() > deadline {
                return Err(format!("{op:?} at {off}+{len} never completed"));
            }
        }
        Ok(())
    }
}

fn model(args: &[String]) -> Res<()> {
    let o = parse_model(args)?;
    let n = o.members.len() as u16;
    let started = Instant::now();
    let mut devs: Vec<AnyDevice> = Vec::new();
    if let Some(spare) = &o.spare {
        // A distinct device: the array still holds the failed member's channel when the
        // spare's is put in (and a vfio controller opens once).
        if let Some(i) = o.members.iter().position(|m| m == spare) {
            return Err(format!("the spare {spare} is member {i} of the array"));
        }
    }
    for m in &o.members {
        devs.push(open(m, 32)?);
    }
    let block = devs
        .iter()
        .map(|d| d.info().block_bytes)
        .max()
        .unwrap_or(512);
    let g = Geometry::new(o.level, o.layout, n, o.chunk, block)
        .map_err(|e| format!("geometry: {e}"))?;
    let geo = ArrayGeometry::new(g, o.stripes).map_err(|e| format!("geometry: {e}"))?;
    let need = o.data_offset + geo.member_data_bytes();
    for d in &devs {
        if d.info().capacity_bytes < need {
            return Err(format!(
                "{} holds {} bytes, the array needs {need}",
                d.info().name,
                d.info().capacity_bytes
            ));
        }
    }
    if o.fail >= n {
        return Err(format!("--fail {} is not a member index", o.fail));
    }
    if o.fail_by_reset && !matches!(devs[usize::from(o.fail)], AnyDevice::VfioNvme(_)) {
        return Err("--fail-how controller-reset needs a vfio member to fail".into());
    }
    let chans = devs
        .iter()
        .map(|d| {
            d.open_channel()
                .map_err(|e| format!("channel of {}: {e}", d.info().name))
        })
        .collect::<Res<Vec<_>>>()?;
    let cfg = ArrayConfig {
        data_offset_bytes: o.data_offset,
        ..ArrayConfig::default()
    };
    let arr = Array::new(geo, chans, Parity::new(), cfg).map_err(|e| format!("array: {e}"))?;
    let cap = geo.capacity_bytes();
    let max_len = 2 * g.stripe_data_bytes();
    let mut m = Model {
        arr,
        reference: vec![0; cap as usize],
        bufs: (0..o.depth)
            .map(|_| AlignedBuf::zeroed(max_len as usize))
            .collect(),
        free_bufs: (0..o.depth).rev().collect(),
        flights: vec![None; o.depth],
        rng: Rng::new(o.seed),
        start: Instant::now(),
        verified_reads: 0,
        requests: 0,
    };
    let what = format!(
        "RAID{} {} {}x{} chunk {} KiB over {}",
        o.level.md_level(),
        o.layout.name(),
        n,
        geo.member_data_bytes() >> 10,
        o.chunk >> 10,
        devs.iter().map(kind).collect::<Vec<_>>().join(",")
    );
    println!(
        "model: {what}: healthy phase, {} ops at depth {}",
        o.ops, o.depth
    );
    // The array starts over whatever the members held: write it all first (full stripes).
    let mut off = 0;
    while off < cap {
        let len = (2 * g.stripe_data_bytes()).min(cap - off);
        m.one(ArrayOp::Write { fua: false }, off, len)?;
        off += len;
    }
    m.phase("healthy phase", o.ops, |_| {})?;
    m.one(ArrayOp::Flush, 0, 0)?;
    check_parity(&devs, &geo, o.data_offset)?;
    println!("model: {what}: parity of every stripe verified in the guest");

    if !o.fail_by_reset {
        m.arr.fail_member_by_operator(o.fail);
        println!(
            "model: member {} ({}) failed by the operator",
            o.fail,
            o.members[usize::from(o.fail)]
        );
    }
    let fail = usize::from(o.fail);
    let dev_fail = &devs[fail];
    m.phase("degraded phase", o.ops, |_m| {
        if o.fail_by_reset {
            if let AnyDevice::VfioNvme(v) = dev_fail {
                println!(
                    "model: disabling the NVMe controller of member {fail} ({}) with requests in flight",
                    v.bdf()
                );
                v.inject_controller_disable();
            }
        }
    })?;
    let state = m
        .arr
        .member_states()
        .nth(fail)
        .expect("member index checked");
    if state == MemberState::Online {
        return Err(format!("member {fail} is still online after its failure"));
    }
    if o.fail_by_reset {
        if let AnyDevice::VfioNvme(v) = dev_fail {
            if v.resets() == 0 {
                return Err("the controller was disabled but the driver never reset it".into());
            }
            println!(
                "model: member {fail} failed with {state:?}; controller resets: {}",
                v.resets()
            );
        }
    }
    for i in 0..n {
        println!(
            "model: member {i} ({}): {:?}, {} errors",
            o.members[usize::from(i)],
            m.arr.member_states().nth(usize::from(i)).expect("member"),
            m.arr.member_counters(i).errors
        );
    }
    let rebuilt = rebuild_step(&mut m, &mut devs, &o, &what)?;
    m.one(ArrayOp::Flush, 0, 0)?;
    // Everything reads back (degraded: reconstructed; rebuilt: from the spare itself).
    let degraded_reads_before = m.arr.stats().degraded_reads;
    let mut off = 0;
    while off < cap {
        let len = (2 * g.stripe_data_bytes()).min(cap - off);
        m.one(ArrayOp::Read, off, len)?;
        off += len;
    }
    let st = m.arr.stats();
    if st.degraded_reads == 0 {
        return Err("the degraded phase did no degraded read".into());
    }
    if rebuilt && st.degraded_reads != degraded_reads_before {
        return Err(format!(
            "after the rebuild the read-back still reconstructed ({} degraded reads)",
            st.degraded_reads - degraded_reads_before
        ));
    }
    if let Some(p) = &o.reference {
        std::fs::write(p, &m.reference).map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    println!(
        "model: {what}: ok: {} requests, {} reads verified, stats {{full {}, rmw {}, rcw {}, \
         degraded reads {}, degraded writes {}, member failures {}}}, {:.1} s",
        m.requests,
        m.verified_reads,
        st.full_stripe_writes,
        st.rmw_writes,
        st.rcw_writes,
        st.degraded_reads,
        st.degraded_writes,
        st.member_failures,
        started.elapsed().as_secs_f64()
    );
    drop(m);
    drop(devs);
    Ok(())
}

/// Step 5 of the model test (module docs): with `--spare`, fills the spare's data area
/// with random bytes, puts it into the failed member's slot, rebuilds it under the model's
/// random verified load, brings it online and checks every stripe's parity over the final
/// members; `devs[fail]` is then the spare. Returns whether it rebuilt (false without
/// `--spare`: the array stays degraded).
fn rebuild_step(m: &mut Model, devs: &mut [AnyDevice], o: &ModelOpts, what: &str) -> Res<bool> {
    let Some(spec) = &o.spare else {
        return Ok(false);
    };
    let fail = o.fail;
    let slot = usize::from(fail);
    let geo = *m.arr.geometry();
    let started = Instant::now();
    let spare = {
        let deadline = Instant::now() + PHASE_DEADLINE;
        // Aborted requests to the failed member may still be on their way back
        // (`MemberBusy`); `replace_member` checks the spare itself.
        loop {
            match m.arr.check_replace(fail, devs[slot].info()) {
                Ok(()) => break,
                Err(ProcessError::MemberBusy { .. }) if Instant::now() < deadline => {
                    m.turn()?;
                }
                Err(e) => return Err(format!("replacing member {fail}: {e}")),
            }
        }
        let spare = open(spec, 32)?;
        poison(&spare, o.data_offset, geo.member_data_bytes(), o.seed)?;
        spare
    };
    let ch = spare
        .open_channel()
        .map_err(|e| format!("channel of the spare {spec}: {e}"))?;
    let old = m
        .arr
        .replace_member(fail, ch)
        .map_err(|e| format!("replacing member {fail} with {spec}: {e}"))?;
    drop(old);
    drop(std::mem::replace(&mut devs[slot], spare));
    let state = m
        .arr
        .member_states()
        .nth(slot)
        .expect("member index checked");
    if state != MemberState::Rebuilding {
        return Err(format!(
            "the spare in slot {fail} is {state:?}, not Rebuilding"
        ));
    }
    m.arr
        .start_process(&ProcessRequest::whole(ProcessKind::Rebuild))
        .map_err(|e| format!("starting the rebuild: {e}"))?;
    println!(
        "model: member {fail} replaced by the spare {spec} ({}, its data area filled with \
         random bytes): rebuilding under {} random requests",
        kind(&devs[slot]),
        o.ops
    );
    // Client requests go on while the rebuild runs: `ops` of them, and more until it has
    // finished; then the last ones drain.
    let deadline = Instant::now() + PHASE_DEADLINE;
    let depth = m.flights.len();
    let mut issued = 0;
    let mut during = 0;
    loop {
        let p = m.arr.process_progress().expect("a rebuild was started");
        if let ProcessState::Failed(e) = p.state {
            return Err(format!(
                "the rebuild failed at stripe {} of {}: {e}",
                p.position_stripes,
                geo.stripes()
            ));
        }
        let running = p.state == ProcessState::Running;
        let more = running || issued < o.ops;
        if !more && m.in_flight() == 0 {
            break;
        }
        while more && m.in_flight() < depth {
            let Some((op, off, len)) = m.pick() else {
                break;
            };
            m.submit(op, off, len)?;
            issued += 1;
        }
        let n = m.turn()?;
        if m.arr
            .process_progress()
            .is_some_and(|p| p.state == ProcessState::Running)
        {
            during += n;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "rebuild phase: not finished after {PHASE_DEADLINE:?} (rebuild {:?}, {issued} \
                 requests issued, {} in flight)",
                m.arr
                    .process_progress()
                    .map(|p| (p.state, p.done_stripes, p.total_stripes)),
                m.in_flight()
            ));
        }
    }
    let p = m.arr.process_progress().expect("a rebuild was started");
    if p.state != ProcessState::Finished || p.done_stripes != geo.stripes() {
        return Err(format!(
            "the rebuild ended {:?} with {} of {} stripes done",
            p.state,
            p.done_stripes,
            geo.stripes()
        ));
    }
    if during == 0 {
        return Err("no client request completed while the rebuild ran".into());
    }
    let online = m.arr.complete_rebuild();
    if online.as_slice() != [fail] {
        return Err(format!(
            "the finished rebuild brought {online:?} online, not member {fail}"
        ));
    }
    for (i, st) in m.arr.member_states().enumerate() {
        if st != MemberState::Online {
            return Err(format!("member {i} is {st:?} after the rebuild"));
        }
    }
    m.one(ArrayOp::Flush, 0, 0)?;
    check_parity(devs, &geo, o.data_offset)?;
    println!(
        "model: {what}: member {fail} rebuilt onto {spec} in {:.1} s: {} stripes, {issued} \
         requests in the rebuild phase, {during} of them completed while the rebuild ran; \
         all members online; parity of every stripe verified in the guest",
        started.elapsed().as_secs_f64(),
        p.done_stripes
    );
    Ok(true)
}

/// Fills `len` bytes at `offset` of `dev` with random bytes from `seed` (chunk-sized
/// writes, then a flush): what a rebuild must overwrite entirely.
fn poison(dev: &AnyDevice, offset: u64, len: u64, seed: u64) -> Res<()> {
    let mut ch = dev
        .open_channel()
        .map_err(|e| format!("channel of {}: {e}", dev.info().name))?;
    let step = (256u64 << 10).min(u64::from(dev.info().max_transfer_bytes));
    let mut buf = AlignedBuf::zeroed(step as usize);
    let mut rng = Rng::new(seed ^ 0x5350_4152_4520_5253);
    let mut off = 0;
    while off < len {
        let n = step.min(len - off) as usize;
        rng.fill(&mut buf[..n]);
        one_sync(
            &mut ch,
            Op::Write { fua: false },
            offset + off,
            &mut buf[..n],
        )?;
        off += n as u64;
    }
    one_sync(&mut ch, Op::Flush, 0, &mut [])
}

/// Reads every stripe's chunks through fresh channels and checks P (and Q).
fn check_parity(devs: &[AnyDevice], geo: &ArrayGeometry, data_offset: u64) -> Res<()> {
    let g = geo.geometry();
    let chunk = g.chunk_bytes() as usize;
    let parity = Parity::new();
    let mut chans = devs
        .iter()
        .map(|d| d.open_channel().map_err(|e| format!("check channel: {e}")))
        .collect::<Res<Vec<_>>>()?;
    let mut bufs: Vec<AlignedBuf> = (0..devs.len()).map(|_| AlignedBuf::zeroed(chunk)).collect();
    let mut p = AlignedBuf::zeroed(chunk);
    let mut q = AlignedBuf::zeroed(chunk);
    for s in 0..geo.stripes() {
        let off = data_offset + s * chunk as u64;
        for (i, ch) in chans.iter_mut().enumerate() {
            read_sync(ch, off, &mut bufs[i])?;
        }
        let st = g.stripe(s);
        let k = st.data_chunks();
        let mut data: Vec<&[u8]> = vec![&[]; usize::from(k)];
        for idx in 0..k {
            let slot = if st.q_member().is_some() {
                st.q_slot(idx)
            } else {
                idx
            };
            data[usize::from(slot)] = &bufs[usize::from(st.data_member(idx))];
        }
        match st.q_member() {
            Some(qm) => {
                parity.gen_pq(&data, &mut p, &mut q);
                if q[..] != bufs[usize::from(qm)][..] {
                    return Err(format!("stripe {s}: Q on member {qm} is wrong"));
                }
            }
            None => parity.gen_p(&data, &mut p),
        }
        if p[..] != bufs[usize::from(st.p_member())][..] {
            return Err(format!(
                "stripe {s}: P on member {} is wrong",
                st.p_member()
            ));
        }
    }
    Ok(())
}

/// One read on a channel, waited for (bounded).
fn read_sync(ch: &mut AnyChannel, off: u64, buf: &mut [u8]) -> Res<()> {
    one_sync(ch, Op::Read, off, buf)
}

fn one_sync(ch: &mut AnyChannel, op: Op, off: u64, buf: &mut [u8]) -> Res<()> {
    let io = if op.has_data() {
        // SAFETY: waited for below before `buf` is released.
        unsafe { IoBuf::from_slice(buf) }
    } else {
        IoBuf::NONE
    };
    ch.submit(Request {
        tag: 7,
        op,
        offset_bytes: off,
        len_bytes: io.len(),
        buf: io,
    })
    .map_err(|e| format!("{}: submit {op:?}: {e}", ch.info().name))?;
    ch.kick();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = [Completion::EMPTY; 1];
    loop {
        if ch.poll(&mut out) == 1 {
            return out[0]
                .status
                .map_err(|e| format!("{}: {op:?} at {off}: {e}", ch.info().name));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{}: {op:?} at {off} never completed",
                ch.info().name
            ));
        }
        std::hint::spin_loop();
    }
}

fn timeout_drill(args: &[String]) -> Res<()> {
    let [spec] = args else {
        return Err("timeout-drill takes one vfio:BDF".into());
    };
    let dev = open(spec, 16)?;
    let AnyDevice::VfioNvme(v) = &dev else {
        return Err(format!("{spec} is not a vfio member"));
    };
    let mut ch = match dev.open_channel() {
        Ok(AnyChannel::VfioNvme(c)) => c,
        Ok(_) => unreachable!("a vfio device opens vfio channels"),
        Err(e) => return Err(format!("channel: {e}")),
    };
    let block = dev.info().block_bytes as usize;
    let mut pattern = AlignedBuf::zeroed(8 * block);
    Rng::new(99).fill(&mut pattern);
    // A write that completes normally, to read back after the reset.
    let mut w = AlignedBuf::from_slice(&pattern);
    write_wait(&mut ch, 1 << 20, &mut w)?;
    let resets_before = v.resets();
    ch.set_command_timeout(Duration::from_millis(50));
    // Queued but never announced to the controller (no kick): the commands cannot complete,
    // so they must time out, be aborted, and end with a controller reset.
    let mut bufs: Vec<AlignedBuf> = (0..4).map(|_| AlignedBuf::zeroed(block)).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        // SAFETY: `bufs` outlives the channel's use of them: every request is reaped below
        // before the buffers are dropped (or the channel is dropped first).
        let io = unsafe { IoBuf::from_slice(b) };
        ch.submit(Request {
            tag: 100 + i as u64,
            op: Op::Read,
            offset_bytes: 0,
            len_bytes: block as u32,
            buf: io,
        })
        .map_err(|e| format!("submit: {e}"))?;
    }
    let t = Instant::now();
    let mut done = 0;
    let mut out = [Completion::EMPTY; 8];
    while done < 4 {
        let n = ch.poll(&mut out);
        for c in &out[..n] {
            if c.status != Err(IoError::Timeout) {
                return Err(format!(
                    "a never-submitted command completed with {:?}",
                    c.status
                ));
            }
        }
        done += n;
        if t.elapsed() > Duration::from_secs(60) {
            return Err(format!(
                "only {done} of 4 timed-out commands completed within 60 s"
            ));
        }
    }
    let st = ch.stats();
    if st.aborts == 0 || v.resets() <= resets_before {
        return Err(format!(
            "expected aborts and a controller reset: aborts {}, resets {} → {}",
            st.aborts,
            resets_before,
            v.resets()
        ));
    }
    println!(
        "timeout-drill: 4 commands timed out after {:?}: {} aborts, controller reset, all \
         completed with Timeout",
        t.elapsed(),
        st.aborts
    );
    ch.set_command_timeout(Duration::from_secs(30));
    let mut r = AlignedBuf::zeroed(8 * block);
    read_wait(&mut ch, 1 << 20, &mut r)?;
    if r[..] != pattern[..] {
        return Err("data written before the reset reads back differently after it".into());
    }
    println!("timeout-drill: {spec}: the queue pair works after the reset; data intact");
    drop(ch);
    drop(bufs);
    Ok(())
}

fn write_wait(ch: &mut drivers::vfio_nvme::VfioNvmeChannel, off: u64, b: &mut [u8]) -> Res<()> {
    wait_one(ch, Op::Write { fua: true }, off, b)
}

fn read_wait(ch: &mut drivers::vfio_nvme::VfioNvmeChannel, off: u64, b: &mut [u8]) -> Res<()> {
    wait_one(ch, Op::Read, off, b)
}

fn wait_one(
    ch: &mut drivers::vfio_nvme::VfioNvmeChannel,
    op: Op,
    off: u64,
    b: &mut [u8],
) -> Res<()> {
    // SAFETY: waited for below.
    let io = unsafe { IoBuf::from_slice(b) };
    ch.submit(Request {
        tag: 1,
        op,
        offset_bytes: off,
        len_bytes: io.len(),
        buf: io,
    })
    .map_err(|e| format!("submit: {e}"))?;
    ch.kick();
    let t = Instant::now();
    let mut out = [Completion::EMPTY; 1];
    loop {
        if ch.poll(&mut out) == 1 {
            return out[0].status.map_err(|e| format!("{op:?}: {e}"));
        }
        if t.elapsed() > Duration::from_secs(60) {
            return Err(format!("{op:?} never completed"));
        }
    }
}

fn superblock(args: &[String]) -> Res<()> {
    let [spec] = args else {
        return Err("superblock takes one member".into());
    };
    let p = Path::new(spec);
    let mut area = [0u8; engine::metadata::SUPERBLOCK_AREA_BYTES];
    Rng::new(5).fill(&mut area);
    let dev = open(spec, 2)?;
    drivers::metadata_io::write_area_to(&dev, p, &area).map_err(|e| e.to_string())?;
    drop(dev);
    let back = drivers::metadata_io::read_superblock_area(p).map_err(|e| e.to_string())?;
    if back != area {
        return Err(format!("{spec}: the superblock area read back differs"));
    }
    println!("superblock: {spec}: 4 KiB area at byte 4096 written and read back");
    Ok(())
}
