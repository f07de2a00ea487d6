//! Assembly: which device serves which role, decided from the superblocks alone.
//!
//! md's rules (`drivers/md/md.c` `super_1_load`/`super_1_validate`, mdadm's
//! `Assemble.c`, `Documentation/admin-guide/md.rst`), with one deliberate tightening:
//!
//! 1. All superblocks must be readable (checksum), of one array (`set_uuid`) and of a kind
//!    ferroraid serves ([`super::Superblock::check_supported`]). With `force`, unreadable
//!    ones are skipped instead (and reported).
//! 2. **Freshness is by `events`.** The newest superblock — highest `events` among
//!    devices whose own superblock gives them an active role (spares' counts do not matter:
//!    md does not rewrite spares on every clean/dirty change) — carries the array state:
//!    geometry, `dev_roles`, `resync_offset`.
//! 3. A device is used for role `r` when the newest superblock gives its slot
//!    (`dev_number`) role `r`, its own superblock agrees, and its `events` is at most
//!    [`EVENT_MARGIN`] (1) behind the newest: md's margin for a crash in the middle of a
//!    superblock update, where some members got generation N+1 and others still hold N
//!    (`super_1_validate`: `++ev1; if (ev1 < mddev->events) return -EINVAL`; mdadm:
//!    `event_margin = 1`). Older devices are **stale**: they missed writes and are not used
//!    for data.
//! 4. **Tightening:** a slot that the newest superblock records as faulty is excluded even
//!    when its own `events` is within the margin. md (kernel and mdadm) take the role from
//!    the device's own superblock and so re-admit a member that failed in the very last
//!    update and was then skipped by every later write — the RAID6 corruption reported on
//!    linux-raid ("raid6 corruption after assembling with event counter difference of 1",
//!    2023-11-22). The newest superblock knows better.
//! 5. Spares are devices whose slot the newest superblock calls spare.
//! 6. Two usable devices for one slot (the same device seen twice, or a clone) are an
//!    error: ferroraid will not guess.
//! 7. The array can serve data with at least `raid_disks − parity` members. Fewer: refused;
//!    with `force`, out-of-date members of the missing roles are brought in, freshest first,
//!    like `mdadm --assemble --force` — reported, and the array then needs a resync.
//! 8. **Internal bitmap** (`MD_FEATURE_BITMAP_OFFSET` on the newest superblock): every
//!    current member's bitmap superblock must be readable and belong to the array
//!    ([`super::BitmapSuper::check_against`]) — refused otherwise ([`AssembleError::Bitmap`];
//!    `force` leaves that member out). The array's bitmap is the one of the newest
//!    superblock's device; it is *stale* (every bit counts as dirty, md's "bitmap file is
//!    out of date ... forcing full recovery") when its `events` is below the newest
//!    superblock's or its stale flag is set.
//! 9. **Re-add** (md's `super_1_validate` with a bitmap): a device left out as stale,
//!    recorded faulty, or removed (the newest superblock calls its slot spare), whose own
//!    superblock still holds an active role of the array,
//!    missed writes. If the array has a current (non-stale) bitmap and the device's
//!    `events >= events_cleared`, every write it missed is still marked in the bitmap: it
//!    is re-added to its role with a **bitmap-based recovery** (only dirty regions are
//!    rebuilt; md's `Bitmap_sync`). Otherwise — older than `events_cleared`, no or stale
//!    bitmap, or its role now served by another device — it can only be rebuilt fully,
//!    like a new spare. [`Assembly::re_add`] lists the decisions; the devices stay out of
//!    [`Assembly::members`] until the recovery completes.
//! 10. **Replacement** (md's `Replacement` flag, `MD_FEATURE_REPLACEMENT` on the device's
//!     own superblock; `dev_roles` then gives two slots one role, mdadm's `R`): a current
//!     replacement whose member is current too resumes its replace
//!     ([`Assembly::replacements`], copied below its `recovery_offset`); if the member is
//!     gone (stale, faulty, absent), the replacement becomes the member of the role,
//!     recovering from its `recovery_offset` — md's `raid5_run` moves a replacement into
//!     an empty slot the same way. Two devices claiming one role without the flag are an
//!     error ([`AssembleError::RoleClaimedTwice`]). A replacement is never re-added.
//! 11. **Dirty and degraded** (`resync_offset != MaxSector` and a role missing) is refused
//!     unless `force` (md.rst, "Boot time assembly of degraded/dirty arrays": the parity
//!     of a dirty array cannot be trusted, and a degraded array needs it to reconstruct)
//!     — or unless the array has a Partial Parity Log, whose recovery at assembly makes
//!     that parity right (md's `raid5_run`; [`Assembly::ppl`]), on RAID6 (ferroraid's
//!     extension) with up to two roles missing.

use std::collections::HashMap;
use std::fmt;

use thiserror::Error;

use super::bitmap::{BitmapError, BitmapSuper};
use super::superblock::{DevRole, Feature, Superblock, SuperblockError, MAX_SECTOR};
use super::Uuid;
use crate::geometry::{ArrayGeometry, Geometry};

/// How many generations a member's `events` may lag the newest and still count as
/// current: 1, md's margin for a crash during a superblock update (`super_1_validate`;
/// mdadm `Assemble.c`, `event_margin`). See the module docs.
pub const EVENT_MARGIN: u64 = 1;

/// A device and what was found at its superblock position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The device's name (path), used in every message.
    pub device: String,
    /// Its decoded superblock ([`Superblock::decode`] or [`super::parse`]), or why it could
    /// not be decoded.
    pub superblock: Result<Superblock, SuperblockError>,
    /// Its internal bitmap's superblock ([`BitmapSuper::decode`]) when its superblock has
    /// `MD_FEATURE_BITMAP_OFFSET` and the bitmap was read, or why it could not be decoded;
    /// `None` when not read (no bitmap, or the caller did not read it).
    pub bitmap: Option<Result<BitmapSuper, BitmapError>>,
}

impl Candidate {
    /// A device with a decoded superblock.
    pub fn new(device: impl Into<String>, superblock: Superblock) -> Self {
        Candidate {
            device: device.into(),
            superblock: Ok(superblock),
            bitmap: None,
        }
    }

    /// The same candidate with its bitmap superblock, as read (or why it could not be).
    pub fn with_bitmap(mut self, bitmap: Result<BitmapSuper, BitmapError>) -> Self {
        self.bitmap = Some(bitmap);
        self
    }

    /// A device whose superblock area holds `bytes`: decoded with
    /// [`Superblock::decode`] (support is judged by [`assemble`]).
    pub fn from_bytes(device: impl Into<String>, bytes: &[u8]) -> Self {
        Candidate {
            device: device.into(),
            superblock: Superblock::decode(bytes),
            bitmap: None,
        }
    }

    /// A device whose superblock could not be decoded.
    pub fn unreadable(device: impl Into<String>, error: SuperblockError) -> Self {
        Candidate {
            device: device.into(),
            superblock: Err(error),
            bitmap: None,
        }
    }
}

/// Choices for [`assemble`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AssembleOptions {
    /// `mdadm --force`: skip unreadable superblocks, bring out-of-date members in when too
    /// few current ones remain, and start a dirty degraded array. Everything it overrides
    /// is listed in [`Assembly::forced`].
    pub force: bool,
    /// Logical block size of the array in bytes (512 or 4096): md does not record it; it is
    /// the largest logical block size of the members.
    pub block_bytes: u32,
}

impl Default for AssembleOptions {
    /// No force, 512-byte blocks.
    fn default() -> Self {
        AssembleOptions {
            force: false,
            block_bytes: 512,
        }
    }
}

/// A device serving a role.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Index into the candidates.
    pub candidate: usize,
    /// The device's name.
    pub device: String,
    /// Its slot (`dev_number`).
    pub dev_number: u32,
    /// Its `events`.
    pub events: u64,
    /// Its data area start, sectors (may differ between members).
    pub data_offset_sectors: u64,
    /// Its data area size, sectors.
    pub data_size_sectors: u64,
    /// Whether it was brought in by `force` although out of date or recorded faulty.
    pub forced: bool,
    /// `Some(sectors)` when the member is only partly rebuilt (`MD_FEATURE_RECOVERY_OFFSET`):
    /// its data is valid below this many 512-byte sectors from its data offset, and the
    /// rebuild resumes there (md's `recovery_offset`); `None` when it is in sync.
    pub recovery_offset: Option<u64>,
    /// Whether its recovery covers only the write-intent bitmap's dirty regions
    /// (`MD_FEATURE_RECOVERY_BITMAP`: a re-add in progress) — honoured only when the
    /// array's bitmap is current ([`Assembly::bitmap`] not stale).
    pub bitmap_recovery: bool,
    /// Whether it was a replacement whose member is gone: it serves the role now, being
    /// rebuilt from its `recovery_offset`, and its superblock's `MD_FEATURE_REPLACEMENT`
    /// is to be cleared with the next update.
    pub was_replacement: bool,
}

/// A replacement device whose member is current: its replace resumes
/// ([`Assembly::replacements`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplacementMember {
    /// Index into the candidates.
    pub candidate: usize,
    /// The device's name.
    pub device: String,
    /// The role (member) it replaces.
    pub role: u16,
    /// Its slot (`dev_number`).
    pub dev_number: u32,
    /// Its `events`.
    pub events: u64,
    /// The member's data it holds: 512-byte sectors from the data offset
    /// (`recovery_offset`; [`MAX_SECTOR`] when it has no recovery offset, i.e. it was
    /// copied in full and only the swap was left).
    pub recovery_offset: u64,
}

/// Why a device is not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExclusionReason {
    /// Its superblock could not be decoded (only with `force`; otherwise an error).
    Unreadable(SuperblockError),
    /// More than [`EVENT_MARGIN`] generations behind the newest: it missed writes.
    Stale {
        /// Its `events`.
        events: u64,
        /// The newest `events`.
        newest: u64,
    },
    /// The newest superblock records its slot as faulty.
    RecordedFaulty {
        /// The device whose superblock is the newest.
        by: String,
    },
    /// Its bitmap is unreadable or not the array's (only with `force`; otherwise an error).
    BadBitmap(BitmapError),
    /// Its own superblock and the newest disagree on its role (it missed a role change,
    /// e.g. it was removed from the array).
    RoleChanged {
        /// What its own superblock says.
        own: DevRole,
        /// What the newest says.
        newest: DevRole,
        /// Its `events`.
        events: u64,
    },
}

impl fmt::Display for ExclusionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExclusionReason::Unreadable(e) => write!(f, "unreadable superblock: {e}"),
            ExclusionReason::BadBitmap(e) => write!(f, "bad bitmap: {e}"),
            ExclusionReason::Stale { events, newest } => write!(
                f,
                "stale: events {events}, newest {newest} (more than {EVENT_MARGIN} behind); not used for data"
            ),
            ExclusionReason::RecordedFaulty { by } => {
                write!(f, "recorded as faulty by the newest superblock (on {by})")
            }
            ExclusionReason::RoleChanged { own, newest, events } => write!(
                f,
                "its superblock (events {events}) says {own}, the newest says {newest}: it missed a role change"
            ),
        }
    }
}

/// A device not used, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exclusion {
    /// Index into the candidates.
    pub candidate: usize,
    /// The device's name.
    pub device: String,
    /// Why.
    pub reason: ExclusionReason,
}

/// Something `force` overrode. Each is a risk the operator accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ForcedAction {
    /// A device with an unreadable superblock was left out instead of refusing.
    SkippedUnreadable {
        /// The device.
        device: String,
    },
    /// An out-of-date (or recorded-faulty) member was used for its role to reach enough
    /// members: its data may be older than the rest; a resync will make parity match it.
    IncludedOutOfDate {
        /// The device.
        device: String,
        /// The role it serves.
        role: u16,
        /// Its `events`.
        events: u64,
        /// The newest `events`.
        newest: u64,
    },
    /// A member whose bitmap could not be read or does not belong to the array was left
    /// out.
    SkippedBadBitmap {
        /// The device.
        device: String,
        /// Why its bitmap was refused.
        error: BitmapError,
    },
    /// The array is dirty and degraded: data in stripes written at the crash may be wrong
    /// and cannot be detected (md.rst, "Boot time assembly of degraded/dirty arrays").
    StartedDirtyDegraded {
        /// Roles with no member.
        missing_roles: Vec<u16>,
    },
}

impl fmt::Display for ForcedAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ForcedAction::SkippedUnreadable { device } => {
                write!(f, "forced: skipped {device} (unreadable superblock)")
            }
            ForcedAction::IncludedOutOfDate {
                device,
                role,
                events,
                newest,
            } => write!(
                f,
                "forced: using out-of-date {device} (events {events}, newest {newest}) as role {role}; \
                 its data may be old and the array will be resynced"
            ),
            ForcedAction::SkippedBadBitmap { device, error } => {
                write!(f, "forced: left out {device} (bad bitmap: {error})")
            }
            ForcedAction::StartedDirtyDegraded { missing_roles } => write!(
                f,
                "forced: starting a dirty degraded array (missing roles {missing_roles:?}); \
                 stripes being written at the crash may hold undetectable corruption"
            ),
        }
    }
}

/// The array's write-intent bitmap as assembly found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArrayBitmap {
    /// Index of the candidate whose bitmap is the array's (the newest superblock's).
    pub source: usize,
    /// Its bitmap superblock.
    pub super_: BitmapSuper,
    /// Whether it is stale: its `events` is below the newest superblock's, or its stale
    /// flag is set. Every bit then counts as dirty, and no member can be re-added with a
    /// bitmap-based recovery.
    pub stale: bool,
}

/// Why a returning device needs a full rebuild rather than a bitmap-based recovery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FullRebuildReason {
    /// The array has no internal bitmap.
    NoBitmap,
    /// The array's bitmap is stale ([`ArrayBitmap::stale`]).
    StaleBitmap,
    /// The device is older than the last bit clearing: writes it missed may no longer be
    /// marked (`events < events_cleared`, md's `super_1_validate`).
    OlderThanEventsCleared {
        /// The device's `events`.
        events: u64,
        /// The bitmap's `events_cleared`.
        events_cleared: u64,
    },
    /// Its role is served by another device now.
    RoleTaken,
    /// It was itself being rebuilt (`MD_FEATURE_RECOVERY_OFFSET` without
    /// `MD_FEATURE_RECOVERY_BITMAP`): its data beyond `recovery_offset` was never there
    /// (md's `super_1_validate` sets `saved_raid_disk = -1`: full recovery).
    PartlyRecovered {
        /// Its `recovery_offset`, sectors.
        recovery_offset: u64,
    },
    /// It was a replacement in progress: a partial copy, never a member.
    Replacement,
}

impl fmt::Display for FullRebuildReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FullRebuildReason::NoBitmap => f.write_str("the array has no write-intent bitmap"),
            FullRebuildReason::StaleBitmap => f.write_str("the array's bitmap is stale"),
            FullRebuildReason::OlderThanEventsCleared {
                events,
                events_cleared,
            } => write!(
                f,
                "its events {events} are older than the bitmap's events_cleared {events_cleared}"
            ),
            FullRebuildReason::RoleTaken => f.write_str("its role is served by another device"),
            FullRebuildReason::PartlyRecovered { recovery_offset } => write!(
                f,
                "it was itself being rebuilt (recovered only up to sector {recovery_offset})"
            ),
            FullRebuildReason::Replacement => {
                f.write_str("it was a replacement in progress, never a member")
            }
        }
    }
}

/// How a returning device gets its data back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// Rebuild only the regions the array's bitmap marks dirty (md's `Bitmap_sync`).
    Bitmap,
    /// Rebuild everything, as onto a new spare.
    Full(FullRebuildReason),
}

/// A device that missed writes and comes back (md's re-add decision).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReAdd {
    /// Index into the candidates.
    pub candidate: usize,
    /// The device.
    pub device: String,
    /// The role its own superblock holds (the one it returns to for a bitmap recovery).
    pub role: u16,
    /// Its `events`.
    pub events: u64,
    /// How it is recovered.
    pub recovery: Recovery,
}

impl fmt::Display for ReAdd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.recovery {
            Recovery::Bitmap => write!(
                f,
                "{} (role {}, events {}) can be re-added: bitmap-based recovery of the dirty regions only",
                self.device, self.role, self.events
            ),
            Recovery::Full(r) => write!(
                f,
                "{} (role {}, events {}) needs a full rebuild: {r}",
                self.device, self.role, self.events
            ),
        }
    }
}

/// The decision: how to run the array.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assembly {
    /// The array's geometry and capacity (from the newest superblock).
    pub array: ArrayGeometry,
    /// The array UUID.
    pub uuid: Uuid,
    /// The array name (`set_name`).
    pub name: String,
    /// The newest `events`.
    pub events: u64,
    /// Index of the candidate holding the newest superblock (the array state's source).
    pub newest: usize,
    /// The member serving each role (`members[r]`), `None` where the role is missing.
    pub members: Vec<Option<Member>>,
    /// Candidates that are spares.
    pub spares: Vec<usize>,
    /// Candidates not used, with reasons.
    pub excluded: Vec<Exclusion>,
    /// Roles with no member.
    pub missing_roles: Vec<u16>,
    /// Whether a role is missing (the array runs on its redundancy).
    pub degraded: bool,
    /// The newest `resync_offset`, sectors from the data offset (`MaxSector` if clean).
    pub resync_offset: u64,
    /// Whether a resync is needed: the array was not clean (`resync_offset != MaxSector`),
    /// or `force` brought in out-of-date members.
    pub resync_needed: bool,
    /// What `force` overrode (empty when not forced).
    pub forced: Vec<ForcedAction>,
    /// The internal write-intent bitmap, when the array has one.
    pub bitmap: Option<ArrayBitmap>,
    /// The Partial Parity Log area (the newest superblock's; every member's lies at the
    /// same place), when the array has one (`--consistency-policy ppl`: md's on RAID5,
    /// ferroraid's `FERRORAID_FEATURE_RAID6_PPL` extension on RAID6).
    pub ppl: Option<super::ppl::PplArea>,
    /// Devices that missed writes and can come back, and how (also listed in
    /// `excluded`).
    pub re_add: Vec<ReAdd>,
    /// Replacement devices whose member is current: their replace resumes.
    pub replacements: Vec<ReplacementMember>,
}

impl Assembly {
    /// The stripe geometry.
    pub fn geometry(&self) -> &Geometry {
        self.array.geometry()
    }

    /// One line per notable fact, for logs and the CLI: degraded start, resync, exclusions
    /// and everything forced.
    pub fn notes(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.degraded {
            v.push(format!(
                "degraded start: roles {:?} missing, running on redundancy",
                self.missing_roles
            ));
        }
        if self.resync_needed && self.ppl.is_some() {
            v.push(
                "not shut down cleanly: the Partial Parity Log is recovered before the first \
                 request"
                    .to_string(),
            );
        } else if self.resync_needed {
            v.push(format!(
                "resync needed from sector {} of each member's data area",
                if self.resync_offset == MAX_SECTOR {
                    0
                } else {
                    self.resync_offset
                }
            ));
        }
        for e in &self.excluded {
            v.push(format!("{} not used: {}", e.device, e.reason));
        }
        if let Some(b) = &self.bitmap {
            if b.stale {
                v.push(format!(
                    "write-intent bitmap is stale (bitmap events {}, array events {}): every region counts as dirty",
                    b.super_.events, self.events
                ));
            }
        }
        for r in &self.re_add {
            v.push(r.to_string());
        }
        for r in &self.replacements {
            v.push(format!(
                "{} replaces role {} (copied up to sector {}): the replace resumes",
                r.device, r.role, r.recovery_offset
            ));
        }
        for m in self.members.iter().flatten().filter(|m| m.was_replacement) {
            v.push(format!(
                "{} was replacing a member that is gone: it takes the role and is rebuilt \
                 from sector {}",
                m.device,
                m.recovery_offset.unwrap_or(0)
            ));
        }
        for f in &self.forced {
            v.push(f.to_string());
        }
        v
    }
}

/// Why an array could not be assembled. Every variant names the device(s) concerned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AssembleError {
    /// No candidate with a readable superblock.
    #[error("no device with a readable md superblock")]
    NoCandidates,
    /// A superblock could not be decoded (bad checksum, no magic, ...).
    #[error("{device}: {source} (leave the device out, or use force to assemble without it)")]
    Unreadable {
        /// The device.
        device: String,
        /// Why.
        source: SuperblockError,
    },
    /// A device of another array among the candidates.
    #[error("{device} is a member of array {uuid}, not of array {array_uuid} (as {reference} is)")]
    ForeignArray {
        /// The device.
        device: String,
        /// Its array UUID.
        uuid: Uuid,
        /// The UUID most candidates carry.
        array_uuid: Uuid,
        /// A device carrying `array_uuid`.
        reference: String,
    },
    /// A superblock ferroraid cannot serve (feature, level, layout, chunk, offsets).
    #[error("{device}: {source}")]
    Unsupported {
        /// The device.
        device: String,
        /// Why.
        source: SuperblockError,
    },
    /// A current member whose superblock disagrees with the newest on an array-wide field.
    #[error("{device} disagrees with the newest superblock (on {newest}) about {field}: split brain or corruption")]
    Inconsistent {
        /// The device.
        device: String,
        /// The device with the newest superblock.
        newest: String,
        /// The field.
        field: &'static str,
    },
    /// Two usable devices for one slot.
    #[error(
        "{first} and {second} both claim slot {dev_number} ({role}){}",
        if *.same_device_uuid { "; same device UUID: the same device twice, or a clone" } else { "" }
    )]
    DuplicateRole {
        /// The slot.
        dev_number: u32,
        /// Its role.
        role: DevRole,
        /// First device.
        first: String,
        /// Second device.
        second: String,
        /// Whether their `device_uuid`s are equal.
        same_device_uuid: bool,
    },
    /// Two devices claim one role and neither is a replacement.
    #[error(
        "{first} and {second} both claim role {role} and neither is a replacement \
         (MD_FEATURE_REPLACEMENT): split brain or corruption"
    )]
    RoleClaimedTwice {
        /// The role.
        role: u16,
        /// First device.
        first: String,
        /// Second device.
        second: String,
    },
    /// No device has an active role of its own.
    #[error("no active member among the devices ({spares} spare(s)): nothing to assemble")]
    NoActiveMembers {
        /// Spares found.
        spares: usize,
    },
    /// Too few current members to serve data.
    #[error(
        "too few members to serve data: {available} current of {raid_disks}, {needed} needed; \
         missing roles {missing_roles:?}{}",
        stale_hint(stale)
    )]
    TooFewMembers {
        /// Current members found.
        available: usize,
        /// Members needed (`raid_disks − parity`).
        needed: usize,
        /// Members of the complete array.
        raid_disks: u16,
        /// Roles with no current member.
        missing_roles: Vec<u16>,
        /// Out-of-date devices that `force` could use, with their reason.
        stale: Vec<String>,
    },
    /// A current member's bitmap is unreadable or not the array's.
    #[error("{device}: {source} (leave the device out, or use force to assemble without it)")]
    Bitmap {
        /// The device.
        device: String,
        /// Why.
        source: BitmapError,
    },
    /// Dirty and degraded: refused without force (md.rst).
    #[error(
        "array is dirty (resync_offset {resync_offset}) and degraded (missing roles \
         {missing_roles:?}): parity cannot be trusted to rebuild the missing data \
         (md.rst, \"Boot time assembly of degraded/dirty arrays\"); use force to start anyway"
    )]
    DirtyDegraded {
        /// The newest `resync_offset`.
        resync_offset: u64,
        /// Roles with no member.
        missing_roles: Vec<u16>,
    },
}

fn stale_hint(stale: &[String]) -> String {
    if stale.is_empty() {
        String::new()
    } else {
        format!(
            "; out-of-date devices force could use: {}",
            stale.join(", ")
        )
    }
}

/// Decides how to assemble an array from `candidates` (any order). Pure: no I/O. See the
/// module docs for md's rules and the one place ferroraid is stricter.
///
/// # Errors
/// [`AssembleError::NoCandidates`]; [`AssembleError::Unreadable`] (without force);
/// [`AssembleError::ForeignArray`]; [`AssembleError::Unsupported`];
/// [`AssembleError::NoActiveMembers`]; [`AssembleError::Inconsistent`];
/// [`AssembleError::DuplicateRole`]; [`AssembleError::Bitmap`] (without force);
/// [`AssembleError::TooFewMembers`] (without force, or
/// when force cannot find enough either); [`AssembleError::DirtyDegraded`] (without force).
pub fn assemble(
    candidates: &[Candidate],
    options: AssembleOptions,
) -> Result<Assembly, AssembleError> {
    let mut excluded = Vec::new();
    let mut forced = Vec::new();

    // 1. Readable superblocks.
    let mut readable: Vec<(usize, &Superblock)> = Vec::new();
    for (i, c) in candidates.iter().enumerate() {
        match &c.superblock {
            Ok(sb) => readable.push((i, sb)),
            Err(e) if options.force => {
                excluded.push(Exclusion {
                    candidate: i,
                    device: c.device.clone(),
                    reason: ExclusionReason::Unreadable(e.clone()),
                });
                forced.push(ForcedAction::SkippedUnreadable {
                    device: c.device.clone(),
                });
            }
            Err(e) => {
                return Err(AssembleError::Unreadable {
                    device: c.device.clone(),
                    source: e.clone(),
                })
            }
        }
    }
    if readable.is_empty() {
        return Err(AssembleError::NoCandidates);
    }
    let dev = |i: usize| candidates[i].device.clone();

    // 2. One array: the UUID most devices carry (the first such on ties).
    let mut counts: HashMap<Uuid, (usize, usize)> = HashMap::new();
    for (order, &(_, sb)) in readable.iter().enumerate() {
        counts.entry(sb.set_uuid).or_insert((0, order)).0 += 1;
    }
    let (&array_uuid, &(_, ref_order)) = counts
        .iter()
        .max_by(|a, b| a.1 .0.cmp(&b.1 .0).then(b.1 .1.cmp(&a.1 .1)))
        .expect("readable is not empty");
    let reference = readable[ref_order].0;
    for &(i, sb) in &readable {
        if sb.set_uuid != array_uuid {
            return Err(AssembleError::ForeignArray {
                device: dev(i),
                uuid: sb.set_uuid,
                array_uuid,
                reference: dev(reference),
            });
        }
    }

    // 3. Supported.
    for &(i, sb) in &readable {
        sb.check_supported()
            .map_err(|source| AssembleError::Unsupported {
                device: dev(i),
                source,
            })?;
    }

    // 4. The newest superblock among devices with an active role of their own.
    let (newest_i, newest) = readable
        .iter()
        .copied()
        .filter(|(_, sb)| matches!(sb.role(), DevRole::Active(_)))
        .max_by(|(ia, a), (ib, b)| a.events.cmp(&b.events).then(ib.cmp(ia)))
        .ok_or(AssembleError::NoActiveMembers {
            spares: readable.len(),
        })?;
    let array = newest
        .array_geometry(options.block_bytes)
        .map_err(|source| AssembleError::Unsupported {
            device: dev(newest_i),
            source,
        })?;
    let raid_disks = array.geometry().members();

    // 5. Classify every readable device by what the newest superblock says of its slot.
    let mut members: Vec<Option<Member>> = vec![None; usize::from(raid_disks)];
    let mut spares: Vec<usize> = Vec::new();
    let mut slot_user: HashMap<u32, usize> = HashMap::new();
    let claim = |slot_user: &mut HashMap<u32, usize>, i: usize, sb: &Superblock| {
        if let Some(&other) = slot_user.get(&sb.dev_number) {
            let osb = candidates[other]
                .superblock
                .as_ref()
                .expect("only readable candidates claim slots");
            return Err(AssembleError::DuplicateRole {
                dev_number: sb.dev_number,
                role: newest.role_of(sb.dev_number),
                first: dev(other),
                second: dev(i),
                same_device_uuid: osb.device_uuid == sb.device_uuid,
            });
        }
        slot_user.insert(sb.dev_number, i);
        Ok(())
    };
    let mut found_replacements: Vec<(usize, u16)> = Vec::new();
    for &(i, sb) in &readable {
        let now = newest.role_of(sb.dev_number);
        let own = sb.role();
        let current = sb.events.saturating_add(EVENT_MARGIN) >= newest.events;
        let reason = match now {
            DevRole::Active(r) if own == now && current => {
                check_consistent(i, sb, newest_i, newest, &dev)?;
                claim(&mut slot_user, i, sb)?;
                if sb.is_replacement() {
                    found_replacements.push((i, r));
                    continue;
                }
                if let Some(m) = &members[usize::from(r)] {
                    return Err(AssembleError::RoleClaimedTwice {
                        role: r,
                        first: m.device.clone(),
                        second: dev(i),
                    });
                }
                members[usize::from(r)] = Some(Member {
                    candidate: i,
                    device: dev(i),
                    dev_number: sb.dev_number,
                    events: sb.events,
                    data_offset_sectors: sb.data_offset,
                    data_size_sectors: sb.data_size,
                    forced: false,
                    recovery_offset: sb.recovering(),
                    bitmap_recovery: sb.recovers_by_bitmap(),
                    was_replacement: false,
                });
                continue;
            }
            DevRole::Active(_) if own == now => ExclusionReason::Stale {
                events: sb.events,
                newest: newest.events,
            },
            DevRole::Spare if own == DevRole::Spare => {
                claim(&mut slot_user, i, sb)?;
                spares.push(i);
                continue;
            }
            DevRole::Spare | DevRole::Active(_) => ExclusionReason::RoleChanged {
                own,
                newest: now,
                events: sb.events,
            },
            // check_supported admits only active, spare and faulty roles.
            DevRole::Faulty | DevRole::Journal | DevRole::Invalid(_) => {
                ExclusionReason::RecordedFaulty { by: dev(newest_i) }
            }
        };
        excluded.push(Exclusion {
            candidate: i,
            device: dev(i),
            reason,
        });
    }

    // 5a. Replacements: resumed beside a current member, else the member of the role.
    let mut replacements: Vec<ReplacementMember> = Vec::new();
    for (i, r) in found_replacements {
        let sb = candidates[i]
            .superblock
            .as_ref()
            .expect("replacements are readable");
        let copied = sb.recovering().unwrap_or(MAX_SECTOR);
        match &members[usize::from(r)] {
            Some(_) => {
                if let Some(other) = replacements.iter().find(|x| x.role == r) {
                    return Err(AssembleError::RoleClaimedTwice {
                        role: r,
                        first: other.device.clone(),
                        second: dev(i),
                    });
                }
                replacements.push(ReplacementMember {
                    candidate: i,
                    device: dev(i),
                    role: r,
                    dev_number: sb.dev_number,
                    events: sb.events,
                    recovery_offset: copied,
                });
            }
            None => {
                members[usize::from(r)] = Some(Member {
                    candidate: i,
                    device: dev(i),
                    dev_number: sb.dev_number,
                    events: sb.events,
                    data_offset_sectors: sb.data_offset,
                    data_size_sectors: sb.data_size,
                    forced: false,
                    recovery_offset: (copied != MAX_SECTOR).then_some(copied),
                    bitmap_recovery: false,
                    was_replacement: true,
                });
            }
        }
    }

    // 5b. Bitmaps of the current members.
    let has_bitmap = newest.feature_map & Feature::BitmapOffset.bit() != 0;
    for slot in members.iter_mut() {
        let Some(m) = slot else { continue };
        let c = &candidates[m.candidate];
        let sb = c.superblock.as_ref().expect("members are readable");
        if !has_bitmap && sb.feature_map & Feature::BitmapOffset.bit() == 0 {
            continue;
        }
        let checked = match &c.bitmap {
            None => Err(BitmapError::NotRead),
            Some(Err(e)) => Err(e.clone()),
            Some(Ok(b)) if !has_bitmap => {
                // A member with a bitmap the newest superblock no longer has (removed by
                // --grow --bitmap=none at a generation this member saw as current): fine.
                let _ = b;
                Ok(())
            }
            Some(Ok(b)) => b.check_against(sb),
        };
        if let Err(error) = checked {
            if !options.force {
                return Err(AssembleError::Bitmap {
                    device: m.device.clone(),
                    source: error,
                });
            }
            forced.push(ForcedAction::SkippedBadBitmap {
                device: m.device.clone(),
                error: error.clone(),
            });
            excluded.push(Exclusion {
                candidate: m.candidate,
                device: m.device.clone(),
                reason: ExclusionReason::BadBitmap(error),
            });
            *slot = None;
        }
    }
    let bitmap_of = |i: usize| match &candidates[i].bitmap {
        Some(Ok(b)) => Some(b),
        _ => None,
    };
    let bitmap = if has_bitmap {
        let source = members
            .iter()
            .flatten()
            .map(|m| m.candidate)
            .filter(|&i| bitmap_of(i).is_some())
            .max_by_key(|&i| {
                (
                    i == newest_i,
                    bitmap_of(i).map(|b| b.events),
                    std::cmp::Reverse(i),
                )
            });
        source.map(|i| {
            let b = bitmap_of(i).expect("filtered").clone();
            ArrayBitmap {
                source: i,
                stale: b.is_stale() || b.events < newest.events,
                super_: b,
            }
        })
    } else {
        None
    };

    // 6. Enough members to serve data?
    let needed = usize::from(array.geometry().data_chunks());
    let available = members.iter().filter(|m| m.is_some()).count();
    let missing = |members: &[Option<Member>]| -> Vec<u16> {
        (0..raid_disks)
            .filter(|&r| members[usize::from(r)].is_none())
            .collect()
    };
    let mut resync_needed = newest.resync_offset != MAX_SECTOR;
    if available < needed {
        // Out-of-date devices whose own superblock holds a missing role, freshest first.
        let mut usable: Vec<(usize, u16, u64)> = excluded
            .iter()
            .filter(|e| !matches!(e.reason, ExclusionReason::Unreadable(_)))
            .filter_map(|e| {
                let sb = candidates[e.candidate].superblock.as_ref().ok()?;
                match sb.role() {
                    DevRole::Active(r)
                        if u32::from(r) < u32::from(raid_disks)
                            && members[usize::from(r)].is_none()
                            && same_shape(sb, newest) =>
                    {
                        Some((e.candidate, r, sb.events))
                    }
                    _ => None,
                }
            })
            .collect();
        usable.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
        if !options.force {
            return Err(AssembleError::TooFewMembers {
                available,
                needed,
                raid_disks,
                missing_roles: missing(&members),
                stale: usable
                    .iter()
                    .map(|&(i, r, ev)| format!("{} (role {r}, events {ev})", dev(i)))
                    .collect(),
            });
        }
        let mut have = available;
        for (i, r, events) in usable {
            if have >= needed {
                break;
            }
            if members[usize::from(r)].is_some() {
                continue;
            }
            let sb = candidates[i]
                .superblock
                .as_ref()
                .expect("usable candidates are readable");
            claim(&mut slot_user, i, sb)?;
            members[usize::from(r)] = Some(Member {
                candidate: i,
                device: dev(i),
                dev_number: sb.dev_number,
                events,
                data_offset_sectors: sb.data_offset,
                data_size_sectors: sb.data_size,
                forced: true,
                recovery_offset: sb.recovering(),
                bitmap_recovery: false,
                was_replacement: false,
            });
            excluded.retain(|e| e.candidate != i);
            forced.push(ForcedAction::IncludedOutOfDate {
                device: dev(i),
                role: r,
                events,
                newest: newest.events,
            });
            resync_needed = true;
            have += 1;
        }
        if have < needed {
            return Err(AssembleError::TooFewMembers {
                available: have,
                needed,
                raid_disks,
                missing_roles: missing(&members),
                stale: Vec::new(),
            });
        }
    }
    let missing_roles = missing(&members);
    let degraded = !missing_roles.is_empty();

    // 6b. Re-add decisions for devices that missed writes.
    let mut re_add = Vec::new();
    for e in &excluded {
        // Missed writes: behind by events, recorded faulty (failed), or failed and removed
        // (md's `super_1_sync` then leaves the slot 0xffff): md re-adds by the device's own
        // role in all three cases (`super_1_validate`).
        let missed_writes = match &e.reason {
            ExclusionReason::Stale { .. } | ExclusionReason::RecordedFaulty { .. } => true,
            ExclusionReason::RoleChanged { newest, .. } => {
                matches!(newest, DevRole::Spare | DevRole::Faulty)
            }
            ExclusionReason::Unreadable(_) | ExclusionReason::BadBitmap(_) => false,
        };
        if !missed_writes {
            continue;
        }
        let Ok(sb) = &candidates[e.candidate].superblock else {
            continue;
        };
        let DevRole::Active(role) = sb.role() else {
            continue;
        };
        if u32::from(role) >= u32::from(raid_disks) || !same_shape(sb, newest) {
            continue;
        }
        let recovery = readd_recovery(
            sb,
            bitmap.as_ref().map(|b| ReaddBitmap {
                events_cleared: b.super_.events_cleared,
                stale: b.stale,
            }),
            members[usize::from(role)].is_some(),
        );
        re_add.push(ReAdd {
            candidate: e.candidate,
            device: e.device.clone(),
            role,
            events: sb.events,
            recovery,
        });
    }

    // 7. Dirty and degraded — allowed with a Partial Parity Log: its recovery makes the
    // parity of every stripe written at the crash consistent before the first request, so
    // a missing member reads back right wherever it was not itself written (md's
    // `raid5_run`: "starting dirty degraded array with PPL").
    let ppl = newest.ppl_area().ok().flatten();
    if degraded && newest.resync_offset != MAX_SECTOR && ppl.is_none() {
        if !options.force {
            return Err(AssembleError::DirtyDegraded {
                resync_offset: newest.resync_offset,
                missing_roles,
            });
        }
        forced.push(ForcedAction::StartedDirtyDegraded {
            missing_roles: missing_roles.clone(),
        });
    }

    Ok(Assembly {
        array,
        uuid: array_uuid,
        name: newest.name(),
        events: newest.events,
        newest: newest_i,
        members,
        spares,
        excluded,
        missing_roles,
        degraded,
        resync_offset: newest.resync_offset,
        resync_needed,
        forced,
        bitmap,
        ppl,
        re_add,
        replacements,
    })
}

/// The array's write-intent bitmap as a re-add decision needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReaddBitmap {
    /// The bitmap's `events_cleared` (array `events` when bits were last cleared).
    pub events_cleared: u64,
    /// Whether the bitmap is stale (every bit counts as dirty).
    pub stale: bool,
}

/// md's re-add rule (`super_1_validate` when the array has a bitmap; `md_bitmap`'s
/// `events_cleared`) for a device coming back with superblock `sb` to the role its own
/// superblock holds: [`Recovery::Bitmap`] when the array has a current bitmap
/// (`bitmap`, not stale), the device's `events` is not below its `events_cleared` (no
/// bit was cleared since it left, so the bits cover every write it missed), it was not
/// itself a partial copy (a replacement, or a rebuild not guided by the bitmap:
/// `MD_FEATURE_RECOVERY_OFFSET` without `MD_FEATURE_RECOVERY_BITMAP`), and its role is
/// free (`role_taken` false); else [`Recovery::Full`] with the first reason that applies.
/// Used by assembly and by a running target's `member_add`.
pub fn readd_recovery(sb: &Superblock, bitmap: Option<ReaddBitmap>, role_taken: bool) -> Recovery {
    if role_taken {
        return Recovery::Full(FullRebuildReason::RoleTaken);
    }
    if sb.is_replacement() {
        return Recovery::Full(FullRebuildReason::Replacement);
    }
    if let Some(recovery_offset) = sb.recovering().filter(|_| !sb.recovers_by_bitmap()) {
        return Recovery::Full(FullRebuildReason::PartlyRecovered { recovery_offset });
    }
    match bitmap {
        None => Recovery::Full(FullRebuildReason::NoBitmap),
        Some(b) if b.stale => Recovery::Full(FullRebuildReason::StaleBitmap),
        Some(b) if sb.events < b.events_cleared => {
            Recovery::Full(FullRebuildReason::OlderThanEventsCleared {
                events: sb.events,
                events_cleared: b.events_cleared,
            })
        }
        Some(_) => Recovery::Bitmap,
    }
}

/// Whether `sb` describes the same array shape as `newest` (so its data, however old,
/// is laid out the same way).
fn same_shape(sb: &Superblock, newest: &Superblock) -> bool {
    sb.ctime == newest.ctime
        && sb.level == newest.level
        && sb.layout == newest.layout
        && sb.chunksize == newest.chunksize
        && sb.raid_disks == newest.raid_disks
        && sb.size == newest.size
}

/// A current member must agree with the newest superblock on the array's constant fields,
/// and — at the same generation — on its state (`dev_roles`, `resync_offset`): md writes
/// the same values to every member in one update.
fn check_consistent(
    i: usize,
    sb: &Superblock,
    newest_i: usize,
    newest: &Superblock,
    dev: &dyn Fn(usize) -> String,
) -> Result<(), AssembleError> {
    let field = if sb.ctime != newest.ctime {
        Some("ctime")
    } else if sb.level != newest.level {
        Some("level")
    } else if sb.layout != newest.layout {
        Some("layout")
    } else if sb.chunksize != newest.chunksize {
        Some("chunksize")
    } else if sb.raid_disks != newest.raid_disks {
        Some("raid_disks")
    } else if sb.size != newest.size {
        Some("size")
    } else if sb.events == newest.events && sb.resync_offset != newest.resync_offset {
        Some("resync_offset")
    } else if sb.events == newest.events
        && (sb.consistency_policy() != newest.consistency_policy()
            || (sb.feature_map ^ newest.feature_map) & super::FERRORAID_FEATURE_RAID6_PPL != 0)
    {
        // One update writes the policy bits to every member (`grow`, create): members
        // of one generation that differ would run the array under two policies.
        Some("consistency policy (feature_map)")
    } else if sb.events == newest.events && {
        let n = sb.max_dev().max(newest.max_dev()) as u32;
        (0..n).any(|s| sb.role_of(s) != newest.role_of(s))
    } {
        Some("dev_roles")
    } else {
        None
    };
    match field {
        Some(field) => Err(AssembleError::Inconsistent {
            device: dev(i),
            newest: dev(newest_i),
            field,
        }),
        None => Ok(()),
    }
}
