//! ferroraid's RAID engine.
//!
//! The engine is pure computation plus (in later modules) the reactor and stripe state
//! machines; it performs no syscalls of its own and talks to devices through a trait.
//! See `../shared/DESIGN.md` for the architecture and vocabulary.
//!
//! Modules present so far:
//! - [`geometry`]: md raid5/raid6 member layout (the six md layouts), logical→member
//!   mapping, P/Q placement, Q syndrome slots, array capacity.
//! - [`parity`]: P (XOR) and P+Q (GF(2^8), polynomial 0x11d, generator {02}) generation,
//!   read-modify-write updates and recovery of every recoverable erasure, with scalar,
//!   AVX2, AVX-512BW and GFNI kernels chosen at run time.
//! - [`metadata`]: md's v1.2 superblock (every field of `mdp_superblock_1`), its checksum,
//!   superblocks for a new array as mdadm lays them out, the update rule, and the
//!   assembly decision (which device serves which role, stale, spare, missing).
//! - [`buf`]: aligned, zero-initialised buffers for chunks (the parity kernels require
//!   64-byte alignment; device DMA wants 4 KiB).
//! - [`device`]: the block-device interface (device facts, per-reactor channels, requests,
//!   completions, typed I/O errors) that every back end implements.
//! - [`stripe`]: write planning (full-stripe / RMW / RCW / degraded reconstruct-write).
//! - [`array`]: one reactor's stripe engine: array requests to member I/O, per-stripe
//!   ordering, degraded reads and writes, member failure handling.
//! - [`bitmap`]: the runtime write-intent bitmap (md's rules: bits durable before a
//!   write, lazy clearing by a daemon, `events_cleared`), shared lock-free by the shards
//!   and written by one owner shard.
//! - [`reactor`]: reactor threads (pinned, polled or adaptive) each running a shard, an
//!   inbound lock-free ring and a front-end hook.
//! - [`shard`]: stripe ownership across reactors (stripe `s` → reactor `s mod n`), request
//!   splitting, and a single-threaded composition of shards for virtual-time runs.
//! - [`process`]: background processes (resync, rebuild, check, repair): kinds, per-shard
//!   walks and progress, the merged snapshot, md's `mismatch_cnt` rule.
//! - [`qos`]: I/O classes and the background pacer interface (controllers in
//!   submodules).
//! - [`qos`]: I/O classes and per-member class queues, per-member queue-depth
//!   controllers (ferroraid's, a wbt-like baseline, off) and background pacers
//!   (ferroraid's, md's pre-4.1 and 4.1+ rules) behind the `Pacer` interface.
//! - [`zero_map`]: which stripes read as zeroes (one bit per stripe, shared lock-free by
//!   the shards), for block status: from the members' allocation at start, set by
//!   whole-stripe zeroing, cleared by writes.
//! - [`latency`]: latency histograms for the per-request path (an HDR histogram behind
//!   a run-length front: the equal latencies of one loop turn cost an increment).
//! - [`sim`]: the engine's test world — a virtual clock and simulated devices with latency
//!   profiles (NVMe, cached SATA SSD with an unbounded or bounded write cache, 7200 rpm
//!   disk), seeded fault injection, and closed-loop client jobs in virtual time.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod array;
pub mod bitmap;
pub mod buf;
pub mod checksum;
pub mod device;
pub mod geometry;
pub mod latency;
pub mod metadata;
pub mod parity;
pub mod ppl;
pub mod process;
pub mod qos;
pub mod reactor;
pub mod shard;
pub mod sim;
pub mod stripe;
pub mod zero_map;
