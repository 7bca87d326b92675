//! One thing that holds pages of a pool (a drafter `ContextState`, a target `SeqPages`) shared
//! with the pool it draws from, as every Python object made from it sees them.
//!
//! Lock order is the thing first, then the pool (`with`); a thing dropped without `free`
//! gives its pages back on drop, so forgetting to free cannot leak pool capacity.

use std::sync::{Mutex, MutexGuard};

use blockdraft_core as core;

use crate::errors::{lock, CoreResult};
use crate::SharedPool;

/// What gives its pages back to the pool it holds them from.
pub(crate) trait HoldsPages {
    /// What it is called in a lock error ("state", "sequence").
    const WHAT: &'static str;

    /// Give every page back (a no-op once freed).
    ///
    /// # Errors
    /// The core's, when its bookkeeping and the pool disagree.
    fn free_pages(&mut self, pool: &mut core::BlockPool) -> core::Result<()>;
}

impl HoldsPages for core::ContextState {
    const WHAT: &'static str = "state";

    fn free_pages(&mut self, pool: &mut core::BlockPool) -> core::Result<()> {
        self.free(pool).map(drop)
    }
}

impl HoldsPages for core::SeqPages {
    const WHAT: &'static str = "sequence";

    fn free_pages(&mut self, pool: &mut core::BlockPool) -> core::Result<()> {
        self.free(pool).map(drop)
    }
}

/// A page holder and the pool it draws from.
pub(crate) struct Shared<T: HoldsPages> {
    item: Mutex<T>,
    pool: SharedPool,
}

impl<T: HoldsPages> Shared<T> {
    pub(crate) fn new(item: T, pool: SharedPool) -> Self {
        Self {
            item: Mutex::new(item),
            pool,
        }
    }

    /// The holder, locked.
    pub(crate) fn lock(&self) -> CoreResult<MutexGuard<'_, T>> {
        lock(&self.item, T::WHAT)
    }

    /// The pool, locked (after the holder, where both are taken).
    pub(crate) fn lock_pool(&self) -> CoreResult<MutexGuard<'_, core::BlockPool>> {
        lock(&self.pool, "pool")
    }

    /// Run `f` on the locked holder and pool (holder first, then pool).
    pub(crate) fn with<R>(
        &self,
        f: impl FnOnce(&mut T, &mut core::BlockPool) -> core::Result<R>,
    ) -> CoreResult<R> {
        let mut item = self.lock()?;
        let mut pool = self.lock_pool()?;
        Ok(f(&mut item, &mut pool)?)
    }
}

impl<T: HoldsPages> Drop for Shared<T> {
    /// Errors cannot be reported from a destructor and are ignored.
    fn drop(&mut self) {
        let _ = self.with(T::free_pages);
    }
}
