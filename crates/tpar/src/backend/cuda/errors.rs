//! The error word a kernel leaves in host-mapped memory when it gives up (a peer past its
//! deadline, a peer's call header that disagrees with this rank's), decoded into tpar's errors.
//! The word's layout, codes and phases are the ABI mirror's in `kernels.rs` (checked against
//! the headers there): `code | peer << 8 | phase << 16 | field << 24 | detail << 32`.

use std::time::Duration;

use super::kernels::{
    phase_name, ERR_DETAIL_SHIFT, ERR_FIELD_SHIFT, ERR_MISMATCH, ERR_PEER_SHIFT, ERR_PHASE_SHIFT,
    ERR_TIMEOUT,
};
use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::Error;
use crate::protocol::header::CallHeader;

/// Where each part of the word sits: (shift, mask); the shifts are the ABI mirror's.
const CODE: (u32, u64) = (0, 0xff);
const PEER: (u32, u64) = (ERR_PEER_SHIFT, 0xff);
const PHASE: (u32, u64) = (ERR_PHASE_SHIFT, 0xff);
const FIELD: (u32, u64) = (ERR_FIELD_SHIFT, 0xff);
const DETAIL: (u32, u64) = (ERR_DETAIL_SHIFT, 0xffff_ffff);

/// The call header's words (`header_word` in the kernels) that a mismatch can name. The
/// kernels compare the op (word 4) first, so a differing count is read knowing the op.
const HEADER_COUNT_LOW: u64 = 2;
const HEADER_COUNT_HIGH: u64 = 3;
const HEADER_DTYPE_AND_ALGORITHM: u64 = 4;
const HEADER_CHUNK: u64 = 5;
const HEADER_CALL_HASH: u64 = 6;
/// A mismatch another rank found and passed on (`TPAR_FIELD_NOTICE`): the detail is that rank.
pub(super) const FIELD_NOTICE: u64 = 7;

/// Set in header word 4 by fused calls (`TPAR_HEADER_FUSED` in fused.cuh).
pub(super) const HEADER_FUSED: u32 = 0x1_0000;
/// Set in header word 4 by islands calls in the all-units form (`TPAR_HEADER_ISLANDS_ALL` in
/// abi.cuh).
pub(super) const HEADER_ISLANDS_ALL: u32 = 0x2_0000;

/// What a mismatched header word 4 says about the op the peer called.
pub(super) fn header_note(word: u32) -> &'static str {
    if word & HEADER_FUSED != 0 {
        ", fused with residual add + RMSNorm"
    } else if word & HEADER_ISLANDS_ALL != 0 {
        ", exchanging all units between islands (TPAR_ISLANDS_EXCHANGE)"
    } else {
        ""
    }
}

fn part(word: u64, (shift, mask): (u32, u64)) -> u64 {
    (word >> shift) & mask
}

/// What a call of `rank` should report for error `word` (non-zero), given the header of its
/// last call (`fused`: a fused call, whose header counts rows and their length) and the
/// kernels' `timeout`.
pub(super) fn decode(
    word: u64,
    rank: usize,
    last_call: Option<CallHeader>,
    fused: bool,
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
                // A fused call's header carries its rows and their length (fused.rs).
                HEADER_COUNT_LOW if fused => format!("{detail} rows (tokens)"),
                HEADER_COUNT_HIGH if fused => format!("rows of {detail} elements (hidden size)"),
                HEADER_COUNT_LOW => format!("{detail} elements (low 32 bits of its count)"),
                HEADER_COUNT_HIGH => format!("a count whose high 32 bits are {detail}"),
                HEADER_DTYPE_AND_ALGORITHM => format!(
                    "dtype {} with algorithm {}{}",
                    DType::from_code(detail as u8).map_or("?", DType::name),
                    Algorithm::from_code((detail >> 8) as u8).map_or("?", Algorithm::name),
                    header_note(detail)
                ),
                HEADER_CHUNK => format!("chunk {detail}"),
                HEADER_CALL_HASH => format!("a call whose identity differs ({detail:#010x})"),
                FIELD_NOTICE => {
                    format!("arguments that rank {detail} found different from its own")
                }
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
    use super::super::kernels::{PHASE_ALL_GATHER, PHASE_HEADER};
    use super::*;

    #[test]
    fn words_decode_into_named_errors() {
        let timeout = Duration::from_secs(3);
        let word = ERR_TIMEOUT | 3 << ERR_PEER_SHIFT | PHASE_ALL_GATHER << ERR_PHASE_SHIFT;
        match decode(word, 1, None, false, timeout) {
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
        let mismatch = |peer: u64, field: u64, detail: u64| {
            ERR_MISMATCH
                | peer << ERR_PEER_SHIFT
                | PHASE_HEADER << ERR_PHASE_SHIFT
                | field << ERR_FIELD_SHIFT
                | detail << ERR_DETAIL_SHIFT
        };
        let word = mismatch(2, HEADER_DTYPE_AND_ALGORITHM, bf16_one_shot);
        let text = decode(word, 0, None, false, timeout).to_string();
        assert!(
            text.contains("dtype bf16 with algorithm one-shot"),
            "{text}"
        );
        let word = mismatch(1, HEADER_COUNT_LOW, 77);
        let text = decode(word, 0, None, false, timeout).to_string();
        assert!(text.contains("77 elements"), "{text}");
        // A fused call's header counts rows: the peer passed 2 rows, not 2 elements.
        let text = decode(word, 0, None, true, timeout).to_string();
        assert!(text.contains("77 rows (tokens)"), "{text}");
        let word = mismatch(1, HEADER_COUNT_HIGH, 4096);
        let text = decode(word, 0, None, true, timeout).to_string();
        assert!(text.contains("rows of 4096 elements"), "{text}");
        let word = mismatch(3, FIELD_NOTICE, 5);
        let text = decode(word, 0, None, false, timeout).to_string();
        assert!(text.contains("that rank 5 found different"), "{text}");
        assert!(decode(0x99, 0, None, false, timeout)
            .to_string()
            .contains("unknown error word 0x99"));
    }
}
