//! Fuzz target: the iSCSI parsers of `ferroraid::iscsi` — PDU framing (`Framing::frame`
//! and `Framing::split`, digests on and off, receive limits drawn from the input), login
//! and text key lists (`text::parse`, numbers, binary values), and the SCSI layer
//! (`scsi::decode` of the input as a CDB against a LUN shaped by the input, MODE SELECT
//! parameter lists, UNMAP descriptor lists). None may panic; a framed PDU must split, and
//! a decoded plan's data must fit the page buffer.
#![no_main]

use ferroraid::iscsi::pdu::{Framing, BHS_BYTES};
use ferroraid::iscsi::scsi::{self, LunInfo, Plan, MAX_PAGE_BYTES};
use ferroraid::iscsi::text;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let byte = |i: usize| data.get(i).copied().unwrap_or(0);
    // Framing with limits and digests from the first bytes; the PDU is the rest.
    let f = Framing {
        header_digest: byte(0) & 1 != 0,
        data_digest: byte(0) & 2 != 0,
        max_recv_data: 512 + (u32::from(byte(1)) << 8),
    };
    let pdu = data.get(2..).unwrap_or_default();
    if let Ok(Some(n)) = f.frame(pdu) {
        assert!(n >= BHS_BYTES && n <= pdu.len() && n <= f.max_pdu_bytes());
        let p = f.split(&pdu[..n]).expect("a framed PDU splits");
        assert!(p.data.len() <= f.max_recv_data as usize);
        let _ = p.bhs.wire_bytes(f.header_digest, f.data_digest);
    }
    // Text keys (login, SendTargets).
    if let Ok(keys) = text::parse(data) {
        for (_, v) in keys {
            let _ = text::number(&v);
            let _ = text::decode_binary(&v);
        }
    }
    // SCSI: the input's first 16 bytes as a CDB, the LUN's facts from the next ones.
    let mut cdb = [0u8; 16];
    let k = data.len().min(16);
    cdb[..k].copy_from_slice(&data[..k]);
    let block_bytes = 512u32 << (byte(16) % 4);
    let lun = LunInfo {
        block_bytes,
        blocks: u64::from(u32::from_le_bytes([byte(17), byte(18), byte(19), byte(20)])),
        max_transfer_blocks: 1 + u32::from(byte(21)) * 64,
        granularity_blocks: u32::from(byte(22)),
        optimal_blocks: u32::from(byte(23)),
        max_compare_write_blocks: byte(24),
        max_write_same_blocks: 1 + u32::from(byte(25)) * 1024,
        uuid: [byte(26); 16],
        product: "RAID6 array".into(),
        target_name: "iqn.2026-11.org.ferroraid:fuzz".into(),
    };
    let mut out = vec![0u8; MAX_PAGE_BYTES];
    match scsi::decode(&cdb, &lun, &mut out) {
        Plan::Data { len } => assert!(len as usize <= MAX_PAGE_BYTES),
        Plan::Read { lba, blocks } | Plan::Write { lba, blocks, .. } => {
            assert!(lba + u64::from(blocks) <= lun.blocks && blocks <= lun.max_transfer_blocks)
        }
        _ => {}
    }
    let params = data.get(16..).unwrap_or_default();
    let _ = scsi::mode_select(params, byte(0) & 1 != 0);
    if let Ok(n) = scsi::unmap_descriptors(params, &lun) {
        for i in 0..n {
            let (lba, blocks) = scsi::unmap_descriptor(params, i);
            assert!(lba + u64::from(blocks) <= lun.blocks);
        }
    }
});
