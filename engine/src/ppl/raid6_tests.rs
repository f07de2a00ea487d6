//! RAID6 PPL recovery (ferroraid RAID6 extension, docs/FORMAT.md) on simulated members.
//!
//! A RAID6 image with known data and consistent P/Q; a write of one stripe is logged as the
//! spec says the writer logs it (a P-log and a Q-log record with the entries of
//! [`entries_for_range`] and partial P / partial Q computed with [`Parity`]); the crash
//! leaves the modified chunks and P/Q old, new or torn; 0, 1 or 2 members are dropped
//! (they disappear: recovery touching one fails the test). After [`recover`], every
//! unmodified block must read back through degraded reconstruction, the stripe must be
//! consistent wherever the members allow a check, and nothing but the stripe's P/Q rows may
//! have changed.

use proptest::prelude::*;

use super::*;
use crate::buf::AlignedBuf;
use crate::geometry::{Geometry, Layout, Level, StripeLayout};
use crate::metadata::ppl::{pp_checksum, signature, PplEntry, PplHeader, PPL_HEADER_SIZE};
use crate::parity::{ChunkId, Parity};
use crate::sim::{Profile, SimClock, SimDevice, SimMedia};

const CHUNK: u64 = 8192;
const STRIPES: u64 = 8;
const AREA_OFFSET: u64 = 4096;
const AREA_BYTES: u64 = 64 << 10;
const DATA_OFFSET: u64 = AREA_OFFSET + AREA_BYTES;
const UUID: Uuid = Uuid([0x6c; 16]);

fn ppl_layout() -> PplLayout {
    PplLayout {
        area_offset_bytes: AREA_OFFSET,
        area_bytes: AREA_BYTES,
        data_offset_bytes: DATA_OFFSET,
    }
}

/// xorshift64: deterministic test bytes.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// A RAID6 array on simulated members, and what its data must read back as.
struct World {
    geo: ArrayGeometry,
    devs: Vec<SimDevice>,
    /// The array's logical data (durable writes applied).
    data: AlignedBuf,
}

impl World {
    fn new(layout: Layout, members: u16, seed: u64) -> World {
        let g = Geometry::new(Level::Raid6, layout, members, CHUNK, 512).unwrap();
        let geo = ArrayGeometry::new(g, STRIPES).unwrap();
        let clock = SimClock::new();
        let devs = (0..members)
            .map(|i| {
                let cap = DATA_OFFSET + STRIPES * CHUNK;
                let seed = seed ^ u64::from(i);
                SimDevice::new(
                    &format!("d{i}"),
                    cap,
                    512,
                    Profile::nvme_ssd(),
                    clock.clone(),
                    seed,
                )
                .unwrap()
            })
            .collect();
        let mut data = AlignedBuf::zeroed(geo.capacity_bytes() as usize);
        let mut next = rng(seed);
        data.iter_mut().for_each(|b| *b = next() as u8);
        let w = World { geo, devs, data };
        for s in 0..STRIPES {
            let img = AlignedBuf::from_slice(w.stripe_data(s));
            w.put_stripe(s, &img);
        }
        let all = vec![true; usize::from(members)];
        reinit_areas(&ppl_layout(), &UUID, &all, &mut SimMedia(&w.devs)).unwrap();
        w
    }

    fn nd(&self) -> usize {
        usize::from(self.geo.geometry().data_chunks())
    }

    fn stripe_data(&self, s: u64) -> &[u8] {
        let sd = self.geo.geometry().stripe_data_bytes() as usize;
        &self.data[s as usize * sd..(s as usize + 1) * sd]
    }

    /// Chunk `k` of a stripe image, by logical data index.
    fn chunk(img: &[u8], k: usize) -> &[u8] {
        &img[k * CHUNK as usize..(k + 1) * CHUNK as usize]
    }

    /// P and Q of a stripe image.
    fn pq(&self, s: u64, img: &[u8]) -> (AlignedBuf, AlignedBuf) {
        let st = self.geo.stripe(s);
        let mut p = AlignedBuf::zeroed(CHUNK as usize);
        let mut q = AlignedBuf::zeroed(CHUNK as usize);
        Parity::new().gen_pq(&by_slot(&st, |k| Self::chunk(img, k)), &mut p, &mut q);
        (p, q)
    }

    /// Writes stripe image `img` (data, P and Q) to the members.
    fn put_stripe(&self, s: u64, img: &[u8]) {
        self.put_mixed(s, img, img, |_, _| true, |_, _| true);
    }

    /// Writes stripe `s` mixing two states block by block: data chunk `k`'s 512-byte block
    /// `b` comes from `old` when `data_old(k, b)`, else `new`; P (`k` = nd) and Q
    /// (`k` = nd + 1) from the parity of `old` when `pq_old(k, b)`, else of `new`.
    fn put_mixed(
        &self,
        s: u64,
        old: &[u8],
        new: &[u8],
        data_old: impl Fn(usize, usize) -> bool,
        pq_old: impl Fn(usize, usize) -> bool,
    ) {
        let st = self.geo.stripe(s);
        let nd = self.nd();
        let (po, qo) = self.pq(s, old);
        let (pn, qn) = self.pq(s, new);
        let at = DATA_OFFSET + s * CHUNK;
        for k in 0..nd + 2 {
            let (member, o, n): (u16, &[u8], &[u8]) = if k < nd {
                let m = st.data_member(k as u16);
                (m, Self::chunk(old, k), Self::chunk(new, k))
            } else if k == nd {
                (st.p_member(), &po, &pn)
            } else {
                (st.q_member().unwrap(), &qo, &qn)
            };
            for b in 0..(CHUNK / 512) as usize {
                let keep_old = if k < nd { data_old(k, b) } else { pq_old(k, b) };
                let src = if keep_old { o } else { n };
                self.devs[usize::from(member)]
                    .poke(at + b as u64 * 512, &src[b * 512..(b + 1) * 512]);
            }
        }
    }

    /// Reads stripe `s` back as a reader with the members `present` would, reconstructing
    /// the others: the stripe's logical data, and whether the stripe is consistent where
    /// the members allow a check (`None`: two members missing, nothing to check against).
    fn read_back(&self, s: u64, present: &[bool]) -> (AlignedBuf, Option<bool>) {
        let st = self.geo.stripe(s);
        let nd = self.nd();
        let c = CHUNK as usize;
        let at = DATA_OFFSET + s * CHUNK;
        let mut slots = AlignedBuf::zeroed(nd * c);
        let mut p = AlignedBuf::zeroed(c);
        let mut q = AlignedBuf::zeroed(c);
        let mut lost = Vec::new();
        for k in 0..nd as u16 {
            let (m, slot) = (st.data_member(k), usize::from(st.q_slot(k)));
            if present[usize::from(m)] {
                self.devs[usize::from(m)].peek(at, &mut slots[slot * c..(slot + 1) * c]);
            } else {
                lost.push(ChunkId::Data(slot as u8));
            }
        }
        let (pm, qm) = (st.p_member(), st.q_member().unwrap());
        let mut media = Vec::new();
        for (m, id, buf) in [(pm, ChunkId::P, &mut p), (qm, ChunkId::Q, &mut q)] {
            if present[usize::from(m)] {
                self.devs[usize::from(m)].peek(at, buf);
            } else {
                lost.push(id);
            }
        }
        // Regenerate parity that is on media too, to compare.
        for id in [ChunkId::Q, ChunkId::P] {
            if lost.len() < 2 && !lost.contains(&id) {
                lost.push(id);
                media.push((
                    id,
                    if id == ChunkId::P {
                        p.to_vec()
                    } else {
                        q.to_vec()
                    },
                ));
            }
        }
        assert!(lost.len() <= 2, "tests drop at most two members");
        let mut sl: Vec<&mut [u8]> = slots.chunks_exact_mut(c).collect();
        Parity::new()
            .reconstruct(&mut sl, &mut p, Some(&mut q), &lost)
            .unwrap();
        let consistent = (!media.is_empty()).then(|| {
            media.iter().all(|(id, on_media)| {
                let regenerated: &[u8] = if *id == ChunkId::P { &p } else { &q };
                regenerated == &on_media[..]
            })
        });
        let mut img = AlignedBuf::zeroed(nd * c);
        for k in 0..nd as u16 {
            let slot = usize::from(st.q_slot(k));
            img[usize::from(k) * c..(usize::from(k) + 1) * c]
                .copy_from_slice(&slots[slot * c..(slot + 1) * c]);
        }
        (img, consistent)
    }

    /// Makes the members not `present` disappear (recovery touching one fails).
    fn drop_members(&self, present: &[bool]) {
        for (d, &p) in self.devs.iter().zip(present) {
            if !p {
                d.disappear();
            }
        }
    }

    fn recover(&self, present: &[bool]) -> RecoveryReport {
        recover(
            &self.geo,
            &ppl_layout(),
            &UUID,
            present,
            &mut SimMedia(&self.devs),
        )
        .expect("recovery reads and writes only present members")
    }
}

/// The data chunks of a stripe in Q slot order, `chunk(k)` by logical index.
fn by_slot<'a>(st: &StripeLayout, chunk: impl Fn(usize) -> &'a [u8]) -> Vec<&'a [u8]> {
    let nd = usize::from(st.data_chunks());
    let mut out = vec![&[][..]; nd];
    for k in 0..nd {
        out[usize::from(st.q_slot(k as u16))] = chunk(k);
    }
    out
}

/// The P-log and Q-log records of a write of stripe `s`'s logical range `lo..hi` (bytes)
/// over the stripe image `before`, as the writer makes them: the entries of
/// [`entries_for_range`], partial P and partial Q over the unmodified chunks (the modified
/// ones taken as zero), `parity_disk` the log's own member. Each: (entries, partial parity
/// bytes back to back).
fn log_write(w: &World, s: u64, lo: u64, hi: u64, before: &[u8]) -> [(Vec<PplEntry>, Vec<u8>); 2] {
    let st = w.geo.stripe(s);
    let g = w.geo.geometry();
    let nd = g.data_chunks();
    let (pm, qm) = (st.p_member(), st.q_member().unwrap());
    let mut out = [(Vec::new(), Vec::new()), (Vec::new(), Vec::new())];
    for r in entries_for_range(lo, hi, g.chunk_bytes()) {
        let (a, n) = (r.row_start as usize, r.row_bytes as usize);
        let zero = AlignedBuf::zeroed(n);
        let rows: Vec<AlignedBuf> = (0..nd)
            .map(|k| AlignedBuf::from_slice(&World::chunk(before, usize::from(k))[a..a + n]))
            .collect();
        let mut pp = [AlignedBuf::zeroed(n), AlignedBuf::zeroed(n)];
        let [pp_p, pp_q] = &mut pp;
        let virt = by_slot(&st, |k| {
            if r.first_chunk as usize <= k && k < usize::from(r.first_chunk + r.chunks) {
                &zero[..]
            } else {
                &rows[k][..]
            }
        });
        Parity::new().gen_pq(&virt, pp_p, pp_q);
        let first = (s * u64::from(nd) + u64::from(r.first_chunk)) * CHUNK + u64::from(r.row_start);
        for ((entries, bytes), (member, pp)) in out.iter_mut().zip([(pm, &pp[0]), (qm, &pp[1])]) {
            let pp = &pp[..r.pp_bytes(nd) as usize];
            entries.push(PplEntry {
                data_sector: first / 512,
                pp_size: pp.len() as u32,
                data_size: r.row_bytes * u32::from(r.chunks),
                parity_disk: u32::from(member),
                checksum: pp_checksum(pp),
            });
            bytes.extend_from_slice(pp);
        }
    }
    out
}

/// Writes a record (header of `generation` + partial parity) at `offset` bytes into
/// `member`'s area; returns the offset just past it.
fn put_record(
    w: &World,
    member: u16,
    generation: u64,
    offset: u64,
    rec: &(Vec<PplEntry>, Vec<u8>),
) -> u64 {
    let header = PplHeader {
        signature: signature(&UUID),
        generation,
        entries: rec.0.clone(),
    };
    let d = &w.devs[usize::from(member)];
    d.poke(AREA_OFFSET + offset, &header.encode().unwrap());
    d.poke(AREA_OFFSET + offset + PPL_HEADER_SIZE as u64, &rec.1);
    offset + (PPL_HEADER_SIZE + rec.1.len()) as u64
}

/// The stripe image `before` with `lo..hi` from fresh bytes.
fn written(before: &[u8], lo: u64, hi: u64, seed: u64) -> AlignedBuf {
    let mut img = AlignedBuf::from_slice(before);
    let mut next = rng(seed ^ 0xA5A5);
    img[lo as usize..hi as usize]
        .iter_mut()
        .for_each(|b| *b = next() as u8);
    img
}

/// Every `present` vector of `members` members with 0, 1 or 2 of them missing.
fn losses(members: u16) -> Vec<Vec<bool>> {
    let n = usize::from(members);
    let mut out = vec![vec![true; n]];
    for a in 0..n {
        let mut p = vec![true; n];
        p[a] = false;
        out.push(p.clone());
        for b in a + 1..n {
            let mut p = p.clone();
            p[b] = false;
            out.push(p);
        }
    }
    out
}

fn contents(w: &World) -> Vec<Vec<u8>> {
    w.devs.iter().map(SimDevice::contents).collect()
}

/// What [`check`] expects of the modified range of stripe `s`.
#[derive(Clone, Copy, Debug)]
enum Modified {
    /// Anything (an in-flight write, torn): only consistency is checked.
    Unknown,
    /// Every block holds this image (a uniform crash state).
    Is(Uniform),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Uniform {
    Old,
    New,
}

/// The checks after recovery: every stripe but `s` reads back as `w.data` and is
/// consistent; stripe `s` reads back as `old` outside `lo..hi` (inside as `modified`
/// says) and is consistent wherever a check is possible; on the present members nothing
/// changed but P/Q of stripe `s`.
#[allow(clippy::too_many_arguments)]
fn check(
    w: &World,
    present: &[bool],
    s: u64,
    (lo, hi): (u64, u64),
    old: &[u8],
    new: &[u8],
    modified: Modified,
    snapshot: &[Vec<u8>],
    ctx: &str,
) {
    for t in 0..STRIPES {
        let (img, consistent) = w.read_back(t, present);
        assert_ne!(consistent, Some(false), "{ctx}: stripe {t} inconsistent");
        if t != s {
            assert!(
                img[..] == *w.stripe_data(t),
                "{ctx}: stripe {t} reads back wrong"
            );
            continue;
        }
        let (lo, hi) = (lo as usize, hi as usize);
        assert!(
            img[..lo] == old[..lo],
            "{ctx}: unmodified blocks before the write"
        );
        assert!(
            img[hi..] == old[hi..],
            "{ctx}: unmodified blocks after the write"
        );
        if let Modified::Is(u) = modified {
            let want = if u == Uniform::Old { old } else { new };
            assert!(
                img[lo..hi] == want[lo..hi],
                "{ctx}: modified blocks not {u:?}"
            );
        }
    }
    check_writes(w, present, s, snapshot, ctx);
}

/// On the present members nothing changed but P/Q of stripe `s`.
fn check_writes(w: &World, present: &[bool], s: u64, snapshot: &[Vec<u8>], ctx: &str) {
    let st = w.geo.stripe(s);
    let parity_rows = DATA_OFFSET + s * CHUNK..DATA_OFFSET + (s + 1) * CHUNK;
    for (m, (d, before)) in w.devs.iter().zip(snapshot).enumerate() {
        if !present[m] {
            continue;
        }
        let after = d.contents();
        let is_parity = m == usize::from(st.p_member()) || Some(m as u16) == st.q_member();
        for (i, (a, b)) in after.iter().zip(before).enumerate() {
            if a != b {
                assert!(
                    is_parity && parity_rows.contains(&(i as u64)),
                    "{ctx}: member {m} byte {i} written by recovery"
                );
            }
        }
    }
}

/// Crash state of one chunk kind (data or P/Q): which 512-byte blocks still hold the old
/// state.
#[derive(Clone, Copy, Debug)]
enum State {
    Old,
    New,
    /// Blocks old where the mask bit (block ^ chunk index, mod 64) is set.
    Torn(u64),
}

impl State {
    fn old(self, k: usize, b: usize) -> bool {
        match self {
            State::Old => true,
            State::New => false,
            State::Torn(mask) => mask >> ((b ^ k) % 64) & 1 == 1,
        }
    }
}

/// One in-flight write of stripe `s`, `lo..hi`, both records durable, crash state `data`
/// for the modified chunks and `p`, `q` for the parity; members `present`; recovery and
/// the checks. Returns the report.
#[allow(clippy::too_many_arguments)]
fn in_flight(
    layout: Layout,
    members: u16,
    s: u64,
    (lo, hi): (u64, u64),
    (data, p, q): (State, State, State),
    present: &[bool],
    corrupt_p_log: bool,
    seed: u64,
) -> RecoveryReport {
    let w = World::new(layout, members, seed);
    let old = AlignedBuf::from_slice(w.stripe_data(s));
    let new = written(&old, lo, hi, seed);
    let st = w.geo.stripe(s);
    let nd = w.nd();
    let [prec, qrec] = log_write(&w, s, lo, hi, &old);
    put_record(&w, st.p_member(), 1, 0, &prec);
    put_record(&w, st.q_member().unwrap(), 1, 0, &qrec);
    if corrupt_p_log && !prec.1.is_empty() {
        let at = AREA_OFFSET + PPL_HEADER_SIZE as u64;
        let d = &w.devs[usize::from(st.p_member())];
        let mut b = [0u8; 1];
        d.peek(at, &mut b);
        d.poke(at, &[b[0] ^ 0x40]);
    }
    w.put_mixed(
        s,
        &old,
        &new,
        |k, b| data.old(k, b),
        |k, b| {
            if k == nd {
                p.old(k, b)
            } else {
                q.old(k, b)
            }
        },
    );
    let snapshot = contents(&w);
    w.drop_members(present);
    let rep = w.recover(present);
    let ctx = format!(
        "{layout:?} {members} members, stripe {s} {lo}..{hi}, data {data:?} P {p:?} Q {q:?}, \
         present {present:?}, corrupt {corrupt_p_log}: {rep:?}"
    );
    let modified = match (data, p, q) {
        (State::Old, State::Old, State::Old) => Modified::Is(Uniform::Old),
        (State::New, State::New, State::New) => Modified::Is(Uniform::New),
        _ => Modified::Unknown,
    };
    if rep.rows_unrecoverable == 0 {
        check(
            &w,
            present,
            s,
            (lo, hi),
            &old,
            &new,
            modified,
            &snapshot,
            &ctx,
        );
    } else {
        // Other entries of the write may have been replayed; nothing else was written.
        check_writes(&w, present, s, &snapshot, &ctx);
    }
    assert_eq!(
        rep.logs as usize,
        present.iter().filter(|&&p| p).count(),
        "{ctx}"
    );
    assert_eq!(rep.entries_settled, 0, "{ctx}");
    if !corrupt_p_log {
        assert!(rep.clean(), "{ctx}");
        assert_eq!(rep.rows_unrecoverable, 0, "{ctx}");
    }
    rep
}

fn contents_unchanged(w: &World, present: &[bool], snapshot: &[Vec<u8>]) -> bool {
    w.devs
        .iter()
        .zip(snapshot)
        .zip(present)
        .all(|((d, before), &p)| !p || d.contents() == *before)
}

/// Write ranges (stripe-relative bytes) for a stripe of `nd` data chunks of [`CHUNK`]:
/// inside one chunk, across chunks (three entries), one whole chunk, the full stripe.
fn ranges(nd: u64) -> [(u64, u64); 5] {
    [
        (4096, 8192),
        (CHUNK + 1024, CHUNK + 3072),
        (CHUNK - 2048, 2 * CHUNK + 1024 + (nd - 3) * CHUNK),
        (2 * CHUNK, 3 * CHUNK),
        (0, nd * CHUNK),
    ]
}

#[test]
fn raid6_in_flight_write_recovers_for_every_crash_state_and_member_loss() {
    let states = [
        (State::Old, State::Old, State::Old),
        (State::New, State::New, State::New),
        (State::New, State::Old, State::Old),
        (State::New, State::New, State::Old),
        (State::New, State::Old, State::New),
        (State::Torn(0x5555_5555_5555_5555), State::New, State::Old),
        (
            State::Torn(0x0f0f_0f0f_0f0f_0f0f),
            State::Torn(0x3333),
            State::Torn(!0x3333),
        ),
        (State::Old, State::Torn(0xff00), State::New),
    ];
    let members = 6;
    let mut runs = 0;
    for layout in [Layout::LeftAsymmetric, Layout::LeftSymmetric] {
        for (i, &range) in ranges(4).iter().enumerate() {
            let s = (i as u64 * 3 + 1) % STRIPES;
            for &state in &states {
                for present in losses(members) {
                    let rep =
                        in_flight(layout, members, s, range, state, &present, false, i as u64);
                    assert!(rep.rows_repaired > 0 || present.iter().filter(|&&p| !p).count() > 0);
                    runs += 1;
                }
            }
        }
    }
    assert_eq!(runs, 2 * 5 * 8 * 22);
}

#[test]
fn raid6_joint_recovery_counts_pairs_and_skipped_rows() {
    // Data chunk 1 of stripe 2 modified (one entry, 4 KiB rows); drop it and data chunk 3.
    let w = World::new(Layout::LeftSymmetric, 6, 9);
    let st = w.geo.stripe(2);
    let mut present = vec![true; 6];
    present[usize::from(st.data_member(1))] = false;
    present[usize::from(st.data_member(3))] = false;
    drop(w);
    let rep = in_flight(
        Layout::LeftSymmetric,
        6,
        2,
        (CHUNK, CHUNK + 4096),
        (State::New, State::Torn(0xf0), State::Old),
        &present,
        false,
        9,
    );
    assert_eq!(rep.entries, 2);
    assert_eq!(rep.entries_paired, 2);
    assert_eq!(rep.rows_repaired, 1);
    assert_eq!(rep.rows_skipped, 1);
    assert_eq!(rep.stripes_skipped, 1);
    assert_eq!(rep.mismatches, 0);
}

#[test]
fn raid6_bad_partial_parity_checksum_is_a_mismatch_and_the_partner_partial_still_serves() {
    let pm = World::new(Layout::LeftAsymmetric, 6, 0)
        .geo
        .stripe(5)
        .p_member();
    for present in losses(6) {
        for (i, &range) in ranges(4).iter().take(3).enumerate() {
            let state = (State::Torn(0x1234_5678), State::New, State::Old);
            let rep = in_flight(
                Layout::LeftAsymmetric,
                6,
                5,
                range,
                state,
                &present,
                true,
                40 + i as u64,
            );
            if present[usize::from(pm)] {
                assert!(rep.mismatches >= 1, "{present:?}: {rep:?}");
                assert!(!rep.clean());
            }
        }
    }
}

/// The partner member is present but its log has no valid record (a mismatch): the entry
/// cannot be known settled, and is recovered from its own partial parity alone.
#[test]
fn raid6_partner_log_without_a_valid_record_is_recovered_from_this_log_alone() {
    let w = World::new(Layout::LeftSymmetric, 6, 21);
    let s = 4;
    let st = w.geo.stripe(s);
    let old = AlignedBuf::from_slice(w.stripe_data(s));
    let (lo, hi) = (CHUNK + 1024, 3 * CHUNK);
    let new = written(&old, lo, hi, 21);
    let [prec, _] = log_write(&w, s, lo, hi, &old);
    put_record(&w, st.p_member(), 1, 0, &prec);
    // The Q member's header at the area start fails its checksum.
    w.devs[usize::from(st.q_member().unwrap())].poke(AREA_OFFSET + 600, &[0xee]);
    let torn = State::Torn(0x77);
    w.put_mixed(s, &old, &new, |k, b| torn.old(k, b), |_, _| true);
    let snapshot = contents(&w);
    let mut present = vec![true; 6];
    // Unmodified data chunk 0: rebuilt from the partial P.
    present[usize::from(st.data_member(0))] = false;
    w.drop_members(&present);
    let rep = w.recover(&present);
    let ctx = format!("{rep:?}");
    assert_eq!(rep.mismatches, 1, "{ctx}");
    assert_eq!((rep.entries_settled, rep.entries_paired), (0, 0), "{ctx}");
    assert_eq!(rep.entries, 2, "{ctx}");
    check(
        &w,
        &present,
        s,
        (lo, hi),
        &old,
        &new,
        Modified::Unknown,
        &snapshot,
        &ctx,
    );
}

/// The spec's settled case: the lower-numbered parity member's log holds a later write W
/// that was never issued (its record in the higher member's log was not written), the
/// higher member's newest record an older, durable write W0 of the same stripe.
fn settled(
    layout: Layout,
    s: u64,
    w0: (u64, u64),
    wr: (u64, u64),
    present: &[bool],
    seed: u64,
) -> RecoveryReport {
    let mut w = World::new(layout, 6, seed);
    let st = w.geo.stripe(s);
    let (pm, qm) = (st.p_member(), st.q_member().unwrap());
    let (first, second) = (pm.min(qm), pm.max(qm));
    // W0: logged in both, durable on every member.
    let before0 = AlignedBuf::from_slice(w.stripe_data(s));
    let after0 = written(&before0, w0.0, w0.1, seed + 1);
    let [p0, q0] = log_write(&w, s, w0.0, w0.1, &before0);
    let rec0 = |m: u16| if m == pm { &p0 } else { &q0 };
    let end0 = put_record(&w, first, 1, 0, rec0(first));
    put_record(&w, second, 1, 0, rec0(second));
    w.put_stripe(s, &after0);
    let sd = w.geo.geometry().stripe_data_bytes() as usize;
    w.data[s as usize * sd..(s as usize + 1) * sd].copy_from_slice(&after0);
    // W: logged in the first log only; nothing issued.
    let [p1, q1] = log_write(&w, s, wr.0, wr.1, &after0);
    put_record(&w, first, 2, end0, if first == pm { &p1 } else { &q1 });
    let snapshot = contents(&w);
    w.drop_members(present);
    let rep = w.recover(present);
    let ctx =
        format!("settled {layout:?} stripe {s} W0 {w0:?} W {wr:?} present {present:?}: {rep:?}");
    // Nothing of W was written: the stripe is W0's everywhere.
    check(
        &w,
        present,
        s,
        wr,
        &after0,
        &after0,
        Modified::Is(Uniform::Old),
        &snapshot,
        &ctx,
    );
    assert!(rep.clean(), "{ctx}");
    rep
}

#[test]
fn raid6_settled_entries_are_left_alone() {
    let st = World::new(Layout::LeftAsymmetric, 6, 0).geo.stripe(3);
    for present in losses(6) {
        for (w0, wr) in [
            ((0, 4096), (CHUNK + 512, 2 * CHUNK + 1024)),
            ((3 * CHUNK, 4 * CHUNK), (0, 4 * CHUNK)),
            // The same range twice: the two logs' entries pair although they are two
            // writes; the unmodified chunks are the same for both, so is the result.
            ((CHUNK, CHUNK + 2048), (CHUNK, CHUNK + 2048)),
        ] {
            let rep = settled(Layout::LeftAsymmetric, 3, w0, wr, &present, 77);
            let both =
                present[usize::from(st.p_member())] && present[usize::from(st.q_member().unwrap())];
            if both && w0 != wr {
                assert!(rep.entries_settled > 0, "{present:?}: {rep:?}");
                assert_eq!(rep.rows_repaired, 0, "{present:?}: {rep:?}");
            }
        }
    }
}

/// A record of `entries` (with partial parity `pp`, checksums made to match) in
/// `member`'s log, on an otherwise clean consistent array; recovery must count a mismatch,
/// not panic and write nothing.
fn refused(entry: PplEntry, member: u16, present: &[bool]) -> RecoveryReport {
    let w = World::new(Layout::LeftSymmetric, 6, 5);
    let pp = vec![0x3cu8; entry.pp_size as usize];
    let e = PplEntry {
        checksum: pp_checksum(&pp),
        ..entry
    };
    put_record(&w, member, 1, 0, &(vec![e], pp));
    let snapshot = contents(&w);
    w.drop_members(present);
    let rep = w.recover(present);
    assert!(
        contents_unchanged(&w, present, &snapshot),
        "{entry:?}: {rep:?}"
    );
    assert!(!rep.clean(), "{entry:?}: {rep:?}");
    assert_eq!(rep.rows_repaired, 0, "{entry:?}: {rep:?}");
    rep
}

#[test]
fn raid6_refuses_entries_the_writer_never_produces() {
    let w = World::new(Layout::LeftSymmetric, 6, 5);
    let nd = 4u64;
    let s = 2;
    let st = w.geo.stripe(s);
    let pm = st.p_member();
    let sector = |k: u64, off: u64| ((s * nd + k) * CHUNK + off) / 512;
    let entry = |data_sector, pp_size, data_size, parity_disk: u16| PplEntry {
        data_sector,
        pp_size,
        data_size,
        parity_disk: u32::from(parity_disk),
        checksum: 0,
    };
    for present in [vec![true; 6], {
        let mut p = vec![true; 6];
        p[usize::from(st.data_member(0))] = false;
        p
    }] {
        // Crosses a stripe: two chunks from the last data chunk.
        refused(entry(sector(3, 4096), 4096, 8192, pm), pm, &present);
        // Rows past the end of the chunk.
        refused(entry(sector(1, 4096), 8192, 8192, pm), pm, &present);
        // More chunks than the stripe has.
        refused(entry(sector(0, 0), 512, 512 * 5, pm), pm, &present);
        // In the log of a data member of its stripe.
        let dm = st.data_member(1);
        if present[usize::from(dm)] {
            refused(entry(sector(1, 0), 4096, 4096, dm), dm, &present);
        }
        // parity_disk is not the log's member.
        refused(
            entry(sector(1, 0), 4096, 4096, st.q_member().unwrap()),
            pm,
            &present,
        );
        // Beyond the array.
        refused(
            entry(STRIPES * nd * CHUNK / 512, 4096, 4096, pm),
            pm,
            &present,
        );
        // Sizes that are no rectangle of rows.
        refused(entry(sector(1, 0), 4096, 6000, pm), pm, &present);
        refused(entry(sector(0, 0), 0, 4096 + 512, pm), pm, &present);
        refused(entry(sector(1, 0), 4000, 4000, pm), pm, &present);
        refused(
            entry(sector(0, 0), 2 * CHUNK as u32, 2 * CHUNK as u32, pm),
            pm,
            &present,
        );
    }
    // A bad pp checksum alone (no partner: the Q log is empty; a settled entry).
    let w = World::new(Layout::LeftSymmetric, 6, 5);
    let e = entry(sector(1, 0), 4096, 4096, pm);
    put_record(
        &w,
        pm,
        1,
        0,
        &(vec![PplEntry { checksum: 1, ..e }], vec![7; 4096]),
    );
    let rep = w.recover(&[true; 6]);
    assert_eq!(rep.mismatches, 1, "{rep:?}");
    assert_eq!(rep.entries_settled, 1, "{rep:?}");
}

#[test]
fn decode_entry_inverts_the_writers_entries() {
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, CHUNK, 512).unwrap();
    let geo = ArrayGeometry::new(g, STRIPES).unwrap();
    let nd = 4u64;
    let s = 5;
    for lo in (0..nd * CHUNK).step_by(512) {
        for hi in ((lo + 512)..=nd * CHUNK).step_by(1536) {
            for r in entries_for_range(lo, hi, CHUNK as u32) {
                let first = (s * nd + u64::from(r.first_chunk)) * CHUNK + u64::from(r.row_start);
                let e = PplEntry {
                    data_sector: first / 512,
                    pp_size: r.pp_bytes(nd as u16),
                    data_size: r.row_bytes * u32::from(r.chunks),
                    parity_disk: 0,
                    checksum: 0,
                };
                let d = decode_entry(&e, &geo).unwrap();
                assert_eq!(
                    (d.stripe, d.first_chunk, d.chunks, d.row_start, d.row_bytes),
                    (s, r.first_chunk, r.chunks, r.row_start, r.row_bytes),
                    "{lo}..{hi}"
                );
                let aligned = r.row_start % 4096 == 0 && r.row_bytes % 4096 == 0;
                assert_eq!(d.block_bytes, if aligned { 4096 } else { 512 });
            }
        }
    }
}

#[test]
fn raid5_recovery_reports_no_raid6_counters() {
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, CHUNK, 512).unwrap();
    let geo = ArrayGeometry::new(g, STRIPES).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..4)
        .map(|i| {
            SimDevice::new(
                &format!("d{i}"),
                DATA_OFFSET + STRIPES * CHUNK,
                512,
                Profile::nvme_ssd(),
                clock.clone(),
                i,
            )
            .unwrap()
        })
        .collect();
    let present = [true; 4];
    reinit_areas(&ppl_layout(), &UUID, &present, &mut SimMedia(&devs)).unwrap();
    let rep = recover(&geo, &ppl_layout(), &UUID, &present, &mut SimMedia(&devs)).unwrap();
    assert_eq!(
        rep,
        RecoveryReport {
            logs: 4,
            ..RecoveryReport::default()
        }
    );
}

fn layouts() -> impl Strategy<Value = Layout> {
    prop_oneof![
        Just(Layout::LeftAsymmetric),
        Just(Layout::RightAsymmetric),
        Just(Layout::LeftSymmetric),
        Just(Layout::RightSymmetric),
        Just(Layout::ParityFirst),
        Just(Layout::ParityLast),
    ]
}

fn states() -> impl Strategy<Value = State> {
    prop_oneof![
        Just(State::Old),
        Just(State::New),
        any::<u64>().prop_map(State::Torn)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn raid6_recovery_of_random_writes_crashes_and_losses(
        layout in layouts(),
        members in 4u16..=7,
        s in 0..STRIPES,
        a in 0u64..64,
        b in 0u64..64,
        state in (states(), states(), states()),
        lose in (0usize..8, 0usize..8),
        seed in any::<u64>(),
    ) {
        let nd = u64::from(members - 2);
        let blocks = nd * CHUNK / 512;
        let (x, y) = (a * blocks / 64, b * blocks / 64);
        let (lo, hi) = (x.min(y) * 512, (x.max(y) + 1) * 512);
        let mut present = vec![true; usize::from(members)];
        for m in [lose.0, lose.1] {
            if m < present.len() {
                present[m] = false;
            }
        }
        in_flight(layout, members, s, (lo, hi), state, &present, false, seed);
    }

    #[test]
    fn raid6_random_records_on_a_consistent_array_change_nothing(
        entries in proptest::collection::vec(
            (
                0u64..(STRIPES * 4 * CHUNK / 512 + 8),
                0u32..3 * CHUNK as u32,
                0u32..5 * CHUNK as u32,
                0u32..7,
            ),
            1..6,
        ),
        member in 0u16..6,
        other in 0u16..6,
        pp_seed in any::<u64>(),
    ) {
        let w = World::new(Layout::LeftAsymmetric, 6, 3);
        let mut next = rng(pp_seed);
        let mut rec = (Vec::new(), Vec::new());
        for (data_sector, pp_size, data_size, parity_disk) in entries {
            let pp_size = if next() & 1 == 0 { pp_size & !511 } else { pp_size };
            let parity_disk = if next() & 1 == 0 { u32::from(member) } else { parity_disk };
            let pp: Vec<u8> = (0..pp_size).map(|_| next() as u8).collect();
            let checksum = pp_checksum(&pp);
            rec.0.push(PplEntry { data_sector, pp_size, data_size, parity_disk, checksum });
            rec.1.extend_from_slice(&pp[..(pp_size as usize & !511)]);
        }
        if (PPL_HEADER_SIZE + rec.1.len()) as u64 <= AREA_BYTES - PPL_HEADER_SIZE as u64 {
            put_record(&w, member, 1, 0, &rec);
            // The same entries in another log, as a partner would be.
            let moved =
                rec.0.iter().map(|e| PplEntry { parity_disk: u32::from(other), ..*e }).collect();
            put_record(&w, other, 1, 0, &(moved, rec.1.clone()));
        }
        let snapshot = contents(&w);
        let present = vec![true; 6];
        let _ = w.recover(&present);
        prop_assert!(contents_unchanged(&w, &present, &snapshot));
    }
}
