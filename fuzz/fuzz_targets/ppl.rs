//! Fuzz target: md's Partial Parity Log (`engine::metadata::ppl`).
//!
//! The input is a PPL area: its first 4096 bytes go to the header parser as they are and
//! with the checksum fixed up (to reach the entry count and entries); whatever decodes
//! must re-encode to the same bytes. The whole input is scanned as an area (and its first
//! two bytes choose the area size), and every entry of every header found — plus entries
//! read straight from the input — is planned for recovery against a small RAID5 array,
//! with members missing as the input says.
#![no_main]

use engine::geometry::{ArrayGeometry, Geometry, Layout};
use engine::metadata::ppl::{
    header_checksum, plan_recovery, scan_area, usable_area_sectors, PplEntry, PplHeader,
    PPL_ENTRY_SIZE, PPL_HEADER_SIZE,
};
use engine::metadata::Uuid;
use libfuzzer_sys::fuzz_target;

fn header(block: &[u8; PPL_HEADER_SIZE]) -> Option<PplHeader> {
    let h = PplHeader::decode(block).ok()?;
    assert!(h.entries.len() <= 148);
    // Unused slots and padding are not checked: the round trip holds up to them.
    let again = PplHeader::decode(&h.encode().expect("a decoded header encodes"))
        .expect("an encoded header decodes");
    assert_eq!(again, h, "decode/encode round trip");
    Some(h)
}

fuzz_target!(|data: &[u8]| {
    let uuid = Uuid([0x5a; 16]);
    let geometries = [
        (Layout::LeftSymmetric, 4, 64 << 10),
        (Layout::ParityLast, 3, 4 << 10),
        (Layout::RightAsymmetric, 5, 16 << 10),
    ]
    .map(|(layout, members, chunk)| {
        let g = Geometry::new(engine::geometry::Level::Raid5, layout, members, chunk, 512)
            .expect("valid geometry");
        ArrayGeometry::new(g, 64).expect("valid array")
    });
    let missing = data.get(2).copied().unwrap_or(0);
    let limit = u64::from(data.get(3).copied().unwrap_or(0)) << 12;
    let mut entries: Vec<PplEntry> = data
        .chunks_exact(PPL_ENTRY_SIZE)
        .take(8)
        .map(|c| PplEntry::from_bytes(c.try_into().expect("24 bytes")))
        .collect();
    if data.len() >= PPL_HEADER_SIZE {
        let mut block = [0u8; PPL_HEADER_SIZE];
        block.copy_from_slice(&data[..PPL_HEADER_SIZE]);
        let _ = header(&block);
        let c = header_checksum(&block);
        block[0x214..0x218].copy_from_slice(&c.to_le_bytes());
        if let Some(h) = header(&block) {
            entries.extend(h.entries);
        }
    }
    let size = u16::from_le_bytes([
        data.first().copied().unwrap_or(0),
        data.get(1).copied().unwrap_or(0),
    ]);
    let scan = scan_area(data, usable_area_sectors(size).unwrap_or(0), &uuid);
    if let Some(r) = scan.newest {
        entries.extend(r.header.entries);
    }
    for e in entries.iter().take(200) {
        for g in &geometries {
            let log_member = (e.parity_disk % 8) as u16;
            if let Ok(plan) = plan_recovery(e, g, log_member, |m, off| {
                missing & (1 << (m % 8)) != 0 && off >= limit
            }) {
                let members = g.geometry().members();
                for row in &plan.rows {
                    assert!(row.parity.member < members);
                    assert!(row.data.len() <= usize::from(g.geometry().data_chunks()));
                    assert!(row
                        .data
                        .iter()
                        .all(|b| b.member < members && b.member != row.parity.member));
                    assert!(row.parity.offset_bytes < g.member_data_bytes());
                    if let Some(off) = row.pp_offset_bytes {
                        assert!(off + u64::from(plan.block_bytes) <= u64::from(e.pp_size));
                    }
                }
            }
        }
    }
});
