//! Bookkeeping core of blockdraft (no Python, no device memory).
//!
//! - [`pool`]: the shared pool of fixed-size K/V blocks.
//! - [`window`]: the per-sequence context window and its environment cap.
//! - [`state`]: one sequence's context rows, committed K/V and block table, changed only
//!   through two-phase plans.
//! - [`batch`]: the batch policy of `propose_batch` and band splitting.
//! - [`step`]: a proposal's anchor rules and the graph path's metadata matrix.
//!
//! Functions that touch blocks take the pool explicitly (`&mut BlockPool`); the caller decides
//! how it is shared. The only global input is the environment variable read by
//! [`window::read_ctx_cap`].

#![warn(clippy::pedantic)]

pub mod batch;
pub mod error;
pub mod pool;
pub mod state;
pub mod step;
pub mod window;

pub use batch::{batch_decline_reason, propose_batch_max, split_bands};
pub use error::{Error, Result};
pub use pool::BlockPool;
pub use state::{AppendPlan, ContextState, PrecomputePlan, SlidePlan};
pub use step::{check_anchor, Filled, GraphMeta, MetaLayout, TooWide, MAX_ANCHOR_POSITION};
pub use window::{
    ctx_ceiling, ctx_window, parse_ctx_cap, read_ctx_cap, DEFAULT_CTX_CAP, ENV_CTX_CAP,
};

/// Slot value that marks a row the K/V store must skip.
pub const PAD_SLOT: i64 = -1;
