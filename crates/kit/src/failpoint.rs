//! Crash fail points at durability boundaries.
//!
//! `crash_point("relay.after_ack_before_mark")` is a no-op unless the crate is
//! built with the `failpoints` feature. With it, the environment variable
//! `FAILPOINTS` configures points with the `fail` crate's actions, separated by
//! `;`, e.g. `FAILPOINTS="relay.after_ack_before_mark=return"`:
//! - `return` (optionally `N*return` to fire on the N-th... see `fail`'s syntax)
//!   aborts the whole process right there (SIGABRT: no destructors, no flush,
//!   exactly like a `kill -9` at that line; a panic would only kill a task);
//! - `sleep(ms)`, `pause`, `panic`, `off` behave as in the `fail` crate.

/// Read `FAILPOINTS` and configure the named points. Call once at start-up.
pub fn init_from_env() {
    #[cfg(feature = "failpoints")]
    if let Ok(spec) = std::env::var("FAILPOINTS") {
        for entry in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            let Some((name, actions)) = entry.split_once('=') else {
                tracing::error!(entry, "FAILPOINTS entry without '=' ignored");
                continue;
            };
            match fail::cfg(name.trim(), actions.trim()) {
                Ok(()) => tracing::warn!(name, actions, "fail point armed"),
                Err(error) => tracing::error!(name, actions, %error, "bad fail point action"),
            }
        }
    }
}

/// A named point where a test holds the process (`sleep(ms)`, `pause`), not
/// a durability boundary: `return` does nothing here. A no-op without the
/// `failpoints` feature.
#[inline]
pub fn hold_point(name: &'static str) {
    #[cfg(feature = "failpoints")]
    let _ = fail::eval(name, |_| ());
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// A named point where a test delays this task without blocking its thread
/// (armed with `return(<ms>)`, e.g. `1*return(2000)`), to let other tasks
/// run first: an interleaving made certain instead of left to the
/// scheduler. A no-op without the `failpoints` feature.
pub async fn delay_point(name: &'static str) {
    #[cfg(feature = "failpoints")]
    if let Some(ms) =
        fail::eval(name, |ms| ms.and_then(|ms| ms.trim().parse::<u64>().ok())).flatten()
    {
        tracing::warn!(name, ms, "fail point: delaying");
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// A named fault that is not a crash: whether the caller should fail here,
/// as the fault the point names would make it fail (armed with `return`,
/// or `N*return`). Always `false` without the `failpoints` feature.
#[inline]
pub fn error_point(name: &'static str) -> bool {
    #[cfg(feature = "failpoints")]
    return fail::eval(name, |_| ()).is_some();
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = name;
        false
    }
}

/// A named crash boundary. See the module documentation.
#[inline]
pub fn crash_point(name: &'static str) {
    if error_point(name) {
        abort(name, "");
    }
}

/// End the process at fail point `name` (SIGABRT: no destructors, no flush).
fn abort(name: &str, item: &str) -> ! {
    eprintln!("fail point {name} fired{item}: aborting the process");
    std::process::abort();
}

/// A crash boundary for one item among many: aborts as [`crash_point`] does
/// when the point is armed with `return` (every item) or `return(<key>)`
/// (the item whose key is `key` only), e.g.
/// `FAILPOINTS="relay.preparing_row=return(<aggregate id>)"` for a row the
/// relay dies on each time it handles it. A count (`N*return(<key>)`) is
/// spent by every item evaluated, not only the key's. A no-op without the
/// `failpoints` feature.
#[inline]
pub fn crash_point_for(name: &'static str, key: &str) {
    #[cfg(feature = "failpoints")]
    if let Some(only) = fail::eval(name, |only| only) {
        if only.as_deref().is_none_or(|only| only == key) {
            abort(name, &format!(" for {key}"));
        }
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = (name, key);
}

/// A named point where a test holds one task, not its thread: armed with
/// `return(<ms>)`, the caller awaits that many milliseconds while the
/// runtime's other tasks go on (the `fail` crate's `sleep` blocks the whole
/// thread, and with it every task scheduled there). A no-op without the
/// `failpoints` feature, or armed with anything else.
pub async fn hold_task(name: &'static str) {
    #[cfg(feature = "failpoints")]
    if let Some(Some(ms)) = fail::eval(name, |ms| ms) {
        if let Ok(ms) = ms.parse::<u64>() {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}
