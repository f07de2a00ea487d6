//! Unit and property tests of the superblock format, creation, update and assembly.

use proptest::prelude::*;
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::geometry::{Geometry, GeometryError, Layout, Level};

const MIB_SECTORS: u64 = 2048;

fn rng() -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(7)
}

fn new_array(level: Level, members: u16, clean: bool) -> NewArray {
    let g = Geometry::new(level, Layout::LeftSymmetric, members, 64 << 10, 512).unwrap();
    let mut a = NewArray::new(
        g,
        Uuid::random(&mut rng()),
        "vol",
        Some("host"),
        MdTime::new(1_700_000_000, 0),
    )
    .unwrap();
    a.clean = clean;
    a
}

/// Superblocks of a `members`-member array over 64 MiB devices.
fn array_sbs(level: Level, members: u16, clean: bool) -> Vec<Superblock> {
    new_array(level, members, clean)
        .superblocks(&vec![64 * MIB_SECTORS; members.into()], &mut rng())
        .unwrap()
}

/// Independent re-statement of md's checksum, for the tests: sum of le32 words with the
/// checksum field zeroed, the odd 2 bytes added as le16, folded once.
fn reference_csum(bytes: &[u8], max_dev: usize) -> u32 {
    let mut b = bytes[..256 + 2 * max_dev].to_vec();
    b[216..220].fill(0);
    let mut sum = 0u64;
    let mut i = 0;
    while i + 4 <= b.len() {
        sum += u64::from(u32::from_le_bytes(b[i..i + 4].try_into().unwrap()));
        i += 4;
    }
    if b.len() - i == 2 {
        sum += u64::from(u16::from_le_bytes(b[i..i + 2].try_into().unwrap()));
    }
    ((sum & 0xffff_ffff) + (sum >> 32)) as u32
}

/// Rewrites the checksum of raw superblock bytes after a test changed them.
fn fix_csum(bytes: &mut [u8]) {
    let max_dev = u32::from_le_bytes(bytes[220..224].try_into().unwrap()) as usize;
    let c = reference_csum(bytes, max_dev);
    bytes[216..220].copy_from_slice(&c.to_le_bytes());
}

// ---------------------------------------------------------------- format

#[test]
fn round_trip_and_layout() {
    let sbs = array_sbs(Level::Raid6, 6, true);
    for sb in &sbs {
        let bytes = sb.to_bytes().unwrap();
        assert_eq!(bytes.len(), 256 + 2 * 128);
        assert_eq!(&bytes[0..4], &0xa92b4efcu32.to_le_bytes());
        assert_eq!(u32::from_le_bytes(bytes[4..8].try_into().unwrap()), 1);
        assert_eq!(
            u64::from_le_bytes(bytes[128..136].try_into().unwrap()),
            sb.data_offset
        );
        assert_eq!(u64::from_le_bytes(bytes[144..152].try_into().unwrap()), 8);
        assert_eq!(
            u64::from_le_bytes(bytes[200..208].try_into().unwrap()),
            sb.events
        );
        assert_eq!(u32::from_le_bytes(bytes[220..224].try_into().unwrap()), 128);
        let back = parse(&bytes).unwrap();
        assert_eq!(&back, sb);
        let area = sb.to_area().unwrap();
        assert_eq!(&area[..bytes.len()], &bytes[..]);
        assert!(area[bytes.len()..].iter().all(|&b| b == 0));
        assert_eq!(parse(&area).unwrap(), *sb);
    }
}

#[test]
fn checksum_matches_reference_even_and_odd_max_dev() {
    for max_dev in [0usize, 1, 3, 4, 127, 128, 1919, 1920] {
        let mut sb = array_sbs(Level::Raid5, 3, true).remove(0);
        sb.dev_roles = (0..max_dev)
            .map(|i| if i < 3 { i as u16 } else { 0xffff })
            .collect();
        sb.events = 0xdead_beef_1234_5678; // make the high half of the sum matter
        let bytes = sb.to_bytes().unwrap();
        let stored = u32::from_le_bytes(bytes[216..220].try_into().unwrap());
        assert_eq!(stored, reference_csum(&bytes, max_dev), "max_dev {max_dev}");
        assert_eq!(sb.checksum().unwrap(), stored);
        assert_eq!(Superblock::decode(&bytes).unwrap(), sb);
    }
}

#[test]
fn odd_max_dev_trailing_word_is_checked() {
    let mut sb = array_sbs(Level::Raid5, 3, true).remove(0);
    sb.dev_roles = vec![0, 1, 2];
    let mut bytes = sb.to_bytes().unwrap();
    assert_eq!(bytes.len(), 262);
    bytes[260] ^= 1; // dev_roles[2], the odd trailing 16-bit word
    assert!(matches!(
        Superblock::decode(&bytes),
        Err(SuperblockError::BadChecksum { .. })
    ));
}

#[test]
fn decode_errors_name_the_reason() {
    let sb = array_sbs(Level::Raid6, 4, true).remove(0);
    let good = sb.to_area().unwrap().to_vec();

    assert_eq!(
        Superblock::decode(&good[..100]),
        Err(SuperblockError::Truncated {
            len: 100,
            needed: 256
        })
    );
    assert_eq!(
        Superblock::decode(&good[..300]),
        Err(SuperblockError::Truncated {
            len: 300,
            needed: 512
        })
    );

    let mut b = good.clone();
    b[0] = 0;
    let e = Superblock::decode(&b).unwrap_err();
    assert_eq!(e, SuperblockError::NoMagic { found: 0xa92b4e00 });
    assert!(e.to_string().contains("no md superblock"));

    let mut b = good.clone();
    b[4] = 0;
    assert_eq!(
        Superblock::decode(&b),
        Err(SuperblockError::WrongMajorVersion { found: 0 })
    );

    let mut b = good.clone();
    b[220..224].copy_from_slice(&1921u32.to_le_bytes());
    assert_eq!(
        Superblock::decode(&b),
        Err(SuperblockError::MaxDevTooLarge { max_dev: 1921 })
    );

    let mut b = good.clone();
    b[200] ^= 0xff; // events
    let stored = u32::from_le_bytes(b[216..220].try_into().unwrap());
    let computed = reference_csum(&b, 128);
    let e = Superblock::decode(&b).unwrap_err();
    assert_eq!(e, SuperblockError::BadChecksum { stored, computed });
    assert!(e.to_string().contains(&format!("stored 0x{stored:08x}")));
    assert!(e
        .to_string()
        .contains(&format!("computed 0x{computed:08x}")));

    let mut b = good.clone();
    b[12] = 1;
    fix_csum(&mut b);
    assert_eq!(
        Superblock::decode(&b),
        Err(SuperblockError::NonZeroPadding { field: "pad0" })
    );
    let mut b = good.clone();
    b[255] = 1;
    fix_csum(&mut b);
    assert_eq!(
        Superblock::decode(&b),
        Err(SuperblockError::NonZeroPadding { field: "pad3" })
    );

    let mut too_many = sb.clone();
    too_many.dev_roles = vec![0xffff; 1921];
    assert_eq!(
        too_many.to_bytes(),
        Err(SuperblockError::MaxDevTooLarge { max_dev: 1921 })
    );
    assert_eq!(
        sb.write_into(&mut [0u8; 300]),
        Err(SuperblockError::BufferTooSmall {
            len: 300,
            needed: 512
        })
    );
}

/// Encodes a modified superblock and parses it (the checksum is always right).
fn reparse(sb: &Superblock) -> Result<Superblock, SuperblockError> {
    parse(&sb.to_bytes().unwrap())
}

#[test]
fn every_feature_bit_is_refused_by_name() {
    let base = array_sbs(Level::Raid6, 4, true).remove(0);
    for f in Feature::ALL {
        // PPL bits on this RAID6 array fail md's own PPL checks first: `ppl_superblock`.
        if f.bit() & Feature::SUPPORTED != 0 || matches!(f, Feature::Ppl | Feature::MultiplePpls) {
            continue;
        }
        let mut sb = base.clone();
        sb.feature_map = f.bit();
        let e = reparse(&sb).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(f.md_name()), "{msg}");
        assert!(msg.contains(f.refusal()), "{msg}");
        // decode alone accepts it: the format is fine, ferroraid's support is not.
        assert!(Superblock::decode(&sb.to_bytes().unwrap()).is_ok());
    }
    let mut sb = base.clone();
    sb.feature_map = Feature::ReshapeActive.bit() | Feature::Journal.bit() | 0x8000;
    let msg = reparse(&sb).unwrap_err().to_string();
    assert!(msg.contains("MD_FEATURE_RESHAPE_ACTIVE"), "{msg}");
    assert!(msg.contains("MD_FEATURE_JOURNAL"), "{msg}");
    assert!(msg.contains("unknown feature bits 0x8000"), "{msg}");
}

/// A RAID5 member with mdadm's PPL: `MD_FEATURE_PPL`, 2048 sectors 8 after the
/// superblock, data from 4096 (mdadm: `ROUND_UP(24 + 2048 + headroom, 2048)`).
fn ppl_sb() -> Superblock {
    let mut sb = array_sbs(Level::Raid5, 4, true).remove(0);
    sb.feature_map = Feature::Ppl.bit();
    sb.set_ppl(ppl::MDADM_PPL_OFFSET_SECTORS, ppl::MDADM_PPL_SIZE_SECTORS);
    sb.data_offset = sb.data_offset.max(4096);
    sb
}

#[test]
fn ppl_superblock() {
    let sb = ppl_sb();
    assert_eq!(sb.ppl(), (8, 2048));
    assert_eq!(
        sb.bitmap_offset.to_le_bytes(),
        [8, 0, 0, 8],
        "le16 offset, le16 size"
    );
    let area = sb.ppl_area().unwrap().unwrap();
    assert_eq!(area.start_sector, 16);
    assert_eq!(area.usable_sectors, 2048);
    assert_eq!(area.mode, ppl::PplMode::Multiple);
    assert!(!area.multiple_feature);
    // md would run it, and so does ferroraid (either bit).
    assert_eq!(reparse(&sb).unwrap().ppl_area(), sb.ppl_area());
    let mut multi = sb.clone();
    multi.feature_map = Feature::MultiplePpls.bit();
    assert!(reparse(&multi).is_ok());
    assert_eq!(
        Superblock::decode(&multi.to_bytes().unwrap())
            .unwrap()
            .ppl_area()
            .unwrap()
            .map(|a| a.multiple_feature),
        Some(true)
    );
    // Without a PPL bit there is no area.
    let base = array_sbs(Level::Raid5, 4, true).remove(0);
    assert_eq!(base.ppl_area(), Ok(None));
}

#[test]
fn ppl_superblock_refusals_follow_md() {
    let with = |f: &dyn Fn(&mut Superblock)| {
        let mut sb = ppl_sb();
        f(&mut sb);
        assert_eq!(reparse(&sb).unwrap_err(), sb.ppl_area().unwrap_err());
        sb.ppl_area().unwrap_err()
    };
    for extra in [
        Feature::BitmapOffset,
        Feature::Journal,
        Feature::MultiplePpls,
    ] {
        assert!(matches!(
            with(&|sb| sb.feature_map |= extra.bit()),
            SuperblockError::PplFeatures { .. }
        ));
    }
    assert_eq!(
        with(&|sb| sb.level = 6),
        SuperblockError::PplLevel { level: 6 }
    );
    let placement = |e: SuperblockError| match e {
        SuperblockError::PplPlacement { why, .. } => why,
        other => panic!("{other}"),
    };
    assert!(placement(with(&|sb| sb.set_ppl(8, 15))).contains("too small"));
    assert!(placement(with(&|sb| sb.data_offset = 2048)).contains("data area"));
    // (An offset of 1 is fine when the superblock takes one sector, as md computes
    // `sb_size` from `max_dev`.)
    assert!(placement(with(&|sb| sb.set_ppl(0, 2048))).contains("superblock"));
    assert!(placement(with(&|sb| sb.set_ppl(-8, 16))).contains("superblock"));
    // After the data area: allowed by md (`ppl.sector >= data_offset + sectors`).
    let mut sb = ppl_sb();
    sb.data_size = 100;
    sb.set_ppl((sb.data_offset + 100 - sb.super_offset) as i16, 16);
    assert_eq!(
        sb.ppl_area().unwrap().unwrap().start_sector,
        sb.data_offset + 100
    );
    sb.data_size = 101;
    assert!(placement(sb.ppl_area().unwrap_err()).contains("data area"));
    // ... and the smallest area md accepts: a header and one page.
    let mut sb = ppl_sb();
    sb.set_ppl(8, 16);
    let area = sb.ppl_area().unwrap().unwrap();
    assert_eq!((area.usable_sectors, area.mode), (16, ppl::PplMode::Single));
}

/// md accepts a PPL area of a header and one page; ferroraid's writer logs up to one chunk
/// of partial parity per record and must end every record more than a header before the
/// area's end (`crate::ppl::min_area_bytes`): a smaller area is refused by name, with the
/// way out, instead of being logged into.
#[test]
fn a_ppl_area_too_small_for_one_chunk_is_refused_with_the_way_out() {
    let mut sb = ppl_sb();
    let chunk = sb.chunksize;
    let needed = 3 * 8 + u64::from(chunk);
    sb.set_ppl(8, needed as u16 - 8);
    assert!(sb.ppl_area().is_ok(), "md accepts it");
    let e = sb.check_supported().unwrap_err();
    assert_eq!(
        e,
        SuperblockError::PplAreaTooSmall {
            usable_sectors: needed - 8,
            chunk_sectors: chunk,
            needed_sectors: needed,
        }
    );
    assert!(e.to_string().contains("--consistency-policy resync"), "{e}");
    sb.set_ppl(8, needed as u16);
    sb.check_supported().unwrap();
}

#[test]
fn support_errors_name_the_reason() {
    let base = array_sbs(Level::Raid6, 4, true).remove(0);
    let with = |f: &dyn Fn(&mut Superblock)| {
        let mut sb = base.clone();
        f(&mut sb);
        reparse(&sb).unwrap_err()
    };

    assert_eq!(
        with(&|s| s.super_offset = 0),
        SuperblockError::NotVersion12 { super_offset: 0 }
    );
    for (level, name) in [
        (1, "raid1"),
        (10, "raid10"),
        (-1, "linear"),
        (0, "raid0"),
        (4, "raid4"),
    ] {
        let e = with(&|s| s.level = level);
        assert_eq!(e, SuperblockError::UnsupportedLevel { level });
        assert!(e.to_string().contains(name), "{e}");
    }
    let e = with(&|s| s.layout = 18);
    assert!(matches!(
        e,
        SuperblockError::UnsupportedLayout {
            level: Level::Raid6,
            layout: 18,
            ..
        }
    ));
    assert!(e.to_string().contains("left-symmetric-6"), "{e}");
    assert!(e.to_string().contains("normalise"), "{e}");
    assert!(with(&|s| s.layout = 9)
        .to_string()
        .contains("ddf-N-restart"));
    let e = with(&|s| {
        s.level = 5;
        s.layout = 16;
    });
    assert!(e.to_string().contains("RAID5 layouts are 0..=5"), "{e}");
    for chunk in [0u32, 4, 12, 65536] {
        assert_eq!(
            with(&|s| s.chunksize = chunk),
            SuperblockError::ChunkNotRepresentable {
                chunk_sectors: chunk
            }
        );
    }
    assert!(matches!(
        with(&|s| s.raid_disks = 3),
        SuperblockError::Geometry(GeometryError::MemberCount { members: 3, .. })
    ));
    assert_eq!(
        with(&|s| s.raid_disks = 70000),
        SuperblockError::RaidDisks { raid_disks: 70000 }
    );
    assert_eq!(
        with(&|s| s.data_offset = 8),
        SuperblockError::DataOffset {
            data_offset: 8,
            min: 9
        }
    );
    let e = with(&|s| s.data_size = s.size - 1);
    assert!(matches!(e, SuperblockError::DataSize { .. }), "{e}");
    assert!(matches!(
        with(&|s| {
            s.size = 64;
            s.data_size = 64;
        }),
        SuperblockError::SizeTooSmall { .. }
    ));
    assert!(matches!(
        with(&|s| s.bblog_offset = -8),
        SuperblockError::BadBlockLogPlacement { .. }
    ));
    assert_eq!(
        with(&|s| s.dev_roles[7] = 4),
        SuperblockError::InvalidRole {
            dev_number: 7,
            role: 4,
            raid_disks: 4
        }
    );
    assert_eq!(
        with(&|s| s.dev_roles[7] = 0xfffd),
        SuperblockError::InvalidRole {
            dev_number: 7,
            role: 0xfffd,
            raid_disks: 4
        }
    );
    // A member and its replacement may share a role (mdadm's `R`); a third may not.
    assert_eq!(
        with(&|s| {
            s.dev_roles[5] = 2;
            s.dev_roles[6] = 2;
        }),
        SuperblockError::DuplicateRole {
            role: 2,
            first: 2,
            second: 6
        }
    );
}

#[test]
fn geometry_conversion() {
    for level in [Level::Raid5, Level::Raid6] {
        for layout in Layout::ALL {
            let mut sb = array_sbs(level, 5, true).remove(0);
            sb.layout = layout.md_id();
            sb.chunksize = 1024; // 512 KiB
            sb.size = 10 * 1024 + 100; // 10 chunks and a bit
            let g = sb.geometry(4096).unwrap();
            assert_eq!(g.level(), level);
            assert_eq!(g.layout(), layout);
            assert_eq!(g.members(), 5);
            assert_eq!(g.chunk_bytes(), 512 << 10);
            assert_eq!(g.block_bytes(), 4096);
            let a = sb.array_geometry(512).unwrap();
            assert_eq!(a.stripes(), 10);
            assert_eq!(
                a.capacity_bytes(),
                10 * u64::from(g.data_chunks()) * (512 << 10)
            );
        }
    }
}

#[test]
fn uuid_and_time_formats() {
    let u: Uuid = "0123abcd:4567EF01:89abcdef:00112233".parse().unwrap();
    assert_eq!(u.to_string(), "0123abcd:4567ef01:89abcdef:00112233");
    assert_eq!(
        "0123abcd-4567-ef01-89ab-cdef00112233"
            .parse::<Uuid>()
            .unwrap(),
        u
    );
    assert!("0123".parse::<Uuid>().is_err());
    assert!("0123abcd:4567ef01:89abcdef:0011223344"
        .parse::<Uuid>()
        .is_err());
    assert!("g123abcd:4567ef01:89abcdef:00112233"
        .parse::<Uuid>()
        .is_err());

    let t = MdTime::new(1_700_000_000, 123_456);
    assert_eq!(t.seconds(), 1_700_000_000);
    assert_eq!(t.micros(), 123_456);
    assert_eq!(t.raw(), 1_700_000_000 | (123_456 << 40));
    assert_eq!(
        MdTime::new(u64::MAX, 5_000_000).seconds(),
        MdTime::MAX_SECONDS
    );
    assert_eq!(MdTime::new(0, 5_000_000).micros(), 999_999);
}

// ---------------------------------------------------------------- creation

#[test]
fn default_data_offset_follows_mdadm() {
    // Small devices: 1 MiB, the minimum.
    assert_eq!(default_data_offset_sectors(64 * MIB_SECTORS, 128), 2048);
    // 10 GiB: headroom 8 MiB, bitmap 64 KiB -> 24 + 128 + 16384 rounded up to 9 MiB.
    assert_eq!(
        default_data_offset_sectors(10 * 1024 * MIB_SECTORS, 128),
        18432
    );
    // 20 GiB: headroom 16 MiB -> 17 MiB.
    assert_eq!(
        default_data_offset_sectors(20 * 1024 * MIB_SECTORS, 128),
        34816
    );
    // 1 TB disk (1953525168 sectors): the familiar 264192 (129 MiB).
    assert_eq!(default_data_offset_sectors(1_953_525_168, 1024), 264192);
    // Big chunks keep at least four chunks of headroom.
    assert_eq!(
        default_data_offset_sectors(64 * MIB_SECTORS, 32768),
        (24 + 8 + 65536u64).div_ceil(2048) * 2048
    );
    assert_eq!(choose_bitmap_space_sectors(100), 0);
    assert_eq!(choose_bitmap_space_sectors(64 * MIB_SECTORS), 8);
    assert_eq!(choose_bitmap_space_sectors(9 * 1024 * MIB_SECTORS), 128);
    assert_eq!(choose_bitmap_space_sectors(300 * 1024 * MIB_SECTORS), 256);
    // The bad-block log follows the bitmap space, or sits below the data.
    assert_eq!(bad_block_log(2048, 8), Some((16, 8)));
    assert_eq!(bad_block_log(264192, 256), Some((264, 8)));
    assert_eq!(bad_block_log(32, 8), Some((16, 8)));
    assert_eq!(bad_block_log(30, 8), Some((14, 8)));
    assert_eq!(bad_block_log(16, 8), None);
}

#[test]
fn new_array_superblocks_follow_mdadm() {
    let mut sizes = vec![64 * MIB_SECTORS; 7];
    sizes[2] -= 100; // a slightly smaller member decides the size
    let a = new_array(Level::Raid6, 6, false);
    let sbs = a.superblocks(&sizes, &mut rng()).unwrap();
    assert_eq!(sbs.len(), 7);
    let size = (64 * MIB_SECTORS - 100 - 2048) / 128 * 128;
    for (i, sb) in sbs.iter().enumerate() {
        sb.check_supported().unwrap();
        assert_eq!(sb.name(), "host:vol");
        assert_eq!(sb.short_name(), "vol");
        assert_eq!(sb.level, 6);
        assert_eq!(sb.layout, 2);
        assert_eq!(sb.chunksize, 128);
        assert_eq!(sb.raid_disks, 6);
        assert_eq!(sb.feature_map, 0);
        assert_eq!(sb.super_offset, 8);
        assert_eq!(sb.data_offset, 2048);
        assert_eq!(sb.data_size, sizes[i] - 2048);
        assert_eq!(sb.size, size);
        assert_eq!(sb.dev_number, i as u32);
        assert_eq!(sb.max_dev(), 128);
        assert_eq!(sb.events, 0);
        assert_eq!(sb.resync_offset, 0);
        assert!(!sb.is_clean());
        assert_eq!(sb.utime, sb.ctime);
        assert_eq!((sb.bblog_offset, sb.bblog_size), (16, 8));
        let expect = if i < 6 {
            DevRole::Active(i as u16)
        } else {
            DevRole::Spare
        };
        assert_eq!(sb.role(), expect);
        for (s, &r) in sb.dev_roles.iter().enumerate() {
            assert_eq!(r, if s < 6 { s as u16 } else { 0xffff });
        }
    }
    // Random, distinct device UUIDs; one array UUID.
    let mut uuids: Vec<_> = sbs.iter().map(|s| s.device_uuid).collect();
    uuids.sort();
    uuids.dedup();
    assert_eq!(uuids.len(), 7);
    assert!(sbs.iter().all(|s| s.set_uuid == a.uuid));
    // Clean arrays say so.
    assert!(array_sbs(Level::Raid5, 3, true)
        .iter()
        .all(|s| s.is_clean()));
    // max_dev grows in whole sectors, like mdadm's init_super1.
    assert_eq!(NewArray::max_dev_for(128), 128);
    assert_eq!(NewArray::max_dev_for(129), 384);
    assert_eq!(NewArray::max_dev_for(1920), 1920);
}

#[test]
fn new_array_errors() {
    let a = new_array(Level::Raid5, 4, true);
    assert_eq!(
        a.superblocks(&[64 * MIB_SECTORS; 3], &mut rng()),
        Err(CreateError::DeviceCount {
            devices: 3,
            raid_disks: 4
        })
    );
    let mut sizes = [64 * MIB_SECTORS; 4];
    sizes[3] = 2048 + 100;
    assert!(matches!(
        a.superblocks(&sizes, &mut rng()),
        Err(CreateError::DeviceTooSmall { index: 3, .. })
    ));
    let mut b = a.clone();
    b.data_offset_sectors = Some(8);
    assert_eq!(
        b.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()),
        Err(CreateError::DataOffset {
            data_offset: 8,
            min: 9
        })
    );
    b.data_offset_sectors = Some(20);
    assert!(b.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()).is_err());
    b.data_offset_sectors = Some(4096);
    let sbs = b.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()).unwrap();
    assert!(sbs.iter().all(|s| s.data_offset == 4096));
}

#[test]
fn names_follow_mdadm() {
    let s = |n: &str, h: Option<&str>| {
        set_name(n, h).map(|b| {
            let end = b.iter().position(|&c| c == 0).unwrap_or(32);
            String::from_utf8(b[..end].to_vec()).unwrap()
        })
    };
    assert_eq!(s("data", Some("nas")).unwrap(), "nas:data");
    assert_eq!(s("data", None).unwrap(), "data");
    assert_eq!(s("other:data", Some("nas")).unwrap(), "other:data");
    // Host prefix only when the result fits in 31 bytes; else the plain name.
    let long_host = "h".repeat(27);
    assert_eq!(s("data", Some(&long_host)).unwrap(), "data");
    assert_eq!(s(&"n".repeat(31), None).unwrap(), "n".repeat(31));
    assert_eq!(
        s(&"n".repeat(32), None),
        Err(CreateError::NameTooLong {
            name: "n".repeat(32),
            len: 32
        })
    );
    assert_eq!(s("", None), Err(CreateError::EmptyName));
    assert!(matches!(s("a\0b", None), Err(CreateError::NameByte { .. })));
    assert!(matches!(
        s("a", Some("x\ny")),
        Err(CreateError::NameByte { .. })
    ));
}

// ---------------------------------------------------------------- update

fn upd(failed: Vec<u32>, resync: Option<Resync>) -> Update {
    Update {
        utime: MdTime::new(1_800_000_000, 0),
        failed,
        resync,
        roles: Vec::new(),
        recovery: Vec::new(),
        features: Vec::new(),
    }
}

#[test]
fn next_generation_bumps_events_and_records_failures() {
    let sbs = array_sbs(Level::Raid6, 6, true);
    let next = next_generation(&sbs, &upd(vec![4], Some(Resync::Dirty))).unwrap();
    assert!(next[4].is_none(), "a failed member is not written");
    for (i, n) in next.iter().enumerate().filter(|(i, _)| *i != 4) {
        let n = n.as_ref().unwrap();
        assert_eq!(n.events, 1);
        assert_eq!(n.utime, MdTime::new(1_800_000_000, 0));
        assert_eq!(n.resync_offset, 0);
        assert_eq!(n.role_of(4), DevRole::Faulty);
        assert_eq!(n.role(), DevRole::Active(i as u16));
        assert_eq!(n.device_uuid, sbs[i].device_uuid);
        n.check_supported().unwrap();
    }
    // A later generation keeps the fault, and can mark the array clean again.
    let live: Vec<_> = next.into_iter().flatten().collect();
    let again = next_generation(&live, &upd(vec![], Some(Resync::Clean))).unwrap();
    assert!(again.iter().all(|s| {
        let s = s.as_ref().unwrap();
        s.events == 2 && s.is_clean() && s.role_of(4) == DevRole::Faulty
    }));
    // Keeping resync_offset.
    let kept = next_generation(&live, &upd(vec![], None)).unwrap();
    assert!(kept.iter().all(|s| s.as_ref().unwrap().resync_offset == 0));
    assert_eq!(Resync::At(77).offset(), 77);
}

#[test]
fn replacement_joins_rebuilds_and_comes_in_sync() {
    // Slot 4 of a RAID6 of 6 fails; a new device joins in slot 6 with role 4, is rebuilt
    // in two checkpoints, then is in sync: md's Manage_add + super_1_sync sequence.
    let sbs = array_sbs(Level::Raid6, 6, true);
    let failed: Vec<Superblock> = next_generation(&sbs, &upd(vec![4], None))
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    let newest = failed[0].clone();
    let joining = joining_member(&newest, 6, Uuid([0xab; 16]), newest.data_size);
    assert_eq!(joining.dev_number, 6);
    assert_eq!(joining.device_uuid, Uuid([0xab; 16]));
    assert_eq!(joining.recovering(), None);
    let mut current = failed.clone();
    current.push(joining);
    let add = Update {
        roles: vec![(6, 4)],
        recovery: vec![(6, Some(0))],
        features: Vec::new(),
        ..Update::at(MdTime::new(1_800_000_001, 0))
    };
    let next: Vec<Superblock> = next_generation(&current, &add)
        .unwrap()
        .into_iter()
        .map(Option::unwrap)
        .collect();
    for n in &next {
        assert!(n.dev_roles.len() > 6, "dev_roles holds slot 6");
        assert_eq!(n.role_of(6), DevRole::Active(4));
        assert_eq!(n.role_of(4), DevRole::Faulty);
        n.check_supported().unwrap();
        // Round trip through the on-disk form keeps the recovery state.
        assert_eq!(reparse(n).unwrap().recovering(), n.recovering());
    }
    assert_eq!(
        next[5].recovering(),
        Some(0),
        "the new member is recovering from 0"
    );
    assert!(next[..5].iter().all(|n| n.recovering().is_none()));
    let cp = Update {
        recovery: vec![(6, Some(4096))],
        features: Vec::new(),
        ..Update::at(MdTime::new(1_800_000_002, 0))
    };
    let next: Vec<Superblock> = next_generation(&next, &cp)
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(next[5].recovering(), Some(4096));
    assert_eq!(next[5].recovery_offset, 4096);
    let done = Update {
        recovery: vec![(6, None)],
        features: Vec::new(),
        ..Update::at(MdTime::new(1_800_000_003, 0))
    };
    let next: Vec<Superblock> = next_generation(&next, &done)
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(next[5].recovering(), None);
    assert_eq!(next[5].feature_map & Feature::RecoveryOffset.bit(), 0);
    assert_eq!(next[5].events, newest.events + 3);
    // Assembly takes the new member in role 4 and leaves the failed one out.
    let asm = assemble(&cands(&next), AssembleOptions::default()).unwrap();
    assert_eq!(asm.members[4].as_ref().unwrap().dev_number, 6);
    assert_eq!(asm.members[4].as_ref().unwrap().recovery_offset, None);
    // A slot beyond md's limit is refused.
    let too_far = Update {
        roles: vec![(MAX_DEV_LIMIT, 1)],
        ..Update::at(MdTime::new(1_800_000_004, 0))
    };
    assert!(matches!(
        next_generation(&next, &too_far),
        Err(UpdateError::UnknownSlot { .. })
    ));
}

#[test]
fn partly_rebuilt_member_assembles_with_its_recovery_offset() {
    let sbs = array_sbs(Level::Raid5, 4, true);
    let rec = Update {
        recovery: vec![(2, Some(2048))],
        features: Vec::new(),
        ..Update::at(MdTime::new(1_800_000_001, 0))
    };
    let next: Vec<Superblock> = next_generation(&sbs, &rec)
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    let asm = assemble(&cands(&next), AssembleOptions::default()).unwrap();
    assert_eq!(asm.members[2].as_ref().unwrap().recovery_offset, Some(2048));
    assert_eq!(asm.members[1].as_ref().unwrap().recovery_offset, None);
}

#[test]
fn next_generation_errors() {
    let sbs = array_sbs(Level::Raid5, 3, true);
    assert_eq!(
        next_generation(&[], &upd(vec![], None)),
        Err(UpdateError::Empty)
    );
    assert_eq!(
        next_generation(&sbs, &upd(vec![500], None)),
        Err(UpdateError::UnknownSlot {
            dev_number: 500,
            max_dev: 128
        })
    );
    let mut foreign = sbs.clone();
    foreign[1].set_uuid = Uuid([9; 16]);
    assert!(matches!(
        next_generation(&foreign, &upd(vec![], None)),
        Err(UpdateError::ForeignArray { index: 1, .. })
    ));
    let mut stale = sbs.clone();
    for s in stale.iter_mut() {
        s.events = 10;
    }
    stale[1].events = 8;
    assert!(matches!(
        next_generation(&stale, &upd(vec![], None)),
        Err(UpdateError::StaleMember { index: 1, .. })
    ));
    // ...unless that member is the one being failed.
    assert!(next_generation(&stale, &upd(vec![1], None)).unwrap()[1].is_none());
    let mut max = sbs.clone();
    max[0].events = u64::MAX;
    assert_eq!(
        next_generation(&max, &upd(vec![], None)),
        Err(UpdateError::EventsOverflow)
    );
}

// ---------------------------------------------------------------- assembly

fn cands(sbs: &[Superblock]) -> Vec<Candidate> {
    sbs.iter()
        .enumerate()
        .map(|(i, s)| Candidate::new(format!("/dev/d{i}"), s.clone()))
        .collect()
}

fn force() -> AssembleOptions {
    AssembleOptions {
        force: true,
        ..AssembleOptions::default()
    }
}

#[test]
fn assembles_healthy_array_in_any_order() {
    let sbs = array_sbs(Level::Raid6, 6, true);
    let mut c = cands(&sbs);
    c.reverse();
    let a = assemble(&c, AssembleOptions::default()).unwrap();
    assert_eq!(a.uuid, sbs[0].set_uuid);
    assert_eq!(a.name, "host:vol");
    assert_eq!(a.geometry().level(), Level::Raid6);
    assert_eq!(a.geometry().members(), 6);
    assert_eq!(a.array.stripes(), (64 * MIB_SECTORS - 2048) / 128);
    assert!(!a.degraded && !a.resync_needed && a.forced.is_empty());
    assert!(a.missing_roles.is_empty() && a.excluded.is_empty() && a.spares.is_empty());
    for (r, m) in a.members.iter().enumerate() {
        let m = m.as_ref().unwrap();
        assert_eq!(m.device, format!("/dev/d{r}"));
        assert_eq!(c[m.candidate].device, m.device);
        assert_eq!(m.data_offset_sectors, 2048);
    }
    assert!(a.notes().is_empty());
}

#[test]
fn spares_and_dirty_arrays() {
    let a = new_array(Level::Raid5, 4, false);
    let sbs = a.superblocks(&[64 * MIB_SECTORS; 5], &mut rng()).unwrap();
    let asm = assemble(&cands(&sbs), AssembleOptions::default()).unwrap();
    assert_eq!(asm.spares, vec![4]);
    assert!(asm.resync_needed);
    assert_eq!(asm.resync_offset, 0);
    assert!(asm.notes().iter().any(|n| n.contains("resync needed")));
}

#[test]
fn degraded_clean_array_starts_and_says_so() {
    let sbs = array_sbs(Level::Raid6, 6, true);
    let c = cands(&sbs[..4]);
    let a = assemble(&c, AssembleOptions::default()).unwrap();
    assert!(a.degraded);
    assert_eq!(a.missing_roles, vec![4, 5]);
    assert!(a.members[4].is_none() && a.members[5].is_none());
    assert!(a.notes().iter().any(|n| n.contains("degraded start")));
}

#[test]
fn too_few_members_is_refused_and_force_brings_in_stale_ones() {
    // RAID5 of 4: member 2 failed long ago (events 3), then member 3 vanished now.
    let mut sbs = array_sbs(Level::Raid5, 4, true);
    for s in sbs.iter_mut() {
        s.events = 10;
    }
    sbs[2].events = 3;
    let c = cands(&sbs[..3]);
    let e = assemble(&c, AssembleOptions::default()).unwrap_err();
    match &e {
        AssembleError::TooFewMembers {
            available,
            needed,
            missing_roles,
            stale,
            ..
        } => {
            assert_eq!((*available, *needed), (2, 3));
            assert_eq!(missing_roles, &vec![2, 3]);
            assert_eq!(stale, &vec!["/dev/d2 (role 2, events 3)".to_string()]);
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("too few members"), "{e}");

    let a = assemble(&c, force()).unwrap();
    assert!(a.members[2].as_ref().unwrap().forced);
    assert!(a.degraded && a.resync_needed);
    assert_eq!(a.missing_roles, vec![3]);
    assert!(matches!(
        &a.forced[0],
        ForcedAction::IncludedOutOfDate {
            role: 2,
            events: 3,
            newest: 10,
            ..
        }
    ));
    assert!(a.notes().iter().any(|n| n.contains("out-of-date /dev/d2")));

    // Force cannot conjure members that are not there.
    let e = assemble(&cands(&sbs[..2]), force()).unwrap_err();
    assert!(
        matches!(e, AssembleError::TooFewMembers { available: 2, .. }),
        "{e}"
    );
}

#[test]
fn stale_member_is_excluded() {
    let mut sbs = array_sbs(Level::Raid6, 6, true);
    for s in sbs.iter_mut() {
        s.events = 50;
    }
    sbs[3].events = 48; // two generations behind
    sbs[1].events = 49; // one behind: within md's margin
    let a = assemble(&cands(&sbs), AssembleOptions::default()).unwrap();
    assert!(a.members[1].is_some());
    assert!(a.members[3].is_none());
    assert_eq!(a.missing_roles, vec![3]);
    assert_eq!(
        a.excluded,
        vec![Exclusion {
            candidate: 3,
            device: "/dev/d3".into(),
            reason: ExclusionReason::Stale {
                events: 48,
                newest: 50
            }
        }]
    );
    assert!(a.notes().iter().any(|n| n.contains("stale")));
}

/// The linux-raid 2023 scenario: a member is marked faulty in the last update and skipped
/// by every later write; its events are one behind. md re-admits it; ferroraid must not.
#[test]
fn member_recorded_faulty_by_newest_is_excluded_even_within_margin() {
    let sbs = array_sbs(Level::Raid6, 6, false);
    let next = next_generation(&sbs, &upd(vec![5], None)).unwrap();
    let mut set: Vec<Superblock> = next.into_iter().flatten().collect();
    set.push(sbs[5].clone()); // the failed member, events 0 vs 1
    let a = assemble(&cands(&set), force()).unwrap();
    assert!(a.members[5].is_none());
    assert!(matches!(
        a.excluded[0].reason,
        ExclusionReason::RecordedFaulty { .. }
    ));
    assert_eq!(a.missing_roles, vec![5]);
}

/// A crash in the middle of writing generation N+1 leaves a consistent newest set.
#[test]
fn crash_mid_update_assembles_consistently() {
    let sbs = array_sbs(Level::Raid6, 6, true);
    let next = next_generation(&sbs, &upd(vec![2], Some(Resync::Dirty))).unwrap();
    // Every split of which members got N+1 before the crash (the failed one never does).
    for mask in 0u32..(1 << 6) {
        if mask & (1 << 2) != 0 {
            continue;
        }
        let on_disk: Vec<Superblock> = (0..6)
            .map(|i| {
                if mask & (1 << i) != 0 {
                    next[i].clone().unwrap()
                } else {
                    sbs[i].clone()
                }
            })
            .collect();
        let a = assemble(&cands(&on_disk), force()).unwrap();
        if mask == 0 {
            // Nothing written: generation N, member 2 still in.
            assert!(!a.degraded && !a.resync_needed, "mask {mask:#b}");
        } else {
            // Generation N+1 is the state: member 2 faulty, dirty.
            assert_eq!(a.events, 1);
            assert_eq!(a.missing_roles, vec![2], "mask {mask:#b}");
            assert!(a.resync_needed);
            assert!(a.members.iter().flatten().all(|m| !m.forced));
        }
    }
}

#[test]
fn assembly_errors_name_the_device() {
    let sbs = array_sbs(Level::Raid6, 4, true);

    assert_eq!(
        assemble(&[], AssembleOptions::default()),
        Err(AssembleError::NoCandidates)
    );

    // Bad checksum: refused, or skipped with force.
    let mut bad = sbs[1].to_bytes().unwrap();
    bad[100] ^= 1;
    let mut c = cands(&sbs);
    c[1] = Candidate::from_bytes("/dev/d1", &bad);
    let e = assemble(&c, AssembleOptions::default()).unwrap_err();
    assert!(matches!(
        &e,
        AssembleError::Unreadable { device, source: SuperblockError::BadChecksum { .. } }
            if device == "/dev/d1"
    ));
    assert!(e.to_string().contains("/dev/d1") && e.to_string().contains("checksum"));
    let a = assemble(&c, force()).unwrap();
    assert_eq!(a.missing_roles, vec![1]);
    assert!(matches!(
        a.forced[0],
        ForcedAction::SkippedUnreadable { .. }
    ));
    assert!(matches!(
        assemble(
            &[Candidate::unreadable(
                "/dev/x",
                SuperblockError::NoMagic { found: 0 }
            )],
            force()
        ),
        Err(AssembleError::NoCandidates)
    ));

    // Another array's member.
    let mut c = cands(&sbs);
    let other = array_sbs(Level::Raid6, 4, true);
    let mut stranger = other[0].clone();
    stranger.set_uuid = Uuid([0x55; 16]);
    c.push(Candidate::new("/dev/other", stranger));
    let e = assemble(&c, AssembleOptions::default()).unwrap_err();
    assert!(matches!(&e, AssembleError::ForeignArray { device, .. } if device == "/dev/other"));
    assert!(e.to_string().contains("55555555:"), "{e}");

    // Unsupported feature / level.
    let mut c = cands(&sbs);
    let mut s = sbs[2].clone();
    s.feature_map = Feature::ReshapeActive.bit();
    c[2] = Candidate::new("/dev/d2", s);
    let e = assemble(&c, AssembleOptions::default()).unwrap_err();
    assert!(matches!(&e, AssembleError::Unsupported { device, .. } if device == "/dev/d2"));
    assert!(e.to_string().contains("MD_FEATURE_RESHAPE_ACTIVE"), "{e}");
    let mut c = cands(&sbs);
    let mut s = sbs[0].clone();
    s.level = 1;
    c[0] = Candidate::new("/dev/d0", s);
    let e = assemble(&c, AssembleOptions::default()).unwrap_err();
    assert!(e.to_string().contains("raid1"), "{e}");

    // Duplicate role: the same device twice.
    let mut c = cands(&sbs);
    c.push(Candidate::new("/dev/d1-again", sbs[1].clone()));
    let e = assemble(&c, AssembleOptions::default()).unwrap_err();
    assert!(matches!(
        &e,
        AssembleError::DuplicateRole {
            dev_number: 1,
            same_device_uuid: true,
            ..
        }
    ));
    assert!(e.to_string().contains("/dev/d1-again"), "{e}");

    // Only spares.
    let a = new_array(Level::Raid5, 3, true);
    let with_spare = a.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()).unwrap();
    assert_eq!(
        assemble(&cands(&with_spare[3..]), AssembleOptions::default()),
        Err(AssembleError::NoActiveMembers { spares: 1 })
    );

    // Split brain: two members at the newest events disagree about the roles.
    let mut split = sbs.clone();
    split[3].dev_roles[0] = 0xfffe;
    let e = assemble(&cands(&split), AssembleOptions::default()).unwrap_err();
    assert!(
        matches!(
            &e,
            AssembleError::Inconsistent {
                field: "dev_roles",
                ..
            }
        ),
        "{e}"
    );
    // One member of the newest generation with another consistency policy's bits.
    let mut mixed = array_sbs(Level::Raid5, 4, true);
    for sb in &mut mixed {
        sb.feature_map = Feature::Ppl.bit();
        sb.set_ppl(ppl::MDADM_PPL_OFFSET_SECTORS, ppl::MDADM_PPL_SIZE_SECTORS);
        sb.data_offset = sb.data_offset.max(4096);
    }
    assert!(assemble(&cands(&mixed), AssembleOptions::default()).is_ok());
    mixed[1].feature_map = 0;
    let e = assemble(&cands(&mixed), AssembleOptions::default()).unwrap_err();
    assert!(
        matches!(
            &e,
            AssembleError::Inconsistent {
                field: "consistency policy (feature_map)",
                ..
            }
        ),
        "{e}"
    );
    let mut odd = sbs.clone();
    odd[2].chunksize = 256;
    let e = assemble(&cands(&odd), AssembleOptions::default()).unwrap_err();
    assert!(
        matches!(
            &e,
            AssembleError::Inconsistent {
                field: "chunksize",
                ..
            }
        ),
        "{e}"
    );

    // Dirty and degraded: refused without force, reported with it.
    let dirty = array_sbs(Level::Raid6, 4, false);
    let e = assemble(&cands(&dirty[..3]), AssembleOptions::default()).unwrap_err();
    assert!(matches!(&e, AssembleError::DirtyDegraded { .. }));
    assert!(e.to_string().contains("degraded/dirty"), "{e}");
    let a = assemble(&cands(&dirty[..3]), force()).unwrap();
    assert!(matches!(
        a.forced[0],
        ForcedAction::StartedDirtyDegraded { .. }
    ));
}

#[test]
fn removed_member_is_not_reused() {
    // Generation N+1 no longer lists slot 3 (removed: spare in dev_roles).
    let sbs = array_sbs(Level::Raid6, 6, true);
    let mut next: Vec<Superblock> = next_generation(&sbs[..5], &upd(vec![], None))
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    for s in next.iter_mut() {
        s.dev_roles[3] = 0xffff;
        s.dev_roles[5] = 0xffff;
    }
    next.push(sbs[3].clone());
    let a = assemble(&cands(&next), AssembleOptions::default()).unwrap();
    assert!(a.members[3].is_none());
    assert!(matches!(
        a.excluded[0].reason,
        ExclusionReason::RoleChanged {
            own: DevRole::Active(3),
            newest: DevRole::Spare,
            ..
        }
    ));
}

// ---------------------------------------------------------------- robustness

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Random bytes: decode, parse and assemble never panic.
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4200)) {
        let _ = Superblock::decode(&bytes);
        let _ = parse(&bytes);
        let c = [Candidate::from_bytes("x", &bytes)];
        let _ = assemble(&c, AssembleOptions::default());
        let _ = assemble(&c, force());
    }

    /// Random bytes behind a valid magic, version and checksum reach the deeper checks.
    #[test]
    fn random_superblocks_with_valid_checksum_never_panic(
        mut bytes in proptest::collection::vec(any::<u8>(), 4096..=4096),
        max_dev in 0u32..=1920,
    ) {
        bytes[0..4].copy_from_slice(&MD_SB_MAGIC.to_le_bytes());
        bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
        bytes[12..16].fill(0);
        bytes[224..256].fill(0);
        bytes[220..224].copy_from_slice(&max_dev.to_le_bytes());
        fix_csum(&mut bytes);
        let sb = Superblock::decode(&bytes).unwrap();
        let _ = sb.check_supported();
        let _ = sb.geometry(512);
        let _ = sb.array_geometry(4096);
        let _ = sb.to_string_lossy_fields();
        let n = sb.encoded_len();
        prop_assert_eq!(&sb.to_bytes().unwrap()[..], &bytes[..n]);
        let _ = assemble(&[Candidate::new("a", sb.clone()), Candidate::new("b", sb)], force());
    }

    /// Mutated valid superblocks: a flipped byte is either caught, or (when the checksum
    /// is fixed up) the result still decodes to exactly those bytes and never panics.
    #[test]
    fn mutated_superblocks(
        member in 0usize..6,
        flips in proptest::collection::vec((0usize..512, any::<u8>()), 1..8),
        fixup in any::<bool>(),
    ) {
        let sbs = array_sbs(Level::Raid6, 6, true);
        let mut bytes = sbs[member].to_area().unwrap().to_vec();
        for &(at, x) in &flips {
            bytes[at] ^= x;
        }
        if fixup && bytes[220..224] == 128u32.to_le_bytes() {
            fix_csum(&mut bytes);
        }
        match parse(&bytes) {
            Ok(sb) => {
                let n = sb.encoded_len();
                prop_assert_eq!(&sb.to_bytes().unwrap()[..], &bytes[..n]);
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        let mut c = cands(&sbs);
        c[member] = Candidate::from_bytes("mutated", &bytes);
        let _ = assemble(&c, AssembleOptions::default());
        let _ = assemble(&c, force());
    }

    /// Any superblock round-trips through its encoding.
    #[test]
    fn encode_decode_round_trip(
        events in any::<u64>(),
        resync in any::<u64>(),
        level in any::<i32>(),
        layout in any::<u32>(),
        roles in proptest::collection::vec(any::<u16>(), 0..300),
        name in proptest::collection::vec(any::<u8>(), 32..=32),
        offsets in (any::<i32>(), any::<i32>(), any::<u64>(), any::<u64>()),
    ) {
        let mut sb = array_sbs(Level::Raid5, 3, true).remove(0);
        sb.events = events;
        sb.resync_offset = resync;
        sb.level = level;
        sb.layout = layout;
        sb.dev_roles = roles;
        sb.set_name.copy_from_slice(&name);
        sb.bitmap_offset = offsets.0;
        sb.bblog_offset = offsets.1;
        sb.data_offset = offsets.2;
        sb.reshape_position = offsets.3;
        let bytes = sb.to_bytes().unwrap();
        prop_assert_eq!(Superblock::decode(&bytes).unwrap(), sb);
    }
}

impl Superblock {
    /// Exercises the text accessors on arbitrary contents.
    fn to_string_lossy_fields(&self) -> (String, String, (i16, u16), DevRole) {
        (self.name(), self.short_name(), self.ppl(), self.role())
    }
}

// ---------------------------------------------------------------- replacement, re-add

/// A RAID6 of 6 whose member 2 gets a replacement in slot 6 (md's superblocks during
/// `mdadm --replace`: both slots hold role 2, the new device has MD_FEATURE_REPLACEMENT
/// and a recovery offset), copied up to sector 4096.
fn replacing() -> Vec<Superblock> {
    let sbs = array_sbs(Level::Raid6, 6, true);
    let newest = sbs[0].clone();
    let mut current = sbs;
    current.push(joining_member(
        &newest,
        6,
        Uuid([0xcd; 16]),
        newest.data_size,
    ));
    let up = Update {
        roles: vec![(6, 2)],
        recovery: vec![(6, Some(4096))],
        features: vec![(6, Feature::Replacement, true)],
        ..Update::at(MdTime::new(1_800_000_001, 0))
    };
    next_generation(&current, &up)
        .unwrap()
        .into_iter()
        .map(Option::unwrap)
        .collect()
}

#[test]
fn replacement_superblocks_are_supported_and_round_trip() {
    let sbs = replacing();
    for sb in &sbs {
        // Role 2 twice (mdadm prints R), accepted; round trip keeps every bit.
        sb.check_supported().unwrap();
        assert_eq!(&reparse(sb).unwrap(), sb);
    }
    assert!(sbs[6].is_replacement() && sbs[6].recovering() == Some(4096));
    assert!(!sbs[2].is_replacement() && sbs[2].recovering().is_none());
    assert_eq!(sbs[0].role_of(2), DevRole::Active(2));
    assert_eq!(sbs[0].role_of(6), DevRole::Active(2));
    // Completing: the replacement in sync, its flag cleared, the old slot faulty.
    let done = Update {
        failed: vec![2],
        recovery: vec![(6, None)],
        features: vec![(6, Feature::Replacement, false)],
        ..Update::at(MdTime::new(1_800_000_002, 0))
    };
    let next = next_generation(&sbs, &done).unwrap();
    assert!(next[2].is_none(), "the replaced member is not written");
    let n6 = next[6].as_ref().unwrap();
    assert!(!n6.is_replacement() && n6.recovering().is_none());
    assert_eq!(n6.role_of(2), DevRole::Faulty);
    assert_eq!(n6.role(), DevRole::Active(2));
}

#[test]
fn a_replacement_resumes_beside_its_member_or_takes_its_role() {
    let sbs = replacing();
    let asm = assemble(&cands(&sbs), AssembleOptions::default()).unwrap();
    assert_eq!(asm.members[2].as_ref().unwrap().dev_number, 2);
    assert_eq!(asm.replacements.len(), 1);
    let r = &asm.replacements[0];
    assert_eq!((r.role, r.dev_number, r.recovery_offset), (2, 6, 4096));
    assert!(!asm.degraded);
    assert!(asm.notes().iter().any(|n| n.contains("replace resumes")));
    // The member gone: the replacement serves role 2, rebuilt from where it got to.
    let without: Vec<Superblock> = sbs.iter().filter(|s| s.dev_number != 2).cloned().collect();
    let asm = assemble(&cands(&without), force()).unwrap();
    let m = asm.members[2].as_ref().unwrap();
    assert_eq!((m.dev_number, m.recovery_offset), (6, Some(4096)));
    assert!(m.was_replacement);
    assert!(asm.replacements.is_empty());
    // The member recorded faulty (it failed during the replace): the same.
    let failed: Vec<Superblock> = next_generation(&sbs, &upd(vec![2], None))
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    let mut with_old = failed.clone();
    with_old.push(sbs[2].clone());
    let asm = assemble(&cands(&with_old), AssembleOptions::default()).unwrap();
    let m = asm.members[2].as_ref().unwrap();
    assert_eq!((m.dev_number, m.was_replacement), (6, true));
    // The old member is never re-added: its role is served.
    let re = asm.re_add.iter().find(|r| r.role == 2).unwrap();
    assert_eq!(re.recovery, Recovery::Full(FullRebuildReason::RoleTaken));
    // Two devices of one role without the flag: refused.
    let mut clash = sbs.clone();
    clash[6].feature_map &= !Feature::Replacement.bit();
    assert!(matches!(
        assemble(&cands(&clash), AssembleOptions::default()),
        Err(AssembleError::RoleClaimedTwice { role: 2, .. })
    ));
}

#[test]
fn readd_rule_follows_md() {
    let sbs = array_sbs(Level::Raid5, 4, true);
    let mut sb = sbs[1].clone();
    sb.events = 10;
    let cur = Some(ReaddBitmap {
        events_cleared: 10,
        stale: false,
    });
    assert_eq!(readd_recovery(&sb, cur, false), Recovery::Bitmap);
    assert_eq!(
        readd_recovery(&sb, cur, true),
        Recovery::Full(FullRebuildReason::RoleTaken)
    );
    assert_eq!(
        readd_recovery(&sb, None, false),
        Recovery::Full(FullRebuildReason::NoBitmap)
    );
    let stale = Some(ReaddBitmap {
        events_cleared: 0,
        stale: true,
    });
    assert_eq!(
        readd_recovery(&sb, stale, false),
        Recovery::Full(FullRebuildReason::StaleBitmap)
    );
    let newer = Some(ReaddBitmap {
        events_cleared: 11,
        stale: false,
    });
    assert_eq!(
        readd_recovery(&sb, newer, false),
        Recovery::Full(FullRebuildReason::OlderThanEventsCleared {
            events: 10,
            events_cleared: 11
        })
    );
    // Itself partly rebuilt: full, unless that recovery was by bitmap too.
    sb.feature_map |= Feature::RecoveryOffset.bit();
    sb.recovery_offset = 512;
    assert_eq!(
        readd_recovery(&sb, cur, false),
        Recovery::Full(FullRebuildReason::PartlyRecovered {
            recovery_offset: 512
        })
    );
    sb.feature_map |= Feature::RecoveryBitmap.bit();
    assert!(sb.recovers_by_bitmap());
    assert_eq!(readd_recovery(&sb, cur, false), Recovery::Bitmap);
    sb.feature_map |= Feature::Replacement.bit();
    assert_eq!(
        readd_recovery(&sb, cur, false),
        Recovery::Full(FullRebuildReason::Replacement)
    );
}

#[test]
fn marking_in_sync_clears_the_bitmap_recovery_flag() {
    let sbs = array_sbs(Level::Raid5, 4, true);
    let rec = Update {
        recovery: vec![(2, Some(0))],
        features: vec![(2, Feature::RecoveryBitmap, true)],
        ..Update::at(MdTime::new(1_800_000_001, 0))
    };
    let next: Vec<Superblock> = next_generation(&sbs, &rec)
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    assert!(next[2].recovers_by_bitmap());
    assert!(!next[1].recovers_by_bitmap());
    let asm = assemble(&cands(&next), AssembleOptions::default()).unwrap();
    assert!(asm.members[2].as_ref().unwrap().bitmap_recovery);
    let done = Update {
        recovery: vec![(2, None)],
        ..Update::at(MdTime::new(1_800_000_002, 0))
    };
    let next: Vec<Superblock> = next_generation(&next, &done)
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(
        next[2].feature_map & (Feature::RecoveryOffset.bit() | Feature::RecoveryBitmap.bit()),
        0
    );
}

// ---------------------------------------------------------------- consistency policy

/// `--consistency-policy ppl` lays a RAID5 out as mdadm 4.2 does (`validate_geometry1`,
/// `write_init_super1`, `write_init_ppl1`): 1 MiB reserved instead of the bitmap space in
/// the default data offset, `MD_FEATURE_PPL` with the area at +8 sectors, 2048 long, the
/// bad-block log after it, and an area that is zero but for the empty header.
#[test]
fn ppl_policy_lays_out_the_array_as_mdadm() {
    use super::ppl::{scan_area, PplHeader, MDADM_PPL_SIZE_SECTORS};
    // 64 MiB: the headroom halves down to 256 sectors (two 64 KiB chunks) -> 24 + 2048 + 256,
    // rounded up to 2 MiB; the 1 TB disk: 24 + 2048 + 128 MiB -> 130 MiB.
    assert_eq!(ppl_data_offset_sectors(64 * MIB_SECTORS, 128), 4096);
    assert_eq!(ppl_data_offset_sectors(1_953_525_168, 1024), 266240);
    assert_eq!(
        ppl_data_offset_sectors(64 * MIB_SECTORS, 32768),
        (24 + 2048 + 65536u64).div_ceil(2048) * 2048
    );
    assert_eq!(bad_block_log(4096, 2048), Some((2056, 8)));

    let mut a = new_array(Level::Raid5, 4, true);
    a.consistency_policy = Some(ConsistencyPolicy::Ppl);
    let sbs = a.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()).unwrap();
    for sb in &sbs {
        assert_eq!(sb.feature_map, Feature::Ppl.bit());
        assert_eq!(sb.ppl(), (8, 2048));
        assert_eq!(sb.data_offset, 4096);
        assert_eq!(sb.data_size, 64 * MIB_SECTORS - 4096);
        assert_eq!((sb.bblog_offset, sb.bblog_size), (2056, 8));
        let area = sb.ppl_area().unwrap().unwrap();
        assert_eq!((area.start_sector, area.size_sectors), (16, 2048));
    }
    assert_eq!(a.policy(sbs[0].size), Ok(ConsistencyPolicy::Ppl));
    assert_eq!(a.bitmap_super(sbs[0].size).unwrap(), None);
    assert_eq!(a.initial_bitmap_area(sbs[0].size).unwrap(), None);
    let bytes = a.initial_ppl_area(sbs[0].size).unwrap().unwrap();
    assert_eq!(bytes.len(), usize::from(MDADM_PPL_SIZE_SECTORS) * 512);
    let header = PplHeader::empty(&a.uuid).encode().unwrap();
    assert_eq!(&bytes[..4096], &header[..]);
    assert!(bytes[4096..].iter().all(|&b| b == 0));
    let scan = scan_area(&bytes, 2048, &a.uuid);
    let newest = scan.newest.expect("the empty header is a valid record");
    assert_eq!(
        (newest.header.generation, newest.header.entries.len()),
        (0, 0)
    );

    // An explicit data offset must leave room for the area and the bad-block log.
    a.data_offset_sectors = Some(2064);
    assert_eq!(
        a.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()),
        Err(CreateError::PplSpace {
            data_offset: 2064,
            min: 2072
        })
    );
    a.data_offset_sectors = Some(2072);
    let sbs = a.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()).unwrap();
    assert_eq!((sbs[0].bblog_offset, sbs[0].bblog_size), (2056, 8));
    assert!(sbs[0].ppl_area().unwrap().is_some());
}

/// mdadm's refusals (`mdadm.c` for `--create`): PPL never with a bitmap (mdadm's RAID5
/// only rule gives way to ferroraid's RAID6 PPL); `resync` without a bitmap; `bitmap` with
/// one. The default (no policy) is
/// unchanged.
#[test]
fn consistency_policy_refusals_follow_mdadm() {
    let sizes = [64 * MIB_SECTORS; 4];
    // RAID6 takes ppl (ferroraid's extension, `raid6_ppl_policy_...`), but not with a bitmap.
    let mut r6 = new_array(Level::Raid6, 4, true);
    r6.consistency_policy = Some(ConsistencyPolicy::Ppl);
    r6.bitmap = BitmapChoice::Internal;
    assert!(matches!(
        r6.superblocks(&sizes, &mut rng()),
        Err(CreateError::PolicyConflict {
            policy: ConsistencyPolicy::Ppl,
            ..
        })
    ));

    let mut a = new_array(Level::Raid5, 4, true);
    for p in [ConsistencyPolicy::Ppl, ConsistencyPolicy::Resync] {
        a.consistency_policy = Some(p);
        a.bitmap = BitmapChoice::Internal;
        let e = a.superblocks(&sizes, &mut rng()).unwrap_err();
        assert!(
            matches!(e, CreateError::PolicyConflict { policy, .. } if policy == p),
            "{e}"
        );
        assert!(
            e.to_string().contains("not compatible with an internal"),
            "{e}"
        );
    }
    a.consistency_policy = Some(ConsistencyPolicy::Bitmap);
    a.bitmap = BitmapChoice::None;
    let e = a.superblocks(&sizes, &mut rng()).unwrap_err();
    assert!(e.to_string().contains("needs an internal"), "{e}");
    // md's PPL covers at most 64 members (`ppl_init_log`): 64 take it, 65 do not.
    for (n, ok) in [(64u16, true), (65, false)] {
        let mut wide = new_array(Level::Raid5, n, true);
        wide.consistency_policy = Some(ConsistencyPolicy::Ppl);
        let got = wide.policy(64 * MIB_SECTORS);
        if ok {
            assert_eq!(got, Ok(ConsistencyPolicy::Ppl));
        } else {
            let e = got.unwrap_err();
            assert!(e.to_string().contains("at most 64 members"), "{e}");
        }
    }

    // resync: no bitmap, no PPL, mdadm's usual offset; bitmap: one even on a small array.
    a.consistency_policy = Some(ConsistencyPolicy::Resync);
    a.bitmap = BitmapChoice::Auto;
    let sbs = a.superblocks(&sizes, &mut rng()).unwrap();
    assert_eq!((sbs[0].feature_map, sbs[0].data_offset), (0, 2048));
    assert_eq!(a.initial_ppl_area(sbs[0].size).unwrap(), None);
    a.consistency_policy = Some(ConsistencyPolicy::Bitmap);
    let sbs = a.superblocks(&sizes, &mut rng()).unwrap();
    assert_eq!(sbs[0].feature_map, Feature::BitmapOffset.bit());
    assert_eq!(sbs[0].data_offset, 2048);
    // No policy: the bitmap choice decides, as before.
    a.consistency_policy = None;
    assert_eq!(a.policy(sbs[0].size), Ok(ConsistencyPolicy::Resync));
    assert_eq!(
        a.policy(200 * 1024 * MIB_SECTORS),
        Ok(ConsistencyPolicy::Bitmap)
    );
    a.bitmap = BitmapChoice::Internal;
    assert_eq!(a.policy(sbs[0].size), Ok(ConsistencyPolicy::Bitmap));

    // mdadm's names; none and journal refused with the reason.
    for p in [
        ConsistencyPolicy::Resync,
        ConsistencyPolicy::Bitmap,
        ConsistencyPolicy::Ppl,
    ] {
        assert_eq!(p.name().parse::<ConsistencyPolicy>(), Ok(p));
    }
    assert!("none"
        .parse::<ConsistencyPolicy>()
        .unwrap_err()
        .contains("RAID0"));
    assert!("journal"
        .parse::<ConsistencyPolicy>()
        .unwrap_err()
        .contains("journal device"));
    assert!("PPL".parse::<ConsistencyPolicy>().is_err());
}

// ---------------------------------------------------------------- RAID6 PPL (ferroraid's bit)

/// A RAID6 member of ferroraid's RAID6 PPL: `MD_FEATURE_PPL` and
/// `FERRORAID_FEATURE_RAID6_PPL`, mdadm's area and data offset, as `create` writes it.
fn raid6_ppl_sbs() -> Vec<Superblock> {
    let mut a = new_array(Level::Raid6, 5, true);
    a.consistency_policy = Some(ConsistencyPolicy::Ppl);
    a.superblocks(&[64 * MIB_SECTORS; 5], &mut rng()).unwrap()
}

#[test]
fn raid6_ppl_feature_bit_is_named_and_supported() {
    assert_eq!(Feature::Raid6Ppl.bit(), 1 << 24);
    assert_eq!(Feature::Raid6Ppl.bit(), FERRORAID_FEATURE_RAID6_PPL);
    assert_eq!(Feature::Raid6Ppl.md_name(), "FERRORAID_FEATURE_RAID6_PPL");
    assert_eq!(
        Feature::Raid6Ppl.to_string(),
        "FERRORAID_FEATURE_RAID6_PPL (0x1000000)"
    );
    assert_ne!(Feature::SUPPORTED & FERRORAID_FEATURE_RAID6_PPL, 0);
    // Outside md's bits (the kernel refuses the member), but not an unknown bit to us.
    assert_eq!(FEATURE_ALL & FERRORAID_FEATURE_RAID6_PPL, 0);
    let set = FeatureSet(FERRORAID_FEATURE_RAID6_PPL | 0x8000);
    assert_eq!(set.unknown_bits(), 0x8000);
    assert_eq!(set.features().collect::<Vec<_>>(), vec![Feature::Raid6Ppl]);
    let text = set.to_string();
    assert!(
        text.starts_with("FERRORAID_FEATURE_RAID6_PPL (0x1000000): "),
        "{text}"
    );
    assert!(text.contains("unknown feature bits 0x8000"), "{text}");
    // Bits in order: the discriminants are the bit positions.
    let bits: Vec<u32> = Feature::ALL.iter().map(|f| f.bit()).collect();
    assert!(bits.windows(2).all(|w| w[0] < w[1]), "{bits:x?}");
}

/// `create --consistency-policy ppl --level 6`: exactly the RAID5 layout (mdadm's area,
/// data offset and bad-block log) plus the ferroraid bit; the superblock round-trips and
/// its area is found as on RAID5.
#[test]
fn raid6_ppl_superblock_round_trips_with_mdadms_placement() {
    let sbs = raid6_ppl_sbs();
    for sb in &sbs {
        assert_eq!(sb.feature_map, 0x0100_0400);
        assert_eq!(sb.ppl(), (8, 2048));
        assert_eq!(sb.data_offset, 4096);
        assert_eq!((sb.bblog_offset, sb.bblog_size), (2056, 8));
        let bytes = sb.to_bytes().unwrap();
        assert_eq!(
            u32::from_le_bytes(bytes[8..12].try_into().unwrap()),
            0x0100_0400
        );
        let back = parse(&bytes).unwrap();
        assert_eq!(&back, sb);
        let area = back.ppl_area().unwrap().unwrap();
        assert_eq!((area.start_sector, area.size_sectors), (16, 2048));
        assert_eq!(area.usable_sectors, 2048);
        assert_eq!(area.mode, ppl::PplMode::Multiple);
        assert!(!area.multiple_feature);
        assert_eq!(back.consistency_policy(), ConsistencyPolicy::Ppl);
    }
    // The same area as a RAID5 PPL member's.
    let mut r5 = ppl_sb();
    r5.data_offset = sbs[0].data_offset;
    assert_eq!(
        r5.ppl_area()
            .unwrap()
            .map(|a| (a.start_sector, a.usable_sectors, a.mode)),
        sbs[0]
            .ppl_area()
            .unwrap()
            .map(|a| (a.start_sector, a.usable_sectors, a.mode))
    );
    // MULTIPLE_PPLS (what the kernel writes back for a multi-PPL area) works as well.
    let mut multi = sbs[0].clone();
    multi.feature_map = Feature::MultiplePpls.bit() | Feature::Raid6Ppl.bit();
    assert!(
        reparse(&multi)
            .unwrap()
            .ppl_area()
            .unwrap()
            .unwrap()
            .multiple_feature
    );
}

/// The bit's rules: only on RAID6 and only with a PPL bit; a RAID6 PPL without it keeps
/// md's refusal; md's own PPL refusals still come first.
#[test]
fn raid6_ppl_superblock_refusals_name_the_rule() {
    let base = raid6_ppl_sbs().remove(0);
    let refused = |f: &dyn Fn(&mut Superblock)| {
        let mut sb = base.clone();
        f(&mut sb);
        let e = sb.ppl_area().unwrap_err();
        assert_eq!(reparse(&sb).unwrap_err(), e);
        e
    };
    // RAID6 + PPL bit without the ferroraid bit: md's refusal, with a hint.
    let e = refused(&|sb| sb.feature_map = Feature::Ppl.bit());
    assert_eq!(e, SuperblockError::PplLevel { level: 6 });
    assert_eq!(
        e.to_string(),
        "PPL is not compatible with raid level raid6 (6): md's PPL is RAID5 only (ferroraid's \
         RAID6 PPL also sets FERRORAID_FEATURE_RAID6_PPL)"
    );
    // The bit without a PPL bit.
    let e = refused(&|sb| sb.feature_map = Feature::Raid6Ppl.bit());
    assert!(
        matches!(e, SuperblockError::Raid6PplBit { level: 6, .. }),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "feature_map 0x1000000 on raid level raid6 (6): FERRORAID_FEATURE_RAID6_PPL \
         (0x1000000) is set without a PPL bit (MD_FEATURE_PPL or MD_FEATURE_MULTIPLE_PPLS): \
         it marks a RAID6 partial parity log and means nothing alone"
    );
    // ... also beside a bitmap (not md's PPL-with-bitmap refusal: there is no PPL bit).
    let e = refused(&|sb| {
        sb.feature_map = Feature::Raid6Ppl.bit() | Feature::BitmapOffset.bit();
        sb.bitmap_offset = 8;
    });
    assert!(e.to_string().contains("without a PPL bit"), "{e}");
    // On RAID5.
    let mut r5 = ppl_sb();
    r5.feature_map |= Feature::Raid6Ppl.bit();
    let e = r5.ppl_area().unwrap_err();
    assert_eq!(reparse(&r5).unwrap_err(), e);
    assert_eq!(
        e.to_string(),
        "feature_map 0x1000400 on raid level raid5 (5): FERRORAID_FEATURE_RAID6_PPL \
         (0x1000000) is set on a RAID5: a RAID5 partial parity log is md's own and carries \
         no ferroraid bit"
    );
    r5.feature_map = Feature::Raid6Ppl.bit();
    assert!(r5
        .ppl_area()
        .unwrap_err()
        .to_string()
        .contains("without a PPL bit"));
    // Another level: md's refusal.
    assert_eq!(
        refused(&|sb| sb.level = 4),
        SuperblockError::PplLevel { level: 4 }
    );
    // md's combination and placement rules hold for RAID6 as for RAID5.
    for extra in [
        Feature::BitmapOffset,
        Feature::Journal,
        Feature::MultiplePpls,
    ] {
        assert!(matches!(
            refused(&|sb| sb.feature_map |= extra.bit()),
            SuperblockError::PplFeatures { .. }
        ));
    }
    assert!(matches!(
        refused(&|sb| sb.data_offset = 2048),
        SuperblockError::PplPlacement { why, .. } if why.contains("data area")
    ));
    assert!(matches!(
        refused(&|sb| sb.set_ppl(8, 15)),
        SuperblockError::PplPlacement { why, .. } if why.contains("too small")
    ));
}

/// What `create` writes for `--level 6 --consistency-policy ppl`: the RAID5 layout, the
/// ferroraid bit, and the same initial area.
#[test]
fn raid6_ppl_policy_is_the_raid5_layout_plus_the_bit() {
    let mut r5 = new_array(Level::Raid5, 5, true);
    r5.consistency_policy = Some(ConsistencyPolicy::Ppl);
    let r5_sbs = r5.superblocks(&[64 * MIB_SECTORS; 5], &mut rng()).unwrap();
    let mut r6 = new_array(Level::Raid6, 5, true);
    r6.consistency_policy = Some(ConsistencyPolicy::Ppl);
    let r6_sbs = r6.superblocks(&[64 * MIB_SECTORS; 5], &mut rng()).unwrap();
    for (a, b) in r5_sbs.iter().zip(&r6_sbs) {
        assert_eq!(b.feature_map, a.feature_map | Feature::Raid6Ppl.bit());
        assert_eq!(
            (b.bitmap_offset, b.data_offset, b.bblog_offset, b.bblog_size),
            (a.bitmap_offset, a.data_offset, a.bblog_offset, a.bblog_size)
        );
    }
    assert_eq!(
        r6.initial_ppl_area(r6_sbs[0].size).unwrap(),
        Some(empty_ppl_area(&r6.uuid, 2048))
    );
    assert_eq!(r6.policy(r6_sbs[0].size), Ok(ConsistencyPolicy::Ppl));
}

fn switch(sbs: &[Superblock], to: ConsistencyPolicy) -> Result<Vec<Superblock>, PolicyChangeError> {
    switch_consistency_policy(sbs, to, MdTime::new(1_800_000_000, 0))
}

/// `grow --consistency-policy resync` and back on a RAID6 PPL array: every bit, the
/// area fields, events and utime as specified; the result is what md would accept
/// (`feature_map` within `MD_FEATURE_ALL`) and switches back to the create-time layout.
#[test]
fn raid6_ppl_switches_to_resync_and_back() {
    let sbs = raid6_ppl_sbs();
    let resync = switch(&sbs, ConsistencyPolicy::Resync).unwrap();
    assert_eq!(resync.len(), sbs.len());
    for (old, new) in sbs.iter().zip(&resync) {
        assert_eq!(new.feature_map, 0);
        assert_eq!(new.bitmap_offset, 0);
        assert_eq!(new.events, old.events + 1);
        assert_eq!(new.utime, MdTime::new(1_800_000_000, 0));
        assert_eq!(new.consistency_policy(), ConsistencyPolicy::Resync);
        assert_eq!((new.data_offset, new.bblog_offset), (4096, 2056));
        assert_eq!(new.feature_map & !FEATURE_ALL, 0);
        reparse(new).unwrap();
        // Nothing else changes.
        let mut same = new.clone();
        same.feature_map = old.feature_map;
        same.bitmap_offset = old.bitmap_offset;
        same.events = old.events;
        same.utime = old.utime;
        assert_eq!(&same, old);
    }
    let back = switch(&resync, ConsistencyPolicy::Ppl).unwrap();
    for (orig, b) in sbs.iter().zip(&back) {
        assert_eq!(b.feature_map, orig.feature_map);
        assert_eq!(b.ppl(), (8, 2048));
        assert_eq!(b.events, orig.events + 2);
        assert_eq!(b.ppl_area().unwrap(), orig.ppl_area().unwrap());
    }
    // RAID5: md's own PPL, no ferroraid bit.
    let mut r5 = new_array(Level::Raid5, 4, true);
    r5.consistency_policy = Some(ConsistencyPolicy::Ppl);
    let r5 = r5.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()).unwrap();
    let r5_back = switch(
        &switch(&r5, ConsistencyPolicy::Resync).unwrap(),
        ConsistencyPolicy::Ppl,
    )
    .unwrap();
    assert!(r5_back
        .iter()
        .all(|sb| sb.feature_map == Feature::Ppl.bit()));
}

/// mdadm's placement for a PPL added later (`update_super1` "ppl"): up to the bad-block
/// log, capped at 2048 sectors, else `choose_ppl_space`; refused below 16 sectors.
#[test]
fn ppl_placement_on_a_resync_array_follows_mdadm() {
    // A small resync array: the bad-block log right after 8 sectors of bitmap space.
    let small = array_sbs(Level::Raid6, 4, true);
    assert_eq!(small[0].bblog_offset, 16);
    assert_eq!(mdadm_ppl_placement(&small[0]), Err(8));
    let e = switch(&small, ConsistencyPolicy::Ppl).unwrap_err();
    assert_eq!(
        e,
        PolicyChangeError::PplSpace {
            index: 0,
            dev_number: 0,
            space_sectors: 8
        }
    );
    assert!(e.to_string().contains("Not enough space to add ppl"), "{e}");
    // Room up to the log: capped by choose_ppl_space (8 + max(chunk, 256)) below 2048.
    let mut sb = small[0].clone();
    sb.bblog_offset = 8 + 128;
    assert_eq!(mdadm_ppl_placement(&sb), Ok((8, 128)));
    sb.bblog_offset = 8 + 1000;
    assert_eq!(mdadm_ppl_placement(&sb), Ok((8, 8 + 256)));
    sb.chunksize = 1024;
    assert_eq!(mdadm_ppl_placement(&sb), Ok((8, 1000)));
    sb.bblog_offset = 8 + 2000;
    assert_eq!(mdadm_ppl_placement(&sb), Ok((8, 8 + 1024)));
    // No log: up to the data; 2048 at most.
    sb.bblog_offset = 0;
    sb.data_offset = 4096;
    assert_eq!(mdadm_ppl_placement(&sb), Ok((8, 2048)));
    // A resync array with room (large devices: 128 sectors of bitmap space).
    let mut roomy = small.clone();
    for sb in &mut roomy {
        sb.bblog_offset = 8 + 128;
    }
    let ppl = switch(&roomy, ConsistencyPolicy::Ppl).unwrap();
    let area = ppl[0].ppl_area().unwrap().unwrap();
    assert_eq!((area.size_sectors, area.mode), (128, ppl::PplMode::Single));
}

#[test]
fn policy_switch_refusals_name_the_reason() {
    let sbs = raid6_ppl_sbs();
    let refused = |sbs: &[Superblock], to| switch(sbs, to).unwrap_err();
    let msg = |sbs: &[Superblock], to| refused(sbs, to).to_string();

    assert!(msg(&sbs, ConsistencyPolicy::Bitmap).contains("only ppl and resync"));
    // Too many members for a PPL: switching to ppl is refused, to resync is not checked.
    let mut wide = switch(&sbs, ConsistencyPolicy::Resync).unwrap();
    for sb in &mut wide {
        sb.raid_disks = 65;
    }
    assert_eq!(
        refused(&wide, ConsistencyPolicy::Ppl),
        PolicyChangeError::PplMembers { members: 65 }
    );
    assert_eq!(
        refused(&[], ConsistencyPolicy::Resync),
        PolicyChangeError::Empty
    );
    // Dirty: assemble and stop cleanly first.
    let mut dirty = sbs.clone();
    for sb in &mut dirty {
        sb.resync_offset = 0;
    }
    assert_eq!(
        msg(&dirty, ConsistencyPolicy::Resync),
        "the array was not shut down cleanly (resync_offset 0): assemble it (ferroraid \
         serve) and stop it cleanly first, then switch"
    );
    // A member behind (a stop that did not reach it).
    let mut behind = sbs.clone();
    behind[3].events = 0;
    for sb in &mut behind[..3] {
        sb.events = 1;
    }
    behind[4].events = 1;
    assert!(matches!(
        refused(&behind, ConsistencyPolicy::Resync),
        PolicyChangeError::EventsDiffer {
            index: 3,
            events: 0,
            newest: 1,
            ..
        }
    ));
    // Every member must be given.
    let e = refused(&sbs[..4], ConsistencyPolicy::Resync);
    assert_eq!(e, PolicyChangeError::MissingRole { role: 4 });
    assert!(e.to_string().contains("give every member"), "{e}");
    // Twice the same member.
    let mut twice = sbs.clone();
    twice.push(sbs[1].clone());
    assert!(matches!(
        refused(&twice, ConsistencyPolicy::Resync),
        PolicyChangeError::DuplicateRole {
            role: 1,
            first: 1,
            second: 5
        }
    ));
    // Members of another array.
    let mut foreign = sbs.clone();
    foreign[2].set_uuid = Uuid([9; 16]);
    assert!(matches!(
        refused(&foreign, ConsistencyPolicy::Resync),
        PolicyChangeError::ForeignArray { index: 2, .. }
    ));
    // Already there.
    assert_eq!(
        msg(&sbs, ConsistencyPolicy::Ppl),
        "consistency policy is already ppl"
    );
    // A bitmap array: neither way (mdadm: "Current consistency policy is bitmap").
    let mut bm = new_array(Level::Raid6, 4, true);
    bm.bitmap = BitmapChoice::Internal;
    let bm = bm.superblocks(&[64 * MIB_SECTORS; 4], &mut rng()).unwrap();
    for to in [ConsistencyPolicy::Ppl, ConsistencyPolicy::Resync] {
        assert!(matches!(
            refused(&bm, to),
            PolicyChangeError::From {
                current: ConsistencyPolicy::Bitmap,
                ..
            }
        ));
    }
    assert!(msg(&bm, ConsistencyPolicy::Ppl)
        .starts_with("current consistency policy is bitmap, cannot change to ppl"));
    // A member being rebuilt.
    let mut rebuilding = sbs.clone();
    rebuilding[2].feature_map |= Feature::RecoveryOffset.bit();
    assert!(matches!(
        refused(&rebuilding, ConsistencyPolicy::Resync),
        PolicyChangeError::Recovering { index: 2, .. }
    ));
    // One ferroraid cannot serve (here: the bit on its own).
    let mut broken = sbs.clone();
    broken[0].feature_map = Feature::Raid6Ppl.bit();
    assert!(matches!(
        refused(&broken, ConsistencyPolicy::Resync),
        PolicyChangeError::Superblock {
            index: 0,
            error: SuperblockError::Raid6PplBit { .. }
        }
    ));
    // A member recorded faulty by the others.
    let mut faulty = sbs.clone();
    for sb in &mut faulty {
        sb.dev_roles[4] = DEV_ROLE_FAULTY;
    }
    assert!(matches!(
        refused(&faulty, ConsistencyPolicy::Resync),
        PolicyChangeError::Faulty {
            index: 4,
            dev_number: 4
        }
    ));
    // A spare is rewritten with the members.
    let mut a = new_array(Level::Raid6, 4, true);
    a.consistency_policy = Some(ConsistencyPolicy::Ppl);
    let with_spare = a.superblocks(&[64 * MIB_SECTORS; 5], &mut rng()).unwrap();
    assert_eq!(with_spare[4].role(), DevRole::Spare);
    let out = switch(&with_spare, ConsistencyPolicy::Resync).unwrap();
    assert_eq!(out[4].feature_map, 0);
}

/// Assembly accepts a RAID6 PPL array as a RAID5 one: the area is attached
/// (`Assembly::ppl`), and dirty with up to two members missing it starts without force
/// (md's dirty-degraded rule for a PPL array, generalised: the recovery at assembly makes
/// every logged stripe consistent first); three missing is too few members either way.
#[test]
fn raid6_ppl_dirty_degraded_assembles_without_force() {
    let mut sbs = raid6_ppl_sbs();
    let area = sbs[0].ppl_area().unwrap();
    let a = assemble(&cands(&sbs), AssembleOptions::default()).unwrap();
    assert_eq!(a.ppl, area);
    assert!(!a.resync_needed);
    for sb in &mut sbs {
        sb.resync_offset = 0;
    }
    for missing in [1, 2] {
        let a = assemble(&cands(&sbs[missing..]), AssembleOptions::default()).unwrap();
        assert!(a.degraded && a.resync_needed);
        assert_eq!(a.ppl, area);
        assert!(a.forced.is_empty(), "{:?}", a.forced);
        assert_eq!(a.missing_roles.len(), missing);
        assert!(
            a.notes()
                .iter()
                .any(|n| n.contains("the Partial Parity Log is recovered before the first")),
            "{:?}",
            a.notes()
        );
    }
    assert!(assemble(&cands(&sbs[3..]), AssembleOptions::default()).is_err());
    // The same array without the ferroraid bit is md's refusal, not a PPL array.
    for sb in &mut sbs {
        sb.feature_map &= !Feature::Raid6Ppl.bit();
    }
    assert!(assemble(&cands(&sbs[1..]), AssembleOptions::default()).is_err());
}
