//! Log output, to stderr: human-readable lines, or one JSON object per line
//! for a log pipeline (`[log] format`). `RUST_LOG` filters either way.
//!
//! Nothing that proves identity is ever logged: bearer keys and their
//! hashes, JWTs in full, lease ids, and request or response bodies stay out
//! of every line (the access log carries a JWT's fence number, and the path
//! without its query).

use crate::config::LogFormat;

/// Installs the process's log subscriber; once, before serving.
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,sqlx=warn".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second init (a test that builds several gateways) keeps the first.
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .try_init(),
    };
}
