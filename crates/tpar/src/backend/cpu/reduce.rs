//! The CPU backend's reduction: sums operands element by element in f32, in the order given,
//! and writes the result rounded once to the dtype (or as f32 partials for another rank to
//! continue). Each rank or owner evaluates exactly the expression its algorithm's schedule
//! ([`crate::protocol::schedule`]) defines, so results are bitwise identical across ranks.
//!
//! Work goes a block at a time through an f32 accumulator that stays in L1: load the first
//! operand, add each other one, store. The loops are plain element loops over slices that the
//! compiler vectorises (bf16 widens by a shift, rounds to nearest even with integer ops); on
//! x86-64 with AVX2 the same loops run compiled for AVX2, and f16 converts with F16C
//! (`simd`). Elsewhere f16 converts element by element with the `half` crate.

use crate::dtype::DType;

/// Elements per block: 8 KiB of f32 accumulator, with room in L1 for the operands' lines.
const BLOCK: usize = 2048;

/// One term of a sum.
#[derive(Clone, Copy, Debug)]
pub enum Operand<'a> {
    /// Elements of the call's dtype, little-endian.
    Elements(&'a [u8]),
    /// f32 partial sums (native byte order: they never leave this host).
    Partials(&'a [u8]),
    /// What the target holds before the sum (an in-place call's own input).
    Target,
}

/// Where a sum goes.
#[derive(Debug)]
pub enum Target<'a> {
    /// Rounded to the call's dtype, little-endian.
    Elements(&'a mut [u8]),
    /// As f32 partials.
    Partials(&'a mut [u8]),
}

impl Operand<'_> {
    fn len_bytes(&self) -> Option<usize> {
        match self {
            Operand::Elements(b) | Operand::Partials(b) => Some(b.len()),
            Operand::Target => None,
        }
    }
}

/// `target = operands[0] + operands[1] + ...` over `count` elements of `dtype`, each sum taken
/// in f32 left to right and rounded once. Panics if an operand or the target is shorter than
/// `count` elements of its kind (a bug in the caller, never a peer's doing).
pub fn sum(dtype: DType, count: usize, operands: &[Operand<'_>], target: Target<'_>) {
    assert!(!operands.is_empty(), "a sum of no operands");
    let (target_bytes, target_partials) = match &target {
        Target::Elements(b) => (b.len(), false),
        Target::Partials(b) => (b.len(), true),
    };
    let size_of = |partials: bool| if partials { 4 } else { dtype.size() };
    assert!(
        target_bytes >= count * size_of(target_partials),
        "target too short"
    );
    for op in operands {
        if let Some(len) = op.len_bytes() {
            let partials = matches!(op, Operand::Partials(_));
            assert!(len >= count * size_of(partials), "operand too short");
        }
    }
    BLOCKS.with_borrow_mut(|blocks| {
        let Blocks { acc, staging } = &mut **blocks;
        sum_blocks(dtype, count, operands, target, acc, staging);
    });
}

/// The accumulator and the staging block of a thread, kept between calls: zeroing 16 KiB on
/// every call would cost as much as a small message's whole reduction.
struct Blocks {
    acc: [f32; BLOCK],
    /// Where an operand or the target is not aligned for its element type, its block goes
    /// through this aligned copy (callers' buffers may start anywhere; segments are aligned).
    staging: [u32; BLOCK],
}

thread_local! {
    static BLOCKS: std::cell::RefCell<Box<Blocks>> = std::cell::RefCell::new(Box::new(Blocks {
        acc: [0.0; BLOCK],
        staging: [0; BLOCK],
    }));
}

fn sum_blocks(
    dtype: DType,
    count: usize,
    operands: &[Operand<'_>],
    target: Target<'_>,
    acc: &mut [f32; BLOCK],
    staging: &mut [u32; BLOCK],
) {
    let size_of = |partials: bool| if partials { 4 } else { dtype.size() };
    let kernels = simd::kernels();
    let mut target = target;
    let mut start = 0;
    while start < count {
        let len = BLOCK.min(count - start);
        let acc = &mut acc[..len];
        for (i, op) in operands.iter().enumerate() {
            let (bytes, partials) = match op {
                Operand::Elements(b) => (*b, false),
                Operand::Partials(b) => (*b, true),
                Operand::Target => match &target {
                    Target::Elements(b) => (&b[..], false),
                    Target::Partials(b) => (&b[..], true),
                },
            };
            let size = size_of(partials);
            let src = &bytes[start * size..(start + len) * size];
            let src = aligned(src, staging);
            let first = i == 0;
            if partials || dtype == DType::F32 {
                let src: &[f32] = bytemuck::cast_slice(src);
                if first {
                    acc.copy_from_slice(src);
                } else {
                    (kernels.add_f32)(src, acc);
                }
            } else {
                let src: &[u16] = bytemuck::cast_slice(src);
                match (dtype, first) {
                    (DType::Bf16, true) => (kernels.load_bf16)(src, acc),
                    (DType::Bf16, false) => (kernels.add_bf16)(src, acc),
                    (_, true) => (kernels.load_f16)(src, acc),
                    (_, false) => (kernels.add_f16)(src, acc),
                }
            }
        }
        let (bytes, partials) = match &mut target {
            Target::Elements(b) => (&mut b[..], false),
            Target::Partials(b) => (&mut b[..], true),
        };
        let size = size_of(partials);
        let dst = &mut bytes[start * size..(start + len) * size];
        if partials || dtype == DType::F32 {
            match bytemuck::try_cast_slice_mut::<u8, f32>(dst) {
                Ok(dst) => dst.copy_from_slice(acc),
                Err(_) => dst.copy_from_slice(bytemuck::cast_slice(acc)),
            }
        } else {
            let store = if dtype == DType::Bf16 {
                kernels.store_bf16
            } else {
                kernels.store_f16
            };
            match bytemuck::try_cast_slice_mut::<u8, u16>(dst) {
                Ok(dst) => store(acc, dst),
                Err(_) => {
                    let staged: &mut [u16] = bytemuck::cast_slice_mut(&mut staging[..]);
                    store(acc, &mut staged[..len]);
                    dst.copy_from_slice(bytemuck::cast_slice(&staged[..len]));
                }
            }
        }
        start += len;
    }
}

/// `src` itself where it is 4-byte aligned, else a copy of it in `staging`.
fn aligned<'a>(src: &'a [u8], staging: &'a mut [u32; BLOCK]) -> &'a [u8] {
    if src.as_ptr().align_offset(4) == 0 {
        return src;
    }
    let staged: &mut [u8] = bytemuck::cast_slice_mut(&mut staging[..]);
    staged[..src.len()].copy_from_slice(src);
    &staged[..src.len()]
}

/// Copies `count` elements of `dtype` as f32 partials (a sum of one operand).
pub fn widen(dtype: DType, count: usize, src: &[u8], dst: &mut [u8]) {
    sum(
        dtype,
        count,
        &[Operand::Elements(src)],
        Target::Partials(dst),
    );
}

// Elements are little-endian bytes; the kernels read them as native integers and floats.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "the CPU backend assumes a little-endian host"
);

/// The element loops, written once and compiled twice on x86-64: for the baseline target and
/// for AVX2 (picked at run time), where f16 also converts with F16C. The loops over f32 and
/// bf16 are plain loops the compiler vectorises.
mod simd {
    use half::f16;

    /// The loops the reduction runs, for the best instruction set this CPU has.
    pub struct Kernels {
        pub add_f32: fn(&[f32], &mut [f32]),
        pub load_bf16: fn(&[u16], &mut [f32]),
        pub add_bf16: fn(&[u16], &mut [f32]),
        pub store_bf16: fn(&[f32], &mut [u16]),
        pub load_f16: fn(&[u16], &mut [f32]),
        pub add_f16: fn(&[u16], &mut [f32]),
        pub store_f16: fn(&[f32], &mut [u16]),
    }

    #[inline(always)]
    fn add_f32(src: &[f32], acc: &mut [f32]) {
        for (a, s) in acc.iter_mut().zip(src) {
            *a += *s;
        }
    }

    #[inline(always)]
    fn load_bf16(src: &[u16], acc: &mut [f32]) {
        for (a, s) in acc.iter_mut().zip(src) {
            *a = f32::from_bits(u32::from(*s) << 16);
        }
    }

    #[inline(always)]
    fn add_bf16(src: &[u16], acc: &mut [f32]) {
        for (a, s) in acc.iter_mut().zip(src) {
            *a += f32::from_bits(u32::from(*s) << 16);
        }
    }

    /// f32 to bf16, rounding to nearest even; NaN stays NaN with its sign and top payload
    /// bits, quiet (exactly `half::bf16::from_f32`).
    #[inline(always)]
    pub(super) fn bf16_bits(x: u32) -> u16 {
        let rounded = (x + 0x7fff + ((x >> 16) & 1)) >> 16;
        let nan = (x >> 16) | 0x40;
        (if x & 0x7fff_ffff > 0x7f80_0000 {
            nan
        } else {
            rounded
        }) as u16
    }

    #[inline(always)]
    fn store_bf16(acc: &[f32], dst: &mut [u16]) {
        for (d, a) in dst.iter_mut().zip(acc) {
            *d = bf16_bits(a.to_bits());
        }
    }

    fn load_f16(src: &[u16], acc: &mut [f32]) {
        for (a, s) in acc.iter_mut().zip(src) {
            *a = f16::from_bits(*s).to_f32();
        }
    }

    fn add_f16(src: &[u16], acc: &mut [f32]) {
        for (a, s) in acc.iter_mut().zip(src) {
            *a += f16::from_bits(*s).to_f32();
        }
    }

    fn store_f16(acc: &[f32], dst: &mut [u16]) {
        for (d, a) in dst.iter_mut().zip(acc) {
            *d = f16::from_f32(*a).to_bits();
        }
    }

    static BASELINE: Kernels = Kernels {
        add_f32,
        load_bf16,
        add_bf16,
        store_bf16,
        load_f16,
        add_f16,
        store_f16,
    };

    #[cfg(target_arch = "x86_64")]
    mod avx2 {
        //! The loops compiled for AVX2, and f16 with F16C. Every `unsafe fn` here is reached
        //! only through the safe wrappers in [`wrappers`], which `kernels()` hands out only
        //! after checking that this CPU has AVX2 and F16C.

        use std::arch::x86_64::{
            __m128i, _mm256_add_ps, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps,
            _mm256_storeu_ps, _mm_loadu_si128, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
        };

        macro_rules! compiled_for_avx2 {
            ($($name:ident($($arg:ident: $ty:ty),*);)*) => {
                $(
                    /// # Safety
                    /// The CPU must support AVX2.
                    #[target_feature(enable = "avx2")]
                    unsafe fn $name($($arg: $ty),*) {
                        super::$name($($arg),*)
                    }
                )*
            };
        }

        compiled_for_avx2! {
            add_f32(src: &[f32], acc: &mut [f32]);
            load_bf16(src: &[u16], acc: &mut [f32]);
            add_bf16(src: &[u16], acc: &mut [f32]);
            store_bf16(acc: &[f32], dst: &mut [u16]);
        }

        /// # Safety
        /// The CPU must support AVX2 and F16C.
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn widen_f16(src: &[u16], acc: &mut [f32], add: bool) {
            let whole = src.len().min(acc.len()) / 8 * 8;
            for i in (0..whole).step_by(8) {
                // SAFETY: i + 8 <= whole <= both lengths, so the 16 bytes read and the 32
                // bytes read and written are inside the slices; unaligned loads and stores.
                unsafe {
                    let halves = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                    let mut wide = _mm256_cvtph_ps(halves);
                    if add {
                        wide = _mm256_add_ps(_mm256_loadu_ps(acc.as_ptr().add(i)), wide);
                    }
                    _mm256_storeu_ps(acc.as_mut_ptr().add(i), wide);
                }
            }
            let (src, acc) = (&src[whole..], &mut acc[whole..]);
            if add {
                super::add_f16(src, acc);
            } else {
                super::load_f16(src, acc);
            }
        }

        /// # Safety
        /// The CPU must support AVX2 and F16C.
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn narrow_f16(acc: &[f32], dst: &mut [u16]) {
            let whole = acc.len().min(dst.len()) / 8 * 8;
            for i in (0..whole).step_by(8) {
                // SAFETY: i + 8 <= whole <= both lengths: 32 bytes read, 16 written, inside
                // the slices; unaligned loads and stores.
                unsafe {
                    let wide = _mm256_loadu_ps(acc.as_ptr().add(i));
                    let halves = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(wide);
                    _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, halves);
                }
            }
            super::store_f16(&acc[whole..], &mut dst[whole..]);
        }

        /// Safe entry points: only reachable through `kernels()`'s AVX2 table.
        pub mod wrappers {
            macro_rules! safe {
                ($($name:ident($($arg:ident: $ty:ty),*) => $call:expr;)*) => {
                    $(
                        pub fn $name($($arg: $ty),*) {
                            // SAFETY: `kernels()` returns the table holding this function only
                            // after `is_x86_feature_detected!` found AVX2 and F16C.
                            unsafe { $call }
                        }
                    )*
                };
            }
            safe! {
                add_f32(src: &[f32], acc: &mut [f32]) => super::add_f32(src, acc);
                load_bf16(src: &[u16], acc: &mut [f32]) => super::load_bf16(src, acc);
                add_bf16(src: &[u16], acc: &mut [f32]) => super::add_bf16(src, acc);
                store_bf16(acc: &[f32], dst: &mut [u16]) => super::store_bf16(acc, dst);
                load_f16(src: &[u16], acc: &mut [f32]) => super::widen_f16(src, acc, false);
                add_f16(src: &[u16], acc: &mut [f32]) => super::widen_f16(src, acc, true);
                store_f16(acc: &[f32], dst: &mut [u16]) => super::narrow_f16(acc, dst);
            }
        }
    }

    /// The loops for this CPU (detected once).
    pub fn kernels() -> &'static Kernels {
        #[cfg(target_arch = "x86_64")]
        {
            use std::sync::OnceLock;
            static AVX2: Kernels = Kernels {
                add_f32: avx2::wrappers::add_f32,
                load_bf16: avx2::wrappers::load_bf16,
                add_bf16: avx2::wrappers::add_bf16,
                store_bf16: avx2::wrappers::store_bf16,
                load_f16: avx2::wrappers::load_f16,
                add_f16: avx2::wrappers::add_f16,
                store_f16: avx2::wrappers::store_f16,
            };
            static HAS_AVX2: OnceLock<bool> = OnceLock::new();
            let has = *HAS_AVX2.get_or_init(|| {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
            });
            if has {
                return &AVX2;
            }
        }
        &BASELINE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::reduce::reduce_in_rank_order;
    use proptest::prelude::*;

    fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
        let mut b = vec![0u8; values.len() * dtype.size()];
        for (i, v) in values.iter().enumerate() {
            dtype.store_f32(&mut b, i, *v);
        }
        b
    }

    #[test]
    fn bf16_rounding_is_the_half_crates() {
        let specials = [
            0u32,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0001,
            0xffbf_ffff,
            0x7f7f_ffff,
            0x0000_8000,
            0x0001_8000,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x0000_0001,
        ];
        let mut x = 0x1234_5678u32;
        let samples = specials.into_iter().chain((0..100_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        }));
        for bits in samples {
            assert_eq!(
                simd::bf16_bits(bits),
                half::bf16::from_f32(f32::from_bits(bits)).to_bits(),
                "{bits:#x}"
            );
        }
    }

    proptest! {
        #[test]
        fn sums_follow_the_definition_for_every_kind(
            ranks in proptest::collection::vec(proptest::collection::vec(-1.0e4f32..1.0e4, 1..5000), 1..6),
            d in 0usize..3,
            partial_first in any::<bool>(),
            offset in 0usize..2,
        ) {
            let dtype = DType::ALL[d];
            let count = ranks.iter().map(Vec::len).min().unwrap();
            // Each rank's values as stored, at an odd offset too (unaligned buffers).
            let stored: Vec<Vec<u8>> = ranks.iter().map(|v| {
                let mut b = vec![0u8; offset];
                b.extend(encode(dtype, &v[..count]));
                b
            }).collect();
            let value = |r: usize, i: usize| dtype.load_f32(&stored[r][offset..], i);
            let first_partials: Vec<u8> = (0..count).flat_map(|i| value(0, i).to_ne_bytes()).collect();
            let mut operands: Vec<Operand> = stored.iter().map(|b| Operand::Elements(&b[offset..])).collect();
            if partial_first {
                operands[0] = Operand::Partials(&first_partials);
            }
            let mut out = vec![0u8; count * dtype.size()];
            sum(dtype, count, &operands, Target::Elements(&mut out));
            let mut partials = vec![0u8; count * 4];
            sum(dtype, count, &operands, Target::Partials(&mut partials));
            for i in 0..count {
                let expected = reduce_in_rank_order((0..stored.len()).map(|r| value(r, i)));
                let mut one = [0u8; 4];
                dtype.store_f32(&mut one, 0, expected);
                prop_assert_eq!(&out[i * dtype.size()..(i + 1) * dtype.size()], &one[..dtype.size()]);
                prop_assert_eq!(f32::from_ne_bytes(partials[i * 4..i * 4 + 4].try_into().unwrap()).to_bits(), expected.to_bits());
            }
            // In place: the target's own content is the first operand.
            let mut in_place = stored[0][offset..].to_vec();
            let mut rest = vec![Operand::Target];
            rest.extend(operands[1..].iter().copied());
            sum(dtype, count, &rest, Target::Elements(&mut in_place));
            prop_assert_eq!(in_place, out);
        }
    }

    #[test]
    fn negative_zero_from_one_operand_stays_negative_zero() {
        for dtype in DType::ALL {
            let src = encode(dtype, &[-0.0, 1.5]);
            let mut out = vec![0u8; src.len()];
            sum(
                dtype,
                2,
                &[Operand::Elements(&src)],
                Target::Elements(&mut out),
            );
            assert_eq!(out, src, "{dtype}");
        }
    }
}
