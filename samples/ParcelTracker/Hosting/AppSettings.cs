namespace ParcelTracker.Hosting;

/// <summary>Where the application keeps its data and which transport it uses.</summary>
public sealed record AppSettings(string? Postgres, string? RabbitMq, string SqliteFile)
{
    /// <summary>Messages each consumer endpoint processes at once; null for MassTransit's default.</summary>
    public int? ConsumerConcurrency { get; init; }

    public bool UsesPostgres => !string.IsNullOrWhiteSpace(Postgres);

    public bool UsesRabbitMq => !string.IsNullOrWhiteSpace(RabbitMq);

    public string SqliteOutsideWorldFile => Path.ChangeExtension(SqliteFile, null) + "-outside-world.db";

    public string SqliteStepJournalFile => Path.ChangeExtension(SqliteFile, null) + "-steps.db";

    /// <summary>Reads <c>Postgres</c>, <c>RabbitMq</c> and <c>Sqlite</c> from configuration (command line, environment, appsettings).</summary>
    public static AppSettings From(IConfiguration configuration) => new(
        configuration["Postgres"],
        configuration["RabbitMq"],
        configuration["Sqlite"] ?? Path.Combine(Environment.CurrentDirectory, "parceltracker.db"))
    {
        ConsumerConcurrency = configuration.GetValue<int?>("ConsumerConcurrency"),
    };

    /// <summary>A description for logs and reports, without credentials.</summary>
    public string Describe()
    {
        string store = UsesPostgres ? "PostgreSQL " + SafePostgres() : "SQLite " + SqliteFile;
        string transport = UsesRabbitMq ? "RabbitMQ " + new Uri(RabbitMq!).GetComponents(UriComponents.SchemeAndServer | UriComponents.Path, UriFormat.Unescaped) : "in-memory transport";
        return store + " + " + transport;
    }

    private string SafePostgres()
    {
        var builder = new Npgsql.NpgsqlConnectionStringBuilder(Postgres);
        return $"{builder.Host}:{builder.Port}/{builder.Database}";
    }
}
