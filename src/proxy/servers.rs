//! The engines' OpenAI servers as failure domains (docs.md "Routing"): a server that cannot be
//! reached backs off every rank behind it, and its health is checked actively.
//!
//! A request that finds a server down (refused, no connection in time) leaves every rank of
//! every engine behind that URL out for the selector's back-off. An active check asks each
//! server `GET /health` every `health_interval_s`: after `unhealthy_threshold` failed checks in
//! a row its ranks are left out until `healthy_threshold` checks in a row pass, and a server
//! backed off by a request is readmitted by its next passing check. Each change is logged.
//!
//! Owns: each server's check counts, whether it is out, and whether its 404s were logged. Never: chooses a rank, sends a
//! client's request, or keeps a rank out by any means but this table and the selector's
//! back-off (`Selector::rank_failed`, readmitted by `rank_answered`).

use std::collections::HashMap;

use hyper::StatusCode;
use parking_lot::Mutex;

use super::upstream::Fetch;

/// One server's health as the checks and the requests saw it.
#[derive(Default)]
struct Health {
    failed_checks: u32,
    passed_checks: u32,
    /// Left out by its checks: only passing checks readmit it.
    unhealthy: bool,
    /// Backed off by a request since its last passing check: the next one readmits it.
    backed_off: bool,
    /// Its 404 to a routed path was logged: once until it answers another status.
    not_found_logged: bool,
}

/// What a check's result changed.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Change {
    None,
    /// The server failed its threshold of checks: its ranks go out.
    WentDown,
    /// Still down: its ranks' back-off is renewed.
    StillDown,
    /// Passing again after it was out: its ranks come back.
    Readmitted,
}

/// The thresholds of `[route]`'s health checks.
#[derive(Clone, Copy, Debug)]
pub(super) struct Thresholds {
    pub(super) unhealthy: u32,
    pub(super) healthy: u32,
}

/// Every server's health, by its base URL.
#[derive(Default)]
pub(super) struct Servers {
    health: Mutex<HashMap<String, Health>>,
}

impl Servers {
    /// A request found `base` down.
    pub(super) fn request_failed(&self, base: &str) {
        self.health
            .lock()
            .entry(base.to_owned())
            .or_default()
            .backed_off = true;
    }

    /// `base` answered 404 to a routed path: whether that is news worth a log line.
    pub(super) fn not_found(&self, base: &str) -> bool {
        let mut table = self.health.lock();
        let health = table.entry(base.to_owned()).or_default();
        !std::mem::replace(&mut health.not_found_logged, true)
    }

    /// `base` answered a routed path with another status than 404.
    pub(super) fn found(&self, base: &str) {
        if let Some(health) = self.health.lock().get_mut(base) {
            health.not_found_logged = false;
        }
    }

    /// Whether `base` is out by its checks.
    pub(super) fn is_unhealthy(&self, base: &str) -> bool {
        self.health
            .lock()
            .get(base)
            .is_some_and(|health| health.unhealthy)
    }

    /// A check of `base` ended: `result` is its status, or why there was none. A server that
    /// answers anything below 500 is up (one without a `/health` route answers 404, and
    /// takes requests).
    pub(super) fn checked(
        &self,
        base: &str,
        result: &Result<StatusCode, Fetch>,
        thresholds: Thresholds,
    ) -> Change {
        let passed = matches!(result, Ok(status) if !status.is_server_error());
        let mut table = self.health.lock();
        let health = table.entry(base.to_owned()).or_default();
        if passed {
            health.failed_checks = 0;
            health.passed_checks = health.passed_checks.saturating_add(1);
            let was_out = health.unhealthy || health.backed_off;
            if health.unhealthy && health.passed_checks < thresholds.healthy {
                return Change::None;
            }
            health.unhealthy = false;
            health.backed_off = false;
            return match was_out {
                true => Change::Readmitted,
                false => Change::None,
            };
        }
        health.passed_checks = 0;
        health.failed_checks = health.failed_checks.saturating_add(1);
        if health.unhealthy {
            return Change::StillDown;
        }
        if health.failed_checks < thresholds.unhealthy {
            return Change::None;
        }
        health.unhealthy = true;
        Change::WentDown
    }

    /// Forgets the servers no longer in the file.
    pub(super) fn retain(&self, bases: &[&str]) {
        self.health
            .lock()
            .retain(|base, _| bases.contains(&base.as_str()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THRESHOLDS: Thresholds = Thresholds {
        unhealthy: 2,
        healthy: 2,
    };

    fn passing() -> Result<StatusCode, Fetch> {
        Ok(StatusCode::OK)
    }

    fn failing() -> Result<StatusCode, Fetch> {
        Err(Fetch::Failed("connection refused".into()))
    }

    #[test]
    fn a_server_goes_out_after_its_failed_checks_and_back_after_its_passing_ones() {
        let servers = Servers::default();
        let base = "http://a:8000";
        assert_eq!(servers.checked(base, &failing(), THRESHOLDS), Change::None);
        assert!(
            !servers.is_unhealthy(base),
            "one failure is below the threshold"
        );
        assert_eq!(
            servers.checked(base, &Ok(StatusCode::SERVICE_UNAVAILABLE), THRESHOLDS),
            Change::WentDown
        );
        assert!(servers.is_unhealthy(base));
        assert_eq!(
            servers.checked(base, &failing(), THRESHOLDS),
            Change::StillDown
        );
        assert_eq!(servers.checked(base, &passing(), THRESHOLDS), Change::None);
        assert!(
            servers.is_unhealthy(base),
            "one pass is below the threshold"
        );
        assert_eq!(
            servers.checked(base, &failing(), THRESHOLDS),
            Change::StillDown
        );
        assert_eq!(servers.checked(base, &passing(), THRESHOLDS), Change::None);
        assert_eq!(
            servers.checked(base, &passing(), THRESHOLDS),
            Change::Readmitted
        );
        assert!(!servers.is_unhealthy(base));
        assert_eq!(servers.checked(base, &passing(), THRESHOLDS), Change::None);
    }

    #[test]
    fn a_server_backed_off_by_a_request_is_readmitted_by_its_next_passing_check() {
        let servers = Servers::default();
        let base = "http://a:8000";
        servers.request_failed(base);
        assert!(
            !servers.is_unhealthy(base),
            "a request's failure is a back-off"
        );
        assert_eq!(
            servers.checked(base, &Ok(StatusCode::NOT_FOUND), THRESHOLDS),
            Change::Readmitted,
            "a server without /health that answers is up"
        );
        assert_eq!(servers.checked(base, &passing(), THRESHOLDS), Change::None);
        assert!(servers.not_found(base), "the first 404 is logged");
        assert!(!servers.not_found(base), "the next are not");
        servers.found(base);
        assert!(servers.not_found(base), "nor after another answer");
        servers.retain(&[]);
        assert!(servers.health.lock().is_empty());
    }
}
