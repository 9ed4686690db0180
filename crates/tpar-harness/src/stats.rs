//! The two statistics every timed row reports: a percentile of sorted samples and the bus
//! bandwidth of an allreduce as nccl-tests defines it.

/// Nearest-rank percentile `p` of sorted samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// nccl-tests' bus bandwidth for allreduce: bytes / time x 2 (n-1) / n, in GB/s (1e9).
pub fn bus_bandwidth_gbps(bytes: u64, micros: f64, world_size: usize) -> f64 {
    if micros <= 0.0 {
        return 0.0;
    }
    let n = world_size as f64;
    bytes as f64 / (micros * 1e3) * 2.0 * (n - 1.0) / n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&samples, 50.0), 50.0);
        assert_eq!(percentile(&samples, 99.0), 99.0);
        assert_eq!(percentile(&samples[..1], 99.0), 1.0);
    }

    #[test]
    fn bus_bandwidth_follows_nccl_tests() {
        // 1 MB in 100 us on 4 ranks: algbw 10 GB/s, busbw 15 GB/s.
        assert!((bus_bandwidth_gbps(1_000_000, 100.0, 4) - 15.0).abs() < 1e-9);
        assert_eq!(bus_bandwidth_gbps(1_000_000, 100.0, 1), 0.0);
    }
}
