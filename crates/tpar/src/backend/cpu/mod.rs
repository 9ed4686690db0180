//! The CPU backend: the push protocol over POSIX shared memory between the processes (or
//! threads) of one host.
//!
//! Each rank owns one inbox segment (layout in [`crate::protocol::layout`]) that its peers map
//! and write into with 8-byte LL stores; a rank only ever reads its own inbox. Segments are
//! created 0600 under a name that carries the job token, stamped with a hash of the token,
//! and unlinked as soon as every rank has mapped every segment, so nothing stays in /dev/shm
//! even if a rank is killed later.

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::algorithm::Algorithm;
use crate::config::Config;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::memory::MemoryFootprint;
use crate::protocol::header::{CallHeader, HEADER_LINES};
use crate::protocol::layout::{chunks, owned_lines, InboxLayout, SEGMENT_HEADER_LINES};
use crate::protocol::line::{lines_for_bytes, pack, put_word, word_at, Tag};
use crate::protocol::reduce::Accumulator;
use crate::rendezvous::Rendezvous;
use crate::sys::{liveness, Liveness, SharedSegment};
pub use crate::wait::InterruptCheck;
use crate::wait::{Phase, Watch};

/// Lines of a reduction block: large enough to stream, small enough to stay in L1/L2.
const BLOCK_LINES: usize = 1024;

const SEGMENT_MAGIC: u64 = 0x7470_6172_5f73_686d; // "tpar_shm"
const SEGMENT_VERSION: u64 = 1;

pub use crate::rendezvous::segment_prefix;

/// FNV-1a: stamps a segment with its job without writing the token itself into it.
fn token_hash(token: &str) -> u64 {
    crate::hash::fnv1a(token.bytes())
}

#[derive(Serialize, Deserialize)]
struct InboxRecord {
    segment: String,
    pid: u32,
    payload_lines: usize,
}

/// One rank's endpoint of a CPU allreduce group.
pub struct CpuCommunicator {
    rank: usize,
    world_size: usize,
    layout: InboxLayout,
    /// Every rank's inbox, indexed by rank; `inboxes[rank]` is this rank's own.
    inboxes: Vec<SharedSegment>,
    /// Peers' process ids where this process can see them (same pid namespace).
    peer_pids: Vec<Option<u32>>,
    timeout: Duration,
    /// Epoch of the last chunk sent; the next chunk uses `epoch + 1`.
    epoch: u64,
    seq: u32,
    /// Set by the first failed call: the ranks' epochs may no longer agree.
    poisoned: Option<String>,
    /// Asked while a wait is slow; true interrupts the call (and poisons the communicator).
    interrupt: Option<std::sync::Arc<InterruptCheck>>,
}

impl CpuCommunicator {
    /// The algorithms this backend runs.
    pub const ALGORITHMS: [Algorithm; 2] = [Algorithm::OneShot, Algorithm::TwoShot];

    /// Joins the ranks of `rendezvous` in a new communicator. Every rank must call this, in
    /// the same order relative to its other communicators, with the same `config`.
    pub fn new(rendezvous: &Rendezvous, config: Config) -> Result<CpuCommunicator> {
        // Taken before anything can fail on one rank alone, so that every rank's count of
        // communicators stays the same after a failed creation.
        let instance = rendezvous.next_instance();
        let chunk_bytes = config.cpu_chunk_bytes();
        if chunk_bytes < Config::MIN_CHUNK_BYTES {
            return Err(Error::InvalidArgument(format!(
                "chunk size {chunk_bytes} B is too small; use at least {} B",
                Config::MIN_CHUNK_BYTES
            )));
        }
        let rank = rendezvous.rank();
        let world_size = rendezvous.world_size();
        let layout = InboxLayout::new(world_size, chunk_bytes);
        let token_stamp = token_hash(rendezvous.token());

        let name = rendezvous.shm_name(&format!("{instance}-r{rank}"));
        let own = SharedSegment::create(&name, layout.total_bytes())?;
        let header = [
            SEGMENT_MAGIC,
            SEGMENT_VERSION,
            token_stamp,
            rank as u64,
            world_size as u64,
            layout.payload_lines as u64,
        ];
        for (line, value) in own.lines().iter().zip(header) {
            line.store(value, Ordering::Release);
        }

        let key = format!("cpu-{instance}");
        rendezvous.publish(
            &format!("{key}-inbox"),
            &InboxRecord {
                segment: name,
                pid: std::process::id(),
                payload_lines: layout.payload_lines,
            },
        )?;
        let records: Vec<InboxRecord> =
            rendezvous.gather(&format!("{key}-inbox"), config.timeout)?;

        let mut inboxes = Vec::with_capacity(world_size);
        let mut own = Some(own);
        for (peer, record) in records.iter().enumerate() {
            if record.payload_lines != layout.payload_lines {
                return Err(Error::InvalidArgument(format!(
                    "rank {peer} uses chunks of {} B, this rank (rank {rank}) {} B; every rank must use the same Config::chunk_bytes",
                    record.payload_lines * 4,
                    layout.payload_lines * 4
                )));
            }
            let segment = if peer == rank {
                own.take().expect("own segment")
            } else {
                SharedSegment::open(&record.segment)?
            };
            let stamp: Vec<u64> = segment.lines()[..header.len()]
                .iter()
                .map(|l| l.load(Ordering::Acquire))
                .collect();
            let expected = [
                SEGMENT_MAGIC,
                SEGMENT_VERSION,
                token_stamp,
                peer as u64,
                world_size as u64,
                layout.payload_lines as u64,
            ];
            if stamp[..3] != expected[..3] {
                return Err(Error::ForeignJob {
                    what: format!(
                        "shared memory {} presented as rank {peer}'s inbox",
                        record.segment
                    ),
                });
            }
            if stamp != expected || segment.len_bytes() < layout.total_bytes() {
                return Err(Error::InvalidArgument(format!(
                    "rank {peer}'s inbox {} does not match this job's layout",
                    record.segment
                )));
            }
            inboxes.push(segment);
        }
        // Everyone has mapped everyone: the names can go, the mappings stay.
        rendezvous.barrier(&format!("{key}-mapped"), config.timeout)?;
        inboxes[rank].unlink();

        let peer_pids = records
            .iter()
            .map(|r| (liveness(r.pid) == Liveness::Alive).then_some(r.pid))
            .collect();
        debug_assert!(SEGMENT_HEADER_LINES >= header.len());
        Ok(CpuCommunicator {
            rank,
            world_size,
            layout,
            inboxes,
            peer_pids,
            timeout: config.timeout,
            epoch: 0,
            seq: 0,
            poisoned: None,
            interrupt: None,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Changes the per-wait deadline (all ranks should use the same).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Memory this communicator holds: its own inbox, and its peers' inboxes mapped.
    pub fn memory_footprint(&self) -> MemoryFootprint {
        let own = self.inboxes[self.rank].len_bytes() as u64;
        let all: u64 = self.inboxes.iter().map(|s| s.len_bytes() as u64).sum();
        MemoryFootprint {
            shared_host_bytes: own,
            peer_mapped_bytes: all - own,
            ..MemoryFootprint::default()
        }
    }

    /// `output[i] = sum over ranks of input[i]`, identical on every rank.
    pub fn all_reduce<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        algorithm: Algorithm,
    ) -> Result<()> {
        if input.len() != output.len() {
            return Err(Error::InvalidArgument(format!(
                "input has {} elements but output has {}; they must be equal",
                input.len(),
                output.len()
            )));
        }
        self.all_reduce_bytes(
            T::DTYPE,
            Some(bytemuck::cast_slice(input)),
            bytemuck::cast_slice_mut(output),
            algorithm,
        )
    }

    /// `data[i] = sum over ranks of data[i]`, identical on every rank.
    pub fn all_reduce_in_place<T: Element>(
        &mut self,
        data: &mut [T],
        algorithm: Algorithm,
    ) -> Result<()> {
        self.all_reduce_bytes(T::DTYPE, None, bytemuck::cast_slice_mut(data), algorithm)
    }

    /// The untyped form: `input` (or `output` itself when `None`) holds little-endian elements
    /// of `dtype`. After any error the communicator refuses further calls.
    pub fn all_reduce_bytes(
        &mut self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
        algorithm: Algorithm,
    ) -> Result<()> {
        if let Some(why) = &self.poisoned {
            return Err(Error::Poisoned(why.clone()));
        }
        if output.len() % dtype.size() != 0 || input.is_some_and(|i| i.len() != output.len()) {
            return Err(Error::InvalidArgument(format!(
                "buffers of {} and {} bytes do not hold the same whole number of {dtype} elements",
                input.map_or(output.len(), <[u8]>::len),
                output.len()
            )));
        }
        if !matches!(algorithm, Algorithm::OneShot | Algorithm::TwoShot) {
            return Err(Error::Unsupported(format!(
                "the CPU backend runs one-shot and two-shot; {algorithm} is a GPU algorithm"
            )));
        }
        let result = self.run_call(dtype, input, output, algorithm);
        if let Err(e) = &result {
            self.poisoned = Some(e.to_string());
        }
        result
    }

    fn run_call(
        &mut self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
        algorithm: Algorithm,
    ) -> Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let count = output.len() / dtype.size();
        let mut acc = Accumulator::new(dtype);
        for (index, elements) in chunks(count, self.layout.chunk_elements(dtype)).enumerate() {
            self.epoch += 1;
            let header = CallHeader {
                seq: self.seq,
                count: count as u64,
                dtype,
                algorithm,
                chunk: index as u32,
            };
            let bytes = elements.start * dtype.size()..elements.end * dtype.size();
            // Stage one reads the input; nothing is written to `output` before it is done,
            // which is what makes in-place calls safe.
            let source = match input {
                Some(input) => &input[bytes.clone()],
                None => &output[bytes.clone()],
            };
            self.push_stage_one(&header, source);
            self.check_headers(&header)?;
            let out = &mut output[bytes];
            if algorithm == Algorithm::TwoShot {
                self.reduce_owned_and_push(&mut acc, &header, out.len())?;
                self.gather(&header, out)?;
            } else {
                self.reduce_all(&mut acc, &header, out)?;
            }
        }
        Ok(())
    }

    /// Starts the epoch counter elsewhere, to test tag wrap-around.
    #[cfg(test)]
    pub(crate) fn set_epoch_for_test(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    fn tag(&self) -> Tag {
        Tag::for_epoch(self.epoch)
    }

    fn watch(&self) -> Watch<'_> {
        Watch {
            timeout: self.timeout,
            peer_pids: &self.peer_pids,
            interrupted: self.interrupt.as_deref(),
        }
    }

    /// A check asked every ~50 ms while a call waits for a peer: when it says true the call
    /// fails with [`Error::Interrupted`] and the communicator is unusable afterwards (the
    /// ranks' epochs no longer agree). The Python package stops on Ctrl-C this way.
    pub fn set_interrupt(&mut self, check: Option<std::sync::Arc<InterruptCheck>>) {
        self.interrupt = check;
    }

    /// Writes the header and this rank's payload into every peer's stage-one slot: all lines
    /// for one-shot, the receiver's owned lines for two-shot.
    fn push_stage_one(&self, header: &CallHeader, source: &[u8]) {
        let tag = self.tag();
        let lines = lines_for_bytes(source.len());
        let header_words = header.encode();
        // Start with the next rank so that ranks do not all write to rank 0 first.
        for step in 0..self.world_size {
            let peer = (self.rank + 1 + step) % self.world_size;
            let inbox = self.inboxes[peer].lines();
            let slot = self.layout.stage_one_slot(self.epoch, self.rank);
            let payload = self.layout.stage_one_payload(self.epoch, self.rank);
            let range = if header.algorithm == Algorithm::TwoShot {
                owned_lines(lines, self.world_size, peer)
            } else {
                0..lines
            };
            let first = range.start;
            for (k, line) in inbox[payload + range.start..payload + range.end]
                .iter()
                .enumerate()
            {
                line.store(pack(tag, word_at(source, first + k)), Ordering::Release);
            }
            // The header goes last: a receiver that sees it will find the payload arriving
            // (it still checks each line's tag; this only shortens its wait).
            for (i, word) in header_words.iter().enumerate() {
                inbox[slot + i].store(pack(tag, *word), Ordering::Release);
            }
        }
    }

    /// Compares every peer's header with this rank's own.
    fn check_headers(&self, mine: &CallHeader) -> Result<()> {
        let tag = self.tag();
        let inbox = self.inboxes[self.rank].lines();
        let phase = self.phase("header exchange", mine);
        let watch = self.watch();
        for peer in 0..self.world_size {
            let slot = self.layout.stage_one_slot(self.epoch, peer);
            let mut words = [0u32; HEADER_LINES];
            for (i, word) in words.iter_mut().enumerate() {
                *word = watch.word(&inbox[slot + i], tag, peer, phase)?;
            }
            let theirs = CallHeader::decode(&words);
            if theirs != Some(*mine) {
                return Err(Error::CallMismatch {
                    seq: mine.seq,
                    rank: self.rank,
                    mine: mine.describe(),
                    peer,
                    theirs: theirs.map_or_else(
                        || "a header this version cannot read (another tpar version?)".to_owned(),
                        |h| h.describe(),
                    ),
                });
            }
        }
        Ok(())
    }

    fn phase(&self, step: &'static str, header: &CallHeader) -> Phase {
        Phase {
            step,
            seq: header.seq,
            chunk: header.chunk,
        }
    }

    /// Adds `lines` of every rank's stage-one payload (in rank order) into the accumulator,
    /// one block at a time, handing each block to `emit(first_line, accumulator)`.
    fn accumulate(
        &self,
        acc: &mut Accumulator,
        header: &CallHeader,
        lines: std::ops::Range<usize>,
        step: &'static str,
        mut emit: impl FnMut(usize, &Accumulator),
    ) -> Result<()> {
        let tag = self.tag();
        let phase = self.phase(step, header);
        let watch = self.watch();
        let inbox = self.inboxes[self.rank].lines();
        let mut words = [0u32; BLOCK_LINES];
        let mut start = lines.start;
        while start < lines.end {
            let end = (start + BLOCK_LINES).min(lines.end);
            let block = &mut words[..end - start];
            acc.reset(end - start);
            for peer in 0..self.world_size {
                let payload = self.layout.stage_one_payload(self.epoch, peer) + start;
                for (word, line) in block.iter_mut().zip(&inbox[payload..]) {
                    *word = watch.word(line, tag, peer, phase)?;
                }
                acc.add_words(0, block, peer == 0);
            }
            emit(start, acc);
            start = end;
        }
        Ok(())
    }

    /// One-shot: reduce every line from every rank's stage-one slot into `out`.
    fn reduce_all(&self, acc: &mut Accumulator, header: &CallHeader, out: &mut [u8]) -> Result<()> {
        let count = out.len() / header.dtype.size();
        let per_word = 4 / header.dtype.size();
        self.accumulate(
            acc,
            header,
            0..lines_for_bytes(out.len()),
            "one-shot receive",
            |first_line, acc| {
                let first = first_line * per_word;
                acc.store(out, first, acc.sums().len().min(count - first));
            },
        )
    }

    /// Two-shot, reduce-scatter half: reduce the lines this rank owns and push the result into
    /// every rank's gather slot at the same offsets.
    fn reduce_owned_and_push(
        &self,
        acc: &mut Accumulator,
        header: &CallHeader,
        chunk_bytes: usize,
    ) -> Result<()> {
        let owned = owned_lines(lines_for_bytes(chunk_bytes), self.world_size, self.rank);
        let tag = self.tag();
        let gather = self.layout.gather_slot(self.epoch);
        // Each block is rounded to the dtype once, then pushed to every rank.
        let mut lines = Vec::with_capacity(BLOCK_LINES);
        self.accumulate(
            acc,
            header,
            owned,
            "two-shot reduce-scatter",
            |first_line, acc| {
                lines.clear();
                lines.extend((0..acc.words()).map(|w| pack(tag, acc.word(w))));
                for step in 0..self.world_size {
                    let inbox = self.inboxes[(self.rank + 1 + step) % self.world_size].lines();
                    for (slot, line) in inbox[gather + first_line..].iter().zip(&lines) {
                        slot.store(*line, Ordering::Release);
                    }
                }
            },
        )
    }

    /// Two-shot, all-gather half: copy every owner's reduced lines from the gather slot.
    fn gather(&self, header: &CallHeader, out: &mut [u8]) -> Result<()> {
        let tag = self.tag();
        let phase = self.phase("two-shot all-gather", header);
        let watch = self.watch();
        let inbox = self.inboxes[self.rank].lines();
        let gather = self.layout.gather_slot(self.epoch);
        let lines = lines_for_bytes(out.len());
        for owner in 0..self.world_size {
            for i in owned_lines(lines, self.world_size, owner) {
                let word = watch.word(&inbox[gather + i], tag, owner, phase)?;
                put_word(out, i, word);
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for CpuCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuCommunicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("layout", &self.layout)
            .field("epoch", &self.epoch)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

#[cfg(test)]
mod tests;
