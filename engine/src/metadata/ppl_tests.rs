//! Tests of `metadata::ppl`: the record format against independently computed bytes, the
//! area scan, and recovery planning on a 4-member RAID5 left-symmetric array.

use proptest::prelude::*;

use super::ppl::*;
use super::Uuid;
use crate::geometry::{ArrayGeometry, Geometry, Layout, Level};

/// The UUID of the golden vectors: bytes 0x00, 0x01, …, 0x0f.
fn uuid() -> Uuid {
    Uuid(std::array::from_fn(|i| i as u8))
}

// Golden values, computed independently of this crate with python3 and a bitwise
// pure-python CRC-32C (reflected polynomial 0x82F63B78, init and final XOR 0xFFFFFFFF;
// it gives 0xE3069283 for b"123456789"):
//   sig  = crc32c(bytes(range(16)))                                   = 0xd9c908eb
//   hdr  = 512 × 0xff, sig (LE) at 0x200, zeros elsewhere (4096 bytes)
//   crc32c(hdr)                                                       = 0xa68b68c7
//   pp   = 4096 × 0xab;  crc32c(pp)                                   = 0x94374193
//   hdr2 = hdr with generation 7 at 0x208, entries_count 1 at 0x210 and the entry
//          (data_sector 8, pp_size 4096, data_size 8192, parity_disk 3, crc32c(pp)) at 0x218
//   crc32c(hdr2)                                                      = 0x5f6b6f11
const GOLDEN_SIGNATURE: u32 = 0xd9c9_08eb;
const GOLDEN_EMPTY_CHECKSUM: u32 = 0xa68b_68c7;
const GOLDEN_PP_CHECKSUM: u32 = 0x9437_4193;
const GOLDEN_ONE_ENTRY_CHECKSUM: u32 = 0x5f6b_6f11;

#[test]
fn crc32c_vector() {
    assert_eq!(pp_checksum(b"123456789"), 0xE306_9283);
    assert_eq!(pp_checksum(&[]), 0, "an entry without PP stores 0");
}

/// The folded partial-parity checksum (`crc-fast`) equals the `crc32c` crate's (which the
/// header checksum and the iSCSI digests use) on every length up to 3 KiB + 64 at four
/// alignments, and on whole 4 KiB..1 MiB partial parity: the SIMD paths switch on length
/// and alignment.
#[test]
fn partial_parity_checksum_equals_the_reference_crc32c() {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let buf: Vec<u8> = (0..(1 << 20) + 8)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng as u8
        })
        .collect();
    for off in 0..4 {
        for len in 0..3136 {
            let b = &buf[off..off + len];
            assert_eq!(
                pp_checksum(b),
                crc32c::crc32c(b),
                "offset {off}, {len} bytes"
            );
        }
    }
    for len in [4096, 65536, 1 << 20] {
        assert_eq!(
            pp_checksum(&buf[..len]),
            crc32c::crc32c(&buf[..len]),
            "{len} bytes"
        );
    }
}

#[test]
fn golden_empty_header() {
    assert_eq!(signature(&uuid()), GOLDEN_SIGNATURE);
    let b = PplHeader::empty(&uuid()).encode().unwrap();
    assert!(b[..512].iter().all(|&x| x == 0xff));
    assert_eq!(b[0x200..0x204], GOLDEN_SIGNATURE.to_le_bytes());
    assert_eq!(b[0x214..0x218], GOLDEN_EMPTY_CHECKSUM.to_le_bytes());
    assert!(b[0x204..0x214].iter().all(|&x| x == 0));
    assert!(b[0x218..].iter().all(|&x| x == 0));
    let h = PplHeader::decode_for(&b, &uuid()).unwrap();
    assert_eq!(h, PplHeader::empty(&uuid()));
}

#[test]
fn golden_one_entry_header() {
    let pp = [0xabu8; 4096];
    assert_eq!(pp_checksum(&pp), GOLDEN_PP_CHECKSUM);
    let e = PplEntry {
        data_sector: 8,
        pp_size: 4096,
        data_size: 8192,
        parity_disk: 3,
        checksum: pp_checksum(&pp),
    };
    assert!(e.pp_matches(&pp));
    assert!(!e.pp_matches(&pp[..512]));
    let h = PplHeader {
        signature: signature(&uuid()),
        generation: 7,
        entries: vec![e],
    };
    let b = h.encode().unwrap();
    assert_eq!(b[0x214..0x218], GOLDEN_ONE_ENTRY_CHECKSUM.to_le_bytes());
    assert_eq!(b[0x218..0x220], 8u64.to_le_bytes());
    assert_eq!(b[0x22c..0x230], GOLDEN_PP_CHECKSUM.to_le_bytes());
    assert_eq!(h.record_sectors(), 16);
}

fn full_header() -> PplHeader {
    PplHeader {
        signature: 0x1234_5678,
        generation: u64::MAX - 3,
        entries: (0..PPL_HDR_MAX_ENTRIES as u64)
            .map(|i| PplEntry {
                data_sector: i * 0x1_0000_0001,
                pp_size: (i as u32) << 12,
                data_size: (i as u32) << 13,
                parity_disk: i as u32 % 7,
                checksum: (i as u32).wrapping_mul(0x9e37_79b9),
            })
            .collect(),
    }
}

#[test]
fn round_trip() {
    let h = full_header();
    let b = h.encode().unwrap();
    assert_eq!(PplHeader::decode(&b).unwrap(), h);
    let mut too_many = h.clone();
    too_many.entries.push(PplEntry::default());
    assert_eq!(
        too_many.encode(),
        Err(PplError::TooManyEntries { count: 149 })
    );
}

#[test]
fn decode_rejects_flipped_bytes() {
    let b = full_header().encode().unwrap();
    for at in [0, 511, 0x200, 0x208, 0x210, 0x214, 0x218, 0xff0, 4095] {
        let mut bad = b;
        bad[at] ^= 0x01;
        assert!(
            matches!(PplHeader::decode(&bad), Err(PplError::Checksum { .. })),
            "flip at {at:#x}"
        );
    }
    assert_eq!(
        PplHeader::decode(&b[..4095]),
        Err(PplError::HeaderLength { len: 4095 })
    );
    assert!(matches!(
        PplHeader::decode_for(&b, &uuid()),
        Err(PplError::Signature {
            found: 0x1234_5678,
            ..
        })
    ));
}

/// `block` with its checksum recomputed.
fn reseal(mut block: [u8; PPL_HEADER_SIZE]) -> [u8; PPL_HEADER_SIZE] {
    let c = header_checksum(&block);
    block[0x214..0x218].copy_from_slice(&c.to_le_bytes());
    block
}

#[test]
fn decode_rejects_bad_entry_count() {
    let mut b = full_header().encode().unwrap();
    b[0x210..0x214].copy_from_slice(&149u32.to_le_bytes());
    let b = reseal(b);
    assert_eq!(
        PplHeader::decode(&b),
        Err(PplError::EntryCount { count: 149 })
    );
    let mut b = reseal(b);
    b[0x210..0x214].copy_from_slice(&u32::MAX.to_le_bytes());
    let b = reseal(b);
    assert_eq!(
        PplHeader::decode(&b),
        Err(PplError::EntryCount { count: u32::MAX })
    );
}

#[test]
fn area_sizes_and_modes() {
    assert_eq!(usable_area_sectors(MDADM_PPL_SIZE_SECTORS), Some(2048));
    assert_eq!(usable_area_sectors(530), Some(528));
    assert_eq!(usable_area_sectors(527), Some(520));
    assert_eq!(usable_area_sectors(16), Some(16));
    assert_eq!(usable_area_sectors(15), None);
    assert_eq!(usable_area_sectors(8), None);
    assert_eq!(usable_area_sectors(0), None);
    assert_eq!(PplMode::of(2048), PplMode::Multiple);
    assert_eq!(PplMode::of(528), PplMode::Multiple);
    assert_eq!(PplMode::of(520), PplMode::Single);
    assert_eq!(PplMode::Multiple.entry_space_bytes(2048), 128 << 10);
    assert_eq!(PplMode::Single.entry_space_bytes(264), 264 * 512 - 4096);
}

/// A record of generation `generation` with one entry per PP length in `pp_sizes`.
fn record(generation: u64, pp_sizes: &[u32]) -> (PplHeader, Vec<u8>) {
    let mut pp = Vec::new();
    let entries = pp_sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let bytes = vec![generation as u8 ^ i as u8; size as usize];
            pp.extend_from_slice(&bytes);
            PplEntry {
                data_sector: 8 * i as u64,
                pp_size: size,
                data_size: size.max(4096),
                parity_disk: 3,
                checksum: pp_checksum(&bytes),
            }
        })
        .collect();
    let h = PplHeader {
        signature: signature(&uuid()),
        generation,
        entries,
    };
    (h, pp)
}

/// Writes record `(h, pp)` at `offset_sectors` of `area`.
fn put(area: &mut [u8], offset_sectors: u64, (h, pp): &(PplHeader, Vec<u8>)) {
    let at = offset_sectors as usize * 512;
    area[at..at + PPL_HEADER_SIZE].copy_from_slice(&h.encode().unwrap());
    area[at + PPL_HEADER_SIZE..at + PPL_HEADER_SIZE + pp.len()].copy_from_slice(pp);
}

const AREA: u64 = MDADM_PPL_SIZE_SECTORS as u64;

#[test]
fn scan_picks_the_newer_of_two() {
    let mut area = vec![0u8; AREA as usize * 512];
    let r1 = record(1, &[4096]);
    let r2 = record(2, &[8192, 4096]);
    put(&mut area, 0, &r1);
    put(&mut area, 16, &r2);
    let s = scan_area(&area, AREA, &uuid());
    assert_eq!(s.records_seen, 2);
    let newest = s.newest.unwrap();
    assert_eq!(newest.offset_sectors, 16);
    assert_eq!(newest.header, r2.0);
    // The next header would be at 16 + 8 + 24 = 48: zeros, a bad checksum.
    assert!(matches!(
        s.end,
        ScanEnd::Invalid {
            offset_sectors: 48,
            error: PplError::Checksum { .. }
        }
    ));
}

#[test]
fn scan_stops_at_a_torn_record() {
    let mut area = vec![0u8; AREA as usize * 512];
    put(&mut area, 0, &record(1, &[4096]));
    put(&mut area, 16, &record(2, &[4096]));
    area[16 * 512 + 1000] ^= 0xff;
    let s = scan_area(&area, AREA, &uuid());
    assert_eq!(s.records_seen, 1);
    assert_eq!(s.newest.unwrap().header.generation, 1);
    assert!(matches!(
        s.end,
        ScanEnd::Invalid {
            offset_sectors: 16,
            ..
        }
    ));
}

#[test]
fn scan_handles_rewind() {
    // First pass: generations 1 at 0 and 2 at 16; the log rewound and wrote 3 at 0, whose
    // PP ends where 2 begins. 2 is valid but older: 3 is the newest.
    let mut area = vec![0u8; AREA as usize * 512];
    put(&mut area, 0, &record(1, &[4096]));
    put(&mut area, 16, &record(2, &[4096]));
    put(&mut area, 0, &record(3, &[4096]));
    let s = scan_area(&area, AREA, &uuid());
    assert_eq!(s.records_seen, 1);
    let newest = s.newest.unwrap();
    assert_eq!((newest.offset_sectors, newest.header.generation), (0, 3));
    assert_eq!(
        s.end,
        ScanEnd::Older {
            offset_sectors: 16,
            generation: 2
        }
    );
    // Equal generations do not stop the walk (md stops only on a lower one).
    put(&mut area, 16, &record(3, &[4096]));
    let s = scan_area(&area, AREA, &uuid());
    assert_eq!(s.records_seen, 2);
    assert_eq!(s.newest.unwrap().offset_sectors, 16);
}

#[test]
fn scan_of_fresh_and_foreign_areas() {
    // What mdadm and the kernel leave: a zeroed area with the empty header.
    let mut area = vec![0u8; AREA as usize * 512];
    area[..PPL_HEADER_SIZE].copy_from_slice(&PplHeader::empty(&uuid()).encode().unwrap());
    let s = scan_area(&area, AREA, &uuid());
    assert_eq!(s.records_seen, 1);
    let newest = s.newest.unwrap();
    assert_eq!((newest.offset_sectors, newest.header.generation), (0, 0));
    assert!(newest.header.entries.is_empty());
    // Another array's header.
    let other = Uuid([7; 16]);
    let s = scan_area(&area, AREA, &other);
    assert_eq!(s.newest, None);
    assert_eq!(
        s.end,
        ScanEnd::Signature {
            offset_sectors: 0,
            found: GOLDEN_SIGNATURE
        }
    );
    // All zeros: nothing valid.
    let s = scan_area(&vec![0u8; 8192], 16, &uuid());
    assert_eq!((s.newest, s.records_seen), (None, 0));
    // A short buffer reads as zeros beyond its end; an area too small to hold a header
    // reads nothing.
    let s = scan_area(&[], 16, &uuid());
    assert_eq!(s.newest, None);
    let s = scan_area(&area, 8, &uuid());
    assert_eq!((s.newest, s.end), (None, ScanEnd::EndOfArea));
}

#[test]
fn scan_stops_at_the_area_end() {
    // A record whose PP fills the rest of a 24-sector area: the next header would start
    // at 24 = usable − 0, where no header fits.
    let mut area = vec![0u8; 24 * 512];
    put(&mut area, 0, &record(5, &[8192]));
    let s = scan_area(&area, 24, &uuid());
    assert_eq!(s.records_seen, 1);
    assert_eq!(s.end, ScanEnd::EndOfArea);
}

#[test]
fn scan_reports_read_errors() {
    let r = scan_area_with(AREA, &uuid(), |_, _| Err("EIO"));
    assert_eq!(r, Err("EIO"));
}

const CHUNK: u64 = 64 << 10;
const CHUNK_SECTORS: u64 = CHUNK / 512;

/// 4-member RAID5 left-symmetric, 64 KiB chunks, 16 stripes. Stripe 0: D0 D1 D2 P on
/// members 0 1 2 3; stripe 1: D1 D2 P D0 (P on member 2, D0 on member 3).
fn raid5() -> ArrayGeometry {
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, CHUNK, 512).unwrap();
    ArrayGeometry::new(g, 16).unwrap()
}

/// Array sector of stripe 1's first data sector.
const STRIPE1: u64 = 3 * CHUNK_SECTORS;

fn block(member: u16, offset_bytes: u64) -> MemberBlock {
    MemberBlock {
        member,
        offset_bytes,
    }
}

fn none_missing(_: u16, _: u64) -> bool {
    false
}

#[test]
fn plan_one_row() {
    // One 4 KiB write to stripe 0, data chunk 1, row 1 (case 0).
    let e = PplEntry {
        data_sector: CHUNK_SECTORS + 8,
        pp_size: 4096,
        data_size: 4096,
        parity_disk: 3,
        checksum: 0,
    };
    let p = plan_recovery(&e, &raid5(), 3, none_missing).unwrap();
    assert_eq!(p.block_bytes, 4096);
    assert!(p.skipped.is_empty());
    assert_eq!(
        p.rows,
        vec![RecoveryRow {
            array_sector: CHUNK_SECTORS + 8,
            pp_offset_bytes: Some(0),
            data: vec![block(1, 4096)],
            parity: block(3, 4096),
        }]
    );
}

/// Three rows (2..5) of stripe 1 written on data chunks 0 and 1 (members 3 and 0).
fn three_rows_two_chunks() -> PplEntry {
    PplEntry {
        data_sector: STRIPE1 + 16,
        pp_size: 3 * 4096,
        data_size: 2 * 3 * 4096,
        parity_disk: 2,
        checksum: 0,
    }
}

#[test]
fn plan_multi_row() {
    let p = plan_recovery(&three_rows_two_chunks(), &raid5(), 2, none_missing).unwrap();
    assert_eq!(p.block_bytes, 4096);
    let base = CHUNK + 16 * 512;
    let want: Vec<RecoveryRow> = (0..3u64)
        .map(|r| RecoveryRow {
            array_sector: STRIPE1 + 16 + 8 * r,
            pp_offset_bytes: Some(4096 * r),
            data: vec![block(3, base + 4096 * r), block(0, base + 4096 * r)],
            parity: block(2, base + 4096 * r),
        })
        .collect();
    assert_eq!(p.rows, want);
    assert!(p.skipped.is_empty());
}

#[test]
fn plan_full_stripe() {
    // One row (row 5) of stripe 1 written on all three data chunks: no PP (case 2).
    let e = PplEntry {
        data_sector: STRIPE1 + 40,
        pp_size: 0,
        data_size: 3 * 4096,
        parity_disk: 2,
        checksum: 0,
    };
    let p = plan_recovery(&e, &raid5(), 2, none_missing).unwrap();
    let at = CHUNK + 40 * 512;
    assert_eq!(
        p.rows,
        vec![RecoveryRow {
            array_sector: STRIPE1 + 40,
            pp_offset_bytes: None,
            data: vec![block(3, at), block(0, at), block(1, at)],
            parity: block(2, at),
        }]
    );
}

#[test]
fn plan_skips_rows_of_a_missing_modified_member() {
    // Member 0 (modified) is recovered only up to row 3 of stripe 1: rows 3 and 4 skip.
    let limit = CHUNK + 24 * 512;
    let p = plan_recovery(&three_rows_two_chunks(), &raid5(), 2, |m, off| {
        m == 0 && off >= limit
    })
    .unwrap();
    assert_eq!(p.rows.len(), 1);
    assert_eq!(p.rows[0].array_sector, STRIPE1 + 16);
    assert_eq!(
        p.skipped,
        vec![
            SkippedRow {
                array_sector: STRIPE1 + 24,
                missing: block(0, limit)
            },
            SkippedRow {
                array_sector: STRIPE1 + 32,
                missing: block(0, limit + 4096)
            },
        ]
    );
    // A missing *unmodified* member (1) changes nothing: the write hole is closed.
    let p = plan_recovery(&three_rows_two_chunks(), &raid5(), 2, |m, _| m == 1).unwrap();
    assert_eq!(p.rows.len(), 3);
    assert!(p.skipped.is_empty());
}

#[test]
fn plan_small_blocks_when_unaligned() {
    // Two sectors on data chunk 0 of stripe 1, not 4 KiB aligned: 512-byte blocks.
    let e = PplEntry {
        data_sector: STRIPE1 + 1,
        pp_size: 1024,
        data_size: 1024,
        parity_disk: 2,
        checksum: 0,
    };
    let p = plan_recovery(&e, &raid5(), 2, none_missing).unwrap();
    assert_eq!(p.block_bytes, 512);
    assert_eq!(p.rows.len(), 2);
    assert_eq!(p.rows[1].pp_offset_bytes, Some(512));
    assert_eq!(p.rows[1].data, vec![block(3, CHUNK + 1024)]);
}

#[test]
fn plan_pp_of_a_whole_chunk() {
    // Other implementations (md's "case 3/4"): pp_size >= chunk, the modified range is
    // data_sector .. + data_size: all of chunk 0 and the first row of chunk 1.
    let e = PplEntry {
        data_sector: STRIPE1,
        pp_size: CHUNK as u32,
        data_size: (CHUNK + 4096) as u32,
        parity_disk: 2,
        checksum: 0,
    };
    let p = plan_recovery(&e, &raid5(), 2, none_missing).unwrap();
    assert_eq!(p.block_bytes, 4096);
    assert_eq!(p.rows.len(), 16);
    assert_eq!(p.rows[0].data, vec![block(3, CHUNK), block(0, CHUNK)]);
    assert_eq!(p.rows[1].data, vec![block(3, CHUNK + 4096)]);
    assert_eq!(p.rows[15].pp_offset_bytes, Some(15 * 4096));
}

#[test]
fn plan_refuses_what_the_kernel_asserts() {
    let g = raid5();
    let mut e = three_rows_two_chunks();
    e.parity_disk = 3;
    assert!(matches!(
        plan_recovery(&e, &g, 3, none_missing),
        Err(RecoveryError::ParityDisk { p_member: 2, .. })
    ));
    assert!(matches!(
        plan_recovery(&three_rows_two_chunks(), &g, 1, none_missing),
        Err(RecoveryError::WrongLog {
            p_member: 2,
            log_member: 1
        })
    ));
    let mut e = three_rows_two_chunks();
    e.data_sector = 16 * 3 * CHUNK_SECTORS - 8;
    assert!(matches!(
        plan_recovery(&e, &g, 2, none_missing),
        Err(RecoveryError::OutOfRange { .. })
    ));
    e.data_sector = u64::MAX - 4;
    assert!(matches!(
        plan_recovery(&e, &g, 2, none_missing),
        Err(RecoveryError::OutOfRange { .. })
    ));
    let mut e = three_rows_two_chunks();
    e.data_size = 4 * e.pp_size;
    assert!(matches!(
        plan_recovery(&e, &g, 2, none_missing),
        Err(RecoveryError::TooManyDataDisks { data_disks: 4, .. })
    ));
    let e = PplEntry {
        pp_size: 0,
        data_size: 3 * (CHUNK as u32 + 4096),
        ..three_rows_two_chunks()
    };
    assert!(matches!(
        plan_recovery(&e, &g, 2, none_missing),
        Err(RecoveryError::StripTooLong { .. })
    ));
    let g6 = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 4, CHUNK, 512).unwrap();
    let g6 = ArrayGeometry::new(g6, 16).unwrap();
    assert_eq!(
        plan_recovery(&three_rows_two_chunks(), &g6, 2, none_missing),
        Err(RecoveryError::Level(Level::Raid6))
    );
    // data_size < pp_size: no modified chunk, nothing to do (as in md).
    let e = PplEntry {
        data_size: 0,
        ..three_rows_two_chunks()
    };
    let p = plan_recovery(&e, &g, 2, none_missing).unwrap();
    assert!(p.rows.is_empty() && p.skipped.is_empty());
}

proptest! {
    #[test]
    fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..5000)) {
        let _ = PplHeader::decode(&bytes);
        if bytes.len() >= PPL_HEADER_SIZE {
            let mut b = [0u8; PPL_HEADER_SIZE];
            b.copy_from_slice(&bytes[..PPL_HEADER_SIZE]);
            // Past the checksum: the entry count and entries are what is checked.
            let b = reseal(b);
            if let Ok(h) = PplHeader::decode(&b) {
                prop_assert!(h.entries.len() <= PPL_HDR_MAX_ENTRIES);
                let _ = h.record_sectors();
            }
        }
    }

    #[test]
    fn scan_never_panics(
        bytes in proptest::collection::vec(any::<u8>(), 0..20000),
        size in any::<u16>(),
    ) {
        let usable = usable_area_sectors(size).unwrap_or(0);
        let s = scan_area(&bytes, usable, &uuid());
        if let Some(r) = s.newest {
            prop_assert!(r.offset_sectors + PPL_HEADER_SECTORS <= usable);
        }
    }

    #[test]
    fn plans_stay_in_the_stripe(
        kind in 0u8..4,
        rows in 1u32..17,
        disks in 0u32..5,
        raw_pp in any::<u32>(),
        raw_data in any::<u32>(),
        data_sector in 0u64..CHUNK_SECTORS * 48,
        far in any::<bool>(),
        parity in proptest::option::of(0u32..5),
        missing in any::<u8>(),
    ) {
        // Mostly entries shaped as md writes them, with the right parity member.
        let (pp_size, data_size) = match kind {
            0 => (rows * 4096, rows * 4096 * disks),
            1 => (0, rows * 4096 * 3),
            2 => (CHUNK as u32, raw_data % (3 * CHUNK as u32)),
            _ => (raw_pp, raw_data),
        };
        let g = raid5();
        let p_member = g.stripe(data_sector / (3 * CHUNK_SECTORS)).p_member();
        let parity_disk = parity.unwrap_or(u32::from(p_member));
        let data_sector = if far { data_sector.wrapping_mul(0x9e37_79b9_7f4a_7c15) } else { data_sector };
        let e = PplEntry { data_sector, pp_size, data_size, parity_disk, checksum: 0 };
        if let Ok(plan) = plan_recovery(&e, &g, p_member, |m, _| missing & (1 << m) != 0) {
            for row in &plan.rows {
                prop_assert_eq!(row.parity.member, p_member);
                prop_assert!(row.data.len() <= 3);
                prop_assert!(row.data.iter().all(|b| b.member < 4 && b.member != p_member));
                prop_assert!(row.data.iter().all(|b| b.offset_bytes == row.parity.offset_bytes
                    || kind >= 2));
                prop_assert!(row.parity.offset_bytes < g.member_data_bytes());
                if let Some(off) = row.pp_offset_bytes {
                    // The row's PP lies within the entry's PP.
                    prop_assert!(off + u64::from(plan.block_bytes) <= u64::from(pp_size));
                }
            }
            for row in &plan.skipped {
                prop_assert!(missing & (1 << row.missing.member) != 0);
            }
        }
    }
}

/// The fuzz seed `fuzz/seeds/ppl/two-records`, written by an independent python script
/// (pure-python CRC-32C, UUID 16 × 0x5a): records of generations 1 and 2 back to back.
#[test]
fn python_built_area() {
    let area = include_bytes!("../../../fuzz/seeds/ppl/two-records");
    let uuid = Uuid([0x5a; 16]);
    let s = scan_area(area, 48, &uuid);
    assert_eq!((s.records_seen, s.end.clone()), (2, ScanEnd::EndOfArea));
    let newest = s.newest.unwrap();
    assert_eq!((newest.offset_sectors, newest.header.generation), (16, 2));
    let e = newest.header.entries;
    assert_eq!(e.len(), 2);
    let pp_at = (16 + 8) * 512;
    assert!(e[0].pp_matches(&area[pp_at..pp_at + 8192]));
    assert!(e[1].pp_matches(&[]));
    let p = plan_recovery(&e[0], &raid5(), 2, none_missing).unwrap();
    assert_eq!(p.rows.len(), 2);
    assert_eq!(
        p.rows[1].data,
        vec![block(3, CHUNK + 24 * 512), block(0, CHUNK + 24 * 512)]
    );
    let p = plan_recovery(&e[1], &raid5(), 2, none_missing).unwrap();
    assert_eq!(p.rows.len(), 1);
    assert_eq!(p.rows[0].data.len(), 3);
}

#[test]
fn plan_refuses_entries_crossing_a_stripe() {
    // Chunks 2 and 3 of stripe 0 written: the second is stripe 1's first chunk.
    let e = PplEntry {
        data_sector: 2 * CHUNK_SECTORS,
        pp_size: 4096,
        data_size: 2 * 4096,
        parity_disk: 3,
        checksum: 0,
    };
    assert_eq!(
        plan_recovery(&e, &raid5(), 3, none_missing),
        Err(RecoveryError::CrossesStripe {
            first: 2 * CHUNK_SECTORS,
            last: 3 * CHUNK_SECTORS + 8,
            stripe_sectors: 3 * CHUNK_SECTORS
        })
    );
    // An entry with less than a sector of PP and one chunk reaches nothing, as in md.
    let e = PplEntry {
        pp_size: 100,
        data_size: 100,
        ..e
    };
    assert_eq!(
        plan_recovery(&e, &raid5(), 3, none_missing).map(|p| p.rows.len()),
        Ok(0)
    );
}
