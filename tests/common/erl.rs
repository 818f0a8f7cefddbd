//! The broker's books read through an Erlang node of the test process's own, started once and kept: a query costs
//! a message between two nodes, where a `rabbitmqctl` call boots a whole Erlang VM and the CLI's code (half a second
//! of CPU and about as long in wall time; seconds on a loaded box). Tests that wait for a queue to empty poll the
//! broker in a loop, and with two cores and five tests at once those boots were a good part of the suite's CPU.
//!
//! The node reads one Erlang expression a line from its standard input, evaluates it on the broker's node
//! (`rpc:call` of `erl_eval`), and writes the result as `rabbitmqctl eval` prints it, then a line `.end`. It ends
//! when the test process does (its standard input closes). Without the broker's cookie, or with no broker node
//! answering by a name tried (`rabbit@localhost`, `rabbit@<short host name>`, or `INBOXCTL_TEST_RABBIT_NODE`),
//! [`eval`] answers `None` and the caller asks `rabbitmqctl` instead.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;

/// The node's loop. `Node` is the first of the candidates that answers a ping; none answering, it says `nonode`
/// and stops.
const LOOP: &str = r#"
Candidates = [list_to_atom(N) || N <- string:lexemes(os:getenv("INBOXCTL_RABBIT_NODES"), " ")],
case [N || N <- Candidates, net_adm:ping(N) =:= pong] of
  [] -> io:format("nonode~n"), init:stop();
  [Node | _] ->
    io:format("ready~n"),
    Loop = fun L() ->
      case io:get_line("") of
        eof -> init:stop();
        {error, _} -> init:stop();
        Line ->
          Out = try
              {ok, Tokens, _} = erl_scan:string(Line),
              {ok, Exprs} = erl_parse:parse_exprs(Tokens),
              case rpc:call(Node, erl_eval, exprs, [Exprs, erl_eval:new_bindings()], 60000) of
                {value, V, _} -> io_lib:format("~tp", [V]);
                Other -> io_lib:format("!failed ~tp", [Other])
              end
            catch C:E -> io_lib:format("!failed ~tp", [{C, E}])
            end,
          io:format("~ts~n.end~n", [Out]),
          L()
      end
    end,
    Loop()
end.
"#;

struct Shell {
    _child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// `None` before the first query; `Some(None)` once starting failed (every later query goes to `rabbitmqctl`).
static SHELL: Mutex<Option<Option<Shell>>> = Mutex::new(None);

fn start() -> Option<Shell> {
    let host = Command::new("hostname")
        .arg("-s")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let nodes = std::env::var("INBOXCTL_TEST_RABBIT_NODE")
        .unwrap_or_else(|_| format!("rabbit@localhost rabbit@{host}"));
    start_for(&nodes)
}

/// A node of the process's own, evaluating on the first of `nodes` (names, by spaces) that answers.
fn start_for(nodes: &str) -> Option<Shell> {
    let cookie = ["/var/lib/rabbitmq/.erlang.cookie"]
        .into_iter()
        .map(std::path::PathBuf::from)
        .chain(std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".erlang.cookie")))
        .find_map(|p| std::fs::read_to_string(p).ok())?;
    let name = format!(
        "inboxctl_tests_{}_{}@localhost",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    );
    let mut child = Command::new("erl")
        .args(["-sname", &name, "-hidden", "-noshell"])
        .args(["-eval", LOOP])
        // Through the environment, not the command line, which every local user can read.
        .env("ERL_FLAGS", format!("-setcookie {}", cookie.trim()))
        .env("INBOXCTL_RABBIT_NODES", nodes)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let stdin = child.stdin.take()?;
    let mut stdout = BufReader::new(child.stdout.take()?);
    let mut first = String::new();
    stdout.read_line(&mut first).ok()?;
    if first.trim() != "ready" {
        let _ = child.kill();
        let _ = child.wait();
        return None;
    }
    Some(Shell {
        _child: child,
        stdin,
        stdout,
    })
}

impl Shell {
    /// What the node answered to `expression` (`!failed …` when it failed there, or the node is down); `None` when
    /// the shell itself is gone.
    fn ask(&mut self, expression: &str) -> Option<String> {
        let line = format!("{}\n", expression.replace(['\n', '\r'], " "));
        self.stdin
            .write_all(line.as_bytes())
            .and_then(|()| self.stdin.flush())
            .ok()?;
        let mut out = String::new();
        loop {
            let mut line = String::new();
            match self.stdout.read_line(&mut line) {
                Ok(0) | Err(_) => return None,
                Ok(_) if line == ".end\n" => return Some(out),
                Ok(_) => out.push_str(&line),
            }
        }
    }
}

/// What `rabbitmqctl -q eval <expression>` prints, from the process's own node; `None` when there is none (the
/// caller then asks `rabbitmqctl`). An expression that fails on the broker panics, as `rabbitmqctl` failing does.
pub fn eval(expression: &str) -> Option<String> {
    let mut shell = SHELL.lock().unwrap_or_else(|e| e.into_inner());
    if shell.is_none() {
        *shell = Some(start());
    }
    let running = shell.as_mut().unwrap().as_mut()?;
    let Some(out) = running.ask(expression) else {
        *shell = Some(None);
        return None;
    };
    assert!(
        !out.starts_with("!failed"),
        "eval on the broker's node failed: {expression}\n{out}"
    );
    Some(out)
}

/// A node of the process's own for one broker node of a test's (a private node), asked as [`eval`] asks the shared
/// broker's: started at the first question, and kept; the broker node may stop and start again meanwhile.
pub struct Remote {
    node: String,
    shell: Mutex<Option<Option<Shell>>>,
}

impl Remote {
    pub fn new(node: &str) -> Self {
        Self {
            node: node.to_owned(),
            shell: Mutex::new(None),
        }
    }

    /// What the broker node answers to `expression`: `Err` when the expression failed there or the node is down
    /// (`!failed …`), or when no node of the process's own could be started (then ask `rabbitmqctl`).
    pub fn eval(&self, expression: &str) -> Result<String, String> {
        let mut shell = self.shell.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(*shell, Some(Some(_))) {
            // Not yet, or the node was down when last tried: tried again.
            *shell = Some(start_for(&self.node));
        }
        let Some(running) = shell.as_mut().unwrap().as_mut() else {
            return Err(format!("no node answering as {}", self.node));
        };
        match running.ask(expression) {
            Some(out) if out.starts_with("!failed") => Err(out),
            Some(out) => Ok(out),
            None => {
                *shell = None;
                Err(format!("the shell for {} ended", self.node))
            }
        }
    }
}

/// An Erlang expression for the binary of `text`'s bytes: no quoting to get wrong, whatever the name holds.
pub fn binary(text: &str) -> String {
    let bytes: Vec<String> = text.bytes().map(|b| b.to_string()).collect();
    format!("<<{}>>", bytes.join(","))
}
