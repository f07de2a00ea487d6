//! NVMe command-level facts of the target, pure: status codes, properties, and the data
//! structures the admin and discovery controllers return (Identify, log pages).
//!
//! Sources: NVMe Base Specification 2.0 ("Base") for the admin commands, properties,
//! Identify Controller (§5.17.2.1, Fig. 275) and log pages (§5.16); NVMe NVM Command Set
//! Specification 1.0 ("NVM") for Identify Namespace (§4.1.5.1) and the I/O commands;
//! NVMe over Fabrics as folded into Base 2.0 §6 for Connect and Property Get/Set; the
//! discovery log page (Base §5.16.1.23, Fig. 262/263). Byte offsets below are those of the
//! figures (and of Linux `include/linux/nvme.h`, which the interop host uses).

use engine::geometry::ArrayGeometry;

/// The well-known discovery subsystem NQN (Base 2.0 §4.5.3.2).
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Prefix of the NQN of an array's subsystem: the array name follows (Base §4.5:
/// `nqn.yyyy-mm.reverse-domain:free-form`).
pub const NQN_PREFIX: &str = "nqn.2026-11.org.ferroraid:";
/// Longest NQN, bytes (Base §4.5: 223 bytes, UTF-8, NUL-terminated in a 256-byte field).
pub const NQN_MAX: usize = 223;
/// Size of Identify data and of most log pages, bytes.
pub const IDENTIFY_BYTES: usize = 4096;
/// Maximum Data Transfer Size as a power of two of the minimum page (4 KiB): 5 ⇒ 128 KiB
/// (Identify Controller MDTS, Base Fig. 275; SPDK's default max I/O size).
pub const MDTS: u8 = 5;
/// MDTS in bytes.
pub const MAX_TRANSFER: u32 = 4096 << MDTS;
/// Highest queue entries, 0's based (CAP.MQES): 128 entries, the Linux default queue size.
pub const MQES: u16 = 127;
/// I/O queues a controller grants at most (Set Features Number of Queues).
pub const MAX_IO_QUEUES: u16 = 64;
/// In-capsule data of I/O commands, bytes (IOCCSZ × 16 − 64, TCP 1.0 Fig. 11): 4 KiB, so a
/// 4 KiB write (and the 4096-byte DSM range list) travels with its command.
pub const IO_IN_CAPSULE: u32 = 4096;
/// In-capsule data accepted on the admin queue and for Fabrics commands on any queue,
/// bytes (TCP 1.0 §3.3.1 Fig. 11 note: at least 8192).
pub const ADMIN_IN_CAPSULE: u32 = 8192;
/// Keep Alive Support granularity (Identify KAS), units of 100 ms: 1 ⇒ 100 ms.
pub const KAS: u16 = 1;
/// Asynchronous Event Requests held at once (AERL + 1; Base Fig. 275 AERL is 0's based).
pub const AER_LIMIT: usize = 4;
/// NVMe version reported (VS, Base §3.1.3.2): 1.3, which makes the host use the NS
/// descriptor list and not require CNTRLTYPE checks beyond it (research note §1.7 step 7).
pub const VERSION: u32 = 0x0001_0300;

/// Status code types (Base §4.2.3, Fig. 92).
pub mod sct {
    /// Generic Command Status.
    pub const GENERIC: u8 = 0;
    /// Command Specific Status.
    pub const COMMAND: u8 = 1;
    /// Media and Data Integrity Errors.
    pub const MEDIA: u8 = 2;
    /// Path Related Status (Base 2.0 Fig. 97).
    pub const PATH: u8 = 3;
}

/// Generic command status codes (Base Fig. 94).
pub mod sc {
    /// Successful Completion.
    pub const SUCCESS: u8 = 0x00;
    /// Invalid Command Opcode.
    pub const INVALID_OPCODE: u8 = 0x01;
    /// Invalid Field in Command.
    pub const INVALID_FIELD: u8 = 0x02;
    /// Data Transfer Error.
    pub const DATA_TRANSFER_ERROR: u8 = 0x04;
    /// Internal Error.
    pub const INTERNAL: u8 = 0x06;
    /// Invalid Namespace or Format.
    pub const INVALID_NS: u8 = 0x0B;
    /// Command Sequence Error.
    pub const SEQUENCE: u8 = 0x0C;
    /// Data SGL Length Invalid.
    pub const SGL_LENGTH_INVALID: u8 = 0x0F;
    /// SGL Descriptor Type Invalid.
    pub const SGL_TYPE_INVALID: u8 = 0x11;
    /// SGL Offset Invalid.
    pub const SGL_OFFSET_INVALID: u8 = 0x16;
    /// Keep Alive Timeout Invalid.
    pub const KEEP_ALIVE_INVALID: u8 = 0x1A;
    /// Transient Transport Error (TCP 1.0 §3.5: a data digest error).
    pub const TRANSIENT_TRANSPORT: u8 = 0x22;
    /// LBA Out of Range (NVM-specific generic status, NVM Fig. 31).
    pub const LBA_OUT_OF_RANGE: u8 = 0x80;
    /// Namespace Not Ready (NVM Fig. 31).
    pub const NS_NOT_READY: u8 = 0x82;
    /// Command specific: Asynchronous Event Request Limit Exceeded (Base Fig. 95).
    pub const AER_LIMIT_EXCEEDED: u8 = 0x05;
    /// Command specific: Invalid Log Page (Base Fig. 95).
    pub const INVALID_LOG_PAGE: u8 = 0x09;
    /// Command specific: Feature Not Changeable (Base Fig. 95).
    pub const FEATURE_NOT_CHANGEABLE: u8 = 0x0E;
    /// Command specific (Fabrics): Incompatible Format (Base §6.3, Fig. 379).
    pub const CONNECT_INCOMPATIBLE_FORMAT: u8 = 0x80;
    /// Command specific (Fabrics): Connect Invalid Parameters.
    pub const CONNECT_INVALID_PARAMETERS: u8 = 0x82;
    /// Command specific (Fabrics): Connect Invalid Host (NVMe-oF 1.1 §3.3.1, Fig. 21;
    /// Base 2.0 Fig. 379): the host is not allowed to connect to the subsystem.
    pub const CONNECT_INVALID_HOST: u8 = 0x84;
    /// Path related (SCT 3h): Asymmetric Access Inaccessible (Base 2.0 Fig. 97).
    pub const ANA_INACCESSIBLE: u8 = 0x02;
    /// Media: Write Fault (Base Fig. 96).
    pub const WRITE_FAULT: u8 = 0x80;
    /// Media: Unrecovered Read Error.
    pub const UNRECOVERED_READ: u8 = 0x81;
    /// Media: Compare Failure.
    pub const COMPARE_FAILURE: u8 = 0x85;
}

/// Admin command opcodes (Base Fig. 141).
pub mod admin {
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0A;
    /// Asynchronous Event Request.
    pub const AER: u8 = 0x0C;
    /// Keep Alive.
    pub const KEEP_ALIVE: u8 = 0x18;
    /// Fabrics command (FCTYPE in SQE byte 4; Base §6).
    pub const FABRICS: u8 = 0x7F;
}

/// Fabrics command types (Base §6, Fig. 368).
pub mod fctype {
    /// Property Set.
    pub const PROPERTY_SET: u8 = 0x00;
    /// Connect.
    pub const CONNECT: u8 = 0x01;
    /// Property Get.
    pub const PROPERTY_GET: u8 = 0x04;
    /// Disconnect (Base 2.0 §6.4; an I/O queue only).
    pub const DISCONNECT: u8 = 0x08;
}

/// NVM command opcodes (NVM Fig. 15; Flush from Base §7.1).
pub mod io {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Compare.
    pub const COMPARE: u8 = 0x05;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DSM: u8 = 0x09;
}

/// Feature identifiers (Base Fig. 319).
pub mod feature {
    /// Volatile Write Cache.
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    /// Number of Queues.
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    /// Asynchronous Event Configuration.
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0B;
    /// Keep Alive Timer.
    pub const KEEP_ALIVE_TIMER: u8 = 0x0F;
    /// Host Identifier.
    pub const HOST_IDENTIFIER: u8 = 0x81;
}

/// Log page identifiers (Base Fig. 202).
pub mod log {
    /// Error Information.
    pub const ERROR: u8 = 0x01;
    /// SMART / Health Information.
    pub const SMART: u8 = 0x02;
    /// Firmware Slot Information.
    pub const FW_SLOT: u8 = 0x03;
    /// Changed Namespace List.
    pub const CHANGED_NS: u8 = 0x04;
    /// Asymmetric Namespace Access (Base 2.0 §5.16.1.13).
    pub const ANA: u8 = 0x0C;
    /// Discovery (discovery controllers only).
    pub const DISCOVERY: u8 = 0x70;
}

/// Asynchronous Event Configuration (Set Features 0Bh, Base 2.0 §5.27.1.8, Fig. 315)
/// bit 11: Asymmetric Namespace Access Change Notices enabled.
pub const AEC_ANA_CHANGE: u32 = 1 << 11;
/// Completion DW0 of an Asynchronous Event Request for an ANA change (Base 2.0 §5.2,
/// Fig. 146/148): event type 2h (Notice) in bits 2:0, information 03h (ANA Change) in
/// bits 15:8, log page 0Ch in bits 23:16.
pub const AEN_ANA_CHANGE: u32 = 0x2 | (0x03 << 8) | ((log::ANA as u32) << 16);
/// ANA Transition Time (Identify ANATT), seconds: the host arms a 2 × ANATT timer while a
/// group is in the change state (never reported by this target).
pub const ANATT_SECONDS: u8 = 10;
/// The one ANA group (ID) and the namespace in it.
pub const ANA_GROUP: u32 = 1;
/// Get Log Page LSP bit 0 for log 0Ch: Return Groups Only (no NSID lists).
pub const ANA_LSP_RGO: u32 = 1;

/// The ANA state of a path (Base 2.0 §8.1.3; codes of the ANA log, Fig. 220).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnaState {
    /// ANA Optimized (01h): the preferred path.
    Optimized,
    /// ANA Non-Optimized (02h): serves I/O; used when no optimized path is left.
    NonOptimized,
    /// ANA Inaccessible (03h): I/O completes with SCT 3h / SC 02h; the host fails over.
    Inaccessible,
}

impl AnaState {
    /// The state's code in the ANA log.
    pub fn code(self) -> u8 {
        match self {
            AnaState::Optimized => 0x01,
            AnaState::NonOptimized => 0x02,
            AnaState::Inaccessible => 0x03,
        }
    }

    /// The state of a log code (`None` for codes this target never uses).
    pub fn from_code(c: u8) -> Option<Self> {
        match c {
            0x01 => Some(AnaState::Optimized),
            0x02 => Some(AnaState::NonOptimized),
            0x03 => Some(AnaState::Inaccessible),
            _ => None,
        }
    }

    /// The name used by JSON-RPC and the CLI (`optimized`, `non_optimized`,
    /// `inaccessible`).
    pub fn name(self) -> &'static str {
        match self {
            AnaState::Optimized => "optimized",
            AnaState::NonOptimized => "non_optimized",
            AnaState::Inaccessible => "inaccessible",
        }
    }

    /// The state named `s` (as [`AnaState::name`]; `-` may stand for `_`).
    pub fn from_name(s: &str) -> Option<Self> {
        match s.replace('-', "_").as_str() {
            "optimized" => Some(AnaState::Optimized),
            "non_optimized" => Some(AnaState::NonOptimized),
            "inaccessible" => Some(AnaState::Inaccessible),
            _ => None,
        }
    }
}

impl std::fmt::Display for AnaState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Bytes of the ANA log page (Base 2.0 §5.16.1.13, Fig. 218/219): the 16-byte header,
/// one 32-byte group descriptor, and its NSID list (one NSID) unless `rgo`.
pub fn ana_log_len(rgo: bool) -> usize {
    16 + 32 + if rgo { 0 } else { 4 }
}

/// Writes bytes `[offset, offset + out.len())` of the ANA log page into `out` (bytes past
/// the end read as zero): header CHGCNT (0..8) = `chgcnt`, NGRPS (8..10) = 1; descriptor
/// at 16: ANAGRPID (0..4) = 1, NNSID (4..8) = 1 (0 with `rgo`), CHGCNT (8..16) = `chgcnt`,
/// ANA state (16, bits 3:0) = `state`, NSID list at 32: \[1\] unless `rgo`.
pub fn ana_log(chgcnt: u64, state: AnaState, rgo: bool, offset: u64, out: &mut [u8]) {
    out.fill(0);
    let mut page = [0u8; 16 + 32 + 4];
    put64(&mut page, 0, chgcnt);
    put16(&mut page, 8, 1);
    put32(&mut page, 16, ANA_GROUP);
    put32(&mut page, 20, u32::from(!rgo));
    put64(&mut page, 24, chgcnt);
    page[32] = state.code();
    if !rgo {
        put32(&mut page, 48, 1);
    }
    let len = ana_log_len(rgo) as u64;
    if offset >= len {
        return;
    }
    let src = &page[offset as usize..len as usize];
    let n = src.len().min(out.len());
    out[..n].copy_from_slice(&src[..n]);
}

/// Property offsets (Base §3.1.3, Fig. 33).
pub mod prop {
    /// Controller Capabilities (8 bytes).
    pub const CAP: u32 = 0x00;
    /// Version.
    pub const VS: u32 = 0x08;
    /// Controller Configuration.
    pub const CC: u32 = 0x14;
    /// Controller Status.
    pub const CSTS: u32 = 0x1C;
}

/// CAP (Base §3.1.3.1): MQES, CQR = 1 (contiguous queues required), TO = 30 (15 s: the
/// host's ready timeout, generous for emulated guests), CSS bit 37 (NVM command set only,
/// so the host does not require CSI descriptors), MPSMIN = MPSMAX = 0 (4 KiB), CRMS = 0.
pub const CAP_VALUE: u64 = MQES as u64 | (1 << 16) | (30 << 24) | (1 << 37);

/// CC fields (Base §3.1.3.5).
pub mod cc {
    /// Enable.
    pub const EN: u32 = 1;
    /// Shutdown Notification, bits 15:14.
    pub const SHN_SHIFT: u32 = 14;
    /// I/O Submission Queue Entry Size, bits 19:16 (must be 6: 64 bytes).
    pub const IOSQES_SHIFT: u32 = 16;
    /// I/O Completion Queue Entry Size, bits 23:20 (must be 4: 16 bytes).
    pub const IOCQES_SHIFT: u32 = 20;
}

/// CSTS fields (Base §3.1.3.6).
pub mod csts {
    /// Ready.
    pub const RDY: u32 = 1;
    /// Controller Fatal Status.
    pub const CFS: u32 = 1 << 1;
    /// Shutdown Status: shutdown processing occurring (01b, bits 3:2).
    pub const SHST_OCCURRING: u32 = 0b01 << 2;
    /// Shutdown Status: shutdown processing complete (10b).
    pub const SHST_COMPLETE: u32 = 0b10 << 2;
    /// Mask of SHST.
    pub const SHST_MASK: u32 = 0b11 << 2;
}

/// Whether a CC value written with EN 0 → 1 is one this controller runs with (what nvmet's
/// `nvmet_cc_*` checks do): IOSQES 6, IOCQES 4, MPS 0 (4 KiB), AMS 0, CSS 0 (NVM).
pub fn cc_valid(cc: u32) -> bool {
    let field = |shift: u32, bits: u32| (cc >> shift) & ((1 << bits) - 1);
    field(cc::IOSQES_SHIFT, 4) == 6
        && field(cc::IOCQES_SHIFT, 4) == 4
        && field(7, 4) == 0
        && field(11, 3) == 0
        && field(4, 3) == 0
}

/// What a subsystem reports about itself and its one namespace (NSID 1), fixed for the
/// life of the target.
#[derive(Debug, Clone)]
pub struct Subsystem {
    /// Subsystem NQN ([`subsystem_nqn`]).
    pub nqn: String,
    /// Serial number: 20 ASCII characters (hex of the array UUID's first 10 bytes).
    pub serial: [u8; 20],
    /// Model number, 40 ASCII characters, space padded.
    pub model: [u8; 40],
    /// Firmware revision, 8 ASCII characters (the crate version).
    pub firmware: [u8; 8],
    /// The array UUID: the namespace's NGUID and UUID (stable across restarts).
    pub uuid: [u8; 16],
    /// Logical block size, bytes (the array's block size: the LBA size).
    pub block_bytes: u32,
    /// Namespace size, logical blocks.
    pub blocks: u64,
    /// Namespace Optimal I/O Boundary, logical blocks (NVM §4.1.5.1 NOIOB; the chunk when
    /// it is a power of two that fits 16 bits, else 0 = not reported).
    pub noiob: u16,
    /// Namespace Preferred Write Granularity, 0's based logical blocks (NPWG: the full
    /// stripe's data, so a write of it needs no read-modify-write), saturated at 65535.
    pub npwg: u16,
    /// Namespace Optimal Write Size, 0's based logical blocks (NOWS: also the stripe).
    pub nows: u16,
}

/// The NQN of the subsystem exporting array `name` with UUID `uuid`:
/// `nqn.2026-11.org.ferroraid:<name>` when the name is printable ASCII without spaces and
/// the NQN fits 223 bytes, else the UUID form `nqn.2014-08.org.nvmexpress:uuid:<uuid>`
/// (Base §4.5).
pub fn subsystem_nqn(name: &str, uuid: &[u8; 16]) -> String {
    let ok = !name.is_empty() && name.bytes().all(|b| b.is_ascii_graphic());
    if ok && NQN_PREFIX.len() + name.len() <= NQN_MAX {
        return format!("{NQN_PREFIX}{name}");
    }
    format!("nqn.2014-08.org.nvmexpress:uuid:{}", uuid_string(uuid))
}

/// `8-4-4-4-12` lower-case hex form of a UUID.
pub fn uuid_string(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn padded<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [b' '; N];
    for (o, b) in out.iter_mut().zip(s.bytes()) {
        *o = b;
    }
    out
}

impl Subsystem {
    /// The subsystem of array `name` (UUID `uuid`, geometry `geo`).
    pub fn for_array(name: &str, uuid: [u8; 16], geo: &ArrayGeometry) -> Self {
        let g = geo.geometry();
        let bs = g.block_bytes();
        let serial_hex: String = uuid[..10].iter().map(|b| format!("{b:02x}")).collect();
        let chunk_blocks = g.chunk_bytes() / bs;
        let stripe_blocks = g.stripe_data_bytes() / u64::from(bs);
        let noiob = if chunk_blocks.is_power_of_two() && chunk_blocks <= u32::from(u16::MAX) {
            chunk_blocks as u16
        } else {
            0
        };
        let m1 = stripe_blocks.saturating_sub(1).min(u64::from(u16::MAX)) as u16;
        Self {
            nqn: subsystem_nqn(name, &uuid),
            serial: padded(&serial_hex),
            model: padded(&format!("ferroraid RAID{}", g.level().md_level())),
            firmware: padded(env!("CARGO_PKG_VERSION")),
            uuid,
            block_bytes: bs,
            blocks: geo.capacity_blocks(),
            noiob,
            npwg: m1,
            nows: m1,
        }
    }
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
fn put_str(b: &mut [u8], at: usize, len: usize, s: &str) {
    let n = s.len().min(len);
    b[at..at + n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Which controller answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtrlKind {
    /// The I/O controller of the array's subsystem.
    Io,
    /// The discovery controller.
    Discovery,
}

/// Identify Controller (CNS 01h, Base §5.17.2.1, Fig. 275) into `out` (4096 bytes).
pub fn identify_controller(s: &Subsystem, kind: CtrlKind, cntlid: u16, out: &mut [u8]) {
    let out = &mut out[..IDENTIFY_BYTES];
    out.fill(0);
    // VID/SSVID 0 (no PCI vendor).
    out[4..24].copy_from_slice(&s.serial);
    out[24..64].copy_from_slice(&s.model);
    out[64..72].copy_from_slice(&s.firmware);
    // CMIC (Base Fig. 275): bit1, the subsystem may have several controllers (one per
    // host association); for the I/O controller also bit0, several ports (portals), and
    // bit3, ANA reporting (research note §3.2: what native multipath needs).
    out[76] = match kind {
        CtrlKind::Io => 0b1011,
        CtrlKind::Discovery => 0b10,
    };
    out[77] = MDTS;
    put16(out, 78, cntlid);
    put32(out, 80, VERSION);
    // OAES: bit 8 Namespace Attribute Notices (changed-NS list), bit 11 ANA Change
    // Notices; bit 31 (discovery log change) for discovery.
    put32(
        out,
        92,
        match kind {
            CtrlKind::Io => (1 << 8) | AEC_ANA_CHANGE,
            CtrlKind::Discovery => 1 << 31,
        },
    );
    // CTRATT bit 0: 128-bit Host Identifier.
    put32(out, 96, 1);
    out[111] = match kind {
        CtrlKind::Io => 1,
        CtrlKind::Discovery => 2,
    };
    // OACS 0; ACL 3 (Abort limit, 0's based); AERL; FRMW bit0 slot 1 read-only, 1 slot.
    out[258] = 3;
    out[259] = (AER_LIMIT - 1) as u8;
    out[260] = 0b11;
    // LPA bit2: extended data for Get Log Page (LPO, NUMDU).
    out[261] = 1 << 2;
    // ELPE 0: one error log entry.
    put16(out, 320, KAS);
    if kind == CtrlKind::Io {
        // ANATT; ANACAP bits 0-2 (optimized, non-optimized, inaccessible states) and bit 6
        // (ANAGRPID does not change while the namespace is attached); ANAGRPMAX and
        // NANAGRPID 1 (one group).
        out[342] = ANATT_SECONDS;
        out[343] = 0b0100_0111;
        put32(out, 344, ANA_GROUP);
        put32(out, 348, ANA_GROUP);
    }
    out[512] = 0x66;
    out[513] = 0x44;
    put16(out, 514, MQES + 1);
    if kind == CtrlKind::Io {
        put32(out, 516, 1); // NN
                            // ONCS: bit0 Compare, bit2 DSM, bit3 Write Zeroes.
        put16(out, 520, 0b1101);
        // VWC bit0: a volatile write cache (the members'): Flush and FUA matter.
        out[525] = 1;
        // MNAN: 1 (≠ 0 and ≤ NN, which Linux 6.1 requires with CMIC bit3; it sizes the
        // ANA log from it).
        put32(out, 540, 1);
    }
    // SGLS bit0: SGLs supported (no alignment); bit 20: in-capsule data (Offset SGLs).
    put32(out, 536, 1 | (1 << 20));
    let nqn = match kind {
        CtrlKind::Io => s.nqn.as_str(),
        CtrlKind::Discovery => DISCOVERY_NQN,
    };
    put_str(out, 768, 256, nqn);
    // Fabrics: IOCCSZ (16-byte units, SQE included), IORCSZ 1, ICDOFF 0, FCATT 0
    // (dynamic controller model), MSDBD 1.
    put32(out, 1792, (64 + IO_IN_CAPSULE) / 16);
    put32(out, 1796, 1);
    out[1803] = 1;
    // PSD0: max power 0 (not reported), the only power state (NPSS 0).
}

/// Identify Namespace (CNS 00h, NVM §4.1.5.1) of NSID 1 into `out` (4096 bytes).
pub fn identify_namespace(s: &Subsystem, out: &mut [u8]) {
    let out = &mut out[..IDENTIFY_BYTES];
    out.fill(0);
    put64(out, 0, s.blocks); // NSZE
    put64(out, 8, s.blocks); // NCAP
    put64(out, 16, s.blocks); // NUSE
                              // NSFEAT bit4: NPWG/NPWA/NPDG/NPDA/NOWS are valid (OPTPERF).
    out[24] = 1 << 4;
    // NLBAF 0 (one format), FLBAS 0. DLFEAT 0: deallocated blocks read unspecified —
    // the array only deallocates whole stripes (ArrayOp::Discard).
    // NMIC bit0: the namespace may be reached through several controllers (shared;
    // multipath requires it).
    out[30] = 1;
    put16(out, 46, s.noiob);
    put16(out, 64, s.npwg); // NPWG
    put16(out, 66, s.npwg); // NPWA
    put16(out, 68, s.npwg); // NPDG
    put16(out, 70, s.npwg); // NPDA
    put16(out, 72, s.nows); // NOWS
    put32(out, 92, ANA_GROUP); // ANAGRPID
    out[104..120].copy_from_slice(&s.uuid); // NGUID
                                            // LBAF0: MS 0, LBADS = log2(block size), RP 0.
    out[128 + 2] = s.block_bytes.trailing_zeros() as u8;
}

/// Active Namespace ID list (CNS 02h, Base §5.17.2.2) after NSID `after` into `out`.
pub fn active_ns_list(after: u32, out: &mut [u8]) {
    let out = &mut out[..IDENTIFY_BYTES];
    out.fill(0);
    if after < 1 {
        put32(out, 0, 1);
    }
}

/// Namespace Identification Descriptor list (CNS 03h, Base §5.17.2.3, Fig. 276) of NSID 1:
/// NGUID (NIDT 2) and UUID (NIDT 3), both the array UUID.
pub fn ns_descriptors(s: &Subsystem, out: &mut [u8]) {
    let out = &mut out[..IDENTIFY_BYTES];
    out.fill(0);
    out[0] = 2;
    out[1] = 16;
    out[4..20].copy_from_slice(&s.uuid);
    out[20] = 3;
    out[21] = 16;
    out[24..40].copy_from_slice(&s.uuid);
}

/// Counters of a controller's I/O queues for the SMART / Health log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoCounters {
    /// Bytes read by Read commands.
    pub bytes_read: u64,
    /// Bytes written by Write commands.
    pub bytes_written: u64,
    /// Read commands completed.
    pub reads: u64,
    /// Write commands completed.
    pub writes: u64,
}

/// SMART / Health Information log (LID 02h, Base §5.16.1.3, Fig. 207) into `out` (512
/// bytes): critical warning 0, available spare 100 %, threshold 10 %, Data Units
/// Read/Written (thousands of 512-byte units, rounded up) and host commands from
/// `c`; temperature 0 (not reported: a RAID array has no sensor of its own).
pub fn smart_log(c: &IoCounters, out: &mut [u8]) {
    let out = &mut out[..512];
    out.fill(0);
    out[3] = 100;
    out[4] = 10;
    let units = |bytes: u64| (bytes / 512).div_ceil(1000);
    put64(out, 32, units(c.bytes_read));
    put64(out, 48, units(c.bytes_written));
    put64(out, 64, c.reads);
    put64(out, 80, c.writes);
}

/// A portal of the discovery log: where the subsystem is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Portal {
    /// Transport address (IP address text, never a wildcard).
    pub traddr: String,
    /// Transport service ID (the TCP port, decimal).
    pub trsvcid: u16,
    /// IPv6 (ADRFAM 2) rather than IPv4 (1).
    pub ipv6: bool,
    /// Port ID (1-based index of the listen address).
    pub portid: u16,
}

/// Bytes of the discovery log page header and of each entry (Base Fig. 262/263).
pub const DISC_ENTRY_BYTES: usize = 1024;

/// Writes bytes `[offset, offset + out.len())` of the discovery log page (LID 70h, Base
/// §5.16.1.23) with generation counter `genctr` listing `subnqn` at each of `portals` into
/// `out` (bytes past the end of the log read as zero). Header: GENCTR (0..8), NUMREC
/// (8..16), RECFMT 0 (16..18); entries: TRTYPE 3 (TCP), ADRFAM, SUBTYPE 2 (NVM subsystem),
/// TREQ 0 (not specified), PORTID, CNTLID FFFFh (dynamic), ASQSZ 32, TRSVCID (32..64),
/// SUBNQN (256..512), TRADDR (512..768), TSAS (768..: SECTYPE 0, none).
pub fn discovery_log(genctr: u64, subnqn: &str, portals: &[Portal], offset: u64, out: &mut [u8]) {
    out.fill(0);
    let mut rec = [0u8; DISC_ENTRY_BYTES];
    // Build record by record, copying the part that overlaps the window.
    for i in 0..=portals.len() {
        let start = (i * DISC_ENTRY_BYTES) as u64;
        let end = start + DISC_ENTRY_BYTES as u64;
        let win_end = offset + out.len() as u64;
        if end <= offset || start >= win_end {
            continue;
        }
        rec.fill(0);
        if i == 0 {
            put64(&mut rec, 0, genctr);
            put64(&mut rec, 8, portals.len() as u64);
        } else {
            let p = &portals[i - 1];
            rec[0] = 3;
            rec[1] = if p.ipv6 { 2 } else { 1 };
            rec[2] = 2;
            put16(&mut rec, 4, p.portid);
            put16(&mut rec, 6, 0xFFFF);
            put16(&mut rec, 8, 32);
            put_str(&mut rec, 32, 32, &p.trsvcid.to_string());
            put_str(&mut rec, 256, 256, subnqn);
            put_str(&mut rec, 512, 256, &p.traddr);
        }
        let from = start.max(offset);
        let to = end.min(win_end);
        let src = &rec[(from - start) as usize..(to - start) as usize];
        let dst = (from - offset) as usize;
        out[dst..dst + src.len()].copy_from_slice(src);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nqn_from_name_or_uuid() {
        let u = [0x11; 16];
        assert_eq!(subsystem_nqn("md0", &u), "nqn.2026-11.org.ferroraid:md0");
        assert_eq!(
            subsystem_nqn("has space", &u),
            "nqn.2014-08.org.nvmexpress:uuid:11111111-1111-1111-1111-111111111111"
        );
        assert!(subsystem_nqn(&"x".repeat(300), &u).contains(":uuid:"));
    }

    #[test]
    fn cc_checks_entry_sizes() {
        let good = (6 << 16) | (4 << 20) | 1;
        assert!(cc_valid(good));
        assert!(!cc_valid((7 << 16) | (4 << 20) | 1));
        assert!(!cc_valid(good | (1 << 7)));
    }

    #[test]
    fn discovery_log_windows_match_the_whole() {
        let portals = vec![
            Portal {
                traddr: "127.0.0.1".into(),
                trsvcid: 4420,
                ipv6: false,
                portid: 1,
            },
            Portal {
                traddr: "::1".into(),
                trsvcid: 8009,
                ipv6: true,
                portid: 2,
            },
        ];
        let mut whole = vec![0u8; 3 * 1024 + 100];
        discovery_log(7, "nqn.x", &portals, 0, &mut whole);
        assert_eq!(u64::from_le_bytes(whole[0..8].try_into().unwrap()), 7);
        assert_eq!(u64::from_le_bytes(whole[8..16].try_into().unwrap()), 2);
        assert_eq!(&whole[1024 + 32..1024 + 36], b"4420");
        assert_eq!(whole[2048 + 1], 2);
        assert!(whole[3072..].iter().all(|&b| b == 0));
        for (off, len) in [(0u64, 1024usize), (1000, 100), (2048, 4096), (4, 8)] {
            let mut w = vec![0u8; len];
            discovery_log(7, "nqn.x", &portals, off, &mut w);
            let end = (off as usize + len).min(whole.len());
            assert_eq!(&w[..end - off as usize], &whole[off as usize..end]);
        }
    }
}
