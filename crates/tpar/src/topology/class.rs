//! What kind of machine a group of GPUs is (its [`MachineClass`]), where each GPU sits in it
//! (a [`Location`]: its switch, root complex and socket), and the islands its ranks form.
//!
//! The places come from the PCIe tree where sysfs was read (every GPU's [`PciePlace`]), else
//! from the path class of each pair (`nvidia-smi topo -m`'s levels): GPUs joined by PIX or PXB
//! share a switch, by PHB a root complex, by NODE a socket; SYS is another socket. The classes
//! are the ones the PCIe algorithms tell apart (pcie-published.md): NVLink, one switch, several
//! switches, root complexes without switches, two (or more) sockets, islands without P2P
//! between them, no P2P. The islands are what the islands algorithms reduce inside:
//! switch groups, sockets, or the groups that reach each other by P2P.
//!
//! [`PciePlace`]: super::PciePlace

use std::fmt;

use serde::Serialize;

use super::{PathClass, Topology};
use crate::algorithm::MAX_RANKS;
use crate::islands::Islands;

/// The kind of machine the GPUs of a group are, for the dispatcher and the fabric model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MachineClass {
    /// Every rank on one GPU.
    OneGpu,
    /// Every pair of GPUs on NVLink (or NVSwitch).
    Nvlink,
    /// Every GPU under one PCIe switch (no root complex on any peer path).
    OneSwitch,
    /// GPUs in groups under several PCIe switches, one socket (FlashInfer's
    /// `pcieswitch-pairs`, and larger groups).
    Switches,
    /// GPUs on the CPU's root ports, no switch shared, one socket (FlashInfer's
    /// `rootcplx-noswitch`).
    RootComplex,
    /// GPUs under two or more CPU sockets, P2P between every pair.
    TwoSockets,
    /// Islands of GPUs with P2P inside and none between (through host memory across).
    IslandsNoP2p,
    /// No P2P between some GPUs, and no islands that have it inside.
    NoP2p,
}

impl MachineClass {
    pub const ALL: [MachineClass; 8] = [
        MachineClass::OneGpu,
        MachineClass::Nvlink,
        MachineClass::OneSwitch,
        MachineClass::Switches,
        MachineClass::RootComplex,
        MachineClass::TwoSockets,
        MachineClass::IslandsNoP2p,
        MachineClass::NoP2p,
    ];

    /// The name in JSON and in `tpar doctor`.
    pub fn name(self) -> &'static str {
        match self {
            MachineClass::OneGpu => "one-gpu",
            MachineClass::Nvlink => "nvlink",
            MachineClass::OneSwitch => "one-switch",
            MachineClass::Switches => "switches",
            MachineClass::RootComplex => "root-complex",
            MachineClass::TwoSockets => "two-sockets",
            MachineClass::IslandsNoP2p => "islands-no-p2p",
            MachineClass::NoP2p => "no-p2p",
        }
    }

    /// The class in a sentence.
    pub fn describe(self) -> &'static str {
        match self {
            MachineClass::OneGpu => "all ranks share one GPU",
            MachineClass::Nvlink => "every pair of GPUs is on NVLink",
            MachineClass::OneSwitch => "PCIe, every GPU under one switch",
            MachineClass::Switches => "PCIe, GPUs in groups under several switches, one socket",
            MachineClass::RootComplex => {
                "PCIe, GPUs on the CPU's root complexes without a shared switch, one socket"
            }
            MachineClass::TwoSockets => "PCIe across CPU sockets, P2P between every pair",
            MachineClass::IslandsNoP2p => {
                "islands of GPUs with P2P inside and none between (across through host memory)"
            }
            MachineClass::NoP2p => "some pair of GPUs has no peer-to-peer access",
        }
    }

    /// Whether peer traffic crosses PCIe (where posted writes may collapse under fan-out).
    pub fn is_pcie(self) -> bool {
        !matches!(self, MachineClass::OneGpu | MachineClass::Nvlink)
    }
}

impl fmt::Display for MachineClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where one GPU sits: the groups it belongs to, numbered from 0 per topology in GPU order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Location {
    /// The top-most PCIe switch above the GPU, if any (GPUs that share it share the switch's
    /// uplink to the CPU).
    pub switch: Option<usize>,
    /// The root complex (host bridge) the GPU's traffic to the CPU goes through.
    pub root_complex: usize,
    /// The CPU socket.
    pub socket: usize,
}

/// Groups numbered by first appearance: `same(a, b)` joins GPUs a and b.
fn groups(n: usize, same: impl Fn(usize, usize) -> bool) -> Vec<usize> {
    let mut parent: Vec<usize> = (0..n).collect();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    for a in 0..n {
        for b in a + 1..n {
            if same(a, b) {
                let (ra, rb) = (root(&mut parent, a), root(&mut parent, b));
                parent[ra.max(rb)] = ra.min(rb);
            }
        }
    }
    let mut labels: Vec<usize> = Vec::new();
    (0..n)
        .map(|i| {
            let r = root(&mut parent, i);
            match labels.iter().position(|&l| l == r) {
                Some(k) => k,
                None => {
                    labels.push(r);
                    labels.len() - 1
                }
            }
        })
        .collect()
}

/// Numbers the distinct values of `keys` by first appearance.
fn numbered<K: PartialEq>(keys: &[K]) -> Vec<usize> {
    let mut seen: Vec<&K> = Vec::new();
    keys.iter()
        .map(|k| match seen.iter().position(|s| *s == k) {
            Some(i) => i,
            None => {
                seen.push(k);
                seen.len() - 1
            }
        })
        .collect()
}

/// Numbers the distinct present values by first appearance; absent stays absent.
fn number_some<K: PartialEq>(keys: &[Option<K>]) -> Vec<Option<usize>> {
    let present: Vec<&K> = keys.iter().flatten().collect();
    let mut ids = numbered(&present).into_iter();
    keys.iter()
        .map(|k| k.as_ref().and_then(|_| ids.next()))
        .collect()
}

impl Topology {
    /// Whether GPUs `a` and `b` reach each other by peer reads and writes (a GPU reaches
    /// itself).
    pub fn p2p(&self, a: usize, b: usize) -> bool {
        a == b || self.link(a, b).is_some_and(|l| l.p2p_read && l.p2p_write)
    }

    /// Where each GPU sits. From the PCIe tree where every GPU has its root complex and
    /// socket read; else from the path class of each pair (PIX/PXB: one switch, PHB: one root
    /// complex, NODE: one socket) and, for NVLink pairs whose PCIe path is hidden, the NUMA node.
    pub fn locations(&self) -> Vec<Location> {
        let n = self.gpus.len();
        let tree: Option<Vec<(Option<String>, String, u32)>> = self
            .gpus
            .iter()
            .map(|g| {
                let p = g.pcie.as_ref()?;
                Some((
                    p.switches.first().cloned(),
                    p.root_complex.clone()?,
                    p.socket?,
                ))
            })
            .collect();
        if let Some(places) = tree {
            let rcs = numbered(&places.iter().map(|p| &p.1).collect::<Vec<_>>());
            let sockets = numbered(&places.iter().map(|p| p.2).collect::<Vec<_>>());
            let switches = number_some(&places.iter().map(|p| p.0.clone()).collect::<Vec<_>>());
            return (0..n)
                .map(|i| Location {
                    switch: switches[i],
                    root_complex: rcs[i],
                    socket: sockets[i],
                })
                .collect();
        }
        let path = |a: usize, b: usize| self.link(a, b).map(|l| l.path);
        let within = |a: usize, b: usize, widest: PathClass| {
            path(a, b).is_some_and(|p| p != PathClass::Nvlink && p <= widest)
        };
        let switch = groups(n, |a, b| within(a, b, PathClass::MultipleSwitches));
        let rc = groups(n, |a, b| within(a, b, PathClass::HostBridge));
        let socket = groups(n, |a, b| {
            within(a, b, PathClass::SameNumaNode)
                || (path(a, b) == Some(PathClass::Nvlink)
                    && self.gpus[a].numa_node.is_some()
                    && self.gpus[a].numa_node == self.gpus[b].numa_node)
        });
        // From the links alone a switch shows only where two GPUs share it.
        let shared: Vec<Option<usize>> = (0..n)
            .map(|i| (switch.iter().filter(|&&s| s == switch[i]).count() > 1).then_some(switch[i]))
            .collect();
        let switches = number_some(&shared);
        (0..n)
            .map(|i| Location {
                switch: switches[i],
                root_complex: rc[i],
                socket: socket[i],
            })
            .collect()
    }

    /// The class of the machine made of GPUs `gpus` (indices; duplicates ignored).
    pub fn class_of_gpus(&self, gpus: &[usize]) -> MachineClass {
        let mut gpus = gpus.to_vec();
        gpus.sort_unstable();
        gpus.dedup();
        if gpus.len() <= 1 {
            return MachineClass::OneGpu;
        }
        let pairs: Vec<(usize, usize)> = gpus
            .iter()
            .enumerate()
            .flat_map(|(i, &a)| gpus[i + 1..].iter().map(move |&b| (a, b)))
            .collect();
        if pairs
            .iter()
            .all(|&(a, b)| self.link(a, b).is_some_and(|l| l.nvlink))
        {
            return MachineClass::Nvlink;
        }
        if !pairs.iter().all(|&(a, b)| self.p2p(a, b)) {
            return match self.p2p_islands(&gpus) {
                Some(_) => MachineClass::IslandsNoP2p,
                None => MachineClass::NoP2p,
            };
        }
        let places = self.locations();
        let at = |g: usize| places[g];
        let first = at(gpus[0]);
        if gpus.iter().any(|&g| at(g).socket != first.socket) {
            return MachineClass::TwoSockets;
        }
        if first.switch.is_some() && gpus.iter().all(|&g| at(g).switch == first.switch) {
            return MachineClass::OneSwitch;
        }
        let shares_switch = pairs
            .iter()
            .any(|&(a, b)| at(a).switch.is_some() && at(a).switch == at(b).switch);
        if shares_switch {
            MachineClass::Switches
        } else {
            MachineClass::RootComplex
        }
    }

    /// The class of the machine `world_size` ranks run on (placed round-robin).
    pub fn class(&self, world_size: usize) -> MachineClass {
        self.class_of_gpus(&self.placement(world_size))
    }

    /// Where P2P holds inside groups of `gpus` (sorted, distinct) and not between them, the
    /// group of each of `gpus`; `None` when P2P does not split them that way (some group is
    /// not whole inside, or every GPU is alone).
    fn p2p_islands(&self, gpus: &[usize]) -> Option<Vec<usize>> {
        let label = groups(gpus.len(), |i, j| self.p2p(gpus[i], gpus[j]));
        for i in 0..gpus.len() {
            for j in i + 1..gpus.len() {
                if label[i] == label[j] && !self.p2p(gpus[i], gpus[j]) {
                    return None;
                }
            }
        }
        let count = label.iter().max().map_or(0, |m| m + 1);
        (count > 1 && count < gpus.len()).then_some(label)
    }

    /// The islands of ranks placed on `gpu_of_rank` (rank r on GPU `gpu_of_rank[r]`), as the
    /// islands algorithms use them when the configuration gives none: the P2P groups where
    /// islands have no P2P between them, the sockets across sockets, the switches of a
    /// one-socket machine with several; one island elsewhere (one GPU, NVLink, one switch,
    /// root complexes without switches, no P2P). Ranks sharing a GPU share its island. `None`
    /// above [`MAX_RANKS`] ranks.
    pub fn islands_for_gpus(&self, gpu_of_rank: &[usize]) -> Option<Islands> {
        let n = gpu_of_rank.len();
        if n == 0 || n > MAX_RANKS || gpu_of_rank.iter().any(|&g| g >= self.gpus.len()) {
            return None;
        }
        let mut gpus = gpu_of_rank.to_vec();
        gpus.sort_unstable();
        gpus.dedup();
        let places = self.locations();
        let label_of_gpu: Vec<usize> = match self.class_of_gpus(&gpus) {
            MachineClass::IslandsNoP2p => self.p2p_islands(&gpus).unwrap_or_default(),
            MachineClass::TwoSockets => gpus.iter().map(|&g| places[g].socket).collect(),
            MachineClass::Switches => gpus
                .iter()
                .map(|&g| match places[g].switch {
                    Some(s) => s,
                    // A GPU on a root port alone is an island of its own.
                    None => usize::MAX - g,
                })
                .collect(),
            _ => vec![0; gpus.len()],
        };
        let island_of: Vec<usize> = gpu_of_rank
            .iter()
            .map(|g| {
                let i = gpus.binary_search(g).expect("a GPU of the group");
                label_of_gpu.get(i).copied().unwrap_or(0)
            })
            .collect();
        Islands::from_island_of(&island_of).ok()
    }

    /// The islands of `world_size` ranks placed round-robin ([`Topology::placement`]).
    pub fn islands(&self, world_size: usize) -> Option<Islands> {
        self.islands_for_gpus(&self.placement(world_size))
    }

    /// Whether the islands algorithms' exchange between `islands` must go through host memory:
    /// some pair of ranks in different islands sits on GPUs without P2P between them.
    pub fn exchange_via_host(&self, gpu_of_rank: &[usize], islands: &Islands) -> bool {
        let n = gpu_of_rank.len().min(islands.world_size());
        (0..n).any(|a| {
            (0..n).any(|b| {
                islands.island_of(a) != islands.island_of(b)
                    && !self.p2p(gpu_of_rank[a], gpu_of_rank[b])
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::PciePlace;

    fn fixture(name: &str) -> Topology {
        Topology::fixture(name).unwrap()
    }

    #[test]
    fn the_shipped_fixtures_fall_in_the_classes_their_names_say() {
        for (name, class, islands) in [
            ("8x-h200-nvswitch", MachineClass::Nvlink, "8"),
            (
                "8x-rtx-pro-6000-pcie-2switch",
                MachineClass::TwoSockets,
                "4+4",
            ),
            ("4x-rtx-4090-no-p2p", MachineClass::NoP2p, "4"),
            ("8x-l40s-2numa", MachineClass::IslandsNoP2p, "4+4"),
            ("8x-a800-2islands", MachineClass::IslandsNoP2p, "4+4"),
        ] {
            let t = fixture(name);
            assert_eq!(t.class(8.min(t.gpus.len())), class, "{name}");
            let got = t.islands(8.min(t.gpus.len())).unwrap();
            assert_eq!(got.to_string(), islands, "{name}");
            // One GPU is one GPU whatever the machine.
            assert_eq!(t.class(1), MachineClass::OneGpu, "{name}");
        }
        // The L40S across its NUMA nodes exchanges through host memory; the two-switch RTX
        // PRO 6000 has P2P across its sockets.
        let l40s = fixture("8x-l40s-2numa");
        let placed = l40s.placement(8);
        assert!(l40s.exchange_via_host(&placed, &l40s.islands(8).unwrap()));
        let pro = fixture("8x-rtx-pro-6000-pcie-2switch");
        assert!(!pro.exchange_via_host(&pro.placement(8), &pro.islands(8).unwrap()));
        // Four ranks of the L40S stay on node 0: P2P everywhere, one socket, no switch.
        assert_eq!(l40s.class(4), MachineClass::RootComplex);
        assert_eq!(pro.class(4), MachineClass::OneSwitch);
    }

    #[test]
    fn ranks_sharing_gpus_share_their_gpus_island_and_uneven_islands_come_out_whole() {
        let pro = fixture("8x-rtx-pro-6000-pcie-2switch");
        // 12 ranks on 8 GPUs: ranks 8-11 sit on GPUs 0-3 (socket 0).
        let islands = pro.islands(12).unwrap();
        assert_eq!(islands.members(0).count(), 8);
        assert_eq!(islands.island_of(9), islands.island_of(1));
        // GPUs 0, 1, 2 and 4: three on socket 0, one on socket 1 (3+1).
        let uneven = pro.islands_for_gpus(&[0, 1, 2, 4]).unwrap();
        assert_eq!(uneven.to_string(), "3+1");
        assert!(pro.islands(17).is_none());
        assert!(pro.islands_for_gpus(&[0, 9]).is_none());
    }

    #[test]
    fn the_pcie_tree_when_read_decides_over_the_path_classes() {
        // Eight GPUs on one socket: pairs of GPUs under four switches, two switches per root
        // complex. The links (all PHB, no P2P info beyond) would say root complex only.
        let mut t = fixture("8x-rtx-pro-6000-pcie-2switch");
        for g in &mut t.gpus {
            g.pcie = Some(PciePlace {
                switches: vec![format!("0000:{:02x}:00.0", 0x10 + g.index / 2)],
                root_port: Some(format!("0000:00:0{}.1", g.index / 4)),
                root_complex: Some(format!("0000:{:02x}", 0x40 * (g.index / 4))),
                socket: Some(0),
            });
        }
        let places = t.locations();
        assert_eq!(places[2].switch, Some(1));
        assert_eq!(places[5].root_complex, 1);
        assert_eq!(t.class(8), MachineClass::Switches);
        assert_eq!(t.islands(8).unwrap().to_string(), "2+2+2+2");
        // A GPU whose place could not be read sends the whole machine back to the links.
        t.gpus[3].pcie = None;
        assert_eq!(t.class(8), MachineClass::TwoSockets);
    }

    #[test]
    fn every_class_has_a_name_and_a_sentence() {
        let names: Vec<&str> = MachineClass::ALL.iter().map(|c| c.name()).collect();
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len());
        for c in MachineClass::ALL {
            assert_eq!(
                serde_json::to_string(&c).unwrap(),
                format!("\"{}\"", c.name())
            );
            assert!(c.describe().len() > 10);
        }
    }
}
