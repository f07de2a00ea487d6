//! Unit tests of the array's edges. The model-based test (random concurrent I/O against a
//! reference, every layout, 1/2/4 shards, failures) lives in `tests/tests/model.rs`.

use std::ptr::NonNull;

use super::*;
use crate::device::BlockDevice;
use crate::geometry::{Geometry, Layout};
use crate::sim::{Profile, SimClock, SimDevice};

#[test]
fn beyond_redundancy_is_an_error_never_wrong_data() {
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
                1,
            )
            .unwrap()
        })
        .collect();
    let mut arr = Array::new(
        geo,
        devs.iter().map(|d| d.open_channel().unwrap()).collect(),
        Parity::new(),
        ArrayConfig::default(),
    )
    .unwrap();
    devs[0].disappear();
    devs[2].disappear();
    let mut buf = AlignedBuf::zeroed(4096 * 3);
    // SAFETY: buf outlives the request.
    let io = unsafe {
        IoBuf::from_raw(
            NonNull::new(buf.as_mut_ptr()).unwrap(),
            buf.len() as u32,
            None,
        )
    };
    arr.submit(ArrayRequest {
        tag: 7,
        op: ArrayOp::Read,
        offset_bytes: 0,
        len_bytes: io.len(),
        buf: io,
    })
    .unwrap();
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 1];
    for _ in 0..100 {
        arr.process();
        if arr.poll(&mut out) == 1 {
            break;
        }
        if let Some(t) = arr.channels().filter_map(|c| c.next_completion_ns()).min() {
            clock.advance_to(t.max(clock.now_ns()));
        }
    }
    assert_eq!(out[0].tag, 7);
    assert!(
        matches!(
            out[0].status,
            Err(ArrayError::Unrecoverable { .. } | ArrayError::Failed)
        ),
        "{:?}",
        out[0]
    );
    // Malformed requests complete with a clear error instead of panicking.
    for (off, len, why) in [
        (100u64, 512u32, "multiple"),
        (geo.capacity_bytes(), 512, "beyond"),
    ] {
        let mut b = AlignedBuf::zeroed(len as usize);
        // SAFETY: b outlives the request (refused at once).
        let io = unsafe { IoBuf::from_raw(NonNull::new(b.as_mut_ptr()).unwrap(), len, None) };
        arr.submit(ArrayRequest {
            tag: 9,
            op: ArrayOp::Read,
            offset_bytes: off,
            len_bytes: len,
            buf: io,
        })
        .unwrap();
        arr.process();
        assert_eq!(arr.poll(&mut out), 1);
        assert!(
            matches!(out[0].status, Err(ArrayError::Invalid(m)) if m.contains(why)),
            "{:?}",
            out[0]
        );
    }
}
