using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Hosting;
using Microsoft.Extensions.Logging;

namespace ExactlyOnce.TestHost;

/// <summary>Builds hosts wired the way a user would: their DbContext, AddExactlyOnce, AddMassTransit with the inbox.</summary>
public static class TestHosts
{
    public static string PostgresServer =>
        Environment.GetEnvironmentVariable("EXACTLYONCE_TEST_POSTGRES")
        ?? "Host=127.0.0.1;Port=5432;Username=postgres;Password=postgres;Maximum Pool Size=100";

    public static Uri RabbitMq =>
        new(Environment.GetEnvironmentVariable("EXACTLYONCE_TEST_RABBITMQ") ?? "amqp://guest:guest@127.0.0.1:5672/");

    public sealed record Options
    {
        public required Action<DbContextOptionsBuilder> Database { get; init; }
        public bool InMemoryTransport { get; init; }
        public Action<IServiceCollection>? Services { get; init; }
        public Action<ExactlyOnceOptions>? ExactlyOnce { get; init; }
        public required Action<IBusRegistrationConfigurator> Consumers { get; init; }
        public required Action<IBusRegistrationContext, IBusFactoryConfigurator> Endpoints { get; init; }
        public bool InboxOnAllEndpoints { get; init; } = true;
        public LogLevel MinimumLogLevel { get; init; } = LogLevel.Warning;
        public bool Outbox { get; init; }
        public Action<IServiceCollection>? AfterServices { get; init; }
        public bool Dispatcher { get; init; }
    }

    public static IHost Build(Options options)
    {
        var builder = Host.CreateApplicationBuilder(new HostApplicationBuilderSettings { DisableDefaults = true });
        builder.Logging.SetMinimumLevel(options.MinimumLogLevel);
        builder.Logging.AddSimpleConsole(o => o.SingleLine = true);
        // Keep test output readable: the console shows errors only; tests that assert logs add a FakeLogger.
        builder.Logging.AddFilter<Microsoft.Extensions.Logging.Console.ConsoleLoggerProvider>(level => level >= LogLevel.Error);
        // StartAsync returns only once every receive endpoint (and its queue) is ready.
        builder.Services.AddOptions<MassTransitHostOptions>().Configure(o => o.WaitUntilStarted = true);
        builder.Services.AddDbContext<TestDbContext>(options.Database);
        options.Services?.Invoke(builder.Services);
        builder.Services.AddExactlyOnce<TestDbContext>(options.ExactlyOnce);
        builder.Services.AddMassTransit(x =>
        {
            options.Consumers(x);
            if (options.InMemoryTransport)
            {
                x.UsingInMemory((context, cfg) =>
                {
                    if (options.InboxOnAllEndpoints)
                    {
                        cfg.UseExactlyOnceInbox(context);
                    }

                    options.Endpoints(context, cfg);
                });
            }
            else
            {
                x.UsingRabbitMq((context, cfg) =>
                {
                    cfg.Host(RabbitMq);
                    if (options.InboxOnAllEndpoints)
                    {
                        cfg.UseExactlyOnceInbox(context);
                    }

                    options.Endpoints(context, cfg);
                });
            }
        });
        if (options.Outbox)
        {
            builder.Services.AddExactlyOnceMassTransitOutbox();
        }

        if (options.Dispatcher)
        {
            builder.Services.AddExactlyOnceMassTransitOutboxDispatcher();
        }

        options.AfterServices?.Invoke(builder.Services);
        return builder.Build();
    }
}
