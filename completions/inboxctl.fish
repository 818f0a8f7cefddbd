# Print an optspec for argparse to handle cmd's options that are independent of any subcommand.
function __fish_inboxctl_global_optspecs
    string join \n database-url= amqp-url= database-password-file= amqp-password-file= amqp-ca-file= transaction-pooling v/verbose log-format= h/help V/version
end

function __fish_inboxctl_needs_command
    # Figure out if the current invocation already has a command.
    set -l cmd (commandline -opc)
    set -e cmd[1]
    argparse -s (__fish_inboxctl_global_optspecs) -- $cmd 2>/dev/null
    or return
    if set -q argv[1]
        # Also print the command, so this can be used to figure out what it is.
        echo $argv[1]
        return 1
    end
    return 0
end

function __fish_inboxctl_using_subcommand
    set -l cmd (__fish_inboxctl_needs_command)
    test -z "$cmd"
    and return 1
    contains -- $cmd[1] $argv
end

complete -c inboxctl -n "__fish_inboxctl_needs_command" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_needs_command" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_needs_command" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_needs_command" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_needs_command" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_needs_command" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_needs_command" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "migrate" -d 'Apply the inbox schema (creates the database if needed; safe to repeat, safe to run twice at once)'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "consume" -d 'Run a Parcel Tracker consumer in the foreground, exactly once per (message id, consumer_type)'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "cleanup" -d 'Purge processed inbox rows older than the retention window, in small batches (never an unprocessed row)'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "replay" -d 'Move dead-lettered messages back to the queue they failed on, safely (the inbox absorbs what was done)'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "find" -d 'Everything known about messages, by id: inbox rows, events, effects, copies in dead-letter queues'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "failures" -d 'A dead-letter queue\'s messages grouped by the cause of their failure, as they are now (nothing is taken)'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "publish" -d 'Publish Parcel Tracker events as MassTransit 8 messages (demos, tests, load)'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "top" -d 'Live dashboard per consumer_type: duplicate rate, unprocessed rows, queues'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "stats" -d 'Per consumer_type: inbox rows, unprocessed rows, duplicate rate, queues — once, as a table or JSON'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "demo" -d 'The whole story in one command: migrate, publish with duplicates, consume, count the effects'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "effects" -d 'Calls to the outside world not done (owed, in doubt, failed), and settling them'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "audit" -d 'The operator actions that changed state (migrate, cleanup, replay, consume), who did them and what came of it'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "carrier-stub" -d 'A stand-in carrier API on HTTP for demos and tests: books pickup slots, counts them, misbehaves on request'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "completions" -d 'Print a shell completion script (bash, zsh, fish, elvish, powershell)'
complete -c inboxctl -n "__fish_inboxctl_needs_command" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l partitioned -d 'Partition inbox_messages by range, one partition per this interval (1h to 31d), on a time every copy of a message carries (--partition-time), so that cleanup drops whole partitions instead of deleting rows. An existing inbox_messages is converted in place: its rows are not copied, and consumers go on (docs/scaling.md)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l partition-time -d 'The time a partitioned inbox keys each message on: one that every copy of it carries. Chosen once: it cannot be changed afterwards' -r -f -a "id\t'The time inside the message id: UUIDv7, else MassTransit\'s NewId (what MassTransit sends)'
sent-time\t'The envelope\'s sentTime, else the AMQP timestamp: for ids without a time (random v4)'
timestamp\t'The AMQP timestamp property'"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l partition-back -d 'How far back the conversion of an inbox makes partitions: at least the cleanup\'s --retention, so that a message of an older time (waiting in an error queue, say) can still be claimed. Taken only at the conversion; a partition is never made before the oldest one after it (a cleanup may have dropped it). 7d (the default) to 3650d: less would leave messages of the last week unclaimable for good' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l dry-run -d 'Show what would be created and run, SQL included, and change nothing'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l new-inbox -d 'Make a new inbox on the search path even though another schema of the database holds an inbox_messages (refused without: that one may be a service\'s, which a new one would take the place of)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l json -d 'Print the result as JSON'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -s h -l help -d 'Print help (see more with \'--help\')'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand migrate" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l queue -d 'The queue to read (default: parcel-created-carrier or parcel-created-notification)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l exchange -d 'The exchange the event is published to; the queue is bound to it through an exchange of its own name' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l queue-type -d 'What the queue and its <queue>_error and <queue>_skipped are declared as where they do not exist (an existing queue is used as it is)' -r -f -a "classic\t'On one node, as MassTransit declares by default'
quorum\t'Replicated over the cluster\'s nodes; the broker counts each message\'s deliveries'"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l consumer-type -d 'The deduplication scope written to inbox_messages.consumer_type (default: the queue name, as the .NET tutorial does, so inboxctl can take over a queue from a .NET consumer without reprocessing)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l prefetch -d 'Deliveries the broker may send ahead of acknowledgements' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l concurrency -d 'Messages processed at once' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l pool-size -d 'Most PostgreSQL connections (default: --concurrency)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l max-attempts -d 'Attempts of a message whose processing fails, before it moves to <queue>_error' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l retry-delay -d 'Delay before the second attempt; doubles for each further one, up to 30s (so at most 30s itself)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l claim-timeout -d 'How long a copy waits for another process\'s in-flight attempt at the same message before it backs off (from 100ms to 24 days)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l attempt-timeout -d 'How long one attempt at a message (a batch, batched) may take before it is given up: its connection is dropped and the message tried again, not counted against it (twice in a row, with PostgreSQL then answering, it is: the work is slow or stuck on that message). Bounds a connection that died without a word (a host lost, a network cut), which would otherwise hold its message until the kernel\'s TCP timeout; the server also ends a consumer\'s session idle inside a transaction for this long. Longer than --claim-timeout (plus, with --effect-mode keyed, --carrier-timeout and its connect timeout for each member of a batch) [default: 30s more than that, 60s with the other defaults]' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l exit-when-idle -d 'End once nothing arrived and nothing was in flight for this long, the queue is empty and no call to the carrier is owed (scripts, tests)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l shutdown-timeout -d 'After SIGINT/SIGTERM, how long in-flight messages may take; past it they are rolled back and redelivered' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l broker-timeout -d 'How long any call to RabbitMQ may take (an ack or nack, a dead-letter copy\'s confirm, setting a connection up); past it the connection is dropped and opened again, and what was not settled comes back as duplicates. A dead-letter copy the broker blocks (a memory or disk alarm) may wait for the alarm to end, in at most half the workers (on a partition queue, always)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l batch-size -d 'Up to this many deliveries share one transaction, their effects written together (1: one transaction per message). At most 64' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l batch-wait -d 'How long a batch waits to fill, only while another batch is running (a lone message never waits)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l poison-after -d 'A redelivered message that started this many times without an outcome, each start ending the consumer process (an abort, a crash, a kill), goes to <queue>_error at its next delivery' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l on-conflict -d 'What to do with a message whose id was processed before for another event (a producer reusing ids): it is never processed, and always counted and logged as a conflict; dead-letter moves it to <queue>_error for a look, discard drops it like a duplicate' -r -f -a "dead-letter\t'Moved to <queue>_error with the reason, for someone to look at: it is a bug upstream'
discard\t'Acknowledged and dropped, like a duplicate'"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l metrics-addr -d 'Serve Prometheus metrics on /metrics and a health check on /health at this address (e.g. 127.0.0.1:9464)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l partitions -d 'Spread the queue over this many partition queues (<queue>.0 …) fed by a consistent-hash exchange (<queue>.partitions) on the routing key, each read by one active consumer one message at a time: messages of one key are processed in the order they were published, N keys at once. Needs --partition-key' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l partition-key -d 'The message field publishers set as the routing key (e.g. parcelId): the consumer checks each message against it and says when a publisher did not' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l fail-destination -d 'Make the stand-in carrier (or SMS gateway) fail every call for parcels to this destination, like an API that is down: shows retries and the error queue' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l carrier-url -d 'Book pickups with the carrier\'s HTTP API at this base URL (POST <url>/pickups, with an Idempotency-Key) instead of the stand-in that writes a row. Carrier consumer only' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l carrier-timeout -d 'The longest a call to the carrier may take, its answer included' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l carrier-connect-timeout -d 'The longest connecting to the carrier may take' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l effect-mode -d 'How the call to the carrier is made (see the README\'s "Effects outside the database")' -r -f -a "keyed\t'Call inside the claim\'s transaction with the idempotency key; a failure or crash rolls back and the redelivery calls again with the same key. For APIs that honour keys'
after-commit\t'Commit the claim with the call owed, then call (with the key), retrying until done; a process that dies leaves it to the next. Exactly once with keyed APIs, at least once otherwise'
at-most-once\t'Commit the intent, call once, commit the outcome; a call whose outcome is unknown is never made again but listed in doubt (`inboxctl effects --in-doubt`)'"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l effect-key-ttl -d 'How long the carrier keeps idempotency keys: `replay` warns about messages older than this (keyed), and an after-commit call whose outcome is unknown is not sent again once its key is this old, but put in doubt' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l effect-lease -d 'How long a process holds an effect while it calls (after-commit, at-most-once): past it, another process may take the effect over. Longer than --carrier-timeout plus --carrier-connect-timeout' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l lookup-url -d 'after-commit: where to ask the carrier what it booked under a key (GET <url>/pickups/by-key/{key}) before calling again for an effect whose earlier call has an unknown outcome; without it, such a call is made again' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l lookup-quiet -d 'With --lookup-url: how long a call whose outcome is unknown (a timeout, a gateway\'s 504, a crash) is left alone before the look-up is asked. The carrier may still be at work on a request whose answer never came; a look-up before it books answers 404 and the call is made again. At least how long the carrier may go on with a request its caller gave up on' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -s h -l help -d 'Print help (see more with \'--help\')'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand consume" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l retention -d 'Keep processed rows this long (e.g. 90m, 36h, 7d; from 1m, or shorter with --force, to 100y): a copy of a message is recognised as a duplicate only while its row exists, so make it longer than any redelivery or replay can come late' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l dlq -d 'A dead-letter-exchange queue to look at besides each consumer_type\'s <queue>_error and <queue>_skipped (repeatable): a message in it that failed before the cutoff keeps the rows of every consumer_type' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l broker-timeout -d 'How long any call to RabbitMQ may wait for its answer while the cleanup looks at dead-letter queues (a count, a take, a mark); past it the cleanup fails, saying so, and deletes nothing' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l audit-retention -d 'Keep the audit\'s rows (inboxctl audit) this long, from 1d; they are deleted only with this retention of their own' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l detach-wait -d 'How long dropping a partition of a partitioned inbox waits for the transactions that could still see it (a long query, a dump, a session idle in a transaction) before leaving it for the next cleanup' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l consumer-type -d 'Only this consumer_type (default: every one)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l batch-size -d 'Rows per DELETE; each batch is a short transaction of its own' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l batch-pause -d 'Rest between batches (e.g. 50ms), to leave the database room' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l every -d 'Keep running and clean on this schedule (e.g. 1h), as a sidecar or where there is no cron' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l metrics-addr -d 'With --every: serve Prometheus metrics on /metrics and a health check on /health at this address' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l force -d 'Clean even where it shortens the deduplication window: accept a --retention under 1m, and clean consumer_types whose dead-letter queues hold a message that failed before the cutoff (its replay would then be processed again)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l dry-run -d 'Count what would be deleted; delete nothing'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l json -d 'Print the result as JSON (one line per run)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand cleanup" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l from -d 'The dead-letter queue: a MassTransit <queue>_error or <queue>_skipped, or a dead-letter-exchange queue' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l to -d 'Send every message here instead of where its headers say it failed' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l limit -d 'Replay at most this many messages' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l message-id -d 'Only this message id (repeatable)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l reason -d 'Only messages whose failure reason contains this text' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l max-replays -d 'Leave messages that were already replayed this many times' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l retention -d 'The inbox cleanup\'s retention: a message that failed longer ago may have lost its inbox row, so replaying it could repeat its effect; such messages are left where they are' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l group -d 'Only the members of this failure group (its fingerprint, or a unique prefix), as the listing of --listing holds them: messages of its cause that arrived since are left, and members gone since are reported' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l listing -d 'The listing `inboxctl failures --from <queue> --output <file>` wrote, which --group chooses from' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l rate -d 'Republish at most this many messages a second, so that a large replay does not flood the consumers' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l confirm-above -d 'On a terminal, ask before replaying more than this many messages, showing the count and the groups' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l reconnect-timeout -d 'After a lost connection, how long to keep connecting again to go on (0: stop at once, saying what was done)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l broker-timeout -d 'How long any call to RabbitMQ may wait for its answer (a copy\'s confirm, a get, an ack); past it the connection is given up and made again as after a loss (--reconnect-timeout), and what it held goes back to the dead-letter queue. On a connection the broker blocks (a memory or disk alarm) the replay stops instead' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l include-expired -d 'Replay messages that failed before the retention window too'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l restore-expiration -d 'Give each copy back the per-message TTL (expiration) it had before it was dead-lettered; by default a replayed copy has none, so that it cannot expire on its way back'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -s y -l yes -d 'Do not ask (for scripts run on a terminal; without a terminal nothing is asked)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l dry-run -d 'List what would be replayed; move nothing (the broker marks inspected messages redelivered)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l json -d 'Print the result as JSON'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand replay" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -l dlq -d 'A dead-letter-exchange queue to look in too, beside each known consumer_type\'s <queue>_error and <queue>_skipped (repeatable)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -l limit -d 'Look at no more than this many messages per dead-letter queue (the oldest)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -l broker-timeout -d 'How long any call to RabbitMQ may wait for its answer (a count, a take, a mark); past it the look fails, saying so, and what it held goes back' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -l json -d 'Print the result as JSON'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand find" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l from -d 'The dead-letter queue: a MassTransit <queue>_error or <queue>_skipped, or a dead-letter-exchange queue' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l limit -d 'Look at no more than this many messages (the oldest)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l output -d 'Write the listing, with every member\'s message id, to this file: `replay --group <fingerprint> --listing <file>` replays exactly those members' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l broker-timeout -d 'How long any call to RabbitMQ may wait for its answer (a count, a take, a mark); past it the look fails, saying so, and what it held goes back' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l json -d 'Print the listing as JSON (without the member ids; --output has them)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand failures" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -f -a "parcel-created" -d 'ParcelTracker.Domain.Events.ParcelCreatedEvent, one per new parcel'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and not __fish_seen_subcommand_from parcel-created help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l count -d 'How many parcels, at most 1000000 (each is held until the broker confirmed it)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l duplicates -d 'Fraction of them published twice with the same message id (half at once, half after the rest), 0 to 1' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l rate -d 'Messages per second, copies included, from 0.001 to 1000000 (default: as fast as the broker confirms)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l destination -d 'Every parcel\'s destination (default: a rotation of cities)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l id-kind -d 'The kind of message ids: MassTransit\'s NewId (what a MassTransit publisher sends), UUIDv7 (time first) or random v4' -r -f -a "newid\t''
v7\t''
v4\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l events-per-parcel -d 'Events per parcel, published one after another, each with its own message id (what a partitioned consumer keeps in order); --count counts parcels' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l partition-key -d 'Set each message\'s routing key to this field of the event (what a consistent-hash exchange spreads on, see consume --partitions); default: no routing key, as MassTransit publishes' -r -f -a "parcelId\t''
trackingNumber\t''
destination\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l exchange -d 'The exchange to publish to' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l reconnect-timeout -d 'After a lost connection, how long to keep connecting again to send the unconfirmed rest (0: fail at once)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l broker-timeout -d 'How long any call to RabbitMQ may wait for its answer (a publish or its confirm); past it the connection is given up and made again as after a loss, and what was not confirmed is sent again. On a connection the broker blocks (a memory or disk alarm) it stops instead, saying how many copies were confirmed' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l json -d 'Print the result as JSON'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from parcel-created" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from help" -f -a "parcel-created" -d 'ParcelTracker.Domain.Events.ParcelCreatedEvent, one per new parcel'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand publish; and __fish_seen_subcommand_from help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l interval -d 'How often the figures are refreshed (from 100ms to 100y)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l window -d 'Rates are averages over this last stretch of time (from 1s to 100y)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l retention -d 'The cleanup\'s retention: an error queue\'s oldest message nearing it is flagged (its replay needs its inbox row)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l alert-duplicates -d 'Highlight a duplicate ratio above this, in percent' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l read-only -d 'Look only: the detail view\'s replay (r) is off'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand top" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -l window -d 'Rates are averages over this last stretch of time (from 1s to 100y)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -l retention -d 'The cleanup\'s retention: an error queue\'s oldest message nearing it is flagged (its replay needs its inbox row)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -l json -d 'Print JSON (the shape is documented in docs/commands.md and stable)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand stats" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -l parcels -d 'Parcels to register (one ParcelCreatedEvent each)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -l duplicates -d 'Fraction of the events delivered twice (the same message id again), 0 to 1' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -l carrier -d 'The carrier the carrier consumer books with: the stand-in that writes a row, or the stand-in carrier API on HTTP, started in this process on loopback and called keyed (the JSON line then adds the bookings it counted)' -r -f -a "stand-in\t'Writes carrier_reservations in the consumer\'s transaction'
http\t'Books over HTTP with an idempotency key, against a stand-in carrier API on loopback'"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -s h -l help -d 'Print help (see more with \'--help\')'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand demo" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l consumer-type -d 'Only this consumer_type\'s' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l limit -d 'At most this many, the oldest first' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l in-doubt -d 'Only the effects in doubt: the call may or may not have been made (at-most-once)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l pending -d 'Only the effects owed: not called yet, or being called'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l failed -d 'Only the effects that failed every attempt'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l json -d 'Print them as JSON'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -f -a "resolve" -d 'Settle one effect after checking with the carrier: --done (it was made) or --retry (it was not: make it again)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -f -a "reconcile" -d 'Ask the carrier what it booked under each unknown effect\'s key and settle it: done with the slot found, or pending (made again by a consumer) when the carrier has none'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and not __fish_seen_subcommand_from resolve reconcile help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l consumer-type -d 'Its consumer_type (needed when the message has effects for several)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l reference -d 'The carrier\'s reference for it (e.g. the slot id), kept with it' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l quiet-for -d 'With --retry: refused unless the call\'s last attempt ended at least this long ago — a request whose answer never came may still be booked by the carrier after you looked' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l done -d 'The call was made: mark the effect done'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l never-attempted -d 'With --done: settle a call no consumer has attempted yet (owed, booked some other way). Refused without: a mistaken message id would mark done a call no one made, and it would never be made'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l retry -d 'The call was not made: owe it again (a running consumer makes it)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from resolve" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l lookup-url -d 'The carrier\'s base URL for look-ups: GET <url>/pickups/by-key/{key}' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l consumer-type -d 'Whose calls to settle: the consumer_type whose carrier --lookup-url answers for. Always named: a look-up asked about another carrier\'s calls answers 404 for each, and would have them made again' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l timeout -d 'The longest one look-up may take' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l quiet-for -d 'Owe a call again on a 404 only when its last attempt ended at least this long ago: the carrier may still be working on a request whose answer never came' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l json -d 'Print what was done as JSON'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from reconcile" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from help" -f -a "resolve" -d 'Settle one effect after checking with the carrier: --done (it was made) or --retry (it was not: make it again)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from help" -f -a "reconcile" -d 'Ask the carrier what it booked under each unknown effect\'s key and settle it: done with the slot found, or pending (made again by a consumer) when the carrier has none'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand effects; and __fish_seen_subcommand_from help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -l since -d 'Actions of this last while (e.g. 90m, 24h, 30d)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -l command -d 'Only this command\'s actions (migrate, cleanup, replay, consume)' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -l limit -d 'At most this many rows' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -l json -d 'Print the rows as JSON'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand audit" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l listen -d 'The address to listen on (port 0: one the system chooses); the first line printed is its URL' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l delay -d 'Answer this late, after booking' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l delay-destination -d 'Only bookings to this destination are answered late' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l fail-next -d 'Answer 503 to this many requests, booking nothing' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l drop-next -d 'Book, then drop the connection without answering, for this many requests' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l ignore-keys -d 'Book again for a repeated Idempotency-Key, as a carrier that does not honour keys does'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l fail-always -d 'Answer 503 to every request'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand carrier-stub" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand completions" -l database-url -d 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand completions" -l amqp-url -d 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node' -r
complete -c inboxctl -n "__fish_inboxctl_using_subcommand completions" -l database-password-file -d 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand completions" -l amqp-password-file -d 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand completions" -l amqp-ca-file -d 'CA certificate (PEM) an amqps:// broker\'s certificate may chain to, beside the system\'s roots (amqps:// only)' -r -F
complete -c inboxctl -n "__fish_inboxctl_using_subcommand completions" -l log-format -d 'Log line format on stderr' -r -f -a "text\t''
json\t''"
complete -c inboxctl -n "__fish_inboxctl_using_subcommand completions" -l transaction-pooling -d 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer\'s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand completions" -s v -l verbose -d 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand completions" -s h -l help -d 'Print help'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand completions" -s V -l version -d 'Print version'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "migrate" -d 'Apply the inbox schema (creates the database if needed; safe to repeat, safe to run twice at once)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "consume" -d 'Run a Parcel Tracker consumer in the foreground, exactly once per (message id, consumer_type)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "cleanup" -d 'Purge processed inbox rows older than the retention window, in small batches (never an unprocessed row)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "replay" -d 'Move dead-lettered messages back to the queue they failed on, safely (the inbox absorbs what was done)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "find" -d 'Everything known about messages, by id: inbox rows, events, effects, copies in dead-letter queues'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "failures" -d 'A dead-letter queue\'s messages grouped by the cause of their failure, as they are now (nothing is taken)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "publish" -d 'Publish Parcel Tracker events as MassTransit 8 messages (demos, tests, load)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "top" -d 'Live dashboard per consumer_type: duplicate rate, unprocessed rows, queues'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "stats" -d 'Per consumer_type: inbox rows, unprocessed rows, duplicate rate, queues — once, as a table or JSON'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "demo" -d 'The whole story in one command: migrate, publish with duplicates, consume, count the effects'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "effects" -d 'Calls to the outside world not done (owed, in doubt, failed), and settling them'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "audit" -d 'The operator actions that changed state (migrate, cleanup, replay, consume), who did them and what came of it'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "carrier-stub" -d 'A stand-in carrier API on HTTP for demos and tests: books pickup slots, counts them, misbehaves on request'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "completions" -d 'Print a shell completion script (bash, zsh, fish, elvish, powershell)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and not __fish_seen_subcommand_from migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and __fish_seen_subcommand_from publish" -f -a "parcel-created" -d 'ParcelTracker.Domain.Events.ParcelCreatedEvent, one per new parcel'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and __fish_seen_subcommand_from effects" -f -a "resolve" -d 'Settle one effect after checking with the carrier: --done (it was made) or --retry (it was not: make it again)'
complete -c inboxctl -n "__fish_inboxctl_using_subcommand help; and __fish_seen_subcommand_from effects" -f -a "reconcile" -d 'Ask the carrier what it booked under each unknown effect\'s key and settle it: done with the slot found, or pending (made again by a consumer) when the carrier has none'
