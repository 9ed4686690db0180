//! One rank's share of a tensor-parallel forward pass over `tokens` tokens, as a list of
//! GEMMs, allreduces and residual add + RMSNorms per layer: what `tpar bench step` runs on real
//! GPUs (cuBLAS and the communicator) to see how much of a verify pass the allreduces take, with
//! each norm run as its own kernel after the allreduce or fused into it.
//!
//! The sharding is the engines' (Megatron-style, as in SGLang and vLLM): column-parallel
//! QKV / gate-up projections, row-parallel output / down projections, each followed by an
//! allreduce of the `[tokens, hidden]` activations. MLA (DeepSeek) keeps its low-rank
//! down-projections (`q_a`, `kv_a`) and the router replicated on every rank. A MoE layer runs its
//! shared experts on every token and `min(tokens * experts_per_token, routed_experts)` distinct
//! routed experts, each over its share of the tokens (experts split by TP, as SGLang's TP MoE).
//! Each of the two allreduces per layer is followed by the residual add + RMSNorm that engines
//! run there (`residual += allreduce(x); x = rmsnorm(residual) * weight`: the MLP's input norm
//! after attention, the next layer's input norm after the MLP, the model's final norm after the
//! last layer), the pair that issue 15's fused op replaces. Left out, as small next to the GEMMs
//! at decode sizes: attention over the KV cache, the first layer's input norm (no allreduce
//! before it), activations, rotary embeddings.

use super::model::ModelShape;

/// Activation buffers of one rank. Every GEMM reads the first `k` columns of its input buffer's
/// rows and writes `[rows, n]` (row-major) to its output buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    /// The layer's input `[tokens, hidden]`, and the attention block's allreduced output.
    Hidden,
    /// The attention block's output before the allreduce, then the layer's output.
    Residual,
    /// Wide intermediates (projections, MLP inner activations).
    WideA,
    WideB,
    /// The residual stream `[tokens, hidden]` that every norm adds its allreduced input to.
    Stream,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepOp {
    /// `output[rows, n] (+)= input[rows, :k] x W[k, n]` with W one of the rank's weights.
    Gemm {
        name: &'static str,
        rows: u64,
        k: u64,
        n: u64,
        input: Slot,
        /// Row length of the input buffer as its producer wrote it (>= k).
        input_row: u64,
        output: Slot,
        /// Adds to the output (experts summing into one result) instead of overwriting it.
        accumulate: bool,
    },
    /// Allreduce of `[tokens, hidden]` in place.
    AllReduce { slot: Slot },
    /// The residual add + RMSNorm after an allreduce of `slot`, in place on both:
    /// `Stream += slot; slot = rmsnorm(Stream) * weight` (a norm weight of `hidden` elements,
    /// replicated on every rank). It always directly follows the allreduce of the same slot, so
    /// that the pair can run as one fused call.
    AddRmsNorm { slot: Slot },
}

impl StepOp {
    /// Elements of the split weight this op reads: a GEMM's share; 0 for an allreduce, and 0
    /// for a norm, whose `hidden` weights are replicated (they are not in
    /// [`ModelShape::parameters`] either).
    pub fn weight_elements(&self) -> u64 {
        match self {
            StepOp::Gemm { k, n, .. } => k * n,
            StepOp::AllReduce { .. } | StepOp::AddRmsNorm { .. } => 0,
        }
    }

    /// Elements the op writes (GEMMs, norms) or reduces (allreduces), for buffer sizing.
    pub fn output_elements(&self, tokens: u64, hidden: u64) -> u64 {
        match self {
            StepOp::Gemm { rows, n, .. } => rows * n,
            StepOp::AllReduce { .. } | StepOp::AddRmsNorm { .. } => tokens * hidden,
        }
    }
}

/// The ops of `layer` for one of `tp` ranks over `tokens` tokens.
pub fn layer_ops(model: &ModelShape, layer: u64, tp: u64, tokens: u64) -> Vec<StepOp> {
    let (h, t, tp) = (model.hidden, tokens.max(1), tp.max(1));
    let mut ops = Vec::new();
    let gemm = |name, rows, k, n, input, input_row, output, accumulate| StepOp::Gemm {
        name,
        rows,
        k,
        n,
        input,
        input_row,
        output,
        accumulate,
    };
    use Slot::*;
    // Attention projections: Hidden -> ... -> Residual, then allreduce.
    match &model.mla {
        Some(m) => {
            let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
            let heads = model.heads.div_ceil(tp);
            let q_cols = heads * qk;
            let kv_a = m.kv_lora_rank + m.qk_rope_head_dim;
            ops.push(gemm("kv_a", t, h, kv_a, Hidden, h, WideA, false));
            let kv_b = heads * (m.qk_nope_head_dim + m.v_head_dim);
            ops.push(gemm(
                "kv_b",
                t,
                m.kv_lora_rank,
                kv_b,
                WideA,
                kv_a,
                WideB,
                false,
            ));
            match m.q_lora_rank {
                Some(r) => {
                    ops.push(gemm("q_a", t, h, r, Hidden, h, WideA, false));
                    ops.push(gemm("q_b", t, r, q_cols, WideA, r, WideB, false));
                }
                None => ops.push(gemm("q", t, h, q_cols, Hidden, h, WideB, false)),
            }
            // The attention output (heads x v_head_dim) stands in as the first columns of the
            // query projection's output.
            let o_in = heads * m.v_head_dim;
            ops.push(gemm(
                "o",
                t,
                o_in,
                h,
                WideB,
                q_cols.max(o_in),
                Residual,
                false,
            ));
        }
        None => {
            let q = model.heads.div_ceil(tp) * model.head_dim;
            let kv = model.kv_heads.div_ceil(tp) * model.head_dim;
            ops.push(gemm("qkv", t, h, q + 2 * kv, Hidden, h, WideA, false));
            ops.push(gemm("o", t, q, h, WideA, q + 2 * kv, Residual, false));
        }
    }
    ops.push(StepOp::AllReduce { slot: Residual });
    ops.push(StepOp::AddRmsNorm { slot: Residual });
    // MLP: Residual (now the normed attention output) -> ... -> Hidden, then allreduce + norm.
    match &model.moe {
        Some(m) if layer >= m.dense_layers => {
            ops.push(gemm(
                "router",
                t,
                h,
                m.routed_experts,
                Residual,
                h,
                WideB,
                false,
            ));
            let shared = m.shared_experts * m.moe_intermediate / tp;
            let mut first = true;
            if shared > 0 {
                ops.push(gemm(
                    "shared_gate_up",
                    t,
                    h,
                    2 * shared,
                    Residual,
                    h,
                    WideA,
                    false,
                ));
                ops.push(gemm(
                    "shared_down",
                    t,
                    shared,
                    h,
                    WideA,
                    2 * shared,
                    Hidden,
                    false,
                ));
                first = false;
            }
            let picks = t * m.experts_per_token;
            let experts = picks.min(m.routed_experts);
            let rows = picks.div_ceil(experts);
            let inter = m.moe_intermediate / tp;
            for _ in 0..experts {
                ops.push(gemm(
                    "expert_gate_up",
                    rows,
                    h,
                    2 * inter,
                    Residual,
                    h,
                    WideA,
                    false,
                ));
                ops.push(gemm(
                    "expert_down",
                    rows,
                    inter,
                    h,
                    WideA,
                    2 * inter,
                    Hidden,
                    !first,
                ));
                first = false;
            }
        }
        _ => {
            let inter = model.intermediate / tp;
            ops.push(gemm("gate_up", t, h, 2 * inter, Residual, h, WideA, false));
            ops.push(gemm("down", t, inter, h, WideA, 2 * inter, Hidden, false));
        }
    }
    ops.push(StepOp::AllReduce { slot: Hidden });
    ops.push(StepOp::AddRmsNorm { slot: Hidden });
    ops
}

/// The ops of a whole pass over `layers` layers.
pub fn pass_ops(model: &ModelShape, layers: u64, tp: u64, tokens: u64) -> Vec<Vec<StepOp>> {
    (0..layers)
        .map(|l| layer_ops(model, l, tp, tokens))
        .collect()
}

/// Elements each slot must hold for every op of `ops`.
pub fn slot_elements(ops: &[Vec<StepOp>], tokens: u64, hidden: u64) -> [(Slot, u64); 5] {
    let mut sizes = [
        (Slot::Hidden, tokens * hidden),
        (Slot::Residual, tokens * hidden),
        (Slot::WideA, 0),
        (Slot::WideB, 0),
        (Slot::Stream, tokens * hidden),
    ];
    for op in ops.iter().flatten() {
        let (slot, elements) = match op {
            StepOp::Gemm { output, .. } => (*output, op.output_elements(tokens, hidden)),
            StepOp::AllReduce { slot } | StepOp::AddRmsNorm { slot } => {
                (*slot, op.output_elements(tokens, hidden))
            }
        };
        let entry = sizes.iter_mut().find(|(s, _)| *s == slot).unwrap();
        entry.1 = entry.1.max(elements);
    }
    sizes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::MODEL_FIXTURES;

    fn fixture(name: &str) -> ModelShape {
        ModelShape::from_config_json(MODEL_FIXTURES.iter().find(|f| f.0 == name).unwrap().1, name)
            .unwrap()
    }

    fn weights(ops: &[StepOp]) -> u64 {
        ops.iter().map(StepOp::weight_elements).sum()
    }

    #[test]
    fn a_dense_pass_reads_every_layer_weight_once_split_over_the_ranks() {
        let llama = fixture("llama-3.1-70b");
        for tp in [1, 2, 4, 8] {
            let pass = pass_ops(&llama, llama.layers, tp, 1);
            let per_rank: u64 = pass.iter().map(|l| weights(l)).sum();
            let embeddings = llama.vocab * llama.hidden * 2;
            assert_eq!(per_rank * tp, llama.parameters() - embeddings, "tp {tp}");
            let allreduces = pass
                .iter()
                .flatten()
                .filter(|o| matches!(o, StepOp::AllReduce { .. }));
            assert_eq!(allreduces.count() as u64, llama.allreduces_per_forward());
        }
    }

    #[test]
    fn a_moe_layer_runs_the_shared_and_the_picked_experts() {
        let ds = fixture("deepseek-v3");
        let m = ds.moe.clone().unwrap();
        let tp = 8;
        let expert = 3 * ds.hidden * m.moe_intermediate / tp;
        let dense = layer_ops(&ds, 0, tp, 1);
        let moe = layer_ops(&ds, m.dense_layers, tp, 1);
        let attention: u64 = weights(&dense) - 3 * ds.hidden * (ds.intermediate / tp);
        let router = ds.hidden * m.routed_experts;
        assert_eq!(
            weights(&moe),
            attention + router + (m.shared_experts + m.experts_per_token) * expert
        );
        // With more tokens than routed experts can take one by one, every expert runs once.
        let wide = layer_ops(&ds, m.dense_layers, tp, 64);
        let experts = wide.iter().filter(|o| {
            matches!(
                o,
                StepOp::Gemm {
                    name: "expert_down",
                    ..
                }
            )
        });
        assert_eq!(
            experts.count() as u64,
            m.routed_experts.min(64 * m.experts_per_token)
        );
    }

    #[test]
    fn every_allreduce_is_followed_by_its_norm_and_the_next_gemm_reads_the_normed_slot() {
        for name in ["llama-3.1-70b", "deepseek-v3"] {
            let model = fixture(name);
            let pass = pass_ops(&model, model.layers.min(5), 8, 4);
            for layer in &pass {
                let norms = layer
                    .iter()
                    .filter(|o| matches!(o, StepOp::AddRmsNorm { .. }))
                    .count();
                assert_eq!(norms, 2, "{name}: two norms per layer");
                for (j, op) in layer.iter().enumerate() {
                    if let StepOp::AllReduce { slot } = op {
                        assert_eq!(layer[j + 1], StepOp::AddRmsNorm { slot: *slot }, "{name}");
                        // The norm's output is what the following GEMMs read.
                        if let Some(StepOp::Gemm { input, .. }) = layer.get(j + 2) {
                            assert_eq!(input, slot, "{name}");
                        }
                    }
                }
                assert!(!layer.iter().any(|o| matches!(
                    o,
                    StepOp::Gemm {
                        input: Slot::Stream,
                        ..
                    } | StepOp::Gemm {
                        output: Slot::Stream,
                        ..
                    }
                )));
            }
            // The MLP's norm leaves the next layer's input where the next layer reads it.
            assert_eq!(
                pass[0].last(),
                Some(&StepOp::AddRmsNorm { slot: Slot::Hidden })
            );
        }
    }

    #[test]
    fn every_gemm_reads_within_what_its_input_slot_holds() {
        for name in ["llama-3.1-70b", "deepseek-v3"] {
            let model = fixture(name);
            for (tp, tokens) in [(1, 1), (8, 1), (8, 4), (4, 16)] {
                let pass = pass_ops(&model, model.layers.min(5), tp, tokens);
                let sizes = slot_elements(&pass, tokens, model.hidden);
                let size = |s: Slot| sizes.iter().find(|(x, _)| *x == s).unwrap().1;
                for op in pass.iter().flatten() {
                    if let StepOp::Gemm {
                        rows,
                        k,
                        input,
                        input_row,
                        output,
                        name,
                        ..
                    } = op
                    {
                        assert!(k <= input_row, "{name}: k {k} > row {input_row}");
                        assert_ne!(input, output, "{name} would read what it writes");
                        assert!(
                            rows * input_row <= size(*input),
                            "{name} reads past its input"
                        );
                    }
                }
            }
        }
    }
}
