//! Reads the machine this process runs on into a [`Topology`]: NVML for the GPUs and the links
//! between them, the CUDA driver for which GPUs this process sees (and how CUDA numbers them),
//! NCCL for its version. The backends measure; [`crate::topology`] only holds what they found,
//! so it can be loaded from a file and planned for on another machine.

use crate::error::Result;
use crate::topology::{Gpu, Link, PathClass, Topology};

impl Topology {
    /// Reads the machine through NVML. Errors (no driver, no NVML) say why. Where the CUDA
    /// driver loads, only the GPUs this process sees are kept, numbered as CUDA numbers them
    /// (NVML ignores CUDA_VISIBLE_DEVICES: GPU 0 to CUDA may be NVML's GPU 2).
    pub fn detect() -> Result<Topology> {
        let machine = detect::detect()?;
        Ok(match crate::backend::cuda::driver::visible_gpu_uuids() {
            Ok(uuids) => machine.restricted_to(&uuids),
            Err(_) => machine,
        })
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
                    })
                    .collect(),
                links,
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
