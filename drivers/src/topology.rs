//! Where reactors run: one hardware thread per physical core, near the members' memory.
//!
//! A reactor busy-polls its core, so two reactors on SMT siblings of one core halve each
//! other; and a reactor whose member devices hang off another NUMA node pays the
//! interconnect on every completion and every buffer. [`choose_cores`] picks, for `n`
//! reactors, the first hardware thread (PU) of distinct physical cores, taking the cores of
//! the preferred NUMA node first, and only PUs this process may run on (its CPU affinity).
//!
//! Two ways read the machine, and one function decides ([`pick_cores`]), so they cannot
//! disagree in policy:
//! - [`Method::Hwloc`] (cargo feature `hwloc`, the production build): hwloc through
//!   `hwlocality`; needs the hwloc C library (`libhwloc-dev`).
//! - [`Method::Sysfs`] (the default build): the kernel's own CPU topology in sysfs
//!   (`/sys/devices/system/cpu/cpuN/topology/core_cpus_list`, the NUMA nodes'
//!   `/sys/devices/system/node/nodeM/cpulist`); needs no C library. It is what hwloc itself
//!   reads on Linux for these facts, so both give the same cores on the same machine (a test
//!   holds them to that).
//!
//! Both reduce the machine to a [`Machine`]: each PU with its OS index, the physical core it
//! belongs to, and its NUMA node.

use std::fmt;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Why no core list could be made.
#[derive(Debug, Error)]
pub enum TopologyError {
    /// hwloc could not read the machine's topology.
    #[cfg(feature = "hwloc")]
    #[error("reading the CPU topology with hwloc: {0}")]
    Hwloc(String),
    /// A sysfs topology file could not be read.
    #[error("reading the CPU topology from sysfs: {path}: {source}")]
    SysfsRead {
        /// The file or directory.
        path: PathBuf,
        /// What the read returned.
        source: std::io::Error,
    },
    /// A sysfs topology file held something other than a CPU list or number.
    #[error("reading the CPU topology from sysfs: {path}: unexpected contents {text:?}")]
    SysfsFormat {
        /// The file.
        path: PathBuf,
        /// Its contents (trimmed).
        text: String,
    },
    /// sysfs listed no CPU with a topology.
    #[error("reading the CPU topology from sysfs: no CPU under {0}")]
    SysfsEmpty(PathBuf),
    /// Fewer usable physical cores than reactors asked for.
    #[error("{wanted} reactors need {wanted} physical cores, but this process may use {available}: {cores:?}")]
    TooFewCores {
        /// Reactors asked for.
        wanted: usize,
        /// Usable physical cores.
        available: usize,
        /// Their chosen PUs (OS indices).
        cores: Vec<usize>,
    },
}

/// How the machine's topology was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// hwloc (cargo feature `hwloc`).
    #[cfg(feature = "hwloc")]
    Hwloc,
    /// The kernel's CPU topology in sysfs (no C library).
    Sysfs,
}

impl Method {
    /// The method a build uses: hwloc when built with the `hwloc` feature, sysfs otherwise.
    pub const DEFAULT: Method = {
        #[cfg(feature = "hwloc")]
        {
            Method::Hwloc
        }
        #[cfg(not(feature = "hwloc"))]
        {
            Method::Sysfs
        }
    };
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            #[cfg(feature = "hwloc")]
            Method::Hwloc => "hwloc",
            Method::Sysfs => "sysfs",
        })
    }
}

/// One hardware thread (PU, a logical CPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pu {
    /// OS index: the N of `cpuN`, what `sched_setaffinity` takes.
    pub os_index: usize,
    /// The physical core it belongs to, named by the lowest OS index among that core's
    /// hardware threads (its SMT siblings, itself included). Linux's `core_id` is not used:
    /// it repeats across packages and, on some machines, across dies.
    pub core: usize,
    /// The NUMA node (OS index) whose CPU list holds it; `None` if none does.
    pub node: Option<usize>,
}

/// The machine as core choice sees it: every PU the method reports, in OS index order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    /// The PUs, sorted by OS index.
    pub pus: Vec<Pu>,
}

impl Machine {
    /// Reads this machine's topology by `method`.
    ///
    /// # Errors
    /// [`TopologyError::Hwloc`] when hwloc cannot load the topology; the `Sysfs*` variants
    /// when `/sys/devices/system` cannot be read (see [`Machine::from_sysfs`]).
    pub fn read(method: Method) -> Result<Machine, TopologyError> {
        match method {
            #[cfg(feature = "hwloc")]
            Method::Hwloc => {
                let topo =
                    hwlocality::Topology::new().map_err(|e| TopologyError::Hwloc(e.to_string()))?;
                Ok(Machine::from_hwloc(&topo))
            }
            Method::Sysfs => Machine::from_sysfs(Path::new("/sys/devices/system")),
        }
    }

    /// Reads the kernel's CPU topology under `root` (on a live machine
    /// `/sys/devices/system`; a test points it at a fixture). Per online CPU `cpuN`, the
    /// core is the first entry of `cpu/cpuN/topology/core_cpus_list` (Linux 5.4+; before,
    /// the same list was named `thread_siblings_list`); a CPU whose `cpu/cpuN/online` reads
    /// 0 is skipped. The node is the `nodeM` whose `node/nodeM/cpulist` lists it. Without a
    /// `node` directory (a kernel built without NUMA) every CPU is on node 0, as hwloc
    /// reports such a machine. File formats: Documentation/ABI/stable/sysfs-devices-system-cpu
    /// and Documentation/ABI/stable/sysfs-devices-node of the Linux kernel.
    ///
    /// # Errors
    /// [`TopologyError::SysfsRead`] when `root/cpu` or a CPU's sibling list cannot be read,
    /// [`TopologyError::SysfsFormat`] when a list is malformed,
    /// [`TopologyError::SysfsEmpty`] when no CPU is listed.
    pub fn from_sysfs(root: &Path) -> Result<Machine, TopologyError> {
        let cpu_dir = root.join("cpu");
        let mut pus = Vec::new();
        for (os_index, dir) in numbered_entries(&cpu_dir, "cpu")? {
            if let Ok(online) = std::fs::read_to_string(dir.join("online")) {
                if online.trim() == "0" {
                    continue;
                }
            }
            let topo = dir.join("topology");
            let siblings = ["core_cpus_list", "thread_siblings_list"]
                .iter()
                .map(|f| topo.join(f))
                .find(|p| p.exists())
                .unwrap_or_else(|| topo.join("core_cpus_list"));
            let list = read_cpu_list(&siblings)?;
            let core = list.iter().copied().min().unwrap_or(os_index).min(os_index);
            pus.push(Pu {
                os_index,
                core,
                node: None,
            });
        }
        if pus.is_empty() {
            return Err(TopologyError::SysfsEmpty(cpu_dir));
        }
        let node_dir = root.join("node");
        if node_dir.is_dir() {
            for (node, dir) in numbered_entries(&node_dir, "node")? {
                for cpu in read_cpu_list(&dir.join("cpulist"))? {
                    if let Some(pu) = pus.iter_mut().find(|p| p.os_index == cpu) {
                        pu.node = Some(node);
                    }
                }
            }
        } else {
            for pu in &mut pus {
                pu.node = Some(0);
            }
        }
        pus.sort_by_key(|p| p.os_index);
        Ok(Machine { pus })
    }

    /// The machine as an hwloc topology describes it: its PUs (hwloc leaves out those this
    /// process's cgroup forbids), each core named by the lowest OS index of the core's
    /// complete CPU set (disallowed siblings included, as in sysfs), each PU's node the NUMA
    /// node whose CPU set holds it.
    #[cfg(feature = "hwloc")]
    pub fn from_hwloc(topo: &hwlocality::Topology) -> Machine {
        use hwlocality::object::types::ObjectType;
        let nodes: Vec<(usize, Vec<usize>)> = topo
            .objects_with_type(ObjectType::NUMANode)
            .filter_map(|n| {
                let set = n.cpuset()?;
                Some((n.os_index()?, set.iter_set().map(usize::from).collect()))
            })
            .collect();
        let mut pus = Vec::new();
        for core in topo.objects_with_type(ObjectType::Core) {
            let (Some(set), Some(complete)) = (core.cpuset(), core.complete_cpuset()) else {
                continue;
            };
            let Some(first) = complete.first_set().map(usize::from) else {
                continue;
            };
            for os_index in set.iter_set().map(usize::from) {
                let node = nodes
                    .iter()
                    .find(|(_, cpus)| cpus.contains(&os_index))
                    .map(|&(n, _)| n);
                pus.push(Pu {
                    os_index,
                    core: first,
                    node,
                });
            }
        }
        pus.sort_by_key(|p| p.os_index);
        Machine { pus }
    }
}

/// `dir`'s entries named `prefix` followed by a number (`cpu12`, `node1`), with that number,
/// in number order.
fn numbered_entries(dir: &Path, prefix: &str) -> Result<Vec<(usize, PathBuf)>, TopologyError> {
    let read = std::fs::read_dir(dir).map_err(|source| TopologyError::SysfsRead {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut out: Vec<(usize, PathBuf)> = read
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name();
            let n = name.to_str()?.strip_prefix(prefix)?.parse().ok()?;
            Some((n, e.path()))
        })
        .collect();
    out.sort_unstable_by_key(|&(n, _)| n);
    Ok(out)
}

/// Reads a kernel CPU list file (`0-3,8,10-11`; empty for none).
fn read_cpu_list(path: &Path) -> Result<Vec<usize>, TopologyError> {
    let text = std::fs::read_to_string(path).map_err(|source| TopologyError::SysfsRead {
        path: path.to_path_buf(),
        source,
    })?;
    parse_cpu_list(text.trim()).ok_or_else(|| TopologyError::SysfsFormat {
        path: path.to_path_buf(),
        text: text.trim().to_string(),
    })
}

/// Parses the kernel's CPU list format (`0-3,8,10-11`; the empty string is no CPU);
/// `None` if malformed.
fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in text.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if b < a {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

/// The core policy, shared by every method: for each physical core of `machine`, its
/// lowest-numbered PU in `allowed` (cores with no allowed PU are left out); the cores whose
/// chosen PU is on NUMA node `prefer_node` come first, then the others, each group in OS
/// index order. Returns the chosen PUs' OS indices.
pub fn pick_cores(machine: &Machine, allowed: &[usize], prefer_node: Option<usize>) -> Vec<usize> {
    // `machine.pus` is sorted by OS index, so the first allowed PU seen of a core is its
    // lowest.
    let mut seen_cores: Vec<usize> = Vec::new();
    let mut near = Vec::new();
    let mut far = Vec::new();
    for pu in &machine.pus {
        if !allowed.contains(&pu.os_index) || seen_cores.contains(&pu.core) {
            continue;
        }
        seen_cores.push(pu.core);
        if prefer_node.is_some() && pu.node == prefer_node {
            near.push(pu.os_index);
        } else {
            far.push(pu.os_index);
        }
    }
    near.extend(far);
    near
}

/// The PUs this process may run on (its CPU affinity), or every PU of `machine` if the
/// affinity cannot be read.
fn allowed_pus(machine: &Machine) -> Vec<usize> {
    match core_affinity::get_core_ids() {
        Some(ids) if !ids.is_empty() => ids.into_iter().map(|c| c.id).collect(),
        _ => machine.pus.iter().map(|p| p.os_index).collect(),
    }
}

/// OS indices of one PU per usable physical core of this machine, read by `method`, in
/// [`pick_cores`] order.
///
/// # Errors
/// As [`Machine::read`].
pub fn usable_cores_by(
    method: Method,
    prefer_node: Option<usize>,
) -> Result<Vec<usize>, TopologyError> {
    let machine = Machine::read(method)?;
    Ok(pick_cores(&machine, &allowed_pus(&machine), prefer_node))
}

/// [`usable_cores_by`] with this build's [`Method::DEFAULT`].
///
/// # Errors
/// As [`Machine::read`].
pub fn usable_cores(prefer_node: Option<usize>) -> Result<Vec<usize>, TopologyError> {
    usable_cores_by(Method::DEFAULT, prefer_node)
}

/// Cores chosen for the reactors, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoreChoice {
    /// OS indices of the PUs, one reactor each.
    pub cores: Vec<usize>,
    /// How the topology was read.
    pub method: Method,
}

/// PUs for `n` reactors: the first `n` of [`usable_cores`], with the method that read the
/// topology ([`Method::DEFAULT`]).
///
/// # Errors
/// [`TopologyError::TooFewCores`] when the process may use fewer than `n` physical cores
/// (run fewer reactors, or name cores explicitly); the read errors of [`Machine::read`].
pub fn choose_cores(n: usize, prefer_node: Option<usize>) -> Result<CoreChoice, TopologyError> {
    let method = Method::DEFAULT;
    let cores = usable_cores_by(method, prefer_node)?;
    if cores.len() < n {
        return Err(TopologyError::TooFewCores {
            wanted: n,
            available: cores.len(),
            cores,
        });
    }
    Ok(CoreChoice {
        cores: cores[..n].to_vec(),
        method,
    })
}

/// The NUMA node a block device's controller is attached to, from sysfs
/// (`/sys/dev/block/MAJ:MIN/device/numa_node`, or the parent device's for a partition);
/// `None` for regular files, loop and virtual devices, and machines without NUMA
/// information (the kernel reports -1).
pub fn device_numa_node(path: &Path) -> Option<usize> {
    use std::os::unix::fs::FileTypeExt;
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    if !meta.file_type().is_block_device() {
        return None;
    }
    let rdev = meta.rdev();
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    let base = format!("/sys/dev/block/{major}:{minor}");
    for candidate in [
        format!("{base}/device/numa_node"),
        format!("{base}/../device/numa_node"),
    ] {
        if let Ok(s) = std::fs::read_to_string(&candidate) {
            return s
                .trim()
                .parse::<i64>()
                .ok()
                .and_then(|n| usize::try_from(n).ok());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape both fixtures describe: 2 packages × 2 NUMA nodes × 2 cores × 2 PUs, with
    /// Linux's usual numbering of SMT siblings (core `c` has PUs `c` and `c + CORES`).
    const CORES: usize = 8;
    /// Cores per NUMA node and per package.
    const CORES_PER_NODE: usize = 2;
    const CORES_PER_PACKAGE: usize = 4;

    /// The PUs of core `c`.
    fn siblings(c: usize) -> [usize; 2] {
        [c, c + CORES]
    }

    /// Writes the shape as a sysfs tree under `root`, with the noise a real one has (an
    /// offline CPU, files and directories that are not CPUs or nodes).
    fn sysfs_fixture(root: &Path, old_kernel: bool) {
        let list = |v: &[usize]| {
            v.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        for c in 0..CORES {
            for pu in siblings(c) {
                let topo = root.join(format!("cpu/cpu{pu}/topology"));
                std::fs::create_dir_all(&topo).unwrap();
                let name = if old_kernel {
                    "thread_siblings_list"
                } else {
                    "core_cpus_list"
                };
                std::fs::write(topo.join(name), format!("{}\n", list(&siblings(c)))).unwrap();
                std::fs::write(
                    topo.join("physical_package_id"),
                    format!("{}\n", c / CORES_PER_PACKAGE),
                )
                .unwrap();
                std::fs::write(topo.join("core_id"), format!("{}\n", c % CORES_PER_PACKAGE))
                    .unwrap();
                if pu != 0 {
                    std::fs::write(root.join(format!("cpu/cpu{pu}/online")), "1\n").unwrap();
                }
            }
        }
        // An offline CPU keeps its directory but has no topology.
        std::fs::create_dir_all(root.join("cpu/cpu16")).unwrap();
        std::fs::write(root.join("cpu/cpu16/online"), "0\n").unwrap();
        std::fs::create_dir_all(root.join("cpu/cpufreq")).unwrap();
        std::fs::write(root.join("cpu/online"), "0-15\n").unwrap();
        for n in 0..CORES / CORES_PER_NODE {
            let cores = n * CORES_PER_NODE..(n + 1) * CORES_PER_NODE;
            let mut cpus: Vec<usize> = cores.flat_map(siblings).collect();
            cpus.sort_unstable();
            let dir = root.join(format!("node/node{n}"));
            std::fs::create_dir_all(&dir).unwrap();
            // The kernel writes ranges.
            let text = format!("{}-{},{}-{}\n", cpus[0], cpus[1], cpus[2], cpus[3]);
            std::fs::write(dir.join("cpulist"), text).unwrap();
        }
        std::fs::write(root.join("node/has_cpu"), "0-3\n").unwrap();
    }

    /// Every PU except 0 (core 0 is then reached through its sibling 8) and both PUs of
    /// core 3.
    fn allowed() -> Vec<usize> {
        (0..2 * CORES)
            .filter(|&p| p != 0 && !siblings(3).contains(&p))
            .collect()
    }

    /// What [`pick_cores`] must choose on the shape for [`allowed`].
    fn expected(prefer_node: Option<usize>) -> Vec<usize> {
        match prefer_node {
            // Node 2 holds cores 4 and 5; the others follow in OS index order.
            Some(2) => vec![4, 5, 1, 2, 6, 7, 8],
            // Node 0 holds cores 0 (through PU 8) and 1.
            Some(0) => vec![1, 8, 2, 4, 5, 6, 7],
            _ => vec![1, 2, 4, 5, 6, 7, 8],
        }
    }

    #[test]
    fn cpu_lists_parse_like_the_kernel_writes_them() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn sysfs_fixture_picks_one_pu_per_core_preferred_node_first() {
        for old_kernel in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            sysfs_fixture(dir.path(), old_kernel);
            let machine = Machine::from_sysfs(dir.path()).unwrap();
            assert_eq!(machine.pus.len(), 2 * CORES, "{machine:?}");
            assert_eq!(
                machine.pus[9],
                Pu {
                    os_index: 9,
                    core: 1,
                    node: Some(0)
                }
            );
            for prefer in [None, Some(0), Some(2), Some(7)] {
                assert_eq!(
                    pick_cores(&machine, &allowed(), prefer),
                    expected(prefer),
                    "prefer {prefer:?}"
                );
            }
            // Everything allowed: the first PU of every core.
            let all: Vec<usize> = (0..2 * CORES).collect();
            assert_eq!(
                pick_cores(&machine, &all, None),
                (0..CORES).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn sysfs_without_numa_puts_every_cpu_on_node_0() {
        let dir = tempfile::tempdir().unwrap();
        sysfs_fixture(dir.path(), false);
        std::fs::remove_dir_all(dir.path().join("node")).unwrap();
        let machine = Machine::from_sysfs(dir.path()).unwrap();
        assert!(machine.pus.iter().all(|p| p.node == Some(0)));
    }

    #[test]
    fn sysfs_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let e = Machine::from_sysfs(dir.path()).unwrap_err();
        assert!(e.to_string().contains("cpu"), "{e}");
        std::fs::create_dir_all(dir.path().join("cpu/cpu0/topology")).unwrap();
        std::fs::write(dir.path().join("cpu/cpu0/topology/core_cpus_list"), "zz\n").unwrap();
        let e = Machine::from_sysfs(dir.path()).unwrap_err();
        assert!(e.to_string().contains("core_cpus_list"), "{e}");
    }

    #[test]
    fn cores_on_this_machine_are_distinct_allowed_and_bounded() {
        let all = usable_cores(None).expect("this machine's topology reads");
        assert!(!all.is_empty());
        let mut sorted = all.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), all.len(), "one PU per core: {all:?}");
        let allowed: Vec<usize> = core_affinity::get_core_ids()
            .unwrap()
            .into_iter()
            .map(|c| c.id)
            .collect();
        assert!(
            all.iter().all(|c| allowed.contains(c)),
            "{all:?} vs {allowed:?}"
        );
        let one = choose_cores(1, Some(0)).unwrap();
        assert_eq!(one.cores.len(), 1);
        assert_eq!(one.method, Method::DEFAULT);
        let too_many = choose_cores(all.len() + 1, None).unwrap_err();
        assert!(
            too_many.to_string().contains("physical cores"),
            "{too_many}"
        );
        assert_eq!(device_numa_node(Path::new("/etc/hostname")), None);
    }

    #[cfg(feature = "hwloc")]
    mod hwloc {
        use super::*;

        /// The same shape as `sysfs_fixture`, in hwloc's synthetic syntax
        /// (<https://hwloc.readthedocs.io/en/stable/synthetic.html>): PU OS indices given
        /// in logical order, so that core `c` has PUs `c` and `c + 8`.
        fn synthetic() -> hwlocality::Topology {
            let indexes: Vec<String> = (0..CORES)
                .flat_map(siblings)
                .map(|p| p.to_string())
                .collect();
            let description = format!(
                "pack:2 numa:2 core:{CORES_PER_NODE} pu:2(indexes={})",
                indexes.join(",")
            );
            hwlocality::Topology::builder()
                .from_synthetic(&description)
                .unwrap()
                .build()
                .unwrap()
        }

        #[test]
        fn hwloc_synthetic_and_sysfs_fixture_agree() {
            let hw = Machine::from_hwloc(&synthetic());
            let dir = tempfile::tempdir().unwrap();
            sysfs_fixture(dir.path(), false);
            let fs = Machine::from_sysfs(dir.path()).unwrap();
            assert_eq!(hw, fs);
            for prefer in [None, Some(0), Some(2), Some(7)] {
                assert_eq!(pick_cores(&hw, &allowed(), prefer), expected(prefer));
            }
        }

        #[test]
        fn hwloc_and_sysfs_choose_the_same_cores_on_this_machine() {
            let hw = Machine::read(Method::Hwloc).unwrap();
            let fs = Machine::read(Method::Sysfs).unwrap();
            let allowed = allowed_pus(&hw);
            let nodes: Vec<Option<usize>> = std::iter::once(None)
                .chain(hw.pus.iter().map(|p| p.node))
                .collect();
            for prefer in nodes {
                assert_eq!(
                    pick_cores(&hw, &allowed, prefer),
                    pick_cores(&fs, &allowed, prefer),
                    "prefer {prefer:?}: {hw:?} vs {fs:?}"
                );
                assert_eq!(
                    usable_cores_by(Method::Hwloc, prefer).unwrap(),
                    usable_cores_by(Method::Sysfs, prefer).unwrap()
                );
            }
        }
    }
}
