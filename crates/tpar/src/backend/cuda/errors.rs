//! The error word a kernel leaves in host-mapped memory when it gives up (a peer past its
//! deadline, a peer's call header that disagrees with this rank's), decoded into tpar's errors.
//! The word's layout and codes mirror `report_error` and the `TPAR_ERR_*` / `TPAR_PHASE_*`
//! defines of the kernels' header: `code | peer << 8 | phase << 16 | field << 24 | detail << 32`.

use std::time::Duration;

use super::fused;
use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::Error;
use crate::protocol::header::CallHeader;

/// `TPAR_ERR_TIMEOUT`: a wait passed its deadline.
pub const ERR_TIMEOUT: u64 = 1;
/// `TPAR_ERR_MISMATCH`: a peer's call header differs from this rank's.
pub const ERR_MISMATCH: u64 = 2;

/// Where each part of the word sits: (shift, mask).
const CODE: (u32, u64) = (0, 0xff);
const PEER: (u32, u64) = (8, 0xff);
const PHASE: (u32, u64) = (16, 0xff);
const FIELD: (u32, u64) = (24, 0xff);
const DETAIL: (u32, u64) = (32, 0xffff_ffff);

/// The phases a kernel waits in (`TPAR_PHASE_*`), with the words an error names them by.
pub const PHASES: [(u64, &str); 5] = [
    (1, "header exchange"),
    (2, "one-shot receive"),
    (3, "two-shot reduce-scatter"),
    (4, "two-shot all-gather"),
    (5, "pull: waiting for the peer's flag"),
];

/// The call header's words (`header_word` in the kernels) that a mismatch can name.
const HEADER_COUNT_LOW: u64 = 2;
const HEADER_DTYPE_AND_ALGORITHM: u64 = 4;
const HEADER_CHUNK: u64 = 5;

pub fn phase_name(code: u64) -> &'static str {
    PHASES
        .iter()
        .find(|(c, _)| *c == code)
        .map_or("unknown phase", |(_, name)| name)
}

fn part(word: u64, (shift, mask): (u32, u64)) -> u64 {
    (word >> shift) & mask
}

/// What a call of `rank` should report for error `word` (non-zero), given the header of its
/// last call and the kernels' `timeout`.
pub(super) fn decode(
    word: u64,
    rank: usize,
    last_call: Option<CallHeader>,
    timeout: Duration,
) -> Error {
    let peer = part(word, PEER) as usize;
    let phase = phase_name(part(word, PHASE));
    let field = part(word, FIELD);
    let detail = part(word, DETAIL) as u32;
    match part(word, CODE) {
        ERR_TIMEOUT => Error::PeerTimeout {
            peer,
            phase: format!("{phase}, in a kernel"),
            waited: timeout,
        },
        ERR_MISMATCH => Error::CallMismatch {
            seq: last_call.map_or(0, |c| c.seq),
            rank,
            mine: last_call.map_or_else(|| "another call".to_owned(), |c| c.describe()),
            peer,
            theirs: match field {
                HEADER_COUNT_LOW => format!("{detail} elements (low 32 bits of its count)"),
                HEADER_DTYPE_AND_ALGORITHM => format!(
                    "dtype {} with algorithm {}{}",
                    DType::from_code(detail as u8).map_or("?", DType::name),
                    Algorithm::from_code((detail >> 8) as u8).map_or("?", Algorithm::name),
                    fused::header_note(detail)
                ),
                HEADER_CHUNK => format!("chunk {detail}"),
                _ => format!("header word {field} = {detail:#x}"),
            },
        },
        _ => Error::Cuda(format!(
            "the kernel reported an unknown error word {word:#x}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::super::kernels::HEADERS;
    use super::*;

    fn headers() -> impl Iterator<Item = &'static str> {
        HEADERS.iter().flat_map(|(_, source)| source.lines())
    }

    fn define(name: &str) -> u64 {
        let line = headers()
            .find(|l| l.starts_with("#define") && l.split_whitespace().nth(1) == Some(name))
            .unwrap_or_else(|| panic!("{name} is not defined in the kernels' headers"));
        line.split_whitespace().nth(2).unwrap().parse().unwrap()
    }

    #[test]
    fn codes_and_phases_mirror_the_header() {
        assert_eq!(define("TPAR_ERR_TIMEOUT"), ERR_TIMEOUT);
        assert_eq!(define("TPAR_ERR_MISMATCH"), ERR_MISMATCH);
        for (name, phase) in [
            ("TPAR_PHASE_HEADER", "header exchange"),
            ("TPAR_PHASE_ONE_SHOT", "one-shot receive"),
            ("TPAR_PHASE_REDUCE_SCATTER", "two-shot reduce-scatter"),
            ("TPAR_PHASE_ALL_GATHER", "two-shot all-gather"),
            ("TPAR_PHASE_PULL_FLAG", "pull: waiting for the peer's flag"),
        ] {
            assert_eq!(phase_name(define(name)), phase, "{name}");
        }
        assert!(headers().any(|l| l.contains(
            "(u64)code | ((u64)peer << 8) | ((u64)phase << 16) | ((u64)(field & 0xff) << 24)"
        )));
    }

    #[test]
    fn words_decode_into_named_errors() {
        let timeout = Duration::from_secs(3);
        let word = ERR_TIMEOUT | 3 << 8 | 4 << 16;
        match decode(word, 1, None, timeout) {
            Error::PeerTimeout {
                peer,
                phase,
                waited,
            } => {
                assert_eq!((peer, waited), (3, timeout));
                assert_eq!(phase, "two-shot all-gather, in a kernel");
            }
            other => panic!("{other:?}"),
        }
        let bf16_one_shot =
            u64::from(DType::Bf16.code()) | u64::from(Algorithm::OneShot.code()) << 8;
        let word = ERR_MISMATCH
            | 2 << 8
            | 1 << 16
            | HEADER_DTYPE_AND_ALGORITHM << 24
            | bf16_one_shot << 32;
        let text = decode(word, 0, None, timeout).to_string();
        assert!(
            text.contains("dtype bf16 with algorithm one-shot"),
            "{text}"
        );
        let word = ERR_MISMATCH | 1 << 8 | 1 << 16 | HEADER_COUNT_LOW << 24 | 77 << 32;
        let text = decode(word, 0, None, timeout).to_string();
        assert!(text.contains("77 elements"), "{text}");
        assert!(decode(0x99, 0, None, timeout)
            .to_string()
            .contains("unknown error word 0x99"));
    }
}
