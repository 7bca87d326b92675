//! Page tables of the target model's K/V: which pool pages one sequence holds, how many of its
//! tokens have committed K/V, and how many rows the last forward wrote beyond them.
//!
//! A sequence takes every page it may need when it is made (`ceil(capacity / page_size)`, all
//! or nothing), so a running sequence never waits for memory and its page table never changes
//! until it is freed. Token position `p` lives in slot `pages[p / page_size] * page_size +
//! p % page_size`.
//!
//! A forward over `r` rows writes positions `length .. length + r` and leaves them pending;
//! `accept(k)` commits the first `k` of them. Rows not accepted cost nothing: the next forward
//! writes the same slots again.
//!
//! Invariant (checked by [`SeqPages::check_invariants`]): a live sequence holds exactly
//! `ceil(capacity / page_size)` distinct allocated pages and `length + pending <= capacity`; a
//! freed one holds no page and has `length == pending == 0`.

use crate::error::{Error, Result};
use crate::pool::BlockPool;

/// One target sequence's pages and counters (no device memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqPages {
    owner: u64,
    capacity: usize,
    page_size: usize,
    pages: Vec<usize>,
    length: usize,
    pending: usize,
    freed: bool,
}

impl SeqPages {
    /// A sequence of up to `capacity` tokens, taking its `ceil(capacity / page_size)` pages from
    /// `pool` now.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `capacity` is 0; [`Error::PoolExhausted`] when the pool
    /// has too few free pages (nothing is taken).
    pub fn new(pool: &mut BlockPool, capacity: usize, owner: u64) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::invalid_argument("capacity", "must be >= 1, got 0"));
        }
        let page_size = pool.page_size();
        let pages = pool.alloc(capacity.div_ceil(page_size))?;
        Ok(Self {
            owner,
            capacity,
            page_size,
            pages,
            length: 0,
            pending: 0,
            freed: false,
        })
    }

    #[must_use]
    pub fn owner(&self) -> u64 {
        self.owner
    }
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    #[must_use]
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// The page table, in position order (empty once freed).
    #[must_use]
    pub fn pages(&self) -> &[usize] {
        &self.pages
    }
    #[must_use]
    pub fn num_pages(&self) -> usize {
        self.pages.len()
    }
    /// Tokens whose K/V are committed (positions `0 .. length`).
    #[must_use]
    pub fn length(&self) -> usize {
        self.length
    }
    /// Rows the last forward wrote beyond `length`, not accepted yet.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.pending
    }
    #[must_use]
    pub fn freed(&self) -> bool {
        self.freed
    }

    /// Whether the sequence belongs to `owner`.
    ///
    /// # Errors
    /// [`Error::ForeignSequence`] naming both ids.
    pub fn ensure_owner(&self, owner: u64) -> Result<()> {
        if self.owner == owner {
            Ok(())
        } else {
            Err(Error::ForeignSequence {
                owner: self.owner,
                expected: owner,
            })
        }
    }

    /// The paged-cache slot of token position `pos`.
    ///
    /// # Errors
    /// [`Error::Freed`]; [`Error::InvalidArgument`] when `pos` is not in `0 .. capacity`.
    pub fn slot(&self, pos: usize) -> Result<usize> {
        self.ensure_live()?;
        if pos >= self.capacity {
            return Err(Error::invalid_argument(
                "pos",
                format!(
                    "{pos} is outside the capacity of {} tokens (positions 0..{})",
                    self.capacity,
                    self.capacity - 1
                ),
            ));
        }
        Ok(self.slot_unchecked(pos))
    }

    fn slot_unchecked(&self, pos: usize) -> usize {
        self.pages[pos / self.page_size] * self.page_size + pos % self.page_size
    }

    /// The rules of a forward over `rows` new rows: a live sequence, `rows >= 1`, and
    /// `length + rows <= capacity`.
    ///
    /// # Errors
    /// [`Error::Freed`]; [`Error::InvalidArgument`] naming `rows` (and the capacity).
    pub fn check_forward(&self, rows: usize) -> Result<()> {
        self.ensure_live()?;
        if rows == 0 {
            return Err(Error::invalid_argument("rows", "must be >= 1, got 0"));
        }
        if self
            .length
            .checked_add(rows)
            .is_none_or(|end| end > self.capacity)
        {
            return Err(Error::invalid_argument(
                "rows",
                format!(
                    "{rows} rows after {} committed tokens exceed the capacity of {} tokens",
                    self.length, self.capacity
                ),
            ));
        }
        Ok(())
    }

    /// A forward wrote `rows` rows at positions `length .. length + rows`: they are pending now
    /// (a previous pending count is replaced; its slots were written over).
    ///
    /// # Errors
    /// As [`Self::check_forward`]; nothing changes.
    pub fn forward(&mut self, rows: usize) -> Result<()> {
        self.check_forward(rows)?;
        self.pending = rows;
        Ok(())
    }

    /// Positions and slots of the rows a forward over `rows` rows writes, appended to
    /// `positions` and `slots` (the rows must have passed [`Self::check_forward`]).
    pub(crate) fn rows_into(
        &self,
        rows: usize,
        positions: &mut Vec<usize>,
        slots: &mut Vec<usize>,
    ) {
        let span = self.length..self.length + rows;
        positions.extend(span.clone());
        slots.extend(span.map(|p| self.slot_unchecked(p)));
    }

    /// The rules of accepting `k` pending rows: a live sequence and `k <= pending`.
    ///
    /// # Errors
    /// [`Error::Freed`]; [`Error::InvalidArgument`] naming `k`.
    pub fn check_accept(&self, k: usize) -> Result<()> {
        self.check_accept_as(k, "k")
    }

    pub(crate) fn check_accept_as(&self, k: usize, name: &'static str) -> Result<()> {
        self.ensure_live()?;
        if k > self.pending {
            return Err(Error::invalid_argument(
                name,
                format!("{k} exceeds the {} pending rows", self.pending),
            ));
        }
        Ok(())
    }

    /// Commit the first `k` pending rows: `length += k`, `pending = 0`.
    ///
    /// # Errors
    /// As [`Self::check_accept`]; nothing changes.
    pub fn accept(&mut self, k: usize) -> Result<()> {
        self.check_accept(k)?;
        self.length += k;
        self.pending = 0;
        Ok(())
    }

    /// Return every page to `pool` and reset the counters. Returns `Ok(false)` and does nothing
    /// when already freed.
    ///
    /// # Errors
    /// [`Error::PoolMismatch`], or a pool error if the sequence holds a page the pool does not
    /// consider allocated (a broken invariant); nothing changes.
    pub fn free(&mut self, pool: &mut BlockPool) -> Result<bool> {
        if self.freed {
            return Ok(false);
        }
        if pool.page_size() != self.page_size {
            return Err(Error::PoolMismatch {
                expected: self.page_size,
                actual: pool.page_size(),
            });
        }
        pool.free(&self.pages)?;
        self.pages = Vec::new();
        self.length = 0;
        self.pending = 0;
        self.freed = true;
        Ok(true)
    }

    /// Verify the module's invariant against `pool`: page count, no page twice, every page
    /// allocated, `length + pending <= capacity`, and a freed sequence holding nothing.
    ///
    /// # Errors
    /// [`Error::Invariant`] describing the first violation found.
    pub fn check_invariants(&self, pool: &BlockPool) -> Result<()> {
        let bad = |m: String| Err(Error::Invariant(m));
        if self.freed {
            if !self.pages.is_empty() || self.length != 0 || self.pending != 0 {
                return bad("a freed sequence still holds pages or counts tokens".into());
            }
            return Ok(());
        }
        let want = self.capacity.div_ceil(self.page_size);
        if self.pages.len() != want {
            return bad(format!(
                "{} pages held for a capacity of {} tokens in pages of {} (want {want})",
                self.pages.len(),
                self.capacity,
                self.page_size
            ));
        }
        if self.length + self.pending > self.capacity {
            return bad(format!(
                "length {} + pending {} exceed the capacity {}",
                self.length, self.pending, self.capacity
            ));
        }
        for (i, &b) in self.pages.iter().enumerate() {
            if !pool.is_allocated(b) {
                return bad(format!("held page {b} is not allocated in the pool"));
            }
            if self.pages[..i].contains(&b) {
                return bad(format!("page {b} is held twice by one sequence"));
            }
        }
        Ok(())
    }

    pub(crate) fn ensure_live(&self) -> Result<()> {
        if self.freed {
            Err(Error::Freed)
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(num_pages: usize, page_size: usize, capacity: usize) -> (BlockPool, SeqPages) {
        let mut pool = BlockPool::new(num_pages, page_size).unwrap();
        let seq = SeqPages::new(&mut pool, capacity, 3).unwrap();
        (pool, seq)
    }

    #[test]
    fn takes_every_page_at_creation() {
        let (pool, seq) = setup(8, 4, 9);
        assert_eq!(seq.pages(), &[0, 1, 2]);
        assert_eq!((seq.num_pages(), pool.num_free()), (3, 5));
        assert_eq!((seq.length(), seq.pending(), seq.freed()), (0, 0, false));
        assert_eq!((seq.capacity(), seq.page_size(), seq.owner()), (9, 4, 3));
        seq.check_invariants(&pool).unwrap();
        // a capacity that is a whole number of pages takes no extra one
        let (_, seq) = setup(8, 4, 8);
        assert_eq!(seq.num_pages(), 2);
    }

    #[test]
    fn creation_is_all_or_nothing() {
        let mut pool = BlockPool::new(5, 2).unwrap();
        let _held = SeqPages::new(&mut pool, 5, 0).unwrap();
        let before = pool.clone();
        assert_eq!(
            SeqPages::new(&mut pool, 5, 0),
            Err(Error::PoolExhausted {
                requested: 3,
                free: 2
            })
        );
        assert_eq!(pool, before, "a refused creation must take nothing");
        assert!(matches!(
            SeqPages::new(&mut pool, 0, 0),
            Err(Error::InvalidArgument {
                name: "capacity",
                ..
            })
        ));
        assert_eq!(pool, before);
    }

    #[test]
    fn slots_follow_the_page_table() {
        let mut pool = BlockPool::new(6, 3).unwrap();
        let raw = pool.alloc(1).unwrap(); // page 0 is someone else's
        let seq = SeqPages::new(&mut pool, 7, 0).unwrap();
        assert_eq!(seq.pages(), &[1, 2, 3]);
        let slots: Vec<usize> = (0..7).map(|p| seq.slot(p).unwrap()).collect();
        assert_eq!(slots, vec![3, 4, 5, 6, 7, 8, 9]);
        match seq.slot(7) {
            Err(Error::InvalidArgument {
                name: "pos",
                reason,
            }) => {
                assert!(reason.contains("capacity of 7"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        pool.free(&raw).unwrap();
    }

    #[test]
    fn forward_then_accept() {
        let (pool, mut seq) = setup(4, 4, 10);
        seq.forward(4).unwrap();
        assert_eq!((seq.length(), seq.pending()), (0, 4));
        seq.accept(4).unwrap();
        assert_eq!((seq.length(), seq.pending()), (4, 0));
        // a verify block of 3, of which 1 is accepted; the next forward starts after it
        seq.forward(3).unwrap();
        seq.accept(1).unwrap();
        assert_eq!((seq.length(), seq.pending()), (5, 0));
        let (mut pos, mut slots) = (Vec::new(), Vec::new());
        seq.rows_into(2, &mut pos, &mut slots);
        assert_eq!(pos, vec![5, 6]);
        assert_eq!(slots, vec![seq.slot(5).unwrap(), seq.slot(6).unwrap()]);
        // accepting nothing clears the pending rows
        seq.forward(2).unwrap();
        seq.accept(0).unwrap();
        assert_eq!((seq.length(), seq.pending()), (5, 0));
        seq.check_invariants(&pool).unwrap();
    }

    #[test]
    fn a_new_forward_replaces_the_pending_rows() {
        let (_, mut seq) = setup(4, 4, 10);
        seq.forward(5).unwrap();
        seq.forward(2).unwrap();
        assert_eq!(seq.pending(), 2);
        let before = seq.clone();
        assert!(matches!(
            seq.accept(3),
            Err(Error::InvalidArgument { name: "k", .. })
        ));
        assert_eq!(seq, before);
        seq.accept(2).unwrap();
        assert_eq!(seq.length(), 2);
    }

    #[test]
    fn forwards_past_the_capacity_change_nothing() {
        let (_, mut seq) = setup(4, 4, 10);
        seq.forward(6).unwrap();
        seq.accept(6).unwrap();
        seq.forward(1).unwrap();
        let before = seq.clone();
        for rows in [0, 5, usize::MAX] {
            match seq.forward(rows) {
                Err(Error::InvalidArgument {
                    name: "rows",
                    reason,
                }) => {
                    assert!(rows == 0 || reason.contains("capacity of 10"), "{reason}");
                }
                other => panic!("{rows}: {other:?}"),
            }
            assert_eq!(seq, before);
        }
        // exactly up to the capacity is fine
        seq.forward(4).unwrap();
        seq.accept(4).unwrap();
        assert_eq!(seq.length(), 10);
        assert!(seq.check_forward(1).is_err());
    }

    #[test]
    fn free_is_idempotent_and_returns_every_page() {
        let (mut pool, mut seq) = setup(8, 2, 7);
        seq.forward(3).unwrap();
        seq.accept(2).unwrap();
        seq.forward(1).unwrap();
        assert_eq!(pool.num_free(), 4);
        assert_eq!(seq.free(&mut pool), Ok(true));
        assert_eq!(pool.num_free(), 8);
        assert!(seq.pages().is_empty() && seq.freed());
        assert_eq!((seq.length(), seq.pending(), seq.capacity()), (0, 0, 7));
        let once = (seq.clone(), pool.clone());
        assert_eq!(seq.free(&mut pool), Ok(false));
        assert_eq!((seq.clone(), pool.clone()), once);
        seq.check_invariants(&pool).unwrap();
        pool.check_invariants().unwrap();
    }

    #[test]
    fn every_operation_on_a_freed_sequence_is_refused() {
        let (mut pool, mut seq) = setup(8, 2, 7);
        seq.free(&mut pool).unwrap();
        let before = seq.clone();
        assert_eq!(seq.forward(1), Err(Error::Freed));
        assert_eq!(seq.check_forward(1), Err(Error::Freed));
        assert_eq!(seq.accept(0), Err(Error::Freed));
        assert_eq!(seq.slot(0), Err(Error::Freed));
        assert_eq!(seq, before);
        assert_eq!(
            seq.ensure_owner(3),
            Ok(()),
            "a freed sequence keeps its owner"
        );
    }

    #[test]
    fn owner_check_names_both_ids() {
        let (_, seq) = setup(2, 2, 2);
        let err = seq.ensure_owner(4).unwrap_err();
        assert_eq!(
            err,
            Error::ForeignSequence {
                owner: 3,
                expected: 4
            }
        );
        assert!(err.to_string().contains("another owner"), "{err}");
    }

    #[test]
    fn free_into_another_geometry_is_refused() {
        let (mut pool, mut seq) = setup(4, 2, 3);
        let mut other = BlockPool::new(4, 3).unwrap();
        let before = (seq.clone(), other.clone());
        assert!(matches!(
            seq.free(&mut other),
            Err(Error::PoolMismatch { .. })
        ));
        assert_eq!((seq.clone(), other.clone()), before);
        assert_eq!(seq.free(&mut pool), Ok(true));
    }

    #[test]
    fn check_invariants_detects_corruption() {
        let (pool, seq) = setup(8, 2, 5);
        let mut short = seq.clone();
        short.pages.pop();
        let mut twice = seq.clone();
        twice.pages[1] = twice.pages[0];
        let mut unallocated = seq.clone();
        unallocated.pages[2] = 7;
        let mut over = seq.clone();
        over.length = 4;
        over.pending = 2;
        let mut freed = seq.clone();
        freed.freed = true;
        for (name, bad) in [
            ("short", short),
            ("twice", twice),
            ("unallocated", unallocated),
            ("over", over),
            ("freed", freed),
        ] {
            assert!(
                matches!(bad.check_invariants(&pool), Err(Error::Invariant(_))),
                "{name}"
            );
        }
        seq.check_invariants(&pool).unwrap();
    }
}
