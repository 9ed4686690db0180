//! Element types tpar reduces, and their conversion to and from the fp32 accumulator.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::error::Error;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
}

impl DType {
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }

    /// The code carried in a call header.
    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F16 => 2,
            DType::Bf16 => 3,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.code() == code)
    }

    /// Reads element `index` of a little-endian byte buffer as f32.
    #[inline]
    pub fn load_f32(self, bytes: &[u8], index: usize) -> f32 {
        match self {
            DType::F32 => {
                let b = &bytes[index * 4..index * 4 + 4];
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
            DType::F16 => f16::from_bits(u16_at(bytes, index)).to_f32(),
            DType::Bf16 => bf16::from_bits(u16_at(bytes, index)).to_f32(),
        }
    }

    /// Rounds `value` to this dtype (round to nearest even) and writes it as element `index`.
    #[inline]
    pub fn store_f32(self, bytes: &mut [u8], index: usize, value: f32) {
        match self {
            DType::F32 => bytes[index * 4..index * 4 + 4].copy_from_slice(&value.to_le_bytes()),
            DType::F16 => bytes[index * 2..index * 2 + 2]
                .copy_from_slice(&f16::from_f32(value).to_bits().to_le_bytes()),
            DType::Bf16 => bytes[index * 2..index * 2 + 2]
                .copy_from_slice(&bf16::from_f32(value).to_bits().to_le_bytes()),
        }
    }
}

#[inline]
fn u16_at(bytes: &[u8], index: usize) -> u16 {
    u16::from_le_bytes([bytes[index * 2], bytes[index * 2 + 1]])
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" | "fp32" => Ok(DType::F32),
            "f16" | "float16" | "half" | "fp16" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            _ => Err(Error::InvalidArgument(format!(
                "unknown dtype '{s}'; expected one of: f32, f16, bf16"
            ))),
        }
    }
}

/// A Rust element type that maps to a [`DType`].
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_codes() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::Bf16);
        assert!("int8".parse::<DType>().is_err());
    }

    #[test]
    fn byte_access_matches_element_conversion() {
        let values = [1.5f32, -0.0, 3.0e-3, 65504.0];
        for d in DType::ALL {
            let mut bytes = vec![0u8; values.len() * d.size()];
            for (i, v) in values.iter().enumerate() {
                d.store_f32(&mut bytes, i, *v);
            }
            for (i, v) in values.iter().enumerate() {
                let expected = match d {
                    DType::F32 => *v,
                    DType::F16 => f16::from_f32(*v).to_f32(),
                    DType::Bf16 => bf16::from_f32(*v).to_f32(),
                };
                assert_eq!(
                    d.load_f32(&bytes, i).to_bits(),
                    expected.to_bits(),
                    "{d} {v}"
                );
            }
        }
    }
}
