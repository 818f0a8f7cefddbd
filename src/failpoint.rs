//! Crash points for the tests. Compiled in only with the `failpoints` feature; without it every call is a no-op the
//! optimiser removes.
//!
//! Armed by `INBOXCTL_FAILPOINTS`, a comma-separated list of `name[=action][@label]`:
//! - `pause` (the default): print `failpoint <name> reached` to stderr and wait forever, so a test that sees the line
//!   knows the point was reached and can kill the process there with SIGKILL;
//! - `panic`: panic at the point;
//! - `panic-once`: panic at the point the first time it is reached, pass it after;
//! - `abort`: abort the process at the point;
//! - `sleep-once-<ms>`: print the line, then sleep that long, the first time only (a test can break a connection
//!   meanwhile); armed for two labels, once at each.
//!
//! With `@label`, the point fires only where the caller passes that label (e.g. a parcel's destination).

/// Fires the failpoint `name` if it is armed.
pub async fn hit(name: &str) {
    hit_with(name, "").await;
}

/// Fires the failpoint `name` if it is armed for `label` (or for every label).
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
pub async fn hit_with(name: &str, label: &str) {
    #[cfg(feature = "failpoints")]
    armed::hit(name, label).await;
}

/// Whether the failpoint `name` is armed for `label` (or for every label): a caller with a faster way around the point
/// takes the way through it instead, so that the test holding it there sees what it means to.
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
pub fn armed(name: &str, label: &str) -> bool {
    #[cfg(feature = "failpoints")]
    return armed::is_armed(name, label);
    #[cfg(not(feature = "failpoints"))]
    false
}

#[cfg(feature = "failpoints")]
mod armed {
    use std::io::Write;
    use std::sync::OnceLock;

    struct Point {
        name: String,
        action: String,
        label: Option<String>,
    }

    fn points() -> &'static [Point] {
        static POINTS: OnceLock<Vec<Point>> = OnceLock::new();
        POINTS.get_or_init(|| {
            std::env::var("INBOXCTL_FAILPOINTS")
                .unwrap_or_default()
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|spec| {
                    let (spec, label) = match spec.split_once('@') {
                        Some((s, l)) => (s, Some(l.to_owned())),
                        None => (spec, None),
                    };
                    let (name, action) = spec.split_once('=').unwrap_or((spec, "pause"));
                    Point {
                        name: name.trim().to_owned(),
                        action: action.trim().to_owned(),
                        label,
                    }
                })
                .collect()
        })
    }

    pub fn is_armed(name: &str, label: &str) -> bool {
        points()
            .iter()
            .any(|p| p.name == name && p.label.as_deref().is_none_or(|l| l == label))
    }

    pub async fn hit(name: &str, label: &str) {
        let Some(point) = points()
            .iter()
            .find(|p| p.name == name && p.label.as_deref().is_none_or(|l| l == label))
        else {
            return;
        };
        let mut stderr = std::io::stderr();
        static FIRED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
        // Once per entry: a point armed twice, for two labels, fires once at each.
        let entry = format!("{name}@{}", point.label.as_deref().unwrap_or_default());
        let first = || {
            let mut fired = FIRED.lock().unwrap_or_else(|p| p.into_inner());
            !fired.contains(&entry) && {
                fired.push(entry.clone());
                true
            }
        };
        if point.action == "panic-once" {
            if first() {
                let _ = writeln!(stderr, "failpoint {name} reached");
                let _ = stderr.flush();
                panic!("failpoint {name}");
            }
            return;
        }
        if let Some(ms) = point.action.strip_prefix("sleep-once-") {
            if first() {
                let _ = writeln!(stderr, "failpoint {name} reached");
                let _ = stderr.flush();
                let ms = ms.parse().unwrap_or(1000);
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
            return;
        }
        let _ = writeln!(stderr, "failpoint {name} reached");
        let _ = stderr.flush();
        match point.action.as_str() {
            // The label (a parcel's destination: a message's text) in the message: the tests' hostile text in a
            // panic, to be masked and escaped on its way out.
            "panic" if !label.is_empty() => panic!("failpoint {name} at {label}"),
            "panic" => panic!("failpoint {name}"),
            "abort" => std::process::abort(),
            _ => std::future::pending::<()>().await,
        }
    }
}
