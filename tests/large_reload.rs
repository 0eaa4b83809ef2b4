//! A reload that starts thousands of engines whose endpoints never answer: `/workers` and
//! `/ready` answer meanwhile from what the registry last published, and SIGTERM ends the real
//! binary within a second (docs.md "Running it") without waiting for the reload, or the
//! start-up, to finish.

mod support;

use std::time::{Duration, Instant};

use kv_indexer_sim::indexer_toml::{indexer_toml, EngineToml};
use kv_indexer_sim::process::IndexerProcess;
use kv_indexer_sim::procfs::Proc;
use support::http_client::{get, wait_for};
use support::{indexer_binary, one_at_a_time, start_service};

/// Engines in a reload, one rank each. Starting them takes seconds on a shared 2-core machine
/// (about 1 ms each in a debug build), and a listener whose engine is down holds about 6
/// descriptors: 2,500 fit the 20,000 this machine allows (5,000 would need 30,000).
const ENGINES: usize = 2_500;

/// A config of `engines` engines at 127.1.x.y:9, where nobody listens.
fn config(engines: usize) -> String {
    let engines: Vec<EngineToml> = (0..engines)
        .map(|n| EngineToml {
            host: Some(format!("127.1.{}.{}", n / 250, n % 250 + 1)),
            ..EngineToml::new(format!("e{n}"), 9)
        })
        .collect();
    indexer_toml(Some("127.0.0.1:1"), 16, &engines)
}

/// The open descriptors of `process` (0 once it is gone): listeners run on a few pollers, so
/// their descriptors (about 6 each while their engine is down) show them being started.
fn descriptors(process: Proc) -> u64 {
    process
        .holdings()
        .map_or(0, |holdings| holdings.descriptors)
}

fn ranks_listed(workers: &serde_json::Value) -> usize {
    workers
        .as_array()
        .expect("/workers is an array")
        .iter()
        .map(|engine| engine["listeners"].as_array().map_or(0, Vec::len))
        .sum()
}

#[test]
fn workers_and_ready_answer_while_a_reload_starts_many_engines() {
    let _serial = one_at_a_time();
    let running = start_service(&config(1));
    let (service, addr) = (running.service(), running.http_addr());
    assert_eq!(ranks_listed(&get(addr, "/workers").json()), 1);
    std::fs::write(running.config_path(), config(ENGINES)).expect("write the large config");

    let before = descriptors(Proc::Myself);
    std::thread::scope(|scope| {
        let reload = scope.spawn(|| {
            let diff = service.reload().expect("the large config is valid");
            (diff, Instant::now())
        });
        // The reload is under way once its listeners' descriptors appear (50 listeners).
        wait_for(60, "the reload to start listeners", || {
            (descriptors(Proc::Myself) > before + 300).then_some(())
        });
        let asked = Instant::now();
        let workers = get(addr, "/workers");
        let ready = get(addr, "/ready");
        let answered = Instant::now();
        let (diff, reloaded) = reload.join().expect("reload thread");
        assert_eq!(diff.added.len(), ENGINES - 1, "{:?}", diff.failed);
        assert_eq!(workers.status, 200);
        assert_eq!(ready.status, 503, "e0 is not connected: {}", ready.text());
        // Answered from the registry as it was before the reload: the reload had not
        // finished, so these requests did not wait for it.
        assert_eq!(
            ranks_listed(&workers.json()),
            1,
            "/workers waited {:?} for the reload",
            answered - asked
        );
        assert!(answered < reloaded);
    });
    let after = get(addr, "/workers");
    assert_eq!(ranks_listed(&after.json()), ENGINES);
}

/// Waits until `indexer` has 6,000 more descriptors than `before` (1,000 listeners), sends
/// SIGTERM, and checks that it exits 0 within a second (bounded at 60 s).
fn terminated_within_a_second(mut indexer: IndexerProcess, before: u64, during: &str) {
    let pid = Proc::Pid(indexer.pid().expect("running"));
    wait_for(60, "the indexer to start listeners", || {
        (descriptors(pid) > before + 6_000).then_some(())
    });
    let started = (descriptors(pid) - before) / 6;
    indexer
        .signal(libc::SIGTERM)
        .unwrap_or_else(|error| panic!("{error:#}"));
    let (status, took) = indexer
        .wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|error| panic!("{error:#} after SIGTERM"));
    eprintln!(
        "SIGTERM during {during} with {started} of {ENGINES} listeners started: exited {status} \
         in {took:?}"
    );
    assert!(status.success(), "{status}");
    assert!(
        took < Duration::from_secs(1),
        "SIGTERM during {during} took {took:?}; docs.md promises under a second"
    );
}

#[test]
fn sigterm_during_a_large_reload_exits_0_within_a_second() {
    let _serial = one_at_a_time();
    let indexer = IndexerProcess::launch(indexer_binary(), &config(1))
        .start(Duration::from_secs(30))
        .unwrap_or_else(|error| panic!("{error:#}"));
    indexer
        .write_config(&config(ENGINES))
        .unwrap_or_else(|error| panic!("{error:#}"));
    let before = descriptors(Proc::Pid(indexer.pid().expect("running")));
    indexer
        .signal(libc::SIGHUP)
        .unwrap_or_else(|error| panic!("{error:#}"));
    terminated_within_a_second(indexer, before, "a reload");
}

#[test]
fn sigterm_during_a_large_start_up_exits_0_within_a_second() {
    let _serial = one_at_a_time();
    let indexer = IndexerProcess::launch(indexer_binary(), &config(ENGINES))
        .spawn()
        .unwrap_or_else(|error| panic!("{error:#}"));
    terminated_within_a_second(indexer, 0, "start-up");
}
