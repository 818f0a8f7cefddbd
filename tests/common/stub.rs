//! The stand-in carrier API (`inboxctl carrier-stub`) as a child process on loopback, and what tests ask of it: its
//! bookings, and a new behaviour.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::{Proc, TestEnv};

pub struct Stub {
    /// Held so the process lives as long as the stub (dropped: killed).
    _proc: Proc,
    /// Its base URL, `http://127.0.0.1:<port>`.
    pub url: String,
    http: reqwest::Client,
}

impl Stub {
    /// Starts `inboxctl carrier-stub` with `args` and waits for the URL it prints first.
    pub fn start(env: &TestEnv, args: &[&str]) -> Self {
        let mut all = vec!["carrier-stub", "--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        let proc = env.spawn(&all);
        let deadline = Instant::now() + Duration::from_secs(10);
        let url = loop {
            if let Some(line) = proc.stdout().lines().next() {
                break line.trim().to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "the stub printed no URL: {}",
                proc.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(url.starts_with("http://127.0.0.1:"), "{url}");
        Self {
            _proc: proc,
            url,
            http: reqwest::Client::new(),
        }
    }

    /// Every booking it made.
    pub async fn bookings(&self) -> Vec<Value> {
        serde_json::from_value(self.get("/_stub/bookings").await).unwrap()
    }

    /// What it answers to `GET <path>`, as JSON.
    async fn get(&self, path: &str) -> Value {
        self.http
            .get(format!("{}{path}", self.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Its bookings to `destination`.
    pub async fn bookings_to(&self, destination: &str) -> usize {
        self.bookings()
            .await
            .iter()
            .filter(|b| b["destination"] == destination)
            .count()
    }

    /// Its behaviour now (what is left of `failNext`, say).
    // Asked by tests/effects.rs, which needs the failpoints.
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    pub async fn behaviour(&self) -> Value {
        self.get("/_stub/behaviour").await
    }

    /// Sets its behaviour (fields left out take their defaults: honouring keys, prompt, no failures).
    pub async fn behave(&self, behaviour: Value) {
        let response = self
            .http
            .post(format!("{}/_stub/behaviour", self.url))
            .json(&behaviour)
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success(), "{behaviour}");
    }
}
