//! Service-manager readiness notification: systemd's `sd_notify` protocol (sd_notify(3)),
//! through the `sd-notify` crate.
//!
//! When the service manager starts a `Type=notify` service it sets `NOTIFY_SOCKET` to the
//! path of an `AF_UNIX` datagram socket (`/run/systemd/notify`). The service sends one
//! datagram per notification of newline-separated `KEY=VALUE` assignments: `READY=1` says
//! start-up finished (systemd then counts the unit active and starts what is ordered after
//! it), `STOPPING=1` that shutdown began, `STATUS=` a one-line state shown by `systemctl
//! status`. Without `NOTIFY_SOCKET` nothing is sent (not run by systemd). The crate
//! connects to the variable's value as a path: Linux abstract-namespace names (`@name`,
//! which systemd's own socket is not) are not reached.
//!
//! `ferroraid serve` sends `READY=1` once the array is assembled and every export (NBD,
//! iSCSI), the management socket and the metrics endpoint listen, and `STOPPING=1` when a
//! stop begins (docs/MANAGEMENT.md, "Running under systemd").
//!
//! Sending is one `send(2)` on a management path (start-up and shutdown), never on a
//! reactor.

use std::io;

pub use sd_notify::NotifyState;

/// Notifications to the service manager named by `NOTIFY_SOCKET`.
#[derive(Debug)]
pub struct Notifier(());

impl Notifier {
    /// The notifier of `NOTIFY_SOCKET`, or `None` when it is unset or empty (the process
    /// was not started by a service manager that asked for notifications).
    pub fn from_env() -> Option<Notifier> {
        std::env::var_os("NOTIFY_SOCKET")
            .filter(|v| !v.is_empty())
            .map(|_| Notifier(()))
    }

    /// Sends `state` as one datagram (`STATUS` values: pass them through
    /// [`status_line`], the receiver splits at newlines).
    ///
    /// # Errors
    /// The socket's error (no one listening: `ECONNREFUSED`/`ENOENT`), or `WriteZero` if
    /// the datagram went out short.
    pub fn notify(&self, state: &[NotifyState]) -> io::Result<()> {
        sd_notify::notify(state)
    }
}

/// `s` made one line for a `STATUS=` value: line breaks become spaces.
pub fn status_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    // Sending is tested with the real binary (tests/tests/target.rs,
    // `serve_tells_systemd_it_is_ready_only_once_the_export_answers`): setting
    // NOTIFY_SOCKET here would race the other tests of this process reading the
    // environment.
    #[test]
    fn a_status_is_one_line() {
        assert_eq!(status_line("a\nb\r\nc"), "a b  c");
    }
}
