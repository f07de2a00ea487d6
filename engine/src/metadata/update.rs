//! The superblock-update rule: from the current superblocks, the next generation.
//!
//! Every state change of the array (a member failed, clean ↔ dirty, resync progress) is
//! recorded by writing a new superblock to every working member, each with `events` one
//! higher than the newest current one. This is md's `md_update_sb` / `super_1_sync`.
//!
//! **Why a crash in the middle leaves a consistent newest set.** Each member's superblock
//! is self-contained: it carries the whole array state (every slot's role in `dev_roles`,
//! `resync_offset`, geometry) and its own `events`. Writing generation N+1 rewrites each
//! member's 4 KiB independently, so after a crash every member holds either its complete
//! generation N or its complete generation N+1 (a torn 4 KiB write fails the checksum and
//! that member reads as unreadable, like a missing one). Assembly
//! ([`super::assemble`]) takes the array state from a superblock with the highest
//! `events` and accepts members up to [`super::EVENT_MARGIN`] (one) generation behind —
//! exactly the members that missed only the interrupted write — while a member that
//! generation N+1 records as faulty is excluded whatever its own count says.
//!
//! That is safe only under md's write ordering, which the caller must keep:
//! 1. never start generation N+2 before generation N+1 is durable (written and
//!    `sync_data`) on every member it was written to;
//! 2. never issue a data write that relies on generation N+1 (writing while dirty, or
//!    writing past a newly failed member) before generation N+1 is durable everywhere;
//! 3. if writing a member's superblock fails, mark that member failed in generation N+2
//!    before any further data write (so a member one generation behind never missed data).

use thiserror::Error;

use super::assemble::EVENT_MARGIN;
use super::superblock::{
    DevRole, Feature, Superblock, DEV_ROLE_FAULTY, DEV_ROLE_SPARE, MAX_DEV_LIMIT, MAX_SECTOR,
};
use super::{MdTime, Uuid};

/// The new `resync_offset` of an update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resync {
    /// The array is clean: `resync_offset` = `MaxSector`. md writes this after no write has
    /// been seen for `safe_mode_delay` (md.rst, "safe_mode_delay").
    Clean,
    /// The array is dirty: `resync_offset` = 0. md writes this before the first write to a
    /// clean array; after a crash the whole array is resynced.
    Dirty,
    /// A resync got this far: sectors (from `data_offset`) known in sync.
    At(u64),
}

impl Resync {
    /// The `resync_offset` value.
    pub fn offset(self) -> u64 {
        match self {
            Resync::Clean => MAX_SECTOR,
            Resync::Dirty => 0,
            Resync::At(s) => s,
        }
    }
}

/// One state change to record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Update {
    /// The new `utime`.
    pub utime: MdTime,
    /// Slots (`dev_number`s) to record as faulty (`dev_roles[slot] = 0xfffe`).
    pub failed: Vec<u32>,
    /// The new `resync_offset`, or `None` to keep the newest one.
    pub resync: Option<Resync>,
    /// Slots given a new role: `(dev_number, role)` with a role number, or
    /// [`super::superblock::DEV_ROLE_SPARE`] (`0xffff`) for a spare. `dev_roles` grows to
    /// hold a new slot (md's `max_dev`). A replacement taking a failed member's role gets
    /// the role on its own slot, and the failed slot is recorded faulty (`failed`).
    pub roles: Vec<(u32, u16)>,
    /// Rebuild progress of members being rebuilt: `(dev_number, Some(sectors))` sets
    /// `MD_FEATURE_RECOVERY_OFFSET` and `recovery_offset` on that member's superblock
    /// (valid below that many sectors from its data offset); `(dev_number, None)` marks it
    /// in sync (feature cleared, `recovery_offset` 0), as md's `super_1_sync` writes them.
    pub recovery: Vec<(u32, Option<u64>)>,
    /// Per-device feature bits to set (`true`) or clear (`false`) on that member's own
    /// superblock, `(dev_number, feature, set)`: [`Feature::Replacement`] on a device
    /// replacing the member of its role (md's `super_1_sync` sets it while the
    /// `Replacement` flag is on), [`Feature::RecoveryBitmap`] on a member recovered from
    /// the bitmap (set only together with a recovery offset; marking a member in sync
    /// through `recovery` clears it).
    pub features: Vec<(u32, Feature, bool)>,
}

impl Update {
    /// An update at `utime` that changes nothing but the generation.
    pub fn at(utime: MdTime) -> Self {
        Update {
            utime,
            failed: Vec::new(),
            resync: None,
            roles: Vec::new(),
            recovery: Vec::new(),
            features: Vec::new(),
        }
    }
}

/// Why the next generation could not be built.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum UpdateError {
    /// No superblocks given.
    #[error("no superblocks to update")]
    Empty,
    /// A superblock of another array among the ones given.
    #[error("superblock {index} belongs to array {uuid}, not {expected}")]
    ForeignArray {
        /// Its position in the list.
        index: usize,
        /// Its `set_uuid`.
        uuid: Uuid,
        /// The newest superblock's `set_uuid`.
        expected: Uuid,
    },
    /// A slot to fail that `dev_roles` does not have.
    #[error("cannot fail slot {dev_number}: dev_roles has {max_dev} slots")]
    UnknownSlot {
        /// The slot asked for.
        dev_number: u32,
        /// Slots in `dev_roles`.
        max_dev: usize,
    },
    /// An active member more than one generation behind: writing it a new generation
    /// would pass off its stale data as current.
    #[error(
        "superblock {index} (slot {dev_number}) is at events {events}, more than \
         {EVENT_MARGIN} behind the newest {newest}: it is stale and must be rebuilt, not updated"
    )]
    StaleMember {
        /// Its position in the list.
        index: usize,
        /// Its slot.
        dev_number: u32,
        /// Its events.
        events: u64,
        /// The newest events.
        newest: u64,
    },
    /// `events` cannot grow further.
    #[error("events counter overflow")]
    EventsOverflow,
}

/// The superblock of a device joining the array in slot `dev_number` (a spare, or a
/// replacement about to be rebuilt): the array-wide fields, `events` and `dev_roles` of
/// `newest`, and its own identity — `device_uuid`, a data area of `data_size_sectors`
/// 512-byte sectors at the array's data offset, no corrected reads, no bad-block log, not
/// recovering yet (mdadm's `Manage_add` → `write_init_super1` for a new device). Record its
/// role with the next [`next_generation`] (its `roles` and `recovery`), writing it together
/// with the members' superblocks, as md does when it adds a device.
pub fn joining_member(
    newest: &Superblock,
    dev_number: u32,
    device_uuid: Uuid,
    data_size_sectors: u64,
) -> Superblock {
    let mut sb = newest.clone();
    sb.dev_number = dev_number;
    sb.device_uuid = device_uuid;
    sb.data_size = data_size_sectors;
    sb.recovery_offset = 0;
    sb.feature_map &= !Feature::RecoveryOffset.bit();
    sb.cnt_corrected_read = 0;
    sb.devflags = 0;
    sb.bblog_shift = 0;
    sb.bblog_size = 0;
    sb.bblog_offset = 0;
    sb
}

/// The next generation of superblocks for the members whose current superblocks are
/// `current` (the members to be written: working members and spares), recording `update`.
///
/// The array state comes from the newest superblock of `current` (highest `events`,
/// first on ties); every output gets `events` = newest + 1, `utime`, the new
/// `resync_offset`, and the newest `dev_roles` with the `failed` slots set to faulty, plus
/// the newest array-wide fields (name, geometry, size). Per-device fields (`dev_number`,
/// `device_uuid`, `data_offset`, `data_size`, `cnt_corrected_read`, `devflags`, bad-block
/// log, `feature_map`) stay each member's own; `dev_roles`, and so `max_dev`, is the
/// newest's for all.
///
/// Returns one entry per input, in order: `None` for a member that is (now) recorded
/// faulty — md never writes a faulty member's superblock, so it keeps its old generation
/// and assembly recognises it from the others'. See the module docs for why a crash while
/// writing the result leaves a consistent set, and the write ordering that requires.
///
/// # Errors
/// [`UpdateError::Empty`], [`UpdateError::ForeignArray`], [`UpdateError::UnknownSlot`],
/// [`UpdateError::StaleMember`] (an active member more than [`EVENT_MARGIN`] behind),
/// [`UpdateError::EventsOverflow`].
pub fn next_generation(
    current: &[Superblock],
    update: &Update,
) -> Result<Vec<Option<Superblock>>, UpdateError> {
    let newest = current
        .iter()
        .enumerate()
        .max_by(|(ia, a), (ib, b)| a.events.cmp(&b.events).then(ib.cmp(ia)))
        .map(|(_, sb)| sb)
        .ok_or(UpdateError::Empty)?;
    let events = newest
        .events
        .checked_add(1)
        .ok_or(UpdateError::EventsOverflow)?;
    let mut roles = newest.dev_roles.clone();
    for &(slot, role) in &update.roles {
        let slot = slot as usize;
        if slot >= MAX_DEV_LIMIT as usize {
            return Err(UpdateError::UnknownSlot {
                dev_number: slot as u32,
                max_dev: MAX_DEV_LIMIT as usize,
            });
        }
        if roles.len() <= slot {
            roles.resize(slot + 1, DEV_ROLE_SPARE);
        }
        roles[slot] = role;
    }
    for &slot in &update.failed {
        let max_dev = roles.len();
        let r = roles
            .get_mut(slot as usize)
            .ok_or(UpdateError::UnknownSlot {
                dev_number: slot,
                max_dev,
            })?;
        *r = DEV_ROLE_FAULTY;
    }
    let resync_offset = update.resync.map_or(newest.resync_offset, Resync::offset);
    let mut out = Vec::with_capacity(current.len());
    for (index, sb) in current.iter().enumerate() {
        if sb.set_uuid != newest.set_uuid {
            return Err(UpdateError::ForeignArray {
                index,
                uuid: sb.set_uuid,
                expected: newest.set_uuid,
            });
        }
        let slot_role = roles
            .get(sb.dev_number as usize)
            .map_or(DevRole::Spare, |&r| DevRole::from_raw(r));
        if slot_role == DevRole::Faulty {
            out.push(None);
            continue;
        }
        if matches!(slot_role, DevRole::Active(_))
            && sb.events.saturating_add(EVENT_MARGIN) < newest.events
        {
            return Err(UpdateError::StaleMember {
                index,
                dev_number: sb.dev_number,
                events: sb.events,
                newest: newest.events,
            });
        }
        let mut next = sb.clone();
        next.set_name = newest.set_name;
        next.ctime = newest.ctime;
        next.level = newest.level;
        next.layout = newest.layout;
        next.size = newest.size;
        next.chunksize = newest.chunksize;
        next.raid_disks = newest.raid_disks;
        next.utime = update.utime;
        next.events = events;
        next.resync_offset = resync_offset;
        next.dev_roles.clone_from(&roles);
        if let Some(&(_, rec)) = update.recovery.iter().find(|(d, _)| *d == sb.dev_number) {
            match rec {
                Some(sectors) => {
                    next.feature_map |= Feature::RecoveryOffset.bit();
                    next.recovery_offset = sectors;
                }
                None => {
                    next.feature_map &=
                        !(Feature::RecoveryOffset.bit() | Feature::RecoveryBitmap.bit());
                    next.recovery_offset = 0;
                }
            }
        }
        for &(_, f, set) in update.features.iter().filter(|x| x.0 == sb.dev_number) {
            if set {
                next.feature_map |= f.bit();
            } else {
                next.feature_map &= !f.bit();
            }
        }
        out.push(Some(next));
    }
    Ok(out)
}
