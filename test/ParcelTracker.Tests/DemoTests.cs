using System.Text.Json;
using ExactlyOnce.TestHost;
using Xunit;
using Xunit.Abstractions;

namespace ParcelTracker.Tests;

/// <summary>The demo, as a user runs it, on both back ends: its last line is the JSON report, read from the tables.</summary>
public sealed class DemoTests(ITestOutputHelper output)
{
    [Fact]
    public async Task Demo_EmbeddedDefault_EveryParcelReservedAndNotifiedExactlyOnce()
    {
        var report = await RunDemoAsync("--parcels", "100", "--duplicates", "0.2");

        Assert.Equal(100, report.GetProperty("parcels").GetInt32());
        Assert.Equal(100, report.GetProperty("carrier_reservations").GetInt32());
        Assert.Equal(100, report.GetProperty("notifications_sent").GetInt32());
        Assert.Equal(40, report.GetProperty("duplicates_discarded").GetInt32()); // 20 redelivered events x 2 consumers
        Assert.Equal(0, report.GetProperty("parked").GetInt32());
    }

    [Fact]
    public async Task Demo_CrashRate_ConsumersKilledAtRandomPoints_EveryParcelReservedAndNotifiedExactlyOnce()
    {
        await Services.DeleteParcelTrackerQueuesAsync();
        string database = await Services.CreateDatabaseAsync();
        try
        {
            // 25 parcels = 50 deliveries: at 15 % the chance of no crash at all is 0.85^50 ≈ 0.03 %.
            var report = await RunDemoAsync("--parcels", "25", "--duplicates", "0.2", "--crash-rate", "0.15",
                "--postgres", database, "--rabbitmq", TestHosts.RabbitMq.ToString());

            Assert.True(report.GetProperty("crashes").GetInt32() > 0, "the consumer process was killed");
            Assert.Equal(25, report.GetProperty("parcels").GetInt32());
            Assert.Equal(25, report.GetProperty("carrier_reservations").GetInt32());
            Assert.Equal(25, report.GetProperty("notifications_sent").GetInt32());
            Assert.Equal(0, report.GetProperty("parked").GetInt32()); // the stand-ins honour keys
        }
        finally
        {
            await Services.DropDatabaseAsync(database);
        }
    }

    [Fact]
    public async Task Demo_PostgresAndRabbitMq_EveryParcelReservedAndNotifiedExactlyOnce()
    {
        await Services.DeleteParcelTrackerQueuesAsync();
        string database = await Services.CreateDatabaseAsync();
        try
        {
            var report = await RunDemoAsync("--parcels", "200", "--duplicates", "0.1", "--postgres", database, "--rabbitmq", TestHosts.RabbitMq.ToString());

            Assert.Equal(200, report.GetProperty("parcels").GetInt32());
            Assert.Equal(200, report.GetProperty("carrier_reservations").GetInt32());
            Assert.Equal(200, report.GetProperty("notifications_sent").GetInt32());
            Assert.Equal(40, report.GetProperty("duplicates_discarded").GetInt32());
        }
        finally
        {
            await Services.DropDatabaseAsync(database);
        }
    }

    private async Task<JsonElement> RunDemoAsync(params string[] args)
    {
        using var demo = new AppProcess(["demo", .. args]);
        int exitCode = await demo.WaitForExitAsync(TimeSpan.FromMinutes(4));
        foreach (string line in demo.Lines)
        {
            output.WriteLine(line);
        }

        Assert.Equal(0, exitCode);
        string last = demo.Lines.Last(l => !string.IsNullOrWhiteSpace(l));
        return JsonDocument.Parse(last).RootElement;
    }
}
