//! The signals of a running process: SIGHUP asks for a reload (one at a time, on a task of
//! their own), the first SIGTERM or SIGINT stops (`/ready` turns false at once, then
//! `Service::shutdown` drains the route front end), a second one cuts that drain short.
//!
//! Owns: the signal handlers and what each signal asks for. Never: reloads or stops anything
//! itself (the reloader and the service do), or waits for a drain.

use std::sync::Arc;

use anyhow::Context;
use tokio::runtime::Handle;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::Notify;
use tracing::{info, warn};

use super::reload::Reloader;
use super::tasks::{blocking, Task};
use super::Service;
use crate::config::{Config, Source};
use crate::registry::ShutdownSignal;

/// Installs the signal handlers, starts the service beside them and answers the signals until
/// SIGTERM or SIGINT; returns the service, for `run` to shut down.
pub(super) async fn serve(
    runtime: &Handle,
    source: Source,
    config: Config,
    listen: Option<String>,
) -> anyhow::Result<Service> {
    // Handlers first: a SIGHUP that arrives once HTTP answers must reload, not kill.
    let mut hangup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    let mut terminate =
        signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    // Start-up runs beside the signals: SIGTERM while thousands of engines start stops the
    // start (no engine starts after it) and exits within a second.
    let shutdown_signal = ShutdownSignal::default();
    let mut start = {
        let (source, signal, runtime) = (source.clone(), shutdown_signal.clone(), runtime.clone());
        tokio::task::spawn_blocking(move || {
            Service::start_on(runtime, &source, config, listen, signal)
        })
    };
    let (started, stop_early) = tokio::select! {
        started = &mut start => (started, None),
        name = stop_requested(&mut terminate, &mut interrupt) => {
            shutdown_signal.raise();
            ((&mut start).await, Some(name))
        }
    };
    let service = started.context("the start-up task")??;
    if let Some(name) = stop_early {
        info!("{name} during start-up: shutting down");
        return Ok(service);
    }
    let hangups = HangupReloads::spawn(runtime, service.reloader.clone());
    loop {
        tokio::select! {
            _ = hangup.recv() => {
                info!("SIGHUP: reloading {}", source.describe());
                hangups.ask();
            }
            name = stop_requested(&mut terminate, &mut interrupt) => {
                info!("{name}: shutting down");
                break;
            }
        }
    }
    // At once, before anything is waited for: a load balancer sends nothing more here.
    service.begin_stop();
    if let Some(cut) = service.route_drain_cut() {
        tokio::spawn(async move {
            let name = stop_requested(&mut terminate, &mut interrupt).await;
            warn!("{name} again: the route front end's drain is cut short");
            cut.cut();
        });
    }
    // Before waiting for the reload task: a reload in progress stops starting engines.
    service.shutdown_signal.raise();
    hangups.stop().await;
    Ok(service)
}

/// Waits for SIGTERM or SIGINT; the name of the one that came.
async fn stop_requested(terminate: &mut Signal, interrupt: &mut Signal) -> &'static str {
    tokio::select! {
        _ = terminate.recv() => "SIGTERM",
        _ = interrupt.recv() => "SIGINT",
    }
}

/// Reloads asked for by SIGHUP, run one after another by a task of their own (each on the
/// blocking pool) so that the signal loop sees SIGTERM at once, even while a reload starts
/// thousands of engines (seconds). SIGHUPs that arrive during a reload are answered by one
/// more reload.
struct HangupReloads {
    /// Holds one permit at most: the SIGHUPs during a reload make one more.
    asked: Arc<Notify>,
    task: Task,
}

impl HangupReloads {
    fn spawn(runtime: &Handle, reloader: Arc<Reloader>) -> HangupReloads {
        let asked = Arc::new(Notify::new());
        let reloads = Arc::clone(&asked);
        let task = Task::spawn(runtime, |mut stopped| async move {
            while stopped.unless(reloads.notified()).await.is_some() {
                let reloader = Arc::clone(&reloader);
                // The outcome is logged by reload itself.
                let _ = blocking(move || reloader.reload()).await;
            }
        });
        HangupReloads { asked, task }
    }

    fn ask(&self) {
        self.asked.notify_one();
    }

    /// Stops the task; waits for the reload under way (the shutdown signal, raised first,
    /// makes it start no more engines), never starts a reload asked for meanwhile.
    async fn stop(self) {
        self.task.stop().await;
    }
}
