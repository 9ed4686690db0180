//! `tpar plan memory` and `tpar plan spec-decode`: the arithmetic behind two costly surprises,
//! before anyone launches a server. Memory: the KV cache an engine will get, every term shown,
//! and the setting that fixes a budget that does not fit. Speculation: communication per
//! verify pass and per accepted token, tokens/s with and without it, and the allreduce latency
//! at which it breaks even. The plans are `tpar_harness::planner::capacity`'s and their text is
//! `tpar_report::plan`'s; this file is their arguments.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Subcommand, ValueEnum};
use tpar_harness::planner::capacity::{memory_report, spec_report, MemoryRequest, SpecRequest};
use tpar_harness::planner::memory::EngineRule;

use crate::args::usage;
use tpar_report::emit;

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
    /// The model's Hugging Face config.json (fixtures: crates/tpar-harness/fixtures/models/).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Tensor-parallel size.
    #[arg(long = "world-size", short = 'n', alias = "tp", value_name = "N", value_parser = crate::args::tp_arg)]
    tp: u64,
    /// GPU memory in GiB [default: read from GPU 0].
    #[arg(long, value_name = "GIB", value_parser = crate::args::positive_f64)]
    gpu_gb: Option<f64>,
    /// The GPUs' compute capability (9.0 for an H100 or H200, 12.0 for an RTX PRO 6000
    /// Blackwell; sm_90 also reads): tpar's kernels take 6 MiB up to 9.0 and 12 MiB on
    /// Blackwell [default: GPU 0's; the largest where there is no GPU].
    #[arg(long, value_name = "X.Y", value_parser = crate::args::compute_capability_arg)]
    compute_capability: Option<String>,
    /// SGLang: free GPU memory after the engine loaded its weights, in GiB, if measured
    /// (SGLang's log prints it; vLLM's rule does not use it).
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
    /// SGLang's fraction of GPU memory for weights and KV cache [default: 0.88]; with
    /// --engine sglang only.
    #[arg(long, value_name = "FRACTION", value_parser = crate::args::fraction_arg)]
    mem_fraction_static: Option<f64>,
    /// vLLM's fraction of GPU memory it may use [default: 0.9]; with --engine vllm only.
    #[arg(long, value_name = "FRACTION", value_parser = crate::args::fraction_arg)]
    gpu_memory_utilization: Option<f64>,
    /// Bytes per KV element: 2 (bf16/fp16), 1 (fp8) or 4 (f32) [default: the model's dtype].
    #[arg(long, value_parser = crate::args::kv_bytes_arg)]
    kv_bytes: Option<u64>,
    /// CUDA-graph pool, GiB (an estimate: it grows with the captured batch sizes).
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::non_negative_f64)]
    cuda_graph_gb: f64,
    /// Draft model (speculative decoding) per rank, GiB; or --draft-config.
    #[arg(long, default_value_t = 0.0, value_parser = crate::args::non_negative_f64, conflicts_with = "draft_config")]
    draft_gb: f64,
    /// The draft model's config.json: its weights per rank are computed.
    #[arg(long, value_name = "FILE")]
    draft_config: Option<PathBuf>,
    /// CUDA context, libraries and allocator slack, GiB.
    #[arg(long, default_value_t = 1.5, value_parser = crate::args::non_negative_f64)]
    runtime_gb: f64,
    /// vLLM: profiled peak activations, GiB [default: 2.0]; with --engine vllm only (SGLang
    /// keeps them in total x (1 - mem_fraction_static)).
    #[arg(long, value_name = "GIB", value_parser = crate::args::non_negative_f64)]
    activation_gb: Option<f64>,
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
    /// The model's Hugging Face config.json (fixtures: crates/tpar-harness/fixtures/models/).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Tensor-parallel size: the number of ranks.
    #[arg(long = "world-size", short = 'n', alias = "tp", value_name = "N", value_parser = crate::args::tp_arg)]
    tp: u64,
    /// Tokens per verify pass: draft tokens + 1.
    #[arg(long, value_parser = crate::args::tokens_arg)]
    tokens: u64,
    /// Tokens a verify pass yields on average (acceptance length, the bonus token included:
    /// 1 or more, at most --tokens).
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

pub fn run(command: PlanCommand) -> Result<ExitCode> {
    // The planner does no work that can fail at run time: its every error is about its inputs
    // (a usage error); only printing the plan can fail otherwise.
    match command {
        PlanCommand::Memory(args) => memory(args),
        PlanCommand::SpecDecode(args) => spec(args),
    }
}

/// A flag of the other engine's rule, refused rather than ignored.
fn refuse_other_engine(engine: Engine, flags: &[(&str, bool)]) -> Result<()> {
    let (this, other) = match engine {
        Engine::Sglang => ("sglang", "vllm"),
        Engine::Vllm => ("vllm", "sglang"),
    };
    if let Some((flag, _)) = flags.iter().find(|(_, given)| *given) {
        anyhow::bail!(crate::args::Usage(format!(
            "--{flag} belongs to --engine {other}'s rule and --engine {this} ignores it; add --engine {other}, or leave it out"
        )));
    }
    Ok(())
}

fn memory(a: MemoryArgs) -> Result<ExitCode> {
    match a.engine {
        Engine::Sglang => refuse_other_engine(
            a.engine,
            &[
                ("gpu-memory-utilization", a.gpu_memory_utilization.is_some()),
                ("activation-gb", a.activation_gb.is_some()),
            ],
        )?,
        Engine::Vllm => refuse_other_engine(
            a.engine,
            &[
                ("mem-fraction-static", a.mem_fraction_static.is_some()),
                ("free-after-load-gb", a.free_after_load_gb.is_some()),
            ],
        )?,
    }
    let request = MemoryRequest {
        config: a.config,
        tp: a.tp,
        gpu_gb: a.gpu_gb,
        compute_capability: a.compute_capability,
        free_after_load_gb: a.free_after_load_gb,
        weights_gb: a.weights_gb,
        rule: match a.engine {
            Engine::Sglang => EngineRule::Sglang {
                mem_fraction_static: a.mem_fraction_static.unwrap_or(0.88),
            },
            Engine::Vllm => EngineRule::Vllm {
                gpu_memory_utilization: a.gpu_memory_utilization.unwrap_or(0.9),
            },
        },
        nccl: a.nccl.mode(),
        kv_bytes: a.kv_bytes,
        cuda_graph_gb: a.cuda_graph_gb,
        draft_gb: a.draft_gb,
        draft_config: a.draft_config,
        runtime_gb: a.runtime_gb,
        activation_gb: a.activation_gb.unwrap_or(2.0),
        context: a.context,
    };
    let report = memory_report(&request).map_err(|e| usage(e.into()))?;
    let engine = match a.engine {
        Engine::Sglang => "SGLang",
        Engine::Vllm => "vLLM",
    };
    let text = tpar_report::plan::memory(&report, engine);
    emit(&text, a.json.then_some("-"), &report)?;
    Ok(if report.plan.problem.is_some() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn spec(a: SpecArgs) -> Result<ExitCode> {
    let request = SpecRequest {
        config: a.config,
        tp: a.tp,
        tokens: a.tokens,
        acceptance: a.acceptance,
        latency_us: a.latency_us,
        latency_json: a.latency_json,
        latency_topology: a.latency_topology,
        plain_latency_us: a.plain_latency_us,
        plain_ms: a.plain_ms,
        verify_ms: a.verify_ms,
        draft_ms: a.draft_ms,
        tflops: a.tflops,
        hbm_gbps: a.hbm_gbps,
    };
    let report = spec_report(&request).map_err(|e| usage(e.into()))?;
    let text = tpar_report::plan::spec(&report);
    emit(&text, a.json.then_some("-"), &report)?;
    Ok(ExitCode::SUCCESS)
}
