//! `ferroraid selftest`: an offline self-test of the engine (the foundation-stage demo).
//! Builds a RAID array over member image files in a data directory with the engine's geometry and parity, verifies every stripe, then loses
//! members (two for RAID6, one for RAID5) and reconstructs every stripe from the survivors,
//! checking each byte against what was written. The member images are md-layout images
//! that `../shared/oracle/raidref.py verify` accepts; the command to check them is printed.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use engine::buf::AlignedBuf;
use engine::geometry::{ArrayGeometry, Level, Role};
use engine::parity::{ChunkId, Kernel, Parity};

/// Options of `ferroraid selftest`.
#[derive(Args, Debug)]
pub struct SelftestArgs {
    /// Data directory for the member images (created if missing; existing
    /// `member-N.img` files in it are overwritten, nothing else is touched).
    #[arg(long, default_value = "ferroraid-selftest")]
    dir: PathBuf,
    #[command(flatten)]
    shape: crate::Shape,
    /// Size of each member image (K, M, G suffixes are binary).
    #[arg(long, default_value = "16M", value_parser = crate::parse_bytes)]
    member_size: u64,
    /// Members to lose before reconstructing (default: 1 and 3 for RAID6, 1 for RAID5).
    #[arg(long, value_delimiter = ',')]
    fail: Vec<u16>,
    /// Parity kernel (default: the best this CPU has).
    #[arg(long)]
    kernel: Option<Kernel>,
    /// Seed of the pseudo-random logical data.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Largest array capacity the self-test builds, in bytes. The self-test keeps the logical data and
/// every member image in memory to check them, about `capacity × (1 + members/data_chunks)`
/// bytes: at most 3 GiB at this limit (RAID6 with 4 members).
const MAX_SELFTEST_CAPACITY_BYTES: u64 = 1 << 30;

/// Progress output: best effort, so a closed stdout (`| head`) never stops the self-test
/// half-way through writing its images.
macro_rules! progress {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

/// Runs the self-test.
///
/// # Errors
/// Invalid geometry, unusable directory, I/O failures on the member images, or a
/// verification/reconstruction mismatch (which would be a bug).
pub fn run(a: &SelftestArgs) -> Result<()> {
    let geo = a.shape.geometry()?;
    let parity = match a.kernel {
        Some(k) => Parity::with_kernel(k)?,
        None => Parity::new(),
    };
    let n = usize::from(geo.members());
    let arr = geo.with_members(&vec![a.member_size; n], 0)?;
    ensure!(
        arr.capacity_bytes() <= MAX_SELFTEST_CAPACITY_BYTES,
        "the self-test holds the array in memory and is limited to {MAX_SELFTEST_CAPACITY_BYTES} bytes of \
         capacity; {} members of {} bytes give {}: lower --member-size or --members",
        n,
        a.member_size,
        arr.capacity_bytes()
    );
    let mut fail: Vec<u16> = if a.fail.is_empty() {
        match geo.level() {
            Level::Raid6 => vec![1, 3],
            Level::Raid5 => vec![1],
        }
    } else {
        a.fail.clone()
    };
    fail.sort_unstable();
    fail.dedup();
    for &m in &fail {
        ensure!(
            m < geo.members(),
            "--fail member {m} does not exist (members are 0..{})",
            geo.members()
        );
    }
    if fail.len() > usize::from(geo.parity_chunks()) {
        bail!(
            "--fail names {} members but {} survives only {}",
            fail.len(),
            geo.level(),
            geo.parity_chunks()
        );
    }

    fs::create_dir_all(&a.dir)
        .with_context(|| format!("creating data directory {}", a.dir.display()))?;
    let paths: Vec<PathBuf> = (0..n)
        .map(|i| a.dir.join(format!("member-{i}.img")))
        .collect();
    // Check every path before writing any: only regular files (or nothing) are replaced,
    // never a symlink, directory or device someone left under that name.
    for p in &paths {
        match fs::symlink_metadata(p) {
            Ok(m) if !m.file_type().is_file() => {
                let t = m.file_type();
                let what = if t.is_symlink() {
                    "a symbolic link"
                } else if t.is_dir() {
                    "a directory"
                } else {
                    "not a regular file"
                };
                bail!("refusing to overwrite {}: it is {what}", p.display())
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("inspecting {}", p.display())),
        }
    }
    progress!(
        "ferroraid selftest: {} {} over {} member images of {} bytes in {} (chunk {} bytes, parity kernel {})",
        geo.level(),
        geo.layout(),
        n,
        arr.member_data_bytes(),
        a.dir.display(),
        geo.chunk_bytes(),
        parity.kernel()
    );
    progress!(
        "  capacity {} bytes in {} stripes",
        arr.capacity_bytes(),
        arr.stripes()
    );

    // 1. Write: logical data -> member images, with P (and Q) per stripe.
    let mut logical = AlignedBuf::zeroed(usize::try_from(arr.capacity_bytes())?);
    fill(&mut logical, a.seed);
    let t = Instant::now();
    write_array(&arr, &parity, &logical, &paths)?;
    progress!(
        "1. wrote {} bytes of data and parity in {:.2?}",
        arr.capacity_bytes(),
        t.elapsed()
    );

    // 2. Verify every stripe's parity from the images on disk.
    let images = read_members(&paths, arr.member_data_bytes())?;
    let mismatches = verify(&arr, &parity, &images)?;
    ensure!(
        mismatches == 0,
        "{mismatches} stripes have inconsistent parity"
    );
    progress!(
        "2. verified P{} of all {} stripes: 0 mismatches",
        if geo.level() == Level::Raid6 {
            "+Q"
        } else {
            ""
        },
        arr.stripes()
    );

    // 3. Lose members and rebuild every stripe from the survivors.
    let t = Instant::now();
    let rebuilt = reconstruct(&arr, &parity, &images, &fail, &logical)?;
    let el = t.elapsed();
    progress!(
        "3. lost members {:?}; reconstructed {} chunks ({} bytes) and read back every logical byte correctly in {:.2?} ({:.2} GB/s of array data)",
        fail,
        rebuilt,
        rebuilt * u64::from(geo.chunk_bytes()),
        el,
        arr.capacity_bytes() as f64 / el.as_secs_f64() / 1e9
    );
    progress!(
        "Cross-check with the independent oracle, from the repository root:\n  python3 ../shared/oracle/raidref.py verify {} --level {} --layout {} --chunk {}",
        paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" "),
        geo.level().md_level(),
        geo.layout(),
        geo.chunk_bytes()
    );
    Ok(())
}

/// Deterministic pseudo-random bytes (ChaCha8 from `seed`).
fn fill(buf: &mut [u8], seed: u64) {
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    rand_chacha::ChaCha8Rng::seed_from_u64(seed).fill_bytes(buf);
}

/// Data chunks of `stripe` in Q slot order, as slices of `chunk_of(data_index)`.
fn slot_order<'a>(
    arr: &ArrayGeometry,
    stripe: u64,
    chunk_of: impl Fn(u16) -> &'a [u8],
) -> Vec<&'a [u8]> {
    let g = arr.geometry();
    let st = g.stripe(stripe);
    let mut out: Vec<&[u8]> = vec![&[]; usize::from(g.data_chunks())];
    for k in 0..g.data_chunks() {
        out[usize::from(st.q_slot(k))] = chunk_of(k);
    }
    out
}

fn write_array(
    arr: &ArrayGeometry,
    parity: &Parity,
    logical: &[u8],
    paths: &[PathBuf],
) -> Result<()> {
    let g = arr.geometry();
    let chunk = g.chunk_bytes() as usize;
    let files: Vec<File> = paths
        .iter()
        .map(|p| {
            let f = OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .open(p)
                .with_context(|| format!("creating member image {}", p.display()))?;
            f.set_len(arr.member_data_bytes())
                .with_context(|| format!("sizing {}", p.display()))?;
            Ok(f)
        })
        .collect::<Result<_>>()?;
    let mut p = AlignedBuf::zeroed(chunk);
    let mut q = AlignedBuf::zeroed(chunk);
    let stripe_bytes = g.stripe_data_bytes() as usize;
    for s in 0..arr.stripes() {
        let base = s as usize * stripe_bytes;
        let st = g.stripe(s);
        let off = s * chunk as u64;
        for k in 0..g.data_chunks() {
            let d = &logical[base + usize::from(k) * chunk..][..chunk];
            write_at(&files, paths, st.data_member(k), d, off)?;
        }
        let data = slot_order(arr, s, |k| {
            &logical[base + usize::from(k) * chunk..][..chunk]
        });
        match st.q_member() {
            Some(qm) => {
                parity.gen_pq(&data, &mut p, &mut q);
                write_at(&files, paths, qm, &q, off)?;
            }
            None => parity.gen_p(&data, &mut p),
        }
        write_at(&files, paths, st.p_member(), &p, off)?;
    }
    for (f, path) in files.iter().zip(paths) {
        f.sync_all()
            .with_context(|| format!("syncing {}", path.display()))?;
    }
    Ok(())
}

fn write_at(files: &[File], paths: &[PathBuf], member: u16, buf: &[u8], off: u64) -> Result<()> {
    let m = usize::from(member);
    files[m].write_all_at(buf, off).with_context(|| {
        format!(
            "writing {} bytes at {off} to {}",
            buf.len(),
            paths[m].display()
        )
    })
}

fn read_members(paths: &[PathBuf], bytes: u64) -> Result<Vec<AlignedBuf>> {
    paths
        .iter()
        .map(|p: &PathBuf| {
            let mut b = AlignedBuf::zeroed(usize::try_from(bytes)?);
            read_exact_at(p, &mut b)?;
            Ok(b)
        })
        .collect()
}

fn read_exact_at(path: &Path, buf: &mut [u8]) -> Result<()> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    f.read_exact_at(buf, 0)
        .with_context(|| format!("reading {} bytes from {}", buf.len(), path.display()))
}

fn verify(arr: &ArrayGeometry, parity: &Parity, images: &[AlignedBuf]) -> Result<u64> {
    let g = arr.geometry();
    let chunk = g.chunk_bytes() as usize;
    let mut p = AlignedBuf::zeroed(chunk);
    let mut q = AlignedBuf::zeroed(chunk);
    let parity = parity.streaming(false); // results are compared at once
    let mut bad = 0;
    for s in 0..arr.stripes() {
        let st = g.stripe(s);
        let at = s as usize * chunk;
        let member = |m: u16| &images[usize::from(m)][at..at + chunk];
        let data = slot_order(arr, s, |k| member(st.data_member(k)));
        let ok = match st.q_member() {
            Some(qm) => {
                parity.gen_pq(&data, &mut p, &mut q);
                p[..] == *member(st.p_member()) && q[..] == *member(qm)
            }
            None => {
                parity.gen_p(&data, &mut p);
                p[..] == *member(st.p_member())
            }
        };
        if !ok {
            bad += 1;
        }
    }
    Ok(bad)
}

/// Rebuilds the chunks of the `fail`ed members in every stripe and checks the logical
/// data they held against `logical`. Returns the number of chunks rebuilt.
fn reconstruct(
    arr: &ArrayGeometry,
    parity: &Parity,
    images: &[AlignedBuf],
    fail: &[u16],
    logical: &[u8],
) -> Result<u64> {
    let g = arr.geometry();
    let chunk = g.chunk_bytes() as usize;
    let nd = usize::from(g.data_chunks());
    let mut data: Vec<AlignedBuf> = (0..nd).map(|_| AlignedBuf::zeroed(chunk)).collect();
    let mut p = AlignedBuf::zeroed(chunk);
    let mut q = AlignedBuf::zeroed(chunk);
    let poison = vec![0xa5u8; chunk];
    let mut rebuilt = 0u64;
    for s in 0..arr.stripes() {
        let st = g.stripe(s);
        let at = s as usize * chunk;
        let mut lost = Vec::with_capacity(fail.len());
        for m in 0..g.members() {
            let src = &images[usize::from(m)][at..at + chunk];
            // A failed member's chunk is not read: the buffer gets poison instead.
            let src = if fail.contains(&m) { &poison[..] } else { src };
            let (dst, id) = match st.role(m) {
                Role::P => (&mut p, ChunkId::P),
                Role::Q => (&mut q, ChunkId::Q),
                Role::Data { slot, .. } => {
                    (&mut data[usize::from(slot)], ChunkId::Data(slot as u8))
                }
            };
            dst.copy_from_slice(src);
            if fail.contains(&m) {
                lost.push(id);
            }
        }
        let mut dm: Vec<&mut [u8]> = data.iter_mut().map(|b| &mut b[..]).collect();
        let qa = st.q_member().map(|_| &mut q[..]);
        parity.reconstruct(&mut dm, &mut p, qa, &lost)?;
        rebuilt += lost.len() as u64;
        if lost.contains(&ChunkId::P) && p[..] != images[usize::from(st.p_member())][at..at + chunk]
        {
            bail!("stripe {s}: regenerated P differs");
        }
        if let Some(qm) = st.q_member() {
            if lost.contains(&ChunkId::Q) && q[..] != images[usize::from(qm)][at..at + chunk] {
                bail!("stripe {s}: regenerated Q differs");
            }
        }
        let base = s as usize * g.stripe_data_bytes() as usize;
        for k in 0..g.data_chunks() {
            let want = &logical[base + usize::from(k) * chunk..][..chunk];
            if data[usize::from(st.q_slot(k))][..] != *want {
                bail!("stripe {s}: data index {k} differs after reconstruction");
            }
        }
    }
    Ok(rebuilt)
}
