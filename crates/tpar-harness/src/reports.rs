//! The reports of the harness's runs as they are written out (`tpar ... --json`): each run's
//! rows with what was run, how it was timed, and where ([`Provenance`]). A report is built
//! from the run's settings and results in one place, so the CLI and Python write the same record.

use serde::Serialize;

use super::anatomy::{Anatomy, AnatomyRow, CHAIN};
use super::bench_step::{StepRow, StepSettings};
use super::cpu_bench::{CpuBench, CpuBenchSettings, CpuRow};
use super::cuda_bench::{CudaBenchSettings, CudaRow, Floors};
use super::cuda_ranks::CudaRanks;
use super::fused_bench::{FusedBench, FusedBenchRow};
use super::provenance::Provenance;
use tpar::dispatch::TuningTable;
use tpar::DType;

/// `tpar bench` on the CPU backend.
#[derive(Serialize)]
pub struct CpuBenchReport {
    pub backend: String,
    pub world_size: usize,
    pub dtype: DType,
    #[serde(flatten)]
    pub provenance: Provenance,
    pub iters: usize,
    pub warmup: usize,
    pub timing: &'static str,
    /// How the ranks were placed on cores.
    pub binding: String,
    pub memory_per_rank_bytes: u64,
    pub results: Vec<CpuRow>,
}

impl CpuBenchReport {
    pub fn new(
        world_size: usize,
        settings: &CpuBenchSettings,
        run: CpuBench,
        provenance: Provenance,
    ) -> CpuBenchReport {
        CpuBenchReport {
            backend: "cpu".to_owned(),
            world_size,
            dtype: settings.dtype,
            provenance,
            iters: settings.iters,
            warmup: settings.warmup,
            timing: "wall clock per call on rank 0; p50/p99 over the timed calls",
            binding: run.binding,
            memory_per_rank_bytes: run.memory_per_rank_bytes,
            results: run.rows,
        }
    }
}

/// `tpar bench` on CUDA.
#[derive(Serialize)]
pub struct CudaBenchReport {
    pub backend: &'static str,
    pub world_size: usize,
    pub mode: &'static str,
    pub dtype: DType,
    #[serde(flatten)]
    pub provenance: Provenance,
    pub replays: usize,
    pub warmup: usize,
    pub chain: usize,
    pub timing: &'static str,
    pub memory_per_rank_bytes: u64,
    pub max_blocks_per_rank: u32,
    pub floors: Floors,
    /// The first-use measurement this run made for `auto` (ranks as threads, no table yet),
    /// in one line; absent where none ran (each auto row's `why` says what decided).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_use: Option<String>,
    pub results: Vec<CudaRow>,
}

impl CudaBenchReport {
    /// The report of `rows`, timed by `settings` on `group` (ranks run as `mode`) after the
    /// first-use measurement `first_use` described.
    pub fn new(
        group: &CudaRanks,
        mode: &'static str,
        settings: &CudaBenchSettings,
        floors: Floors,
        rows: Vec<CudaRow>,
        provenance: Provenance,
        first_use: Option<String>,
    ) -> CudaBenchReport {
        CudaBenchReport {
            backend: "cuda",
            world_size: group.world_size,
            mode,
            dtype: settings.dtype,
            provenance,
            replays: settings.replays,
            warmup: settings.warmup,
            chain: settings.chain,
            timing: "CUDA events around graph replays; p50/p99 over replays; per allreduce = replay / chain",
            memory_per_rank_bytes: group.comms[0].memory_footprint().allocated_bytes(),
            max_blocks_per_rank: group.comms[0].cuda().max_blocks(),
            floors,
            first_use,
            results: rows,
        }
    }
}

/// `tpar bench --anatomy`.
#[derive(Serialize)]
pub struct AnatomyReport {
    #[serde(flatten)]
    pub provenance: Provenance,
    pub driver_version: i32,
    pub chain: usize,
    pub replays: usize,
    pub dtype: &'static str,
    pub rows: Vec<AnatomyRow>,
}

impl AnatomyReport {
    pub fn new(anatomy: Anatomy, provenance: Provenance) -> AnatomyReport {
        AnatomyReport {
            provenance,
            driver_version: anatomy.driver_version,
            chain: CHAIN,
            replays: anatomy.replays,
            dtype: "bf16",
            rows: anatomy.rows,
        }
    }
}

/// `tpar bench --fused`.
#[derive(Serialize)]
pub struct FusedReport {
    #[serde(flatten)]
    pub provenance: Provenance,
    pub driver_version: i32,
    pub dtype: &'static str,
    pub chain: usize,
    pub replays: usize,
    pub timing: &'static str,
    pub rows: Vec<FusedBenchRow>,
    /// World sizes that failed, with the error.
    pub errors: Vec<String>,
}

impl FusedReport {
    /// The report of `bench`, timed in graph chains of `chain` ops over `replays` replays.
    pub fn new(
        bench: FusedBench,
        chain: usize,
        replays: usize,
        provenance: Provenance,
    ) -> FusedReport {
        FusedReport {
            provenance,
            driver_version: bench.driver_version,
            dtype: "bf16",
            chain,
            replays,
            timing: "CUDA events around graph replays; per op = replay time / chain",
            rows: bench.rows,
            errors: bench.errors,
        }
    }
}

/// The report of `bench step`: the pass, where it ran and its timed rows.
#[derive(Serialize)]
pub struct StepReport {
    pub model: String,
    pub tp: usize,
    pub tokens: usize,
    pub layers: u64,
    pub allreduces_per_pass: u64,
    /// Residual add + RMSNorms per pass: one after each allreduce.
    pub norms_per_pass: u64,
    pub allreduce_bytes: u64,
    pub gemms_per_pass: usize,
    pub weight_bytes_per_rank_per_layer: u64,
    pub mode: &'static str,
    pub gpus: usize,
    #[serde(flatten)]
    pub provenance: Provenance,
    pub replays: usize,
    pub timing: &'static str,
    pub results: Vec<StepRow>,
}

impl StepReport {
    /// The report of `rows`, timed by `settings` with ranks run as `mode` on `gpus` GPUs.
    pub fn new(
        settings: &StepSettings,
        mode: &'static str,
        gpus: usize,
        provenance: Provenance,
        rows: Vec<StepRow>,
    ) -> StepReport {
        StepReport {
            model: settings.model.name.clone(),
            tp: settings.tp as usize,
            tokens: settings.tokens as usize,
            layers: settings.layers,
            allreduces_per_pass: 2 * settings.layers,
            norms_per_pass: 2 * settings.layers,
            allreduce_bytes: (settings.count() * DType::Bf16.size()) as u64,
            gemms_per_pass: settings.gemms_per_pass(),
            weight_bytes_per_rank_per_layer: settings.weight_bytes(false),
            mode,
            gpus,
            provenance,
            replays: settings.replays,
            timing: "CUDA events around replays of one graph holding the whole pass; p50/p99 over replays; communication = pass - compute-only pass (which runs the norms as separate kernels), so a fused row's figure is what its allreduces add once their norms are folded in",
            results: rows,
        }
    }
}

/// What `tpar tune --json` writes: the table, where it was saved and its measurements; and the
/// fused op's (fused against allreduce + norm per algorithm and token count).
#[derive(Serialize)]
pub struct TuneReport {
    /// Where, when and by what the table was measured.
    #[serde(flatten)]
    pub provenance: Provenance,
    pub table: TuningTable,
    pub written_to: String,
    pub measurements: Vec<CudaRow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fused: Option<super::tune::FusedTuned>,
}
