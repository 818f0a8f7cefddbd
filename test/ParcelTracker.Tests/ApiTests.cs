using System.Net;
using System.Net.Http.Json;
using System.Text.Json;
using Microsoft.AspNetCore.Builder;
using Microsoft.AspNetCore.Hosting.Server;
using Microsoft.AspNetCore.Hosting.Server.Features;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Logging;
using ParcelTracker.Hosting;
using Xunit;

namespace ParcelTracker.Tests;

/// <summary>The HTTP API, in process on the embedded default (SQLite + in-memory transport).</summary>
public sealed class ApiTests : IAsyncLifetime
{
    private readonly string _sqlite = Path.Combine(Path.GetTempPath(), $"pt-api-{Guid.NewGuid():N}.db");
    private WebApplication? _app;
    private HttpClient? _http;

    private HttpClient Http => _http!;

    public async Task InitializeAsync()
    {
        _app = ParcelTrackerApp.Build(Roles.All, ["--sqlite", _sqlite, "--urls", "http://127.0.0.1:0"], b => b.Logging.SetMinimumLevel(LogLevel.Warning));
        await _app.StartAsync();
        string address = _app.Services.GetRequiredService<IServer>().Features.Get<IServerAddressesFeature>()!.Addresses.First();
        _http = new HttpClient { BaseAddress = new Uri(address) };
    }

    public async Task DisposeAsync()
    {
        _http?.Dispose();
        if (_app is not null)
        {
            await _app.StopAsync();
            await _app.DisposeAsync();
        }

        Microsoft.Data.Sqlite.SqliteConnection.ClearAllPools();
        foreach (string file in Directory.GetFiles(Path.GetTempPath(), Path.GetFileNameWithoutExtension(_sqlite) + "*"))
        {
            File.Delete(file);
        }
    }

    [Fact]
    public async Task PostParcel_Valid_Returns201WithIdAndTrackingNumber_ThenSlotAndNotificationAppear()
    {
        var response = await Http.PostAsJsonAsync("/parcels", new { destination = "Depot 7, Harbour Road 1" });

        Assert.Equal(HttpStatusCode.Created, response.StatusCode);
        var body = await response.Content.ReadFromJsonAsync<JsonElement>();
        Guid id = body.GetProperty("id").GetGuid();
        Assert.StartsWith("PT", body.GetProperty("trackingNumber").GetString(), StringComparison.Ordinal);
        Assert.Equal($"/parcels/{id}", response.Headers.Location!.OriginalString);

        JsonElement parcel = default;
        for (var clock = System.Diagnostics.Stopwatch.StartNew(); clock.Elapsed < TimeSpan.FromSeconds(30); await Task.Delay(50))
        {
            parcel = await Http.GetFromJsonAsync<JsonElement>($"/parcels/{id}");
            if (parcel.GetProperty("notified").GetBoolean() && parcel.GetProperty("pickupSlot").ValueKind == JsonValueKind.String)
            {
                break;
            }
        }

        Assert.True(parcel.GetProperty("notified").GetBoolean());
        Assert.Equal("Depot 7, Harbour Road 1", parcel.GetProperty("destination").GetString());
        Assert.Matches(@"^\d{4}-\d{2}-\d{2}/\d{2}:00$", parcel.GetProperty("pickupSlot").GetString());
    }

    [Theory]
    [InlineData("""{"destination":""}""", "destination")]
    [InlineData("""{}""", "destination")]
    [InlineData("""{"destination":"Depot 1","trackingNumber":"no spaces allowed"}""", "trackingNumber")]
    public async Task PostParcel_Invalid_Returns400ProblemDetailsNamingTheField(string json, string field)
    {
        var response = await Http.PostAsync("/parcels", new StringContent(json, System.Text.Encoding.UTF8, "application/json"));

        Assert.Equal(HttpStatusCode.BadRequest, response.StatusCode);
        Assert.Equal("application/problem+json", response.Content.Headers.ContentType!.MediaType);
        var problem = await response.Content.ReadFromJsonAsync<JsonElement>();
        Assert.True(problem.GetProperty("errors").TryGetProperty(field, out _), $"the problem names '{field}'");
    }

    [Fact]
    public async Task PostParcel_MalformedJson_Returns400ProblemDetails()
    {
        var response = await Http.PostAsync("/parcels", new StringContent("{not json", System.Text.Encoding.UTF8, "application/json"));

        Assert.Equal(HttpStatusCode.BadRequest, response.StatusCode);
        Assert.Equal("application/problem+json", response.Content.Headers.ContentType!.MediaType);
    }

    [Fact]
    public async Task Health_ReportsTheThreeExactlyOnceChecks()
    {
        var response = await Http.GetAsync("/health");

        Assert.Equal(HttpStatusCode.OK, response.StatusCode);
        var health = await response.Content.ReadFromJsonAsync<JsonElement>();
        Assert.Equal("Healthy", health.GetProperty("status").GetString());
        var checks = health.GetProperty("checks").EnumerateObject().Select(c => c.Name).Order().ToArray();
        Assert.Subset(checks.ToHashSet(), new HashSet<string> { "exactlyonce-cleanup", "exactlyonce-database", "exactlyonce-outbox-backlog" });
        Assert.Contains("masstransit-bus", checks); // MassTransit's own check comes along
    }

    [Fact]
    public async Task Metrics_PrometheusEndpointExposesTheExactlyOnceInstruments()
    {
        var created = await Http.PostAsJsonAsync("/parcels", new { destination = "Depot 3" });
        Guid id = (await created.Content.ReadFromJsonAsync<JsonElement>()).GetProperty("id").GetGuid();
        for (var clock = System.Diagnostics.Stopwatch.StartNew(); clock.Elapsed < TimeSpan.FromSeconds(30); await Task.Delay(50))
        {
            var parcel = await Http.GetFromJsonAsync<JsonElement>($"/parcels/{id}");
            if (parcel.GetProperty("notified").GetBoolean() && parcel.GetProperty("pickupSlot").ValueKind == JsonValueKind.String)
            {
                break;
            }
        }

        string metrics = "";
        for (var clock = System.Diagnostics.Stopwatch.StartNew(); clock.Elapsed < TimeSpan.FromSeconds(30); await Task.Delay(200))
        {
            metrics = await Http.GetStringAsync("/metrics");
            if (metrics.Contains("exactlyonce_inbox_messages_processed", StringComparison.Ordinal)
                && metrics.Contains("exactlyonce_outbox_messages_dispatched", StringComparison.Ordinal))
            {
                break;
            }
        }

        Assert.Contains("exactlyonce_inbox_messages_processed", metrics, StringComparison.Ordinal);
        Assert.Contains("exactlyonce_consumer_name=\"parcel-tracker.carrier-assignment\"", metrics, StringComparison.Ordinal);
        Assert.Contains("exactlyonce_outbox_messages_dispatched", metrics, StringComparison.Ordinal);
        Assert.Contains("exactlyonce_inbox_process_duration_seconds", metrics, StringComparison.Ordinal);
    }

    [Fact]
    public async Task GetParcel_Unknown_Returns404ProblemDetails()
    {
        var response = await Http.GetAsync($"/parcels/{Guid.NewGuid()}");

        Assert.Equal(HttpStatusCode.NotFound, response.StatusCode);
        Assert.Equal("application/problem+json", response.Content.Headers.ContentType!.MediaType);
    }
}
