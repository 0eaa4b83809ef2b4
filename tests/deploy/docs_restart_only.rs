//! docs.md's table of keys read at start only and `config::RESTART_ONLY`, the list the reload
//! warns from, name the same keys in the same order.

use std::path::Path;

use kv_indexer::config::RESTART_ONLY;

/// The first-column keys of the table under docs.md's `### Keys read at start only` heading.
fn documented_keys() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs.md");
    let docs = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let section: Vec<&str> = docs
        .lines()
        .skip_while(|l| *l != "### Keys read at start only")
        .skip(1)
        .take_while(|l| !l.starts_with('#'))
        .collect();
    assert!(
        !section.is_empty(),
        "docs.md: no ### Keys read at start only section"
    );
    section
        .iter()
        .filter_map(|l| l.strip_prefix("| `"))
        .map(|rest| {
            let (key, _) = rest
                .split_once("` |")
                .unwrap_or_else(|| panic!("docs.md: malformed restart-only row: {rest}"));
            key.to_string()
        })
        .collect()
}

#[test]
fn docs_list_exactly_the_restart_only_keys_of_the_code() {
    let documented = documented_keys();
    let restart_only: Vec<&str> = RESTART_ONLY.iter().map(|key| key.key).collect();
    assert_eq!(
        documented, restart_only,
        "docs.md \"Keys read at start only\" against config::RESTART_ONLY"
    );
}
