using System.Diagnostics;
using ExactlyOnce.TestHost;
using MassTransit;
using Npgsql;
using ParcelTracker.Domain.Events;
using Xunit.Abstractions;

namespace ParcelTracker.Tests;

/// <summary>
/// One Parcel Tracker process with crash injection on a fresh database: parcels are inserted and their events sent
/// straight to one consumer queue; whenever the process dies (SIGKILL at a crash point) it is started again, until the
/// test's condition holds. An optional companion process (another role, without crash injection) runs beside it and must
/// stay up: a kill then stops only the crashing role's work, not the companion's.
/// </summary>
internal sealed class CrashRig : IAsyncDisposable
{
    private readonly string[] _args;
    private readonly ITestOutputHelper _output;
    private readonly List<AppProcess> _processes = [];
    private AppProcess? _companion;

    private CrashRig(string database, string[] args, ITestOutputHelper output)
    {
        Database = database;
        CrashLog = Path.Combine(Path.GetTempPath(), $"eo-crash-{Guid.NewGuid():N}.log");
        _args = [.. args, .. Hosts(database), "--crash-log", CrashLog];
        _output = output;
    }

    public string Database { get; }

    public string CrashLog { get; }

    /// <summary>Exit codes of the processes that died.</summary>
    public List<int> ExitCodes { get; } = [];

    /// <param name="database">The fresh database.</param>
    /// <param name="args">The crashing process's role and flags.</param>
    /// <param name="output">Where restarts are reported.</param>
    /// <param name="companion">A second process's role and flags; it is never crashed and must not die.</param>
    public static async Task<CrashRig> StartAsync(string database, string[] args, ITestOutputHelper output, string[]? companion = null)
    {
        var rig = new CrashRig(database, args, output);
        if (companion is not null)
        {
            rig._companion = new AppProcess([.. companion, .. Hosts(database)]);
            await rig._companion.WaitForOutputAsync("Bus started", TimeSpan.FromSeconds(90));
        }

        await rig.StartProcessAsync();
        return rig;
    }

    private static string[] Hosts(string database) => ["--postgres", database, "--rabbitmq", TestHosts.RabbitMq.ToString()];

    /// <summary>Crashes logged at <paramref name="point"/> by <paramref name="who"/> (a queue or an action name).</summary>
    public int CrashesAt(string point, string who) =>
        File.Exists(CrashLog) ? File.ReadAllLines(CrashLog).Count(l => l.StartsWith(point + " " + who + " ", StringComparison.Ordinal)) : 0;

    /// <summary>The message ids (or action keys) that crashed at <paramref name="point"/> in <paramref name="who"/>.</summary>
    public HashSet<Guid> CrashedMessages(string point, string who) => File.Exists(CrashLog)
        ? File.ReadAllLines(CrashLog).Where(l => l.StartsWith(point + " " + who + " ", StringComparison.Ordinal)).Select(l => Guid.ParseExact(l[(l.LastIndexOf(' ') + 1)..], "N")).ToHashSet()
        : [];

    public async Task<List<(Guid ParcelId, Guid MessageId)>> SendParcelsAsync(int count, string queue)
    {
        var parcels = new List<(Guid, Guid)>();
        await using var connection = new NpgsqlConnection(Database);
        await connection.OpenAsync();
        var bus = Bus.Factory.CreateUsingRabbitMq(cfg => cfg.Host(TestHosts.RabbitMq));
        await bus.StartAsync();
        try
        {
            var endpoint = await bus.GetSendEndpoint(new Uri("queue:" + queue));
            for (int i = 0; i < count; i++)
            {
                var id = Guid.NewGuid();
                string tracking = "PT" + id.ToString("N")[..12].ToUpperInvariant();
                await using (var insert = new NpgsqlCommand(
                    "INSERT INTO parcels (id, tracking_number, destination, created_at) VALUES (@id, @tracking, @destination, now())", connection))
                {
                    insert.Parameters.AddWithValue("id", id);
                    insert.Parameters.AddWithValue("tracking", tracking);
                    insert.Parameters.AddWithValue("destination", $"Depot {i % 7}");
                    await insert.ExecuteNonQueryAsync();
                }

                var messageId = NewId.NextGuid();
                await endpoint.Send(new ParcelCreatedEvent(id, tracking, $"Depot {i % 7}"), ctx => ctx.MessageId = messageId);
                parcels.Add((id, messageId));
            }
        }
        finally
        {
            await bus.StopAsync();
        }

        return parcels;
    }

    /// <summary>Keeps a process running (restarting it whenever it dies) until <paramref name="done"/> holds.</summary>
    public async Task RunUntilAsync(Func<Task<bool>> done, string what, TimeSpan timeout)
    {
        var clock = Stopwatch.StartNew();
        while (true)
        {
            if (_companion is { HasExited: true })
            {
                throw new InvalidOperationException($"the companion process died (exit code {_companion.ExitCode}). Last output:{Environment.NewLine}{string.Join(Environment.NewLine, _companion.Lines.TakeLast(40))}");
            }

            AppProcess current = _processes[^1];
            if (current.HasExited)
            {
                int code = await current.WaitForExitAsync(TimeSpan.FromSeconds(10));
                ExitCodes.Add(code);
                _output.WriteLine($"process died with exit code {code} ({current.Lines.LastOrDefault(l => l.StartsWith("CHAOS", StringComparison.Ordinal))}); restarting");
                await StartProcessAsync();
                continue;
            }

            if (await done())
            {
                return;
            }

            if (clock.Elapsed > timeout)
            {
                throw new TimeoutException($"not {what} within {timeout}. Last output:{Environment.NewLine}{string.Join(Environment.NewLine, current.Lines.TakeLast(40))}");
            }

            await Task.Delay(100);
        }
    }

    public Task<long> ScalarAsync(string sql) => Services.ScalarAsync(Database, sql);

    private async Task StartProcessAsync()
    {
        var process = new AppProcess(_args);
        _processes.Add(process);
        try
        {
            await process.WaitForOutputAsync("Bus started", TimeSpan.FromSeconds(90));
        }
        catch (TimeoutException) when (process.HasExited)
        {
            // Killed at a crash point by a delivery that arrived while the bus was starting: the loop restarts it.
        }
    }

    public ValueTask DisposeAsync()
    {
        foreach (var process in _processes)
        {
            process.Dispose();
        }

        _companion?.Dispose();

        File.Delete(CrashLog);
        return ValueTask.CompletedTask;
    }
}
