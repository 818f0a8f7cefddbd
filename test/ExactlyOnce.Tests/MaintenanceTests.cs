using System.Diagnostics.Metrics;
using ExactlyOnce.EntityFrameworkCore;
using ExactlyOnce.Maintenance;
using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Diagnostics.HealthChecks;
using Microsoft.Extensions.Diagnostics.Metrics.Testing;
using Microsoft.Extensions.Hosting;
using Microsoft.Extensions.Time.Testing;
using Npgsql;
using Xunit;
using Xunit.Abstractions;

namespace ExactlyOnce.Tests;

/// <summary>Retention cleanup, gauges and health checks against real PostgreSQL, with a fake clock.</summary>
public sealed class MaintenanceTests(ITestOutputHelper output) : PostgresRabbitTest
{
    private static readonly DateTime Now = new(2030, 6, 1, 12, 0, 0, DateTimeKind.Utc);
    private readonly FakeTimeProvider _clock = new(new DateTimeOffset(Now));

    [Fact]
    public async Task Cleanup_DeletesOnlyProcessedInboxAndDispatchedOutboxRowsOlderThanRetention_InFullBatchesUntilDone()
    {
        // Inbox: 5 processed 8 days ago (out of retention), 2 processed 1 day ago, 3 unprocessed received 30 days ago.
        await InsertInboxAsync(5, received: Now.AddDays(-8), processed: Now.AddDays(-8));
        await InsertInboxAsync(2, received: Now.AddDays(-1), processed: Now.AddDays(-1));
        await InsertInboxAsync(3, received: Now.AddDays(-30), processed: null);
        // Outbox: 4 dispatched 8 days ago, 1 dispatched yesterday, 2 never dispatched, written 30 days ago.
        await InsertOutboxAsync(4, created: Now.AddDays(-8), dispatched: Now.AddDays(-8));
        await InsertOutboxAsync(1, created: Now.AddDays(-1), dispatched: Now.AddDays(-1));
        await InsertOutboxAsync(2, created: Now.AddDays(-30), dispatched: null);
        using var host = BuildMaintenanceHost(o => o.Maintenance.CleanupBatchSize = 2); // forces several batches
        using var deleted = new MetricCollector<long>(host.Services.GetRequiredService<IMeterFactory>(), "ExactlyOnce", "exactlyonce.cleanup.rows.deleted");

        var (inbox, outbox) = await host.Services.GetRequiredService<RetentionCleanupService>().RunOnceAsync();

        Assert.Equal(5, inbox);
        Assert.Equal(4, outbox);
        Assert.Equal(2, await ScalarAsync("SELECT count(*) FROM inbox_messages WHERE processed_at IS NOT NULL"));
        Assert.Equal(3, await ScalarAsync("SELECT count(*) FROM inbox_messages WHERE processed_at IS NULL"));
        Assert.Equal(1, await ScalarAsync("SELECT count(*) FROM outbox_messages WHERE dispatched_at IS NOT NULL"));
        Assert.Equal(2, await ScalarAsync("SELECT count(*) FROM outbox_messages WHERE dispatched_at IS NULL"));
        var byTable = deleted.GetMeasurementSnapshot().GroupBy(m => (string)m.Tags["exactlyonce.table"]!).ToDictionary(g => g.Key, g => g.Sum(m => m.Value));
        Assert.Equal(5, byTable["inbox_messages"]);
        Assert.Equal(4, byTable["outbox_messages"]);

        // A week later the rows that were inside retention are out of it; unprocessed and undispatched rows stay.
        _clock.Advance(TimeSpan.FromDays(7));
        Assert.Equal((2L, 1L), await host.Services.GetRequiredService<RetentionCleanupService>().RunOnceAsync());
        Assert.Equal(3, await ScalarAsync("SELECT count(*) FROM inbox_messages"));
        Assert.Equal(2, await ScalarAsync("SELECT count(*) FROM outbox_messages"));
    }

    [Fact]
    public async Task Cleanup_HostedService_RunsAgainAfterItsInterval_OnTheFakeClock()
    {
        using var host = BuildMaintenanceHost(o => o.Maintenance.CleanupInterval = TimeSpan.FromMinutes(10));
        await host.StartAsync();
        await Eventually.AssertAsync(() => Task.FromResult(host.Services.GetRequiredService<CleanupState>().LastSuccess is not null), "first pass at start");

        await InsertInboxAsync(3, received: Now.AddDays(-9), processed: Now.AddDays(-9));
        _clock.Advance(TimeSpan.FromMinutes(9));
        Assert.Equal(3, await ScalarAsync("SELECT count(*) FROM inbox_messages")); // not yet: the interval has not passed
        _clock.Advance(TimeSpan.FromMinutes(1));
        await Eventually.AssertAsync(async () => await ScalarAsync("SELECT count(*) FROM inbox_messages") == 0, "second pass after the interval");
        await host.StopAsync();
    }

    [Fact]
    public async Task Cleanup_FourInstancesAtOnce_DeleteEveryOldRowOnce_WithoutDeadlockOrError()
    {
        await ExecuteAsync($"""
            INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
            SELECT gen_random_uuid(), 'c', @t, @t FROM generate_series(1, 20000)
            """, Now.AddDays(-10));
        var hosts = Enumerable.Range(0, 4).Select(_ => BuildMaintenanceHost(o => o.Maintenance.CleanupBatchSize = 500)).ToList();

        var results = await Task.WhenAll(hosts.Select(h => h.Services.GetRequiredService<RetentionCleanupService>().RunOnceAsync()));

        Assert.Equal(20000, results.Sum(r => r.Inbox));
        Assert.Equal(0, await ScalarAsync("SELECT count(*) FROM inbox_messages"));
        output.WriteLine("deleted per instance: " + string.Join(", ", results.Select(r => r.Inbox)));
        hosts.ForEach(h => h.Dispose());
    }

    [Fact]
    public async Task Cleanup_OnAMillionRows_TheDeleteFindsOldRowsThroughTheIndex_NotAScan()
    {
        await ExecuteAsync("""
            INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
            SELECT gen_random_uuid(), 'consumer-' || (i % 4), @t + (i * interval '0.7776 seconds'), @t + (i * interval '0.7776 seconds')
            FROM generate_series(1, 1000000) AS i
            """, Now.AddDays(-9)); // nine days of traffic: the oldest two are out of the 7-day retention
        await ExecuteAsync("ANALYZE inbox_messages", Now);
        using var host = BuildMaintenanceHost();
        await using var scope = host.Services.CreateAsyncScope();
        var db = scope.ServiceProvider.GetRequiredService<TestDbContext>();
        string delete = MaintenanceSql.For(db).DeleteInbox!;

        await using var connection = new NpgsqlConnection(ConnectionString);
        await connection.OpenAsync();
        await using var explain = new NpgsqlCommand("EXPLAIN " + delete, connection);
        explain.Parameters.AddWithValue("eo_cutoff", Now.AddDays(-7));
        explain.Parameters.AddWithValue("eo_limit", 1000);
        var plan = new List<string>();
        await using (var reader = await explain.ExecuteReaderAsync())
        {
            while (await reader.ReadAsync())
            {
                plan.Add(reader.GetString(0));
            }
        }

        output.WriteLine(string.Join(Environment.NewLine, plan));
        Assert.Equal(1_000_000, await ScalarAsync("SELECT count(*) FROM inbox_messages"));
        Assert.Contains(plan, line => line.Contains("ix_inbox_messages_processed_at", StringComparison.Ordinal));
        Assert.DoesNotContain(plan, line => line.Contains("Seq Scan", StringComparison.Ordinal));
    }

    [Fact]
    public async Task Gauges_ReportInboxRowsOutboxPendingOldestPendingAgeAndTimeSinceCleanup()
    {
        await InsertInboxAsync(7, received: Now.AddMinutes(-5), processed: Now.AddMinutes(-5));
        await ExecuteAsync("ANALYZE inbox_messages", Now);
        await InsertOutboxAsync(3, created: Now.AddSeconds(-90), dispatched: null);
        await InsertOutboxAsync(2, created: Now.AddSeconds(-200), dispatched: Now.AddSeconds(-199));
        using var host = BuildMaintenanceHost();
        var factory = host.Services.GetRequiredService<IMeterFactory>();
        using var inboxRows = new MetricCollector<long>(factory, "ExactlyOnce", "exactlyonce.inbox.rows");
        using var pending = new MetricCollector<long>(factory, "ExactlyOnce", "exactlyonce.outbox.pending");
        using var oldest = new MetricCollector<double>(factory, "ExactlyOnce", "exactlyonce.outbox.oldest_pending.age");
        using var sinceCleanup = new MetricCollector<double>(factory, "ExactlyOnce", "exactlyonce.cleanup.since_last_success");

        await host.StartAsync(); // the sampler reads the statistics, the cleanup runs its first pass
        await Eventually.AssertAsync(() => Task.FromResult(host.Services.GetRequiredService<StatisticsState>().Latest is not null
            && host.Services.GetRequiredService<CleanupState>().LastSuccess is not null), "sampled and cleaned");
        _clock.Advance(TimeSpan.FromSeconds(30));
        inboxRows.RecordObservableInstruments();
        pending.RecordObservableInstruments();
        oldest.RecordObservableInstruments();
        sinceCleanup.RecordObservableInstruments();

        Assert.Equal(7, inboxRows.LastMeasurement!.Value);
        Assert.Equal("{row}", inboxRows.Instrument!.Unit);
        Assert.Equal(3, pending.LastMeasurement!.Value);
        Assert.Equal("{message}", pending.Instrument!.Unit);
        Assert.Equal(120, oldest.LastMeasurement!.Value, precision: 3);
        Assert.Equal("s", oldest.Instrument!.Unit);
        Assert.Equal(30, sinceCleanup.LastMeasurement!.Value, precision: 3);
        await host.StopAsync();
    }

    [Fact]
    public async Task HealthChecks_HealthyThenOutboxBacklogAndStaleCleanupTurnUnhealthy()
    {
        using var host = BuildMaintenanceHost(o =>
        {
            o.Maintenance.OutboxBacklogThreshold = TimeSpan.FromMinutes(5);
            o.Maintenance.CleanupStaleThreshold = TimeSpan.FromMinutes(30);
        });
        var health = host.Services.GetRequiredService<HealthCheckService>();

        var report = await health.CheckHealthAsync();
        Assert.Equal(HealthStatus.Healthy, report.Status);
        Assert.Equal(["exactlyonce-cleanup", "exactlyonce-database", "exactlyonce-outbox-backlog"], report.Entries.Keys.Order());

        await InsertOutboxAsync(1, created: Now.AddMinutes(-6), dispatched: null);
        _clock.Advance(TimeSpan.FromMinutes(31)); // and no cleanup has run
        report = await health.CheckHealthAsync();

        Assert.Equal(HealthStatus.Unhealthy, report.Entries["exactlyonce-outbox-backlog"].Status);
        Assert.Contains("is a dispatcher running", report.Entries["exactlyonce-outbox-backlog"].Description, StringComparison.Ordinal);
        Assert.Equal(HealthStatus.Unhealthy, report.Entries["exactlyonce-cleanup"].Status);
        Assert.Equal(HealthStatus.Healthy, report.Entries["exactlyonce-database"].Status);

        await host.Services.GetRequiredService<RetentionCleanupService>().RunOnceAsync();
        report = await health.CheckHealthAsync();
        Assert.Equal(HealthStatus.Healthy, report.Entries["exactlyonce-cleanup"].Status);
    }

    [Fact]
    public async Task HealthChecks_DatabaseUnreachable_IsUnhealthyWithTheReason()
    {
        using var host = BuildMaintenanceHost(database: "Host=127.0.0.1;Port=1;Username=postgres;Password=postgres;Database=none;Timeout=2");
        var report = await host.Services.GetRequiredService<HealthCheckService>().CheckHealthAsync();

        Assert.Equal(HealthStatus.Unhealthy, report.Entries["exactlyonce-database"].Status);
        Assert.Contains("cannot be reached", report.Entries["exactlyonce-database"].Description, StringComparison.Ordinal);
        Assert.NotNull(report.Entries["exactlyonce-database"].Exception);
        Assert.DoesNotContain("Password", report.Entries["exactlyonce-database"].Exception!.Message, StringComparison.OrdinalIgnoreCase);
    }

    private IHost BuildMaintenanceHost(Action<ExactlyOnceOptions>? configure = null, string? database = null)
    {
        var builder = Host.CreateApplicationBuilder(new HostApplicationBuilderSettings { DisableDefaults = true });
        builder.Services.AddSingleton<TimeProvider>(_clock);
        builder.Services.AddDbContext<TestDbContext>(o => o.UseNpgsql(database ?? ConnectionString));
        builder.Services.AddExactlyOnce<TestDbContext>(o => configure?.Invoke(o));
        builder.Services.AddExactlyOnceMaintenance();
        builder.Services.AddHealthChecks().AddExactlyOnceHealthChecks();
        return builder.Build();
    }

    private Task InsertInboxAsync(int count, DateTime received, DateTime? processed) => ExecuteAsync(
        $"INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at) SELECT gen_random_uuid(), 'c', @t, {(processed is null ? "NULL" : "@p")} FROM generate_series(1, {count})",
        received, processed);

    private Task InsertOutboxAsync(int count, DateTime created, DateTime? dispatched) => ExecuteAsync(
        $"INSERT INTO outbox_messages (message_id, message_type, body, created_at, dispatched_at, attempts) SELECT gen_random_uuid(), 'T, A', '{{}}', @t, {(dispatched is null ? "NULL" : "@p")}, 0 FROM generate_series(1, {count})",
        created, dispatched);

    private async Task ExecuteAsync(string sql, DateTime t, DateTime? p = null)
    {
        await using var connection = new NpgsqlConnection(ConnectionString);
        await connection.OpenAsync();
        await using var command = new NpgsqlCommand(sql, connection) { CommandTimeout = 300 };
        command.Parameters.AddWithValue("t", t);
        if (p is not null)
        {
            command.Parameters.AddWithValue("p", p.Value);
        }

        await command.ExecuteNonQueryAsync();
    }

    private async Task<long> ScalarAsync(string sql)
    {
        await using var connection = new NpgsqlConnection(ConnectionString);
        await connection.OpenAsync();
        await using var command = new NpgsqlCommand(sql, connection);
        return Convert.ToInt64(await command.ExecuteScalarAsync(), System.Globalization.CultureInfo.InvariantCulture);
    }
}
