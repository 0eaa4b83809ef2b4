//! The APIs over real HTTP: selection, prompts as text, and the Dynamo API.
//!
//! One test binary of the area (`cargo test --test api`); each file is one concern.

#[path = "../support/mod.rs"]
mod support;

mod dynamo_api;
mod select;
mod tokenize;
