//! The LL ("low latency", after NCCL's protocol of that name) line: 4 bytes of payload and a
//! 4-byte tag written together in one 8-byte store. A reader that sees the current tag in a line
//! has that line's data, whatever order the stores reach memory in, so no flag has to follow
//! the data (a flag written after the data may overtake it on PCIe).
//!
//! Line layout (little-endian u64): bits 0..32 payload word, bits 32..64 tag.

/// Bytes of payload carried by one line.
pub const PAYLOAD_BYTES: usize = 4;
/// Bytes one line takes in memory.
pub const LINE_BYTES: usize = 8;

/// The tag of one epoch. Never zero, so freshly zeroed memory never looks like data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tag(u32);

impl Tag {
    /// The tag lines of `epoch` carry. Epochs count from 1 and never wrap (u64); tags cycle
    /// through 1..=u32::MAX, so the tags of two epochs fewer than 2^32-1 apart always differ:
    /// a stale line left in a rotating buffer from an earlier epoch never matches.
    pub fn for_epoch(epoch: u64) -> Tag {
        debug_assert!(epoch >= 1, "epochs start at 1");
        Tag(((epoch.wrapping_sub(1)) % u64::from(u32::MAX)) as u32 + 1)
    }

    pub fn raw(self) -> u32 {
        self.0
    }
}

/// One line holding `word` tagged with `tag`.
#[inline]
pub fn pack(tag: Tag, word: u32) -> u64 {
    (u64::from(tag.0) << 32) | u64::from(word)
}

/// The payload word of `line` if it carries `tag`, otherwise `None` (not arrived yet).
#[inline]
pub fn word_if_tagged(line: u64, tag: Tag) -> Option<u32> {
    ((line >> 32) as u32 == tag.0).then_some(line as u32)
}

/// Payload word `index` of `bytes`: 4 little-endian bytes, zero-padded past the end.
#[inline]
pub fn word_at(bytes: &[u8], index: usize) -> u32 {
    let start = index * PAYLOAD_BYTES;
    if let Some(full) = bytes.get(start..start + PAYLOAD_BYTES) {
        return u32::from_le_bytes(full.try_into().expect("4 bytes"));
    }
    let end = (start + PAYLOAD_BYTES).min(bytes.len());
    let mut word = [0u8; PAYLOAD_BYTES];
    word[..end - start].copy_from_slice(&bytes[start..end]);
    u32::from_le_bytes(word)
}

/// Writes payload word `index` into `bytes`, dropping the padding past the end.
#[inline]
pub fn put_word(bytes: &mut [u8], index: usize, word: u32) {
    let start = index * PAYLOAD_BYTES;
    if let Some(full) = bytes.get_mut(start..start + PAYLOAD_BYTES) {
        full.copy_from_slice(&word.to_le_bytes());
        return;
    }
    let end = (start + PAYLOAD_BYTES).min(bytes.len());
    bytes[start..end].copy_from_slice(&word.to_le_bytes()[..end - start]);
}

/// Lines needed for `bytes` of payload.
pub fn lines_for_bytes(bytes: usize) -> usize {
    bytes.div_ceil(PAYLOAD_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tags_skip_zero_at_wrap_around() {
        let period = u64::from(u32::MAX);
        assert_eq!(Tag::for_epoch(1).raw(), 1);
        assert_eq!(Tag::for_epoch(period).raw(), u32::MAX);
        assert_eq!(Tag::for_epoch(period + 1).raw(), 1);
        for epoch in (period - 5)..(period + 5) {
            assert_ne!(Tag::for_epoch(epoch).raw(), 0);
        }
    }

    proptest! {
        #[test]
        fn tag_never_zero_and_differs_from_recent_epochs(epoch in 4u64..u64::MAX - 4, back in 1u64..4) {
            let tag = Tag::for_epoch(epoch);
            prop_assert_ne!(tag.raw(), 0);
            // Buffers rotate every few epochs: the epochs sharing a buffer must have other tags.
            prop_assert_ne!(tag, Tag::for_epoch(epoch - back));
        }

        #[test]
        fn a_line_yields_its_word_only_under_its_tag(epoch in 1u64..u64::MAX, word: u32) {
            let tag = Tag::for_epoch(epoch);
            let line = pack(tag, word);
            prop_assert_eq!(word_if_tagged(line, tag), Some(word));
            prop_assert_eq!(word_if_tagged(line, Tag::for_epoch(epoch.wrapping_add(1).max(1))), None);
            prop_assert_eq!(word_if_tagged(0, tag), None);
        }

        #[test]
        fn words_round_trip_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let lines = lines_for_bytes(bytes.len());
            let mut back = vec![0u8; bytes.len()];
            for i in 0..lines {
                put_word(&mut back, i, word_at(&bytes, i));
            }
            prop_assert_eq!(back, bytes);
        }
    }
}
