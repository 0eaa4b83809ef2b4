//! The real binary's `--check`: the shipped file, a multi-rank file, a two-node deployment, and
//! broken input.

use std::path::Path;
use std::process::{Command, Output};

fn check(config: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .arg("--check")
        .arg("--config")
        .arg(config)
        .args(extra)
        .output()
        .unwrap_or_else(|err| panic!("running kv-indexer: {err}"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn temp_config(body: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("temp dir: {err}"));
    let path = dir.path().join("indexer.toml");
    std::fs::write(&path, body).unwrap_or_else(|err| panic!("writing {path:?}: {err}"));
    (dir, path)
}

#[test]
fn the_shipped_file_checks_clean_and_subscribes_to_the_vllm_default_endpoint() {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("indexer.toml");
    let output = check(&shipped, &[]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|line| line.starts_with("local "))
        .collect();
    assert_eq!(rows.len(), 1, "{stdout}");
    assert!(rows[0].contains("tcp://127.0.0.1:5557"), "{stdout}");
    assert!(
        stdout.contains("1 engine, 1 listener; listen 127.0.0.1:8090, block_size 16\n"),
        "{stdout}"
    );
}

/// The shipped file names the routing keys in its comments: uncommenting them (but the files
/// they point to) gives a file that routes.
#[test]
fn the_shipped_file_routes_once_its_routing_lines_are_uncommented() {
    let shipped =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("indexer.toml"))
            .unwrap_or_else(|err| panic!("reading indexer.toml: {err}"));
    let mut in_route = false;
    let mut uncommented = 0;
    let routing: Vec<String> = shipped
        .lines()
        .map(|line| {
            if line.starts_with("# [") {
                in_route = line == "# [route]" || line == "# [select]";
            }
            let key = |prefix: &str| line.starts_with(prefix);
            let wanted = key("# openai_url = ")
                || key("# metrics_url = ")
                || (in_route && !key("# auth_token_file") && line.contains(" = "))
                || line == "# [route]"
                || line == "# [select]";
            if wanted {
                uncommented += 1;
                line.trim_start_matches("# ").to_owned()
            } else {
                line.to_owned()
            }
        })
        .collect();
    assert!(
        uncommented >= 6,
        "the routing lines are in indexer.toml's comments"
    );
    let (_dir, path) = temp_config(&routing.join("\n"));
    let output = check(&path, &[]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert!(stdout.contains("route: listen 127.0.0.1:8080"), "{stdout}");
    assert!(
        stdout.contains("  local -> http://127.0.0.1:8000"),
        "{stdout}"
    );
}

#[test]
fn every_rank_gets_a_row_on_port_plus_rank() {
    let (_dir, path) = temp_config(
        "[[engine]]\nname = \"vllm-a\"\nhost = \"10.0.0.5\"\nzmq_port = 5557\ndp_size = 2\nreplay_port = 5600\nmodel = \"m\"\ninstance_id = 7\n",
    );
    let output = check(&path, &["--listen", "0.0.0.0:9000"]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|line| line.starts_with("vllm-a"))
        .map(|line| line.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows,
        vec![
            vec![
                "vllm-a",
                "0",
                "tcp://10.0.0.5:5557",
                "tcp://10.0.0.5:5600",
                "-",
                "\"\"",
                "7",
                "m"
            ],
            vec![
                "vllm-a",
                "1",
                "tcp://10.0.0.5:5558",
                "tcp://10.0.0.5:5601",
                "-",
                "\"\"",
                "7",
                "m"
            ],
        ],
        "{stdout}"
    );
    assert!(
        stdout.contains("1 engine, 2 listeners; listen 0.0.0.0:9000"),
        "{stdout}"
    );
}

#[test]
fn a_two_node_deployment_lists_node_b_under_its_global_ranks_on_base_port_plus_rank() {
    let (_dir, path) = temp_config(
        r#"
[defaults]
zmq_port = 5557
replay_port = 5600
dp_size = 2
[[engine]]
name = "llama-node-a"
host = "10.0.0.7"
[[engine]]
name = "llama-node-b"
host = "10.0.0.8"
dp_rank_start = 2
"#,
    );
    let output = check(&path, &[]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|line| line.starts_with("llama-node-"))
        .map(|line| line.split_whitespace().take(4).collect())
        .collect();
    assert_eq!(
        rows,
        vec![
            vec![
                "llama-node-a",
                "0",
                "tcp://10.0.0.7:5557",
                "tcp://10.0.0.7:5600"
            ],
            vec![
                "llama-node-a",
                "1",
                "tcp://10.0.0.7:5558",
                "tcp://10.0.0.7:5601"
            ],
            vec![
                "llama-node-b",
                "2",
                "tcp://10.0.0.8:5559",
                "tcp://10.0.0.8:5602"
            ],
            vec![
                "llama-node-b",
                "3",
                "tcp://10.0.0.8:5560",
                "tcp://10.0.0.8:5603"
            ],
        ],
        "{stdout}"
    );
    assert!(stdout.contains("2 engines, 4 listeners"), "{stdout}");
}

#[test]
fn a_broken_file_prints_every_problem_naming_the_file_and_exits_1() {
    let (_dir, path) = temp_config(
        "shards = 3\n[[engine]]\nname = \"a\"\nhost = \"h\"\ndp_size = 2\nreplay_port = 5558\n",
    );
    let output = check(&path, &["--listen", "nonsense"]);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(output.stdout.is_empty(), "{output:?}");
    let file = path.display().to_string();
    let problem = |words: &[&str]| {
        stderr
            .lines()
            .any(|line| words.iter().all(|w| line.contains(w)))
    };
    assert!(problem(&[&format!("{file}:1:"), "`shards`"]), "{stderr}");
    assert!(
        problem(&[
            &format!("{file}:2:"),
            "engine \"a\"",
            "replay ports 5558..5559"
        ]),
        "{stderr}"
    );
    assert!(problem(&["--listen", "nonsense"]), "{stderr}");
}

#[test]
fn an_unreadable_file_names_the_path_and_exits_1() {
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("temp dir: {err}"));
    let path = dir.path().join("missing.toml");
    let output = check(&path, &[]);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(
        text(&output.stderr).contains(&path.display().to_string()),
        "{output:?}"
    );
}

#[test]
fn a_100000_character_name_and_model_are_listed_whole_without_padding_the_other_rows() {
    let long = "x".repeat(100_000);
    let (_dir, path) = temp_config(&format!(
        "[[engine]]\nname = \"{long}\"\nhost = \"h\"\nmodel = \"{long}\"\n[[engine]]\nname = \"short\"\nhost = \"h2\"\n"
    ));
    let output = check(&path, &[]);
    let stderr = text(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let stdout = text(&output.stdout);
    let row = |engine: &str| {
        stdout
            .lines()
            .find(|line| line.split_whitespace().next() == Some(engine))
            .unwrap_or_else(|| panic!("no row of {engine:.20} in {stdout:.300}"))
    };
    let long_row: Vec<&str> = row(&long).split_whitespace().collect();
    let widths: Vec<usize> = long_row.iter().map(|cell| cell.len()).collect();
    assert_eq!(widths.len(), 8, "cell widths {widths:?}");
    assert_eq!(long_row[7], long);
    // Padding the other rows to a 100,000-character column would make each that long.
    assert!(row("short").len() < 1000, "{}", row("short").len());
    assert!(stdout.contains("2 engines, 2 listeners"), "{stdout:.300}");
}

#[test]
fn an_engine_with_an_unknown_key_or_no_host_still_has_its_port_ranges_checked() {
    let (_dir, path) = temp_config(
        "[[engine]]\nname = \"a\"\nhost = \"h\"\nzmq_port = 65535\ndp_size = 4\ncolour = \"blue\"\n[[engine]]\nname = \"b\"\nhots = \"h\"\nzmq_port = 65535\ndp_size = 4\n",
    );
    let output = check(&path, &[]);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    let file = path.display().to_string();
    let problems: Vec<&str> = stderr
        .lines()
        .filter(|line| {
            line.strip_prefix(&format!("{file}:"))
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .collect();
    for words in [
        [":6:", "engine \"a\"", "unknown key `colour`"],
        [
            ":1:",
            "engine \"a\"",
            "zmq ports 65535..65538 run past 65535",
        ],
        [":9:", "engine \"b\"", "unknown key `hots`"],
        [":7:", "engine \"b\"", "missing `host`"],
        [
            ":7:",
            "engine \"b\"",
            "zmq ports 65535..65538 run past 65535",
        ],
    ] {
        let at = format!("{file}{}", words[0]);
        let found = problems
            .iter()
            .filter(|line| line.starts_with(&at) && words[1..].iter().all(|w| line.contains(w)))
            .count();
        assert_eq!(found, 1, "{words:?} in {stderr}");
    }
    assert_eq!(problems.len(), 5, "{stderr}");
    assert!(stderr.contains("5 problems found"), "{stderr}");
}

/// A simulated vLLM with `dp_size` ranks on OS-picked ports and its API server.
fn discoverable_engine(dp_size: u32) -> kv_indexer_sim::server::SimEngine {
    kv_indexer_sim::server::SimEngine::start(kv_indexer_sim::server::SimConfig {
        dp_size,
        recover_port: None,
        api_port: Some(0),
        ..Default::default()
    })
    .unwrap_or_else(|err| panic!("{err:#}"))
}

#[test]
fn check_stays_offline_and_check_discover_asks_the_engine_and_marks_its_rows() {
    let engine = discoverable_engine(2);
    let api = engine.api_port().expect("API port");
    let (_dir, path) = temp_config(&format!(
        "[[engine]]\nname = \"asked\"\ndiscover = \"http://127.0.0.1:{api}\"\ndp_size = 1\n\
         [[engine]]\nname = \"fixed\"\nhost = \"10.0.0.5\"\n"
    ));
    let offline = check(&path, &[]);
    let stdout = text(&offline.stdout);
    assert!(offline.status.success(), "{offline:?}");
    assert!(
        !stdout.contains("asked"),
        "no ranks without asking: {stdout}"
    );
    assert!(!stdout.contains("SOURCE"), "{stdout}");

    let asked = check(&path, &["--discover"]);
    let (stdout, stderr) = (text(&asked.stdout), text(&asked.stderr));
    assert!(asked.status.success(), "{stdout}{stderr}");
    let header: Vec<&str> = stdout
        .lines()
        .find(|line| line.starts_with("ENGINE"))
        .map(|line| line.split_whitespace().collect())
        .unwrap_or_default();
    let columns = [
        "ENGINE",
        "RANK",
        "ENDPOINT",
        "REPLAY",
        "RECOVER",
        "TOPIC",
        "INSTANCE_ID",
        "MODEL",
        "SOURCE",
    ];
    assert_eq!(header, columns, "{stdout}");
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .skip(1)
        .filter(|line| line.starts_with("asked") || line.starts_with("fixed"))
        .map(|line| line.split_whitespace().collect())
        .collect();
    let ports = engine.ports();
    let expected = |rank: usize| {
        vec![
            "asked".to_string(),
            rank.to_string(),
            format!("tcp://127.0.0.1:{}", ports[rank].publish),
            format!("tcp://127.0.0.1:{}", ports[rank].replay.expect("replay")),
            kv_indexer::config::derived_instance_id("asked").to_string(),
            "vllm".to_string(),
        ]
    };
    let picked = |row: &Vec<&str>| -> Vec<String> {
        [0, 1, 2, 3, 6, row.len() - 1]
            .iter()
            .map(|&i| row[i].to_string())
            .collect()
    };
    assert_eq!(rows.len(), 3, "{stdout}");
    assert_eq!(picked(&rows[0]), expected(0), "{stdout}");
    assert_eq!(picked(&rows[1]), expected(1), "{stdout}");
    assert_eq!(rows[2].last(), Some(&"file"), "{stdout}");
    assert!(
        stderr.contains("engine asked: dp_size = 1 in the file, the engine runs 2 ranks (0, 1)"),
        "{stderr}"
    );
}

#[test]
fn check_discover_fails_naming_the_engine_that_cannot_be_asked() {
    let closed = kv_indexer_sim::ports::free_port().unwrap_or_else(|error| panic!("{error:#}"));
    let (_dir, path) = temp_config(&format!(
        "[[engine]]\nname = \"down\"\ndiscover = \"http://127.0.0.1:{closed}\"\n"
    ));
    let output = check(&path, &["--discover"]);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "engine down: http://127.0.0.1:{closed}/kv_event_sources"
        )),
        "{stderr}"
    );
    assert!(stderr.contains("1 engine could not be asked"), "{stderr}");
}

/// `--check` reads what the file points to and resolves what it binds: each problem names the
/// key's line, and a front end with nothing to route to is a warning.
#[test]
fn files_the_configuration_points_to_are_read_and_its_addresses_resolved() {
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("temp dir: {err}"));
    let missing = dir.path().join("missing");
    let empty = dir.path().join("empty-key");
    std::fs::write(&empty, "\n").unwrap_or_else(|err| panic!("writing the key: {err}"));
    let body = format!(
        "listen = \"127.0.0.1:18090\"\n\
         auth_token_file = '{missing}/admin'\n\
         [[engine]]\n\
         name = \"vllm-a\"\n\
         host = \"127.0.0.1\"\n\
         model = \"m\"\n\
         tokenizer = '{missing}/tokenizer'\n\
         openai_url = \"http://127.0.0.1:8000\"\n\
         api_key_file = '{empty}'\n\
         [route]\n\
         listen = \"0.0.0.0:18090\"\n\
         auth_token_file = '{missing}/route'\n",
        missing = missing.display(),
        empty = empty.display(),
    );
    let (_config_dir, path) = temp_config(&body);
    let output = check(&path, &[]);
    let stderr = text(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    let origin = path.display().to_string();
    for (line, wanted) in [
        (2, "auth_token_file"),
        (7, "tokenizer"),
        (9, "api_key_file"),
        (11, "would bind the same port"),
        (12, "[route] auth_token_file"),
    ] {
        let prefix = format!("{origin}:{line}: ");
        assert!(
            stderr
                .lines()
                .any(|problem| problem.starts_with(&prefix) && problem.contains(wanted)),
            "no {wanted:?} on line {line}:\n{stderr}"
        );
    }
    assert!(stderr.contains("5 problems found"), "{stderr}");

    // Clean but with nowhere to route: a warning, and the check passes.
    let (_config_dir, path) = temp_config(
        "[[engine]]\nname = \"vllm-a\"\nhost = \"127.0.0.1\"\n[route]\nlisten = \"127.0.0.1:18091\"\n",
    );
    let output = check(&path, &[]);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning:") && stderr.contains("no engine has an openai_url"),
        "{stderr}"
    );
}
