//! NBD over TLS (issue 18; proto.md "TLS support"), end to end: `ferroraid serve --tls ...`
//! started as a process on member files, with certificates the test makes (rcgen: a CA, a
//! server certificate for localhost/127.0.0.1, a client certificate, and a second,
//! unrelated CA with a client certificate of its own), and the real clients:
//! - `--tls require --tls-ca`: `nbdinfo nbds://…?tls-certificates=DIR`, `nbdcopy` of a
//!   random pattern in and back out (bit-identical), `qemu-io --object tls-creds-x509`
//!   writing patterns and reading them back verified; the log names the TLS version and
//!   the client certificate's subject;
//! - the same server refuses: a plaintext client (`nbdinfo nbd://` fails and prints no
//!   export; on a raw socket every option but STARTTLS/ABORT gets `NBD_REP_ERR_TLS_REQD`
//!   and `NBD_OPT_EXPORT_NAME` is closed without a byte of export data), a client trusting
//!   another CA (nbdinfo and qemu-io), a client without a certificate, and a client whose
//!   certificate another CA signed;
//! - `--tls allow`: plaintext and TLS clients both served.
//!
//! libnbd and qemu read the files `ca-cert.pem`, `client-cert.pem` and `client-key.pem`
//! of the directory they are given (`nbd_set_tls_certificates(3)`, qemu's
//! `tls-creds-x509`). A client tool that is not installed skips its part with `SKIPPED:`
//! unless `FERRORAID_REQUIRE_TOOLS=1`.

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferroraid_tests::{ferroraid_bin, first_difference, run_tool, show_output, tool, Rng};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

const MIB: u64 = 1 << 20;
/// Any one client command.
const TOOL_TIMEOUT: Duration = Duration::from_secs(120);
/// From spawning `ferroraid serve` to its NBD port greeting.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// The export: RAID5 over three 9 MiB member files (1 MiB data offset): 16 MiB.
const EXPORT_BYTES: u64 = 16 * MIB;

// ---------------------------------------------------------------------------------------
// Certificates.
// ---------------------------------------------------------------------------------------

/// A CA: its certificate (PEM) and what signs with it.
struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn ca(name: &str) -> Ca {
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
    ];
    let key = KeyPair::generate().expect("CA key");
    let cert = p.self_signed(&key).expect("self-signing the CA");
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(p, key),
    }
}

/// A certificate signed by `ca` for `names` (subject alternative names; IP addresses
/// become IP entries), for a server or a client: (certificate PEM, key PEM).
fn leaf(ca: &Ca, cn: &str, names: &[&str], server: bool) -> (String, String) {
    let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .expect("leaf parameters");
    p.distinguished_name.push(DnType::CommonName, cn);
    p.distinguished_name
        .push(DnType::OrganizationName, "ferroraid tests");
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![if server {
        ExtendedKeyUsagePurpose::ServerAuth
    } else {
        ExtendedKeyUsagePurpose::ClientAuth
    }];
    p.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate().expect("leaf key");
    let cert = p.signed_by(&key, &ca.issuer).expect("signing the leaf");
    (cert.pem(), key.serialize_pem())
}

/// The files of one test: the server's credentials and the client directories.
struct Pki {
    /// Server certificate and key, the CA that signs client certificates.
    server_cert: PathBuf,
    server_key: PathBuf,
    client_ca: PathBuf,
    /// Trusts the right CA, has a client certificate of it.
    good: PathBuf,
    /// Trusts an unrelated CA (and has a client certificate of the right one).
    wrong_ca: PathBuf,
    /// Trusts the right CA, has no client certificate.
    no_cert: PathBuf,
    /// Trusts the right CA, has a client certificate signed by the unrelated CA.
    foreign_cert: PathBuf,
}

fn write_dir(dir: &Path, files: &[(&str, &str)]) -> PathBuf {
    fs::create_dir_all(dir).expect("creating a certificate directory");
    for (name, text) in files {
        fs::write(dir.join(name), text).expect("writing a PEM file");
    }
    dir.to_path_buf()
}

fn pki(dir: &Path) -> Pki {
    let ca1 = ca("ferroraid test CA");
    let ca2 = ca("unrelated CA");
    let (srv_cert, srv_key) = leaf(&ca1, "localhost", &["localhost", "127.0.0.1"], true);
    let (cli_cert, cli_key) = leaf(&ca1, "ferroraid test client", &[], false);
    let (foreign_cert, foreign_key) = leaf(&ca2, "intruder", &[], false);
    let server = write_dir(
        &dir.join("server"),
        &[
            ("cert.pem", &srv_cert),
            ("key.pem", &srv_key),
            ("ca.pem", &ca1.pem),
        ],
    );
    let client = |name: &str, ca: &str, cert: Option<(&str, &str)>| {
        let mut files = vec![("ca-cert.pem", ca)];
        if let Some((c, k)) = cert {
            files.push(("client-cert.pem", c));
            files.push(("client-key.pem", k));
        }
        write_dir(&dir.join(name), &files)
    };
    Pki {
        server_cert: server.join("cert.pem"),
        server_key: server.join("key.pem"),
        client_ca: server.join("ca.pem"),
        good: client("good", &ca1.pem, Some((&cli_cert, &cli_key))),
        wrong_ca: client("wrong-ca", &ca2.pem, Some((&cli_cert, &cli_key))),
        no_cert: client("no-cert", &ca1.pem, None),
        foreign_cert: client("foreign", &ca1.pem, Some((&foreign_cert, &foreign_key))),
    }
}

// ---------------------------------------------------------------------------------------
// The target.
// ---------------------------------------------------------------------------------------

/// A `ferroraid serve` process, killed when dropped (and with the test process, by
/// `PR_SET_PDEATHSIG`); its log is printed when the test fails.
struct Serve {
    child: Child,
    log: PathBuf,
    port: u16,
}

impl Serve {
    /// Creates a RAID5 named `tls` on three member files in `dir` and serves it on a free
    /// 127.0.0.1 port with `extra` options; returns once the port greets.
    fn start(dir: &Path, extra: &[&std::ffi::OsStr]) -> Serve {
        let members: Vec<PathBuf> = (0..3)
            .map(|i| {
                let p = dir.join(format!("m{i}.img"));
                fs::File::create(&p)
                    .and_then(|f| f.set_len(9 * MIB))
                    .expect("creating a member file");
                p
            })
            .collect();
        let out = run_tool(
            Command::new(ferroraid_bin())
                .args(["create", "--level", "5", "--name", "tls"])
                .args(&members),
            dir,
            TOOL_TIMEOUT,
        );
        assert!(out.status.success(), "create: {}", show_output(&out));
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let log = dir.join("serve.log");
        let mut cmd = Command::new(ferroraid_bin());
        cmd.args(["serve", "--adaptive", "--nbd", &format!("127.0.0.1:{port}")])
            .args(extra)
            .args(&members)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).expect("creating the log file"));
        // SAFETY: prctl is async-signal-safe and touches nothing else: the server dies
        // with the test process.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut s = Serve {
            child: cmd.spawn().expect("starting ferroraid serve"),
            log,
            port,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(st) = s.child.try_wait().expect("waiting for serve") {
                panic!("ferroraid serve exited with {st}:\n{}", s.log());
            }
            if let Ok(mut c) = TcpStream::connect(("127.0.0.1", port)) {
                let mut g = [0u8; 18];
                if c.read_exact(&mut g).is_ok() && &g[..16] == b"NBDMAGICIHAVEOPT" {
                    // NBD_OPT_ABORT is allowed before TLS in every mode.
                    let _ = c.write_all(&[&3u32.to_be_bytes()[..], &option(2, &[])].concat());
                    return s;
                }
            }
            assert!(
                Instant::now() < deadline,
                "serve never greeted:\n{}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The URI of the export; `nbds://` with the certificate directory `certs`.
    fn uri(&self, certs: Option<&Path>) -> String {
        match certs {
            None => format!("nbd://127.0.0.1:{}/tls", self.port),
            Some(d) => format!(
                "nbds://127.0.0.1:{}/tls?tls-certificates={}",
                self.port,
                d.display()
            ),
        }
    }

    /// Runs a client that must succeed; returns its stdout.
    fn ok(&self, cmd: &mut Command, dir: &Path) -> String {
        let shown = format!("{cmd:?}");
        let out = run_tool(cmd, dir, TOOL_TIMEOUT);
        assert!(
            out.status.success(),
            "{shown} failed: {}\n--- serve ---\n{}",
            show_output(&out),
            self.log()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs a client that must fail; returns its output.
    fn refused(&self, what: &str, cmd: &mut Command, dir: &Path) -> Output {
        let shown = format!("{cmd:?}");
        let out = run_tool(cmd, dir, TOOL_TIMEOUT);
        assert!(
            !out.status.success(),
            "{what}: {shown} should have failed: {}\n--- serve ---\n{}",
            show_output(&out),
            self.log()
        );
        out
    }

    /// Waits (briefly) until the log contains `needle`.
    fn log_shows(&self, needle: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.log().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- ferroraid serve log ---\n{}", self.log());
        }
    }
}

fn tls_args(pki: &Pki, mode: &str, client_ca: bool) -> Vec<std::ffi::OsString> {
    let mut a: Vec<std::ffi::OsString> = vec![
        "--tls".into(),
        mode.into(),
        "--tls-cert".into(),
        pki.server_cert.clone().into(),
        "--tls-key".into(),
        pki.server_key.clone().into(),
    ];
    if client_ca {
        a.push("--tls-ca".into());
        a.push(pki.client_ca.clone().into());
    }
    a
}

fn refs(a: &[std::ffi::OsString]) -> Vec<&std::ffi::OsStr> {
    a.iter().map(|s| s.as_os_str()).collect()
}

/// `qemu-io` on the export over TLS with the credentials of `certs`, running `cmds`.
fn qemu_io(port: u16, certs: &Path, cmds: &[String]) -> Command {
    let mut c = Command::new("qemu-io");
    c.arg("--object").arg(format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        certs.display()
    ));
    c.arg("--image-opts").arg(format!(
        "driver=nbd,host=127.0.0.1,port={port},export=tls,tls-creds=tls0"
    ));
    for k in cmds {
        c.arg("-c").arg(k);
    }
    c
}

// ---------------------------------------------------------------------------------------
// Raw NBD, for what a plaintext client can get out of a `require` server.
// ---------------------------------------------------------------------------------------

/// An option request: `IHAVEOPT`, option, length, data.
fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut m = b"IHAVEOPT".to_vec();
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    m
}

/// A plaintext connection past the greeting (client flags FIXED_NEWSTYLE | NO_ZEROES).
fn plaintext(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connecting");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).expect("greeting");
    assert_eq!(&g[..16], b"NBDMAGICIHAVEOPT");
    s.write_all(&3u32.to_be_bytes()).unwrap();
    s
}

/// Sends option `opt` and reads one reply: (reply type, data).
fn ask(s: &mut TcpStream, opt: u32, data: &[u8]) -> (u32, Vec<u8>) {
    s.write_all(&option(opt, data)).unwrap();
    let mut h = [0u8; 20];
    s.read_exact(&mut h).expect("option reply header");
    assert_eq!(&h[..8], &0x3e889045565a9u64.to_be_bytes(), "reply magic");
    assert_eq!(u32::from_be_bytes(h[8..12].try_into().unwrap()), opt);
    let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
    let mut d = vec![0u8; len as usize];
    s.read_exact(&mut d).expect("option reply data");
    (ty, d)
}

const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_STARTTLS: u32 = 5;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const REP_ACK: u32 = 1;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;

/// `NBD_OPT_GO`/`INFO` data for export `tls` with no information requests.
fn go_data() -> Vec<u8> {
    let mut d = 3u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"tls");
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

// ---------------------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------------------

/// `--tls require --tls-ca`: nbdinfo, nbdcopy in and out, and qemu-io work over TLS with a
/// client certificate of the CA, and the log says what the handshake agreed.
#[test]
fn tls_require_serves_nbdinfo_nbdcopy_and_qemu_io() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let pki = pki(dir);
    let srv = Serve::start(dir, &refs(&tls_args(&pki, "require", true)));
    let uri = srv.uri(Some(&pki.good));
    if tool("nbdinfo").is_some() {
        let out = srv.ok(Command::new("nbdinfo").arg(&uri), dir);
        assert!(
            out.contains("with TLS"),
            "nbdinfo does not report TLS:\n{out}"
        );
        assert!(
            out.contains(&format!("export-size: {EXPORT_BYTES}")),
            "nbdinfo:\n{out}"
        );
        assert!(
            srv.log_shows("client=CN=ferroraid test client"),
            "no TLS line naming the client certificate:\n{}",
            srv.log()
        );
        assert!(srv.log().contains("TLS established"), "{}", srv.log());
    }
    if tool("nbdcopy").is_some() {
        let mut pattern = vec![0u8; EXPORT_BYTES as usize];
        Rng::new(18).fill(&mut pattern);
        let src = dir.join("pattern.bin");
        fs::write(&src, &pattern).unwrap();
        srv.ok(Command::new("nbdcopy").arg(&src).arg(&uri), dir);
        let back = dir.join("back.bin");
        srv.ok(Command::new("nbdcopy").arg(&uri).arg(&back), dir);
        let got = fs::read(&back).unwrap();
        if let Some(d) = first_difference(&got, &pattern) {
            panic!("nbdcopy over TLS: the copy back differs: {d}");
        }
    }
    if tool("qemu-io").is_some() {
        // Patterns at unaligned-to-the-stripe places, then each read back verified (qemu-io
        // prints "Pattern verification failed" and exits 0 on a mismatch: look for it).
        let spots = [
            (0u64, 4096u64, 0x11u8),
            (3 * MIB + 512, MIB, 0x5a),
            (EXPORT_BYTES - 65536, 65536, 0xc3),
        ];
        let mut cmds: Vec<String> = spots
            .iter()
            .map(|(o, l, p)| format!("write -P {p:#x} {o} {l}"))
            .collect();
        cmds.extend(
            spots
                .iter()
                .map(|(o, l, p)| format!("read -P {p:#x} {o} {l}")),
        );
        let out = srv.ok(&mut qemu_io(srv.port, &pki.good, &cmds), dir);
        assert!(!out.contains("verification failed"), "qemu-io:\n{out}");
        assert_eq!(
            out.matches("read ").count(),
            spots.len(),
            "qemu-io did not read every pattern back:\n{out}"
        );
    }
}

/// The `require` server gives nothing to a plaintext client, and refuses a client that
/// trusts another CA, one without a certificate, and one whose certificate another CA
/// signed.
#[test]
fn tls_require_refuses_plaintext_wrong_ca_and_foreign_or_missing_client_certs() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let pki = pki(dir);
    let srv = Serve::start(dir, &refs(&tls_args(&pki, "require", true)));
    // On a raw socket: every option but STARTTLS and ABORT is refused with TLS_REQD, and
    // nothing about the export is said.
    let mut s = plaintext(srv.port);
    for opt in [OPT_LIST, OPT_INFO, OPT_GO, OPT_STRUCTURED_REPLY, 42] {
        let data = if matches!(opt, OPT_INFO | OPT_GO) {
            go_data()
        } else {
            Vec::new()
        };
        let (ty, msg) = ask(&mut s, opt, &data);
        assert_eq!(ty, REP_ERR_TLS_REQD, "option {opt} before TLS");
        assert!(
            !String::from_utf8_lossy(&msg).contains("tls"),
            "the reply names the export"
        );
    }
    // STARTTLS with data is malformed.
    assert_eq!(ask(&mut s, OPT_STARTTLS, b"x").0, REP_ERR_INVALID);
    // NBD_OPT_EXPORT_NAME cannot be refused: the connection closes, no byte of data.
    s.write_all(&option(OPT_EXPORT_NAME, b"tls")).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(
        rest.is_empty(),
        "a plaintext NBD_OPT_EXPORT_NAME got {} bytes",
        rest.len()
    );
    // ABORT is acknowledged in the clear.
    let mut s = plaintext(srv.port);
    assert_eq!(ask(&mut s, OPT_ABORT, &[]).0, REP_ACK);
    if tool("nbdinfo").is_some() {
        let out = srv.refused(
            "plaintext nbdinfo",
            Command::new("nbdinfo").arg(srv.uri(None)),
            dir,
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !text.contains("export-size"),
            "plaintext nbdinfo saw the export:\n{text}"
        );
        for (what, certs) in [
            ("a client trusting another CA", &pki.wrong_ca),
            ("a client without a certificate", &pki.no_cert),
            ("a client certificate of another CA", &pki.foreign_cert),
        ] {
            srv.refused(what, Command::new("nbdinfo").arg(srv.uri(Some(certs))), dir);
        }
        // The server saw the foreign certificate and said why it refused it.
        assert!(
            srv.log_shows("handshake failed: TLS"),
            "no TLS refusal in the log:\n{}",
            srv.log()
        );
        assert!(!srv.log().contains("transmission phase"), "{}", srv.log());
    }
    if tool("qemu-io").is_some() {
        srv.refused(
            "qemu-io trusting another CA",
            &mut qemu_io(srv.port, &pki.wrong_ca, &["read 0 4096".into()]),
            dir,
        );
    }
}

/// `--tls allow` without client certificates: a plaintext client and a TLS client (with
/// only the CA) are both served.
#[test]
fn tls_allow_serves_plaintext_and_tls_clients() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let pki = pki(dir);
    let srv = Serve::start(dir, &refs(&tls_args(&pki, "allow", false)));
    // STARTTLS is acknowledged; the raw client then leaves (the server's TLS handshake
    // sees the connection close and ends it).
    let mut s = plaintext(srv.port);
    assert_eq!(ask(&mut s, OPT_STARTTLS, &[]).0, REP_ACK);
    drop(s);
    if tool("nbdinfo").is_none() {
        return;
    }
    let out = srv.ok(Command::new("nbdinfo").arg(srv.uri(None)), dir);
    assert!(out.contains("without TLS"), "plaintext nbdinfo:\n{out}");
    let out = srv.ok(
        Command::new("nbdinfo").arg(srv.uri(Some(&pki.no_cert))),
        dir,
    );
    assert!(out.contains("with TLS"), "nbdinfo over TLS:\n{out}");
    assert!(srv.log_shows("client=none"), "{}", srv.log());
}
