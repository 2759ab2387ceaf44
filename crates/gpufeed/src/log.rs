//! gpufeed's `tracing` events (the fallbacks it takes, leftovers it cleans, peers it gives up
//! on) on stderr, for programs that install no subscriber of their own: the `gpufeed` CLI and
//! the Python package. Behind the cargo feature `stderr-log`.

/// The variable that sets how much [`log_to_stderr`] prints.
pub const LOG_VAR: &str = "GPUFEED_LOG";

/// Prints gpufeed's `tracing` events to stderr from now on, at the level `GPUFEED_LOG` names
/// (`error`, `warn` — the default —, `info`, `debug`, `trace`; `off` prints nothing), unless
/// the process already has a global subscriber (then nothing changes). The crates under
/// gpufeed (the HTTP client, the object store) print their warnings, and everything only at
/// `trace`. At `debug` and `trace` each event begins with the seconds since this call (a
/// timeline). A value it does not know is said once on stderr and `warn` is used.
///
/// For binaries and bindings; a Rust program that logs picks its own subscriber instead.
///
/// # Example
/// ```
/// gpufeed::log_to_stderr(); // e.g. first thing in main()
/// ```
pub fn log_to_stderr() {
    use tracing::Level;
    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::fmt::time::Uptime;
    use tracing_subscriber::layer::{Layer, SubscriberExt};
    use tracing_subscriber::util::SubscriberInitExt;
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
    // gpufeed's own crates (`gpufeed*`, the Python module `_gpufeed`) at `level`; the crates
    // under them (the HTTP client, the object store) at `warn` unless `trace` asks for all.
    let others = if level == Level::TRACE {
        Level::TRACE
    } else {
        level.min(Level::WARN)
    };
    let targets = Targets::new()
        .with_target("gpufeed", level)
        .with_target("_gpufeed", level)
        .with_default(others);
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false);
    // `try_init` fails only where a global subscriber is already set: that one stays.
    if level >= Level::DEBUG {
        // A timeline: seconds since this call (for the Python package, its import).
        let _ = tracing_subscriber::registry()
            .with(fmt.with_timer(Uptime::default()).with_filter(targets))
            .try_init();
    } else {
        let _ = tracing_subscriber::registry()
            .with(fmt.without_time().with_filter(targets))
            .try_init();
    }
}
