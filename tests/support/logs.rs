//! The test binary's one logger: every warning kept as text (for tests that assert what the
//! indexer warned about), beside what env_logger prints as usual. Every test that wants logs
//! installs it, never another logger, so that a binary of many files still records warnings.

use std::sync::{Once, OnceLock};

use parking_lot::Mutex;

/// Every warning logged in this test binary, kept as text, beside what env_logger prints as
/// usual (`RUST_LOG`).
struct Recorder {
    warnings: Mutex<Vec<String>>,
    printer: env_logger::Logger,
}

impl log::Log for Recorder {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Warn || self.printer.enabled(metadata)
    }

    fn log(&self, record: &log::Record) {
        if record.level() <= log::Level::Warn {
            self.warnings.lock().push(record.args().to_string());
        }
        self.printer.log(record);
    }

    fn flush(&self) {
        self.printer.flush();
    }
}

static RECORDER: OnceLock<Recorder> = OnceLock::new();

/// The recorder as this binary's logger, once: every test that wants logs calls this, never
/// another logger's init, or the recorder would miss warnings in a binary of many files.
pub fn install_logger() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let recorder = RECORDER.get_or_init(|| Recorder {
            warnings: Mutex::new(Vec::new()),
            printer: env_logger::builder().is_test(true).build(),
        });
        let printed = recorder.printer.filter();
        if log::set_logger(recorder).is_ok() {
            log::set_max_level(printed.max(log::LevelFilter::Warn));
        }
    });
}

/// The warnings logged so far that mention `needle` (an engine's name).
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
