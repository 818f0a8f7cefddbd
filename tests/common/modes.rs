//! The two modes every guarantee test runs in: one transaction per message, and batched.

/// `consume` flags of the two modes every guarantee test runs in: one transaction per message, and batched.
pub const ONE_BY_ONE: &[&str] = &[];
pub const BATCHED: &[&str] = &["--batch-size", "32"];

/// Declares a test that runs `$body(mode)` once per mode, as `$name::one_by_one` and `$name::batched`.
#[macro_export]
macro_rules! in_both_modes {
    ($name:ident, $body:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_by_one() {
                super::$body(super::common::ONE_BY_ONE).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batched() {
                super::$body(super::common::BATCHED).await;
            }
        }
    };
}

/// `args` followed by `mode`.
pub fn with_mode<'a>(args: &[&'a str], mode: &[&'a str]) -> Vec<&'a str> {
    args.iter().chain(mode).copied().collect()
}
