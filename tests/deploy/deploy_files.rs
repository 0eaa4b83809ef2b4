//! The deployment files agree with each other: docker-compose.yml's engines publish where the
//! indexer TOML files they are paired with look, the indexer containers mount their TOML where
//! the Dockerfile's command reads it, the TOML files pass the indexer's own validation, the
//! systemd unit reloads with SIGHUP, and a stop has room for the drain and the state save.

use std::path::Path;

use kv_indexer::config::Config;
use yaml_rust2::{Yaml, YamlLoader};

fn read(file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn compose() -> Yaml {
    let mut docs = YamlLoader::load_from_str(&read("docker-compose.yml"))
        .unwrap_or_else(|e| panic!("docker-compose.yml: {e}"));
    assert_eq!(docs.len(), 1, "docker-compose.yml: one document");
    docs.remove(0)
}

fn service<'a>(compose: &'a Yaml, name: &str) -> &'a Yaml {
    let service = &compose["services"][name];
    assert!(
        !service.is_badvalue(),
        "docker-compose.yml: no service {name}"
    );
    service
}

fn strings(list: &Yaml, what: &str) -> Vec<String> {
    list.as_vec()
        .unwrap_or_else(|| panic!("{what}: not a list"))
        .iter()
        .map(|item| {
            item.as_str()
                .unwrap_or_else(|| panic!("{what}: {item:?} is not a string (quote numbers)"))
                .to_owned()
        })
        .collect()
}

/// The value of `--name` in `args`, given as `--name value` or `--name=value`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let prefixed = format!("{name}=");
    args.iter().enumerate().find_map(|(i, arg)| {
        if arg == name {
            args.get(i + 1).map(String::as_str)
        } else {
            arg.strip_prefix(&prefixed)
        }
    })
}

fn port_of(endpoint: &str) -> i64 {
    endpoint
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in endpoint {endpoint:?}"))
}

/// A TOML file's only `[[engine]]`, read as plain TOML so these checks do not depend on
/// `Config`; `deploy_tomls_pass_config_validation` checks the files with `Config` itself.
fn only_engine(file: &str) -> (toml::Table, toml::Table) {
    let table: toml::Table = read(file).parse().unwrap_or_else(|e| panic!("{file}: {e}"));
    let engines = table["engine"]
        .as_array()
        .unwrap_or_else(|| panic!("{file}: no [[engine]]"));
    assert_eq!(engines.len(), 1, "{file}: one engine");
    let engine = engines[0]
        .as_table()
        .unwrap_or_else(|| panic!("{file}: [[engine]] is not a table"))
        .clone();
    (table, engine)
}

fn int(table: &toml::Table, key: &str, file: &str) -> i64 {
    table
        .get(key)
        .and_then(toml::Value::as_integer)
        .unwrap_or_else(|| panic!("{file}: no integer {key}"))
}

fn text<'a>(table: &'a toml::Table, key: &str, file: &str) -> &'a str {
    table
        .get(key)
        .and_then(toml::Value::as_str)
        .unwrap_or_else(|| panic!("{file}: no string {key}"))
}

fn parse_int(value: Option<&str>, what: &str) -> i64 {
    value
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{what}: missing or not an integer: {value:?}"))
}

#[test]
fn vllm_publishes_where_indexer_compose_toml_subscribes() {
    let file = "deploy/indexer.compose.toml";
    let (top, engine) = only_engine(file);
    let compose = compose();
    let args = strings(&service(&compose, "vllm")["command"], "vllm command");

    assert_eq!(
        text(&engine, "host", file),
        "vllm",
        "{file}: host is the vllm service"
    );
    assert_eq!(
        parse_int(
            flag(&args, "--data-parallel-size"),
            "vllm --data-parallel-size"
        ),
        int(&engine, "dp_size", file)
    );
    assert_eq!(
        parse_int(flag(&args, "--block-size"), "vllm --block-size"),
        int(&top, "block_size", file)
    );
    assert_eq!(flag(&args, "--model"), Some(text(&engine, "model", file)));
    assert!(args.iter().any(|a| a == "--enable-prefix-caching"));

    let events: serde_json::Value = flag(&args, "--kv-events-config")
        .map(serde_json::from_str)
        .unwrap_or_else(|| panic!("vllm: no --kv-events-config"))
        .unwrap_or_else(|e| panic!("vllm --kv-events-config: {e}"));
    assert_eq!(events["enable_kv_cache_events"], true);
    assert_eq!(events["publisher"], "zmq");
    let endpoint = |key: &str| {
        events[key]
            .as_str()
            .unwrap_or_else(|| panic!("--kv-events-config: no {key}"))
            .to_owned()
    };
    assert_eq!(
        port_of(&endpoint("endpoint")),
        int(&engine, "zmq_port", file)
    );
    assert_eq!(
        port_of(&endpoint("replay_endpoint")),
        int(&engine, "replay_port", file)
    );
    assert_eq!(
        events["topic"].as_str().unwrap_or(""),
        engine
            .get("topic")
            .and_then(toml::Value::as_str)
            .unwrap_or("")
    );
}

/// A simulated engine's `--dp-size` and ports are the `[[engine]]`'s of `file`.
fn assert_ports_match(args: &[String], engine: &toml::Table, file: &str, name: &str) {
    for (flag_name, key) in [
        ("--dp-size", "dp_size"),
        ("--port", "zmq_port"),
        ("--replay-port", "replay_port"),
        ("--recover-port", "recover_port"),
    ] {
        assert_eq!(
            parse_int(flag(args, flag_name), flag_name),
            int(engine, key, file),
            "{name} {flag_name} vs {file} {key}"
        );
    }
}

#[test]
fn mock_engine_publishes_where_indexer_mock_toml_subscribes() {
    let file = "deploy/indexer.mock.toml";
    let (_, engine) = only_engine(file);
    let compose = compose();
    for name in ["mock-engine", "indexer-mock"] {
        let profiles = strings(&service(&compose, name)["profiles"], "profiles");
        assert_eq!(profiles, ["mock"], "{name}: only in the mock profile");
    }
    let args = strings(
        &service(&compose, "mock-engine")["command"],
        "mock-engine command",
    );
    assert_eq!(text(&engine, "host", file), "mock-engine");
    assert_eq!(flag(&args, "--bind"), Some("0.0.0.0"));
    assert_ports_match(&args, &engine, file, "mock-engine");
}

/// The Dockerfile stage named `name`: its lines from `FROM ... AS name` to the next `FROM`.
fn stage<'a>(dockerfile: &'a str, name: &str) -> Vec<&'a str> {
    let header = format!(" AS {name}");
    dockerfile
        .lines()
        .skip_while(|l| !(l.starts_with("FROM ") && l.ends_with(&header)))
        .enumerate()
        .take_while(|(i, l)| *i == 0 || !l.starts_with("FROM "))
        .map(|(_, l)| l)
        .collect()
}

/// The JSON (exec) form of a single-line instruction such as `CMD [...]`.
fn exec_form(stage: &[&str], instruction: &str) -> Vec<String> {
    let prefix = format!("{instruction} ");
    let lines: Vec<&str> = stage
        .iter()
        .filter_map(|l| l.strip_prefix(&prefix))
        .collect();
    assert_eq!(lines.len(), 1, "Dockerfile: one {instruction} in the stage");
    serde_json::from_str(lines[0])
        .unwrap_or_else(|e| panic!("Dockerfile {instruction} is not exec form: {e}"))
}

#[test]
fn indexer_containers_mount_their_toml_where_the_dockerfile_reads_it() {
    let dockerfile = read("Dockerfile");
    let last_from = dockerfile
        .lines()
        .rfind(|l| l.starts_with("FROM "))
        .unwrap_or_default();
    assert!(
        last_from.ends_with(" AS indexer"),
        "the default (last) stage is the indexer"
    );
    let indexer = stage(&dockerfile, "indexer");
    assert_eq!(
        exec_form(&indexer, "ENTRYPOINT"),
        ["/usr/local/bin/kv-indexer"]
    );
    let cmd = exec_form(&indexer, "CMD");
    let config_path = flag(&cmd, "--config").unwrap_or_else(|| panic!("CMD: no --config"));
    let listen_port = port_of(flag(&cmd, "--listen").unwrap_or_else(|| panic!("CMD: no --listen")));
    assert!(indexer.contains(&format!("EXPOSE {listen_port}").as_str()));
    let healthcheck = indexer.join("\n");
    assert!(
        healthcheck.contains(&format!("127.0.0.1:{listen_port}/health")),
        "HEALTHCHECK probes /health on the listen port"
    );

    let compose = compose();
    for (name, toml_file) in [
        ("indexer", "deploy/indexer.compose.toml"),
        ("indexer-mock", "deploy/indexer.mock.toml"),
        ("indexer-demo", "deploy/indexer.demo.toml"),
    ] {
        let service = service(&compose, name);
        assert_eq!(
            service["build"]["target"].as_str(),
            Some("indexer"),
            "{name}"
        );
        let mounts = strings(&service["volumes"], "volumes");
        let wanted = format!("./{toml_file}:{config_path}");
        assert!(
            mounts
                .iter()
                .any(|m| m == &wanted || m == &format!("{wanted}:ro")),
            "{name}: mounts {mounts:?}, wanted {wanted}"
        );
        let ports = strings(&service["ports"], "ports");
        assert!(
            ports
                .iter()
                .any(|p| p.ends_with(&format!(":{listen_port}"))),
            "{name}: publishes container port {listen_port}: {ports:?}"
        );
    }
}

#[test]
fn the_demo_engines_serve_where_indexer_demo_toml_subscribes_and_routes() {
    let file = "deploy/indexer.demo.toml";
    let table: toml::Table = read(file).parse().unwrap_or_else(|e| panic!("{file}: {e}"));
    let engines = table["engine"]
        .as_array()
        .unwrap_or_else(|| panic!("{file}: no [[engine]]"));
    let compose = compose();
    let volumes = |name: &str| strings(&service(&compose, name)["volumes"], "volumes");
    let indexer_mounts = volumes("indexer-demo");
    assert_eq!(engines.len(), 2, "{file}: two engines");
    for (engine, name) in engines.iter().zip(["demo-engine-a", "demo-engine-b"]) {
        let engine = engine
            .as_table()
            .unwrap_or_else(|| panic!("{file}: not a table"));
        let demo = service(&compose, name);
        assert_eq!(strings(&demo["profiles"], "profiles"), ["demo"], "{name}");
        let args = strings(&demo["command"], "command");
        assert_eq!(text(engine, "host", file), name);
        assert_eq!(flag(&args, "--bind"), Some("0.0.0.0"));
        assert_ports_match(&args, engine, file, name);
        let openai_port = parse_int(flag(&args, "--openai-port"), "--openai-port");
        assert_eq!(
            text(engine, "openai_url", file),
            format!("http://{name}:{openai_port}")
        );
        assert_eq!(flag(&args, "--model"), Some(text(engine, "model", file)));
        // The engine writes the tokenizer into the volume the indexer reads it from.
        let written = flag(&args, "--write-tokenizers").unwrap_or_else(|| panic!("{name}"));
        let (volume, _) = volumes(name)
            .iter()
            .find_map(|m| m.split_once(':').filter(|(_, at)| *at == written))
            .map(|(v, at)| (v.to_owned(), at.to_owned()))
            .unwrap_or_else(|| panic!("{name}: no volume at {written}"));
        let tokenizer = text(engine, "tokenizer", file);
        assert!(
            indexer_mounts.iter().any(|m| {
                let mut parts = m.split(':');
                parts.next() == Some(volume.as_str())
                    && parts.next().is_some_and(|at| tokenizer.starts_with(at))
            }),
            "indexer-demo mounts {volume} where {tokenizer} is: {indexer_mounts:?}"
        );
    }
    let route = table["route"]
        .as_table()
        .unwrap_or_else(|| panic!("{file}: no [route]"));
    let route_port = port_of(&format!("tcp://{}", text(route, "listen", file)));
    let ports = strings(&service(&compose, "indexer-demo")["ports"], "ports");
    assert!(
        ports.contains(&format!("{route_port}:{route_port}")),
        "indexer-demo publishes the route port {route_port}: {ports:?}"
    );
}

#[test]
fn deploy_tomls_pass_config_validation() {
    let config =
        Config::parse(&read("deploy/indexer.demo.toml"), "demo").unwrap_or_else(|e| panic!("{e}"));
    assert!(config.route.is_some() && config.engines.len() == 2);
    for file in ["deploy/indexer.compose.toml", "deploy/indexer.mock.toml"] {
        let config = Config::parse(&read(file), file).unwrap_or_else(|e| panic!("{e}"));
        let (_, engine) = only_engine(file);
        assert_eq!(config.engines.len(), 1, "{file}");
        assert_eq!(
            config.engines[0]
                .fixed()
                .map(|fixed| i64::from(fixed.dp_size)),
            Some(int(&engine, "dp_size", file))
        );
    }
}

#[test]
fn systemd_unit_runs_the_installed_binary_and_reloads_with_sighup() {
    let unit = read("deploy/kv-indexer.service");
    let service = service_section(&unit);
    let value = |key: &str| {
        let values = all(&service, key);
        assert_eq!(values.len(), 1, "[Service] {key} once");
        values[0]
    };
    let dockerfile = read("Dockerfile");
    let cmd = exec_form(&stage(&dockerfile, "indexer"), "CMD");
    let config_path = flag(&cmd, "--config").unwrap_or_default();
    assert_eq!(
        value("ExecStart"),
        format!("/usr/local/bin/kv-indexer --config {config_path}")
    );
    assert_eq!(value("ExecReload"), "/bin/kill -HUP $MAINPID");
    assert_eq!(value("Restart"), "on-failure");
    for hardening in ["DynamicUser", "NoNewPrivileges", "PrivateTmp"] {
        assert_eq!(value(hardening), "yes", "{hardening}");
    }
    assert_eq!(value("ProtectSystem"), "strict");
    assert_eq!(
        value("ProtectHome"),
        "tmpfs",
        "homes hidden, but for what is bound back"
    );
}

/// The `[Service]` section's `key=value` lines, comments left out, in order.
fn service_section(unit: &str) -> Vec<(&str, &str)> {
    unit.lines()
        .skip_while(|l| l.trim() != "[Service]")
        .skip(1)
        .take_while(|l| !l.starts_with('['))
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .collect()
}

/// Every value of a key that may repeat (`LoadCredential=`, `Environment=`).
fn all<'a>(service: &[(&str, &'a str)], key: &str) -> Vec<&'a str> {
    service
        .iter()
        .filter(|(k, _)| *k == key)
        .map(|(_, v)| *v)
        .collect()
}

/// docs.md "systemd": secrets stay 0600 and root's, handed over as credentials that the
/// documented `indexer.toml` names; a tokenizer in a home cache is readable through a
/// read-only bind of that cache, the one `HF_HOME` names.
#[test]
fn the_systemd_unit_hands_over_secrets_as_credentials_and_binds_the_model_cache_read_only() {
    let unit = read("deploy/kv-indexer.service");
    let service = service_section(&unit);
    let docs = read("docs.md");
    let section = docs
        .split("\n### systemd\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs.md has a systemd section");

    let credentials = all(&service, "LoadCredential");
    assert!(
        !credentials.is_empty(),
        "the unit loads its secrets as credentials"
    );
    for credential in &credentials {
        let (id, source) = credential
            .split_once(':')
            .unwrap_or_else(|| panic!("LoadCredential={credential}: ID:PATH"));
        assert!(
            source.starts_with("/etc/kv-indexer/"),
            "{credential}: a root-owned file beside the configuration"
        );
        let copy = format!("/run/credentials/kv-indexer.service/{id}");
        assert!(
            section.contains(&format!("\"{copy}\"")),
            "docs.md \"systemd\" names {copy} in its indexer.toml"
        );
        assert!(
            unit.contains("# Secrets stay 0600") && unit.contains(&copy),
            "the unit's own comment names {copy}"
        );
    }
    let toml = section
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs.md \"systemd\" shows the indexer.toml lines");
    let file = format!(
        "{toml}\n[[engine]]\nname = \"a\"\nhost = \"127.0.0.1\"\nopenai_url = \"http://127.0.0.1:8001\"\n"
    );
    let config = kv_indexer::config::Config::parse(&file, "docs.md \"systemd\"")
        .unwrap_or_else(|e| panic!("docs.md \"systemd\"'s indexer.toml: {e}"));
    assert!(config.route.is_some(), "the example routes");

    let environment = all(&service, "Environment");
    let hf_home = environment
        .iter()
        .find_map(|e| e.strip_prefix("HF_HOME="))
        .expect("the unit sets HF_HOME");
    let binds: Vec<&str> = all(&service, "BindReadOnlyPaths")
        .into_iter()
        .map(|b| b.trim_start_matches('-'))
        .collect();
    assert!(
        binds.iter().any(|b| hf_home.starts_with(b)),
        "HF_HOME={hf_home} is bound read-only (binds: {binds:?})"
    );
    assert!(
        hf_home.starts_with("/root/") || hf_home.starts_with("/home/"),
        "the shipped cache is a home cache, hidden but for the bind"
    );
    assert!(
        section.contains(&format!("BindReadOnlyPaths=-{hf_home}"))
            || section.contains("BindReadOnlyPaths=-/home/"),
        "docs.md shows how to bind another cache"
    );
}

/// docs.md "Restarts": the systemd unit gives the service `/var/lib/kv-indexer`
/// (`StateDirectory=`, a stop long enough to save), and the compose indexer keeps its
/// `state_dir` on a named volume, in a directory the image's user owns.
#[test]
fn the_state_dir_survives_a_restart_under_systemd_and_compose() {
    let unit = read("deploy/kv-indexer.service");
    let service_keys: Vec<&str> = unit
        .lines()
        .skip_while(|l| l.trim() != "[Service]")
        .filter(|l| !l.starts_with('#'))
        .collect();
    assert!(
        service_keys.contains(&"StateDirectory=kv-indexer"),
        "{service_keys:?}"
    );
    let dockerfile = read("Dockerfile");
    assert!(
        dockerfile.contains("install -d -o kv-indexer -g kv-indexer -m 0700 /var/lib/kv-indexer"),
        "the image's user owns the state directory"
    );
    let (top, _) = only_engine("deploy/indexer.compose.toml");
    let state_dir = text(&top, "state_dir", "deploy/indexer.compose.toml");
    assert_eq!(state_dir, "/var/lib/kv-indexer");
    let compose = compose();
    let mounts = strings(&service(&compose, "indexer")["volumes"], "volumes");
    let volume = mounts
        .iter()
        .find_map(|m| m.strip_suffix(&format!(":{state_dir}")))
        .unwrap_or_else(|| panic!("no volume at {state_dir}: {mounts:?}"));
    assert!(
        !compose["volumes"][volume].is_badvalue(),
        "{volume} is a named volume"
    );
}

/// Room a stop leaves for the state save and the listeners' stop, beside the drain: about 3 s
/// for 10 M blocks (docs.md "Restarts"), with a margin.
const SAVE_ROOM_S: u32 = 10;

/// A duration of a deployment file in seconds: `60s`, `1m`, or `45` (seconds).
fn seconds(value: &str, what: &str) -> u32 {
    let (number, unit) = match value.strip_suffix('m') {
        Some(minutes) => (minutes, 60),
        None => (value.strip_suffix('s').unwrap_or(value), 1),
    };
    number
        .parse::<u32>()
        .map(|n| n * unit)
        .unwrap_or_else(|_| panic!("{what}: {value:?} is not seconds or minutes"))
}

/// docs.md "Drain": a stop lets open answers finish for up to `[route] drain_s`, then saves the
/// state; systemd's `TimeoutStopSec` and each compose indexer's `stop_grace_period` leave room
/// for both (docker kills after 10 s by default, systemd after 90 s).
#[test]
fn a_stop_has_room_for_the_drain_and_the_save_under_systemd_and_compose() {
    let unit = read("deploy/kv-indexer.service");
    let stop = unit
        .lines()
        .find_map(|line| line.strip_prefix("TimeoutStopSec="))
        .expect("the unit sets TimeoutStopSec");
    let default_drain = kv_indexer::config::DEFAULT_DRAIN_S;
    assert!(
        seconds(stop, "TimeoutStopSec") > default_drain + SAVE_ROOM_S,
        "TimeoutStopSec={stop} leaves no room for a {default_drain} s drain and the save"
    );
    let compose = compose();
    for (name, file) in [
        ("indexer", "deploy/indexer.compose.toml"),
        ("indexer-demo", "deploy/indexer.demo.toml"),
        ("indexer-mock", "deploy/indexer.mock.toml"),
    ] {
        let config = Config::parse(&read(file), file).unwrap_or_else(|e| panic!("{e}"));
        let drain = config.route.as_ref().map_or(0, |route| route.drain_s);
        let save = if config.state.dir.is_some() {
            SAVE_ROOM_S
        } else {
            0
        };
        let needed = drain + save;
        if needed == 0 {
            continue;
        }
        let grace = service(&compose, name)["stop_grace_period"]
            .as_str()
            .map_or(10, |grace| seconds(grace, name));
        assert!(
            grace > needed,
            "{name}: stop_grace_period {grace} s, but {file} drains for {drain} s and saves"
        );
    }
}

/// Every `indexer.toml` example in the README is a file the indexer accepts, as written.
#[test]
fn the_readmes_toml_examples_parse() {
    let readme = read("README.md");
    let examples: Vec<&str> = readme
        .split("```toml\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .collect();
    assert!(examples.len() >= 3, "the README shows its examples");
    for example in examples {
        if let Err(e) = Config::parse(example, "README.md") {
            panic!("README.md's example does not parse:\n{example}\n{e}");
        }
    }
}

/// docs.md "Routing": the cached tokens a router weighs are what vLLM reports with
/// `--enable-prompt-tokens-details`; every `vllm serve` the docs show starts it so.
#[test]
fn every_vllm_the_docs_start_reports_its_cached_tokens() {
    for file in ["README.md", "docs.md"] {
        let text = read(file);
        let commands: Vec<String> = text
            .split("vllm serve ")
            .skip(1)
            .map(|rest| {
                // A command runs to the first line that does not end in a backslash.
                let mut command = String::new();
                for line in rest.lines() {
                    command.push_str(line);
                    if !line.trim_end().ends_with('\\') {
                        break;
                    }
                }
                command
            })
            .filter(|command| command.contains("--"))
            .collect();
        assert!(!commands.is_empty(), "{file} shows how to start vLLM");
        for command in commands {
            assert!(
                command.contains("--enable-prompt-tokens-details"),
                "{file}: vllm serve {command}"
            );
        }
    }
}

/// docs.md "Two route front ends on one fleet": the router's file it shows is one the indexer
/// accepts, with the engines' tables beside it.
#[test]
fn the_two_router_set_up_in_the_docs_parses() {
    let docs = read("docs.md");
    let section = docs
        .split("### Two route front ends on one fleet\n")
        .nth(1)
        .expect("docs.md shows two route front ends");
    let toml = section
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("its indexer.toml");
    let (top, tables) = toml.split_once("\n[route]").expect("a [route] table");
    let file = format!(
        "{top}\n[[engine]]\nname = \"a\"\nhost = \"10.0.0.5\"\nopenai_url = \"http://10.0.0.5:8000\"\n\n[route]{tables}"
    );
    let config = Config::parse(&file, "docs.md")
        .unwrap_or_else(|e| panic!("docs.md's two-router file: {e}"));
    assert!(config.route.is_some());
    assert_eq!(config.replicas.peers.len(), 1, "each names the other");
}
