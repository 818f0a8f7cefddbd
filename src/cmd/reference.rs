//! The reference generated from the command line itself, so that it cannot go stale: the manual pages in `man/`
//! (one per command, `inboxctl.1` and `inboxctl-<subcommand>.1`, as git's are) and `docs/cli.md`. A test fails when
//! the committed files differ from what this generates.

use clap::CommandFactory as _;

use crate::cli::Cli;

/// The command line as the reference shows it: without the build's commit in its version (which would make every
/// commit change the pages) and without clap's `help` subcommand.
fn command() -> clap::Command {
    let mut cmd = Cli::command()
        .version(env!("CARGO_PKG_VERSION"))
        .disable_help_subcommand(true);
    cmd.build();
    cmd
}

/// Every command, the root first, each followed by its subcommands.
fn commands() -> Vec<clap::Command> {
    fn walk(cmd: &clap::Command, into: &mut Vec<clap::Command>) {
        into.push(cmd.clone());
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            walk(sub, into);
        }
    }
    let mut all = Vec::new();
    walk(&command(), &mut all);
    all
}

/// The manual pages: file name (`inboxctl-consume.1`) and roff text.
pub fn man_pages() -> Vec<(String, Vec<u8>)> {
    commands()
        .into_iter()
        .map(|cmd| {
            let man = clap_mangen::Man::new(cmd).manual("inboxctl manual");
            let mut page = Vec::new();
            // Writing into a Vec cannot fail.
            let _ = man.render(&mut page);
            (man.get_filename(), page)
        })
        .collect()
}

/// `docs/cli.md`: every command's full `--help`, in one page.
pub fn markdown() -> String {
    let mut page = String::from(
        "# Command-line reference\n\nGenerated from the command line (`src/cmd/reference.rs`; a test fails when this \
         page is stale): every command's `--help`. What each command does and guarantees: \
         [commands.md](commands.md).\n",
    );
    for mut cmd in commands() {
        let name = cmd
            .get_bin_name()
            .unwrap_or_else(|| cmd.get_name())
            .to_owned();
        let help = cmd.render_long_help().to_string();
        page.push_str(&format!(
            "\n## `{name}`\n\n```text\n{}\n```\n",
            help.trim_end()
        ));
    }
    page
}
