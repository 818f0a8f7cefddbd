using System.Net.Http.Json;
using System.Text.Json;
using ExactlyOnce.TestHost;

namespace ParcelTracker.Tests;

/// <summary>The Parcel Tracker as separate processes (api, worker, consumer) on PostgreSQL + RabbitMQ.</summary>
internal sealed class Cluster : IAsyncDisposable
{
    private readonly List<AppProcess> _processes = [];

    private Cluster(string database, int port)
    {
        Database = database;
        Port = port;
        Http = new HttpClient { BaseAddress = new Uri($"http://127.0.0.1:{port}") };
    }

    public string Database { get; }

    public int Port { get; }

    public HttpClient Http { get; }

    public IReadOnlyList<AppProcess> Processes => _processes;

    public string[] StoreArgs => ["--postgres", Database, "--rabbitmq", TestHosts.RabbitMq.ToString()];

    public static async Task<Cluster> StartApiAndWorkerAsync(string database)
    {
        var cluster = new Cluster(database, TestProcess.FreePort());
        var api = cluster.Start(["api", .. cluster.StoreArgs, "--urls", $"http://127.0.0.1:{cluster.Port}"]);
        await api.WaitForOutputAsync("Now listening on", TimeSpan.FromSeconds(90)); // the schema exists from here on
        var worker = cluster.Start(["worker", .. cluster.StoreArgs]);
        await worker.WaitForOutputAsync("Bus started", TimeSpan.FromSeconds(90));
        return cluster;
    }

    public async Task<AppProcess> StartConsumerAsync()
    {
        var consumer = Start(["consumer", .. StoreArgs]);
        await consumer.WaitForOutputAsync("Bus started", TimeSpan.FromSeconds(90));
        return consumer;
    }

    public AppProcess Start(string[] args)
    {
        var process = new AppProcess(args);
        _processes.Add(process);
        return process;
    }

    public async Task<List<Guid>> PostParcelsAsync(int count)
    {
        var ids = new List<Guid>(count);
        await Parallel.ForEachAsync(Enumerable.Range(0, count), new ParallelOptions { MaxDegreeOfParallelism = 8 }, async (i, ct) =>
        {
            var response = await Http.PostAsJsonAsync("/parcels", new { destination = $"Depot {i % 13}" }, ct);
            response.EnsureSuccessStatusCode();
            var created = await response.Content.ReadFromJsonAsync<JsonElement>(ct);
            lock (ids)
            {
                ids.Add(created.GetProperty("id").GetGuid());
            }
        });
        return ids;
    }

    public Task<long> ScalarAsync(string sql) => Services.ScalarAsync(Database, sql);

    /// <summary>Deliveries discarded as duplicates, counted from the consumers' own logs (event 1001).</summary>
    public int DuplicatesLogged => _processes.Sum(p => p.Lines.Count(l => l.Contains("[1001]", StringComparison.Ordinal)));

    public async Task<string> ReportAsync(int sent)
    {
        long slots = await ScalarAsync("SELECT count(*) FROM parcels WHERE pickup_slot IS NOT NULL");
        long notified = await ScalarAsync("SELECT count(*) FROM parcels WHERE notified_at IS NOT NULL");
        long inbox = await ScalarAsync("SELECT count(*) FROM inbox_messages WHERE processed_at IS NOT NULL");
        long maxInboxPerKey = await ScalarAsync("SELECT COALESCE(max(n), 0) FROM (SELECT count(*) n FROM inbox_messages GROUP BY id, consumer_type) x");
        long reservations = await ScalarAsync("SELECT count(*) FROM carrier_reservations");
        long sms = await ScalarAsync("SELECT count(*) FROM notifications_sent");
        return $"sent {sent} parcels; processed: {slots} with a slot, {notified} notified; inbox rows {inbox} (at most {maxInboxPerKey} per message and consumer); " +
               $"duplicates discarded {DuplicatesLogged}; outside world: {reservations} reservations, {sms} SMS for {sent} parcels";
    }

    public async Task WaitUntilSettledAsync(int parcels, TimeSpan timeout)
    {
        var clock = System.Diagnostics.Stopwatch.StartNew();
        while (await SettledOrZeroAsync() < parcels)
        {
            if (clock.Elapsed > timeout)
            {
                string tail = string.Join(Environment.NewLine, _processes.SelectMany(p => p.Lines.TakeLast(15)));
                throw new TimeoutException($"not settled within {timeout}: {await ReportAsync(parcels)}{Environment.NewLine}{tail}");
            }

            await Task.Delay(200);
        }
    }

    private async Task<long> SettledOrZeroAsync()
    {
        try
        {
            // Notified = the consumer scheduled the SMS (committed) and the worker sent it afterwards (an after-commit action).
            return await ScalarAsync("SELECT count(*) FROM parcels p WHERE pickup_slot IS NOT NULL AND notified_at IS NOT NULL " +
                                     "AND EXISTS (SELECT 1 FROM notifications_sent n WHERE n.parcel_id = p.id)");
        }
        catch (Npgsql.NpgsqlException)
        {
            return 0; // the database is restarting
        }
    }

    public async ValueTask DisposeAsync()
    {
        foreach (var process in _processes)
        {
            process.Dispose();
        }

        Http.Dispose();
        await Task.CompletedTask;
    }
}
