//! The CUDA paths of `tpar bench` and `tpar selftest`: one process driving every rank (the
//! default), or one process per rank (`--processes`, or when started by an outside launcher),
//! and the reports they print. The measuring and checking is `tpar::harness`'s.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use tpar::memory::human_bytes;

use tpar::harness::anatomy::CHAIN;
use tpar::harness::cuda_bench::{self, CudaBenchPlan};
use tpar::harness::cuda_ranks::CudaRanks;
use tpar::harness::cuda_selftest::{self, CudaPlan};
use tpar::harness::fused_bench::{self, FusedBench, VARIANTS};
use tpar::harness::job::cuda_config;
use tpar::harness::reports::{AnatomyReport, CudaBenchReport, FusedReport};

use crate::progress::Progress;
use crate::ranks::on_cuda_ranks;
use crate::report::{emit, name_with_runs, skipped_row, Table};

pub fn selftest(processes: bool, world_size: usize, plan: CudaPlan) -> Result<ExitCode> {
    on_cuda_ranks(processes, world_size, plan.timeout, |make, mode| {
        let sweep = cuda_selftest::run(make, &plan)?;
        let rows = sweep.rows;
        let failed = rows.iter().filter(|r| r.bad > 0).count();
        let rows_run = rows.len();
        if sweep.leader {
            let mut table = Table::new(
                &["case", "dtype", "elements", "placement", "mode", "result"],
                5,
            );
            for row in &rows {
                let mut cells = row.cells.clone();
                cells.push(row.result.clone());
                table.push(cells);
            }
            let table = table.render();
            println!(
                "tpar selftest: cuda backend, {} ({mode}); each row checked bitwise against the exact sum\n{table}",
                crate::report::ranks(world_size)
            );
            println!("selftest: {} passed, {failed} failed", rows_run - failed);
        }
        if failed > 0 {
            bail!("{failed} of {rows_run} selftest rows failed");
        }
        Ok(())
    })
}

pub fn bench(
    processes: bool,
    world_size: usize,
    plan: CudaBenchPlan,
    timeout: Duration,
    json: Option<String>,
    plot: Option<String>,
) -> Result<ExitCode> {
    let body = |mut group: CudaRanks, mode: &'static str| -> Result<()> {
        let leader = group.is_leader();
        let mut progress = Progress::new(leader, plan.sizes.len() * plan.choices.len());
        let floors = cuda_bench::measure_floors(&group, &plan)?;
        let rows = cuda_bench::run(&mut group, &plan, &floors, |bytes, algo| {
            progress.step(format!("{} {algo}", crate::report::size(bytes)))
        })?;
        progress.finish();
        if !leader {
            return Ok(());
        }
        let provenance = crate::report::provenance(group.device()?);
        let report = CudaBenchReport::new(&group, mode, &plan, floors, rows, provenance);
        emit(&render(&report), json.as_deref(), &report)?;
        if let Some(path) = &plot {
            let rows = report.results.iter().filter(|r| r.skipped.is_none());
            let series = crate::plot::series(rows.map(|r| (r.algo.as_str(), r.bytes, r.p50_us)));
            let title = format!(
                "tpar bench: {}, {} ({mode}), {}",
                report.provenance.device,
                crate::report::ranks(world_size),
                plan.dtype
            );
            crate::plot::latency_svg(path, &title, &series)?;
            eprintln!("wrote {path}");
        }
        let wrong = report.results.iter().filter(|r| !r.correct).count();
        if wrong > 0 {
            bail!("{wrong} configurations gave wrong results (see the table)");
        }
        Ok(())
    };
    on_cuda_ranks(processes, world_size, timeout, |make, mode| {
        body(make(cuda_config(timeout))?, mode)
    })
}

fn render(report: &CudaBenchReport) -> String {
    let mut table = Table::new(
        &[
            "size",
            "algorithm",
            "p50 us",
            "p99 us",
            "1-op graph us",
            "wire floor us",
            "busbw GB/s",
            "correct",
        ],
        2,
    );
    for r in &report.results {
        if let Some(why) = &r.skipped {
            table.push(skipped_row(
                vec![crate::report::size(r.bytes), r.algo.clone()],
                8,
                why,
            ));
            continue;
        }
        let algo = name_with_runs(&r.algo, r.runs.as_deref());
        table.push(vec![
            crate::report::size(r.bytes),
            algo,
            format!("{:.2}", r.p50_us),
            format!("{:.2}", r.p99_us),
            format!("{:.2}", r.graph_single_us),
            format!("{:.2}", r.wire_floor_us),
            format!("{:.1}", r.busbw_gbps),
            if r.correct { "yes" } else { "NO" }.to_owned(),
        ]);
    }
    let f = &report.floors;
    format!(
        "tpar bench: cuda backend ({}), {} ({}), {}; {} replays of a graph with {} allreduces per rank; {} per rank\n\
         floors in this run: empty kernel {:.2} us per op in the chain, {:.2} us for a 1-op graph; device copy {:.0} GB/s, device->host {:.1} GB/s\n{}",
        report.provenance.device,
        crate::report::ranks(report.world_size),
        report.mode,
        report.dtype,
        report.replays,
        report.chain,
        human_bytes(report.memory_per_rank_bytes),
        f.empty_chain_us,
        f.empty_single_us,
        f.device_copy_gbps,
        f.device_to_host_gbps,
        table.render()
    )
}

/// `tpar bench --anatomy`: the harness's ladder of kernels, as a table (and JSON).
pub fn anatomy(world_size: Option<usize>, replays: usize, json: Option<&str>) -> Result<()> {
    let anatomy = tpar::harness::anatomy::run(world_size, replays)?;
    let rows = &anatomy.rows;
    let mut table = Table::new(
        &[
            "ranks",
            "piece",
            "bytes",
            "grid",
            "us/op",
            "xempty",
            "PDL us/op",
            "xempty",
        ],
        2,
    );
    for plain in rows.iter().filter(|r| !r.pdl) {
        let with = rows.iter().find(|r| {
            r.pdl
                && r.world_size == plain.world_size
                && r.rung == plain.rung
                && r.bytes == plain.bytes
        });
        table.push(vec![
            plain.world_size.to_string(),
            plain.piece.clone(),
            human_bytes(plain.bytes as u64),
            plain.grid.to_string(),
            format!("{:.2}", plain.p50_us),
            format!("{:.2}", plain.ratio_to_empty),
            with.map_or("-".into(), |w| format!("{:.2}", w.p50_us)),
            with.map_or("-".into(), |w| format!("{:.2}", w.ratio_to_empty)),
        ]);
    }
    let device = anatomy.device.clone();
    let text = format!(
        "anatomy of one allreduce call: {device}, ranks as streams, bf16, per call in a graph chain of {CHAIN} per rank (median of {replays} replays)\n{}",
        table.render()
    );
    let report = AnatomyReport::new(anatomy, crate::report::provenance(device));
    emit(&text, json, &report)
}

/// `tpar bench --fused`: the harness's measurement as a table (and JSON).
pub fn fused(
    world_size: Option<usize>,
    iters: usize,
    chain: usize,
    json: Option<&str>,
) -> Result<()> {
    let bench = fused_bench::measure(world_size, iters, chain);
    let FusedBench {
        device,
        hidden,
        rows,
        errors,
        ..
    } = &bench;
    let mut table = Table::new(
        &[
            "ranks",
            "tokens",
            "bytes",
            "empty",
            "allreduce",
            "norm",
            "ar + norm",
            "fused",
            "fused - ar",
            "ar+norm - fused",
            "correct",
        ],
        3,
    );
    for chunk in rows.chunks(VARIANTS.len()) {
        let p = |v: &str| {
            chunk
                .iter()
                .find(|r| r.variant == v)
                .map_or(0.0, |r| r.p50_us)
        };
        table.push(vec![
            chunk[0].world_size.to_string(),
            chunk[0].tokens.to_string(),
            human_bytes(chunk[0].bytes as u64),
            format!("{:.2}", p("empty kernel")),
            format!("{:.2}", p("allreduce")),
            format!("{:.2}", p("norm kernel")),
            format!("{:.2}", p("allreduce + norm")),
            format!("{:.2}", p("fused")),
            format!("{:+.2}", p("fused") - p("allreduce")),
            format!("{:+.2}", p("allreduce + norm") - p("fused")),
            if chunk.iter().all(|r| r.correct != Some(false)) {
                "yes"
            } else {
                "NO"
            }
            .to_owned(),
        ]);
    }
    let text = format!(
        "fused allreduce + residual + RMSNorm: {device}, ranks as streams, bf16, hidden {hidden}, one-shot, us per op in a graph chain of {chain} per rank (median of {iters} replays)\n{}",
        table.render()
    );
    let ok = rows.iter().all(|r| r.correct != Some(false));
    let text = if errors.is_empty() {
        text
    } else {
        format!("{text}\nFAILED: {}", errors.join("; "))
    };
    let (errors, provenance) = (errors.join("; "), crate::report::provenance(device.clone()));
    let report = FusedReport::new(bench, chain, iters, provenance);
    emit(&text, json, &report)?;
    anyhow::ensure!(
        ok,
        "a fused or unfused result differed from the CPU reference"
    );
    anyhow::ensure!(errors.is_empty(), "{errors}");
    Ok(())
}
