using ExactlyOnce.Steps;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Infrastructure;
using Microsoft.EntityFrameworkCore.Metadata;
using Microsoft.Extensions.DependencyInjection;

namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>
/// The step journal in <typeparamref name="TDbContext"/>'s <c>recorded_steps</c> table. Every operation runs on a
/// DbContext from a fresh scope — its own connection, in autocommit — never on the consumer's, so a record survives
/// the consumer's rollback.
/// </summary>
internal sealed class EntityFrameworkStepStore<TDbContext>(IServiceScopeFactory scopes, StepStoreOptions options) : IStepStore
    where TDbContext : DbContext
{
    public Task<StepRecord?> FindAsync(StepKey key, CancellationToken cancellationToken = default) =>
        WithContextAsync(async db =>
        {
            RecordedStep? row = await Rows(db, key).AsNoTracking().FirstOrDefaultAsync(cancellationToken).ConfigureAwait(false);
            return row is null ? null : ToRecord(row);
        });

    public Task<bool> StartAsync(StepKey key, Guid idempotencyKey, StepStatus? expected, DateTime nowUtc, CancellationToken cancellationToken = default) =>
        WithContextAsync(async db =>
        {
            if (expected is { } status)
            {
                int updated = await Rows(db, key).Where(s => s.Status == status)
                    .ExecuteUpdateAsync(u => u
                        .SetProperty(s => s.Status, StepStatus.Started)
                        .SetProperty(s => s.Attempts, s => s.Attempts + 1)
                        .SetProperty(s => s.StartedAt, nowUtc)
                        .SetProperty(s => s.CompletedAt, (DateTime?)null), cancellationToken).ConfigureAwait(false);
                return updated == 1;
            }

            // INSERT … ON CONFLICT DO NOTHING (PostgreSQL and SQLite alike): a row that exists is reported, not an error.
            string sql = _insert ??= InsertStatement(db);
            int inserted = await db.Database.ExecuteSqlRawAsync(sql,
                [key.Message.MessageId, key.Message.ConsumerName, key.Name, idempotencyKey, nameof(StepStatus.Started), nowUtc], cancellationToken).ConfigureAwait(false);
            return inserted == 1;
        });

    public Task CompleteAsync(StepKey key, string result, DateTime nowUtc, CancellationToken cancellationToken = default) =>
        WithContextAsync(async db =>
        {
            int updated = await Rows(db, key).ExecuteUpdateAsync(u => u
                .SetProperty(s => s.Status, StepStatus.Completed)
                .SetProperty(s => s.Result, result)
                .SetProperty(s => s.CompletedAt, nowUtc)
                .SetProperty(s => s.Reason, (string?)null), cancellationToken).ConfigureAwait(false);
            if (updated != 1)
            {
                throw new InvalidOperationException($"ExactlyOnce: step '{key.Name}' of message {key.Message.MessageId} has no record to complete.");
            }

            return true;
        });

    public Task SetStatusAsync(StepKey key, StepStatus status, string? reason, DateTime nowUtc, CancellationToken cancellationToken = default) =>
        WithContextAsync(async db =>
        {
            DateTime? settledAt = status == StepStatus.NotDone ? nowUtc : null;
            int updated = await Rows(db, key).ExecuteUpdateAsync(u => u
                .SetProperty(s => s.Status, status)
                .SetProperty(s => s.Reason, reason)
                .SetProperty(s => s.CompletedAt, settledAt), cancellationToken).ConfigureAwait(false);
            if (updated != 1)
            {
                throw new InvalidOperationException($"ExactlyOnce: step '{key.Name}' of message {key.Message.MessageId} for consumer '{key.Message.ConsumerName}' has no record.");
            }

            return true;
        });

    public Task<IReadOnlyList<StepRecord>> ListAsync(StepStatus status, int limit, CancellationToken cancellationToken = default) =>
        WithContextAsync<IReadOnlyList<StepRecord>>(async db =>
        {
            var rows = await db.Set<RecordedStep>().AsNoTracking().Where(s => s.Status == status)
                .OrderBy(s => s.StartedAt).Take(limit).ToListAsync(cancellationToken).ConfigureAwait(false);
            return rows.Select(ToRecord).ToList();
        });

    public Task<int> DeleteSettledAsync(DateTime cutoffUtc, int batchSize, CancellationToken cancellationToken = default) =>
        WithContextAsync(db => db.Set<RecordedStep>()
            .Where(s => (s.Status == StepStatus.Completed || s.Status == StepStatus.NotDone) && s.StartedAt < cutoffUtc)
            .OrderBy(s => s.StartedAt).Take(batchSize)
            .ExecuteDeleteAsync(cancellationToken));

    // Built once from the model's own mapping (this store serves one DbContext type, hence one model).
    private string? _insert;

    private static string InsertStatement(TDbContext db)
    {
        IEntityType entity = db.Model.FindEntityType(typeof(RecordedStep))!;
        var table = StoreObjectIdentifier.Table(entity.GetTableName()!, entity.GetSchema());
        string Column(string property) => Quote(db, entity.FindProperty(property)!.GetColumnName(table)!);
        string tableName = entity.GetSchema() is { } schema ? Quote(db, schema) + "." + Quote(db, entity.GetTableName()!) : Quote(db, entity.GetTableName()!);
        return $"INSERT INTO {tableName} ({Column(nameof(RecordedStep.MessageId))}, {Column(nameof(RecordedStep.ConsumerType))}, {Column(nameof(RecordedStep.StepName))}, " +
               $"{Column(nameof(RecordedStep.IdempotencyKey))}, {Column(nameof(RecordedStep.Status))}, {Column(nameof(RecordedStep.Attempts))}, {Column(nameof(RecordedStep.StartedAt))}) " +
               "VALUES ({0}, {1}, {2}, {3}, {4}, 1, {5}) ON CONFLICT DO NOTHING";
    }

    private static IQueryable<RecordedStep> Rows(TDbContext db, StepKey key) =>
        db.Set<RecordedStep>().Where(s => s.MessageId == key.Message.MessageId && s.ConsumerType == key.Message.ConsumerName && s.StepName == key.Name);

    private async Task<T> WithContextAsync<T>(Func<TDbContext, Task<T>> operation)
    {
        AsyncServiceScope scope = scopes.CreateAsyncScope();
        await using (scope.ConfigureAwait(false))
        {
            var db = scope.ServiceProvider.GetRequiredService<TDbContext>();
            if (options.SharesInboxDatabase && db.Database.ProviderName == "Microsoft.EntityFrameworkCore.Sqlite")
            {
                throw new InvalidOperationException(
                    $"ExactlyOnce: recorded steps are written on their own connection while the consumer's transaction is open, and SQLite " +
                    $"allows one writer per database file — the consumer's. Keep the step journal in another SQLite file: " +
                    $"services.AddExactlyOnceRecordedSteps<TStepsDbContext>() with a DbContext on another file whose model calls " +
                    $"AddExactlyOnceRecordedSteps(). ({typeof(TDbContext).Name} is the inbox's own DbContext.)");
            }

            return await operation(db).ConfigureAwait(false);
        }
    }

    private static string Quote(DbContext db, string identifier) =>
        db.GetService<Microsoft.EntityFrameworkCore.Storage.ISqlGenerationHelper>().DelimitIdentifier(identifier);

    private static StepRecord ToRecord(RecordedStep row) => new(
        new StepKey(new InboxKey(row.MessageId, row.ConsumerType), row.StepName), row.IdempotencyKey, row.Status, row.Result, row.Attempts,
        DateTime.SpecifyKind(row.StartedAt, DateTimeKind.Utc), row.CompletedAt is { } c ? DateTime.SpecifyKind(c, DateTimeKind.Utc) : null, row.Reason);
}

/// <summary>Where the step journal lives relative to the inbox.</summary>
/// <param name="SharesInboxDatabase">The journal's DbContext type is the inbox's own (fine on PostgreSQL; impossible on SQLite).</param>
internal sealed record StepStoreOptions(bool SharesInboxDatabase);
