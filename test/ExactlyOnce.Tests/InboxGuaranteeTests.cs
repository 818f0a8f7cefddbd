using System.Data.Common;
using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Diagnostics;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Diagnostics.Metrics.Testing;
using Microsoft.Extensions.Logging;
using Microsoft.Extensions.Logging.Testing;
using Npgsql;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>The core guarantees, through MassTransit, against real PostgreSQL and RabbitMQ.</summary>
public class InboxGuaranteeTests : PostgresRabbitTest
{
    private static readonly string EffectConsumerName = typeof(EffectConsumer).FullName!;

    [Fact]
    public async Task Consume_SameMessageIdDeliveredTwice_EffectExistsOnce()
    {
        string queue = Queue("dup");
        var counter = new DeliveryCounter();
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, services: s => s.AddFakeLogging());
        using var duplicates = new MetricCollector<long>(host.Services.GetRequiredService<System.Diagnostics.Metrics.IMeterFactory>(),
            "ExactlyOnce", "exactlyonce.inbox.messages.duplicates");
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 1), "first delivery handled");
        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 2), "second delivery handled");

        Assert.Equal(1, await CountEffectsAsync(id));
        Assert.Equal(1, Probe.Entries(id, nameof(EffectConsumer)));
        var row = Assert.Single(await InboxRowsAsync(id));
        Assert.Equal(EffectConsumerName, row.Consumer);
        Assert.NotNull(row.ProcessedAt);
        Assert.Equal(0, counter.Faulted);
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue));
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue + "_error"));
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue + "_skipped"));

        // The duplicate is counted, tagged with the consumer (never the message id), and logged as a Warning.
        var measurement = Assert.Single(duplicates.GetMeasurementSnapshot());
        Assert.Equal(1, measurement.Value);
        Assert.Equal(EffectConsumerName, measurement.Tags["exactlyonce.consumer.name"]);
        Assert.DoesNotContain("messaging.message.id", measurement.Tags.Keys);
        var warning = Assert.Single(host.Services.GetFakeLogCollector().GetSnapshot(), r => r.Id.Id == 1001);
        Assert.Equal(LogLevel.Warning, warning.Level);
        Assert.Contains(id.ToString(), warning.Message, StringComparison.Ordinal);
        Assert.Contains(EffectConsumerName, warning.Message, StringComparison.Ordinal);
    }

    [Fact]
    public async Task Consume_TwoConsumersOfOneEvent_EachProcessesItOnce()
    {
        string queueA = Queue("fan-a");
        string queueB = Queue("fan-b");
        var counter = new DeliveryCounter();
        var host = await StartHostAsync(new TestHosts.Options
        {
            Database = o => o.UseNpgsql(ConnectionString),
            Services = s => s.AddSingleton(Probe),
            Consumers = x =>
            {
                x.AddConsumer<EffectConsumer>();
                x.AddConsumer<SecondEffectConsumer>();
            },
            Endpoints = (context, cfg) =>
            {
                cfg.ReceiveEndpoint(queueA, e =>
                {
                    e.ConfigureConsumeTopology = false;
                    e.ConfigureConsumer<EffectConsumer>(context);
                });
                cfg.ReceiveEndpoint(queueB, e =>
                {
                    e.ConfigureConsumeTopology = false;
                    e.ConfigureConsumer<SecondEffectConsumer>(context);
                });
            },
        }, counter);
        var id = NewId.NextGuid();

        // The event reaches both consumers' queues, and each of them twice.
        await SendAsync(host, queueA, id, copies: 2);
        await SendAsync(host, queueB, id, copies: 2);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 4), "all four deliveries handled");

        Assert.Equal(1, await CountEffectsAsync(id, nameof(EffectConsumer)));
        Assert.Equal(1, await CountEffectsAsync(id, nameof(SecondEffectConsumer)));
        var rows = await InboxRowsAsync(id);
        Assert.Equal(
            new[] { typeof(EffectConsumer).FullName!, typeof(SecondEffectConsumer).FullName! }.Order(),
            rows.Select(r => r.Consumer).Order());
        Assert.All(rows, r => Assert.NotNull(r.ProcessedAt));
    }

    [Fact]
    public async Task UseExactlyOnceInbox_OnOneEndpoint_AppliesToThatEndpointOnly()
    {
        string guarded = Queue("guarded");
        string unguarded = Queue("unguarded");
        var counter = new DeliveryCounter();
        var host = await StartHostAsync(new TestHosts.Options
        {
            Database = o => o.UseNpgsql(ConnectionString),
            Services = s => s.AddSingleton(Probe),
            InboxOnAllEndpoints = false,
            Consumers = x =>
            {
                x.AddConsumer<EffectConsumer>();
                x.AddConsumer<SecondEffectConsumer>();
            },
            Endpoints = (context, cfg) =>
            {
                cfg.ReceiveEndpoint(guarded, e =>
                {
                    e.ConfigureConsumeTopology = false;
                    e.UseExactlyOnceInbox(context); // this endpoint only
                    e.ConfigureConsumer<EffectConsumer>(context);
                });
                cfg.ReceiveEndpoint(unguarded, e =>
                {
                    e.ConfigureConsumeTopology = false;
                    e.ConfigureConsumer<SecondEffectConsumer>(context);
                });
            },
        }, counter);
        var id = NewId.NextGuid();

        await SendAsync(host, guarded, id, copies: 2);
        await SendAsync(host, unguarded, id, copies: 2);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 4), "all four deliveries handled");

        Assert.Equal(1, await CountEffectsAsync(id, nameof(EffectConsumer)));
        Assert.Equal(2, await CountEffectsAsync(id, nameof(SecondEffectConsumer))); // no inbox there: both copies applied
        Assert.Equal(typeof(EffectConsumer).FullName, Assert.Single(await InboxRowsAsync(id)).Consumer);
    }

    [Fact]
    public async Task Consume_ConsumerThrows_NoInboxRowRemainsAndTheRetryProcessesItOnce()
    {
        string queue = Queue("retry");
        var counter = new DeliveryCounter();
        var id = NewId.NextGuid();
        int committedClaimsSeenByRetry = -1;
        int trackedEntitiesSeenByRetry = -1;
        Probe.AfterSave = async (context, db) =>
        {
            if (Probe.Entries(context.MessageId!.Value, nameof(EffectConsumer)) == 1)
            {
                throw new InvalidOperationException("injected failure after the business row was saved");
            }

            // The retry: a separate connection sees no committed claim left behind by the failed attempt.
            await using var other = NewContext();
            committedClaimsSeenByRetry = await other.Set<ExactlyOnce.EntityFrameworkCore.InboxMessage>().CountAsync(m => m.Id == id);
            trackedEntitiesSeenByRetry = db.ChangeTracker.Entries().Count();
        };
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, e => e.UseMessageRetry(r => r.Immediate(3)));

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 1), "delivery handled");

        Assert.Equal(2, Probe.Entries(id, nameof(EffectConsumer)));
        Assert.Equal(0, committedClaimsSeenByRetry);
        Assert.Equal(1, trackedEntitiesSeenByRetry); // only the retry's own effect: a fresh change tracker
        Assert.Equal(1, await CountEffectsAsync(id));
        Assert.NotNull(Assert.Single(await InboxRowsAsync(id)).ProcessedAt);
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue + "_error"));
    }

    [Fact]
    public async Task Consume_ConsumerThrowsWithoutRetryPolicy_FaultsToErrorQueueLeavesNoClaim_RedriveProcessesOnce()
    {
        string queue = Queue("noretry");
        var counter = new DeliveryCounter();
        var id = NewId.NextGuid();
        Probe.AfterSave = (context, _) => Probe.Entries(context.MessageId!.Value, nameof(EffectConsumer)) == 1
            ? throw new InvalidOperationException("injected failure")
            : Task.CompletedTask;
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter);

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(async () => await RabbitAdmin.CountAsync(queue + "_error") == 1, "failed message in the error queue");
        Assert.Equal(0, await CountEffectsAsync(id));
        Assert.Empty(await InboxRowsAsync(id));

        // Re-drive (what an operator does with the error queue): same message id, processed once.
        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(async () => await CountEffectsAsync(id) == 1, "re-driven message processed");
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 2), "both deliveries handled");
        Assert.Equal(1, await CountEffectsAsync(id));
        Assert.NotNull(Assert.Single(await InboxRowsAsync(id)).ProcessedAt);
    }

    [Fact]
    public async Task Consume_FailureAfterBusinessSaveBeforeCommit_NeitherRowExists_RedeliveryProcessesOnce()
    {
        string queue = Queue("atomic");
        var counter = new DeliveryCounter();
        var failCommit = new FailingCommitInterceptor { Remaining = 1 };
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, database: o => o.AddInterceptors(failCommit));
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(async () => await RabbitAdmin.CountAsync(queue + "_error") == 1, "the failed commit faulted the message");
        Assert.Equal(1, failCommit.Failed);
        Assert.Equal(1, Probe.Entries(id, nameof(EffectConsumer)));
        Assert.Equal(0, await CountEffectsAsync(id));
        Assert.Empty(await InboxRowsAsync(id));

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 2), "redelivery handled");
        Assert.Equal(2, Probe.Entries(id, nameof(EffectConsumer)));
        Assert.Equal(1, await CountEffectsAsync(id));
        Assert.NotNull(Assert.Single(await InboxRowsAsync(id)).ProcessedAt);
    }

    [Fact]
    public async Task Consume_WithRetryingExecutionStrategy_TransientCommitFailureIsRetriedAsOneFreshTransaction()
    {
        string queue = Queue("strategy");
        var counter = new DeliveryCounter();
        var failCommit = new FailingCommitInterceptor
        {
            Remaining = 1,
            Exception = () => new NpgsqlException("injected transient failure", new TimeoutException()),
        };
        int trackedAtRetryStart = -1;
        Probe.BeforeSave = (context, db) =>
        {
            if (Probe.Entries(context.MessageId!.Value, nameof(EffectConsumer)) == 2)
            {
                trackedAtRetryStart = db.ChangeTracker.Entries().Count();
            }

            return Task.CompletedTask;
        };
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, database: o => o
            .UseNpgsql(ConnectionString, n => n.EnableRetryOnFailure(3, TimeSpan.FromMilliseconds(50), null))
            .AddInterceptors(failCommit));
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 1), "delivery handled");
        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 2), "duplicate handled");

        Assert.Equal(1, failCommit.Failed);
        Assert.Equal(0, counter.Faulted);
        Assert.Equal(2, Probe.Entries(id, nameof(EffectConsumer))); // first attempt + the strategy's retry; not the duplicate
        Assert.Equal(0, trackedAtRetryStart); // the same DbContext, cleared between attempts
        Assert.Equal(1, await CountEffectsAsync(id));
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue + "_error"));
    }
}

/// <summary>Throws on commit — after the claim (written processed) and the consumer's rows were sent, before they are durable.</summary>
public sealed class FailingCommitInterceptor : DbTransactionInterceptor
{
    private int _remaining;
    private int _failed;

    public int Remaining { get => _remaining; init => _remaining = value; }
    public int Failed => Volatile.Read(ref _failed);
    public Func<Exception> Exception { get; init; } = () => new InvalidOperationException("injected failure before commit");

    public override ValueTask<InterceptionResult> TransactionCommittingAsync(DbTransaction transaction, TransactionEventData eventData, InterceptionResult result, CancellationToken cancellationToken = default)
    {
        if (Interlocked.Decrement(ref _remaining) >= 0)
        {
            Interlocked.Increment(ref _failed);
            throw Exception();
        }

        return ValueTask.FromResult(result);
    }
}
