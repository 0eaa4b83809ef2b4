//! The simulator's workload: trace expansion, synthetic conversations, routing, and its
//! deterministic random numbers. The simulator is a crate of its own (`sim/`) and is tested here,
//! by the root package's `cargo test`.

use std::path::Path;

use kv_indexer_sim::rng::*;
use kv_indexer_sim::workload::*;
use std::io::Write;

fn trace_file(lines: &[&str]) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    for line in lines {
        writeln!(file, "{line}").expect("write");
    }
    file
}

#[test]
fn trace_ids_expand_to_shared_token_prefixes() {
    let file = trace_file(&[
        r#"{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [7, 8, 9]}"#,
        r#"{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [7, 5]}"#,
        r#"{"timestamp": 2, "input_length": 30, "output_length": 1, "hash_ids": [8]}"#,
    ]);
    let prompts = load_trace(file.path(), 16).expect("valid trace");
    assert_eq!(
        prompts.iter().map(Vec::len).collect::<Vec<_>>(),
        [1100, 1024, 30]
    );
    assert_eq!(prompts[0][..512], prompts[1][..512]);
    assert_ne!(prompts[0][512..1024], prompts[1][512..1024]);
    // Same id, other position: same tokens (the chained engine hashes still differ).
    assert_eq!(prompts[2][..], prompts[0][512..542]);
    assert!(prompts.iter().flatten().all(|&t| (t as u64) < VOCABULARY));
    // Blocks inside one id differ from each other.
    assert_ne!(prompts[0][..16], prompts[0][16..32]);
}

#[test]
fn bad_trace_lines_are_errors_naming_the_line() {
    for (line, why) in [
        (
            r#"{"input_length": 2000, "hash_ids": [1, 2]}"#,
            "does not fit",
        ),
        (r#"{"input_length": 10, "hash_ids": []}"#, "no hash_ids"),
        (
            r#"{"input_length": -1, "hash_ids": [1]}"#,
            "not a trace request",
        ),
        ("not json", "not a trace request"),
    ] {
        let file = trace_file(&[r#"{"input_length": 3, "hash_ids": [1]}"#, line]);
        let error = format!("{:#}", load_trace(file.path(), 16).expect_err(line));
        assert!(error.contains("line 2") && error.contains(why), "{error}");
    }
    let file = trace_file(&[r#"{"input_length": 3, "hash_ids": [1]}"#]);
    assert!(load_trace(file.path(), 24).is_err());
    assert!(load_trace(Path::new("/nonexistent/trace.jsonl"), 16).is_err());
}

#[test]
fn conversations_grow_turn_by_turn_over_shared_system_prompts() {
    let spec = Conversations {
        system_prompts: 2,
        system_tokens: 64,
        conversations: 10,
        in_progress: 4,
        turns: 3,
        user_tokens: 8,
        reply_tokens: 8,
        seed: 4,
    };
    let prompts: Vec<Vec<u32>> = spec.prompts().collect();
    assert_eq!(prompts.len(), 30);
    assert_eq!(prompts, spec.prompts().collect::<Vec<_>>(), "deterministic");
    let lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
    assert_eq!(lengths.iter().filter(|&&n| n == 72).count(), 10);
    assert_eq!(lengths.iter().filter(|&&n| n == 88).count(), 10);
    assert_eq!(lengths.iter().filter(|&&n| n == 104).count(), 10);
    // Every later turn extends an earlier prompt of its conversation (plus the reply).
    for later in prompts.iter().filter(|p| p.len() > 72) {
        assert!(prompts
            .iter()
            .any(|earlier| earlier.len() + 16 == later.len() && later.starts_with(earlier)));
    }
    let heads: std::collections::HashSet<&[u32]> = prompts.iter().map(|p| &p[..64]).collect();
    assert!(heads.len() <= 2);
}

#[test]
fn routing_round_robin_and_sticky() {
    let mut rr = Router::new(Route::RoundRobin, 3, 4);
    let ranks: Vec<u32> = (0..6).map(|_| rr.rank_for(&[1, 2, 3])).collect();
    assert_eq!(ranks, [0, 1, 2, 0, 1, 2]);

    let mut sticky = Router::new(Route::Sticky, 4, 4);
    let heads: Vec<u32> = (0..64)
        .map(|head| sticky.rank_for(&[head, 0, 0, 0, 9]))
        .collect();
    for head in 0..64u32 {
        assert_eq!(
            sticky.rank_for(&[head, 0, 0, 0, 1, 2]),
            heads[head as usize]
        );
    }
    assert!(heads.iter().all(|&r| r < 4));
    assert!((0..4).all(|r| heads.contains(&r)), "spreads over ranks");
}

#[test]
fn a_cycled_trace_expands_each_request_as_it_is_taken() {
    let file = trace_file(&[
        r#"{"input_length": 20, "hash_ids": [1]}"#,
        r#"{"input_length": 600, "hash_ids": [2, 3]}"#,
    ]);
    let trace = Trace::load(file.path(), 16).expect("valid trace");
    assert_eq!(trace.len(), 2);
    let whole = load_trace(file.path(), 16).expect("valid trace");
    let cycled: Vec<Vec<u32>> = trace.cycled(5).collect();
    assert_eq!(
        cycled.iter().map(Vec::len).collect::<Vec<_>>(),
        [20, 600, 20, 600, 20]
    );
    assert_eq!(cycled[..2], whole[..]);
    assert_eq!(cycled[2], whole[0]);
    let empty = trace_file(&[]);
    assert_eq!(
        Trace::load(empty.path(), 16)
            .expect("empty trace")
            .cycled(5)
            .count(),
        0
    );
}

#[test]
fn conversations_beyond_those_in_progress_start_as_others_end() {
    let spec = Conversations {
        system_prompts: 1,
        system_tokens: 16,
        conversations: 50,
        in_progress: 2,
        turns: 4,
        user_tokens: 4,
        reply_tokens: 4,
        seed: 1,
    };
    let prompts: Vec<Vec<u32>> = spec.prompts().collect();
    assert_eq!(prompts.len(), 200);
    // First turns are 20 tokens, last turns 44: between them a conversation is under way, and
    // never more than two are.
    let first_turns = prompts.iter().filter(|p| p.len() == 20).count();
    let last_turns = prompts.iter().filter(|p| p.len() == 44).count();
    assert_eq!((first_turns, last_turns), (50, 50));
    let mut under_way = 0i32;
    for prompt in &prompts {
        match prompt.len() {
            20 => under_way += 1,
            44 => under_way -= 1,
            _ => {}
        }
        assert!((0..=2).contains(&under_way), "{under_way} under way");
    }
}

#[test]
fn same_seed_same_stream_and_f64_in_unit_interval() {
    let mut a = SplitMix64::new(7);
    let mut b = SplitMix64::new(7);
    let mut c = SplitMix64::new(8);
    let first: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
    let again: Vec<u64> = (0..4).map(|_| b.next_u64()).collect();
    let other: Vec<u64> = (0..4).map(|_| c.next_u64()).collect();
    assert_eq!(first, again);
    assert_ne!(first, other);
    for _ in 0..1000 {
        let x = a.next_f64();
        assert!((0.0..1.0).contains(&x));
        assert!(a.below(3) < 3);
    }
}
