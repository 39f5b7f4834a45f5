//! The dependency rules of `docs/ARCHITECTURE.md` hold: every library crate's kiln
//! dependencies (dev-dependencies excluded) are among those the document allows it, so no crate
//! depends upward, and the document names every crate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The allowed edges, read from the "Dependency direction" paragraph: `` `a -> {b, c}` ``,
/// `` `a -> b` ``, and `` `x` depends on no other kiln crate `` / `` `y` on none ``.
fn documented() -> BTreeMap<String, BTreeSet<String>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    let start = doc
        .find("Dependency direction")
        .expect("the dependency paragraph");
    let para: String = doc[start..]
        .split("\n\n")
        .next()
        .unwrap()
        .replace('\n', " ");
    let mut rules = BTreeMap::new();
    for code in para.split('`').skip(1).step_by(2) {
        if let Some((from, to)) = code.split_once("->") {
            let to: BTreeSet<String> = to
                .trim()
                .trim_start_matches('{')
                .trim_end_matches('}')
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect();
            rules.insert(from.trim().to_string(), to);
        } else {
            rules.entry(code.trim().to_string()).or_default();
        }
    }
    rules
}

/// The kiln crates a manifest's `[dependencies]` names (without the `kiln-` prefix).
fn kiln_deps(manifest: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(manifest).unwrap();
    let mut in_deps = false;
    let mut out = BTreeSet::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
        } else if in_deps {
            if let Some(rest) = line.strip_prefix("kiln-") {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                out.insert(name);
            }
        }
    }
    out
}

#[test]
fn no_crate_depends_against_the_documented_direction() {
    let rules = documented();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let mut checked = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let dir = entry.unwrap().path();
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        if name == "testkit" {
            continue; // a dev-dependency only, checked by its own rule in the document
        }
        let allowed = rules
            .get(&name)
            .unwrap_or_else(|| panic!("docs/ARCHITECTURE.md gives no rule for crate {name}"));
        let deps = kiln_deps(&dir.join("Cargo.toml"));
        let extra: Vec<&String> = deps.difference(allowed).collect();
        assert!(
            extra.is_empty(),
            "kiln-{name} depends on {extra:?}, which docs/ARCHITECTURE.md does not allow \
             (allowed: {allowed:?})"
        );
        checked += 1;
    }
    println!("{checked} crates follow the documented dependency direction");
    assert!(checked >= 11, "only {checked} crates found");
}

/// The longest a source file may be before it must say why it is one concept.
const MAX_LINES: usize = 800;

/// Whether a file's module comment (its leading `//!` lines) says why it is one concept, with a
/// line that starts `//! One concept:`.
fn says_one_concept(text: &str) -> bool {
    text.lines()
        .take_while(|l| l.starts_with("//!"))
        .any(|l| l.starts_with("//! One concept:"))
}

#[test]
fn no_source_file_is_longer_than_the_limit_unless_it_says_why() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = kiln_testkit::rust_sources(&root.join("src"));
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        let src = entry.unwrap().path().join("src");
        if src.is_dir() {
            files.extend(kiln_testkit::rust_sources(&src));
        }
    }
    assert!(files.len() > 100, "only {} source files found", files.len());
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            let n = text.lines().count();
            (n > MAX_LINES && !says_one_concept(&text))
                .then(|| format!("{} ({n} lines)", f.strip_prefix(root).unwrap().display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "source files over {MAX_LINES} lines whose module comment gives no `//! One concept:` \
         reason; split them by concept: {long:?}"
    );
    println!(
        "{} source files, none over {MAX_LINES} lines without a reason",
        files.len()
    );
}

#[test]
fn the_line_limit_check_sees_a_long_file_and_its_reason() {
    let long = "fn f() {}\n".repeat(MAX_LINES + 1);
    assert!(long.lines().count() > MAX_LINES && !says_one_concept(&long));
    let justified = format!("//! A parser.\n//! One concept: one grammar's rules.\n{long}");
    assert!(says_one_concept(&justified));
    let late = format!("//! A parser.\n\n//! One concept: too late.\n{long}");
    assert!(!says_one_concept(&late));
}
