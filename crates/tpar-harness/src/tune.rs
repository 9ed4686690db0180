//! Tuning: from measured rows (the graph-replay timing of [`super::cuda_bench`], tpar's
//! algorithms and NCCL alike: every choice the backend runs, the PCIe-fabric algorithms
//! included, each skipped with its reason where this group cannot run it) to the
//! [`TuningTable`] the dispatcher reads, keeping the fastest correct choice per size. Then the
//! fused allreduce + residual + RMSNorm against allreduce + the separate norm kernel, 1 to 512
//! tokens at the model's hidden size, to the [`FusedTable`] that decides which of the two
//! paths a fused call takes on this machine (`tpar::dispatch::decide_fused`).

use std::path::PathBuf;

use super::bail;
use serde::Serialize;

use super::cuda_bench::{self, CudaBenchSettings, CudaRow};
use super::cuda_ranks::CudaRanks;
use super::fused_bench::{self, FusedBenchRow};
use super::{Context, Result};
use tpar::algorithm::Selection;
use tpar::dispatch::{Choice, TuningEntry, TuningTable};
use tpar::norm::{FusedRow, FusedTable};
use tpar::topology::Topology;
use tpar::{Algorithm, DType};

/// What tuning measures: every choice (tpar's algorithms and NCCL) at each of `sizes`
/// ((bytes, elements) pairs), by the graph-replay timing of `tpar bench`.
pub fn settings(sizes: Vec<(u64, usize)>, dtype: DType, replays: usize) -> CudaBenchSettings {
    CudaBenchSettings {
        sizes,
        choices: Choice::ALL.map(Selection::Forced).to_vec(),
        dtype,
        replays,
        warmup: cuda_bench::DEFAULT_WARMUP,
        chain: 50,
        islands: None,
    }
}

/// What tuning runs on: this machine's topology (the table's key) and the world size, one
/// rank per GPU unless `world_size` says otherwise.
pub fn machine(world_size: Option<usize>) -> Result<(usize, Topology)> {
    let gpus = tpar::backend::cuda::check_available()
        .context("tpar tune measures GPUs, and none is usable here")?;
    let topology =
        Topology::detect().context("tpar tune keys its table by the machine's topology")?;
    Ok((world_size.unwrap_or(gpus).max(1), topology))
}

/// A tuning run's outcome: the table, where rank 0 wrote it (other ranks write nothing), and
/// the measurements it was made from.
pub struct Tuned {
    pub table: TuningTable,
    pub written_to: Option<PathBuf>,
    pub rows: Vec<CudaRow>,
}

/// Measures `settings` on `group` (every rank of the job calls this together), makes the table
/// and, on the rank holding rank 0, saves it where the dispatcher of this machine looks.
/// `progress` hears each (size, choice) before it is timed.
pub fn run(
    group: &mut CudaRanks,
    settings: &CudaBenchSettings,
    topology: &Topology,
    progress: impl FnMut(u64, Selection),
) -> Result<Tuned> {
    let floors = cuda_bench::measure_floors(group, settings)?;
    let rows = cuda_bench::run(group, settings, &floors, progress)?;
    let table = table_from(
        &rows,
        topology.fingerprint(),
        group.world_size,
        settings.dtype,
    )?;
    let written_to = if group.is_leader() {
        Some(table.save()?)
    } else {
        None
    };
    Ok(Tuned {
        table,
        written_to,
        rows,
    })
}

/// The two fastest correct choices measured at one size, for the crossover table.
pub struct Podium<'a> {
    pub bytes: u64,
    pub fastest: Option<&'a CudaRow>,
    pub runner_up: Option<&'a CudaRow>,
}

/// The fastest and runner-up correct measurement at each of `sizes`, in that order.
pub fn podiums<'a>(rows: &'a [CudaRow], sizes: &[(u64, usize)]) -> Vec<Podium<'a>> {
    sizes
        .iter()
        .map(|&(bytes, _)| {
            let mut here: Vec<&CudaRow> = rows
                .iter()
                .filter(|r| r.bytes == bytes && r.correct && r.skipped.is_none())
                .collect();
            here.sort_by(|a, b| a.p50_us.total_cmp(&b.p50_us));
            Podium {
                bytes,
                fastest: here.first().copied(),
                runner_up: here.get(1).copied(),
            }
        })
        .collect()
}

/// Each choice that was not measured, with why, once (`nccl: no NCCL library`), sorted.
pub fn not_measured(rows: &[CudaRow]) -> Vec<String> {
    rows.iter()
        .filter_map(|r| r.skipped.as_ref().map(|why| format!("{}: {why}", r.algo)))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
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
        kernels: tpar::backend::cuda::kernels::build_id(),
        world_size,
        dtype,
        entries,
        probes: Vec::new(),
    })
}

/// Token counts `tpar tune` times the fused op at (issue 25: 1 to 512).
pub const FUSED_TOKENS: [usize; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

/// The hidden size the fused op is tuned at unless `--hidden` says (Llama-3.1-70B's).
pub const DEFAULT_HIDDEN: usize = 8192;

/// Allreduces (or fused calls) per rank in each timed graph of the fused tuning: fewer than
/// `tpar bench`'s 50, the largest case (512 x 8192 bf16, 8 MiB) being long enough alone.
const FUSED_CHAIN: usize = 20;

/// The fused tuning's outcome: the table, where rank 0 wrote it, the timings it was made from,
/// and the algorithms not measured with why.
#[derive(Serialize)]
pub struct FusedTuned {
    pub table: FusedTable,
    pub written_to: Option<PathBuf>,
    pub rows: Vec<FusedBenchRow>,
    pub not_measured: Vec<String>,
}

/// Times the fused op against allreduce + norm for every algorithm with a fused kernel that
/// this group runs, at `tokens` x `hidden` of `dtype`, and saves the table (rank 0) where the
/// fused calls of this machine find it. `progress` hears each (algorithm, tokens) first.
pub fn run_fused(
    group: &mut CudaRanks,
    topology: &Topology,
    dtype: DType,
    hidden: usize,
    tokens: &[usize],
    iters: usize,
    mut progress: impl FnMut(Algorithm, usize),
) -> Result<FusedTuned> {
    let mut rows = Vec::new();
    let mut not_measured = Vec::new();
    for algorithm in Algorithm::ALL {
        if !tpar::norm::has_fused_kernel(algorithm) {
            continue;
        }
        let cuda = group.comms[0].cuda();
        if let Err(why) = cuda.supports(algorithm) {
            not_measured.push(format!("{algorithm}: {why}"));
            continue;
        }
        let path = group.comms[0].fused_decision(Choice::Tpar(algorithm), dtype, hidden, None);
        if !path.fused {
            not_measured.push(format!("{algorithm}: {}", path.reason));
            continue;
        }
        for &t in tokens {
            progress(algorithm, t);
            rows.extend(fused_bench::time_case(
                group,
                algorithm,
                dtype,
                t,
                hidden,
                &["allreduce + norm", "fused"],
                iters,
                FUSED_CHAIN,
            )?);
        }
    }
    let table = fused_table_from(
        &rows,
        topology.fingerprint(),
        group.world_size,
        dtype,
        hidden,
    );
    let written_to = if group.is_leader() && !table.rows.is_empty() {
        Some(table.save()?)
    } else {
        None
    };
    Ok(FusedTuned {
        table,
        written_to,
        rows,
        not_measured,
    })
}

/// The fused table from timed rows: per algorithm and token count, the fused kernel's and
/// allreduce + norm's times, where both were measured and both were correct.
pub fn fused_table_from(
    rows: &[FusedBenchRow],
    fingerprint: String,
    world_size: usize,
    dtype: DType,
    hidden: usize,
) -> FusedTable {
    let find = |algorithm: &str, tokens: usize, variant: &str| {
        rows.iter().find(|r| {
            r.algorithm == algorithm
                && r.tokens == tokens
                && r.variant == variant
                && r.correct == Some(true)
                && r.p50_us > 0.0
        })
    };
    let mut out: Vec<FusedRow> = Vec::new();
    for r in rows {
        let Ok(algorithm) = r.algorithm.parse::<Algorithm>() else {
            continue;
        };
        if out
            .iter()
            .any(|o| o.algorithm == algorithm && o.tokens == r.tokens)
        {
            continue;
        }
        if let (Some(separate), Some(fused)) = (
            find(r.algorithm, r.tokens, "allreduce + norm"),
            find(r.algorithm, r.tokens, "fused"),
        ) {
            out.push(FusedRow {
                algorithm,
                tokens: r.tokens,
                fused_us: fused.p50_us,
                separate_us: separate.p50_us,
            });
        }
    }
    FusedTable {
        kernels: tpar::backend::cuda::kernels::build_id(),
        fingerprint,
        world_size,
        dtype,
        hidden,
        rows: out,
    }
}

/// "one-shot up to 4 KiB, two-shot up to 64 KiB, nccl above": where the table switches.
pub fn crossovers(table: &TuningTable) -> String {
    tpar::dispatch::describe_ranges(table.entries.iter().map(|e| (e.max_bytes, e.choice)))
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
            why: None,
            launch: None,
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
    fn the_fused_table_pairs_correct_fused_and_separate_rows_per_algorithm_and_tokens() {
        let row = |algorithm: &'static str, tokens, variant, p50_us, correct| FusedBenchRow {
            algorithm,
            world_size: 2,
            tokens,
            hidden: 8192,
            bytes: tokens * 8192 * 2,
            variant,
            p50_us,
            p99_us: p50_us,
            correct: Some(correct),
            launch: None,
        };
        let rows = vec![
            row("one-shot", 1, "allreduce + norm", 6.76, true),
            row("one-shot", 1, "fused", 4.53, true),
            row("one-shot", 64, "allreduce + norm", 19.18, true),
            row("one-shot", 64, "fused", 21.51, true),
            // A wrong fused result is no measurement.
            row("two-shot", 16, "allreduce + norm", 9.79, true),
            row("two-shot", 16, "fused", 6.53, false),
        ];
        let t = fused_table_from(&rows, "fp".into(), 2, DType::Bf16, 8192);
        assert_eq!(t.rows.len(), 2, "{t:?}");
        assert_eq!(
            (t.rows[1].tokens, t.rows[1].fused_us, t.rows[1].separate_us),
            (64, 21.51, 19.18)
        );
        // The fused decision then never fuses at 64 tokens on this machine, and does at 1.
        let at = |tokens| {
            tpar::dispatch::decide_fused(
                Choice::Tpar(Algorithm::OneShot),
                DType::Bf16,
                8192,
                65536,
                tpar::norm::Prefer::Faster {
                    world_size: 2,
                    tokens,
                    measured: Some(&t),
                },
            )
            .fused
        };
        assert!(at(1) && !at(64) && !at(32));
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

    #[test]
    fn podiums_rank_correct_rows_and_skips_are_listed_once() {
        let mut wrong = row(4096, "two-shot", 1.0);
        wrong.correct = false;
        let mut skipped = row(4096, "nccl", 0.0);
        skipped.skipped = Some("no NCCL".into());
        let rows = vec![
            row(4096, "one-shot", 4.0),
            wrong,
            skipped.clone(),
            row(4096, "one-shot-pull", 3.0),
            row(65536, "one-shot", 6.0),
            skipped,
        ];
        let podiums = podiums(&rows, &[(4096, 2048), (65536, 32768), (1 << 20, 0)]);
        fn names<'a>(p: &Podium<'a>) -> (Option<&'a str>, Option<&'a str>) {
            (
                p.fastest.map(|r| r.algo.as_str()),
                p.runner_up.map(|r| r.algo.as_str()),
            )
        }
        assert_eq!(
            names(&podiums[0]),
            (Some("one-shot-pull"), Some("one-shot"))
        );
        assert_eq!(names(&podiums[1]), (Some("one-shot"), None));
        assert_eq!(names(&podiums[2]), (None, None));
        assert_eq!(not_measured(&rows), ["nccl: no NCCL"]);
    }
}
