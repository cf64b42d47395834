//! The device step as data, in three layers:
//!
//! | file | what lives there |
//! |---|---|
//! | `ir.rs` | the data: [`Arena`], [`Region`], [`Arg`], [`Op`] (one launch), [`Precision`], region groups |
//! | `builder.rs` | [`Builder`]: one method per kernel entry point, with its argument order and geometry |
//! | `schedule.rs` | [`Tensors`]: a model's tensors laid out in the arenas and its step's launch sequence, derived from the [`Model`](crate::model::Model) |

mod builder;
mod ir;
mod schedule;

pub use builder::{splitk_workspace_len, Builder, CLIP_PARTIALS, SPLIT_K_MAX_SMS};
pub use ir::{
    AdamHyper, AmpTensors, Arena, Arg, BnTensors, ClipTensors, LossTensors, Op, ParamAt, Precision,
    Region,
};
pub use schedule::Tensors;
