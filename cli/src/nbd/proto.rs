//! The NBD wire format: constants, parsing and encoding, with no I/O and no state.
//!
//! Everything here follows the NBD project's protocol document (`doc/proto.md`); each item
//! names the section it implements. The functions are pure — bytes in, values out — so the
//! handshake, the reactor-side connection code, the tests and a fuzzer share one
//! implementation of every rule. Parsers never panic on any input: a short or malformed
//! message is a [`ProtoError`].
//!
//! All integers on the wire are big-endian ("network byte order", proto.md "Conventions").
//! Offsets and lengths are in **bytes** throughout.

use thiserror::Error;

// ---------------------------------------------------------------------------------------
// Magic numbers (proto.md "Newstyle negotiation", "Fixed newstyle negotiation",
// "Request message", "Simple reply message", "Structured reply chunk message").
// ---------------------------------------------------------------------------------------

/// `NBDMAGIC`, the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: second server magic, and the magic of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply (fixed newstyle).
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// `NBD_REQUEST_MAGIC`: first 4 bytes of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// `NBD_SIMPLE_REPLY_MAGIC`.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// `NBD_STRUCTURED_REPLY_MAGIC`.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---------------------------------------------------------------------------------------
// Handshake flags (proto.md "Handshake flags", "Client flags").
// ---------------------------------------------------------------------------------------

/// Server handshake flag `NBD_FLAG_FIXED_NEWSTYLE`.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Server handshake flag `NBD_FLAG_NO_ZEROES`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag `NBD_FLAG_C_FIXED_NEWSTYLE`.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag `NBD_FLAG_C_NO_ZEROES`.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;
/// The handshake flags this server sends: fixed newstyle, and no zero padding on request.
pub const SERVER_HANDSHAKE_FLAGS: u16 = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;

// ---------------------------------------------------------------------------------------
// Transmission flags (proto.md "Transmission flags").
// ---------------------------------------------------------------------------------------

/// `NBD_FLAG_HAS_FLAGS`: always set.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// `NBD_FLAG_READ_ONLY`.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// `NBD_FLAG_SEND_FLUSH`: `NBD_CMD_FLUSH` is supported.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// `NBD_FLAG_SEND_FUA`: `NBD_CMD_FLAG_FUA` is supported.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// `NBD_FLAG_ROTATIONAL`.
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
/// `NBD_FLAG_SEND_TRIM`: `NBD_CMD_TRIM` is supported.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// `NBD_FLAG_SEND_WRITE_ZEROES`: `NBD_CMD_WRITE_ZEROES` and `NBD_CMD_FLAG_NO_HOLE`.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// `NBD_FLAG_SEND_DF`: `NBD_CMD_FLAG_DF` on reads (only with structured replies).
pub const TFLAG_SEND_DF: u16 = 1 << 7;
/// `NBD_FLAG_CAN_MULTI_CONN`: flush and FUA are visible across all connections.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// `NBD_FLAG_SEND_CACHE`.
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
/// `NBD_FLAG_SEND_FAST_ZERO`: `NBD_CMD_FLAG_FAST_ZERO` on write-zeroes.
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---------------------------------------------------------------------------------------
// Options and option replies (proto.md "Option types", "Option reply types").
// ---------------------------------------------------------------------------------------

/// `NBD_OPT_EXPORT_NAME`.
pub const OPT_EXPORT_NAME: u32 = 1;
/// `NBD_OPT_ABORT`.
pub const OPT_ABORT: u32 = 2;
/// `NBD_OPT_LIST`.
pub const OPT_LIST: u32 = 3;
/// `NBD_OPT_STARTTLS`.
pub const OPT_STARTTLS: u32 = 5;
/// `NBD_OPT_INFO`.
pub const OPT_INFO: u32 = 6;
/// `NBD_OPT_GO`.
pub const OPT_GO: u32 = 7;
/// `NBD_OPT_STRUCTURED_REPLY`.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// `NBD_OPT_LIST_META_CONTEXT`.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// `NBD_OPT_SET_META_CONTEXT`.
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// `NBD_REP_ACK`.
pub const REP_ACK: u32 = 1;
/// `NBD_REP_SERVER`.
pub const REP_SERVER: u32 = 2;
/// `NBD_REP_INFO`.
pub const REP_INFO: u32 = 3;
/// `NBD_REP_META_CONTEXT`: one metadata context, a reply to `NBD_OPT_LIST_META_CONTEXT`
/// or `NBD_OPT_SET_META_CONTEXT` (proto.md "Option reply types").
pub const REP_META_CONTEXT: u32 = 4;
/// `NBD_REP_ERR_UNSUP`: unknown option.
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
/// `NBD_REP_ERR_POLICY`.
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
/// `NBD_REP_ERR_INVALID`: known option, syntactically or semantically invalid.
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
/// `NBD_REP_ERR_PLATFORM`.
pub const REP_ERR_PLATFORM: u32 = (1 << 31) + 4;
/// `NBD_REP_ERR_TLS_REQD`.
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
/// `NBD_REP_ERR_UNKNOWN`: the requested export is not available.
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
/// `NBD_REP_ERR_SHUTDOWN`: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;
/// `NBD_REP_ERR_BLOCK_SIZE_REQD`.
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = (1 << 31) + 8;
/// `NBD_REP_ERR_TOO_BIG`: the request or the reply is too large to process.
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

/// `NBD_INFO_EXPORT` (size and transmission flags).
pub const INFO_EXPORT: u16 = 0;
/// `NBD_INFO_NAME` (canonical export name).
pub const INFO_NAME: u16 = 1;
/// `NBD_INFO_DESCRIPTION`.
pub const INFO_DESCRIPTION: u16 = 2;
/// `NBD_INFO_BLOCK_SIZE` (minimum, preferred, maximum block size).
pub const INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------------------
// Transmission (proto.md "Request types", "Command flags", "Structured reply flags",
// "Structured reply types", "Error values").
// ---------------------------------------------------------------------------------------

/// `NBD_CMD_READ`.
pub const CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE`.
pub const CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC`.
pub const CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH`.
pub const CMD_FLUSH: u16 = 3;
/// `NBD_CMD_TRIM`.
pub const CMD_TRIM: u16 = 4;
/// `NBD_CMD_CACHE`.
pub const CMD_CACHE: u16 = 5;
/// `NBD_CMD_WRITE_ZEROES`.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// `NBD_CMD_BLOCK_STATUS`.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// `NBD_CMD_FLAG_FUA`.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// `NBD_CMD_FLAG_NO_HOLE`.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// `NBD_CMD_FLAG_DF`.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// `NBD_CMD_FLAG_REQ_ONE`.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// `NBD_CMD_FLAG_FAST_ZERO`.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// `NBD_REPLY_FLAG_DONE`: the final chunk of a structured reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// `NBD_REPLY_TYPE_NONE`.
pub const REPLY_TYPE_NONE: u16 = 0;
/// `NBD_REPLY_TYPE_OFFSET_DATA`.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// `NBD_REPLY_TYPE_OFFSET_HOLE`.
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// `NBD_REPLY_TYPE_BLOCK_STATUS`: a context id and block descriptors.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// `NBD_REPLY_TYPE_ERROR`.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
/// `NBD_REPLY_TYPE_ERROR_OFFSET`.
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

/// `NBD_EPERM`.
pub const EPERM: u32 = 1;
/// `NBD_EIO`.
pub const EIO: u32 = 5;
/// `NBD_ENOMEM`.
pub const ENOMEM: u32 = 12;
/// `NBD_EINVAL`.
pub const EINVAL: u32 = 22;
/// `NBD_ENOSPC`.
pub const ENOSPC: u32 = 28;
/// `NBD_EOVERFLOW`.
pub const EOVERFLOW: u32 = 75;
/// `NBD_ENOTSUP`.
pub const ENOTSUP: u32 = 95;
/// `NBD_ESHUTDOWN`.
pub const ESHUTDOWN: u32 = 108;

// ---------------------------------------------------------------------------------------
// Metadata contexts (proto.md "Metadata querying", "Metadata contexts", "`base:`
// metadata context").
// ---------------------------------------------------------------------------------------

/// The one metadata context this server offers: allocation status of the export.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// The context id this server gives `base:allocation` when it is selected
/// (`NBD_OPT_SET_META_CONTEXT`); ids are the server's choice. `NBD_OPT_LIST_META_CONTEXT`
/// replies carry id 0.
pub const BASE_ALLOCATION_ID: u32 = 1;
/// `base:allocation` status flag `NBD_STATE_HOLE`: the extent is not allocated.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` status flag `NBD_STATE_ZERO`: the extent reads as zeroes.
pub const STATE_ZERO: u32 = 1 << 1;
/// Most block descriptors one `NBD_REPLY_TYPE_BLOCK_STATUS` chunk of this server carries
/// (proto.md "`NBD_REPLY_TYPE_BLOCK_STATUS`": the server may describe less than the
/// requested range, as long as it sends at least one descriptor). 256 descriptors are
/// 2 KiB; a client asks again from where the reply ended.
pub const MAX_BLOCK_DESCRIPTORS: usize = 256;
/// Bytes of one block descriptor: 32-bit extent length, 32-bit status flags.
pub const BLOCK_DESCRIPTOR_BYTES: usize = 8;

// ---------------------------------------------------------------------------------------
// Sizes.
// ---------------------------------------------------------------------------------------

/// Bytes of the server greeting: `NBDMAGIC`, `IHAVEOPT`, 16-bit handshake flags.
pub const GREETING_BYTES: usize = 18;
/// Bytes of an option header: `IHAVEOPT`, option, data length.
pub const OPTION_HEADER_BYTES: usize = 16;
/// Bytes of an option reply header: magic, option, reply type, data length.
pub const OPTION_REPLY_HEADER_BYTES: usize = 20;
/// Bytes of a transmission request header (the `NBD_CMD_WRITE` payload follows it).
pub const REQUEST_BYTES: usize = 28;
/// Bytes of a simple reply header (the read data follows it).
pub const SIMPLE_REPLY_BYTES: usize = 16;
/// Bytes of a structured reply chunk header (the payload follows it).
pub const STRUCTURED_HEADER_BYTES: usize = 20;
/// Longest string (export name, description, error message) the protocol allows, bytes
/// (proto.md "Conventions": strings "MUST be no longer than 4096 bytes").
pub const MAX_STRING_BYTES: usize = 4096;
/// Zero padding after the `NBD_OPT_EXPORT_NAME` reply unless `NBD_FLAG_C_NO_ZEROES`.
pub const EXPORT_NAME_ZEROES: usize = 124;
/// Lengths below this never count as a denial of service (proto.md "Block size
/// constraints": "any *length* less than 2^25 (33,554,432) bytes SHOULD NOT be
/// considered a denial of service attack").
pub const DOS_FLOOR_BYTES: u32 = 1 << 25;

/// Why a message could not be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ProtoError {
    /// Fewer bytes than the fixed part of the message.
    #[error("message too short: need {need} bytes, have {have}")]
    Short {
        /// Bytes the message needs.
        need: usize,
        /// Bytes given.
        have: usize,
    },
    /// The magic number is wrong: the stream is not (or no longer) NBD.
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    /// Option data that does not follow the option's documented layout
    /// (reply with `NBD_REP_ERR_INVALID`).
    #[error("malformed option data: {0}")]
    Malformed(&'static str),
    /// A string longer than [`MAX_STRING_BYTES`].
    #[error("string of {0} bytes exceeds the protocol's 4096-byte limit")]
    StringTooLong(usize),
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}
fn need(b: &[u8], n: usize) -> Result<(), ProtoError> {
    if b.len() < n {
        Err(ProtoError::Short {
            need: n,
            have: b.len(),
        })
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Handshake.
// ---------------------------------------------------------------------------------------

/// The server's first message (proto.md "Newstyle negotiation"): `NBDMAGIC`, `IHAVEOPT`,
/// handshake flags.
pub fn greeting(handshake_flags: u16) -> [u8; GREETING_BYTES] {
    let mut b = [0u8; GREETING_BYTES];
    b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&handshake_flags.to_be_bytes());
    b
}

/// Checks the client's 32-bit flags against what the server advertised (proto.md "Client
/// flags": "the server MUST drop the TCP connection if the client sets an unknown flag, or
/// a flag that does not match something advertised by the server").
///
/// # Errors
/// The offending bits, when any is unknown or not advertised.
pub fn check_client_flags(client_flags: u32, server_flags: u16) -> Result<(), u32> {
    let mut allowed = 0u32;
    if server_flags & FLAG_FIXED_NEWSTYLE != 0 {
        allowed |= FLAG_C_FIXED_NEWSTYLE;
    }
    if server_flags & FLAG_NO_ZEROES != 0 {
        allowed |= FLAG_C_NO_ZEROES;
    }
    let bad = client_flags & !allowed;
    if bad == 0 {
        Ok(())
    } else {
        Err(bad)
    }
}

/// The fixed header of a client option (proto.md "Newstyle negotiation").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// Option number (`NBD_OPT_*`).
    pub option: u32,
    /// Bytes of option data that follow.
    pub length: u32,
}

/// Parses the 16-byte option header (`IHAVEOPT`, option, length) at the start of `b`.
///
/// # Errors
/// [`ProtoError::Short`] for fewer than 16 bytes; [`ProtoError::BadMagic`] when the magic
/// is not `IHAVEOPT` (the client is not speaking newstyle: disconnect).
pub fn parse_option_header(b: &[u8]) -> Result<OptionHeader, ProtoError> {
    need(b, OPTION_HEADER_BYTES)?;
    let magic = be64(b, 0);
    if magic != IHAVEOPT {
        return Err(ProtoError::BadMagic(magic));
    }
    Ok(OptionHeader {
        option: be32(b, 8),
        length: be32(b, 12),
    })
}

/// Encodes an option header (for clients and tests).
pub fn encode_option_header(option: u32, length: u32) -> [u8; OPTION_HEADER_BYTES] {
    let mut b = [0u8; OPTION_HEADER_BYTES];
    b[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[8..12].copy_from_slice(&option.to_be_bytes());
    b[12..16].copy_from_slice(&length.to_be_bytes());
    b
}

/// The data of `NBD_OPT_INFO` / `NBD_OPT_GO` (proto.md "`NBD_OPT_INFO` (6) and
/// `NBD_OPT_GO` (7)"): an export name and a list of `NBD_INFO_*` requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    /// Export name (empty = the default export). Not checked for UTF-8: a name that is not
    /// valid UTF-8 simply names no export.
    pub name: &'a [u8],
    /// The raw request list: `2 × n` bytes of big-endian `NBD_INFO_*` numbers.
    requests: &'a [u8],
}

impl InfoRequest<'_> {
    /// The `NBD_INFO_*` types the client asked for, in its order.
    pub fn requests(&self) -> impl Iterator<Item = u16> + '_ {
        self.requests
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
    }
    /// Whether the client asked for information type `info`.
    pub fn asked(&self, info: u16) -> bool {
        self.requests().any(|r| r == info)
    }
}

/// A client option with its data decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientOption<'a> {
    /// `NBD_OPT_EXPORT_NAME` with the export name.
    ExportName(&'a [u8]),
    /// `NBD_OPT_ABORT` (any data is ignored, as proto.md says the server SHOULD).
    Abort,
    /// `NBD_OPT_LIST`.
    List,
    /// `NBD_OPT_STARTTLS`.
    StartTls,
    /// `NBD_OPT_INFO`.
    Info(InfoRequest<'a>),
    /// `NBD_OPT_GO`.
    Go(InfoRequest<'a>),
    /// `NBD_OPT_STRUCTURED_REPLY`.
    StructuredReply,
    /// `NBD_OPT_LIST_META_CONTEXT`.
    ListMetaContext(MetaContextRequest<'a>),
    /// `NBD_OPT_SET_META_CONTEXT`.
    SetMetaContext(MetaContextRequest<'a>),
    /// Any other option number (reply `NBD_REP_ERR_UNSUP`).
    Unknown(u32),
}

/// The data of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT` (proto.md "Option
/// types"): an export name and a list of queries (context names, or for
/// `NBD_OPT_LIST_META_CONTEXT` also a bare namespace such as `base:`). Checked when
/// parsed: every query length fits the data, and the data holds nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaContextRequest<'a> {
    /// Export name (empty = the default export).
    pub name: &'a [u8],
    /// Number of queries.
    count: u32,
    /// The raw queries: `count` × (32-bit length, string).
    queries: &'a [u8],
}

impl<'a> MetaContextRequest<'a> {
    /// The queries, in the client's order (not checked for UTF-8: a query that is not
    /// valid UTF-8 names no context).
    pub fn queries(&self) -> impl Iterator<Item = &'a [u8]> + 'a {
        let mut rest = self.queries;
        (0..self.count).map_while(move |_| {
            let len = be32(rest.get(..4)?, 0) as usize;
            let q = rest.get(4..4 + len)?;
            rest = &rest[4 + len..];
            Some(q)
        })
    }

    /// Whether the request names `base:allocation`: a query of exactly that name, or
    /// when `list` (`NBD_OPT_LIST_META_CONTEXT`) no query at all ("all contexts") or the
    /// bare namespace `base:` ("all contexts of the namespace"). For
    /// `NBD_OPT_SET_META_CONTEXT` only the full name selects it (as qemu-nbd does).
    pub fn names_base_allocation(&self, list: bool) -> bool {
        if list && self.count == 0 {
            return true;
        }
        self.queries()
            .any(|q| q == BASE_ALLOCATION.as_bytes() || (list && q == b"base:"))
    }
}

fn parse_meta_context_request(data: &[u8]) -> Result<MetaContextRequest<'_>, ProtoError> {
    let bad = ProtoError::Malformed;
    if data.len() < 8 {
        return Err(bad(
            "META_CONTEXT data shorter than name length + query count",
        ));
    }
    let name_len = be32(data, 0) as usize;
    if name_len > data.len() - 8 {
        return Err(bad("META_CONTEXT name length exceeds the option data"));
    }
    if name_len > MAX_STRING_BYTES {
        return Err(ProtoError::StringTooLong(name_len));
    }
    let name = &data[4..4 + name_len];
    let count = be32(data, 4 + name_len);
    let queries = &data[8 + name_len..];
    let mut rest = queries;
    for _ in 0..count {
        if rest.len() < 4 {
            return Err(bad("META_CONTEXT query count exceeds the option data"));
        }
        let len = be32(rest, 0) as usize;
        if len > rest.len() - 4 {
            return Err(bad("META_CONTEXT query length exceeds the option data"));
        }
        if len > MAX_STRING_BYTES {
            return Err(ProtoError::StringTooLong(len));
        }
        rest = &rest[4 + len..];
    }
    if !rest.is_empty() {
        return Err(bad("META_CONTEXT data longer than its queries"));
    }
    Ok(MetaContextRequest {
        name,
        count,
        queries,
    })
}

/// Encodes `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT` data (for clients and
/// tests): export name, query count, queries.
pub fn encode_meta_context_request(name: &[u8], queries: &[&[u8]]) -> Vec<u8> {
    let mut v =
        Vec::with_capacity(8 + name.len() + queries.iter().map(|q| 4 + q.len()).sum::<usize>());
    v.extend_from_slice(&(name.len() as u32).to_be_bytes());
    v.extend_from_slice(name);
    v.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        v.extend_from_slice(&(q.len() as u32).to_be_bytes());
        v.extend_from_slice(q);
    }
    v
}

/// `NBD_REP_META_CONTEXT` data (proto.md "Option reply types"): the 32-bit context id
/// (0 in replies to `NBD_OPT_LIST_META_CONTEXT`) and the context's name.
pub fn rep_meta_context_data(id: u32, name: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + name.len());
    v.extend_from_slice(&id.to_be_bytes());
    v.extend_from_slice(name.as_bytes());
    v
}

/// Decodes the data of option `option`.
///
/// Rules (proto.md "Option types"): `NBD_OPT_LIST`, `NBD_OPT_STARTTLS` and
/// `NBD_OPT_STRUCTURED_REPLY` carry no data; `NBD_OPT_INFO`/`NBD_OPT_GO` carry a 32-bit
/// name length (at most data length − 6), the name, a 16-bit count and that many 16-bit
/// information requests, and nothing else; `NBD_OPT_LIST_META_CONTEXT` /
/// `NBD_OPT_SET_META_CONTEXT` carry a 32-bit name length, the name, a 32-bit query count
/// and that many (32-bit length, query) pairs, and nothing else; names and queries are at
/// most 4096 bytes.
///
/// # Errors
/// [`ProtoError::Malformed`] / [`ProtoError::StringTooLong`] (reply
/// `NBD_REP_ERR_INVALID`, or for `NBD_OPT_EXPORT_NAME`, which cannot be answered with an
/// error, disconnect).
pub fn parse_option(option: u32, data: &[u8]) -> Result<ClientOption<'_>, ProtoError> {
    match option {
        OPT_EXPORT_NAME => {
            if data.len() > MAX_STRING_BYTES {
                return Err(ProtoError::StringTooLong(data.len()));
            }
            Ok(ClientOption::ExportName(data))
        }
        OPT_ABORT => Ok(ClientOption::Abort),
        OPT_LIST | OPT_STARTTLS | OPT_STRUCTURED_REPLY => {
            if !data.is_empty() {
                return Err(ProtoError::Malformed("this option carries no data"));
            }
            Ok(match option {
                OPT_LIST => ClientOption::List,
                OPT_STARTTLS => ClientOption::StartTls,
                _ => ClientOption::StructuredReply,
            })
        }
        OPT_INFO | OPT_GO => {
            let r = parse_info_request(data)?;
            Ok(if option == OPT_INFO {
                ClientOption::Info(r)
            } else {
                ClientOption::Go(r)
            })
        }
        OPT_LIST_META_CONTEXT => Ok(ClientOption::ListMetaContext(parse_meta_context_request(
            data,
        )?)),
        OPT_SET_META_CONTEXT => Ok(ClientOption::SetMetaContext(parse_meta_context_request(
            data,
        )?)),
        other => Ok(ClientOption::Unknown(other)),
    }
}

fn parse_info_request(data: &[u8]) -> Result<InfoRequest<'_>, ProtoError> {
    if data.len() < 6 {
        return Err(ProtoError::Malformed(
            "INFO/GO data shorter than name length + request count",
        ));
    }
    let name_len = be32(data, 0) as usize;
    if name_len > data.len() - 6 {
        return Err(ProtoError::Malformed(
            "INFO/GO name length exceeds the option data",
        ));
    }
    if name_len > MAX_STRING_BYTES {
        return Err(ProtoError::StringTooLong(name_len));
    }
    let name = &data[4..4 + name_len];
    let count = usize::from(be16(data, 4 + name_len));
    let requests = &data[6 + name_len..];
    if requests.len() != 2 * count {
        return Err(ProtoError::Malformed(
            "INFO/GO request count does not match the option data",
        ));
    }
    Ok(InfoRequest { name, requests })
}

/// Encodes `NBD_OPT_INFO`/`NBD_OPT_GO` data (for clients and tests).
pub fn encode_info_request(name: &[u8], requests: &[u16]) -> Vec<u8> {
    let mut v = Vec::with_capacity(6 + name.len() + 2 * requests.len());
    v.extend_from_slice(&(name.len() as u32).to_be_bytes());
    v.extend_from_slice(name);
    v.extend_from_slice(&(requests.len() as u16).to_be_bytes());
    for r in requests {
        v.extend_from_slice(&r.to_be_bytes());
    }
    v
}

/// Encodes an option reply header (proto.md "Fixed newstyle negotiation"): magic, the
/// option replied to, reply type, and the length of the data that follows.
pub fn option_reply_header(
    option: u32,
    reply: u32,
    data_len: u32,
) -> [u8; OPTION_REPLY_HEADER_BYTES] {
    let mut b = [0u8; OPTION_REPLY_HEADER_BYTES];
    b[0..8].copy_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    b[8..12].copy_from_slice(&option.to_be_bytes());
    b[12..16].copy_from_slice(&reply.to_be_bytes());
    b[16..20].copy_from_slice(&data_len.to_be_bytes());
    b
}

/// A decoded option reply header (for clients and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    /// The option replied to.
    pub option: u32,
    /// `NBD_REP_*`.
    pub reply: u32,
    /// Bytes of reply data that follow.
    pub length: u32,
}

/// Parses an option reply header (for clients and tests).
///
/// # Errors
/// [`ProtoError::Short`], or [`ProtoError::BadMagic`] when the magic is wrong.
pub fn parse_option_reply_header(b: &[u8]) -> Result<OptionReplyHeader, ProtoError> {
    need(b, OPTION_REPLY_HEADER_BYTES)?;
    let magic = be64(b, 0);
    if magic != OPTION_REPLY_MAGIC {
        return Err(ProtoError::BadMagic(magic));
    }
    Ok(OptionReplyHeader {
        option: be32(b, 8),
        reply: be32(b, 12),
        length: be32(b, 16),
    })
}

/// `NBD_REP_SERVER` data (proto.md "`NBD_REP_SERVER` (2)"): 32-bit name length, name,
/// then a description for humans.
pub fn rep_server_data(name: &[u8], description: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + name.len() + description.len());
    v.extend_from_slice(&(name.len() as u32).to_be_bytes());
    v.extend_from_slice(name);
    v.extend_from_slice(description);
    v
}

/// `NBD_REP_INFO` data for `NBD_INFO_EXPORT` (proto.md "`NBD_INFO_EXPORT` (0)"): export
/// size in bytes and transmission flags; 12 bytes.
pub fn info_export(size_bytes: u64, transmission_flags: u16) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
    b[2..10].copy_from_slice(&size_bytes.to_be_bytes());
    b[10..12].copy_from_slice(&transmission_flags.to_be_bytes());
    b
}

/// `NBD_REP_INFO` data for `NBD_INFO_BLOCK_SIZE` (proto.md "`NBD_INFO_BLOCK_SIZE` (3)"):
/// minimum, preferred and maximum block size in bytes; 14 bytes.
pub fn info_block_size(min_bytes: u32, preferred_bytes: u32, max_bytes: u32) -> [u8; 14] {
    let mut b = [0u8; 14];
    b[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    b[2..6].copy_from_slice(&min_bytes.to_be_bytes());
    b[6..10].copy_from_slice(&preferred_bytes.to_be_bytes());
    b[10..14].copy_from_slice(&max_bytes.to_be_bytes());
    b
}

/// `NBD_REP_INFO` data for `NBD_INFO_NAME` or `NBD_INFO_DESCRIPTION`: the 16-bit type and
/// the string.
pub fn info_string(info: u16, s: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + s.len());
    v.extend_from_slice(&info.to_be_bytes());
    v.extend_from_slice(s);
    v
}

/// The reply to `NBD_OPT_EXPORT_NAME` (proto.md "Newstyle negotiation"): export size in
/// bytes, transmission flags, and 124 zero bytes unless the client set
/// `NBD_FLAG_C_NO_ZEROES`. Returns the buffer and how many of its bytes to send.
pub fn export_name_reply(
    size_bytes: u64,
    transmission_flags: u16,
    no_zeroes: bool,
) -> ([u8; 10 + EXPORT_NAME_ZEROES], usize) {
    let mut b = [0u8; 10 + EXPORT_NAME_ZEROES];
    b[0..8].copy_from_slice(&size_bytes.to_be_bytes());
    b[8..10].copy_from_slice(&transmission_flags.to_be_bytes());
    let n = if no_zeroes {
        10
    } else {
        10 + EXPORT_NAME_ZEROES
    };
    (b, n)
}

// ---------------------------------------------------------------------------------------
// Transmission: requests.
// ---------------------------------------------------------------------------------------

/// A transmission request header (proto.md "Request message"). `length` bytes of data
/// follow it on the wire when `command` is `NBD_CMD_WRITE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags (`NBD_CMD_FLAG_*`).
    pub flags: u16,
    /// Command type (`NBD_CMD_*`), possibly unknown.
    pub command: u16,
    /// The client's handle, echoed in the reply.
    pub handle: u64,
    /// Byte offset in the export.
    pub offset: u64,
    /// Length in bytes.
    pub length: u32,
}

impl Request {
    /// Bytes of payload that follow this header on the wire: `length` for `NBD_CMD_WRITE`,
    /// none otherwise (proto.md "Request message").
    pub fn payload_bytes(&self) -> u32 {
        if self.command == CMD_WRITE {
            self.length
        } else {
            0
        }
    }
}

/// Parses the 28-byte request header at the start of `b` (extra bytes are ignored).
///
/// # Errors
/// [`ProtoError::Short`] for fewer than 28 bytes; [`ProtoError::BadMagic`] when the magic
/// is not `NBD_REQUEST_MAGIC` (the stream is out of sync: hard disconnect, proto.md
/// "Terminating the transmission phase").
pub fn parse_request(b: &[u8]) -> Result<Request, ProtoError> {
    need(b, REQUEST_BYTES)?;
    let magic = be32(b, 0);
    if magic != REQUEST_MAGIC {
        return Err(ProtoError::BadMagic(u64::from(magic)));
    }
    Ok(Request {
        flags: be16(b, 4),
        command: be16(b, 6),
        handle: be64(b, 8),
        offset: be64(b, 16),
        length: be32(b, 24),
    })
}

/// Encodes a request header (for clients and tests).
pub fn encode_request(r: &Request) -> [u8; REQUEST_BYTES] {
    let mut b = [0u8; REQUEST_BYTES];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&r.flags.to_be_bytes());
    b[6..8].copy_from_slice(&r.command.to_be_bytes());
    b[8..16].copy_from_slice(&r.handle.to_be_bytes());
    b[16..24].copy_from_slice(&r.offset.to_be_bytes());
    b[24..28].copy_from_slice(&r.length.to_be_bytes());
    b
}

/// What the export accepts: the facts [`check_request`] judges a request against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportLimits {
    /// Export size in bytes (a multiple of `min_block_bytes`).
    pub size_bytes: u64,
    /// Advertised minimum block size, bytes: offsets and lengths must be multiples of it.
    pub min_block_bytes: u32,
    /// Advertised maximum block size, bytes: the longest `NBD_CMD_READ`/`NBD_CMD_WRITE`.
    pub max_block_bytes: u32,
    /// Whether `NBD_FLAG_SEND_TRIM` is advertised.
    pub trim: bool,
    /// Whether `NBD_FLAG_SEND_WRITE_ZEROES` is advertised.
    pub write_zeroes: bool,
    /// Whether `NBD_FLAG_SEND_FAST_ZERO` is advertised.
    pub fast_zero: bool,
    /// Whether structured replies were negotiated on this connection (enables
    /// `NBD_CMD_FLAG_DF`, advertised with `NBD_FLAG_SEND_DF` only then).
    pub structured: bool,
    /// Whether the client selected the `base:allocation` metadata context on this
    /// connection (`NBD_OPT_SET_META_CONTEXT`, which needs structured replies): enables
    /// `NBD_CMD_BLOCK_STATUS`.
    pub block_status: bool,
}

impl ExportLimits {
    /// The longest `NBD_CMD_READ`/`NBD_CMD_WRITE` served, bytes: the advertised maximum
    /// block size or [`DOS_FLOOR_BYTES`] (2^25), whichever is larger (see
    /// [`check_request`], rule 6).
    pub fn max_request_bytes(&self) -> u32 {
        self.max_block_bytes.max(DOS_FLOOR_BYTES)
    }

    /// The transmission flags for these limits (proto.md "Transmission flags"): flush and
    /// FUA always (the array implements both), multi-conn (a flush goes through the array
    /// to every member, whichever connection sent it), trim/write-zeroes/fast-zero as
    /// configured, `NBD_FLAG_SEND_DF` only with structured replies.
    pub fn transmission_flags(&self) -> u16 {
        let mut f = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_CAN_MULTI_CONN;
        if self.trim {
            f |= TFLAG_SEND_TRIM;
        }
        if self.write_zeroes {
            f |= TFLAG_SEND_WRITE_ZEROES;
            if self.fast_zero {
                f |= TFLAG_SEND_FAST_ZERO;
            }
        }
        if self.structured {
            f |= TFLAG_SEND_DF;
        }
        f
    }
}

/// What to do with a request, decided by [`check_request`] from its header alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Read `length` bytes at `offset`.
    Read,
    /// Write the `length`-byte payload at `offset`; `fua`: durable before the reply.
    Write {
        /// `NBD_CMD_FLAG_FUA`.
        fua: bool,
    },
    /// Flush every member.
    Flush,
    /// Discard the range; `fua`: flush before the reply.
    Trim {
        /// `NBD_CMD_FLAG_FUA`.
        fua: bool,
    },
    /// Zero the range.
    WriteZeroes {
        /// `NBD_CMD_FLAG_FUA`.
        fua: bool,
    },
    /// Describe the range's allocation (`base:allocation`), answered with one
    /// `NBD_REPLY_TYPE_BLOCK_STATUS` chunk.
    BlockStatus {
        /// `NBD_CMD_FLAG_REQ_ONE`: exactly one descriptor.
        req_one: bool,
    },
    /// A zero-length read, write, trim, write-zeroes or block status: reply success
    /// without doing anything (proto.md: behaviour unspecified, "the server SHOULD NOT disconnect").
    Noop,
    /// `NBD_CMD_DISC`: finish outstanding requests, then close (no reply).
    Disconnect,
    /// Reply with this error. A `NBD_CMD_WRITE` payload ([`Request::payload_bytes`]) must
    /// still be consumed to keep the stream in sync.
    Reject {
        /// `NBD_E*` error value.
        error: u32,
        /// Why, for humans (sent in structured error chunks).
        message: &'static str,
    },
}

/// Judges a request against the export (proto.md "Request types", "Command flags",
/// "Block size constraints", "Error values"), in this order:
///
/// 1. unknown or unimplemented command (`NBD_CMD_CACHE`, trim or write-zeroes when not
///    advertised) → `NBD_EINVAL` ("SHOULD return `NBD_EINVAL` if it receives an unknown
///    command"); `NBD_CMD_BLOCK_STATUS` without a selected metadata context →
///    `NBD_EINVAL` (proto.md "Metadata querying": "Servers SHOULD reply to clients doing
///    so anyway with `EINVAL`");
/// 2. a command flag not documented for the command, or not negotiated → `NBD_EINVAL`;
///    `NBD_CMD_FLAG_FUA` is accepted on every command ("the server MUST accept all
///    commands with this bit set (even by ignoring the bit)");
/// 3. flush with a nonzero offset or length → `NBD_EINVAL` ("*length* and *offset* are
///    reserved, and MUST be set to all-zero");
/// 4. offset or length not a multiple of the minimum block size → `NBD_EINVAL`;
/// 5. a range ending beyond the export → `NBD_ENOSPC` for writes and write-zeroes,
///    `NBD_EINVAL` for reads, trims and block status ("Error values");
/// 6. a read or write longer than [`ExportLimits::max_request_bytes`] (the larger of the
///    advertised maximum and 2^25 bytes) → `NBD_EINVAL`. Up to 2^25 bytes are served
///    whatever maximum was advertised — proto.md "Block size constraints": without agreed
///    constraints "a server SHOULD support ... a maximum payload size that is at least
///    2^25", and any payload up to 2^25 "SHOULD NOT be considered a denial of service
///    attack, even if that length is larger than the advertised maximum"; qemu-nbd and
///    nbdkit serve them too. The front end splits such requests into pieces its buffers
///    hold. `NBD_EOVERFLOW` is reserved for `NBD_CMD_FLAG_DF`. Trim, write-zeroes and
///    block status carry no payload and may be longer (the array takes any 32-bit
///    length; a block status reply describes at most [`MAX_BLOCK_DESCRIPTORS`] extents);
/// 7. `NBD_CMD_FLAG_FAST_ZERO` → `NBD_ENOTSUP` at once, without touching the export: this
///    server cannot promise that zeroing is faster than writing, and "a fast failure of
///    `NBD_ENOTSUP` still counts as a fast response";
/// 8. zero length → [`Verdict::Noop`].
pub fn check_request(r: &Request, lim: &ExportLimits) -> Verdict {
    let reject = |error, message| Verdict::Reject { error, message };
    let allowed = match r.command {
        CMD_READ => CMD_FLAG_FUA | if lim.structured { CMD_FLAG_DF } else { 0 },
        CMD_WRITE | CMD_FLUSH => CMD_FLAG_FUA,
        CMD_TRIM if lim.trim => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES if lim.write_zeroes => {
            CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | if lim.fast_zero { CMD_FLAG_FAST_ZERO } else { 0 }
        }
        CMD_BLOCK_STATUS if lim.block_status => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        CMD_DISC => return Verdict::Disconnect,
        CMD_BLOCK_STATUS => return reject(
            EINVAL,
            "block status needs the base:allocation metadata context (NBD_OPT_SET_META_CONTEXT)",
        ),
        CMD_TRIM => return reject(EINVAL, "trim is not supported by this export"),
        CMD_WRITE_ZEROES => return reject(EINVAL, "write-zeroes is not supported by this export"),
        _ => return reject(EINVAL, "unknown or unsupported command"),
    };
    if r.flags & !allowed != 0 {
        return reject(EINVAL, "command flag not valid for this command");
    }
    let fua = r.flags & CMD_FLAG_FUA != 0;
    if r.command == CMD_FLUSH {
        return if r.offset == 0 && r.length == 0 {
            Verdict::Flush
        } else {
            reject(EINVAL, "flush offset and length must be zero")
        };
    }
    let block = u64::from(lim.min_block_bytes.max(1));
    if !r.offset.is_multiple_of(block) || !u64::from(r.length).is_multiple_of(block) {
        return reject(
            EINVAL,
            "offset or length not a multiple of the minimum block size",
        );
    }
    let beyond = r
        .offset
        .checked_add(u64::from(r.length))
        .is_none_or(|end| end > lim.size_bytes);
    if beyond {
        return if matches!(r.command, CMD_WRITE | CMD_WRITE_ZEROES) {
            reject(ENOSPC, "write beyond the end of the export")
        } else {
            reject(EINVAL, "request beyond the end of the export")
        };
    }
    if matches!(r.command, CMD_READ | CMD_WRITE) && r.length > lim.max_request_bytes() {
        return reject(EINVAL, "length exceeds 32 MiB and the maximum block size");
    }
    if r.command == CMD_WRITE_ZEROES && r.flags & CMD_FLAG_FAST_ZERO != 0 {
        return reject(ENOTSUP, "fast zero is not guaranteed faster than a write");
    }
    if r.length == 0 {
        return Verdict::Noop;
    }
    match r.command {
        CMD_READ => Verdict::Read,
        CMD_WRITE => Verdict::Write { fua },
        CMD_TRIM => Verdict::Trim { fua },
        CMD_BLOCK_STATUS => Verdict::BlockStatus {
            req_one: r.flags & CMD_FLAG_REQ_ONE != 0,
        },
        _ => Verdict::WriteZeroes { fua },
    }
}

// ---------------------------------------------------------------------------------------
// Transmission: replies.
// ---------------------------------------------------------------------------------------

/// A simple reply header (proto.md "Simple reply message"); read data follows it on
/// success.
pub fn simple_reply(error: u32, handle: u64) -> [u8; SIMPLE_REPLY_BYTES] {
    let mut b = [0u8; SIMPLE_REPLY_BYTES];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b
}

/// A structured reply chunk header (proto.md "Structured reply chunk message");
/// `length` bytes of payload follow it.
pub fn structured_header(
    flags: u16,
    kind: u16,
    handle: u64,
    length: u32,
) -> [u8; STRUCTURED_HEADER_BYTES] {
    let mut b = [0u8; STRUCTURED_HEADER_BYTES];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b[16..20].copy_from_slice(&length.to_be_bytes());
    b
}

/// The head of an `NBD_REPLY_TYPE_OFFSET_DATA` chunk (proto.md "Structured reply
/// types"): chunk header (with `NBD_REPLY_FLAG_DONE` when `last`) and the 64-bit offset;
/// `data_len` bytes of data (at least 1) follow it.
pub fn offset_data_head(handle: u64, offset: u64, data_len: u32, last: bool) -> [u8; 28] {
    let mut b = [0u8; 28];
    b[0..20].copy_from_slice(&structured_header(
        if last { REPLY_FLAG_DONE } else { 0 },
        REPLY_TYPE_OFFSET_DATA,
        handle,
        data_len.saturating_add(8),
    ));
    b[20..28].copy_from_slice(&offset.to_be_bytes());
    b
}

/// The head of a final error chunk (proto.md "Structured reply types"):
/// `NBD_REPLY_TYPE_ERROR`, or `NBD_REPLY_TYPE_ERROR_OFFSET` when `with_offset`, with
/// `NBD_REPLY_FLAG_DONE`, the error and the message length. The message (`message_len`
/// bytes, at most 4096) follows, then for `ERROR_OFFSET` the 64-bit offset
/// ([`error_offset_tail`]).
pub fn error_chunk_head(handle: u64, error: u32, message_len: u16, with_offset: bool) -> [u8; 26] {
    let (kind, fixed) = if with_offset {
        (REPLY_TYPE_ERROR_OFFSET, 14)
    } else {
        (REPLY_TYPE_ERROR, 6)
    };
    let mut b = [0u8; 26];
    b[0..20].copy_from_slice(&structured_header(
        REPLY_FLAG_DONE,
        kind,
        handle,
        fixed + u32::from(message_len),
    ));
    b[20..24].copy_from_slice(&error.to_be_bytes());
    b[24..26].copy_from_slice(&message_len.to_be_bytes());
    b
}

/// The 8-byte tail of an `NBD_REPLY_TYPE_ERROR_OFFSET` chunk: the offset of the error.
pub fn error_offset_tail(offset: u64) -> [u8; 8] {
    offset.to_be_bytes()
}

/// The head of a final `NBD_REPLY_TYPE_BLOCK_STATUS` chunk (proto.md "Structured reply
/// types"): chunk header with `NBD_REPLY_FLAG_DONE` and the 32-bit context id;
/// `descriptors` block descriptors ([`block_descriptor`], 8 bytes each, at least one)
/// follow it.
pub fn block_status_head(handle: u64, context_id: u32, descriptors: u32) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[0..20].copy_from_slice(&structured_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_BLOCK_STATUS,
        handle,
        descriptors
            .saturating_mul(BLOCK_DESCRIPTOR_BYTES as u32)
            .saturating_add(4),
    ));
    b[20..24].copy_from_slice(&context_id.to_be_bytes());
    b
}

/// One block descriptor (proto.md "`NBD_REPLY_TYPE_BLOCK_STATUS`"): the extent's length
/// in bytes and its status flags (for `base:allocation`, [`STATE_HOLE`] |
/// [`STATE_ZERO`] or 0).
pub fn block_descriptor(length_bytes: u32, status: u32) -> [u8; BLOCK_DESCRIPTOR_BYTES] {
    let mut b = [0u8; BLOCK_DESCRIPTOR_BYTES];
    b[0..4].copy_from_slice(&length_bytes.to_be_bytes());
    b[4..8].copy_from_slice(&status.to_be_bytes());
    b
}

/// A complete final `NBD_REPLY_TYPE_NONE` chunk (success, no payload).
pub fn none_chunk(handle: u64) -> [u8; STRUCTURED_HEADER_BYTES] {
    structured_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, handle, 0)
}

/// A decoded reply header of either kind (for clients and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    /// A simple reply; for a successful read, the data follows.
    Simple {
        /// `NBD_E*`, 0 for success.
        error: u32,
        /// The request's handle.
        handle: u64,
    },
    /// A structured reply chunk; `length` payload bytes follow.
    Structured {
        /// `NBD_REPLY_FLAG_*`.
        flags: u16,
        /// `NBD_REPLY_TYPE_*`.
        kind: u16,
        /// The request's handle.
        handle: u64,
        /// Payload bytes.
        length: u32,
    },
}

/// Parses a reply header (for clients and tests): simple (16 bytes) or structured
/// (20 bytes), told apart by the magic. Returns the header and its size in bytes.
///
/// # Errors
/// [`ProtoError::Short`] when `b` holds less than the header its magic announces;
/// [`ProtoError::BadMagic`].
pub fn parse_reply_header(b: &[u8]) -> Result<(ReplyHeader, usize), ProtoError> {
    need(b, 4)?;
    match be32(b, 0) {
        SIMPLE_REPLY_MAGIC => {
            need(b, SIMPLE_REPLY_BYTES)?;
            Ok((
                ReplyHeader::Simple {
                    error: be32(b, 4),
                    handle: be64(b, 8),
                },
                SIMPLE_REPLY_BYTES,
            ))
        }
        STRUCTURED_REPLY_MAGIC => {
            need(b, STRUCTURED_HEADER_BYTES)?;
            Ok((
                ReplyHeader::Structured {
                    flags: be16(b, 4),
                    kind: be16(b, 6),
                    handle: be64(b, 8),
                    length: be32(b, 16),
                },
                STRUCTURED_HEADER_BYTES,
            ))
        }
        m => Err(ProtoError::BadMagic(u64::from(m))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lim() -> ExportLimits {
        ExportLimits {
            size_bytes: 1 << 20,
            min_block_bytes: 512,
            max_block_bytes: 64 << 10,
            trim: true,
            write_zeroes: true,
            fast_zero: true,
            structured: false,
            block_status: false,
        }
    }

    fn req(command: u16, flags: u16, offset: u64, length: u32) -> Request {
        Request {
            flags,
            command,
            handle: 7,
            offset,
            length,
        }
    }

    #[test]
    fn request_round_trip_and_bad_magic() {
        let r = req(CMD_WRITE, CMD_FLAG_FUA, 4096, 512);
        let b = encode_request(&r);
        assert_eq!(parse_request(&b), Ok(r));
        assert_eq!(r.payload_bytes(), 512);
        let mut bad = b;
        bad[0] ^= 1;
        assert!(matches!(parse_request(&bad), Err(ProtoError::BadMagic(_))));
        assert!(matches!(
            parse_request(&b[..27]),
            Err(ProtoError::Short { need: 28, have: 27 })
        ));
    }

    #[test]
    fn verdicts_follow_the_error_rules() {
        let l = lim();
        assert_eq!(check_request(&req(CMD_READ, 0, 0, 512), &l), Verdict::Read);
        assert_eq!(
            check_request(&req(CMD_WRITE, CMD_FLAG_FUA, 512, 512), &l),
            Verdict::Write { fua: true }
        );
        let err = |v: Verdict| match v {
            Verdict::Reject { error, .. } => error,
            other => panic!("expected a rejection, got {other:?}"),
        };
        // Beyond the end: ENOSPC for writes, EINVAL for reads/trims.
        assert_eq!(
            err(check_request(&req(CMD_WRITE, 0, 1 << 20, 512), &l)),
            ENOSPC
        );
        assert_eq!(
            err(check_request(&req(CMD_WRITE_ZEROES, 0, 1 << 20, 512), &l)),
            ENOSPC
        );
        assert_eq!(
            err(check_request(&req(CMD_READ, 0, 1 << 20, 512), &l)),
            EINVAL
        );
        assert_eq!(
            err(check_request(&req(CMD_TRIM, 0, u64::MAX - 511, 512), &l)),
            EINVAL
        );
        // Misaligned, oversize, unknown, bad flags.
        assert_eq!(err(check_request(&req(CMD_READ, 0, 1, 512), &l)), EINVAL);
        assert_eq!(err(check_request(&req(CMD_READ, 0, 0, 1000), &l)), EINVAL);
        // Longer than the maximum block size: served up to 2^25 bytes, refused beyond.
        let big = ExportLimits {
            size_bytes: 1 << 30,
            ..l
        };
        assert_eq!(
            check_request(&req(CMD_READ, 0, 0, 128 << 10), &big),
            Verdict::Read
        );
        assert_eq!(
            check_request(&req(CMD_WRITE, 0, 0, DOS_FLOOR_BYTES), &big),
            Verdict::Write { fua: false }
        );
        for cmd in [CMD_READ, CMD_WRITE] {
            assert_eq!(
                err(check_request(&req(cmd, 0, 0, DOS_FLOOR_BYTES + 512), &big)),
                EINVAL
            );
        }
        assert_eq!(err(check_request(&req(99, 0, 0, 0), &l)), EINVAL);
        assert_eq!(
            err(check_request(&req(CMD_READ, CMD_FLAG_DF, 0, 512), &l)),
            EINVAL
        );
        assert_eq!(
            err(check_request(&req(CMD_WRITE, CMD_FLAG_NO_HOLE, 0, 512), &l)),
            EINVAL
        );
        assert_eq!(err(check_request(&req(CMD_FLUSH, 0, 512, 0), &l)), EINVAL);
        assert_eq!(
            err(check_request(
                &req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 512),
                &l
            )),
            ENOTSUP
        );
        // DF is allowed once structured replies are negotiated; FUA on anything.
        let s = ExportLimits {
            structured: true,
            ..l
        };
        assert_eq!(
            check_request(&req(CMD_READ, CMD_FLAG_DF, 0, 512), &s),
            Verdict::Read
        );
        assert_eq!(
            check_request(&req(CMD_FLUSH, CMD_FLAG_FUA, 0, 0), &l),
            Verdict::Flush
        );
        // Trim/write-zeroes longer than the maximum block size are fine.
        assert_eq!(
            check_request(&req(CMD_TRIM, 0, 0, 1 << 20), &l),
            Verdict::Trim { fua: false }
        );
        assert_eq!(check_request(&req(CMD_WRITE, 0, 0, 0), &l), Verdict::Noop);
        assert_eq!(
            check_request(&req(CMD_DISC, 0, 0, 0), &l),
            Verdict::Disconnect
        );
        // Not advertised → EINVAL.
        let n = ExportLimits {
            trim: false,
            write_zeroes: false,
            ..l
        };
        assert_eq!(err(check_request(&req(CMD_TRIM, 0, 0, 512), &n)), EINVAL);
        assert_eq!(
            err(check_request(&req(CMD_WRITE_ZEROES, 0, 0, 512), &n)),
            EINVAL
        );
        assert_eq!(
            n.transmission_flags() & (TFLAG_SEND_TRIM | TFLAG_SEND_FAST_ZERO),
            0
        );
    }

    #[test]
    fn info_request_layout() {
        let d = encode_info_request(b"disk", &[INFO_BLOCK_SIZE, INFO_NAME]);
        match parse_option(OPT_GO, &d) {
            Ok(ClientOption::Go(r)) => {
                assert_eq!(r.name, b"disk");
                assert!(r.asked(INFO_BLOCK_SIZE) && r.asked(INFO_NAME));
                assert!(!r.asked(INFO_DESCRIPTION));
            }
            other => panic!("{other:?}"),
        }
        // Count not matching the data, name running past the data, too short.
        let mut bad = d.clone();
        bad.push(0);
        assert!(matches!(
            parse_option(OPT_GO, &bad),
            Err(ProtoError::Malformed(_))
        ));
        let mut bad = d.clone();
        bad[3] = 200;
        assert!(matches!(
            parse_option(OPT_INFO, &bad),
            Err(ProtoError::Malformed(_))
        ));
        assert!(matches!(
            parse_option(OPT_INFO, &d[..5]),
            Err(ProtoError::Malformed(_))
        ));
        assert!(matches!(
            parse_option(OPT_LIST, b"x"),
            Err(ProtoError::Malformed(_))
        ));
        assert_eq!(parse_option(OPT_ABORT, b"junk"), Ok(ClientOption::Abort));
        assert_eq!(parse_option(42, b"junk"), Ok(ClientOption::Unknown(42)));
        let long = vec![b'a'; MAX_STRING_BYTES + 1];
        assert!(matches!(
            parse_option(OPT_EXPORT_NAME, &long),
            Err(ProtoError::StringTooLong(_))
        ));
    }

    #[test]
    fn meta_context_requests_and_block_status_rules() {
        let d = encode_meta_context_request(b"disk", &[b"base:", b"qemu:dirty-bitmap:x"]);
        for opt in [OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT] {
            let r = match parse_option(opt, &d) {
                Ok(ClientOption::ListMetaContext(r) | ClientOption::SetMetaContext(r)) => r,
                other => panic!("{other:?}"),
            };
            assert_eq!(r.name, b"disk");
            let q: Vec<&[u8]> = r.queries().collect();
            assert_eq!(q, [&b"base:"[..], b"qemu:dirty-bitmap:x"]);
            // `base:` lists the namespace but selects nothing.
            assert!(r.names_base_allocation(true) && !r.names_base_allocation(false));
        }
        let none = encode_meta_context_request(b"", &[]);
        let Ok(ClientOption::SetMetaContext(r)) = parse_option(OPT_SET_META_CONTEXT, &none) else {
            panic!()
        };
        assert!(r.names_base_allocation(true) && !r.names_base_allocation(false));
        let named = encode_meta_context_request(b"", &[b"base:allocation"]);
        let Ok(ClientOption::SetMetaContext(r)) = parse_option(OPT_SET_META_CONTEXT, &named) else {
            panic!()
        };
        assert!(r.names_base_allocation(false));
        // Malformed: short, name past the data, a query past the data, trailing bytes,
        // count larger than the queries, an over-long query.
        let mut trailing = named.clone();
        trailing.push(0);
        let mut count = named.clone();
        count[7] = 2;
        let mut qlen = named.clone();
        qlen[11] = 200;
        let long = encode_meta_context_request(b"", &[&[b'a'; MAX_STRING_BYTES + 1]]);
        for bad in [
            &named[..7],
            &[0, 0, 0, 9, 0, 0, 0, 0][..],
            &qlen,
            &trailing,
            &count,
            &long,
        ] {
            assert!(
                parse_option(OPT_SET_META_CONTEXT, bad).is_err(),
                "{bad:?} accepted"
            );
        }
        // Block status: EINVAL without the context; REQ_ONE (and FUA) allowed with it; range
        // and alignment as reads; zero length a no-op; any 32-bit length.
        let err = |v: Verdict| match v {
            Verdict::Reject { error, .. } => error,
            other => panic!("expected a rejection, got {other:?}"),
        };
        let l = lim();
        assert_eq!(
            err(check_request(&req(CMD_BLOCK_STATUS, 0, 0, 512), &l)),
            EINVAL
        );
        let b = ExportLimits {
            structured: true,
            block_status: true,
            ..l
        };
        assert_eq!(
            check_request(&req(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 0, 1 << 20), &b),
            Verdict::BlockStatus { req_one: true }
        );
        assert_eq!(
            check_request(&req(CMD_BLOCK_STATUS, CMD_FLAG_FUA, 512, 512), &b),
            Verdict::BlockStatus { req_one: false }
        );
        assert_eq!(
            err(check_request(
                &req(CMD_BLOCK_STATUS, CMD_FLAG_DF, 0, 512),
                &b
            )),
            EINVAL
        );
        assert_eq!(
            err(check_request(&req(CMD_BLOCK_STATUS, 0, 1 << 20, 512), &b)),
            EINVAL
        );
        assert_eq!(
            err(check_request(
                &req(CMD_BLOCK_STATUS, 0, 0, (1 << 20) + 512),
                &b
            )),
            EINVAL
        );
        assert_eq!(
            err(check_request(&req(CMD_BLOCK_STATUS, 0, 100, 512), &b)),
            EINVAL
        );
        assert_eq!(
            check_request(&req(CMD_BLOCK_STATUS, 0, 0, 0), &b),
            Verdict::Noop
        );
        let head = block_status_head(3, BASE_ALLOCATION_ID, 2);
        assert_eq!(
            parse_reply_header(&head).unwrap().0,
            ReplyHeader::Structured {
                flags: REPLY_FLAG_DONE,
                kind: REPLY_TYPE_BLOCK_STATUS,
                handle: 3,
                length: 20
            }
        );
    }

    #[test]
    fn client_flags() {
        assert_eq!(check_client_flags(3, SERVER_HANDSHAKE_FLAGS), Ok(()));
        assert_eq!(check_client_flags(0, SERVER_HANDSHAKE_FLAGS), Ok(()));
        assert_eq!(check_client_flags(4, SERVER_HANDSHAKE_FLAGS), Err(4));
        assert_eq!(check_client_flags(2, FLAG_FIXED_NEWSTYLE), Err(2));
    }

    #[test]
    fn reply_headers() {
        let (h, n) = parse_reply_header(&simple_reply(EIO, 9)).unwrap();
        assert_eq!(n, 16);
        assert_eq!(
            h,
            ReplyHeader::Simple {
                error: EIO,
                handle: 9
            }
        );
        let head = offset_data_head(5, 4096, 512, true);
        let (h, n) = parse_reply_header(&head).unwrap();
        assert_eq!(n, 20);
        assert_eq!(
            h,
            ReplyHeader::Structured {
                flags: REPLY_FLAG_DONE,
                kind: REPLY_TYPE_OFFSET_DATA,
                handle: 5,
                length: 520
            }
        );
        let e = error_chunk_head(5, EINVAL, 3, true);
        assert_eq!(u32::from_be_bytes([e[16], e[17], e[18], e[19]]), 14 + 3);
    }
}
