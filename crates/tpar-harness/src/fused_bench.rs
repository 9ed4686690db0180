//! The fused allreduce + residual add + RMSNorm in the harness: its selftest rows (every path,
//! odd hidden sizes, 1 and many tokens, in place and not, eager and graph-replayed, each rank's
//! `residual_out` and `y` compared bitwise with the CPU reference of `tpar::norm`; a peer
//! timeout and a mismatched call), and `tpar bench --fused`: the fused op against the plain
//! allreduce of the same bytes and against the allreduce followed by tpar's separate
//! residual + RMSNorm kernel, each in a graph chain per rank (ranks as streams).

use std::time::{Duration, Instant};

use serde::Serialize;
use tpar::backend::cuda::driver::{self, DeviceMemory};
use tpar::backend::cuda::fused::{FusedInput, FusedResidual, FusedSpans};
use tpar::backend::cuda::LaunchShape;
use tpar::check::fill_input;
use tpar::dispatch::Choice;
use tpar::Config;
use tpar::{Algorithm, DType, Error};

use super::cuda_bench::time_replays;
use super::cuda_ranks::CudaRanks;
use super::cuda_ranks::MakeGroup;
use super::selftest_row::SelftestRow;
use super::stats::percentile;
use super::{Context, Result};

/// Inputs of one case for every rank of the job, and the reference outputs.
struct HostCase {
    dtype: DType,
    tokens: usize,
    hidden: usize,
    eps: f32,
    xs: Vec<Vec<u8>>,
    residual: Vec<u8>,
    weight: Vec<u8>,
    residual_out: Vec<u8>,
    y: Vec<u8>,
}

impl HostCase {
    fn new(dtype: DType, tokens: usize, hidden: usize, world_size: usize, seed: u64) -> HostCase {
        let bytes = tokens * hidden * dtype.size();
        let xs: Vec<Vec<u8>> = (0..world_size)
            .map(|r| {
                let mut x = vec![0u8; bytes];
                fill_input(dtype, seed, r, &mut x);
                x
            })
            .collect();
        let mut residual = vec![0u8; bytes];
        fill_input(dtype, seed ^ 0x5eed, 0, &mut residual);
        let mut weight = vec![0u8; hidden * dtype.size()];
        fill_input(dtype, seed ^ 0x3e1, 1, &mut weight);
        let eps = 1e-6;
        let refs: Vec<&[u8]> = xs.iter().map(Vec::as_slice).collect();
        let (residual_out, y) =
            tpar::norm::fused_reference(dtype, &refs, &residual, &weight, hidden, eps);
        HostCase {
            dtype,
            tokens,
            hidden,
            eps,
            xs,
            residual,
            weight,
            residual_out,
            y,
        }
    }
}

/// One local rank's buffers.
struct FusedBuffers {
    x: DeviceMemory,
    residual: DeviceMemory,
    residual_out: DeviceMemory,
    y: DeviceMemory,
    weight: DeviceMemory,
}

fn buffers(group: &CudaRanks, case: &HostCase) -> Result<Vec<FusedBuffers>> {
    let bytes = case.residual.len().max(4);
    group
        .comms
        .iter()
        .map(|c| {
            let alloc = |b| DeviceMemory::zeroed(c.cuda().context(), b);
            Ok(FusedBuffers {
                x: alloc(bytes)?,
                residual: alloc(bytes)?,
                residual_out: alloc(bytes)?,
                y: alloc(bytes)?,
                weight: alloc(case.weight.len().max(4))?,
            })
        })
        .collect()
}

/// Inputs in place; outputs poisoned, so that an unwritten element cannot pass.
fn upload(group: &CudaRanks, bufs: &[FusedBuffers], case: &HostCase) -> Result<()> {
    for (i, b) in bufs.iter().enumerate() {
        b.x.upload(&case.xs[group.ranks[i]])?;
        b.residual.upload(&case.residual)?;
        b.weight.upload(&case.weight)?;
        b.residual_out.fill(0xA5)?;
        b.y.fill(0xA5)?;
    }
    Ok(())
}

/// The case's operands in `b`. In place: residual_out is residual and y is x (vLLM's
/// convention); else separate buffers. The spans borrow `b` only while a call is queued.
fn spans<'a>(b: &'a mut FusedBuffers, case: &HostCase, in_place: bool) -> Result<FusedSpans<'a>> {
    let (dtype, elements) = (case.dtype, case.tokens * case.hidden);
    let FusedBuffers {
        x,
        residual,
        residual_out,
        y,
        weight,
    } = b;
    let (input, residual) = if in_place {
        (
            FusedInput::YIntoX(x.span_mut(dtype, elements)?),
            FusedResidual::InPlace(residual.span_mut(dtype, elements)?),
        )
    } else {
        (
            FusedInput::Separate {
                x: x.span(dtype, elements)?,
                y: y.span_mut(dtype, elements)?,
            },
            FusedResidual::Separate {
                residual: residual.span(dtype, elements)?,
                out: residual_out.span_mut(dtype, elements)?,
            },
        )
    };
    Ok(FusedSpans {
        input,
        residual,
        weight: weight.span(dtype, case.hidden)?,
        tokens: case.tokens,
        hidden: case.hidden,
        eps: case.eps,
    })
}

/// Local ranks whose residual_out or y differs bitwise from the reference (each described).
fn wrong(group: &CudaRanks, bufs: &[FusedBuffers], case: &HostCase, in_place: bool) -> Result<u64> {
    let mut bad = 0;
    let mut host = vec![0u8; case.residual.len()];
    for (i, b) in bufs.iter().enumerate() {
        let outputs = [
            (
                "residual_out",
                if in_place {
                    &b.residual
                } else {
                    &b.residual_out
                },
                &case.residual_out,
            ),
            ("y", if in_place { &b.x } else { &b.y }, &case.y),
        ];
        for (name, buffer, expected) in outputs {
            buffer.download(&mut host)?;
            if let Some((index, got, want)) =
                tpar::check::first_mismatch(case.dtype, &host, expected)
            {
                bad += 1;
                super::ranks::say(
                    group.ranks[i],
                    &format!(
                        "fused {} x {} {}: {name} element {index} is {got}, the reference {want}",
                        case.tokens, case.hidden, case.dtype
                    ),
                );
                break;
            }
        }
    }
    Ok(bad)
}

/// One row of the selftest table: cells, ranks that failed, detail.
struct FusedRow {
    cells: [String; 5],
    bad: u64,
    detail: String,
}

impl FusedRow {
    fn into_row(self) -> SelftestRow {
        SelftestRow::tallied(self.cells.to_vec(), self.bad, self.detail)
    }
}

/// (tokens, hidden): 1 and many tokens, odd hidden sizes, several launches (512 x 2048 bf16
/// is 8 chunks), the fused kernel's largest hidden size, and rows above it that only the
/// separate norm kernel takes: 20000 and 40000 are 20 and 40 segments in f32 (10 and 20 in
/// f16/bf16), more than its shared arrays hold at once (a row of 20000 f32 overran them and
/// faulted before 2026-12-01's fix).
const SHAPES: [(usize, usize); 8] = [
    (1, 8192),
    (8, 4099),
    (3, 7),
    (512, 2048),
    (2, 16383),
    (1, 16384),
    (2, 20000),
    (1, 40000),
];

/// The fused op's selftest rows on groups built by `make`: every dtype of `dtypes` on one-shot,
/// host-staged, two-shot and pull (each fused where the fused decision says, else the allreduce + the
/// separate norm kernel: pull, and rows above the fused kernels' hidden size), then, with
/// `failure_cases`, a silent peer and a mismatched call on the fused one-shot and two-shot
/// kernels.
pub fn selftest(
    make: MakeGroup<'_>,
    dtypes: &[DType],
    timeout: Duration,
    failure_cases: bool,
) -> Result<Vec<SelftestRow>> {
    let mut rows = Vec::new();
    let mut group = make(Config {
        timeout,
        ..Config::default()
    })?;
    let algorithms = [
        Algorithm::OneShot,
        Algorithm::HostStaged,
        Algorithm::TwoShot,
        Algorithm::OneShotPull,
    ];
    for &dtype in dtypes {
        for (s, &(tokens, hidden)) in SHAPES.iter().enumerate() {
            let case = HostCase::new(dtype, tokens, hidden, group.world_size, 60 + s as u64);
            let mut bufs = buffers(&group, &case)?;
            for algorithm in algorithms {
                let name = format!("fused {}", algorithm.name());
                if let Err(why) = group.comms[0].cuda().supports(algorithm) {
                    rows.push(FusedRow {
                        cells: [
                            name,
                            dtype.name().into(),
                            "-".into(),
                            "-".into(),
                            "-".into(),
                        ],
                        bad: 0,
                        detail: format!(" (skipped: {why})"),
                    });
                    continue;
                }
                let path =
                    group.comms[0].fused_decision(Choice::Tpar(algorithm), dtype, hidden, None);
                let path_name = if path.fused { "fused" } else { "unfused" };
                for in_place in [false, true] {
                    let placement = if in_place { "in place" } else { "out of place" };
                    let queue = |group: &CudaRanks,
                                 b: &mut FusedBuffers,
                                 i: usize,
                                 stream: &cudarc::driver::CudaStream|
                     -> Result<()> {
                        group.comms[i].fused_add_rms_norm_as(
                            Choice::Tpar(algorithm),
                            spans(b, &case, in_place)?,
                            stream,
                        )?;
                        Ok(())
                    };
                    // A failure names the case: a hang at 8 ranks (1 H200, 2026-12-01) was
                    // reported only as a timeout.
                    let what =
                        || format!("fused {algorithm} {dtype} {tokens} x {hidden} {placement}");
                    // Eager, twice (two epochs, two buffers of the triple).
                    let mut bad = 0;
                    for _ in 0..2 {
                        upload(&group, &bufs, &case)?;
                        for (i, s) in group.streams.iter().enumerate() {
                            queue(&group, &mut bufs[i], i, s)?;
                        }
                        group
                            .synchronize()
                            .with_context(|| format!("{}, eager", what()))?;
                        bad += wrong(&group, &bufs, &case, in_place)?;
                    }
                    let shape = format!("{tokens} x {hidden}");
                    rows.push(FusedRow {
                        cells: [
                            name.clone(),
                            dtype.name().into(),
                            shape.clone(),
                            placement.into(),
                            "eager".into(),
                        ],
                        bad: group.total(bad)?,
                        detail: format!(" ({path_name})"),
                    });
                    // Captured once, replayed twice with fresh inputs.
                    let graph = group.capture(|i, s| queue(&group, &mut bufs[i], i, s))?;
                    let mut bad = 0;
                    for _ in 0..2 {
                        upload(&group, &bufs, &case)?;
                        graph.launch()?;
                        group
                            .synchronize()
                            .with_context(|| format!("{}, graph", what()))?;
                        bad += wrong(&group, &bufs, &case, in_place)?;
                    }
                    drop(graph);
                    rows.push(FusedRow {
                        cells: [
                            name.clone(),
                            dtype.name().into(),
                            shape,
                            placement.into(),
                            "graph".into(),
                        ],
                        bad: group.total(bad)?,
                        detail: format!(" ({path_name})"),
                    });
                }
            }
        }
    }
    drop(group);
    if failure_cases {
        for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
            rows.push(silent_peer(make, algorithm)?);
            rows.push(mismatched_rows(make, algorithm)?);
        }
    }
    Ok(rows.into_iter().map(FusedRow::into_row).collect())
}

const CASE_DEADLINE: Duration = Duration::from_secs(1);

/// What a failure row is called: one-shot's as it always was, others with the algorithm.
fn failure_row_name(algorithm: Algorithm, what: &str) -> String {
    if algorithm == Algorithm::OneShot {
        format!("fused {what}")
    } else {
        format!("fused {} {what}", algorithm.name())
    }
}

/// The last rank never calls: every other rank's fused kernel must give up at its deadline,
/// naming that rank. Two-shot: 8 x 4096 (16 row segments), so that every rank of up to 16
/// owns a segment and waits for the silent rank's pushes in the reduce-scatter, whose waits
/// end before the all-gather's (twoshot_fused.cu).
fn silent_peer(make: MakeGroup<'_>, algorithm: Algorithm) -> Result<FusedRow> {
    let mut group = make(Config {
        timeout: CASE_DEADLINE,
        host_staged: false,
        ..Config::default()
    })?;
    let silent = group.world_size - 1;
    let tokens = if algorithm == Algorithm::TwoShot {
        8
    } else {
        2
    };
    let case = HostCase::new(DType::Bf16, tokens, 4096, group.world_size, 7);
    let mut bufs = buffers(&group, &case)?;
    upload(&group, &bufs, &case)?;
    let start = Instant::now();
    for (i, b) in bufs.iter_mut().enumerate() {
        if group.ranks[i] != silent {
            group.comms[i].fused_add_rms_norm_as(
                Choice::Tpar(algorithm),
                spans(b, &case, false)?,
                &group.streams[i],
            )?;
        }
    }
    let (bad, detail) = group.tally_silent_peer(silent, start, CASE_DEADLINE);
    Ok(FusedRow {
        cells: [
            failure_row_name(algorithm, "peer timeout"),
            "bf16".into(),
            format!("{tokens} x 4096"),
            "-".into(),
            format!("rank {silent} silent"),
        ],
        bad: group.total(bad)?,
        detail,
    })
}

/// Rank 0 calls 1 x 8192, the others 2 x 4096 (the same bytes and lines, another row length):
/// every rank must report a mismatched call, none a result.
fn mismatched_rows(make: MakeGroup<'_>, algorithm: Algorithm) -> Result<FusedRow> {
    let mut group = make(Config {
        timeout: CASE_DEADLINE,
        host_staged: false,
        ..Config::default()
    })?;
    let wide = HostCase::new(DType::Bf16, 1, 8192, group.world_size, 8);
    let narrow = HostCase::new(DType::Bf16, 2, 4096, group.world_size, 8);
    let mut bufs = buffers(&group, &wide)?;
    for (i, b) in bufs.iter_mut().enumerate() {
        // Both shapes are the same bytes: the buffers fit either.
        let case = if group.ranks[i] == 0 { &wide } else { &narrow };
        group.comms[i].fused_add_rms_norm_as(
            Choice::Tpar(algorithm),
            spans(b, case, false)?,
            &group.streams[i],
        )?;
    }
    let (bad, detail) = group.tally_mismatch();
    Ok(FusedRow {
        cells: [
            failure_row_name(algorithm, "mismatch"),
            "bf16".into(),
            "1 x 8192 vs 2 x 4096".into(),
            "-".into(),
            "eager".into(),
        ],
        bad: group.total(bad)?,
        detail,
    })
}

/// Times `variants` (of [`VARIANTS`]) of the fused op with `tokens` x `hidden` rows of `dtype`
/// on `group`'s ranks, the allreduce on `algorithm`, each variant in a graph chain of `chain`
/// per rank over `iters` replays; the norm-producing variants are checked against the CPU
/// reference. `tpar bench --fused` and `tpar tune` both time this way.
#[allow(clippy::too_many_arguments)]
pub fn time_case(
    group: &mut CudaRanks,
    algorithm: Algorithm,
    dtype: DType,
    tokens: usize,
    hidden: usize,
    variants: &[&'static str],
    iters: usize,
    chain: usize,
) -> Result<Vec<FusedBenchRow>> {
    let n = group.world_size;
    let case = HostCase::new(dtype, tokens, hidden, n, 90 + tokens as u64);
    let mut bufs = buffers(group, &case)?;
    upload(group, &bufs, &case)?;
    let count = tokens * hidden;
    // The fused variant runs the fused kernel wherever it can run (where it cannot, the call
    // runs the allreduce and the separate norm kernel, and the row says so by its time).
    let fused = tpar::dispatch::fused_eligibility(
        Choice::Tpar(algorithm),
        dtype,
        hidden,
        group.comms[0].cuda().payload_lines(),
    )
    .is_ok();
    let mut rows = Vec::new();
    for &variant in variants {
        let one = |group: &CudaRanks,
                   b: &mut FusedBuffers,
                   i: usize,
                   s: &cudarc::driver::CudaStream|
         -> Result<()> {
            let cuda = group.comms[i].cuda();
            match variant {
                "empty kernel" => cuda.launch_empty(s)?,
                "allreduce" => cuda.all_reduce(
                    Some(b.x.span(dtype, count)?),
                    b.y.span_mut(dtype, count)?,
                    algorithm,
                    s,
                )?,
                "norm kernel" => cuda.add_rms_norm(spans(b, &case, false)?, Some(0), s)?,
                "allreduce + norm" => {
                    cuda.unfused_add_rms_norm(spans(b, &case, false)?, algorithm, s)?
                }
                _ => {
                    cuda.fused_add_rms_norm(spans(b, &case, false)?, algorithm, fused, s)?;
                }
            }
            Ok(())
        };
        let shared: &CudaRanks = group;
        let graphs = shared.capture_each(|i, s| -> Result<()> {
            for _ in 0..chain {
                one(shared, &mut bufs[i], i, s)?;
            }
            Ok(())
        })?;
        // The chain's last launch (the norm kernel's after "allreduce + norm"). The empty
        // kernel is not one of tpar's launches: the communicator's record would be the
        // previous variant's.
        let launch = match variant {
            "empty kernel" => None,
            _ => shared.comms[0].cuda().last_launch(),
        };
        let warmup = (iters / 10).max(5);
        let us = time_replays(shared, &graphs, warmup, iters)
            .with_context(|| format!("{n} ranks, {tokens} tokens, {variant}"))?;
        drop(graphs);
        let correct = match variant {
            "allreduce + norm" | "fused" => {
                Some(group.total(wrong(group, &bufs, &case, false)?)? == 0)
            }
            _ => None,
        };
        if variant == "allreduce + norm" {
            upload(group, &bufs, &case)?; // the fused rows must write their own outputs
        }
        rows.push(FusedBenchRow {
            algorithm: algorithm.name(),
            world_size: n,
            tokens,
            hidden,
            bytes: count * dtype.size(),
            variant,
            p50_us: percentile(&us, 50.0) / chain as f64,
            p99_us: percentile(&us, 99.0) / chain as f64,
            correct,
            launch,
        });
    }
    Ok(rows)
}

/// One timed variant of one case of `tpar bench --fused`.
#[derive(Serialize, Clone, Debug)]
pub struct FusedBenchRow {
    /// tpar's algorithm of the allreduce in every variant but the norm kernel alone.
    pub algorithm: &'static str,
    pub world_size: usize,
    pub tokens: usize,
    pub hidden: usize,
    pub bytes: usize,
    pub variant: &'static str,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Checked against the CPU reference after the replays (the norm-producing variants).
    pub correct: Option<bool>,
    /// How the first rank's last kernel of the timed chain was launched: the fused kernel in
    /// the fused rows, the norm kernel after "allreduce + norm".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub launch: Option<LaunchShape>,
}

/// The rows of a fused bench, where they ran, and the world sizes that failed (with the error):
/// a failing world size is reported beside the others' figures, not instead of them.
pub struct FusedBench {
    pub algorithm: Algorithm,
    pub device: String,
    pub driver_version: i32,
    pub hidden: usize,
    pub rows: Vec<FusedBenchRow>,
    pub errors: Vec<String>,
}

/// The variants timed per case, in table order.
pub const VARIANTS: [&str; 5] = [
    "empty kernel",
    "allreduce",
    "norm kernel",
    "allreduce + norm",
    "fused",
];

/// Token counts `tpar bench --fused` times by default.
pub const DEFAULT_TOKENS: [usize; 2] = [1, 8];

/// The most tokens a `tpar bench --fused` case takes (the range: 1 to 512).
pub const MAX_TOKENS: usize = 512;

/// The algorithms `tpar bench --fused` can time: those with a fused kernel, in
/// [`Algorithm::ALL`]'s order.
pub fn fused_algorithms() -> Vec<Algorithm> {
    Algorithm::ALL
        .into_iter()
        .filter(|&a| tpar::norm::has_fused_kernel(a))
        .collect()
}

/// `tpar bench --fused`: bf16, hidden 8192, `tokens` per case, -n ranks as streams on GPU 0
/// (2 and 8 when `world_size` is `None`), the allreduce on `algorithm` (one of
/// [`fused_algorithms`]); each variant in a graph chain of `chain` per rank, `iters` timed
/// replays. A case whose fused call would not run fused (a row too long for a slot) is
/// reported as an error, not timed as if it were.
pub fn measure(
    world_size: Option<usize>,
    algorithm: Algorithm,
    tokens: &[usize],
    iters: usize,
    chain: usize,
) -> FusedBench {
    let dtype = DType::Bf16;
    let hidden = 8192;
    let sizes = world_size.map_or(vec![2, 8], |n| vec![n]);
    let mut rows = Vec::new();
    let mut device = String::new();
    let mut driver_version = 0;
    let mut errors = Vec::new();
    for &n in &sizes {
        // A failing world size is reported beside the others' figures, not instead of them.
        let mut measure = || -> Result<()> {
            let mut group = CudaRanks::threads(n, Config::default())?;
            if device.is_empty() {
                device = group.comms[0].cuda().context().name().unwrap_or_default();
                driver_version = driver::driver_version()?;
            }
            let path = group.comms[0].fused_decision(Choice::Tpar(algorithm), dtype, hidden, None);
            if !path.fused {
                return Err(Error::Unsupported(format!(
                    "the fused op on {algorithm} would not run fused: {}",
                    path.reason
                ))
                .into());
            }
            for &tokens in tokens {
                rows.extend(time_case(
                    &mut group, algorithm, dtype, tokens, hidden, &VARIANTS, iters, chain,
                )?);
            }
            Ok(())
        };
        if let Err(e) = measure() {
            errors.push(format!("{n} ranks: {}", e.chain()));
        }
    }
    FusedBench {
        algorithm,
        device,
        driver_version,
        hidden,
        rows,
        errors,
    }
}
