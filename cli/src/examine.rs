//! `ferroraid examine`: the md v1.2 superblock of a device, for people (the key lines of
//! `mdadm --examine`) and for scripts (JSON with stable field names).
//!
//! A superblock is shown when its format decodes (`engine::metadata::Superblock::decode`)
//! — even with a bad checksum, which is reported (`checksum_ok: false`) as mdadm does —
//! and whether ferroraid can serve the array it describes is a separate verdict
//! (`supported`, `unsupported_reason`). A device that cannot be read or holds no
//! decodable superblock is an [`ExamineFailure`] with the reason.
//!
//! **Stable field names** (JSON, one array entry per device, in the order given): fields
//! are only added, never renamed or removed. Units are in the names: `_bytes` bytes,
//! `_unix_s` seconds since the Unix epoch; md's sector counts are converted to bytes.

use std::fmt;
use std::path::Path;

use engine::geometry::Layout;
use engine::metadata::bitmap::BITMAP_MAGIC;
use engine::metadata::ppl::AreaScan;
use engine::metadata::{
    raw_checksum, Bitmap, DevRole, Feature, FeatureSet, Superblock, SuperblockError,
    SUPERBLOCK_BASE_BYTES,
};
use serde::{Deserialize, Serialize};

/// Byte offset of `sb_csum` in the superblock (`md_p.h`; `docs/FORMAT.md`).
const SB_CSUM_OFFSET: usize = 216;

/// One device's superblock, as `ferroraid examine --json` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExamineReport {
    /// The device path as given.
    pub device: String,
    /// `set_uuid` in md's colon form (`xxxxxxxx:xxxxxxxx:xxxxxxxx:xxxxxxxx`).
    pub array_uuid: String,
    /// `set_name` (mdadm's `homehost:name` convention).
    pub name: String,
    /// md's RAID level number (5, 6; other md levels are shown but not served).
    pub level: i32,
    /// md's layout name (`left-symmetric`, ...; the number for ones without a name).
    pub layout: String,
    /// md's layout id (`ALGORITHM_*`).
    pub layout_id: u32,
    /// Chunk size, bytes.
    pub chunk_bytes: u64,
    /// Members of the complete array (`raid_disks`).
    pub raid_devices: u32,
    /// This device's role: its slot number, or `"spare"`, `"faulty"`, `"journal"`,
    /// `"invalid"` ([`ExamineRole`]).
    pub role: ExamineRole,
    /// This device's permanent index in `dev_roles` (`dev_number`; not its role).
    pub dev_number: u32,
    /// Where the data area starts on the device, bytes (`data_offset`).
    pub data_offset_bytes: u64,
    /// Bytes of the device usable for data from the data offset (`data_size`; mdadm's
    /// "Avail Dev Size").
    pub data_size_bytes: u64,
    /// Bytes of each member's data area the array uses (`size`; mdadm's "Used Dev Size").
    pub component_size_bytes: u64,
    /// The array's capacity, bytes (`size` × data members) for RAID4/5/6; `null` for
    /// other levels or when it overflows.
    pub array_size_bytes: Option<u64>,
    /// The superblock generation (`events`).
    pub events: u64,
    /// This member is rebuilt only below this many 512-byte sectors from its data offset
    /// (`recovery_offset`, present when `MD_FEATURE_RECOVERY_OFFSET` is set: a rebuild or
    /// a replace resumes there); `null` when the member is in sync.
    #[serde(default)]
    pub recovery_offset_sectors: Option<u64>,
    /// `"clean"` (parity known consistent: `resync_offset` = MaxSector) or `"active"`.
    pub state: ExamineState,
    /// This device's UUID in md's colon form (`device_uuid`).
    pub device_uuid: String,
    /// md's `feature_map` bits (0 for arrays without a bitmap, log or recovery).
    pub feature_map: u32,
    /// The names of the known bits set in `feature_map`, in bit order: md's
    /// (`MD_FEATURE_PPL`, ...) and ferroraid's own `FERRORAID_FEATURE_RAID6_PPL`.
    #[serde(default)]
    pub features: Vec<String>,
    /// `sb_csum` as stored.
    pub checksum: u32,
    /// The checksum the contents have (md's `calc_sb_1_csum`).
    pub checksum_expected: u32,
    /// Whether the two agree.
    pub checksum_ok: bool,
    /// Creation time, seconds since the Unix epoch (`ctime`).
    pub ctime_unix_s: u64,
    /// Last update time, seconds since the Unix epoch (`utime`).
    pub utime_unix_s: u64,
    /// mdadm's "Array State" as this superblock records it: one letter per role, `A`
    /// held by an active device, `.` not held, `R` held by two (a replacement).
    pub array_state: String,
    /// Whether ferroraid can serve the array this superblock describes.
    pub supported: bool,
    /// Why not, when it cannot (`engine::metadata::Superblock::check_supported`).
    pub unsupported_reason: Option<String>,
    /// The internal write-intent bitmap (`mdadm --examine-bitmap`), when the superblock
    /// has one (`feature_map` bit 1) and it could be read; `null` otherwise.
    #[serde(default)]
    pub bitmap: Option<BitmapReport>,
    /// Why the internal bitmap the superblock announces could not be read or is refused.
    #[serde(default)]
    pub bitmap_error: Option<String>,
    /// The Partial Parity Log area, when the superblock has a PPL feature bit
    /// (`feature_map` 0x400 or 0x800); `null` otherwise.
    #[serde(default)]
    pub ppl: Option<PplReport>,
    /// Why the PPL area is refused (md's checks, `Superblock::ppl_area`) or could not be
    /// read.
    #[serde(default)]
    pub ppl_error: Option<String>,
}

/// A member's Partial Parity Log area (`mdadm --examine`'s "PPL" line, and what md's
/// `ppl_load_distributed` would find in it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PplReport {
    /// Where the area starts, bytes from the superblock (`ppl.offset` × 512; signed).
    pub offset_from_superblock_bytes: i64,
    /// The area's size, bytes (`ppl.size` × 512).
    pub size_bytes: u64,
    /// `"single"` or `"multiple"`: how md logs into an area of this size (multiple from
    /// 528 usable sectors, `ppl_init_child_log`); `null` when md refuses the area.
    pub mode: Option<String>,
    /// Whether the superblock says `MD_FEATURE_MULTIPLE_PPLS` (else `MD_FEATURE_PPL`).
    pub multiple_feature: bool,
    /// Valid records the scan walked through; `null` when the area was not read.
    pub records_seen: Option<u32>,
    /// The newest valid record, when the area was read and holds one.
    pub newest: Option<PplRecordReport>,
}

/// The newest valid record of a PPL area.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PplRecordReport {
    /// Where its header starts, bytes from the start of the area.
    pub offset_bytes: u64,
    /// Its `generation` (0: the empty header md writes at creation and every start).
    pub generation: u64,
    /// Its entries (logged stripe writes whose parity md would repair if the array was
    /// not shut down cleanly).
    pub entries: u32,
}

impl PplReport {
    /// The area as `sb` places it; `None` without a PPL feature bit. Not read.
    fn new(sb: &Superblock) -> Option<Self> {
        let area = sb.ppl_area();
        let multiple_feature = sb.feature_map & Feature::MultiplePpls.bit() != 0;
        if !multiple_feature && sb.feature_map & Feature::Ppl.bit() == 0 {
            return None;
        }
        let (offset, size) = sb.ppl();
        Some(PplReport {
            offset_from_superblock_bytes: i64::from(offset) * 512,
            size_bytes: u64::from(size) * 512,
            mode: area.ok().flatten().map(|a| a.mode.to_string()),
            multiple_feature,
            records_seen: None,
            newest: None,
        })
    }

    /// Adds what a scan of the area found.
    fn scanned(&mut self, scan: &AreaScan) {
        self.records_seen = Some(scan.records_seen);
        self.newest = scan.newest.as_ref().map(|r| PplRecordReport {
            offset_bytes: r.offset_sectors * 512,
            generation: r.header.generation,
            entries: r.header.entries.len() as u32,
        });
    }
}

impl fmt::Display for PplReport {
    /// mdadm's line (`examine_super1`: "PPL : N sectors at offset M sectors from
    /// superblock"), then what ferroraid read from the area.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "            PPL : {} sectors at offset {} sectors from superblock",
            self.size_bytes / 512,
            self.offset_from_superblock_bytes / 512
        )?;
        if let Some(mode) = &self.mode {
            writeln!(f, "       PPL Mode : {mode}")?;
        }
        match (&self.newest, self.records_seen) {
            (Some(r), Some(seen)) => writeln!(
                f,
                "     PPL Newest : generation {}, {} entries, at {} sectors into the area \
                 ({seen} valid records read)",
                r.generation,
                r.entries,
                r.offset_bytes / 512
            ),
            (None, Some(_)) => writeln!(f, "     PPL Newest : no valid PPL header"),
            _ => Ok(()),
        }
    }
}

/// An internal bitmap as `mdadm --examine-bitmap` shows it (`bitmap_super_t`, md-bitmap.h).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BitmapReport {
    /// Where the bitmap starts on the device, bytes (`(super_offset + bitmap_offset) × 512`).
    pub offset_bytes: u64,
    /// `version` (4: little-endian bits).
    pub version: u32,
    /// `uuid`, md's colon form (the array's UUID).
    pub uuid: String,
    /// `events` the bitmap was last written with.
    pub events: u64,
    /// `events_cleared`: the array's events when a bit was last cleared.
    pub events_cleared: u64,
    /// `"ok"` or `"stale"` (every bit counts as dirty).
    pub state: String,
    /// Bytes of each member one bit covers (`chunksize`).
    pub chunk_bytes: u64,
    /// Seconds between bitmap-daemon passes (`daemon_sleep`).
    pub daemon_sleep_s: u32,
    /// `write_behind` (0: normal write mode).
    pub write_behind: u32,
    /// Bytes of each member the bitmap covers (`sync_size` × 512).
    pub sync_size_bytes: u64,
    /// Number of bits (chunks).
    pub bits: u64,
    /// Bits set: regions that may hold writes not yet known to be on every member.
    pub dirty_bits: u64,
}

impl BitmapReport {
    /// The report of bitmap `b` found at `offset_bytes`.
    pub fn new(b: &Bitmap, offset_bytes: u64) -> Self {
        let s = &b.super_;
        BitmapReport {
            offset_bytes,
            version: s.version,
            uuid: s.uuid.to_string(),
            events: s.events,
            events_cleared: s.events_cleared,
            state: if s.is_stale() { "stale" } else { "ok" }.to_string(),
            chunk_bytes: s.chunk_bytes(),
            daemon_sleep_s: s.daemon_sleep,
            write_behind: s.write_behind,
            sync_size_bytes: s.sync_size.saturating_mul(512),
            bits: b.bits(),
            dirty_bits: b.dirty_count(),
        }
    }
}

impl fmt::Display for BitmapReport {
    /// The lines of `mdadm --examine-bitmap` (`ExamineBitmap`, bitmap.c), same labels.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "  Internal Bitmap : {} sectors from superblock",
            self.offset_bytes / 512 - 8
        )?;
        writeln!(f, "           Magic : {BITMAP_MAGIC:x}")?;
        writeln!(f, "         Version : {}", self.version)?;
        writeln!(f, "            UUID : {}", self.uuid)?;
        writeln!(f, "          Events : {}", self.events)?;
        writeln!(f, "  Events Cleared : {}", self.events_cleared)?;
        writeln!(
            f,
            "           State : {}",
            if self.state == "stale" {
                "Out of date"
            } else {
                "OK"
            }
        )?;
        writeln!(f, "       Chunksize : {}", chunk_text(self.chunk_bytes))?;
        writeln!(
            f,
            "          Daemon : {}s flush period",
            self.daemon_sleep_s
        )?;
        if self.write_behind == 0 {
            writeln!(f, "      Write Mode : Normal")?;
        } else {
            writeln!(
                f,
                "      Write Mode : Allow write behind, max {}",
                self.write_behind
            )?;
        }
        // mdadm prints KiB, then the human size.
        writeln!(
            f,
            "       Sync Size : {} ({})",
            self.sync_size_bytes / 1024,
            crate::status::human_bytes(self.sync_size_bytes)
        )?;
        let pct = if self.bits == 0 {
            0.0
        } else {
            100.0 * self.dirty_bits as f64 / self.bits as f64
        };
        writeln!(
            f,
            "          Bitmap : {} bits (chunks), {} dirty ({pct:.1}%)",
            self.bits, self.dirty_bits
        )
    }
}

/// mdadm's `human_chunksize`: B, KB, MB or GB (powers of 1024).
fn chunk_text(bytes: u64) -> String {
    let mut v = bytes;
    for unit in ["B", "KB", "MB"] {
        if v < 1024 || !v.is_multiple_of(1024) {
            return format!("{v} {unit}");
        }
        v /= 1024;
    }
    format!("{v} GB")
}

/// A device's role as its own superblock records it. Serialized as the slot number or
/// the lower-case name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExamineRole {
    /// Active member in this slot (its position in the stripe layout).
    Slot(u16),
    /// Spare.
    Spare,
    /// Faulty.
    Faulty,
    /// Journal device.
    Journal,
    /// A value md does not define.
    Invalid,
}

impl From<DevRole> for ExamineRole {
    fn from(r: DevRole) -> Self {
        match r {
            DevRole::Active(s) => ExamineRole::Slot(s),
            DevRole::Spare => ExamineRole::Spare,
            DevRole::Faulty => ExamineRole::Faulty,
            DevRole::Journal => ExamineRole::Journal,
            DevRole::Invalid(_) => ExamineRole::Invalid,
        }
    }
}

impl Serialize for ExamineRole {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ExamineRole::Slot(n) => s.serialize_u16(*n),
            ExamineRole::Spare => s.serialize_str("spare"),
            ExamineRole::Faulty => s.serialize_str("faulty"),
            ExamineRole::Journal => s.serialize_str("journal"),
            ExamineRole::Invalid => s.serialize_str("invalid"),
        }
    }
}

impl<'de> Deserialize<'de> for ExamineRole {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Slot(u16),
            Name(String),
        }
        match Raw::deserialize(d)? {
            Raw::Slot(n) => Ok(ExamineRole::Slot(n)),
            Raw::Name(n) => match n.as_str() {
                "spare" => Ok(ExamineRole::Spare),
                "faulty" => Ok(ExamineRole::Faulty),
                "journal" => Ok(ExamineRole::Journal),
                "invalid" => Ok(ExamineRole::Invalid),
                other => Err(serde::de::Error::custom(format!(
                    "unknown role {other:?}: expected a slot number, spare, faulty, journal or invalid"
                ))),
            },
        }
    }
}

impl fmt::Display for ExamineRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExamineRole::Slot(n) => write!(f, "Active device {n}"),
            ExamineRole::Spare => f.write_str("spare"),
            ExamineRole::Faulty => f.write_str("faulty"),
            ExamineRole::Journal => f.write_str("Journal"),
            ExamineRole::Invalid => f.write_str("undefined role"),
        }
    }
}

/// The array's consistency as a superblock records it. Serialized lower-case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExamineState {
    /// `resync_offset` = MaxSector: parity known consistent.
    Clean,
    /// Anything else: dirty, or a resync under way.
    Active,
}

/// A device whose superblock could not be shown.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExamineFailure {
    /// The device path as given.
    pub device: String,
    /// Why, naming the device (cannot open, too small, no md superblock, ...).
    pub error: String,
}

/// What `examine` found on one device: a JSON array entry. Entries with an `error` field
/// are failures.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ExamineEntry {
    /// A superblock (maybe with a bad checksum).
    Report(Box<ExamineReport>),
    /// No superblock could be shown.
    Failure(ExamineFailure),
}

impl ExamineEntry {
    /// Whether the device has a superblock with a correct checksum (`examine` exits
    /// non-zero otherwise).
    pub fn is_ok(&self) -> bool {
        matches!(self, ExamineEntry::Report(r) if r.checksum_ok)
    }

    /// What is wrong with the device, in one line naming it; `None` when nothing is.
    pub fn problem(&self) -> Option<String> {
        match self {
            ExamineEntry::Failure(f) => Some(f.error.clone()),
            ExamineEntry::Report(r) if !r.checksum_ok => Some(format!(
                "{}: bad superblock checksum: stored 0x{:08x}, expected 0x{:08x}",
                r.device, r.checksum, r.checksum_expected
            )),
            ExamineEntry::Report(_) => None,
        }
    }
}

/// Reads and examines the superblock of the device at `path`
/// (`drivers::metadata_io::read_superblock_area`, then [`examine_area`]).
pub fn examine_device(path: &Path) -> ExamineEntry {
    let device = path.display().to_string();
    match drivers::metadata_io::read_superblock_area(path) {
        Err(e) => ExamineEntry::Failure(ExamineFailure {
            device,
            error: e.to_string(),
        }),
        Ok(area) => match examine_area(&device, &area) {
            Ok(mut r) => {
                if r.feature_map & Feature::BitmapOffset.bit() != 0 {
                    let sb = Superblock::decode(&area).ok();
                    match sb.map(|sb| {
                        let at = engine::metadata::bitmap::bitmap_start_sector(&sb);
                        (drivers::metadata_io::read_bitmap(path, &sb), at)
                    }) {
                        Some((Ok(b), Some(at))) => r.bitmap = Some(BitmapReport::new(&b, at * 512)),
                        Some((Err(e), _)) => r.bitmap_error = Some(e.to_string()),
                        _ => {
                            r.bitmap_error =
                                Some("the superblock does not decode: bitmap not read".into())
                        }
                    }
                }
                if let (Some(report), Ok(sb)) = (&mut r.ppl, Superblock::decode(&area)) {
                    match drivers::metadata_io::scan_ppl(path, &sb) {
                        Ok(Some((_, scan))) => report.scanned(&scan),
                        Ok(None) => {}
                        Err(e) => r.ppl_error = Some(e.to_string()),
                    }
                }
                ExamineEntry::Report(Box::new(r))
            }
            Err(e) => ExamineEntry::Failure(ExamineFailure {
                error: format!("{device}: {e}"),
                device,
            }),
        },
    }
}

/// Examines a superblock area (`bytes` read at byte 4096 of `device`). A bad checksum
/// does not stop it: the fields are shown with `checksum_ok: false`.
///
/// # Errors
/// Every other format error of `Superblock::decode`: truncated, no md magic, major
/// version, `max_dev`, non-zero padding.
pub fn examine_area(device: &str, bytes: &[u8]) -> Result<ExamineReport, SuperblockError> {
    let (sb, checksum_ok) = match Superblock::decode(bytes) {
        Ok(sb) => (sb, true),
        Err(SuperblockError::BadChecksum { computed, .. }) => {
            // Decode the rest as mdadm does: with the checksum taken as right.
            let mut fixed = bytes.to_vec();
            fixed[SB_CSUM_OFFSET..SB_CSUM_OFFSET + 4].copy_from_slice(&computed.to_le_bytes());
            (Superblock::decode(&fixed)?, false)
        }
        Err(e) => return Err(e),
    };
    const _: () = assert!(SB_CSUM_OFFSET + 4 <= SUPERBLOCK_BASE_BYTES);
    let stored = u32::from_le_bytes([
        bytes[SB_CSUM_OFFSET],
        bytes[SB_CSUM_OFFSET + 1],
        bytes[SB_CSUM_OFFSET + 2],
        bytes[SB_CSUM_OFFSET + 3],
    ]);
    let expected = raw_checksum(bytes)?;
    let parity = match sb.level {
        4 | 5 => Some(1u64),
        6 => Some(2),
        _ => None,
    };
    let array_size_bytes = parity.and_then(|p| {
        u64::from(sb.raid_disks)
            .checked_sub(p)
            .and_then(|data| data.checked_mul(sb.size))
            .and_then(|s| s.checked_mul(512))
    });
    let unsupported_reason = sb.check_supported().err().map(|e| e.to_string());
    let ppl_error = sb.ppl_area().err().map(|e| e.to_string());
    Ok(ExamineReport {
        device: device.to_string(),
        array_uuid: sb.set_uuid.to_string(),
        name: sb.name(),
        level: sb.level,
        layout: layout_name(sb.level, sb.layout),
        layout_id: sb.layout,
        chunk_bytes: u64::from(sb.chunksize) * 512,
        raid_devices: sb.raid_disks,
        role: sb.role().into(),
        dev_number: sb.dev_number,
        data_offset_bytes: sb.data_offset.saturating_mul(512),
        data_size_bytes: sb.data_size.saturating_mul(512),
        component_size_bytes: sb.size.saturating_mul(512),
        array_size_bytes,
        events: sb.events,
        recovery_offset_sectors: sb.recovering(),
        state: if sb.is_clean() {
            ExamineState::Clean
        } else {
            ExamineState::Active
        },
        device_uuid: sb.device_uuid.to_string(),
        feature_map: sb.feature_map,
        features: FeatureSet(sb.feature_map)
            .features()
            .map(|f| f.md_name().to_string())
            .collect(),
        checksum: stored,
        checksum_expected: expected,
        checksum_ok,
        ctime_unix_s: sb.ctime.seconds(),
        utime_unix_s: sb.utime.seconds(),
        array_state: array_state(&sb),
        supported: unsupported_reason.is_none(),
        unsupported_reason,
        bitmap: None,
        bitmap_error: None,
        ppl: PplReport::new(&sb),
        ppl_error,
    })
}

/// md's name of a layout of `level` (mdadm's `r5layout`/`r6layout` maps).
fn layout_name(level: i32, id: u32) -> String {
    if matches!(level, 4..=6) {
        if let Ok(l) = Layout::from_md(id) {
            return l.name().to_string();
        }
    }
    let name = match (level, id) {
        (6, 8) => "ddf-zero-restart",
        (6, 9) => "ddf-N-restart",
        (6, 10) => "ddf-N-continue",
        (6, 16) => "left-asymmetric-6",
        (6, 17) => "right-asymmetric-6",
        (6, 18) => "left-symmetric-6",
        (6, 19) => "right-symmetric-6",
        (6, 20) => "parity-first-6",
        _ => return id.to_string(),
    };
    name.to_string()
}

/// mdadm's "Array State" letters (`examine_super1`): per role, `A` when a slot holds it,
/// `R` when two do (replacement), `.` when none does. At most 1920 letters (`max_dev`).
fn array_state(sb: &Superblock) -> String {
    let n = sb.raid_disks.min(engine::metadata::MAX_DEV_LIMIT) as usize;
    let mut held = vec![0u8; n];
    for &r in &sb.dev_roles {
        if let DevRole::Active(r) = DevRole::from_raw(r) {
            if let Some(h) = held.get_mut(usize::from(r)) {
                *h = h.saturating_add(1);
            }
        }
    }
    held.iter()
        .map(|&h| match h {
            0 => '.',
            1 => 'A',
            _ => 'R',
        })
        .collect()
}

/// Seconds since the Unix epoch as `YYYY-MM-DD hh:mm:ss UTC` (proleptic Gregorian;
/// Howard Hinnant's `civil_from_days`).
pub fn utc_time(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn sectors_text(bytes: u64) -> String {
    format!(
        "{} sectors ({})",
        bytes / 512,
        crate::status::human_bytes(bytes)
    )
}

impl fmt::Display for ExamineReport {
    /// The key lines of `mdadm --examine`, same labels and order.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let level = match self.level {
            4..=6 | 0 | 1 | 10 => format!("raid{}", self.level),
            -1 => "linear".to_string(),
            l => format!("level {l}"),
        };
        writeln!(f, "{}:", self.device)?;
        writeln!(f, "          Magic : a92b4efc")?;
        writeln!(f, "        Version : 1.2")?;
        writeln!(f, "    Feature Map : 0x{:x}", self.feature_map)?;
        // Not an mdadm line: the bits by name (ferroraid's own among them).
        if !self.features.is_empty() {
            writeln!(f, "       Features : {}", self.features.join(", "))?;
        }
        writeln!(f, "     Array UUID : {}", self.array_uuid)?;
        writeln!(f, "           Name : {}", self.name)?;
        writeln!(f, "  Creation Time : {}", utc_time(self.ctime_unix_s))?;
        writeln!(f, "     Raid Level : {level}")?;
        writeln!(f, "   Raid Devices : {}", self.raid_devices)?;
        writeln!(f)?;
        writeln!(
            f,
            " Avail Dev Size : {}",
            sectors_text(self.data_size_bytes)
        )?;
        if let Some(a) = self.array_size_bytes {
            writeln!(
                f,
                "     Array Size : {} KiB ({})",
                a / 1024,
                crate::status::human_bytes(a)
            )?;
        }
        // mdadm prints it only when the array uses less than the device offers.
        if self.component_size_bytes != self.data_size_bytes {
            writeln!(
                f,
                "  Used Dev Size : {}",
                sectors_text(self.component_size_bytes)
            )?;
        }
        writeln!(
            f,
            "    Data Offset : {} sectors",
            self.data_offset_bytes / 512
        )?;
        writeln!(f, "   Super Offset : 8 sectors")?;
        // mdadm's `examine_super1` prints it when MD_FEATURE_RECOVERY_OFFSET is set.
        if let Some(r) = self.recovery_offset_sectors {
            writeln!(f, "Recovery Offset : {r} sectors")?;
        }
        writeln!(
            f,
            "          State : {}",
            match self.state {
                ExamineState::Clean => "clean",
                ExamineState::Active => "active",
            }
        )?;
        writeln!(f, "    Device UUID : {}", self.device_uuid)?;
        writeln!(f)?;
        if let Some(p) = &self.ppl {
            write!(f, "{p}")?;
        }
        if let Some(e) = &self.ppl_error {
            writeln!(f, "      PPL Error : {e}")?;
        }
        writeln!(f, "    Update Time : {}", utc_time(self.utime_unix_s))?;
        if self.checksum_ok {
            writeln!(f, "       Checksum : {:x} - correct", self.checksum)?;
        } else {
            writeln!(
                f,
                "       Checksum : {:x} - expected {:x}",
                self.checksum, self.checksum_expected
            )?;
        }
        writeln!(f, "         Events : {}", self.events)?;
        writeln!(f)?;
        writeln!(f, "         Layout : {}", self.layout)?;
        writeln!(f, "     Chunk Size : {}K", self.chunk_bytes / 1024)?;
        writeln!(f)?;
        writeln!(f, "    Device Role : {}", self.role)?;
        writeln!(
            f,
            "    Array State : {} ('A' == active, '.' == missing, 'R' == replacing)",
            self.array_state
        )?;
        match &self.unsupported_reason {
            None => writeln!(f, "      ferroraid : can serve this array")?,
            Some(why) => writeln!(f, "      ferroraid : cannot serve this array: {why}")?,
        }
        if let Some(b) = &self.bitmap {
            writeln!(f)?;
            write!(f, "{b}")?;
        }
        if let Some(e) = &self.bitmap_error {
            writeln!(f, "  Internal Bitmap : unreadable: {e}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::geometry::{Geometry, Level};
    use engine::metadata::ppl::{
        PplEntry, PplHeader, MDADM_PPL_OFFSET_SECTORS, MDADM_PPL_SIZE_SECTORS, PPL_HEADER_SIZE,
    };
    use engine::metadata::{MdTime, NewArray, Uuid};
    use rand_chacha::rand_core::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn raid6() -> Vec<Superblock> {
        let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, 64 << 10, 512).unwrap();
        let mut a = NewArray::new(
            g,
            Uuid::random(&mut ChaCha8Rng::seed_from_u64(1)),
            "ferro",
            Some("testhost"),
            MdTime::new(1_700_000_000, 0),
        )
        .unwrap();
        a.clean = true;
        a.superblocks(&[(64 << 20) / 512; 7], &mut ChaCha8Rng::seed_from_u64(2))
            .unwrap()
    }

    #[test]
    fn fields() {
        let sbs = raid6();
        let r = examine_area("/dev/x", &sbs[3].to_area().unwrap()).unwrap();
        assert_eq!(r.role, ExamineRole::Slot(3));
        assert_eq!(r.level, 6);
        assert_eq!(r.layout, "left-symmetric");
        assert_eq!(r.chunk_bytes, 65536);
        assert_eq!(r.raid_devices, 6);
        assert_eq!(r.data_offset_bytes, sbs[3].data_offset * 512);
        assert_eq!(r.array_size_bytes, Some(4 * sbs[3].size * 512));
        assert_eq!(r.state, ExamineState::Clean);
        assert_eq!(r.array_state, "AAAAAA");
        assert!(r.checksum_ok && r.supported && r.unsupported_reason.is_none());
        assert_eq!(r.checksum, sbs[3].checksum().unwrap());
        assert_eq!(r.name, "testhost:ferro");
        let spare = examine_area("/dev/s", &sbs[6].to_area().unwrap()).unwrap();
        assert_eq!(spare.role, ExamineRole::Spare);
        let v = serde_json::to_value(&spare).unwrap();
        assert_eq!(v["role"], "spare");
        assert_eq!(v["state"], "clean");
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["role"], 3);
        let back: ExamineReport = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn bad_checksum_is_shown_and_reported() {
        let mut area = raid6()[0].to_area().unwrap();
        area[SB_CSUM_OFFSET] ^= 0xff;
        let r = examine_area("/dev/x", &area).unwrap();
        assert!(!r.checksum_ok);
        assert_ne!(r.checksum, r.checksum_expected);
        let e = ExamineEntry::Report(Box::new(r));
        assert!(!e.is_ok());
        assert!(e.problem().unwrap().contains("bad superblock checksum"));
        let text = match &e {
            ExamineEntry::Report(r) => r.to_string(),
            ExamineEntry::Failure(_) => unreachable!(),
        };
        assert!(text.contains(" - expected "), "{text}");
    }

    #[test]
    fn unsupported_is_shown_with_the_reason() {
        let mut sb = raid6()[0].clone();
        sb.feature_map = 4; // reshape active
        let r = examine_area("/dev/x", &sb.to_area().unwrap()).unwrap();
        assert!(r.checksum_ok);
        assert!(!r.supported);
        assert!(r
            .unsupported_reason
            .unwrap()
            .contains("MD_FEATURE_RESHAPE_ACTIVE"));
        let mut sb = raid6()[0].clone();
        sb.layout = 18;
        let r = examine_area("/dev/x", &sb.to_area().unwrap()).unwrap();
        assert_eq!(r.layout, "left-symmetric-6");
        assert!(!r.supported);
    }

    /// A RAID5 member with mdadm's PPL (`MD_FEATURE_PPL`, 2048 sectors at +8, data at
    /// 4096 sectors).
    fn ppl_member() -> Superblock {
        let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 64 << 10, 512).unwrap();
        let a = NewArray::new(
            g,
            Uuid::random(&mut ChaCha8Rng::seed_from_u64(3)),
            "ppl",
            None,
            MdTime::new(1_700_000_000, 0),
        )
        .unwrap();
        let mut sb = a
            .superblocks(&[(64 << 20) / 512; 3], &mut ChaCha8Rng::seed_from_u64(4))
            .unwrap()
            .remove(0);
        sb.feature_map = Feature::Ppl.bit();
        sb.set_ppl(MDADM_PPL_OFFSET_SECTORS, MDADM_PPL_SIZE_SECTORS);
        sb.data_offset = sb.data_offset.max(4096);
        sb
    }

    #[test]
    fn ppl_area_is_shown() {
        let sb = ppl_member();
        let r = examine_area("/dev/x", &sb.to_area().unwrap()).unwrap();
        // RAID5 with md's PPL is served (issue 19).
        assert!(r.supported, "{:?}", r.unsupported_reason);
        assert_eq!(r.unsupported_reason, None);
        let p = r.ppl.clone().unwrap();
        assert_eq!(p.offset_from_superblock_bytes, 8 * 512);
        assert_eq!(p.size_bytes, 2048 * 512);
        assert_eq!(p.mode.as_deref(), Some("multiple"));
        assert_eq!((p.records_seen, p.newest), (None, None));
        assert_eq!(r.ppl_error, None);
        let text = r.to_string();
        assert!(
            text.contains("            PPL : 2048 sectors at offset 8 sectors from superblock\n"),
            "{text}"
        );
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["ppl"]["mode"], "multiple");
        assert_eq!(serde_json::from_value::<ExamineReport>(v).unwrap(), r);
        // md's refusals are reported, the line still shown.
        let mut bad = sb.clone();
        bad.data_offset = 2048;
        let r = examine_area("/dev/x", &bad.to_area().unwrap()).unwrap();
        assert!(r
            .ppl_error
            .as_deref()
            .unwrap()
            .contains("overlaps the data area"));
        assert_eq!(r.ppl.unwrap().mode, None);
        // No PPL bit, no PPL lines.
        let r = examine_area("/dev/x", &raid6()[0].to_area().unwrap()).unwrap();
        assert!(!r.to_string().contains("PPL"));
        assert_eq!((r.ppl, r.ppl_error), (None, None));
    }

    /// A RAID6 member of ferroraid's RAID6 PPL: served, the bits named (not an mdadm
    /// line), the PPL line as on RAID5; without the ferroraid bit md's refusal is shown.
    #[test]
    fn raid6_ppl_member_shows_the_feature() {
        let mut sb = ppl_member();
        sb.level = 6;
        sb.raid_disks = 4;
        sb.feature_map |= Feature::Raid6Ppl.bit();
        let r = examine_area("/dev/x", &sb.to_area().unwrap()).unwrap();
        assert!(r.supported, "{:?}", r.unsupported_reason);
        assert_eq!(
            r.features,
            ["MD_FEATURE_PPL", "FERRORAID_FEATURE_RAID6_PPL"]
        );
        assert_eq!(
            r.ppl.as_ref().and_then(|p| p.mode.as_deref()),
            Some("multiple")
        );
        let text = r.to_string();
        assert!(
            text.contains(
                "    Feature Map : 0x1000400\n       Features : MD_FEATURE_PPL, \
                 FERRORAID_FEATURE_RAID6_PPL\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("            PPL : 2048 sectors at offset 8"),
            "{text}"
        );
        // Old JSON without `features` still reads.
        let mut v = serde_json::to_value(&r).unwrap();
        v.as_object_mut().unwrap().remove("features");
        assert!(serde_json::from_value::<ExamineReport>(v)
            .unwrap()
            .features
            .is_empty());
        sb.feature_map = Feature::Ppl.bit();
        let r = examine_area("/dev/x", &sb.to_area().unwrap()).unwrap();
        assert!(!r.supported);
        let why = r.ppl_error.unwrap();
        assert!(
            why.contains("PPL is not compatible with raid level raid6"),
            "{why}"
        );
        assert_eq!(r.unsupported_reason, Some(why));
    }

    #[test]
    fn ppl_area_is_read_from_the_device() {
        let sb = ppl_member();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("member");
        let mut img = vec![0u8; (sb.data_offset * 512) as usize];
        img[4096..8192].copy_from_slice(&sb.to_area().unwrap());
        // The empty header mdadm writes, then a record of generation 4 after it.
        let area = 16 * 512;
        img[area..area + PPL_HEADER_SIZE]
            .copy_from_slice(&PplHeader::empty(&sb.set_uuid).encode().unwrap());
        let rec = PplHeader {
            generation: 4,
            entries: vec![PplEntry::default(); 3],
            ..PplHeader::empty(&sb.set_uuid)
        };
        img[area + 4096..area + 8192].copy_from_slice(&rec.encode().unwrap());
        std::fs::write(&path, &img).unwrap();
        let ExamineEntry::Report(r) = examine_device(&path) else {
            panic!("no report");
        };
        assert_eq!(r.ppl_error, None);
        let p = r.ppl.clone().unwrap();
        assert_eq!(p.records_seen, Some(2));
        assert_eq!(
            p.newest,
            Some(PplRecordReport {
                offset_bytes: 4096,
                generation: 4,
                entries: 3
            })
        );
        let text = r.to_string();
        assert!(
            text.contains("PPL Newest : generation 4, 3 entries, at 8 sectors into the area"),
            "{text}"
        );
        // A device that ends inside the area.
        std::fs::write(&path, &img[..area + 4096]).unwrap();
        let ExamineEntry::Report(r) = examine_device(&path) else {
            panic!("no report");
        };
        assert!(r.ppl_error.unwrap().contains("beyond the end"));
    }

    #[test]
    fn garbage_is_an_error() {
        let e = examine_area("/dev/x", &[0u8; 4096]).unwrap_err();
        assert!(e.to_string().contains("no md superblock"), "{e}");
        assert!(examine_area("/dev/x", &[0u8; 10]).is_err());
        // Random bytes behind a valid magic never panic.
        let mut x = 12345u64;
        for _ in 0..2000 {
            let mut area = raid6()[1].to_area().unwrap();
            for _ in 0..8 {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let at = (x >> 33) as usize % 512;
                area[at] = (x >> 20) as u8;
            }
            if let Ok(r) = examine_area("/dev/x", &area) {
                let _ = r.to_string();
            }
        }
    }

    #[test]
    fn utc() {
        assert_eq!(utc_time(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc_time(1_700_000_000), "2023-11-14 22:13:20 UTC");
        assert_eq!(utc_time(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc_time((1 << 40) - 1), "36812-02-20 00:36:15 UTC");
    }
}
