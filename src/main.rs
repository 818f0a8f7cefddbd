use std::process::ExitCode;

use inboxctl::error::exit;

fn main() -> ExitCode {
    // Before clap, which may quote an argument or a value from the environment in a usage error: every URL given is
    // registered, so its password is masked wherever it is quoted, whatever it holds (a `'` or a space ends the URL
    // the pattern pass in `redact::text` sees, and clap quotes values in `'…'`).
    for arg in std::env::args_os().skip(1) {
        let arg = arg.to_string_lossy();
        if arg.contains("://") {
            inboxctl::redact::register_url(&arg);
        }
    }
    for name in ["DATABASE_URL", "AMQP_URL"] {
        if let Some(value) = std::env::var_os(name) {
            inboxctl::redact::register_url(&value.to_string_lossy());
        }
    }
    inboxctl::panic_hook::install();
    let cli = match inboxctl::cli::parse() {
        Ok(cli) => cli,
        // --help and --version are not errors; a bad flag or value is a usage error, said with the argument it
        // quotes masked where it is a URL with a password (a second node's `--amqp-url` given without the flag).
        // (A closed stderr is no panic: written, not `eprint!`ed.)
        Err(e)
            if e.use_stderr()
                && e.kind() != clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand =>
        {
            use std::io::Write as _;
            // Masked, and escaped as every text inboxctl prints is: the argument quoted is the user's (or a pasted
            // id's, from a message header), and may hold control or direction-changing characters.
            let text =
                inboxctl::sanitize::multiline(&inboxctl::redact::text(&e.render().to_string()));
            let _ = std::io::stderr().write_all(text.as_bytes());
            return ExitCode::from(exit::USAGE);
        }
        // Help asked for by giving nothing: no argument of the user's in it, and its URL shapes are no passwords.
        Err(e) if e.use_stderr() => {
            let _ = e.print();
            return ExitCode::from(exit::USAGE);
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(exit::OK);
        }
    };
    let target = match cli.command {
        inboxctl::cmd::Command::Demo(_) => inboxctl::logging::Target::StderrQuietConsumers,
        inboxctl::cmd::Command::Top(_) => inboxctl::logging::Target::Nowhere,
        _ => inboxctl::logging::Target::Stderr,
    };
    inboxctl::logging::init(&cli.global, target);
    match inboxctl::run(cli) {
        Ok(outcome) => outcome.into(),
        Err(e) => {
            inboxctl::report(&e);
            ExitCode::from(e.exit_code())
        }
    }
}
