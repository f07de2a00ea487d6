//! NVMe over TCP (NVMe/TCP transport specification 1.0): the building blocks of an
//! NVMe/TCP target front end beside NBD and iSCSI.
//!
//! What is here so far:
//!
//! - [`pdu`]: the PDU layer as pure code, without sockets or the engine. The common header
//!   (CH, TCP 1.0 §3.6.2.1), every PDU type of the transport (ICReq/ICResp, CapsuleCmd/
//!   CapsuleResp, H2CData/C2HData, R2T, H2CTermReq/C2HTermReq, §3.6.2.2–§3.6.2.10), the
//!   64-byte submission queue entry with its SGL descriptor and the 16-byte completion
//!   queue entry; an incremental, allocation-free receive parser ([`pdu::PduParser`]) that
//!   checks header and data digests (CRC32C, §3.3.1.1) and reports fatal transport errors
//!   with the FES/FEI a C2HTermReq must carry (§3.5); encoders into a caller's buffer; the
//!   ICReq/ICResp negotiation as the Linux 6.1 host checks it ([`pdu::negotiate`],
//!   [`pdu::check_icresp`]) and the H2CData checks against an outstanding R2T
//!   ([`pdu::H2cExpect`]).
//!
//! What the target above it will add (issue 22; facts in the research note
//! `nvmf-tcp.md` and the outline in docs/NVMF.md): one queue pair per TCP connection on a
//! reactor (admin queue first, I/O queues spread over reactors), the Fabrics commands
//! (Connect, Property Get/Set), the admin and discovery controllers (Identify, Get Log
//! Page, features, keep-alive, AER), the NVM I/O commands against the array, and ANA
//! groups for native multipath across portals.

pub mod pdu;
