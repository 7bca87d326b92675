//! The per-sequence context window: how many context rows a sequence's accumulator keeps.
//!
//! `ceiling = max_seq_len` if the cap is 0, else `min(max_seq_len, cap)`;
//! `window = min(ceiling, budget_tokens + block_size + 1)`, saturating, with an unknown budget
//! meaning the ceiling. The cap comes from [`ENV_CTX_CAP`] unless given explicitly.

use crate::error::{Error, Result};

/// Environment variable holding the context-window cap.
pub const ENV_CTX_CAP: &str = "BLOCKDRAFT_DFLASH_CTX_CAP";

/// Cap used when [`ENV_CTX_CAP`] is unset.
pub const DEFAULT_CTX_CAP: usize = 16384;

/// Parse the cap from the raw environment value (`None` = unset).
///
/// Surrounding whitespace is ignored; anything but a non-negative integer is an error rather
/// than a silent default, because a typo here silently changes memory use per sequence.
///
/// # Errors
/// [`Error::Config`] naming the variable and the rejected value.
pub fn parse_ctx_cap(raw: Option<&str>) -> Result<usize> {
    let Some(raw) = raw else {
        return Ok(DEFAULT_CTX_CAP);
    };
    raw.trim().parse::<usize>().map_err(|_| {
        Error::Config(format!(
            "{ENV_CTX_CAP}={raw:?} is not a non-negative integer (tokens; 0 = uncapped)"
        ))
    })
}

/// The cap from the process environment (default [`DEFAULT_CTX_CAP`], 0 = uncapped).
///
/// # Errors
/// [`Error::Config`] when the value is not a non-negative integer (or not valid Unicode).
pub fn read_ctx_cap() -> Result<usize> {
    match std::env::var(ENV_CTX_CAP) {
        Ok(v) => parse_ctx_cap(Some(&v)),
        Err(std::env::VarError::NotPresent) => parse_ctx_cap(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::Config(format!(
            "{ENV_CTX_CAP}={v:?} is not valid Unicode"
        ))),
    }
}

/// `max_seq_len` if `cap == 0`, else `min(max_seq_len, cap)`.
///
/// # Errors
/// [`Error::InvalidArgument`] when `max_seq_len` is 0.
pub fn ctx_ceiling(max_seq_len: usize, cap: usize) -> Result<usize> {
    if max_seq_len == 0 {
        return Err(Error::invalid_argument(
            "max_seq_len",
            "must be >= 1, got 0",
        ));
    }
    Ok(if cap == 0 {
        max_seq_len
    } else {
        max_seq_len.min(cap)
    })
}

/// Rows of the context accumulator: `min(ceiling, budget_tokens + block_size + 1)`, saturating.
///
/// # Errors
/// [`Error::InvalidArgument`] when `max_seq_len` or `block_size` is 0.
pub fn ctx_window(
    max_seq_len: usize,
    block_size: usize,
    budget_tokens: Option<usize>,
    cap: usize,
) -> Result<usize> {
    let ceiling = ctx_ceiling(max_seq_len, cap)?;
    if block_size == 0 {
        return Err(Error::invalid_argument("block_size", "must be >= 1, got 0"));
    }
    Ok(match budget_tokens {
        None => ceiling,
        Some(b) => ceiling.min(b.saturating_add(block_size).saturating_add(1)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_cap() {
        assert_eq!(parse_ctx_cap(None), Ok(DEFAULT_CTX_CAP));
        assert_eq!(parse_ctx_cap(Some("0")), Ok(0));
        assert_eq!(parse_ctx_cap(Some(" 4096\n")), Ok(4096));
        for bad in ["", "-1", "16k", "1.5", "abc", "99999999999999999999999"] {
            let err = parse_ctx_cap(Some(bad)).unwrap_err();
            assert!(
                matches!(&err, Error::Config(m) if m.contains(ENV_CTX_CAP)),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn ceiling_applies_cap_unless_zero() {
        assert_eq!(ctx_ceiling(32768, 0), Ok(32768));
        assert_eq!(ctx_ceiling(32768, 16384), Ok(16384));
        assert_eq!(ctx_ceiling(1000, 16384), Ok(1000));
        assert!(ctx_ceiling(0, 1).is_err());
    }

    #[test]
    fn window_is_budget_bounded_and_saturates() {
        assert_eq!(ctx_window(4096, 8, None, 0), Ok(4096));
        assert_eq!(ctx_window(4096, 8, Some(100), 0), Ok(109));
        assert_eq!(ctx_window(4096, 8, Some(0), 0), Ok(9));
        assert_eq!(ctx_window(4096, 8, Some(5000), 1024), Ok(1024));
        assert_eq!(ctx_window(4096, 8, Some(usize::MAX), 0), Ok(4096));
        assert_eq!(
            ctx_window(usize::MAX, usize::MAX, Some(usize::MAX), 0),
            Ok(usize::MAX)
        );
        assert!(matches!(
            ctx_window(10, 0, None, 0),
            Err(Error::InvalidArgument {
                name: "block_size",
                ..
            })
        ));
        assert!(matches!(
            ctx_window(0, 1, None, 0),
            Err(Error::InvalidArgument {
                name: "max_seq_len",
                ..
            })
        ));
    }
}
