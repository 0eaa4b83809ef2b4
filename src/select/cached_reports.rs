//! Whether each engine reports the cached tokens of its answers (docs.md "Routing: the
//! OpenAI-compatible front end"): vLLM sends `usage.prompt_tokens_details` only when started
//! with `--enable-prompt-tokens-details`, and releases before 0.33 leave the details out
//! whenever nothing was cached.
//!
//! Owns: per engine, whether any of its answers carried the details. An engine that has once
//! reported them is taken to report 0 cached tokens when it leaves them out; one that never
//! has reports nothing, so its answers stay out of the hit ratio and the prediction error
//! rather than counting hits alone. Never: guesses a figure for an engine that never reported,
//! or reads an answer itself (the route front end hands it what the answer said).

use std::collections::HashMap;

use parking_lot::Mutex;

/// What an engine's answers have shown of their cached tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reporting {
    /// At least one answer carried `usage.prompt_tokens_details`.
    Reporting,
    /// Answers came, none with the details.
    NotReporting,
}

impl Reporting {
    /// As `/workers` shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            Reporting::Reporting => "reporting",
            Reporting::NotReporting => "not_reporting",
        }
    }
}

/// Each engine's [`Reporting`], from the answers passed on so far.
#[derive(Default)]
pub struct CachedTokenReports(Mutex<HashMap<String, Reporting>>);

impl CachedTokenReports {
    /// The cached tokens of an answer of `engine` that said `reported` (`None`: no
    /// `prompt_tokens_details`), as that engine reports them: 0 for an omission by an engine
    /// that reports, nothing for one that never has.
    pub fn as_reported(&self, engine: &str, reported: Option<u64>) -> Option<u64> {
        let mut engines = self.0.lock();
        match reported {
            Some(cached) => {
                match engines.get_mut(engine) {
                    Some(state) => *state = Reporting::Reporting,
                    None => {
                        engines.insert(engine.to_owned(), Reporting::Reporting);
                    }
                }
                Some(cached)
            }
            None => match engines.get(engine) {
                Some(Reporting::Reporting) => Some(0),
                Some(Reporting::NotReporting) => None,
                None => {
                    engines.insert(engine.to_owned(), Reporting::NotReporting);
                    None
                }
            },
        }
    }

    /// What `engine`'s answers have shown; `None` before its first answer.
    pub fn reporting(&self, engine: &str) -> Option<Reporting> {
        self.0.lock().get(engine).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_omission_is_0_from_an_engine_that_reports_and_nothing_from_one_that_never_did() {
        let reports = CachedTokenReports::default();
        assert_eq!(reports.reporting("a"), None);
        assert_eq!(reports.as_reported("a", None), None);
        assert_eq!(reports.reporting("a"), Some(Reporting::NotReporting));
        assert_eq!(reports.as_reported("a", Some(32)), Some(32));
        assert_eq!(reports.reporting("a"), Some(Reporting::Reporting));
        assert_eq!(reports.as_reported("a", None), Some(0));
        assert_eq!(reports.as_reported("b", None), None);
        assert_eq!(reports.reporting("b"), Some(Reporting::NotReporting));
    }
}
