//! Parsing of the list arguments shared by the commands: sizes with binary suffixes, element
//! counts, algorithm and dtype lists, durations in seconds.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use tpar::DType;

/// `"4K"` -> 4096. Suffixes K, M, G (optionally followed by `B` or `iB`) are powers of 1024.
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let upper = t.to_ascii_uppercase();
    let number_end = upper
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(upper.len());
    let (digits, suffix) = upper.split_at(number_end);
    if digits.is_empty() {
        bail!("size '{text}' does not start with a number; write sizes like 4096, 4K, 1M or 1G");
    }
    let shift = match suffix.trim_end_matches("IB").trim_end_matches('B') {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => {
            bail!("size '{text}' has an unknown suffix '{suffix}'; use K, M or G (powers of 1024)")
        }
    };
    let value: u64 = digits
        .parse()
        .with_context(|| format!("size '{text}' is too large"))?;
    value
        .checked_mul(1 << shift)
        .with_context(|| format!("size '{text}' is too large"))
}

pub fn parse_list<T>(text: &str, what: &str, parse: impl Fn(&str) -> Result<T>) -> Result<Vec<T>> {
    let items: Vec<T> = text
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| parse(s).with_context(|| format!("in --{what} '{text}'")))
        .collect::<Result<_>>()?;
    if items.is_empty() {
        bail!("--{what} is empty; give a comma-separated list");
    }
    Ok(items)
}

pub fn parse_dtypes(text: &str) -> Result<Vec<DType>> {
    parse_list(text, "dtypes", |s| Ok(s.parse::<DType>()?))
}

pub fn parse_seconds(text: &str) -> Result<Duration> {
    let secs: f64 = text
        .trim()
        .parse()
        .with_context(|| format!("'{text}' is not a number of seconds"))?;
    if !(secs > 0.0 && secs.is_finite()) {
        bail!("a timeout must be a positive number of seconds, not '{text}'");
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Sizes in bytes as elements of `dtype`, refusing sizes that are not whole elements.
pub fn sizes_to_counts(sizes: &[u64], dtype: DType) -> Result<Vec<usize>> {
    sizes
        .iter()
        .map(|&bytes| {
            if bytes % dtype.size() as u64 != 0 {
                bail!(
                    "size {bytes} B is not a whole number of {dtype} elements ({} B each); pick a multiple of {}",
                    dtype.size(),
                    dtype.size()
                );
            }
            Ok((bytes / dtype.size() as u64) as usize)
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
        assert!(parse_size("K").unwrap_err().to_string().contains("number"));
        assert!(parse_size("3X").unwrap_err().to_string().contains("suffix"));
        assert!(parse_size("99999999999999999999").is_err());
    }

    #[test]
    fn lists_name_the_flag_in_errors() {
        let err = parse_list("1K,,zz", "sizes", parse_size).unwrap_err();
        assert!(format!("{err:#}").contains("--sizes"), "{err:#}");
        assert!(parse_list(",", "sizes", parse_size).is_err());
        let algos = parse_list("one-shot,two-shot", "algos", |s| {
            Ok(s.parse::<tpar::Algorithm>()?)
        })
        .unwrap();
        assert_eq!(algos, tpar::CpuCommunicator::ALGORITHMS.to_vec());
    }

    #[test]
    fn sizes_must_be_whole_elements() {
        assert_eq!(sizes_to_counts(&[8, 0], DType::F32).unwrap(), vec![2, 0]);
        assert!(sizes_to_counts(&[6], DType::F32)
            .unwrap_err()
            .to_string()
            .contains("multiple of 4"));
    }

    #[test]
    fn timeouts_are_positive() {
        assert_eq!(parse_seconds("1.5").unwrap(), Duration::from_millis(1500));
        assert!(parse_seconds("0").is_err());
        assert!(parse_seconds("-3").is_err());
        assert!(parse_seconds("soon").is_err());
    }
}
