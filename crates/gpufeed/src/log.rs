//! gpufeed's `tracing` events (the fallbacks it takes, leftovers it cleans, peers it gives up
//! on) on stderr, for programs that install no subscriber of their own: the `gpufeed` CLI and
//! the Python package. Behind the cargo feature `stderr-log`.

/// The variable that sets how much [`log_to_stderr`] prints.
pub const LOG_VAR: &str = "GPUFEED_LOG";

/// Prints gpufeed's `tracing` events to stderr from now on, at the level `GPUFEED_LOG` names
/// (`error`, `warn` — the default —, `info`, `debug`, `trace`; `off` prints nothing), unless
/// the process already has a global subscriber (then nothing changes). A value it does not
/// know is said once on stderr and `warn` is used.
///
/// For binaries and bindings; a Rust program that logs picks its own subscriber instead.
///
/// # Example
/// ```
/// gpufeed::log_to_stderr(); // e.g. first thing in main()
/// ```
pub fn log_to_stderr() {
    use tracing::Level;
    let asked = std::env::var(LOG_VAR).ok();
    let level = match asked.as_deref().map(str::trim) {
        None | Some("") | Some("warn") => Some(Level::WARN),
        Some("off") => None,
        Some("error") => Some(Level::ERROR),
        Some("info") => Some(Level::INFO),
        Some("debug") => Some(Level::DEBUG),
        Some("trace") => Some(Level::TRACE),
        Some(other) => {
            eprintln!(
                "gpufeed: {LOG_VAR}={other:?} is not a level (error, warn, info, debug, trace, \
                 off): using warn"
            );
            Some(Level::WARN)
        }
    };
    let Some(level) = level else {
        return;
    };
    // `try_init` fails only where a global subscriber is already set: that one stays.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .with_ansi(false)
        .without_time()
        .try_init();
}
