using System.Data.Common;
using ExactlyOnce.Telemetry;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.Logging;

namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>How the inbox statements' database errors are recognised and reported, in both modes.</summary>
internal static class InboxStoreErrors
{
    public static bool IsLockTimeout(InboxSql sql, DbException exception) => sql.Dialect switch
    {
        SqlDialect.PostgreSql => exception.SqlState == "55P03", // lock_not_available
        _ => IsSqliteBusy(exception),
    };

    public static bool IsDeadlock(InboxSql sql, DbException exception) =>
        sql.Dialect == SqlDialect.PostgreSql && exception.SqlState == "40P01"; // deadlock_detected

    public static bool IsMissingTable(InboxSql sql, DbException exception) => sql.Dialect switch
    {
        SqlDialect.PostgreSql => exception.SqlState == "42P01", // undefined_table
        _ => exception.Message.Contains("no such table", StringComparison.OrdinalIgnoreCase),
    };

    // SQLITE_BUSY (5) and SQLITE_LOCKED (6); Microsoft.Data.Sqlite reports the primary code as ErrorCode.
    public static bool IsSqliteBusy(DbException exception) => exception.ErrorCode is 5 or 6;

    public static InboxSchemaMissingException SchemaMissing(InboxSql sql, DbContext context, DbException exception, ILogger logger)
    {
        Log.SchemaMissing(logger, sql.TableDisplayName);
        // Not wrapped: transports report the innermost exception's message (MassTransit's MT-Fault-Message), and the
        // operator must read this one, not the provider's "relation does not exist".
        return new InboxSchemaMissingException(
            $"ExactlyOnce: the inbox table '{sql.TableDisplayName}' does not exist. Call modelBuilder.AddExactlyOnceInbox() in " +
            $"{context.GetType().Name}.OnModelCreating, then create and apply the migration: " +
            $"dotnet ef migrations add AddExactlyOnceInbox && dotnet ef database update. (Database error: {exception.Message})");
    }
}
