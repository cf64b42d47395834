//! [`ranges_text`]: a sorted list of numbers (CPUs, ranks, nodes) as the ranges people write,
//! `0-3,8`, for messages and reports.

/// `v`, sorted and without repeats, as runs of consecutive numbers: `a-b` for a run, `a` alone,
/// joined by `sep` (`[0, 1, 2, 5, 7, 8]` with `", "` is `0-2, 5, 7-8`; empty for an empty `v`).
pub fn ranges_text(v: &[usize], sep: &str) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if j == i {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    out.join(sep)
}

#[cfg(test)]
mod tests {
    use super::ranges_text;

    #[test]
    fn runs_and_singles() {
        assert_eq!(ranges_text(&[0, 1, 2, 5, 7, 8], ", "), "0-2, 5, 7-8");
        assert_eq!(ranges_text(&[3], ","), "3");
        assert_eq!(ranges_text(&[], ","), "");
        assert_eq!(ranges_text(&[0, 1, 2, 3, 8], ","), "0-3,8");
    }
}
