//! `ferroraid`: the storage target's command-line front end.
//!
//! The target: `create` (md v1.2 superblocks, initial parity), `serve` (assemble and export
//! over NBD), `demo` (the embedded default: a RAID6 over sparse files, served over NBD).
//! Offline: `examine` (superblocks), `grow` (a stopped array's consistency policy).
//! Array tools: `layout` (where P, Q and data live), `map` (logical offset to member),
//! `kernels` (parity kernels on this CPU), `selftest` (offline engine self-test).

/// `println!` that returns the I/O error instead of panicking when stdout is closed
/// (`ferroraid layout | head`).
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($t)*)
    }};
}
/// `print!` counterpart of [`say!`].
macro_rules! say_part {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($t)*)
    }};
}

mod mgmt;
mod selftest;
mod serve;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use engine::geometry::{Geometry, Layout, Level, Role};
use engine::parity::Kernel;

/// Exit status of a command-line usage error (unknown command or option, bad value):
/// `EX_USAGE` of BSD's sysexits.h, apart from every status a command itself reports
/// (clap's own default, 2, is `ferroraid status`'s "array failed").
const EXIT_USAGE: u8 = 64;

/// The exit statuses, shown at the end of `ferroraid --help` (README.md has the same table).
const EXIT_STATUS_HELP: &str = "\
Exit status:
  0   success; status: the array is healthy
  1   error (the message says which), a refused fail/remove/add, examine found a problem;
      status: the array is degraded or rebuilding
  2   status: the array has failed
  3   check/repair: parity mismatches were found
  4   status: no target answers on the management socket
  64  usage error: unknown command or option, bad value (EX_USAGE of sysexits.h)";

#[derive(Parser, Debug)]
#[command(
    name = "ferroraid",
    version,
    about = "ferroraid: a polled-mode RAID5/RAID6 target",
    after_help = EXIT_STATUS_HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the member layout of the first stripes: P, Q and data chunks (with their Q
    /// syndrome slots) per member.
    Layout {
        #[command(flatten)]
        shape: Shape,
        /// Stripes to print (one full rotation by default; at most 1048576).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
        stripes: Option<u64>,
    },
    /// Map a logical byte offset to (member, byte offset in the member's data area).
    Map {
        #[command(flatten)]
        shape: Shape,
        /// Logical byte offset (suffixes K, M, G = KiB, MiB, GiB).
        #[arg(value_parser = parse_bytes)]
        offset: u64,
    },
    /// List the parity kernels and which one this CPU uses.
    Kernels,
    /// The embedded demo: a RAID6 over six sparse member files in a data directory,
    /// served over NBD on 127.0.0.1:10809 as export `demo` (rerunning reuses it).
    Demo(serve::DemoArgs),
    /// Create an array: md v1.2 superblocks on every member, initial parity by zeroing
    /// the data areas (or --assume-clean).
    Create(serve::CreateArgs),
    /// Run the target: assemble the array from its members' superblocks and serve it over
    /// NBD until SIGINT/SIGTERM (which drain, flush and mark the array clean).
    Serve(Box<serve::ServeArgs>),
    /// Offline self-test of the engine: builds a RAID over member image files, verifies
    /// it, loses members and reconstructs every stripe.
    Selftest(selftest::SelftestArgs),
    /// Show a running target's array: state, members, I/O, latency. Exit status: 0 healthy,
    /// 1 degraded or rebuilding, 2 failed, 4 no target running.
    Status(mgmt::StatusArgs),
    /// Mark a member of a running target's array faulty (no more I/O goes to it).
    Fail(mgmt::MemberArgs),
    /// Take a faulty member (or a spare) out of a running target's array.
    Remove(mgmt::MemberArgs),
    /// Add a device to a running target's array (as a spare, or into an empty slot; a
    /// device that left its slot comes back by bitmap, rebuilt only where it missed writes).
    Add(mgmt::MemberArgs),
    /// Replace a member of a running target's array with a new device while the member
    /// keeps serving (md's mdadm --replace): NEW is copied from OLD (rebuilt from the
    /// others where OLD cannot be read), then takes its slot and OLD leaves the array.
    /// Follows progress until done unless --no-wait.
    Replace(mgmt::ReplaceArgs),
    /// Print the md v1.2 superblock of member devices (like mdadm --examine).
    Examine(mgmt::ExamineArgs),
    /// Scrub a running target's array: read everything and count parity mismatches
    /// (md's `check`). Follows progress until done unless --no-wait; exit status 0 when no
    /// mismatch was found, 3 when some were.
    Check(mgmt::ProcessArgs),
    /// Scrub and rewrite mismatched parity (md's `repair`); like `check` otherwise.
    Repair(mgmt::ProcessArgs),
    /// Switch a stopped array's consistency policy between ppl and resync (mdadm --grow
    /// --consistency-policy): rewrites every member's superblock (and, for ppl, its
    /// partial parity log area). The array must have been stopped cleanly and every member
    /// must be given. The way back to kernel md for a RAID6 ppl array.
    Grow(mgmt::GrowArgs),
    /// Stop a running target's background process (check, repair, resync, rebuild); a
    /// resync or rebuild resumes from where it stopped when started again.
    StopProcess(mgmt::StopProcessArgs),
    /// Manage a running target's NVMe/TCP portals (listen addresses of its subsystem):
    /// list them, set a portal's ANA state (multipath: optimized, non_optimized,
    /// inaccessible), remove one (closing its connections) or add one.
    Portal(mgmt::PortalArgs),
    /// Assemble and start an array on a running target (beside the arrays it serves),
    /// from its member devices in any order, exported as --nbd/--iscsi/--nvmf say.
    /// Exit status: 0 started, 1 refused (the reason on stderr), 4 no target running.
    Start(mgmt::StartArgs),
    /// Stop one array of a running target: its exports drain, its members are flushed and
    /// it is marked clean; the other arrays serve on. Exit status: 0 stopped, 1 refused or
    /// failed, 4 no target running.
    Stop(mgmt::StopArgs),
    /// List the arrays a running target serves (name, level, state, members, exports).
    List(mgmt::ListArgs),
    /// Manage a running target's exports: list them, export the array over NBD, iSCSI or
    /// NVMe/TCP while it serves (`add nbd --listen 0.0.0.0:10810`), or stop exporting over
    /// a protocol (`remove nbd`: its connections finish their requests and close).
    Export(mgmt::ExportArgs),
}

/// The stripe shape options shared by several commands.
#[derive(Args, Debug, Clone)]
pub(crate) struct Shape {
    /// RAID level: 5 or 6.
    #[arg(long, default_value = "6")]
    pub(crate) level: Level,
    /// md layout name or number (left-symmetric is md's default).
    #[arg(long, default_value = "left-symmetric")]
    pub(crate) layout: Layout,
    /// Member count (RAID5: 3..=256, RAID6: 4..=257).
    #[arg(long, default_value_t = 6)]
    pub(crate) members: u16,
    /// Chunk size: a power of two from 4K to 16M.
    #[arg(long, default_value = "64K", value_parser = parse_bytes)]
    pub(crate) chunk: u64,
}

impl Shape {
    pub(crate) fn geometry(&self) -> Result<Geometry> {
        Ok(Geometry::new(
            self.level,
            self.layout,
            self.members,
            self.chunk,
            512,
        )?)
    }
}

/// Parses a byte count with optional binary suffix (`64K` = 65536, `1M`, `1GiB`).
fn parse_bytes(s: &str) -> Result<u64, String> {
    if s.contains('.') {
        return Err(format!(
            "{s:?} is not a whole number of bytes; use e.g. 65536, 64K, 1M"
        ));
    }
    parse_size::Config::new()
        .with_binary()
        .parse_size(s)
        .map_err(|e| format!("{s:?} is not a byte size ({e}); use e.g. 65536, 64K, 1M"))
}

fn main() -> std::process::ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version print to stdout and succeed; everything else clap rejects
        // is a usage error.
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                std::process::ExitCode::from(EXIT_USAGE)
            } else {
                std::process::ExitCode::SUCCESS
            };
        }
    };
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The reader went away (`| head`): stop quietly, as Unix tools do.
        Err(e) if is_broken_pipe(&e) => std::process::ExitCode::SUCCESS,
        // A command that chose its exit status (and said why already).
        Err(e) if e.downcast_ref::<mgmt::Exit>().is_some() => {
            std::process::ExitCode::from(e.downcast_ref::<mgmt::Exit>().map_or(1, |x| x.0))
        }
        Err(e) => {
            eprintln!("ferroraid: error: {}", ferroraid::error_text(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Whether log lines on stderr get ANSI colours: only when stderr is a terminal and
/// `NO_COLOR` is unset or empty (<https://no-color.org>: any non-empty value disables).
fn log_colour(stderr_is_terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

fn run(cli: Cli) -> Result<()> {
    use std::io::IsTerminal as _;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(log_colour(
            std::io::stderr().is_terminal(),
            std::env::var_os("NO_COLOR"),
        ))
        .init();
    match cli.command {
        Command::Layout { shape, stripes } => layout(&shape, stripes),
        Command::Map { shape, offset } => map(&shape, offset),
        Command::Kernels => {
            let best = Kernel::best();
            for k in Kernel::ALL {
                let state = if k == best {
                    "available, selected"
                } else if k.is_available() {
                    "available"
                } else {
                    "not supported by this CPU"
                };
                say!("{:<12} {state}", k.name())?;
            }
            Ok(())
        }
        Command::Demo(args) => serve::run_demo(&args),
        Command::Create(args) => serve::run_create(&args),
        Command::Serve(args) => serve::run_serve(&args),
        Command::Selftest(args) => selftest::run(&args),
        Command::Status(args) => mgmt::status(&args),
        Command::Fail(args) => mgmt::member(mgmt::MemberOp::Fail, &args),
        Command::Remove(args) => mgmt::member(mgmt::MemberOp::Remove, &args),
        Command::Add(args) => mgmt::member(mgmt::MemberOp::Add, &args),
        Command::Replace(args) => mgmt::replace(&args),
        Command::Examine(args) => mgmt::examine(&args),
        Command::Check(args) => mgmt::process(ferroraid::status::ProcessKind::Check, &args),
        Command::Repair(args) => mgmt::process(ferroraid::status::ProcessKind::Repair, &args),
        Command::StopProcess(args) => mgmt::stop_process(&args),
        Command::Portal(args) => mgmt::portal(&args),
        Command::Start(args) => mgmt::start(&args),
        Command::Stop(args) => mgmt::stop(&args),
        Command::List(args) => mgmt::list(&args),
        Command::Export(args) => mgmt::export(&args),
        Command::Grow(args) => mgmt::grow(&args),
    }
}

fn layout(shape: &Shape, stripes: Option<u64>) -> Result<()> {
    let g = shape.geometry()?;
    let n = u64::from(g.members());
    say!(
        "{} {} · {} members ({} data + {} parity) · chunk {} bytes",
        g.level(),
        g.layout(),
        g.members(),
        g.data_chunks(),
        g.parity_chunks(),
        g.chunk_bytes()
    )?;
    say_part!("{:>8}", "stripe")?;
    for m in 0..g.members() {
        say_part!(" {:>9}", format!("m{m}"))?;
    }
    say!()?;
    for s in 0..stripes.unwrap_or(n) {
        let st = g.stripe(s);
        say_part!("{s:>8}")?;
        for m in 0..g.members() {
            let cell = match st.role(m) {
                Role::P => "P".to_string(),
                Role::Q => "Q".to_string(),
                Role::Data { index, slot } => {
                    let chunk = s * u64::from(g.data_chunks()) + u64::from(index);
                    if g.level() == Level::Raid6 {
                        format!("D{chunk}/s{slot}")
                    } else {
                        format!("D{chunk}")
                    }
                }
            };
            say_part!(" {cell:>9}")?;
        }
        say!()?;
    }
    if g.level() == Level::Raid6 {
        say!("(Dn/sk: logical chunk n, entering Q as g^k·Dn)")?;
    }
    Ok(())
}

fn map(shape: &Shape, offset: u64) -> Result<()> {
    let g = shape.geometry()?;
    let stripe_bytes = g.stripe_data_bytes();
    // Map within an array just big enough to hold the offset.
    let stripes = offset / stripe_bytes + 1;
    let arr = engine::geometry::ArrayGeometry::new(g, stripes)?;
    let block = u64::from(g.block_bytes());
    let aligned = offset - offset % block;
    let ext = arr
        .map_range(aligned, block)?
        .next()
        .context("an in-range block always maps to one extent")?;
    let st = g.stripe(ext.stripe);
    let slot = st
        .q_member()
        .map(|_| format!(", slot {}", st.q_slot(ext.data_index)))
        .unwrap_or_default();
    say!(
        "offset {offset} -> member {} offset {} (stripe {}, data index {}{slot}, chunk offset {}); P on member {}{}",
        ext.member,
        ext.member_offset + offset % block,
        ext.stripe,
        ext.data_index,
        u64::from(ext.chunk_offset) + offset % block,
        st.p_member(),
        st.q_member().map(|q| format!(", Q on member {q}")).unwrap_or_default()
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_colour_only_on_a_terminal_without_no_color() {
        assert!(log_colour(true, None));
        assert!(log_colour(true, Some("".into())));
        assert!(!log_colour(true, Some("1".into())));
        assert!(!log_colour(false, None));
        assert!(!log_colour(false, Some("".into())));
    }

    #[test]
    fn usage_errors_are_not_help() {
        let e = Cli::try_parse_from(["ferroraid", "bogus"]).unwrap_err();
        assert!(e.use_stderr());
        let e = Cli::try_parse_from(["ferroraid", "--help"]).unwrap_err();
        assert!(!e.use_stderr());
        assert!(e.to_string().contains("64"), "{e}");
    }
}
