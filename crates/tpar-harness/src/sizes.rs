//! The message sizes of a sweep: sizes as people write them (`4K`, `1MiB`), the default
//! sweeps of `bench` and `tune`, and sizes as whole element counts of a dtype.

use super::backend_choice::Backend;
use tpar::DType;

/// `bench`'s sweep on the CPU backend.
pub const CPU_BENCH_SIZES: &str = "1K,4K,16K,64K,256K,1M,4M";
/// `bench`'s sweep on CUDA: 42K is where the dispatcher's built-in crossovers sit.
pub const CUDA_BENCH_SIZES: &str = "4K,8K,16K,32K,42K,64K,128K,256K,1M,4M,8M";
/// `tune`'s sweep: the table switches algorithms between these sizes.
pub const TUNE_SIZES: &str = "1K,4K,16K,32K,64K,128K,256K,512K,1M,2M,4M,16M,64M";

/// A size that cannot be read, or is not a whole number of elements; the message says the fix.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct SizeError(pub String);

/// `bench`'s default sweep on `backend`.
pub fn bench_sizes(backend: Backend) -> &'static str {
    match backend {
        Backend::Cuda => CUDA_BENCH_SIZES,
        Backend::Cpu => CPU_BENCH_SIZES,
    }
}

/// `"4K"` -> 4096. Suffixes K, M, G (optionally followed by `B` or `iB`) are powers of 1024.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let upper = text.trim().to_ascii_uppercase();
    let number_end = upper
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(upper.len());
    let (digits, suffix) = upper.split_at(number_end);
    if upper.starts_with('-') {
        return Err(SizeError(format!(
            "size '{text}' is negative; a size is a number of bytes, 0 or more, like 4096, 4K or 1M"
        )));
    }
    if digits.is_empty() {
        return Err(SizeError(format!(
            "size '{text}' does not start with a number; write sizes like 4096, 4K, 1M or 1G"
        )));
    }
    let shift = match suffix.trim_end_matches("IB").trim_end_matches('B') {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => {
            return Err(SizeError(format!(
                "size '{text}' has an unknown suffix '{suffix}'; use K, M or G (powers of 1024)"
            )))
        }
    };
    let value: u64 = digits
        .parse()
        .map_err(|e| SizeError(format!("size '{text}' is too large: {e}")))?;
    value
        .checked_mul(1 << shift)
        .ok_or_else(|| SizeError(format!("size '{text}' is too large")))
}

/// Each size in bytes with its count of `dtype` elements; a size that is not a whole number of
/// elements is refused.
pub fn with_counts(sizes: &[u64], dtype: DType) -> Result<Vec<(u64, usize)>, SizeError> {
    let element = dtype.size() as u64;
    sizes
        .iter()
        .map(|&bytes| {
            if bytes % element != 0 {
                return Err(SizeError(format!(
                    "size {bytes} B is not a whole number of {dtype} elements ({element} B each); pick a multiple of {element}"
                )));
            }
            Ok((bytes, (bytes / element) as usize))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_use_binary_suffixes() {
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("2GB").unwrap(), 2 << 30);
        assert!(parse_size("K").unwrap_err().0.contains("number"));
        assert!(parse_size("-4K")
            .unwrap_err()
            .0
            .contains("'-4K' is negative"));
        assert!(parse_size("3X").unwrap_err().0.contains("suffix"));
        assert!(parse_size("99999999999999999999").is_err());
        assert_eq!(
            parse_size("99999999999G").unwrap_err().0,
            "size '99999999999G' is too large"
        );
    }

    #[test]
    fn sizes_must_be_whole_elements() {
        assert_eq!(
            with_counts(&[8, 0], DType::F32).unwrap(),
            vec![(8, 2), (0, 0)]
        );
        assert!(with_counts(&[6], DType::F32)
            .unwrap_err()
            .0
            .contains("multiple of 4"));
        assert_eq!(bench_sizes(Backend::Cpu), CPU_BENCH_SIZES);
        for list in [CPU_BENCH_SIZES, CUDA_BENCH_SIZES, TUNE_SIZES] {
            assert!(list.split(',').all(|s| parse_size(s).is_ok()), "{list}");
        }
    }
}
