using System.Data;
using System.Data.Common;
using System.Runtime.CompilerServices;
using ExactlyOnce.Outbox;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Diagnostics;

namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>
/// Wakes the outbox dispatchers right after a unit of work that wrote outbox rows has committed: the in-process
/// signal, and on PostgreSQL a NOTIFY that dispatchers in other processes LISTEN for. Sent after the commit, so a
/// woken dispatcher always finds the rows; if a wake-up is lost, the dispatcher's polling still finds them.
/// </summary>
internal sealed class OutboxCommitNotifier(OutboxSignal signal)
{
    private static readonly ConditionalWeakTable<DbContext, object> Pending = [];

    /// <summary>Called by the outbox writer: this context's next commit carries outbox rows.</summary>
    public static void MarkWritingOutbox(DbContext context) => Pending.AddOrUpdate(context, Pending);

    public static void Clear(DbContext? context)
    {
        if (context is not null)
        {
            Pending.Remove(context);
        }
    }

    /// <summary>Forgets and reports whether <paramref name="context"/> wrote outbox rows since its last commit.</summary>
    public static bool TakePending(DbContext context) => Pending.Remove(context);

    public Task CommittedAsync(DbContext? context, CancellationToken cancellationToken) =>
        context is not null && Pending.Remove(context) ? WakeAsync(context, cancellationToken) : Task.CompletedTask;

    /// <summary>Wakes the dispatchers: the in-process signal, and a NOTIFY on <paramref name="context"/>'s connection (PostgreSQL).</summary>
    public async Task WakeAsync(DbContext context, CancellationToken cancellationToken)
    {
        signal.Notify();
        if (InboxSql.DialectOf(context) != SqlDialect.PostgreSql)
        {
            return;
        }

        try
        {
            DbConnection connection = context.Database.GetDbConnection();
            bool open = connection.State == ConnectionState.Open;
            if (!open)
            {
                await connection.OpenAsync(cancellationToken).ConfigureAwait(false);
            }

            try
            {
                DbCommand command = connection.CreateCommand();
                await using (command.ConfigureAwait(false))
                {
                    command.CommandText = "SELECT pg_notify('" + OutboxSql.NotifyChannel + "', '')";
                    await command.ExecuteNonQueryAsync(cancellationToken).ConfigureAwait(false);
                }
            }
            finally
            {
                if (!open)
                {
                    await connection.CloseAsync().ConfigureAwait(false);
                }
            }
        }
        catch (DbException)
        {
            // Only a wake-up: the data is committed, and the dispatchers poll.
        }
    }
}

internal sealed class OutboxSaveChangesInterceptor(OutboxCommitNotifier notifier) : SaveChangesInterceptor
{
    public override int SavedChanges(SaveChangesCompletedEventData eventData, int result)
    {
        if (eventData.Context?.Database.CurrentTransaction is null)
        {
            notifier.CommittedAsync(eventData.Context, CancellationToken.None).GetAwaiter().GetResult();
        }

        return result;
    }

    public override async ValueTask<int> SavedChangesAsync(SaveChangesCompletedEventData eventData, int result, CancellationToken cancellationToken = default)
    {
        // Without an explicit transaction SaveChanges committed on its own; with one, the commit interceptor fires.
        if (eventData.Context?.Database.CurrentTransaction is null)
        {
            await notifier.CommittedAsync(eventData.Context, cancellationToken).ConfigureAwait(false);
        }

        return result;
    }

    // A failed SaveChanges leaves the rows tracked as Added: a retried SaveChanges still wakes the dispatcher.
}

internal sealed class OutboxTransactionInterceptor(OutboxCommitNotifier notifier) : DbTransactionInterceptor
{
    public override void TransactionCommitted(DbTransaction transaction, TransactionEndEventData eventData) =>
        notifier.CommittedAsync(eventData.Context, CancellationToken.None).GetAwaiter().GetResult();

    public override Task TransactionCommittedAsync(DbTransaction transaction, TransactionEndEventData eventData, CancellationToken cancellationToken = default) =>
        notifier.CommittedAsync(eventData.Context, cancellationToken);

    public override void TransactionRolledBack(DbTransaction transaction, TransactionEndEventData eventData) =>
        OutboxCommitNotifier.Clear(eventData.Context);

    public override Task TransactionRolledBackAsync(DbTransaction transaction, TransactionEndEventData eventData, CancellationToken cancellationToken = default)
    {
        OutboxCommitNotifier.Clear(eventData.Context);
        return Task.CompletedTask;
    }
}
