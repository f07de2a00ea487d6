//! NVMe command-set facts shared by the two NVMe back ends ([`crate::nvme_passthru`] and
//! [`crate::vfio_nvme`]): opcodes, the 64-byte submission entry, the 16-byte completion
//! entry, Identify parsing, and the mapping of command status (SCT/SC) to
//! [`engine::device::IoError`].
//!
//! Sources: NVM Express Base Specification 2.0 (§3.3.3 command formats, §4.2 completion
//! queue entry, Figures 92–105 status codes, §5.17 Identify) and NVM Command Set
//! Specification 1.0 (§3 I/O commands, §4.1.5 Identify Namespace data structure).
//! Everything on the wire is little-endian.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

use engine::device::{IoError, Op};

/// Admin opcode: Delete I/O Submission Queue (Base 2.0 §5.7).
pub const ADMIN_DELETE_SQ: u8 = 0x00;
/// Admin opcode: Create I/O Submission Queue (§5.5).
pub const ADMIN_CREATE_SQ: u8 = 0x01;
/// Admin opcode: Delete I/O Completion Queue (§5.6).
pub const ADMIN_DELETE_CQ: u8 = 0x04;
/// Admin opcode: Create I/O Completion Queue (§5.4).
pub const ADMIN_CREATE_CQ: u8 = 0x05;
/// Admin opcode: Identify (§5.17).
pub const ADMIN_IDENTIFY: u8 = 0x06;
/// Admin opcode: Abort (§5.1).
pub const ADMIN_ABORT: u8 = 0x08;
/// Admin opcode: Set Features (§5.27).
pub const ADMIN_SET_FEATURES: u8 = 0x09;
/// Feature identifier: Number of Queues (§5.27.1.5).
pub const FEATURE_NUMBER_OF_QUEUES: u32 = 0x07;

/// NVM opcode: Flush (NVM Command Set 1.0 §3.2 / Base §7.1).
pub const NVM_FLUSH: u8 = 0x00;
/// NVM opcode: Write (§3.2.6).
pub const NVM_WRITE: u8 = 0x01;
/// NVM opcode: Read (§3.2.4).
pub const NVM_READ: u8 = 0x02;
/// NVM opcode: Write Zeroes (§3.2.8).
pub const NVM_WRITE_ZEROES: u8 = 0x08;
/// NVM opcode: Dataset Management (§3.2.3).
pub const NVM_DSM: u8 = 0x09;

/// CDW12 bit 30 of Read/Write/Write Zeroes: Force Unit Access.
pub const CDW12_FUA: u32 = 1 << 30;
/// CDW11 bit 2 of Dataset Management: Attribute – Deallocate.
pub const DSM_DEALLOCATE: u32 = 1 << 2;

/// Largest number of logical blocks one Read/Write/Write Zeroes command names: NLB is a
/// 16-bit 0's-based field in CDW12.
pub const MAX_NLB: u32 = 1 << 16;

/// A 64-byte submission queue entry (Base 2.0 Figure 88: common command format).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Command {
    /// Opcode (bits 7:0), fused/PSDT flags (15:8, 0 = PRPs), command identifier (31:16).
    pub cdw0: u32,
    /// Namespace identifier.
    pub nsid: u32,
    /// Command dword 2 (reserved for NVM I/O).
    pub cdw2: u32,
    /// Command dword 3.
    pub cdw3: u32,
    /// Metadata pointer (unused: ferroraid formats without metadata).
    pub mptr: u64,
    /// PRP entry 1: bus address of the first data page (may have an offset).
    pub prp1: u64,
    /// PRP entry 2: the second page, or the bus address of a PRP list.
    pub prp2: u64,
    /// Command dwords 10–15.
    pub cdw10: u32,
    /// CDW11.
    pub cdw11: u32,
    /// CDW12.
    pub cdw12: u32,
    /// CDW13.
    pub cdw13: u32,
    /// CDW14.
    pub cdw14: u32,
    /// CDW15.
    pub cdw15: u32,
}

const _: () = assert!(std::mem::size_of::<Command>() == 64);

impl Command {
    /// A command with `opcode` and command identifier `cid`, everything else zero.
    pub fn new(opcode: u8, cid: u16) -> Self {
        Self {
            cdw0: u32::from(opcode) | (u32::from(cid) << 16),
            ..Self::default()
        }
    }

    /// The opcode.
    pub fn opcode(&self) -> u8 {
        self.cdw0 as u8
    }

    /// The command identifier.
    pub fn cid(&self) -> u16 {
        (self.cdw0 >> 16) as u16
    }
}

/// A 16-byte completion queue entry (Base 2.0 Figure 90).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompletionEntry {
    /// Command-specific result (DW0).
    pub dw0: u32,
    /// DW1 (reserved).
    pub dw1: u32,
    /// Submission queue head pointer at completion time.
    pub sq_head: u16,
    /// Submission queue the command came from.
    pub sq_id: u16,
    /// The command identifier.
    pub cid: u16,
    /// Phase tag (bit 0) and status field (bits 15:1).
    pub status: u16,
}

const _: () = assert!(std::mem::size_of::<CompletionEntry>() == 16);

impl CompletionEntry {
    /// The phase tag.
    pub fn phase(&self) -> bool {
        self.status & 1 != 0
    }
    /// The status field without the phase tag (SC in bits 7:0, SCT 10:8, CRD 12:11, More
    /// 13, DNR 14): the same value Linux passes back from passthrough commands.
    pub fn status_field(&self) -> u16 {
        self.status >> 1
    }
}

/// Status code type (bits 10:8 of the status field).
pub fn sct(status: u16) -> u8 {
    ((status >> 8) & 0x7) as u8
}

/// Status code (bits 7:0 of the status field).
pub fn sc(status: u16) -> u8 {
    status as u8
}

/// Maps an NVMe status field (phase bit removed; 0 = success) of a command doing `op` to
/// the completion status the engine understands.
///
/// | SCT / SC                                                          | result                 |
/// |-------------------------------------------------------------------|------------------------|
/// | 0/0x00 success                                                    | `Ok`                   |
/// | 0/0x01 invalid opcode, 0/0x02 invalid field (on Write Zeroes/DSM) | `Unsupported`          |
/// | 0/0x02 invalid field, 0/0x80 LBA out of range                     | `Invalid`              |
/// | 0/0x07 abort requested, 0/0x08 SQ deleted                         | `Timeout`              |
/// | 0/0x0B invalid namespace, 0/0x82 namespace not ready              | `Gone`                 |
/// | 0/0x81 capacity exceeded                                          | `NoSpace`              |
/// | 2/0x81 unrecovered read, 2/0x82–0x84 end-to-end check, 2/0x87 deallocated LBA | `Medium` |
/// | anything else (data transfer 0/0x04, internal 0/0x06, write fault 2/0x80, path 3/…) | `Io { errno: EIO }` |
///
/// Generic codes: Base 2.0 Figure 102/103; media and data-integrity codes: Figure 105 and
/// NVM Command Set 1.0 Figure 31.
pub fn status_to_result(op: Op, status: u16) -> Result<(), IoError> {
    let (t, c) = (sct(status), sc(status));
    let optional = matches!(op, Op::WriteZeroes | Op::Discard);
    match (t, c) {
        (0, 0x00) => Ok(()),
        (0, 0x01) => Err(IoError::Unsupported),
        (0, 0x02) if optional => Err(IoError::Unsupported),
        (0, 0x02) | (0, 0x80) => Err(IoError::Invalid),
        (0, 0x07) | (0, 0x08) => Err(IoError::Timeout),
        (0, 0x0B) | (0, 0x82) => Err(IoError::Gone),
        (0, 0x81) => Err(IoError::NoSpace),
        (2, 0x81..=0x84) | (2, 0x87) => Err(IoError::Medium),
        _ => Err(IoError::Io { errno: libc::EIO }),
    }
}

/// Human-readable name of a status, for logs and errors (Base 2.0 Figures 102–105).
pub fn status_name(status: u16) -> &'static str {
    match (sct(status), sc(status)) {
        (0, 0x00) => "successful completion",
        (0, 0x01) => "invalid command opcode",
        (0, 0x02) => "invalid field in command",
        (0, 0x04) => "data transfer error",
        (0, 0x06) => "internal error",
        (0, 0x07) => "command abort requested",
        (0, 0x08) => "command aborted due to SQ deletion",
        (0, 0x0B) => "invalid namespace or format",
        (0, 0x80) => "LBA out of range",
        (0, 0x81) => "capacity exceeded",
        (0, 0x82) => "namespace not ready",
        (1, _) => "command specific error",
        (2, 0x80) => "write fault",
        (2, 0x81) => "unrecovered read error",
        (2, 0x82..=0x84) => "end-to-end protection check error",
        (2, 0x87) => "deallocated or unwritten logical block",
        (2, _) => "media or data integrity error",
        (3, _) => "path related error",
        _ => "vendor specific or reserved status",
    }
}

/// What ferroraid needs from Identify Controller (CNS 01h, Base 2.0 Figure 275).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerIdentity {
    /// Serial number (bytes 23:04), trimmed.
    pub serial: String,
    /// Model number (bytes 63:24), trimmed.
    pub model: String,
    /// Maximum Data Transfer Size (byte 77): 2^mdts × the minimum page size; 0 = no limit.
    pub mdts: u8,
    /// Optional NVM Command Support (bytes 521:520): bit 2 Dataset Management, bit 3 Write
    /// Zeroes.
    pub oncs: u16,
    /// Volatile Write Cache (byte 525) bit 0: a volatile write cache is present.
    pub vwc: bool,
    /// Number of Namespaces (bytes 519:516).
    pub nn: u32,
}

impl ControllerIdentity {
    /// Parses the 4096-byte Identify Controller data structure.
    pub fn parse(d: &[u8; 4096]) -> Self {
        let text = |r: std::ops::Range<usize>| {
            String::from_utf8_lossy(&d[r])
                .trim_matches(|c: char| c == ' ' || c == '\0')
                .to_string()
        };
        Self {
            serial: text(4..24),
            model: text(24..64),
            mdts: d[77],
            oncs: u16::from_le_bytes([d[520], d[521]]),
            vwc: d[525] & 1 != 0,
            nn: u32::from_le_bytes(d[516..520].try_into().expect("4 bytes")),
        }
    }

    /// Whether Dataset Management (deallocate) is supported.
    pub fn dsm(&self) -> bool {
        self.oncs & (1 << 2) != 0
    }

    /// Whether Write Zeroes is supported.
    pub fn write_zeroes(&self) -> bool {
        self.oncs & (1 << 3) != 0
    }

    /// Largest transfer in bytes given the controller's minimum memory page size
    /// (`page_bytes`, 2^(12 + CAP.MPSMIN)); `None` when MDTS reports no limit.
    pub fn max_transfer_bytes(&self, page_bytes: u64) -> Option<u64> {
        (self.mdts != 0).then(|| page_bytes << self.mdts.min(20))
    }
}

/// What ferroraid needs from Identify Namespace (CNS 00h, NVM Command Set 1.0 Figure 97).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceIdentity {
    /// Namespace Size (bytes 7:0), in logical blocks.
    pub nsze: u64,
    /// Logical block size in bytes, from the LBA format FLBAS selects.
    pub block_bytes: u32,
    /// Metadata bytes per block of that format (ferroraid needs 0).
    pub metadata_bytes: u16,
    /// DLFEAT (byte 33) bits 2:0 = 001b: a deallocated block reads as zeroes.
    pub deallocated_reads_zeroes: bool,
}

impl NamespaceIdentity {
    /// Parses the 4096-byte Identify Namespace data structure.
    ///
    /// # Errors
    /// A message when the namespace is inactive (size 0) or its LBA format is unusable
    /// (LBADS outside 9..=16, i.e. not 512 B to 64 KiB).
    pub fn parse(d: &[u8; 4096]) -> Result<Self, String> {
        let nsze = u64::from_le_bytes(d[0..8].try_into().expect("8 bytes"));
        if nsze == 0 {
            return Err("namespace is inactive (size 0)".into());
        }
        let flbas = d[26];
        // FLBAS bits 3:0 with bits 6:5 as the upper bits of the format index (NVM 1.0).
        let index = usize::from((flbas & 0xF) | ((flbas >> 1) & 0x30));
        let at = 128 + 4 * index;
        if at + 4 > d.len() {
            return Err(format!("LBA format index {index} is out of range"));
        }
        let lbaf = u32::from_le_bytes(d[at..at + 4].try_into().expect("4 bytes"));
        let ms = (lbaf & 0xFFFF) as u16;
        let lbads = (lbaf >> 16) & 0xFF;
        if !(9..=16).contains(&lbads) {
            return Err(format!(
                "LBA format {index} has LBADS {lbads} (block size 2^{lbads}); 512 B to 64 KiB supported"
            ));
        }
        Ok(Self {
            nsze,
            block_bytes: 1 << lbads,
            metadata_bytes: ms,
            deallocated_reads_zeroes: d[33] & 0x7 == 1,
        })
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.nsze.saturating_mul(u64::from(self.block_bytes))
    }
}

/// Fills the NVM I/O part of a command for `op` on `[slba, slba + nlb)` of namespace
/// `nsid` (`nlb` ≥ 1 blocks, ≤ [`MAX_NLB`] for the ranged commands). Data pointers and, for
/// Dataset Management, the range list are the caller's.
pub fn io_command(op: Op, cid: u16, nsid: u32, slba: u64, nlb: u32) -> Command {
    debug_assert!(matches!(op, Op::Flush | Op::Discard) || (1..=MAX_NLB).contains(&nlb));
    let (opcode, cdw10, cdw11, cdw12) = match op {
        Op::Flush => (NVM_FLUSH, 0, 0, 0),
        Op::Read => (NVM_READ, slba as u32, (slba >> 32) as u32, nlb - 1),
        Op::Write { fua } => (
            NVM_WRITE,
            slba as u32,
            (slba >> 32) as u32,
            (nlb - 1) | if fua { CDW12_FUA } else { 0 },
        ),
        Op::WriteZeroes => (NVM_WRITE_ZEROES, slba as u32, (slba >> 32) as u32, nlb - 1),
        // One range (NR = 0's based 0), attribute deallocate; the range is in the buffer.
        Op::Discard => (NVM_DSM, 0, DSM_DEALLOCATE, 0),
    };
    let mut c = Command::new(opcode, cid);
    c.nsid = nsid;
    c.cdw10 = cdw10;
    c.cdw11 = cdw11;
    c.cdw12 = cdw12;
    c
}

/// One Dataset Management range (NVM Command Set 1.0 Figure 38): context attributes,
/// length in logical blocks, starting LBA.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DsmRange {
    /// Context attributes (0: none).
    pub attributes: u32,
    /// Length in logical blocks (1's based).
    pub nlb: u32,
    /// Starting LBA.
    pub slba: u64,
}

const _: () = assert!(std::mem::size_of::<DsmRange>() == 16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_mapping_follows_the_spec_tables() {
        let r = Op::Read;
        assert_eq!(status_to_result(r, 0), Ok(()));
        assert_eq!(status_to_result(r, 0x0281), Err(IoError::Medium));
        assert_eq!(status_to_result(r, 0x0287), Err(IoError::Medium));
        assert_eq!(status_to_result(r, 0x0280), Err(IoError::Io { errno: 5 }));
        assert_eq!(status_to_result(r, 0x0080), Err(IoError::Invalid));
        assert_eq!(status_to_result(r, 0x0002), Err(IoError::Invalid));
        assert_eq!(
            status_to_result(Op::WriteZeroes, 0x0002),
            Err(IoError::Unsupported)
        );
        assert_eq!(status_to_result(r, 0x0001), Err(IoError::Unsupported));
        assert_eq!(status_to_result(r, 0x0007), Err(IoError::Timeout));
        assert_eq!(status_to_result(r, 0x0081), Err(IoError::NoSpace));
        assert_eq!(status_to_result(r, 0x000B), Err(IoError::Gone));
        // DNR and More bits do not change the mapping.
        assert_eq!(status_to_result(r, 0x4281), Err(IoError::Medium));
        assert_eq!(status_to_result(r, 0x0004), Err(IoError::Io { errno: 5 }));
        assert_eq!(status_name(0x0281), "unrecovered read error");
        assert_eq!(status_name(0x4004), "data transfer error");
    }

    #[test]
    fn completion_entry_fields() {
        let e = CompletionEntry {
            status: (0x0281 << 1) | 1,
            ..Default::default()
        };
        assert!(e.phase());
        assert_eq!(e.status_field(), 0x0281);
    }

    #[test]
    fn io_commands_encode_lba_and_count() {
        let c = io_command(Op::Write { fua: true }, 7, 1, 0x1_0000_0002, 8);
        assert_eq!(c.opcode(), NVM_WRITE);
        assert_eq!(c.cid(), 7);
        assert_eq!((c.cdw10, c.cdw11), (2, 1));
        assert_eq!(c.cdw12, 7 | CDW12_FUA);
        let c = io_command(Op::Discard, 1, 1, 0, 0);
        assert_eq!((c.opcode(), c.cdw10, c.cdw11), (NVM_DSM, 0, DSM_DEALLOCATE));
        assert_eq!(io_command(Op::Flush, 3, 1, 0, 0).opcode(), NVM_FLUSH);
    }

    #[test]
    fn identify_parsing() {
        let mut d = [0u8; 4096];
        d[4..10].copy_from_slice(b"SER123");
        d[24..28].copy_from_slice(b"QEMU");
        d[77] = 5;
        d[520] = 0b1100;
        d[525] = 1;
        d[516] = 1;
        let c = ControllerIdentity::parse(&d);
        assert_eq!((c.serial.as_str(), c.model.as_str()), ("SER123", "QEMU"));
        assert!(c.dsm() && c.write_zeroes() && c.vwc);
        assert_eq!(c.max_transfer_bytes(4096), Some(128 << 10));
        let mut n = [0u8; 4096];
        n[0..8].copy_from_slice(&2048u64.to_le_bytes());
        n[26] = 1; // format 1
        n[33] = 1;
        n[132..136].copy_from_slice(&(12u32 << 16).to_le_bytes());
        let ns = NamespaceIdentity::parse(&n).unwrap();
        assert_eq!(ns.block_bytes, 4096);
        assert_eq!(ns.capacity_bytes(), 2048 * 4096);
        assert!(ns.deallocated_reads_zeroes);
        n[132..136].copy_from_slice(&(8u32 << 16).to_le_bytes());
        assert!(NamespaceIdentity::parse(&n)
            .unwrap_err()
            .contains("LBADS 8"));
        n[0..8].fill(0);
        assert!(NamespaceIdentity::parse(&n).is_err());
    }
}
