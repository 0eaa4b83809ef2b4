//! What `--check` verifies beyond the file's own keys (docs.md "Checking before running"): the
//! files the configuration points to are read (the token and key files, each tokenizer
//! directory, a model's tokenizer in the Hugging Face cache) and the addresses it listens on
//! are resolved, so that what would stop a start or a reload is found before either; and where
//! each engine's prompts get their ids (`tokenizer_source`).
//!
//! Owns: those reads and what they find, each problem naming the key and its line in the file.
//! Never: binds a port, connects anywhere, starts anything, or prints a secret.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;

use crate::config::{Config, EngineConfig};
use crate::tokenize::{hf_cache, Tokenizers};

/// What the check found: problems stop a start; warnings do not.
#[derive(Debug, Default)]
pub struct Findings {
    pub problems: Vec<String>,
    pub warnings: Vec<String>,
}

/// Checks what `config` (read from `text`, the file `origin`) points to; `listen` is the API's
/// address in effect (`--listen` or the file's).
pub fn check(config: &Config, listen: &str, text: &str, origin: &str) -> Findings {
    let mut findings = Findings::default();
    let at = |key: &str, value: &str| match line_of(text, key, value) {
        Some(line) => format!("{origin}:{line}: "),
        None => format!("{origin}: "),
    };
    if let (Err(error), Some(path)) = (
        config.replicas.read_auth_token(),
        &config.replicas.auth_token_file,
    ) {
        let at = at("auth_token_file", path);
        findings.problems.push(format!("{at}{error:#}"));
    }
    if let Some(route) = &config.route {
        if let (Err(error), Some(path)) = (route.read_token(), &route.auth_token_file) {
            let at = at("auth_token_file", path);
            findings.problems.push(format!("{at}{error:#}"));
        }
    }
    for engine in &config.engines {
        if let (Err(error), Some(path)) = (engine.read_api_key(), &engine.api_key_file) {
            let at = at("api_key_file", path);
            findings.problems.push(format!("{at}{error:#}"));
        }
        if let Some(dir) = &engine.tokenizer {
            let wanted = [(engine.tokenizer_model(), Path::new(dir))];
            if let Err(error) = Tokenizers::load(wanted, &Tokenizers::default()) {
                let at = at("tokenizer", dir);
                findings.problems.push(format!(
                    "{at}engine {:?}: tokenizer {dir}: {error:#}",
                    engine.name
                ));
            }
        }
    }
    let hub = hf_cache::hub_root();
    for engine in &config.engines {
        let Some(dir) = cached_tokenizer(config, engine, hub.as_deref()) else {
            continue;
        };
        let wanted = [(engine.tokenizer_model(), dir.as_path())];
        if let Err(error) = Tokenizers::load(wanted, &Tokenizers::default()) {
            findings.warnings.push(format!(
                "engine {:?}: the Hugging Face cache's tokenizer {} does not load, so it will not                  be used: {error:#}",
                engine.name,
                dir.display()
            ));
        }
    }
    let mut addresses = vec![("listen", listen)];
    if let Some(dynamo) = &config.dynamo_listen {
        addresses.push(("dynamo_listen", dynamo));
    }
    if let Some(route) = &config.route {
        addresses.push(("[route] listen", &route.listen));
    }
    check_addresses(&addresses, &at, &mut findings.problems);
    if let Some(route) = &config.route {
        if !config.engines.iter().any(|e| e.openai_url.is_some()) {
            findings.warnings.push(format!(
                "{}[route] is set, but no engine has an openai_url (or discover): the front end \
                 has no engine server to send requests to",
                at("listen", &route.listen)
            ));
        } else if config
            .engines
            .iter()
            .all(|e| tokenizer_source(config, e, hub.as_deref()) == Source::Nothing)
        {
            findings.warnings.push(format!(
                "{}[route] is set, but no engine has a tokenizer (a `tokenizer` directory, its \
                 model in the Hugging Face cache, or an openai_url to ask POST /tokenize with \
                 engine_tokenize_timeout_ms above 0): every prompt sent as text or messages is \
                 routed by load alone (its cached prefix is not weighed)",
                at("listen", &route.listen)
            ));
        }
    }
    findings
}

/// Where an engine's prompts get their ids, in the front end's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A `tokenizer` directory: the engine's own, or another engine's of its model.
    Configured(String),
    /// Its model's snapshot in the local Hugging Face cache.
    HfCache(std::path::PathBuf),
    /// Its server's `POST /tokenize`, asked by the route front end.
    Engine,
    /// None: prompts as text or messages are routed by load alone.
    Nothing,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Configured(dir) => write!(f, "tokenizer {dir}"),
            Source::HfCache(dir) => write!(f, "tokenizer {} (Hugging Face cache)", dir.display()),
            Source::Engine => write!(f, "tokenizer: the engine's POST /tokenize"),
            Source::Nothing => write!(
                f,
                "no tokenizer: text and chat prompts routed by load alone"
            ),
        }
    }
}

/// Where `engine`'s prompts get their ids: a configured directory (any engine's of its
/// model), its model in the Hugging Face cache at `hub`, its server's `/tokenize` (with
/// `[route]`), or nowhere.
pub fn tokenizer_source(
    config: &Config,
    engine: &EngineConfig,
    hub: Option<&std::path::Path>,
) -> Source {
    let model = engine.tokenizer_model();
    let configured = config
        .engines
        .iter()
        .filter(|other| other.tokenizer_model() == model)
        .find_map(|other| other.tokenizer.clone());
    if let Some(dir) = configured {
        return Source::Configured(dir);
    }
    if let Some(dir) = cached_tokenizer(config, engine, hub) {
        return Source::HfCache(dir);
    }
    let asks = config
        .route
        .as_ref()
        .is_some_and(|route| route.engine_tokenize_timeout_ms > 0);
    match asks && engine.openai_url.is_some() {
        true => Source::Engine,
        false => Source::Nothing,
    }
}

/// The Hugging Face cache's snapshot of `engine`'s model, when it names one and no engine of
/// that model has a `tokenizer` directory (which the service reads instead).
fn cached_tokenizer(
    config: &Config,
    engine: &EngineConfig,
    hub: Option<&std::path::Path>,
) -> Option<std::path::PathBuf> {
    let model = engine.model.as_deref()?;
    let configured = config
        .engines
        .iter()
        .any(|other| other.tokenizer_model() == model && other.tokenizer.is_some());
    if configured {
        return None;
    }
    hf_cache::snapshot(hub?, model).ok()
}

/// Resolves each `(key, address)`; two that would bind the same port on overlapping hosts
/// (one of them the wildcard, or the same address) are a problem, as is one that does not
/// resolve.
fn check_addresses(
    addresses: &[(&str, &str)],
    at: &dyn Fn(&str, &str) -> String,
    problems: &mut Vec<String>,
) {
    let mut resolved: Vec<(&str, &str, Vec<SocketAddr>)> = Vec::new();
    for &(key, address) in addresses {
        let bare = key.trim_start_matches("[route] ");
        match address.to_socket_addrs() {
            Ok(found) => resolved.push((key, address, found.collect())),
            Err(error) => problems.push(format!(
                "{}{key} {address}: does not resolve: {error}",
                at(bare, address)
            )),
        }
    }
    for (i, (key, address, found)) in resolved.iter().enumerate() {
        for (other_key, other_address, other_found) in &resolved[..i] {
            let overlap = found.iter().any(|a| {
                other_found.iter().any(|b| {
                    a.port() == b.port()
                        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
                })
            });
            if overlap {
                let bare = key.trim_start_matches("[route] ");
                problems.push(format!(
                    "{}{key} {address} and {other_key} {other_address} would bind the same port: \
                     give each its own port",
                    at(bare, address)
                ));
            }
        }
    }
}

/// The 1-based line of the first `key = ...` in `text` whose value holds `value`.
fn line_of(text: &str, key: &str, value: &str) -> Option<usize> {
    text.lines()
        .position(|line| {
            let line = line.trim_start();
            line.strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with('=') && rest.contains(value))
        })
        .map(|index| index + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engines_tokenizer_is_its_models_dir_else_the_cache_else_its_server_else_none() {
        let hub = tempfile::tempdir().expect("temp dir");
        let snapshot = hub.path().join("models--org--cached/snapshots/abc");
        std::fs::create_dir_all(&snapshot).expect("mkdir");
        std::fs::write(snapshot.join("tokenizer.json"), "{}").expect("write");
        let engine = |name: &str, model: &str, extra: &str| {
            format!(
                "[[engine]]\nname = \"{name}\"\nhost = \"127.0.0.1\"\nzmq_port = {}\n\
                 model = \"{model}\"\n{extra}\n",
                5557 + name.len()
            )
        };
        let text = [
            engine("a", "org/dir", "tokenizer = \"/models/dir\""),
            engine("bb", "org/dir", "openai_url = \"http://127.0.0.1:8000\""),
            engine(
                "ccc",
                "org/cached",
                "openai_url = \"http://127.0.0.1:8001\"",
            ),
            engine(
                "dddd",
                "org/asked",
                "openai_url = \"http://127.0.0.1:8002\"",
            ),
            engine("eeeee", "org/asked", ""),
            "[route]\nlisten = \"127.0.0.1:8080\"\n".to_owned(),
        ]
        .concat();
        let config = Config::parse(&text, "indexer.toml").expect("a valid file");
        let sources: Vec<Source> = config
            .engines
            .iter()
            .map(|engine| tokenizer_source(&config, engine, Some(hub.path())))
            .collect();
        assert_eq!(
            sources,
            [
                Source::Configured("/models/dir".into()),
                Source::Configured("/models/dir".into()),
                Source::HfCache(snapshot),
                Source::Engine,
                Source::Nothing,
            ]
        );
        let asks_none = Config::parse(
            &text.replace(
                "listen = \"127.0.0.1:8080\"",
                "listen = \"127.0.0.1:8080\"\nengine_tokenize_timeout_ms = 0",
            ),
            "indexer.toml",
        )
        .expect("a valid file");
        let asked = &asks_none.engines[3];
        assert_eq!(tokenizer_source(&asks_none, asked, None), Source::Nothing);
    }

    #[test]
    fn a_key_is_found_on_its_line_and_not_on_a_longer_keys() {
        let text = "listen = \"a\"\n[route]\nlisten_backlog = \"b\"\n  listen = \"b\"\n";
        assert_eq!(line_of(text, "listen", "a"), Some(1));
        assert_eq!(line_of(text, "listen", "b"), Some(4));
        assert_eq!(line_of(text, "listen", "c"), None);
    }

    #[test]
    fn addresses_that_would_bind_one_port_are_caught_and_others_are_not() {
        let at = |_: &str, _: &str| String::new();
        let mut problems = Vec::new();
        check_addresses(
            &[
                ("listen", "127.0.0.1:8090"),
                ("[route] listen", "0.0.0.0:8090"),
            ],
            &at,
            &mut problems,
        );
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("would bind the same port"));
        problems.clear();
        check_addresses(
            &[
                ("listen", "127.0.0.1:8090"),
                ("[route] listen", "127.0.0.2:8090"),
                ("dynamo_listen", "0.0.0.0:8091"),
            ],
            &at,
            &mut problems,
        );
        assert_eq!(problems, Vec::<String>::new());
        check_addresses(&[("listen", "no-such-host.invalid:80")], &at, &mut problems);
        assert!(problems[0].contains("does not resolve"), "{problems:?}");
    }
}
