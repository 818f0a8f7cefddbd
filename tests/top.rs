//! `inboxctl top` end to end, in a real terminal (tmux): real traffic for two consumer_types, known figures on
//! screen, `q` quits and leaves the terminal usable.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::{TestEnv, Tmux};

/// Waits for the shell after top to report, then checks top's exit code and that the terminal was given back:
/// canonical mode, the alternate screen gone.
fn assert_exited_and_terminal_given_back(tmux: &Tmux, code: &str) {
    // Wait for stty's answer too: it comes a moment after the exit line.
    let after = tmux.wait_for("top to exit and stty to report", |s| {
        s.contains("EXITED=")
            && s.lines()
                .any(|l| l.trim() == "icanon" || l.trim() == "-icanon")
    });
    assert!(after.contains(&format!("EXITED={code}")), "{after}");
    assert!(
        after.lines().any(|l| l.trim() == "icanon"),
        "the terminal is back in canonical mode:\n{after}"
    );
    assert!(
        !after.contains("consumer_type"),
        "the alternate screen is gone:\n{after}"
    );
}

/// `top --interval 500ms` in a tmux session of its own, `width` columns wide; the shell reports its exit code and
/// the terminal's mode after it (see [`assert_exited_and_terminal_given_back`]).
fn top_in_tmux(env: &TestEnv, width: u16) -> Tmux {
    top_in_tmux_with(env, width, "")
}

/// The same, with `variables` (`NAME='value' …`) set for `top` alone.
fn top_in_tmux_with(env: &TestEnv, width: u16, variables: &str) -> Tmux {
    let tmux = Tmux {
        socket: format!("inboxctl-{}", env.db_name),
    };
    let script = format!(
        "{variables} DATABASE_URL='{}' AMQP_URL='{}' '{}' top --interval 500ms; echo EXITED=$?; stty -a | tr ' ' '\\n' | grep -x -- '-\\?icanon'; sleep 60",
        env.database_url,
        env.amqp_url,
        common::bin()
    );
    let width = width.to_string();
    tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        &width,
        "-y",
        "40",
        &script,
    ]);
    tmux
}

#[tokio::test(flavor = "multi_thread")]
async fn top_shows_two_consumer_types_after_real_traffic_and_quits_cleanly() {
    let env = TestEnv::migrated().await;
    common::ensure_endpoints(&env).await;
    common::publish_parcels(&env, &["--count", "20", "--duplicates", "0.5"]);
    let mut carrier = env.spawn(&["consume", "carrier", "--exit-when-idle", "1s"]);
    let mut notification = env.spawn(&["consume", "notification", "--exit-when-idle", "1s"]);
    assert_eq!(carrier.wait(Duration::from_secs(60)), Some(0));
    assert_eq!(notification.wait(Duration::from_secs(60)), Some(0));

    let tmux = top_in_tmux(&env, 160);

    // 20 parcels, 10 sent twice, in the last minute: 30 deliveries (0.5/s), 10 duplicates (0.2/s), 33.3 %.
    // The charts are part of the wait: tmux can capture a frame half written (the rows drawn, the charts below not yet).
    let screen = tmux.wait_for("both consumer_types with their figures", |s| {
        s.contains("parcel-created-carrier")
            && s.contains("parcel-created-notification")
            && s.matches("33.3%").count() == 2
            && s.contains("deliveries, last 2m")
    });
    for name in ["parcel-created-carrier ", "parcel-created-notification "] {
        let row = screen
            .lines()
            .find(|l| l.contains(name) && l.contains('%'))
            .unwrap();
        let figures: Vec<&str> = row.split_whitespace().collect();
        assert!(
            figures.contains(&"0.5") && figures.contains(&"0.2") && figures.contains(&"20"),
            "{row}"
        );
        assert!(figures.contains(&"33.3%"), "{row}");
    }
    assert!(
        screen.contains("deliveries, last 2m"),
        "charts of the selected consumer_type:\n{screen}"
    );

    tmux.run(&["send-keys", "-t", "top", "s"]);
    tmux.wait_for("the sort changed", |s| s.contains("sorted by deliveries/s"));
    // `/` filters by name; while typing, q is a letter, not quit; Esc drops the filter.
    tmux.run(&[
        "send-keys",
        "-t",
        "top",
        "/",
        "q",
        "BSpace",
        "n",
        "o",
        "t",
        "i",
        "f",
    ]);
    tmux.wait_for("the filter", |s| {
        s.contains("filter: notif")
            && s.contains("parcel-created-notification")
            && !s.contains("parcel-created-carrier")
    });
    tmux.run(&["send-keys", "-t", "top", "Escape"]);
    tmux.wait_for("the filter gone", |s| {
        !s.contains("filter:")
            && s.contains("parcel-created-carrier")
            && s.contains("parcel-created-notification")
    });
    tmux.run(&["send-keys", "-t", "top", "q"]);
    assert_exited_and_terminal_given_back(&tmux, "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_says_when_postgres_is_gone_keeps_retrying_and_recovers() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    sqlx::raw_sql("INSERT INTO inbox_messages SELECT gen_random_uuid(), 'ops-queue', now(), NULL FROM generate_series(1, 3)")
        .execute(&pool)
        .await
        .unwrap();
    let proxy = common::Proxy::start("127.0.0.1:5432").await;
    let tmux = Tmux {
        socket: format!("inboxctl-{}", env.db_name),
    };
    let script = format!(
        "DATABASE_URL='postgres://postgres@127.0.0.1:{}/{}' AMQP_URL='{}' '{}' top --interval 300ms; echo EXITED=$?; sleep 60",
        proxy.port,
        env.db_name,
        env.amqp_url,
        common::bin()
    );
    tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "150",
        "-y",
        "30",
        &script,
    ]);
    tmux.wait_for("the inbox figures", |s| s.contains("ops-queue"));

    proxy.cut();
    let screen = tmux.wait_for("the outage on the status line", |s| s.contains("retrying"));
    assert!(
        screen.contains("ops-queue"),
        "the last figures stay on screen:\n{screen}"
    );
    assert!(!screen.contains("EXITED"), "it does not exit");
    proxy.restore();
    tmux.wait_for("recovery", |s| {
        s.contains("updated") && !s.contains("retrying")
    });
    tmux.run(&["send-keys", "-t", "top", "Escape"]);
    assert!(
        tmux.wait_for("top to exit", |s| s.contains("EXITED="))
            .contains("EXITED=0")
    );
}

/// A refresh stuck behind a lock (a `VACUUM FULL`, a migration holding the inbox) froze the figures without a word,
/// and `q` waited for it — the terminal left raw — until the lock went. The refresh is bounded now and says so, and
/// `q` ends the dashboard at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_refresh_stuck_behind_a_lock_is_said_and_does_not_hold_the_quit() {
    let env = TestEnv::migrated().await;
    let pool = env.pool().await;
    let tmux = top_in_tmux(&env, 200);
    tmux.wait_for("the dashboard", |s| s.contains("consumer_type"));
    let mut lock = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE inbox_messages IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    tmux.wait_for("the refresh said to be late", |s| {
        s.contains("a refresh took longer than 15s")
    });
    // The next refresh is stuck by now, seconds from its own limit: the quit must not wait for it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let quit = std::time::Instant::now();
    tmux.run(&["send-keys", "-t", "top", "q"]);
    tmux.wait_for("top to exit", |s| s.contains("EXITED="));
    assert!(
        quit.elapsed() < Duration::from_secs(5),
        "quit took {:?}",
        quit.elapsed()
    );
    assert_exited_and_terminal_given_back(&tmux, "0");
    lock.rollback().await.unwrap();
}

/// A second SIGTERM while `top` is still stopping (held there by a failpoint) ends it at once, exit 130 — and gives
/// the terminal back first: canonical mode, the alternate screen gone.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_signal_exits_at_once_and_gives_the_terminal_back() {
    let env = TestEnv::migrated().await;
    let tmux = Tmux {
        socket: format!("inboxctl-{}", env.db_name),
    };
    let pid_file = std::env::temp_dir().join(format!("{}.top.pid", env.db_name));
    let inner = std::env::temp_dir().join(format!("{}.top.sh", env.db_name));
    // The dashboard runs in a shell of its own (exec keeps the pid it wrote), and the session's shell reports after.
    std::fs::write(
        &inner,
        format!(
            "echo $$ > '{}'\nINBOXCTL_FAILPOINTS=top-stopping DATABASE_URL='{}' AMQP_URL='{}' exec '{}' top --interval 500ms\n",
            pid_file.display(),
            env.database_url,
            env.amqp_url,
            common::bin()
        ),
    )
    .unwrap();
    let outer = format!(
        "sh '{}'; echo EXITED=$?; stty -a | tr ' ' '\\n' | grep -x -- '-\\?icanon'; sleep 60",
        inner.display()
    );
    tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "160",
        "-y",
        "40",
        &outer,
    ]);
    tmux.wait_for("the dashboard", |s| s.contains("consumer_type"));
    let pid = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .to_owned();
    let _ = std::fs::remove_file(&pid_file);
    let kill = |what: &str| {
        let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(status.success(), "{what}");
    };
    kill("the first signal");
    tmux.wait_for("the failpoint holding it", |s| {
        s.contains("failpoint top-stopping reached")
    });
    kill("the second signal");
    assert_exited_and_terminal_given_back(&tmux, "130");
}

/// Under `TERM=dumb` (Emacs's shell, some CI consoles) the terminal cannot redraw in place: `top` says so, points to
/// `stats`, exits 64 and draws nothing — no box, no escape codes — and the terminal is left as it was.
#[tokio::test(flavor = "multi_thread")]
async fn a_dumb_terminal_is_refused_with_a_pointer_to_stats() {
    let env = TestEnv::migrated().await;
    let tmux = Tmux {
        socket: format!("inboxctl-{}", env.db_name),
    };
    let script = format!(
        "TERM=dumb DATABASE_URL='{}' AMQP_URL='{}' '{}' top --interval 500ms; echo EXITED=$?; stty -a | tr ' ' '\\n' | grep -x -- '-\\?icanon'; sleep 60",
        env.database_url,
        env.amqp_url,
        common::bin()
    );
    tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "160",
        "-y",
        "40",
        &script,
    ]);
    let screen = tmux.wait_for("top to exit", |s| s.contains("EXITED="));
    assert!(screen.contains("EXITED=64"), "{screen}");
    assert!(
        screen.contains("TERM=dumb") && screen.contains("inboxctl stats"),
        "{screen}"
    );
    assert!(
        !screen.contains('┌') && !screen.contains("consumer_type"),
        "nothing drawn:\n{screen}"
    );
    // Escape codes written raw would show in the pane's history with -e; there are none but the message's.
    let raw = tmux.run(&["capture-pane", "-p", "-e", "-t", "top"]);
    assert!(!raw.contains('\u{1b}'), "{raw:?}");
    assert_exited_and_terminal_given_back(&tmux, "64");
}

/// The error queue `slow-heads_error` with a message in it, beside rows of the consumer_type `slow-heads`.
#[cfg(feature = "failpoints")]
async fn a_consumer_type_with_a_dead_letter(env: &TestEnv) {
    let pool = env.pool().await;
    sqlx::query(
        "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) \
         SELECT gen_random_uuid(), 'slow-heads', now(), now() FROM generate_series(1, 3)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let conn = env.amqp().await;
    let channel = conn.create_channel().await.unwrap();
    for queue in ["slow-heads", "slow-heads_error"] {
        channel
            .queue_declare(
                queue.into(),
                lapin::options::QueueDeclareOptions::durable(),
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap();
    }
    common::publish(
        &conn,
        "",
        "slow-heads_error",
        lapin::BasicProperties::default().with_message_id("m".into()),
        b"{}",
    )
    .await;
}

/// A panic in the dashboard's data collection (inboxctl's bug; here a failpoint): the panic hook gives the terminal
/// back, and the dashboard used to go on drawing stale figures into a terminal out of raw mode — keys needing Enter,
/// nothing said — and exit 0. It ends with an error now.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_panic_in_the_data_collection_ends_the_dashboard_with_an_error() {
    let env = TestEnv::migrated().await;
    a_consumer_type_with_a_dead_letter(&env).await;
    let tmux = top_in_tmux_with(
        &env,
        220,
        "INBOXCTL_FAILPOINTS=head-look=panic@slow-heads_error",
    );
    assert_exited_and_terminal_given_back(&tmux, "1");
    let screen = tmux.screen();
    assert!(
        screen.contains("the data collection of the dashboard failed"),
        "{screen}"
    );
}

/// A panic in the dashboard's own loop (inboxctl's bug; here a failpoint at a key): the panic hook gives the terminal
/// back and prints the panic, and the guard gave it back a second time as it unwound, covering the panic's text.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_panic_in_the_dashboards_loop_leaves_its_text_on_the_terminal() {
    let env = TestEnv::migrated().await;
    let tmux = top_in_tmux_with(
        &env,
        160,
        "RUST_BACKTRACE=0 INBOXCTL_FAILPOINTS=top-key=panic",
    );
    tmux.wait_for("the dashboard", |s| s.contains("consumer_type"));
    tmux.run(&["send-keys", "-t", "top", "j"]);
    assert_exited_and_terminal_given_back(&tmux, "101");
    let screen = tmux.screen();
    assert!(screen.contains("failpoint top-key"), "{screen}");
}

/// A look at an error queue's head the broker does not answer (a quorum queue without a leader, a broker far away
/// with many of them): every refresh ran into its limit and was thrown away whole, the database's figures with it,
/// and looked at the heads again — the dashboard said "waiting for the first figures" for good. The broker's half is
/// bounded apart now: the figures come, and what RabbitMQ did not answer is said.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_head_the_broker_does_not_answer_leaves_the_figures_shown() {
    let env = TestEnv::migrated().await;
    a_consumer_type_with_a_dead_letter(&env).await;
    let tmux = top_in_tmux_with(&env, 220, "INBOXCTL_FAILPOINTS=head-look@slow-heads_error");
    let screen = tmux.wait_for("the figures, and what RabbitMQ did not answer", |s| {
        s.contains("slow-heads") && s.contains("did not answer every look")
    });
    assert!(
        !screen.contains("waiting for the first figures"),
        "{screen}"
    );
    tmux.run(&["send-keys", "-t", "top", "q"]);
    assert_exited_and_terminal_given_back(&tmux, "0");
}
