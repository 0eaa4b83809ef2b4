//! A published router (sglang-router, vllm-router, …) as a child process in front of the live
//! fleet: `--external NAME=COMMAND`, the command a shell line in which `{port}` becomes the
//! port it must listen on (127.0.0.1) and `{workers}` the engines' OpenAI URLs, space-separated.
//!
//! Owns: the child (started with `exec`, so its id is the router's; killed and reaped on drop)
//! and its log file. Never: installs anything, or guesses a router's flags: the command is the
//! user's, as the router's `--help` spells them.

use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// How long a router may take to answer `GET /health` after it was started.
const START_WAIT: Duration = Duration::from_secs(60);

/// The lines of its log an error shows when a router did not come up.
const LOG_TAIL: usize = 20;

/// `--external NAME=COMMAND` as given.
#[derive(Clone, Debug)]
pub struct External {
    pub name: String,
    command: String,
}

impl FromStr for External {
    type Err = String;

    fn from_str(given: &str) -> Result<External, String> {
        let (name, command) = given.split_once('=').ok_or_else(|| {
            format!("--external {given:?}: expected NAME=COMMAND (with {{port}} and {{workers}})")
        })?;
        if name.is_empty() || !command.contains("{port}") || !command.contains("{workers}") {
            return Err(format!(
                "--external {given:?}: NAME=COMMAND, the command naming {{port}} and {{workers}}"
            ));
        }
        Ok(External {
            name: name.to_string(),
            command: command.to_string(),
        })
    }
}

/// A running published router.
pub struct ExternalRouter {
    child: Child,
    addr: SocketAddr,
}

impl ExternalRouter {
    /// Starts `external` in front of `workers` and waits until it answers `GET /health` with
    /// 200; a router that exits or never answers is an error showing the end of its log.
    pub fn start(external: &External, workers: &[String]) -> Result<ExternalRouter> {
        // The OS picks a free port; the router binds it a moment later.
        let addr = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let command = external
            .command
            .replace("{port}", &addr.port().to_string())
            .replace("{workers}", &workers.join(" "));
        let log = log_path(&external.name, addr);
        let file = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!("exec {command}"))
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {}: sh -c {command:?}", external.name))?;
        let mut router = ExternalRouter { child, addr };
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(2)))
            .build()
            .into();
        let started = Instant::now();
        loop {
            if let Some(status) = router.child.try_wait()? {
                bail!(
                    "{} exited ({status}) before answering /health: {command}\n{}",
                    external.name,
                    tail(&log)
                );
            }
            let health = agent.get(&format!("http://{addr}/health")).call();
            if health.is_ok_and(|reply| reply.status() == 200) {
                return Ok(router);
            }
            if started.elapsed() > START_WAIT {
                bail!(
                    "{} did not answer /health on {addr} within {START_WAIT:?}: {command}\n{}",
                    external.name,
                    tail(&log)
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for ExternalRouter {
    fn drop(&mut self) {
        // Only this child, by its own id; an error means it is gone already.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The router's log: in the temporary directory, one a run, kept for reading afterwards.
fn log_path(name: &str, addr: SocketAddr) -> PathBuf {
    let safe: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    std::env::temp_dir().join(format!("ladder-{safe}-{}.log", addr.port()))
}

fn tail(log: &PathBuf) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(LOG_TAIL);
    format!("{} (end):\n{}", log.display(), lines[from..].join("\n"))
}
