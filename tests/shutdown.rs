//! SIGTERM of the real binary while a reload is starting thousands of engines: it exits 0
//! within a second (docs.md "Signals"), without waiting for the reload to finish.

#[path = "support/http_client.rs"]
mod http_client;

use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use http_client::{free_port, wait_for};

/// Engines in the reload, one rank each, at addresses where nobody listens. A listener whose
/// engine is down holds about 6 descriptors; 2,500 of them fit the 20,000 this machine allows
/// (5,000 would need 30,000).
const ENGINES: usize = 2_500;

fn config(listen: SocketAddr, engines: usize) -> String {
    let mut toml = format!("listen = \"{listen}\"\nblock_size = 16\nshards = 8\n");
    for n in 0..engines {
        toml.push_str(&format!(
            "\n[[engine]]\nname = \"e{n}\"\nhost = \"127.2.{}.{}\"\nzmq_port = 9\n",
            n / 250,
            n % 250 + 1
        ));
    }
    toml
}

fn threads(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid}");
}

#[test]
fn sigterm_during_a_large_reload_exits_0_within_a_second() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("indexer.toml");
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    std::fs::write(&path, config(listen, 1)).expect("write config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .arg("--config")
        .arg(&path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kv-indexer");
    let pid = child.id();
    wait_for(30, "the HTTP API to answer", || {
        TcpStream::connect(listen).ok().map(|_| ())
    });
    std::fs::write(&path, config(listen, ENGINES)).expect("write the large config");
    let before = threads(pid);
    signal(pid, "HUP");
    wait_for(60, "the reload to start listeners", || {
        (threads(pid) > before + 1_000).then_some(())
    });
    let started = threads(pid) - before;
    signal(pid, "TERM");
    let sent = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            break status;
        }
        if sent.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("still running 60 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = sent.elapsed();
    eprintln!("SIGTERM with {started} of {ENGINES} listeners started: exited {status} in {took:?}");
    assert!(status.success(), "{status}");
    assert!(
        took < Duration::from_secs(1),
        "SIGTERM took {took:?}; docs.md promises under a second"
    );
}
