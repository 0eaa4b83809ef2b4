//! The OpenAI server's `GET /metrics`, as vLLM v1 serves it (`vllm/v1/metrics/loggers.py`):
//! `vllm:num_requests_running`, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`,
//! one series per data-parallel rank labelled `engine="<rank>"` and `model_name`, and
//! `vllm:cache_config_info` (its `num_gpu_blocks` and `block_size` labels), in the Prometheus
//! text format.
//!
//! Owns: that text, from each rank's batch as the scheduler runs it (running: admitted until
//! its last token or its client leaving; waiting: queued for a place) and the KV blocks its
//! requests in flight hold, as vLLM's usage counts them: a block cached but held by no request
//! is free (evictable), not used. Never: reports a figure it did not read.

use std::fmt::Write;

use super::Inner;

/// A gauge's name, help text and value for a rank.
type Gauge<'a> = (&'static str, &'static str, &'a dyn Fn(u32) -> f64);

/// The exposition of `inner`'s ranks now.
pub(super) fn exposition(inner: &Inner) -> String {
    let model = inner
        .config
        .model
        .replace('\\', "\\\\")
        .replace('"', "\\\"");
    let engine = inner.engine.upgrade();
    let ranks = engine.as_ref().map_or(0, |engine| engine.dp_size());
    let load = inner.scheduler.load();
    let capacity_blocks = engine.as_ref().map_or(0, |engine| engine.capacity_blocks());
    let block_size = engine.as_ref().map_or(0, |engine| engine.block_size());
    let count = |rank: u32, pick: fn(&(u64, u64)) -> u64| {
        load.get(rank as usize).map_or(0.0, |l| pick(l) as f64)
    };
    let mut text = String::new();
    let gauges: [Gauge; 3] = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            &|rank| count(rank, |l| l.0),
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            &|rank| count(rank, |l| l.1),
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            &|rank| {
                let held = inner.figures.held_blocks(rank) as f64;
                (held / capacity_blocks.max(1) as f64).min(1.0)
            },
        ),
    ];
    let info = "vllm:cache_config_info";
    let _ = writeln!(
        text,
        "# HELP {info} Information of the LLMEngine CacheConfig\n# TYPE {info} gauge"
    );
    for rank in 0..ranks {
        let _ = writeln!(
            text,
            "{info}{{block_size=\"{block_size}\",enable_prefix_caching=\"True\",engine=\"{rank}\",num_gpu_blocks=\"{capacity_blocks}\"}} 1.0"
        );
    }
    for (name, help, value) in gauges {
        let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} gauge");
        for rank in 0..ranks {
            let _ = writeln!(
                text,
                "{name}{{engine=\"{rank}\",model_name=\"{model}\"}} {:?}",
                value(rank)
            );
        }
    }
    text
}
