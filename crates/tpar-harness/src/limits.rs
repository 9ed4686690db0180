//! What this host can hold, checked before any rank starts (by the CLI and by Python): ranks against cores (a warning:
//! waits yield, so it runs, slowly), and shared memory and buffers against free /dev/shm and
//! available RAM (an error naming both numbers). Without this, `-n 1000` or `--sizes 16G`
//! forked ranks until the machine stopped answering.

use crate::{bail, Result};
use tpar::memory::human_bytes;

/// Free bytes of the host, as far as they can be read.
#[derive(Clone, Copy, Debug)]
pub struct HostRoom {
    /// `MemAvailable` of /proc/meminfo.
    pub ram_available: Option<u64>,
    /// Free bytes of the file system under /dev/shm (tmpfs: also RAM).
    pub shm_free: Option<u64>,
    pub cores: usize,
}

impl HostRoom {
    pub fn here() -> HostRoom {
        HostRoom {
            ram_available: ram_available(),
            shm_free: tpar::free_bytes(std::path::Path::new("/dev/shm")),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

fn ram_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Whether this process may create files in folder `dir` (checked before a run that writes
/// its results there, so a bad path fails at once rather than after the run).
pub fn can_write_in(dir: &std::path::Path) -> bool {
    tpar::dir_writable(dir)
}

/// What a CPU-backend job of `world_size` ranks needs: each rank's inbox segment in /dev/shm,
/// and in each rank's own memory `buffers_per_rank` bytes (inputs, expected sums, output).
#[derive(Clone, Copy, Debug)]
pub struct CpuJobNeeds {
    pub world_size: usize,
    pub shm_per_rank: u64,
    pub buffers_per_rank: u64,
    /// The flag that sets the largest message (`--sizes` of bench, `--counts` of selftest),
    /// which a refusal names as the fix.
    pub sizes_flag: &'static str,
}

impl CpuJobNeeds {
    /// A bench's job: the largest of `sizes` ((bytes, elements) pairs), in the buffers `cpu`
    /// counts.
    pub fn bench(world_size: usize, sizes: &[(u64, usize)]) -> CpuJobNeeds {
        let max_bytes = sizes.iter().map(|s| s.0).max().unwrap_or(0);
        CpuJobNeeds::cpu(world_size, max_bytes, 5)
    }

    /// A self-test's job: the largest count of the widest dtype, in the buffers `cpu` counts,
    /// and two communicators per rank: the silent-peer case's is still mapped by the ranks
    /// waiting out its deadline while the silent rank creates the sweep's (counted as one, a
    /// /dev/shm too small for two passed this check and failed inside the ranks).
    pub fn selftest(world_size: usize, counts: &[usize], dtypes: &[tpar::DType]) -> CpuJobNeeds {
        let widest = dtypes.iter().map(|d| d.size() as u64).max().unwrap_or(4);
        let max_bytes = counts
            .iter()
            .max()
            .map_or(0, |&c| (c as u64).saturating_mul(widest));
        let one = CpuJobNeeds::cpu(world_size, max_bytes, 5);
        CpuJobNeeds {
            shm_per_rank: 2 * one.shm_per_rank,
            sizes_flag: "--counts",
            ..one
        }
    }

    /// A CPU communicator per rank with the default chunk size, plus `buffer_copies` buffers of
    /// the largest message (bench and selftest keep two inputs, two expected sums and an output).
    pub fn cpu(world_size: usize, max_message_bytes: u64, buffer_copies: u64) -> CpuJobNeeds {
        let segment = tpar::backend::cpu::segment_bytes(world_size, &tpar::Config::default());
        CpuJobNeeds {
            world_size,
            shm_per_rank: segment as u64,
            buffers_per_rank: max_message_bytes.saturating_mul(buffer_copies),
            sizes_flag: "--sizes",
        }
    }

    /// Refuses a job that cannot fit (an error naming what is needed and what is free: the
    /// caller's arguments asked too much, so the CLI reports it as a usage error);
    /// returns the warnings to print for one that fits but will be slow.
    pub fn check(&self, room: &HostRoom) -> Result<Vec<String>> {
        let n = self.world_size as u64;
        let shm_total = self.shm_per_rank.saturating_mul(n);
        let buffers_total = self.buffers_per_rank.saturating_mul(n);
        if let Some(free) = room.shm_free {
            if shm_total > free {
                bail!(
                    "{} ranks need {} of shared memory ({} each) but /dev/shm has {} free; use fewer ranks (-n)",
                    self.world_size,
                    human_bytes(shm_total),
                    human_bytes(self.shm_per_rank),
                    human_bytes(free)
                );
            }
        }
        if let Some(ram) = room.ram_available {
            let total = shm_total.saturating_add(buffers_total);
            if total > ram {
                bail!(
                    "{} ranks need {} of memory ({} of shared memory and {} of message buffers, {} per rank) but {} is available; use smaller {} or fewer ranks (-n)",
                    self.world_size,
                    human_bytes(total),
                    human_bytes(shm_total),
                    human_bytes(buffers_total),
                    human_bytes(self.buffers_per_rank),
                    human_bytes(ram),
                    self.sizes_flag
                );
            }
        }
        let mut warnings = Vec::new();
        if self.world_size > room.cores {
            warnings.push(format!(
                "tpar: warning: {} ranks on {} core{}: ranks take turns, so latencies measure the scheduler more than the protocol",
                self.world_size,
                room.cores,
                if room.cores == 1 { "" } else { "s" }
            ));
        }
        Ok(warnings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_selftest_counts_two_communicators_per_rank_and_a_bench_one() {
        let inbox = CpuJobNeeds::cpu(7, 0, 5).shm_per_rank;
        assert_eq!(
            CpuJobNeeds::selftest(7, &[1024], &[tpar::DType::F32]).shm_per_rank,
            2 * inbox
        );
        assert_eq!(CpuJobNeeds::bench(7, &[(4096, 1024)]).shm_per_rank, inbox);
    }

    fn room(ram: u64, shm: u64, cores: usize) -> HostRoom {
        HostRoom {
            ram_available: Some(ram),
            shm_free: Some(shm),
            cores,
        }
    }

    #[test]
    fn a_small_job_fits_and_too_many_ranks_warn() {
        let needs = CpuJobNeeds::cpu(4, 4 << 20, 5);
        assert!(needs.check(&room(16 * GIB, 8 * GIB, 8)).unwrap().is_empty());
        let warnings = needs.check(&room(16 * GIB, 8 * GIB, 2)).unwrap();
        assert!(warnings[0].contains("4 ranks on 2 cores"), "{warnings:?}");
    }

    #[test]
    fn a_selftest_needs_its_largest_count_of_its_widest_dtype() {
        let needs = CpuJobNeeds::selftest(2, &[0, 7, 1000], &[tpar::DType::F16, tpar::DType::F32]);
        assert_eq!(
            needs.buffers_per_rank,
            CpuJobNeeds::cpu(2, 4000, 5).buffers_per_rank
        );
        let bench = CpuJobNeeds::bench(2, &[(4096, 2048), (65536, 32768)]);
        assert_eq!(
            bench.buffers_per_rank,
            CpuJobNeeds::cpu(2, 65536, 5).buffers_per_rank
        );
        let none = CpuJobNeeds::selftest(2, &[], &[]);
        assert_eq!(
            none.buffers_per_rank,
            CpuJobNeeds::cpu(2, 0, 5).buffers_per_rank
        );
    }

    #[test]
    fn shared_memory_beyond_dev_shm_names_both_numbers() {
        let needs = CpuJobNeeds::cpu(1000, 4096, 5);
        let err = needs
            .check(&room(64 * GIB, GIB, 2))
            .unwrap_err()
            .to_string();
        assert!(err.contains("1000 ranks need"), "{err}");
        assert!(err.contains("/dev/shm has 1 GiB free"), "{err}");
    }

    #[test]
    fn huge_messages_are_refused_without_overflow() {
        let needs = CpuJobNeeds::cpu(2, u64::MAX - 1, 5);
        let err = needs.check(&room(64 * GIB, 64 * GIB, 2)).unwrap_err();
        assert!(err.to_string().contains("64 GiB is available"), "{err}");
    }
}
