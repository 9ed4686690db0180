//! The CPU backend's self-test on one rank of a job: every algorithm x dtype x element count x
//! placement (in place or not) runs twice with different inputs and is compared bitwise with
//! the exact sum, after a peer-timeout case that must fail in time and leave the process able
//! to communicate again. Every rank runs it together; each row is tallied across ranks.

use std::time::{Duration, Instant};

use super::known::{total_across_ranks, KnownData};
use super::ranks::Rank;
use super::selftest_row::SelftestRow;
use super::Result;
use tpar::{Algorithm, Config, CpuCommunicator, DType, Error};

/// What the sweep covers.
pub struct CpuSelftestSettings {
    pub counts: Vec<usize>,
    pub dtypes: Vec<DType>,
    pub algorithms: Vec<Algorithm>,
    /// How long a rank waits for a peer in the sweep.
    pub timeout: Duration,
    /// Run the peer-timeout case first (it costs about a second; needs two ranks or more).
    pub timeout_case: bool,
}

/// The deadline of the timeout case: short, so the case is cheap.
pub const CASE_DEADLINE: Duration = Duration::from_secs(1);

/// Runs the sweep on this rank; `on_row` sees the rows so far after each one (rank 0 keeps
/// them where an interrupted job's launcher finds them). Returns every row.
pub fn run(
    rank: &Rank,
    settings: &CpuSelftestSettings,
    mut on_row: impl FnMut(&[SelftestRow]),
) -> Result<Vec<SelftestRow>> {
    let timeout_case = settings
        .timeout_case
        .then(|| timeout_case(rank))
        .transpose()?;

    // A fresh communicator: the one the timeout case broke is gone.
    let config = Config {
        timeout: settings.timeout,
        ..Config::default()
    };
    let mut comm = CpuCommunicator::new(&rank.rendezvous, config)?;
    let mut rows = Vec::new();
    if let Some(detail) = timeout_case {
        let bad = total_across_ranks(&mut comm, u64::from(detail.is_err()))?;
        rows.push(SelftestRow {
            cells: vec![
                "peer timeout".into(),
                "-".into(),
                "-".into(),
                format!("rank {} silent", rank.world_size() - 1),
            ],
            bad,
            result: match (&detail, bad) {
                (Ok(took), 0) => format!("pass (failed in {took:.2?}, deadline {CASE_DEADLINE:?})"),
                (Err(e), _) => format!("FAIL: {e}"),
                (Ok(_), n) => format!("FAIL on {n} rank(s)"),
            },
        });
    }

    let max_count = settings.counts.iter().copied().max().unwrap_or(0);
    for &dtype in &settings.dtypes {
        let known = KnownData::new(dtype, rank.rank(), rank.world_size(), max_count, [21, 22]);
        for &algo in &settings.algorithms {
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
                    let bad_ranks = total_across_ranks(&mut comm, u64::from(wrong > 0))?;
                    rows.push(SelftestRow::tallied(
                        vec![
                            algo.name().into(),
                            dtype.name().into(),
                            count.to_string(),
                            if in_place { "in place" } else { "out of place" }.into(),
                        ],
                        bad_ranks,
                        String::new(),
                    ));
                    on_row(&rows);
                }
            }
        }
    }
    Ok(rows)
}

/// The last rank skips a call; every other rank must fail with a timeout that names it,
/// within the deadline plus one second. Returns how long this rank took to fail.
fn timeout_case(rank: &Rank) -> Result<std::result::Result<Duration, String>> {
    let config = Config {
        timeout: CASE_DEADLINE,
        ..Config::default()
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
