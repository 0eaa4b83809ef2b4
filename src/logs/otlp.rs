//! The `otlp` feature's exporter (docs.md "Tracing"): the spans (`route_request`, with the log
//! lines inside them as its events) sent to the OTLP collector that
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) names, over
//! HTTP/protobuf, in batches from the SDK's own thread. Owns building the exporter and flushing
//! it at the end. Never: exports without one of those variables set, or stops the process when
//! the collector cannot be built or reached (a warning says so; the logs go on).

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{
    ExporterBuildError, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing::Subscriber;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// The exporter while it runs: dropping it flushes the spans not yet sent.
pub struct Exporter {
    provider: SdkTracerProvider,
}

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Err(error) = self.provider.shutdown() {
            eprintln!("OTLP exporter: flushing the last spans at exit: {error}");
        }
    }
}

/// What the exporter's start gave: nothing to export to, the exporter, or why it did not
/// start (logged once the subscriber runs).
pub enum Started<S> {
    Off,
    On(Box<dyn Layer<S> + Send + Sync>, Exporter),
    Failed(ExporterBuildError),
}

/// The layer exporting this crate's spans (and the events inside them) at `info` and above,
/// whatever `RUST_LOG` prints, when an endpoint variable is set.
pub fn start<S>() -> Started<S>
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    let named = |name: &str| std::env::var(name).is_ok_and(|value| !value.trim().is_empty());
    if !named(OTEL_EXPORTER_OTLP_ENDPOINT) && !named(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) {
        return Started::Off;
    }
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
    {
        Ok(exporter) => exporter,
        Err(error) => return Started::Failed(error),
    };
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(env!("CARGO_PKG_NAME"));
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer(env!("CARGO_PKG_NAME"));
    let exported = Targets::new().with_target("kv_indexer", tracing::Level::INFO);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(exported);
    Started::On(Box::new(layer), Exporter { provider })
}
