//! Free TCP ports on 127.0.0.1 for harnesses that must name a port before binding it (a config
//! file, ranks on `port + rank`): the one port finder of tests, examples and the fleet harness.
//!
//! It owns probing only. It never holds a port past its return, so a caller that binds later
//! can still lose the race to another process and must retry.

use std::net::TcpListener;

use anyhow::{Context, Result};

/// A port nobody listened on a moment ago (bound by the OS, then released).
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
    Ok(listener
        .local_addr()
        .context("reading the bound address")?
        .port())
}

/// A base port such that `base .. base + span` were all free a moment ago; `None` when the
/// ports after the OS's pick were taken (try again).
pub fn free_port_range(span: u16) -> Option<u16> {
    let first = TcpListener::bind("127.0.0.1:0").ok()?;
    let base = first.local_addr().ok()?.port();
    let rest = (1..span)
        .map(|offset| TcpListener::bind(("127.0.0.1", base.checked_add(offset)?)).ok())
        .collect::<Option<Vec<_>>>()?;
    drop((first, rest));
    Some(base)
}
