//! The array's exports while it runs: the live NBD, iSCSI and NVMe/TCP servers, built
//! by one function ([`start_server`]) both at [`super::Target::start`] and for
//! [`super::Target::export_add`], and handed to the reactors through the
//! [`Attacher`] (`crate::frontends`).
//!
//! One server per protocol per array at a time: adding a protocol already exported is
//! [`ExportError::Exists`]; removing one shuts its server down (listeners stop, the
//! accepted requests finish and are answered, connections close) and waits up to
//! [`DRAIN_WAIT`] for every reactor to let its front-end go, after which the protocol
//! can be added again.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::geometry::ArrayGeometry;
use engine::metadata::Uuid;
use tracing::info;

use super::{ServeOptions, Shared};
use crate::frontends::{Attach, AttachError, Attacher, ExportSpec};
use crate::iscsi::IscsiServer;
use crate::nbd::{ExportConfig, NbdServer};
use crate::nvmf::NvmfServer;
use crate::status::{ExportProtocol, ExportRemoveReport, ExportReport};

/// Longest wait of [`Shared::export_remove`] for the reactors to drop a removed
/// server's front-ends (its connections drained and closed); past it the removal still
/// completes in the background and [`ExportRemoveReport::drained`] is false.
pub const DRAIN_WAIT: Duration = Duration::from_secs(5);

/// Why an export could not be added or removed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The protocol is already exported (one server per protocol per array).
    #[error("{0} is already exported (remove it first)")]
    Exists(ExportProtocol),
    /// The protocol's previous server is still draining its connections.
    #[error("the previous {0} export is still draining its connections; try again")]
    Draining(ExportProtocol),
    /// The protocol is not exported.
    #[error("{0} is not exported")]
    NotExported(ExportProtocol),
    /// The spec breaks a rule ([`ExportSpec::validate`]).
    #[error("{0}")]
    BadSpec(String),
    /// The server could not start (an address in use or not local, a bad setting).
    #[error("cannot start the {protocol} export: {message}")]
    Start {
        /// The protocol.
        protocol: ExportProtocol,
        /// The server's error, with the OS error where there is one.
        message: String,
    },
    /// The target is stopping.
    #[error("the target is stopping")]
    Stopping,
}

/// What every server of the array is built from, beside its [`ExportSpec`].
pub(super) struct ExportContext {
    /// The array name: the default NBD export name, the iSCSI and NVMe names' suffix.
    pub(super) name: String,
    pub(super) geo: ArrayGeometry,
    pub(super) uuid: Uuid,
    /// Device path of each role: the iSCSI reservation store writes every member.
    pub(super) paths: Arc<Mutex<Vec<Option<PathBuf>>>>,
    /// The protocols' settings (`nbd_config`, `nbd_tls`, `max_block_bytes`,
    /// `nbd_block_status`, `iscsi_config`, `nvmf_config`, `nvmf_allow_hosts`).
    pub(super) opts: ServeOptions,
    /// Reactors (front-ends per server).
    pub(super) reactors: usize,
}

impl ExportContext {
    /// A copy for building a server outside the exports' lock.
    fn clone_settings(&self) -> ExportContext {
        ExportContext {
            name: self.name.clone(),
            geo: self.geo,
            uuid: self.uuid,
            paths: Arc::clone(&self.paths),
            opts: self.opts.clone(),
            reactors: self.reactors,
        }
    }
}

/// One running server.
pub(super) enum Server {
    Nbd(NbdServer),
    Iscsi(IscsiServer),
    Nvmf(NvmfServer),
}

/// An NBD server's listen addresses and export name.
fn nbd_reports(n: &NbdServer) -> Vec<ExportReport> {
    let name = &n.export().name;
    let addrs = n.tcp_addrs().iter().map(SocketAddr::to_string);
    let paths = n.unix_paths().iter().map(|p| p.display().to_string());
    addrs
        .chain(paths)
        .map(|address| ExportReport {
            protocol: ExportProtocol::Nbd,
            address,
            name: name.clone(),
        })
        .collect()
}

/// An iSCSI target's listen addresses and target name.
fn iscsi_reports(i: &IscsiServer) -> Vec<ExportReport> {
    i.addrs()
        .iter()
        .map(|a| ExportReport {
            protocol: ExportProtocol::Iscsi,
            address: a.to_string(),
            name: i.target_name().to_string(),
        })
        .collect()
}

/// An NVMe/TCP target's listen addresses (bound at its start) and subsystem NQN.
fn nvmf_reports(t: &NvmfServer) -> Vec<ExportReport> {
    t.addrs()
        .iter()
        .map(|a| ExportReport {
            protocol: ExportProtocol::Nvmf,
            address: a.to_string(),
            name: t.nqn().to_string(),
        })
        .collect()
}

impl Server {
    /// Its listen addresses and names.
    fn reports(&self) -> Vec<ExportReport> {
        match self {
            Server::Nbd(n) => nbd_reports(n),
            Server::Iscsi(i) => iscsi_reports(i),
            Server::Nvmf(t) => nvmf_reports(t),
        }
    }

    fn shutdown(self) {
        match self {
            Server::Nbd(n) => n.shutdown(),
            Server::Iscsi(i) => i.shutdown(),
            Server::Nvmf(t) => t.shutdown(),
        }
    }
}

/// Starts the server `spec` asks for with the array's settings: its listeners bound and
/// one front-end per reactor (reactor order) to attach. Used by [`super::Target::start`]
/// (each protocol of [`ServeOptions`]) and [`super::Target::export_add`] alike.
///
/// An NBD spec with no address listens on the NBD default (127.0.0.1:10809), an iSCSI
/// one on 127.0.0.1:3260, an NVMe/TCP one on 127.0.0.1:4420 (the builders' defaults).
///
/// # Errors
/// [`ExportError::Start`]: an address that cannot be bound, a setting the server refuses.
pub(super) fn start_server(
    ctx: &ExportContext,
    spec: &ExportSpec,
) -> Result<(Server, Vec<Attach>), ExportError> {
    let opts = &ctx.opts;
    let n = ctx.reactors;
    let start_err = |e: &dyn std::fmt::Display| ExportError::Start {
        protocol: spec.protocol,
        message: e.to_string(),
    };
    match spec.protocol {
        ExportProtocol::Nbd => {
            let name = spec.name.clone().unwrap_or_else(|| ctx.name.clone());
            let mut export = ExportConfig::for_array(name, &ctx.geo, opts.max_block_bytes);
            export.block_status = opts.nbd_block_status;
            let mut b = NbdServer::builder(export).config(opts.nbd_config.clone());
            if let Some(t) = &opts.nbd_tls {
                b = b.tls(t.clone());
            }
            for a in &spec.tcp {
                b = b.listen_tcp(*a);
            }
            for p in &spec.unix {
                b = b.listen_unix(p);
            }
            let (s, f) = b.start(n).map_err(|e| start_err(&e))?;
            Ok((Server::Nbd(s), f.into_iter().map(Attach::Nbd).collect()))
        }
        ExportProtocol::Iscsi => {
            let lun = crate::iscsi::lun_info(&ctx.name, &ctx.geo, ctx.uuid.0, &opts.iscsi_config);
            let mut b = IscsiServer::builder(lun).config(opts.iscsi_config.clone());
            let members = Arc::clone(&ctx.paths);
            let store = crate::iscsi::member_store::MemberStore::new(
                ctx.uuid,
                Box::new(move || {
                    members
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .iter()
                        .flatten()
                        .cloned()
                        .collect()
                }),
            );
            b = b.reservation_store(Arc::new(store));
            for a in &spec.tcp {
                b = b.listen(*a);
            }
            let (s, f) = b.start(n).map_err(|e| start_err(&e))?;
            Ok((Server::Iscsi(s), f.into_iter().map(Attach::Iscsi).collect()))
        }
        ExportProtocol::Nvmf => {
            let sub = crate::nvmf::spec::Subsystem::for_array(&ctx.name, ctx.uuid.0, &ctx.geo);
            let mut b = NvmfServer::builder(sub).config(opts.nvmf_config.clone());
            for a in &spec.tcp {
                b = b.listen(*a);
            }
            for h in &opts.nvmf_allow_hosts {
                b = b.allow_host(h.clone());
            }
            let (s, f) = b.start(n).map_err(|e| start_err(&e))?;
            Ok((Server::Nvmf(s), f.into_iter().map(Attach::Nvmf).collect()))
        }
    }
}

/// The specs [`ServeOptions`] asks for at start: NBD unless `nbd` is off, iSCSI and
/// NVMe/TCP when they have addresses.
pub(super) fn initial_specs(opts: &ServeOptions) -> Vec<ExportSpec> {
    let mut out = Vec::new();
    if opts.nbd {
        out.push(ExportSpec {
            protocol: ExportProtocol::Nbd,
            tcp: opts.nbd_tcp.clone(),
            unix: opts.nbd_unix.clone(),
            name: None,
        });
    }
    for (protocol, tcp) in [
        (ExportProtocol::Iscsi, &opts.iscsi),
        (ExportProtocol::Nvmf, &opts.nvmf),
    ] {
        if !tcp.is_empty() {
            out.push(ExportSpec {
                protocol,
                tcp: tcp.clone(),
                unix: Vec::new(),
                name: None,
            });
        }
    }
    out
}

/// Logs one listening export as `serve` always has (the tests and operators look for
/// these lines).
fn log_listening(r: &ExportReport) {
    match r.protocol {
        ExportProtocol::Nbd => {
            info!(address = %r.address, export = %r.name, "NBD export listening")
        }
        ExportProtocol::Iscsi => {
            info!(address = %r.address, target = %r.name, "iSCSI target listening")
        }
        ExportProtocol::Nvmf => {
            info!(address = %r.address, nqn = %r.name, "NVMe/TCP target listening")
        }
    }
}

/// The live exports of the array.
pub(super) struct Exports {
    pub(super) ctx: ExportContext,
    pub(super) attacher: Attacher,
    pub(super) nbd: Option<NbdServer>,
    pub(super) iscsi: Option<IscsiServer>,
    pub(super) nvmf: Option<NvmfServer>,
    /// [`Exports::shut_all`] ran: nothing is added any more.
    stopping: bool,
}

impl Exports {
    /// The exports of `servers` (as [`start_server`] started them), attached through
    /// `attacher`.
    pub(super) fn new(ctx: ExportContext, attacher: Attacher, servers: Vec<Server>) -> Self {
        let mut e = Exports {
            ctx,
            attacher,
            nbd: None,
            iscsi: None,
            nvmf: None,
            stopping: false,
        };
        for s in servers {
            for r in s.reports() {
                log_listening(&r);
            }
            e.put(s);
        }
        e
    }

    fn put(&mut self, s: Server) {
        match s {
            Server::Nbd(n) => self.nbd = Some(n),
            Server::Iscsi(i) => self.iscsi = Some(i),
            Server::Nvmf(t) => self.nvmf = Some(t),
        }
    }

    fn take(&mut self, p: ExportProtocol) -> Option<Server> {
        match p {
            ExportProtocol::Nbd => self.nbd.take().map(Server::Nbd),
            ExportProtocol::Iscsi => self.iscsi.take().map(Server::Iscsi),
            ExportProtocol::Nvmf => self.nvmf.take().map(Server::Nvmf),
        }
    }

    fn live(&self, p: ExportProtocol) -> bool {
        match p {
            ExportProtocol::Nbd => self.nbd.is_some(),
            ExportProtocol::Iscsi => self.iscsi.is_some(),
            ExportProtocol::Nvmf => self.nvmf.is_some(),
        }
    }

    /// Every live export's addresses and names: NBD, iSCSI, NVMe/TCP.
    pub(super) fn reports(&self) -> Vec<ExportReport> {
        let mut out = Vec::new();
        out.extend(self.nbd.iter().flat_map(nbd_reports));
        out.extend(self.iscsi.iter().flat_map(iscsi_reports));
        out.extend(self.nvmf.iter().flat_map(nvmf_reports));
        out
    }

    /// Shuts every server down and closes the reactors' inboxes: the front-ends drain and
    /// finish; the reactors may be stopped after this.
    pub(super) fn shut_all(&mut self) {
        self.stopping = true;
        for p in crate::frontends::PROTOCOLS {
            if let Some(s) = self.take(p) {
                s.shutdown();
            }
        }
        self.attacher.close();
    }
}

impl Shared {
    /// Starts the export `spec` asks for and hands its front-ends to the running reactors
    /// (see [`super::Target::export_add`]).
    pub(super) fn export_add(&self, spec: &ExportSpec) -> Result<Vec<ExportReport>, ExportError> {
        spec.validate().map_err(ExportError::BadSpec)?;
        let p = spec.protocol;
        // Checked before binding (a clear answer, no socket touched), and again by the
        // attacher under the same lock.
        {
            let e = self.exports();
            if e.stopping {
                return Err(ExportError::Stopping);
            }
            if e.live(p) {
                return Err(ExportError::Exists(p));
            }
            if e.attacher.occupied(p) {
                return Err(ExportError::Draining(p));
            }
        }
        // Binding and the server's threads start outside the lock: `status` goes on.
        let ctx = self.exports().ctx.clone_settings();
        let (server, fronts) = start_server(&ctx, spec)?;
        let mut e = self.exports();
        if e.stopping {
            drop(e);
            server.shutdown();
            return Err(ExportError::Stopping);
        }
        if e.live(p) {
            // Another export_add of the protocol won the race.
            drop(e);
            server.shutdown();
            return Err(ExportError::Exists(p));
        }
        if let Err(err) = e.attacher.attach(fronts) {
            drop(e);
            server.shutdown();
            return Err(match err {
                AttachError::Closed => ExportError::Stopping,
                AttachError::Draining(p) => ExportError::Draining(p),
                AttachError::Count { .. } => ExportError::Start {
                    protocol: p,
                    message: err.to_string(),
                },
            });
        }
        let reports = server.reports();
        for r in &reports {
            log_listening(r);
        }
        info!(protocol = %p, "export added");
        e.put(server);
        Ok(reports)
    }

    /// Shuts the export of `p` down and waits up to [`DRAIN_WAIT`] for its connections
    /// to drain (see [`super::Target::export_remove`]).
    pub(super) fn export_remove(
        &self,
        p: ExportProtocol,
    ) -> Result<ExportRemoveReport, ExportError> {
        let server = {
            let mut e = self.exports();
            if e.stopping {
                return Err(ExportError::Stopping);
            }
            e.take(p).ok_or(ExportError::NotExported(p))?
        };
        let exports = server.reports();
        // Listeners stop and connections drain on their reactors; joins the listener
        // threads (outside the lock: `status` goes on).
        server.shutdown();
        let deadline = Instant::now() + DRAIN_WAIT;
        let drained = loop {
            if !self.exports().attacher.occupied(p) {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        info!(protocol = %p, drained, "export removed");
        Ok(ExportRemoveReport {
            protocol: p,
            exports,
            drained,
        })
    }
}
