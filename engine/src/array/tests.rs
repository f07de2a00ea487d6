//! Unit tests of the array's edges. The model-based test (random concurrent I/O against a
//! reference, every layout, 1/2/4 shards, failures) lives in `tests/tests/model.rs`.

use super::*;
use crate::device::BlockDevice;
use crate::geometry::{Geometry, Layout, Level};
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

/// Drives `arr` until every request in `tags` completes; returns their statuses in order.
pub(super) fn complete_all(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    tags: &[u64],
) -> Vec<Result<(), ArrayError>> {
    let mut got: Vec<Option<Result<(), ArrayError>>> = vec![None; tags.len()];
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    for _ in 0..200_000 {
        arr.set_now(clock.now_ns());
        let progressed = arr.process();
        let n = arr.poll(&mut out);
        for c in &out[..n] {
            if let Some(i) = tags.iter().position(|&t| t == c.tag) {
                got[i] = Some(c.status);
            }
        }
        if got.iter().all(Option::is_some) {
            return got.into_iter().map(Option::unwrap).collect();
        }
        if !progressed && n == 0 {
            let next = arr
                .channels()
                .filter_map(|c| c.next_completion_ns())
                .chain(arr.next_deadline_ns())
                .min();
            if let Some(t) = next {
                clock.advance_to(t.max(clock.now_ns()));
            }
        }
    }
    panic!("requests {tags:?} never completed: {got:?}");
}

/// Drives `arr` until request `tag` completes; returns its status.
fn complete(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    tag: u64,
) -> Result<(), ArrayError> {
    complete_all(arr, clock, &[tag])[0]
}

fn rw(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    tag: u64,
    op: ArrayOp,
    off: u64,
    buf: &mut [u8],
) -> Result<(), ArrayError> {
    // The buffer outlives the request, which completes before we return.
    submit_at(arr, tag, op, off, buf);
    complete(arr, clock, tag)
}

/// Reads `want.len()` bytes of the array from byte 0 (tag `tag`) and asserts that the read
/// succeeds and returns `want`; `what` names the check in a failure.
fn assert_reads_back(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    tag: u64,
    want: &[u8],
    what: &str,
) {
    let mut got = AlignedBuf::zeroed(want.len());
    assert_eq!(
        rw(arr, clock, tag, ArrayOp::Read, 0, &mut got),
        Ok(()),
        "{what}"
    );
    assert!(got[..] == want[..], "{what}");
}

/// Writes the whole array with `pattern(byte offset)` (tag 1) and returns what it wrote.
fn fill_array(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    pattern: impl Fn(usize) -> u8,
) -> AlignedBuf {
    let cap = arr.geometry().capacity_bytes() as usize;
    let mut data = AlignedBuf::zeroed(cap);
    for (i, b) in data.iter_mut().enumerate() {
        *b = pattern(i);
    }
    assert_eq!(
        rw(arr, clock, 1, ArrayOp::Write { fua: false }, 0, &mut data),
        Ok(())
    );
    data
}

fn sim_array(
    level: Level,
    n: u16,
    chunk: u64,
    block: u32,
    stripes: u64,
    profile: Profile,
) -> (Array<crate::sim::SimChannel>, Vec<SimDevice>, SimClock) {
    sim_array_with(
        level,
        n,
        chunk,
        block,
        stripes,
        profile,
        ArrayConfig::default(),
    )
}

/// [`sim_array`] with the array configured by `cfg`.
fn sim_array_with(
    level: Level,
    n: u16,
    chunk: u64,
    block: u32,
    stripes: u64,
    profile: Profile,
    cfg: ArrayConfig,
) -> (Array<crate::sim::SimChannel>, Vec<SimDevice>, SimClock) {
    let g = Geometry::new(level, Layout::LeftSymmetric, n, chunk, block).unwrap();
    sim_array_of(g, stripes, |_| (profile.clone(), 1), cfg)
}

/// An array of geometry `g` and `stripes` stripes over fresh simulated devices, member `i`
/// with the profile and fault seed `device(i)` gives, configured by `cfg`.
pub(super) fn sim_array_of(
    g: Geometry,
    stripes: u64,
    device: impl Fn(u16) -> (Profile, u64),
    cfg: ArrayConfig,
) -> (Array<crate::sim::SimChannel>, Vec<SimDevice>, SimClock) {
    let geo = ArrayGeometry::new(g, stripes).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..g.members())
        .map(|i| {
            let (profile, seed) = device(i);
            SimDevice::new(
                &format!("d{i}"),
                stripes * u64::from(g.chunk_bytes()),
                g.block_bytes(),
                profile,
                clock.clone(),
                seed,
            )
            .unwrap()
        })
        .collect();
    let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
    (
        Array::new(geo, chans, Parity::new(), cfg).unwrap(),
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
    let w = fill_array(&mut arr, &clock, |i| (i % 251) as u8);
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

/// A member whose command never completes is failed after the command timeout, the
/// command aborted, and the request served from redundancy; a member that keeps its queue
/// full forever (every command hung, later ones refused) is failed the same way.
#[test]
fn hung_member_commands_time_out_and_fail_the_member() {
    use crate::sim::{Fault, FaultRule, OpFilter};
    for depth in [1024u32, 1] {
        let mut profile = Profile::fixed(1000);
        profile.queue_depth = depth;
        let (mut arr, devs, clock) = sim_array(Level::Raid6, 5, 4096, 512, 8, profile);
        let cap = arr.geometry().capacity_bytes();
        let mut data = fill_array(&mut arr, &clock, |i| (i * 7 + 3) as u8);
        devs[2].add_fault(FaultRule {
            filter: OpFilter::Any,
            range: None,
            fault: Fault::Hang,
            probability: 1.0,
            count: None,
        });
        let t0 = clock.now_ns();
        // Several requests at once, so with queue depth 1 the later ones wait in the
        // array's overflow queue behind the hung one.
        let mut bufs: Vec<AlignedBuf> = (0..4)
            .map(|_| AlignedBuf::zeroed(cap as usize / 4))
            .collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            // SAFETY: the buffers outlive the requests, which complete below.
            let io = unsafe { IoBuf::from_slice(b) };
            arr.submit(ArrayRequest {
                tag: 10 + i as u64,
                op: ArrayOp::Read,
                offset_bytes: i as u64 * cap / 4,
                len_bytes: io.len(),
                buf: io,
            })
            .unwrap();
        }
        assert_eq!(
            complete_all(&mut arr, &clock, &[10, 11, 12, 13]),
            vec![Ok(()); 4],
            "depth {depth}"
        );
        for (i, b) in bufs.iter().enumerate() {
            let at = i * cap as usize / 4;
            assert!(
                b[..] == data[at..at + b.len()],
                "depth {depth}: read {i} differs"
            );
        }
        let waited = clock.now_ns() - t0;
        assert!(
            (DEFAULT_IO_TIMEOUT_NS..2 * DEFAULT_IO_TIMEOUT_NS).contains(&waited),
            "depth {depth}: the reads took {waited} ns"
        );
        assert_eq!(
            arr.member_states().nth(2),
            Some(MemberState::Failed(IoError::Timeout))
        );
        assert!(arr.stats().timeouts >= 1);
        // Writes go on degraded, and the member is not touched again.
        assert_eq!(
            rw(
                &mut arr,
                &clock,
                20,
                ArrayOp::Write { fua: true },
                0,
                &mut data
            ),
            Ok(())
        );
        assert!(!arr.busy());
    }
}

/// A command deadline that passes between two timeout scans (`check_timeouts` scans at
/// most every 1/16 of the timeout) is reported as the next scan, not as a time already
/// past: an executor that waits for `next_deadline_ns` with nothing else to do must not
/// wake to no work (a reactor would spin until the scan, a virtual clock would stop). Then
/// the timeout fires at that scan and the read is served from redundancy.
#[test]
fn a_deadline_between_timeout_scans_is_reported_as_the_next_scan() {
    use crate::sim::{Fault, FaultRule, OpFilter};
    let (mut arr, devs, clock) = sim_array(Level::Raid5, 4, 4096, 512, 8, Profile::fixed(1000));
    let data = fill_array(&mut arr, &clock, |i| (i * 5 + 1) as u8);
    let member = arr.geometry().geometry().stripe(0).data_member(0);
    devs[usize::from(member)].add_fault(FaultRule {
        filter: OpFilter::Read,
        range: None,
        fault: Fault::Hang,
        probability: 1.0,
        count: Some(1),
    });
    let mut buf = AlignedBuf::zeroed(4096);
    // SAFETY: the buffer outlives the request, which completes below.
    let io = unsafe { IoBuf::from_slice(&mut buf) };
    arr.set_now(clock.now_ns());
    let t0 = clock.now_ns();
    arr.submit(ArrayRequest {
        tag: 7,
        op: ArrayOp::Read,
        offset_bytes: 0,
        len_bytes: 4096,
        buf: io,
    })
    .unwrap();
    arr.process();
    let deadline = t0 + DEFAULT_IO_TIMEOUT_NS;
    // A scan just before the deadline (other work kept the executor turning).
    clock.advance_to(deadline - 1000);
    arr.set_now(clock.now_ns());
    arr.process();
    clock.advance_to(deadline);
    arr.set_now(clock.now_ns());
    let progressed = arr.process();
    let next = arr.next_deadline_ns().expect("a command is outstanding");
    assert!(
        progressed || next > clock.now_ns(),
        "idle at {} with the next deadline at {next}",
        clock.now_ns()
    );
    assert_eq!(complete(&mut arr, &clock, 7), Ok(()));
    assert!(buf[..] == data[..4096]);
    assert_eq!(
        arr.member_states().nth(usize::from(member)),
        Some(MemberState::Failed(IoError::Timeout))
    );
    assert!(clock.now_ns() - t0 < DEFAULT_IO_TIMEOUT_NS + DEFAULT_IO_TIMEOUT_NS / 16 + 1);
}

/// The zero map (block status) follows the array's contents: a whole-stripe write-zeroes
/// (with or without FUA) or discard marks its stripes zero once complete, any write to a
/// stripe marks it data as it starts. Every stripe the map calls zero reads as zeroes.
#[test]
fn the_zero_map_follows_zeroing_and_writes() {
    let (mut arr, _devs, clock) = sim_array(Level::Raid6, 6, 4096, 512, 16, Profile::fixed(1000));
    let geo = *arr.geometry();
    let map = Arc::new(ZeroMap::new(&geo));
    arr.set_zero_map(Arc::clone(&map));
    let stripe = geo.geometry().stripe_data_bytes();
    fill_array(&mut arr, &clock, |i| (i % 251) as u8 | 1);
    assert_eq!(map.zero_stripes(), 0);
    let op =
        |arr: &mut Array<crate::sim::SimChannel>, tag: u64, op: ArrayOp, off: u64, len: u64| {
            submit_dataless(arr, tag, op, off, len);
            assert_eq!(complete(arr, &clock, tag), Ok(()));
        };
    op(
        &mut arr,
        1,
        ArrayOp::WriteZeroes { fua: false },
        2 * stripe,
        2 * stripe,
    );
    op(&mut arr, 2, ArrayOp::Discard, 7 * stripe - 512, 3 * stripe);
    op(
        &mut arr,
        3,
        ArrayOp::WriteZeroes { fua: true },
        12 * stripe,
        stripe,
    );
    let zero: Vec<u64> = (0..geo.stripes()).filter(|&s| map.is_zero(s)).collect();
    assert_eq!(zero, vec![2, 3, 7, 8, 12]);
    // A 512-byte write into stripe 3 makes it data; the rest stays zero.
    let mut b = AlignedBuf::zeroed(512);
    b.fill(7);
    let wr = rw(
        &mut arr,
        &clock,
        4,
        ArrayOp::Write { fua: false },
        3 * stripe + 4096,
        &mut b,
    );
    assert_eq!(wr, Ok(()));
    let zero: Vec<u64> = (0..geo.stripes()).filter(|&s| map.is_zero(s)).collect();
    assert_eq!(zero, vec![2, 7, 8, 12]);
    let mut runs = Vec::new();
    map.extents(2 * stripe, 8 * stripe, |len, z| {
        runs.push((len / stripe, z));
        true
    });
    assert_eq!(runs, vec![(1, true), (4, false), (2, true), (1, false)]);
    // What the map calls zero reads as zeroes.
    for s in zero {
        let mut got = AlignedBuf::zeroed(stripe as usize);
        got.fill(0xee);
        let rd = rw(
            &mut arr,
            &clock,
            10 + s,
            ArrayOp::Read,
            s * stripe,
            &mut got,
        );
        assert_eq!(rd, Ok(()));
        assert!(got.iter().all(|&x| x == 0), "stripe {s}");
    }
}

/// A FUA write-zeroes of a whole stripe zeroes it natively (member write-zeroes carry no
/// FUA bit) and then flushes every member with a volatile cache before it completes: at
/// its completion nothing it wrote sits in a member's cache. Without FUA no flush is sent.
#[test]
fn a_fua_whole_stripe_write_zeroes_is_flushed_before_it_completes() {
    let profile = Profile {
        write_cache_latency_ns: Some(200),
        ..Profile::fixed(1000)
    };
    let (mut arr, devs, clock) = sim_array(Level::Raid6, 6, 4096, 512, 16, profile);
    let stripe = arr.geometry().geometry().stripe_data_bytes();
    fill_array(&mut arr, &clock, |i| (i % 251) as u8 | 1);
    let flushes = |arr: &Array<crate::sim::SimChannel>| -> Vec<u64> {
        (0..6).map(|m| arr.member_counters(m).flushes).collect()
    };
    let zeroes = |arr: &mut Array<crate::sim::SimChannel>, tag: u64, fua: bool, st: u64| {
        submit_dataless(arr, tag, ArrayOp::WriteZeroes { fua }, st * stripe, stripe);
        assert_eq!(complete(arr, &clock, tag), Ok(()));
    };
    let before = flushes(&arr);
    zeroes(&mut arr, 2, false, 3);
    assert_eq!(flushes(&arr), before, "no FUA: no flush");
    assert!(devs.iter().any(|d| d.volatile_bytes() > 0));
    let zeroed = arr.stats().zeroed_stripes;
    zeroes(&mut arr, 3, true, 5);
    assert_eq!(arr.stats().zeroed_stripes, zeroed + 1, "zeroed natively");
    let after = flushes(&arr);
    assert!(
        before.iter().zip(&after).all(|(b, a)| a == &(b + 1)),
        "one flush per member: {before:?} -> {after:?}"
    );
    for (i, d) in devs.iter().enumerate() {
        assert_eq!(d.volatile_bytes(), 0, "member {i}: something left volatile");
    }
    let mut got = AlignedBuf::zeroed(stripe as usize);
    got.fill(0xee);
    assert_eq!(
        rw(&mut arr, &clock, 4, ArrayOp::Read, 5 * stripe, &mut got),
        Ok(())
    );
    assert!(got.iter().all(|&x| x == 0));
}

/// Write-zeroes zeroes whole stripes natively and partial ones by RMW/RCW from the zero
/// buffer; discard deallocates whole stripes only. Parity stays right either way: the
/// data survives the loss of two members afterwards.
#[test]
fn write_zeroes_and_discard_keep_parity_consistent() {
    let (mut arr, devs, clock) = sim_array(Level::Raid6, 6, 4096, 512, 16, Profile::fixed(1000));
    let stripe = arr.geometry().geometry().stripe_data_bytes() as usize;
    let data = fill_array(&mut arr, &clock, |i| (i % 251) as u8 | 1);
    let mut want = data.to_vec();
    let ops = [
        // (op, offset, len)
        (
            ArrayOp::WriteZeroes { fua: false },
            512u64,
            2 * stripe as u32,
        ),
        (
            ArrayOp::WriteZeroes { fua: true },
            5 * stripe as u64,
            stripe as u32,
        ),
        (
            ArrayOp::Discard,
            7 * stripe as u64 + 1024,
            3 * stripe as u32,
        ),
        (ArrayOp::Discard, 12 * stripe as u64 + 512, 4096),
    ];
    for (i, &(op, off, len)) in ops.iter().enumerate() {
        submit_dataless(&mut arr, 100 + i as u64, op, off, u64::from(len));
        assert_eq!(complete(&mut arr, &clock, 100 + i as u64), Ok(()));
        let (o, l) = (off as usize, len as usize);
        match op {
            ArrayOp::Discard => {
                let first = o.div_ceil(stripe) * stripe;
                let last = (o + l) / stripe * stripe;
                if first < last {
                    want[first..last].fill(0);
                }
            }
            _ => want[o..o + l].fill(0),
        }
    }
    let st = arr.stats();
    assert!(
        st.zeroed_stripes >= 1 && st.discarded_stripes == 2 && st.discards_skipped >= 2,
        "{st:?}"
    );
    assert!(
        st.rmw_writes + st.rcw_writes >= 2,
        "partial zeroing goes through the write path: {st:?}"
    );
    // Buffers are refused on bufferless ops, and missing ones on data ops.
    let mut b = AlignedBuf::zeroed(512);
    let status = rw(&mut arr, &clock, 7, ArrayOp::Discard, 0, &mut b);
    assert!(matches!(status, Err(ArrayError::Invalid(_))), "{status:?}");
    devs[0].disappear();
    devs[3].disappear();
    assert_reads_back(
        &mut arr,
        &clock,
        200,
        &want,
        "data differs after losing two members",
    );
}

/// A full-stripe write generates its P (and Q) into its stripe operation's first chunk
/// buffers whichever members they rotate onto (`Array::parity_buf`), and many run at once:
/// every stripe written whole, healthy or with a member already missing, reads back after
/// losing as many members as the parity covers — pairs chosen so that each stripe loses
/// two data chunks, a data chunk and P, a data chunk and Q, or P and Q somewhere.
#[test]
fn full_stripe_writes_leave_the_right_parity_on_every_member() {
    let cases: [(Level, u16, &[u16], &[u16]); 9] = [
        (Level::Raid5, 4, &[], &[0]),
        (Level::Raid5, 4, &[], &[1]),
        (Level::Raid5, 4, &[], &[3]),
        (Level::Raid5, 4, &[2], &[]),
        (Level::Raid6, 6, &[], &[0, 1]),
        (Level::Raid6, 6, &[], &[1, 4]),
        (Level::Raid6, 6, &[], &[2, 5]),
        (Level::Raid6, 6, &[3], &[0]),
        (Level::Raid6, 6, &[0, 5], &[]),
    ];
    for (level, n, before, after) in cases {
        let (mut arr, devs, clock) = sim_array(level, n, 4096, 512, 24, Profile::fixed(1000));
        for &m in before {
            devs[usize::from(m)].disappear();
        }
        let data = fill_array(&mut arr, &clock, |i| {
            (i.wrapping_mul(31) % 251) as u8 ^ 0x5a
        });
        let st = arr.stats();
        assert!(
            st.full_stripe_writes + st.degraded_writes >= 24 && st.full_stripe_writes > 0,
            "{level:?} {before:?}: {st:?}"
        );
        for &m in after {
            devs[usize::from(m)].disappear();
        }
        assert_reads_back(
            &mut arr,
            &clock,
            2,
            &data,
            &format!("{level:?} lost {before:?} then {after:?}: read-back differs"),
        );
    }
}

/// A device whose native write-zeroes fails as unsupported at run time (a loop device over
/// tmpfs) does not fail the member: the stripe is rewritten from the zero buffer.
#[test]
fn unsupported_native_zeroing_falls_back_to_writes() {
    use crate::sim::{Fault, FaultRule, OpFilter};
    let (mut arr, devs, clock) = sim_array(Level::Raid5, 4, 4096, 512, 4, Profile::fixed(1000));
    let cap = arr.geometry().capacity_bytes() as usize;
    fill_array(&mut arr, &clock, |_| 0xa5);
    devs[1].add_fault(FaultRule {
        filter: OpFilter::Write,
        range: None,
        fault: Fault::Error(IoError::Unsupported),
        probability: 1.0,
        count: Some(1),
    });
    submit_dataless(
        &mut arr,
        2,
        ArrayOp::WriteZeroes { fua: false },
        0,
        cap as u64,
    );
    assert_eq!(complete(&mut arr, &clock, 2), Ok(()));
    assert!(arr.member_states().all(|m| m == MemberState::Online));
    devs[3].disappear();
    let mut got = AlignedBuf::zeroed(cap);
    assert_eq!(rw(&mut arr, &clock, 3, ArrayOp::Read, 0, &mut got), Ok(()));
    assert!(got.iter().all(|&b| b == 0));
}

/// A flush goes only to members written since this shard last flushed them: a write that
/// completed before it arrived is covered, one still in flight when it is sent makes the
/// next flush cover its members.
#[test]
fn flush_goes_to_members_written_since_their_last_flush() {
    let (mut arr, _devs, clock) = sim_array(Level::Raid5, 4, 4096, 512, 8, Profile::fixed(1000));
    let flushes = |arr: &Array<crate::sim::SimChannel>| -> Vec<u64> {
        (0..4).map(|m| arr.member_counters(m).flushes).collect()
    };
    let flush = |arr: &mut Array<crate::sim::SimChannel>, tag: u64| {
        arr.submit(ArrayRequest::flush(tag)).unwrap();
    };
    // The first flush after start flushes every member (earlier writes are unknown).
    flush(&mut arr, 1);
    assert_eq!(complete(&mut arr, &clock, 1), Ok(()));
    assert_eq!(flushes(&arr), [1, 1, 1, 1]);
    // Nothing written since: nothing to flush.
    flush(&mut arr, 2);
    assert_eq!(complete(&mut arr, &clock, 2), Ok(()));
    assert_eq!(flushes(&arr), [1, 1, 1, 1]);
    // One block of stripe 0 (data member 0, parity on member 3 in left-symmetric): only
    // those two are flushed.
    let mut small = AlignedBuf::zeroed(512);
    small.fill(7);
    let w = ArrayOp::Write { fua: false };
    assert_eq!(rw(&mut arr, &clock, 3, w, 0, &mut small), Ok(()));
    flush(&mut arr, 4);
    assert_eq!(complete(&mut arr, &clock, 4), Ok(()));
    assert_eq!(flushes(&arr), [2, 1, 1, 2]);
    // A full-stripe write still in flight when a flush is sent: that flush need not (and
    // does not) cover it, the next one does, on every member.
    let mut stripe = AlignedBuf::zeroed(3 * 4096);
    stripe.fill(9);
    // SAFETY: `stripe` outlives the request, which completes before the test ends.
    let io = unsafe { IoBuf::from_slice(&mut stripe) };
    arr.submit(ArrayRequest {
        tag: 5,
        op: w,
        offset_bytes: 0,
        len_bytes: io.len(),
        buf: io,
    })
    .unwrap();
    arr.set_now(clock.now_ns());
    arr.process();
    assert!(
        (0..4).all(|m| arr.member_counters(m).writes > 0),
        "the stripe's member writes are in flight"
    );
    flush(&mut arr, 6);
    assert_eq!(complete_all(&mut arr, &clock, &[6, 5]), [Ok(()), Ok(())]);
    assert_eq!(flushes(&arr), [2, 1, 1, 2]);
    flush(&mut arr, 7);
    assert_eq!(complete(&mut arr, &clock, 7), Ok(()));
    assert_eq!(flushes(&arr), [3, 2, 2, 3]);
    // A flush arriving while another is still in flight on a device sends its own there:
    // the first may be answered before the second's writes are durable.
    assert_eq!(rw(&mut arr, &clock, 8, w, 0, &mut small), Ok(()));
    flush(&mut arr, 9);
    arr.set_now(clock.now_ns());
    arr.process();
    assert_eq!(
        flushes(&arr),
        [4, 2, 2, 4],
        "flush 9 in flight on members 0 and 3"
    );
    flush(&mut arr, 10);
    arr.set_now(clock.now_ns());
    arr.process();
    assert_eq!(flushes(&arr), [5, 2, 2, 5], "flush 10 sent its own");
    assert_eq!(complete_all(&mut arr, &clock, &[9, 10]), [Ok(()), Ok(())]);
    // Nothing written or in flight any more: nothing to flush.
    flush(&mut arr, 11);
    assert_eq!(complete(&mut arr, &clock, 11), Ok(()));
    assert_eq!(flushes(&arr), [5, 2, 2, 5]);
}

/// The hold bound: the configured floor until a write latency is known, then 3 × the
/// shard's write latency (a weighted mean), never below the floor nor above 10 ms.
#[test]
fn hold_bound_scales_with_write_latency_between_floor_and_cap() {
    let (mut arr, _devs, _clock) = sim_array(Level::Raid5, 4, 4096, 512, 8, Profile::fixed(1000));
    assert_eq!(arr.hold_bound_ns(), DEFAULT_WRITE_HOLD_NS);
    arr.note_write_latency(1_000_000);
    assert_eq!(arr.hold_bound_ns(), 3_000_000);
    // A weighted mean: one slow write moves it by a sixteenth of the difference.
    arr.note_write_latency(17_000_000);
    assert_eq!(arr.hold_bound_ns(), 3 * 2_000_000);
    for _ in 0..200 {
        arr.note_write_latency(50_000_000);
    }
    assert_eq!(arr.hold_bound_ns(), pass::MAX_HOLD_NS);
    for _ in 0..400 {
        arr.note_write_latency(10_000);
    }
    assert_eq!(arr.hold_bound_ns(), DEFAULT_WRITE_HOLD_NS, "the floor");
    arr.write_hold_ns = 20_000_000;
    assert_eq!(
        arr.hold_bound_ns(),
        20_000_000,
        "a floor above the cap wins"
    );
}

/// Submits `op` over `buf` at `off` with `tag` and returns at once (the caller drives).
pub(super) fn submit_at(
    arr: &mut Array<crate::sim::SimChannel>,
    tag: u64,
    op: ArrayOp,
    off: u64,
    buf: &mut [u8],
) {
    // SAFETY: every caller keeps `buf` alive until the request's completion is polled.
    let io = unsafe { IoBuf::from_slice(buf) };
    // A compare-and-write's buffer holds its verify data, then its write data.
    let len_bytes = if matches!(op, ArrayOp::CompareAndWrite { .. }) {
        io.len() / 2
    } else {
        io.len()
    };
    arr.submit(ArrayRequest {
        tag,
        op,
        offset_bytes: off,
        len_bytes,
        buf: io,
    })
    .unwrap();
}

/// Submits a request that carries no data (write-zeroes, discard, flush: `off`/`len` 0,
/// 0) of `len` array bytes at `off`.
pub(super) fn submit_dataless(
    arr: &mut Array<crate::sim::SimChannel>,
    tag: u64,
    op: ArrayOp,
    off: u64,
    len: u64,
) {
    arr.submit(ArrayRequest {
        tag,
        op,
        offset_bytes: off,
        len_bytes: u32::try_from(len).expect("test request length"),
        buf: IoBuf::NONE,
    })
    .unwrap();
}

/// Runs the array's work at the current sim time (no device completes) and returns the
/// tags completed.
fn turn(arr: &mut Array<crate::sim::SimChannel>, clock: &SimClock) -> Vec<u64> {
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 8];
    arr.set_now(clock.now_ns());
    let mut tags = Vec::new();
    while arr.process() {}
    let n = arr.poll(&mut out);
    for c in &out[..n] {
        assert_eq!(c.status, Ok(()), "tag {}", c.tag);
        tags.push(c.tag);
    }
    tags
}

/// Submits a read of `r` at `at` (tag `tags.0`), then a write of `w` over the same bytes
/// (tag `tags.1`); checks that the write waits for the read (`what` names the case in the
/// message), and drives both to completion, returning their statuses in that order.
fn read_then_write_behind_it(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    tags: (u64, u64),
    at: u64,
    r: &mut [u8],
    w: &mut [u8],
    what: &str,
) -> Vec<Result<(), ArrayError>> {
    arr.set_now(clock.now_ns());
    submit_at(arr, tags.0, ArrayOp::Read, at, r);
    submit_at(arr, tags.1, ArrayOp::Write { fua: false }, at, w);
    assert!(turn(arr, clock).is_empty());
    assert_eq!(arr.waiting.len(), 1, "{what}: the write waits for the read");
    complete_all(arr, clock, &[tags.0, tags.1])
}

/// Advances the sim until some operation's phase satisfies `phase` (no request may
/// complete meanwhile).
pub(super) fn run_until(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    phase: impl Fn(Phase) -> bool,
) {
    for _ in 0..10_000 {
        let done = turn(arr, clock);
        assert!(done.is_empty(), "{done:?} completed before the phase");
        let live = |i: usize| !arr.free_sops.contains(&(i as u32));
        if arr
            .sops
            .iter()
            .enumerate()
            .any(|(i, o)| live(i) && phase(o.phase))
        {
            return;
        }
        let next = arr
            .channels()
            .filter_map(|c| c.next_completion_ns())
            .chain(arr.next_deadline_ns())
            .min();
        clock.advance_to(next.expect("member I/O in flight").max(clock.now_ns()));
    }
    panic!("no operation reached the phase");
}

/// Issue 24: a read of a stripe whose write pass has its new data in memory is served from
/// that data at once — the new bytes, never part of the pass — while a read of blocks the
/// pass neither writes nor holds waits for the pass and reads the members after it.
#[test]
fn reads_of_a_stripe_being_written_are_served_from_the_pass() {
    for level in [Level::Raid5, Level::Raid6] {
        let n = if level == Level::Raid5 { 4 } else { 5 };
        let chunk = 16u64 << 10;
        let (mut arr, _devs, clock) = sim_array(level, n, chunk, 512, 4, Profile::fixed(10_000));
        let old = fill_array(&mut arr, &clock, |i| (i * 13 + 5) as u8);
        let stripe = chunk * 3; // data bytes of one stripe (3 data chunks either way)
                                // A full-stripe write of stripe 1 (written from the caller's buffer), its member
                                // writes in flight.
        let mut new = AlignedBuf::zeroed(stripe as usize);
        new.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 7 + 1) as u8);
        submit_at(&mut arr, 2, ArrayOp::Write { fua: false }, stripe, &mut new);
        assert!(turn(&mut arr, &clock).is_empty());
        // A 4 KiB read inside it, and one across the end of chunk 0 into chunk 1: served
        // in the same turn, with the new bytes, the write still in flight.
        let mut r1 = AlignedBuf::zeroed(4096);
        let mut r2 = AlignedBuf::zeroed(8192);
        submit_at(&mut arr, 3, ArrayOp::Read, stripe + 4096, &mut r1);
        submit_at(&mut arr, 4, ArrayOp::Read, stripe + chunk - 4096, &mut r2);
        let done = turn(&mut arr, &clock);
        assert_eq!(done, vec![3, 4], "{level:?}: the reads waited for the pass");
        assert_eq!(&r1[..], &new[4096..8192]);
        assert_eq!(
            &r2[..],
            &new[(chunk - 4096) as usize..(chunk + 4096) as usize]
        );
        assert_eq!(arr.stats().pass_reads, 2);
        assert_eq!(complete(&mut arr, &clock, 2), Ok(()));

        // A 4 KiB write at the start of stripe 2 continues the stream: its pass reads the
        // rest of the stripe into its cache entry (stream prefetch) and writes RCW. A read
        // of the written block and one of another chunk are both served from the pass.
        let base = 2 * stripe;
        let mut small = AlignedBuf::zeroed(4096);
        small.fill(0xa5);
        submit_at(&mut arr, 5, ArrayOp::Write { fua: false }, base, &mut small);
        run_until(&mut arr, &clock, |p| p == Phase::PassWrite);
        let mut r5 = AlignedBuf::zeroed(4096);
        let mut r6 = AlignedBuf::zeroed(4096);
        submit_at(&mut arr, 6, ArrayOp::Read, base, &mut r5);
        submit_at(&mut arr, 7, ArrayOp::Read, base + chunk, &mut r6);
        assert_eq!(turn(&mut arr, &clock), vec![6, 7]);
        assert_eq!(&r5[..], &small[..]);
        let at = (base + chunk) as usize;
        assert_eq!(&r6[..], &old[at..at + 4096]);
        assert_eq!(arr.stats().pass_reads, 4);
        assert_eq!(complete(&mut arr, &clock, 5), Ok(()));

        // A random 4 KiB write into stripe 3 (no stream, nothing cached: the
        // single-operation path), still reading for its parity: a read inside it is
        // served from the caller's data; a read of another chunk, which nothing in memory
        // holds, waits for the write and then reads the members.
        let base3 = 3 * stripe + 8192;
        let mut rnd = AlignedBuf::zeroed(4096);
        rnd.fill(0x3c);
        submit_at(&mut arr, 9, ArrayOp::Write { fua: false }, base3, &mut rnd);
        run_until(&mut arr, &clock, |p| matches!(p, Phase::WriteRead(_)));
        let mut r10 = AlignedBuf::zeroed(2048);
        let mut r11 = AlignedBuf::zeroed(4096);
        submit_at(&mut arr, 10, ArrayOp::Read, base3 + 1024, &mut r10);
        submit_at(&mut arr, 11, ArrayOp::Read, 3 * stripe + chunk, &mut r11);
        assert_eq!(turn(&mut arr, &clock), vec![10]);
        assert_eq!(&r10[..], &rnd[1024..3072]);
        assert_eq!(arr.stats().pass_reads, 5);
        assert_eq!(
            complete_all(&mut arr, &clock, &[9, 11]),
            vec![Ok(()), Ok(())]
        );
        let at = (3 * stripe + chunk) as usize;
        assert_eq!(&r11[..], &old[at..at + 4096]);
        assert_eq!(
            arr.stats().pass_reads,
            5,
            "the cold read went to the members"
        );

        // Everything reads back as written.
        let cap = arr.geometry().capacity_bytes() as usize;
        let mut all = AlignedBuf::zeroed(cap);
        assert_eq!(rw(&mut arr, &clock, 8, ArrayOp::Read, 0, &mut all), Ok(()));
        let mut want = old.to_vec();
        want[stripe as usize..2 * stripe as usize].copy_from_slice(&new);
        want[base as usize..base as usize + 4096].copy_from_slice(&small);
        want[base3 as usize..base3 as usize + 4096].copy_from_slice(&rnd);
        assert!(all[..] == want[..], "{level:?}: read back differs");
    }
}

/// A compare-and-write buffer: `verify` then `write`.
fn caw_buf(verify: &[u8], write: &[u8]) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(verify.len() + write.len());
    b[..verify.len()].copy_from_slice(verify);
    b[verify.len()..].copy_from_slice(write);
    b
}

/// Compare-and-write (SBC-4 §5.3): a match writes, a mismatch reports the first differing
/// byte and writes nothing — from the members and from the stripe cache, on a healthy and
/// on a degraded array; ranges across a stripe or with a wrong buffer are refused.
#[test]
fn compare_and_write_matches_writes_and_mismatches_report_the_offset() {
    for degraded in [false, true] {
        let (mut arr, devs, clock) =
            sim_array(Level::Raid6, 5, 4096, 512, 16, Profile::fixed(1000));
        let stripe = arr.geometry().geometry().stripe_data_bytes() as usize;
        let mut image = fill_array(&mut arr, &clock, |i| (i % 253) as u8);
        if degraded {
            // Member 1 holds data of stripe 2 (left-symmetric, 5 members).
            devs[1].disappear();
        }
        // Across a chunk boundary of stripe 2: 1 KiB before and after it.
        let off = 2 * stripe + 4096 - 1024;
        let mut tag = 10;
        for round in 0..6u8 {
            let old = image[off..off + 2048].to_vec();
            let new: Vec<u8> = (0..2048).map(|i| (i as u8) ^ round ^ 0x5a).collect();
            // Mismatch at byte k (round 0: the very first byte; later: the second chunk).
            let k = [0usize, 1500, 2047, 1024, 7, 1023][usize::from(round)];
            let mut bad = old.clone();
            bad[k] ^= 0x80;
            let mut b = caw_buf(&bad, &new);
            tag += 1;
            let st = rw(
                &mut arr,
                &clock,
                tag,
                ArrayOp::CompareAndWrite { fua: false },
                off as u64,
                &mut b,
            );
            assert_eq!(
                st,
                Err(ArrayError::Miscompare { offset: k as u32 }),
                "round {round}"
            );
            let mut got = AlignedBuf::zeroed(2048);
            tag += 1;
            assert_eq!(
                rw(&mut arr, &clock, tag, ArrayOp::Read, off as u64, &mut got),
                Ok(())
            );
            assert_eq!(&got[..], &old[..], "a miscompare wrote");
            // Now the right verify data: written.
            let mut b = caw_buf(&old, &new);
            tag += 1;
            let fua = round % 2 == 1;
            let st = rw(
                &mut arr,
                &clock,
                tag,
                ArrayOp::CompareAndWrite { fua },
                off as u64,
                &mut b,
            );
            assert_eq!(st, Ok(()), "round {round}");
            image[off..off + 2048].copy_from_slice(&new);
        }
        let mut got = AlignedBuf::zeroed(image.len());
        tag += 1;
        assert_eq!(
            rw(&mut arr, &clock, tag, ArrayOp::Read, 0, &mut got),
            Ok(())
        );
        assert!(
            got[..] == image[..],
            "degraded={degraded}: read-back differs"
        );
        if !degraded {
            // Later rounds found the stripe in the cache (written by the earlier ones).
            assert!(arr.stats().cache_hit_bytes > 0, "{:?}", arr.stats());
            // Parity is right: the data survives the loss of two members.
            devs[0].disappear();
            devs[3].disappear();
            assert_reads_back(&mut arr, &clock, 99, &image, "rebuilt data differs");
        } else {
            assert!(arr.stats().degraded_reads > 0 || arr.stats().degraded_writes > 0);
        }
        // Refused: across a stripe boundary, and a buffer not twice the range.
        let mut b = AlignedBuf::zeroed(4096);
        let st = rw(
            &mut arr,
            &clock,
            100,
            ArrayOp::CompareAndWrite { fua: false },
            (stripe - 1024) as u64,
            &mut b,
        );
        assert!(
            matches!(st, Err(ArrayError::Invalid(m)) if m.contains("one stripe")),
            "{st:?}"
        );
        let io = unsafe { IoBuf::from_slice(&mut b) };
        arr.submit(ArrayRequest {
            tag: 101,
            op: ArrayOp::CompareAndWrite { fua: false },
            offset_bytes: 0,
            len_bytes: 4096,
            buf: io,
        })
        .unwrap();
        assert!(matches!(
            complete(&mut arr, &clock, 101),
            Err(ArrayError::Invalid(_))
        ));
    }
}

/// A FUA compare-and-write (and OR-write) is durable on the members before it completes;
/// without FUA the members' volatile caches may keep it.
#[test]
fn fua_compare_and_write_and_or_write_are_durable_at_completion() {
    let profile = Profile {
        write_cache_latency_ns: Some(200),
        ..Profile::fixed(1000)
    };
    let (mut arr, devs, clock) = sim_array(Level::Raid5, 4, 4096, 512, 16, profile);
    let image = fill_array(&mut arr, &clock, |i| (i % 7) as u8);
    let flush = |arr: &mut Array<crate::sim::SimChannel>, tag| {
        arr.submit(ArrayRequest::flush(tag)).unwrap();
        assert_eq!(complete(arr, &clock, tag), Ok(()));
    };
    flush(&mut arr, 2);
    assert!(devs.iter().all(|d| d.volatile_bytes() == 0));
    let mut b = caw_buf(&image[512..1024], &[9u8; 512]);
    assert_eq!(
        rw(
            &mut arr,
            &clock,
            3,
            ArrayOp::CompareAndWrite { fua: false },
            512,
            &mut b
        ),
        Ok(())
    );
    assert!(
        devs.iter().any(|d| d.volatile_bytes() > 0),
        "no FUA: cached"
    );
    flush(&mut arr, 4);
    let mut b = caw_buf(&[9u8; 512], &[10u8; 512]);
    assert_eq!(
        rw(
            &mut arr,
            &clock,
            5,
            ArrayOp::CompareAndWrite { fua: true },
            512,
            &mut b
        ),
        Ok(())
    );
    assert!(
        devs.iter().all(|d| d.volatile_bytes() == 0),
        "FUA CAW left data volatile"
    );
    let mut o = AlignedBuf::from_slice(&[0x21u8; 1024]);
    assert_eq!(
        rw(
            &mut arr,
            &clock,
            6,
            ArrayOp::OrWrite { fua: true },
            512,
            &mut o
        ),
        Ok(())
    );
    assert!(
        devs.iter().all(|d| d.volatile_bytes() == 0),
        "FUA OR-write left data volatile"
    );
    let mut got = AlignedBuf::zeroed(1024);
    assert_eq!(
        rw(&mut arr, &clock, 7, ArrayOp::Read, 512, &mut got),
        Ok(())
    );
    assert!(got[..512].iter().all(|&x| x == 10 | 0x21));
    assert!(got[512..]
        .iter()
        .zip(&image[1024..1536])
        .all(|(&g, &i)| g == i | 0x21));
}

/// OR-write (SBC-4 §5.9): old | new over a range spanning stripes, healthy and degraded;
/// parity stays consistent.
#[test]
fn or_write_ors_old_data_across_stripes() {
    for degraded in [false, true] {
        let (mut arr, devs, clock) = sim_array(Level::Raid6, 6, 4096, 512, 8, Profile::fixed(1000));
        let stripe = arr.geometry().geometry().stripe_data_bytes() as usize;
        let mut image = fill_array(&mut arr, &clock, |i| ((i * 13) % 256) as u8 & 0x0f);
        if degraded {
            devs[2].disappear();
        }
        let (off, len) = (stripe - 3072, stripe + 5120);
        let mut b = AlignedBuf::zeroed(len);
        for (i, x) in b.iter_mut().enumerate() {
            *x = ((i * 7) % 256) as u8 & 0xf0 | (i % 3) as u8;
        }
        for (i, x) in b.iter().enumerate() {
            image[off + i] |= x;
        }
        assert_eq!(
            rw(
                &mut arr,
                &clock,
                2,
                ArrayOp::OrWrite { fua: false },
                off as u64,
                &mut b
            ),
            Ok(())
        );
        assert!(
            b[..] == image[off..off + len],
            "the buffer holds what was written"
        );
        assert_reads_back(&mut arr, &clock, 3, &image, &format!("degraded={degraded}"));
        devs[4].disappear();
        if !degraded {
            devs[0].disappear();
        }
        assert_reads_back(
            &mut arr,
            &clock,
            4,
            &image,
            &format!("degraded={degraded}: parity inconsistent"),
        );
    }
}

/// Writes the last data chunk of RAID6 stripe `p - 1` (tag 19), then the four data chunks
/// of stripe `p` as four concurrent chunk writes (tags 20..24) that continue it (one
/// full-stripe pass): the clients' write depth is then 4, and the sequential stream's
/// front is the start of stripe `p + 1`. Returns (offset, data) of every write.
fn prime_stream(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    p: u64,
    chunk: usize,
) -> Vec<(usize, AlignedBuf)> {
    let stripe = 4 * chunk as u64;
    let mut prev = AlignedBuf::zeroed(chunk);
    prev.fill(0x0f + p as u8);
    let at = p * stripe - chunk as u64;
    assert_eq!(
        rw(arr, clock, 19, ArrayOp::Write { fua: false }, at, &mut prev),
        Ok(())
    );
    let mut bufs: Vec<AlignedBuf> = (0..4)
        .map(|i| {
            let mut b = AlignedBuf::zeroed(chunk);
            b.fill(0x10 + p as u8 * 4 + i as u8);
            b
        })
        .collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        let off = p * stripe + (i * chunk) as u64;
        submit_at(arr, 20 + i as u64, ArrayOp::Write { fua: false }, off, b);
    }
    assert_eq!(complete_all(arr, clock, &[20, 21, 22, 23]), vec![Ok(()); 4]);
    let mut out = vec![(at as usize, prev)];
    for (i, b) in bufs.into_iter().enumerate() {
        out.push(((p * stripe) as usize + i * chunk, b));
    }
    out
}

/// A held pass (issue 17) ends with data and parity consistent however its hold ends: the
/// rest of the stripe arrives (one full-stripe pass, nothing read), the hold expires (the
/// pass reads and writes what it has), or a member the pass does not write fails while it
/// is held (the leader goes on degraded, its followers after it).
///
/// The last case is what rules out writing a held pass's data to the members before its
/// parity ("early data writes", docs/BENCHMARKS.md, "Fourth look"): with the first chunk
/// of stripe 6 on its member and P/Q still old, the lost chunk can no longer be rebuilt —
/// that prototype failed this test ("stripes [6] read back wrong with one member lost",
/// RAID6 with a single member lost).
#[test]
fn held_passes_stay_consistent_however_the_hold_ends() {
    let chunk = 16usize << 10;
    let stripe = 4 * chunk;
    let (mut arr, devs, clock) = sim_array(
        Level::Raid6,
        6,
        chunk as u64,
        512,
        8,
        Profile::fixed(10_000),
    );
    let mut want = fill_array(&mut arr, &clock, |i| (i * 13 + 5) as u8).to_vec();
    let mut keep: Vec<AlignedBuf> = Vec::new();
    let put =
        |want: &mut Vec<u8>, off: usize, b: &[u8]| want[off..off + b.len()].copy_from_slice(b);

    // The stream's first chunk of stripe 2 is held.
    for (o, b) in prime_stream(&mut arr, &clock, 1, chunk) {
        put(&mut want, o, &b);
    }
    let s0 = arr.stats();
    let mut w: Vec<AlignedBuf> = (0..4)
        .map(|i| {
            let mut b = AlignedBuf::zeroed(chunk);
            b.fill(0xa0 + i);
            b
        })
        .collect();
    submit_at(
        &mut arr,
        30,
        ArrayOp::Write { fua: false },
        2 * stripe as u64,
        &mut w[0],
    );
    assert!(turn(&mut arr, &clock).is_empty());
    let s1 = arr.stats();
    assert_eq!(s1.held_passes, s0.held_passes + 1, "{s1:?}");
    assert_eq!(s1.write_passes, s0.write_passes, "held, not issued: {s1:?}");
    // The rest of the stripe arrives: one full-stripe pass of the four writes, nothing
    // read, each chunk and P/Q written once.
    let writes_before: u64 = arr.members.iter().map(|m| m.counters.writes).sum();
    for (i, b) in w.iter_mut().enumerate().skip(1) {
        let off = (2 * stripe + i * chunk) as u64;
        submit_at(
            &mut arr,
            30 + i as u64,
            ArrayOp::Write { fua: false },
            off,
            b,
        );
    }
    assert_eq!(
        complete_all(&mut arr, &clock, &[30, 31, 32, 33]),
        vec![Ok(()); 4]
    );
    let s2 = arr.stats();
    assert_eq!(s2.full_stripe_writes, s1.full_stripe_writes + 1, "{s2:?}");
    assert_eq!(s2.write_read_bytes, s1.write_read_bytes, "{s2:?}");
    let writes_after: u64 = arr.members.iter().map(|m| m.counters.writes).sum();
    assert_eq!(writes_after - writes_before, 6, "4 data chunks + P + Q");
    assert_eq!(s2.batched_writes, s1.batched_writes + 4, "{s2:?}");
    for (i, b) in w.iter().enumerate() {
        put(&mut want, 2 * stripe + i * chunk, b);
    }
    keep.extend(w);

    // A hold that expires without the rest of stripe 4: RCW from the other chunks.
    for (o, b) in prime_stream(&mut arr, &clock, 3, chunk) {
        put(&mut want, o, &b);
    }
    let s3 = arr.stats();
    let mut lone = AlignedBuf::zeroed(chunk);
    lone.fill(0xb7);
    submit_at(
        &mut arr,
        40,
        ArrayOp::Write { fua: false },
        4 * stripe as u64,
        &mut lone,
    );
    assert!(turn(&mut arr, &clock).is_empty());
    assert_eq!(arr.stats().held_passes, s3.held_passes + 1);
    assert_eq!(complete(&mut arr, &clock, 40), Ok(()));
    let s4 = arr.stats();
    assert_eq!(s4.expired_holds, s3.expired_holds + 1, "{s4:?}");
    put(&mut want, 4 * stripe, &lone);
    keep.push(lone);

    // A member of stripe 6 that the pass does not write fails while the pass is held.
    for (o, b) in prime_stream(&mut arr, &clock, 5, chunk) {
        put(&mut want, o, &b);
    }
    let s5 = arr.stats();
    let mut early = AlignedBuf::zeroed(chunk);
    early.fill(0xc3);
    submit_at(
        &mut arr,
        50,
        ArrayOp::Write { fua: false },
        6 * stripe as u64,
        &mut early,
    );
    assert!(turn(&mut arr, &clock).is_empty());
    assert_eq!(arr.stats().held_passes, s5.held_passes + 1);
    let lost = arr.geo.stripe(6).data_member(2);
    arr.fail_member_by_operator(lost);
    assert_eq!(complete(&mut arr, &clock, 50), Ok(()));
    put(&mut want, 6 * stripe, &early);
    keep.push(early);

    // Everything reads back as written, with the failed member, and with one more lost
    // (parity consistent everywhere).
    let cap = arr.geometry().capacity_bytes() as usize;
    let mut all = AlignedBuf::zeroed(cap);
    assert_eq!(rw(&mut arr, &clock, 60, ArrayOp::Read, 0, &mut all), Ok(()));
    let bad: Vec<usize> = (0..8)
        .filter(|s| all[s * stripe..(s + 1) * stripe] != want[s * stripe..(s + 1) * stripe])
        .collect();
    assert!(
        bad.is_empty(),
        "stripes {bad:?} read back wrong with one member lost"
    );
    let other = (0..6u16).find(|&m| m != lost).unwrap();
    devs[usize::from(other)].disappear();
    let mut all = AlignedBuf::zeroed(cap);
    assert_eq!(rw(&mut arr, &clock, 61, ArrayOp::Read, 0, &mut all), Ok(()));
    for s in 0..8 {
        let r = s * stripe..(s + 1) * stripe;
        assert!(
            all[r.clone()] == want[r],
            "stripe {s} differs with two members lost"
        );
    }
}

/// Queue waits count every request that issued member I/O: a read issued in the turn that
/// accepted it (0 ns by the turn's clock, kept as a counter) as 1 ns, a read the array
/// first saw a turn later with the time between.
#[test]
fn queue_wait_counts_same_turn_requests_and_times_later_ones() {
    let (mut arr, _devs, clock) = sim_array(Level::Raid5, 4, 4096, 512, 8, Profile::fixed(1000));
    let small = RequestClass::SmallRead;
    let mut a = AlignedBuf::zeroed(4096);
    let mut b = AlignedBuf::zeroed(4096);
    // Issued in the same turn.
    arr.set_now(clock.now_ns());
    assert_eq!(rw(&mut arr, &clock, 2, ArrayOp::Read, 0, &mut a), Ok(()));
    // Accepted now, issued 5 µs later: a read across a chunk boundary (two member
    // reads) takes a stripe operation, which `process` issues (a read inside one chunk
    // would go out at submission, on the fast path).
    arr.set_now(clock.now_ns());
    submit_at(&mut arr, 3, ArrayOp::Read, 6144, &mut b);
    clock.advance_by(5_000);
    assert_eq!(complete(&mut arr, &clock, 3), Ok(()));
    let w = arr.queue_wait(small);
    assert_eq!(w.len(), 2, "both reads counted");
    assert_eq!(w.min(), 1, "the same-turn read as 1 ns");
    assert!(
        w.equivalent(w.max(), 5_000),
        "the later one: {} ns",
        w.max()
    );
    // The reactor's copy is the same histogram, and fills without growing.
    let mut out = new_latency_histogram();
    out.saturating_record(77);
    arr.queue_wait_into(small, &mut out);
    assert_eq!(
        (out.len(), out.min(), out.max()),
        (w.len(), w.min(), w.max())
    );
}

/// RAID6 over six simulated members (64 KiB chunks: 256 KiB stripes, one turn's bulk
/// bytes; 50 µs per member request), the bulk share pinned at the whole pool so that only
/// the per-turn bound limits admission.
fn bulk_turn_array() -> (Array<crate::sim::SimChannel>, Vec<SimDevice>, SimClock) {
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, 64 << 10, 4096).unwrap();
    assert_eq!(
        g.stripe_data_bytes(),
        BULK_BYTES_PER_TURN,
        "the tests' stripes are one turn's bulk"
    );
    let geo = ArrayGeometry::new(g, 256).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..6)
        .map(|i| {
            SimDevice::new(
                &format!("d{i}"),
                256 * (64 << 10),
                4096,
                Profile::fixed(50_000),
                clock.clone(),
                1,
            )
            .unwrap()
        })
        .collect();
    let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
    let cfg = ArrayConfig {
        bulk_share_percent: Some(100),
        ..ArrayConfig::default()
    };
    let arr = Array::new(geo, chans, Parity::new(), cfg).unwrap();
    (arr, devs, clock)
}

/// Stripe operations of bulk writes in flight or queued.
fn live_bulk(arr: &Array<crate::sim::SimChannel>) -> usize {
    (0..arr.sops.len())
        .filter(|&i| !arr.free_sops.contains(&(i as u32)) && arr.sops[i].bulk)
        .count()
}

/// After a `process` call that returned `more`: polls `arr`'s completions into `done`
/// (each must have succeeded); with nothing done and nothing more to do, advances `clock`
/// to the next member completion.
fn collect_or_advance(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    more: bool,
    done: &mut Vec<u64>,
) {
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    let n = arr.poll(&mut out);
    for c in &out[..n] {
        assert_eq!(c.status, Ok(()), "tag {}", c.tag);
        done.push(c.tag);
    }
    if !more && n == 0 {
        let next = arr.channels().filter_map(|c| c.next_completion_ns()).min();
        clock.advance_to(next.expect("member I/O in flight"));
    }
}

/// Issue 24: one `process` call (a reactor turn) admits at most `BULK_BYTES_PER_TURN` of
/// bulk-write stripe operations — the copy and parity work it does — however much bulk
/// work is queued, while the bound holds (a small read was accepted within
/// `TURN_BOUND_HOLD_NS`), so a small read that arrives while a bulk writer has 8 MiB
/// queued gets its member read issued in the next call; every call admits some bulk work
/// until none is left (no starvation), and the data comes back as written.
#[test]
fn a_turn_admits_bounded_bulk_work_ahead_of_a_small_read() {
    let (mut arr, _devs, clock) = bulk_turn_array();
    let stripe = arr.geometry().geometry().stripe_data_bytes();

    // A reader was here a moment ago: the bound holds.
    let mut earlier = AlignedBuf::zeroed(4096);
    assert_eq!(
        rw(
            &mut arr,
            &clock,
            3,
            ArrayOp::Read,
            100 * stripe,
            &mut earlier
        ),
        Ok(())
    );

    // Eight 1 MiB sequential writes (32 stripes), all queued at once.
    const MIB: usize = 1 << 20;
    let mut data = AlignedBuf::zeroed(8 * MIB);
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i * 31 + 7) as u8;
    }
    for k in 0..8 {
        let buf = &mut data[k * MIB..(k + 1) * MIB];
        submit_at(
            &mut arr,
            10 + k as u64,
            ArrayOp::Write { fua: false },
            (k * MIB) as u64,
            buf,
        );
    }
    arr.set_now(clock.now_ns());
    assert!(arr.process(), "bulk work deferred is progress");
    assert_eq!(live_bulk(&arr), 1, "one turn's bulk bytes: one stripe");
    assert_eq!(arr.turn_bulk_bytes, BULK_BYTES_PER_TURN);

    // A small read beyond the writes arrives: the next turn issues its member read.
    let mut small = AlignedBuf::zeroed(4096);
    small.fill(0xa5);
    let read_at = 200 * stripe + 8192;
    submit_at(&mut arr, 1, ArrayOp::Read, read_at, &mut small);
    arr.set_now(clock.now_ns());
    assert!(arr.process());
    let reading = (0..arr.sops.len()).any(|i| {
        !arr.free_sops.contains(&(i as u32))
            && !arr.sops[i].bulk
            && arr.sops[i].phase == Phase::DirectRead
    });
    assert!(
        reading,
        "the small read's member read is issued in the turn it arrived"
    );
    assert_eq!(live_bulk(&arr), 2);

    // Drain: every call admits at most one turn's bulk bytes, and some while any wait.
    let mut done = Vec::new();
    for _ in 0..100_000 {
        if done.len() == 9 {
            break;
        }
        arr.set_now(clock.now_ns());
        let backlog_bulk = arr
            .backlog
            .iter()
            .any(|&r| arr.reqs.get(r).expect("live").class == RequestClass::BulkWrite);
        let room = !arr.free_sops.is_empty();
        let more = arr.process();
        assert!(arr.turn_bulk_bytes <= BULK_BYTES_PER_TURN);
        if backlog_bulk && room {
            assert!(
                arr.turn_bulk_bytes > 0,
                "bulk work waited with a free operation"
            );
        }
        collect_or_advance(&mut arr, &clock, more, &mut done);
    }
    done.sort_unstable();
    assert_eq!(done, [1, 10, 11, 12, 13, 14, 15, 16, 17]);
    assert!(small.iter().all(|&b| b == 0), "never written: zeroes");
    let mut back = AlignedBuf::zeroed(8 * MIB);
    assert_eq!(rw(&mut arr, &clock, 2, ArrayOp::Read, 0, &mut back), Ok(()));
    assert!(
        back[..] == data[..],
        "read-back differs from what was written"
    );
}

/// The per-turn bulk bound holds only while something may wait behind it: with nothing
/// but bulk writes accepted within `TURN_BOUND_HOLD_NS`, one turn admits every queued
/// bulk stripe the pool has room for; from the turn that accepts a small read, every turn
/// admits at most `BULK_BYTES_PER_TURN` (the read's member read going out meanwhile);
/// `TURN_BOUND_HOLD_NS` after that read, turns are unbounded again, until the executor
/// says the bound holds (`Array::set_turn_bound_held`). Data read back as written.
#[test]
fn the_turn_bound_holds_only_after_a_request_other_than_bulk_writes() {
    let (mut arr, _devs, clock) = bulk_turn_array();
    let stripe = arr.geometry().geometry().stripe_data_bytes();
    let pool = ArrayConfig::default().stripe_ops;
    assert_eq!(pool, 32, "the default pool: 8 MiB of these stripes");
    const MIB: usize = 1 << 20;
    let mut data = AlignedBuf::zeroed(32 * MIB);
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i * 29 + 3) as u8;
    }
    let mut done = Vec::new();
    // Runs turns until `until` requests have completed in all; returns the most bulk
    // bytes one turn admitted.
    let drain =
        |arr: &mut Array<crate::sim::SimChannel>, done: &mut Vec<u64>, until: usize| -> u64 {
            let mut most = 0;
            for _ in 0..100_000 {
                if done.len() >= until {
                    return most;
                }
                arr.set_now(clock.now_ns());
                let more = arr.process();
                most = most.max(arr.turn_bulk_bytes);
                collect_or_advance(arr, &clock, more, done);
            }
            panic!("requests did not finish");
        };

    // Queues 1 MiB writes `ks` (tags 10 + k) of `data`, in place.
    let write_mibs = |arr: &mut Array<crate::sim::SimChannel>,
                      data: &mut AlignedBuf,
                      ks: std::ops::Range<usize>| {
        for k in ks {
            let buf = &mut data[k * MIB..(k + 1) * MIB];
            let (tag, off) = (10 + k as u64, (k * MIB) as u64);
            submit_at(arr, tag, ArrayOp::Write { fua: false }, off, buf);
        }
    };

    // Only bulk writes so far: the first turn admits all 32 stripes of eight 1 MiB writes.
    write_mibs(&mut arr, &mut data, 0..8);
    arr.set_now(clock.now_ns());
    arr.process();
    assert_eq!(
        live_bulk(&arr),
        pool,
        "unbounded: the whole pool in one turn"
    );
    assert_eq!(arr.turn_bulk_bytes, pool as u64 * stripe);

    // Eight more queue behind them, then a small read arrives: bounded from its turn on.
    write_mibs(&mut arr, &mut data, 8..16);
    let mut small = AlignedBuf::zeroed(4096);
    small.fill(0xa5);
    submit_at(&mut arr, 1, ArrayOp::Read, 200 * stripe + 8192, &mut small);
    let most = drain(&mut arr, &mut done, 17);
    assert_eq!(
        most, BULK_BYTES_PER_TURN,
        "bounded while a reader was recent"
    );
    assert!(small.iter().all(|&b| b == 0), "never written: zeroes");
    assert!(
        clock.now_ns() < TURN_BOUND_HOLD_NS,
        "the drain took longer than the hold: the test proves nothing"
    );

    // A hold after the read, bulk alone again: unbounded.
    clock.advance_by(TURN_BOUND_HOLD_NS);
    write_mibs(&mut arr, &mut data, 16..24);
    arr.set_now(clock.now_ns());
    arr.process();
    assert_eq!(arr.turn_bulk_bytes, pool as u64 * stripe, "unbounded again");
    drain(&mut arr, &mut done, 25);

    // The executor says a small request waits elsewhere (another shard's, another
    // array's): bounded with nothing of the kind accepted here.
    arr.set_turn_bound_held(true);
    write_mibs(&mut arr, &mut data, 24..32);
    let most = drain(&mut arr, &mut done, 33);
    assert_eq!(most, BULK_BYTES_PER_TURN, "bounded on the executor's word");

    let mut back = AlignedBuf::zeroed(32 * MIB);
    assert_eq!(rw(&mut arr, &clock, 2, ArrayOp::Read, 0, &mut back), Ok(()));
    assert!(
        back[..] == data[..],
        "read-back differs from what was written"
    );
}

/// A degraded read crossing chunk boundaries reads the survivors only over what it wants
/// of the lost chunks (the hull of those ranges, rebuilt) and the rest of the surviving
/// chunks straight into the caller's buffer: an 8 KiB read across two 64 KiB chunks, one
/// lost, costs five 4 KiB member reads (three data survivors and P over the lost 4 KiB,
/// plus the surviving chunk's own 4 KiB), not four whole chunks. RAID5 with one member
/// failed, RAID6 with two; every boundary of every stripe, and reads spanning three
/// chunks; member bytes read counted exactly, data checked against what was written.
#[test]
fn degraded_reads_across_chunks_read_only_the_lost_range() {
    const C: u64 = 64 * 1024;
    for (level, n, failed) in [
        (Level::Raid5, 5u16, &[1u16][..]),
        (Level::Raid6, 6, &[1, 4][..]),
    ] {
        let (mut arr, _devs, clock) = sim_array(level, n, C, 4096, 6, Profile::fixed(1000));
        let w = fill_array(&mut arr, &clock, |i| (i % 253) as u8);
        for &m in failed {
            arr.fail_member_by_operator(m);
        }
        let g = *arr.geometry().geometry();
        let d = u64::from(g.data_chunks());
        let read_bytes = |arr: &Array<_>| {
            (0..n)
                .map(|m| arr.member_counters(m).read_bytes)
                .sum::<u64>()
        };
        let mut tag = 100;
        for stripe in 0..6u64 {
            for k in 1..d {
                // (offset in the stripe's data, length): across one boundary, and from
                // the middle of chunk k-1 to the middle of chunk k+1 where there is one.
                let mut cases = vec![(k * C - 4096, 8192u64)];
                if k + 1 < d {
                    cases.push((k * C - C / 2, 2 * C));
                }
                for (at, len) in cases {
                    let off = stripe * d * C + at;
                    let mut buf = AlignedBuf::zeroed(len as usize);
                    let before = read_bytes(&arr);
                    tag += 1;
                    assert_eq!(
                        rw(&mut arr, &clock, tag, ArrayOp::Read, off, &mut buf),
                        Ok(())
                    );
                    let off = off as usize;
                    assert!(
                        buf[..] == w[off..off + len as usize],
                        "{level:?} stripe {stripe} at {at} len {len}: data differs"
                    );
                    // Expected: every survivor (P and Q included) over the hull of the
                    // read's ranges in lost chunks, plus the read's ranges in surviving
                    // chunks outside that hull; a read of no lost chunk is a plain read.
                    let layout = g.stripe(stripe);
                    let ranges: Vec<(u16, u64, u64)> = (0..d)
                        .filter_map(|j| {
                            let (a, b) = (at.max(j * C), (at + len).min((j + 1) * C));
                            (a < b).then(|| (layout.data_member(j as u16), a - j * C, b - j * C))
                        })
                        .collect();
                    let lost: Vec<_> = ranges.iter().filter(|r| failed.contains(&r.0)).collect();
                    let expected = if lost.is_empty() {
                        len
                    } else {
                        let lo = lost.iter().map(|r| r.1).min().unwrap();
                        let hi = lost.iter().map(|r| r.2).max().unwrap();
                        let survivors = u64::from(n) - failed.len() as u64;
                        let direct: u64 = ranges
                            .iter()
                            .filter(|r| {
                                let inside = lo <= r.1 && r.2 <= hi;
                                !failed.contains(&r.0) && !inside
                            })
                            .map(|r| r.2 - r.1)
                            .sum();
                        survivors * (hi - lo) + direct
                    };
                    let read = read_bytes(&arr) - before;
                    assert_eq!(
                        read, expected,
                        "{level:?} stripe {stripe} at {at} len {len}: member bytes read"
                    );
                }
            }
        }
        assert!(arr.stats().degraded_reads > 0, "{:?}", arr.stats());
    }
}

/// A degraded read retried after a latent sector error keeps the range of its earlier
/// rounds, so the bad member's rewrite covers what it was read over. RAID6, stripe 1: A
/// (data chunk 0) failed, R (data chunk 1) replaced and being rebuilt over ranges (as a
/// bitmap re-add does). A read of A's last 512 B and all of R's chunk reads the survivors
/// over R's whole range; untouched survivor D has a latent sector there, so the read
/// retries. Meanwhile the rebuild finishes stripe 0 and its position moves past stripe 1
/// (not in its ranges): R is no longer missing, and the retry's own hull is A's 512 B
/// alone. D must still be rewritten over the first round's range: a later read of D's
/// chunk finds no error. (Found by review: the rewrite covered only the retry's hull,
/// and D's sector, counted as repaired, stayed unreadable.)
#[test]
fn a_retried_degraded_read_repairs_what_its_earlier_rounds_read() {
    let (c, b, stripes) = (4096u64, 512u32, 4u64);
    let (mut arr, devs, clock) = sim_array(Level::Raid6, 6, c, b, stripes, Profile::fixed(1000));
    let w = fill_array(&mut arr, &clock, |i| ((i * 7 + i / 509) % 253) as u8);
    let g = *arr.geometry().geometry();
    let dc = u64::from(g.data_chunks());
    let st = g.stripe(1);
    let (a, r, d) = (st.data_member(0), st.data_member(1), st.data_member(2));
    arr.fail_member_by_operator(a);
    arr.fail_member_by_operator(r);
    // R's new device already holds R's data (so the stripes the rebuild skips are in sync).
    let fresh = SimDevice::new(
        "newR",
        stripes * c,
        b,
        Profile::fixed(1000),
        clock.clone(),
        9,
    )
    .unwrap();
    let mut all = vec![0u8; (stripes * c) as usize];
    devs[usize::from(r)].peek(0, &mut all);
    fresh.poke(0, &all);
    arr.replace_member(r, fresh.open_channel().unwrap())
        .unwrap();
    arr.start_process(&crate::process::ProcessRequest {
        kind: crate::process::ProcessKind::Rebuild,
        ranges: Some(vec![0..1, 2..3]),
        resume_stripe: 0,
    })
    .unwrap();
    // D: one bad sector at 1024..1536 of its stripe-1 chunk (inside R's range, not A's).
    devs[usize::from(d)].add_latent_error(arr.data_offset + c + 1024..arr.data_offset + c + 1536);
    // The rebuild of stripe 0 has read its survivors and issued its write; D slows down so
    // that the read's first round ends after that write.
    run_until(&mut arr, &clock, |p| p == Phase::BgWrite);
    devs[usize::from(d)].set_slowdown(4);
    let (off, len) = (dc * c + c - 512, 512 + c);
    let mut buf = AlignedBuf::zeroed(len as usize);
    submit_at(&mut arr, 7, ArrayOp::Read, off, &mut buf);
    assert_eq!(complete(&mut arr, &clock, 7), Ok(()));
    assert!(
        buf[..] == w[off as usize..(off + len) as usize],
        "data differs"
    );
    let s1 = arr.stats();
    assert_eq!(
        (s1.medium_errors, s1.read_errors_repaired),
        (1, 1),
        "{s1:?}"
    );
    // D's chunk of stripe 1: the sector counted as repaired reads cleanly.
    let mut b2 = AlignedBuf::zeroed(c as usize);
    assert_eq!(
        rw(&mut arr, &clock, 8, ArrayOp::Read, dc * c + 2 * c, &mut b2),
        Ok(())
    );
    assert!(b2[..] == w[(dc * c + 2 * c) as usize..(dc * c + 3 * c) as usize]);
    assert_eq!(
        arr.stats().medium_errors,
        1,
        "D's latent sector, counted as repaired, is still unreadable"
    );
}

/// Issue 23: a read inside one chunk of a healthy array, with nothing queued ahead of it,
/// goes out at submission as one member read without a stripe operation (`read.rs`, "the
/// fast path"), and keeps a stripe operation's guarantees: a write submitted while it is in
/// flight waits for it (the read returns the old bytes), a read of a stripe a write holds
/// waits for (or is served from) the write, and reads across a chunk boundary, or of a
/// degraded array, take stripe operations.
#[test]
fn single_chunk_reads_take_the_fast_path_and_keep_the_stripe_order() {
    for level in [Level::Raid5, Level::Raid6] {
        let (mut arr, devs, clock) = sim_array(level, 5, 4096, 512, 8, Profile::fixed(1000));
        let cap = arr.geometry().capacity_bytes() as usize;
        let mut data = fill_array(&mut arr, &clock, |i| (i * 13 + 5) as u8);
        let base = arr.stats();
        // Every chunk whole, then sub-chunk reads at block granularity.
        let mut reads = 0;
        for at in (0..cap).step_by(4096) {
            let mut r = AlignedBuf::zeroed(4096);
            assert_eq!(
                rw(&mut arr, &clock, 100, ArrayOp::Read, at as u64, &mut r),
                Ok(())
            );
            assert!(r[..] == data[at..at + 4096], "{level:?}: chunk at {at}");
            reads += 1;
        }
        for (at, len) in [(512usize, 512usize), (4096 + 1024, 2048), (cap - 512, 512)] {
            let mut r = AlignedBuf::zeroed(len);
            assert_eq!(
                rw(&mut arr, &clock, 101, ArrayOp::Read, at as u64, &mut r),
                Ok(())
            );
            assert!(r[..] == data[at..at + len], "{level:?}: {at}+{len}");
            reads += 1;
        }
        let s = arr.stats();
        assert_eq!(s.fast_reads - base.fast_reads, reads, "{level:?}: {s:?}");
        assert_eq!(s.direct_reads - base.direct_reads, reads);
        // Across a chunk boundary: a stripe operation (two member reads).
        let mut r = AlignedBuf::zeroed(1024);
        assert_eq!(
            rw(&mut arr, &clock, 102, ArrayOp::Read, 4096 - 512, &mut r),
            Ok(())
        );
        assert!(r[..] == data[4096 - 512..4096 + 512]);
        assert_eq!(arr.stats().fast_reads, s.fast_reads, "{level:?}");
        assert_eq!(arr.stats().direct_reads, s.direct_reads + 1);

        // A write submitted while a fast-path read of its range is in flight waits for it:
        // the read returns the old bytes, a read after the write the new ones.
        let at = 3 * 4096 + 1024;
        let mut old = AlignedBuf::zeroed(2048);
        let fast = arr.stats().fast_reads;
        let mut new = AlignedBuf::zeroed(2048);
        new.iter_mut().for_each(|b| *b = 0xa5);
        let what = format!("{level:?}");
        let st = read_then_write_behind_it(
            &mut arr,
            &clock,
            (200, 201),
            at as u64,
            &mut old,
            &mut new,
            &what,
        );
        assert_eq!(st, vec![Ok(()); 2]);
        assert_eq!(arr.stats().fast_reads, fast + 1);
        assert!(
            old[..] == data[at..at + 2048],
            "{level:?}: the read saw the write"
        );
        data[at..at + 2048].copy_from_slice(&new);
        // A read submitted while a write holds its stripe is no fast-path read; it sees
        // the write whole.
        new.iter_mut().for_each(|b| *b = 0x3c);
        let mut after = AlignedBuf::zeroed(2048);
        arr.set_now(clock.now_ns());
        submit_at(
            &mut arr,
            202,
            ArrayOp::Write { fua: false },
            at as u64,
            &mut new,
        );
        assert!(turn(&mut arr, &clock).is_empty());
        submit_at(&mut arr, 203, ArrayOp::Read, at as u64, &mut after);
        assert_eq!(complete_all(&mut arr, &clock, &[202, 203]), vec![Ok(()); 2]);
        assert_eq!(arr.stats().fast_reads, fast + 1, "{level:?}");
        assert!(after[..] == new[..], "{level:?}: the read missed the write");
        data[at..at + 2048].copy_from_slice(&new);

        // Degraded: the surviving chunks are fast-path reads, the lost ones stripe
        // operations rebuilding them.
        devs[1].disappear();
        let mut all = AlignedBuf::zeroed(cap);
        assert_eq!(
            rw(&mut arr, &clock, 300, ArrayOp::Read, 0, &mut all),
            Ok(())
        );
        assert_eq!(
            arr.member_states().nth(1),
            Some(MemberState::Failed(IoError::Gone))
        );
        let before = arr.stats();
        let g = *arr.geometry().geometry();
        let data_chunks = usize::from(g.data_chunks());
        let mut lost = 0;
        for at in (0..cap).step_by(4096) {
            let (stripe, k) = (at / 4096 / data_chunks, (at / 4096 % data_chunks) as u16);
            lost += u64::from(g.stripe(stripe as u64).data_member(k) == 1);
            let mut r = AlignedBuf::zeroed(4096);
            assert_eq!(
                rw(&mut arr, &clock, 301, ArrayOp::Read, at as u64, &mut r),
                Ok(())
            );
            assert!(
                r[..] == data[at..at + 4096],
                "{level:?}: degraded chunk at {at}"
            );
        }
        let after = arr.stats();
        let chunks = (cap / 4096) as u64;
        assert!(lost > 0 && lost < chunks);
        assert_eq!(
            after.fast_reads - before.fast_reads,
            chunks - lost,
            "{level:?}"
        );
        assert_eq!(
            after.degraded_reads - before.degraded_reads,
            lost,
            "{level:?}"
        );
        assert!(!arr.busy());
    }
}

/// A fast-path read that meets a member error runs again as a stripe operation: an
/// unrecovered read error is rebuilt from redundancy and rewritten once (the member stays
/// in), any other error fails the member, and a hung command times out and fails it — the
/// read returns the right bytes in every case, and nothing is left in flight.
#[test]
fn a_failed_fast_path_read_runs_again_from_redundancy() {
    use crate::sim::{Fault, FaultRule, OpFilter};
    let (mut arr, devs, clock) = sim_array(Level::Raid6, 6, 4096, 512, 8, Profile::fixed(1000));
    let data = fill_array(&mut arr, &clock, |i| (i * 31 + 7) as u8);
    let g = *arr.geometry().geometry();
    let read = |arr: &mut Array<crate::sim::SimChannel>, tag, at: usize, len: usize| {
        let mut r = AlignedBuf::zeroed(len);
        assert_eq!(
            rw(arr, &clock, tag, ArrayOp::Read, at as u64, &mut r),
            Ok(())
        );
        assert!(
            r[..] == data[at..at + len],
            "read {tag} at {at}+{len} differs"
        );
    };

    // A latent sector error under a read of data chunk 1 of stripe 2.
    let m = g.stripe(2).data_member(1);
    let (chunk, stripe_bytes) = (4096usize, g.stripe_data_bytes() as usize);
    let at = 2 * stripe_bytes + chunk + 1024;
    devs[usize::from(m)].add_latent_error(2 * 4096 + 1024..2 * 4096 + 1536);
    let s0 = arr.stats();
    read(&mut arr, 10, at, 2048);
    let s1 = arr.stats();
    assert_eq!(s1.medium_errors - s0.medium_errors, 1, "{s1:?}");
    assert_eq!(s1.read_errors_repaired - s0.read_errors_repaired, 1);
    assert_eq!(s1.degraded_reads - s0.degraded_reads, 1);
    assert_eq!(
        s1.fast_reads, s0.fast_reads,
        "the failed read completes only once"
    );
    assert!(arr.member_states().all(|s| s == MemberState::Online));
    // Repaired: the same read is a clean fast-path read now.
    read(&mut arr, 11, at, 2048);
    assert_eq!(arr.stats().fast_reads, s1.fast_reads + 1);
    assert_eq!(arr.stats().medium_errors, s1.medium_errors);

    // An I/O error fails the member; the read is served from redundancy.
    let m = g.stripe(5).data_member(3);
    devs[usize::from(m)].add_fault(FaultRule {
        filter: OpFilter::Read,
        range: None,
        fault: Fault::Error(IoError::Io { errno: 5 }),
        probability: 1.0,
        count: Some(1),
    });
    let s2 = arr.stats();
    read(&mut arr, 12, 5 * stripe_bytes + 3 * chunk, 4096);
    assert_eq!(
        arr.member_states().nth(usize::from(m)),
        Some(MemberState::Failed(IoError::Io { errno: 5 }))
    );
    assert_eq!(arr.stats().fast_reads, s2.fast_reads);
    assert_eq!(arr.stats().degraded_reads, s2.degraded_reads + 1);
    assert!(!arr.busy());

    // A hung command on a second member times out (RAID6: still redundant).
    let (mut arr, devs, clock) = sim_array(Level::Raid6, 6, 4096, 512, 8, Profile::fixed(1000));
    let data = fill_array(&mut arr, &clock, |i| (i * 31 + 7) as u8);
    let m = g.stripe(4).data_member(0);
    devs[usize::from(m)].add_fault(FaultRule {
        filter: OpFilter::Read,
        range: None,
        fault: Fault::Hang,
        probability: 1.0,
        count: Some(1),
    });
    let t0 = clock.now_ns();
    let at = 4 * stripe_bytes + 512;
    let mut r = AlignedBuf::zeroed(1024);
    assert_eq!(
        rw(&mut arr, &clock, 13, ArrayOp::Read, at as u64, &mut r),
        Ok(())
    );
    assert!(r[..] == data[at..at + 1024]);
    let waited = clock.now_ns() - t0;
    assert!(
        (DEFAULT_IO_TIMEOUT_NS..2 * DEFAULT_IO_TIMEOUT_NS).contains(&waited),
        "the read took {waited} ns"
    );
    assert_eq!(
        arr.member_states().nth(usize::from(m)),
        Some(MemberState::Failed(IoError::Timeout))
    );
    assert_eq!(arr.stats().timeouts, 1);
    assert_eq!(arr.stats().fast_reads, 0);
    assert!(!arr.busy());
}

/// A fast-path read of a stripe another shard owns holds the stripe gate while it reads,
/// as a foreign stripe operation's read does: the owner's write of that stripe waits for it
/// (and the read returns the old bytes), and a read arriving while the owner writes the
/// stripe is no fast-path read — it goes to the owner and returns the new bytes.
#[test]
fn a_foreign_fast_path_read_holds_the_stripe_gate() {
    // Stripe 1's owner writes it; the other shard reads it as a foreign read.
    let (mut shards, _devs, clock, _gate) = two_gated_shards(ArrayConfig::default());
    let (_, o, f, at, old, _) = owner_writes_stripe_1(&mut shards, &clock);
    // The foreign read goes out at submission and holds the gate...
    let mut r = AlignedBuf::zeroed(2048);
    shards[f].set_now(clock.now_ns());
    submit_at(&mut shards[f], 2, ArrayOp::Read, at, &mut r);
    let st = shards[f].stats();
    assert_eq!((st.fast_reads, st.foreign_reads), (0, 1), "{st:?}");
    // ...so the owner's write of the stripe waits for it.
    let mut new = AlignedBuf::from_slice(&[0x22; 2048]);
    shards[o].set_now(clock.now_ns());
    submit_at(
        &mut shards[o],
        3,
        ArrayOp::Write { fua: false },
        at,
        &mut new,
    );
    assert!(turn(&mut shards[o], &clock).is_empty());
    assert_eq!(
        shards[o].stats().gate_waits,
        1,
        "the write waits for the gate"
    );
    assert_eq!(complete(&mut shards[f], &clock, 2), Ok(()));
    assert_eq!(shards[f].stats().fast_reads, 1);
    assert!(
        r[..] == old[..],
        "the foreign read saw part of the owner's write"
    );
    // The write is under way now (its member reads in flight, the gate held): a foreign
    // read of the stripe goes to the owner.
    turn(&mut shards[o], &clock);
    let mut r2 = AlignedBuf::zeroed(2048);
    shards[f].set_now(clock.now_ns());
    submit_at(&mut shards[f], 4, ArrayOp::Read, at, &mut r2);
    assert!(turn(&mut shards[f], &clock).is_empty());
    assert_eq!(
        shards[f].stats().fast_reads,
        1,
        "no fast-path read under the owner's write"
    );
    let moved = shards[f].take_moved().expect("the read moved to the owner");
    assert_eq!(moved.tag, 4);
    shards[o].submit(moved).unwrap();
    assert_eq!(
        complete_all(&mut shards[o], &clock, &[3, 4]),
        vec![Ok(()); 2]
    );
    assert!(r2[..] == new[..], "the moved read missed the owner's write");
    for a in &shards {
        assert!(!a.busy());
    }
}
/// A fast-path read that fails (I/O error, latent sector error, or a timeout) keeps its
/// stripe hold until the stripe operation that runs it again takes it over: a write of the
/// stripe submitted after the read, waiting for the stripe, does not run first, and the
/// read returns the old bytes — as a stripe operation's read does (the control cases,
/// reads crossing a chunk boundary). Found by review: the first version let go of the hold
/// and the retried read returned the later write's data.
#[test]
fn a_failed_fast_read_is_not_overtaken_by_a_later_write() {
    use crate::sim::{Fault, FaultRule, OpFilter};
    let mut wrong = Vec::new();
    // (fault, read offset in the chunk, read length): 2 KiB inside the chunk is a fast-path
    // read; 2 KiB crossing into the next chunk is a stripe operation (the control: it
    // passes).
    for (fault, off, len) in [
        (Fault::Error(IoError::Io { errno: 5 }), 1024usize, 2048usize),
        (Fault::Error(IoError::Medium), 1024, 2048),
        (Fault::Hang, 1024, 2048),
        (Fault::Error(IoError::Io { errno: 5 }), 3072, 2048),
        (Fault::Error(IoError::Medium), 3072, 2048),
        (Fault::Hang, 3072, 2048),
    ] {
        let (mut arr, devs, clock) = sim_array(Level::Raid6, 6, 4096, 512, 8, Profile::fixed(1000));
        let data = fill_array(&mut arr, &clock, |i| (i * 7 + 3) as u8);
        let g = *arr.geometry().geometry();
        let stripe_bytes = g.stripe_data_bytes() as usize;
        // Data chunk 2 of stripe 3.
        let m = g.stripe(3).data_member(2);
        let at = 3 * stripe_bytes + 2 * 4096 + off;
        devs[usize::from(m)].add_fault(FaultRule {
            filter: OpFilter::Read,
            range: None,
            fault,
            probability: 1.0,
            count: Some(1),
        });
        let fast0 = arr.stats().fast_reads;
        let mut r = AlignedBuf::zeroed(len);
        // A write of the same bytes, submitted after the read: it must not be seen.
        let mut w = AlignedBuf::from_slice(&vec![0xee; len]);
        let what = format!("{fault:?}");
        let st =
            read_then_write_behind_it(&mut arr, &clock, (10, 11), at as u64, &mut r, &mut w, &what);
        assert_eq!(st, vec![Ok(()); 2], "{fault:?}");
        assert_eq!(arr.stats().fast_reads, fast0);
        if r[..] != data[at..at + len] {
            wrong.push(format!(
                "{fault:?} at chunk offset {off} (fast path: {}): the read returned the \
                 later write's data (first byte {:#x})",
                off + len <= 4096,
                r[0]
            ));
        }
        assert!(!arr.busy());
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// Two shards over four RAID5 members, one stripe gate (as `a_foreign_fast_path_read_holds_the_stripe_gate`).
fn two_gated_shards(
    cfg: ArrayConfig,
) -> (
    Vec<Array<crate::sim::SimChannel>>,
    Vec<SimDevice>,
    SimClock,
    Arc<crate::shard::StripeGate>,
) {
    use crate::shard::StripeGate;
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, 4096, 512).unwrap();
    let geo = ArrayGeometry::new(g, 8).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..4)
        .map(|i| {
            SimDevice::new(
                &format!("d{i}"),
                8 * 4096,
                512,
                Profile::fixed(1000),
                clock.clone(),
                i,
            )
            .unwrap()
        })
        .collect();
    let mut shards: Vec<Array<crate::sim::SimChannel>> = (0..2)
        .map(|i| {
            let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
            let mut a = Array::new(geo, chans, Parity::new(), cfg).unwrap();
            a.set_shard(i, 2);
            a
        })
        .collect();
    // Sized as `ShardedArray::new` sizes it: twice the stripe operations of every shard.
    let ops: usize = shards.iter().map(Array::stripe_op_capacity).sum();
    let gate = StripeGate::new(4096, 2 * ops, 4);
    for a in &mut shards {
        a.set_gate(Some(Arc::clone(&gate)));
    }
    (shards, devs, clock, gate)
}

/// Through the public [`Array::submit`], a shard refuses what it may not serve: another
/// shard's stripe unless the request is a read within that one stripe and the gate is
/// attached, and any request over two stripes (one of them always another shard's),
/// whichever stripe it starts in. The reactors' pieces ([`Array::submit_piece`]) are routed so and skip the
/// check; a caller of `submit` is not trusted to.
#[test]
fn a_shard_refuses_what_another_shard_must_serve() {
    let (mut shards, _devs, clock, _gate) = two_gated_shards(ArrayConfig::default());
    let stripe = 12288u64;
    let invalid = Err(ArrayError::Invalid(
        "a request for a stripe another reactor owns must be a read within one stripe",
    ));
    // Shard 1 owns the odd stripes. Stripe 0 belongs to shard 0.
    let s1 = &mut shards[1];
    let mut b = AlignedBuf::zeroed(4096);
    let w = ArrayOp::Write { fua: false };
    assert_eq!(
        rw(s1, &clock, 1, w, 0, &mut b),
        invalid,
        "a write of another's stripe"
    );
    assert_eq!(
        rw(s1, &clock, 2, ArrayOp::Read, 0, &mut b),
        Ok(()),
        "a foreign read"
    );
    assert_eq!(
        rw(s1, &clock, 3, w, stripe, &mut b),
        Ok(()),
        "a write of its own stripe"
    );
    let mut two = AlignedBuf::zeroed(8192);
    assert_eq!(
        rw(s1, &clock, 4, ArrayOp::Read, stripe - 4096, &mut two),
        invalid,
        "a read across another's stripe and its own"
    );
    // From its own stripe 1 into shard 0's stripe 2: a write and a read.
    let end_of_1 = 2 * stripe - 4096;
    assert_eq!(
        rw(s1, &clock, 7, w, end_of_1, &mut two),
        invalid,
        "a write into another's"
    );
    assert_eq!(
        rw(s1, &clock, 8, ArrayOp::Read, end_of_1, &mut two),
        invalid,
        "a read into another's"
    );
    // Without the gate, no foreign read either.
    s1.set_gate(None);
    assert_eq!(
        rw(s1, &clock, 5, ArrayOp::Read, 0, &mut b),
        invalid,
        "no gate"
    );
    assert_eq!(rw(s1, &clock, 6, ArrayOp::Read, stripe, &mut b), Ok(()));
}

/// On [`two_gated_shards`]: the owner of stripe 1 writes 2 KiB of 0x11 into its data chunk
/// 1 (tag 1). Returns (stripe, owner shard, the other shard, array offset of the bytes,
/// the bytes, the member holding them).
fn owner_writes_stripe_1(
    shards: &mut [Array<crate::sim::SimChannel>],
    clock: &SimClock,
) -> (u64, usize, usize, u64, AlignedBuf, u16) {
    let g = *shards[0].geometry().geometry();
    let s = 1u64;
    let o = crate::shard::owner(s, 2);
    let at = s * g.stripe_data_bytes() + 4096 + 512;
    let mut old = AlignedBuf::from_slice(&[0x11; 2048]);
    let w = ArrayOp::Write { fua: false };
    assert_eq!(rw(&mut shards[o], clock, 1, w, at, &mut old), Ok(()));
    (s, o, 1 - o, at, old, g.stripe(s).data_member(1))
}

/// A foreign fast-path read that meets a member error and runs again as a (foreign)
/// stripe operation counts once in `foreign_reads`.
#[test]
fn a_retried_foreign_fast_read_counts_once() {
    use crate::sim::{Fault, FaultRule, OpFilter};
    let (mut shards, devs, clock, _gate) = two_gated_shards(ArrayConfig::default());
    let (_, _, f, at, old, m) = owner_writes_stripe_1(&mut shards, &clock);
    devs[usize::from(m)].add_fault(FaultRule {
        filter: OpFilter::Read,
        range: None,
        fault: Fault::Error(IoError::Io { errno: 5 }),
        probability: 1.0,
        count: Some(1),
    });
    let mut r = AlignedBuf::zeroed(2048);
    assert_eq!(
        rw(&mut shards[f], &clock, 2, ArrayOp::Read, at, &mut r),
        Ok(())
    );
    assert!(r[..] == old[..]);
    let st = shards[f].stats();
    assert_eq!(
        (st.fast_reads, st.degraded_reads, st.moved_reads),
        (0, 1, 0),
        "{st:?}"
    );
    assert_eq!(
        st.foreign_reads, 1,
        "one foreign read, counted {} times",
        st.foreign_reads
    );
}

/// The stripe gate counts a slot's foreign reads in 16 bits and is sized (asserted at
/// construction) for twice the stripe operations of all reactors (`ShardedArray::new`,
/// `Reactors::start_on`): a shard holds the gate for at most as many fast-path reads as it
/// has stripe operations, however large its request pool — here 2^16 reads of one stripe,
/// which would overflow the count (in release builds into the writer count).
#[test]
fn foreign_fast_reads_stay_within_the_gate_bound() {
    let cfg = ArrayConfig {
        requests: 1 << 16,
        ..ArrayConfig::default()
    };
    let (mut shards, _devs, clock, _gate) = two_gated_shards(cfg);
    let g = *shards[0].geometry().geometry();
    let s = 1u64;
    let f = 1 - crate::shard::owner(s, 2);
    let at = s * g.stripe_data_bytes() + 4096;
    let mut bufs: Vec<AlignedBuf> = (0..4).map(|_| AlignedBuf::zeroed(512)).collect();
    shards[f].set_now(clock.now_ns());
    for i in 0..(1u64 << 16) {
        // Reads of one stripe's chunk, all in flight (nothing processed).
        let b = &mut bufs[(i % 4) as usize];
        submit_at(
            &mut shards[f],
            100 + i,
            ArrayOp::Read,
            at + 512 * (i % 4),
            b,
        );
    }
    let st = shards[f].stats();
    assert!(
        st.foreign_reads <= shards[f].stripe_op_capacity() as u64 * 2,
        "{} foreign reads hold the gate at once, sized for {}",
        st.foreign_reads,
        shards[f].stripe_op_capacity() * 2
    );
}

/// Starts replacement `serial` of member `slot` of `arr` (8 stripes of 4 KiB chunks) on a
/// new 1 µs sim device and turns the array until its copy finished; returns the device.
fn replace_copied(
    arr: &mut Array<crate::sim::SimChannel>,
    clock: &SimClock,
    slot: u16,
    serial: u64,
) -> SimDevice {
    let new = SimDevice::new("new", 8 * 4096, 512, Profile::fixed(1000), clock.clone(), 9).unwrap();
    arr.start_replace(slot, new.open_channel().unwrap(), serial, 0)
        .unwrap();
    for _ in 0..10_000 {
        if arr.replace_finished(serial) {
            break;
        }
        turn(arr, clock);
        clock.advance_by(1000);
    }
    assert!(arr.replace_finished(serial));
    new
}

/// fast-path reads in flight to a member across its replacement's swap:
/// one completes from the old device, one hangs there and times out (its completion is a
/// device leaving the array: no member fails) and runs again from the new one; the old
/// device is dropped only once both are back; nothing is left in flight.
#[test]
fn fast_reads_across_a_replace_swap() {
    use crate::sim::{Fault, FaultRule, OpFilter};
    let (mut arr, devs, clock) = sim_array(Level::Raid5, 4, 4096, 512, 8, Profile::fixed(1000));
    let data = fill_array(&mut arr, &clock, |i| (i * 5 + 1) as u8);
    let g = *arr.geometry().geometry();
    let slot = 1u16;
    let _new = replace_copied(&mut arr, &clock, slot, 1);
    // Two fast-path reads of slot 1's data chunks: stripe s where slot 1 holds data.
    let s = (0..8)
        .find(|&s| (0..3).any(|k| g.stripe(s).data_member(k) == slot))
        .unwrap();
    let k = (0..3)
        .find(|&k| g.stripe(s).data_member(k) == slot)
        .unwrap();
    let at = (s * g.stripe_data_bytes() + u64::from(k) * 4096) as usize;
    devs[usize::from(slot)].add_fault(FaultRule {
        filter: OpFilter::Read,
        range: None,
        fault: Fault::Hang,
        probability: 1.0,
        count: Some(1),
    });
    let (mut a, mut b) = (AlignedBuf::zeroed(1024), AlignedBuf::zeroed(1024));
    arr.set_now(clock.now_ns());
    let f0 = arr.stats().fast_reads;
    submit_at(&mut arr, 20, ArrayOp::Read, at as u64, &mut a);
    submit_at(&mut arr, 21, ArrayOp::Read, at as u64 + 2048, &mut b);
    assert_eq!(arr.stats().foreign_reads, 0);
    assert!(arr.complete_replace(1));
    assert_eq!(complete_all(&mut arr, &clock, &[20, 21]), vec![Ok(()); 2]);
    assert!(a[..] == data[at..at + 1024] && b[..] == data[at + 2048..at + 3072]);
    let st = arr.stats();
    assert_eq!(st.fast_reads, f0 + 1, "{st:?}");
    assert_eq!(st.timeouts, 1);
    assert_eq!(st.member_failures, 0);
    assert_eq!(st.stray_completions, 0);
    assert!(arr.member_states().all(|s| s == MemberState::Online));
    turn(&mut arr, &clock);
    assert!(!arr.busy());
    assert_eq!(arr.members.len(), 4, "the old device was dropped");
    for m in 0..4 {
        for c in IoClass::ALL {
            assert_eq!(arr.member_in_device(m, c), 0);
        }
    }
}

/// A replacement that fails after every shard copied it fails the slot on every shard,
/// whether the shard had swapped it in already (the failure comes later:
/// `fail_replacement` fails the member) or not (the swap comes later: `complete_replace`
/// fails the member) — never the old device on some shards and the new one on others,
/// which would leave the old device, missing the swapped shards' writes, in service. The
/// data reads back from the others either way.
#[test]
fn a_replacement_failing_after_its_copy_fails_the_slot_on_every_shard() {
    use crate::array::ReplaceState;
    for swapped_first in [false, true] {
        let (mut arr, _devs, clock) =
            sim_array(Level::Raid5, 4, 4096, 512, 8, Profile::fixed(1000));
        let data = fill_array(&mut arr, &clock, |i| (i * 7 + 3) as u8);
        let _new = replace_copied(&mut arr, &clock, 2, 5);
        // A late message about another replacement changes nothing.
        assert!(!arr.fail_replacement(4, IoError::Gone));
        if swapped_first {
            assert!(arr.complete_replace(5));
            assert!(arr.member_states().all(|s| s == MemberState::Online));
            assert!(arr.fail_replacement(5, IoError::Io { errno: 5 }));
        } else {
            assert!(arr.fail_replacement(5, IoError::Io { errno: 5 }));
            assert_eq!(arr.member_states().nth(2), Some(MemberState::Online));
            assert!(arr.complete_replace(5));
        }
        let what = format!("swapped first: {swapped_first}");
        assert_eq!(
            arr.member_states().nth(2),
            Some(MemberState::Failed(IoError::Io { errno: 5 })),
            "{what}"
        );
        assert_eq!(
            arr.replacement().unwrap().state,
            ReplaceState::Done,
            "{what}"
        );
        // Asked again: nothing more happens.
        assert!(!arr.fail_replacement(5, IoError::Io { errno: 5 }), "{what}");
        let mut got = AlignedBuf::zeroed(data.len());
        arr.set_now(clock.now_ns());
        submit_at(&mut arr, 90, ArrayOp::Read, 0, &mut got);
        assert_eq!(
            complete_all(&mut arr, &clock, &[90]),
            vec![Ok(())],
            "{what}"
        );
        assert!(got[..] == data[..], "{what}: read-back differs");
    }
}

/// A foreign fast-path read that meets a latent sector error runs again
/// as a foreign stripe operation, which hands it to the owner (the owner rewrites the
/// range); the gate is left clear (the owner's next write of the stripe does not wait),
/// nothing is left in flight.
#[test]
fn a_foreign_fast_read_with_a_medium_error_goes_to_the_owner() {
    let (mut shards, devs, clock, gate) = two_gated_shards(ArrayConfig::default());
    let (s, o, f, at, old, m) = owner_writes_stripe_1(&mut shards, &clock);
    devs[usize::from(m)].add_latent_error(s * 4096 + 1024..s * 4096 + 1536);
    let mut r = AlignedBuf::zeroed(2048);
    shards[f].set_now(clock.now_ns());
    submit_at(&mut shards[f], 2, ArrayOp::Read, at, &mut r);
    let mut moved = None;
    for _ in 0..100 {
        turn(&mut shards[f], &clock);
        if let Some(x) = shards[f].take_moved() {
            moved = Some(x);
            break;
        }
        clock.advance_by(1000);
    }
    let moved = moved.expect("moved to the owner");
    assert!(!shards[f].busy());
    assert!(gate.readers_clear(s));
    shards[o].submit(moved).unwrap();
    assert_eq!(complete(&mut shards[o], &clock, 2), Ok(()));
    assert!(r[..] == old[..]);
    let (a, b) = (shards[f].stats(), shards[o].stats());
    assert_eq!(
        (a.medium_errors, b.medium_errors, b.read_errors_repaired),
        (1, 1, 1)
    );
    let mut new = AlignedBuf::from_slice(&[0x22; 2048]);
    assert_eq!(
        rw(
            &mut shards[o],
            &clock,
            3,
            ArrayOp::Write { fua: false },
            at,
            &mut new
        ),
        Ok(())
    );
    assert_eq!(shards[o].stats().gate_waits, 0);
    for a in &shards {
        assert!(!a.busy());
    }
}

/// A failed fast-path read keeps its stripe hold until a stripe operation takes it over, so
/// one stripe operation is kept free for that while fast-path reads are in flight: with
/// every other operation taken by writes waiting for the read's stripe, the read's retry
/// still gets one (without it, the shard would wait forever), returns the old bytes, and
/// the writes follow in order. Found by review of the hold-keeping retry.
#[test]
fn a_failed_fast_read_gets_a_stripe_operation_when_writes_fill_the_rest() {
    use crate::sim::{Fault, FaultRule, OpFilter};
    for fault in [Fault::Error(IoError::Io { errno: 5 }), Fault::Hang] {
        let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, 4096, 512).unwrap();
        let geo = ArrayGeometry::new(g, 8).unwrap();
        let clock = SimClock::new();
        let devs: Vec<SimDevice> = (0..6)
            .map(|i| {
                let p = Profile::fixed(1000);
                SimDevice::new(&format!("d{i}"), 8 * 4096, 512, p, clock.clone(), i).unwrap()
            })
            .collect();
        let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
        let cfg = ArrayConfig {
            stripe_ops: 4,
            ..ArrayConfig::default()
        };
        let mut arr = Array::new(geo, chans, Parity::new(), cfg).unwrap();
        let data = fill_array(&mut arr, &clock, |i| (i * 11 + 1) as u8);
        let at = 2 * g.stripe_data_bytes() as usize + 4096;
        let m = g.stripe(2).data_member(1);
        devs[usize::from(m)].add_fault(FaultRule {
            filter: OpFilter::Read,
            range: None,
            fault,
            probability: 1.0,
            count: Some(1),
        });
        let mut r = AlignedBuf::zeroed(1024);
        arr.set_now(clock.now_ns());
        submit_at(&mut arr, 10, ArrayOp::Read, at as u64, &mut r);
        assert_eq!(arr.fast_in_flight, 1, "a fast-path read");
        // Four writes of the read's stripe, submitted after it: as many as there are
        // stripe operations.
        let mut ws: Vec<AlignedBuf> = (0..4u8)
            .map(|i| AlignedBuf::from_slice(&[0xa0 + i; 512]))
            .collect();
        for (i, w) in ws.iter_mut().enumerate() {
            let off = (at + 512 * (i % 2)) as u64;
            submit_at(
                &mut arr,
                20 + i as u64,
                ArrayOp::Write { fua: false },
                off,
                w,
            );
        }
        let tags = [10, 20, 21, 22, 23];
        assert_eq!(
            complete_all(&mut arr, &clock, &tags),
            vec![Ok(()); 5],
            "{fault:?}"
        );
        assert!(
            r[..] == data[at..at + 1024],
            "{fault:?}: the read saw a later write"
        );
        let mut back = AlignedBuf::zeroed(1024);
        assert_eq!(
            rw(&mut arr, &clock, 30, ArrayOp::Read, at as u64, &mut back),
            Ok(())
        );
        assert!(
            back[..512].iter().all(|&b| b == 0xa2),
            "{fault:?}: writes out of order"
        );
        assert!(
            back[512..].iter().all(|&b| b == 0xa3),
            "{fault:?}: writes out of order"
        );
        assert!(!arr.busy());
    }
}

/// A write queued behind a read of its stripe starts its pass after a flush that arrived
/// behind it (waiting in the backlog: no stripe operation free): the pass is not held
/// ("never once a flush has arrived behind it", `pass.rs`). It was, until the flush count
/// a pass compares with became the one its writes were accepted under (from a review).
#[test]
fn a_flush_behind_a_queued_write_ends_the_hold_of_its_later_pass() {
    let chunk = 16usize << 10;
    let stripe = 4 * chunk;
    let cfg = ArrayConfig {
        stripe_ops: 4,
        bulk_share_percent: Some(100),
        ..ArrayConfig::default()
    };
    let profile = Profile::fixed(10_000);
    let (mut arr, _devs, clock) =
        sim_array_with(Level::Raid6, 6, chunk as u64, 512, 8, profile, cfg);
    // The clients' write depth: 8 writes in flight at once (FUA: never held).
    let mut deep: Vec<AlignedBuf> = (0..8).map(|_| AlignedBuf::zeroed(4096)).collect();
    for (i, b) in deep.iter_mut().enumerate() {
        let off = (3 + i / 4) * stripe + (i % 4) * chunk;
        submit_at(
            &mut arr,
            60 + i as u64,
            ArrayOp::Write { fua: true },
            off as u64,
            b,
        );
    }
    assert_eq!(
        complete_all(&mut arr, &clock, &[60, 61, 62, 63, 64, 65, 66, 67]).len(),
        8
    );
    // The stream's front: the start of stripe 2.
    let _keep = prime_stream(&mut arr, &clock, 1, chunk);
    // A: a read of stripe 2 across a chunk boundary (a stripe operation): it runs.
    let mut a = AlignedBuf::zeroed(8192);
    submit_at(
        &mut arr,
        50,
        ArrayOp::Read,
        (2 * stripe + chunk - 4096) as u64,
        &mut a,
    );
    assert!(turn(&mut arr, &clock).is_empty());
    let t0 = clock.now_ns();
    clock.advance_to(t0 + 5_000);
    // C, D: FUA writes of other stripes (never held), finishing after A.
    let mut cd: Vec<AlignedBuf> = (0..2).map(|_| AlignedBuf::zeroed(4096)).collect();
    for (i, w) in cd.iter_mut().enumerate() {
        let off = ((5 + i) * stripe) as u64;
        submit_at(
            &mut arr,
            51 + i as u64,
            ArrayOp::Write { fua: true },
            off,
            w,
        );
    }
    assert!(turn(&mut arr, &clock).is_empty());
    // B: the stream's next chunk (stripe 2's first), queued behind the read A.
    let mut b = AlignedBuf::zeroed(chunk);
    b.fill(0xbb);
    submit_at(
        &mut arr,
        53,
        ArrayOp::Write { fua: false },
        (2 * stripe) as u64,
        &mut b,
    );
    assert!(turn(&mut arr, &clock).is_empty());
    assert!(arr.free_sops.is_empty(), "every stripe operation busy");
    // F: a flush, behind B: it waits in the backlog.
    arr.submit(ArrayRequest::flush(54)).unwrap();
    assert_eq!(arr.backlog.len(), 1);
    let mut done = Vec::new();
    for _ in 0..200 {
        done.extend(turn(&mut arr, &clock));
        if done.contains(&54) || done.contains(&53) {
            break;
        }
        let next = arr.channels().filter_map(|c| c.next_completion_ns()).min();
        match next {
            Some(n) => clock.advance_to(n),
            None => break,
        }
    }
    assert!(
        arr.held_passes.is_empty(),
        "B's pass still held after the flush behind it completed: {:?}",
        arr.held_passes
    );
    assert_eq!(arr.stats().held_passes, 0, "B's pass was held at all");
    let rest: Vec<u64> = [50, 51, 52, 53]
        .into_iter()
        .filter(|t| !done.contains(t))
        .collect();
    assert_eq!(complete_all(&mut arr, &clock, &rest).len(), rest.len());
}

/// [`ArrayConfig::initial_member_states`] (what a reactor publishes before its first turn,
/// and what the management layer may see first) is exactly what [`Array::new`] makes of
/// the configuration, for every combination of failed and rebuilding members that it
/// accepts, RAID5 and RAID6 — the two must not drift apart (a member reported online
/// while it is being rebuilt was recorded in sync and lost its recovery offset).
#[test]
fn the_configured_member_states_are_what_the_array_starts_with() {
    let n = 5u16;
    let slots: Vec<Option<u16>> = std::iter::once(None).chain((0..n).map(Some)).collect();
    let mut built = 0;
    for level in [Level::Raid5, Level::Raid6] {
        for &f0 in &slots {
            for &f1 in &slots {
                for &r0 in &slots {
                    for &r1 in &slots {
                        let cfg = ArrayConfig {
                            failed_members: [f0, f1],
                            rebuilding: [r0.map(|m| (m, 3)), r1.map(|m| (m, 5))],
                            bitmap_recovery: [r1, None],
                            ..ArrayConfig::default()
                        };
                        let g = Geometry::new(level, Layout::LeftSymmetric, n, 4096, 512).unwrap();
                        let geo = ArrayGeometry::new(g, 8).unwrap();
                        let chans = (0..n)
                            .map(|_| {
                                SimDevice::new(
                                    "m",
                                    8 * 4096,
                                    512,
                                    Profile::fixed(1000),
                                    SimClock::new(),
                                    1,
                                )
                                .unwrap()
                                .open_channel()
                                .unwrap()
                            })
                            .collect();
                        let Ok(arr) = Array::new(geo, chans, Parity::new(), cfg) else {
                            continue;
                        };
                        built += 1;
                        let states: Vec<MemberState> = arr.member_states().collect();
                        assert_eq!(
                            states,
                            cfg.initial_member_states(n),
                            "{level:?} failed {f0:?} {f1:?} rebuilding {r0:?} {r1:?}"
                        );
                    }
                }
            }
        }
    }
    assert!(built > 100, "combinations built: {built}");
}

// ---- full-stripe writes: parity generated in the operation's buffers 0/1 (8e1e28d) reaches
// every member and replacement, degraded, faulted, during a replace -------------------

mod full_stripe_parity {
    use super::*;
    use crate::sim::{Fault, FaultRule, OpFilter};

    /// An array of `n` members in `layout` (4 KiB chunks, 512-byte blocks) over fresh
    /// simulated devices, and its geometry.
    fn world(
        level: Level,
        layout: Layout,
        n: u16,
        stripes: u64,
        cfg: ArrayConfig,
    ) -> (
        Array<crate::sim::SimChannel>,
        Vec<SimDevice>,
        SimClock,
        Geometry,
    ) {
        let g = Geometry::new(level, layout, n, 4096, 512).unwrap();
        let (arr, devs, clock) = sim_array_of(
            g,
            stripes,
            |i| (Profile::fixed(1000 + 137 * u64::from(i)), u64::from(i) + 1),
            cfg,
        );
        (arr, devs, clock, g)
    }

    /// Four stripe operations, so that their buffers are reused from write to write.
    fn four_ops() -> ArrayConfig {
        ArrayConfig {
            stripe_ops: 4,
            ..ArrayConfig::default()
        }
    }

    fn pattern(seed: u64, len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::zeroed(len);
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for v in b.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *v = x as u8;
        }
        b
    }

    /// Writes every stripe whole, one request per stripe, all submitted at once; returns
    /// the statuses and the data.
    fn write_stripes(
        arr: &mut Array<crate::sim::SimChannel>,
        clock: &SimClock,
        seed: u64,
        tag0: u64,
    ) -> (Vec<Result<(), ArrayError>>, AlignedBuf) {
        let cap = arr.geometry().capacity_bytes() as usize;
        let sb = arr.geometry().geometry().stripe_data_bytes() as usize;
        let mut data = pattern(seed, cap);
        let mut tags = Vec::new();
        arr.set_now(clock.now_ns());
        for (i, piece) in data.chunks_mut(sb).enumerate() {
            submit_at(
                arr,
                tag0 + i as u64,
                ArrayOp::Write { fua: i % 3 == 0 },
                (i * sb) as u64,
                piece,
            );
            tags.push(tag0 + i as u64);
        }
        let st = complete_all(arr, clock, &tags);
        (st, data)
    }

    /// Checks every member image not in `skip` against `data`: data chunks equal, P and Q
    /// (where their member is not skipped) the parity of the data.
    fn check_images(
        images: &[Vec<u8>],
        g: &Geometry,
        stripes: u64,
        data: &[u8],
        skip: &[u16],
        what: &str,
    ) {
        let c = g.chunk_bytes() as usize;
        let nd = g.data_chunks();
        let parity = Parity::new();
        for s in 0..stripes {
            let st = g.stripe(s);
            let base = s as usize * c;
            let mut rows: Vec<&[u8]> = vec![&[][..]; usize::from(nd)];
            for k in 0..nd {
                let d = &data[(s as usize * usize::from(nd) + usize::from(k)) * c..][..c];
                rows[usize::from(st.q_slot(k))] = d;
                let m = st.data_member(k);
                if !skip.contains(&m) {
                    assert!(
                        images[usize::from(m)][base..base + c] == d[..],
                        "{what}: stripe {s} data chunk {k} on member {m} differs"
                    );
                }
            }
            let mut p = AlignedBuf::zeroed(c);
            let mut q = AlignedBuf::zeroed(c);
            match st.q_member() {
                Some(_) => parity.gen_pq(&rows, &mut p, &mut q),
                None => parity.gen_p(&rows, &mut p),
            }
            let pm = st.p_member();
            if !skip.contains(&pm) {
                assert!(
                    images[usize::from(pm)][base..base + c] == p[..],
                    "{what}: stripe {s} P on member {pm} is wrong"
                );
            }
            if let Some(qm) = st.q_member() {
                if !skip.contains(&qm) {
                    assert!(
                        images[usize::from(qm)][base..base + c] == q[..],
                        "{what}: stripe {s} Q on member {qm} is wrong"
                    );
                }
            }
        }
    }

    fn read_all(
        arr: &mut Array<crate::sim::SimChannel>,
        clock: &SimClock,
        tag: u64,
    ) -> (Result<(), ArrayError>, AlignedBuf) {
        let cap = arr.geometry().capacity_bytes() as usize;
        let mut got = AlignedBuf::zeroed(cap);
        let st = rw(arr, clock, tag, ArrayOp::Read, 0, &mut got);
        (st, got)
    }

    fn lost_sets(level: Level, n: u16) -> Vec<Vec<u16>> {
        let mut v: Vec<Vec<u16>> = vec![vec![]];
        for a in 0..n {
            v.push(vec![a]);
            if level == Level::Raid6 {
                for b in a + 1..n {
                    v.push(vec![a, b]);
                }
            }
        }
        v
    }

    /// Every layout, every set of members lost before the writes (so some stripes lose
    /// P, some Q, some P and Q, some data): full-stripe writes (concurrent) first meet the
    /// loss as member write errors, then run degraded; survivors hold the right data and
    /// parity, and everything reads back, also after losing what redundancy remains.
    #[test]
    fn degraded_full_stripe_writes_every_layout_every_loss() {
        let stripes = 10;
        for (level, n) in [
            (Level::Raid5, 3),
            (Level::Raid5, 4),
            (Level::Raid6, 4),
            (Level::Raid6, 5),
        ] {
            for layout in Layout::ALL {
                for lost in lost_sets(level, n) {
                    let cfg = four_ops();
                    let (mut arr, devs, clock, g) = world(level, layout, n, stripes, cfg);
                    let what = format!("{level:?} {layout:?} n={n} lost {lost:?}");
                    let (st0, _) = write_stripes(&mut arr, &clock, 1, 10);
                    assert!(st0.iter().all(Result::is_ok), "{what}: {st0:?}");
                    for &m in &lost {
                        devs[usize::from(m)].disappear();
                    }
                    // Round 1 meets the loss mid-write; round 2 runs degraded from the start.
                    for round in 0..2u64 {
                        let (st, data) =
                            write_stripes(&mut arr, &clock, 100 + round, 1000 * (round + 1));
                        assert!(st.iter().all(Result::is_ok), "{what} round {round}: {st:?}");
                        let images: Vec<Vec<u8>> = devs.iter().map(SimDevice::contents).collect();
                        check_images(
                            &images,
                            &g,
                            stripes,
                            &data,
                            &lost,
                            &format!("{what} round {round}"),
                        );
                        let (rs, got) = read_all(&mut arr, &clock, 5000 + round);
                        assert_eq!(rs, Ok(()), "{what}");
                        assert!(
                            got[..] == data[..],
                            "{what} round {round}: read-back differs"
                        );
                    }
                    let stt = arr.stats();
                    assert!(stt.full_stripe_writes >= 3 * stripes, "{what}: {stt:?}");
                }
            }
        }
    }

    /// A member write error, a torn write or a hung write (timed out) on one member in the
    /// middle of a run of concurrent full-stripe writes: the writes complete, the member
    /// fails, the survivors hold the right data and parity, and (RAID6) everything reads
    /// back after losing one more member.
    #[test]
    fn full_stripe_writes_with_a_member_write_fault() {
        let stripes = 12;
        for (level, n) in [(Level::Raid5, 4), (Level::Raid6, 5)] {
            for layout in [
                Layout::LeftSymmetric,
                Layout::ParityFirst,
                Layout::RightAsymmetric,
            ] {
                for victim in 0..n {
                    for fault in [
                        Fault::Error(IoError::Io { errno: 5 }),
                        Fault::Torn { blocks: 1 },
                        Fault::Hang,
                    ] {
                        let cfg = ArrayConfig {
                            stripe_ops: 6,
                            io_timeout_ns: 5_000_000,
                            ..ArrayConfig::default()
                        };
                        let (mut arr, devs, clock, g) = world(level, layout, n, stripes, cfg);
                        let what = format!("{level:?} {layout:?} victim {victim} {fault:?}");
                        devs[usize::from(victim)].add_fault(FaultRule {
                            filter: OpFilter::Write,
                            range: Some(4096 * 5..4096 * 6),
                            fault,
                            probability: 1.0,
                            count: Some(1),
                        });
                        let (st, data) = write_stripes(&mut arr, &clock, 7, 10);
                        assert!(st.iter().all(Result::is_ok), "{what}: {st:?}");
                        let failed: Vec<u16> = arr
                            .member_states()
                            .enumerate()
                            .filter(|(_, s)| s.is_failed())
                            .map(|(m, _)| m as u16)
                            .collect();
                        assert_eq!(failed, vec![victim], "{what}");
                        let images: Vec<Vec<u8>> = devs.iter().map(SimDevice::contents).collect();
                        check_images(&images, &g, stripes, &data, &failed, &what);
                        // Write again while degraded, then lose one more (RAID6).
                        let (st, data) = write_stripes(&mut arr, &clock, 8, 100);
                        assert!(st.iter().all(Result::is_ok), "{what}: {st:?}");
                        let images: Vec<Vec<u8>> = devs.iter().map(SimDevice::contents).collect();
                        check_images(&images, &g, stripes, &data, &failed, &what);
                        if level == Level::Raid6 {
                            devs[usize::from((victim + 2) % n)].disappear();
                        }
                        let (rs, got) = read_all(&mut arr, &clock, 999);
                        assert_eq!(rs, Ok(()), "{what}");
                        assert!(got[..] == data[..], "{what}: read-back differs");
                    }
                }
            }
        }
    }

    /// Drives the replace to its end while full-stripe writes run (optionally losing the
    /// member being replaced part-way), swaps the replacement in, and checks every member
    /// image, the replacement's included, then reads back after losing what parity covers.
    fn replace_case(level: Level, n: u16, layout: Layout, slot: u16, fail_old: bool) {
        let stripes = 16;
        let cfg = four_ops();
        let (mut arr, devs, clock, g) = world(level, layout, n, stripes, cfg);
        let what = format!("{level:?} {layout:?} replace {slot} fail_old {fail_old}");
        write_stripes(&mut arr, &clock, 3, 10);
        let new = SimDevice::new(
            "new",
            stripes * 4096,
            512,
            Profile::fixed(1500),
            clock.clone(),
            99,
        )
        .unwrap();
        arr.start_replace(slot, new.open_channel().unwrap(), 1, 0)
            .unwrap();
        // Writes while the copy runs.
        let mut data = pattern(4, arr.geometry().capacity_bytes() as usize);
        let sb = g.stripe_data_bytes() as usize;
        let mut rounds = 0u64;
        let mut next_tag = 1000u64;
        loop {
            rounds += 1;
            let mut tags = Vec::new();
            arr.set_now(clock.now_ns());
            data = pattern(4 + rounds, data.len());
            for (i, piece) in data.chunks_mut(sb).enumerate() {
                submit_at(
                    &mut arr,
                    next_tag,
                    ArrayOp::Write { fua: false },
                    (i * sb) as u64,
                    piece,
                );
                tags.push(next_tag);
                next_tag += 1;
            }
            if fail_old && rounds == 2 {
                devs[usize::from(slot)].disappear();
            }
            let st = complete_all(&mut arr, &clock, &tags);
            assert!(st.iter().all(Result::is_ok), "{what}: {st:?}");
            if arr.replace_finished(1) || rounds > 50 {
                break;
            }
            turn(&mut arr, &clock);
            clock.advance_by(500);
        }
        for _ in 0..100_000 {
            if arr.replace_finished(1) {
                break;
            }
            turn(&mut arr, &clock);
            clock.advance_by(1000);
        }
        assert!(
            arr.replace_finished(1),
            "{what}: replace never finished {:?}",
            arr.replacement()
        );
        // Check the images now: the member's (if in service) and the replacement's.
        let mut images: Vec<Vec<u8>> = devs.iter().map(SimDevice::contents).collect();
        let skip: Vec<u16> = if fail_old { vec![slot] } else { vec![] };
        check_images(
            &images,
            &g,
            stripes,
            &data,
            &skip,
            &format!("{what} before swap"),
        );
        images[usize::from(slot)] = new.contents();
        check_images(
            &images,
            &g,
            stripes,
            &data,
            &[],
            &format!("{what} replacement"),
        );
        assert!(arr.complete_replace(1), "{what}");
        turn(&mut arr, &clock);
        // One more round of full-stripe writes on the swapped array.
        let (st, data) = write_stripes(&mut arr, &clock, 77, 50_000);
        assert!(st.iter().all(Result::is_ok), "{what}: {st:?}");
        images = devs.iter().map(SimDevice::contents).collect();
        images[usize::from(slot)] = new.contents();
        check_images(
            &images,
            &g,
            stripes,
            &data,
            &[],
            &format!("{what} after swap"),
        );
        // Lose what parity covers (never the replacement's slot itself first).
        let other = (slot + 1) % n;
        devs[usize::from(other)].disappear();
        if level == Level::Raid6 {
            devs[usize::from((slot + 2) % n)].disappear();
        }
        let (rs, got) = read_all(&mut arr, &clock, 60_000);
        assert_eq!(rs, Ok(()), "{what}");
        assert!(got[..] == data[..], "{what}: read-back differs");
    }

    #[test]
    fn full_stripe_writes_during_a_replace() {
        for (level, n) in [(Level::Raid5, 4), (Level::Raid6, 5)] {
            for layout in [Layout::LeftSymmetric, Layout::ParityLast] {
                for slot in 0..n {
                    for fail_old in [false, true] {
                        replace_case(level, n, layout, slot, fail_old);
                    }
                }
            }
        }
    }

    /// Degraded compare-and-write, OR-write and zeroing fallback over whole stripes, with P
    /// or Q (or both) lost on some stripes.
    #[test]
    fn degraded_whole_stripe_combining_writes_and_zeroes() {
        let stripes = 6u64;
        for (level, n) in [(Level::Raid5, 4), (Level::Raid6, 5)] {
            for lost in lost_sets(level, n).into_iter().filter(|l| !l.is_empty()) {
                let (mut arr, devs, clock, g) = world(
                    level,
                    Layout::LeftSymmetric,
                    n,
                    stripes,
                    ArrayConfig::default(),
                );
                let what = format!("{level:?} lost {lost:?}");
                let (_, mut want) = write_stripes(&mut arr, &clock, 1, 10);
                for &m in &lost {
                    devs[usize::from(m)].disappear();
                }
                // Trigger detection of the loss.
                let (_, w2) = write_stripes(&mut arr, &clock, 2, 100);
                want.copy_from_slice(&w2);
                let sb = g.stripe_data_bytes() as usize;
                // Compare-and-write of stripes 1 and 2 (each whole).
                for (j, stripe) in [1usize, 2].into_iter().enumerate() {
                    let new = pattern(30 + stripe as u64, sb);
                    let mut caw = AlignedBuf::zeroed(2 * sb);
                    caw[..sb].copy_from_slice(&want[stripe * sb..(stripe + 1) * sb]);
                    caw[sb..].copy_from_slice(&new);
                    assert_eq!(
                        rw(
                            &mut arr,
                            &clock,
                            200 + 10 * j as u64,
                            ArrayOp::CompareAndWrite { fua: j == 1 },
                            (stripe * sb) as u64,
                            &mut caw
                        ),
                        Ok(()),
                        "{what} caw"
                    );
                    want[stripe * sb..(stripe + 1) * sb].copy_from_slice(&new);
                }
                // OR-write over stripes 3..5.
                let mut orb = pattern(4, 2 * sb);
                for (i, b) in orb.iter_mut().enumerate() {
                    *b &= 0x0f;
                    let _ = i;
                }
                let mut expect = orb.to_vec();
                for (e, o) in expect.iter_mut().zip(&want[3 * sb..5 * sb]) {
                    *e |= o;
                }
                assert_eq!(
                    rw(
                        &mut arr,
                        &clock,
                        201,
                        ArrayOp::OrWrite { fua: false },
                        3 * sb as u64,
                        &mut orb
                    ),
                    Ok(()),
                    "{what} or"
                );
                want[3 * sb..5 * sb].copy_from_slice(&expect);
                // Write-zeroes of stripe 5 with native zeroing refused by one survivor.
                let survivor = (0..n).find(|m| !lost.contains(m)).unwrap();
                devs[usize::from(survivor)].add_fault(FaultRule {
                    filter: OpFilter::Write,
                    range: None,
                    fault: Fault::Error(IoError::Unsupported),
                    probability: 1.0,
                    count: Some(1),
                });
                submit_dataless(
                    &mut arr,
                    202,
                    ArrayOp::WriteZeroes { fua: false },
                    5 * sb as u64,
                    sb as u64,
                );
                assert_eq!(complete(&mut arr, &clock, 202), Ok(()), "{what} zeroes");
                want[5 * sb..6 * sb].fill(0);
                let images: Vec<Vec<u8>> = devs.iter().map(SimDevice::contents).collect();
                check_images(&images, &g, stripes, &want, &lost, &what);
                let (rs, got) = read_all(&mut arr, &clock, 300);
                assert_eq!(rs, Ok(()), "{what}");
                assert!(got[..] == want[..], "{what}: read-back differs");
            }
        }
    }
}

/// A sequential stream of sub-stripe writes recycles each stripe's entry first once the
/// stream has left the stripe (the next stripe's pass works in buffers the CPU caches
/// still hold); a region rewritten in laps that the cache can hold is noticed (a miss on
/// a stripe recycled lately) and stays cached from then on; a stream of writes larger
/// than a stripe keeps recency order (it pins only the stripes its writes share). Either
/// way the data and parity are right.
#[test]
fn a_stream_recycles_the_stripes_it_left_unless_it_comes_back() {
    let chunk = 16usize << 10;
    let stripe = 4 * chunk;
    let cfg = ArrayConfig {
        stripe_ops: 4,
        stripe_cache_entries: 4,
        ..ArrayConfig::default()
    };
    // 4 entries of 64 KiB of data. (stripes, laps, write bytes, entries recycled, the
    // laps from which every stripe is a hit).
    for (stripes, laps, write, recycled, hits_from) in [
        // One long stream: every stripe it leaves.
        (12usize, 1, 4096usize, 12..=12, None),
        // A region the cache holds, rewritten: the first lap recycles its two stripes,
        // the second misses on them (ghosts: the cache turns cautious) and keeps them,
        // the third finds them cached.
        (2, 4, 4096, 2..=2, Some(2)),
        // Writes larger than a stripe: recency order.
        (12, 1, 96 << 10, 0..=0, None),
    ] {
        let what = format!("{stripes} stripes × {laps} of {write}-byte writes");
        let (mut arr, devs, clock) = sim_array_with(
            Level::Raid5,
            5,
            chunk as u64,
            512,
            16,
            Profile::fixed(10_000),
            cfg,
        );
        let mut want = fill_array(&mut arr, &clock, |i| (i * 7 + 3) as u8).to_vec();
        let mut tag = 100;
        let mut hits_per_lap = Vec::new();
        for lap in 0..laps {
            let hits = arr.stats().cache_hit_stripes;
            for w in 0..stripes * stripe / write {
                let off = w * write;
                let mut b = AlignedBuf::zeroed(write);
                b.fill((lap * 31 + w) as u8);
                tag += 1;
                let op = ArrayOp::Write { fua: false };
                let st = rw(&mut arr, &clock, tag, op, off as u64, &mut b);
                assert_eq!(st, Ok(()), "{what}: lap {lap} write {w}");
                want[off..off + write].copy_from_slice(&b);
            }
            hits_per_lap.push(arr.stats().cache_hit_stripes - hits);
        }
        let demoted = arr.cache.demoted();
        assert!(recycled.contains(&demoted), "{what}: {demoted} recycled");
        if let Some(from) = hits_from {
            assert!(
                hits_per_lap[from..].iter().all(|&h| h >= stripes as u64),
                "{what}: later laps find the region cached: {hits_per_lap:?}"
            );
        }
        assert_reads_back(
            &mut arr,
            &clock,
            1,
            &want,
            &format!("{what}: read-back differs"),
        );
        devs[2].disappear();
        assert_reads_back(
            &mut arr,
            &clock,
            2,
            &want,
            &format!("{what}: parity inconsistent"),
        );
    }
}

/// Random sub-stripe writes (none starts where another ended) go around the stripe cache
/// while they touch stripes for the first time; a write that comes back to a stripe
/// written lately runs as a pass, and from then on that stripe's old data and P/Q come
/// from the cache: a hot region the cache holds is rewritten without member reads. Not on
/// members whose writes take less than `CACHE_ADMIT_WRITE_LATENCY_NS`: there every lap
/// reads. The data and P/Q on the members are right throughout.
#[test]
fn random_writes_that_come_back_to_their_stripes_are_cached() {
    for latency_ns in [10_000, 1_000] {
        random_rewrites(
            latency_ns,
            latency_ns >= super::pass::CACHE_ADMIT_WRITE_LATENCY_NS,
        );
    }
}

/// [`random_writes_that_come_back_to_their_stripes_are_cached`] on members of fixed
/// `latency_ns`; `cached`: whether the hot laps must stop reading (and reads of what they
/// wrote be served from the cache).
fn random_rewrites(latency_ns: u64, cached: bool) {
    let chunk = 16u64 << 10;
    let stripe = 4 * chunk;
    let cfg = ArrayConfig {
        stripe_ops: 4,
        stripe_cache_entries: 8,
        ..ArrayConfig::default()
    };
    let (mut arr, devs, clock) = sim_array_with(
        Level::Raid6,
        6,
        chunk,
        512,
        32,
        Profile::fixed(latency_ns),
        cfg,
    );
    let mut want = fill_array(&mut arr, &clock, |i| (i * 13 + 5) as u8).to_vec();
    let member_reads = |devs: &[SimDevice]| devs.iter().map(|d| d.stats().reads).sum::<u64>();
    let mut tag = 100;
    let mut write = |arr: &mut Array<crate::sim::SimChannel>, want: &mut [u8], off: u64| {
        let mut b = AlignedBuf::zeroed(4096);
        b.fill(tag as u8);
        tag += 1;
        let st = rw(arr, &clock, tag, ArrayOp::Write { fua: false }, off, &mut b);
        assert_eq!(st, Ok(()), "write at {off}");
        want[off as usize..off as usize + 4096].copy_from_slice(&b);
    };
    // One write to each of the 32 stripes (4× the cache), in a scattered order, at a
    // block that moves around the stripe: first touches only, nothing goes through the
    // cache.
    for i in 0..32u64 {
        let s = i * 7 % 32;
        write(
            &mut arr,
            &mut want,
            s * stripe + (i % 4) * chunk + 4096 * (i % 3),
        );
    }
    assert_eq!(arr.stats().cache_hit_stripes, 0, "{:?}", arr.stats());
    assert!(
        (0..32).all(|s| !arr.cache.holds(s)),
        "first touches were cached"
    );
    // A hot set in four stripes the cache holds, rewritten in laps (database pages):
    // the first lap runs around the cache (the stripes were written long ago), the
    // second is admitted (it reads what it lacks into the cache), the later ones read
    // nothing from the members.
    // (Four stripes that share no slot of the cache's bypass filter, which is
    // direct-mapped: two sharing one would push each other out lap after lap.)
    let mut hot_stripes = Vec::new();
    for s in 0..32u64 {
        let slot = arr.cache.bypass_slot(s);
        if hot_stripes.len() < 4
            && hot_stripes
                .iter()
                .all(|&h| arr.cache.bypass_slot(h) != slot)
        {
            hot_stripes.push(s);
        }
    }
    let at = [8192u64, chunk + 4096, 3 * chunk, 2 * chunk + 12288];
    let hot: Vec<(u64, u64)> = [2, 0, 3, 1].map(|i| (hot_stripes[i], at[i])).to_vec();
    let mut reads_per_lap = Vec::new();
    for _ in 0..5 {
        let before = member_reads(&devs);
        for &(s, at) in &hot {
            write(&mut arr, &mut want, s * stripe + at);
        }
        reads_per_lap.push(member_reads(&devs) - before);
    }
    if cached {
        assert!(
            reads_per_lap[0] > 0 && reads_per_lap[1] > 0,
            "the first two laps read old data and P/Q: {reads_per_lap:?}"
        );
        assert_eq!(
            reads_per_lap[2..],
            [0, 0, 0],
            "later laps find everything cached: {reads_per_lap:?}"
        );
        assert!(
            arr.stats().cache_hit_bytes >= 3 * 4 * 3 * 4096,
            "{:?}",
            arr.stats()
        );
    } else {
        // RAID6 RMW of 4 KiB inside one chunk: old data, P and Q.
        assert_eq!(reads_per_lap, [12; 5], "{latency_ns} ns members");
        assert_eq!(arr.stats().cache_hit_stripes, 0, "{:?}", arr.stats());
    }
    // Reads of the hot blocks: served from the cache where the laps are cached (no
    // member read), from the members otherwise; and a block the cache lacks (the stripe's
    // other chunks were never read or written through it) from its member.
    let (before, served) = (member_reads(&devs), arr.stats().cache_reads);
    let read_4k = |arr: &mut Array<crate::sim::SimChannel>, tag: u64, off: u64, want: &[u8]| {
        let mut b = AlignedBuf::zeroed(4096);
        assert_eq!(rw(arr, &clock, tag, ArrayOp::Read, off, &mut b), Ok(()));
        assert!(
            b[..] == want[off as usize..off as usize + 4096],
            "read at {off}"
        );
        arr.stats().cache_reads - served
    };
    for (i, &(s, at)) in hot.iter().enumerate() {
        read_4k(&mut arr, 900 + i as u64, s * stripe + at, &want);
    }
    let n = u64::from(cached) * 4;
    assert_eq!(
        arr.stats().cache_reads - served,
        n,
        "{latency_ns} ns members"
    );
    assert_eq!(
        member_reads(&devs) - before,
        4 - n,
        "{latency_ns} ns members"
    );
    let off = hot[0].0 * stripe + (hot[0].1 + chunk) % stripe;
    assert_eq!(
        read_4k(&mut arr, 910, off, &want),
        n,
        "{latency_ns} ns members"
    );
    // A whole-stripe write of a hot stripe goes around the cache and drops its entry: a
    // read of the block after it gets the new data, from the member.
    let (s0, at0) = hot[0];
    let mut whole = AlignedBuf::zeroed(stripe as usize);
    whole.fill(0xe7);
    let st = rw(
        &mut arr,
        &clock,
        920,
        ArrayOp::Write { fua: false },
        s0 * stripe,
        &mut whole,
    );
    assert_eq!(st, Ok(()));
    want[(s0 * stripe) as usize..((s0 + 1) * stripe) as usize].fill(0xe7);
    assert_eq!(
        read_4k(&mut arr, 921, s0 * stripe + at0, &want),
        n,
        "{latency_ns} ns members"
    );
    assert_reads_back(&mut arr, &clock, 1, &want, "read-back differs");
    let bad = super::gather_tests::parity_mismatches(&arr, &devs);
    assert!(bad.is_empty(), "P/Q wrong in stripes {bad:?}");
    devs[4].disappear();
    assert_reads_back(&mut arr, &clock, 2, &want, "degraded read-back differs");
}

// Adversarial streams against the recycling stripe cache and the bulk backlog. Seeds
// and length: FERRORAID_STRESS_SEEDS (how many, default 8), FERRORAID_STRESS_FROM (the
// first, default 0), FERRORAID_STRESS_OPS (requests of the pure-stream runs, default
// 3000); FERRORAID_STRESS_TRACE=FILE appends one line per run with a hash of the
// completion order, to compare two builds' behaviour run by run (docs/TESTING.md).

/// xorshift64*, deterministic per seed.
struct StressRng(u64);
impl StressRng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

struct StressPending {
    write: bool,
    off: u64,
    len: u64,
    buf: AlignedBuf,
    want: Option<Vec<u8>>,
}

/// The backlog's bulk-write counter equals what the backlog holds.
fn check_backlog_bulk(arr: &Array<crate::sim::SimChannel>, what: &str) {
    let n = arr
        .backlog
        .iter()
        .filter(|&&r| arr.reqs.get(r).expect("live").class == RequestClass::BulkWrite)
        .count();
    assert_eq!(arr.backlog_bulk as usize, n, "{what}: backlog_bulk drifted");
}

/// Streams of sub-stripe writes (several at once, each wrapping in a region of about the
/// cache's size), write-zeroes and discards inside the streams, reads right behind the
/// streams' cursors, random reads and writes, flushes, at a random queue depth, on a small
/// stripe cache; members fail mid-stream (`fails`: at which op, up to the redundancy).
/// Every read equals the reference; at the end the whole array reads back as written,
/// and again with one more member gone when the redundancy allows. Every fourth seed
/// (3, 7, …) runs on members whose channels do not gather, so the passes copy what the
/// others write gathered. Returns the stripes the cache demoted (recycled) during the run
/// and the data chunks written gathered.
#[allow(clippy::too_many_arguments)]
fn stream_stress(
    level: Level,
    members: u16,
    seed: u64,
    entries: usize,
    streams: usize,
    ops: usize,
    fails: &[usize],
    bulk_pct: Option<usize>,
    turn_bytes: Option<u64>,
    pure: bool,
) -> (u64, u64) {
    let chunk = 16u64 << 10;
    let nstripes = 24u64;
    let g = Geometry::new(level, Layout::LeftSymmetric, members, chunk, 512).unwrap();
    let sb = g.stripe_data_bytes();
    let cap = sb * nstripes;
    let cfg = ArrayConfig {
        requests: 32,
        stripe_ops: 4,
        stripe_cache_entries: entries,
        bulk_share_percent: bulk_pct,
        bulk_bytes_per_turn: turn_bytes.unwrap_or(BULK_BYTES_PER_TURN),
        ..ArrayConfig::default()
    };
    let (mut arr, devs, clock) = sim_array_of(
        g,
        nstripes,
        |i| {
            let mut p = Profile::fixed(5_000 + 3_000 * u64::from(i));
            if i % 2 == 1 {
                p.write_bytes_per_s = 200 << 20;
                p.parallelism = 2;
            }
            (p, 1 + u64::from(i))
        },
        cfg,
    );
    let gather = seed % 4 != 3;
    for d in &devs {
        d.set_gather(gather);
    }
    let what0 = format!("{level:?} members={members} seed={seed} entries={entries} streams={streams} fails={fails:?} bulk={bulk_pct:?} turn={turn_bytes:?} pure={pure} gather={gather}");
    let mut rng = StressRng::new(seed);
    let mut reference = vec![0u8; cap as usize];
    // Streams: (region start, region length, cursor).
    let cache_bytes = entries.max(4) as u64 * sb;
    let mut strm: Vec<(u64, u64, u64)> = (0..streams)
        .map(|_| {
            let region = match rng.below(5) {
                0 => cache_bytes - sb,
                1 => cache_bytes,
                2 => cache_bytes + sb,
                3 => cache_bytes / 2,
                _ => cap,
            }
            .clamp(sb, cap);
            let start = if region == cap {
                0
            } else {
                (rng.below((cap - region) / sb + 1)) * sb
            };
            (start, region, start)
        })
        .collect();
    let mut inflight: std::collections::HashMap<u64, StressPending> =
        std::collections::HashMap::new();
    let mut tag = 1000u64;
    let mut issued = 0usize;
    let mut failed = 0usize;
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    let redundancy = usize::from(g.parity_chunks());
    let mut depth = 1 + rng.below(16) as usize;
    let mut turns = 0u64;
    let mut trace = 0xcbf2_9ce4_8422_2325u64;
    let mut reads_checked = 0u64;
    while issued < ops || !inflight.is_empty() {
        turns += 1;
        assert!(turns < 5_000_000, "{what0}: no end");
        if failed < fails.len() && issued >= fails[failed] {
            let m = ((seed as usize + 2 * failed) % usize::from(members)) as u16;
            devs[usize::from(m)].disappear();
            failed += 1;
        }
        if rng.below(64) == 0 {
            depth = 1 + rng.below(16) as usize;
        }
        while issued < ops && inflight.len() < depth {
            let mut kind = rng.below(100);
            if pure {
                // Mostly the streams, reads right behind them, a few flushes.
                kind = if kind < 85 {
                    0
                } else if kind < 96 {
                    60
                } else {
                    82
                };
            }
            let (op, off, len) = if kind < 55 {
                // A stream write.
                let k = rng.below(strm.len() as u64) as usize;
                let (start, region, cursor) = strm[k];
                let max = if rng.below(4) == 0 { 64 } else { 16 };
                let mut len = 512 * (1 + rng.below(max));
                len = len.min(sb - 512).min(region);
                let mut off = cursor;
                if off + len > start + region {
                    off = start;
                }
                strm[k].2 = off + len;
                let op = match rng.below(20) {
                    0 => ArrayOp::WriteZeroes {
                        fua: rng.below(2) == 0,
                    },
                    1 => ArrayOp::Discard,
                    2 => ArrayOp::Write { fua: true },
                    _ => ArrayOp::Write { fua: false },
                };
                (op, off, len)
            } else if kind < 70 {
                // A read right behind a stream's cursor (the stripe it just left).
                let k = rng.below(strm.len() as u64) as usize;
                let (start, _, cursor) = strm[k];
                let len = 512 * (1 + rng.below(2 * sb / 512));
                let off = cursor
                    .saturating_sub(len / 2 + 512 * rng.below(64))
                    .max(start)
                    / 512
                    * 512;
                let len = len.min(cap - off);
                (ArrayOp::Read, off, len)
            } else if kind < 80 {
                let len = 512 * (1 + rng.below(3 * sb / 512));
                let off = 512 * rng.below((cap - len) / 512 + 1);
                (ArrayOp::Read, off, len)
            } else if kind < 85 {
                (ArrayOp::Flush, 0, 0)
            } else {
                let len = if rng.below(2) == 0 {
                    512 * (1 + rng.below(16))
                } else {
                    512 * (1 + rng.below(3 * sb / 512))
                };
                let off = 512 * rng.below((cap - len) / 512 + 1);
                let op = if rng.below(10) == 0 {
                    ArrayOp::Discard
                } else {
                    ArrayOp::Write { fua: false }
                };
                (op, off, len)
            };
            let ov = |a: (u64, u64), b: (u64, u64)| a.0 < b.0 + b.1 && b.0 < a.0 + a.1;
            let write = op.is_write();
            let clash = inflight.values().any(|p| {
                (write || p.write)
                    && p.len > 0
                    && ov((p.off, p.len), (off, len))
                    && (write != p.write)
            });
            if clash {
                break;
            }
            let mut buf = AlignedBuf::zeroed(len as usize);
            let (a, b) = (off as usize, (off + len) as usize);
            let want = match op {
                ArrayOp::Write { .. } => {
                    for x in buf.iter_mut() {
                        *x = rng.next() as u8;
                    }
                    reference[a..b].copy_from_slice(&buf);
                    None
                }
                ArrayOp::WriteZeroes { .. } => {
                    reference[a..b].fill(0);
                    None
                }
                ArrayOp::Discard => {
                    let first = off.div_ceil(sb) * sb;
                    let last = (off + len) / sb * sb;
                    if first < last {
                        reference[first as usize..last as usize].fill(0);
                    }
                    None
                }
                ArrayOp::Read => Some(reference[a..b].to_vec()),
                _ => None,
            };
            tag += 1;
            if op.is_flush() || matches!(op, ArrayOp::WriteZeroes { .. } | ArrayOp::Discard) {
                submit_dataless(&mut arr, tag, op, off, len);
            } else {
                submit_at(&mut arr, tag, op, off, &mut buf);
            }
            inflight.insert(
                tag,
                StressPending {
                    write,
                    off,
                    len: if op.is_flush() { 0 } else { len },
                    buf,
                    want,
                },
            );
            issued += 1;
        }
        arr.set_now(clock.now_ns());
        let progressed = arr.process();
        check_backlog_bulk(&arr, &what0);
        let n = arr.poll(&mut out);
        for c in &out[..n] {
            trace = trace.wrapping_mul(0x100_0000_01B3) ^ c.tag ^ clock.now_ns().rotate_left(32);
            let p = inflight.remove(&c.tag).expect("known tag");
            assert_eq!(
                c.status,
                Ok(()),
                "{what0}: tag {} at {} len {}",
                c.tag,
                p.off,
                p.len
            );
            if let Some(want) = p.want {
                reads_checked += 1;
                if p.buf[..] != want[..] {
                    let first = (0..want.len()).find(|&i| p.buf[i] != want[i]).unwrap();
                    panic!(
                        "{what0}: read tag {} of {}+{} differs first at array byte {} (stripe {}) after {issued} ops",
                        c.tag,
                        p.off,
                        p.len,
                        p.off + first as u64,
                        (p.off + first as u64) / sb
                    );
                }
            }
        }
        if !progressed && n == 0 {
            let next = arr
                .channels()
                .filter_map(|c| c.next_completion_ns())
                .chain(arr.next_deadline_ns())
                .min();
            match next {
                Some(t) => clock.advance_to(t.max(clock.now_ns())),
                None => assert!(
                    inflight.is_empty() || issued < ops,
                    "{what0}: stalled with {} in flight",
                    inflight.len()
                ),
            }
        }
    }
    if let Ok(path) = std::env::var("FERRORAID_STRESS_TRACE") {
        use std::io::Write as _;
        let st = arr.stats();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        writeln!(
            f,
            "{what0} trace={trace:016x} now={} overtaking={} hits={} demoted={} reads={reads_checked}",
            clock.now_ns(),
            st.overtaking_requests,
            st.cache_hit_stripes,
            arr.cache.demoted()
        )
        .unwrap();
    }
    assert_reads_back(
        &mut arr,
        &clock,
        1,
        &reference,
        &format!("{what0}: final read-back differs"),
    );
    if failed < redundancy {
        let m = ((seed as usize + 2 * failed + 1) % usize::from(members)) as u16;
        devs[usize::from(m)].disappear();
        assert_reads_back(
            &mut arr,
            &clock,
            2,
            &reference,
            &format!("{what0}: parity inconsistent (read with member {m} gone)"),
        );
    }
    let gathered = arr.stats().gathered_writes;
    if !gather {
        assert_eq!(
            gathered, 0,
            "{what0}: gathered writes on members that do not gather"
        );
    }
    (arr.cache.demoted(), gathered)
}

/// The seeds of the stream stress tests (see the comment above `StressRng`).
fn stress_seeds() -> std::ops::Range<u64> {
    let n = std::env::var("FERRORAID_STRESS_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8u64);
    let from = std::env::var("FERRORAID_STRESS_FROM")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0u64);
    from..from + n
}

#[test]
fn streams_on_a_small_cache_read_back_what_was_written() {
    for seed in stress_seeds() {
        for (level, members) in [(Level::Raid5, 5), (Level::Raid6, 6)] {
            for entries in [4usize, 5, 8] {
                for streams in [1usize, 2, 3] {
                    stream_stress(
                        level,
                        members,
                        seed,
                        entries,
                        streams,
                        1500,
                        &[],
                        None,
                        None,
                        false,
                    );
                }
            }
        }
    }
}

#[test]
fn streams_with_members_failing_mid_stream_read_back_what_was_written() {
    for seed in stress_seeds() {
        for (level, members, fails) in [
            (Level::Raid5, 5u16, &[700usize][..]),
            (Level::Raid6, 6, &[500, 1000][..]),
            (Level::Raid6, 6, &[900][..]),
        ] {
            for entries in [4usize, 6] {
                for streams in [1usize, 2] {
                    stream_stress(
                        level, members, seed, entries, streams, 1500, fails, None, None, false,
                    );
                }
            }
        }
    }
}

#[test]
fn streams_with_a_pinned_bulk_share_read_back_what_was_written() {
    for seed in stress_seeds() {
        for pct in [1usize, 25, 50] {
            for turn in [None, Some(512u64), Some(20 << 10)] {
                stream_stress(
                    Level::Raid5,
                    5,
                    seed,
                    4,
                    2,
                    1500,
                    &[],
                    Some(pct),
                    turn,
                    false,
                );
                stream_stress(
                    Level::Raid6,
                    6,
                    seed,
                    5,
                    3,
                    1500,
                    &[800],
                    Some(pct),
                    turn,
                    false,
                );
            }
        }
    }
}

/// Bulk writes fill the bulk share (or spend the turn's bulk bytes) with small reads, a
/// flush and a small non-sequential write behind them: those go ahead of the queued bulk
/// writes (nothing starves), a read overlapping a queued bulk write waits for it and sees
/// its data, the backlog's bulk counter stays exact, and everything reads back as written.
#[test]
fn requests_behind_waiting_bulk_writes_go_ahead_and_read_what_was_written() {
    for (pct, turn) in [
        (Some(25usize), BULK_BYTES_PER_TURN),
        (Some(100), 512),
        (Some(1), 512),
        (None, 4096),
    ] {
        for level in [Level::Raid5, Level::Raid6] {
            let members = if level == Level::Raid5 { 5 } else { 6 };
            let cfg = ArrayConfig {
                stripe_ops: 4,
                stripe_cache_entries: 4,
                bulk_share_percent: pct,
                bulk_bytes_per_turn: turn,
                ..ArrayConfig::default()
            };
            let g = Geometry::new(level, Layout::LeftSymmetric, members, 16 << 10, 512).unwrap();
            let sb = g.stripe_data_bytes() as usize;
            let (mut arr, _devs, clock) = sim_array_of(
                g,
                64,
                |i| (Profile::fixed(20_000 + 1000 * u64::from(i)), 1),
                cfg,
            );
            let what = format!("{level:?} pct={pct:?} turn={turn}");
            let cap = arr.geometry().capacity_bytes() as usize;
            let mut want = vec![0u8; cap];
            // Six bulk writes of 3 stripes each over stripes 0..18.
            let mut bufs: Vec<AlignedBuf> = Vec::new();
            let mut tags = Vec::new();
            for k in 0..6 {
                let mut b = AlignedBuf::zeroed(3 * sb);
                b.fill(10 + k as u8);
                want[k * 3 * sb..(k + 1) * 3 * sb].copy_from_slice(&b);
                bufs.push(b);
                tags.push(10 + k as u64);
            }
            for (k, b) in bufs.iter_mut().enumerate() {
                submit_at(
                    &mut arr,
                    10 + k as u64,
                    ArrayOp::Write { fua: false },
                    (k * 3 * sb) as u64,
                    b,
                );
            }
            // Behind them: a small read far away, a flush, a small write far away, a small
            // read of what bulk write 4 writes, a sequential sub-stripe write (bulk).
            let mut r1 = AlignedBuf::zeroed(4096);
            submit_at(&mut arr, 1, ArrayOp::Read, (40 * sb + 512) as u64, &mut r1);
            submit_dataless(&mut arr, 2, ArrayOp::Flush, 0, 0);
            let mut w3 = AlignedBuf::zeroed(8192);
            w3.fill(0xA3);
            want[50 * sb + 4096..50 * sb + 4096 + 8192].copy_from_slice(&w3);
            submit_at(
                &mut arr,
                3,
                ArrayOp::Write { fua: false },
                (50 * sb + 4096) as u64,
                &mut w3,
            );
            let mut r4 = AlignedBuf::zeroed(8192);
            let r4_at = 4 * 3 * sb + sb + 1024;
            submit_at(&mut arr, 4, ArrayOp::Read, r4_at as u64, &mut r4);
            let mut w5 = AlignedBuf::zeroed(4096);
            w5.fill(0xB5);
            want[18 * sb..18 * sb + 4096].copy_from_slice(&w5);
            submit_at(
                &mut arr,
                5,
                ArrayOp::Write { fua: false },
                (18 * sb) as u64,
                &mut w5,
            );
            tags.extend([1, 2, 3, 4, 5]);
            let mut order = Vec::new();
            let mut out = [ArrayCompletion {
                tag: 0,
                status: Ok(()),
            }; 16];
            for _ in 0..1_000_000 {
                if order.len() == tags.len() {
                    break;
                }
                arr.set_now(clock.now_ns());
                let more = arr.process();
                check_backlog_bulk(&arr, &what);
                let n = arr.poll(&mut out);
                for c in &out[..n] {
                    assert_eq!(c.status, Ok(()), "{what}: tag {}", c.tag);
                    order.push(c.tag);
                }
                if !more && n == 0 {
                    let next = arr.channels().filter_map(|c| c.next_completion_ns()).min();
                    clock.advance_to(next.expect("member I/O in flight"));
                }
            }
            assert_eq!(
                order.len(),
                tags.len(),
                "{what}: not all completed: {order:?}"
            );
            let pos = |t: u64| order.iter().position(|&x| x == t).unwrap();
            for t in [1, 2, 3] {
                assert!(
                    pos(t) < pos(15),
                    "{what}: {t} waited for the last bulk write: {order:?}"
                );
            }
            assert!(r1.iter().all(|&b| b == 0), "{what}");
            assert!(
                r4[..] == want[r4_at..r4_at + 8192],
                "{what}: overlapping read"
            );
            assert_reads_back(
                &mut arr,
                &clock,
                99,
                &want,
                &format!("{what}: read-back differs"),
            );
        }
    }
}

/// Requests of each pure-stream run (see the comment above `StressRng`).
fn stress_ops() -> usize {
    std::env::var("FERRORAID_STRESS_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000)
}

/// Almost nothing but the streams (so they recycle constantly and the cache turns
/// cautious and back), reads right behind the cursors, members failing mid-stream.
#[test]
fn pure_streams_recycle_and_read_back_what_was_written() {
    let ops = stress_ops();
    let mut demoted = 0;
    let mut gathered = 0;
    for seed in stress_seeds() {
        for (level, members, fails) in [
            (Level::Raid5, 5u16, &[][..]),
            (Level::Raid5, 5, &[ops / 2][..]),
            (Level::Raid6, 6, &[][..]),
            (Level::Raid6, 6, &[ops / 3, 2 * ops / 3][..]),
        ] {
            for entries in [0usize, 4, 5, 7] {
                for streams in [1usize, 2, 3] {
                    let (d, g) = stream_stress(
                        level, members, seed, entries, streams, ops, fails, None, None, true,
                    );
                    demoted += d;
                    gathered += g;
                }
            }
        }
    }
    assert!(demoted > 0, "the streams never recycled a stripe");
    assert!(gathered > 0, "the streams never wrote a chunk gathered");
}
