//! `tpar selftest`: a correctness sweep. Every algorithm x dtype x element count x placement
//! (in place or not) runs twice with different inputs and is compared bitwise with the exact
//! expected sum (so every rank holds the same bits), after a peer-timeout case that must fail
//! in time and leave the process able to communicate again. Prints a pass/fail table and ends
//! non-zero on any failure.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use tpar::{Algorithm, CommConfig, CpuCommunicator, DType, Error};

use crate::args::{parse_dtypes, parse_list};
use crate::backend_choice::{Backend, BackendArg, Setup};
use crate::ranks::{run_ranks, Rank};
use crate::report::Table;
use tpar::harness::known::{total_across_ranks, KnownData};

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct SelftestArgs {
    /// Where to run: auto picks CUDA when a usable GPU exists, else the CPU (and says why).
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendArg,
    /// Ranks to start on this host (default: the number of cores, 2 to 8).
    #[arg(long, short = 'n', value_parser = crate::args::world_size_arg)]
    world_size: Option<usize>,
    /// Element counts to test, comma-separated (odd ones on purpose).
    #[arg(long, default_value = "0,1,7,1023,65541,1048579")]
    counts: String,
    /// Element types, comma-separated.
    #[arg(long, alias = "dtype", default_value = "f32,f16,bf16")]
    dtypes: String,
    #[arg(long, value_name = "LIST", help = concat!(
        "Algorithms to check, comma-separated, from: ", tpar::route_names!(),
        " (tpar's own only: nccl and auto are compared by `tpar bench`) [default: all the backend has]"
    ))]
    algos: Option<String>,
    /// CUDA: one process per rank (CUDA IPC) instead of one process driving every rank.
    #[arg(long)]
    processes: bool,
    /// CUDA: replays of the graph that gets new inputs before every replay.
    #[arg(long, default_value_t = 1000, value_parser = crate::args::iterations_arg)]
    replays: usize,
    /// Seconds a rank waits for a peer in the sweep.
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = crate::args::timeout_arg)]
    timeout: std::time::Duration,
    /// Skip the peer-timeout case (it costs about a second).
    #[arg(long)]
    no_timeout_case: bool,
}

struct Plan {
    note: Option<String>,
    counts: Vec<usize>,
    dtypes: Vec<DType>,
    algorithms: Vec<Algorithm>,
    timeout: Duration,
    timeout_case: bool,
}

/// The deadline of the timeout case: short, so the case is cheap.
const CASE_DEADLINE: Duration = Duration::from_secs(1);

pub fn run(args: SelftestArgs) -> Result<std::process::ExitCode> {
    let setup = Setup::resolve(args.backend, args.world_size, args.algos.as_deref())?;
    let algorithms = setup.tpar_algorithms("tpar selftest")?;
    let Setup {
        backend,
        note,
        world_size,
        ..
    } = setup;
    let counts = parse_list(&args.counts, "counts", |s| {
        crate::args::whole_in(s, 0, 1 << 40)
            .map(|c| c as usize)
            .map_err(anyhow::Error::msg)
    })?;
    let dtypes = parse_dtypes(&args.dtypes)?;
    let timeout = args.timeout;
    if backend == Backend::Cpu && args.processes {
        anyhow::bail!(crate::args::Usage(
            "--processes is for the CUDA backend (the CPU backend always runs one process per rank); leave it out or use --backend cuda".into()
        ));
    }
    if backend == Backend::Cpu {
        let widest = dtypes.iter().map(|d| d.size() as u64).max().unwrap_or(4);
        let max_bytes = counts
            .iter()
            .max()
            .map_or(0, |&c| (c as u64).saturating_mul(widest));
        crate::limits::check_cpu_job(crate::limits::CpuJobNeeds::cpu(world_size, max_bytes, 5))?;
    }
    if backend == Backend::Cuda {
        return crate::cuda_commands::selftest(
            args.processes,
            world_size,
            tpar::harness::cuda_selftest::CudaPlan {
                counts,
                dtypes,
                algorithms,
                timeout,
                timeout_case: !args.no_timeout_case && world_size > 1,
                replays: args.replays,
            },
        );
    }
    let plan = Plan {
        note,
        counts,
        dtypes,
        algorithms,
        timeout,
        timeout_case: !args.no_timeout_case && world_size > 1,
    };
    run_ranks(world_size, plan.timeout, |rank| selftest_rank(rank, &plan))
}

fn selftest_rank(rank: Rank, plan: &Plan) -> Result<()> {
    let leader = rank.is_leader();
    if leader {
        if let Some(note) = &plan.note {
            eprintln!("{note}");
        }
    }
    let timeout_case = plan.timeout_case.then(|| timeout_case(&rank)).transpose()?;

    // A fresh communicator: the one the timeout case broke is gone.
    let config = CommConfig {
        timeout: plan.timeout,
        ..CommConfig::default()
    };
    let mut comm = CpuCommunicator::new(&rank.rendezvous, config)?;
    let mut table = Table::new(&["case", "dtype", "elements", "placement", "result"], 4);
    let mut failed = 0;
    let mut rows = 0;
    if let Some(detail) = timeout_case {
        let bad = total_across_ranks(&mut comm, u64::from(detail.is_err()))?;
        rows += 1;
        failed += usize::from(bad > 0);
        table.push(vec![
            "peer timeout".into(),
            "-".into(),
            "-".into(),
            format!("rank {} silent", rank.world_size() - 1),
            match (&detail, bad) {
                (Ok(took), 0) => format!("pass (failed in {took:.2?}, deadline {CASE_DEADLINE:?})"),
                (Err(e), _) => format!("FAIL: {e}"),
                (Ok(_), n) => format!("FAIL on {n} rank(s)"),
            },
        ]);
    }

    let max_count = plan.counts.iter().copied().max().unwrap_or(0);
    for &dtype in &plan.dtypes {
        let known = KnownData::new(dtype, rank.rank(), rank.world_size(), max_count, [21, 22]);
        for &algo in &plan.algorithms {
            for &count in &plan.counts {
                for in_place in [false, true] {
                    let mut wrong = 0u64;
                    let mut output = vec![0u8; count * dtype.size()];
                    for variant in 0..2 {
                        let input = known.input(variant, count);
                        if in_place {
                            output.copy_from_slice(input);
                            comm.all_reduce_bytes(dtype, None, &mut output, algo)?;
                        } else {
                            comm.all_reduce_bytes(dtype, Some(input), &mut output, algo)?;
                        }
                        wrong += u64::from(output != known.expected(variant, count));
                    }
                    let bad_ranks = total_across_ranks(&mut comm, u64::from(wrong > 0))?;
                    rows += 1;
                    failed += usize::from(bad_ranks > 0);
                    table.push(vec![
                        algo.name().into(),
                        dtype.name().into(),
                        count.to_string(),
                        if in_place { "in place" } else { "out of place" }.into(),
                        if bad_ranks == 0 {
                            "pass".into()
                        } else {
                            format!("FAIL on {bad_ranks} rank(s)")
                        },
                    ]);
                    if leader {
                        rank.save_partial(&format!(
                            "tpar selftest (partial): cpu backend, {}\n{}",
                            crate::report::ranks(rank.world_size()),
                            table.render()
                        ));
                    }
                }
            }
        }
    }
    if leader {
        println!(
            "tpar selftest: cpu backend, {}; each row is two calls checked bitwise against the exact sum\n{}",
            crate::report::ranks(rank.world_size()),
            table.render()
        );
        println!("selftest: {} passed, {failed} failed", rows - failed);
    }
    if failed > 0 {
        bail!("{failed} of {rows} selftest rows failed");
    }
    Ok(())
}

/// The last rank skips a call; every other rank must fail with a timeout that names it,
/// within the deadline plus one second. Returns how long this rank took to fail.
fn timeout_case(rank: &Rank) -> Result<std::result::Result<Duration, String>> {
    let config = CommConfig {
        timeout: CASE_DEADLINE,
        ..CommConfig::default()
    };
    let mut comm = CpuCommunicator::new(&rank.rendezvous, config)?;
    let mut data = vec![1f32; 1024];
    comm.all_reduce_in_place(&mut data, Algorithm::OneShot)?;
    let silent = rank.world_size() - 1;
    if rank.rank() == silent {
        return Ok(Ok(Duration::ZERO));
    }
    let start = Instant::now();
    let result = comm.all_reduce_in_place(&mut data, Algorithm::OneShot);
    let took = start.elapsed();
    Ok(match result {
        Err(Error::PeerTimeout { peer, .. })
            if peer == silent && took <= CASE_DEADLINE + Duration::from_secs(1) =>
        {
            Ok(took)
        }
        Err(e) => Err(format!(
            "expected a timeout naming rank {silent} within {:?}, got after {took:.2?}: {e}",
            CASE_DEADLINE + Duration::from_secs(1)
        )),
        Ok(()) => Err(format!(
            "the call succeeded although rank {silent} never made it"
        )),
    })
}
