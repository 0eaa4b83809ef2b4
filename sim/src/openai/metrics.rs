//! The OpenAI server's `GET /metrics`, as vLLM v1 serves it (`vllm/v1/metrics/loggers.py`):
//! `vllm:num_requests_running`, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`,
//! one series per data-parallel rank labelled `engine="<rank>"` and `model_name`, in the
//! Prometheus text format.
//!
//! Owns: that text, from what the server really has in flight per rank (a request counts from
//! its acceptance until its answer ends or its client leaves) and each rank's cache occupancy.
//! Never: reports a waiting request (the simulated prefills do not queue) or a figure it did
//! not read.

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
    let running = inner.figures.running.lock().clone();
    let mut text = String::new();
    let gauges: [Gauge; 3] = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            &|rank| running.get(rank as usize).copied().unwrap_or(0) as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            &|_| 0.0,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            &|rank| {
                engine
                    .as_ref()
                    .and_then(|engine| engine.cache_usage(rank).ok())
                    .unwrap_or(0.0)
            },
        ),
    ];
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
