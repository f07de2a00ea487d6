//! Where reactors run: one hardware thread per physical core, near the members' memory.
//!
//! A reactor busy-polls its core, so two reactors on SMT siblings of one core halve each
//! other; and a reactor whose member devices hang off another NUMA node pays the
//! interconnect on every completion and every buffer. [`choose_cores`] asks hwloc (through
//! `hwlocality`) for the machine's cores and picks, for `n` reactors, the first hardware
//! thread (PU) of distinct physical cores, taking the cores of the preferred NUMA node
//! first, and only PUs this process may run on (its CPU affinity).

use std::path::Path;

use hwlocality::object::types::ObjectType;
use hwlocality::Topology;
use thiserror::Error;

/// Why no core list could be made.
#[derive(Debug, Error)]
pub enum TopologyError {
    /// hwloc could not read the machine's topology.
    #[error("reading the CPU topology with hwloc: {0}")]
    Hwloc(String),
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

/// OS indices of one PU per usable physical core, the cores of NUMA node `prefer_node`
/// (OS index) first, then the others, each group in OS order.
///
/// # Errors
/// [`TopologyError::Hwloc`] when hwloc cannot load the topology.
pub fn usable_cores(prefer_node: Option<usize>) -> Result<Vec<usize>, TopologyError> {
    let topo = Topology::new().map_err(|e| TopologyError::Hwloc(e.to_string()))?;
    let allowed: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    let node_cpus: Vec<usize> = prefer_node
        .and_then(|n| {
            topo.objects_with_type(ObjectType::NUMANode)
                .find(|o| o.os_index() == Some(n))
                .and_then(|o| o.cpuset())
                .map(|set| set.iter_set().map(usize::from).collect())
        })
        .unwrap_or_default();
    let mut near = Vec::new();
    let mut far = Vec::new();
    for core in topo.objects_with_type(ObjectType::Core) {
        let Some(set) = core.cpuset() else { continue };
        // The first PU of the core this process may run on.
        let Some(pu) = set
            .iter_set()
            .map(usize::from)
            .find(|pu| allowed.is_empty() || allowed.contains(pu))
        else {
            continue;
        };
        if node_cpus.contains(&pu) {
            near.push(pu);
        } else {
            far.push(pu);
        }
    }
    near.extend(far);
    Ok(near)
}

/// PUs for `n` reactors: the first `n` of [`usable_cores`].
///
/// # Errors
/// [`TopologyError::TooFewCores`] when the process may use fewer than `n` physical cores
/// (run fewer reactors, or name cores explicitly); [`TopologyError::Hwloc`].
pub fn choose_cores(n: usize, prefer_node: Option<usize>) -> Result<Vec<usize>, TopologyError> {
    let cores = usable_cores(prefer_node)?;
    if cores.len() < n {
        return Err(TopologyError::TooFewCores {
            wanted: n,
            available: cores.len(),
            cores,
        });
    }
    Ok(cores[..n].to_vec())
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

    #[test]
    fn cores_are_distinct_allowed_and_bounded() {
        let all = usable_cores(None).expect("hwloc reads this machine");
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
        assert_eq!(choose_cores(1, Some(0)).unwrap().len(), 1);
        let too_many = choose_cores(all.len() + 1, None).unwrap_err();
        assert!(
            too_many.to_string().contains("physical cores"),
            "{too_many}"
        );
        assert_eq!(device_numa_node(Path::new("/etc/hostname")), None);
    }
}
