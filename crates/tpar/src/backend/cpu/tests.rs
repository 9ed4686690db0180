//! The CPU backend with threads as ranks: every algorithm, dtype and placement against the
//! exact expected sum and against the bits its schedule defines, island partitions, chunking,
//! mismatches (also between algorithms), silent peers, timeouts and memory accounting.
//! Cross-process behaviour (kills, launcher) is tested through the `tpar` binary.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::*;
use crate::check::{fill_expected, fill_input, first_mismatch};
use crate::islands::{Islands, IslandsExchange};
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
                let env = RankEnv::on_one_host(rank, n, &self.dir, &self.token);
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
    let inbox = segment_bytes(4, &config) as u64;
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
            let env = RankEnv::on_one_host(rank, n, &job.dir, &job.token);
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
    let world = Rendezvous::join(RankEnv::on_one_host(1, 4, &job.dir, &job.token)).unwrap();
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
    let env = RankEnv::on_one_host(0, 1, &job.dir, &job.token);
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

/// What the schedule (`protocol::schedule`'s module doc) says every element of a call sums to,
/// computed element by element from its definition: rank order for one-shot, two-shot and the
/// staged forms; island partials in rank order, summed in island order for the islands forms;
/// `x_{c+1} + ... + x_{c+n-1} + x_c` for an element in ring chunk c. A call is cut into rounds
/// of `round_bytes`, each a message of the schedule.
fn schedule_result(
    algorithm: Algorithm,
    islands: &Islands,
    dtype: DType,
    inputs: &[Vec<u8>],
    round_bytes: usize,
) -> Vec<u8> {
    use crate::protocol::reduce::reduce_in_rank_order;
    use crate::protocol::schedule::{share, units_for_bytes, UNIT_BYTES};
    let n = inputs.len();
    let size = dtype.size();
    let len = inputs[0].len();
    let mut out = vec![0u8; len];
    let mut start = 0;
    while start < len {
        let round = round_bytes.min(len - start);
        let units = units_for_bytes(round);
        for e in 0..round / size {
            let i = start / size + e;
            let value = |r: usize| dtype.load_f32(&inputs[r], i);
            let total = match algorithm {
                Algorithm::Islands | Algorithm::IslandsPull => reduce_in_rank_order(
                    (0..islands.count())
                        .map(|island| reduce_in_rank_order(islands.members(island).map(value))),
                ),
                Algorithm::Ring => {
                    let unit = e * size / UNIT_BYTES;
                    let c = (0..n)
                        .find(|&c| share(units, n, c).contains(&unit))
                        .unwrap();
                    reduce_in_rank_order((1..=n).map(|k| value((c + k) % n)))
                }
                _ => reduce_in_rank_order((0..n).map(value)),
            };
            dtype.store_f32(&mut out, i, total);
        }
        start += round;
    }
    out
}

/// Inputs whose sums depend on the order of the additions: values over many binary orders of
/// magnitude, of both signs.
fn order_sensitive_input(dtype: DType, rank: usize, seed: u64, count: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; count * dtype.size()];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (rank as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d);
    for i in 0..count {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mantissa = (x % 1000) as f32 / 1000.0 + 1.0;
        let exponent = ((x >> 20) % 24) as i32 - 12;
        let sign = if (x >> 40) & 1 == 1 { -1.0 } else { 1.0 };
        dtype.store_f32(&mut bytes, i, sign * mantissa * 2f32.powi(exponent));
    }
    bytes
}

/// The island partitions a test covers for `n` ranks: one island, halves, 1 + (n-1), three
/// islands, and interleaved islands (not contiguous in rank order).
fn partitions(n: usize) -> Vec<Islands> {
    let mut texts = vec![n.to_string()];
    if n >= 2 {
        texts.push(format!("{}+{}", n / 2, n - n / 2));
        texts.push(format!("1+{}", n - 1));
    }
    if n >= 3 {
        texts.push(format!("1+1+{}", n - 2));
    }
    if n >= 5 {
        texts.push(format!("2+2+{}", n - 4));
    }
    if n >= 4 {
        let even: Vec<String> = (0..n).step_by(2).map(|r| r.to_string()).collect();
        let odd: Vec<String> = (1..n).step_by(2).map(|r| r.to_string()).collect();
        texts.push(format!("{}:{}", even.join(","), odd.join(",")));
    }
    let mut all: Vec<Islands> = Vec::new();
    for t in texts {
        let islands = Islands::parse(&t, n).unwrap();
        if !all.contains(&islands) {
            all.push(islands);
        }
    }
    all
}

#[test]
fn every_algorithm_gives_the_bits_its_schedule_defines_on_every_rank() {
    // Small chunks so that calls span several rounds; counts that end mid-unit.
    let chunk = 256;
    for n in [2, 3, 5] {
        let mut differing = 0;
        for islands in partitions(n) {
            let job = Job::new();
            let config = Config {
                islands: Some(islands),
                chunk_bytes: Some(chunk),
                ..SMALL_CHUNKS
            };
            let results = job.run(n, config, move |mut comm| {
                let mut failures = Vec::new();
                let mut differs_from_rank_order = 0;
                // Islands twice: the exchange in its ranges form, then in its all-units form.
                let forms = CpuCommunicator::ALGORITHMS
                    .into_iter()
                    .map(|a| (a, 0))
                    .chain([(Algorithm::Islands, usize::MAX)]);
                for (algo, all_units_up_to) in forms {
                    comm.set_islands_exchange(IslandsExchange::all_units_up_to(all_units_up_to));
                    let islands_algo = matches!(algo, Algorithm::Islands | Algorithm::IslandsPull);
                    // The island partition only matters to the islands algorithms.
                    if !islands_algo && islands.count() > 1 {
                        continue;
                    }
                    for dtype in DType::ALL {
                        for (seed, count) in [(1u64, 1usize), (2, 13), (3, 301), (4, 1000)] {
                            let inputs: Vec<Vec<u8>> = (0..n)
                                .map(|r| order_sensitive_input(dtype, r, seed, count))
                                .collect();
                            let round = comm.layout.round_bytes(algo, dtype);
                            let want = schedule_result(algo, &islands, dtype, &inputs, round);
                            let rank_order = schedule_result(
                                Algorithm::OneShot,
                                &islands,
                                dtype,
                                &inputs,
                                round,
                            );
                            differs_from_rank_order += usize::from(want != rank_order);
                            for in_place in [false, true] {
                                let mine = &inputs[comm.rank()];
                                let mut out = vec![0xAAu8; mine.len()];
                                if in_place {
                                    out.copy_from_slice(mine);
                                    comm.all_reduce_bytes(dtype, None, &mut out, algo).unwrap();
                                } else {
                                    comm.all_reduce_bytes(dtype, Some(mine), &mut out, algo)
                                        .unwrap();
                                }
                                if let Some((i, got, expected)) = first_mismatch(dtype, &out, &want)
                                {
                                    failures.push(format!(
                                        "n {n} islands {islands} {algo} (all units up to {all_units_up_to} B) {dtype} count {count} in_place {in_place}: [{i}] = {got}, the schedule says {expected}"
                                    ));
                                }
                            }
                        }
                    }
                }
                (failures, differs_from_rank_order)
            });
            for (failures, _) in &results {
                assert!(failures.is_empty(), "{failures:#?}");
            }
            differing += results[0].1;
            assert_eq!(job.leftover_segments(), 0);
        }
        // The inputs do tell the orders apart (else this test could not fail). Two ranks have
        // one addition per element, which every order gives the same bits.
        if n > 2 {
            assert!(differing > 0, "n {n}");
        }
    }
}

#[test]
fn ranks_that_disagree_on_the_islands_are_refused_naming_both() {
    let job = Job::new();
    let errors = each_rank(&job, 4, |rank, env| {
        let text = if rank == 3 { "1+3" } else { "2+2" };
        let config = Config {
            islands: Some(Islands::parse(text, 4).unwrap()),
            ..Config::default()
        };
        CpuCommunicator::new(&Rendezvous::join(env).unwrap(), config)
            .unwrap_err()
            .to_string()
    });
    for msg in &errors {
        assert!(
            msg.contains("2+2") && msg.contains("1+3") && msg.contains("islands"),
            "{msg}"
        );
    }
}

#[test]
fn islands_of_another_world_size_are_refused() {
    let job = Job::new();
    let errors = each_rank(&job, 2, |_, env| {
        let config = Config {
            islands: Some(Islands::parse("2+2", 4).unwrap()),
            ..Config::default()
        };
        CpuCommunicator::new(&Rendezvous::join(env).unwrap(), config)
            .unwrap_err()
            .to_string()
    });
    assert!(errors[0].contains("describe 4 ranks"), "{}", errors[0]);
}

#[test]
fn ranks_calling_different_algorithms_fail_on_every_rank_naming_both() {
    // Every pair of the CPU's algorithms, the last rank calling the other one.
    let algos = CpuCommunicator::ALGORITHMS;
    let pairs: Vec<(Algorithm, Algorithm)> = algos
        .iter()
        .flat_map(|&a| algos.iter().map(move |&b| (a, b)))
        .filter(|(a, b)| a != b)
        .collect();
    let job = Job::new();
    let config = Config {
        timeout: Duration::from_secs(20),
        islands: Some(Islands::parse("1+2", 3).unwrap()),
        ..Config::default()
    };
    let results = each_rank(&job, 3, move |rank, env| {
        let rdv = Rendezvous::join(env).unwrap();
        let mut out = Vec::new();
        for &(a, b) in &pairs {
            let mut comm = CpuCommunicator::new(&rdv, config).unwrap();
            let algo = if rank == 2 { b } else { a };
            let start = Instant::now();
            let err = comm
                .all_reduce_in_place(&mut [1f32; 100], algo)
                .unwrap_err();
            out.push((a, b, err.to_string(), start.elapsed()));
        }
        out
    });
    for (rank, rows) in results.iter().enumerate() {
        for (a, b, msg, took) in rows {
            assert!(
                msg.contains(&format!("(f32 ({a}")) || msg.contains(&format!("of f32 ({a}")),
                "rank {rank}, {a} vs {b}: {msg}"
            );
            assert!(
                msg.contains(&format!("of f32 ({b}")),
                "rank {rank}, {a} vs {b}: {msg}"
            );
            assert!(
                *took < Duration::from_secs(5),
                "rank {rank}, {a} vs {b}: {took:?}"
            );
        }
    }
}

#[test]
fn a_silent_rank_is_named_by_every_other_rank_in_every_algorithm() {
    let job = Job::new();
    let n = 4;
    let config = Config {
        islands: Some(Islands::parse("1+3", n).unwrap()),
        ..Config::default()
    };
    let results = each_rank(&job, n, move |rank, env| {
        let rdv = Rendezvous::join(env).unwrap();
        let mut out = Vec::new();
        for algo in CpuCommunicator::ALGORITHMS {
            let mut comm = CpuCommunicator::new(&rdv, config).unwrap();
            comm.set_timeout(Duration::from_millis(400));
            let mut data = vec![1f32; 1000];
            comm.all_reduce_in_place(&mut data, algo).unwrap();
            // Rank 2 (inside the larger island, not a ring neighbour of rank 0) stops calling.
            if rank == 2 {
                std::thread::sleep(Duration::from_millis(900));
                out.push(None);
                continue;
            }
            let start = Instant::now();
            let err = comm.all_reduce_in_place(&mut data, algo).unwrap_err();
            out.push(Some((algo, err.to_string(), start.elapsed())));
        }
        out
    });
    for (rank, rows) in results.iter().enumerate() {
        for (algo, msg, took) in rows.iter().flatten() {
            assert!(
                msg.contains("rank 2") && msg.contains("timed out"),
                "rank {rank}, {algo}: {msg}"
            );
            assert!(
                *took < Duration::from_millis(1500),
                "rank {rank}, {algo}: {took:?}"
            );
        }
    }
}

#[test]
fn islands_come_from_the_config_else_the_environment_else_one_island() {
    let four = Islands::parse("2+2", 4).unwrap();
    let given = Config {
        islands: Some(four),
        ..Config::default()
    };
    // The config wins over the environment, and must describe the group.
    let env = Ok(Some(Islands::parse("1+3", 4).unwrap()));
    assert_eq!(resolve_islands(&given, 4, env).unwrap(), (four, None));
    let err = resolve_islands(&given, 3, Ok(None))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("describe 4 ranks") && err.contains("has 3"),
        "{err}"
    );
    let none = Config::default();
    assert_eq!(
        resolve_islands(&none, 4, Ok(Some(four))).unwrap(),
        (four, None)
    );
    assert_eq!(
        resolve_islands(&none, 4, Ok(None)).unwrap(),
        (Islands::single(4), None)
    );
    // A TPAR_ISLANDS of another group size: one island here, and the islands algorithms
    // refused with the reason (a process may hold groups of several sizes).
    let other = Err(Error::InvalidArgument("TPAR_ISLANDS=4+4: 8 ranks".into()));
    let (islands, refused) = resolve_islands(&none, 2, other).unwrap();
    assert_eq!(islands, Islands::single(2));
    assert!(refused.unwrap().contains("TPAR_ISLANDS=4+4"));
}

#[test]
fn more_ranks_than_tpar_serves_are_refused_not_a_panic() {
    let job = Job::new();
    let too_many = crate::algorithm::MAX_RANKS + 1;
    let rdv = Rendezvous::join(RankEnv::on_one_host(0, too_many, &job.dir, &job.token)).unwrap();
    let Err(err) = CpuCommunicator::new(&rdv, Config::default()) else {
        panic!("a group of 17 ranks was accepted");
    };
    assert!(
        matches!(err, Error::Unsupported(_)) && err.to_string().contains("1 to 16 ranks"),
        "{err}"
    );
    assert_eq!(job.leftover_segments(), 0);
}
