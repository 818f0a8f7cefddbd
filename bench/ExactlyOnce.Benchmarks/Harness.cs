using System.Diagnostics;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Hosting;
using Microsoft.Extensions.Logging;
using Npgsql;
using RabbitMQ.Client;

namespace ExactlyOnce.Benchmarks;

internal sealed record Settings(int Messages, int Repeats, string[] Modes, int Rate, int LatencySeconds, int DuplicateRunMessages, int Concurrency, string? JsonPath);

internal sealed record ModeRun(string Mode, double MessagesPerSecond, double P50Ms, double P99Ms, long DuplicateEffects, int DuplicatesSent, double MessagesPerTransaction);

/// <summary>
/// Runs one mode end to end on a fresh database and queue: drain a pre-loaded queue (throughput), a steady publisher
/// (latency from publish to the business row), and a run with 10 % duplicate deliveries (duplicate effects).
/// </summary>
internal sealed class Harness(Settings settings)
{
    private const int DrainPhase = 1;
    private const int LatencyPhase = 2;
    private const int DuplicatePhase = 3;

    public static readonly string[] AllModes = ["baseline", "tutorial", "exactlyonce", "exactlyonce-batched", WolverineMode.Name];

    public async Task<ModeRun> RunAsync(string mode)
    {
        string database = "eo_bench_" + Guid.NewGuid().ToString("N")[..10];
        string connectionString = TestHosts.PostgresServer + ";Database=" + database + ";Maximum Pool Size=64;No Reset On Close=true";
        string queue = $"bench-{mode}-{Guid.NewGuid():N}";
        await ExecuteAdminAsync($"CREATE DATABASE \"{database}\"");
        try
        {
            await using (var db = NewContext(connectionString))
            {
                await db.Database.EnsureCreatedAsync();
            }

            await using var sender = await StartSenderAsync(mode, queue, connectionString);

            // 1. Throughput: pre-load the queue, then start the consumer and time the drain.
            await SendAsync(sender, Enumerable.Range(0, settings.Messages).Select(_ => (NewId.NextGuid(), Guid.NewGuid())), DrainPhase);
            var counter = new DeliveryCounter(settings.Messages);
            using var consumer = mode == WolverineMode.Name
                ? await WolverineMode.StartConsumerAsync(settings, queue, connectionString, counter)
                : await StartBusAsync(mode, queue, connectionString, counter);
            await WaitAsync(() => counter.Completed >= settings.Messages, TimeSpan.FromMinutes(10));
            // From the first message done to the last: the consumer's start-up is not part of the rate.
            double rate = (settings.Messages - 1) / (counter.DrainedAt - counter.FirstAt).TotalSeconds;
            // Our modes: how many messages shared a transaction during the drain (rows committed together share an xmin).
            double perTransaction = mode is "exactlyonce" or "exactlyonce-batched"
                ? (double)await ScalarAsync(connectionString, "SELECT count(*) FROM inbox_messages")
                  / await ScalarAsync(connectionString, "SELECT count(DISTINCT xmin::text) FROM inbox_messages")
                : double.NaN;

            // 2. Latency at a steady, moderate rate: publish time to the business row's write time.
            int steady = settings.Rate * settings.LatencySeconds;
            var pace = Stopwatch.StartNew();
            for (int i = 0; i < steady; i++)
            {
                TimeSpan due = TimeSpan.FromSeconds((double)i / settings.Rate);
                if (due > pace.Elapsed)
                {
                    await Task.Delay(due - pace.Elapsed);
                }

                await sender.SendAsync(NewId.NextGuid(), new BenchMessage(Guid.NewGuid(), DateTime.UtcNow, LatencyPhase));
            }

            await WaitAsync(() => counter.Completed >= settings.Messages + steady, TimeSpan.FromMinutes(5));
            var (p50, p99) = await LatencyAsync(connectionString);

            // 3. Duplicates: 10 % of the messages delivered twice with the same message id, half of the copies at once.
            var keys = Enumerable.Range(0, settings.DuplicateRunMessages).Select(_ => (MessageId: NewId.NextGuid(), Key: Guid.NewGuid())).ToList();
            var copies = keys.Take(settings.DuplicateRunMessages / 10).ToList();
            var concurrentCopies = copies.Take(copies.Count / 2).ToList();
            var lateCopies = copies.Skip(copies.Count / 2).ToList();
            await SendAsync(sender, keys.Zip(Enumerable.Range(0, keys.Count)).SelectMany(pair =>
                pair.Second < concurrentCopies.Count ? [pair.First, pair.First] : new[] { pair.First }), DuplicatePhase);
            await SendAsync(sender, lateCopies, DuplicatePhase);
            int expected = settings.Messages + steady + keys.Count + copies.Count;
            await WaitAsync(() => counter.Completed >= expected, TimeSpan.FromMinutes(5), () => $"{counter.Completed} of {expected} deliveries finished");
            long duplicateEffects = await ScalarAsync(connectionString,
                $"SELECT count(*) FROM (SELECT key FROM bench_rows WHERE phase = {DuplicatePhase} GROUP BY key HAVING count(*) > 1) d");
            if (mode == WolverineMode.Name)
            {
                // Its deliveries are counted from two signals (handler commits, logged discards): show that they add up.
                long rows = await ScalarAsync(connectionString, "SELECT count(*) FROM bench_rows");
                Console.WriteLine($"  {mode}: {counter.Completed} deliveries counted = {rows} rows committed + {counter.Discarded} duplicates discarded (expected {expected})");
            }

            await consumer.StopAsync();
            return new ModeRun(mode, rate, p50, p99, duplicateEffects, copies.Count, perTransaction);
        }
        finally
        {
            NpgsqlConnection.ClearAllPools();
            await ExecuteAdminAsync($"DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)");
            await DeleteQueueAsync(queue);
        }
    }

    private static async Task SendAsync(IBenchSender sender, IEnumerable<(Guid MessageId, Guid Key)> messages, int phase)
    {
        foreach (var chunk in messages.Chunk(500))
        {
            await Task.WhenAll(chunk.Select(m => sender.SendAsync(m.MessageId, new BenchMessage(m.Key, DateTime.UtcNow, phase))));
        }
    }

    /// <summary>MassTransit modes get a MassTransit sender; Wolverine gets its own wire format, on the queue its listener declares.</summary>
    private async Task<IBenchSender> StartSenderAsync(string mode, string queue, string connectionString)
    {
        if (mode == WolverineMode.Name)
        {
            await WolverineMode.ProvisionAsync(settings, queue, connectionString);
            return await WolverineAmqpSender.ConnectAsync(queue);
        }

        var host = await StartBusAsync(null, null, connectionString, null);
        return new MassTransitSender(host, await host.Services.GetRequiredService<IBus>().GetSendEndpoint(new Uri("queue:" + queue)));
    }

    private async Task<IHost> StartBusAsync(string? mode, string? queue, string connectionString, DeliveryCounter? counter)
    {
        var builder = Host.CreateApplicationBuilder(new HostApplicationBuilderSettings { DisableDefaults = true });
        builder.Logging.SetMinimumLevel(LogLevel.Error);
        builder.Logging.AddFilter("Microsoft.EntityFrameworkCore", LogLevel.None); // the tutorial mode's duplicate-key failures are expected
        builder.Logging.AddSimpleConsole(o => o.SingleLine = true);
        builder.Services.AddDbContext<BenchDbContext>(o => o.UseNpgsql(connectionString));
        if (mode is "exactlyonce" or "exactlyonce-batched")
        {
            builder.Services.AddExactlyOnce<BenchDbContext>();
        }

        builder.Services.AddOptions<MassTransitHostOptions>().Configure(o => o.WaitUntilStarted = true);
        builder.Services.AddMassTransit(x =>
        {
            if (mode is not null)
            {
                x.AddConsumer<BenchConsumer>();
            }

            x.UsingRabbitMq((context, cfg) =>
            {
                cfg.Host(TestHosts.RabbitMq);
                if (mode is "exactlyonce" or "exactlyonce-batched")
                {
                    cfg.UseExactlyOnceInbox(context, batched: mode == "exactlyonce-batched");
                }

                if (mode is not null)
                {
                    cfg.ReceiveEndpoint(queue!, e =>
                    {
                        e.ConfigureConsumeTopology = false;
                        e.PrefetchCount = settings.Concurrency * 4;
                        e.ConcurrentMessageLimit = settings.Concurrency;
                        e.UseMessageRetry(r => r.Immediate(5)); // the same policy for every mode
                        e.ConfigureConsumer<BenchConsumer>(context, c =>
                        {
                            if (mode == "tutorial")
                            {
                                c.ConsumerMessage<BenchMessage>(m => m.UseFilter(
                                    new TutorialInboxFilter<BenchDbContext, BenchConsumer, BenchMessage>(context.GetRequiredService<IServiceScopeFactory>())));
                            }
                        });
                    });
                }
            });
        });
        var host = builder.Build();
        if (counter is not null)
        {
            host.Services.GetRequiredService<IBus>().ConnectReceiveObserver(new CompletedCounter(counter));
        }

        await host.StartAsync();
        return host;
    }

    private static async Task<(double P50, double P99)> LatencyAsync(string connectionString)
    {
        await using var connection = new NpgsqlConnection(connectionString);
        await connection.OpenAsync();
        await using var command = new NpgsqlCommand(
            $"SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) " +
            $"FROM (SELECT extract(epoch FROM written_at - sent_at) * 1000 AS ms FROM bench_rows WHERE phase = {LatencyPhase}) l", connection);
        await using var reader = await command.ExecuteReaderAsync();
        await reader.ReadAsync();
        return (reader.GetDouble(0), reader.GetDouble(1));
    }

    private static BenchDbContext NewContext(string connectionString) =>
        new(new DbContextOptionsBuilder<BenchDbContext>().UseNpgsql(connectionString).Options);

    private static async Task WaitAsync(Func<bool> condition, TimeSpan timeout, Func<string>? progress = null)
    {
        var clock = Stopwatch.StartNew();
        while (!condition())
        {
            if (clock.Elapsed > timeout)
            {
                throw new TimeoutException($"not done within {timeout}: {progress?.Invoke() ?? "condition false"}");
            }

            await Task.Delay(10);
        }
    }

    internal static async Task<long> ScalarAsync(string connectionString, string sql)
    {
        await using var connection = new NpgsqlConnection(connectionString);
        await connection.OpenAsync();
        await using var command = new NpgsqlCommand(sql, connection);
        return Convert.ToInt64(await command.ExecuteScalarAsync());
    }

    internal static async Task<string?> ScalarTextAsync(string sql)
    {
        await using var connection = new NpgsqlConnection(TestHosts.PostgresServer + ";Database=postgres");
        await connection.OpenAsync();
        await using var command = new NpgsqlCommand(sql, connection);
        return (string?)await command.ExecuteScalarAsync();
    }

    internal static async Task ExecuteAdminAsync(string sql)
    {
        await using var connection = new NpgsqlConnection(TestHosts.PostgresServer + ";Database=postgres");
        await connection.OpenAsync();
        await using var command = new NpgsqlCommand(sql, connection);
        await command.ExecuteNonQueryAsync();
    }

    internal static async Task DeleteQueueAsync(string queue)
    {
        var factory = new ConnectionFactory { Uri = TestHosts.RabbitMq };
        await using var connection = await factory.CreateConnectionAsync();
        await using var channel = await connection.CreateChannelAsync();
        await channel.QueueDeleteAsync(queue);
        await channel.ExchangeDeleteAsync(queue);
    }

    private sealed class CompletedCounter(DeliveryCounter counter) : IReceiveObserver
    {
        public Task PreReceive(ReceiveContext context) => Task.CompletedTask;

        public Task PostReceive(ReceiveContext context)
        {
            counter.Record();
            return Task.CompletedTask;
        }

        public Task PostConsume<T>(ConsumeContext<T> context, TimeSpan duration, string consumerType) where T : class => Task.CompletedTask;

        public Task ConsumeFault<T>(ConsumeContext<T> context, TimeSpan duration, string consumerType, Exception exception) where T : class => Task.CompletedTask;

        public Task ReceiveFault(ReceiveContext context, Exception exception)
        {
            counter.Record();
            return Task.CompletedTask;
        }
    }
}
