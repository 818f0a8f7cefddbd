using ExactlyOnce.EntityFrameworkCore;
using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Hosting;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>
/// The embedded default: SQLite and MassTransit's in-memory transport, with the same semantics. SQLite serializes
/// writers (BEGIN IMMEDIATE), so a concurrent delivery waits for the first transaction and then sees its claim.
/// </summary>
public class SqliteInboxTests : IAsyncLifetime
{
    private readonly string _path = Path.Combine(Path.GetTempPath(), $"eo-test-{Guid.NewGuid():N}.db");
    private readonly ConsumerProbe _probe = new();
    private readonly DeliveryCounter _counter = new();
    private IHost? _host;

    private string ConnectionString => $"Data Source={_path};Default Timeout=30";

    /// <summary>Runs the host with the inbox in batched mode (see <see cref="BatchedSqliteInboxTests"/>).</summary>
    protected virtual bool Batched => false;

    public async Task InitializeAsync()
    {
        await using var db = NewContext();
        await db.Database.EnsureCreatedAsync();
    }

    public async Task DisposeAsync()
    {
        if (_host is not null)
        {
            await _host.StopAsync();
            _host.Dispose();
        }

        Microsoft.Data.Sqlite.SqliteConnection.ClearAllPools();
        foreach (string file in new[] { _path, _path + "-wal", _path + "-shm", _path + "-journal" })
        {
            File.Delete(file);
        }
    }

    [Fact]
    public async Task Sqlite_SameMessageIdDeliveredTwice_EffectExistsOnce()
    {
        var bus = await StartAsync();
        var id = NewId.NextGuid();

        await SendAsync(bus, id, 1);
        await Eventually.AssertAsync(() => Task.FromResult(_counter.Handled >= 1), "first handled");
        await SendAsync(bus, id, 1);
        await Eventually.AssertAsync(() => Task.FromResult(_counter.Handled >= 2), "second handled");

        Assert.Equal(1, _probe.Entries(id, nameof(EffectConsumer)));
        Assert.Equal(1, await CountEffectsAsync(id));
        await using var db = NewContext();
        var row = await db.Set<InboxMessage>().SingleAsync(m => m.Id == id);
        Assert.Equal(typeof(EffectConsumer).FullName, row.ConsumerType);
        Assert.NotNull(row.ProcessedAt);
    }

    [Fact]
    public async Task Sqlite_SixteenConcurrentDeliveries_ConsumerBodyEnteredOncePerRound()
    {
        _probe.HoldAfterEntering = TimeSpan.FromMilliseconds(10);
        var bus = await StartAsync();
        const int rounds = 10;
        const int copies = 16;
        for (int round = 1; round <= rounds; round++)
        {
            var id = NewId.NextGuid();
            await SendAsync(bus, id, copies);
            int expected = round * copies;
            await Eventually.AssertAsync(() => Task.FromResult(_counter.Handled >= expected), $"round {round} handled");
            Assert.Equal(1, _probe.Entries(id, nameof(EffectConsumer)));
            Assert.Equal(1, await CountEffectsAsync(id));
        }

        Assert.Equal(0, _counter.Faulted);
    }

    [Fact]
    public async Task Sqlite_FailureAfterBusinessSave_NeitherRowExists_ThenRedeliveryProcessesOnce()
    {
        var id = NewId.NextGuid();
        _probe.AfterSave = (context, _) => _probe.Entries(context.MessageId!.Value, nameof(EffectConsumer)) == 1
            ? throw new InvalidOperationException("injected failure after the business row was saved")
            : Task.CompletedTask;
        var bus = await StartAsync();

        await SendAsync(bus, id, 1);
        await Eventually.AssertAsync(() => Task.FromResult(_counter.Faulted >= 1 && _counter.Handled >= 1), "first delivery faulted and left the pipe");
        await using (var db = NewContext())
        {
            Assert.Equal(0, await db.Set<InboxMessage>().CountAsync(m => m.Id == id));
            Assert.Equal(0, await db.Effects.CountAsync(m => m.MessageId == id));
        }

        await SendAsync(bus, id, 1);
        await Eventually.AssertAsync(() => Task.FromResult(_counter.Handled >= 2), "redelivery handled");

        Assert.Equal(2, _probe.Entries(id, nameof(EffectConsumer)));
        Assert.Equal(1, await CountEffectsAsync(id));
        await using var check = NewContext();
        Assert.NotNull((await check.Set<InboxMessage>().SingleAsync(m => m.Id == id)).ProcessedAt);
    }

    private TestDbContext NewContext() => new(new DbContextOptionsBuilder<TestDbContext>().UseSqlite(ConnectionString).Options);

    private async Task<IBus> StartAsync(Action<IReceiveEndpointConfigurator>? endpoint = null)
    {
        _host = TestHosts.Build(new TestHosts.Options
        {
            Database = o => o.UseSqlite(ConnectionString),
            InMemoryTransport = true,
            Services = s => s.AddSingleton(_probe),
            ExactlyOnce = o => o.Batching.Enabled = Batched,
            Consumers = x => x.AddConsumer<EffectConsumer>(),
            Endpoints = (context, cfg) => cfg.ReceiveEndpoint("sqlite-effects", e =>
            {
                e.ConcurrentMessageLimit = 16;
                endpoint?.Invoke(e);
                e.ConfigureConsumer<EffectConsumer>(context);
            }),
        });
        var bus = _host.Services.GetRequiredService<IBus>();
        bus.ConnectReceiveObserver(_counter);
        await _host.StartAsync();
        return bus;
    }

    private static async Task SendAsync(IBus bus, Guid id, int copies)
    {
        var endpoint = await bus.GetSendEndpoint(new Uri("queue:sqlite-effects"));
        await Task.WhenAll(Enumerable.Range(0, copies).Select(i => endpoint.Send(new TestMessage(i), c => c.MessageId = id)));
    }

    private async Task<int> CountEffectsAsync(Guid id)
    {
        await using var db = NewContext();
        return await db.Effects.CountAsync(e => e.MessageId == id);
    }
}
