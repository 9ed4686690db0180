//! The CPU backend with threads as ranks: every algorithm, dtype and placement against the
//! exact expected sum, chunking, tag wrap-around, mismatches, timeouts and memory accounting.
//! Cross-process behaviour (kills, launcher) is tested through the `tpar` binary.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::*;
use crate::check::{fill_expected, fill_input, first_mismatch};
use crate::rendezvous::{ensure_private_dir, random_token, RankEnv};

struct Job {
    dir: PathBuf,
    token: String,
}

impl Job {
    fn new() -> Job {
        let token = random_token().unwrap();
        let dir = std::env::temp_dir().join(format!("tpar-cpu-test-{token}"));
        ensure_private_dir(&dir).unwrap();
        Job { dir, token }
    }

    /// Runs `body` on `n` threads, each a rank with its own communicator.
    fn run<R: Send + 'static>(
        &self,
        n: usize,
        config: Config,
        body: impl Fn(CpuCommunicator) -> R + Send + Sync + Clone + 'static,
    ) -> Vec<R> {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let env = RankEnv {
                    rank,
                    world_size: n,
                    local_rank: rank,
                    local_world_size: n,
                    dir: self.dir.clone(),
                    token: self.token.clone(),
                };
                let body = body.clone();
                std::thread::spawn(move || {
                    let rdv = Rendezvous::join(env).unwrap();
                    body(CpuCommunicator::new(&rdv, config).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn leftover_segments(&self) -> usize {
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&segment_prefix(&self.token))
            })
            .count()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One call with known inputs; returns the first wrong element, if any.
fn checked_call(
    comm: &mut CpuCommunicator,
    dtype: DType,
    count: usize,
    algo: Algorithm,
    in_place: bool,
    seed: u64,
) -> Option<String> {
    let bytes = count * dtype.size();
    let mut input = vec![0u8; bytes];
    fill_input(dtype, seed, comm.rank(), &mut input);
    let mut output = vec![0xAAu8; bytes];
    if in_place {
        output.copy_from_slice(&input);
        comm.all_reduce_bytes(dtype, None, &mut output, algo)
            .unwrap();
    } else {
        comm.all_reduce_bytes(dtype, Some(&input), &mut output, algo)
            .unwrap();
    }
    let mut expected = vec![0u8; bytes];
    fill_expected(dtype, seed, comm.world_size(), &mut expected);
    first_mismatch(dtype, &output, &expected).map(|(i, g, e)| {
        format!("{dtype} {algo} n={count} in_place={in_place}: [{i}] = {g}, expected {e}")
    })
}

const SMALL_CHUNKS: Config = Config {
    timeout: Duration::from_secs(20),
    chunk_bytes: Some(256),
    host_staged: false,
    islands: None,
};

#[test]
fn every_algorithm_dtype_and_placement_gives_the_exact_sum() {
    let job = Job::new();
    // 256-byte chunks: 1023 elements span several chunks, 7 f16 elements end mid-line.
    let failures = job.run(3, SMALL_CHUNKS, |mut comm| {
        let mut failures = Vec::new();
        let mut seed = 0;
        for algo in CpuCommunicator::ALGORITHMS {
            for dtype in DType::ALL {
                for count in [0, 1, 7, 64, 65, 1023] {
                    for in_place in [false, true] {
                        seed += 1;
                        failures
                            .extend(checked_call(&mut comm, dtype, count, algo, in_place, seed));
                    }
                }
            }
        }
        failures
    });
    for f in &failures {
        assert!(f.is_empty(), "{f:?}");
    }
    assert_eq!(job.leftover_segments(), 0);
}

#[test]
fn results_are_bitwise_identical_across_ranks_and_algorithms() {
    let job = Job::new();
    let outputs = job.run(4, Config::default(), |mut comm| {
        let input: Vec<f32> = (0..999)
            .map(|i| (i as f32 * 0.37 + comm.rank() as f32).sin() * 1e3)
            .collect();
        let mut one = vec![0f32; input.len()];
        let mut two = vec![0f32; input.len()];
        comm.all_reduce(&input, &mut one, Algorithm::OneShot)
            .unwrap();
        comm.all_reduce(&input, &mut two, Algorithm::TwoShot)
            .unwrap();
        (one, two)
    });
    for (one, two) in &outputs {
        assert_eq!(
            one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            two.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(
            one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            outputs[0].0.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn tags_wrap_around_without_a_wrong_result() {
    let job = Job::new();
    let failures = job.run(2, SMALL_CHUNKS, |mut comm| {
        comm.set_epoch_for_test(u64::from(u32::MAX) - 7);
        let mut failures = Vec::new();
        for seed in 0..12 {
            let algo = CpuCommunicator::ALGORITHMS[seed as usize % 2];
            failures.extend(checked_call(&mut comm, DType::F32, 100, algo, false, seed));
        }
        assert!(
            comm.epoch > u64::from(u32::MAX) + 8,
            "the test must cross the wrap"
        );
        failures
    });
    assert!(failures.iter().all(Vec::is_empty), "{failures:?}");
}

#[test]
fn a_size_mismatch_fails_on_every_rank_naming_both_sizes() {
    let job = Job::new();
    let errors = job.run(3, SMALL_CHUNKS, |mut comm| {
        let n = if comm.rank() == 2 { 2048 } else { 1024 };
        let mut data = vec![1f32; n];
        let err = comm
            .all_reduce_in_place(&mut data, Algorithm::OneShot)
            .unwrap_err();
        let again = comm
            .all_reduce_in_place(&mut data, Algorithm::OneShot)
            .unwrap_err();
        (err.to_string(), matches!(again, Error::Poisoned(_)))
    });
    for (msg, poisoned) in errors {
        assert!(
            msg.contains("1024 elements of f32") && msg.contains("2048 elements of f32"),
            "{msg}"
        );
        assert!(poisoned);
    }
}

#[test]
fn a_dtype_or_algorithm_mismatch_fails_on_every_rank() {
    let job = Job::new();
    let errors = job.run(2, Config::default(), |mut comm| {
        let result = if comm.rank() == 0 {
            comm.all_reduce_in_place(&mut [1f32; 16], Algorithm::OneShot)
        } else {
            comm.all_reduce_in_place(&mut [half::bf16::ONE; 16], Algorithm::TwoShot)
        };
        result.unwrap_err().to_string()
    });
    for msg in errors {
        assert!(
            msg.contains("of f32 (one-shot") && msg.contains("of bf16 (two-shot"),
            "{msg}"
        );
    }
}

#[test]
fn a_rank_that_stops_calling_times_out_naming_it() {
    let job = Job::new();
    let config = Config {
        timeout: Duration::from_millis(500),
        ..Config::default()
    };
    let results = job.run(3, config, |mut comm| {
        let mut data = vec![1f32; 100];
        comm.all_reduce_in_place(&mut data, Algorithm::TwoShot)
            .unwrap();
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_secs(2)); // stops calling
            return None;
        }
        let start = Instant::now();
        let err = comm
            .all_reduce_in_place(&mut data, Algorithm::TwoShot)
            .unwrap_err();
        Some((err.to_string(), start.elapsed()))
    });
    for (msg, took) in results.into_iter().flatten() {
        assert!(msg.contains("rank 1") && msg.contains("timed out"), "{msg}");
        assert!(took < Duration::from_millis(1500), "{took:?}");
    }
}

#[test]
fn footprint_counts_the_inbox_and_peer_mappings() {
    let job = Job::new();
    let config = Config::default();
    let footprints = job.run(4, config, |comm| comm.memory_footprint());
    let inbox = InboxLayout::new(4, config.cpu_chunk_bytes()).total_bytes() as u64;
    for f in footprints {
        assert_eq!(f.shared_host_bytes, inbox);
        assert_eq!(f.peer_mapped_bytes, 3 * inbox);
        assert_eq!(f.allocated_bytes(), inbox);
    }
}

#[test]
fn mismatched_lengths_are_refused_before_any_communication() {
    let job = Job::new();
    let errors = job.run(1, Config::default(), |mut comm| {
        let err = comm
            .all_reduce(&[1f32; 4], &mut [0f32; 5], Algorithm::OneShot)
            .unwrap_err();
        // The refused call did not poison the communicator.
        let mut ok = [2f32; 3];
        comm.all_reduce_in_place(&mut ok, Algorithm::OneShot)
            .unwrap();
        (err.to_string(), ok)
    });
    assert!(
        errors[0].0.contains("4 elements but output has 5"),
        "{}",
        errors[0].0
    );
    assert_eq!(errors[0].1, [2.0; 3]);
}

#[test]
fn gpu_algorithms_are_refused_by_name() {
    let job = Job::new();
    let errors = job.run(1, Config::default(), |mut comm| {
        let err = comm
            .all_reduce_in_place(&mut [1f32; 4], Algorithm::HostStaged)
            .unwrap_err();
        err.to_string()
    });
    assert!(
        errors[0].contains("host-staged is a GPU algorithm"),
        "{}",
        errors[0]
    );
}

/// Runs `body(rank, env)` on `n` threads, each a rank of the job (the body creates its own
/// communicators, as an engine does).
fn each_rank<R: Send + 'static>(
    job: &Job,
    n: usize,
    body: impl Fn(usize, RankEnv) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let env = RankEnv {
                rank,
                world_size: n,
                local_rank: rank,
                local_world_size: n,
                dir: job.dir.clone(),
                token: job.token.clone(),
            };
            let body = body.clone();
            std::thread::spawn(move || body(rank, env))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// `count` f32 elements of rank `rank`'s known input, and the sum over `members`.
fn sum_case(seed: u64, rank: usize, members: usize, count: usize) -> (Vec<u8>, Vec<u8>) {
    let mut input = vec![0u8; count * 4];
    let mut expected = vec![0u8; count * 4];
    fill_input(DType::F32, seed, rank, &mut input);
    fill_expected(DType::F32, seed, members, &mut expected);
    (input, expected)
}

fn reduce_checked(comm: &mut CpuCommunicator, seed: u64, count: usize) -> Result<()> {
    let (input, expected) = sum_case(seed, comm.rank(), comm.world_size(), count);
    let mut out = vec![0u8; input.len()];
    comm.all_reduce_bytes(DType::F32, Some(&input), &mut out, Algorithm::OneShot)?;
    match first_mismatch(DType::F32, &out, &expected) {
        None => Ok(()),
        Some((i, got, want)) => Err(Error::InvalidArgument(format!(
            "element {i} was {got}, expected {want}"
        ))),
    }
}

#[test]
fn two_communicators_from_one_rank_environment_are_open_at_once() {
    // Finding 1 of issue 12: every communicator made its own `Rendezvous` from the same
    // environment (as the Python package does) and took generation 0 of the job, so the second
    // read the first one's records and opened unlinked or foreign segments.
    let job = Job::new();
    let results = each_rank(&job, 3, |_, env| -> Result<()> {
        let config = Config::default();
        let mut a = CpuCommunicator::new(&Rendezvous::join(env.clone())?, config)?;
        let mut b = CpuCommunicator::new(&Rendezvous::join(env.clone())?, config)?;
        // Interleaved calls on the two must each give their own sums.
        for seed in 0..20 {
            reduce_checked(&mut a, seed, 1000 + seed as usize)?;
            reduce_checked(&mut b, seed + 100, 3000)?;
        }
        // Closed in another order than created, then recreated over fresh `Rendezvous` values.
        drop(a);
        let mut c = CpuCommunicator::new(&Rendezvous::join(env.clone())?, config)?;
        reduce_checked(&mut c, 7, 4099)?;
        reduce_checked(&mut b, 8, 17)?;
        drop(b);
        drop(c);
        for cycle in 0..5 {
            let mut d = CpuCommunicator::new(&Rendezvous::join(env.clone())?, config)?;
            reduce_checked(&mut d, cycle, 64)?;
        }
        Ok(())
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
    assert_eq!(job.leftover_segments(), 0);
}

#[test]
fn a_communicator_is_recreated_after_an_error() {
    let job = Job::new();
    let results = each_rank(&job, 2, |rank, env| -> Result<String> {
        let config = Config {
            timeout: Duration::from_millis(300),
            ..Config::default()
        };
        let mut a = CpuCommunicator::new(&Rendezvous::join(env.clone())?, config)?;
        // Mismatched sizes poison the communicator on both ranks.
        let mut x = vec![1.0f32; if rank == 0 { 10 } else { 20 }];
        let err = a
            .all_reduce_in_place(&mut x, Algorithm::OneShot)
            .unwrap_err();
        let again = a.all_reduce_in_place(&mut [1.0f32], Algorithm::OneShot);
        assert!(matches!(again, Err(Error::Poisoned(_))), "{again:?}");
        drop(a);
        // "create a new one", as the error says: that must work.
        let mut b = CpuCommunicator::new(&Rendezvous::join(env)?, config)?;
        reduce_checked(&mut b, 3, 5000)?;
        Ok(err.to_string())
    });
    for r in results {
        let text = r.unwrap();
        assert!(text.contains("mismatched"), "{text}");
    }
    assert_eq!(job.leftover_segments(), 0);
}

#[test]
fn subgroups_of_one_job_reduce_among_their_members_only() {
    // A world of 4 with groups {0,1}, {2,3} and {0,1,2,3}, all open at once, interleaved.
    let job = Job::new();
    let results = each_rank(&job, 4, |rank, env| -> Result<()> {
        let config = Config::default();
        let world = Rendezvous::join(env)?;
        let pair: Vec<usize> = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
        let mut sub = CpuCommunicator::new(&world.subgroup(&pair)?, config)?;
        let mut all = CpuCommunicator::new(&world.subgroup(&[0, 1, 2, 3])?, config)?;
        assert_eq!((sub.rank(), sub.world_size()), (rank % 2, 2));
        assert_eq!((all.rank(), all.world_size()), (rank, 4));
        for seed in 0..10 {
            reduce_checked(&mut sub, seed, 999)?;
            reduce_checked(&mut all, seed, 2001)?;
        }
        // A second communicator of the same subgroup, then the first closes.
        let mut sub2 = CpuCommunicator::new(&world.subgroup(&pair)?, config)?;
        drop(sub);
        reduce_checked(&mut sub2, 11, 31)?;
        Ok(())
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
    assert_eq!(job.leftover_segments(), 0);
}

#[test]
fn subgroup_members_are_checked() {
    let job = Job::new();
    let world = Rendezvous::join(RankEnv {
        rank: 1,
        world_size: 4,
        local_rank: 1,
        local_world_size: 4,
        dir: job.dir.clone(),
        token: job.token.clone(),
    })
    .unwrap();
    for (members, says) in [
        (vec![], "at least one"),
        (vec![1, 1], "twice"),
        (vec![1, 4], "not a rank of this job"),
        (vec![0, 2], "does not include this rank"),
    ] {
        let err = world.subgroup(&members).unwrap_err().to_string();
        assert!(err.contains(says), "{members:?}: {err}");
    }
    let sub = world.subgroup(&[3, 1]).unwrap();
    assert_eq!(
        (sub.rank(), sub.world_size(), sub.members()),
        (1, 2, &[3, 1][..])
    );
}

/// Open file descriptors and threads of this process, from /proc.
fn fds_and_threads() -> (usize, usize) {
    let count = |dir: &str| std::fs::read_dir(dir).map_or(0, |d| d.count());
    (count("/proc/self/fd"), count("/proc/self/task"))
}

#[test]
fn a_thousand_create_use_close_cycles_leak_nothing() {
    // Finding 2 of issue 12: every cycle left one descriptor per shared-memory segment open.
    // World size 1 on this thread, so no other test's threads or files move the figures.
    let job = Job::new();
    let env = RankEnv {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        local_world_size: 1,
        dir: job.dir.clone(),
        token: job.token.clone(),
    };
    let config = Config {
        chunk_bytes: Some(4096),
        ..Config::default()
    };
    let mut at = Vec::new();
    for cycle in 1..=1000u64 {
        let mut comm = CpuCommunicator::new(&Rendezvous::join(env.clone()).unwrap(), config)
            .unwrap_or_else(|e| panic!("cycle {cycle}: {e}"));
        reduce_checked(&mut comm, cycle, 100).unwrap();
        if cycle % 2 == 0 {
            drop(comm); // dropped without anything else: must release the same as at the end
        }
        if cycle == 10 || cycle == 1000 {
            let (fds, _) = fds_and_threads();
            let records = std::fs::read_dir(&job.dir).unwrap().count();
            println!(
                "cycle {cycle}: {fds} fds, {} /dev/shm entries of this job, {records} rendezvous records",
                job.leftover_segments()
            );
            at.push((fds, job.leftover_segments(), records));
        }
    }
    // Other tests run on other threads and open files of their own: descriptors may move by
    // a few either way, never by one per cycle (990 cycles between the two readings).
    let (fds10, fds1000) = (at[0].0 as i64, at[1].0 as i64);
    assert!(
        (fds1000 - fds10).abs() < 50,
        "descriptors {fds10} at cycle 10, {fds1000} at cycle 1000"
    );
    assert_eq!((at[0].1, at[1].1), (0, 0), "segments left in /dev/shm");
    // Only the last barrier's record stays: earlier ones are retired by the next barrier.
    assert_eq!((at[0].2, at[1].2), (1, 1), "rendezvous records left");
}

#[test]
fn eight_groups_of_eight_ranks_cost_little_more_than_one() {
    // Deliver 5 of issue 12, the CPU part (the CUDA self-test cache is timed by gpu-check
    // engine-comm): creating 8 communicators of 8 ranks one after another.
    let job = Job::new();
    let times = each_rank(&job, 8, |_, env| -> Result<Vec<Duration>> {
        let rdv = Rendezvous::join(env)?;
        let mut times = Vec::new();
        let mut comms = Vec::new();
        for _ in 0..8 {
            let start = Instant::now();
            comms.push(CpuCommunicator::new(&rdv, Config::default())?);
            times.push(start.elapsed());
        }
        for (seed, comm) in comms.iter_mut().enumerate() {
            reduce_checked(comm, seed as u64, 100)?;
        }
        Ok(times)
    });
    let rank0 = times.into_iter().next().unwrap().unwrap();
    let extra: Duration = rank0[1..].iter().sum();
    println!(
        "8 ranks: first group {:?}, the other 7 together {extra:?}",
        rank0[0]
    );
    // Generous for a loaded CI machine of 2 cores running 8 rank threads; typically ~0.1 s.
    assert!(extra < Duration::from_secs(2), "{rank0:?}");
}
