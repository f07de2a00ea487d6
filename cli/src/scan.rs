//! Finding arrays by their members' superblocks: `ferroraid examine --scan` and the
//! `[[array]]` tables of `serve --config` (mdadm's `--examine --scan` and
//! `--assemble --scan` with `DEVICE`/`ARRAY` lines in mdadm.conf).
//!
//! A scan expands shell globs (the `glob` crate: `*`, `?`, `[...]`, `**`) into paths, reads
//! each path's superblock ([`crate::examine::examine_device`]) and groups the devices
//! whose superblock decodes with a correct checksum by the array UUID (`set_uuid`), in
//! whatever order the globs list them: assembly puts each device in its slot from its
//! superblock, as `serve` does with devices named on the command line. Devices without a
//! readable superblock are skipped (a scan of `/dev/sd*` meets many) and counted.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::examine::{examine_device, ExamineEntry, ExamineReport, ExamineRole};

/// What a scan found of one array.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FoundArray {
    /// `set_uuid` in md's colon form.
    pub uuid: String,
    /// `set_name` of the newest superblock (highest `events`).
    pub name: String,
    /// md's RAID level number.
    pub level: i32,
    /// Members of the complete array (`raid_disks`).
    pub raid_devices: u32,
    /// The devices found, by role: slots in slot order, then spares and the rest.
    pub devices: Vec<FoundDevice>,
}

/// One device of a [`FoundArray`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FoundDevice {
    /// The path the glob gave.
    pub path: PathBuf,
    /// Its role in the array, as its superblock records it.
    pub role: ExamineRole,
    /// Its superblock's generation (`events`): a device behind the others is stale.
    pub events: u64,
}

impl FoundArray {
    /// How many distinct slots the devices found hold.
    pub fn slots_found(&self) -> usize {
        let mut slots: Vec<u16> = self
            .devices
            .iter()
            .filter_map(|d| match d.role {
                ExamineRole::Slot(n) => Some(n),
                _ => None,
            })
            .collect();
        slots.sort_unstable();
        slots.dedup();
        slots.len()
    }
}

/// The result of a scan.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scan {
    /// The arrays found, by UUID.
    pub arrays: Vec<FoundArray>,
    /// Paths the globs matched that hold no usable superblock (no md magic, too small,
    /// unreadable, bad checksum), each with why.
    pub skipped: Vec<String>,
}

/// The globs a scan without any reads: every block device the kernel lists
/// (`/sys/class/block`, as mdadm's scan reads `/proc/partitions`).
pub fn default_patterns() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/sys/class/block")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Expands `patterns` and reads every matching path's superblock.
///
/// # Errors
/// A pattern that is not a valid glob (the `glob` crate's message, naming it), or a
/// directory the glob cannot list.
pub fn scan(patterns: &[String]) -> Result<Scan> {
    let mut paths: Vec<PathBuf> = Vec::new();
    let mut keys = Vec::new();
    for p in patterns {
        for entry in glob::glob(p).with_context(|| format!("scan pattern {p:?}"))? {
            let path = entry.with_context(|| format!("scan pattern {p:?}"))?;
            if path.is_dir() {
                continue;
            }
            // One device matched twice (a symlink or hard link beside it) is one device.
            let key = crate::create::DeviceKey::of(&path);
            if !keys.contains(&key) {
                keys.push(key);
                paths.push(path);
            }
        }
    }
    Ok(examine_paths(paths))
}

/// Reads the superblock of every path in `paths` and groups them by array UUID.
pub fn examine_paths(paths: Vec<PathBuf>) -> Scan {
    let mut by_uuid: BTreeMap<String, (Vec<ExamineReport>, Vec<PathBuf>)> = BTreeMap::new();
    let mut out = Scan::default();
    for path in paths {
        match examine_device(&path) {
            ExamineEntry::Report(r) if r.checksum_ok => {
                let e = by_uuid.entry(r.array_uuid.clone()).or_default();
                e.0.push(*r);
                e.1.push(path);
            }
            other => out.skipped.push(
                other
                    .problem()
                    .unwrap_or_else(|| format!("{}: skipped", path.display())),
            ),
        }
    }
    for (uuid, (reports, paths)) in by_uuid {
        let newest = reports
            .iter()
            .max_by_key(|r| r.events)
            .expect("a group has a report");
        let mut devices: Vec<FoundDevice> = reports
            .iter()
            .zip(paths)
            .map(|(r, path)| FoundDevice {
                path,
                role: r.role,
                events: r.events,
            })
            .collect();
        devices.sort_by_key(|d| match d.role {
            ExamineRole::Slot(n) => (0, u32::from(n)),
            ExamineRole::Spare => (1, 0),
            _ => (2, 0),
        });
        out.arrays.push(FoundArray {
            uuid,
            name: newest.name.clone(),
            level: newest.level,
            raid_devices: newest.raid_devices,
            devices,
        });
    }
    out
}

/// One `[[array]]` table of the `serve --config` file (docs/MANAGEMENT.md, "Finding
/// arrays by scanning").
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArrayTable {
    /// The array's name (`set_name`): selects it among the scan's arrays when `uuid` is
    /// not given.
    pub name: Option<String>,
    /// The array's UUID in md's colon form (as `examine` prints it): selects it.
    pub uuid: Option<String>,
    /// The member devices, named (any order).
    pub devices: Option<Vec<PathBuf>>,
    /// Globs whose matches are scanned for this array's members (any order).
    pub scan: Option<Vec<String>>,
    /// NBD listen addresses of this array: `HOST:PORT` or `unix:PATH` (serve's `--nbd`).
    pub nbd: Option<Vec<String>>,
    /// iSCSI portals of this array, `HOST:PORT`.
    pub iscsi: Option<Vec<String>>,
    /// NVMe/TCP portals of this array, `HOST:PORT`.
    pub nvmf: Option<Vec<String>>,
}

impl ArrayTable {
    /// Whether `a` is the array this table names: its UUID and its name (md's
    /// `homehost:` prefix aside), each as far as the table gives them (at least one).
    fn selects(&self, a: &FoundArray) -> bool {
        let uuid = self.uuid.as_deref().is_none_or(|u| same_uuid(u, &a.uuid));
        let name = self
            .name
            .as_deref()
            .is_none_or(|n| name_matches(n, &a.name));
        (self.uuid.is_some() || self.name.is_some()) && uuid && name
    }

    /// The member devices this table names: `devices` as given (checked, when the table
    /// also gives `uuid` or `name`, to hold no other array's superblocks), or the devices
    /// the `scan` globs find with this table's UUID (else name).
    ///
    /// # Errors
    /// Both or neither of `devices` and `scan`; `scan` without `uuid` or `name`; listed
    /// `devices` holding another array's superblocks than the `uuid`/`name` given; a scan
    /// that finds no array, or several, that match (listing what it found); the scan's
    /// own errors.
    pub fn resolve(&self) -> Result<Vec<PathBuf>> {
        match (&self.devices, &self.scan) {
            (Some(d), None) => {
                if d.is_empty() {
                    bail!("[[array]] devices = []: name at least one member device");
                }
                if self.uuid.is_some() || self.name.is_some() {
                    // The devices must be the named array's: another array's members
                    // would otherwise start under this table.
                    let found = examine_paths(d.clone());
                    let wrong: Vec<&FoundArray> =
                        found.arrays.iter().filter(|a| !self.selects(a)).collect();
                    if !wrong.is_empty() {
                        bail!(
                            "[[array]] {}: the devices listed hold another array's superblocks \
                             ({}): fix the table's devices, or its name/uuid",
                            self.label(),
                            wrong
                                .iter()
                                .map(|a| format!(
                                    "{:?} uuid {} on {}",
                                    a.name,
                                    a.uuid,
                                    a.devices
                                        .iter()
                                        .map(|d| d.path.display().to_string())
                                        .collect::<Vec<_>>()
                                        .join(", ")
                                ))
                                .collect::<Vec<_>>()
                                .join("; ")
                        );
                    }
                }
                Ok(d.clone())
            }
            (None, Some(patterns)) => {
                if self.uuid.is_none() && self.name.is_none() {
                    bail!(
                        "[[array]] with scan needs uuid (or name) to say which array: \
                         `ferroraid examine --scan` prints it"
                    );
                }
                let found = scan(patterns)?;
                let matching: Vec<&FoundArray> =
                    found.arrays.iter().filter(|a| self.selects(a)).collect();
                match matching.as_slice() {
                    [one] => Ok(one.devices.iter().map(|d| d.path.clone()).collect()),
                    [] => bail!(
                        "[[array]] {}: no such array among the devices {patterns:?} match \
                         (found: {})",
                        self.label(),
                        describe(&found)
                    ),
                    _ => bail!(
                        "[[array]] {}: several arrays have that name (found: {}): give \
                         uuid",
                        self.label(),
                        describe(&found)
                    ),
                }
            }
            (Some(_), Some(_)) => {
                bail!("[[array]] {}: give devices or scan, not both", self.label())
            }
            (None, None) => bail!(
                "[[array]] {}: give its member devices (devices = [...]) or globs to scan \
                 (scan = [...])",
                self.label()
            ),
        }
    }

    /// Whether the table names any export of its own.
    pub fn has_exports(&self) -> bool {
        self.nbd.is_some() || self.iscsi.is_some() || self.nvmf.is_some()
    }

    /// Adds the table's exports to `o` (`nbd` to `nbd_tcp`/`nbd_unix`, `iscsi`, `nvmf`).
    ///
    /// # Errors
    /// An address that is not `HOST:PORT` (or `unix:PATH` for NBD), naming the table.
    pub fn exports_into(&self, o: &mut crate::target::ServeOptions) -> Result<()> {
        let addr = |what: &str, s: &str| -> Result<std::net::SocketAddr> {
            s.parse().map_err(|e| {
                anyhow::anyhow!(
                    "[[array]] {}: {what} {s:?}: expected HOST:PORT ({e})",
                    self.label()
                )
            })
        };
        for s in self.nbd.iter().flatten() {
            match s.strip_prefix("unix:") {
                Some(p) => o.nbd_unix.push(PathBuf::from(p)),
                None => o.nbd_tcp.push(addr("nbd", s)?),
            }
        }
        for s in self.iscsi.iter().flatten() {
            o.iscsi.push(addr("iscsi", s)?);
        }
        for s in self.nvmf.iter().flatten() {
            o.nvmf.push(addr("nvmf", s)?);
        }
        Ok(())
    }

    fn label(&self) -> String {
        match (&self.name, &self.uuid) {
            (_, Some(u)) => format!("uuid {u}"),
            (Some(n), None) => format!("name {n:?}"),
            (None, None) => "(unnamed)".into(),
        }
    }
}

/// Whether two UUIDs in md's colon form (or with other separators, any case) are equal.
fn same_uuid(a: &str, b: &str) -> bool {
    let hex = |s: &str| -> String {
        s.chars()
            .filter(char::is_ascii_hexdigit)
            .map(|c| c.to_ascii_lowercase())
            .collect()
    };
    let (a, b) = (hex(a), hex(b));
    a.len() == 32 && a == b
}

/// Whether `want` names the array `set_name`: equal, or equal to its part after mdadm's
/// `homehost:` prefix.
pub fn name_matches(want: &str, set_name: &str) -> bool {
    want == set_name || set_name.split_once(':').is_some_and(|(_, n)| n == want)
}

fn describe(s: &Scan) -> String {
    if s.arrays.is_empty() {
        return "none".into();
    }
    s.arrays
        .iter()
        .map(|a| format!("{:?} uuid {}", a.name, a.uuid))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `s` as a TOML basic string.
fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// The `[[array]]` tables for what `s` found: each with its name, UUID and `scan =
/// patterns`, preceded by comments with level, members found and their paths by role.
/// `serve --config` accepts each table as written.
pub fn config_text(s: &Scan, patterns: &[String]) -> String {
    let mut t = String::new();
    let pats = toml::Value::Array(
        patterns
            .iter()
            .map(|p| toml::Value::String(p.clone()))
            .collect(),
    );
    for (i, a) in s.arrays.iter().enumerate() {
        if i > 0 {
            t.push('\n');
        }
        t.push_str(&format!(
            "# RAID{}, {} of {} slots found ({} devices)\n",
            a.level,
            a.slots_found(),
            a.raid_devices,
            a.devices.len()
        ));
        for d in &a.devices {
            t.push_str(&format!(
                "#   {}: {} (events {})\n",
                d.role,
                d.path.display(),
                d.events
            ));
        }
        t.push_str("[[array]]\n");
        t.push_str(&format!("name = {}\n", toml_str(&a.name)));
        t.push_str(&format!("uuid = {}\n", toml_str(&a.uuid)));
        t.push_str(&format!("scan = {pats}\n"));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_compare_by_their_hex_digits() {
        assert!(same_uuid(
            "0123abcd:00000000:11111111:2222ffff",
            "0123ABCD-00000000-11111111-2222FFFF"
        ));
        assert!(!same_uuid("0123abcd", "0123abcd"));
        assert!(!same_uuid(
            "0123abcd:00000000:11111111:2222ffff",
            "0123abcd:00000000:11111111:2222fffe"
        ));
        assert!(name_matches("data", "host:data"));
        assert!(name_matches("host:data", "host:data"));
        assert!(!name_matches("dat", "host:data"));
    }

    /// The error `resolve` gives for the table `text`, with its causes.
    fn refusal(text: &str) -> String {
        let t: ArrayTable = toml::from_str(text).unwrap();
        format!("{:#}", t.resolve().unwrap_err())
    }

    #[test]
    fn a_table_names_devices_or_globs_and_which_array() {
        for (text, why) in [
            ("devices = []", "at least one"),
            ("scan = [\"/nonexistent/*\"]", "needs uuid"),
            (
                "name = \"x\"\ndevices = [\"/a\"]\nscan = [\"/b\"]",
                "not both",
            ),
            ("name = \"x\"", "give its member"),
            (
                "name = \"x\"\nscan = [\"/nonexistent-ferroraid/*\"]",
                "found: none",
            ),
            ("uuid = \"x\"\nscan = [\"[\"]", "scan pattern"),
        ] {
            let e = refusal(text);
            assert!(e.contains(why), "{text}: no {why:?} in {e}");
        }
        assert!(toml::from_str::<ArrayTable>("nam = \"x\"").is_err());
    }

    /// A `devices` table that also gives `name` or `uuid` resolves only when its devices
    /// hold that array (or no superblock at all: the start then says why).
    #[test]
    fn a_devices_table_with_a_name_checks_the_devices() {
        use engine::geometry::{Geometry, Layout, Level};
        let dir = tempfile::tempdir().unwrap();
        let devices: Vec<PathBuf> = (0..3)
            .map(|i| {
                let p = dir.path().join(format!("m{i}.img"));
                std::fs::File::create(&p)
                    .and_then(|f| f.set_len(16 << 20))
                    .unwrap();
                p
            })
            .collect();
        crate::create::create(&crate::create::CreateOptions {
            geometry: Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 64 << 10, 512).unwrap(),
            name: "alpha".into(),
            devices: devices.clone(),
            assume_clean: true,
            force: false,
            progress: false,
            zero_progress: None,
            bitmap: engine::metadata::BitmapChoice::None,
            bitmap_chunk_bytes: None,
            consistency_policy: None,
        })
        .unwrap();
        let uuid = examine_paths(devices.clone()).arrays[0].uuid.clone();
        let list = format!("{devices:?}");
        let table = |head: &str| format!("{head}\ndevices = {list}");
        for ok in [
            table("name = \"alpha\""),
            table(&format!("uuid = \"{uuid}\"")),
            table(""),
        ] {
            let t: ArrayTable = toml::from_str(&ok).unwrap();
            assert_eq!(t.resolve().unwrap(), devices, "{ok}");
        }
        for wrong in [
            table("name = \"beta\""),
            table("uuid = \"00000000:00000000:00000000:00000000\""),
            table(&format!("name = \"beta\"\nuuid = \"{uuid}\"")),
        ] {
            let e = refusal(&wrong);
            assert!(
                e.contains("another array's superblocks") && e.contains("\"alpha\""),
                "{wrong}: {e}"
            );
        }
        // A symlink and a hard link beside a member: still three devices to a scan.
        std::os::unix::fs::symlink(&devices[0], dir.path().join("m0-sym.img")).unwrap();
        std::fs::hard_link(&devices[0], dir.path().join("m0-hard.img")).unwrap();
        let found = scan(&[format!("{}/m*.img", dir.path().display())]).unwrap();
        assert_eq!(found.arrays.len(), 1);
        assert_eq!(found.arrays[0].devices.len(), 3, "{found:?}");
        let blank = dir.path().join("blank.img");
        std::fs::File::create(&blank)
            .and_then(|f| f.set_len(16 << 20))
            .unwrap();
        let t: ArrayTable =
            toml::from_str(&format!("name = \"beta\"\ndevices = [{blank:?}]")).unwrap();
        assert_eq!(t.resolve().unwrap(), [blank]);
    }
}
