//! Whole-step calls over many target sequences: one forward's plan (rows, slots, page tables,
//! the attention kernel's ragged offsets), the accepts after a verify, and freeing.
//!
//! Every call checks every sequence before it changes any (errors name the sequence's index
//! through [`Error::InSequence`]), so a refused call leaves every sequence as it was.

use std::ops::DerefMut;

use crate::error::{Error, Result};
use crate::pages::SeqPages;
use crate::pool::BlockPool;

/// What one forward over many sequences writes and reads, in the sequences' order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ForwardPlan {
    /// Token position of every new row, sequence after sequence.
    pub positions: Vec<usize>,
    /// Paged-cache slot of every new row (same order).
    pub slots: Vec<usize>,
    /// `n + 1` cumulative row offsets: sequence `i`'s rows are `q_starts[i] .. q_starts[i + 1]`.
    pub q_starts: Vec<usize>,
    /// Per sequence the tokens its new rows attend to: `length + rows`.
    pub kv_lens: Vec<usize>,
    /// The most new rows of any sequence.
    pub max_rows: usize,
    /// The most pages any sequence's forward reads.
    pub max_pages: usize,
    /// Every sequence's pages that hold its first `kv_lens[i]` tokens (the pages its forward
    /// reads and writes), back to back; sequence `i`'s are
    /// `pages[page_starts[i] .. page_starts[i + 1]]`.
    pages: Vec<usize>,
    page_starts: Vec<usize>,
}

impl ForwardPlan {
    /// New rows in all.
    #[must_use]
    pub fn n_rows(&self) -> usize {
        self.positions.len()
    }

    /// Sequences in the plan.
    #[must_use]
    pub fn n_seqs(&self) -> usize {
        self.kv_lens.len()
    }

    /// Sequence `i`'s page table: its pages that hold its first `kv_lens[i]` tokens.
    ///
    /// # Panics
    /// When `i >= n_seqs()`.
    #[must_use]
    pub fn pages_of(&self, i: usize) -> &[usize] {
        &self.pages[self.page_starts[i]..self.page_starts[i + 1]]
    }

    fn check_width(&self, width: usize) -> Result<()> {
        if width < self.max_pages {
            return Err(Error::invalid_argument(
                "width",
                format!(
                    "{width} is less than the {} pages of the widest sequence",
                    self.max_pages
                ),
            ));
        }
        Ok(())
    }

    /// The `n x width` page table, row-major, each row zero padded.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `width < max_pages`.
    pub fn page_table(&self, width: usize) -> Result<Vec<usize>> {
        self.check_width(width)?;
        let mut out = vec![0; self.n_seqs() * width];
        self.write_table(&mut out, width, true, |b| b);
        Ok(out)
    }

    /// [`Self::page_table`] written into `out` (`n * width` elements, row-major) as `i32`, the
    /// attention kernel's index type.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `width < max_pages`, `out` has another length, or a page
    /// id does not fit in `i32`; `out` is untouched.
    pub fn fill_page_table(&self, out: &mut [i32], width: usize) -> Result<()> {
        self.fill_rows(out, width, true)
    }

    /// [`Self::fill_page_table`] without the padding: each row's pages are written and the
    /// entries past them keep what they held. For a caller whose kernels read no entry past a
    /// sequence's pages (they mask keys at its length): a table as wide as `max_seq_len` then
    /// costs each step only the pages in use, not its width.
    ///
    /// # Errors
    /// As [`Self::fill_page_table`]; `out` is untouched.
    pub fn fill_page_table_pages(&self, out: &mut [i32], width: usize) -> Result<()> {
        self.fill_rows(out, width, false)
    }

    fn fill_rows(&self, out: &mut [i32], width: usize, pad: bool) -> Result<()> {
        self.check_width(width)?;
        let want = self.n_seqs() * width;
        if out.len() != want {
            return Err(Error::invalid_argument(
                "out",
                format!(
                    "{} elements, the table has {} x {width} = {want}",
                    out.len(),
                    self.n_seqs()
                ),
            ));
        }
        if let Some(&b) = self.pages.iter().find(|&&b| i32::try_from(b).is_err()) {
            return Err(Error::invalid_argument(
                "out",
                format!("page id {b} does not fit in int32"),
            ));
        }
        self.write_table(out, width, pad, |b| i32::try_from(b).unwrap_or(i32::MAX));
        Ok(())
    }

    fn write_table<T: Copy + Default>(
        &self,
        out: &mut [T],
        width: usize,
        pad: bool,
        conv: impl Fn(usize) -> T,
    ) {
        if width == 0 {
            return;
        }
        for (i, row) in out.chunks_exact_mut(width).enumerate() {
            let pages = self.pages_of(i);
            for (dst, &b) in row.iter_mut().zip(pages) {
                *dst = conv(b);
            }
            if pad {
                row[pages.len()..].fill(T::default());
            }
        }
    }
}

/// `got` entries of the argument `name` (`label` in the message) for `n` sequences.
fn same_len(name: &'static str, label: &str, got: usize, n: usize) -> Result<()> {
    if got == n {
        Ok(())
    } else {
        Err(Error::invalid_argument(
            name,
            format!("{n} sequences but {got} {label}"),
        ))
    }
}

/// Every sequence belongs to `owner` (checked before any other rule of a whole-step call).
///
/// # Errors
/// [`Error::InSequence`] around [`Error::ForeignSequence`].
pub fn ensure_owners(seqs: &[&mut SeqPages], owner: u64) -> Result<()> {
    for (i, s) in seqs.iter().enumerate() {
        s.ensure_owner(owner).map_err(|e| e.in_sequence(i))?;
    }
    Ok(())
}

/// `r` as the row count of a forward on `s`, by [`SeqPages::check_forward`]'s rules (a freed
/// sequence is refused as such whatever the count).
fn forward_rows(s: &SeqPages, r: i64) -> Result<usize> {
    let Ok(rows) = usize::try_from(r) else {
        s.ensure_live()?;
        return Err(Error::invalid_argument(
            "rows",
            format!("must be >= 1, got {r}"),
        ));
    };
    s.check_forward(rows)?;
    Ok(rows)
}

/// `k` as the accept count of `s`, by [`SeqPages::check_accept`]'s rules (as
/// [`forward_rows`], freed first).
fn accept_count(s: &SeqPages, k: i64) -> Result<usize> {
    let Ok(count) = usize::try_from(k) else {
        s.ensure_live()?;
        return Err(Error::invalid_argument(
            "counts",
            format!("must be >= 0, got {k}"),
        ));
    };
    s.check_accept_as(count, "counts")?;
    Ok(count)
}

/// Plan one forward over `rows[i]` new rows of each sequence: check every sequence (owned by
/// `owner`, live, `rows[i] >= 1`, within its capacity), then mark each one's rows pending and
/// return where they go. Allocates nothing.
///
/// # Errors
/// [`Error::InvalidArgument`] when the lengths differ; [`Error::InSequence`] around
/// [`Error::ForeignSequence`], [`Error::Freed`] or [`Error::InvalidArgument`] (`rows`). Nothing
/// changes.
pub fn plan_forward(seqs: &mut [&mut SeqPages], rows: &[i64], owner: u64) -> Result<ForwardPlan> {
    same_len("rows", "row counts", rows.len(), seqs.len())?;
    ensure_owners(seqs, owner)?;
    let mut counts = Vec::with_capacity(rows.len());
    for (i, (s, &r)) in seqs.iter().zip(rows).enumerate() {
        counts.push(forward_rows(s, r).map_err(|e| e.in_sequence(i))?);
    }
    let n = seqs.len();
    let total: usize = counts.iter().sum();
    let mut plan = ForwardPlan {
        positions: Vec::with_capacity(total),
        slots: Vec::with_capacity(total),
        q_starts: Vec::with_capacity(n + 1),
        kv_lens: Vec::with_capacity(n),
        pages: Vec::new(),
        page_starts: Vec::with_capacity(n + 1),
        ..ForwardPlan::default()
    };
    plan.q_starts.push(0);
    plan.page_starts.push(0);
    for (s, &r) in seqs.iter_mut().zip(&counts) {
        s.rows_into(r, &mut plan.positions, &mut plan.slots);
        plan.q_starts.push(plan.positions.len());
        let kv_len = s.length() + r;
        plan.kv_lens.push(kv_len);
        plan.max_rows = plan.max_rows.max(r);
        // The forward reads and writes only the pages that hold its first `kv_len` tokens;
        // the rest of the sequence's reservation stays out of the plan, so a plan (and a table
        // filled from it) costs the pages in use, not the sequence's capacity.
        let used = kv_len.div_ceil(s.page_size()).min(s.num_pages());
        plan.pages.extend_from_slice(&s.pages()[..used]);
        plan.page_starts.push(plan.pages.len());
        plan.max_pages = plan.max_pages.max(used);
        // Checked above; the sequences are borrowed exclusively, so nothing changed since.
        s.forward(r)?;
    }
    Ok(plan)
}

/// Commit the first `counts[i]` pending rows of each sequence after checking every one (owned
/// by `owner`, live, `0 <= counts[i] <= pending`).
///
/// # Errors
/// [`Error::InvalidArgument`] when the lengths differ; [`Error::InSequence`] around
/// [`Error::ForeignSequence`], [`Error::Freed`] or [`Error::InvalidArgument`] (`counts`).
/// Nothing changes.
pub fn accept_rows(seqs: &mut [&mut SeqPages], counts: &[i64], owner: u64) -> Result<()> {
    same_len("counts", "accept counts", counts.len(), seqs.len())?;
    ensure_owners(seqs, owner)?;
    let mut ks = Vec::with_capacity(counts.len());
    for (i, (s, &k)) in seqs.iter().zip(counts).enumerate() {
        ks.push(accept_count(s, k).map_err(|e| e.in_sequence(i))?);
    }
    for (s, k) in seqs.iter_mut().zip(ks) {
        s.accept(k)?;
    }
    Ok(())
}

/// Free every sequence (each into the pool `pool_for(i)` gives) after checking that every one
/// belongs to `owner`. Returns how many were live; freed ones are skipped.
///
/// # Errors
/// [`Error::InSequence`] around [`Error::ForeignSequence`] (nothing freed), or around the error
/// of a sequence that cannot be freed (a broken invariant; the ones before it are freed).
pub fn free_all<P: DerefMut<Target = BlockPool>>(
    seqs: &mut [&mut SeqPages],
    owner: u64,
    mut pool_for: impl FnMut(usize) -> Result<P>,
) -> Result<usize> {
    ensure_owners(seqs, owner)?;
    let mut live = 0;
    for (i, s) in seqs.iter_mut().enumerate() {
        if s.freed() {
            continue;
        }
        let mut pool = pool_for(i)?;
        if s.free(&mut pool).map_err(|e| e.in_sequence(i))? {
            live += 1;
        }
    }
    Ok(live)
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    fn seqs(pool: &mut BlockPool, caps: &[usize], owner: u64) -> Vec<SeqPages> {
        caps.iter()
            .map(|&c| SeqPages::new(pool, c, owner).unwrap())
            .collect()
    }

    fn refs(v: &mut [SeqPages]) -> Vec<&mut SeqPages> {
        v.iter_mut().collect()
    }

    #[test]
    fn plan_forward_lays_out_rows_slots_and_tables() {
        let mut pool = BlockPool::new(16, 4).unwrap();
        let mut v = seqs(&mut pool, &[10, 4, 13], 1);
        // commit 6 tokens on the first sequence
        v[0].forward(6).unwrap();
        v[0].accept(6).unwrap();
        let plan = plan_forward(&mut refs(&mut v), &[3, 2, 1], 1).unwrap();
        assert_eq!(plan.n_rows(), 6);
        assert_eq!(plan.positions, vec![6, 7, 8, 0, 1, 0]);
        let want: Vec<usize> = [(0, 6), (0, 7), (0, 8), (1, 0), (1, 1), (2, 0)]
            .iter()
            .map(|&(i, p)| v[i].slot(p).unwrap())
            .collect();
        assert_eq!(plan.slots, want);
        assert_eq!(plan.q_starts, vec![0, 3, 5, 6]);
        assert_eq!(plan.kv_lens, vec![9, 2, 1]);
        // The third sequence holds pages 4..=7 but its forward reads one token: page 4 only.
        assert_eq!((plan.max_rows, plan.max_pages), (3, 3));
        assert_eq!(plan.pages_of(2), [4]);
        assert_eq!(
            plan.page_table(4).unwrap(),
            vec![0, 1, 2, 0, 3, 0, 0, 0, 4, 0, 0, 0]
        );
        assert_eq!(plan.page_table(5).unwrap().len(), 15);
        assert!(matches!(
            plan.page_table(2),
            Err(Error::InvalidArgument { name: "width", .. })
        ));
        assert_eq!(
            v.iter().map(SeqPages::pending).collect::<Vec<_>>(),
            vec![3, 2, 1]
        );
    }

    #[test]
    fn fill_page_table_equals_page_table() {
        let mut pool = BlockPool::new(16, 2).unwrap();
        let mut v = seqs(&mut pool, &[3, 7, 1], 0);
        let plan = plan_forward(&mut refs(&mut v), &[1, 1, 1], 0).unwrap();
        for width in 4..7 {
            let mut out = vec![-5i32; 3 * width];
            plan.fill_page_table(&mut out, width).unwrap();
            let want: Vec<i32> = plan
                .page_table(width)
                .unwrap()
                .into_iter()
                .map(|b| i32::try_from(b).unwrap())
                .collect();
            assert_eq!(out, want);
        }
        let mut short = vec![-5i32; 11];
        assert!(matches!(
            plan.fill_page_table(&mut short, 4),
            Err(Error::InvalidArgument { name: "out", .. })
        ));
        assert!(plan.fill_page_table(&mut short, 3).is_err());
        assert!(
            short.iter().all(|&x| x == -5),
            "a refused fill writes nothing"
        );
    }

    #[test]
    fn fill_pages_writes_the_pages_and_keeps_the_rest() {
        let mut pool = BlockPool::new(16, 2).unwrap();
        let mut v = seqs(&mut pool, &[3, 7, 1], 0);
        let plan = plan_forward(&mut refs(&mut v), &[1, 1, 1], 0).unwrap();
        let width = 6;
        let full: Vec<i32> = plan
            .page_table(width)
            .unwrap()
            .into_iter()
            .map(|b| i32::try_from(b).unwrap())
            .collect();
        let mut out = vec![-5i32; 3 * width];
        plan.fill_page_table_pages(&mut out, width).unwrap();
        for (i, row) in out.chunks_exact(width).enumerate() {
            let used = plan.pages_of(i).len();
            assert_eq!(row[..used], full[i * width..i * width + used], "row {i}");
            assert!(row[used..].iter().all(|&x| x == -5), "row {i}: {row:?}");
        }
        let mut short = vec![-5i32; 11];
        assert!(plan.fill_page_table_pages(&mut short, 4).is_err());
        assert!(plan.fill_page_table_pages(&mut out, 3).is_err());
        assert!(
            short.iter().all(|&x| x == -5),
            "a refused fill writes nothing"
        );
    }

    #[test]
    fn fill_refuses_page_ids_beyond_int32() {
        let plan = ForwardPlan {
            kv_lens: vec![1],
            max_pages: 1,
            pages: vec![1 << 31],
            page_starts: vec![0, 1],
            ..ForwardPlan::default()
        };
        let mut out = [0i32; 1];
        match plan.fill_page_table(&mut out, 1) {
            Err(Error::InvalidArgument {
                name: "out",
                reason,
            }) => {
                assert!(reason.contains("int32"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(out, [0]);
    }

    #[test]
    fn an_empty_call_is_an_empty_plan() {
        let plan = plan_forward(&mut [], &[], 0).unwrap();
        assert_eq!((plan.n_rows(), plan.n_seqs()), (0, 0));
        assert_eq!(plan.q_starts, vec![0]);
        assert!(plan.page_table(0).unwrap().is_empty());
        plan.fill_page_table(&mut [], 0).unwrap();
        accept_rows(&mut [], &[], 0).unwrap();
        let pool = RefCell::new(BlockPool::new(1, 1).unwrap());
        assert_eq!(free_all(&mut [], 0, |_| Ok(pool.borrow_mut())), Ok(0));
    }

    #[test]
    fn plan_forward_checks_everything_first() {
        let mut pool = BlockPool::new(16, 4).unwrap();
        let mut v = seqs(&mut pool, &[8, 8, 8], 1);
        v[1].forward(2).unwrap();
        let mut foreign = seqs(&mut pool, &[8], 2);
        let mut freed = seqs(&mut pool, &[8], 1);
        freed[0].free(&mut pool).unwrap();
        let before = v.clone();
        let cases: Vec<(Vec<i64>, usize, &str)> = vec![
            (vec![1, 1, 9], 2, "capacity of 8"),
            (vec![1, 0, 1], 1, ">= 1, got 0"),
            (vec![-2, 1, 1], 0, ">= 1, got -2"),
        ];
        for (rows, at, words) in cases {
            match plan_forward(&mut refs(&mut v), &rows, 1) {
                Err(Error::InSequence { index, source }) => {
                    assert_eq!(index, at, "{rows:?}");
                    assert!(source.to_string().contains(words), "{source}");
                }
                other => panic!("{rows:?}: {other:?}"),
            }
            assert_eq!(v, before, "{rows:?}");
        }
        assert!(matches!(
            plan_forward(&mut refs(&mut v), &[1, 1], 1),
            Err(Error::InvalidArgument { name: "rows", .. })
        ));
        let mut mixed: Vec<&mut SeqPages> = v.iter_mut().chain(foreign.iter_mut()).collect();
        let err = plan_forward(&mut mixed, &[1, 1, 1, 1], 1).unwrap_err();
        assert_eq!(
            err,
            Error::ForeignSequence {
                owner: 2,
                expected: 1
            }
            .in_sequence(3)
        );
        let mut mixed: Vec<&mut SeqPages> = v.iter_mut().chain(freed.iter_mut()).collect();
        let err = plan_forward(&mut mixed, &[1, 1, 1, 1], 1).unwrap_err();
        assert_eq!(err, Error::Freed.in_sequence(3));
        assert_eq!(err.to_string(), "sequence 3: the context state was freed");
        // freed comes before the count's own rules
        let err = plan_forward(&mut mixed, &[1, 1, 1, -1], 1).unwrap_err();
        assert_eq!(err, Error::Freed.in_sequence(3));
        assert_eq!(
            accept_rows(&mut mixed, &[0, 0, 0, -1], 1),
            Err(Error::Freed.in_sequence(3))
        );
        assert_eq!(v, before);
    }

    #[test]
    fn accept_rows_checks_everything_first() {
        let mut pool = BlockPool::new(16, 4).unwrap();
        let mut v = seqs(&mut pool, &[8, 8], 1);
        plan_forward(&mut refs(&mut v), &[3, 2], 1).unwrap();
        let before = v.clone();
        for (counts, at) in [(vec![3, 3], 1), (vec![-1, 0], 0)] {
            match accept_rows(&mut refs(&mut v), &counts, 1) {
                Err(Error::InSequence { index, source }) => {
                    assert_eq!(index, at);
                    assert!(
                        matches!(*source, Error::InvalidArgument { name: "counts", .. }),
                        "{source}"
                    );
                }
                other => panic!("{counts:?}: {other:?}"),
            }
            assert_eq!(v, before);
        }
        assert!(matches!(
            accept_rows(&mut refs(&mut v), &[0, 0], 9),
            Err(Error::InSequence { index: 0, .. })
        ));
        assert!(accept_rows(&mut refs(&mut v), &[0], 1).is_err());
        assert_eq!(v, before);
        accept_rows(&mut refs(&mut v), &[3, 1], 1).unwrap();
        assert_eq!(
            v.iter()
                .map(|s| (s.length(), s.pending()))
                .collect::<Vec<_>>(),
            vec![(3, 0), (1, 0)]
        );
    }

    #[test]
    fn free_all_checks_owners_first_and_counts_live_ones() {
        let pool = RefCell::new(BlockPool::new(16, 4).unwrap());
        let mut v = seqs(&mut pool.borrow_mut(), &[8, 8, 8], 1);
        v[1].free(&mut pool.borrow_mut()).unwrap();
        let mut foreign = seqs(&mut pool.borrow_mut(), &[4], 2);
        let before = (v.clone(), pool.borrow().clone());
        let mut mixed: Vec<&mut SeqPages> = v.iter_mut().chain(foreign.iter_mut()).collect();
        assert!(matches!(
            free_all(&mut mixed, 1, |_| Ok(pool.borrow_mut())),
            Err(Error::InSequence { index: 3, .. })
        ));
        assert_eq!((v.clone(), pool.borrow().clone()), before);
        assert_eq!(
            free_all(&mut refs(&mut v), 1, |_| Ok(pool.borrow_mut())),
            Ok(2)
        );
        assert_eq!(pool.borrow().num_free(), 15);
        assert_eq!(
            free_all(&mut refs(&mut v), 1, |_| Ok(pool.borrow_mut())),
            Ok(0)
        );
        assert!(v.iter().all(SeqPages::freed));
        foreign[0].free(&mut pool.borrow_mut()).unwrap();
        assert_eq!(pool.borrow().num_free(), 16);
    }
}
