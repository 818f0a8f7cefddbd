using System.Data.Common;
using System.Runtime.CompilerServices;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Infrastructure;
using Microsoft.EntityFrameworkCore.Metadata;
using Microsoft.EntityFrameworkCore.Storage;

namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>The outbox statements for one model and provider, built from the model's mapping and cached per model.</summary>
internal sealed class OutboxSql
{
    public const string NotifyChannel = "exactlyonce_outbox";
    private static readonly ConditionalWeakTable<IModel, OutboxSql> Cache = [];
    private readonly RelationalTypeMapping _timeMapping;
    private readonly RelationalTypeMapping _sequenceMapping;
    private readonly RelationalTypeMapping _textMapping;

    private OutboxSql(DbContext context)
    {
        Dialect = InboxSql.DialectOf(context);
        IEntityType entity = context.Model.FindEntityType(typeof(OutboxMessage))
            ?? throw new InvalidOperationException(
                $"ExactlyOnce: the model of {context.GetType().Name} has no outbox. Call modelBuilder.AddExactlyOnceOutbox() (or AddExactlyOnce()) " +
                "in OnModelCreating, then add and apply a migration (dotnet ef migrations add AddExactlyOnceOutbox).");
        var sql = context.GetService<ISqlGenerationHelper>();
        string Column(string property) => sql.DelimitIdentifier(entity.FindProperty(property)!.GetColumnName());
        string table = sql.DelimitIdentifier(entity.GetTableName()!, entity.GetSchema());
        string sequence = Column(nameof(OutboxMessage.Sequence));
        string dispatchedAt = Column(nameof(OutboxMessage.DispatchedAt));
        string attempts = Column(nameof(OutboxMessage.Attempts));
        string nextAttemptAt = Column(nameof(OutboxMessage.NextAttemptAt));
        _timeMapping = entity.FindProperty(nameof(OutboxMessage.CreatedAt))!.GetRelationalTypeMapping();
        _sequenceMapping = entity.FindProperty(nameof(OutboxMessage.Sequence))!.GetRelationalTypeMapping();
        _textMapping = entity.FindProperty(nameof(OutboxMessage.LastError))!.GetRelationalTypeMapping();

        Claim = $"SELECT {sequence}, {Column(nameof(OutboxMessage.MessageId))}, {Column(nameof(OutboxMessage.MessageType))}, " +
                $"{Column(nameof(OutboxMessage.Body))}, {Column(nameof(OutboxMessage.Headers))}, {Column(nameof(OutboxMessage.Destination))}, " +
                $"{Column(nameof(OutboxMessage.CreatedAt))}, {attempts} FROM {table} " +
                $"WHERE {dispatchedAt} IS NULL AND ({nextAttemptAt} IS NULL OR {nextAttemptAt} <= @eo_now) " +
                $"ORDER BY {sequence} LIMIT @eo_limit" +
                // Other dispatchers skip locked rows instead of waiting on them. SQLite has one writer at a time.
                (Dialect == SqlDialect.PostgreSql ? " FOR UPDATE SKIP LOCKED" : "");
        MarkDispatchedPrefix = $"UPDATE {table} SET {dispatchedAt} = @eo_now, {attempts} = {attempts} + 1, {Column(nameof(OutboxMessage.LastError))} = NULL " +
                               $"WHERE {sequence} IN (";
        MarkFailed = $"UPDATE {table} SET {attempts} = {attempts} + 1, {Column(nameof(OutboxMessage.LastError))} = @eo_error, " +
                     $"{nextAttemptAt} = @eo_next WHERE {sequence} = @eo_sequence";
    }

    public SqlDialect Dialect { get; }

    public string Claim { get; }

    public string MarkDispatchedPrefix { get; }

    public string MarkFailed { get; }

    public static OutboxSql For(DbContext context) => Cache.GetValue(context.Model, _ => new OutboxSql(context));

    public void AddTime(DbCommand command, string name, DateTime utc) =>
        command.Parameters.Add(_timeMapping.CreateParameter(command, name, DateTime.SpecifyKind(utc, DateTimeKind.Utc), nullable: false));

    public void AddSequence(DbCommand command, string name, long value) =>
        command.Parameters.Add(_sequenceMapping.CreateParameter(command, name, value, nullable: false));

    public void AddText(DbCommand command, string name, string value) =>
        command.Parameters.Add(_textMapping.CreateParameter(command, name, value, nullable: true));

    public static void AddInt(DbCommand command, string name, int value)
    {
        DbParameter parameter = command.CreateParameter();
        parameter.ParameterName = name;
        parameter.DbType = System.Data.DbType.Int32;
        parameter.Value = value;
        command.Parameters.Add(parameter);
    }
}
