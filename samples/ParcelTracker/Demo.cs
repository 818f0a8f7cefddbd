using System.Diagnostics;
using System.Diagnostics.Metrics;
using System.Globalization;
using System.Text.Json;
using MassTransit;
using Microsoft.AspNetCore.Hosting.Server;
using Microsoft.AspNetCore.Hosting.Server.Features;
using Microsoft.EntityFrameworkCore;
using ParcelTracker.Data;
using ParcelTracker.Domain.Events;
using ParcelTracker.Hosting;
using ParcelTracker.OutsideWorld;
using ExactlyOnce.Steps;

namespace ParcelTracker;

/// <summary>
/// <c>demo [--parcels N] [--duplicates FRACTION] [--crash-rate FRACTION] [--postgres … --rabbitmq …]</c>: registers N
/// parcels through the HTTP API, republishes a fraction of their events with the original message ids (simulated
/// redeliveries), waits until everything has settled and reports. With <c>--crash-rate</c> the consumers run as a
/// child process that kills itself with SIGKILL at random crash points and are restarted. The
/// last line is one JSON object whose counts are read from the tables.
/// </summary>
internal static class Demo
{
    public static async Task<int> RunAsync(string[] args)
    {
        var options = new ConfigurationBuilder()
            .AddCommandLine(args, new Dictionary<string, string> { ["--parcels"] = "Parcels", ["--duplicates"] = "Duplicates", ["--crash-rate"] = "CrashRate" })
            .Build();
        int parcels = int.Parse(options["Parcels"] ?? "100", CultureInfo.InvariantCulture);
        double duplicates = double.Parse(options["Duplicates"] ?? "0.1", CultureInfo.InvariantCulture);
        double crashRate = double.Parse(options["CrashRate"] ?? "0", CultureInfo.InvariantCulture);
        if (parcels < 1 || duplicates is < 0 or > 1 || crashRate is < 0 or >= 1)
        {
            Console.Error.WriteLine("demo: --parcels must be at least 1, --duplicates between 0 and 1, --crash-rate at least 0 and below 1");
            return 2;
        }

        if (crashRate > 0 && !(args.Contains("--postgres") && args.Contains("--rabbitmq")))
        {
            Console.Error.WriteLine("demo: --crash-rate runs the consumers as separate processes, which need a shared database and broker: " +
                                    "add --postgres \"<connection string>\" --rabbitmq amqp://… (the embedded SQLite + in-memory transport live in one process)");
            return 2;
        }

        string? tempSqlite = null;
        var appArgs = WithoutOption(args, "--crash-rate").ToList();
        await using var children = crashRate > 0 ? new CrashingChildren([.. appArgs, "--crash-rate", crashRate.ToString(CultureInfo.InvariantCulture)]) : null;
        if (!appArgs.Contains("--postgres") && !appArgs.Contains("--sqlite"))
        {
            // A fresh embedded database per demo run.
            tempSqlite = Path.Combine(Path.GetTempPath(), $"parceltracker-demo-{Guid.NewGuid():N}.db");
            appArgs.AddRange(["--sqlite", tempSqlite]);
        }

        appArgs.AddRange(["--urls", "http://127.0.0.1:0"]);
        var app = ParcelTrackerApp.Build(children is null ? Roles.All : Roles.Api | Roles.Worker, [.. appArgs], b =>
        {
            // The report is the output (duplicates are expected here): the console shows errors only, whatever the configuration says.
            b.Logging.AddFilter<Microsoft.Extensions.Logging.Console.ConsoleLoggerProvider>(level => level >= LogLevel.Error);
        });
        long duplicatesDiscarded = 0;
        using var listener = new MeterListener();
        listener.InstrumentPublished = (instrument, l) =>
        {
            if (instrument.Meter.Name == "ExactlyOnce" && instrument.Name == "exactlyonce.inbox.messages.duplicates")
            {
                l.EnableMeasurementEvents(instrument);
            }
        };
        listener.SetMeasurementEventCallback<long>((_, value, _, _) => Interlocked.Add(ref duplicatesDiscarded, value));
        listener.Start();

        var clock = Stopwatch.StartNew();
        await app.StartAsync();
        try
        {
            var settings = app.Services.GetRequiredService<AppSettings>();
            Console.WriteLine($"ExactlyOnce Parcel Tracker demo: {parcels} parcels, {duplicates:P0} of their events redelivered");
            Console.WriteLine($"  store and transport: {settings.Describe()}");
            var outsideWorld = app.Services.GetRequiredService<OutsideWorldSettings>();
            Console.WriteLine($"  carrier {(outsideWorld.CarrierHonoursKeys ? "honours" : "ignores")} idempotency keys, unknown booking outcome → " +
                              $"{app.Services.GetRequiredService<ParcelTracker.Consumers.CarrierStepPolicy>().Mode}; SMS gateway {(outsideWorld.SmsHonoursKeys ? "honours" : "ignores")} keys");
            if (children is not null)
            {
                Console.WriteLine($"  consumers run as a child process killed with SIGKILL at {crashRate:P1} of crash-point visits, and restarted");
                await children.StartAsync();
            }

            string address = app.Services.GetRequiredService<IServer>().Features.Get<IServerAddressesFeature>()!.Addresses.First();
            using var http = new HttpClient { BaseAddress = new Uri(address) };

            // 1. Register the parcels through the API (each: parcel + event in one transaction via the outbox).
            var ids = new List<Guid>(parcels);
            await Parallel.ForEachAsync(Enumerable.Range(0, parcels), new ParallelOptions { MaxDegreeOfParallelism = 8 }, async (i, ct) =>
            {
                var response = await http.PostAsJsonAsync("/parcels", new { destination = $"Depot {i % 17}, Main Street {i}" }, ct);
                response.EnsureSuccessStatusCode();
                var created = await response.Content.ReadFromJsonAsync<JsonElement>(ct);
                lock (ids)
                {
                    ids.Add(created.GetProperty("id").GetGuid());
                    if (ids.Count % Math.Max(1, parcels / 5) == 0 || ids.Count == parcels)
                    {
                        Console.WriteLine($"  registered {ids.Count}/{parcels} parcels");
                    }
                }
            });

            // 2. Redeliver a fraction of the events with their original message ids, as a broker would.
            int redelivered = (int)Math.Round(parcels * duplicates);
            var idSet = ids.ToHashSet();
            if (redelivered > 0)
            {
                var events = await WaitForDispatchedEventsAsync(app.Services, idSet, redelivered);
                var bus = app.Services.GetRequiredService<IBus>();
                foreach (var (messageId, message) in events)
                {
                    await bus.Publish(message, ctx => ctx.MessageId = messageId);
                }

                Console.WriteLine($"  redelivered {events.Count} events with their original message ids");
            }

            // 3. Wait until every parcel has its slot and its notification, and every redelivery was discarded.
            var deadline = Stopwatch.StartNew();
            int lastReported = -1;
            while (true)
            {
                int settled = await CountSettledAsync(app.Services, ids);
                long discarded = children?.DuplicatesDiscarded ?? Interlocked.Read(ref duplicatesDiscarded);
                bool done = settled == parcels && discarded >= 2L * redelivered;
                if (settled != lastReported || done)
                {
                    Console.WriteLine($"  settled {settled}/{parcels} parcels; {discarded} duplicate deliveries discarded" +
                                      (children is null ? "" : $"; {children.Kills} crashes so far"));
                    lastReported = settled;
                }

                if (done)
                {
                    break;
                }

                if (deadline.Elapsed > TimeSpan.FromMinutes(5))
                {
                    Console.WriteLine("  gave up waiting after 5 minutes: not everything settled");
                    break;
                }

                await Task.Delay(250);
            }

            await using var scope = app.Services.CreateAsyncScope();
            await using var outside = await scope.ServiceProvider.GetRequiredService<IDbContextFactory<OutsideWorldDbContext>>().CreateDbContextAsync();
            int reservations = await outside.CarrierReservations.CountAsync(r => ids.Contains(r.ParcelId));
            int notifications = await outside.NotificationsSent.CountAsync(n => ids.Contains(n.ParcelId));
            int reservationCalls = await outside.CarrierReservations.Where(r => ids.Contains(r.ParcelId)).SumAsync(r => r.Calls);
            int smsCalls = await outside.NotificationsSent.Where(n => ids.Contains(n.ParcelId)).SumAsync(n => n.Calls);
            int parked = (await app.Services.GetRequiredService<IRecordedStepAdministration>().ListParkedAsync(int.MaxValue)).Count;
            double seconds = Math.Round(clock.Elapsed.TotalSeconds, 2);
            bool exact = reservations == parcels && notifications == parcels && parked == 0;
            bool parkedSafely = parked > 0 && reservations <= parcels && notifications == parcels;
            Console.WriteLine($"  outside world saw {reservations} carrier reservations ({reservationCalls} calls) and {notifications} SMS ({smsCalls} calls) " +
                              $"for {parcels} parcels; {parked} bookings parked with an unknown outcome " +
                              (exact ? "(each exactly once)" : parkedSafely ? "(at most once; parked ones wait for an operator)" : "(NOT exactly once)"));
            Console.WriteLine(JsonSerializer.Serialize(new Dictionary<string, object>
            {
                ["parcels"] = parcels,
                ["carrier_reservations"] = reservations,
                ["notifications_sent"] = notifications,
                ["parked"] = parked,
                ["duplicates_discarded"] = children?.DuplicatesDiscarded ?? Interlocked.Read(ref duplicatesDiscarded),
                ["crashes"] = children?.Kills ?? 0,
                ["seconds"] = seconds,
            }));
            return exact || parkedSafely ? 0 : 1;
        }
        finally
        {
            await app.StopAsync();
            await app.DisposeAsync();
            if (tempSqlite is not null)
            {
                Microsoft.Data.Sqlite.SqliteConnection.ClearAllPools();
                foreach (string file in Directory.GetFiles(Path.GetDirectoryName(tempSqlite)!, Path.GetFileNameWithoutExtension(tempSqlite) + "*"))
                {
                    File.Delete(file);
                }
            }
        }
    }

    private static async Task<List<(Guid MessageId, ParcelCreatedEvent Message)>> WaitForDispatchedEventsAsync(IServiceProvider services, HashSet<Guid> parcels, int count)
    {
        var deadline = Stopwatch.StartNew();
        while (true)
        {
            await using var scope = services.CreateAsyncScope();
            var db = scope.ServiceProvider.GetRequiredService<ParcelDbContext>();
            var rows = await db.Set<ExactlyOnce.EntityFrameworkCore.OutboxMessage>().AsNoTracking()
                .Where(m => m.DispatchedAt != null && m.MessageType.StartsWith(typeof(ParcelCreatedEvent).FullName!))
                .OrderBy(m => m.Sequence).Select(m => new { m.MessageId, m.Body }).ToListAsync();
            var events = rows
                .Select(r => (r.MessageId, Message: JsonSerializer.Deserialize<ParcelCreatedEvent>(r.Body, JsonSerializerOptions.Web)!))
                .Where(e => parcels.Contains(e.Message.ParcelId))
                .Take(count)
                .ToList();
            if (events.Count >= count || deadline.Elapsed > TimeSpan.FromMinutes(2))
            {
                return events;
            }

            await Task.Delay(100);
        }
    }

    /// <summary>Parcels whose booking is recorded (or parked) and whose SMS reached the gateway.</summary>
    private static async Task<int> CountSettledAsync(IServiceProvider services, List<Guid> ids)
    {
        await using var scope = services.CreateAsyncScope();
        var db = scope.ServiceProvider.GetRequiredService<ParcelDbContext>();
        int booked = await db.Parcels.CountAsync(p => ids.Contains(p.Id) && p.PickupSlot != null && p.NotifiedAt != null);
        int parked = (await services.GetRequiredService<IRecordedStepAdministration>().ListParkedAsync(int.MaxValue)).Count;
        await using var outside = await scope.ServiceProvider.GetRequiredService<IDbContextFactory<OutsideWorldDbContext>>().CreateDbContextAsync();
        int notified = await outside.NotificationsSent.Where(n => ids.Contains(n.ParcelId)).Select(n => n.ParcelId).Distinct().CountAsync();
        return Math.Min(booked + parked, notified);
    }

    private static IEnumerable<string> WithoutOption(string[] args, string option)
    {
        for (int i = 0; i < args.Length; i++)
        {
            if (args[i] == option)
            {
                i++; // and its value
                continue;
            }

            yield return args[i];
        }
    }
}
