//! The metrics endpoint (`serve --metrics HOST:PORT`): Prometheus text (exposition format
//! 0.0.4) or OpenMetrics 1.0 text, chosen by the scraper's `Accept` header, served on
//! `GET /metrics` by a management thread of its own — never by a reactor. One endpoint
//! covers every array the process serves: each family once, with every array's samples
//! (see [`render`]). A scrape takes, per array, the reactors' last published statistics
//! ([`engine::reactor::ReactorHandle::snapshot`], at most `PUBLISH_INTERVAL` old) and the
//! same [`StatusReport`] `ferroraid status` shows; encoding is the `prometheus-client`
//! crate's, HTTP the `tiny_http` crate's.
//!
//! Names follow the Prometheus conventions (`ferroraid_` prefix, base units, counters end
//! in `_total`, `_bytes`/`_seconds` units). Every metric of the array carries the label
//! `array` (its name); member metrics add `slot` (the role, 0-based) and `device` (the
//! path, empty for a missing slot); reactor metrics add `reactor` and `core` (empty when
//! not pinned) and are the loop counters of that array's shard on that reactor. The
//! catalogue with meanings is in docs/MANAGEMENT.md ("Metrics").
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
use tracing::{debug, warn};

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
    /// Each reactor's loop counters for this array's shard, in reactor order.
    pub reactor_loads: Vec<ReactorLoad>,
}

/// Where a scrape comes from: the running target, one process that may serve several
/// arrays.
pub trait MetricsSource: Send + Sync + 'static {
    /// The current figures, one [`Scrape`] per array the process serves now (any order;
    /// array names distinct — a repeated name is left out of the rendering). An empty
    /// list is a process serving no array yet and is answered 200 with no samples;
    /// `None` means the process is still starting (the scrape is then answered 503).
    fn scrape(&self) -> Option<Vec<Scrape>>;
}

/// The content type of OpenMetrics 1.0 text.
const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Renders the scrapes of every array a process serves: OpenMetrics 1.0 text (ends with
/// `# EOF`) when `openmetrics`, else the Prometheus text exposition format 0.0.4. Each
/// metric family appears once, with the samples of every array (told apart by the
/// `array` label); a family no array has (the bitmap's without a bitmap, NBD's without an
/// NBD export) is left out. No scrapes render no families: an empty 0.0.4 text, or only
/// `# EOF`.
pub fn render(scrapes: &[Scrape], openmetrics: bool) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(GatheredCollector(gather(scrapes))));
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
    let Some(scrapes) = source.scrape() else {
        let r = Response::from_string("the target is still starting\n").with_status_code(503);
        return respond(request, r);
    };
    let body = render(&scrapes, openmetrics);
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

type Labels = Vec<(&'static str, String)>;

/// The samples of one family, every array's.
#[derive(Debug)]
enum Samples {
    /// Counter or gauge samples: labels and value.
    Scalars(Vec<(Labels, f64)>),
    /// Histogram samples (seconds): labels and [`buckets_of`]'s `(sum, count, buckets)`.
    Histograms(Vec<(Labels, HistogramRow)>),
}

/// `(sum seconds, count, per-bucket counts)`, as [`buckets_of`] returns it.
type HistogramRow = (f64, u64, Vec<(f64, u64)>);

/// One metric family: its descriptor and the samples of every array that has it.
#[derive(Debug)]
struct Family {
    name: String,
    help: String,
    unit: Option<Unit>,
    ty: MetricType,
    samples: Samples,
}

/// The metric families of a scrape, gathered over every array before anything is
/// encoded: the encoders below run once per array and append that array's samples to
/// the family of the same name, so each family is written once with every array's
/// samples (the text formats forbid a family twice: Prometheus 0.0.4 and OpenMetrics 1.0
/// both, and `promtool check metrics` rejects it). Families keep the order in which they
/// were first declared.
#[derive(Debug, Default)]
struct Families {
    /// The name of the array whose samples are being added (the `array` label).
    array: String,
    families: Vec<Family>,
    /// Family name → index into `families`.
    index: std::collections::HashMap<String, usize>,
}

impl Families {
    fn array_labels(&self) -> Labels {
        vec![("array", self.array.clone())]
    }

    fn with(&self, extra: &[(&'static str, String)]) -> Labels {
        let mut l = self.array_labels();
        l.extend(extra.iter().cloned());
        l
    }

    /// The family `name`, declared now if no array declared it yet.
    fn family(
        &mut self,
        ty: MetricType,
        name: &str,
        help: &str,
        unit: Option<Unit>,
    ) -> &mut Samples {
        let i = match self.index.get(name) {
            Some(&i) => i,
            None => {
                let samples = match ty {
                    MetricType::Histogram => Samples::Histograms(Vec::new()),
                    _ => Samples::Scalars(Vec::new()),
                };
                self.families.push(Family {
                    name: name.to_string(),
                    help: help.to_string(),
                    unit,
                    ty,
                    samples,
                });
                self.index.insert(name.to_string(), self.families.len() - 1);
                self.families.len() - 1
            }
        };
        let family = &mut self.families[i];
        debug_assert!(
            family.ty == ty && family.help == help,
            "{name} declared twice differently"
        );
        &mut family.samples
    }

    /// Counter or gauge samples of this array: one per row.
    fn scalars(
        &mut self,
        ty: MetricType,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        rows: &[(Labels, f64)],
    ) {
        debug_assert!(matches!(ty, MetricType::Counter | MetricType::Gauge));
        match self.family(ty, name, help, unit) {
            Samples::Scalars(s) => s.extend(rows.iter().cloned()),
            Samples::Histograms(_) => debug_assert!(false, "{name} is a histogram"),
        }
    }

    /// This array's sample of an array-labelled counter.
    fn array_counter(&mut self, name: &str, help: &str, unit: Option<Unit>, v: f64) {
        let l = self.array_labels();
        self.scalars(MetricType::Counter, name, help, unit, &[(l, v)]);
    }

    /// This array's sample of an array-labelled gauge.
    fn array_gauge(&mut self, name: &str, help: &str, unit: Option<Unit>, v: f64) {
        let l = self.array_labels();
        self.scalars(MetricType::Gauge, name, help, unit, &[(l, v)]);
    }

    /// Histogram samples (seconds) of this array from HDR histograms recorded in ns.
    fn histograms(
        &mut self,
        name: &str,
        help: &str,
        rows: &[(Labels, &hdrhistogram::Histogram<u64>)],
    ) {
        match self.family(MetricType::Histogram, name, help, Some(Unit::Seconds)) {
            Samples::Histograms(s) => {
                s.extend(rows.iter().map(|(l, h)| (l.clone(), buckets_of(h))));
            }
            Samples::Scalars(_) => debug_assert!(false, "{name} is not a histogram"),
        }
    }
}

/// `(sum seconds, count, per-bucket counts)` of an HDR histogram recorded in ns, in the
/// buckets of [`LATENCY_BUCKETS_S`] and `+Inf` (counts per bucket, not cumulative: the
/// encoder accumulates).
fn buckets_of(h: &hdrhistogram::Histogram<u64>) -> HistogramRow {
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

/// The families of every array's scrape (see [`Families`]); arrays whose name an earlier
/// scrape already used are left out with a warning (their series would repeat the
/// earlier array's, which makes the whole exposition invalid).
fn gather(scrapes: &[Scrape]) -> Vec<Family> {
    let mut f = Families::default();
    let mut seen = std::collections::HashSet::new();
    for s in scrapes {
        let name = &s.status.array.name;
        if !seen.insert(name.as_str()) {
            warn!("metrics: a second array named {name:?} is left out of the scrape");
            continue;
        }
        f.array.clone_from(name);
        encode_array(&mut f, s);
        encode_members(&mut f, s);
        encode_reactors(&mut f, s);
    }
    f.families
}

/// Gathered families as a `prometheus-client` collector: each family's descriptor once,
/// then its samples.
#[derive(Debug)]
struct GatheredCollector(Vec<Family>);

impl prometheus_client::collector::Collector for GatheredCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        for family in &self.0 {
            let mut m =
                enc.encode_descriptor(&family.name, &family.help, family.unit.as_ref(), family.ty)?;
            match &family.samples {
                Samples::Scalars(rows) => {
                    for (labels, v) in rows {
                        let mut e = m.encode_family(labels)?;
                        match family.ty {
                            MetricType::Counter => {
                                e.encode_counter::<NoLabelSet, f64, f64>(v, None)?;
                            }
                            _ => e.encode_gauge(v)?,
                        }
                    }
                }
                Samples::Histograms(rows) => {
                    for (labels, (sum, count, buckets)) in rows {
                        m.encode_family(labels)?
                            .encode_histogram::<NoLabelSet>(*sum, *count, buckets, None)?;
                    }
                }
            }
        }
        Ok(())
    }
}

fn encode_array(f: &mut Families, s: &Scrape) {
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
    );
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
    );
    f.array_gauge(
        "ferroraid_array_size",
        "Capacity exported to clients.",
        Some(Unit::Bytes),
        a.size_bytes as f64,
    );
    f.array_gauge(
        "ferroraid_array_chunk_size",
        "Chunk size.",
        Some(Unit::Bytes),
        a.chunk_bytes as f64,
    );
    f.array_gauge(
        "ferroraid_array_raid_devices",
        "Members of the complete array (md's raid_disks).",
        None,
        f64::from(a.raid_devices),
    );
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
    );
    f.array_gauge(
        "ferroraid_array_superblock_events",
        "The superblock generation (md's events).",
        None,
        a.events as f64,
    );
    f.array_gauge(
        "ferroraid_array_requests_in_flight",
        "Array requests accepted and not yet completed, all reactors.",
        None,
        st.requests_in_flight as f64,
    );
    f.array_gauge(
        "ferroraid_array_writes_awaiting_record",
        "Write pieces finished while a member or replacement had failed, held until the superblocks record it.",
        None,
        st.writes_awaiting_record as f64,
    );
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
    );
    f.array_counter(
        "ferroraid_array_fast_reads",
        "Direct reads issued at submission as one member read, without a stripe operation.",
        None,
        x.fast_reads as f64,
    );
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
    );
    let counters: [(&str, &str, Option<Unit>, f64); 21] = [
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
        ("ferroraid_array_stripe_cache_admitted_writes", "Random sub-stripe writes admitted to the stripe cache (they came back to a stripe written around it lately).", None, x.cache_admitted_writes as f64),
        ("ferroraid_array_stripe_cache_reads", "Reads served from the stripe cache (no member read).", None, x.cache_reads as f64),
        ("ferroraid_array_gathered_writes", "Data chunks write passes wrote gathered from several writes' buffers (one member request, no copy).", None, x.gathered_writes as f64),
        ("ferroraid_array_held_passes", "Write passes held for more writes before reading (coalescing).", None, x.held_passes as f64),
        ("ferroraid_array_held", "Time write passes were held.", Some(Unit::Seconds), x.held_us as f64 / 1e6),
        ("ferroraid_array_expired_holds", "Holds that reached their bound without the writes they waited for.", None, x.expired_holds as f64),
        ("ferroraid_array_overtaking_requests", "Requests that went ahead of earlier bulk writes waiting for their share.", None, x.overtaking_requests as f64),
        ("ferroraid_array_ppl_records", "Partial Parity Log records written.", None, x.ppl_records as f64),
        ("ferroraid_array_ppl_written", "Bytes of Partial Parity Log records.", Some(Unit::Bytes), x.ppl_bytes as f64),
    ];
    for (name, help, unit, v) in counters {
        f.array_counter(name, help, unit, v);
    }
    f.array_gauge(
        "ferroraid_array_bulk_share_ops",
        "Stripe operations bulk writes may hold now, all reactors (the adaptive bulk share).",
        None,
        x.bulk_share_ops as f64,
    );
    f.array_gauge(
        "ferroraid_array_bulk_share_pool",
        "The stripe operations of all reactors: the pool the bulk share is of.",
        None,
        x.bulk_share_pool as f64,
    );
    f.array_counter(
        "ferroraid_array_bulk_share_cuts",
        "Cuts of the bulk share (small reads slower inside the target than allowed).",
        None,
        x.bulk_share_cuts as f64,
    );
    f.array_counter(
        "ferroraid_array_bulk_share_raises",
        "Raises of the bulk share (probes, returns towards the whole pool).",
        None,
        x.bulk_share_raises as f64,
    );
    f.array_gauge(
        "ferroraid_array_zero_stripes",
        "Stripes the target knows to read as zeroes now (reported as holes by block status).",
        None,
        st.stats.zero_stripes as f64,
    );
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
    );
    encode_process(f, st);
    if let Some(b) = &st.bitmap {
        f.array_gauge(
            "ferroraid_array_bitmap_regions",
            "Regions (bits) of the write-intent bitmap.",
            None,
            b.regions as f64,
        );
        f.array_gauge(
            "ferroraid_array_bitmap_dirty_regions",
            "Bits set on disk: regions a crash would resync or a re-added member rebuild.",
            None,
            b.dirty_regions as f64,
        );
    }
    if let Some(n) = &st.nbd {
        f.array_gauge(
            "ferroraid_nbd_connections",
            "NBD connections holding a slot now.",
            None,
            n.connections as f64,
        );
        f.array_gauge(
            "ferroraid_nbd_max_connections",
            "The NBD export's connection limit.",
            None,
            n.max_connections as f64,
        );
        f.array_gauge(
            "ferroraid_nbd_handshakes",
            "NBD handshakes in progress now.",
            None,
            n.handshakes as f64,
        );
        f.array_counter(
            "ferroraid_nbd_refused",
            "NBD clients refused because the connection limit was reached.",
            None,
            n.refused as f64,
        );
        f.array_counter(
            "ferroraid_nbd_handshake_timeouts",
            "NBD handshakes closed by the handshake timeout.",
            None,
            n.handshake_timeouts as f64,
        );
    }
}

fn encode_process(f: &mut Families, st: &StatusReport) {
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
    );
    f.array_gauge(
        "ferroraid_array_process_failed",
        "1 when the last background process ended on an error (see `ferroraid status`).",
        None,
        f64::from(u8::from(p.state == ProcessRunState::Failed)),
    );
    f.array_gauge(
        "ferroraid_array_process_position",
        "How far the running process has come, bytes of array capacity.",
        Some(Unit::Bytes),
        p.position_bytes as f64,
    );
    f.array_gauge(
        "ferroraid_array_process_size",
        "How far the running process goes, bytes of array capacity.",
        Some(Unit::Bytes),
        p.size_bytes as f64,
    );
    f.array_gauge(
        "ferroraid_array_process_rate_bytes_per_second",
        "The running process's speed, bytes of array capacity per second (as paced).",
        None,
        p.rate_bytes_per_s as f64,
    );
    f.array_gauge(
        "ferroraid_array_mismatch_sectors",
        "Sectors (512 bytes) the last check or repair found inconsistent (md's mismatch_cnt).",
        None,
        p.mismatch_cnt as f64,
    );
}

fn encode_members(f: &mut Families, s: &Scrape) {
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
    );
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
        f.scalars(MetricType::Counter, name, help, unit, &r);
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
    );
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
    );
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
    );
}

fn encode_reactors(f: &mut Families, s: &Scrape) {
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
    let counters: [(&str, &str, Option<Unit>, Pick); 6] = [
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
        (
            "ferroraid_reactor_bound_held_turns",
            "Loop turns whose per-turn bulk-write bound held because the reactor saw a request other than a bulk write within the last second.",
            None,
            |l| l.bound_held_turns as f64,
        ),
    ];
    for (name, help, unit, pick) in counters {
        let r: Vec<(Labels, f64)> = labels
            .iter()
            .zip(&s.reactor_loads)
            .map(|(l, x)| (l.clone(), pick(x)))
            .collect();
        f.scalars(MetricType::Counter, name, help, unit, &r);
    }
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
                writes_held: 0,
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
                    bound_held_turns: 5,
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
        let t = render(&[scrape()], false);
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
        assert_eq!(
            value(
                &t,
                &format!(r#"ferroraid_reactor_bound_held_turns_total{{{a},reactor="0",core="0"}}"#)
            ),
            Some(5.0)
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
        let t = render(&[scrape()], true);
        assert!(t.ends_with("# EOF\n"), "{t}");
        assert!(t.contains("# TYPE ferroraid_member_latency_seconds histogram\n"));
        assert!(t.contains("# UNIT ferroraid_member_latency_seconds seconds\n"));
        assert!(
            t.contains("# TYPE ferroraid_array_stripe_writes counter\n"),
            "{t}"
        );
    }

    /// A second array for the multi-array tests: RAID5 `host:logs`, no NBD export but a
    /// bitmap with 9 dirty regions, 11 full-stripe writes, reactor 1 busy 2 s.
    fn other_scrape() -> Scrape {
        let mut s = scrape();
        s.status.array.name = "host:logs".into();
        s.status.array.level = 5;
        s.status.array.array_uuid = "0badc0de:00000000:00000000:00000001".into();
        s.status.nbd = None;
        s.status.bitmap = Some(crate::status::BitmapReport {
            chunk_bytes: 64 << 20,
            regions: 100,
            dirty_regions: 9,
            events_cleared: 3,
            clearing: true,
        });
        s.status.stats.full_stripe_writes = 11;
        s.reactor_loads[1].busy_ns = 2_000_000_000;
        s
    }

    /// The text's families in order, each with its sample lines, checked for what the
    /// exposition formats require of families: every sample line belongs to the family
    /// whose `# TYPE` came last (the name, or the name plus a suffix its type allows),
    /// and no family is declared twice. Panics naming the offence.
    fn families_of(text: &str) -> Vec<(String, Vec<String>)> {
        let mut out: Vec<(String, String, Vec<String>)> = Vec::new();
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                let (name, ty) = rest.split_once(' ').expect("TYPE name type");
                assert!(
                    out.iter().all(|(n, _, _)| n != name),
                    "family {name} declared twice:\n{text}"
                );
                out.push((name.to_string(), ty.to_string(), Vec::new()));
            } else if l.starts_with('#') || l.is_empty() {
                continue;
            } else {
                let (name, ty, samples) = out.last_mut().expect("a sample before any TYPE");
                let metric = l.split(['{', ' ']).next().unwrap_or("");
                let suffixes: &[&str] = match ty.as_str() {
                    "counter" => &["", "_total", "_created"],
                    "histogram" => &["_bucket", "_sum", "_count", "_created"],
                    _ => &[""],
                };
                assert!(
                    suffixes.iter().any(|x| metric == format!("{name}{x}")),
                    "sample {l:?} outside its family ({name} {ty})"
                );
                samples.push(l.to_string());
            }
        }
        out.into_iter().map(|(n, _, s)| (n, s)).collect()
    }

    #[test]
    fn two_arrays_render_each_family_once_with_both_arrays_samples() {
        for openmetrics in [false, true] {
            let t = render(&[scrape(), other_scrape()], openmetrics);
            let families = families_of(&t);
            assert!(families.len() > 40, "{} families", families.len());
            let data = r#"array="host:data""#;
            let logs = r#"array="host:logs""#;
            for (name, samples) in &families {
                let has = |a: &str| samples.iter().any(|l| l.contains(a));
                match name.as_str() {
                    // Only host:data has an NBD export, only host:logs a bitmap.
                    n if n.starts_with("ferroraid_nbd_") => {
                        assert!(has(data) && !has(logs), "{name}: {samples:?}");
                    }
                    n if n.starts_with("ferroraid_array_bitmap_") => {
                        assert!(has(logs) && !has(data), "{name}: {samples:?}");
                    }
                    _ => assert!(has(data) && has(logs), "{name}: {samples:?}"),
                }
            }
            for (a, level, writes) in [(data, "raid6", 7.0), (logs, "raid5", 11.0)] {
                assert!(
                    t.lines().any(|l| l.starts_with("ferroraid_array_info{")
                        && l.contains(a)
                        && l.contains(&format!(r#"level="{level}""#))),
                    "{t}"
                );
                let series =
                    format!(r#"ferroraid_array_stripe_writes_total{{{a},path="full_stripe"}}"#);
                assert_eq!(value(&t, &series), Some(writes), "{series}\n{t}");
            }
            let busy = |a: &str| {
                value(
                    &t,
                    &format!(r#"ferroraid_reactor_busy_seconds_total{{{a},reactor="1",core=""}}"#),
                )
            };
            assert_eq!(busy(data), Some(0.0), "{t}");
            assert_eq!(busy(logs), Some(2.0), "{t}");
            // No series twice.
            let mut seen = std::collections::HashSet::new();
            for l in t.lines().filter(|l| !l.starts_with('#')) {
                let series = l.rsplit_once(' ').expect("a value").0;
                assert!(seen.insert(series.to_string()), "{series} twice");
            }
            assert_eq!(t.ends_with("# EOF\n"), openmetrics);
        }
    }

    #[test]
    fn a_repeated_array_name_is_left_out_rather_than_repeating_series() {
        let t = render(&[scrape(), scrape()], false);
        assert_eq!(t, render(&[scrape()], false));
    }

    #[test]
    fn zero_arrays_render_no_families() {
        assert_eq!(render(&[], false), "");
        assert_eq!(render(&[], true), "# EOF\n");
    }

    /// `promtool check metrics` (when installed; `FERRORAID_REQUIRE_TOOLS=1` makes a
    /// missing promtool a failure) accepts a two-array rendering and an empty one.
    #[test]
    fn promtool_accepts_two_arrays_and_none() {
        let found = std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("promtool"))
                .find(|p| p.is_file())
        });
        let Some(promtool) = found else {
            assert!(
                std::env::var("FERRORAID_REQUIRE_TOOLS").as_deref() != Ok("1"),
                "promtool is not installed and FERRORAID_REQUIRE_TOOLS=1"
            );
            eprintln!("SKIPPED: promtool is not installed (set FERRORAID_REQUIRE_TOOLS=1 to fail instead)");
            return;
        };
        let check = |text: &str| {
            use std::io::Write;
            use std::process::{Command, Stdio};
            let mut child = Command::new(&promtool)
                .args(["check", "metrics"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting promtool");
            child
                .stdin
                .take()
                .expect("piped stdin")
                .write_all(text.as_bytes())
                .expect("writing to promtool");
            let out = child.wait_with_output().expect("waiting for promtool");
            assert!(
                out.status.success(),
                "promtool check metrics rejected the text: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        check(&render(&[scrape(), other_scrape()], false));
        check(&render(&[], false));
    }
}
