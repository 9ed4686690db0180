//! Allreduce latency predicted for a machine described by a topology file, for planning before
//! anything was measured there: for each size, the path the dispatcher would pick on that
//! machine and an alpha-beta cost of it (a fixed cost per call that grows with the ranks, plus
//! the bytes that path puts on its bottleneck over that bottleneck's bandwidth).
//!
//! The constants are per machine class and say where they come from: NVLink and host memory
//! from tpar's own runs on H200s (bench/README.md), PCIe peer-to-peer and NCCL on PCIe from the
//! published figures in the design brief. A measured `tpar bench --json` file is always the
//! better input; this is what to use before one exists.

use super::spec::Latency;
use tpar::algorithm::Algorithm;
use tpar::dispatch::{classify, decide, Choice, Class, Request};
use tpar::dtype::DType;
use tpar::error::Result;
use tpar::topology::Topology;

/// Cost of one path on one machine class: `fixed_us + per_rank_us x ranks + bytes / gbps`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PathCost {
    pub fixed_us: f64,
    pub per_rank_us: f64,
    /// Bandwidth of the path's bottleneck per GPU, GB/s.
    pub gbps: f64,
}

impl PathCost {
    fn at(&self, ranks: usize, bottleneck_bytes: f64) -> f64 {
        self.fixed_us + self.per_rank_us * ranks as f64 + bottleneck_bytes / (self.gbps * 1e3)
    }
}

/// The constants of one machine class, and where they come from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClassModel {
    /// tpar's kernels over this class's links (device memory, or host memory for host-staged).
    pub tpar: PathCost,
    /// What two-shot's second step (another hop and a wait for every peer) adds, us.
    pub two_shot_extra_us: f64,
    pub host_staged: PathCost,
    pub nccl: PathCost,
    pub source: &'static str,
}

/// Host-staged on 2 and 4 H200s, one process per GPU: 7.5 and 8.1 us at 4 KiB, 62 us at 256
/// KiB with 4 ranks (bench/README.md, commit 098465b).
const HOST_STAGED: PathCost = PathCost {
    fixed_us: 6.6,
    per_rank_us: 0.35,
    gbps: 29.0,
};

pub fn class_model(class: Class) -> ClassModel {
    match class {
        // 2 and 4 H200s on NVLink: one-shot 4.8 / 6.1 us at 1 KiB, 10.6 us at 256 KiB with 4
        // ranks; NCCL 5.7 / 8.8 us at 1 KiB, 325 us at 64 MiB with 4 (bench/README.md).
        Class::Nvlink => ClassModel {
            tpar: PathCost {
                fixed_us: 3.5,
                per_rank_us: 0.65,
                gbps: 340.0,
            },
            // Two-shot 7.3 against one-shot 6.2 us at 1-4 KiB, 4 ranks.
            two_shot_extra_us: 1.1,
            host_staged: HOST_STAGED,
            nccl: PathCost {
                fixed_us: 3.3,
                per_rank_us: 1.35,
                gbps: 310.0,
            },
            source: "NVLink: measured on 2 and 4 H200s (bench/README.md)",
        },
        // Published: a posted P2P write hop 0.36-0.45 us, 25 GB/s per GPU with all ranks
        // writing at once; NCCL about 24 us at <= 64 KB in nccl-tests on tuned 8-GPU PCIe
        // (design brief). The fixed cost adds a kernel in a graph (about 1.5 us, H200).
        Class::PcieP2p => ClassModel {
            tpar: PathCost {
                fixed_us: 2.5,
                per_rank_us: 0.45,
                gbps: 25.0,
            },
            // One more posted-write hop and a poll.
            two_shot_extra_us: 1.5,
            host_staged: HOST_STAGED,
            nccl: PathCost {
                fixed_us: 20.0,
                per_rank_us: 0.5,
                gbps: 20.0,
            },
            source: "PCIe P2P: published figures in the design brief (posted-write hop, 25 GB/s per GPU all at once, NCCL ~24 us at <= 64 KB)",
        },
        // Without P2P both tpar (host-staged) and NCCL go through host memory: NCCL with
        // NCCL_P2P_DISABLE=1 took 9.5 / 17.3 us at 4 KiB with 2 / 4 ranks, 48 us at 256 KiB.
        Class::NoP2p => ClassModel {
            tpar: HOST_STAGED,
            two_shot_extra_us: 0.0,
            host_staged: HOST_STAGED,
            nccl: PathCost {
                fixed_us: 1.7,
                per_rank_us: 3.9,
                gbps: 12.7,
            },
            source: "no P2P: host-staged and NCCL without P2P measured on 2 and 4 H200s (bench/README.md)",
        },
        // Ranks sharing one GPU: one H200, 2 and 8 ranks (bench/README.md, commit 277b255).
        Class::OneGpu => ClassModel {
            tpar: PathCost {
                fixed_us: 2.4,
                per_rank_us: 0.85,
                gbps: 1000.0,
            },
            // 2 ranks on one H200: two-shot 5.8 against one-shot 4.1 us at 4 KiB.
            two_shot_extra_us: 1.6,
            host_staged: HOST_STAGED,
            nccl: PathCost {
                fixed_us: 4.0,
                per_rank_us: 0.0,
                gbps: 1000.0,
            },
            source: "one GPU: measured with 2 and 8 ranks sharing one H200 (bench/README.md)",
        },
    }
}

/// Where the ranks of an allreduce sit, which decides what its bottleneck is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// One rank per GPU: the bottleneck is each rank's own link.
    GpuPerRank,
    /// Every rank on one GPU: the bottleneck is that GPU's memory (or, for host-staged, its
    /// one PCIe link), which carries every rank's traffic.
    SharedGpu,
}

/// Bytes through the bottleneck for one allreduce of `bytes` over `n` ranks placed as
/// `placement` says. LL lines carry 4 data bytes in 8, so tpar's pushed bytes count double.
/// The one formula for the latency model (one rank per GPU) and for the bandwidth columns of
/// benchmarks (often every rank on one GPU).
pub fn bottleneck_bytes(choice: Choice, n: f64, bytes: f64, placement: Placement) -> f64 {
    match placement {
        Placement::GpuPerRank => match choice {
            Choice::Nccl => 2.0 * (n - 1.0) / n * bytes,
            Choice::Tpar(Algorithm::OneShot) | Choice::Tpar(Algorithm::OneShotPull) => {
                (n - 1.0) * 2.0 * bytes
            }
            Choice::Tpar(Algorithm::TwoShot) => 2.0 * (n - 1.0) / n * 2.0 * bytes,
            Choice::Tpar(Algorithm::HostStaged) => n * 2.0 * bytes,
            // The staged schedules move one-shot's bytes, in n-1 paced steps.
            Choice::Tpar(Algorithm::Staged) | Choice::Tpar(Algorithm::StagedPull) => {
                (n - 1.0) * 2.0 * bytes
            }
            // Islands of n/2 (the common 4+4): a one-shot inside the island, f32 partials of
            // 1/(n/2) of the message across, the island's all-gather.
            Choice::Tpar(Algorithm::Islands) | Choice::Tpar(Algorithm::IslandsPull) => {
                let m = (n / 2.0).max(1.0);
                (m - 1.0) * 2.0 * bytes + 4.0 * bytes / m + (m - 1.0) / m * 2.0 * bytes
            }
            // Reduce-scatter with f32 partials (twice the bytes of 16-bit data), then all-gather.
            Choice::Tpar(Algorithm::Ring) => (n - 1.0) / n * (4.0 + 2.0) * bytes,
        },
        Placement::SharedGpu => match choice {
            // NCCL's ring moves 2 (n-1)/n of the message per rank, n ranks on the one GPU.
            Choice::Nccl => 2.0 * n * bytes,
            // n ranks each write 2B into n inboxes and read n slots of 2B.
            Choice::Tpar(Algorithm::OneShot) => 4.0 * n * n * bytes,
            // Reduce-scatter and all-gather each write and read about 2B per rank, twice.
            Choice::Tpar(Algorithm::TwoShot) => 8.0 * n * bytes,
            // Each rank writes B once; every rank reads every rank's B.
            Choice::Tpar(Algorithm::OneShotPull) => n * bytes + n * n * bytes,
            // Over PCIe, per direction: n x n x 2B written to host memory (and as much read
            // back).
            Choice::Tpar(Algorithm::HostStaged) => 2.0 * n * n * bytes,
            Choice::Tpar(Algorithm::Staged) => 4.0 * n * n * bytes,
            Choice::Tpar(Algorithm::StagedPull) => n * bytes + n * n * bytes,
            Choice::Tpar(Algorithm::Islands) | Choice::Tpar(Algorithm::IslandsPull) => {
                let m = (n / 2.0).max(1.0);
                4.0 * n * m * bytes + 8.0 * n * bytes
            }
            Choice::Tpar(Algorithm::Ring) => 12.0 * n * bytes,
        },
    }
}

/// Sizes the model is evaluated at: 1 KiB to 1 GiB, four points per doubling.
fn grid() -> impl Iterator<Item = u64> {
    (0..=80).map(|i| (1024.0 * 2f64.powf(i as f64 / 4.0)) as u64 & !1)
}

/// The modelled latency on `topology` with `world_size` ranks, and a sentence saying what it
/// rests on (the class, the source of its constants, what runs where).
pub fn modelled_latency(
    topology: &Topology,
    world_size: usize,
    dtype: DType,
) -> Result<(Latency, String)> {
    if world_size > topology.gpus.len() {
        return Err(tpar::error::Error::InvalidArgument(format!(
            "{world_size} ranks on a machine of {} GPU(s) ({}): give a TP size of at most {}",
            topology.gpus.len(),
            topology.description,
            topology.gpus.len()
        )));
    }
    let class = classify(topology, world_size);
    let model = class_model(class);
    let n = world_size.max(1) as f64;
    let mut points = Vec::new();
    let mut runs: Vec<(u64, Choice)> = Vec::new();
    for bytes in grid() {
        let bytes = bytes - bytes % dtype.size() as u64;
        let p = decide(&Request {
            topology,
            findings: None,
            tuning: None,
            world_size,
            dtype,
            bytes,
            capturing: true,
            forced: None,
            group: None,
        })?;
        let (cost, extra) = match p.choice {
            Choice::Nccl => (model.nccl, 0.0),
            Choice::Tpar(Algorithm::HostStaged) => (model.host_staged, 0.0),
            Choice::Tpar(Algorithm::TwoShot) => (model.tpar, model.two_shot_extra_us),
            Choice::Tpar(_) => (model.tpar, 0.0),
        };
        let us = if world_size <= 1 {
            0.0
        } else {
            cost.at(
                world_size,
                bottleneck_bytes(p.choice, n, bytes as f64, Placement::GpuPerRank),
            ) + extra
        };
        points.push((bytes, us));
        if runs.last().is_none_or(|(_, c)| *c != p.choice) {
            runs.push((bytes, p.choice));
        }
    }
    let paths: Vec<String> = runs
        .iter()
        .map(|(from, c)| format!("{c} from {}", tpar::memory::human_bytes(*from)))
        .collect();
    let why = format!(
        "modelled for {} ({}), {world_size} ranks: {}; {}",
        topology.description,
        class_label(class),
        paths.join(", "),
        model.source
    );
    Ok((Latency::Table(points), why))
}

fn class_label(class: Class) -> &'static str {
    match class {
        Class::OneGpu => "ranks share one GPU",
        Class::Nvlink => "NVLink",
        Class::PcieP2p => "PCIe with P2P",
        Class::NoP2p => "no P2P: through host memory",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpar::topology::FIXTURES;

    fn fixture(name: &str) -> Topology {
        Topology::from_json(FIXTURES.iter().find(|f| f.0 == name).unwrap().1).unwrap()
    }

    #[test]
    fn the_model_reproduces_the_nvlink_runs_it_was_fitted_to() {
        let h200 = fixture("8x-h200-nvswitch");
        // bench/README.md, 4 H200s: one-shot 6.10 us at 1 KiB, 6.99 at 64 KiB, two-shot 8.9 at
        // 256 KiB; NCCL 17.5 at 1 MiB.
        let (latency, why) = modelled_latency(&h200, 4, DType::Bf16).unwrap();
        for (bytes, measured) in [
            (1024, 6.10),
            (64 << 10, 6.99),
            (256 << 10, 8.9),
            (1 << 20, 17.5),
        ] {
            let got = latency.at(bytes);
            assert!(
                (got - measured).abs() / measured < 0.3,
                "{bytes}: {got} vs {measured}"
            );
        }
        assert!(why.contains("NVLink") && why.contains("nccl from"), "{why}");
    }

    #[test]
    fn every_fixture_gets_a_rising_positive_latency() {
        for (name, _) in FIXTURES {
            let topology = fixture(name);
            for n in [2, 4, 8] {
                if n > topology.gpus.len() {
                    continue;
                }
                let (latency, _) = modelled_latency(&topology, n, DType::Bf16).unwrap();
                let Latency::Table(points) = &latency else {
                    panic!()
                };
                assert!(points.iter().all(|p| p.1 > 0.0), "{name} n={n}");
                // Larger messages never come out faster by more than a switch of path allows.
                let small = latency.at(4096);
                assert!(latency.at(64 << 20) > small, "{name} n={n}");
            }
        }
    }

    #[test]
    fn more_ranks_than_gpus_is_an_error_naming_the_limit() {
        let rtx = fixture("4x-rtx-4090-no-p2p");
        let err = modelled_latency(&rtx, 8, DType::Bf16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("at most 4"), "{err}");
    }

    #[test]
    fn pcie_without_p2p_is_slower_than_nvlink_for_the_reported_size() {
        let rtx = fixture("4x-rtx-4090-no-p2p");
        let h200 = fixture("8x-h200-nvswitch");
        let at = |t: &Topology| modelled_latency(t, 4, DType::Bf16).unwrap().0.at(43008);
        assert!(at(&rtx) > at(&h200));
    }

    #[test]
    fn bottleneck_bytes_count_each_placement_s_bottleneck() {
        let one_shot = Choice::Tpar(Algorithm::OneShot);
        let kib = 1024.0;
        // One rank per GPU: each pushes its LL-doubled input to n-1 peers.
        assert_eq!(
            bottleneck_bytes(one_shot, 8.0, kib, Placement::GpuPerRank),
            7.0 * 2.0 * kib
        );
        // All on one GPU: n ranks write 2B into n inboxes and read n slots of 2B.
        assert_eq!(
            bottleneck_bytes(one_shot, 8.0, kib, Placement::SharedGpu),
            4.0 * 64.0 * kib
        );
        for choice in Choice::ALL {
            for placement in [Placement::GpuPerRank, Placement::SharedGpu] {
                let two = bottleneck_bytes(choice, 2.0, kib, placement);
                let eight = bottleneck_bytes(choice, 8.0, kib, placement);
                assert!(two > 0.0 && eight > two, "{choice} {placement:?}");
                assert_eq!(
                    bottleneck_bytes(choice, 8.0, 2.0 * kib, placement),
                    2.0 * eight
                );
            }
        }
    }
}
