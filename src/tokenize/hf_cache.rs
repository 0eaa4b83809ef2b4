//! A model's tokenizer found in the local Hugging Face hub cache, as `huggingface_hub` lays it
//! out: `ROOT/models--ORG--NAME/refs/main` holds a commit hash, whose files are in
//! `ROOT/models--ORG--NAME/snapshots/HASH/`. The root is `HF_HUB_CACHE`, else `HF_HOME/hub`,
//! else `~/.cache/huggingface/hub`, as `huggingface_hub` chooses it.
//!
//! Owns: that lookup, and why a model is not there (`Missing`, each naming the path looked at).
//! Never: downloads, writes to the cache, or follows a `refs/main` out of its model's
//! `snapshots/` directory.

use std::path::{Path, PathBuf};

/// The hub cache directory of this process's environment, if one can be named.
pub fn hub_root() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
    if let Some(cache) = var("HF_HUB_CACHE") {
        return Some(PathBuf::from(cache));
    }
    if let Some(home) = var("HF_HOME") {
        return Some(PathBuf::from(home).join("hub"));
    }
    var("HOME").map(|home| PathBuf::from(home).join(".cache/huggingface/hub"))
}

/// Why a model has no tokenizer in the cache.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Missing {
    #[error("no Hugging Face cache: HF_HUB_CACHE, HF_HOME and HOME are all unset")]
    NoRoot,
    #[error("{0} is not a directory")]
    NoModel(PathBuf),
    #[error("{path}: names {hash:?}, not a snapshot of the model")]
    BadRef { path: PathBuf, hash: String },
    #[error("{0}: no refs/main, and not exactly one snapshot")]
    NoSnapshot(PathBuf),
    #[error("{0} is not a file")]
    NoTokenizer(PathBuf),
}

/// The snapshot directory holding `model`'s `tokenizer.json` under `root`: the one
/// `refs/main` names, else the only snapshot there is.
pub fn snapshot(root: &Path, model: &str) -> Result<PathBuf, Missing> {
    let dir = root.join(format!("models--{}", model.replace('/', "--")));
    if !dir.is_dir() {
        return Err(Missing::NoModel(dir));
    }
    let snapshots = dir.join("snapshots");
    let refs_main = dir.join("refs").join("main");
    let chosen = match std::fs::read_to_string(&refs_main) {
        Ok(text) => {
            let hash = text.trim();
            // A hash is one path component: `..` or a slash would leave `snapshots/`.
            if hash.is_empty() || hash.starts_with('.') || hash.contains(['/', '\\']) {
                return Err(Missing::BadRef {
                    path: refs_main,
                    hash: hash.to_owned(),
                });
            }
            snapshots.join(hash)
        }
        Err(_) => only_snapshot(&snapshots).ok_or_else(|| Missing::NoSnapshot(dir.clone()))?,
    };
    let tokenizer = chosen.join("tokenizer.json");
    if !tokenizer.is_file() {
        return Err(Missing::NoTokenizer(tokenizer));
    }
    Ok(chosen)
}

fn only_snapshot(snapshots: &Path) -> Option<PathBuf> {
    let mut dirs = std::fs::read_dir(snapshots)
        .ok()?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.is_dir());
    match (dirs.next(), dirs.next()) {
        (Some(only), None) => Some(only),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    }

    #[test]
    fn refs_main_names_the_snapshot_else_the_only_one_is_taken() {
        let root = tempfile::tempdir().expect("temp dir");
        let model = root.path().join("models--Org--Name");
        for hash in ["aaa", "bbb"] {
            write(
                &model.join("snapshots").join(hash).join("tokenizer.json"),
                "{}",
            );
        }
        write(&model.join("refs/main"), "bbb\n");
        assert_eq!(
            snapshot(root.path(), "Org/Name"),
            Ok(model.join("snapshots/bbb"))
        );

        // Two snapshots and no ref: which is the model's is not known.
        std::fs::remove_file(model.join("refs/main")).expect("rm");
        assert_eq!(
            snapshot(root.path(), "Org/Name"),
            Err(Missing::NoSnapshot(model.clone()))
        );
        std::fs::remove_dir_all(model.join("snapshots/aaa")).expect("rm");
        assert_eq!(
            snapshot(root.path(), "Org/Name"),
            Ok(model.join("snapshots/bbb"))
        );
    }

    #[test]
    fn a_model_a_ref_or_a_tokenizer_not_there_is_missing_and_a_ref_never_leaves_snapshots() {
        let root = tempfile::tempdir().expect("temp dir");
        assert_eq!(
            snapshot(root.path(), "gpt2"),
            Err(Missing::NoModel(root.path().join("models--gpt2")))
        );
        let model = root.path().join("models--gpt2");
        write(&model.join("snapshots/abc/config.json"), "{}");
        write(&model.join("refs/main"), "abc");
        assert_eq!(
            snapshot(root.path(), "gpt2"),
            Err(Missing::NoTokenizer(
                model.join("snapshots/abc/tokenizer.json")
            ))
        );
        for hash in ["../../elsewhere", "..", "", "a/b"] {
            write(&model.join("refs/main"), hash);
            assert!(
                matches!(snapshot(root.path(), "gpt2"), Err(Missing::BadRef { .. })),
                "{hash:?}"
            );
        }
    }
}
