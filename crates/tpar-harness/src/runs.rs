//! The bench's rank bodies, one per backend, from settings to the report rank 0 writes: the
//! CPU one on this process's rank of a job ([`cpu_bench_rank`]), the CUDA one on a group of
//! CUDA ranks ([`cuda_bench_group`]). Printing (tables, JSON, plots, progress) stays with the
//! caller, which hears each step and each partial result through closures.

use super::backend_choice::cpu_device;
use super::cpu_bench::{self, CpuBenchSettings, CpuRow};
use super::cuda_bench::{self, CudaBenchSettings};
use super::cuda_ranks::CudaRanks;
use super::provenance::Provenance;
use super::ranks::Rank;
use super::reports::{CpuBenchReport, CudaBenchReport};
use super::Result;
use tpar::{Algorithm, Selection};

/// One rank's part of `tpar bench --backend cpu`: the sweep of `settings` (see
/// [`cpu_bench::run`] for `on_step` and `on_rows`), then, on rank 0, its report as measured by
/// a build of `commit`. The other ranks get `None`.
pub fn cpu_bench_rank(
    rank: &Rank,
    settings: &CpuBenchSettings,
    commit: &str,
    on_step: impl FnMut(u64, Algorithm),
    on_rows: impl FnMut(&[CpuRow]),
) -> Result<Option<CpuBenchReport>> {
    let run = cpu_bench::run(rank, settings, on_step, on_rows)?;
    if !rank.is_leader() {
        return Ok(None);
    }
    let provenance = Provenance::collect(cpu_device(), commit);
    Ok(Some(CpuBenchReport::new(
        rank.world_size(),
        settings,
        run,
        provenance,
    )))
}

/// `tpar bench --backend cuda` on `group` (its ranks run as `mode`: threads or processes): the
/// first-use measurement an engine's communicator would make, where `auto` is benched (see
/// [`CudaRanks::measure_first_use`]), the floors of the run, the sweep of `settings`
/// (`on_step` hears each size and choice before it starts), then, on the leader, its report as
/// measured by a build of `commit`.
pub fn cuda_bench_group(
    group: &mut CudaRanks,
    mode: &'static str,
    settings: &CudaBenchSettings,
    commit: &str,
    on_step: impl FnMut(u64, Selection),
) -> Result<Option<CudaBenchReport>> {
    let first_use = if settings.choices.contains(&Selection::Auto) {
        group.measure_first_use()
    } else {
        None
    };
    let floors = cuda_bench::measure_floors(group, settings)?;
    let rows = cuda_bench::run(group, settings, &floors, on_step)?;
    if !group.is_leader() {
        return Ok(None);
    }
    let provenance = Provenance::collect(group.device()?, commit);
    Ok(Some(CudaBenchReport::new(
        group, mode, settings, floors, rows, provenance, first_use,
    )))
}
