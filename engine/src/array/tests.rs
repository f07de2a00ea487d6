//! Unit tests of the array's edges. The model-based test (random concurrent I/O against a
//! reference, every layout, 1/2/4 shards, failures) lives in `tests/tests/model.rs`.

use super::*;
use crate::device::BlockDevice;
use crate::geometry::{Geometry, Layout};
use crate::sim::{Profile, SimClock, SimDevice};

#[test]
fn beyond_redundancy_is_an_error_never_wrong_data() {
    let (mut arr, devs, clock) = sim_array(Level::Raid5, 4, 4096, 512, 8, Profile::fixed(1000));
    devs[0].disappear();
    devs[2].disappear();
    let mut buf = AlignedBuf::zeroed(4096 * 3);
    let status = rw(&mut arr, &clock, 7, ArrayOp::Read, 0, &mut buf);
    assert!(
        matches!(
            status,
            Err(ArrayError::Unrecoverable { .. } | ArrayError::Failed)
        ),
        "{status:?}"
    );
    // Malformed requests complete with a clear error instead of panicking.
    let cap = arr.geometry().capacity_bytes();
    for (off, len, why) in [(100u64, 512usize, "multiple"), (cap, 512, "beyond")] {
        let mut b = AlignedBuf::zeroed(len);
        let status = rw(&mut arr, &clock, 9, ArrayOp::Read, off, &mut b);
        assert!(
            matches!(status, Err(ArrayError::Invalid(m)) if m.contains(why)),
            "{status:?}"
        );
    }
}

/// Drives `arr` until request `tag` completes; returns its status.
fn complete(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    tag: u64,
) -> Result<(), ArrayError> {
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 4];
    for _ in 0..100_000 {
        let progressed = arr.process();
        let n = arr.poll(&mut out);
        if let Some(c) = out[..n].iter().find(|c| c.tag == tag) {
            return c.status;
        }
        if !progressed && n == 0 {
            // Nothing in flight may still mean work waiting for a refusing member: keep
            // turning the loop, as a reactor would.
            if let Some(t) = arr.channels().filter_map(|c| c.next_completion_ns()).min() {
                clock.advance_to(t.max(clock.now_ns()));
            }
        }
    }
    panic!("request {tag} never completed");
}

fn rw(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    tag: u64,
    op: ArrayOp,
    off: u64,
    buf: &mut [u8],
) -> Result<(), ArrayError> {
    // SAFETY: buf outlives the request, which completes before we return.
    let io = unsafe { IoBuf::from_slice(buf) };
    arr.submit(ArrayRequest {
        tag,
        op,
        offset_bytes: off,
        len_bytes: io.len(),
        buf: io,
    })
    .unwrap();
    complete(arr, clock, tag)
}

fn sim_array(
    level: Level,
    n: u16,
    chunk: u64,
    block: u32,
    stripes: u64,
    profile: Profile,
) -> (Array<crate::sim::SimChannel>, Vec<SimDevice>, SimClock) {
    let g = Geometry::new(level, Layout::LeftSymmetric, n, chunk, block).unwrap();
    let geo = ArrayGeometry::new(g, stripes).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..n)
        .map(|i| {
            SimDevice::new(
                &format!("d{i}"),
                stripes * chunk,
                block,
                profile.clone(),
                clock.clone(),
                1,
            )
            .unwrap()
        })
        .collect();
    let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
    (
        Array::new(geo, chans, Parity::new(), ArrayConfig::default()).unwrap(),
        devs,
        clock,
    )
}

/// Chunks larger than a member's largest transfer go out in pieces instead of failing it.
#[test]
fn chunks_larger_than_the_member_transfer_limit_are_split() {
    let (mut arr, _devs, clock) =
        sim_array(Level::Raid5, 3, 2 << 20, 4096, 2, Profile::fixed(1000));
    let mut w = AlignedBuf::zeroed(4 << 20);
    w.iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i * 7) as u8);
    assert_eq!(
        rw(
            &mut arr,
            &clock,
            1,
            ArrayOp::Write { fua: false },
            0,
            &mut w
        ),
        Ok(())
    );
    let mut r = AlignedBuf::zeroed(4 << 20);
    assert_eq!(rw(&mut arr, &clock, 2, ArrayOp::Read, 0, &mut r), Ok(()));
    assert!(r[..] == w[..]);
    assert!(arr.member_states().all(|s| s == MemberState::Online));
}

/// Latent sector errors are rebuilt from redundancy and rewritten; the members stay in.
#[test]
fn latent_sector_errors_are_repaired_not_fatal() {
    let (mut arr, devs, clock) = sim_array(Level::Raid5, 4, 4096, 512, 4, Profile::fixed(1000));
    let cap = arr.geometry().capacity_bytes() as usize;
    let mut w = AlignedBuf::zeroed(cap);
    w.iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i % 251) as u8);
    assert_eq!(
        rw(
            &mut arr,
            &clock,
            1,
            ArrayOp::Write { fua: false },
            0,
            &mut w
        ),
        Ok(())
    );
    let g = *arr.geometry().geometry();
    // One bad sector in stripe 0 on the member of data chunk 0, one in stripe 1 elsewhere.
    let m0 = g.stripe(0).data_member(0);
    let m1 = g.stripe(1).data_member(2);
    assert_ne!(m0, m1);
    devs[usize::from(m0)].add_latent_error(512..1024);
    devs[usize::from(m1)].add_latent_error(4096 + 1024..4096 + 1536);
    for round in 0..2 {
        let mut r = AlignedBuf::zeroed(cap);
        assert_eq!(
            rw(&mut arr, &clock, 10 + round, ArrayOp::Read, 0, &mut r),
            Ok(())
        );
        assert!(r[..] == w[..], "round {round}: data differs");
    }
    assert!(arr.member_states().all(|s| s == MemberState::Online));
    assert_eq!(arr.stats().read_errors_repaired, 2, "{:?}", arr.stats());
}

/// Members that cannot serve the geometry are refused when the array is built.
#[test]
fn unusable_members_are_refused_at_build() {
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 4, 4096, 512).unwrap();
    let geo = ArrayGeometry::new(g, 4).unwrap();
    let clock = SimClock::new();
    let mk = |block: u32, cap: u64| -> Vec<crate::sim::SimChannel> {
        (0..4)
            .map(|i| {
                SimDevice::new(
                    &format!("d{i}"),
                    cap,
                    block,
                    Profile::fixed(1),
                    clock.clone(),
                    1,
                )
                .unwrap()
                .open_channel()
                .unwrap()
            })
            .collect()
    };
    let cfg = |off| ArrayConfig {
        data_offset_bytes: off,
        ..ArrayConfig::default()
    };
    for (chans, off, why) in [
        (mk(512, 1 << 20), 100, "data offset"),
        (mk(4096, 1 << 20), 0, "do not divide"),
        (mk(512, 8192), 0, "less than the data offset plus data area"),
    ] {
        let e = Array::new(geo, chans, Parity::new(), cfg(off))
            .err()
            .expect("refused");
        assert!(e.to_string().contains(why), "{e}");
    }
}

/// Two shards sharing QD1 disks: a channel is often refused because the other shard's
/// channel holds the device's only slot. That is waiting, not a dead member.
#[test]
fn shards_sharing_qd1_members_wait_instead_of_failing_them() {
    use crate::shard::ShardedArray;
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 4096, 512).unwrap();
    let geo = ArrayGeometry::new(g, 16).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..3)
        .map(|i| {
            SimDevice::new(
                &format!("hdd{i}"),
                16 * 4096,
                512,
                Profile::hdd_7200(false),
                clock.clone(),
                i,
            )
            .unwrap()
        })
        .collect();
    let shards = (0..2)
        .map(|_| {
            Array::new(
                geo,
                devs.iter().map(|d| d.open_channel().unwrap()).collect(),
                Parity::new(),
                ArrayConfig::default(),
            )
            .unwrap()
        })
        .collect();
    let mut arr = ShardedArray::new(shards, 64);
    let mut bufs: Vec<AlignedBuf> = (0..16u8)
        .map(|i| AlignedBuf::from_slice(&[i + 1; 8192]))
        .collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        // SAFETY: the buffers outlive their requests and are not touched until completion.
        let io = unsafe { IoBuf::from_slice(b) };
        arr.submit(ArrayRequest {
            tag: i as u64,
            op: ArrayOp::Write { fua: false },
            offset_bytes: i as u64 * 8192,
            len_bytes: 8192,
            buf: io,
        })
        .unwrap();
    }
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    let mut done = 0;
    while done < 16 {
        let progressed = arr.process();
        let n = arr.poll(&mut out);
        for c in &out[..n] {
            let states: Vec<Vec<MemberState>> = arr
                .shards()
                .iter()
                .map(|s| s.member_states().collect())
                .collect();
            assert_eq!(c.status, Ok(()), "request {}: {states:?}", c.tag);
        }
        done += n;
        if !progressed && n == 0 {
            let t = arr
                .shards()
                .iter()
                .flat_map(|s| s.channels())
                .filter_map(|c| c.next_completion_ns())
                .min()
                .expect("I/O pending");
            clock.advance_to(t.max(clock.now_ns()));
        }
    }
    for s in arr.shards() {
        assert!(
            s.member_states().all(|m| m == MemberState::Online),
            "{:?}",
            s.member_states().collect::<Vec<_>>()
        );
    }
}
