//! The status report of a running target: what `ferroraid status` prints and what the
//! `array_status` JSON-RPC method returns.
//!
//! **Stable field names.** Scripts read these fields by name (`ferroraid status --json`,
//! the RPC socket): fields are only ever added, never renamed or removed, and enum values
//! are the lower-case strings listed on each type. Units are in the field names: `_bytes`
//! are bytes, `_us` microseconds, `_s` seconds, `_bytes_per_s` bytes per second; counts
//! have no suffix.
//!
//! A JSON report looks like this (abridged):
//!
//! ```json
//! { "array": { "name": "host:data", "array_uuid": "e6c2614f:6ebd4c6b:5055bf86:866fae7b",
//!              "level": 6, "layout": "left-symmetric", "chunk_bytes": 65536,
//!              "raid_devices": 6, "size_bytes": 268435456, "state": "degraded", "events": 7 },
//!   "members": [ { "slot": 0, "device": "/dev/nvme0n1", "state": "active",
//!                  "io": { "reads": 10, "writes": 4, "flushes": 1, "read_bytes": 40960,
//!                          "write_bytes": 16384, "errors": 0 },
//!                  "latency_us": { "p50": 11.2, "p90": 14.0, "p99": 30.1, "p999": 52.0,
//!                                  "max": 61.4, "count": 15 },
//!                  "qos": { "policy": "ferroraid", "depth_limit": 31, "scale_step": 6,
//!                           "target_latency_us": 151.3, "read_p50_us": 121.0,
//!                           "read_p99_us": 123.9, "read_min_us": 120.8 } }, ... ],
//!   "reactors": { "count": 2, "cores": [0, 1], "mode": "polled",
//!                 "load": [ { "turns": 10, "busy_s": 0.1, "idle_s": 2.0, "pieces_sent": 4,
//!                             "pieces_received": 3 }, ... ] },
//!   "stats": { "direct_reads": 10, ... }, "requests_in_flight": 0,
//!   "exports": [ { "protocol": "nbd", "address": "127.0.0.1:10809", "name": "data" } ],
//!   "process": { "kind": "idle", "state": "idle", "position_bytes": 0, "size_bytes": 0,
//!                "rate_bytes_per_s": 0, "eta_s": null, "mismatch_cnt": 0, "error": null },
//!   "bitmap": { "chunk_bytes": 67108864, "regions": 120, "dirty_regions": 3,
//!               "events_cleared": 5, "clearing": true },
//!   "queue_wait_us": { "small_read": { "p50": 3.1, "p90": 8.0, "p99": 41.0, "p999": 90.1,
//!                                      "max": 120.3, "count": 5120 },
//!                      "bulk_write": { ... }, "other": { ... } } }
//! ```
//!
//! [`StatusReport::exit_code`] is the exit status of `ferroraid status` (0 healthy,
//! 1 degraded or rebuilding, 2 failed; [`EXIT_NOT_RUNNING`] when no target answers), after
//! `mdadm --detail --test`.

use std::fmt;

use engine::array::{ArrayStats, MemberCounters};
use engine::reactor::MemberSnapshot;
use serde::{Deserialize, Serialize};

/// `ferroraid status` exit status: the array is healthy (all members active; clean, or
/// active with writes in flight; resync/check/repair count as healthy, as in
/// `mdadm --detail --test`).
pub const EXIT_HEALTHY: u8 = 0;
/// Exit status: degraded (a member is missing or faulty, redundancy reduced) or rebuilding.
pub const EXIT_DEGRADED: u8 = 1;
/// Exit status: failed (more members lost than the level's parity: data is unavailable).
pub const EXIT_FAILED: u8 = 2;
/// Exit status: no target answered (nothing running at the socket, or its status could
/// not be read); `ferroraid status` prints one line on stderr saying why.
pub const EXIT_NOT_RUNNING: u8 = 4;

/// Everything `ferroraid status` shows about one array and the target serving it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The array: identity, geometry, size and state.
    pub array: ArrayInfo,
    /// Every slot of the array (missing/removed ones included) and every spare, in slot
    /// order, spares last.
    pub members: Vec<MemberReport>,
    /// The reactor threads serving the array.
    pub reactors: ReactorsReport,
    /// What the engine did, by path (summed over every reactor).
    pub stats: StatsReport,
    /// Array requests accepted and not yet completed, all reactors.
    pub requests_in_flight: u64,
    /// Of those, write pieces that finished while a member (or a replacement) had failed
    /// and are held until the superblocks record the failure (normally for a monitor
    /// turn, 50 ms; for as long as no superblock can be written). Absent in reports of
    /// targets that predate it.
    #[serde(default)]
    pub writes_awaiting_record: u64,
    /// Where the array is exported (empty when it is not).
    pub exports: Vec<ExportReport>,
    /// The background process running on the array (resync, rebuild, check, repair,
    /// replace), `idle`, or the last one if it ended on a failure.
    pub process: ProcessReport,
    /// The internal write-intent bitmap; `null` when the array has none. Absent in reports
    /// of targets that predate it.
    #[serde(default)]
    pub bitmap: Option<BitmapReport>,
    /// How long requests waited inside the target before their first member request, per
    /// class (issue 24, docs/PACING.md, "Front door"). Absent in reports of targets that predate it.
    #[serde(default)]
    pub queue_wait_us: QueueWaitReport,
    /// The NBD server's connections and its refusals (issue 18); `null` in reports of
    /// targets that predate it.
    #[serde(default)]
    pub nbd: Option<NbdReport>,
    /// The NVMe/TCP target's controllers and their I/O queues with counters (issue 22);
    /// `null` without NVMe/TCP and in reports of targets that predate it.
    #[serde(default)]
    pub nvmf: Option<NvmfReport>,
}

/// The NVMe/TCP target's associations now (`ferroraid::nvmf`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmfReport {
    /// Controllers (one per host association), by CNTLID.
    pub controllers: Vec<NvmfControllerReport>,
}

/// One NVMe/TCP controller.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmfControllerReport {
    /// Controller ID.
    pub cntlid: u16,
    /// `io` or `discovery`.
    pub kind: String,
    /// The host's NQN.
    pub hostnqn: String,
    /// Its connected I/O queues, by QID.
    pub queues: Vec<NvmfQueueReport>,
}

/// One I/O queue's counters since it connected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmfQueueReport {
    /// Queue ID.
    pub qid: u16,
    /// Read commands completed successfully.
    pub reads: u64,
    /// Write commands completed successfully.
    pub writes: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Commands completed with an error status.
    pub errors: u64,
}

/// The NBD server's connection counters (`ferroraid::nbd::NbdStats`): counts since start,
/// gauges now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NbdReport {
    /// Connections holding a slot now (transmission phase, or reserved by `NBD_OPT_INFO`).
    pub connections: u64,
    /// The export's connection limit (`--nbd-max-connections`).
    pub max_connections: u64,
    /// Handshakes in progress now.
    pub handshakes: u64,
    /// Clients refused at the handshake because the limit was reached.
    pub refused: u64,
    /// Handshakes closed by `--nbd-handshake-timeout-ms`.
    pub handshake_timeouts: u64,
    /// Handshakes closed to make room for newer ones (`--nbd-max-handshakes`).
    pub handshakes_evicted: u64,
    /// Connections closed by `--nbd-idle-timeout-s`.
    pub idle_closed: u64,
}

impl From<crate::nbd::NbdStats> for NbdReport {
    fn from(s: crate::nbd::NbdStats) -> Self {
        Self {
            connections: s.connections as u64,
            max_connections: s.max_connections as u64,
            handshakes: s.handshakes as u64,
            refused: s.refused,
            handshake_timeouts: s.handshake_timeouts,
            handshakes_evicted: s.handshakes_evicted,
            idle_closed: s.idle_closed,
        }
    }
}

/// Queue wait inside the target per request class, **microseconds**: from the array's
/// acceptance of a request to its first member request (`engine::array::Array::queue_wait`),
/// merged over the reactors. Classes (`engine::array::RequestClass`): reads of at most 128
/// KiB; writes of at least 128 KiB or continuing a sequential stream; the rest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueWaitReport {
    /// Reads of at most 128 KiB.
    pub small_read: LatencyReport,
    /// Bulk writes.
    pub bulk_write: LatencyReport,
    /// Everything else (large reads, small random writes, flushes).
    pub other: LatencyReport,
}

impl QueueWaitReport {
    /// From the snapshot's per-class histograms (ns, indexed by `RequestClass::index`).
    pub fn from_histograms_ns(h: &[hdrhistogram::Histogram<u64>; 3]) -> Self {
        use engine::array::RequestClass as C;
        let r = |c: C| LatencyReport::from_histogram_ns(&h[c.index()]);
        QueueWaitReport {
            small_read: r(C::SmallRead),
            bulk_write: r(C::BulkWrite),
            other: r(C::Other),
        }
    }
}

/// The array's internal write-intent bitmap (md's, `engine::bitmap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BitmapReport {
    /// Bytes of each member one bit covers (md's bitmap `chunksize`).
    pub chunk_bytes: u64,
    /// Bits (regions) in the bitmap.
    pub regions: u64,
    /// Bits set on disk: regions written recently, or since a member left (a re-added
    /// member is rebuilt over these; a crash resyncs them).
    pub dirty_regions: u64,
    /// md's `events_cleared`: the array's `events` when bits were last cleared. A member
    /// that left at a lower `events` can only come back with a full rebuild.
    pub events_cleared: u64,
    /// Whether idle bits are being cleared (false while a member is missing or being
    /// recovered: md keeps every bit then).
    pub clearing: bool,
}

/// The array's identity, geometry, size and state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayInfo {
    /// md's `set_name` (by mdadm's convention `homehost:name`).
    pub name: String,
    /// The array UUID in md's colon form, `xxxxxxxx:xxxxxxxx:xxxxxxxx:xxxxxxxx` (as
    /// `mdadm --detail` prints it; `engine::metadata::Uuid`'s `Display`).
    pub array_uuid: String,
    /// RAID level: 5 or 6.
    pub level: u8,
    /// md's layout name (`left-symmetric`, ...; `engine::geometry::Layout::name`).
    pub layout: String,
    /// Chunk size, bytes.
    pub chunk_bytes: u64,
    /// Members of the complete array (md's `raid_disks`), spares not counted.
    pub raid_devices: u16,
    /// Capacity exported to clients, bytes.
    pub size_bytes: u64,
    /// `clean`, `active`, `degraded` or `failed` ([`ArrayState`]).
    pub state: ArrayState,
    /// The superblock generation (md's `events`).
    pub events: u64,
    /// How parity is kept consistent across a crash, with mdadm's names (`mdadm --detail`'s
    /// "Consistency Policy"): `bitmap` (internal write-intent bitmap), `ppl` (Partial
    /// Parity Log), `resync` (neither: a full resync after an unclean shutdown). Absent in
    /// reports of targets that predate it.
    #[serde(default)]
    pub consistency_policy: String,
}

/// The state of an array. Serialized as the lower-case name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ArrayState {
    /// Every member active, parity known consistent, no write outstanding (md's
    /// `resync_offset` = MaxSector).
    Clean,
    /// Every member active, the array marked dirty (writes in flight, or a resync needed).
    Active,
    /// Members missing or faulty, within the parity: data served by reconstruction, with
    /// less (RAID6: maybe no) redundancy. Wins over `active`/`clean`.
    Degraded,
    /// More members lost than the parity covers: data unavailable.
    Failed,
}

impl ArrayState {
    /// The state of an array with `raid_devices` members of which `working` are active,
    /// protected by `parity` parity chunks per stripe (1 for RAID5, 2 for RAID6); `clean`
    /// says whether the parity is known consistent (md's `resync_offset` = MaxSector).
    /// Failed beats degraded beats clean/active.
    pub fn derive(raid_devices: u16, parity: u16, working: u16, clean: bool) -> ArrayState {
        let lost = raid_devices.saturating_sub(working);
        if lost > parity {
            ArrayState::Failed
        } else if lost > 0 {
            ArrayState::Degraded
        } else if clean {
            ArrayState::Clean
        } else {
            ArrayState::Active
        }
    }

    /// The lower-case name (`clean`, ...), as serialized.
    pub fn as_str(self) -> &'static str {
        match self {
            ArrayState::Clean => "clean",
            ArrayState::Active => "active",
            ArrayState::Degraded => "degraded",
            ArrayState::Failed => "failed",
        }
    }
}

impl fmt::Display for ArrayState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One slot of the array, or a spare.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemberReport {
    /// The member's role in the stripe layout (0-based, `< raid_devices`); `null` for a
    /// spare.
    pub slot: Option<u16>,
    /// The device's path as the target opened it; `null` when the slot has no device
    /// (`missing`, `removed`).
    pub device: Option<String>,
    /// `active`, `faulty`, `removed`, `spare` or `missing` ([`MemberState`]).
    pub state: MemberState,
    /// Requests the target sent to the device.
    pub io: IoReport,
    /// Completion latency of those requests.
    pub latency_us: LatencyReport,
    /// The member's queue-depth controller (`engine::qos::depth`), merged over the
    /// reactors. Absent in reports of targets that predate it (reads as all zero).
    #[serde(default)]
    pub qos: QosReport,
}

/// One member's queue-depth control (`engine::qos::QosState`), merged over the reactors
/// (`engine::qos::QosState::merge`: depth limits add up, latencies take the worst).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QosReport {
    /// `off`, `wbt-like` or `ferroraid` (empty when no controller reported).
    pub policy: String,
    /// Foreground-write + background requests the reactors together let into the device
    /// (with control off, the device's queue depth per reactor, summed).
    pub depth_limit: u64,
    /// Scaling step: 0 = unthrottled, each step halves the depth (negative: deeper than
    /// default, wbt-like only); the largest over the reactors.
    pub scale_step: i32,
    /// Read-latency target, µs (derived from quiet-device reads, or configured).
    pub target_latency_us: f64,
    /// Last finished control window: read latency median, µs (0: no reads).
    pub read_p50_us: f64,
    /// Last finished control window: read latency 99th percentile, µs.
    pub read_p99_us: f64,
    /// Last finished control window: smallest read latency, µs.
    pub read_min_us: f64,
}

impl QosReport {
    /// The report of an engine controller state; the empty report (no policy) for a
    /// member no reactor has reported on yet (a state with no depth limit: every running
    /// controller allows at least one request; the snapshot before the reactors' first
    /// publication holds `QosState::default()`, which would read as "ferroraid", depth 0).
    pub fn from_state(q: &engine::qos::QosState) -> QosReport {
        if q.depth_limit == 0 {
            return QosReport::default();
        }
        let policy = match q.policy {
            engine::qos::DepthPolicy::Off => "off",
            engine::qos::DepthPolicy::WbtLike => "wbt-like",
            engine::qos::DepthPolicy::Ferroraid => "ferroraid",
        };
        QosReport {
            policy: policy.to_string(),
            depth_limit: u64::from(q.depth_limit),
            scale_step: q.scale_step,
            target_latency_us: q.target_latency_us,
            read_p50_us: q.read_p50_us,
            read_p99_us: q.read_p99_us,
            read_min_us: q.read_min_us,
        }
    }
}

/// The state of a slot or spare. Serialized as the lower-case name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberState {
    /// Serving I/O.
    Active,
    /// Failed (by an I/O error, a timeout or the operator's `fail`): no I/O is sent to it;
    /// still holds its slot until removed.
    Faulty,
    /// A faulty member taken out of its slot by `remove`; the slot is empty.
    Removed,
    /// A device standing by to replace a failed member (no slot).
    Spare,
    /// A device in a failed member's slot whose contents a rebuild is recovering (md's
    /// "spare rebuilding"): written by every write, read only where already rebuilt.
    Rebuilding,
    /// A slot no device was found for when the array started.
    Missing,
    /// A device replacing the member of its slot (`ferroraid replace`, md's
    /// "replacement"): written by every write to the member, filled by the `replace`
    /// process, never read until it takes the slot. Listed right after its slot.
    Replacing,
}

impl MemberState {
    /// The lower-case name (`active`, ...), as serialized.
    pub fn as_str(self) -> &'static str {
        match self {
            MemberState::Active => "active",
            MemberState::Faulty => "faulty",
            MemberState::Removed => "removed",
            MemberState::Spare => "spare",
            MemberState::Rebuilding => "rebuilding",
            MemberState::Missing => "missing",
            MemberState::Replacing => "replacing",
        }
    }

    /// The report state of an engine member: online → `active`; failed by an error or by
    /// the operator → `faulty`; being rebuilt → `rebuilding` (md's "spare rebuilding").
    pub fn from_engine(state: &engine::array::MemberState) -> MemberState {
        match state {
            engine::array::MemberState::Online => MemberState::Active,
            engine::array::MemberState::Rebuilding => MemberState::Rebuilding,
            engine::array::MemberState::Failed(_)
            | engine::array::MemberState::FailedByOperator => MemberState::Faulty,
        }
    }
}

impl fmt::Display for MemberState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Requests sent to one member (the engine's `MemberCounters`, all reactors).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoReport {
    /// Read requests issued.
    pub reads: u64,
    /// Write, write-zeroes and discard requests issued.
    pub writes: u64,
    /// Flush requests issued.
    pub flushes: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written (write-zeroes and discards count their range).
    pub write_bytes: u64,
    /// Requests that completed with an error (any kind).
    pub errors: u64,
}

impl From<&MemberCounters> for IoReport {
    fn from(c: &MemberCounters) -> Self {
        IoReport {
            reads: c.reads,
            writes: c.writes,
            flushes: c.flushes,
            read_bytes: c.read_bytes,
            write_bytes: c.write_bytes,
            errors: c.errors,
        }
    }
}

/// Completion latency percentiles of one member's requests, **microseconds** (with
/// nanosecond resolution: the engine records ns), and the number of requests measured.
/// All zero when nothing was measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyReport {
    /// Median, µs.
    pub p50: f64,
    /// 90th percentile, µs.
    pub p90: f64,
    /// 99th percentile, µs.
    pub p99: f64,
    /// 99.9th percentile, µs.
    pub p999: f64,
    /// Largest recorded, µs.
    pub max: f64,
    /// Requests recorded.
    pub count: u64,
}

impl LatencyReport {
    /// Percentiles of a latency histogram recorded in **nanoseconds** (the engine's
    /// member histograms, `engine::array::new_latency_histogram`), converted to µs. The
    /// histogram's precision applies (2 significant digits for the engine's): each
    /// percentile is the highest value equivalent to the recorded ones.
    pub fn from_histogram_ns(h: &hdrhistogram::Histogram<u64>) -> LatencyReport {
        if h.is_empty() {
            return LatencyReport::default();
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        LatencyReport {
            p50: us(h.value_at_quantile(0.5)),
            p90: us(h.value_at_quantile(0.9)),
            p99: us(h.value_at_quantile(0.99)),
            p999: us(h.value_at_quantile(0.999)),
            max: us(h.max()),
            count: h.len(),
        }
    }
}

impl MemberReport {
    /// [`LatencyReport::from_histogram_ns`]: µs percentiles of a histogram recorded in ns.
    pub fn latency_from(h: &hdrhistogram::Histogram<u64>) -> LatencyReport {
        LatencyReport::from_histogram_ns(h)
    }

    /// The report of member `slot` at `device` from the reactors' merged snapshot
    /// (`engine::reactor::ReactorHandle::snapshot`).
    pub fn from_snapshot(slot: u16, device: Option<String>, m: &MemberSnapshot) -> MemberReport {
        MemberReport {
            slot: Some(slot),
            device,
            state: MemberState::from_engine(&m.state),
            io: IoReport::from(&m.counters),
            latency_us: Self::latency_from(&m.latency),
            qos: QosReport::from_state(&m.qos),
        }
    }

    /// A slot with no device (`missing` or `removed`) or a device with no I/O yet: zero
    /// counters and latencies.
    pub fn idle(slot: Option<u16>, device: Option<String>, state: MemberState) -> MemberReport {
        MemberReport {
            slot,
            device,
            state,
            io: IoReport::default(),
            latency_us: LatencyReport::default(),
            qos: QosReport::default(),
        }
    }
}

/// The reactor threads serving the array.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReactorsReport {
    /// Reactor threads running.
    pub count: usize,
    /// The CPU core each reactor is pinned to (`null`: not pinned), in reactor order.
    pub cores: Vec<Option<usize>>,
    /// `polled` (busy-poll) or `adaptive` (spin, then nap) ([`ReactorMode`]).
    pub mode: ReactorMode,
    /// Each reactor's loop since start, in reactor order. Empty in reports of targets that
    /// predate it.
    #[serde(default)]
    pub load: Vec<ReactorLoadReport>,
}

/// One reactor's loop since the target started (`engine::reactor::ReactorLoad`): how its
/// time split between turns that moved something and idle turns, and the request pieces
/// it exchanged with the reactors owning their stripes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReactorLoadReport {
    /// Loop turns.
    pub turns: u64,
    /// Seconds in turns that moved something.
    pub busy_s: f64,
    /// Seconds in turns that found nothing to do (spinning or napping).
    pub idle_s: f64,
    /// Request pieces sent to other reactors.
    pub pieces_sent: u64,
    /// Request pieces received from other reactors.
    pub pieces_received: u64,
}

impl From<&engine::reactor::ReactorLoad> for ReactorLoadReport {
    fn from(l: &engine::reactor::ReactorLoad) -> Self {
        ReactorLoadReport {
            turns: l.turns,
            busy_s: l.busy_ns as f64 / 1e9,
            idle_s: l.idle_ns as f64 / 1e9,
            pieces_sent: l.pieces_sent,
            pieces_received: l.pieces_received,
        }
    }
}

impl ReactorLoadReport {
    /// Busy share of the measured time, percent (0 before anything was measured).
    pub fn busy_percent(&self) -> f64 {
        let total = self.busy_s + self.idle_s;
        if total > 0.0 {
            100.0 * self.busy_s / total
        } else {
            0.0
        }
    }
}

/// How reactors wait when idle (`engine::reactor::Mode`). Serialized lower-case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReactorMode {
    /// Busy-poll: never sleeps.
    Polled,
    /// Spin briefly, then sleep in growing naps.
    Adaptive,
}

impl From<engine::reactor::Mode> for ReactorMode {
    fn from(m: engine::reactor::Mode) -> Self {
        match m {
            engine::reactor::Mode::Polled => ReactorMode::Polled,
            engine::reactor::Mode::Adaptive => ReactorMode::Adaptive,
        }
    }
}

impl fmt::Display for ReactorMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReactorMode::Polled => "polled",
            ReactorMode::Adaptive => "adaptive",
        })
    }
}

/// What the engine did, by path: the engine's `ArrayStats`, summed over every reactor.
/// All counts since the target started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsReport {
    /// Stripe reads served straight from the members (fast-path reads included).
    pub direct_reads: u64,
    /// Reads issued at submission as one member read, without a stripe operation (the
    /// engine's fast path: inside one chunk of an online member, no write or flush queued
    /// ahead, no write holding or waiting for the stripe).
    #[serde(default)]
    pub fast_reads: u64,
    /// Stripe reads that rebuilt data from parity.
    pub degraded_reads: u64,
    /// Full-stripe writes (no reads).
    pub full_stripe_writes: u64,
    /// Read-modify-write stripe writes.
    pub rmw_writes: u64,
    /// Reconstruct-write stripe writes.
    pub rcw_writes: u64,
    /// Degraded reconstruct-writes.
    pub degraded_writes: u64,
    /// Members failed by I/O errors, timeouts or disappearance.
    pub member_failures: u64,
    /// Unrecovered read errors absorbed by rebuilding the range from redundancy.
    pub medium_errors: u64,
    /// Ranges rewritten after being rebuilt from redundancy.
    pub read_errors_repaired: u64,
    /// Whole stripes zeroed with member write-zeroes.
    pub zeroed_stripes: u64,
    /// Whole stripes deallocated with member discards.
    pub discarded_stripes: u64,
    /// Stripe pieces of discard requests left alone (discard is advisory).
    pub discards_skipped: u64,
    /// Member requests that outlived the command timeout (each failed its member).
    pub timeouts: u64,
    /// Write passes on healthy stripes: one plan, one parity computation and one set of
    /// member I/Os each, serving `batched_writes` stripe writes (the batching factor is
    /// their ratio).
    #[serde(default)]
    pub write_passes: u64,
    /// Stripe writes the write passes served.
    #[serde(default)]
    pub batched_writes: u64,
    /// Member bytes read before writing (RMW/RCW pre-reads).
    #[serde(default)]
    pub write_read_bytes: u64,
    /// Client bytes the write passes wrote (member bytes read per client byte written:
    /// `write_read_bytes / pass_written_bytes`).
    #[serde(default)]
    pub pass_written_bytes: u64,
    /// Write passes that found their stripe in the stripe cache.
    #[serde(default)]
    pub cache_hit_stripes: u64,
    /// Member bytes the stripe cache spared reading.
    #[serde(default)]
    pub cache_hit_bytes: u64,
    /// Random sub-stripe writes admitted to the stripe cache (they came back to a stripe
    /// written around it lately).
    #[serde(default)]
    pub cache_admitted_writes: u64,
    /// Reads served from the stripe cache (no member read).
    #[serde(default)]
    pub cache_reads: u64,
    /// Data chunks the write passes wrote gathered from several writes' buffers (one
    /// member request each, no copy into the stripe cache).
    #[serde(default)]
    pub gathered_writes: u64,
    /// Partial Parity Log records written (each durable before the writes it describes).
    #[serde(default)]
    pub ppl_records: u64,
    /// Bytes of those records (4 KiB headers and partial parity).
    #[serde(default)]
    pub ppl_bytes: u64,
    /// Write passes held for more writes before reading (coalescing).
    #[serde(default)]
    pub held_passes: u64,
    /// Total time write passes were held, µs.
    #[serde(default)]
    pub held_us: u64,
    /// Holds that reached `--write-hold-us` without the writes they waited for.
    #[serde(default)]
    pub expired_holds: u64,
    /// Requests that went ahead of earlier bulk writes waiting for their share of the
    /// stripe operations (front-door scheduling, docs/PACING.md, "Front door").
    #[serde(default)]
    pub overtaking_requests: u64,
    /// Reads of a stripe a write held, served from that write's own data instead of
    /// waiting for its member writes (docs/PACING.md, "Front door").
    #[serde(default)]
    pub pass_reads: u64,
    /// Stripe operations bulk writes may hold now, over all reactors (the bulk share,
    /// `engine::qos::share`, docs/PACING.md, "Front door"). A gauge.
    #[serde(default)]
    pub bulk_share_ops: u64,
    /// The stripe operations of all reactors, the pool the share is of. A gauge.
    #[serde(default)]
    pub bulk_share_pool: u64,
    /// Cuts of the bulk share so far (small reads slower inside the target than allowed).
    #[serde(default)]
    pub bulk_share_cuts: u64,
    /// Raises of the bulk share so far (probes, returns towards the whole pool).
    #[serde(default)]
    pub bulk_share_raises: u64,
    /// Stripes the target knows to read as zeroes now, reported as holes by block status
    /// (`engine::zero_map::ZeroMap`: from the members' allocation at start, whole-stripe
    /// zeroing since, cleared by writes). A gauge, not a count since start.
    #[serde(default)]
    pub zero_stripes: u64,
}

impl From<&ArrayStats> for StatsReport {
    fn from(s: &ArrayStats) -> Self {
        StatsReport {
            direct_reads: s.direct_reads,
            fast_reads: s.fast_reads,
            degraded_reads: s.degraded_reads,
            full_stripe_writes: s.full_stripe_writes,
            rmw_writes: s.rmw_writes,
            rcw_writes: s.rcw_writes,
            degraded_writes: s.degraded_writes,
            member_failures: s.member_failures,
            medium_errors: s.medium_errors,
            read_errors_repaired: s.read_errors_repaired,
            zeroed_stripes: s.zeroed_stripes,
            discarded_stripes: s.discarded_stripes,
            discards_skipped: s.discards_skipped,
            timeouts: s.timeouts,
            write_passes: s.write_passes,
            batched_writes: s.batched_writes,
            write_read_bytes: s.write_read_bytes,
            pass_written_bytes: s.pass_written_bytes,
            cache_hit_stripes: s.cache_hit_stripes,
            cache_hit_bytes: s.cache_hit_bytes,
            cache_admitted_writes: s.cache_admitted_writes,
            cache_reads: s.cache_reads,
            gathered_writes: s.gathered_writes,
            ppl_records: s.ppl_records,
            ppl_bytes: s.ppl_bytes,
            held_passes: s.held_passes,
            held_us: s.held_ns / 1000,
            expired_holds: s.expired_holds,
            overtaking_requests: s.overtaking_requests,
            pass_reads: s.pass_reads,
            bulk_share_ops: s.bulk_share_ops,
            bulk_share_pool: s.bulk_share_pool,
            bulk_share_cuts: s.bulk_share_cuts,
            bulk_share_raises: s.bulk_share_raises,
            // A gauge of the snapshot, not of the path counters: the caller fills it in.
            zero_stripes: 0,
        }
    }
}

/// One export of the array.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportReport {
    /// The protocol ([`ExportProtocol`]): `nbd`, `iscsi` or `nvmf`.
    pub protocol: ExportProtocol,
    /// Where clients connect: `host:port` for TCP, or a Unix socket path.
    pub address: String,
    /// The export name clients ask for (NBD: the export name of `NBD_OPT_GO`).
    pub name: String,
}

/// What `Target::export_remove` (`export_remove`) did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportRemoveReport {
    /// The protocol removed.
    pub protocol: ExportProtocol,
    /// Its listen addresses and names as they were.
    pub exports: Vec<ExportReport>,
    /// Every connection finished and closed before the answer (false: still draining
    /// after `crate::target::DRAIN_WAIT`; the protocol can be added again once it has).
    pub drained: bool,
}

/// An export protocol. Serialized lower-case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExportProtocol {
    /// The Network Block Device protocol (fixed newstyle).
    Nbd,
    /// iSCSI (RFC 7143); the export name is the target IQN.
    Iscsi,
    /// NVMe/TCP (NVMe/TCP transport 1.0); the export name is the subsystem NQN.
    Nvmf,
}

impl fmt::Display for ExportProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExportProtocol::Nbd => "nbd",
            ExportProtocol::Iscsi => "iscsi",
            ExportProtocol::Nvmf => "nvmf",
        })
    }
}

/// The background process on the array (md's `sync_action` and progress).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessReport {
    /// `idle`, `resync`, `rebuild`, `check`, `repair` or `replace` ([`ProcessKind`]); the
    /// failed process's kind when `state` is `failed`.
    pub kind: ProcessKind,
    /// `running`, `idle` (nothing runs: none was started, or the last one finished or was
    /// stopped) or `failed` (the last one ended on an error: `error` says which)
    /// ([`ProcessRunState`]). Absent in reports of targets that predate it.
    #[serde(default)]
    pub state: ProcessRunState,
    /// How far it has come, bytes of array capacity (0 when idle).
    pub position_bytes: u64,
    /// How far it goes, bytes of array capacity (0 when idle).
    pub size_bytes: u64,
    /// Current speed, bytes of array capacity per second (0 when idle).
    pub rate_bytes_per_s: u64,
    /// Estimated seconds to completion at the current speed; `null` when idle or unknown.
    pub eta_s: Option<u64>,
    /// Sectors (512 bytes) found inconsistent by the last check or repair (md's
    /// `mismatch_cnt`); 0 when none ran.
    pub mismatch_cnt: u64,
    /// Why the process ended early, when `state` is `failed` (`null` otherwise).
    #[serde(default)]
    pub error: Option<String>,
    /// A RAID6 rebuild of one member on members that do not seek leaves the parity chunk
    /// it does not use unread, and once the rebuild proper is done (`position_bytes` ==
    /// `size_bytes`; the member is then in sync) reads those chunks so that an unreadable
    /// one is still found and rewritten: how far that verification has come, bytes of
    /// array capacity (0 when there is none).
    #[serde(default)]
    pub verify_position_bytes: u64,
    /// How far it goes, bytes of array capacity (0 when there is none).
    #[serde(default)]
    pub verify_size_bytes: u64,
}

/// Whether a background process runs. Serialized lower-case.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessRunState {
    /// Nothing runs.
    #[default]
    Idle,
    /// Working.
    Running,
    /// The last process ended on an error (a rebuild target or replacement failed, the
    /// array failed, a stripe could not be recovered): see `error`.
    Failed,
}

impl ProcessReport {
    /// Whether a rebuild is restoring a member: a rebuild past its own walk, verifying the
    /// parity it left unread, has its member in sync already.
    pub fn rebuilding(&self) -> bool {
        self.kind == ProcessKind::Rebuild && !self.verifying()
    }

    /// Whether a rebuild is in its verification walk (`verify_size_bytes` > 0 and its
    /// own walk done).
    pub fn verifying(&self) -> bool {
        self.kind == ProcessKind::Rebuild
            && self.verify_size_bytes > 0
            && self.position_bytes >= self.size_bytes
    }

    /// No background process.
    pub fn idle() -> ProcessReport {
        ProcessReport {
            kind: ProcessKind::Idle,
            state: ProcessRunState::Idle,
            position_bytes: 0,
            size_bytes: 0,
            rate_bytes_per_s: 0,
            eta_s: None,
            mismatch_cnt: 0,
            error: None,
            verify_position_bytes: 0,
            verify_size_bytes: 0,
        }
    }
}

impl Default for ProcessReport {
    fn default() -> Self {
        ProcessReport::idle()
    }
}

/// A background process kind (md's `sync_action`). Serialized lower-case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessKind {
    /// Nothing running.
    Idle,
    /// Making parity consistent (after creation or an unclean stop).
    Resync,
    /// Recovering a failed member's contents onto a spare.
    Rebuild,
    /// Scrub: reading everything and counting parity mismatches.
    Check,
    /// Scrub that also rewrites mismatched parity.
    Repair,
    /// Copying a member onto its replacement while it keeps serving (`ferroraid replace`).
    Replace,
}

impl fmt::Display for ProcessKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProcessKind::Idle => "idle",
            ProcessKind::Resync => "resync",
            ProcessKind::Rebuild => "rebuild",
            ProcessKind::Check => "check",
            ProcessKind::Repair => "repair",
            ProcessKind::Replace => "replace",
        })
    }
}

impl StatusReport {
    /// The exit status of `ferroraid status` for this report: [`EXIT_FAILED`] (2) when the
    /// array failed, [`EXIT_DEGRADED`] (1) when it is degraded or a rebuild runs, else
    /// [`EXIT_HEALTHY`] (0) — resync, check and repair leave it at 0, as
    /// `mdadm --detail --test` does.
    pub fn exit_code(&self) -> u8 {
        match self.array.state {
            ArrayState::Failed => EXIT_FAILED,
            ArrayState::Degraded => EXIT_DEGRADED,
            _ if self.process.rebuilding() => EXIT_DEGRADED,
            _ => EXIT_HEALTHY,
        }
    }

    /// The member a management request names: `selector` is a slot number (all digits:
    /// `"3"`) or a device path compared as given (`"/dev/nvme1n1"`; write `./3` for a file
    /// named `3`). Slots match members holding that slot; paths match any member or spare.
    pub fn find_member(&self, selector: &str) -> Option<&MemberReport> {
        match parse_slot(selector) {
            Some(slot) => self.members.iter().find(|m| m.slot == Some(slot)),
            None => self
                .members
                .iter()
                .find(|m| m.device.as_deref() == Some(selector)),
        }
    }
}

/// `selector` as a slot number when it is one (ASCII digits only, fits `u16`).
pub fn parse_slot(selector: &str) -> Option<u16> {
    if selector.is_empty() || !selector.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    selector.parse().ok()
}

/// `bytes` with a binary unit for people: `268435456` → `256.00 MiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}

/// A duration in seconds for people: `83` → `1m23s`, `7322` → `2h02m`.
fn human_secs(s: u64) -> String {
    if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    }
}

/// A chunk size as mdadm prints it (`64K`, `1024K`).
fn chunk_text(bytes: u64) -> String {
    if bytes.is_multiple_of(1024) {
        format!("{}K", bytes / 1024)
    } else {
        format!("{bytes} bytes")
    }
}

impl fmt::Display for StatusReport {
    /// A compact report in the manner of `mdadm --detail` and `/proc/mdstat`: the array's
    /// key lines, then one row per member with its I/O and latency.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = &self.array;
        let working = self
            .members
            .iter()
            .filter(|m| m.slot.is_some() && m.state == MemberState::Active)
            .count();
        let spares = self
            .members
            .iter()
            .filter(|m| m.state == MemberState::Spare)
            .count();
        writeln!(f, "{}:", a.name)?;
        writeln!(f, "     Array UUID : {}", a.array_uuid)?;
        writeln!(f, "     Raid Level : raid{}", a.level)?;
        writeln!(
            f,
            "     Array Size : {} bytes ({})",
            a.size_bytes,
            human_bytes(a.size_bytes)
        )?;
        writeln!(
            f,
            "   Raid Devices : {} ({working} working, {spares} spare{})",
            a.raid_devices,
            if spares == 1 { "" } else { "s" }
        )?;
        let state = match (self.process.kind, self.process.state) {
            (ProcessKind::Idle, _) => a.state.to_string(),
            (k, ProcessRunState::Failed) => format!("{}, {k} failed", a.state),
            // resyncing, rebuilding, checking, repairing, replacing (as /proc/mdstat
            // words them)
            (ProcessKind::Replace, _) => format!("{}, replacing", a.state),
            _ if self.process.verifying() => format!("{}, verifying parity", a.state),
            (k, _) => format!("{}, {k}ing", a.state),
        };
        writeln!(f, "          State : {state}")?;
        if !a.consistency_policy.is_empty() {
            writeln!(f, "Consistency Policy : {}", a.consistency_policy)?;
        }
        writeln!(f, "         Events : {}", a.events)?;
        writeln!(f, "         Layout : {}", a.layout)?;
        writeln!(f, "     Chunk Size : {}", chunk_text(a.chunk_bytes))?;
        let cores: Vec<String> = self
            .reactors
            .cores
            .iter()
            .map(|c| c.map_or_else(|| "-".to_string(), |c| c.to_string()))
            .collect();
        writeln!(
            f,
            "       Reactors : {} {} (cores {})",
            self.reactors.count,
            self.reactors.mode,
            if cores.is_empty() {
                "-".to_string()
            } else {
                cores.join(",")
            }
        )?;
        if !self.reactors.load.is_empty() {
            let busy: Vec<String> = self
                .reactors
                .load
                .iter()
                .map(|l| format!("{:.1} %", l.busy_percent()))
                .collect();
            let pieces: u64 = self.reactors.load.iter().map(|l| l.pieces_sent).sum();
            writeln!(
                f,
                "   Reactor Busy : {} (since start; {pieces} request pieces between reactors)",
                busy.join(", ")
            )?;
        }
        if self.writes_awaiting_record > 0 {
            writeln!(
                f,
                "      In Flight : {} requests ({} write pieces waiting for a member failure to be recorded)",
                self.requests_in_flight, self.writes_awaiting_record
            )?;
        } else {
            writeln!(f, "      In Flight : {} requests", self.requests_in_flight)?;
        }
        if self.exports.is_empty() {
            writeln!(f, "        Exports : none")?;
        }
        for (i, e) in self.exports.iter().enumerate() {
            let label = if i == 0 { "Exports" } else { "" };
            writeln!(
                f,
                "{label:>15} : {} {} (export name {:?})",
                e.protocol, e.address, e.name
            )?;
        }
        if let Some(n) = &self.nbd {
            writeln!(
                f,
                "    NBD clients : {} of {} connected, {} negotiating; refused {}, handshake \
                 timeouts {}, evicted {}, idle closed {}",
                n.connections,
                n.max_connections,
                n.handshakes,
                n.refused,
                n.handshake_timeouts,
                n.handshakes_evicted,
                n.idle_closed
            )?;
        }
        if let Some(n) = &self.nvmf {
            for c in &n.controllers {
                let (r, w, e) = c.queues.iter().fold((0, 0, 0), |(r, w, e), q| {
                    (r + q.reads, w + q.writes, e + q.errors)
                });
                writeln!(
                    f,
                    "   NVMe/TCP ctl : {} ({}) host {}: {} I/O queues, {} reads, {} writes, {} errors",
                    c.cntlid,
                    c.kind,
                    c.hostnqn,
                    c.queues.len(),
                    r,
                    w,
                    e
                )?;
            }
        }
        let p = &self.process;
        if p.kind == ProcessKind::Idle {
            writeln!(f, "        Process : idle")?;
        } else if p.state == ProcessRunState::Failed {
            writeln!(
                f,
                "        Process : {} failed at {} of {}: {}",
                p.kind,
                human_bytes(p.position_bytes),
                human_bytes(p.size_bytes),
                p.error.as_deref().unwrap_or("unknown error")
            )?;
        } else {
            let pct = if p.size_bytes == 0 {
                0.0
            } else {
                p.position_bytes as f64 * 100.0 / p.size_bytes as f64
            };
            if p.verifying() {
                writeln!(
                    f,
                    "        Process : {} done; verifying the parity it did not read, {:.1}% ({} of {})",
                    p.kind,
                    p.verify_position_bytes as f64 * 100.0 / p.verify_size_bytes as f64,
                    human_bytes(p.verify_position_bytes),
                    human_bytes(p.verify_size_bytes),
                )?;
            } else {
                writeln!(
                    f,
                    "        Process : {} {pct:.1}% ({} of {}) at {}/s, eta {}",
                    p.kind,
                    human_bytes(p.position_bytes),
                    human_bytes(p.size_bytes),
                    human_bytes(p.rate_bytes_per_s),
                    p.eta_s.map_or_else(|| "unknown".to_string(), human_secs)
                )?;
            }
        }
        if matches!(p.kind, ProcessKind::Check | ProcessKind::Repair) || p.mismatch_cnt > 0 {
            writeln!(f, "   Mismatch Cnt : {}", p.mismatch_cnt)?;
        }
        if let Some(b) = &self.bitmap {
            writeln!(
                f,
                "         Bitmap : {} of {} regions dirty, {} chunks, events_cleared {}{}",
                b.dirty_regions,
                b.regions,
                chunk_text(b.chunk_bytes),
                b.events_cleared,
                if b.clearing {
                    ""
                } else {
                    " (kept: a member is missing or recovering)"
                }
            )?;
        }
        writeln!(f)?;
        let dev_w = self
            .members
            .iter()
            .map(|m| m.device.as_deref().map_or(1, str::len))
            .max()
            .unwrap_or(0)
            .max("Device".len());
        writeln!(
            f,
            "  {:>4}  {:<7}  {:<dev_w$}  {:>10}  {:>10}  {:>6}  {:>9}  {:>9}  {:>9}",
            "Slot", "State", "Device", "Reads", "Writes", "Errors", "p50 us", "p99 us", "max us"
        )?;
        for m in &self.members {
            let slot = m.slot.map_or_else(|| "-".to_string(), |s| s.to_string());
            let dev = m.device.as_deref().unwrap_or("-");
            let l = &m.latency_us;
            writeln!(
                f,
                "  {slot:>4}  {:<7}  {dev:<dev_w$}  {:>10}  {:>10}  {:>6}  {:>9.1}  {:>9.1}  {:>9.1}",
                m.state.as_str(),
                m.io.reads,
                m.io.writes,
                m.io.errors,
                l.p50,
                l.p99,
                l.max
            )?;
        }
        let s = &self.stats;
        writeln!(f)?;
        writeln!(
            f,
            "  reads: {} direct, {} degraded ({} direct on the fast path) · writes: {} full-stripe, {} rmw, {} rcw, {} degraded",
            s.direct_reads,
            s.degraded_reads,
            s.fast_reads,
            s.full_stripe_writes,
            s.rmw_writes,
            s.rcw_writes,
            s.degraded_writes
        )?;
        writeln!(
            f,
            "  errors: {} member failures, {} timeouts, {} medium errors ({} repaired) · \
             {} zeroed, {} discarded, {} discards skipped, {} reading as zeroes now (stripes)",
            s.member_failures,
            s.timeouts,
            s.medium_errors,
            s.read_errors_repaired,
            s.zeroed_stripes,
            s.discarded_stripes,
            s.discards_skipped,
            s.zero_stripes
        )?;
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        writeln!(
            f,
            "  write passes: {} ({:.1} writes each), {} held ({:.0} µs on average, {} to the \
             bound) · stripe cache: {} hits, {} bytes not read, {} random writes admitted, {} \
             reads served · \
             {:.2} bytes read per byte written · {} chunks written gathered",
            s.write_passes,
            ratio(s.batched_writes, s.write_passes),
            s.held_passes,
            ratio(s.held_us, s.held_passes),
            s.expired_holds,
            s.cache_hit_stripes,
            s.cache_hit_bytes,
            s.cache_admitted_writes,
            s.cache_reads,
            ratio(s.write_read_bytes, s.pass_written_bytes),
            s.gathered_writes
        )?;
        let q = &self.queue_wait_us;
        let wait = |l: &LatencyReport| {
            format!(
                "{} ({:.0} / {:.0} / {:.0} / {:.0})",
                l.count, l.p50, l.p99, l.p999, l.max
            )
        };
        writeln!(
            f,
            "  queue wait inside the target, requests (p50 / p99 / p99.9 / max µs): small \
             reads {} · bulk writes {} · other {} · {} went ahead of queued bulk writes · {} \
             reads served from the write holding their stripe · bulk share {} of {} stripe \
             operations ({} cuts, {} raises)",
            wait(&q.small_read),
            wait(&q.bulk_write),
            wait(&q.other),
            s.overtaking_requests,
            s.pass_reads,
            s.bulk_share_ops,
            s.bulk_share_pool,
            s.bulk_share_cuts,
            s.bulk_share_raises
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A RAID6 report with `faulty` members failed.
    pub(crate) fn sample(faulty: &[u16]) -> StatusReport {
        let members: Vec<MemberReport> = (0..6u16)
            .map(|s| {
                let state = if faulty.contains(&s) {
                    MemberState::Faulty
                } else {
                    MemberState::Active
                };
                MemberReport::idle(Some(s), Some(format!("/dev/m{s}")), state)
            })
            .collect();
        let working = members
            .iter()
            .filter(|m| m.state == MemberState::Active)
            .count() as u16;
        StatusReport {
            array: ArrayInfo {
                name: "host:data".into(),
                array_uuid: "e6c2614f:6ebd4c6b:5055bf86:866fae7b".into(),
                level: 6,
                layout: "left-symmetric".into(),
                chunk_bytes: 65536,
                raid_devices: 6,
                size_bytes: 256 << 20,
                state: ArrayState::derive(6, 2, working, true),
                events: 3,
                consistency_policy: "bitmap".to_string(),
            },
            members,
            reactors: ReactorsReport {
                count: 2,
                cores: vec![Some(0), None],
                mode: ReactorMode::Adaptive,
                load: vec![
                    ReactorLoadReport {
                        turns: 1000,
                        busy_s: 1.0,
                        idle_s: 3.0,
                        pieces_sent: 7,
                        pieces_received: 5,
                    },
                    ReactorLoadReport {
                        turns: 900,
                        busy_s: 0.5,
                        idle_s: 3.5,
                        pieces_sent: 5,
                        pieces_received: 7,
                    },
                ],
            },
            stats: StatsReport::default(),
            requests_in_flight: 0,
            writes_awaiting_record: 0,
            exports: vec![ExportReport {
                protocol: ExportProtocol::Nbd,
                address: "127.0.0.1:10809".into(),
                name: "data".into(),
            }],
            process: ProcessReport::idle(),
            bitmap: None,
            queue_wait_us: QueueWaitReport::default(),
            nbd: Some(NbdReport {
                connections: 3,
                max_connections: 1024,
                refused: 2,
                ..NbdReport::default()
            }),
            nvmf: None,
        }
    }

    #[test]
    fn array_state_rules() {
        assert_eq!(ArrayState::derive(6, 2, 6, true), ArrayState::Clean);
        assert_eq!(ArrayState::derive(6, 2, 6, false), ArrayState::Active);
        assert_eq!(ArrayState::derive(6, 2, 5, false), ArrayState::Degraded);
        assert_eq!(ArrayState::derive(6, 2, 4, true), ArrayState::Degraded);
        assert_eq!(ArrayState::derive(6, 2, 3, true), ArrayState::Failed);
        assert_eq!(ArrayState::derive(4, 1, 2, true), ArrayState::Failed);
        assert_eq!(ArrayState::derive(4, 1, 0, true), ArrayState::Failed);
    }

    #[test]
    fn exit_codes() {
        assert_eq!(sample(&[]).exit_code(), EXIT_HEALTHY);
        assert_eq!(sample(&[1]).exit_code(), EXIT_DEGRADED);
        assert_eq!(sample(&[1, 4]).exit_code(), EXIT_DEGRADED);
        assert_eq!(sample(&[0, 1, 4]).exit_code(), EXIT_FAILED);
        let mut r = sample(&[]);
        r.process.kind = ProcessKind::Rebuild;
        assert_eq!(r.exit_code(), EXIT_DEGRADED);
        // Past its own walk, verifying the parity it left unread: the member is in sync.
        r.process.size_bytes = 1 << 20;
        r.process.position_bytes = 1 << 20;
        r.process.verify_size_bytes = 1 << 20;
        assert_eq!(r.exit_code(), EXIT_HEALTHY);
        assert!(
            r.to_string()
                .contains("          State : clean, verifying parity\n"),
            "{r}"
        );
        r.process.position_bytes = 1 << 19;
        assert_eq!(r.exit_code(), EXIT_DEGRADED);
        r.process.kind = ProcessKind::Resync;
        assert_eq!(r.exit_code(), EXIT_HEALTHY);
    }

    #[test]
    fn latency_converts_ns_to_us() {
        let mut h = engine::array::new_latency_histogram();
        assert_eq!(MemberReport::latency_from(&h), LatencyReport::default());
        for ns in 1..=1000u64 {
            h.record(ns * 1000).unwrap(); // 1 µs .. 1 ms
        }
        let l = MemberReport::latency_from(&h);
        assert_eq!(l.count, 1000);
        // Two significant digits: within 1% of the exact value.
        let near = |got: f64, want: f64| (got - want).abs() <= want * 0.01;
        assert!(near(l.p50, 500.0), "{l:?}");
        assert!(near(l.p90, 900.0), "{l:?}");
        assert!(near(l.p99, 990.0), "{l:?}");
        assert!(near(l.p999, 999.0), "{l:?}");
        assert!(near(l.max, 1000.0), "{l:?}");
    }

    #[test]
    fn member_qos_comes_from_the_snapshot_and_old_reports_still_parse() {
        let snap = MemberSnapshot {
            state: engine::array::MemberState::Online,
            counters: MemberCounters::default(),
            latency: engine::array::new_latency_histogram(),
            qos: engine::qos::QosState {
                policy: engine::qos::DepthPolicy::Ferroraid,
                depth_limit: 31,
                scale_step: 6,
                target_latency_us: 151.5,
                read_p50_us: 121.0,
                read_p99_us: 124.0,
                read_min_us: 120.5,
                changes: 9,
            },
        };
        let m = MemberReport::from_snapshot(0, Some("/dev/x".into()), &snap);
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(v["qos"]["policy"], "ferroraid");
        assert_eq!(v["qos"]["depth_limit"], 31);
        assert_eq!(v["qos"]["scale_step"], 6);
        assert_eq!(v["qos"]["read_p99_us"], 124.0);
        // Before the reactors' first publication: no controller reported (it read as
        // "ferroraid" with depth 0 for an array whose qos is off).
        let fresh = MemberSnapshot {
            qos: engine::qos::QosState::default(),
            ..snap.clone()
        };
        let m = MemberReport::from_snapshot(0, Some("/dev/x".into()), &fresh);
        assert_eq!(m.qos, QosReport::default());
        assert_eq!(m.qos.policy, "");
        // A report without `qos` (an older target) parses, with zeroes.
        let mut old = v.clone();
        old.as_object_mut().unwrap().remove("qos");
        let back: MemberReport = serde_json::from_value(old).unwrap();
        assert_eq!(back.qos, QosReport::default());
    }

    /// Scripts read these names: changing one is a breaking change.
    #[test]
    fn json_field_names_are_stable() {
        let v = serde_json::to_value(sample(&[2])).unwrap();
        let keys = |v: &serde_json::Value| {
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k.join(",")
        };
        assert_eq!(
            keys(&v),
            "array,bitmap,exports,members,nbd,nvmf,process,queue_wait_us,reactors,requests_in_flight,stats,writes_awaiting_record"
        );
        let mut with_nvmf = sample(&[2]);
        with_nvmf.nvmf = Some(NvmfReport {
            controllers: vec![NvmfControllerReport {
                cntlid: 1,
                kind: "io".into(),
                hostnqn: "nqn.x".into(),
                queues: vec![NvmfQueueReport {
                    qid: 1,
                    ..NvmfQueueReport::default()
                }],
            }],
        });
        let n = serde_json::to_value(&with_nvmf).unwrap();
        assert_eq!(
            keys(&n["nvmf"]["controllers"][0]),
            "cntlid,hostnqn,kind,queues"
        );
        assert_eq!(
            keys(&n["nvmf"]["controllers"][0]["queues"][0]),
            "bytes_read,bytes_written,errors,qid,reads,writes"
        );
        assert!(with_nvmf
            .to_string()
            .contains("NVMe/TCP ctl : 1 (io) host nqn.x: 1 I/O queues"));
        assert_eq!(
            keys(&v["nbd"]),
            "connections,handshake_timeouts,handshakes,handshakes_evicted,idle_closed,max_connections,refused"
        );
        assert_eq!(
            keys(&v["array"]),
            "array_uuid,chunk_bytes,consistency_policy,events,layout,level,name,raid_devices,size_bytes,state"
        );
        assert_eq!(
            keys(&v["members"][0]),
            "device,io,latency_us,qos,slot,state"
        );
        assert_eq!(
            keys(&v["members"][0]["qos"]),
            "depth_limit,policy,read_min_us,read_p50_us,read_p99_us,scale_step,target_latency_us"
        );
        assert_eq!(
            keys(&v["members"][0]["io"]),
            "errors,flushes,read_bytes,reads,write_bytes,writes"
        );
        assert_eq!(
            keys(&v["members"][0]["latency_us"]),
            "count,max,p50,p90,p99,p999"
        );
        assert_eq!(keys(&v["reactors"]), "cores,count,load,mode");
        assert_eq!(
            keys(&v["reactors"]["load"][0]),
            "busy_s,idle_s,pieces_received,pieces_sent,turns"
        );
        assert_eq!(keys(&v["queue_wait_us"]), "bulk_write,other,small_read");
        assert_eq!(
            keys(&v["queue_wait_us"]["small_read"]),
            "count,max,p50,p90,p99,p999"
        );
        assert_eq!(
            keys(&v["stats"]),
            "batched_writes,bulk_share_cuts,bulk_share_ops,bulk_share_pool,bulk_share_raises,\
             cache_admitted_writes,cache_hit_bytes,cache_hit_stripes,cache_reads,degraded_reads,degraded_writes,\
             direct_reads,discarded_stripes,discards_skipped,expired_holds,fast_reads,full_stripe_writes,\
             gathered_writes,held_passes,held_us,medium_errors,member_failures,overtaking_requests,pass_reads,\
             pass_written_bytes,ppl_bytes,ppl_records,rcw_writes,\
             read_errors_repaired,rmw_writes,timeouts,write_passes,write_read_bytes,\
             zero_stripes,zeroed_stripes"
        );
        assert_eq!(keys(&v["exports"][0]), "address,name,protocol");
        assert_eq!(
            keys(&v["process"]),
            "error,eta_s,kind,mismatch_cnt,position_bytes,rate_bytes_per_s,size_bytes,state,\
             verify_position_bytes,verify_size_bytes"
        );
        assert_eq!(v["process"]["state"], "idle");
        assert_eq!(v["bitmap"], serde_json::Value::Null);
        let mut with_bitmap = sample(&[]);
        with_bitmap.bitmap = Some(BitmapReport {
            chunk_bytes: 64 << 20,
            regions: 120,
            dirty_regions: 3,
            events_cleared: 5,
            clearing: true,
        });
        let b = serde_json::to_value(&with_bitmap).unwrap();
        assert_eq!(
            keys(&b["bitmap"]),
            "chunk_bytes,clearing,dirty_regions,events_cleared,regions"
        );
        assert!(with_bitmap.to_string().contains(
            "         Bitmap : 3 of 120 regions dirty, 65536K chunks, events_cleared 5\n"
        ));
        // Reports of older targets (no bitmap, no process state) still parse.
        let mut old = b.clone();
        old.as_object_mut().unwrap().remove("bitmap");
        old["process"].as_object_mut().unwrap().remove("state");
        old["process"].as_object_mut().unwrap().remove("error");
        let back: StatusReport = serde_json::from_value(old).unwrap();
        assert_eq!(back.bitmap, None);
        assert_eq!(back.process, ProcessReport::idle());
        // A failed process says so.
        let mut failed = sample(&[]);
        failed.process = ProcessReport {
            kind: ProcessKind::Rebuild,
            state: ProcessRunState::Failed,
            error: Some("rebuild target member 3 failed".into()),
            size_bytes: 1 << 20,
            ..ProcessReport::idle()
        };
        let f = serde_json::to_value(&failed).unwrap();
        assert_eq!(f["process"]["state"], "failed");
        assert_eq!(f["process"]["error"], "rebuild target member 3 failed");
        assert!(failed.to_string().contains(
            "        Process : rebuild failed at 0 B of 1.00 MiB: rebuild target member 3 failed\n"
        ));
        // A rebuild past its own walk, verifying the parity it left unread; older
        // reports without those fields parse as no verification.
        let mut verifying = sample(&[]);
        verifying.process = ProcessReport {
            kind: ProcessKind::Rebuild,
            state: ProcessRunState::Running,
            position_bytes: 1 << 20,
            size_bytes: 1 << 20,
            verify_position_bytes: 1 << 18,
            verify_size_bytes: 1 << 20,
            ..ProcessReport::idle()
        };
        assert!(verifying.to_string().contains(
            "        Process : rebuild done; verifying the parity it did not read, 25.0% (256.00 KiB of 1.00 MiB)\n"
        ), "{verifying}");
        let mut old = serde_json::to_value(&verifying).unwrap();
        assert_eq!(old["process"]["verify_size_bytes"], 1 << 20);
        old["process"]
            .as_object_mut()
            .unwrap()
            .remove("verify_position_bytes");
        old["process"]
            .as_object_mut()
            .unwrap()
            .remove("verify_size_bytes");
        let back: StatusReport = serde_json::from_value(old).unwrap();
        assert_eq!(
            (
                back.process.verify_position_bytes,
                back.process.verify_size_bytes
            ),
            (0, 0)
        );
        assert_eq!(v["array"]["state"], "degraded");
        assert_eq!(v["members"][2]["state"], "faulty");
        assert_eq!(v["reactors"]["mode"], "adaptive");
        assert_eq!(v["reactors"]["cores"], serde_json::json!([0, null]));
        assert_eq!(v["exports"][0]["protocol"], "nbd");
        assert_eq!(v["process"]["kind"], "idle");
        // And back.
        let back: StatusReport = serde_json::from_value(v).unwrap();
        assert_eq!(back, sample(&[2]));
    }

    #[test]
    fn display_is_a_compact_table() {
        let mut r = sample(&[2]);
        r.members.push(MemberReport::idle(
            None,
            Some("/dev/spare0".into()),
            MemberState::Spare,
        ));
        r.process = ProcessReport {
            kind: ProcessKind::Rebuild,
            position_bytes: 64 << 20,
            size_bytes: 256 << 20,
            rate_bytes_per_s: 100 << 20,
            eta_s: Some(83),
            mismatch_cnt: 0,
            ..ProcessReport::idle()
        };
        let text = r.to_string();
        assert!(text.starts_with("host:data:\n"), "{text}");
        assert!(text.contains("     Raid Level : raid6\n"), "{text}");
        assert!(
            text.contains("   Raid Devices : 6 (5 working, 1 spare)\n"),
            "{text}"
        );
        assert!(
            text.contains("          State : degraded, rebuilding\n"),
            "{text}"
        );
        assert!(text.contains("     Chunk Size : 64K\n"), "{text}");
        assert!(
            text.contains("       Reactors : 2 adaptive (cores 0,-)\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "   Reactor Busy : 25.0 %, 12.5 % (since start; 12 request pieces between reactors)\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("        Exports : nbd 127.0.0.1:10809 (export name \"data\")"),
            "{text}"
        );
        assert!(
            text.contains("    NBD clients : 3 of 1024 connected, 0 negotiating; refused 2,"),
            "{text}"
        );
        assert!(
            text.contains("rebuild 25.0% (64.00 MiB of 256.00 MiB) at 100.00 MiB/s, eta 1m23s"),
            "{text}"
        );
        let rows: Vec<&str> = text.lines().filter(|l| l.contains("/dev/")).collect();
        assert_eq!(rows.len(), 7, "{text}");
        assert!(
            rows[2].trim_start().starts_with("2  faulty   /dev/m2"),
            "{text}"
        );
        assert!(
            rows[6].trim_start().starts_with("-  spare    /dev/spare0"),
            "{text}"
        );
        assert!(text.contains("      In Flight : 0 requests\n"), "{text}");
        r.requests_in_flight = 3;
        r.writes_awaiting_record = 2;
        let text = r.to_string();
        assert!(
            text.contains(
                "      In Flight : 3 requests (2 write pieces waiting for a member failure to be recorded)\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn find_member_by_slot_or_path() {
        let r = sample(&[]);
        assert_eq!(r.find_member("3").unwrap().slot, Some(3));
        assert_eq!(r.find_member("/dev/m4").unwrap().slot, Some(4));
        assert!(r.find_member("/dev/m9").is_none());
        assert!(r.find_member("9").is_none());
        assert!(r.find_member("").is_none());
        assert_eq!(parse_slot("007"), Some(7));
        assert_eq!(parse_slot("70000"), None);
        assert_eq!(parse_slot("+1"), None);
        assert_eq!(parse_slot("./3"), None);
    }

    #[test]
    fn human_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(256 << 20), "256.00 MiB");
        assert_eq!(human_bytes(u64::MAX), "16.00 EiB");
        assert_eq!(human_secs(5), "5s");
        assert_eq!(human_secs(83), "1m23s");
        assert_eq!(human_secs(7322), "2h02m");
        assert_eq!(chunk_text(65536), "64K");
    }
}
