using System.Data.Common;
using System.Globalization;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Storage;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Logging;

namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>
/// The shared transaction of a batch of deliveries, on a context of its own scope (the leader): it owns the connection,
/// begins and commits through EF Core (so the user's transaction interceptors see the one commit), and the members'
/// contexts join its connection and transaction for their turns.
/// </summary>
internal sealed class EntityFrameworkInboxBatch : IInboxBatch
{
    private readonly AsyncServiceScope _scope;
    private readonly DbContext _leader;
    private readonly InboxSql _sql;
    private readonly OutboxCommitNotifier _notifier;
    private readonly bool _prepare;
    private readonly ILogger _logger;
    private readonly List<DbContext> _members = [];
    private IDbContextTransaction? _transaction;

    public EntityFrameworkInboxBatch(AsyncServiceScope scope, DbContext leader, InboxSql sql, OutboxCommitNotifier notifier, bool prepare, ILogger logger)
    {
        _scope = scope;
        _leader = leader;
        _sql = sql;
        _notifier = notifier;
        _prepare = prepare;
        _logger = logger;
    }

    public DbConnection Connection => _leader.Database.GetDbConnection();

    public DbTransaction Transaction => _transaction?.GetDbTransaction()
        ?? throw new InvalidOperationException("ExactlyOnce: the inbox batch has no transaction.");

    /// <summary>A member's context joined this attempt: after the commit, its outbox rows (if any) wake the dispatchers.</summary>
    public void Enlist(DbContext member) => _members.Add(member);

    public Task<TResult> ExecuteAsync<TResult>(Func<CancellationToken, Task<TResult>> attempt, CancellationToken cancellationToken = default) =>
        _leader.Database.CreateExecutionStrategy().ExecuteAsync(attempt, static (a, ct) => a(ct), cancellationToken);

    public async Task BeginAsync(CancellationToken cancellationToken = default)
    {
        _members.Clear();
        try
        {
            _transaction = await _leader.Database.BeginTransactionAsync(cancellationToken).ConfigureAwait(false);
        }
        catch (DbException exception) when (_sql.Dialect == SqlDialect.Sqlite && InboxStoreErrors.IsSqliteBusy(exception))
        {
            throw new InboxClaimTimeoutException("The SQLite database stayed locked by another transaction beyond the busy timeout.", exception);
        }
    }

    public async Task<IReadOnlySet<InboxKey>> ClaimAsync(
        IReadOnlyList<InboxKey> keys, IReadOnlyList<DateTime> receivedAtUtc, DateTime processedAtUtc, TimeSpan timeout, CancellationToken cancellationToken = default)
    {
        var claimed = new HashSet<InboxKey>();
        try
        {
            if (_sql.Dialect == SqlDialect.PostgreSql)
            {
                DbCommand command = CreateCommand(_sql.BatchClaim!);
                await using var commandScope = command.ConfigureAwait(false);
                _sql.AddBatchClaimParameters(command, keys, receivedAtUtc, processedAtUtc);
                InboxSql.AddTimeoutParameter(command, timeout);
                if (_prepare)
                {
                    await command.PrepareAsync(cancellationToken).ConfigureAwait(false);
                }

                DbDataReader reader = await command.ExecuteReaderAsync(cancellationToken).ConfigureAwait(false);
                await using var readerScope = reader.ConfigureAwait(false);
                await reader.NextResultAsync(cancellationToken).ConfigureAwait(false); // past set_config's row
                while (await reader.ReadAsync(cancellationToken).ConfigureAwait(false))
                {
                    claimed.Add(new InboxKey(reader.GetGuid(0), reader.GetString(1)));
                }

                while (await reader.NextResultAsync(cancellationToken).ConfigureAwait(false))
                {
                }

                return claimed;
            }

            // SQLite: the transaction already holds the database's write lock (BEGIN IMMEDIATE), so key by key is one
            // uncontended pass; there is nothing to wait for and nothing to order.
            for (int i = 0; i < keys.Count; i++)
            {
                InboxKey key = keys[i];
                DbCommand command = CreateCommand(_sql.Claim);
                await using var commandScope = command.ConfigureAwait(false);
                _sql.AddClaimParameters(command, key, receivedAtUtc[i], processedAtUtc);
                command.CommandTimeout = Math.Max(1, (int)Math.Ceiling(timeout.TotalSeconds));
                if (await command.ExecuteNonQueryAsync(cancellationToken).ConfigureAwait(false) == 1)
                {
                    claimed.Add(key);
                }
            }

            return claimed;
        }
        catch (DbException exception) when (InboxStoreErrors.IsLockTimeout(_sql, exception) || InboxStoreErrors.IsDeadlock(_sql, exception))
        {
            throw new InboxClaimTimeoutException(
                $"A batch of {keys.Count} deliveries could not claim its keys within {timeout}: another delivery held one of them, or the claim deadlocked.", exception);
        }
        catch (DbException exception) when (InboxStoreErrors.IsMissingTable(_sql, exception))
        {
            throw InboxStoreErrors.SchemaMissing(_sql, _leader, exception, _logger);
        }
    }

    public Task SavepointAsync(int member, CancellationToken cancellationToken = default) =>
        Transaction.SaveAsync(SavepointName(member), cancellationToken);

    public async Task RollbackMemberAsync(int member, InboxKey key, CancellationToken cancellationToken = default)
    {
        await Transaction.RollbackAsync(SavepointName(member), cancellationToken).ConfigureAwait(false);
        // The claim was inserted before the savepoint (all keys in one statement): delete it, so the key is free again
        // once this transaction ends and a waiting or retried delivery can claim it.
        DbCommand command = CreateCommand(_sql.DeleteClaim);
        await using (command.ConfigureAwait(false))
        {
            _sql.AddKeyParameters(command, key);
            await command.ExecuteNonQueryAsync(cancellationToken).ConfigureAwait(false);
        }
    }

    public async Task CompleteAsync(CancellationToken cancellationToken = default)
    {
        IDbContextTransaction transaction = _transaction ?? throw new InvalidOperationException("ExactlyOnce: no inbox batch transaction to complete.");
        await transaction.CommitAsync(cancellationToken).ConfigureAwait(false);
        await transaction.DisposeAsync().ConfigureAwait(false);
        _transaction = null;

        // The members saved their outbox rows through their own contexts, which never commit themselves: the commit
        // interceptor saw only this one. Wake the dispatchers once for the whole batch.
        bool wroteOutbox = false;
        foreach (DbContext member in _members)
        {
            wroteOutbox |= OutboxCommitNotifier.TakePending(member);
        }

        _members.Clear();
        if (wroteOutbox)
        {
            await _notifier.WakeAsync(_leader, cancellationToken).ConfigureAwait(false);
        }
    }

    public async Task RollbackAsync()
    {
        IDbContextTransaction? transaction = _transaction;
        _transaction = null;
        foreach (DbContext member in _members)
        {
            OutboxCommitNotifier.Clear(member);
        }

        _members.Clear();
        if (transaction is null)
        {
            return;
        }

        try
        {
            await transaction.RollbackAsync(CancellationToken.None).ConfigureAwait(false);
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

    public async ValueTask DisposeAsync()
    {
        await RollbackAsync().ConfigureAwait(false);
        await _scope.DisposeAsync().ConfigureAwait(false);
    }

    private static string SavepointName(int member) => "eo_member_" + member.ToString(CultureInfo.InvariantCulture);

    private DbCommand CreateCommand(string text)
    {
        DbCommand command = Connection.CreateCommand();
        command.CommandText = text;
        command.Transaction = Transaction;
        return command;
    }
}
