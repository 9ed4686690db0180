//! What tpar knows about the GPUs of a machine: each GPU, and for each pair the PCIe path
//! between them and whether peer-to-peer reads, writes, NVLink and atomics work. Read from
//! NVML (loaded at run time) on a real machine, or from a JSON file that describes one, so that
//! a machine can be planned for elsewhere (`tpar doctor --topology FILE`). Fixtures for common
//! inference servers are in `crates/tpar/fixtures/topologies/`.
//!
//! Where it was read (sysfs), each GPU also carries its place in the host's PCIe tree
//! ([`PciePlace`]: the switches above it, its root port, root complex and CPU socket); a file
//! may also carry figures measured on the machine it describes ([`Measured`]). Both are
//! optional, so files written before they existed still load. [`class`] turns either (or, where
//! they are missing, the path class of each pair) into the machine's class and its islands.

pub mod class;

pub use class::{Location, MachineClass};

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::algorithm::Choice;
use crate::error::{Error, Result};

/// How two GPUs are connected, nearest first (the levels of `nvidia-smi topo -m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PathClass {
    /// NVLink or NVSwitch (`NV#`).
    Nvlink,
    /// One PCIe switch (`PIX`).
    SameSwitch,
    /// Several PCIe switches, no host bridge (`PXB`).
    MultipleSwitches,
    /// Through one PCIe host bridge (`PHB`).
    HostBridge,
    /// Several host bridges of one NUMA node (`NODE`).
    SameNumaNode,
    /// Across NUMA nodes / CPU sockets (`SYS`).
    CrossNuma,
}

impl PathClass {
    /// The label `nvidia-smi topo -m` uses.
    pub fn label(self) -> &'static str {
        match self {
            PathClass::Nvlink => "NV",
            PathClass::SameSwitch => "PIX",
            PathClass::MultipleSwitches => "PXB",
            PathClass::HostBridge => "PHB",
            PathClass::SameNumaNode => "NODE",
            PathClass::CrossNuma => "SYS",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    pub index: usize,
    pub name: String,
    pub uuid: String,
    pub pci_bus_id: String,
    pub numa_node: Option<u32>,
    pub pcie_gen: Option<u32>,
    pub pcie_width: Option<u32>,
    /// "9.0", "12.0", ...
    pub compute_capability: Option<String>,
    pub memory_bytes: u64,
    /// Where the GPU sits in the host's PCIe tree, where that was read (sysfs); `None` in files
    /// written before tpar read it, and where sysfs could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie: Option<PciePlace>,
}

impl Gpu {
    /// The oldest compute capability tpar's kernels run on (the loader refuses older GPUs).
    pub const MIN_COMPUTE_MAJOR: u32 = 8;

    /// Whether this GPU is older than tpar's kernels need (false where its capability is not
    /// given or cannot be read: only a known old GPU is refused ahead of the loader).
    pub fn too_old_for_tpar(&self) -> bool {
        self.compute_capability
            .as_deref()
            .and_then(|c| c.split('.').next()?.trim().parse::<u32>().ok())
            .is_some_and(|major| major < Gpu::MIN_COMPUTE_MAJOR)
    }
}

/// A GPU's place in the host's PCIe tree, read from sysfs (`/sys/bus/pci/devices/BDF`: the
/// chain of bridges above it, its `numa_node`, the socket of that node's CPUs).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciePlace {
    /// The upstream ports of the PCIe switches between the root port and the GPU, the one
    /// nearest the CPU first (empty: the GPU hangs from a root port directly).
    #[serde(default)]
    pub switches: Vec<String>,
    /// The CPU root port the GPU's branch hangs from (a bus id).
    #[serde(default)]
    pub root_port: Option<String>,
    /// The root complex (host bridge) above that root port: `0000:40` for `pci0000:40`.
    #[serde(default)]
    pub root_complex: Option<String>,
    /// The CPU socket (physical package) of the GPU's NUMA node.
    #[serde(default)]
    pub socket: Option<u32>,
}

/// Peer bandwidths that show whether posted writes collapse when one source fans out to
/// several root complexes (pcie-published.md, table A): one GPU to one peer, and one GPU (or
/// the GPUs of one switch) to peers behind two or more root complexes at once. Measured by
/// `tpar doctor`, or published for a machine a file describes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fanout {
    /// One GPU writing into one peer's memory, alone, GB/s.
    pub pair_write_gbps: f64,
    /// One GPU reading one peer's memory, alone, GB/s.
    pub pair_read_gbps: f64,
    /// The same source writing to peers behind two or more root complexes at once, in all,
    /// GB/s.
    pub fanout_write_gbps: f64,
    /// The same source reading from them at once, in all, GB/s.
    pub fanout_read_gbps: f64,
}

impl Fanout {
    /// How many times slower writes get when they fan out (1: no collapse; table A: 3.9).
    pub fn write_collapse(&self) -> f64 {
        self.pair_write_gbps / self.fanout_write_gbps.max(1e-9)
    }

    /// The same for reads (table A: about 1: reads do not collapse).
    pub fn read_collapse(&self) -> f64 {
        self.pair_read_gbps / self.fanout_read_gbps.max(1e-9)
    }
}

/// Figures measured on the machine a topology file describes (published reports for the
/// fixtures), which the fabric model takes instead of its defaults.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// Where the figures come from (a report, a command and its date).
    pub source: String,
    /// Peer writes and reads alone and fanned out over root complexes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fanout: Option<Fanout>,
    /// One peer-to-peer copy alone, GB/s, where it differs from the PCIe generation's usual.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_gbps: Option<f64>,
    /// The link between the CPU sockets, per direction, in all, GB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket_link_gbps: Option<f64>,
}

/// The connection between GPUs `a` and `b` (a < b); the same both ways.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub a: usize,
    pub b: usize,
    pub path: PathClass,
    pub p2p_read: bool,
    pub p2p_write: bool,
    pub nvlink: bool,
    pub atomics: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// A sentence a person wrote (fixtures) or "detected on HOST".
    pub description: String,
    pub driver_version: Option<String>,
    pub cuda_version: Option<String>,
    /// `None` when no NCCL library could be loaded.
    pub nccl_version: Option<String>,
    pub gpus: Vec<Gpu>,
    pub links: Vec<Link>,
    /// Figures measured on the machine described (fixtures: published reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<Measured>,
}

/// The most GPUs a described machine may have: far beyond any one host (16 today), and a
/// clear limit instead of minutes of planning over every pair.
pub const MAX_GPUS: usize = 128;

impl Topology {
    /// A topology from its JSON: a description (the fixtures') or a `tpar doctor --json`
    /// report, which holds the machine it examined under `topology`.
    pub fn from_json(text: &str) -> Result<Topology> {
        // Count the GPUs before building every link: a description of thousands of GPUs (half a
        // million links per thousand) is refused in the time it takes to skim it.
        #[derive(Deserialize)]
        struct Count {
            gpus: Vec<serde::de::IgnoredAny>,
        }
        #[derive(Deserialize)]
        struct DoctorReport<T> {
            topology: T,
        }
        let in_report = serde_json::from_str::<DoctorReport<Count>>(text);
        let count = match &in_report {
            Ok(report) => Some(report.topology.gpus.len()),
            Err(_) => serde_json::from_str::<Count>(text)
                .ok()
                .map(|c| c.gpus.len()),
        };
        if let Some(n) = count.filter(|&n| n > MAX_GPUS) {
            return Err(Error::InvalidArgument(format!(
                "the topology has {n} GPUs; tpar plans for one host of at most {MAX_GPUS}"
            )));
        }
        let parsed = if in_report.is_ok() {
            serde_json::from_str::<DoctorReport<Topology>>(text).map(|r| r.topology)
        } else {
            serde_json::from_str(text)
        };
        let mut topology: Topology =
            parsed.map_err(|e| Error::InvalidArgument(format!("not a tpar topology file: {e}")))?;
        topology.validate()?;
        // Sorted by pair, so that `link` finds one by binary search (doctor asks for every
        // pair: with a linear search 1000 GPUs took minutes).
        topology.links.sort_by_key(|l| (l.a, l.b));
        Ok(topology)
    }

    pub fn load(path: &Path) -> Result<Topology> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            what: "cannot read topology file",
            path: path.to_owned(),
            source,
        })?;
        Topology::from_json(&text).map_err(|e| match e {
            Error::InvalidArgument(why) => {
                Error::InvalidArgument(format!("{}: {why}", path.display()))
            }
            other => other,
        })
    }

    /// The shipped fixture called `name` (a file stem of [`FIXTURES`]).
    pub fn fixture(name: &str) -> Option<Topology> {
        let (_, text) = FIXTURES.iter().find(|f| f.0 == name)?;
        Some(Topology::from_json(text).expect("shipped fixtures load"))
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("topologies serialise")
    }

    /// Every GPU is indexed 0..n in order and every pair has exactly one link; at least one
    /// GPU, at most [`MAX_GPUS`]. Linear in the number of links.
    pub fn validate(&self) -> Result<()> {
        let n = self.gpus.len();
        if n == 0 {
            return Err(Error::InvalidArgument(
                "the topology has no GPUs; describe at least one (or run `tpar doctor` without --topology on this machine)".into(),
            ));
        }
        if n > MAX_GPUS {
            return Err(Error::InvalidArgument(format!(
                "the topology has {n} GPUs; tpar plans for one host of at most {MAX_GPUS}"
            )));
        }
        for (i, g) in self.gpus.iter().enumerate() {
            if g.index != i {
                return Err(Error::InvalidArgument(format!(
                    "GPU at position {i} says index {}",
                    g.index
                )));
            }
        }
        if let Some(l) = self.links.iter().find(|l| l.a >= l.b || l.b >= n) {
            return Err(Error::InvalidArgument(format!(
                "link {}-{} names no pair of GPUs 0..{n} with a < b",
                l.a, l.b
            )));
        }
        let mut pairs: Vec<(usize, usize)> = self.links.iter().map(|l| (l.a, l.b)).collect();
        pairs.sort_unstable();
        let mut next = pairs.iter().copied().peekable();
        for a in 0..n {
            for b in a + 1..n {
                let mut count = 0;
                while next.next_if_eq(&(a, b)).is_some() {
                    count += 1;
                }
                if count != 1 {
                    return Err(Error::InvalidArgument(format!(
                        "GPUs {a} and {b} have {count} links described; each pair needs exactly one (with a < b)"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The link between two different GPUs.
    pub fn link(&self, a: usize, b: usize) -> Option<&Link> {
        let (a, b) = (a.min(b), a.max(b));
        match self.links.binary_search_by_key(&(a, b), |l| (l.a, l.b)) {
            Ok(i) => Some(&self.links[i]),
            // Not sorted (built in code, not loaded): look at every link.
            Err(_) => self.links.iter().find(|l| l.a == a && l.b == b),
        }
    }

    /// The GPU each of `world_size` ranks runs on: round-robin, as the backends place them.
    pub fn placement(&self, world_size: usize) -> Vec<usize> {
        (0..world_size)
            .map(|r| r % self.gpus.len().max(1))
            .collect()
    }

    /// Names this machine's GPUs, driver and links (not the description), for keying the
    /// tuning table measured on it.
    pub fn fingerprint(&self) -> String {
        let mut text = format!("{:?}|", self.driver_version);
        for g in &self.gpus {
            text.push_str(&format!(
                "{}|{}|{:?}|",
                g.name, g.uuid, g.compute_capability
            ));
        }
        for l in &self.links {
            text.push_str(&format!(
                "{}-{}:{:?}{}{}{}|",
                l.a, l.b, l.path, l.p2p_read, l.p2p_write, l.nvlink
            ));
        }
        let hash = crate::hash::fnv1a(text.bytes());
        format!("{hash:016x}")
    }

    /// The GPUs with these UUIDs (in this order, renumbered from 0) and the links between
    /// them. UUIDs compare as hex digits (NVML writes "GPU-" and dashes, CUDA raw bytes). If
    /// one is not found, the topology is kept whole: a partial one would misplace links.
    pub fn restricted_to(self, uuids: &[String]) -> Topology {
        let key = |u: &str| {
            u.trim_start_matches("GPU-")
                .chars()
                .filter(char::is_ascii_hexdigit)
                .collect::<String>()
                .to_ascii_lowercase()
        };
        let Some(picked) = uuids
            .iter()
            .map(|u| {
                let wanted = key(u);
                (!wanted.is_empty())
                    .then(|| self.gpus.iter().position(|g| key(&g.uuid) == wanted))
                    .flatten()
            })
            .collect::<Option<Vec<usize>>>()
        else {
            return self;
        };
        if picked.iter().copied().eq(0..self.gpus.len()) {
            return self;
        }
        let gpus = picked
            .iter()
            .enumerate()
            .map(|(index, &old)| Gpu {
                index,
                ..self.gpus[old].clone()
            })
            .collect();
        let new_index = |old: usize| picked.iter().position(|&p| p == old);
        let links = self
            .links
            .iter()
            .filter_map(|l| {
                let (a, b) = (new_index(l.a)?, new_index(l.b)?);
                Some(Link {
                    a: a.min(b),
                    b: a.max(b),
                    ..l.clone()
                })
            })
            .collect();
        let physical: Vec<String> = picked.iter().map(usize::to_string).collect();
        Topology {
            description: format!(
                "{}; this process sees GPUs {} of {} (CUDA_VISIBLE_DEVICES), numbered from 0 here",
                self.description,
                physical.join(", "),
                self.gpus.len()
            ),
            gpus,
            links,
            ..self
        }
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} GPU(s): {}", self.gpus.len(), self.description)
    }
}

/// What checks and measurements found on this machine: choices that failed a check (with
/// why), the link bandwidth measured with every link busy, and whether writes collapse when
/// they fan out over root complexes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Findings {
    /// Paths that cannot run here, with the reason (a failed self-test, no peer access in this
    /// group): never planned, and an error when forced.
    pub failed: Vec<(Choice, String)>,
    /// Peer-write and peer-read bandwidth with every link busy at once, GB/s.
    pub push_gbps: Option<f64>,
    pub pull_gbps: Option<f64>,
    /// One GPU's writes and reads to one peer and fanned out over root complexes (`tpar
    /// doctor`); the fabric model takes its collapse from here.
    #[serde(default)]
    pub fanout: Option<Fanout>,
}

/// The fixtures shipped with tpar: (file stem, JSON).
pub const FIXTURES: [(&str, &str); 10] = [
    (
        "8x-h200-nvswitch",
        include_str!("../fixtures/topologies/8x-h200-nvswitch.json"),
    ),
    (
        "8x-rtx-pro-6000-pcie-2switch",
        include_str!("../fixtures/topologies/8x-rtx-pro-6000-pcie-2switch.json"),
    ),
    (
        "4x-rtx-4090-no-p2p",
        include_str!("../fixtures/topologies/4x-rtx-4090-no-p2p.json"),
    ),
    (
        "8x-l40s-2numa",
        include_str!("../fixtures/topologies/8x-l40s-2numa.json"),
    ),
    (
        "8x-a800-2islands",
        include_str!("../fixtures/topologies/8x-a800-2islands.json"),
    ),
    // The machines of the published PCIe measurements (pcie-published.md tables A-E), written
    // by fixtures/topologies/make_published_fixtures.py with what each report measured.
    (
        "16x-rtx-pro-6000-4switch",
        include_str!("../fixtures/topologies/16x-rtx-pro-6000-4switch.json"),
    ),
    (
        "8x-rtx-pro-6000-switch-pairs",
        include_str!("../fixtures/topologies/8x-rtx-pro-6000-switch-pairs.json"),
    ),
    (
        "4x-rtx-pro-6000-rootcomplex",
        include_str!("../fixtures/topologies/4x-rtx-pro-6000-rootcomplex.json"),
    ),
    (
        "8x-rtx-pro-6000-2socket-broadcom",
        include_str!("../fixtures/topologies/8x-rtx-pro-6000-2socket-broadcom.json"),
    ),
    (
        "4x-v100-1plx",
        include_str!("../fixtures/topologies/4x-v100-1plx.json"),
    ),
];

#[cfg(test)]
mod tests {

    fn uniform(n: usize) -> String {
        let gpu = |i: usize| {
            format!(
                r#"{{"index":{i},"name":"G","uuid":"GPU-{i}","pci_bus_id":"0000:{i:02x}:00.0","numa_node":0,"pcie_gen":5,"pcie_width":16,"compute_capability":"9.0","memory_bytes":1}}"#
            )
        };
        let mut links = Vec::new();
        for a in 0..n {
            for b in a + 1..n {
                links.push(format!(
                    r#"{{"a":{a},"b":{b},"path":"same-switch","p2p_read":true,"p2p_write":true,"nvlink":false,"atomics":false}}"#
                ));
            }
        }
        let gpus: Vec<String> = (0..n).map(gpu).collect();
        format!(
            r#"{{"description":"test","driver_version":null,"cuda_version":null,"nccl_version":null,"gpus":[{}],"links":[{}]}}"#,
            gpus.join(","),
            links.join(",")
        )
    }

    #[test]
    fn no_gpus_and_too_many_are_clear_errors_and_the_limit_loads_fast() {
        let err = Topology::from_json(&uniform(0)).unwrap_err().to_string();
        assert!(err.contains("no GPUs"), "{err}");
        let err = Topology::from_json(&uniform(MAX_GPUS + 1))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("at most {MAX_GPUS}")), "{err}");
        let in_report = format!(r#"{{"topology":{}}}"#, uniform(MAX_GPUS + 1));
        let err = Topology::from_json(&in_report).unwrap_err().to_string();
        assert!(err.contains(&format!("at most {MAX_GPUS}")), "{err}");
        // Validation and lookups were n^4 together (200 GPUs: 8.6 s in doctor).
        let start = std::time::Instant::now();
        let t = Topology::from_json(&uniform(MAX_GPUS)).unwrap();
        for a in 0..MAX_GPUS {
            for b in 0..MAX_GPUS {
                assert_eq!(t.link(a, b).is_some(), a != b);
            }
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        let mut missing = Topology::from_json(&uniform(3)).unwrap();
        missing.links.pop();
        assert!(missing
            .validate()
            .unwrap_err()
            .to_string()
            .contains("GPUs 1 and 2 have 0 links"));
    }

    use super::*;

    #[test]
    fn every_fixture_loads_validates_and_round_trips() {
        for (name, text) in FIXTURES {
            let t = Topology::from_json(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!t.gpus.is_empty(), "{name}");
            assert_eq!(Topology::from_json(&t.to_json()).unwrap(), t, "{name}");
            // As `tpar doctor --json` holds it, beside fields of the same names (its link
            // measurements are `links`, null without two GPUs).
            let report = format!(r#"{{"links":null,"ok":true,"topology":{}}}"#, t.to_json());
            assert_eq!(Topology::from_json(&report).unwrap(), t, "{name}");
        }
    }

    #[test]
    fn the_gpus_cuda_sees_are_kept_in_cudas_order_with_their_links() {
        let mut l40s =
            Topology::from_json(FIXTURES.iter().find(|f| f.0 == "8x-l40s-2numa").unwrap().1)
                .unwrap();
        for g in &mut l40s.gpus {
            g.uuid = format!("GPU-{:08x}-1111-2222-3333-444455556666", g.index);
        }
        let raw = |i: u32| format!("{i:08x}111122223333444455556666");
        // CUDA_VISIBLE_DEVICES=5,1: CUDA's GPU 0 is NVML's 5, and they sit on different nodes.
        let seen = l40s.clone().restricted_to(&[raw(5), raw(1)]);
        assert_eq!(seen.gpus.len(), 2);
        assert_eq!(seen.gpus[0].uuid, l40s.gpus[5].uuid);
        assert_eq!((seen.gpus[0].index, seen.gpus[1].index), (0, 1));
        assert_eq!(seen.links.len(), 1);
        let link = seen.link(0, 1).unwrap();
        assert_eq!(link.path, l40s.link(1, 5).unwrap().path);
        assert_eq!(link.path, PathClass::CrossNuma);
        assert!(
            seen.description.contains("sees GPUs 5, 1 of 8"),
            "{}",
            seen.description
        );
        // Every GPU in NVML's order: nothing changes. An unknown UUID: kept whole, not guessed.
        let all: Vec<String> = (0..8).map(raw).collect();
        assert_eq!(l40s.clone().restricted_to(&all), l40s);
        assert_eq!(l40s.clone().restricted_to(&[raw(1), raw(99)]), l40s);
        assert_eq!(l40s.clone().restricted_to(&[String::new()]), l40s);
    }

    #[test]
    fn fixtures_describe_what_their_names_say() {
        let load =
            |n: &str| Topology::from_json(FIXTURES.iter().find(|f| f.0 == n).unwrap().1).unwrap();
        let h200 = load("8x-h200-nvswitch");
        assert!(h200
            .links
            .iter()
            .all(|l| l.nvlink && l.path == PathClass::Nvlink));
        let rtx = load("4x-rtx-4090-no-p2p");
        assert!(rtx.links.iter().all(|l| !l.p2p_read && !l.p2p_write));
        let l40s = load("8x-l40s-2numa");
        assert!(l40s.link(0, 3).unwrap().p2p_write && !l40s.link(3, 4).unwrap().p2p_write);
        assert_eq!(l40s.link(5, 2).unwrap().path, PathClass::CrossNuma);
        let pro = load("8x-rtx-pro-6000-pcie-2switch");
        assert_eq!(pro.gpus.len(), 8);
        assert_eq!(pro.link(0, 1).unwrap().path, PathClass::SameSwitch);
        assert_eq!(pro.link(0, 7).unwrap().path, PathClass::CrossNuma);
    }

    #[test]
    fn a_file_missing_a_pair_is_refused_with_the_pair() {
        let mut t = Topology::from_json(FIXTURES[2].1).unwrap();
        t.links.retain(|l| (l.a, l.b) != (1, 2));
        let err = Topology::from_json(&t.to_json()).unwrap_err().to_string();
        assert!(err.contains("GPUs 1 and 2 have 0 links"), "{err}");
        assert!(Topology::from_json("{}")
            .unwrap_err()
            .to_string()
            .contains("not a tpar topology file"));
    }

    #[test]
    fn placement_is_round_robin() {
        let t = Topology::from_json(FIXTURES[2].1).unwrap(); // 4 GPUs
        assert_eq!(t.placement(6), vec![0, 1, 2, 3, 0, 1]);
    }
}
