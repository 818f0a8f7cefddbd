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

namespace ParcelTracker;

/// <summary>
/// <c>demo [--parcels N] [--duplicates FRACTION] [--postgres … --rabbitmq …]</c>: registers N parcels through the
/// HTTP API, republishes a fraction of their events with the original message ids (simulated redeliveries), waits
/// until everything has settled and reports. The last line is one JSON object whose counts are read from the tables.
/// </summary>
internal static class Demo
{
    public static async Task<int> RunAsync(string[] args)
    {
        var options = new ConfigurationBuilder()
            .AddCommandLine(args, new Dictionary<string, string> { ["--parcels"] = "Parcels", ["--duplicates"] = "Duplicates" })
            .Build();
        int parcels = int.Parse(options["Parcels"] ?? "100", CultureInfo.InvariantCulture);
        double duplicates = double.Parse(options["Duplicates"] ?? "0.1", CultureInfo.InvariantCulture);
        if (parcels < 1 || duplicates is < 0 or > 1)
        {
            Console.Error.WriteLine("demo: --parcels must be at least 1 and --duplicates between 0 and 1");
            return 2;
        }

        string? tempSqlite = null;
        var appArgs = args.ToList();
        if (!appArgs.Contains("--postgres") && !appArgs.Contains("--sqlite"))
        {
            // A fresh embedded database per demo run.
            tempSqlite = Path.Combine(Path.GetTempPath(), $"parceltracker-demo-{Guid.NewGuid():N}.db");
            appArgs.AddRange(["--sqlite", tempSqlite]);
        }

        appArgs.AddRange(["--urls", "http://127.0.0.1:0"]);
        var app = ParcelTrackerApp.Build(Roles.All, [.. appArgs], b =>
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
                bool done = settled == parcels && Interlocked.Read(ref duplicatesDiscarded) >= 2L * redelivered;
                if (settled != lastReported || done)
                {
                    Console.WriteLine($"  settled {settled}/{parcels} parcels; {Interlocked.Read(ref duplicatesDiscarded)} duplicate deliveries discarded");
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
            double seconds = Math.Round(clock.Elapsed.TotalSeconds, 2);
            Console.WriteLine($"  outside world saw {reservations} carrier reservations and {notifications} SMS for {parcels} parcels " +
                              (reservations == parcels && notifications == parcels ? "(each exactly once)" : "(NOT exactly once)"));
            Console.WriteLine(JsonSerializer.Serialize(new Dictionary<string, object>
            {
                ["parcels"] = parcels,
                ["carrier_reservations"] = reservations,
                ["notifications_sent"] = notifications,
                ["duplicates_discarded"] = Interlocked.Read(ref duplicatesDiscarded),
                ["seconds"] = seconds,
            }));
            return reservations == parcels && notifications == parcels ? 0 : 1;
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

    private static async Task<int> CountSettledAsync(IServiceProvider services, List<Guid> ids)
    {
        await using var scope = services.CreateAsyncScope();
        var db = scope.ServiceProvider.GetRequiredService<ParcelDbContext>();
        return await db.Parcels.CountAsync(p => ids.Contains(p.Id) && p.PickupSlot != null && p.NotifiedAt != null);
    }
}
