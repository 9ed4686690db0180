//! The call header: the first lines of every stage-one slot say which call, how many elements
//! of which dtype and by which algorithm the sender is reducing. A receiver compares it with
//! its own before touching the data, so ranks that disagree get an error naming both sides
//! instead of a wrong sum.

use crate::algorithm::Algorithm;
use crate::dtype::DType;

/// Lines reserved for the header at the start of each stage-one slot.
pub const HEADER_LINES: usize = 8;

/// Word 0 of every call header: "tpar" (`TPAR_HEADER_MAGIC` in the kernels' layout.cuh).
pub const HEADER_MAGIC: u32 = 0x7470_6172;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallHeader {
    /// Sequence number of the call on this communicator (wraps; compared for equality only).
    pub seq: u32,
    /// Elements in the whole call, not just this chunk.
    pub count: u64,
    pub dtype: DType,
    pub algorithm: Algorithm,
    /// Index of this chunk within the call.
    pub chunk: u32,
}

impl CallHeader {
    pub fn encode(&self) -> [u32; HEADER_LINES] {
        [
            HEADER_MAGIC,
            self.seq,
            self.count as u32,
            (self.count >> 32) as u32,
            u32::from(self.dtype.code()) | (u32::from(self.algorithm.code()) << 8),
            self.chunk,
            0,
            0,
        ]
    }

    /// Decodes a header; `None` when the words are not a header this version wrote.
    pub fn decode(words: &[u32; HEADER_LINES]) -> Option<CallHeader> {
        if words[0] != HEADER_MAGIC {
            return None;
        }
        Some(CallHeader {
            seq: words[1],
            count: u64::from(words[2]) | (u64::from(words[3]) << 32),
            dtype: DType::from_code(words[4] as u8)?,
            algorithm: Algorithm::from_code((words[4] >> 8) as u8)?,
            chunk: words[5],
        })
    }

    /// What a user would recognise of this call, for mismatch errors.
    pub fn describe(&self) -> String {
        format!(
            "{} elements of {} ({}, chunk {})",
            self.count, self.dtype, self.algorithm, self.chunk
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn headers_round_trip(seq: u32, count: u64, chunk: u32, d in 0usize..3, a in 0usize..4) {
            let h = CallHeader { seq, count, dtype: DType::ALL[d], algorithm: Algorithm::ALL[a], chunk };
            prop_assert_eq!(CallHeader::decode(&h.encode()), Some(h));
        }
    }

    #[test]
    fn garbage_is_not_a_header() {
        assert_eq!(CallHeader::decode(&[0; HEADER_LINES]), None);
        let mut words = CallHeader {
            seq: 1,
            count: 5,
            dtype: DType::F16,
            algorithm: Algorithm::OneShot,
            chunk: 0,
        }
        .encode();
        words[4] = 0xffff;
        assert_eq!(CallHeader::decode(&words), None);
    }
}
