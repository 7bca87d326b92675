//! Batch policy of `propose_batch`: how wide a batch may be, when to decline, and how the
//! drafter's `n * block_size` output tokens split into per-sequence drafts.
//!
//! These are total functions of their arguments so Python can pass raw lever values (which
//! may be 0 or negative) and get the documented formula.

use crate::error::{Error, Result};

/// 1 without a batched path or when `width < 2`; else `min(width, max(max_batch, 1))`.
#[must_use]
pub fn propose_batch_max(batched_path: bool, width: i64, max_batch: i64) -> i64 {
    if !batched_path || width < 2 {
        return 1;
    }
    width.min(max_batch.max(1))
}

/// Why `propose_batch` must decline before doing any work, or `None` to proceed.
///
/// Checked in a fixed order, so a call with several faults always names the same one: too few,
/// too many, mismatched lengths, no batched path.
#[must_use]
pub fn batch_decline_reason(
    n: i64,
    max_batch: i64,
    batched_path: bool,
    num_positions: i64,
    num_states: i64,
) -> Option<String> {
    if n < 2 {
        Some(format!("fewer than 2 sequences (n={n})"))
    } else if n > max_batch {
        Some(format!("{n} sequences exceed max_batch={max_batch}"))
    } else if num_positions != n {
        Some(format!("{num_positions} positions for {n} sequences"))
    } else if num_states != n {
        Some(format!("{num_states} states for {n} sequences"))
    } else if !batched_path {
        Some("no batched propose path".to_owned())
    } else {
        None
    }
}

/// Split `n * block_size` output tokens into `n` bands of drafts.
///
/// Band `i` is `tokens[i*block_size..(i+1)*block_size]`; with a mask token its row 0 (the
/// anchor) is dropped; at most `draft_cap` drafts are kept (`None` = all). Returns `Ok(None)`
/// when fewer than `n * block_size` tokens were given (the caller declines). Extra tokens are
/// ignored.
///
/// # Errors
/// [`Error::InvalidArgument`] when `n`, `block_size` or `draft_cap` is 0.
pub fn split_bands<T: Copy>(
    tokens: &[T],
    n: usize,
    block_size: usize,
    has_mask_token: bool,
    draft_cap: Option<usize>,
) -> Result<Option<Vec<Vec<T>>>> {
    if n == 0 {
        return Err(Error::invalid_argument("n", "must be >= 1, got 0"));
    }
    if block_size == 0 {
        return Err(Error::invalid_argument("block_size", "must be >= 1, got 0"));
    }
    if draft_cap == Some(0) {
        return Err(Error::invalid_argument("draft_cap", "must be >= 1, got 0"));
    }
    match n.checked_mul(block_size) {
        Some(total) if tokens.len() >= total => {}
        _ => return Ok(None),
    }
    let skip = usize::from(has_mask_token);
    let cap = draft_cap.unwrap_or(usize::MAX);
    Ok(Some(
        tokens
            .chunks_exact(block_size)
            .take(n)
            .map(|band| band.iter().skip(skip).take(cap).copied().collect())
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_max() {
        assert_eq!(propose_batch_max(false, 8, 16), 1);
        assert_eq!(propose_batch_max(true, 1, 16), 1);
        assert_eq!(propose_batch_max(true, -3, 16), 1);
        assert_eq!(propose_batch_max(true, 8, 16), 8);
        assert_eq!(propose_batch_max(true, 32, 16), 16);
        assert_eq!(propose_batch_max(true, 8, 0), 1);
        assert_eq!(propose_batch_max(true, 2, -5), 1);
    }

    #[test]
    fn decline_reasons_in_order() {
        assert!(batch_decline_reason(1, 8, true, 1, 1)
            .unwrap()
            .contains("fewer"));
        assert!(batch_decline_reason(9, 8, true, 9, 9)
            .unwrap()
            .contains("max_batch"));
        assert!(batch_decline_reason(4, 8, true, 3, 4)
            .unwrap()
            .contains("positions"));
        assert!(batch_decline_reason(4, 8, true, 4, 5)
            .unwrap()
            .contains("states"));
        assert!(batch_decline_reason(4, 8, false, 4, 4)
            .unwrap()
            .contains("batched"));
        assert_eq!(batch_decline_reason(4, 8, true, 4, 4), None);
        assert_eq!(batch_decline_reason(2, 2, true, 2, 2), None);
    }

    #[test]
    fn bands() {
        let t: Vec<i64> = (0..8).collect();
        assert_eq!(
            split_bands(&t, 2, 4, false, None).unwrap(),
            Some(vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]])
        );
        assert_eq!(
            split_bands(&t, 2, 4, true, None).unwrap(),
            Some(vec![vec![1, 2, 3], vec![5, 6, 7]])
        );
        assert_eq!(
            split_bands(&t, 2, 4, true, Some(2)).unwrap(),
            Some(vec![vec![1, 2], vec![5, 6]])
        );
        assert_eq!(
            split_bands(&t, 1, 4, false, Some(9)).unwrap(),
            Some(vec![vec![0, 1, 2, 3]])
        );
        assert_eq!(split_bands(&t, 3, 3, false, None).unwrap(), None);
        assert_eq!(split_bands(&t, usize::MAX, 2, false, None).unwrap(), None);
        assert!(split_bands(&t, 0, 4, false, None).is_err());
        assert!(split_bands(&t, 2, 0, false, None).is_err());
        assert!(split_bands(&t, 2, 4, false, Some(0)).is_err());
    }
}
