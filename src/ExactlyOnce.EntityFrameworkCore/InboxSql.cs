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

        string insert = $"INSERT INTO {Table} ({idColumn}, {consumerColumn}, {receivedColumn}) VALUES (@eo_id, @eo_consumer, @eo_time) " +
                        $"ON CONFLICT ({idColumn}, {consumerColumn}) DO NOTHING";
        Claim = Dialect == SqlDialect.PostgreSql
            // One round trip: bound the lock wait for the claim alone, claim, then restore the session's lock timeout
            // so the consumer's own statements are not affected. RETURNING tells whether a row was inserted.
            ? $"SELECT set_config('lock_timeout', @eo_timeout, true); {insert} RETURNING 1; SET LOCAL lock_timeout TO DEFAULT"
            : insert;
        MarkProcessed = $"UPDATE {Table} SET {processedColumn} = @eo_time WHERE {idColumn} = @eo_id AND {consumerColumn} = @eo_consumer";
        DeleteClaim = $"DELETE FROM {Table} WHERE {idColumn} = @eo_id AND {consumerColumn} = @eo_consumer";
        if (Dialect == SqlDialect.PostgreSql)
        {
            // Batched mode: every key in one statement, inserted in key order so that two batches with overlapping keys
            // take their row locks in the same order and cannot deadlock on each other's claims.
            BatchClaim = "SELECT set_config('lock_timeout', @eo_timeout, true); " +
                         $"INSERT INTO {Table} ({idColumn}, {consumerColumn}, {receivedColumn}) " +
                         "SELECT k.id, k.consumer, @eo_time FROM unnest(@eo_ids, @eo_consumers) AS k(id, consumer) ORDER BY k.id, k.consumer " +
                         $"ON CONFLICT ({idColumn}, {consumerColumn}) DO NOTHING RETURNING {idColumn}, {consumerColumn}; SET LOCAL lock_timeout TO DEFAULT";
            BatchMarkProcessed = $"UPDATE {Table} AS t SET {processedColumn} = @eo_time FROM unnest(@eo_ids, @eo_consumers) AS k(id, consumer) " +
                                 $"WHERE t.{idColumn} = k.id AND t.{consumerColumn} = k.consumer";
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

    public string MarkProcessed { get; }

    public string DeleteClaim { get; }

    /// <summary>PostgreSQL only (SQLite claims key by key inside the batch's transaction).</summary>
    public string? BatchClaim { get; }

    /// <summary>PostgreSQL only.</summary>
    public string? BatchMarkProcessed { get; }

    public static InboxSql For(DbContext context) => Cache.GetValue(context.Model, _ => new InboxSql(context));

    public void AddKeyParameters(DbCommand command, InboxKey key, DateTime timeUtc)
    {
        AddKeyParameters(command, key);
        command.Parameters.Add(_timeMapping.CreateParameter(command, "eo_time", DateTime.SpecifyKind(timeUtc, DateTimeKind.Utc), nullable: false));
    }

    public void AddKeyParameters(DbCommand command, InboxKey key)
    {
        command.Parameters.Add(_idMapping.CreateParameter(command, "eo_id", key.MessageId, nullable: false));
        command.Parameters.Add(_consumerMapping.CreateParameter(command, "eo_consumer", key.ConsumerName, nullable: false));
    }

    /// <summary>The keys as two parallel arrays (uuid[] and text[]) for unnest, and the time.</summary>
    public void AddBatchParameters(DbCommand command, IReadOnlyList<InboxKey> keys, DateTime timeUtc)
    {
        DbParameter ids = command.CreateParameter();
        ids.ParameterName = "eo_ids";
        ids.Value = keys.Select(k => k.MessageId).ToArray();
        command.Parameters.Add(ids);
        DbParameter consumers = command.CreateParameter();
        consumers.ParameterName = "eo_consumers";
        consumers.Value = keys.Select(k => k.ConsumerName).ToArray();
        command.Parameters.Add(consumers);
        command.Parameters.Add(_timeMapping.CreateParameter(command, "eo_time", DateTime.SpecifyKind(timeUtc, DateTimeKind.Utc), nullable: false));
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
