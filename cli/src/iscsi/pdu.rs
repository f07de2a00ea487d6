//! iSCSI PDU wire format (RFC 7143 §11): the 48-byte Basic Header Segment, the layout of a
//! whole PDU (AHS, digests, padding), CRC32C digests, and encoders for every PDU the target
//! sends. Pure: no I/O, never panics on input (every length is checked before use).
//!
//! Numbers on the wire are big-endian (§11.1), except the CRC32C digests, which iSCSI
//! carries in little-endian byte order (the order Linux, libiscsi and every target use,
//! RFC 7143 §13.1 / RFC 3385).

use thiserror::Error;

/// Bytes of the Basic Header Segment (§11.2.1).
pub const BHS_BYTES: usize = 48;
/// Bytes of a header or data digest (CRC32C).
pub const DIGEST_BYTES: usize = 4;
/// Largest AHS, bytes: `TotalAHSLength` is one byte counting 4-byte words (§11.2.1.2).
pub const MAX_AHS_BYTES: usize = 255 * 4;
/// The reserved "no tag" value of ITTs and TTTs (§11.2.1.8).
pub const RESERVED_TAG: u32 = 0xffff_ffff;

/// Initiator opcodes (§11.2.1.2).
pub mod op {
    /// NOP-Out.
    pub const NOP_OUT: u8 = 0x00;
    /// SCSI Command.
    pub const SCSI_CMD: u8 = 0x01;
    /// SCSI Task Management Function Request.
    pub const TMF_REQ: u8 = 0x02;
    /// Login Request.
    pub const LOGIN_REQ: u8 = 0x03;
    /// Text Request.
    pub const TEXT_REQ: u8 = 0x04;
    /// SCSI Data-Out.
    pub const DATA_OUT: u8 = 0x05;
    /// Logout Request.
    pub const LOGOUT_REQ: u8 = 0x06;
    /// SNACK Request.
    pub const SNACK: u8 = 0x10;
    /// NOP-In.
    pub const NOP_IN: u8 = 0x20;
    /// SCSI Response.
    pub const SCSI_RESP: u8 = 0x21;
    /// Task Management Function Response.
    pub const TMF_RESP: u8 = 0x22;
    /// Login Response.
    pub const LOGIN_RESP: u8 = 0x23;
    /// Text Response.
    pub const TEXT_RESP: u8 = 0x24;
    /// SCSI Data-In.
    pub const DATA_IN: u8 = 0x25;
    /// Logout Response.
    pub const LOGOUT_RESP: u8 = 0x26;
    /// Ready To Transfer.
    pub const R2T: u8 = 0x31;
    /// Reject.
    pub const REJECT: u8 = 0x3f;
}

/// Reject reasons (§11.17.1).
pub mod reject {
    /// Data (payload) digest error.
    pub const DATA_DIGEST: u8 = 0x02;
    /// Protocol error.
    pub const PROTOCOL_ERROR: u8 = 0x04;
    /// Command not supported.
    pub const NOT_SUPPORTED: u8 = 0x05;
    /// Invalid PDU field.
    pub const INVALID_FIELD: u8 = 0x09;
}

/// Why bytes are not a PDU this target can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PduError {
    /// Fewer than 48 bytes.
    #[error("short basic header segment")]
    Short,
    /// The data segment is longer than the receiver declared it accepts
    /// (MaxRecvDataSegmentLength, §13.12): a protocol error.
    #[error("data segment of {len} bytes exceeds MaxRecvDataSegmentLength {max}")]
    DataTooLong {
        /// Bytes the header announces.
        len: u32,
        /// Negotiated limit.
        max: u32,
    },
    /// The header digest does not match (§11.2.3): the header cannot be trusted.
    #[error("header digest mismatch")]
    HeaderDigest,
}

/// A parsed Basic Header Segment: the common fields plus the raw bytes for the
/// opcode-specific ones (read with the accessors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bhs {
    /// The 48 raw bytes.
    pub raw: [u8; BHS_BYTES],
}

impl Bhs {
    /// Takes the first 48 bytes of `b`.
    ///
    /// # Errors
    /// [`PduError::Short`] when `b` holds fewer than 48 bytes.
    pub fn parse(b: &[u8]) -> Result<Self, PduError> {
        let raw: [u8; BHS_BYTES] = b
            .get(..BHS_BYTES)
            .and_then(|s| s.try_into().ok())
            .ok_or(PduError::Short)?;
        Ok(Self { raw })
    }

    /// Opcode (6 bits).
    pub fn opcode(&self) -> u8 {
        self.raw[0] & 0x3f
    }
    /// The immediate-delivery bit (§11.2.1.1).
    pub fn immediate(&self) -> bool {
        self.raw[0] & 0x40 != 0
    }
    /// Byte 1: the final bit and opcode-specific flags.
    pub fn flags(&self) -> u8 {
        self.raw[1]
    }
    /// The final (F) bit.
    pub fn final_bit(&self) -> bool {
        self.raw[1] & 0x80 != 0
    }
    /// AHS length, bytes.
    pub fn ahs_bytes(&self) -> usize {
        usize::from(self.raw[4]) * 4
    }
    /// DataSegmentLength, bytes (without padding).
    pub fn data_len(&self) -> u32 {
        u32::from_be_bytes([0, self.raw[5], self.raw[6], self.raw[7]])
    }
    /// Bytes 8..16: the LUN field (or ISID+TSIH in a login).
    pub fn lun_raw(&self) -> u64 {
        self.u64_at(8)
    }
    /// Initiator Task Tag.
    pub fn itt(&self) -> u32 {
        self.u32_at(16)
    }
    /// A big-endian u32 at `at` (≤ 44).
    pub fn u32_at(&self, at: usize) -> u32 {
        u32::from_be_bytes(self.raw[at..at + 4].try_into().expect("4 bytes"))
    }
    /// A big-endian u64 at `at` (≤ 40).
    pub fn u64_at(&self, at: usize) -> u64 {
        u64::from_be_bytes(self.raw[at..at + 8].try_into().expect("8 bytes"))
    }
    /// The 16-byte CDB of a SCSI Command (bytes 32..48).
    pub fn cdb(&self) -> &[u8; 16] {
        self.raw[32..48].try_into().expect("16 bytes")
    }

    /// Bytes of the whole PDU on the wire: BHS, AHS, header digest, data segment padded to 4
    /// bytes, data digest (digests only when data is present, §11.1).
    pub fn wire_bytes(&self, header_digest: bool, data_digest: bool) -> usize {
        let d = self.data_len() as usize;
        BHS_BYTES
            + self.ahs_bytes()
            + if header_digest { DIGEST_BYTES } else { 0 }
            + pad4(d)
            + if data_digest && d > 0 {
                DIGEST_BYTES
            } else {
                0
            }
    }
}

/// `n` rounded up to a multiple of 4 (data segments are padded, §11.1).
pub fn pad4(n: usize) -> usize {
    (n + 3) & !3
}

/// CRC32C (Castagnoli) of `b`, as iSCSI digests use it.
pub fn crc32c(b: &[u8]) -> u32 {
    engine::checksum::crc32c(b)
}

/// A received PDU split into its parts (borrowed from the receive buffer).
#[derive(Debug)]
pub struct Pdu<'a> {
    /// The header.
    pub bhs: Bhs,
    /// The data segment (without padding).
    pub data: &'a [u8],
    /// Whether the data digest matched (true when data digests are off or no data).
    pub data_digest_ok: bool,
}

/// Digest settings and the receive limit of one connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Framing {
    /// HeaderDigest=CRC32C.
    pub header_digest: bool,
    /// DataDigest=CRC32C.
    pub data_digest: bool,
    /// The MaxRecvDataSegmentLength this side declared, bytes.
    pub max_recv_data: u32,
}

impl Framing {
    /// Largest PDU this framing accepts, bytes.
    pub fn max_pdu_bytes(&self) -> usize {
        BHS_BYTES + MAX_AHS_BYTES + 2 * DIGEST_BYTES + pad4(self.max_recv_data as usize)
    }

    /// Bytes of the header part (BHS, AHS, header digest) of the PDU at the front of `buf`:
    /// [`BHS_BYTES`] while the BHS itself is incomplete (the AHS length is not known yet).
    /// What a receiver reads even with no payload budget left: a PDU without a data
    /// segment is whole once its header is.
    pub fn header_bytes(&self, buf: &[u8]) -> usize {
        match Bhs::parse(buf) {
            Ok(bhs) => {
                BHS_BYTES + bhs.ahs_bytes() + if self.header_digest { DIGEST_BYTES } else { 0 }
            }
            Err(_) => BHS_BYTES,
        }
    }

    /// Judges the header at the front of `buf`: `Ok(None)` when more bytes are needed to
    /// know the PDU's length or to hold all of it, `Ok(Some(len))` when a whole PDU of `len`
    /// bytes is buffered.
    ///
    /// # Errors
    /// A data segment over `max_recv_data`, a header digest mismatch: the connection cannot
    /// go on (ERL 0 drops it).
    pub fn frame(&self, buf: &[u8]) -> Result<Option<usize>, PduError> {
        let Ok(bhs) = Bhs::parse(buf) else {
            return Ok(None);
        };
        if bhs.data_len() > self.max_recv_data {
            return Err(PduError::DataTooLong {
                len: bhs.data_len(),
                max: self.max_recv_data,
            });
        }
        if self.header_digest {
            let hl = BHS_BYTES + bhs.ahs_bytes();
            let Some(d) = buf.get(hl..hl + DIGEST_BYTES) else {
                return Ok(None);
            };
            let got = u32::from_le_bytes(d.try_into().expect("4 bytes"));
            if got != crc32c(&buf[..hl]) {
                return Err(PduError::HeaderDigest);
            }
        }
        let n = bhs.wire_bytes(self.header_digest, self.data_digest);
        Ok((buf.len() >= n).then_some(n))
    }

    /// Splits a whole PDU (as [`Framing::frame`] measured it) into its parts.
    ///
    /// # Errors
    /// [`PduError::Short`] if `buf` is shorter than the PDU it announces.
    pub fn split<'a>(&self, buf: &'a [u8]) -> Result<Pdu<'a>, PduError> {
        let bhs = Bhs::parse(buf)?;
        let mut at = BHS_BYTES + bhs.ahs_bytes();
        if self.header_digest {
            at += DIGEST_BYTES;
        }
        let d = bhs.data_len() as usize;
        let data = buf.get(at..at + d).ok_or(PduError::Short)?;
        let mut ok = true;
        if self.data_digest && d > 0 {
            let padded = buf.get(at..at + pad4(d)).ok_or(PduError::Short)?;
            let dg = buf
                .get(at + pad4(d)..at + pad4(d) + DIGEST_BYTES)
                .ok_or(PduError::Short)?;
            ok = u32::from_le_bytes(dg.try_into().expect("4 bytes")) == crc32c(padded);
        }
        Ok(Pdu {
            bhs,
            data,
            data_digest_ok: ok,
        })
    }
}

/// Builds a 48-byte header: opcode byte, flags byte, data length and ITT set; everything
/// else zero for the caller to fill with the `put_*` helpers.
#[derive(Clone, Copy, Debug)]
pub struct Header(pub [u8; BHS_BYTES]);

impl Header {
    /// A header for `opcode` with `flags` in byte 1, `data_len` bytes of data, tag `itt`.
    pub fn new(opcode: u8, flags: u8, data_len: u32, itt: u32) -> Self {
        debug_assert!(data_len < 1 << 24);
        let mut h = [0u8; BHS_BYTES];
        h[0] = opcode;
        h[1] = flags;
        h[5..8].copy_from_slice(&data_len.to_be_bytes()[1..]);
        h[16..20].copy_from_slice(&itt.to_be_bytes());
        Self(h)
    }
    /// Sets byte `at`.
    pub fn byte(mut self, at: usize, v: u8) -> Self {
        self.0[at] = v;
        self
    }
    /// Sets a big-endian u32 at `at`.
    pub fn u32(mut self, at: usize, v: u32) -> Self {
        self.0[at..at + 4].copy_from_slice(&v.to_be_bytes());
        self
    }
    /// Sets a big-endian u16 at `at`.
    pub fn u16(mut self, at: usize, v: u16) -> Self {
        self.0[at..at + 2].copy_from_slice(&v.to_be_bytes());
        self
    }
    /// Sets a big-endian u64 at `at`.
    pub fn u64(mut self, at: usize, v: u64) -> Self {
        self.0[at..at + 8].copy_from_slice(&v.to_be_bytes());
        self
    }
    /// Copies `b` to `at`.
    pub fn bytes(mut self, at: usize, b: &[u8]) -> Self {
        self.0[at..at + b.len()].copy_from_slice(b);
        self
    }
}

/// Serial number arithmetic (RFC 1982, 32 bits) as §4.2.2.1 asks for CmdSN and StatSN:
/// whether `a` < `b`.
pub fn sn_lt(a: u32, b: u32) -> bool {
    a != b && (b.wrapping_sub(a) as i32) > 0
}

/// Serial-number `a` ≤ `b`.
pub fn sn_le(a: u32, b: u32) -> bool {
    a == b || sn_lt(a, b)
}

/// Appends a whole PDU (header, header digest, data, padding, data digest) to `out`, which
/// must have room for [`pdu_bytes`]`(data.len(), ..)` more bytes. Returns bytes written.
pub fn write_pdu(out: &mut [u8], h: &Header, data: &[u8], f: &Framing) -> usize {
    let mut at = 0;
    out[..BHS_BYTES].copy_from_slice(&h.0);
    at += BHS_BYTES;
    if f.header_digest {
        out[at..at + 4].copy_from_slice(&crc32c(&h.0).to_le_bytes());
        at += 4;
    }
    if !data.is_empty() {
        out[at..at + data.len()].copy_from_slice(data);
        let padded = pad4(data.len());
        out[at + data.len()..at + padded].fill(0);
        if f.data_digest {
            let c = crc32c(&out[at..at + padded]);
            out[at + padded..at + padded + 4].copy_from_slice(&c.to_le_bytes());
            at += 4;
        }
        at += padded;
    }
    at
}

/// Bytes [`write_pdu`] writes for `data_len` bytes of data.
pub fn pdu_bytes(data_len: usize, f: &Framing) -> usize {
    BHS_BYTES
        + if f.header_digest { 4 } else { 0 }
        + pad4(data_len)
        + if f.data_digest && data_len > 0 { 4 } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_rfc3720_vectors() {
        // RFC 3720 B.4: 32 bytes of zeroes, of ones, ascending.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        let asc: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&asc), 0x46dd_794e);
    }

    #[test]
    fn framing_round_trip_with_digests() {
        let f = Framing {
            header_digest: true,
            data_digest: true,
            max_recv_data: 8192,
        };
        let h = Header::new(op::NOP_IN, 0x80, 5, 7);
        let mut buf = vec![0u8; pdu_bytes(5, &f)];
        let n = write_pdu(&mut buf, &h, b"hello", &f);
        assert_eq!(n, 48 + 4 + 8 + 4);
        assert_eq!(f.frame(&buf[..n - 1]), Ok(None));
        assert_eq!(f.frame(&buf), Ok(Some(n)));
        let p = f.split(&buf).unwrap();
        assert_eq!(p.data, b"hello");
        assert!(p.data_digest_ok);
        assert_eq!(p.bhs.itt(), 7);
        // A flipped data byte: digest mismatch, still framed.
        buf[53] ^= 1;
        assert!(!f.split(&buf).unwrap().data_digest_ok);
        // A flipped header byte: header digest mismatch.
        buf[20] ^= 1;
        assert_eq!(f.frame(&buf), Err(PduError::HeaderDigest));
    }

    #[test]
    fn oversized_data_segment_is_refused() {
        let f = Framing {
            header_digest: false,
            data_digest: false,
            max_recv_data: 8192,
        };
        let h = Header::new(op::SCSI_CMD, 0x80, 8193, 1);
        assert!(matches!(f.frame(&h.0), Err(PduError::DataTooLong { .. })));
    }

    #[test]
    fn serial_numbers_wrap() {
        assert!(sn_lt(1, 2));
        assert!(sn_lt(u32::MAX, 0));
        assert!(!sn_lt(0, u32::MAX));
        assert!(sn_le(5, 5));
    }
}
