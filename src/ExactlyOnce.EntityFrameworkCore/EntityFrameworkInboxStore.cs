using System.Data.Common;
using ExactlyOnce.Telemetry;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Storage;
using Microsoft.Extensions.Logging;

namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>
/// The inbox on the consume scope's own <typeparamref name="TDbContext"/> — the very instance the consumer gets
/// from DI — so the claim, the consumer's writes and the processed mark share one connection and one transaction.
/// </summary>
internal sealed class EntityFrameworkInboxStore<TDbContext> : IInboxStore
    where TDbContext : DbContext
{
    private readonly TDbContext _context;
    private readonly ILogger _logger;
    private IDbContextTransaction? _transaction;
    private InboxSql? _sql;

    public EntityFrameworkInboxStore(TDbContext context, ILogger<EntityFrameworkInboxStore<TDbContext>> logger)
    {
        _context = context;
        _logger = logger;
    }

    // Built once per model and cached there; kept here too so the per-message path does not look it up three times.
    private InboxSql Sql => _sql ??= InboxSql.For(_context);

    public Task<TResult> ExecuteAsync<TResult>(Func<CancellationToken, Task<TResult>> attempt, CancellationToken cancellationToken = default) =>
        _context.Database.CreateExecutionStrategy().ExecuteAsync(attempt, static (a, ct) => a(ct), cancellationToken);

    public async Task BeginAsync(CancellationToken cancellationToken = default)
    {
        if (_context.Database.CurrentTransaction is not null)
        {
            throw new InvalidOperationException(
                $"ExactlyOnce: {typeof(TDbContext).Name} already has an open transaction when the inbox begins. The inbox owns the " +
                "consume transaction; consumers must not begin or commit their own.");
        }

        // Each attempt starts from a clean change tracker: nothing a failed attempt tracked may leak into this one.
        _context.ChangeTracker.Clear();
        InboxSql sql = Sql;
        try
        {
            _transaction = await _context.Database.BeginTransactionAsync(cancellationToken).ConfigureAwait(false);
        }
        catch (DbException exception) when (sql.Dialect == SqlDialect.Sqlite && IsSqliteBusy(exception))
        {
            throw new InboxClaimTimeoutException("The SQLite database stayed locked by another transaction beyond the busy timeout.", exception);
        }
    }

    public async Task<bool> TryClaimAsync(InboxKey key, DateTime receivedAtUtc, TimeSpan timeout, CancellationToken cancellationToken = default)
    {
        InboxSql sql = Sql;
        DbCommand command = CreateCommand(sql.Claim);
        await using var commandScope = command.ConfigureAwait(false);
        sql.AddKeyParameters(command, key, receivedAtUtc);
        try
        {
            if (sql.Dialect == SqlDialect.PostgreSql)
            {
                InboxSql.AddTimeoutParameter(command, timeout);
                DbDataReader reader = await command.ExecuteReaderAsync(cancellationToken).ConfigureAwait(false);
                await using var readerScope = reader.ConfigureAwait(false);
                await reader.NextResultAsync(cancellationToken).ConfigureAwait(false); // past set_config's row
                bool inserted = await reader.ReadAsync(cancellationToken).ConfigureAwait(false);
                while (await reader.NextResultAsync(cancellationToken).ConfigureAwait(false))
                {
                }

                return inserted;
            }

            command.CommandTimeout = Math.Max(1, (int)Math.Ceiling(timeout.TotalSeconds));
            return await command.ExecuteNonQueryAsync(cancellationToken).ConfigureAwait(false) == 1;
        }
        catch (DbException exception) when (IsLockTimeout(sql, exception))
        {
            throw new InboxClaimTimeoutException(
                $"Another delivery of message {key.MessageId} for consumer '{key.ConsumerName}' held its claim longer than {timeout}.", exception);
        }
        catch (DbException exception) when (IsMissingTable(sql, exception))
        {
            Log.SchemaMissing(_logger, sql.TableDisplayName);
            // Not wrapped: transports report the innermost exception's message (MassTransit's MT-Fault-Message), and the
            // operator must read this one, not the provider's "relation does not exist".
            throw new InboxSchemaMissingException(
                $"ExactlyOnce: the inbox table '{sql.TableDisplayName}' does not exist. Call modelBuilder.AddExactlyOnceInbox() in " +
                $"{typeof(TDbContext).Name}.OnModelCreating, then create and apply the migration: " +
                $"dotnet ef migrations add AddExactlyOnceInbox && dotnet ef database update. (Database error: {exception.Message})");
        }
    }

    public async Task CompleteAsync(InboxKey key, DateTime processedAtUtc, CancellationToken cancellationToken = default)
    {
        IDbContextTransaction transaction = _transaction ?? throw new InvalidOperationException("ExactlyOnce: no inbox transaction to complete.");

        // Whatever the consumer left pending is part of its unit of work.
        await _context.SaveChangesAsync(cancellationToken).ConfigureAwait(false);

        InboxSql sql = Sql;
        DbCommand command = CreateCommand(sql.MarkProcessed);
        await using (command.ConfigureAwait(false))
        {
            sql.AddKeyParameters(command, key, processedAtUtc);
            int updated = await command.ExecuteNonQueryAsync(cancellationToken).ConfigureAwait(false);
            if (updated != 1)
            {
                throw new InvalidOperationException(
                    $"ExactlyOnce: the claim of message {key.MessageId} for consumer '{key.ConsumerName}' vanished inside its own transaction " +
                    "(did the consumer delete inbox rows?); rolling back.");
            }
        }

        await transaction.CommitAsync(cancellationToken).ConfigureAwait(false);
        await transaction.DisposeAsync().ConfigureAwait(false);
        _transaction = null;
    }

    public async Task RollbackAsync(CancellationToken cancellationToken = default)
    {
        IDbContextTransaction? transaction = _transaction;
        _transaction = null;
        _context.ChangeTracker.Clear();
        if (transaction is null)
        {
            return;
        }

        try
        {
            await transaction.RollbackAsync(cancellationToken).ConfigureAwait(false);
        }
        catch (DbException)
        {
            // The connection is gone: the server has rolled the transaction back already.
        }
        catch (InvalidOperationException)
        {
            // The connection was closed under us (e.g. broken): same as above.
        }
        finally
        {
            await transaction.DisposeAsync().ConfigureAwait(false);
        }
    }

    private DbCommand CreateCommand(string text)
    {
        DbCommand command = _context.Database.GetDbConnection().CreateCommand();
        command.CommandText = text;
        command.Transaction = _transaction?.GetDbTransaction()
            ?? throw new InvalidOperationException("ExactlyOnce: the inbox transaction has not begun.");
        return command;
    }

    private static bool IsLockTimeout(InboxSql sql, DbException exception) => sql.Dialect switch
    {
        SqlDialect.PostgreSql => exception.SqlState == "55P03", // lock_not_available
        _ => IsSqliteBusy(exception),
    };

    private static bool IsMissingTable(InboxSql sql, DbException exception) => sql.Dialect switch
    {
        SqlDialect.PostgreSql => exception.SqlState == "42P01", // undefined_table
        _ => exception.Message.Contains("no such table", StringComparison.OrdinalIgnoreCase),
    };

    // SQLITE_BUSY (5) and SQLITE_LOCKED (6); Microsoft.Data.Sqlite reports the primary code as ErrorCode.
    private static bool IsSqliteBusy(DbException exception) => exception.ErrorCode is 5 or 6;
}
