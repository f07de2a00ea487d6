//! NVMe/TCP PDUs (NVMe/TCP transport specification 1.0, "TCP 1.0" below): layout, the
//! incremental receive parser, encoders and the connection-initialization rules.
//!
//! Every PDU starts with the 8-byte common header (CH, TCP 1.0 §3.6.2.1): `PDU-type(1)
//! FLAGS(1) HLEN(1) PDO(1) PLEN(4)`, then the PDU-specific header (PSH) up to HLEN bytes,
//! then, where negotiated, a 4-byte header digest (HDGST), padding up to PDO, the data and
//! a 4-byte data digest (DDGST). All multi-byte fields are little-endian; PLEN counts every
//! byte of the PDU. Digests are CRC32C (Castagnoli) stored little-endian (§3.3.1.1): HDGST
//! covers the HLEN header bytes, DDGST covers the data only (not the padding).
//!
//! Fatal transport errors (§3.5) are [`PduError`]s: each carries the fatal error status
//! ([`Fes`]) and fatal error information (FEI: the byte offset of the offending field,
//! where the spec asks for one) that the C2HTermReq ending the connection reports
//! ([`PduError::term_req`]). A data digest error is *not* fatal (§3.5.2 via the research
//! note §1.3): the parser still yields the PDU, with [`Received::data_digest_ok`] false,
//! and the command is completed with Transient Transport Error (SCT 0, SC 22h).
//!
//! Nothing here allocates: the parser returns data as slices of the caller's receive
//! buffer and the encoders write into the caller's buffer.

use thiserror::Error;

/// Length of the common header (CH), bytes (TCP 1.0 §3.6.2.1).
pub const CH_LEN: usize = 8;
/// Length of a header or data digest, bytes (TCP 1.0 §3.3.1.1).
pub const DIGEST_LEN: usize = 4;
/// HLEN of ICReq and ICResp, bytes (TCP 1.0 §3.6.2.2, §3.6.2.3); also their PLEN.
pub const IC_LEN: usize = 128;
/// HLEN of CapsuleCmd, bytes: CH + a 64-byte SQE (TCP 1.0 §3.6.2.6).
pub const CAPSULE_CMD_HLEN: usize = 72;
/// HLEN of every other PDU type (CapsuleResp, H2CData, C2HData, R2T, the TermReqs), bytes.
pub const SHORT_HLEN: usize = 24;
/// Most bytes of the offending PDU header a TermReq carries (TCP 1.0 §3.6.2.4/§3.6.2.5:
/// PLEN 24..152).
pub const TERM_MAX_DATA: usize = 128;
/// Largest PDU data alignment value (HPDA/CPDA, 0's based in dwords: alignment is
/// `(PDA + 1) × 4` bytes, at most 128) (TCP 1.0 §3.6.2.2).
pub const PDA_MAX: u8 = 31;
/// Smallest MAXH2CDATA a controller may announce, bytes (TCP 1.0 §3.6.2.3; the Linux 6.1
/// host also requires a multiple of 4, research note §1.2).
pub const MIN_MAXH2CDATA: u32 = 4096;
/// Length of a submission queue entry, bytes (NVMe Base: 64-byte SQE).
pub const SQE_LEN: usize = 64;
/// Length of a completion queue entry, bytes (NVMe Base: 16-byte CQE).
pub const CQE_LEN: usize = 16;

/// FLAGS bit 0: HDGSTF, a header digest follows the header (TCP 1.0 §3.6.2.1).
pub const FLAG_HDGSTF: u8 = 1 << 0;
/// FLAGS bit 1: DDGSTF, a data digest follows the data (TCP 1.0 §3.6.2.1).
pub const FLAG_DDGSTF: u8 = 1 << 1;
/// FLAGS bit 2 of H2CData/C2HData: LAST_PDU, the last data PDU of the transfer
/// (TCP 1.0 §3.6.2.8, §3.6.2.9).
pub const FLAG_LAST_PDU: u8 = 1 << 2;
/// FLAGS bit 3 of C2HData: SUCCESS, the command completed successfully and no
/// CapsuleResp follows (TCP 1.0 §3.6.2.9). Only valid with LAST_PDU.
pub const FLAG_SUCCESS: u8 = 1 << 3;

/// PSDT value (CDW0 bits 7:6) for "SGLs are used for this transfer", the only one
/// NVMe/TCP hosts use (TCP 1.0 §3.3.2, research note §1.4).
pub const PSDT_SGL: u8 = 0b01;
/// SGL identifier of an SGL Data Block descriptor with the Offset subtype (type 0h,
/// subtype 1h): in-capsule data (TCP 1.0 §3.3.2, Fig. 14).
pub const SGL_ID_DATA_BLOCK_OFFSET: u8 = 0x01;
/// SGL identifier of a Transport SGL Data Block descriptor (type 5h, transport-specific
/// subtype Ah): data moved by R2T/H2CData or C2HData (TCP 1.0 §3.3.2, Fig. 14).
pub const SGL_ID_TRANSPORT_DATA_BLOCK: u8 = 0x5A;

/// CRC32C of `bytes` as NVMe/TCP digests use it (seed ~0, final complement: the standard
/// CRC-32C; TCP 1.0 §3.3.1.1).
pub fn digest(bytes: &[u8]) -> u32 {
    engine::checksum::crc32c(bytes)
}

/// Continue a CRC32C over data that lies in several pieces: `digest_append(digest(a), b)
/// == digest(a ++ b)`. For data digests over scattered buffers.
pub fn digest_append(crc: u32, bytes: &[u8]) -> u32 {
    engine::checksum::crc32c_append(crc, bytes)
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}
fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// PDU-type values (TCP 1.0 §3.6.2.1, Fig. 21). `0x08` is reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PduType {
    /// Initialize Connection Request, host → controller (§3.6.2.2).
    IcReq = 0x00,
    /// Initialize Connection Response, controller → host (§3.6.2.3).
    IcResp = 0x01,
    /// Host to Controller Terminate Connection Request (§3.6.2.4).
    H2cTermReq = 0x02,
    /// Controller to Host Terminate Connection Request (§3.6.2.5).
    C2hTermReq = 0x03,
    /// Command capsule, host → controller (§3.6.2.6).
    CapsuleCmd = 0x04,
    /// Response capsule, controller → host (§3.6.2.7).
    CapsuleResp = 0x05,
    /// Host to Controller Data (§3.6.2.8).
    H2cData = 0x06,
    /// Controller to Host Data (§3.6.2.9).
    C2hData = 0x07,
    /// Ready to Transfer, controller → host (§3.6.2.10).
    R2t = 0x09,
}

impl PduType {
    /// The type for a PDU-type byte, `None` for reserved values.
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0x00 => Self::IcReq,
            0x01 => Self::IcResp,
            0x02 => Self::H2cTermReq,
            0x03 => Self::C2hTermReq,
            0x04 => Self::CapsuleCmd,
            0x05 => Self::CapsuleResp,
            0x06 => Self::H2cData,
            0x07 => Self::C2hData,
            0x09 => Self::R2t,
            _ => return None,
        })
    }

    /// The fixed HLEN of this type, bytes (§3.6.2.2–§3.6.2.10).
    pub fn hlen(self) -> usize {
        match self {
            Self::IcReq | Self::IcResp => IC_LEN,
            Self::CapsuleCmd => CAPSULE_CMD_HLEN,
            _ => SHORT_HLEN,
        }
    }

    /// Whether the host sends this type (else the controller does).
    pub fn from_host(self) -> bool {
        matches!(
            self,
            Self::IcReq | Self::H2cTermReq | Self::CapsuleCmd | Self::H2cData
        )
    }

    /// Whether this type carries a header digest when one is negotiated: all but the
    /// connection-initialization and termination PDUs (§3.3.1.1).
    pub fn digested(self) -> bool {
        !matches!(
            self,
            Self::IcReq | Self::IcResp | Self::H2cTermReq | Self::C2hTermReq
        )
    }
}

/// The common header (CH) of every PDU (TCP 1.0 §3.6.2.1), as on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommonHeader {
    /// PDU-type byte (see [`PduType`]).
    pub pdu_type: u8,
    /// FLAGS: [`FLAG_HDGSTF`], [`FLAG_DDGSTF`] and type-specific bits.
    pub flags: u8,
    /// HLEN: length of CH + PSH, bytes (digest not included).
    pub hlen: u8,
    /// PDO: offset of the data from the start of the PDU, bytes (0 when there is none).
    pub pdo: u8,
    /// PLEN: length of the whole PDU, bytes (header, digests, padding, data).
    pub plen: u32,
}

impl CommonHeader {
    /// Decode the first 8 bytes of `b`.
    pub fn decode(b: &[u8; CH_LEN]) -> Self {
        Self {
            pdu_type: b[0],
            flags: b[1],
            hlen: b[2],
            pdo: b[3],
            plen: le32(b, 4),
        }
    }

    /// The 8 wire bytes.
    pub fn encode(&self) -> [u8; CH_LEN] {
        let p = self.plen.to_le_bytes();
        [
            self.pdu_type,
            self.flags,
            self.hlen,
            self.pdo,
            p[0],
            p[1],
            p[2],
            p[3],
        ]
    }
}

/// Digest and alignment settings of one direction of a connection, fixed by ICReq/ICResp
/// (TCP 1.0 §3.6.2.2/§3.6.2.3). Before initialization both digests are off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Framing {
    /// Header digests on every PDU type that has one ([`PduType::digested`]).
    pub hdgst: bool,
    /// Data digests after the data of CapsuleCmd, H2CData and C2HData.
    pub ddgst: bool,
    /// PDU data alignment (PDA, 0's based in dwords) the sender honours: the receiver's
    /// HPDA (C2H) or CPDA (H2C). PDO is the header end (+ HDGST) rounded up to
    /// `(pda + 1) × 4` bytes. Values above [`PDA_MAX`] are treated as [`PDA_MAX`].
    pub pda: u8,
}

impl Framing {
    fn hd(&self, t: PduType) -> usize {
        if self.hdgst && t.digested() {
            DIGEST_LEN
        } else {
            0
        }
    }
    fn dd(&self) -> usize {
        if self.ddgst {
            DIGEST_LEN
        } else {
            0
        }
    }
    /// PDO of a data-carrying PDU of type `t`, bytes.
    fn pdo(&self, t: PduType) -> usize {
        let align = (usize::from(self.pda.min(PDA_MAX)) + 1) * 4;
        (t.hlen() + self.hd(t)).div_ceil(align) * align
    }
}

/// An SGL descriptor, 16 bytes (NVMe Base "SGL Descriptor"; the kinds NVMe/TCP uses are in
/// TCP 1.0 §3.3.2, Fig. 14).
///
/// Layout: bytes 0..8 Address (for the Data Block/Offset kind: the offset into the
/// in-capsule data), 8..12 Length (bytes), 12..15 reserved, 15 SGL Identifier (type in
/// bits 7:4, subtype in bits 3:0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SglDescriptor {
    /// Address (bytes 0..8).
    pub address: u64,
    /// Length of the data, bytes (bytes 8..12).
    pub length: u32,
    /// Bytes 12..15, reserved for the descriptor kinds NVMe/TCP uses (kept for a faithful
    /// round trip).
    pub reserved: [u8; 3],
    /// SGL Identifier (byte 15).
    pub sgl_identifier: u8,
}

/// What an SGL descriptor asks of an NVMe/TCP controller (research note §1.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SglKind {
    /// SGL Data Block, Offset subtype (identifier 01h): the data is in the capsule at
    /// offset `address` (hosts use 0, ICDOFF = 0).
    InCapsule,
    /// Transport SGL Data Block (identifier 5Ah): the data moves by R2T/H2CData or
    /// C2HData; length 0 for commands without data.
    Transport,
    /// Anything else: the command completes with SGL Descriptor Type Invalid (SC 11h).
    Other(u8),
}

impl SglDescriptor {
    /// A descriptor for `length` bytes of in-capsule data at offset 0.
    pub fn in_capsule(length: u32) -> Self {
        Self {
            address: 0,
            length,
            reserved: [0; 3],
            sgl_identifier: SGL_ID_DATA_BLOCK_OFFSET,
        }
    }

    /// A Transport SGL Data Block descriptor for `length` bytes (0: no data).
    pub fn transport(length: u32) -> Self {
        Self {
            address: 0,
            length,
            reserved: [0; 3],
            sgl_identifier: SGL_ID_TRANSPORT_DATA_BLOCK,
        }
    }

    /// The descriptor's kind from its identifier.
    pub fn kind(&self) -> SglKind {
        match self.sgl_identifier {
            SGL_ID_DATA_BLOCK_OFFSET => SglKind::InCapsule,
            SGL_ID_TRANSPORT_DATA_BLOCK => SglKind::Transport,
            other => SglKind::Other(other),
        }
    }

    /// Decode 16 bytes.
    pub fn decode(b: &[u8; 16]) -> Self {
        Self {
            address: le64(b, 0),
            length: le32(b, 8),
            reserved: [b[12], b[13], b[14]],
            sgl_identifier: b[15],
        }
    }

    /// The 16 wire bytes.
    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        put64(&mut b, 0, self.address);
        put32(&mut b, 8, self.length);
        b[12..15].copy_from_slice(&self.reserved);
        b[15] = self.sgl_identifier;
        b
    }
}

/// A submission queue entry, 64 bytes (NVMe Base "Common Command Format"), as carried in a
/// CapsuleCmd (TCP 1.0 §3.6.2.6).
///
/// Layout: byte 0 opcode (OPC), 1 flags (FUSE bits 1:0, PSDT bits 7:6), 2..4 command
/// identifier (CID), 4..8 NSID (for Fabrics commands, opcode 7Fh, byte 4 is FCTYPE),
/// 8..16 CDW2–CDW3, 16..24 MPTR, 24..40 DPTR (SGL1), 40..64 CDW10–CDW15.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sqe {
    /// Opcode (CDW0 bits 7:0).
    pub opcode: u8,
    /// CDW0 bits 15:8: FUSE (bits 1:0) and PSDT (bits 7:6).
    pub flags: u8,
    /// Command identifier (CDW0 bits 31:16). Opaque: Linux puts a generation counter in
    /// the upper bits.
    pub cid: u16,
    /// Namespace identifier (CDW1).
    pub nsid: u32,
    /// Command dword 2.
    pub cdw2: u32,
    /// Command dword 3.
    pub cdw3: u32,
    /// Metadata pointer (CDW4–5).
    pub mptr: u64,
    /// Data pointer (CDW6–9): SGL descriptor 1.
    pub dptr: SglDescriptor,
    /// Command dword 10.
    pub cdw10: u32,
    /// Command dword 11.
    pub cdw11: u32,
    /// Command dword 12.
    pub cdw12: u32,
    /// Command dword 13.
    pub cdw13: u32,
    /// Command dword 14.
    pub cdw14: u32,
    /// Command dword 15.
    pub cdw15: u32,
}

impl Sqe {
    /// PSDT (flags bits 7:6): [`PSDT_SGL`] from NVMe/TCP hosts.
    pub fn psdt(&self) -> u8 {
        self.flags >> 6
    }

    /// FUSE (flags bits 1:0): 0 for a normal command.
    pub fn fuse(&self) -> u8 {
        self.flags & 0b11
    }

    /// Decode 64 bytes.
    pub fn decode(b: &[u8; SQE_LEN]) -> Self {
        let mut sgl = [0u8; 16];
        sgl.copy_from_slice(&b[24..40]);
        Self {
            opcode: b[0],
            flags: b[1],
            cid: le16(b, 2),
            nsid: le32(b, 4),
            cdw2: le32(b, 8),
            cdw3: le32(b, 12),
            mptr: le64(b, 16),
            dptr: SglDescriptor::decode(&sgl),
            cdw10: le32(b, 40),
            cdw11: le32(b, 44),
            cdw12: le32(b, 48),
            cdw13: le32(b, 52),
            cdw14: le32(b, 56),
            cdw15: le32(b, 60),
        }
    }

    /// The 64 wire bytes.
    pub fn encode(&self) -> [u8; SQE_LEN] {
        let mut b = [0u8; SQE_LEN];
        b[0] = self.opcode;
        b[1] = self.flags;
        put16(&mut b, 2, self.cid);
        put32(&mut b, 4, self.nsid);
        put32(&mut b, 8, self.cdw2);
        put32(&mut b, 12, self.cdw3);
        put64(&mut b, 16, self.mptr);
        b[24..40].copy_from_slice(&self.dptr.encode());
        for (i, v) in [
            self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15,
        ]
        .into_iter()
        .enumerate()
        {
            put32(&mut b, 40 + 4 * i, v);
        }
        b
    }
}

/// A completion queue entry, 16 bytes (NVMe Base "Common Completion Queue Entry"), as
/// carried in a CapsuleResp (TCP 1.0 §3.6.2.7).
///
/// Layout: 0..4 DW0 (command specific), 4..8 DW1, 8..10 SQ head pointer (SQHD), 10..12 SQ
/// identifier (SQID), 12..14 command identifier (CID), 14..16 phase tag (bit 0) and status
/// field (bits 15:1: SC 8:1, SCT 11:9, CRD 13:12, More 14, DNR 15).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cqe {
    /// Dword 0, command specific.
    pub dw0: u32,
    /// Dword 1, command specific.
    pub dw1: u32,
    /// SQ head pointer.
    pub sqhd: u16,
    /// SQ identifier.
    pub sqid: u16,
    /// Identifier of the completed command.
    pub cid: u16,
    /// Bits 15:0 of dword 3: phase tag (bit 0) and status field (bits 15:1), as on the wire.
    pub status: u16,
}

impl Cqe {
    /// The status word for status code `sc` of status code type `sct`, with Do Not Retry
    /// `dnr`, phase tag 0 (fabrics transports do not use the phase tag).
    pub fn status_word(sct: u8, sc: u8, dnr: bool) -> u16 {
        (u16::from(sc) << 1) | (u16::from(sct & 0b111) << 9) | (u16::from(dnr) << 15)
    }
    /// Phase tag (bit 0).
    pub fn phase(&self) -> bool {
        self.status & 1 != 0
    }
    /// Status code (SC).
    pub fn sc(&self) -> u8 {
        (self.status >> 1) as u8
    }
    /// Status code type (SCT).
    pub fn sct(&self) -> u8 {
        ((self.status >> 9) & 0b111) as u8
    }
    /// Command retry delay (CRD).
    pub fn crd(&self) -> u8 {
        ((self.status >> 12) & 0b11) as u8
    }
    /// More (M): more status in the Error Information log page.
    pub fn more(&self) -> bool {
        self.status & (1 << 14) != 0
    }
    /// Do not retry (DNR).
    pub fn dnr(&self) -> bool {
        self.status & (1 << 15) != 0
    }

    /// Decode 16 bytes.
    pub fn decode(b: &[u8; CQE_LEN]) -> Self {
        Self {
            dw0: le32(b, 0),
            dw1: le32(b, 4),
            sqhd: le16(b, 8),
            sqid: le16(b, 10),
            cid: le16(b, 12),
            status: le16(b, 14),
        }
    }

    /// The 16 wire bytes.
    pub fn encode(&self) -> [u8; CQE_LEN] {
        let mut b = [0u8; CQE_LEN];
        put32(&mut b, 0, self.dw0);
        put32(&mut b, 4, self.dw1);
        put16(&mut b, 8, self.sqhd);
        put16(&mut b, 10, self.sqid);
        put16(&mut b, 12, self.cid);
        put16(&mut b, 14, self.status);
        b
    }
}

/// ICReq PSH (TCP 1.0 §3.6.2.2): bytes 8..10 PFV, 10 HPDA, 11 DGST (bit 0 HDGST_ENABLE,
/// bit 1 DDGST_ENABLE), 12..16 MAXR2T, 16..128 reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IcReq {
    /// PDU format version; 0 is the only one defined.
    pub pfv: u16,
    /// Host PDU data alignment (0's based, dwords) for C2H data.
    pub hpda: u8,
    /// The host asks for header digests.
    pub hdgst_enable: bool,
    /// The host asks for data digests.
    pub ddgst_enable: bool,
    /// Maximum outstanding R2Ts per command, 0's based (Linux sends 0: one R2T).
    pub maxr2t: u32,
}

/// ICResp PSH (TCP 1.0 §3.6.2.3): bytes 8..10 PFV, 10 CPDA, 11 DGST, 12..16 MAXH2CDATA,
/// 16..128 reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IcResp {
    /// PDU format version (0).
    pub pfv: u16,
    /// Controller PDU data alignment (0's based, dwords) for H2C data.
    pub cpda: u8,
    /// Header digests enabled.
    pub hdgst_enable: bool,
    /// Data digests enabled.
    pub ddgst_enable: bool,
    /// Maximum data bytes in one H2CData PDU (≥ 4096, a multiple of 4 for Linux).
    pub maxh2cdata: u32,
}

/// H2CTermReq/C2HTermReq (TCP 1.0 §3.6.2.4, §3.6.2.5): bytes 8..10 FES, 10..14 FEI,
/// 14..24 reserved, then up to 128 bytes of the offending PDU header. Never digested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermReq<'a> {
    /// Fatal error status, raw (see [`Fes`]).
    pub fes: u16,
    /// Fatal error information (byte offset of the offending field for FES 1 and 6).
    pub fei: u32,
    /// The offending PDU header (≤ [`TERM_MAX_DATA`] bytes).
    pub data: &'a [u8],
}

/// H2CData PSH (TCP 1.0 §3.6.2.8): bytes 8..10 CCCID, 10..12 TTAG, 12..16 DATAO, 16..20
/// DATAL, 20..24 reserved. DATAL is the data's length, so it is not stored: the parser
/// checks it against PLEN and the encoder writes it from the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct H2cDataHdr {
    /// Command capsule CID of the command the data belongs to.
    pub cccid: u16,
    /// Transfer tag from the R2T.
    pub ttag: u16,
    /// Offset of this data in the command's data, bytes.
    pub datao: u32,
    /// LAST_PDU flag.
    pub last: bool,
}

/// C2HData PSH (TCP 1.0 §3.6.2.9): bytes 8..10 CCCID, 10..12 reserved, 12..16 DATAO,
/// 16..20 DATAL, 20..24 reserved. DATAL is derived from the data as for [`H2cDataHdr`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct C2hDataHdr {
    /// Command capsule CID.
    pub cccid: u16,
    /// Offset of this data in the command's data, bytes.
    pub datao: u32,
    /// LAST_PDU flag.
    pub last: bool,
    /// SUCCESS flag (only with `last`; the research note §1.5 advises against it in v1).
    pub success: bool,
}

/// R2T PSH (TCP 1.0 §3.6.2.10): bytes 8..10 CCCID, 10..12 TTAG, 12..16 R2TO, 16..20 R2TL,
/// 20..24 reserved. PDO is 0, no data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct R2t {
    /// Command capsule CID.
    pub cccid: u16,
    /// Transfer tag chosen by the controller, echoed in H2CData.
    pub ttag: u16,
    /// Offset of the requested data, bytes.
    pub r2to: u32,
    /// Length of the requested data, bytes (> 0).
    pub r2tl: u32,
}

/// One PDU, data borrowed from the receive buffer (or, to encode, from the caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pdu<'a> {
    /// ICReq (§3.6.2.2).
    IcReq(IcReq),
    /// ICResp (§3.6.2.3).
    IcResp(IcResp),
    /// H2CTermReq (§3.6.2.4).
    H2cTermReq(TermReq<'a>),
    /// C2HTermReq (§3.6.2.5).
    C2hTermReq(TermReq<'a>),
    /// CapsuleCmd (§3.6.2.6) with its in-capsule data (empty if none).
    CapsuleCmd {
        /// The command.
        sqe: Sqe,
        /// In-capsule data.
        data: &'a [u8],
    },
    /// CapsuleResp (§3.6.2.7).
    CapsuleResp(Cqe),
    /// H2CData (§3.6.2.8).
    H2cData {
        /// The header fields.
        hdr: H2cDataHdr,
        /// The data (DATAL bytes).
        data: &'a [u8],
    },
    /// C2HData (§3.6.2.9).
    C2hData {
        /// The header fields.
        hdr: C2hDataHdr,
        /// The data (DATAL bytes).
        data: &'a [u8],
    },
    /// R2T (§3.6.2.10).
    R2t(R2t),
}

impl<'a> Pdu<'a> {
    /// The PDU's type.
    pub fn pdu_type(&self) -> PduType {
        match self {
            Pdu::IcReq(_) => PduType::IcReq,
            Pdu::IcResp(_) => PduType::IcResp,
            Pdu::H2cTermReq(_) => PduType::H2cTermReq,
            Pdu::C2hTermReq(_) => PduType::C2hTermReq,
            Pdu::CapsuleCmd { .. } => PduType::CapsuleCmd,
            Pdu::CapsuleResp(_) => PduType::CapsuleResp,
            Pdu::H2cData { .. } => PduType::H2cData,
            Pdu::C2hData { .. } => PduType::C2hData,
            Pdu::R2t(_) => PduType::R2t,
        }
    }

    /// The data the PDU carries (empty for types without data).
    pub fn data(&self) -> &'a [u8] {
        match *self {
            Pdu::H2cTermReq(t) | Pdu::C2hTermReq(t) => t.data,
            Pdu::CapsuleCmd { data, .. }
            | Pdu::H2cData { data, .. }
            | Pdu::C2hData { data, .. } => data,
            _ => &[],
        }
    }

    /// Bytes [`encode`](Self::encode) writes with `framing`: PLEN.
    pub fn encoded_len(&self, framing: &Framing) -> usize {
        self.layout(framing, self.data().len()).plen
    }

    fn layout(&self, framing: &Framing, data_len: usize) -> Layout {
        let t = self.pdu_type();
        let hd = framing.hd(t);
        let header_end = t.hlen() + hd;
        match t {
            PduType::CapsuleCmd | PduType::H2cData | PduType::C2hData if data_len > 0 => {
                let pdo = framing.pdo(t);
                Layout {
                    hd,
                    pdo,
                    plen: pdo + data_len + framing.dd(),
                    ddgst: framing.ddgst,
                }
            }
            PduType::H2cTermReq | PduType::C2hTermReq => Layout {
                hd: 0,
                pdo: 0,
                plen: SHORT_HLEN + data_len,
                ddgst: false,
            },
            _ => Layout {
                hd,
                pdo: 0,
                plen: header_end,
                ddgst: false,
            },
        }
    }

    /// Encode the header of this PDU (CH, PSH, HDGST and padding up to PDO) for
    /// `data_len` bytes of data that the caller sends after it (followed by the data
    /// digest, [`digest`] of the data, little-endian, when `framing.ddgst` and
    /// `data_len > 0`). The data slice inside `self` is ignored: for sending data from
    /// the caller's own buffers without copying it. Returns the header length (PDO, or
    /// PLEN for a PDU without data), bytes.
    pub fn encode_header(
        &self,
        framing: &Framing,
        data_len: usize,
        out: &mut [u8],
    ) -> Result<usize, EncodeError> {
        let t = self.pdu_type();
        let max = max_data(t);
        if data_len > max {
            return Err(EncodeError::DataTooLong { len: data_len, max });
        }
        let l = self.layout(framing, data_len);
        let head = if l.pdo > 0 { l.pdo } else { t.hlen() + l.hd };
        if out.len() < head {
            return Err(EncodeError::BufferTooSmall {
                need: head,
                have: out.len(),
            });
        }
        let out = &mut out[..head];
        out.fill(0);
        let mut flags = 0u8;
        if l.hd > 0 {
            flags |= FLAG_HDGSTF;
        }
        if l.ddgst {
            flags |= FLAG_DDGSTF;
        }
        match *self {
            Pdu::IcReq(r) => {
                put16(out, 8, r.pfv);
                out[10] = r.hpda;
                out[11] = u8::from(r.hdgst_enable) | (u8::from(r.ddgst_enable) << 1);
                put32(out, 12, r.maxr2t);
            }
            Pdu::IcResp(r) => {
                put16(out, 8, r.pfv);
                out[10] = r.cpda;
                out[11] = u8::from(r.hdgst_enable) | (u8::from(r.ddgst_enable) << 1);
                put32(out, 12, r.maxh2cdata);
            }
            Pdu::H2cTermReq(r) | Pdu::C2hTermReq(r) => {
                put16(out, 8, r.fes);
                put32(out, 10, r.fei);
            }
            Pdu::CapsuleCmd { sqe, .. } => out[8..72].copy_from_slice(&sqe.encode()),
            Pdu::CapsuleResp(cqe) => out[8..24].copy_from_slice(&cqe.encode()),
            Pdu::H2cData { hdr, .. } => {
                put16(out, 8, hdr.cccid);
                put16(out, 10, hdr.ttag);
                put32(out, 12, hdr.datao);
                put32(out, 16, data_len as u32);
                if hdr.last {
                    flags |= FLAG_LAST_PDU;
                }
            }
            Pdu::C2hData { hdr, .. } => {
                put16(out, 8, hdr.cccid);
                put32(out, 12, hdr.datao);
                put32(out, 16, data_len as u32);
                if hdr.last {
                    flags |= FLAG_LAST_PDU;
                }
                if hdr.success {
                    flags |= FLAG_SUCCESS;
                }
            }
            Pdu::R2t(r) => {
                put16(out, 8, r.cccid);
                put16(out, 10, r.ttag);
                put32(out, 12, r.r2to);
                put32(out, 16, r.r2tl);
            }
        }
        let ch = CommonHeader {
            pdu_type: t as u8,
            flags,
            hlen: t.hlen() as u8,
            pdo: l.pdo as u8,
            plen: l.plen as u32,
        };
        out[..CH_LEN].copy_from_slice(&ch.encode());
        if l.hd > 0 {
            let h = t.hlen();
            let d = digest(&out[..h]);
            out[h..h + DIGEST_LEN].copy_from_slice(&d.to_le_bytes());
        }
        Ok(head)
    }

    /// Encode the whole PDU (header, data, data digest) into `out`. Returns PLEN, bytes.
    /// Send it with one write: the Linux 6.1 host reads the ICResp with a single
    /// `recvmsg` (research note §1.2).
    pub fn encode(&self, framing: &Framing, out: &mut [u8]) -> Result<usize, EncodeError> {
        let data = self.data();
        let max = max_data(self.pdu_type());
        if data.len() > max {
            return Err(EncodeError::DataTooLong {
                len: data.len(),
                max,
            });
        }
        // Checked before writing so that nothing is written on error.
        let plen = self.encoded_len(framing);
        if out.len() < plen {
            return Err(EncodeError::BufferTooSmall {
                need: plen,
                have: out.len(),
            });
        }
        let head = self.encode_header(framing, data.len(), out)?;
        if data.is_empty() {
            return Ok(head);
        }
        out[head..head + data.len()].copy_from_slice(data);
        let l = self.layout(framing, data.len());
        if l.ddgst {
            let at = head + data.len();
            out[at..at + DIGEST_LEN].copy_from_slice(&digest(data).to_le_bytes());
        }
        Ok(l.plen)
    }
}

/// Most data bytes a PDU of type `t` can carry (PLEN is 32 bits; 128 for a TermReq).
fn max_data(t: PduType) -> usize {
    match t {
        PduType::H2cTermReq | PduType::C2hTermReq => TERM_MAX_DATA,
        PduType::CapsuleCmd | PduType::H2cData | PduType::C2hData => u32::MAX as usize - 256,
        _ => 0,
    }
}

struct Layout {
    hd: usize,
    pdo: usize,
    plen: usize,
    ddgst: bool,
}

/// An encoder failure (the caller's mistake, never the peer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum EncodeError {
    /// `out` is shorter than the PDU (or its header).
    #[error("buffer too small for the PDU: need {need} bytes, have {have}")]
    BufferTooSmall {
        /// Bytes needed.
        need: usize,
        /// Bytes given.
        have: usize,
    },
    /// More data than the PDU type can carry (128 bytes for a TermReq).
    #[error("PDU data too long: {len} bytes, at most {max}")]
    DataTooLong {
        /// Data bytes given.
        len: usize,
        /// The most allowed.
        max: usize,
    },
}

/// Fatal error status values of H2CTermReq/C2HTermReq (TCP 1.0 §3.6.2.4/§3.6.2.5, §3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Fes {
    /// 01h: Invalid PDU Header Field (FEI: byte offset of the field).
    InvalidHeaderField = 0x01,
    /// 02h: PDU Sequence Error.
    PduSequenceError = 0x02,
    /// 03h: Header Digest Error.
    HeaderDigestError = 0x03,
    /// 04h: Data Transfer Out of Range.
    DataTransferOutOfRange = 0x04,
    /// 05h: Data Transfer Limit Exceeded.
    DataTransferLimitExceeded = 0x05,
    /// 06h: Unsupported Parameter (FEI: byte offset of the parameter).
    UnsupportedParameter = 0x06,
}

/// A fatal transport error (TCP 1.0 §3.5): the controller sends a C2HTermReq with
/// [`fes`](Self::fes) and [`fei`](Self::fei) ([`PduError::term_req`]) and closes the
/// connection. FEI is a byte offset from the start of the PDU; where the spec defines no
/// FEI for the status it is still the offset of the field found wrong (as SPDK reports
/// it), or 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PduError {
    /// A header field has a value not allowed here (FES 01h).
    #[error("invalid PDU header field at byte {fei}: {reason}")]
    InvalidHeaderField {
        /// Byte offset of the field in the PDU.
        fei: u32,
        /// What was wrong.
        reason: &'static str,
    },
    /// A PDU arrived that the connection's state does not allow (FES 02h).
    #[error("PDU sequence error: {reason}")]
    PduSequence {
        /// Byte offset of the field that gave it away (0: the PDU type).
        fei: u32,
        /// What was wrong.
        reason: &'static str,
    },
    /// The header digest does not match the header (FES 03h).
    #[error(
        "header digest error: the PDU carries {received:#010x}, the header gives {computed:#010x}"
    )]
    HeaderDigest {
        /// HDGST as received.
        received: u32,
        /// CRC32C of the received header.
        computed: u32,
    },
    /// Data outside the range the controller asked for (FES 04h).
    #[error("data transfer out of range at byte {fei}: {reason}")]
    DataOutOfRange {
        /// Byte offset of the field (DATAO or DATAL).
        fei: u32,
        /// What was wrong.
        reason: &'static str,
    },
    /// More data in one PDU than allowed (FES 05h): above MAXH2CDATA for H2CData, above
    /// the in-capsule data size for CapsuleCmd.
    #[error("data transfer limit exceeded at byte {fei}: {len} bytes, limit {limit}")]
    DataLimitExceeded {
        /// Byte offset of the field (DATAL, or PLEN for a capsule).
        fei: u32,
        /// Data bytes in the PDU.
        len: u64,
        /// The limit, bytes.
        limit: u32,
    },
    /// A parameter the controller does not support (FES 06h).
    #[error("unsupported parameter at byte {fei}: {reason}")]
    UnsupportedParameter {
        /// Byte offset of the parameter.
        fei: u32,
        /// What was unsupported.
        reason: &'static str,
    },
}

impl PduError {
    /// The fatal error status for the C2HTermReq.
    pub fn fes(&self) -> Fes {
        match self {
            Self::InvalidHeaderField { .. } => Fes::InvalidHeaderField,
            Self::PduSequence { .. } => Fes::PduSequenceError,
            Self::HeaderDigest { .. } => Fes::HeaderDigestError,
            Self::DataOutOfRange { .. } => Fes::DataTransferOutOfRange,
            Self::DataLimitExceeded { .. } => Fes::DataTransferLimitExceeded,
            Self::UnsupportedParameter { .. } => Fes::UnsupportedParameter,
        }
    }

    /// The fatal error information for the C2HTermReq: a byte offset in the PDU.
    pub fn fei(&self) -> u32 {
        match *self {
            Self::InvalidHeaderField { fei, .. }
            | Self::PduSequence { fei, .. }
            | Self::DataOutOfRange { fei, .. }
            | Self::DataLimitExceeded { fei, .. }
            | Self::UnsupportedParameter { fei, .. } => fei,
            Self::HeaderDigest { .. } => 0,
        }
    }

    /// The C2HTermReq reporting this error, carrying the offending PDU's header taken
    /// from `received` (the receive buffer from the start of that PDU): its HLEN bytes
    /// as far as received, at most 128. Encode it with [`Pdu::C2hTermReq`] (or
    /// [`Pdu::H2cTermReq`] on a host).
    pub fn term_req<'a>(&self, received: &'a [u8]) -> TermReq<'a> {
        let hlen = received
            .get(2)
            .map_or(CH_LEN, |&h| usize::from(h).max(CH_LEN));
        let n = hlen.min(received.len()).min(TERM_MAX_DATA);
        TermReq {
            fes: self.fes() as u16,
            fei: self.fei(),
            data: &received[..n],
        }
    }
}

/// Which end of the connection the parser serves: it accepts only the PDU types the
/// other end sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A controller (target): receives ICReq, CapsuleCmd, H2CData, H2CTermReq.
    Controller,
    /// A host: receives ICResp, CapsuleResp, C2HData, R2T, C2HTermReq (for tests and a
    /// load generator).
    Host,
}

/// Receive limits, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvLimits {
    /// Most in-capsule data in one CapsuleCmd: the controller's in-capsule data size
    /// (admin queue at least 8192, research note §1.4; I/O queues IOCCSZ × 16 − 64, but
    /// at least 1024 for Fabrics Connect). Per-command checks are the command layer's.
    pub max_in_capsule: u32,
    /// Most data in one H2CData (MAXH2CDATA) or C2HData PDU.
    pub max_data_pdu: u32,
}

/// One step of the parser.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parse<'a> {
    /// The buffer holds no complete PDU yet: at least this many more bytes (≥ 1) are
    /// needed before it can say more. Everything received so far has been checked.
    Need(usize),
    /// A complete PDU.
    Pdu(Received<'a>),
}

/// A complete PDU from the receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received<'a> {
    /// The PDU; its data borrows the buffer.
    pub pdu: Pdu<'a>,
    /// Bytes it takes in the buffer (PLEN): consume them before the next call.
    pub len: usize,
    /// False when a data digest was present and wrong: not fatal; the command completes
    /// with Transient Transport Error (SCT 0, SC 22h) (research note §1.3).
    pub data_digest_ok: bool,
}

/// Incremental PDU receive parser for one connection.
///
/// The caller keeps a receive buffer; after each read it calls [`parse`](Self::parse)
/// with the unconsumed bytes, which returns a complete PDU (the caller consumes
/// [`Received::len`] bytes and calls again), or how many more bytes are needed, or a
/// fatal [`PduError`]. Each call checks what has arrived, so a malformed header is
/// reported as soon as its bytes are there, before its data. The header is checked from
/// the CH alone (type, HLEN, flags, PDO, PLEN, limits: at most 8 bytes buffered before
/// an oversized PDU is refused), then the PSH and HDGST, then the data and DDGST.
/// No allocation, no panic on any input.
///
/// Connection state: the first PDU must be ICReq (ICResp for a host) — or a TermReq —
/// and no second one may follow (PDU sequence errors, TCP 1.0 §3.6.2.2). Once the
/// initialization exchange is done the caller installs the negotiated [`Framing`] with
/// [`set_framing`](Self::set_framing).
#[derive(Debug, Clone)]
pub struct PduParser {
    role: Role,
    framing: Framing,
    limits: RecvLimits,
    ic_done: bool,
}

impl PduParser {
    /// A parser for a new connection: no digests, PDA 0, initialization pending.
    pub fn new(role: Role, limits: RecvLimits) -> Self {
        Self {
            role,
            framing: Framing::default(),
            limits,
            ic_done: false,
        }
    }

    /// Install the framing the peer sends with (after ICReq/ICResp: see
    /// [`Negotiated::rx`]).
    pub fn set_framing(&mut self, framing: Framing) {
        self.framing = framing;
    }

    /// The framing in use.
    pub fn framing(&self) -> Framing {
        self.framing
    }

    /// Change the receive limits.
    pub fn set_limits(&mut self, limits: RecvLimits) {
        self.limits = limits;
    }

    /// Whether ICReq (ICResp) has been received.
    pub fn ic_done(&self) -> bool {
        self.ic_done
    }

    /// Parse the PDU at the start of `buf` (see the type's documentation).
    pub fn parse<'a>(&mut self, buf: &'a [u8]) -> Result<Parse<'a>, PduError> {
        let Some(ch) = buf.first_chunk::<CH_LEN>() else {
            return Ok(Parse::Need(CH_LEN - buf.len()));
        };
        let ch = CommonHeader::decode(ch);
        let f = self.framing;
        let Some(t) = PduType::from_u8(ch.pdu_type) else {
            return Err(field(0, "unknown PDU type"));
        };
        if t.from_host() != (self.role == Role::Controller) {
            return Err(field(0, "PDU type not sent in this direction"));
        }
        let is_ic = matches!(t, PduType::IcReq | PduType::IcResp);
        let is_term = matches!(t, PduType::H2cTermReq | PduType::C2hTermReq);
        if !self.ic_done && !is_ic && !is_term {
            return Err(PduError::PduSequence {
                fei: 0,
                reason: "PDU before connection initialization",
            });
        }
        if self.ic_done && is_ic {
            return Err(PduError::PduSequence {
                fei: 0,
                reason: "second connection initialization PDU",
            });
        }
        let hlen = t.hlen();
        if usize::from(ch.hlen) != hlen {
            return Err(field(2, "HLEN wrong for the PDU type"));
        }
        let plen = ch.plen as usize;
        let hd = f.hd(t);
        if t.digested() && (ch.flags & FLAG_HDGSTF != 0) != f.hdgst {
            return Err(field(1, "HDGSTF differs from the negotiated header digest"));
        }
        let header_end = hlen + hd;
        if plen < header_end {
            return Err(field(4, "PLEN shorter than the header"));
        }
        // Where the data starts and how long it is; whether a data digest follows.
        let (pdo, data_len, dd) = match t {
            PduType::IcReq | PduType::IcResp => {
                if plen != IC_LEN {
                    return Err(field(4, "PLEN of ICReq/ICResp is not 128"));
                }
                (0, 0, 0)
            }
            PduType::H2cTermReq | PduType::C2hTermReq => {
                if plen > SHORT_HLEN + TERM_MAX_DATA {
                    return Err(field(4, "PLEN of a TermReq above 152"));
                }
                (SHORT_HLEN, plen - SHORT_HLEN, 0)
            }
            PduType::CapsuleResp | PduType::R2t => {
                if plen != header_end {
                    return Err(field(4, "PLEN of a PDU without data is not its header"));
                }
                if ch.flags & FLAG_DDGSTF != 0 {
                    return Err(field(1, "DDGSTF on a PDU without data"));
                }
                (0, 0, 0)
            }
            PduType::CapsuleCmd | PduType::H2cData | PduType::C2hData => {
                if plen == header_end {
                    if t != PduType::CapsuleCmd {
                        return Err(field(4, "data PDU without data"));
                    }
                    if ch.flags & FLAG_DDGSTF != 0 {
                        return Err(field(1, "DDGSTF on a PDU without data"));
                    }
                    (0, 0, 0)
                } else {
                    if (ch.flags & FLAG_DDGSTF != 0) != f.ddgst {
                        return Err(field(1, "DDGSTF differs from the negotiated data digest"));
                    }
                    let pdo = usize::from(ch.pdo);
                    if pdo != f.pdo(t) {
                        return Err(field(3, "PDO not the aligned end of the header"));
                    }
                    let dd = f.dd();
                    if plen < pdo + dd + 1 {
                        return Err(field(4, "PLEN too short for PDO and the data digest"));
                    }
                    let data_len = plen - pdo - dd;
                    let (limit, fei) = if t == PduType::CapsuleCmd {
                        (self.limits.max_in_capsule, 4)
                    } else {
                        (self.limits.max_data_pdu, 16)
                    };
                    if data_len > limit as usize {
                        return Err(PduError::DataLimitExceeded {
                            fei,
                            len: data_len as u64,
                            limit,
                        });
                    }
                    (pdo, data_len, dd)
                }
            }
        };
        if t == PduType::C2hData && ch.flags & FLAG_SUCCESS != 0 && ch.flags & FLAG_LAST_PDU == 0 {
            return Err(field(1, "SUCCESS without LAST_PDU"));
        }
        if buf.len() < header_end {
            return Ok(Parse::Need(header_end - buf.len()));
        }
        if hd > 0 {
            let received = le32(buf, hlen);
            let computed = digest(&buf[..hlen]);
            if received != computed {
                return Err(PduError::HeaderDigest { received, computed });
            }
        }
        // PSH checks that need the header bytes.
        if matches!(t, PduType::H2cData | PduType::C2hData) && le32(buf, 16) as usize != data_len {
            return Err(field(16, "DATAL differs from the PDU's data length"));
        }
        if t == PduType::R2t && le32(buf, 16) == 0 {
            return Err(field(16, "R2TL is 0"));
        }
        if buf.len() < plen {
            return Ok(Parse::Need(plen - buf.len()));
        }
        let data = &buf[pdo..pdo + data_len];
        let data_digest_ok = dd == 0 || le32(buf, pdo + data_len) == digest(data);
        let h = &buf[..hlen];
        let pdu = match t {
            PduType::IcReq => Pdu::IcReq(IcReq {
                pfv: le16(h, 8),
                hpda: h[10],
                hdgst_enable: h[11] & 1 != 0,
                ddgst_enable: h[11] & 2 != 0,
                maxr2t: le32(h, 12),
            }),
            PduType::IcResp => Pdu::IcResp(IcResp {
                pfv: le16(h, 8),
                cpda: h[10],
                hdgst_enable: h[11] & 1 != 0,
                ddgst_enable: h[11] & 2 != 0,
                maxh2cdata: le32(h, 12),
            }),
            PduType::H2cTermReq | PduType::C2hTermReq => {
                let r = TermReq {
                    fes: le16(h, 8),
                    fei: le32(h, 10),
                    data,
                };
                if t == PduType::H2cTermReq {
                    Pdu::H2cTermReq(r)
                } else {
                    Pdu::C2hTermReq(r)
                }
            }
            PduType::CapsuleCmd => {
                let mut sqe = [0u8; SQE_LEN];
                sqe.copy_from_slice(&h[8..72]);
                Pdu::CapsuleCmd {
                    sqe: Sqe::decode(&sqe),
                    data,
                }
            }
            PduType::CapsuleResp => {
                let mut cqe = [0u8; CQE_LEN];
                cqe.copy_from_slice(&h[8..24]);
                Pdu::CapsuleResp(Cqe::decode(&cqe))
            }
            PduType::H2cData => Pdu::H2cData {
                hdr: H2cDataHdr {
                    cccid: le16(h, 8),
                    ttag: le16(h, 10),
                    datao: le32(h, 12),
                    last: ch.flags & FLAG_LAST_PDU != 0,
                },
                data,
            },
            PduType::C2hData => Pdu::C2hData {
                hdr: C2hDataHdr {
                    cccid: le16(h, 8),
                    datao: le32(h, 12),
                    last: ch.flags & FLAG_LAST_PDU != 0,
                    success: ch.flags & FLAG_SUCCESS != 0,
                },
                data,
            },
            PduType::R2t => Pdu::R2t(R2t {
                cccid: le16(h, 8),
                ttag: le16(h, 10),
                r2to: le32(h, 12),
                r2tl: le32(h, 16),
            }),
        };
        if is_ic {
            self.ic_done = true;
        }
        Ok(Parse::Pdu(Received {
            pdu,
            len: plen,
            data_digest_ok,
        }))
    }
}

fn field(fei: u32, reason: &'static str) -> PduError {
    PduError::InvalidHeaderField { fei, reason }
}

/// What the controller offers in ICResp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcPolicy {
    maxh2cdata: u32,
}

impl IcPolicy {
    /// A policy announcing MAXH2CDATA = `maxh2cdata` bytes; `None` unless it is at least
    /// 4096 (TCP 1.0 §3.6.2.3) and a multiple of 4 (what the Linux 6.1 host requires,
    /// research note §1.2). Pick at least MDTS in bytes so one R2T takes one H2CData.
    pub fn new(maxh2cdata: u32) -> Option<Self> {
        (maxh2cdata >= MIN_MAXH2CDATA && maxh2cdata.is_multiple_of(4))
            .then_some(Self { maxh2cdata })
    }

    /// MAXH2CDATA, bytes.
    pub fn maxh2cdata(&self) -> u32 {
        self.maxh2cdata
    }
}

/// The outcome of connection initialization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// The ICResp to send (one write of 128 bytes).
    pub resp: IcResp,
    /// Framing of what the host sends (digests, CPDA): for [`PduParser::set_framing`].
    pub rx: Framing,
    /// Framing of what the controller sends (digests, HPDA): for the encoders.
    pub tx: Framing,
    /// Outstanding R2Ts allowed per command (MAXR2T + 1; 1 with Linux).
    pub max_r2t: u64,
}

/// Answer an ICReq (TCP 1.0 §3.6.2.2/§3.6.2.3) the way the Linux 6.1 host accepts
/// (research note §1.2): PFV 0, digests exactly as requested (the host refuses a
/// declined digest), CPDA 0, MAXH2CDATA from `policy`. PFV ≠ 0 and HPDA > 31 are fatal
/// Invalid PDU Header Field errors at their offsets (8, 10), as SPDK reports them.
pub fn negotiate(req: &IcReq, policy: &IcPolicy) -> Result<Negotiated, PduError> {
    if req.pfv != 0 {
        return Err(field(8, "ICReq PFV is not 0"));
    }
    if req.hpda > PDA_MAX {
        return Err(field(10, "ICReq HPDA above 31"));
    }
    let resp = IcResp {
        pfv: 0,
        cpda: 0,
        hdgst_enable: req.hdgst_enable,
        ddgst_enable: req.ddgst_enable,
        maxh2cdata: policy.maxh2cdata,
    };
    Ok(Negotiated {
        resp,
        rx: Framing {
            hdgst: req.hdgst_enable,
            ddgst: req.ddgst_enable,
            pda: 0,
        },
        tx: Framing {
            hdgst: req.hdgst_enable,
            ddgst: req.ddgst_enable,
            pda: req.hpda,
        },
        max_r2t: u64::from(req.maxr2t) + 1,
    })
}

/// Why the Linux 6.1 host refuses an ICResp (`nvme_tcp_init_connection`, research note
/// §1.2; type and PLEN are the parser's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum IcRespRejected {
    /// "bad pfv returned".
    #[error("ICResp PFV {0} is not 0")]
    Pfv(u16),
    /// "data/header digest mismatch".
    #[error("ICResp digests differ from the ICReq's")]
    DigestMismatch,
    /// "unsupported cpda returned".
    #[error("ICResp CPDA {0} is not 0")]
    Cpda(u8),
    /// "invalid maxh2cdata returned".
    #[error("ICResp MAXH2CDATA {0} below 4096 or not a multiple of 4")]
    MaxH2cData(u32),
}

/// Check an ICResp against its ICReq as the Linux 6.1 host does (research note §1.2).
pub fn check_icresp(req: &IcReq, resp: &IcResp) -> Result<(), IcRespRejected> {
    if resp.pfv != 0 {
        return Err(IcRespRejected::Pfv(resp.pfv));
    }
    if resp.hdgst_enable != req.hdgst_enable || resp.ddgst_enable != req.ddgst_enable {
        return Err(IcRespRejected::DigestMismatch);
    }
    if resp.cpda != 0 {
        return Err(IcRespRejected::Cpda(resp.cpda));
    }
    if resp.maxh2cdata < MIN_MAXH2CDATA || !resp.maxh2cdata.is_multiple_of(4) {
        return Err(IcRespRejected::MaxH2cData(resp.maxh2cdata));
    }
    Ok(())
}

/// The controller's record of one outstanding R2T, to check each H2CData against it
/// (TCP 1.0 §3.3.2.2; research note §1.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct H2cExpect {
    /// The R2T sent.
    pub r2t: R2t,
    /// Bytes of it received so far.
    pub received: u32,
}

impl H2cExpect {
    /// Expect the data of `r2t`.
    pub fn new(r2t: R2t) -> Self {
        Self { r2t, received: 0 }
    }

    /// Check an H2CData header with `datal` data bytes and account for it. Returns
    /// whether the R2T's data is now complete. Errors (all fatal): TTAG or CCCID not the
    /// R2T's (Invalid PDU Header Field at 10 / 8), data outside R2TO..R2TO+R2TL (Data
    /// Transfer Out of Range at DATAO 12 or DATAL 16), DATAO not the next byte expected
    /// or LAST_PDU not on exactly the last PDU (PDU Sequence Error).
    pub fn accept(&mut self, hdr: &H2cDataHdr, datal: u32) -> Result<bool, PduError> {
        let r = self.r2t;
        if hdr.ttag != r.ttag {
            return Err(field(10, "TTAG of no outstanding R2T"));
        }
        if hdr.cccid != r.cccid {
            return Err(field(8, "CCCID differs from the R2T's"));
        }
        let end = u64::from(r.r2to) + u64::from(r.r2tl);
        if hdr.datao < r.r2to || u64::from(hdr.datao) >= end {
            return Err(PduError::DataOutOfRange {
                fei: 12,
                reason: "DATAO outside the R2T's range",
            });
        }
        if u64::from(hdr.datao) + u64::from(datal) > end {
            return Err(PduError::DataOutOfRange {
                fei: 16,
                reason: "data runs past the R2T's range",
            });
        }
        if hdr.datao - r.r2to != self.received {
            return Err(PduError::PduSequence {
                fei: 12,
                reason: "DATAO is not the next byte expected",
            });
        }
        self.received += datal;
        let complete = self.received == r.r2tl;
        if complete != hdr.last {
            return Err(PduError::PduSequence {
                fei: 1,
                reason: "LAST_PDU not on the last H2CData of the R2T",
            });
        }
        Ok(complete)
    }
}

#[cfg(test)]
mod tests;
