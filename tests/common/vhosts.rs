//! The tests' RabbitMQ vhosts, made and removed in bulk. Each `rabbitmqctl` call boots an Erlang VM, about 1.5 s of
//! CPU on the 2-core test machine: one per `add_vhost`, `set_permissions` and `delete_vhost` made them the largest
//! cost of the whole suite. So vhosts are made two dozen at a time by one `rabbitmqctl eval`, handed out one per test
//! environment (never twice), and deleted in bulk, by a later refill, once the test process that used one is gone.
//!
//! The pool lives in files under the temporary directory, shared by the test processes: `ready/<vhost>` is one to
//! take (taking is an atomic rename into `used/`), `used/<vhost>` holds the taker's process id; `pool.lock` is held
//! while vhosts are made or deleted.

use std::fs;
use std::path::PathBuf;

use uuid::Uuid;

use super::rabbitmqctl;

/// How many vhosts one refill makes.
const BATCH: usize = 24;

fn dir() -> PathBuf {
    std::env::temp_dir().join("inboxctl-test-vhosts")
}

/// A fresh vhost with `guest` granted everything on it, for one test environment.
pub fn take() -> String {
    let (ready, used) = (dir().join("ready"), dir().join("used"));
    fs::create_dir_all(&ready).unwrap();
    fs::create_dir_all(&used).unwrap();
    loop {
        for entry in fs::read_dir(&ready).unwrap().flatten() {
            let name = entry.file_name();
            if fs::rename(entry.path(), used.join(&name)).is_ok() {
                fs::write(used.join(&name), std::process::id().to_string()).unwrap();
                return name.to_string_lossy().into_owned();
            }
        }
        refill();
    }
}

/// Marks a vhost as done with: a later refill deletes it (unless `keep`, for a look afterwards).
pub fn give_back(vhost: &str, keep: bool) {
    let used = dir().join("used").join(vhost);
    if keep {
        let _ = fs::remove_file(used);
    } else {
        let _ = fs::write(used, "done");
    }
}

/// Under the pool's lock: deletes the vhosts whose tests are over, and makes a batch of new ones (unless another
/// process did while this one waited for the lock).
fn refill() {
    let lock = fs::File::create(dir().join("pool.lock")).unwrap();
    lock.lock().unwrap();
    if fs::read_dir(dir().join("ready")).unwrap().next().is_some() {
        return;
    }
    let finished: Vec<PathBuf> = fs::read_dir(dir().join("used"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let owner = fs::read_to_string(p).unwrap_or_default();
            owner == "done"
                || owner
                    .parse::<u32>()
                    .is_ok_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
        })
        .collect();
    let gone: Vec<String> = finished
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    let new: Vec<String> = (0..BATCH)
        .map(|_| {
            format!(
                "inboxctl-test-{}",
                &Uuid::new_v4().simple().to_string()[..16]
            )
        })
        .collect();
    let list = |names: &[String]| {
        names
            .iter()
            .map(|n| format!("<<\"{n}\">>"))
            .collect::<Vec<_>>()
            .join(",")
    };
    // Erlang: delete the finished (one a test deleted itself is gone already: `catch` keeps that from failing the
    // batch), then add each new vhost and grant guest everything on it.
    let script = format!(
        "[catch rabbit_vhost:delete(V, <<\"inboxctl-tests\">>) || V <- [{}]], \
         [begin rabbit_vhost:add(V, <<\"inboxctl-tests\">>), \
          rabbit_auth_backend_internal:set_permissions(<<\"guest\">>, V, <<\".*\">>, <<\".*\">>, <<\".*\">>, \
          <<\"inboxctl-tests\">>) end || V <- [{}]], ok.",
        list(&gone),
        list(&new)
    );
    rabbitmqctl(&["-q", "eval", &script]);
    for path in finished {
        let _ = fs::remove_file(path);
    }
    for name in new {
        fs::write(dir().join("ready").join(name), "").unwrap();
    }
}
