//! Prometheus metrics.

use crate::index::{ApplyOutcome, Index};
use crate::listener::State;

/// Every metric of the process, rendered by `GET /metrics`.
pub struct Metrics {
    _todo: (),
}

impl Metrics {
    pub fn new() -> Metrics {
        todo!("metrics helper")
    }

    /// The handles of one listener's metrics, labelled `instance` and `dp_rank`.
    pub fn rank(&self, instance: &str, dp_rank: u32) -> RankMetrics {
        todo!("metrics helper: {instance} {dp_rank}")
    }

    /// Drops a removed listener's labelled series so /metrics stops showing it.
    pub fn forget_rank(&self, instance: &str, dp_rank: u32) {
        todo!("metrics helper: {instance} {dp_rank}")
    }

    /// One `/query` served, with its latency.
    pub fn observe_query(&self, seconds: f64) {
        todo!("metrics helper: {seconds}")
    }

    /// A rejected HTTP request, by status code.
    pub fn http_error(&self, status: u16) {
        todo!("metrics helper: {status}")
    }

    /// A config reload, `applied` or `rejected`.
    pub fn reload(&self, applied: bool) {
        todo!("metrics helper: {applied}")
    }

    /// The Prometheus text exposition of every metric (index gauges read from `index`).
    pub fn render(&self, index: &Index) -> String {
        let _ = index;
        todo!("metrics helper")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// One listener's metric handles; cheap to clone, lock-free to update.
#[derive(Clone)]
pub struct RankMetrics {
    _todo: (),
}

impl RankMetrics {
    /// A batch decoded and applied.
    pub fn batch(&self, outcome: &ApplyOutcome, skipped: u32) {
        todo!("metrics helper: {outcome:?} {skipped}")
    }

    /// A message dropped as malformed: `reason` is `frames`, `seq` or `payload`.
    pub fn malformed(&self, reason: &'static str) {
        todo!("metrics helper: {reason}")
    }

    /// A gap, mid-stream join, restart or undecodable batch detected.
    pub fn gap(&self) {
        todo!("metrics helper")
    }

    /// Batches known lost and not recovered.
    pub fn lost_batches(&self, n: u64) {
        todo!("metrics helper: {n}")
    }

    /// A publisher restart (seq went backwards).
    pub fn restart(&self) {
        todo!("metrics helper")
    }

    /// A recovery attempt: `method` `replay` or `snapshot`; `ok` whether it covered the hole.
    pub fn recovery(&self, method: &'static str, ok: bool) {
        todo!("metrics helper: {method} {ok}")
    }

    /// A batch whose payload dp_rank disagrees with the listener's rank.
    pub fn dp_rank_mismatch(&self) {
        todo!("metrics helper")
    }

    pub fn set_state(&self, state: State, connected: bool) {
        todo!("metrics helper: {state:?} {connected}")
    }

    pub fn set_blocks(&self, blocks: u64) {
        todo!("metrics helper: {blocks}")
    }
}
