//! `tpar tune`: measures tpar's algorithms and NCCL across message sizes on this machine (the
//! same CUDA-graph timing as `tpar bench`), writes the fastest choice per size as the tuning
//! table where the dispatcher looks for it (keyed by a fingerprint of the GPUs, driver and
//! topology, the world size and the dtype), and prints the crossovers.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use tpar::dispatch::{Choice, TuningEntry, TuningTable};
use tpar::topology::Topology;
use tpar::DType;

use crate::args::{parse_list, parse_size, sizes_to_counts};
use crate::cuda_bench::{self, CudaBenchPlan, CudaRow};
use crate::cuda_commands::{config, on_ranks};
use crate::report::{emit, Table};

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct TuneArgs {
    /// Ranks to tune for [default: one per GPU].
    #[arg(long, short = 'n', value_parser = crate::args::world_size_arg)]
    world_size: Option<usize>,
    /// Element type to tune for: f32, f16 or bf16 (the table is kept per dtype).
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    /// Sizes to measure; the table switches algorithms between them.
    #[arg(
        long,
        default_value = "1K,4K,16K,32K,64K,128K,256K,512K,1M,2M,4M,16M,64M"
    )]
    sizes: String,
    /// Timed graph replays per size and algorithm.
    #[arg(long, default_value_t = 50, value_parser = crate::args::iterations_arg)]
    iters: usize,
    /// One process per rank (CUDA IPC); NCCL with several ranks is only measured this way.
    #[arg(long)]
    processes: bool,
    /// Seconds a rank waits for a peer before it fails the run, naming the peer.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = crate::args::timeout_arg)]
    timeout: std::time::Duration,
    /// Also write the measurements and the table as JSON (`-`: stdout).
    #[arg(long, value_name = "PATH|-")]
    json: Option<String>,
}

#[derive(Serialize)]
struct TuneReport {
    table: TuningTable,
    written_to: String,
    measurements: Vec<CudaRow>,
}

/// The fastest correct choice at each measured size, runs of one choice merged; the last
/// entry covers every larger size.
pub fn table_from(
    rows: &[CudaRow],
    fingerprint: String,
    world_size: usize,
    dtype: DType,
) -> Result<TuningTable> {
    let mut sizes: Vec<u64> = rows.iter().map(|r| r.bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut entries: Vec<TuningEntry> = Vec::new();
    for bytes in sizes {
        let best = rows
            .iter()
            .filter(|r| r.bytes == bytes && r.correct && r.skipped.is_none() && r.p50_us > 0.0)
            .min_by(|a, b| a.p50_us.total_cmp(&b.p50_us));
        let Some(best) = best else { continue };
        let choice: Choice = best.algo.parse()?;
        match entries.last_mut() {
            Some(last) if last.choice == choice => {
                last.max_bytes = bytes;
                last.p50_us = best.p50_us;
            }
            _ => entries.push(TuningEntry {
                max_bytes: bytes,
                choice,
                p50_us: best.p50_us,
            }),
        }
    }
    let Some(last) = entries.last_mut() else {
        bail!("no size had a correct measurement; nothing to tune");
    };
    last.max_bytes = u64::MAX;
    Ok(TuningTable {
        fingerprint,
        world_size,
        dtype,
        entries,
    })
}

pub fn crossovers(table: &TuningTable) -> String {
    tpar::dispatch::describe_ranges(table.entries.iter().map(|e| (e.max_bytes, e.choice)))
}

pub fn run(args: TuneArgs) -> Result<ExitCode> {
    // Arguments first: a typo is reported as such, on any machine.
    let bytes = parse_list(&args.sizes, "sizes", parse_size)?;
    let counts = sizes_to_counts(&bytes, args.dtype)?;
    if let Some(path) = &args.json {
        crate::args::check_writable("json", path)?;
    }
    let gpus =
        tpar::backend::cuda::probe().context("tpar tune measures GPUs, and none is usable here")?;
    let topology =
        Topology::detect().context("tpar tune keys its table by the machine's topology")?;
    let world_size = args.world_size.unwrap_or(gpus).max(1);
    let timeout = args.timeout;
    let plan = CudaBenchPlan {
        sizes: bytes.into_iter().zip(counts).collect(),
        choices: Choice::ALL.map(crate::cuda_ranks::Route::Fixed).to_vec(),
        dtype: args.dtype,
        replays: args.iters,
        warmup: 5,
        chain: 50,
    };
    on_ranks(args.processes, world_size, timeout, |make, _mode| {
        let mut group = make(config(timeout))?;
        let mut progress = crate::progress::Progress::new(
            group.is_leader(),
            plan.sizes.len() * plan.choices.len(),
        );
        let floors = cuda_bench::measure_floors(&group, &plan)?;
        let rows = cuda_bench::run(&mut group, &plan, &floors, |what| {
            progress.step(what.to_owned())
        })?;
        progress.finish();
        if !group.is_leader() {
            return Ok(());
        }
        let table = table_from(&rows, topology.fingerprint(), world_size, args.dtype)?;
        let path = table.save()?;
        let mut t = Table::new(&["size", "fastest", "p50 us", "runner-up", "p50 us"], 2);
        for &(size, _) in &plan.sizes {
            let mut here: Vec<&CudaRow> = rows
                .iter()
                .filter(|r| r.bytes == size && r.correct && r.skipped.is_none())
                .collect();
            here.sort_by(|a, b| a.p50_us.total_cmp(&b.p50_us));
            let cell = |i: usize| {
                here.get(i).map_or(("-".to_owned(), "-".to_owned()), |r| {
                    (r.algo.clone(), format!("{:.2}", r.p50_us))
                })
            };
            let ((a, a_us), (b, b_us)) = (cell(0), cell(1));
            t.push(vec![crate::report::size(size), a, a_us, b, b_us]);
        }
        let skipped: Vec<String> = rows
            .iter()
            .filter_map(|r| r.skipped.as_ref().map(|why| format!("{}: {why}", r.algo)))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let text = format!(
            "tpar tune: {}, {} on {}\n{}\n\ncrossovers: {}\n{}wrote {}",
            crate::report::ranks(world_size),
            args.dtype,
            topology,
            t.render(),
            crossovers(&table),
            if skipped.is_empty() {
                String::new()
            } else {
                format!("not measured: {}\n", skipped.join("; "))
            },
            path.display()
        );
        let report = TuneReport {
            table,
            written_to: path.display().to_string(),
            measurements: rows,
        };
        emit(&text, args.json.as_deref(), &report)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(bytes: u64, algo: &str, p50_us: f64) -> CudaRow {
        CudaRow {
            bytes,
            algo: algo.into(),
            p50_us,
            p99_us: p50_us,
            busbw_gbps: 0.0,
            correct: true,
            graph_single_us: 0.0,
            wire_floor_us: 0.0,
            chain: 50,
            replays: 50,
            runs: None,
            skipped: None,
        }
    }

    #[test]
    fn the_table_keeps_the_fastest_per_size_and_merges_runs() {
        let rows = vec![
            row(4096, "one-shot", 4.0),
            row(4096, "two-shot", 5.0),
            row(65536, "one-shot", 6.0),
            row(65536, "two-shot", 5.5),
            row(1 << 20, "two-shot", 30.0),
            row(1 << 20, "nccl", 25.0),
            row(4 << 20, "nccl", 60.0),
        ];
        let t = table_from(&rows, "fp".into(), 8, DType::Bf16).unwrap();
        let got: Vec<(u64, Choice)> = t.entries.iter().map(|e| (e.max_bytes, e.choice)).collect();
        assert_eq!(
            got,
            vec![
                (4096, Choice::Tpar(tpar::Algorithm::OneShot)),
                (65536, Choice::Tpar(tpar::Algorithm::TwoShot)),
                (u64::MAX, Choice::Nccl)
            ]
        );
        assert_eq!(
            crossovers(&t),
            "one-shot up to 4 KiB, two-shot up to 64 KiB, nccl above"
        );
    }

    #[test]
    fn wrong_or_skipped_rows_never_win() {
        let mut wrong = row(4096, "one-shot", 1.0);
        wrong.correct = false;
        let mut skipped = row(4096, "nccl", 0.5);
        skipped.skipped = Some("no NCCL".into());
        let t = table_from(
            &[wrong, skipped, row(4096, "two-shot", 9.0)],
            "fp".into(),
            2,
            DType::F32,
        )
        .unwrap();
        assert_eq!(t.entries[0].choice, Choice::Tpar(tpar::Algorithm::TwoShot));
        assert!(table_from(&[], "fp".into(), 2, DType::F32).is_err());
    }
}
