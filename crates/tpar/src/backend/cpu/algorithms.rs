//! One round of each algorithm on the CPU backend, written from a few primitives: raise a
//! flag (a cell of [`super::layout`]) after writing data, wait for a peer's flag, copy into a
//! peer's slot (push) or read from a peer's slot (pull), and sum in a given order
//! ([`super::reduce`]). Each follows its schedule in [`crate::protocol::schedule`]; the module
//! doc there is the definition of what moves in which step and the order of every sum.
//!
//! Calls are checked against each other by their headers: every rank writes its header into
//! its own `Header` cell as a round starts (in the pull forms once its input is published), and
//! the push forms also carry it in the flag of the first data they send. A rank compares the
//! header of every peer before it uses the peer's data; while it waits for a peer it also looks
//! at the peer's `Header` cell, so ranks that called with different arguments (even different
//! algorithms) fail at once, naming both calls. Algorithms in which a rank does not receive
//! from every peer in its first step (staged, islands, ring) first compare every peer's header,
//! which also makes every rank name a silent peer rather than a neighbour stuck behind it.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use super::layout::{f32_image, unit_bytes, Cell, CpuLayout, CPU_WORD};
use super::reduce::{sum, widen, Operand, Target};
use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::islands::Islands;
use crate::protocol::header::{CallHeader, HEADER_LINES};
use crate::protocol::schedule::{
    island_sender, ring_gather_chunk, ring_neighbours, ring_reduce_chunk, share, units_for_bytes,
};
use crate::sys::{current_cpu, SharedSegment};
use crate::wait::{Phase, Watch, SPIN_SHARED};

/// The data of one round: this rank's input (`None`: in place, the input is `out` itself).
pub(super) struct Data<'a> {
    pub dtype: DType,
    pub input: Option<&'a [u8]>,
    pub out: &'a mut [u8],
}

impl Data<'_> {
    /// This rank's input (before anything is written to `out`).
    fn mine(&self) -> &[u8] {
        self.input.unwrap_or(self.out)
    }

    fn elements(&self, bytes: &Range<usize>) -> usize {
        bytes.len() / self.dtype.size()
    }
}

/// This rank's input over `bytes` as an operand of a sum written to `out[bytes]` (in place:
/// what `out` holds there).
fn mine_into_out<'a>(input: Option<&'a [u8]>, bytes: &Range<usize>) -> Operand<'a> {
    match input {
        Some(input) => Operand::Elements(&input[bytes.clone()]),
        None => Operand::Target,
    }
}

/// One round of one call on one rank.
pub(super) struct Round<'a> {
    pub rank: usize,
    pub world_size: usize,
    pub layout: CpuLayout,
    pub islands: &'a Islands,
    pub segments: &'a mut [SharedSegment],
    pub watch: Watch<'a>,
    pub epoch: u64,
    pub header: CallHeader,
    /// Private f32 scratch of one slot.
    pub scratch: &'a mut [u8],
    /// Islands: the exchange in its all-units form (protocol::schedule::islands_all_units).
    pub all_units: bool,
}

/// Peers' segments beside this rank's own, borrowed mutably.
struct Peers<'s> {
    before: &'s [SharedSegment],
    after: &'s [SharedSegment],
    rank: usize,
}

impl Peers<'_> {
    fn get(&self, peer: usize) -> &SharedSegment {
        match peer.cmp(&self.rank) {
            std::cmp::Ordering::Less => &self.before[peer],
            std::cmp::Ordering::Greater => &self.after[peer - self.rank - 1],
            std::cmp::Ordering::Equal => unreachable!("a rank is not its own peer"),
        }
    }
}

/// This rank's segment, writable, beside its peers' (readable).
fn split_own(segments: &mut [SharedSegment], rank: usize) -> (&mut SharedSegment, Peers<'_>) {
    let (before, rest) = segments.split_at_mut(rank);
    let (own, after) = rest.split_first_mut().expect("own segment");
    (
        own,
        Peers {
            before,
            after,
            rank,
        },
    )
}

/// Segment `read` (readable) beside segment `write` (writable); `read != write`.
fn read_and_write(
    segments: &mut [SharedSegment],
    read: usize,
    write: usize,
) -> (&SharedSegment, &mut SharedSegment) {
    assert_ne!(read, write);
    if read < write {
        let (a, b) = segments.split_at_mut(write);
        (&a[read], &mut b[0])
    } else {
        let (a, b) = segments.split_at_mut(read);
        (&b[0], &mut a[write])
    }
}

/// Bytes reduced at a time where the result is sent on at once (a whole number of units).
const PIECE_BYTES: usize = 16 << 10;

/// `out[bytes] = operands[0] + operands[1] + ...`, rounded to `dtype` ([`sum`]).
fn sum_into_out(dtype: DType, out: &mut [u8], bytes: &Range<usize>, operands: &[Operand<'_>]) {
    let count = bytes.len() / dtype.size();
    sum(
        dtype,
        count,
        operands,
        Target::Elements(&mut out[bytes.clone()]),
    );
}

/// The inputs of this rank's island over one range, in rank order: this rank's own `mine`,
/// each other member's from `theirs(member)`.
fn island_inputs<'s>(
    islands: &Islands,
    rank: usize,
    mine: &'s [u8],
    theirs: impl Fn(usize) -> &'s [u8],
) -> Vec<Operand<'s>> {
    islands
        .members(islands.island_of(rank))
        .map(|m| Operand::Elements(if m == rank { mine } else { theirs(m) }))
        .collect()
}

/// The header's 8 words packed into 4 words of 8 bytes after a cell's flag.
const HEADER_WORDS: usize = HEADER_LINES / 2;

impl Round<'_> {
    pub fn run(&mut self, mut data: Data<'_>) -> Result<()> {
        // Where this rank runs, for peers deciding how long to spin for it.
        let cpu = current_cpu().map_or(0, |c| c as u64 + 1);
        let word = self.segments[self.rank].word(CPU_WORD);
        if word.load(Ordering::Relaxed) != cpu {
            word.store(cpu, Ordering::Relaxed);
        }
        if self.world_size == 1 {
            let all = 0..data.out.len();
            let mine = [mine_into_out(data.input, &all)];
            sum_into_out(data.dtype, data.out, &all, &mine);
            return Ok(());
        }
        match self.header.algorithm {
            Algorithm::OneShot => self.one_shot(&mut data),
            Algorithm::OneShotPull => self.one_shot_pull(&mut data),
            Algorithm::TwoShot => self.two_shot(&mut data),
            Algorithm::Staged => self.staged(&mut data),
            Algorithm::StagedPull => self.staged_pull(&mut data),
            Algorithm::Islands => self.islands(&mut data),
            Algorithm::IslandsPull => self.islands_pull(&mut data),
            Algorithm::Ring => self.ring(&mut data),
            Algorithm::HostStaged => unreachable!("refused before the call"),
        }
    }

    // ---- primitives ----------------------------------------------------------------------

    fn phase(&self, step: &'static str) -> Phase {
        Phase {
            step,
            seq: self.header.seq,
            chunk: self.header.chunk,
        }
    }

    fn flag(&self, segment: usize, cell: Cell) -> &AtomicU64 {
        self.segments[segment].word(self.layout.cell(self.epoch, cell))
    }

    /// Raises `cell` in `segment` for this round (after everything written before it), with
    /// this rank's header when `with_header`.
    fn raise(&self, segment: usize, cell: Cell, with_header: bool) {
        let at = self.layout.cell(self.epoch, cell);
        let seg = &self.segments[segment];
        if with_header {
            let words = self.header.encode();
            for i in 0..HEADER_WORDS {
                let packed = u64::from(words[2 * i]) | (u64::from(words[2 * i + 1]) << 32);
                seg.word(at + 8 * (1 + i)).store(packed, Ordering::Relaxed);
            }
        }
        seg.word(at).store(self.epoch, Ordering::Release);
    }

    /// The header in `cell` of `segment`, read after its flag showed this round.
    fn header_in(&self, segment: usize, cell: Cell) -> Option<CallHeader> {
        let at = self.layout.cell(self.epoch, cell);
        let seg = &self.segments[segment];
        let mut words = [0u32; HEADER_LINES];
        for i in 0..HEADER_WORDS {
            let packed = seg.word(at + 8 * (1 + i)).load(Ordering::Relaxed);
            words[2 * i] = packed as u32;
            words[2 * i + 1] = (packed >> 32) as u32;
        }
        CallHeader::decode(&words)
    }

    fn compare(&self, peer: usize, theirs: Option<CallHeader>) -> Result<()> {
        if theirs == Some(self.header) {
            return Ok(());
        }
        Err(Error::CallMismatch {
            seq: self.header.seq,
            rank: self.rank,
            mine: self.header.describe(),
            peer,
            theirs: theirs.map_or_else(
                || "a header this version cannot read (another tpar version?)".to_owned(),
                |h| h.describe(),
            ),
        })
    }

    /// While waiting for `peer`: has it started this round with another call?
    fn peek(&self, peer: usize) -> Result<()> {
        if self.flag(peer, Cell::Header).load(Ordering::Acquire) == self.epoch {
            self.compare(peer, self.header_in(peer, Cell::Header))?;
        }
        Ok(())
    }

    /// Waits until `peer` raised `cell` in `segment` for this round; compares the header it
    /// carries when `with_header`.
    fn wait(
        &self,
        segment: usize,
        cell: Cell,
        peer: usize,
        step: &'static str,
        with_header: bool,
    ) -> Result<()> {
        self.watch.until(
            self.flag(segment, cell),
            self.epoch,
            peer,
            self.phase(step),
            &mut || self.peek(peer),
            &|| self.spin_for(peer),
        )?;
        if with_header {
            self.compare(peer, self.header_in(segment, cell))?;
        }
        Ok(())
    }

    /// How long to spin for `peer` before yielding: briefly when it last ran on this core
    /// (it may be waiting for it), else up to the watch's limit.
    fn spin_for(&self, peer: usize) -> std::time::Duration {
        let theirs = self.segments[peer].word(CPU_WORD).load(Ordering::Relaxed);
        let mine = current_cpu().map_or(0, |c| c as u64 + 1);
        if theirs != 0 && theirs == mine {
            SPIN_SHARED
        } else {
            self.watch.spin
        }
    }

    /// Compares every peer's header (waiting for each to start the round).
    fn check_every_header(&self) -> Result<()> {
        for peer in self.peers() {
            self.wait(peer, Cell::Header, peer, "header exchange", true)?;
        }
        Ok(())
    }

    /// The other ranks, starting after this one (so that ranks do not all start with rank 0).
    fn peers(&self) -> impl Iterator<Item = usize> {
        let (rank, n) = (self.rank, self.world_size);
        (1..n).map(move |step| (rank + step) % n)
    }

    /// Copies `data` into slot `slot` of `segment` at `offset`.
    fn send(&mut self, segment: usize, slot: usize, offset: usize, data: &[u8]) {
        let range = self.layout.slot(self.epoch, slot);
        debug_assert!(offset + data.len() <= range.len());
        self.segments[segment].write(range.start + offset, data);
    }

    /// Copies `data` into slot `slot` of `segment` at `offset`, then raises `cell` there: a
    /// push into a peer's segment, or a publication in this rank's own.
    fn post(
        &mut self,
        segment: usize,
        slot: usize,
        offset: usize,
        data: &[u8],
        cell: Cell,
        with_header: bool,
    ) {
        self.send(segment, slot, offset, data);
        self.raise(segment, cell, with_header);
    }

    /// Waits for `cell` of `segment` (raised by `peer`), then copies `bytes` of slot `slot`
    /// there into the same bytes of `out`.
    #[allow(clippy::too_many_arguments)]
    fn fetch(
        &self,
        out: &mut [u8],
        segment: usize,
        cell: Cell,
        peer: usize,
        step: &'static str,
        slot: usize,
        bytes: &Range<usize>,
    ) -> Result<()> {
        self.wait(segment, cell, peer, step, false)?;
        out[bytes.clone()].copy_from_slice(self.slot(segment, slot, bytes));
        Ok(())
    }

    /// Bytes `bytes` of slot `slot` of `segment`.
    fn slot(&self, segment: usize, slot: usize, bytes: &Range<usize>) -> &[u8] {
        let start = self.layout.slot(self.epoch, slot).start;
        self.segments[segment].bytes(start + bytes.start..start + bytes.end)
    }

    /// Sums every rank's input over `bytes` in rank order into `out[bytes]`: this rank's own
    /// from `data`, the others' from `from(peer)`.
    fn sum_in_rank_order<'s>(
        &'s self,
        data: &mut Data<'_>,
        bytes: &Range<usize>,
        from: impl Fn(&'s Self, usize) -> &'s [u8],
    ) {
        let input = data.input;
        let operands: Vec<Operand> = (0..self.world_size)
            .map(|r| {
                if r == self.rank {
                    mine_into_out(input, bytes)
                } else {
                    Operand::Elements(from(self, r))
                }
            })
            .collect();
        sum_into_out(data.dtype, data.out, bytes, &operands);
    }

    /// The byte range of share `i` of `m` of this round's units.
    fn share_bytes(&self, len: usize, m: usize, i: usize) -> Range<usize> {
        unit_bytes(&share(units_for_bytes(len), m, i), len)
    }

    // ---- the algorithms ------------------------------------------------------------------

    /// one-shot: every rank writes its input into every peer's slot (its own index), then
    /// sums all inputs in rank order.
    fn one_shot(&mut self, data: &mut Data<'_>) -> Result<()> {
        let len = data.out.len();
        self.raise(self.rank, Cell::Header, true);
        for peer in self.peers() {
            self.post(
                peer,
                self.rank,
                0,
                data.mine(),
                Cell::Input(self.rank),
                true,
            );
        }
        for peer in self.peers() {
            self.wait(self.rank, Cell::Input(peer), peer, "one-shot receive", true)?;
        }
        let own = self.rank;
        self.sum_in_rank_order(data, &(0..len), |me, peer| me.slot(own, peer, &(0..len)));
        Ok(())
    }

    /// one-shot-pull: every rank publishes its input in its own slot, then reads every peer's
    /// and sums in rank order.
    fn one_shot_pull(&mut self, data: &mut Data<'_>) -> Result<()> {
        let len = data.out.len();
        self.post(self.rank, 0, 0, data.mine(), Cell::Header, true);
        for peer in self.peers() {
            self.wait(peer, Cell::Header, peer, "one-shot-pull read", true)?;
        }
        self.sum_in_rank_order(data, &(0..len), |me, peer| me.slot(peer, 0, &(0..len)));
        Ok(())
    }

    /// two-shot: reduce-scatter (each rank writes share q of its input to owner q, which sums
    /// its share in rank order) then all-gather (each owner writes its rounded share into every
    /// peer's gather slot).
    fn two_shot(&mut self, data: &mut Data<'_>) -> Result<()> {
        let (n, rank, len) = (self.world_size, self.rank, data.out.len());
        let gather = n;
        self.raise(rank, Cell::Header, true);
        for owner in self.peers() {
            let part = self.share_bytes(len, n, owner);
            self.post(
                owner,
                rank,
                part.start,
                &data.mine()[part],
                Cell::Input(rank),
                true,
            );
        }
        for peer in self.peers() {
            self.wait(
                rank,
                Cell::Input(peer),
                peer,
                "two-shot reduce-scatter",
                true,
            )?;
        }
        // The owned share a piece at a time, each piece sent on while it is still in L1.
        let mine = self.share_bytes(len, n, rank);
        let mut at = mine.start;
        while at < mine.end {
            let piece = at..(at + PIECE_BYTES).min(mine.end);
            self.sum_in_rank_order(data, &piece, |me, peer| me.slot(rank, peer, &piece));
            for peer in self.peers() {
                self.send(peer, gather, piece.start, &data.out[piece.clone()]);
            }
            at = piece.end;
        }
        for peer in self.peers() {
            self.raise(peer, Cell::Final(rank), false);
        }
        for owner in self.peers() {
            let part = self.share_bytes(len, n, owner);
            let step = "two-shot all-gather";
            self.fetch(
                data.out,
                rank,
                Cell::Final(owner),
                owner,
                step,
                gather,
                &part,
            )?;
        }
        Ok(())
    }

    /// staged: in step s this rank writes its input to rank r+s and waits for rank r-s's
    /// before its next write; then sums in rank order.
    fn staged(&mut self, data: &mut Data<'_>) -> Result<()> {
        let (n, rank, len) = (self.world_size, self.rank, data.out.len());
        self.raise(rank, Cell::Header, true);
        self.check_every_header()?;
        for s in 1..n {
            let (to, from) = ((rank + s) % n, (rank + n - s) % n);
            self.post(to, rank, 0, data.mine(), Cell::Input(rank), true);
            self.wait(rank, Cell::Input(from), from, "staged receive", true)?;
        }
        self.sum_in_rank_order(data, &(0..len), |me, peer| me.slot(rank, peer, &(0..len)));
        Ok(())
    }

    /// staged-pull: every rank publishes its input; in step s this rank waits for rank r-s's.
    /// The sum then reads the published inputs in rank order.
    fn staged_pull(&mut self, data: &mut Data<'_>) -> Result<()> {
        let (n, rank, len) = (self.world_size, self.rank, data.out.len());
        self.post(rank, 0, 0, data.mine(), Cell::Header, true);
        for s in 1..n {
            let from = (rank + n - s) % n;
            self.wait(from, Cell::Header, from, "staged-pull read", true)?;
        }
        self.sum_in_rank_order(data, &(0..len), |me, peer| me.slot(peer, 0, &(0..len)));
        Ok(())
    }

    /// The unit ranges over which this rank needs its island's partial: its own range (as a
    /// receiver in step 2) and every range it sends to another island's member. Sorted and
    /// merged, so each unit is summed once.
    fn partial_ranges(&self, units: usize) -> Vec<Range<usize>> {
        if self.all_units {
            return vec![Range {
                start: 0,
                end: units,
            }];
        }
        let islands = self.islands;
        let island = islands.island_of(self.rank);
        let size = islands.size(island);
        let position = islands.position(self.rank);
        let mut ranges = vec![share(units, size, position)];
        for other in (0..islands.count()).filter(|&i| i != island) {
            for member in islands.members(other) {
                if island_sender(islands, island, member) == self.rank {
                    let m = islands.size(other);
                    ranges.push(share(units, m, islands.position(member)));
                }
            }
        }
        ranges.retain(|r| !r.is_empty());
        ranges.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<usize>> = Vec::new();
        for r in ranges {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        merged
    }

    /// For each island in order, the rank whose partial of it this rank sums in step 2 of
    /// the islands algorithms: this rank itself for its own island.
    fn partial_senders(&self) -> Vec<usize> {
        let own = self.islands.island_of(self.rank);
        (0..self.islands.count())
            .map(|i| {
                if i == own {
                    self.rank
                } else {
                    island_sender(self.islands, i, self.rank)
                }
            })
            .collect()
    }

    /// This rank's range of the round (bytes) in its island: share `position` of `size` (the
    /// whole round in the all-units form).
    fn island_range(&self, rank: usize, len: usize) -> Range<usize> {
        if self.all_units {
            return 0..len;
        }
        let island = self.islands.island_of(rank);
        self.share_bytes(len, self.islands.size(island), self.islands.position(rank))
    }

    /// islands: (1) each rank writes its input to every member of its island, and each member
    /// sums its island's inputs in rank order into the island partial (f32); (2) every other
    /// island's partial over this rank's range arrives from that island's sender, and this
    /// rank sums the partials in island order and rounds; (3) each member writes its rounded
    /// range to every member of its island. In the all-units form a rank's range is the whole
    /// round and there is no step 3.
    fn islands(&mut self, data: &mut Data<'_>) -> Result<()> {
        let (n, rank, len, dtype) = (self.world_size, self.rank, data.out.len(), data.dtype);
        let islands = *self.islands;
        let island = islands.island_of(rank);
        let members: Vec<usize> = islands.members(island).filter(|&m| m != rank).collect();
        let gather = n;
        self.raise(rank, Cell::Header, true);
        self.check_every_header()?;

        // 1. Inside the island.
        for &m in &members {
            self.post(m, rank, 0, data.mine(), Cell::Input(rank), false);
        }
        for &m in &members {
            self.wait(rank, Cell::Input(m), m, "islands: island inputs", false)?;
        }
        let units = units_for_bytes(len);
        for range in self.partial_ranges(units) {
            let bytes = unit_bytes(&range, len);
            let (layout, epoch) = (self.layout, self.epoch);
            let own = &self.segments[rank];
            let operands = island_inputs(&islands, rank, &data.mine()[bytes.clone()], |m| {
                let at = layout.slot(epoch, m).start;
                own.bytes(at + bytes.start..at + bytes.end)
            });
            let target = Target::Partials(&mut self.scratch[f32_image(&bytes, dtype)]);
            sum(dtype, bytes.len() / dtype.size(), &operands, target);
        }

        // 2. Across islands: send this island's partial to the members this rank serves,
        // then sum every island's partial over this rank's range in island order.
        for other in (0..islands.count()).filter(|&i| i != island) {
            for member in islands.members(other) {
                if island_sender(&islands, island, member) == rank {
                    let image = f32_image(&self.island_range(member, len), dtype);
                    let at = self.layout.slot(self.epoch, rank).start + image.start;
                    self.segments[member].write(at, &self.scratch[image]);
                    self.raise(member, Cell::Partial(rank), false);
                }
            }
        }
        let mine = self.island_range(rank, len);
        let image = f32_image(&mine, dtype);
        let senders = self.partial_senders();
        for &sender in senders.iter().filter(|&&s| s != rank) {
            self.wait(
                rank,
                Cell::Partial(sender),
                sender,
                "islands: partials",
                false,
            )?;
        }
        let operands: Vec<Operand> = senders
            .iter()
            .map(|&s| {
                if s == rank {
                    Operand::Partials(&self.scratch[image.clone()])
                } else {
                    Operand::Partials(self.slot(rank, s, &image))
                }
            })
            .collect();
        sum_into_out(dtype, data.out, &mine, &operands);
        if self.all_units {
            // Every rank summed every unit: no third step.
            return Ok(());
        }

        // 3. Inside the island again: every member's rounded range.
        for &m in &members {
            let rounded = &data.out[mine.clone()];
            self.post(m, gather, mine.start, rounded, Cell::Final(rank), false);
        }
        for &m in &members {
            let part = self.island_range(m, len);
            let step = "islands: island finals";
            self.fetch(data.out, rank, Cell::Final(m), m, step, gather, &part)?;
        }
        Ok(())
    }

    /// islands-pull: the same three steps, each read instead of written. Every rank publishes
    /// its input (slot 0), its island's partial (slot 1, f32) and its rounded range (the
    /// gather slot).
    fn islands_pull(&mut self, data: &mut Data<'_>) -> Result<()> {
        let (n, rank, len, dtype) = (self.world_size, self.rank, data.out.len(), data.dtype);
        let islands = *self.islands;
        let island = islands.island_of(rank);
        let members: Vec<usize> = islands.members(island).filter(|&m| m != rank).collect();
        let (input_slot, partial_slot, final_slot) = (0, 1, n);
        self.post(rank, input_slot, 0, data.mine(), Cell::Header, true);
        // Every header is compared; the island's inputs are among them.
        self.check_every_header()?;

        // 1. Read the island's inputs; publish the island partial where this rank needs it.
        let units = units_for_bytes(len);
        let partial_start = self.layout.slot(self.epoch, partial_slot).start;
        for range in self.partial_ranges(units) {
            let bytes = unit_bytes(&range, len);
            let image = f32_image(&bytes, dtype);
            let input_start = self.layout.slot(self.epoch, input_slot).start;
            let (own, peers) = split_own(&mut *self.segments, rank);
            let operands = island_inputs(&islands, rank, &data.mine()[bytes.clone()], |m| {
                peers
                    .get(m)
                    .bytes(input_start + bytes.start..input_start + bytes.end)
            });
            let target = own.bytes_mut(partial_start + image.start..partial_start + image.end);
            sum(
                dtype,
                bytes.len() / dtype.size(),
                &operands,
                Target::Partials(target),
            );
        }
        self.raise(rank, Cell::PartialPublished, false);

        // 2. Read every other island's partial over this rank's range; sum in island order.
        let mine = self.island_range(rank, len);
        let image = f32_image(&mine, dtype);
        let senders = self.partial_senders();
        for &sender in senders.iter().filter(|&&s| s != rank) {
            let step = "islands-pull: partials";
            self.wait(sender, Cell::PartialPublished, sender, step, false)?;
        }
        let operands: Vec<Operand> = senders
            .iter()
            .map(|&s| Operand::Partials(self.slot(s, partial_slot, &image)))
            .collect();
        sum_into_out(dtype, data.out, &mine, &operands);
        let rounded = &data.out[mine.clone()];
        self.post(
            rank,
            final_slot,
            mine.start,
            rounded,
            Cell::FinalPublished,
            false,
        );

        // 3. Read the island's rounded ranges.
        for &m in &members {
            let part = self.island_range(m, len);
            let step = "islands-pull: island finals";
            self.fetch(
                data.out,
                m,
                Cell::FinalPublished,
                m,
                step,
                final_slot,
                &part,
            )?;
        }
        Ok(())
    }

    /// ring: reduce-scatter in n-1 steps (this rank adds its input to the f32 partial from its
    /// left neighbour and passes it right; chunk c is finished, and rounded, at rank c), then
    /// all-gather in n-1 steps (the rounded chunks travel right).
    fn ring(&mut self, data: &mut Data<'_>) -> Result<()> {
        let (n, rank, len, dtype) = (self.world_size, self.rank, data.out.len(), data.dtype);
        let (left, right) = ring_neighbours(rank, n);
        let (reduce_slot, gather_slot) = (0, 1);
        const GATHER: &str = "ring all-gather";
        let chunk = |c: usize| self.share_bytes(len, n, c);
        let chunks: Vec<Range<usize>> = (0..n).map(chunk).collect();
        self.raise(rank, Cell::Header, true);
        self.check_every_header()?;

        let reduce_start = self.layout.slot(self.epoch, reduce_slot).start;
        for s in 0..n - 1 {
            let c = ring_reduce_chunk(rank, n, s);
            let bytes = &chunks[c];
            let image = f32_image(bytes, dtype);
            let count = data.elements(bytes);
            let at = reduce_start + image.start..reduce_start + image.end;
            if s == 0 {
                let target = self.segments[right].bytes_mut(at);
                widen(dtype, count, &data.mine()[bytes.clone()], target);
            } else {
                self.wait(
                    rank,
                    Cell::RingReduce(s - 1),
                    left,
                    "ring reduce-scatter",
                    false,
                )?;
                let (own, next) = read_and_write(&mut *self.segments, rank, right);
                let operands = [
                    Operand::Partials(own.bytes(at.clone())),
                    Operand::Elements(&data.mine()[bytes.clone()]),
                ];
                sum(
                    dtype,
                    count,
                    &operands,
                    Target::Partials(next.bytes_mut(at)),
                );
            }
            self.raise(right, Cell::RingReduce(s), false);
        }
        // The last partial to arrive is of this rank's own chunk: finish and round it.
        self.wait(
            rank,
            Cell::RingReduce(n - 2),
            left,
            "ring reduce-scatter",
            false,
        )?;
        let own_chunk = chunks[rank].clone();
        let image = f32_image(&own_chunk, dtype);
        let received = self.slot(rank, reduce_slot, &image);
        let operands = [
            Operand::Partials(received),
            mine_into_out(data.input, &own_chunk),
        ];
        sum_into_out(dtype, data.out, &own_chunk, &operands);

        for s in 0..n - 1 {
            let c = ring_gather_chunk(rank, n, s);
            let bytes = chunks[c].clone();
            if s > 0 {
                let cell = Cell::RingGather(s - 1);
                self.fetch(data.out, rank, cell, left, GATHER, gather_slot, &bytes)?;
            }
            let rounded = &data.out[bytes.clone()];
            self.post(
                right,
                gather_slot,
                bytes.start,
                rounded,
                Cell::RingGather(s),
                false,
            );
        }
        let last = chunks[(rank + 1) % n].clone();
        let cell = Cell::RingGather(n - 2);
        self.fetch(data.out, rank, cell, left, GATHER, gather_slot, &last)?;
        Ok(())
    }
}
