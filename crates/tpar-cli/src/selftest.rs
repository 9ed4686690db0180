//! `tpar selftest`: a correctness sweep. Every algorithm (the islands algorithms over several
//! island partitions, or `--islands`) x dtype x element count x placement (in place or not)
//! runs twice with different inputs and is compared bitwise with the exact expected sum (so
//! every rank holds the same bits), after peer-timeout cases (a silent rank must be named in
//! time, and the process must be able to communicate again) and, on the CPU, mismatch cases
//! for every algorithm. Prints a pass/fail table and ends non-zero on any failure.

use anyhow::{bail, Result};
use clap::Args;
use tpar_harness::cpu_selftest::{self, CpuSelftestSettings};

use crate::args::{parse_dtypes, parse_list};
use crate::args::{BackendArg, Timed};
use crate::ranks::{run_ranks, PartialRows, Rank};
use tpar_harness::backend_choice::Backend;
use tpar_harness::limits::CpuJobNeeds;
use tpar_report::{print_err, print_out, ranks, selftest};

/// Replays of the CUDA selftest's graph where --replays is not given.
const DEFAULT_REPLAYS: usize = 1000;

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct SelftestArgs {
    /// Where to run: auto picks CUDA when a usable GPU exists, else the CPU (and says why).
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendArg,
    /// Ranks to start on this host, 1 to 16 (default: one per GPU on CUDA; on the CPU backend
    /// the number of cores, 2 to 8).
    #[arg(long, short = 'n', value_parser = crate::args::world_size_arg)]
    world_size: Option<usize>,
    /// Element counts to test, comma-separated (odd ones on purpose).
    #[arg(
        long,
        default_value = "0,1,7,1023,65541,1048579",
        allow_hyphen_values = true
    )]
    counts: String,
    /// Element types, comma-separated.
    #[arg(
        long,
        alias = "dtype",
        default_value = "f32,f16,bf16",
        allow_hyphen_values = true
    )]
    dtypes: String,
    #[arg(long, value_name = "LIST", allow_hyphen_values = true, help = concat!(
        "Algorithms to check, comma-separated, from tpar's own: ", tpar_harness::algorithm_names!(),
        " (nccl and auto are timed by `tpar bench`) [default: all the backend has]"
    ))]
    algos: Option<String>,
    #[arg(long, value_name = "PARTITION", help = crate::args::ISLANDS_HELP)]
    islands: Option<String>,
    /// CUDA: one process per rank (CUDA IPC) instead of one process driving every rank.
    #[arg(long)]
    processes: bool,
    /// CUDA: replays of the graph that gets new inputs before every replay [default: 1000].
    #[arg(long, value_parser = crate::args::iterations_arg)]
    replays: Option<usize>,
    /// Seconds a rank waits for a peer in the sweep.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = crate::args::timeout_arg)]
    timeout: std::time::Duration,
    /// Skip the fault cases (CPU: a silent peer and a mismatched call per algorithm; CUDA: a
    /// silent peer); they cost about a second.
    #[arg(long)]
    no_timeout_case: bool,
}

struct SelftestSettings {
    note: Option<String>,
    sweep: CpuSelftestSettings,
}

pub fn run(args: SelftestArgs) -> Result<std::process::ExitCode> {
    let setup = crate::args::setup(args.backend, args.world_size, args.algos.as_deref())?;
    let algorithms = setup
        .tpar_algorithms("tpar selftest")
        .map_err(crate::args::setup_error)?;
    let counts = parse_list(&args.counts, "counts", |s| {
        crate::args::whole_in(s, 0, 1 << 40)
            .map(|c| c as usize)
            .map_err(anyhow::Error::msg)
    })?;
    let dtypes = parse_dtypes(&args.dtypes)?;
    let timeout = args.timeout;
    setup
        .check_processes(args.processes)
        .and_then(|()| setup.check_cuda_only("--replays", args.replays.is_some()))
        .map_err(crate::args::setup_error)?;
    let (backend, world_size) = (setup.backend, setup.world_size);
    let islands = crate::args::parse_islands(args.islands.as_deref(), world_size)?;
    if backend == Backend::Cpu {
        crate::args::check_cpu_job(
            CpuJobNeeds::selftest(world_size, &counts, &dtypes),
            Timed::No,
        )?;
    }
    if backend == Backend::Cuda {
        crate::args::print_note_once(setup.note.as_deref());
        return crate::cuda_commands::selftest(
            args.processes,
            world_size,
            tpar_harness::cuda_selftest::CudaSelftestSettings {
                counts,
                dtypes,
                algorithms,
                timeout,
                timeout_case: !args.no_timeout_case && world_size > 1,
                replays: args.replays.unwrap_or(DEFAULT_REPLAYS),
                islands,
            },
        );
    }
    let settings = SelftestSettings {
        note: setup.note,
        sweep: CpuSelftestSettings {
            counts,
            dtypes,
            algorithms,
            timeout,
            timeout_case: !args.no_timeout_case && world_size > 1,
            islands,
        },
    };
    run_ranks(world_size, timeout, PartialRows::Stdout, |rank| {
        selftest_rank(rank, &settings)
    })
}

fn selftest_rank(rank: Rank, settings: &SelftestSettings) -> Result<()> {
    let leader = rank.is_leader();
    if let Some(note) = settings.note.as_ref().filter(|_| leader) {
        print_err(note);
    }
    let rows = cpu_selftest::run(&rank, &settings.sweep, |rows| {
        if leader {
            rank.save_partial(&format!(
                "tpar selftest (partial): cpu backend, {}\n{}",
                ranks(rank.world_size()),
                selftest::table(rows, false)
            ));
        }
    })?;
    if leader {
        print_out(&format!(
            "tpar selftest: cpu backend, {}; each row is two calls checked bitwise against the exact sum\n{}\n{}",
            ranks(rank.world_size()),
            selftest::table(&rows, false),
            selftest::summary(&rows)
        ))?;
    }
    match selftest::failed(&rows) {
        0 => Ok(()),
        failed => bail!("{failed} of {} selftest rows failed", rows.len()),
    }
}
