//! The superblock-update rule: from the current superblocks, the next generation; and the
//! offline consistency-policy switch ([`switch_consistency_policy`]).
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
use super::create::ConsistencyPolicy;
use super::superblock::{
    DevRole, Feature, Superblock, SuperblockError, DEV_ROLE_FAULTY, DEV_ROLE_SPARE, MAX_DEV_LIMIT,
    MAX_SECTOR,
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

/// The newest of `sbs`: highest `events`, the first on ties; `None` when empty.
fn newest_of(sbs: &[Superblock]) -> Option<&Superblock> {
    sbs.iter()
        .enumerate()
        .max_by(|(ia, a), (ib, b)| a.events.cmp(&b.events).then(ib.cmp(ia)))
        .map(|(_, sb)| sb)
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
    let newest = newest_of(current).ok_or(UpdateError::Empty)?;
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

/// Why a consistency-policy switch ([`switch_consistency_policy`]) was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PolicyChangeError {
    /// No superblocks given.
    #[error("no superblocks given")]
    Empty,
    /// A policy that cannot be switched to offline: only `ppl` and `resync` (mdadm's
    /// `Grow_consistency_policy` allows the same two).
    #[error(
        "cannot switch to consistency policy {to}: only ppl and resync can be switched to \
         (an internal bitmap is added under md: mdadm --grow --bitmap=internal)"
    )]
    Target {
        /// The policy asked for.
        to: ConsistencyPolicy,
    },
    /// A superblock ferroraid cannot serve (reshape, journal, unknown bits, a PPL md
    /// refuses, ...): nothing is rewritten.
    #[error("superblock {index}: {error}")]
    Superblock {
        /// Its position in the list.
        index: usize,
        /// Why.
        error: SuperblockError,
    },
    /// A PPL asked for an array of more members than a PPL supports
    /// ([`crate::ppl::MAX_PPL_MEMBERS`], md's limit).
    #[error(
        "a PPL supports at most 64 members (md's limit, raid5-ppl.c ppl_init_log); the \
         array has {members}"
    )]
    PplMembers {
        /// `raid_disks`.
        members: u32,
    },
    /// A superblock of another array among the ones given.
    #[error(
        "superblock {index} belongs to array {uuid}, not {expected}: give the members of one array"
    )]
    ForeignArray {
        /// Its position in the list.
        index: usize,
        /// Its `set_uuid`.
        uuid: Uuid,
        /// The first superblock's `set_uuid`.
        expected: Uuid,
    },
    /// The array is dirty: its parity may be inconsistent, and only the policy it was
    /// written under can make it consistent.
    #[error(
        "the array was not shut down cleanly (resync_offset {resync_offset}): assemble it \
         (ferroraid serve) and stop it cleanly first, then switch"
    )]
    Dirty {
        /// The newest `resync_offset`, sectors.
        resync_offset: u64,
    },
    /// An active member whose `events` differ from the newest: the last stop did not
    /// reach every member.
    #[error(
        "superblock {index} (slot {dev_number}) is at events {events}, the newest at \
         {newest}: the array was not stopped cleanly on every member; assemble it \
         (ferroraid serve) and stop it cleanly first"
    )]
    EventsDiffer {
        /// Its position in the list.
        index: usize,
        /// Its slot.
        dev_number: u32,
        /// Its events.
        events: u64,
        /// The newest events.
        newest: u64,
    },
    /// A device recorded faulty by the array.
    #[error(
        "superblock {index} (slot {dev_number}) is recorded faulty by the array: leave it out"
    )]
    Faulty {
        /// Its position in the list.
        index: usize,
        /// Its slot.
        dev_number: u32,
    },
    /// A role with no device given: every member must be given, or the ones left out
    /// would keep the old policy.
    #[error(
        "no device given for role {role}: give every member of the array (a degraded array \
         must be rebuilt first)"
    )]
    MissingRole {
        /// The role.
        role: u16,
    },
    /// Two devices given for one role (the same device twice, a clone, a replacement).
    #[error("superblocks {first} and {second} both hold role {role}")]
    DuplicateRole {
        /// The role.
        role: u16,
        /// The first superblock holding it.
        first: usize,
        /// The second.
        second: usize,
    },
    /// A member being rebuilt or replaced.
    #[error(
        "superblock {index} (slot {dev_number}) is being rebuilt or replaced: let it finish \
         under ferroraid first"
    )]
    Recovering {
        /// Its position in the list.
        index: usize,
        /// Its slot.
        dev_number: u32,
    },
    /// The array already has the policy asked for (mdadm: "Consistency policy is already").
    #[error("consistency policy is already {policy}")]
    Already {
        /// The policy.
        policy: ConsistencyPolicy,
    },
    /// The current policy cannot be switched from (mdadm: "Current consistency policy is
    /// %s, cannot change to %s").
    #[error(
        "current consistency policy is {current}, cannot change to {to} (remove the bitmap \
         under md first: mdadm --grow --bitmap=none)"
    )]
    From {
        /// The array's policy.
        current: ConsistencyPolicy,
        /// The policy asked for.
        to: ConsistencyPolicy,
    },
    /// No room for a PPL area between the superblock and the bad-block log or data
    /// (mdadm's `update_super1` "ppl": "Not enough space to add ppl").
    #[error(
        "superblock {index} (slot {dev_number}): not enough space for a PPL: {space_sectors} \
         sectors between the superblock and the bad-block log or data, at least \
         {MIN_PPL_SPACE_SECTORS} needed (mdadm: Not enough space to add ppl)"
    )]
    PplSpace {
        /// Its position in the list.
        index: usize,
        /// Its slot.
        dev_number: u32,
        /// The space found, sectors.
        space_sectors: i64,
    },
    /// `events` cannot grow further.
    #[error("events counter overflow")]
    EventsOverflow,
}

/// Fewest sectors mdadm's `update_super1` "ppl" accepts for a PPL area: the 4 KiB header
/// and one 4 KiB page (`(PPL_HEADER_SIZE >> 9) + 8`).
pub const MIN_PPL_SPACE_SECTORS: i64 = 16;

/// Where mdadm's `update_super1` "ppl" (`mdadm --grow --consistency-policy=ppl`) puts a
/// PPL area on a v1.1/1.2 member: `(ppl.offset, ppl.size)` in sectors, offset 8 from the
/// superblock; the size is the room up to the bad-block log (`bblog_offset − 8` when there
/// is a log) or else to the data (`data_offset − super_offset − 8`), capped at 2048
/// sectors (`MULTIPLE_PPL_AREA_SIZE_SUPER1`), and below that at `choose_ppl_space`:
/// `8 + max(chunk, 256)` sectors.
///
/// # Errors
/// The room found, in sectors, when it is below [`MIN_PPL_SPACE_SECTORS`].
pub fn mdadm_ppl_placement(sb: &Superblock) -> Result<(i16, u16), i64> {
    let space = if sb.bblog_offset != 0 {
        i64::from(sb.bblog_offset) - 8
    } else {
        sb.data_offset as i64 - sb.super_offset as i64 - 8
    };
    if space < MIN_PPL_SPACE_SECTORS {
        return Err(space);
    }
    let max = i64::from(super::ppl::MDADM_PPL_SIZE_SECTORS);
    let size = if space >= max {
        max
    } else {
        space.min(8 + i64::from(sb.chunksize.max(256)))
    };
    Ok((8, size.min(i64::from(u16::MAX)) as u16))
}

/// The superblocks of a **stopped, clean** array switched to consistency policy `to`
/// (`ppl` or `resync`): ferroraid's offline `mdadm --grow --consistency-policy=`
/// (mdadm's `Grow_consistency_policy` and `update_super1` "ppl" / "no-ppl"). `current`
/// holds the superblock of every device of the array (members and spares); the result has
/// one superblock per input, in order, each with `events` one above the newest, `utime`,
/// and:
/// - `resync`: the PPL feature bits and [`Feature::Raid6Ppl`] cleared, `ppl.offset` and
///   `ppl.size` zero (mdadm's "no-ppl" clears the bits only);
/// - `ppl`: [`Feature::Ppl`] set (and on RAID6 [`Feature::Raid6Ppl`]), the area placed
///   as mdadm places it ([`mdadm_ppl_placement`], per member: offsets may differ). The
///   caller writes every member's area as at creation ([`super::empty_ppl_area`]) before
///   any superblock.
///
/// # Errors
/// In this order: [`PolicyChangeError::Target`] (`bitmap`), [`PolicyChangeError::Empty`],
/// [`PolicyChangeError::Superblock`] (one ferroraid cannot serve),
/// [`PolicyChangeError::ForeignArray`], [`PolicyChangeError::PplMembers`],
/// [`PolicyChangeError::Dirty`],
/// [`PolicyChangeError::Faulty`], [`PolicyChangeError::EventsDiffer`] (an active member
/// not at the newest events), [`PolicyChangeError::Recovering`],
/// [`PolicyChangeError::DuplicateRole`], [`PolicyChangeError::MissingRole`],
/// [`PolicyChangeError::Already`], [`PolicyChangeError::From`] (a bitmap array),
/// [`PolicyChangeError::PplSpace`], [`PolicyChangeError::Superblock`] (the new PPL area
/// refused by md's placement rules), [`PolicyChangeError::EventsOverflow`].
pub fn switch_consistency_policy(
    current: &[Superblock],
    to: ConsistencyPolicy,
    utime: MdTime,
) -> Result<Vec<Superblock>, PolicyChangeError> {
    if to == ConsistencyPolicy::Bitmap {
        return Err(PolicyChangeError::Target { to });
    }
    let newest = newest_of(current).ok_or(PolicyChangeError::Empty)?;
    for (index, sb) in current.iter().enumerate() {
        sb.check_supported()
            .map_err(|error| PolicyChangeError::Superblock { index, error })?;
        if sb.set_uuid != current[0].set_uuid {
            return Err(PolicyChangeError::ForeignArray {
                index,
                uuid: sb.set_uuid,
                expected: current[0].set_uuid,
            });
        }
    }
    if to == ConsistencyPolicy::Ppl && newest.raid_disks > u32::from(crate::ppl::MAX_PPL_MEMBERS) {
        return Err(PolicyChangeError::PplMembers {
            members: newest.raid_disks,
        });
    }
    if !newest.is_clean() {
        return Err(PolicyChangeError::Dirty {
            resync_offset: newest.resync_offset,
        });
    }
    let mut holder: Vec<Option<usize>> = vec![None; newest.raid_disks as usize];
    for (index, sb) in current.iter().enumerate() {
        let dev_number = sb.dev_number;
        match newest.role_of(dev_number) {
            DevRole::Faulty => return Err(PolicyChangeError::Faulty { index, dev_number }),
            DevRole::Active(role) => {
                if sb.events != newest.events {
                    return Err(PolicyChangeError::EventsDiffer {
                        index,
                        dev_number,
                        events: sb.events,
                        newest: newest.events,
                    });
                }
                if sb.recovering().is_some() || sb.is_replacement() {
                    return Err(PolicyChangeError::Recovering { index, dev_number });
                }
                // check_supported: every active role is below raid_disks.
                let h = &mut holder[usize::from(role)];
                if let Some(first) = *h {
                    return Err(PolicyChangeError::DuplicateRole {
                        role,
                        first,
                        second: index,
                    });
                }
                *h = Some(index);
            }
            DevRole::Spare | DevRole::Journal | DevRole::Invalid(_) => {}
        }
    }
    if let Some(role) = holder.iter().position(Option::is_none) {
        return Err(PolicyChangeError::MissingRole { role: role as u16 });
    }
    let current_policy = newest.consistency_policy();
    if current_policy == to {
        return Err(PolicyChangeError::Already { policy: to });
    }
    if current_policy == ConsistencyPolicy::Bitmap {
        return Err(PolicyChangeError::From {
            current: current_policy,
            to,
        });
    }
    let events = newest
        .events
        .checked_add(1)
        .ok_or(PolicyChangeError::EventsOverflow)?;
    let ppl_bits = Feature::Ppl.bit() | Feature::MultiplePpls.bit() | Feature::Raid6Ppl.bit();
    let mut out = Vec::with_capacity(current.len());
    for (index, sb) in current.iter().enumerate() {
        let mut next = sb.clone();
        next.events = events;
        next.utime = utime;
        next.dev_roles.clone_from(&newest.dev_roles);
        next.feature_map &= !ppl_bits;
        next.bitmap_offset = 0;
        if to == ConsistencyPolicy::Ppl {
            let (offset, size) =
                mdadm_ppl_placement(sb).map_err(|space_sectors| PolicyChangeError::PplSpace {
                    index,
                    dev_number: sb.dev_number,
                    space_sectors,
                })?;
            next.feature_map |= Feature::Ppl.bit();
            if next.level == 6 {
                next.feature_map |= Feature::Raid6Ppl.bit();
            }
            next.set_ppl(offset, size);
            next.ppl_area()
                .map_err(|error| PolicyChangeError::Superblock { index, error })?;
        }
        out.push(next);
    }
    Ok(out)
}
