//! What the copy into the stripe cache costs a stream of small sequential writes, and what
//! computing parity straight from the clients' buffers would save (issue 17: sequential
//! 4 KiB writes at QD32 spend as long in `memmove` as in parity generation). No array, no
//! devices: the two memory passes of a stripe's writes on their own, with the engine's
//! parity kernel ([`Parity::new`]), on one core.
//!
//! ```text
//! cargo run --release -p bench --bin copy-gen-probe -- [--chunk-kib 64] [--data-chunks 4]
//!     [--write-kib 4] [--qd 32] [--entries 64] [--seconds 2]
//! ```
//!
//! A stripe of `--data-chunks` chunks receives `--qd` writes of `--write-kib` per pass
//! (the client's depth: QD32 × 4 KiB is half a 4-chunk stripe of 64 KiB chunks, so two
//! passes a stripe, as the array runs them), from `--qd` client buffers that are reused;
//! stripes take the `--entries` cache entries in turn (recycled, as `pass.rs` recycles a
//! stream's entries). Per pass, P over the whole stripe:
//!
//! - `copy` (what the array does): each write copied into its entry's chunk, then P from
//!   the entry's chunks;
//! - `direct`: P computed row piece by row piece (`--write-kib` each) from the client
//!   buffers for the chunks this pass writes and from the entry for the others; nothing
//!   copied. What a pass costs if its data stays in the clients' buffers (member writes
//!   from those buffers, vectored) — but its data is then not in the cache for the next
//!   pass of the stripe;
//! - `copy-then-direct`: the first pass of a stripe as `copy` (the second needs its data),
//!   the second as `direct` (nothing after it needs the data): the saving open to a stream
//!   that leaves the stripe after its last pass;
//! - `direct-rmw`: every pass direct, the first as `direct`, each later one as a
//!   read-modify-write against the previous pass's P: P' = P ⊕ old ⊕ new over the chunks
//!   it writes, the old data from the entry (the chunks a pass writes are ones no earlier
//!   pass of the stripe wrote, so the entry still holds them as the members do), the new
//!   from the clients' buffers. Nothing is copied and no pass needs an earlier pass's data.
//!
//! Output: ns per client write for each, and each ÷ `copy`.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use clap::Parser;
use engine::buf::AlignedBuf;
use engine::parity::Parity;

#[derive(Parser, Debug)]
#[command(about = "Copy into the stripe cache vs parity from the clients' buffers")]
struct Args {
    /// Chunk size, KiB.
    #[arg(long, default_value_t = 64)]
    chunk_kib: usize,
    /// Data chunks per stripe.
    #[arg(long, default_value_t = 4)]
    data_chunks: usize,
    /// Client write size, KiB (a divisor of the chunk).
    #[arg(long, default_value_t = 4)]
    write_kib: usize,
    /// Client writes per pass (the client's depth).
    #[arg(long, default_value_t = 32)]
    qd: usize,
    /// Cache entries the stripes take in turn.
    #[arg(long, default_value_t = 64)]
    entries: usize,
    /// Seconds per mode.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Copy,
    Direct,
    CopyThenDirect,
    DirectRmw,
}

struct Probe {
    parity: Parity,
    chunk: usize,
    piece: usize,
    data_chunks: usize,
    /// Per entry: `data_chunks` data chunks, then P, then the next P of `direct-rmw`.
    entries: Vec<Vec<AlignedBuf>>,
    clients: Vec<AlignedBuf>,
}

impl Probe {
    /// One pass over entry `e`: the client writes cover stripe bytes `from..to` (whole
    /// pieces), client buffer `i` holding piece `i` of the range.
    fn pass(&mut self, e: usize, from: usize, to: usize, copy: bool) {
        let (chunk, piece) = (self.chunk, self.piece);
        if copy {
            for (i, at) in (from..to).step_by(piece).enumerate() {
                let dst = &mut self.entries[e][at / chunk][at % chunk..at % chunk + piece];
                dst.copy_from_slice(&self.clients[i]);
            }
            let (data, p) = self.entries[e].split_at_mut(self.data_chunks);
            let srcs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
            self.parity.gen_p(&srcs, &mut p[0]);
            return;
        }
        // Row piece by row piece: each chunk's source is the client buffer that writes
        // it in this pass, else the entry.
        let (data, p) = self.entries[e].split_at_mut(self.data_chunks);
        let mut srcs: Vec<&[u8]> = Vec::with_capacity(self.data_chunks);
        for row in (0..chunk).step_by(piece) {
            srcs.clear();
            for (k, d) in data.iter().enumerate() {
                let at = k * chunk + row;
                srcs.push(if (from..to).contains(&at) {
                    &self.clients[(at - from) / piece][..]
                } else {
                    &d[row..row + piece]
                });
            }
            self.parity.gen_p(&srcs, &mut p[0][row..row + piece]);
        }
    }

    /// A later pass of `direct-rmw` over entry `e` (bytes `from..to`, whole chunks'
    /// rows as `pass` takes them): the next P from this P, the old data of the chunks it
    /// writes (the entry) and their new data (the clients' buffers), row piece by row
    /// piece; then the two P buffers swap.
    fn rmw_pass(&mut self, e: usize, from: usize, to: usize) {
        let (chunk, piece, n) = (self.chunk, self.piece, self.data_chunks);
        let (data, ps) = self.entries[e].split_at_mut(n);
        let (p, next) = ps.split_at_mut(1);
        let mut srcs: Vec<&[u8]> = Vec::with_capacity(2 * n + 1);
        for row in (0..chunk).step_by(piece) {
            srcs.clear();
            srcs.push(&p[0][row..row + piece]);
            for (k, d) in data.iter().enumerate() {
                let at = k * chunk + row;
                if (from..to).contains(&at) {
                    srcs.push(&d[row..row + piece]);
                    srcs.push(&self.clients[(at - from) / piece][..]);
                }
            }
            self.parity.gen_p(&srcs, &mut next[0][row..row + piece]);
        }
        self.entries[e].swap(n, n + 1);
    }

    /// ns per client write of `mode` over `seconds`.
    fn run(&mut self, mode: Mode, seconds: f64, qd: usize) -> f64 {
        let stripe = self.chunk * self.data_chunks;
        let span = qd * self.piece;
        let (mut writes, mut e) = (0u64, 0usize);
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs_f64(seconds) {
            let mut from = 0;
            while from < stripe {
                let to = (from + span).min(stripe);
                let last = to == stripe;
                match mode {
                    Mode::Copy => self.pass(e, from, to, true),
                    Mode::Direct => self.pass(e, from, to, false),
                    Mode::CopyThenDirect => self.pass(e, from, to, !last),
                    Mode::DirectRmw if from == 0 => self.pass(e, from, to, false),
                    Mode::DirectRmw => self.rmw_pass(e, from, to),
                }
                writes += ((to - from) / self.piece) as u64;
                from = to;
            }
            e = (e + 1) % self.entries.len();
        }
        t0.elapsed().as_nanos() as f64 / writes as f64
    }
}

fn main() -> Result<()> {
    let a = Args::parse();
    let (chunk, piece) = (a.chunk_kib << 10, a.write_kib << 10);
    ensure!(
        piece > 0 && chunk.is_multiple_of(piece) && a.data_chunks >= 2 && a.qd > 0,
        "--write-kib must divide --chunk-kib; at least 2 data chunks; --qd at least 1"
    );
    ensure!(a.entries > 0, "--entries must be at least 1");
    let mut probe = Probe {
        parity: Parity::new(),
        chunk,
        piece,
        data_chunks: a.data_chunks,
        entries: (0..a.entries)
            .map(|_| {
                (0..a.data_chunks + 2)
                    .map(|_| AlignedBuf::zeroed(chunk))
                    .collect()
            })
            .collect(),
        clients: (0..a.qd)
            .map(|i| AlignedBuf::from_slice(&vec![i as u8 | 1; piece]))
            .collect(),
    };
    println!(
        "- {} data chunks of {} KiB, {} KiB writes, {} per pass, {} entries, kernel {:?}\n",
        a.data_chunks,
        a.chunk_kib,
        a.write_kib,
        a.qd,
        a.entries,
        probe.parity.kernel()
    );
    println!("| mode | ns per client write | ÷ copy |\n|---|---:|---:|");
    let copy = probe.run(Mode::Copy, a.seconds, a.qd);
    for (name, mode) in [
        ("copy", Mode::Copy),
        ("direct", Mode::Direct),
        ("copy-then-direct", Mode::CopyThenDirect),
        ("direct-rmw", Mode::DirectRmw),
    ] {
        let ns = if mode == Mode::Copy {
            copy
        } else {
            probe.run(mode, a.seconds, a.qd)
        };
        println!("| {name} | {ns:.1} | {:.2} |", ns / copy);
    }
    Ok(())
}
