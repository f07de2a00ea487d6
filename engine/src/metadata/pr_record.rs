//! The persistent-reservation record: where an exported array keeps state that must
//! survive a restart of the target and the members moving to another machine — SCSI
//! persistent reservations with APTPL set (SPC-4 §5.14.5, "Activate Persist Through Power
//! Loss") — on the members themselves, not in a file of the host.
//!
//! **Where.** Bytes 0..4096 of every member: the 4 KiB *before* the md v1.2 superblock
//! (which is at byte 4096, `super_offset` = 8 sectors). md v1.2 leaves that space unused on
//! purpose (room for a boot sector); neither the kernel nor mdadm reads or writes it, so
//! the record rides along with the members under kernel md too and is back when the array
//! returns to ferroraid. `docs/FORMAT.md` ("The persistent-reservation record") has the
//! layout below.
//!
//! **Layout** (little-endian, offsets in bytes from the start of the member):
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 8 | magic `b"FRRSV\0\x01\0"` ([`PR_RECORD_MAGIC`]) |
//! | 8 | 4 | format version, 1 |
//! | 12 | 4 | CRC-32C (Castagnoli) of the whole 4096 bytes with this field zero |
//! | 16 | 16 | the array UUID (the superblock's `set_uuid`) |
//! | 32 | 8 | generation: one higher on every save |
//! | 40 | 4 | payload length in bytes (≤ [`PR_PAYLOAD_MAX_BYTES`]) |
//! | 44 | 4 | zero |
//! | 48 | len | payload: the serialized state, opaque here (the iSCSI target's format) |
//! | 48 + len | … | zero |
//!
//! **Saving and loading.** A save writes the same record (generation N+1) to every member
//! and makes it durable; a crash in the middle leaves each member with its whole record N
//! or N+1 (a torn 4 KiB write fails the CRC and is ignored like a missing one). Loading
//! takes the valid record of the highest generation among the members. An area without
//! the magic (never written, or zeroes, or a boot sector) holds no record; one with the
//! magic but another array's UUID is not this array's and is ignored.
//!
//! The module does no I/O (`drivers::metadata_io` moves the area).

use thiserror::Error;

use super::Uuid;

/// Byte offset of the record on every member: the start of the device.
pub const PR_RECORD_OFFSET_BYTES: u64 = 0;
/// Bytes of the record area (8 sectors: everything before the v1.2 superblock).
pub const PR_RECORD_BYTES: usize = 4096;
/// The magic at byte 0.
pub const PR_RECORD_MAGIC: [u8; 8] = *b"FRRSV\0\x01\0";
/// The format version this code writes and reads.
pub const PR_RECORD_VERSION: u32 = 1;
/// Bytes before the payload.
const HEADER_BYTES: usize = 48;
/// Largest payload, bytes (4096 − 48).
pub const PR_PAYLOAD_MAX_BYTES: usize = PR_RECORD_BYTES - HEADER_BYTES;

/// A decoded record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrRecord {
    /// One higher on every save; the newest record wins.
    pub generation: u64,
    /// The saved state (empty: cleared).
    pub payload: Vec<u8>,
}

/// Why a record cannot be encoded, or an area holds a damaged one.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PrRecordError {
    /// The payload does not fit the 4 KiB area.
    #[error("persistent-reservation state of {len} bytes does not fit the {max}-byte record")]
    TooLong {
        /// Payload bytes asked for.
        len: usize,
        /// [`PR_PAYLOAD_MAX_BYTES`].
        max: usize,
    },
    /// The magic is there but the checksum does not match (a torn or damaged write).
    #[error(
        "persistent-reservation record: CRC-32C {stored:#010x} stored, {computed:#010x} computed"
    )]
    Checksum {
        /// The CRC in the area.
        stored: u32,
        /// The CRC of the area's contents.
        computed: u32,
    },
    /// A version this code does not read.
    #[error("persistent-reservation record version {0} (this ferroraid reads version 1)")]
    Version(u32),
    /// The length field or the padding is wrong although the checksum matches.
    #[error("persistent-reservation record: {0}")]
    Malformed(&'static str),
}

fn crc_of(area: &[u8; PR_RECORD_BYTES]) -> u32 {
    let mut copy = *area;
    copy[12..16].fill(0);
    crate::checksum::crc32c(&copy)
}

/// The 4 KiB area holding `payload` as generation `generation` of array `uuid`.
///
/// # Errors
/// [`PrRecordError::TooLong`] when `payload` exceeds [`PR_PAYLOAD_MAX_BYTES`].
pub fn encode(
    uuid: Uuid,
    generation: u64,
    payload: &[u8],
) -> Result<Box<[u8; PR_RECORD_BYTES]>, PrRecordError> {
    if payload.len() > PR_PAYLOAD_MAX_BYTES {
        return Err(PrRecordError::TooLong {
            len: payload.len(),
            max: PR_PAYLOAD_MAX_BYTES,
        });
    }
    let mut a = Box::new([0u8; PR_RECORD_BYTES]);
    a[0..8].copy_from_slice(&PR_RECORD_MAGIC);
    a[8..12].copy_from_slice(&PR_RECORD_VERSION.to_le_bytes());
    a[16..32].copy_from_slice(&uuid.0);
    a[32..40].copy_from_slice(&generation.to_le_bytes());
    a[40..44].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    a[HEADER_BYTES..HEADER_BYTES + payload.len()].copy_from_slice(payload);
    let crc = crc_of(&a);
    a[12..16].copy_from_slice(&crc.to_le_bytes());
    Ok(a)
}

/// The record in `area` if it holds one of array `uuid`: `Ok(None)` when the area has no
/// record (no magic) or one of another array.
///
/// # Errors
/// [`PrRecordError::Checksum`], [`PrRecordError::Version`], [`PrRecordError::Malformed`]:
/// the magic is there but the record is damaged or from a newer format.
pub fn decode(area: &[u8; PR_RECORD_BYTES], uuid: Uuid) -> Result<Option<PrRecord>, PrRecordError> {
    if area[0..8] != PR_RECORD_MAGIC {
        return Ok(None);
    }
    let u32_at = |o: usize| u32::from_le_bytes(area[o..o + 4].try_into().expect("4 bytes"));
    let stored = u32_at(12);
    let computed = crc_of(area);
    if stored != computed {
        return Err(PrRecordError::Checksum { stored, computed });
    }
    let version = u32_at(8);
    if version != PR_RECORD_VERSION {
        return Err(PrRecordError::Version(version));
    }
    if area[16..32] != uuid.0 {
        return Ok(None);
    }
    let len = u32_at(40) as usize;
    if len > PR_PAYLOAD_MAX_BYTES {
        return Err(PrRecordError::Malformed("payload length beyond the area"));
    }
    if u32_at(44) != 0 || area[HEADER_BYTES + len..].iter().any(|&b| b != 0) {
        return Err(PrRecordError::Malformed("nonzero padding"));
    }
    Ok(Some(PrRecord {
        generation: u64::from_le_bytes(area[32..40].try_into().expect("8 bytes")),
        payload: area[HEADER_BYTES..HEADER_BYTES + len].to_vec(),
    }))
}

/// What the members' areas say together: the newest valid record of array `uuid`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Newest {
    /// The valid record of the highest generation, if any member holds one.
    pub record: Option<PrRecord>,
    /// Members whose area held a damaged record (index into the areas given), with why.
    pub damaged: Vec<(usize, PrRecordError)>,
}

/// Picks the newest valid record among `areas` (one per member; `None` for a member that
/// could not be read). Damaged records are reported, not fatal: a torn save leaves the
/// other members' copies.
pub fn newest<'a>(
    areas: impl IntoIterator<Item = Option<&'a [u8; PR_RECORD_BYTES]>>,
    uuid: Uuid,
) -> Newest {
    let mut out = Newest::default();
    for (i, area) in areas.into_iter().enumerate() {
        let Some(area) = area else { continue };
        match decode(area, uuid) {
            Ok(Some(r)) => {
                if out
                    .record
                    .as_ref()
                    .is_none_or(|best| r.generation > best.generation)
                {
                    out.record = Some(r);
                }
            }
            Ok(None) => {}
            Err(e) => out.damaged.push((i, e)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: Uuid = Uuid([7; 16]);

    #[test]
    fn a_record_round_trips_and_its_bytes_are_where_the_docs_say() {
        let a = encode(U, 42, b"state").unwrap();
        assert_eq!(&a[0..8], b"FRRSV\0\x01\0");
        assert_eq!(u32::from_le_bytes(a[8..12].try_into().unwrap()), 1);
        assert_eq!(&a[16..32], &[7; 16]);
        assert_eq!(u64::from_le_bytes(a[32..40].try_into().unwrap()), 42);
        assert_eq!(u32::from_le_bytes(a[40..44].try_into().unwrap()), 5);
        assert_eq!(&a[48..53], b"state");
        // The CRC is CRC-32C of the area with the field zeroed, computed independently
        // of `crc_of` here.
        let mut z = *a;
        z[12..16].fill(0);
        assert_eq!(
            u32::from_le_bytes(a[12..16].try_into().unwrap()),
            crc32c::crc32c(&z)
        );
        assert_eq!(
            decode(&a, U).unwrap(),
            Some(PrRecord {
                generation: 42,
                payload: b"state".to_vec()
            })
        );
        let full = vec![0xa5; PR_PAYLOAD_MAX_BYTES];
        assert_eq!(
            decode(&encode(U, 1, &full).unwrap(), U)
                .unwrap()
                .unwrap()
                .payload,
            full
        );
    }

    #[test]
    fn no_magic_or_another_array_is_no_record_and_damage_is_an_error() {
        assert_eq!(decode(&[0; PR_RECORD_BYTES], U), Ok(None));
        let other = encode(Uuid([9; 16]), 3, b"x").unwrap();
        assert_eq!(decode(&other, U), Ok(None));
        let mut torn = *encode(U, 3, b"abc").unwrap();
        torn[50] ^= 1;
        assert!(matches!(
            decode(&torn, U),
            Err(PrRecordError::Checksum { .. })
        ));
        assert_eq!(
            encode(U, 1, &vec![0; PR_PAYLOAD_MAX_BYTES + 1]),
            Err(PrRecordError::TooLong {
                len: PR_PAYLOAD_MAX_BYTES + 1,
                max: PR_PAYLOAD_MAX_BYTES
            })
        );
        // A checksummed area with a length past the end, or garbage after the payload.
        let mut bad = *encode(U, 1, b"ab").unwrap();
        bad[40..44].copy_from_slice(&5000u32.to_le_bytes());
        let crc = crc_of(&bad);
        bad[12..16].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(decode(&bad, U), Err(PrRecordError::Malformed(_))));
        let mut bad = *encode(U, 1, b"ab").unwrap();
        bad[100] = 1;
        let crc = crc_of(&bad);
        bad[12..16].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(decode(&bad, U), Err(PrRecordError::Malformed(_))));
        let mut v2 = *encode(U, 1, b"ab").unwrap();
        v2[8] = 2;
        let crc = crc_of(&v2);
        v2[12..16].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode(&v2, U), Err(PrRecordError::Version(2)));
    }

    #[test]
    fn the_newest_valid_generation_wins_over_torn_and_missing_copies() {
        let g5 = encode(U, 5, b"five").unwrap();
        let g6 = encode(U, 6, b"six").unwrap();
        let mut torn7 = *encode(U, 7, b"seven").unwrap();
        torn7[60] ^= 0xff;
        let n = newest([Some(&*g5), None, Some(&torn7), Some(&*g6)], U);
        assert_eq!(n.record.unwrap().payload, b"six");
        assert_eq!(n.damaged.len(), 1);
        assert_eq!(n.damaged[0].0, 2);
        assert_eq!(
            newest([None, Some(&[0u8; PR_RECORD_BYTES])], U),
            Newest::default()
        );
    }
}
