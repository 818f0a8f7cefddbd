using ExactlyOnce.TestHost;
using Npgsql;
using RabbitMQ.Client;

namespace ParcelTracker.Tests;

/// <summary>Fresh databases and clean queues on the real services.</summary>
internal static class Services
{
    public static readonly string[] Queues = ["parcel-created-notification", "parcel-created-carrier"];

    public static async Task<string> CreateDatabaseAsync()
    {
        string name = "pt_test_" + Guid.NewGuid().ToString("N")[..12];
        await using var admin = new NpgsqlConnection(TestHosts.PostgresServer + ";Database=postgres");
        await admin.OpenAsync();
        await using var create = new NpgsqlCommand($"CREATE DATABASE \"{name}\"", admin); // generated identifier
        await create.ExecuteNonQueryAsync();
        return TestHosts.PostgresServer + ";Database=" + name;
    }

    public static async Task DropDatabaseAsync(string connectionString)
    {
        string name = new NpgsqlConnectionStringBuilder(connectionString).Database!;
        NpgsqlConnection.ClearAllPools();
        await using var admin = new NpgsqlConnection(TestHosts.PostgresServer + ";Database=postgres");
        await admin.OpenAsync();
        await using var drop = new NpgsqlCommand($"DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)", admin);
        await drop.ExecuteNonQueryAsync();
    }

    /// <summary>The Parcel Tracker's queues are fixed names: start each test with none of them, so no stale message arrives.</summary>
    public static async Task DeleteParcelTrackerQueuesAsync()
    {
        var factory = new ConnectionFactory { Uri = TestHosts.RabbitMq };
        await using var connection = await factory.CreateConnectionAsync();
        await using var channel = await connection.CreateChannelAsync();
        foreach (string queue in Queues.SelectMany(q => new[] { q, q + "_error", q + "_skipped", q + "_parked" }))
        {
            await channel.QueueDeleteAsync(queue);
        }
    }

    /// <summary>Ready messages in <paramref name="queue"/>; 0 when it does not exist (yet).</summary>
    public static async Task<uint> ReadyMessagesAsync(string queue)
    {
        var factory = new ConnectionFactory { Uri = TestHosts.RabbitMq };
        await using var connection = await factory.CreateConnectionAsync();
        await using var channel = await connection.CreateChannelAsync();
        try
        {
            return (await channel.QueueDeclarePassiveAsync(queue)).MessageCount;
        }
        catch (RabbitMQ.Client.Exceptions.OperationInterruptedException)
        {
            return 0;
        }
    }

    public static async Task<long> ScalarAsync(string connectionString, string sql)
    {
        await using var connection = new NpgsqlConnection(connectionString);
        await connection.OpenAsync();
        await using var command = new NpgsqlCommand(sql, connection);
        return Convert.ToInt64(await command.ExecuteScalarAsync(), System.Globalization.CultureInfo.InvariantCulture);
    }
}
