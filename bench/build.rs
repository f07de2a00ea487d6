//! Links Intel ISA-L (Debian `libisal-dev`) when pkg-config finds it, for the reference
//! columns of the parity benchmark; without it the benchmark reports ISA-L as absent.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(have_isal)");
    println!("cargo::rerun-if-env-changed=FERRORAID_NO_ISAL");
    if std::env::var_os("FERRORAID_NO_ISAL").is_some() {
        return;
    }
    if pkg_config::Config::new().probe("libisal").is_ok() {
        println!("cargo::rustc-cfg=have_isal");
    } else {
        println!("cargo::warning=libisal not found (apt-get install libisal-dev): ISA-L columns disabled");
    }
}
