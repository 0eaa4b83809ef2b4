//! The test binary's one subscriber: every warning kept as text, its message then its fields
//! (`engine=…`, `rank=…`), for tests that assert what the indexer warned about, beside the lines
//! printed as usual (`RUST_LOG`, errors only unless set). Every test that wants logs installs
//! it, never another subscriber, so that a binary of many files still records warnings.

use std::fmt::{self, Write as _};
use std::sync::{Once, OnceLock};

use parking_lot::Mutex;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// An event's message then its other fields as ` name=value`, the way a reader greps a line.
#[derive(Default)]
pub struct Line(pub String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let fields = std::mem::take(&mut self.0);
            self.0 = format!("{value:?}{fields}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_debug(field, &format_args!("{value}"));
    }
}

/// Every warning (and error) logged in this test binary, as a [`Line`].
#[derive(Default)]
struct Recorder {
    warnings: Mutex<Vec<String>>,
}

impl<S: Subscriber> Layer<S> for &'static Recorder {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let mut line = Line::default();
        event.record(&mut line);
        self.warnings.lock().push(line.0);
    }
}

static RECORDER: OnceLock<Recorder> = OnceLock::new();

/// The recorder as this binary's subscriber, once: every test that wants logs calls this, never
/// another subscriber's init, or the recorder would miss warnings in a binary of many files.
pub fn install_logger() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let recorder: &'static Recorder = RECORDER.get_or_init(Recorder::default);
        let printer = tracing_subscriber::fmt::layer()
            .with_test_writer()
            .with_filter(kv_indexer::logs::filter("error"));
        let _ = tracing_subscriber::registry()
            .with(printer)
            .with(recorder.with_filter(LevelFilter::WARN))
            .try_init();
    });
}

/// The warnings logged so far that mention `needle` (an engine's name) in their message or
/// fields.
pub fn warnings_about(needle: &str) -> Vec<String> {
    install_logger();
    RECORDER.get().map_or_else(Vec::new, |recorder| {
        recorder
            .warnings
            .lock()
            .iter()
            .filter(|line| line.contains(needle))
            .cloned()
            .collect()
    })
}
