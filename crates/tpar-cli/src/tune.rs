//! `tpar tune`: measures tpar's algorithms and NCCL across message sizes on this machine (the
//! same CUDA-graph timing as `tpar bench`), writes the fastest choice per size as the tuning
//! table where the dispatcher looks for it (keyed by a fingerprint of the GPUs, driver and
//! topology, the world size and the dtype), and prints the crossovers. Then the fused allreduce +
//! residual + RMSNorm against allreduce + the separate norm kernel at 1-512 tokens of
//! `--hidden`, kept beside the table: a fused call then takes the path measured faster here.

use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use tpar::DType;
use tpar_harness::reports::TuneReport;
use tpar_harness::tune;

use crate::args::{parse_list, parse_size, sizes_with_counts};
use crate::ranks::on_cuda_ranks;
use tpar_harness::job::cuda_config;
use tpar_report::{emit, ranks};

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct TuneArgs {
    /// Ranks to tune for [default: one per GPU].
    #[arg(long, short = 'n', value_parser = crate::args::world_size_arg)]
    world_size: Option<usize>,
    /// Element type to tune for: f32, f16 or bf16 (the table is kept per dtype).
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    /// Sizes to measure; the table switches algorithms between them.
    #[arg(long, default_value = tpar_harness::sizes::TUNE_SIZES, allow_hyphen_values = true)]
    sizes: String,
    /// Timed graph replays per size and algorithm.
    #[arg(long, default_value_t = 50, value_parser = crate::args::iterations_arg)]
    iters: usize,
    /// Hidden size of the model whose fused allreduce + residual + RMSNorm is measured (1 to
    /// 512 tokens; the fused calls of this machine then take the path measured faster).
    #[arg(long, default_value_t = tpar_harness::tune::DEFAULT_HIDDEN, value_name = "N")]
    hidden: usize,
    /// One process per rank (CUDA IPC); NCCL with several ranks is only measured this way.
    #[arg(long)]
    processes: bool,
    /// Seconds a rank waits for a peer before it fails the run, naming the peer.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = crate::args::timeout_arg)]
    timeout: std::time::Duration,
    /// Also write the measurements and the table as JSON (`-`: stdout).
    #[arg(long, value_name = "PATH|-")]
    json: Option<String>,
}

pub fn run(args: TuneArgs) -> Result<ExitCode> {
    // Arguments first: a typo is reported as such, on any machine.
    let bytes = parse_list(&args.sizes, "sizes", parse_size)?;
    let sizes = sizes_with_counts(&bytes, args.dtype)?;
    crate::args::check_outputs(args.json.as_deref(), None)?;
    let (world_size, topology) = tune::machine(args.world_size)?;
    let timeout = args.timeout;
    let settings = tune::settings(sizes, args.dtype, args.iters);
    on_cuda_ranks(args.processes, world_size, timeout, |make, _mode| {
        let mut group = make(cuda_config(timeout))?;
        let mut progress = crate::progress::Progress::new(
            group.is_leader(),
            settings.sizes.len() * settings.choices.len(),
        );
        let tuned = tune::run(&mut group, &settings, &topology, |bytes, algo| {
            progress.step_at(bytes, algo)
        })?;
        progress.finish();
        let fused = tune::run_fused(
            &mut group,
            &topology,
            args.dtype,
            args.hidden,
            &tune::FUSED_TOKENS,
            args.iters,
            |_, _| {},
        )?;
        let Some(path) = tuned.written_to else {
            return Ok(());
        };
        let report = TuneReport {
            provenance: crate::provenance::provenance(group.device()?),
            table: tuned.table,
            written_to: path.display().to_string(),
            measurements: tuned.rows,
            fused: Some(fused),
        };
        let heading = format!("{}, {} on {topology}", ranks(world_size), args.dtype);
        let text = tpar_report::tune::tune(&report, &heading, &settings.sizes);
        Ok(emit(&text, args.json.as_deref(), &report)?)
    })
}
