//! The metrics endpoint (`serve --metrics HOST:PORT`): Prometheus text (exposition format
//! 0.0.4) or OpenMetrics 1.0 text, chosen by the scraper's `Accept` header, served on
//! `GET /metrics` by a management thread of its own — never by a reactor. A scrape takes
//! the reactors' last published statistics ([`engine::reactor::ReactorHandle::snapshot`],
//! at most `PUBLISH_INTERVAL` old) and the same [`StatusReport`] `ferroraid status` shows;
//! encoding is the `prometheus-client` crate's, HTTP the `tiny_http` crate's.
//!
//! Names follow the Prometheus conventions (`ferroraid_` prefix, base units, counters end
//! in `_total`, `_bytes`/`_seconds` units). Every metric of the array carries the label
//! `array` (its name); member metrics add `slot` (the role, 0-based) and `device` (the
//! path, empty for a missing slot); reactor metrics add `reactor` and `core` (empty when
//! not pinned). The catalogue with meanings is in docs/MANAGEMENT.md ("Metrics").
//!
//! Latency histograms are the engine's HDR histograms (ns, 2 significant digits) put into
//! fixed buckets ([`LATENCY_BUCKETS_S`]); their `_sum` uses each recorded value's HDR
//! equivalent, so it is exact to the histogram's precision (≤ 1 %).

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use engine::reactor::{ArraySnapshot, ReactorLoad};
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use tracing::debug;

use crate::status::{ArrayState, MemberState, ProcessKind, ProcessRunState, StatusReport};

/// Upper bounds of the latency histograms' buckets, **seconds** (10 µs .. 10 s, 1-2.5-5
/// steps); a `+Inf` bucket follows.
pub const LATENCY_BUCKETS_S: [f64; 19] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// What one scrape reads: the status report and the snapshot it was made from (for the
/// raw histograms the report only summarizes), and each reactor's loop counters.
#[derive(Clone, Debug)]
pub struct Scrape {
    /// As `ferroraid status --json` reports it.
    pub status: StatusReport,
    /// The reactors' merged statistics the report was made from.
    pub snapshot: ArraySnapshot,
    /// Each reactor's loop counters, in reactor order.
    pub reactor_loads: Vec<ReactorLoad>,
}

/// Where a scrape comes from (the running target).
pub trait MetricsSource: Send + Sync + 'static {
    /// The current figures; `None` while the array is still being assembled (the scrape
    /// is then answered 503).
    fn scrape(&self) -> Option<Scrape>;
}

/// The content type of OpenMetrics 1.0 text.
const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Renders a scrape: OpenMetrics 1.0 text (ends with `# EOF`) when `openmetrics`, else the
/// Prometheus text exposition format 0.0.4.
pub fn render(scrape: Scrape, openmetrics: bool) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(ScrapeCollector(scrape)));
    let mut out = String::with_capacity(32 << 10);
    let encoded = if openmetrics {
        prometheus_client::encoding::text::encode(&mut out, &registry)
    } else {
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
    };
    // Writing into a String cannot fail; an encoder error would be a bug of ours (a
    // duplicate or malformed name), caught by the tests.
    debug_assert!(encoded.is_ok(), "encoding metrics: {encoded:?}");
    out
}

/// The HTTP endpoint: one thread answering `GET /metrics` (and `/`, with a pointer), 404
/// for other paths, 405 for other methods.
pub struct MetricsServer {
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (port 0 picks a free port: see [`Self::local_addr`]) and serves
    /// scrapes of `source` from a thread named `metrics`.
    ///
    /// # Errors
    /// The address cannot be bound (in use, not local, no permission), or the thread
    /// cannot be started.
    pub fn bind(addr: SocketAddr, source: Arc<dyn MetricsSource>) -> anyhow::Result<Self> {
        let server = tiny_http::Server::http(addr)
            .map_err(|e| anyhow::anyhow!("binding the metrics endpoint {addr}: {e}"))?;
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| anyhow::anyhow!("the metrics endpoint {addr} is not an IP socket"))?;
        let server = Arc::new(server);
        let thread = {
            let server = Arc::clone(&server);
            std::thread::Builder::new()
                .name("metrics".into())
                .spawn(move || {
                    for request in server.incoming_requests() {
                        answer(request, source.as_ref());
                    }
                })?
        };
        Ok(MetricsServer {
            server,
            addr,
            thread: Some(thread),
        })
    }

    /// The address the endpoint listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops answering and joins the thread.
    pub fn shutdown(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn answer(request: tiny_http::Request, source: &dyn MetricsSource) {
    use tiny_http::{Header, Method, Response};
    let header = |v: &str| Header::from_bytes("Content-Type", v).expect("a valid header");
    let path = request.url().split('?').next().unwrap_or("");
    let respond = |request: tiny_http::Request, r: Response<std::io::Cursor<Vec<u8>>>| {
        if let Err(e) = request.respond(r) {
            debug!("metrics: answering a scrape: {e}");
        }
    };
    if !matches!(request.method(), Method::Get | Method::Head) {
        let r = Response::from_string("only GET and HEAD\n")
            .with_status_code(405)
            .with_header(Header::from_bytes("Allow", "GET, HEAD").expect("a valid header"));
        return respond(request, r);
    }
    match path {
        "/metrics" => {}
        "/" => {
            let r = Response::from_string("ferroraid metrics: GET /metrics\n")
                .with_header(header("text/plain; charset=utf-8"));
            return respond(request, r);
        }
        _ => {
            return respond(
                request,
                Response::from_string("not found: try /metrics\n").with_status_code(404),
            )
        }
    }
    let openmetrics = request.headers().iter().any(|h| {
        h.field.equiv("Accept") && h.value.as_str().contains("application/openmetrics-text")
    });
    let Some(scrape) = source.scrape() else {
        let r = Response::from_string("the array is still starting\n").with_status_code(503);
        return respond(request, r);
    };
    let body = render(scrape, openmetrics);
    let content_type = if openmetrics {
        OPENMETRICS_CONTENT_TYPE
    } else {
        prometheus_client::encoding::prometheus_text::CONTENT_TYPE
    };
    respond(
        request,
        Response::from_string(body).with_header(header(content_type)),
    );
}

/// One scrape as a `prometheus-client` collector.
struct ScrapeCollector(Scrape);

impl fmt::Debug for ScrapeCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScrapeCollector")
            .field("array", &self.0.status.array.name)
            .finish_non_exhaustive()
    }
}

type Labels = Vec<(&'static str, String)>;

/// Writes metric families through one descriptor encoder.
struct Families<'a> {
    enc: DescriptorEncoder<'a>,
    array: String,
}

impl Families<'_> {
    fn array_labels(&self) -> Labels {
        vec![("array", self.array.clone())]
    }

    fn with(&self, extra: &[(&'static str, String)]) -> Labels {
        let mut l = self.array_labels();
        l.extend(extra.iter().cloned());
        l
    }

    /// A counter or gauge family: one sample per row.
    fn scalars(
        &mut self,
        ty: MetricType,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        rows: &[(Labels, f64)],
    ) -> fmt::Result {
        debug_assert!(matches!(ty, MetricType::Counter | MetricType::Gauge));
        let mut m = self.enc.encode_descriptor(name, help, unit.as_ref(), ty)?;
        for (labels, v) in rows {
            let mut e = m.encode_family(labels)?;
            match ty {
                MetricType::Counter => e.encode_counter::<NoLabelSet, f64, f64>(v, None)?,
                _ => e.encode_gauge(v)?,
            }
        }
        Ok(())
    }

    /// One array-labelled counter.
    fn array_counter(&mut self, name: &str, help: &str, unit: Option<Unit>, v: f64) -> fmt::Result {
        let l = self.array_labels();
        self.scalars(MetricType::Counter, name, help, unit, &[(l, v)])
    }

    /// One array-labelled gauge.
    fn array_gauge(&mut self, name: &str, help: &str, unit: Option<Unit>, v: f64) -> fmt::Result {
        let l = self.array_labels();
        self.scalars(MetricType::Gauge, name, help, unit, &[(l, v)])
    }

    /// Histograms (seconds) from HDR histograms recorded in ns.
    fn histograms(
        &mut self,
        name: &str,
        help: &str,
        rows: &[(Labels, &hdrhistogram::Histogram<u64>)],
    ) -> fmt::Result {
        let mut m =
            self.enc
                .encode_descriptor(name, help, Some(&Unit::Seconds), MetricType::Histogram)?;
        for (labels, h) in rows {
            let (sum, count, buckets) = buckets_of(h);
            m.encode_family(labels)?
                .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        }
        Ok(())
    }
}

/// `(sum seconds, count, per-bucket counts)` of an HDR histogram recorded in ns, in the
/// buckets of [`LATENCY_BUCKETS_S`] and `+Inf` (counts per bucket, not cumulative: the
/// encoder accumulates).
fn buckets_of(h: &hdrhistogram::Histogram<u64>) -> (f64, u64, Vec<(f64, u64)>) {
    let mut buckets: Vec<(f64, u64)> = LATENCY_BUCKETS_S
        .iter()
        .map(|&b| (b, 0))
        .chain(std::iter::once((f64::INFINITY, 0)))
        .collect();
    let mut sum = 0.0;
    let mut count = 0;
    for v in h.iter_recorded() {
        let n = v.count_at_value();
        let s = h.highest_equivalent(v.value_iterated_to()) as f64 / 1e9;
        sum += s * n as f64;
        count += n;
        let i = buckets
            .iter()
            .position(|&(b, _)| s <= b)
            .unwrap_or(buckets.len() - 1);
        buckets[i].1 += n;
    }
    (sum, count, buckets)
}

impl prometheus_client::collector::Collector for ScrapeCollector {
    fn encode(&self, enc: DescriptorEncoder) -> fmt::Result {
        let mut f = Families {
            enc,
            array: self.0.status.array.name.clone(),
        };
        encode_array(&mut f, &self.0)?;
        encode_members(&mut f, &self.0)?;
        encode_reactors(&mut f, &self.0)
    }
}

fn encode_array(f: &mut Families<'_>, s: &Scrape) -> fmt::Result {
    let st = &s.status;
    let a = &st.array;
    let info = f.with(&[
        ("uuid", a.array_uuid.clone()),
        ("level", format!("raid{}", a.level)),
        ("layout", a.layout.clone()),
        ("consistency_policy", a.consistency_policy.clone()),
    ]);
    f.scalars(
        MetricType::Gauge,
        "ferroraid_array_info",
        "The array's identity (always 1): md UUID, level, layout, consistency policy.",
        None,
        &[(info, 1.0)],
    )?;
    let states: Vec<(Labels, f64)> = [
        ArrayState::Clean,
        ArrayState::Active,
        ArrayState::Degraded,
        ArrayState::Failed,
    ]
    .iter()
    .map(|&x| {
        (
            f.with(&[("state", x.as_str().to_string())]),
            f64::from(u8::from(a.state == x)),
        )
    })
    .collect();
    f.scalars(
        MetricType::Gauge,
        "ferroraid_array_state",
        "1 for the array's current state (clean, active, degraded, failed), 0 for the others.",
        None,
        &states,
    )?;
    f.array_gauge(
        "ferroraid_array_size",
        "Capacity exported to clients.",
        Some(Unit::Bytes),
        a.size_bytes as f64,
    )?;
    f.array_gauge(
        "ferroraid_array_chunk_size",
        "Chunk size.",
        Some(Unit::Bytes),
        a.chunk_bytes as f64,
    )?;
    f.array_gauge(
        "ferroraid_array_raid_devices",
        "Members of the complete array (md's raid_disks).",
        None,
        f64::from(a.raid_devices),
    )?;
    let working = st
        .members
        .iter()
        .filter(|m| m.slot.is_some() && m.state == MemberState::Active)
        .count();
    f.array_gauge(
        "ferroraid_array_working_devices",
        "Members active now.",
        None,
        working as f64,
    )?;
    f.array_gauge(
        "ferroraid_array_superblock_events",
        "The superblock generation (md's events).",
        None,
        a.events as f64,
    )?;
    f.array_gauge(
        "ferroraid_array_requests_in_flight",
        "Array requests accepted and not yet completed, all reactors.",
        None,
        st.requests_in_flight as f64,
    )?;
    let x = &st.stats;
    let reads: Vec<(Labels, f64)> = [("direct", x.direct_reads), ("degraded", x.degraded_reads)]
        .iter()
        .map(|&(p, v)| (f.with(&[("path", p.to_string())]), v as f64))
        .collect();
    f.scalars(
        MetricType::Counter,
        "ferroraid_array_stripe_reads",
        "Stripe reads by path: direct (from the members) or degraded (rebuilt from parity).",
        None,
        &reads,
    )?;
    let writes: Vec<(Labels, f64)> = [
        ("full_stripe", x.full_stripe_writes),
        ("rmw", x.rmw_writes),
        ("rcw", x.rcw_writes),
        ("degraded", x.degraded_writes),
    ]
    .iter()
    .map(|&(p, v)| (f.with(&[("path", p.to_string())]), v as f64))
    .collect();
    f.scalars(
        MetricType::Counter,
        "ferroraid_array_stripe_writes",
        "Stripe writes and write passes by path: full_stripe (no reads), rmw \
         (read-modify-write), rcw (reconstruct-write), degraded.",
        None,
        &writes,
    )?;
    let counters: [(&str, &str, Option<Unit>, f64); 18] = [
        ("ferroraid_array_member_failures", "Members failed by I/O errors, timeouts or disappearance.", None, x.member_failures as f64),
        ("ferroraid_array_medium_errors", "Unrecovered read errors absorbed by rebuilding the range from redundancy.", None, x.medium_errors as f64),
        ("ferroraid_array_read_errors_repaired", "Ranges rewritten after being rebuilt from redundancy.", None, x.read_errors_repaired as f64),
        ("ferroraid_array_zeroed_stripes", "Whole stripes zeroed with member write-zeroes.", None, x.zeroed_stripes as f64),
        ("ferroraid_array_discarded_stripes", "Whole stripes deallocated with member discards.", None, x.discarded_stripes as f64),
        ("ferroraid_array_member_timeouts", "Member requests that outlived the command timeout.", None, x.timeouts as f64),
        ("ferroraid_array_write_passes", "Write passes on healthy stripes (one plan, one parity computation, one set of member I/Os).", None, x.write_passes as f64),
        ("ferroraid_array_batched_writes", "Stripe writes the write passes served (batching factor: this over write_passes).", None, x.batched_writes as f64),
        ("ferroraid_array_write_preread", "Member bytes read before writing (RMW/RCW pre-reads).", Some(Unit::Bytes), x.write_read_bytes as f64),
        ("ferroraid_array_pass_written", "Client bytes the write passes wrote.", Some(Unit::Bytes), x.pass_written_bytes as f64),
        ("ferroraid_array_stripe_cache_hits", "Write passes that found their stripe in the stripe cache.", None, x.cache_hit_stripes as f64),
        ("ferroraid_array_stripe_cache_hit", "Member bytes the stripe cache spared reading.", Some(Unit::Bytes), x.cache_hit_bytes as f64),
        ("ferroraid_array_held_passes", "Write passes held for more writes before reading (coalescing).", None, x.held_passes as f64),
        ("ferroraid_array_held", "Time write passes were held.", Some(Unit::Seconds), x.held_us as f64 / 1e6),
        ("ferroraid_array_expired_holds", "Holds that reached their bound without the writes they waited for.", None, x.expired_holds as f64),
        ("ferroraid_array_overtaking_requests", "Requests that went ahead of earlier bulk writes waiting for their share.", None, x.overtaking_requests as f64),
        ("ferroraid_array_ppl_records", "Partial Parity Log records written.", None, x.ppl_records as f64),
        ("ferroraid_array_ppl_written", "Bytes of Partial Parity Log records.", Some(Unit::Bytes), x.ppl_bytes as f64),
    ];
    for (name, help, unit, v) in counters {
        f.array_counter(name, help, unit, v)?;
    }
    f.array_gauge(
        "ferroraid_array_bulk_share_ops",
        "Stripe operations bulk writes may hold now, all reactors (the adaptive bulk share).",
        None,
        x.bulk_share_ops as f64,
    )?;
    f.array_gauge(
        "ferroraid_array_bulk_share_pool",
        "The stripe operations of all reactors: the pool the bulk share is of.",
        None,
        x.bulk_share_pool as f64,
    )?;
    f.array_counter(
        "ferroraid_array_bulk_share_cuts",
        "Cuts of the bulk share (small reads slower inside the target than allowed).",
        None,
        x.bulk_share_cuts as f64,
    )?;
    f.array_counter(
        "ferroraid_array_bulk_share_raises",
        "Raises of the bulk share (probes, returns towards the whole pool).",
        None,
        x.bulk_share_raises as f64,
    )?;
    f.array_gauge(
        "ferroraid_array_zero_stripes",
        "Stripes the target knows to read as zeroes now (reported as holes by block status).",
        None,
        st.stats.zero_stripes as f64,
    )?;
    use engine::array::RequestClass as C;
    let waits: Vec<(Labels, &hdrhistogram::Histogram<u64>)> = [
        ("small_read", C::SmallRead),
        ("bulk_write", C::BulkWrite),
        ("other", C::Other),
    ]
    .iter()
    .map(|&(n, c)| {
        (
            f.with(&[("class", n.to_string())]),
            &s.snapshot.queue_wait[c.index()],
        )
    })
    .collect();
    f.histograms(
        "ferroraid_array_queue_wait",
        "Time requests waited inside the array before their first member request, by class.",
        &waits,
    )?;
    encode_process(f, st)?;
    if let Some(b) = &st.bitmap {
        f.array_gauge(
            "ferroraid_array_bitmap_regions",
            "Regions (bits) of the write-intent bitmap.",
            None,
            b.regions as f64,
        )?;
        f.array_gauge(
            "ferroraid_array_bitmap_dirty_regions",
            "Bits set on disk: regions a crash would resync or a re-added member rebuild.",
            None,
            b.dirty_regions as f64,
        )?;
    }
    if let Some(n) = &st.nbd {
        f.array_gauge(
            "ferroraid_nbd_connections",
            "NBD connections holding a slot now.",
            None,
            n.connections as f64,
        )?;
        f.array_gauge(
            "ferroraid_nbd_max_connections",
            "The NBD export's connection limit.",
            None,
            n.max_connections as f64,
        )?;
        f.array_gauge(
            "ferroraid_nbd_handshakes",
            "NBD handshakes in progress now.",
            None,
            n.handshakes as f64,
        )?;
        f.array_counter(
            "ferroraid_nbd_refused",
            "NBD clients refused because the connection limit was reached.",
            None,
            n.refused as f64,
        )?;
        f.array_counter(
            "ferroraid_nbd_handshake_timeouts",
            "NBD handshakes closed by the handshake timeout.",
            None,
            n.handshake_timeouts as f64,
        )?;
    }
    Ok(())
}

fn encode_process(f: &mut Families<'_>, st: &StatusReport) -> fmt::Result {
    let p = &st.process;
    let kinds = [
        ProcessKind::Resync,
        ProcessKind::Rebuild,
        ProcessKind::Check,
        ProcessKind::Repair,
        ProcessKind::Replace,
    ];
    let running: Vec<(Labels, f64)> = kinds
        .iter()
        .map(|&k| {
            (
                f.with(&[("kind", k.to_string())]),
                f64::from(u8::from(p.kind == k && p.state == ProcessRunState::Running)),
            )
        })
        .collect();
    f.scalars(
        MetricType::Gauge,
        "ferroraid_array_process_running",
        "1 for the background process running now (resync, rebuild, check, repair, replace).",
        None,
        &running,
    )?;
    f.array_gauge(
        "ferroraid_array_process_failed",
        "1 when the last background process ended on an error (see `ferroraid status`).",
        None,
        f64::from(u8::from(p.state == ProcessRunState::Failed)),
    )?;
    f.array_gauge(
        "ferroraid_array_process_position",
        "How far the running process has come, bytes of array capacity.",
        Some(Unit::Bytes),
        p.position_bytes as f64,
    )?;
    f.array_gauge(
        "ferroraid_array_process_size",
        "How far the running process goes, bytes of array capacity.",
        Some(Unit::Bytes),
        p.size_bytes as f64,
    )?;
    f.array_gauge(
        "ferroraid_array_process_rate_bytes_per_second",
        "The running process's speed, bytes of array capacity per second (as paced).",
        None,
        p.rate_bytes_per_s as f64,
    )?;
    f.array_gauge(
        "ferroraid_array_mismatch_sectors",
        "Sectors (512 bytes) the last check or repair found inconsistent (md's mismatch_cnt).",
        None,
        p.mismatch_cnt as f64,
    )
}

fn encode_members(f: &mut Families<'_>, s: &Scrape) -> fmt::Result {
    let st = &s.status;
    // Slots only (spares have no I/O); a replacement is labelled with its slot and
    // `replacing`.
    let rows: Vec<(Labels, &crate::status::MemberReport)> = st
        .members
        .iter()
        .filter_map(|m| {
            let slot = m.slot?;
            let mut l = f.with(&[
                ("slot", slot.to_string()),
                ("device", m.device.clone().unwrap_or_default()),
            ]);
            if m.state == MemberState::Replacing {
                l.push(("replacing", "true".to_string()));
            }
            Some((l, m))
        })
        .collect();
    let all_states = [
        MemberState::Active,
        MemberState::Faulty,
        MemberState::Removed,
        MemberState::Rebuilding,
        MemberState::Missing,
        MemberState::Replacing,
    ];
    let mut states = Vec::new();
    for (l, m) in &rows {
        for x in all_states {
            let mut l = l.clone();
            l.push(("state", x.as_str().to_string()));
            states.push((l, f64::from(u8::from(m.state == x))));
        }
    }
    f.scalars(
        MetricType::Gauge,
        "ferroraid_member_state",
        "1 for each member's current state (active, faulty, removed, rebuilding, missing, \
         replacing), 0 for the others.",
        None,
        &states,
    )?;
    type Pick = fn(&crate::status::MemberReport) -> f64;
    let counters: [(&str, &str, Option<Unit>, Pick); 6] = [
        (
            "ferroraid_member_reads",
            "Read requests sent to the member.",
            None,
            |m| m.io.reads as f64,
        ),
        (
            "ferroraid_member_writes",
            "Write, write-zeroes and discard requests sent to the member.",
            None,
            |m| m.io.writes as f64,
        ),
        (
            "ferroraid_member_flushes",
            "Flush requests sent to the member.",
            None,
            |m| m.io.flushes as f64,
        ),
        (
            "ferroraid_member_read",
            "Bytes read from the member.",
            Some(Unit::Bytes),
            |m| m.io.read_bytes as f64,
        ),
        (
            "ferroraid_member_written",
            "Bytes written to the member (write-zeroes and discards count their range).",
            Some(Unit::Bytes),
            |m| m.io.write_bytes as f64,
        ),
        (
            "ferroraid_member_errors",
            "Member requests that completed with an error.",
            None,
            |m| m.io.errors as f64,
        ),
    ];
    for (name, help, unit, pick) in counters {
        let r: Vec<(Labels, f64)> = rows.iter().map(|(l, m)| (l.clone(), pick(m))).collect();
        f.scalars(MetricType::Counter, name, help, unit, &r)?;
    }
    let depth: Vec<(Labels, f64)> = rows
        .iter()
        .map(|(l, m)| (l.clone(), m.qos.depth_limit as f64))
        .collect();
    f.scalars(
        MetricType::Gauge,
        "ferroraid_member_depth_limit",
        "Foreground-write and background requests the depth controller lets into the member, \
         all reactors.",
        None,
        &depth,
    )?;
    let target: Vec<(Labels, f64)> = rows
        .iter()
        .map(|(l, m)| (l.clone(), m.qos.target_latency_us / 1e6))
        .collect();
    f.scalars(
        MetricType::Gauge,
        "ferroraid_member_read_latency_target",
        "The depth controller's read-latency target.",
        Some(Unit::Seconds),
        &target,
    )?;
    // Latency: the slot's device as every reactor measured it (a replacement's own
    // histogram is the snapshot's replacement entry).
    let mut hist: Vec<(Labels, &hdrhistogram::Histogram<u64>)> = Vec::new();
    for (l, m) in &rows {
        // Every row is a slot's (spares were filtered out above).
        let Some(slot) = m.slot.map(usize::from) else {
            continue;
        };
        let h = match m.state {
            MemberState::Replacing => s.snapshot.replacement.as_ref().map(|r| &r.latency),
            MemberState::Removed | MemberState::Missing => None,
            _ => s.snapshot.members.get(slot).map(|x| &x.latency),
        };
        if let Some(h) = h {
            hist.push((l.clone(), h));
        }
    }
    f.histograms(
        "ferroraid_member_latency",
        "Completion latency of the requests sent to the member.",
        &hist,
    )
}

fn encode_reactors(f: &mut Families<'_>, s: &Scrape) -> fmt::Result {
    let cores = &s.status.reactors.cores;
    let labels: Vec<Labels> = (0..s.reactor_loads.len())
        .map(|i| {
            f.with(&[
                ("reactor", i.to_string()),
                (
                    "core",
                    cores
                        .get(i)
                        .copied()
                        .flatten()
                        .map_or_else(String::new, |c| c.to_string()),
                ),
            ])
        })
        .collect();
    type Pick = fn(&ReactorLoad) -> f64;
    let counters: [(&str, &str, Option<Unit>, Pick); 5] = [
        (
            "ferroraid_reactor_turns",
            "Loop turns of the reactor.",
            None,
            |l| l.turns as f64,
        ),
        (
            "ferroraid_reactor_busy",
            "Time in loop turns that moved something.",
            Some(Unit::Seconds),
            |l| l.busy_ns as f64 / 1e9,
        ),
        (
            "ferroraid_reactor_idle",
            "Time in loop turns that found nothing to do (spinning or napping).",
            Some(Unit::Seconds),
            |l| l.idle_ns as f64 / 1e9,
        ),
        (
            "ferroraid_reactor_pieces_sent",
            "Request pieces sent to the reactor owning their stripe.",
            None,
            |l| l.pieces_sent as f64,
        ),
        (
            "ferroraid_reactor_pieces_received",
            "Request pieces received from other reactors.",
            None,
            |l| l.pieces_received as f64,
        ),
    ];
    for (name, help, unit, pick) in counters {
        let r: Vec<(Labels, f64)> = labels
            .iter()
            .zip(&s.reactor_loads)
            .map(|(l, x)| (l.clone(), pick(x)))
            .collect();
        f.scalars(MetricType::Counter, name, help, unit, &r)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::array::{new_latency_histogram, MemberCounters, MemberState as EngineState};
    use engine::reactor::MemberSnapshot;

    /// A scrape of the status module's sample RAID6 (slot 2 faulty), with member 0's
    /// latency histogram holding 3 × 80 µs and 1 × 3 ms, member counters set, and two
    /// reactors.
    fn scrape() -> Scrape {
        let status = crate::status::tests::sample(&[2]);
        let members = (0..6u64)
            .map(|i| {
                let mut latency = new_latency_histogram();
                if i == 0 {
                    latency.record_n(80_000, 3).unwrap();
                    latency.record(3_000_000).unwrap();
                }
                MemberSnapshot {
                    state: if i == 2 {
                        EngineState::FailedByOperator
                    } else {
                        EngineState::Online
                    },
                    counters: MemberCounters {
                        reads: 10 + i,
                        read_bytes: 4096 * (10 + i),
                        ..MemberCounters::default()
                    },
                    latency,
                    qos: engine::qos::QosState::default(),
                }
            })
            .collect();
        let mut status = status;
        for (m, i) in status.members.iter_mut().zip(0u64..) {
            m.io.reads = 10 + i;
            m.io.read_bytes = 4096 * (10 + i);
        }
        status.stats.full_stripe_writes = 7;
        status.stats.rmw_writes = 5;
        Scrape {
            status,
            snapshot: ArraySnapshot {
                stats: engine::array::ArrayStats::default(),
                members,
                requests_in_flight: 0,
                reactors: 2,
                control_error: None,
                replacement: None,
                queue_wait: std::array::from_fn(|_| new_latency_histogram()),
                zero_stripes: 0,
            },
            reactor_loads: vec![
                ReactorLoad {
                    turns: 100,
                    busy_ns: 1_500_000_000,
                    idle_ns: 500_000_000,
                    pieces_sent: 3,
                    pieces_received: 4,
                },
                ReactorLoad::default(),
            ],
        }
    }

    /// The value of the sample line `name{labels}` (labels as printed), if present.
    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn prometheus_text_names_counters_gauges_and_histograms_by_convention() {
        let t = render(scrape(), false);
        assert!(!t.contains("# EOF"), "0.0.4 text has no EOF marker");
        let a = r#"array="host:data""#;
        assert_eq!(
            value(
                &t,
                &format!(r#"ferroraid_array_stripe_writes_total{{{a},path="full_stripe"}}"#)
            ),
            Some(7.0),
            "{t}"
        );
        assert_eq!(
            value(
                &t,
                &format!(r#"ferroraid_array_stripe_writes_total{{{a},path="rmw"}}"#)
            ),
            Some(5.0)
        );
        assert_eq!(
            value(
                &t,
                &format!(r#"ferroraid_array_state{{{a},state="degraded"}}"#)
            ),
            Some(1.0)
        );
        assert_eq!(
            value(
                &t,
                &format!(r#"ferroraid_array_state{{{a},state="clean"}}"#)
            ),
            Some(0.0)
        );
        let m3 = format!(r#"{a},slot="3",device="/dev/m3""#);
        assert_eq!(
            value(&t, &format!("ferroraid_member_reads_total{{{m3}}}")),
            Some(13.0)
        );
        assert_eq!(
            value(&t, &format!("ferroraid_member_read_bytes_total{{{m3}}}")),
            Some(4096.0 * 13.0)
        );
        assert_eq!(
            value(
                &t,
                &format!(
                    r#"ferroraid_member_state{{{a},slot="2",device="/dev/m2",state="faulty"}}"#
                )
            ),
            Some(1.0)
        );
        // Member 0's histogram: 3 values of 80 µs in the 100 µs bucket, the 3 ms one in
        // the 5 ms bucket; buckets are cumulative, +Inf holds all four.
        let m0 = format!(r#"{a},slot="0",device="/dev/m0""#);
        let bucket = |le: &str| {
            value(
                &t,
                &format!(r#"ferroraid_member_latency_seconds_bucket{{{m0},le="{le}"}}"#),
            )
        };
        assert_eq!(bucket("5e-05"), Some(0.0), "{t}");
        assert_eq!(bucket("0.0001"), Some(3.0), "{t}");
        assert_eq!(bucket("0.0025"), Some(3.0));
        assert_eq!(bucket("0.005"), Some(4.0));
        assert_eq!(bucket("+Inf"), Some(4.0));
        assert_eq!(
            value(
                &t,
                &format!("ferroraid_member_latency_seconds_count{{{m0}}}")
            ),
            Some(4.0)
        );
        let sum = value(&t, &format!("ferroraid_member_latency_seconds_sum{{{m0}}}")).unwrap();
        assert!((sum - 0.00324).abs() < 0.00324 * 0.01, "sum {sum}");
        assert_eq!(
            value(
                &t,
                &format!(r#"ferroraid_reactor_busy_seconds_total{{{a},reactor="0",core="0"}}"#)
            ),
            Some(1.5),
            "{t}"
        );
        assert_eq!(
            value(
                &t,
                &format!(r#"ferroraid_reactor_pieces_received_total{{{a},reactor="0",core="0"}}"#)
            ),
            Some(4.0)
        );
        // Every family has HELP and TYPE once, and no series repeats.
        let mut seen = std::collections::HashSet::new();
        for l in t.lines().filter(|l| !l.starts_with('#')) {
            let series = l.rsplit_once(' ').expect("a value").0;
            assert!(seen.insert(series.to_string()), "{series} twice");
        }
        let types = t.lines().filter(|l| l.starts_with("# TYPE ")).count();
        let helps = t.lines().filter(|l| l.starts_with("# HELP ")).count();
        assert_eq!(types, helps);
        assert!(types > 40, "{types} families");
    }

    #[test]
    fn openmetrics_text_ends_with_eof_and_keeps_the_families() {
        let t = render(scrape(), true);
        assert!(t.ends_with("# EOF\n"), "{t}");
        assert!(t.contains("# TYPE ferroraid_member_latency_seconds histogram\n"));
        assert!(t.contains("# UNIT ferroraid_member_latency_seconds seconds\n"));
        assert!(
            t.contains("# TYPE ferroraid_array_stripe_writes counter\n"),
            "{t}"
        );
    }
}
