//! Tests of md's internal bitmap format, sizing, creation and the assembly decisions that
//! depend on it (re-add).

use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::bitmap::*;
use super::*;
use crate::geometry::{Geometry, Layout, Level};

const MIB_SECTORS: u64 = 2048;
const GIB_SECTORS: u64 = 1024 * MIB_SECTORS;

fn rng() -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(11)
}

fn new_array(members: u16, clean: bool, bitmap: BitmapChoice) -> NewArray {
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, members, 64 << 10, 512).unwrap();
    let mut a = NewArray::new(
        g,
        Uuid::random(&mut rng()),
        "bm",
        None,
        MdTime::new(1_700_000_000, 0),
    )
    .unwrap();
    a.clean = clean;
    a.bitmap = bitmap;
    a
}

fn sample() -> BitmapSuper {
    let mut s = BitmapSuper::new(Uuid([7; 16]), 123_456, 1 << 20, 5);
    s.events = 0x1122_3344_5566_7788;
    s.events_cleared = 42;
    s.state = BITMAP_STATE_HOSTENDIAN;
    s.write_behind = 256;
    s.sectors_reserved = 264;
    s.cluster_name[..4].copy_from_slice(b"clus");
    s
}

fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}

fn le64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

#[test]
fn bitmap_super_layout_matches_md_bitmap_h() {
    let s = sample();
    let b = s.encode();
    assert_eq!(le32(&b, 0), 0x6d74_6962);
    assert_eq!(&b[0..4], b"bitm");
    assert_eq!(le32(&b, 4), 4);
    assert_eq!(&b[8..24], &[7; 16]);
    assert_eq!(le64(&b, 24), 0x1122_3344_5566_7788);
    assert_eq!(le64(&b, 32), 42);
    assert_eq!(le64(&b, 40), 123_456);
    assert_eq!(le32(&b, 48), 1 << 15);
    assert_eq!(le32(&b, 52), 1 << 20);
    assert_eq!(le32(&b, 56), 5);
    assert_eq!(le32(&b, 60), 256);
    assert_eq!(le32(&b, 64), 264);
    assert_eq!(le32(&b, 68), 0);
    assert_eq!(&b[72..76], b"clus");
    assert!(b[136..].iter().all(|&x| x == 0));
    assert_eq!(BitmapSuper::decode(&b).unwrap(), s);
}

#[test]
fn bitmap_super_refusals_are_named() {
    let good = sample().encode();
    let with = |off: usize, v: u32| {
        let mut b = good;
        b[off..off + 4].copy_from_slice(&v.to_le_bytes());
        BitmapSuper::decode(&b)
    };
    assert_eq!(
        BitmapSuper::decode(&good[..255]),
        Err(BitmapError::Truncated { len: 255 })
    );
    assert_eq!(
        with(0, 0xdead),
        Err(BitmapError::BadMagic { found: 0xdead })
    );
    assert_eq!(
        with(4, 2),
        Err(BitmapError::UnsupportedVersion { version: 2 })
    );
    assert_eq!(
        with(4, 6),
        Err(BitmapError::UnsupportedVersion { version: 6 })
    );
    assert_eq!(
        with(4, 5),
        Err(BitmapError::Clustered {
            version: 5,
            nodes: 0
        })
    );
    assert_eq!(
        with(68, 2),
        Err(BitmapError::Clustered {
            version: 4,
            nodes: 2
        })
    );
    assert_eq!(with(4, 3).unwrap().version, 3);
    assert_eq!(
        with(52, 256),
        Err(BitmapError::ChunkTooSmall { chunk_bytes: 256 })
    );
    assert_eq!(
        with(52, 3 << 12),
        Err(BitmapError::ChunkNotPowerOfTwo {
            chunk_bytes: 3 << 12
        })
    );
    assert_eq!(
        with(56, 0),
        Err(BitmapError::DaemonSleep { daemon_sleep_s: 0 })
    );
    assert_eq!(
        with(60, 16384),
        Err(BitmapError::WriteBehind {
            write_behind: 16384
        })
    );
    assert!(with(60, 16383).is_ok());
    // Messages name the values.
    assert!(with(52, 3 << 12).unwrap_err().to_string().contains("12288"));
}

#[test]
fn decode_never_panics_on_arbitrary_bytes() {
    let mut r = rng();
    use rand_chacha::rand_core::RngCore;
    for _ in 0..2000 {
        let mut b = [0u8; 300];
        r.fill_bytes(&mut b);
        if r.next_u32().is_multiple_of(2) {
            b[0..4].copy_from_slice(&BITMAP_MAGIC.to_le_bytes());
        }
        let _ = BitmapSuper::decode(&b);
        let _ = Bitmap::decode(&b);
    }
}

#[test]
fn bit_order_is_md_little_endian_after_the_superblock() {
    assert_eq!(bit_location(0), (256, 0x01));
    assert_eq!(bit_location(7), (256, 0x80));
    assert_eq!(bit_location(9), (257, 0x02));
    assert_eq!(bit_location(8 * 3840), (256 + 3840, 0x01));
    // 10 bits: 2 bytes, tail bits of the last byte stay clear in the bit array.
    let s = BitmapSuper::new(Uuid([1; 16]), 10 * 8, 4096, 5); // 10 chunks of 8 sectors
    assert_eq!(s.bits(), 10);
    let mut b = Bitmap::new(s.clone(), true);
    assert_eq!(b.bytes, vec![0xff, 0x03]);
    assert_eq!(b.dirty_count(), 10);
    b.set(9, false);
    b.set(0, false);
    assert_eq!(b.bytes, vec![0xfe, 0x01]);
    assert!(!b.is_set(0) && b.is_set(1) && !b.is_set(9) && !b.is_set(10));
    let area = b.to_area(false);
    assert_eq!(area.len(), 4096);
    assert_eq!(&area[256..258], &[0xfe, 0x01]);
    assert!(area[258..].iter().all(|&x| x == 0));
    let back = Bitmap::decode(&area).unwrap();
    assert_eq!(back, b);
    assert_eq!(back.dirty().collect::<Vec<_>>(), (1..9).collect::<Vec<_>>());
    assert_eq!(
        Bitmap::decode(&area[..257]),
        Err(BitmapError::AreaTooShort {
            len: 257,
            needed: 258,
            bits: 10
        })
    );
}

#[test]
fn bits_and_area_sizes_follow_mdadm() {
    assert_eq!(bitmap_bits(0, 4096), 0);
    assert_eq!(bitmap_bits(8, 4096), 1);
    assert_eq!(bitmap_bits(9, 4096), 2);
    assert_eq!(bitmap_bits(1 << 40, 1 << 26), 1 << 23);
    assert_eq!(bitmap_area_bytes(0, 4096), 4096);
    assert_eq!(bitmap_area_bytes(8 * 3840, 4096), 4096);
    assert_eq!(bitmap_area_bytes(8 * 3840 + 1, 4096), 8192);
    assert_eq!(bitmap_area_bytes(1, 512), 512);
}

/// mdadm 4.2 `add_internal_bitmap1` for a new 1.2 array, worked by hand.
#[test]
fn chunk_choice_follows_add_internal_bitmap1() {
    // Small members: 4 KiB of room, 30720 bits; 4 KiB chunks fit, default is 64 MiB.
    assert_eq!(
        choose_bitmap_chunk_bytes(63 * MIB_SECTORS, None),
        Ok(64 << 20)
    );
    assert_eq!(
        choose_bitmap_chunk_bytes(63 * MIB_SECTORS, Some(4096)),
        Ok(4096)
    );
    // 100 MiB with 4 KiB chunks: 25601 bits, fits 30720.
    assert_eq!(
        choose_bitmap_chunk_bytes(100 * MIB_SECTORS, Some(4096)),
        Ok(4096)
    );
    // 200 MiB: 51201 bits > 30720 → min 8 KiB.
    assert_eq!(
        choose_bitmap_chunk_bytes(200 * MIB_SECTORS, Some(4096)),
        Err(BitmapError::ChunkTooSmallForSpace {
            chunk_bytes: 4096,
            min_chunk_bytes: 8192,
            size_sectors: 200 * MIB_SECTORS,
            room_sectors: 8,
        })
    );
    // 4 TiB: 128 KiB of room, (131072−256)·8 = 1046528 bits: min chunk 8 MiB, default
    // 64 MiB.
    let four_tib = 4096 * GIB_SECTORS;
    assert_eq!(choose_bitmap_chunk_bytes(four_tib, None), Ok(64 << 20));
    assert!(matches!(
        choose_bitmap_chunk_bytes(four_tib, Some(4 << 20)),
        Err(BitmapError::ChunkTooSmallForSpace {
            min_chunk_bytes: 8388608,
            ..
        })
    ));
    // 64 TiB: min chunk 128 MiB > 64 MiB: the default grows.
    assert_eq!(
        choose_bitmap_chunk_bytes(64 * 1024 * GIB_SECTORS, None),
        Ok(128 << 20)
    );
    assert_eq!(
        choose_bitmap_chunk_bytes(MIB_SECTORS, Some(1000)),
        Err(BitmapError::ChunkNotPowerOfTwo { chunk_bytes: 1000 })
    );
    assert_eq!(
        choose_bitmap_chunk_bytes(MIB_SECTORS, Some(256)),
        Err(BitmapError::ChunkTooSmall { chunk_bytes: 256 })
    );
    assert_eq!(
        choose_bitmap_chunk_bytes(60, None),
        Err(BitmapError::NoSpace { size_sectors: 60 })
    );
    assert!(!mdadm_adds_bitmap_by_default(100 * GIB_SECTORS));
    assert!(mdadm_adds_bitmap_by_default(100 * GIB_SECTORS + 1));
}

#[test]
fn create_with_internal_bitmap_sets_feature_offset_and_area() {
    for clean in [false, true] {
        let mut a = new_array(4, clean, BitmapChoice::Internal);
        a.bitmap_chunk_bytes = Some(1 << 20);
        let sbs = a.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()).unwrap();
        let size = sbs[0].size;
        let bm = a.bitmap_super(size).unwrap().unwrap();
        assert_eq!(bm.chunksize, 1 << 20);
        assert_eq!(bm.sync_size, size);
        assert_eq!(bm.daemon_sleep, 5);
        assert_eq!(bm.uuid, a.uuid);
        for sb in &sbs {
            assert_eq!(sb.feature_map, 1);
            assert_eq!(sb.bitmap_offset, 8);
            assert_eq!(bitmap::bitmap_start_sector(sb), Some(16));
            // The superblock is served and the bitmap belongs to it.
            let parsed = parse(&sb.to_bytes().unwrap()).unwrap();
            bm.check_against(&parsed).unwrap();
            // Bad-block log after the 4 KiB bitmap space.
            assert_eq!(sb.bblog_offset, 16);
        }
        let area = a.initial_bitmap_area(size).unwrap().unwrap();
        assert_eq!(area.len(), 4096);
        let bits = bm.bits();
        assert_eq!(bits, size.div_ceil(2048));
        let b = Bitmap::decode(&area).unwrap();
        assert_eq!(b.dirty_count(), if clean { 0 } else { bits });
        // mdadm fills the rest of the area with 0xff when all bits are set.
        assert!(area[256 + bits.div_ceil(8) as usize..]
            .iter()
            .all(|&x| x == if clean { 0 } else { 0xff }));
    }
}

#[test]
fn create_bitmap_choice_auto_follows_mdadm_and_none_means_none() {
    let a = new_array(4, false, BitmapChoice::Auto);
    let sbs = a.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()).unwrap();
    assert_eq!(sbs[0].feature_map, 0);
    assert_eq!(a.initial_bitmap_area(sbs[0].size).unwrap(), None);
    let big = [101 * GIB_SECTORS; 4];
    let sbs = a.superblocks(&big, &mut rng()).unwrap();
    assert_eq!(sbs[0].feature_map, 1);
    let bm = a.bitmap_super(sbs[0].size).unwrap().unwrap();
    assert_eq!(bm.chunksize, 64 << 20);
    let none = new_array(4, false, BitmapChoice::None);
    assert_eq!(
        none.superblocks(&big, &mut rng()).unwrap()[0].feature_map,
        0
    );
}

#[test]
fn create_refuses_a_bitmap_that_does_not_fit_an_explicit_data_offset() {
    let mut a = new_array(4, false, BitmapChoice::Internal);
    a.bitmap_chunk_bytes = Some(4096);
    // Superblock at 8..16, bitmap at 16..24, bad-block log at 24..32, data at 40.
    // 64 MiB members with 4 KiB chunks: 16378 bits = 2048 bytes + 256: 5 sectors — fits.
    a.data_offset_sectors = Some(40);
    let sbs = a.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()).unwrap();
    assert_eq!(sbs[0].bblog_offset, 16);
    // Data at 24: the bad-block log goes just below the data, onto the bitmap.
    a.data_offset_sectors = Some(24);
    assert!(matches!(
        a.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()),
        Err(CreateError::Bitmap(BitmapError::DoesNotFit { .. }))
    ));
}

#[test]
fn check_against_refuses_foreign_resized_or_misplaced_bitmaps() {
    let a = new_array(4, false, BitmapChoice::Internal);
    let sbs = a.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()).unwrap();
    let sb = &sbs[0];
    let bm = a.bitmap_super(sb.size).unwrap().unwrap();
    bm.check_against(sb).unwrap();
    let mut other = bm.clone();
    other.uuid = Uuid([9; 16]);
    assert!(matches!(
        other.check_against(sb),
        Err(BitmapError::UuidMismatch { .. })
    ));
    let mut resized = bm.clone();
    resized.sync_size += 8;
    assert!(matches!(
        resized.check_against(sb),
        Err(BitmapError::SyncSize { .. })
    ));
    let mut no_feature = sb.clone();
    no_feature.feature_map = 0;
    assert_eq!(bm.check_against(&no_feature), Err(BitmapError::NoBitmap));
    let mut inside = sb.clone();
    inside.bitmap_offset = 0;
    assert!(matches!(
        bm.check_against(&inside),
        Err(BitmapError::OverlapsSuperblock { bitmap_offset: 0 })
    ));
    // A 512-byte chunk needs 14 KiB of bits: beyond the 4 KiB before the bad-block log.
    let mut tiny = bm.clone();
    tiny.chunksize = 512;
    assert!(matches!(
        tiny.check_against(sb),
        Err(BitmapError::DoesNotFit {
            limit: "bad-block log",
            ..
        })
    ));
    // The md superblock itself refuses a bitmap offset past the data.
    let mut past = sb.clone();
    past.bitmap_offset = sb.data_offset as i32;
    assert!(matches!(
        parse(&past.to_bytes().unwrap()),
        Err(SuperblockError::BitmapPlacement { .. })
    ));
}

// ------------------------------------------------------------------ assembly / re-add

fn upd(failed: Vec<u32>) -> Update {
    Update {
        utime: MdTime::new(1_800_000_000, 0),
        failed,
        resync: None,
        roles: Vec::new(),
        recovery: Vec::new(),
        features: Vec::new(),
    }
}

/// A 6-member RAID6 with a bitmap; all members at `events`, bitmap events = `events`,
/// events_cleared = `cleared`.
fn bitmap_array(events: u64, cleared: u64) -> (Vec<Superblock>, BitmapSuper) {
    let a = new_array(6, true, BitmapChoice::Internal);
    let mut sbs = a.superblocks(&[64 * MIB_SECTORS; 6], &mut rng()).unwrap();
    for s in &mut sbs {
        s.events = events;
    }
    let mut bm = a.bitmap_super(sbs[0].size).unwrap().unwrap();
    bm.events = events;
    bm.events_cleared = cleared;
    (sbs, bm)
}

fn cands(sbs: &[Superblock], bm: &BitmapSuper) -> Vec<Candidate> {
    sbs.iter()
        .enumerate()
        .map(|(i, s)| {
            let mut b = bm.clone();
            b.events = b.events.min(s.events);
            Candidate::new(format!("/dev/d{i}"), s.clone()).with_bitmap(Ok(b))
        })
        .collect()
}

#[test]
fn assembly_accepts_bitmap_arrays_and_reports_the_bitmap() {
    let (sbs, bm) = bitmap_array(10, 10);
    let a = assemble(&cands(&sbs, &bm), AssembleOptions::default()).unwrap();
    let b = a.bitmap.as_ref().unwrap();
    assert!(!b.stale);
    assert_eq!(b.super_, bm);
    assert!(a.re_add.is_empty());
    assert!(!a.degraded);
}

#[test]
fn assembly_refuses_a_member_with_a_bad_or_unread_bitmap_unless_forced() {
    let (sbs, bm) = bitmap_array(10, 10);
    let mut c = cands(&sbs, &bm);
    c[2].bitmap = Some(Err(BitmapError::BadMagic { found: 0 }));
    let e = assemble(&c, AssembleOptions::default()).unwrap_err();
    assert_eq!(
        e,
        AssembleError::Bitmap {
            device: "/dev/d2".into(),
            source: BitmapError::BadMagic { found: 0 }
        }
    );
    c[2].bitmap = None;
    assert!(matches!(
        assemble(&c, AssembleOptions::default()),
        Err(AssembleError::Bitmap {
            source: BitmapError::NotRead,
            ..
        })
    ));
    let mut foreign = bm.clone();
    foreign.uuid = Uuid([3; 16]);
    c[2].bitmap = Some(Ok(foreign));
    let forced = assemble(
        &c,
        AssembleOptions {
            force: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(forced.members[2].is_none());
    assert!(matches!(
        forced.excluded[0].reason,
        ExclusionReason::BadBitmap(BitmapError::UuidMismatch { .. })
    ));
    assert!(matches!(
        forced.forced[0],
        ForcedAction::SkippedBadBitmap { .. }
    ));
}

#[test]
fn stale_bitmap_counts_everything_dirty_and_forbids_bitmap_re_add() {
    let (sbs, mut bm) = bitmap_array(10, 5);
    bm.events = 9; // written before the last superblock update
    let mut c: Vec<Candidate> = sbs
        .iter()
        .enumerate()
        .map(|(i, s)| Candidate::new(format!("/dev/d{i}"), s.clone()).with_bitmap(Ok(bm.clone())))
        .collect();
    let mut old = sbs[4].clone();
    old.events = 7;
    c[4] = Candidate::new("/dev/d4", old).with_bitmap(Ok(bm.clone()));
    let a = assemble(&c, AssembleOptions::default()).unwrap();
    assert!(a.bitmap.as_ref().unwrap().stale);
    assert_eq!(
        a.re_add[0].recovery,
        Recovery::Full(FullRebuildReason::StaleBitmap)
    );
    assert!(a.notes().iter().any(|n| n.contains("stale")));
    // The stale flag alone also makes it stale.
    let (sbs, mut bm) = bitmap_array(10, 5);
    bm.state = bitmap::BITMAP_STATE_STALE;
    let a = assemble(&cands(&sbs, &bm), AssembleOptions::default()).unwrap();
    assert!(a.bitmap.unwrap().stale);
}

/// md's `super_1_validate` with a bitmap: events >= events_cleared → bitmap recovery;
/// older → full rebuild.
#[test]
fn re_add_is_bitmap_based_only_from_events_cleared_on() {
    for (member_events, cleared, expect_bitmap) in [(7, 5, true), (5, 5, true), (4, 5, false)] {
        let (mut sbs, bm) = bitmap_array(10, cleared);
        sbs[1].events = member_events;
        let a = assemble(&cands(&sbs, &bm), AssembleOptions::default()).unwrap();
        assert!(a.members[1].is_none());
        assert_eq!(a.re_add.len(), 1);
        let r = &a.re_add[0];
        assert_eq!((r.candidate, r.role, r.events), (1, 1, member_events));
        if expect_bitmap {
            assert_eq!(r.recovery, Recovery::Bitmap);
            assert!(r.to_string().contains("bitmap-based recovery"));
        } else {
            assert_eq!(
                r.recovery,
                Recovery::Full(FullRebuildReason::OlderThanEventsCleared {
                    events: 4,
                    events_cleared: 5
                })
            );
        }
    }
}

#[test]
fn member_failed_and_removed_can_return_by_bitmap() {
    // Member 5 fails: generation 11 records it faulty; it keeps its own events 10.
    let (sbs, bm) = bitmap_array(10, 10);
    let next: Vec<Superblock> = next_generation(&sbs, &upd(vec![5]))
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    let mut set = next.clone();
    set.push(sbs[5].clone());
    let mut bm_now = bm.clone();
    bm_now.events = 11;
    let c: Vec<Candidate> = set
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut b = bm_now.clone();
            b.events = s.events;
            Candidate::new(format!("/dev/d{i}"), s.clone()).with_bitmap(Ok(b))
        })
        .collect();
    let a = assemble(&c, AssembleOptions::default()).unwrap();
    assert!(a.members[5].is_none());
    assert_eq!(a.re_add.len(), 1);
    assert_eq!(a.re_add[0].role, 5);
    assert_eq!(a.re_add[0].recovery, Recovery::Bitmap);
}

#[test]
fn re_add_without_bitmap_or_with_role_taken_is_a_full_rebuild() {
    // No bitmap at all.
    let a0 = new_array(6, true, BitmapChoice::None);
    let mut sbs = a0.superblocks(&[64 * MIB_SECTORS; 6], &mut rng()).unwrap();
    for s in &mut sbs {
        s.events = 10;
    }
    sbs[0].events = 3;
    let c: Vec<Candidate> = sbs
        .iter()
        .enumerate()
        .map(|(i, s)| Candidate::new(format!("/dev/d{i}"), s.clone()))
        .collect();
    let a = assemble(&c, AssembleOptions::default()).unwrap();
    assert_eq!(a.bitmap, None);
    assert_eq!(
        a.re_add[0].recovery,
        Recovery::Full(FullRebuildReason::NoBitmap)
    );
    // Role taken: an old copy of member 2 next to the current member 2 is a duplicate
    // slot; use a stale device whose slot is another but whose own role is 2.
    let (mut sbs, bm) = bitmap_array(10, 0);
    let mut old = sbs[2].clone();
    old.events = 6;
    old.dev_number = 6; // a slot the newest calls spare... its own says role 2
    for s in &mut sbs {
        s.dev_roles[6] = DEV_ROLE_FAULTY;
    }
    old.dev_roles[6] = 2;
    old.dev_roles[2] = DEV_ROLE_FAULTY;
    sbs.push(old);
    let a = assemble(&cands(&sbs, &bm), AssembleOptions::default()).unwrap();
    assert_eq!(a.re_add.len(), 1);
    assert_eq!(
        a.re_add[0].recovery,
        Recovery::Full(FullRebuildReason::RoleTaken)
    );
}

/// md fails *and removes* a member: the survivors' `dev_roles` give its slot 0xffff (md's
/// `super_1_sync`); it still comes back by bitmap with its own role.
#[test]
fn member_failed_and_removed_with_slot_spare_can_return_by_bitmap() {
    let (mut sbs, bm) = bitmap_array(10, 8);
    for (i, s) in sbs.iter_mut().enumerate() {
        if i != 2 {
            s.events = 12;
            s.dev_roles[2] = DEV_ROLE_SPARE;
        }
    }
    sbs[2].events = 9;
    let mut bm_now = bm.clone();
    bm_now.events = 12;
    let a = assemble(&cands(&sbs, &bm_now), AssembleOptions::default()).unwrap();
    assert!(matches!(
        a.excluded[0].reason,
        ExclusionReason::RoleChanged { .. }
    ));
    assert_eq!(a.re_add.len(), 1);
    assert_eq!(
        (a.re_add[0].role, a.re_add[0].recovery.clone()),
        (2, Recovery::Bitmap)
    );
}
