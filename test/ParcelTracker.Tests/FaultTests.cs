using System.Diagnostics;
using ExactlyOnce.TestHost;
using RabbitMQ.Client;
using Xunit;
using Xunit.Abstractions;

namespace ParcelTracker.Tests;

/// <summary>
/// Surviving faults, on the Parcel Tracker as separate processes against the real services: the database and the
/// broker are stopped mid-stream and started again; the database is unreachable at start-up; a body is unreadable.
/// </summary>
public sealed class FaultTests(ITestOutputHelper output) : IAsyncLifetime
{
    private const int Parcels = 200;
    private string _database = "";

    public async Task InitializeAsync()
    {
        await Services.DeleteParcelTrackerQueuesAsync();
        _database = await Services.CreateDatabaseAsync();
    }

    public async Task DisposeAsync()
    {
        await EnsurePostgresRunningAsync();
        await Services.DropDatabaseAsync(_database);
    }

    [Fact]
    public async Task PostgresStoppedForTenSecondsMidStream_NothingLostNothingDuplicated_ConsumersRecoverWithoutRestart()
    {
        await using var cluster = await Cluster.StartApiAndWorkerAsync(_database);
        var ids = await QueueParcelsWithoutConsumerAsync(cluster, Parcels);
        var consumer = await cluster.StartConsumerAsync();
        await Eventually.AssertAsync(async () => await cluster.ScalarAsync("SELECT count(*) FROM inbox_messages") >= Parcels / 5, "a fifth of the messages processed", TimeSpan.FromSeconds(60));

        long processedBefore = await cluster.ScalarAsync("SELECT count(*) FROM inbox_messages");
        await RunAsync("pg_ctlcluster", "--skip-systemctl-redirect", "15", "main", "stop", "-m", "fast");
        var outage = Stopwatch.StartNew();
        await Task.Delay(TimeSpan.FromSeconds(10)); // the outage itself: ten seconds without a database
        await RunAsync("pg_ctlcluster", "--skip-systemctl-redirect", "15", "main", "start");
        Npgsql.NpgsqlConnection.ClearAllPools(); // this test's own pooled connections died with the server
        output.WriteLine($"PostgreSQL stopped for {outage.Elapsed.TotalSeconds:F1} s after {processedBefore} of {2 * Parcels} inbox rows were committed");

        await cluster.WaitUntilSettledAsync(Parcels, TimeSpan.FromMinutes(3));
        output.WriteLine(await cluster.ReportAsync(Parcels));
        Assert.False(consumer.HasExited, "the consumer recovered by itself");
        await AssertExactlyOnceAsync(cluster, ids);
    }

    [Fact]
    public async Task RabbitMqStoppedAndStartedMidStream_NothingLostNothingDuplicated()
    {
        await using var cluster = await Cluster.StartApiAndWorkerAsync(_database);
        var ids = await QueueParcelsWithoutConsumerAsync(cluster, Parcels);
        var consumer = await cluster.StartConsumerAsync();
        await Eventually.AssertAsync(async () => await cluster.ScalarAsync("SELECT count(*) FROM inbox_messages") >= Parcels / 5, "a fifth of the messages processed", TimeSpan.FromSeconds(60));

        long processedBefore = await cluster.ScalarAsync("SELECT count(*) FROM inbox_messages");
        await RunAsync("rabbitmqctl", "stop_app");
        var outage = Stopwatch.StartNew();
        await Task.Delay(TimeSpan.FromSeconds(10));
        await RunAsync("rabbitmqctl", "start_app");
        await RunAsync("rabbitmqctl", "await_startup");
        output.WriteLine($"RabbitMQ stopped for {outage.Elapsed.TotalSeconds:F1} s after {processedBefore} of {2 * Parcels} inbox rows were committed");

        // More parcels after the restart: the API, the dispatcher and the consumer all reconnected.
        ids.AddRange(await cluster.PostParcelsAsync(50));
        await cluster.WaitUntilSettledAsync(Parcels + 50, TimeSpan.FromMinutes(3));
        output.WriteLine(await cluster.ReportAsync(Parcels + 50));
        Assert.False(consumer.HasExited, "the consumer recovered by itself");
        await AssertExactlyOnceAsync(cluster, ids);
    }

    [Fact]
    public async Task DatabaseUnreachableAtStartup_ClearErrorAndRetries_NotACrashLoop_NoCredentialsLogged()
    {
        using var api = new AppProcess("api", "--postgres", "Host=127.0.0.1;Port=1;Username=postgres;Password=s3cret-not-logged;Database=none;Timeout=1",
            "--rabbitmq", TestHosts.RabbitMq.ToString(), "--urls", $"http://127.0.0.1:{TestProcess.FreePort()}");

        await Eventually.AssertAsync(() => Task.FromResult(api.Lines.Count(l => l.Contains("Database not reachable", StringComparison.Ordinal)) >= 3), "three retry warnings", TimeSpan.FromSeconds(30));

        Assert.False(api.HasExited, "it keeps retrying instead of exiting");
        string warning = api.Lines.First(l => l.Contains("Database not reachable", StringComparison.Ordinal));
        output.WriteLine(warning);
        Assert.Contains("retrying in 2 s", warning, StringComparison.Ordinal);
        Assert.Contains("127.0.0.1:1", warning, StringComparison.Ordinal); // the reason names what could not be reached
        Assert.DoesNotContain(api.Lines, l => l.Contains("s3cret-not-logged", StringComparison.Ordinal));
    }

    [Fact]
    public async Task UnreadableBody_GoesToTheErrorQueueWithTheReason_NothingAcknowledgedUnprocessed()
    {
        await using var cluster = await Cluster.StartApiAndWorkerAsync(_database);
        await cluster.StartConsumerAsync();
        var ids = await cluster.PostParcelsAsync(20);

        var factory = new ConnectionFactory { Uri = TestHosts.RabbitMq };
        await using (var connection = await factory.CreateConnectionAsync())
        await using (var channel = await connection.CreateChannelAsync())
        {
            var props = new BasicProperties { ContentType = "application/vnd.masstransit+json", MessageId = Guid.NewGuid().ToString(), Persistent = true };
            await channel.BasicPublishAsync("", "parcel-created-carrier", false, props, "{ this is not json"u8.ToArray());
        }

        await Eventually.AssertAsync(async () => await Services.ReadyMessagesAsync("parcel-created-carrier_error") == 1, "moved to the error queue", TimeSpan.FromSeconds(60));
        await cluster.WaitUntilSettledAsync(20, TimeSpan.FromMinutes(1));
        await using (var connection = await factory.CreateConnectionAsync())
        await using (var channel = await connection.CreateChannelAsync())
        {
            var faulted = await channel.BasicGetAsync("parcel-created-carrier_error", autoAck: false);
            Assert.NotNull(faulted);
            string Header(string name) => System.Text.Encoding.UTF8.GetString((byte[])faulted.BasicProperties.Headers![name]!);
            string exceptionType = Header("MT-Fault-ExceptionType");
            string reason = Header("MT-Fault-Message");
            output.WriteLine($"error queue: {exceptionType}: {reason}; body kept: {System.Text.Encoding.UTF8.GetString(faulted.Body.Span)}");
            Assert.Equal("{ this is not json", System.Text.Encoding.UTF8.GetString(faulted.Body.Span)); // kept as it was, re-drivable
            Assert.Contains("Json", exceptionType, StringComparison.Ordinal); // the deserializer's own error, kept with the message
            Assert.False(string.IsNullOrWhiteSpace(reason));
        }

        output.WriteLine(await cluster.ReportAsync(20));
        await AssertExactlyOnceAsync(cluster, ids);
    }

    /// <summary>
    /// Declares the consumers' queues (a consumer process starts and is killed), then registers the parcels: their
    /// events wait in the queues, so the outage below hits the consumer while it works through them.
    /// </summary>
    private static async Task<List<Guid>> QueueParcelsWithoutConsumerAsync(Cluster cluster, int count)
    {
        var first = await cluster.StartConsumerAsync();
        first.Kill();
        var ids = await cluster.PostParcelsAsync(count);
        await Eventually.AssertAsync(async () => await cluster.ScalarAsync("SELECT count(*) FROM outbox_messages WHERE dispatched_at IS NULL") == 0
            && await Services.ReadyMessagesAsync("parcel-created-carrier") == count, "every event dispatched and waiting in its queue", TimeSpan.FromSeconds(60));
        return ids;
    }

    private static async Task AssertExactlyOnceAsync(Cluster cluster, List<Guid> ids)
    {
        Assert.Equal(ids.Count, await cluster.ScalarAsync("SELECT count(*) FROM parcels WHERE pickup_slot IS NOT NULL AND notified_at IS NOT NULL"));
        Assert.Equal(ids.Count, await cluster.ScalarAsync("SELECT count(*) FROM inbox_messages WHERE consumer_type = 'parcel-tracker.carrier-assignment' AND processed_at IS NOT NULL"));
        Assert.Equal(ids.Count, await cluster.ScalarAsync("SELECT count(*) FROM inbox_messages WHERE consumer_type = 'parcel-tracker.notification' AND processed_at IS NOT NULL"));
        // The SMS actions are marked done just after the gateway received them: wait for the last marks.
        await Eventually.AssertAsync(async () => await cluster.ScalarAsync("SELECT count(*) FROM outbox_messages WHERE dispatched_at IS NULL") == 0,
            "every event and action dispatched", TimeSpan.FromSeconds(30));
        Assert.Equal(0u, await Services.ReadyMessagesAsync("parcel-created-carrier"));
        Assert.Equal(0u, await Services.ReadyMessagesAsync("parcel-created-notification"));
    }

    private static async Task EnsurePostgresRunningAsync()
    {
        try
        {
            await RunAsync("pg_ctlcluster", "--skip-systemctl-redirect", "15", "main", "start");
        }
        catch (InvalidOperationException)
        {
            // already running
        }
    }

    private static async Task RunAsync(string file, params string[] args)
    {
        var start = new ProcessStartInfo(file) { RedirectStandardOutput = true, RedirectStandardError = true, UseShellExecute = false };
        foreach (string arg in args)
        {
            start.ArgumentList.Add(arg);
        }

        using var process = Process.Start(start)!;
        string stderr = await process.StandardError.ReadToEndAsync();
        await process.WaitForExitAsync();
        if (process.ExitCode != 0)
        {
            throw new InvalidOperationException($"{file} {string.Join(' ', args)} exited with {process.ExitCode}: {stderr}");
        }
    }

}
