//! The per-sequence context window: how many context rows a sequence's accumulator keeps.
//!
//! `ceiling = max_seq_len` if the cap is 0, else `min(max_seq_len, cap)`;
//! `window = min(ceiling, budget_tokens + block_size + 1)`, saturating, with an unknown budget
//! meaning the ceiling. The cap comes from [`ENV_CTX_CAP`] unless given explicitly.
//!
//! When a commit overflows a full window, the slide leaves [`slide_room`] rows free beyond the
//! commit's: a fraction of the window, from [`ENV_SLIDE`] unless given explicitly
//! (`docs/design/window-slides.md` says why a fraction).

use crate::error::{Error, Result};

/// Environment variable holding the context-window cap.
pub const ENV_CTX_CAP: &str = "BLOCKDRAFT_DFLASH_CTX_CAP";

/// Cap used when [`ENV_CTX_CAP`] is unset.
pub const DEFAULT_CTX_CAP: usize = 16384;

/// Environment variable holding the slide room as a fraction of the window.
pub const ENV_SLIDE: &str = "BLOCKDRAFT_DFLASH_SLIDE";

/// Slide room used when [`ENV_SLIDE`] is unset: an eighth of the window, so one recompute of
/// the kept rows serves the next `window / 8` committed rows.
pub const DEFAULT_SLIDE: f64 = 0.125;

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

/// Parse the slide fraction from the raw environment value (`None` = unset): a decimal number
/// in `[0, 1)`; 0 slides by exactly the rows a commit needs. Surrounding whitespace is ignored.
///
/// # Errors
/// [`Error::Config`] naming the variable and the rejected value.
pub fn parse_slide(raw: Option<&str>) -> Result<f64> {
    let Some(raw) = raw else {
        return Ok(DEFAULT_SLIDE);
    };
    match raw.trim().parse::<f64>() {
        Ok(f) if (0.0..1.0).contains(&f) => Ok(f),
        _ => Err(Error::Config(format!(
            "{ENV_SLIDE}={raw:?} is not a fraction in [0, 1) (of the window a slide leaves free)"
        ))),
    }
}

/// The slide fraction from the process environment (default [`DEFAULT_SLIDE`]).
///
/// # Errors
/// [`Error::Config`] when the value is not a fraction in `[0, 1)` (or not valid Unicode).
pub fn read_slide() -> Result<f64> {
    match std::env::var(ENV_SLIDE) {
        Ok(v) => parse_slide(Some(&v)),
        Err(std::env::VarError::NotPresent) => parse_slide(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::Config(format!(
            "{ENV_SLIDE}={v:?} is not valid Unicode"
        ))),
    }
}

/// Rows a slide of a `window`-row context leaves free: `floor(window * fraction)`, at most
/// `window - 1` (a slide keeps room for a one-row commit's predecessors).
///
/// # Errors
/// [`Error::InvalidArgument`] when `window` is 0 or `fraction` is not in `[0, 1)`.
pub fn slide_room(window: usize, fraction: f64) -> Result<usize> {
    if window == 0 {
        return Err(Error::invalid_argument("window", "must be >= 1, got 0"));
    }
    if !(0.0..1.0).contains(&fraction) {
        return Err(Error::invalid_argument(
            "fraction",
            format!("must be in [0, 1), got {fraction}"),
        ));
    }
    // Exact for windows below 2^53 rows; the clamp keeps larger ones in range.
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let room = (window as f64 * fraction).floor() as usize;
    Ok(room.min(window - 1))
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
    fn parse_slide_fraction() {
        assert_eq!(parse_slide(None), Ok(DEFAULT_SLIDE));
        assert_eq!(parse_slide(Some("0")), Ok(0.0));
        assert_eq!(parse_slide(Some(" 0.25\n")), Ok(0.25));
        for bad in ["", "1", "1.0", "-0.1", "nan", "inf", "1/8", "abc"] {
            let err = parse_slide(Some(bad)).unwrap_err();
            assert!(
                matches!(&err, Error::Config(m) if m.contains(ENV_SLIDE)),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn slide_room_is_a_floored_fraction_below_the_window() {
        assert_eq!(slide_room(16384, DEFAULT_SLIDE), Ok(2048));
        assert_eq!(slide_room(16384, 0.0), Ok(0));
        assert_eq!(slide_room(100, 0.125), Ok(12));
        assert_eq!(slide_room(1, 0.9), Ok(0));
        assert_eq!(slide_room(10, 0.999_999), Ok(9));
        assert_eq!(slide_room(3, 1.0 - f64::EPSILON), Ok(2));
        assert!(slide_room(usize::MAX, 1.0 - f64::EPSILON).unwrap() < usize::MAX);
        assert!(slide_room(0, 0.5).is_err());
        for bad in [1.0, -0.5, f64::NAN] {
            assert!(matches!(
                slide_room(8, bad),
                Err(Error::InvalidArgument {
                    name: "fraction",
                    ..
                })
            ));
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
