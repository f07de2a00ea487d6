//! ferroraid's layout against member images written by Linux md itself.
//!
//! `tests/qemu/md-fixtures.sh` boots a Debian kernel under QEMU (the rig, `tests/qemu/rig.sh`;
//! see `docs/TESTING.md`) where the real mdadm and md driver create a RAID6 (left-symmetric),
//! a RAID5 (left-asymmetric) and a degraded RAID6 (right-asymmetric, one member failed and
//! removed, the first 4 MiB rewritten without it) on sparse files, resync them, and write a
//! seeded pattern over each whole array; a fourth RAID6 (mdfix6b) has an internal
//! write-intent bitmap and loses member 1 before its first 2 MiB are rewritten. This test
//! then holds those images against:
//!
//! - the superblocks themselves, decoded here from the raw bytes (magic, checksum, level,
//!   layout, chunk, data offset/size, events, slots; the removed member without a role in
//!   the survivors' `dev_roles` and behind them in events) and read by the host's
//!   `mdadm --examine`;
//! - the oracle `../shared/oracle/raidref.py`: `verify` accepts md's parity (and, on the
//!   degraded array with the stale member put back, rejects exactly the rewritten stripes),
//!   `extract` returns the pattern;
//! - the engine's `engine::geometry`: `Geometry::new` + `with_members` give md's array size,
//!   and `map_range` reading member bytes directly reproduces the pattern over the whole
//!   array and for thousands of random ranges: ferroraid's layout is Linux md's.
//!
//! - for mdfix6b, ferroraid's reading of md's bitmap: every field, the bits md left dirty for
//!   the writes the removed member missed (the same counts as md's own
//!   `mdadm --examine-bitmap` in the guest), and assembly's verdict that the removed member
//!   can be re-added with a bitmap-based recovery (its events ≥ `events_cleared`).
//!
//! The fixtures are cached in `target/tmp/md-fixtures` (the script knows when they are
//! current, keyed on its own sources). Without `qemu-system-x86_64` (or a kernel from apt)
//! and without current fixtures, the test says why and passes, unless
//! `FERRORAID_REQUIRE_QEMU=1` (CI) makes that a failure.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use ferroraid_tests::{
    ensure_md_fixtures, first_difference, seed_of, show_output as show, tool_runs, Oracle, Rng,
};

/// The arrays `md-fixtures.sh` makes.
const ARRAYS: [&str; 4] = ["mdfix6", "mdfix5", "mdfix6d", "mdfix6b"];
/// Random ranges read through `map_range` per array.
const RANDOM_READS: usize = 4000;
/// md v1 superblock magic.
const MD_SB_MAGIC: u32 = 0xa92b_4efc;
/// `dev_roles` value of an index no device of the array holds (md's `MD_DISK_ROLE_SPARE`).
/// A member that was failed *and removed* gets this, not `MD_DISK_ROLE_FAULTY` (0xfffe):
/// md's `super_1_sync` starts every role at 0xffff and marks only the devices still
/// attached; 0xfffe would appear only while the failed device is still in the array.
const MD_DISK_ROLE_NONE: u16 = 0xffff;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("md-fixtures")
}

fn required() -> bool {
    ferroraid_tests::required("FERRORAID_REQUIRE_QEMU")
}

#[test]
fn md_written_members_match_ferroraid_layout() {
    let dir = fixtures_dir();
    if !ensure_md_fixtures(&dir, "md_fixtures") {
        return;
    }
    let oracle = Oracle::locate_or_skip("md_written_members_match_ferroraid_layout");
    let mdadm = tool_runs("mdadm", "--version");
    if !mdadm {
        assert!(
            !required(),
            "FERRORAID_REQUIRE_QEMU=1 but mdadm is not installed on the host"
        );
        eprintln!(
            "md_fixtures: no mdadm on the host: `mdadm --examine` of the members is not checked"
        );
    }
    for name in ARRAYS {
        let fx = Fixture::load(&dir.join(name));
        let start = Instant::now();
        fx.check_superblocks();
        if mdadm {
            fx.check_mdadm_examine();
        }
        if let Some(oracle) = &oracle {
            fx.check_oracle(oracle);
        }
        fx.check_engine_map();
        eprintln!(
            "md_fixtures: {name}: RAID{} {} {} members, chunk {}, data offset {}, data size {}, \
             array {} bytes, events {}: checked in {:.1} s",
            fx.level_md,
            fx.layout.name(),
            fx.members.len(),
            fx.chunk,
            fx.data_offset,
            fx.data_size,
            fx.array_size,
            fx.events,
            start.elapsed().as_secs_f64()
        );
    }
}

/// md's internal bitmap as ferroraid reads it (mdfix6b), and md's re-add rule.
#[test]
fn md_internal_bitmap_is_read_and_the_removed_member_is_re_addable() {
    use drivers::metadata_io::{read_bitmap, read_candidate};
    use engine::metadata::{assemble, AssembleOptions, Recovery};
    let dir = fixtures_dir();
    if !ensure_md_fixtures(&dir, "md_fixtures bitmap") {
        return;
    }
    let fx = Fixture::load(&dir.join("mdfix6b"));
    let gone = fx.removed().expect("mdfix6b has a removed member").slot;
    let cands: Vec<_> = fx
        .members
        .iter()
        .map(|m| read_candidate(&m.image).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    for c in &cands {
        let b = c.bitmap.as_ref().expect("md's members announce the bitmap");
        let b = b.as_ref().unwrap_or_else(|e| panic!("{}: {e}", c.device));
        assert_eq!(
            (b.version, b.chunksize, b.daemon_sleep),
            (4, 64 << 10, 5),
            "{}",
            c.device
        );
        assert_eq!(b.sync_size * 512, fx.data_size, "{}", c.device);
    }
    let a = assemble(&cands, AssembleOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let ab = a.bitmap.as_ref().expect("the array's bitmap");
    assert!(!ab.stale, "md keeps its bitmap current: {:?}", ab.super_);
    assert_eq!(ab.super_.events, fx.events);
    assert!(ab.super_.events_cleared <= fx.members[usize::from(gone)].events);
    assert_eq!(a.re_add.len(), 1, "{:?}", a.re_add);
    assert_eq!(a.re_add[0].role, gone);
    assert_eq!(a.re_add[0].recovery, Recovery::Bitmap, "{}", a.re_add[0]);

    // The bits: what md left dirty covers every stripe rewritten without the member.
    let survivor = fx.members.iter().find(|m| m.active).unwrap();
    let sb = cands[usize::from(survivor.slot)]
        .superblock
        .clone()
        .unwrap();
    let bm = read_bitmap(&survivor.image, &sb).unwrap_or_else(|e| panic!("{e}"));
    let stripe_data = fx.chunk * u64::from(fx.n() - 2);
    let last_stripe = (fx.rewrite - 1) / stripe_data;
    let per_bit = u64::from(bm.super_.chunksize);
    for s in 0..=last_stripe {
        let first = s * fx.chunk / per_bit;
        let last = ((s + 1) * fx.chunk - 1) / per_bit;
        for k in first..=last {
            assert!(bm.is_set(k), "stripe {s} rewritten degraded, bit {k} clear");
        }
    }
    for m in fx.members.iter().filter(|m| m.active) {
        let sb = cands[usize::from(m.slot)].superblock.clone().unwrap();
        assert_eq!(
            read_bitmap(&m.image, &sb).unwrap().bytes,
            bm.bytes,
            "survivors agree"
        );
    }
    // md's own count, from `mdadm --examine-bitmap` in the guest (first survivor's block).
    let text = fs::read_to_string(fx.dir.join("examine-bitmap.txt")).unwrap();
    let want = format!("{} bits (chunks), {} dirty", bm.bits(), bm.dirty_count());
    assert!(
        text.lines().any(|l| l.contains(&want)),
        "ferroraid reads {want}; md said:\n{text}"
    );
    eprintln!(
        "md_fixtures: mdfix6b bitmap: {want}, events {} cleared {}; member {gone} re-addable by bitmap",
        ab.super_.events, ab.super_.events_cleared
    );
}

/// One member as `manifest.json` lists it (slot order).
#[derive(Debug)]
struct Member {
    slot: u16,
    image: PathBuf,
    active: bool,
    events: u64,
}

/// One array's `manifest.json`, plus its pattern.
#[derive(Debug)]
struct Fixture {
    name: String,
    dir: PathBuf,
    level_md: u32,
    level: Level,
    layout: Layout,
    chunk: u64,
    data_offset: u64,
    data_size: u64,
    array_size: u64,
    events: u64,
    members: Vec<Member>,
    /// Logical bytes `0..rewrite` were written after the removed member left.
    rewrite: u64,
    pattern: Vec<u8>,
}

impl Fixture {
    fn load(dir: &Path) -> Self {
        let path = dir.join("manifest.json");
        let text =
            fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let m = Json::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let ctx = path.display().to_string();
        let name = m.get(&ctx, "name").str(&ctx).to_string();
        let level_md = m.get(&ctx, "level").u64(&ctx) as u32;
        let layout_name = m.get(&ctx, "layout").str(&ctx);
        let layout: Layout = layout_name
            .parse()
            .unwrap_or_else(|e| panic!("{ctx}: layout {layout_name:?}: {e}"));
        let layout_md = m.get(&ctx, "layout_md").u64(&ctx) as u32;
        assert_eq!(
            layout.md_id(),
            layout_md,
            "{ctx}: md's id for {layout_name}"
        );
        let members: Vec<Member> = m
            .get(&ctx, "members")
            .array(&ctx)
            .iter()
            .map(|e| Member {
                slot: e.get(&ctx, "slot").u64(&ctx) as u16,
                image: dir.join(e.get(&ctx, "image").str(&ctx)),
                active: e.get(&ctx, "state").str(&ctx) == "active",
                events: e.get(&ctx, "events").u64(&ctx),
            })
            .collect();
        for (i, mem) in members.iter().enumerate() {
            assert_eq!(usize::from(mem.slot), i, "{ctx}: members not in slot order");
        }
        let pat = m.get(&ctx, "pattern");
        let pattern_path = dir.join(pat.get(&ctx, "file").str(&ctx));
        let pattern = fs::read(&pattern_path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", pattern_path.display()));
        let rewrite = match pat.field("rewrite") {
            Some(r) => r.get(&ctx, "bytes").u64(&ctx),
            None => 0,
        };
        let fx = Fixture {
            level: Level::from_md(level_md).unwrap_or_else(|e| panic!("{ctx}: {e}")),
            level_md,
            layout,
            chunk: m.get(&ctx, "chunk_bytes").u64(&ctx),
            data_offset: m.get(&ctx, "data_offset_bytes").u64(&ctx),
            data_size: m.get(&ctx, "data_size_bytes").u64(&ctx),
            array_size: m.get(&ctx, "array_size_bytes").u64(&ctx),
            events: m.get(&ctx, "events").u64(&ctx),
            members,
            rewrite,
            pattern,
            name,
            dir: dir.to_path_buf(),
        };
        assert_eq!(
            fx.members.len() as u64,
            m.get(&ctx, "raid_devices").u64(&ctx),
            "{ctx}: raid_devices"
        );
        assert_eq!(
            fx.pattern.len() as u64,
            fx.array_size,
            "{ctx}: the pattern is the array's content"
        );
        assert_eq!(
            fx.data_size % fx.chunk,
            0,
            "{ctx}: md's data size in whole chunks"
        );
        fx
    }

    fn n(&self) -> u16 {
        self.members.len() as u16
    }

    fn geometry(&self) -> Geometry {
        Geometry::new(self.level, self.layout, self.n(), self.chunk, 512)
            .unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }

    fn stripes(&self) -> u64 {
        self.data_size / self.chunk
    }

    fn removed(&self) -> Option<&Member> {
        self.members.iter().find(|m| !m.active)
    }

    /// Decodes each member's v1.2 superblock (4 KiB into the device) from the raw bytes.
    fn check_superblocks(&self) {
        let sbs: Vec<Superblock> = self
            .members
            .iter()
            .map(|m| Superblock::read(&m.image))
            .collect();
        let chunk_sectors = self.chunk / 512;
        for (m, sb) in self.members.iter().zip(&sbs) {
            let ctx = format!("{}: {}", self.name, m.image.display());
            assert_eq!(sb.level, self.level_md, "{ctx}: level");
            assert_eq!(sb.layout, self.layout.md_id(), "{ctx}: layout");
            assert_eq!(u64::from(sb.chunk_sectors), chunk_sectors, "{ctx}: chunk");
            assert_eq!(u32::from(self.n()), sb.raid_disks, "{ctx}: raid_disks");
            assert_eq!(sb.data_offset * 512, self.data_offset, "{ctx}: data_offset");
            assert_eq!(
                sb.size * 512,
                self.data_size,
                "{ctx}: size (used per member)"
            );
            assert!(sb.data_size >= sb.size, "{ctx}: data_size below size");
            assert_eq!(sb.super_offset, 8, "{ctx}: v1.2 superblock at 4 KiB");
            assert_eq!(sb.events, m.events, "{ctx}: events");
            assert_eq!(
                sb.name, self.name,
                "{ctx}: set_name (created with --homehost=<none>)"
            );
            assert_eq!(
                sb.dev_roles.get(sb.dev_number).copied(),
                Some(m.slot),
                "{ctx}: the member's own role is its slot"
            );
            assert_eq!(sb.set_uuid, sbs[0].set_uuid, "{ctx}: array UUID");
        }
        let survivors: Vec<&Superblock> = self
            .members
            .iter()
            .zip(&sbs)
            .filter(|(m, _)| m.active)
            .map(|(_, sb)| sb)
            .collect();
        for sb in &survivors {
            assert_eq!(sb.events, self.events, "{}: survivors' events", self.name);
            assert_eq!(
                sb.dev_roles, survivors[0].dev_roles,
                "{}: survivors' dev_roles",
                self.name
            );
            assert_eq!(
                sb.resync_offset,
                u64::MAX,
                "{}: stopped clean, nothing to resync",
                self.name
            );
        }
        if let Some(gone) = self.removed() {
            let sb = &sbs[usize::from(gone.slot)];
            assert!(
                sb.events < self.events,
                "{}: the removed member's events {} must be behind the array's {}",
                self.name,
                sb.events,
                self.events
            );
            assert_eq!(
                survivors[0].dev_roles[sb.dev_number], MD_DISK_ROLE_NONE,
                "{}: the survivors give the removed member (dev_number {}) no role",
                self.name, sb.dev_number
            );
        }
    }

    /// The host's mdadm reads every member as md wrote it.
    fn check_mdadm_examine(&self) {
        for m in &self.members {
            let out = Command::new("mdadm")
                .arg("--examine")
                .arg(&m.image)
                .stdin(Stdio::null())
                .output()
                .unwrap_or_else(|e| panic!("cannot run mdadm: {e}"));
            let text = String::from_utf8_lossy(&out.stdout);
            let ctx = format!("{}: mdadm --examine {}", self.name, m.image.display());
            assert!(out.status.success(), "{ctx}: {}", show(&out));
            for want in [
                format!("Raid Level : raid{}", self.level_md),
                format!("Name : {}", self.name),
                format!("Data Offset : {} sectors", self.data_offset / 512),
                format!("Events : {}", m.events),
                format!("Layout : {}", self.layout.name()),
                format!("Chunk Size : {}K", self.chunk / 1024),
                format!("Device Role : Active device {}", m.slot),
            ] {
                assert!(text.contains(&want), "{ctx}: no {want:?} in\n{text}");
            }
        }
    }

    fn oracle_args(&self, command: &str, images: &[String], extra: &[&str]) -> Vec<String> {
        let mut a = vec![command.to_string()];
        a.extend(images.iter().cloned());
        for (k, v) in [
            ("--level", self.level_md.to_string()),
            ("--layout", self.layout.name().to_string()),
            ("--chunk", self.chunk.to_string()),
            ("--data-offset", self.data_offset.to_string()),
            ("--stripes", self.stripes().to_string()),
        ] {
            a.push(k.to_string());
            a.push(v);
        }
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    fn check_oracle(&self, oracle: &Oracle) {
        let all: Vec<String> = self
            .members
            .iter()
            .map(|m| m.image.display().to_string())
            .collect();
        let verify = oracle
            .run(self.oracle_args("verify", &all, &[]))
            .unwrap_or_else(|e| panic!("{}: {e}", self.name));
        let stripe_bytes = self.geometry().stripe_data_bytes();
        // With the stale member put back, exactly the stripes rewritten without it disagree.
        let bad = self.rewrite.div_ceil(stripe_bytes);
        let expect = format!("stripes {} mismatches {bad}", self.stripes());
        assert!(
            verify.code() == i32::from(bad > 0) && verify.stdout.contains(&expect),
            "{}: oracle verify of md's members must print {expect:?}: {}",
            self.name,
            verify.into_error()
        );
        if bad > 0 {
            assert!(
                verify.stderr.starts_with("mismatch in stripe 0\n"),
                "{}: the first mismatch must be stripe 0: {}",
                self.name,
                verify.stderr
            );
        }

        let present: Vec<String> = self
            .members
            .iter()
            .map(|m| {
                if m.active {
                    m.image.display().to_string()
                } else {
                    "missing".to_string()
                }
            })
            .collect();
        let out_path = self.dir.join("extract.tmp");
        let out_arg = out_path.display().to_string();
        oracle
            .run_ok(self.oracle_args("extract", &present, &["--out", &out_arg]))
            .unwrap_or_else(|e| panic!("{}: {e}", self.name));
        let got = fs::read(&out_path).unwrap_or_else(|e| panic!("reading {out_arg}: {e}"));
        let _ = fs::remove_file(&out_path);
        if let Some(d) = first_difference(&got, &self.pattern) {
            panic!(
                "{}: oracle extract of md's members (removed member missing) differs from the pattern: {d}",
                self.name
            );
        }
    }

    fn check_engine_map(&self) {
        let files: Vec<File> = self
            .members
            .iter()
            .map(|m| {
                File::open(&m.image)
                    .unwrap_or_else(|e| panic!("opening {}: {e}", m.image.display()))
            })
            .collect();
        let sizes: Vec<u64> = files
            .iter()
            .map(|f| f.metadata().map(|m| m.len()).unwrap_or(0))
            .collect();
        let array = self
            .geometry()
            .with_members(&sizes, self.data_offset)
            .unwrap_or_else(|e| panic!("{}: with_members({sizes:?}): {e}", self.name));
        assert_eq!(
            array.capacity_bytes(),
            self.array_size,
            "{}: ferroraid's capacity for members of {sizes:?} bytes at data offset {} vs md's array size",
            self.name,
            self.data_offset
        );
        assert_eq!(array.stripes(), self.stripes(), "{}: stripes", self.name);

        let mut reader = Reader {
            fx: self,
            array,
            files,
            removed: self.removed().map(|m| m.slot),
            buf: Vec::new(),
            skipped: 0,
        };
        // The whole array, a stripe at a time.
        let step = self.geometry().stripe_data_bytes();
        let mut off = 0;
        while off < self.array_size {
            let len = step.min(self.array_size - off);
            reader.check(off, len);
            off += len;
        }
        // Random sector-aligned ranges up to three chunks, crossing chunks and stripes.
        let mut rng = Rng::new(seed_of(&[
            u64::from(self.level_md),
            self.layout.md_id().into(),
            self.array_size,
        ]));
        let sectors = self.array_size / 512;
        for _ in 0..RANDOM_READS {
            let off = rng.below(sectors) * 512;
            let max = (self.array_size - off).min(3 * self.chunk) / 512;
            let len = (rng.below(max) + 1) * 512;
            reader.check(off, len);
        }
        if reader.removed.is_some() {
            assert!(
                reader.skipped > 0,
                "{}: no read touched the removed member's rewritten chunks",
                self.name
            );
        }
    }
}

/// Reads logical ranges from the member images through `map_range`.
struct Reader<'a> {
    fx: &'a Fixture,
    array: ArrayGeometry,
    files: Vec<File>,
    /// The removed member: its chunks inside the range rewritten after it left are stale
    /// there and skipped (counted in `skipped`); everywhere else its (pre-failure) data
    /// must still be right.
    removed: Option<u16>,
    buf: Vec<u8>,
    skipped: u64,
}

impl Reader<'_> {
    /// Reads logical `off..off + len` and compares it with the pattern.
    fn check(&mut self, off: u64, len: u64) {
        let fx = self.fx;
        let extents = self
            .array
            .map_range(off, len)
            .unwrap_or_else(|e| panic!("{}: map_range({off}, {len}): {e}", fx.name));
        let mut at = off;
        for e in extents {
            assert_eq!(e.logical_offset, at, "{}: extents out of order", fx.name);
            at += u64::from(e.len);
            if Some(e.member) == self.removed && e.logical_offset < fx.rewrite {
                self.skipped += u64::from(e.len);
                continue;
            }
            let file = &self.files[usize::from(e.member)];
            self.buf.resize(e.len as usize, 0);
            let pos = fx.data_offset + e.member_offset;
            file.read_exact_at(&mut self.buf, pos)
                .unwrap_or_else(|err| {
                    panic!("{}: reading member {} at {pos}: {err}", fx.name, e.member)
                });
            let lo = e.logical_offset as usize;
            let want = &fx.pattern[lo..lo + e.len as usize];
            if let Some(d) = first_difference(&self.buf, want) {
                // The pattern's 4 KiB blocks start with a header naming their logical offset.
                let mut header = vec![0; 64];
                let _ = file.read_exact_at(&mut header, pos - pos % 4096);
                panic!(
                    "{}: logical {}+{} maps (ferroraid) to member {} byte {pos} (stripe {}, data index {}), \
                     whose bytes differ from md's: {d}; that member's 4 KiB block holds {:?}",
                    fx.name,
                    e.logical_offset,
                    e.len,
                    e.member,
                    e.stripe,
                    e.data_index,
                    String::from_utf8_lossy(&header).trim_end()
                );
            }
        }
        assert_eq!(
            at,
            off + len,
            "{}: map_range({off}, {len}) coverage",
            fx.name
        );
    }
}

/// The fields of an md v1 superblock (`struct mdp_superblock_1`) this test looks at.
#[derive(Debug)]
struct Superblock {
    set_uuid: [u8; 16],
    name: String,
    level: u32,
    layout: u32,
    size: u64,
    chunk_sectors: u32,
    raid_disks: u32,
    data_offset: u64,
    data_size: u64,
    super_offset: u64,
    dev_number: usize,
    events: u64,
    resync_offset: u64,
    dev_roles: Vec<u16>,
}

impl Superblock {
    /// Reads and checks (magic, version, checksum) the superblock 4 KiB into `image`.
    fn read(image: &Path) -> Self {
        let ctx = image.display();
        let f = File::open(image).unwrap_or_else(|e| panic!("opening {ctx}: {e}"));
        let mut b = vec![0u8; 4096];
        f.read_exact_at(&mut b, 4096)
            .unwrap_or_else(|e| panic!("reading {ctx}: {e}"));
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        assert_eq!(u32_at(0), MD_SB_MAGIC, "{ctx}: md superblock magic");
        assert_eq!(u32_at(4), 1, "{ctx}: major version");
        let max_dev = u32_at(220) as usize;
        assert!(256 + 2 * max_dev <= b.len(), "{ctx}: max_dev {max_dev}");
        // md's calc_sb_1_csum: the sum of the little-endian 32-bit words of the first
        // 256 + 2 * max_dev bytes (the checksum counted as zero), folded to 32 bits.
        let len = 256 + 2 * max_dev;
        let mut sum: u64 = 0;
        let mut i = 0;
        while i + 4 <= len {
            if i != 216 {
                sum += u64::from(u32_at(i));
            }
            i += 4;
        }
        if len % 4 == 2 {
            sum += u64::from(u16_at(len - 2));
        }
        let csum = ((sum & 0xffff_ffff) + (sum >> 32)) as u32;
        assert_eq!(csum, u32_at(216), "{ctx}: superblock checksum");
        let name_bytes = &b[32..64];
        let name_len = name_bytes.iter().position(|&c| c == 0).unwrap_or(32);
        Superblock {
            set_uuid: b[16..32].try_into().unwrap(),
            name: String::from_utf8_lossy(&name_bytes[..name_len]).into_owned(),
            level: u32_at(72),
            layout: u32_at(76),
            size: u64_at(80),
            chunk_sectors: u32_at(88),
            raid_disks: u32_at(92),
            data_offset: u64_at(128),
            data_size: u64_at(136),
            super_offset: u64_at(144),
            dev_number: u32_at(160) as usize,
            events: u64_at(200),
            resync_offset: u64_at(208),
            dev_roles: (0..max_dev).map(|d| u16_at(256 + 2 * d)).collect(),
        }
    }
}

/// Just enough JSON for `manifest.json` (the tests crate has no dependencies).
#[derive(Debug, Clone, PartialEq)]
enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(BTreeMap<String, Json>),
}

impl Json {
    fn parse(text: &str) -> Result<Json, String> {
        let mut p = JsonParser {
            s: text.as_bytes(),
            i: 0,
        };
        let v = p.value()?;
        p.ws();
        if p.i != p.s.len() {
            return Err(format!("trailing characters at byte {}", p.i));
        }
        Ok(v)
    }

    fn field(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(m) => m.get(key).filter(|v| **v != Json::Null),
            _ => None,
        }
    }

    fn get(&self, ctx: &str, key: &str) -> &Json {
        self.field(key)
            .unwrap_or_else(|| panic!("{ctx}: no {key:?} in {self:?}"))
    }

    fn str(&self, ctx: &str) -> &str {
        match self {
            Json::Str(s) => s,
            other => panic!("{ctx}: expected a string, got {other:?}"),
        }
    }

    fn u64(&self, ctx: &str) -> u64 {
        match *self {
            Json::Num(n) if n >= 0.0 && n.fract() == 0.0 && n < 9.007e15 => n as u64,
            ref other => panic!("{ctx}: expected a non-negative integer, got {other:?}"),
        }
    }

    fn array(&self, ctx: &str) -> &[Json] {
        match self {
            Json::Arr(a) => a,
            other => panic!("{ctx}: expected an array, got {other:?}"),
        }
    }
}

struct JsonParser<'a> {
    s: &'a [u8],
    i: usize,
}

impl JsonParser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Result<(), String> {
        self.ws();
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            Ok(())
        } else {
            Err(format!("expected {:?} at byte {}", c as char, self.i))
        }
    }

    fn value(&mut self) -> Result<Json, String> {
        self.ws();
        let rest = &self.s[self.i..];
        for (word, v) in [
            ("null", Json::Null),
            ("true", Json::Bool(true)),
            ("false", Json::Bool(false)),
        ] {
            if rest.starts_with(word.as_bytes()) {
                self.i += word.len();
                return Ok(v);
            }
        }
        match rest.first() {
            Some(b'"') => self.string().map(Json::Str),
            Some(b'[') => {
                self.i += 1;
                let mut a = Vec::new();
                self.ws();
                if self.s.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Ok(Json::Arr(a));
                }
                loop {
                    a.push(self.value()?);
                    self.ws();
                    if self.s.get(self.i) == Some(&b',') {
                        self.i += 1;
                    } else {
                        self.eat(b']')?;
                        return Ok(Json::Arr(a));
                    }
                }
            }
            Some(b'{') => {
                self.i += 1;
                let mut m = BTreeMap::new();
                self.ws();
                if self.s.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Ok(Json::Obj(m));
                }
                loop {
                    self.ws();
                    let k = self.string()?;
                    self.eat(b':')?;
                    m.insert(k, self.value()?);
                    self.ws();
                    if self.s.get(self.i) == Some(&b',') {
                        self.i += 1;
                    } else {
                        self.eat(b'}')?;
                        return Ok(Json::Obj(m));
                    }
                }
            }
            Some(c) if *c == b'-' || c.is_ascii_digit() => {
                let start = self.i;
                while self.i < self.s.len() && b"+-.eE0123456789".contains(&self.s[self.i]) {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.s[start..self.i]).map_err(|e| e.to_string())?;
                t.parse()
                    .map(Json::Num)
                    .map_err(|e| format!("number {t:?} at byte {start}: {e}"))
            }
            _ => Err(format!("unexpected input at byte {}", self.i)),
        }
    }

    fn string(&mut self) -> Result<String, String> {
        self.eat(b'"')?;
        let mut out = String::new();
        loop {
            let start = self.i;
            while self.i < self.s.len() && self.s[self.i] != b'"' && self.s[self.i] != b'\\' {
                self.i += 1;
            }
            out.push_str(std::str::from_utf8(&self.s[start..self.i]).map_err(|e| e.to_string())?);
            match self.s.get(self.i) {
                Some(b'"') => {
                    self.i += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    let c = *self.s.get(self.i + 1).ok_or("unterminated escape")?;
                    self.i += 2;
                    match c {
                        b'"' | b'\\' | b'/' => out.push(c as char),
                        b'n' => out.push('\n'),
                        b't' => out.push('\t'),
                        b'r' => out.push('\r'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'u' => {
                            let hex = self.s.get(self.i..self.i + 4).ok_or("short \\u escape")?;
                            let hex = std::str::from_utf8(hex).map_err(|e| e.to_string())?;
                            let code = u32::from_str_radix(hex, 16).map_err(|e| e.to_string())?;
                            self.i += 4;
                            out.push(char::from_u32(code).unwrap_or('\u{fffd}'));
                        }
                        other => return Err(format!("bad escape \\{}", other as char)),
                    }
                }
                _ => return Err("unterminated string".to_string()),
            }
        }
    }
}

#[test]
fn json_reader_reads_what_python_writes() {
    let v = Json::parse(
        r#"{"a": [1, -2.5e1, true, null, "x\"\u00e9\n"], "b": {}, "c": [], "d": 18446744073709}"#,
    )
    .unwrap();
    let a = v.get("t", "a").array("t");
    assert_eq!(a[0], Json::Num(1.0));
    assert_eq!(a[1], Json::Num(-25.0));
    assert_eq!(a[2], Json::Bool(true));
    assert_eq!(a[3], Json::Null);
    assert_eq!(a[4].str("t"), "x\"é\n");
    assert_eq!(v.get("t", "d").u64("t"), 18_446_744_073_709);
    assert!(v.field("b").is_some() && v.field("zz").is_none());
    assert!(Json::parse("{\"a\": 1,}").is_err());
    assert!(Json::parse("[1] x").is_err());
}
