//! One listener per data-parallel rank.

/// A listener's state, as shown on `/workers` (SPEC.md "Listeners: one per rank").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    Connecting,
    Active,
    Recovering,
    Degraded,
    Stopped,
}

impl State {
    pub const ALL: [State; 5] = [
        State::Connecting,
        State::Active,
        State::Recovering,
        State::Degraded,
        State::Stopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Connecting => "connecting",
            State::Active => "active",
            State::Recovering => "recovering",
            State::Degraded => "degraded",
            State::Stopped => "stopped",
        }
    }
}
