using System.Diagnostics;
using System.Text.RegularExpressions;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Hosting;
using Microsoft.Extensions.Logging;
using Npgsql;

namespace ExactlyOnce.Benchmarks;

/// <summary>
/// What each message costs the database: N messages through the real consume pipeline of a mode, with every byte the
/// process sends to PostgreSQL read off the wire by <see cref="PgWireRecorder"/>; round trips per message and the
/// statements sent, per message.
/// </summary>
/// <remarks>
/// The MassTransit modes use MassTransit's in-memory transport (the consume pipeline, the inbox filter, the store and the
/// consumer are the real ones; the broker adds no database traffic); <c>wolverine</c> needs its RabbitMQ listener, since its
/// inbox is the listener's.
/// </remarks>
internal static partial class HotPathProfile
{
    public static readonly string[] Modes = ["baseline", "exactlyonce", "exactlyonce-batched", WolverineMode.Name];

    /// <summary>Profiles each of <paramref name="modes"/> in turn; <paramref name="keepSavepoints"/> runs the ExactlyOnce modes with
    /// <c>ExactlyOnceOptions.KeepSaveChangesSavepoints</c> (what they cost before it existed).</summary>
    public static async Task RunAsync(Settings settings, IReadOnlyList<string> modes, bool keepSavepoints = false)
    {
        foreach (string mode in modes)
        {
            await ProfileAsync(settings, mode, keepSavepoints);
        }
    }

    private static async Task ProfileAsync(Settings settings, string mode, bool keepSavepoints)
    {
        string database = "eo_profile_" + Guid.NewGuid().ToString("N")[..10];
        var server = new NpgsqlConnectionStringBuilder(TestHosts.PostgresServer);
        await using var recorder = new PgWireRecorder(server.Host ?? "127.0.0.1", server.Port);
        // Through the recorder, unencrypted so that it can read; otherwise the harness's own settings.
        string recorded = new NpgsqlConnectionStringBuilder(TestHosts.PostgresServer)
        {
            Host = "127.0.0.1", Port = recorder.Port, Database = database, SslMode = SslMode.Disable, MaxPoolSize = 64, NoResetOnClose = true,
        }.ConnectionString;
        string direct = TestHosts.PostgresServer + ";Database=" + database;
        string queue = $"profile-{mode}-{Guid.NewGuid():N}";
        await Harness.ExecuteAdminAsync($"CREATE DATABASE \"{database}\"");
        try
        {
            await using (var db = new BenchDbContext(new DbContextOptionsBuilder<BenchDbContext>().UseNpgsql(direct).Options))
            {
                await db.Database.EnsureCreatedAsync();
            }

            IBenchSender sender;
            IHost consumer;
            var counter = new DeliveryCounter(int.MaxValue);
            if (mode == WolverineMode.Name)
            {
                await WolverineMode.ProvisionAsync(settings, queue, recorded);
                sender = await WolverineAmqpSender.ConnectAsync(queue);
                consumer = await WolverineMode.StartConsumerAsync(settings, queue, recorded, counter);
            }
            else
            {
                consumer = await StartInMemoryBusAsync(mode, queue, recorded, settings.Concurrency, keepSavepoints);
                sender = new MassTransitSender(consumer, await consumer.Services.GetRequiredService<IBus>().GetSendEndpoint(new Uri("queue:" + queue)));
            }

            await using (sender)
            {
                // Warm up: connections opened, types loaded, handler code compiled; none of it is per message.
                // Enough calls for tiered compilation to reach its optimized code before anything is counted.
                const int WarmUp = 500;
                await SendAndWaitAsync(sender, direct, WarmUp, 0);
                await Task.Delay(500);
                recorder.Reset();
                TimeSpan cpuBefore = Process.GetCurrentProcess().TotalProcessorTime;
                var clock = Stopwatch.StartNew();
                await SendAndWaitAsync(sender, direct, settings.Messages, WarmUp);
                await Task.Delay(200); // let the last commits' trailing traffic (if any) arrive
                clock.Stop();
                TimeSpan cpu = Process.GetCurrentProcess().TotalProcessorTime - cpuBefore;
                Report(mode, settings.Messages, recorder, clock.Elapsed);
                // The whole process: the consume pipeline, the in-memory transport, the sender and the recording relay.
                Console.WriteLine($"   client CPU (this process, relay included): {cpu.TotalMicroseconds / settings.Messages:F0} µs per message");
                await consumer.StopAsync();
                consumer.Dispose();
            }
        }
        finally
        {
            NpgsqlConnection.ClearAllPools();
            await Harness.ExecuteAdminAsync($"DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)");
            await Harness.DeleteQueueAsync(queue);
        }
    }

    private static async Task SendAndWaitAsync(IBenchSender sender, string direct, int count, int before)
    {
        for (int i = 0; i < count; i++)
        {
            await sender.SendAsync(NewId.NextGuid(), new BenchMessage(Guid.NewGuid(), DateTime.UtcNow, 1));
        }

        // Polled on a connection that bypasses the recorder; a row is visible only once its transaction committed.
        var clock = Stopwatch.StartNew();
        while (await Harness.ScalarAsync(direct, "SELECT count(*) FROM bench_rows") < before + count)
        {
            if (clock.Elapsed > TimeSpan.FromMinutes(5))
            {
                throw new TimeoutException("profile: messages not processed within 5 minutes");
            }

            await Task.Delay(20);
        }
    }

    private static async Task<IHost> StartInMemoryBusAsync(string mode, string queue, string connectionString, int concurrency, bool keepSavepoints)
    {
        var builder = Host.CreateApplicationBuilder(new HostApplicationBuilderSettings { DisableDefaults = true });
        builder.Logging.SetMinimumLevel(LogLevel.Error);
        builder.Logging.AddSimpleConsole(o => o.SingleLine = true);
        builder.Services.AddDbContext<BenchDbContext>(o => o.UseNpgsql(connectionString));
        if (mode is "exactlyonce" or "exactlyonce-batched")
        {
            builder.Services.AddExactlyOnce<BenchDbContext>(o => o.KeepSaveChangesSavepoints = keepSavepoints);
        }

        builder.Services.AddOptions<MassTransitHostOptions>().Configure(o => o.WaitUntilStarted = true);
        builder.Services.AddMassTransit(x =>
        {
            x.AddConsumer<BenchConsumer>();
            x.UsingInMemory((context, cfg) =>
            {
                if (mode is "exactlyonce" or "exactlyonce-batched")
                {
                    cfg.UseExactlyOnceInbox(context, batched: mode == "exactlyonce-batched");
                }

                cfg.ReceiveEndpoint(queue, e =>
                {
                    e.ConcurrentMessageLimit = concurrency;
                    e.UseMessageRetry(r => r.Immediate(5));
                    e.ConfigureConsumer<BenchConsumer>(context);
                });
            });
        });
        var host = builder.Build();
        await host.StartAsync();
        return host;
    }

    private static void Report(string mode, int messages, PgWireRecorder recorder, TimeSpan elapsed)
    {
        Console.WriteLine();
        // One COMMIT per transaction: in batched mode, what a batch costs is what a message costs times the batch size.
        int commits = recorder.Statements.Where(s => s.Key.StartsWith("COMMIT", StringComparison.OrdinalIgnoreCase)).Sum(s => s.Value);
        Console.WriteLine($"== {mode}: {messages} messages in {elapsed.TotalSeconds:F1} s; " +
                          $"{(double)recorder.RoundTrips / messages:F2} round trips per message ({recorder.RoundTrips} in all); " +
                          $"{(double)recorder.SyncOrQueryMessages / messages:F2} Sync/Query messages per message ({recorder.SyncOrQueryMessages}, " +
                          "those sent ahead of a command included); " +
                          $"{commits} transactions ({(commits == 0 ? 0 : (double)messages / commits):F2} messages per transaction)");
        Console.WriteLine("   round trips, per message (each: the statements sent in one go before waiting for the server):");
        foreach (var (statements, count) in recorder.RoundTripShapes.OrderByDescending(s => s.Value).ThenBy(s => string.Join(';', s.Key), StringComparer.Ordinal))
        {
            string shape = statements.Count == 0 ? "(no statement: Sync alone)" : string.Join(" | ", statements.Select(Short));
            Console.WriteLine($"   {(double)count / messages,6:F2} × {shape}");
        }

        Console.WriteLine("   statements (full text), per message:");
        foreach (var (text, count) in recorder.Statements.OrderByDescending(s => s.Value).ThenBy(s => s.Key, StringComparer.Ordinal))
        {
            Console.WriteLine($"   {(double)count / messages,6:F2} × {Whitespace().Replace(text, " ").Trim()}");
        }
    }

    private static string Short(string statement)
    {
        string text = Whitespace().Replace(statement, " ").Trim();
        return text.Length <= 60 ? text : text[..57] + "...";
    }

    [GeneratedRegex(@"\s+")]
    private static partial Regex Whitespace();
}
