//! FNV-1a, the one short stable hash tpar uses for names derived from content: kernel cache
//! files, tuning-table fingerprints, job stamps in shared memory, subgroup namespaces. Not for
//! security: nothing depends on it being hard to collide on purpose.

/// FNV-1a (64-bit) of `bytes`.
pub fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// FNV-1a of several texts, each ended by a zero byte (so that moving text from one to the
/// next changes the hash).
pub fn fnv1a_texts<'a>(texts: impl IntoIterator<Item = &'a str>) -> u64 {
    fnv1a(texts.into_iter().flat_map(|t| t.bytes().chain([0u8])))
}

#[cfg(test)]
mod tests {
    #[test]
    fn matches_the_published_fnv1a_values() {
        // Test vectors of the FNV reference (64-bit FNV-1a).
        assert_eq!(super::fnv1a(*b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(super::fnv1a(*b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(super::fnv1a(*b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn texts_are_separated() {
        assert_eq!(super::fnv1a_texts(["foobar"]), super::fnv1a(*b"foobar\0"));
        assert_ne!(
            super::fnv1a_texts(["foo", "bar"]),
            super::fnv1a_texts(["fo", "obar"])
        );
    }
}
