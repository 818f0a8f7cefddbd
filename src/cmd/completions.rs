//! `inboxctl completions <shell>`: a completion script on stdout. The generated files are kept in `completions/`.

use clap::CommandFactory as _;
use clap_complete::Shell;

use crate::cli::Cli;
use crate::error::{Outcome, Result};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The shell to complete for
    #[arg(value_enum)]
    pub shell: Shell,
}

/// The completion script for `shell`.
pub fn script(shell: Shell) -> Vec<u8> {
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "inboxctl", &mut out);
    out
}

/// The file in `completions/` that holds `shell`'s script.
pub fn file_name(shell: Shell) -> &'static str {
    match shell {
        Shell::Bash => "inboxctl.bash",
        Shell::Zsh => "_inboxctl",
        Shell::Fish => "inboxctl.fish",
        Shell::Elvish => "inboxctl.elv",
        Shell::PowerShell => "_inboxctl.ps1",
        _ => "inboxctl.completion",
    }
}

pub fn run(args: &Args) -> Result<Outcome> {
    let script = String::from_utf8_lossy(&script(args.shell)).into_owned();
    crate::output::line(script.trim_end())?;
    Ok(Outcome::Done)
}
