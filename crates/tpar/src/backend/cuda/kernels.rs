//! tpar's kernel sources (in `crates/tpar/kernels/`, one algorithm per file, the shared line
//! format and layout in `tpar_ll.cuh`), the Rust mirror of their argument block, and which
//! kernel runs which algorithm and dtype.

use crate::algorithm::Algorithm;
use crate::dtype::DType;

pub const HEADER_NAME: &str = "tpar_ll.cuh";
pub const HEADER_SOURCE: &str = include_str!("../../../kernels/tpar_ll.cuh");

/// Every kernel source file: (file name, source).
pub const SOURCES: [(&str, &str); 7] = [
    (
        "oneshot_push.cu",
        include_str!("../../../kernels/oneshot_push.cu"),
    ),
    (
        "twoshot_push.cu",
        include_str!("../../../kernels/twoshot_push.cu"),
    ),
    (
        "oneshot_pull.cu",
        include_str!("../../../kernels/oneshot_pull.cu"),
    ),
    ("floor.cu", include_str!("../../../kernels/floor.cu")),
    ("probe.cu", include_str!("../../../kernels/probe.cu")),
    // Fused allreduce + residual add + RMSNorm (backend/cuda/fused.rs).
    (
        "fused_oneshot.cu",
        include_str!("../../../kernels/fused_oneshot.cu"),
    ),
    (
        "fused_norm.cu",
        include_str!("../../../kernels/fused_norm.cu"),
    ),
];

/// The ladder of `tpar bench --anatomy` (`anatomy.cu`): timed by the CLI, never loaded by a
/// communicator. Its kernels are `tpar_anatomy_<rung>` for rungs `0..ANATOMY_RUNGS`.
pub const ANATOMY_SOURCE: (&str, &str) =
    ("anatomy.cu", include_str!("../../../kernels/anatomy.cu"));
pub const ANATOMY_RUNGS: usize = 6;

/// Kernels of the init probe (`probe.cu`): not allreduces, launched with their own arguments.
pub const PROBE_PREFIX: &str = "tpar_probe";

/// Architectures tpar builds for (compute capability x 10): Ampere to Blackwell.
pub const ARCHITECTURES: [u32; 6] = [80, 86, 89, 90, 100, 120];

/// Mirrors `TPAR_MAX_RANKS` in the header.
pub const MAX_RANKS: usize = crate::algorithm::MAX_RANKS;
/// Mirrors `TPAR_MAX_BLOCKS`.
pub const MAX_BLOCKS: u32 = 64;
/// Mirrors the 128-byte flag stride of the pull algorithm.
pub const FLAG_STRIDE_BYTES: usize = 128;
/// Threads per block of every kernel (`__launch_bounds__(512)`).
pub const THREADS: u32 = 512;

/// Error word codes and phases (`TPAR_ERR_*`, `TPAR_PHASE_*`).
pub const ERR_TIMEOUT: u64 = 1;
pub const ERR_MISMATCH: u64 = 2;

pub fn phase_name(code: u64) -> &'static str {
    match code {
        1 => "header exchange",
        2 => "one-shot receive",
        3 => "two-shot reduce-scatter",
        4 => "two-shot all-gather",
        5 => "pull: waiting for the peer's flag",
        _ => "unknown phase",
    }
}

/// The kernels' argument block (`struct TparArgs` in the header), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KernelArgs {
    pub input: u64,
    pub output: u64,
    pub count: u64,
    pub total_count: u64,
    pub payload_lines: u64,
    pub timeout_ns: u64,
    pub state: u64,
    pub error: u64,
    pub inboxes: [u64; MAX_RANKS],
    pub rank: u32,
    pub world_size: u32,
    pub chunk: u32,
    pub algo: u32,
}

/// The source file and function name of the kernel for `algorithm` on `dtype`.
pub fn kernel_for(algorithm: Algorithm, dtype: DType) -> (&'static str, String) {
    let (file, stem) = match algorithm {
        Algorithm::OneShot | Algorithm::HostStaged => ("oneshot_push.cu", "tpar_oneshot_push"),
        Algorithm::TwoShot => ("twoshot_push.cu", "tpar_twoshot_push"),
        Algorithm::OneShotPull => ("oneshot_pull.cu", "tpar_oneshot_pull"),
    };
    (file, format!("{stem}_{}", dtype.name()))
}

pub const EMPTY_KERNEL: (&str, &str) = ("floor.cu", "tpar_empty");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::nvrtc;
    use crate::protocol::header::HEADER_LINES;
    use crate::protocol::layout::{BUFFERS, SEGMENT_HEADER_LINES};

    fn define(name: &str) -> u64 {
        let line = HEADER_SOURCE
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(name) && l.starts_with("#define"))
            .unwrap_or_else(|| panic!("{name} is not defined in {HEADER_NAME}"));
        let value = line
            .split_whitespace()
            .nth(2)
            .unwrap()
            .trim_end_matches('u');
        match value.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).unwrap(),
            None => value.parse().unwrap(),
        }
    }

    #[test]
    fn the_header_and_the_rust_protocol_agree() {
        assert_eq!(define("TPAR_HEADER_LINES"), HEADER_LINES as u64);
        assert_eq!(define("TPAR_BUFFERS"), BUFFERS as u64);
        assert_eq!(
            define("TPAR_SEGMENT_HEADER_LINES"),
            SEGMENT_HEADER_LINES as u64
        );
        assert_eq!(define("TPAR_HEADER_MAGIC"), 0x7470_6172);
        assert_eq!(define("TPAR_MAX_RANKS"), MAX_RANKS as u64);
        assert_eq!(define("TPAR_MAX_BLOCKS"), u64::from(MAX_BLOCKS));
        assert_eq!(define("TPAR_FLAG_STRIDE_U64") * 8, FLAG_STRIDE_BYTES as u64);
        assert_eq!(define("TPAR_ERR_TIMEOUT"), ERR_TIMEOUT);
        assert_eq!(define("TPAR_ERR_MISMATCH"), ERR_MISMATCH);
        for d in DType::ALL {
            assert_eq!(
                define(&format!("TPAR_DTYPE_{}", d.name().to_uppercase())),
                u64::from(d.code())
            );
        }
        for (a, name) in [
            (Algorithm::OneShot, "TPAR_ALGO_ONE_SHOT"),
            (Algorithm::TwoShot, "TPAR_ALGO_TWO_SHOT"),
            (Algorithm::OneShotPull, "TPAR_ALGO_ONE_SHOT_PULL"),
            (Algorithm::HostStaged, "TPAR_ALGO_HOST_STAGED"),
        ] {
            assert_eq!(define(name), u64::from(a.code()), "{name}");
        }
        // The argument block: 8 u64, MAX_RANKS pointers, 4 u32.
        assert_eq!(
            std::mem::size_of::<KernelArgs>(),
            8 * 8 + MAX_RANKS * 8 + 16
        );
    }

    #[test]
    fn every_algorithm_and_dtype_has_a_kernel_in_the_sources() {
        for a in Algorithm::ALL {
            for d in DType::ALL {
                let (file, function) = kernel_for(a, d);
                let source = SOURCES.iter().find(|(f, _)| *f == file).unwrap().1;
                assert!(
                    source.contains(&format!("void __launch_bounds__(512) {function}(")),
                    "{function}"
                );
            }
        }
    }

    #[test]
    fn every_anatomy_rung_has_a_kernel_and_nothing_more() {
        let source = ANATOMY_SOURCE.1;
        for rung in 0..ANATOMY_RUNGS {
            assert!(
                source.contains(&format!("void __launch_bounds__(512) tpar_anatomy_{rung}(")),
                "rung {rung}"
            );
        }
        assert!(!source.contains(&format!("tpar_anatomy_{ANATOMY_RUNGS}(")));
    }

    /// Compiles every kernel for every architecture. Needs NVRTC but no GPU; CI sets
    /// TPAR_REQUIRE_NVRTC=1 so that a missing NVRTC fails instead of skipping.
    #[test]
    fn every_kernel_compiles_for_every_architecture() {
        if !nvrtc::nvrtc_present() {
            let why = "NVRTC not loadable (pip install nvidia-cuda-nvrtc; put nvidia/cu13/lib on LD_LIBRARY_PATH)";
            assert!(
                std::env::var("TPAR_REQUIRE_NVRTC").is_err(),
                "TPAR_REQUIRE_NVRTC is set but {why}"
            );
            eprintln!("SKIPPED every_kernel_compiles_for_every_architecture: {why}");
            return;
        }
        let version = nvrtc::nvrtc_version().unwrap();
        for arch in ARCHITECTURES {
            for (name, source) in SOURCES.into_iter().chain([ANATOMY_SOURCE]) {
                let cubin =
                    nvrtc::compile_cubin(name, source, &[(HEADER_NAME, HEADER_SOURCE)], arch)
                        .unwrap_or_else(|e| panic!("{name} sm_{arch} (NVRTC {version:?}): {e}"));
                assert!(
                    cubin.starts_with(b"\x7fELF"),
                    "{name} sm_{arch}: not an ELF CUBIN"
                );
            }
        }
        eprintln!(
            "compiled {} kernel files for sm_{:?} with NVRTC {version:?}",
            SOURCES.len(),
            ARCHITECTURES
        );
    }
}
