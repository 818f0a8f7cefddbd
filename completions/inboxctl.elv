
use builtin;
use str;

set edit:completion:arg-completer[inboxctl] = {|@words|
    fn spaces {|n|
        builtin:repeat $n ' ' | str:join ''
    }
    fn cand {|text desc|
        edit:complex-candidate $text &display=$text' '(spaces (- 14 (wcswidth $text)))$desc
    }
    var command = 'inboxctl'
    for word $words[1..-1] {
        if (str:has-prefix $word '-') {
            break
        }
        set command = $command';'$word
    }
    var completions = [
        &'inboxctl'= {
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
            cand migrate 'Apply the inbox schema (creates the database if needed; safe to repeat, safe to run twice at once)'
            cand consume 'Run a Parcel Tracker consumer in the foreground, exactly once per (message id, consumer_type)'
            cand cleanup 'Purge processed inbox rows older than the retention window, in small batches (never an unprocessed row)'
            cand replay 'Move dead-lettered messages back to the queue they failed on, safely (the inbox absorbs what was done)'
            cand find 'Everything known about messages, by id: inbox rows, events, effects, copies in dead-letter queues'
            cand failures 'A dead-letter queue''s messages grouped by the cause of their failure, as they are now (nothing is taken)'
            cand publish 'Publish Parcel Tracker events as MassTransit 8 messages (demos, tests, load)'
            cand top 'Live dashboard per consumer_type: duplicate rate, unprocessed rows, queues'
            cand stats 'Per consumer_type: inbox rows, unprocessed rows, duplicate rate, queues — once, as a table or JSON'
            cand demo 'The whole story in one command: migrate, publish with duplicates, consume, count the effects'
            cand effects 'Calls to the outside world not done (owed, in doubt, failed), and settling them'
            cand audit 'The operator actions that changed state (migrate, cleanup, replay, consume), who did them and what came of it'
            cand carrier-stub 'A stand-in carrier API on HTTP for demos and tests: books pickup slots, counts them, misbehaves on request'
            cand completions 'Print a shell completion script (bash, zsh, fish, elvish, powershell)'
            cand help 'Print this message or the help of the given subcommand(s)'
        }
        &'inboxctl;migrate'= {
            cand --partitioned 'Partition inbox_messages by range, one partition per this interval (1h to 31d), on a time every copy of a message carries (--partition-time), so that cleanup drops whole partitions instead of deleting rows. An existing inbox_messages is converted in place: its rows are not copied, and consumers go on (docs/scaling.md)'
            cand --partition-time 'The time a partitioned inbox keys each message on: one that every copy of it carries. Chosen once: it cannot be changed afterwards'
            cand --partition-back 'How far back the conversion of an inbox makes partitions: at least the cleanup''s --retention, so that a message of an older time (waiting in an error queue, say) can still be claimed. Taken only at the conversion; a partition is never made before the oldest one after it (a cleanup may have dropped it). 7d (the default) to 3650d: less would leave messages of the last week unclaimable for good'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --dry-run 'Show what would be created and run, SQL included, and change nothing'
            cand --new-inbox 'Make a new inbox on the search path even though another schema of the database holds an inbox_messages (refused without: that one may be a service''s, which a new one would take the place of)'
            cand --json 'Print the result as JSON'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help (see more with ''--help'')'
            cand --help 'Print help (see more with ''--help'')'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;consume'= {
            cand --queue 'The queue to read (default: parcel-created-carrier or parcel-created-notification)'
            cand --exchange 'The exchange the event is published to; the queue is bound to it through an exchange of its own name'
            cand --queue-type 'What the queue and its <queue>_error and <queue>_skipped are declared as where they do not exist (an existing queue is used as it is)'
            cand --consumer-type 'The deduplication scope written to inbox_messages.consumer_type (default: the queue name, as the .NET tutorial does, so inboxctl can take over a queue from a .NET consumer without reprocessing)'
            cand --prefetch 'Deliveries the broker may send ahead of acknowledgements'
            cand --concurrency 'Messages processed at once'
            cand --pool-size 'Most PostgreSQL connections (default: --concurrency)'
            cand --max-attempts 'Attempts of a message whose processing fails, before it moves to <queue>_error'
            cand --retry-delay 'Delay before the second attempt; doubles for each further one, up to 30s (so at most 30s itself)'
            cand --claim-timeout 'How long a copy waits for another process''s in-flight attempt at the same message before it backs off (from 100ms to 24 days)'
            cand --attempt-timeout 'How long one attempt at a message (a batch, batched) may take before it is given up: its connection is dropped and the message tried again, not counted against it (twice in a row, with PostgreSQL then answering, it is: the work is slow or stuck on that message). Bounds a connection that died without a word (a host lost, a network cut), which would otherwise hold its message until the kernel''s TCP timeout; the server also ends a consumer''s session idle inside a transaction for this long. Longer than --claim-timeout (plus, with --effect-mode keyed, --carrier-timeout and its connect timeout for each member of a batch) [default: 30s more than that, 60s with the other defaults]'
            cand --exit-when-idle 'End once nothing arrived and nothing was in flight for this long, the queue is empty and no call to the carrier is owed (scripts, tests)'
            cand --shutdown-timeout 'After SIGINT/SIGTERM, how long in-flight messages may take; past it they are rolled back and redelivered'
            cand --broker-timeout 'How long any call to RabbitMQ may take (an ack or nack, a dead-letter copy''s confirm, setting a connection up); past it the connection is dropped and opened again, and what was not settled comes back as duplicates. A dead-letter copy the broker blocks (a memory or disk alarm) may wait for the alarm to end, in at most half the workers (on a partition queue, always)'
            cand --batch-size 'Up to this many deliveries share one transaction, their effects written together (1: one transaction per message). At most 64'
            cand --batch-wait 'How long a batch waits to fill, only while another batch is running (a lone message never waits)'
            cand --poison-after 'A redelivered message that started this many times without an outcome, each start ending the consumer process (an abort, a crash, a kill), goes to <queue>_error at its next delivery'
            cand --on-conflict 'What to do with a message whose id was processed before for another event (a producer reusing ids): it is never processed, and always counted and logged as a conflict; dead-letter moves it to <queue>_error for a look, discard drops it like a duplicate'
            cand --metrics-addr 'Serve Prometheus metrics on /metrics and a health check on /health at this address (e.g. 127.0.0.1:9464)'
            cand --partitions 'Spread the queue over this many partition queues (<queue>.0 …) fed by a consistent-hash exchange (<queue>.partitions) on the routing key, each read by one active consumer one message at a time: messages of one key are processed in the order they were published, N keys at once. Needs --partition-key'
            cand --partition-key 'The message field publishers set as the routing key (e.g. parcelId): the consumer checks each message against it and says when a publisher did not'
            cand --fail-destination 'Make the stand-in carrier (or SMS gateway) fail every call for parcels to this destination, like an API that is down: shows retries and the error queue'
            cand --carrier-url 'Book pickups with the carrier''s HTTP API at this base URL (POST <url>/pickups, with an Idempotency-Key) instead of the stand-in that writes a row. Carrier consumer only'
            cand --carrier-timeout 'The longest a call to the carrier may take, its answer included'
            cand --carrier-connect-timeout 'The longest connecting to the carrier may take'
            cand --effect-mode 'How the call to the carrier is made (see the README''s "Effects outside the database")'
            cand --effect-key-ttl 'How long the carrier keeps idempotency keys: `replay` warns about messages older than this (keyed), and an after-commit call whose outcome is unknown is not sent again once its key is this old, but put in doubt'
            cand --effect-lease 'How long a process holds an effect while it calls (after-commit, at-most-once): past it, another process may take the effect over. Longer than --carrier-timeout plus --carrier-connect-timeout'
            cand --lookup-url 'after-commit: where to ask the carrier what it booked under a key (GET <url>/pickups/by-key/{key}) before calling again for an effect whose earlier call has an unknown outcome; without it, such a call is made again'
            cand --lookup-quiet 'With --lookup-url: how long a call whose outcome is unknown (a timeout, a gateway''s 504, a crash) is left alone before the look-up is asked. The carrier may still be at work on a request whose answer never came; a look-up before it books answers 404 and the call is made again. At least how long the carrier may go on with a request its caller gave up on'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help (see more with ''--help'')'
            cand --help 'Print help (see more with ''--help'')'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;cleanup'= {
            cand --retention 'Keep processed rows this long (e.g. 90m, 36h, 7d; from 1m, or shorter with --force, to 100y): a copy of a message is recognised as a duplicate only while its row exists, so make it longer than any redelivery or replay can come late'
            cand --dlq 'A dead-letter-exchange queue to look at besides each consumer_type''s <queue>_error and <queue>_skipped (repeatable): a message in it that failed before the cutoff keeps the rows of every consumer_type'
            cand --broker-timeout 'How long any call to RabbitMQ may wait for its answer while the cleanup looks at dead-letter queues (a count, a take, a mark); past it the cleanup fails, saying so, and deletes nothing'
            cand --audit-retention 'Keep the audit''s rows (inboxctl audit) this long, from 1d; they are deleted only with this retention of their own'
            cand --detach-wait 'How long dropping a partition of a partitioned inbox waits for the transactions that could still see it (a long query, a dump, a session idle in a transaction) before leaving it for the next cleanup'
            cand --consumer-type 'Only this consumer_type (default: every one)'
            cand --batch-size 'Rows per DELETE; each batch is a short transaction of its own'
            cand --batch-pause 'Rest between batches (e.g. 50ms), to leave the database room'
            cand --every 'Keep running and clean on this schedule (e.g. 1h), as a sidecar or where there is no cron'
            cand --metrics-addr 'With --every: serve Prometheus metrics on /metrics and a health check on /health at this address'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --force 'Clean even where it shortens the deduplication window: accept a --retention under 1m, and clean consumer_types whose dead-letter queues hold a message that failed before the cutoff (its replay would then be processed again)'
            cand --dry-run 'Count what would be deleted; delete nothing'
            cand --json 'Print the result as JSON (one line per run)'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;replay'= {
            cand --from 'The dead-letter queue: a MassTransit <queue>_error or <queue>_skipped, or a dead-letter-exchange queue'
            cand --to 'Send every message here instead of where its headers say it failed'
            cand --limit 'Replay at most this many messages'
            cand --message-id 'Only this message id (repeatable)'
            cand --reason 'Only messages whose failure reason contains this text'
            cand --max-replays 'Leave messages that were already replayed this many times'
            cand --retention 'The inbox cleanup''s retention: a message that failed longer ago may have lost its inbox row, so replaying it could repeat its effect; such messages are left where they are'
            cand --group 'Only the members of this failure group (its fingerprint, or a unique prefix), as the listing of --listing holds them: messages of its cause that arrived since are left, and members gone since are reported'
            cand --listing 'The listing `inboxctl failures --from <queue> --output <file>` wrote, which --group chooses from'
            cand --rate 'Republish at most this many messages a second, so that a large replay does not flood the consumers'
            cand --confirm-above 'On a terminal, ask before replaying more than this many messages, showing the count and the groups'
            cand --reconnect-timeout 'After a lost connection, how long to keep connecting again to go on (0: stop at once, saying what was done)'
            cand --broker-timeout 'How long any call to RabbitMQ may wait for its answer (a copy''s confirm, a get, an ack); past it the connection is given up and made again as after a loss (--reconnect-timeout), and what it held goes back to the dead-letter queue. On a connection the broker blocks (a memory or disk alarm) the replay stops instead'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --include-expired 'Replay messages that failed before the retention window too'
            cand --restore-expiration 'Give each copy back the per-message TTL (expiration) it had before it was dead-lettered; by default a replayed copy has none, so that it cannot expire on its way back'
            cand -y 'Do not ask (for scripts run on a terminal; without a terminal nothing is asked)'
            cand --yes 'Do not ask (for scripts run on a terminal; without a terminal nothing is asked)'
            cand --dry-run 'List what would be replayed; move nothing (the broker marks inspected messages redelivered)'
            cand --json 'Print the result as JSON'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;find'= {
            cand --dlq 'A dead-letter-exchange queue to look in too, beside each known consumer_type''s <queue>_error and <queue>_skipped (repeatable)'
            cand --limit 'Look at no more than this many messages per dead-letter queue (the oldest)'
            cand --broker-timeout 'How long any call to RabbitMQ may wait for its answer (a count, a take, a mark); past it the look fails, saying so, and what it held goes back'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --json 'Print the result as JSON'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;failures'= {
            cand --from 'The dead-letter queue: a MassTransit <queue>_error or <queue>_skipped, or a dead-letter-exchange queue'
            cand --limit 'Look at no more than this many messages (the oldest)'
            cand --output 'Write the listing, with every member''s message id, to this file: `replay --group <fingerprint> --listing <file>` replays exactly those members'
            cand --broker-timeout 'How long any call to RabbitMQ may wait for its answer (a count, a take, a mark); past it the look fails, saying so, and what it held goes back'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --json 'Print the listing as JSON (without the member ids; --output has them)'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;publish'= {
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
            cand parcel-created 'ParcelTracker.Domain.Events.ParcelCreatedEvent, one per new parcel'
            cand help 'Print this message or the help of the given subcommand(s)'
        }
        &'inboxctl;publish;parcel-created'= {
            cand --count 'How many parcels, at most 1000000 (each is held until the broker confirmed it)'
            cand --duplicates 'Fraction of them published twice with the same message id (half at once, half after the rest), 0 to 1'
            cand --rate 'Messages per second, copies included, from 0.001 to 1000000 (default: as fast as the broker confirms)'
            cand --destination 'Every parcel''s destination (default: a rotation of cities)'
            cand --id-kind 'The kind of message ids: MassTransit''s NewId (what a MassTransit publisher sends), UUIDv7 (time first) or random v4'
            cand --events-per-parcel 'Events per parcel, published one after another, each with its own message id (what a partitioned consumer keeps in order); --count counts parcels'
            cand --partition-key 'Set each message''s routing key to this field of the event (what a consistent-hash exchange spreads on, see consume --partitions); default: no routing key, as MassTransit publishes'
            cand --exchange 'The exchange to publish to'
            cand --reconnect-timeout 'After a lost connection, how long to keep connecting again to send the unconfirmed rest (0: fail at once)'
            cand --broker-timeout 'How long any call to RabbitMQ may wait for its answer (a publish or its confirm); past it the connection is given up and made again as after a loss, and what was not confirmed is sent again. On a connection the broker blocks (a memory or disk alarm) it stops instead, saying how many copies were confirmed'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --json 'Print the result as JSON'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;publish;help'= {
            cand parcel-created 'ParcelTracker.Domain.Events.ParcelCreatedEvent, one per new parcel'
            cand help 'Print this message or the help of the given subcommand(s)'
        }
        &'inboxctl;publish;help;parcel-created'= {
        }
        &'inboxctl;publish;help;help'= {
        }
        &'inboxctl;top'= {
            cand --interval 'How often the figures are refreshed (from 100ms to 100y)'
            cand --window 'Rates are averages over this last stretch of time (from 1s to 100y)'
            cand --retention 'The cleanup''s retention: an error queue''s oldest message nearing it is flagged (its replay needs its inbox row)'
            cand --alert-duplicates 'Highlight a duplicate ratio above this, in percent'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --read-only 'Look only: the detail view''s replay (r) is off'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;stats'= {
            cand --window 'Rates are averages over this last stretch of time (from 1s to 100y)'
            cand --retention 'The cleanup''s retention: an error queue''s oldest message nearing it is flagged (its replay needs its inbox row)'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --json 'Print JSON (the shape is documented in docs/commands.md and stable)'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;demo'= {
            cand --parcels 'Parcels to register (one ParcelCreatedEvent each)'
            cand --duplicates 'Fraction of the events delivered twice (the same message id again), 0 to 1'
            cand --carrier 'The carrier the carrier consumer books with: the stand-in that writes a row, or the stand-in carrier API on HTTP, started in this process on loopback and called keyed (the JSON line then adds the bookings it counted)'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help (see more with ''--help'')'
            cand --help 'Print help (see more with ''--help'')'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;effects'= {
            cand --consumer-type 'Only this consumer_type''s'
            cand --limit 'At most this many, the oldest first'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --in-doubt 'Only the effects in doubt: the call may or may not have been made (at-most-once)'
            cand --pending 'Only the effects owed: not called yet, or being called'
            cand --failed 'Only the effects that failed every attempt'
            cand --json 'Print them as JSON'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
            cand resolve 'Settle one effect after checking with the carrier: --done (it was made) or --retry (it was not: make it again)'
            cand reconcile 'Ask the carrier what it booked under each unknown effect''s key and settle it: done with the slot found, or pending (made again by a consumer) when the carrier has none'
            cand help 'Print this message or the help of the given subcommand(s)'
        }
        &'inboxctl;effects;resolve'= {
            cand --consumer-type 'Its consumer_type (needed when the message has effects for several)'
            cand --reference 'The carrier''s reference for it (e.g. the slot id), kept with it'
            cand --quiet-for 'With --retry: refused unless the call''s last attempt ended at least this long ago — a request whose answer never came may still be booked by the carrier after you looked'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --done 'The call was made: mark the effect done'
            cand --never-attempted 'With --done: settle a call no consumer has attempted yet (owed, booked some other way). Refused without: a mistaken message id would mark done a call no one made, and it would never be made'
            cand --retry 'The call was not made: owe it again (a running consumer makes it)'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;effects;reconcile'= {
            cand --lookup-url 'The carrier''s base URL for look-ups: GET <url>/pickups/by-key/{key}'
            cand --consumer-type 'Whose calls to settle: the consumer_type whose carrier --lookup-url answers for. Always named: a look-up asked about another carrier''s calls answers 404 for each, and would have them made again'
            cand --timeout 'The longest one look-up may take'
            cand --quiet-for 'Owe a call again on a 404 only when its last attempt ended at least this long ago: the carrier may still be working on a request whose answer never came'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --json 'Print what was done as JSON'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;effects;help'= {
            cand resolve 'Settle one effect after checking with the carrier: --done (it was made) or --retry (it was not: make it again)'
            cand reconcile 'Ask the carrier what it booked under each unknown effect''s key and settle it: done with the slot found, or pending (made again by a consumer) when the carrier has none'
            cand help 'Print this message or the help of the given subcommand(s)'
        }
        &'inboxctl;effects;help;resolve'= {
        }
        &'inboxctl;effects;help;reconcile'= {
        }
        &'inboxctl;effects;help;help'= {
        }
        &'inboxctl;audit'= {
            cand --since 'Actions of this last while (e.g. 90m, 24h, 30d)'
            cand --command 'Only this command''s actions (migrate, cleanup, replay, consume)'
            cand --limit 'At most this many rows'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --json 'Print the rows as JSON'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;carrier-stub'= {
            cand --listen 'The address to listen on (port 0: one the system chooses); the first line printed is its URL'
            cand --delay 'Answer this late, after booking'
            cand --delay-destination 'Only bookings to this destination are answered late'
            cand --fail-next 'Answer 503 to this many requests, booking nothing'
            cand --drop-next 'Book, then drop the connection without answering, for this many requests'
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --ignore-keys 'Book again for a repeated Idempotency-Key, as a carrier that does not honour keys does'
            cand --fail-always 'Answer 503 to every request'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;completions'= {
            cand --database-url 'PostgreSQL URL (postgres://user[:password]@host[:port]/database[?sslmode=...])'
            cand --amqp-url 'RabbitMQ URL (amqp[s]://user[:password]@host[:port]/vhost; the vhost "/" is written %2f). The nodes of a cluster: a host list (amqp://user@host1:5672,host2:5672/vhost) or this flag once per node'
            cand --database-password-file 'File holding the PostgreSQL password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-password-file 'File holding the RabbitMQ password (one line), so that it is in neither the URL nor the environment'
            cand --amqp-ca-file 'CA certificate (PEM) an amqps:// broker''s certificate may chain to, beside the system''s roots (amqps:// only)'
            cand --log-format 'Log line format on stderr'
            cand --transaction-pooling 'PostgreSQL is reached through a connection pooler in transaction mode (PgBouncer''s pool_mode = transaction): every statement unnamed and in a transaction, no session settings or locks (migrate refuses: run it against PostgreSQL itself)'
            cand -v 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand --verbose 'More log output on stderr: -v debug, -vv trace (RUST_LOG, if set, takes precedence)'
            cand -h 'Print help'
            cand --help 'Print help'
            cand -V 'Print version'
            cand --version 'Print version'
        }
        &'inboxctl;help'= {
            cand migrate 'Apply the inbox schema (creates the database if needed; safe to repeat, safe to run twice at once)'
            cand consume 'Run a Parcel Tracker consumer in the foreground, exactly once per (message id, consumer_type)'
            cand cleanup 'Purge processed inbox rows older than the retention window, in small batches (never an unprocessed row)'
            cand replay 'Move dead-lettered messages back to the queue they failed on, safely (the inbox absorbs what was done)'
            cand find 'Everything known about messages, by id: inbox rows, events, effects, copies in dead-letter queues'
            cand failures 'A dead-letter queue''s messages grouped by the cause of their failure, as they are now (nothing is taken)'
            cand publish 'Publish Parcel Tracker events as MassTransit 8 messages (demos, tests, load)'
            cand top 'Live dashboard per consumer_type: duplicate rate, unprocessed rows, queues'
            cand stats 'Per consumer_type: inbox rows, unprocessed rows, duplicate rate, queues — once, as a table or JSON'
            cand demo 'The whole story in one command: migrate, publish with duplicates, consume, count the effects'
            cand effects 'Calls to the outside world not done (owed, in doubt, failed), and settling them'
            cand audit 'The operator actions that changed state (migrate, cleanup, replay, consume), who did them and what came of it'
            cand carrier-stub 'A stand-in carrier API on HTTP for demos and tests: books pickup slots, counts them, misbehaves on request'
            cand completions 'Print a shell completion script (bash, zsh, fish, elvish, powershell)'
            cand help 'Print this message or the help of the given subcommand(s)'
        }
        &'inboxctl;help;migrate'= {
        }
        &'inboxctl;help;consume'= {
        }
        &'inboxctl;help;cleanup'= {
        }
        &'inboxctl;help;replay'= {
        }
        &'inboxctl;help;find'= {
        }
        &'inboxctl;help;failures'= {
        }
        &'inboxctl;help;publish'= {
            cand parcel-created 'ParcelTracker.Domain.Events.ParcelCreatedEvent, one per new parcel'
        }
        &'inboxctl;help;publish;parcel-created'= {
        }
        &'inboxctl;help;top'= {
        }
        &'inboxctl;help;stats'= {
        }
        &'inboxctl;help;demo'= {
        }
        &'inboxctl;help;effects'= {
            cand resolve 'Settle one effect after checking with the carrier: --done (it was made) or --retry (it was not: make it again)'
            cand reconcile 'Ask the carrier what it booked under each unknown effect''s key and settle it: done with the slot found, or pending (made again by a consumer) when the carrier has none'
        }
        &'inboxctl;help;effects;resolve'= {
        }
        &'inboxctl;help;effects;reconcile'= {
        }
        &'inboxctl;help;audit'= {
        }
        &'inboxctl;help;carrier-stub'= {
        }
        &'inboxctl;help;completions'= {
        }
        &'inboxctl;help;help'= {
        }
    ]
    $completions[$command]
}
