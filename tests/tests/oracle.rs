//! The engine's layout and parity held against the independent oracle
//! `../shared/oracle/raidref.py` (see `shared/DESIGN.md`, "Correctness references").
//!
//! Both directions:
//! - [`engine_images_pass_oracle_verify`]: member images laid out and given P/Q by the
//!   engine must pass the oracle's `verify`, its `extract` must return the logical data,
//!   and the engine's `map_range` must agree with the oracle's `map`.
//! - [`oracle_images_map_and_recover`]: member images the oracle `build`s must read back
//!   through the engine's `map_range`, and every stripe must be rebuilt by
//!   `Parity::reconstruct` with any one (RAID5) or any two (RAID6) members missing.
//! - [`oracle_verify_detects_corrupted_parity`]: the negative control; the oracle must
//!   reject a single flipped parity byte, proving the first test can fail.
//!
//! Every case derives its data from a fixed seed printed in its description, so a failure
//! replays exactly. All files live in a fresh temporary directory per case.

use std::fmt;
use std::fs;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread;

use engine::buf::AlignedBuf;
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level, Role};
use engine::parity::{ChunkId, Kernel, Parity};
use ferroraid_tests::{first_difference, seed_of, Oracle, Rng};

/// Logical block size of every test array (md's sector).
const BLOCK: u32 = 512;

/// One array configuration under test.
#[derive(Clone, Copy, Debug)]
struct Case {
    level: Level,
    layout: Layout,
    members: u16,
    chunk: u32,
    data_offset: u64,
    stripes: u64,
    seed: u64,
}

impl Case {
    /// A case whose seed is a fixed function of its parameters and of `test` (so the
    /// three tests do not share data).
    fn new(
        test: u64,
        level: Level,
        layout: Layout,
        members: u16,
        chunk: u32,
        data_offset: u64,
    ) -> Self {
        // At least 2n+1 stripes: every rotation of P/Q appears at least twice, and the
        // count is not a multiple of the rotation period.
        let stripes = 2 * u64::from(members) + 1;
        let seed = seed_of(&[
            test,
            u64::from(level.md_level()),
            u64::from(layout.md_id()),
            u64::from(members),
            u64::from(chunk),
            data_offset,
            stripes,
        ]);
        Self {
            level,
            layout,
            members,
            chunk,
            data_offset,
            stripes,
            seed,
        }
    }

    fn geometry(&self) -> Geometry {
        Geometry::new(
            self.level,
            self.layout,
            self.members,
            u64::from(self.chunk),
            BLOCK,
        )
        .unwrap_or_else(|e| panic!("{self}: Geometry::new refused: {e}"))
    }

    fn array(&self) -> ArrayGeometry {
        ArrayGeometry::new(self.geometry(), self.stripes)
            .unwrap_or_else(|e| panic!("{self}: ArrayGeometry::new refused: {e}"))
    }

    fn n(&self) -> usize {
        usize::from(self.members)
    }

    fn data_chunks(&self) -> usize {
        self.n() - usize::from(self.level.parity_chunks())
    }

    fn chunk_len(&self) -> usize {
        self.chunk as usize
    }

    /// Logical capacity in bytes.
    fn capacity(&self) -> usize {
        self.stripes as usize * self.data_chunks() * self.chunk_len()
    }

    /// Bytes of one member image: the data offset plus the data area.
    fn member_bytes(&self) -> usize {
        self.data_offset as usize + self.stripes as usize * self.chunk_len()
    }

    /// Byte of a member image where stripe `s` starts.
    fn stripe_at(&self, s: u64) -> usize {
        self.data_offset as usize + s as usize * self.chunk_len()
    }

    /// The oracle's geometry options.
    fn oracle_opts(&self) -> Vec<String> {
        vec![
            "--level".into(),
            self.level.md_level().to_string(),
            "--layout".into(),
            self.layout.name().into(),
            "--chunk".into(),
            self.chunk.to_string(),
            "--data-offset".into(),
            self.data_offset.to_string(),
        ]
    }

    /// Oracle arguments for `command` over the member images `paths`. The members come
    /// right after the command: raidref.py's argparse takes them as a positional there.
    fn oracle_args(&self, command: &str, paths: &[PathBuf], extra: &[&str]) -> Vec<String> {
        let mut args = vec![command.to_string()];
        args.extend(paths.iter().map(|p| p.display().to_string()));
        args.extend(self.oracle_opts());
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{} {}, {} members, chunk {}, data offset {}, {} stripes, seed {:#018x}]",
            self.level,
            self.layout,
            self.members,
            self.chunk,
            self.data_offset,
            self.stripes,
            self.seed
        )
    }
}

/// The oracle, or `None` after saying on stderr that `test` skips (every test here needs it).
fn oracle(test: &str) -> Option<Oracle> {
    Oracle::locate_or_skip(test)
}

/// Runs `check` on every case, on as many threads as there are CPUs (the oracle runs are
/// short-lived processes, mostly interpreter start-up), collecting failures so one run
/// names every failing configuration, then fails with all of them in case order.
fn run_cases(cases: &[Case], check: impl Fn(&Case) + Sync) {
    let next = AtomicUsize::new(0);
    let failed = Mutex::new(Vec::new());
    let workers = thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(cases.len());
    thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(case) = cases.get(i) else { break };
                if let Err(e) = panic::catch_unwind(AssertUnwindSafe(|| check(case))) {
                    let msg = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| format!("{case}: panicked"));
                    failed
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((i, msg));
                }
            });
        }
    });
    let mut failed = failed.into_inner().unwrap_or_else(|p| p.into_inner());
    failed.sort();
    let messages: Vec<String> = failed.into_iter().map(|(_, m)| m).collect();
    assert!(
        messages.is_empty(),
        "{} of {} cases failed:\n\n{}",
        messages.len(),
        cases.len(),
        messages.join("\n\n")
    );
}

fn tempdir(case: &Case) -> tempfile::TempDir {
    tempfile::tempdir()
        .unwrap_or_else(|e| panic!("{case}: cannot create a temporary directory: {e}"))
}

/// Writes member images as `dir/<tag>-<member>.img` and returns their paths.
fn write_images(case: &Case, dir: &Path, tag: &str, images: &[Vec<u8>]) -> Vec<PathBuf> {
    images
        .iter()
        .enumerate()
        .map(|(m, img)| {
            let path = dir.join(format!("{tag}-{m}.img"));
            fs::write(&path, img)
                .unwrap_or_else(|e| panic!("{case}: writing {}: {e}", path.display()));
            path
        })
        .collect()
}

/// Member images holding `logical` where the engine's `map_range` puts it, parity areas
/// zero, and random bytes before the data offset (so an offset mix-up cannot pass).
fn place_data(case: &Case, array: &ArrayGeometry, logical: &[u8], rng: &mut Rng) -> Vec<Vec<u8>> {
    let mut images: Vec<Vec<u8>> = (0..case.n())
        .map(|_| {
            let mut img = vec![0u8; case.member_bytes()];
            rng.fill(&mut img[..case.data_offset as usize]);
            img
        })
        .collect();
    let extents = array
        .map_range(0, logical.len() as u64)
        .unwrap_or_else(|e| panic!("{case}: map_range over the whole array: {e}"));
    let mut next = 0u64;
    for e in extents {
        assert_eq!(
            e.logical_offset, next,
            "{case}: extents must tile the range in order"
        );
        assert_eq!(
            (e.chunk_offset, e.len),
            (0, case.chunk),
            "{case}: whole-array extents are whole chunks"
        );
        assert_eq!(
            e.member,
            case.geometry().stripe(e.stripe).data_member(e.data_index),
            "{case}: extent member disagrees with StripeLayout::data_member"
        );
        let at = case.data_offset as usize + e.member_offset as usize;
        let lo = e.logical_offset as usize;
        images[usize::from(e.member)][at..at + case.chunk_len()]
            .copy_from_slice(&logical[lo..lo + case.chunk_len()]);
        next += u64::from(e.len);
    }
    assert_eq!(
        next,
        logical.len() as u64,
        "{case}: extents must cover the whole array"
    );
    images
}

/// Computes P (and Q) of every stripe of `images` with `parity`, data in Q slot order, and
/// writes them to their members.
fn add_parity(case: &Case, images: &mut [Vec<u8>], parity: &Parity) {
    let g = case.geometry();
    let len = case.chunk_len();
    let nd = case.data_chunks();
    let mut data: Vec<AlignedBuf> = (0..nd).map(|_| AlignedBuf::zeroed(len)).collect();
    let mut p = AlignedBuf::zeroed(len);
    let mut q = AlignedBuf::zeroed(len);
    for s in 0..case.stripes {
        let sl = g.stripe(s);
        let at = case.stripe_at(s);
        for k in 0..sl.data_chunks() {
            let m = sl.data_member(k);
            let slot = sl.q_slot(k);
            assert_eq!(
                sl.role(m),
                Role::Data { index: k, slot },
                "{case}: stripe {s}: role of member {m}"
            );
            data[usize::from(slot)].copy_from_slice(&images[usize::from(m)][at..at + len]);
        }
        let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
        let pm = usize::from(sl.p_member());
        match sl.q_member() {
            None => {
                parity.gen_p(&refs, &mut p);
                images[pm][at..at + len].copy_from_slice(&p);
            }
            Some(qm) => {
                parity.gen_pq(&refs, &mut p, &mut q);
                images[pm][at..at + len].copy_from_slice(&p);
                images[usize::from(qm)][at..at + len].copy_from_slice(&q);
            }
        }
    }
}

/// Checks the engine's `map_range` against the oracle's `map` for a few sectors: the last
/// one of the array and some at random.
fn check_map(oracle: &Oracle, case: &Case, array: &ArrayGeometry, rng: &mut Rng) {
    let sectors_total = case.capacity() as u64 / 512;
    let sectors = [
        sectors_total - 1,
        rng.below(sectors_total),
        rng.below(sectors_total),
    ];
    for sector in sectors {
        let e = array
            .map_range(sector * 512, 512)
            .unwrap_or_else(|err| panic!("{case}: map_range of sector {sector}: {err}"))
            .next()
            .unwrap_or_else(|| panic!("{case}: map_range of sector {sector} gave no extent"));
        let mut args = vec![
            "map".to_string(),
            "--sector".into(),
            sector.to_string(),
            "--raid-disks".into(),
            case.members.to_string(),
        ];
        args.extend(case.oracle_opts());
        let out = oracle
            .run_ok(&args)
            .unwrap_or_else(|err| panic!("{case}: {err}"));
        let parsed: Vec<u64> = out
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        let [member, offset] = parsed[..] else {
            panic!("{case}: oracle map printed {out:?}, expected \"member offset_bytes\"");
        };
        assert_eq!(
            (u64::from(e.member), e.member_offset),
            (member, offset),
            "{case}: sector {sector}: engine maps it to (member, data-area offset) = ({}, {}), \
             the oracle to ({member}, {offset})",
            e.member,
            e.member_offset
        );
    }
}

/// Cases of [`engine_images_pass_oracle_verify`]: both levels, all six layouts, three
/// member counts each, chunks of 4 KiB and 64 KiB (data offset 0 or 8 KiB, alternating),
/// plus one 16 KiB-chunk case per level at a data offset that is not a chunk multiple.
fn verify_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (level, counts) in [(Level::Raid5, [3u16, 4, 7]), (Level::Raid6, [4, 5, 8])] {
        for layout in Layout::ALL {
            for (i, &n) in counts.iter().enumerate() {
                for (j, chunk) in [4096u32, 65536].into_iter().enumerate() {
                    let data_offset = if (i + j + layout.md_id() as usize) % 2 == 1 {
                        8192
                    } else {
                        0
                    };
                    cases.push(Case::new(1, level, layout, n, chunk, data_offset));
                }
            }
        }
    }
    cases.push(Case::new(
        1,
        Level::Raid5,
        Layout::RightAsymmetric,
        5,
        16384,
        12288,
    ));
    cases.push(Case::new(
        1,
        Level::Raid6,
        Layout::LeftAsymmetric,
        6,
        16384,
        12288,
    ));
    cases
}

/// Engine-written member images (every parity kernel this CPU has must write the same
/// bytes) pass the oracle's `verify`; its `extract` returns the logical data; the
/// engine's `map_range` agrees with its `map`.
#[test]
fn engine_images_pass_oracle_verify() {
    let Some(oracle) = oracle("engine_images_pass_oracle_verify") else {
        return;
    };
    run_cases(&verify_cases(), |case| {
        let dir = tempdir(case);
        let array = case.array();
        let mut rng = Rng::new(case.seed);
        let logical = rng.bytes(case.capacity());
        let base = place_data(case, &array, &logical, &mut rng);

        let best = Parity::new();
        let mut images = base.clone();
        add_parity(case, &mut images, &best);
        for kernel in Kernel::available() {
            let parity = Parity::with_kernel(kernel).unwrap_or_else(|e| panic!("{case}: {e}"));
            let mut other = base.clone();
            add_parity(case, &mut other, &parity);
            if let Some(m) = (0..case.n()).find(|&m| other[m] != images[m]) {
                // Let the oracle say which of the two is wrong.
                let paths = write_images(case, dir.path(), kernel.name(), &other);
                let verdict = oracle
                    .run(case.oracle_args("verify", &paths, &[]))
                    .map(|o| format!("exit {}: {}{}", o.code(), o.stdout.trim(), o.stderr.trim()))
                    .unwrap_or_else(|e| e.to_string());
                panic!(
                    "{case}: parity kernel {kernel} writes different bytes from {} on member {m}: {}; \
                     oracle verify of the {kernel} images: {verdict}",
                    best.kernel(),
                    first_difference(&other[m], &images[m]).unwrap_or_default()
                );
            }
        }

        let paths = write_images(case, dir.path(), "engine", &images);
        let out = oracle
            .run_ok(case.oracle_args("verify", &paths, &[]))
            .unwrap_or_else(|e| {
                panic!("{case}: the oracle rejects the engine's member images: {e}")
            });
        let expect = format!("stripes {} mismatches 0", case.stripes);
        assert!(
            out.contains(&expect),
            "{case}: oracle verify printed {out:?}, expected {expect:?}"
        );

        let logical_out = dir.path().join("logical.out");
        let out_arg = logical_out.display().to_string();
        oracle
            .run_ok(case.oracle_args("extract", &paths, &["--out", &out_arg]))
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        let extracted =
            fs::read(&logical_out).unwrap_or_else(|e| panic!("{case}: reading {out_arg}: {e}"));
        if let Some(d) = first_difference(&extracted, &logical) {
            panic!("{case}: oracle extract of the engine's images differs from the logical data written: {d}");
        }

        check_map(&oracle, case, &array, &mut rng);
    });
}

/// Negative control: one flipped byte in one parity chunk (P of RAID5; P, then Q, of
/// RAID6) of engine-written images makes the oracle's `verify` exit 1 naming the stripe.
#[test]
fn oracle_verify_detects_corrupted_parity() {
    let Some(oracle) = oracle("oracle_verify_detects_corrupted_parity") else {
        return;
    };
    let cases = [
        (
            Case::new(2, Level::Raid5, Layout::LeftSymmetric, 4, 4096, 8192),
            Role::P,
        ),
        (
            Case::new(2, Level::Raid6, Layout::RightAsymmetric, 5, 4096, 0),
            Role::P,
        ),
        (
            Case::new(2, Level::Raid6, Layout::LeftAsymmetric, 5, 4096, 8192),
            Role::Q,
        ),
    ];
    for (case, role) in cases {
        let case = &case;
        let dir = tempdir(case);
        let array = case.array();
        let mut rng = Rng::new(case.seed);
        let logical = rng.bytes(case.capacity());
        let mut images = place_data(case, &array, &logical, &mut rng);
        add_parity(case, &mut images, &Parity::new());
        let paths = write_images(case, dir.path(), "good", &images);
        oracle
            .run_ok(case.oracle_args("verify", &paths, &[]))
            .unwrap_or_else(|e| panic!("{case}: the uncorrupted images must pass first: {e}"));

        let stripe = 3;
        let sl = case.geometry().stripe(stripe);
        let member = match role {
            Role::Q => sl.q_member().expect("RAID6 has Q"),
            _ => sl.p_member(),
        };
        let byte = case.stripe_at(stripe) + rng.below(u64::from(case.chunk)) as usize;
        images[usize::from(member)][byte] ^= 0xff;
        let paths = write_images(case, dir.path(), "bad", &images);
        let out = oracle
            .run(case.oracle_args("verify", &paths, &[]))
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(
            out.code(),
            1,
            "{case}: flipped byte {byte} of member {member} ({role:?} of stripe {stripe}); oracle verify \
             must exit 1: {}",
            out.clone().into_error()
        );
        assert!(
            out.stderr
                .contains(&format!("mismatch in stripe {stripe}\n"))
                && out.stdout.contains("mismatches 1"),
            "{case}: oracle verify must name stripe {stripe} alone: {}",
            out.clone().into_error()
        );
    }
}

/// Cases of [`oracle_images_map_and_recover`]: both levels, all six layouts, two member
/// counts each, 4 KiB chunks (one 16 KiB per level), data offset 0 or 4 KiB.
fn recover_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (level, counts) in [(Level::Raid5, [3u16, 5]), (Level::Raid6, [4, 7])] {
        for layout in Layout::ALL {
            for (i, &n) in counts.iter().enumerate() {
                let data_offset = if (i + layout.md_id() as usize) % 2 == 1 {
                    4096
                } else {
                    0
                };
                let chunk = if layout == Layout::LeftSymmetric && i == 1 {
                    16384
                } else {
                    4096
                };
                cases.push(Case::new(3, level, layout, n, chunk, data_offset));
            }
        }
    }
    cases
}

/// The logical range `offset..offset + len` read through the engine's `map_range`.
fn read_logical(
    case: &Case,
    array: &ArrayGeometry,
    images: &[Vec<u8>],
    offset: u64,
    len: u64,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(len as usize);
    let extents = array
        .map_range(offset, len)
        .unwrap_or_else(|e| panic!("{case}: map_range({offset}, {len}): {e}"));
    for e in extents {
        assert_eq!(
            e.logical_offset,
            offset + out.len() as u64,
            "{case}: extents out of order"
        );
        let at = case.data_offset as usize + e.member_offset as usize;
        out.extend_from_slice(&images[usize::from(e.member)][at..at + e.len as usize]);
    }
    assert_eq!(
        out.len() as u64,
        len,
        "{case}: map_range({offset}, {len}) covers {} bytes",
        out.len()
    );
    out
}

/// Rebuilds every stripe with the members in `lost` unreadable (their buffers hold
/// garbage), using `Parity::reconstruct`, and checks the data against `logical` and any
/// rebuilt P/Q against the oracle's.
fn check_degraded(
    case: &Case,
    images: &[Vec<u8>],
    logical: &[u8],
    lost: &[u16],
    parity: &Parity,
    rng: &mut Rng,
) {
    let g = case.geometry();
    let len = case.chunk_len();
    let nd = case.data_chunks();
    let kernel = parity.kernel();
    let mut data: Vec<AlignedBuf> = (0..nd).map(|_| AlignedBuf::zeroed(len)).collect();
    let mut p = AlignedBuf::zeroed(len);
    let mut q = AlignedBuf::zeroed(len);
    for s in 0..case.stripes {
        let sl = g.stripe(s);
        let at = case.stripe_at(s);
        let chunk_of = |m: u16| &images[usize::from(m)][at..at + len];
        let mut load = |m: u16, buf: &mut [u8]| {
            if lost.contains(&m) {
                rng.fill(buf);
            } else {
                buf.copy_from_slice(chunk_of(m));
            }
        };
        for k in 0..sl.data_chunks() {
            load(sl.data_member(k), &mut data[usize::from(sl.q_slot(k))]);
        }
        load(sl.p_member(), &mut p);
        if let Some(qm) = sl.q_member() {
            load(qm, &mut q);
        }
        let ids: Vec<ChunkId> = lost
            .iter()
            .map(|&m| match sl.role(m) {
                Role::Data { slot, .. } => {
                    ChunkId::Data(u8::try_from(slot).expect("slot below 255"))
                }
                Role::P => ChunkId::P,
                Role::Q => ChunkId::Q,
            })
            .collect();
        {
            let mut refs: Vec<&mut [u8]> = data.iter_mut().map(|b| &mut b[..]).collect();
            let q_ref = sl.q_member().map(|_| &mut q[..]);
            parity
                .reconstruct(&mut refs, &mut p, q_ref, &ids)
                .unwrap_or_else(|e| {
                    panic!("{case}: kernel {kernel}, members {lost:?} lost, stripe {s}: {e}")
                });
        }
        for k in 0..sl.data_chunks() {
            let slot = sl.q_slot(k);
            let c = s as usize * nd + usize::from(k);
            if let Some(d) =
                first_difference(&data[usize::from(slot)], &logical[c * len..(c + 1) * len])
            {
                panic!(
                    "{case}: kernel {kernel}, members {lost:?} lost ({ids:?}), stripe {s}: data index {k} \
                     (member {}, slot {slot}) differs from the logical data: {d}",
                    sl.data_member(k)
                );
            }
        }
        let parity_chunks = [(Some(sl.p_member()), &p, "P"), (sl.q_member(), &q, "Q")];
        for (member, buf, name) in parity_chunks {
            let Some(m) = member.filter(|m| lost.contains(m)) else {
                continue;
            };
            if let Some(d) = first_difference(buf, chunk_of(m)) {
                panic!(
                    "{case}: kernel {kernel}, members {lost:?} lost ({ids:?}), stripe {s}: rebuilt {name} \
                     (member {m}) differs from the oracle's: {d}"
                );
            }
        }
    }
}

/// Member images built by the oracle read back through the engine's `map_range`, and the
/// engine rebuilds every stripe from them with any one (RAID5) or two (RAID6) members
/// missing, with every parity kernel this CPU has.
#[test]
fn oracle_images_map_and_recover() {
    let Some(oracle) = oracle("oracle_images_map_and_recover") else {
        return;
    };
    let kernels: Vec<Kernel> = Kernel::available().collect();
    run_cases(&recover_cases(), |case| {
        let dir = tempdir(case);
        let mut rng = Rng::new(case.seed);
        let logical = rng.bytes(case.capacity());
        let input = dir.path().join("logical.in");
        fs::write(&input, &logical)
            .unwrap_or_else(|e| panic!("{case}: writing {}: {e}", input.display()));

        // Zero-filled members; member 0 is half a chunk longer, which md (and so both
        // sides) must leave unused.
        let sizes: Vec<u64> = (0..case.n())
            .map(|m| (case.member_bytes() + if m == 0 { case.chunk_len() / 2 } else { 0 }) as u64)
            .collect();
        let paths: Vec<PathBuf> = (0..case.n())
            .map(|m| dir.path().join(format!("oracle-{m}.img")))
            .collect();
        for (path, &size) in paths.iter().zip(&sizes) {
            let f = fs::File::create(path)
                .unwrap_or_else(|e| panic!("{case}: creating {}: {e}", path.display()));
            f.set_len(size)
                .unwrap_or_else(|e| panic!("{case}: sizing {}: {e}", path.display()));
        }
        let in_arg = input.display().to_string();
        oracle
            .run_ok(case.oracle_args("build", &paths, &["--in", &in_arg]))
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        let images: Vec<Vec<u8>> = paths
            .iter()
            .map(|p| fs::read(p).unwrap_or_else(|e| panic!("{case}: reading {}: {e}", p.display())))
            .collect();

        let array = case
            .geometry()
            .with_members(&sizes, case.data_offset)
            .unwrap_or_else(|e| panic!("{case}: with_members({sizes:?}): {e}"));
        assert_eq!(
            array.stripes(),
            case.stripes,
            "{case}: stripes derived from the member sizes"
        );
        assert_eq!(
            array.capacity_bytes(),
            case.capacity() as u64,
            "{case}: capacity"
        );

        // The whole array, then block-aligned ranges at random (crossing chunks and stripes).
        let cap = case.capacity() as u64;
        let mut ranges = vec![(0, cap)];
        for _ in 0..32 {
            let off = rng.below(cap / 512) * 512;
            let len = rng.below((cap - off).min(3 * u64::from(case.chunk)) / 512 + 1) * 512;
            ranges.push((off, len));
        }
        for (off, len) in ranges {
            let got = read_logical(case, &array, &images, off, len);
            if let Some(d) = first_difference(&got, &logical[off as usize..(off + len) as usize]) {
                panic!("{case}: reading logical {off}+{len} through map_range from the oracle's images: {d}");
            }
        }

        let members = case.members;
        let mut lost_sets: Vec<Vec<u16>> = (0..members).map(|m| vec![m]).collect();
        if case.level == Level::Raid6 {
            for a in 0..members {
                for b in a + 1..members {
                    lost_sets.push(vec![a, b]);
                }
            }
        }
        for lost in &lost_sets {
            for &kernel in &kernels {
                let parity = Parity::with_kernel(kernel).unwrap_or_else(|e| panic!("{case}: {e}"));
                check_degraded(case, &images, &logical, lost, &parity, &mut rng);
            }
        }
    });
}
