//! `tpar selftest --backend cuda`: every algorithm x dtype x element count x placement, eager
//! and replayed from a CUDA graph, each compared bitwise with the exact sum (the kernels
//! accumulate in fp32 in rank order, as the reference does); a graph replayed 1000 times with
//! new inputs each time; and a peer-timeout case after which a fresh group must pass.
//! Rows are counted across ranks (a row fails when any rank got a wrong bit); the caller
//! prints them.

use std::time::{Duration, Instant};

use tpar::check::{fill_expected, fill_input};
use tpar::dispatch::Choice;
use tpar::Config;
use tpar::{Algorithm, DType};

use super::cuda_ranks::{say_findings, CudaRanks, RankBuffers};
use super::known::KnownData;
// Also at their old paths here, for the callers that name them so.
pub use super::cuda_ranks::MakeGroup;
pub use super::selftest_row::SelftestRow;
use super::Result;
use tpar::algorithm::Selection;
use tpar::verify::{self, CheckSpec};

pub struct CudaSelftestSettings {
    pub counts: Vec<usize>,
    pub dtypes: Vec<DType>,
    pub algorithms: Vec<Algorithm>,
    pub timeout: Duration,
    pub timeout_case: bool,
    pub replays: usize,
    /// The island partition of the islands algorithms (`Config::islands`; `None`: the
    /// machine's).
    pub islands: Option<tpar::Islands>,
}

const CASE_DEADLINE: Duration = Duration::from_secs(1);

/// The two inputs every row alternates between.
const SEEDS: [u64; 2] = [31, 32];

/// Adds the row of one case of the sweep (algorithm, dtype, count, placement) run in `mode`
/// ("eager" or "graph"), from this rank's count of wrong outputs tallied across the ranks.
fn record_case(
    rows: &mut Vec<SelftestRow>,
    group: &mut CudaRanks,
    case: [&str; 4],
    mode: &str,
    wrong: u64,
) -> Result<()> {
    let bad = group.total(wrong)?;
    let [algo, dtype, count, placement] = case;
    let cells = [algo, dtype, count, placement, mode]
        .map(String::from)
        .to_vec();
    rows.push(SelftestRow::tallied(cells, bad, String::new()));
    Ok(())
}

/// The rows of a sweep, and whether this process holds rank 0 (which prints them).
pub struct Sweep {
    pub rows: Vec<SelftestRow>,
    pub leader: bool,
}

/// Runs the sweep on the groups `make` builds (all ranks here, or this process's rank).
pub fn run(make: MakeGroup<'_>, plan: &CudaSelftestSettings) -> Result<Sweep> {
    let mut rows = Vec::new();
    let mut leader = false;
    let record = |rows: &mut Vec<SelftestRow>, cells: [&str; 5], bad: u64, detail: String| {
        rows.push(SelftestRow::tallied(
            cells.iter().map(|c| c.to_string()).collect(),
            bad,
            detail,
        ));
    };

    if plan.timeout_case {
        let mut group = make(Config {
            timeout: CASE_DEADLINE,
            host_staged: false,
            ..Config::default()
        })?;
        let silent = group.world_size - 1;
        let mut buffers = group.buffers(4096)?;
        let start = Instant::now();
        for i in 0..group.comms.len() {
            if group.ranks[i] != silent {
                group.queue(
                    i,
                    &group.streams[i],
                    &mut buffers,
                    Some(0),
                    DType::F32,
                    1024,
                    Selection::Forced(Choice::Tpar(Algorithm::OneShot)),
                )?;
            }
        }
        let (bad, detail) = group.tally_silent_peer(silent, start, CASE_DEADLINE);
        let bad = group.total(bad)?;
        leader |= group.is_leader();
        record(
            &mut rows,
            [
                "peer timeout",
                "-",
                "-",
                "-",
                &format!("rank {silent} silent"),
            ],
            bad,
            detail,
        );
    }

    // A fresh group: the GPU and the process must be fine after the timeout.
    let mut group = make(Config {
        timeout: plan.timeout,
        islands: plan.islands,
        ..Config::default()
    })?;
    leader |= group.is_leader();
    let max_count = plan.counts.iter().copied().max().unwrap_or(0);
    for &dtype in &plan.dtypes {
        let known = group.known(dtype, max_count, SEEDS);
        let mut buffers = group.buffers(max_count * dtype.size())?;
        group.upload_inputs(&buffers, &known, max_count)?;
        for &algo in &plan.algorithms {
            if let Err(why) = group.supports(Selection::Forced(Choice::Tpar(algo))) {
                record(
                    &mut rows,
                    [algo.name(), dtype.name(), "-", "-", "-"],
                    0,
                    format!(" (skipped: {why})"),
                );
                continue;
            }
            for &count in &plan.counts {
                let count_text = count.to_string();
                for in_place in [false, true] {
                    let placement = if in_place { "in place" } else { "out of place" };
                    let case = [algo.name(), dtype.name(), &count_text, placement];
                    // Eager: the one numerical check, two calls with different inputs.
                    let spec = CheckSpec {
                        dtype,
                        counts: &[count],
                        calls: 2,
                        in_place,
                        seeds: SEEDS,
                    };
                    let findings = verify::check(&group, algo, &spec)?;
                    say_findings(&findings, dtype);
                    record_case(&mut rows, &mut group, case, "eager", findings.len() as u64)?;

                    // Graph: captured once, replayed with new data in the same buffers.
                    let graph = group.capture(|i, stream| -> Result<()> {
                        group.queue(
                            i,
                            stream,
                            &mut buffers,
                            (!in_place).then_some(0),
                            dtype,
                            count,
                            Selection::Forced(Choice::Tpar(algo)),
                        )
                    })?;
                    let mut wrong = 0;
                    for variant in 0..2 {
                        for (b, k) in buffers.iter().zip(&known) {
                            b.inputs[0].upload(k.input(variant, count))?;
                        }
                        prepare_output(&buffers, &known, count, variant, in_place)?;
                        graph.launch()?;
                        group.synchronize()?;
                        wrong += group.wrong_outputs(&buffers, &known, count, variant, dtype)?;
                    }
                    drop(graph);
                    group.upload_inputs(&buffers, &known, max_count)?;
                    record_case(&mut rows, &mut group, case, "graph", wrong)?;
                }
            }
        }
    }

    // One graph per algorithm replayed many times, new inputs before every replay.
    let count = 4099;
    let dtype = DType::Bf16;
    let mut buffers = group.buffers(count * dtype.size())?;
    let mut host = vec![0u8; count * dtype.size()];
    let mut expected = host.clone();
    for &algo in &plan.algorithms {
        if group
            .supports(Selection::Forced(Choice::Tpar(algo)))
            .is_err()
            || plan.replays == 0
        {
            continue;
        }
        let graph = group.capture(|i, stream| -> Result<()> {
            group.queue(
                i,
                stream,
                &mut buffers,
                Some(0),
                dtype,
                count,
                Selection::Forced(Choice::Tpar(algo)),
            )
        })?;
        let mut wrong = 0;
        for replay in 0..plan.replays {
            let seed = 1000 + replay as u64;
            for (i, b) in buffers.iter().enumerate() {
                fill_input(dtype, seed, group.ranks[i], &mut host);
                b.inputs[0].upload(&host)?;
            }
            graph.launch()?;
            group.synchronize()?;
            fill_expected(dtype, seed, group.world_size, &mut expected);
            for b in &buffers {
                b.output.download(&mut host)?;
                wrong += u64::from(host != expected);
            }
        }
        let bad = group.total(wrong)?;
        record(
            &mut rows,
            [
                algo.name(),
                dtype.name(),
                &count.to_string(),
                "out of place",
                &format!("graph x{}", plan.replays),
            ],
            bad,
            " (new inputs before every replay)".to_owned(),
        );
    }
    drop(buffers);
    drop(group);
    // The fused allreduce + residual add + RMSNorm, with one-shot in the sweep (`--algos
    // two-shot` leaves them out).
    if plan.algorithms.contains(&Algorithm::OneShot) {
        rows.extend(super::fused_bench::selftest(
            make,
            &plan.dtypes,
            plan.timeout,
            plan.timeout_case,
        )?);
    }
    Ok(Sweep { rows, leader })
}

/// In place: the output starts as the input. Out of place: poisoned, so that an unwritten
/// element cannot pass.
fn prepare_output(
    buffers: &[RankBuffers],
    known: &[KnownData],
    count: usize,
    variant: usize,
    in_place: bool,
) -> Result<()> {
    for (b, k) in buffers.iter().zip(known) {
        if in_place {
            b.output.upload(k.input(variant, count))?;
        } else {
            b.output.fill(0xA5)?;
        }
    }
    Ok(())
}
