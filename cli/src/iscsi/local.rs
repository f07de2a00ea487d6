//! The iSCSI target without listeners or threads, driven by the caller: for the stateful
//! fuzz target (`fuzz/fuzz_targets/iscsi_session.rs`) and tests that must not depend on
//! thread timing.
//!
//! It is the real target, not a model: [`LocalServer::new`] checks the LUN and the
//! tunables as [`super::IscsiServerBuilder::start`] does (for one reactor) and returns the
//! same [`IscsiFrontend`]; [`LocalServer::accept`] starts the same login state machine
//! (`login::Login`: security negotiation with AuthMethod=None or CHAP, operational
//! negotiation, discovery sessions with SendTargets) that a login thread runs with
//! blocking reads, and [`LocalLogin::drive`] feeds it from a non-blocking Unix socket,
//! reading exactly one PDU at a time as the login thread does (bytes the initiator sent
//! after its last Login Request stay in the socket for the front-end). A normal session's
//! connection that reaches the full-feature phase goes, after its last Login Response is
//! sent, to the front-end's inbox, where its next `poll` adopts it: run the front-end on a
//! reactor driven by the caller's thread (`engine::reactor::run_local`).
//!
//! What differs from a listener's login thread: no login timeouts or deadline (the caller
//! decides how long to drive a login), and the login's random numbers are fixed
//! functions of the connection number (RFC 7143 §12.1.3 CHAP challenges and identifiers,
//! the first StatSN) so that a client whose bytes are fixed in advance can answer CHAP:
//! connection `id` (1 for the server's first connection, then 2, ...) gets the challenge
//! whose byte `i` is `(31 × id + i) mod 256` (16 bytes), CHAP_I `id mod 256`, and StatSN
//! `id` on its first Login Response. Never serve a network with this.
//!
//! ```
//! # use std::os::unix::net::UnixStream;
//! # use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
//! # use ferroraid::iscsi::{lun_info, IscsiConfig};
//! # use ferroraid::iscsi::local::{LocalServer, LoginState};
//! let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 64 << 10, 512).unwrap();
//! let geo = ArrayGeometry::new(g, 16).unwrap();
//! let config = IscsiConfig::default();
//! let lun = lun_info("x", &geo, [1; 16], &config);
//! let (server, _frontend) = LocalServer::new(lun, config).unwrap();
//! let (_client, theirs) = UnixStream::pair().unwrap();
//! let mut login = server.accept(theirs).unwrap();
//! // The initiator has sent nothing yet.
//! assert_eq!(login.drive(&server), LoginState::Reading);
//! ```

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::login::{hand_over, pdu_data, pdu_wire_bytes, Entropy, Login, Step};
use super::pdu::{Bhs, BHS_BYTES};
use super::scsi::LunInfo;
use super::{prepare, IscsiConfig, IscsiError, IscsiFrontend, Shared};
use crate::nbd::conn::Stream;

/// The address a local login reports as the portal it reached (SendTargets'
/// TargetAddress, RFC 7143 Appendix C).
pub const LOCAL_PORTAL: &str = "127.0.0.1:3260";

/// An iSCSI target with one reactor's front-end and no listener or thread (see the module
/// docs). Dropping it does not stop the front-end: request shutdown with
/// [`LocalServer::shutdown`] and keep turning the reactor until the front-end finishes.
pub struct LocalServer {
    shared: Arc<Shared>,
}

impl LocalServer {
    /// The target for `lun` with tunables `config`, and the front-end of its one reactor.
    ///
    /// # Errors
    /// [`IscsiError::Config`] for invalid tunables, as
    /// [`super::IscsiServerBuilder::start`].
    pub fn new(lun: LunInfo, config: IscsiConfig) -> Result<(Self, IscsiFrontend), IscsiError> {
        // No reservation store: APTPL is refused (a persister thread would make runs
        // nondeterministic); every other reservation command runs.
        let shared = prepare(lun, config, 1, None)?;
        let frontend = IscsiFrontend::new(0, Arc::clone(&shared), Arc::clone(&shared.inboxes[0]));
        Ok((Self { shared }, frontend))
    }

    /// Starts the login of an initiator connected over `stream` (the target's end of a
    /// socket pair, made non-blocking here).
    ///
    /// # Errors
    /// The socket cannot be made non-blocking.
    pub fn accept(&self, stream: UnixStream) -> io::Result<LocalLogin> {
        stream.set_nonblocking(true)?;
        let id = self.shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let login = Login::new(
            id,
            format!("local-{id}"),
            LOCAL_PORTAL.to_string(),
            &self.shared,
            Entropy::Fixed,
        );
        Ok(LocalLogin {
            conn: Some((stream, login)),
            rx: Vec::new(),
            need: BHS_BYTES,
            bhs: None,
            out: Vec::new(),
            out_at: 0,
            after: None,
            state: LoginState::Reading,
        })
    }

    /// The target name (`iqn.2026-11.org.ferroraid:<array>`).
    pub fn target_name(&self) -> &str {
        &self.shared.target_name
    }

    /// Sessions registered now (by logins that reached the full-feature phase, until
    /// their last connection ends on the front-end).
    pub fn sessions(&self) -> usize {
        self.shared
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Requests shutdown, as [`super::IscsiServer::shutdown`]: logins still driven end,
    /// the front-end drains its connections and then reports itself finished.
    pub fn shutdown(&self) {
        self.shared.shutdown.store(true, Ordering::Release);
    }
}

/// Where a [`LocalLogin`] stands after [`LocalLogin::drive`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoginState {
    /// Waiting for the initiator's bytes.
    Reading,
    /// Replies queued that the socket does not take yet.
    Writing,
    /// A normal session's connection was handed to the front-end.
    FullFeature,
    /// The login failed, the initiator went away, a discovery session logged out, or the
    /// server shut down: the socket is closed.
    Ended,
}

/// What to do once the queued replies are sent.
#[derive(Clone, Copy, Debug)]
enum After {
    Close,
    HandOver,
}

/// One initiator's login (and discovery session) with a [`LocalServer`].
pub struct LocalLogin {
    conn: Option<(UnixStream, Login)>,
    /// The PDU being received.
    rx: Vec<u8>,
    /// Bytes of it wanted: the basic header, then the whole PDU.
    need: usize,
    bhs: Option<Bhs>,
    /// Replies not yet sent, from `out_at` on.
    out: Vec<u8>,
    out_at: usize,
    after: Option<After>,
    state: LoginState,
}

/// Sends without blocking and without `SIGPIPE`. `Ok(0)` only when `b` is empty.
fn send(s: &UnixStream, b: &[u8]) -> io::Result<usize> {
    // SAFETY: `b` is a valid slice for the call; the descriptor is open (owned by `s`).
    let n = unsafe {
        libc::send(
            s.as_raw_fd(),
            b.as_ptr().cast(),
            b.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

impl LocalLogin {
    /// Sends what is queued, reads and answers what the initiator sent, as far as the
    /// socket allows without blocking. Once [`LoginState::FullFeature`] or
    /// [`LoginState::Ended`] it stays there (later calls do nothing).
    pub fn drive(&mut self, server: &LocalServer) -> LoginState {
        let shared = &*server.shared;
        loop {
            let Some((stream, login)) = self.conn.as_mut() else {
                return self.state;
            };
            while self.out_at < self.out.len() {
                match send(stream, &self.out[self.out_at..]) {
                    Ok(n) if n > 0 => self.out_at += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.state = LoginState::Writing;
                        return self.state;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    _ => return self.end(shared),
                }
            }
            self.out.clear();
            self.out_at = 0;
            match self.after.take() {
                Some(After::Close) => return self.end(shared),
                Some(After::HandOver) => {
                    let (stream, login) = self.conn.take().expect("checked above");
                    hand_over(login.into_new_conn(Stream::Unix(stream), shared), shared);
                    self.state = LoginState::FullFeature;
                    return self.state;
                }
                None => {}
            }
            // As the login thread: shutdown is looked at before each PDU.
            if self.rx.is_empty() && shared.shutdown.load(Ordering::Acquire) {
                return self.end(shared);
            }
            let have = self.rx.len();
            self.rx.resize(self.need, 0);
            match stream.read(&mut self.rx[have..]) {
                Ok(0) => return self.end(shared),
                Ok(n) => self.rx.truncate(have + n),
                Err(e) => {
                    self.rx.truncate(have);
                    match e.kind() {
                        io::ErrorKind::WouldBlock => {
                            self.state = LoginState::Reading;
                            return self.state;
                        }
                        io::ErrorKind::Interrupted => continue,
                        _ => return self.end(shared),
                    }
                }
            }
            if self.rx.len() < self.need {
                continue;
            }
            let f = login.recv_framing(shared);
            let bhs = match self.bhs.take() {
                Some(b) => b,
                None => {
                    let h: &[u8; BHS_BYTES] = self.rx[..BHS_BYTES].try_into().expect("48 bytes");
                    match pdu_wire_bytes(h, &f) {
                        Ok((b, n)) if n > BHS_BYTES => {
                            self.bhs = Some(b);
                            self.need = n;
                            continue;
                        }
                        Ok((b, _)) => b,
                        Err(_) => return self.end(shared),
                    }
                }
            };
            let data = match pdu_data(&bhs, &self.rx, &f) {
                Ok(d) => d,
                Err(_) => return self.end(shared),
            };
            self.rx.clear();
            self.need = BHS_BYTES;
            self.after = match login.on_pdu(&bhs, &data, shared, &mut self.out) {
                Ok(Step::More) => None,
                Ok(Step::FullFeature) => Some(After::HandOver),
                Ok(Step::Done) | Err(_) => Some(After::Close),
            };
        }
    }

    /// Where the login stands after the last [`LocalLogin::drive`].
    pub fn state(&self) -> LoginState {
        self.state
    }

    /// Closes the socket; a session registered for a connection that never reached the
    /// front-end is forgotten.
    fn end(&mut self, shared: &Shared) -> LoginState {
        if let Some((_, mut login)) = self.conn.take() {
            login.abandon(shared);
        }
        self.state = LoginState::Ended;
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iscsi::login::chap_md5;
    use crate::iscsi::pdu::{self, op, Framing, Header};
    use crate::iscsi::{lun_info, text, ChapConfig};
    use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
    use std::io::Write;

    fn server(chap: Option<ChapConfig>) -> LocalServer {
        let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 64 << 10, 512).unwrap();
        let geo = ArrayGeometry::new(g, 16).unwrap();
        let config = IscsiConfig {
            chap,
            ..IscsiConfig::default()
        };
        let lun = lun_info("t", &geo, [1; 16], &config);
        LocalServer::new(lun, config).unwrap().0
    }

    /// A Login Request with `flags` (T, CSG, NSG) and `keys`, no digests.
    fn login_pdu(flags: u8, keys: &[(&str, &str)]) -> Vec<u8> {
        let mut data = Vec::new();
        for (k, v) in keys {
            text::put(&mut data, k, v);
        }
        let h = Header::new(op::LOGIN_REQ | 0x40, flags, data.len() as u32, 1)
            .bytes(8, &[0x80, 0, 0, 0, 0, 1])
            .u32(24, 1);
        let f = Framing {
            header_digest: false,
            data_digest: false,
            max_recv_data: 8192,
        };
        let mut out = vec![0u8; pdu::pdu_bytes(data.len(), &f)];
        let n = pdu::write_pdu(&mut out, &h, &data, &f);
        out.truncate(n);
        out
    }

    /// Reads one Login Response: its flags, status and text.
    fn response(c: &mut UnixStream) -> (u8, u16, Vec<(String, String)>) {
        let mut h = [0u8; BHS_BYTES];
        c.read_exact(&mut h).unwrap();
        assert_eq!(h[0] & 0x3f, op::LOGIN_RESP);
        let len = (usize::from(h[5]) << 16) | (usize::from(h[6]) << 8) | usize::from(h[7]);
        let mut d = vec![0u8; pdu::pad4(len)];
        c.read_exact(&mut d).unwrap();
        let keys = text::parse(&d[..len]).unwrap();
        (h[1], u16::from_be_bytes([h[36], h[37]]), keys)
    }

    const NORMAL: [(&str, &str); 3] = [
        ("InitiatorName", "iqn.2026-01.org.example:i"),
        ("SessionType", "Normal"),
        ("TargetName", "iqn.2026-11.org.ferroraid:t"),
    ];

    #[test]
    fn a_login_reaches_the_full_feature_phase() {
        let s = server(None);
        let (mut c, theirs) = UnixStream::pair().unwrap();
        let mut l = s.accept(theirs).unwrap();
        let mut keys = NORMAL.to_vec();
        keys.push(("AuthMethod", "None"));
        c.write_all(&login_pdu(0x81, &keys)).unwrap();
        assert_eq!(l.drive(&s), LoginState::Reading);
        let (flags, status, _) = response(&mut c);
        assert_eq!((flags, status), (0x81, 0));
        c.write_all(&login_pdu(0x87, &[("MaxRecvDataSegmentLength", "8192")]))
            .unwrap();
        assert_eq!(l.drive(&s), LoginState::FullFeature);
        let (flags, status, _) = response(&mut c);
        assert_eq!((flags, status), (0x87, 0));
        assert_eq!(s.sessions(), 1);
        assert_eq!(s.shared.inboxes[0].len(), 1);
    }

    /// Regression: a session registered for a connection whose last Login Response could
    /// not be sent (the initiator had gone) stayed registered forever.
    #[test]
    fn a_login_cut_before_its_last_response_leaves_no_session() {
        let s = server(None);
        let (mut c, theirs) = UnixStream::pair().unwrap();
        let mut l = s.accept(theirs).unwrap();
        let mut keys = NORMAL.to_vec();
        keys.push(("AuthMethod", "None"));
        c.write_all(&login_pdu(0x81, &keys)).unwrap();
        assert_eq!(l.drive(&s), LoginState::Reading);
        let _ = response(&mut c);
        c.write_all(&login_pdu(0x87, &[])).unwrap();
        drop(c);
        assert_eq!(l.drive(&s), LoginState::Ended);
        assert_eq!(
            s.sessions(),
            0,
            "the session of a failed login stays registered"
        );
        assert!(s.shared.inboxes[0].is_empty());
    }

    /// CHAP with the local server's fixed challenge (module docs): the first connection's
    /// challenge is bytes 31..47 with identifier 1.
    #[test]
    fn chap_challenges_are_fixed_per_connection() {
        let s = server(Some(ChapConfig {
            user: "u".into(),
            secret: "secret-secret".into(),
            mutual: None,
            require_mutual: false,
        }));
        let (mut c, theirs) = UnixStream::pair().unwrap();
        let mut l = s.accept(theirs).unwrap();
        let mut keys = NORMAL.to_vec();
        keys.push(("AuthMethod", "CHAP"));
        c.write_all(&login_pdu(0x81, &keys)).unwrap();
        l.drive(&s);
        let (flags, status, _) = response(&mut c);
        assert_eq!((flags & 0x80, status), (0, 0));
        c.write_all(&login_pdu(0x81, &[("CHAP_A", "5")])).unwrap();
        l.drive(&s);
        let (_, _, keys) = response(&mut c);
        let get = |k: &str| keys.iter().find(|(n, _)| n == k).unwrap().1.clone();
        let challenge: Vec<u8> = (31..47).collect();
        assert_eq!(get("CHAP_I"), "1");
        assert_eq!(get("CHAP_C"), text::encode_hex(&challenge));
        let r = text::encode_hex(&chap_md5(1, b"secret-secret", &challenge));
        c.write_all(&login_pdu(0x81, &[("CHAP_N", "u"), ("CHAP_R", &r)]))
            .unwrap();
        l.drive(&s);
        let (flags, status, _) = response(&mut c);
        assert_eq!((flags, status), (0x81, 0));
    }
}
