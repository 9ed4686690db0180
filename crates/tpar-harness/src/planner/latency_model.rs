//! Allreduce latency predicted for a machine described by a topology file, for planning before
//! anything was measured there: for each size, the path the dispatcher would pick on that
//! machine and the fabric model's time for it (`tpar::dispatch::fabric`: each algorithm's
//! schedule of transfers costed on the machine's links, with physical parameters that name
//! their sources, held in CI against the published PCIe tables). A measured `tpar bench
//! --json` file is always the better input; this is what to use before one exists.
//!
//! [`bottleneck_bytes`] stays here for the benchmarks' bandwidth columns.

use super::spec::Latency;
use tpar::algorithm::Algorithm;
use tpar::dispatch::fabric::Fabric;
use tpar::dispatch::{decide, Choice, Findings, Request};
use tpar::dtype::DType;
use tpar::error::Result;
use tpar::topology::Topology;

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
/// rests on (the class, the islands, where the collapse figure comes from, what runs where).
pub fn modelled_latency(
    topology: &Topology,
    world_size: usize,
    dtype: DType,
) -> Result<(Latency, String)> {
    modelled_latency_with(topology, world_size, dtype, None)
}

/// [`modelled_latency`] with what was measured on the machine (`tpar doctor`'s findings).
pub fn modelled_latency_with(
    topology: &Topology,
    world_size: usize,
    dtype: DType,
    findings: Option<&Findings>,
) -> Result<(Latency, String)> {
    if world_size > topology.gpus.len() {
        return Err(tpar::error::Error::InvalidArgument(format!(
            "{world_size} ranks on a machine of {} GPU(s) ({}): give a TP size of at most {}",
            topology.gpus.len(),
            topology.description,
            topology.gpus.len()
        )));
    }
    let fabric = Fabric::new(topology, world_size, findings);
    let mut points = Vec::new();
    let mut runs: Vec<(u64, Choice)> = Vec::new();
    for bytes in grid() {
        let bytes = bytes - bytes % dtype.size() as u64;
        let p = decide(&Request {
            topology,
            findings,
            tuning: None,
            world_size,
            dtype,
            bytes,
            capturing: true,
            forced: None,
            group: None,
        })?;
        let us = if world_size <= 1 {
            0.0
        } else {
            fabric
                .estimate(p.choice, dtype, bytes)
                .map_or(f64::NAN, |e| e.us)
        };
        if us.is_finite() {
            points.push((bytes, us));
        }
        if runs.last().is_none_or(|(_, c)| *c != p.choice) {
            runs.push((bytes, p.choice));
        }
    }
    let paths: Vec<String> = runs
        .iter()
        .map(|(from, c)| format!("{c} from {}", tpar::memory::human_bytes(*from)))
        .collect();
    let islands = fabric
        .islands()
        .filter(|i| i.count() > 1)
        .map_or(String::new(), |i| format!(", islands {i}"));
    let collapse = if fabric.class().is_pcie() {
        format!("; {}", fabric.collapse().source)
    } else {
        String::new()
    };
    let why = format!(
        "modelled for {} ({}{islands}), {world_size} ranks: {}; the fabric model (tpar::dispatch::fabric){collapse}",
        topology.description,
        fabric.class().describe(),
        paths.join(", "),
    );
    Ok((Latency::Table(points), why))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpar::topology::FIXTURES;

    fn fixture(name: &str) -> Topology {
        Topology::from_json(FIXTURES.iter().find(|f| f.0 == name).unwrap().1).unwrap()
    }

    #[test]
    fn the_model_follows_tpars_own_nvlink_runs() {
        let h200 = fixture("8x-h200-nvswitch");
        // bench/README.md, 2 H200s over NVLink, one process per GPU (5260727): one-shot 2.96
        // us at 1 KiB, 3.44 at 16 KiB, 4.92 at 256 KiB; NCCL 13.82 at 1 MiB, 77.00 at 16 MiB.
        let (latency, why) = modelled_latency(&h200, 2, DType::Bf16).unwrap();
        for (bytes, measured) in [
            (1024, 2.96),
            (16 << 10, 3.44),
            (256 << 10, 4.92),
            (1 << 20, 13.82),
            (16 << 20, 77.00),
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
                let (latency, why) = modelled_latency(&topology, n, DType::Bf16).unwrap();
                assert!(why.contains("fabric model"), "{why}");
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
