//! The management subcommands: `status`, `fail`, `remove`, `add`, `replace`, `check`,
//! `repair`, `stop-process`, `portal`, `export` (clients of a running target's JSON-RPC socket, `ferroraid::rpc`),
//! `examine` (superblocks, no target needed) and `grow` (a stopped array's superblocks).

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use engine::metadata::ConsistencyPolicy;
use ferroraid::examine::{examine_device, ExamineEntry};
use ferroraid::grow::{grow_consistency_policy, GrowOptions, RAID6_PPL_NOTICE};
use ferroraid::nvmf::spec::AnaState;
use ferroraid::rpc::{
    default_rpc_path, ArrayCreateParams, ArrayStartParams, ClientError, ExportParams, RpcClient,
};
use ferroraid::status::{
    ExportProtocol, ExportReport, MemberReport, MemberState, ProcessKind, ProcessRunState,
    EXIT_NOT_RUNNING,
};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal as _;

/// The help of `--rpc`, with the default rule.
const RPC_HELP: &str = "The target's management socket [default: \
    /run/ferroraid/ferroraid.sock as root with /run writable, else \
    $XDG_RUNTIME_DIR/ferroraid.sock, else ./ferroraid.sock]";

/// Ends the process with this exit status (whatever needed saying was said): returned as
/// an error so `main` can map it.
#[derive(Debug)]
pub struct Exit(pub u8);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit status {}", self.0)
    }
}

impl std::error::Error for Exit {}

/// Options of `ferroraid status`.
#[derive(Args, Debug)]
pub struct StatusArgs {
    #[arg(long, value_name = "PATH", help = RPC_HELP)]
    rpc: Option<PathBuf>,
    /// The array, by name, when the target serves several (default: its only array).
    #[arg(long, value_name = "NAME")]
    array: Option<String>,
    /// Print the report as JSON (stable field names, units in the names; see
    /// docs/MANAGEMENT.md).
    #[arg(long)]
    json: bool,
}

/// Options of `ferroraid fail|remove|add`.
#[derive(Args, Debug)]
pub struct MemberArgs {
    /// The device: its path as the target opened it, or its slot number (`add`: a path).
    #[arg(value_name = "DEV")]
    device: String,
    #[arg(long, value_name = "PATH", help = RPC_HELP)]
    rpc: Option<PathBuf>,
    /// The array, by name, when the target serves several (default: its only array).
    #[arg(long, value_name = "NAME")]
    array: Option<String>,
}

/// Options of `ferroraid check|repair`.
#[derive(Args, Debug)]
pub struct ProcessArgs {
    /// Start it and return at once (follow it with `ferroraid status`).
    #[arg(long)]
    no_wait: bool,
    #[arg(long, value_name = "PATH", help = RPC_HELP)]
    rpc: Option<PathBuf>,
    /// The array, by name, when the target serves several (default: its only array).
    #[arg(long, value_name = "NAME")]
    array: Option<String>,
}

/// Options of `ferroraid replace`.
#[derive(Args, Debug)]
pub struct ReplaceArgs {
    /// The member to replace: its path as the target opened it, or its slot number.
    #[arg(value_name = "OLD")]
    old: String,
    /// The new device (a path; blank, or a former member of this array).
    #[arg(value_name = "NEW")]
    new: String,
    /// Start it and return at once (follow it with `ferroraid status`).
    #[arg(long)]
    no_wait: bool,
    #[arg(long, value_name = "PATH", help = RPC_HELP)]
    rpc: Option<PathBuf>,
    /// The array, by name, when the target serves several (default: its only array).
    #[arg(long, value_name = "NAME")]
    array: Option<String>,
}

/// Options of `ferroraid stop-process`.
#[derive(Args, Debug)]
pub struct StopProcessArgs {
    #[arg(long, value_name = "PATH", help = RPC_HELP)]
    rpc: Option<PathBuf>,
    /// The array, by name, when the target serves several (default: its only array).
    #[arg(long, value_name = "NAME")]
    array: Option<String>,
}

/// Options of `ferroraid examine`.
#[derive(Args, Debug)]
pub struct ExamineArgs {
    /// Print a JSON array, one entry per device (stable field names; entries with an
    /// `error` field are devices without a readable superblock); with `--scan`, the
    /// arrays found (`ferroraid::scan::Scan`).
    #[arg(long)]
    json: bool,
    /// Find arrays instead: read the superblock of every path the DEV arguments match as
    /// shell globs (quote them; every block device in /sys/class/block when none is
    /// given), group the devices by array UUID and print an `[[array]]` table for each,
    /// which `serve --config` accepts (mdadm's `--examine --scan`).
    #[arg(long)]
    scan: bool,
    /// Member devices or image files (also `/dev/ngXnY` and `vfio:DDDD:BB:DD.F`); globs
    /// with `--scan`.
    #[arg(value_name = "DEV", required_unless_present = "scan")]
    devices: Vec<PathBuf>,
}

/// Options of `ferroraid grow`.
#[derive(Args, Debug)]
pub struct GrowArgs {
    /// The consistency policy to switch to: `resync` (no log: what kernel md can assemble
    /// for a RAID6) or `ppl` (the Partial Parity Log, area re-initialised as at create).
    #[arg(long, value_name = "resync|ppl", value_parser = parse_grow_policy)]
    consistency_policy: ConsistencyPolicy,
    /// Every member (and spare) of the stopped array, in any order.
    #[arg(value_name = "DEV", required = true)]
    devices: Vec<PathBuf>,
}

/// `grow --consistency-policy`: `resync` or `ppl` (mdadm's `Grow_consistency_policy`
/// switches only these two); the others are refused with what to do instead.
fn parse_grow_policy(s: &str) -> Result<ConsistencyPolicy, String> {
    match s.parse::<ConsistencyPolicy>()? {
        ConsistencyPolicy::Bitmap => Err("\"bitmap\": grow switches between ppl and resync \
             only; add an internal bitmap under md (mdadm --grow --bitmap=internal) after \
             switching to resync"
            .into()),
        p => Ok(p),
    }
}

/// Which member operation.
#[derive(Clone, Copy, Debug)]
pub enum MemberOp {
    /// `member_fail`.
    Fail,
    /// `member_remove`.
    Remove,
    /// `member_add`.
    Add,
}

fn out(text: &str) -> std::io::Result<()> {
    let mut o = std::io::stdout().lock();
    o.write_all(text.as_bytes())?;
    o.flush()
}

/// Connects, or says on one line why not and ends with [`EXIT_NOT_RUNNING`].
fn connect(rpc: &Option<PathBuf>, array: &Option<String>) -> Result<RpcClient> {
    let path = rpc.clone().unwrap_or_else(default_rpc_path);
    let mut c = RpcClient::connect(&path).map_err(|e| {
        eprintln!("ferroraid: {e}");
        anyhow::Error::from(Exit(EXIT_NOT_RUNNING))
    })?;
    c.set_array(array.clone());
    Ok(c)
}

/// `ferroraid status`: exit status 0 healthy, 1 degraded or rebuilding, 2 failed, 4 no
/// target (or its status unreadable), with one line on stderr saying why.
pub fn status(a: &StatusArgs) -> Result<()> {
    let mut c = connect(&a.rpc, &a.array)?;
    let report = match c.status() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ferroraid: {e}");
            return Err(Exit(EXIT_NOT_RUNNING).into());
        }
    };
    if a.json {
        out(&(serde_json::to_string_pretty(&report)? + "\n"))?;
    } else {
        out(&report.to_string())?;
    }
    match report.exit_code() {
        0 => Ok(()),
        code => Err(Exit(code).into()),
    }
}

/// `ferroraid fail|remove|add DEV`: prints what happened and the array's state after.
/// Exit status 0 done, 1 refused (the message names the device), 4 no target.
pub fn member(op: MemberOp, a: &MemberArgs) -> Result<()> {
    let mut c = connect(&a.rpc, &a.array)?;
    let dev = device_arg(&a.device)?;
    let dev = dev.as_str();
    let result = match op {
        MemberOp::Fail => c.member_fail(dev),
        MemberOp::Remove => c.member_remove(dev),
        MemberOp::Add => c.member_add(dev),
    };
    let m = match result {
        Ok(m) => m,
        Err(ClientError::Rpc(e)) => {
            let verb = match op {
                MemberOp::Fail => "fail",
                MemberOp::Remove => "remove",
                MemberOp::Add => "add",
            };
            anyhow::bail!("{verb} {dev}: {e}");
        }
        Err(e) => return Err(e.into()),
    };
    let name = m.device.as_deref().unwrap_or(dev);
    let line = match op {
        MemberOp::Fail => format!("set {name} faulty{}", in_slot(&m)),
        MemberOp::Remove => format!("removed {dev}{}", from_slot(&m)),
        MemberOp::Add => match m.slot {
            Some(s) => format!("added {name} as member {s} ({})", m.state),
            None => format!("added {name} as a spare"),
        },
    };
    // The array's state after, best effort: the operation itself succeeded.
    let after = c
        .status()
        .map(|r| format!("; array {} is now {}", r.array.name, r.array.state))
        .unwrap_or_default();
    out(&format!("ferroraid: {line}{after}\n"))?;
    Ok(())
}

/// Exit status of `check`/`repair` when mismatches were found.
pub const EXIT_MISMATCHES: u8 = 3;

/// How often `check --wait` polls the target.
const PROGRESS_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// `ferroraid check|repair`: starts the process and, unless `--no-wait`, follows it to the
/// end (a progress bar on a terminal, a line every 10 % otherwise), then prints
/// `mismatch_cnt`. Exit status 0 done with no mismatch, 3 mismatches found, 1 refused
/// (another process runs, the array is degraded) or the target went away, 4 no target. A
/// process that ends early (a member failed under it) is logged by the target.
pub fn process(kind: ProcessKind, a: &ProcessArgs) -> Result<()> {
    let mut c = connect(&a.rpc, &a.array)?;
    let started = match c.process_start(kind) {
        Ok(p) => p,
        Err(ClientError::Rpc(e)) => anyhow::bail!("{kind}: {e}"),
        Err(e) => return Err(e.into()),
    };
    let name = c.status().map(|r| r.array.name).unwrap_or_default();
    out(&format!("ferroraid: {kind} of array {name} started\n"))?;
    if a.no_wait {
        return Ok(());
    }
    let bar = if std::io::stderr().is_terminal() {
        let b = ProgressBar::new(started.size_bytes.max(1));
        b.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b.set_message(kind.to_string());
        Some(b)
    } else {
        None
    };
    let mut next_line = 0u64;
    let last = loop {
        std::thread::sleep(PROGRESS_POLL);
        let r = match c.status() {
            Ok(r) => r,
            Err(e) => {
                if let Some(b) = &bar {
                    b.abandon();
                }
                anyhow::bail!("{kind}: lost the target: {e}");
            }
        };
        let p = r.process;
        if p.kind != kind {
            break p;
        }
        match &bar {
            Some(b) => {
                b.set_length(p.size_bytes.max(1));
                b.set_position(p.position_bytes);
            }
            None => {
                let pct = p.position_bytes.saturating_mul(100) / p.size_bytes.max(1);
                if pct >= next_line {
                    out(&format!("ferroraid: {kind} {pct}% done\n"))?;
                    next_line = pct / 10 * 10 + 10;
                }
            }
        }
    };
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    out(&format!(
        "ferroraid: {kind} of array {name} ended: mismatch_cnt {}\n",
        last.mismatch_cnt
    ))?;
    if last.mismatch_cnt > 0 {
        return Err(Exit(EXIT_MISMATCHES).into());
    }
    Ok(())
}

/// `ferroraid replace OLD NEW`: starts the replace and, unless `--no-wait`, follows it
/// (a progress bar on a terminal, a line every 10 % otherwise) until NEW holds OLD's slot.
/// Exit status 0 done, 1 refused or failed (the message says why: the new device failed,
/// the array failed, ...), 4 no target.
pub fn replace(a: &ReplaceArgs) -> Result<()> {
    let mut c = connect(&a.rpc, &a.array)?;
    let m = match c.member_replace(&device_arg(&a.old)?, &device_arg(&a.new)?) {
        Ok(m) => m,
        Err(ClientError::Rpc(e)) => anyhow::bail!("replace {} with {}: {e}", a.old, a.new),
        Err(e) => return Err(e.into()),
    };
    let slot = m.slot.unwrap_or(0);
    let name = c.status().map(|r| r.array.name).unwrap_or_default();
    out(&format!(
        "ferroraid: replacing member {slot} ({}) of array {name} with {}\n",
        a.old, a.new
    ))?;
    if a.no_wait {
        return Ok(());
    }
    let bar = if std::io::stderr().is_terminal() {
        let b = ProgressBar::new(1);
        b.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b.set_message("replace");
        Some(b)
    } else {
        None
    };
    let mut next_line = 0u64;
    let mut said_rebuild = false;
    let finish = |bar: &Option<ProgressBar>| {
        if let Some(b) = bar {
            b.finish_and_clear();
        }
    };
    loop {
        std::thread::sleep(PROGRESS_POLL);
        let r = match c.status() {
            Ok(r) => r,
            Err(e) => {
                if let Some(b) = &bar {
                    b.abandon();
                }
                anyhow::bail!("replace: lost the target: {e}");
            }
        };
        let replacing = r.members.iter().any(|m| m.state == MemberState::Replacing);
        let p = &r.process;
        if !replacing {
            finish(&bar);
            let now = r.members.iter().find(|m| m.slot == Some(slot));
            let holds = now.is_some_and(|m| {
                m.device.as_deref() == Some(a.new.as_str()) && m.state == MemberState::Active
            });
            if holds {
                out(&format!(
                    "ferroraid: replace done: {} is member {slot} of array {name}; {} is out \
                     of the array; array is {}\n",
                    a.new, a.old, r.array.state
                ))?;
                return Ok(());
            }
            let why = match (&p.state, &p.error) {
                (ProcessRunState::Failed, Some(e)) => e.clone(),
                _ => format!("{} is no longer replacing member {slot}", a.new),
            };
            anyhow::bail!("replace of member {slot} ended without completing: {why}");
        }
        if p.kind == ProcessKind::Rebuild && !said_rebuild {
            said_rebuild = true;
            out(&format!(
                "ferroraid: member {slot} ({}) failed: the replace goes on as a rebuild from \
                 the other members\n",
                a.old
            ))?;
        }
        if !matches!(p.kind, ProcessKind::Replace | ProcessKind::Rebuild) {
            continue;
        }
        match &bar {
            Some(b) => {
                b.set_length(p.size_bytes.max(1));
                b.set_position(p.position_bytes);
            }
            None => {
                let pct = p.position_bytes.saturating_mul(100) / p.size_bytes.max(1);
                if pct >= next_line {
                    out(&format!("ferroraid: replace {pct}% done\n"))?;
                    next_line = pct / 10 * 10 + 10;
                }
            }
        }
    }
}

/// `ferroraid stop-process`: stops what runs and says what it was.
pub fn stop_process(a: &StopProcessArgs) -> Result<()> {
    let mut c = connect(&a.rpc, &a.array)?;
    let before = c.status().map(|r| r.process.kind).ok();
    match c.process_stop() {
        Ok(_) => {
            let what = match before {
                Some(ProcessKind::Idle) | None => "nothing was running".to_string(),
                Some(k) => format!("{k} stopped"),
            };
            out(&format!("ferroraid: {what}\n"))?;
            Ok(())
        }
        Err(ClientError::Rpc(e)) => anyhow::bail!("stop-process: {e}"),
        Err(e) => Err(e.into()),
    }
}

fn in_slot(m: &MemberReport) -> String {
    m.slot.map(|s| format!(" (slot {s})")).unwrap_or_default()
}

fn from_slot(m: &MemberReport) -> String {
    m.slot
        .map(|s| format!(" from slot {s} (now {})", m.state))
        .unwrap_or_default()
}

/// `ferroraid examine DEV...`: every device's superblock; devices without a readable one
/// are reported on stderr (and as `error` entries in JSON). Exit status 1 when any device
/// has no superblock or a bad checksum.
pub fn examine(a: &ExamineArgs) -> Result<()> {
    if a.scan {
        return examine_scan(a);
    }
    let entries: Vec<ExamineEntry> = a.devices.iter().map(|d| examine_device(d)).collect();
    if a.json {
        out(&(serde_json::to_string_pretty(&entries)? + "\n"))?;
    } else {
        let mut first = true;
        for e in &entries {
            if let ExamineEntry::Report(r) = e {
                if !first {
                    out("\n")?;
                }
                first = false;
                out(&r.to_string())?;
            }
        }
    }
    let mut bad = false;
    for e in &entries {
        if let Some(p) = e.problem() {
            eprintln!("ferroraid: examine: {p}");
            bad = true;
        }
    }
    if bad {
        Err(Exit(1).into())
    } else {
        Ok(())
    }
}

/// `ferroraid examine --scan [GLOB...]`: the arrays the globs' devices belong to, as
/// `[[array]]` tables (or JSON). Exit status 0 when at least one array was found, 1 when
/// none was.
fn examine_scan(a: &ExamineArgs) -> Result<()> {
    let patterns: Vec<String> = if a.devices.is_empty() {
        ferroraid::scan::default_patterns()
    } else {
        a.devices
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect()
    };
    let found = ferroraid::scan::scan(&patterns)?;
    if a.json {
        out(&(serde_json::to_string_pretty(&found)? + "\n"))?;
    } else {
        out(&ferroraid::scan::config_text(&found, &patterns))?;
    }
    if found.arrays.is_empty() {
        eprintln!(
            "ferroraid: examine --scan: no array found: none of the {} paths {patterns:?} \
             matched holds a usable md superblock",
            found.skipped.len()
        );
        return Err(Exit(1).into());
    }
    Ok(())
}

/// `ferroraid grow --consistency-policy resync|ppl DEV...`: switches the stopped array's
/// policy (`ferroraid::grow`) and says what changed and what md can do with it now.
/// Exit status 0 switched, 1 refused (nothing written; the message says why) or an I/O
/// error.
pub fn grow(a: &GrowArgs) -> Result<()> {
    let g = grow_consistency_policy(&GrowOptions {
        devices: a.devices.clone(),
        consistency_policy: a.consistency_policy,
    })?;
    out(&format!(
        "ferroraid: array {:?} (UUID {}): consistency policy {} -> {} on {} devices, events {}\n",
        g.name,
        g.uuid,
        g.from,
        g.to,
        a.devices.len(),
        g.events
    ))?;
    match (g.to, g.level) {
        (ConsistencyPolicy::Ppl, 6) => out(&format!("{RAID6_PPL_NOTICE}\n"))?,
        (ConsistencyPolicy::Resync, 6) => out(
            "ferroraid: kernel md can assemble it now (mdadm --assemble); for a write-intent \
             bitmap under md: mdadm --grow --bitmap=internal /dev/md/NAME\n",
        )?,
        _ => {}
    }
    if let Some(size) = g.ppl_sectors.iter().max() {
        out(&format!(
            "ferroraid: partial parity log areas written ({size} sectors at offset 8 sectors \
             from the superblock)\n"
        ))?;
    }
    Ok(())
}

/// Options of `ferroraid portal`.
#[derive(Args, Debug)]
pub struct PortalArgs {
    #[command(subcommand)]
    op: PortalOp,
    #[arg(long, value_name = "PATH", help = RPC_HELP, global = true)]
    rpc: Option<PathBuf>,
    /// The array, by name, when the target serves several (default: its only array).
    #[arg(long, value_name = "NAME", global = true)]
    array: Option<String>,
    /// Print the JSON-RPC result as JSON (docs/MANAGEMENT.md).
    #[arg(long, global = true)]
    json: bool,
}

/// What `ferroraid portal` does.
#[derive(clap::Subcommand, Debug)]
pub enum PortalOp {
    /// List the portals: address, ANA state, controllers, connections
    /// (`nvmf_portal_list`).
    List,
    /// Set a portal's ANA state (`nvmf_portal_set_ana`); its controllers get an ANA
    /// change notice.
    SetAna {
        /// The portal, IP:PORT as served.
        portal: String,
        /// optimized, non_optimized or inaccessible.
        #[arg(value_parser = parse_ana_state)]
        state: AnaState,
    },
    /// Stop listening on a portal and close its connections (`nvmf_portal_remove`).
    Remove {
        /// The portal, IP:PORT as served.
        portal: String,
    },
    /// Listen on a new portal (`nvmf_portal_add`).
    Add {
        /// The address, IP:PORT.
        portal: String,
        /// Its ANA state [default: optimized].
        #[arg(long, value_parser = parse_ana_state)]
        ana_state: Option<AnaState>,
    },
}

fn parse_ana_state(s: &str) -> Result<AnaState, String> {
    AnaState::from_name(s)
        .ok_or_else(|| format!("unknown ANA state {s:?}: optimized, non_optimized or inaccessible"))
}

/// `ferroraid portal list|set-ana|remove|add`: prints the result (a line per portal, or
/// the JSON-RPC result with `--json`). Exit status 0 done, 1 refused (the RPC error's
/// message), 4 no target.
pub fn portal(a: &PortalArgs) -> Result<()> {
    let mut c = connect(&a.rpc, &a.array)?;
    let fail = |verb: &str, e: ClientError| -> anyhow::Error {
        match e {
            ClientError::Rpc(e) => anyhow::anyhow!("portal {verb}: {e}"),
            e => e.into(),
        }
    };
    let (json, text) = match &a.op {
        PortalOp::List => {
            let r = c.nvmf_portal_list().map_err(|e| fail("list", e))?;
            let mut t = String::new();
            for p in &r.portals {
                t += &format!(
                    "{}  {}  controllers {}  connections {}\n",
                    p.portal, p.ana_state, p.controllers, p.connections
                );
            }
            if r.portals.is_empty() {
                t += "no NVMe/TCP portal\n";
            }
            (serde_json::to_value(&r)?, t)
        }
        PortalOp::SetAna { portal, state } => {
            let r = c
                .nvmf_portal_set_ana(portal, *state)
                .map_err(|e| fail("set-ana", e))?;
            let t = format!(
                "ferroraid: portal {} is {} ({} controller(s) notified)\n",
                r.portal, r.ana_state, r.notified
            );
            (serde_json::to_value(&r)?, t)
        }
        PortalOp::Remove { portal } => {
            let r = c
                .nvmf_portal_remove(portal)
                .map_err(|e| fail("remove", e))?;
            let t = format!(
                "ferroraid: portal {} removed ({} connection(s) closed)\n",
                r.portal, r.closed
            );
            (serde_json::to_value(&r)?, t)
        }
        PortalOp::Add { portal, ana_state } => {
            let r = c
                .nvmf_portal_add(portal, *ana_state)
                .map_err(|e| fail("add", e))?;
            let t = format!("ferroraid: portal {} added ({})\n", r.portal, r.ana_state);
            (serde_json::to_value(&r)?, t)
        }
    };
    if a.json {
        out(&(serde_json::to_string_pretty(&json)? + "\n"))?;
    } else {
        out(&text)?;
    }
    Ok(())
}

/// Where `ferroraid start` and `create --rpc` export an array.
#[derive(Args, Debug, Clone, Default)]
pub struct ExportFlags {
    /// NBD listen address: HOST:PORT or unix:PATH (repeatable).
    #[arg(long, value_name = "ADDR")]
    nbd: Vec<String>,
    /// iSCSI portal HOST:PORT (repeatable).
    #[arg(long, value_name = "HOST:PORT")]
    iscsi: Vec<std::net::SocketAddr>,
    /// NVMe/TCP portal HOST:PORT (repeatable).
    #[arg(long, value_name = "HOST:PORT")]
    nvmf: Vec<std::net::SocketAddr>,
}

impl ExportFlags {
    /// Whether no export was asked for.
    pub fn is_empty(&self) -> bool {
        self.nbd.is_empty() && self.iscsi.is_empty() && self.nvmf.is_empty()
    }

    /// As the JSON-RPC parameters.
    ///
    /// # Errors
    /// An NBD address that is neither `HOST:PORT` nor `unix:PATH`.
    pub fn params(&self) -> Result<ExportParams> {
        let mut p = ExportParams {
            iscsi: self.iscsi.clone(),
            nvmf: self.nvmf.clone(),
            ..ExportParams::default()
        };
        for a in &self.nbd {
            match a.strip_prefix("unix:") {
                Some(path) => p.nbd_unix.push(PathBuf::from(path)),
                None => p.nbd.push(a.parse().map_err(|e| {
                    anyhow::anyhow!("--nbd {a:?}: expected HOST:PORT or unix:PATH ({e})")
                })?),
            }
        }
        Ok(p)
    }
}

/// Options of `ferroraid start`.
#[derive(Args, Debug)]
pub struct StartArgs {
    /// Member devices in any order (their superblocks say the roles).
    #[arg(value_name = "DEV", required = true)]
    devices: Vec<PathBuf>,
    /// Start although members are missing or out of date (mdadm --force).
    #[arg(long)]
    force: bool,
    /// Start although members the array counts as active are missing (mdadm --run).
    #[arg(long)]
    run: bool,
    #[command(flatten)]
    exports: ExportFlags,
    #[arg(long, value_name = "PATH", help = RPC_HELP)]
    rpc: Option<PathBuf>,
    /// Print the array's status as JSON.
    #[arg(long)]
    json: bool,
}

/// Options of `ferroraid stop`.
#[derive(Args, Debug)]
pub struct StopArgs {
    /// The array's name.
    #[arg(value_name = "NAME")]
    name: String,
    #[arg(long, value_name = "PATH", help = RPC_HELP)]
    rpc: Option<PathBuf>,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// Options of `ferroraid list`.
#[derive(Args, Debug)]
pub struct ListArgs {
    #[arg(long, value_name = "PATH", help = RPC_HELP)]
    rpc: Option<PathBuf>,
    /// Print every array's status as JSON (a list).
    #[arg(long)]
    json: bool,
}

/// Exit status of `start`/`stop`/`create --rpc` refused by the target.
pub const EXIT_REFUSED: u8 = 1;

/// Prints a refusal on one line and ends with [`EXIT_REFUSED`] (or [`EXIT_NOT_RUNNING`]
/// when the target went away).
fn refused(what: &str, e: ClientError) -> anyhow::Error {
    match e {
        ClientError::Rpc(e) => {
            eprintln!("ferroraid: {what}: {e}");
            Exit(EXIT_REFUSED).into()
        }
        e => {
            eprintln!("ferroraid: {what}: {e}");
            Exit(EXIT_NOT_RUNNING).into()
        }
    }
}

/// `devices` made absolute against this process's working directory (`vfio:BDF` names
/// kept): the target resolves a relative path in its own, and would open another file.
///
/// # Errors
/// The working directory cannot be read.
pub fn absolute_devices(devices: &[PathBuf]) -> Result<Vec<PathBuf>> {
    devices
        .iter()
        .map(|d| {
            if d.to_string_lossy().starts_with("vfio:") {
                Ok(d.clone())
            } else {
                std::path::absolute(d).with_context(|| format!("device {}", d.display()))
            }
        })
        .collect()
}

/// A member argument (`fail|remove|add DEV`, `replace OLD NEW`): a slot number or a
/// `vfio:BDF` name as given, a path made absolute ([`absolute_devices`]).
fn device_arg(s: &str) -> Result<String> {
    if s.parse::<u16>().is_ok() {
        return Ok(s.to_string());
    }
    let p = absolute_devices(&[PathBuf::from(s)])?;
    Ok(p[0].display().to_string())
}

/// `ferroraid start DEV...`: assembles and starts an array on a running target (the
/// `array_start` method). Exit status 0 started, 1 refused (the reason on stderr), 4 no
/// target.
pub fn start(a: &StartArgs) -> Result<()> {
    let mut c = connect(&a.rpc, &None)?;
    let p = ArrayStartParams {
        devices: absolute_devices(&a.devices)?,
        force: a.force,
        run: a.run,
        exports: a.exports.params()?,
    };
    let r = c.array_start(&p).map_err(|e| refused("start", e))?;
    if a.json {
        out(&(serde_json::to_string_pretty(&r)? + "\n"))?;
    } else {
        out(&format!(
            "ferroraid: started array {} ({}, {}){}\n",
            r.array.name,
            r.array.state,
            r.array.array_uuid,
            r.exports
                .iter()
                .map(|e| format!("; {} {} {}", e.protocol, e.address, e.name))
                .collect::<String>()
        ))?;
    }
    Ok(())
}

/// `ferroraid stop NAME`: stops one array of a running target (`array_stop`); the others
/// serve on. Exit status 0 stopped, 1 refused or the stop failed, 4 no target.
pub fn stop(a: &StopArgs) -> Result<()> {
    let mut c = connect(&a.rpc, &None)?;
    let r = c.array_stop(&a.name).map_err(|e| refused("stop", e))?;
    if a.json {
        out(&(serde_json::to_string_pretty(&r)? + "\n"))?;
    } else {
        out(&format!(
            "ferroraid: stopped array {}{}\n",
            r.array,
            if r.clean {
                " (clean)"
            } else {
                " (a resync is owed: it resumes at the next start)"
            }
        ))?;
    }
    Ok(())
}

/// `ferroraid list`: the arrays a running target serves, one line each (name, level,
/// state, members, exports). Exit status 0, 4 no target.
pub fn list(a: &ListArgs) -> Result<()> {
    let mut c = connect(&a.rpc, &None)?;
    let all = c.array_list().map_err(|e| refused("list", e))?;
    if a.json {
        out(&(serde_json::to_string_pretty(&all)? + "\n"))?;
        return Ok(());
    }
    let mut text = String::new();
    for r in &all {
        let online = r
            .members
            .iter()
            .filter(|m| m.state == ferroraid::status::MemberState::Active)
            .count();
        text += &format!(
            "{} raid{} {} {}/{} members{}\n",
            r.array.name,
            r.array.level,
            r.array.state,
            online,
            r.array.raid_devices,
            r.exports
                .iter()
                .map(|e| format!(" {}={}", e.protocol, e.address))
                .collect::<String>()
        );
    }
    if all.is_empty() {
        text += "no array is running\n";
    }
    out(&text)?;
    Ok(())
}

/// `ferroraid create --rpc`: creates the array through a running target
/// (`array_create`), which starts it unless `p.start` is false. Exit status 0 created, 1
/// refused (the reason on stderr), 4 no target.
pub fn create_rpc(rpc: &std::path::Path, p: &ArrayCreateParams, json: bool) -> Result<()> {
    // Zeroing large members takes long: the call waits as long as it takes, and a second
    // connection follows its progress (`array_create_progress`) for the bar.
    let mut c = RpcClient::connect_timeout(rpc, CREATE_TIMEOUT).map_err(|e| {
        eprintln!("ferroraid: {e}");
        anyhow::Error::from(Exit(EXIT_NOT_RUNNING))
    })?;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = std::io::stderr().is_terminal().then(|| {
        let (path, name, done) = (rpc.to_path_buf(), p.name.clone(), done.clone());
        std::thread::spawn(move || follow_create(&path, &name, &done))
    });
    let result = c.array_create(p);
    done.store(true, std::sync::atomic::Ordering::Release);
    if let Some(w) = watcher {
        let _ = w.join();
    }
    let r = result.map_err(|e| refused("create", e))?;
    if json {
        out(&(serde_json::to_string_pretty(&r)? + "\n"))?;
    } else {
        out(&format!(
            "ferroraid: created array {:?} (UUID {}): {} bytes, data offset {} bytes{}\n",
            r.array,
            r.uuid,
            r.size_bytes,
            r.data_offset_bytes,
            match &r.status {
                Some(s) => format!("; started ({})", s.array.state),
                None => "; not started".into(),
            }
        ))?;
    }
    Ok(())
}

/// Options of `ferroraid export`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    #[command(subcommand)]
    op: ExportOp,
    #[arg(long, value_name = "PATH", help = RPC_HELP, global = true)]
    rpc: Option<PathBuf>,
    /// The array, by name, when the target serves several (default: its only array).
    #[arg(long, value_name = "NAME", global = true)]
    array: Option<String>,
    /// Print the JSON-RPC result as JSON (docs/MANAGEMENT.md).
    #[arg(long, global = true)]
    json: bool,
}

/// What `ferroraid export` does.
#[derive(clap::Subcommand, Debug)]
pub enum ExportOp {
    /// List the live exports: protocol, address, name (`export_list`).
    List,
    /// Export the array over a protocol while it serves (`export_add`).
    Add {
        /// nbd, iscsi or nvmf.
        #[arg(value_parser = parse_protocol)]
        protocol: ExportProtocol,
        /// Listen address, IP:PORT, or unix:PATH for NBD (repeatable; at least one).
        #[arg(long = "listen", value_name = "ADDR", required = true)]
        listen: Vec<String>,
        /// The NBD export name [default: the array name].
        #[arg(long)]
        name: Option<String>,
    },
    /// Stop exporting over a protocol (`export_remove`): its listeners stop, its
    /// connections finish the requests they accepted, reply and close.
    Remove {
        /// nbd, iscsi or nvmf.
        #[arg(value_parser = parse_protocol)]
        protocol: ExportProtocol,
    },
}

fn parse_protocol(s: &str) -> Result<ExportProtocol, String> {
    match s {
        "nbd" => Ok(ExportProtocol::Nbd),
        "iscsi" => Ok(ExportProtocol::Iscsi),
        "nvmf" => Ok(ExportProtocol::Nvmf),
        _ => Err(format!("unknown protocol {s:?}: nbd, iscsi or nvmf")),
    }
}

/// One line per export: `protocol  address  name`.
fn export_lines(exports: &[ExportReport]) -> String {
    exports
        .iter()
        .map(|e| format!("{:<6} {}  {}\n", e.protocol, e.address, e.name))
        .collect()
}

/// `ferroraid export list|add|remove`: prints the result (a line per export, or the
/// JSON-RPC result with `--json`). Exit status 0 done, 1 refused (the RPC error's
/// message), 4 no target.
pub fn export(a: &ExportArgs) -> Result<()> {
    let mut c = connect(&a.rpc, &a.array)?;
    let fail = |verb: &str, e: ClientError| -> anyhow::Error {
        match e {
            ClientError::Rpc(e) => anyhow::anyhow!("export {verb}: {e}"),
            e => e.into(),
        }
    };
    let (json, text) = match &a.op {
        ExportOp::List => {
            let r = c.export_list().map_err(|e| fail("list", e))?;
            let mut t = export_lines(&r);
            if r.is_empty() {
                t += "no export\n";
            }
            (serde_json::to_value(&r)?, t)
        }
        ExportOp::Add {
            protocol,
            listen,
            name,
        } => {
            let r = c
                .export_add(*protocol, listen, name.as_deref())
                .map_err(|e| fail("add", e))?;
            let t = format!("ferroraid: {protocol} export added\n{}", export_lines(&r));
            (serde_json::to_value(&r)?, t)
        }
        ExportOp::Remove { protocol } => {
            let r = c.export_remove(*protocol).map_err(|e| fail("remove", e))?;
            let t = if r.drained {
                format!("ferroraid: {protocol} export removed (connections drained and closed)\n")
            } else {
                format!(
                    "ferroraid: {protocol} export removed; its connections are still draining\n"
                )
            };
            (serde_json::to_value(&r)?, t)
        }
    };
    if a.json {
        out(&(serde_json::to_string_pretty(&json)? + "\n"))?;
    } else {
        out(&text)?;
    }
    Ok(())
}

/// Longest wait for `array_create` (zeroing every member's data area).
const CREATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// Draws the zeroing progress of the create of `name` on stderr until `done`.
fn follow_create(path: &std::path::Path, name: &str, done: &std::sync::atomic::AtomicBool) {
    let Ok(mut w) = RpcClient::connect(path) else {
        return;
    };
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "zeroing members {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template"),
    );
    while !done.load(std::sync::atomic::Ordering::Acquire) {
        if let Ok(jobs) = w.array_create_progress() {
            if let Some(j) = jobs.iter().find(|j| j.array == name) {
                bar.set_length(j.total_bytes);
                bar.set_position(j.zeroed_bytes);
            }
        }
        std::thread::sleep(PROGRESS_POLL);
    }
    bar.finish_and_clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CLI sends member paths absolute (the target resolves relative ones in its own
    /// working directory); slot numbers and `vfio:` names go as given.
    #[test]
    fn member_paths_go_absolute() {
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(
            absolute_devices(&[PathBuf::from("m0.img"), PathBuf::from("vfio:0000:00:04.0")])
                .unwrap(),
            [cwd.join("m0.img"), PathBuf::from("vfio:0000:00:04.0")]
        );
        assert_eq!(device_arg("3").unwrap(), "3");
        assert_eq!(
            device_arg("d/m1.img").unwrap(),
            cwd.join("d/m1.img").display().to_string()
        );
        assert_eq!(device_arg("/dev/x").unwrap(), "/dev/x");
    }
}
