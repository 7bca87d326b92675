//! Bookkeeping core of blockdraft (no Python, no device memory).
//!
//! - [`pool`]: the shared pool of fixed-size K/V pages.
//! - [`window`]: the per-sequence context window and its environment cap.
//! - [`state`]: one sequence's context rows, committed K/V and page table, changed only
//!   through two-phase plans.
//! - [`batch`]: the batch policy of `propose_batch` and band splitting.
//! - [`step`]: a proposal's rules and the graph path's metadata matrix.
//! - [`pages`]: one target sequence's K/V pages, taken all at once, and its committed and
//!   pending token counts.
//! - [`pages_step`]: whole-step calls over many target sequences (a forward's plan, accepts,
//!   frees).
//!
//! Functions that touch pages take the pool explicitly (`&mut BlockPool`); the caller decides
//! how it is shared. The only global inputs are the environment variables read by
//! [`window::read_ctx_cap`] and [`window::read_slide`].
//!
//! # Invariants
//!
//! The stateful tests (Rust and Python) and the fuzz target check these after every operation;
//! tests cite them by number.
//!
//! 1. Conservation: free pages plus the pages held by live states (and raw allocations)
//!    equal `num_pages`.
//! 2. No page is held twice (by two states, or twice by one), and no free page is held.
//! 3. Every live state: `0 <= ctx_committed <= ctx_len <= window`, positions non-negative and
//!    strictly increasing, `page_table.len() == ceil(ctx_committed / page_size)`.
//! 4. After a slide the kept rows are the newest ones, in order, with their positions, and
//!    `ctx_committed == 0`; the slide keeps `window - slide_room - n` of them for a commit of
//!    `n` rows (none when that is negative), never cuts a row of the commit itself, and
//!    returns every page of the table to the pool.
//! 5. A refused operation (a failed allocation, a declined batch, a bad argument) leaves the
//!    pool and every state exactly as they were.
//! 6. Freeing twice equals freeing once; a freed state equals a fresh one and its pages are
//!    back in the pool.
//! 7. Once every state is freed the pool is exactly full again.
//!
//! Target sequences ([`SeqPages`]) count as states in 1, 2 and 5–7. Their counterpart of 3: a
//! live one holds exactly `ceil(capacity / page_size)` pages and `length + pending <=
//! capacity`; a freed one holds no page and counts no token.

#![warn(clippy::pedantic)]

pub mod batch;
pub mod error;
pub mod pages;
pub mod pages_step;
pub mod pool;
pub mod state;
pub mod step;
pub mod window;

pub use batch::{batch_decline_reason, propose_batch_max, split_bands};
pub use error::{Error, Result};
pub use pages::SeqPages;
pub use pages_step::{accept_rows, ensure_owners, free_all, plan_forward, ForwardPlan};
pub use pool::BlockPool;
pub use state::{AppendPlan, ContextState, PrecomputePlan, SlidePlan};
pub use step::{
    check_anchor, check_proposal, Filled, GraphMeta, MetaLayout, TooWide, MAX_ANCHOR_POSITION,
};
pub use window::{
    ctx_ceiling, ctx_window, parse_ctx_cap, parse_slide, read_ctx_cap, read_slide, slide_room,
    DEFAULT_CTX_CAP, DEFAULT_SLIDE, ENV_CTX_CAP, ENV_SLIDE,
};

/// Slot value that marks a row the K/V store must skip.
pub const PAD_SLOT: i64 = -1;
