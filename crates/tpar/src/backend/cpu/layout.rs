//! Where things live in a CPU rank's shared segment, and how a call is cut into rounds. This is
//! the CPU backend's own format (plain data and one flag per transfer in its own cache line),
//! not the GPU's LL lines of [`crate::protocol::layout`]: coherent caches make a flag written
//! after the data safe, so the data travel as plain copies at full width.
//!
//! Each rank owns one segment, placed in memory by the rank itself (it creates and fills it,
//! so its pages come from the rank's own NUMA node):
//!
//! ```text
//! [segment header: SEGMENT_HEADER_BYTES: the stamp, then the owner's CPU (CPU_WORD)]
//! buffer 0: [cells: cells_per_buffer x CELL_BYTES][slot 0][slot 1] ... [slot n]
//! buffer 1: ...
//! ```
//!
//! A *round* (one chunk of a call, [`crate::protocol::header::CallHeader::chunk`]) uses the
//! buffer of its epoch. A cell is a flag (the round's epoch, written last with release
//! semantics) followed by the call header, alone in its [`CELL_BYTES`]; a slot holds up to one
//! chunk of data. Which cells and slots an algorithm uses is said in `algorithms.rs`.
//!
//! Two buffers are enough: a rank finishing round e has seen data that depends on every rank's
//! round-e contribution (every algorithm's result depends on every input), so every rank had
//! finished round e-1; a rank can therefore be at most one round ahead of any other, and round
//! e+2, which reuses round e's buffer, cannot start before everyone is done with round e.

use std::ops::Range;

use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::protocol::schedule::{partials_fitting, UNIT_BYTES};

/// Buffers by epoch (see the module doc for why two suffice).
pub const BUFFERS: usize = 2;

/// One flag with its header, padded so that no two flags share a cache line or a pair of lines
/// (the adjacent-line prefetcher moves 128 bytes at a time).
pub const CELL_BYTES: usize = 128;

/// Bytes before the first buffer: the segment's stamp (magic, job, rank, layout); a page.
pub const SEGMENT_HEADER_BYTES: usize = 4096;

/// Byte offset, in the segment's header page, of the word that says on which CPU the owner
/// ran when its last round began (CPU + 1; 0: unknown). Alone in its cell, away from the stamp.
pub const CPU_WORD: usize = CELL_BYTES;

/// Data regions start on cache-line boundaries.
const ALIGN: usize = 64;

/// The flags of one buffer. `Header` lives in the owner's segment and says "this rank has
/// started the round with this header" (for the pull forms also: "my input is published");
/// the indexed cells live in the receiver's segment and are written by the rank they name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cell {
    /// The owner's header for the round (and, in pull forms, its published input).
    Header,
    /// Pull forms: the owner's island partial is published.
    PartialPublished,
    /// Pull forms: the owner's rounded range is published.
    FinalPublished,
    /// Push: the named rank's input (or the share of it this rank owns) has arrived.
    Input(usize),
    /// Islands push: the named rank's island partial over this rank's range has arrived.
    Partial(usize),
    /// Push: the named rank's reduced range has arrived in the gather slot.
    Final(usize),
    /// Ring: the left neighbour's reduce-scatter step has arrived.
    RingReduce(usize),
    /// Ring: the left neighbour's all-gather step has arrived.
    RingGather(usize),
}

/// The layout of every rank's segment in a communicator of `world_size` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuLayout {
    pub world_size: usize,
    /// Bytes of one slot: the chunk size rounded up to a cache line.
    pub slot_bytes: usize,
}

impl CpuLayout {
    /// The layout whose slots hold `chunk_bytes` (rounded up to a cache line).
    pub fn new(world_size: usize, chunk_bytes: usize) -> CpuLayout {
        CpuLayout {
            world_size,
            slot_bytes: chunk_bytes.max(1).next_multiple_of(ALIGN),
        }
    }

    fn cells_per_buffer(&self) -> usize {
        3 + 5 * self.world_size
    }

    /// Slots of one buffer: one per rank and the gather slot.
    pub fn slots(&self) -> usize {
        self.world_size + 1
    }

    /// A buffer, rounded up to whole pages so that every buffer's cells stay aligned.
    fn buffer_bytes(&self) -> usize {
        (self.cells_per_buffer() * CELL_BYTES + self.slots() * self.slot_bytes)
            .next_multiple_of(SEGMENT_HEADER_BYTES)
    }

    /// Size of each rank's segment.
    pub fn total_bytes(&self) -> usize {
        SEGMENT_HEADER_BYTES + BUFFERS * self.buffer_bytes()
    }

    fn buffer_start(&self, epoch: u64) -> usize {
        SEGMENT_HEADER_BYTES + (epoch % BUFFERS as u64) as usize * self.buffer_bytes()
    }

    /// Byte offset of `cell` in the buffer of `epoch`.
    pub fn cell(&self, epoch: u64, cell: Cell) -> usize {
        let n = self.world_size;
        let index = match cell {
            Cell::Header => 0,
            Cell::PartialPublished => 1,
            Cell::FinalPublished => 2,
            Cell::Input(r) => 3 + r,
            Cell::Partial(r) => 3 + n + r,
            Cell::Final(r) => 3 + 2 * n + r,
            Cell::RingReduce(s) => 3 + 3 * n + s,
            Cell::RingGather(s) => 3 + 4 * n + s,
        };
        debug_assert!(match cell {
            Cell::Input(r) | Cell::Partial(r) | Cell::Final(r) => r < n,
            Cell::RingReduce(s) | Cell::RingGather(s) => s < n,
            _ => true,
        });
        self.buffer_start(epoch) + index * CELL_BYTES
    }

    /// Byte range of slot `slot` (0..=world_size) in the buffer of `epoch`.
    pub fn slot(&self, epoch: u64, slot: usize) -> Range<usize> {
        debug_assert!(slot < self.slots());
        let start = self.buffer_start(epoch) + self.cells_per_buffer() * CELL_BYTES;
        let start = start + slot * self.slot_bytes;
        start..start + self.slot_bytes
    }

    /// The most payload bytes one round of `algorithm` carries for `dtype`: a slot, or for the
    /// algorithms whose partials cross ranks as f32 (islands, ring) as much as a slot holds in
    /// f32. Always a whole number of units (and so of elements).
    pub fn round_bytes(&self, algorithm: Algorithm, dtype: DType) -> usize {
        let limit = if carries_f32_partials(algorithm) {
            partials_fitting(self.slot_bytes, dtype)
        } else {
            self.slot_bytes
        };
        (limit / UNIT_BYTES * UNIT_BYTES).max(UNIT_BYTES)
    }
}

/// The algorithms whose partial sums cross ranks as f32 (their slots hold f32 images).
pub fn carries_f32_partials(algorithm: Algorithm) -> bool {
    matches!(
        algorithm,
        Algorithm::Islands | Algorithm::IslandsPull | Algorithm::Ring
    )
}

/// Byte range of units `units` in a message of `len` bytes of data (the last unit may be short).
pub fn unit_bytes(units: &Range<usize>, len: usize) -> Range<usize> {
    (units.start * UNIT_BYTES).min(len)..(units.end * UNIT_BYTES).min(len)
}

/// Where bytes `bytes` of a message of `dtype` sit in its f32 image (one f32 per element).
pub fn f32_image(bytes: &Range<usize>, dtype: DType) -> Range<usize> {
    let scale = 4 / dtype.size();
    bytes.start * scale..bytes.end * scale
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn cells_and_slots_are_disjoint_aligned_and_inside(world in 1usize..17, chunk in 1usize..9000, epoch in 1u64..100) {
            let l = CpuLayout::new(world, chunk);
            let mut regions: Vec<Range<usize>> = Vec::new();
            let mut cells = vec![Cell::Header, Cell::PartialPublished, Cell::FinalPublished];
            for r in 0..world {
                cells.extend([Cell::Input(r), Cell::Partial(r), Cell::Final(r), Cell::RingReduce(r), Cell::RingGather(r)]);
            }
            for c in cells {
                let at = l.cell(epoch, c);
                prop_assert_eq!(at % CELL_BYTES, 0);
                regions.push(at..at + CELL_BYTES);
            }
            for s in 0..l.slots() {
                let slot = l.slot(epoch, s);
                prop_assert_eq!(slot.start % ALIGN, 0);
                prop_assert!(slot.len() >= chunk);
                regions.push(slot);
            }
            regions.sort_by_key(|r| r.start);
            prop_assert!(regions[0].start >= SEGMENT_HEADER_BYTES);
            for pair in regions.windows(2) {
                prop_assert!(pair[0].end <= pair[1].start);
            }
            prop_assert!(regions.last().unwrap().end <= l.total_bytes());
            // Consecutive epochs use different buffers, and epochs two apart the same one.
            prop_assert_ne!(l.cell(epoch, Cell::Header), l.cell(epoch + 1, Cell::Header));
            prop_assert_eq!(l.slot(epoch, 0), l.slot(epoch + BUFFERS as u64, 0));
        }

        #[test]
        fn a_round_and_its_f32_image_fit_a_slot(chunk in 64usize..9000, a in 0usize..9, d in 0usize..3) {
            let l = CpuLayout::new(4, chunk);
            let algorithm = Algorithm::ALL[a];
            let dtype = DType::ALL[d];
            let round = l.round_bytes(algorithm, dtype);
            prop_assert_eq!(round % UNIT_BYTES, 0);
            prop_assert!(round <= l.slot_bytes);
            if carries_f32_partials(algorithm) {
                prop_assert!(f32_image(&(0..round), dtype).end <= l.slot_bytes);
            }
        }
    }
}
