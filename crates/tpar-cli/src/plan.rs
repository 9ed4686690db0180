//! `tpar plan memory` and `tpar plan spec-decode`: the arithmetic behind two costly surprises,
//! before anyone launches a server. Memory: the KV cache an engine will get, every term shown,
//! and the setting that fixes a budget that does not fit. Speculation: communication per
//! verify pass and per accepted token, tokens/s with and without it, and the allreduce latency
//! at which it breaks even.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;
use tpar::backend::cuda::CudaConfig;
use tpar::planner::memory::{plan_memory, EngineRule, MemoryInputs, MemoryPlan};
use tpar::planner::model::ModelShape;
use tpar::planner::spec::{plan_spec, roofline_ms, Latency, SpecInputs, SpecPlan};
use tpar::planner::{gib, GIB};

use crate::args::usage;
use crate::report::{emit, Table};

#[derive(Subcommand, Debug)]
pub enum PlanCommand {
    /// The KV cache an engine gets per GPU, with every term, or what to change when it does not fit.
    Memory(MemoryArgs),
    /// Whether speculative decoding pays with this allreduce latency, and where it breaks even.
    SpecDecode(SpecArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Engine {
    /// rest = free after weights - total x (1 - mem_fraction_static)
    Sglang,
    /// kv = total x gpu_memory_utilization - (weights + activations + other memory)
    Vllm,
}

/// Whether tpar runs with an NCCL communicator of its own (`tpar::communicator::NcclMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum NcclChoice {
    /// tpar's kernels only; sizes they do not take stay on the engine's NCCL (the engine
    /// plugins and Python's default): no memory for NCCL.
    None,
    /// tpar creates its own NCCL communicator for those sizes: about 0.5 GiB more per GPU and
    /// group (an estimate from NCCL_BUFFSIZE and the channel settings).
    Own,
}

impl NcclChoice {
    fn mode(self) -> tpar::communicator::NcclMode {
        match self {
            NcclChoice::None => tpar::communicator::NcclMode::None,
            NcclChoice::Own => tpar::communicator::NcclMode::Own,
        }
    }
}

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct MemoryArgs {
    /// The model's Hugging Face config.json (fixtures: crates/tpar/fixtures/models/).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Tensor-parallel size.
    #[arg(long = "world-size", short = 'n', alias = "tp", value_name = "N", value_parser = crate::args::tp_arg)]
    tp: u64,
    /// GPU memory in GiB [default: read from GPU 0].
    #[arg(long, value_name = "GIB", value_parser = crate::args::positive_f64)]
    gpu_gb: Option<f64>,
    /// Free GPU memory after the engine loaded its weights, in GiB, if measured.
    #[arg(long, value_name = "GIB", value_parser = crate::args::positive_f64)]
    free_after_load_gb: Option<f64>,
    /// Weights per rank in GiB [default: computed from the config].
    #[arg(long, value_name = "GIB", value_parser = crate::args::non_negative_f64)]
    weights_gb: Option<f64>,
    /// The engine whose rule sizes the KV cache (SGLang: --mem-fraction-static; vLLM:
    /// --gpu-memory-utilization).
    #[arg(long, value_enum, default_value = "sglang")]
    engine: Engine,
    /// tpar's NCCL: none (the engine keeps its own NCCL for what tpar does not take) or own
    /// (tpar's own communicator, counted in tpar's footprint).
    #[arg(long, value_enum, default_value = "none")]
    nccl: NcclChoice,
    /// SGLang's fraction of GPU memory for weights and KV cache.
    #[arg(long, default_value_t = 0.88, value_parser = crate::args::fraction_arg)]
    mem_fraction_static: f64,
    /// vLLM's fraction of GPU memory it may use.
    #[arg(long, default_value_t = 0.9, value_parser = crate::args::fraction_arg)]
    gpu_memory_utilization: f64,
    /// Bytes per KV element: 2 (bf16/fp16) or 1 (fp8) [default: the model's dtype].
    #[arg(long, value_parser = crate::args::kv_bytes_arg)]
    kv_bytes: Option<u64>,
    /// CUDA-graph pool, GiB (an estimate: it grows with the captured batch sizes).
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::non_negative_f64)]
    cuda_graph_gb: f64,
    /// Draft model (speculative decoding) per rank, GiB; or --draft-config.
    #[arg(long, default_value_t = 0.0, value_parser = crate::args::non_negative_f64)]
    draft_gb: f64,
    /// The draft model's config.json: its weights per rank are computed.
    #[arg(long, value_name = "FILE")]
    draft_config: Option<PathBuf>,
    /// CUDA context, libraries and allocator slack, GiB.
    #[arg(long, default_value_t = 1.5, value_parser = crate::args::non_negative_f64)]
    runtime_gb: f64,
    /// vLLM: profiled peak activations, GiB.
    #[arg(long, default_value_t = 2.0, value_parser = crate::args::non_negative_f64)]
    activation_gb: f64,
    /// Fewest KV tokens worth running with (one full context).
    #[arg(long, default_value_t = 4096, value_parser = crate::args::tokens_arg)]
    context: u64,
    /// Print the plan as JSON on stdout (the text goes to stderr).
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct SpecArgs {
    /// The model's Hugging Face config.json (fixtures: crates/tpar/fixtures/models/).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Tensor-parallel size: the number of ranks.
    #[arg(long = "world-size", short = 'n', alias = "tp", value_name = "N", value_parser = crate::args::tp_arg)]
    tp: u64,
    /// Tokens per verify pass: draft tokens + 1.
    #[arg(long, value_parser = crate::args::tokens_arg)]
    tokens: u64,
    /// Tokens accepted per verify pass on average (acceptance length).
    #[arg(long, value_parser = crate::args::positive_f64)]
    acceptance: f64,
    /// Allreduce latency at every size, us; or --latency-json.
    #[arg(long, value_name = "US", value_parser = crate::args::positive_f64)]
    latency_us: Option<f64>,
    /// A `tpar bench --json` file: the fastest correct result at each size.
    #[arg(long, value_name = "FILE")]
    latency_json: Option<PathBuf>,
    /// A topology file (`tpar doctor --json`'s, or crates/tpar/fixtures/topologies/*.json):
    /// the latency tpar's model predicts there, for the path its dispatcher would pick at
    /// each size, with -n ranks. A measured --latency-json is better where one exists.
    #[arg(long, value_name = "FILE")]
    latency_topology: Option<PathBuf>,
    /// Allreduce latency of plain decoding (one token), us, if it takes another path.
    #[arg(long, value_name = "US", value_parser = crate::args::positive_f64)]
    plain_latency_us: Option<f64>,
    /// Compute of a plain decode step, ms [default: roofline from --tflops and --hbm-gbps].
    #[arg(long, value_parser = crate::args::positive_f64)]
    plain_ms: Option<f64>,
    /// Compute of a verify pass, ms [default: roofline].
    #[arg(long, value_parser = crate::args::positive_f64)]
    verify_ms: Option<f64>,
    /// Draft model time per verify pass, ms [default: (tokens - 1) draft steps, each 2/layers
    /// of a plain step, as for a one-layer EAGLE-3 head].
    #[arg(long, value_parser = crate::args::non_negative_f64)]
    draft_ms: Option<f64>,
    /// Dense bf16 TFLOP/s per GPU for the roofline.
    #[arg(long, default_value_t = 400.0, value_parser = crate::args::positive_f64)]
    tflops: f64,
    /// Memory bandwidth per GPU, GB/s, for the roofline.
    #[arg(long, default_value_t = 1800.0, value_parser = crate::args::positive_f64)]
    hbm_gbps: f64,
    /// Print the plan as JSON on stdout (the text goes to stderr).
    #[arg(long)]
    json: bool,
}

fn load_model(path: &PathBuf) -> Result<ModelShape> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let name = path
        .file_stem()
        .map_or("model".into(), |s| s.to_string_lossy().into_owned());
    Ok(ModelShape::from_config_json(&text, &name)?)
}

pub fn run(command: PlanCommand) -> Result<ExitCode> {
    // The planner does no work that can fail at run time: every error is about its inputs.
    match command {
        PlanCommand::Memory(args) => memory(args),
        PlanCommand::SpecDecode(args) => spec(args),
    }
    .map_err(usage)
}

#[derive(Serialize)]
struct MemoryReport {
    model: String,
    tp: u64,
    kv_bytes_per_token: f64,
    inputs: MemoryInputs,
    plan: MemoryPlan,
}

fn memory(a: MemoryArgs) -> Result<ExitCode> {
    if a.tp == 0 {
        bail!("-n/--world-size must be at least 1");
    }
    let model = load_model(&a.config)?;
    model.check_tp(a.tp).map_err(anyhow::Error::from)?;
    let gpu_bytes = match a.gpu_gb {
        Some(g) => g * GIB,
        None => tpar::topology::Topology::detect()
            .ok()
            .and_then(|t| t.gpus.first().map(|g| g.memory_bytes as f64))
            .context("no GPU to read its memory from: give --gpu-gb")?,
    };
    let draft = match &a.draft_config {
        Some(path) => load_model(path)?.weight_bytes_per_rank(a.tp),
        None => a.draft_gb * GIB,
    };
    let kv_bytes = a.kv_bytes.unwrap_or(model.activation_bytes);
    let footprint =
        tpar::communicator::planned_footprint(a.tp as usize, &CudaConfig::default(), a.nccl.mode());
    let tpar = footprint.device_bytes as f64;
    let inputs = MemoryInputs {
        gpu_total_bytes: gpu_bytes,
        free_after_load_bytes: a.free_after_load_gb.map(|g| g * GIB),
        weights_bytes: a
            .weights_gb
            .map_or_else(|| model.weight_bytes_per_rank(a.tp), |g| g * GIB),
        runtime_overhead_bytes: a.runtime_gb * GIB,
        rule: match a.engine {
            Engine::Sglang => EngineRule::Sglang {
                mem_fraction_static: a.mem_fraction_static,
            },
            Engine::Vllm => EngineRule::Vllm {
                gpu_memory_utilization: a.gpu_memory_utilization,
            },
        },
        tpar_bytes: tpar,
        cuda_graph_bytes: a.cuda_graph_gb * GIB,
        draft_bytes: draft,
        activation_peak_bytes: a.activation_gb * GIB,
        kv_bytes_per_token: model.kv_bytes_per_token(a.tp, kv_bytes) as f64,
        min_tokens: a.context,
    };
    inputs.check().map_err(anyhow::Error::from)?;
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
        );
    }
    let mut t = Table::new(&["term", "GiB", "what"], 1);
    for term in &plan.terms {
        t.push(vec![
            term.name.clone(),
            format!("{:+.2}", term.bytes / GIB),
            term.note.clone(),
        ]);
    }
    let attention = if model.mla.is_some() {
        "MLA latent"
    } else {
        "K and V"
    };
    let text = format!(
        "tpar plan memory: {} ({:.1}B parameters, {:.1} GiB of weights per rank at TP {}), {} GPU of {}\n{}\n\nKV budget {} = {} tokens of {} bytes each ({attention}, {} bytes per element){}",
        model.name,
        model.parameters() as f64 / 1e9,
        inputs.weights_bytes / GIB,
        a.tp,
        match a.engine { Engine::Sglang => "SGLang", Engine::Vllm => "vLLM" },
        gib(gpu_bytes),
        t.render(),
        gib(plan.kv_budget_bytes),
        plan.kv_tokens,
        inputs.kv_bytes_per_token,
        kv_bytes,
        plan.problem.as_ref().map_or(String::new(), |p| format!("\n\nDOES NOT FIT: {p}"))
    );
    let failed = plan.problem.is_some();
    let report = MemoryReport {
        model: model.name.clone(),
        tp: a.tp,
        kv_bytes_per_token: inputs.kv_bytes_per_token,
        inputs,
        plan,
    };
    emit(&text, a.json.then_some("-"), &report)?;
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[derive(Serialize)]
struct SpecReport {
    model: String,
    tp: u64,
    inputs: SpecInputs,
    assumptions: Vec<String>,
    plan: SpecPlan,
}

fn spec(a: SpecArgs) -> Result<ExitCode> {
    if a.tp == 0 || a.tokens == 0 || a.acceptance <= 0.0 {
        bail!("-n/--world-size and --tokens must be at least 1 and --acceptance above 0");
    }
    if a.acceptance > a.tokens as f64 {
        bail!(
            "--acceptance {} exceeds --tokens {}: a pass cannot accept more tokens than it scores",
            a.acceptance,
            a.tokens
        );
    }
    let model = load_model(&a.config)?;
    model.check_tp(a.tp).map_err(anyhow::Error::from)?;
    let mut assumptions = Vec::new();
    let latency = match (a.latency_us, &a.latency_json, &a.latency_topology) {
        (Some(us), None, None) => Latency::Flat(us),
        (None, Some(path), None) => Latency::from_bench_json(&std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?)?,
        (None, None, Some(path)) => {
            let topology = tpar::topology::Topology::load(path)?;
            let (latency, why) = tpar::planner::latency_model::modelled_latency(&topology, a.tp as usize, tpar::DType::Bf16)?;
            assumptions.push(format!("allreduce latency {why}"));
            latency
        }
        _ => bail!("give the allreduce latency one way: --latency-us US, --latency-json FILE from `tpar bench --json`, or --latency-topology FILE"),
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
    let p = plan_spec(&model, &inputs);
    let verdict = if p.spec_tokens_per_s > p.plain_tokens_per_s {
        "speculation wins"
    } else {
        "speculation LOSES"
    };
    let text = format!(
        "tpar plan spec-decode: {} at TP {}, {} tokens per verify pass, acceptance {}\n\
         allreduces per pass: {} of {} B (verify) / {} B (plain step)\n\
         allreduce latency: {:.1} us (verify size), {:.1} us (plain size)\n\
         communication: {:.2} ms per verify pass, {:.2} ms per accepted token, {:.2} ms per plain step\n\
         tokens/s: {:.1} with speculation, {:.1} without: {verdict}\n\
         break-even: {}\n{}",
        model.name,
        a.tp,
        a.tokens,
        a.acceptance,
        p.allreduces_per_pass,
        p.verify_allreduce_bytes,
        p.plain_allreduce_bytes,
        p.verify_latency_us,
        p.plain_latency_us,
        p.comm_per_pass_ms,
        p.comm_per_accepted_token_ms,
        p.comm_per_plain_step_ms,
        p.spec_tokens_per_s,
        p.plain_tokens_per_s,
        p.breakeven_latency_us.map_or("speculation loses even with free allreduces (compute alone)".to_owned(), |us| format!(
            "speculation pays while the {} B allreduce takes under {us:.1} us",
            p.verify_allreduce_bytes
        )),
        if assumptions.is_empty() { String::new() } else { format!("assumed: {}", assumptions.join("; ")) }
    );
    let report = SpecReport {
        model: model.name.clone(),
        tp: a.tp,
        inputs,
        assumptions,
        plan: p,
    };
    emit(&text, a.json.then_some("-"), &report)?;
    Ok(ExitCode::SUCCESS)
}
