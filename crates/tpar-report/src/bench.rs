//! The text of `tpar bench`: the CPU and CUDA sweeps, the anatomy ladder and the fused
//! allreduce + RMSNorm comparison.

use tpar::memory::human_bytes;
use tpar_harness::anatomy::{Anatomy, CHAIN};
use tpar_harness::cpu_bench::CpuRow;
use tpar_harness::fused_bench::{FusedBench, VARIANTS};
use tpar_harness::reports::{CpuBenchReport, CudaBenchReport};

use crate::{name_with_runs, ranks, size, skipped_row, Table};

/// `tpar bench` on the CPU backend: the heading and the table.
pub fn cpu_bench(report: &CpuBenchReport) -> String {
    format!(
        "tpar bench: {} backend, {}, {}, {} timed calls per row after {} warm-up; {} of shared memory per rank\n{}",
        report.backend,
        ranks(report.world_size),
        report.dtype,
        report.iters,
        report.warmup,
        human_bytes(report.memory_per_rank_bytes),
        cpu_table(&report.results)
    )
}

/// The CPU bench's rows (also the partial table an interrupted run prints).
pub fn cpu_table(rows: &[CpuRow]) -> String {
    let mut table = Table::new(
        &[
            "size",
            "algorithm",
            "p50 us",
            "p99 us",
            "busbw GB/s",
            "correct",
        ],
        2,
    );
    for r in rows {
        table.push(vec![
            size(r.bytes),
            r.algo.clone(),
            format!("{:.2}", r.p50_us),
            format!("{:.2}", r.p99_us),
            format!("{:.2}", r.busbw_gbps),
            if r.correct { "yes" } else { "NO" }.to_owned(),
        ]);
    }
    table.render()
}

/// `tpar bench` on CUDA: the heading, the floors of the run and the table.
pub fn cuda_bench(report: &CudaBenchReport) -> String {
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
            "launch",
        ],
        2,
    );
    for r in &report.results {
        if let Some(why) = &r.skipped {
            table.push(skipped_row(vec![size(r.bytes), r.algo.clone()], 9, why));
            continue;
        }
        let algo = name_with_runs(&r.algo, r.runs.as_deref());
        table.push(vec![
            size(r.bytes),
            algo,
            format!("{:.2}", r.p50_us),
            format!("{:.2}", r.p99_us),
            format!("{:.2}", r.graph_single_us),
            format!("{:.2}", r.wire_floor_us),
            format!("{:.1}", r.busbw_gbps),
            if r.correct { "yes" } else { "NO" }.to_owned(),
            r.launch.map_or("-".to_owned(), |l| l.to_string()),
        ]);
    }
    let f = &report.floors;
    format!(
        "tpar bench: cuda backend ({}), {} ({}), {}; {} replays of a graph with {} allreduces per rank; {} per rank\n\
         floors in this run: empty kernel {:.2} us per op in the chain, {:.2} us for a 1-op graph; device copy {:.0} GB/s, device->host {:.1} GB/s\n{}{}",
        report.provenance.device,
        ranks(report.world_size),
        report.mode,
        report.dtype,
        report.replays,
        report.chain,
        human_bytes(report.memory_per_rank_bytes),
        f.empty_chain_us,
        f.empty_single_us,
        f.device_copy_gbps,
        f.device_to_host_gbps,
        table.render(),
        auto_reasons(report)
    )
}

/// Why `auto` ran what it ran at each size (the dispatcher's reason, as an engine's
/// communicator would decide on this machine), after the first-use measurement this run made,
/// if any; empty where `auto` was not benched.
fn auto_reasons(report: &CudaBenchReport) -> String {
    let reasons: Vec<String> = report
        .results
        .iter()
        .filter_map(|r| Some(format!("  {:>9}  {}", size(r.bytes), r.why.as_deref()?)))
        .collect();
    if reasons.is_empty() {
        return String::new();
    }
    let measured = match &report.first_use {
        Some(line) => format!("auto's first-use measurement, as an engine's communicator makes it on a machine with no tuning table: {line}\n"),
        None => String::new(),
    };
    format!(
        "\n{measured}auto at each size, and why:\n{}\n",
        reasons.join("\n")
    )
}

/// `tpar bench --anatomy`: what each piece of one call costs, a row per rung, with and without
/// PDL.
pub fn anatomy(anatomy: &Anatomy) -> String {
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
            format!("{}x{}", plain.grid, plain.block_threads),
            format!("{:.2}", plain.p50_us),
            format!("{:.2}", plain.ratio_to_empty),
            with.map_or("-".into(), |w| format!("{:.2}", w.p50_us)),
            with.map_or("-".into(), |w| format!("{:.2}", w.ratio_to_empty)),
        ]);
    }
    format!(
        "anatomy of one allreduce call: {}, ranks as streams, bf16, per call in a graph chain of {CHAIN} per rank (median of {} replays)\n{}",
        anatomy.device,
        anatomy.replays,
        table.render()
    )
}

/// `tpar bench --fused`: each case's variants side by side, in graph chains of `chain` ops
/// over `replays` replays, and the world sizes that failed.
pub fn fused(bench: &FusedBench, chain: usize, replays: usize) -> String {
    let FusedBench {
        algorithm,
        device,
        hidden,
        rows,
        errors,
        ..
    } = bench;
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
            "fused launch",
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
            chunk
                .iter()
                .find(|r| r.variant == "fused")
                .and_then(|r| r.launch)
                .map_or("-".to_owned(), |l| l.to_string()),
            if chunk.iter().all(|r| r.correct != Some(false)) {
                "yes"
            } else {
                "NO"
            }
            .to_owned(),
        ]);
    }
    let device = if device.is_empty() {
        "no GPU opened"
    } else {
        device.as_str()
    };
    let text = format!(
        "fused allreduce + residual + RMSNorm: {device}, ranks as streams, bf16, hidden {hidden}, {algorithm}, us per op in a graph chain of {chain} per rank (median of {replays} replays)\n{}",
        table.render()
    );
    if errors.is_empty() {
        text
    } else {
        format!("{text}\nFAILED: {}", errors.join("; "))
    }
}
