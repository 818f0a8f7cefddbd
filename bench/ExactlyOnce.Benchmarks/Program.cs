using System.Globalization;
using System.Runtime.InteropServices;
using System.Text.Json;
using ExactlyOnce.Benchmarks;

// dotnet run -c Release --project bench/ExactlyOnce.Benchmarks -- throughput --messages 20000 --json results.json
//   [--repeats 3] [--modes baseline,tutorial,exactlyonce,wolverine] [--rate 200] [--latency-seconds 10] [--duplicate-messages 5000] [--concurrency 16]
//   [--warmup-messages 2000]  (every mode once, not recorded, before the first measured run; 0 to skip)
// dotnet run -c Release --project bench/ExactlyOnce.Benchmarks -- profile [--messages 500] [--modes baseline,exactlyonce,exactlyonce-batched,wolverine]
//   [--keep-savepoints] [--no-benchmark]
//   round trips and SQL per message off the wire, then the BenchmarkDotNet hot-path benchmark (allocations, time)
if (args.Length == 0 || args[0] is not ("throughput" or "profile"))
{
    Console.Error.WriteLine("usage: throughput --messages N [--json FILE] [--repeats R] [--modes a,b,c] [--rate MSG_PER_S] [--latency-seconds S] [--duplicate-messages N] [--concurrency C] [--warmup-messages N]");
    Console.Error.WriteLine("       profile [--messages N] [--modes a,b,c] [--concurrency C] [--keep-savepoints] [--no-benchmark]");
    return 2;
}

string? Option(string name) => Array.IndexOf(args, name) is var i and >= 0 && i + 1 < args.Length ? args[i + 1] : null;
int IntOption(string name, int fallback) => Option(name) is { } v ? int.Parse(v, CultureInfo.InvariantCulture) : fallback;
if (args[0] == "profile")
{
    var profileModes = Option("--modes")?.Split(',', StringSplitOptions.RemoveEmptyEntries | StringSplitOptions.TrimEntries) ?? HotPathProfile.Modes;
    if (profileModes.FirstOrDefault(m => !HotPathProfile.Modes.Contains(m)) is { } unknown)
    {
        Console.Error.WriteLine($"unknown profile mode '{unknown}'; available: {string.Join(", ", HotPathProfile.Modes)}");
        return 2;
    }

    var profileSettings = new Settings(IntOption("--messages", 500), 1, profileModes, 0, 0, 0, IntOption("--concurrency", 16), null);
    await HotPathProfile.RunAsync(profileSettings, profileModes, keepSavepoints: args.Contains("--keep-savepoints"));
    if (!args.Contains("--no-benchmark"))
    {
        BenchmarkDotNet.Running.BenchmarkRunner.Run<InboxHotPathBenchmarks>();
    }

    return 0;
}

var settings = new Settings(
    Messages: IntOption("--messages", 20000),
    Repeats: IntOption("--repeats", 3),
    Modes: Option("--modes")?.Split(',', StringSplitOptions.RemoveEmptyEntries | StringSplitOptions.TrimEntries) ?? Harness.AllModes,
    Rate: IntOption("--rate", 200),
    LatencySeconds: IntOption("--latency-seconds", 10),
    DuplicateRunMessages: IntOption("--duplicate-messages", 5000),
    Concurrency: IntOption("--concurrency", 16),
    JsonPath: Option("--json"));
foreach (string mode in settings.Modes)
{
    if (!Harness.AllModes.Contains(mode))
    {
        Console.Error.WriteLine($"unknown mode '{mode}'; available: {string.Join(", ", Harness.AllModes)}");
        return 2;
    }
}

// Warm-up, not recorded: every mode once on a small load, so JIT, connection pools and broker channels are warm
// before the first measured run (otherwise the first mode of the process pays for them).
int warmup = IntOption("--warmup-messages", 2000);
if (warmup > 0)
{
    var warm = new Harness(settings with { Messages = warmup, LatencySeconds = 1, DuplicateRunMessages = Math.Max(10, warmup / 10) });
    foreach (string mode in settings.Modes)
    {
        var run = await warm.RunAsync(mode);
        Console.WriteLine($"warm-up  {mode,-12} {run.MessagesPerSecond,8:F0} msg/s (not recorded)");
    }
}

// 0 skips the database ceiling (e.g. while measuring where the CPU goes); the ratios to it are then NaN.
int ceilingSeconds = IntOption("--ceiling-seconds", 10);
var harness = new Harness(settings);
var runs = new List<ModeRun>();
var ceilings = new List<(double Insert, double Inbox)>();
for (int repeat = 1; repeat <= settings.Repeats; repeat++)
{
    // Rotate the order each repeat, so drift in the machine's load does not always favour the same mode.
    var order = settings.Modes.Skip((repeat - 1) % settings.Modes.Length).Concat(settings.Modes.Take((repeat - 1) % settings.Modes.Length));
    foreach (string mode in order)
    {
        var run = await harness.RunAsync(mode);
        runs.Add(run);
        Console.WriteLine($"repeat {repeat} {mode,-12} {run.MessagesPerSecond,8:F0} msg/s  p50 {run.P50Ms,6:F1} ms  p99 {run.P99Ms,7:F1} ms  duplicate effects {run.DuplicateEffects}/{run.DuplicatesSent}" +
            (double.IsNaN(run.MessagesPerTransaction) ? "" : $"  {run.MessagesPerTransaction:F1} msg/tx"));
    }

    if (ceilingSeconds <= 0)
    {
        continue;
    }

    var ceiling = await DbCeiling.MeasureAsync(settings.Concurrency, TimeSpan.FromSeconds(ceilingSeconds));
    ceilings.Add(ceiling);
    Console.WriteLine($"repeat {repeat} db ceiling   insert-only {ceiling.InsertOnly:F0} tx/s, inbox transaction {ceiling.InboxTransaction:F0} tx/s");
}

static double Median(IEnumerable<double> values)
{
    var sorted = values.Order().ToArray();
    return sorted.Length % 2 == 1 ? sorted[sorted.Length / 2] : (sorted[sorted.Length / 2 - 1] + sorted[sorted.Length / 2]) / 2;
}

double baseline = runs.Where(r => r.Mode == "baseline").Select(r => r.MessagesPerSecond).DefaultIfEmpty(double.NaN).Pipe(Median);
double insertCeiling = ceilings.Count == 0 ? double.NaN : Median(ceilings.Select(c => c.Insert));
double inboxCeiling = ceilings.Count == 0 ? double.NaN : Median(ceilings.Select(c => c.Inbox));
Console.WriteLine();
Console.WriteLine($"{"mode",-12} {"msg/s median",12} {"min–max",15} {"× baseline",10} {"× db ceiling",12} {"p50 ms",7} {"p99 ms",7} {"dup effects",11}");
var modes = new List<object>();
foreach (string mode in settings.Modes)
{
    var mine = runs.Where(r => r.Mode == mode).ToList();
    double median = Median(mine.Select(r => r.MessagesPerSecond));
    double ceiling = mode == "baseline" ? insertCeiling : inboxCeiling;
    double p50 = Median(mine.Select(r => r.P50Ms));
    double p99 = Median(mine.Select(r => r.P99Ms));
    long duplicates = mine.Max(r => r.DuplicateEffects);
    Console.WriteLine($"{mode,-12} {median,12:F0} {$"{mine.Min(r => r.MessagesPerSecond):F0}–{mine.Max(r => r.MessagesPerSecond):F0}",15} {median / baseline,10:F2} {median / ceiling,12:F2} {p50,7:F1} {p99,7:F1} {duplicates,11}");
    modes.Add(new
    {
        name = mode,
        messages_per_second = Math.Round(median, 1),
        messages_per_second_runs = mine.Select(r => Math.Round(r.MessagesPerSecond, 1)).ToArray(),
        ratio_to_baseline = Math.Round(median / baseline, 3),
        fraction_of_db_ceiling = Math.Round(median / ceiling, 3),
        p50_ms = Math.Round(p50, 2),
        p99_ms = Math.Round(p99, 2),
        p50_ms_runs = mine.Select(r => Math.Round(r.P50Ms, 2)).ToArray(),
        p99_ms_runs = mine.Select(r => Math.Round(r.P99Ms, 2)).ToArray(),
        duplicate_effects = duplicates,
        messages_per_transaction_runs = mine.Select(r => double.IsNaN(r.MessagesPerTransaction) ? (double?)null : Math.Round(r.MessagesPerTransaction, 2)).ToArray(),
        duplicates_sent = mine[0].DuplicatesSent,
    });
}

Console.WriteLine($"db ceiling: insert-only {insertCeiling:F0} tx/s, inbox transaction {inboxCeiling:F0} tx/s (median of {ceilings.Count})");
if (settings.JsonPath is not null)
{
    string synchronousCommit = (await Harness.ScalarTextAsync("SHOW synchronous_commit"))!;
    string version = (await Harness.ScalarTextAsync("SHOW server_version"))!;
    var report = new
    {
        machine = new
        {
            cores = Environment.ProcessorCount,
            memory_gib = Math.Round(GC.GetGCMemoryInfo().TotalAvailableMemoryBytes / (1024.0 * 1024 * 1024), 1),
            os = RuntimeInformation.OSDescription,
            dotnet = RuntimeInformation.FrameworkDescription,
            cpu = File.Exists("/proc/cpuinfo") ? File.ReadLines("/proc/cpuinfo").FirstOrDefault(l => l.StartsWith("model name", StringComparison.Ordinal))?.Split(':')[1].Trim() : null,
        },
        postgres = new { synchronous_commit = synchronousCommit, version },
        settings = new { settings.Messages, settings.Repeats, settings.Rate, settings.LatencySeconds, settings.DuplicateRunMessages, settings.Concurrency },
        modes,
        db_ceiling = new
        {
            insert_only_tx_per_second = Math.Round(insertCeiling, 1),
            inbox_transaction_tx_per_second = Math.Round(inboxCeiling, 1),
            runs = ceilings.Select(c => new { insert_only = Math.Round(c.Insert, 1), inbox_transaction = Math.Round(c.Inbox, 1) }).ToArray(),
        },
    };
    await File.WriteAllTextAsync(settings.JsonPath, JsonSerializer.Serialize(report, new JsonSerializerOptions
    {
        WriteIndented = true,
        // A run without baseline or ceiling has NaN ratios: written as "NaN", not a failed run.
        NumberHandling = System.Text.Json.Serialization.JsonNumberHandling.AllowNamedFloatingPointLiterals,
    }));
    Console.WriteLine($"wrote {settings.JsonPath}");
}

return 0;

internal static class PipeExtensions
{
    public static TResult Pipe<T, TResult>(this T value, Func<T, TResult> f) => f(value);
}
