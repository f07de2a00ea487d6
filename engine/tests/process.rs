//! Background processes on simulated members in virtual time, with 1, 2 and 4 shards:
//! rebuild under client writes (exact bytes, parity everywhere), double rebuild on RAID6,
//! check / repair of injected mismatches, resync after a crash and over given ranges, a
//! failed array staying failed, resume from a checkpoint, a rebuild target failing, and
//! the pacer's admission. Every run is seeded and deterministic.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use engine::array::{
    Array, ArrayCompletion, ArrayConfig, ArrayError, ArrayOp, ArrayRequest, MemberState,
    ReplaceState,
};
use engine::buf::AlignedBuf;
use engine::device::{BlockDevice, IoBuf, IoError};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level, Role};
use engine::parity::Parity;
use engine::process::{ProcessError, ProcessKind, ProcessRequest, ProcessSnapshot, ProcessState};
use engine::qos::{Admission, Pacer};
use engine::shard::ShardedArray;
use engine::sim::{Fault, FaultRule, OpFilter, Profile, SimChannel, SimClock, SimDevice};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

const BLOCK: u32 = 512;

/// Client I/O of the test, in flight.
struct Pending {
    tag: u64,
    range: Range<u64>,
    write: bool,
    buf: AlignedBuf,
}

struct World {
    arr: ShardedArray<SimChannel>,
    devs: Vec<SimDevice>,
    clock: SimClock,
    geo: ArrayGeometry,
    /// What the array must read back.
    model: Vec<u8>,
    rng: ChaCha8Rng,
    pending: Vec<Pending>,
    next_tag: u64,
    /// Client requests completed, and how many failed.
    completed: u64,
    failed: Vec<(u64, ArrayError)>,
    /// Reads that returned other bytes than the model.
    bad_reads: u64,
    shards: usize,
}

fn config() -> ArrayConfig {
    ArrayConfig {
        requests: 64,
        stripe_ops: 16,
        ..ArrayConfig::default()
    }
}

fn sim_dev(name: &str, geo: &ArrayGeometry, clock: &SimClock, seed: u64) -> SimDevice {
    SimDevice::new(
        name,
        geo.member_data_bytes(),
        BLOCK,
        Profile::nvme_ssd(),
        clock.clone(),
        seed,
    )
    .unwrap()
}

impl World {
    fn new(
        level: Level,
        members: u16,
        chunk: u64,
        stripes: u64,
        shards: usize,
        seed: u64,
    ) -> World {
        World::with_layout(
            level,
            Layout::LeftSymmetric,
            members,
            chunk,
            stripes,
            shards,
            seed,
        )
    }

    /// A six-member RAID6 of 8 KiB chunks over `stripes` stripes, filled
    /// ([`Self::fill`]).
    fn raid6_filled(stripes: u64, shards: usize, seed: u64) -> World {
        let mut w = World::new(Level::Raid6, 6, 8192, stripes, shards, seed);
        w.fill();
        w
    }

    fn with_layout(
        level: Level,
        layout: Layout,
        members: u16,
        chunk: u64,
        stripes: u64,
        shards: usize,
        seed: u64,
    ) -> World {
        let g = Geometry::new(level, layout, members, chunk, BLOCK).unwrap();
        let geo = ArrayGeometry::new(g, stripes).unwrap();
        let clock = SimClock::new();
        let devs: Vec<SimDevice> = (0..members)
            .map(|i| sim_dev(&format!("d{i}"), &geo, &clock, seed * 100 + u64::from(i)))
            .collect();
        World::over(devs, geo, clock, shards, seed, config())
    }

    fn over(
        devs: Vec<SimDevice>,
        geo: ArrayGeometry,
        clock: SimClock,
        shards: usize,
        seed: u64,
        cfg: ArrayConfig,
    ) -> World {
        let arrays = (0..shards)
            .map(|_| {
                let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
                Array::new(geo, chans, Parity::new(), cfg).unwrap()
            })
            .collect();
        World {
            arr: ShardedArray::new(arrays, 64),
            model: vec![0; geo.capacity_bytes() as usize],
            devs,
            clock,
            geo,
            rng: ChaCha8Rng::seed_from_u64(seed),
            pending: Vec::new(),
            next_tag: 1,
            completed: 0,
            failed: Vec::new(),
            bad_reads: 0,
            shards,
        }
    }

    /// One executor turn: run the shards, take completions, and advance virtual time to
    /// the next event when nothing could run.
    fn step(&mut self) {
        self.arr.set_now(self.clock.now_ns());
        let progressed = self.arr.process();
        let mut out = [ArrayCompletion {
            tag: 0,
            status: Ok(()),
        }; 16];
        let n = self.arr.poll(&mut out);
        for c in &out[..n] {
            let i = self
                .pending
                .iter()
                .position(|p| p.tag == c.tag)
                .expect("completion of a pending request");
            let p = self.pending.swap_remove(i);
            self.completed += 1;
            match c.status {
                Err(e) => self.failed.push((c.tag, e)),
                Ok(()) if !p.write => {
                    let r = p.range.start as usize..p.range.end as usize;
                    if p.buf[..] != self.model[r] {
                        self.bad_reads += 1;
                    }
                }
                Ok(()) => {}
            }
        }
        if !progressed && n == 0 {
            let next = self
                .arr
                .shards()
                .iter()
                .flat_map(|s| s.channels().filter_map(|c| c.next_completion_ns()))
                .chain(self.arr.next_deadline_ns())
                .min();
            match next {
                Some(t) => self.clock.advance_to(t.max(self.clock.now_ns())),
                None => self.clock.advance_by(1_000),
            }
        }
    }

    fn overlaps(&self, r: &Range<u64>, write: bool) -> bool {
        self.pending
            .iter()
            .any(|p| (write || p.write) && p.range.start < r.end && r.start < p.range.end)
    }

    /// Submits a client request (a write updates the model at once: the array applies
    /// writes in submission order). Returns false if it would overlap a conflicting
    /// request in flight.
    fn submit(&mut self, write: bool, off: u64, len: u64) -> bool {
        let range = off..off + len;
        if self.overlaps(&range, write) {
            return false;
        }
        let mut buf = AlignedBuf::zeroed(len as usize);
        if write {
            self.rng.fill_bytes(&mut buf);
            self.model[off as usize..(off + len) as usize].copy_from_slice(&buf);
        }
        let tag = self.next_tag;
        self.next_tag += 1;
        // SAFETY: the buffer lives in `pending` (its heap allocation never moves) until the
        // request completes.
        let io = unsafe { IoBuf::from_slice(&mut buf) };
        let op = if write {
            ArrayOp::Write { fua: false }
        } else {
            ArrayOp::Read
        };
        self.arr
            .submit(ArrayRequest {
                tag,
                op,
                offset_bytes: off,
                len_bytes: len as u32,
                buf: io,
            })
            .expect("room for the request");
        self.pending.push(Pending {
            tag,
            range,
            write,
            buf,
        });
        true
    }

    /// A random block-aligned client request of up to two stripes.
    fn random_io(&mut self, write: bool) {
        let cap = self.geo.capacity_bytes();
        let max = (2 * self.geo.geometry().stripe_data_bytes()).min(cap) / u64::from(BLOCK);
        let blocks = 1 + self.rng.next_u64() % max;
        let len = blocks * u64::from(BLOCK);
        let off = (self.rng.next_u64() % ((cap - len) / u64::from(BLOCK) + 1)) * u64::from(BLOCK);
        self.submit(write, off, len);
    }

    fn drain(&mut self) {
        for _ in 0..10_000_000 {
            if self.pending.is_empty() {
                return;
            }
            self.step();
        }
        panic!("client requests never completed");
    }

    /// Writes the whole array with random data (stripe by stripe).
    fn fill(&mut self) {
        let s = self.geo.geometry().stripe_data_bytes();
        for i in 0..self.geo.stripes() {
            assert!(self.submit(true, i * s, s));
            if self.pending.len() >= 8 {
                self.drain();
            }
        }
        self.drain();
        assert!(self.failed.is_empty(), "{:?}", self.failed);
    }

    /// Runs until `done` holds, with `client_qd` random client requests (reads and writes)
    /// kept in flight.
    fn run_until(&mut self, client_qd: usize, mut done: impl FnMut(&mut World) -> bool) {
        for _ in 0..20_000_000 {
            if done(self) {
                return;
            }
            while self.pending.len() < client_qd {
                let write = !self.rng.next_u64().is_multiple_of(3);
                self.random_io(write);
            }
            self.step();
        }
        panic!("condition never reached");
    }

    fn process_state(&self) -> Option<ProcessState> {
        self.arr.process_snapshot().map(|s| s.state)
    }

    fn run_process(&mut self, client_qd: usize) -> ProcessState {
        self.run_until(client_qd, |w| !w.arr.process_active());
        self.drain();
        self.process_state().expect("a process ran")
    }

    fn channels_to(&self, d: &SimDevice) -> Vec<SimChannel> {
        (0..self.shards)
            .map(|_| d.open_channel().unwrap())
            .collect()
    }

    /// Every member's data chunks equal the model, byte for byte (read straight from the
    /// simulated members' storage), for members in `which`.
    fn assert_members_hold_model(&self, which: &[u16]) {
        let g = *self.geo.geometry();
        let c = g.chunk_bytes() as usize;
        let sd = g.stripe_data_bytes() as usize;
        for &m in which {
            let img = self.devs[usize::from(m)].contents();
            for s in 0..self.geo.stripes() {
                let st = g.stripe(s);
                if let Role::Data { index, .. } = st.role(m) {
                    let at = s as usize * sd + usize::from(index) * c;
                    let on = s as usize * c;
                    assert!(
                        img[on..on + c] == self.model[at..at + c],
                        "member {m} stripe {s}: data differs from what was written"
                    );
                }
            }
        }
    }

    /// Stripes whose stored P (and Q) do not match their data, from the members' storage.
    fn inconsistent_stripes(&self) -> Vec<u64> {
        let g = *self.geo.geometry();
        let c = g.chunk_bytes() as usize;
        // The parity kernels want 64-byte aligned buffers.
        let imgs: Vec<AlignedBuf> = self
            .devs
            .iter()
            .map(|d| {
                let v = d.contents();
                let mut b = AlignedBuf::zeroed(v.len());
                b.copy_from_slice(&v);
                b
            })
            .collect();
        let parity = Parity::new();
        let mut bad = Vec::new();
        for s in 0..self.geo.stripes() {
            let st = g.stripe(s);
            let on = s as usize * c;
            let mut data: Vec<&[u8]> = vec![&[]; usize::from(g.data_chunks())];
            for m in 0..g.members() {
                if let Role::Data { slot, .. } = st.role(m) {
                    data[usize::from(slot)] = &imgs[usize::from(m)][on..on + c];
                }
            }
            let mut p = AlignedBuf::zeroed(c);
            let mut q = AlignedBuf::zeroed(c);
            let ok = match st.q_member() {
                Some(qm) => {
                    parity.gen_pq(&data, &mut p, &mut q);
                    p[..] == imgs[usize::from(st.p_member())][on..on + c]
                        && q[..] == imgs[usize::from(qm)][on..on + c]
                }
                None => {
                    parity.gen_p(&data, &mut p);
                    p[..] == imgs[usize::from(st.p_member())][on..on + c]
                }
            };
            if !ok {
                bad.push(s);
            }
        }
        bad
    }

    /// Reads the whole array through the engine and compares with the model.
    fn assert_reads_model(&mut self) {
        self.drain();
        let cap = self.geo.capacity_bytes();
        let step = 4 * self.geo.geometry().stripe_data_bytes();
        let mut off = 0;
        let before = self.bad_reads;
        while off < cap {
            let len = step.min(cap - off);
            assert!(self.submit(false, off, len));
            off += len;
        }
        self.drain();
        assert_eq!(self.bad_reads, before, "reads differ from what was written");
    }

    fn member_write_bytes(&self, m: u16) -> u64 {
        self.devs[usize::from(m)].stats().bytes_written
    }

    fn member_read_bytes(&self, m: u16) -> u64 {
        self.devs[usize::from(m)].stats().bytes_read
    }

    /// The first stripe from `from` on where `member` holds a data chunk.
    fn data_stripe_of(&self, member: u16, from: u64) -> u64 {
        (from..self.geo.stripes())
            .find(|&s| {
                matches!(
                    self.geo.geometry().stripe(s).role(member),
                    Role::Data { .. }
                )
            })
            .expect("a data chunk of the member")
    }

    /// Member `m`'s device vanishes and is failed; a blank device takes its slot (a
    /// rebuild is then pending, started by `run_process`).
    fn replace_with_blank(&mut self, m: u16, seed: u64) {
        self.devs[usize::from(m)].disappear();
        self.arr.fail_member(m, IoError::Gone);
        let spare = blank(self, "spare", seed);
        let chans = self.channels_to(&spare);
        self.arr.replace_member(m, chans).unwrap();
        self.devs[usize::from(m)] = spare;
    }

    /// The array is whole and exact: every member online, each holding its chunks of the
    /// model byte for byte, and every stripe's parity consistent.
    fn assert_in_sync(&self, what: &str) {
        let states = self.arr.member_states();
        assert!(
            states.iter().all(|s| *s == MemberState::Online),
            "{what}: {states:?}"
        );
        let members: Vec<u16> = (0..self.geo.geometry().members()).collect();
        self.assert_members_hold_model(&members);
        assert_eq!(self.inconsistent_stripes(), Vec::<u64>::new(), "{what}");
    }

    /// Runs with `client_qd` client requests in flight until the process's snapshot
    /// satisfies `until`.
    fn run_process_until(&mut self, client_qd: usize, until: impl Fn(&ProcessSnapshot) -> bool) {
        self.run_until(client_qd, |w| {
            w.arr.process_snapshot().is_some_and(|p| until(&p))
        });
    }

    /// [`Self::replace_with_blank`] while the array runs with `client_qd` client requests
    /// in flight: member `m` fails, and a blank device takes its slot as soon as the failed
    /// device has nothing outstanding.
    fn fail_and_replace_running(&mut self, m: u16, seed: u64, client_qd: usize) {
        self.devs[usize::from(m)].disappear();
        self.arr.fail_member(m, IoError::Gone);
        let spare = blank(self, "spare", seed);
        self.run_until(client_qd, |w| {
            match w.arr.replace_member(m, w.channels_to(&spare)) {
                Ok(()) => true,
                Err(ProcessError::MemberBusy { .. }) => false,
                Err(e) => panic!("replace refused: {e}"),
            }
        });
        self.devs[usize::from(m)] = spare;
    }

    /// Unreadable ranges rebuilt and rewritten, over every shard.
    fn read_errors_repaired(&self) -> u64 {
        self.arr
            .shards()
            .iter()
            .map(|s| s.stats().read_errors_repaired)
            .sum()
    }
}

fn blank(w: &World, name: &str, seed: u64) -> SimDevice {
    sim_dev(name, &w.geo, &w.clock, seed)
}

/// Rebuild after a member failure restores the exact bytes while a client keeps writing
/// (and reading: reads below and above the rebuild position must be right), on RAID5 and
/// RAID6, with 1, 2 and 4 shards; parity is consistent on every stripe afterwards and no
/// client request failed.
#[test]
fn rebuild_restores_exact_bytes_under_client_writes() {
    for (level, members) in [(Level::Raid5, 4u16), (Level::Raid6, 5)] {
        for shards in [1usize, 2, 4] {
            let seed = u64::from(members) * 10 + shards as u64;
            let mut w = World::new(level, members, 16384, 48, shards, seed);
            w.fill();
            let victim = (seed % u64::from(members)) as u16;
            w.devs[usize::from(victim)].disappear();
            w.arr.fail_member(victim, IoError::Gone);
            // Degraded client traffic first.
            for _ in 0..50 {
                w.random_io(true);
                w.drain();
            }
            let spare = blank(&w, "spare", seed);
            let chans = w.channels_to(&spare);
            w.arr.replace_member(victim, chans).unwrap();
            w.devs[usize::from(victim)] = spare;
            assert_eq!(
                w.arr.member_states()[usize::from(victim)],
                MemberState::Rebuilding
            );
            // Midway, read everything back (below and above the position).
            let half = w.geo.stripes() / 2;
            w.run_until(6, |w| {
                w.arr
                    .process_snapshot()
                    .is_some_and(|s| s.position_stripes >= half)
            });
            let snap = w.arr.process_snapshot().unwrap();
            assert_eq!(snap.kind, ProcessKind::Rebuild);
            assert_eq!(snap.state, ProcessState::Running, "{level:?} {shards}");
            assert!(snap.position_stripes < w.geo.stripes());
            w.assert_reads_model();
            let st = w.run_process(6);
            assert_eq!(st, ProcessState::Finished, "{level:?} shards {shards}");
            assert!(w
                .arr
                .member_states()
                .iter()
                .all(|s| *s == MemberState::Online));
            let snap = w.arr.process_snapshot().unwrap();
            assert_eq!(snap.position_stripes, w.geo.stripes());
            assert_eq!(snap.done_stripes, w.geo.stripes());
            assert_eq!(snap.position_sectors, w.geo.member_data_bytes() / 512);
            assert!(w.failed.is_empty(), "client saw errors: {:?}", w.failed);
            assert_eq!(w.bad_reads, 0, "{level:?} shards {shards}");
            let all: Vec<u16> = (0..members).collect();
            w.assert_members_hold_model(&all);
            assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
            w.assert_reads_model();
        }
    }
}

/// RAID6 rebuilds two replaced members at once.
#[test]
fn raid6_rebuilds_two_members_at_once() {
    for shards in [1usize, 2, 4] {
        let mut w = World::new(Level::Raid6, 6, 8192, 40, shards, 7 + shards as u64);
        w.fill();
        for m in [1u16, 4] {
            w.devs[usize::from(m)].disappear();
            w.arr.fail_member(m, IoError::Gone);
        }
        for m in [1u16, 4] {
            let spare = blank(&w, "spare", u64::from(m));
            let chans = w.channels_to(&spare);
            w.arr.replace_member(m, chans).unwrap();
            w.devs[usize::from(m)] = spare;
        }
        w.run_until(4, |w| w.arr.process_snapshot().is_some());
        assert_eq!(
            w.arr.process_snapshot().unwrap().targets.as_slice(),
            &[1, 4]
        );
        assert_eq!(w.run_process(4), ProcessState::Finished);
        // The finished rebuild still says what it brought in (for the superblocks).
        assert_eq!(
            w.arr.process_snapshot().unwrap().targets.as_slice(),
            &[1, 4]
        );
        assert!(w.failed.is_empty(), "{:?}", w.failed);
        assert_eq!(w.bad_reads, 0);
        w.assert_in_sync("");
    }
}

/// Corrupts member bytes directly in storage: `(stripe, role, byte in chunk)`.
fn corrupt(w: &World, stripe: u64, role: Role, at: usize) {
    let g = *w.geo.geometry();
    let st = g.stripe(stripe);
    let m = (0..g.members()).find(|&m| st.role(m) == role).unwrap();
    let off = stripe * u64::from(g.chunk_bytes()) + at as u64;
    let old = w.devs[usize::from(m)].contents()[off as usize];
    w.devs[usize::from(m)].poke(off, &[old ^ 0x5a]);
}

/// Check counts every injected mismatch (md's rule: 8 sectors per mismatching 4 KiB slice
/// of a stripe, once whichever of P and Q mismatch) and writes nothing; repair fixes them;
/// a check afterwards counts 0.
#[test]
fn check_counts_injected_mismatches_and_repair_fixes_them() {
    for shards in [1usize, 2, 4] {
        let mut w = World::new(Level::Raid6, 5, 16384, 24, shards, 40 + shards as u64);
        w.fill();
        // P of stripe 3, one slice; Q of stripe 5, two slices; P and Q of stripe 9 in the
        // same slice (counted once); data of stripe 7 (both P and Q then mismatch, once);
        // P of stripe 23 in its last slice.
        corrupt(&w, 3, Role::P, 100);
        corrupt(&w, 5, Role::Q, 4096 + 1);
        corrupt(&w, 5, Role::Q, 3 * 4096 + 7);
        corrupt(&w, 9, Role::P, 8192 + 5);
        corrupt(&w, 9, Role::Q, 8192 + 9);
        let g = *w.geo.geometry();
        let data1 = g.stripe(7).role(g.stripe(7).data_member(1));
        corrupt(&w, 7, data1, 2 * 4096);
        corrupt(&w, 23, Role::P, 16383);
        let expected = 8 * (1 + 2 + 1 + 1 + 1);
        // The corrupted data is what the array now holds (md's repair trusts the data).
        let c = g.chunk_bytes() as usize;
        let at = 7 * g.stripe_data_bytes() as usize + c + 2 * 4096;
        w.model[at] ^= 0x5a;
        let inconsistent = vec![3, 5, 7, 9, 23];
        assert_eq!(w.inconsistent_stripes(), inconsistent);

        let writes: Vec<u64> = (0..5).map(|m| w.member_write_bytes(m)).collect();
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Check))
            .unwrap();
        assert_eq!(w.run_process(0), ProcessState::Finished);
        let snap = w.arr.process_snapshot().unwrap();
        assert_eq!(snap.mismatch_cnt, expected, "shards {shards}");
        let after: Vec<u64> = (0..5).map(|m| w.member_write_bytes(m)).collect();
        assert_eq!(writes, after, "check wrote to a member");
        assert_eq!(w.inconsistent_stripes(), inconsistent);

        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Repair))
            .unwrap();
        // No client here: its writes would make stripes consistent before the repair
        // got to them.
        assert_eq!(w.run_process(0), ProcessState::Finished);
        assert_eq!(w.arr.process_snapshot().unwrap().mismatch_cnt, expected);
        assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());

        // A check under client writes and reads finds nothing on a consistent array.
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Check))
            .unwrap();
        assert_eq!(w.run_process(4), ProcessState::Finished);
        assert_eq!(w.arr.process_snapshot().unwrap().mismatch_cnt, 0);
        assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
        assert!(w.failed.is_empty(), "{:?}", w.failed);
        assert_eq!(w.bad_reads, 0);
        w.assert_reads_model();
    }
}

/// RAID5: the same on P only.
#[test]
fn raid5_check_and_repair() {
    let mut w = World::new(Level::Raid5, 4, 8192, 16, 2, 77);
    w.fill();
    corrupt(&w, 2, Role::P, 0);
    corrupt(&w, 2, Role::P, 4096);
    corrupt(&w, 11, Role::P, 4095);
    w.arr
        .start_process(&ProcessRequest::whole(ProcessKind::Check))
        .unwrap();
    assert_eq!(w.run_process(0), ProcessState::Finished);
    assert_eq!(w.arr.process_snapshot().unwrap().mismatch_cnt, 24);
    w.arr
        .start_process(&ProcessRequest::whole(ProcessKind::Repair))
        .unwrap();
    assert_eq!(w.run_process(0), ProcessState::Finished);
    assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
    w.assert_reads_model();
}

/// A crash after data reached the members but before parity did (the write hole): a
/// resync makes every stripe consistent and writes parity only where it mismatched.
#[test]
fn resync_after_a_crash_makes_parity_consistent() {
    for shards in [1usize, 2, 4] {
        let mut w = World::new(Level::Raid6, 5, 8192, 32, shards, 90 + shards as u64);
        w.fill();
        let g = *w.geo.geometry();
        let c = g.chunk_bytes() as usize;
        let sd = g.stripe_data_bytes() as usize;
        // New data on data chunks of some stripes, parity untouched.
        let torn = [1u64, 6, 17, 30];
        for &s in &torn {
            let st = g.stripe(s);
            let k = (s % u64::from(g.data_chunks())) as u16;
            let m = st.data_member(k);
            let mut new = vec![0u8; c];
            w.rng.fill_bytes(&mut new);
            w.devs[usize::from(m)].poke(s * c as u64, &new);
            let at = s as usize * sd + usize::from(k) * c;
            w.model[at..at + c].copy_from_slice(&new);
        }
        assert_eq!(w.inconsistent_stripes(), torn.to_vec());
        let writes: u64 = (0..5).map(|m| w.member_write_bytes(m)).sum();
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Resync))
            .unwrap();
        assert_eq!(w.run_process(0), ProcessState::Finished);
        assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
        let written: u64 = (0..5).map(|m| w.member_write_bytes(m)).sum::<u64>() - writes;
        // Exactly P and Q of the torn stripes, whole chunks (random data differs in every
        // slice).
        assert_eq!(written, torn.len() as u64 * 2 * c as u64, "shards {shards}");
        assert_eq!(
            w.arr.process_snapshot().unwrap().mismatch_cnt,
            torn.len() as u64 * (c as u64 / 512)
        );
        w.assert_reads_model();
    }
}

/// A resync given stripe ranges (a write-intent bitmap's dirty regions) reads and writes
/// only those stripes.
#[test]
fn resync_over_ranges_touches_only_those_stripes() {
    for shards in [1usize, 2, 4] {
        let mut w = World::new(Level::Raid5, 4, 8192, 32, shards, 120 + shards as u64);
        w.fill();
        let g = *w.geo.geometry();
        for s in [3u64, 12, 20] {
            corrupt(&w, s, Role::P, 10);
        }
        let reads: Vec<u64> = (0..4).map(|m| w.member_read_bytes(m)).collect();
        let ranges = vec![2..4, 10..11, 12..14];
        w.arr
            .start_process(&ProcessRequest {
                kind: ProcessKind::Resync,
                ranges: Some(ranges),
                resume_stripe: 0,
            })
            .unwrap();
        assert_eq!(w.run_process(0), ProcessState::Finished);
        let snap = w.arr.process_snapshot().unwrap();
        assert_eq!(snap.total_stripes, 5);
        assert_eq!(snap.done_stripes, 5);
        assert_eq!(snap.mismatch_cnt, 16);
        // Every member read exactly the five stripes' chunks, whole.
        for m in 0..4 {
            assert_eq!(
                w.member_read_bytes(m) - reads[usize::from(m)],
                5 * u64::from(g.chunk_bytes()),
                "member {m}, shards {shards}"
            );
        }
        // Stripe 20 lay outside: still inconsistent.
        assert_eq!(w.inconsistent_stripes(), vec![20]);
    }
}

/// An array that lost more members than its redundancy is failed and stays failed: no
/// rebuild, no new member, no process brings it back; reads fail cleanly.
#[test]
fn a_failed_array_stays_failed() {
    let mut w = World::new(Level::Raid5, 4, 8192, 8, 2, 5);
    w.fill();
    w.arr.fail_member(0, IoError::Gone);
    w.arr.fail_member(2, IoError::Gone);
    let spare = blank(&w, "spare", 1);
    let chans = w.channels_to(&spare);
    assert_eq!(
        w.arr.replace_member(0, chans),
        Err(ProcessError::ArrayFailed)
    );
    for kind in [
        ProcessKind::Rebuild,
        ProcessKind::Resync,
        ProcessKind::Check,
        ProcessKind::Repair,
    ] {
        assert_eq!(
            w.arr.start_process(&ProcessRequest::whole(kind)),
            Err(ProcessError::ArrayFailed)
        );
    }
    w.step();
    let states = w.arr.member_states();
    assert!(states[0].is_failed() && states[2].is_failed());
    assert!(w.submit(false, 0, 4096));
    w.drain();
    assert!(matches!(
        w.failed.last(),
        Some((_, ArrayError::Failed | ArrayError::Unrecoverable { .. }))
    ));

    // A RAID5 rebuild that loses another member fails the array, and it stays failed.
    let mut w = World::new(Level::Raid5, 4, 8192, 32, 1, 6);
    w.fill();
    w.arr.fail_member(1, IoError::Gone);
    let spare = blank(&w, "spare", 2);
    let chans = w.channels_to(&spare);
    w.arr.replace_member(1, chans).unwrap();
    w.devs[1] = spare;
    w.run_until(0, |w| {
        w.arr
            .process_snapshot()
            .is_some_and(|s| s.done_stripes >= 4)
    });
    w.devs[3].disappear();
    w.arr.fail_member(3, IoError::Gone);
    let st = w.run_process(0);
    assert!(
        matches!(
            st,
            ProcessState::Failed(ProcessError::ArrayFailed | ProcessError::Unrecoverable { .. })
        ),
        "{st:?}"
    );
    assert!(w.arr.member_states()[1] == MemberState::Rebuilding);
    let spare = blank(&w, "spare2", 3);
    let chans = w.channels_to(&spare);
    assert_eq!(
        w.arr.replace_member(3, chans),
        Err(ProcessError::ArrayFailed)
    );
    assert_eq!(
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Rebuild)),
        Err(ProcessError::ArrayFailed)
    );
}

/// Progress survives a restart: a repair stopped midway is resumed by a new array from
/// its checkpoint, finishes, and never redoes a stripe below it (no member reads there;
/// mismatches below it are not counted again).
#[test]
fn a_process_resumes_from_its_checkpoint() {
    for shards in [1usize, 2, 4] {
        let mut w = World::new(Level::Raid6, 5, 8192, 40, shards, 200 + shards as u64);
        w.fill();
        for s in [2u64, 5, 33, 38] {
            corrupt(&w, s, Role::Q, 0);
        }
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Repair))
            .unwrap();
        w.run_until(0, |w| {
            w.arr
                .process_snapshot()
                .is_some_and(|s| s.position_stripes >= 12)
        });
        assert!(w.arr.stop_process());
        let st = w.run_process(0);
        assert_eq!(st, ProcessState::Stopped);
        let snap = w.arr.process_snapshot().unwrap();
        let pos = snap.position_stripes;
        assert!((12..33).contains(&pos), "position {pos}");
        assert_eq!(snap.position_member_bytes, pos * 8192);
        // Everything below the checkpoint is done; what lies above may or may not be
        // (shards run ahead of the slowest one).
        let left = w.inconsistent_stripes();
        assert!(left.iter().all(|&s| s >= pos), "{left:?} below {pos}");
        assert!(left.contains(&38), "{left:?}");

        // "Restart": new array over the same members, resumed at the checkpoint.
        let devs = w.devs.clone();
        let mut w2 = World::over(devs, w.geo, w.clock.clone(), shards, 9, config());
        w2.model = w.model.clone();
        let reads: Vec<u64> = (0..5).map(|m| w2.member_read_bytes(m)).collect();
        w2.arr
            .start_process(&ProcessRequest {
                kind: ProcessKind::Repair,
                ranges: None,
                resume_stripe: pos,
            })
            .unwrap();
        let snap = w2.arr.process_snapshot().unwrap();
        assert_eq!(snap.position_stripes, pos);
        assert_eq!(snap.done_stripes, pos);
        assert_eq!(w2.run_process(0), ProcessState::Finished);
        for m in 0..5 {
            assert_eq!(
                w2.member_read_bytes(m) - reads[usize::from(m)],
                (40 - pos) * 8192,
                "member {m}: stripes below the checkpoint were read again"
            );
        }
        assert_eq!(
            w2.arr.process_snapshot().unwrap().mismatch_cnt,
            left.len() as u64 * 8
        );
        assert_eq!(w2.inconsistent_stripes(), Vec::<u64>::new());
        w2.assert_reads_model();
    }
}

/// A rebuild resumed at its checkpoint (md's recovery_offset) writes the target only
/// above it and restores the exact bytes.
#[test]
fn a_rebuild_resumes_from_recovery_offset() {
    let shards = 2;
    let mut w = World::new(Level::Raid6, 5, 8192, 40, shards, 300);
    w.fill();
    w.devs[2].disappear();
    w.arr.fail_member(2, IoError::Gone);
    let spare = blank(&w, "spare", 3);
    let chans = w.channels_to(&spare);
    w.arr.replace_member(2, chans).unwrap();
    w.devs[2] = spare.clone();
    w.run_until(0, |w| {
        w.arr
            .process_snapshot()
            .is_some_and(|s| s.position_stripes >= 15)
    });
    w.arr.stop_process();
    assert_eq!(w.run_process(0), ProcessState::Stopped);
    let pos = w.arr.process_snapshot().unwrap().position_stripes;
    assert!((15..40).contains(&pos));

    // Restart: the spare is assembled as a member being rebuilt at `pos` (its
    // recovery_offset); the rebuild resumes there by itself.
    let mut cfg = config();
    cfg.rebuilding = [Some((2, pos)), None];
    let devs = w.devs.clone();
    let mut w2 = World::over(devs, w.geo, w.clock.clone(), shards, 4, cfg);
    w2.model = w.model.clone();
    assert_eq!(w2.arr.member_states()[2], MemberState::Rebuilding);
    let before = w2.member_write_bytes(2);
    w2.step();
    let snap = w2.arr.process_snapshot().expect("the rebuild resumed");
    assert_eq!(snap.kind, ProcessKind::Rebuild);
    assert_eq!(snap.position_stripes, pos);
    assert_eq!(w2.run_process(0), ProcessState::Finished);
    assert_eq!(w2.member_write_bytes(2) - before, (40 - pos) * 8192);
    assert!(w2
        .arr
        .member_states()
        .iter()
        .all(|s| *s == MemberState::Online));
    w2.assert_members_hold_model(&[0, 1, 2, 3, 4]);
    assert_eq!(w2.inconsistent_stripes(), Vec::<u64>::new());
}

/// A rebuild whose target fails midway stops cleanly: the target is failed again, the
/// process ends with the reason, the array stays degraded with every byte readable, and
/// the client never sees an error.
#[test]
fn a_rebuild_whose_target_fails_stops_cleanly() {
    for shards in [1usize, 2, 4] {
        let mut w = World::new(Level::Raid5, 4, 8192, 32, shards, 400 + shards as u64);
        w.fill();
        w.devs[3].disappear();
        w.arr.fail_member(3, IoError::Gone);
        let spare = blank(&w, "spare", 5);
        // Writes past stripe 16 fail.
        spare.add_fault(FaultRule {
            filter: OpFilter::Write,
            range: Some(16 * 8192..32 * 8192),
            fault: Fault::Error(IoError::Io { errno: 5 }),
            probability: 1.0,
            count: None,
        });
        let chans = w.channels_to(&spare);
        w.arr.replace_member(3, chans).unwrap();
        let st = w.run_process(4);
        assert_eq!(
            st,
            ProcessState::Failed(ProcessError::TargetFailed { member: 3 }),
            "shards {shards}"
        );
        assert!(w.arr.member_states()[3].is_failed());
        assert!(w.failed.is_empty(), "{:?}", w.failed);
        assert_eq!(w.bad_reads, 0);
        w.assert_reads_model();
        let pos = w.arr.process_snapshot().unwrap().position_stripes;
        assert!(pos <= 16, "position {pos} passed the failure");
    }
}

/// A pacer that admits one background operation per millisecond and counts what it
/// is told.
struct Metered {
    next: u64,
    fg_submitted: Arc<AtomicU64>,
    bg_done: u64,
}

impl Pacer for Metered {
    fn foreground_submitted(&mut self, _now_ns: u64) {
        self.fg_submitted.fetch_add(1, Ordering::Relaxed);
    }
    fn foreground_done(&mut self, _now: u64, _lat: u64, _bytes: u64, _read: bool) {}
    fn background_done(&mut self, _now: u64, _lat: u64, bytes: u64) {
        assert_eq!(bytes, 8192);
        self.bg_done += 1;
    }
    fn admit(&mut self, now_ns: u64, _bytes: u64, _in_flight: u32) -> Admission {
        if now_ns >= self.next {
            self.next = now_ns + 1_000_000;
            Admission::Now
        } else {
            Admission::NotBefore(self.next)
        }
    }
}

/// Background operations go through the shard's pacer: a pacer's `NotBefore` is a
/// deadline the executor wakes for, and it sees the foreground traffic.
#[test]
fn the_pacer_admits_background_work() {
    let mut w = World::new(Level::Raid5, 4, 8192, 20, 1, 500);
    w.fill();
    let seen = Arc::new(AtomicU64::new(0));
    w.arr.shards_mut()[0].set_pacer(Box::new(Metered {
        next: 0,
        fg_submitted: seen.clone(),
        bg_done: 0,
    }));
    let t0 = w.clock.now_ns();
    w.arr
        .start_process(&ProcessRequest::whole(ProcessKind::Check))
        .unwrap();
    assert_eq!(w.run_process(1), ProcessState::Finished);
    // 20 stripes, one per millisecond.
    assert!(
        w.clock.now_ns() - t0 >= 19_000_000,
        "{}",
        w.clock.now_ns() - t0
    );
    assert!(seen.load(Ordering::Relaxed) > 0);
    assert!(w.failed.is_empty());
}

/// Bad requests are refused with a clear error and change nothing.
#[test]
fn bad_process_requests_are_refused() {
    let mut w = World::new(Level::Raid6, 5, 8192, 10, 2, 600);
    assert_eq!(
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Rebuild)),
        Err(ProcessError::NothingToRebuild)
    );
    assert!(matches!(
        w.arr.start_process(&ProcessRequest {
            kind: ProcessKind::Check,
            ranges: Some(std::iter::once(Range { start: 4, end: 2 }).collect()),
            resume_stripe: 0
        }),
        Err(ProcessError::BadRange { .. })
    ));
    let spare = blank(&w, "spare", 1);
    let chans = w.channels_to(&spare);
    assert_eq!(
        w.arr.replace_member(1, chans),
        Err(ProcessError::NotFailed { member: 1 })
    );
    w.arr
        .start_process(&ProcessRequest::whole(ProcessKind::Check))
        .unwrap();
    assert!(matches!(
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Repair)),
        Err(ProcessError::Busy {
            running: ProcessKind::Check
        })
    ));
    assert_eq!(w.run_process(0), ProcessState::Finished);
    w.arr.fail_member(0, IoError::Gone);
    assert_eq!(
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Check)),
        Err(ProcessError::Degraded {
            kind: ProcessKind::Check,
            member: 0
        })
    );
    let small = SimDevice::new(
        "small",
        4096,
        BLOCK,
        Profile::fixed(1000),
        w.clock.clone(),
        1,
    )
    .unwrap();
    let chans = w.channels_to(&small);
    assert!(matches!(
        w.arr.replace_member(0, chans),
        Err(ProcessError::Unfit { member: 0, .. })
    ));
    assert!(w.arr.member_states()[0].is_failed());

    // An array configured without background operations refuses processes.
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 8192, BLOCK).unwrap();
    let geo = ArrayGeometry::new(g, 4).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..3)
        .map(|i| sim_dev(&format!("d{i}"), &geo, &clock, i))
        .collect();
    let cfg = ArrayConfig {
        background_ops: 0,
        ..config()
    };
    let mut w = World::over(devs, geo, clock, 1, 1, cfg);
    assert_eq!(
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Check)),
        Err(ProcessError::NoSlots)
    );
}

/// A latent sector error met by a scrub is rebuilt from redundancy and rewritten (the
/// member stays in); a member failing during a check stops it cleanly, and the client
/// goes on reading the right data.
#[test]
fn scrub_repairs_read_errors_and_stops_when_a_member_fails() {
    for shards in [1usize, 2] {
        let mut w = World::new(Level::Raid6, 5, 8192, 16, shards, 700 + shards as u64);
        w.fill();
        let g = *w.geo.geometry();
        let m = usize::from(g.stripe(4).data_member(0));
        w.devs[m].add_latent_error(4 * 8192 + 1024..4 * 8192 + 1536);
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Check))
            .unwrap();
        assert_eq!(w.run_process(0), ProcessState::Finished);
        assert_eq!(w.arr.process_snapshot().unwrap().mismatch_cnt, 0);
        let repaired = w.read_errors_repaired();
        assert_eq!(repaired, 1);
        assert!(w
            .arr
            .member_states()
            .iter()
            .all(|s| *s == MemberState::Online));
        // The rewrite cleared the latent error: the member reads that range again.
        assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
        w.assert_members_hold_model(&[0, 1, 2, 3, 4]);

        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Check))
            .unwrap();
        w.run_until(0, |w| {
            w.arr
                .process_snapshot()
                .is_some_and(|s| s.done_stripes >= 4)
        });
        w.devs[1].disappear();
        let st = w.run_process(2);
        assert_eq!(
            st,
            ProcessState::Failed(ProcessError::MemberFailed {
                kind: ProcessKind::Check,
                member: 1
            })
        );
        assert!(w.arr.member_states()[1].is_failed());
        assert!(w.failed.is_empty(), "{:?}", w.failed);
        assert_eq!(w.bad_reads, 0);
        w.assert_reads_model();
    }
}

/// Background work has its own stripe operations: under a client that keeps every
/// foreground operation busy (and more waiting), a rebuild still progresses and finishes,
/// never holds more than `background_ops` operations, and no client request fails.
#[test]
fn background_work_progresses_beside_a_saturating_client() {
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, 8192, BLOCK).unwrap();
    let geo = ArrayGeometry::new(g, 24).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..4)
        .map(|i| sim_dev(&format!("d{i}"), &geo, &clock, 800 + i))
        .collect();
    let cfg = ArrayConfig {
        requests: 64,
        stripe_ops: 4,
        background_ops: 3,
        ..ArrayConfig::default()
    };
    let mut w = World::over(devs, geo, clock, 1, 801, cfg);
    w.fill();
    w.devs[0].disappear();
    w.arr.fail_member(0, IoError::Gone);
    let spare = blank(&w, "spare", 9);
    let chans = w.channels_to(&spare);
    w.arr.replace_member(0, chans).unwrap();
    w.devs[0] = spare;
    let mut most = 0;
    w.run_until(12, |w| {
        if let Some(p) = w.arr.shards()[0].process_progress() {
            most = most.max(p.in_flight);
        }
        w.arr.member_states()[0] == MemberState::Online
    });
    assert!(
        (1..=3).contains(&most),
        "{most} background operations at once"
    );
    w.drain();
    assert!(w.failed.is_empty(), "{:?}", w.failed);
    assert_eq!(w.bad_reads, 0);
    w.assert_members_hold_model(&[0, 1, 2, 3]);
}

/// Seeded runs over every md layout, each seed choosing level, width, chunk, shards and
/// size: a check of a fresh array finds nothing, a repair fixes injected parity
/// corruption (counted), then a member fails and is rebuilt under client traffic; the
/// members end byte-exact and every stripe consistent.
#[test]
fn seeded_runs_on_every_layout() {
    for (i, layout) in Layout::ALL.into_iter().enumerate() {
        for round in 0..2u64 {
            let seed = 1000 + i as u64 * 10 + round;
            let mut r = ChaCha8Rng::seed_from_u64(seed);
            let level = if r.next_u64().is_multiple_of(2) {
                Level::Raid5
            } else {
                Level::Raid6
            };
            let min = if level == Level::Raid5 { 3 } else { 4 };
            let members = min + (r.next_u64() % 4) as u16;
            let chunk = 4096 << (r.next_u64() % 3);
            let shards = [1usize, 2, 4][(r.next_u64() % 3) as usize];
            let stripes = 12 + r.next_u64() % 20;
            let what = format!(
                "{layout:?} {level:?} {members}x{chunk} {stripes} stripes, {shards} shards"
            );
            let mut w = World::with_layout(level, layout, members, chunk, stripes, shards, seed);
            w.fill();
            w.arr
                .start_process(&ProcessRequest::whole(ProcessKind::Check))
                .unwrap();
            assert_eq!(w.run_process(3), ProcessState::Finished, "{what}");
            assert_eq!(w.arr.process_snapshot().unwrap().mismatch_cnt, 0, "{what}");
            let mut bad = Vec::new();
            for _ in 0..3 {
                let s = r.next_u64() % stripes;
                let role = if level == Level::Raid6 && r.next_u64().is_multiple_of(2) {
                    Role::Q
                } else {
                    Role::P
                };
                // One corruption per stripe, in its first 4 KiB slice.
                if !bad.contains(&s) {
                    corrupt(&w, s, role, (r.next_u64() % 4096) as usize);
                    bad.push(s);
                }
            }
            w.arr
                .start_process(&ProcessRequest::whole(ProcessKind::Repair))
                .unwrap();
            assert_eq!(w.run_process(0), ProcessState::Finished, "{what}");
            assert_eq!(
                w.arr.process_snapshot().unwrap().mismatch_cnt,
                8 * bad.len() as u64,
                "{what}"
            );
            assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new(), "{what}");
            let victim = (r.next_u64() % u64::from(members)) as u16;
            w.devs[usize::from(victim)].disappear();
            w.arr.fail_member(victim, IoError::Gone);
            let spare = blank(&w, "spare", seed);
            let chans = w.channels_to(&spare);
            w.arr.replace_member(victim, chans).unwrap();
            w.devs[usize::from(victim)] = spare;
            assert_eq!(w.run_process(5), ProcessState::Finished, "{what}");
            assert!(
                w.arr
                    .member_states()
                    .iter()
                    .all(|s| *s == MemberState::Online),
                "{what}"
            );
            assert!(w.failed.is_empty(), "{what}: {:?}", w.failed);
            assert_eq!(w.bad_reads, 0, "{what}");
            let all: Vec<u16> = (0..members).collect();
            w.assert_members_hold_model(&all);
            assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new(), "{what}");
        }
    }
}

/// Faults on the survivors during a rebuild, within redundancy (RAID6: the target plus one
/// more per stripe): latent sector errors are rebuilt from parity and rewritten, a member
/// that hangs is failed by the command timeout and the rebuild goes on without it; the
/// target ends byte-exact. Past redundancy (RAID5: a latent error on a survivor of a
/// stripe being rebuilt) the rebuild stops with the stripe named, never writing wrong
/// data, and its position stays below that stripe.
#[test]
fn rebuild_through_survivor_faults() {
    for shards in [1usize, 2] {
        let mut w = World::new(Level::Raid6, 6, 8192, 32, shards, 1500 + shards as u64);
        w.fill();
        w.devs[0].disappear();
        w.arr.fail_member(0, IoError::Gone);
        // Latent errors on member 2 in stripes 5 and 20; member 4 hangs on a read in
        // stripe 12 (the command timeout fails it).
        w.devs[2].add_latent_error(5 * 8192 + 512..5 * 8192 + 1024);
        w.devs[2].add_latent_error(20 * 8192..20 * 8192 + 4096);
        w.devs[4].add_fault(FaultRule {
            filter: OpFilter::Read,
            range: Some(12 * 8192..13 * 8192),
            fault: Fault::Hang,
            probability: 1.0,
            count: Some(1),
        });
        let spare = blank(&w, "spare", 1);
        let chans = w.channels_to(&spare);
        w.arr.replace_member(0, chans).unwrap();
        w.devs[0] = spare;
        assert_eq!(w.run_process(0), ProcessState::Finished, "shards {shards}");
        let states = w.arr.member_states();
        assert_eq!(states[0], MemberState::Online);
        assert_eq!(
            states[2],
            MemberState::Online,
            "a latent error failed its member"
        );
        assert!(states[4].is_failed(), "the hung member was not failed");
        let repaired = w.read_errors_repaired();
        assert_eq!(repaired, 2);
        w.assert_members_hold_model(&[0, 1, 2, 3, 5]);
        w.assert_reads_model();
    }

    let mut w = World::new(Level::Raid5, 4, 8192, 32, 1, 1600);
    w.fill();
    w.devs[1].disappear();
    w.arr.fail_member(1, IoError::Gone);
    w.devs[3].add_latent_error(9 * 8192..9 * 8192 + 512);
    let spare = blank(&w, "spare", 2);
    let chans = w.channels_to(&spare);
    w.arr.replace_member(1, chans).unwrap();
    w.devs[1] = spare.clone();
    let st = w.run_process(0);
    assert_eq!(
        st,
        ProcessState::Failed(ProcessError::Unrecoverable { stripe: 9 })
    );
    assert_eq!(w.arr.process_snapshot().unwrap().position_stripes, 9);
    // Stripes below were rebuilt exactly; the member stays being rebuilt (not online).
    assert_eq!(w.arr.member_states()[1], MemberState::Rebuilding);
    let img = spare.contents();
    let g = *w.geo.geometry();
    for s in 0..9u64 {
        if let Role::Data { index, .. } = g.stripe(s).role(1) {
            let at = (s * g.stripe_data_bytes() + u64::from(index) * 8192) as usize;
            let on = (s * 8192) as usize;
            assert!(img[on..on + 8192] == w.model[at..at + 8192], "stripe {s}");
        }
    }
}

/// A RAID6 rebuild reads every survivor, the parity its reconstruction does not use
/// included (md's recovery does too), so it finds and rewrites an unrecovered read error
/// there: after it the stripe survives two more member failures. A rebuild that skipped
/// that read (tried in d1e4752, reverted) left the error, and the stripe was lost.
#[test]
fn a_rebuild_repairs_latent_errors_on_the_parity_it_does_not_use() {
    let c = 8192u64;
    for shards in [1usize, 2] {
        let mut w = World::new(Level::Raid6, 5, c, 16, shards, 4400 + shards as u64);
        w.fill();
        let lost = 0u16;
        // A stripe where the lost member holds data: its rebuild uses P, not Q.
        let s = w.data_stripe_of(lost, 0);
        let st = w.geo.geometry().stripe(s);
        let q = st.q_member().expect("RAID6");
        w.devs[usize::from(q)].add_latent_error(s * c + 1024..s * c + 2048);
        w.replace_with_blank(lost, 1);
        assert_eq!(w.run_process(0), ProcessState::Finished, "shards {shards}");
        assert_eq!(w.read_errors_repaired(), 1, "shards {shards}");
        // Two data members of that stripe fail: P and Q rebuild them.
        for k in 0..2 {
            let m = st.data_member(k);
            w.devs[usize::from(m)].disappear();
            w.arr.fail_member(m, IoError::Gone);
        }
        w.assert_reads_model();
        assert!(
            w.failed.is_empty(),
            "shards {shards}: stripe {s} lost: {:?}",
            w.failed
        );
    }
}

/// The RAID6 parity chunk that rebuilding `lost` in `stripe` does not use: P when `lost`
/// holds Q there, else Q.
fn unused_parity(w: &World, stripe: u64, lost: u16) -> u16 {
    let st = w.geo.geometry().stripe(stripe);
    let q = st.q_member().expect("a RAID6 stripe");
    if lost == q {
        st.p_member()
    } else {
        q
    }
}

/// A RAID6 rebuild of one member on members that do not seek reads n − 2 of the n − 1
/// survivors' chunks in each stripe, then, in a verification walk, the parity chunks it
/// left unread: every survivor reads each stripe's chunk exactly once in all, with 1 and
/// 2 shards. A latent error on a survivor the rebuild reads brings that stripe's other
/// chunks in at once; the member comes back byte-exact, and the progress counts the
/// verification on its own.
#[test]
fn a_raid6_rebuild_reads_n_minus_2_survivors_then_verifies_the_parity_it_skipped() {
    for shards in [1usize, 2] {
        let (members, stripes, c) = (6u16, 32u64, 8192u64);
        let mut w = World::raid6_filled(stripes, shards, 1700 + shards as u64);
        let lost = 1u16;
        // A latent error on a survivor that stripe 9's rebuild reads (a data chunk).
        let bad = (0..members)
            .find(|&m| {
                m != lost
                    && m != unused_parity(&w, 9, lost)
                    && matches!(w.geo.geometry().stripe(9).role(m), Role::Data { .. })
            })
            .expect("a data survivor");
        w.devs[usize::from(bad)].add_latent_error(9 * c + 1024..9 * c + 1536);
        let reads: Vec<u64> = (0..members).map(|m| w.member_read_bytes(m)).collect();
        w.replace_with_blank(lost, 4);
        assert_eq!(w.run_process(0), ProcessState::Finished, "shards {shards}");
        for m in (0..members).filter(|&m| m != lost) {
            // Each stripe's chunk once, in the rebuild or in its verification (reading the
            // unused parity in both, or in neither, would make this more or less); stripe 9
            // read again after the error by every survivor but the one that erred, whose
            // failed read moved nothing.
            let want = if m == bad {
                (stripes - 1) * c
            } else {
                (stripes + 1) * c
            };
            let read = w.member_read_bytes(m) - reads[usize::from(m)];
            assert_eq!(read, want, "member {m} (bad {bad}), shards {shards}");
        }
        let p = w.arr.process_snapshot().expect("a process ran");
        assert_eq!(p.done_stripes, stripes, "shards {shards}");
        assert_eq!(
            (p.verify_done_stripes, p.verify_total_stripes),
            (stripes, stripes),
            "shards {shards}"
        );
        assert_eq!(w.read_errors_repaired(), 1, "shards {shards}");
        w.assert_in_sync(&format!("shards {shards}"));
        w.assert_reads_model();
    }
}

/// A member replaced while a rebuild is verifying the parity it left unread: the rebuilt
/// member is online already, the verification stops for the rebuild the new member needs,
/// and that rebuild brings it back byte-exact under client I/O, with 1 and 2 shards.
#[test]
fn a_member_replaced_during_the_verification_walk_is_rebuilt_at_once() {
    for shards in [1usize, 2] {
        let stripes = 64u64;
        let mut w = World::raid6_filled(stripes, shards, 1750 + shards as u64);
        w.replace_with_blank(1, 5);
        w.run_process_until(2, |p| p.verify_done_stripes > 0);
        let p = w.arr.process_snapshot().expect("a rebuild runs");
        assert_eq!(p.state, ProcessState::Running, "shards {shards}");
        assert!(
            p.verify_done_stripes < p.verify_total_stripes,
            "shards {shards}"
        );
        assert_eq!(
            w.arr.member_states()[1],
            MemberState::Online,
            "rebuilt before its verification ends, shards {shards}"
        );
        w.fail_and_replace_running(3, 6, 2);
        let p = w.arr.process_snapshot().expect("a rebuild runs");
        assert!(
            p.verify_done_stripes < p.verify_total_stripes,
            "the replace came after the verification, shards {shards}"
        );
        // It gave way rather than holding the new member's rebuild back until it ends.
        assert_eq!(p.state, ProcessState::Stopped, "shards {shards}");
        assert_eq!(w.run_process(2), ProcessState::Finished, "shards {shards}");
        let p = w.arr.process_snapshot().expect("a process ran");
        assert_eq!(p.targets.as_slice(), &[3], "shards {shards}");
        assert!(w.failed.is_empty(), "shards {shards}: {:?}", w.failed);
        w.drain();
        w.assert_in_sync(&format!("shards {shards}"));
        w.assert_reads_model();
    }
}

/// A RAID6 rebuild of one member while another is missing reads every survivor (two
/// chunks are lost in each stripe), so it skips nothing and takes no verification walk.
#[test]
fn a_rebuild_that_skipped_nothing_verifies_nothing() {
    for shards in [1usize, 2] {
        let (members, stripes, c) = (6u16, 16u64, 8192u64);
        let mut w = World::raid6_filled(stripes, shards, 1780 + shards as u64);
        w.devs[4].disappear();
        w.arr.fail_member(4, IoError::Gone);
        let reads: Vec<u64> = (0..members).map(|m| w.member_read_bytes(m)).collect();
        w.replace_with_blank(1, 8);
        assert_eq!(w.run_process(0), ProcessState::Finished, "shards {shards}");
        let p = w.arr.process_snapshot().expect("a process ran");
        assert_eq!(p.verify_done_stripes, 0, "shards {shards}");
        for m in [0u16, 2, 3, 5] {
            let read = w.member_read_bytes(m) - reads[usize::from(m)];
            assert_eq!(read, stripes * c, "member {m}, shards {shards}");
        }
        assert_eq!(w.arr.member_states()[1], MemberState::Online);
        w.assert_reads_model();
    }
}

/// A member replaced while another's rebuild is still in its own walk waits for that
/// rebuild only: the verification walk is left out, so the new member's rebuild starts as
/// soon as the first member is rebuilt.
#[test]
fn a_rebuild_with_another_member_waiting_leaves_the_verification_out() {
    for shards in [1usize, 2] {
        let stripes = 64u64;
        let mut w = World::raid6_filled(stripes, shards, 1790 + shards as u64);
        w.replace_with_blank(1, 9);
        w.run_process_until(0, |p| p.done_stripes >= 8);
        w.fail_and_replace_running(3, 10, 0);
        w.run_until(0, |w| w.arr.member_states()[1] == MemberState::Online);
        let p = w.arr.process_snapshot().expect("a process ran");
        assert_eq!(p.verify_done_stripes, 0, "shards {shards}: {p:?}");
        assert!(
            p.targets.as_slice() == [3] || p.state == ProcessState::Finished,
            "shards {shards}: {p:?}"
        );
        assert_eq!(w.run_process(0), ProcessState::Finished, "shards {shards}");
        w.assert_in_sync(&format!("shards {shards}"));
        w.assert_reads_model();
    }
}

/// On members that seek (rotating disks) a RAID6 rebuild reads every survivor's chunk in
/// each stripe, as md does, so that each member's reads stay one sequential run; there
/// is no verification walk.
#[test]
fn a_raid6_rebuild_on_disks_reads_every_survivor_and_verifies_nothing_after() {
    let (members, stripes, c) = (5u16, 8u64, 8192u64);
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, members, c, BLOCK).unwrap();
    let geo = ArrayGeometry::new(g, stripes).unwrap();
    let clock = SimClock::new();
    let disk = |name: &str, seed: u64| {
        SimDevice::new(
            name,
            geo.member_data_bytes(),
            BLOCK,
            Profile::hdd_7200(true),
            clock.clone(),
            seed,
        )
        .unwrap()
    };
    let devs: Vec<SimDevice> = (0..members)
        .map(|i| disk(&format!("d{i}"), 1800 + u64::from(i)))
        .collect();
    let mut w = World::over(devs, geo, clock.clone(), 1, 18, config());
    w.fill();
    let lost = 2u16;
    w.devs[usize::from(lost)].disappear();
    w.arr.fail_member(lost, IoError::Gone);
    let reads: Vec<u64> = (0..members).map(|m| w.member_read_bytes(m)).collect();
    let spare = disk("spare", 1900);
    let chans = w.channels_to(&spare);
    w.arr.replace_member(lost, chans).unwrap();
    w.devs[usize::from(lost)] = spare;
    assert_eq!(w.run_process(0), ProcessState::Finished);
    for m in (0..members).filter(|&m| m != lost) {
        let read = w.member_read_bytes(m) - reads[usize::from(m)];
        assert_eq!(read, stripes * c, "member {m}");
    }
    let p = w.arr.process_snapshot().expect("a process ran");
    assert_eq!((p.verify_done_stripes, p.verify_total_stripes), (0, 0));
    w.assert_in_sync("disks");
    w.assert_reads_model();
}

/// A survivor hangs on a rebuild's read while a client keeps I/O going: the command
/// timeout fails it (at the timeout scan after its deadline), the stripe is rebuilt from
/// the others, and the rebuild ends byte-exact. Before `next_deadline_ns` reported such a
/// deadline as the next scan, the virtual clock stopped at it and this never finished.
#[test]
fn a_survivor_hanging_mid_rebuild_under_client_io_is_timed_out() {
    let c = 8192u64;
    for shards in [1usize, 4] {
        let mut w = World::new(Level::Raid6, 6, c, 48, shards, 4100 + shards as u64);
        w.fill();
        let lost = 0u16;
        let s = w.data_stripe_of(lost, 5);
        let p = w.geo.geometry().stripe(s).p_member();
        w.devs[usize::from(p)].add_fault(FaultRule {
            filter: OpFilter::Read,
            range: Some(s * c..(s + 1) * c),
            fault: Fault::Hang,
            probability: 1.0,
            count: Some(1),
        });
        w.replace_with_blank(lost, 7);
        assert_eq!(w.run_process(4), ProcessState::Finished, "shards {shards}");
        let states = w.arr.member_states();
        assert!(states[usize::from(p)].is_failed(), "shards {shards}");
        assert_eq!(states[usize::from(lost)], MemberState::Online);
        assert!(w.failed.is_empty(), "shards {shards}: {:?}", w.failed);
        assert_eq!(w.bad_reads, 0, "shards {shards}");
        let ok: Vec<u16> = (0..6u16).filter(|&m| m != p).collect();
        w.assert_members_hold_model(&ok);
        w.assert_reads_model();
    }
}

/// A torn stripe (data written, parity not: a crash) with an unreadable chunk — P, or
/// another data chunk: resync and repair rebuild it (regenerate P from the data; rebuild
/// the data from P) and still check Q, which is stale, so the stripe ends consistent;
/// check counts the stale Q as a mismatch and writes no parity. Before, a stripe with a
/// read error was only rebuilt, and Q stayed stale. (A data chunk rebuilt from stale P
/// is not what was last written there: one erasure and one wrong chunk are beyond two
/// parities; the model is updated to what the array now holds.)
#[test]
fn a_scrub_of_a_torn_stripe_with_an_unreadable_chunk_checks_the_other_parity() {
    let c = 8192u64;
    for (kind, unreadable) in [
        (ProcessKind::Resync, Role::P),
        (ProcessKind::Repair, Role::P),
        (ProcessKind::Check, Role::P),
        (ProcessKind::Resync, Role::Data { index: 1, slot: 1 }),
        (ProcessKind::Check, Role::Data { index: 1, slot: 1 }),
    ] {
        let what = format!("{kind:?}, {unreadable:?} unreadable");
        let mut w = World::new(Level::Raid6, 5, c, 16, 1, 4500);
        w.fill();
        let g = *w.geo.geometry();
        let s = 6u64;
        let st = g.stripe(s);
        let m = st.data_member(0);
        let mut new = vec![0u8; c as usize];
        w.rng.fill_bytes(&mut new);
        w.devs[usize::from(m)].poke(s * c, &new);
        let at = (s * g.stripe_data_bytes()) as usize;
        w.model[at..at + c as usize].copy_from_slice(&new);
        let bad = member_with(&w, s, unreadable);
        w.devs[usize::from(bad)].add_latent_error(s * c + 1024..s * c + 2048);
        w.arr.start_process(&ProcessRequest::whole(kind)).unwrap();
        assert_eq!(w.run_process(0), ProcessState::Finished, "{what}");
        assert_eq!(w.read_errors_repaired(), 1, "{what}");
        let mismatches = w.arr.process_snapshot().unwrap().mismatch_cnt;
        assert!(mismatches > 0, "{what}: the stale Q was not counted");
        if kind == ProcessKind::Check {
            assert_eq!(w.inconsistent_stripes(), vec![s], "{what}");
        } else {
            assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new(), "{what}");
        }
        if let Role::Data { index, .. } = unreadable {
            // Rebuilt from the stale P: take what the member now holds.
            let on = (s * c) as usize;
            let img = w.devs[usize::from(bad)].contents();
            let at = (s * g.stripe_data_bytes() + u64::from(index) * c) as usize;
            w.model[at..at + c as usize].copy_from_slice(&img[on..on + c as usize]);
        }
        assert_eq!(w.devs[usize::from(bad)].latent_errors(), vec![], "{what}");
        w.assert_reads_model();
    }
}

/// A member replaced while a rebuild runs waits for it (md's rule), then is rebuilt by a
/// rebuild of its own; both end byte-exact under client traffic.
#[test]
fn a_member_replaced_during_a_rebuild_is_rebuilt_next() {
    for shards in [1usize, 2, 4] {
        let mut w = World::new(Level::Raid6, 6, 8192, 40, shards, 1700 + shards as u64);
        w.fill();
        for m in [1u16, 4] {
            w.devs[usize::from(m)].disappear();
            w.arr.fail_member(m, IoError::Gone);
        }
        let spare = blank(&w, "spare1", 1);
        let chans = w.channels_to(&spare);
        w.arr.replace_member(1, chans).unwrap();
        w.devs[1] = spare;
        w.run_until(3, |w| {
            w.arr
                .process_snapshot()
                .is_some_and(|s| s.position_stripes >= 10)
        });
        let spare = blank(&w, "spare4", 4);
        let chans = w.channels_to(&spare);
        w.arr.replace_member(4, chans).unwrap();
        w.devs[4] = spare;
        assert_eq!(w.arr.process_snapshot().unwrap().targets.as_slice(), &[1]);
        // The first rebuild finishes, then the second runs.
        w.run_until(3, |w| w.arr.member_states()[1] == MemberState::Online);
        assert_eq!(w.arr.member_states()[4], MemberState::Rebuilding);
        assert_eq!(w.run_process(3), ProcessState::Finished);
        assert_eq!(w.arr.process_snapshot().unwrap().targets.as_slice(), &[4]);
        assert!(w.failed.is_empty(), "{:?}", w.failed);
        assert_eq!(w.bad_reads, 0);
        w.assert_in_sync("");
    }
}

/// A foreground read of a stripe whose background operation (here a resync) is in flight
/// runs beside it, as md serves aligned reads past a resync; a write of that stripe waits
/// for the operation to finish.
#[test]
fn reads_run_beside_a_background_operation_and_writes_wait() {
    const LAT: u64 = 1_000_000;
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 4, 64 << 10, BLOCK).unwrap();
    let geo = ArrayGeometry::new(g, 8).unwrap();
    let clock = SimClock::new();
    let chans: Vec<SimChannel> = (0..4)
        .map(|i| {
            SimDevice::new(
                &format!("d{i}"),
                geo.member_data_bytes(),
                BLOCK,
                Profile::fixed(LAT),
                clock.clone(),
                i,
            )
            .unwrap()
            .open_channel()
            .unwrap()
        })
        .collect();
    let cfg = ArrayConfig {
        background_ops: 1,
        ..config()
    };
    let mut arr = Array::new(geo, chans, Parity::new(), cfg).unwrap();
    arr.set_now(0);
    arr.start_process(&ProcessRequest::whole(ProcessKind::Resync))
        .unwrap();
    // The resync takes stripe 0 and reads it (every member: LAT).
    arr.process();
    assert!(arr.background_busy(), "the resync's operation is in flight");
    let mut rbuf = AlignedBuf::zeroed(4096);
    let mut wbuf = AlignedBuf::zeroed(4096);
    // SAFETY: both buffers outlive their requests (drained below before they drop) and
    // are not touched while the requests are outstanding.
    let (rio, wio) = unsafe { (IoBuf::from_slice(&mut rbuf), IoBuf::from_slice(&mut wbuf)) };
    arr.submit(ArrayRequest {
        tag: 1,
        op: ArrayOp::Read,
        offset_bytes: 0,
        len_bytes: 4096,
        buf: rio,
    })
    .unwrap();
    arr.submit(ArrayRequest {
        tag: 2,
        op: ArrayOp::Write { fua: false },
        offset_bytes: 8192,
        len_bytes: 4096,
        buf: wio,
    })
    .unwrap();
    let mut done_at = [0u64; 3];
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 8];
    for _ in 0..1000 {
        let now = clock.now_ns();
        arr.set_now(now);
        arr.process();
        let n = arr.poll(&mut out);
        for c in &out[..n] {
            c.status.unwrap();
            done_at[c.tag as usize] = now;
        }
        if done_at[1] > 0 && done_at[2] > 0 {
            break;
        }
        let next = arr
            .channels()
            .filter_map(SimChannel::next_completion_ns)
            .min()
            .or(arr.next_deadline_ns())
            .expect("something outstanding");
        clock.advance_to(next.max(now + 1));
    }
    // The read was issued at once, beside the resync's reads: one device latency.
    assert_eq!(done_at[1], LAT, "read completed at {} ns", done_at[1]);
    // The write (read-modify-write of stripe 0) started only after the resync's operation
    // finished (its reads: LAT), so it took at least two more device latencies.
    assert!(
        done_at[2] >= 3 * LAT,
        "write completed at {} ns",
        done_at[2]
    );
}

// ---- replace (md's `mdadm --replace`) ---------------------------------------------------

impl World {
    /// Runs with `client_qd` random client requests in flight until the last replacement
    /// left the copying state (done or failed); returns it.
    fn run_replace(&mut self, client_qd: usize) -> engine::array::ReplaceInfo {
        self.run_until(client_qd, |w| {
            w.arr
                .replacement()
                .is_some_and(|r| r.state != ReplaceState::Copying)
                && !w.arr.process_active()
        });
        self.drain();
        self.arr.replacement().expect("a replacement was started")
    }

    fn all_members(&self) -> Vec<u16> {
        (0..self.geo.geometry().members()).collect()
    }
}

/// Replace under random client writes and reads, on RAID5 and RAID6 with 1, 2 and 4
/// shards, with latent read errors scattered over the old member (some met by the copy,
/// some by client reads): the replacement takes the slot, holds exactly what the old
/// member held plus every write (byte for byte, data and parity: every stripe consistent
/// with the replacement in place), no client request fails or reads wrong bytes, and the
/// old member ends in service until the swap (its latent errors rebuilt from the others).
#[test]
fn replace_under_client_io_copies_the_member_with_every_write() {
    for (level, members) in [(Level::Raid5, 4u16), (Level::Raid6, 5)] {
        for shards in [1usize, 2, 4] {
            let seed = 900 + u64::from(members) * 10 + shards as u64;
            let mut w = World::new(level, members, 16384, 48, shards, seed);
            w.fill();
            let old = (seed % u64::from(members)) as u16;
            // Latent sector errors on the old member: three chunks' worth of sectors.
            for s in [5u64, 21, 40] {
                let at = s * 16384 + 4096;
                w.devs[usize::from(old)].add_latent_error(at..at + 1024);
            }
            let new = blank(&w, "new", seed);
            let chans = w.channels_to(&new);
            w.arr.start_replace(old, chans, 0).unwrap();
            assert_eq!(w.arr.process_snapshot().unwrap().kind, ProcessKind::Replace);
            let r = w.run_replace(6);
            assert_eq!(r.state, ReplaceState::Done, "{level:?} shards {shards}");
            assert_eq!(r.member, old);
            let snap = w.arr.process_snapshot().unwrap();
            assert_eq!(snap.state, ProcessState::Finished);
            assert_eq!(snap.targets.as_slice(), &[old]);
            assert!(w
                .arr
                .member_states()
                .iter()
                .all(|s| *s == MemberState::Online));
            assert!(w.failed.is_empty(), "client saw errors: {:?}", w.failed);
            assert_eq!(w.bad_reads, 0, "{level:?} shards {shards}");
            let stats: u64 = w.arr.shards().iter().map(|s| s.stats().medium_errors).sum();
            assert!(stats >= 1, "no latent error was met");
            // The replacement is the member now: the old device's storage is out.
            let old_dev = std::mem::replace(&mut w.devs[usize::from(old)], new);
            let all = w.all_members();
            w.assert_members_hold_model(&all);
            assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
            w.assert_reads_model();
            // Nothing reaches the old device any more.
            let before = old_dev.stats();
            for _ in 0..20 {
                w.random_io(true);
                w.random_io(false);
                w.drain();
            }
            assert_eq!(old_dev.stats(), before, "I/O after the swap");
            assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
        }
    }
}

/// Without clients the copy reads only the old member's chunks (each once) and writes
/// each to the replacement once; a chunk the old member cannot read is rebuilt from the
/// others (the other members read exactly that stripe) and rewritten on the old member
/// (which reaches the replacement too).
#[test]
fn replace_copies_from_the_old_member_and_rebuilds_only_what_it_cannot_read() {
    for shards in [1usize, 2, 4] {
        let mut w = World::new(Level::Raid6, 6, 8192, 32, shards, 950 + shards as u64);
        w.fill();
        let old = 2u16;
        w.devs[usize::from(old)].add_latent_error(7 * 8192..7 * 8192 + 512);
        let reads: Vec<u64> = (0..6).map(|m| w.member_read_bytes(m)).collect();
        let writes: Vec<u64> = (0..6).map(|m| w.member_write_bytes(m)).collect();
        let new = blank(&w, "new", 3);
        let chans = w.channels_to(&new);
        w.arr.start_replace(old, chans, 0).unwrap();
        let r = w.run_replace(0);
        assert_eq!(r.state, ReplaceState::Done);
        let c = 8192u64;
        for m in 0..6u16 {
            let read = w.member_read_bytes(m) - reads[usize::from(m)];
            let wrote = w.member_write_bytes(m) - writes[usize::from(m)];
            if m == old {
                // Every chunk read once; the failed read moved nothing.
                assert_eq!(read, 32 * c - c, "old member, shards {shards}");
                // Stripe 7's chunk rewritten where the read failed.
                assert_eq!(wrote, c, "old member rewritten, shards {shards}");
            } else {
                assert_eq!(read, c, "member {m} read stripe 7 only, shards {shards}");
                assert_eq!(wrote, 0, "member {m}, shards {shards}");
            }
        }
        // The replacement: every chunk once, stripe 7's twice (the rewrite of the old
        // member is a write to it as well, and the copy's own write is then skipped).
        assert_eq!(new.stats().bytes_written, 32 * c, "shards {shards}");
        w.devs[usize::from(old)] = new;
        w.assert_members_hold_model(&w.all_members());
        assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
    }
}

/// The old member fails part-way (its reads start failing, then it disappears): the
/// replace goes on as a rebuild from the others (redundancy is spent on the old member
/// only), completes, and the replacement holds everything; clients see no error.
#[test]
fn old_member_failing_mid_replace_turns_it_into_a_rebuild() {
    for (level, members) in [(Level::Raid5, 4u16), (Level::Raid6, 5)] {
        for shards in [1usize, 2, 4] {
            let seed = 970 + u64::from(members) * 10 + shards as u64;
            let mut w = World::new(level, members, 8192, 40, shards, seed);
            w.fill();
            let old = 1u16;
            let new = blank(&w, "new", seed);
            let chans = w.channels_to(&new);
            w.arr.start_replace(old, chans, 0).unwrap();
            w.run_until(4, |w| {
                w.arr
                    .process_snapshot()
                    .is_some_and(|s| s.position_stripes >= 12)
            });
            // Reads beyond stripe 20 fail with an I/O error (the member is failed on the
            // first), then it disappears altogether.
            w.devs[usize::from(old)].add_fault(FaultRule {
                filter: OpFilter::Read,
                range: Some(20 * 8192..40 * 8192),
                fault: Fault::Error(IoError::Io { errno: 5 }),
                probability: 1.0,
                count: None,
            });
            w.run_until(4, |w| {
                w.arr.member_states()[usize::from(old)].is_failed()
                    || w.arr
                        .process_snapshot()
                        .is_some_and(|s| s.position_stripes >= 24)
            });
            w.devs[usize::from(old)].disappear();
            let r = w.run_replace(4);
            assert_eq!(r.state, ReplaceState::Done, "{level:?} shards {shards}");
            let failures: u64 = w
                .arr
                .shards()
                .iter()
                .map(|s| s.stats().member_failures)
                .sum();
            assert!(failures >= 1, "the old member never failed");
            assert!(w
                .arr
                .member_states()
                .iter()
                .all(|s| *s == MemberState::Online));
            assert!(w.failed.is_empty(), "client saw errors: {:?}", w.failed);
            assert_eq!(w.bad_reads, 0);
            w.devs[usize::from(old)] = new;
            w.assert_members_hold_model(&w.all_members());
            assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
            w.assert_reads_model();
        }
    }
}

/// The replacement fails part-way: the replace stops (ReplacementFailed), the old member
/// keeps its slot, nothing else changes (every member online, data and parity intact),
/// clients see no error; a second replace onto a good device then completes.
#[test]
fn replacement_failing_stops_the_replace_and_leaves_the_array_unchanged() {
    for shards in [1usize, 2, 4] {
        let mut w = World::new(Level::Raid5, 4, 8192, 32, shards, 990 + shards as u64);
        w.fill();
        let bad = blank(&w, "bad", 1);
        bad.add_fault(FaultRule {
            filter: OpFilter::Write,
            range: Some(16 * 8192..32 * 8192),
            fault: Fault::Error(IoError::Io { errno: 5 }),
            probability: 1.0,
            count: None,
        });
        let chans = w.channels_to(&bad);
        w.arr.start_replace(3, chans, 0).unwrap();
        let r = w.run_replace(4);
        assert!(matches!(r.state, ReplaceState::Failed(_)), "{r:?}");
        assert_eq!(
            w.arr.process_snapshot().unwrap().state,
            ProcessState::Failed(ProcessError::ReplacementFailed { member: 3 })
        );
        assert!(w.failed.is_empty(), "{:?}", w.failed);
        assert_eq!(w.bad_reads, 0);
        w.assert_in_sync("");
        // The failed device gets nothing more.
        let before = bad.stats();
        for _ in 0..10 {
            w.random_io(true);
            w.drain();
        }
        assert_eq!(bad.stats().bytes_written, before.bytes_written);
        // Another replace of the same member works.
        let good = blank(&w, "good", 2);
        let chans = w.channels_to(&good);
        w.arr.start_replace(3, chans, 0).unwrap();
        assert_eq!(w.run_replace(4).state, ReplaceState::Done);
        w.devs[3] = good;
        w.assert_members_hold_model(&[0, 1, 2, 3]);
        assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
        assert!(w.failed.is_empty(), "{:?}", w.failed);
    }
}

/// What a replace refuses, and why (md's rules where it has them): no such member, a
/// device too small, a second replacement while one is live, a degraded array (md gives
/// a new device to the missing member first), a member already failed (add a device to
/// rebuild it), another process running. Nothing changes on a refusal.
#[test]
fn replace_refusals() {
    let mut w = World::new(Level::Raid6, 5, 8192, 16, 2, 1001);
    w.fill();
    let dev = blank(&w, "new", 1);
    let chans = w.channels_to(&dev);
    assert_eq!(
        w.arr.start_replace(7, chans, 0),
        Err(ProcessError::NoSuchMember {
            member: 7,
            members: 5
        })
    );
    let tiny =
        SimDevice::new("tiny", 4096, BLOCK, Profile::nvme_ssd(), w.clock.clone(), 1).unwrap();
    let chans = w.channels_to(&tiny);
    assert!(matches!(
        w.arr.start_replace(1, chans, 0),
        Err(ProcessError::Unfit { member: 1, .. })
    ));
    w.arr
        .start_process(&ProcessRequest::whole(ProcessKind::Check))
        .unwrap();
    let chans = w.channels_to(&dev);
    assert_eq!(
        w.arr.start_replace(1, chans, 0),
        Err(ProcessError::Busy {
            running: ProcessKind::Check
        })
    );
    w.run_process(0);
    let chans = w.channels_to(&dev);
    w.arr.start_replace(1, chans, 0).unwrap();
    let other = blank(&w, "other", 2);
    let chans = w.channels_to(&other);
    assert_eq!(
        w.arr.start_replace(1, chans, 0),
        Err(ProcessError::ReplaceBusy { member: 1 })
    );
    let chans = w.channels_to(&other);
    assert_eq!(
        w.arr.start_replace(2, chans, 0),
        Err(ProcessError::ReplaceBusy { member: 1 })
    );
    assert_eq!(
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Check)),
        Err(ProcessError::Busy {
            running: ProcessKind::Replace
        })
    );
    assert_eq!(w.run_replace(0).state, ReplaceState::Done);
    w.devs[1] = dev;
    // Degraded: refused, the failed member named.
    w.devs[3].disappear();
    w.arr.fail_member(3, IoError::Gone);
    let chans = w.channels_to(&other);
    assert_eq!(
        w.arr.start_replace(0, chans, 0),
        Err(ProcessError::Degraded {
            kind: ProcessKind::Replace,
            member: 3
        })
    );
    let chans = w.channels_to(&other);
    assert_eq!(
        w.arr.start_replace(3, chans, 0),
        Err(ProcessError::NotInService { member: 3 })
    );
}

/// A replace resumed from a checkpoint copies nothing below it (the replacement already
/// holds those stripes, as `recovery_offset` says after a restart).
#[test]
fn replace_resumes_from_its_checkpoint() {
    let mut w = World::new(Level::Raid5, 4, 8192, 32, 2, 1010);
    w.fill();
    let new = blank(&w, "new", 1);
    // What a first run copied before it stopped: stripes below 20.
    for s in 0..20u64 {
        let at = (s * 8192) as usize;
        new.poke(s * 8192, &w.devs[0].contents()[at..at + 8192]);
    }
    let reads = w.member_read_bytes(0);
    let chans = w.channels_to(&new);
    w.arr.start_replace(0, chans, 20).unwrap();
    assert_eq!(w.run_replace(0).state, ReplaceState::Done);
    assert_eq!(w.member_read_bytes(0) - reads, 12 * 8192);
    assert_eq!(new.stats().bytes_written, 12 * 8192);
    w.devs[0] = new;
    w.assert_members_hold_model(&[0, 1, 2, 3]);
    assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
}

/// While a shard still copies a replacement, a read of another shard's stripe that arrives
/// on it goes to the owner: an owner that has already swapped the replacement in writes
/// only the new device, so this shard must not read the old one for the owner's stripes
/// (on threaded reactors the swaps happen at different moments). Without a replace such a
/// read is served where it arrived (a foreign read).
#[test]
fn a_shard_still_copying_a_replacement_sends_foreign_reads_to_the_owner() {
    let mut w = World::new(Level::Raid5, 4, 8192, 32, 2, 4242);
    w.fill();
    let stripe_bytes = w.geo.geometry().stripe_data_bytes();
    let mut buf = AlignedBuf::zeroed(4096);
    // Stripe 1 belongs to shard 1; shard 0 receives the read.
    let read = |buf: &mut AlignedBuf| ArrayRequest {
        tag: 77,
        op: ArrayOp::Read,
        offset_bytes: stripe_bytes,
        len_bytes: 4096,
        // SAFETY: the buffer outlives the request, which completes or moves below.
        buf: unsafe { IoBuf::from_slice(&mut buf[..]) },
    };
    let before = w.arr.shards()[0].stats();
    w.arr.shards_mut()[0].submit(read(&mut buf)).unwrap();
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 4];
    let mut got = 0;
    for _ in 0..1000 {
        let sh = &mut w.arr.shards_mut()[0];
        sh.set_now(w.clock.now_ns());
        sh.process();
        got += sh.poll(&mut out[got..]);
        if got > 0 {
            break;
        }
        w.clock.advance_by(10_000);
    }
    assert_eq!(got, 1);
    assert!(w.arr.shards_mut()[0].take_moved().is_none());
    assert_eq!(out[0].status, Ok(()));
    assert_eq!(
        w.arr.shards()[0].stats().foreign_reads,
        before.foreign_reads + 1
    );
    // Now with a replacement being copied on every shard.
    let new = blank(&w, "new", 5);
    let chans = w.channels_to(&new);
    w.arr.start_replace(2, chans, 0).unwrap();
    w.arr.shards_mut()[0].submit(read(&mut buf)).unwrap();
    w.arr.shards_mut()[0].process();
    let moved = w.arr.shards_mut()[0]
        .take_moved()
        .expect("handed to the owner");
    assert_eq!((moved.tag, moved.offset_bytes), (77, stripe_bytes));
    assert_eq!(
        w.arr.shards()[0].stats().foreign_reads,
        before.foreign_reads + 1
    );
}

/// Replaces one after another in the same running array (a QA finding: the second one
/// used to finish at once, taking the slot with the blank device uncopied, because the
/// first replace's finished process stood for the new one). Each copies everything, with
/// clients running, on 1, 2 and 4 shards; the same slot twice and another slot.
#[test]
fn consecutive_replaces_each_copy_the_member() {
    for shards in [1usize, 2, 4] {
        let mut w = World::new(Level::Raid5, 4, 8192, 32, shards, 1300 + shards as u64);
        w.fill();
        for (i, old) in [1u16, 1, 3].into_iter().enumerate() {
            let new = blank(&w, "new", 40 + i as u64);
            let chans = w.channels_to(&new);
            w.arr.start_replace(old, chans, 0).unwrap();
            let snap = w.arr.process_snapshot().unwrap();
            assert_eq!(
                (snap.kind, snap.state),
                (ProcessKind::Replace, ProcessState::Running),
                "replace {i}, shards {shards}"
            );
            let r = w.run_replace(4);
            assert_eq!(r.state, ReplaceState::Done, "replace {i}, shards {shards}");
            // Every chunk of the member reached the new device.
            assert!(
                new.stats().bytes_written >= 32 * 8192,
                "replace {i}, shards {shards}: {} bytes copied",
                new.stats().bytes_written
            );
            w.devs[usize::from(old)] = new;
            w.assert_members_hold_model(&w.all_members());
            assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new());
            assert!(w.failed.is_empty(), "{:?}", w.failed);
            assert_eq!(w.bad_reads, 0);
        }
    }
}

/// The member holding `role` in `stripe` (`Role::Data` by data index).
fn member_with(w: &World, stripe: u64, role: Role) -> u16 {
    let st = w.geo.geometry().stripe(stripe);
    match role {
        Role::P => st.p_member(),
        Role::Q => st.q_member().expect("RAID6"),
        Role::Data { index, .. } => st.data_member(index),
    }
}

/// The first stripe from `from` on where `m`'s role satisfies `pred`.
fn stripe_where(w: &World, from: u64, m: u16, pred: impl Fn(Role) -> bool) -> u64 {
    (from..w.geo.stripes())
        .find(|&s| pred(w.geo.geometry().stripe(s).role(m)))
        .expect("such a stripe")
}

/// An unrecovered read error on `m` inside `stripe`'s chunk (`c` bytes).
fn latent(w: &World, m: u16, stripe: u64, c: u64) {
    w.devs[usize::from(m)].add_latent_error(stripe * c + 1024..stripe * c + 2048);
}

/// Every background process kind on RAID6 of 4 and 6 members, 1, 2 and 4 shards, without
/// and with client I/O, over unrecovered read errors placed on each role: for a rebuild,
/// stripes where the lost member is data (errors on P, on other data, on Q), P (error on
/// data) and Q (error on data); for a replace, the old member unreadable where it is data,
/// P and Q, plus a second error on a survivor; for resync, check and repair, errors on
/// data, P, Q, and data + P in one stripe. Every member ends exact, every stripe
/// consistent, every read right, no client request failed. (From the review of `d1e4752`.)
#[test]
fn background_processes_over_read_errors_on_every_role() {
    let c = 8192u64;
    let is_data = |r: Role| matches!(r, Role::Data { .. });
    let first_data = Role::Data { index: 0, slot: 0 };
    for members in [4u16, 6] {
        for shards in [1usize, 2, 4] {
            for qd in [0usize, 4] {
                for kind in [
                    ProcessKind::Rebuild,
                    ProcessKind::Replace,
                    ProcessKind::Resync,
                    ProcessKind::Check,
                    ProcessKind::Repair,
                ] {
                    let seed = 3000 + u64::from(members) * 100 + shards as u64 * 10 + qd as u64;
                    let what = format!("{kind:?} members {members} shards {shards} qd {qd}");
                    let mut w = World::new(Level::Raid6, members, c, 48, shards, seed);
                    w.fill();
                    let t = 1u16;
                    match kind {
                        ProcessKind::Rebuild => {
                            let a = stripe_where(&w, 0, t, is_data);
                            latent(&w, member_with(&w, a, Role::P), a, c);
                            let b = stripe_where(&w, a + 1, t, is_data);
                            let d = (0..members)
                                .find(|&m| m != t && is_data(w.geo.geometry().stripe(b).role(m)))
                                .expect("another data chunk");
                            latent(&w, d, b, c);
                            let e = stripe_where(&w, 0, t, |r| r == Role::P);
                            latent(&w, member_with(&w, e, first_data), e, c);
                            let f = stripe_where(&w, 0, t, |r| r == Role::Q);
                            latent(&w, member_with(&w, f, first_data), f, c);
                            let g = stripe_where(&w, f + 1, t, |r| r == Role::Q);
                            latent(&w, member_with(&w, g, Role::P), g, c);
                            let h = stripe_where(&w, e + 1, t, |r| r == Role::P);
                            latent(&w, member_with(&w, h, Role::Q), h, c);
                            w.replace_with_blank(t, seed);
                            assert_eq!(w.run_process(qd), ProcessState::Finished, "{what}");
                        }
                        ProcessKind::Replace => {
                            let a = stripe_where(&w, 0, t, is_data);
                            let e = stripe_where(&w, 0, t, |r| r == Role::P);
                            let f = stripe_where(&w, 0, t, |r| r == Role::Q);
                            for s in [a, e, f] {
                                latent(&w, t, s, c);
                            }
                            latent(&w, member_with(&w, a, Role::P), a, c);
                            latent(&w, member_with(&w, e, first_data), e, c);
                            let new = blank(&w, "new", seed);
                            let chans = w.channels_to(&new);
                            w.arr.start_replace(t, chans, 0).unwrap();
                            let r = w.run_replace(qd);
                            assert_eq!(r.state, ReplaceState::Done, "{what}");
                            w.devs[usize::from(t)] = new;
                        }
                        _ => {
                            let st = |s: u64| w.geo.geometry().stripe(s);
                            latent(&w, st(2).data_member(0), 2, c);
                            latent(&w, st(5).p_member(), 5, c);
                            latent(&w, st(8).q_member().expect("RAID6"), 8, c);
                            latent(&w, st(11).data_member(1), 11, c);
                            latent(&w, st(11).p_member(), 11, c);
                            w.arr.start_process(&ProcessRequest::whole(kind)).unwrap();
                            assert_eq!(w.run_process(qd), ProcessState::Finished, "{what}");
                            if qd == 0 {
                                let snap = w.arr.process_snapshot().unwrap();
                                assert_eq!(snap.mismatch_cnt, 0, "{what}");
                            }
                        }
                    }
                    assert!(
                        w.arr
                            .member_states()
                            .iter()
                            .all(|s| *s == MemberState::Online),
                        "{what}: {:?}",
                        w.arr.member_states()
                    );
                    // Every process reads every chunk it met an error in and rewrites
                    // the unreadable range: none is left on any member.
                    for (m, d) in w.devs.iter().enumerate() {
                        assert_eq!(d.latent_errors(), vec![], "{what}: member {m}");
                    }
                    let all = w.all_members();
                    w.assert_members_hold_model(&all);
                    assert_eq!(w.inconsistent_stripes(), Vec::<u64>::new(), "{what}");
                    w.assert_reads_model();
                    assert!(w.failed.is_empty(), "{what}: client errors {:?}", w.failed);
                    assert_eq!(w.bad_reads, 0, "{what}");
                }
            }
        }
    }
}
