//! The front-end each reactor runs: NBD, iSCSI and NVMe/TCP side by side on the same
//! reactor, each present or not, added and removed while the reactors run.
//!
//! [`TargetFrontend`] polls each present front-end every loop turn and routes each array
//! completion back to the front-end that submitted it by its tag: the iSCSI front-end
//! sets [`crate::iscsi::frontend::TAG_BIT`] (bit 45) on its tags, the NVMe/TCP front-end
//! [`crate::nvmf::frontend::TAG_BIT`] (bit 44); NBD tags are context indexes below 2^16.
//! Every tag is below [`engine::reactor::WHOLE_TAG_LIMIT`] (checked at compile time), so a
//! request inside one stripe goes between reactors without a parent entry.
//! At most one front-end per protocol is in a reactor's slot at a time (the
//! [`Attacher`] refuses a second while the first still drains), so the tag bits always
//! name one front-end.
//!
//! **Runtime exports.** A server started while the reactors run hands its per-reactor
//! front-ends to the [`Attacher`], which posts each to its reactor's inbox (a bounded
//! lock-free queue); the reactor takes them at the start of its next turn (one atomic
//! load per turn when nothing was posted). A server shut down (stop accepting, finish the
//! accepted requests, reply, close) leaves its front-ends in their slots until they are
//! [`Frontend::finished`]; the reactor then drops them and counts the slot free again.
//!
//! **Finishing.** [`TargetFrontend::finished`] is true once the target asked to stop
//! ([`Attacher::close`]; no front-end is attached after that), nothing waits in the inbox
//! and every slot is empty or finished: each part stays true once true, so the whole does
//! (the engine's contract, `engine::reactor::Frontend::finished`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;
use engine::array::ArrayCompletion;
use engine::device::Channel;
use engine::reactor::{Frontend, Io};
use tracing::{info, warn};

use crate::iscsi::frontend::TAG_BIT;
use crate::iscsi::IscsiFrontend;
use crate::nbd::NbdFrontend;
use crate::nvmf::frontend::TAG_BIT as NVMF_TAG_BIT;
use crate::nvmf::NvmfFrontend;
use crate::status::ExportProtocol;

// The tag spaces stay apart and below the reactors' whole-piece limit: iSCSI's marker over
// a task index (`u16`); NVMe/TCP's over slot << 16 | context (below 2^32); NBD's context
// indexes below 2^16.
const _: () = assert!(
    TAG_BIT != NVMF_TAG_BIT
        && TAG_BIT.is_power_of_two()
        && NVMF_TAG_BIT.is_power_of_two()
        && TAG_BIT > 0xFFFF_FFFF
        && NVMF_TAG_BIT > 0xFFFF_FFFF
        && TAG_BIT + 0xFFFF < engine::reactor::WHOLE_TAG_LIMIT
        && NVMF_TAG_BIT + 0xFFFF_FFFF < engine::reactor::WHOLE_TAG_LIMIT
);

/// Front-ends a reactor's inbox holds at most: one per protocol (the [`Attacher`] posts
/// a protocol's front-end only when none of that protocol is queued or in a slot).
const INBOX_CAPACITY: usize = 3;

/// The protocols, in slot order ([`slot_index`]).
pub const PROTOCOLS: [ExportProtocol; 3] = [
    ExportProtocol::Nbd,
    ExportProtocol::Iscsi,
    ExportProtocol::Nvmf,
];

/// Index of `p` in the per-protocol counters.
fn slot_index(p: ExportProtocol) -> usize {
    match p {
        ExportProtocol::Nbd => 0,
        ExportProtocol::Iscsi => 1,
        ExportProtocol::Nvmf => 2,
    }
}

/// An export to start on a running array ([`crate::target::Target::export_add`]): the
/// protocol, where it listens and (NBD only) the export name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSpec {
    /// The protocol.
    pub protocol: ExportProtocol,
    /// TCP listening addresses (port 0: any free port; the bound one is reported).
    pub tcp: Vec<std::net::SocketAddr>,
    /// Unix socket paths (NBD only).
    pub unix: Vec<std::path::PathBuf>,
    /// The NBD export name clients ask for (`None`: the array name). iSCSI and NVMe/TCP
    /// names derive from the array name (`iqn.2026-11.org.ferroraid:<array>`,
    /// `nqn.2026-11.org.ferroraid:<array>`) and take none.
    pub name: Option<String>,
}

impl ExportSpec {
    /// Parses one listen address as the CLI and JSON-RPC give it: `HOST:PORT` (an IP
    /// address and a port), or `unix:PATH` for NBD.
    ///
    /// # Errors
    /// A malformed address, or a Unix path for iSCSI or NVMe/TCP (the message says which).
    pub fn push_listen(&mut self, s: &str) -> Result<(), String> {
        // Quoted at most 64 characters long.
        let quoted = if s.chars().count() > 64 {
            format!("{}…", s.chars().take(64).collect::<String>())
        } else {
            s.to_string()
        };
        if let Some(p) = s.strip_prefix("unix:") {
            if self.protocol != ExportProtocol::Nbd {
                return Err(format!(
                    "listen {quoted:?}: {} listens on TCP only (IP:PORT)",
                    self.protocol
                ));
            }
            if p.is_empty() || p.contains('\0') {
                return Err(format!("listen {quoted:?}: unix: needs a socket path"));
            }
            self.unix.push(std::path::PathBuf::from(p));
            return Ok(());
        }
        let a = s.parse().map_err(|_| {
            let unix = if self.protocol == ExportProtocol::Nbd {
                " or unix:PATH"
            } else {
                ""
            };
            format!("listen {quoted:?}: expected IP:PORT (e.g. 127.0.0.1:10809){unix}")
        })?;
        self.tcp.push(a);
        Ok(())
    }

    /// Checks what a runtime export needs: at least one address, no duplicate, a name only
    /// for NBD, non-empty and at most 4096 bytes (the NBD protocol's limit on names).
    ///
    /// # Errors
    /// The first rule broken, in words.
    pub fn validate(&self) -> Result<(), String> {
        if self.tcp.is_empty() && self.unix.is_empty() {
            return Err("an export needs at least one listen address".into());
        }
        for (i, a) in self.tcp.iter().enumerate() {
            if self.tcp[..i].contains(a) {
                return Err(format!("listen address {a} given twice"));
            }
        }
        for (i, p) in self.unix.iter().enumerate() {
            if self.unix[..i].contains(p) {
                return Err(format!("listen socket {} given twice", p.display()));
            }
        }
        match &self.name {
            Some(_) if self.protocol != ExportProtocol::Nbd => Err(format!(
                "name applies to NBD only: the {} name derives from the array name",
                self.protocol
            )),
            Some(n) if n.is_empty() || n.len() > 4096 => {
                Err("name must be 1 to 4096 bytes (NBD's limit)".into())
            }
            _ => Ok(()),
        }
    }
}

/// One reactor's front-end of one protocol, as a server's builder returned it.
pub enum Attach {
    /// An NBD server's front-end.
    Nbd(NbdFrontend),
    /// An iSCSI target's front-end.
    Iscsi(IscsiFrontend),
    /// An NVMe/TCP target's front-end.
    Nvmf(NvmfFrontend),
}

impl Attach {
    /// Its protocol.
    pub fn protocol(&self) -> ExportProtocol {
        match self {
            Attach::Nbd(_) => ExportProtocol::Nbd,
            Attach::Iscsi(_) => ExportProtocol::Iscsi,
            Attach::Nvmf(_) => ExportProtocol::Nvmf,
        }
    }
}

/// What the target and one reactor share: the inbox of front-ends to attach and the
/// count of front-ends the reactor has let go, per protocol.
struct Port {
    inbox: ArrayQueue<Attach>,
    /// Front-ends pushed so far, counted after each push (the one load a turn makes: the
    /// reactor compares it with the count it has taken).
    posted: AtomicU64,
    /// Front-ends of each protocol ([`slot_index`]) the reactor dropped once finished.
    released: [AtomicU64; 3],
}

/// The target's side of every reactor's inbox: attaches a server's front-ends while the
/// reactors run, tells when a removed server's front-ends are gone, and closes the
/// inboxes when the target stops. Not `Sync` by design: the target serializes its export
/// changes (one mutex), so a protocol's count of front-ends posted is exact.
pub struct Attacher {
    ports: Vec<Arc<Port>>,
    /// The target asked to stop: no attach after this.
    closed: Arc<AtomicBool>,
    /// Front-ends of each protocol posted to (or installed on) every reactor so far.
    posted: [u64; 3],
}

/// Why front-ends could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The target is stopping.
    #[error("the target is stopping")]
    Closed,
    /// Not one front-end per reactor.
    #[error("{got} front-ends for {reactors} reactors")]
    Count {
        /// Front-ends given.
        got: usize,
        /// Reactors.
        reactors: usize,
    },
    /// A front-end of the protocol is still queued or draining on a reactor.
    #[error("the previous {0} export is still draining its connections; try again")]
    Draining(ExportProtocol),
}

impl Attacher {
    /// An attacher for `reactors` reactors and their [`TargetFrontend`]s (reactor order),
    /// each holding the front-ends in `initial` (one `Vec` per protocol present at start,
    /// each one front-end per reactor in reactor order, as the servers' builders'
    /// `start(reactors)` return them).
    ///
    /// # Errors
    /// [`AttachError::Count`] when a `Vec` does not have `reactors` front-ends, or `reactors`
    /// is 0.
    pub fn new(
        reactors: usize,
        initial: Vec<Vec<Attach>>,
    ) -> Result<(Attacher, Vec<TargetFrontend>), AttachError> {
        if reactors == 0 {
            return Err(AttachError::Count { got: 0, reactors });
        }
        if let Some(v) = initial.iter().find(|v| v.len() != reactors) {
            return Err(AttachError::Count {
                got: v.len(),
                reactors,
            });
        }
        let closed = Arc::new(AtomicBool::new(false));
        let mut attacher = Attacher {
            ports: Vec::with_capacity(reactors),
            closed: Arc::clone(&closed),
            posted: [0; 3],
        };
        let mut fronts: Vec<TargetFrontend> = (0..reactors)
            .map(|_| {
                let port = Arc::new(Port {
                    inbox: ArrayQueue::new(INBOX_CAPACITY),
                    posted: AtomicU64::new(0),
                    released: Default::default(),
                });
                attacher.ports.push(Arc::clone(&port));
                TargetFrontend {
                    nbd: None,
                    iscsi: None,
                    nvmf: None,
                    port,
                    taken: 0,
                    closed: Arc::clone(&closed),
                }
            })
            .collect();
        // `posted` counts exports (one server's front-ends on every reactor count once),
        // as `attach` does; each reactor counts the front-ends it released.
        for v in initial {
            let Some(p) = v.first().map(Attach::protocol) else {
                continue;
            };
            let mut refused = false;
            for (f, a) in fronts.iter_mut().zip(v) {
                if let Some(old) = f.install(a) {
                    // Two front-ends of one protocol at start: the second is refused.
                    warn!(protocol = %old.protocol(), "a second front-end of the protocol at start: dropped");
                    refused = true;
                }
            }
            if !refused {
                attacher.posted[slot_index(p)] += 1;
            }
        }
        Ok((attacher, fronts))
    }

    /// Reactors served.
    pub fn reactors(&self) -> usize {
        self.ports.len()
    }

    /// Whether a front-end of `p` is queued or in a slot on any reactor (a server of that
    /// protocol is exported, or a removed one still drains).
    pub fn occupied(&self, p: ExportProtocol) -> bool {
        let i = slot_index(p);
        self.ports
            .iter()
            .any(|port| port.released[i].load(Ordering::Acquire) < self.posted[i])
    }

    /// Posts `fronts` (one per reactor, reactor order, all of one protocol) to the
    /// reactors' inboxes; each reactor installs its own at the start of its next turn.
    ///
    /// # Errors
    /// [`AttachError::Closed`] once [`Attacher::close`] was called;
    /// [`AttachError::Count`]; [`AttachError::Draining`] while a front-end of the protocol
    /// is still queued or in a slot. Nothing is posted on error (the front-ends are
    /// dropped with it).
    pub fn attach(&mut self, fronts: Vec<Attach>) -> Result<(), AttachError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(AttachError::Closed);
        }
        if fronts.len() != self.ports.len() {
            return Err(AttachError::Count {
                got: fronts.len(),
                reactors: self.ports.len(),
            });
        }
        let Some(p) = fronts.first().map(Attach::protocol) else {
            return Err(AttachError::Count {
                got: 0,
                reactors: self.ports.len(),
            });
        };
        if fronts.iter().any(|f| f.protocol() != p) {
            return Err(AttachError::Count {
                got: fronts.len(),
                reactors: self.ports.len(),
            });
        }
        if self.occupied(p) {
            return Err(AttachError::Draining(p));
        }
        for (port, f) in self.ports.iter().zip(fronts) {
            // Room is certain: at most one front-end per protocol is queued or installed
            // (checked above), and the inbox holds one per protocol.
            if port.inbox.push(f).is_err() {
                unreachable!("an inbox holds one front-end per protocol");
            }
            port.posted.fetch_add(1, Ordering::AcqRel);
        }
        self.posted[slot_index(p)] += 1;
        Ok(())
    }

    /// No front-end is attached from now on; once every slot's front-end finished, every
    /// [`TargetFrontend`] is finished. Call it before asking the reactors to stop, after
    /// shutting down every server.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

/// One reactor's front-ends: an NBD, an iSCSI and an NVMe/TCP slot, each empty or holding
/// one front-end, and the inbox of front-ends to install ([`Attacher`]).
pub struct TargetFrontend {
    nbd: Option<NbdFrontend>,
    iscsi: Option<IscsiFrontend>,
    nvmf: Option<NvmfFrontend>,
    port: Arc<Port>,
    /// `port.posted` when the inbox was last emptied: every front-end counted up to it
    /// was installed.
    taken: u64,
    closed: Arc<AtomicBool>,
}

impl TargetFrontend {
    /// Puts `a` in its slot; returns what the slot held if it was not empty (the
    /// [`Attacher`] never lets that happen).
    fn install(&mut self, a: Attach) -> Option<Attach> {
        match a {
            Attach::Nbd(f) => self.nbd.replace(f).map(Attach::Nbd),
            Attach::Iscsi(f) => self.iscsi.replace(f).map(Attach::Iscsi),
            Attach::Nvmf(f) => self.nvmf.replace(f).map(Attach::Nvmf),
        }
    }

    /// Installs what was posted. Cold: runs only after an [`Attacher::attach`].
    #[cold]
    fn take_posted(&mut self, posted: u64) {
        // Every push counted in `posted` happened before; a later one counts again.
        self.taken = posted;
        while let Some(a) = self.port.inbox.pop() {
            let p = a.protocol();
            if let Some(old) = self.install(a) {
                // Unreachable with the attacher's rule; keep the slot's front-end (it may
                // have requests in flight) and let the newcomer go.
                let new = self.install(old);
                drop(new);
                warn!(protocol = %p, "a front-end arrived for a busy slot: dropped");
                self.port.released[slot_index(p)].fetch_add(1, Ordering::AcqRel);
            } else {
                info!(protocol = %p, "front-end attached");
            }
        }
    }

    /// Drops the front-end of `p`'s slot (finished: nothing in flight) and counts it.
    #[cold]
    fn release(&mut self, p: ExportProtocol) {
        match p {
            ExportProtocol::Nbd => drop(self.nbd.take()),
            ExportProtocol::Iscsi => drop(self.iscsi.take()),
            ExportProtocol::Nvmf => drop(self.nvmf.take()),
        }
        self.port.released[slot_index(p)].fetch_add(1, Ordering::AcqRel);
    }
}

impl Frontend for TargetFrontend {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        let mut progress = false;
        let posted = self.port.posted.load(Ordering::Acquire);
        if posted != self.taken {
            self.take_posted(posted);
            progress = true;
        }
        if let Some(n) = self.nbd.as_mut() {
            progress |= n.poll(io);
            if n.finished() {
                self.release(ExportProtocol::Nbd);
            }
        }
        if let Some(i) = self.iscsi.as_mut() {
            progress |= i.poll(io);
            if i.finished() {
                self.release(ExportProtocol::Iscsi);
            }
        }
        if let Some(n) = self.nvmf.as_mut() {
            progress |= n.poll(io);
            if n.finished() {
                self.release(ExportProtocol::Nvmf);
            }
        }
        progress
    }

    fn complete(&mut self, c: ArrayCompletion) {
        if c.tag & TAG_BIT != 0 {
            match self.iscsi.as_mut() {
                Some(i) => i.complete(c),
                None => warn!(tag = c.tag, "iSCSI completion with no iSCSI front-end"),
            }
        } else if c.tag & NVMF_TAG_BIT != 0 {
            match self.nvmf.as_mut() {
                Some(n) => n.complete(c),
                None => warn!(
                    tag = c.tag,
                    "NVMe/TCP completion with no NVMe/TCP front-end"
                ),
            }
        } else {
            match self.nbd.as_mut() {
                Some(n) => n.complete(c),
                None => warn!(tag = c.tag, "NBD completion with no NBD front-end"),
            }
        }
    }

    fn finished(&self) -> bool {
        // `closed` first: once it reads true no attach follows, so an empty inbox stays
        // empty (the attacher checks `closed` before it posts, under the target's lock).
        self.closed.load(Ordering::Acquire)
            && self.port.inbox.is_empty()
            && self.nbd.as_ref().is_none_or(NbdFrontend::finished)
            && self.iscsi.as_ref().is_none_or(IscsiFrontend::finished)
            && self.nvmf.as_ref().is_none_or(NvmfFrontend::finished)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attacher_counts_reactors_and_refuses_a_wrong_count() {
        assert!(matches!(
            Attacher::new(0, Vec::new()),
            Err(AttachError::Count { reactors: 0, .. })
        ));
        let (mut a, fronts) = Attacher::new(2, Vec::new()).unwrap();
        assert_eq!((a.reactors(), fronts.len()), (2, 2));
        assert!(PROTOCOLS.iter().all(|p| !a.occupied(*p)));
        assert!(matches!(
            a.attach(Vec::new()),
            Err(AttachError::Count { got: 0, .. })
        ));
        // No export at all: finished as soon as the target closes.
        assert!(fronts.iter().all(|f| !f.finished()));
        a.close();
        assert!(fronts.iter().all(TargetFrontend::finished));
        assert!(matches!(a.attach(Vec::new()), Err(AttachError::Closed)));
    }

    /// An export present at start counts once, whatever the reactors (a count per
    /// reactor left it "still draining" for good once removed, with 2+ reactors).
    #[test]
    fn an_export_at_start_counts_once_on_several_reactors() {
        let g = engine::geometry::Geometry::new(
            engine::geometry::Level::Raid5,
            engine::geometry::Layout::LeftSymmetric,
            4,
            64 << 10,
            512,
        )
        .unwrap();
        let geo = engine::geometry::ArrayGeometry::new(g, 16).unwrap();
        let export = crate::nbd::ExportConfig::for_array("t", &geo, 1 << 20);
        let (server, nbd) = crate::nbd::NbdServer::builder(export)
            .listen_tcp("127.0.0.1:0".parse().unwrap())
            .start(3)
            .unwrap();
        let (a, fronts) =
            Attacher::new(3, vec![nbd.into_iter().map(Attach::Nbd).collect()]).unwrap();
        assert_eq!(fronts.len(), 3);
        assert_eq!(a.posted[slot_index(ExportProtocol::Nbd)], 1);
        assert!(a.occupied(ExportProtocol::Nbd));
        // Each reactor releasing its front-end frees the protocol.
        for port in &a.ports {
            port.released[slot_index(ExportProtocol::Nbd)].fetch_add(1, Ordering::AcqRel);
        }
        assert!(!a.occupied(ExportProtocol::Nbd));
        server.shutdown();
    }
}
