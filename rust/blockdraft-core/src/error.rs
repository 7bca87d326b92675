//! The one error type of the core. Every variant carries its own message; the binding maps each
//! variant onto exactly one Python exception class.

use thiserror::Error;

/// Everything the core can refuse. Operations that fail change nothing.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Error {
    /// The pool has fewer free pages than an allocation asked for.
    #[error("page pool exhausted: {requested} pages requested, {free} free")]
    PoolExhausted { requested: usize, free: usize },

    /// A page id outside `0..num_pages`.
    #[error("page {page} is out of range (the pool has {num_pages} pages)")]
    PageOutOfRange { page: usize, num_pages: usize },

    /// A page id that is not currently allocated.
    #[error("page {page} is not allocated")]
    PageNotAllocated { page: usize },

    /// A page id listed more than once in one call.
    #[error("page {page} is listed more than once")]
    DuplicatePage { page: usize },

    /// The state was freed; only `free` (a no-op) and reads are allowed.
    #[error("the context state was freed")]
    Freed,

    /// A state used by a proposer other than the one that made it.
    #[error("the state belongs to another proposer (owner {owner}, expected {expected})")]
    ForeignOwner { owner: u64, expected: u64 },

    /// A target sequence used by an owner other than the one that made it.
    #[error("the sequence belongs to another owner (owner {owner}, expected {expected})")]
    ForeignSequence { owner: u64, expected: u64 },

    /// A proposal on a state whose context is still empty: the lifecycle is alloc, commit
    /// context, propose.
    #[error("the state has no committed context (commit_ctx before propose)")]
    NoContext,

    /// The error of one sequence of a whole-step call, with its index in the call.
    #[error("sequence {index}: {source}")]
    InSequence { index: usize, source: Box<Error> },

    /// A plan was handed to a state other than the one that made it.
    #[error("the plan belongs to another context state")]
    ForeignPlan,

    /// A plan was made for an older version of the state.
    #[error("stale plan: made for state version {plan}, the state is at version {state}")]
    StalePlan { plan: u64, state: u64 },

    /// A second precompute plan while one is still unresolved.
    #[error("a precompute plan is still outstanding; confirm or abort it first")]
    PlanOutstanding,

    /// Confirming a plan that was already confirmed or aborted.
    #[error("the precompute plan was already resolved")]
    PlanResolved,

    /// A state used with a pool of another geometry than the one it was made from.
    #[error("pool mismatch: the state uses pages of {expected} tokens, this pool {actual}")]
    PoolMismatch { expected: usize, actual: usize },

    /// An internal consistency check failed (see `check_invariants`).
    #[error("invariant violated: {0}")]
    Invariant(String),

    /// A plain bad argument (negative size, unordered positions, ...).
    #[error("invalid argument `{name}`: {reason}")]
    InvalidArgument { name: &'static str, reason: String },

    /// A configuration value (an environment variable) that cannot be used.
    #[error("configuration error: {0}")]
    Config(String),
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid_argument(name: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            name,
            reason: reason.into(),
        }
    }

    /// `self` as the error of sequence `index` of a whole-step call.
    #[must_use]
    pub fn in_sequence(self, index: usize) -> Self {
        Self::InSequence {
            index,
            source: Box::new(self),
        }
    }
}

/// `Result` with the core's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
