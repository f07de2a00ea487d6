//! md raid5/raid6 member layout: where every logical byte, P and Q live.
//!
//! The rules are Linux md's (`drivers/md/raid5.c`, `raid5_compute_sector` and
//! `raid6_idx_to_slot`), for the six layouts that both levels share, with md's numeric
//! layout ids:
//!
//! | id | name              | RAID5 P member          | RAID6 P member / Q member     |
//! |----|-------------------|-------------------------|-------------------------------|
//! | 0  | left-asymmetric   | `n-1 - s%n`             | `n-1 - s%n` / P+1 (0 after last) |
//! | 1  | right-asymmetric  | `s%n`                   | `s%n` / P+1 (0 after last)     |
//! | 2  | left-symmetric    | `n-1 - s%n`             | `n-1 - s%n` / `(P+1)%n`        |
//! | 3  | right-symmetric   | `s%n`                   | `s%n` / `(P+1)%n`              |
//! | 4  | parity-first      | 0                       | 0 / 1                          |
//! | 5  | parity-last       | `n-1`                   | `n-2` / `n-1`                  |
//!
//! (`n` members, stripe `s`.) Data chunks of a stripe follow P (and Q) cyclically in the
//! symmetric layouts and fill the remaining members in ascending order in the others.
//!
//! **Q syndrome slots.** md computes `Q = Σ g^slot · D` where `slot` numbers the data
//! members in *member order* starting just after Q (from member 0 when Q is the last
//! member). In every layout above Q directly follows P (cyclically), so a data member `m`
//! has slot `(m - P - 2) mod n`. For the symmetric, parity-first and parity-last layouts
//! this equals the logical data index; for the two asymmetric layouts it does **not**
//! (e.g. RAID6 left-asymmetric, 5 members, stripe 2: members `D0 D1 P Q D2`, slots
//! `1 2 - - 0`). [`StripeLayout::q_slot`] gives the slot of each data index.
//!
//! Units: byte offsets and lengths are in bytes unless a name says `_blocks` (logical
//! blocks of [`Geometry::block_bytes`]) or `_sectors` (512-byte sectors, md's unit).
//! Member offsets are relative to the start of the member's *data area* (md's
//! `data_offset`); the caller adds the data offset.

use std::fmt;
use std::str::FromStr;

use strength_reduce::StrengthReducedU64;
use thiserror::Error;

/// Smallest chunk size, in bytes (4 KiB: one page, md's minimum for raid456).
pub const MIN_CHUNK_BYTES: u32 = 4 << 10;
/// Largest chunk size, in bytes (16 MiB).
pub const MAX_CHUNK_BYTES: u32 = 16 << 20;
/// Smallest RAID5 member count (two data chunks and P).
pub const MIN_RAID5_MEMBERS: u16 = 3;
/// Smallest RAID6 member count (two data chunks, P and Q).
pub const MIN_RAID6_MEMBERS: u16 = 4;
/// Largest number of data chunks in a stripe, for both levels: 255.
///
/// Q weights data chunk `slot` by `g^slot` with `g = {02}`, whose multiplicative order in
/// GF(2^8) is 255, so only slots 0..=254 get distinct coefficients. Two-erasure recovery
/// divides by `g^x ⊕ g^y`, which is zero when `x ≡ y (mod 255)`: a 256th data chunk would
/// share a coefficient with slot 0 and make that pair unrecoverable (H. P. Anvin, "The
/// mathematics of RAID-6", §2). RAID5 has no such arithmetic limit; it shares the bound so
/// the parity layer and every per-stripe table have one fixed size.
pub const MAX_DATA_CHUNKS: u16 = 255;
/// Largest RAID5 member count: 256 = [`MAX_DATA_CHUNKS`] + P.
pub const MAX_RAID5_MEMBERS: u16 = MAX_DATA_CHUNKS + 1;
/// Largest RAID6 member count: 257 = [`MAX_DATA_CHUNKS`] + P + Q.
///
/// Note that Linux's `async_pq` refuses more than 255 RAID6 devices in all (it BUG()s at
/// 256); an array meant to move to kernel md should stay at or below that.
pub const MAX_RAID6_MEMBERS: u16 = MAX_DATA_CHUNKS + 2;

/// RAID level: 5 (P) or 6 (P+Q).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Level {
    /// Single distributed parity P (XOR).
    Raid5,
    /// P plus the Reed–Solomon syndrome Q over GF(2^8).
    Raid6,
}

impl Level {
    /// md's numeric level (5 or 6), as in the superblock's `level` field.
    pub fn md_level(self) -> u32 {
        match self {
            Level::Raid5 => 5,
            Level::Raid6 => 6,
        }
    }

    /// Parses md's numeric level.
    ///
    /// # Errors
    /// [`GeometryError::UnsupportedLevel`] for anything but 5 and 6.
    pub fn from_md(level: u32) -> Result<Self, GeometryError> {
        match level {
            5 => Ok(Level::Raid5),
            6 => Ok(Level::Raid6),
            other => Err(GeometryError::UnsupportedLevel(other.to_string())),
        }
    }

    /// Parity chunks per stripe: 1 for RAID5, 2 for RAID6 (also the redundancy: how many
    /// members may be lost).
    pub fn parity_chunks(self) -> u16 {
        match self {
            Level::Raid5 => 1,
            Level::Raid6 => 2,
        }
    }

    /// Fewest members an array of this level may have.
    pub fn min_members(self) -> u16 {
        match self {
            Level::Raid5 => MIN_RAID5_MEMBERS,
            Level::Raid6 => MIN_RAID6_MEMBERS,
        }
    }

    /// Most members an array of this level may have ([`MAX_DATA_CHUNKS`] + parity).
    pub fn max_members(self) -> u16 {
        MAX_DATA_CHUNKS + self.parity_chunks()
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "raid{}", self.md_level())
    }
}

impl FromStr for Level {
    type Err = GeometryError;
    /// Accepts `5`, `6`, `raid5`, `raid6` (case-insensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        match t.strip_prefix("raid").unwrap_or(&t) {
            "5" => Ok(Level::Raid5),
            "6" => Ok(Level::Raid6),
            _ => Err(GeometryError::UnsupportedLevel(s.to_string())),
        }
    }
}

/// Parity rotation, with md's numeric ids (`ALGORITHM_*` in `drivers/md/raid5.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Layout {
    /// md 0, `ALGORITHM_LEFT_ASYMMETRIC`.
    LeftAsymmetric = 0,
    /// md 1, `ALGORITHM_RIGHT_ASYMMETRIC`.
    RightAsymmetric = 1,
    /// md 2, `ALGORITHM_LEFT_SYMMETRIC`: md's default.
    LeftSymmetric = 2,
    /// md 3, `ALGORITHM_RIGHT_SYMMETRIC`.
    RightSymmetric = 3,
    /// md 4, `ALGORITHM_PARITY_0`: P on member 0 (Q on member 1).
    ParityFirst = 4,
    /// md 5, `ALGORITHM_PARITY_N`: P (then Q) on the last member(s).
    ParityLast = 5,
}

impl Layout {
    /// All six layouts, in md id order.
    pub const ALL: [Layout; 6] = [
        Layout::LeftAsymmetric,
        Layout::RightAsymmetric,
        Layout::LeftSymmetric,
        Layout::RightSymmetric,
        Layout::ParityFirst,
        Layout::ParityLast,
    ];

    /// md's numeric layout id (0..=5), as in the superblock's `layout` field.
    pub fn md_id(self) -> u32 {
        self as u32
    }

    /// The layout with md id `id`.
    ///
    /// # Errors
    /// [`GeometryError::UnsupportedLayout`] for ids other than 0..=5 (md's DDF layouts 8..10
    /// and the RAID6 migration layouts 16..20 are not supported).
    pub fn from_md(id: u32) -> Result<Self, GeometryError> {
        Self::ALL
            .get(id as usize)
            .copied()
            .ok_or_else(|| GeometryError::UnsupportedLayout(id.to_string()))
    }

    /// md's name for the layout (`left-symmetric`, ...), as mdadm prints it.
    pub fn name(self) -> &'static str {
        match self {
            Layout::LeftAsymmetric => "left-asymmetric",
            Layout::RightAsymmetric => "right-asymmetric",
            Layout::LeftSymmetric => "left-symmetric",
            Layout::RightSymmetric => "right-symmetric",
            Layout::ParityFirst => "parity-first",
            Layout::ParityLast => "parity-last",
        }
    }
}

impl Default for Layout {
    /// left-symmetric, md's default.
    fn default() -> Self {
        Layout::LeftSymmetric
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Layout {
    type Err = GeometryError;
    /// Accepts md's names (`left-symmetric`, also mdadm's short forms `ls`, `la`, `rs`,
    /// `ra`) or the numeric id `0`..`5`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        let by_name = match t.as_str() {
            "left-asymmetric" | "la" => Some(Layout::LeftAsymmetric),
            "right-asymmetric" | "ra" => Some(Layout::RightAsymmetric),
            "left-symmetric" | "ls" => Some(Layout::LeftSymmetric),
            "right-symmetric" | "rs" => Some(Layout::RightSymmetric),
            "parity-first" => Some(Layout::ParityFirst),
            "parity-last" => Some(Layout::ParityLast),
            _ => None,
        };
        if let Some(l) = by_name {
            return Ok(l);
        }
        match t.parse::<u32>() {
            Ok(id) => Layout::from_md(id),
            Err(_) => Err(GeometryError::UnsupportedLayout(s.to_string())),
        }
    }
}

/// Why a geometry or a range was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GeometryError {
    /// Level other than 5 or 6.
    #[error("unsupported RAID level {0:?}: ferroraid supports 5 and 6")]
    UnsupportedLevel(String),
    /// Layout other than md's 0..=5.
    #[error(
        "unsupported layout {0:?}: expected one of left-asymmetric (0), right-asymmetric (1), \
         left-symmetric (2), right-symmetric (3), parity-first (4), parity-last (5)"
    )]
    UnsupportedLayout(String),
    /// Member count outside `min..=max` for the level.
    #[error("{level} needs {min} to {max} members, got {members}{why}")]
    MemberCount {
        /// The level asked for.
        level: Level,
        /// The count asked for.
        members: u16,
        /// Smallest allowed count.
        min: u16,
        /// Largest allowed count.
        max: u16,
        /// Explanation of the upper bound, when it was the one violated.
        why: &'static str,
    },
    /// Chunk size not a power of two within [`MIN_CHUNK_BYTES`]..=[`MAX_CHUNK_BYTES`].
    #[error(
        "chunk size {chunk_bytes} bytes is invalid: it must be a power of two from \
         {min} bytes (4 KiB) to {max} bytes (16 MiB)",
        min = MIN_CHUNK_BYTES,
        max = MAX_CHUNK_BYTES
    )]
    ChunkSize {
        /// The chunk size asked for, in bytes.
        chunk_bytes: u64,
    },
    /// Block size other than 512 or 4096.
    #[error("block size {0} bytes is invalid: it must be 512 or 4096")]
    BlockSize(u32),
    /// A member too small to hold a single chunk after the data offset.
    #[error(
        "member {member} is too small: {member_bytes} bytes leaves less than one \
         {chunk_bytes}-byte chunk after the {data_offset_bytes}-byte data offset"
    )]
    MemberTooSmall {
        /// Index of the member (position in the list given).
        member: usize,
        /// Its size in bytes.
        member_bytes: u64,
        /// The data offset in bytes.
        data_offset_bytes: u64,
        /// The chunk size in bytes.
        chunk_bytes: u32,
    },
    /// A member list whose length differs from the geometry's member count.
    #[error("{got} member sizes given for a {expected}-member array")]
    MemberSizes {
        /// Member count of the geometry.
        expected: u16,
        /// Sizes given.
        got: usize,
    },
    /// An array whose capacity in bytes does not fit in 64 bits.
    #[error(
        "{stripes} stripes of {stripe_data_bytes} data bytes exceed the 2^64-byte capacity limit"
    )]
    CapacityOverflow {
        /// Stripes asked for.
        stripes: u64,
        /// Data bytes per stripe.
        stripe_data_bytes: u64,
    },
    /// A range that does not start and end on a block boundary.
    #[error("range {offset_bytes}+{len_bytes} bytes is not aligned to the {block_bytes}-byte block size")]
    Misaligned {
        /// Start of the range, bytes.
        offset_bytes: u64,
        /// Length of the range, bytes.
        len_bytes: u64,
        /// Block size, bytes.
        block_bytes: u32,
    },
    /// A range that ends beyond the array's capacity.
    #[error("range {offset_bytes}+{len_bytes} bytes ends beyond the array capacity of {capacity_bytes} bytes")]
    OutOfRange {
        /// Start of the range, bytes.
        offset_bytes: u64,
        /// Length of the range, bytes.
        len_bytes: u64,
        /// Array capacity, bytes.
        capacity_bytes: u64,
    },
}

/// The shape of an array's stripes: level, layout, member count, chunk and block size.
///
/// Pure arithmetic: maps stripes and logical offsets to members. Construct with
/// [`Geometry::new`], which validates every parameter; a `Geometry` is always valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    level: Level,
    layout: Layout,
    members: u16,
    chunk_bytes: u32,
    block_bytes: u32,
}

impl Geometry {
    /// Validates and builds a geometry.
    ///
    /// - `members`: RAID5 3..=[`MAX_RAID5_MEMBERS`], RAID6 4..=[`MAX_RAID6_MEMBERS`];
    /// - `chunk_bytes`: a power of two, [`MIN_CHUNK_BYTES`]..=[`MAX_CHUNK_BYTES`];
    /// - `block_bytes`: 512 or 4096.
    ///
    /// # Errors
    /// [`GeometryError::MemberCount`], [`GeometryError::ChunkSize`] or
    /// [`GeometryError::BlockSize`], each naming the limit.
    pub fn new(
        level: Level,
        layout: Layout,
        members: u16,
        chunk_bytes: u64,
        block_bytes: u32,
    ) -> Result<Self, GeometryError> {
        let (min, max) = (level.min_members(), level.max_members());
        if members < min || members > max {
            let why = if members > max {
                " (at most 255 data chunks: Q over GF(2^8) has only 255 distinct coefficients \
                 {02}^0..{02}^254, and RAID5 shares the bound)"
            } else {
                ""
            };
            return Err(GeometryError::MemberCount {
                level,
                members,
                min,
                max,
                why,
            });
        }
        if !chunk_bytes.is_power_of_two()
            || chunk_bytes < u64::from(MIN_CHUNK_BYTES)
            || chunk_bytes > u64::from(MAX_CHUNK_BYTES)
        {
            return Err(GeometryError::ChunkSize { chunk_bytes });
        }
        if block_bytes != 512 && block_bytes != 4096 {
            return Err(GeometryError::BlockSize(block_bytes));
        }
        Ok(Self {
            level,
            layout,
            members,
            chunk_bytes: chunk_bytes as u32,
            block_bytes,
        })
    }

    /// The RAID level.
    pub fn level(&self) -> Level {
        self.level
    }
    /// The parity layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }
    /// Members per stripe (`data_chunks + parity_chunks`).
    pub fn members(&self) -> u16 {
        self.members
    }
    /// Chunk (strip) size in bytes.
    pub fn chunk_bytes(&self) -> u32 {
        self.chunk_bytes
    }
    /// Chunk size in 512-byte sectors (md's `chunk_size` unit in the v1.2 superblock).
    pub fn chunk_sectors(&self) -> u32 {
        self.chunk_bytes / 512
    }
    /// Logical block size in bytes (512 or 4096).
    pub fn block_bytes(&self) -> u32 {
        self.block_bytes
    }
    /// Data chunks per stripe.
    pub fn data_chunks(&self) -> u16 {
        self.members - self.level.parity_chunks()
    }
    /// Parity chunks per stripe (1 or 2).
    pub fn parity_chunks(&self) -> u16 {
        self.level.parity_chunks()
    }
    /// Logical bytes per stripe: `data_chunks * chunk_bytes`.
    pub fn stripe_data_bytes(&self) -> u64 {
        u64::from(self.data_chunks()) * u64::from(self.chunk_bytes)
    }

    /// Where P, Q and each data chunk of stripe `stripe` live.
    #[inline]
    pub fn stripe(&self, stripe: u64) -> StripeLayout {
        self.stripe_rotated(stripe, (stripe % u64::from(self.members)) as u16)
    }

    /// [`Geometry::stripe`] given `r = stripe % members` (the layout's rotation).
    fn stripe_rotated(&self, stripe: u64, r: u16) -> StripeLayout {
        let n = self.members;
        let nd = self.data_chunks();
        debug_assert!(r < n);
        let p = match self.layout {
            Layout::LeftAsymmetric | Layout::LeftSymmetric => n - 1 - r,
            Layout::RightAsymmetric | Layout::RightSymmetric => r,
            Layout::ParityFirst => 0,
            Layout::ParityLast => nd,
        };
        let q = match self.level {
            Level::Raid5 => None,
            // In every supported RAID6 layout Q follows P cyclically.
            Level::Raid6 => Some(if p == n - 1 { 0 } else { p + 1 }),
        };
        StripeLayout {
            stripe,
            members: n,
            data_chunks: nd,
            layout: self.layout,
            p,
            q,
        }
    }

    /// Builds the array-level view: the geometry plus the per-member data area.
    ///
    /// `member_bytes[i]` is the size of member `i` in bytes; `data_offset_bytes` is where
    /// each member's data area starts (md's `data_offset`, same for all members). As md
    /// does, every member contributes the smallest member's data area, rounded down to a
    /// whole number of chunks.
    ///
    /// # Errors
    /// [`GeometryError::MemberSizes`] when the list length differs from the member count;
    /// [`GeometryError::MemberTooSmall`] when a member cannot hold one chunk;
    /// [`GeometryError::CapacityOverflow`] when the capacity does not fit in 64 bits.
    pub fn with_members(
        self,
        member_bytes: &[u64],
        data_offset_bytes: u64,
    ) -> Result<ArrayGeometry, GeometryError> {
        if member_bytes.len() != usize::from(self.members) {
            return Err(GeometryError::MemberSizes {
                expected: self.members,
                got: member_bytes.len(),
            });
        }
        let chunk = u64::from(self.chunk_bytes);
        let mut smallest = u64::MAX;
        for (member, &size) in member_bytes.iter().enumerate() {
            let needed = data_offset_bytes.checked_add(chunk);
            if needed.is_none_or(|n| size < n) {
                return Err(GeometryError::MemberTooSmall {
                    member,
                    member_bytes: size,
                    data_offset_bytes,
                    chunk_bytes: self.chunk_bytes,
                });
            }
            smallest = smallest.min(size - data_offset_bytes);
        }
        ArrayGeometry::new(self, smallest / chunk)
    }
}

/// What a member holds in one stripe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The P (XOR) chunk.
    P,
    /// The Q (syndrome) chunk.
    Q,
    /// A data chunk: its logical index in the stripe and its Q syndrome slot.
    Data {
        /// Logical data index within the stripe, `0..data_chunks`.
        index: u16,
        /// Q coefficient exponent: the chunk enters Q as `g^slot · D`.
        slot: u16,
    },
}

/// The roles of the members in one stripe. Cheap to build (`Geometry::stripe`), no
/// allocation; every query is O(1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StripeLayout {
    stripe: u64,
    members: u16,
    data_chunks: u16,
    layout: Layout,
    p: u16,
    q: Option<u16>,
}

/// `x mod n` for `x < 2n` (member arithmetic: a member index plus an offset below `n`).
fn wrap(x: u16, n: u16) -> u16 {
    debug_assert!(x < 2 * n);
    if x >= n {
        x - n
    } else {
        x
    }
}

/// `x % n` for `x < 3n`: two conditional subtractions.
fn wrap3(x: u16, n: u16) -> u16 {
    debug_assert!(u32::from(x) < 3 * u32::from(n));
    wrap(if x >= n { x - n } else { x }, n)
}

impl StripeLayout {
    /// The stripe number.
    pub fn stripe(&self) -> u64 {
        self.stripe
    }
    /// Member holding P.
    pub fn p_member(&self) -> u16 {
        self.p
    }
    /// Member holding Q (RAID6 only).
    pub fn q_member(&self) -> Option<u16> {
        self.q
    }
    /// Data chunks in the stripe.
    pub fn data_chunks(&self) -> u16 {
        self.data_chunks
    }

    /// Member holding logical data index `index` (`0..data_chunks`).
    ///
    /// # Panics
    /// If `index >= data_chunks` (a programmer error).
    #[inline]
    pub fn data_member(&self, index: u16) -> u16 {
        assert!(index < self.data_chunks, "data index {index} out of range");
        let n = self.members;
        let k = index;
        let p = self.p;
        match (self.q, self.layout) {
            // Symmetric: data follows parity cyclically.
            // p < n and k < n - 1, so one conditional subtraction is the remainder (no
            // division on the per-request path).
            (None, Layout::LeftSymmetric | Layout::RightSymmetric) => wrap(p + 1 + k, n),
            (Some(_), Layout::LeftSymmetric | Layout::RightSymmetric) => wrap(p + 2 + k, n),
            // Ascending member order, skipping the parity member(s).
            (None, _) => {
                if k >= p {
                    k + 1
                } else {
                    k
                }
            }
            (Some(q), _) => {
                if q == 0 {
                    // Q wrapped to member 0, P is last: Q D D .. D P.
                    k + 1
                } else if k >= p {
                    k + 2
                } else {
                    k
                }
            }
        }
    }

    /// What member `member` holds in this stripe.
    ///
    /// # Panics
    /// If `member >= members`.
    pub fn role(&self, member: u16) -> Role {
        assert!(member < self.members, "member {member} out of range");
        if member == self.p {
            return Role::P;
        }
        if Some(member) == self.q {
            return Role::Q;
        }
        Role::Data {
            index: self.data_index_of(member),
            slot: self.slot_of_member(member),
        }
    }

    /// Logical data index of a member that holds neither P nor Q in this stripe.
    fn data_index_of(&self, member: u16) -> u16 {
        let n = self.members;
        let p = self.p;
        match (self.q, self.layout) {
            // member, p < n: the sums stay below 2n (RAID5) and 3n (RAID6), so conditional
            // subtractions are the remainders (no division on the degraded-read path).
            (None, Layout::LeftSymmetric | Layout::RightSymmetric) => wrap(member + n - p - 1, n),
            (Some(_), Layout::LeftSymmetric | Layout::RightSymmetric) => {
                wrap3(member + 2 * n - p - 2, n)
            }
            (None, _) => {
                if member > p {
                    member - 1
                } else {
                    member
                }
            }
            (Some(q), _) => {
                if q == 0 {
                    member - 1
                } else if member > p {
                    member - 2
                } else {
                    member
                }
            }
        }
    }

    /// Q syndrome slot of logical data index `index`: the chunk enters Q as `g^slot · D`.
    /// For RAID5 (no Q) this is the data index.
    ///
    /// # Panics
    /// If `index >= data_chunks` (a programmer error).
    #[inline]
    pub fn q_slot(&self, index: u16) -> u16 {
        if self.q.is_none() {
            assert!(index < self.data_chunks, "data index {index} out of range");
            return index;
        }
        self.slot_of_member(self.data_member(index))
    }

    fn slot_of_member(&self, member: u16) -> u16 {
        match self.q {
            // md walks members from just after Q, skipping P and Q; Q follows P, so the
            // walk starts at P+2 and P, Q are its last two steps.
            Some(_) => wrap3(member + 2 * self.members - self.p - 2, self.members),
            // RAID5 has no Q; report the data index.
            None => self.data_index_of(member),
        }
    }
}

/// A geometry bound to its members: knows the array's capacity and maps ranges.
#[derive(Clone, Copy, Debug)]
pub struct ArrayGeometry {
    geometry: Geometry,
    stripes: u64,
    /// `stripe_data_bytes` as a precomputed reciprocal: the per-request stripe lookup
    /// ([`ArrayGeometry::stripe_of`]) multiplies and shifts instead of dividing (a 64-bit
    /// division is tens of cycles; stripe sizes like 3 × 64 KiB are not powers of two).
    stripe_div: StrengthReducedU64,
    /// The member count, likewise, for the layout's rotation ([`ArrayGeometry::stripe`]).
    members_div: StrengthReducedU64,
}

impl PartialEq for ArrayGeometry {
    fn eq(&self, other: &Self) -> bool {
        // `stripe_div` and `members_div` are derived from `geometry`.
        self.geometry == other.geometry && self.stripes == other.stripes
    }
}

impl Eq for ArrayGeometry {}

impl ArrayGeometry {
    /// An array of `stripes` stripes. Prefer [`Geometry::with_members`], which derives the
    /// stripe count from member sizes.
    ///
    /// # Errors
    /// [`GeometryError::CapacityOverflow`] when the capacity in bytes
    /// (`stripes × data_chunks × chunk_bytes`) does not fit in 64 bits; every size this
    /// type reports is then computed without overflow.
    pub fn new(geometry: Geometry, stripes: u64) -> Result<Self, GeometryError> {
        if stripes.checked_mul(geometry.stripe_data_bytes()).is_none() {
            return Err(GeometryError::CapacityOverflow {
                stripes,
                stripe_data_bytes: geometry.stripe_data_bytes(),
            });
        }
        Ok(Self {
            geometry,
            stripes,
            stripe_div: StrengthReducedU64::new(geometry.stripe_data_bytes()),
            members_div: StrengthReducedU64::new(u64::from(geometry.members)),
        })
    }

    /// Where stripe `stripe`'s chunks live: [`Geometry::stripe`] without a division.
    #[inline]
    pub fn stripe(&self, stripe: u64) -> StripeLayout {
        self.geometry
            .stripe_rotated(stripe, (stripe % self.members_div) as u16)
    }

    /// The stripe holding array byte `offset_bytes` and the byte's offset within that
    /// stripe's data: `(offset_bytes / stripe_data_bytes, offset_bytes % stripe_data_bytes)`,
    /// without a division.
    pub fn stripe_of(&self, offset_bytes: u64) -> (u64, u64) {
        StrengthReducedU64::div_rem(offset_bytes, self.stripe_div)
    }

    /// The stripe holding all of array bytes `[offset_bytes, offset_bytes + len_bytes)`,
    /// if one does (the range ends at or before that stripe's data ends); `None` for a
    /// range that runs into the next stripe.
    #[inline]
    pub fn single_stripe(&self, offset_bytes: u64, len_bytes: u32) -> Option<u64> {
        let (stripe, within) = self.stripe_of(offset_bytes);
        (within + u64::from(len_bytes) <= self.geometry.stripe_data_bytes()).then_some(stripe)
    }

    /// The stripe shape.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }
    /// Stripes in the array.
    pub fn stripes(&self) -> u64 {
        self.stripes
    }
    /// Bytes of each member's data area in use (`stripes * chunk_bytes`).
    pub fn member_data_bytes(&self) -> u64 {
        self.stripes * u64::from(self.geometry.chunk_bytes)
    }
    /// Array capacity in bytes: `stripes * data_chunks * chunk_bytes`.
    pub fn capacity_bytes(&self) -> u64 {
        self.stripes * self.geometry.stripe_data_bytes()
    }
    /// Array capacity in logical blocks.
    pub fn capacity_blocks(&self) -> u64 {
        self.capacity_bytes() / u64::from(self.geometry.block_bytes)
    }

    /// Splits the logical range `offset_bytes .. offset_bytes + len_bytes` into per-member
    /// extents, in logical order; each extent lies within one chunk.
    ///
    /// # Errors
    /// [`GeometryError::Misaligned`] if either end is not on a block boundary;
    /// [`GeometryError::OutOfRange`] if the range ends beyond the capacity.
    pub fn map_range(
        &self,
        offset_bytes: u64,
        len_bytes: u64,
    ) -> Result<MemberExtents, GeometryError> {
        // The block size is a power of two (512 or 4096, checked at construction): a mask
        // tests alignment without a division on this per-request path.
        let mask = u64::from(self.geometry.block_bytes) - 1;
        if (offset_bytes | len_bytes) & mask != 0 {
            return Err(GeometryError::Misaligned {
                offset_bytes,
                len_bytes,
                block_bytes: self.geometry.block_bytes,
            });
        }
        let capacity_bytes = self.capacity_bytes();
        match offset_bytes.checked_add(len_bytes) {
            Some(end) if end <= capacity_bytes => {}
            _ => {
                return Err(GeometryError::OutOfRange {
                    offset_bytes,
                    len_bytes,
                    capacity_bytes,
                })
            }
        }
        Ok(MemberExtents {
            geometry: self.geometry,
            offset: offset_bytes,
            end: offset_bytes + len_bytes,
        })
    }

    /// Splits a range given in logical blocks; see [`ArrayGeometry::map_range`].
    ///
    /// # Errors
    /// [`GeometryError::OutOfRange`] if the range ends beyond the capacity (or overflows).
    pub fn map_blocks(&self, lba: u64, blocks: u64) -> Result<MemberExtents, GeometryError> {
        let block = u64::from(self.geometry.block_bytes);
        let capacity_bytes = self.capacity_bytes();
        let out_of_range = || GeometryError::OutOfRange {
            offset_bytes: lba.saturating_mul(block),
            len_bytes: blocks.saturating_mul(block),
            capacity_bytes,
        };
        let off = lba.checked_mul(block).ok_or_else(out_of_range)?;
        let len = blocks.checked_mul(block).ok_or_else(out_of_range)?;
        self.map_range(off, len)
    }
}

/// One piece of a logical range, inside a single chunk of a single member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemberExtent {
    /// Logical byte offset of the piece in the array.
    pub logical_offset: u64,
    /// Stripe the piece belongs to.
    pub stripe: u64,
    /// Logical data index of its chunk within the stripe.
    pub data_index: u16,
    /// Member holding it.
    pub member: u16,
    /// Byte offset within the member's data area (add md's `data_offset` for the device).
    pub member_offset: u64,
    /// Byte offset within the chunk.
    pub chunk_offset: u32,
    /// Length in bytes (at most one chunk).
    pub len: u32,
}

/// Iterator over the [`MemberExtent`]s of a logical range (from [`ArrayGeometry::map_range`]).
#[derive(Clone, Debug)]
pub struct MemberExtents {
    geometry: Geometry,
    offset: u64,
    end: u64,
}

impl Iterator for MemberExtents {
    type Item = MemberExtent;

    fn next(&mut self) -> Option<MemberExtent> {
        if self.offset >= self.end {
            return None;
        }
        let g = &self.geometry;
        let chunk = u64::from(g.chunk_bytes);
        let c = self.offset / chunk;
        let chunk_offset = self.offset % chunk;
        let nd = u64::from(g.data_chunks());
        let stripe = c / nd;
        let data_index = (c % nd) as u16;
        let len = (chunk - chunk_offset).min(self.end - self.offset);
        let member = g.stripe(stripe).data_member(data_index);
        let ext = MemberExtent {
            logical_offset: self.offset,
            stripe,
            data_index,
            member,
            member_offset: stripe * chunk + chunk_offset,
            chunk_offset: chunk_offset as u32,
            len: len as u32,
        };
        self.offset += len;
        Some(ext)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(level: Level, layout: Layout, n: u16) -> Geometry {
        Geometry::new(level, layout, n, 65536, 512).unwrap()
    }

    /// md's RAID6 left-asymmetric, 5 members, rotation shown in the module docs.
    #[test]
    fn raid6_left_asymmetric_slots_differ_from_data_order() {
        let g = geo(Level::Raid6, Layout::LeftAsymmetric, 5);
        let s = g.stripe(2);
        assert_eq!(s.p_member(), 2);
        assert_eq!(s.q_member(), Some(3));
        let members: Vec<u16> = (0..3).map(|k| s.data_member(k)).collect();
        assert_eq!(members, [0, 1, 4]);
        let slots: Vec<u16> = (0..3).map(|k| s.q_slot(k)).collect();
        assert_eq!(slots, [1, 2, 0]);
        // P on the last member: Q wraps to member 0 and data starts at member 1.
        let s = g.stripe(0);
        assert_eq!((s.p_member(), s.q_member()), (4, Some(0)));
        assert_eq!(
            (0..3).map(|k| s.data_member(k)).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        assert_eq!((0..3).map(|k| s.q_slot(k)).collect::<Vec<_>>(), [0, 1, 2]);
    }

    /// Every member has exactly one role, data indices are a permutation, slots are a
    /// permutation, and role() inverts data_member().
    #[test]
    fn roles_are_a_partition() {
        for level in [Level::Raid5, Level::Raid6] {
            for layout in Layout::ALL {
                for n in level.min_members()..=12 {
                    let g = geo(level, layout, n);
                    for stripe in 0..(3 * u64::from(n)) {
                        let s = g.stripe(stripe);
                        let mut seen = vec![false; n as usize];
                        let mut slots = vec![false; g.data_chunks() as usize];
                        for k in 0..g.data_chunks() {
                            let m = s.data_member(k);
                            assert!(!seen[m as usize]);
                            seen[m as usize] = true;
                            let slot = s.q_slot(k);
                            assert!(!slots[slot as usize]);
                            slots[slot as usize] = true;
                            assert_eq!(s.role(m), Role::Data { index: k, slot });
                        }
                        assert_eq!(s.role(s.p_member()), Role::P);
                        assert!(!seen[s.p_member() as usize]);
                        if let Some(q) = s.q_member() {
                            assert_eq!(s.role(q), Role::Q);
                            assert_ne!(q, s.p_member());
                            assert!(!seen[q as usize]);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn limits_are_named_in_errors() {
        let e = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 258, 65536, 512).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("4 to 257") && msg.contains("255"), "{msg}");
        let e = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 2, 65536, 512).unwrap_err();
        assert!(e.to_string().contains("3 to 256"), "{e}");
        let e = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 257, 65536, 512).unwrap_err();
        assert!(
            e.to_string().contains("3 to 256") && e.to_string().contains("255 data"),
            "{e}"
        );
        assert!(Geometry::new(Level::Raid5, Layout::LeftSymmetric, 256, 65536, 512).is_ok());
        let e = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 3, 65536, 512).unwrap_err();
        assert!(e.to_string().contains("4 to 257"), "{e}");
        assert!(Geometry::new(Level::Raid6, Layout::LeftSymmetric, 257, 65536, 512).is_ok());
        for bad in [0u64, 2048, 4095, 3 << 12, 32 << 20] {
            let e = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, bad, 512).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("4096 bytes") && msg.contains("16777216 bytes"),
                "{msg}"
            );
        }
        let e = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, 65536, 1024).unwrap_err();
        assert!(e.to_string().contains("512 or 4096"));
        let e = "left-sideways".parse::<Layout>().unwrap_err();
        assert!(e.to_string().contains("left-symmetric (2)"), "{e}");
        assert!(Layout::from_md(6).is_err());
        assert!(Layout::from_md(16).is_err());
        assert!("raid4".parse::<Level>().is_err());
        assert_eq!("ls".parse::<Layout>().unwrap(), Layout::LeftSymmetric);
        assert_eq!("5".parse::<Layout>().unwrap(), Layout::ParityLast);
        assert_eq!("RAID6".parse::<Level>().unwrap(), Level::Raid6);
    }

    #[test]
    fn capacity_follows_md() {
        let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, 512 << 10, 4096).unwrap();
        // Smallest member wins; its data area is rounded down to whole chunks.
        let sizes = [
            10 << 30,
            9 << 30,
            (9 << 30) + 12345,
            10 << 30,
            10 << 30,
            10 << 30,
        ];
        let a = g.with_members(&sizes, 1 << 20).unwrap();
        let per_member = ((9u64 << 30) - (1 << 20)) / (512 << 10) * (512 << 10);
        assert_eq!(a.member_data_bytes(), per_member);
        assert_eq!(a.capacity_bytes(), per_member * 4);
        assert!(matches!(
            g.with_members(&sizes[..5], 0),
            Err(GeometryError::MemberSizes {
                expected: 6,
                got: 5
            })
        ));
        let tiny = [1 << 20; 6];
        assert!(matches!(
            g.with_members(&tiny, 1 << 20),
            Err(GeometryError::MemberTooSmall { .. })
        ));
    }

    #[test]
    fn map_range_splits_on_chunks() {
        let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, 4096, 512).unwrap();
        let a = ArrayGeometry::new(g, 10).unwrap();
        assert_eq!(a.capacity_bytes(), 10 * 3 * 4096);
        let ext: Vec<_> = a.map_range(3584, 4096 + 1024).unwrap().collect();
        assert_eq!(ext.len(), 3);
        assert_eq!(
            (ext[0].data_index, ext[0].chunk_offset, ext[0].len),
            (0, 3584, 512)
        );
        assert_eq!(
            (ext[1].data_index, ext[1].chunk_offset, ext[1].len),
            (1, 0, 4096)
        );
        assert_eq!(
            (ext[2].data_index, ext[2].chunk_offset, ext[2].len),
            (2, 0, 512)
        );
        // left-symmetric stripe 0 on 4 members: P on 3, data 0,1,2.
        assert_eq!(ext.iter().map(|e| e.member).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(matches!(
            a.map_range(100, 512),
            Err(GeometryError::Misaligned { .. })
        ));
        assert!(matches!(
            a.map_range(a.capacity_bytes() - 512, 1024),
            Err(GeometryError::OutOfRange { .. })
        ));
        assert!(matches!(
            a.map_blocks(u64::MAX, 2),
            Err(GeometryError::OutOfRange { .. })
        ));
        assert_eq!(a.map_range(a.capacity_bytes(), 0).unwrap().count(), 0);
    }

    proptest::proptest! {
        /// The division-free lookups (and `single_stripe`, built on them) agree with plain
        /// division for every member count and layout, including stripe sizes that are
        /// not powers of two.
        #[test]
        fn reciprocal_lookups_match_division(
            n in 4u16..=12,
            raid6 in proptest::bool::ANY,
            layout in 0usize..6,
            chunk_shift in 12u32..=20,
            offset in 0u64..(1 << 50),
        ) {
            let level = if raid6 { Level::Raid6 } else { Level::Raid5 };
            let g = Geometry::new(level, Layout::ALL[layout], n, 1 << chunk_shift, 512).unwrap();
            let a = ArrayGeometry::new(g, 1 << 20).unwrap();
            let sb = g.stripe_data_bytes();
            proptest::prop_assert_eq!(a.stripe_of(offset), (offset / sb, offset % sb));
            // A range inside one stripe: its last byte in the first byte's stripe.
            for len in [1u32, 512, 1 << 20] {
                let last = offset + u64::from(len) - 1;
                let want = (last / sb == offset / sb).then_some(offset / sb);
                proptest::prop_assert_eq!(a.single_stripe(offset, len), want);
            }
            let stripe = offset >> 12;
            proptest::prop_assert_eq!(a.stripe(stripe), g.stripe(stripe));
        }
    }
}
