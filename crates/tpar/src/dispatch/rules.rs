//! The machine as the dispatcher classifies it: its class ([`Class`], the topology's
//! [`MachineClass`](crate::topology::MachineClass)) for the ranks of a request, and the pairs
//! of distinct GPUs those ranks use (what eligibility checks). The choice itself is the fabric
//! model's ([`super::fabric`]), which replaced the per-class ladders of built-in thresholds.

pub use crate::topology::MachineClass as Class;
use crate::topology::Topology;

/// The class of the machine `world_size` ranks (placed round-robin) run on.
pub fn classify(topology: &Topology, world_size: usize) -> Class {
    topology.class(world_size)
}

pub(super) fn distinct_pairs(topology: &Topology, world_size: usize) -> Vec<(usize, usize)> {
    let mut gpus = topology.placement(world_size);
    gpus.sort_unstable();
    gpus.dedup();
    let mut pairs = Vec::new();
    for (i, a) in gpus.iter().enumerate() {
        for b in &gpus[i + 1..] {
            pairs.push((*a, *b));
        }
    }
    pairs
}
