using System.Data.Common;
using System.Runtime.CompilerServices;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Infrastructure;
using Microsoft.EntityFrameworkCore.Metadata;
using Microsoft.EntityFrameworkCore.Storage;

namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>The SQL dialects the store speaks.</summary>
internal enum SqlDialect
{
    PostgreSql,
    Sqlite,
}

/// <summary>
/// The inbox statements for one model and provider, built once from the model's own mapping (table, schema,
/// column names, type mappings) and cached per model. Every value is a parameter.
/// </summary>
internal sealed class InboxSql
{
    private const string PostgresProvider = "Npgsql.EntityFrameworkCore.PostgreSQL";
    private const string SqliteProvider = "Microsoft.EntityFrameworkCore.Sqlite";
    private static readonly ConditionalWeakTable<IModel, InboxSql> Cache = [];

    private readonly RelationalTypeMapping _idMapping;
    private readonly RelationalTypeMapping _consumerMapping;
    private readonly RelationalTypeMapping _timeMapping;

    private InboxSql(DbContext context)
    {
        Dialect = DialectOf(context);

        IEntityType entity = context.Model.FindEntityType(typeof(InboxMessage))
            ?? throw new InvalidOperationException(
                $"ExactlyOnce: the model of {context.GetType().Name} has no inbox. Call modelBuilder.AddExactlyOnceInbox() in OnModelCreating, " +
                "then add and apply a migration (dotnet ef migrations add AddExactlyOnceInbox).");

        var sql = context.GetService<ISqlGenerationHelper>();
        string tableName = entity.GetTableName()!;
        Table = sql.DelimitIdentifier(tableName, entity.GetSchema());
        TableDisplayName = entity.GetSchema() is { } schema ? schema + "." + tableName : tableName;

        IProperty id = entity.FindProperty(nameof(InboxMessage.Id))!;
        IProperty consumer = entity.FindProperty(nameof(InboxMessage.ConsumerType))!;
        IProperty received = entity.FindProperty(nameof(InboxMessage.ReceivedAt))!;
        IProperty processed = entity.FindProperty(nameof(InboxMessage.ProcessedAt))!;
        string idColumn = sql.DelimitIdentifier(id.GetColumnName());
        string consumerColumn = sql.DelimitIdentifier(consumer.GetColumnName());
        string receivedColumn = sql.DelimitIdentifier(received.GetColumnName());
        string processedColumn = sql.DelimitIdentifier(processed.GetColumnName());
        _idMapping = id.GetRelationalTypeMapping();
        _consumerMapping = consumer.GetRelationalTypeMapping();
        _timeMapping = received.GetRelationalTypeMapping();

        // The row is written already processed (see IInboxStore.TryClaimAsync): it is invisible to everyone else until
        // it commits with the consumer's effects, so nothing has to come back and mark it.
        string insert = $"INSERT INTO {Table} ({idColumn}, {consumerColumn}, {receivedColumn}, {processedColumn}) " +
                        "VALUES (@eo_id, @eo_consumer, @eo_received, @eo_processed) " +
                        $"ON CONFLICT ({idColumn}, {consumerColumn}) DO NOTHING";
        Claim = Dialect == SqlDialect.PostgreSql
            // One round trip: bound the lock wait for the claim alone, claim, then restore the session's lock timeout
            // so the consumer's own statements are not affected. RETURNING tells whether a row was inserted.
            ? $"SELECT set_config('lock_timeout', @eo_timeout, true); {insert} RETURNING 1; SET LOCAL lock_timeout TO DEFAULT"
            : insert;
        DeleteClaim = $"DELETE FROM {Table} WHERE {idColumn} = @eo_id AND {consumerColumn} = @eo_consumer";
        if (Dialect == SqlDialect.PostgreSql)
        {
            // Batched mode: every key in one statement, inserted in key order so that two batches with overlapping keys
            // take their row locks in the same order and cannot deadlock on each other's claims.
            BatchClaim = "SELECT set_config('lock_timeout', @eo_timeout, true); " +
                         $"INSERT INTO {Table} ({idColumn}, {consumerColumn}, {receivedColumn}, {processedColumn}) " +
                         "SELECT k.id, k.consumer, k.received, @eo_processed FROM unnest(@eo_ids, @eo_consumers, @eo_received) AS k(id, consumer, received) " +
                         "ORDER BY k.id, k.consumer " +
                         $"ON CONFLICT ({idColumn}, {consumerColumn}) DO NOTHING RETURNING {idColumn}, {consumerColumn}; SET LOCAL lock_timeout TO DEFAULT";
        }
    }

    public SqlDialect Dialect { get; }

    public static SqlDialect DialectOf(DbContext context)
    {
        string? provider = context.Database.ProviderName;
        return provider switch
        {
            PostgresProvider => SqlDialect.PostgreSql,
            SqliteProvider => SqlDialect.Sqlite,
            _ => throw new NotSupportedException(
                $"ExactlyOnce: the EF Core provider '{provider}' is not supported; use PostgreSQL (Npgsql) or SQLite."),
        };
    }

    public string Table { get; }

    public string TableDisplayName { get; }

    public string Claim { get; }

    public string DeleteClaim { get; }

    /// <summary>PostgreSQL only (SQLite claims key by key inside the batch's transaction).</summary>
    public string? BatchClaim { get; }

    public static InboxSql For(DbContext context) => Cache.GetValue(context.Model, _ => new InboxSql(context));

    public void AddClaimParameters(DbCommand command, InboxKey key, DateTime receivedAtUtc, DateTime processedAtUtc)
    {
        AddKeyParameters(command, key);
        command.Parameters.Add(_timeMapping.CreateParameter(command, "eo_received", DateTime.SpecifyKind(receivedAtUtc, DateTimeKind.Utc), nullable: false));
        command.Parameters.Add(_timeMapping.CreateParameter(command, "eo_processed", DateTime.SpecifyKind(processedAtUtc, DateTimeKind.Utc), nullable: false));
    }

    public void AddKeyParameters(DbCommand command, InboxKey key)
    {
        command.Parameters.Add(_idMapping.CreateParameter(command, "eo_id", key.MessageId, nullable: false));
        command.Parameters.Add(_consumerMapping.CreateParameter(command, "eo_consumer", key.ConsumerName, nullable: false));
    }

    /// <summary>The keys and their receive times as three parallel arrays (uuid[], text[], timestamptz[]) for unnest, and the processed time.</summary>
    public void AddBatchClaimParameters(DbCommand command, IReadOnlyList<InboxKey> keys, IReadOnlyList<DateTime> receivedAtUtc, DateTime processedAtUtc)
    {
        AddArrayParameter(command, "eo_ids", keys.Select(static k => k.MessageId).ToArray());
        AddArrayParameter(command, "eo_consumers", keys.Select(static k => k.ConsumerName).ToArray());
        AddArrayParameter(command, "eo_received", receivedAtUtc.Select(static t => DateTime.SpecifyKind(t, DateTimeKind.Utc)).ToArray());
        command.Parameters.Add(_timeMapping.CreateParameter(command, "eo_processed", DateTime.SpecifyKind(processedAtUtc, DateTimeKind.Utc), nullable: false));
    }

    private static void AddArrayParameter<T>(DbCommand command, string name, T[] values)
    {
        DbParameter parameter = command.CreateParameter();
        parameter.ParameterName = name;
        parameter.Value = values;
        command.Parameters.Add(parameter);
    }

    public static void AddTimeoutParameter(DbCommand command, TimeSpan timeout)
    {
        DbParameter parameter = command.CreateParameter();
        parameter.ParameterName = "eo_timeout";
        parameter.DbType = System.Data.DbType.String;
        long milliseconds = Math.Max(1, (long)Math.Ceiling(timeout.TotalMilliseconds));
        parameter.Value = milliseconds.ToString(System.Globalization.CultureInfo.InvariantCulture) + "ms";
        command.Parameters.Add(parameter);
    }
}
