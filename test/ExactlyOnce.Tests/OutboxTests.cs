using ExactlyOnce.EntityFrameworkCore;
using ExactlyOnce.Outbox;
using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Diagnostics;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Diagnostics.Metrics.Testing;
using Microsoft.Extensions.Hosting;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>The outbox against real PostgreSQL and RabbitMQ: atomic writes, dispatchers side by side, crashes, poison rows.</summary>
public sealed class OutboxTests : PostgresRabbitTest
{
    private readonly DeliveryLog _deliveries = new();

    [Fact]
    public async Task Outbox_UnitOfWorkFailsAfterAddingRowAndEvent_LeavesNeither_AndNothingIsPublished()
    {
        var (host, _) = await StartOutboxHostAsync(dispatcher: true, failSaveChanges: true);
        var key = Guid.NewGuid();

        await using (var scope = host.Services.CreateAsyncScope())
        {
            var db = scope.ServiceProvider.GetRequiredService<TestDbContext>();
            var publish = scope.ServiceProvider.GetRequiredService<IPublishEndpoint>();
            db.Effects.Add(new Effect { MessageId = key, Consumer = "api" });
            await publish.Publish(new OutboxTestEvent(key, 1));
            await Assert.ThrowsAsync<InvalidOperationException>(() => db.SaveChangesAsync());
        }

        Assert.Equal(0, await CountEffectsAsync(key));
        await using var check = NewContext();
        Assert.Equal(0, await check.Set<OutboxMessage>().CountAsync());

        // A later unit of work is published; the failed one never is.
        Guid sentinel = await PublishThroughOutboxAsync(host, Guid.NewGuid());
        await Eventually.AssertAsync(() => Task.FromResult(_deliveries.ByMessageId.ContainsKey(sentinel)), "the sentinel is delivered");
        Assert.Equal(1, _deliveries.Total);
    }

    [Fact]
    public async Task Outbox_UnitOfWorkCommits_LeavesBoth_AndTheEventIsPublishedExactlyOnceWithItsMessageId()
    {
        var (host, _) = await StartOutboxHostAsync(dispatcher: true);
        using var latency = new MetricCollector<double>(host.Services.GetRequiredService<System.Diagnostics.Metrics.IMeterFactory>(),
            "ExactlyOnce", "exactlyonce.outbox.publish.latency");
        var key = Guid.NewGuid();

        Guid messageId = await PublishThroughOutboxAsync(host, key);

        Assert.Equal(1, await CountEffectsAsync(key));
        await Eventually.AssertAsync(() => Task.FromResult(_deliveries.ByMessageId.ContainsKey(messageId)), "the event is delivered with the outbox row's message id");
        await Eventually.AssertAsync(async () => await PendingRowsAsync() == 0, "the row is marked dispatched");
        Guid sentinel = await PublishThroughOutboxAsync(host, Guid.NewGuid());
        await Eventually.AssertAsync(() => Task.FromResult(_deliveries.ByMessageId.ContainsKey(sentinel)), "the sentinel is delivered");

        Assert.Equal(1, _deliveries.ByMessageId[messageId]);
        await using var db = NewContext();
        var row = await db.Set<OutboxMessage>().SingleAsync(m => m.MessageId == messageId);
        Assert.NotNull(row.DispatchedAt);
        Assert.Equal(1, row.Attempts);
        Assert.Contains(nameof(OutboxTestEvent), row.MessageType, StringComparison.Ordinal);
        Assert.Equal("s", latency.Instrument!.Unit); // commit-to-publish latency, one measurement per dispatched row
        Assert.All(latency.GetMeasurementSnapshot(), m => Assert.InRange(m.Value, 0, 10));
        Assert.Equal(2, latency.GetMeasurementSnapshot().Count); // the event and the sentinel
    }

    /// <summary>
    /// In batched mode the consumer's context never commits itself (the batch does, once): with polling effectively off,
    /// the event is delivered only if the batch's commit wakes the dispatcher.
    /// </summary>
    [Theory]
    [InlineData(false)]
    [InlineData(true)]
    public async Task Outbox_ConsumerPublishUnderTheInbox_CommitsWithTheClaim_FailedAttemptLeavesNoRow(bool batched)
    {
        string input = Queue("republish");
        var counter = new DeliveryCounter();
        Probe.AfterSave = (context, _) => Probe.Entries(context.MessageId!.Value, nameof(RepublishingConsumer)) == 1
            ? throw new InvalidOperationException("the first attempt fails after publishing")
            : Task.CompletedTask;
        var (host, _) = await StartOutboxHostAsync(dispatcher: true, configure: o => o with
        {
            ExactlyOnce = x =>
            {
                x.Outbox.PollingInterval = batched ? TimeSpan.FromHours(1) : TimeSpan.FromSeconds(1);
                x.Batching.Enabled = batched;
            },
            Consumers = x =>
            {
                x.AddConsumer<CountingConsumer>();
                x.AddConsumer<RepublishingConsumer>();
            },
            Endpoints = (context, cfg) =>
            {
                cfg.ReceiveEndpoint(Queue("outbox-events"), e => e.ConfigureConsumer<CountingConsumer>(context));
                cfg.ReceiveEndpoint(input, e =>
                {
                    e.ConfigureConsumeTopology = false;
                    e.UseMessageRetry(r => r.Immediate(2));
                    e.ConfigureConsumer<RepublishingConsumer>(context);
                });
            },
        }, counter: counter);
        var id = NewId.NextGuid();

        await SendAsync(host, input, id);
        await Eventually.AssertAsync(() => Task.FromResult(_deliveries.Total >= 1), "the consumer's event is delivered");
        await Eventually.AssertAsync(async () => await PendingRowsAsync() == 0, "dispatched");

        Assert.Equal(2, Probe.Entries(id, nameof(RepublishingConsumer)));
        await using var db = NewContext();
        var row = await db.Set<OutboxMessage>().SingleAsync(); // only the committed attempt's event
        Assert.Equal(1, _deliveries.ByMessageId[row.MessageId]);
        Assert.Equal(1, await CountEffectsAsync(id));
    }

    /// <summary>
    /// With polling effectively off (one hour), only a commit signal can wake the dispatcher: in the same process the
    /// in-process signal, from another process (here: another host with its own container) PostgreSQL NOTIFY.
    /// </summary>
    [Theory]
    [InlineData(true)]
    [InlineData(false)]
    public async Task Dispatcher_WokenByTheCommit_PublishesWithinMillisecondsNotAPollingInterval(bool sameProcess)
    {
        var (dispatcherHost, _) = await StartOutboxHostAsync(dispatcher: true, configure: o => o with
        {
            ExactlyOnce = x => x.Outbox.PollingInterval = TimeSpan.FromHours(1),
        });
        IHost writerHost = sameProcess ? dispatcherHost : (await StartOutboxHostAsync(dispatcher: false)).Host;
        await Task.Delay(200); // let the dispatcher finish its first (empty) pass and go to sleep on the signal

        var clock = System.Diagnostics.Stopwatch.StartNew();
        Guid messageId = await PublishThroughOutboxAsync(writerHost, Guid.NewGuid());
        await Eventually.AssertAsync(() => Task.FromResult(_deliveries.ByMessageId.ContainsKey(messageId)), "woken and published", TimeSpan.FromSeconds(10));

        Assert.True(clock.Elapsed < TimeSpan.FromSeconds(5), $"commit to delivery took {clock.Elapsed}");
    }

    [Fact]
    public async Task Dispatcher_TwoInstancesOver5000PendingRows_PublishEachRowExactlyOnce()
    {
        const int rows = 5000;
        var (consumerHost, _) = await StartOutboxHostAsync(dispatcher: false);
        await InsertPendingRowsAsync(consumerHost, rows);

        var (dispatcherA, _) = await StartDispatcherOnlyHostAsync();
        var (dispatcherB, _) = await StartDispatcherOnlyHostAsync();
        using var dispatchedA = Dispatched(dispatcherA);
        using var dispatchedB = Dispatched(dispatcherB);

        await Eventually.AssertAsync(async () => _deliveries.ByMessageId.Count >= rows && await PendingRowsAsync() == 0,
            "all rows delivered and marked", TimeSpan.FromMinutes(3));

        Assert.Equal(rows, _deliveries.ByMessageId.Count);
        Assert.All(_deliveries.ByMessageId.Values, n => Assert.Equal(1, n));
        long a = dispatchedA.GetMeasurementSnapshot().EvaluateAsCounter();
        long b = dispatchedB.GetMeasurementSnapshot().EvaluateAsCounter();
        Assert.Equal(rows, a + b);
        Assert.True(a > 0 && b > 0, $"both dispatchers must share the work (A {a}, B {b})");
    }

    [Fact]
    public async Task Dispatcher_KilledMidBatch_TheOtherPublishesItsRows_AndInboxEffectsStayExactlyOnce()
    {
        const int rows = 300;
        var counter = new DeliveryCounter();
        var (consumerHost, _) = await StartOutboxHostAsync(dispatcher: false, configure: o => o with
        {
            Consumers = x => x.AddConsumer<OutboxEffectConsumer>(),
            Endpoints = (context, cfg) => cfg.ReceiveEndpoint(Queue("outbox-inbox"), e => e.ConfigureConsumer<OutboxEffectConsumer>(context)),
        }, counter: counter);
        using var duplicates = new MetricCollector<long>(consumerHost.Services.GetRequiredService<System.Diagnostics.Metrics.IMeterFactory>(),
            "ExactlyOnce", "exactlyonce.inbox.messages.duplicates");
        var messageIds = await InsertPendingRowsAsync(consumerHost, rows);

        using (var child = new ChildProcess("stalling-dispatcher", DatabaseName, Queue("unused")))
        {
            await child.WaitForLineAsync("STALLED", TimeSpan.FromSeconds(60));
            child.Kill(); // SIGKILL with a batch claimed, 20 of its rows published, none marked dispatched
        }

        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 20), "the killed dispatcher's publishes arrived");
        await using (var db = NewContext())
        {
            Assert.Equal(rows, await db.Set<OutboxMessage>().CountAsync(m => m.DispatchedAt == null));
        }

        await StartDispatcherOnlyHostAsync();
        await Eventually.AssertAsync(async () => await PendingRowsAsync() == 0 && Probe.TotalEntries >= rows,
            "the surviving dispatcher published everything", TimeSpan.FromMinutes(2));
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= rows + 20), "the re-published copies arrived");

        Assert.Equal(20, duplicates.GetMeasurementSnapshot().EvaluateAsCounter()); // re-published, recognised, discarded
        await using var check = NewContext();
        var effects = await check.Effects.GroupBy(e => e.MessageId).Select(g => new { g.Key, Count = g.Count() }).ToListAsync();
        Assert.Equal(messageIds.Order(), effects.Select(e => e.Key).Order());
        Assert.All(effects, e => Assert.Equal(1, e.Count));
    }

    [Fact]
    public async Task Dispatcher_PoisonRows_GetAttemptsBackoffAndLastError_AndDoNotBlockTheRowsBehindThem()
    {
        var (host, _) = await StartOutboxHostAsync(dispatcher: false);
        await using (var scope = host.Services.CreateAsyncScope())
        {
            var db = scope.ServiceProvider.GetRequiredService<TestDbContext>();
            var writer = scope.ServiceProvider.GetRequiredService<IOutboxWriter>();
            writer.Add(new OutboxEntry(Guid.NewGuid(), "No.Such.Type, NoSuchAssembly", "{}", null, null));
            writer.Add(new OutboxEntry(Guid.NewGuid(), typeof(OutboxTestEvent).FullName + ", " + typeof(OutboxTestEvent).Assembly.GetName().Name,
                """{"key":"00000000-0000-0000-0000-000000000001","index":0}""", null, "nosuchscheme://nowhere/queue"));
            await db.SaveChangesAsync();
        }

        var good = await InsertPendingRowsAsync(host, 10);
        var (dispatcher, _) = await StartDispatcherOnlyHostAsync();
        using var failures = new MetricCollector<long>(dispatcher.Services.GetRequiredService<System.Diagnostics.Metrics.IMeterFactory>(),
            "ExactlyOnce", "exactlyonce.outbox.messages.failed");

        await Eventually.AssertAsync(() => Task.FromResult(good.All(_deliveries.ByMessageId.ContainsKey)), "the rows behind the poison rows are delivered");
        await using var db2 = NewContext();
        var poison = await db2.Set<OutboxMessage>().AsNoTracking().Where(m => m.DispatchedAt == null).OrderBy(m => m.Sequence).ToListAsync();
        Assert.Equal(2, poison.Count);
        Assert.All(poison, p =>
        {
            Assert.True(p.Attempts >= 1);
            Assert.NotNull(p.LastError);
            Assert.True(p.NextAttemptAt > p.CreatedAt, "a failed row is deferred by its backoff");
        });
        Assert.Contains("No.Such.Type", poison[0].LastError, StringComparison.Ordinal);
        Assert.Contains("nosuchscheme", poison[1].LastError, StringComparison.Ordinal);
        Assert.True(failures.GetMeasurementSnapshot().EvaluateAsCounter() >= 2);
    }

    private MetricCollector<long> Dispatched(IHost host) =>
        new(host.Services.GetRequiredService<System.Diagnostics.Metrics.IMeterFactory>(), "ExactlyOnce", "exactlyonce.outbox.messages.dispatched");

    private async Task<(IHost Host, string Queue)> StartOutboxHostAsync(bool dispatcher, bool failSaveChanges = false,
        Func<TestHosts.Options, TestHosts.Options>? configure = null, DeliveryCounter? counter = null)
    {
        string queue = Queue("outbox-events");
        var failing = new FailingSaveChangesInterceptor();
        var options = new TestHosts.Options
        {
            Database = o =>
            {
                o.UseNpgsql(ConnectionString);
                if (failSaveChanges)
                {
                    o.AddInterceptors(failing);
                }
            },
            Services = s => s.AddSingleton(_deliveries).AddSingleton(Probe),
            Outbox = true,
            Dispatcher = dispatcher,
            ExactlyOnce = o => o.Outbox.PollingInterval = TimeSpan.FromSeconds(1),
            Consumers = x => x.AddConsumer<CountingConsumer>(),
            Endpoints = (context, cfg) => cfg.ReceiveEndpoint(queue, e => e.ConfigureConsumer<CountingConsumer>(context)),
        };
        return (await StartHostAsync(configure?.Invoke(options) ?? options, counter), queue);
    }

    private async Task<(IHost Host, string Queue)> StartDispatcherOnlyHostAsync() =>
        (await StartHostAsync(new TestHosts.Options
        {
            Database = o => o.UseNpgsql(ConnectionString),
            Dispatcher = true,
            InboxOnAllEndpoints = false,
            ExactlyOnce = o =>
            {
                o.Outbox.BatchSize = 50;
                o.Outbox.PollingInterval = TimeSpan.FromSeconds(1);
            },
            Consumers = _ => { },
            Endpoints = (_, _) => { },
        }), "");

    /// <summary>A unit of work through the API path: a business row and an event, one SaveChanges.</summary>
    private async Task<Guid> PublishThroughOutboxAsync(IHost host, Guid key)
    {
        await using var scope = host.Services.CreateAsyncScope();
        var db = scope.ServiceProvider.GetRequiredService<TestDbContext>();
        var publish = scope.ServiceProvider.GetRequiredService<IPublishEndpoint>();
        db.Effects.Add(new Effect { MessageId = key, Consumer = "api" });
        await publish.Publish(new OutboxTestEvent(key, 1));
        await db.SaveChangesAsync();
        return await db.Set<OutboxMessage>().Where(m => m.Body.Contains(key.ToString())).Select(m => m.MessageId).SingleAsync();
    }

    private async Task<List<Guid>> InsertPendingRowsAsync(IHost host, int count)
    {
        var ids = new List<Guid>(count);
        for (int offset = 0; offset < count; offset += 500)
        {
            await using var scope = host.Services.CreateAsyncScope();
            var db = scope.ServiceProvider.GetRequiredService<TestDbContext>();
            var publish = scope.ServiceProvider.GetRequiredService<IPublishEndpoint>();
            for (int i = offset; i < Math.Min(count, offset + 500); i++)
            {
                var id = NewId.NextGuid();
                ids.Add(id);
                await publish.Publish(new OutboxTestEvent(Guid.NewGuid(), i), ctx => ctx.MessageId = id);
            }

            await db.SaveChangesAsync();
        }

        return ids;
    }

    private async Task<int> PendingRowsAsync()
    {
        await using var db = NewContext();
        return await db.Set<OutboxMessage>().CountAsync(m => m.DispatchedAt == null);
    }

    /// <summary>Fails the first SaveChanges only.</summary>
    private sealed class FailingSaveChangesInterceptor : SaveChangesInterceptor
    {
        private int _failed;

        public override ValueTask<InterceptionResult<int>> SavingChangesAsync(DbContextEventData eventData, InterceptionResult<int> result, CancellationToken cancellationToken = default) =>
            Interlocked.Exchange(ref _failed, 1) == 0
                ? throw new InvalidOperationException("injected failure: the unit of work does not commit")
                : ValueTask.FromResult(result);
    }
}
