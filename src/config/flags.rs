//! Engines and the route listener given on the command line (`--engine URL`, `--route-listen`,
//! or `KV_INDEXER_ENGINES` / `KV_INDEXER_ROUTE_LISTEN`), and where a configuration comes from
//! (`Source`: a file, or none, plus these flags), so that a reload reads it the same way.
//!
//! Owns: what a flag engine is (an engine asked at its URL for its ranks and its model, routed
//! at that URL: `discover` and `openai_url` both the URL, nothing from `[defaults]`), the name
//! derived from its URL, and the rules of combining flags with a file (the file's engines plus
//! the flags', a name given twice refused). Never: asks an engine anything (`discover` does) nor
//! reads the environment itself (`main` hands it the values).

use std::path::{Path, PathBuf};

use super::{
    derived_instance_id, validate_listen, Config, ConfigError, DiscoverConfig, EngineConfig, Ranks,
    Route, DEFAULT_DISCOVER_INTERVAL_S,
};
use crate::discover::{BaseUrl, EngineApi, FileLayout};

/// Where vLLM's and SGLang's OpenAI servers serve their Prometheus gauges.
const METRICS_PATH: &str = "/metrics";

/// What the command line adds to a file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Flags {
    /// `--engine` URLs, in the order given.
    pub engines: Vec<String>,
    /// `--route-listen`: serves the route front end there (`[route] listen`).
    pub route_listen: Option<String>,
}

impl Flags {
    /// The URLs of `KV_INDEXER_ENGINES`: separated by commas, spaces or both.
    pub fn split_urls(text: &str) -> Vec<String> {
        text.split(|c: char| c == ',' || c.is_whitespace())
            .filter(|url| !url.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// `config` with the flags' engines added after the file's and `--route-listen` as its
    /// `[route] listen` (a `[route]` of defaults when the file has none). Every problem is
    /// reported, each naming the flag: a bad URL, a URL given twice, a name the file uses.
    pub fn apply(&self, mut config: Config) -> Result<Config, ConfigError> {
        let mut problems = Vec::new();
        let mut taken: Vec<String> = config.engines.iter().map(|e| e.name.clone()).collect();
        let mut urls: Vec<String> = Vec::new();
        for text in &self.engines {
            let url = match BaseUrl::parse(text) {
                Ok(url) => url,
                Err(why) => {
                    problems.push(format!("--engine: {why}"));
                    continue;
                }
            };
            if urls.contains(&url.base) {
                problems.push(format!("--engine {text}: given twice"));
                continue;
            }
            urls.push(url.base.clone());
            let name = derived_name(&url);
            if taken.contains(&name) {
                problems.push(format!(
                    "--engine {text}: its name {name:?} is an [[engine]] of the file already: \
                     remove one of the two, or give the file's engine another name"
                ));
                continue;
            }
            taken.push(name.clone());
            config.engines.push(flag_engine(name, url));
        }
        if let Some(listen) = &self.route_listen {
            let apis = std::iter::once(&config.listen).chain(&config.dynamo_listen);
            match validate_listen(listen) {
                Err(why) => problems.push(format!("--route-listen: {why}")),
                Ok(()) if apis.clone().any(|api| api == listen) => problems.push(format!(
                    "--route-listen {listen}: must differ from the API's address"
                )),
                Ok(()) => match &mut config.route {
                    Some(route) => route.listen = listen.clone(),
                    None => config.route = Some(Route::listening_on(listen.clone())),
                },
            }
        }
        match problems.is_empty() {
            true => Ok(config),
            false => Err(ConfigError { problems }),
        }
    }
}

/// An engine named by its URL: asked there for its ranks (`/kv_event_sources` or
/// `/server_info`) and its model (`/v1/models`), and routed there.
fn flag_engine(name: String, url: BaseUrl) -> EngineConfig {
    let metrics_url = BaseUrl::parse(&url.join(METRICS_PATH)).ok();
    EngineConfig {
        instance_id: derived_instance_id(&name),
        host: url.host.clone(),
        ranks: Ranks::Discovered(DiscoverConfig {
            api: EngineApi {
                engine: name.clone(),
                url: url.clone(),
                host: url.host.clone(),
                asks_model: true,
            },
            interval_s: DEFAULT_DISCOVER_INTERVAL_S,
            file: FileLayout::default(),
        }),
        name,
        recover_port: None,
        model: None,
        topic: String::new(),
        tokenizer: None,
        openai_url: Some(url),
        metrics_url,
        api_key_file: None,
        reports_reused: false,
    }
}

/// `HOST-PORT` (and the path, if any), every character but letters, digits, `.` and `_` a
/// `-`: a name that reads well in `/workers`, metric labels and logs. `http://10.0.0.5:8000`
/// is `10.0.0.5-8000`; `http://[fd00::5]:8000/v` is `fd00--5-8000-v`. Two URLs that differ
/// only in what this folds (`/a.b` and `/a-b`) are told apart by the clash check.
pub fn derived_name(url: &BaseUrl) -> String {
    let rest = url.base.strip_prefix("http://").unwrap_or(&url.base);
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let has_port = authority.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty() && !port.is_empty() && port.chars().all(|c| c.is_ascii_digit())
    }) && !authority.ends_with(']');
    let mut name = url.host.to_string();
    if !has_port {
        name.push_str("-80");
    } else if let Some((_, port)) = authority.rsplit_once(':') {
        name.push('-');
        name.push_str(port);
    }
    if !path.is_empty() {
        name.push('-');
        name.push_str(path);
    }
    name.chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '_' => c,
            _ => '-',
        })
        .collect()
}

/// Where the configuration comes from: a file (or none: every default), and the flags added to
/// it. A reload reads it again the same way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// `None`: no file (`--config` not given and no `indexer.toml` here).
    pub path: Option<PathBuf>,
    pub flags: Flags,
}

impl Source {
    /// The file alone.
    pub fn file(path: &Path) -> Source {
        Source {
            path: Some(path.to_path_buf()),
            flags: Flags::default(),
        }
    }

    /// Reads the file (or starts from the defaults without one) and adds the flags.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let config = match &self.path {
            Some(path) => Config::load(path)?,
            None => Config::parse("", "(defaults)")?,
        };
        self.flags.apply(config)
    }

    /// How logs and messages name it: the file, or what stands in for one.
    pub fn describe(&self) -> String {
        match &self.path {
            Some(path) => path.display().to_string(),
            None => "(no file: defaults and the command line)".to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> BaseUrl {
        BaseUrl::parse(text).unwrap_or_else(|why| panic!("{why}"))
    }

    fn flags(engines: &[&str], route_listen: Option<&str>) -> Flags {
        Flags {
            engines: engines.iter().map(ToString::to_string).collect(),
            route_listen: route_listen.map(str::to_string),
        }
    }

    #[test]
    fn a_name_is_the_urls_host_and_port_in_letters_digits_dots_and_dashes() {
        let cases = [
            ("http://10.0.0.5:8000", "10.0.0.5-8000"),
            ("http://gpu-1:8000/", "gpu-1-8000"),
            ("http://gpu-1", "gpu-1-80"),
            ("http://[fd00::5]:8000/vllm/v1", "fd00--5-8000-vllm-v1"),
            ("http://[::1]", "--1-80"),
        ];
        for (given, name) in cases {
            assert_eq!(derived_name(&url(given)), name, "{given}");
        }
    }

    #[test]
    fn flag_engines_follow_the_files_each_asked_and_routed_at_its_url() {
        let file = Config::parse("[[engine]]\nname = \"a\"\nhost = \"h\"\n", "f")
            .unwrap_or_else(|err| panic!("{err}"));
        let config = flags(
            &["http://127.0.0.1:8000", "http://127.0.0.1:8001/"],
            Some("127.0.0.1:8080"),
        )
        .apply(file)
        .unwrap_or_else(|err| panic!("{err}"));
        let names: Vec<&str> = config.engines.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["a", "127.0.0.1-8000", "127.0.0.1-8001"]);
        let engine = &config.engines[2];
        let discover = engine.discover().expect("asked for its ranks");
        assert!(discover.api.asks_model);
        assert_eq!(discover.api.url.base, "http://127.0.0.1:8001");
        assert_eq!(
            engine.openai_url.as_ref().map(|u| u.base.as_str()),
            Some("http://127.0.0.1:8001")
        );
        assert_eq!(
            engine.metrics_url.as_ref().map(|u| u.base.as_str()),
            Some("http://127.0.0.1:8001/metrics")
        );
        let route = config.route.expect("a [route] of defaults");
        assert_eq!(route.listen, "127.0.0.1:8080");
        assert_eq!(route, Route::listening_on("127.0.0.1:8080".into()));
    }

    #[test]
    fn a_clash_a_repeat_and_a_bad_url_are_each_refused_naming_the_flag() {
        let file = Config::parse(
            "[[engine]]\nname = \"127.0.0.1-8000\"\nhost = \"h\"\n[route]\nlisten = \"127.0.0.1:9\"\n",
            "f",
        )
        .unwrap_or_else(|err| panic!("{err}"));
        let rejected = flags(
            &[
                "http://127.0.0.1:8000",
                "https://h:1",
                "http://h:1",
                "http://h:1/",
            ],
            Some("127.0.0.1:8090"),
        )
        .apply(file)
        .expect_err("refused");
        let problems = rejected.problems;
        assert_eq!(problems.len(), 4, "{problems:#?}");
        assert!(problems[0].contains("\"127.0.0.1-8000\" is an [[engine]] of the file"));
        assert!(problems[1].contains("--engine: \"https://h:1\": https"));
        assert!(problems[2].contains("--engine http://h:1/: given twice"));
        assert!(problems[3].contains("--route-listen 127.0.0.1:8090: must differ"));
    }

    #[test]
    fn the_environments_list_takes_commas_spaces_or_both() {
        assert_eq!(
            Flags::split_urls(" http://a:1, http://b:2 ,http://c:3\nhttp://d:4,,"),
            ["http://a:1", "http://b:2", "http://c:3", "http://d:4"]
        );
    }

    #[test]
    fn without_a_file_the_defaults_apply_and_a_reload_reads_the_same() {
        let source = Source {
            path: None,
            flags: flags(&["http://h:8000"], None),
        };
        let config = source.load().unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(config.listen, super::super::DEFAULT_LISTEN);
        assert_eq!(config.engines.len(), 1);
        assert_eq!(config.route, None);
        assert_eq!(source.load(), Ok(config));
    }
}
