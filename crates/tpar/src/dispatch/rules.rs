//! The built-in rules: the kind of machine a request runs on ([`Class`]) and, per class, which
//! choice serves which sizes and why (a ladder of rungs). Thresholds come from measurements
//! (bench/README.md) and published figures; a tuning table measured on the machine overrides
//! them.

use serde::Serialize;

use crate::algorithm::{Algorithm, Choice};
use crate::topology::{Findings, Topology};

/// The kind of machine the ranks of a request run on, for the built-in rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    OneGpu,
    Nvlink,
    PcieP2p,
    NoP2p,
}

impl Class {
    pub(super) fn describe(self) -> &'static str {
        match self {
            Class::OneGpu => "all ranks share one GPU",
            Class::Nvlink => "every pair of GPUs is on NVLink",
            Class::PcieP2p => "PCIe with peer-to-peer between every pair",
            Class::NoP2p => "some pair of GPUs has no peer-to-peer access",
        }
    }
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

pub fn classify(topology: &Topology, world_size: usize) -> Class {
    let pairs = distinct_pairs(topology, world_size);
    let link = |&(a, b): &(usize, usize)| topology.link(a, b);
    if pairs.is_empty() {
        Class::OneGpu
    } else if pairs.iter().all(|p| link(p).is_some_and(|l| l.nvlink)) {
        Class::Nvlink
    } else if pairs
        .iter()
        .all(|p| link(p).is_some_and(|l| l.p2p_write && l.p2p_read))
    {
        Class::PcieP2p
    } else {
        Class::NoP2p
    }
}

pub(super) const KIB: u64 = 1024;
pub(super) const MIB: u64 = 1024 * KIB;

/// One rung of the built-in rules: messages up to `max_bytes` go to `choice`, because `why`.
pub(super) struct Rung {
    pub(super) max_bytes: u64,
    pub(super) choice: Choice,
    pub(super) why: &'static str,
}

const ONE_SHOT_WHY: &str = "one step and no barrier: the lowest latency for small messages";
const TWO_SHOT_WHY: &str = "moves 2(n-1)/n of the message per rank instead of (n-1) copies";
pub(super) const NCCL_WHY: &str =
    "NCCL's pipelined ring/tree runs large messages at link bandwidth";
const NVLINK_NCCL_WHY: &str =
    "over NVLink NCCL was fastest from 1 MiB on 2 and 4 H200s (its copy engines and rings run at link bandwidth)";

/// The built-in rules for a class. Thresholds come from the measurements in bench/README.md
/// and the published figures in the design brief; `tpar tune` replaces them with this
/// machine's own.
pub(super) fn ladder(class: Class, world_size: usize, findings: Option<&Findings>) -> Vec<Rung> {
    use Algorithm::*;
    let many = world_size > 4;
    let push_collapses = findings
        .and_then(|f| Some(f.push_gbps? < 0.5 * f.pull_gbps?))
        .unwrap_or(false);
    let (one_shot, one_shot_why) = if push_collapses {
        (
            Choice::Tpar(OneShotPull),
            "the init probe saw peer writes collapse while reads held, so peers are read (pull)",
        )
    } else {
        (Choice::Tpar(OneShot), ONE_SHOT_WHY)
    };
    let rung = |max_bytes, choice, why| Rung {
        max_bytes,
        choice,
        why,
    };
    match class {
        Class::OneGpu if !many => vec![rung(
            u64::MAX,
            Choice::Tpar(OneShot),
            "with 2 ranks on one GPU one-shot was fastest at every size measured (H200)",
        )],
        // `tpar bench -n 8 --sizes 32K..256K` on one H200 (2026-12-01, 5260727,
        // bench/results/2026-12-01-h200x2-crossover): one-shot 7.53 vs two-shot 8.74 us at
        // 64 KiB, 9.60 vs 8.36 at 80 KiB. (The rung at 32 KiB, from older kernels, sent 40-64
        // KiB to two-shot, 1.2-2.2 us slower.)
        Class::OneGpu => vec![
            rung(64 * KIB, Choice::Tpar(OneShot), ONE_SHOT_WHY),
            rung(
                u64::MAX,
                Choice::Tpar(TwoShot),
                "with 8 ranks on one GPU two-shot overtook one-shot from 80 KiB (H200)",
            ),
        ],
        // Measured on 2 and 4 H200s, one process per GPU (bench/README.md): one-shot led up to
        // 256 KiB at 2 ranks and 64 KiB at 4, two-shot at 256 KiB with 4, NCCL from 1 MiB.
        // 8 ranks are extrapolated (one-shot's traffic grows with the square of the ranks).
        Class::Nvlink if world_size <= 2 => vec![
            rung(256 * KIB, one_shot, one_shot_why),
            rung(u64::MAX, Choice::Nccl, NVLINK_NCCL_WHY),
        ],
        Class::Nvlink => vec![
            rung(
                if many { 32 * KIB } else { 64 * KIB },
                one_shot,
                one_shot_why,
            ),
            rung(256 * KIB, Choice::Tpar(TwoShot), TWO_SHOT_WHY),
            rung(u64::MAX, Choice::Nccl, NVLINK_NCCL_WHY),
        ],
        Class::PcieP2p => vec![
            rung(
                if many { 32 * KIB } else { 64 * KIB },
                one_shot,
                one_shot_why,
            ),
            rung(MIB, Choice::Tpar(TwoShot), TWO_SHOT_WHY),
            rung(u64::MAX, Choice::Nccl, NCCL_WHY),
        ],
        Class::NoP2p => vec![
            rung(
                if many { 64 * KIB } else { 256 * KIB },
                Choice::Tpar(HostStaged),
                "without P2P tpar stages through pinned host memory mapped into every GPU",
            ),
            rung(
                u64::MAX,
                Choice::Nccl,
                "NCCL's shared-memory transport pipelines large messages through host memory",
            ),
        ],
    }
}
