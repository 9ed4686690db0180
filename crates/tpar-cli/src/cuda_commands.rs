//! The CUDA paths of `tpar bench` and `tpar selftest`: one process driving every rank (the
//! default), or one process per rank (`--processes`, or when started by an outside launcher),
//! and the anatomy and fused benches. The measuring and checking is `tpar_harness`'s, the text
//! `tpar_report`'s.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use tpar_harness::cuda_bench::CudaBenchSettings;
use tpar_harness::cuda_ranks::CudaRanks;
use tpar_harness::cuda_selftest::{self, CudaSelftestSettings};
use tpar_harness::fused_bench;
use tpar_harness::job::cuda_config;
use tpar_harness::reports::{AnatomyReport, FusedReport};
use tpar_harness::runs::cuda_bench_group;

use crate::progress::Progress;
use crate::ranks::on_cuda_ranks;
use tpar_report::plot::plot_latency;
use tpar_report::{bench, emit, emit_to, print_out, ranks, selftest};

pub fn selftest(
    processes: bool,
    world_size: usize,
    settings: CudaSelftestSettings,
) -> Result<ExitCode> {
    on_cuda_ranks(processes, world_size, settings.timeout, |make, mode| {
        let sweep = cuda_selftest::run(make, &settings)?;
        if sweep.leader {
            print_out(&format!(
                "tpar selftest: cuda backend, {} ({mode}); each row checked bitwise against the exact sum\n{}\n{}",
                ranks(world_size),
                selftest::table(&sweep.rows, true),
                selftest::summary(&sweep.rows)
            ))?;
        }
        match selftest::failed(&sweep.rows) {
            0 => Ok(()),
            failed => bail!("{failed} of {} selftest rows failed", sweep.rows.len()),
        }
    })
}

pub fn bench(
    processes: bool,
    world_size: usize,
    settings: CudaBenchSettings,
    timeout: Duration,
    json: Option<String>,
    plot: Option<String>,
) -> Result<ExitCode> {
    let body = |mut group: CudaRanks, mode: &'static str| -> Result<()> {
        let leader = group.is_leader();
        let mut progress = Progress::new(leader, settings.sizes.len() * settings.choices.len());
        let report = cuda_bench_group(
            &mut group,
            mode,
            &settings,
            crate::provenance::COMMIT,
            |bytes, algo| progress.step_at(bytes, algo),
        )?;
        progress.finish();
        let Some(report) = report else {
            return Ok(());
        };
        let plot_on_stdout = plot.as_deref() == Some("-");
        emit_to(
            &bench::cuda_bench(&report),
            json.as_deref(),
            plot_on_stdout,
            &report,
        )?;
        let device = &report.provenance.device;
        let title = || {
            format!(
                "tpar bench: {device}, {} ({mode}), {}",
                ranks(world_size),
                settings.dtype
            )
        };
        let rows = report.results.iter().filter(|r| r.skipped.is_none());
        plot_latency(plot.as_deref(), title, rows)?;
        let wrong = report.results.iter().filter(|r| !r.correct).count();
        if wrong > 0 {
            bail!("{wrong} configurations gave wrong results (see the table)");
        }
        Ok(())
    };
    on_cuda_ranks(processes, world_size, timeout, |make, mode| {
        let config = tpar::Config {
            islands: settings.islands,
            ..cuda_config(timeout)
        };
        body(make(config)?, mode)
    })
}

/// `tpar bench --anatomy`: the harness's ladder of kernels, as a table (and JSON).
pub fn anatomy(world_size: Option<usize>, replays: usize, json: Option<&str>) -> Result<()> {
    let anatomy = tpar_harness::anatomy::run(world_size, replays)?;
    let text = tpar_report::bench::anatomy(&anatomy);
    let provenance = crate::provenance::provenance(anatomy.device.clone());
    Ok(emit(&text, json, &AnatomyReport::new(anatomy, provenance))?)
}

/// `tpar bench --fused`: the harness's measurement as a table (and JSON).
pub fn fused(
    world_size: Option<usize>,
    algorithm: tpar::Algorithm,
    tokens: &[usize],
    iters: usize,
    chain: usize,
    json: Option<&str>,
) -> Result<()> {
    tpar_harness::cuda_ranks::device_count()
        .context("tpar bench --fused times the fused CUDA kernel and needs an NVIDIA GPU")?;
    let bench = fused_bench::measure(world_size, algorithm, tokens, iters, chain);
    let text = tpar_report::bench::fused(&bench, chain, iters);
    let ok = bench.rows.iter().all(|r| r.correct != Some(false));
    let errors = bench.errors.join("; ");
    let provenance = crate::provenance::provenance(bench.device.clone());
    emit(
        &text,
        json,
        &FusedReport::new(bench, chain, iters, provenance),
    )?;
    anyhow::ensure!(
        ok,
        "a fused or unfused result differed from the CPU reference"
    );
    anyhow::ensure!(errors.is_empty(), "{errors}");
    Ok(())
}
