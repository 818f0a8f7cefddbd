using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>
/// The tests have teeth: the same scenarios as the trap tests, run on the common tutorial design (PRODUCT.md:
/// its own DI scope, "does the row exist? no → run → insert"), show the defects our inbox must not have.
/// These assert that the tutorial design FAILS; the trap tests assert that ours does not.
/// </summary>
public sealed class TutorialDesignTests : PostgresRabbitTest
{
    [Fact]
    public async Task TutorialDesign_Trap1_SeparateScope_BusinessRowCommitsWithoutItsInboxRow_RedeliveryDuplicatesTheEffect()
    {
        string queue = Queue("tut1");
        var counter = new DeliveryCounter();
        var tutorial = new TutorialInbox { FailInboxInsertOnce = true };
        bool consumerHadTransaction = true;
        Probe.BeforeSave = (_, db) =>
        {
            consumerHadTransaction = db.Database.CurrentTransaction is not null;
            return Task.CompletedTask;
        };
        var host = await StartTutorialHostAsync(queue, counter, tutorial);
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 1), "first delivery handled");
        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 2), "redelivery handled");

        Assert.False(consumerHadTransaction);
        Assert.Equal(2, await CountEffectsAsync(id)); // the defect: the effect happened twice
    }

    [Fact]
    public async Task TutorialDesign_Trap2_CheckThenInsert_ConcurrentFirstArrivalsEnterTheConsumerMoreThanOnce()
    {
        string queue = Queue("tut2");
        var counter = new DeliveryCounter();
        Probe.HoldAfterEntering = TimeSpan.FromMilliseconds(20);
        var host = await StartTutorialHostAsync(queue, counter, new TutorialInbox());

        int maxEntries = 0;
        for (int round = 1; round <= 10 && maxEntries <= 1; round++)
        {
            var id = NewId.NextGuid();
            await SendAsync(host, queue, id, copies: 16);
            int expected = round * 16;
            await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= expected), $"round {round} handled");
            maxEntries = Math.Max(maxEntries, Probe.Entries(id, nameof(EffectConsumer)));
        }

        Assert.True(maxEntries > 1, "the tutorial design was expected to enter the consumer more than once for one message id");
    }

    private Task<Microsoft.Extensions.Hosting.IHost> StartTutorialHostAsync(string queue, DeliveryCounter counter, TutorialInbox tutorial) =>
        StartHostAsync(new TestHosts.Options
        {
            Database = o => o.UseNpgsql(ConnectionString),
            Services = s => s.AddSingleton(Probe),
            InboxOnAllEndpoints = false,
            Consumers = x => x.AddConsumer<EffectConsumer>(),
            Endpoints = (context, cfg) => cfg.ReceiveEndpoint(queue, e =>
            {
                e.ConfigureConsumeTopology = false;
                e.PrefetchCount = 32;
                e.ConcurrentMessageLimit = 16;
                e.ConfigureConsumer<EffectConsumer>(context, c =>
                    c.ConsumerMessage<TestMessage>(m => m.UseFilter(new TutorialInboxFilter<TestDbContext, EffectConsumer, TestMessage>(
                        context.GetRequiredService<IServiceScopeFactory>(), tutorial.TakeFailure))));
            }),
        }, counter);

    public sealed class TutorialInbox
    {
        public bool FailInboxInsertOnce { get; set; }

        public bool TakeFailure()
        {
            bool fail = FailInboxInsertOnce;
            FailInboxInsertOnce = false;
            return fail;
        }
    }
}
