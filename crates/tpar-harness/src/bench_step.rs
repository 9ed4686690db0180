//! `tpar bench step`'s runner: one tensor-parallel forward pass (a decode step, or a
//! speculative verify pass over several tokens) on real GPUs: each rank's share of the
//! projection and MLP GEMMs (cuBLAS, random bf16 weights of the model's shapes), the two
//! allreduces per layer and the residual add + RMSNorm after each, captured as one CUDA graph
//! and replayed. The same pass is timed with no allreduce (the compute), and with each way of
//! reducing asked for (NCCL, tpar's dispatcher, a forced tpar algorithm; norms separate or
//! fused): the difference is what communication costs the pass. See `crate::planner::step` for
//! what the pass holds and leaves out.

use std::sync::Arc;

use cudarc::driver::CudaGraph;
use serde::Serialize;

use super::blas::Blas;
use super::cuda_bench::time_replays;
use super::cuda_ranks::{queue, CudaRanks};
use super::stats::percentile;
use super::{bail, Result};
use crate::planner::model::ModelShape;
use crate::planner::step::{pass_ops, slot_elements, Slot, StepOp};
use tpar::algorithm::Selection;
use tpar::backend::cuda::driver::DeviceMemory;
use tpar::backend::cuda::fused::{FusedInput, FusedResidual, FusedSpans};
use tpar::DType;

/// RMSNorm epsilon of the pass (Llama's and DeepSeek's `rms_norm_eps`); it does not change
/// the time.
pub const EPS: f32 = 1e-5;

/// How a pass runs the norm after each allreduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norms {
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
pub enum Reduce {
    /// No allreduce: the compute alone (GEMMs and the norms as separate kernels).
    Nothing,
    With(Selection, Norms),
}

impl Reduce {
    pub fn name(self) -> String {
        match self {
            Reduce::Nothing => "none (compute only)".into(),
            Reduce::With(r, Norms::Separate) => r.name().into(),
            Reduce::With(r, Norms::Fused) => format!("{} fused", r.name()),
        }
    }
}

#[derive(Serialize)]
pub struct StepRow {
    pub reduce: String,
    /// What `auto` ran for this pass's message size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runs: Option<String>,
    /// How the norms ran: "separate", or "fused" / "unfused: why" for fused rows (the fused
    /// decision of the captured pass).
    pub norms: String,
    pub pass_p50_us: f64,
    pub pass_p99_us: f64,
    /// The pass's time minus the compute-only pass's.
    pub communication_us: f64,
    pub communication_share: f64,
    pub per_allreduce_us: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
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

/// Two different slots of `slots`, borrowed together (a GEMM's input and output, a norm's
/// slot and the residual stream).
fn two_slots(
    slots: &mut [(Slot, DeviceMemory)],
    first: Slot,
    second: Slot,
) -> Result<(&mut DeviceMemory, &mut DeviceMemory)> {
    if first == second {
        bail!("slot {first:?} is both operands of one op; the step's plan gives them two slots");
    }
    let (mut a, mut b) = (None, None);
    for (slot, memory) in slots.iter_mut() {
        if *slot == first {
            a = Some(memory);
        } else if *slot == second {
            b = Some(memory);
        }
    }
    match (a, b) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => bail!("no buffer for slot {first:?} or {second:?}"),
    }
}

impl RankData {
    fn slot_mut(&mut self, slot: Slot) -> &mut DeviceMemory {
        &mut self.slots.iter_mut().find(|(s, _)| *s == slot).unwrap().1
    }

    /// The fused op's operands for the norm after the allreduce of `slot`: y written over x
    /// (both `slot`), the residual stream updated in place, the shared norm weight.
    fn norm_spans(
        &mut self,
        slot: Slot,
        dtype: DType,
        tokens: usize,
        hidden: usize,
    ) -> Result<FusedSpans<'_>> {
        let elements = tokens * hidden;
        let (x, residual) = two_slots(&mut self.slots, slot, Slot::Stream)?;
        Ok(FusedSpans {
            input: FusedInput::YIntoX(x.span_mut(dtype, elements)?),
            residual: FusedResidual::InPlace(residual.span_mut(dtype, elements)?),
            weight: self.norm_weight.span(dtype, hidden)?,
            tokens,
            hidden,
            eps: EPS,
        })
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

/// The pass to time: the model's shapes, the ops of its layers and how the allreduces run.
pub struct StepSettings {
    pub model: ModelShape,
    pub layers: u64,
    pub tp: u64,
    pub tokens: u64,
    /// Timed passes: the compute alone first, then each way of reducing.
    pub reduces: Vec<Reduce>,
    pub replays: usize,
    /// One graph per rank (processes, or a single rank) instead of one graph for all ranks.
    pub graph_per_rank: bool,
    ops: Vec<Vec<StepOp>>,
    sizes: [(Slot, u64); 5],
    /// The first layer of each kind (dense, MoE) whose weights are allocated.
    kinds: Vec<u64>,
}

impl StepSettings {
    pub fn new(
        model: ModelShape,
        layers: u64,
        tp: u64,
        tokens: u64,
        reduces: Vec<Reduce>,
        replays: usize,
        graph_per_rank: bool,
    ) -> StepSettings {
        let ops = pass_ops(&model, layers, tp, tokens);
        let sizes = slot_elements(&ops, tokens, model.hidden);
        let kinds: Vec<u64> = match &model.moe {
            Some(m) if m.dense_layers < layers => vec![0, m.dense_layers],
            _ => vec![0],
        };
        StepSettings {
            model,
            layers,
            tp,
            tokens,
            reduces,
            replays,
            graph_per_rank,
            ops,
            sizes,
            kinds,
        }
    }

    /// Elements of one allreduce (tokens x hidden).
    pub fn count(&self) -> usize {
        (self.tokens * self.model.hidden) as usize
    }

    pub fn gemms_per_pass(&self) -> usize {
        self.ops
            .iter()
            .flatten()
            .filter(|o| matches!(o, StepOp::Gemm { .. }))
            .count()
    }

    /// Bytes of weights per rank: of every layer kind, or of the last kind's one layer.
    pub fn weight_bytes(&self, every_kind: bool) -> u64 {
        let kinds = if every_kind {
            &self.kinds[..]
        } else {
            &self.kinds[self.kinds.len() - 1..]
        };
        weight_bytes(&self.ops, kinds) * 2
    }

    pub fn layer_kinds(&self) -> usize {
        self.kinds.len()
    }
}

/// Times every pass of `settings` on `group`; `on_timing` hears each one before it is timed.
pub fn run(
    group: &mut CudaRanks,
    settings: &StepSettings,
    mut on_timing: impl FnMut(Reduce),
) -> Result<Vec<StepRow>> {
    let dtype = DType::Bf16;
    let (model, layers, tokens) = (&settings.model, settings.layers, settings.tokens);
    let count = settings.count();
    let mut data = prepare(
        group,
        &settings.ops,
        &settings.sizes,
        &settings.kinds,
        model.hidden,
    )?;
    let mut rows = Vec::new();
    let mut compute_us = 0.0;
    for &reduce in &settings.reduces {
        if let Reduce::With(selection, _) = reduce {
            if let Err(why) = group.supports(selection) {
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
        on_timing(reduce);
        // Collective calls: every rank replays the same number of times.
        let replays = group.agreed_mean(settings.replays as u64)? as usize;
        let group = &*group;
        let mut queue = |i: usize, stream: &Arc<cudarc::driver::CudaStream>| {
            queue_pass(
                group,
                &mut data[i],
                i,
                stream,
                &settings.ops,
                model,
                reduce,
                tokens,
                dtype,
            )
        };
        // Once eagerly: cuBLAS picks its kernels and every path runs before capture.
        for (i, s) in group.streams.iter().enumerate() {
            queue(i, s)?;
        }
        group.synchronize()?;
        let graphs: Vec<CudaGraph> = if settings.graph_per_rank || group.comms.len() == 1 {
            group.capture_each(&mut queue)?
        } else {
            vec![group.capture(&mut queue)?]
        };
        rows.push(time_pass(
            group,
            settings,
            graphs,
            reduce,
            replays,
            &mut compute_us,
            (count, dtype, layers),
        )?);
    }
    Ok(rows)
}

/// Replays one pass's graphs and makes its row (the compute-only pass sets `compute_us`).
fn time_pass(
    group: &CudaRanks,
    settings: &StepSettings,
    graphs: Vec<CudaGraph>,
    reduce: Reduce,
    replays: usize,
    compute_us: &mut f64,
    (count, dtype, layers): (usize, DType, u64),
) -> Result<StepRow> {
    let warmup = 3;
    let us = time_replays(group, &graphs, warmup, replays)?;
    drop(graphs);
    let p50 = percentile(&us, 50.0);
    let p99 = percentile(&us, 99.0);
    if reduce == Reduce::Nothing {
        *compute_us = p50;
    }
    let communication = (p50 - *compute_us).max(0.0);
    let captured = match reduce {
        Reduce::With(Selection::Auto, _) => Some(
            group.comms[0]
                .decision(dtype, (count * dtype.size()) as u64, true)?
                .choice,
        ),
        Reduce::With(Selection::Forced(choice), _) => Some(choice),
        Reduce::Nothing => None,
    };
    let runs = match reduce {
        Reduce::With(Selection::Auto, _) => captured.map(|c| c.name().to_owned()),
        _ => None,
    };
    let norms = match (reduce, captured) {
        (Reduce::With(_, Norms::Fused), Some(choice)) => {
            let path = group.comms[0].fused_decision(
                choice,
                dtype,
                settings.model.hidden as usize,
                Some(settings.tokens as usize),
            );
            if path.fused {
                "fused".to_owned()
            } else {
                format!("unfused: {}", path.reason)
            }
        }
        _ => "separate".to_owned(),
    };
    Ok(StepRow {
        reduce: reduce.name(),
        runs,
        norms,
        pass_p50_us: p50,
        pass_p99_us: p99,
        communication_us: communication,
        communication_share: if p50 > 0.0 { communication / p50 } else { 0.0 },
        per_allreduce_us: communication / (2 * layers) as f64,
        skipped: None,
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
    data: &mut RankData,
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
    let (tokens, hidden) = (tokens as usize, model.hidden as usize);
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
                    let (a, c) = two_slots(&mut data.slots, input, output)?;
                    data.blas.gemm(rows, k, n, w, a, input_row, c, accumulate)?;
                }
                StepOp::AllReduce { slot } => match reduce {
                    Reduce::Nothing => {}
                    Reduce::With(selection, Norms::Separate) => {
                        let output = data.slot_mut(slot).span_mut(dtype, count)?;
                        queue(selection, comm, None, output, stream)?
                    }
                    // The allreduce and the norm that follows it (planner::step keeps them
                    // adjacent) in one call; the AddRmsNorm op is then skipped.
                    Reduce::With(selection, Norms::Fused) => {
                        let spans = data.norm_spans(slot, dtype, tokens, hidden)?;
                        match selection {
                            Selection::Auto => {
                                comm.fused_add_rms_norm(spans, stream)?;
                            }
                            Selection::Forced(choice) => {
                                comm.fused_add_rms_norm_as(choice, spans, stream)?;
                            }
                        }
                    }
                },
                StepOp::AddRmsNorm { slot } => {
                    if matches!(reduce, Reduce::With(_, Norms::Fused)) {
                        continue;
                    }
                    // No programmatic dependent launch (`None`): the kernel before it is a
                    // GEMM or an allreduce whose grid this pass does not know, as in an engine.
                    let spans = data.norm_spans(slot, dtype, tokens, hidden)?;
                    comm.cuda().add_rms_norm(spans, None, stream)?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blas::gemm_footprint;
    use crate::planner::MODEL_FIXTURES;

    /// `Blas::gemm` refuses buffers smaller than what cuBLAS touches: every GEMM of a pass
    /// must fit the slots the plan sized, or `bench step` would stop on a GPU.
    #[test]
    fn every_gemm_of_a_pass_fits_the_slots_it_reads_and_writes() {
        let mut gemms = 0;
        for (name, json) in MODEL_FIXTURES {
            let model = ModelShape::from_config_json(json, name).unwrap();
            for (tp, tokens) in [(1, 1), (2, 8), (8, 1), (8, 64), (4, 300)] {
                let ops = pass_ops(&model, 4, tp, tokens);
                let sizes = slot_elements(&ops, tokens, model.hidden);
                let size = |slot: Slot| sizes.iter().find(|(s, _)| *s == slot).unwrap().1;
                for op in ops.iter().flatten() {
                    if let StepOp::Gemm {
                        rows,
                        k,
                        n,
                        input,
                        input_row,
                        output,
                        ..
                    } = *op
                    {
                        let [_, a, c] = gemm_footprint(rows, k, n, input_row);
                        assert_ne!(input, output, "{name} tp {tp}: {op:?}");
                        assert!(
                            a <= size(input),
                            "{name} tp {tp} x {tokens}: {op:?} reads {a}"
                        );
                        assert!(
                            c <= size(output),
                            "{name} tp {tp} x {tokens}: {op:?} writes {c}"
                        );
                        gemms += 1;
                    }
                }
            }
        }
        assert!(gemms > 0);
    }
}
