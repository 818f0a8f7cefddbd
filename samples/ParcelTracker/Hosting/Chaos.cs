using System.Diagnostics;
using System.Globalization;
using MassTransit;

namespace ParcelTracker.Hosting;

/// <summary>
/// Crash injection for the demo and the crash tests: kills this process with SIGKILL at named points.
/// <list type="bullet">
/// <item><c>--crash-rate F</c>: a fraction F of deliveries (and of action executions) die, each at a random one of
/// the crash points on its path: every visit kills with probability F divided by the number of points on that path.</item>
/// <item><c>--crash-at POINT[,POINT] --crash-times N --crash-log FILE</c>: the first N deliveries (per point and
/// consumer) that reach POINT each crash there once. The log (appended and flushed before the kill) survives restarts,
/// so a redelivered message passes the point the second time. Deliveries that reach the point within
/// <c>--crash-gather-ms</c> (default 300; 0 = kill at the first) share one kill, each stopped exactly at the point.</item>
/// </list>
/// Points: <c>before-call</c> (step started, carrier not called), <c>after-call</c> (carrier booked, step not yet
/// recorded), <c>after-record</c> (step recorded, transaction not committed), <c>after-schedule</c> (SMS scheduled,
/// transaction not committed), <c>after-commit</c> (committed, not acknowledged), <c>after-action-call</c> (SMS sent
/// by the dispatcher, action not yet marked done).
/// </summary>
public sealed class Chaos
{
    public static readonly string[] Points = ["before-call", "after-call", "after-record", "after-schedule", "after-commit", "after-action-call"];

    private readonly double _rate;
    private readonly HashSet<string> _points;
    private readonly int _times;
    private readonly string? _log;
    private readonly int _gatherMilliseconds;
    private readonly HashSet<string> _crashed = new(StringComparer.Ordinal);
    private readonly Dictionary<string, int> _counts = new(StringComparer.Ordinal);
    private readonly Lock _gate = new();
    private bool _killScheduled;

    public Chaos(IConfiguration configuration)
    {
        _rate = double.Parse(configuration["CrashRate"] ?? "0", CultureInfo.InvariantCulture);
        _points = (configuration["CrashAt"] ?? "").Split(',', StringSplitOptions.RemoveEmptyEntries | StringSplitOptions.TrimEntries).ToHashSet(StringComparer.Ordinal);
        foreach (string point in _points)
        {
            if (!Points.Contains(point))
            {
                throw new ArgumentException($"Unknown crash point '{point}'; use one of {string.Join(", ", Points)}.");
            }
        }

        _times = int.Parse(configuration["CrashTimes"] ?? "20", CultureInfo.InvariantCulture);
        _log = configuration["CrashLog"];
        _gatherMilliseconds = int.Parse(configuration["CrashGatherMs"] ?? "300", CultureInfo.InvariantCulture);
        if (_points.Count > 0 && _log is null)
        {
            throw new ArgumentException("--crash-at needs --crash-log FILE (it remembers which deliveries already crashed, across restarts).");
        }

        if (_log is not null && File.Exists(_log))
        {
            foreach (string line in File.ReadAllLines(_log))
            {
                if (_crashed.Add(line))
                {
                    string pointAndConsumer = line[..line.LastIndexOf(' ')];
                    _counts[pointAndConsumer] = _counts.GetValueOrDefault(pointAndConsumer) + 1;
                }
            }
        }
    }

    public bool Enabled => _rate > 0 || _points.Count > 0;

    /// <summary>Passes point <paramref name="point"/> for <paramref name="messageId"/> in <paramref name="consumer"/>, or dies there.</summary>
    /// <param name="point">The crash point.</param>
    /// <param name="consumer">Who passes it (queue or action name).</param>
    /// <param name="messageId">The delivery.</param>
    /// <param name="pointsOnPath">How many crash points this delivery's path has, so that <c>--crash-rate</c> is per delivery.</param>
    public Task AtAsync(string point, string consumer, Guid? messageId, int pointsOnPath = 1)
    {
        if (_rate > 0 && Random.Shared.NextDouble() < _rate / pointsOnPath)
        {
            Console.WriteLine($"CHAOS: killing at {point} ({consumer} {messageId})");
            Console.Out.Flush();
            Process.GetCurrentProcess().Kill();
        }

        if (!_points.Contains(point) || messageId is null)
        {
            return Task.CompletedTask;
        }

        string pointAndConsumer = point + " " + consumer;
        string entry = pointAndConsumer + " " + messageId.Value.ToString("N");
        lock (_gate)
        {
            if (_crashed.Contains(entry) || _counts.GetValueOrDefault(pointAndConsumer) >= _times)
            {
                return Task.CompletedTask;
            }

            _crashed.Add(entry);
            _counts[pointAndConsumer] = _counts.GetValueOrDefault(pointAndConsumer) + 1;
            using (var file = new FileStream(_log!, FileMode.Append, FileAccess.Write, FileShare.ReadWrite))
            using (var writer = new StreamWriter(file))
            {
                writer.WriteLine(entry);
                writer.Flush();
                file.Flush(flushToDisk: true);
            }

            if (!_killScheduled)
            {
                _killScheduled = true;
                // Let other deliveries in flight reach their point too, then kill them all where they stand.
                _ = Task.Run(async () =>
                {
                    await Task.Delay(_gatherMilliseconds);
                    Console.WriteLine($"CHAOS: killing at {point}");
                    Console.Out.Flush();
                    Process.GetCurrentProcess().Kill();
                });
            }
        }

        return Task.Delay(Timeout.Infinite); // this delivery stops here until the kill
    }
}

/// <summary>Runs after the inbox committed and before MassTransit acknowledges: the <c>after-commit</c> crash point.</summary>
internal sealed class ChaosAfterCommitFilter(Chaos chaos) : IFilter<ConsumeContext>
{
    public async Task Send(ConsumeContext context, IPipe<ConsumeContext> next)
    {
        await next.Send(context);
        string queue = context.ReceiveContext.InputAddress.AbsolutePath.TrimEnd('/').Split('/')[^1];
        // The carrier's path has four crash points, the notification's two.
        await chaos.AtAsync("after-commit", queue, context.MessageId, queue == Consumers.CarrierAssignmentConsumer.Queue ? 4 : 2);
    }

    public void Probe(ProbeContext context) => context.CreateFilterScope("chaosAfterCommit");
}
