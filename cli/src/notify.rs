//! Service-manager readiness notification: systemd's `sd_notify` protocol, spoken without
//! libsystemd.
//!
//! The protocol (sd_notify(3), "Notes"; systemd's `src/libsystemd/sd-daemon/sd-daemon.c`):
//! when the service manager starts a `Type=notify` service it sets `NOTIFY_SOCKET` to the
//! address of an `AF_UNIX` datagram socket — a filesystem path (`/run/systemd/notify`) or,
//! with a leading `@`, a Linux abstract-namespace name. The service sends one datagram per
//! notification: newline-separated `KEY=VALUE` assignments, e.g. `READY=1\nSTATUS=...`.
//! `READY=1` says start-up finished (systemd then counts the unit active and starts what
//! is ordered after it), `STOPPING=1` that shutdown began, `STATUS=` a one-line state shown
//! by `systemctl status`. Without `NOTIFY_SOCKET` nothing is sent (not run by systemd).
//!
//! `ferroraid serve` sends `READY=1` once the array is assembled and every export (NBD,
//! iSCSI), the management socket and the metrics endpoint listen, and `STOPPING=1` when a
//! stop begins (docs/MANAGEMENT.md, "Running under systemd").
//!
//! Sending is a single non-blocking `sendto(2)` on a management path (start-up and
//! shutdown), never on a reactor.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;

/// Where notifications go: the socket named by `NOTIFY_SOCKET`.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    target: Target,
}

#[derive(Debug)]
enum Target {
    /// A socket file.
    Path(PathBuf),
    /// A Linux abstract-namespace address (`@name` in `NOTIFY_SOCKET`; the name without
    /// the `@`).
    Abstract(Vec<u8>),
}

impl Notifier {
    /// The notifier of `NOTIFY_SOCKET`, or `None` when it is unset or empty (the process
    /// was not started by a service manager that asked for notifications).
    ///
    /// # Errors
    /// As [`Notifier::new`].
    pub fn from_env() -> io::Result<Option<Notifier>> {
        match std::env::var_os("NOTIFY_SOCKET") {
            Some(v) if !v.is_empty() => Notifier::new(&v).map(Some),
            _ => Ok(None),
        }
    }

    /// A notifier sending to `address`: an absolute or relative socket path, or `@name`
    /// for an abstract-namespace socket (sd_notify(3)).
    ///
    /// # Errors
    /// `InvalidInput` for an address systemd would not give (a `vsock:` address, which
    /// only VMs use, or a name longer than `sun_path`'s 108 bytes); the error of
    /// `socket(2)` otherwise.
    pub fn new(address: &OsStr) -> io::Result<Notifier> {
        let bytes = address.as_bytes();
        // sockaddr_un.sun_path holds 108 bytes, the terminating NUL of a path included.
        const SUN_PATH: usize = 108;
        let target = if let Some(name) = bytes.strip_prefix(b"@") {
            if name.len() > SUN_PATH - 1 {
                return Err(invalid(address, "longer than an AF_UNIX address"));
            }
            Target::Abstract(name.to_vec())
        } else if bytes.starts_with(b"vsock:") {
            return Err(invalid(
                address,
                "an AF_VSOCK address (only supported over AF_UNIX)",
            ));
        } else {
            if bytes.len() > SUN_PATH - 1 {
                return Err(invalid(address, "longer than an AF_UNIX address"));
            }
            Target::Path(PathBuf::from(address))
        };
        let socket = UnixDatagram::unbound()?;
        socket.set_nonblocking(true)?;
        Ok(Notifier { socket, target })
    }

    /// Sends `state`: newline-separated `KEY=VALUE` lines (`READY=1`, `STOPPING=1`,
    /// `STATUS=...`), as one datagram. A value must be one line (the receiver splits at
    /// newlines): pass `STATUS` values through [`status_line`].
    ///
    /// # Errors
    /// The error of `sendto(2)` (no one listening: `ECONNREFUSED`/`ENOENT`; a full queue:
    /// `EAGAIN`); `WriteZero` if the datagram went out short.
    pub fn notify(&self, state: &str) -> io::Result<()> {
        let sent = match &self.target {
            Target::Path(p) => self.socket.send_to(state.as_bytes(), p)?,
            Target::Abstract(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                self.socket.send_to_addr(state.as_bytes(), &addr)?
            }
        };
        if sent != state.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!(
                    "notification truncated: {sent} of {} bytes sent",
                    state.len()
                ),
            ));
        }
        Ok(())
    }
}

/// `s` made one line for a `STATUS=` value: line breaks become spaces.
pub fn status_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

fn invalid(address: &OsStr, why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("NOTIFY_SOCKET={}: {why}", address.to_string_lossy()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A datagram sent to a socket file arrives whole, as the service manager reads it.
    #[test]
    fn sends_one_datagram_to_a_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let rx = UnixDatagram::bind(&path).unwrap();
        let n = Notifier::new(path.as_os_str()).unwrap();
        n.notify("READY=1\nSTATUS=serving").unwrap();
        let mut buf = [0u8; 256];
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"READY=1\nSTATUS=serving");
    }

    /// `@name` is the abstract namespace (systemd's own notify socket is a path, but
    /// `systemd-run` and containers use abstract names).
    #[test]
    fn sends_to_an_abstract_address() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("ferroraid-notify-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let rx = UnixDatagram::bind_addr(&addr).unwrap();
        let n = Notifier::new(OsStr::new(&format!("@{name}"))).unwrap();
        n.notify("STOPPING=1").unwrap();
        let mut buf = [0u8; 64];
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"STOPPING=1");
    }

    #[test]
    fn refuses_what_it_cannot_address() {
        for bad in ["vsock:2:1234".to_string(), format!("/{}", "x".repeat(120))] {
            let e = Notifier::new(OsStr::new(&bad)).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad}: {e}");
        }
        // Nobody listening: an error, not a panic or a hang.
        let dir = tempfile::tempdir().unwrap();
        let n = Notifier::new(dir.path().join("none").as_os_str()).unwrap();
        assert!(n.notify("READY=1").is_err());
        assert_eq!(status_line("a\nb\r\nc"), "a b  c");
    }
}
