//! indexer.toml.
