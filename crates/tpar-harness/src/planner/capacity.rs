//! The two plans `tpar plan` prints, from an operator's request: the KV cache an engine gets
//! per GPU ([`memory_report`]) and whether speculative decoding pays ([`spec_report`]). Here
//! the request is resolved (model config read, GPU memory detected, tpar's own footprint,
//! latencies loaded or modelled, roofline compute times) and checked; printing is the caller's.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::planner::memory::{plan_memory, EngineRule, MemoryInputs, MemoryPlan};
use crate::planner::model::ModelShape;
use crate::planner::spec::{plan_spec, roofline_ms, Latency, SpecInputs, SpecPlan};
use crate::planner::GIB;
use tpar::communicator::NcclMode;
use tpar::memory::MemoryFootprint;
use tpar::Config;

/// A request that cannot be planned: every error is about the inputs (the message names the
/// input and the fix).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PlanError(pub String);

type Result<T> = std::result::Result<T, PlanError>;

/// The message with its causes after it, `error: cause`; the library's "invalid argument: "
/// is left out, since every plan error is about an argument.
fn chain(e: &tpar::Error) -> String {
    match e {
        tpar::Error::InvalidArgument(message) => message.clone(),
        other => crate::error_chain(other),
    }
}

impl From<tpar::Error> for PlanError {
    fn from(e: tpar::Error) -> PlanError {
        PlanError(chain(&e))
    }
}

/// Reads a model's Hugging Face `config.json` given by `--flag` (named as
/// [`crate::planner::model::load_config`] names it).
pub fn load_model(flag: &str, path: &Path) -> Result<ModelShape> {
    use crate::planner::model::{load_config, ConfigFileError};
    load_config(path).map_err(|e| match e {
        ConfigFileError::Unreadable { source, .. } => {
            PlanError(format!("cannot read --{flag} {}: {source}", path.display()))
        }
        ConfigFileError::Model(e) => PlanError(chain(&e)),
    })
}

/// `tpar plan memory`'s inputs; sizes in GiB as the engines' flags give them.
#[derive(Clone, Debug)]
pub struct MemoryRequest {
    pub config: PathBuf,
    pub tp: u64,
    /// GPU memory; `None`: read from the first GPU of this machine.
    pub gpu_gb: Option<f64>,
    /// The GPUs' compute capability ("9.0"), whose kernels the plan counts; `None`: the first
    /// GPU of this machine's, or the largest architecture's where there is none.
    pub compute_capability: Option<String>,
    pub free_after_load_gb: Option<f64>,
    /// Weights per rank; `None`: from the model's shape.
    pub weights_gb: Option<f64>,
    pub rule: EngineRule,
    pub nccl: NcclMode,
    /// Bytes per KV element; `None`: the model's activation dtype.
    pub kv_bytes: Option<u64>,
    pub cuda_graph_gb: f64,
    pub draft_gb: f64,
    /// A draft model's config, whose weights per rank replace `draft_gb`.
    pub draft_config: Option<PathBuf>,
    pub runtime_gb: f64,
    pub activation_gb: f64,
    pub context: u64,
}

/// The memory plan with what it was computed from (the JSON of `tpar plan memory`).
#[derive(Serialize, Debug)]
pub struct MemoryReport {
    pub model: String,
    pub tp: u64,
    pub kv_bytes_per_token: f64,
    pub inputs: MemoryInputs,
    pub plan: MemoryPlan,
    /// How the config was read (the weight format and where it came from).
    pub notes: Vec<String>,
    /// The model's parameter count.
    #[serde(skip)]
    pub parameters: u64,
    /// The model caches an MLA latent (not K and V).
    #[serde(skip)]
    pub mla: bool,
    /// Bytes per KV element.
    #[serde(skip)]
    pub kv_bytes: u64,
    /// tpar's own footprint per rank that the plan reserves.
    #[serde(skip)]
    pub footprint: MemoryFootprint,
}

/// Plans the KV cache of `request`; a budget that does not fit is a plan with a `problem`,
/// not an error.
pub fn memory_report(a: &MemoryRequest) -> Result<MemoryReport> {
    if a.tp == 0 {
        return Err(PlanError("-n/--world-size must be at least 1".into()));
    }
    let model = load_model("config", &a.config)?;
    model.check_tp(a.tp)?;
    // GPU 0, read only where a flag leaves something to read.
    let gpu0 = (a.gpu_gb.is_none() || a.compute_capability.is_none())
        .then(|| tpar::topology::Topology::detect().ok())
        .flatten()
        .and_then(|t| t.gpus.into_iter().next());
    let gpu_bytes = match (a.gpu_gb, &gpu0) {
        (Some(g), _) => g * GIB,
        (None, Some(gpu)) => gpu.memory_bytes as f64,
        (None, None) => {
            return Err(PlanError(
                "no GPU to read its memory from: give --gpu-gb".into(),
            ))
        }
    };
    let (capability, capability_from) = match (&a.compute_capability, &gpu0) {
        (Some(c), _) => (Some(c.clone()), format!("compute capability {c} (--compute-capability)")),
        (None, Some(gpu)) => match &gpu.compute_capability {
            Some(c) => (Some(c.clone()), format!("GPU 0, compute capability {c}")),
            None => (None, "the largest architecture: GPU 0 did not say its compute capability; give --compute-capability".into()),
        },
        (None, None) => (
            None,
            "the largest architecture, no GPU here (--compute-capability 9.0 plans an H100 or H200)".into(),
        ),
    };
    let draft = match &a.draft_config {
        Some(path) => load_model("draft-config", path)?.weight_bytes_per_rank(a.tp),
        None => a.draft_gb * GIB,
    };
    let kv_bytes = a.kv_bytes.unwrap_or(model.activation_bytes);
    let footprint = tpar::communicator::planned_footprint_on(
        a.tp as usize,
        &Config::default(),
        a.nccl,
        capability.as_deref(),
    );
    let inputs = MemoryInputs {
        gpu_total_bytes: gpu_bytes,
        free_after_load_bytes: a.free_after_load_gb.map(|g| g * GIB),
        weights_bytes: a
            .weights_gb
            .map_or_else(|| model.weight_bytes_per_rank(a.tp), |g| g * GIB),
        runtime_overhead_bytes: a.runtime_gb * GIB,
        rule: a.rule,
        tpar_bytes: footprint.device_bytes as f64,
        cuda_graph_bytes: a.cuda_graph_gb * GIB,
        draft_bytes: draft,
        activation_peak_bytes: a.activation_gb * GIB,
        kv_bytes_per_token: model.kv_bytes_per_token(a.tp, kv_bytes) as f64,
        min_tokens: a.context,
    };
    inputs.check()?;
    let mut plan = plan_memory(&inputs);
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    for term in plan.terms.iter_mut().filter(|t| t.name == "tpar buffers") {
        term.note = format!(
            "tpar's footprint per rank: buffers {:.1} MiB + kernels {:.1} MiB{}",
            mib(footprint.device_buffer_bytes),
            mib(footprint.module_bytes),
            if footprint.nccl_bytes > 0 {
                format!(
                    " + its own NCCL {:.1} MiB (estimate)",
                    mib(footprint.nccl_bytes)
                )
            } else {
                " (no NCCL of its own: --nccl none)".into()
            }
        ) + &format!("; kernels planned for {capability_from}");
    }
    Ok(MemoryReport {
        model: model.name.clone(),
        tp: a.tp,
        kv_bytes_per_token: inputs.kv_bytes_per_token,
        inputs,
        plan,
        notes: model.notes.clone(),
        parameters: model.parameters(),
        mla: model.mla.is_some(),
        kv_bytes,
        footprint,
    })
}

/// `tpar plan spec-decode`'s inputs. The allreduce latency comes one way: flat, from a
/// `tpar bench --json` file, or modelled for a topology file.
#[derive(Clone, Debug)]
pub struct SpecRequest {
    pub config: PathBuf,
    pub tp: u64,
    pub tokens: u64,
    pub acceptance: f64,
    pub latency_us: Option<f64>,
    pub latency_json: Option<PathBuf>,
    pub latency_topology: Option<PathBuf>,
    pub plain_latency_us: Option<f64>,
    /// Compute times; `None`: a roofline estimate (listed among the assumptions).
    pub plain_ms: Option<f64>,
    pub verify_ms: Option<f64>,
    pub draft_ms: Option<f64>,
    pub tflops: f64,
    pub hbm_gbps: f64,
}

/// The speculation plan with its inputs and the assumptions made to fill them (the JSON of
/// `tpar plan spec-decode`).
#[derive(Serialize, Debug)]
pub struct SpecReport {
    pub model: String,
    pub tp: u64,
    pub inputs: SpecInputs,
    pub assumptions: Vec<String>,
    pub plan: SpecPlan,
}

/// Plans speculative decoding for `request`.
pub fn spec_report(a: &SpecRequest) -> Result<SpecReport> {
    if a.tp == 0 || a.tokens == 0 {
        return Err(PlanError(
            "-n/--world-size and --tokens must be at least 1".into(),
        ));
    }
    if a.acceptance.is_nan() || a.acceptance < 1.0 {
        return Err(PlanError(format!(
            "--acceptance {} is below 1: a verify pass always yields at least one token (the \
             bonus token), so the acceptance length counts it and is 1 or more",
            a.acceptance
        )));
    }
    if a.acceptance > a.tokens as f64 {
        return Err(PlanError(format!(
            "--acceptance {} exceeds --tokens {}: a pass cannot accept more tokens than it scores",
            a.acceptance, a.tokens
        )));
    }
    let model = load_model("config", &a.config)?;
    model.check_tp(a.tp)?;
    let mut assumptions = model.notes.clone();
    let latency = match (a.latency_us, &a.latency_json, &a.latency_topology) {
        (Some(us), None, None) => Latency::Flat(us),
        (None, Some(path), None) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                PlanError(format!("cannot read --latency-json {}: {e}", path.display()))
            })?;
            Latency::from_bench_json(&text, a.tp)
                .map_err(|e| PlanError(format!("--latency-json {}: {}", path.display(), chain(&e))))?
        }
        (None, None, Some(path)) => {
            let topology = tpar::topology::Topology::load(path)?;
            let (latency, why) = crate::planner::latency_model::modelled_latency(
                &topology,
                a.tp as usize,
                tpar::DType::Bf16,
            )?;
            assumptions.push(format!("allreduce latency {why}"));
            latency
        }
        _ => return Err(PlanError("give the allreduce latency one way: --latency-us US, --latency-json FILE from `tpar bench --json`, or --latency-topology FILE".into())),
    };
    let mut roofline = |what: &str, tokens: u64| {
        let ms = roofline_ms(&model, a.tp, tokens, a.tflops, a.hbm_gbps);
        assumptions.push(format!(
            "{what} compute {ms:.2} ms: roofline at {} TFLOP/s and {} GB/s per GPU",
            a.tflops, a.hbm_gbps
        ));
        ms
    };
    let plain = a.plain_ms.unwrap_or_else(|| roofline("plain step", 1));
    let verify = a
        .verify_ms
        .unwrap_or_else(|| roofline("verify pass", a.tokens));
    let draft = a.draft_ms.unwrap_or_else(|| {
        let ms = (a.tokens - 1) as f64 * plain * 2.0 / model.layers as f64;
        assumptions.push(format!(
            "draft {ms:.2} ms: {} draft steps of a one-layer head",
            a.tokens - 1
        ));
        ms
    });
    let inputs = SpecInputs {
        tokens_per_pass: a.tokens,
        acceptance: a.acceptance,
        latency,
        plain_latency: a.plain_latency_us.map(Latency::Flat),
        plain_compute_ms: plain,
        verify_compute_ms: verify,
        draft_ms: draft,
    };
    let plan = plan_spec(&model, &inputs);
    Ok(SpecReport {
        model: model.name.clone(),
        tp: a.tp,
        inputs,
        assumptions,
        plan,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("fixtures/models/{name}.json"))
    }

    fn memory_request(gpu_gb: f64) -> MemoryRequest {
        MemoryRequest {
            compute_capability: None,
            config: fixture("llama-3.1-70b"),
            tp: 8,
            gpu_gb: Some(gpu_gb),
            free_after_load_gb: None,
            weights_gb: None,
            rule: EngineRule::Sglang {
                mem_fraction_static: 0.9,
            },
            nccl: NcclMode::None,
            kv_bytes: None,
            cuda_graph_gb: 1.0,
            draft_gb: 0.0,
            draft_config: None,
            runtime_gb: 1.0,
            activation_gb: 1.0,
            context: 0,
        }
    }

    #[test]
    fn a_draft_model_that_leaves_no_room_is_the_term_named() {
        // DeepSeek-V3 at TP 8 on 96 GiB fits alone; a 70B draft beside it does not.
        let alone = MemoryRequest {
            config: fixture("deepseek-v3"),
            gpu_gb: Some(96.0),
            ..memory_request(96.0)
        };
        assert!(memory_report(&alone).unwrap().plan.problem.is_none());
        let with_draft = MemoryRequest {
            draft_config: Some(fixture("llama-3.1-70b")),
            ..alone
        };
        let problem = memory_report(&with_draft).unwrap().plan.problem.unwrap();
        assert!(
            problem.contains("the draft model (") && problem.contains("a smaller draft model"),
            "{problem}"
        );
        // Weights that alone leave no room are named as before.
        let problem = memory_report(&memory_request(8.0))
            .unwrap()
            .plan
            .problem
            .unwrap();
        assert!(!problem.contains("draft"), "{problem}");
    }

    #[test]
    fn a_big_gpu_gets_a_kv_budget_and_a_small_one_a_problem() {
        let big = memory_report(&memory_request(141.0)).unwrap();
        assert!(big.plan.problem.is_none(), "{:?}", big.plan.problem);
        assert!(big.plan.kv_tokens > 0);
        assert!(big.footprint.device_bytes > 0);
        let small = memory_report(&memory_request(8.0)).unwrap();
        assert!(small.plan.problem.is_some());
    }

    #[test]
    fn the_kernels_planned_are_the_given_architectures() {
        let on = |c: &str| {
            memory_report(&MemoryRequest {
                compute_capability: Some(c.into()),
                ..memory_request(141.0)
            })
            .unwrap()
        };
        let (hopper, blackwell) = (on("9.0"), on("12.0"));
        assert_eq!(hopper.footprint.module_bytes, 6 << 20);
        assert_eq!(blackwell.footprint.module_bytes, 12 << 20);
        assert_eq!(
            blackwell.footprint.device_bytes - hopper.footprint.device_bytes,
            6 << 20
        );
        let note = |r: &MemoryReport| {
            let term = r.plan.terms.iter().find(|t| t.name == "tpar buffers");
            term.expect("tpar's term").note.clone()
        };
        assert!(
            note(&hopper)
                .ends_with("kernels planned for compute capability 9.0 (--compute-capability)"),
            "{}",
            note(&hopper)
        );
        assert!(
            note(&blackwell).contains("kernels 12.0 MiB"),
            "{}",
            note(&blackwell)
        );
    }

    #[test]
    fn bad_inputs_name_the_input() {
        let mut r = memory_request(80.0);
        r.config = PathBuf::from("/nonexistent/config.json");
        let e = memory_report(&r).unwrap_err().to_string();
        assert!(
            e.starts_with("cannot read --config /nonexistent/config.json: "),
            "{e}"
        );
        let spec = SpecRequest {
            config: fixture("llama-3.1-70b"),
            tp: 8,
            tokens: 2,
            acceptance: 3.0,
            latency_us: Some(20.0),
            latency_json: None,
            latency_topology: None,
            plain_latency_us: None,
            plain_ms: None,
            verify_ms: None,
            draft_ms: None,
            tflops: 900.0,
            hbm_gbps: 4800.0,
        };
        let e = spec_report(&spec).unwrap_err().to_string();
        assert!(e.contains("--acceptance 3 exceeds --tokens 2"), "{e}");
        for below_one in [0.5, f64::NAN] {
            let e = spec_report(&SpecRequest {
                acceptance: below_one,
                ..spec.clone()
            })
            .unwrap_err()
            .to_string();
            assert!(e.contains("is below 1"), "{e}");
        }
        let ok = spec_report(&SpecRequest {
            acceptance: 1.5,
            ..spec
        })
        .unwrap();
        assert_eq!(ok.assumptions.len(), 4, "{:?}", ok.assumptions);
        assert_eq!(ok.assumptions[0], "weights: bfloat16 (torch_dtype)");
    }
}
