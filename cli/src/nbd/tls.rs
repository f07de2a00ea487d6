//! TLS for the NBD server (proto.md "TLS support"), with rustls and its `ring` provider.
//!
//! # Modes (proto.md "Server-side requirements")
//! - [`TlsMode::Off`] — NOTLS: `NBD_OPT_STARTTLS` is answered `NBD_REP_ERR_POLICY` ("if it
//!   does not support TLS for policy reasons").
//! - [`TlsMode::Require`] — FORCEDTLS, as `nbdkit --tls=require` and `qemu-nbd
//!   --tls-creds` do: before TLS every option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT`
//!   is answered `NBD_REP_ERR_TLS_REQD`, and `NBD_OPT_EXPORT_NAME` (which cannot carry an
//!   error) closes the connection, so a plaintext client never gets export data nor even
//!   the export's size or name.
//! - [`TlsMode::Allow`] — SELECTIVETLS with no TLS-only export: a client may upgrade with
//!   `NBD_OPT_STARTTLS` or stay in plaintext.
//!
//! `NBD_OPT_STARTTLS` with data, or once TLS is on, gets `NBD_REP_ERR_INVALID`. After
//! its `NBD_REP_ACK` the TLS handshake runs on the same socket (inside the handshake
//! thread's state machine, non-blocking); a failed handshake closes the connection ("it
//! is too late to continue without TLS"). Negotiation state from before STARTTLS
//! (structured replies, a slot reserved by `NBD_OPT_INFO`) is dropped, as proto.md's
//! `NBD_OPT_STARTTLS` requires ("the server MUST NOT preserve any negotiation state").
//! Bytes the client sends after the STARTTLS option stay in the socket and go to the TLS
//! layer (the handshake reads only the bytes of each message), so plaintext injected
//! there cannot pass for encrypted options.
//!
//! # Certificates
//! An X.509 server certificate chain and its private key (PEM files); with a CA file,
//! clients must present a certificate signed by one of its CAs (mutual TLS, checked by
//! rustls' webpki verifier), else the handshake fails. TLS 1.2 and 1.3 are offered
//! (proto.md "TLS versions": 1.2 MUST be supported), rustls' safe default cipher suites.
//!
//! # Cost in the transmission phase
//! Plaintext connections keep their zero-copy path (payloads received straight into the
//! pool's buffers, replies gathered with `sendmsg`). A TLS connection's bytes go through
//! rustls' buffered `ServerConnection`: ciphertext is read with `read_tls` (rustls reads at
//! most 4 KiB per call, so one `recv` per 4 KiB), decrypted, and the plaintext copied once
//! into the receive or pool buffer; replies are copied once into rustls, encrypted and
//! sent from its buffer (bounded by [`TLS_BUFFER_BYTES`]). rustls' buffered API allocates
//! one buffer per TLS record it receives and one per record it sends (a record carries at
//! most 16 KiB), so a TLS connection allocates about two buffers per 16 KiB moved — the
//! allocator's thread cache serves them, but the "no allocation on the data path" rule
//! holds only for plaintext connections (rustls 0.23 has no allocation-free send path,
//! not even in its unbuffered API).

use std::fmt;
use std::hash::{Hash, Hasher};
use std::io::{self, IoSlice, Read, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConnection};
use thiserror::Error;

use super::conn::Stream;

/// Most bytes rustls holds per connection in each direction: plaintext waiting to be
/// encrypted plus ciphertext waiting for the socket (rustls' own default, 64 KiB: four
/// full records, enough to keep a socket's send buffer busy). A reply longer than this is
/// handed to rustls in pieces as the socket drains.
pub const TLS_BUFFER_BYTES: usize = 64 << 10;

/// When the server uses TLS (proto.md "Server-side requirements").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// NOTLS: `NBD_OPT_STARTTLS` is refused with `NBD_REP_ERR_POLICY`.
    #[default]
    Off,
    /// TLS on the client's request; plaintext clients are served too.
    Allow,
    /// FORCEDTLS: nothing but `NBD_OPT_STARTTLS`/`NBD_OPT_ABORT` before TLS.
    Require,
}

impl FromStr for TlsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(TlsMode::Off),
            "allow" => Ok(TlsMode::Allow),
            "require" => Ok(TlsMode::Require),
            _ => Err(format!("{s:?}: expected \"off\", \"allow\" or \"require\"")),
        }
    }
}

impl fmt::Display for TlsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TlsMode::Off => "off",
            TlsMode::Allow => "allow",
            TlsMode::Require => "require",
        })
    }
}

/// Why the TLS credentials could not be loaded.
#[derive(Debug, Error)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("{path}: {why}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// rustls refused the certificate, key or CA.
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
    /// The client-certificate verifier could not be built from the CA file.
    #[error("client CA: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// The server's TLS setup: the mode and the loaded credentials. Cheap to clone (the rustls
/// configuration is shared).
#[derive(Clone)]
pub struct TlsConfig {
    /// When TLS is used.
    pub mode: TlsMode,
    /// The rustls server configuration every TLS connection starts from.
    pub(crate) rustls: Arc<rustls::ServerConfig>,
    /// Whether clients must present a certificate signed by the configured CA.
    pub client_auth: bool,
    /// A hash of the loaded credentials (chain, key, CAs): what tells a reload that
    /// rewrote the files in place from one that read the same ones
    /// ([`TlsConfig::credentials_id`]). Kept out of `Debug`: it is derived from the key.
    credentials: u64,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("mode", &self.mode)
            .field("client_auth", &self.client_auth)
            .finish_non_exhaustive()
    }
}

fn pem_err(path: &Path, why: impl fmt::Display) -> TlsError {
    TlsError::Pem {
        path: path.to_path_buf(),
        why: why.to_string(),
    }
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_err(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(path, e))?;
    if certs.is_empty() {
        return Err(pem_err(path, "no CERTIFICATE in the file"));
    }
    Ok(certs)
}

impl TlsConfig {
    /// Loads the server certificate chain (`cert`, PEM, the server's own certificate
    /// first), its private key (`key`, PEM: PKCS#8, PKCS#1 or SEC1) and, when given, the
    /// CAs (`client_ca`, PEM) that must have signed every client's certificate.
    ///
    /// # Errors
    /// [`TlsError`] naming the file that cannot be read or parsed, or what rustls refused
    /// (a key that does not match the certificate, an unusable CA).
    pub fn from_pem_files(
        mode: TlsMode,
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<Self, TlsError> {
        let chain = load_certs(cert)?;
        let key = PrivateKeyDer::from_pem_file(key).map_err(|e| pem_err(key, e))?;
        let client_ca = match client_ca {
            Some(ca) => Some(load_certs(ca)?),
            None => None,
        };
        Self::from_der(mode, chain, key, client_ca)
    }

    /// As [`TlsConfig::from_pem_files`], from credentials already in memory (DER): the
    /// server certificate chain (its own certificate first), its private key and, when
    /// given, the CAs that must have signed every client's certificate. For embedders and
    /// tests that make their certificates themselves (the `nbd_conn` fuzz target).
    ///
    /// # Errors
    /// [`TlsError`]: what rustls refused (a key that does not match the certificate, an
    /// unusable CA).
    pub fn from_der(
        mode: TlsMode,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        client_ca: Option<Vec<CertificateDer<'static>>>,
    ) -> Result<Self, TlsError> {
        let credentials = {
            // Change detection only (the operator's own files, never shown): std's SipHash
            // is enough.
            let mut h = std::collections::hash_map::DefaultHasher::new();
            for c in &chain {
                c.as_ref().hash(&mut h);
            }
            key.secret_der().hash(&mut h);
            for c in client_ca.iter().flatten() {
                c.as_ref().hash(&mut h);
            }
            h.finish()
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()?;
        let client_auth = client_ca.is_some();
        let builder = match client_ca {
            Some(cas) => {
                let mut roots = RootCertStore::empty();
                for c in cas {
                    roots.add(c)?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let config = builder.with_single_cert(chain, key)?;
        Ok(Self {
            mode,
            rustls: Arc::new(config),
            client_auth,
            credentials,
        })
    }

    /// A 64-bit hash of the certificate chain, private key and client CAs (their DER
    /// bytes), equal for two configurations loaded from the same credentials: how a
    /// reload tells a certificate renewed in place (other bytes from the same paths) from
    /// the same files read again. Not for display: it is derived from the private key.
    pub(crate) fn credentials_id(&self) -> u64 {
        self.credentials
    }

    /// A new server-side TLS session.
    pub(crate) fn session(&self) -> Result<Box<ServerConnection>, rustls::Error> {
        let mut s = ServerConnection::new(Arc::clone(&self.rustls))?;
        s.set_buffer_limit(Some(TLS_BUFFER_BYTES));
        Ok(Box::new(s))
    }
}

/// What a finished TLS handshake agreed, for the log: version, cipher suite and the
/// client certificate's subject (or "none").
pub(crate) fn describe(t: &ServerConnection) -> (String, String, String) {
    let version = t
        .protocol_version()
        .map_or_else(|| "?".into(), |v| format!("{v:?}"));
    let suite = t
        .negotiated_cipher_suite()
        .map_or_else(|| "?".into(), |s| format!("{:?}", s.suite()));
    let subject = match t.peer_certificates().and_then(|c| c.first()) {
        None => "none".into(),
        Some(der) => match x509_parser::parse_x509_certificate(der) {
            Ok((_, cert)) => cert.subject().to_string(),
            Err(e) => format!("(unparsable certificate: {e})"),
        },
    };
    (version, suite, subject)
}

/// `io::Write` over a socket with `send(MSG_NOSIGNAL | MSG_DONTWAIT)`, for `write_tls`: a
/// vanished peer yields `EPIPE`, never `SIGPIPE`.
struct SendTo<'a>(&'a Stream);

impl Write for SendTo<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.send_vectored(&[IoSlice::new(buf)])
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.0.send_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Sends what rustls holds for the socket. `Ok(())`: all of it went; `WouldBlock`: the
/// socket is full and some is still held.
pub(crate) fn flush(t: &mut ServerConnection, s: &Stream) -> io::Result<()> {
    while t.wants_write() {
        match t.write_tls(&mut SendTo(s)) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "peer took no bytes",
                ))
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads ciphertext from the socket into rustls once and processes it. `Ok(0)`: end of
/// stream. A TLS error is returned as `InvalidData` after rustls' alert was tried.
pub(crate) fn pull(t: &mut ServerConnection, s: &mut Stream) -> io::Result<usize> {
    let n = loop {
        match t.read_tls(s) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => break r?,
        }
    };
    if let Err(e) = t.process_new_packets() {
        // The alert rustls queued for the peer, best effort.
        let _ = flush(t, s);
        return Err(io::Error::new(io::ErrorKind::InvalidData, e));
    }
    Ok(n)
}

/// Reads decrypted bytes into `buf` (non-blocking). `Ok(0)`: the client ended the stream
/// (close_notify, or the socket closed without one); `WouldBlock`: nothing there yet.
/// Replies rustls owes the peer (a TLS 1.3 key update) are sent on the way.
pub(crate) fn read(t: &mut ServerConnection, s: &mut Stream, buf: &mut [u8]) -> io::Result<usize> {
    let mut eof = false;
    loop {
        match t.reader().read(buf) {
            Ok(n) => return Ok(n),
            // The socket closed without close_notify: at a message boundary that is a
            // plain end of stream (the caller judges a partial message).
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if eof {
                    return Ok(0);
                }
            }
            Err(e) => return Err(e),
        }
        eof = pull(t, s)? == 0;
        match flush(t, s) {
            Err(e) if e.kind() != io::ErrorKind::WouldBlock => return Err(e),
            _ => {}
        }
    }
}

/// Hands plaintext to rustls (at most what its buffer takes) and sends what it can.
/// Returns the plaintext bytes taken; `WouldBlock` when none could be (the socket is full).
pub(crate) fn send(
    t: &mut ServerConnection,
    s: &Stream,
    bufs: &[IoSlice<'_>],
) -> io::Result<usize> {
    flush(t, s)?;
    let n = t.writer().write_vectored(bufs)?;
    match flush(t, s) {
        Err(e) if e.kind() != io::ErrorKind::WouldBlock => return Err(e),
        _ => {}
    }
    if n == 0 && bufs.iter().any(|b| !b.is_empty()) {
        return Err(io::ErrorKind::WouldBlock.into());
    }
    Ok(n)
}

/// Ends the TLS session politely (proto.md "Terminating the transmission phase": the
/// server "MUST close down the TLS session"): queues close_notify and sends what the
/// socket takes now, without waiting.
pub(crate) fn close(t: &mut ServerConnection, s: &Stream) {
    t.send_close_notify();
    let _ = flush(t, s);
}

/// Certificates for unit tests, made with rcgen: a CA and a server certificate of it for
/// `localhost` and 127.0.0.1, as PEM files.
#[cfg(test)]
pub(crate) mod test_pki {
    use std::path::{Path, PathBuf};

    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};

    /// The PEM files written and the CA certificate (DER) for a client's trust store.
    pub(crate) struct Pki {
        pub(crate) cert: PathBuf,
        pub(crate) key: PathBuf,
        pub(crate) ca: PathBuf,
        pub(crate) ca_der: rustls::pki_types::CertificateDer<'static>,
    }

    /// Writes `cert.pem`, `key.pem` and `ca.pem` into `dir`.
    pub(crate) fn make(dir: &Path) -> Pki {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_key = KeyPair::generate().unwrap();
        let ca = p.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(p, ca_key);
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".into()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let out = Pki {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
            ca: dir.join("ca.pem"),
            ca_der: ca.der().clone(),
        };
        std::fs::write(&out.cert, cert.pem()).unwrap();
        std::fs::write(&out.key, key.serialize_pem()).unwrap();
        std::fs::write(&out.ca, ca.pem()).unwrap();
        out
    }
}
