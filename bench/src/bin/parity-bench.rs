//! Parity kernel benchmark: P, P+Q generation and two-data recovery, per kernel, out of
//! cache, beside a memory-read baseline and Intel ISA-L measured on the same buffers in the
//! same run.
//!
//! ```text
//! cargo run --release -p bench --bin parity-bench -- [--working-set-mib 512] [--reps 7]
//! ```
//!
//! Figures are GB/s (10^9 bytes/s) of *data chunks* processed: a stripe of `k` data chunks
//! of 64 KiB counts `k × 65536` bytes whatever the operation writes. Every candidate runs
//! one pass over all stripes of a working set much larger than the last-level cache; passes
//! of all candidates are interleaved, `--reps` times, and the median pass is reported.

use anyhow::{bail, Context, Result};
use bench::{fill_random, isal, median, membw, time_s};
use clap::Parser;
use engine::buf::AlignedBuf;
use engine::parity::{Kernel, Parity};
use rand::seq::SliceRandom;
use rand_chacha::rand_core::SeedableRng;

#[derive(Parser, Debug)]
#[command(about = "Benchmark ferroraid's parity kernels against memory bandwidth and ISA-L")]
struct Args {
    /// Chunk size in KiB.
    #[arg(long, default_value_t = 64)]
    chunk_kib: usize,
    /// Data chunks per stripe, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
    data_chunks: Vec<usize>,
    /// Bytes of data chunks cycled through, in MiB; keep it ≥ 8× the last-level cache so
    /// every pass runs out of cache (outputs add half as much again).
    #[arg(long, default_value_t = 512)]
    working_set_mib: usize,
    /// Measured passes per candidate (median reported).
    #[arg(long, default_value_t = 11)]
    reps: usize,
    /// Unrelated memory read before every timed pass, in MiB (≥ 4× the last-level cache):
    /// it evicts what the previous pass left in the cache, dirty lines included, so no
    /// candidate pays for its predecessor's write-backs or profits from its leftovers.
    #[arg(long, default_value_t = 128)]
    scrub_mib: usize,
    /// Measured passes for the (slow) scalar kernel.
    #[arg(long, default_value_t = 3)]
    scalar_reps: usize,
    /// Pin the benchmark thread to this core.
    #[arg(long, default_value_t = 0)]
    core: usize,
}

/// One measured implementation of one operation.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Candidate {
    MemRead,
    Isal,
    Engine { kernel: Kernel, streaming: bool },
}

impl Candidate {
    fn label(&self, op: Op) -> String {
        match self {
            Candidate::MemRead => "memory-read baseline".into(),
            Candidate::Isal => match op {
                Op::P => "ISA-L xor_gen".into(),
                _ => "ISA-L pq_gen".into(),
            },
            Candidate::Engine { kernel, streaming } => {
                format!(
                    "{kernel}{}",
                    if *streaming {
                        " (streaming stores)"
                    } else {
                        " (cached stores)"
                    }
                )
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    P,
    Pq,
    Recover2,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::P => "P generation",
            Op::Pq => "P+Q generation",
            Op::Recover2 => "two-data recovery (P+Q)",
        }
    }
}

/// The buffers: a data region and four output regions, each chunk 4 KiB-aligned.
struct Regions {
    chunk: usize,
    data: AlignedBuf,
    outs: [AlignedBuf; 4],
}

impl Regions {
    fn chunk_of<'a>(&self, region: &'a [u8], i: usize) -> &'a [u8] {
        &region[i * self.chunk..(i + 1) * self.chunk]
    }
}

fn run_pass(r: &mut Regions, nd: usize, stripes: usize, op: Op, c: Candidate) -> u64 {
    let chunk = r.chunk;
    let mut sink = 0u64;
    let (o0, rest) = r.outs.split_at_mut(1);
    let (o1, rest) = rest.split_at_mut(1);
    let (o2, o3) = rest.split_at_mut(1);
    let (o0, o1, o2, o3) = (&mut o0[0], &mut o1[0], &mut o2[0], &mut o3[0]);
    for s in 0..stripes {
        let base = s * nd;
        let out = s * chunk..(s + 1) * chunk;
        let mut arr: [&[u8]; 257] = [&[]; 257];
        for (i, a) in arr.iter_mut().enumerate().take(nd) {
            *a = &r.data[(base + i) * chunk..(base + i + 1) * chunk];
        }
        let ptrs = &arr[..nd];
        match (op, c) {
            (Op::P | Op::Pq, Candidate::MemRead) => sink ^= membw::read_all(ptrs),
            (Op::Recover2, Candidate::MemRead) => {
                // What recovery reads: the surviving data, P and Q.
                arr[nd] = &o0[out.clone()];
                arr[nd + 1] = &o1[out.clone()];
                sink ^= membw::read_all(&arr[2..nd + 2]);
            }
            (Op::P, Candidate::Isal) => isal::xor_gen(ptrs, &mut o0[out]).expect("ISA-L linked"),
            (Op::Pq, Candidate::Isal) => {
                isal::pq_gen(ptrs, &mut o0[out.clone()], &mut o1[out]).expect("ISA-L linked")
            }
            (Op::P, Candidate::Engine { kernel, streaming }) => {
                parity(kernel, streaming).gen_p(ptrs, &mut o0[out])
            }
            (Op::Pq, Candidate::Engine { kernel, streaming }) => {
                parity(kernel, streaming).gen_pq(ptrs, &mut o0[out.clone()], &mut o1[out])
            }
            (Op::Recover2, Candidate::Engine { kernel, streaming }) => {
                let mut opt: [Option<&[u8]>; 255] = [None; 255];
                for (o, d) in opt.iter_mut().zip(ptrs).skip(2) {
                    *o = Some(*d);
                }
                parity(kernel, streaming).recover_two_data(
                    &opt[..nd],
                    &o0[out.clone()],
                    &o1[out.clone()],
                    &mut o2[out.clone()],
                    &mut o3[out],
                );
            }
            (Op::Recover2, Candidate::Isal) => unreachable!("ISA-L has no RAID-6 recovery"),
        }
    }
    sink
}

fn parity(kernel: Kernel, streaming: bool) -> Parity {
    Parity::with_kernel(kernel)
        .expect("listed kernels are available")
        .streaming(streaming)
}

/// Checks the measured outputs once: ISA-L's P/Q equal ours, recovery restores the data.
fn verify(r: &mut Regions, nd: usize, stripes: usize) -> Result<()> {
    let best = Parity::new();
    run_pass(
        r,
        nd,
        stripes,
        Op::Pq,
        Candidate::Engine {
            kernel: best.kernel(),
            streaming: true,
        },
    );
    if isal::available() {
        let p = r.outs[0][..r.chunk].to_vec();
        let q = r.outs[1][..r.chunk].to_vec();
        run_pass(r, nd, 1, Op::Pq, Candidate::Isal);
        if r.outs[0][..r.chunk] != p[..] || r.outs[1][..r.chunk] != q[..] {
            bail!("ISA-L pq_gen and ferroraid disagree on P/Q: the comparison would not be like for like");
        }
    }
    run_pass(
        r,
        nd,
        stripes,
        Op::Recover2,
        Candidate::Engine {
            kernel: best.kernel(),
            streaming: true,
        },
    );
    for s in [0, stripes / 2, stripes - 1] {
        let x = r.chunk_of(&r.data, s * nd);
        let y = r.chunk_of(&r.data, s * nd + 1);
        if r.chunk_of(&r.outs[2], s) != x || r.chunk_of(&r.outs[3], s) != y {
            bail!("two-data recovery did not restore stripe {s}");
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(core) =
        core_affinity::get_core_ids().and_then(|ids| ids.into_iter().find(|c| c.id == args.core))
    {
        core_affinity::set_for_current(core);
    }
    let chunk = args.chunk_kib * 1024;
    if chunk == 0 || chunk % 4096 != 0 {
        bail!("--chunk-kib must be a positive multiple of 4");
    }
    let min_nd = *args
        .data_chunks
        .iter()
        .min()
        .context("--data-chunks is empty")?;
    if min_nd < 2 || *args.data_chunks.iter().max().unwrap() > 255 {
        bail!("--data-chunks must lie in 2..=255");
    }
    let ws = args.working_set_mib << 20;
    let out_bytes = (ws / (min_nd * chunk)) * chunk;
    eprintln!(
        "allocating {} MiB of data and 4 × {} MiB of outputs; filling…",
        ws >> 20,
        out_bytes >> 20
    );
    let mut r = Regions {
        chunk,
        data: AlignedBuf::zeroed(ws),
        outs: std::array::from_fn(|_| AlignedBuf::zeroed(out_bytes)),
    };
    fill_random(&mut r.data, 0x5eed);
    for (i, o) in r.outs.iter_mut().enumerate() {
        fill_random(o, i as u64);
    }

    let kernels: Vec<Kernel> = Kernel::available().collect();
    let best = Parity::new();
    println!("# ferroraid parity benchmark\n");
    println!(
        "- CPU: {}\n- kernels available: {}; default (best): {}\n- ISA-L: {}\n- chunk {} KiB, working set {} MiB of data (out of cache), median of {} passes ({} for scalar) in random order, each after an untimed {} MiB cache scrub, core {}\n",
        bench::cpu_model(),
        kernels.iter().map(|k| k.name()).collect::<Vec<_>>().join(", "),
        best.kernel(),
        if isal::available() { "linked (pq_gen/xor_gen multibinary dispatch)" } else { "not linked" },
        args.chunk_kib,
        args.working_set_mib,
        args.reps,
        args.scalar_reps,
        args.scrub_mib,
        args.core
    );

    let mut scrub = AlignedBuf::zeroed((args.scrub_mib << 20) / chunk * chunk);
    fill_random(&mut scrub, 0x5c2b);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0xbe4c);
    let mut sink = 0u64;
    // How fast one core can read at all, by number of interleaved streams: the ceiling
    // every kernel below works under.
    println!("## Memory-read bandwidth of one core, by interleaved streams\n");
    println!("| streams | GB/s |");
    println!("|---:|---:|");
    for streams in [1usize, 2, 4, 8, 16] {
        let stripes = ws / (streams * chunk);
        let mut gbs = Vec::with_capacity(args.reps);
        for _ in 0..args.reps {
            let t = time_s(|| {
                for s in 0..stripes {
                    let mut arr: [&[u8]; 16] = [&[]; 16];
                    for (i, a) in arr.iter_mut().enumerate().take(streams) {
                        *a = r.chunk_of(&r.data, s * streams + i);
                    }
                    sink ^= membw::read_all(&arr[..streams]);
                }
            });
            gbs.push((stripes * streams * chunk) as f64 / t / 1e9);
        }
        println!("| {streams} | {:.2} |", median(&mut gbs));
    }
    println!();

    let mut summary = Vec::new();
    for &nd in &args.data_chunks {
        let stripes = ws / (nd * chunk);
        verify(&mut r, nd, stripes)?;
        // verify() left real P and Q of every stripe in outs[0..2] for the recovery passes.
        let bytes = (stripes * nd * chunk) as f64;
        for op in [Op::P, Op::Pq, Op::Recover2] {
            let mut cands = vec![Candidate::MemRead];
            if isal::available() && op != Op::Recover2 {
                cands.push(Candidate::Isal);
            }
            for &k in &kernels {
                cands.push(Candidate::Engine {
                    kernel: k,
                    streaming: true,
                });
                if k != Kernel::Scalar {
                    cands.push(Candidate::Engine {
                        kernel: k,
                        streaming: false,
                    });
                }
            }
            let mut samples: Vec<Vec<f64>> = vec![Vec::new(); cands.len()];
            for rep in 0..args.reps {
                // A fresh random order each repetition so neither drift nor a fixed
                // predecessor favours one candidate.
                let mut order: Vec<usize> = (0..cands.len()).collect();
                order.shuffle(&mut rng);
                for i in order {
                    let c = cands[i];
                    let scalar = matches!(
                        c,
                        Candidate::Engine {
                            kernel: Kernel::Scalar,
                            ..
                        }
                    );
                    if scalar && rep >= args.scalar_reps {
                        continue;
                    }
                    sink ^= scrub_cache(&scrub, chunk);
                    let t = time_s(|| sink ^= run_pass(&mut r, nd, stripes, op, c));
                    samples[i].push(bytes / t / 1e9);
                }
            }
            let gbs: Vec<f64> = samples.iter_mut().map(|s| median(s)).collect();
            let base = gbs[0];
            let isal_gbs = cands
                .iter()
                .position(|c| *c == Candidate::Isal)
                .map(|i| gbs[i]);
            println!(
                "## {} data chunks × {} KiB: {}\n",
                nd,
                args.chunk_kib,
                op.name()
            );
            println!("| implementation | GB/s | vs memory read | vs ISA-L |");
            println!("|---|---:|---:|---:|");
            for (c, g) in cands.iter().zip(&gbs) {
                let vs_isal = isal_gbs.map_or("–".to_string(), |i| format!("{:.2}×", g / i));
                println!(
                    "| {} | {:.2} | {:.0}% | {} |",
                    c.label(op),
                    g,
                    100.0 * g / base,
                    vs_isal
                );
            }
            let at = |k: Kernel, s: bool| {
                cands
                    .iter()
                    .position(|c| {
                        *c == Candidate::Engine {
                            kernel: k,
                            streaming: s,
                        }
                    })
                    .map(|i| gbs[i])
            };
            let default = at(best.kernel(), true).expect("default kernel measured");
            let scalar = at(Kernel::Scalar, true).expect("scalar measured");
            println!(
                "\ndefault kernel ({}, streaming): {:.2} GB/s = {:.0}% of memory read; {:.1}× the scalar reference\n",
                best.kernel(),
                default,
                100.0 * default / base,
                default / scalar
            );
            summary.push((
                nd,
                op,
                default / base,
                isal_gbs.map(|i| default / i),
                default / scalar,
            ));
        }
    }

    println!("## Targets (issue 2), default kernel\n");
    println!(
        "Store-traffic ratio: a bandwidth-bound pass over k data chunks reads k chunks and \
         writes 1 (P) or 2 (P+Q); ISA-L's ordinary stores also read every destination line \
         first (read-for-ownership), ferroraid's streaming stores do not. At equal efficiency \
         otherwise, that alone makes ferroraid (k+2)/(k+1) (P) or (k+4)/(k+2) (P+Q) times \
         faster; more than that means ISA-L loses elsewhere too.\n"
    );
    println!("| data chunks | operation | % of memory read | × ISA-L | store-traffic ratio | × scalar | target | met |");
    println!("|---:|---|---:|---:|---:|---:|---|---|");
    for (nd, op, vs_mem, vs_isal, vs_scalar) in summary {
        let (target, met) = match op {
            Op::Pq => (
                "≥ 85% mem, ≥ 1.3× ISA-L",
                vs_mem >= 0.85 && vs_isal.is_none_or(|v| v >= 1.3),
            ),
            Op::P => (
                "≥ 90% mem, ≥ 1.0× ISA-L",
                vs_mem >= 0.90 && vs_isal.is_none_or(|v| v >= 1.0),
            ),
            Op::Recover2 => ("(reported)", true),
        };
        let ceiling = match op {
            Op::Pq => format!("{:.2}×", (nd as f64 + 4.0) / (nd as f64 + 2.0)),
            Op::P => format!("{:.2}×", (nd as f64 + 2.0) / (nd as f64 + 1.0)),
            Op::Recover2 => "–".into(),
        };
        println!(
            "| {} | {} | {:.0}% | {} | {} | {:.1}× | {} | {} |",
            nd,
            op.name(),
            100.0 * vs_mem,
            vs_isal.map_or("–".into(), |v| format!("{v:.2}×")),
            ceiling,
            vs_scalar,
            target,
            if met { "yes" } else { "NO" }
        );
    }
    eprintln!("(checksum {sink:#x})");
    Ok(())
}

/// Reads all of `scrub` (untimed), evicting the cache contents of the previous pass.
fn scrub_cache(scrub: &[u8], chunk: usize) -> u64 {
    let mut x = 0;
    for c in scrub.chunks_exact(chunk) {
        x ^= membw::read_all(&[c]);
    }
    x
}
