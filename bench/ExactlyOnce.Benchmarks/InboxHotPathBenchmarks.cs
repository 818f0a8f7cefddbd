using BenchmarkDotNet.Attributes;
using BenchmarkDotNet.Configs;
using BenchmarkDotNet.Jobs;
using BenchmarkDotNet.Toolchains.InProcess.Emit;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Npgsql;

namespace ExactlyOnce.Benchmarks;

/// <summary>
/// One message through the inbox hot path on PostgreSQL, against the same business write without it: a DI scope, a
/// <see cref="BenchDbContext"/>, one row. <c>Inbox</c> is what <c>InboxConsumerFilter</c> does per delivery:
/// <see cref="InboxProtocol.ProcessAsync"/> with the EF Core store (begin, the claim writing the row already processed, the consumer's row, commit).
/// Allocations are the figure to trust; times include loopback round trips on a shared machine.
/// </summary>
[MemoryDiagnoser]
[Config(typeof(ShortInProcess))]
public class InboxHotPathBenchmarks
{
    private string _database = "";
    private ServiceProvider _services = null!;
    private InboxProtocol _protocol = null!;

    [GlobalSetup]
    public void Setup()
    {
        _database = "eo_hotpath_" + Guid.NewGuid().ToString("N")[..10];
        Harness.ExecuteAdminAsync($"CREATE DATABASE \"{_database}\"").GetAwaiter().GetResult();
        string connectionString = TestHosts.PostgresServer + ";Database=" + _database + ";Maximum Pool Size=64;No Reset On Close=true";
        var services = new ServiceCollection();
        services.AddLogging();
        services.AddDbContext<BenchDbContext>(o => o.UseNpgsql(connectionString));
        services.AddExactlyOnce<BenchDbContext>();
        _services = services.BuildServiceProvider();
        using (var scope = _services.CreateScope())
        {
            scope.ServiceProvider.GetRequiredService<BenchDbContext>().Database.EnsureCreated();
        }

        _protocol = _services.GetRequiredService<InboxProtocol>();
    }

    [GlobalCleanup]
    public void Cleanup()
    {
        _services.Dispose();
        NpgsqlConnection.ClearAllPools();
        Harness.ExecuteAdminAsync($"DROP DATABASE IF EXISTS \"{_database}\" WITH (FORCE)").GetAwaiter().GetResult();
    }

    [Benchmark(Baseline = true, Description = "business write alone")]
    public async Task PlainWrite()
    {
        await using var scope = _services.CreateAsyncScope();
        var db = scope.ServiceProvider.GetRequiredService<BenchDbContext>();
        db.Rows.Add(new BenchRow { Key = Guid.NewGuid(), SentAt = DateTime.UtcNow, Phase = 1 });
        await db.SaveChangesAsync();
    }

    [Benchmark(Description = "InboxProtocol.ProcessAsync + write")]
    public async Task Inbox()
    {
        await using var scope = _services.CreateAsyncScope();
        var db = scope.ServiceProvider.GetRequiredService<BenchDbContext>();
        var store = scope.ServiceProvider.GetRequiredService<IInboxStore>();
        await _protocol.ProcessAsync(store, new InboxKey(NewId.NextGuid(), "bench"), cancellationToken =>
        {
            db.Rows.Add(new BenchRow { Key = Guid.NewGuid(), SentAt = DateTime.UtcNow, Phase = 1 });
            return db.SaveChangesAsync(cancellationToken);
        });
    }

    /// <summary>A short job in this process: a few minutes in all, no separate build.</summary>
    private sealed class ShortInProcess : ManualConfig
    {
        public ShortInProcess()
        {
            AddJob(Job.ShortRun.WithToolchain(InProcessEmitToolchain.Instance));
        }
    }
}
