//! Reservations of the LUN: SCSI-3 persistent reservations (SPC-4 §5.13, PERSISTENT
//! RESERVE IN/OUT §6.15/§6.16), RESERVE(6)/RELEASE(6) (SPC-2 §7.21/§7.22, handled as SPC-4
//! §5.13.3 "Exceptions to SPC-2 RESERVE and RELEASE behavior" says: CRH=1), and the unit
//! attentions they and task management raise (SAM-5 §5.14, SPC-4 §5.13.11).
//!
//! Pure: [`PrState`] is the state machine, with no I/O and no locks; the front ends keep it
//! behind a mutex in the server's shared state.
//!
//! # Identity
//! An I_T nexus is an initiator port and the target port. The target has one target port
//! (relative target port 1), so a [`Nexus`] is the initiator port alone: the iSCSI
//! initiator name with the session's ISID (SPC-4 §7.6.4.6, TransportID format 01b:
//! `iqn...,i,0x<isid>`). Every session of one initiator with one ISID is the same nexus.
//!
//! # Threads and the per-command cost
//! The state sits behind a `Mutex` in the server's shared state, taken only by PERSISTENT
//! RESERVE IN/OUT, RESERVE/RELEASE(6), task management, session start and end, and the
//! command that reports a pending unit attention. Every change bumps an `AtomicU64` epoch
//! (under the mutex). A session keeps the [`View`] of its nexus and the epoch it was taken
//! at; before each command it loads the epoch (one atomic load) and only when it moved
//! takes the mutex to refresh the view. The verdict for a command ([`View::check`]) is then
//! a few compares on the session's own copy.
//!
//! # Nexus loss
//! A session that ends (logout or a dropped connection) releases its RESERVE(6)
//! reservation (SPC-2 §5.5.1); registrations and persistent reservations stay (SPC-4
//! §5.13.1: they survive I_T nexus loss) and apply again when the nexus logs in again.
//!
//! # APTPL
//! With APTPL set by the last REGISTER (or REGISTER AND IGNORE EXISTING KEY), the
//! registrations, keys, the reservation and the generation are saved by
//! [`PrState::encode`] after every change (a PR OUT completes only once the save is
//! durable); clearing APTPL saves an empty state. [`PrState::decode`] restores them at
//! start. RESERVE(6) reservations and unit attentions are never saved.
//!
//! ## Encoding (version 1), big-endian
//! | bytes | field |
//! |---|---|
//! | 4 | magic `FRPR` |
//! | 1 | version (1) |
//! | 1 | flags: bit 0 APTPL |
//! | 2 | zero |
//! | 4 | PRgeneration |
//! | 4 | registration count *n* (at most [`MAX_REGISTRATIONS`]) |
//! | *n* × | key (8), flags (1: bit 0 ALL_TG_PT, bit 1 reservation holder), ISID (6), name length (2), name (UTF-8) |
//! | 1 | reservation type (0: none; else the SPC-4 TYPE code) |
//! | 4 | CRC32C (Castagnoli) of everything before it |
//!
//! The encoding carries its own checksum: a store need not add one. For an All
//! Registrants reservation the holder flag marks the registrant that made it (only
//! informative: every registrant holds it).
//!
//! # Not built
//! REGISTER AND MOVE is refused (ILLEGAL REQUEST, INVALID FIELD IN CDB); SPEC_I_PT is not
//! supported (SIP_C=0: INVALID FIELD IN PARAMETER LIST). ALL_TG_PT is accepted (ATP_C=1):
//! with one target port it is the registration itself. PREEMPT AND ABORT preempts like
//! PREEMPT; the preempted nexuses' commands already accepted finish (they are not
//! aborted), later ones conflict.

use std::collections::HashMap;

use super::scsi::{opc, Sense};

/// Most registrations kept; one more is refused with INSUFFICIENT REGISTRATION
/// RESOURCES (SPC-4 §5.13.7).
pub const MAX_REGISTRATIONS: usize = 256;
/// Unit attentions queued per nexus (the oldest is dropped beyond it, SAM-5 §5.14).
const MAX_UAS: usize = 8;
/// PERSISTENT RESERVE OUT parameter list length without SPEC_I_PT (SPC-4 §6.16.3).
pub const PROUT_PARAM_BYTES: u32 = 24;

/// Operation codes of the reservation commands.
pub mod opcode {
    /// RESERVE(6) (SPC-2 §7.21).
    pub const RESERVE_6: u8 = 0x16;
    /// RELEASE(6) (SPC-2 §7.22).
    pub const RELEASE_6: u8 = 0x17;
    /// PERSISTENT RESERVE IN (SPC-4 §6.15).
    pub const PR_IN: u8 = 0x5e;
    /// PERSISTENT RESERVE OUT (SPC-4 §6.16).
    pub const PR_OUT: u8 = 0x5f;
}

/// Unit attention sense data (SPC-4 Table "ASC and ASCQ assignments", key 6).
pub mod ua {
    use super::Sense;
    const fn ua(asc: u8, ascq: u8) -> Sense {
        Sense {
            key: 0x06,
            asc,
            ascq,
            info: None,
            field: None,
        }
    }
    /// RESERVATIONS PREEMPTED (2Ah/03h).
    pub const RESERVATIONS_PREEMPTED: Sense = ua(0x2a, 0x03);
    /// RESERVATIONS RELEASED (2Ah/04h).
    pub const RESERVATIONS_RELEASED: Sense = ua(0x2a, 0x04);
    /// REGISTRATIONS PREEMPTED (2Ah/05h).
    pub const REGISTRATIONS_PREEMPTED: Sense = ua(0x2a, 0x05);
    /// BUS DEVICE RESET FUNCTION OCCURRED (29h/03h).
    pub const BUS_DEVICE_RESET: Sense = ua(0x29, 0x03);
}

/// ILLEGAL REQUEST / INVALID RELEASE OF PERSISTENT RESERVATION (26h/04h).
pub const INVALID_RELEASE: Sense = Sense {
    key: 0x05,
    asc: 0x26,
    ascq: 0x04,
    info: None,
    field: None,
};
/// ILLEGAL REQUEST / INSUFFICIENT REGISTRATION RESOURCES (55h/04h).
pub const INSUFFICIENT_REGISTRATION: Sense = Sense {
    key: 0x05,
    asc: 0x55,
    ascq: 0x04,
    info: None,
    field: None,
};
/// MEDIUM ERROR / WRITE ERROR (0Ch/00h): the answer to a PR OUT whose APTPL save failed
/// (the change took effect in memory but is not durable).
pub const SAVE_FAILED: Sense = Sense {
    key: 0x03,
    asc: 0x0c,
    ascq: 0x00,
    info: None,
    field: None,
};

/// An I_T nexus of the single target port: the initiator port (iSCSI name + ISID).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Nexus {
    /// The iSCSI initiator name.
    pub initiator: String,
    /// The session's ISID (RFC 7143 §11.12.5).
    pub isid: [u8; 6],
}

impl Nexus {
    /// A nexus.
    pub fn new(initiator: &str, isid: [u8; 6]) -> Self {
        Self {
            initiator: initiator.to_string(),
            isid,
        }
    }

    /// The iSCSI initiator port TransportID (SPC-4 §7.6.4.6, format code 01b, protocol
    /// identifier 5): `name,i,0x<ISID in hex>`, NUL-terminated, padded to a multiple of 4
    /// bytes, at least 20 bytes in all.
    pub fn transport_id(&self) -> Vec<u8> {
        let mut s = self.initiator.as_bytes().to_vec();
        s.extend_from_slice(b",i,0x");
        for b in self.isid {
            s.extend_from_slice(format!("{b:02x}").as_bytes());
        }
        s.push(0);
        let len = s.len().div_ceil(4).max(4) * 4;
        s.resize(len, 0);
        let mut t = vec![0x40 | 0x05, 0];
        t.extend_from_slice(&(len as u16).to_be_bytes());
        t.extend_from_slice(&s);
        t
    }
}

/// A persistent reservation type (SPC-4 §6.15.3.4 Table "Persistent reservation type
/// codes").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrType {
    /// Write Exclusive (1h).
    WriteExclusive,
    /// Exclusive Access (3h).
    ExclusiveAccess,
    /// Write Exclusive – Registrants Only (5h).
    WriteExclusiveRegistrantsOnly,
    /// Exclusive Access – Registrants Only (6h).
    ExclusiveAccessRegistrantsOnly,
    /// Write Exclusive – All Registrants (7h).
    WriteExclusiveAllRegistrants,
    /// Exclusive Access – All Registrants (8h).
    ExclusiveAccessAllRegistrants,
}

impl PrType {
    /// The type of a TYPE code, `None` for reserved codes.
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => Self::WriteExclusive,
            3 => Self::ExclusiveAccess,
            5 => Self::WriteExclusiveRegistrantsOnly,
            6 => Self::ExclusiveAccessRegistrantsOnly,
            7 => Self::WriteExclusiveAllRegistrants,
            8 => Self::ExclusiveAccessAllRegistrants,
            _ => return None,
        })
    }

    /// The TYPE code.
    pub fn code(self) -> u8 {
        match self {
            Self::WriteExclusive => 1,
            Self::ExclusiveAccess => 3,
            Self::WriteExclusiveRegistrantsOnly => 5,
            Self::ExclusiveAccessRegistrantsOnly => 6,
            Self::WriteExclusiveAllRegistrants => 7,
            Self::ExclusiveAccessAllRegistrants => 8,
        }
    }

    /// Only writes are reserved (reads are open to everyone).
    pub fn write_exclusive(self) -> bool {
        matches!(
            self,
            Self::WriteExclusive
                | Self::WriteExclusiveRegistrantsOnly
                | Self::WriteExclusiveAllRegistrants
        )
    }

    /// Every registrant holds the reservation.
    pub fn all_registrants(self) -> bool {
        matches!(
            self,
            Self::WriteExclusiveAllRegistrants | Self::ExclusiveAccessAllRegistrants
        )
    }

    /// Registered nexuses get the access of the holder (Registrants Only and All
    /// Registrants types).
    pub fn registrants_access(self) -> bool {
        !matches!(self, Self::WriteExclusive | Self::ExclusiveAccess)
    }
}

/// One registration (SPC-4 §5.13.7).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Registration {
    nexus: Nexus,
    key: u64,
    all_tg_pt: bool,
}

/// The persistent reservation (SPC-4 §5.13.9).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Reservation {
    /// The nexus that made it (for All Registrants types: every registrant holds it).
    holder: Nexus,
    kind: PrType,
}

/// How a command stands against the reservations: what SPC-4 Table "SPC commands that
/// are allowed in the presence of various reservations" and SBC-4 §4.17 Table
/// "SBC-4 commands that are allowed in the presence of various reservations" say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Allowed whatever the reservation (INQUIRY, REPORT LUNS, REQUEST SENSE, TEST UNIT
    /// READY, READ CAPACITY, PREVENT ALLOW MEDIUM REMOVAL with PREVENT 0).
    Always,
    /// Reads the medium or the device's state (READ, VERIFY, PRE-FETCH, MODE SENSE,
    /// GET LBA STATUS, REPORT SUPPORTED OPERATION CODES): allowed under the Write
    /// Exclusive types, a conflict under the Exclusive Access types.
    Read,
    /// Changes the medium or the device (WRITE, WRITE SAME, UNMAP, COMPARE AND WRITE,
    /// SYNCHRONIZE CACHE, MODE SELECT, START STOP UNIT, …, and any other opcode): a
    /// conflict under every type for nexuses without the holder's access.
    Write,
    /// PERSISTENT RESERVE IN.
    PrIn,
    /// PERSISTENT RESERVE OUT (its service actions check the keys themselves).
    PrOut,
    /// RESERVE(6).
    Reserve6,
    /// RELEASE(6).
    Release6,
}

/// The class of a CDB.
pub fn class(cdb: &[u8; 16]) -> Class {
    match cdb[0] {
        opc::INQUIRY
        | opc::REPORT_LUNS
        | opc::REQUEST_SENSE
        | opc::TEST_UNIT_READY
        | opc::READ_CAPACITY_10 => Class::Always,
        opc::SERVICE_ACTION_IN_16 if cdb[1] & 0x1f == opc::SAI_READ_CAPACITY_16 => Class::Always,
        opc::PREVENT_ALLOW if cdb[4] & 0x03 == 0 => Class::Always,
        opc::READ_6
        | opc::READ_10
        | opc::READ_12
        | opc::READ_16
        | opc::VERIFY_10
        | opc::VERIFY_12
        | opc::VERIFY_16
        | opc::PREFETCH_10
        | opc::PREFETCH_16
        | opc::MODE_SENSE_6
        | opc::MODE_SENSE_10
        | opc::SERVICE_ACTION_IN_16
        | opc::MAINTENANCE_IN => Class::Read,
        opcode::PR_IN => Class::PrIn,
        opcode::PR_OUT => Class::PrOut,
        opcode::RESERVE_6 => Class::Reserve6,
        opcode::RELEASE_6 => Class::Release6,
        _ => Class::Write,
    }
}

/// RESERVE(6) state as one nexus sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Spc2 {
    /// Not reserved.
    #[default]
    Free,
    /// Reserved by this nexus.
    Mine,
    /// Reserved by another nexus.
    Other,
}

/// What one nexus needs to judge its commands without the lock (a session's cached copy).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct View {
    /// The persistent reservation's type and whether this nexus has the holder's access
    /// (holds it, or is registered under a Registrants Only / All Registrants type).
    pub pr: Option<(PrType, bool)>,
    /// This nexus is registered.
    pub registered: bool,
    /// Some nexus is registered.
    pub any_registered: bool,
    /// RESERVE(6).
    pub spc2: Spc2,
    /// A unit attention is pending for this nexus.
    pub ua: bool,
    /// How many PREEMPT AND ABORTs have removed this nexus's registration: when it grows,
    /// the front end aborts the nexus's tasks (SPC-4 §5.13.11.5).
    pub aborts: u64,
}

/// The verdict on one command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Run it.
    Go,
    /// RESERVATION CONFLICT status.
    Conflict,
    /// Report the pending unit attention (take it under the lock).
    UnitAttention,
}

impl View {
    /// Nothing reserved, nothing registered, nothing pending: every command runs.
    pub fn is_clear(&self) -> bool {
        self.pr.is_none() && !self.any_registered && self.spc2 == Spc2::Free && !self.ua
    }

    /// The verdict on `cdb` from this nexus (SAM-5 §5.14 for unit attentions, SPC-4
    /// §5.13.1 and §5.13.3, SBC-4 §4.17 for conflicts). A pending unit attention is
    /// reported first, except to INQUIRY, REPORT LUNS and REQUEST SENSE (SAM-5 §5.14;
    /// REQUEST SENSE returns it as its data).
    pub fn check(&self, cdb: &[u8; 16]) -> Verdict {
        if self.is_clear() {
            return Verdict::Go;
        }
        if self.ua && !matches!(cdb[0], opc::INQUIRY | opc::REPORT_LUNS | opc::REQUEST_SENSE) {
            return Verdict::UnitAttention;
        }
        let c = class(cdb);
        // SPC-4 §5.13.3: with a RESERVE(6) reservation, every PR IN/OUT conflicts
        // whoever sends it; with a registration, every RESERVE/RELEASE(6) does.
        match c {
            Class::PrIn | Class::PrOut if self.spc2 != Spc2::Free => return Verdict::Conflict,
            Class::Reserve6 | Class::Release6 if self.any_registered => return Verdict::Conflict,
            _ => {}
        }
        if self.spc2 == Spc2::Other {
            // SPC-2 §5.5.1: another initiator's reservation lets through only these (and
            // a RELEASE, which does nothing; a RESERVE conflicts).
            return match cdb[0] {
                opc::INQUIRY | opc::REPORT_LUNS | opc::REQUEST_SENSE => Verdict::Go,
                opcode::RELEASE_6 => Verdict::Go,
                _ => Verdict::Conflict,
            };
        }
        let Some((kind, access)) = self.pr else {
            return Verdict::Go;
        };
        if access {
            return Verdict::Go;
        }
        match c {
            Class::Always | Class::PrIn | Class::PrOut | Class::Reserve6 | Class::Release6 => {
                Verdict::Go
            }
            Class::Read if kind.write_exclusive() => Verdict::Go,
            Class::Read | Class::Write => Verdict::Conflict,
        }
    }
}

/// The outcome of a reservation command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// GOOD; when `save` is set the new state must be durable first (APTPL): the bytes to
    /// save (empty: clear the saved state).
    Good {
        /// What to hand the [`super::pr_store::ReservationStore`], if anything.
        save: Option<Vec<u8>>,
    },
    /// RESERVATION CONFLICT.
    Conflict,
    /// CHECK CONDITION.
    Check(Sense),
}

/// Why a saved state could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// Too short, wrong magic, bad checksum or lengths.
    #[error("persistent-reservation state: {0}")]
    Corrupt(&'static str),
    /// A version this build does not read.
    #[error("persistent-reservation state: version {0} is not supported (this build reads 1)")]
    Version(u8),
}

/// The reservation state of the LUN (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct PrState {
    generation: u32,
    aptpl: bool,
    regs: Vec<Registration>,
    resv: Option<Reservation>,
    spc2: Option<Nexus>,
    uas: HashMap<Nexus, Vec<Sense>>,
    /// Sessions logged in per nexus.
    live: HashMap<Nexus, u32>,
    /// PREEMPT AND ABORTs that removed each nexus's registration ([`View::aborts`]).
    aborts: HashMap<Nexus, u64>,
    /// A store keeps the state for APTPL (PTPL_C); without one APTPL=1 is refused.
    ptpl_capable: bool,
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

impl PrState {
    /// No registrations, no reservation, generation 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether APTPL can be honoured (a [`super::pr_store::ReservationStore`] is set):
    /// REPORT CAPABILITIES' PTPL_C; without it a REGISTER with APTPL=1 is refused
    /// (SPC-4 §6.16.3: INVALID FIELD IN PARAMETER LIST).
    pub fn set_ptpl_capable(&mut self, yes: bool) {
        self.ptpl_capable = yes;
    }

    /// PRgeneration (SPC-4 §6.15.2).
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Whether APTPL is active.
    pub fn aptpl(&self) -> bool {
        self.aptpl
    }

    /// The registered key of `n`.
    pub fn key_of(&self, n: &Nexus) -> Option<u64> {
        self.reg(n).map(|r| r.key)
    }

    /// The persistent reservation: its type and the nexus that made it.
    pub fn reservation(&self) -> Option<(PrType, &Nexus)> {
        self.resv.as_ref().map(|r| (r.kind, &r.holder))
    }

    fn reg(&self, n: &Nexus) -> Option<&Registration> {
        self.regs.iter().find(|r| r.nexus == *n)
    }

    fn is_holder(&self, n: &Nexus) -> bool {
        match &self.resv {
            None => false,
            Some(r) if r.kind.all_registrants() => self.reg(n).is_some(),
            Some(r) => r.holder == *n,
        }
    }

    /// The view of nexus `n` (for its sessions' caches).
    pub fn view(&self, n: &Nexus) -> View {
        let registered = self.reg(n).is_some();
        View {
            pr: self.resv.as_ref().map(|r| {
                (
                    r.kind,
                    self.is_holder(n) || (registered && r.kind.registrants_access()),
                )
            }),
            registered,
            any_registered: !self.regs.is_empty(),
            spc2: match &self.spc2 {
                None => Spc2::Free,
                Some(h) if h == n => Spc2::Mine,
                Some(_) => Spc2::Other,
            },
            ua: self.uas.get(n).is_some_and(|q| !q.is_empty()),
            aborts: self.aborts.get(n).copied().unwrap_or(0),
        }
    }

    fn add_ua(&mut self, n: &Nexus, s: Sense) {
        let q = self.uas.entry(n.clone()).or_default();
        if !q.contains(&s) {
            if q.len() == MAX_UAS {
                q.remove(0);
            }
            q.push(s);
        }
    }

    /// Takes the oldest unit attention pending for `n`.
    pub fn take_ua(&mut self, n: &Nexus) -> Option<Sense> {
        let q = self.uas.get_mut(n)?;
        let s = if q.is_empty() {
            None
        } else {
            Some(q.remove(0))
        };
        if q.is_empty() {
            self.uas.remove(n);
        }
        s
    }

    /// A session of `n` logged in.
    pub fn attach(&mut self, n: &Nexus) {
        *self.live.entry(n.clone()).or_insert(0) += 1;
    }

    /// A session of `n` ended (logout or nexus loss): with its last session its RESERVE(6)
    /// reservation goes (SPC-2 §5.5.1); registrations and the persistent reservation stay
    /// (SPC-4 §5.13.1). Returns whether the state changed.
    pub fn detach(&mut self, n: &Nexus) -> bool {
        let Some(c) = self.live.get_mut(n) else {
            return false;
        };
        *c -= 1;
        if *c > 0 {
            return false;
        }
        self.live.remove(n);
        let mut changed = false;
        if self.spc2.as_ref() == Some(n) {
            self.spc2 = None;
            changed = true;
        }
        // Unit attentions belong to the nexus; a new login starts afresh.
        changed |= self.uas.remove(n).is_some();
        changed
    }

    /// LOGICAL UNIT RESET or TARGET WARM/COLD RESET from `from` (SAM-5 §6.3): RESERVE(6)
    /// reservations are released (SPC-2 §5.5.1), persistent ones stay (SPC-4 §5.13.1), and
    /// every other logged-in nexus gets BUS DEVICE RESET FUNCTION OCCURRED.
    pub fn reset(&mut self, from: &Nexus) {
        self.spc2 = None;
        let others: Vec<Nexus> = self.live.keys().filter(|n| *n != from).cloned().collect();
        for n in others {
            self.add_ua(&n, ua::BUS_DEVICE_RESET);
        }
    }

    /// RESERVE(6) from `n` (SPC-2 §7.21; the 3rd-party and extent forms are obsolete and
    /// refused). Conflicts were judged by [`View::check`]; judged again here.
    pub fn reserve6(&mut self, n: &Nexus, cdb: &[u8; 16]) -> Outcome {
        if cdb[1] & 0x13 != 0 {
            return Outcome::Check(Sense::INVALID_FIELD_CDB);
        }
        if !self.regs.is_empty() {
            return Outcome::Conflict;
        }
        match &self.spc2 {
            Some(h) if h != n => Outcome::Conflict,
            _ => {
                self.spc2 = Some(n.clone());
                Outcome::Good { save: None }
            }
        }
    }

    /// RELEASE(6) from `n` (SPC-2 §7.22): releases its own reservation; another's is left
    /// alone (GOOD).
    pub fn release6(&mut self, n: &Nexus, cdb: &[u8; 16]) -> Outcome {
        if cdb[1] & 0x13 != 0 {
            return Outcome::Check(Sense::INVALID_FIELD_CDB);
        }
        if !self.regs.is_empty() {
            return Outcome::Conflict;
        }
        if self.spc2.as_ref() == Some(n) {
            self.spc2 = None;
        }
        Outcome::Good { save: None }
    }

    /// PERSISTENT RESERVE IN from `n` (SPC-4 §6.15): the whole answer (the caller applies
    /// the allocation length, §4.2.5.6).
    ///
    /// # Errors
    /// INVALID FIELD IN CDB for an unknown service action.
    pub fn pr_in(&self, cdb: &[u8; 16]) -> Result<Vec<u8>, Sense> {
        let mut out = Vec::new();
        match cdb[1] & 0x1f {
            // READ KEYS (§6.15.2).
            0 => {
                out.extend_from_slice(&self.generation.to_be_bytes());
                out.extend_from_slice(&((8 * self.regs.len()) as u32).to_be_bytes());
                for r in &self.regs {
                    out.extend_from_slice(&r.key.to_be_bytes());
                }
            }
            // READ RESERVATION (§6.15.3).
            1 => {
                out.extend_from_slice(&self.generation.to_be_bytes());
                match &self.resv {
                    None => out.extend_from_slice(&0u32.to_be_bytes()),
                    Some(r) => {
                        out.extend_from_slice(&16u32.to_be_bytes());
                        // All Registrants: the key is zero (§6.15.3.2).
                        let key = if r.kind.all_registrants() {
                            0
                        } else {
                            self.reg(&r.holder).map_or(0, |g| g.key)
                        };
                        out.extend_from_slice(&key.to_be_bytes());
                        out.extend_from_slice(&[0; 4]);
                        out.push(0);
                        out.push(r.kind.code()); // scope 0: LU_SCOPE
                        out.extend_from_slice(&[0; 2]);
                    }
                }
            }
            // REPORT CAPABILITIES (§6.15.4).
            2 => {
                out.extend_from_slice(&8u16.to_be_bytes());
                // CRH (RESERVE/RELEASE per §5.13.3), ATP_C, PTPL_C; SIP_C = 0.
                out.push(0x10 | 0x04 | u8::from(self.ptpl_capable));
                // TMV, ALLOW COMMANDS 000b (no information), PTPL_A.
                out.push(0x80 | u8::from(self.aptpl));
                // WR_EX_AR, EX_AC_RO, WR_EX_RO, EX_AC, WR_EX; EX_AC_AR.
                out.push(0x80 | 0x40 | 0x20 | 0x08 | 0x02);
                out.push(0x01);
                out.extend_from_slice(&[0; 2]);
            }
            // READ FULL STATUS (§6.15.5).
            3 => {
                let mut d = Vec::new();
                for r in &self.regs {
                    d.extend_from_slice(&r.key.to_be_bytes());
                    d.extend_from_slice(&[0; 4]);
                    let holder = self.is_holder(&r.nexus);
                    d.push(u8::from(r.all_tg_pt) << 1 | u8::from(holder));
                    d.push(if holder {
                        self.resv.as_ref().map_or(0, |v| v.kind.code())
                    } else {
                        0
                    });
                    d.extend_from_slice(&[0; 4]);
                    d.extend_from_slice(&1u16.to_be_bytes()); // relative target port 1
                    let tid = r.nexus.transport_id();
                    d.extend_from_slice(&(tid.len() as u32).to_be_bytes());
                    d.extend_from_slice(&tid);
                }
                out.extend_from_slice(&self.generation.to_be_bytes());
                out.extend_from_slice(&(d.len() as u32).to_be_bytes());
                out.extend_from_slice(&d);
            }
            _ => return Err(Sense::INVALID_FIELD_CDB),
        }
        Ok(out)
    }

    /// Checks a PERSISTENT RESERVE OUT CDB before its parameter data is transferred:
    /// the parameter list length it needs (SPC-4 §6.16.1), or the sense to answer.
    ///
    /// # Errors
    /// INVALID FIELD IN CDB for REGISTER AND MOVE and unknown service actions, PARAMETER
    /// LIST LENGTH ERROR for a length other than 24.
    pub fn pr_out_param_bytes(cdb: &[u8; 16]) -> Result<u32, Sense> {
        let sa = cdb[1] & 0x1f;
        if sa > 6 {
            // REGISTER AND MOVE (7) is not built; 8.. are reserved.
            return Err(Sense::INVALID_FIELD_CDB);
        }
        let len = be32(&cdb[5..9]);
        if len != PROUT_PARAM_BYTES {
            return Err(Sense::PARAM_LIST_LENGTH);
        }
        Ok(len)
    }

    /// PERSISTENT RESERVE OUT from `n` with parameter data `param` (SPC-4 §6.16, §5.13.7 –
    /// §5.13.11). The state changes only on [`Outcome::Good`].
    pub fn pr_out(&mut self, n: &Nexus, cdb: &[u8; 16], param: &[u8]) -> Outcome {
        let sa = cdb[1] & 0x1f;
        if let Err(s) = Self::pr_out_param_bytes(cdb) {
            return Outcome::Check(s);
        }
        if param.len() < PROUT_PARAM_BYTES as usize {
            return Outcome::Check(Sense::PARAM_LIST_LENGTH);
        }
        let scope = cdb[2] >> 4;
        let kind = PrType::from_code(cdb[2] & 0x0f);
        let key = be64(&param[0..8]);
        let sa_key = be64(&param[8..16]);
        let spec_i_pt = param[20] & 0x08 != 0;
        let all_tg_pt = param[20] & 0x04 != 0;
        let aptpl = param[20] & 0x01 != 0;
        let register = matches!(sa, 0 | 6);
        if spec_i_pt {
            // SIP_C = 0 (§6.16.3: INVALID FIELD IN PARAMETER LIST).
            return Outcome::Check(Sense::INVALID_FIELD_PARAM);
        }
        if register && aptpl && !self.ptpl_capable {
            return Outcome::Check(Sense::INVALID_FIELD_PARAM);
        }
        if !register && all_tg_pt {
            // ALL_TG_PT is valid only for REGISTER and REGISTER AND IGNORE (§6.16.3).
            return Outcome::Check(Sense::INVALID_FIELD_PARAM);
        }
        let was_aptpl = self.aptpl;
        let mine = self.reg(n).map(|r| r.key);
        let changed = match sa {
            0 | 6 => match self.register(n, mine, key, sa_key, sa == 6, all_tg_pt) {
                Ok(c) => {
                    self.aptpl = aptpl;
                    c
                }
                Err(o) => return o,
            },
            _ => {
                // Every other service action needs a registered nexus and its key
                // (§5.13.1: RESERVATION CONFLICT otherwise).
                if mine != Some(key) {
                    return Outcome::Conflict;
                }
                match sa {
                    1 | 2 | 4 | 5 if scope != 0 => {
                        return Outcome::Check(Sense::INVALID_FIELD_CDB);
                    }
                    _ => {}
                }
                match sa {
                    1 => match self.reserve(n, kind) {
                        Ok(c) => c,
                        Err(o) => return o,
                    },
                    2 => match self.release(n, kind) {
                        Ok(c) => c,
                        Err(o) => return o,
                    },
                    3 => {
                        self.clear(n);
                        true
                    }
                    _ => match self.preempt(n, kind, sa_key, sa == 5) {
                        Ok(()) => true,
                        Err(o) => return o,
                    },
                }
            }
        };
        if !changed {
            return Outcome::Good { save: None };
        }
        let save = if self.aptpl {
            Some(self.encode())
        } else if was_aptpl {
            Some(Vec::new())
        } else {
            None
        };
        Outcome::Good { save }
    }

    /// REGISTER / REGISTER AND IGNORE EXISTING KEY (§5.13.7, §5.13.8).
    fn register(
        &mut self,
        n: &Nexus,
        mine: Option<u64>,
        key: u64,
        sa_key: u64,
        ignore: bool,
        all_tg_pt: bool,
    ) -> Result<bool, Outcome> {
        match mine {
            None => {
                if !ignore && key != 0 {
                    return Err(Outcome::Conflict);
                }
                if sa_key == 0 {
                    // Unregistering an unregistered nexus: nothing to do.
                    return Ok(false);
                }
                if self.regs.len() >= MAX_REGISTRATIONS {
                    return Err(Outcome::Check(INSUFFICIENT_REGISTRATION));
                }
                self.regs.push(Registration {
                    nexus: n.clone(),
                    key: sa_key,
                    all_tg_pt,
                });
            }
            Some(k) => {
                if !ignore && key != k {
                    return Err(Outcome::Conflict);
                }
                if sa_key == 0 {
                    self.unregister(n);
                } else {
                    let r = self
                        .regs
                        .iter_mut()
                        .find(|r| r.nexus == *n)
                        .expect("registered");
                    r.key = sa_key;
                    r.all_tg_pt = all_tg_pt;
                }
            }
        }
        self.generation = self.generation.wrapping_add(1);
        Ok(true)
    }

    /// Removes `n`'s registration and what goes with it (§5.13.10.2: the holder's
    /// reservation is released; under a Registrants Only type the other registrants get
    /// RESERVATIONS RELEASED; an All Registrants reservation goes with the last
    /// registrant).
    fn unregister(&mut self, n: &Nexus) {
        self.regs.retain(|r| r.nexus != *n);
        let Some(r) = &self.resv else {
            return;
        };
        if r.kind.all_registrants() {
            if self.regs.is_empty() {
                self.resv = None;
            } else if r.holder == *n {
                // Another registrant stands for it (informative only).
                let h = self.regs[0].nexus.clone();
                self.resv.as_mut().expect("some").holder = h;
            }
        } else if r.holder == *n {
            let kind = r.kind;
            self.resv = None;
            if kind.registrants_access() {
                for o in self.other_registrants(n) {
                    self.add_ua(&o, ua::RESERVATIONS_RELEASED);
                }
            }
        }
    }

    fn other_registrants(&self, n: &Nexus) -> Vec<Nexus> {
        self.regs
            .iter()
            .filter(|r| r.nexus != *n)
            .map(|r| r.nexus.clone())
            .collect()
    }

    /// RESERVE (§5.13.9). Returns whether the state changed.
    fn reserve(&mut self, n: &Nexus, kind: Option<PrType>) -> Result<bool, Outcome> {
        let Some(kind) = kind else {
            return Err(Outcome::Check(Sense::INVALID_FIELD_CDB));
        };
        match &self.resv {
            None => {
                self.resv = Some(Reservation {
                    holder: n.clone(),
                    kind,
                });
                Ok(true)
            }
            Some(r) if self.is_holder(n) && r.kind == kind => Ok(false),
            Some(_) => Err(Outcome::Conflict),
        }
    }

    /// RELEASE (§5.13.10.2). Returns whether the state changed.
    fn release(&mut self, n: &Nexus, kind: Option<PrType>) -> Result<bool, Outcome> {
        let Some(r) = &self.resv else {
            return Ok(false);
        };
        if !self.is_holder(n) {
            return Ok(false);
        }
        if Some(r.kind) != kind {
            return Err(Outcome::Check(INVALID_RELEASE));
        }
        let k = r.kind;
        self.resv = None;
        if k.registrants_access() {
            for o in self.other_registrants(n) {
                self.add_ua(&o, ua::RESERVATIONS_RELEASED);
            }
        }
        Ok(true)
    }

    /// CLEAR (§5.13.10.3): every registration and the reservation go; the other
    /// registrants get RESERVATIONS PREEMPTED.
    fn clear(&mut self, n: &Nexus) {
        for o in self.other_registrants(n) {
            self.add_ua(&o, ua::RESERVATIONS_PREEMPTED);
        }
        self.regs.clear();
        self.resv = None;
        self.generation = self.generation.wrapping_add(1);
    }

    /// PREEMPT and PREEMPT AND ABORT (§5.13.11.4, §5.13.11.5: with `abort`, the tasks of
    /// every nexus whose registration is removed are aborted — counted in [`View::aborts`]
    /// for the front ends to act on).
    fn preempt(
        &mut self,
        n: &Nexus,
        kind: Option<PrType>,
        sa_key: u64,
        abort: bool,
    ) -> Result<(), Outcome> {
        let resv = self.resv.clone();
        // Registrations removed: those with the key, never the preempting nexus's own.
        let victims = |s: &Self, all_others: bool| -> Vec<Nexus> {
            s.regs
                .iter()
                .filter(|r| r.nexus != *n && (all_others || r.key == sa_key))
                .map(|r| r.nexus.clone())
                .collect()
        };
        let remove = |s: &mut Self, v: &[Nexus]| {
            s.regs.retain(|r| !v.contains(&r.nexus));
            for o in v {
                s.add_ua(o, ua::REGISTRATIONS_PREEMPTED);
                if abort {
                    *s.aborts.entry(o.clone()).or_default() += 1;
                }
            }
        };
        let key_known = self.regs.iter().any(|r| r.key == sa_key);
        match resv {
            Some(r) if r.kind.all_registrants() => {
                if sa_key == 0 {
                    // §5.13.11.4.3: preempt the All Registrants reservation: every other
                    // registration goes, a new reservation of the CDB's type is made.
                    let Some(kind) = kind else {
                        return Err(Outcome::Check(Sense::INVALID_FIELD_CDB));
                    };
                    let v = victims(self, true);
                    remove(self, &v);
                    self.resv = Some(Reservation {
                        holder: n.clone(),
                        kind,
                    });
                } else {
                    if !key_known {
                        return Err(Outcome::Conflict);
                    }
                    let v = victims(self, false);
                    remove(self, &v);
                }
            }
            Some(r) if self.reg(&r.holder).is_some_and(|h| h.key == sa_key) => {
                // Preempting the holder (§5.13.11.4.3): its reservation is replaced by
                // ours, of the CDB's type.
                let Some(kind) = kind else {
                    return Err(Outcome::Check(Sense::INVALID_FIELD_CDB));
                };
                let v = victims(self, false);
                remove(self, &v);
                let changed = r.kind != kind || r.holder != *n;
                self.resv = Some(Reservation {
                    holder: n.clone(),
                    kind,
                });
                if changed {
                    // The remaining registrants see the reservation change.
                    for o in self.other_registrants(n) {
                        if !v.contains(&o) {
                            self.add_ua(&o, ua::RESERVATIONS_RELEASED);
                        }
                    }
                }
            }
            _ => {
                // No reservation, or not the holder's key: registrations only
                // (§5.13.11.4.2). A zero key preempts nothing: INVALID FIELD IN PARAMETER
                // LIST (§5.13.11.4.1).
                if sa_key == 0 {
                    return Err(Outcome::Check(Sense::INVALID_FIELD_PARAM));
                }
                if !key_known {
                    return Err(Outcome::Conflict);
                }
                let v = victims(self, false);
                remove(self, &v);
            }
        }
        self.generation = self.generation.wrapping_add(1);
        Ok(())
    }

    /// The persistent part of the state in the encoding of the module docs.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.regs.len() * 96);
        b.extend_from_slice(b"FRPR");
        b.push(1);
        b.push(u8::from(self.aptpl));
        b.extend_from_slice(&[0; 2]);
        b.extend_from_slice(&self.generation.to_be_bytes());
        b.extend_from_slice(&(self.regs.len() as u32).to_be_bytes());
        for r in &self.regs {
            b.extend_from_slice(&r.key.to_be_bytes());
            let holder = self.resv.as_ref().is_some_and(|v| v.holder == r.nexus);
            b.push(u8::from(r.all_tg_pt) | u8::from(holder) << 1);
            b.extend_from_slice(&r.nexus.isid);
            let name = r.nexus.initiator.as_bytes();
            b.extend_from_slice(&(name.len() as u16).to_be_bytes());
            b.extend_from_slice(name);
        }
        b.push(self.resv.as_ref().map_or(0, |r| r.kind.code()));
        let crc = engine::checksum::crc32c(&b);
        b.extend_from_slice(&crc.to_be_bytes());
        b
    }

    /// The state [`PrState::encode`] wrote (no RESERVE(6), no unit attentions, no
    /// sessions).
    ///
    /// # Errors
    /// [`DecodeError`] for anything but a whole, checksummed version-1 encoding.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() < 21 || &b[..4] != b"FRPR" {
            return Err(DecodeError::Corrupt("no FRPR record"));
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if engine::checksum::crc32c(body) != be32(crc) {
            return Err(DecodeError::Corrupt("checksum mismatch"));
        }
        if body[4] != 1 {
            return Err(DecodeError::Version(body[4]));
        }
        if body[5] & !1 != 0 || body[6] != 0 || body[7] != 0 {
            return Err(DecodeError::Corrupt("reserved bits set"));
        }
        let mut s = PrState {
            aptpl: body[5] & 1 != 0,
            generation: be32(&body[8..12]),
            ..PrState::default()
        };
        let count = be32(&body[12..16]) as usize;
        if count > MAX_REGISTRATIONS {
            return Err(DecodeError::Corrupt("too many registrations"));
        }
        let mut at = 16;
        let mut holder = None;
        for _ in 0..count {
            if body.len() < at + 17 {
                return Err(DecodeError::Corrupt("truncated registration"));
            }
            let key = be64(&body[at..]);
            let flags = body[at + 8];
            let isid: [u8; 6] = body[at + 9..at + 15].try_into().expect("6 bytes");
            let nlen = usize::from(u16::from_be_bytes([body[at + 15], body[at + 16]]));
            at += 17;
            if body.len() < at + nlen || flags & !3 != 0 || key == 0 {
                return Err(DecodeError::Corrupt("bad registration"));
            }
            let name = std::str::from_utf8(&body[at..at + nlen])
                .map_err(|_| DecodeError::Corrupt("initiator name not UTF-8"))?;
            at += nlen;
            let nexus = Nexus::new(name, isid);
            if s.reg(&nexus).is_some() {
                return Err(DecodeError::Corrupt("duplicate registration"));
            }
            if flags & 2 != 0 {
                if holder.is_some() {
                    return Err(DecodeError::Corrupt("two reservation holders"));
                }
                holder = Some(nexus.clone());
            }
            s.regs.push(Registration {
                nexus,
                key,
                all_tg_pt: flags & 1 != 0,
            });
        }
        if body.len() != at + 1 {
            return Err(DecodeError::Corrupt("length mismatch"));
        }
        match (body[at], holder) {
            (0, None) => {}
            (c, Some(h)) => {
                let kind = PrType::from_code(c).ok_or(DecodeError::Corrupt("bad type"))?;
                s.resv = Some(Reservation { holder: h, kind });
            }
            (_, None) => return Err(DecodeError::Corrupt("reservation without holder")),
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a() -> Nexus {
        Nexus::new("iqn.a", [0x23, 0, 0, 0, 0, 1])
    }
    fn b() -> Nexus {
        Nexus::new("iqn.b", [0x23, 0, 0, 0, 0, 2])
    }
    fn c() -> Nexus {
        Nexus::new("iqn.c", [0x23, 0, 0, 0, 0, 3])
    }

    fn out_cdb(sa: u8, kind: u8) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[0] = opcode::PR_OUT;
        c[1] = sa;
        c[2] = kind;
        c[5..9].copy_from_slice(&24u32.to_be_bytes());
        c
    }
    fn param(key: u64, sa_key: u64, flags: u8) -> [u8; 24] {
        let mut p = [0u8; 24];
        p[..8].copy_from_slice(&key.to_be_bytes());
        p[8..16].copy_from_slice(&sa_key.to_be_bytes());
        p[20] = flags;
        p
    }
    const GOOD: Outcome = Outcome::Good { save: None };

    fn reg(s: &mut PrState, n: &Nexus, key: u64) {
        assert_eq!(s.pr_out(n, &out_cdb(6, 0), &param(0, key, 0)), GOOD);
    }
    fn resv(s: &mut PrState, n: &Nexus, key: u64, t: PrType) -> Outcome {
        s.pr_out(n, &out_cdb(1, t.code()), &param(key, 0, 0))
    }
    fn cdb(op: u8) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[0] = op;
        c
    }
    fn keys(s: &PrState) -> Vec<u64> {
        let d = s.pr_in(&cdb(opcode::PR_IN)).unwrap();
        d[8..].chunks(8).map(be64).collect()
    }

    const ALL: [PrType; 6] = [
        PrType::WriteExclusive,
        PrType::ExclusiveAccess,
        PrType::WriteExclusiveRegistrantsOnly,
        PrType::ExclusiveAccessRegistrantsOnly,
        PrType::WriteExclusiveAllRegistrants,
        PrType::ExclusiveAccessAllRegistrants,
    ];

    #[test]
    fn access_rules_per_type() {
        let read = cdb(opc::READ_10);
        let write = cdb(opc::WRITE_10);
        let tur = cdb(opc::TEST_UNIT_READY);
        for t in ALL {
            let mut s = PrState::new();
            reg(&mut s, &a(), 1);
            reg(&mut s, &b(), 2);
            assert_eq!(resv(&mut s, &a(), 1, t), GOOD);
            let holder = s.view(&a());
            let registered = s.view(&b());
            let other = s.view(&c());
            for v in [holder, registered, other] {
                assert_eq!(v.check(&tur), Verdict::Go, "{t:?}");
                assert_eq!(v.check(&cdb(opc::INQUIRY)), Verdict::Go);
                assert_eq!(v.check(&cdb(opcode::PR_IN)), Verdict::Go);
                assert_eq!(v.check(&cdb(opcode::RESERVE_6)), Verdict::Conflict);
            }
            assert_eq!(holder.check(&read), Verdict::Go);
            assert_eq!(holder.check(&write), Verdict::Go);
            let we = t.write_exclusive();
            let reg_access = t.registrants_access();
            let go = |b: bool| if b { Verdict::Go } else { Verdict::Conflict };
            // libiscsi's table (test_prout_reserve_access.c) and SPC-4 §5.13.1.
            assert_eq!(registered.check(&read), go(we || reg_access), "{t:?}");
            assert_eq!(registered.check(&write), go(reg_access), "{t:?}");
            assert_eq!(other.check(&read), go(we), "{t:?}");
            assert_eq!(other.check(&write), Verdict::Conflict, "{t:?}");
            assert_eq!(
                other.check(&cdb(opc::MODE_SENSE_6)),
                go(we),
                "MODE SENSE {t:?}"
            );
            assert_eq!(other.check(&cdb(opc::SYNC_CACHE_10)), Verdict::Conflict);
        }
    }

    #[test]
    fn register_rules_and_generation() {
        let mut s = PrState::new();
        assert!(s.view(&a()).is_clear());
        reg(&mut s, &a(), 7);
        assert_eq!(s.generation(), 1);
        // REGISTER with the wrong key: conflict, no generation change.
        assert_eq!(
            s.pr_out(&a(), &out_cdb(0, 0), &param(0, 8, 0)),
            Outcome::Conflict
        );
        // REGISTER from an unregistered nexus with a nonzero key: conflict.
        assert_eq!(
            s.pr_out(&b(), &out_cdb(0, 0), &param(5, 8, 0)),
            Outcome::Conflict
        );
        assert_eq!(s.generation(), 1);
        assert_eq!(s.pr_out(&a(), &out_cdb(0, 0), &param(7, 9, 0)), GOOD);
        assert_eq!(keys(&s), vec![9]);
        assert_eq!(s.generation(), 2);
        // RESERVE and RELEASE do not count.
        assert_eq!(resv(&mut s, &a(), 9, PrType::WriteExclusive), GOOD);
        assert_eq!(
            s.pr_out(&a(), &out_cdb(2, 1), &param(9, 0, 0)),
            Outcome::Good { save: None }
        );
        assert_eq!(s.generation(), 2);
        // Unregister.
        assert_eq!(s.pr_out(&a(), &out_cdb(0, 0), &param(9, 0, 0)), GOOD);
        assert_eq!(keys(&s), Vec::<u64>::new());
        assert_eq!(s.generation(), 3);
        // Unknown service actions, REGISTER AND MOVE, bad lengths, SPEC_I_PT.
        assert_eq!(
            s.pr_out(&a(), &out_cdb(7, 0), &param(0, 1, 0)),
            Outcome::Check(Sense::INVALID_FIELD_CDB)
        );
        let mut c = out_cdb(6, 0);
        c[8] = 28;
        assert_eq!(
            s.pr_out(&a(), &c, &[0; 28]),
            Outcome::Check(Sense::PARAM_LIST_LENGTH)
        );
        assert_eq!(
            s.pr_out(&a(), &out_cdb(6, 0), &param(0, 1, 0x08)),
            Outcome::Check(Sense::INVALID_FIELD_PARAM)
        );
        // Not registered: RESERVE conflicts.
        assert_eq!(
            resv(&mut s, &a(), 0, PrType::WriteExclusive),
            Outcome::Conflict
        );
    }

    #[test]
    fn reserve_release_types() {
        let mut s = PrState::new();
        reg(&mut s, &a(), 1);
        reg(&mut s, &b(), 2);
        assert_eq!(resv(&mut s, &a(), 1, PrType::ExclusiveAccess), GOOD);
        // Same type again: GOOD; another type or another nexus: conflict.
        assert_eq!(resv(&mut s, &a(), 1, PrType::ExclusiveAccess), GOOD);
        assert_eq!(
            resv(&mut s, &a(), 1, PrType::WriteExclusive),
            Outcome::Conflict
        );
        assert_eq!(
            resv(&mut s, &b(), 2, PrType::ExclusiveAccess),
            Outcome::Conflict
        );
        // Release by a non-holder: nothing happens.
        assert_eq!(s.pr_out(&b(), &out_cdb(2, 3), &param(2, 0, 0)), GOOD);
        assert!(s.reservation().is_some());
        // Release with the wrong type.
        assert_eq!(
            s.pr_out(&a(), &out_cdb(2, 1), &param(1, 0, 0)),
            Outcome::Check(INVALID_RELEASE)
        );
        assert_eq!(s.pr_out(&a(), &out_cdb(2, 3), &param(1, 0, 0)), GOOD);
        assert!(s.reservation().is_none());
        // Registrants Only: release tells the other registrants.
        assert_eq!(
            resv(&mut s, &a(), 1, PrType::WriteExclusiveRegistrantsOnly),
            GOOD
        );
        assert_eq!(s.pr_out(&a(), &out_cdb(2, 5), &param(1, 0, 0)), GOOD);
        assert!(s.view(&b()).ua);
        assert_eq!(s.take_ua(&b()), Some(ua::RESERVATIONS_RELEASED));
        assert!(!s.view(&a()).ua);
        // All Registrants: every registrant holds it; key 0 in READ RESERVATION; it
        // survives its maker unregistering.
        assert_eq!(
            resv(&mut s, &a(), 1, PrType::ExclusiveAccessAllRegistrants),
            GOOD
        );
        assert_eq!(
            resv(&mut s, &b(), 2, PrType::ExclusiveAccessAllRegistrants),
            GOOD
        );
        let rr = s.pr_in(&{
            let mut c = cdb(opcode::PR_IN);
            c[1] = 1;
            c
        });
        let rr = rr.unwrap();
        assert_eq!(be32(&rr[4..8]), 16);
        assert_eq!(be64(&rr[8..16]), 0);
        assert_eq!(rr[21], 8);
        assert_eq!(s.pr_out(&a(), &out_cdb(6, 0), &param(0, 0, 0)), GOOD);
        assert!(s.reservation().is_some());
        assert_eq!(s.view(&b()).check(&cdb(opc::WRITE_10)), Verdict::Go);
        assert_eq!(s.pr_out(&b(), &out_cdb(6, 0), &param(0, 0, 0)), GOOD);
        assert!(s.reservation().is_none());
        // The holder of a plain type unregistering releases it.
        reg(&mut s, &a(), 1);
        assert_eq!(resv(&mut s, &a(), 1, PrType::WriteExclusive), GOOD);
        assert_eq!(s.pr_out(&a(), &out_cdb(6, 0), &param(0, 0, 0)), GOOD);
        assert!(s.reservation().is_none());
    }

    #[test]
    fn preempt_and_clear() {
        let mut s = PrState::new();
        reg(&mut s, &a(), 1);
        reg(&mut s, &b(), 2);
        reg(&mut s, &c(), 3);
        assert_eq!(resv(&mut s, &a(), 1, PrType::WriteExclusive), GOOD);
        let g = s.generation();
        // Unregistered or wrong key: conflict.
        assert_eq!(
            s.pr_out(&b(), &out_cdb(4, 1), &param(9, 1, 0)),
            Outcome::Conflict
        );
        // A key nobody has: conflict.
        assert_eq!(
            s.pr_out(&b(), &out_cdb(4, 1), &param(2, 77, 0)),
            Outcome::Conflict
        );
        // B preempts A's reservation as Exclusive Access.
        assert_eq!(s.pr_out(&b(), &out_cdb(4, 3), &param(2, 1, 0)), GOOD);
        assert_eq!(s.generation(), g + 1);
        assert_eq!(s.reservation(), Some((PrType::ExclusiveAccess, &b())));
        assert_eq!(keys(&s), vec![2, 3]);
        assert_eq!(s.take_ua(&a()), Some(ua::REGISTRATIONS_PREEMPTED));
        assert_eq!(s.take_ua(&c()), Some(ua::RESERVATIONS_RELEASED));
        assert_eq!(s.take_ua(&b()), None);
        assert_eq!(s.view(&a()).check(&cdb(opc::READ_10)), Verdict::Conflict);
        // Preempting a registration only (not the holder's key).
        assert_eq!(s.pr_out(&b(), &out_cdb(4, 3), &param(2, 3, 0)), GOOD);
        assert_eq!(keys(&s), vec![2]);
        assert_eq!(s.take_ua(&c()), Some(ua::REGISTRATIONS_PREEMPTED));
        // Without a reservation, a zero key is an invalid parameter.
        reg(&mut s, &a(), 1);
        assert_eq!(s.pr_out(&b(), &out_cdb(2, 3), &param(2, 0, 0)), GOOD);
        assert_eq!(
            s.pr_out(&b(), &out_cdb(4, 3), &param(2, 0, 0)),
            Outcome::Check(Sense::INVALID_FIELD_PARAM)
        );
        // All Registrants with a zero key: everyone else goes, a new reservation.
        assert_eq!(
            resv(&mut s, &a(), 1, PrType::WriteExclusiveAllRegistrants),
            GOOD
        );
        assert_eq!(s.pr_out(&b(), &out_cdb(5, 1), &param(2, 0, 0)), GOOD);
        assert_eq!(keys(&s), vec![2]);
        assert_eq!(s.reservation(), Some((PrType::WriteExclusive, &b())));
        // CLEAR: everything goes, the others hear RESERVATIONS PREEMPTED.
        reg(&mut s, &a(), 1);
        let g = s.generation();
        assert_eq!(s.pr_out(&b(), &out_cdb(3, 0), &param(2, 0, 0)), GOOD);
        assert_eq!(s.generation(), g + 1);
        assert!(s.reservation().is_none());
        assert!(keys(&s).is_empty());
        assert_eq!(s.take_ua(&a()), Some(ua::REGISTRATIONS_PREEMPTED));
        assert_eq!(s.take_ua(&a()), Some(ua::RESERVATIONS_PREEMPTED));
        assert_eq!(s.take_ua(&a()), None);
    }

    #[test]
    fn reserve6_and_resets() {
        let mut s = PrState::new();
        s.attach(&a());
        s.attach(&b());
        let r6 = cdb(opcode::RESERVE_6);
        let rl6 = cdb(opcode::RELEASE_6);
        assert_eq!(s.reserve6(&a(), &r6), GOOD);
        assert_eq!(s.reserve6(&a(), &r6), GOOD);
        assert_eq!(s.reserve6(&b(), &r6), Outcome::Conflict);
        let vb = s.view(&b());
        assert_eq!(vb.check(&cdb(opc::MODE_SENSE_6)), Verdict::Conflict);
        assert_eq!(vb.check(&cdb(opc::INQUIRY)), Verdict::Go);
        assert_eq!(vb.check(&rl6), Verdict::Go);
        // RELEASE by the other: nothing.
        assert_eq!(s.release6(&b(), &rl6), GOOD);
        assert_eq!(s.view(&b()).spc2, Spc2::Other);
        // PR commands conflict for everyone while RESERVE(6) holds.
        assert_eq!(s.view(&a()).check(&cdb(opcode::PR_IN)), Verdict::Conflict);
        // Nexus loss releases it.
        s.attach(&a());
        assert!(!s.detach(&a()));
        assert!(s.detach(&a()));
        assert_eq!(s.view(&b()).spc2, Spc2::Free);
        // Reset: released, the others get 29h/03h.
        s.attach(&a());
        assert_eq!(s.reserve6(&a(), &r6), GOOD);
        s.reset(&b());
        assert_eq!(s.view(&a()).spc2, Spc2::Free);
        assert_eq!(
            s.view(&a()).check(&cdb(opc::TEST_UNIT_READY)),
            Verdict::UnitAttention
        );
        assert_eq!(s.view(&a()).check(&cdb(opc::INQUIRY)), Verdict::Go);
        assert_eq!(s.take_ua(&a()), Some(ua::BUS_DEVICE_RESET));
        assert!(!s.view(&b()).ua);
        // Registrations make RESERVE(6) conflict.
        reg(&mut s, &b(), 5);
        assert_eq!(s.reserve6(&a(), &r6), Outcome::Conflict);
        assert_eq!(s.view(&a()).check(&r6), Verdict::Conflict);
    }

    #[test]
    fn read_full_status_caps_and_truncation() {
        let mut s = PrState::new();
        reg(&mut s, &a(), 1);
        assert_eq!(resv(&mut s, &a(), 1, PrType::WriteExclusive), GOOD);
        let mut c = cdb(opcode::PR_IN);
        c[1] = 3;
        let d = s.pr_in(&c).unwrap();
        assert_eq!(be32(&d[4..8]) as usize, d.len() - 8);
        assert_eq!(be64(&d[8..16]), 1);
        assert_eq!(d[20], 0x01);
        assert_eq!(d[21], 1);
        let tid = &d[32..];
        assert_eq!(tid[0], 0x45);
        let text = std::str::from_utf8(&tid[4..]).unwrap();
        assert!(text.starts_with("iqn.a,i,0x230000000001\0"), "{text}");
        assert_eq!(tid.len() % 4, 0);
        c[1] = 2;
        let caps = s.pr_in(&c).unwrap();
        assert_eq!(caps.len(), 8);
        assert_eq!(caps[1], 8);
        c[1] = 4;
        assert_eq!(s.pr_in(&c), Err(Sense::INVALID_FIELD_CDB));
    }

    #[test]
    fn aptpl_saves_and_round_trips() {
        let mut s = PrState::new();
        // Without a store, APTPL is refused (PTPL_C = 0).
        assert_eq!(
            s.pr_out(&a(), &out_cdb(6, 0), &param(0, 0x1122, 0x01)),
            Outcome::Check(Sense::INVALID_FIELD_PARAM)
        );
        s.set_ptpl_capable(true);
        let o = s.pr_out(&a(), &out_cdb(6, 0), &param(0, 0x1122, 0x01));
        let Outcome::Good { save: Some(bytes) } = o else {
            panic!("{o:?}")
        };
        assert!(s.aptpl());
        // The last REGISTER's APTPL wins: 0 clears the saved state.
        let o = s.pr_out(&b(), &out_cdb(6, 0), &param(0, 0x33, 0));
        assert_eq!(
            o,
            Outcome::Good {
                save: Some(Vec::new())
            }
        );
        assert!(!s.aptpl());
        let o = s.pr_out(&a(), &out_cdb(6, 0), &param(0, 0x1122, 0x05));
        assert!(matches!(o, Outcome::Good { save: Some(_) }));
        // RESERVE is saved too; RESERVE again (no change) is not.
        let o = resv(&mut s, &a(), 0x1122, PrType::ExclusiveAccessRegistrantsOnly);
        assert!(matches!(o, Outcome::Good { save: Some(_) }));
        let o = resv(&mut s, &a(), 0x1122, PrType::ExclusiveAccessRegistrantsOnly);
        assert_eq!(o, GOOD);
        let enc = s.encode();
        let d = PrState::decode(&enc).unwrap();
        assert_eq!(d.regs, s.regs);
        assert_eq!(d.resv, s.resv);
        assert_eq!(d.generation, s.generation);
        assert!(d.aptpl);
        assert_eq!(d.encode(), enc);
        // The first save decodes too.
        assert_eq!(PrState::decode(&bytes).unwrap().regs.len(), 1);
        // Corruption anywhere is caught.
        for i in 0..enc.len() {
            let mut e = enc.clone();
            e[i] ^= 0x10;
            assert!(PrState::decode(&e).is_err(), "byte {i}");
        }
        assert!(PrState::decode(&enc[..enc.len() - 1]).is_err());
        // A decoded state is not PTPL-capable until told (no store behind it yet).
        assert!(!d.ptpl_capable);
        // APTPL cleared: an empty save.
        let o = s.pr_out(&a(), &out_cdb(6, 0), &param(0, 0x1122, 0));
        assert_eq!(
            o,
            Outcome::Good {
                save: Some(Vec::new())
            }
        );
    }
}
