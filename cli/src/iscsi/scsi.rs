//! The SCSI direct-access device behind LUN 0: CDB decoding (SBC-4, SPC-5 subset), sense
//! data, and the data-in pages answered without the array (INQUIRY and its VPD pages, MODE
//! SENSE, READ CAPACITY, REPORT LUNS, REPORT SUPPORTED OPERATION CODES, GET LBA STATUS,
//! REQUEST SENSE). Pure: [`decode`] turns a CDB into a [`Plan`] the front-end executes;
//! nothing here does I/O or panics on input.
//!
//! Units: LBAs and transfer lengths in logical blocks (the array's block size); byte
//! counts say so.

use super::xcopy;

/// SCSI status codes (SAM-5 §5.3).
pub mod status {
    /// GOOD.
    pub const GOOD: u8 = 0x00;
    /// CHECK CONDITION.
    pub const CHECK_CONDITION: u8 = 0x02;
    /// CONDITION MET (PRE-FETCH when the range fits the cache).
    pub const CONDITION_MET: u8 = 0x04;
    /// RESERVATION CONFLICT: the command conflicts with a reservation (SPC-4 §5.13).
    pub const RESERVATION_CONFLICT: u8 = 0x18;
    /// TASK SET FULL: no resources for the command now; the initiator retries.
    pub const TASK_SET_FULL: u8 = 0x28;
}

/// Sense key, additional sense code and qualifier (SPC-5 §4.4, table "ASC and ASCQ
/// assignments").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sense {
    /// Sense key.
    pub key: u8,
    /// Additional sense code.
    pub asc: u8,
    /// Additional sense code qualifier.
    pub ascq: u8,
    /// INFORMATION field (e.g. the offset of the first miscompared byte), if valid.
    pub info: Option<u32>,
    /// Which field was invalid, for ILLEGAL REQUEST (the sense-key specific field pointer).
    pub field: Option<FieldPointer>,
}

/// The field-pointer sense-key specific data of ILLEGAL REQUEST (SPC-4 §4.5.2.4.2): where
/// in the CDB (or parameter list) the invalid field is. Some initiators need it to tell
/// "this field is wrong" from "this command is not supported" (libiscsi treats a
/// MAINTENANCE IN answered INVALID FIELD IN CDB without a pointer as unsupported).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldPointer {
    /// In the CDB (C/D = 1), else in the parameter data.
    pub cdb: bool,
    /// Byte offset of the field.
    pub byte: u16,
    /// Bit of that byte where the field ends (its most significant bit), if given.
    pub bit: Option<u8>,
}

impl Sense {
    const fn new(key: u8, asc: u8, ascq: u8) -> Self {
        Self {
            key,
            asc,
            ascq,
            info: None,
            field: None,
        }
    }

    /// INVALID FIELD IN CDB pointing at byte `byte`, bit `bit` of the CDB.
    pub const fn invalid_cdb_field(byte: u16, bit: Option<u8>) -> Sense {
        Sense {
            field: Some(FieldPointer {
                cdb: true,
                byte,
                bit,
            }),
            ..Sense::INVALID_FIELD_CDB
        }
    }
    /// ILLEGAL REQUEST / INVALID COMMAND OPERATION CODE (0x20/0x00).
    pub const INVALID_OPCODE: Sense = Sense::new(0x05, 0x20, 0x00);
    /// ILLEGAL REQUEST / INVALID FIELD IN CDB (0x24/0x00).
    pub const INVALID_FIELD_CDB: Sense = Sense::new(0x05, 0x24, 0x00);
    /// ILLEGAL REQUEST / INVALID FIELD IN PARAMETER LIST (0x26/0x00).
    pub const INVALID_FIELD_PARAM: Sense = Sense::new(0x05, 0x26, 0x00);
    /// ILLEGAL REQUEST / PARAMETER LIST LENGTH ERROR (0x1a/0x00).
    pub const PARAM_LIST_LENGTH: Sense = Sense::new(0x05, 0x1a, 0x00);
    /// ILLEGAL REQUEST / LOGICAL BLOCK ADDRESS OUT OF RANGE (0x21/0x00).
    pub const LBA_OUT_OF_RANGE: Sense = Sense::new(0x05, 0x21, 0x00);
    /// ILLEGAL REQUEST / LOGICAL UNIT NOT SUPPORTED (0x25/0x00).
    pub const LUN_NOT_SUPPORTED: Sense = Sense::new(0x05, 0x25, 0x00);
    /// MISCOMPARE / MISCOMPARE DURING VERIFY OPERATION (0x1d/0x00).
    pub const MISCOMPARE: Sense = Sense::new(0x0e, 0x1d, 0x00);
    /// MEDIUM ERROR / UNRECOVERED READ ERROR (0x11/0x00): data lost beyond the array's
    /// redundancy.
    pub const UNRECOVERED_READ: Sense = Sense::new(0x03, 0x11, 0x00);
    /// MEDIUM ERROR / WRITE ERROR (0x0c/0x00).
    pub const WRITE_ERROR: Sense = Sense::new(0x03, 0x0c, 0x00);
    /// HARDWARE ERROR / INTERNAL TARGET FAILURE (0x44/0x00): the array has failed.
    pub const INTERNAL_FAILURE: Sense = Sense::new(0x04, 0x44, 0x00);
    /// ABORTED COMMAND / COMMAND PHASE ERROR (0x4a/0x00) — e.g. missing Data-Out.
    pub const COMMAND_PHASE: Sense = Sense::new(0x0b, 0x4a, 0x00);
    /// ABORTED COMMAND / DATA PHASE ERROR (0x4b/0x00).
    pub const DATA_PHASE: Sense = Sense::new(0x0b, 0x4b, 0x00);
    /// ABORTED COMMAND / PROTOCOL SERVICE CRC ERROR (0x47/0x05): the iSCSI condition
    /// "protocol service CRC error" (RFC 7143 §11.4.7.2) — a Data-Out PDU of the command
    /// was lost to a data digest error or, implied, to a DataSN gap (§7.8, §7.9).
    pub const PROTOCOL_CRC: Sense = Sense::new(0x0b, 0x47, 0x05);

    /// The fixed-format sense data (SPC-5 §4.4.3), 18 bytes.
    pub fn fixed(&self) -> [u8; 18] {
        let mut s = [0u8; 18];
        s[0] = 0x70;
        s[2] = self.key;
        if let Some(i) = self.info {
            s[0] |= 0x80;
            s[3..7].copy_from_slice(&i.to_be_bytes());
        }
        s[7] = 10;
        s[12] = self.asc;
        s[13] = self.ascq;
        if let Some(f) = self.field {
            // SKSV, C/D, BPV and the bit pointer, then the field pointer.
            s[15] = 0x80 | if f.cdb { 0x40 } else { 0 } | f.bit.map_or(0, |b| 0x08 | (b & 0x07));
            s[16..18].copy_from_slice(&f.byte.to_be_bytes());
        }
        s
    }
}

/// Facts about the logical unit that answers come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LunInfo {
    /// Logical block size, bytes.
    pub block_bytes: u32,
    /// Capacity, logical blocks.
    pub blocks: u64,
    /// Longest READ/WRITE/VERIFY, blocks (the largest request buffer).
    pub max_transfer_blocks: u32,
    /// Optimal transfer length granularity, blocks: one full stripe of data (a write of
    /// whole stripes needs no parity reads).
    pub granularity_blocks: u32,
    /// Optimal transfer length, blocks.
    pub optimal_blocks: u32,
    /// Longest COMPARE AND WRITE, blocks (at most 255: the CDB field is one byte).
    pub max_compare_write_blocks: u8,
    /// Longest WRITE SAME / UNMAP range, blocks.
    pub max_write_same_blocks: u32,
    /// The array UUID (source of the NAA identifier and the unit serial number).
    pub uuid: [u8; 16],
    /// Product identification, at most 16 ASCII characters.
    pub product: String,
    /// The SCSI target name (the iSCSI target IQN).
    pub target_name: String,
}

impl LunInfo {
    /// The unit serial number: the array UUID in hex (32 characters).
    pub fn serial(&self) -> String {
        self.uuid.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The NAA IEEE Registered Extended identifier (NAA 6, SPC-5 §7.7.6.6.5), 16 bytes,
    /// stable for the array: NAA 6, a locally administered company ID, then 100 bits of
    /// the array UUID.
    pub fn naa(&self) -> [u8; 16] {
        let mut n = [0u8; 16];
        // NAA=6 | IEEE company ID 0x000000 would claim a real OUI; use the locally
        // administered range x2-xxxx (bit 1 of the first octet set): 0x02_0000.
        n[0] = 0x60;
        n[1] = 0x20;
        n[2] = 0x00;
        n[3] = self.uuid[0] & 0x0f;
        n[4..16].copy_from_slice(&self.uuid[1..13]);
        n
    }
}

/// What a command needs done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Answer at once: GOOD with the first `len` bytes of the data the decoder wrote (the
    /// allocation length already applied).
    Data {
        /// Bytes of data-in.
        len: u32,
    },
    /// GOOD, no data.
    Good,
    /// PRE-FETCH of a range that fits: CONDITION MET.
    ConditionMet,
    /// CHECK CONDITION.
    Check(Sense),
    /// Read `blocks` at `lba` into the data-in buffer.
    Read {
        /// First block.
        lba: u64,
        /// Blocks.
        blocks: u32,
    },
    /// Write `blocks` at `lba` from the data-out buffer.
    Write {
        /// First block.
        lba: u64,
        /// Blocks.
        blocks: u32,
        /// FUA (or a WRITE AND VERIFY, which must be on the medium before GOOD).
        fua: bool,
    },
    /// Flush every member (SYNCHRONIZE CACHE).
    Flush,
    /// VERIFY: read the range; with `bytchk` 1 compare it with `blocks` blocks of data-out,
    /// with 3 compare every block with one block of data-out.
    Verify {
        /// First block.
        lba: u64,
        /// Blocks.
        blocks: u32,
        /// BYTCHK field (0, 1 or 3).
        bytchk: u8,
    },
    /// WRITE SAME: one block of data-out (none with NDOB) written to every block of the
    /// range; `unmap` allows deallocation (done as zeroes when the data is zero).
    WriteSame {
        /// First block.
        lba: u64,
        /// Blocks.
        blocks: u32,
        /// UNMAP bit.
        unmap: bool,
        /// NDOB (no data-out buffer: zeroes).
        ndob: bool,
    },
    /// UNMAP with a parameter list of `param_bytes`.
    Unmap {
        /// Parameter list length, bytes.
        param_bytes: u32,
    },
    /// COMPARE AND WRITE: `blocks` of verify data then `blocks` of write data.
    CompareAndWrite {
        /// First block.
        lba: u64,
        /// Blocks.
        blocks: u32,
        /// FUA.
        fua: bool,
    },
    /// RESERVATION CONFLICT status (the front end's reservation check, [`super::pr`]).
    Conflict,
    /// PERSISTENT RESERVE IN (SPC-4 §6.15), answered from the reservation state.
    PrIn {
        /// Allocation length, bytes.
        alloc: u32,
        /// Service action (0..=3).
        sa: u8,
    },
    /// PERSISTENT RESERVE OUT (SPC-4 §6.16) with `param_bytes` of parameter data.
    PrOut {
        /// Parameter list length, bytes (24: checked by the decoder).
        param_bytes: u32,
        /// Service action (0..=6).
        sa: u8,
        /// CDB byte 2: SCOPE (high nibble) and TYPE (low nibble).
        scope_type: u8,
    },
    /// RESERVE(6) (SPC-2 §7.21).
    Reserve6,
    /// RELEASE(6) (SPC-2 §7.22).
    Release6,
    /// ORWRITE(16) (SBC-4 §5.9): the range becomes its old contents OR `blocks` blocks
    /// of data-out, read-OR-write as one uninterrupted series per stripe.
    OrWrite {
        /// First block.
        lba: u64,
        /// Blocks.
        blocks: u32,
        /// FUA.
        fua: bool,
    },
    /// EXTENDED COPY(LID1) with a parameter list of `param_bytes` (SPC-4 §6.4): the copy
    /// runs in read/write steps through the task buffer ([`super::xcopy`]).
    ExtendedCopy {
        /// Parameter list length, bytes.
        param_bytes: u32,
    },
    /// RECEIVE COPY RESULTS, COPY STATUS of the copy `list_id` of this I_T nexus (SPC-4
    /// §6.18.3), answered from the front-end's state.
    CopyStatus {
        /// LIST IDENTIFIER.
        list_id: u8,
        /// Allocation length, bytes.
        alloc: u32,
    },
    /// MODE SELECT with `param_bytes` of parameter data.
    ModeSelect {
        /// Parameter list length, bytes.
        param_bytes: u32,
        /// MODE SELECT(10) (8-byte header) rather than (6).
        ten: bool,
    },
}

impl Plan {
    /// Data-out bytes the command needs from the initiator.
    pub fn data_out_bytes(&self, block_bytes: u32) -> u64 {
        let b = u64::from(block_bytes);
        match *self {
            Plan::Write { blocks, .. } | Plan::OrWrite { blocks, .. } => u64::from(blocks) * b,
            Plan::Verify { blocks, bytchk, .. } => match bytchk {
                1 => u64::from(blocks) * b,
                3 => b,
                _ => 0,
            },
            Plan::WriteSame { ndob, .. } => {
                if ndob {
                    0
                } else {
                    b
                }
            }
            Plan::Unmap { param_bytes }
            | Plan::ModeSelect { param_bytes, .. }
            | Plan::PrOut { param_bytes, .. } => u64::from(param_bytes),
            Plan::CompareAndWrite { blocks, .. } => 2 * u64::from(blocks) * b,
            Plan::ExtendedCopy { param_bytes } => u64::from(param_bytes),
            _ => 0,
        }
    }
}

/// Operation codes (SBC-4 / SPC-5).
pub mod opc {
    #![allow(missing_docs)]
    pub const TEST_UNIT_READY: u8 = 0x00;
    pub const REQUEST_SENSE: u8 = 0x03;
    pub const READ_6: u8 = 0x08;
    pub const WRITE_6: u8 = 0x0a;
    pub const INQUIRY: u8 = 0x12;
    pub const MODE_SELECT_6: u8 = 0x15;
    pub const RESERVE_6: u8 = 0x16;
    pub const RELEASE_6: u8 = 0x17;
    pub const MODE_SENSE_6: u8 = 0x1a;
    pub const START_STOP_UNIT: u8 = 0x1b;
    pub const PREVENT_ALLOW: u8 = 0x1e;
    pub const READ_CAPACITY_10: u8 = 0x25;
    pub const READ_DEFECT_DATA_10: u8 = 0x37;
    pub const READ_DEFECT_DATA_12: u8 = 0xb7;
    pub const READ_10: u8 = 0x28;
    pub const WRITE_10: u8 = 0x2a;
    pub const WRITE_VERIFY_10: u8 = 0x2e;
    pub const VERIFY_10: u8 = 0x2f;
    pub const PREFETCH_10: u8 = 0x34;
    pub const SYNC_CACHE_10: u8 = 0x35;
    pub const WRITE_SAME_10: u8 = 0x41;
    pub const UNMAP: u8 = 0x42;
    pub const MODE_SELECT_10: u8 = 0x55;
    pub const MODE_SENSE_10: u8 = 0x5a;
    pub const PERSISTENT_RESERVE_IN: u8 = 0x5e;
    pub const PERSISTENT_RESERVE_OUT: u8 = 0x5f;
    pub const READ_16: u8 = 0x88;
    pub const COMPARE_AND_WRITE: u8 = 0x89;
    pub const WRITE_16: u8 = 0x8a;
    pub const ORWRITE_16: u8 = 0x8b;
    pub const WRITE_VERIFY_16: u8 = 0x8e;
    pub const VERIFY_16: u8 = 0x8f;
    pub const PREFETCH_16: u8 = 0x90;
    pub const SYNC_CACHE_16: u8 = 0x91;
    pub const WRITE_SAME_16: u8 = 0x93;
    pub const SERVICE_ACTION_IN_16: u8 = 0x9e;
    pub const REPORT_LUNS: u8 = 0xa0;
    pub const MAINTENANCE_IN: u8 = 0xa3;
    pub const READ_12: u8 = 0xa8;
    pub const WRITE_12: u8 = 0xaa;
    pub const WRITE_VERIFY_12: u8 = 0xae;
    pub const VERIFY_12: u8 = 0xaf;
    /// SERVICE ACTION IN(16) service actions.
    pub const SAI_READ_CAPACITY_16: u8 = 0x10;
    pub const SAI_GET_LBA_STATUS: u8 = 0x12;
    /// MAINTENANCE IN service action.
    pub const MI_REPORT_SUPPORTED_OPCODES: u8 = 0x0c;
}

/// Every command this LUN implements: (opcode, service action or `None`, CDB length,
/// CDB usage bitmap after the opcode byte — SPC-5 §6.35.3 "CDB USAGE DATA").
const SUPPORTED: &[(u8, Option<u8>, &[u8])] = &[
    (opc::TEST_UNIT_READY, None, &[0x00, 0x00, 0x00, 0x00, 0x07]),
    (opc::REQUEST_SENSE, None, &[0x01, 0x00, 0x00, 0xff, 0x07]),
    (opc::READ_6, None, &[0x1f, 0xff, 0xff, 0xff, 0x07]),
    (opc::WRITE_6, None, &[0x1f, 0xff, 0xff, 0xff, 0x07]),
    (opc::INQUIRY, None, &[0x01, 0xff, 0xff, 0xff, 0x07]),
    (opc::MODE_SELECT_6, None, &[0x11, 0x00, 0x00, 0xff, 0x07]),
    (opc::RESERVE_6, None, &[0x00, 0x00, 0x00, 0x00, 0x07]),
    (opc::RELEASE_6, None, &[0x00, 0x00, 0x00, 0x00, 0x07]),
    (opc::MODE_SENSE_6, None, &[0x08, 0xff, 0xff, 0xff, 0x07]),
    (opc::START_STOP_UNIT, None, &[0x01, 0x00, 0x0f, 0xf7, 0x07]),
    (opc::PREVENT_ALLOW, None, &[0x00, 0x00, 0x00, 0x03, 0x07]),
    (
        opc::READ_CAPACITY_10,
        None,
        &[0x00, 0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x01, 0x07],
    ),
    (
        opc::READ_10,
        None,
        &[0xf8, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    ),
    (
        opc::WRITE_10,
        None,
        &[0xf8, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    ),
    (
        opc::WRITE_VERIFY_10,
        None,
        &[0xf6, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    ),
    (
        opc::VERIFY_10,
        None,
        &[0xf6, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    ),
    (
        opc::PREFETCH_10,
        None,
        &[0x02, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    ),
    (
        opc::SYNC_CACHE_10,
        None,
        &[0x06, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    ),
    (
        opc::WRITE_SAME_10,
        None,
        &[0xf8, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0x07],
    ),
    (
        opc::READ_DEFECT_DATA_10,
        None,
        &[0x00, 0x1f, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0x07],
    ),
    (
        opc::READ_DEFECT_DATA_12,
        None,
        &[
            0x1f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x07,
        ],
    ),
    (
        opc::UNMAP,
        None,
        &[0x01, 0x00, 0x00, 0x00, 0x00, 0x1f, 0xff, 0xff, 0x07],
    ),
    (
        opc::MODE_SELECT_10,
        None,
        &[0x11, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0x07],
    ),
    (
        opc::MODE_SENSE_10,
        None,
        &[0x18, 0xff, 0xff, 0x00, 0x00, 0x00, 0xff, 0xff, 0x07],
    ),
    (
        opc::PERSISTENT_RESERVE_IN,
        Some(0),
        &[0x1f, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0x07],
    ),
    (
        opc::PERSISTENT_RESERVE_IN,
        Some(1),
        &[0x1f, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0x07],
    ),
    (
        opc::PERSISTENT_RESERVE_IN,
        Some(2),
        &[0x1f, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0x07],
    ),
    (
        opc::PERSISTENT_RESERVE_IN,
        Some(3),
        &[0x1f, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0x07],
    ),
    (
        opc::PERSISTENT_RESERVE_OUT,
        Some(0),
        &[0x1f, 0xff, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x07],
    ),
    (
        opc::PERSISTENT_RESERVE_OUT,
        Some(1),
        &[0x1f, 0xff, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x07],
    ),
    (
        opc::PERSISTENT_RESERVE_OUT,
        Some(2),
        &[0x1f, 0xff, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x07],
    ),
    (
        opc::PERSISTENT_RESERVE_OUT,
        Some(3),
        &[0x1f, 0xff, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x07],
    ),
    (
        opc::PERSISTENT_RESERVE_OUT,
        Some(4),
        &[0x1f, 0xff, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x07],
    ),
    (
        opc::PERSISTENT_RESERVE_OUT,
        Some(5),
        &[0x1f, 0xff, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x07],
    ),
    (
        opc::PERSISTENT_RESERVE_OUT,
        Some(6),
        &[0x1f, 0xff, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x07],
    ),
    (
        opc::READ_16,
        None,
        &[
            0xf8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f,
            0x07,
        ],
    ),
    (
        opc::COMPARE_AND_WRITE,
        None,
        &[
            0xf8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0xff, 0x1f,
            0x07,
        ],
    ),
    (
        opc::ORWRITE_16,
        None,
        &[
            0xf8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f,
            0x07,
        ],
    ),
    (
        opc::WRITE_16,
        None,
        &[
            0xf8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f,
            0x07,
        ],
    ),
    (
        opc::WRITE_VERIFY_16,
        None,
        &[
            0xf6, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f,
            0x07,
        ],
    ),
    (
        opc::VERIFY_16,
        None,
        &[
            0xf6, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f,
            0x07,
        ],
    ),
    (
        opc::PREFETCH_16,
        None,
        &[
            0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f,
            0x07,
        ],
    ),
    (
        opc::SYNC_CACHE_16,
        None,
        &[
            0x06, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f,
            0x07,
        ],
    ),
    (
        opc::WRITE_SAME_16,
        None,
        &[
            0xf9, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f,
            0x07,
        ],
    ),
    (
        opc::SERVICE_ACTION_IN_16,
        Some(opc::SAI_READ_CAPACITY_16),
        &[
            0x1f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x00,
            0x07,
        ],
    ),
    (
        opc::SERVICE_ACTION_IN_16,
        Some(opc::SAI_GET_LBA_STATUS),
        &[
            0x1f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00,
            0x07,
        ],
    ),
    (
        opc::REPORT_LUNS,
        None,
        &[
            0x00, 0xff, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x00, 0x07,
        ],
    ),
    (
        opc::MAINTENANCE_IN,
        Some(opc::MI_REPORT_SUPPORTED_OPCODES),
        &[
            0x1f, 0x87, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x07,
        ],
    ),
    (
        xcopy::OPC_EXTENDED_COPY,
        Some(xcopy::SA_LID1),
        &[
            0x1f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x00,
            0x07,
        ],
    ),
    (
        xcopy::OPC_RECEIVE_COPY_RESULTS,
        Some(xcopy::SA_COPY_STATUS),
        &[
            0x1f, 0xff, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x00,
            0x07,
        ],
    ),
    (
        xcopy::OPC_RECEIVE_COPY_RESULTS,
        Some(xcopy::SA_OPERATING_PARAMETERS),
        &[
            0x1f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x00,
            0x07,
        ],
    ),
    (
        opc::READ_12,
        None,
        &[
            0xf8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x80, 0x07,
        ],
    ),
    (
        opc::WRITE_12,
        None,
        &[
            0xf8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x80, 0x07,
        ],
    ),
    (
        opc::WRITE_VERIFY_12,
        None,
        &[
            0xf6, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x80, 0x07,
        ],
    ),
    (
        opc::VERIFY_12,
        None,
        &[
            0xf6, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x80, 0x07,
        ],
    ),
];

/// Most bytes any data-in page of [`decode`] writes (REPORT SUPPORTED OPERATION CODES
/// with timeouts for every command is the largest).
pub const MAX_PAGE_BYTES: usize = 4 + SUPPORTED.len() * 20 + 64;

fn be16(b: &[u8]) -> u32 {
    u32::from(u16::from_be_bytes([b[0], b[1]]))
}
fn be24(b: &[u8]) -> u32 {
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

/// Range and size checks of a block command: LBA OUT OF RANGE past the end (SBC-4 §4.5),
/// INVALID FIELD IN CDB beyond the longest transfer.
/// The blocks a WRITE SAME with NUMBER OF LOGICAL BLOCKS 0 covers: from `lba` to the
/// last logical block (SBC-4 §5.42 WRITE SAME(10), §5.44 WRITE SAME(16)).
///
/// # Errors
/// LOGICAL BLOCK ADDRESS OUT OF RANGE past the capacity; INVALID FIELD IN CDB when the
/// range exceeds MAXIMUM WRITE SAME LENGTH.
fn write_same_to_end(lun: &LunInfo, lba: u64) -> Result<u32, Sense> {
    if lba > lun.blocks {
        return Err(Sense::LBA_OUT_OF_RANGE);
    }
    let n = lun.blocks - lba;
    if n > u64::from(lun.max_write_same_blocks) {
        return Err(Sense::INVALID_FIELD_CDB);
    }
    Ok(n as u32)
}

fn range(lun: &LunInfo, lba: u64, blocks: u32, max: u32) -> Result<(), Sense> {
    if lba > lun.blocks || u64::from(blocks) > lun.blocks - lba {
        return Err(Sense::LBA_OUT_OF_RANGE);
    }
    if blocks > max {
        return Err(Sense::INVALID_FIELD_CDB);
    }
    Ok(())
}

/// Decodes `cdb` for `lun`, writing any immediate data-in into `out` (at least
/// [`MAX_PAGE_BYTES`] bytes). Allocation lengths are applied: [`Plan::Data`] gives the bytes
/// to send.
pub fn decode(cdb: &[u8; 16], lun: &LunInfo, out: &mut [u8]) -> Plan {
    match decode_inner(cdb, lun, out) {
        Ok(p) => p,
        Err(s) => Plan::Check(s),
    }
}

fn decode_inner(c: &[u8; 16], lun: &LunInfo, out: &mut [u8]) -> Result<Plan, Sense> {
    let max = lun.max_transfer_blocks;
    let rw = |lba: u64, blocks: u32, prot: u8, write: bool, fua: bool| -> Result<Plan, Sense> {
        if prot != 0 {
            // No protection information (INQUIRY PROTECT=0): SBC-4 §5.x "If the
            // PROTECT bit is zero and RDPROTECT/WRPROTECT is nonzero: INVALID FIELD IN CDB".
            return Err(Sense::INVALID_FIELD_CDB);
        }
        range(lun, lba, blocks, max)?;
        if blocks == 0 {
            return Ok(Plan::Good);
        }
        Ok(if write {
            Plan::Write { lba, blocks, fua }
        } else {
            Plan::Read { lba, blocks }
        })
    };
    match c[0] {
        opc::TEST_UNIT_READY => Ok(Plan::Good),
        opc::REQUEST_SENSE => {
            let alloc = u32::from(c[4]);
            let n = if c[1] & 1 != 0 {
                // Descriptor format, NO SENSE: header only.
                out[..8].fill(0);
                out[0] = 0x72;
                8
            } else {
                let mut s = Sense::new(0, 0, 0).fixed();
                s[0] = 0x70;
                out[..18].copy_from_slice(&s);
                18
            };
            Ok(Plan::Data { len: alloc.min(n) })
        }
        opc::READ_6 | opc::WRITE_6 => {
            let lba = u64::from(be24(&c[1..4]) & 0x1f_ffff);
            let blocks = if c[4] == 0 { 256 } else { u32::from(c[4]) };
            rw(lba, blocks, 0, c[0] == opc::WRITE_6, false)
        }
        opc::READ_10 | opc::WRITE_10 => rw(
            u64::from(be32(&c[2..6])),
            be16(&c[7..9]),
            c[1] >> 5,
            c[0] == opc::WRITE_10,
            c[1] & 0x08 != 0,
        ),
        opc::READ_12 | opc::WRITE_12 => rw(
            u64::from(be32(&c[2..6])),
            be32(&c[6..10]),
            c[1] >> 5,
            c[0] == opc::WRITE_12,
            c[1] & 0x08 != 0,
        ),
        opc::READ_16 | opc::WRITE_16 => rw(
            be64(&c[2..10]),
            be32(&c[10..14]),
            c[1] >> 5,
            c[0] == opc::WRITE_16,
            c[1] & 0x08 != 0,
        ),
        opc::WRITE_VERIFY_10 | opc::WRITE_VERIFY_12 | opc::WRITE_VERIFY_16 => {
            let (lba, blocks) = match c[0] {
                opc::WRITE_VERIFY_10 => (u64::from(be32(&c[2..6])), be16(&c[7..9])),
                opc::WRITE_VERIFY_12 => (u64::from(be32(&c[2..6])), be32(&c[6..10])),
                _ => (be64(&c[2..10]), be32(&c[10..14])),
            };
            // BYTCHK 2 is reserved... only 0 and 1 are defined for WRITE AND VERIFY.
            if (c[1] >> 1) & 3 > 1 {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            // The verify is the write reaching the medium: FUA.
            rw(lba, blocks, c[1] >> 5, true, true)
        }
        opc::VERIFY_10 | opc::VERIFY_12 | opc::VERIFY_16 => {
            let (lba, blocks) = match c[0] {
                opc::VERIFY_10 => (u64::from(be32(&c[2..6])), be16(&c[7..9])),
                opc::VERIFY_12 => (u64::from(be32(&c[2..6])), be32(&c[6..10])),
                _ => (be64(&c[2..10]), be32(&c[10..14])),
            };
            let bytchk = (c[1] >> 1) & 3;
            if c[1] >> 5 != 0 || bytchk == 2 {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            range(lun, lba, blocks, max)?;
            if blocks == 0 {
                return Ok(Plan::Good);
            }
            Ok(Plan::Verify {
                lba,
                blocks,
                bytchk,
            })
        }
        opc::PREFETCH_10 | opc::PREFETCH_16 => {
            let (lba, blocks) = if c[0] == opc::PREFETCH_10 {
                (u64::from(be32(&c[2..6])), be16(&c[7..9]))
            } else {
                (be64(&c[2..10]), be32(&c[10..14]))
            };
            range(lun, lba, blocks, u32::MAX)?;
            // No cache of our own to load: nothing to do (SBC-4 §5.9: GOOD when the
            // range will not fit the cache — it never does).
            Ok(Plan::Good)
        }
        opc::SYNC_CACHE_10 | opc::SYNC_CACHE_16 => {
            let (lba, blocks) = if c[0] == opc::SYNC_CACHE_10 {
                (u64::from(be32(&c[2..6])), be16(&c[7..9]))
            } else {
                (be64(&c[2..10]), be32(&c[10..14]))
            };
            range(lun, lba, blocks, u32::MAX)?;
            Ok(Plan::Flush)
        }
        opc::WRITE_SAME_10 | opc::WRITE_SAME_16 => {
            let (lba, blocks) = if c[0] == opc::WRITE_SAME_10 {
                (u64::from(be32(&c[2..6])), be16(&c[7..9]))
            } else {
                (be64(&c[2..10]), be32(&c[10..14]))
            };
            let ndob = c[0] == opc::WRITE_SAME_16 && c[1] & 0x01 != 0;
            let unmap = c[1] & 0x08 != 0;
            let anchor = c[1] & 0x10 != 0;
            if c[1] >> 5 != 0 || anchor || (ndob && !unmap) {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            // WSNZ=0 in the Block Limits page: zero blocks means every block from the LBA
            // to the last (SBC-4 §5.42/§5.44), within MAXIMUM WRITE SAME LENGTH.
            let blocks = match blocks {
                0 => match write_same_to_end(lun, lba)? {
                    0 => return Ok(Plan::Good),
                    n => n,
                },
                n => n,
            };
            range(lun, lba, blocks, lun.max_write_same_blocks)?;
            Ok(Plan::WriteSame {
                lba,
                blocks,
                unmap,
                ndob,
            })
        }
        opc::UNMAP => {
            if c[1] & 0x01 != 0 {
                // ANCHOR: anchored state not supported (ANC_SUP = 0).
                return Err(Sense::INVALID_FIELD_CDB);
            }
            let n = be16(&c[7..9]);
            if n == 0 {
                return Ok(Plan::Good);
            }
            if n < 8 {
                return Err(Sense::PARAM_LIST_LENGTH);
            }
            Ok(Plan::Unmap { param_bytes: n })
        }
        opc::COMPARE_AND_WRITE => {
            let lba = be64(&c[2..10]);
            let blocks = u32::from(c[13]);
            if c[1] >> 5 != 0 {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            if blocks > u32::from(lun.max_compare_write_blocks) {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            range(lun, lba, blocks, max / 2)?;
            if blocks == 0 {
                return Ok(Plan::Good);
            }
            Ok(Plan::CompareAndWrite {
                lba,
                blocks,
                fua: c[1] & 0x08 != 0,
            })
        }
        opc::PERSISTENT_RESERVE_IN => {
            // READ KEYS, READ RESERVATION, REPORT CAPABILITIES, READ FULL STATUS.
            if c[1] & 0x1f > 3 {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            Ok(Plan::PrIn {
                alloc: be16(&c[7..9]),
                sa: c[1] & 0x1f,
            })
        }
        opc::PERSISTENT_RESERVE_OUT => Ok(Plan::PrOut {
            param_bytes: super::pr::PrState::pr_out_param_bytes(c)?,
            sa: c[1] & 0x1f,
            scope_type: c[2],
        }),
        opc::RESERVE_6 | opc::RELEASE_6 => {
            // The third-party and extent forms (SPC-2 §7.21) are obsolete: refused.
            if c[1] & 0x13 != 0 {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            Ok(if c[0] == opc::RESERVE_6 {
                Plan::Reserve6
            } else {
                Plan::Release6
            })
        }
        opc::ORWRITE_16 => {
            let (lba, blocks) = (be64(&c[2..10]), be32(&c[10..14]));
            // ORPROTECT ≠ 0 without protection information, as RDPROTECT/WRPROTECT.
            if c[1] >> 5 != 0 {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            range(lun, lba, blocks, max)?;
            if blocks == 0 {
                return Ok(Plan::Good);
            }
            Ok(Plan::OrWrite {
                lba,
                blocks,
                fua: c[1] & 0x08 != 0,
            })
        }
        opc::INQUIRY => inquiry(c, lun, out),
        opc::MODE_SENSE_6 | opc::MODE_SENSE_10 => mode_sense(c, lun, out),
        opc::MODE_SELECT_6 | opc::MODE_SELECT_10 => {
            let ten = c[0] == opc::MODE_SELECT_10;
            let n = if ten { be16(&c[7..9]) } else { u32::from(c[4]) };
            // PF must be 1 (SPC-5 §6.12: vendor-specific pages otherwise); SP 0 (no saved
            // pages).
            if c[1] & 0x10 == 0 || c[1] & 0x01 != 0 {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            if n == 0 {
                return Ok(Plan::Good);
            }
            Ok(Plan::ModeSelect {
                param_bytes: n,
                ten,
            })
        }
        opc::START_STOP_UNIT => {
            // Not removable, no power conditions of its own: accept and do nothing; an
            // eject (LOEJ with START=0) of a non-removable medium is refused.
            if c[4] & 0x02 != 0 && c[4] & 0x01 == 0 && c[4] >> 4 == 0 {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            Ok(Plan::Good)
        }
        opc::PREVENT_ALLOW => {
            // RMB=0: nothing to lock; SBC-4 allows PREVENT on any medium.
            Ok(Plan::Good)
        }
        opc::READ_CAPACITY_10 => {
            if c[8] & 1 == 0 && be32(&c[2..6]) != 0 {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            let last = lun.blocks.saturating_sub(1);
            out[..4].copy_from_slice(&u32::try_from(last).unwrap_or(u32::MAX).to_be_bytes());
            out[4..8].copy_from_slice(&lun.block_bytes.to_be_bytes());
            Ok(Plan::Data { len: 8 })
        }
        opc::SERVICE_ACTION_IN_16 => match c[1] & 0x1f {
            opc::SAI_READ_CAPACITY_16 => {
                let alloc = be32(&c[10..14]);
                out[..32].fill(0);
                out[..8].copy_from_slice(&lun.blocks.saturating_sub(1).to_be_bytes());
                out[8..12].copy_from_slice(&lun.block_bytes.to_be_bytes());
                // LBPME (UNMAP/WRITE SAME unmap supported) and LBPRZ (deallocated blocks
                // read zeroes: unmapping writes zeroes).
                out[14] = 0x80 | 0x40;
                Ok(Plan::Data { len: alloc.min(32) })
            }
            opc::SAI_GET_LBA_STATUS => {
                let lba = be64(&c[2..10]);
                let alloc = be32(&c[10..14]);
                if lba >= lun.blocks {
                    return Err(Sense::LBA_OUT_OF_RANGE);
                }
                // Every block is mapped: unmapped ranges are written as zeroes (LBPRZ), so
                // a resource-provisioned LUN reports them mapped (SBC-4 §4.7.4.3).
                out[..24].fill(0);
                out[..4].copy_from_slice(&20u32.to_be_bytes());
                out[8..16].copy_from_slice(&lba.to_be_bytes());
                let n = u32::try_from(lun.blocks - lba).unwrap_or(u32::MAX);
                out[16..20].copy_from_slice(&n.to_be_bytes());
                Ok(Plan::Data { len: alloc.min(24) })
            }
            _ => Err(Sense::INVALID_FIELD_CDB),
        },
        opc::READ_DEFECT_DATA_10 | opc::READ_DEFECT_DATA_12 => read_defect_data(c, out),
        opc::REPORT_LUNS => {
            let alloc = be32(&c[6..10]);
            if alloc < 16 {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            if !matches!(c[2], 0x00..=0x02 | 0x10..=0x12) {
                return Err(Sense::INVALID_FIELD_CDB);
            }
            out[..16].fill(0);
            // Select 0x01 (well-known LUNs only) lists none.
            let n: u32 = if c[2] == 0x01 || c[2] == 0x11 { 0 } else { 8 };
            out[..4].copy_from_slice(&n.to_be_bytes());
            Ok(Plan::Data {
                len: alloc.min(8 + n),
            })
        }
        opc::MAINTENANCE_IN if c[1] & 0x1f == opc::MI_REPORT_SUPPORTED_OPCODES => {
            report_opcodes(c, out)
        }
        xcopy::OPC_EXTENDED_COPY => xcopy::decode_extended_copy(c),
        xcopy::OPC_RECEIVE_COPY_RESULTS => xcopy::decode_receive_copy_results(c, lun, out),
        _ => Err(Sense::INVALID_OPCODE),
    }
}

fn inquiry(c: &[u8; 16], lun: &LunInfo, out: &mut [u8]) -> Result<Plan, Sense> {
    let evpd = c[1] & 0x01 != 0;
    let alloc = be16(&c[3..5]);
    if c[1] & 0x02 != 0 || (!evpd && c[2] != 0) {
        return Err(Sense::INVALID_FIELD_CDB);
    }
    let n = if !evpd {
        let d = &mut out[..96];
        d.fill(0);
        d[0] = 0x00; // connected, direct-access block device
        d[2] = 0x06; // SPC-4
        d[3] = 0x12; // HISUP, response data format 2
        d[4] = 96 - 5;
        d[5] = 0x08; // 3PC: a copy manager (EXTENDED COPY, SPC-4 §6.6.2)
        d[7] = 0x02; // CMDQUE
        pad_ascii(&mut d[8..16], "FERRORAI");
        pad_ascii(&mut d[16..32], &lun.product);
        pad_ascii(&mut d[32..36], "0001");
        // Version descriptors (SPC-5 table "Version descriptor values"): SAM-5, iSCSI
        // (no version claimed), SPC-4, SBC-3.
        for (i, v) in [0x00a0u16, 0x0960, 0x0460, 0x04c0].iter().enumerate() {
            d[58 + 2 * i..60 + 2 * i].copy_from_slice(&v.to_be_bytes());
        }
        96
    } else {
        let page = c[2];
        out[..4].fill(0);
        out[1] = page;
        let body = &mut out[4..];
        let len = match page {
            0x00 => {
                let pages = [0x00, 0x80, 0x83, 0x8f, 0xb0, 0xb1, 0xb2];
                body[..pages.len()].copy_from_slice(&pages);
                pages.len()
            }
            0x80 => {
                let s = lun.serial();
                body[..s.len()].copy_from_slice(s.as_bytes());
                s.len()
            }
            0x83 => device_identification(lun, body),
            0x8f => xcopy::third_party_copy_vpd(body),
            0xb0 => {
                let b = &mut body[..0x3c];
                b.fill(0);
                // WSNZ=0: WRITE SAME with zero blocks writes to the last block.
                b[0] = 0x00;
                b[1] = lun.max_compare_write_blocks;
                b[2..4].copy_from_slice(
                    &u16::try_from(lun.granularity_blocks)
                        .unwrap_or(0)
                        .to_be_bytes(),
                );
                b[4..8].copy_from_slice(&lun.max_transfer_blocks.to_be_bytes());
                b[8..12].copy_from_slice(&lun.optimal_blocks.to_be_bytes());
                b[12..16].copy_from_slice(&lun.max_transfer_blocks.to_be_bytes());
                // MAXIMUM UNMAP LBA COUNT, MAXIMUM UNMAP BLOCK DESCRIPTOR COUNT.
                b[16..20].copy_from_slice(&lun.max_write_same_blocks.to_be_bytes());
                b[20..24].copy_from_slice(&MAX_UNMAP_DESCRIPTORS.to_be_bytes());
                // OPTIMAL UNMAP GRANULARITY: one full stripe.
                b[24..28].copy_from_slice(&lun.granularity_blocks.to_be_bytes());
                b[32..40].copy_from_slice(&u64::from(lun.max_write_same_blocks).to_be_bytes());
                0x3c
            }
            0xb1 => {
                let b = &mut body[..0x3c];
                b.fill(0);
                b[1] = 0x01; // non-rotating medium
                0x3c
            }
            0xb2 => {
                let b = &mut body[..4];
                b.fill(0);
                // LBPU, LBPWS, LBPWS10; LBPRZ = 001b (bits 4:2); provisioning type 1
                // (resource provisioned).
                b[1] = 0x80 | 0x40 | 0x20 | (0x1 << 2);
                b[2] = 0x01;
                4
            }
            _ => return Err(Sense::INVALID_FIELD_CDB),
        };
        out[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        4 + len
    };
    Ok(Plan::Data {
        len: alloc.min(n as u32),
    })
}

/// Most block descriptors one UNMAP may carry (Block Limits page).
pub const MAX_UNMAP_DESCRIPTORS: u32 = 256;

fn device_identification(lun: &LunInfo, body: &mut [u8]) -> usize {
    let mut at = 0;
    let mut put = |code_set: u8, piv_assoc_type: u8, id: &[u8]| {
        body[at] = code_set;
        body[at + 1] = piv_assoc_type;
        body[at + 2] = 0;
        body[at + 3] = id.len() as u8;
        body[at + 4..at + 4 + id.len()].copy_from_slice(id);
        at += 4 + id.len();
    };
    // NAA (type 3), binary, associated with the logical unit.
    put(0x01, 0x03, &lun.naa());
    // T10 vendor ID based (type 1), ASCII: vendor + serial.
    let t10 = format!("FERRORAI{}", lun.serial());
    put(0x02, 0x01, t10.as_bytes());
    // Relative target port (type 4), PIV=1, association target port (1), iSCSI (5).
    put(0x51, 0x80 | 0x10 | 0x04, &[0, 0, 0, 1]);
    // Target port group (type 5).
    put(0x51, 0x80 | 0x10 | 0x05, &[0, 0, 0, 1]);
    // SCSI name string (type 8), UTF-8, associated with the target device (2): the IQN,
    // NUL-terminated and padded to a multiple of 4 (SPC-5 §7.7.6.11).
    let mut name = lun.target_name.as_bytes().to_vec();
    name.push(0);
    name.resize(name.len().div_ceil(4) * 4, 0);
    if name.len() <= 252 {
        put(0x53, 0x80 | 0x20 | 0x08, &name);
    }
    at
}

fn pad_ascii(dst: &mut [u8], s: &str) {
    dst.fill(b' ');
    let n = s.len().min(dst.len());
    dst[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// The caching mode page (SBC-4 §6.5.5), 20 bytes: WCE=1 (members may cache writes;
/// SYNCHRONIZE CACHE flushes them), changeable: nothing.
fn caching_page(pc: u8, out: &mut [u8]) -> usize {
    let p = &mut out[..20];
    p.fill(0);
    p[0] = 0x08;
    p[1] = 0x12;
    if pc != 1 {
        p[2] = 0x04;
    }
    20
}

/// The control mode page (SPC-5 §7.5.8), 12 bytes: unrestricted reordering, fixed sense
/// format, no software write protect; changeable: nothing.
fn control_page(pc: u8, out: &mut [u8]) -> usize {
    let p = &mut out[..12];
    p.fill(0);
    p[0] = 0x0a;
    p[1] = 0x0a;
    if pc != 1 {
        p[3] = 0x10; // queue algorithm modifier 1: unrestricted reordering
        p[8..10].copy_from_slice(&0xffffu16.to_be_bytes()); // busy timeout: unlimited
    }
    12
}

fn mode_sense(c: &[u8; 16], lun: &LunInfo, out: &mut [u8]) -> Result<Plan, Sense> {
    let ten = c[0] == opc::MODE_SENSE_10;
    let dbd = c[1] & 0x08 != 0;
    let pc = c[2] >> 6;
    let page = c[2] & 0x3f;
    let sub = c[3];
    let alloc = if ten { be16(&c[7..9]) } else { u32::from(c[4]) };
    if pc == 3 {
        // Saved values are not supported (SPC-5 §6.13: SAVING PARAMETERS NOT SUPPORTED).
        return Err(Sense::new(0x05, 0x39, 0x00));
    }
    if sub != 0 && sub != 0xff {
        return Err(Sense::INVALID_FIELD_CDB);
    }
    let hdr = if ten { 8 } else { 4 };
    let bd = if dbd { 0 } else { 8 };
    let mut at = hdr + bd;
    match page {
        0x08 => at += caching_page(pc, &mut out[at..]),
        0x0a => at += control_page(pc, &mut out[at..]),
        0x3f => {
            at += caching_page(pc, &mut out[at..]);
            at += control_page(pc, &mut out[at..]);
        }
        _ => return Err(Sense::INVALID_FIELD_CDB),
    }
    out[..hdr].fill(0);
    // Device-specific parameter: DPOFUA.
    if ten {
        out[0..2].copy_from_slice(&((at - 2) as u16).to_be_bytes());
        out[3] = 0x10;
        out[7] = bd as u8;
    } else {
        out[0] = (at - 1) as u8;
        out[2] = 0x10;
        out[3] = bd as u8;
    }
    if bd > 0 {
        let d = &mut out[hdr..hdr + 8];
        d.fill(0);
        let n = u32::try_from(lun.blocks).unwrap_or(u32::MAX).min(0xff_ffff);
        d[1..4].copy_from_slice(&n.to_be_bytes()[1..]);
        d[5..8].copy_from_slice(&lun.block_bytes.to_be_bytes()[1..]);
    }
    Ok(Plan::Data {
        len: alloc.min(at as u32),
    })
}

/// Checks MODE SELECT parameter data: every page it carries must equal the current values
/// (nothing is changeable). Returns `Ok` or the sense to answer.
pub fn mode_select(data: &[u8], ten: bool) -> Result<(), Sense> {
    let hdr = if ten { 8 } else { 4 };
    if data.len() < hdr {
        return Err(Sense::PARAM_LIST_LENGTH);
    }
    let bd = if ten {
        be16(&data[6..8]) as usize
    } else {
        usize::from(data[3])
    };
    let mut at = hdr + bd;
    if at > data.len() {
        return Err(Sense::PARAM_LIST_LENGTH);
    }
    let mut cur = [0u8; 32];
    while at < data.len() {
        if data.len() - at < 2 {
            return Err(Sense::PARAM_LIST_LENGTH);
        }
        let code = data[at] & 0x3f;
        let len = usize::from(data[at + 1]) + 2;
        if at + len > data.len() {
            return Err(Sense::PARAM_LIST_LENGTH);
        }
        let n = match code {
            0x08 => caching_page(0, &mut cur),
            0x0a => control_page(0, &mut cur),
            _ => return Err(Sense::INVALID_FIELD_PARAM),
        };
        // PS bit (0x80) of byte 0 is reserved in MODE SELECT data; compare the rest.
        if len != n || data[at + 2..at + len] != cur[2..n] {
            return Err(Sense::INVALID_FIELD_PARAM);
        }
        at += len;
    }
    Ok(())
}

fn report_opcodes(c: &[u8; 16], out: &mut [u8]) -> Result<Plan, Sense> {
    let rctd = c[2] & 0x80 != 0;
    let options = c[2] & 0x07;
    let req_op = c[3];
    let req_sa = be16(&c[4..6]);
    let alloc = be32(&c[6..10]);
    let timeouts = |d: &mut [u8]| {
        d[..12].fill(0);
        d[1] = 0x0a;
    };
    let n = match options {
        0 => {
            let mut at = 4;
            for &(op, sa, usage) in SUPPORTED {
                let d = &mut out[at..at + 8];
                d.fill(0);
                d[0] = op;
                if let Some(sa) = sa {
                    d[2..4].copy_from_slice(&u16::from(sa).to_be_bytes());
                    d[5] |= 0x01;
                }
                if rctd {
                    d[5] |= 0x02;
                }
                d[6..8].copy_from_slice(&(usage.len() as u16 + 1).to_be_bytes());
                at += 8;
                if rctd {
                    timeouts(&mut out[at..]);
                    at += 12;
                }
            }
            out[..4].copy_from_slice(&((at - 4) as u32).to_be_bytes());
            at
        }
        1..=3 => {
            let has_sa = |op: u8| SUPPORTED.iter().any(|&(o, sa, _)| o == op && sa.is_some());
            // Option 1: the opcode has no service actions (else INVALID FIELD); option 2:
            // it must have them; option 3: either.
            if options == 1 && has_sa(req_op) || options == 2 && !has_sa(req_op) {
                // The REPORTING OPTIONS field (byte 2, bits 2..0) does not fit the opcode.
                return Err(Sense::invalid_cdb_field(2, Some(2)));
            }
            let found = SUPPORTED.iter().find(|&&(o, sa, _)| {
                o == req_op
                    && match sa {
                        None => options != 2,
                        Some(s) => options != 1 && u32::from(s) == req_sa,
                    }
            });
            out[..4].fill(0);
            match found {
                Some(&(op, _, usage)) => {
                    out[1] = 0x03 | if rctd { 0x80 } else { 0 };
                    let len = usage.len() + 1;
                    out[2..4].copy_from_slice(&(len as u16).to_be_bytes());
                    out[4] = op;
                    out[5..5 + usage.len()].copy_from_slice(usage);
                    let mut at = 4 + len;
                    if rctd {
                        timeouts(&mut out[at..]);
                        at += 12;
                    }
                    at
                }
                None => {
                    out[1] = 0x01; // not supported
                    4
                }
            }
        }
        _ => return Err(Sense::invalid_cdb_field(2, Some(2))),
    };
    Ok(Plan::Data {
        len: alloc.min(n as u32),
    })
}

/// READ DEFECT DATA (10) and (12) (SBC-4 §5.19, §5.20): the logical unit is an array, whose
/// members keep their own defect management; it has no primary or grown defect list of
/// its own, so both lists are reported valid (when asked for) and empty, in the format
/// asked for when it is one SBC-4 defines (short block, long block, bytes from index,
/// physical sector, extended bytes from index, extended physical sector).
fn read_defect_data(c: &[u8; 16], out: &mut [u8]) -> Result<Plan, Sense> {
    let twelve = c[0] == opc::READ_DEFECT_DATA_12;
    let flags = if twelve { c[1] } else { c[2] };
    let format = flags & 0x07;
    if !matches!(format, 0b000 | 0b011..=0b111) || (format == 0b110 && !twelve) {
        return Err(Sense::invalid_cdb_field(
            if twelve { 1 } else { 2 },
            Some(2),
        ));
    }
    // PLISTV / GLISTV: the lists asked for are valid (and empty).
    let valid = flags & 0x18;
    let (alloc, header) = if twelve {
        (be32(&c[6..10]), 8usize)
    } else {
        (be16(&c[7..9]), 4usize)
    };
    out[..header].fill(0);
    out[1] = valid | format;
    Ok(Plan::Data {
        len: alloc.min(header as u32),
    })
}

/// Parses UNMAP parameter data into block descriptors `(lba, blocks)`, checking them
/// against the LUN (SBC-4 §5.30): returns the descriptors through `each`.
///
/// # Errors
/// The sense to answer: bad lengths (PARAMETER LIST LENGTH ERROR / INVALID FIELD IN
/// PARAMETER LIST), too many descriptors or blocks (INVALID FIELD IN PARAMETER LIST), a
/// range past the end (LBA OUT OF RANGE).
pub fn unmap_descriptors(data: &[u8], lun: &LunInfo) -> Result<usize, Sense> {
    if data.len() < 8 {
        return Err(Sense::PARAM_LIST_LENGTH);
    }
    let bd = be16(&data[2..4]) as usize;
    let avail = (data.len() - 8).min(bd) / 16;
    if avail as u32 > MAX_UNMAP_DESCRIPTORS {
        return Err(Sense::INVALID_FIELD_PARAM);
    }
    for i in 0..avail {
        let d = &data[8 + 16 * i..24 + 16 * i];
        let lba = be64(&d[..8]);
        let n = be32(&d[8..12]);
        if n > lun.max_write_same_blocks {
            return Err(Sense::INVALID_FIELD_PARAM);
        }
        range(lun, lba, n, u32::MAX)?;
    }
    Ok(avail)
}

/// The `i`-th UNMAP block descriptor (after [`unmap_descriptors`] accepted the list).
pub fn unmap_descriptor(data: &[u8], i: usize) -> (u64, u32) {
    let d = &data[8 + 16 * i..24 + 16 * i];
    (be64(&d[..8]), be32(&d[8..12]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lun() -> LunInfo {
        LunInfo {
            block_bytes: 512,
            blocks: 1 << 20,
            max_transfer_blocks: 8192,
            granularity_blocks: 512,
            optimal_blocks: 512,
            max_compare_write_blocks: 255,
            max_write_same_blocks: 1 << 16,
            uuid: [0x11; 16],
            product: "RAID6".into(),
            target_name: "iqn.2026-11.org.ferroraid:x".into(),
        }
    }

    fn cdb(b: &[u8]) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[..b.len()].copy_from_slice(b);
        c
    }

    /// ORWRITE(16): decoded with FUA, ORPROTECT refused, zero blocks GOOD, past the end
    /// LBA OUT OF RANGE (SBC-4 §5.9).
    #[test]
    fn orwrite_decodes_like_a_write() {
        let l = lun();
        let mut out = vec![0u8; MAX_PAGE_BYTES];
        let mut c = cdb(&[0x8b, 0x08]);
        c[2..10].copy_from_slice(&7u64.to_be_bytes());
        c[10..14].copy_from_slice(&3u32.to_be_bytes());
        assert_eq!(
            decode(&c, &l, &mut out),
            Plan::OrWrite {
                lba: 7,
                blocks: 3,
                fua: true
            }
        );
        assert_eq!(
            Plan::OrWrite {
                lba: 7,
                blocks: 3,
                fua: true
            }
            .data_out_bytes(512),
            1536
        );
        c[1] = 0x20;
        assert_eq!(
            decode(&c, &l, &mut out),
            Plan::Check(Sense::INVALID_FIELD_CDB)
        );
        c[1] = 0;
        c[10..14].fill(0);
        assert_eq!(decode(&c, &l, &mut out), Plan::Good);
        c[2..10].copy_from_slice(&((1u64 << 20) + 1).to_be_bytes());
        assert_eq!(
            decode(&c, &l, &mut out),
            Plan::Check(Sense::LBA_OUT_OF_RANGE)
        );
    }

    /// WRITE SAME with zero blocks covers the LBA to the last block (WSNZ=0), within
    /// MAXIMUM WRITE SAME LENGTH (SBC-4 §5.42/§5.44).
    #[test]
    fn write_same_zero_blocks_runs_to_the_end() {
        let l = lun();
        let mut out = vec![0u8; MAX_PAGE_BYTES];
        let ws10 = |lba: u32| {
            let mut c = cdb(&[0x41]);
            c[2..6].copy_from_slice(&lba.to_be_bytes());
            c
        };
        let end = (1u32 << 20) - 16;
        assert_eq!(
            decode(&ws10(end), &l, &mut out),
            Plan::WriteSame {
                lba: u64::from(end),
                blocks: 16,
                unmap: false,
                ndob: false
            }
        );
        assert_eq!(decode(&ws10(1 << 20), &l, &mut out), Plan::Good);
        assert_eq!(
            decode(&ws10((1 << 20) + 1), &l, &mut out),
            Plan::Check(Sense::LBA_OUT_OF_RANGE)
        );
        // From LBA 0 the rest exceeds MAXIMUM WRITE SAME LENGTH.
        assert_eq!(
            decode(&ws10(0), &l, &mut out),
            Plan::Check(Sense::INVALID_FIELD_CDB)
        );
        let Plan::Data { .. } = decode(&cdb(&[0x12, 1, 0xb0, 0, 255]), &l, &mut out) else {
            panic!("Block Limits page");
        };
        assert_eq!(out[4] & 0x01, 0, "WSNZ=0");
    }

    #[test]
    fn reads_writes_and_ranges() {
        let l = lun();
        let mut out = vec![0u8; MAX_PAGE_BYTES];
        let r = decode(&cdb(&[0x28, 0, 0, 0, 0, 8, 0, 0, 4, 0]), &l, &mut out);
        assert_eq!(r, Plan::Read { lba: 8, blocks: 4 });
        let w = decode(
            &cdb(&[0x8a, 0x08, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2]),
            &l,
            &mut out,
        );
        assert_eq!(
            w,
            Plan::Write {
                lba: 1,
                blocks: 2,
                fua: true
            }
        );
        // Past the end, by one block.
        let mut c = cdb(&[0x88]);
        c[2..10].copy_from_slice(&((1u64 << 20) - 1).to_be_bytes());
        c[13] = 2;
        assert_eq!(
            decode(&c, &l, &mut out),
            Plan::Check(Sense::LBA_OUT_OF_RANGE)
        );
        // RDPROTECT without protection information.
        assert_eq!(
            decode(&cdb(&[0x28, 0x20, 0, 0, 0, 0, 0, 0, 1]), &l, &mut out),
            Plan::Check(Sense::INVALID_FIELD_CDB)
        );
        // Unknown opcode.
        assert_eq!(
            decode(&cdb(&[0xee]), &l, &mut out),
            Plan::Check(Sense::INVALID_OPCODE)
        );
        // Zero blocks: nothing to do.
        assert_eq!(decode(&cdb(&[0x28]), &l, &mut out), Plan::Good);
    }

    #[test]
    fn capacity_and_inquiry_pages() {
        let l = lun();
        let mut out = vec![0u8; MAX_PAGE_BYTES];
        let mut c = cdb(&[0x9e, 0x10]);
        c[13] = 32;
        assert_eq!(decode(&c, &l, &mut out), Plan::Data { len: 32 });
        assert_eq!(be64(&out[..8]), (1 << 20) - 1);
        assert_eq!(be32(&out[8..12]), 512);
        assert_eq!(out[14] & 0xc0, 0xc0);
        assert_eq!(
            decode(&cdb(&[0x12, 0, 0, 0, 255]), &l, &mut out),
            Plan::Data { len: 96 }
        );
        assert_eq!(&out[8..16], b"FERRORAI");
        assert_eq!(
            decode(&cdb(&[0x12, 1, 0x00, 0, 255]), &l, &mut out),
            Plan::Data { len: 11 }
        );
        assert_eq!(&out[4..11], &[0x00, 0x80, 0x83, 0x8f, 0xb0, 0xb1, 0xb2]);
        let Plan::Data { len } = decode(&cdb(&[0x12, 1, 0x83, 0, 255]), &l, &mut out) else {
            panic!()
        };
        assert!(len > 20);
        assert_eq!(out[4 + 4] >> 4, 6, "NAA 6 first");
        // Allocation length truncates.
        assert_eq!(
            decode(&cdb(&[0x12, 0, 0, 0, 5]), &l, &mut out),
            Plan::Data { len: 5 }
        );
        assert_eq!(
            decode(&cdb(&[0x12, 0, 0x80, 0, 255]), &l, &mut out),
            Plan::Check(Sense::INVALID_FIELD_CDB)
        );
    }

    #[test]
    fn unmap_lists_are_checked() {
        let l = lun();
        let mut p = vec![0u8; 8 + 32];
        p[2..4].copy_from_slice(&32u16.to_be_bytes());
        p[8..16].copy_from_slice(&10u64.to_be_bytes());
        p[16..20].copy_from_slice(&5u32.to_be_bytes());
        p[24..32].copy_from_slice(&((1u64 << 20) - 1).to_be_bytes());
        p[32..36].copy_from_slice(&2u32.to_be_bytes());
        assert_eq!(unmap_descriptors(&p, &l), Err(Sense::LBA_OUT_OF_RANGE));
        p[32..36].copy_from_slice(&1u32.to_be_bytes());
        assert_eq!(unmap_descriptors(&p, &l), Ok(2));
        assert_eq!(unmap_descriptor(&p, 0), (10, 5));
        assert_eq!(
            unmap_descriptors(&p[..4], &l),
            Err(Sense::PARAM_LIST_LENGTH)
        );
    }

    #[test]
    fn report_supported_opcodes() {
        let l = lun();
        let mut out = vec![0u8; MAX_PAGE_BYTES];
        let mut c = cdb(&[0xa3, 0x0c, 0x00]);
        c[6..10].copy_from_slice(&4096u32.to_be_bytes());
        let Plan::Data { len } = decode(&c, &l, &mut out) else {
            panic!()
        };
        assert_eq!(len as usize, 4 + SUPPORTED.len() * 8);
        c[2] = 0x01;
        c[3] = 0x28;
        let Plan::Data { len } = decode(&c, &l, &mut out) else {
            panic!()
        };
        assert_eq!(out[1] & 7, 3);
        assert_eq!(len, 4 + 10);
        assert_eq!(out[4], 0x28);
        // Every usage map matches the CDB length of its opcode group.
        for &(op, _, usage) in SUPPORTED {
            let want = match op >> 5 {
                0 => 6,
                1 | 2 => 10,
                4 => 16,
                5 => 12,
                _ => 0,
            };
            assert_eq!(usage.len() + 1, want, "opcode {op:#x}");
        }
        assert!(MAX_PAGE_BYTES >= 4 + SUPPORTED.len() * 20);
        // Reporting option 2 (by service action) for an opcode without service actions:
        // INVALID FIELD IN CDB pointing at the REPORTING OPTIONS field (byte 2, bit 2).
        c[2] = 0x02;
        let Plan::Check(s) = decode(&c, &l, &mut out) else {
            panic!("option 2 for READ(10) accepted")
        };
        let f = s.fixed();
        assert_eq!((f[2], f[12], f[13]), (0x05, 0x24, 0x00));
        assert_eq!((f[15], f[16], f[17]), (0x80 | 0x40 | 0x08 | 2, 0, 2));
    }

    #[test]
    fn read_defect_data_reports_empty_valid_lists() {
        let l = lun();
        let mut out = vec![0xeeu8; MAX_PAGE_BYTES];
        // (10), both lists, long block format, allocation 32.
        let r = decode(
            &cdb(&[0x37, 0, 0x18 | 0b011, 0, 0, 0, 0, 0, 32]),
            &l,
            &mut out,
        );
        assert_eq!(r, Plan::Data { len: 4 });
        assert_eq!(&out[..4], &[0, 0x18 | 0b011, 0, 0]);
        // (12), grown list only, short block format.
        let r = decode(&cdb(&[0xb7, 0x08, 0, 0, 0, 0, 0, 0, 1, 0]), &l, &mut out);
        assert_eq!(r, Plan::Data { len: 8 });
        assert_eq!(&out[..8], &[0, 0x08, 0, 0, 0, 0, 0, 0]);
        // A reserved format.
        assert!(matches!(
            decode(&cdb(&[0x37, 0, 0b001, 0, 0, 0, 0, 0, 32]), &l, &mut out),
            Plan::Check(s) if s.asc == 0x24
        ));
    }
}
