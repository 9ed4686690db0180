//! `tpar bench step`: the arguments, mapped onto the harness's request checks and timed passes
//! (`tpar_harness::step_request`, `tpar_harness::bench_step`, which says what the pass
//! holds); the table is `tpar_report::step`'s.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use tpar::memory::human_bytes;
use tpar_harness::bench_step::{self, Norms, StepSettings};
use tpar_harness::cuda_ranks::parse_selection;
use tpar_harness::reports::StepReport;
use tpar_harness::step_request::{self, StepRequestError};

use crate::args::{parse_list, usage};
use crate::ranks::on_cuda_ranks;
use tpar_harness::job::cuda_config;
use tpar_report::{emit, print_err, ranks, step};

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
    #[arg(long, default_value_t = 1, value_parser = crate::args::step_tokens_arg)]
    tokens: usize,
    /// Layers in the pass [default: the config's num_hidden_layers].
    #[arg(long, value_parser = crate::args::layers_arg)]
    layers: Option<u64>,
    #[arg(long, default_value = "nccl,auto", value_name = "LIST", allow_hyphen_values = true, help = concat!(
        "How the allreduces run, comma-separated, from: ", tpar_harness::selection_names!(),
        " (auto: tpar's dispatcher, NCCL included). The pass without allreduces is always timed too"
    ))]
    algos: String,
    /// How the norm after each allreduce runs, comma-separated, from: separate (its own kernel
    /// after the allreduce, as engines run it), fused (one call with tpar's allreduce; NCCL
    /// rows have no fused form).
    #[arg(
        long,
        default_value = "separate,fused",
        value_name = "LIST",
        allow_hyphen_values = true
    )]
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

pub fn run(args: StepArgs) -> Result<std::process::ExitCode> {
    crate::args::check_outputs(args.json.as_deref(), None)?;
    // A config that cannot be read or understood, or counts it does not allow, are the
    // request's fault: usage errors, before any GPU is looked at.
    let model = step_request::load_model(&args.config).map_err(|e| usage(e.into()))?;
    let layers = step_request::layers(&model, args.layers, [args.tp, args.tokens, args.replays])
        .map_err(|e: StepRequestError| usage(e.into()))?;
    let norms = parse_list(&args.norms, "norms", |s| {
        s.parse::<Norms>().map_err(|e| anyhow::anyhow!(e))
    })?;
    let algos = parse_list(&args.algos, "algos", |s| Ok(parse_selection(s)?))?;
    let reduces = step_request::reduces(&algos, &norms);
    let timeout = args.timeout;
    let gpus = tpar_harness::cuda_ranks::device_count().context(
        "tpar bench step runs the pass on GPUs (`tpar plan spec-decode` predicts it without one)",
    )?;
    let processes = step_request::processes(args.processes, args.tp, gpus);
    if processes && !args.processes && std::env::var_os("RANK").is_none() {
        print_err(
            "tpar bench step: one process per rank (a GPU each), so that NCCL can run beside tpar",
        );
    }
    tpar_harness::blas::load()?;
    let settings = StepSettings::new(
        model,
        layers,
        args.tp as u64,
        args.tokens as u64,
        reduces,
        args.replays,
        processes,
    );

    on_cuda_ranks(processes, args.tp, timeout, |make, mode| {
        let mut group = make(cuda_config(timeout))?;
        let leader = group.is_leader();
        if leader {
            print_err(&format!(
                "tpar bench step: preparing {} ({mode}): weights of {} layer kind(s), {} per rank",
                ranks(args.tp),
                settings.layer_kinds(),
                human_bytes(settings.weight_bytes(true))
            ));
        }
        let rows = bench_step::run(&mut group, &settings, |reduce| {
            if leader {
                print_err(&format!("tpar bench step: timing {}", reduce.name()));
            }
        })?;
        if !leader {
            return Ok(());
        }
        let gpus = tpar_harness::cuda_ranks::device_count()?;
        let provenance = crate::provenance::provenance(group.device()?);
        let report = StepReport::new(&settings, mode, gpus, provenance, rows);
        Ok(emit(&step::step(&report), args.json.as_deref(), &report)?)
    })
}
