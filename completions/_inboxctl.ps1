
using namespace System.Management.Automation
using namespace System.Management.Automation.Language

Register-ArgumentCompleter -Native -CommandName 'inboxctl' -ScriptBlock {
    param($wordToComplete, $commandAst, $cursorPosition)

    $commandElements = $commandAst.CommandElements
    $command = @(
        'inboxctl'
        for ($i = 1; $i -lt $commandElements.Count; $i++) {
            $element = $commandElements[$i]
            if ($element -isnot [StringConstantExpressionAst] -or
                $element.StringConstantType -ne [StringConstantType]::BareWord -or
                $element.Value.StartsWith('-') -or
                $element.Value -eq $wordToComplete) {
                break
        }
        $element.Value
    }) -join ';'

    $completions = @(switch ($command) {
        'inboxctl' {
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('migrate', 'migrate', [CompletionResultType]::ParameterValue, 'Apply the inbox schema (creates the database if needed; safe to repeat, safe to run twice at once)')
            [CompletionResult]::new('consume', 'consume', [CompletionResultType]::ParameterValue, 'Run a Parcel Tracker consumer in the foreground, exactly once per (message id, consumer_type)')
            [CompletionResult]::new('cleanup', 'cleanup', [CompletionResultType]::ParameterValue, 'Purge processed inbox rows older than the retention window, in small batches (never an unprocessed row)')
            [CompletionResult]::new('replay', 'replay', [CompletionResultType]::ParameterValue, 'Move dead-lettered messages back to the queue they failed on, safely (the inbox absorbs what was done)')
            [CompletionResult]::new('find', 'find', [CompletionResultType]::ParameterValue, 'Everything known about messages, by id: inbox rows, events, effects, copies in dead-letter queues')
            [CompletionResult]::new('failures', 'failures', [CompletionResultType]::ParameterValue, 'A dead-letter queue''s messages grouped by the cause of their failure, as they are now (nothing is taken)')
            [CompletionResult]::new('publish', 'publish', [CompletionResultType]::ParameterValue, 'Publish Parcel Tracker events as MassTransit 8 messages (demos, tests, load)')
            [CompletionResult]::new('top', 'top', [CompletionResultType]::ParameterValue, 'Live dashboard per consumer_type: duplicate rate, unprocessed rows, queues')
            [CompletionResult]::new('stats', 'stats', [CompletionResultType]::ParameterValue, 'Per consumer_type: inbox rows, unprocessed rows, duplicate rate, queues — once, as a table or JSON')
            [CompletionResult]::new('demo', 'demo', [CompletionResultType]::ParameterValue, 'The whole story in one command: migrate, publish with duplicates, consume, count the effects')
            [CompletionResult]::new('effects', 'effects', [CompletionResultType]::ParameterValue, 'Calls to the outside world not done (owed, in doubt, failed), and settling them')
            [CompletionResult]::new('audit', 'audit', [CompletionResultType]::ParameterValue, 'The operator actions that changed state (migrate, cleanup, replay, consume), who did them and what came of it')
            [CompletionResult]::new('carrier-stub', 'carrier-stub', [CompletionResultType]::ParameterValue, 'A stand-in carrier API on HTTP for demos and tests: books pickup slots, counts them, misbehaves on request')
            [CompletionResult]::new('completions', 'completions', [CompletionResultType]::ParameterValue, 'Print a shell completion script (bash, zsh, fish, elvish, powershell)')
            [CompletionResult]::new('help', 'help', [CompletionResultType]::ParameterValue, 'Print this message or the help of the given subcommand(s)')
            break
        }
        'inboxctl;migrate' {
            [CompletionResult]::new('--partitioned', '--partitioned', [CompletionResultType]::ParameterName, 'Partition inbox_messages by range, one partition per this interval (1h to 31d), on a time every copy of a message carries (--partition-time), so that cleanup drops whole partitions instead of deleting rows. An existing inbox_messages is converted in place: its rows are not copied, and consumers go on (docs/scaling.md)')
            [CompletionResult]::new('--partition-time', '--partition-time', [CompletionResultType]::ParameterName, 'The time a partitioned inbox keys each message on: one that every copy of it carries. Chosen once: it cannot be changed afterwards')
            [CompletionResult]::new('--partition-back', '--partition-back', [CompletionResultType]::ParameterName, 'How far back the conversion of an inbox makes partitions: at least the cleanup''s --retention, so that a message of an older time (waiting in an error queue, say) can still be claimed. Taken only at the conversion; a partition is never made before the oldest one after it (a cleanup may have dropped it). 7d (the default) to 3650d: less would leave messages of the last week unclaimable for good')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--dry-run', '--dry-run', [CompletionResultType]::ParameterName, 'Show what would be created and run, SQL included, and change nothing')
            [CompletionResult]::new('--new-inbox', '--new-inbox', [CompletionResultType]::ParameterName, 'Make a new inbox on the search path even though another schema of the database holds an inbox_messages (refused without: that one may be a service''s, which a new one would take the place of)')
            [CompletionResult]::new('--json', '--json', [CompletionResultType]::ParameterName, 'Print the result as JSON')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help (see more with ''--help'')')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help (see more with ''--help'')')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;consume' {
            [CompletionResult]::new('--queue', '--queue', [CompletionResultType]::ParameterName, 'The queue to read (default: parcel-created-carrier or parcel-created-notification)')
            [CompletionResult]::new('--exchange', '--exchange', [CompletionResultType]::ParameterName, 'The exchange the event is published to; the queue is bound to it through an exchange of its own name')
            [CompletionResult]::new('--queue-type', '--queue-type', [CompletionResultType]::ParameterName, 'What the queue and its <queue>_error and <queue>_skipped are declared as where they do not exist (an existing queue is used as it is)')
            [CompletionResult]::new('--consumer-type', '--consumer-type', [CompletionResultType]::ParameterName, 'The deduplication scope written to inbox_messages.consumer_type (default: the queue name, as the .NET tutorial does, so inboxctl can take over a queue from a .NET consumer without reprocessing)')
            [CompletionResult]::new('--prefetch', '--prefetch', [CompletionResultType]::ParameterName, 'Deliveries the broker may send ahead of acknowledgements')
            [CompletionResult]::new('--concurrency', '--concurrency', [CompletionResultType]::ParameterName, 'Messages processed at once')
            [CompletionResult]::new('--pool-size', '--pool-size', [CompletionResultType]::ParameterName, 'Most PostgreSQL connections (default: --concurrency)')
            [CompletionResult]::new('--max-attempts', '--max-attempts', [CompletionResultType]::ParameterName, 'Attempts of a message whose processing fails, before it moves to <queue>_error')
            [CompletionResult]::new('--retry-delay', '--retry-delay', [CompletionResultType]::ParameterName, 'Delay before the second attempt; doubles for each further one, up to 30s (so at most 30s itself)')
            [CompletionResult]::new('--claim-timeout', '--claim-timeout', [CompletionResultType]::ParameterName, 'How long a copy waits for another process''s in-flight attempt at the same message before it backs off (from 100ms to 24 days)')
            [CompletionResult]::new('--attempt-timeout', '--attempt-timeout', [CompletionResultType]::ParameterName, 'How long one attempt at a message (a batch, batched) may take before it is given up: its connection is dropped and the message tried again, not counted against it (twice in a row, with PostgreSQL then answering, it is: the work is slow or stuck on that message). Bounds a connection that died without a word (a host lost, a network cut), which would otherwise hold its message until the kernel''s TCP timeout; the server also ends a consumer''s session idle inside a transaction for this long. Longer than --claim-timeout (plus, with --effect-mode keyed, --carrier-timeout and its connect timeout for each member of a batch) [default: 30s more than that, 60s with the other defaults]')
            [CompletionResult]::new('--exit-when-idle', '--exit-when-idle', [CompletionResultType]::ParameterName, 'End once nothing arrived and nothing was in flight for this long, the queue is empty and no call to the carrier is owed (scripts, tests)')
            [CompletionResult]::new('--shutdown-timeout', '--shutdown-timeout', [CompletionResultType]::ParameterName, 'After SIGINT/SIGTERM, how long in-flight messages may take; past it they are rolled back and redelivered')
            [CompletionResult]::new('--broker-timeout', '--broker-timeout', [CompletionResultType]::ParameterName, 'How long any call to RabbitMQ may take (an ack or nack, a dead-letter copy''s confirm, setting a connection up); past it the connection is dropped and opened again, and what was not settled comes back as duplicates. A dead-letter copy the broker blocks (a memory or disk alarm) may wait for the alarm to end, in at most half the workers (on a partition queue, always)')
            [CompletionResult]::new('--batch-size', '--batch-size', [CompletionResultType]::ParameterName, 'Up to this many deliveries share one transaction, their effects written together (1: one transaction per message). At most 64')
            [CompletionResult]::new('--batch-wait', '--batch-wait', [CompletionResultType]::ParameterName, 'How long a batch waits to fill, only while another batch is running (a lone message never waits)')
            [CompletionResult]::new('--poison-after', '--poison-after', [CompletionResultType]::ParameterName, 'A redelivered message that started this many times without an outcome, each start ending the consumer process (an abort, a crash, a kill), goes to <queue>_error at its next delivery')
            [CompletionResult]::new('--on-conflict', '--on-conflict', [CompletionResultType]::ParameterName, 'What to do with a message whose id was processed before for another event (a producer reusing ids): it is never processed, and always counted and logged as a conflict; dead-letter moves it to <queue>_error for a look, discard drops it like a duplicate')
            [CompletionResult]::new('--metrics-addr', '--metrics-addr', [CompletionResultType]::ParameterName, 'Serve Prometheus metrics on /metrics and a health check on /health at this address (e.g. 127.0.0.1:9464)')
            [CompletionResult]::new('--partitions', '--partitions', [CompletionResultType]::ParameterName, 'Spread the queue over this many partition queues (<queue>.0 …) fed by a consistent-hash exchange (<queue>.partitions) on the routing key, each read by one active consumer one message at a time: messages of one key are processed in the order they were published, N keys at once. Needs --partition-key')
            [CompletionResult]::new('--partition-key', '--partition-key', [CompletionResultType]::ParameterName, 'The message field publishers set as the routing key (e.g. parcelId): the consumer checks each message against it and says when a publisher did not')
            [CompletionResult]::new('--fail-destination', '--fail-destination', [CompletionResultType]::ParameterName, 'Make the stand-in carrier (or SMS gateway) fail every call for parcels to this destination, like an API that is down: shows retries and the error queue')
            [CompletionResult]::new('--carrier-url', '--carrier-url', [CompletionResultType]::ParameterName, 'Book pickups with the carrier''s HTTP API at this base URL (POST <url>/pickups, with an Idempotency-Key) instead of the stand-in that writes a row. Carrier consumer only')
            [CompletionResult]::new('--carrier-timeout', '--carrier-timeout', [CompletionResultType]::ParameterName, 'The longest a call to the carrier may take, its answer included')
            [CompletionResult]::new('--carrier-connect-timeout', '--carrier-connect-timeout', [CompletionResultType]::ParameterName, 'The longest connecting to the carrier may take')
            [CompletionResult]::new('--effect-mode', '--effect-mode', [CompletionResultType]::ParameterName, 'How the call to the carrier is made (see the README''s "Effects outside the database")')
            [CompletionResult]::new('--effect-key-ttl', '--effect-key-ttl', [CompletionResultType]::ParameterName, 'How long the carrier keeps idempotency keys: `replay` warns about messages older than this (keyed), and an after-commit call whose outcome is unknown is not sent again once its key is this old, but put in doubt')
            [CompletionResult]::new('--effect-lease', '--effect-lease', [CompletionResultType]::ParameterName, 'How long a process holds an effect while it calls (after-commit, at-most-once): past it, another process may take the effect over. Longer than --carrier-timeout plus --carrier-connect-timeout')
            [CompletionResult]::new('--lookup-url', '--lookup-url', [CompletionResultType]::ParameterName, 'after-commit: where to ask the carrier what it booked under a key (GET <url>/pickups/by-key/{key}) before calling again for an effect whose earlier call has an unknown outcome; without it, such a call is made again')
            [CompletionResult]::new('--lookup-quiet', '--lookup-quiet', [CompletionResultType]::ParameterName, 'With --lookup-url: how long a call whose outcome is unknown (a timeout, a gateway''s 504, a crash) is left alone before the look-up is asked. The carrier may still be at work on a request whose answer never came; a look-up before it books answers 404 and the call is made again. At least how long the carrier may go on with a request its caller gave up on')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help (see more with ''--help'')')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help (see more with ''--help'')')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;cleanup' {
            [CompletionResult]::new('--retention', '--retention', [CompletionResultType]::ParameterName, 'Keep processed rows this long (e.g. 90m, 36h, 7d; from 1m, or shorter with --force, to 100y): a copy of a message is recognised as a duplicate only while its row exists, so make it longer than any redelivery or replay can come late')
            [CompletionResult]::new('--dlq', '--dlq', [CompletionResultType]::ParameterName, 'A dead-letter-exchange queue to look at besides each consumer_type''s <queue>_error and <queue>_skipped (repeatable): a message in it that failed before the cutoff keeps the rows of every consumer_type')
            [CompletionResult]::new('--broker-timeout', '--broker-timeout', [CompletionResultType]::ParameterName, 'How long any call to RabbitMQ may wait for its answer while the cleanup looks at dead-letter queues (a count, a take, a mark); past it the cleanup fails, saying so, and deletes nothing')
            [CompletionResult]::new('--audit-retention', '--audit-retention', [CompletionResultType]::ParameterName, 'Keep the audit''s rows (inboxctl audit) this long, from 1d; they are deleted only with this retention of their own')
            [CompletionResult]::new('--detach-wait', '--detach-wait', [CompletionResultType]::ParameterName, 'How long dropping a partition of a partitioned inbox waits for the transactions that could still see it (a long query, a dump, a session idle in a transaction) before leaving it for the next cleanup')
            [CompletionResult]::new('--consumer-type', '--consumer-type', [CompletionResultType]::ParameterName, 'Only this consumer_type (default: every one)')
            [CompletionResult]::new('--batch-size', '--batch-size', [CompletionResultType]::ParameterName, 'Rows per DELETE; each batch is a short transaction of its own')
            [CompletionResult]::new('--batch-pause', '--batch-pause', [CompletionResultType]::ParameterName, 'Rest between batches (e.g. 50ms), to leave the database room')
            [CompletionResult]::new('--every', '--every', [CompletionResultType]::ParameterName, 'Keep running and clean on this schedule (e.g. 1h), as a sidecar or where there is no cron')
            [CompletionResult]::new('--metrics-addr', '--metrics-addr', [CompletionResultType]::ParameterName, 'With --every: serve Prometheus metrics on /metrics and a health check on /health at this address')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--force', '--force', [CompletionResultType]::ParameterName, 'Clean even where it shortens the deduplication window: accept a --retention under 1m, and clean consumer_types whose dead-letter queues hold a message that failed before the cutoff (its replay would then be processed again)')
            [CompletionResult]::new('--dry-run', '--dry-run', [CompletionResultType]::ParameterName, 'Count what would be deleted; delete nothing')
            [CompletionResult]::new('--json', '--json', [CompletionResultType]::ParameterName, 'Print the result as JSON (one line per run)')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;replay' {
            [CompletionResult]::new('--from', '--from', [CompletionResultType]::ParameterName, 'The dead-letter queue: a MassTransit <queue>_error or <queue>_skipped, or a dead-letter-exchange queue')
            [CompletionResult]::new('--to', '--to', [CompletionResultType]::ParameterName, 'Send every message here instead of where its headers say it failed')
            [CompletionResult]::new('--limit', '--limit', [CompletionResultType]::ParameterName, 'Replay at most this many messages')
            [CompletionResult]::new('--message-id', '--message-id', [CompletionResultType]::ParameterName, 'Only this message id (repeatable)')
            [CompletionResult]::new('--reason', '--reason', [CompletionResultType]::ParameterName, 'Only messages whose failure reason contains this text')
            [CompletionResult]::new('--max-replays', '--max-replays', [CompletionResultType]::ParameterName, 'Leave messages that were already replayed this many times')
            [CompletionResult]::new('--retention', '--retention', [CompletionResultType]::ParameterName, 'The inbox cleanup''s retention: a message that failed longer ago may have lost its inbox row, so replaying it could repeat its effect; such messages are left where they are')
            [CompletionResult]::new('--group', '--group', [CompletionResultType]::ParameterName, 'Only the members of this failure group (its fingerprint, or a unique prefix), as the listing of --listing holds them: messages of its cause that arrived since are left, and members gone since are reported')
            [CompletionResult]::new('--listing', '--listing', [CompletionResultType]::ParameterName, 'The listing `inboxctl failures --from <queue> --output <file>` wrote, which --group chooses from')
            [CompletionResult]::new('--rate', '--rate', [CompletionResultType]::ParameterName, 'Republish at most this many messages a second, so that a large replay does not flood the consumers')
            [CompletionResult]::new('--confirm-above', '--confirm-above', [CompletionResultType]::ParameterName, 'On a terminal, ask before replaying more than this many messages, showing the count and the groups')
            [CompletionResult]::new('--reconnect-timeout', '--reconnect-timeout', [CompletionResultType]::ParameterName, 'After a lost connection, how long to keep connecting again to go on (0: stop at once, saying what was done)')
            [CompletionResult]::new('--broker-timeout', '--broker-timeout', [CompletionResultType]::ParameterName, 'How long any call to RabbitMQ may wait for its answer (a copy''s confirm, a get, an ack); past it the connection is given up and made again as after a loss (--reconnect-timeout), and what it held goes back to the dead-letter queue. On a connection the broker blocks (a memory or disk alarm) the replay stops instead')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--include-expired', '--include-expired', [CompletionResultType]::ParameterName, 'Replay messages that failed before the retention window too')
            [CompletionResult]::new('--restore-expiration', '--restore-expiration', [CompletionResultType]::ParameterName, 'Give each copy back the per-message TTL (expiration) it had before it was dead-lettered; by default a replayed copy has none, so that it cannot expire on its way back')
            [CompletionResult]::new('-y', '-y', [CompletionResultType]::ParameterName, 'Do not ask (for scripts run on a terminal; without a terminal nothing is asked)')
            [CompletionResult]::new('--yes', '--yes', [CompletionResultType]::ParameterName, 'Do not ask (for scripts run on a terminal; without a terminal nothing is asked)')
            [CompletionResult]::new('--dry-run', '--dry-run', [CompletionResultType]::ParameterName, 'List what would be replayed; move nothing (the broker marks inspected messages redelivered)')
            [CompletionResult]::new('--json', '--json', [CompletionResultType]::ParameterName, 'Print the result as JSON')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;find' {
            [CompletionResult]::new('--dlq', '--dlq', [CompletionResultType]::ParameterName, 'A dead-letter-exchange queue to look in too, beside each known consumer_type''s <queue>_error and <queue>_skipped (repeatable)')
            [CompletionResult]::new('--limit', '--limit', [CompletionResultType]::ParameterName, 'Look at no more than this many messages per dead-letter queue (the oldest)')
            [CompletionResult]::new('--broker-timeout', '--broker-timeout', [CompletionResultType]::ParameterName, 'How long any call to RabbitMQ may wait for its answer (a count, a take, a mark); past it the look fails, saying so, and what it held goes back')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--json', '--json', [CompletionResultType]::ParameterName, 'Print the result as JSON')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;failures' {
            [CompletionResult]::new('--from', '--from', [CompletionResultType]::ParameterName, 'The dead-letter queue: a MassTransit <queue>_error or <queue>_skipped, or a dead-letter-exchange queue')
            [CompletionResult]::new('--limit', '--limit', [CompletionResultType]::ParameterName, 'Look at no more than this many messages (the oldest)')
            [CompletionResult]::new('--output', '--output', [CompletionResultType]::ParameterName, 'Write the listing, with every member''s message id, to this file: `replay --group <fingerprint> --listing <file>` replays exactly those members')
            [CompletionResult]::new('--broker-timeout', '--broker-timeout', [CompletionResultType]::ParameterName, 'How long any call to RabbitMQ may wait for its answer (a count, a take, a mark); past it the look fails, saying so, and what it held goes back')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--json', '--json', [CompletionResultType]::ParameterName, 'Print the listing as JSON (without the member ids; --output has them)')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;publish' {
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('parcel-created', 'parcel-created', [CompletionResultType]::ParameterValue, 'ParcelTracker.Domain.Events.ParcelCreatedEvent, one per new parcel')
            [CompletionResult]::new('help', 'help', [CompletionResultType]::ParameterValue, 'Print this message or the help of the given subcommand(s)')
            break
        }
        'inboxctl;publish;parcel-created' {
            [CompletionResult]::new('--count', '--count', [CompletionResultType]::ParameterName, 'How many parcels, at most 1000000 (each is held until the broker confirmed it)')
            [CompletionResult]::new('--duplicates', '--duplicates', [CompletionResultType]::ParameterName, 'Fraction of them published twice with the same message id (half at once, half after the rest), 0 to 1')
            [CompletionResult]::new('--rate', '--rate', [CompletionResultType]::ParameterName, 'Messages per second, copies included, from 0.001 to 1000000 (default: as fast as the broker confirms)')
            [CompletionResult]::new('--destination', '--destination', [CompletionResultType]::ParameterName, 'Every parcel''s destination (default: a rotation of cities)')
            [CompletionResult]::new('--id-kind', '--id-kind', [CompletionResultType]::ParameterName, 'The kind of message ids: MassTransit''s NewId (what a MassTransit publisher sends), UUIDv7 (time first) or random v4')
            [CompletionResult]::new('--events-per-parcel', '--events-per-parcel', [CompletionResultType]::ParameterName, 'Events per parcel, published one after another, each with its own message id (what a partitioned consumer keeps in order); --count counts parcels')
            [CompletionResult]::new('--partition-key', '--partition-key', [CompletionResultType]::ParameterName, 'Set each message''s routing key to this field of the event (what a consistent-hash exchange spreads on, see consume --partitions); default: no routing key, as MassTransit publishes')
            [CompletionResult]::new('--exchange', '--exchange', [CompletionResultType]::ParameterName, 'The exchange to publish to')
            [CompletionResult]::new('--reconnect-timeout', '--reconnect-timeout', [CompletionResultType]::ParameterName, 'After a lost connection, how long to keep connecting again to send the unconfirmed rest (0: fail at once)')
            [CompletionResult]::new('--broker-timeout', '--broker-timeout', [CompletionResultType]::ParameterName, 'How long any call to RabbitMQ may wait for its answer (a publish or its confirm); past it the connection is given up and made again as after a loss, and what was not confirmed is sent again. On a connection the broker blocks (a memory or disk alarm) it stops instead, saying how many copies were confirmed')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--json', '--json', [CompletionResultType]::ParameterName, 'Print the result as JSON')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;publish;help' {
            [CompletionResult]::new('parcel-created', 'parcel-created', [CompletionResultType]::ParameterValue, 'ParcelTracker.Domain.Events.ParcelCreatedEvent, one per new parcel')
            [CompletionResult]::new('help', 'help', [CompletionResultType]::ParameterValue, 'Print this message or the help of the given subcommand(s)')
            break
        }
        'inboxctl;publish;help;parcel-created' {
            break
        }
        'inboxctl;publish;help;help' {
            break
        }
        'inboxctl;top' {
            [CompletionResult]::new('--interval', '--interval', [CompletionResultType]::ParameterName, 'How often the figures are refreshed (from 100ms to 100y)')
            [CompletionResult]::new('--window', '--window', [CompletionResultType]::ParameterName, 'Rates are averages over this last stretch of time (from 1s to 100y)')
            [CompletionResult]::new('--retention', '--retention', [CompletionResultType]::ParameterName, 'The cleanup''s retention: an error queue''s oldest message nearing it is flagged (its replay needs its inbox row)')
            [CompletionResult]::new('--alert-duplicates', '--alert-duplicates', [CompletionResultType]::ParameterName, 'Highlight a duplicate ratio above this, in percent')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--read-only', '--read-only', [CompletionResultType]::ParameterName, 'Look only: the detail view''s replay (r) is off')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;stats' {
            [CompletionResult]::new('--window', '--window', [CompletionResultType]::ParameterName, 'Rates are averages over this last stretch of time (from 1s to 100y)')
            [CompletionResult]::new('--retention', '--retention', [CompletionResultType]::ParameterName, 'The cleanup''s retention: an error queue''s oldest message nearing it is flagged (its replay needs its inbox row)')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--json', '--json', [CompletionResultType]::ParameterName, 'Print JSON (the shape is documented in docs/commands.md and stable)')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;demo' {
            [CompletionResult]::new('--parcels', '--parcels', [CompletionResultType]::ParameterName, 'Parcels to register (one ParcelCreatedEvent each)')
            [CompletionResult]::new('--duplicates', '--duplicates', [CompletionResultType]::ParameterName, 'Fraction of the events delivered twice (the same message id again), 0 to 1')
            [CompletionResult]::new('--carrier', '--carrier', [CompletionResultType]::ParameterName, 'The carrier the carrier consumer books with: the stand-in that writes a row, or the stand-in carrier API on HTTP, started in this process on loopback and called keyed (the JSON line then adds the bookings it counted)')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help (see more with ''--help'')')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help (see more with ''--help'')')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;effects' {
            [CompletionResult]::new('--consumer-type', '--consumer-type', [CompletionResultType]::ParameterName, 'Only this consumer_type''s')
            [CompletionResult]::new('--limit', '--limit', [CompletionResultType]::ParameterName, 'At most this many, the oldest first')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--in-doubt', '--in-doubt', [CompletionResultType]::ParameterName, 'Only the effects in doubt: the call may or may not have been made (at-most-once)')
            [CompletionResult]::new('--pending', '--pending', [CompletionResultType]::ParameterName, 'Only the effects owed: not called yet, or being called')
            [CompletionResult]::new('--failed', '--failed', [CompletionResultType]::ParameterName, 'Only the effects that failed every attempt')
            [CompletionResult]::new('--json', '--json', [CompletionResultType]::ParameterName, 'Print them as JSON')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('resolve', 'resolve', [CompletionResultType]::ParameterValue, 'Settle one effect after checking with the carrier: --done (it was made) or --retry (it was not: make it again)')
            [CompletionResult]::new('reconcile', 'reconcile', [CompletionResultType]::ParameterValue, 'Ask the carrier what it booked under each unknown effect''s key and settle it: done with the slot found, or pending (made again by a consumer) when the carrier has none')
            [CompletionResult]::new('help', 'help', [CompletionResultType]::ParameterValue, 'Print this message or the help of the given subcommand(s)')
            break
        }
        'inboxctl;effects;resolve' {
            [CompletionResult]::new('--consumer-type', '--consumer-type', [CompletionResultType]::ParameterName, 'Its consumer_type (needed when the message has effects for several)')
            [CompletionResult]::new('--reference', '--reference', [CompletionResultType]::ParameterName, 'The carrier''s reference for it (e.g. the slot id), kept with it')
            [CompletionResult]::new('--quiet-for', '--quiet-for', [CompletionResultType]::ParameterName, 'With --retry: refused unless the call''s last attempt ended at least this long ago — a request whose answer never came may still be booked by the carrier after you looked')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--done', '--done', [CompletionResultType]::ParameterName, 'The call was made: mark the effect done')
            [CompletionResult]::new('--never-attempted', '--never-attempted', [CompletionResultType]::ParameterName, 'With --done: settle a call no consumer has attempted yet (owed, booked some other way). Refused without: a mistaken message id would mark done a call no one made, and it would never be made')
            [CompletionResult]::new('--retry', '--retry', [CompletionResultType]::ParameterName, 'The call was not made: owe it again (a running consumer makes it)')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;effects;reconcile' {
            [CompletionResult]::new('--lookup-url', '--lookup-url', [CompletionResultType]::ParameterName, 'The carrier''s base URL for look-ups: GET <url>/pickups/by-key/{key}')
            [CompletionResult]::new('--consumer-type', '--consumer-type', [CompletionResultType]::ParameterName, 'Whose calls to settle: the consumer_type whose carrier --lookup-url answers for. Always named: a look-up asked about another carrier''s calls answers 404 for each, and would have them made again')
            [CompletionResult]::new('--timeout', '--timeout', [CompletionResultType]::ParameterName, 'The longest one look-up may take')
            [CompletionResult]::new('--quiet-for', '--quiet-for', [CompletionResultType]::ParameterName, 'Owe a call again on a 404 only when its last attempt ended at least this long ago: the carrier may still be working on a request whose answer never came')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--json', '--json', [CompletionResultType]::ParameterName, 'Print what was done as JSON')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;effects;help' {
            [CompletionResult]::new('resolve', 'resolve', [CompletionResultType]::ParameterValue, 'Settle one effect after checking with the carrier: --done (it was made) or --retry (it was not: make it again)')
            [CompletionResult]::new('reconcile', 'reconcile', [CompletionResultType]::ParameterValue, 'Ask the carrier what it booked under each unknown effect''s key and settle it: done with the slot found, or pending (made again by a consumer) when the carrier has none')
            [CompletionResult]::new('help', 'help', [CompletionResultType]::ParameterValue, 'Print this message or the help of the given subcommand(s)')
            break
        }
        'inboxctl;effects;help;resolve' {
            break
        }
        'inboxctl;effects;help;reconcile' {
            break
        }
        'inboxctl;effects;help;help' {
            break
        }
        'inboxctl;audit' {
            [CompletionResult]::new('--since', '--since', [CompletionResultType]::ParameterName, 'Actions of this last while (e.g. 90m, 24h, 30d)')
            [CompletionResult]::new('--command', '--command', [CompletionResultType]::ParameterName, 'Only this command''s actions (migrate, cleanup, replay, consume)')
            [CompletionResult]::new('--limit', '--limit', [CompletionResultType]::ParameterName, 'At most this many rows')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--json', '--json', [CompletionResultType]::ParameterName, 'Print the rows as JSON')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;carrier-stub' {
            [CompletionResult]::new('--listen', '--listen', [CompletionResultType]::ParameterName, 'The address to listen on (port 0: one the system chooses); the first line printed is its URL')
            [CompletionResult]::new('--delay', '--delay', [CompletionResultType]::ParameterName, 'Answer this late, after booking')
            [CompletionResult]::new('--delay-destination', '--delay-destination', [CompletionResultType]::ParameterName, 'Only bookings to this destination are answered late')
            [CompletionResult]::new('--fail-next', '--fail-next', [CompletionResultType]::ParameterName, 'Answer 503 to this many requests, booking nothing')
            [CompletionResult]::new('--drop-next', '--drop-next', [CompletionResultType]::ParameterName, 'Book, then drop the connection without answering, for this many requests')
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--ignore-keys', '--ignore-keys', [CompletionResultType]::ParameterName, 'Book again for a repeated Idempotency-Key, as a carrier that does not honour keys does')
            [CompletionResult]::new('--fail-always', '--fail-always', [CompletionResultType]::ParameterName, 'Answer 503 to every request')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;completions' {
            [CompletionResult]::new('--database-url', '--database-url', [CompletionResultType]::ParameterName, 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])')
            [CompletionResult]::new('--amqp-url', '--amqp-url', [CompletionResultType]::ParameterName, 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node')
            [CompletionResult]::new('--database-password-file', '--database-password-file', [CompletionResultType]::ParameterName, 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-password-file', '--amqp-password-file', [CompletionResultType]::ParameterName, 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment')
            [CompletionResult]::new('--amqp-ca-file', '--amqp-ca-file', [CompletionResultType]::ParameterName, 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)')
            [CompletionResult]::new('--log-format', '--log-format', [CompletionResultType]::ParameterName, 'Log line format on stderr')
            [CompletionResult]::new('--transaction-pooling', '--transaction-pooling', [CompletionResultType]::ParameterName, 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)')
            [CompletionResult]::new('-v', '-v', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('--verbose', '--verbose', [CompletionResultType]::ParameterName, 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)')
            [CompletionResult]::new('-h', '-h', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('--help', '--help', [CompletionResultType]::ParameterName, 'Print help')
            [CompletionResult]::new('-V', '-V ', [CompletionResultType]::ParameterName, 'Print version')
            [CompletionResult]::new('--version', '--version', [CompletionResultType]::ParameterName, 'Print version')
            break
        }
        'inboxctl;help' {
            [CompletionResult]::new('migrate', 'migrate', [CompletionResultType]::ParameterValue, 'Apply the inbox schema (creates the database if needed; safe to repeat, safe to run twice at once)')
            [CompletionResult]::new('consume', 'consume', [CompletionResultType]::ParameterValue, 'Run a Parcel Tracker consumer in the foreground, exactly once per (message id, consumer_type)')
            [CompletionResult]::new('cleanup', 'cleanup', [CompletionResultType]::ParameterValue, 'Purge processed inbox rows older than the retention window, in small batches (never an unprocessed row)')
            [CompletionResult]::new('replay', 'replay', [CompletionResultType]::ParameterValue, 'Move dead-lettered messages back to the queue they failed on, safely (the inbox absorbs what was done)')
            [CompletionResult]::new('find', 'find', [CompletionResultType]::ParameterValue, 'Everything known about messages, by id: inbox rows, events, effects, copies in dead-letter queues')
            [CompletionResult]::new('failures', 'failures', [CompletionResultType]::ParameterValue, 'A dead-letter queue''s messages grouped by the cause of their failure, as they are now (nothing is taken)')
            [CompletionResult]::new('publish', 'publish', [CompletionResultType]::ParameterValue, 'Publish Parcel Tracker events as MassTransit 8 messages (demos, tests, load)')
            [CompletionResult]::new('top', 'top', [CompletionResultType]::ParameterValue, 'Live dashboard per consumer_type: duplicate rate, unprocessed rows, queues')
            [CompletionResult]::new('stats', 'stats', [CompletionResultType]::ParameterValue, 'Per consumer_type: inbox rows, unprocessed rows, duplicate rate, queues — once, as a table or JSON')
            [CompletionResult]::new('demo', 'demo', [CompletionResultType]::ParameterValue, 'The whole story in one command: migrate, publish with duplicates, consume, count the effects')
            [CompletionResult]::new('effects', 'effects', [CompletionResultType]::ParameterValue, 'Calls to the outside world not done (owed, in doubt, failed), and settling them')
            [CompletionResult]::new('audit', 'audit', [CompletionResultType]::ParameterValue, 'The operator actions that changed state (migrate, cleanup, replay, consume), who did them and what came of it')
            [CompletionResult]::new('carrier-stub', 'carrier-stub', [CompletionResultType]::ParameterValue, 'A stand-in carrier API on HTTP for demos and tests: books pickup slots, counts them, misbehaves on request')
            [CompletionResult]::new('completions', 'completions', [CompletionResultType]::ParameterValue, 'Print a shell completion script (bash, zsh, fish, elvish, powershell)')
            [CompletionResult]::new('help', 'help', [CompletionResultType]::ParameterValue, 'Print this message or the help of the given subcommand(s)')
            break
        }
        'inboxctl;help;migrate' {
            break
        }
        'inboxctl;help;consume' {
            break
        }
        'inboxctl;help;cleanup' {
            break
        }
        'inboxctl;help;replay' {
            break
        }
        'inboxctl;help;find' {
            break
        }
        'inboxctl;help;failures' {
            break
        }
        'inboxctl;help;publish' {
            [CompletionResult]::new('parcel-created', 'parcel-created', [CompletionResultType]::ParameterValue, 'ParcelTracker.Domain.Events.ParcelCreatedEvent, one per new parcel')
            break
        }
        'inboxctl;help;publish;parcel-created' {
            break
        }
        'inboxctl;help;top' {
            break
        }
        'inboxctl;help;stats' {
            break
        }
        'inboxctl;help;demo' {
            break
        }
        'inboxctl;help;effects' {
            [CompletionResult]::new('resolve', 'resolve', [CompletionResultType]::ParameterValue, 'Settle one effect after checking with the carrier: --done (it was made) or --retry (it was not: make it again)')
            [CompletionResult]::new('reconcile', 'reconcile', [CompletionResultType]::ParameterValue, 'Ask the carrier what it booked under each unknown effect''s key and settle it: done with the slot found, or pending (made again by a consumer) when the carrier has none')
            break
        }
        'inboxctl;help;effects;resolve' {
            break
        }
        'inboxctl;help;effects;reconcile' {
            break
        }
        'inboxctl;help;audit' {
            break
        }
        'inboxctl;help;carrier-stub' {
            break
        }
        'inboxctl;help;completions' {
            break
        }
        'inboxctl;help;help' {
            break
        }
    })

    $completions.Where{ $_.CompletionText -like "$wordToComplete*" } |
        Sort-Object -Property ListItemText
}
