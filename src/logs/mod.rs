//! The process's log subscriber: installs it once, for the binary and the examples. `RUST_LOG`
//! chooses what is printed (the caller's default when it is unset); each line goes to stderr as
//! time, level, target, message and the event's fields (`engine=…`, `rank=…`), so a line is
//! found by grepping any of them, and the request's `route_request` span before the message
//! (its id and rank, not its cost terms: `LineFields`). Libraries that log through `log` are
//! bridged in. With the `otlp` feature, spans are also exported (`otlp`). It never decides what
//! is logged, and never installs twice.

use std::fmt;
use std::io::IsTerminal;

use tracing::field::{Field, Visit};
use tracing::span::Record;
use tracing_subscriber::field::{RecordFields, VisitFmt, VisitOutput};
use tracing_subscriber::fmt::format::{DefaultVisitor, Writer};
use tracing_subscriber::fmt::{FormatFields, FormattedFields};
use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt, EnvFilter, Layer};

use crate::proxy::SPAN_ONLY_FIELDS;

/// The filter `RUST_LOG` asks for, or `default` (`info`, `warn`, …) when it is unset or empty.
/// A directive it cannot read is skipped (and said on stderr), never fatal: a typo in
/// `RUST_LOG` must not stop an indexer.
pub fn filter(default: &str) -> EnvFilter {
    match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => {
            EnvFilter::builder().parse_lossy(directives)
        }
        _ => EnvFilter::builder().parse_lossy(default),
    }
}

#[cfg(feature = "otlp")]
mod otlp;

/// What keeps running after `init`: with the `otlp` feature and an endpoint set, the exporter,
/// which flushes its last spans when dropped (hold it until the process ends).
#[must_use = "dropping it stops the OTLP exporter"]
pub struct Logging {
    #[cfg(feature = "otlp")]
    _exporter: Option<otlp::Exporter>,
}

/// Installs the subscriber for this process, with `default` as the filter when `RUST_LOG` is
/// unset. A second call (or another subscriber already set) leaves the first in place.
pub fn init(default: &str) -> Logging {
    let printer = tracing_subscriber::fmt::layer()
        .fmt_fields(LineFields)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(filter(default));
    #[cfg(not(feature = "otlp"))]
    {
        let _ = tracing_subscriber::registry().with(printer).try_init();
        Logging {}
    }
    #[cfg(feature = "otlp")]
    {
        let (layer, exporter, failed) = match otlp::start() {
            otlp::Started::Off => (None, None, None),
            otlp::Started::On(layer, exporter) => (Some(layer), Some(exporter), None),
            otlp::Started::Failed(why) => (None, None, Some(why)),
        };
        let _ = tracing_subscriber::registry()
            .with(printer)
            .with(layer)
            .try_init();
        if let Some(why) = failed {
            tracing::warn!("OTLP exporter not started ({why}); spans are not exported");
        }
        Logging {
            _exporter: exporter,
        }
    }
}

/// A log line's fields as `tracing_subscriber`'s default shows them, less the routed request's
/// cost terms (`proxy::SPAN_ONLY_FIELDS`): every line of a request would repeat them; they are
/// in the exported span and the explain header.
pub struct LineFields;

impl<'w> FormatFields<'w> for LineFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut visitor = LineVisitor(DefaultVisitor::new(writer, true));
        fields.record(&mut visitor);
        visitor.finish()
    }

    /// Fields recorded later (the span's choice): a space before each shown, none for those
    /// left out.
    fn add_fields(
        &self,
        current: &'w mut FormattedFields<Self>,
        fields: &Record<'_>,
    ) -> fmt::Result {
        let empty = current.fields.is_empty();
        let mut visitor = LineVisitor(DefaultVisitor::new(current.as_writer(), empty));
        fields.record(&mut visitor);
        visitor.finish()
    }
}

/// `LineFields`' visitor: the default one, shown only the fields a line shows.
struct LineVisitor<'a>(DefaultVisitor<'a>);

fn printed(field: &Field) -> bool {
    !SPAN_ONLY_FIELDS.contains(&field.name())
}

impl Visit for LineVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if printed(field) {
            self.0.record_str(field, value);
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        if printed(field) {
            self.0.record_error(field, value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if printed(field) {
            self.0.record_debug(field, value);
        }
    }
}

impl VisitOutput<fmt::Result> for LineVisitor<'_> {
    fn finish(self) -> fmt::Result {
        self.0.finish()
    }
}

impl VisitFmt for LineVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        self.0.writer()
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::Arc;

    use parking_lot::Mutex;
    use tracing_subscriber::layer::SubscriberExt;

    use super::LineFields;

    /// What the printer wrote, shared with the test.
    #[derive(Clone, Default)]
    struct Written(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Written {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_line_shows_level_target_message_fields_and_its_request_but_not_the_cost_terms() {
        let written = Written::default();
        let printer = tracing_subscriber::fmt::layer()
            .fmt_fields(LineFields)
            .with_ansi(false)
            .with_writer({
                let written = written.clone();
                move || written.clone()
            });
        let subscriber = tracing_subscriber::registry().with(printer);
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "route_request",
                request_id = "r-1",
                engine = tracing::field::Empty,
                cost = tracing::field::Empty,
            );
            span.record("cost", 2.5);
            span.record("engine", "e");
            span.in_scope(|| tracing::warn!(rank = 3, "the engine is slow"));
        });
        let line = String::from_utf8(written.0.lock().clone()).expect("UTF-8");
        for part in [
            " WARN ",
            "route_request{request_id=\"r-1\" engine=\"e\"}: ",
            "kv_indexer::logs::tests: the engine is slow rank=3",
        ] {
            assert!(line.contains(part), "{part:?} missing from {line:?}");
        }
        assert!(!line.contains("cost"), "{line}");
    }
}
