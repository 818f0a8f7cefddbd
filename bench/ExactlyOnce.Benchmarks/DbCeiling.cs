using System.Diagnostics;
using ExactlyOnce.TestHost;
using Npgsql;

namespace ExactlyOnce.Benchmarks;

/// <summary>
/// What PostgreSQL itself does here: the same statements the modes issue, sent directly through Npgsql with the same
/// concurrency, no broker, no framework. Every mode is reported as a fraction of these.
/// </summary>
internal static class DbCeiling
{
    public static async Task<(double InsertOnly, double InboxTransaction)> MeasureAsync(int concurrency, TimeSpan duration)
    {
        string database = "eo_ceiling_" + Guid.NewGuid().ToString("N")[..10];
        await Harness.ExecuteAdminAsync($"CREATE DATABASE \"{database}\"");
        string connectionString = TestHosts.PostgresServer + ";Database=" + database + ";Maximum Pool Size=64";
        try
        {
            await using (var setup = new NpgsqlConnection(connectionString))
            {
                await setup.OpenAsync();
                await using var create = new NpgsqlCommand("""
                    CREATE TABLE bench_rows (id bigserial PRIMARY KEY, key uuid NOT NULL, sent_at timestamptz NOT NULL, phase integer NOT NULL,
                      written_at timestamptz NOT NULL DEFAULT clock_timestamp());
                    CREATE TABLE inbox_messages (id uuid NOT NULL, consumer_type varchar(500) NOT NULL, received_at timestamptz NOT NULL,
                      processed_at timestamptz NULL, CONSTRAINT pk_inbox_messages PRIMARY KEY (id, consumer_type));
                    CREATE INDEX ix_inbox_messages_unprocessed ON inbox_messages (received_at) WHERE processed_at IS NULL;
                    CREATE INDEX ix_inbox_messages_processed_at ON inbox_messages (processed_at) WHERE processed_at IS NOT NULL;
                    """, setup);
                await create.ExecuteNonQueryAsync();
            }

            double insert = await RunAsync(connectionString, concurrency, duration, InsertOnlyAsync);
            double inbox = await RunAsync(connectionString, concurrency, duration, InboxTransactionAsync);
            return (insert, inbox);
        }
        finally
        {
            NpgsqlConnection.ClearAllPools();
            await Harness.ExecuteAdminAsync($"DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)");
        }
    }

    private static async Task<double> RunAsync(string connectionString, int concurrency, TimeSpan duration, Func<NpgsqlConnection, Task> transaction)
    {
        long done = 0;
        var clock = Stopwatch.StartNew();
        await Task.WhenAll(Enumerable.Range(0, concurrency).Select(async _ =>
        {
            await using var connection = new NpgsqlConnection(connectionString);
            await connection.OpenAsync();
            while (clock.Elapsed < duration)
            {
                await transaction(connection);
                Interlocked.Increment(ref done);
            }
        }));
        return done / clock.Elapsed.TotalSeconds;
    }

    /// <summary>The baseline's business write: one insert, its own transaction.</summary>
    private static async Task InsertOnlyAsync(NpgsqlConnection connection)
    {
        await using var insert = new NpgsqlCommand("INSERT INTO bench_rows (key, sent_at, phase) VALUES ($1, now(), 0)", connection);
        insert.Parameters.Add(new NpgsqlParameter { Value = Guid.NewGuid() });
        await insert.ExecuteNonQueryAsync();
    }

    /// <summary>The inbox's transaction: claim (written already processed), business insert, commit — the statements ExactlyOnce sends.</summary>
    private static async Task InboxTransactionAsync(NpgsqlConnection connection)
    {
        Guid id = Guid.NewGuid();
        await using var transaction = await connection.BeginTransactionAsync();
        await using (var claim = new NpgsqlCommand(
            "SELECT set_config('lock_timeout', '30000ms', true); INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) " +
            "VALUES (@id, 'bench', now(), now()) ON CONFLICT (id, consumer_type) DO NOTHING RETURNING 1; SET LOCAL lock_timeout TO DEFAULT", connection, transaction))
        {
            claim.Parameters.AddWithValue("id", id);
            await using var reader = await claim.ExecuteReaderAsync();
            while (await reader.NextResultAsync())
            {
            }
        }

        await using (var insert = new NpgsqlCommand("INSERT INTO bench_rows (key, sent_at, phase) VALUES ($1, now(), 0)", connection, transaction))
        {
            insert.Parameters.Add(new NpgsqlParameter { Value = id });
            await insert.ExecuteNonQueryAsync();
        }

        await transaction.CommitAsync();
    }
}
