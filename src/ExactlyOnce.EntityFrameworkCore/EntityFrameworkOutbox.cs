using System.Data.Common;
using ExactlyOnce.Outbox;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Storage;
using Microsoft.Extensions.DependencyInjection;
using Npgsql;

namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>Adds outbox rows to the scope's own DbContext: they are saved by its next SaveChanges, in its transaction.</summary>
internal sealed class EntityFrameworkOutboxWriter<TDbContext>(TDbContext context, TimeProvider timeProvider) : IOutboxWriter
    where TDbContext : DbContext
{
    public void Add(OutboxEntry entry)
    {
        ArgumentNullException.ThrowIfNull(entry);
        _ = OutboxSql.For(context); // fail early and clearly if the model has no outbox
        context.Set<OutboxMessage>().Add(new OutboxMessage
        {
            MessageId = entry.MessageId,
            MessageType = entry.MessageType,
            Body = entry.Body,
            Headers = entry.Headers,
            Destination = entry.Destination,
            CreatedAt = timeProvider.GetUtcNow().UtcDateTime,
        });
        OutboxCommitNotifier.MarkWritingOutbox(context);
    }
}

/// <summary>The dispatcher's store: claims rows in its own scope and transaction.</summary>
internal sealed class EntityFrameworkOutboxStore<TDbContext>(IServiceScopeFactory scopes) : IOutboxStore
    where TDbContext : DbContext
{
    public async Task<IOutboxBatch> ClaimAsync(int batchSize, DateTime nowUtc, CancellationToken cancellationToken = default)
    {
        AsyncServiceScope scope = scopes.CreateAsyncScope();
        try
        {
            var context = scope.ServiceProvider.GetRequiredService<TDbContext>();
            OutboxSql sql = OutboxSql.For(context);
            IDbContextTransaction transaction = await context.Database.BeginTransactionAsync(cancellationToken).ConfigureAwait(false);
            var entries = new List<OutboxEntry>();
            DbCommand command = context.Database.GetDbConnection().CreateCommand();
            await using (command.ConfigureAwait(false))
            {
                command.Transaction = transaction.GetDbTransaction();
                command.CommandText = sql.Claim;
                sql.AddTime(command, "eo_now", nowUtc);
                OutboxSql.AddInt(command, "eo_limit", batchSize);
                DbDataReader reader = await command.ExecuteReaderAsync(cancellationToken).ConfigureAwait(false);
                await using (reader.ConfigureAwait(false))
                {
                    while (await reader.ReadAsync(cancellationToken).ConfigureAwait(false))
                    {
                        entries.Add(new OutboxEntry(
                            reader.GetGuid(1),
                            reader.GetString(2),
                            reader.GetString(3),
                            reader.IsDBNull(4) ? null : reader.GetString(4),
                            reader.IsDBNull(5) ? null : reader.GetString(5))
                        {
                            Sequence = reader.GetInt64(0),
                            CreatedAt = DateTime.SpecifyKind(reader.GetDateTime(6), DateTimeKind.Utc),
                            Attempts = reader.GetInt32(7),
                        });
                    }
                }
            }

            return new Batch(scope, context, transaction, sql, entries);
        }
        catch
        {
            await scope.DisposeAsync().ConfigureAwait(false);
            throw;
        }
    }

    public async Task ListenAsync(Action onNotification, CancellationToken cancellationToken = default)
    {
        string? connectionString;
        AsyncServiceScope scope = scopes.CreateAsyncScope();
        await using (scope.ConfigureAwait(false))
        {
            var context = scope.ServiceProvider.GetRequiredService<TDbContext>();
            if (OutboxSql.For(context).Dialect != SqlDialect.PostgreSql)
            {
                return; // in-process signals and polling only
            }

            connectionString = context.Database.GetConnectionString();
        }

        var connection = new NpgsqlConnection(connectionString);
        await using (connection.ConfigureAwait(false))
        {
            await connection.OpenAsync(cancellationToken).ConfigureAwait(false);
            connection.Notification += (_, _) => onNotification();
            NpgsqlCommand listen = new("LISTEN " + OutboxSql.NotifyChannel, connection);
            await using (listen.ConfigureAwait(false))
            {
                await listen.ExecuteNonQueryAsync(cancellationToken).ConfigureAwait(false);
            }

            onNotification(); // catch up with anything committed while not listening
            while (true)
            {
                await connection.WaitAsync(cancellationToken).ConfigureAwait(false);
            }
        }
    }

    private sealed class Batch(AsyncServiceScope scope, DbContext context, IDbContextTransaction transaction, OutboxSql sql, List<OutboxEntry> entries) : IOutboxBatch
    {
        private bool _completed;

        public IReadOnlyList<OutboxEntry> Entries => entries;

        public async Task CompleteAsync(IReadOnlyCollection<long> dispatched, IReadOnlyCollection<OutboxFailure> failed, DateTime nowUtc, CancellationToken cancellationToken = default)
        {
            ArgumentNullException.ThrowIfNull(dispatched);
            ArgumentNullException.ThrowIfNull(failed);
            DbConnection connection = context.Database.GetDbConnection();
            if (dispatched.Count > 0)
            {
                DbCommand command = connection.CreateCommand();
                await using (command.ConfigureAwait(false))
                {
                    command.Transaction = transaction.GetDbTransaction();
                    sql.AddTime(command, "eo_now", nowUtc);
                    var names = new List<string>(dispatched.Count);
                    int i = 0;
                    foreach (long sequence in dispatched)
                    {
                        string name = "eo_s" + i++.ToString(System.Globalization.CultureInfo.InvariantCulture);
                        sql.AddSequence(command, name, sequence);
                        names.Add("@" + name);
                    }

                    command.CommandText = sql.MarkDispatchedPrefix + string.Join(", ", names) + ")";
                    await command.ExecuteNonQueryAsync(cancellationToken).ConfigureAwait(false);
                }
            }

            foreach (OutboxFailure failure in failed)
            {
                DbCommand command = connection.CreateCommand();
                await using (command.ConfigureAwait(false))
                {
                    command.Transaction = transaction.GetDbTransaction();
                    command.CommandText = sql.MarkFailed;
                    sql.AddText(command, "eo_error", failure.Error);
                    sql.AddTime(command, "eo_next", failure.NextAttemptAtUtc);
                    sql.AddSequence(command, "eo_sequence", failure.Sequence);
                    await command.ExecuteNonQueryAsync(cancellationToken).ConfigureAwait(false);
                }
            }

            await transaction.CommitAsync(cancellationToken).ConfigureAwait(false);
            _completed = true;
        }

        public async ValueTask DisposeAsync()
        {
            try
            {
                if (!_completed)
                {
                    try
                    {
                        await transaction.RollbackAsync(CancellationToken.None).ConfigureAwait(false);
                    }
                    catch (DbException)
                    {
                        // The connection is gone; the server rolled back and released the locks.
                    }
                    catch (InvalidOperationException)
                    {
                    }
                }

                await transaction.DisposeAsync().ConfigureAwait(false);
            }
            finally
            {
                await scope.DisposeAsync().ConfigureAwait(false);
            }
        }
    }
}
