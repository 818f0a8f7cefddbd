using MassTransit;
using Microsoft.AspNetCore.Diagnostics.HealthChecks;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.Diagnostics.HealthChecks;
using OpenTelemetry.Metrics;
using Microsoft.EntityFrameworkCore.Infrastructure;
using Microsoft.EntityFrameworkCore.Storage;
using Microsoft.Extensions.DependencyInjection.Extensions;
using ParcelTracker.Api;
using ParcelTracker.Consumers;
using ParcelTracker.Data;
using ParcelTracker.OutsideWorld;

namespace ParcelTracker.Hosting;

/// <summary>Builds the application for a set of roles, the way a user of ExactlyOnce wires it.</summary>
public static class ParcelTrackerApp
{
    public static WebApplication Build(Roles roles, string[] args, Action<WebApplicationBuilder>? configure = null)
    {
        var builder = WebApplication.CreateBuilder(new WebApplicationOptions { Args = args, ContentRootPath = AppContext.BaseDirectory });
        builder.Configuration.AddCommandLine(args, new Dictionary<string, string>
        {
            ["--postgres"] = "Postgres",
            ["--rabbitmq"] = "RabbitMq",
            ["--sqlite"] = "Sqlite",
            ["--urls"] = "Urls",
            ["--carrier-honours-keys"] = "CarrierHonoursKeys",
            ["--sms-honours-keys"] = "SmsHonoursKeys",
            ["--carrier-when-unknown"] = "CarrierWhenUnknown",
            ["--crash-rate"] = "CrashRate",
            ["--crash-at"] = "CrashAt",
            ["--crash-times"] = "CrashTimes",
            ["--crash-log"] = "CrashLog",
            ["--crash-gather-ms"] = "CrashGatherMs",
            ["--consumer-concurrency"] = "ConsumerConcurrency",
        });
        builder.Logging.AddSimpleConsole(o => o.SingleLine = true);
        configure?.Invoke(builder);
        var settings = AppSettings.From(builder.Configuration);
        if (!roles.HasFlag(Roles.Api))
        {
            builder.WebHost.UseSetting("urls", "http://127.0.0.1:0");
        }

        var outsideWorld = OutsideWorldSettings.From(builder.Configuration);
        builder.Services.AddSingleton(outsideWorld);
        builder.Services.AddSingleton(CarrierStepPolicy.From(builder.Configuration, outsideWorld));
        builder.Services.AddSingleton(new Chaos(builder.Configuration));
        AddServices(builder.Services, settings, roles);
        var app = builder.Build();
        app.UseExceptionHandler();
        app.UseStatusCodePages();
        if (roles.HasFlag(Roles.Api))
        {
            app.MapParcelEndpoints();
        }

        // Every role answers /health and /metrics (pass --urls to a consumer or worker to reach them).
        app.MapHealthChecks("/health", new HealthCheckOptions { ResponseWriter = WriteHealthAsync });
        app.MapPrometheusScrapingEndpoint();
        return app;
    }

    public static void AddServices(IServiceCollection services, AppSettings settings, Roles roles)
    {
        services.AddSingleton(settings);
        services.TryAddSingleton(new OutsideWorldSettings(CarrierHonoursKeys: true, SmsHonoursKeys: true));
        services.TryAddSingleton(new CarrierStepPolicy("retry"));
        services.TryAddSingleton(new Chaos(new ConfigurationBuilder().Build()));
        services.AddSingleton(TimeProvider.System);
        services.AddProblemDetails();
        services.AddDbContext<ParcelDbContext>(o => UseStore(o, settings, settings.SqliteFile));
        services.AddDbContextFactory<OutsideWorldDbContext>(o => UseStore(o, settings, settings.SqliteOutsideWorldFile), ServiceLifetime.Singleton);
        services.AddSingleton<ICarrierApiClient, RecordingCarrierApiClient>();
        services.AddSingleton<INotificationService, RecordingNotificationService>();
        services.AddHostedService<SchemaInitializer>(); // before the bus: the schema exists before the first message

        services.AddExactlyOnce<ParcelDbContext>();
        if (!settings.UsesPostgres)
        {
            // SQLite has one writer per file and the consumer's transaction holds it: the step journal needs its own file.
            services.AddDbContext<StepJournalDbContext>(o => UseStore(o, settings, settings.SqliteStepJournalFile));
            services.AddExactlyOnceRecordedSteps<StepJournalDbContext>();
        }

        // Executed by the outbox dispatcher (worker role) after the scheduling transaction committed.
        services.AddExactlyOnceAfterCommitAction<ParcelSms, SendParcelSms>(SendParcelSms.Name);
        if (roles.HasFlag(Roles.Worker))
        {
            services.AddExactlyOnceMassTransitOutboxDispatcher();
            services.AddExactlyOnceMaintenance(); // retention cleanup + the gauges' statistics
        }

        services.AddHealthChecks().AddExactlyOnceHealthChecks(includeCleanup: roles.HasFlag(Roles.Worker));
        services.AddOpenTelemetry().WithMetrics(metrics => metrics
            .AddMeter("ExactlyOnce")
            .AddPrometheusExporter());

        services.AddOptions<MassTransitHostOptions>().Configure(o => o.WaitUntilStarted = true);
        services.AddMassTransit(x =>
        {
            if (roles.HasFlag(Roles.Consumer))
            {
                // --consumer-concurrency N: messages each endpoint processes at once (MassTransit's default otherwise).
                int? concurrency = settings.ConsumerConcurrency;
                x.AddConsumer<NotificationConsumer>().Endpoint(e =>
                {
                    e.Name = NotificationConsumer.Queue;
                    e.ConcurrentMessageLimit = concurrency;
                });
                x.AddConsumer<CarrierAssignmentConsumer>().Endpoint(e =>
                {
                    e.Name = CarrierAssignmentConsumer.Queue;
                    e.ConcurrentMessageLimit = concurrency;
                });
            }

            void Configure<TEndpoint>(IBusRegistrationContext context, IBusFactoryConfigurator<TEndpoint> cfg)
                where TEndpoint : IReceiveEndpointConfigurator
            {
                // Long enough to ride out a database or broker restart (about a minute in all) before a message goes to
                // the error queue; each attempt is a fresh scope and inbox transaction.
                if (context.GetRequiredService<Chaos>() is { Enabled: true } chaos)
                {
                    cfg.UseFilter(new ChaosAfterCommitFilter(chaos)); // outermost: runs after the commit, before the ack
                }

                cfg.UseMessageRetry(r => r.Exponential(12, TimeSpan.FromMilliseconds(100), TimeSpan.FromSeconds(10), TimeSpan.FromMilliseconds(300)));
                cfg.UseExactlyOnceInbox(context);  // every consumer runs under the inbox
                cfg.ConfigureEndpoints(context);
            }

            if (settings.UsesRabbitMq)
            {
                x.UsingRabbitMq((context, cfg) =>
                {
                    cfg.Host(new Uri(settings.RabbitMq!));
                    Configure(context, cfg);
                });
            }
            else
            {
                x.UsingInMemory((context, cfg) => Configure(context, cfg));
            }
        });
        services.AddExactlyOnceMassTransitOutbox(); // scoped publishes go into the outbox, with the unit of work
    }

    private static Task WriteHealthAsync(HttpContext context, HealthReport report)
    {
        context.Response.ContentType = "application/json";
        return context.Response.WriteAsJsonAsync(new
        {
            status = report.Status.ToString(),
            checks = report.Entries.ToDictionary(e => e.Key, e => new
            {
                status = e.Value.Status.ToString(),
                description = e.Value.Description,
                data = e.Value.Data,
            }),
        });
    }

    private static void UseStore(DbContextOptionsBuilder options, AppSettings settings, string sqliteFile)
    {
        if (settings.UsesPostgres)
        {
            options.UseNpgsql(settings.Postgres);
        }
        else
        {
            options.UseSqlite($"Data Source={sqliteFile};Default Timeout=30;Pooling=True");
        }
    }
}

/// <summary>Creates the schema on start (retrying while the database is unreachable) and says so in the log.</summary>
internal sealed class SchemaInitializer(IServiceProvider services, AppSettings settings, ILogger<SchemaInitializer> logger) : IHostedService
{
    public async Task StartAsync(CancellationToken cancellationToken)
    {
        for (int attempt = 1; ; attempt++)
        {
            try
            {
                await using var scope = services.CreateAsyncScope();
                var db = scope.ServiceProvider.GetRequiredService<ParcelDbContext>();
                bool created = await db.Database.EnsureCreatedAsync(cancellationToken);
                var outside = await scope.ServiceProvider.GetRequiredService<IDbContextFactory<OutsideWorldDbContext>>().CreateDbContextAsync(cancellationToken);
                await using (outside)
                {
                    if (settings.UsesPostgres)
                    {
                        // Same database as the application: add the stand-ins' tables if they are missing.
                        if (!await TableExistsAsync(outside, "carrier_reservations", cancellationToken))
                        {
                            await outside.GetService<IRelationalDatabaseCreator>().CreateTablesAsync(cancellationToken);
                        }
                    }
                    else
                    {
                        await outside.Database.EnsureCreatedAsync(cancellationToken);
                        await scope.ServiceProvider.GetRequiredService<StepJournalDbContext>().Database.EnsureCreatedAsync(cancellationToken);
                    }
                }

                logger.LogInformation("Schema {State} on {Store}: parcels, inbox_messages, outbox_messages, recorded_steps, carrier_reservations, notifications_sent",
                    created ? "created" : "already present", settings.Describe());
                return;
            }
            catch (Exception exception) when (attempt < 30 && exception is System.Data.Common.DbException or InvalidOperationException or TimeoutException)
            {
                // The innermost error says what failed ("Failed to connect to 127.0.0.1:5432"); EF's wrapper only says "transient".
                logger.LogWarning("Database not reachable or not ready ({Error}); attempt {Attempt}, retrying in 2 s", Causes(exception), attempt);
                await Task.Delay(TimeSpan.FromSeconds(2), cancellationToken);
            }
        }
    }

    public Task StopAsync(CancellationToken cancellationToken) => Task.CompletedTask;

    /// <summary>The inner causes joined ("Failed to connect to 127.0.0.1:5432 → Connection refused"), skipping EF's generic wrapper.</summary>
    private static string Causes(Exception exception)
    {
        var messages = new List<string>();
        for (Exception? e = exception.InnerException ?? exception; e is not null; e = e.InnerException)
        {
            messages.Add(e.Message);
        }

        return string.Join(" → ", messages.Distinct());
    }

    private static async Task<bool> TableExistsAsync(DbContext db, string table, CancellationToken cancellationToken)
    {
        var connection = db.Database.GetDbConnection();
        await db.Database.OpenConnectionAsync(cancellationToken);
        try
        {
            await using var command = connection.CreateCommand();
            command.CommandText = "SELECT to_regclass(@name) IS NOT NULL";
            var parameter = command.CreateParameter();
            parameter.ParameterName = "name";
            parameter.Value = table;
            command.Parameters.Add(parameter);
            return (bool)(await command.ExecuteScalarAsync(cancellationToken))!;
        }
        finally
        {
            await db.Database.CloseConnectionAsync();
        }
    }
}
