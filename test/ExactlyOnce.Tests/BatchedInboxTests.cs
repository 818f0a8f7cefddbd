using System.Collections.Concurrent;
using System.Data.Common;
using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Diagnostics;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.DependencyInjection.Extensions;
using Microsoft.Extensions.Diagnostics.Metrics.Testing;
using Microsoft.Extensions.Hosting;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>
/// What only batched mode has: several messages in one transaction, one of them failing, two copies of one id in one
/// batch. Each test records the PostgreSQL transaction id each consumer ran in (txid_current() on the consumer's own
/// context), so "these messages shared one transaction" is observed, not inferred.
/// </summary>
public sealed class BatchedInboxTests : PostgresRabbitTest
{
    private readonly ConcurrentDictionary<Guid, ConcurrentQueue<long>> _transactions = new();

    protected override bool Batched => true;

    [Fact]
    public async Task Batch_OneMessageFails_TheOthersInItsTransactionCommit_AndOnlyTheFailedOneIsRetried()
    {
        string queue = Queue("batch-fail");
        var counter = new DeliveryCounter();
        var holder = HoldWhileOthersArrive();
        var ids = Enumerable.Range(0, 10).Select(_ => NewId.NextGuid()).ToList();
        Guid failing = ids[5];
        Probe.AfterSave = (context, _) => context.MessageId == failing && Probe.Entries(failing, nameof(EffectConsumer)) == 1
            ? throw new InvalidOperationException("one message of the batch fails")
            : Task.CompletedTask;
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, e => e.UseMessageRetry(r => r.Immediate(3)), options: Window);

        await SendWhileHeldAsync(host, queue, counter, holder, () => Task.WhenAll(ids.Select(id => SendAsync(host, queue, id))), ids.Count);

        foreach (Guid id in ids)
        {
            Assert.Equal(1, await CountEffectsAsync(id));
            Assert.NotNull(Assert.Single(await InboxRowsAsync(id)).ProcessedAt);
            Assert.Equal(id == failing ? 2 : 1, Probe.Entries(id, nameof(EffectConsumer))); // only the failed one ran again
        }

        long[] failingAttempts = [.. _transactions[failing]];
        Assert.Equal(2, failingAttempts.Length);
        var sharedTheFailedTransaction = ids.Where(id => id != failing && _transactions[id].Single() == failingAttempts[0]).ToList();
        // Others ran in the very transaction whose member failed, and their effects committed (asserted above).
        Assert.True(sharedTheFailedTransaction.Count >= 2, $"{sharedTheFailedTransaction.Count} other messages shared the failed one's transaction");
        // The retry ran in a later transaction of its own.
        Assert.NotEqual(failingAttempts[0], failingAttempts[1]);
        Assert.DoesNotContain(ids, id => id != failing && _transactions[id].Contains(failingAttempts[1]));
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue + "_error"));
    }

    /// <summary>
    /// The batch's leader runs on a flow of its own, but each member's consumer runs on its delivery's: what the pipeline
    /// put in async locals before the inbox (a trace, a tenant, a log scope) is what the consumer sees — its own
    /// delivery's, not the leader's (none) nor a batch-mate's. Running the consumer from the leader's flow fails this.
    /// </summary>
    [Fact]
    public async Task Batch_EachConsumerSeesTheAsyncLocalsOfItsOwnDelivery_NotTheLeadersNorABatchMates()
    {
        string queue = Queue("batch-context");
        var counter = new DeliveryCounter();
        var seen = new ConcurrentDictionary<Guid, Guid?>();
        var holder = HoldWhileOthersArrive(context => seen[context.MessageId!.Value] = DeliveryScopeFilter.Delivery.Value);
        var ids = Enumerable.Range(0, 10).Select(_ => NewId.NextGuid()).ToList();
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, e => e.UseFilter(new DeliveryScopeFilter()), options: Window);

        await SendWhileHeldAsync(host, queue, counter, holder, () => Task.WhenAll(ids.Select(id => SendAsync(host, queue, id))), ids.Count);

        Assert.All(ids, id => Assert.Equal(id, seen[id]));
        int largestBatch = ids.GroupBy(id => _transactions[id].Single()).Max(g => g.Count());
        Assert.True(largestBatch >= 2, $"the messages shared transactions (largest: {largestBatch}), so the leader ran several consumers");
    }

    /// <summary>
    /// A transient commit failure under a retrying execution strategy re-runs the whole batch as one fresh transaction:
    /// every member's consumer runs again (with a cleared change tracker) and nothing is faulted or applied twice.
    /// </summary>
    [Fact]
    public async Task Batch_TransientCommitFailureWithRetryingStrategy_ReRunsTheWholeBatchAsOneFreshTransaction()
    {
        string queue = Queue("batch-strategy");
        var counter = new DeliveryCounter();
        var holder = HoldWhileOthersArrive();
        var failCommit = new FailingCommitInterceptor
        {
            Remaining = 1,
            Exception = () => new Npgsql.NpgsqlException("injected transient failure", new TimeoutException()),
        };
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, options: Window, database: o => o
            .UseNpgsql(ConnectionString, n => n.EnableRetryOnFailure(3, TimeSpan.FromMilliseconds(50), null))
            .AddInterceptors(failCommit));
        var ids = Enumerable.Range(0, 6).Select(_ => NewId.NextGuid()).ToList();

        await SendWhileHeldAsync(host, queue, counter, holder, () => Task.WhenAll(ids.Select(id => SendAsync(host, queue, id))), ids.Count);

        Assert.Equal(1, failCommit.Failed);
        Assert.Equal(0, counter.Faulted);
        Assert.All(ids, id => Assert.True(Probe.Entries(id, nameof(EffectConsumer)) is 1 or 2));
        var rerun = ids.Where(id => Probe.Entries(id, nameof(EffectConsumer)) == 2).ToList();
        // The failed commit was one batch of several messages, and exactly that batch ran again, in a new transaction.
        Assert.True(rerun.Count >= 2, $"{rerun.Count} messages were in the batch whose commit failed");
        Assert.Single(rerun.Select(id => _transactions[id].First()).Distinct());
        Assert.Single(rerun.Select(id => _transactions[id].Last()).Distinct());
        Assert.NotEqual(_transactions[rerun[0]].First(), _transactions[rerun[0]].Last());
        foreach (Guid id in ids)
        {
            Assert.Equal(1, await CountEffectsAsync(id));
        }

        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue + "_error"));
    }

    /// <summary>
    /// Trap 5 inside one batch: one statement cannot claim a key twice, so the second copy must wait for the batch's
    /// outcome — a duplicate if the first copy committed, processed if it failed. Dropping it early would lose the message.
    /// </summary>
    [Theory]
    [InlineData(false)]
    [InlineData(true)]
    public async Task Batch_TwoCopiesOfOneIdInOneBatch_OneEffect_AndWhenTheFirstFailsTheSecondIsProcessed(bool firstFails)
    {
        string queue = Queue("batch-copies");
        var counter = new DeliveryCounter();
        var holder = HoldWhileOthersArrive();
        var id = NewId.NextGuid();
        if (firstFails)
        {
            Probe.AfterSave = (context, _) => context.MessageId == id && Probe.Entries(id, nameof(EffectConsumer)) == 1
                ? throw new InvalidOperationException("the first copy fails")
                : Task.CompletedTask;
        }

        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, options: Window); // no retry policy
        using var duplicates = new MetricCollector<long>(host.Services.GetRequiredService<System.Diagnostics.Metrics.IMeterFactory>(),
            "ExactlyOnce", "exactlyonce.inbox.messages.duplicates");

        await SendWhileHeldAsync(host, queue, counter, holder, () => SendAsync(host, queue, id, copies: 2), 2); // both copies in the open batch's window

        Assert.Equal(1, await CountEffectsAsync(id));
        Assert.NotNull(Assert.Single(await InboxRowsAsync(id)).ProcessedAt);
        Assert.Equal(firstFails ? 2 : 1, Probe.Entries(id, nameof(EffectConsumer)));
        Assert.Equal(firstFails ? 0 : 1, duplicates.GetMeasurementSnapshot().EvaluateAsCounter());
        Assert.Equal(firstFails ? 1u : 0u, await RabbitAdmin.CountAsync(queue + "_error")); // the failed copy, recoverable
    }

    /// <summary>
    /// The point of the mode, observed twice: the consumers of a burst report the same PostgreSQL transaction id, and
    /// the process commits fewer transactions than it processed messages. One endpoint opts in with
    /// <c>UseExactlyOnceInbox(context, batched: true)</c> while the global option stays off; the control run (same
    /// endpoint, batched: false) must show one transaction per message.
    /// </summary>
    [Theory]
    [InlineData(true)]
    [InlineData(false)]
    public async Task Batch_BurstOfMessages_SharesTransactions_OnlyWhereTheEndpointOptedIn(bool batched)
    {
        const int messages = 40;
        string queue = Queue("batch-share");
        var counter = new DeliveryCounter();
        var commits = new CommitCounter();
        var host = await StartHostAsync(new TestHosts.Options
        {
            Database = o => o.UseNpgsql(ConnectionString).AddInterceptors(commits),
            Services = s => s.AddSingleton(Probe),
            ExactlyOnce = o =>
            {
                o.Batching.Enabled = false; // the endpoint decides
                Window(o);
            },
            InboxOnAllEndpoints = false,
            Consumers = x => x.AddConsumer<EffectConsumer>(),
            Endpoints = (context, cfg) => cfg.ReceiveEndpoint(queue, e =>
            {
                e.ConfigureConsumeTopology = false;
                e.PrefetchCount = 64;
                e.ConcurrentMessageLimit = 32;
                e.UseExactlyOnceInbox(context, batched);
                e.ConfigureConsumer<EffectConsumer>(context);
            }),
        }, counter);
        RecordTransactionIds();
        using var batchSizes = new MetricCollector<long>(host.Services.GetRequiredService<System.Diagnostics.Metrics.IMeterFactory>(),
            "ExactlyOnce", "exactlyonce.inbox.batch.size");
        var ids = Enumerable.Range(0, messages).Select(_ => NewId.NextGuid()).ToList();

        await Task.WhenAll(ids.Select(id => SendAsync(host, queue, id)));
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= messages), "all messages handled");

        await using var db = NewContext();
        Assert.Equal(messages, await db.Effects.CountAsync());
        Assert.All(ids, id => Assert.Single(_transactions[id]));
        int transactions = ids.Select(id => _transactions[id].Single()).Distinct().Count();
        if (batched)
        {
            Assert.True(transactions <= messages / 2, $"{messages} messages ran in {transactions} transactions");
            Assert.True(commits.Count <= messages / 2, $"{messages} messages took {commits.Count} commits");
            Assert.Equal(messages, batchSizes.GetMeasurementSnapshot().Sum(m => m.Value));
            Assert.Contains(batchSizes.GetMeasurementSnapshot(), m => m.Value > 1);
        }
        else
        {
            Assert.Equal(messages, transactions);
            Assert.Equal(messages, commits.Count);
            Assert.Empty(batchSizes.GetMeasurementSnapshot());
        }
    }

    /// <summary>
    /// With AddDbContextPool the members' contexts go back to the pool after a batch: each must have left the batch's
    /// connection (which the batch disposes), or the next message that rents it would fail.
    /// </summary>
    [Fact]
    public async Task Batch_WithPooledDbContexts_ContextsReturnToThePoolUsable()
    {
        string queue = Queue("batch-pool");
        var counter = new DeliveryCounter();
        var host = await StartHostAsync(new TestHosts.Options
        {
            Database = o => o.UseNpgsql(ConnectionString),
            Services = s => s.AddSingleton(Probe),
            ExactlyOnce = Window,
            AfterServices = s =>
            {
                s.RemoveAll<TestDbContext>();
                s.RemoveAll<DbContextOptions<TestDbContext>>();
                s.AddDbContextPool<TestDbContext>(o => o.UseNpgsql(ConnectionString), poolSize: 8);
            },
            Consumers = x => x.AddConsumer<EffectConsumer>(),
            Endpoints = (context, cfg) => cfg.ReceiveEndpoint(queue, e =>
            {
                e.ConfigureConsumeTopology = false;
                e.PrefetchCount = 32;
                e.ConcurrentMessageLimit = 16;
                e.ConfigureConsumer<EffectConsumer>(context);
            }),
        }, counter);
        RecordTransactionIds();

        for (int wave = 1; wave <= 3; wave++)
        {
            var ids = Enumerable.Range(0, 20).Select(_ => NewId.NextGuid()).ToList();
            await Task.WhenAll(ids.Select(id => SendAsync(host, queue, id)));
            await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= wave * 20), $"wave {wave} handled");
            Assert.Equal(0, counter.Faulted);
        }

        await using var db = NewContext();
        Assert.Equal(60, await db.Effects.CountAsync());
        Assert.True(_transactions.Values.Select(q => q.Single()).Distinct().Count() < 60, "some messages shared a transaction");
        await using var scope = host.Services.CreateAsyncScope();
        var rented = scope.ServiceProvider.GetRequiredService<TestDbContext>();
        Assert.Null(rented.Database.CurrentTransaction);
        Assert.Equal(60, await rented.Effects.CountAsync());
    }

    private static void Window(ExactlyOnceOptions options)
    {
        // A wide window, so that everything sent together lands in one batch even on a loaded machine.
        options.Batching.MaxWait = TimeSpan.FromMilliseconds(150);
        options.Batching.MaxBatchSize = 10;
    }

    /// <summary>
    /// A first message that stays in its consumer until released: while it is in flight the next ones do not count as
    /// lone deliveries and collect in a batch for the whole window. Also records every consumer's transaction id, and
    /// passes every consumer's context to <paramref name="observe"/> on the consumer's own flow.
    /// </summary>
    private Holder HoldWhileOthersArrive(Action<ConsumeContext>? observe = null)
    {
        var holder = new Holder(NewId.NextGuid());
        Probe.BeforeSave = async (context, db) =>
        {
            observe?.Invoke(context);
            await RecordTransactionIdAsync(context, db);
            if (context.MessageId == holder.Id)
            {
                holder.Entered.TrySetResult();
                await holder.Released.Task;
            }
        };
        return holder;
    }

    /// <summary>
    /// Sends the holder and, once it is inside its consumer, the deliveries <paramref name="send"/> sends; waits until
    /// <paramref name="handled"/> of them were handled, then lets the holder finish and waits for it.
    /// </summary>
    private async Task SendWhileHeldAsync(IHost host, string queue, DeliveryCounter counter, Holder holder, Func<Task> send, int handled)
    {
        await SendAsync(host, queue, holder.Id);
        await holder.Entered.Task.WaitAsync(TimeSpan.FromSeconds(30));
        await send();
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= handled), $"the {handled} held-back deliveries handled");
        holder.Released.TrySetResult();
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= handled + 1), "the holder handled");
    }

    private sealed record Holder(Guid Id)
    {
        public TaskCompletionSource Entered { get; } = new(TaskCreationOptions.RunContinuationsAsynchronously);

        public TaskCompletionSource Released { get; } = new(TaskCreationOptions.RunContinuationsAsynchronously);
    }

    private void RecordTransactionIds() => Probe.BeforeSave = RecordTransactionIdAsync;

    private async Task RecordTransactionIdAsync(ConsumeContext context, TestDbContext db)
    {
        long txid = (await db.Database.SqlQuery<long>($"SELECT txid_current() AS \"Value\"").ToListAsync()).Single();
        _transactions.GetOrAdd(context.MessageId!.Value, _ => new ConcurrentQueue<long>()).Enqueue(txid);
    }

    /// <summary>Before the inbox, as a tracing or tenancy filter would: puts the delivery's id in an async local.</summary>
    private sealed class DeliveryScopeFilter : IFilter<ConsumeContext>
    {
        public static readonly AsyncLocal<Guid?> Delivery = new();

        public Task Send(ConsumeContext context, IPipe<ConsumeContext> next)
        {
            Delivery.Value = context.MessageId;
            return next.Send(context);
        }

        public void Probe(ProbeContext context) => context.CreateFilterScope("deliveryScope");
    }

    private sealed class CommitCounter : DbTransactionInterceptor
    {
        private int _count;

        public int Count => Volatile.Read(ref _count);

        public override Task TransactionCommittedAsync(DbTransaction transaction, TransactionEndEventData eventData, CancellationToken cancellationToken = default)
        {
            Interlocked.Increment(ref _count);
            return Task.CompletedTask;
        }
    }
}
