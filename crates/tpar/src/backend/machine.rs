//! Reads the machine this process runs on into a [`Topology`]: NVML for the GPUs and the links
//! between them, the CUDA driver for which GPUs this process sees (and how CUDA numbers them),
//! NCCL for its version, sysfs for each GPU's place in the PCIe tree (its switches, root port,
//! root complex and CPU socket: [`pcie_tree`]). The backends measure; [`crate::topology`] only
//! holds what they found, so it can be loaded from a file and planned for on another machine.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::dtype::DType;
use crate::error::Result;
use crate::norm::FusedTable;
use crate::topology::{Gpu, Link, PathClass, Topology};

/// The fingerprint of the machine this process detected (the GPUs it sees): kept by the
/// first [`Topology::detect`] (a communicator's creation), else detected here, once.
static FINGERPRINT: OnceLock<Option<String>> = OnceLock::new();

fn this_machine() -> Option<&'static str> {
    if FINGERPRINT.get().is_none() {
        // `detect` keeps the fingerprint itself where it succeeds (not from inside an
        // initialiser of the same cell: that would re-enter it).
        let detected = Topology::detect().ok().map(|t| t.fingerprint());
        let _ = FINGERPRINT.set(detected);
    }
    FINGERPRINT.get().and_then(|f| f.as_deref())
}

/// `tpar tune`'s measurement of the fused op on this machine for `world_size` ranks, `dtype`
/// and `hidden` (`norm::FusedTable`), read once per process: the fused call's path is decided
/// on every call, from memory.
pub fn fused_table(world_size: usize, dtype: DType, hidden: usize) -> Option<Arc<FusedTable>> {
    type Tables = Mutex<HashMap<(usize, DType, usize), Option<Arc<FusedTable>>>>;
    static TABLES: OnceLock<Tables> = OnceLock::new();
    let mut tables = TABLES.get_or_init(Default::default).lock().ok()?;
    tables
        .entry((world_size, dtype, hidden))
        .or_insert_with(|| {
            FusedTable::load(
                (this_machine()?, &super::cuda::kernels::build_id()),
                world_size,
                dtype,
                hidden,
            )
            .map(Arc::new)
        })
        .clone()
}

impl Topology {
    /// Reads the machine through NVML. Errors (no driver, no NVML) say why. Where the CUDA
    /// driver loads, only the GPUs this process sees are kept, numbered as CUDA numbers them
    /// (NVML ignores CUDA_VISIBLE_DEVICES: GPU 0 to CUDA may be NVML's GPU 2).
    pub fn detect() -> Result<Topology> {
        let machine = detect::detect()?;
        let seen = match crate::backend::cuda::driver::visible_gpu_uuids() {
            Ok(uuids) => machine.restricted_to(&uuids),
            Err(_) => machine,
        };
        let _ = FINGERPRINT.set(Some(seen.fingerprint()));
        Ok(seen)
    }

    /// This machine as NVML describes it; where NVML cannot be read, GPUs whose links are unknown
    /// and assumed to have no P2P (the dispatcher then stays on paths every machine has).
    pub fn detect_or_unknown(gpus: usize) -> Topology {
        Topology::detect().unwrap_or_else(|e| {
            let links = (0..gpus)
                .flat_map(|a| (a + 1..gpus).map(move |b| (a, b)))
                .map(|(a, b)| Link {
                    a,
                    b,
                    path: PathClass::CrossNuma,
                    p2p_read: false,
                    p2p_write: false,
                    nvlink: false,
                    atomics: false,
                })
                .collect();
            Topology {
                description: format!("{gpus} GPU(s); links unknown ({e})"),
                driver_version: None,
                cuda_version: None,
                nccl_version: crate::backend::nccl::Nccl::load()
                    .ok()
                    .map(|n| n.version_string()),
                gpus: (0..gpus)
                    .map(|index| Gpu {
                        index,
                        name: "unknown".into(),
                        uuid: String::new(),
                        pci_bus_id: String::new(),
                        numa_node: None,
                        pcie_gen: None,
                        pcie_width: None,
                        compute_capability: None,
                        memory_bytes: 0,
                        pcie: None,
                    })
                    .collect(),
                links,
                measured: None,
            }
        })
    }
}

mod detect {
    use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus, TopologyLevel};
    use nvml_wrapper::Nvml;

    use crate::error::{Error, Result};
    use crate::topology::{Gpu, Link, PathClass, Topology};

    pub fn detect() -> Result<Topology> {
        let nvml = Nvml::init()
            .map_err(|e| Error::Cuda(format!("NVML (libnvidia-ml.so) is not usable: {e}")))?;
        let nv = |what: &str, e: nvml_wrapper::error::NvmlError| {
            Error::Cuda(format!("NVML {what}: {e}"))
        };
        let count = nvml.device_count().map_err(|e| nv("device count", e))?;
        let mut gpus = Vec::new();
        let mut devices = Vec::new();
        for i in 0..count {
            let d = nvml.device_by_index(i).map_err(|e| nv("device", e))?;
            let pci = d.pci_info().map_err(|e| nv("PCI info", e))?;
            gpus.push(Gpu {
                index: i as usize,
                name: d.name().unwrap_or_else(|_| "unknown".into()),
                uuid: d.uuid().unwrap_or_default(),
                pci_bus_id: pci.bus_id.clone(),
                numa_node: d
                    .numa_node_id()
                    .ok()
                    .or_else(|| numa_from_sysfs(&pci.bus_id)),
                pcie_gen: d.max_pcie_link_gen().ok(),
                pcie_width: d.max_pcie_link_width().ok(),
                compute_capability: d
                    .cuda_compute_capability()
                    .ok()
                    .map(|c| format!("{}.{}", c.major, c.minor)),
                memory_bytes: d.memory_info().map(|m| m.total).unwrap_or(0),
                pcie: super::pcie_tree::place(std::path::Path::new("/sys"), &pci.bus_id),
            });
            devices.push(d);
        }
        let mut links = Vec::new();
        for a in 0..devices.len() {
            for b in a + 1..devices.len() {
                let (da, db) = (&devices[a], &devices[b]);
                let cap = |index| matches!(da.p2p_status(db, index), Ok(P2pStatus::Ok));
                let nvlink = cap(P2pCapabilitiesIndex::NvLink);
                let path = if nvlink {
                    PathClass::Nvlink
                } else {
                    let other = nvml
                        .device_by_index(b as u32)
                        .map_err(|e| nv("device", e))?;
                    match da.topology_common_ancestor(other) {
                        Ok(TopologyLevel::Internal) | Ok(TopologyLevel::Single) => {
                            PathClass::SameSwitch
                        }
                        Ok(TopologyLevel::Multiple) => PathClass::MultipleSwitches,
                        Ok(TopologyLevel::HostBridge) => PathClass::HostBridge,
                        Ok(TopologyLevel::Node) => PathClass::SameNumaNode,
                        _ => PathClass::CrossNuma,
                    }
                };
                links.push(Link {
                    a,
                    b,
                    path,
                    p2p_read: cap(P2pCapabilitiesIndex::Read),
                    p2p_write: cap(P2pCapabilitiesIndex::Write),
                    nvlink,
                    atomics: cap(P2pCapabilitiesIndex::Atomics),
                });
            }
        }
        let cuda = nvml
            .sys_cuda_driver_version()
            .ok()
            .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10));
        Ok(Topology {
            description: format!("detected on {}", crate::sys::host_name()),
            driver_version: nvml.sys_driver_version().ok(),
            cuda_version: cuda,
            nccl_version: crate::backend::nccl::Nccl::load()
                .ok()
                .map(|n| n.version_string()),
            gpus,
            links,
            measured: None,
        })
    }

    fn numa_from_sysfs(bus_id: &str) -> Option<u32> {
        let id = bus_id.to_ascii_lowercase();
        let short = id.get(id.len().saturating_sub(12)..)?;
        let text =
            std::fs::read_to_string(format!("/sys/bus/pci/devices/{short}/numa_node")).ok()?;
        text.trim()
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= 0)
            .map(|n| n as u32)
    }
}

pub mod pcie_tree {
    //! A GPU's place in the PCIe tree, read from sysfs (`/sys`, or a copy of it for tests):
    //! `bus/pci/devices/BDF` links to `devices/pciDDDD:BB/ROOT_PORT/[SWITCH_UP/SWITCH_DOWN/]...
    //! /BDF`; the device's `numa_node`, the CPUs of that node (`devices/system/node/nodeN/
    //! cpulist`) and their package (`devices/system/cpu/cpuK/topology/physical_package_id`)
    //! give its socket. Between the root port and the GPU, bridges come in pairs, a switch's
    //! upstream port and one of its downstream ports; the upstream ports name the switches.

    use std::path::{Path, PathBuf};

    use crate::topology::PciePlace;

    /// sysfs's name of an NVML bus id: `00000000:18:00.0` is `0000:18:00.0`.
    pub fn sysfs_bus_id(bus_id: &str) -> Option<String> {
        let id = bus_id.trim().to_ascii_lowercase();
        let (domain, rest) = id.split_once(':')?;
        let domain = u32::from_str_radix(domain, 16).ok()?;
        Some(format!("{domain:04x}:{rest}"))
    }

    fn read(path: &Path) -> Option<String> {
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_owned())
    }

    /// The first CPU of a cpulist (`0-15,64-79` -> 0).
    fn first_cpu(list: &str) -> Option<u32> {
        list.split([',', '-']).next()?.trim().parse().ok()
    }

    fn package_of_cpu(sys: &Path, cpu: u32) -> Option<u32> {
        read(&sys.join(format!(
            "devices/system/cpu/cpu{cpu}/topology/physical_package_id"
        )))?
        .parse()
        .ok()
    }

    /// The socket of NUMA node `node`; with no node (a machine without NUMA), the one package
    /// every CPU is on, if they all are.
    fn socket(sys: &Path, node: Option<u32>) -> Option<u32> {
        if let Some(node) = node {
            let cpus = read(&sys.join(format!("devices/system/node/node{node}/cpulist")))?;
            return package_of_cpu(sys, first_cpu(&cpus)?);
        }
        let mut packages = std::fs::read_dir(sys.join("devices/system/cpu"))
            .ok()?
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                let cpu: u32 = name.strip_prefix("cpu")?.parse().ok()?;
                package_of_cpu(sys, cpu)
            })
            .collect::<Vec<_>>();
        packages.sort_unstable();
        packages.dedup();
        (packages.len() == 1).then(|| packages[0])
    }

    /// Where the GPU with NVML bus id `bus_id` sits, read from the sysfs at `sys`; `None`
    /// where the device is not there.
    pub fn place(sys: &Path, bus_id: &str) -> Option<PciePlace> {
        let bdf = sysfs_bus_id(bus_id)?;
        let device: PathBuf = std::fs::canonicalize(sys.join("bus/pci/devices").join(&bdf)).ok()?;
        let parts: Vec<String> = device
            .components()
            .filter_map(|c| c.as_os_str().to_str().map(str::to_owned))
            .collect();
        let host = parts
            .iter()
            .position(|p| p.starts_with("pci") && p.contains(':'))?;
        let root_complex = parts[host].strip_prefix("pci").map(str::to_owned);
        // The bridges between the host bridge and the device: the root port, then pairs.
        let chain = &parts[host + 1..];
        let (root_port, bridges) = match chain {
            [] | [_] => (None, &chain[..0]),
            [port, rest @ ..] => (Some(port.clone()), &rest[..rest.len() - 1]),
        };
        let switches = bridges.chunks(2).map(|pair| pair[0].clone()).collect();
        let node = read(&device.join("numa_node"))
            .and_then(|n| n.parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok());
        Some(PciePlace {
            switches,
            root_port,
            root_complex,
            socket: socket(sys, node),
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// A sysfs with two sockets (nodes 0 and 1, CPUs 0-3 and 4-7): GPU 0000:43:00.0
        /// under a switch on root port 40:01.1 of root complex 0000:40, node 0; GPU
        /// 0000:c1:00.0 directly on root port c0:03.1, node 1; GPU 0000:44:00.0 under the
        /// same switch as the first.
        fn fake_sysfs() -> PathBuf {
            let root = std::env::temp_dir().join(format!(
                "tpar-sysfs-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos()
            ));
            let dev = |path: &str, node: i32| {
                let d = root.join("devices").join(path);
                std::fs::create_dir_all(&d).unwrap();
                std::fs::write(d.join("numa_node"), format!("{node}\n")).unwrap();
                let bdf = path.rsplit('/').next().unwrap();
                let link_dir = root.join("bus/pci/devices");
                std::fs::create_dir_all(&link_dir).unwrap();
                std::os::unix::fs::symlink(
                    Path::new("../../../devices").join(path),
                    link_dir.join(bdf),
                )
                .unwrap();
            };
            dev(
                "pci0000:40/0000:40:01.1/0000:41:00.0/0000:42:00.0/0000:43:00.0",
                0,
            );
            dev(
                "pci0000:40/0000:40:01.1/0000:41:00.0/0000:42:01.0/0000:44:00.0",
                0,
            );
            dev("pci0000:c0/0000:c0:03.1/0000:c1:00.0", 1);
            for (node, cpus) in [(0, "0-3"), (1, "4-7")] {
                let d = root.join(format!("devices/system/node/node{node}"));
                std::fs::create_dir_all(&d).unwrap();
                std::fs::write(d.join("cpulist"), format!("{cpus}\n")).unwrap();
            }
            for cpu in 0..8 {
                let d = root.join(format!("devices/system/cpu/cpu{cpu}/topology"));
                std::fs::create_dir_all(&d).unwrap();
                std::fs::write(d.join("physical_package_id"), format!("{}\n", cpu / 4)).unwrap();
            }
            root
        }

        #[test]
        fn switches_root_ports_root_complexes_and_sockets_are_read_from_sysfs() {
            let sys = fake_sysfs();
            let a = place(&sys, "00000000:43:00.0").unwrap();
            assert_eq!(a.switches, vec!["0000:41:00.0".to_owned()]);
            assert_eq!(a.root_port.as_deref(), Some("0000:40:01.1"));
            assert_eq!(a.root_complex.as_deref(), Some("0000:40"));
            assert_eq!(a.socket, Some(0));
            let b = place(&sys, "00000000:44:00.0").unwrap();
            assert_eq!(b.switches, a.switches, "one switch, two downstream ports");
            let c = place(&sys, "00000000:C1:00.0").unwrap();
            assert!(c.switches.is_empty());
            assert_eq!(c.root_port.as_deref(), Some("0000:c0:03.1"));
            assert_eq!(c.root_complex.as_deref(), Some("0000:c0"));
            assert_eq!(c.socket, Some(1));
            assert_eq!(place(&sys, "00000000:99:00.0"), None);
            // No NUMA node (-1): the socket is the one package every CPU is on, if one.
            std::fs::write(
                sys.join("devices/pci0000:c0/0000:c0:03.1/0000:c1:00.0/numa_node"),
                "-1\n",
            )
            .unwrap();
            assert_eq!(place(&sys, "00000000:c1:00.0").unwrap().socket, None);
            for cpu in 4..8 {
                std::fs::write(
                    sys.join(format!(
                        "devices/system/cpu/cpu{cpu}/topology/physical_package_id"
                    )),
                    "0\n",
                )
                .unwrap();
            }
            assert_eq!(place(&sys, "00000000:c1:00.0").unwrap().socket, Some(0));
            std::fs::remove_dir_all(&sys).ok();
        }

        #[test]
        fn nvml_bus_ids_become_sysfs_names() {
            assert_eq!(
                sysfs_bus_id("00000000:18:00.0").as_deref(),
                Some("0000:18:00.0")
            );
            assert_eq!(
                sysfs_bus_id("0001:C1:00.0").as_deref(),
                Some("0001:c1:00.0")
            );
            assert_eq!(sysfs_bus_id("garbage"), None);
        }
    }
}
