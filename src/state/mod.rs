//! One rank's state file in `state_dir`: its on-disk format, its atomic write and its checked
//! load, so that an indexer that restarts finds each rank's blocks as it saved them.
//!
//! It owns files and bytes only. It never touches the index, a socket or a listener, and it
//! never judges what a loaded state is worth: the listener compares `last_seq` and
//! `last_digest` with the engine's replay before trusting it. It never guesses either: a file
//! that is not exactly one this format version wrote for this rank is refused with a
//! [`StateError`], whose [`reason`](StateError::reason) labels the refusal for a metric.
//!
//! # File names
//!
//! `<engine>.rank-<dp_rank>.kvstate`, the engine name percent-encoded (every byte but ASCII
//! letters, digits, `-` and `_` as `%XX`), so that any name (with `/`, `..`, `%`, unicode, or
//! empty) is one file inside `state_dir` and two names never share one. An encoded name over
//! 160 bytes keeps its first 128 followed by `~` and the xxh3-128 of the whole name in hex, so
//! that a file name stays within the file systems' 255 bytes; `~` is always encoded otherwise,
//! so such a name never meets a short one, and a hash collision would still be refused by the
//! identity check.
//!
//! A write goes to `<file name>.<pid>-<counter>.tmp` in the same directory; the temporary is
//! synced, renamed over the file name, then the directory is synced: after a crash the file
//! name holds the old state or the new one, never a torn one, and at worst a temporary is left
//! for [`remove_stale_temporaries`] to delete at the next start.
//!
//! # Layout, format version 1
//!
//! ```text
//! 8 bytes     magic: 89 4B 56 53 54 41 54 0A ("\x89KVSTAT\n")
//! 3-25 bytes  header: postcard Header { version: u32, body_len: u64, checksum: u64 }
//! body_len    body: postcard RankState; checksum is the xxh3-64 of these bytes
//! ```
//!
//! Nothing follows the body. A reader checks, in order: the magic (`not_a_state_file`; a file
//! cut inside it is `truncated`), the version, decoded alone so that another version's header
//! is never parsed (`unknown_version`), the body's length against the bytes present
//! (`truncated` if fewer, `corrupt` if more), the checksum, the body's decoding (both
//! `corrupt`), then the identity (`foreign`). It allocates the bytes the file holds, never what
//! its header claims.
//!
//! Postcard writes no field names: any change to the layout or to the fields of `RankState`,
//! `RankIdentity` or `index::SavedBlocks` needs a new [`FORMAT_VERSION`].

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use crate::index::SavedBlocks;

/// The layout this build writes and the only one it reads.
pub const FORMAT_VERSION: u32 = 1;

/// Starts with a byte no UTF-8 text starts with, ends with a newline a text-mode copy mangles.
const MAGIC: [u8; 8] = *b"\x89KVSTAT\n";

const EXTENSION: &str = ".kvstate";
const TEMPORARY_EXTENSION: &str = ".tmp";

/// `~` stays encoded: it marks a long name's hashed tail ([`encoded_engine`]).
const ENGINE_NAME: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_');
/// Leaves room for `.rank-<u32>.kvstate.<pid>-<u64>.tmp` within a file name's 255 bytes.
const LONG_ENGINE_NAME: usize = 160;
const LONG_ENGINE_NAME_KEPT: usize = 128;

/// Makes temporary names unique within the process; the pid makes them unique between.
static TEMPORARIES: AtomicU64 = AtomicU64::new(0);

/// Who a saved rank is and what its keys assume: a file whose identity differs from the
/// running rank's is not loaded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankIdentity {
    pub engine: String,
    pub dp_rank: u32,
    /// The rank's ZMQ endpoint, e.g. `tcp://10.0.0.5:5558`.
    pub endpoint: String,
    pub model: Option<String>,
    pub block_size: u32,
    /// `index::KEY_SCHEME` when the state was taken.
    pub key_scheme: u32,
}

/// One rank's saved state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankState {
    pub identity: RankIdentity,
    /// The last batch applied: its seq and the xxh3-64 digest of its payload bytes, which the
    /// engine's replay of that seq must match before anything saved is trusted.
    pub last_seq: u64,
    pub last_digest: u64,
    /// Milliseconds since the Unix epoch when it was taken (`unix_ms`).
    pub saved_at_ms: u64,
    pub blocks: SavedBlocks,
}

impl RankState {
    /// How long ago it was taken, by the wall clock (zero for a clock that went back).
    pub fn age(&self) -> std::time::Duration {
        std::time::Duration::from_millis(unix_ms().saturating_sub(self.saved_at_ms))
    }
}

/// Milliseconds since the Unix epoch now: when a state is taken.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// A state written in place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    pub path: PathBuf,
    /// The file's size.
    pub bytes: u64,
    /// From the call to the directory's sync: encoding, writing and syncing.
    pub elapsed: Duration,
}

/// Why a state file was not written or not loaded. A file that is refused is left as it is:
/// the rank's next save replaces it.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(
        "{}: cannot {action}: {source}; state_dir must be a directory this indexer can create, \
         read and write",
        path.display()
    )]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(
        "state file {} ends after {len} bytes, inside its {part}: cut short by a copy or a full \
         disk; not loaded",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        len: u64,
        part: &'static str,
    },
    #[error(
        "state file {} is corrupt ({detail}): damaged on disk or in a copy; not loaded",
        path.display()
    )]
    Corrupt { path: PathBuf, detail: String },
    #[error(
        "state file {} is format version {version}, this kv-indexer reads version \
         {FORMAT_VERSION} only: written by another release, which alone can load it; not loaded",
        path.display()
    )]
    UnknownVersion { path: PathBuf, version: u32 },
    #[error(
        "{} is not a kv-indexer state file (it does not start with the state magic); not \
         loaded: move it out of state_dir",
        path.display()
    )]
    NotAStateFile { path: PathBuf },
    #[error(
        "state file {} was saved with {field} {saved}, this indexer's {expected}: its blocks are \
         not this rank's; not loaded",
        path.display()
    )]
    Foreign {
        path: PathBuf,
        field: &'static str,
        saved: String,
        expected: String,
    },
}

impl StateError {
    /// A short label for a metric counter.
    pub fn reason(&self) -> &'static str {
        match self {
            StateError::Io { .. } => "io",
            StateError::Truncated { .. } => "truncated",
            StateError::Corrupt { .. } => "corrupt",
            StateError::UnknownVersion { .. } => "unknown_version",
            StateError::NotAStateFile { .. } => "not_a_state_file",
            StateError::Foreign { .. } => "foreign",
        }
    }
}

/// The version is its first field so that a reader can decode it alone, before knowing the
/// rest of the header's layout.
#[derive(Serialize, Deserialize)]
struct Header {
    version: u32,
    body_len: u64,
    checksum: u64,
}

/// The one file of `engine`'s rank `dp_rank` in `dir`.
pub fn file_path(dir: &Path, engine: &str, dp_rank: u32) -> PathBuf {
    dir.join(file_name(engine, dp_rank))
}

fn file_name(engine: &str, dp_rank: u32) -> String {
    format!("{}.rank-{dp_rank}{EXTENSION}", encoded_engine(engine))
}

fn encoded_engine(engine: &str) -> String {
    let encoded = utf8_percent_encode(engine, ENGINE_NAME).to_string();
    if encoded.len() <= LONG_ENGINE_NAME {
        return encoded;
    }
    // All ASCII once encoded: any byte index is a char boundary.
    format!(
        "{}~{:032x}",
        &encoded[..LONG_ENGINE_NAME_KEPT],
        xxh3_128(engine.as_bytes())
    )
}

/// Writes `state` to its rank's file in `dir` (created if missing), replacing the previous one
/// atomically.
pub fn write(dir: &Path, state: &RankState) -> Result<Written, StateError> {
    let started = Instant::now();
    let staged = Staged::write(dir, state)?;
    let (path, bytes) = staged.commit()?;
    Ok(Written {
        path,
        bytes,
        elapsed: started.elapsed(),
    })
}

/// A complete, synced temporary file not yet renamed into place: dropped uncommitted, it is
/// removed, so a failed write leaves nothing behind.
struct Staged {
    dir: PathBuf,
    temporary: PathBuf,
    path: PathBuf,
    bytes: u64,
    committed: bool,
}

impl Staged {
    fn write(dir: &Path, state: &RankState) -> Result<Staged, StateError> {
        // An empty path names the working directory everywhere but where it is opened to sync.
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        fs::create_dir_all(dir).map_err(io_error(dir, "create the directory"))?;
        let name = file_name(&state.identity.engine, state.identity.dp_rank);
        let path = dir.join(&name);
        let encode = |error| io_error(&path, "encode the state")(io::Error::other(error));
        let body = postcard::to_stdvec(state).map_err(encode)?;
        let header = Header {
            version: FORMAT_VERSION,
            body_len: body.len() as u64,
            checksum: xxh3_64(&body),
        };
        let head = postcard::to_extend(&header, MAGIC.to_vec()).map_err(encode)?;

        let temporary = dir.join(format!(
            "{name}.{}-{}{TEMPORARY_EXTENSION}",
            std::process::id(),
            TEMPORARIES.fetch_add(1, Ordering::Relaxed)
        ));
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temporary)
            .map_err(io_error(&temporary, "create a temporary file"))?;
        let staged = Staged {
            dir: dir.to_owned(),
            temporary,
            path,
            bytes: (head.len() + body.len()) as u64,
            committed: false,
        };
        // Two writes: the body is already one buffer, copying it behind the head would cost
        // more than a syscall.
        file.write_all(&head)
            .and_then(|()| file.write_all(&body))
            .map_err(io_error(&staged.temporary, "write"))?;
        file.sync_all()
            .map_err(io_error(&staged.temporary, "sync"))?;
        Ok(staged)
    }

    fn commit(mut self) -> Result<(PathBuf, u64), StateError> {
        fs::rename(&self.temporary, &self.path)
            .map_err(io_error(&self.path, "replace it with its new state"))?;
        self.committed = true;
        // Without it a crash could undo the rename: the file would hold the previous state.
        File::open(&self.dir)
            .and_then(|dir| dir.sync_all())
            .map_err(io_error(&self.dir, "sync the directory"))?;
        Ok((std::mem::take(&mut self.path), self.bytes))
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.temporary);
        }
    }
}

/// Reads the file of `expected`'s rank in `dir`: `Ok(None)` when there is none, an error when
/// it is not a state this build wrote for that same rank.
pub fn read(dir: &Path, expected: &RankIdentity) -> Result<Option<RankState>, StateError> {
    let path = file_path(dir, &expected.engine, expected.dp_rank);
    // Sized by the file's metadata: a header's claims allocate nothing.
    let bytes = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(io_error(&path, "read it")(error)),
    };
    let state = decode(&path, &bytes)?;
    if let Some((field, saved, expected)) = difference(&state.identity, expected) {
        return Err(StateError::Foreign {
            path,
            field,
            saved,
            expected,
        });
    }
    Ok(Some(state))
}

fn decode(path: &Path, bytes: &[u8]) -> Result<RankState, StateError> {
    let truncated = |part| StateError::Truncated {
        path: path.to_owned(),
        len: bytes.len() as u64,
        part,
    };
    let corrupt = |detail| StateError::Corrupt {
        path: path.to_owned(),
        detail,
    };
    let header_error = |error| match error {
        postcard::Error::DeserializeUnexpectedEnd => truncated("header"),
        error => corrupt(format!("its header does not decode: {error}")),
    };

    let Some(after_magic) = bytes.strip_prefix(&MAGIC) else {
        return Err(if !bytes.is_empty() && MAGIC.starts_with(bytes) {
            truncated("magic")
        } else {
            StateError::NotAStateFile {
                path: path.to_owned(),
            }
        });
    };
    let (version, _) = postcard::take_from_bytes::<u32>(after_magic).map_err(header_error)?;
    if version != FORMAT_VERSION {
        return Err(StateError::UnknownVersion {
            path: path.to_owned(),
            version,
        });
    }
    let (header, body) = postcard::take_from_bytes::<Header>(after_magic).map_err(header_error)?;
    let present = body.len() as u64;
    if present < header.body_len {
        return Err(truncated("body"));
    }
    if present > header.body_len {
        return Err(corrupt(format!(
            "{} bytes follow its body of {}",
            present - header.body_len,
            header.body_len
        )));
    }
    let checksum = xxh3_64(body);
    if checksum != header.checksum {
        return Err(corrupt(format!(
            "its body's checksum is {checksum:016x}, its header says {:016x}",
            header.checksum
        )));
    }
    match postcard::take_from_bytes::<RankState>(body) {
        Ok((state, [])) => Ok(state),
        Ok((_, rest)) => Err(corrupt(format!(
            "its body ends {} bytes before its length",
            rest.len()
        ))),
        Err(error) => Err(corrupt(format!(
            "its body matches its checksum but does not decode: {error}"
        ))),
    }
}

/// The first field where `saved` is not `expected`, with both values as a message shows them.
fn difference(
    saved: &RankIdentity,
    expected: &RankIdentity,
) -> Option<(&'static str, String, String)> {
    if saved == expected {
        return None;
    }
    let model = |model: &Option<String>| model.as_deref().map_or("none".to_string(), quoted);
    [
        ("engine", quoted(&saved.engine), quoted(&expected.engine)),
        (
            "dp_rank",
            saved.dp_rank.to_string(),
            expected.dp_rank.to_string(),
        ),
        (
            "endpoint",
            quoted(&saved.endpoint),
            quoted(&expected.endpoint),
        ),
        ("model", model(&saved.model), model(&expected.model)),
        (
            "block_size",
            saved.block_size.to_string(),
            expected.block_size.to_string(),
        ),
        (
            "key_scheme",
            saved.key_scheme.to_string(),
            expected.key_scheme.to_string(),
        ),
    ]
    .into_iter()
    .find(|(_, saved, expected)| saved != expected)
}

fn quoted(text: &str) -> String {
    format!("{text:?}")
}

/// Deletes the temporaries of writes interrupted by a crash. Call it before this process
/// writes: it cannot tell an interrupted write from one under way (a restarted container's
/// indexer often has the same pid as its predecessor).
pub fn remove_stale_temporaries(dir: &Path) {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return,
        Err(error) => {
            tracing::warn!(
                "state_dir {}: cannot list it for stale temporaries: {error}",
                dir.display()
            );
            return;
        }
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(is_temporary) {
            continue;
        }
        let path = entry.path();
        match fs::remove_file(&path) {
            Ok(()) => tracing::info!(
                "removed {}, left by a state write a crash interrupted",
                path.display()
            ),
            Err(error) => tracing::warn!(
                "cannot remove {}, left by an interrupted state write: {error}",
                path.display()
            ),
        }
    }
}

/// Whether `name` is `<name>.kvstate.<pid>-<counter>.tmp`, as [`Staged::write`] names them.
fn is_temporary(name: &str) -> bool {
    let digits = |text: &str| !text.is_empty() && text.bytes().all(|byte| byte.is_ascii_digit());
    name.strip_suffix(TEMPORARY_EXTENSION)
        .and_then(|rest| rest.rsplit_once('.'))
        .is_some_and(|(final_name, writer)| {
            final_name.ends_with(EXTENSION)
                && writer
                    .split_once('-')
                    .is_some_and(|(pid, counter)| digits(pid) && digits(counter))
        })
}

fn io_error<'a>(path: &'a Path, action: &'static str) -> impl FnOnce(io::Error) -> StateError + 'a {
    move |source| StateError::Io {
        path: path.to_owned(),
        action,
        source,
    }
}

#[cfg(test)]
mod tests;
