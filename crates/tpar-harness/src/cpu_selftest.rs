//! The CPU backend's self-test on one rank of a job: every algorithm (the islands algorithms
//! over several island partitions) x dtype x element count x placement (in place or not) runs
//! twice with different inputs and is compared bitwise with the exact sum; before that, for
//! every algorithm, a peer-timeout case (a silent rank must be named by every other rank within
//! the deadline) and a mismatch case (a rank passing another count must make every rank fail,
//! naming both calls). Every rank runs it together; each row is tallied across ranks.

use std::time::{Duration, Instant};

use super::known::{total_across_ranks, KnownData};
use super::ranks::Rank;
use super::selftest_row::SelftestRow;
use super::Result;
use tpar::{Algorithm, Config, CpuCommunicator, DType, Error, Islands};

/// What the sweep covers.
pub struct CpuSelftestSettings {
    pub counts: Vec<usize>,
    pub dtypes: Vec<DType>,
    pub algorithms: Vec<Algorithm>,
    /// How long a rank waits for a peer in the sweep.
    pub timeout: Duration,
    /// Run the fault cases first: per algorithm a silent peer (they cost about a second
    /// together) and a mismatched call. They need two ranks or more.
    pub timeout_case: bool,
    /// The island partition of the islands algorithms; `None`: several (see
    /// [`island_partitions`]).
    pub islands: Option<Islands>,
}

/// The deadline of the timeout cases: short, so the cases are cheap.
pub const CASE_DEADLINE: Duration = Duration::from_secs(1);

/// Chunk of the communicators of the timeout and mismatch cases (one per algorithm, open at
/// once): small, so that they fit beside the sweep's in a small /dev/shm.
const CASE_CHUNK_BYTES: usize = 4096;

/// Elements of the timeout and mismatch cases' calls.
const CASE_COUNT: usize = 1024;

/// The partitions the islands algorithms are checked over for `n` ranks: one island, halves
/// (`n/2+n/2`), one rank against the rest (`1+(n-1)`), three islands (`2+2+(n-4)`, or
/// `1+1+(n-2)` below 5 ranks) and interleaved islands (even and odd ranks), each once.
pub fn island_partitions(n: usize) -> Vec<Islands> {
    let mut texts = vec![n.to_string()];
    if n >= 2 {
        texts.push(format!("{}+{}", n / 2, n - n / 2));
        texts.push(format!("1+{}", n - 1));
    }
    if n >= 5 {
        texts.push(format!("2+2+{}", n - 4));
    } else if n >= 3 {
        texts.push(format!("1+1+{}", n - 2));
    }
    if n >= 4 {
        let list = |first: usize| {
            (first..n)
                .step_by(2)
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        texts.push(format!("{}:{}", list(0), list(1)));
    }
    let mut all: Vec<Islands> = Vec::new();
    for text in texts {
        let islands = Islands::parse(&text, n).expect("a partition of n ranks");
        if !all.contains(&islands) {
            all.push(islands);
        }
    }
    all
}

fn uses_islands(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::Islands | Algorithm::IslandsPull)
}

/// The partition the timeout and mismatch cases run the islands algorithms over: the one
/// given, else the first with more than one island.
fn case_islands(settings: &CpuSelftestSettings, n: usize) -> Option<Islands> {
    settings
        .islands
        .or_else(|| island_partitions(n).into_iter().find(|i| i.count() > 1))
}

/// The case cell of a row: the algorithm, and its islands where they matter.
fn case_name(algorithm: Algorithm, islands: Option<Islands>) -> String {
    match islands.filter(|_| uses_islands(algorithm)) {
        Some(islands) => format!("{algorithm} {islands}"),
        None => algorithm.name().to_owned(),
    }
}

/// Runs the sweep on this rank; `on_row` sees the rows so far after each one (rank 0 keeps
/// them where an interrupted job's launcher finds them). Returns every row.
pub fn run(
    rank: &Rank,
    settings: &CpuSelftestSettings,
    mut on_row: impl FnMut(&[SelftestRow]),
) -> Result<Vec<SelftestRow>> {
    let n = rank.world_size();
    let timeouts = if settings.timeout_case && n > 1 {
        timeout_cases(rank, settings)?
    } else {
        Vec::new()
    };
    let mismatches = if settings.timeout_case && n > 1 {
        mismatch_cases(rank, settings)?
    } else {
        Vec::new()
    };

    let config = |islands: Option<Islands>| Config {
        timeout: settings.timeout,
        islands,
        ..Config::default()
    };
    // A fresh communicator: the cases broke theirs. It tallies the cases, then runs the sweep
    // of every algorithm that does not use islands.
    let mut comm = CpuCommunicator::new(&rank.rendezvous, config(None))?;
    let mut rows = Vec::new();
    let silent = n - 1;
    for (algorithm, detail) in timeouts {
        let bad = total_across_ranks(&mut comm, u64::from(detail.is_err()))?;
        rows.push(SelftestRow {
            cells: vec![
                format!(
                    "peer timeout, {}",
                    case_name(algorithm, case_islands(settings, n))
                ),
                "-".into(),
                "-".into(),
                format!("rank {silent} silent"),
            ],
            bad,
            result: match (&detail, bad) {
                (Ok(took), 0) => format!("pass (failed in {took:.2?}, deadline {CASE_DEADLINE:?})"),
                (Err(e), _) => format!("FAIL: {e}"),
                (Ok(_), n) => format!("FAIL on {n} rank(s)"),
            },
        });
    }
    for (algorithm, detail) in mismatches {
        let bad = total_across_ranks(&mut comm, u64::from(detail.is_err()))?;
        rows.push(SelftestRow {
            cells: vec![
                format!(
                    "mismatch, {}",
                    case_name(algorithm, case_islands(settings, n))
                ),
                "f32".into(),
                format!("{CASE_COUNT} vs {}", CASE_COUNT + 1),
                format!("rank {silent} differs"),
            ],
            bad,
            result: match (&detail, bad) {
                (Ok(()), 0) => "pass (every rank named both calls)".into(),
                (Err(e), _) => format!("FAIL: {e}"),
                (Ok(()), n) => format!("FAIL on {n} rank(s)"),
            },
        });
    }
    on_row(&rows);

    let plain: Vec<Algorithm> = settings
        .algorithms
        .iter()
        .copied()
        .filter(|a| !uses_islands(*a))
        .collect();
    sweep(
        rank,
        settings,
        &mut comm,
        &plain,
        None,
        &mut rows,
        &mut on_row,
    )?;
    let with_islands: Vec<Algorithm> = settings
        .algorithms
        .iter()
        .copied()
        .filter(|a| uses_islands(*a))
        .collect();
    if !with_islands.is_empty() {
        let partitions = match settings.islands {
            Some(given) => vec![given],
            None => island_partitions(n),
        };
        for islands in partitions {
            let mut comm = CpuCommunicator::new(&rank.rendezvous, config(Some(islands)))?;
            sweep(
                rank,
                settings,
                &mut comm,
                &with_islands,
                Some(islands),
                &mut rows,
                &mut on_row,
            )?;
        }
    }
    Ok(rows)
}

/// Every dtype x algorithm x count x placement of `settings` on `comm`, two calls per row.
fn sweep(
    rank: &Rank,
    settings: &CpuSelftestSettings,
    comm: &mut CpuCommunicator,
    algorithms: &[Algorithm],
    islands: Option<Islands>,
    rows: &mut Vec<SelftestRow>,
    on_row: &mut impl FnMut(&[SelftestRow]),
) -> Result<()> {
    let max_count = settings.counts.iter().copied().max().unwrap_or(0);
    for &dtype in &settings.dtypes {
        let known = KnownData::new(dtype, rank.rank(), rank.world_size(), max_count, [21, 22]);
        for &algo in algorithms {
            for &count in &settings.counts {
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
                    let bad_ranks = total_across_ranks(comm, u64::from(wrong > 0))?;
                    rows.push(SelftestRow::tallied(
                        vec![
                            case_name(algo, islands),
                            dtype.name().into(),
                            count.to_string(),
                            if in_place { "in place" } else { "out of place" }.into(),
                        ],
                        bad_ranks,
                        String::new(),
                    ));
                    on_row(rows);
                }
            }
        }
    }
    Ok(())
}

/// The communicators of the cases, one per algorithm, created in the same order on every rank.
fn case_communicators(
    rank: &Rank,
    settings: &CpuSelftestSettings,
    timeout: Duration,
) -> Result<Vec<(Algorithm, CpuCommunicator)>> {
    let islands = case_islands(settings, rank.world_size());
    settings
        .algorithms
        .iter()
        .map(|&algorithm| {
            let config = Config {
                timeout,
                chunk_bytes: Some(CASE_CHUNK_BYTES),
                islands: islands.filter(|_| uses_islands(algorithm)),
                ..Config::default()
            };
            Ok((algorithm, CpuCommunicator::new(&rank.rendezvous, config)?))
        })
        .collect()
}

/// For every algorithm at once (one thread each, so the cases cost one deadline together):
/// the last rank skips a call; every other rank must fail with a timeout that names it,
/// within the deadline plus one second. Returns how long this rank took to fail, per
/// algorithm.
#[allow(clippy::type_complexity)]
fn timeout_cases(
    rank: &Rank,
    settings: &CpuSelftestSettings,
) -> Result<Vec<(Algorithm, std::result::Result<Duration, String>)>> {
    let comms = case_communicators(rank, settings, settings.timeout)?;
    let silent = rank.world_size() - 1;
    let me = rank.rank();
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|(algorithm, mut comm)| {
                scope.spawn(move || -> Result<_> {
                    let mut data = vec![1f32; CASE_COUNT];
                    comm.all_reduce_in_place(&mut data, algorithm)?;
                    if me == silent {
                        return Ok((algorithm, Ok(Duration::ZERO)));
                    }
                    comm.set_timeout(CASE_DEADLINE);
                    let start = Instant::now();
                    let result = comm.all_reduce_in_place(&mut data, algorithm);
                    let took = start.elapsed();
                    let limit = CASE_DEADLINE + Duration::from_secs(1);
                    Ok((
                        algorithm,
                        match result {
                            Err(Error::PeerTimeout { peer, .. })
                                if peer == silent && took <= limit =>
                            {
                                Ok(took)
                            }
                            Err(e) => Err(format!(
                                "expected a timeout naming rank {silent} within {limit:?}, got after {took:.2?}: {e}"
                            )),
                            Ok(()) => Err(format!(
                                "the call succeeded although rank {silent} never made it"
                            )),
                        },
                    ))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a timeout case panicked"))
            .collect::<Result<Vec<_>>>()
    })?;
    Ok(results)
}

/// For every algorithm in turn: the last rank passes one element more; every rank must fail
/// with a mismatch that names both counts.
fn mismatch_cases(
    rank: &Rank,
    settings: &CpuSelftestSettings,
) -> Result<Vec<(Algorithm, std::result::Result<(), String>)>> {
    let comms = case_communicators(rank, settings, settings.timeout)?;
    let odd_one = rank.world_size() - 1;
    let count = if rank.rank() == odd_one {
        CASE_COUNT + 1
    } else {
        CASE_COUNT
    };
    let mut results = Vec::new();
    for (algorithm, mut comm) in comms {
        let mut data = vec![1f32; count];
        let result = comm.all_reduce_in_place(&mut data, algorithm);
        let named = |text: &str| {
            text.contains(&format!("{CASE_COUNT} elements of f32"))
                && text.contains(&format!("{} elements of f32", CASE_COUNT + 1))
        };
        results.push((
            algorithm,
            match result {
                Err(e @ Error::CallMismatch { .. }) if named(&e.to_string()) => Ok(()),
                Err(e) => Err(format!("expected a mismatch naming both counts, got: {e}")),
                Ok(()) => Err(format!(
                    "the call succeeded although rank {odd_one} passed {} elements",
                    CASE_COUNT + 1
                )),
            },
        ));
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_cover_halves_uneven_and_three_islands_once_each() {
        let text = |n| {
            island_partitions(n)
                .iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(text(1), ["1"]);
        assert_eq!(text(2), ["2", "1+1"]);
        assert_eq!(text(3), ["3", "1+2", "1+1+1"]);
        assert_eq!(text(8), ["8", "4+4", "1+7", "2+2+4", "0,2,4,6:1,3,5,7"]);
        assert_eq!(text(5), ["5", "2+3", "1+4", "2+2+1", "0,2,4:1,3"]);
    }
}
