using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Hosting;
using Npgsql;
using Xunit;

namespace ExactlyOnce.Tests.Infrastructure;

/// <summary>
/// Base of the tests that run against real PostgreSQL and RabbitMQ: a fresh database per test (dropped after),
/// queues with unique names (deleted after), hosts wired exactly as a user would wire them.
/// </summary>
public abstract class PostgresRabbitTest : IAsyncLifetime
{
    private readonly List<IHost> _hosts = [];
    private readonly List<string> _queues = [];

    protected string DatabaseName { get; } = "eo_test_" + Guid.NewGuid().ToString("N")[..12];

    protected string ConnectionString => TestHosts.PostgresServer + ";Database=" + DatabaseName;

    protected ConsumerProbe Probe { get; } = new();

    protected virtual bool CreateInboxTable => true;

    /// <summary>
    /// Runs every host of the test with the inbox in batched mode (<c>ExactlyOnceOptions.Batching.Enabled</c>): the
    /// guarantee test classes are subclassed with this set, so each guarantee is proven in both modes.
    /// </summary>
    protected virtual bool Batched => false;

    public async Task InitializeAsync()
    {
        await using (var admin = new NpgsqlConnection(TestHosts.PostgresServer + ";Database=postgres"))
        {
            await admin.OpenAsync();
            // A generated identifier, not user input: CREATE DATABASE takes no parameters.
            await using var create = new NpgsqlCommand($"CREATE DATABASE \"{DatabaseName}\"", admin);
            await create.ExecuteNonQueryAsync();
        }

        await using var db = NewContext();
        if (CreateInboxTable)
        {
            await db.Database.EnsureCreatedAsync();
        }
        else
        {
            await db.Database.ExecuteSqlRawAsync("CREATE TABLE effects (id bigserial PRIMARY KEY, message_id uuid NOT NULL, consumer text NOT NULL)");
        }
    }

    public async Task DisposeAsync()
    {
        foreach (IHost host in _hosts)
        {
            try
            {
                using var cts = new CancellationTokenSource(TimeSpan.FromSeconds(15));
                await host.StopAsync(cts.Token);
            }
            catch (Exception)
            {
                // A host a test broke on purpose may fail to stop cleanly.
            }

            host.Dispose();
        }

        await RabbitAdmin.DeleteAsync(_queues.SelectMany(q => new[] { q, q + "_error", q + "_skipped", q + "_parked" }));
        NpgsqlConnection.ClearAllPools();
        await using var admin = new NpgsqlConnection(TestHosts.PostgresServer + ";Database=postgres");
        await admin.OpenAsync();
        await using var drop = new NpgsqlCommand($"DROP DATABASE IF EXISTS \"{DatabaseName}\" WITH (FORCE)", admin);
        await drop.ExecuteNonQueryAsync();
    }

    protected string Queue(string name)
    {
        string queue = $"eo-{name}-{Guid.NewGuid():N}";
        _queues.Add(queue);
        return queue;
    }

    protected TestDbContext NewContext() =>
        new(new DbContextOptionsBuilder<TestDbContext>().UseNpgsql(ConnectionString).Options);

    /// <summary>Starts a host with <typeparamref name="TConsumer"/> on <paramref name="queue"/> under the inbox.</summary>
    protected Task<IHost> StartConsumerHostAsync<TConsumer>(
        string queue,
        DeliveryCounter? counter = null,
        Action<IReceiveEndpointConfigurator>? endpoint = null,
        Action<ExactlyOnceOptions>? options = null,
        Action<IServiceCollection>? services = null,
        Action<DbContextOptionsBuilder>? database = null)
        where TConsumer : class, IConsumer =>
        StartHostAsync(new TestHosts.Options
        {
            Database = o =>
            {
                o.UseNpgsql(ConnectionString);
                database?.Invoke(o);
            },
            Services = s =>
            {
                s.AddSingleton(Probe);
                services?.Invoke(s);
            },
            ExactlyOnce = options,
            Consumers = x => x.AddConsumer<TConsumer>(),
            Endpoints = (context, cfg) => cfg.ReceiveEndpoint(queue, e =>
            {
                e.ConfigureConsumeTopology = false;
                e.PrefetchCount = 32;
                e.ConcurrentMessageLimit = 16;
                endpoint?.Invoke(e);
                e.ConfigureConsumer<TConsumer>(context);
            }),
        }, counter);

    protected async Task<IHost> StartHostAsync(TestHosts.Options options, DeliveryCounter? counter = null)
    {
        if (Batched)
        {
            var configure = options.ExactlyOnce;
            options = options with
            {
                ExactlyOnce = o =>
                {
                    o.Batching.Enabled = true;
                    configure?.Invoke(o);
                },
            };
        }

        IHost host = TestHosts.Build(options);
        _hosts.Add(host);
        if (counter is not null)
        {
            host.Services.GetRequiredService<IBus>().ConnectReceiveObserver(counter);
        }

        await host.StartAsync();
        return host;
    }

    protected static async Task SendAsync(IHost host, string queue, Guid messageId, int copies = 1)
    {
        ISendEndpoint endpoint = await host.Services.GetRequiredService<IBus>().GetSendEndpoint(new Uri("queue:" + queue));
        await Task.WhenAll(Enumerable.Range(0, copies).Select(i =>
            endpoint.Send(new TestMessage(i), ctx => ctx.MessageId = messageId)));
    }

    protected async Task<int> CountEffectsAsync(Guid messageId, string? consumer = null)
    {
        await using var db = NewContext();
        return await db.Effects.CountAsync(e => e.MessageId == messageId && (consumer == null || e.Consumer == consumer));
    }

    protected async Task<List<(string Consumer, DateTime ReceivedAt, DateTime? ProcessedAt)>> InboxRowsAsync(Guid messageId)
    {
        await using var db = NewContext();
        var rows = await db.Set<ExactlyOnce.EntityFrameworkCore.InboxMessage>().AsNoTracking()
            .Where(m => m.Id == messageId).ToListAsync();
        return rows.Select(r => (r.ConsumerType, r.ReceivedAt, r.ProcessedAt)).ToList();
    }
}
