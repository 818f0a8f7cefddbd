using System.Data.Common;
using System.Runtime.CompilerServices;
using ExactlyOnce.Maintenance;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Infrastructure;
using Microsoft.EntityFrameworkCore.Metadata;
using Microsoft.EntityFrameworkCore.Storage;
using Microsoft.Extensions.DependencyInjection;

namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>Retention deletes and statistics, each one short statement in its own scope.</summary>
internal sealed class EntityFrameworkMaintenanceStore<TDbContext>(IServiceScopeFactory scopes) : IMaintenanceStore
    where TDbContext : DbContext
{
    public Task<int> DeleteProcessedInboxAsync(DateTime cutoffUtc, int batchSize, CancellationToken cancellationToken = default) =>
        ExecuteAsync(sql => sql.DeleteInbox, cutoffUtc, batchSize, cancellationToken);

    public Task<int> DeleteDispatchedOutboxAsync(DateTime cutoffUtc, int batchSize, CancellationToken cancellationToken = default) =>
        ExecuteAsync(sql => sql.DeleteOutbox, cutoffUtc, batchSize, cancellationToken);

    public async Task<ExactlyOnceStatistics> ReadStatisticsAsync(CancellationToken cancellationToken = default)
    {
        AsyncServiceScope scope = scopes.CreateAsyncScope();
        await using (scope.ConfigureAwait(false))
        {
            var context = scope.ServiceProvider.GetRequiredService<TDbContext>();
            MaintenanceSql sql = MaintenanceSql.For(context);
            DbConnection connection = context.Database.GetDbConnection();
            await context.Database.OpenConnectionAsync(cancellationToken).ConfigureAwait(false);
            try
            {
                DbCommand command = connection.CreateCommand();
                await using (command.ConfigureAwait(false))
                {
                    command.CommandText = sql.Statistics;
                    if (sql.InboxRegclass is not null)
                    {
                        DbParameter parameter = command.CreateParameter();
                        parameter.ParameterName = "eo_table";
                        parameter.Value = sql.InboxRegclass;
                        command.Parameters.Add(parameter);
                    }

                    DbDataReader reader = await command.ExecuteReaderAsync(cancellationToken).ConfigureAwait(false);
                    await using (reader.ConfigureAwait(false))
                    {
                        await reader.ReadAsync(cancellationToken).ConfigureAwait(false);
                        long inbox = reader.IsDBNull(0) ? 0 : Convert.ToInt64(reader.GetValue(0), System.Globalization.CultureInfo.InvariantCulture);
                        long pending = reader.IsDBNull(1) ? 0 : Convert.ToInt64(reader.GetValue(1), System.Globalization.CultureInfo.InvariantCulture);
                        DateTime? oldest = reader.IsDBNull(2) ? null : DateTime.SpecifyKind(reader.GetDateTime(2), DateTimeKind.Utc);
                        return new ExactlyOnceStatistics(inbox, pending, oldest);
                    }
                }
            }
            finally
            {
                await context.Database.CloseConnectionAsync().ConfigureAwait(false);
            }
        }
    }

    private async Task<int> ExecuteAsync(Func<MaintenanceSql, string?> statement, DateTime cutoffUtc, int batchSize, CancellationToken cancellationToken)
    {
        AsyncServiceScope scope = scopes.CreateAsyncScope();
        await using (scope.ConfigureAwait(false))
        {
            var context = scope.ServiceProvider.GetRequiredService<TDbContext>();
            MaintenanceSql sql = MaintenanceSql.For(context);
            string? text = statement(sql);
            if (text is null)
            {
                return 0; // that table is not in this model
            }

            DbConnection connection = context.Database.GetDbConnection();
            await context.Database.OpenConnectionAsync(cancellationToken).ConfigureAwait(false);
            try
            {
                DbCommand command = connection.CreateCommand();
                await using (command.ConfigureAwait(false))
                {
                    command.CommandText = text;
                    command.Parameters.Add(sql.TimeMapping.CreateParameter(command, "eo_cutoff", DateTime.SpecifyKind(cutoffUtc, DateTimeKind.Utc), nullable: false));
                    DbParameter limit = command.CreateParameter();
                    limit.ParameterName = "eo_limit";
                    limit.DbType = System.Data.DbType.Int32;
                    limit.Value = batchSize;
                    command.Parameters.Add(limit);
                    return await command.ExecuteNonQueryAsync(cancellationToken).ConfigureAwait(false);
                }
            }
            finally
            {
                await context.Database.CloseConnectionAsync().ConfigureAwait(false);
            }
        }
    }
}

/// <summary>The maintenance statements for one model, built from its mapping.</summary>
internal sealed class MaintenanceSql
{
    private static readonly ConditionalWeakTable<IModel, MaintenanceSql> Cache = [];

    private MaintenanceSql(DbContext context)
    {
        SqlDialect dialect = InboxSql.DialectOf(context);
        var sql = context.GetService<ISqlGenerationHelper>();
        IEntityType? inbox = context.Model.FindEntityType(typeof(InboxMessage));
        IEntityType? outbox = context.Model.FindEntityType(typeof(OutboxMessage));
        string Column(IEntityType entity, string property) => sql.DelimitIdentifier(entity.FindProperty(property)!.GetColumnName());
        string Table(IEntityType entity) => sql.DelimitIdentifier(entity.GetTableName()!, entity.GetSchema());
        string rowId = dialect == SqlDialect.PostgreSql ? "ctid" : "rowid";
        // Other cleanup instances skip the rows this one is deleting: no waiting, no deadlock, no double work.
        // ORDER BY the indexed timestamp: oldest first, and the planner walks the partial index and stops after the
        // batch instead of scanning the table (a plain LIMIT lets it pick a sequential scan that only looks cheap).
        string skipLocked = dialect == SqlDialect.PostgreSql ? " FOR UPDATE SKIP LOCKED" : "";
        string Subset(string inner) => dialect == SqlDialect.PostgreSql ? $"= ANY (ARRAY({inner}))" : $"IN ({inner})";

        IProperty timeProperty = inbox?.FindProperty(nameof(InboxMessage.ReceivedAt))
            ?? outbox?.FindProperty(nameof(OutboxMessage.CreatedAt))
            ?? throw new InvalidOperationException("ExactlyOnce: the model has neither the inbox nor the outbox table.");
        TimeMapping = timeProperty.GetRelationalTypeMapping();
        if (inbox is not null)
        {
            string table = Table(inbox);
            string processedAt = Column(inbox, nameof(InboxMessage.ProcessedAt));
            DeleteInbox = $"DELETE FROM {table} WHERE {rowId} {Subset($"SELECT {rowId} FROM {table} WHERE {processedAt} IS NOT NULL AND {processedAt} < @eo_cutoff ORDER BY {processedAt} LIMIT @eo_limit{skipLocked}")}";
        }

        if (outbox is not null)
        {
            string table = Table(outbox);
            string dispatchedAt = Column(outbox, nameof(OutboxMessage.DispatchedAt));
            string sequence = Column(outbox, nameof(OutboxMessage.Sequence));
            DeleteOutbox = $"DELETE FROM {table} WHERE {sequence} IN (SELECT {sequence} FROM {table} WHERE {dispatchedAt} IS NOT NULL AND {dispatchedAt} < @eo_cutoff ORDER BY {dispatchedAt} LIMIT @eo_limit{skipLocked})";
        }

        string inboxRows = inbox is null
            ? "0"
            : dialect == SqlDialect.PostgreSql
                // The planner's estimate: free to read, refreshed by autovacuum/ANALYZE; -1 before the first one.
                ? "(SELECT GREATEST(reltuples, 0)::bigint FROM pg_class WHERE oid = to_regclass(@eo_table))"
                : $"(SELECT count(*) FROM {Table(inbox)})";
        InboxRegclass = inbox is not null && dialect == SqlDialect.PostgreSql ? Table(inbox) : null;
        Statistics = outbox is null
            ? $"SELECT {inboxRows}, 0, NULL"
            : $"SELECT {inboxRows}, count(*), min({Column(outbox, nameof(OutboxMessage.CreatedAt))}) FROM {Table(outbox)} WHERE {Column(outbox, nameof(OutboxMessage.DispatchedAt))} IS NULL";
    }

    public string? DeleteInbox { get; }

    public string? DeleteOutbox { get; }

    public string Statistics { get; }

    public string? InboxRegclass { get; }

    public RelationalTypeMapping TimeMapping { get; }

    public static MaintenanceSql For(DbContext context) => Cache.GetValue(context.Model, _ => new MaintenanceSql(context));
}
