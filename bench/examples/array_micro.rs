//! The stripe engine alone, without reactors or load generator threads: one `Array` over
//! five `null` (then `mem`) members, driven in a loop at queue depth 32 with 4 KiB random
//! reads, 20 M reads per device kind. Prints ns per read (wall clock, one pinned thread):
//! the engine's own per-read cost on `null`, plus the member copies on `mem`.
//!
//! ```text
//! cargo run --release -p bench --example array_micro [null]
//! ```

use drivers::mem::MemDevice;
use drivers::null::NullDevice;
use engine::array::{Array, ArrayCompletion, ArrayConfig, ArrayOp, ArrayRequest};
use engine::buf::AlignedBuf;
use engine::device::{BlockDevice, Channel, IoBuf};
use engine::geometry::{Geometry, Layout, Level};
use engine::parity::Parity;

use std::ptr::NonNull;
use std::time::Instant;

fn go<C: Channel>(chans: Vec<C>, label: &str) {
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 5, 64 << 10, 512).unwrap();
    let geo = g.with_members(&[256u64 << 20; 5], 0).unwrap();
    let cap = geo.capacity_bytes();
    let cfg = ArrayConfig {
        requests: 64,
        stripe_ops: 64,
        data_offset_bytes: 0,
        ..ArrayConfig::default()
    };
    let mut a = Array::new(geo, chans, Parity::new(), cfg).unwrap();
    let qd = 32;
    let mut bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::zeroed(4096)).collect();
    let mut free: Vec<usize> = (0..qd).collect();
    let mut x: u64 = 88172645463325252;
    let mut comps = vec![
        ArrayCompletion {
            tag: 0,
            status: Ok(())
        };
        64
    ];
    let t0 = Instant::now();
    let mut n = 0u64;
    let blocks = cap / 4096;
    while n < 20_000_000 {
        a.set_now(t0.elapsed().as_nanos() as u64);
        while let Some(slot) = free.pop() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = (x % blocks) * 4096;
            let b = &mut bufs[slot];
            // SAFETY: buffer `slot` is this loop's and untouched until its read completes
            // (the slot returns to `free` only then).
            let buf = unsafe { IoBuf::from_raw(NonNull::new(b.as_mut_ptr()).unwrap(), 4096, None) };
            a.submit(ArrayRequest {
                tag: slot as u64,
                op: ArrayOp::Read,
                offset_bytes: off,
                len_bytes: 4096,
                buf,
            })
            .unwrap();
        }
        a.process();
        loop {
            let k = a.poll(&mut comps);
            for c in &comps[..k] {
                n += 1;
                free.push(c.tag as usize);
            }
            if k < comps.len() {
                break;
            }
        }
    }
    let dt = t0.elapsed();
    println!(
        "{label}: {:.1} ns/IO, {:.2} M IOPS",
        dt.as_nanos() as f64 / n as f64,
        n as f64 / dt.as_secs_f64() / 1e6
    );
}

/// Five members of `make(name)`, one channel each, through [`go`].
fn members<D: BlockDevice>(label: &str, make: impl Fn(&str) -> D) {
    let devs: Vec<D> = (0..5).map(|i| make(&format!("{label}{i}"))).collect();
    go(
        devs.iter().map(|d| d.open_channel().unwrap()).collect(),
        label,
    );
}

fn main() {
    core_affinity::set_for_current(core_affinity::CoreId { id: 1 });
    members("null", |n| NullDevice::new(n, 256 << 20, 512, 128).unwrap());
    if std::env::args().nth(1).as_deref() != Some("null") {
        members("mem", |n| MemDevice::new(n, 256 << 20, 512, 128).unwrap());
    }
}
