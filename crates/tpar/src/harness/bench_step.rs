//! `tpar bench step`: one tensor-parallel forward pass (a decode step, or a speculative verify
//! pass over several tokens) on real GPUs: each rank's share of the projection and MLP GEMMs
//! (cuBLAS, random bf16 weights of the model's shapes) and the two allreduces per layer, each
//! followed by its residual add + RMSNorm, captured as one CUDA graph and replayed. The same
//! pass is timed with no allreduce (the compute: GEMMs and the norms as separate kernels), and
//! with each way of reducing asked for (NCCL, tpar's dispatcher, a forced tpar algorithm), the
//! norms run as a separate kernel after each allreduce (as engines run them) and, for tpar's
//! routes, fused into it (`Communicator::fused_add_rms_norm_raw`): the difference from the
//! compute is what communication costs the pass. See `tpar::planner::step` for what the pass
//! holds and leaves out.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use cudarc::driver::CudaGraph;
use serde::Serialize;
use tpar::backend::cuda::driver::DeviceMemory;
use tpar::backend::cuda::fused::FusedCall;
use tpar::dispatch::Choice;
use tpar::memory::human_bytes;
use tpar::planner::model::ModelShape;
use tpar::planner::step::{pass_ops, slot_elements, Slot, StepOp};
use tpar::DType;

use crate::args::parse_list;
use crate::backend_choice::cuda_device;
use crate::blas::Blas;
use crate::cuda_commands::{config, on_ranks};
use crate::report::{emit, name_with_runs, percentile, skipped_row, Provenance, Table};
use tpar::harness::cuda_bench::time_replays;
use tpar::harness::cuda_ranks::{stream_is_capturing, CudaRanks, Route};

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct StepArgs {
    /// The model's Hugging Face config.json (layers, hidden size, heads, MLP, MLA and MoE fields).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Tensor-parallel size: the number of ranks (round-robin over the GPUs; on fewer GPUs than
    /// ranks they share, which times the protocol but not a real TP machine).
    #[arg(long = "world-size", short = 'n', alias = "tp", value_name = "N", value_parser = crate::args::world_size_arg)]
    tp: usize,
    /// Tokens per pass: 1 for a plain decode step, draft tokens + 1 for a verify pass.
    #[arg(long, default_value_t = 1)]
    tokens: usize,
    /// Layers in the pass [default: the config's num_hidden_layers].
    #[arg(long)]
    layers: Option<u64>,
    #[arg(long, default_value = "nccl,auto", value_name = "LIST", help = concat!(
        "How the allreduces run, comma-separated, from: ", tpar::route_names!(),
        " (auto: tpar's dispatcher, NCCL included). The pass without allreduces is always timed too"
    ))]
    algos: String,
    /// How the norm after each allreduce runs, comma-separated, from: separate (its own kernel
    /// after the allreduce, as engines run it), fused (one call with tpar's allreduce; NCCL
    /// rows have no fused form).
    #[arg(long, default_value = "separate,fused", value_name = "LIST")]
    norms: String,
    /// Timed replays of each pass's graph.
    #[arg(long, default_value_t = 20, value_parser = crate::args::iterations_arg)]
    replays: usize,
    /// One process per rank (CUDA IPC) instead of one process driving every rank; NCCL needs it
    /// with more than one rank [default: on when every rank has a GPU of its own].
    #[arg(long)]
    processes: bool,
    /// Seconds a rank waits for a peer before it fails the run, naming the peer.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = crate::args::timeout_arg)]
    timeout: std::time::Duration,
    /// Write results as JSON to PATH; `-` writes JSON to stdout and the table to stderr.
    #[arg(long, value_name = "PATH|-")]
    json: Option<String>,
}

/// RMSNorm epsilon of the pass (Llama's and DeepSeek's `rms_norm_eps`); it does not change
/// the time.
const EPS: f32 = 1e-5;

/// How a pass runs the norm after each allreduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Norms {
    /// The allreduce, then tpar's residual add + RMSNorm kernel on its own.
    Separate,
    /// One fused call (`fused_add_rms_norm`); where the allreduce's algorithm has no fused
    /// kernel it runs as the allreduce and the norm kernel, and the row says so.
    Fused,
}

impl std::str::FromStr for Norms {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "separate" => Ok(Norms::Separate),
            "fused" => Ok(Norms::Fused),
            other => Err(format!(
                "unknown norm mode '{other}'; give separate or fused"
            )),
        }
    }
}

/// What reduces in one timed pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reduce {
    /// No allreduce: the compute alone (GEMMs and the norms as separate kernels).
    Nothing,
    With(Route, Norms),
}

impl Reduce {
    fn name(self) -> String {
        match self {
            Reduce::Nothing => "none (compute only)".into(),
            Reduce::With(r, Norms::Separate) => r.name().into(),
            Reduce::With(r, Norms::Fused) => format!("{} fused", r.name()),
        }
    }
}

#[derive(Serialize)]
struct StepRow {
    reduce: String,
    /// What `auto` ran for this pass's message size.
    #[serde(skip_serializing_if = "Option::is_none")]
    runs: Option<String>,
    /// How the norms ran: "separate", or "fused" / "unfused: why" for fused rows (the plan
    /// of the captured pass).
    norms: String,
    pass_p50_us: f64,
    pass_p99_us: f64,
    /// The pass's time minus the compute-only pass's.
    communication_us: f64,
    communication_share: f64,
    per_allreduce_us: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped: Option<String>,
}

#[derive(Serialize)]
struct StepReport {
    model: String,
    tp: usize,
    tokens: usize,
    layers: u64,
    allreduces_per_pass: u64,
    /// Residual add + RMSNorms per pass: one after each allreduce.
    norms_per_pass: u64,
    allreduce_bytes: u64,
    gemms_per_pass: usize,
    weight_bytes_per_rank_per_layer: u64,
    mode: &'static str,
    gpus: usize,
    #[serde(flatten)]
    provenance: Provenance,
    replays: usize,
    timing: &'static str,
    results: Vec<StepRow>,
}

/// One rank's buffers: activations by slot and the weights of each op of a dense and of a MoE
/// layer (layers of a kind share weights: each is larger than the GPU's L2 cache, so reuse
/// across layers does not make them cheaper to read).
struct RankData {
    blas: Blas,
    slots: Vec<(Slot, DeviceMemory)>,
    /// `weights[kind][op]`: kind 0 for the first layer's op list, 1 for MoE layers'.
    weights: [Vec<Option<DeviceMemory>>; 2],
    /// The RMSNorm weight (`hidden` elements), shared by every norm of the pass.
    norm_weight: DeviceMemory,
}

impl RankData {
    fn slot(&self, slot: Slot) -> u64 {
        self.slots.iter().find(|(s, _)| *s == slot).unwrap().1.ptr()
    }
}

/// Random bf16 in [-1/16, 1/16): the values do not change a GEMM's time, but keep the
/// activations finite over many layers.
fn random_bf16(elements: u64, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut bytes = Vec::with_capacity(elements as usize * 2);
    for _ in 0..elements {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let v = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) / 8.0;
        bytes.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
    }
    bytes
}

fn layer_kind(model: &ModelShape, layer: u64) -> usize {
    match &model.moe {
        Some(m) if layer >= m.dense_layers => 1,
        _ => 0,
    }
}

pub fn run(args: StepArgs) -> Result<std::process::ExitCode> {
    if let Some(path) = &args.json {
        crate::args::check_writable("json", path)?;
    }
    let text = std::fs::read_to_string(&args.config)
        .with_context(|| format!("cannot read --config {}", args.config.display()))
        .map_err(crate::args::usage)?;
    // A Hugging Face checkout names the model by its folder; a renamed file by its stem.
    let stem = args
        .config
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned());
    let name = match stem.as_deref() {
        Some("config") | None => args
            .config
            .canonicalize()
            .ok()
            .and_then(|p| {
                p.parent()?
                    .file_name()
                    .map(|s| s.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| "model".to_owned()),
        Some(stem) => stem.to_owned(),
    };
    let model = ModelShape::from_config_json(&text, &name)?;
    if args.tp == 0 || args.tokens == 0 || args.replays == 0 {
        bail!("-n/--world-size, --tokens and --replays must be at least 1");
    }
    let layers = args.layers.unwrap_or(model.layers);
    if layers == 0 || layers > model.layers {
        bail!(
            "--layers {layers}: the model has {} layers; give 1 to {}",
            model.layers,
            model.layers
        );
    }
    let norms = parse_list(&args.norms, "norms", |s| {
        s.parse::<Norms>().map_err(|e| anyhow::anyhow!(e))
    })?;
    let mut reduces = vec![Reduce::Nothing];
    for r in parse_list(&args.algos, "algos", |s| Ok(s.parse::<Route>()?))? {
        for &n in &norms {
            // NCCL has no fused form: its fused row would be its separate row again.
            if n == Norms::Fused && r == Route::Fixed(Choice::Nccl) {
                continue;
            }
            reduces.push(Reduce::With(r, n));
        }
    }
    let timeout = args.timeout;
    let gpus = tpar::harness::cuda_ranks::device_count().context(
        "tpar bench step runs the pass on GPUs (`tpar plan spec-decode` predicts it without one)",
    )?;
    // NCCL takes one process per rank: with a GPU for every rank, run that way by default.
    let processes = args.processes || (args.tp > 1 && gpus >= args.tp);
    if processes && !args.processes && std::env::var_os("RANK").is_none() {
        eprintln!(
            "tpar bench step: one process per rank (a GPU each), so that NCCL can run beside tpar"
        );
    }
    crate::blas::load()?;
    let (tp, tokens) = (args.tp as u64, args.tokens as u64);
    let ops = pass_ops(&model, layers, tp, tokens);
    let sizes = slot_elements(&ops, tokens, model.hidden);
    let count = (tokens * model.hidden) as usize;
    let dtype = DType::Bf16;
    let kinds: Vec<u64> = match &model.moe {
        Some(m) if m.dense_layers < layers => vec![0, m.dense_layers],
        _ => vec![0],
    };

    on_ranks(processes, args.tp, timeout, |make, mode| {
        let mut group = make(config(timeout))?;
        let leader = group.is_leader();
        if leader {
            eprintln!(
                "tpar bench step: preparing {} ({mode}): weights of {} layer kind(s), {} per rank",
                crate::report::ranks(args.tp),
                kinds.len(),
                human_bytes(weight_bytes(&ops, &kinds) * 2)
            );
        }
        let data = prepare(&group, &ops, &sizes, &kinds, model.hidden)?;
        let mut rows = Vec::new();
        let mut compute_us = 0.0;
        for &reduce in &reduces {
            if let Reduce::With(route, _) = reduce {
                if let Err(why) = group.supports(route) {
                    rows.push(StepRow {
                        reduce: reduce.name(),
                        runs: None,
                        norms: "-".into(),
                        pass_p50_us: 0.0,
                        pass_p99_us: 0.0,
                        communication_us: 0.0,
                        communication_share: 0.0,
                        per_allreduce_us: 0.0,
                        skipped: Some(why),
                    });
                    continue;
                }
            }
            if leader {
                eprintln!("tpar bench step: timing {}", reduce.name());
            }
            let queue = |i: usize, stream: &Arc<cudarc::driver::CudaStream>| {
                queue_pass(
                    &group, &data[i], i, stream, &ops, &model, reduce, tokens, dtype,
                )
            };
            // Once eagerly: cuBLAS picks its kernels and every path runs before capture.
            for (i, s) in group.streams.iter().enumerate() {
                queue(i, s)?;
            }
            group.synchronize()?;
            let graphs: Vec<CudaGraph> = if processes || group.comms.len() == 1 {
                group.capture_each(queue)?
            } else {
                vec![group.capture(queue)?]
            };
            let warmup = 3;
            let replays = group.agreed_mean(args.replays as u64)? as usize;
            let us = time_replays(&group, &graphs, warmup, replays)?;
            drop(graphs);
            let p50 = percentile(&us, 50.0);
            let p99 = percentile(&us, 99.0);
            if reduce == Reduce::Nothing {
                compute_us = p50;
            }
            let communication = (p50 - compute_us).max(0.0);
            let captured = match reduce {
                Reduce::With(Route::Auto, _) => Some(
                    group.comms[0]
                        .plan(dtype, (count * dtype.size()) as u64, true)?
                        .choice,
                ),
                Reduce::With(Route::Fixed(choice), _) => Some(choice),
                Reduce::Nothing => None,
            };
            let runs = match reduce {
                Reduce::With(Route::Auto, _) => captured.map(|c| c.name().to_owned()),
                _ => None,
            };
            let norms = match (reduce, captured) {
                (Reduce::With(_, Norms::Fused), Some(choice)) => {
                    let algorithm = match choice {
                        Choice::Tpar(a) => Some(a),
                        Choice::Nccl => None,
                    };
                    let path =
                        group.comms[0]
                            .cuda()
                            .fused_plan(algorithm, dtype, model.hidden as usize);
                    if path.fused {
                        "fused".to_owned()
                    } else {
                        format!("unfused: {}", path.reason)
                    }
                }
                _ => "separate".to_owned(),
            };
            rows.push(StepRow {
                reduce: reduce.name(),
                runs,
                norms,
                pass_p50_us: p50,
                pass_p99_us: p99,
                communication_us: communication,
                communication_share: if p50 > 0.0 { communication / p50 } else { 0.0 },
                per_allreduce_us: communication / (2 * layers) as f64,
                skipped: None,
            });
        }
        if !leader {
            return Ok(());
        }
        let gpus = tpar::harness::cuda_ranks::device_count()?;
        let report = StepReport {
            model: model.name.clone(),
            tp: args.tp,
            tokens: args.tokens,
            layers,
            allreduces_per_pass: 2 * layers,
            norms_per_pass: 2 * layers,
            allreduce_bytes: (count * dtype.size()) as u64,
            gemms_per_pass: ops.iter().flatten().filter(|o| matches!(o, StepOp::Gemm { .. })).count(),
            weight_bytes_per_rank_per_layer: weight_bytes(&ops, &kinds[kinds.len() - 1..]) * 2,
            mode,
            gpus,
            provenance: Provenance::collect(cuda_device(group.comms[0].cuda().context(), gpus)),
            replays: args.replays,
            timing: "CUDA events around replays of one graph holding the whole pass; p50/p99 over replays; communication = pass - compute-only pass (which runs the norms as separate kernels), so a fused row's figure is what its allreduces add once their norms are folded in",
            results: rows,
        };
        emit(&render(&report), args.json.as_deref(), &report)
    })
}

fn weight_bytes(ops: &[Vec<StepOp>], kinds: &[u64]) -> u64 {
    kinds
        .iter()
        .map(|&l| {
            ops[l as usize]
                .iter()
                .map(StepOp::weight_elements)
                .sum::<u64>()
        })
        .sum()
}

/// cuBLAS handles, activation buffers and random weights for every local rank.
fn prepare(
    group: &CudaRanks,
    ops: &[Vec<StepOp>],
    sizes: &[(Slot, u64)],
    kinds: &[u64],
    hidden: u64,
) -> Result<Vec<RankData>> {
    let mut all = Vec::new();
    for (i, (comm, stream)) in group.comms.iter().zip(&group.streams).enumerate() {
        let ctx = comm.cuda().context();
        let slots = sizes
            .iter()
            .map(|&(slot, elements)| {
                let memory = DeviceMemory::zeroed(ctx, (elements as usize * 2).max(2))?;
                memory.upload(&random_bf16(elements, 1000 + i as u64)[..])?;
                Ok((slot, memory))
            })
            .collect::<Result<_>>()?;
        let mut weights: [Vec<Option<DeviceMemory>>; 2] = [Vec::new(), Vec::new()];
        for (kind, &layer) in kinds.iter().enumerate() {
            for (j, op) in ops[layer as usize].iter().enumerate() {
                let elements = op.weight_elements();
                weights[kind].push(if elements == 0 {
                    None
                } else {
                    let memory = DeviceMemory::zeroed(ctx, elements as usize * 2)?;
                    memory.upload(&random_bf16(elements, (i * 1000 + kind * 100 + j) as u64))?;
                    Some(memory)
                });
            }
        }
        let norm_weight = DeviceMemory::zeroed(ctx, hidden as usize * 2)?;
        norm_weight.upload(&random_bf16(hidden, 7 + i as u64)[..])?;
        all.push(RankData {
            blas: Blas::new(stream)?,
            slots,
            weights,
            norm_weight,
        });
    }
    Ok(all)
}

/// Queues local rank `i`'s pass on `stream`.
#[allow(clippy::too_many_arguments)]
fn queue_pass(
    group: &CudaRanks,
    data: &RankData,
    i: usize,
    stream: &Arc<cudarc::driver::CudaStream>,
    ops: &[Vec<StepOp>],
    model: &ModelShape,
    reduce: Reduce,
    tokens: u64,
    dtype: DType,
) -> Result<()> {
    let comm = &group.comms[i];
    let count = (tokens * model.hidden) as usize;
    let cu = stream.cu_stream();
    let norm_call = |slot: Slot| FusedCall {
        dtype,
        tokens: tokens as usize,
        hidden: model.hidden as usize,
        x: data.slot(slot),
        residual: data.slot(Slot::Stream),
        residual_out: None,
        weight: data.norm_weight.ptr(),
        y: data.slot(slot),
        eps: EPS,
    };
    for (layer, layer_ops) in ops.iter().enumerate() {
        let kind = layer_kind(model, layer as u64).min(data.weights.len() - 1);
        for (j, op) in layer_ops.iter().enumerate() {
            match *op {
                StepOp::Gemm {
                    rows,
                    k,
                    n,
                    input,
                    input_row,
                    output,
                    accumulate,
                    ..
                } => {
                    let w = data.weights[kind][j].as_ref().expect("a GEMM has a weight");
                    // SAFETY: the weight holds k*n elements and the slots were sized by
                    // slot_elements for every op of the pass; all live until the caller has
                    // synchronised and dropped its graphs.
                    unsafe {
                        data.blas.gemm_bf16(
                            rows,
                            k,
                            n,
                            w.ptr(),
                            data.slot(input),
                            input_row,
                            data.slot(output),
                            accumulate,
                        )?
                    };
                }
                StepOp::AllReduce { slot } => match reduce {
                    Reduce::Nothing => {}
                    // SAFETY: the slot holds tokens x hidden bf16 elements on this rank's GPU.
                    Reduce::With(route, Norms::Separate) => unsafe {
                        route.queue(comm, dtype, None, data.slot(slot), count, stream)?
                    },
                    // The allreduce and the norm that follows it (planner::step keeps them
                    // adjacent) in one call; the AddRmsNorm op is then skipped.
                    // SAFETY: x = y = the slot, residual = the stream slot, weight = hidden
                    // elements: all on this rank's GPU, alive until the graphs are dropped.
                    Reduce::With(route, Norms::Fused) => unsafe {
                        let call = norm_call(slot);
                        match route {
                            Route::Auto => {
                                comm.fused_add_rms_norm_raw(
                                    &call,
                                    cu,
                                    stream_is_capturing(stream),
                                )?;
                            }
                            Route::Fixed(choice) => {
                                comm.fused_add_rms_norm_with(choice, &call, cu)?;
                            }
                        }
                    },
                },
                StepOp::AddRmsNorm { slot } => {
                    if matches!(reduce, Reduce::With(_, Norms::Fused)) {
                        continue;
                    }
                    // No programmatic dependent launch (`None`): the kernel before it is a
                    // GEMM or an allreduce whose grid this pass does not know, as in an engine.
                    // SAFETY: as for the fused call above.
                    unsafe {
                        comm.cuda().launch_add_rms_norm(
                            &norm_call(slot),
                            data.slot(slot),
                            None,
                            cu,
                        )?
                    };
                }
            }
        }
    }
    Ok(())
}

fn render(report: &StepReport) -> String {
    let mut table = Table::new(
        &[
            "allreduce",
            "norms",
            "pass p50 us",
            "pass p99 us",
            "communication us",
            "share",
            "per allreduce us",
        ],
        1,
    );
    for r in &report.results {
        if let Some(why) = &r.skipped {
            table.push(skipped_row(vec![r.reduce.clone()], 7, why));
            continue;
        }
        let name = name_with_runs(&r.reduce, r.runs.as_deref());
        let compute = r.reduce.starts_with("none");
        table.push(vec![
            name,
            r.norms.clone(),
            format!("{:.1}", r.pass_p50_us),
            format!("{:.1}", r.pass_p99_us),
            if compute {
                "-".into()
            } else {
                format!("{:.1}", r.communication_us)
            },
            if compute {
                "-".into()
            } else {
                format!("{:.1}%", 100.0 * r.communication_share)
            },
            if compute {
                "-".into()
            } else {
                format!("{:.2}", r.per_allreduce_us)
            },
        ]);
    }
    let sharing = if report.gpus < report.tp {
        format!(
            "\nnote: {} ranks share {} GPU(s): every rank's GEMMs run on the same GPU, so the pass is not a TP-{} machine's; the real use is one GPU per rank",
            report.tp, report.gpus, report.tp
        )
    } else {
        String::new()
    };
    format!(
        "tpar bench step: {}, TP {}, {} token(s) per pass, {} layers: {} GEMMs, {} allreduces of {} bf16 and {} residual add + RMSNorms per pass; {}, {} ({})\n{}{}",
        report.model,
        report.tp,
        report.tokens,
        report.layers,
        report.gemms_per_pass,
        report.allreduces_per_pass,
        human_bytes(report.allreduce_bytes),
        report.norms_per_pass,
        report.provenance.device,
        crate::report::ranks(report.tp),
        report.mode,
        table.render(),
        sharing
    )
}
