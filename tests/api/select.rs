//! `POST /select`, the reservation routes and `GET /loads` (docs.md "Selection") over real HTTP
//! on 127.0.0.1, served in-process by `Service` over the real registry, listeners and index,
//! fed by scripted engine ranks over real ZMQ: the formula on docs.md's worked example, the
//! tie-breaks, reservations and their expiry, predictions, auth, reload and bad input. The
//! selection's clock is manual: time-to-lives pass only when a test advances it.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::fake_engine::{prompt, FakeRank, BLOCK_SIZE};
use crate::support::http_client::{get, metric_value, post, wait_for, Connection, Reply};
use crate::support::start_service_with_select_clock;
use kv_indexer::select::Clock;
use kv_indexer::wire::{BlockStored, Event};
use kv_indexer_sim::indexer_toml::{indexer_toml, replica_keys, select_table, EngineToml};
use kv_indexer_sim::running::RunningService;
use serde_json::{json, Value};

/// Engines `a`, `b`, … (dp_size 1 each) on `ranks`, with `extra` top-level keys first and a
/// `[select]` table of `select` last.
fn config(ranks: &[FakeRank], extra: &str, select: &[(&str, &str)]) -> String {
    let engines: Vec<EngineToml> = ranks
        .iter()
        .enumerate()
        .map(|(at, rank)| EngineToml::new(((b'a' + at as u8) as char).to_string(), rank.port))
        .collect();
    let file = indexer_toml(Some("127.0.0.1:1"), BLOCK_SIZE, &engines);
    format!("{extra}{file}{}", select_table(select))
}

struct Setup {
    running: RunningService,
    ranks: Vec<FakeRank>,
    /// The selection's clock: it stands still until the test advances it.
    clock: Clock,
}

impl Setup {
    fn start(engines: usize, extra: &str, select: &[(&str, &str)]) -> Setup {
        let zmq = zmq::Context::new();
        let ranks: Vec<FakeRank> = (0..engines).map(|_| FakeRank::bind(&zmq, 0)).collect();
        let clock = Clock::manual();
        let running =
            start_service_with_select_clock(&config(&ranks, extra, select), clock.clone());
        for rank in &ranks {
            rank.wait_subscribed();
        }
        let setup = Setup {
            running,
            ranks,
            clock,
        };
        let addr = setup.addr();
        // Connected, nothing published yet: partial (scored on what they will send).
        wait_for(10, "every rank connected and scored", || {
            let workers = get(addr, "/workers").json();
            let listeners: Vec<&Value> = workers
                .as_array()?
                .iter()
                .flat_map(|engine| engine["listeners"].as_array().into_iter().flatten())
                .collect();
            let ready = listeners.len() == engines
                && listeners
                    .iter()
                    .all(|l| l["connected"] == true && l["state"] == "partial");
            ready.then_some(())
        });
        setup
    }

    fn addr(&self) -> SocketAddr {
        self.running.http_addr()
    }

    /// Stores `blocks` of `tokens` (hashes 1..) on engine `at`, GPU, and waits for the index.
    fn store(&mut self, at: usize, tokens: &[u32], blocks: usize) {
        let hashes: Vec<u64> = (1..=blocks as u64).map(|h| h + 1000 * at as u64).collect();
        self.ranks[at].store(&hashes, None, &tokens[..blocks * BLOCK_SIZE as usize]);
        self.wait_matched(at, tokens, blocks);
    }

    fn wait_matched(&self, at: usize, tokens: &[u32], blocks: usize) {
        let name = ((b'a' + at as u8) as char).to_string();
        let addr = self.addr();
        wait_for(10, "the blocks to be indexed", || {
            let answer = post(
                addr,
                "/query",
                json!({ "token_ids": tokens }).to_string().as_bytes(),
            )
            .json();
            let found = answer["scores"].as_array()?.iter().any(|score| {
                score["instance"] == name.as_str() && score["matched_blocks"] == blocks
            });
            found.then_some(())
        });
    }
}

fn select(addr: SocketAddr, body: Value) -> Value {
    let reply = post(addr, "/select", body.to_string().as_bytes());
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()
}

fn send(addr: SocketAddr, method: &str, path: &str, token: Option<&str>, body: &[u8]) -> Reply {
    let bearer = token.map(|token| format!("Bearer {token}"));
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(bearer) = &bearer {
        headers.push(("Authorization", bearer));
    }
    Connection::open(addr).send_with(method, path, &headers, Some(body))
}

/// `(instance, cost)` of each candidate, in the answer's order.
fn costs(answer: &Value) -> Vec<(String, f64)> {
    answer["candidates"]
        .as_array()
        .unwrap_or_else(|| panic!("no candidates: {answer}"))
        .iter()
        .map(|c| {
            let name = c["instance"].as_str().expect("instance").to_owned();
            (name, c["cost"].as_f64().expect("cost"))
        })
        .collect()
}

fn candidate<'a>(answer: &'a Value, instance: &str) -> &'a Value {
    answer["candidates"]
        .as_array()
        .and_then(|all| all.iter().find(|c| c["instance"] == instance))
        .unwrap_or_else(|| panic!("{instance} is not a candidate: {answer}"))
}

fn loads(addr: SocketAddr, instance: &str) -> Value {
    let all = get(addr, "/loads").json();
    all.as_array()
        .and_then(|all| all.iter().find(|rank| rank["instance"] == instance))
        .cloned()
        .unwrap_or_else(|| panic!("{instance} not in /loads: {all}"))
}

/// docs.md's worked example: `a` holds 4 of the 8 blocks in GPU, the 5th in CPU and the 6th on
/// disk; `b` nothing. Then a reservation on `a` makes its load count, and its prediction
/// shows on a second prompt sharing the prefix — never in `/query`.
#[test]
fn the_worked_example_reservation_load_and_prediction() {
    let mut setup = Setup::start(2, "", &[]);
    let addr = setup.addr();
    let tokens = prompt(100, 8);
    let block = |b: usize| tokens[b * 16..(b + 1) * 16].to_vec();
    let tier = |medium: &str, hash: u64, b: usize| {
        Event::Stored(BlockStored {
            medium: Some(medium.into()),
            ..BlockStored::new(vec![hash], Some(hash - 1), block(b), BLOCK_SIZE)
        })
    };
    setup.store(0, &tokens, 4);
    setup.ranks[0].publish(vec![tier("CPU", 5, 4), tier("DISK", 6, 5)]);
    let addr_query = json!({ "token_ids": tokens }).to_string();
    wait_for(10, "the CPU and disk blocks", || {
        let answer = post(addr, "/query", addr_query.as_bytes()).json();
        (answer["scores"][0]["tiers"] == json!({"gpu": 4, "cpu": 5, "disk": 6})).then_some(())
    });

    let answer = select(addr, json!({ "token_ids": tokens }));
    assert_eq!(
        answer,
        json!({
            "instance": "a", "dp_rank": 0, "instance_id": answer["instance_id"], "query_tokens": 128, "query_blocks": 8,
            "policy": "cost",
            "candidates": [
                {"instance": "a", "dp_rank": 0, "matched_blocks": 4, "predicted_blocks": 0,
                 "overlap_blocks": 5.0, "prefill_blocks": 3.0, "active_prefill_blocks": 0.0,
                 "active_decode_blocks": 0, "reservations": 0, "outside_requests": 0.0, "outside_blocks": 0.0,
                 "engine_load": null, "cost": 3.0},
                {"instance": "b", "dp_rank": 0, "matched_blocks": 0, "predicted_blocks": 0,
                 "overlap_blocks": 0.0, "prefill_blocks": 8.0, "active_prefill_blocks": 0.0,
                 "active_decode_blocks": 0, "reservations": 0, "outside_requests": 0.0, "outside_blocks": 0.0,
                 "engine_load": null, "cost": 8.0},
            ]
        })
    );
    assert!(answer["instance_id"].is_u64(), "{answer}");

    // Reserved with 40 output tokens: 8 + ceil(40 / 16) = 11 blocks to decode, 3 to prefill.
    let reserved = select(
        addr,
        json!({ "token_ids": tokens, "reserve": true, "expected_output_tokens": 40 }),
    );
    assert_eq!(reserved["instance"], "a");
    let id = reserved["reservation_id"]
        .as_u64()
        .expect("a reservation id");
    assert_eq!(
        loads(addr, "a"),
        json!({"instance": "a", "dp_rank": 0, "reservations": 1, "active_prefill_blocks": 3.0,
               "active_decode_blocks": 11, "predicted_prefixes": 1,
               "outside_requests": 0.0, "outside_blocks": 0.0, "engine_load": null})
    );

    // A sibling sharing the first 6 blocks: a's prediction covers them, beyond its GPU 4.
    let mut sibling = tokens[..6 * 16].to_vec();
    sibling.extend(prompt(9000, 2));
    let answer = select(addr, json!({ "token_ids": sibling }));
    let a = candidate(&answer, "a");
    assert_eq!(
        (a["matched_blocks"].as_u64(), a["predicted_blocks"].as_u64()),
        (Some(4), Some(6))
    );
    // 6 predicted, the CPU and disk blocks within them: 2 to prefill, 3 queued, 11 decoding
    // at decode_weight 0.1.
    assert_eq!(a["overlap_blocks"], 6.0);
    assert_eq!(a["cost"], 2.0 + 3.0 + 0.1 * 11.0);
    assert_eq!(candidate(&answer, "b")["cost"], 8.0);
    assert_eq!(
        answer["instance"], "a",
        "a's predicted prefix outweighs its load"
    );
    // At decode_weight 1 (Dynamo's) a's load outweighs it: 2 + 3 + 11 = 16 against b's 8.
    let file = std::fs::read_to_string(setup.running.config_path()).expect("the config file");
    let dynamo = file.replace("[select]\n", "[select]\ndecode_weight = 1\n");
    std::fs::write(setup.running.config_path(), dynamo).expect("rewrite the config");
    assert_eq!(post(addr, "/reload", b"").status, 200);
    let answer = select(addr, json!({ "token_ids": sibling }));
    assert_eq!(candidate(&answer, "a")["cost"], 2.0 + 3.0 + 11.0);
    assert_eq!(answer["instance"], "b", "a's load outweighs its overlap");
    // Predictions are not cache: /query and /query's scores are untouched.
    let query = post(
        addr,
        "/query",
        json!({ "token_ids": sibling }).to_string().as_bytes(),
    )
    .json();
    assert_eq!(query["scores"][0]["matched_blocks"], 4);
    assert_eq!(query["scores"].as_array().map(Vec::len), Some(1));

    // prefill_complete takes the prefill off the queue; the decode stays until released.
    let path = format!("/reservations/{id}/prefill_complete");
    assert_eq!(send(addr, "POST", &path, None, b"").status, 200);
    assert_eq!(
        send(addr, "POST", &path, None, b"").status,
        200,
        "idempotent"
    );
    let load = loads(addr, "a");
    assert_eq!(
        (
            load["active_prefill_blocks"].as_f64(),
            load["active_decode_blocks"].as_u64()
        ),
        (Some(0.0), Some(11))
    );
    assert_eq!(
        send(addr, "DELETE", &format!("/reservations/{id}"), None, b"").status,
        200
    );
    assert_eq!(
        send(addr, "DELETE", &format!("/reservations/{id}"), None, b"").status,
        404
    );
    assert_eq!(send(addr, "POST", &path, None, b"").status, 404);
    assert_eq!(loads(addr, "a")["reservations"], 0);
    assert_eq!(
        send(addr, "DELETE", "/reservations/nope", None, b"").status,
        404
    );
}

/// Equal costs go to fewer reservations, then the larger overlap, then a rotation of the
/// `/workers` order that starts one rank further at each selection.
#[test]
fn ties_go_to_fewer_reservations_then_overlap_then_a_rotation() {
    let weights = [("prefill_weight", "0"), ("decode_weight", "0")];
    let mut setup = Setup::start(3, "", &weights);
    let addr = setup.addr();
    let tokens = prompt(500, 4);
    setup.store(1, &tokens, 2);
    setup.store(2, &tokens, 2);
    let reserve = json!({ "token_ids": tokens, "reserve": true });
    let mut chosen = Vec::new();
    for _ in 0..4 {
        let answer = select(addr, reserve.clone());
        assert!(
            costs(&answer).iter().all(|(_, cost)| *cost == 0.0),
            "{answer}"
        );
        chosen.push(answer["instance"].as_str().expect("instance").to_owned());
    }
    // b and c overlap 2 (which first: the rotation's, which starts at a random rank), then a
    // with none but no reservation; then all hold one reservation and the prompt predicted
    // (overlap 4): the fourth goes where the rotation then starts.
    let mut overlapping = chosen[..2].to_vec();
    overlapping.sort();
    assert_eq!(overlapping, ["b", "c"], "{chosen:?}");
    assert_eq!(chosen[2], "a", "{chosen:?}");
}

/// Cold prompts sent one after another, each answered (its reservation released) before the
/// next: every rank is idle and none holds anything, and they take turns, never the first of
/// the file every time.
#[test]
fn cold_prompts_one_after_another_spread_over_idle_ranks() {
    let setup = Setup::start(4, "", &[]);
    let addr = setup.addr();
    let mut chosen = Vec::new();
    for cold in 0..8 {
        let answer = select(
            addr,
            json!({ "token_ids": prompt(3_000 + cold, 4), "reserve": true }),
        );
        chosen.push(answer["instance"].as_str().expect("instance").to_owned());
        let id = answer["reservation_id"].as_u64().expect("an id");
        let release = format!("/reservations/{id}");
        assert_eq!(send(addr, "DELETE", &release, None, b"").status, 200);
    }
    let mut spread = chosen.clone();
    spread.sort();
    assert_eq!(
        spread,
        ["a", "a", "b", "b", "c", "c", "d", "d"],
        "{chosen:?}"
    );
}

/// A prediction lasts exactly `predicted_ttl_s` and a reservation `reservation_ttl_s` on the
/// selection's clock: there one nanosecond before, gone at it, the rank's load back to exactly
/// zero and the reservation's routes answering 404; a reload changes the knobs in effect.
#[test]
fn reservations_and_predictions_expire_at_their_ttl_and_knobs_reload() {
    let knobs = [("reservation_ttl_s", "10"), ("predicted_ttl_s", "3")];
    let setup = Setup::start(2, "", &knobs);
    let addr = setup.addr();
    let tick = Duration::from_nanos(1);
    let tokens = prompt(700, 4);
    let reserve = json!({ "token_ids": tokens, "reserve": true, "expected_output_tokens": 16 });
    let reserved = select(addr, reserve);
    let id = reserved["reservation_id"].as_u64().expect("an id");
    // The first of two idle ranks: whichever the rotation starts at.
    let chosen = reserved["instance"].as_str().expect("instance").to_owned();
    let chosen = chosen.as_str();
    let reserved_load = |predicted_prefixes: u32| {
        json!({"instance": chosen, "dp_rank": 0, "reservations": 1, "active_prefill_blocks": 4.0,
               "active_decode_blocks": 5, "predicted_prefixes": predicted_prefixes,
               "outside_requests": 0.0, "outside_blocks": 0.0, "engine_load": null})
    };

    setup.clock.advance(Duration::from_secs(3) - tick);
    let before = select(addr, json!({ "token_ids": tokens }));
    assert_eq!(
        candidate(&before, chosen)["predicted_blocks"],
        4,
        "{before}"
    );
    assert_eq!(loads(addr, chosen), reserved_load(1));
    setup.clock.advance(tick);
    let at = select(addr, json!({ "token_ids": tokens }));
    assert_eq!(candidate(&at, chosen)["predicted_blocks"], 0, "{at}");
    assert_eq!(candidate(&at, chosen)["reservations"], 1, "{at}");
    assert_eq!(loads(addr, chosen), reserved_load(0));

    let complete = format!("/reservations/{id}/prefill_complete");
    let release = format!("/reservations/{id}");
    setup.clock.advance(Duration::from_secs(7) - tick);
    assert_eq!(loads(addr, chosen)["reservations"], 1);
    assert_eq!(send(addr, "POST", &complete, None, b"").status, 200);
    setup.clock.advance(tick);
    assert_eq!(
        loads(addr, chosen),
        json!({"instance": chosen, "dp_rank": 0, "reservations": 0, "active_prefill_blocks": 0.0,
               "active_decode_blocks": 0, "predicted_prefixes": 0,
               "outside_requests": 0.0, "outside_blocks": 0.0, "engine_load": null})
    );
    let expired = send(addr, "POST", &complete, None, b"");
    assert_eq!(expired.status, 404, "expired: {}", expired.text());
    assert_eq!(send(addr, "DELETE", &release, None, b"").status, 404);

    let file = std::fs::read_to_string(setup.running.config_path()).expect("the config file");
    let doubled = file.replace("[select]\n", "[select]\nprefill_weight = 2\n");
    std::fs::write(setup.running.config_path(), doubled).expect("rewrite the config");
    assert_eq!(post(addr, "/reload", b"").status, 200);
    let answer = select(addr, json!({ "token_ids": tokens }));
    assert_eq!(costs(&answer)[0].1, 8.0, "2 × 4 blocks: {answer}");
}

/// Each reservation expires at its own deadline, measured from its own `/select`; the rank's
/// sums follow each one out, back to exactly zero.
#[test]
fn each_reservation_expires_at_its_own_deadline() {
    let setup = Setup::start(1, "", &[("reservation_ttl_s", "5")]);
    let addr = setup.addr();
    let tick = Duration::from_nanos(1);
    let reserve = |first: u32| {
        let body = json!({ "token_ids": prompt(first, 2), "reserve": true });
        select(addr, body)["reservation_id"]
            .as_u64()
            .expect("an id")
    };
    let first = reserve(800);
    setup.clock.advance(Duration::from_secs(2));
    let second = reserve(850);
    let load = loads(addr, "a");
    assert_eq!(
        (
            load["reservations"].as_u64(),
            load["active_decode_blocks"].as_u64()
        ),
        (Some(2), Some(4)),
        "{load}"
    );

    setup.clock.advance(Duration::from_secs(3) - tick);
    assert_eq!(loads(addr, "a")["reservations"], 2);
    setup.clock.advance(tick);
    let load = loads(addr, "a");
    assert_eq!(
        (
            load["reservations"].as_u64(),
            load["active_decode_blocks"].as_u64()
        ),
        (Some(1), Some(2)),
        "the first is due 5 s after its /select: {load}"
    );
    let gone = send(addr, "DELETE", &format!("/reservations/{first}"), None, b"");
    assert_eq!(gone.status, 404, "{}", gone.text());

    setup.clock.advance(Duration::from_secs(2) - tick);
    assert_eq!(loads(addr, "a")["reservations"], 1);
    setup.clock.advance(tick);
    assert_eq!(loads(addr, "a")["reservations"], 0);
    assert_eq!(loads(addr, "a")["active_prefill_blocks"], 0.0);
    let gone = send(
        addr,
        "DELETE",
        &format!("/reservations/{second}"),
        None,
        b"",
    );
    assert_eq!(gone.status, 404, "{}", gone.text());
}

/// A rank that is not `active` is still a candidate, with nothing matched.
#[test]
fn a_degraded_rank_is_a_candidate_with_nothing_matched() {
    let mut setup = Setup::start(2, "", &[]);
    let addr = setup.addr();
    let tokens = prompt(900, 3);
    // b loses batches 1..=4 and has no replay to ask: degraded, still indexed (but not
    // trusted: `/query` would not list it).
    setup.ranks[1].store(&[2001], None, &prompt(901, 1));
    setup.ranks[1].next_seq = 5;
    setup.ranks[1].store(&[1001, 1002, 1003], None, &tokens);
    wait_for(10, "b degraded with its blocks", || {
        let b = &get(addr, "/workers").json()[1]["listeners"][0];
        (b["state"] == "degraded" && b["blocks"] == 4).then_some(())
    });
    let answer = select(addr, json!({ "token_ids": tokens }));
    assert_eq!(candidate(&answer, "b")["matched_blocks"], 0);
    assert_eq!(candidate(&answer, "b")["prefill_blocks"], 3.0);
    assert_eq!(answer["candidates"].as_array().map(Vec::len), Some(2));
}

/// Reserving and the reservation routes need the token; a plain /select does not.
#[test]
fn reserving_and_reservation_routes_need_the_bearer_token() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret\n").expect("write the token");
    let setup = Setup::start(1, &replica_keys(&[], false, Some(&token_file)), &[]);
    let addr = setup.addr();
    let body = json!({ "token_ids": prompt(1, 2) }).to_string();
    assert_eq!(
        send(addr, "POST", "/select", None, body.as_bytes()).status,
        200
    );
    let reserve = json!({ "token_ids": prompt(1, 2), "reserve": true }).to_string();
    for wrong in [None, Some("nope")] {
        let refused = send(addr, "POST", "/select", wrong, reserve.as_bytes());
        assert_eq!(refused.status, 401, "{wrong:?}");
        assert!(refused.header("WWW-Authenticate").is_some());
    }
    let reserved = send(addr, "POST", "/select", Some("s3cret"), reserve.as_bytes());
    assert_eq!(reserved.status, 200, "{}", reserved.text());
    let id = reserved.json()["reservation_id"].as_u64().expect("an id");
    let complete = format!("/reservations/{id}/prefill_complete");
    let release = format!("/reservations/{id}");
    assert_eq!(send(addr, "POST", &complete, None, b"").status, 401);
    assert_eq!(send(addr, "DELETE", &release, None, b"").status, 401);
    assert_eq!(
        send(addr, "POST", &complete, Some("s3cret"), b"").status,
        200
    );
    assert_eq!(
        send(addr, "DELETE", &release, Some("s3cret"), b"").status,
        200
    );
}

/// Every bad input is a 400 naming the field (or the method a 405), and the binary body takes
/// its options from the query string.
#[test]
fn bad_input_is_a_400_naming_the_field_and_the_binary_body_works() {
    let mut setup = Setup::start(1, "", &[]);
    let addr = setup.addr();
    let tokens = prompt(300, 2);
    setup.store(0, &tokens, 2);
    for (body, field) in [
        (json!({ "token_ids": tokens, "reserve": "yes" }), "reserve"),
        (
            json!({ "token_ids": tokens, "expected_output_tokens": -1 }),
            "expected_output_tokens",
        ),
        (json!({ "reserve": true }), "token_ids"),
        (json!({ "token_ids": [1, "x"] }), "token_ids"),
    ] {
        let refused = post(addr, "/select", body.to_string().as_bytes());
        assert_eq!(refused.status, 400, "{body}");
        let reason = refused.json()["error"]
            .as_str()
            .expect("an error")
            .to_owned();
        assert!(reason.starts_with(field), "{body}: {reason}");
    }
    assert_eq!(get(addr, "/select").status, 405);
    let method = send(addr, "POST", "/reservations/1", None, b"");
    assert_eq!(
        (method.status, method.header("Allow")),
        (405, Some("DELETE"))
    );

    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let binary = |query: &str| {
        let headers = [("Content-Type", "application/octet-stream")];
        Connection::open(addr).send_with("POST", &format!("/select{query}"), &headers, Some(&bytes))
    };
    let reserved = binary("?reserve=true&expected_output_tokens=16");
    assert_eq!(reserved.status, 200, "{}", reserved.text());
    let id = reserved.json()["reservation_id"].as_u64().expect("an id");
    assert_eq!(loads(addr, "a")["active_decode_blocks"], 3);
    let refused = binary("?reserve=maybe");
    assert_eq!(refused.status, 400);
    assert!(
        refused.text().contains("query parameter reserve"),
        "{}",
        refused.text()
    );

    let path = format!("/reservations/{id}/prefill_complete");
    let refused = send(addr, "POST", &path, None, br#"{"cached_tokens": "many"}"#);
    assert_eq!(refused.status, 400);
    assert!(
        refused.text().contains("cached_tokens"),
        "{}",
        refused.text()
    );
}

/// `prefill_complete` with the engine's `cached_tokens` feeds the live prediction metrics.
#[test]
fn reported_cached_tokens_are_weighed_against_the_prediction() {
    let mut setup = Setup::start(1, "", &[]);
    let addr = setup.addr();
    let tokens = prompt(400, 5);
    setup.store(0, &tokens, 4);
    let metric = |name: &str| metric_value(addr, name).unwrap_or(0.0);
    // Predicted: first the 4 matched blocks (64 tokens), then the first reservation's
    // prediction of all 5 (80).
    for (served, over, under) in [(48, 16.0, 0.0), (96, 16.0, 16.0)] {
        let reserved = select(addr, json!({ "token_ids": tokens, "reserve": true }));
        let id = reserved["reservation_id"].as_u64().expect("an id");
        let path = format!("/reservations/{id}/prefill_complete");
        let body = json!({ "cached_tokens": served }).to_string();
        assert_eq!(send(addr, "POST", &path, None, body.as_bytes()).status, 200);
        assert_eq!(metric("kv_indexer_select_overpredicted_tokens_total"), over);
        assert_eq!(
            metric("kv_indexer_select_underpredicted_tokens_total"),
            under
        );
    }
    assert_eq!(
        metric("kv_indexer_select_prediction_error_tokens_count"),
        2.0
    );
}

/// A client that expects more output than any model can give (2^64 - 1 tokens, twice) weighs
/// as much as a model's whole context (`select::MAX_CONTEXT_TOKENS`) each: no load overflows or
/// is poisoned for every later choice.
#[test]
fn an_absurd_expected_output_is_clamped_before_it_enters_a_load() {
    let setup = Setup::start(1, "", &[]);
    let addr = setup.addr();
    let tokens = prompt(4_000, 4);
    for _ in 0..2 {
        select(
            addr,
            json!({ "token_ids": tokens, "reserve": true, "expected_output_tokens": u64::MAX }),
        );
    }
    let most = 2 * (kv_indexer::select::MAX_CONTEXT_TOKENS / u64::from(BLOCK_SIZE) + 4);
    assert_eq!(loads(addr, "a")["active_decode_blocks"], most);
}

/// A reservation predicts its prompt's first `MAX_PREDICTED_BLOCKS` blocks, not all of them:
/// what the selector does under its lock is bounded whatever the prompt's length. A prompt
/// sharing the whole long prefix sees that many predicted on the reserved rank; one sharing
/// less sees its own shared prefix.
#[test]
fn a_long_prompt_is_predicted_up_to_max_predicted_blocks() {
    use kv_indexer::select::MAX_PREDICTED_BLOCKS;
    let setup = Setup::start(2, "", &[]);
    let addr = setup.addr();
    let blocks = MAX_PREDICTED_BLOCKS as u32 + 100;
    let tokens = prompt(7, blocks);
    let reserved = select(addr, json!({ "token_ids": tokens, "reserve": true }));
    let rank = reserved["instance"]
        .as_str()
        .expect("an instance")
        .to_owned();
    let again = select(addr, json!({ "token_ids": tokens }));
    assert_eq!(again["query_blocks"], blocks);
    assert_eq!(
        candidate(&again, &rank)["predicted_blocks"],
        MAX_PREDICTED_BLOCKS,
        "{again}"
    );
    let shorter = &tokens[..10 * BLOCK_SIZE as usize];
    let answer = select(addr, json!({ "token_ids": shorter }));
    assert_eq!(
        candidate(&answer, &rank)["predicted_blocks"],
        10,
        "{answer}"
    );
}

/// Which instance each of `selections` reserving selections of `tokens` chose, each answer
/// naming `policy`.
fn chosen_by(addr: SocketAddr, tokens: &[u32], selections: usize, policy: &str) -> Vec<String> {
    (0..selections)
        .map(|_| {
            let answer = select(addr, json!({ "token_ids": tokens, "reserve": true }));
            assert_eq!(answer["policy"], policy, "{answer}");
            answer["instance"].as_str().expect("instance").to_owned()
        })
        .collect()
}

/// Rewrites `[select]` to `policy = name` and reloads.
fn reload_policy(setup: &Setup, original: &str, name: &str) {
    let file = original.replace("[select]\n", &format!("[select]\npolicy = \"{name}\"\n"));
    std::fs::write(setup.running.config_path(), file).expect("rewrite the config");
    assert_eq!(post(setup.addr(), "/reload", b"").status, 200);
}

/// `round_robin`: each selection the next rank in turn, whatever one holds or carries.
#[test]
fn round_robin_cycles_through_the_ranks_whatever_they_hold() {
    let mut setup = Setup::start(3, "", &[("policy", "\"round_robin\"")]);
    let tokens = prompt(4_000, 4);
    setup.store(1, &tokens, 4);
    let chosen = chosen_by(setup.addr(), &tokens, 6, "round_robin");
    // From a random rank, in the board's order: a, b, c, a, … whatever each holds.
    let first = ["a", "b", "c"]
        .iter()
        .position(|rank| *rank == chosen[0])
        .expect("a rank");
    let expected: Vec<&str> = (0..6)
        .map(|turn| ["a", "b", "c"][(first + turn) % 3])
        .collect();
    assert_eq!(chosen, expected);
}

/// The warm rank `a` takes every reservation under `cost`; after a reload `least_load` sends
/// the same prompt to the idle ranks until they carry as much, and `prefix` sends it back to
/// `a`, the longest match, loaded as it is.
#[test]
fn least_load_avoids_the_loaded_rank_and_prefix_takes_the_longest_match() {
    let mut setup = Setup::start(3, "", &[]);
    let addr = setup.addr();
    let original = std::fs::read_to_string(setup.running.config_path()).expect("the config");
    let tokens = prompt(5_000, 4);
    setup.store(0, &tokens, 4);
    setup.store(1, &tokens, 2);
    assert_eq!(chosen_by(addr, &tokens, 3, "cost"), ["a", "a", "a"]);

    reload_policy(&setup, &original, "least_load");
    let mut chosen = chosen_by(addr, &tokens, 4, "least_load");
    chosen.sort();
    assert_eq!(chosen, ["b", "b", "c", "c"]);

    // The reservations stay; their predictions (the prompt on b and c) expire.
    setup.clock.advance(Duration::from_secs(3));
    reload_policy(&setup, &original, "prefix");
    let answer = select(addr, json!({ "token_ids": tokens }));
    assert_eq!(answer["policy"], "prefix");
    assert_eq!(answer["instance"], "a", "{answer}");
    assert_eq!(candidate(&answer, "a")["reservations"], 3, "{answer}");
    let order: Vec<String> = costs(&answer).into_iter().map(|(name, _)| name).collect();
    assert_eq!(order, ["a", "b", "c"], "by overlap 4, 2, 0: {answer}");
}
