//! What ships beside the binary: `--check`, the deployment files, the dashboards and the docs' promises.
//!
//! One test binary of the area (`cargo test --test deploy`); each file is one concern.

#[path = "../support/mod.rs"]
mod support;

mod cli_check;
mod deploy_files;
mod deploy_monitoring;
mod docs_metrics;
mod docs_restart_only;
