//! `tpar bench`: times every algorithm over a sweep of message sizes, verifies every timed
//! call against the exact expected sum, and prints a table (and JSON) of p50/p99 latency and
//! bus bandwidth as nccl-tests defines it.

use anyhow::{bail, Result};
use clap::Args;
use tpar::{Algorithm, DType};
use tpar_harness::cpu_bench::{self, CpuBenchSettings};
use tpar_harness::cuda_bench;
use tpar_harness::limits::CpuJobNeeds;

use crate::args::{check_outputs, parse_list, parse_size, sizes_with_counts};
use crate::args::{BackendArg, Timed, Usage};
use crate::progress::Progress;
use crate::ranks::{run_ranks, PartialRows, Rank};
use tpar_harness::backend_choice::Backend;
use tpar_harness::runs::cpu_bench_rank;
use tpar_report::plot::plot_latency;
use tpar_report::{bench, emit_to, ranks};

/// Allreduces per rank in a timed CUDA graph where --chain is not given.
const DEFAULT_CHAIN: usize = 50;

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, allow_negative_numbers = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: Option<BenchCommand>,
    /// Where to run: auto picks CUDA when a usable GPU exists, else the CPU (and says why).
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendArg,
    /// Ranks to start on this host, 1 to 16 (default: one per GPU on CUDA; on the CPU backend
    /// the number of cores, 2 to 8). Under an outside launcher (TPAR_RENDEZVOUS, RANK,
    /// WORLD_SIZE set) the environment decides, and a -n that disagrees is refused.
    #[arg(long, short = 'n', value_parser = crate::args::world_size_arg)]
    world_size: Option<usize>,
    /// Message sizes in bytes, comma-separated; K, M, G are powers of 1024
    /// [default: cpu 1K..4M, cuda 4K..8M including 42K].
    #[arg(long, allow_hyphen_values = true)]
    sizes: Option<String>,
    #[arg(long, value_name = "LIST", allow_hyphen_values = true, help = concat!(
        "Algorithms to time, comma-separated, from: ", tpar_harness::selection_names!(),
        " (CPU: all but host-staged, nccl and auto) [default: all the backend has]. auto decides \
        as an engine's communicator would on this machine: from a `tpar tune` table, else from the \
        first-use measurement (made here, under 200 ms, and cached, where no table exists; \
        TPAR_FIRST_USE=0 leaves the fabric model alone); the output says why at each size"
    ))]
    algos: Option<String>,
    #[arg(long, value_name = "PARTITION", help = crate::args::ISLANDS_HELP)]
    islands: Option<String>,
    /// Timed calls per size and algorithm (CUDA: timed graph replays).
    #[arg(long, default_value_t = 100, value_parser = crate::args::iterations_arg)]
    iters: usize,
    /// CUDA: allreduces per rank in the timed graph; the figure is the replay time over this
    /// [default: 50].
    #[arg(long, value_parser = crate::args::iterations_arg)]
    chain: Option<usize>,
    /// CUDA: one process per rank (CUDA IPC) instead of one process driving every rank.
    #[arg(long)]
    processes: bool,
    /// Untimed calls before timing (default: a tenth of --iters, at least 5).
    #[arg(long, value_parser = crate::args::warmup_arg)]
    warmup: Option<usize>,
    /// Element type: f32, f16 or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    /// Seconds a rank waits for a peer before it fails the run, naming the peer.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = crate::args::timeout_arg)]
    timeout: std::time::Duration,
    /// Write results as JSON to PATH; `-` writes JSON to stdout and the table to stderr.
    #[arg(long, value_name = "PATH|-")]
    json: Option<String>,
    /// CUDA: time the pieces of one call (a ladder of kernels, with and without PDL) for
    /// -n ranks as streams on GPU 0 (2 and 8 when -n is not given); see bench/README.md.
    #[arg(long, conflicts_with_all = ["sizes", "algos", "chain", "processes", "warmup", "dtype", "timeout", "plot", "fused"])]
    anatomy: bool,
    /// CUDA: the fused allreduce + residual add + RMSNorm against the allreduce and against
    /// the allreduce followed by the separate norm kernel (bf16, hidden 8192, 1 and 8 tokens;
    /// -n ranks as streams on GPU 0, 2 and 8 when -n is not given). The allreduce is one-shot
    /// unless --algos names another of tpar's algorithms (one at a time).
    #[arg(long, conflicts_with_all = ["sizes", "processes", "warmup", "dtype", "timeout", "plot"])]
    fused: bool,
    /// With --fused: the token counts of the cases, comma-separated, 1 to 512 [default: 1,8].
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    tokens: Option<String>,
    /// Draw p50 latency against size, one line per algorithm, as SVG (`-`: to stdout, and the
    /// table to stderr).
    #[arg(long, value_name = "FILE.svg|-")]
    plot: Option<String>,
}

#[derive(clap::Subcommand, Debug)]
enum BenchCommand {
    /// Time one tensor-parallel forward pass (GEMMs and allreduces of a model's shapes) with
    /// NCCL and with tpar, and the share of it spent in communication.
    Step(crate::step::StepArgs),
}

/// The algorithm and token counts of `bench --fused`, from `--algos` (one algorithm with a
/// fused kernel; default one-shot) and `--tokens`; usage errors otherwise.
fn fused_request(algos: Option<&str>, tokens: Option<&str>) -> Result<(Algorithm, Vec<usize>)> {
    use tpar_harness::fused_bench::{fused_algorithms, DEFAULT_TOKENS, MAX_TOKENS};
    let fused = fused_algorithms();
    let names = || {
        fused
            .iter()
            .map(|a| a.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let algorithm = match algos {
        None => Algorithm::OneShot,
        Some(text) => {
            let list = parse_list(text, "algos", |s| Ok(s.parse::<Algorithm>()?))?;
            match list[..] {
                [a] if fused.contains(&a) => a,
                [a] => bail!(Usage(format!(
                    "--fused: {a} has no fused kernel; give --algos one of {}",
                    names()
                ))),
                _ => bail!(Usage(format!(
                    "--fused times one algorithm at a time; give --algos one of {}",
                    names()
                ))),
            }
        }
    };
    let tokens = match tokens {
        None => DEFAULT_TOKENS.to_vec(),
        Some(text) => parse_list(text, "tokens", |s| {
            let n = crate::args::whole_in(s, 1, MAX_TOKENS as u64).map_err(anyhow::Error::msg)?;
            Ok(n as usize)
        })?,
    };
    Ok((algorithm, tokens))
}

struct BenchSettings {
    note: Option<String>,
    sweep: CpuBenchSettings,
    json: Option<String>,
    plot: Option<String>,
}

pub fn run(args: BenchArgs) -> Result<std::process::ExitCode> {
    if let Some(BenchCommand::Step(step)) = args.command {
        return crate::step::run(step);
    }
    if args.tokens.is_some() && !args.fused {
        return Err(crate::args::usage(anyhow::anyhow!(
            "--tokens is for --fused; leave it out or add --fused"
        )));
    }
    if args.fused || args.anatomy {
        let what = if args.fused { "--fused" } else { "--anatomy" };
        if args.backend == BackendArg::Cpu {
            bail!(Usage(format!(
                "{what} times CUDA kernels and has no CPU form; leave out --backend cpu (it needs an NVIDIA GPU)"
            )));
        }
        check_outputs(args.json.as_deref(), None)?;
    }
    if args.fused {
        let (algorithm, tokens) = fused_request(args.algos.as_deref(), args.tokens.as_deref())?;
        crate::cuda_commands::fused(
            args.world_size,
            algorithm,
            &tokens,
            args.iters,
            args.chain.unwrap_or(DEFAULT_CHAIN),
            args.json.as_deref(),
        )?;
        return Ok(std::process::ExitCode::SUCCESS);
    }
    if args.anatomy {
        crate::cuda_commands::anatomy(args.world_size, args.iters, args.json.as_deref())?;
        return Ok(std::process::ExitCode::SUCCESS);
    }
    // Everything is checked before any rank starts.
    let setup = crate::args::setup(args.backend, args.world_size, args.algos.as_deref())?;
    let (backend, world_size) = (setup.backend, setup.world_size);
    let dtype = args.dtype;
    let default_sizes = tpar_harness::sizes::bench_sizes(backend);
    let bytes = parse_list(
        args.sizes.as_deref().unwrap_or(default_sizes),
        "sizes",
        parse_size,
    )?;
    let sizes = sizes_with_counts(&bytes, dtype)?;
    let islands = crate::args::parse_islands(args.islands.as_deref(), world_size)?;
    let timeout = args.timeout;
    check_outputs(args.json.as_deref(), args.plot.as_deref())?;
    if args.plot.is_some() && bytes.iter().all(|&b| b == 0) {
        bail!(Usage(
            "--plot draws sizes above 0 bytes on a log scale, and --sizes has none; add one".into()
        ));
    }
    if backend == Backend::Cuda {
        crate::args::print_note_once(setup.note.as_deref());
        return crate::cuda_commands::bench(
            args.processes,
            world_size,
            cuda_bench::CudaBenchSettings {
                sizes,
                choices: setup.choices,
                dtype,
                replays: args.iters,
                warmup: args.warmup.unwrap_or(cuda_bench::DEFAULT_WARMUP),
                chain: args.chain.unwrap_or(DEFAULT_CHAIN),
                islands,
            },
            timeout,
            args.json,
            args.plot,
        );
    }
    setup
        .check_processes(args.processes)
        .and_then(|()| setup.check_cuda_only("--chain", args.chain.is_some()))
        .map_err(crate::args::setup_error)?;
    crate::args::check_cpu_job(CpuJobNeeds::bench(world_size, &sizes), Timed::Yes)?;
    let settings = BenchSettings {
        note: setup.note.clone(),
        sweep: CpuBenchSettings {
            sizes,
            algorithms: setup
                .tpar_algorithms("the CPU bench")
                .map_err(crate::args::setup_error)?,
            iters: args.iters,
            warmup: args.warmup.unwrap_or(cpu_bench::default_warmup(args.iters)),
            dtype,
            timeout,
            islands,
        },
        json: args.json,
        plot: args.plot,
    };
    let partial_rows = PartialRows::beside(settings.json.as_deref(), settings.plot.as_deref());
    run_ranks(world_size, timeout, partial_rows, |rank| {
        bench_rank(rank, &settings)
    })
}

fn bench_rank(rank: Rank, settings: &BenchSettings) -> Result<()> {
    let leader = rank.is_leader();
    let world_size = rank.world_size();
    if let Some(note) = settings.note.as_ref().filter(|_| leader) {
        tpar_report::print_err(note);
    }
    let configs = settings.sweep.sizes.len() * settings.sweep.algorithms.len();
    let mut progress = Progress::new(leader, configs);
    let report = cpu_bench_rank(
        &rank,
        &settings.sweep,
        crate::provenance::COMMIT,
        |bytes, algo| progress.step_at(bytes, algo),
        |rows| {
            if leader {
                rank.save_partial(&format!(
                    "tpar bench (partial): cpu backend, {}, {}\n{}",
                    ranks(world_size),
                    settings.sweep.dtype,
                    bench::cpu_table(rows)
                ));
            }
        },
    )?;
    progress.finish();
    let Some(report) = report else {
        return Ok(());
    };
    let plot_on_stdout = settings.plot.as_deref() == Some("-");
    emit_to(
        &bench::cpu_bench(&report),
        settings.json.as_deref(),
        plot_on_stdout,
        &report,
    )?;
    let title = || {
        format!(
            "tpar bench: cpu, {}, {}",
            ranks(world_size),
            settings.sweep.dtype
        )
    };
    plot_latency(settings.plot.as_deref(), title, report.results.iter())?;
    let wrong = report.results.iter().filter(|r| !r.correct).count();
    if wrong > 0 {
        bail!(
            "{wrong} of {} configurations gave wrong results (see the table)",
            report.results.len()
        );
    }
    Ok(())
}
