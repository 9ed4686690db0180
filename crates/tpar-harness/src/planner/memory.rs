//! How much KV cache an engine will get on each GPU, computed the way the engine computes it,
//! with every term shown, so that a budget that goes negative (the reported case: 96 GB card,
//! 72.3 GB of weights, `mem_fraction_static` 0.55, rest -21.5 GB) is found before launch with
//! the term at fault and the setting that would work.

use serde::Serialize;

use super::gib;

/// How the engine sizes its KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineRule {
    /// SGLang (python/sglang/srt/model_executor/model_runner.py, ModelRunner.profile_max_num_token):
    /// `rest = available_after_weights - total * (1 - mem_fraction_static)`; the KV pool gets
    /// `rest`, and `total * (1 - mem_fraction_static)` is left for activations and CUDA graphs.
    Sglang { mem_fraction_static: f64 },
    /// vLLM (vllm/v1/worker/gpu_worker.py, Worker.determine_available_memory):
    /// `kv = total * gpu_memory_utilization - (weights + peak activations + non-torch memory)`.
    Vllm { gpu_memory_utilization: f64 },
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryInputs {
    pub gpu_total_bytes: f64,
    /// Free memory after the engine loaded its weights (SGLang measures it); when absent it is
    /// `total - weights - runtime_overhead`.
    pub free_after_load_bytes: Option<f64>,
    pub weights_bytes: f64,
    /// CUDA context, allocator slack, libraries: what is gone before any tensor.
    pub runtime_overhead_bytes: f64,
    pub rule: EngineRule,
    /// What tpar allocates on this GPU per rank (its footprint call).
    pub tpar_bytes: f64,
    pub cuda_graph_bytes: f64,
    pub draft_bytes: f64,
    /// vLLM's profiled peak of activations (a forward pass at the largest batch).
    pub activation_peak_bytes: f64,
    pub kv_bytes_per_token: f64,
    /// The fewest KV tokens worth running with (one full context), for the diagnosis.
    pub min_tokens: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Term {
    pub name: String,
    /// Signed: what the term adds to (+) or takes from (-) the KV budget.
    pub bytes: f64,
    pub note: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryPlan {
    pub terms: Vec<Term>,
    pub kv_budget_bytes: f64,
    pub kv_tokens: u64,
    /// Set when the budget is negative or below `min_tokens`: the term at fault and the fix.
    pub problem: Option<String>,
}

impl MemoryInputs {
    /// Refuses inputs that would give a confident wrong plan: non-finite or negative figures,
    /// fractions outside (0, 1], free memory above the GPU's total, KV of 0 bytes per token.
    pub fn check(&self) -> tpar::Result<()> {
        let bad = |what: String| Err(tpar::Error::InvalidArgument(what));
        let figures = [
            ("GPU memory", self.gpu_total_bytes),
            ("weights", self.weights_bytes),
            ("runtime overhead", self.runtime_overhead_bytes),
            ("tpar buffers", self.tpar_bytes),
            ("CUDA-graph pool", self.cuda_graph_bytes),
            ("draft model", self.draft_bytes),
            ("activation peak", self.activation_peak_bytes),
            ("KV bytes per token", self.kv_bytes_per_token),
        ];
        for (name, value) in figures {
            if !value.is_finite() || value < 0.0 {
                return bad(format!(
                    "{name} is {value}; it must be a finite number >= 0"
                ));
            }
        }
        if self.gpu_total_bytes <= 0.0 {
            return bad("GPU memory must be above 0".into());
        }
        if self.kv_bytes_per_token <= 0.0 {
            return bad("KV cache of 0 bytes per token: check --kv-bytes and the config".into());
        }
        if let Some(free) = self.free_after_load_bytes {
            if !free.is_finite() || free < 0.0 {
                return bad(format!("free memory after load is {free}; it must be >= 0"));
            }
            if free > self.gpu_total_bytes {
                return bad(format!(
                    "free memory after load ({}) is more than the GPU's total ({}); check --free-after-load-gb and --gpu-gb",
                    gib(free),
                    gib(self.gpu_total_bytes)
                ));
            }
        }
        let (flag, fraction) = match self.rule {
            EngineRule::Sglang {
                mem_fraction_static,
            } => ("--mem-fraction-static", mem_fraction_static),
            EngineRule::Vllm {
                gpu_memory_utilization,
            } => ("--gpu-memory-utilization", gpu_memory_utilization),
        };
        if !(fraction > 0.0 && fraction <= 1.0) {
            return bad(format!("{flag} {fraction} is outside (0, 1]"));
        }
        Ok(())
    }
}

pub fn plan_memory(i: &MemoryInputs) -> MemoryPlan {
    let mut terms = Vec::new();
    let mut term = |name: &str, bytes: f64, note: String| {
        terms.push(Term {
            name: name.to_owned(),
            bytes,
            note,
        })
    };
    let free = i
        .free_after_load_bytes
        .unwrap_or(i.gpu_total_bytes - i.weights_bytes - i.runtime_overhead_bytes);
    let min_kv = i.min_tokens as f64 * i.kv_bytes_per_token;
    let (budget, problem) = match i.rule {
        EngineRule::Sglang {
            mem_fraction_static,
        } => {
            let reserved = i.gpu_total_bytes * (1.0 - mem_fraction_static);
            term(
                "free after loading weights",
                free,
                if i.free_after_load_bytes.is_some() {
                    "as measured by the engine".into()
                } else {
                    format!(
                        "total {} - weights {} - runtime {}",
                        gib(i.gpu_total_bytes),
                        gib(i.weights_bytes),
                        gib(i.runtime_overhead_bytes)
                    )
                },
            );
            term(
                "tpar buffers",
                -i.tpar_bytes,
                "tpar's footprint per rank".into(),
            );
            term(
                "draft model",
                -i.draft_bytes,
                "speculative decoding's draft weights and cache".into(),
            );
            term(
                "total x (1 - mem_fraction_static)",
                -reserved,
                format!(
                    "{} x (1 - {mem_fraction_static}): left for activations and CUDA graphs",
                    gib(i.gpu_total_bytes)
                ),
            );
            let budget = free - i.tpar_bytes - i.draft_bytes - reserved;
            let problem = (budget < min_kv).then(|| {
                // The fraction at which the KV pool just holds min_tokens.
                let needed = 1.0 - (free - i.tpar_bytes - i.draft_bytes - min_kv) / i.gpu_total_bytes;
                let fix = if needed < 0.99 {
                    format!("set mem_fraction_static to at least {:.2} (it reserves {} outside the KV pool, but only {} are free after the weights{})",
                        (needed * 100.0).ceil() / 100.0, gib(reserved), gib(free),
                        if i.tpar_bytes + i.draft_bytes > 0.0 { " and tpar/draft" } else { "" })
                } else if i.draft_bytes > 0.0
                    && 1.0 - (free - i.tpar_bytes - min_kv) / i.gpu_total_bytes < 0.99
                {
                    // Without the draft model a fraction would do: it is the term at fault.
                    format!("the draft model ({}) leaves no room beside the weights ({}) at any mem_fraction_static: a smaller draft model, or shard over more GPUs", gib(i.draft_bytes), gib(i.weights_bytes))
                } else {
                    format!("the weights ({}) leave no room at any mem_fraction_static: shard over more GPUs or quantise", gib(i.weights_bytes))
                };
                format!("the KV budget is {} ({} tokens needed {}): {fix}; and keep {} of (1 - mem_fraction_static) x total for CUDA graphs and activations",
                    gib(budget), i.min_tokens, gib(min_kv), gib(i.cuda_graph_bytes))
            });
            (budget, problem)
        }
        EngineRule::Vllm {
            gpu_memory_utilization,
        } => {
            let granted = i.gpu_total_bytes * gpu_memory_utilization;
            term(
                "total x gpu_memory_utilization",
                granted,
                format!("{} x {gpu_memory_utilization}", gib(i.gpu_total_bytes)),
            );
            term("weights", -i.weights_bytes, "this rank's share".into());
            term(
                "peak activations",
                -i.activation_peak_bytes,
                "profiled forward pass".into(),
            );
            term(
                "runtime and non-torch memory",
                -i.runtime_overhead_bytes,
                "CUDA context, NCCL, allocator".into(),
            );
            term(
                "tpar buffers",
                -i.tpar_bytes,
                "tpar's footprint per rank".into(),
            );
            term(
                "CUDA graphs",
                -i.cuda_graph_bytes,
                "captured decode graphs".into(),
            );
            term(
                "draft model",
                -i.draft_bytes,
                "speculative decoding's draft weights and cache".into(),
            );
            let used = i.weights_bytes
                + i.activation_peak_bytes
                + i.runtime_overhead_bytes
                + i.tpar_bytes
                + i.cuda_graph_bytes
                + i.draft_bytes;
            let budget = granted - used;
            let problem = (budget < min_kv).then(|| {
                let needed = (used + min_kv) / i.gpu_total_bytes;
                let fix = if needed <= 0.98 {
                    format!("set gpu_memory_utilization to at least {:.2}", (needed * 100.0).ceil() / 100.0)
                } else {
                    format!("weights and buffers ({}) leave no room on a {} GPU: shard over more GPUs or quantise", gib(used), gib(i.gpu_total_bytes))
                };
                format!("the KV budget is {} ({} tokens need {}): {fix}", gib(budget), i.min_tokens, gib(min_kv))
            });
            (budget, problem)
        }
    };
    MemoryPlan {
        terms,
        kv_budget_bytes: budget,
        kv_tokens: if budget > 0.0 && i.kv_bytes_per_token > 0.0 {
            (budget / i.kv_bytes_per_token) as u64
        } else {
            0
        },
        problem,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::GIB;

    fn reported_case() -> MemoryInputs {
        MemoryInputs {
            gpu_total_bytes: 96.0 * GIB,
            free_after_load_bytes: Some(21.7 * GIB),
            weights_bytes: 72.3 * GIB,
            runtime_overhead_bytes: 2.0 * GIB,
            rule: EngineRule::Sglang {
                mem_fraction_static: 0.55,
            },
            tpar_bytes: 0.0,
            cuda_graph_bytes: 1.0 * GIB,
            draft_bytes: 0.0,
            activation_peak_bytes: 0.0,
            kv_bytes_per_token: 70272.0,
            min_tokens: 4096,
        }
    }

    #[test]
    fn impossible_inputs_are_refused_before_planning() {
        assert!(reported_case().check().is_ok());
        let refused = |change: &dyn Fn(&mut MemoryInputs), says: &str| {
            let mut i = reported_case();
            change(&mut i);
            let err = i.check().unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        };
        refused(&|i| i.gpu_total_bytes = f64::NAN, "GPU memory is NaN");
        refused(&|i| i.weights_bytes = f64::INFINITY, "weights is inf");
        refused(
            &|i| i.free_after_load_bytes = Some(500.0 * GIB),
            "more than the GPU's total",
        );
        refused(&|i| i.kv_bytes_per_token = 0.0, "0 bytes per token");
        refused(
            &|i| {
                i.rule = EngineRule::Sglang {
                    mem_fraction_static: 1.5,
                }
            },
            "outside (0, 1]",
        );
        refused(
            &|i| {
                i.rule = EngineRule::Vllm {
                    gpu_memory_utilization: 0.0,
                }
            },
            "outside (0, 1]",
        );
    }

    #[test]
    fn the_reported_case_is_diagnosed_with_the_fix() {
        let plan = plan_memory(&reported_case());
        // rest = 21.7 - 96 x 0.45 = -21.5 GiB, as the engine computed it.
        assert!(
            (plan.kv_budget_bytes / GIB + 21.5).abs() < 0.01,
            "{}",
            plan.kv_budget_bytes / GIB
        );
        assert_eq!(plan.kv_tokens, 0);
        let problem = plan.problem.unwrap();
        assert!(
            problem.contains("-21.5 GiB")
                && problem.contains("mem_fraction_static to at least 0.78"),
            "{problem}"
        );
        // At the suggested fraction the same machine has a working pool.
        let fixed = plan_memory(&MemoryInputs {
            rule: EngineRule::Sglang {
                mem_fraction_static: 0.78,
            },
            ..reported_case()
        });
        assert!(
            fixed.problem.is_none() && fixed.kv_tokens >= 4096,
            "{fixed:?}"
        );
    }

    #[test]
    fn tpar_and_the_draft_model_come_out_of_the_budget() {
        let base = MemoryInputs {
            rule: EngineRule::Sglang {
                mem_fraction_static: 0.9,
            },
            ..reported_case()
        };
        let with = MemoryInputs {
            tpar_bytes: 0.5 * GIB,
            draft_bytes: 1.5 * GIB,
            ..base.clone()
        };
        let (a, b) = (plan_memory(&base), plan_memory(&with));
        assert!(((a.kv_budget_bytes - b.kv_budget_bytes) / GIB - 2.0).abs() < 1e-9);
        assert!(b
            .terms
            .iter()
            .any(|t| t.name == "tpar buffers" && t.bytes < 0.0));
    }

    #[test]
    fn vllm_weights_too_large_for_the_card_say_so() {
        let i = MemoryInputs {
            rule: EngineRule::Vllm {
                gpu_memory_utilization: 0.9,
            },
            free_after_load_bytes: None,
            activation_peak_bytes: 4.0 * GIB,
            weights_bytes: 90.0 * GIB,
            ..reported_case()
        };
        let p = plan_memory(&i);
        assert!(p.problem.unwrap().contains("shard over more GPUs"));
        let ok = plan_memory(&MemoryInputs {
            weights_bytes: 40.0 * GIB,
            ..i
        });
        assert!(ok.problem.is_none() && ok.kv_tokens > 100_000, "{ok:?}");
    }
}
