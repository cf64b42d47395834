//! Element types and reduction operators shared by every backend.
//!
//! The mapping from Rust type to [`Dtype`] is the one NCCL uses (`ncclFloat32`, `ncclBfloat16`, ...),
//! so the NCCL backend can translate a [`Dtype`] one-to-one.

use std::fmt;

/// Element type of a collective's buffers, tagged at run time so ranks can check they agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum Dtype {
    /// `f32` (`ncclFloat32`).
    F32 = 1,
    /// `f64` (`ncclFloat64`).
    F64 = 2,
    /// IEEE half, `half::f16` (`ncclFloat16`).
    F16 = 3,
    /// bfloat16, `half::bf16` (`ncclBfloat16`).
    BF16 = 4,
    /// `i32` (`ncclInt32`).
    I32 = 5,
    /// `i64` (`ncclInt64`).
    I64 = 6,
    /// `u8` (`ncclUint8`).
    U8 = 7,
    /// `i8` (`ncclInt8`).
    I8 = 8,
    /// `u32` (`ncclUint32`).
    U32 = 9,
    /// `u64` (`ncclUint64`).
    U64 = 10,
}

impl Dtype {
    /// Every dtype, in declaration order (handy for tests and CLIs).
    pub const ALL: [Dtype; 10] = [
        Dtype::F32,
        Dtype::F64,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::I64,
        Dtype::U8,
        Dtype::I8,
        Dtype::U32,
        Dtype::U64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U8 | Dtype::I8 => 1,
        }
    }

    /// Short lowercase name as used on the command line (`f32`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F64 => "f64",
            Dtype::F16 => "f16",
            Dtype::BF16 => "bf16",
            Dtype::I32 => "i32",
            Dtype::I64 => "i64",
            Dtype::U8 => "u8",
            Dtype::I8 => "i8",
            Dtype::U32 => "u32",
            Dtype::U64 => "u64",
        }
    }

    /// True for the floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(self, Dtype::F32 | Dtype::F64 | Dtype::F16 | Dtype::BF16)
    }

    pub(crate) fn from_u8(v: u8) -> Option<Dtype> {
        Dtype::ALL.iter().copied().find(|d| *d as u8 == v)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Dtype::ALL
            .iter()
            .copied()
            .find(|d| d.name() == s.to_ascii_lowercase())
            .ok_or_else(|| format!("unknown dtype '{s}' (expected one of f32, f64, f16, bf16, i32, i64, u8, i8, u32, u64)"))
    }
}

/// Reduction operator of `all_reduce`, `reduce` and `reduce_scatter`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Element-wise sum (integers wrap on overflow, as NCCL's do).
    Sum = 1,
    /// Element-wise product (integers wrap).
    Prod = 2,
    /// Element-wise minimum.
    Min = 3,
    /// Element-wise maximum.
    Max = 4,
    /// Sum divided by the world size (integer division for integer types, as `ncclAvg`).
    Avg = 5,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// Lowercase name (`sum`, `prod`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    pub(crate) fn from_u8(v: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.iter().copied().find(|o| *o as u8 == v)
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ReduceOp::ALL
            .iter()
            .copied()
            .find(|o| o.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                format!("unknown reduce op '{s}' (expected one of sum, prod, min, max, avg)")
            })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A type that can travel through a collective. Sealed: the set matches NCCL's types.
pub trait Element:
    sealed::Sealed + Copy + Send + Sync + PartialEq + Default + fmt::Debug + 'static
{
    /// The run-time tag of this type.
    const DTYPE: Dtype;
}

macro_rules! define_element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(
            impl sealed::Sealed for $t {}
            impl Element for $t {
                const DTYPE: Dtype = Dtype::$d;
            }
        )*
    };
}

define_element!(
    f32 => F32,
    f64 => F64,
    half::f16 => F16,
    half::bf16 => BF16,
    i32 => I32,
    i64 => I64,
    u8 => U8,
    i8 => I8,
    u32 => U32,
    u64 => U64,
);
