use super::*;
use crate::index::{SavedBlock, SavedGroupSpec, SavedWriter, KEY_SCHEME};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;

fn identity() -> RankIdentity {
    RankIdentity {
        engine: "vllm-a".to_string(),
        dp_rank: 3,
        endpoint: "tcp://10.0.0.5:5558".to_string(),
        model: Some("Qwen/Qwen3-8B".to_string()),
        block_size: 16,
        key_scheme: KEY_SCHEME,
    }
}

fn block(engine_hash: u64, key: u64, parent: Option<u64>, copies: u32) -> SavedBlock {
    SavedBlock {
        engine_hash,
        key,
        parent,
        copies,
    }
}

fn state() -> RankState {
    RankState {
        identity: identity(),
        last_seq: 4242,
        last_digest: 0x0123_4567_89ab_cdef,
        saved_at_ms: 1_765_000_000_000,
        blocks: SavedBlocks {
            writers: vec![
                SavedWriter {
                    tier: 0,
                    group: 0,
                    blocks: vec![
                        block(u64::MAX, 11, None, 1),
                        block(2, 12, Some(11), 2),
                        block(3, 13, Some(12), 1),
                    ],
                    unheld_parents: Vec::new(),
                },
                SavedWriter {
                    tier: 0,
                    group: 1,
                    blocks: vec![block(7, 21, None, 1)],
                    unheld_parents: vec![(20, Some(19))],
                },
                SavedWriter {
                    tier: 1,
                    group: 0,
                    blocks: vec![block(1, 11, None, 3), block(9, 99, Some(11), 1)],
                    unheld_parents: Vec::new(),
                },
            ],
            group_specs: vec![
                Some(SavedGroupSpec {
                    kind: Some(0),
                    sliding_window: None,
                    block_size: 16,
                }),
                Some(SavedGroupSpec {
                    kind: Some(2),
                    sliding_window: Some(4096),
                    block_size: 16,
                }),
                None,
            ],
            lookahead: 1,
        },
    }
}

/// Every file name in `dir`.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

fn no_temporaries(dir: &Path) {
    let names = names(dir);
    assert!(
        names.iter().all(|name| !name.ends_with(".tmp")),
        "{names:?}"
    );
}

/// Writes `bytes` as `identity()`'s file and reads it back.
fn read_bytes(dir: &Path, bytes: &[u8]) -> Result<Option<RankState>, StateError> {
    fs::write(file_path(dir, "vllm-a", 3), bytes).unwrap();
    read(dir, &identity())
}

fn written_bytes(dir: &Path) -> Vec<u8> {
    let written = write(dir, &state()).unwrap();
    fs::read(written.path).unwrap()
}

#[test]
fn a_written_state_reads_back_equal() {
    let dir = tempfile::tempdir().unwrap();
    let written = write(dir.path(), &state()).unwrap();
    assert_eq!(written.path, file_path(dir.path(), "vllm-a", 3));
    assert_eq!(written.bytes, fs::metadata(&written.path).unwrap().len());
    assert_eq!(read(dir.path(), &identity()).unwrap(), Some(state()));
    assert_eq!(names(dir.path()), ["vllm-a.rank-3.kvstate"]);
}

#[test]
fn the_layout_is_magic_then_header_then_body() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = written_bytes(dir.path());
    assert_eq!(bytes[..8], *b"\x89KVSTAT\n");
    let (header, body) = postcard::take_from_bytes::<Header>(&bytes[8..]).unwrap();
    assert_eq!(header.version, FORMAT_VERSION);
    assert_eq!(header.body_len, body.len() as u64);
    assert_eq!(header.checksum, xxh3_64(body));
    assert_eq!(postcard::from_bytes::<RankState>(body).unwrap(), state());
}

#[test]
fn a_missing_file_or_directory_is_none() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(read(dir.path(), &identity()).unwrap(), None);
    assert_eq!(read(&dir.path().join("absent"), &identity()).unwrap(), None);
}

#[test]
fn a_file_cut_anywhere_is_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = written_bytes(dir.path());
    for len in 0..bytes.len() {
        let error = read_bytes(dir.path(), &bytes[..len]).unwrap_err();
        let expected = if len == 0 {
            "not_a_state_file"
        } else {
            "truncated"
        };
        assert_eq!(error.reason(), expected, "cut at {len}: {error}");
    }
}

#[test]
fn a_file_with_bytes_after_its_body_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = written_bytes(dir.path());
    bytes.push(0);
    let error = read_bytes(dir.path(), &bytes).unwrap_err();
    assert_eq!(error.reason(), "corrupt", "{error}");
}

#[test]
fn every_flipped_bit_or_byte_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = written_bytes(dir.path());
    let masks = [1u8, 2, 4, 8, 16, 32, 64, 128, 0xff];
    for at in 0..bytes.len() {
        for mask in masks {
            let mut flipped = bytes.clone();
            flipped[at] ^= mask;
            let result = read_bytes(dir.path(), &flipped);
            assert!(
                result.is_err(),
                "byte {at} ^ {mask:#04x} read as {result:?}"
            );
        }
    }
}

#[test]
fn another_version_is_refused_before_its_header_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = written_bytes(dir.path());
    assert_eq!(bytes[8], 1, "version 1 is one varint byte");
    bytes[8] = 2;
    let error = read_bytes(dir.path(), &bytes).unwrap_err();
    assert_eq!(error.reason(), "unknown_version");
    assert!(error.to_string().contains("format version 2"), "{error}");

    // A later version's header may be anything after its version.
    let mut bytes = MAGIC.to_vec();
    bytes.extend(postcard::to_stdvec(&1000u32).unwrap());
    bytes.extend(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff");
    let error = read_bytes(dir.path(), &bytes).unwrap_err();
    assert_eq!(error.reason(), "unknown_version", "{error}");
}

#[test]
fn a_header_claiming_a_huge_body_is_truncated_without_allocating_it() {
    let dir = tempfile::tempdir().unwrap();
    let header = Header {
        version: FORMAT_VERSION,
        body_len: 1 << 60,
        checksum: 0,
    };
    let mut bytes = postcard::to_extend(&header, MAGIC.to_vec()).unwrap();
    bytes.extend([0; 64]);
    let error = read_bytes(dir.path(), &bytes).unwrap_err();
    assert_eq!(error.reason(), "truncated", "{error}");
}

#[test]
fn other_files_are_not_state_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut random = vec![0; 4096];
    SmallRng::seed_from_u64(7).fill(&mut random[..]);
    assert_ne!(random[0], MAGIC[0]);
    let text = b"[[engine]]\nname = \"vllm-a\"\n".to_vec();
    for bytes in [Vec::new(), random, text, b"\x89KVSTAX\n".to_vec()] {
        let error = read_bytes(dir.path(), &bytes).unwrap_err();
        assert_eq!(error.reason(), "not_a_state_file", "{bytes:?}: {error}");
        let path = file_path(dir.path(), "vllm-a", 3);
        assert!(error.to_string().contains(&*path.to_string_lossy()));
    }
}

#[test]
fn a_state_saved_for_another_identity_is_foreign_and_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &state()).unwrap();
    let saved_path = file_path(dir.path(), "vllm-a", 3);
    let key_scheme = KEY_SCHEME.to_string();
    let changed = |change: fn(&mut RankIdentity)| {
        let mut changed = identity();
        change(&mut changed);
        changed
    };
    let cases = [
        (
            "engine",
            changed(|id| id.engine = "vllm-b".into()),
            "\"vllm-a\"",
        ),
        ("dp_rank", changed(|id| id.dp_rank = 4), "3"),
        (
            "endpoint",
            changed(|id| id.endpoint = "tcp://10.0.0.6:5558".into()),
            "\"tcp://10.0.0.5:5558\"",
        ),
        ("model", changed(|id| id.model = None), "\"Qwen/Qwen3-8B\""),
        (
            "model",
            changed(|id| id.model = Some("Qwen/Qwen3-32B".into())),
            "\"Qwen/Qwen3-8B\"",
        ),
        ("block_size", changed(|id| id.block_size = 32), "16"),
        (
            "key_scheme",
            changed(|id| id.key_scheme = KEY_SCHEME + 1),
            &key_scheme,
        ),
    ];
    for (field, expected, saved) in cases {
        // The engine and the rank name the file: the file was copied under the other name.
        let path = file_path(dir.path(), &expected.engine, expected.dp_rank);
        if path != saved_path {
            fs::copy(&saved_path, &path).unwrap();
        }
        let error = read(dir.path(), &expected).unwrap_err();
        assert_eq!(error.reason(), "foreign", "{field}: {error}");
        let message = error.to_string();
        assert!(
            message.contains(&format!("{field} {saved}, this indexer's ")),
            "{message}"
        );
        assert!(message.contains(&*path.to_string_lossy()), "{message}");
    }
    let mut expected = identity();
    expected.block_size = 32;
    let message = read(dir.path(), &expected).unwrap_err().to_string();
    assert!(
        message.contains("block_size 16, this indexer's 32"),
        "{message}"
    );
}

#[test]
fn every_engine_name_is_one_safe_file_of_its_own_in_dir() {
    let dir = tempfile::tempdir().unwrap();
    let long = "é".repeat(200);
    let mut long_other = long.clone();
    long_other.push('x');
    let engines = [
        "vllm-a",
        "",
        ".",
        "..",
        "../escape",
        "a/b",
        "a%2Fb",
        "a%2fb",
        "%",
        "%25",
        "a b",
        "a~b",
        "a.rank-1",
        "模型/Qwen ü",
        long.as_str(),
        long_other.as_str(),
    ];
    let mut seen = HashSet::new();
    for engine in engines {
        for dp_rank in [0, 1, u32::MAX] {
            let path = file_path(dir.path(), engine, dp_rank);
            assert_eq!(path.parent(), Some(dir.path()), "{engine:?}");
            let name = path.file_name().unwrap().to_str().unwrap();
            assert!(!name.contains('/') && name != "." && name != "..");
            // Room for the temporary's suffix within 255 bytes.
            assert!(name.len() + ".4294967295-18446744073709551615.tmp".len() <= 255);
            assert!(
                seen.insert(name.to_string()),
                "{engine:?} {dp_rank}: {name}"
            );
        }
    }
    // A hostile name writes and reads back inside dir, and only there.
    let root = tempfile::tempdir().unwrap();
    let state_dir = root.path().join("state");
    for engine in ["../escape", long.as_str()] {
        let mut state = state();
        state.identity.engine = engine.to_string();
        write(&state_dir, &state).unwrap();
        assert_eq!(read(&state_dir, &state.identity).unwrap(), Some(state));
    }
    assert_eq!(names(root.path()), ["state"]);
    assert_eq!(names(&state_dir).len(), 2);
}

#[test]
fn a_write_that_fails_leaves_no_temporary() {
    // The directory is a file: nothing can be created.
    let root = tempfile::tempdir().unwrap();
    let not_a_dir = root.path().join("state");
    fs::write(&not_a_dir, "").unwrap();
    let error = write(&not_a_dir, &state()).unwrap_err();
    assert_eq!(error.reason(), "io");
    assert!(error.to_string().contains(&*not_a_dir.to_string_lossy()));
    assert_eq!(names(root.path()), ["state"]);

    // The rename fails (a non-empty directory holds the name) after the temporary is written.
    let dir = tempfile::tempdir().unwrap();
    let path = file_path(dir.path(), "vllm-a", 3);
    fs::create_dir(&path).unwrap();
    fs::write(path.join("keep"), "").unwrap();
    let error = write(dir.path(), &state()).unwrap_err();
    assert_eq!(error.reason(), "io", "{error}");
    assert!(error.to_string().contains(&*path.to_string_lossy()));
    assert_eq!(names(dir.path()), ["vllm-a.rank-3.kvstate"]);
}

#[test]
fn a_rewrite_replaces_the_old_state_only_at_the_rename() {
    let dir = tempfile::tempdir().unwrap();
    let old = state();
    write(dir.path(), &old).unwrap();
    let mut new = state();
    new.last_seq += 1;
    new.blocks.writers.pop();

    let staged = Staged::write(dir.path(), &new).unwrap();
    assert_eq!(read(dir.path(), &identity()).unwrap(), Some(old));
    assert_eq!(names(dir.path()).len(), 2, "the temporary beside the file");
    staged.commit().unwrap();
    assert_eq!(read(dir.path(), &identity()).unwrap(), Some(new.clone()));
    no_temporaries(dir.path());

    new.last_seq += 1;
    write(dir.path(), &new).unwrap();
    assert_eq!(read(dir.path(), &identity()).unwrap(), Some(new));
    assert_eq!(names(dir.path()), ["vllm-a.rank-3.kvstate"]);
}

#[test]
fn stale_temporaries_of_ours_are_removed_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &state()).unwrap();
    // A crash between the write and the rename leaves this.
    std::mem::forget(Staged::write(dir.path(), &state()).unwrap());
    let others = [
        "notes.tmp",
        "x.kvstate",
        "x.kvstate.tmp",
        "x.kvstate.12.tmp",
        "x.kvstate.12-.tmp",
        "x.kvstate.a-1.tmp",
        "x.other.12-3.tmp",
    ];
    for name in others {
        fs::write(dir.path().join(name), "").unwrap();
    }
    fs::write(dir.path().join("x.kvstate.12-3.tmp"), "").unwrap();
    assert_eq!(names(dir.path()).len(), 10);

    remove_stale_temporaries(dir.path());
    let mut expected = others.to_vec();
    expected.push("vllm-a.rank-3.kvstate");
    expected.sort();
    assert_eq!(names(dir.path()), expected);
    assert_eq!(read(dir.path(), &identity()).unwrap(), Some(state()));

    remove_stale_temporaries(&dir.path().join("absent"));
}
