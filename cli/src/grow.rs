//! `ferroraid grow --consistency-policy ppl|resync DEV...`: switches a **stopped, clean**
//! array's consistency policy offline — ferroraid's `mdadm --grow --consistency-policy=`
//! (mdadm's `Grow_consistency_policy`, `update_super1` "ppl" / "no-ppl").
//!
//! It is the way back to kernel md for a RAID6 PPL array (ferroraid's extension, which md
//! cannot assemble): `resync` clears the PPL bits and `FERRORAID_FEATURE_RAID6_PPL`, and md
//! assembles the array again. `ppl` sets them (the ferroraid bit on RAID6 only) and writes
//! every member's PPL area as `create` does — zero but for the empty header — before any
//! superblock announces it. The rules (clean, every member given, one array, no bitmap,
//! events one above the newest) are `engine::metadata::switch_consistency_policy`'s.

use std::path::PathBuf;
use std::time::SystemTime;

use anyhow::{anyhow, Context, Result};
use drivers::metadata_io;
use engine::metadata::{
    empty_ppl_area, switch_consistency_policy, ConsistencyPolicy, MdTime, PolicyChangeError,
    Superblock, Uuid,
};

/// The one-line notice for a RAID6 array whose policy is `ppl`: kernel md cannot assemble
/// it, and how to switch it back (printed by `create` and `grow`).
pub const RAID6_PPL_NOTICE: &str = "note: kernel md cannot assemble a RAID6 while its \
    consistency policy is ppl (ferroraid's RAID6 partial parity log, feature bit \
    FERRORAID_FEATURE_RAID6_PPL); to move the array to md, stop it and run `ferroraid grow \
    --consistency-policy resync MEMBERS...`";

/// What to switch.
#[derive(Clone, Debug)]
pub struct GrowOptions {
    /// Every device of the array: all members, and its spares (left-out spares keep the
    /// old policy and are refused by md's and ferroraid's assembly for their PPL fields
    /// only when they join).
    pub devices: Vec<PathBuf>,
    /// The policy to switch to: [`ConsistencyPolicy::Ppl`] or [`ConsistencyPolicy::Resync`].
    pub consistency_policy: ConsistencyPolicy,
}

/// What was switched.
#[derive(Clone, Debug)]
pub struct Grown {
    /// The array UUID.
    pub uuid: Uuid,
    /// The array name (`set_name`).
    pub name: String,
    /// md's level number (5 or 6).
    pub level: i32,
    /// The policy before.
    pub from: ConsistencyPolicy,
    /// The policy now.
    pub to: ConsistencyPolicy,
    /// The new superblock generation (`events`).
    pub events: u64,
    /// With `ppl`: each device's PPL area size, sectors (in device order).
    pub ppl_sectors: Vec<u16>,
}

/// The device a refusal names, when it names one.
fn index_of(e: &PolicyChangeError) -> Option<usize> {
    use PolicyChangeError as E;
    match *e {
        E::Superblock { index, .. }
        | E::ForeignArray { index, .. }
        | E::EventsDiffer { index, .. }
        | E::Faulty { index, .. }
        | E::Recovering { index, .. }
        | E::PplSpace { index, .. }
        | E::DuplicateRole { second: index, .. } => Some(index),
        _ => None,
    }
}

/// Switches the consistency policy of the stopped array whose devices are `o.devices`.
/// Every device is claimed (refused while a target serves it), every superblock read,
/// the new generation computed (nothing is written when anything is refused), then — for
/// `ppl` — every PPL area written and flushed, then every superblock written and flushed.
///
/// # Errors
/// The same device twice; a device in use, unreadable, without a superblock; a refusal of
/// `engine::metadata::switch_consistency_policy` (dirty, a member missing or behind,
/// members of different arrays, a bitmap array, already that policy, no room for a PPL),
/// naming the device; `ppl` over members reached through their back end (not supported
/// for PPL arrays yet); an I/O error writing, naming the device. A failure while writing
/// leaves each member with either its old or its new superblock, both of a clean array
/// (the areas are written first): run the command again.
pub fn grow_consistency_policy(o: &GrowOptions) -> Result<Grown> {
    crate::create::check_distinct(&o.devices)?;
    if o.consistency_policy == ConsistencyPolicy::Ppl {
        crate::create::refuse_back_end_for_ppl(&o.devices)?;
    }
    let mut locks = Vec::with_capacity(o.devices.len());
    for p in &o.devices {
        locks.push(crate::target::claim(p)?);
    }
    let mut current = Vec::with_capacity(o.devices.len());
    for p in &o.devices {
        let area = metadata_io::read_superblock_area(p)?;
        let sb = Superblock::decode(&area)
            .with_context(|| format!("{}: no usable md superblock", p.display()))?;
        current.push(sb);
    }
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let next = switch_consistency_policy(
        &current,
        o.consistency_policy,
        // Seconds only, as md writes it (`MdTime`).
        MdTime::new(now.as_secs(), 0),
    )
    .map_err(|e| match index_of(&e) {
        Some(i) => anyhow!("{}: {e}", o.devices[i].display()),
        None => anyhow!("{e}"),
    })?;
    // Every device checked before the first write: a refusal after some were written
    // would leave members with different policies and generations.
    for (p, sb) in o.devices.iter().zip(&next) {
        metadata_io::check_superblock_fits(p, sb)?;
    }
    let mut ppl_sectors = Vec::new();
    if o.consistency_policy == ConsistencyPolicy::Ppl {
        for (p, sb) in o.devices.iter().zip(&next) {
            let size = sb.ppl().1;
            metadata_io::write_init_ppl(p, sb, &empty_ppl_area(&sb.set_uuid, size))?;
            ppl_sectors.push(size);
        }
    }
    for (p, sb) in o.devices.iter().zip(&next) {
        metadata_io::write_superblock(p, sb)?;
    }
    drop(locks);
    let first = &next[0];
    Ok(Grown {
        uuid: first.set_uuid,
        name: first.name(),
        level: first.level,
        // Only ppl <-> resync is allowed, and never to the policy the array has.
        from: match o.consistency_policy {
            ConsistencyPolicy::Ppl => ConsistencyPolicy::Resync,
            _ => ConsistencyPolicy::Ppl,
        },
        to: o.consistency_policy,
        events: first.events,
        ppl_sectors,
    })
}
