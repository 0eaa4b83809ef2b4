//! The route front end (the OpenAI-compatible proxy) over real HTTP, against simulated engines.
//!
//! One test binary of the area (`cargo test --test proxy`); each file is one concern.

#[path = "../support/mod.rs"]
mod support;

mod from_urls;
mod peers;
mod route;
mod route_surface;
mod trace;
