//! Slurm's compressed host lists (`node[01-04,07],gpu-a[1-2]`), expanded in order.

use crate::error::{LaunchError, Result};

fn bad(list: &str, message: impl Into<String>) -> LaunchError {
    LaunchError::Env {
        variable: format!("SLURM_JOB_NODELIST={list}"),
        message: message.into(),
    }
}

/// Expands a Slurm host list into host names, in Slurm's order.
///
/// Items are separated by commas outside brackets; each item is literal text with any number
/// of bracket groups, each group a comma-separated list of numbers or `lo-hi` ranges that keep
/// the zero padding of `lo` (`[01-03]` gives `01 02 03`). Several groups give their product
/// (`r[1-2]n[1-2]`: `r1n1 r1n2 r2n1 r2n2`).
///
/// ```
/// use kiln_launch::expand_nodelist;
/// assert_eq!(
///     expand_nodelist("node[01-03,07],login")?,
///     ["node01", "node02", "node03", "node07", "login"]
/// );
/// # Ok::<(), kiln_launch::LaunchError>(())
/// ```
pub fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    let mut hosts = Vec::new();
    for item in split_top(list).map_err(|m| bad(list, m))? {
        if item.is_empty() {
            return Err(bad(list, "an empty host name (two commas in a row?)"));
        }
        hosts.extend(expand_item(item).map_err(|m| bad(list, m))?);
        if hosts.len() > 1 << 20 {
            return Err(bad(list, "expands to over a million hosts"));
        }
    }
    if hosts.is_empty() {
        return Err(bad(list, "no host in the list"));
    }
    Ok(hosts)
}

/// Splits at commas that are not inside brackets.
fn split_top(list: &str) -> std::result::Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err(format!("nested '[' at byte {i}")),
            '[' => depth = 1,
            ']' if depth == 0 => return Err(format!("']' without '[' at byte {i}")),
            ']' => depth = 0,
            ',' if depth == 0 => {
                out.push(list[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err("a '[' is never closed".into());
    }
    out.push(list[start..].trim());
    Ok(out)
}

/// One item: literal pieces and bracket groups, expanded as a product.
fn expand_item(item: &str) -> std::result::Result<Vec<String>, String> {
    let mut partial = vec![String::new()];
    let mut rest = item;
    while !rest.is_empty() {
        match rest.find('[') {
            None => {
                partial.iter_mut().for_each(|p| p.push_str(rest));
                break;
            }
            Some(open) => {
                let lit = &rest[..open];
                let close = rest[open..]
                    .find(']')
                    .map(|c| open + c)
                    .ok_or_else(|| format!("'{item}': a '[' is never closed"))?;
                let choices =
                    expand_group(&rest[open + 1..close]).map_err(|m| format!("'{item}': {m}"))?;
                partial = partial
                    .iter()
                    .flat_map(|p| choices.iter().map(move |c| format!("{p}{lit}{c}")))
                    .collect();
                rest = &rest[close + 1..];
            }
        }
    }
    Ok(partial)
}

/// `01-04,07` into `01 02 03 04 07`.
fn expand_group(group: &str) -> std::result::Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in group.split(',').map(str::trim) {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let num = |s: &str| {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("'{part}' is not a number or a range lo-hi"));
            }
            s.parse::<u64>().map_err(|e| format!("'{s}': {e}"))
        };
        let (a, b) = (num(lo)?, num(hi)?);
        if b < a {
            return Err(format!("range '{part}' runs backwards"));
        }
        if b - a > 1 << 20 {
            return Err(format!("range '{part}' is too long"));
        }
        let width = lo.len();
        out.extend((a..=b).map(|v| format!("{v:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_examples_expand() {
        assert_eq!(expand_nodelist("tux").unwrap(), ["tux"]);
        assert_eq!(
            expand_nodelist("node[01-04,07]").unwrap(),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(
            expand_nodelist("gpu-a[9-11],cpu[1],login").unwrap(),
            ["gpu-a9", "gpu-a10", "gpu-a11", "cpu1", "login"]
        );
        assert_eq!(
            expand_nodelist("r[1-2]n[08-09]").unwrap(),
            ["r1n08", "r1n09", "r2n08", "r2n09"]
        );
        assert_eq!(
            expand_nodelist("a[098-101]-ib").unwrap(),
            ["a098-ib", "a099-ib", "a100-ib", "a101-ib"]
        );
    }

    #[test]
    fn malformed_lists_name_the_variable_and_the_fault() {
        for (list, what) in [
            ("node[01-04", "never closed"),
            ("node01-04]", "without '['"),
            ("node[04-01]", "backwards"),
            ("node[a-b]", "not a number"),
            ("node[1,,2]", "not a number"),
            ("a,,b", "empty host"),
            ("", "empty host"),
            ("n[[1]]", "nested"),
        ] {
            let e = expand_nodelist(list).unwrap_err().to_string();
            assert!(e.contains("SLURM_JOB_NODELIST"), "{list}: {e}");
            assert!(e.contains(what), "{list}: {e}");
        }
    }
}
