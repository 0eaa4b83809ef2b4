//! The few lines of an engine's Prometheus text exposition that say its load: vLLM's and
//! SGLang's running and waiting requests, KV-cache usage and the tokens it holds, per
//! data-parallel rank (vLLM's `engine` label, SGLang's `dp_rank`; a series with neither is the
//! engine's only rank, or, for vLLM's cache size, every rank's).
//!
//! The tokens a rank holds: SGLang's `sglang:num_used_tokens`, else vLLM's usage times its
//! cache's size (`vllm:cache_config_info`'s `num_gpu_blocks` × `block_size` labels); unknown
//! without either.
//!
//! Owns: reading those samples (names, labels with their escapes, values) and nothing else of
//! the format. Never: trusts a value: one that is not a finite number >= 0 is left out, a
//! count is clamped to `MAX_REQUESTS`, a usage to 0..=1 and a cache to `MAX_TOKENS`; a rank
//! with two series of one gauge (SGLang's per tensor-parallel rank) takes the larger, never
//! their sum.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::select::RankFigures;

/// More requests than this on one rank is an engine (or a URL) that lies.
const MAX_REQUESTS: f64 = 1_000_000.0;
/// More tokens than this in one rank's KV cache is an engine that lies (2^32: 256 times the
/// ~16 M tokens of a 192 GB GPU's cache at a small model's 12 KiB a token).
const MAX_TOKENS: f64 = 4_294_967_296.0;
/// The most bytes of one line that are read; a longer line is skipped.
const MAX_LINE_BYTES: usize = 64 << 10;

/// Which figure a gauge is.
#[derive(Clone, Copy)]
enum Gauge {
    Running,
    Waiting,
    KvUsage,
    /// The tokens the KV cache holds for running requests (SGLang).
    UsedTokens,
    /// The KV cache's size in tokens, from an info gauge's labels (vLLM).
    CacheTokens,
}

/// The gauges read, by name: vLLM v1 (`vllm/v1/metrics/loggers.py`) and SGLang
/// (`sglang/srt/metrics/collector.py`); `vllm:gpu_cache_usage_perc` is vLLM's name before
/// 0.10.
const GAUGES: [(&str, Gauge); 9] = [
    ("vllm:num_requests_running", Gauge::Running),
    ("vllm:num_requests_waiting", Gauge::Waiting),
    ("vllm:kv_cache_usage_perc", Gauge::KvUsage),
    ("vllm:gpu_cache_usage_perc", Gauge::KvUsage),
    ("vllm:cache_config_info", Gauge::CacheTokens),
    ("sglang:num_running_reqs", Gauge::Running),
    ("sglang:num_queue_reqs", Gauge::Waiting),
    ("sglang:token_usage", Gauge::KvUsage),
    ("sglang:num_used_tokens", Gauge::UsedTokens),
];

/// The labels naming a series' data-parallel rank.
const RANK_LABELS: [&str; 2] = ["engine", "dp_rank"];

/// A rank's figures as read so far.
#[derive(Default)]
struct Read {
    running: Option<f64>,
    waiting: Option<f64>,
    kv_usage: Option<f64>,
    used_tokens: Option<f64>,
    cache_tokens: Option<f64>,
}

/// Why an exposition says no load.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ExpositionError {
    #[error(
        "no load gauges in the answer (vllm:num_requests_running, sglang:num_running_reqs): \
         is metrics_url the engine's Prometheus endpoint?"
    )]
    NoLoadGauges,
}

/// Each rank's figures (`None`: a series without a rank label), in rank order. A rank appears
/// once a running or waiting series names it.
pub fn parse(text: &str) -> Result<Vec<(Option<u32>, RankFigures)>, ExpositionError> {
    let mut ranks: BTreeMap<Option<u32>, Read> = BTreeMap::new();
    for line in text.lines() {
        if line.len() > MAX_LINE_BYTES || line.starts_with('#') {
            continue;
        }
        let Some((gauge, rank, value)) = sample(line) else {
            continue;
        };
        let figures = ranks.entry(rank).or_default();
        let (slot, value) = match gauge {
            Gauge::Running => (&mut figures.running, value.min(MAX_REQUESTS)),
            Gauge::Waiting => (&mut figures.waiting, value.min(MAX_REQUESTS)),
            Gauge::KvUsage => (&mut figures.kv_usage, value.min(1.0)),
            Gauge::UsedTokens => (&mut figures.used_tokens, value.min(MAX_TOKENS)),
            Gauge::CacheTokens => (&mut figures.cache_tokens, value.min(MAX_TOKENS)),
        };
        *slot = Some(slot.map_or(value, |seen| seen.max(value)));
    }
    // vLLM's cache size without a rank label is every rank's.
    let every_rank = ranks.get(&None).and_then(|read| read.cache_tokens);
    let read: Vec<_> = ranks
        .into_iter()
        .filter(|(_, read)| read.running.is_some() || read.waiting.is_some())
        .map(|(rank, read)| {
            let cache_tokens = read.cache_tokens.or(every_rank);
            let held = cache_tokens
                .zip(read.kv_usage)
                .map(|(size, usage)| size * usage);
            let figures = RankFigures {
                running: read.running.unwrap_or(0.0),
                waiting: read.waiting.unwrap_or(0.0),
                kv_usage: read.kv_usage,
                held_tokens: read.used_tokens.or(held),
            };
            (rank, figures)
        })
        .collect();
    match read.is_empty() {
        true => Err(ExpositionError::NoLoadGauges),
        false => Ok(read),
    }
}

/// A sample line of a gauge read: which, its rank, its value.
fn sample(line: &str) -> Option<(Gauge, Option<u32>, f64)> {
    let line = line.trim_start();
    let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
    let (name, rest) = line.split_at(name_end);
    let gauge = GAUGES
        .iter()
        .find(|(known, _)| *known == name)
        .map(|(_, gauge)| *gauge)?;
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inside) => labels(inside)?,
        None => (Vec::new(), rest),
    };
    // The value, then an optional timestamp.
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    if !value.is_finite() || value < 0.0 {
        return None;
    }
    // An info gauge says its figures in its labels.
    let value = match gauge {
        Gauge::CacheTokens => {
            let label = |name: &str| {
                let (_, text) = labels.iter().find(|(label, _)| label == name)?;
                text.parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
            };
            label("num_gpu_blocks")? * label("block_size")?
        }
        _ => value,
    };
    let rank = match labels
        .iter()
        .find(|(label, _)| RANK_LABELS.contains(&label.as_str()))
    {
        Some((_, rank)) => Some(rank.parse::<u32>().ok()?),
        None => None,
    };
    Some((gauge, rank, value))
}

/// The labels of `text` (after its `{`) and what follows their `}`; `None` when malformed.
fn labels(mut text: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut read = Vec::new();
    loop {
        text = text.trim_start();
        if let Some(rest) = text.strip_prefix('}') {
            return Some((read, rest));
        }
        let (name, rest) = text.split_once('=')?;
        let mut chars = rest.trim_start().strip_prefix('"')?.char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next()? {
                (at, '"') => break at,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (_, other) => value.push(other),
            }
        };
        read.push((name.trim().to_owned(), value));
        let after = &rest.trim_start()[1 + end + 1..];
        text = after.trim_start();
        text = text.strip_prefix(',').unwrap_or(text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM 0.11's `/metrics` with `--data-parallel-size 2`, cut to the gauges around the ones
    /// read (one series per engine, labelled `engine` and `model_name`).
    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 2.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.4215
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 81234.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-8B"} 0.0
"#;

    /// SGLang 0.5's `/metrics` with `--dp-size 2 --enable-dp-attention` (labels `dp_rank`,
    /// `model_name`, and per tensor-parallel rank `tp_rank`), and an old one without `dp_rank`.
    const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 5.0
sglang:num_running_reqs{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="1"} 5.0
sglang:num_running_reqs{dp_rank="1",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="2"} 1.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 7.0
sglang:num_queue_reqs{dp_rank="1",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="2"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 0.28
sglang:token_usage{dp_rank="1",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="2"} 0.01
"#;

    const SGLANG_OLD: &str = r#"# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
"#;

    fn figures(running: f64, waiting: f64, kv_usage: f64) -> RankFigures {
        RankFigures {
            running,
            waiting,
            kv_usage: Some(kv_usage),
            held_tokens: None,
        }
    }

    /// vLLM's usage times its cache's size (one info series per engine, or one for all), and
    /// SGLang's used tokens as it says them.
    #[test]
    fn the_tokens_a_rank_holds_are_its_usage_of_its_cache_or_sglangs_own_count() {
        let per_engine = format!(
            "{VLLM}vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"10000\"}} 1.0\n\
             vllm:cache_config_info{{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"10000\"}} 1.0\n"
        );
        let held = |text: &str| -> Vec<Option<f64>> {
            let read = parse(text).expect("load gauges");
            read.iter()
                .map(|(_, figures)| figures.held_tokens)
                .collect()
        };
        assert_eq!(held(&per_engine), [Some(0.4215 * 160_000.0), Some(0.0)]);
        let for_all = format!(
            "{VLLM}vllm:cache_config_info{{block_size=\"32\",num_gpu_blocks=\"500\"}} 1.0\n"
        );
        assert_eq!(held(&for_all), [Some(0.4215 * 16_000.0), Some(0.0)]);
        assert_eq!(held(VLLM), [None, None], "no cache size, no tokens");
        let unlabelled = format!("{VLLM}vllm:cache_config_info{{engine=\"0\"}} 1.0\n");
        assert_eq!(held(&unlabelled), [None, None]);
        let sglang =
            format!("{SGLANG}sglang:num_used_tokens{{dp_rank=\"1\",tp_rank=\"0\"}} 1234.0\n");
        assert_eq!(held(&sglang), [None, Some(1234.0)]);
        let lying = format!(
            "{VLLM}vllm:cache_config_info{{block_size=\"1e300\",num_gpu_blocks=\"1e300\"}} 1\n"
        );
        assert_eq!(held(&lying)[0], Some(0.4215 * MAX_TOKENS));
    }

    #[test]
    fn vllm_gauges_are_read_per_engine_label() {
        assert_eq!(
            parse(VLLM),
            Ok(vec![
                (Some(0), figures(3.0, 2.0, 0.4215)),
                (Some(1), figures(0.0, 0.0, 0.0)),
            ])
        );
    }

    #[test]
    fn sglang_gauges_are_read_per_dp_rank_and_tp_ranks_are_not_summed() {
        assert_eq!(
            parse(SGLANG),
            Ok(vec![
                (Some(0), figures(5.0, 7.0, 0.28)),
                (Some(1), figures(1.0, 0.0, 0.01)),
            ])
        );
        assert_eq!(
            parse(SGLANG_OLD),
            Ok(vec![(None, figures(12.0, 3.0, 0.28))])
        );
    }

    #[test]
    fn hostile_or_foreign_text_says_no_load_and_never_panics() {
        for text in [
            "",
            "<html>not found</html>",
            "# only comments\n",
            "vllm:num_requests_running{engine=\"0\"} NaN\n",
            "vllm:num_requests_running{engine=\"0\"} -3\n",
            "vllm:num_requests_running{engine=\"x\"} 3\n",
            "vllm:num_requests_running{engine=\"0 3\n",
            "vllm:num_requests_running{engine=\"0\",} \n",
            "vllm:num_requests_running{engine=\"\\",
            "vllm:num_requests_running{engine}",
            "vllm:num_requests_running_other{engine=\"0\"} 3\n",
        ] {
            assert_eq!(parse(text), Err(ExpositionError::NoLoadGauges), "{text:?}");
        }
        let clamped = parse(
            "vllm:num_requests_waiting{engine=\"2\",note=\"a \\\"quoted\\\" }, label\"} 1e300 1700000000\n\
             vllm:kv_cache_usage_perc{engine=\"2\"} 7\n",
        );
        assert_eq!(
            clamped,
            Ok(vec![(Some(2), figures(0.0, MAX_REQUESTS, 1.0))])
        );
    }
}
