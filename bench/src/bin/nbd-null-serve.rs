//! `ferroraid serve`'s front ends over an array of `null` members, for front-end
//! benchmarks (bench/nbd_frontend_bench.py, issue 18; bench/fronts_bench.py, issue 22).
//!
//! `ferroraid serve` assembles arrays from md superblocks on real devices and has no
//! `null` member kind, so this binary builds the same pieces the target does — the NBD
//! server ([`ferroraid::nbd::NbdServer`], optionally over TLS), with `--iscsi` the iSCSI
//! target ([`ferroraid::iscsi::IscsiServer`], serve's iSCSI defaults, target name
//! `iqn.2026-11.org.ferroraid:NAME`, LUN 0) and with `--nvmf` the NVMe/TCP target
//! ([`ferroraid::nvmf::NvmfServer`], serve's defaults, one subsystem found through the
//! discovery log), one reactor per listed core ([`engine::reactor::Reactors`]) running
//! the same [`ferroraid::frontends::TargetFrontend`] as serve (every front polled every
//! loop turn), the array with
//! `ferroraid serve`'s defaults (1024 requests, 64 stripe operations, 4 MiB requests,
//! default write hold, stripe cache and depth control) — over
//! [`drivers::null::NullDevice`] members, which complete every request at the next poll
//! without touching its buffer. What it leaves out: superblocks and their updates, the
//! bitmap, the PPL, the background pacer, the management socket, iSCSI persistent
//! reservations kept across restarts (no reservation store: APTPL is refused). The cost
//! measured through it is the front end's plus the engine's (RAID parity included).
//!
//! Runs until SIGINT or SIGTERM, then shuts the NBD server down and stops the reactors.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use drivers::null::NullDevice;
use engine::array::ArrayConfig;
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::reactor::{Mode, ReactorConfig, Reactors};
use ferroraid::frontends::{Attach, Attacher};
use ferroraid::iscsi::IscsiServer;
use ferroraid::nbd::{ExportConfig, NbdServer, TlsConfig, TlsMode};
use ferroraid::nvmf::spec::Subsystem;
use ferroraid::nvmf::NvmfServer;
use ferroraid::target::ServeOptions;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum IdleMode {
    Polled,
    Adaptive,
}

/// Serve a RAID5/6 array of `null` members over NBD, and iSCSI and NVMe/TCP when asked
/// (front-end benchmarks).
#[derive(Parser, Debug)]
struct Args {
    /// RAID level: 5 or 6.
    #[arg(long, default_value_t = 6)]
    level: u8,
    /// Members (RAID5: at least 3, RAID6: at least 4).
    #[arg(long, default_value_t = 6)]
    members: u16,
    /// Chunk size, KiB.
    #[arg(long, default_value_t = 64)]
    chunk_kib: u64,
    /// Export size, MiB (rounded down to whole stripes).
    #[arg(long, default_value_t = 4096)]
    export_mib: u64,
    /// Export name.
    #[arg(long, default_value = "bench")]
    name: String,
    /// NBD listening address.
    #[arg(long, default_value = "127.0.0.1:10809")]
    nbd: SocketAddr,
    /// iSCSI listening address (repeatable; none: no iSCSI).
    #[arg(long)]
    iscsi: Vec<SocketAddr>,
    /// NVMe/TCP listening address (repeatable; none: no NVMe/TCP).
    #[arg(long)]
    nvmf: Vec<SocketAddr>,
    /// Array UUID as 32 hex digits (the iSCSI LUN's and the NVMe namespace's identifiers
    /// derive from it, as serve derives them from the md superblock's).
    #[arg(long, default_value = "6e756c6c2d736572-76652d6172726179")]
    uuid: String,
    /// Reactor cores (comma-separated; one reactor each).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    cores: Vec<usize>,
    /// Idle behaviour of the reactors (`ferroraid serve --polled` / `--adaptive`).
    #[arg(long, value_enum, default_value = "adaptive")]
    mode: IdleMode,
    /// TLS: off, allow or require (as `ferroraid serve --tls`).
    #[arg(long, default_value = "off")]
    tls: TlsMode,
    /// Server certificate chain (PEM), with --tls allow/require.
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    /// Server private key (PEM), with --tls allow/require.
    #[arg(long)]
    tls_key: Option<PathBuf>,
}

fn main() -> Result<()> {
    let a = Args::parse();
    // The server's log (connections, the TLS version and cipher suite) on stderr.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let level = match a.level {
        5 => Level::Raid5,
        6 => Level::Raid6,
        l => bail!("--level {l}: 5 or 6"),
    };
    let defaults = ServeOptions::new(Vec::new());
    let g = Geometry::new(
        level,
        Layout::LeftSymmetric,
        a.members,
        a.chunk_kib * 1024,
        512,
    )?;
    let stripes = (a.export_mib << 20) / g.stripe_data_bytes();
    let geo = ArrayGeometry::new(g, stripes)?;
    let member_bytes = stripes * u64::from(g.chunk_bytes());
    let devices: Vec<NullDevice> = (0..a.members)
        .map(|i| NullDevice::new(&format!("null{i}"), member_bytes, 512, defaults.queue_depth))
        .collect::<Result<_, _>>()?;

    // SIGINT/SIGTERM blocked before any thread starts (every thread inherits the mask);
    // the main thread waits for them with sigwait.
    // SAFETY: sigset_t is a plain bit array; all-zero is a valid value, and sigemptyset
    // initialises it below before any use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live, initialised sigset_t owned by this frame; a null old-mask
    // pointer is allowed by pthread_sigmask.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }

    let export = ExportConfig::for_array(a.name.clone(), &geo, defaults.max_block_bytes);
    let size = export.size_bytes;
    let mut builder = NbdServer::builder(export)
        .config(defaults.nbd_config.clone())
        .listen_tcp(a.nbd);
    if a.tls != TlsMode::Off {
        let (Some(cert), Some(key)) = (&a.tls_cert, &a.tls_key) else {
            bail!("--tls {} needs --tls-cert and --tls-key", a.tls);
        };
        builder = builder.tls(
            TlsConfig::from_pem_files(a.tls, cert, key, None).context("loading TLS credentials")?,
        );
    }
    let n = a.cores.len();
    let (nbd, nbd_frontends) = builder.start(n).context("starting the NBD server")?;
    let uuid = parse_uuid(&a.uuid)?;
    let (iscsi, iscsi_frontends) = if a.iscsi.is_empty() {
        (None, Vec::new())
    } else {
        let cfg = defaults.iscsi_config.clone();
        let lun = ferroraid::iscsi::lun_info(&a.name, &geo, uuid, &cfg);
        let mut b = IscsiServer::builder(lun).config(cfg);
        for l in &a.iscsi {
            b = b.listen(*l);
        }
        let (s, f) = b.start(n).context("starting the iSCSI target")?;
        (Some(s), f)
    };
    let (nvmf, nvmf_frontends) = if a.nvmf.is_empty() {
        (None, Vec::new())
    } else {
        let sub = Subsystem::for_array(&a.name, uuid, &geo);
        let mut b = NvmfServer::builder(sub).config(defaults.nvmf_config.clone());
        for l in &a.nvmf {
            b = b.listen(*l);
        }
        let (s, f) = b.start(n).context("starting the NVMe/TCP target")?;
        (Some(s), f)
    };
    // Every front the server was started with, attached from the first turn; closed at
    // the end so the reactors can stop once the servers have drained.
    let mut initial: Vec<Vec<Attach>> = vec![nbd_frontends.into_iter().map(Attach::Nbd).collect()];
    if !iscsi_frontends.is_empty() {
        initial.push(iscsi_frontends.into_iter().map(Attach::Iscsi).collect());
    }
    if !nvmf_frontends.is_empty() {
        initial.push(nvmf_frontends.into_iter().map(Attach::Nvmf).collect());
    }
    let (attacher, frontends) =
        Attacher::new(n, initial).map_err(|e| anyhow::anyhow!("front-ends: {e}"))?;
    let array_cfg = ArrayConfig {
        requests: 1024,
        stripe_ops: defaults.stripe_ops,
        depth: defaults.depth,
        write_hold_ns: u64::try_from(defaults.write_hold.as_nanos()).unwrap_or(u64::MAX),
        ..ArrayConfig::default()
    };
    let rcfg = ReactorConfig {
        cores: a.cores.iter().copied().map(Some).collect(),
        mode: match a.mode {
            IdleMode::Polled => Mode::Polled,
            IdleMode::Adaptive => Mode::Adaptive,
        },
        requests: 1024,
        foreign_reads: true,
    };
    let reactors = Reactors::start(
        Arc::new(devices),
        geo,
        Parity::new(),
        array_cfg,
        rcfg,
        frontends,
    )?;
    eprintln!(
        "serving RAID{} over {} null members ({} KiB chunk), export {:?} of {size} bytes on \
         {} (TLS {}), iSCSI on {:?}, NVMe/TCP on {:?}, reactors on cores {:?}, {:?}",
        a.level, a.members, a.chunk_kib, a.name, a.nbd, a.tls, a.iscsi, a.nvmf, a.cores, a.mode
    );
    let mut sig = 0;
    // SAFETY: `set` and `sig` are live locals; SIGINT and SIGTERM are blocked in every
    // thread (mask set above before any thread started), as sigwait requires.
    unsafe { libc::sigwait(&set, &mut sig) };
    nbd.shutdown();
    if let Some(s) = iscsi {
        s.shutdown();
    }
    if let Some(s) = nvmf {
        s.shutdown();
    }
    attacher.close();
    reactors.stop().context("stopping the reactors")?;
    Ok(())
}

/// `--uuid`: 32 hex digits (dashes ignored) into the 16 bytes of an array UUID.
fn parse_uuid(s: &str) -> Result<[u8; 16]> {
    let hex: String = s.chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        bail!("--uuid {s:?}: 32 hex digits expected");
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)?;
    }
    Ok(out)
}
