//! Where each line lives in a rank's inbox, how a call is cut into chunks, and which lines of a
//! chunk each rank owns in the two-shot algorithm. Counted in lines (see [`super::line`]).
//!
//! A rank's inbox (one per rank, written by its peers, read only by its owner):
//!
//! ```text
//! [segment header: SEGMENT_HEADER_LINES]
//! buffer 0: [stage-one slot from rank 0][... from rank n-1][gather slot]
//! buffer 1: ...
//! buffer 2: ...
//! stage-one slot: [call header: HEADER_LINES][payload: payload_lines]
//! gather slot:    [payload: payload_lines]
//! ```
//!
//! Stage one is where a sender pushes its input: all of it (one-shot) or only the lines the
//! receiver owns (two-shot reduce-scatter). The gather slot receives the reduced lines from
//! each owner at the owner's offsets (two-shot all-gather); owners write disjoint lines, so
//! one slot serves all of them.

use std::ops::Range;

use super::header::HEADER_LINES;
use super::line::{lines_for_bytes, LINE_BYTES, PAYLOAD_BYTES};
use crate::dtype::DType;

/// Rotating buffers. A rank writing epoch e+3 into a peer has finished epoch e+2, which needed
/// every peer's epoch e+2 data, so every peer had finished reading epoch e: the buffer is free.
/// (Two would do for these algorithms; the third leaves room for a deeper pipeline.)
pub const BUFFERS: usize = 3;

/// Lines at the start of a segment that describe it (magic, job token, rank, layout).
pub const SEGMENT_HEADER_LINES: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InboxLayout {
    pub world_size: usize,
    /// Payload lines of one slot: the largest chunk, in lines.
    pub payload_lines: usize,
}

impl InboxLayout {
    /// A layout whose chunks carry up to `chunk_bytes` of payload (rounded up to whole lines).
    pub fn new(world_size: usize, chunk_bytes: usize) -> InboxLayout {
        InboxLayout {
            world_size,
            payload_lines: lines_for_bytes(chunk_bytes).max(1),
        }
    }

    pub fn slot_lines(&self) -> usize {
        HEADER_LINES + self.payload_lines
    }

    fn buffer_lines(&self) -> usize {
        self.world_size * self.slot_lines() + self.payload_lines
    }

    pub fn total_lines(&self) -> usize {
        SEGMENT_HEADER_LINES + BUFFERS * self.buffer_lines()
    }

    pub fn total_bytes(&self) -> usize {
        self.total_lines() * LINE_BYTES
    }

    fn buffer_start(&self, epoch: u64) -> usize {
        SEGMENT_HEADER_LINES + (epoch % BUFFERS as u64) as usize * self.buffer_lines()
    }

    /// First line (the header) of the stage-one slot that `from` writes in `epoch`.
    pub fn stage_one_slot(&self, epoch: u64, from: usize) -> usize {
        debug_assert!(from < self.world_size);
        self.buffer_start(epoch) + from * self.slot_lines()
    }

    /// First payload line of the stage-one slot that `from` writes in `epoch`.
    pub fn stage_one_payload(&self, epoch: u64, from: usize) -> usize {
        self.stage_one_slot(epoch, from) + HEADER_LINES
    }

    /// First line of the gather slot of `epoch`.
    pub fn gather_slot(&self, epoch: u64) -> usize {
        self.buffer_start(epoch) + self.world_size * self.slot_lines()
    }

    /// Elements of `dtype` in one full chunk.
    pub fn chunk_elements(&self, dtype: DType) -> usize {
        self.payload_lines * PAYLOAD_BYTES / dtype.size()
    }
}

/// The element ranges of the chunks of a call of `count` elements. A call of zero elements is
/// one empty chunk: it still exchanges headers, so a mismatch with a peer is still caught.
pub fn chunks(count: usize, chunk_elements: usize) -> impl Iterator<Item = Range<usize>> {
    assert!(chunk_elements > 0, "a chunk holds at least one element");
    let n = count.div_ceil(chunk_elements).max(1);
    (0..n).map(move |i| (i * chunk_elements).min(count)..((i + 1) * chunk_elements).min(count))
}

/// The lines of a chunk of `lines` lines that `owner` reduces in two-shot: contiguous, in rank
/// order, sizes differing by at most one line.
pub fn owned_lines(lines: usize, world_size: usize, owner: usize) -> Range<usize> {
    let base = lines / world_size;
    let extra = lines % world_size;
    let start = owner * base + owner.min(extra);
    start..start + base + usize::from(owner < extra)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn chunks_cover_every_element_once(count in 0usize..100_000, per in 1usize..5000) {
            let mut next = 0;
            let mut n = 0;
            for c in chunks(count, per) {
                prop_assert_eq!(c.start, next);
                prop_assert!(c.len() <= per);
                next = c.end;
                n += 1;
            }
            prop_assert_eq!(next, count);
            prop_assert_eq!(n, count.div_ceil(per).max(1));
        }

        #[test]
        fn owners_partition_the_lines(lines in 0usize..10_000, world in 1usize..17) {
            let mut next = 0;
            for owner in 0..world {
                let r = owned_lines(lines, world, owner);
                prop_assert_eq!(r.start, next);
                prop_assert!(r.len() == lines / world || r.len() == lines / world + 1);
                next = r.end;
            }
            prop_assert_eq!(next, lines);
        }

        #[test]
        fn slots_are_disjoint_and_inside_the_segment(world in 1usize..9, chunk in 1usize..4096, epoch in 1u64..1000) {
            let l = InboxLayout::new(world, chunk);
            let mut regions: Vec<Range<usize>> = (0..world)
                .map(|r| l.stage_one_slot(epoch, r)..l.stage_one_slot(epoch, r) + l.slot_lines())
                .collect();
            regions.push(l.gather_slot(epoch)..l.gather_slot(epoch) + l.payload_lines);
            regions.sort_by_key(|r| r.start);
            prop_assert!(regions[0].start >= SEGMENT_HEADER_LINES);
            for pair in regions.windows(2) {
                prop_assert!(pair[0].end <= pair[1].start);
            }
            prop_assert!(regions.last().unwrap().end <= l.total_lines());
            // Consecutive epochs use different buffers.
            prop_assert_ne!(l.gather_slot(epoch), l.gather_slot(epoch + 1));
            prop_assert_eq!(l.gather_slot(epoch), l.gather_slot(epoch + BUFFERS as u64));
        }
    }

    #[test]
    fn zero_elements_is_one_empty_chunk() {
        assert_eq!(chunks(0, 16).collect::<Vec<_>>(), vec![0..0]);
    }
}
