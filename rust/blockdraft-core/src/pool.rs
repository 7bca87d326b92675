//! A fixed pool of equally sized K/V pages shared by every sequence.
//!
//! Free pages sit on a stack (O(1) pop/push per page); an allocation bitmap answers "is this
//! page allocated" in O(1) so that `free` can validate a whole request before touching
//! anything. A failed call leaves the pool exactly as it was.

use crate::error::{Error, Result};

const WORD_BITS: usize = u64::BITS as usize;

/// `num_pages` pages of `page_size` tokens; ids are `0..num_pages`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockPool {
    page_size: usize,
    num_pages: usize,
    /// Free ids; the top of the stack is handed out first.
    free: Vec<usize>,
    /// Bit `i` set iff page `i` is allocated.
    allocated: Vec<u64>,
    /// All-zero between calls; `free` marks the ids of one call here to find duplicates
    /// without allocating.
    scratch: Vec<u64>,
    /// Source of per-pool ids for the context states drawing from this pool.
    next_state_id: u64,
}

impl BlockPool {
    /// A pool with every page free. Fresh allocations come out in increasing id order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `num_pages` or `page_size` is 0, or the pool's bookkeeping
    /// for `num_pages` cannot be allocated.
    pub fn new(num_pages: usize, page_size: usize) -> Result<Self> {
        if num_pages == 0 {
            return Err(Error::invalid_argument("num_pages", "must be >= 1, got 0"));
        }
        if page_size == 0 {
            return Err(Error::invalid_argument("page_size", "must be >= 1, got 0"));
        }
        // Reserve fallibly: an absurd `num_pages` must be an error, not an abort of the process
        // (an infallible allocation failure aborts; a capacity overflow panics).
        let words = num_pages.div_ceil(WORD_BITS);
        let (mut free, mut allocated, mut scratch) = (Vec::new(), Vec::new(), Vec::new());
        if free.try_reserve_exact(num_pages).is_err()
            || allocated.try_reserve_exact(words).is_err()
            || scratch.try_reserve_exact(words).is_err()
        {
            return Err(Error::invalid_argument(
                "num_pages",
                format!("{num_pages} pages do not fit in memory"),
            ));
        }
        free.extend((0..num_pages).rev());
        allocated.resize(words, 0);
        scratch.resize(words, 0);
        Ok(Self {
            page_size,
            num_pages,
            free,
            allocated,
            scratch,
            next_state_id: 1,
        })
    }

    #[must_use]
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    #[must_use]
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    #[must_use]
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    #[must_use]
    pub fn num_used(&self) -> usize {
        self.num_pages - self.free.len()
    }

    /// Whether `page` is allocated; `false` for ids outside the pool.
    #[must_use]
    pub fn is_allocated(&self, page: usize) -> bool {
        page < self.num_pages && self.bit(page)
    }

    /// Take `n` pages, all or nothing.
    ///
    /// # Errors
    /// [`Error::PoolExhausted`] when fewer than `n` pages are free; nothing changes.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<usize>> {
        if n > self.free.len() {
            return Err(Error::PoolExhausted {
                requested: n,
                free: self.free.len(),
            });
        }
        let start = self.free.len() - n;
        // The stack top is the end of the Vec; reversing keeps fresh pools handing out 0, 1, 2...
        let out: Vec<usize> = self.free.drain(start..).rev().collect();
        for &b in &out {
            self.set_bit(b, true);
        }
        Ok(out)
    }

    /// Return `pages` to the pool after validating every id.
    ///
    /// # Errors
    /// [`Error::PageOutOfRange`], [`Error::PageNotAllocated`] or [`Error::DuplicatePage`]
    /// for the first bad id; nothing changes.
    pub fn free(&mut self, pages: &[usize]) -> Result<()> {
        // Validate first: range, allocated, and duplicates via the scratch bitmap (marks only
        // the ids of this call, and is all-zero again before we return).
        let mut bad = None;
        let mut marked = 0;
        for &b in pages {
            if b >= self.num_pages {
                bad = Some(Error::PageOutOfRange {
                    page: b,
                    num_pages: self.num_pages,
                });
            } else if !self.bit(b) {
                bad = Some(Error::PageNotAllocated { page: b });
            } else if get_bit(&self.scratch, b) {
                bad = Some(Error::DuplicatePage { page: b });
            }
            if bad.is_some() {
                break;
            }
            put_bit(&mut self.scratch, b, true);
            marked += 1;
        }
        for &b in &pages[..marked] {
            put_bit(&mut self.scratch, b, false);
        }
        if let Some(err) = bad {
            return Err(err);
        }
        // Then mutate.
        for &b in pages {
            self.set_bit(b, false);
        }
        // Reverse order so that an alloc right after this free hands the same ids back in the
        // same order (cheap determinism for tests and debugging).
        self.free.extend(pages.iter().rev());
        Ok(())
    }

    /// Verify that the free stack and the bitmap describe the same partition of the ids.
    ///
    /// # Errors
    /// [`Error::Invariant`] describing the first violation found.
    pub fn check_invariants(&self) -> Result<()> {
        let mut seen = vec![false; self.num_pages];
        for &b in &self.free {
            if b >= self.num_pages {
                return Err(Error::Invariant(format!(
                    "free list holds out-of-range page {b}"
                )));
            }
            if seen[b] {
                return Err(Error::Invariant(format!(
                    "page {b} is on the free list twice"
                )));
            }
            seen[b] = true;
            if self.bit(b) {
                return Err(Error::Invariant(format!(
                    "page {b} is on the free list but marked allocated"
                )));
            }
        }
        if self.scratch.iter().any(|&w| w != 0) {
            return Err(Error::Invariant(
                "free's scratch bitmap is not clear".into(),
            ));
        }
        let marked: usize = self.allocated.iter().map(|w| w.count_ones() as usize).sum();
        if marked + self.free.len() != self.num_pages {
            return Err(Error::Invariant(format!(
                "{marked} allocated + {} free != {} pages",
                self.free.len(),
                self.num_pages
            )));
        }
        Ok(())
    }

    /// A fresh id for a context state drawing from this pool (plans carry it).
    pub fn issue_state_id(&mut self) -> u64 {
        let id = self.next_state_id;
        self.next_state_id += 1;
        id
    }

    fn bit(&self, b: usize) -> bool {
        get_bit(&self.allocated, b)
    }

    fn set_bit(&mut self, b: usize, on: bool) {
        put_bit(&mut self.allocated, b, on);
    }
}

fn get_bit(words: &[u64], b: usize) -> bool {
    words[b / WORD_BITS] & (1 << (b % WORD_BITS)) != 0
}

fn put_bit(words: &mut [u64], b: usize, on: bool) {
    let mask = 1u64 << (b % WORD_BITS);
    if on {
        words[b / WORD_BITS] |= mask;
    } else {
        words[b / WORD_BITS] &= !mask;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_empty_geometry() {
        assert!(matches!(
            BlockPool::new(0, 16),
            Err(Error::InvalidArgument {
                name: "num_pages",
                ..
            })
        ));
        assert!(matches!(
            BlockPool::new(4, 0),
            Err(Error::InvalidArgument {
                name: "page_size",
                ..
            })
        ));
    }

    #[test]
    fn alloc_hands_out_increasing_ids_then_exhausts() {
        let mut pool = BlockPool::new(5, 16).unwrap();
        assert_eq!(pool.alloc(3).unwrap(), vec![0, 1, 2]);
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.num_used(), 3);
        let before = pool.clone();
        assert_eq!(
            pool.alloc(3),
            Err(Error::PoolExhausted {
                requested: 3,
                free: 2
            })
        );
        assert_eq!(pool, before, "a failed alloc must not change the pool");
        assert_eq!(pool.alloc(2).unwrap(), vec![3, 4]);
        assert_eq!(pool.alloc(0).unwrap(), Vec::<usize>::new());
        pool.check_invariants().unwrap();
    }

    #[test]
    fn free_returns_pages_for_reuse() {
        let mut pool = BlockPool::new(4, 8).unwrap();
        let a = pool.alloc(4).unwrap();
        pool.free(&a[1..3]).unwrap();
        assert!(!pool.is_allocated(1) && !pool.is_allocated(2));
        assert!(pool.is_allocated(0) && pool.is_allocated(3));
        assert_eq!(pool.alloc(2).unwrap(), vec![1, 2]);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn bad_frees_change_nothing() {
        let mut pool = BlockPool::new(130, 4).unwrap();
        pool.alloc(100).unwrap();
        let before = pool.clone();
        assert_eq!(
            pool.free(&[1, 2, 130]),
            Err(Error::PageOutOfRange {
                page: 130,
                num_pages: 130
            })
        );
        assert_eq!(
            pool.free(&[1, 99, 100]),
            Err(Error::PageNotAllocated { page: 100 })
        );
        assert_eq!(
            pool.free(&[70, 5, 70]),
            Err(Error::DuplicatePage { page: 70 })
        );
        assert_eq!(pool, before);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn is_allocated_is_false_out_of_range() {
        let mut pool = BlockPool::new(2, 1).unwrap();
        pool.alloc(2).unwrap();
        assert!(pool.is_allocated(1));
        assert!(!pool.is_allocated(2));
        assert!(!pool.is_allocated(usize::MAX));
    }

    #[test]
    fn check_invariants_detects_corruption() {
        let mut pool = BlockPool::new(3, 1).unwrap();
        pool.alloc(1).unwrap();
        let mut twice = pool.clone();
        twice.free.push(1);
        assert!(matches!(twice.check_invariants(), Err(Error::Invariant(_))));
        let mut lost = pool.clone();
        lost.free.pop();
        assert!(matches!(lost.check_invariants(), Err(Error::Invariant(_))));
        let mut marked = pool;
        marked.set_bit(2, true);
        assert!(matches!(
            marked.check_invariants(),
            Err(Error::Invariant(_))
        ));
    }

    #[test]
    fn state_ids_are_distinct() {
        let mut pool = BlockPool::new(1, 1).unwrap();
        let a = pool.issue_state_id();
        let b = pool.issue_state_id();
        assert_ne!(a, b);
    }
}
