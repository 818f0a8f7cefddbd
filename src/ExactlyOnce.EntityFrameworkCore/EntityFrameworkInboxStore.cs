using System.Data.Common;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Infrastructure;
using Microsoft.EntityFrameworkCore.Storage;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Logging;
using Microsoft.Extensions.Options;

namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>
/// The inbox on the consume scope's own <typeparamref name="TDbContext"/> — the very instance the consumer gets
/// from DI — so the claim (written already marked processed) and the consumer's writes share one connection and one
/// transaction.
/// </summary>
/// <remarks>
/// In batched mode the same context joins a batch instead: it is pointed at the batch's connection (never owning it)
/// and uses the batch's transaction, and is pointed back at its own configuration when it leaves, so a pooled context
/// goes back to the pool as it came.
/// <para>
/// Inside the inbox's transaction EF Core's automatic savepoints are off (unless
/// <see cref="ExactlyOnceOptions.KeepSaveChangesSavepoints"/>): the attempt is all or nothing anyway, so a savepoint per
/// <c>SaveChanges</c> only costs a <c>SAVEPOINT</c>/<c>RELEASE SAVEPOINT</c> pair. The price is that a failed
/// <c>SaveChanges</c> can no longer be undone on its own, so one the consumer caught and went on from fails the attempt
/// here, before anything is committed; batched mode then rolls the member back to the batch's own savepoint. The context's
/// own setting is restored when the attempt (or the member's turn) ends.
/// </para>
/// </remarks>
internal sealed class EntityFrameworkInboxStore<TDbContext> : IInboxBatchStore
    where TDbContext : DbContext
{
    private readonly TDbContext _context;
    private readonly IServiceScopeFactory _scopes;
    private readonly OutboxCommitNotifier _notifier;
    private readonly ILogger _logger;
    private readonly bool _keepSavepoints;
    private readonly bool _prepare;
    private IDbContextTransaction? _transaction;
    private bool? _autoSavepointsBefore; // the context's own setting, while the inbox has turned savepoints off
    private Exception? _failedSave;
    private InboxSql? _sql;
    private EntityFrameworkInboxBatch? _joined;
    private readonly InboxContext? _inboxContext;

    public EntityFrameworkInboxStore(
        TDbContext context,
        IServiceScopeFactory scopes,
        OutboxCommitNotifier notifier,
        IOptions<ExactlyOnceOptions> options,
        ILogger<EntityFrameworkInboxStore<TDbContext>> logger,
        InboxContext? inboxContext = null)
    {
        _inboxContext = inboxContext;
        _context = context;
        _scopes = scopes;
        _notifier = notifier;
        _keepSavepoints = options.Value.KeepSaveChangesSavepoints;
        _prepare = options.Value.PrepareStatements;
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
        _inboxContext?.BeginAttempt();
        InboxSql sql = Sql;
        try
        {
            _transaction = await _context.Database.BeginTransactionAsync(cancellationToken).ConfigureAwait(false);
        }
        catch (DbException exception) when (sql.Dialect == SqlDialect.Sqlite && InboxStoreErrors.IsSqliteBusy(exception))
        {
            throw new InboxClaimTimeoutException("The SQLite database stayed locked by another transaction beyond the busy timeout.", exception);
        }

        SuspendAutoSavepoints();
    }

    public async Task<bool> TryClaimAsync(InboxKey key, DateTime receivedAtUtc, DateTime processedAtUtc, TimeSpan timeout, CancellationToken cancellationToken = default)
    {
        InboxSql sql = Sql;
        DbCommand command = CreateCommand(sql.Claim);
        await using var commandScope = command.ConfigureAwait(false);
        sql.AddClaimParameters(command, key, receivedAtUtc, processedAtUtc);
        try
        {
            if (sql.Dialect == SqlDialect.PostgreSql)
            {
                InboxSql.AddTimeoutParameter(command, timeout);
                if (_prepare)
                {
                    // No round trip once prepared on this physical connection: Npgsql keeps it across pooled uses.
                    await command.PrepareAsync(cancellationToken).ConfigureAwait(false);
                }

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
        catch (DbException exception) when (InboxStoreErrors.IsLockTimeout(sql, exception))
        {
            throw new InboxClaimTimeoutException(
                $"Another delivery of message {key.MessageId} for consumer '{key.ConsumerName}' held its claim longer than {timeout}.", exception);
        }
        catch (DbException exception) when (InboxStoreErrors.IsMissingTable(sql, exception))
        {
            throw InboxStoreErrors.SchemaMissing(sql, _context, exception, _logger);
        }
    }

    public async Task CompleteAsync(CancellationToken cancellationToken = default)
    {
        IDbContextTransaction transaction = _transaction ?? throw new InvalidOperationException("ExactlyOnce: no inbox transaction to complete.");

        ThrowIfASaveFailed();
        // Whatever the consumer left pending is part of its unit of work.
        await _context.SaveChangesAsync(cancellationToken).ConfigureAwait(false);

        await transaction.CommitAsync(cancellationToken).ConfigureAwait(false);
        RestoreAutoSavepoints();
        await transaction.DisposeAsync().ConfigureAwait(false);
        _transaction = null;
    }

    public async Task RollbackAsync(CancellationToken cancellationToken = default)
    {
        IDbContextTransaction? transaction = _transaction;
        _transaction = null;
        _context.ChangeTracker.Clear();
        RestoreAutoSavepoints();
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

    public Task<IInboxBatch> CreateBatchAsync(CancellationToken cancellationToken = default)
    {
        // The batch's connection belongs to a scope of its own, not to any member: a member that fails returns early and
        // its scope is disposed while the batch goes on.
        AsyncServiceScope scope = _scopes.CreateAsyncScope();
        try
        {
            TDbContext leader = scope.ServiceProvider.GetRequiredService<TDbContext>();
            return Task.FromResult<IInboxBatch>(new EntityFrameworkInboxBatch(scope, leader, Sql, _notifier, _prepare, _logger));
        }
        catch
        {
            scope.Dispose();
            throw;
        }
    }

    public async Task JoinBatchAsync(IInboxBatch batch, CancellationToken cancellationToken = default)
    {
        var unit = (EntityFrameworkInboxBatch)batch;
        if (_transaction is not null || (_joined is null && _context.Database.CurrentTransaction is not null))
        {
            throw new InvalidOperationException(
                $"ExactlyOnce: {typeof(TDbContext).Name} already has an open transaction when the inbox batch begins. The inbox owns the " +
                "consume transaction; consumers must not begin or commit their own.");
        }

        _context.ChangeTracker.Clear();
        _inboxContext?.BeginAttempt();
        if (!ReferenceEquals(_joined, unit))
        {
            _context.Database.SetDbConnection(unit.Connection, contextOwnsConnection: false);
            _joined = unit;
        }

        await _context.Database.UseTransactionAsync(unit.Transaction, cancellationToken).ConfigureAwait(false);
        unit.Enlist(_context);
        SuspendAutoSavepoints();
    }

    public Task SaveBatchMemberAsync(CancellationToken cancellationToken = default)
    {
        // Thrown, the member's turn fails and the batch rolls it back to its own savepoint: its batch-mates go on.
        ThrowIfASaveFailed();
        return _context.SaveChangesAsync(cancellationToken);
    }

    public async Task LeaveBatchAsync()
    {
        RestoreAutoSavepoints();
        if (_joined is null)
        {
            return;
        }

        _joined = null;
        _context.ChangeTracker.Clear();
        await _context.Database.UseTransactionAsync(null).ConfigureAwait(false);
        // Back to the context's own configuration: its configured connection, or a connection string / data source from
        // which it creates (and owns) a connection on its next use.
        var relational = RelationalOptionsExtension.Extract(_context.GetService<IDbContextOptions>());
        if (relational.Connection is { } configured)
        {
            _context.Database.SetDbConnection(configured, relational.IsConnectionOwned);
        }
        else
        {
            _context.Database.SetDbConnection(null, contextOwnsConnection: true);
            if (relational.ConnectionString is { } connectionString)
            {
                _context.Database.SetConnectionString(connectionString);
            }
        }
    }

    private void SuspendAutoSavepoints()
    {
        _failedSave = null;
        if (_keepSavepoints || _autoSavepointsBefore is not null)
        {
            return;
        }

        _autoSavepointsBefore = _context.Database.AutoSavepointsEnabled;
        _context.Database.AutoSavepointsEnabled = false;
        _context.SaveChangesFailed += OnSaveChangesFailed;
    }

    private void RestoreAutoSavepoints()
    {
        if (_autoSavepointsBefore is not { } before)
        {
            return;
        }

        _context.SaveChangesFailed -= OnSaveChangesFailed;
        _context.Database.AutoSavepointsEnabled = before;
        _autoSavepointsBefore = null;
    }

    private void OnSaveChangesFailed(object? sender, SaveChangesFailedEventArgs e) => _failedSave ??= e.Exception;

    // A failed save without its savepoint may have left some of its statements applied (SQLite, or a concurrency
    // conflict detected after the fact) or the whole transaction aborted (PostgreSQL): never commit on top of it.
    private void ThrowIfASaveFailed()
    {
        if (_failedSave is { } failure)
        {
            throw new InvalidOperationException(
                "ExactlyOnce: a SaveChanges failed during this delivery and the consumer carried on. Inside the inbox's transaction " +
                "EF Core's per-SaveChanges savepoints are off, so the failed save cannot be undone on its own: the whole attempt is " +
                "rolled back and the delivery retried. Rethrow the exception, or set ExactlyOnceOptions.KeepSaveChangesSavepoints = " +
                "true to recover from a failed save and go on.",
                failure);
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
}
