//! The test binary's one subscriber: every warning kept as text, its message then its fields
//! and those of the spans it is in (`engine=…`, `rank=…`, `request_id=…`), for tests that
//! assert what the indexer warned about; every span kept with its fields when it closes, for
//! tests that assert what a span recorded (`route_request`); and the lines printed as usual
//! (`RUST_LOG`, errors only unless set). Every test that wants logs installs it, never another
//! subscriber, so that a binary of many files still records them.

use std::fmt::{self, Write as _};
use std::sync::{Once, OnceLock};

use parking_lot::Mutex;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The fields of an event or a span as recorded, in order; a field recorded again keeps its
/// place with the new value.
#[derive(Clone, Debug, Default)]
pub struct Fields(pub Vec<(&'static str, String)>);

impl Fields {
    /// The value of `name`, as the log line shows it.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(field, _)| *field == name)
            .map(|(_, value)| value.as_str())
    }
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let value = format!("{value:?}");
        match self.0.iter_mut().find(|(name, _)| *name == field.name()) {
            Some((_, old)) => *old = value,
            None => self.0.push((field.name(), value)),
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_debug(field, &format_args!("{value}"));
    }
}

/// A span as it closed: its name and fields.
#[derive(Clone, Debug)]
pub struct ClosedSpan {
    pub name: &'static str,
    pub fields: Fields,
}

#[derive(Default)]
struct Recorder {
    /// Every warning (and error), as its message then ` name=value` for its fields and its
    /// spans' fields, innermost first.
    warnings: Mutex<Vec<String>>,
    closed: Mutex<Vec<ClosedSpan>>,
}

impl<S> Layer<S> for &'static Recorder
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(fields) = span.extensions_mut().get_mut::<Fields>() {
                values.record(fields);
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        if *event.metadata().level() > Level::WARN {
            return;
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        let mut line = fields.get("message").unwrap_or_default().to_owned();
        let spans = ctx.event_scope(event).into_iter().flatten();
        let around: Vec<Fields> = spans
            .filter_map(|span| span.extensions().get::<Fields>().cloned())
            .collect();
        for (name, value) in fields.0.iter().chain(around.iter().flat_map(|f| &f.0)) {
            if *name != "message" {
                let _ = write!(line, " {name}={value}");
            }
        }
        self.warnings.lock().push(line);
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            let fields = span
                .extensions()
                .get::<Fields>()
                .cloned()
                .unwrap_or_default();
            let name = span.name();
            self.closed.lock().push(ClosedSpan { name, fields });
        }
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
            .fmt_fields(kv_indexer::logs::LineFields)
            .with_ansi(false)
            .with_test_writer()
            .with_filter(kv_indexer::logs::filter("error"));
        let kept = filter_fn(|meta| meta.is_span() || *meta.level() <= Level::WARN);
        let _ = tracing_subscriber::registry()
            .with(printer)
            .with(recorder.with_filter(kept))
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

/// The spans named `name` closed so far whose field `field` shows `value`.
pub fn closed_spans(name: &str, field: &str, value: &str) -> Vec<ClosedSpan> {
    install_logger();
    RECORDER.get().map_or_else(Vec::new, |recorder| {
        recorder
            .closed
            .lock()
            .iter()
            .filter(|span| span.name == name && span.fields.get(field) == Some(value))
            .cloned()
            .collect()
    })
}
