//! Counting a launch's output lines by the rank that wrote them, for the tests that check the
//! launcher forwards every line whole (no line mixes two ranks' bytes, none is lost).

use crate::common::check;

/// How many of `lines` each of `N` ranks wrote: `rank_of` names the rank a line is a whole line
/// of, or `None`; the first line that is no rank's whole line fails with `what`.
pub fn per_rank<'a, const N: usize>(
    lines: impl IntoIterator<Item = &'a str>,
    rank_of: impl Fn(&str) -> Option<usize>,
    what: &str,
) -> Result<[usize; N], String> {
    let mut counts = [0usize; N];
    for line in lines {
        match rank_of(line) {
            Some(r) => counts[r] += 1,
            None => return check(false, what, format!("bad line: {line:?}")).map(|()| counts),
        }
    }
    Ok(counts)
}
