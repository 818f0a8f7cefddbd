//! Passwords read from files (`--database-password-file`, `--amqp-password-file`), so that they need appear neither
//! on a command line that `ps` shows nor in the environment.

use std::path::Path;

use crate::error::{Error, Result};
use crate::redact;

/// A password file longer than this is not a password file.
const MAX_PASSWORD_FILE: u64 = 64 * 1024;

/// Reads the password in `path` for the option `flag`: the file's text without its final line end. Registered for
/// redaction before anything can print it. An unreadable or empty file, or one of more than one line, is a usage error
/// that names the file, never its content.
///
/// Read once per process: a command that connects twice (`replay`'s audit, then its run) would find a pipe
/// (`<(pass show db)`) empty the second time.
pub fn read_password_file(flag: &str, path: &Path) -> Result<String> {
    static READ: std::sync::Mutex<Vec<(std::path::PathBuf, String)>> =
        std::sync::Mutex::new(Vec::new());
    let known = |read: &Vec<(std::path::PathBuf, String)>| {
        read.iter()
            .find(|(p, _)| p == path)
            .map(|(_, password)| password.clone())
    };
    if let Some(password) = known(&READ.lock().unwrap_or_else(|p| p.into_inner())) {
        return Ok(password);
    }
    let password = read_once(flag, path)?;
    READ.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((path.to_owned(), password.clone()));
    Ok(password)
}

/// The text of the file `path` given with `flag`, read through a bound of `max` bytes: a pipe (`<(pass show db)`)
/// works, and `/dev/zero` given by mistake does not fill the memory. What is wrong with it is a usage error naming the
/// file (`holds`: what it must hold, said when it is too long).
pub fn read_bounded_text(flag: &str, path: &Path, max: u64, holds: &str) -> Result<String> {
    use std::io::Read as _;
    let shown = crate::sanitize::text(&path.display().to_string()).into_owned();
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(max + 1).read_to_end(&mut bytes))
        .map_err(|e| Error::Usage(format!("{flag} {shown}: {e}")))?;
    if bytes.len() as u64 > max {
        return Err(Error::Usage(format!(
            "{flag} {shown}: longer than {max} bytes; it must hold {holds}"
        )));
    }
    String::from_utf8(bytes).map_err(|_| Error::Usage(format!("{flag} {shown}: not UTF-8 text")))
}

fn read_once(flag: &str, path: &Path) -> Result<String> {
    let shown = crate::sanitize::text(&path.display().to_string()).into_owned();
    let text = read_bounded_text(flag, path, MAX_PASSWORD_FILE, "the password alone")?;
    let password = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(&text)
        .to_owned();
    redact::register(&password);
    if password.is_empty() {
        return Err(Error::Usage(format!("{flag} {shown}: the file is empty")));
    }
    if password.contains(['\n', '\r']) {
        return Err(Error::Usage(format!(
            "{flag} {shown}: the file holds more than one line; it must hold the password alone"
        )));
    }
    warn_if_shared(flag, path);
    Ok(password)
}

/// libpq ignores a password file that others can read; inboxctl uses it (a mounted secret is often 0644) but says so.
#[cfg(unix)]
fn warn_if_shared(flag: &str, path: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(
            file = %crate::sanitize::text(&path.display().to_string()),
            "{flag}: the file can be read by other users of this machine (chmod 600 it)"
        );
    }
}

#[cfg(not(unix))]
fn warn_if_shared(_flag: &str, _path: &Path) {}

/// A URL flag, with the safer places its password can come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UrlFlag {
    pub flag: &'static str,
    pub env: &'static str,
    pub password_file: &'static str,
}

pub const DATABASE_URL: UrlFlag = UrlFlag {
    flag: "--database-url",
    env: "DATABASE_URL",
    password_file: "--database-password-file",
};

pub const AMQP_URL: UrlFlag = UrlFlag {
    flag: "--amqp-url",
    env: "AMQP_URL",
    password_file: "--amqp-password-file",
};

/// How to write a password that a URL cannot hold as it is.
fn encoding_hint(url: UrlFlag) -> String {
    format!(
        "percent-encode the password (% as %25, / as %2F, ? as %3F, # as %23, @ as %40, : as %3A) or give it in {}",
        url.password_file
    )
}

/// The usage error for a URL the driver could not parse. It never shows the credentials: the URL is masked (all of
/// the part before its last `@` when the credentials are ambiguous), the driver's message is shown only when the
/// credentials are clear (it may quote a piece of the URL), and the URL itself in it is masked too.
pub fn invalid_url(url: UrlFlag, given: &str, driver_error: &str) -> Error {
    let flag = url.flag;
    // Not a URL at all (a libpq key/value string, `host=… password=…`, say): nothing in it can be told apart as a
    // password, so none of it is shown.
    let scheme = given.split_once("://").map(|(scheme, _)| scheme);
    let a_scheme = scheme.is_some_and(|s| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '.' | '-'))
    });
    if !a_scheme {
        return Error::Usage(format!(
            "invalid {flag}: not a URL (not shown: it may hold a password); give scheme://user:password@host:port/…"
        ));
    }
    let shown = redact::url(given);
    if redact::credentials_ambiguous(given) {
        return Error::Usage(format!(
            "invalid {flag} {shown}: a URL's user name and password end at its first /, ? or #, and one comes \
             before the last @; {}",
            encoding_hint(url)
        ));
    }
    let mut message = format!(
        "invalid {flag} {shown}: {}",
        redact::text(&driver_error.replace(given, &shown))
    );
    if given.contains('@') {
        message.push_str("; if the password holds a character a URL reserves, ");
        message.push_str(&encoding_hint(url));
    }
    Error::Usage(message)
}

/// Warns about a URL that parsed but whose credentials are ambiguous (see [`redact::credentials_ambiguous`]): the
/// driver took the user name and password to end at the first `/`, `?` or `#`, which is rarely what was meant.
pub fn warn_if_ambiguous(url: UrlFlag, given: &str) {
    if redact::credentials_ambiguous(given) {
        tracing::warn!(
            "{} {}: a URL's user name and password end at its first /, ? or #, and one comes before the last @; if \
             the password holds one, {}",
            url.flag,
            redact::url(given),
            encoding_hint(url)
        );
    }
}

/// Warns, once per URL, about a password typed in the command line: `ps` shows it to every user of the machine.
pub fn warn_if_on_command_line(urls: &[UrlFlag]) {
    for url in urls {
        tracing::warn!(
            "{} holds a password in the command line, where `ps` shows it to every user of this machine: give the URL in \
             the environment ({}) or the password in a file ({})",
            url.flag,
            url.env,
            url.password_file
        );
    }
}

/// The usage error for a password given twice.
pub fn given_twice(url_flag: &str, file_flag: &str) -> Error {
    Error::Usage(format!(
        "{url_flag} has a password and {file_flag} gives one too; give it in one place"
    ))
}

/// `url` with `password` (and `user`, where the URL names none) written into it, for handing to a child process
/// through its environment (never for printing). The URL as it was when it cannot carry one.
pub fn url_with_password(url: &str, user: &str, password: &str) -> String {
    let Ok(mut u) = url::Url::parse(url) else {
        return url.to_owned();
    };
    if u.username().is_empty() && u.set_username(user).is_err() {
        return url.to_owned();
    }
    match u.set_password(Some(password)) {
        Ok(()) => u.to_string(),
        Err(()) => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, content: &[u8]) -> std::path::PathBuf {
        let path =
            std::env::temp_dir().join(format!("inboxctl-secret-{}-{name}", std::process::id()));
        std::fs::write(&path, content).expect("write");
        path
    }

    #[test]
    fn a_password_is_written_into_a_url_encoded() {
        assert_eq!(
            url_with_password(
                "postgres://app@db:5432/parcels?sslmode=require",
                "app",
                "p@ss/w:rd"
            ),
            "postgres://app:p%40ss%2Fw%3Ard@db:5432/parcels?sslmode=require"
        );
        assert_eq!(
            url_with_password("amqp://127.0.0.1:5672/%2f", "guest", "pw-x"),
            "amqp://guest:pw-x@127.0.0.1:5672/%2f"
        );
    }

    #[test]
    fn the_final_line_end_is_not_part_of_the_password() {
        for (name, content) in [
            ("lf", &b"s3cret-pw\n"[..]),
            ("crlf", b"s3cret-pw\r\n"),
            ("none", b"s3cret-pw"),
        ] {
            let path = file(name, content);
            assert_eq!(
                read_password_file("--database-password-file", &path).expect("read"),
                "s3cret-pw"
            );
            let _ = std::fs::remove_file(path);
        }
    }

    /// Read twice in one process (`replay` connects for its audit, then for its run), a pipe was empty the second
    /// time: "the file is empty", and what that connection was for skipped. Read once now.
    #[test]
    fn a_password_file_is_read_once_per_process() {
        let path = file("once", b"0nce-pw\n");
        assert_eq!(
            read_password_file("--database-password-file", &path).expect("read"),
            "0nce-pw"
        );
        std::fs::write(&path, b"").expect("emptied, as a pipe read once is");
        assert_eq!(
            read_password_file("--database-password-file", &path).expect("read again"),
            "0nce-pw"
        );
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn empty_missing_and_multi_line_files_are_usage_errors_that_do_not_show_the_content() {
        let empty = file("empty", b"\n");
        let two = file("two", b"first-line-pw\nsecond-line-pw\n");
        let missing = std::env::temp_dir().join("inboxctl-secret-no-such-file");
        for (path, says) in [
            (&empty, "empty"),
            (&two, "more than one line"),
            (&missing, "No such file"),
        ] {
            let err = read_password_file("--amqp-password-file", path).expect_err("refused");
            assert_eq!(err.exit_code(), 64, "{err}");
            let text = err.to_string();
            assert!(text.contains(says), "{text}");
            assert!(text.contains("--amqp-password-file"), "{text}");
            assert!(!text.contains("line-pw"), "{text}");
        }
        let _ = std::fs::remove_file(empty);
        let _ = std::fs::remove_file(two);
    }
}
