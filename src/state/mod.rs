//! Placeholder: the state files (filled in by the state-file work).
