using ExactlyOnce.EntityFrameworkCore;
using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Options;
using Microsoft.Extensions.Time.Testing;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>
/// One test per known trap of PRODUCT.md that is not a concurrency test (traps 2 and 5 are in
/// <see cref="ConcurrencyTests"/>). Each names the naive design it would catch.
/// </summary>
public class TrapTests : PostgresRabbitTest
{
    /// <summary>
    /// Trap 1 (separate scope). A filter with its own DI scope claims on another DbContext and connection: the
    /// consumer's context then cannot see the claim and has no transaction, and its SaveChanges commits on its own.
    /// Here the consumer's own context sees its own still-uncommitted claim, which only the same transaction can.
    /// </summary>
    [Fact]
    public async Task Trap1_ConsumerDbContextIsTheInboxTransaction_SeesItsOwnUncommittedClaim()
    {
        string queue = Queue("trap1");
        var counter = new DeliveryCounter();
        var id = NewId.NextGuid();
        int claimsSeenByConsumerContext = -1;
        int claimsSeenByOtherConnection = -1;
        bool consumerHadTransaction = false;
        Probe.BeforeSave = async (_, db) =>
        {
            consumerHadTransaction = db.Database.CurrentTransaction is not null;
            claimsSeenByConsumerContext = await db.Set<InboxMessage>().CountAsync(m => m.Id == id);
            await using var other = NewContext();
            claimsSeenByOtherConnection = await other.Set<InboxMessage>().CountAsync(m => m.Id == id);
        };
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter);

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 1), "delivery handled");

        Assert.True(consumerHadTransaction);
        Assert.Equal(1, claimsSeenByConsumerContext);
        Assert.Equal(0, claimsSeenByOtherConnection);
        Assert.Equal(1, await CountEffectsAsync(id));
    }

    /// <summary>
    /// Trap 3 (processed_at never set). If nothing sets it, a retention job that deletes processed rows deletes
    /// nothing. Here it is set from the injected TimeProvider, by the claim itself (the time the committing attempt
    /// claimed the message, not the time the consumer finished): the row is invisible until it commits with the
    /// consumer's effects, so it never exists unprocessed for anyone else.
    /// </summary>
    [Fact]
    public async Task Trap3_ProcessedMessage_HasProcessedAtSetFromTimeProvider_AndNoUnprocessedRowRemains()
    {
        string queue = Queue("trap3");
        var counter = new DeliveryCounter();
        var start = new DateTimeOffset(2030, 1, 2, 3, 4, 5, TimeSpan.Zero);
        var clock = new FakeTimeProvider(start);
        Probe.BeforeSave = (_, _) =>
        {
            clock.Advance(TimeSpan.FromSeconds(5)); // the consumer takes five (fake) seconds
            return Task.CompletedTask;
        };
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, services: s => s.AddSingleton<TimeProvider>(clock));
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 1), "delivery handled");

        var row = Assert.Single(await InboxRowsAsync(id));
        Assert.Equal(start.UtcDateTime, row.ReceivedAt);
        Assert.Equal(start.UtcDateTime, row.ProcessedAt);
        await using var db = NewContext();
        Assert.Equal(0, await db.Set<InboxMessage>().CountAsync(m => m.ProcessedAt == null));
    }

    /// <summary>
    /// Trap 4 (fragile identity). Deriving the scope from the queue name (or hashing type and queue) resets
    /// deduplication when either is renamed. Here the class and its queue are both renamed and the explicit
    /// identity keeps the redelivery a duplicate.
    /// </summary>
    [Fact]
    public async Task Trap4_ConsumerClassAndQueueRenamed_ExplicitIdentityKeepsDeduplication()
    {
        string oldQueue = Queue("trap4-old");
        string newQueue = Queue("trap4-new");
        var id = NewId.NextGuid();
        var oldCounter = new DeliveryCounter();
        var oldHost = await StartConsumerHostAsync<StableEffectConsumerV1>(oldQueue, oldCounter);
        await SendAsync(oldHost, oldQueue, id);
        await Eventually.AssertAsync(() => Task.FromResult(oldCounter.Handled >= 1), "processed before the rename");
        await oldHost.StopAsync();

        var newCounter = new DeliveryCounter();
        var newHost = await StartConsumerHostAsync<StableEffectConsumerV2>(newQueue, newCounter);
        await SendAsync(newHost, newQueue, id);
        await Eventually.AssertAsync(() => Task.FromResult(newCounter.Handled >= 1), "redelivered after the rename");

        Assert.Equal(1, Probe.Entries(id, "stable-effects"));
        Assert.Equal(1, await CountEffectsAsync(id));
        Assert.Equal("stable-effects", Assert.Single(await InboxRowsAsync(id)).Consumer);
    }

    [Fact]
    public async Task Trap4_DefaultIdentity_IsTheConsumerTypeFullName_NeverTheQueueName()
    {
        string queue = Queue("trap4-default");
        var counter = new DeliveryCounter();
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter);
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 1), "delivery handled");

        string consumer = Assert.Single(await InboxRowsAsync(id)).Consumer;
        Assert.Equal("ExactlyOnce.TestHost.EffectConsumer", consumer);
        Assert.DoesNotContain(queue, consumer, StringComparison.Ordinal);
    }

    [Fact]
    public async Task Startup_TwoConsumersWithTheSameIdentity_FailsWithAClearError()
    {
        var exception = await Assert.ThrowsAnyAsync<Exception>(() => StartHostAsync(new TestHosts.Options
        {
            Database = o => o.UseNpgsql(ConnectionString),
            Services = s => s.AddSingleton(Probe),
            Consumers = x =>
            {
                x.AddConsumer<StableEffectConsumerV1>();
                x.AddConsumer<StableEffectConsumerV2>();
            },
            Endpoints = (context, cfg) => cfg.ReceiveEndpoint(Queue("clash"), e =>
            {
                e.ConfigureConsumeTopology = false;
                e.ConfigureConsumer<StableEffectConsumerV1>(context);
                e.ConfigureConsumer<StableEffectConsumerV2>(context);
            }),
        }));

        Assert.Contains("both have the inbox identity 'stable-effects'", Flatten(exception), StringComparison.Ordinal);
    }

    [Fact]
    public async Task Startup_IdentityLongerThan500Characters_FailsOptionsValidation()
    {
        var exception = await Assert.ThrowsAsync<OptionsValidationException>(() =>
            StartConsumerHostAsync<EffectConsumer>(Queue("long"), options: o => o.MapConsumer<EffectConsumer>(new string('x', 501))));

        Assert.Contains("501 characters long; at most 500", exception.Message, StringComparison.Ordinal);
    }

    [Fact]
    public async Task Startup_TwoTypesMappedToOneIdentity_FailsOptionsValidation()
    {
        var exception = await Assert.ThrowsAsync<OptionsValidationException>(() =>
            StartConsumerHostAsync<EffectConsumer>(Queue("mapped"), options: o => o
                .MapConsumer<EffectConsumer>("same")
                .MapConsumer<SecondEffectConsumer>("same")));

        Assert.Contains("are both mapped to the inbox identity 'same'", exception.Message, StringComparison.Ordinal);
    }

    private static string Flatten(Exception exception)
    {
        var messages = new List<string>();
        for (Exception? e = exception; e is not null; e = e.InnerException)
        {
            messages.Add(e.Message);
            if (e is AggregateException aggregate)
            {
                messages.AddRange(aggregate.InnerExceptions.Select(Flatten));
            }
        }

        return string.Join(" | ", messages);
    }
}
