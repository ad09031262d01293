//! Accelerate's spellings of its enums (`"MULTI_CPU"`, `"bf16"`,
//! `"SHARDED_STATE_DICT"`, ...), parsed in any case, with a distinct error
//! for a value Accelerate has and hearth does not.

/// Parses `s` as one of `all`, whose Accelerate spelling `spell` gives
/// (in any case); a value of `elsewhere` (Accelerate's, for what hearth
/// does not have) is refused with `foreign()`, anything else with
/// `unknown()`.
pub fn parse_spelling<T: Copy>(
    s: &str,
    all: &[T],
    spell: impl Fn(T) -> &'static str,
    elsewhere: &[&str],
    foreign: impl FnOnce() -> String,
    unknown: impl FnOnce() -> String,
) -> Result<T, String> {
    if let Some(&t) = all.iter().find(|&&t| spell(t).eq_ignore_ascii_case(s)) {
        return Ok(t);
    }
    if elsewhere.iter().any(|e| e.eq_ignore_ascii_case(s)) {
        return Err(foreign());
    }
    Err(unknown())
}
