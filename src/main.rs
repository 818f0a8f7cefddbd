use std::process::ExitCode;

use inboxctl::error::exit;

fn main() -> ExitCode {
    let cli = match inboxctl::cli::parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            // --help and --version are not errors; a bad flag or value is a usage error.
            return ExitCode::from(if e.use_stderr() {
                exit::USAGE
            } else {
                exit::OK
            });
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
