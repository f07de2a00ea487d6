//! `ferroraid create`, `ferroraid serve` and `ferroraid demo`: the command-line side of
//! the target (the runtime itself is the library's `target` module).

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use engine::array::MemberState;
use engine::geometry::{Geometry, Layout, Level};
use engine::metadata::BitmapChoice;
use engine::reactor::Mode;
use ferroraid::create::{create, CreateOptions};
use ferroraid::node::Node;
use ferroraid::notify::NotifyState;
use ferroraid::status::{ExportProtocol, ExportReport};
use ferroraid::target::{ServeOptions, Target};
use serde::Deserialize;

/// Options of `ferroraid create`.
#[derive(Args, Debug)]
pub struct CreateArgs {
    /// RAID level: 5 or 6.
    #[arg(long)]
    level: Level,
    /// Chunk size: a power of two from 4K to 16M.
    #[arg(long, default_value = "64K", value_parser = crate::parse_bytes)]
    chunk: u64,
    /// md layout name or number.
    #[arg(long, default_value = "left-symmetric")]
    layout: Layout,
    /// Array name (the NBD export name; at most 31 bytes; md's `host:name` form is
    /// accepted and exports `name`).
    #[arg(long, default_value = "ferroraid")]
    name: String,
    /// Declare the members consistent instead of zeroing their data areas (only for
    /// devices that are already all zeroes).
    #[arg(long)]
    assume_clean: bool,
    /// Overwrite devices that already carry an md superblock.
    #[arg(long)]
    force: bool,
    /// Internal write-intent bitmap: `internal` or `none`. Default: mdadm's rule (internal
    /// when each member contributes more than 100 GiB).
    #[arg(long, value_parser = parse_bitmap_choice)]
    bitmap: Option<BitmapChoice>,
    /// Bytes of each member one bitmap bit covers (a power of two, at least 4K; default
    /// as mdadm: 64M, or more when the bitmap would not fit its space). Implies
    /// `--bitmap internal`.
    #[arg(long, value_parser = crate::parse_bytes)]
    bitmap_chunk: Option<u64>,
    /// How parity is made consistent after a crash (mdadm's names): `resync` (no bitmap,
    /// a full resync), `bitmap` (the internal write-intent bitmap), `ppl` (md's Partial
    /// Parity Log; closes the write hole; on RAID6 ferroraid's extension, which kernel md
    /// cannot assemble until `ferroraid grow --consistency-policy resync`). Default: as
    /// --bitmap decides.
    #[arg(long, value_parser = clap::value_parser!(engine::metadata::ConsistencyPolicy))]
    consistency_policy: Option<engine::metadata::ConsistencyPolicy>,
    /// Create through a running target's management socket (`array_create`) and start
    /// the array there (exit status 0 created, 1 refused, 4 no target). Without it the
    /// members are written here and nothing is started.
    #[arg(long, value_name = "PATH")]
    rpc: Option<PathBuf>,
    /// With --rpc: create without starting.
    #[arg(long, requires = "rpc")]
    no_start: bool,
    /// With --rpc: where the started array is exported.
    #[command(flatten)]
    exports: crate::mgmt::ExportFlags,
    /// With --rpc: print the result as JSON.
    #[arg(long, requires = "rpc")]
    json: bool,
    /// Member devices in role order: files, block devices, NVMe generic devices
    /// (`/dev/ngXnY`, io_uring passthrough) or NVMe controllers bound to vfio-pci
    /// (`vfio:DDDD:BB:DD.F`).
    #[arg(required = true)]
    devices: Vec<PathBuf>,
}

/// `--bitmap`: `internal` or `none` (mdadm's names).
fn parse_bitmap_choice(s: &str) -> Result<BitmapChoice, String> {
    match s {
        "internal" => Ok(BitmapChoice::Internal),
        "none" => Ok(BitmapChoice::None),
        _ => Err(format!(
            "{s:?}: expected 'internal' or 'none' (external bitmap files are not supported)"
        )),
    }
}

/// Runs `ferroraid create`.
pub fn run_create(a: &CreateArgs) -> Result<()> {
    if let Some(rpc) = &a.rpc {
        let p = ferroraid::rpc::ArrayCreateParams {
            name: a.name.clone(),
            level: a.level.md_level() as u8,
            // Absolute: the target resolves paths in its own working directory.
            devices: crate::mgmt::absolute_devices(&a.devices)?,
            chunk_bytes: Some(a.chunk),
            layout: Some(a.layout.name().to_string()),
            assume_clean: a.assume_clean,
            force: a.force,
            bitmap: a.bitmap.map(|b| match b {
                BitmapChoice::Internal => "internal".to_string(),
                _ => "none".to_string(),
            }),
            bitmap_chunk_bytes: a.bitmap_chunk,
            consistency_policy: a.consistency_policy.map(|c| c.to_string()),
            start: !a.no_start,
            exports: a.exports.params()?,
        };
        return crate::mgmt::create_rpc(rpc, &p, a.json);
    }
    if !(a.exports.is_empty()) {
        bail!("--nbd, --iscsi and --nvmf need --rpc (a running target to start the array on)");
    }
    let n = u16::try_from(a.devices.len()).context("too many devices")?;
    let geometry = Geometry::new(a.level, a.layout, n, a.chunk, 512)?;
    let bitmap = match (a.bitmap, a.bitmap_chunk) {
        (Some(BitmapChoice::None), Some(_)) => {
            bail!("--bitmap-chunk needs an internal bitmap, but --bitmap none was given")
        }
        // A bitmap chunk asks for a bitmap.
        (None, Some(_)) => BitmapChoice::Internal,
        (b, None) | (b @ Some(_), Some(_)) => b.unwrap_or_default(),
    };
    let c = create(&CreateOptions {
        geometry,
        name: a.name.clone(),
        devices: a.devices.clone(),
        assume_clean: a.assume_clean,
        force: a.force,
        progress: std::io::stderr().is_terminal(),
        zero_progress: None,
        bitmap,
        bitmap_chunk_bytes: a.bitmap_chunk,
        consistency_policy: a.consistency_policy,
    })?;
    say!(
        "created {} {} array {:?} (UUID {}): {} members, chunk {} bytes, {} bytes, data offset {} bytes",
        geometry.level(),
        geometry.layout(),
        a.name,
        c.uuid,
        n,
        geometry.chunk_bytes(),
        c.size_bytes,
        c.data_offset_bytes
    )?;
    if let Some(chunk) = c.bitmap_chunk_bytes {
        say!("internal write-intent bitmap: {chunk}-byte chunks")?;
    }
    if c.consistency_policy == engine::metadata::ConsistencyPolicy::Ppl {
        say!("partial parity log: 1 MiB on every member, 4 KiB after the superblock")?;
        if geometry.level() == Level::Raid6 {
            say!("{}", ferroraid::grow::RAID6_PPL_NOTICE)?;
        }
    }
    Ok(())
}

/// Options of `ferroraid serve`; every one can also come from the `--config` TOML file
/// (same names, `-` written `_`; command-line values win).
#[derive(Args, Debug, Default)]
pub struct ServeArgs {
    /// TOML configuration file (keys: devices or [[array]] tables, cores, reactors, mode = "polled" |
    /// "adaptive", nbd = [...], iscsi = [...], nvmf = [...], nvmf_allow_hosts = [...], rpc, metrics, force, run, io_timeout_ms, max_block,
    /// nbd_max_connections, nbd_handshake_timeout_ms, nbd_max_handshakes,
    /// nbd_idle_timeout_s, nbd_block_status = "on" | "off" (or true | false), tls = "off"
    /// | "allow" | "require", tls_cert, tls_key, tls_ca,
    /// queue_depth, stripe_ops, stripe_cache, write_hold_us, qos, qos_target_us, pacer,
    /// pacer_tolerance, speed_min, speed_max, and an
    /// [iscsi_chap] table: user, secret, mutual_user, mutual_secret, require_mutual).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Cores to run reactors on, one reactor each (e.g. 0,1). Default: `--reactors`
    /// reactors, one per physical core, the members' NUMA node first (read with hwloc in
    /// builds with the `hwloc` feature, else from sysfs; serve logs which).
    #[arg(long, value_delimiter = ',')]
    cores: Vec<usize>,
    /// Reactors when no --cores are given (default 1).
    #[arg(long)]
    reactors: Option<usize>,
    /// Busy-poll (the default: lowest latency, a whole core per reactor).
    #[arg(long, conflicts_with = "adaptive")]
    polled: bool,
    /// Sleep when idle (shared machines, tests).
    #[arg(long)]
    adaptive: bool,
    /// NBD listen address: HOST:PORT or unix:PATH (repeatable; default 127.0.0.1:10809);
    /// `none`: no NBD export until `ferroraid export add nbd`.
    #[arg(long)]
    nbd: Vec<String>,
    /// iSCSI listen address HOST:PORT (repeatable; e.g. 127.0.0.1:3260). Serves the target
    /// iqn.2026-11.org.ferroraid:<array name>, LUN 0. Default: no iSCSI.
    #[arg(long)]
    iscsi: Vec<String>,
    /// NVMe/TCP listen address HOST:PORT (repeatable; e.g. 0.0.0.0:4420 and 0.0.0.0:8009
    /// for `nvme discover`). Serves the subsystem nqn.2026-11.org.ferroraid:<array name>,
    /// namespace 1, and the discovery controller on every address (docs/NVMF.md).
    /// Default: no NVMe/TCP.
    #[arg(long)]
    nvmf: Vec<String>,
    /// Allow this host NQN to connect to the NVMe/TCP subsystem (repeatable; config key
    /// `nvmf_allow_hosts`). Without any, every host may connect; with some, other hosts
    /// get Connect Invalid Host and an empty discovery log (docs/NVMF.md).
    #[arg(long, value_name = "NQN")]
    nvmf_allow_host: Vec<String>,
    /// Open the JSON-RPC management socket (mode 0600) at PATH; `--rpc default` puts it
    /// where `ferroraid status` looks by default (/run/ferroraid/ferroraid.sock as root,
    /// else $XDG_RUNTIME_DIR/ferroraid.sock, else ./ferroraid.sock). Without --rpc (and no
    /// `rpc` key in the config) there is no management socket.
    #[arg(long, value_name = "PATH|default")]
    rpc: Option<PathBuf>,
    /// Serve metrics for Prometheus on HOST:PORT (`GET /metrics`: Prometheus text, or
    /// OpenMetrics when the scraper asks for it; docs/MANAGEMENT.md "Metrics"), e.g.
    /// 127.0.0.1:9750. Default: no metrics endpoint.
    #[arg(long, value_name = "HOST:PORT")]
    metrics: Option<String>,
    /// Start even with members missing or out of date, or dirty and degraded (reported;
    /// mdadm `--assemble --force`; implies --run).
    #[arg(long)]
    force: bool,
    /// Start although members the array still counts as active were not given (mdadm
    /// `--assemble --run`): the array runs degraded and the absent members are recorded
    /// faulty. A dirty degraded array still needs --force unless it has a Partial Parity
    /// Log, whose recovery makes it consistent first.
    #[arg(long)]
    run: bool,
    /// Member command timeout, milliseconds (default 30000): a member request outstanding
    /// longer fails its member, and the request is served from redundancy. 0 disables it.
    #[arg(long)]
    io_timeout_ms: Option<u64>,
    /// Advertised NBD maximum block size (default 4M); reads and writes up to 32M are
    /// served anyway, split into pieces of this size.
    #[arg(long, value_parser = crate::parse_bytes)]
    max_block: Option<u64>,
    /// NBD connections the export serves at once (default: every slot of the reactors'
    /// connection tables, 1024 per reactor; a larger limit grows the tables). Beyond it
    /// `NBD_OPT_GO` is refused with `NBD_REP_ERR_POLICY` and a message the client shows.
    #[arg(long, value_name = "N")]
    nbd_max_connections: Option<usize>,
    /// Longest NBD handshake, ms: a connection that has not finished negotiating by then
    /// is closed (half-open clients; default 10000).
    #[arg(long, value_name = "MS")]
    nbd_handshake_timeout_ms: Option<u64>,
    /// NBD handshakes in progress at once; a new connection beyond it closes the oldest
    /// handshake, never the newcomer (default 1024).
    #[arg(long, value_name = "N")]
    nbd_max_handshakes: Option<usize>,
    /// Close an NBD connection idle this long, s: nothing in flight and nothing received
    /// (default 0: never — the kernel client and qemu keep idle connections for hours).
    #[arg(long, value_name = "S")]
    nbd_idle_timeout_s: Option<u64>,
    /// NBD block status (`NBD_CMD_BLOCK_STATUS`, metadata context `base:allocation`):
    /// `on` (default) lets `nbdcopy`, `qemu-img convert` and `nbdinfo --map` skip the
    /// stripes the array knows read as zeroes; `off` never offers the context (for
    /// measurement, or clients that misuse it).
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    nbd_block_status: Option<bool>,
    /// NBD over TLS (`NBD_OPT_STARTTLS`): `off` (default), `allow` (clients choose) or
    /// `require` (nothing but STARTTLS before TLS: a plaintext client gets no data, as
    /// with nbdkit and qemu-nbd). `allow` and `require` need --tls-cert and --tls-key.
    #[arg(long, value_name = "off|allow|require")]
    tls: Option<ferroraid::nbd::TlsMode>,
    /// The server's X.509 certificate chain, PEM (its own certificate first).
    #[arg(long, value_name = "PEM")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert, PEM.
    #[arg(long, value_name = "PEM")]
    tls_key: Option<PathBuf>,
    /// CA certificates, PEM: clients must then present a certificate signed by one of
    /// them (default: no client certificate asked for).
    #[arg(long, value_name = "PEM")]
    tls_ca: Option<PathBuf>,
    /// io_uring queue depth per member per reactor (default 128).
    #[arg(long)]
    queue_depth: Option<u32>,
    /// Stripe operations per reactor, at least 1 (default 64).
    #[arg(long)]
    stripe_ops: Option<usize>,
    /// Stripe cache per reactor and member, bytes (suffixes K, M, G): the recently written
    /// stripes a following sub-stripe write need not read again (random writes from their
    /// second write to a stripe on: random rewrites of a hot region read nothing once
    /// SIZE ≥ the region ÷ data members). md's `stripe_cache_size`
    /// is this in 4 KiB pages (default 256 = 1 MiB); ferroraid caches whole chunks, so it
    /// holds SIZE / chunk stripes, at least `--stripe-ops`. 0 keeps nothing between
    /// writes. Default: every stripe of the array, within 1/64 of the machine's memory
    /// (its cgroup's limit when lower) and 1 GiB per array over all reactors, at least 64
    /// stripes (the start log's `stripe cache` line gives the size).
    #[arg(long, value_parser = crate::parse_bytes, value_name = "SIZE")]
    stripe_cache: Option<u64>,
    /// Shortest bound of the hold of a sub-stripe write that must pre-read, waiting for
    /// more writes of its stripe, µs: the bound is 3 × the measured write latency, at
    /// least this and at most 10 ms (only writes continuing a sequential stream, only while
    /// the clients can still send more writes, never FUA or behind a flush); 0 never
    /// holds. Default 200.
    #[arg(long, value_name = "US")]
    write_hold_us: Option<u64>,
    /// Per-member queue-depth control: `ferroraid` (default: latency target derived from
    /// quiet-device reads), `wbt-like` (Linux blk-wbt's algorithm, for comparison) or
    /// `off`.
    #[arg(long, value_name = "ferroraid|wbt-like|off")]
    qos: Option<String>,
    /// Read-latency target of the depth controller, µs (like wbt's `wb_lat_usec`);
    /// default: derived (ferroraid) or 2000 (wbt-like).
    #[arg(long, value_name = "US")]
    qos_target_us: Option<u64>,
    /// Background pacer of resync, rebuild, check and repair: `ferroraid` (default:
    /// feedback on foreground latency), `md-min` (md before 4.1: `speed_min` whenever
    /// foreground is seen) or `md-pending` (md 4.1+: wait only for its own requests).
    #[arg(long, value_name = "ferroraid|md-min|md-pending")]
    pacer: Option<String>,
    /// ferroraid's pacer: how much background may add to the foreground's latency, percent
    /// of its latency with background quiet (1..=1000; default 15: the foreground keeps
    /// ~85 % of its speed; lower protects it more, higher lets background finish sooner).
    /// Refused with another pacer.
    #[arg(long, value_name = "PERCENT")]
    pacer_tolerance: Option<u64>,
    /// Background floor, KiB/s per member (md's `speed_limit_min`; default 1000).
    #[arg(long, value_name = "KIB_PER_S")]
    speed_min: Option<u64>,
    /// Background ceiling, KiB/s per member (md's `speed_limit_max`; default 200000).
    #[arg(long, value_name = "KIB_PER_S")]
    speed_max: Option<u64>,
    /// Member devices in any order: files, block devices, NVMe generic devices
    /// (`/dev/ngXnY`, io_uring passthrough) or NVMe controllers bound to vfio-pci
    /// (`vfio:DDDD:BB:DD.F`).
    devices: Vec<PathBuf>,
}

/// A byte count of the `--config` file: an integer, or a string with a binary suffix
/// (`"4M"`), as on the command line.
///
/// # Errors
/// A negative number, a string that is no byte size, or another TOML type, naming `key`.
fn toml_bytes(v: &toml::Value, key: &str) -> Result<u64> {
    match v {
        toml::Value::Integer(i) => u64::try_from(*i).with_context(|| format!("{key} = {i}")),
        toml::Value::String(s) => crate::parse_bytes(s)
            .map_err(anyhow::Error::msg)
            .with_context(|| key.to_string()),
        v => bail!("{key} = {v}: expected a byte count like 4194304 or \"4M\""),
    }
}

/// The `--config` file.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct ServeFile {
    devices: Option<Vec<PathBuf>>,
    /// `[[array]]` tables: the array by its devices or by globs to scan
    /// ([`ferroraid::scan::ArrayTable`]); several tables: several arrays on the node's
    /// reactors ([`ServeArgs::node_options`]).
    array: Option<Vec<ferroraid::scan::ArrayTable>>,
    cores: Option<Vec<usize>>,
    reactors: Option<usize>,
    mode: Option<String>,
    nbd: Option<Vec<String>>,
    iscsi: Option<Vec<String>>,
    nvmf: Option<Vec<String>>,
    nvmf_allow_hosts: Option<Vec<String>>,
    /// CHAP secrets of the iSCSI target (only in the file: secrets stay off the command
    /// line, where `ps` would show them).
    iscsi_chap: Option<ChapFile>,
    /// A socket path, or `true` for the default path.
    rpc: Option<toml::Value>,
    /// The metrics endpoint, HOST:PORT.
    metrics: Option<String>,
    force: Option<bool>,
    run: Option<bool>,
    io_timeout_ms: Option<u64>,
    max_block: Option<toml::Value>,
    nbd_max_connections: Option<usize>,
    nbd_handshake_timeout_ms: Option<u64>,
    nbd_max_handshakes: Option<usize>,
    nbd_idle_timeout_s: Option<u64>,
    /// `"on"`/`"off"` or a boolean.
    nbd_block_status: Option<toml::Value>,
    tls: Option<String>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_ca: Option<PathBuf>,
    queue_depth: Option<u32>,
    stripe_ops: Option<usize>,
    stripe_cache: Option<toml::Value>,
    write_hold_us: Option<u64>,
    qos: Option<String>,
    qos_target_us: Option<u64>,
    pacer: Option<String>,
    pacer_tolerance: Option<u64>,
    speed_min: Option<u64>,
    speed_max: Option<u64>,
}

/// `[iscsi_chap]` of the `--config` file.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct ChapFile {
    /// The CHAP name initiators must give.
    user: String,
    /// The initiator's secret.
    secret: String,
    /// Mutual CHAP: the target's name.
    mutual_user: Option<String>,
    /// Mutual CHAP: the target's secret.
    mutual_secret: Option<String>,
    /// Refuse initiators that do not authenticate the target.
    #[serde(default)]
    require_mutual: bool,
}

/// Parses `on` / `off` (a switch of the command line).
///
/// # Errors
/// Anything else, with the expected values.
fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: expected \"on\" or \"off\"")),
    }
}

/// A switch of the `--config` file: `"on"` / `"off"` or a boolean, naming `key`.
///
/// # Errors
/// Another value or type.
fn toml_on_off(v: &toml::Value, key: &str) -> Result<bool> {
    match v {
        toml::Value::Boolean(b) => Ok(*b),
        toml::Value::String(s) => parse_on_off(s)
            .map_err(anyhow::Error::msg)
            .with_context(|| key.to_string()),
        v => bail!("{key} = {v}: expected \"on\", \"off\", true or false"),
    }
}

/// Parses `HOST:PORT` or `unix:PATH`.
fn listen_spec(s: &str, o: &mut ServeOptions) -> Result<()> {
    if let Some(p) = s.strip_prefix("unix:") {
        if p.is_empty() {
            bail!("--nbd unix: needs a socket path");
        }
        o.nbd_unix.push(PathBuf::from(p));
    } else {
        let a: SocketAddr = s.parse().with_context(|| {
            format!("--nbd {s:?}: expected HOST:PORT (e.g. 127.0.0.1:10809) or unix:PATH")
        })?;
        o.nbd_tcp.push(a);
    }
    Ok(())
}

impl ServeArgs {
    /// The options, from the file first, then the command line over it (one array: a
    /// config of several `[[array]]` tables is [`ServeArgs::node_options`]' business).
    #[cfg(test)]
    fn options(&self) -> Result<ServeOptions> {
        let (o, tables, failed) = self.options_and_tables()?;
        if let Some((_, e)) = failed {
            return Err(e);
        }
        if !tables.is_empty() {
            bail!(
                "the config has {} [[array]] tables: serve them with node_options",
                tables.len()
            );
        }
        Ok(o)
    }

    /// The node `serve` runs: every array of the command line or the config, on one set
    /// of reactors. Several `[[array]]` tables each name their own exports (`nbd`,
    /// `iscsi`, `nvmf` keys of the table; two arrays cannot share a listening address);
    /// the top-level `nbd`/`iscsi`/`nvmf` then apply to none.
    ///
    /// # Errors
    /// As [`ServeArgs::options`]; a table that cannot be resolved (scan finds no such
    /// array) or whose exports do not parse; several tables with top-level exports.
    pub fn node_options(&self) -> Result<ferroraid::node::NodeOptions> {
        let (opts, mut unusable) = self.node_options_by_table()?;
        if unusable.is_empty() {
            Ok(opts)
        } else {
            Err(unusable.swap_remove(0).1)
        }
    }

    /// As [`ServeArgs::node_options`], but an `[[array]]` table that cannot be resolved
    /// (a scan that finds no such array, listed devices holding another array, an export
    /// address that does not parse) is left out of `arrays` and returned beside them with
    /// why: a reload starts the other tables' arrays and takes the settings, and logs
    /// these.
    ///
    /// # Errors
    /// As [`ServeArgs::node_options`], less the tables' own.
    #[allow(clippy::type_complexity)]
    fn node_options_by_table(
        &self,
    ) -> Result<(
        ferroraid::node::NodeOptions,
        Vec<(ferroraid::scan::ArrayTable, anyhow::Error)>,
    )> {
        let (o, tables, failed) = self.options_and_tables()?;
        if tables.is_empty() {
            let arrays = if o.devices.is_empty() || failed.is_some() {
                Vec::new()
            } else {
                vec![o.clone()]
            };
            return Ok((
                ferroraid::node::NodeOptions {
                    defaults: o,
                    arrays,
                },
                failed.into_iter().collect(),
            ));
        }
        if !(o.nbd_tcp.is_empty()
            && o.nbd_unix.is_empty()
            && o.iscsi.is_empty()
            && o.nvmf.is_empty())
        {
            bail!(
                "the config has {} [[array]] tables and top-level exports (nbd, iscsi, nvmf): \
                 give each table its own exports instead",
                tables.len()
            );
        }
        let mut arrays = Vec::with_capacity(tables.len());
        let mut unusable = Vec::new();
        // The devices of each table resolved so far, by table number (1-based).
        let mut seen: Vec<(usize, Vec<ferroraid::create::DeviceKey>)> = Vec::new();
        for (n, t) in tables.iter().enumerate() {
            let mut a = o.clone();
            let resolved = t.resolve().and_then(|devices| {
                // Two tables of one array would start it once and fail the other table
                // on every reload ("in use"): say which tables share devices.
                let mine: Vec<ferroraid::create::DeviceKey> = devices
                    .iter()
                    .map(|d| ferroraid::create::DeviceKey::of(d))
                    .collect();
                if let Some((first, _)) = seen
                    .iter()
                    .find(|(_, theirs)| theirs.iter().any(|d| mine.contains(d)))
                {
                    bail!(
                        "[[array]] tables {first} and {} name the same devices: one table \
                         per array",
                        n + 1
                    );
                }
                seen.push((n + 1, mine));
                a.devices = devices;
                t.exports_into(&mut a)
            });
            if let Err(e) = resolved {
                unusable.push((t.clone(), e));
                continue;
            }
            // A table without NBD addresses is not exported over NBD (the default port
            // would be every table's).
            a.nbd = !(a.nbd_tcp.is_empty() && a.nbd_unix.is_empty());
            arrays.push(a);
        }
        Ok((
            ferroraid::node::NodeOptions {
                defaults: o,
                arrays,
            },
            unusable,
        ))
    }

    /// The options (devices from the command line, the top level of the config, or its
    /// one `[[array]]` table) and the config's `[[array]]` tables when it has several.
    ///
    /// # Errors
    /// The file cannot be read or parsed; settings that are not valid. A single table
    /// that cannot be used (its devices not found, an export address that does not parse)
    /// is not an error here: it comes back third, with why, and the options have no
    /// devices (`options` refuses it; a reload starts nothing from it but takes the
    /// settings).
    #[allow(clippy::type_complexity)]
    fn options_and_tables(
        &self,
    ) -> Result<(
        ServeOptions,
        Vec<ferroraid::scan::ArrayTable>,
        Option<(ferroraid::scan::ArrayTable, anyhow::Error)>,
    )> {
        let file: ServeFile = match &self.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading {}", p.display()))?;
                toml::from_str(&text).map_err(|e| toml_error(p, &text, &e))?
            }
            None => ServeFile::default(),
        };
        let mut tables = Vec::new();
        let mut one_table = None;
        let mut one_table_error = None;
        let devices = if !self.devices.is_empty() {
            if file.array.as_ref().is_some_and(|t| !t.is_empty()) {
                bail!("devices on the command line and [[array]] tables in the config: keep one");
            }
            self.devices.clone()
        } else if let Some(t) = &file.array {
            if file.devices.is_some() {
                bail!("the config names devices both at the top and in [[array]]: keep one");
            }
            match t.as_slice() {
                [t] => {
                    one_table = Some(t.clone());
                    t.resolve().unwrap_or_else(|e| {
                        one_table_error = Some(e);
                        Vec::new()
                    })
                }
                [] => Vec::new(),
                _ => {
                    tables = t.clone();
                    Vec::new()
                }
            }
        } else {
            file.devices.clone().unwrap_or_default()
        };
        let rpc_given = self.rpc.is_some() || file.rpc.is_some();
        if devices.is_empty() && tables.is_empty() && !rpc_given && one_table_error.is_none() {
            bail!(
                "no member devices: name them on the command line, or in --config as \
                 `devices` or [[array]] tables (or give --rpc to start arrays later with \
                 `ferroraid start`)"
            );
        }
        let mut o = ServeOptions::new(devices);
        o.cores = if self.cores.is_empty() {
            file.cores.clone().unwrap_or_default()
        } else {
            self.cores.clone()
        };
        o.reactors = self.reactors.or(file.reactors).unwrap_or(1);
        if o.reactors == 0 {
            bail!("--reactors must be at least 1");
        }
        o.mode = if self.adaptive {
            Mode::Adaptive
        } else if self.polled {
            Mode::Polled
        } else {
            match file.mode.as_deref() {
                None | Some("polled") => Mode::Polled,
                Some("adaptive") => Mode::Adaptive,
                Some(m) => bail!("mode {m:?}: expected \"polled\" or \"adaptive\""),
            }
        };
        let nbd = if self.nbd.is_empty() {
            file.nbd.clone().unwrap_or_default()
        } else {
            self.nbd.clone()
        };
        if nbd.iter().any(|s| s == "none") {
            if nbd.len() > 1 {
                bail!("--nbd none: no other NBD address can be given with it");
            }
            o.nbd = false;
        } else {
            for s in &nbd {
                listen_spec(s, &mut o)?;
            }
        }
        let iscsi = if self.iscsi.is_empty() {
            file.iscsi.clone().unwrap_or_default()
        } else {
            self.iscsi.clone()
        };
        for s in &iscsi {
            o.iscsi.push(s.parse().with_context(|| {
                format!("--iscsi {s:?}: expected HOST:PORT (e.g. 127.0.0.1:3260)")
            })?);
        }
        let nvmf = if self.nvmf.is_empty() {
            file.nvmf.clone().unwrap_or_default()
        } else {
            self.nvmf.clone()
        };
        for s in &nvmf {
            o.nvmf.push(s.parse().with_context(|| {
                format!("--nvmf {s:?}: expected HOST:PORT (e.g. 127.0.0.1:4420)")
            })?);
        }
        o.nvmf_allow_hosts = if self.nvmf_allow_host.is_empty() {
            file.nvmf_allow_hosts.clone().unwrap_or_default()
        } else {
            self.nvmf_allow_host.clone()
        };
        for h in &o.nvmf_allow_hosts {
            anyhow::ensure!(
                !h.is_empty() && h.len() <= ferroraid::nvmf::spec::NQN_MAX,
                "--nvmf-allow-host {h:?}: an NQN is 1 to {} bytes",
                ferroraid::nvmf::spec::NQN_MAX
            );
        }
        if let Some(c) = &file.iscsi_chap {
            let mutual = match (&c.mutual_user, &c.mutual_secret) {
                (Some(u), Some(s)) => Some((u.clone(), s.clone())),
                (None, None) => None,
                _ => bail!("iscsi_chap: mutual_user and mutual_secret go together"),
            };
            if c.require_mutual && mutual.is_none() {
                bail!("iscsi_chap: require_mutual needs mutual_user and mutual_secret");
            }
            o.iscsi_config.chap = Some(ferroraid::iscsi::ChapConfig {
                user: c.user.clone(),
                secret: c.secret.clone(),
                mutual,
                require_mutual: c.require_mutual,
            });
        }
        o.force = self.force || file.force.unwrap_or(false);
        o.run = self.run || file.run.unwrap_or(false);
        if let Some(ms) = self.io_timeout_ms.or(file.io_timeout_ms) {
            o.io_timeout = Duration::from_millis(ms);
        }
        let max_block = match (self.max_block, &file.max_block) {
            (Some(b), _) => Some(b),
            (None, Some(v)) => Some(toml_bytes(v, "max_block")?),
            (None, None) => None,
        };
        if let Some(b) = max_block {
            o.max_block_bytes = u32::try_from(b)
                .ok()
                .filter(|&b| b >= 4096)
                .with_context(|| format!("max_block {b}: expected 4K to 4G"))?;
        }
        let nbd = &mut o.nbd_config;
        if let Some(n) = self.nbd_max_connections.or(file.nbd_max_connections) {
            if n == 0 {
                bail!("nbd_max_connections 0: expected at least 1");
            }
            nbd.max_connections = Some(n);
        }
        if let Some(ms) = self
            .nbd_handshake_timeout_ms
            .or(file.nbd_handshake_timeout_ms)
        {
            if ms == 0 {
                bail!("nbd_handshake_timeout_ms 0: expected at least 1");
            }
            nbd.handshake_timeout = Duration::from_millis(ms);
        }
        if let Some(n) = self.nbd_max_handshakes.or(file.nbd_max_handshakes) {
            if n == 0 {
                bail!("nbd_max_handshakes 0: expected at least 1");
            }
            nbd.max_handshakes = n;
        }
        if let Some(s) = self.nbd_idle_timeout_s.or(file.nbd_idle_timeout_s) {
            nbd.idle_timeout = (s > 0).then(|| Duration::from_secs(s));
        }
        o.nbd_block_status = match (self.nbd_block_status, &file.nbd_block_status) {
            (Some(b), _) => b,
            (None, Some(v)) => toml_on_off(v, "nbd_block_status")?,
            (None, None) => true,
        };
        let tls = match (self.tls, &file.tls) {
            (Some(m), _) => m,
            (None, Some(m)) => m.parse().map_err(anyhow::Error::msg).context("tls")?,
            (None, None) => ferroraid::nbd::TlsMode::Off,
        };
        let cert = self.tls_cert.as_ref().or(file.tls_cert.as_ref());
        let key = self.tls_key.as_ref().or(file.tls_key.as_ref());
        let ca = self.tls_ca.as_ref().or(file.tls_ca.as_ref());
        match (tls, cert, key) {
            (ferroraid::nbd::TlsMode::Off, None, None) if ca.is_none() => {}
            (ferroraid::nbd::TlsMode::Off, ..) => {
                bail!("tls_cert, tls_key and tls_ca need --tls allow or --tls require")
            }
            (mode, Some(cert), Some(key)) => {
                o.nbd_tls = Some(
                    ferroraid::nbd::TlsConfig::from_pem_files(mode, cert, key, ca.map(|p| &**p))
                        .context("loading the NBD TLS credentials")?,
                );
            }
            (mode, ..) => bail!("--tls {mode} needs --tls-cert and --tls-key (PEM files)"),
        }
        if let Some(q) = self.queue_depth.or(file.queue_depth) {
            o.queue_depth = q;
        }
        if let Some(s) = self.stripe_ops.or(file.stripe_ops) {
            anyhow::ensure!(
                s >= 1,
                "stripe_ops 0: a reactor needs at least 1 stripe operation to serve writes"
            );
            o.stripe_ops = s;
        }
        let stripe_cache = match (self.stripe_cache, &file.stripe_cache) {
            (Some(b), _) => Some(b),
            (None, Some(v)) => Some(toml_bytes(v, "stripe_cache")?),
            (None, None) => None,
        };
        if stripe_cache.is_some() {
            o.stripe_cache_bytes = stripe_cache;
        }
        if let Some(us) = self.write_hold_us.or(file.write_hold_us) {
            o.write_hold = Duration::from_micros(us);
        }
        if let Some(q) = self.qos.as_ref().or(file.qos.as_ref()) {
            o.depth.policy = match q.as_str() {
                "ferroraid" => engine::qos::DepthPolicy::Ferroraid,
                "wbt-like" | "wbt" => engine::qos::DepthPolicy::WbtLike,
                "off" => engine::qos::DepthPolicy::Off,
                other => bail!("qos {other:?}: expected \"ferroraid\", \"wbt-like\" or \"off\""),
            };
        }
        if let Some(us) = self.qos_target_us.or(file.qos_target_us) {
            if us == 0 {
                bail!("qos_target_us 0: expected a latency target in µs (at least 1)");
            }
            o.depth.target_latency_ns = Some(us.saturating_mul(1000));
        }
        if let Some(p) = self.pacer.as_ref().or(file.pacer.as_ref()) {
            o.pacer = p.parse().map_err(anyhow::Error::msg)?;
        }
        if let Some(pct) = self.pacer_tolerance.or(file.pacer_tolerance) {
            if o.pacer != engine::qos::pacer::PacerKind::Ferroraid {
                bail!(
                    "pacer_tolerance {pct}: only the ferroraid pacer has a tolerance (pacer is {})",
                    o.pacer.name()
                );
            }
            o.pacer_tolerance =
                engine::qos::pacer::FerroraidPacerConfig::tolerance_from_percent(pct)
                    .map_err(anyhow::Error::msg)?;
        }
        let speed_min = self
            .speed_min
            .or(file.speed_min)
            .unwrap_or(engine::qos::pacer::MD_SPEED_MIN / 1024);
        let speed_max = self
            .speed_max
            .or(file.speed_max)
            .unwrap_or(engine::qos::pacer::MD_SPEED_MAX / 1024);
        o.speed_limits = engine::qos::pacer::SpeedLimits::from_kib_per_s(speed_min, speed_max)
            .map_err(anyhow::Error::msg)?;
        o.rpc = match (&self.rpc, &file.rpc) {
            (Some(p), _) if p.as_os_str() == "default" => Some(ferroraid::rpc::default_rpc_path()),
            (Some(p), _) => Some(p.clone()),
            (None, None) | (None, Some(toml::Value::Boolean(false))) => None,
            (None, Some(toml::Value::Boolean(true))) => Some(ferroraid::rpc::default_rpc_path()),
            (None, Some(toml::Value::String(p))) => Some(PathBuf::from(p)),
            (None, Some(v)) => {
                bail!("rpc = {v}: expected a socket path or true (the default path)")
            }
        };
        if let Some(m) = self.metrics.as_ref().or(file.metrics.as_ref()) {
            o.metrics = Some(m.parse().with_context(|| {
                format!("--metrics {m:?}: expected HOST:PORT (e.g. 127.0.0.1:9750)")
            })?);
        }
        if let Some(t) = &one_table {
            if t.has_exports() {
                o.nbd_tcp.clear();
                o.nbd_unix.clear();
                o.iscsi.clear();
                o.nvmf.clear();
                if let Err(e) = t.exports_into(&mut o) {
                    one_table_error.get_or_insert(e);
                    o.devices.clear();
                }
            }
            // `nbd = []` says no NBD export, as it does among several tables (without the
            // key, one table follows serve's default: NBD on 127.0.0.1:10809).
            if t.nbd.as_ref().is_some_and(Vec::is_empty) {
                o.nbd = false;
            }
        }
        let failed = one_table.zip(one_table_error);
        Ok((o, tables, failed))
    }
}

/// SIGINT/SIGTERM set the returned flag. Further ones change nothing: a stop always drains,
/// flushes and marks the array clean (service managers and `timeout` may signal twice);
/// SIGKILL is the way to stop at once (the array is then left dirty, as after a crash).
fn stop_flag() -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&flag))?;
    }
    Ok(flag)
}

/// Runs `ferroraid serve` until SIGINT/SIGTERM: every array of the command line or the
/// config on one set of reactors ([`ferroraid::node::Node`]). SIGHUP re-reads the config
/// and starts the arrays it names that are not running; an array running but no longer
/// in the config keeps running (logged: `ferroraid stop NAME` stops it). Under a service
/// manager that set `NOTIFY_SOCKET` (systemd's `Type=notify`), says `READY=1` once every
/// configured array is up — assembled, exported, with the management socket and the
/// metrics endpoint listening — and `STOPPING=1` when the stop begins; a start that fails
/// says why in `STATUS=` (the unit then fails on the exit status).
pub fn run_serve(a: &ServeArgs) -> Result<()> {
    let opts = a.node_options()?;
    let stop = stop_flag()?;
    let reload = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGHUP, Arc::clone(&reload))?;
    let notifier = ferroraid::notify::Notifier::from_env();
    let node = match Node::start(&opts) {
        Ok(n) => n,
        Err(e) => {
            let why = ferroraid::notify::status_line(&format!(
                "start failed: {}",
                ferroraid::error_text(&e)
            ));
            notify(notifier.as_ref(), &[NotifyState::Status(&why)]);
            return Err(e);
        }
    };
    if let Some(n) = &notifier {
        let status = node_status(&node);
        match n.notify(&[NotifyState::Ready, NotifyState::Status(&status)]) {
            Ok(()) => tracing::info!("told the service manager: ready"),
            Err(e) => tracing::warn!("cannot notify the service manager (READY=1): {e}"),
        }
    }
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
        if reload.swap(false, Ordering::AcqRel) {
            notify(notifier.as_ref(), &[NotifyState::Reloading]);
            reload_config(a, &node);
            let status = node_status(&node);
            notify(
                notifier.as_ref(),
                &[NotifyState::Ready, NotifyState::Status(&status)],
            );
        }
    }
    tracing::info!("stopping: draining requests, flushing members, marking the arrays clean");
    notify(
        notifier.as_ref(),
        &[
            NotifyState::Stopping,
            NotifyState::Status(
                "stopping: draining requests, flushing members, marking the arrays clean",
            ),
        ],
    );
    node.stop()
}

/// SIGHUP: re-reads the config (without `--config`: nothing to do) and starts every
/// array it names that is not running (an
/// array is running when one of its devices is a member of a running array). Never stops
/// an array: one no longer in the config is logged. Changed settings are logged by key:
/// the array settings become those of every array started from now on (by this reload,
/// `ferroraid start`, `array_create`); running arrays and the node's own settings
/// ([`ferroraid::node::NODE_SETTINGS`]) keep theirs ([`Node::reload_defaults`]). Errors
/// are logged, never fatal (the running arrays serve on).
fn reload_config(a: &ServeArgs, node: &Node) {
    if a.config.is_none() {
        tracing::info!("SIGHUP: serve runs without --config: nothing to reload");
        return;
    }
    tracing::info!("SIGHUP: reloading the configuration");
    let (opts, unusable) = match a.node_options_by_table() {
        Ok(v) => v,
        Err(e) => {
            tracing::error!(
                "reload: the configuration is not usable, nothing changed: {}",
                ferroraid::error_text(&e)
            );
            return;
        }
    };
    let changed = node.reload_defaults(&opts.defaults);
    if !changed.node.is_empty() {
        tracing::warn!(
            "reload: changed in the configuration, not applied until `serve` restarts (the \
             reactors, the management socket and the metrics endpoint keep their settings): {}",
            changed.node.join("; ")
        );
    }
    if !changed.arrays.is_empty() {
        tracing::warn!(
            "reload: changed in the configuration, applied to arrays started from now on; \
             running arrays keep their settings until stopped and started again: {}",
            changed.arrays.join("; ")
        );
    }
    if !changed.config_starts.is_empty() {
        tracing::warn!(
            "reload: changed in the configuration, applied to the arrays it starts from now \
             on (`ferroraid start` and `array_create` give their own --force/--run): {}",
            changed.config_starts.join("; ")
        );
    }
    let canon = |p: &std::path::Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let mut running: Vec<(String, Vec<PathBuf>)> = Vec::new();
    node.for_each_array(|t| {
        running.push((
            t.name().to_string(),
            t.member_paths()
                .into_iter()
                .flatten()
                .map(|p: PathBuf| canon(&p))
                .collect(),
        ));
    });
    let mut wanted = vec![false; running.len()];
    for (t, e) in &unusable {
        // A running array's own table may be the one that does not resolve (an export
        // typo, a changed name): it is still that array's, not a table gone.
        let devs: Vec<PathBuf> = t.devices.iter().flatten().map(|p| canon(p)).collect();
        let of = running.iter().position(|(name, paths)| {
            devs.iter().any(|d| paths.contains(d))
                || t.name
                    .as_deref()
                    .is_some_and(|n| ferroraid::scan::name_matches(n, name))
        });
        match of {
            Some(i) => {
                wanted[i] = true;
                tracing::error!(
                    array = %running[i].0,
                    "reload: the array's table is not usable; the array keeps running as it \
                     is: {}",
                    ferroraid::error_text(e)
                );
            }
            None => tracing::error!(
                "reload: cannot start an array: {}",
                ferroraid::error_text(e)
            ),
        }
    }
    for o in &opts.arrays {
        let devs: Vec<PathBuf> = o.devices.iter().map(|p| canon(p)).collect();
        if let Some(i) = running
            .iter()
            .position(|(_, paths)| devs.iter().any(|d| paths.contains(d)))
        {
            wanted[i] = true;
            let name = &running[i].0;
            let unnamed: Vec<String> = running[i]
                .1
                .iter()
                .filter(|p| !devs.contains(p))
                .map(|p| p.display().to_string())
                .collect();
            if !unnamed.is_empty() {
                // A member replaced since the configuration was written: the next start
                // from it would leave this one out.
                tracing::warn!(
                    array = %name,
                    "reload: the configuration does not name the running member(s) {}; \
                     the array keeps running on them — add them to its table (a start from \
                     this configuration would leave them out)",
                    unnamed.join(", ")
                );
            }
            let drift = node.with_array(name, |t| export_drift(o, &t.exports()));
            if let Some(Some((want, have))) = drift {
                tracing::warn!(
                    array = %name,
                    "reload: the configuration exports the array at {want}; it is \
                     exported at {have} and stays so (`ferroraid export add|remove` \
                     changes a running array's exports)"
                );
            }
            continue;
        }
        match node.start_array(o) {
            Ok(name) => tracing::info!(array = %name, "reload: array started"),
            Err(e) => {
                tracing::error!(devices = ?o.devices, "reload: cannot start an array: {}", ferroraid::error_text(&e))
            }
        }
    }
    for ((name, _), w) in running.iter().zip(wanted) {
        if !w {
            tracing::warn!(
                array = %name,
                "reload: the array is no longer in the configuration; it keeps running \
                 (`ferroraid stop {name}` stops it)"
            );
        }
    }
}

/// Where the configuration's array `o` is to be exported ([`ServeOptions::export_specs`])
/// and where it is (`have`, its live exports) when they differ: each a list of
/// `protocol address`, sorted. An NBD export with no address is the NBD default
/// ([`ferroraid::nbd::DEFAULT_LISTEN`]); a configured TCP port 0 matches any port of its
/// IP.
fn export_drift(o: &ServeOptions, have: &[ExportReport]) -> Option<(String, String)> {
    let mut want: Vec<(ExportProtocol, String)> = Vec::new();
    for spec in o.export_specs() {
        let p = spec.protocol;
        if p == ExportProtocol::Nbd && spec.tcp.is_empty() && spec.unix.is_empty() {
            want.push((p, ferroraid::nbd::DEFAULT_LISTEN.to_string()));
        }
        want.extend(spec.tcp.iter().map(|a| (p, a.to_string())));
        want.extend(
            spec.unix
                .iter()
                .map(|u| (p, unix_path(&u.display().to_string()))),
        );
    }
    // A port-0 entry matches a bound port of its IP that no other entry names (an
    // explicit entry's own, or one an earlier port-0 entry took).
    let mut taken: Vec<bool> = have
        .iter()
        .map(|h| {
            want.iter()
                .any(|(p, a)| *p == h.protocol && *a == h.address)
        })
        .collect();
    for (protocol, address) in &mut want {
        let Ok(a) = address.parse::<SocketAddr>() else {
            continue;
        };
        if a.port() != 0 {
            continue;
        }
        let bound = have.iter().zip(&taken).position(|(h, &t)| {
            !t && h.protocol == *protocol
                && h.address
                    .parse::<SocketAddr>()
                    .is_ok_and(|b| b.ip() == a.ip())
        });
        if let Some(i) = bound {
            taken[i] = true;
            address.clone_from(&have[i].address);
        }
    }
    let list = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let want = list(want.iter().map(|(p, a)| format!("{p} {a}")).collect());
    let have = list(
        have.iter()
            .map(|h| format!("{} {}", h.protocol, unix_path(&h.address)))
            .collect(),
    );
    let show = |v: &[String]| {
        if v.is_empty() {
            "no address".to_string()
        } else {
            v.join(", ")
        }
    };
    (want != have).then(|| (show(&want), show(&have)))
}

/// A Unix socket path in one spelling (`a//b/./c` is `a/b/c`: the same socket); a TCP
/// address (`IP:PORT`, no `/`) as given.
fn unix_path(address: &str) -> String {
    if !address.contains('/') {
        return address.to_string();
    }
    let p: PathBuf = std::path::Path::new(address).components().collect();
    p.display().to_string()
}

/// The one-line `STATUS=` of a running node (what `systemctl status` shows): each array
/// with its members online, and where it is exported.
fn node_status(node: &Node) -> String {
    let mut parts = Vec::new();
    node.for_each_array(|t| parts.push(array_status(t)));
    if parts.is_empty() {
        return "serving no array (start one with `ferroraid start`)".into();
    }
    ferroraid::notify::status_line(&parts.join("; "))
}

/// Sends `state` to the service manager, if there is one; a failure is logged, never
/// fatal (the data path does not depend on systemd hearing from us).
fn notify(n: Option<&ferroraid::notify::Notifier>, state: &[NotifyState]) {
    if let Some(n) = n {
        if let Err(e) = n.notify(state) {
            tracing::warn!("cannot notify the service manager: {e}");
        }
    }
}

/// One array's part of the status line: name, members online, exports.
fn array_status(t: &Target) -> String {
    let snap = t.handle().snapshot();
    let online = snap
        .members
        .iter()
        .filter(|m| m.state == MemberState::Online)
        .count();
    let mut exports: Vec<String> = t
        .nbd_tcp_addrs()
        .iter()
        .map(|a| format!("nbd {a}"))
        .collect();
    exports.extend(
        t.nbd_unix_paths()
            .iter()
            .map(|p| format!("nbd unix:{}", p.display())),
    );
    exports.extend(t.iscsi_addrs().iter().map(|a| format!("iscsi {a}")));
    format!(
        "serving array \"{}\": {online}/{} members online; {}",
        t.name(),
        snap.members.len(),
        exports.join(", ")
    )
}

/// Serves until `stop` is set, then stops cleanly; with `live`, a status line every
/// second on stdout. `notifier`: the service manager hears `STOPPING=1` when the stop
/// begins.
fn serve_until(
    target: Target,
    stop: &AtomicBool,
    live: bool,
    notifier: Option<&ferroraid::notify::Notifier>,
) -> Result<()> {
    let tty = std::io::stdout().is_terminal();
    let mut last = (Instant::now(), 0u64, 0u64, 0u64);
    let mut next = Instant::now() + Duration::from_secs(1);
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
        if live && Instant::now() >= next {
            next += Duration::from_secs(1);
            let snap = target.handle().snapshot();
            let (mut ops, mut rb, mut wb) = (0u64, 0u64, 0u64);
            for m in &snap.members {
                ops += m.counters.reads + m.counters.writes;
                rb += m.counters.read_bytes;
                wb += m.counters.write_bytes;
            }
            let dt = last.0.elapsed().as_secs_f64().max(1e-3);
            let online = snap
                .members
                .iter()
                .filter(|m| m.state == MemberState::Online)
                .count();
            let line = format!(
                "{} · {online}/{} members · member I/O {:.0}/s, read {:.1} MB/s, write {:.1} MB/s · events {}",
                if online == snap.members.len() { "healthy" } else { "DEGRADED" },
                snap.members.len(),
                (ops - last.1) as f64 / dt,
                (rb - last.2) as f64 / dt / 1e6,
                (wb - last.3) as f64 / dt / 1e6,
                target.events()
            );
            last = (Instant::now(), ops, rb, wb);
            if tty {
                say_part!("\r\x1b[2K{line}")?;
                use std::io::Write as _;
                std::io::stdout().flush()?;
            } else {
                say!("{line}")?;
            }
        }
    }
    if live && tty {
        say!()?;
    }
    tracing::info!("stopping: draining requests, flushing members, marking the array clean");
    notify(
        notifier,
        &[
            NotifyState::Stopping,
            NotifyState::Status(
                "stopping: draining requests, flushing members, marking the array clean",
            ),
        ],
    );
    target.stop()
}

/// Options of `ferroraid demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Data directory (created if missing; an array already there is reused).
    #[arg(long, default_value = "ferroraid-demo")]
    dir: PathBuf,
    /// NBD address: HOST:PORT or unix:PATH.
    #[arg(long, default_value = "127.0.0.1:10809")]
    nbd: String,
    /// Size of each of the six sparse member files (a new array only).
    #[arg(long, default_value = "256M", value_parser = crate::parse_bytes)]
    member_size: u64,
    /// Reactors (adaptive mode).
    #[arg(long, default_value_t = 1)]
    reactors: usize,
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    seconds: Option<u64>,
    /// Start the existing array even if members are missing or it is dirty and degraded
    /// (as `serve --force`).
    #[arg(long)]
    force: bool,
}

/// Members of the demo array (RAID6: four data + P + Q).
const DEMO_MEMBERS: usize = 6;

/// Runs `ferroraid demo`.
pub fn run_demo(a: &DemoArgs) -> Result<()> {
    std::fs::create_dir_all(&a.dir)
        .with_context(|| format!("creating data directory {}", a.dir.display()))?;
    let paths: Vec<PathBuf> = (0..DEMO_MEMBERS)
        .map(|i| a.dir.join(format!("member-{i}.img")))
        .collect();
    let present = paths.iter().filter(|p| p.exists()).count();
    if present == 0 {
        for p in &paths {
            let f = std::fs::File::options()
                .write(true)
                .create_new(true)
                .open(p)
                .with_context(|| format!("creating {}", p.display()))?;
            f.set_len(a.member_size)
                .with_context(|| format!("sizing {}", p.display()))?;
        }
        let geometry = Geometry::new(
            Level::Raid6,
            Layout::LeftSymmetric,
            DEMO_MEMBERS as u16,
            64 << 10,
            512,
        )?;
        let c = create(&CreateOptions {
            geometry,
            name: "demo".into(),
            devices: paths.clone(),
            assume_clean: false,
            force: false,
            progress: false,
            zero_progress: None,
            bitmap: Default::default(),
            bitmap_chunk_bytes: None,
            consistency_policy: None,
        })?;
        say!(
            "created RAID6 \"demo\" over {DEMO_MEMBERS} sparse {}-byte member files in {} ({} bytes)",
            a.member_size,
            a.dir.display(),
            c.size_bytes
        )?;
    } else {
        say!("reusing the array in {}", a.dir.display())?;
    }
    let mut o = ServeOptions::new(paths);
    o.rpc = Some(a.dir.join("ferroraid.sock"));
    o.force = a.force;
    o.mode = Mode::Adaptive;
    o.reactors = a.reactors.max(1);
    listen_spec(&a.nbd, &mut o)?;
    let stop = stop_flag()?;
    let target = Target::start(&o).with_context(|| {
        format!(
            "serving the demo array in {} (--force starts it degraded or dirty; deleting the \
             directory starts over with a new, empty array)",
            a.dir.display()
        )
    })?;
    let url = match (
        target.nbd_tcp_addrs().first(),
        target.nbd_unix_paths().first(),
    ) {
        (Some(t), _) => format!("nbd://{t}/{}", target.name()),
        (None, Some(u)) => format!("nbd+unix:///{}?socket={}", target.name(), u.display()),
        _ => bail!("the NBD server listens nowhere"),
    };
    print_howto(&url, &target, &a.dir)?;
    if let Some(s) = a.seconds {
        let stop2 = Arc::clone(&stop);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(s));
            stop2.store(true, Ordering::Release);
        });
    }
    serve_until(target, &stop, true, None)
}

fn print_howto(url: &str, t: &Target, dir: &Path) -> Result<()> {
    let g = t.geometry().geometry();
    say!(
        "serving RAID{} {} ({} members, {} KiB chunk, {} bytes) as NBD export {:?}",
        g.level().md_level(),
        g.layout(),
        g.members(),
        g.chunk_bytes() / 1024,
        t.geometry().capacity_bytes(),
        t.name()
    )?;
    say!("  connect:   {url}")?;
    say!("  try:       qemu-io -f raw -c 'write -P 0x5a 0 1M' -c 'read -P 0x5a 0 1M' {url}")?;
    say!("             nbdinfo {url}")?;
    say!("             nbdcopy disk.img {url}   # and back: nbdcopy {url} copy.img")?;
    if let Some(a) = t.nbd_tcp_addrs().first() {
        say!(
            "             nbd-client {} {} /dev/nbd0 -N {}   # kernel client, as root",
            a.ip(),
            a.port(),
            t.name()
        )?;
    }
    say!(
        "  members:   {}/member-0.img … member-{}.img (md v1.2: mdadm --examine reads them)",
        dir.display(),
        g.members() - 1
    )?;
    say!(
        "  status:    ferroraid status --rpc {}   (--json for scripts)",
        dir.join("ferroraid.sock").display()
    )?;
    say!("Ctrl-C stops: drains requests, flushes the members, marks the array clean.")?;
    Ok(())
}

/// A config file's parse error without the file's text: toml's own message quotes the
/// offending line, and that line may hold a secret (`[iscsi_chap]`, the TLS key's path is
/// harmless but a CHAP secret is not). Gives the file, the line and column (1-based) and
/// toml's message.
fn toml_error(path: &std::path::Path, text: &str, e: &toml::de::Error) -> anyhow::Error {
    match e.span() {
        Some(span) => {
            let start = span.start.min(text.len());
            let before = &text[..start];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            // serde's message quotes a value of the wrong type (`invalid type: integer
            // `123`, expected a string`): not where it may be a secret — inside the
            // `[iscsi_chap]` table, or on a line that names CHAP or a secret (or spells a
            // key with escapes, which could be either).
            let line_text = text[before.rfind('\n').map_or(0, |i| i + 1)..]
                .lines()
                .next()
                .unwrap_or("")
                .to_ascii_lowercase();
            let table = before
                .lines()
                .rev()
                .map(str::trim)
                .find(|l| l.starts_with('['))
                .unwrap_or("")
                .to_ascii_lowercase();
            let secret = table.contains("chap")
                || ["secret", "chap", "\\u", "\\x"]
                    .iter()
                    .any(|w| line_text.contains(w));
            let message = if secret {
                "not a valid value here (the message is not shown: it may quote a secret)"
            } else {
                e.message()
            };
            anyhow!(
                "parsing {}: line {line}, column {column}: {message}",
                path.display(),
            )
        }
        None => anyhow!("parsing {}: {}", path.display(), e.message()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn options(args: &[&str]) -> Result<ServeOptions> {
        let mut v = vec!["serve"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v)?.serve.options()
    }

    /// A config that does not parse is reported by line and column, without quoting the
    /// line (it may be a CHAP secret's).
    #[test]
    fn a_config_parse_error_never_quotes_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("node.toml");
        std::fs::write(
            &cfg,
            "devices = [\"m0\"]\n[iscsi_chap]\nuser = \"u\"\nsecret = \"SuperSecretChap123\n",
        )
        .unwrap();
        let parse_error = || {
            format!(
                "{:#}",
                options(&["--config", cfg.to_str().unwrap()]).unwrap_err()
            )
        };
        let e = parse_error();
        assert!(!e.contains("SuperSecret"), "{e}");
        assert!(e.contains("node.toml: line 4, column"), "{e}");
        // A secret of the wrong type: serde's message would quote it.
        for chap in [
            "[iscsi_chap]\nuser = \"u\"\nsecret = 918273645",
            "iscsi_chap = { user = \"u\", secret = 918273645 }",
            "[iscsi_chap]\nuser = \"u\"\n\"s\\u0065cret\" = 918273645",
            "iscsi_chap = \"918273645\"",
        ] {
            std::fs::write(&cfg, format!("devices = [\"m0\"]\n{chap}\n")).unwrap();
            let e = parse_error();
            assert!(!e.contains("918273645") && e.contains("line "), "{e}");
        }
        // Other keys keep serde's message.
        std::fs::write(&cfg, "devices = [\"m0\"]\nqueue_depth = \"deep\"\n").unwrap();
        let e = parse_error();
        assert!(
            e.contains("line 2, column 15: invalid type: string \"deep\""),
            "{e}"
        );
    }

    /// One `[[array]]` table: `nbd = []` means no NBD export (as among several tables),
    /// no `nbd` key follows serve's default, addresses are the table's.
    #[test]
    fn one_table_nbd_empty_means_none() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("node.toml");
        let c = cfg.to_str().unwrap();
        for (nbd, want) in [
            ("nbd = []\n", (false, 0)),
            ("", (true, 0)),
            ("nbd = [\"127.0.0.1:10900\"]\n", (true, 1)),
        ] {
            std::fs::write(&cfg, format!("[[array]]\ndevices = [\"m0\"]\n{nbd}")).unwrap();
            let o = options(&["--config", c]).unwrap();
            assert_eq!((o.nbd, o.nbd_tcp.len()), want, "{nbd:?}");
        }
    }

    /// One `[[array]]` table that cannot be used: `serve` refuses to start, a reload gets
    /// the settings and the table's error (it blocked the whole reload; several tables
    /// never did).
    #[test]
    fn one_unusable_table_leaves_the_settings_to_a_reload() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("node.toml");
        let c = cfg.to_str().unwrap();
        for table in [
            format!(
                "scan = [{:?}]\nname = \"gone\"\n",
                format!("{}/absent*", dir.path().display())
            ),
            "devices = [\"m0\"]\nnbd = [\"localhost:1\"]\n".to_string(),
        ] {
            std::fs::write(&cfg, format!("queue_depth = 48\n[[array]]\n{table}")).unwrap();
            assert!(options(&["--config", c]).is_err(), "{table}");
            let args = Cli::try_parse_from(["serve", "--config", c]).unwrap().serve;
            let (opts, unusable) = args.node_options_by_table().unwrap();
            assert_eq!(unusable.len(), 1, "{table}");
            assert!(opts.arrays.is_empty(), "{table}");
            assert_eq!(opts.defaults.queue_depth, 48);
        }
    }

    /// Two tables naming the same devices: the later one is refused, naming both.
    #[test]
    fn two_tables_of_one_array_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("node.toml");
        let c = cfg.to_str().unwrap();
        let m = dir.path().join("m0.img");
        std::fs::write(&m, b"").unwrap();
        let table = |dev: &std::path::Path| format!("[[array]]\ndevices = [{dev:?}]\n");
        // The second spells the same file another way.
        let other = dir.path().join(".").join("m0.img");
        std::fs::write(&cfg, format!("{}{}", table(&m), table(&other))).unwrap();
        let args = Cli::try_parse_from(["serve", "--config", c]).unwrap().serve;
        let (opts, unusable) = args.node_options_by_table().unwrap();
        assert_eq!(opts.arrays.len(), 1);
        let e = format!("{:#}", unusable[0].1);
        assert!(e.contains("tables 1 and 2 name the same devices"), "{e}");
        assert!(args.node_options().is_err());
    }

    #[test]
    fn nvmf_addresses_from_flags_and_config() {
        let o = options(&["m0"]).unwrap();
        assert!(o.nvmf.is_empty());
        let o = options(&["--nvmf", "127.0.0.1:4420", "--nvmf", "[::1]:8009", "m0"]).unwrap();
        assert_eq!(
            o.nvmf,
            vec![
                "127.0.0.1:4420".parse::<std::net::SocketAddr>().unwrap(),
                "[::1]:8009".parse().unwrap()
            ]
        );
        let e = options(&["--nvmf", "localhost", "m0"]).err().unwrap();
        assert!(
            ferroraid::error_text(&e).contains("HOST:PORT"),
            "{}",
            ferroraid::error_text(&e)
        );
        let dir = std::env::temp_dir().join(format!("ferroraid-nvmf-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("serve.toml");
        std::fs::write(&cfg, "devices = [\"m0\"]\nnvmf = [\"0.0.0.0:4420\"]\n").unwrap();
        let c = cfg.to_str().unwrap();
        let o = options(&["--config", c]).unwrap();
        assert_eq!(o.nvmf, vec!["0.0.0.0:4420".parse().unwrap()]);
        // The command line wins over the file.
        let o = options(&["--config", c, "--nvmf", "127.0.0.2:4421"]).unwrap();
        assert_eq!(o.nvmf, vec!["127.0.0.2:4421".parse().unwrap()]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn qos_policy_and_target_are_selectable() {
        let o = options(&["m0", "m1", "m2"]).unwrap();
        assert_eq!(o.depth, engine::qos::DepthConfig::default());
        let o = options(&["--qos", "wbt-like", "--qos-target-us", "750", "m0"]).unwrap();
        assert_eq!(o.depth.policy, engine::qos::DepthPolicy::WbtLike);
        assert_eq!(o.depth.target_latency_ns, Some(750_000));
        let o = options(&["--qos", "off", "m0"]).unwrap();
        assert_eq!(o.depth.policy, engine::qos::DepthPolicy::Off);
        let e = options(&["--qos", "fast", "m0"]).err().unwrap();
        assert!(e.to_string().contains("expected"), "{e}");
        assert!(options(&["--qos-target-us", "0", "m0"]).is_err());
    }

    /// A reload compares where the config exports a running array with where it is
    /// exported: the NBD default when no address is given, port 0 as any port of its IP,
    /// order ignored; a difference lists both sides.
    #[test]
    fn export_drift_compares_configured_and_live_exports() {
        let live = |v: &[(ExportProtocol, &str)]| -> Vec<ExportReport> {
            v.iter()
                .map(|&(protocol, address)| ExportReport {
                    protocol,
                    address: address.to_string(),
                    name: "a".into(),
                })
                .collect()
        };
        let nbd = ExportProtocol::Nbd;
        let o = options(&["m0"]).unwrap();
        assert_eq!(export_drift(&o, &live(&[(nbd, "127.0.0.1:10809")])), None);
        let o = options(&["--nbd", "127.0.0.1:0", "--iscsi", "127.0.0.1:3261", "m0"]).unwrap();
        let both = live(&[
            (ExportProtocol::Iscsi, "127.0.0.1:3261"),
            (nbd, "127.0.0.1:41234"),
        ]);
        assert_eq!(export_drift(&o, &both), None);
        let o = options(&["--nbd", "127.0.0.1:10810", "m0"]).unwrap();
        assert_eq!(
            export_drift(&o, &live(&[(nbd, "127.0.0.1:10809")])),
            Some((
                "nbd 127.0.0.1:10810".to_string(),
                "nbd 127.0.0.1:10809".to_string()
            ))
        );
        assert_eq!(
            export_drift(&o, &[]),
            Some(("nbd 127.0.0.1:10810".to_string(), "no address".to_string()))
        );
        // Port 0 beside an explicit port of the same IP takes the other bound port, not
        // the explicit entry's (it once reported 36514 twice and a drift that was none).
        let o = options(&["--nbd", "127.0.0.1:0", "--nbd", "127.0.0.1:36514", "m0"]).unwrap();
        let bound = live(&[(nbd, "127.0.0.1:36514"), (nbd, "127.0.0.1:36513")]);
        assert_eq!(export_drift(&o, &bound), None);
        // A Unix socket path spelled with `//` or `/./` is the same socket.
        let o = options(&["--nbd", "unix:/run/x//a/./n.sock", "m0"]).unwrap();
        assert_eq!(export_drift(&o, &live(&[(nbd, "/run/x/a/n.sock")])), None);
        let o = options(&["--nbd", "127.0.0.1:0", "--nbd", "127.0.0.1:36514", "m0"]).unwrap();
        let one = live(&[(nbd, "127.0.0.1:36514")]);
        assert_eq!(
            export_drift(&o, &one),
            Some((
                "nbd 127.0.0.1:0, nbd 127.0.0.1:36514".to_string(),
                "nbd 127.0.0.1:36514".to_string()
            ))
        );
    }

    /// Stripe operations: the default, a flag, and 0 refused by name (it once became 1
    /// without a word).
    #[test]
    fn stripe_ops_are_at_least_one() {
        assert_eq!(options(&["m0"]).unwrap().stripe_ops, 64);
        assert_eq!(options(&["--stripe-ops", "8", "m0"]).unwrap().stripe_ops, 8);
        let e = options(&["--stripe-ops", "0", "m0"]).err().unwrap();
        assert!(e.to_string().contains("stripe_ops 0"), "{e}");
    }

    #[test]
    fn pacer_and_speed_limits_are_selectable() {
        use engine::qos::pacer::{PacerKind, SpeedLimits};
        let o = options(&["m0"]).unwrap();
        assert_eq!(o.pacer, PacerKind::Ferroraid);
        assert_eq!(o.speed_limits, SpeedLimits::default());
        let o = options(&[
            "--pacer",
            "md-pending",
            "--speed-min",
            "5000",
            "--speed-max",
            "100000",
            "m0",
        ])
        .unwrap();
        assert_eq!(o.pacer, PacerKind::MdPending);
        assert_eq!(o.speed_limits.speed_min, 5000 * 1024);
        assert_eq!(o.speed_limits.speed_max, 100_000 * 1024);
        let default_tolerance = engine::qos::pacer::FerroraidPacerConfig::default().tolerance;
        assert_eq!(o.pacer_tolerance, default_tolerance);
        let o = options(&["--pacer-tolerance", "40", "m0"]).unwrap();
        assert_eq!((o.pacer, o.pacer_tolerance), (PacerKind::Ferroraid, 0.40));
        assert_eq!(
            options(&["--pacer", "md-min", "m0"]).unwrap().pacer,
            PacerKind::MdMin
        );
        for bad in [
            &["--pacer", "fast", "m0"][..],
            &["--speed-min", "0", "m0"],
            &["--speed-min", "3000", "--speed-max", "2000", "m0"],
            &["--speed-max", "500", "m0"],
            &["--speed-max", "18446744073709551615", "m0"],
            &["--speed-min", "-1", "m0"],
            &["--pacer-tolerance", "0", "m0"],
            &["--pacer-tolerance", "1001", "m0"],
            &["--pacer-tolerance", "0.2", "m0"],
            &["--pacer", "md-min", "--pacer-tolerance", "20", "m0"],
        ] {
            let e = options(bad)
                .err()
                .unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(!e.to_string().is_empty());
        }
        // The config file's keys, and the command line over them.
        let dir = std::env::temp_dir().join(format!("ferroraid-pacer-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("serve.toml");
        std::fs::write(
            &cfg,
            "devices = [\"m0\"]\npacer = \"md-min\"\nspeed_min = 2000\nspeed_max = 4000\n",
        )
        .unwrap();
        let c = cfg.to_str().unwrap();
        let o = options(&["--config", c]).unwrap();
        assert_eq!(o.pacer, PacerKind::MdMin);
        assert_eq!(
            o.speed_limits,
            SpeedLimits::from_kib_per_s(2000, 4000).unwrap()
        );
        let o = options(&["--config", c, "--pacer", "ferroraid", "--speed-max", "8000"]).unwrap();
        assert_eq!(o.pacer, PacerKind::Ferroraid);
        assert_eq!(
            o.speed_limits,
            SpeedLimits::from_kib_per_s(2000, 8000).unwrap()
        );
        std::fs::write(&cfg, "devices = [\"m0\"]\npacer = \"slow\"\n").unwrap();
        assert!(options(&["--config", c]).is_err());
        std::fs::write(&cfg, "devices = [\"m0\"]\npacer_tolerance = 25\n").unwrap();
        assert_eq!(options(&["--config", c]).unwrap().pacer_tolerance, 0.25);
        let o = options(&["--config", c, "--pacer-tolerance", "5"]).unwrap();
        assert_eq!(o.pacer_tolerance, 0.05);
        std::fs::write(&cfg, "devices = [\"m0\"]\npacer_tolerance = 2000\n").unwrap();
        let Err(e) = options(&["--config", c]) else {
            panic!("2000 % accepted");
        };
        assert!(e.to_string().contains("1 to 1000"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn nbd_connection_limits_are_configurable() {
        use ferroraid::nbd::ServerConfig;
        let o = options(&["m0"]).unwrap();
        assert_eq!(o.nbd_config, ServerConfig::default());
        assert_eq!(o.nbd_config.idle_timeout, None);
        let o = options(&[
            "--nbd-max-connections",
            "5000",
            "--nbd-handshake-timeout-ms",
            "2500",
            "--nbd-max-handshakes",
            "64",
            "--nbd-idle-timeout-s",
            "3600",
            "m0",
        ])
        .unwrap();
        let n = &o.nbd_config;
        assert_eq!(n.max_connections, Some(5000));
        assert_eq!(n.handshake_timeout, Duration::from_millis(2500));
        assert_eq!(n.max_handshakes, 64);
        assert_eq!(n.idle_timeout, Some(Duration::from_secs(3600)));
        let off = options(&["--nbd-idle-timeout-s", "0", "m0"]).unwrap();
        assert_eq!(off.nbd_config.idle_timeout, None);
        for bad in [
            &["--nbd-max-connections", "0", "m0"][..],
            &["--nbd-handshake-timeout-ms", "0", "m0"],
            &["--nbd-max-handshakes", "0", "m0"],
            &["--nbd-max-connections", "-1", "m0"],
        ] {
            assert!(options(bad).is_err(), "{bad:?} accepted");
        }
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("serve.toml");
        std::fs::write(
            &cfg,
            "devices = [\"m0\"]\nnbd_max_connections = 8\nnbd_handshake_timeout_ms = 900\n\
             nbd_max_handshakes = 16\nnbd_idle_timeout_s = 60\n",
        )
        .unwrap();
        let c = cfg.to_str().unwrap();
        let n = options(&["--config", c]).unwrap().nbd_config;
        assert_eq!(
            (
                n.max_connections,
                n.handshake_timeout,
                n.max_handshakes,
                n.idle_timeout
            ),
            (
                Some(8),
                Duration::from_millis(900),
                16,
                Some(Duration::from_secs(60))
            )
        );
        let n = options(&["--config", c, "--nbd-max-connections", "9"])
            .unwrap()
            .nbd_config;
        assert_eq!(n.max_connections, Some(9));
    }

    #[test]
    fn nbd_block_status_switch() {
        assert!(options(&["m0"]).unwrap().nbd_block_status);
        assert!(
            !options(&["--nbd-block-status", "off", "m0"])
                .unwrap()
                .nbd_block_status
        );
        assert!(
            options(&["--nbd-block-status", "on", "m0"])
                .unwrap()
                .nbd_block_status
        );
        assert!(options(&["--nbd-block-status", "maybe", "m0"]).is_err());
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("serve.toml");
        let c = cfg.to_str().unwrap();
        for (text, want) in [
            ("nbd_block_status = \"off\"", Some(false)),
            ("nbd_block_status = false", Some(false)),
            ("nbd_block_status = \"on\"", Some(true)),
            ("nbd_block_status = 1", None),
            ("nbd_block_status = \"no\"", None),
        ] {
            std::fs::write(&cfg, format!("devices = [\"m0\"]\n{text}\n")).unwrap();
            let got = options(&["--config", c]).ok().map(|o| o.nbd_block_status);
            assert_eq!(got, want, "{text}");
        }
        // The command line wins over the file.
        std::fs::write(&cfg, "devices = [\"m0\"]\nnbd_block_status = \"off\"\n").unwrap();
        assert!(
            options(&["--config", c, "--nbd-block-status", "on"])
                .unwrap()
                .nbd_block_status
        );
    }

    #[test]
    fn nbd_tls_options_and_config_keys() {
        use ferroraid::nbd::TlsMode;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // A self-signed certificate for localhost, also used as the client CA.
        let c = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let (cert_p, key_p) = (d.join("cert.pem"), d.join("key.pem"));
        std::fs::write(&cert_p, c.cert.pem()).unwrap();
        std::fs::write(&key_p, c.signing_key.serialize_pem()).unwrap();
        let (cert, key) = (cert_p.to_str().unwrap(), key_p.to_str().unwrap());
        // serve with `args`, the certificate and key, and one member.
        let with_creds = |args: &[&str]| {
            let mut v = args.to_vec();
            v.extend(["--tls-cert", cert, "--tls-key", key, "m0"]);
            options(&v)
        };
        assert!(options(&["m0"]).unwrap().nbd_tls.is_none());
        let t = with_creds(&["--tls", "require"]).unwrap().nbd_tls.unwrap();
        assert_eq!((t.mode, t.client_auth), (TlsMode::Require, false));
        let t = with_creds(&["--tls", "allow", "--tls-ca", cert]).unwrap();
        let t = t.nbd_tls.unwrap();
        assert_eq!((t.mode, t.client_auth), (TlsMode::Allow, true));
        // No mode, an unknown one, a CA file without a certificate in it.
        for bad in [
            &[][..],
            &["--tls", "on"],
            &["--tls", "require", "--tls-ca", key],
        ] {
            assert!(with_creds(bad).is_err(), "{bad:?} accepted");
        }
        assert!(options(&["--tls", "require", "m0"]).is_err());
        assert!(options(&["--tls", "allow", "--tls-cert", cert, "m0"]).is_err());
        // A certificate given as the key; a file that is not there, named in the error.
        let swapped = [
            "--tls",
            "require",
            "--tls-key",
            cert,
            "--tls-cert",
            cert,
            "m0",
        ];
        assert!(options(&swapped).is_err());
        let missing = [
            "--tls",
            "allow",
            "--tls-key",
            key,
            "--tls-cert",
            "/none.pem",
            "m0",
        ];
        let e = format!("{:#}", options(&missing).unwrap_err());
        assert!(e.contains("/none.pem"), "{e}");
        let cfg = d.join("serve.toml");
        let toml = format!(
            "devices = [\"m0\"]\ntls = \"require\"\ntls_cert = {cert:?}\n\
             tls_key = {key:?}\ntls_ca = {cert:?}\n"
        );
        std::fs::write(&cfg, toml).unwrap();
        let f = cfg.to_str().unwrap();
        let t = options(&["--config", f]).unwrap().nbd_tls.unwrap();
        assert_eq!((t.mode, t.client_auth), (TlsMode::Require, true));
        let t = options(&["--config", f, "--tls", "allow"]).unwrap();
        assert_eq!(t.nbd_tls.unwrap().mode, TlsMode::Allow);
        std::fs::write(&cfg, "devices = [\"m0\"]\ntls = \"maybe\"\n").unwrap();
        assert!(options(&["--config", f]).is_err());
    }
}
