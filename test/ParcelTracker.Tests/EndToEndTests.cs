using System.Net.Http.Json;
using System.Text.Json;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Hosting;
using Npgsql;
using ParcelTracker.Domain.Events;
using Xunit;
using Xunit.Abstractions;

namespace ParcelTracker.Tests;

/// <summary>
/// API, consumer and worker as separate processes on PostgreSQL + RabbitMQ; parcels through HTTP; redeliveries
/// injected; the consumer process killed with SIGKILL mid-stream and restarted.
/// </summary>
public sealed class EndToEndTests(ITestOutputHelper output) : ParcelTrackerDatabaseTest
{
    private const int Parcels = 500;
    private const int Redelivered = 50;

    [Fact]
    public async Task SeparateProcesses_ConsumerKilledMidStream_EveryParcelHasOneSlotAndOneInboxRowPerConsumer()
    {
        string rabbit = TestHosts.RabbitMq.ToString();
        int port = TestProcess.FreePort();
        string[] store = ["--postgres", Database, "--rabbitmq", rabbit];
        using var api = new AppProcess(["api", .. store, "--urls", $"http://127.0.0.1:{port}"]);
        await api.WaitForOutputAsync("Now listening on", TimeSpan.FromSeconds(90)); // the schema exists from here on
        using var worker = new AppProcess(["worker", .. store]);
        var consumer = new AppProcess(["consumer", .. store]);
        AppProcess? restarted = null;
        try
        {
            await worker.WaitForOutputAsync("Bus started", TimeSpan.FromSeconds(90));
            await consumer.WaitForOutputAsync("Bus started", TimeSpan.FromSeconds(90));

            // 1. Parcels through HTTP; the consumer process is killed with SIGKILL after a third of them and restarted.
            using var http = new HttpClient { BaseAddress = new Uri($"http://127.0.0.1:{port}") };
            var ids = new List<Guid>();
            int posted = 0;
            await Parallel.ForEachAsync(Enumerable.Range(0, Parcels), new ParallelOptions { MaxDegreeOfParallelism = 8 }, async (i, ct) =>
            {
                var response = await http.PostAsJsonAsync("/parcels", new { destination = $"Depot {i % 11}" }, ct);
                response.EnsureSuccessStatusCode();
                var created = await response.Content.ReadFromJsonAsync<JsonElement>(ct);
                lock (ids)
                {
                    ids.Add(created.GetProperty("id").GetGuid());
                }

                if (Interlocked.Increment(ref posted) == Parcels / 3)
                {
                    await Eventually.AssertAsync(async () => await Services.ScalarAsync(Database, "SELECT count(*) FROM inbox_messages") > 0, "the consumer has committed work", TimeSpan.FromSeconds(60));
                    long processed = await Services.ScalarAsync(Database, "SELECT count(*) FROM inbox_messages");
                    int postedAtKill = Volatile.Read(ref posted);
                    consumer.Kill();
                    output.WriteLine($"consumer process killed with SIGKILL mid-stream: {postedAtKill} of {Parcels} parcels posted, {processed} inbox rows committed");
                    restarted = new AppProcess(["consumer", .. store]);
                }
            });
            Assert.NotNull(restarted);
            await restarted!.WaitForOutputAsync("Bus started", TimeSpan.FromSeconds(90));

            // 2. Redeliveries: a sample of the events again, with their original message ids.
            await Eventually.AssertAsync(async () => await Services.ScalarAsync(Database, "SELECT count(*) FROM outbox_messages WHERE dispatched_at IS NOT NULL") >= Parcels, "every event dispatched", TimeSpan.FromMinutes(2));
            await RedeliverAsync(Redelivered);

            // 3. Everything settles.
            await Eventually.AssertAsync(async () =>
                    await Services.ScalarAsync(Database, "SELECT count(*) FROM parcels WHERE pickup_slot IS NOT NULL AND notified_at IS NOT NULL") == Parcels
                    && await Services.ReadyMessagesAsync("parcel-created-carrier") == 0
                    && await Services.ReadyMessagesAsync("parcel-created-notification") == 0,
                "every parcel settled and both queues drained",
                TimeSpan.FromMinutes(4));

            // The SMS is an after-commit action: the worker sends it once the notification consumer's transaction committed.
            await Eventually.AssertAsync(async () => await Services.ScalarAsync(Database, "SELECT count(DISTINCT parcel_id) FROM notifications_sent") >= Parcels,
                "every SMS sent", TimeSpan.FromMinutes(1));
            long slots = await Services.ScalarAsync(Database, "SELECT count(*) FROM parcels WHERE pickup_slot IS NOT NULL");
            long carrierInbox = await Services.ScalarAsync(Database, "SELECT count(*) FROM inbox_messages WHERE consumer_type = 'parcel-tracker.carrier-assignment' AND processed_at IS NOT NULL");
            long notificationInbox = await Services.ScalarAsync(Database, "SELECT count(*) FROM inbox_messages WHERE consumer_type = 'parcel-tracker.notification' AND processed_at IS NOT NULL");
            long reservations = await Services.ScalarAsync(Database, "SELECT count(*) FROM carrier_reservations");
            long repeatedReservations = await Services.ScalarAsync(Database, "SELECT count(*) FROM (SELECT parcel_id FROM carrier_reservations GROUP BY parcel_id HAVING count(*) > 1) r");
            long sms = await Services.ScalarAsync(Database, "SELECT count(*) FROM notifications_sent");
            long repeatedSms = await Services.ScalarAsync(Database, "SELECT count(*) FROM (SELECT parcel_id FROM notifications_sent GROUP BY parcel_id HAVING count(*) > 1) r");
            output.WriteLine($"sent {Parcels} parcels through HTTP, {Redelivered} events redelivered, consumer killed once");
            output.WriteLine($"database effects: {slots} parcels with a slot; inbox rows: carrier {carrierInbox}, notification {notificationInbox}");
            output.WriteLine($"outside world: {reservations} carrier reservations ({repeatedReservations} parcels booked more than once), {sms} SMS ({repeatedSms} parcels notified more than once)");
            output.WriteLine($"calls that reached the stand-ins: carrier {await Services.ScalarAsync(Database, "SELECT sum(calls) FROM carrier_reservations")}, SMS gateway {await Services.ScalarAsync(Database, "SELECT sum(calls) FROM notifications_sent")} (repeats carry the same key)");

            Assert.Equal(Parcels, ids.Count);
            Assert.Equal(Parcels, slots);
            Assert.Equal(Parcels, carrierInbox);
            Assert.Equal(Parcels, notificationInbox);
            Assert.Equal(Parcels, await Services.ScalarAsync(Database, "SELECT count(DISTINCT id) FROM inbox_messages"));
            // The booking is a recorded step and the SMS an after-commit action, with key-honouring stand-ins: exactly once each.
            Assert.Equal(Parcels, reservations);
            Assert.Equal(0, repeatedReservations);
            Assert.Equal(Parcels, sms);
            Assert.Equal(0, repeatedSms);
        }
        finally
        {
            consumer.Dispose();
            restarted?.Dispose();
        }
    }

    private async Task RedeliverAsync(int count)
    {
        var rows = new List<(Guid MessageId, ParcelCreatedEvent Message)>();
        await using (var connection = new NpgsqlConnection(Database))
        {
            await connection.OpenAsync();
            await using var command = new NpgsqlCommand("SELECT message_id, body FROM outbox_messages ORDER BY sequence LIMIT @n", connection);
            command.Parameters.AddWithValue("n", count);
            await using var reader = await command.ExecuteReaderAsync();
            while (await reader.ReadAsync())
            {
                rows.Add((reader.GetGuid(0), JsonSerializer.Deserialize<ParcelCreatedEvent>(reader.GetString(1), JsonSerializerOptions.Web)!));
            }
        }

        var builder = Host.CreateApplicationBuilder(new HostApplicationBuilderSettings { DisableDefaults = true });
        builder.Services.AddMassTransit(x => x.UsingRabbitMq((_, cfg) => cfg.Host(TestHosts.RabbitMq)));
        using var host = builder.Build();
        await host.StartAsync();
        var bus = host.Services.GetRequiredService<IBus>();
        foreach (var (messageId, message) in rows)
        {
            await bus.Publish(message, ctx => ctx.MessageId = messageId);
        }

        await host.StopAsync();
    }

}
