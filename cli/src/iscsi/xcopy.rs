//! EXTENDED COPY (LID1) and RECEIVE COPY RESULTS (SPC-4 §6.4 and §6.18): the copy manager
//! of LUN 0, for copies inside that LUN. Pure: CDB decoding, the parameter-list parser, the
//! copy's step planner, and the data-in pages; the front-end
//! ([`super::frontend`]) runs the steps through the array and keeps the per-session state
//! ([`Held`]).
//!
//! # What is supported
//! - CSCD descriptors (SPC-4 §6.4.5): only the identification descriptor (type E4h) of a
//!   block device (peripheral device type 0) whose designator is the NAA designator
//!   INQUIRY page 83h reports for this LUN ([`super::scsi::LunInfo::naa`]), with the LUN's
//!   block length. Another designator names a logical unit this copy manager cannot reach:
//!   a segment using it ends the command with COPY ABORTED / UNREACHABLE COPY TARGET. LU
//!   ID TYPE, NUL (obsolete in SPC-4) and RELATIVE INITIATOR PORT IDENTIFIER are ignored.
//! - Segment descriptors (SPC-4 §6.4.6): only block device to block device (02h). Other
//!   types: ILLEGAL REQUEST / UNSUPPORTED SEGMENT DESCRIPTOR TYPE CODE. No inline or
//!   embedded data, no held data (RECEIVE DATA is not supported).
//! - Limits: [`MAX_CSCD_DESCRIPTORS`], [`MAX_SEGMENT_DESCRIPTORS`],
//!   [`MAX_DESCRIPTOR_LIST_BYTES`], [`MAX_SEGMENT_BYTES`], as OPERATING PARAMETERS
//!   reports them.
//! - Every segment is checked before the first block moves, so a bad list changes nothing.
//!   A range past the end of the LUN: COPY ABORTED with no additional sense code (SPC-4
//!   §6.4.3 leaves the code to the copy manager; LOGICAL BLOCK ADDRESS OUT OF RANGE would
//!   claim an ILLEGAL REQUEST, which the command as a whole is not).
//! - Overlapping source and destination ranges are copied in the safe direction: back to
//!   front when the destination starts inside the source range, front to back otherwise,
//!   so the result equals a copy through an infinite buffer.
//!
//! Units: LBAs and block counts in logical blocks; byte counts say so.

use super::scsi::{LunInfo, Plan, Sense};

/// EXTENDED COPY operation code (SPC-4 §6.4.1).
pub const OPC_EXTENDED_COPY: u8 = 0x83;
/// RECEIVE COPY RESULTS operation code (SPC-4 §6.18.1).
pub const OPC_RECEIVE_COPY_RESULTS: u8 = 0x84;
/// EXTENDED COPY service action LID1 (SPC-4 §6.4.1).
pub const SA_LID1: u8 = 0x00;
/// RECEIVE COPY RESULTS service action COPY STATUS (SPC-4 §6.18.3).
pub const SA_COPY_STATUS: u8 = 0x00;
/// RECEIVE COPY RESULTS service action OPERATING PARAMETERS (SPC-4 §6.18.4).
pub const SA_OPERATING_PARAMETERS: u8 = 0x03;

/// Most CSCD (target) descriptors in one parameter list.
pub const MAX_CSCD_DESCRIPTORS: u16 = 4;
/// Most segment descriptors in one parameter list.
pub const MAX_SEGMENT_DESCRIPTORS: u16 = 16;
/// Most bytes of CSCD and segment descriptors together in one parameter list.
pub const MAX_DESCRIPTOR_LIST_BYTES: u32 = 1024;
/// Most bytes one segment copies (also at most 65535 blocks: the descriptor's field).
pub const MAX_SEGMENT_BYTES: u32 = 64 << 20;
/// Longest parameter list accepted, bytes: the header, the descriptor lists and room for
/// trailing bytes; anything longer is refused with PARAMETER LIST LENGTH ERROR before its
/// data is transferred.
pub const MAX_PARAM_BYTES: u32 = 4096;
/// Most EXTENDED COPY commands one I_T nexus may have in progress at once.
pub const MAX_CONCURRENT_COPIES: u8 = 8;
/// Completed copies whose status one I_T nexus holds for COPY STATUS (the oldest is
/// discarded first, SPC-4 §6.18.3 d).
pub const HELD_RESULTS: usize = 4;

/// Parameter list header bytes (SPC-4 §6.4.3, table "EXTENDED COPY(LID1) parameter list").
pub const HEADER_BYTES: usize = 16;
/// Identification CSCD descriptor bytes (SPC-4 §6.4.5.2).
pub const CSCD_BYTES: usize = 32;
/// Block device to block device segment descriptor bytes (SPC-4 §6.4.6.5).
pub const B2B_SEGMENT_BYTES: usize = 28;
/// Identification descriptor CSCD descriptor type code.
pub const CSCD_IDENTIFICATION: u8 = 0xe4;
/// Block device to block device segment descriptor type code.
pub const SEG_BLOCK_TO_BLOCK: u8 = 0x02;

const fn sense(key: u8, asc: u8, ascq: u8) -> Sense {
    Sense {
        key,
        asc,
        ascq,
        info: None,
        field: None,
    }
}

/// Sense data of the copy manager (SPC-4 §4.4, ASC/ASCQ assignments).
pub mod senses {
    use super::{sense, Sense};
    /// ILLEGAL REQUEST / TOO MANY TARGET DESCRIPTORS (26h/06h).
    pub const TOO_MANY_CSCD: Sense = sense(0x05, 0x26, 0x06);
    /// ILLEGAL REQUEST / UNSUPPORTED TARGET DESCRIPTOR TYPE CODE (26h/07h).
    pub const UNSUPPORTED_CSCD: Sense = sense(0x05, 0x26, 0x07);
    /// ILLEGAL REQUEST / TOO MANY SEGMENT DESCRIPTORS (26h/08h).
    pub const TOO_MANY_SEGMENTS: Sense = sense(0x05, 0x26, 0x08);
    /// ILLEGAL REQUEST / UNSUPPORTED SEGMENT DESCRIPTOR TYPE CODE (26h/09h).
    pub const UNSUPPORTED_SEGMENT: Sense = sense(0x05, 0x26, 0x09);
    /// ILLEGAL REQUEST / INLINE DATA LENGTH EXCEEDED (26h/0Bh).
    pub const INLINE_TOO_LONG: Sense = sense(0x05, 0x26, 0x0b);
    /// ILLEGAL REQUEST / OPERATION IN PROGRESS (00h/16h): the list identifier is in use.
    pub const OPERATION_IN_PROGRESS: Sense = sense(0x05, 0x00, 0x16);
    /// ILLEGAL REQUEST / INSUFFICIENT RESOURCES (55h/03h): too many copies in progress.
    pub const INSUFFICIENT_RESOURCES: Sense = sense(0x05, 0x55, 0x03);
    /// COPY ABORTED / UNREACHABLE COPY TARGET (08h/04h).
    pub const UNREACHABLE: Sense = sense(0x0a, 0x08, 0x04);
    /// COPY ABORTED / NO ADDITIONAL SENSE INFORMATION: a segment's range lies past the end
    /// of the LUN.
    pub const COPY_ABORTED: Sense = sense(0x0a, 0x00, 0x00);
}

fn be16(b: &[u8]) -> u32 {
    u32::from(u16::from_be_bytes([b[0], b[1]]))
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

/// Decodes an EXTENDED COPY CDB (SPC-4 §6.4.1): [`Plan::ExtendedCopy`] with the parameter
/// list length, GOOD for an empty list.
///
/// # Errors
/// INVALID FIELD IN CDB for a service action other than LID1; PARAMETER LIST LENGTH ERROR
/// for a list longer than [`MAX_PARAM_BYTES`].
pub fn decode_extended_copy(c: &[u8; 16]) -> Result<Plan, Sense> {
    if c[1] & 0x1f != SA_LID1 {
        return Err(Sense::INVALID_FIELD_CDB);
    }
    let param_bytes = be32(&c[10..14]);
    if param_bytes == 0 {
        // "shall not be considered an error" (SPC-4 §6.4.1).
        return Ok(Plan::Good);
    }
    if param_bytes > MAX_PARAM_BYTES {
        return Err(Sense::PARAM_LIST_LENGTH);
    }
    Ok(Plan::ExtendedCopy { param_bytes })
}

/// Decodes a RECEIVE COPY RESULTS CDB (SPC-4 §6.18.1): OPERATING PARAMETERS is written
/// into `out` at once ([`Plan::Data`]); COPY STATUS needs the session's state
/// ([`Plan::CopyStatus`]).
///
/// # Errors
/// INVALID FIELD IN CDB for another service action (RECEIVE DATA: no data is ever held;
/// FAILED SEGMENT DETAILS: not kept).
pub fn decode_receive_copy_results(
    c: &[u8; 16],
    lun: &LunInfo,
    out: &mut [u8],
) -> Result<Plan, Sense> {
    let alloc = be32(&c[10..14]);
    match c[1] & 0x1f {
        SA_COPY_STATUS => {
            if alloc == 0 {
                return Ok(Plan::Good);
            }
            Ok(Plan::CopyStatus {
                list_id: c[2],
                alloc,
            })
        }
        SA_OPERATING_PARAMETERS => {
            let n = operating_parameters(lun, out);
            Ok(Plan::Data {
                len: alloc.min(n as u32),
            })
        }
        _ => Err(Sense::INVALID_FIELD_CDB),
    }
}

/// Writes the OPERATING PARAMETERS data (SPC-4 §6.18.4) into `out` (at least 46 bytes);
/// returns its length in bytes.
pub fn operating_parameters(lun: &LunInfo, out: &mut [u8]) -> usize {
    const CODES: [u8; 2] = [SEG_BLOCK_TO_BLOCK, CSCD_IDENTIFICATION];
    let n = 44 + CODES.len();
    let d = &mut out[..n];
    d.fill(0);
    d[0..4].copy_from_slice(&((n - 4) as u32).to_be_bytes());
    d[4] = 0x01; // SNLID: LIST ID USAGE 11b (no list identifier) is supported.
    d[8..10].copy_from_slice(&MAX_CSCD_DESCRIPTORS.to_be_bytes());
    d[10..12].copy_from_slice(&MAX_SEGMENT_DESCRIPTORS.to_be_bytes());
    d[12..16].copy_from_slice(&MAX_DESCRIPTOR_LIST_BYTES.to_be_bytes());
    d[16..20].copy_from_slice(&max_segment_bytes(lun).to_be_bytes());
    // MAXIMUM INLINE DATA LENGTH, HELD DATA LIMIT, MAXIMUM STREAM DEVICE TRANSFER SIZE: 0.
    d[34..36].copy_from_slice(&u16::from(MAX_CONCURRENT_COPIES).to_be_bytes());
    d[36] = MAX_CONCURRENT_COPIES;
    // DATA SEGMENT GRANULARITY: log2 of the block size (whole blocks only).
    d[37] = lun.block_bytes.max(1).trailing_zeros() as u8;
    d[43] = CODES.len() as u8;
    d[44..n].copy_from_slice(&CODES);
    n
}

/// Writes the body of the Third-party Copy VPD page (SPC-4 §7.8.17, page code 8Fh, after
/// its 4-byte header) into `out` (at least 64 bytes); returns its length in bytes. Three
/// third-party copy descriptors: Supported Commands (0001h: EXTENDED COPY LID1, RECEIVE
/// COPY RESULTS COPY STATUS and OPERATING PARAMETERS), Parameter Data (0008h: the LID1
/// limits, as OPERATING PARAMETERS reports them) and Supported Descriptors (0009h).
pub fn third_party_copy_vpd(out: &mut [u8]) -> usize {
    let mut at = 0;
    // Supported Commands: the list, then padding to a multiple of 4 bytes.
    let cmds: [u8; 7] = [
        OPC_EXTENDED_COPY,
        1,
        SA_LID1,
        OPC_RECEIVE_COPY_RESULTS,
        2,
        SA_COPY_STATUS,
        SA_OPERATING_PARAMETERS,
    ];
    let len = (1 + cmds.len()).div_ceil(4) * 4;
    let d = &mut out[at..at + 4 + len];
    d.fill(0);
    d[0..2].copy_from_slice(&0x0001u16.to_be_bytes());
    d[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    d[4] = cmds.len() as u8;
    d[5..5 + cmds.len()].copy_from_slice(&cmds);
    at += 4 + len;
    // Parameter Data.
    let d = &mut out[at..at + 32];
    d.fill(0);
    d[0..2].copy_from_slice(&0x0008u16.to_be_bytes());
    d[2..4].copy_from_slice(&28u16.to_be_bytes());
    d[8..10].copy_from_slice(&MAX_CSCD_DESCRIPTORS.to_be_bytes());
    d[10..12].copy_from_slice(&MAX_SEGMENT_DESCRIPTORS.to_be_bytes());
    d[12..16].copy_from_slice(&MAX_DESCRIPTOR_LIST_BYTES.to_be_bytes());
    // MAXIMUM INLINE DATA LENGTH: 0.
    at += 32;
    // Supported Descriptors.
    let codes = [SEG_BLOCK_TO_BLOCK, CSCD_IDENTIFICATION];
    let len = (1 + codes.len()).div_ceil(4) * 4;
    let d = &mut out[at..at + 4 + len];
    d.fill(0);
    d[0..2].copy_from_slice(&0x0009u16.to_be_bytes());
    d[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    d[4] = codes.len() as u8;
    d[5..5 + codes.len()].copy_from_slice(&codes);
    at += 4 + len;
    at
}

/// Byte offset of a copy's work area in its task buffer: after the parameter list of
/// `param_bytes`, aligned to 4096 bytes and to the block size `block_bytes` (a power of
/// two), as array requests need.
pub fn work_offset(param_bytes: u32, block_bytes: u32) -> u32 {
    let align = block_bytes.max(4096);
    param_bytes.div_ceil(align) * align
}

/// Most bytes one segment may copy on `lun`: [`MAX_SEGMENT_BYTES`] and 65535 blocks, in
/// whole blocks.
pub fn max_segment_bytes(lun: &LunInfo) -> u32 {
    let bs = u64::from(lun.block_bytes.max(1));
    let blocks = (u64::from(MAX_SEGMENT_BYTES) / bs).min(0xffff);
    (blocks * bs) as u32
}

/// LIST ID USAGE (SPC-4 §6.4.3, table "LIST ID USAGE field").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListIdUsage {
    /// 00b: hold the status for RECEIVE COPY RESULTS; the identifier is unique.
    Hold,
    /// 10b: nothing held; the identifier is unique while the copy runs.
    NoHold,
    /// 11b: no list identifier (it must be zero); nothing held.
    None,
}

/// The parameter list header fields the copy manager acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// LIST IDENTIFIER.
    pub list_id: u8,
    /// LIST ID USAGE.
    pub usage: ListIdUsage,
}

/// A block device to block device segment (SPC-4 §6.4.6.5), within this LUN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First source block.
    pub src: u64,
    /// First destination block.
    pub dst: u64,
    /// Blocks to copy.
    pub blocks: u32,
}

impl Segment {
    /// Whether the copy must run back to front: the destination starts inside the source
    /// range (front to back would overwrite source blocks not yet read).
    pub fn backwards(&self) -> bool {
        self.dst > self.src && self.dst < self.src + u64::from(self.blocks)
    }
}

/// A parameter list [`parse`] accepted: where its segments are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamList {
    /// The header.
    pub header: Header,
    /// Segment descriptors (all block to block, [`B2B_SEGMENT_BYTES`] each).
    pub segments: u16,
    /// Byte offset of the first segment descriptor.
    pub segments_at: usize,
}

impl ParamList {
    /// The layout of a list [`parse`] accepted, read again without checks (the front-end
    /// keeps the list in the task buffer, not the parse).
    pub fn of_checked(data: &[u8]) -> ParamList {
        let cscd_bytes = be16(&data[2..4]) as usize;
        let seg_bytes = be32(&data[8..12]) as usize;
        ParamList {
            header: header_fields(data).unwrap_or(Header {
                list_id: 0,
                usage: ListIdUsage::None,
            }),
            segments: (seg_bytes / B2B_SEGMENT_BYTES) as u16,
            segments_at: HEADER_BYTES + cscd_bytes,
        }
    }

    /// Segment `i` (below [`ParamList::segments`]) of `data`.
    pub fn segment(&self, data: &[u8], i: u16) -> Segment {
        let d = &data[self.segments_at + usize::from(i) * B2B_SEGMENT_BYTES..];
        Segment {
            blocks: be16(&d[10..12]),
            src: be64(&d[12..20]),
            dst: be64(&d[20..28]),
        }
    }

    /// Blocks all segments copy.
    pub fn total_blocks(&self, data: &[u8]) -> u64 {
        (0..self.segments)
            .map(|i| u64::from(self.segment(data, i).blocks))
            .sum()
    }

    /// Blocks written by a copy at `cur`: the segments before it and the part of its own
    /// done.
    pub fn blocks_done(&self, data: &[u8], cur: Cursor) -> u64 {
        (0..cur.seg.min(self.segments))
            .map(|i| u64::from(self.segment(data, i).blocks))
            .sum::<u64>()
            + u64::from(cur.done)
    }
}

fn header_fields(data: &[u8]) -> Result<Header, Sense> {
    let list_id = data[0];
    let usage = match (data[1] >> 3) & 0x03 {
        0 => ListIdUsage::Hold,
        2 => ListIdUsage::NoHold,
        3 => ListIdUsage::None,
        _ => return Err(Sense::INVALID_FIELD_PARAM),
    };
    if usage == ListIdUsage::None && list_id != 0 {
        return Err(Sense::INVALID_FIELD_PARAM);
    }
    Ok(Header { list_id, usage })
}

/// Whether the designation descriptor `d` (SPC-4 §7.8.6.1: code set, association and
/// type, reserved, length, designator) names `lun`: the binary NAA designator associated
/// with the logical unit, as INQUIRY page 83h reports it.
fn names_this_lun(d: &[u8], lun: &LunInfo) -> bool {
    let naa = lun.naa();
    let code_set = d[0] & 0x0f;
    let association = (d[1] >> 4) & 0x03;
    let kind = d[1] & 0x0f;
    let len = usize::from(d[3]);
    code_set == 0x01
        && association == 0
        && kind == 0x03
        && len == naa.len()
        && d.len() >= 4 + len
        && d[4..4 + len] == naa
}

/// Parses and checks an EXTENDED COPY(LID1) parameter list (SPC-4 §6.4.3) for `lun`: the
/// header, every CSCD descriptor and every segment descriptor, including each segment's
/// range. Nothing is copied before this accepts the list.
///
/// Checks in order: length of the header; LIST ID USAGE; descriptor lists against
/// [`MAX_DESCRIPTOR_LIST_BYTES`] and inline data (none supported); the lists against the
/// parameter list length; the CSCD count and each CSCD descriptor; each segment.
///
/// # Errors
/// The sense to answer: PARAMETER LIST LENGTH ERROR (truncated lists, descriptor lists too
/// long), INVALID FIELD IN PARAMETER LIST (reserved LIST ID USAGE, a list identifier with
/// 11b, a wrong descriptor length or block length, a segment too long), INLINE DATA
/// LENGTH EXCEEDED, TOO MANY TARGET/SEGMENT DESCRIPTORS, UNSUPPORTED TARGET/SEGMENT
/// DESCRIPTOR TYPE CODE, COPY ABORTED / UNREACHABLE COPY TARGET (an index past the CSCD
/// list, or a CSCD naming another logical unit), COPY ABORTED (a range past the end).
pub fn parse(data: &[u8], lun: &LunInfo) -> Result<ParamList, Sense> {
    if data.len() < HEADER_BYTES {
        return Err(Sense::PARAM_LIST_LENGTH);
    }
    let header = header_fields(data)?;
    let cscd_bytes = be16(&data[2..4]) as usize;
    let seg_bytes = be32(&data[8..12]) as usize;
    let inline_bytes = be32(&data[12..16]) as usize;
    if cscd_bytes + seg_bytes > MAX_DESCRIPTOR_LIST_BYTES as usize {
        return Err(Sense::PARAM_LIST_LENGTH);
    }
    if inline_bytes > 0 {
        // MAXIMUM INLINE DATA LENGTH is 0.
        return Err(senses::INLINE_TOO_LONG);
    }
    if HEADER_BYTES + cscd_bytes + seg_bytes > data.len() {
        return Err(Sense::PARAM_LIST_LENGTH);
    }
    // CSCD descriptors: all of one length; more than the limit is refused before any is
    // looked at.
    if cscd_bytes.div_ceil(CSCD_BYTES) > usize::from(MAX_CSCD_DESCRIPTORS) {
        return Err(senses::TOO_MANY_CSCD);
    }
    let cscd = &data[HEADER_BYTES..HEADER_BYTES + cscd_bytes];
    // Bit i: CSCD descriptor i names this LUN.
    let mut reachable: u32 = 0;
    let mut count: u16 = 0;
    for (i, d) in cscd.chunks(CSCD_BYTES).enumerate() {
        if d[0] != CSCD_IDENTIFICATION {
            return Err(senses::UNSUPPORTED_CSCD);
        }
        if d.len() < CSCD_BYTES {
            return Err(Sense::PARAM_LIST_LENGTH);
        }
        if d[1] & 0x1f != 0 {
            // Only block devices (peripheral device type 0).
            return Err(senses::UNSUPPORTED_CSCD);
        }
        if names_this_lun(&d[4..24], lun) {
            // Block device type specific parameters: DISK BLOCK LENGTH must be ours.
            if be32(&d[28..32]) & 0x00ff_ffff != lun.block_bytes {
                return Err(Sense::INVALID_FIELD_PARAM);
            }
            reachable |= 1 << i;
        }
        count += 1;
    }
    // Segment descriptors.
    let segments_at = HEADER_BYTES + cscd_bytes;
    let segs = &data[segments_at..segments_at + seg_bytes];
    let mut at = 0;
    let mut n: u16 = 0;
    let max_bytes = u64::from(max_segment_bytes(lun));
    let bs = u64::from(lun.block_bytes);
    while at < segs.len() {
        if n == MAX_SEGMENT_DESCRIPTORS {
            return Err(senses::TOO_MANY_SEGMENTS);
        }
        if segs.len() - at < 4 {
            return Err(Sense::PARAM_LIST_LENGTH);
        }
        let d = &segs[at..];
        if d[0] != SEG_BLOCK_TO_BLOCK {
            return Err(senses::UNSUPPORTED_SEGMENT);
        }
        if be16(&d[2..4]) as usize + 4 != B2B_SEGMENT_BYTES {
            return Err(Sense::INVALID_FIELD_PARAM);
        }
        if d.len() < B2B_SEGMENT_BYTES {
            return Err(Sense::PARAM_LIST_LENGTH);
        }
        for index in [be16(&d[4..6]), be16(&d[6..8])] {
            if index >= u32::from(count) || reachable & (1 << index) == 0 {
                return Err(senses::UNREACHABLE);
            }
        }
        let blocks = u64::from(be16(&d[10..12]));
        if blocks * bs > max_bytes {
            return Err(Sense::INVALID_FIELD_PARAM);
        }
        for lba in [be64(&d[12..20]), be64(&d[20..28])] {
            if lba > lun.blocks || blocks > lun.blocks - lba {
                return Err(senses::COPY_ABORTED);
            }
        }
        at += B2B_SEGMENT_BYTES;
        n += 1;
    }
    Ok(ParamList {
        header,
        segments: n,
        segments_at,
    })
}

/// Where a running copy is, packed into the task's `step` word by [`Cursor::pack`]:
/// segment, blocks of it done, the piece in flight (blocks) and whether that piece was
/// read and waits to be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    /// Segment index.
    pub seg: u16,
    /// Blocks of the segment copied.
    pub done: u32,
    /// Blocks of the piece in flight.
    pub piece: u32,
    /// The piece was read into the buffer; its write is next.
    pub writing: bool,
}

const STARTED: u64 = 1 << 63;
const FIELD: u64 = (1 << 20) - 1;

impl Cursor {
    /// The cursor of a copy that has just started.
    pub const START: Cursor = Cursor {
        seg: 0,
        done: 0,
        piece: 0,
        writing: false,
    };

    /// Packs into a step word (never 0: 0 is "not started").
    pub fn pack(self) -> u64 {
        STARTED
            | (u64::from(self.seg) << 41)
            | ((u64::from(self.done) & FIELD) << 21)
            | ((u64::from(self.piece) & FIELD) << 1)
            | u64::from(self.writing)
    }

    /// Unpacks a step word; `None` before the copy started (the list not yet checked).
    pub fn unpack(step: u64) -> Option<Cursor> {
        if step & STARTED == 0 {
            return None;
        }
        Some(Cursor {
            seg: ((step >> 41) & 0xffff) as u16,
            done: ((step >> 21) & FIELD) as u32,
            piece: ((step >> 1) & FIELD) as u32,
            writing: step & 1 != 0,
        })
    }

    /// The cursor after the array completed the step [`next_step`] planned.
    pub fn completed(self) -> Cursor {
        if self.writing {
            Cursor {
                done: self.done + self.piece,
                piece: 0,
                writing: false,
                ..self
            }
        } else {
            Cursor {
                writing: true,
                ..self
            }
        }
    }
}

/// One array request of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Read `blocks` at `lba` into the task buffer's work area.
    Read {
        /// First block.
        lba: u64,
        /// Blocks.
        blocks: u32,
    },
    /// Write `blocks` at `lba` from the work area.
    Write {
        /// First block.
        lba: u64,
        /// Blocks.
        blocks: u32,
    },
    /// Every segment is copied.
    Done,
}

/// Plans the next array request of a copy of `list` (in `data`) at `cur`, in pieces of at
/// most `per` blocks (the work area). Returns the request and the cursor to keep while it
/// runs. Zero-block segments are skipped.
pub fn next_step(list: &ParamList, data: &[u8], cur: Cursor, per: u32) -> (Step, Cursor) {
    let per = per.max(1);
    let mut cur = cur;
    loop {
        if cur.seg >= list.segments {
            return (Step::Done, cur);
        }
        let s = list.segment(data, cur.seg);
        if cur.done >= s.blocks {
            cur = Cursor {
                seg: cur.seg + 1,
                ..Cursor::START
            };
            continue;
        }
        if !cur.writing {
            cur.piece = (s.blocks - cur.done).min(per);
        }
        // Back to front: the pieces from the end of the segment.
        let off = if s.backwards() {
            s.blocks - cur.done - cur.piece
        } else {
            cur.done
        };
        let step = if cur.writing {
            Step::Write {
                lba: s.dst + u64::from(off),
                blocks: cur.piece,
            }
        } else {
            Step::Read {
                lba: s.src + u64::from(off),
                blocks: cur.piece,
            }
        };
        return (step, cur);
    }
}

/// COPY MANAGER STATUS (SPC-4 §6.18.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyState {
    /// 00h: in progress.
    InProgress,
    /// 01h: completed without errors.
    Done,
    /// 02h: completed with errors.
    Failed,
}

/// What COPY STATUS reports of one copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyResult {
    /// The copy's LIST IDENTIFIER.
    pub list_id: u8,
    /// Its state.
    pub state: CopyState,
    /// Segments processed.
    pub segments: u16,
    /// Bytes written to the destination.
    pub bytes: u64,
}

/// Writes the COPY STATUS data (SPC-4 §6.18.3) of `r` into `out` (at least 12 bytes);
/// returns its length in bytes. The transfer count is in the smallest unit (bytes, KiB,
/// MiB, ...) that fits its 32-bit field.
pub fn copy_status(r: &CopyResult, out: &mut [u8]) -> usize {
    let d = &mut out[..12];
    d.fill(0);
    d[0..4].copy_from_slice(&8u32.to_be_bytes());
    d[4] = match r.state {
        CopyState::InProgress => 0x00,
        CopyState::Done => 0x01,
        CopyState::Failed => 0x02,
    };
    d[5..7].copy_from_slice(&r.segments.to_be_bytes());
    let mut units = 0u8;
    let mut count = r.bytes;
    while count > u64::from(u32::MAX) {
        count >>= 10;
        units += 1;
    }
    d[7] = units;
    d[8..12].copy_from_slice(&(count as u32).to_be_bytes());
    12
}

/// The completed copies' status one I_T nexus holds for COPY STATUS: fixed size, the
/// oldest discarded first (SPC-4 §6.18.3: discarded once reported, when a new copy uses
/// the same list identifier, at I_T nexus loss — the session's end — or when the copy
/// manager needs the room).
#[derive(Clone, Copy, Debug, Default)]
pub struct Held {
    slots: [Option<CopyResult>; HELD_RESULTS],
    next: usize,
}

impl Held {
    /// Holds `r`, replacing any result with its list identifier, else taking a free slot,
    /// else the oldest recorded into a full table.
    pub fn record(&mut self, r: CopyResult) {
        self.forget(r.list_id);
        if let Some(free) = self.slots.iter_mut().find(|s| s.is_none()) {
            *free = Some(r);
            return;
        }
        self.slots[self.next] = Some(r);
        self.next = (self.next + 1) % HELD_RESULTS;
    }

    /// The result held for `list_id`, discarded as it is returned.
    pub fn take(&mut self, list_id: u8) -> Option<CopyResult> {
        self.slots
            .iter_mut()
            .find(|s| s.is_some_and(|r| r.list_id == list_id))
            .and_then(Option::take)
    }

    /// Discards the result held for `list_id`, if any.
    pub fn forget(&mut self, list_id: u8) {
        let _ = self.take(list_id);
    }
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

    /// An identification CSCD descriptor for `naa` with block length `bs`.
    fn cscd(naa: &[u8; 16], bs: u32) -> Vec<u8> {
        let mut d = vec![0u8; CSCD_BYTES];
        d[0] = CSCD_IDENTIFICATION;
        d[4] = 0x01;
        d[5] = 0x03;
        d[7] = 16;
        d[8..24].copy_from_slice(naa);
        d[29..32].copy_from_slice(&bs.to_be_bytes()[1..]);
        d
    }

    fn seg(src_i: u16, dst_i: u16, blocks: u16, src: u64, dst: u64) -> Vec<u8> {
        let mut d = vec![0u8; B2B_SEGMENT_BYTES];
        d[0] = SEG_BLOCK_TO_BLOCK;
        d[2..4].copy_from_slice(&0x18u16.to_be_bytes());
        d[4..6].copy_from_slice(&src_i.to_be_bytes());
        d[6..8].copy_from_slice(&dst_i.to_be_bytes());
        d[10..12].copy_from_slice(&blocks.to_be_bytes());
        d[12..20].copy_from_slice(&src.to_be_bytes());
        d[20..28].copy_from_slice(&dst.to_be_bytes());
        d
    }

    fn list(list_id: u8, usage: u8, cscds: &[Vec<u8>], segs: &[Vec<u8>]) -> Vec<u8> {
        let mut p = vec![0u8; HEADER_BYTES];
        p[0] = list_id;
        p[1] = usage << 3;
        let c: Vec<u8> = cscds.concat();
        let s: Vec<u8> = segs.concat();
        p[2..4].copy_from_slice(&(c.len() as u16).to_be_bytes());
        p[8..12].copy_from_slice(&(s.len() as u32).to_be_bytes());
        p.extend(c);
        p.extend(s);
        p
    }

    #[test]
    fn a_simple_list_is_accepted_and_read_back() {
        let l = lun();
        let p = list(
            7,
            0,
            &[cscd(&l.naa(), 512)],
            &[seg(0, 0, 100, 0, 5000), seg(0, 0, 0, 1, 2)],
        );
        let pl = parse(&p, &l).unwrap();
        assert_eq!(
            pl.header,
            Header {
                list_id: 7,
                usage: ListIdUsage::Hold
            }
        );
        assert_eq!(pl.segments, 2);
        assert_eq!(ParamList::of_checked(&p), pl);
        assert_eq!(
            pl.segment(&p, 0),
            Segment {
                src: 0,
                dst: 5000,
                blocks: 100
            }
        );
        assert_eq!(pl.total_blocks(&p), 100);
    }

    #[test]
    fn lengths_and_limits() {
        let l = lun();
        let good = list(1, 0, &[cscd(&l.naa(), 512)], &[seg(0, 0, 8, 0, 64)]);
        // Truncated by the parameter list length: inside the CSCD, inside the segment.
        assert_eq!(parse(&good[..47], &l), Err(Sense::PARAM_LIST_LENGTH));
        assert_eq!(
            parse(&good[..good.len() - 1], &l),
            Err(Sense::PARAM_LIST_LENGTH)
        );
        assert_eq!(parse(&good[..15], &l), Err(Sense::PARAM_LIST_LENGTH));
        // One CSCD too many.
        let c = cscd(&l.naa(), 512);
        let many: Vec<Vec<u8>> = (0..=MAX_CSCD_DESCRIPTORS).map(|_| c.clone()).collect();
        let p = list(1, 0, &many, &[seg(0, 0, 8, 0, 64)]);
        assert_eq!(parse(&p, &l), Err(senses::TOO_MANY_CSCD));
        // One segment too many.
        let s = seg(0, 0, 8, 0, 64);
        let segs: Vec<Vec<u8>> = (0..=MAX_SEGMENT_DESCRIPTORS).map(|_| s.clone()).collect();
        let p = list(2, 0, std::slice::from_ref(&c), &segs);
        assert_eq!(parse(&p, &l), Err(senses::TOO_MANY_SEGMENTS));
        // Exactly the limits: accepted.
        let p = list(2, 0, &many[1..], &segs[1..]);
        assert_eq!(
            parse(&p, &l).map(|p| p.segments),
            Ok(MAX_SEGMENT_DESCRIPTORS)
        );
        // Descriptor lists over MAXIMUM DESCRIPTOR LIST LENGTH (with too many of both):
        // the length error wins.
        let segs: Vec<Vec<u8>> = (0..40).map(|_| s.clone()).collect();
        let p = list(3, 0, &many, &segs);
        assert_eq!(parse(&p, &l), Err(Sense::PARAM_LIST_LENGTH));
        // Inline data.
        let mut p = good.clone();
        p[15] = 4;
        p.extend([0; 4]);
        assert_eq!(parse(&p, &l), Err(senses::INLINE_TOO_LONG));
        // A segment longer than the maximum segment length (512-byte blocks: 65535 max).
        let l4k = LunInfo {
            block_bytes: 4096,
            ..lun()
        };
        let p = list(
            1,
            0,
            &[cscd(&l4k.naa(), 4096)],
            &[seg(0, 0, 0xffff, 0, 70000)],
        );
        assert_eq!(parse(&p, &l4k), Err(Sense::INVALID_FIELD_PARAM));
    }

    #[test]
    fn descriptor_types_and_targets() {
        let l = lun();
        // Fibre Channel N_Port_Name CSCD (E0h).
        let mut fc = cscd(&l.naa(), 512);
        fc[0] = 0xe0;
        let p = list(1, 0, &[fc], &[seg(0, 0, 8, 0, 64)]);
        assert_eq!(parse(&p, &l), Err(senses::UNSUPPORTED_CSCD));
        // Stream to stream segment (03h, 20 bytes).
        let mut st = vec![0u8; 20];
        st[0] = 0x03;
        st[3] = 0x10;
        let p = list(1, 0, &[cscd(&l.naa(), 512)], &[st]);
        assert_eq!(parse(&p, &l), Err(senses::UNSUPPORTED_SEGMENT));
        // A destination index past the CSCD list.
        let p = list(1, 0, &[cscd(&l.naa(), 512)], &[seg(0, 1, 8, 0, 64)]);
        assert_eq!(parse(&p, &l), Err(senses::UNREACHABLE));
        // Another LUN's NAA: unreachable when a segment uses it, fine otherwise.
        let other = cscd(&[0x60; 16], 512);
        let p = list(
            1,
            0,
            &[cscd(&l.naa(), 512), other.clone()],
            &[seg(0, 1, 8, 0, 64)],
        );
        assert_eq!(parse(&p, &l), Err(senses::UNREACHABLE));
        let p = list(1, 0, &[cscd(&l.naa(), 512), other], &[seg(0, 0, 8, 0, 64)]);
        assert!(parse(&p, &l).is_ok());
        // LU ID TYPE (reserved value) is ignored (SPC-4).
        let mut c = cscd(&l.naa(), 512);
        c[1] = 0x80;
        let p = list(1, 0, &[c], &[seg(0, 0, 8, 0, 64)]);
        assert!(parse(&p, &l).is_ok());
        // Wrong block length; a peripheral type other than block.
        let p = list(1, 0, &[cscd(&l.naa(), 4096)], &[seg(0, 0, 8, 0, 64)]);
        assert_eq!(parse(&p, &l), Err(Sense::INVALID_FIELD_PARAM));
        let mut c = cscd(&l.naa(), 512);
        c[1] = 0x01;
        let p = list(1, 0, &[c], &[seg(0, 0, 8, 0, 64)]);
        assert_eq!(parse(&p, &l), Err(senses::UNSUPPORTED_CSCD));
        // Past the end of the LUN, by one block, as source or destination.
        let end = l.blocks;
        let p = list(1, 0, &[cscd(&l.naa(), 512)], &[seg(0, 0, 8, 0, end - 7)]);
        assert_eq!(parse(&p, &l), Err(senses::COPY_ABORTED));
        let p = list(1, 0, &[cscd(&l.naa(), 512)], &[seg(0, 0, 8, end - 7, 0)]);
        assert_eq!(parse(&p, &l), Err(senses::COPY_ABORTED));
        let p = list(1, 0, &[cscd(&l.naa(), 512)], &[seg(0, 0, 8, 0, end - 8)]);
        assert!(parse(&p, &l).is_ok());
        // LIST ID USAGE 01b is reserved; 11b needs list identifier 0.
        let p = list(1, 1, &[cscd(&l.naa(), 512)], &[seg(0, 0, 8, 0, 64)]);
        assert_eq!(parse(&p, &l), Err(Sense::INVALID_FIELD_PARAM));
        let p = list(1, 3, &[cscd(&l.naa(), 512)], &[seg(0, 0, 8, 0, 64)]);
        assert_eq!(parse(&p, &l), Err(Sense::INVALID_FIELD_PARAM));
        let p = list(0, 3, &[cscd(&l.naa(), 512)], &[seg(0, 0, 8, 0, 64)]);
        assert_eq!(parse(&p, &l).unwrap().header.usage, ListIdUsage::None);
    }

    /// Runs a copy's steps over an in-memory LUN of `n` blocks of one byte each.
    fn run(disk: &mut [u8], p: &[u8], per: u32) {
        let pl = ParamList::of_checked(p);
        let mut buf = vec![0u8; per as usize];
        let mut cur = Cursor::START;
        for _ in 0..10_000 {
            let (step, c) = next_step(&pl, p, cur, per);
            assert_eq!(Cursor::unpack(c.pack()), Some(c));
            match step {
                Step::Done => return,
                Step::Read { lba, blocks } => {
                    let (a, n) = (lba as usize, blocks as usize);
                    buf[..n].copy_from_slice(&disk[a..a + n]);
                }
                Step::Write { lba, blocks } => {
                    let (a, n) = (lba as usize, blocks as usize);
                    disk[a..a + n].copy_from_slice(&buf[..n]);
                }
            }
            cur = c.completed();
        }
        panic!("copy never finished");
    }

    #[test]
    fn steps_copy_in_pieces_and_overlaps_safely() {
        let l = LunInfo {
            blocks: 1000,
            ..lun()
        };
        let c = cscd(&l.naa(), 512);
        let fresh = || -> Vec<u8> { (0..1000).map(|i| (i % 251) as u8).collect() };
        for (src, dst, n) in [
            (0u64, 500u64, 100u16),
            (10, 40, 100),
            (40, 10, 100),
            (5, 5, 9),
        ] {
            for per in [1, 7, 64, 1000] {
                let mut disk = fresh();
                let want: Vec<u8> = {
                    let mut d = disk.clone();
                    let s = d[src as usize..src as usize + usize::from(n)].to_vec();
                    d[dst as usize..dst as usize + usize::from(n)].copy_from_slice(&s);
                    d
                };
                let p = list(1, 0, std::slice::from_ref(&c), &[seg(0, 0, n, src, dst)]);
                parse(&p, &l).unwrap();
                run(&mut disk, &p, per);
                assert!(disk == want, "src {src} dst {dst} n {n} per {per}");
            }
        }
        // Several segments, one empty.
        let mut disk = fresh();
        let p = list(
            1,
            0,
            std::slice::from_ref(&c),
            &[
                seg(0, 0, 3, 0, 900),
                seg(0, 0, 0, 0, 0),
                seg(0, 0, 2, 10, 950),
            ],
        );
        run(&mut disk, &p, 2);
        assert_eq!(&disk[900..903], &[0, 1, 2]);
        assert_eq!(&disk[950..952], &[10, 11]);
        assert_eq!(Cursor::unpack(0), None);
    }

    #[test]
    fn cdbs_and_pages() {
        let l = lun();
        let mut out = [0u8; 64];
        let mut c = [0u8; 16];
        c[0] = OPC_EXTENDED_COPY;
        assert_eq!(decode_extended_copy(&c), Ok(Plan::Good));
        c[13] = 60;
        assert_eq!(
            decode_extended_copy(&c),
            Ok(Plan::ExtendedCopy { param_bytes: 60 })
        );
        c[1] = 0x01; // LID4
        assert_eq!(decode_extended_copy(&c), Err(Sense::INVALID_FIELD_CDB));
        c[1] = 0;
        c[10..14].copy_from_slice(&(MAX_PARAM_BYTES + 1).to_be_bytes());
        assert_eq!(decode_extended_copy(&c), Err(Sense::PARAM_LIST_LENGTH));

        let mut c = [0u8; 16];
        c[0] = OPC_RECEIVE_COPY_RESULTS;
        c[1] = SA_OPERATING_PARAMETERS;
        c[10..14].copy_from_slice(&1024u32.to_be_bytes());
        assert_eq!(
            decode_receive_copy_results(&c, &l, &mut out),
            Ok(Plan::Data { len: 46 })
        );
        assert_eq!(be32(&out[0..4]), 42);
        assert_eq!(be16(&out[8..10]), u32::from(MAX_CSCD_DESCRIPTORS));
        assert_eq!(be16(&out[10..12]), u32::from(MAX_SEGMENT_DESCRIPTORS));
        assert_eq!(be32(&out[16..20]), 0xffff * 512);
        assert_eq!(out[37], 9);
        assert_eq!(&out[43..46], &[2, SEG_BLOCK_TO_BLOCK, CSCD_IDENTIFICATION]);
        c[1] = SA_COPY_STATUS;
        c[2] = 9;
        assert_eq!(
            decode_receive_copy_results(&c, &l, &mut out),
            Ok(Plan::CopyStatus {
                list_id: 9,
                alloc: 1024
            })
        );
        c[1] = 0x01; // RECEIVE DATA
        assert_eq!(
            decode_receive_copy_results(&c, &l, &mut out),
            Err(Sense::INVALID_FIELD_CDB)
        );

        // Third-party Copy VPD page: descriptors that walk to the end; the commands.
        let n = third_party_copy_vpd(&mut out);
        let mut at = 0;
        let mut types = Vec::new();
        while at < n {
            types.push(be16(&out[at..at + 2]));
            at += 4 + be16(&out[at + 2..at + 4]) as usize;
        }
        assert_eq!(at, n);
        assert_eq!(types, [1, 8, 9]);
        assert_eq!(&out[4..12], &[7, 0x83, 1, 0, 0x84, 2, 0, 3]);

        let r = CopyResult {
            list_id: 1,
            state: CopyState::Done,
            segments: 3,
            bytes: 5 << 32,
        };
        assert_eq!(copy_status(&r, &mut out), 12);
        assert_eq!(be32(&out[0..4]), 8);
        assert_eq!(out[4], 1);
        assert_eq!(be16(&out[5..7]), 3);
        assert_eq!(out[7], 1, "KiB");
        assert_eq!(u64::from(be32(&out[8..12])), (5 << 32) >> 10);
    }

    #[test]
    fn held_results_are_bounded_and_taken_once() {
        let mut h = Held::default();
        let r = |id| CopyResult {
            list_id: id,
            state: CopyState::Done,
            segments: 1,
            bytes: 512,
        };
        for id in 0..=HELD_RESULTS as u8 {
            h.record(r(id));
        }
        // The oldest went for the newest.
        assert_eq!(h.take(0), None);
        assert_eq!(h.take(1), Some(r(1)));
        assert_eq!(h.take(1), None);
        h.record(r(2));
        h.forget(2);
        assert_eq!(h.take(2), None);
        assert_eq!(h.take(HELD_RESULTS as u8), Some(r(HELD_RESULTS as u8)));
    }
}
